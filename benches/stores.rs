//! Each store's two paths against its real server: a new key (claim, then complete) and a
//! replay (a claim on a completed key). The same body runs for every store.
//!
//! ```text
//! cargo bench --bench stores   # with the servers' URLs set, e.g.:
//! TEST_POSTGRES_URL=postgres://root@127.0.0.1/test TEST_MYSQL_URL=mysql://root@127.0.0.1/test \
//! TEST_REDIS_URL=redis://127.0.0.1:6379 cargo bench --bench stores
//! ```
//!
//! The memory and SQLite stores always run; a server store whose URL is unset is skipped with
//! a note. Records go under a scope unique to the run and expire after ten minutes (the
//! memory store's new keys after 100 ms, see `stores`).

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, Criterion};
use tokio::runtime::Runtime;
use tower_idempotency::{
    store::{MemoryStore, MySqlStore, PostgresStore, RedisStore, SqliteStore, Store},
    ClaimOutcome, Fingerprint, StoreKey, Token,
};

const LEASE: Duration = Duration::from_secs(30);
const RETENTION: Duration = Duration::from_secs(600);

type Opened = Option<Arc<dyn Store>>;

fn url(var: &str) -> Option<String> {
    let url = std::env::var(var).ok().filter(|u| !u.is_empty());
    if url.is_none() {
        eprintln!("skipped: {var} is not set");
    }
    url
}

async fn open_postgres() -> Opened {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&url("TEST_POSTGRES_URL")?)
        .await
        .expect("TEST_POSTGRES_URL is set but PostgreSQL is unreachable");
    let store = PostgresStore::new(pool);
    store.migrate().await.expect("migrate");
    Some(Arc::new(store))
}

async fn open_mysql() -> Opened {
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(4)
        .connect(&url("TEST_MYSQL_URL")?)
        .await
        .expect("TEST_MYSQL_URL is set but MySQL is unreachable");
    let store = MySqlStore::new(pool);
    store.migrate().await.expect("migrate");
    Some(Arc::new(store))
}

async fn open_redis() -> Opened {
    let store = RedisStore::open(&url("TEST_REDIS_URL")?)
        .await
        .expect("TEST_REDIS_URL is set but Redis is unreachable");
    Some(Arc::new(store))
}

async fn open_sqlite() -> Opened {
    let path =
        std::env::temp_dir().join(format!("tower-idempotency-bench-{}.db", std::process::id()));
    let store = SqliteStore::open(&path)
        .await
        .expect("open a temp-file SQLite database");
    store.migrate().await.expect("migrate");
    Some(Arc::new(store))
}

/// `new_key_retention` is how long the new-key records are kept: the memory store's records
/// must expire as fast as the bench adds them, or its byte budget runs out mid-bench.
fn bench_store(
    c: &mut Criterion,
    runtime: &Runtime,
    name: &str,
    store: Arc<dyn Store>,
    new_key_retention: Duration,
) {
    // One scope per run, so runs neither see nor reuse each other's records.
    let scope = format!("bench-{}", Token::random().to_hex());
    let fingerprint = Fingerprint::of([b"POST".as_slice(), b"/payments", b"{}"]);
    // A typical small JSON response with a few headers, as the HTTP layer stores it.
    let payload = Bytes::from(vec![b'x'; 512]);
    let mut group = c.benchmark_group(name);
    group
        .sample_size(30)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));

    let next = AtomicU64::new(0);
    group.bench_function("new key: claim + complete", |b| {
        b.to_async(runtime).iter(|| async {
            let key = StoreKey::new(
                scope.as_str(),
                next.fetch_add(1, Ordering::Relaxed).to_string(),
            );
            let ClaimOutcome::Claimed(token) =
                store.claim(&key, &fingerprint, LEASE).await.unwrap()
            else {
                panic!("a new key must be claimed");
            };
            store
                .complete(&key, token, payload.clone(), new_key_retention)
                .await
                .unwrap();
        })
    });

    let done = StoreKey::new(scope.as_str(), "completed");
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
    group.bench_function("replay: claim on a completed key", |b| {
        b.to_async(runtime).iter(|| async {
            let outcome = store.claim(&done, &fingerprint, LEASE).await.unwrap();
            assert!(matches!(outcome, ClaimOutcome::Existing(_)));
        })
    });
    group.finish();
}

fn stores(c: &mut Criterion) {
    let runtime = Runtime::new().expect("a tokio runtime");
    // At a million new keys a second, 100 ms of records is about 60 MB: the store runs in
    // its steady state, sweeping expired records as it inserts, well within its budget.
    let memory = Arc::new(MemoryStore::new());
    bench_store(c, &runtime, "memory", memory, Duration::from_millis(100));
    let opened = [
        ("sqlite", runtime.block_on(open_sqlite())),
        ("postgres", runtime.block_on(open_postgres())),
        ("mysql", runtime.block_on(open_mysql())),
        ("redis", runtime.block_on(open_redis())),
    ];
    for (name, store) in opened {
        if let Some(store) = store {
            bench_store(c, &runtime, name, store, RETENTION);
        }
    }
}

criterion_group!(benches, stores);
criterion_main!(benches);
