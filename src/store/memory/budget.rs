//! The memory store's byte budget: what its records may hold, and the "store full" episode
//! it logs once.

use crate::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Bytes charged against a fixed maximum, shared by all shards.
#[derive(Debug)]
pub(super) struct Budget {
    max: u64,
    used: AtomicU64,
    refused: AtomicU64,
    /// Set while refusing; the warning is logged when it turns on, so a storm against a full
    /// store logs one line, not one per request.
    full: AtomicBool,
}

impl Budget {
    pub(super) fn new(max: u64) -> Self {
        Self {
            max,
            used: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            full: AtomicBool::new(false),
        }
    }

    pub(super) fn max(&self) -> u64 {
        self.max
    }

    pub(super) fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    pub(super) fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Takes `bytes` for a new record if they fit.
    pub(super) fn try_take(&self, bytes: u64) -> bool {
        let fits = self
            .used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |used| {
                used.checked_add(bytes).filter(|&after| after <= self.max)
            })
            .is_ok();
        if fits && self.full.load(Ordering::Relaxed) && self.used() <= self.max / 10 * 9 {
            // Only once usage fell clearly below the maximum, so that a store hovering at its
            // limit does not log an episode per record.
            if self.full.swap(false, Ordering::Relaxed) {
                tracing::info!(
                    used_bytes = self.used(),
                    max_bytes = self.max,
                    "the idempotency memory store accepts new keys again"
                );
            }
        }
        fits
    }

    /// Takes `bytes` whether or not they fit: the payload of a claim admitted earlier, whose
    /// operation has already run and whose outcome must not be lost.
    pub(super) fn take(&self, bytes: u64) {
        self.used.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Gives back `bytes` of removed or shrunk records.
    pub(super) fn give_back(&self, bytes: u64) {
        if bytes > 0 {
            self.used.fetch_sub(bytes, Ordering::Relaxed);
        }
    }

    /// Counts a refused claim and logs the start of a "full" episode; true when this refusal
    /// started one.
    pub(super) fn refuse(&self) -> bool {
        self.refused.fetch_add(1, Ordering::Relaxed);
        let starts = !self.full.swap(true, Ordering::Relaxed);
        if starts {
            tracing::warn!(
                used_bytes = self.used(),
                max_bytes = self.max,
                "the idempotency memory store is full: new keys are refused (503) until records \
                 expire; raise MemoryStoreBuilder::max_bytes or shorten the retention"
            );
        }
        starts
    }
}

#[cfg(test)]
mod tests {
    use super::Budget;

    #[test]
    fn one_warning_per_episode_of_refusals() {
        let budget = Budget::new(100);
        assert!(budget.try_take(100));
        assert!(!budget.try_take(1));
        assert!(budget.refuse(), "the first refusal starts an episode");
        assert!(!budget.refuse(), "later ones belong to it");
        // Room again, but still above 90%: the same episode.
        budget.give_back(5);
        assert!(budget.try_take(1));
        assert!(!budget.refuse());
        // Clearly below the limit: the episode ends with the next admitted claim.
        budget.give_back(50);
        assert!(budget.try_take(1));
        assert!(budget.refuse(), "a new episode warns again");
        assert_eq!(budget.refused(), 4);
    }
}
