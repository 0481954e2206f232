//! The conformance suite, and what only Postgres has (migration, table names, the replay
//! path), against a real server at `TEST_POSTGRES_URL`.
//!
//! ```text
//! TEST_POSTGRES_URL=postgres://root@127.0.0.1/test TEST_REQUIRE_ALL_BACKENDS=1 \
//!     cargo test --all-features --test store_postgres
//! ```
#![cfg(feature = "postgres")]

mod conformance;

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use sqlx::{postgres::PgPoolOptions, PgPool};
use tower_idempotency::{
    store::{PostgresStore, Store, StoreError},
    ClaimOutcome, Record, StoreKey, Token,
};

/// A new pool per call, so that two calls are two independent "instances". Small, because
/// every test opens its own and the race tests queue 64 claims on it.
async fn pool() -> Option<PgPool> {
    let url = conformance::url_or_skip("TEST_POSTGRES_URL")?;
    match PgPoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(10))
        .connect(&url)
        .await
    {
        Ok(pool) => Some(pool),
        Err(error) if conformance::require_all() => {
            panic!("TEST_POSTGRES_URL is set but the server is unreachable: {error}")
        }
        Err(error) => {
            eprintln!("skipped: TEST_POSTGRES_URL is set but the server is unreachable: {error}");
            None
        }
    }
}

async fn open_store() -> Option<PostgresStore> {
    let store = PostgresStore::new(pool().await?);
    store.migrate().await.expect("migrate");
    Some(store)
}

async fn open() -> Option<conformance::DynStore> {
    Some(Arc::new(open_store().await?))
}

async fn unreachable() -> Option<conformance::DynStore> {
    let pool = PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(500))
        .connect_lazy("postgres://root@127.0.0.1:1/test")
        .expect("a valid URL");
    Some(Arc::new(PostgresStore::new(pool)))
}

conformance_tests!(open: open(), unreachable: unreachable(), exact_purge_count: true);

const LEASE: Duration = Duration::from_secs(30);
const RETENTION: Duration = Duration::from_secs(3600);

fn claimed(outcome: ClaimOutcome) -> Token {
    match outcome {
        ClaimOutcome::Claimed(token) => token,
        other => panic!("expected to win the claim, found {other:?}"),
    }
}

/// A table of its own for a test that creates or drops tables, so it cannot disturb the
/// shared default table the other tests use.
fn private_table() -> String {
    format!("tower_idempotency_test_{}", &Token::random().to_hex()[..12])
}

async fn drop_table(pool: &PgPool, table: &str) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS {table}")))
        .execute(pool)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn migrate_is_idempotent_and_safe_to_run_concurrently() {
    let Some(pool) = pool().await else { return };
    let table = private_table();
    let store = PostgresStore::builder(pool.clone())
        .table(&table)
        .build()
        .unwrap();
    // Without the advisory lock, concurrent CREATE TABLE IF NOT EXISTS fails on the catalog's
    // unique indexes now and then; eight at once makes that likely.
    let runs: Vec<_> = (0..8)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move { store.migrate().await })
        })
        .collect();
    for run in runs {
        run.await.unwrap().unwrap();
    }
    store.migrate().await.unwrap();

    let key = StoreKey::new("s", "k");
    let token = claimed(
        store
            .claim(&key, &conformance::fp("a"), LEASE)
            .await
            .unwrap(),
    );
    store
        .complete(&key, token, Bytes::from_static(b"ok"), RETENTION)
        .await
        .unwrap();
    store.migrate().await.unwrap();
    assert!(
        store.lookup(&key).await.unwrap().is_some(),
        "a second migrate must keep the records"
    );
    drop_table(&pool, &table).await;
}

/// The collation of each of `columns` of `table`, in order.
async fn collations(pool: &PgPool, table: &str, columns: &[&str]) -> Vec<String> {
    let mut found = Vec::new();
    for column in columns {
        let name: String = sqlx::query_scalar(
            "SELECT c.collname::text FROM pg_attribute a JOIN pg_collation c ON c.oid = a.attcollation \
             WHERE a.attrelid = $1::regclass AND a.attname = $2",
        )
        .bind(table)
        .bind(column)
        .fetch_one(pool)
        .await
        .unwrap();
        found.push(name);
    }
    found
}

