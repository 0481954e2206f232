//! The conformance suite and SQLite-specific tests against the SQLite store.
//!
//! All tests of this process share one database file (not `:memory:`, which one pool cannot
//! share with another), and every `open()` builds a new pool onto it, so the two-instances
//! race really is two pools contending for one file's write lock.
#![cfg(feature = "sqlite")]

mod conformance;
#[path = "common/sqlite_file.rs"]
mod sqlite_file;

use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use sqlite_file::fresh_path;

use bytes::Bytes;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
use tokio::sync::OnceCell;
use tower_idempotency::{
    store::{SqliteStore, Store, StoreError},
    ClaimOutcome, Record, StoreKey,
};

/// Creates the shared file once: the switch to WAL cannot wait for a lock, so it must not
/// race with the many pools the tests open at once.
async fn shared_path() -> &'static Path {
    static PATH: OnceCell<PathBuf> = OnceCell::const_new();
    PATH.get_or_init(|| async {
        let path = fresh_path("shared");
        let store = SqliteStore::open(&path).await.unwrap();
        store.migrate().await.unwrap();
        store.pool().close().await;
        path
    })
    .await
}

async fn pool_on(path: &Path) -> sqlx::SqlitePool {
    SqlitePoolOptions::new()
        .max_connections(8)
        .connect_with(SqliteStore::durable_options(
            SqliteConnectOptions::new().filename(path),
        ))
        .await
        .unwrap()
}

async fn open() -> Option<conformance::DynStore> {
    let store = SqliteStore::new(pool_on(shared_path().await).await);
    store.migrate().await.unwrap();
    Some(Arc::new(store))
}

/// The nearest thing SQLite has to an unreachable server: a database in a directory that
/// does not exist, behind a lazy pool, so the failure comes from the claim itself.
async fn unreachable() -> Option<conformance::DynStore> {
    let options = SqliteConnectOptions::new()
        .filename("/nonexistent-tower-idempotency-dir/records.db")
        .create_if_missing(true);
    let pool = SqlitePoolOptions::new()
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy_with(options);
    Some(Arc::new(SqliteStore::new(pool)))
}

conformance_tests!(open: open(), unreachable: unreachable(), exact_purge_count: true);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_migrate_on_a_fresh_file() {
    let path = fresh_path("migrate");
    // The first open switches the new file to WAL; after that, eight pools race to create
    // the schema.
    SqliteStore::open(&path).await.unwrap().pool().close().await;
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let pool = pool_on(&path).await;
        tasks.push(tokio::spawn(async move {
            let store = SqliteStore::new(pool);
            store.migrate().await.map(|()| store)
        }));
    }
    let mut stores = Vec::new();
    for task in tasks {
        stores.push(task.await.unwrap().unwrap());
    }
    let key = StoreKey::new(conformance::fresh_scope(), "k");
    let outcome = stores[0]
        .claim(&key, &conformance::fp("a"), Duration::from_secs(30))
        .await
        .unwrap();
    assert!(matches!(outcome, ClaimOutcome::Claimed(_)));
    stores[0].migrate().await.unwrap();
    let _ = std::fs::remove_file(&path);
}

#[tokio::test]
async fn invalid_table_name_is_a_typed_error() {
    let pool = SqlitePoolOptions::new()
        .connect_lazy("sqlite::memory:")
        .unwrap();
    let err = SqliteStore::builder(pool)
        .table("records; DROP TABLE users")
        .build()
        .unwrap_err();
    assert_eq!(err.name, "records; DROP TABLE users");
}

#[tokio::test]
async fn custom_and_schema_qualified_tables_work() {
    let pool = pool_on(shared_path().await).await;
    for name in ["custom_records", "main.qualified_records"] {
        let store = SqliteStore::builder(pool.clone())
            .table(name)
            .build()
            .unwrap();
        assert!(store.schema_sql().contains(name), "{}", store.schema_sql());
        store.migrate().await.unwrap();
        store.migrate().await.unwrap();
        let key = StoreKey::new(conformance::fresh_scope(), "k");
        let fp = conformance::fp("a");
        let ClaimOutcome::Claimed(token) = store
            .claim(&key, &fp, Duration::from_secs(30))
            .await
            .unwrap()
        else {
            panic!("a fresh key in {name} must be claimable");
        };
        store
            .complete(
                &key,
                token,
                Bytes::from_static(b"ok"),
                Duration::from_secs(60),
            )
            .await
            .unwrap();
        assert_eq!(
            store.lookup(&key).await.unwrap(),
            Some(Record::Completed {
                fingerprint: fp,
                payload: Bytes::from_static(b"ok")
            })
        );
    }
}

#[tokio::test]
async fn multi_megabyte_payload_round_trips() {
    let store = open().await.unwrap();
    let key = StoreKey::new(conformance::fresh_scope(), "big");
    let payload: Bytes = (0..5_000_000u32).map(|i| (i % 253) as u8).collect();
    let ClaimOutcome::Claimed(token) = store
        .claim(&key, &conformance::fp("a"), Duration::from_secs(30))
        .await
        .unwrap()
    else {
        panic!("fresh key");
    };
    store
        .complete(&key, token, payload.clone(), Duration::from_secs(60))
        .await
        .unwrap();
    match store.lookup(&key).await.unwrap() {
        Some(Record::Completed { payload: got, .. }) => assert!(got == payload),
        other => panic!("expected the completed record, got {other:?}"),
    }
}

#[tokio::test]
async fn open_uses_wal_and_refuses_a_missing_directory() {
    let store = SqliteStore::open(shared_path().await).await.unwrap();
    let (mode,): (String,) = sqlx::query_as("PRAGMA journal_mode")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(mode, "wal");

    let err = SqliteStore::open("/nonexistent-tower-idempotency-dir/x.db")
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::Backend {
                backend: "sqlite",
                ..
            }
        ),
        "{err:?}"
    );
}
