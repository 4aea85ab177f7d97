//! The allocator's strict in-process fakes: [`FakeMemory`] (device memory from a counter,
//! with a capacity and injected failures) and [`FakeEvent`] (an event completed by hand), on
//! which every rule of the caching allocator is tested without a GPU.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

use super::{FreeEvent, RawAllocError, RawMemory};
use crate::error::{CudaError, Result};

/// In-process fake device memory: hands out addresses from a counter (segments are
/// adjacent, so merging across segments would show), tracks live ranges, refuses past a
/// capacity, and can be told to fail.
#[derive(Debug)]
pub struct FakeMemory {
    state: Mutex<FakeState>,
}

#[derive(Debug)]
struct FakeState {
    next: u64,
    capacity: u64,
    live: BTreeMap<u64, u64>,
    fail_next: u32,
    bad_frees: u64,
}

impl FakeMemory {
    /// A fake device of `capacity` bytes.
    pub fn new(capacity: u64) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(FakeState {
                next: 0x7f00_0000_0000,
                capacity,
                live: BTreeMap::new(),
                fail_next: 0,
                bad_frees: 0,
            }),
        })
    }

    /// The next `n` allocations fail with out-of-memory, whatever the capacity.
    pub fn fail_next(&self, n: u32) {
        self.state.lock().fail_next = n;
    }

    /// Injected failures not yet used.
    pub fn pending_failures(&self) -> u32 {
        self.state.lock().fail_next
    }

    /// Bytes in live segments.
    pub fn live_bytes(&self) -> u64 {
        self.state.lock().live.values().sum()
    }

    /// Live segments as (address, size).
    pub fn live_segments(&self) -> Vec<(u64, u64)> {
        self.state
            .lock()
            .live
            .iter()
            .map(|(a, s)| (*a, *s))
            .collect()
    }

    /// The capacity.
    pub fn capacity(&self) -> u64 {
        self.state.lock().capacity
    }

    /// Frees of addresses that were not live (double or foreign frees).
    pub fn bad_frees(&self) -> u64 {
        self.state.lock().bad_frees
    }
}

impl RawMemory for FakeMemory {
    fn alloc(&self, bytes: u64) -> std::result::Result<u64, RawAllocError> {
        let mut st = self.state.lock();
        let used: u64 = st.live.values().sum();
        if st.fail_next > 0 {
            st.fail_next -= 1;
            return Err(RawAllocError::OutOfMemory);
        }
        if used + bytes > st.capacity {
            return Err(RawAllocError::OutOfMemory);
        }
        let ptr = st.next;
        st.next += bytes;
        st.live.insert(ptr, bytes);
        Ok(ptr)
    }

    fn free(&self, ptr: u64) -> Result<()> {
        let mut st = self.state.lock();
        if st.live.remove(&ptr).is_none() {
            st.bad_frees += 1;
            return Err(CudaError::Core(ddo_core::CoreError::Backend {
                device: "fake".into(),
                message: format!("free of {ptr:#x}, which is not a live segment"),
            }));
        }
        Ok(())
    }

    fn free_bytes(&self) -> Option<u64> {
        let st = self.state.lock();
        Some(st.capacity - st.live.values().sum::<u64>())
    }
}

/// A fake free event: complete when told (or when waited on, which stands for blocking
/// until the device gets there).
#[derive(Debug, Clone, Default)]
pub struct FakeEvent(Arc<AtomicBool>);

impl FakeEvent {
    /// A pending event.
    pub fn new() -> Self {
        Self::default()
    }

    /// Marks the event complete.
    pub fn complete(&self) {
        self.0.store(true, Ordering::Release);
    }

    /// Whether it is complete.
    pub fn is_done(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

impl FreeEvent for FakeEvent {
    fn is_complete(&self) -> Result<bool> {
        Ok(self.is_done())
    }
    fn wait(&self) -> Result<()> {
        self.complete();
        Ok(())
    }
}
