use std::time::Duration;

/// What a request does when it finds its key claimed by a request that is still running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum InProgressPolicy {
    /// Wait up to `timeout` for the running original to finish, then replay its outcome. Past
    /// the timeout, give up with [`EngineError::InProgress`](super::EngineError::InProgress).
    /// The waiters of one key in one process share a single watch on the store (woken the
    /// moment an owner in this process finishes, polling with capped backoff otherwise).
    Wait {
        /// The longest a duplicate waits.
        timeout: Duration,
    },
    /// Give up at once with [`EngineError::InProgress`](super::EngineError::InProgress)
    /// (HTTP: 409 + `Retry-After`).
    Reject,
}

/// Timing of the claim lifecycle. The defaults suit request handlers that finish in seconds.
/// Only [`EngineBuilder::build`](super::EngineBuilder::build) makes one, after checking it.
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
    /// The longest pause between polls when the store notifies completions: the polls then
    /// only back up a lost notification (or a rollback, which notifies nobody), starting at a
    /// tenth of it and doubling.
    pub(crate) notified_poll: Duration,
    /// What callers are told to wait before retrying (409 / 503 `Retry-After`).
    pub(crate) retry_after: Duration,
    /// How many times a failed `complete` is attempted before the outcome is given up on.
    pub(crate) complete_attempts: u32,
    /// The longest one store call may take before it counts as failed.
    pub(crate) store_timeout: Duration,
    /// The most requests of this process that may wait on one key at once.
    pub(crate) max_waiters_per_key: usize,
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
            notified_poll: Duration::from_secs(1),
            retry_after: Duration::from_secs(1),
            complete_attempts: 4,
            store_timeout: Duration::from_secs(5),
            max_waiters_per_key: 1024,
        }
    }
}

/// Durations are stored as signed 64-bit milliseconds by the SQL stores and added to the
/// clock by the others: anything longer is refused rather than wrapped or panicking.
const LONGEST: Duration = Duration::from_millis(i64::MAX as u64 / 2);

const NANOSECOND: Duration = Duration::from_nanos(1);

impl EngineConfig {
    /// The polling backoff of a key's watch: fast when polls are the only way to learn of an
    /// owner in another process finishing, slow when notifications tell it.
    pub(crate) fn poll(&self, notified: bool) -> (Duration, Duration) {
        if notified {
            (self.notified_poll / 10, self.notified_poll)
        } else {
            self.poll
        }
    }

    /// The renewal period: a quarter of the lease.
    pub(crate) fn renew_every(&self) -> Duration {
        self.lease / 4
    }

    /// The pause before retrying a renewal that failed: short, so that two failures in a row
    /// still leave time for a third attempt before the lease ends.
    pub(crate) fn renew_retry(&self) -> Duration {
        self.lease / 16
    }

    /// The worst case from a successful renewal to the end of the third attempt after it, when
    /// the first two fail only at the store timeout, plus a sixteenth of the lease for the
    /// drift between this process' clock and the store's. `None` on overflow.
    ///
    /// The lease must be strictly longer: every fence is strict (`expires_at > now`, Redis's
    /// PX), so an attempt that reaches the store exactly as the lease ends is refused. The
    /// spin model found both (model/README.md, finding 3): at equality, and at equality minus
    /// a tick with drift, a live owner lost its key and a duplicate ran the operation again.
    fn renewal_worst_case(&self) -> Option<Duration> {
        self.renew_every()
            .checked_add(self.store_timeout.checked_mul(3)?)?
            .checked_add(self.renew_retry().checked_mul(2)?)?
            .checked_add(self.lease / 16)
    }

    /// Checks every rule; the first one broken is the error.
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        if self.lease.is_zero() {
            return Err(ConfigError::ZeroLease);
        }
        if self.retention.is_zero() {
            return Err(ConfigError::ZeroRetention);
        }
        if self.store_timeout.is_zero() {
            return Err(ConfigError::ZeroStoreTimeout);
        }
        if self.max_waiters_per_key == 0 {
            return Err(ConfigError::ZeroWaiters);
        }
        if self.notified_poll.is_zero() {
            return Err(ConfigError::ZeroNotifiedPoll);
        }
        for (name, value) in [
            ("lease", self.lease),
            ("retention", self.retention),
            ("store_timeout", self.store_timeout),
            ("retry_after", self.retry_after),
            ("poll_when_notified", self.notified_poll),
        ] {
            if value > LONGEST || tokio::time::Instant::now().checked_add(value).is_none() {
                return Err(ConfigError::TooLong {
                    name,
                    value,
                    max: LONGEST,
                });
            }
        }
        if let InProgressPolicy::Wait { timeout } = self.in_progress {
            if timeout > LONGEST {
                return Err(ConfigError::TooLong {
                    name: "in_progress wait timeout",
                    value: timeout,
                    max: LONGEST,
                });
            }
        }
        match self.renewal_worst_case() {
            Some(worst) if worst < self.lease => Ok(()),
            _ => Err(ConfigError::LeaseTooShort {
                lease: self.lease,
                store_timeout: self.store_timeout,
                // lease/4 + 3 T + 3 lease/16 < lease  <=>  T < 3 lease / 16; the nanosecond
                // makes each suggestion land strictly on the accepted side.
                max_store_timeout: (self.lease * 3 / 16).saturating_sub(NANOSECOND),
                min_lease: (self.store_timeout.saturating_mul(16) / 3).saturating_add(NANOSECOND),
            }),
        }
    }
}

