//! The claim / wait / replay / release rules, for any operation — no HTTP here.
//!
//! The HTTP layer is built on this; a message consumer uses it directly through
//! [`Engine::run_once`]:
//!
//! ```
//! use bytes::Bytes;
//! use tower_idempotency::{engine::{Engine, Execution}, store::MemoryStore, Fingerprint, StoreKey};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let engine = Engine::new(MemoryStore::new());
//! let key = StoreKey::new("orders-queue", "message-81");
//! let body = br#"{"order": 81}"#;
//! let fingerprint = Fingerprint::of([body.as_slice()]);
//!
//! for delivery in 0..2 {
//!     let result = engine
//!         .run_once(key.clone(), fingerprint, || async {
//!             // move the order to `paid`, charge the card, ...
//!             Ok::<_, std::io::Error>(Bytes::from_static(b"paid"))
//!         })
//!         .await
//!         .unwrap();
//!     match result {
//!         Execution::Ran(out) => assert_eq!(delivery, 0, "ran once: {out:?}"),
//!         Execution::Replayed(out) => assert_eq!(out, "paid"),
//!     }
//! }
//! # }
//! ```
//!
//! `cargo run --example queue_consumer` runs it on redelivered messages.

mod bounded;
mod builder;
mod claim;
mod config;
mod error;
pub(crate) mod in_flight;
mod renewal;
mod status;
pub(crate) mod waiters;

use std::{future::Future, sync::Arc, time::Duration};

use bytes::Bytes;
use tokio::time::Instant;

pub use builder::EngineBuilder;
pub use claim::Claim;
pub(crate) use config::EngineConfig;
pub use config::{ConfigError, InProgressPolicy};
pub use error::{EngineError, RunError};
pub use status::ClaimStatus;

use crate::{
    record::{ClaimOutcome, Fingerprint, Record, StoreKey},
    store::{Store, StoreError},
};
use waiters::Seen;

/// A store error seen by the key's shared watch, handed to each of its waiters.
#[derive(Debug)]
pub(crate) struct SharedError(pub(crate) Arc<StoreError>);

impl std::fmt::Display for SharedError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for SharedError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        // Straight to the backend's own error, as a waiter's own lookup would have it.
        self.0.source()
    }
}

/// Runs operations at most once per key, refereed by a [`Store`]. Clones share the store, the
/// configuration and the in-process waiters.
#[derive(Clone)]
pub struct Engine {
    /// One allocation for all of it: a request clones the engine, and one reference count is
    /// cheaper to move than five.
    pub(crate) shared: Arc<Shared>,
}

/// What the clones of an engine share.
pub(crate) struct Shared {
    store: Arc<dyn Store>,
    pub(crate) config: EngineConfig,
    pub(crate) waiters: Arc<waiters::Waiters>,
    pub(crate) in_flight: Arc<in_flight::InFlight>,
    pub(crate) renewals: Arc<renewal::Renewals>,
}

/// What [`Engine::begin`] decided.
#[derive(Debug)]
pub enum Begin {
    /// This caller owns the key: run the operation, then complete or release the claim.
    Run(Claim),
    /// The operation already ran under this key with the same fingerprint; here is its
    /// stored outcome.
    Replay(Bytes),
}

/// What [`Engine::run_once`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Execution {
    /// This call ran the operation; its output was recorded.
    Ran(Bytes),
    /// An earlier or concurrent call ran it; this is that call's output.
    Replayed(Bytes),
}

impl Execution {
    /// The output, whoever produced it.
    pub fn into_output(self) -> Bytes {
        match self {
            Execution::Ran(output) | Execution::Replayed(output) => output,
        }
    }
}

impl Engine {
    /// An engine over `store` with the default timings: 30 s lease, 24 h retention, duplicates
    /// wait up to 10 s for a running original. [`Engine::builder`] changes them.
    pub fn new(store: impl Store) -> Self {
        Self::from_shared(Arc::new(store))
    }

    /// An engine over a store that is already shared, with the default timings.
    pub fn from_shared(store: Arc<dyn Store>) -> Self {
        Self::with_config(store, EngineConfig::default())
    }

    /// Configures an engine over `store`; [`EngineBuilder::build`] checks the timings.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::{store::MemoryStore, Engine};
    ///
    /// let engine = Engine::builder(MemoryStore::new())
    ///     .lease(Duration::from_secs(10))
    ///     .store_timeout(Duration::from_secs(1))
    ///     .build()
    ///     .expect("valid timings");
    /// # let _ = engine;
    /// ```
    pub fn builder(store: impl Store) -> EngineBuilder {
        EngineBuilder::new(Arc::new(store))
    }

