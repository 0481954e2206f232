//! Round trips of the Redis store against a real server: the claim-and-complete of a first
//! request, and the replay a duplicate of a completed request costs.
//!
//! Needs `TEST_REDIS_URL` (for example `redis://127.0.0.1:6379`); prints a note and measures
//! nothing without it. Keys go under a prefix unique to the run and expire after a minute.

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, Criterion};
use tower_idempotency::{
    store::{RedisStore, Store},
    ClaimOutcome, Fingerprint, StoreKey, Token,
};

const LEASE: Duration = Duration::from_secs(30);
const RETENTION: Duration = Duration::from_secs(60);

fn store_redis(c: &mut Criterion) {
    let Ok(url) = std::env::var("TEST_REDIS_URL") else {
        eprintln!("skipped: TEST_REDIS_URL is not set");
        return;
    };
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let store = runtime.block_on(async {
        RedisStore::builder()
            .prefix(format!(
                "tower-idempotency-bench:{}:",
                Token::random().to_hex()
            ))
            .unwrap()
            .open(&url)
            .await
            .expect("TEST_REDIS_URL is set but Redis is unreachable")
    });
    let fingerprint = Fingerprint::of([b"POST".as_slice(), b"/payments", b"{}"]);
    // A typical small JSON response with a few headers, as the HTTP layer would store it.
    let payload = Bytes::from(vec![b'x'; 512]);

    let mut group = c.benchmark_group("redis");
    group
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));

    let next = AtomicU64::new(0);
    group.bench_function("claim_and_complete_new_key", |b| {
        b.to_async(&runtime).iter(|| async {
            let key = StoreKey::new("bench", next.fetch_add(1, Ordering::Relaxed).to_string());
            let ClaimOutcome::Claimed(token) =
                store.claim(&key, &fingerprint, LEASE).await.unwrap()
            else {
                panic!("a new key must be claimed");
            };
            store
                .complete(&key, token, payload.clone(), RETENTION)
                .await
                .unwrap();
        })
    });

    let done = StoreKey::new("bench", "completed");
    runtime.block_on(async {
        let ClaimOutcome::Claimed(token) = store.claim(&done, &fingerprint, LEASE).await.unwrap()
        else {
            panic!("the replay key must be new");
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
}

criterion_group!(benches, store_redis);
criterion_main!(benches);
