//! The transactional mode: the claim, the operation's own database writes and its stored
//! outcome commit in ONE transaction.
//!
//! In the separate mode ([`Engine`]) the claim, the operation and the completion are three
//! commits, so a process that dies after the operation committed and before the completion
//! leaves an effect without a record, and when the lease ends a retry runs it again. Here the
//! database referees the outcome as well as the race:
//!
//! 1. the request opens a transaction and claims the key inside it; a committed record is
//!    replayed (the transaction, which wrote nothing, is rolled back), and a key that another
//!    transaction holds right now is reported at once as busy, never waited for on a pooled
//!    connection;
//! 2. a busy key's duplicates wait without a connection: woken by an owner in their own
//!    process, or looking again (one read, no transaction) with capped backoff;
//! 3. the operation runs on that transaction;
//! 4. its outcome is written into the claim row in the same transaction, which then commits.
//!
//! | the owner dies or fails ... | what persists | the retry |
//! |---|---|---|
//! | before its transaction commits (crash, kill -9, lost connection, panic, error) | nothing: the server rolls back | runs once |
//! | after the commit | the effect and its stored outcome, together | replays |
//!
//! No lease is needed to recover from a crash: the database aborts a dead owner's transaction
//! when its connection goes. An owner that hangs without dying is ended by the database where
//! it can enforce an idle limit (PostgreSQL's `idle_in_transaction_session_timeout`, set to
//! the engine's lease); elsewhere duplicates wait until their own limit and get "in progress".
//! A stale owner can never commit effects after someone else took its key over: nobody can
//! take the key over while its transaction is open.
//!
//! What the mode cannot cover: effects outside the database (a call to a card processor, an
//! e-mail) are not rolled back with the transaction, so an attempt that fails after making one
//! leaves it behind and the retry makes it again. Send those through an outbox written in
//! the transaction, or use the separate mode.
//!
//! ```no_run
//! # #[cfg(feature = "postgres")]
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use bytes::Bytes;
//! use tower_idempotency::{
//!     store::PostgresStore, transactional::Transactional, Fingerprint, StoreKey,
//! };
//!
//! let pool = sqlx::PgPool::connect("postgres://localhost/app").await?;
//! let store = PostgresStore::new(pool);
//! store.migrate().await?;
//! let inbox = Transactional::new(store);
//!
//! let key = StoreKey::new("orders-queue", "message-81");
//! let execution = inbox
//!     .run_once(key, Fingerprint::of([b"message-81".as_slice()]), |tx| {
//!         Box::pin(async move {
//!             sqlx::query("UPDATE orders SET status = 'paid' WHERE id = 81")
//!                 .execute(&mut *tx)
//!                 .await?;
//!             Ok::<_, sqlx::Error>(Bytes::from_static(b"paid"))
//!         })
//!     })
//!     .await?;
//! # let _ = execution; Ok(()) }
//! ```

#[cfg(feature = "axum")]
mod axum;
mod dialect;
mod local;
#[cfg(feature = "mysql")]
mod mysql;
mod owner;
#[cfg(feature = "postgres")]
mod postgres;
mod run;
mod slot;
#[cfg(feature = "sqlite")]
mod sqlite;

use std::sync::Arc;

use bytes::Bytes;
use tokio::time::Instant;

#[cfg(feature = "axum")]
pub use self::axum::{Tx, TxRejection};
pub use dialect::{Probe, TransactionalStore, TxClaim, TxDialect};
pub use owner::{CommitError, TxOwner};
pub use run::TxRunError;
pub use slot::{LockError, StillBorrowed, TxGuard, TxSlot};

use self::local::LocalOwnership;
use crate::{
    engine::{Engine, EngineError, InProgressPolicy},
    record::{Fingerprint, Record, StoreKey},
};

/// Runs operations at most once per key with their effects and their recorded outcome in
/// one database transaction. Clones share everything.
pub struct Transactional<S: TransactionalStore> {
    store: S,
    dialect: Arc<dyn TxDialect<S::Database>>,
    engine: Engine,
    local: Arc<local::LocalOwners>,
}

