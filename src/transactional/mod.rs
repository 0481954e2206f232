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
//! 4. its outcome is written in the same transaction, which then commits. Where the claim
//!    is a lock rather than a row (PostgreSQL), the record is written only here, once: a
//!    unique violation then means another request recorded the key first, and this attempt
//!    rolls back and answers as a duplicate ([`CommitError::KeyTaken`]).
//!
//! | the owner dies or fails ... | what persists | the retry |
//! |---|---|---|
//! | before its transaction commits (crash, kill -9, lost connection, panic, error) | nothing: the server rolls back | runs once |
//! | while its `COMMIT` is under way (connection killed or broken, store silent past its time limit) | either nothing or both, unknown to the owner: it answers `503` + `Retry-After` (`urn:tower-idempotency:outcome-unknown`, [`CommitError::OutcomeUnknown`]); the claim ended with the transaction | replays if it committed, else runs once |
//! | after the commit | the effect and its stored outcome, together | replays |
//!
//! No lease is needed to recover from a crash: the database aborts a dead owner's transaction
//! when its connection goes. An owner that hangs without dying is ended by the database where
//! it can enforce an idle limit (PostgreSQL's `idle_in_transaction_session_timeout`, set to
//! the engine's lease); elsewhere duplicates wait until their own limit and get "in progress".
//! A stale owner can never commit effects after someone else took its key over: nobody can
//! take the key over while its transaction is open.
//!
//! Across a failover the guarantee is the database's: with synchronous replication (the
//! promoted standby had every acknowledged commit) no key runs twice and none is lost; with
//! asynchronous replication the last acknowledged commits can vanish with the old primary,
//! effect and record together, so a client may hold a `201` whose effect is gone and its
//! retry runs the key again. On MariaDB Galera a commit that loses a certification conflict
//! (error 1213: the same key committed on another node first) is answered like
//! [`CommitError::KeyTaken`]: the winner's outcome. See the store module's "Past one database
//! server".
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
//!
//! # Using the transaction
//!
//! Plain Tower services find the transaction in the request's extensions
//! (`transactional::TxSlot`); message consumers use `Transactional::run_once`, whose operation
//! gets the transaction's connection.
//!
//! What changes for a handler in this mode:
//!
//! - A response that is not stored (5xx, 408, 409, 425, 429, `DoNotStore`, an error, a panic)
//!   rolls back the handler's writes too, so the retry starts from a clean slate.
//! - The response body is read before the commit; the client only sees an answer whose record
//!   committed. A commit the database refused answers `503`
//!   (`urn:tower-idempotency:not-committed`) and nothing of the request persists; a commit
//!   whose connection broke answers `503` (`urn:tower-idempotency:outcome-unknown`), as it may
//!   have committed: the retry with the same key replays it, or runs once if it did not. A
//!   request sent without a key has no record to learn from: its broken commit answers `500`
//!   with the same problem type and no `Retry-After`, since a retry may apply it twice.
//!   A body over the response limit is not held: an HTTP one commits (as "not stored") before
//!   it streams; a gRPC or gRPC-web server stream streams its messages first and commits or
//!   rolls back at its status, which reaches the client only after (see
//!   [`http::grpc`](crate::http::grpc)): a stream that fails at its end keeps no writes.
//! - Duplicates never hold a database connection while they wait: the claim does not queue
//!   behind the owner's uncommitted row (PostgreSQL: a per-key `pg_try_advisory_xact_lock`;
//!   MariaDB: a zero lock wait). Duplicates in the owner's process are woken when it commits.
//!   On PostgreSQL those in other processes block on the owner's advisory lock, on a few
//!   connections of their own (4 per store and process; past that they poll), and wake the
//!   moment its transaction ends. The commit itself notifies nobody: PostgreSQL serialises the
//!   commits of notifying transactions, which measured at less than half the commit rate. On
//!   MariaDB and SQLite they poll. SQLite has one writer: the mode serializes writers across
//!   keys.
//! - On PostgreSQL the claim rides on the `BEGIN` (the key's advisory lock and a look for a
//!   live record) and the record's `INSERT` on the `COMMIT`; the only round trip beyond the
//!   handler's own transaction is the empty `ROLLBACK` that sqlx sends when the connection goes
//!   back to the pool (BENCHMARKS.md shows what the claim and the record cost the database).
//! - No lease is needed to recover from a crash (the database aborts the dead owner's
//!   transaction); on PostgreSQL the lease bounds how long an owner's transaction may sit idle.
//!   A handler that waits inside its transaction longer than that (an external call, a sleep)
//!   finds its session ended (SQLSTATE `25P03`): nothing of it commits, and the answer is
//!   `503` `not-committed` (the session ended before the `COMMIT` was read, so the outcome is
//!   known), whatever the handler returns.
//! - On MariaDB a deadlock (error 1213) rolls the whole transaction back, claim included. A
//!   handler that catches it and carries on does not write in autocommit: the owner's session
//!   runs with `autocommit` off, so its later statements land in a transaction of their own
//!   that is never committed, and the request answers `503` `not-committed` (nothing of it
//!   persists; the retry runs it once). Better: let the error answer 5xx.
//! - A rollback (after an unstored answer, an error, a panic) is bounded by the engine's store
//!   time limit like every store call: over a network gone silent, the handler's answer still
//!   goes out once the limit passes, and the abandoned transaction ends with its connection.
//! - A request whose key is running elsewhere cannot be compared with it before it commits, so
//!   a reused key with a different body waits like a duplicate and then gets `422`.
//! - Requests without a key (key optional) get a transaction too, begun when the handler first
//!   uses it, committed or rolled back by the same rule; nothing is recorded for them.
//! - Run every query of the request on the lent transaction: a handler that also takes a second
//!   connection from the same pool can exhaust it under load.

