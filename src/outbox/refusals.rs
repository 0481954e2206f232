//! Rows the broker refuses: each one's own attempts, backoff and, past its limit, parking.

use std::time::Duration;

/// What an outbox does with a row the broker refuses (a RabbitMQ `mandatory` return or
/// publisher nack, a NATS subject no stream covers): the row gets another attempt after a
/// delay that doubles with each refusal, up to `max_delay`, and after `max_attempts` refusals
/// it is *parked*: set aside with its last error until an operator re-queues it
/// ([`SqlOutbox::requeue_parked`](super::SqlOutbox::requeue_parked)). The rows around it are
/// sent meanwhile.
///
/// Only the broker's verdict about a row counts. A batch that failed as a whole (the broker
/// unreachable, a time limit, a connection lost) spends no row's attempts: the relay tries the
/// batch again later, however long the outage lasts.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::outbox::RefusalPolicy;
///
/// // The defaults: 10 refusals, 1 s doubling up to 1 min between them (about 4 minutes).
/// let policy = RefusalPolicy::default();
/// assert_eq!(policy.max_attempts, 10);
/// assert_eq!(policy.delay_after(1), Duration::from_secs(1));
/// assert_eq!(policy.delay_after(3), Duration::from_secs(4));
/// assert_eq!(policy.delay_after(9), Duration::from_secs(60));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RefusalPolicy {
    /// Refusals a row may get; the one that reaches this number parks it (default 10; 0 and
    /// 1 both park at the first refusal).
    pub max_attempts: u32,
    /// The wait after a row's first refusal (default 1 s); each further refusal doubles it.
    pub first_delay: Duration,
    /// The longest wait between two attempts of one row (default 1 minute).
    pub max_delay: Duration,
}

impl Default for RefusalPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 10,
            first_delay: Duration::from_secs(1),
            max_delay: Duration::from_secs(60),
        }
    }
}

impl RefusalPolicy {
    /// The wait before the next attempt of a row refused `refusals` times (from 1).
    pub fn delay_after(&self, refusals: u32) -> Duration {
        let doublings = refusals.saturating_sub(1).min(31);
        self.first_delay
            .saturating_mul(1 << doublings)
            .min(self.max_delay.max(self.first_delay))
    }

    /// Whether the refusal that brings a row to `refusals` parks it.
    pub(super) fn parks(&self, refusals: u32) -> bool {
        refusals >= self.max_attempts
    }
}

/// A parked outbox row, as [`SqlOutbox::parked`](super::SqlOutbox::parked) lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ParkedRow {
    /// The row's sequence number (its place in the table's order).
    pub seq: i64,
    /// The event id, which [`requeue_parked`](super::SqlOutbox::requeue_parked) takes.
    pub id: String,
    /// The topic the broker refused.
    pub topic: String,
    /// The ordering key, if the event has one.
    pub key: Option<String>,
    /// How many times the broker refused it.
    pub attempts: u32,
    /// What the broker said the last time.
    pub last_error: Option<String>,
}

/// What the `last_error` column keeps of a refusal: enough to tell why, never a whole page.
pub(super) fn error_text(refusal: &crate::broker::Refusal) -> String {
    const MAX: usize = 1000;
    let mut text = refusal.to_string();
    if text.len() > MAX {
        let mut end = MAX;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_up_to_the_ceiling_and_never_overflow() {
        let policy = RefusalPolicy::default();
        assert_eq!(policy.delay_after(0), Duration::from_secs(1));
        assert_eq!(policy.delay_after(2), Duration::from_secs(2));
        assert_eq!(policy.delay_after(7), Duration::from_secs(60));
        assert_eq!(policy.delay_after(u32::MAX), Duration::from_secs(60));
        let slow = RefusalPolicy {
            first_delay: Duration::MAX,
            ..policy
        };
        assert_eq!(slow.delay_after(40), Duration::MAX);
    }

    #[test]
    fn the_refusal_that_reaches_the_limit_parks() {
        let policy = RefusalPolicy {
            max_attempts: 3,
            ..RefusalPolicy::default()
        };
        assert!(!policy.parks(2));
        assert!(policy.parks(3));
        let at_once = RefusalPolicy {
            max_attempts: 0,
            ..policy
        };
        assert!(at_once.parks(1));
    }
}
