//! Which offset a Kafka consumer may commit, per partition, when messages are handled
//! concurrently and settle out of order: the committed position is the first offset not yet
//! settled, so only the contiguous prefix of settled offsets counts (offsets are taken in the
//! order they were received, so gaps in the log, from compaction or transaction markers, are
//! no holes).
//!
//! Each assignment of a partition is a generation of its own: when the partition is revoked
//! its tracking is dropped, and a late settle from the old generation (a handler that
//! finished after its partition moved away) neither commits nor disturbs the new one.

use std::collections::{BTreeMap, HashMap};

/// A partition of a topic.
pub(crate) type Partition = (String, i32);

/// Where one received message sits: its partition, its offset, its assignment generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Position {
    pub(crate) partition: Partition,
    pub(crate) offset: i64,
    pub(crate) generation: u64,
}

#[derive(Debug, Default)]
struct Tracked {
    generation: u64,
    /// Offsets received and not yet part of the committed prefix: `true` once settled.
    open: BTreeMap<i64, bool>,
}

/// The offsets in flight, per partition. Not thread-safe by itself: the subscriber keeps it
/// under a lock shared with its rebalance callback.
#[derive(Debug, Default)]
pub(crate) struct Offsets {
    partitions: HashMap<Partition, Tracked>,
    next_generation: u64,
}

impl Offsets {
    /// A message at `offset` of `partition` was received; returns its position.
    pub(crate) fn received(&mut self, partition: Partition, offset: i64) -> Position {
        let next_generation = &mut self.next_generation;
        let tracked = self.partitions.entry(partition.clone()).or_insert_with(|| {
            *next_generation += 1;
            Tracked {
                generation: *next_generation,
                open: BTreeMap::new(),
            }
        });
        // A message received again (fetched anew after a seek) keeps its settled mark.
        tracked.open.entry(offset).or_insert(false);
        Position {
            partition,
            offset,
            generation: tracked.generation,
        }
    }

    /// The message at `position` is settled (its inbox transaction committed, or it was
    /// dead-lettered). Returns the offset to commit when the prefix grew: the first offset
    /// not settled, or one past the last one received. `None` when the prefix did not grow
    /// or the position belongs to a revoked generation.
    pub(crate) fn settled(&mut self, position: &Position) -> Option<i64> {
        let tracked = self.partitions.get_mut(&position.partition)?;
        if tracked.generation != position.generation {
            return None;
        }
        *tracked.open.get_mut(&position.offset)? = true;
        let mut commit = None;
        while let Some(entry) = tracked.open.first_entry() {
            if !*entry.get() {
                break;
            }
            commit = Some(entry.key() + 1);
            entry.remove();
        }
        commit.map(|past_last| {
            // The next open offset, if one is known, is where reading resumes.
            tracked
                .open
                .first_key_value()
                .map_or(past_last, |(&next, _)| next)
        })
    }

    /// Whether `position` still belongs to the partition's current assignment.
    pub(crate) fn is_current(&self, position: &Position) -> bool {
        self.partitions
            .get(&position.partition)
            .is_some_and(|tracked| tracked.generation == position.generation)
    }

    /// The partition was revoked: forget what was in flight on it.
    pub(crate) fn revoke(&mut self, partition: &Partition) {
        self.partitions.remove(partition);
    }

    /// Every partition was revoked (the consumer left the group or lost its assignment).
    pub(crate) fn revoke_all(&mut self) {
        self.partitions.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn part(p: i32) -> Partition {
        ("t".to_owned(), p)
    }

    #[test]
    fn commits_only_the_settled_prefix() {
        let mut offsets = Offsets::default();
        let a = offsets.received(part(0), 10);
        let b = offsets.received(part(0), 11);
        let c = offsets.received(part(0), 14); // a gap: compaction or a transaction marker
        assert_eq!(offsets.settled(&b), None, "10 is still open");
        assert_eq!(offsets.settled(&a), Some(14), "10 and 11 done, 14 open");
        assert_eq!(offsets.settled(&c), Some(15));
        assert_eq!(offsets.settled(&c), None, "settling twice changes nothing");
    }

    #[test]
    fn a_revoked_generation_never_commits() {
        let mut offsets = Offsets::default();
        let old = offsets.received(part(0), 5);
        offsets.revoke(&part(0));
        let new = offsets.received(part(0), 5);
        assert!(!offsets.is_current(&old));
        assert_eq!(offsets.settled(&old), None);
        assert_eq!(offsets.settled(&new), Some(6));
    }

    /// Gaps between consecutive offsets, and an order to settle them in.
    fn log_and_settle_order() -> impl Strategy<Value = (Vec<i64>, Vec<usize>)> {
        proptest::collection::vec(1i64..4, 1..40).prop_flat_map(|gaps| {
            let order = Just((0..gaps.len()).collect::<Vec<_>>()).prop_shuffle();
            (Just(gaps), order)
        })
    }

    // mutant: `settled` skips open offsets instead of stopping at the first (commits past
    // a message still in flight) -> both tests above and this one fail.
    proptest! {
        /// Whatever order the messages of a partition settle in, each commit is the first
        /// offset not settled yet (or one past the last received), and commits only grow.
        #[test]
        fn every_commit_is_the_first_unsettled_offset((gaps, order) in log_and_settle_order()) {
            let mut offsets = Offsets::default();
            let mut at = 100;
            let positions: Vec<Position> = gaps
                .iter()
                .map(|gap| {
                    at += gap;
                    offsets.received(part(1), at)
                })
                .collect();
            let mut settled = vec![false; positions.len()];
            let mut last = positions[0].offset;
            for i in order {
                settled[i] = true;
                let expected = settled
                    .iter()
                    .position(|done| !done)
                    .map_or(positions.last().unwrap().offset + 1, |open| positions[open].offset);
                match offsets.settled(&positions[i]) {
                    Some(commit) => {
                        prop_assert_eq!(commit, expected);
                        prop_assert!(commit > last);
                        last = commit;
                    }
                    None => prop_assert_eq!(last, expected),
                }
            }
            prop_assert_eq!(last, positions.last().unwrap().offset + 1);
        }
    }
}
