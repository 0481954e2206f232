use std::time::Duration;

/// What a request does when it finds its key claimed by a request that is still running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum InProgressPolicy {
    /// Wait up to `timeout` for the running request to finish, then replay its outcome. Past
    /// the timeout, give up with [`EngineError::InProgress`](super::EngineError::InProgress).
    /// Waiters in the owner's process are woken the moment it finishes; waiters elsewhere
    /// poll the store with capped exponential backoff.
    Wait {
        /// The longest a duplicate waits.
        timeout: Duration,
    },
    /// Give up at once with [`EngineError::InProgress`](super::EngineError::InProgress)
    /// (HTTP: 409 + `Retry-After`).
    Reject,
}

/// Timing of the claim lifecycle. The defaults suit request handlers that finish in seconds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EngineConfig {
    /// How long a claim survives without renewal, i.e. after its owner died.
    pub(crate) lease: Duration,
    /// How long a completed outcome is replayed.
    pub(crate) retention: Duration,
    pub(crate) in_progress: InProgressPolicy,
    /// Backoff between polls of the store while waiting: starts at the first, doubles, capped
    /// at the second.
    pub(crate) poll: (Duration, Duration),
    /// What callers are told to wait before retrying (409 / 503 `Retry-After`).
    pub(crate) retry_after: Duration,
    /// How many times a failed `complete` is attempted before the outcome is given up on.
    pub(crate) complete_attempts: u32,
    /// The longest one store call may take before it counts as failed.
    pub(crate) store_timeout: Duration,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(24 * 60 * 60),
            in_progress: InProgressPolicy::Wait {
                timeout: Duration::from_secs(10),
            },
            poll: (Duration::from_millis(5), Duration::from_millis(250)),
            retry_after: Duration::from_secs(1),
            complete_attempts: 4,
            store_timeout: Duration::from_secs(5),
        }
    }
}

impl EngineConfig {
    /// The renewal period: a third of the lease, so two renewals can fail before it runs out.
    pub(crate) fn renew_every(&self) -> Duration {
        (self.lease / 3).max(Duration::from_millis(10))
    }
}
