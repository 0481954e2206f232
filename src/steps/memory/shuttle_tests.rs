//! Shuttle schedules of the journal's fence (`scripts/shuttle`): an owner appending a step's
//! entry while another request takes its key over. The memory store's locks and the journal's
//! are shuttle's here, so each run is one interleaving of the two.

use std::time::Duration;

use bytes::Bytes;
use shuttle::{future::block_on, thread};

use super::MemoryJournal;
use crate::{
    engine::ClaimStatus,
    record::{ClaimOutcome, Fingerprint, StoreKey},
    steps::{Journal, KeyOwner},
    store::{MemoryStore, Store, StoreError},
    sync::explore,
};

const LEASE: Duration = Duration::from_secs(3600);

/// The old owner's entry is either refused (the takeover came first) or seen by the new owner
/// (it came first): never accepted and missed, which would let the new owner run the step a
/// second time. The takeover here is the operator's `forget` and a new claim, the one way to
/// end a live lease within a schedule.
///
/// mutant: `MemoryStore::while_claimed` lets go of the key's lock before `write` -> fails with
/// "an accepted entry was missed by the new owner".
#[test]
fn shuttle_tests_a_fenced_entry_is_refused_or_seen() {
    explore(|| {
        let store = MemoryStore::new();
        let journal = MemoryJournal::for_store(&store);
        let key = StoreKey::new("shuttle", "steps");
        let fingerprint = Fingerprint::from_bytes([7; 32]);
        let claim = block_on(store.claim(&key, &fingerprint, LEASE)).unwrap();
        let ClaimOutcome::Claimed(token) = claim else {
            panic!("the first claim wins")
        };
        let old = KeyOwner {
            key: key.clone(),
            token,
            fingerprint,
            retention: LEASE,
            status: ClaimStatus::held(),
        };
        let appender = thread::spawn({
            let journal = journal.clone();
            move || block_on(journal.append(&old, "charge", Bytes::from_static(b"\"ch_1\"")))
        });
        let taker = thread::spawn(move || {
            block_on(store.forget(&key)).unwrap();
            let claim = block_on(store.claim(&key, &fingerprint, LEASE)).unwrap();
            assert!(matches!(claim, ClaimOutcome::Claimed(_)), "{claim:?}");
            block_on(journal.entries(&key, &fingerprint)).unwrap()
        });
        let appended = appender.join().unwrap();
        let seen = taker.join().unwrap();
        match appended {
            Ok(()) => assert_eq!(
                seen.len(),
                1,
                "an accepted entry was missed by the new owner"
            ),
            Err(StoreError::StaleToken) => assert!(seen.is_empty(), "a refused entry was seen"),
            Err(other) => panic!("{other}"),
        }
    });
}
