//! The conformance checks of a step [`Journal`], the contract on its trait: entries round-trip
//! byte for byte under their request's fingerprint, a fenced-out owner appends nothing, and
//! a later attempt gets the journaled outputs back instead of running the steps again.
//!
//! Each check takes the store whose claims fence the journal and the journal itself; they
//! claim keys straight on the store (no engine, so no lease renewal interferes) under a fresh
//! scope each.
//!
//! ```
//! # #[cfg(feature = "memory")]
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! use std::sync::Arc;
//! use tower_idempotency::{conformance, steps::MemoryJournal, store::MemoryStore};
//!
//! let store = MemoryStore::new();
//! let journal = MemoryJournal::for_store(&store);
//! conformance::journal::run_all(Arc::new(store), journal).await;
//! # });
//! ```

use std::time::Duration;

use bytes::Bytes;

use super::{fp, fresh_scope, token_of, DynStore, LEASE, RETENTION};
use crate::{
    engine::ClaimStatus,
    record::{Fingerprint, StoreKey, Token},
    steps::{Journal, KeyOwner, Steps},
    store::StoreError,
};

/// The owner of `key` under `token`, as a step sees it.
fn owner(key: &StoreKey, token: Token, fingerprint: Fingerprint, retention: Duration) -> KeyOwner {
    KeyOwner {
        key: key.clone(),
        token,
        fingerprint,
        retention,
        status: ClaimStatus::held(),
    }
}

/// Claims `key` for a request with `fingerprint`, returning its owner.
async fn claim(
    store: &DynStore,
    key: &StoreKey,
    fingerprint: Fingerprint,
    lease: Duration,
) -> KeyOwner {
    let token = token_of(store.claim(key, &fingerprint, lease).await.unwrap());
    owner(key, token, fingerprint, RETENTION)
}

async fn sorted<J: Journal>(
    journal: &J,
    key: &StoreKey,
    fingerprint: &Fingerprint,
) -> Vec<(String, Bytes)> {
    let mut entries = journal.entries(key, fingerprint).await.unwrap();
    entries.sort();
    entries
}

/// Entries come back byte for byte (every byte value, and an empty output), only for their
/// key and their request's fingerprint.
pub async fn entries_round_trip<J: Journal>(store: DynStore, journal: J) {
    let key = StoreKey::new(fresh_scope(), "k");
    let owner = claim(&store, &key, fp("a"), LEASE).await;
    let every_byte = Bytes::from((0..=255u8).collect::<Vec<_>>());
    journal
        .append(&owner, "first", every_byte.clone())
        .await
        .unwrap();
    journal
        .append(&owner, "second", Bytes::new())
        .await
        .unwrap();
    assert_eq!(
        sorted(&journal, &key, &fp("a")).await,
        vec![
            ("first".to_owned(), every_byte),
            ("second".to_owned(), Bytes::new())
        ]
    );
    assert!(
        journal.entries(&key, &fp("b")).await.unwrap().is_empty(),
        "another request's entries are not this one's"
    );
    let other = StoreKey::new(key.scope(), "k2");
    assert!(journal.entries(&other, &fp("a")).await.unwrap().is_empty());
}

/// After its lease ran out and another request took the key over, the old owner appends
/// nothing ([`StoreError::StaleToken`]), nor does an unknown token or an owner whose record
/// completed; the new owner sees what the old one journaled before the takeover.
pub async fn fenced_owner_is_refused<J: Journal>(store: DynStore, journal: J) {
    let key = StoreKey::new(fresh_scope(), "k");
    let old = claim(&store, &key, fp("a"), Duration::from_millis(400)).await;
    journal
        .append(&old, "before", Bytes::from_static(b"1"))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let new = claim(&store, &key, fp("a"), LEASE).await;

    let late = journal.append(&old, "late", Bytes::from_static(b"2")).await;
    assert!(matches!(late, Err(StoreError::StaleToken)), "{late:?}");
    let stranger = owner(&key, Token::random(), fp("a"), RETENTION);
    let forged = journal
        .append(&stranger, "late", Bytes::from_static(b"3"))
        .await;
    assert!(matches!(forged, Err(StoreError::StaleToken)), "{forged:?}");
    assert_eq!(
        sorted(&journal, &key, &fp("a")).await,
        vec![("before".to_owned(), Bytes::from_static(b"1"))],
        "only the entry appended before the takeover"
    );

    journal
        .append(&new, "after", Bytes::from_static(b"4"))
        .await
        .unwrap();
    store
        .complete(&key, new.token, Bytes::from_static(b"done"), RETENTION)
        .await
        .unwrap();
    let settled = journal.append(&new, "late", Bytes::from_static(b"5")).await;
    assert!(
        matches!(settled, Err(StoreError::StaleToken)),
        "{settled:?}"
    );
    assert_eq!(sorted(&journal, &key, &fp("a")).await.len(), 2);
}

/// Entries outlive a released claim: the next attempt's [`Steps`] hands the journaled output
/// back and does not run the step again.
pub async fn outputs_are_handed_back<J: Journal + Clone>(store: DynStore, journal: J) {
    let key = StoreKey::new(fresh_scope(), "k");
    let first = claim(&store, &key, fp("a"), LEASE).await;
    let steps = Steps::resume(journal.clone(), first.clone()).await.unwrap();
    let charged: String = steps
        .foreign("charge", |derived| async move {
            Ok::<_, std::io::Error>(derived)
        })
        .await
        .unwrap();
    assert_eq!(charged, KeyOwner::derive(&key, "charge"));
    store.release(&key, first.token).await.unwrap();

    let second = claim(&store, &key, fp("a"), LEASE).await;
    let steps = Steps::resume(journal, second).await.unwrap();
    assert_eq!(steps.finished(), 1);
    let again: String = steps
        .foreign("charge", |_| async { Err::<String, _>("ran again") })
        .await
        .unwrap();
    assert_eq!(again, charged, "the journaled output, not a second run");
}

/// Entries expire `retention` after they were written; purging afterwards succeeds.
pub async fn entries_expire_after_retention<J: Journal>(store: DynStore, journal: J) {
    let key = StoreKey::new(fresh_scope(), "k");
    let claimed = claim(&store, &key, fp("a"), LEASE).await;
    let short = owner(&key, claimed.token, fp("a"), Duration::from_millis(400));
    journal
        .append(&short, "brief", Bytes::from_static(b"1"))
        .await
        .unwrap();
    assert_eq!(journal.entries(&key, &fp("a")).await.unwrap().len(), 1);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert!(journal.entries(&key, &fp("a")).await.unwrap().is_empty());
    journal.purge_expired(1000).await.unwrap();
}

/// Runs every journal check, one after the other.
pub async fn run_all<J: Journal + Clone>(store: DynStore, journal: J) {
    entries_round_trip(store.clone(), journal.clone()).await;
    fenced_owner_is_refused(store.clone(), journal.clone()).await;
    outputs_are_handed_back(store.clone(), journal.clone()).await;
    entries_expire_after_retention(store, journal).await;
}
