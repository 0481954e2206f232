//! The optional wait for replicas after a claim (`WAIT <replicas> <ms>`).
//!
//! Redis replicates asynchronously: a claim the master acknowledged can be lost when the
//! master dies before its replica received it, and a duplicate arriving at the promoted
//! replica then runs the operation a second time. Waiting for a replica's acknowledgement
//! before the handler runs closes that window, at the cost of one replication round trip per
//! claim.

use std::time::Duration;

/// The longest wait sent to Redis (one hour); longer settings are cut to it rather than
/// refused, so the setter cannot fail.
const MAX_TIMEOUT_MS: u64 = 60 * 60 * 1000;

/// How many replicas must hold a claim, and how long to wait for them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ReplicaWait {
    pub(super) replicas: u32,
    /// Whole milliseconds, at least 1: `WAIT n 0` would block forever.
    pub(super) timeout_ms: u64,
}

impl ReplicaWait {
    /// `None` for zero replicas (the wait is off).
    pub(super) fn new(replicas: u32, timeout: Duration) -> Option<Self> {
        let millis = timeout.as_nanos().div_ceil(1_000_000);
        let timeout_ms = u64::try_from(millis)
            .unwrap_or(MAX_TIMEOUT_MS)
            .clamp(1, MAX_TIMEOUT_MS);
        (replicas > 0).then_some(Self {
            replicas,
            timeout_ms,
        })
    }

    /// The error for a claim that fewer than `replicas` acknowledged in time.
    pub(super) fn fell_short(self, acknowledged: i64) -> ReplicaWaitTimedOut {
        ReplicaWaitTimedOut {
            acknowledged: u32::try_from(acknowledged.max(0)).unwrap_or(u32::MAX),
            wanted: self.replicas,
            timeout: Duration::from_millis(self.timeout_ms),
        }
    }
}

/// The source of the [`StoreError::Backend`](crate::store::StoreError::Backend) a claim fails
/// with when [`RedisStoreBuilder::wait_for_replicas`](super::RedisStoreBuilder::wait_for_replicas)
/// is set and too few replicas acknowledged the claim in time. The claim was withdrawn and
/// the handler did not run (HTTP: 503), so the client's retry is safe.
///
/// ```
/// use tower_idempotency::store::{ReplicaWaitTimedOut, StoreError};
/// fn replicas_lagging(error: &StoreError) -> bool {
///     std::error::Error::source(error)
///         .is_some_and(|source| source.downcast_ref::<ReplicaWaitTimedOut>().is_some())
/// }
/// # let _ = replicas_lagging;
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the claim reached {acknowledged} of {wanted} replica(s) within {timeout:?}, so it was \
     withdrawn and the operation did not run; retry later, and check that the master has \
     healthy replicas (or raise the replica wait timeout)"
)]
pub struct ReplicaWaitTimedOut {
    /// How many replicas acknowledged the claim.
    pub acknowledged: u32,
    /// How many were required.
    pub wanted: u32,
    /// How long the store waited.
    pub timeout: Duration,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_replicas_is_off_and_timeouts_stay_in_range() {
        assert_eq!(ReplicaWait::new(0, Duration::from_secs(1)), None);
        let at_least_one_ms = ReplicaWait::new(1, Duration::ZERO).unwrap();
        assert_eq!(at_least_one_ms.timeout_ms, 1);
        assert_eq!(
            ReplicaWait::new(1, Duration::from_micros(1500))
                .unwrap()
                .timeout_ms,
            2
        );
        assert_eq!(
            ReplicaWait::new(2, Duration::MAX).unwrap().timeout_ms,
            MAX_TIMEOUT_MS
        );
    }
}