/// Keys and message ids are opaque: the tables compare them bytewise, so the order of their
/// unique indexes never depends on the operating system's language rules (which change
/// across upgrades and then leave a text index out of order).
#[tokio::test]
async fn every_table_migrate_makes_compares_its_ids_bytewise() {
    let Some(pool) = pool().await else { return };
    let (records, inbox, outbox) = (private_table(), private_table(), private_table());
    let store = PostgresStore::builder(pool.clone())
        .table(&records)
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    let inbox_store = tower_idempotency::inbox::PgInbox::with_table(pool.clone(), &inbox).unwrap();
    inbox_store.migrate().await.unwrap();
    let outbox_store =
        tower_idempotency::outbox::PgOutbox::with_table(pool.clone(), &outbox).unwrap();
    outbox_store.migrate().await.unwrap();
    assert_eq!(
        collations(&pool, &records, &["scope", "key"]).await,
        ["C", "C"]
    );
    assert_eq!(
        collations(&pool, &inbox, &["consumer", "message_id"]).await,
        ["C", "C"]
    );
    assert_eq!(collations(&pool, &outbox, &["id"]).await, ["C"]);
    for table in [&records, &inbox, &outbox] {
        drop_table(&pool, table).await;
    }
}

#[tokio::test]
async fn invalid_table_name_is_a_typed_error_before_any_sql() {
    // A lazy pool to a dead port: the refusal must not need the database.
    let pool = PgPoolOptions::new()
        .connect_lazy("postgres://root@127.0.0.1:1/test")
        .unwrap();
    let error = PostgresStore::builder(pool)
        .table("records; DROP TABLE users")
        .build()
        .unwrap_err();
    assert_eq!(error.name, "records; DROP TABLE users");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_qualified_table_works() {
    let Some(pool) = pool().await else { return };
    let schema = private_table();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&pool)
        .await
        .unwrap();
    let store = PostgresStore::builder(pool.clone())
        .table(format!("{schema}.records"))
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    let key = StoreKey::new("s", "k");
    claimed(
        store
            .claim(&key, &conformance::fp("a"), LEASE)
            .await
            .unwrap(),
    );
    let index: Option<String> = sqlx::query_scalar(
        "SELECT indexname::text FROM pg_indexes WHERE schemaname = $1 AND indexname = 'records_expires_at_idx'",
    )
    .bind(&schema)
    .fetch_optional(&pool)
    .await
    .unwrap();
    assert!(index.is_some(), "the expiry index lives next to the table");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&pool)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_table_is_a_backend_error_with_the_sqlx_source() {
    let Some(pool) = pool().await else { return };
    let store = PostgresStore::builder(pool)
        .table(private_table())
        .build()
        .unwrap();
    let error = store
        .claim(&StoreKey::new("s", "k"), &conformance::fp("a"), LEASE)
        .await
        .unwrap_err();
    let StoreError::Backend { backend, source } = &error else {
        panic!("expected a backend error, got {error:?}");
    };
    assert_eq!(*backend, "postgres");
    let sqlx_error = source
        .downcast_ref::<sqlx::Error>()
        .expect("the source is the sqlx error");
    assert!(
        matches!(sqlx_error, sqlx::Error::Database(_)),
        "{sqlx_error:?}"
    );
}

