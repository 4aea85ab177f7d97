//! [`QuiescenceGate`]: the caller's word on whether device work is pending, which
//! [`VmmPool::release_idle`](crate::VmmPool::release_idle) demands before it unmaps anything.
//!
//! The pool cannot see streams: it knows which bytes are live, not which kernels or copies
//! queued earlier still read or write freed ones. Unmapping a page that queued work still
//! touches makes that work fault, so the release rule is "only at a quiescent boundary", and
//! only the owner of the streams can say when that is. The CUDA wiring checks every stream
//! of the device and passes [`QuiescenceGate::busy`] when work is in flight (the pool then
//! refuses with [`VmmError::NotQuiescent`](crate::VmmError::NotQuiescent) and releases
//! nothing), or synchronises every stream and passes the gate
//! [`QuiescenceGate::after_synchronize`] builds.

use std::borrow::Cow;
use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    Quiescent(Cow<'static, str>),
    Busy(String),
}

/// Whether no device work can touch the pool's memory any more, as stated by the one who
/// owns the streams, with the basis for the statement.
#[derive(Clone, PartialEq, Eq)]
pub struct QuiescenceGate {
    state: State,
}

impl QuiescenceGate {
    /// Quiescent on the caller's word; `basis` says why (e.g. "every stream synchronised",
    /// or "no stream exists" for a pool that only tests use). Prefer
    /// [`QuiescenceGate::after_synchronize`].
    pub fn quiescent(basis: &'static str) -> Self {
        Self {
            state: State::Quiescent(Cow::Borrowed(basis)),
        }
    }

    /// Runs `synchronize` (which must block until every stream that may use the pool's
    /// memory has drained) and, if it succeeded, gives a quiescent gate; its error otherwise.
    pub fn after_synchronize<E>(synchronize: impl FnOnce() -> Result<(), E>) -> Result<Self, E> {
        synchronize()?;
        Ok(Self {
            state: State::Quiescent(Cow::Borrowed("every stream synchronised")),
        })
    }

    /// Work is pending: `what` says which (e.g. "2 streams have queued work"). A release
    /// through this gate is refused and changes nothing.
    pub fn busy(what: impl Into<String>) -> Self {
        Self {
            state: State::Busy(what.into()),
        }
    }

    /// Whether the gate lets a release through.
    pub fn is_quiescent(&self) -> bool {
        matches!(self.state, State::Quiescent(_))
    }

    /// The basis of a quiescent gate, or what is pending for a busy one.
    pub fn basis(&self) -> &str {
        match &self.state {
            State::Quiescent(b) => b,
            State::Busy(w) => w,
        }
    }
}

impl fmt::Debug for QuiescenceGate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.state {
            State::Quiescent(b) => write!(f, "QuiescenceGate::Quiescent({b})"),
            State::Busy(w) => write!(f, "QuiescenceGate::Busy({w})"),
        }
    }
}
