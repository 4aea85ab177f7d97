//! [`FakePhysicalMemory`]: [`PhysicalMemory`] in process, for CPU tests of the pool.
//!
//! It hands out fake addresses and handles and tracks reserved ranges, created chunks,
//! mappings and access, with a physical capacity (creating past it is the driver's
//! out-of-memory error). It is stricter than the driver: everything the pool must never do
//! is a [`VmmError::Misuse`] — mapping over a mapping, mapping a chunk twice, unmapping or
//! setting access on a range that is not whole mappings, releasing a mapped or unknown
//! chunk, freeing a range with mappings in it, sizes off the granularity — so a bookkeeping
//! bug in the pool fails a test instead of passing silently.
//!
//! Mapped memory can be written and read ([`FakePhysicalMemory::write`],
//! [`FakePhysicalMemory::read`]; each chunk keeps its bytes, allocated on first write), so
//! a test can prove that live data survives every operation: a byte that was unmapped or
//! remapped to another chunk reads back wrong or fails. Failures can be injected on the
//! N-th call of any operation ([`FakePhysicalMemory::fail_nth`]); an injected failure
//! changes nothing.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use parking_lot::Mutex;

use crate::error::{OOM_CODE, Result, VmmError};
use crate::physical::{ChunkHandle, PhysicalMemory, VaRange};

/// First fake address handed out (looks like a device address, never 0).
const FAKE_VA_BASE: u64 = 0x7f00_0000_0000;

/// The operations of [`PhysicalMemory`], for failure injection and call counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FakeOp {
    /// `reserve` (`cuMemAddressReserve`).
    Reserve,
    /// `free_range` (`cuMemAddressFree`).
    FreeRange,
    /// `create` (`cuMemCreate`).
    Create,
    /// `release` (`cuMemRelease`).
    Release,
    /// `map` (`cuMemMap`).
    Map,
    /// `unmap` (`cuMemUnmap`).
    Unmap,
    /// `set_access` (`cuMemSetAccess`).
    SetAccess,
}

impl FakeOp {
    /// Every operation.
    pub const ALL: [FakeOp; 7] = [
        FakeOp::Reserve,
        FakeOp::FreeRange,
        FakeOp::Create,
        FakeOp::Release,
        FakeOp::Map,
        FakeOp::Unmap,
        FakeOp::SetAccess,
    ];

