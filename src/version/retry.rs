use std::{future::Future, time::Duration};

use rand::Rng;

use super::VersionedUpdate;

/// How often and how patiently [`retry_on_conflict`] tries again.
///
/// Delays grow exponentially from `base_delay` up to `max_delay`, and each actual wait is
/// drawn uniformly from `[0, delay]` ("full jitter") so that the writers that just collided
/// do not collide again in lockstep.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::version::RetryPolicy;
/// let policy = RetryPolicy::default()
///     .max_attempts(8)
///     .base_delay(Duration::from_millis(5))
///     .max_delay(Duration::from_millis(200));
/// assert_eq!(policy.attempts(), 8);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryPolicy {
    max_attempts: u32,
    base_delay: Duration,
    max_delay: Duration,
}

impl Default for RetryPolicy {
    /// 5 attempts, delays from 10 ms doubling up to 1 s.
    fn default() -> Self {
        Self {
            max_attempts: 5,
            base_delay: Duration::from_millis(10),
            max_delay: Duration::from_secs(1),
        }
    }
}

impl RetryPolicy {
    /// How many times the operation runs at most, the first run included (at least 1).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// The delay bound before the second attempt; it doubles for each further attempt.
    pub fn base_delay(mut self, delay: Duration) -> Self {
        self.base_delay = delay;
        self
    }

    /// The largest delay bound.
    pub fn max_delay(mut self, delay: Duration) -> Self {
        self.max_delay = delay;
        self
    }

    /// The configured number of attempts.
    pub fn attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The jittered wait after failed attempt number `failed` (1-based).
    fn delay_after(&self, failed: u32) -> Duration {
        let factor = 1u32
            .checked_shl(failed.saturating_sub(1))
            .unwrap_or(u32::MAX);
        let bound = self
            .base_delay
            .checked_mul(factor)
            .unwrap_or(self.max_delay)
            .min(self.max_delay);
        if bound.is_zero() {
            return bound;
        }
        rand::rng().random_range(Duration::ZERO..=bound)
    }
}

/// Outcomes that can say "lost an optimistic race; running again may succeed".
pub trait IsConflict {
    /// True when the outcome is a conflict worth retrying.
    fn is_conflict(&self) -> bool;
}

impl<R> IsConflict for VersionedUpdate<R> {
    fn is_conflict(&self) -> bool {
        VersionedUpdate::is_conflict(self)
    }
}

/// An error is never retried: only a successful run that reports a conflict is.
impl<T: IsConflict, E> IsConflict for Result<T, E> {
    fn is_conflict(&self) -> bool {
        self.as_ref().is_ok_and(IsConflict::is_conflict)
    }
}

/// Runs `attempt` until it returns something other than a conflict, at most
/// [`RetryPolicy::max_attempts`] times, sleeping a jittered, exponentially growing delay
/// between runs.
///
/// `attempt` must redo the whole read-modify-write each time: read the row (and its
/// version) afresh, compute the new values, then call `update_if_version` with the version
/// it just read. Errors are returned at once, never retried. When the attempts run out the
/// last conflict is returned.
///
/// ```
/// use tower_idempotency::version::{retry_on_conflict, MemoryVersioned, RetryPolicy};
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let counters = MemoryVersioned::new();
/// let _ = counters.insert_new("hits", 0u64);
/// let outcome = retry_on_conflict(&RetryPolicy::default(), || async {
///     let current = counters.get(&"hits").expect("created above");
///     Ok::<_, std::convert::Infallible>(counters.update_if_version(
///         &"hits",
///         current.version,
///         |hits| *hits += 1,
///     ))
/// })
/// .await
/// .unwrap();
/// assert!(outcome.is_updated());
/// # }
/// ```
pub async fn retry_on_conflict<T, F, Fut>(policy: &RetryPolicy, mut attempt: F) -> T
where
    T: IsConflict,
    F: FnMut() -> Fut,
    Fut: Future<Output = T>,
{
    let mut failed = 0;
    loop {
        let outcome = attempt().await;
        failed += 1;
        if !outcome.is_conflict() || failed >= policy.max_attempts {
            return outcome;
        }
        tracing::debug!(attempt = failed, "optimistic update conflicted; retrying");
        tokio::time::sleep(policy.delay_after(failed)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_and_stay_bounded() {
        let policy = RetryPolicy::default()
            .base_delay(Duration::from_millis(10))
            .max_delay(Duration::from_millis(50));
        for _ in 0..100 {
            assert!(policy.delay_after(1) <= Duration::from_millis(10));
            assert!(policy.delay_after(3) <= Duration::from_millis(40));
            assert!(policy.delay_after(40) <= Duration::from_millis(50));
        }
    }
}
