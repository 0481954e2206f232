//! [`ClaimStatus`]: how the owner of a claim learns that it lost it.

mod lease;

use std::sync::Arc;

use tokio::{sync::Notify, time::Instant};

use self::lease::Lease;

/// Whether a running operation still owns its key. Cheap to clone; the HTTP layer puts one in
/// the request's extensions, so a handler can check it before an irreversible step, or race
/// its work against [`lost`](Self::lost).
///
/// A claim counts as lost when a renewal is refused (another request took the key over after
/// the lease ran out), or once this process' clock passes the end of the last lease the store
/// confirmed, whether renewals kept failing or the process was paused (a GC pause, SIGSTOP,
/// an overloaded host) before its renewal task could run. The end is measured from the moment
/// the claim or renewal was sent, so it comes no later than the store's own expiry. Its outcome will then not be recorded (the store's fence refuses it) and
/// a duplicate may run the operation again.
///
/// ```
/// # async fn handler(status: tower_idempotency::engine::ClaimStatus) {
/// tokio::select! {
///     () = status.lost() => { /* stop: another request may be running this operation */ }
///     () = async { /* the work */ } => {}
/// }
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct ClaimStatus {
    flag: Arc<Flag>,
}

#[cfg(any(feature = "conformance", all(test, shuttle)))]
impl ClaimStatus {
    /// A claim held for the next hour, for tests of what runs under a claim.
    pub(crate) fn held() -> Self {
        LostFlag::new(Instant::now() + std::time::Duration::from_secs(3600)).status()
    }
}

/// The flag and the wake-up of those waiting for it.
///
/// Not a `watch` channel: dropping a claim's last `watch::Sender` wakes the receivers to
/// say it closed, which takes eight locks on every request, while nothing here needs to hear
/// of a claim that settled (its [`ClaimStatus::lost`] pends forever either way).
#[derive(Debug)]
struct Flag {
    lease: Lease,
    changed: Notify,
}

/// The renewal task's side. Clones share the flag (the claim holds one, its renewal another).
#[derive(Clone, Debug)]
pub(crate) struct LostFlag(Arc<Flag>);

impl LostFlag {
    /// A flag for a claim whose lease ends at `held_until` unless renewed.
    pub(crate) fn new(held_until: Instant) -> Self {
        Self(Arc::new(Flag {
            lease: Lease::new(held_until),
            changed: Notify::new(),
        }))
    }

    pub(crate) fn set(&self) {
        self.0.lease.set();
        self.0.changed.notify_waiters();
    }

    /// A renewal succeeded: the lease now ends at `held_until`.
    pub(crate) fn renewed(&self, held_until: Instant) {
        self.0.lease.renewed(held_until);
    }

    /// The claim was completed or released (or dropped): its lease no longer matters.
    pub(crate) fn settled(&self) {
        self.0.lease.settled();
    }

    pub(crate) fn status(&self) -> ClaimStatus {
        ClaimStatus {
            flag: self.0.clone(),
        }
    }
}

impl ClaimStatus {
    /// True once the claim is lost (see the type's docs). Never turns back to false: a lease
    /// that ran out, even if renewed later, left a window in which a duplicate could start.
    pub fn is_lost(&self) -> bool {
        self.flag.lease.is_lost_at(Instant::now())
    }

    /// Resolves when the claim is lost; pending forever while it is held, and after it was
    /// completed or released.
    pub async fn lost(&self) {
        loop {
            // Listen first, check second: a `set` in between still wakes this.
            let changed = self.flag.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.is_lost() {
                return;
            }
            let until = self.flag.lease.until();
            match until {
                // Settled: only a `set` could still come, and none will.
                None => changed.await,
                // Wake at the lease's end too; a renewal may have moved it, so look again.
                Some(until) => {
                    tokio::select! {
                        () = changed => {}
                        () = tokio::time::sleep_until(until) => {}
                    }
                }
            }
        }
    }
}

#[cfg(all(test, shuttle))]
mod shuttle_tests;

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn lost_resolves_when_the_flag_is_set_before_or_while_it_waits() {
        let flag = LostFlag::new(Instant::now() + Duration::from_secs(3600));
        let status = flag.status();
        assert!(!status.is_lost());
        let waiting = tokio::spawn({
            let status = status.clone();
            async move { status.lost().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "lost before the flag was set");
        flag.clone().set();
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("a waiter woke when the flag was set")
            .unwrap();
        assert!(status.is_lost());
        // Set already: at once.
        tokio::time::timeout(Duration::from_secs(5), status.lost())
            .await
            .expect("lost resolved at once");
    }

    #[tokio::test(start_paused = true)]
    async fn lost_pends_after_the_claim_settled() {
        let flag = LostFlag::new(Instant::now() + Duration::from_secs(1));
        let status = flag.status();
        flag.settled();
        drop(flag);
        assert!(!status.is_lost());
        assert!(
            tokio::time::timeout(Duration::from_secs(3600), status.lost())
                .await
                .is_err(),
            "a settled claim was reported lost"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_owners_clock_passing_the_lease_is_a_loss_even_before_the_renewal_task_runs() {
        let flag = LostFlag::new(Instant::now() + Duration::from_secs(1));
        let status = flag.status();
        assert!(!status.is_lost());
        tokio::time::advance(Duration::from_millis(900)).await;
        flag.renewed(Instant::now() + Duration::from_secs(1));
        tokio::time::advance(Duration::from_millis(900)).await;
        assert!(!status.is_lost(), "the renewal moved the end of the lease");
        tokio::time::timeout(Duration::from_secs(5), status.lost())
            .await
            .expect("lost() resolves when the lease runs out by this process' clock");
        assert!(status.is_lost());
        flag.renewed(Instant::now() + Duration::from_secs(1));
        assert!(status.is_lost(), "a loss never turns back to held");
    }
}
