//! The SQLite store's two hot paths, on a WAL database file in the temp directory:
//! a first request (claim a new key, then complete it) and a retry (claim a completed key,
//! which answers with the stored record).

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, Criterion};
use tower_idempotency::{
    store::{SqliteStore, Store},
    ClaimOutcome, Fingerprint, StoreKey, Token,
};

const LEASE: Duration = Duration::from_secs(30);
const RETENTION: Duration = Duration::from_secs(3600);

fn store_paths(c: &mut Criterion) {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let path = std::env::temp_dir().join(format!(
        "tower-idempotency-bench-{}.db",
        Token::random().to_hex()
    ));
    let store = runtime.block_on(async {
        let store = SqliteStore::open(&path).await.unwrap();
        store.migrate().await.unwrap();
        store
    });
    let scope = Token::random().to_hex();
    let fingerprint = Fingerprint::of([b"POST".as_slice(), b"/payments", b"{}"]);
    let payload = Bytes::from(vec![b'x'; 1024]);

    let mut group = c.benchmark_group("sqlite");
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

    runtime.block_on(store.pool().close());
    for suffix in ["", "-wal", "-shm"] {
        let mut file = path.clone().into_os_string();
        file.push(suffix);
        let _ = std::fs::remove_file(file);
    }
}

criterion_group!(benches, store_paths);
criterion_main!(benches);
