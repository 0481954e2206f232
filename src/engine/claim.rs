use std::{future::Future, time::Duration};

use bytes::Bytes;

use super::{in_flight::InFlightGuard, Engine};
use crate::{
    record::{StoreKey, Token},
    store::StoreError,
};

/// Ownership of a key: the caller won the claim and must run the operation.
///
/// Finish with [`complete`](Self::complete) (the outcome is replayed to duplicates) or
/// [`release`](Self::release) (a retry runs the operation again). A `Claim` dropped without
/// either — a panic, a cancelled task — releases itself in the background, so a key is never
/// left claimed by an owner that is gone.
#[must_use = "a claim must be completed or released"]
pub struct Claim {
    engine: Engine,
    key: StoreKey,
    token: Token,
    settled: bool,
    /// Counts this claim as in flight until it is completed or released (see
    /// [`Engine::drained`]).
    in_flight: Option<InFlightGuard>,
}

impl Claim {
    pub(super) fn new(
        engine: Engine,
        key: StoreKey,
        token: Token,
        in_flight: InFlightGuard,
    ) -> Self {
        Self {
            engine,
            key,
            token,
            settled: false,
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

    /// Drives `operation` while renewing the lease every third of its length, so a slow
    /// operation keeps its key for as long as it runs; the lease only runs out if this process
    /// stops renewing it (it died).
    pub async fn run<F: Future>(&self, operation: F) -> F::Output {
        let renew = async {
            let every = self.engine.config.renew_every();
            loop {
                tokio::time::sleep(every).await;
                let engine = &self.engine;
                match engine
                    .bounded(
                        engine
                            .store
                            .renew(&self.key, self.token, engine.config.lease),
                    )
                    .await
                {
                    Ok(()) => tracing::trace!(key = %self.key.log_id(), "lease renewed"),
                    Err(StoreError::StaleToken) => {
                        // Someone took the key over: renewing is pointless, and `complete`
                        // will be refused by the fence.
                        tracing::error!(key = %self.key.log_id(), "lease lost while the operation was running: renewals came too late");
                        std::future::pending::<()>().await;
                    }
                    Err(error) => {
                        tracing::warn!(key = %self.key.log_id(), error = %error, "lease renewal failed; will retry")
                    }
                }
            }
        };
        tokio::select! {
            output = operation => output,
            () = renew => unreachable!("the renewal loop never ends"),
        }
    }

    /// Records `payload` as the outcome and wakes waiting duplicates. A failing store is
    /// retried with backoff a few times; [`StoreError::StaleToken`] is final (the lease ran
    /// out and the key belongs to someone else).
    pub async fn complete(mut self, payload: Bytes) -> Result<(), StoreError> {
        self.settled = true;
        let engine = &self.engine;
        let result = engine
            .with_retries("complete", &self.key, || {
                engine.store.complete(
                    &self.key,
                    self.token,
                    payload.clone(),
                    engine.config.retention,
                )
            })
            .await;
        engine.waiters.wake(&self.key);
        result
    }

    /// Gives the key up so that the next request with it runs the operation again, and wakes
    /// waiting duplicates so one of them can take it.
    pub async fn release(mut self) -> Result<(), StoreError> {
        self.settled = true;
        release(&self.engine, &self.key, self.token).await
    }
}

async fn release(engine: &Engine, key: &StoreKey, token: Token) -> Result<(), StoreError> {
    let result = engine
        .with_retries("release", key, || engine.store.release(key, token))
        .await;
    engine.waiters.wake(key);
    result
}

impl Drop for Claim {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
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
