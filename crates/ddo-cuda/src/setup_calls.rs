//! The process's first-call counters ([`ddo_core::Device::setup_calls`]): cuBLASLt plans built
//! on the calling thread, time calls waited for cuDNN plans built in the background, and
//! NVRTC kernel modules loaded (compiled first where no cache held them), and segments the
//! caching allocator took from the driver. Cumulative over
//! every CUDA device of the process; a phase reports the difference across it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use ddo_core::SetupCalls;

static PLANS_BUILT: AtomicU64 = AtomicU64::new(0);
static PLAN_BUILD_NS: AtomicU64 = AtomicU64::new(0);
static PLAN_WAIT_NS: AtomicU64 = AtomicU64::new(0);
static KERNEL_LOADS: AtomicU64 = AtomicU64::new(0);
static KERNEL_LOAD_NS: AtomicU64 = AtomicU64::new(0);
static DEVICE_ALLOCS: AtomicU64 = AtomicU64::new(0);
static DEVICE_ALLOC_NS: AtomicU64 = AtomicU64::new(0);

fn ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// A library plan was built on the calling thread in `took`.
pub(crate) fn plan_built(took: Duration) {
    PLANS_BUILT.fetch_add(1, Ordering::Relaxed);
    PLAN_BUILD_NS.fetch_add(ns(took), Ordering::Relaxed);
}

/// A call waited `took` for a plan being built in the background.
pub(crate) fn plan_waited(took: Duration) {
    PLAN_WAIT_NS.fetch_add(ns(took), Ordering::Relaxed);
}

/// A kernel module was loaded (and compiled, if no cache held it) in `took`.
pub(crate) fn kernel_loaded(took: Duration) {
    KERNEL_LOADS.fetch_add(1, Ordering::Relaxed);
    KERNEL_LOAD_NS.fetch_add(ns(took), Ordering::Relaxed);
}

/// The caching allocator took a segment from the driver in `took`.
pub(crate) fn device_alloc(took: Duration) {
    DEVICE_ALLOCS.fetch_add(1, Ordering::Relaxed);
    DEVICE_ALLOC_NS.fetch_add(ns(took), Ordering::Relaxed);
}

/// The counters now.
pub(crate) fn now() -> SetupCalls {
    SetupCalls {
        plans_built: PLANS_BUILT.load(Ordering::Relaxed),
        plan_build_ns: PLAN_BUILD_NS.load(Ordering::Relaxed),
        plan_wait_ns: PLAN_WAIT_NS.load(Ordering::Relaxed),
        kernel_loads: KERNEL_LOADS.load(Ordering::Relaxed),
        kernel_load_ns: KERNEL_LOAD_NS.load(Ordering::Relaxed),
        device_allocs: DEVICE_ALLOCS.load(Ordering::Relaxed),
        device_alloc_ns: DEVICE_ALLOC_NS.load(Ordering::Relaxed),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each record adds to its own counters only (other tests may record meanwhile, so the
    /// check is on lower bounds).
    #[test]
    fn records_add_to_their_counters() {
        let before = now();
        plan_built(Duration::from_micros(5));
        plan_waited(Duration::from_micros(7));
        kernel_loaded(Duration::from_micros(11));
        device_alloc(Duration::from_micros(13));
        let d = now().since(&before);
        assert!(d.plans_built >= 1 && d.plan_build_ns >= 5_000);
        assert!(d.plan_wait_ns >= 7_000);
        assert!(d.kernel_loads >= 1 && d.kernel_load_ns >= 11_000);
        assert!(d.device_allocs >= 1 && d.device_alloc_ns >= 13_000);
    }
}
