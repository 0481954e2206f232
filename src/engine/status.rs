//! [`ClaimStatus`]: how the owner of a claim learns that it lost it.

use tokio::sync::watch;

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
    lost: watch::Receiver<bool>,
}

/// The renewal task's side. Clones share the flag (the claim holds one, its renewal another);
/// once every clone is dropped the claim has settled, which [`ClaimStatus::lost`] tells.
#[derive(Clone, Debug)]
pub(crate) struct LostFlag(watch::Sender<bool>);

impl LostFlag {
    pub(crate) fn new() -> Self {
        Self(watch::Sender::new(false))
    }

    pub(crate) fn set(&self) {
        self.0.send_replace(true);
    }

    pub(crate) fn status(&self) -> ClaimStatus {
        ClaimStatus {
            lost: self.0.subscribe(),
        }
    }
}

impl ClaimStatus {
    /// True once the claim is lost (see the type's docs). Never turns back to false.
    pub fn is_lost(&self) -> bool {
        *self.lost.borrow()
    }

    /// Resolves when the claim is lost; pending forever while it is held, and after it was
    /// completed or released.
    pub async fn lost(&self) {
        let mut lost = self.lost.clone();
        if lost.wait_for(|lost| *lost).await.is_err() {
            // The claim settled without being lost: that never changes now.
            std::future::pending::<()>().await;
        }
    }
}
