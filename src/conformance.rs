//! The conformance suite of [`Store`] (feature `conformance`): the contract in the
//! [`store`](crate::store) module docs, as async checks that panic on a violation. Every store
//! in this crate runs it against real servers; a store written elsewhere runs it the same way.
//!
//! Each check takes a store (an `Arc<dyn Store>`); [`two_instances_race_one_winner`] takes
//! two instances of the same backend (two pools or connections onto one database), and
//! [`run_all`] takes a factory that opens a new instance per call and runs every check.
//! Every check works under a fresh random scope ([`fresh_scope`]), so checks may run at once
//! against one database and never see each other's records.
//!
//! The checks of a step journal (`steps::Journal`) beside a store are in [`journal`].
//!
//! ```
//! # #[cfg(feature = "memory")]
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! use std::sync::Arc;
//! use tower_idempotency::{conformance, store::MemoryStore};
//!
//! // Clones of one memory store share their records, as two instances of a server-backed
//! // store share one database.
//! let store = MemoryStore::new();
//! conformance::run_all(|| async { Arc::new(store.clone()) as conformance::DynStore }, false)
//!     .await;
//! # });
//! ```
//!
//! # A store of your own
//!
//! A backend outside this crate adds `tower-idempotency = { version = "0.1", features =
//! ["conformance"] }` to its dev-dependencies and runs the suite in its tests, for example:
//!
//! ```
//! # #[cfg(feature = "memory")]
//! # mod example {
//! use std::{sync::Arc, time::Duration};
//!
//! use async_trait::async_trait;
//! use bytes::Bytes;
//! use tower_idempotency::{
//!     conformance,
//!     store::{MemoryStore, Store, StoreError},
//!     ClaimOutcome, Fingerprint, Record, StoreKey, Token,
//! };
//!
//! /// A store that delegates to another (here the memory store): a real backend puts its own
//! /// atomic claim and fenced updates in these seven methods.
//! struct Delegating(MemoryStore);
//!
//! #[async_trait]
//! impl Store for Delegating {
//!     async fn claim(&self, key: &StoreKey, fp: &Fingerprint, lease: Duration)
//!         -> Result<ClaimOutcome, StoreError> {
//!         self.0.claim(key, fp, lease).await
//!     }
//!     async fn renew(&self, key: &StoreKey, token: Token, lease: Duration) -> Result<(), StoreError> {
//!         self.0.renew(key, token, lease).await
//!     }
//!     async fn complete(&self, key: &StoreKey, token: Token, payload: Bytes, retention: Duration)
//!         -> Result<(), StoreError> {
//!         self.0.complete(key, token, payload, retention).await
//!     }
//!     async fn release(&self, key: &StoreKey, token: Token) -> Result<(), StoreError> {
//!         self.0.release(key, token).await
//!     }
//!     async fn lookup(&self, key: &StoreKey) -> Result<Option<Record>, StoreError> {
//!         self.0.lookup(key).await
//!     }
//!     async fn forget(&self, key: &StoreKey) -> Result<bool, StoreError> {
//!         self.0.forget(key).await
//!     }
//!     async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
//!         self.0.purge_expired(batch).await
//!     }
//! }
//!
//! # pub fn run() {
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! // Each call opens a new instance onto the same data (for a server: a new pool onto one
//! // database), so two instances race each other in `two_instances_race_one_winner`.
//! let shared = MemoryStore::new();
//! conformance::run_all(
//!     || async { Arc::new(Delegating(shared.clone())) as conformance::DynStore },
//!     false,
//! )
//! .await;
//! # });
//! # }
//! # }
//! # fn main() {
//! # #[cfg(feature = "memory")]
//! # example::run();
//! # }
//! ```

pub mod journal;

use std::{
    collections::HashSet,
    sync::Arc,
    time::{Duration, Instant},
};

use crate::{
    record::{ClaimOutcome, Fingerprint, Record, StoreKey, Token},
    store::{Store, StoreError},
};
use bytes::Bytes;
use tokio::sync::Barrier;

/// The store a check runs against.
pub type DynStore = Arc<dyn Store>;

/// A scope no other check (or earlier run) uses: every check keys its records under one.
pub fn fresh_scope() -> String {
    format!("conformance-{}", Token::random().to_hex())
}

