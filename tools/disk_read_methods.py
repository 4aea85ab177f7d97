#!/usr/bin/env python3
"""The disk's read rate by method, for the disk tier's reader (issue 35).

With 8 GiB available, a FLUX.1-dev step reads 10.2 GiB from the disk at 1.55 GB/s while
`dd` (16 MiB O_DIRECT reads, one reader) measures 1.8-2.1 GB/s beside it. This reads one
file, the page cache dropped before each method (run as root), in the ways a reader can:

    python3 tools/disk_read_methods.py FILE [GIB_PER_METHOD] [OUT.json]

- `madvise WILLNEED` windows of 768 MiB on a mapping, then a copy out of the pages (DDO's
  disk tier today: read-ahead advice on a thread, `pread` of the cached pages, pages dropped);
- buffered `pread` of 16 MiB, 1 and 4 threads;
- `O_DIRECT` `pread` of 4, 16 and 64 MiB, 1, 2, 4 and 8 threads.

Each method reads a different part of the file when it is long enough.
"""
import json
import mmap
import os
import sys
import threading
import time


def drop_caches():
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def aligned_buffer(n):
    # An anonymous mapping is page-aligned: what O_DIRECT needs.
    return mmap.mmap(-1, n)


def run_threads(threads, chunk, start, total, read_one):
    """Reads [start, start+total) in `chunk`-byte pieces handed out in order to `threads`."""
    lock = threading.Lock()
    state = {"next": start}
    end = start + total

    def worker():
        buf = aligned_buffer(chunk)
        while True:
            with lock:
                off = state["next"]
                if off >= end:
                    return
                state["next"] = off + chunk
            read_one(buf, off, min(chunk, end - off))

    t0 = time.perf_counter()
    ts = [threading.Thread(target=worker) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return total / (time.perf_counter() - t0)


def main():
    path = sys.argv[1]
    gib = float(sys.argv[2]) if len(sys.argv) > 2 else 1.5
    out = sys.argv[3] if len(sys.argv) > 3 else None
    size = os.path.getsize(path)
    per = int(gib * (1 << 30)) // (64 << 20) * (64 << 20)
    results = []
    slot = {"at": 0}

    def region():
        # A fresh part of the file for each method, wrapping.
        if slot["at"] + per > size:
            slot["at"] = 0
        r = slot["at"]
        slot["at"] += per
        return r

    def record(name, rate):
        results.append({"method": name, "gb_per_s": rate / 1e9})
        print("%-40s %.2f GB/s" % (name, rate / 1e9), flush=True)

    # DDO's disk tier today: advice ahead on one thread, the pages copied out behind it.
    drop_caches()
    fd = os.open(path, os.O_RDONLY)
    m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    start = region()
    window = 768 << 20
    page = mmap.PAGESIZE
    t0 = time.perf_counter()
    advised = start
    dst = bytearray(16 << 20)
    off = start
    while off < start + per:
        while advised < min(off + window, start + per):
            n = min(64 << 20, start + per - advised)
            m.madvise(mmap.MADV_WILLNEED, advised - advised % page, n)
            advised += n
        n = min(len(dst), start + per - off)
        dst[:n] = m[off:off + n]
        off += n
    record("madvise WILLNEED 768 MiB + copy", per / (time.perf_counter() - t0))
    m.close()
    os.close(fd)

    for threads in (1, 4):
        drop_caches()
        fd = os.open(path, os.O_RDONLY)
        rate = run_threads(threads, 16 << 20, region(), per, lambda b, o, n: os.preadv(fd, [memoryview(b)[:n]], o))
        os.close(fd)
        record("buffered pread 16 MiB x%d" % threads, rate)

    for chunk_mib in (4, 16, 64):
        for threads in (1, 2, 4, 8):
            drop_caches()
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            rate = run_threads(threads, chunk_mib << 20, region(), per,
                               lambda b, o, n: os.preadv(fd, [memoryview(b)[:n]], o))
            os.close(fd)
            record("O_DIRECT pread %d MiB x%d" % (chunk_mib, threads), rate)

    queue = {}
    for dev in os.listdir("/sys/block"):
        q = "/sys/block/%s/queue" % dev
        try:
            queue[dev] = {k: open(os.path.join(q, k)).read().strip()
                          for k in ("read_ahead_kb", "max_sectors_kb", "nr_requests", "rotational")}
        except OSError:
            pass
    print(json.dumps(queue))
    if out:
        with open(out, "w") as f:
            json.dump({"file": path, "bytes_per_method": per, "results": results, "queues": queue}, f, indent=1)


if __name__ == "__main__":
    main()