/// The replay of a completed key is a plain read: it must neither write a row version nor
/// wait for a row lock. Holding `FOR UPDATE` on the row in another transaction makes any
/// lock attempt hang, so a prompt answer shows the claim never reached `ON CONFLICT`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_of_a_completed_key_neither_writes_nor_locks() {
    let Some(store) = open_store().await else {
        return;
    };
    let key = StoreKey::new(conformance::fresh_scope(), "k");
    let token = claimed(
        store
            .claim(&key, &conformance::fp("a"), LEASE)
            .await
            .unwrap(),
    );
    store
        .complete(&key, token, Bytes::from_static(b"stored"), RETENTION)
        .await
        .unwrap();
    let version_sql = format!(
        "SELECT xmin::text || ctid::text FROM {} WHERE scope = $1 AND key = $2",
        store.table()
    );
    let version = || {
        sqlx::query_scalar::<_, String>(sqlx::AssertSqlSafe(version_sql.as_str()))
            .bind(key.scope())
            .bind(key.key())
            .fetch_one(store.pool())
    };
    let before = version().await.unwrap();

    let mut locker = store.pool().begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT 1 FROM {} WHERE scope = $1 AND key = $2 FOR UPDATE",
        store.table()
    )))
    .bind(key.scope())
    .bind(key.key())
    .execute(&mut *locker)
    .await
    .unwrap();
    let replay = tokio::time::timeout(
        Duration::from_secs(5),
        store.claim(&key, &conformance::fp("a"), LEASE),
    )
    .await
    .expect("the replay waited for a row lock")
    .unwrap();
    locker.rollback().await.unwrap();

    assert_eq!(
        replay,
        ClaimOutcome::Existing(Record::Completed {
            fingerprint: conformance::fp("a"),
            payload: Bytes::from_static(b"stored"),
        })
    );
    assert_eq!(
        version().await.unwrap(),
        before,
        "the replay wrote a row version"
    );
}

/// The lease is measured by the database's clock, and the claim takes over an expired lease
/// in place (same row, new token), as the next claim after a crash would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_lease_is_taken_over_in_place() {
    let Some(store) = open_store().await else {
        return;
    };
    let key = StoreKey::new(conformance::fresh_scope(), "k");
    let old = claimed(
        store
            .claim(&key, &conformance::fp("a"), LEASE)
            .await
            .unwrap(),
    );
    // Age the lease on the server side instead of sleeping.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE {} SET expires_at = now() - interval '1 second' WHERE scope = $1 AND key = $2",
        store.table()
    )))
    .bind(key.scope())
    .bind(key.key())
    .execute(store.pool())
    .await
    .unwrap();
    let new = claimed(
        store
            .claim(&key, &conformance::fp("b"), LEASE)
            .await
            .unwrap(),
    );
    assert_ne!(old, new);
    let stored: Vec<u8> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT token FROM {} WHERE scope = $1 AND key = $2",
        store.table()
    )))
    .bind(key.scope())
    .bind(key.key())
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(stored, new.to_bytes());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_purger_deletes_expired_rows() {
    let Some(store) = open_store().await else {
        return;
    };
    let key = StoreKey::new(conformance::fresh_scope(), "k");
    let token = claimed(
        store
            .claim(&key, &conformance::fp("a"), LEASE)
            .await
            .unwrap(),
    );
    store
        .complete(&key, token, Bytes::new(), Duration::from_millis(200))
        .await
        .unwrap();
    let purger =
        tower_idempotency::store::spawn_purger(store.clone(), Duration::from_millis(100), 50);
    let rows_sql = format!(
        "SELECT count(*) FROM {} WHERE scope = $1 AND key = $2",
        store.table()
    );
    let mut gone = false;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let rows: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(rows_sql.as_str()))
            .bind(key.scope())
            .bind(key.key())
            .fetch_one(store.pool())
            .await
            .unwrap();
        if rows == 0 {
            gone = true;
            break;
        }
    }
    purger.abort();
    assert!(gone, "the purger left an expired row behind");
}

#[tokio::test]
async fn durations_too_long_for_the_store_are_refused() {
    let Some(store) = open_store().await else {
        return;
    };
    let key = StoreKey::new(conformance::fresh_scope(), "k");
    let error = store
        .claim(&key, &conformance::fp("a"), Duration::MAX)
        .await
        .unwrap_err();
    assert!(matches!(error, StoreError::Config(_)), "{error:?}");
}