impl<S: TransactionalStore> Clone for Transactional<S> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            dialect: self.dialect.clone(),
            engine: self.engine.clone(),
            local: self.local.clone(),
        }
    }
}

/// What [`Transactional::begin`] decided.
#[derive(Debug)]
// Returned once per request and moved once: boxing the owner would cost an allocation for
// every claim to save a few bytes on the replay path.
#[allow(clippy::large_enum_variant)]
pub enum TxBegin<DB: sqlx::Database> {
    /// This caller's transaction holds the key: run the operation on it, then
    /// [`commit`](TxOwner::commit) or [`rollback`](TxOwner::rollback).
    Run(TxOwner<DB>),
    /// The operation already ran and committed under this key; here is its stored outcome.
    Replay(Bytes),
}

/// What a single attempt to own a key found.
#[allow(clippy::large_enum_variant)] // as for `TxBegin`
enum Attempt<DB: sqlx::Database> {
    Decided(TxBegin<DB>),
    /// Someone elsewhere holds the key; this task keeps its process' mark and watches.
    Busy(LocalOwnership),
    /// A task of this process is claiming or running the key.
    BusyHere,
}

impl<S: TransactionalStore> Transactional<S> {
    /// The transactional mode on `store` with the engine's default timings.
    pub fn new(store: S) -> Self {
        let engine = Engine::new(store.clone());
        Self::with_engine(store, engine)
    }