#[cfg(feature = "axum")]
mod axum;
mod dialect;
mod local;
#[cfg(feature = "mysql")]
mod mysql;
mod open_tx;
mod owner;
#[cfg(feature = "postgres")]
mod pg_text;
#[cfg(feature = "postgres")]
mod postgres;
mod run;
mod slot;
#[cfg(feature = "sqlite")]
mod sqlite;
mod turn;
mod unknown;

use std::sync::Arc;

use bytes::Bytes;
use tokio::time::Instant;

#[cfg(feature = "axum")]
pub use self::axum::{Tx, TxRejection};
pub use dialect::{Probe, TransactionalStore, TxClaim, TxCommit, TxDialect, TxStart};
pub use open_tx::OpenTx;
pub use owner::{CommitError, TxOwner};
pub use run::TxRunError;
pub use slot::{LockError, StillBorrowed, TxGuard, TxSlot};
pub use turn::{WriterQueue, WriterTurn};

use self::local::LocalOwnership;

/// How long one wait on a running owner may block before the watch looks again (which
/// also lets it notice that its last waiter left).
const OWNER_WAIT_SLICE: std::time::Duration = std::time::Duration::from_secs(1);

/// The pause before an owner asks a busy single-writer database again (its busy timeout has
/// already waited; this only keeps a database without one from being asked in a hot loop).
const BUSY_PAUSE: std::time::Duration = std::time::Duration::from_millis(10);
use crate::{
    engine::{
        waiters::{KeyWatch, Seen},
        Engine, EngineError, InProgressPolicy,
    },
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
    pub async fn begin(
        &self,
        key: StoreKey,
        fingerprint: Fingerprint,
    ) -> Result<TxBegin<S::Database>, EngineError> {
        match self.try_begin(&key, &fingerprint).await? {
            Some(begin) => Ok(begin),
            None => self.wait_for(key, fingerprint).await,
        }
    }

    /// One attempt: `None` when someone runs the key right now. Most requests carry a new
    /// key, so it claims straight away (a look first would cost every new key a round trip to
    /// spare a replay two). In one process only one task at a time tries to claim a key, so a
    /// burst of copies opens one transaction, not a burst of them.
    pub(crate) async fn try_begin(
        &self,
        key: &StoreKey,
        fingerprint: &Fingerprint,
    ) -> Result<Option<TxBegin<S::Database>>, EngineError> {
        let Some(mark) = self.local.try_enter(&self.engine, key) else {
            return Ok(None);
        };
        self.claim(key, fingerprint, mark).await
    }

    /// Waits, as the in-progress policy says, for the key's owner to commit or give up, then
    /// replays or claims. The waiters of a key in one process share one watch on the
    /// database (the engine's), which looks without a transaction and at once when an owner
    /// of this process ends; past the engine's waiter cap a duplicate is told to come back.
    pub(crate) async fn wait_for(
        &self,
        key: StoreKey,
        fingerprint: Fingerprint,
    ) -> Result<TxBegin<S::Database>, EngineError> {
        let engine = &self.engine;
        let InProgressPolicy::Wait { timeout } = engine.shared.config.in_progress else {
            tracing::debug!(key = %key.log_id(), "duplicate rejected: original still running");
            return Err(engine.still_running());
        };
        let deadline = Instant::now() + timeout;
        engine.follow_completions();
        let Some(mut subscription) = engine.shared.waiters.subscribe(
            &key,
            engine.shared.config.max_waiters_per_key,
            |watch| tokio::spawn(self.clone().watch(key.clone(), watch)),
        ) else {
            tracing::warn!(key = %key.log_id(), "too many requests waiting on this key; answering in-progress");
            return Err(engine.still_running());
        };
        loop {
            let seen = match tokio::time::timeout_at(deadline, subscription.next()).await {
                Ok(Some(seen)) => seen,
                Ok(None) | Err(_) => {
                    tracing::debug!(key = %key.log_id(), "gave up waiting for the original request");
                    return Err(engine.still_running());
                }
            };
            let decided = match seen {
                Seen::Record(record) => self.existing(&key, &fingerprint, record)?,
                Seen::Busy => None,
                // Rolled back or never there: whoever claims next runs it — maybe us.
                Seen::Absent => self.try_begin(&key, &fingerprint).await?,
                Seen::Failed(error) => return Err(engine.lookup_failed(&key, error)),
            };
            if let Some(begin) = decided {
                return Ok(begin);
            }
        }
    }

    /// The one database watch of a key in this process: looks (without a transaction),
    /// publishes what it saw, and looks again after a capped, doubling pause, or at once when
    /// an owner of this process ends. Runs until the last waiter leaves (which aborts it).
    async fn watch(self, key: StoreKey, watch: Arc<KeyWatch>) {
        let (mode, key) = (&self, &key);
        // Where the database lets a look block until the owner ends, looking again is only a
        // fallback (no waiting connection free, or a lost connection): poll slowly. Commits
        // of this mode notify nobody, so without that, poll fast.
        let backoff = self
            .engine
            .shared
            .config
            .poll(self.dialect.can_await_owner());
        watch
            .poll(backoff, move || async move {
                loop {
                    let seen = match mode.engine.bounded(mode.dialect.probe(key)).await {
                        Ok(Probe::Live(record)) => Seen::Record(record),
                        Ok(Probe::Busy) => Seen::Busy,
                        Ok(Probe::Absent) => Seen::Absent,
                        Err(error) => Seen::Failed(Arc::new(error)),
                    };
                    if !matches!(seen, Seen::Busy) {
                        return seen;
                    }
                    match mode.dialect.await_owner(key, OWNER_WAIT_SLICE).await {
                        Ok(true) => continue,
                        Ok(false) => return seen,
                        Err(error) => {
                            tracing::debug!(key = %key.log_id(), %error, "cannot wait on the key's owner; polling");
                            return seen;
                        }
                    }
                }
            })
            .await
    }

    /// One claim in a new transaction, by the task holding this process' mark for the key.
    /// `None`: someone elsewhere holds the key.
    async fn claim(
        &self,
        key: &StoreKey,
        fingerprint: &Fingerprint,
        mark: LocalOwnership,
    ) -> Result<Option<TxBegin<S::Database>>, EngineError> {
        let engine = &self.engine;
        let lease = engine.shared.config.lease;
        let begin = || engine.bounded(self.dialect.begin_claim(lease, key, fingerprint, lease));
        let (started, turn) = match self.dialect.writer_queue() {
            None => (begin().await, None),
            Some(queue) => {
                // A busy database is not a failed one: wait for a turn as long as a
                // duplicate would wait for its original, then say "busy".
                let deadline = Instant::now() + engine.wait_budget();
                let turn = tokio::time::timeout_at(deadline, queue.turn())
                    .await
                    .map_err(|_| engine.busy(key))?;
                loop {
                    match begin().await {
                        Err(error) if self.dialect.is_busy(&error) => {
                            if Instant::now() >= deadline {
                                return Err(engine.busy(key));
                            }
                            tracing::debug!(key = %key.log_id(), "database busy with another process' writer; trying again");
                            tokio::time::sleep(BUSY_PAUSE).await;
                        }
                        started => break (started, Some(turn)),
                    }
                }
            }
        };
        let started = started.map_err(|source| engine.unavailable(key, source))?;
        // Unless claimed, nothing was written and the transaction is rolled back; dropping
        // the mark lets this process' waiters on the key look again.
        let (tx, token) = match started {
            TxStart::Owner { tx, token } => (tx, token),
            TxStart::Existing(record) => return self.existing(key, fingerprint, record),
            TxStart::Busy => return Ok(None),
        };
        tracing::debug!(key = %key.log_id(), "claimed in a transaction");
        Ok(Some(TxBegin::Run(TxOwner::claimed(
            self,
            tx,
            key.clone(),
            *fingerprint,
            token,
            mark,
            turn,
        ))))
    }

    /// What a committed record means for this request: its outcome to replay, a client
    /// error, or `None` for a claim of the separate mode still running on the same table
    /// (waited for like a busy key).
    fn existing(
        &self,
        key: &StoreKey,
        fingerprint: &Fingerprint,
        record: Record,
    ) -> Result<Option<TxBegin<S::Database>>, EngineError> {
        if record.fingerprint() != fingerprint {
            tracing::debug!(key = %key.log_id(), "key reused with a different request");
            return Err(EngineError::FingerprintMismatch);
        }
        Ok(match record {
            Record::Completed { payload, .. } => {
                tracing::debug!(key = %key.log_id(), "replaying stored outcome");
                Some(TxBegin::Replay(payload))
            }
            Record::InProgress { .. } => None,
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