/// The fingerprint of a request whose body is `text`.
pub fn fp(text: &str) -> Fingerprint {
    Fingerprint::of([text.as_bytes()])
}

const LEASE: Duration = Duration::from_secs(30);
const RETENTION: Duration = Duration::from_secs(3600);

fn token_of(outcome: ClaimOutcome) -> Token {
    match outcome {
        ClaimOutcome::Claimed(token) => token,
        other => panic!("expected to win the claim, found {other:?}"),
    }
}

/// A second claim on a live key reports the first claim, in progress, with its fingerprint.
pub async fn duplicate_claim_reports_in_progress_with_first_fingerprint(store: DynStore) {
    let key = StoreKey::new(fresh_scope(), "k");
    token_of(store.claim(&key, &fp("first"), LEASE).await.unwrap());
    let second = store.claim(&key, &fp("second"), LEASE).await.unwrap();
    assert_eq!(
        second,
        ClaimOutcome::Existing(Record::InProgress {
            fingerprint: fp("first")
        })
    );
    assert_eq!(
        store.lookup(&key).await.unwrap(),
        Some(Record::InProgress {
            fingerprint: fp("first")
        })
    );
}

/// `copies` tasks per key, released together by a barrier, all claim at once; exactly one
/// per key may win. `stores` are used round-robin, so two instances race each other.
pub async fn race(stores: Vec<DynStore>, keys: usize, copies: usize) {
    let scope = fresh_scope();
    let barrier = Arc::new(Barrier::new(keys * copies));
    let mut tasks = Vec::new();
    for i in 0..keys * copies {
        let store = stores[i % stores.len()].clone();
        let barrier = barrier.clone();
        let key = StoreKey::new(scope.clone(), format!("key-{}", i % keys));
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let outcome = store.claim(&key, &fp("race"), LEASE).await.unwrap();
            (key.key().to_owned(), outcome)
        }));
    }
    let mut winners = HashSet::new();
    let mut losers = 0;
    for task in tasks {
        let (key, outcome) = task.await.unwrap();
        match outcome {
            ClaimOutcome::Claimed(_) => assert!(winners.insert(key.clone()), "{key} won twice"),
            ClaimOutcome::Existing(Record::InProgress { fingerprint }) => {
                assert_eq!(fingerprint, fp("race"));
                losers += 1;
            }
            other => panic!("unexpected outcome {other:?}"),
        }
    }
    assert_eq!(
        winners.len(),
        keys,
        "every key must have exactly one winner"
    );
    assert_eq!(losers, keys * (copies - 1));
}

/// Many concurrent claims on one key: exactly one wins.
pub async fn claim_race_has_one_winner(store: DynStore) {
    race(vec![store], 1, 64).await;
}

/// Concurrent claims on many keys at once: exactly one winner per key.
pub async fn many_keys_race_one_winner_each(store: DynStore) {
    race(vec![store], 20, 10).await;
}

/// Two instances (`a` and `b`, one database) race on the same keys: one winner per key.
pub async fn two_instances_race_one_winner(a: DynStore, b: DynStore) {
    race(vec![a, b], 10, 16).await;
}

/// A claim whose lease ran out is taken over by the next claim, with a new token.
pub async fn expired_lease_is_taken_over_with_a_new_token(store: DynStore) {
    let key = StoreKey::new(fresh_scope(), "k");
    let lease = Duration::from_millis(400);
    let old = token_of(store.claim(&key, &fp("a"), lease).await.unwrap());
    assert!(matches!(
        store.claim(&key, &fp("a"), lease).await.unwrap(),
        ClaimOutcome::Existing(Record::InProgress { .. })
    ));
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(
        store.lookup(&key).await.unwrap(),
        None,
        "an expired claim is not live"
    );
    let new = token_of(store.claim(&key, &fp("b"), LEASE).await.unwrap());
    assert_ne!(old, new);
    assert_eq!(
        store.lookup(&key).await.unwrap(),
        Some(Record::InProgress {
            fingerprint: fp("b")
        })
    );
}

