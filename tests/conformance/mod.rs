//! The store conformance suite: the same test bodies, run against every backend.
//!
//! A backend's test file (`tests/store_<backend>.rs`) includes this module and invokes
//! [`conformance_tests!`] with an async expression that opens a NEW store instance (its own
//! pool/connection) onto the shared test database, or `None` when the backend is not
//! configured. Every test works under a random scope, so tests never see each other's records.
//! Two calls of the expression give two independent "instances" sharing one database.
#![allow(dead_code)]

use std::{
    collections::HashSet,
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::Bytes;
use tokio::sync::Barrier;
use tower_idempotency::{
    store::{Store, StoreError},
    ClaimOutcome, Fingerprint, Record, StoreKey, Token,
};

pub type DynStore = Arc<dyn Store>;

#[path = "../support/backends.rs"]
mod backends;
#[allow(unused_imports)] // each test binary uses a different part
pub use backends::{reachable, require_all, url_or_skip};

pub fn fresh_scope() -> String {
    format!("conformance-{}", Token::random().to_hex())
}

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

pub async fn claim_race_has_one_winner(store: DynStore) {
    race(vec![store], 1, 64).await;
}

pub async fn many_keys_race_one_winner_each(store: DynStore) {
    race(vec![store], 20, 10).await;
}

pub async fn two_instances_race_one_winner(a: DynStore, b: DynStore) {
    race(vec![a, b], 10, 16).await;
}

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

pub async fn release_then_reclaim(store: DynStore) {
    let key = StoreKey::new(fresh_scope(), "k");
    let first = token_of(store.claim(&key, &fp("a"), LEASE).await.unwrap());
    store.release(&key, first).await.unwrap();
    assert_eq!(store.lookup(&key).await.unwrap(), None);
    let second = token_of(store.claim(&key, &fp("b"), LEASE).await.unwrap());
    assert_ne!(first, second);
}

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

/// Generates one `#[tokio::test]` per conformance case. `$open` is an async expression giving
/// `Option<DynStore>` (a new instance each time; `None` skips). `$unreachable` is an async
/// expression giving a store pointed at a dead address, or `None` for backends without one.
#[macro_export]
macro_rules! conformance_tests {
    (open: $open:expr, unreachable: $unreachable:expr, exact_purge_count: $exact:expr) => {
        macro_rules! case {
            ($name:ident, $body:path) => {
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    if let Some(store) = $open.await {
                        $body(store).await;
                    }
                }
            };
        }
        case!(
            duplicate_claim_reports_in_progress_with_first_fingerprint,
            conformance::duplicate_claim_reports_in_progress_with_first_fingerprint
        );
        case!(
            claim_race_has_one_winner,
            conformance::claim_race_has_one_winner
        );
        case!(
            many_keys_race_one_winner_each,
            conformance::many_keys_race_one_winner_each
        );
        case!(
            expired_lease_is_taken_over_with_a_new_token,
            conformance::expired_lease_is_taken_over_with_a_new_token
        );
        case!(
            stale_token_changes_nothing,
            conformance::stale_token_changes_nothing
        );
        case!(unknown_token_is_stale, conformance::unknown_token_is_stale);
        case!(release_then_reclaim, conformance::release_then_reclaim);
        case!(
            completed_payload_round_trips_byte_for_byte,
            conformance::completed_payload_round_trips_byte_for_byte
        );
        case!(
            renewed_lease_is_not_taken_over,
            conformance::renewed_lease_is_not_taken_over
        );
        case!(
            completed_record_expires_after_retention,
            conformance::completed_record_expires_after_retention
        );
        case!(
            scopes_do_not_share_keys,
            conformance::scopes_do_not_share_keys
        );
        case!(
            keys_with_unusual_characters_work,
            conformance::keys_with_unusual_characters_work
        );

        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn purge_removes_only_expired_records() {
            if let Some(store) = $open.await {
                conformance::purge_removes_only_expired_records(store, $exact).await;
            }
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn two_instances_race_one_winner() {
            if let (Some(a), Some(b)) = ($open.await, $open.await) {
                conformance::two_instances_race_one_winner(a, b).await;
            }
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn unreachable_store_reports_backend_error() {
            let store: Option<conformance::DynStore> = $unreachable.await;
            if let Some(store) = store {
                conformance::unreachable_store_reports_backend_error(store).await;
            }
        }
    };
}