    /// [`Engine::builder`] over a store that is already shared.
    pub fn builder_shared(store: Arc<dyn Store>) -> EngineBuilder {
        EngineBuilder::new(store)
    }

    pub(crate) fn with_config(store: Arc<dyn Store>, config: EngineConfig) -> Self {
        let engine = Self {
            shared: Arc::new(Shared {
                store,
                config,
                waiters: Arc::default(),
                in_flight: Arc::default(),
                renewals: Arc::default(),
            }),
        };
        // Listen for completions from the start when we can, so that the first waiters do
        // not miss the notification they wait for; otherwise the first waiter starts it.
        if tokio::runtime::Handle::try_current().is_ok() {
            engine.follow_completions();
        }
        engine
    }

    /// Follows the store's completion notifications, if it has any (once per engine).
    pub(crate) fn follow_completions(&self) {
        self.shared
            .waiters
            .follow(|| self.shared.store.completions());
    }

    /// The polling backoff of a key's watch.
    pub(crate) fn poll(&self) -> (Duration, Duration) {
        self.shared.config.poll(self.shared.waiters.notified())
    }

    /// How many keys requests of this process are waiting on right now (each with one shared
    /// watch on the store). Zero when nothing waits: an entry outliving its waiters is a leak.
    pub fn waiting_keys(&self) -> usize {
        self.shared.waiters.keys()
    }

    /// Runs one store call under the engine's time limit.
    pub(crate) fn bounded<T>(
        &self,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> impl Future<Output = Result<T, StoreError>> {
        bounded::Bounded::new(call, self.shared.config.store_timeout)
    }

    /// The delay suggested to callers told to come back later.
    #[cfg(feature = "sqlx")]
    pub(crate) fn retry_after_delay(&self) -> Duration {
        self.shared.config.retry_after
    }

    /// How many claims this engine (and its clones) holds right now: operations running, or
    /// finishing their store write.
    pub fn in_flight(&self) -> usize {
        self.shared.in_flight.count()
    }

    /// Resolves once no claim is in flight: every running operation has completed or released
    /// its key. Await it after the server stopped accepting requests, so handlers that were
    /// detached from disconnected clients finish and record their outcome before the process
    /// exits (instead of leaving their keys claimed until the lease runs out).
    ///
    /// ```
    /// # async fn shutdown(engine: tower_idempotency::Engine) {
    /// // after axum::serve(..).with_graceful_shutdown(..) returned:
    /// let _ = tokio::time::timeout(std::time::Duration::from_secs(30), engine.drained()).await;
    /// # }
    /// ```
    pub async fn drained(&self) {
        self.shared.in_flight.idle().await
    }

    /// The store this engine uses.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.shared.store
    }

    /// The store itself, for calling it. `self.store.claim(..)` would resolve to the blanket
    /// `impl Store for Arc<S>`, whose future boxes the store's own boxed future once more:
    /// an allocation and an indirect poll on every store call.
    pub(crate) fn backend(&self) -> &dyn Store {
        &*self.shared.store
    }

    /// Claims `key` for a request with `fingerprint` in one atomic store operation, or finds
    /// out what happened to it: the stored outcome to replay, or an error saying why nothing
    /// may run.
    pub async fn begin(
        &self,
        key: StoreKey,
        fingerprint: Fingerprint,
    ) -> Result<Begin, EngineError> {
        match self.try_begin(&key, &fingerprint).await? {
            Some(begin) => Ok(begin),
            None => self.wait_for(key, fingerprint).await,
        }
    }

    /// The first step of [`begin`](Self::begin): one claim. `None`: a live claim with the
    /// same fingerprint is running; [`wait_for`](Self::wait_for) it.
    pub(crate) async fn try_begin(
        &self,
        key: &StoreKey,
        fingerprint: &Fingerprint,
    ) -> Result<Option<Begin>, EngineError> {
        self.claim(key, fingerprint).await
    }

    /// The second step of [`begin`](Self::begin): the duplicate's policy once the original is
    /// known to be running.
    pub(crate) async fn wait_for(
        &self,
        key: StoreKey,
        fingerprint: Fingerprint,
    ) -> Result<Begin, EngineError> {
        match self.shared.config.in_progress {
            InProgressPolicy::Reject => {
                tracing::debug!(key = %key.log_id(), "duplicate rejected: original still running");
                Err(self.still_running())
            }
            InProgressPolicy::Wait { timeout } => self.wait(key, fingerprint, timeout).await,
        }
    }