/// After a takeover, the old token can neither renew, complete nor release.
pub async fn stale_token_changes_nothing(store: DynStore) {
    let key = StoreKey::new(fresh_scope(), "k");
    let old = token_of(
        store
            .claim(&key, &fp("a"), Duration::from_millis(400))
            .await
            .unwrap(),
    );
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let new = token_of(store.claim(&key, &fp("b"), LEASE).await.unwrap());

    let stale = store
        .complete(&key, old, Bytes::from_static(b"late"), RETENTION)
        .await;
    assert!(matches!(stale, Err(StoreError::StaleToken)), "{stale:?}");
    let stale = store.release(&key, old).await;
    assert!(matches!(stale, Err(StoreError::StaleToken)), "{stale:?}");
    let stale = store.renew(&key, old, LEASE).await;
    assert!(matches!(stale, Err(StoreError::StaleToken)), "{stale:?}");
    assert_eq!(
        store.lookup(&key).await.unwrap(),
        Some(Record::InProgress {
            fingerprint: fp("b")
        }),
        "the new owner's claim must be untouched"
    );

    store
        .complete(&key, new, Bytes::from_static(b"mine"), RETENTION)
        .await
        .unwrap();
    // A token that completed no longer owns anything either.
    assert!(matches!(
        store.release(&key, new).await,
        Err(StoreError::StaleToken)
    ));
    assert!(matches!(
        store
            .complete(&key, new, Bytes::from_static(b"again"), RETENTION)
            .await,
        Err(StoreError::StaleToken)
    ));
    assert_eq!(
        store.lookup(&key).await.unwrap(),
        Some(Record::Completed {
            fingerprint: fp("b"),
            payload: Bytes::from_static(b"mine")
        })
    );
}

/// A token that never held the key is stale for renew, complete and release.
pub async fn unknown_token_is_stale(store: DynStore) {
    let key = StoreKey::new(fresh_scope(), "k");
    let random = Token::random();
    assert!(matches!(
        store.release(&key, random).await,
        Err(StoreError::StaleToken)
    ));
    assert!(matches!(
        store.complete(&key, random, Bytes::new(), RETENTION).await,
        Err(StoreError::StaleToken)
    ));
    assert_eq!(
        store.lookup(&key).await.unwrap(),
        None,
        "a stale complete must not create a record"
    );
    token_of(store.claim(&key, &fp("a"), LEASE).await.unwrap());
    assert!(matches!(
        store.renew(&key, random, LEASE).await,
        Err(StoreError::StaleToken)
    ));
}

/// A released claim can be claimed again.
pub async fn release_then_reclaim(store: DynStore) {
    let key = StoreKey::new(fresh_scope(), "k");
    let first = token_of(store.claim(&key, &fp("a"), LEASE).await.unwrap());
    store.release(&key, first).await.unwrap();
    assert_eq!(store.lookup(&key).await.unwrap(), None);
    let second = token_of(store.claim(&key, &fp("b"), LEASE).await.unwrap());
    assert_ne!(first, second);
}

/// `forget` deletes a key's record whatever its state, and only that key's: a claim in
/// progress (whose token is then stale, and whose key is claimed afresh), a completed record;
/// an absent key is nothing to forget.
pub async fn forget_deletes_any_record_of_the_key(store: DynStore) {
    let scope = fresh_scope();
    let (key, other) = (StoreKey::new(&*scope, "k"), StoreKey::new(&*scope, "other"));
    assert!(!store.forget(&key).await.unwrap(), "forgot an absent key");
    let first = token_of(store.claim(&key, &fp("a"), LEASE).await.unwrap());
    let kept = token_of(store.claim(&other, &fp("a"), LEASE).await.unwrap());
    assert!(store.forget(&key).await.unwrap(), "a claim in progress");
    assert_eq!(store.lookup(&key).await.unwrap(), None);
    assert!(matches!(
        store.release(&key, first).await,
        Err(StoreError::StaleToken)
    ));
    let second = token_of(store.claim(&key, &fp("b"), LEASE).await.unwrap());
    assert_ne!(first, second);
    store
        .complete(&key, second, Bytes::from_static(b"done"), RETENTION)
        .await
        .unwrap();
    assert!(store.forget(&key).await.unwrap(), "a completed record");
    assert_eq!(store.lookup(&key).await.unwrap(), None);
    assert!(!store.forget(&key).await.unwrap(), "forgot twice");
    // The other key of the scope is untouched.
    assert_eq!(
        store.lookup(&other).await.unwrap(),
        Some(Record::InProgress {
            fingerprint: fp("a")
        })
    );
    store.release(&other, kept).await.unwrap();
}

