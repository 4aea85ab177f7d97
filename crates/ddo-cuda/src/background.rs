//! The threads ddo-cuda starts in the background — NVRTC compiles of the kernel sources
//! (`ops::kernel_cache`'s prefetch) and cuDNN plan builds (`ops::cudnn_attention`) — and the
//! one way to wait for them, [`join_background_work`].
//!
//! A process must not exit while such a thread is inside libnvrtc or libcudnn: `exit` runs
//! those libraries' static destructors and the driver's teardown beside the thread, which
//! then faults (issue 34: every error exit of `ddo ... --device cuda:0` died by SIGSEGV,
//! exit status 139, because the error came back while plans were still being built). The
//! `ddo` command waits for them before it exits, on success and on error.

use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Every background thread started and not yet joined.
static THREADS: Mutex<Vec<JoinHandle<()>>> = Mutex::new(Vec::new());

/// Starts `work` on a thread named `name` and records it for [`join_background_work`].
/// Threads that have finished are forgotten on the way, so the list stays short.
pub(crate) fn spawn(name: String, work: impl FnOnce() + Send + 'static) -> std::io::Result<()> {
    let handle = std::thread::Builder::new().name(name).spawn(work)?;
    let mut threads = THREADS.lock();
    threads.retain(|t| !t.is_finished());
    threads.push(handle);
    Ok(())
}

/// How many background threads are still running.
pub fn background_work_pending() -> usize {
    THREADS.lock().iter().filter(|t| !t.is_finished()).count()
}

/// Waits until every background thread started so far has finished, at most `timeout`;
/// returns whether none is left running. Call it before the process exits (the `ddo`
/// command does). A thread that panicked counts as finished.
pub fn join_background_work(timeout: Duration) -> bool {
    let started = Instant::now();
    loop {
        let finished: Vec<JoinHandle<()>> = {
            let mut threads = THREADS.lock();
            let (done, running): (Vec<_>, Vec<_>) =
                threads.drain(..).partition(|t| t.is_finished());
            *threads = running;
            done
        };
        for t in finished {
            let _ = t.join();
        }
        if THREADS.lock().is_empty() {
            return true;
        }
        if started.elapsed() >= timeout {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[test]
    fn joining_waits_for_every_thread_started() {
        let done = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&done);
        spawn("ddo-test-background".into(), move || {
            std::thread::sleep(Duration::from_millis(100));
            flag.store(true, Ordering::SeqCst);
        })
        .unwrap();
        assert!(background_work_pending() >= 1);
        assert!(join_background_work(Duration::from_secs(30)));
        assert!(
            done.load(Ordering::SeqCst),
            "returned before the thread finished"
        );
        assert_eq!(background_work_pending(), 0);
        // A thread that outlives the timeout is reported, then joined later.
        spawn("ddo-test-background-slow".into(), || {
            std::thread::sleep(Duration::from_millis(300));
        })
        .unwrap();
        assert!(!join_background_work(Duration::from_millis(10)));
        assert!(join_background_work(Duration::from_secs(30)));
    }
}
