//! The locks and atomics of the in-process structures whose races the shuttle tests explore.
//!
//! Normally these are `std::sync`'s own. Built with `RUSTFLAGS="--cfg shuttle"`
//! (`scripts/shuttle`) they are shuttle's, which yield to its scheduler at every lock and
//! atomic access, so its tests can run the structures under chosen interleavings. Only the
//! structures that import from here are switched: tokio's `Notify` and `watch` cannot be
//! scheduled by shuttle, and anything still using `std::sync` directly is not explored.

#[cfg(not(shuttle))]
pub(crate) use std::sync::{atomic, Mutex, MutexGuard};

#[cfg(shuttle)]
pub(crate) use shuttle::sync::{atomic, Mutex, MutexGuard};

/// Runs a shuttle test under 2,000 random schedules, then 2,000 PCT schedules aimed at bugs
/// needing up to 3 preemptions at chosen points: with every test so checked, `scripts/shuttle`
/// stays within seconds of schedules.
#[cfg(all(test, shuttle))]
pub(crate) fn explore(test: impl Fn() + Send + Sync + Clone + 'static) {
    shuttle::check_random(test.clone(), 2_000);
    shuttle::check_pct(test, 2_000, 3);
}
