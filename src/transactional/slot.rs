//! Lending the owner's transaction to the handler, and taking it back afterwards.

use std::{
    ops::{Deref, DerefMut},
    sync::Arc,
};

use sqlx::{Database, Transaction};
use tokio::sync::{Mutex, OwnedMutexGuard};

/// The transaction of a request that runs in the transactional mode, lent to the handler.
///
/// The layer puts it into the request's extensions before it calls the inner service; a
/// handler locks it with [`lock`](Self::lock) (with the `axum` feature, the
/// [`Tx`](super::Tx) extractor does that) and runs its queries on it. When the handler has
/// answered, the layer takes the transaction back, writes the stored response into it and
/// commits — so the handler must not keep the guard past its answer (the layer then rolls
/// everything back and answers 500), and must not commit or roll back itself.
///
/// ```no_run
/// # #[cfg(feature = "postgres")]
/// # async fn handler(request: http::Request<()>) -> Result<(), Box<dyn std::error::Error>> {
/// use tower_idempotency::transactional::TxSlot;
///
/// let slot = request.extensions().get::<TxSlot<sqlx::Postgres>>().expect("under the layer");
/// let mut tx = slot.lock().await.expect("lent until the handler answers");
/// sqlx::query("INSERT INTO charges (amount) VALUES (1200)").execute(&mut *tx).await?;
/// # Ok(()) }
/// ```
pub struct TxSlot<DB: Database>(Arc<Mutex<Option<Transaction<'static, DB>>>>);

impl<DB: Database> Clone for TxSlot<DB> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<DB: Database> std::fmt::Debug for TxSlot<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TxSlot").finish_non_exhaustive()
    }
}

/// The handler's hold on the lent transaction: dereferences to the database connection the
/// transaction runs on, so it is an executor for sqlx (`.execute(&mut *tx)`).
pub struct TxGuard<DB: Database>(OwnedMutexGuard<Option<Transaction<'static, DB>>>);

/// The handler still holds the transaction after it answered (it kept a [`TxGuard`], or a
/// task it spawned does). Nothing can be committed safely; the transaction rolls back when
/// that guard is dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the handler still holds the idempotency transaction after it answered; drop the transaction guard before returning")]
pub struct StillBorrowed;

impl<DB: Database> TxSlot<DB> {
    pub(crate) fn new(tx: Transaction<'static, DB>) -> Self {
        Self(Arc::new(Mutex::new(Some(tx))))
    }

    /// Locks the transaction for the handler's queries; `None` once the layer has taken it
    /// back (the handler already answered).
    pub async fn lock(&self) -> Option<TxGuard<DB>> {
        let guard = self.0.clone().lock_owned().await;
        guard.is_some().then(|| TxGuard(guard))
    }

    /// Takes the transaction back from the handler.
    pub(crate) fn take(&self) -> Result<Transaction<'static, DB>, StillBorrowed> {
        let mut guard = self.0.try_lock().map_err(|_| StillBorrowed)?;
        guard.take().ok_or(StillBorrowed)
    }
}

impl<DB: Database> Deref for TxGuard<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &DB::Connection {
        // A guard is only handed out over `Some`, and the transaction is only taken out by
        // `take`, which needs the lock this guard holds.
        self.0
            .as_ref()
            .expect("a TxGuard always holds its transaction")
    }
}

impl<DB: Database> DerefMut for TxGuard<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        self.0
            .as_mut()
            .expect("a TxGuard always holds its transaction")
    }
}

impl<DB: Database> std::fmt::Debug for TxGuard<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TxGuard").finish_non_exhaustive()
    }
}
