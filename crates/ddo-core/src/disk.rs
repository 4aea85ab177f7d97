//! The disk's read rate for the weights' files (issue 35): the fourth tier's speed, measured
//! as `ddo bench` measures the link.
//!
//! A probe reads up to a cap of the files' bytes, spread over every file in order, in
//! [`DISK_CHUNK`] reads. It reads with `O_DIRECT` where the file system allows it, which
//! bypasses the page cache, so the figure is the disk's own and needs no root. Elsewhere
//! (tmpfs, some network file systems) it reads through the page cache after asking the
//! kernel to drop the file's clean pages (`POSIX_FADV_DONTNEED`), and says so. Pages another
//! process holds mapped stay cached, so that figure can be the page cache's. Reads are spread
//! over `readers` threads, each taking the next chunk, as a threaded reader of the weights
//! would.

use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use serde::Serialize;

use crate::error::{CoreError, Result};
use crate::host_memory::AlignedBytes;

/// The size of one read: 16 MiB (the issue's `dd` figure used the same).
pub const DISK_CHUNK: usize = 16 << 20;

/// The alignment `O_DIRECT` asks of offsets, lengths and buffers on Linux's block devices.
const DIRECT_ALIGN: u64 = 4096;

/// What a probe measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DiskRate {
    /// Bytes read.
    pub bytes: u64,
    /// Seconds the reads took, first to last.
    pub seconds: f64,
    /// `bytes / seconds`.
    pub bytes_per_sec: f64,
    /// Threads that read.
    pub readers: usize,
    /// Whether every file was read with `O_DIRECT` (else through the page cache after
    /// `POSIX_FADV_DONTNEED`).
    pub direct: bool,
    /// Files read from.
    pub files: usize,
}

/// One chunk to read: file index, offset, length.
type Chunk = (usize, u64, usize);

/// Reads up to `max_bytes` of `files` on `readers` threads and returns the rate. An empty
/// list, a file that cannot be opened or read, or nothing to read is a typed error naming
/// the file.
pub fn probe_read_rate(files: &[PathBuf], max_bytes: u64, readers: usize) -> Result<DiskRate> {
    let readers = readers.max(1);
    let mut opened = Vec::with_capacity(files.len());
    let mut direct = true;
    for path in files {
        let (file, is_direct) = open_cold(path)?;
        direct &= is_direct;
        let len = file.metadata().map_err(|e| io_error(path, e))?.len();
        opened.push((path.clone(), file, len));
    }
    let chunks = plan_chunks(
        &opened.iter().map(|(_, _, len)| *len).collect::<Vec<_>>(),
        max_bytes,
    );
    if chunks.is_empty() {
        return Err(CoreError::InvalidOption {
            option: "disk probe".into(),
            value: format!("{} file(s)", files.len()),
            hint: "nothing to read: give the weights' files (a --weights folder or single files)"
                .into(),
        });
    }
    let next = AtomicUsize::new(0);
    let started = Instant::now();
    let results: Vec<Result<u64>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..readers)
            .map(|_| {
                s.spawn(|| -> Result<u64> {
                    let mut buffer = AlignedBytes::zeroed_committed(DISK_CHUNK);
                    let mut read = 0u64;
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&(f, offset, len)) = chunks.get(i) else {
                            return Ok(read);
                        };
                        let (path, file, _) = &opened[f];
                        read += read_fully(file, path, offset, len, buffer.as_mut_slice())?;
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(CoreError::Panicked {
                        context: "reading the weights' files (disk probe)".into(),
                        message: "a reader thread panicked".into(),
                    })
                })
            })
            .collect()
    });
    let seconds = started.elapsed().as_secs_f64().max(1e-9);
    let mut bytes = 0;
    for r in results {
        bytes += r?;
    }
    Ok(DiskRate {
        bytes,
        seconds,
        bytes_per_sec: bytes as f64 / seconds,
        readers,
        direct,
        files: files.len(),
    })
}

