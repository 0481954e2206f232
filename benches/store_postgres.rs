//! The two paths that matter against a real PostgreSQL: a new key (claim, then complete: two
//! round trips) and a replay (a claim on a completed key: one round trip, a plain read).
//!
//! ```text
//! TEST_POSTGRES_URL=postgres://root@127.0.0.1/test cargo bench --all-features --bench store_postgres
//! ```
//!
//! Without `TEST_POSTGRES_URL` it prints a note and measures nothing.

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use bytes::Bytes;
use criterion::Criterion;
use sqlx::postgres::PgPoolOptions;
use tokio::runtime::Runtime;
use tower_idempotency::{
    store::{PostgresStore, Store},
    ClaimOutcome, Fingerprint, StoreKey, Token,
};

const LEASE: Duration = Duration::from_secs(30);
const RETENTION: Duration = Duration::from_secs(600);

fn main() {
    let Ok(url) = std::env::var("TEST_POSTGRES_URL") else {
        eprintln!("skipped: TEST_POSTGRES_URL is not set");
        return;
    };
    let runtime = Runtime::new().expect("a tokio runtime");
    let store = runtime.block_on(async {
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .connect(&url)
            .await
            .expect("connect to TEST_POSTGRES_URL");
        let store = PostgresStore::new(pool);
        store.migrate().await.expect("migrate");
        store
    });
    // One scope per run, deleted at the end, so runs neither see nor leave each other's rows.
    let scope = format!("bench-{}", Token::random().to_hex());
    let fingerprint = Fingerprint::of([b"POST".as_slice(), b"/payments", b"{}"]);
    let payload = Bytes::from(vec![b'x'; 512]);

    let mut criterion = Criterion::default()
        .sample_size(30)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();

    let next = AtomicU64::new(0);
    criterion.bench_function("postgres/new key: claim + complete", |b| {
        b.to_async(&runtime).iter(|| async {
            let key = StoreKey::new(
                scope.as_str(),
                format!("new-{}", next.fetch_add(1, Ordering::Relaxed)),
            );
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

    let replayed = StoreKey::new(scope.as_str(), "replayed");
    runtime.block_on(async {
        let ClaimOutcome::Claimed(token) =
            store.claim(&replayed, &fingerprint, LEASE).await.unwrap()
        else {
            panic!("a new key must be claimed");
        };
        store
            .complete(&replayed, token, payload.clone(), RETENTION)
            .await
            .unwrap();
    });
    criterion.bench_function("postgres/replay: claim on a completed key", |b| {
        b.to_async(&runtime).iter(|| async {
            let outcome = store.claim(&replayed, &fingerprint, LEASE).await.unwrap();
            assert!(matches!(outcome, ClaimOutcome::Existing(_)));
        })
    });

    criterion.final_summary();
    runtime.block_on(async {
        sqlx::query(&format!("DELETE FROM {} WHERE scope = $1", store.table()))
            .bind(&scope)
            .execute(store.pool())
            .await
            .expect("clean up the bench scope");
    });
}
