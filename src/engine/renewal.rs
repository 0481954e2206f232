//! Keeping a claim's lease alive while its operation runs, in a task of its own.
//!
//! The renewal runs beside the operation rather than inside its future, so an operation that
//! blocks its thread, or is not polled for a while, cannot starve it. It renews every quarter
//! of the lease and retries a failure after a sixteenth, each attempt bounded by the store
//! timeout; [`EngineConfig::validate`](super::config) refuses timings under which two failed
//! attempts in a row would outlast the lease.

use std::sync::Arc;

use tokio::{task::JoinHandle, time::Instant};

use super::{status::LostFlag, Engine};
use crate::{
    record::{StoreKey, Token},
    store::StoreError,
};

/// The running renewal of one claim; aborted when the claim settles.
#[derive(Debug)]
pub(crate) struct Renewal {
    task: JoinHandle<()>,
}

impl Renewal {
    /// Starts renewing. `claimed_at` is taken before the claim was sent, so this process' idea
    /// of when the lease ends is never later than the store's.
    pub(crate) fn start(
        engine: Engine,
        key: StoreKey,
        token: Token,
        claimed_at: Instant,
        lost: Arc<LostFlag>,
    ) -> Self {
        let task = tokio::spawn(renew(engine, key, token, claimed_at, lost));
        Self { task }
    }

    pub(crate) fn stop(&self) {
        self.task.abort();
    }
}

impl Drop for Renewal {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn renew(
    engine: Engine,
    key: StoreKey,
    token: Token,
    claimed_at: Instant,
    lost: Arc<LostFlag>,
) {
    let config = &engine.config;
    let mut held_until = claimed_at + config.lease;
    let mut next = claimed_at + config.renew_every();
    loop {
        tokio::time::sleep_until(next).await;
        let attempt = Instant::now();
        match engine
            .bounded(engine.store.renew(&key, token, config.lease))
            .await
        {
            Ok(()) => {
                tracing::trace!(key = %key.log_id(), "lease renewed");
                held_until = attempt + config.lease;
                next = attempt + config.renew_every();
            }
            Err(StoreError::StaleToken) => {
                tracing::error!(key = %key.log_id(), "lease lost while the operation was running: another request took the key over");
                lost.set();
                return;
            }
            Err(error) if Instant::now() >= held_until => {
                tracing::error!(key = %key.log_id(), error = %error, "lease ran out while renewals failed; a duplicate may run the operation again");
                lost.set();
                return;
            }
            Err(error) => {
                tracing::warn!(key = %key.log_id(), error = %error, "lease renewal failed; retrying soon");
                next = Instant::now() + config.renew_retry();
            }
        }
    }
}