/// A timing configuration the engine refuses to run with, from
/// [`EngineBuilder::build`](super::EngineBuilder::build). Each variant is one rule; its message
/// says what to change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A zero lease would let every duplicate take the key over at once: no mutual exclusion.
    #[error("the lease is zero, which removes mutual exclusion between duplicates; set a lease of a few seconds or more")]
    ZeroLease,

    /// A zero retention would forget every outcome as soon as it is recorded.
    #[error("the retention is zero, so no outcome would ever be replayed; set it longer than your clients' retry horizon (default 24 h)")]
    ZeroRetention,

    /// A zero store timeout fails every store call.
    #[error("store_timeout is zero, so every store call would fail; set it to a few seconds at most a fifth of the lease")]
    ZeroStoreTimeout,

    /// A cap of zero waiters turns every concurrent duplicate into a 409.
    #[error("max_waiters_per_key is zero; use InProgressPolicy::Reject to refuse concurrent duplicates, or allow at least one waiter")]
    ZeroWaiters,

    /// A zero pause would make every waiter's watch poll the store in a busy loop.
    #[error("poll_when_notified is zero, which would poll the store in a busy loop; set it to a second or so")]
    ZeroNotifiedPoll,

    /// The lease cannot survive two failed renewals: the owner renews every quarter of the
    /// lease and retries a failure after a sixteenth of it, each attempt bounded by
    /// `store_timeout`, so `lease/4 + 3 × store_timeout + 2 × lease/16`, plus `lease/16` for
    /// clock drift, must be shorter than the lease (for the default 5 s store timeout, a lease
    /// over 26.7 s).
    #[error("a lease of {lease:?} does not survive two failed renewals of up to store_timeout = {store_timeout:?} each; set the lease to at least {min_lease:?} or store_timeout to at most {max_store_timeout:?}")]
    LeaseTooShort {
        /// The lease configured.
        lease: Duration,
        /// The store timeout configured.
        store_timeout: Duration,
        /// The shortest lease that works with this store timeout.
        min_lease: Duration,
        /// The longest store timeout that works with this lease.
        max_store_timeout: Duration,
    },

    /// A duration too long for the stores' clock arithmetic.
    #[error("{name} = {value:?} is longer than the stores can represent; use at most {max:?}")]
    TooLong {
        /// Which setting.
        name: &'static str,
        /// The value configured.
        value: Duration,
        /// The longest accepted.
        max: Duration,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(change: impl FnOnce(&mut EngineConfig)) -> Result<(), ConfigError> {
        let mut config = EngineConfig::default();
        change(&mut config);
        config.validate()
    }

    #[test]
    fn the_defaults_are_valid() {
        assert_eq!(with(|_| {}), Ok(()));
    }

    #[test]
    fn each_rule_is_its_own_error() {
        assert_eq!(
            with(|c| c.lease = Duration::ZERO),
            Err(ConfigError::ZeroLease)
        );
        assert_eq!(
            with(|c| c.retention = Duration::ZERO),
            Err(ConfigError::ZeroRetention)
        );
        assert_eq!(
            with(|c| c.store_timeout = Duration::ZERO),
            Err(ConfigError::ZeroStoreTimeout)
        );
        assert!(matches!(
            with(|c| c.lease = Duration::from_millis(10)),
            Err(ConfigError::LeaseTooShort { .. })
        ));
        assert!(matches!(
            with(|c| c.retention = Duration::MAX),
            Err(ConfigError::TooLong {
                name: "retention",
                ..
            })
        ));
        assert!(matches!(
            with(|c| c.lease = Duration::MAX),
            Err(ConfigError::TooLong { name: "lease", .. })
        ));
        assert!(matches!(
            with(|c| c.store_timeout = Duration::MAX),
            Err(ConfigError::TooLong { .. })
        ));
    }

    /// The old rule's boundary, where the model found a live owner losing its key: a 24 s lease
    /// with the default 5 s store timeout (in half-seconds: lease 48, timeout 10), and the
    /// same with one tick less of timeout but clocks that drift (lease 48, timeout 9).
    #[test]
    fn leases_the_model_showed_losing_a_live_owner_are_refused() {
        for (lease, store_timeout) in [(24_000, 5_000), (24_000, 4_500)] {
            let refused = with(|c| {
                c.lease = Duration::from_millis(lease);
                c.store_timeout = Duration::from_millis(store_timeout);
            });
            assert!(
                matches!(refused, Err(ConfigError::LeaseTooShort { .. })),
                "lease {lease} ms, store timeout {store_timeout} ms: {refused:?}"
            );
        }
        // What the model checked to hold with drift: lease 48, timeout 8, skew 1.
        assert_eq!(
            with(|c| {
                c.lease = Duration::from_millis(24_000);
                c.store_timeout = Duration::from_millis(4_000);
            }),
            Ok(())
        );
    }

    #[test]
    fn the_suggested_fix_is_accepted() {
        let Err(ConfigError::LeaseTooShort {
            min_lease,
            max_store_timeout,
            ..
        }) = with(|c| c.lease = Duration::from_secs(2))
        else {
            panic!("a 2 s lease with a 5 s store timeout must be refused")
        };
        assert_eq!(with(|c| c.lease = min_lease), Ok(()));
        assert!(
            with(|c| c.lease = min_lease - NANOSECOND * 16).is_err(),
            "the suggestion is the shortest lease, not just one that works"
        );
        assert_eq!(
            with(|c| {
                c.lease = Duration::from_secs(2);
                c.store_timeout = max_store_timeout;
            }),
            Ok(())
        );
    }
}