    /// The driver call it stands for.
    pub const fn call(self) -> &'static str {
        match self {
            FakeOp::Reserve => "cuMemAddressReserve",
            FakeOp::FreeRange => "cuMemAddressFree",
            FakeOp::Create => "cuMemCreate",
            FakeOp::Release => "cuMemRelease",
            FakeOp::Map => "cuMemMap",
            FakeOp::Unmap => "cuMemUnmap",
            FakeOp::SetAccess => "cuMemSetAccess",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

struct FakeChunk {
    bytes: u64,
    mapped_at: Option<u64>,
    data: Option<Vec<u8>>,
}

struct FakeMapping {
    handle: u64,
    bytes: u64,
    access: bool,
}

#[derive(Default)]
struct FakeState {
    next_va: u64,
    next_handle: u64,
    reservations: BTreeMap<u64, u64>,
    chunks: HashMap<u64, FakeChunk>,
    created_bytes: u64,
    mappings: BTreeMap<u64, FakeMapping>,
    calls: [u64; FakeOp::ALL.len()],
    /// (op, call number) pairs that fail.
    failures: Vec<(FakeOp, u64)>,
}

impl FakeState {
    /// Counts a call of `op` and fails it if it was scheduled to fail.
    fn enter(&mut self, op: FakeOp) -> Result<()> {
        self.calls[op.index()] += 1;
        let nth = self.calls[op.index()];
        if let Some(i) = self.failures.iter().position(|&f| f == (op, nth)) {
            self.failures.swap_remove(i);
            return Err(VmmError::Injected {
                call: op.call(),
                nth,
            });
        }
        Ok(())
    }

    /// The reservation holding `va..va + len`.
    fn reservation_of(&self, va: u64, len: u64) -> Option<VaRange> {
        let (&base, &rlen) = self.reservations.range(..=va).next_back()?;
        let r = VaRange { base, len: rlen };
        r.contains(va, len).then_some(r)
    }

    /// The mapping holding address `va`: (its start, mapping).
    fn mapping_at(&self, va: u64) -> Option<(u64, &FakeMapping)> {
        let (&start, m) = self.mappings.range(..=va).next_back()?;
        (va < start + m.bytes).then_some((start, m))
    }

    /// Checks that every byte of `va..va + len` is mapped with access.
    fn check_accessible(&self, va: u64, len: u64) -> Result<()> {
        let misuse = |message: String| VmmError::Misuse {
            call: "device access",
            message,
        };
        let end = va
            .checked_add(len)
            .ok_or_else(|| misuse(format!("range {va:#x}+{len} overflows")))?;
        let mut at = va;
        while at < end {
            match self.mapping_at(at) {
                Some((start, m)) if m.access => at = start + m.bytes,
                Some((start, _)) => {
                    return Err(misuse(format!(
                        "{at:#x} is mapped (at {start:#x}) without access: a kernel would fault"
                    )));
                }
                None => {
                    return Err(misuse(format!(
                        "{at:#x} is not mapped: a kernel would fault"
                    )));
                }
            }
        }
        Ok(())
    }

    /// The starts of the whole mappings that exactly tile `va..va + len`, or why not.
    fn whole_mappings(&self, va: u64, len: u64) -> std::result::Result<Vec<u64>, String> {
        if len == 0 {
            return Err("empty range".into());
        }
        let mut starts = Vec::new();
        let mut at = va;
        let end = va + len;
        while at < end {
            match self.mappings.get(&at) {
                Some(m) => {
                    starts.push(at);
                    at += m.bytes;
                }
                None => {
                    return Err(match self.mapping_at(at) {
                        Some((s, _)) => format!(
                            "{at:#x} is inside the mapping at {s:#x}, not at its start: only whole mappings \
                             may be unmapped or given access"
                        ),
                        None => format!("{at:#x} is not mapped"),
                    });
                }
            }
        }
        if at != end {
            return Err(format!(
                "the range ends at {end:#x} inside the mapping that ends at {at:#x}"
            ));
        }
        Ok(starts)
    }
}

/// An in-process stand-in for the CUDA driver's virtual memory calls.
pub struct FakePhysicalMemory {
    granularity: u64,
    capacity: u64,
    state: Mutex<FakeState>,
}

impl FakePhysicalMemory {
    /// A fake device with allocation granularity `granularity` (a power of two, at least
    /// 512) and `capacity` bytes of physical memory.
    pub fn new(granularity: u64, capacity: u64) -> Self {
        Self {
            granularity,
            capacity,
            state: Mutex::new(FakeState {
                next_va: FAKE_VA_BASE,
                next_handle: 1,
                ..FakeState::default()
            }),
        }
    }

    /// Makes the `n`-th call of `op` from now fail (`n = 1`: the next one), once, with
    /// [`VmmError::Injected`] and no effect.
    pub fn fail_nth(&self, op: FakeOp, n: u64) {
        let mut st = self.state.lock();
        let at = st.calls[op.index()] + n.max(1);
        st.failures.push((op, at));
    }

    /// Cancels every scheduled failure.
    pub fn clear_failures(&self) {
        self.state.lock().failures.clear();
    }

    /// How many times `op` was called (failed calls included).
    pub fn calls(&self, op: FakeOp) -> u64 {
        self.state.lock().calls[op.index()]
    }

    /// Chunks created and not yet released.
    pub fn chunks(&self) -> usize {
        self.state.lock().chunks.len()
    }

    /// Bytes of chunks created and not yet released.
    pub fn created_bytes(&self) -> u64 {
        self.state.lock().created_bytes
    }

    /// Ranges reserved and not yet freed.
    pub fn reservations(&self) -> usize {
        self.state.lock().reservations.len()
    }

    /// Every mapping as `(va, bytes, access)`, in address order.
    pub fn mappings(&self) -> Vec<(u64, u64, bool)> {
        self.state
            .lock()
            .mappings
            .iter()
            .map(|(&va, m)| (va, m.bytes, m.access))
            .collect()
    }

    /// Bytes mapped.
    pub fn mapped_bytes(&self) -> u64 {
        self.state.lock().mappings.values().map(|m| m.bytes).sum()
    }

    /// Checks that every byte of `va..va + len` is mapped with access.
    pub fn check_accessible(&self, va: u64, len: u64) -> Result<()> {
        self.state.lock().check_accessible(va, len)
    }

    /// Writes `bytes` at `va` (every byte must be mapped with access), as a kernel would.
    pub fn write(&self, va: u64, bytes: &[u8]) -> Result<()> {
        let mut st = self.state.lock();
        st.check_accessible(va, bytes.len() as u64)?;
        let mut done = 0usize;
        while done < bytes.len() {
            let at = va + done as u64;
            let Some((start, m)) = st.mapping_at(at) else {
                break; // unreachable: checked above under the same lock
            };
            let (handle, mbytes) = (m.handle, m.bytes);
            let off = (at - start) as usize;
            let n = (mbytes as usize - off).min(bytes.len() - done);
            let Some(chunk) = st.chunks.get_mut(&handle) else {
                break; // unreachable: a mapping's chunk exists
            };
            let size = chunk.bytes as usize;
            let data = chunk.data.get_or_insert_with(|| vec![0; size]);
            data[off..off + n].copy_from_slice(&bytes[done..done + n]);
            done += n;
        }
        Ok(())
    }

    /// Reads `len` bytes at `va` (every byte must be mapped with access).
    pub fn read(&self, va: u64, len: u64) -> Result<Vec<u8>> {
        let st = self.state.lock();
        st.check_accessible(va, len)?;
        let mut out = Vec::with_capacity(len as usize);
        while (out.len() as u64) < len {
            let at = va + out.len() as u64;
            let Some((start, m)) = st.mapping_at(at) else {
                break; // unreachable: checked above under the same lock
            };
            let off = (at - start) as usize;
            let n = (m.bytes as usize - off).min(len as usize - out.len());
            match st.chunks.get(&m.handle).and_then(|c| c.data.as_ref()) {
                Some(d) => out.extend_from_slice(&d[off..off + n]),
                None => out.resize(out.len() + n, 0),
            }
        }
        Ok(out)
    }

    fn misuse(op: FakeOp, message: String) -> VmmError {
        VmmError::Misuse {
            call: op.call(),
            message,
        }
    }

    fn check_granular(&self, op: FakeOp, what: &str, value: u64) -> Result<()> {
        if !value.is_multiple_of(self.granularity) {
            return Err(Self::misuse(
                op,
                format!(
                    "{what} {value:#x} is not a multiple of the granularity {}",
                    self.granularity
                ),
            ));
        }
        Ok(())
    }
}

impl fmt::Debug for FakePhysicalMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.state.lock();
        write!(
            f,
            "FakePhysicalMemory(granularity {} B, {} of {} B created, {} mapping(s), {} reservation(s))",
            self.granularity,
            st.created_bytes,
            self.capacity,
            st.mappings.len(),
            st.reservations.len()
        )
    }
}

