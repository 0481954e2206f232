//! Counting the claims a process holds, so a graceful shutdown can wait for them.

use std::sync::Arc;

use crate::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Notify;

#[derive(Default)]
pub(crate) struct InFlight {
    count: AtomicUsize,
    idle: Notify,
    /// Callers of [`idle`](Self::idle) right now. The last claim out notifies only if there
    /// are any: under load the count touches zero between requests all the time, and a
    /// notification takes the `Notify`'s lock, which both cores would keep passing around.
    listeners: AtomicUsize,
}

/// One held claim; dropping it (after the claim was completed or released) counts it out.
pub(crate) struct InFlightGuard(Arc<InFlight>);

impl InFlight {
    pub(crate) fn enter(self: &Arc<Self>) -> InFlightGuard {
        self.count.fetch_add(1, Ordering::SeqCst);
        crate::metrics::claims_in_flight(1.0);
        InFlightGuard(self.clone())
    }

    pub(crate) fn count(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }

    pub(crate) async fn idle(&self) {
        let _listening = Listening::new(&self.listeners);
        loop {
            // Listen first, check second: a guard dropped in between still wakes us (a
            // `Notified` sees every `notify_waiters` after its creation, and the guard reads
            // `listeners` after its own decrement).
            let idle = self.idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            if self.count() == 0 {
                return;
            }
            idle.await;
        }
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        crate::metrics::claims_in_flight(-1.0);
        if self.0.count.fetch_sub(1, Ordering::SeqCst) == 1
            && self.0.listeners.load(Ordering::SeqCst) > 0
        {
            self.0.idle.notify_waiters();
        }
    }
}

/// One caller of [`InFlight::idle`], counted while it waits (also if its future is dropped).
struct Listening<'a>(&'a AtomicUsize);

impl<'a> Listening<'a> {
    fn new(listeners: &'a AtomicUsize) -> Self {
        listeners.fetch_add(1, Ordering::SeqCst);
        Self(listeners)
    }
}

impl Drop for Listening<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(all(test, shuttle))]
mod shuttle_tests;

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// The last guard skips the notification while nobody waits for idleness: that shortcut
    /// must still wake a waiter that is there. One thread: once the waiter is counted it has
    /// run up to its wait, so the claims below end while it is parked, not before it looks.
    #[tokio::test]
    async fn a_waiter_for_idleness_wakes_when_the_last_claim_ends() {
        let in_flight = Arc::new(InFlight::default());
        // No claim held: idle at once; and a guard dropped with nobody waiting.
        in_flight.idle().await;
        drop(in_flight.enter());
        let (first, second) = (in_flight.enter(), in_flight.enter());
        let waiter = tokio::spawn({
            let in_flight = in_flight.clone();
            async move { in_flight.idle().await }
        });
        while in_flight.listeners.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        drop(first);
        assert!(!waiter.is_finished(), "idle with a claim still held");
        drop(second);
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("the waiter woke when the last claim ended")
            .unwrap();
        assert_eq!(in_flight.listeners.load(Ordering::SeqCst), 0);
    }
}
