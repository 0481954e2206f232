//! Shuttle schedules of the memory store's races (`scripts/shuttle`): tasks claiming one key,
//! a completion racing a takeover of a released key, and claims on different shards racing
//! for the last room in the budget while an expired record waits to be evicted.
//!
//! Every lock and atomic the store touches is shuttle's here (`crate::sync`), so each run is
//! one interleaving of them; the store's futures never wait, so `block_on` runs them at once.

use std::time::Duration;

use bytes::Bytes;
use shuttle::{future::block_on, thread};

use super::{MemoryStore, SHARDS};
use crate::{
    record::{ClaimOutcome, Fingerprint, Record, StoreKey, Token},
    store::{Store, StoreError},
    sync::explore,
};

/// Long enough that no lease of a test runs out during it.
const LEASE: Duration = Duration::from_secs(3600);

fn fingerprint(n: u8) -> Fingerprint {
    Fingerprint::from_bytes([n; 32])
}

/// `count` keys that live in different shards, so their claims take different locks and
/// meet only at the shared budget.
fn keys_in_distinct_shards(count: usize) -> Vec<StoreKey> {
    let mut shards_taken = Vec::new();
    let mut keys = Vec::new();
    for i in 0.. {
        let key = StoreKey::new("shuttle", i.to_string());
        let shard = usize::from(key.digest()[31]) % SHARDS;
        if !shards_taken.contains(&shard) {
            shards_taken.push(shard);
            keys.push(key);
            if keys.len() == count {
                break;
            }
        }
    }
    keys
}

fn claim(
    store: &MemoryStore,
    key: &StoreKey,
    n: u8,
    lease: Duration,
) -> Result<ClaimOutcome, StoreError> {
    block_on(store.claim(key, &fingerprint(n), lease))
}

/// One owner per key: of three tasks claiming one key at once, exactly one gets a token, and
/// the others see that owner's claim (its fingerprint), never one of their own.
#[test]
fn shuttle_tests_one_owner_per_key() {
    explore(|| {
        let store = MemoryStore::new();
        let key = StoreKey::new("shuttle", "one");
        let tasks: Vec<_> = (1..=3u8)
            .map(|n| {
                let (store, key) = (store.clone(), key.clone());
                thread::spawn(move || (n, claim(&store, &key, n, LEASE).unwrap()))
            })
            .collect();
        let outcomes: Vec<_> = tasks.into_iter().map(|t| t.join().unwrap()).collect();
        let owners: Vec<u8> = outcomes
            .iter()
            .filter(|(_, o)| matches!(o, ClaimOutcome::Claimed(_)))
            .map(|(n, _)| *n)
            .collect();
        assert_eq!(owners.len(), 1, "owners: {owners:?}");
        for (_, outcome) in &outcomes {
            if let ClaimOutcome::Existing(record) = outcome {
                assert_eq!(
                    record,
                    &Record::InProgress {
                        fingerprint: fingerprint(owners[0])
                    }
                );
            }
        }
        assert_eq!(store.entry_count(), 1);
        assert_eq!(store.used_bytes(), MemoryStore::RECORD_OVERHEAD);
    });
}

/// Fenced complete: the owner releases its claim and then, late, tries to complete with the
/// same token while another task claims the key anew. The old token completes nothing, in
/// every order; the new owner's completion stands.
#[test]
fn shuttle_tests_complete_only_by_the_token_holder() {
    explore(|| {
        let store = MemoryStore::new();
        let key = StoreKey::new("shuttle", "fenced");
        let ClaimOutcome::Claimed(old) = claim(&store, &key, 1, LEASE).unwrap() else {
            panic!("a fresh store has the key free");
        };
        let late = {
            let (store, key) = (store.clone(), key.clone());
            thread::spawn(move || {
                block_on(store.release(&key, old)).unwrap();
                block_on(store.complete(&key, old, Bytes::from_static(b"old"), LEASE))
            })
        };
        let new = {
            let (store, key) = (store.clone(), key.clone());
            thread::spawn(move || match claim(&store, &key, 2, LEASE).unwrap() {
                ClaimOutcome::Claimed(token) => {
                    block_on(store.complete(&key, token, Bytes::from_static(b"new"), LEASE))
                        .unwrap();
                    Some(token)
                }
                ClaimOutcome::Existing(_) => None,
            })
        };
        let late = late.join().unwrap();
        let new: Option<Token> = new.join().unwrap();
        assert!(
            matches!(late, Err(StoreError::StaleToken)),
            "a released token completed: {late:?}"
        );
        let record = block_on(store.lookup(&key)).unwrap();
        match new {
            Some(token) => {
                assert_ne!(token, old);
                assert_eq!(
                    record,
                    Some(Record::Completed {
                        fingerprint: fingerprint(2),
                        payload: Bytes::from_static(b"new"),
                    })
                );
            }
            // Claimed before the release: it saw the old claim, which is gone now.
            None => assert_eq!(record, None),
        }
    });
}

/// Budget respected: room for two records, one of them taken by an expired record. Three
/// claims on three other shards race for it: the expired record is evicted to make room,
/// exactly two claims are admitted, the third is refused, no live claim is lost, and the
/// charge never passes the maximum.
#[test]
fn shuttle_tests_claims_never_exceed_the_budget() {
    explore(|| {
        let max = 2 * MemoryStore::RECORD_OVERHEAD;
        let store = MemoryStore::builder().max_bytes(max).build();
        let mut keys = keys_in_distinct_shards(4);
        let expired = keys.pop().expect("four keys");
        // A zero lease ends at once: the record holds its room until a sweep evicts it.
        assert!(matches!(
            claim(&store, &expired, 0, Duration::ZERO).unwrap(),
            ClaimOutcome::Claimed(_)
        ));
        let tasks: Vec<_> = keys
            .into_iter()
            .zip(1u8..)
            .map(|(key, n)| {
                let store = store.clone();
                thread::spawn(move || {
                    let outcome = claim(&store, &key, n, LEASE);
                    assert!(
                        store.used_bytes() <= max,
                        "over budget: {}",
                        store.used_bytes()
                    );
                    (key, outcome)
                })
            })
            .collect();
        let mut admitted = 0;
        for task in tasks {
            match task.join().unwrap() {
                (key, Ok(ClaimOutcome::Claimed(_))) => {
                    admitted += 1;
                    assert!(
                        matches!(
                            block_on(store.lookup(&key)).unwrap(),
                            Some(Record::InProgress { .. })
                        ),
                        "an admitted claim was evicted"
                    );
                }
                (_, Err(StoreError::Full { .. })) => {}
                (_, other) => panic!("unexpected outcome {other:?}"),
            }
        }
        assert_eq!(admitted, 2);
        assert_eq!(store.refused_claims(), 1);
        assert_eq!(block_on(store.lookup(&expired)).unwrap(), None);
        assert_eq!(store.entry_count(), 2, "the expired record was evicted");
        assert_eq!(store.used_bytes(), max);
    });
}