    /// Runs `operation` unless it already ran (or is running) under `key`, and returns its
    /// output either way. A failing operation releases the key, so a redelivery runs it again.
    /// A panicking one releases it too (the claim's drop).
    pub async fn run_once<F, Fut, E>(
        &self,
        key: StoreKey,
        fingerprint: Fingerprint,
        operation: F,
    ) -> Result<Execution, RunError<E>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Bytes, E>>,
    {
        let claim = match self.begin(key, fingerprint).await? {
            Begin::Replay(output) => return Ok(Execution::Replayed(output)),
            Begin::Run(claim) => claim,
        };
        let result = claim.run(operation()).await;
        Self::settle(claim, result).await
    }

    /// Ends a claim by its operation's result: a success is completed (and replayed from
    /// then on), a failure releases the key so that a redelivery runs it again.
    pub(crate) async fn settle<E>(
        claim: Claim,
        result: Result<Bytes, E>,
    ) -> Result<Execution, RunError<E>> {
        match result {
            Ok(output) => match claim.complete(output.clone()).await {
                Ok(()) => Ok(Execution::Ran(output)),
                Err(source) => Err(RunError::NotRecorded { output, source }),
            },
            Err(error) => {
                let _ = claim.release().await;
                Err(RunError::Operation(error))
            }
        }
    }

    /// One atomic claim. `Ok(None)`: a live claim with the same fingerprint is running.
    async fn claim(
        &self,
        key: &StoreKey,
        fingerprint: &Fingerprint,
    ) -> Result<Option<Begin>, EngineError> {
        let claimed_at = Instant::now();
        let claim = self.bounded(
            self.backend()
                .claim(key, fingerprint, self.shared.config.lease),
        );
        let outcome = crate::metrics::store_call_since("claim", claimed_at.into_std(), claim)
            .await
            .map_err(|source| self.unavailable(key, source))?;
        match outcome {
            ClaimOutcome::Claimed(token) => {
                tracing::debug!(key = %key.log_id(), "claimed");
                crate::metrics::request(crate::metrics::EXECUTED);
                let in_flight = self.shared.in_flight.enter();
                let claim = Claim::new(
                    self.clone(),
                    key.clone(),
                    token,
                    *fingerprint,
                    claimed_at,
                    in_flight,
                );
                Ok(Some(Begin::Run(claim)))
            }
            ClaimOutcome::Existing(record) => self.existing(key, fingerprint, record),
        }
    }

    fn existing(
        &self,
        key: &StoreKey,
        fingerprint: &Fingerprint,
        record: Record,
    ) -> Result<Option<Begin>, EngineError> {
        if record.fingerprint() != fingerprint {
            tracing::debug!(key = %key.log_id(), "key reused with a different request");
            crate::metrics::request(crate::metrics::KEY_REUSED);
            return Err(EngineError::FingerprintMismatch);
        }
        match record {
            Record::Completed { payload, .. } => {
                tracing::debug!(key = %key.log_id(), "replaying stored outcome");
                crate::metrics::request(crate::metrics::REPLAYED);
                Ok(Some(Begin::Replay(payload)))
            }
            Record::InProgress { .. } => Ok(None),
        }
    }

    /// Waits for the running original to finish, then replays it; takes the key over if the
    /// original gave it up (released, or its lease ran out). The waiters of one key share one
    /// watch on the store (see `waiters`); past `max_waiters_per_key` a duplicate is told to
    /// come back later instead of waiting.
    async fn wait(
        &self,
        key: StoreKey,
        fingerprint: Fingerprint,
        timeout: Duration,
    ) -> Result<Begin, EngineError> {
        let span = tracing::debug_span!("idempotency.wait", key = %key.log_id());
        let _entered = span.enter();
        let _wait = crate::metrics::Wait::start();
        let deadline = Instant::now() + timeout;
        self.follow_completions();
        let Some(mut subscription) =
            self.shared
                .waiters
                .subscribe(&key, self.shared.config.max_waiters_per_key, |watch| {
                    tokio::spawn(self.clone().watch(key.clone(), watch))
                })
        else {
            tracing::warn!(key = %key.log_id(), "too many requests waiting on this key; answering in-progress");
            return Err(self.still_running());
        };
        loop {
            let seen = match tokio::time::timeout_at(deadline, subscription.next()).await {
                Ok(Some(seen)) => seen,
                Ok(None) | Err(_) => {
                    tracing::debug!("gave up waiting for the original request");
                    return Err(self.still_running());
                }
            };
            let decided = match seen {
                Seen::Record(record) => self.existing(&key, &fingerprint, record)?,
                #[cfg(feature = "sqlx")]
                Seen::Busy => None,
                // Released or expired: whoever claims next runs it — maybe us.
                Seen::Absent => self.claim(&key, &fingerprint).await?,
                Seen::Failed(error) => return Err(self.lookup_failed(&key, error)),
            };
            if let Some(begin) = decided {
                return Ok(begin);
            }
        }
    }