impl PhysicalMemory for FakePhysicalMemory {
    fn granularity(&self) -> u64 {
        self.granularity
    }

    fn reserve(&self, bytes: u64) -> Result<VaRange> {
        let op = FakeOp::Reserve;
        let mut st = self.state.lock();
        st.enter(op)?;
        if bytes == 0 {
            return Err(Self::misuse(op, "reserving 0 bytes".into()));
        }
        self.check_granular(op, "size", bytes)?;
        let base = st.next_va;
        // Leave a gap of one granule between reservations, so adjacency bugs show.
        st.next_va = base
            .checked_add(bytes + self.granularity)
            .ok_or_else(|| Self::misuse(op, "fake address space exhausted".into()))?;
        st.reservations.insert(base, bytes);
        Ok(VaRange { base, len: bytes })
    }

    fn free_range(&self, range: VaRange) -> Result<()> {
        let op = FakeOp::FreeRange;
        let mut st = self.state.lock();
        st.enter(op)?;
        if st.reservations.get(&range.base) != Some(&range.len) {
            return Err(Self::misuse(
                op,
                format!("{:#x}+{} is not a reserved range", range.base, range.len),
            ));
        }
        if let Some((&va, _)) = st.mappings.range(range.base..range.end()).next() {
            return Err(Self::misuse(
                op,
                format!(
                    "freeing range {:#x}+{} while {va:#x} is still mapped",
                    range.base, range.len
                ),
            ));
        }
        st.reservations.remove(&range.base);
        Ok(())
    }

