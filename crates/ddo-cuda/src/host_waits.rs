//! The process's long host calls into CUDA ([`ddo_core::Device::host_waits_since`]): each
//! call to the driver or a library that may hold the calling thread on the device (a
//! synchronisation, a copy, a kernel launch, a library's matmul or graph execution, an
//! allocation or a page-locking) is timed, and those that took at least [`HOST_WAIT_MIN`]
//! are kept, the last [`HOST_WAIT_KEEP`] of them. A streamed forward's timeline lists those
//! that fell inside it, so a device waiting for its program shows what held the program.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ddo_metrics::HostWait;

/// Calls shorter than this are not kept.
pub const HOST_WAIT_MIN: Duration = Duration::from_micros(500);

/// How many long calls are kept (the oldest go first).
pub const HOST_WAIT_KEEP: usize = 4096;

struct Kept {
    call: &'static str,
    at: Instant,
    took: Duration,
}

static LOG: Mutex<VecDeque<Kept>> = Mutex::new(VecDeque::new());

/// Runs `f` (the CUDA call named `call`) and keeps its time when it was long.
pub(crate) fn timed<T>(call: &'static str, f: impl FnOnce() -> T) -> T {
    let at = Instant::now();
    let out = f();
    note(call, at, at.elapsed());
    out
}

fn note(call: &'static str, at: Instant, took: Duration) {
    if took < HOST_WAIT_MIN {
        return;
    }
    let mut log = LOG
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if log.len() == HOST_WAIT_KEEP {
        log.pop_front();
    }
    log.push_back(Kept { call, at, took });
}

/// The kept calls that started at or after `since`, in order, timed from `since`.
pub(crate) fn since(since: Instant) -> Vec<HostWait> {
    let log = LOG
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    log.iter()
        .filter(|k| k.at >= since)
        .map(|k| HostWait {
            call: k.call.to_string(),
            at_ns: u64::try_from((k.at - since).as_nanos()).unwrap_or(u64::MAX),
            ns: u64::try_from(k.took.as_nanos()).unwrap_or(u64::MAX),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The log is the process's: its tests take turns.
    static TURN: Mutex<()> = Mutex::new(());

    #[test]
    fn only_long_calls_are_kept_and_timed_from_the_start_given() {
        let _turn = TURN
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let start = Instant::now();
        let v = timed("short call", || 7);
        assert_eq!(v, 7);
        timed("long call", || std::thread::sleep(HOST_WAIT_MIN * 4));
        let kept = since(start);
        assert!(kept.iter().all(|w| w.call != "short call"), "{kept:?}");
        let long = kept.iter().find(|w| w.call == "long call").unwrap();
        assert!(long.ns >= (HOST_WAIT_MIN * 4).as_nanos() as u64, "{long:?}");
        assert!(long.at_ns < long.ns + 1_000_000_000, "{long:?}");
        // Calls before `since` are left out.
        assert!(since(Instant::now()).iter().all(|w| w.call != "long call"));
    }

    #[test]
    fn the_log_keeps_the_newest_calls() {
        let _turn = TURN
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let start = Instant::now();
        for _ in 0..HOST_WAIT_KEEP + 3 {
            note("filler", Instant::now(), HOST_WAIT_MIN);
        }
        let log = LOG.lock().unwrap();
        assert_eq!(log.len(), HOST_WAIT_KEEP);
        assert!(log.back().is_some_and(|k| k.at >= start));
    }
}
