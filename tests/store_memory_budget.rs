//! The memory store's byte budget (issue 9 items 1 and 5): a full store refuses new keys
//! with a typed error and never forgets a live claim or an unexpired record; bytes follow
//! the records; durations its clock cannot hold are configuration errors.

mod common;
mod conformance;

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use common::{app, post_req, send, Runs};
use http::StatusCode;
use tokio::sync::Barrier;
use tower_idempotency::{
    store::{MemoryStore, Store, StoreError},
    ClaimOutcome, IdempotencyLayer, Record, StoreKey, Token,
};

const LEASE: Duration = Duration::from_secs(30);
const RETENTION: Duration = Duration::from_secs(3600);

/// Room for about a hundred records.
fn small_store() -> MemoryStore {
    MemoryStore::builder()
        .max_bytes(100 * (MemoryStore::RECORD_OVERHEAD + 190))
        .build()
}

/// Issue 9 item 1: a full store must never forget a live claim nor a completed record
/// within its retention. Fills a small store with completed records, then claims fresh keys
/// twice: the second claim of a key must never win as long as the first is live, and every
/// completed record must still replay. A store that is full may refuse a claim (a typed
/// error, the handler does not run) but never hand out a second winner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_store_forgets_neither_claims_nor_completed_records() {
    let store = small_store();
    let scope = conformance::fresh_scope();
    let payload = Bytes::from(vec![7u8; 190]);
    let mut completed = Vec::new();
    let mut refused = 0;
    for i in 0..2_000 {
        let key = StoreKey::new(scope.clone(), format!("done-{i}"));
        match store.claim(&key, &conformance::fp("a"), LEASE).await {
            Ok(ClaimOutcome::Claimed(token)) => {
                store
                    .complete(&key, token, payload.clone(), RETENTION)
                    .await
                    .unwrap();
                completed.push(key);
            }
            Ok(other) => panic!("a fresh key is not live yet: {other:?}"),
            Err(StoreError::Full { .. }) => refused += 1,
            Err(other) => panic!("{other:?}"),
        }
    }
    let mut double_winners = 0;
    for i in 0..200 {
        let key = StoreKey::new(scope.clone(), format!("fresh-{i}"));
        if let Ok(ClaimOutcome::Claimed(_)) = store.claim(&key, &conformance::fp("b"), LEASE).await
        {
            // Housekeeping between the two claims, as time passing would bring; it may
            // remove expired records only.
            store.purge_expired(1_000).await.unwrap();
            if let Ok(ClaimOutcome::Claimed(_)) =
                store.claim(&key, &conformance::fp("b"), LEASE).await
            {
                double_winners += 1;
            }
        }
    }
    let mut forgotten = 0;
    for key in &completed {
        match store.lookup(key).await.unwrap() {
            Some(Record::Completed {
                payload: stored, ..
            }) => assert_eq!(stored, payload),
            _ => forgotten += 1,
        }
    }
    assert_eq!(double_winners, 0, "a live claim was forgotten");
    assert_eq!(
        forgotten, 0,
        "completed records within retention were dropped"
    );
    assert!(
        refused > 0,
        "the store never reached its budget: the test proves nothing"
    );
    assert!(!completed.is_empty());
}

fn key(scope: &str, name: impl std::fmt::Display) -> StoreKey {
    StoreKey::new(scope, name.to_string())
}

async fn won(store: &MemoryStore, key: &StoreKey) -> Token {
    match store.claim(key, &conformance::fp("a"), LEASE).await {
        Ok(ClaimOutcome::Claimed(token)) => token,
        other => panic!("expected to win {key:?}: {other:?}"),
    }
}

