//! [`EngineBuilder`]: the timings of an [`Engine`], checked once when it is built.

use std::{sync::Arc, time::Duration};

use super::{config::EngineConfig, ConfigError, Engine, InProgressPolicy};
use crate::store::Store;

/// Collects an [`Engine`]'s timings; [`build`](Self::build) checks them together. The setters
/// never fail, so a chain reads in any order; every rule is enforced by `build`, with a
/// [`ConfigError`] naming what to change.
#[derive(Clone)]
#[must_use = "call .build() to get the engine"]
pub struct EngineBuilder {
    store: Arc<dyn Store>,
    config: EngineConfig,
}

impl EngineBuilder {
    pub(super) fn new(store: Arc<dyn Store>) -> Self {
        Self {
            store,
            config: EngineConfig::default(),
        }
    }

    /// How long a claim survives without renewal, i.e. after its owner died (default 30 s).
    /// The owner renews it every quarter of this from a task of its own and retries a failed
    /// renewal after a sixteenth, so it must leave room for two failed renewals of up to
    /// [`store_timeout`](Self::store_timeout) each.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.config.lease = lease;
        self
    }

    /// How long a completed outcome is replayed (default 24 h). After it, the same key is a
    /// new request and runs again.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.config.retention = retention;
        self
    }

    /// What a duplicate does while the original is still running (default: wait up to 10 s).
    pub fn in_progress(mut self, policy: InProgressPolicy) -> Self {
        self.config.in_progress = policy;
        self
    }

    /// The delay suggested to callers told to come back later (default 1 s).
    pub fn retry_after(mut self, delay: Duration) -> Self {
        self.config.retry_after = delay;
        self
    }

    /// The longest a single store call may take (default 5 s). Past it the call counts as a
    /// store failure: a claim answers "unavailable" (HTTP 503) instead of hanging on a
    /// network that went silent, a `complete` is retried, a renewal is retried.
    pub fn store_timeout(mut self, limit: Duration) -> Self {
        self.config.store_timeout = limit;
        self
    }

    /// The most requests of this process that may wait on one key at once (default 1024);
    /// more duplicates are answered "in progress" (HTTP 409 + `Retry-After`) at once.
    pub fn max_waiters_per_key(mut self, max: usize) -> Self {
        self.config.max_waiters_per_key = max;
        self
    }

    /// The longest pause between two looks at a key that another process is running, when the
    /// store notifies completions (default 1 s; PostgreSQL and Redis do, see
    /// [`Store::completions`]). Waiters are woken by the notification; these looks, starting
    /// at a tenth of this and doubling, only back up a lost notification or an owner that
    /// vanished without one (a lease that ran out, a rolled-back transaction of another
    /// process). Stores without notifications poll fast instead (5 ms doubling to 250 ms).
    pub fn poll_when_notified(mut self, max: Duration) -> Self {
        self.config.notified_poll = max;
        self
    }

    /// Checks the timings together and builds the engine.
    pub fn build(self) -> Result<Engine, ConfigError> {
        self.config.validate()?;
        Ok(Engine::with_config(self.store, self.config))
    }
}

impl std::fmt::Debug for EngineBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineBuilder")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}