/// Completed payloads (empty, binary, large) come back byte for byte.
pub async fn completed_payload_round_trips_byte_for_byte(store: DynStore) {
    let scope = fresh_scope();
    let all_bytes: Vec<u8> = (0..=255u8).chain((0..=255u8).rev()).collect();
    let big: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 251) as u8).collect();
    for (name, payload) in [
        ("binary", Bytes::from(all_bytes)),
        ("empty", Bytes::new()),
        (
            "nul-and-invalid-utf8",
            Bytes::from_static(b"\0\xff\xfe\0abc\0"),
        ),
        ("large", Bytes::from(big)),
    ] {
        let key = StoreKey::new(scope.clone(), name);
        let token = token_of(store.claim(&key, &fp(name), LEASE).await.unwrap());
        store
            .complete(&key, token, payload.clone(), RETENTION)
            .await
            .unwrap();
        let expected = Record::Completed {
            fingerprint: fp(name),
            payload,
        };
        assert_eq!(
            store.claim(&key, &fp(name), LEASE).await.unwrap(),
            ClaimOutcome::Existing(expected.clone()),
            "{name}"
        );
        assert_eq!(store.lookup(&key).await.unwrap(), Some(expected), "{name}");
    }
}

/// A renewed lease outlives its original length.
pub async fn renewed_lease_is_not_taken_over(store: DynStore) {
    let key = StoreKey::new(fresh_scope(), "k");
    let lease = Duration::from_millis(600);
    let token = token_of(store.claim(&key, &fp("a"), lease).await.unwrap());
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(2000) {
        tokio::time::sleep(Duration::from_millis(150)).await;
        store.renew(&key, token, lease).await.unwrap();
        assert!(
            matches!(
                store.claim(&key, &fp("a"), lease).await.unwrap(),
                ClaimOutcome::Existing(Record::InProgress { .. })
            ),
            "a renewed claim was taken over after {:?}",
            start.elapsed()
        );
    }
    store
        .complete(&key, token, Bytes::from_static(b"done"), RETENTION)
        .await
        .unwrap();
}

/// A completed record counts as absent once its retention ends.
pub async fn completed_record_expires_after_retention(store: DynStore) {
    let key = StoreKey::new(fresh_scope(), "k");
    let token = token_of(store.claim(&key, &fp("a"), LEASE).await.unwrap());
    store
        .complete(
            &key,
            token,
            Bytes::from_static(b"x"),
            Duration::from_millis(400),
        )
        .await
        .unwrap();
    assert!(store.lookup(&key).await.unwrap().is_some());
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(store.lookup(&key).await.unwrap(), None);
    token_of(store.claim(&key, &fp("a"), LEASE).await.unwrap());
}

/// Expired records are deleted by `purge_expired` in batches; live ones stay. With
/// `exact_count`, the reported counts must add up to exactly the expired records created
/// here (stores that expire records by themselves, like Redis, report what they still
/// had to delete).
pub async fn purge_removes_only_expired_records(store: DynStore, exact_count: bool) {
    let scope = fresh_scope();
    let short = Duration::from_millis(300);
    for i in 0..7 {
        let key = StoreKey::new(scope.clone(), format!("expired-{i}"));
        let token = token_of(store.claim(&key, &fp("x"), LEASE).await.unwrap());
        store
            .complete(&key, token, Bytes::from_static(b"x"), short)
            .await
            .unwrap();
    }
    for i in 0..3 {
        let key = StoreKey::new(scope.clone(), format!("lease-{i}"));
        token_of(store.claim(&key, &fp("x"), short).await.unwrap());
    }
    let live = StoreKey::new(scope.clone(), "live");
    let token = token_of(store.claim(&live, &fp("x"), LEASE).await.unwrap());
    store
        .complete(&live, token, Bytes::from_static(b"keep"), RETENTION)
        .await
        .unwrap();
    let in_flight = StoreKey::new(scope.clone(), "in-flight");
    token_of(store.claim(&in_flight, &fp("x"), LEASE).await.unwrap());

    tokio::time::sleep(Duration::from_millis(1200)).await;
    // Other tests share the database, so more than ours may be purged; ours must all go.
    let mut purged = 0;
    loop {
        let n = store.purge_expired(4).await.unwrap();
        if exact_count {
            assert!(n <= 4, "a batch of 4 deleted {n}");
        }
        purged += n;
        if n < 4 {
            break;
        }
    }
    if exact_count {
        assert!(
            purged >= 10,
            "purged {purged}, expected at least our 10 expired records"
        );
    }
    for i in 0..7 {
        let key = StoreKey::new(scope.clone(), format!("expired-{i}"));
        assert_eq!(store.lookup(&key).await.unwrap(), None);
    }
    assert!(matches!(
        store.lookup(&live).await.unwrap(),
        Some(Record::Completed { .. })
    ));
    assert!(matches!(
        store.lookup(&in_flight).await.unwrap(),
        Some(Record::InProgress { .. })
    ));
}