    /// The transactional mode on `store`, with the timings and the wait policy of `engine`
    /// (lease, retention, in-progress policy, store time limit). `engine` should run on the
    /// same store: its lookups and purges serve the same table.
    pub fn with_engine(store: S, engine: Engine) -> Self {
        Self {
            dialect: store.dialect(),
            store,
            engine,
            local: Arc::default(),
        }
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The engine whose timings and waiters this mode uses.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Claims `key` inside a new transaction, or finds its committed outcome. Duplicates of a
    /// running owner wait (without a database connection) as the engine's in-progress policy
    /// says, then replay.
    ///
    /// In one process, only one task at a time tries to claim a key; the others wait to be
    /// woken when it has decided, so a burst of copies never opens a burst of transactions.
    pub async fn begin(
        &self,
        key: StoreKey,
        fingerprint: Fingerprint,
    ) -> Result<TxBegin<S::Database>, EngineError> {
        let config = &self.engine.config;
        let deadline = match config.in_progress {
            InProgressPolicy::Wait { timeout } => Some(Instant::now() + timeout),
            InProgressPolicy::Reject => None,
        };
        let subscription = self.engine.waiters.subscribe(&key);
        let (mut pause, max_pause) = config.poll;
        // Most requests carry a new key: the first attempt claims straight away (a look first
        // would cost every new key a round trip to spare a replay two). Later attempts look
        // first, without a transaction.
        let mut look = false;
        // While someone elsewhere runs the key, this task may be the one of its process that
        // watches the database for the outcome; the others wait to be woken.
        let mut watching = None;
        loop {
            // Subscribed before deciding: a task of this process finishing after the decision
            // still wakes us.
            let woken = subscription.notify().notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            // `None`: a task of this process is claiming or running the key, and wakes us.
            // `Some(pause)`: someone elsewhere runs it; look again after the pause.
            let nap = match self
                .attempt(&key, &fingerprint, look, watching.take())
                .await?
            {
                Attempt::Decided(begin) => return Ok(begin),
                Attempt::Busy(mark) => {
                    watching = Some(mark);
                    Some(pause)
                }
                Attempt::BusyHere => None,
            };
            look = true;
            let Some(deadline) = deadline else {
                tracing::debug!(key = %key.log_id(), "duplicate rejected: original still running");
                return Err(self.engine.still_running());
            };
            let now = Instant::now();
            if now >= deadline {
                tracing::debug!(key = %key.log_id(), "gave up waiting for the original request");
                return Err(self.engine.still_running());
            }
            let left = deadline - now;
            tokio::select! {
                () = &mut woken => {}
                () = tokio::time::sleep(nap.map_or(left, |nap| nap.min(left))) => {
                    pause = (pause * 2).min(max_pause);
                }
            }
        }
    }

    /// Maybe one look at the key (any waiter may look: it is one read) and, if it is free and
    /// no other task of this process is claiming it, one claim. Only the task holding its
    /// process' mark for the key claims, or watches a key someone elsewhere runs; `held` is
    /// that mark from this task's previous attempt.
    async fn attempt(
        &self,
        key: &StoreKey,
        fingerprint: &Fingerprint,
        look: bool,
        held: Option<LocalOwnership>,
    ) -> Result<Attempt<S::Database>, EngineError> {
        let engine = &self.engine;
        let unavailable = |source| engine.unavailable(key, source);
        let mark = || held.or_else(|| self.local.try_enter(engine, key));
        if look {
            let found = engine
                .bounded(self.dialect.probe(key))
                .await
                .map_err(unavailable)?;
            match found {
                Probe::Live(record) => return self.existing(key, fingerprint, record, mark()),
                Probe::Busy => return Ok(mark().map_or(Attempt::BusyHere, Attempt::Busy)),
                Probe::Absent => {}
            }
        }
        let Some(mark) = mark() else {
            return Ok(Attempt::BusyHere);
        };
        let lease = engine.config.lease;
        let mut tx = engine
            .bounded(self.dialect.begin(lease))
            .await
            .map_err(unavailable)?;
        let claimed = engine
            .bounded(self.dialect.claim_in(&mut tx, key, fingerprint, lease))
            .await
            .map_err(unavailable)?;
        // Unless claimed, nothing was written: dropping the transaction rolls it back, and
        // dropping the mark wakes the tasks of this process waiting on the key.
        let token = match claimed {
            TxClaim::Claimed(token) => token,
            TxClaim::Existing(record) => {
                return self.existing(key, fingerprint, record, Some(mark))
            }
            TxClaim::Busy => return Ok(Attempt::Busy(mark)),
        };
        tracing::debug!(key = %key.log_id(), "claimed in a transaction");
        let owner = TxOwner::claimed(self, tx, key.clone(), token, mark);
        Ok(Attempt::Decided(TxBegin::Run(owner)))
    }

    /// What a committed record means for this request. `mark` (if this task has its process'
    /// mark) is kept to watch a running claim of the separate mode, and dropped otherwise,
    /// which wakes the other waiters of this process to look for themselves.
    fn existing(
        &self,
        key: &StoreKey,
        fingerprint: &Fingerprint,
        record: Record,
        mark: Option<LocalOwnership>,
    ) -> Result<Attempt<S::Database>, EngineError> {
        if record.fingerprint() != fingerprint {
            tracing::debug!(key = %key.log_id(), "key reused with a different request");
            return Err(EngineError::FingerprintMismatch);
        }
        Ok(match record {
            Record::Completed { payload, .. } => {
                tracing::debug!(key = %key.log_id(), "replaying stored outcome");
                Attempt::Decided(TxBegin::Replay(payload))
            }
            // A claim of the separate mode on the same table: wait for it like for a busy key.
            Record::InProgress { .. } => mark.map_or(Attempt::BusyHere, Attempt::Busy),
        })
    }

    /// A transaction for work that has no key to protect (a request without an idempotency
    /// key on a route where the key is optional): the operation still gets a transaction,
    /// committed or rolled back by the same rules, but nothing is claimed or recorded.
    /// The transaction is begun when the operation first locks it, so work that does not
    /// touch the database costs no connection.
    pub fn begin_unkeyed(&self) -> TxOwner<S::Database> {
        TxOwner::unkeyed(self)
    }
}

impl<S: TransactionalStore> std::fmt::Debug for Transactional<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transactional")
            .field("engine", &self.engine)
            .finish_non_exhaustive()
    }
}
