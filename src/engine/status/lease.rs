//! Whether a claim is lost, without the wake-up of those waiting for it: the state behind
//! [`ClaimStatus`](super::ClaimStatus), on `crate::sync` so the shuttle tests can schedule it.

use std::sync::PoisonError;

use tokio::time::Instant;

use crate::sync::{
    atomic::{AtomicBool, Ordering},
    Mutex, MutexGuard,
};

/// The lost flag and the end of the last lease the store confirmed, by this process' clock.
pub(super) struct Lease {
    /// Set once the claim is lost; never cleared.
    lost: AtomicBool,
    /// Checked by `is_lost_at` itself because the renewal task cannot run while the process is
    /// paused: a handler that resumes after a pause past the lease must not read "held"
    /// (model/README.md, finding 1). `None` once the claim settled: nothing can be lost any
    /// more.
    held_until: Mutex<Option<Instant>>,
}

impl Lease {
    /// A claim whose lease ends at `held_until` unless renewed.
    pub(super) fn new(held_until: Instant) -> Self {
        Self {
            lost: AtomicBool::new(false),
            held_until: Mutex::new(Some(held_until)),
        }
    }

    /// The claim is lost (a renewal was refused, or failed until the lease ran out).
    pub(super) fn set(&self) {
        self.lost.store(true, Ordering::SeqCst);
    }

    /// A renewal succeeded: the lease now ends at `held_until`, unless the claim settled.
    pub(super) fn renewed(&self, held_until: Instant) {
        let mut until = self.held_until();
        if until.is_some() {
            *until = Some(held_until);
        }
    }

    /// The claim was completed or released (or dropped): its lease no longer matters.
    pub(super) fn settled(&self) {
        *self.held_until() = None;
    }

    /// Whether the claim is lost at `now`; once true, true for good (the flag is set, so a
    /// later renewal cannot turn a lease that ran out back into a held one).
    pub(super) fn is_lost_at(&self, now: Instant) -> bool {
        if self.lost.load(Ordering::SeqCst) {
            return true;
        }
        if self.held_until().is_some_and(|until| now >= until) {
            self.lost.store(true, Ordering::SeqCst);
            return true;
        }
        false
    }

    /// The end of the lease, or `None` once the claim settled.
    pub(super) fn until(&self) -> Option<Instant> {
        *self.held_until()
    }

    fn held_until(&self) -> MutexGuard<'_, Option<Instant>> {
        // An Instant cannot be left half-written: a poisoned lock still holds a valid one.
        self.held_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("lost", &self.lost.load(Ordering::SeqCst))
            .field("held_until", &self.until())
            .finish()
    }
}