/// The same key in two scopes is two records.
pub async fn scopes_do_not_share_keys(store: DynStore) {
    let key = "same-key";
    let alice = StoreKey::new(fresh_scope(), key);
    let bob = StoreKey::new(fresh_scope(), key);
    token_of(store.claim(&alice, &fp("a"), LEASE).await.unwrap());
    token_of(store.claim(&bob, &fp("b"), LEASE).await.unwrap());
    // A scope that is a prefix of another, with the rest moved into the key, is a different
    // record too.
    let scope = fresh_scope();
    token_of(
        store
            .claim(&StoreKey::new(format!("{scope}:x"), "y"), &fp("a"), LEASE)
            .await
            .unwrap(),
    );
    token_of(
        store
            .claim(&StoreKey::new(scope, "x:y"), &fp("a"), LEASE)
            .await
            .unwrap(),
    );
}

/// Keys with quotes, wildcards, separators and non-ASCII characters are stored as given.
pub async fn keys_with_unusual_characters_work(store: DynStore) {
    let scope = fresh_scope();
    for key in [
        "a".repeat(255),
        "with space and 'quotes' \"double\" ; -- %_*?".to_owned(),
        "{hash}:tag\\back".to_owned(),
        "ünïcödé-キー".to_owned(),
    ] {
        let key = StoreKey::new(scope.clone(), key);
        let token = token_of(store.claim(&key, &fp("a"), LEASE).await.unwrap());
        store
            .complete(&key, token, Bytes::from_static(b"ok"), RETENTION)
            .await
            .unwrap();
        assert!(matches!(
            store.lookup(&key).await.unwrap(),
            Some(Record::Completed { .. })
        ));
    }
}

/// A store pointed at a server that does not answer reports a typed backend error.
pub async fn unreachable_store_reports_backend_error(store: DynStore) {
    let key = StoreKey::new(fresh_scope(), "k");
    match store.claim(&key, &fp("a"), LEASE).await {
        Err(err @ StoreError::Backend { .. }) => {
            assert!(err.is_unavailable());
            assert!(
                std::error::Error::source(&err).is_some(),
                "the backend error must be kept"
            );
        }
        other => panic!("expected a backend error, got {other:?}"),
    }
}

/// Runs every check, one after the other, each on a new instance from `open` (two for
/// [`two_instances_race_one_winner`]). `exact_purge_count` is as for
/// [`purge_removes_only_expired_records`]. [`unreachable_store_reports_backend_error`] is not
/// included: it needs a store pointed at a dead address.
pub async fn run_all<F, Fut>(open: F, exact_purge_count: bool)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = DynStore>,
{
    duplicate_claim_reports_in_progress_with_first_fingerprint(open().await).await;
    claim_race_has_one_winner(open().await).await;
    many_keys_race_one_winner_each(open().await).await;
    two_instances_race_one_winner(open().await, open().await).await;
    expired_lease_is_taken_over_with_a_new_token(open().await).await;
    stale_token_changes_nothing(open().await).await;
    unknown_token_is_stale(open().await).await;
    release_then_reclaim(open().await).await;
    forget_deletes_any_record_of_the_key(open().await).await;
    completed_payload_round_trips_byte_for_byte(open().await).await;
    renewed_lease_is_not_taken_over(open().await).await;
    completed_record_expires_after_retention(open().await).await;
    purge_removes_only_expired_records(open().await, exact_purge_count).await;
    scopes_do_not_share_keys(open().await).await;
    keys_with_unusual_characters_work(open().await).await;
}