    fn create(&self, bytes: u64) -> Result<ChunkHandle> {
        let op = FakeOp::Create;
        let mut st = self.state.lock();
        st.enter(op)?;
        if bytes == 0 {
            return Err(Self::misuse(op, "creating a chunk of 0 bytes".into()));
        }
        self.check_granular(op, "size", bytes)?;
        if st.created_bytes + bytes > self.capacity {
            return Err(VmmError::Driver {
                call: op.call(),
                code: OOM_CODE.to_string(),
                message: format!(
                    "out of memory (fake: {} of {} B created)",
                    st.created_bytes, self.capacity
                ),
            });
        }
        let raw = st.next_handle;
        st.next_handle += 1;
        st.created_bytes += bytes;
        st.chunks.insert(
            raw,
            FakeChunk {
                bytes,
                mapped_at: None,
                data: None,
            },
        );
        Ok(ChunkHandle::from_raw(raw, bytes))
    }

    fn release(&self, chunk: ChunkHandle) -> Result<()> {
        let op = FakeOp::Release;
        let mut st = self.state.lock();
        st.enter(op)?;
        match st.chunks.get(&chunk.raw()) {
            None => Err(Self::misuse(
                op,
                format!(
                    "chunk {} is unknown (released twice, or never created)",
                    chunk.raw()
                ),
            )),
            Some(c) if c.bytes != chunk.bytes() => Err(Self::misuse(
                op,
                format!(
                    "chunk {} is {} B, the handle says {} B",
                    chunk.raw(),
                    c.bytes,
                    chunk.bytes()
                ),
            )),
            Some(FakeChunk {
                mapped_at: Some(va),
                ..
            }) => Err(Self::misuse(
                op,
                format!(
                    "releasing chunk {} while it is mapped at {va:#x}",
                    chunk.raw()
                ),
            )),
            Some(c) => {
                let bytes = c.bytes;
                st.chunks.remove(&chunk.raw());
                st.created_bytes -= bytes;
                Ok(())
            }
        }
    }

    fn map(&self, va: u64, chunk: &ChunkHandle) -> Result<()> {
        let op = FakeOp::Map;
        let mut st = self.state.lock();
        st.enter(op)?;
        self.check_granular(op, "address", va)?;
        let bytes = match st.chunks.get(&chunk.raw()) {
            None => {
                return Err(Self::misuse(
                    op,
                    format!("chunk {} is unknown", chunk.raw()),
                ));
            }
            Some(FakeChunk {
                mapped_at: Some(at),
                ..
            }) => {
                return Err(Self::misuse(
                    op,
                    format!(
                        "chunk {} is already mapped at {at:#x} (the pool maps each chunk once)",
                        chunk.raw()
                    ),
                ));
            }
            Some(c) => c.bytes,
        };
        if st.reservation_of(va, bytes).is_none() {
            return Err(Self::misuse(
                op,
                format!("{va:#x}+{bytes} is not inside a reserved range"),
            ));
        }
        if let Some((s, _)) = st.mapping_at(va) {
            return Err(Self::misuse(
                op,
                format!("double map: {va:#x} is already mapped (mapping at {s:#x})"),
            ));
        }
        if let Some((&s, _)) = st.mappings.range(va..va + bytes).next() {
            return Err(Self::misuse(
                op,
                format!("double map: {va:#x}+{bytes} overlaps the mapping at {s:#x}"),
            ));
        }
        st.mappings.insert(
            va,
            FakeMapping {
                handle: chunk.raw(),
                bytes,
                access: false,
            },
        );
        if let Some(c) = st.chunks.get_mut(&chunk.raw()) {
            c.mapped_at = Some(va);
        }
        Ok(())
    }

    fn unmap(&self, va: u64, bytes: u64) -> Result<()> {
        let op = FakeOp::Unmap;
        let mut st = self.state.lock();
        st.enter(op)?;
        let starts = st
            .whole_mappings(va, bytes)
            .map_err(|m| Self::misuse(op, format!("unmapping {va:#x}+{bytes}: {m}")))?;
        for s in starts {
            if let Some(m) = st.mappings.remove(&s)
                && let Some(c) = st.chunks.get_mut(&m.handle)
            {
                c.mapped_at = None;
            }
        }
        Ok(())
    }

    fn set_access(&self, va: u64, bytes: u64) -> Result<()> {
        let op = FakeOp::SetAccess;
        let mut st = self.state.lock();
        st.enter(op)?;
        let starts = st
            .whole_mappings(va, bytes)
            .map_err(|m| Self::misuse(op, format!("access to {va:#x}+{bytes}: {m}")))?;
        for s in starts {
            if let Some(m) = st.mappings.get_mut(&s) {
                m.access = true;
            }
        }
        Ok(())
    }

    fn mem_info(&self) -> Option<(u64, u64)> {
        let st = self.state.lock();
        Some((self.capacity - st.created_bytes, self.capacity))
    }
}
