//! Lending the owner's transaction to the handler, and taking it back afterwards.

use std::{
    ops::{Deref, DerefMut},
    sync::Arc,
    time::Duration,
};

use sqlx::Database;
use tokio::sync::{Mutex, OwnedMutexGuard};

use super::{dialect::TxDialect, open_tx::OpenTx};
use crate::store::StoreError;

/// The transaction of a request that runs in the transactional mode, lent to the handler.
///
/// The layer puts it into the request's extensions before it calls the inner service; a
/// handler locks it with [`lock`](Self::lock) (with the `axum` feature, the
/// [`Tx`](super::Tx) extractor does that) and runs its queries on it. When the handler has
/// answered, the layer takes the transaction back, writes the stored response into it and
/// commits — so the handler must not keep the guard past its answer (the layer then rolls
/// everything back and answers 500), and must not commit or roll back itself.
///
/// Run every query of the request on this transaction: a handler that holds it and waits for
/// a second connection from the same pool can exhaust the pool under load (every request
/// holding one connection and waiting for another).
///
/// To nest a unit of work, use savepoints. On MySQL/MariaDB and SQLite, sqlx's `begin()` on
/// the connection makes one; on PostgreSQL the layer began the transaction itself (see
/// [`OpenTx`](super::OpenTx)), so send `SAVEPOINT name` / `RELEASE SAVEPOINT name` /
/// `ROLLBACK TO SAVEPOINT name` as statements instead: sqlx's `begin()` there would send a
/// second `BEGIN`, and its `commit()` would end the layer's transaction early.
///
/// A request without an idempotency key (where the key is optional) gets a transaction too,
/// begun on first [`lock`](Self::lock): a handler that never locks it costs no connection.
///
/// ```no_run
/// # #[cfg(feature = "postgres")]
/// # async fn handler(request: http::Request<()>) -> Result<(), Box<dyn std::error::Error>> {
/// use tower_idempotency::transactional::TxSlot;
///
/// let slot = request.extensions().get::<TxSlot<sqlx::Postgres>>().expect("under the layer");
/// let mut tx = slot.lock().await?;
/// sqlx::query("INSERT INTO charges (amount) VALUES (1200)").execute(&mut *tx).await?;
/// # Ok(()) }
/// ```
pub struct TxSlot<DB: Database>(Arc<Mutex<State<DB>>>);

enum State<DB: Database> {
    /// Not begun yet (a request without a key): begun on first lock.
    Lazy {
        dialect: Arc<dyn TxDialect<DB>>,
        idle_limit: Duration,
    },
    Open(OpenTx<DB>),
    /// Taken back by the layer after the handler answered.
    Taken,
}

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
pub struct TxGuard<DB: Database>(OwnedMutexGuard<State<DB>>);

/// The handler still holds the transaction after it answered (it kept a [`TxGuard`], or a
/// task it spawned does). Nothing can be committed safely; the transaction rolls back when
/// that guard is dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the handler still holds the idempotency transaction after it answered; drop the transaction guard before returning")]
pub struct StillBorrowed;

/// Why [`TxSlot::lock`] could not lend the transaction.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LockError {
    /// The layer already took the transaction back: the handler answered.
    #[error("the idempotency transaction was already taken back: the handler has answered")]
    Taken,
    /// A request without a key: its transaction could not be begun.
    #[error("could not begin the request's transaction")]
    Begin(#[source] StoreError),
}

impl<DB: Database> TxSlot<DB> {
    pub(crate) fn open(tx: OpenTx<DB>) -> Self {
        Self(Arc::new(Mutex::new(State::Open(tx))))
    }

    pub(crate) fn lazy(dialect: Arc<dyn TxDialect<DB>>, idle_limit: Duration) -> Self {
        Self(Arc::new(Mutex::new(State::Lazy {
            dialect,
            idle_limit,
        })))
    }

    /// Locks the transaction for the handler's queries, beginning it first for a request
    /// without a key.
    pub async fn lock(&self) -> Result<TxGuard<DB>, LockError> {
        let mut guard = self.0.clone().lock_owned().await;
        match &*guard {
            State::Open(_) => {}
            State::Taken => return Err(LockError::Taken),
            State::Lazy {
                dialect,
                idle_limit,
            } => {
                let tx = dialect.begin(*idle_limit).await.map_err(LockError::Begin)?;
                *guard = State::Open(tx);
            }
        }
        Ok(TxGuard(guard))
    }

    /// Takes the transaction back from the handler: `None` when it was never begun.
    pub(crate) fn take(&self) -> Result<Option<OpenTx<DB>>, StillBorrowed> {
        let mut guard = self.0.try_lock().map_err(|_| StillBorrowed)?;
        match std::mem::replace(&mut *guard, State::Taken) {
            State::Open(tx) => Ok(Some(tx)),
            State::Lazy { .. } | State::Taken => Ok(None),
        }
    }
}

impl<DB: Database> TxGuard<DB> {
    fn transaction(&mut self) -> &mut OpenTx<DB> {
        match &mut *self.0 {
            State::Open(tx) => tx,
            // `lock` hands out guards over open transactions only, and nothing changes the
            // state while the guard holds the lock.
            State::Lazy { .. } | State::Taken => {
                unreachable!("a TxGuard holds an open transaction")
            }
        }
    }
}

impl<DB: Database> Deref for TxGuard<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &DB::Connection {
        match &*self.0 {
            State::Open(tx) => tx,
            State::Lazy { .. } | State::Taken => {
                unreachable!("a TxGuard holds an open transaction")
            }
        }
    }
}

impl<DB: Database> DerefMut for TxGuard<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        self.transaction()
    }
}

impl<DB: Database> std::fmt::Debug for TxGuard<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TxGuard").finish_non_exhaustive()
    }
}