/// Many tasks race for more new keys than the budget has room for: exactly as many
/// claims win as fit, every other one is refused as full, and nothing overshoots.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_claims_never_overshoot_the_budget() {
    const ROOM: u64 = 50;
    let store = MemoryStore::builder()
        .max_bytes(ROOM * MemoryStore::RECORD_OVERHEAD)
        .build();
    let scope = conformance::fresh_scope();
    let tasks = 4 * ROOM as usize;
    let barrier = Arc::new(Barrier::new(tasks));
    let handles: Vec<_> = (0..tasks)
        .map(|i| {
            let (store, barrier, key) = (store.clone(), barrier.clone(), key(&scope, i));
            tokio::spawn(async move {
                barrier.wait().await;
                store.claim(&key, &conformance::fp("a"), LEASE).await
            })
        })
        .collect();
    let (mut claimed, mut full) = (0, 0);
    for handle in handles {
        match handle.await.unwrap() {
            Ok(ClaimOutcome::Claimed(_)) => claimed += 1,
            Err(StoreError::Full { max_bytes, .. }) => {
                assert_eq!(max_bytes, store.max_bytes());
                full += 1;
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!((claimed, full), (ROOM, 3 * ROOM));
    assert_eq!(store.entry_count(), ROOM);
    assert_eq!(store.used_bytes(), ROOM * MemoryStore::RECORD_OVERHEAD);
    assert_eq!(store.refused_claims(), 3 * ROOM);
}

/// The charge follows the records: payload bytes on complete, everything back on release
/// and once expired records are reclaimed; and expired records make room for new keys.
#[tokio::test]
async fn expired_records_give_their_bytes_back() {
    // Room for three claims; their payloads then overshoot it, as completing may.
    let store = MemoryStore::builder()
        .max_bytes(3 * MemoryStore::RECORD_OVERHEAD)
        .build();
    let scope = conformance::fresh_scope();
    let mut tokens = Vec::new();
    for i in 0..3 {
        tokens.push(won(&store, &key(&scope, i)).await);
    }
    let next = key(&scope, "next");
    let refused = store.claim(&next, &conformance::fp("a"), LEASE).await;
    assert!(
        matches!(refused, Err(StoreError::Full { .. })),
        "{refused:?}"
    );

    let expires_at_once = Duration::from_millis(1);
    for (i, token) in tokens.into_iter().enumerate() {
        store
            .complete(
                &key(&scope, i),
                token,
                Bytes::from(vec![1; 100]),
                expires_at_once,
            )
            .await
            .unwrap();
    }
    assert_eq!(store.used_bytes(), 3 * (MemoryStore::RECORD_OVERHEAD + 100));
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Full, but all of it expired: the claim reclaims it and fits.
    let token = won(&store, &next).await;
    // The claim may have freed only as much as it needed (its shard's sweep); whatever
    // expired record is left is cleared by a purge, and its bytes are given back.
    store.purge_expired(u32::MAX).await.unwrap();
    assert_eq!(store.entry_count(), 1);
    assert_eq!(store.used_bytes(), MemoryStore::RECORD_OVERHEAD);
    store.release(&next, token).await.unwrap();
    assert_eq!((store.entry_count(), store.used_bytes()), (0, 0));
}

/// Issue 9 item 5: durations the store's clock cannot hold are a typed configuration
/// error, not a panic, and a refused `complete` leaves the claim as it was.
#[tokio::test]
async fn endless_leases_and_retentions_are_config_errors() {
    let store = MemoryStore::new();
    let scope = conformance::fresh_scope();
    let endless = store
        .claim(&key(&scope, "a"), &conformance::fp("a"), Duration::MAX)
        .await;
    assert!(matches!(endless, Err(StoreError::Config(_))), "{endless:?}");
    assert_eq!(store.lookup(&key(&scope, "a")).await.unwrap(), None);

    let key = key(&scope, "b");
    let token = won(&store, &key).await;
    let renewed = store.renew(&key, token, Duration::MAX).await;
    assert!(matches!(renewed, Err(StoreError::Config(_))), "{renewed:?}");
    let completed = store
        .complete(&key, token, Bytes::from_static(b"x"), Duration::MAX)
        .await;
    assert!(
        matches!(completed, Err(StoreError::Config(_))),
        "{completed:?}"
    );
    assert_eq!(
        store.lookup(&key).await.unwrap(),
        Some(Record::InProgress {
            fingerprint: conformance::fp("a")
        })
    );
    // Long but finite durations are fine.
    let century = Duration::from_secs(100 * 365 * 24 * 3600);
    store.renew(&key, token, century).await.unwrap();
    store
        .complete(&key, token, Bytes::from_static(b"x"), century)
        .await
        .unwrap();
}

/// Over HTTP a full store is a 503 that runs no handler, while keys already stored still
/// replay.
#[tokio::test]
async fn a_full_store_answers_503_without_running_the_handler() {
    let runs = Runs::default();
    // Room for one claim; its response then overshoots the budget, as completing an
    // admitted claim may.
    let store = MemoryStore::builder()
        .max_bytes(MemoryStore::RECORD_OVERHEAD)
        .build();
    let layer = IdempotencyLayer::new(store.clone()).replay_set_cookie(true);
    let app = app(layer, runs.clone());
    let first = send(&app, post_req("/pay", Some("stored"), "{}")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(runs.count(), 1);

    let refused = send(&app, post_req("/pay", Some("new"), "{}")).await;
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        runs.count(),
        1,
        "the handler ran although nothing could be stored"
    );
    assert_eq!(store.refused_claims(), 1);

    let replay = send(&app, post_req("/pay", Some("stored"), "{}")).await;
    assert_eq!(replay.observable(), first.observable());
    assert_eq!(runs.count(), 1);
}
