//! The wait between two tries of something that failed for a reason outside the message:
//! reconnecting to a broker, probing a database that was down.

use std::time::Duration;

use rand::Rng;

/// Exponential backoff with "equal jitter" under a ceiling: the n-th wait is drawn from
/// `[d/2, d]` where `d = first * 2^(n-1)`, capped at `ceiling`. Half of each wait is
/// guaranteed, so a broker coming back is not hammered; the other half is random, so the
/// clients that lost it at the same moment do not come back in lockstep.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::broker::Backoff;
///
/// let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
/// let first = backoff.next_delay();
/// assert!(first >= Duration::from_millis(50) && first <= Duration::from_millis(100));
/// for _ in 0..20 {
///     assert!(backoff.next_delay() <= Duration::from_secs(5));
/// }
/// backoff.reset(); // it worked: the next failure starts small again
/// assert!(backoff.next_delay() <= Duration::from_millis(100));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backoff {
    first: Duration,
    ceiling: Duration,
    current: Duration,
}

impl Backoff {
    /// Waits from about `first`, doubling up to `ceiling` (at least `first`).
    pub fn new(first: Duration, ceiling: Duration) -> Self {
        Self {
            first,
            ceiling: ceiling.max(first),
            current: first,
        }
    }

    /// The next wait; the one after it is twice as long, up to the ceiling.
    pub fn next_delay(&mut self) -> Duration {
        let bound = self.current;
        self.current = (self.current * 2).min(self.ceiling);
        if bound.is_zero() {
            return bound;
        }
        rand::rng().random_range(bound / 2..=bound)
    }

    /// Sleeps [`next_delay`](Self::next_delay).
    pub async fn wait(&mut self) {
        tokio::time::sleep(self.next_delay()).await;
    }

    /// Starts over from `first`: call it once the thing worked again.
    pub fn reset(&mut self) {
        self.current = self.first;
    }
}

impl Default for Backoff {
    /// From 100 ms up to 5 s: reconnecting to a broker.
    fn default() -> Self {
        Self::new(Duration::from_millis(100), Duration::from_secs(5))
    }
}
