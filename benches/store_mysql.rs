//! The MySQL store's two hot paths against the server in `TEST_MYSQL_URL` (skipped, with a
//! note, when it is unset): a first request (claim a new key, then complete it) and a retry
//! (claim a completed key, which answers with the stored record).

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, Criterion};
use sqlx::mysql::MySqlPoolOptions;
use tower_idempotency::{
    store::{MySqlStore, Store},
    ClaimOutcome, Fingerprint, StoreKey, Token,
};

const LEASE: Duration = Duration::from_secs(30);
const RETENTION: Duration = Duration::from_secs(3600);

fn store_paths(c: &mut Criterion) {
    let Ok(url) = std::env::var("TEST_MYSQL_URL") else {
        eprintln!("skipped: TEST_MYSQL_URL is not set");
        return;
    };
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let store = runtime.block_on(async {
        let pool = MySqlPoolOptions::new()
            .max_connections(4)
            .connect(&url)
            .await
            .unwrap();
        let store = MySqlStore::new(pool);
        store.migrate().await.unwrap();
        store
    });
    let scope = format!("bench-{}", Token::random().to_hex());
    let fingerprint = Fingerprint::of([b"POST".as_slice(), b"/payments", b"{}"]);
    let payload = Bytes::from(vec![b'x'; 1024]);

    let mut group = c.benchmark_group("mysql");
    group
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));

    let next = AtomicU64::new(0);
    group.bench_function("claim_complete_new_key", |b| {
        b.to_async(&runtime).iter(|| async {
            let key = StoreKey::new(
                scope.clone(),
                next.fetch_add(1, Ordering::Relaxed).to_string(),
            );
            let ClaimOutcome::Claimed(token) =
                store.claim(&key, &fingerprint, LEASE).await.unwrap()
            else {
                panic!("a new key must be claimable");
            };
            store
                .complete(&key, token, payload.clone(), RETENTION)
                .await
                .unwrap();
        })
    });

    let done = StoreKey::new(scope.clone(), "completed");
    runtime.block_on(async {
        let ClaimOutcome::Claimed(token) = store.claim(&done, &fingerprint, LEASE).await.unwrap()
        else {
            panic!("a new key must be claimable");
        };
        store
            .complete(&done, token, payload.clone(), RETENTION)
            .await
            .unwrap();
    });
    group.bench_function("replay_completed_key", |b| {
        b.to_async(&runtime).iter(|| async {
            let outcome = store.claim(&done, &fingerprint, LEASE).await.unwrap();
            assert!(matches!(outcome, ClaimOutcome::Existing(_)));
        })
    });
    group.finish();

    // The bench's rows live in their own scope; leave the shared table as it was.
    runtime.block_on(async {
        sqlx::query(&format!("DELETE FROM {} WHERE scope = ?", store.table()))
            .bind(scope.as_bytes())
            .execute(store.pool())
            .await
            .unwrap();
    });
}

criterion_group!(benches, store_paths);
criterion_main!(benches);
