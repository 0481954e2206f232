//! Counting the claims a process holds, so a graceful shutdown can wait for them.

use std::sync::{
    atomic::{AtomicUsize, Ordering},
    Arc,
};

use tokio::sync::Notify;

#[derive(Default)]
pub(crate) struct InFlight {
    count: AtomicUsize,
    idle: Notify,
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
        loop {
            // Listen first, check second: a guard dropped in between still wakes us.
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
        if self.0.count.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}
