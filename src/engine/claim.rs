use std::{future::Future, time::Duration};

use bytes::Bytes;
use tokio::time::Instant;

use super::{
    in_flight::InFlightGuard,
    renewal::Renewal,
    status::{ClaimStatus, LostFlag},
    Engine,
};
use crate::{
    record::{Fingerprint, Record, StoreKey, Token},
    store::StoreError,
};

/// Ownership of a key: the caller won the claim and must run the operation.
///
/// While a `Claim` exists its lease is renewed beside the operation (every quarter of the
/// lease, retrying failures promptly; a claim gets a task of its own when its first renewal is
/// due), so the operation keeps the key however long it runs and whatever it does with its
/// thread; [`status`](Self::status) tells it if the key was lost
/// anyway. Finish with [`complete`](Self::complete) (the outcome is replayed to duplicates) or
/// [`release`](Self::release) (a retry runs the operation again). A `Claim` dropped without
/// either — a panic, a cancelled task — releases itself in the background, so a key is never
/// left claimed by an owner that is gone.
#[must_use = "a claim must be completed or released"]
pub struct Claim {
    engine: Engine,
    key: StoreKey,
    token: Token,
    fingerprint: Fingerprint,
    settled: bool,
    lost: LostFlag,
    renewal: Renewal,
    /// Counts this claim as in flight until it is completed or released (see
    /// [`Engine::drained`]).
    in_flight: Option<InFlightGuard>,
}

impl Claim {
    pub(super) fn new(
        engine: Engine,
        key: StoreKey,
        token: Token,
        fingerprint: Fingerprint,
        claimed_at: Instant,
        in_flight: InFlightGuard,
    ) -> Self {
        let lost = LostFlag::new(claimed_at + engine.shared.config.lease);
        let renewal = Renewal::start(engine.clone(), key.clone(), token, claimed_at, lost.clone());
        Self {
            engine,
            key,
            token,
            fingerprint,
            settled: false,
            lost,
            renewal,
            in_flight: Some(in_flight),
        }
    }

    /// The claimed key.
    pub fn key(&self) -> &StoreKey {
        &self.key
    }

    /// This claim's fencing token.
    pub fn token(&self) -> Token {
        self.token
    }

    /// The fingerprint of the request that won the claim.
    pub(crate) fn fingerprint(&self) -> Fingerprint {
        self.fingerprint
    }

    /// How long the outcome (and a step journal's entries) are kept.
    pub(crate) fn retention(&self) -> Duration {
        self.engine.shared.config.retention
    }

    /// A handle that says whether this claim was lost while the operation ran.
    pub fn status(&self) -> ClaimStatus {
        self.lost.status()
    }

    /// Drives `operation` to its end. The lease is renewed by the claim's own task whether or
    /// not the operation runs under `run`; this is kept so call sites read as "run under the
    /// claim".
    pub async fn run<F: Future>(&self, operation: F) -> F::Output {
        operation.await
    }

    /// Records `payload` as the outcome and wakes waiting duplicates. A failing store is
    /// retried with backoff a few times. When a write failed or timed out, the record is
    /// looked up before an error is reported: a write that committed although its answer was
    /// lost counts as recorded. [`StoreError::StaleToken`] otherwise means the lease ran out
    /// and the key belongs to someone else.
    pub async fn complete(mut self, payload: Bytes) -> Result<(), StoreError> {
        self.settle();
        let engine = &self.engine;
        let mut result = engine
            .with_retries("complete", &self.key, || {
                engine.backend().complete(
                    &self.key,
                    self.token,
                    payload.clone(),
                    engine.shared.config.retention,
                )
            })
            .await;
        // Boxed: a rare path, kept out of the state of every completion.
        if result.is_err() && Box::pin(self.recorded(&payload)).await {
            tracing::info!(key = %self.key.log_id(), "the outcome was recorded although the store's answer was lost");
            result = Ok(());
        }
        engine.shared.waiters.wake(&self.key);
        result
    }

    /// Whether the store holds our outcome: completed, with our fingerprint and payload.
    async fn recorded(&self, payload: &Bytes) -> bool {
        match self
            .engine
            .bounded(self.engine.backend().lookup(&self.key))
            .await
        {
            Ok(Some(Record::Completed {
                fingerprint,
                payload: stored,
            })) => fingerprint == self.fingerprint && stored == *payload,
            Ok(_) => false,
            Err(error) => {
                tracing::warn!(key = %self.key.log_id(), error = %error, "could not check whether the outcome was recorded");
                false
            }
        }
    }

    /// Gives the key up so that the next request with it runs the operation again, and wakes
    /// waiting duplicates so one of them can take it.
    pub async fn release(mut self) -> Result<(), StoreError> {
        self.settle();
        release(&self.engine, &self.key, self.token).await
    }

    /// No more renewals: a renewal landing after `complete` would be refused and mistaken for
    /// a lost lease.
    fn settle(&mut self) {
        self.settled = true;
        self.renewal.stop();
        self.lost.settled();
    }
}

async fn release(engine: &Engine, key: &StoreKey, token: Token) -> Result<(), StoreError> {
    let result = engine
        .with_retries("release", key, || engine.backend().release(key, token))
        .await;
    engine.shared.waiters.wake(key);
    result
}

impl Drop for Claim {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        self.renewal.stop();
        self.lost.settled();
        let (engine, key, token) = (self.engine.clone(), self.key.clone(), self.token);
        let in_flight = self.in_flight.take();
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                tracing::debug!(key = %key.log_id(), "claim dropped unfinished; releasing it");
                runtime.spawn(async move {
                    let _ = release(&engine, &key, token).await;
                    // Still in flight until the release is done.
                    drop(in_flight);
                });
            }
            // Without a runtime nothing can run the release; the lease ends the claim.
            Err(_) => {
                tracing::warn!(key = %key.log_id(), "claim dropped outside a tokio runtime; it ends when its lease runs out")
            }
        }
    }
}

impl std::fmt::Debug for Claim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Claim")
            .field("key", &self.key)
            .field("token", &self.token)
            .finish()
    }
}

pub(super) fn backoff(attempt: u32) -> Duration {
    Duration::from_millis(25u64 << attempt.min(6))
}
