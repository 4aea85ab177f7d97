//! Cancelling a run at a step boundary (a server's client went away, issue 38): the
//! request's flag ([`PipelineRequest::cancel`](super::PipelineRequest::cancel)) is in force
//! on the thread that runs the phases for the call's length ([`scope`]); each denoising
//! step ends by reading it ([`check`]), so a set flag stops the run with
//! [`CoreError::Cancelled`] after the step that ran, and the phase driver's guard releases
//! every component as for any error. A denoise called on its own (no scope) never stops.

use std::cell::RefCell;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use ddo_core::{CoreError, Result};

thread_local! {
    static FLAG: RefCell<Option<Arc<AtomicBool>>> = const { RefCell::new(None) };
}

/// The flag of a run in force on this thread until dropped (the one before restored).
pub(crate) struct Scope(Option<Arc<AtomicBool>>);

/// Puts `flag` in force on this thread for the returned scope's life.
pub(crate) fn scope(flag: Option<Arc<AtomicBool>>) -> Scope {
    Scope(FLAG.with(|f| f.replace(flag)))
}

impl Drop for Scope {
    fn drop(&mut self) {
        let previous = self.0.take();
        FLAG.with(|f| *f.borrow_mut() = previous);
    }
}

/// [`CoreError::Cancelled`] when the flag in force is set, after step `step` of `phase`.
pub(crate) fn check(phase: &str, step: usize) -> Result<()> {
    let set = FLAG.with(|f| {
        f.borrow()
            .as_ref()
            .is_some_and(|c| c.load(Ordering::SeqCst))
    });
    if set {
        return Err(CoreError::Cancelled {
            phase: phase.to_string(),
            step,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_set_flag_stops_only_inside_its_scope() {
        let flag = Arc::new(AtomicBool::new(false));
        check("denoise", 1).unwrap();
        {
            let _s = scope(Some(Arc::clone(&flag)));
            check("denoise", 1).unwrap();
            flag.store(true, Ordering::SeqCst);
            let e = check("denoise", 2).unwrap_err();
            assert!(matches!(e, CoreError::Cancelled { step: 2, .. }), "{e}");
            {
                let _inner = scope(None);
                check("denoise", 3).unwrap();
            }
            assert!(check("denoise", 3).is_err());
        }
        check("denoise", 4).unwrap();
    }
}
