//! [`ClaimStatus`]: how the owner of a claim learns that it lost it.

use std::sync::{
    atomic::{AtomicBool, Ordering},
    Arc,
};

use tokio::sync::Notify;

/// Whether a running operation still owns its key. Cheap to clone; the HTTP layer puts one in
/// the request's extensions, so a handler can check it before an irreversible step, or race
/// its work against [`lost`](Self::lost).
///
/// A claim counts as lost when a renewal is refused (another request took the key over after
/// the lease ran out), or when renewals kept failing until the lease, as far as this process
/// can tell, ran out. Its outcome will then not be recorded (the store's fence refuses it) and
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

/// The flag and the wake-up of those waiting for it.
///
/// Not a `watch` channel: dropping a claim's last `watch::Sender` wakes the receivers to
/// say it closed, which takes eight locks on every request, while nothing here needs to hear
/// of a claim that settled (its [`ClaimStatus::lost`] pends forever either way).
#[derive(Debug, Default)]
struct Flag {
    lost: AtomicBool,
    changed: Notify,
}

/// The renewal task's side. Clones share the flag (the claim holds one, its renewal another).
#[derive(Clone, Debug, Default)]
pub(crate) struct LostFlag(Arc<Flag>);

impl LostFlag {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    pub(crate) fn set(&self) {
        self.0.lost.store(true, Ordering::SeqCst);
        self.0.changed.notify_waiters();
    }

    pub(crate) fn status(&self) -> ClaimStatus {
        ClaimStatus {
            flag: self.0.clone(),
        }
    }
}

impl ClaimStatus {
    /// True once the claim is lost (see the type's docs). Never turns back to false.
    pub fn is_lost(&self) -> bool {
        self.flag.lost.load(Ordering::SeqCst)
    }

    /// Resolves when the claim is lost; pending forever while it is held, and after it was
    /// completed or released.
    pub async fn lost(&self) {
        // Listen first, check second: a `set` in between still wakes this.
        let changed = self.flag.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        if !self.is_lost() {
            // `set` is the only change, and it is final.
            changed.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn lost_resolves_when_the_flag_is_set_before_or_while_it_waits() {
        let flag = LostFlag::new();
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
        let flag = LostFlag::new();
        let status = flag.status();
        drop(flag);
        assert!(!status.is_lost());
        assert!(
            tokio::time::timeout(Duration::from_secs(3600), status.lost())
                .await
                .is_err(),
            "a settled claim was reported lost"
        );
    }
}