/// The chunks of files of `lens` bytes, in file order, until `max_bytes` are planned; each
/// chunk starts at an aligned offset and is at most [`DISK_CHUNK`] long (a file's last
/// chunk may be shorter).
fn plan_chunks(lens: &[u64], max_bytes: u64) -> Vec<Chunk> {
    let mut chunks = Vec::new();
    let mut planned = 0u64;
    for (f, &len) in lens.iter().enumerate() {
        let mut offset = 0u64;
        while offset < len && planned < max_bytes {
            let take = (len - offset)
                .min(DISK_CHUNK as u64)
                .min(max_bytes - planned)
                .max(1);
            chunks.push((f, offset, take as usize));
            planned += take;
            offset += take;
        }
    }
    chunks
}

/// Opens `path` to be read cold: `O_DIRECT` where allowed, else plainly with its cached
/// pages dropped. Returns the file and whether it is direct.
fn open_cold(path: &Path) -> Result<(File, bool)> {
    if let Ok(f) = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
    {
        return Ok((f, true));
    }
    let f = File::open(path).map_err(|e| io_error(path, e))?;
    crate::host_memory::drop_file_cache(&f);
    Ok((f, false))
}

/// Reads `len` bytes at `offset` into `buf` (a [`DISK_CHUNK`] buffer; fewer only at the end
/// of the file). Under `O_DIRECT` each read asks for a whole number of aligned blocks, which
/// the buffer holds; the file's end cuts it.
fn read_fully(file: &File, path: &Path, offset: u64, len: usize, buf: &mut [u8]) -> Result<u64> {
    let aligned = ((len as u64).div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN) as usize;
    let end = aligned.min(buf.len());
    let mut done = 0usize;
    while done < len {
        match file.read_at(&mut buf[done..end], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_error(path, e)),
        }
    }
    Ok(done.min(len) as u64)
}

/// The crate's one error for a file that cannot be read ([`CoreError::Io`]).
fn io_error(path: &Path, source: std::io::Error) -> CoreError {
    CoreError::Io {
        path: path.to_path_buf(),
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_files_in_order_up_to_the_cap() {
        let c = plan_chunks(&[40 << 20, 5, 0, 20 << 20], u64::MAX);
        let lens: Vec<usize> = c.iter().map(|x| x.2).collect();
        assert_eq!(lens, [16 << 20, 16 << 20, 8 << 20, 5, 16 << 20, 4 << 20]);
        assert_eq!(c[3], (1, 0, 5));
        assert!(c.iter().all(|&(_, o, _)| o % DIRECT_ALIGN == 0));
        let capped = plan_chunks(&[40 << 20, 20 << 20], 20 << 20);
        assert_eq!(capped.iter().map(|x| x.2 as u64).sum::<u64>(), 20 << 20);
        assert!(plan_chunks(&[], 1 << 30).is_empty());
    }

    #[test]
    fn a_probe_reads_every_byte_it_plans_and_names_a_missing_file() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a.safetensors");
        let b = dir.path().join("b.safetensors");
        std::fs::write(&a, vec![7u8; (17 << 20) + 3]).unwrap();
        std::fs::write(&b, vec![9u8; 4097]).unwrap();
        let r = probe_read_rate(&[a.clone(), b], u64::MAX, 3).unwrap();
        assert_eq!(r.bytes, (17 << 20) + 3 + 4097);
        assert_eq!((r.readers, r.files), (3, 2));
        assert!(r.bytes_per_sec > 0.0);
        let capped = probe_read_rate(std::slice::from_ref(&a), 1 << 20, 1).unwrap();
        assert_eq!(capped.bytes, 1 << 20);
        let missing = dir.path().join("nope.safetensors");
        let e = probe_read_rate(&[missing], u64::MAX, 1).unwrap_err();
        assert!(e.to_string().contains("nope.safetensors"), "{e}");
        assert!(probe_read_rate(&[], u64::MAX, 1).is_err());
    }
}