    /// The one store watch of a key: looks it up, publishes what it saw to the key's waiters,
    /// and looks again after a capped, doubling pause, or at once when asked. Runs until the
    /// last waiter leaves (which aborts it).
    async fn watch(self, key: StoreKey, watch: Arc<waiters::KeyWatch>) {
        let (engine, key) = (&self, &key);
        watch
            .poll(self.poll(), move || async move {
                let lookup = engine.bounded(engine.backend().lookup(key));
                match crate::metrics::store_call("lookup", lookup).await {
                    Ok(Some(record)) => Seen::Record(record),
                    Ok(None) => Seen::Absent,
                    Err(error) => Seen::Failed(Arc::new(error)),
                }
            })
            .await
    }

    pub(crate) fn still_running(&self) -> EngineError {
        crate::metrics::request(crate::metrics::IN_PROGRESS);
        EngineError::InProgress {
            retry_after: self.shared.config.retry_after,
        }
    }

    /// How long a request may wait for its turn: as long as a duplicate waits for its
    /// original, or, with the reject policy, one store call.
    #[cfg(feature = "sqlx")]
    pub(crate) fn wait_budget(&self) -> Duration {
        match self.shared.config.in_progress {
            InProgressPolicy::Wait { timeout } => timeout,
            InProgressPolicy::Reject => self.shared.config.store_timeout,
        }
    }

    /// The answer for a request whose turn at a busy database did not come within its wait.
    #[cfg(feature = "sqlx")]
    pub(crate) fn busy(&self, key: &StoreKey) -> EngineError {
        tracing::info!(key = %key.log_id(), "database busy with other writers; answering busy");
        crate::metrics::request(crate::metrics::BUSY);
        EngineError::Busy {
            retry_after: self.shared.config.retry_after,
        }
    }

    pub(crate) fn unavailable(&self, key: &StoreKey, source: StoreError) -> EngineError {
        if let StoreError::Corrupt { .. } = source {
            return unreadable(key, source);
        }
        tracing::warn!(key = %key.log_id(), error = %source, "idempotency store unavailable");
        crate::metrics::request(crate::metrics::STORE_UNAVAILABLE);
        EngineError::Store {
            retry_after: self.shared.config.retry_after,
            source,
        }
    }

    /// The answer for a waiter whose key's shared lookup failed with `error`.
    pub(crate) fn lookup_failed(&self, key: &StoreKey, error: Arc<StoreError>) -> EngineError {
        let source = match &*error {
            // Each waiter gets the store's own verdict, not a backend failure wrapping it.
            StoreError::Corrupt { backend, detail } => StoreError::Corrupt {
                backend,
                detail: detail.clone(),
            },
            _ => StoreError::backend("shared lookup", SharedError(error)),
        };
        self.unavailable(key, source)
    }

    /// Runs a fenced store write, retrying backend failures with backoff. A stale token is
    /// final: retrying cannot make it ours again.
    async fn with_retries<F, Fut>(
        &self,
        what: &'static str,
        key: &StoreKey,
        mut write: F,
    ) -> Result<(), StoreError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<(), StoreError>>,
    {
        let mut attempt = 0;
        loop {
            match crate::metrics::store_call(what, self.bounded(write())).await {
                Ok(()) => return Ok(()),
                Err(StoreError::StaleToken) => {
                    tracing::error!(key = %key.log_id(), what, "fenced write refused: the lease ran out and the key was taken over");
                    return Err(StoreError::StaleToken);
                }
                Err(error) if attempt + 1 < self.shared.config.complete_attempts => {
                    tracing::warn!(key = %key.log_id(), what, error = %error, attempt, "store write failed; retrying");
                    // Boxed: a rare path, kept out of the state of every write.
                    Box::pin(tokio::time::sleep(claim::backoff(attempt))).await;
                    attempt += 1;
                }
                Err(error) => {
                    tracing::error!(key = %key.log_id(), what, error = %error, "store write failed; giving up");
                    return Err(error);
                }
            }
        }
    }
}

/// The answer for a request whose key holds a record the store cannot read: permanent, so it
/// is logged as an error with what an operator needs to forget the record (its scope; the
/// client knows its key), and counted.
fn unreadable(key: &StoreKey, source: StoreError) -> EngineError {
    tracing::error!(key = %key.log_id(), scope = %key.scope(), error = %source, "the record under this key cannot be read; answering record-unreadable until an operator forgets it (Store::forget)");
    crate::metrics::request(crate::metrics::RECORD_UNREADABLE);
    EngineError::Unreadable { source }
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("config", &self.shared.config)
            .finish_non_exhaustive()
    }
}
