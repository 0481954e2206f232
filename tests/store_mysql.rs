//! The conformance suite and MySQL-specific tests against the MySQL / MariaDB store.
//!
//! Needs `TEST_MYSQL_URL` (e.g. `mysql://root@127.0.0.1:3306/test`); without it every test
//! skips, unless `TEST_REQUIRE_ALL_BACKENDS=1` makes that a failure.
#![cfg(feature = "mysql")]

mod conformance;

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use sqlx::mysql::{MySqlPool, MySqlPoolOptions};
use tower_idempotency::{
    store::{MySqlStore, Store, StoreError},
    ClaimOutcome, Record, StoreKey, Token,
};

const LEASE: Duration = Duration::from_secs(30);
const RETENTION: Duration = Duration::from_secs(3600);

/// A new small pool per call: tests run in parallel and each may open two.
async fn pool() -> Option<MySqlPool> {
    let url = conformance::url_or_skip("TEST_MYSQL_URL")?;
    Some(
        MySqlPoolOptions::new()
            .max_connections(6)
            .connect(&url)
            .await
            .unwrap_or_else(|err| panic!("TEST_MYSQL_URL is set but unreachable: {err}")),
    )
}

async fn open_store() -> Option<MySqlStore> {
    let store = MySqlStore::new(pool().await?);
    store.migrate().await.unwrap();
    Some(store)
}

async fn open() -> Option<conformance::DynStore> {
    Some(Arc::new(open_store().await?))
}

async fn unreachable() -> Option<conformance::DynStore> {
    let pool = MySqlPoolOptions::new()
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy("mysql://root@127.0.0.1:1/test")
        .unwrap();
    Some(Arc::new(MySqlStore::new(pool)))
}

conformance_tests!(open: open(), unreachable: unreachable(), exact_purge_count: true);

fn claimed(outcome: ClaimOutcome) -> Token {
    match outcome {
        ClaimOutcome::Claimed(token) => token,
        other => panic!("expected to win the claim, found {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_migrate_creates_one_table() {
    let Some(pool) = pool().await else { return };
    let table = format!("tower_idem_migrate_{}", &Token::random().to_hex()[..12]);
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let store = MySqlStore::builder(pool.clone())
            .table(table.clone())
            .build()
            .unwrap();
        tasks.push(tokio::spawn(async move { store.migrate().await }));
    }
    for task in tasks {
        task.await.unwrap().unwrap();
    }
    let store = MySqlStore::builder(pool.clone())
        .table(table.clone())
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    let key = StoreKey::new(conformance::fresh_scope(), "k");
    claimed(
        store
            .claim(&key, &conformance::fp("a"), LEASE)
            .await
            .unwrap(),
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE {table}")))
        .execute(&pool)
        .await
        .unwrap();
}

#[tokio::test]
async fn invalid_table_name_is_a_typed_error() {
    let pool = MySqlPoolOptions::new()
        .connect_lazy("mysql://root@127.0.0.1:1/test")
        .unwrap();
    let err = MySqlStore::builder(pool)
        .table("records`; DROP TABLE users")
        .build()
        .unwrap_err();
    assert_eq!(err.name, "records`; DROP TABLE users");
}

/// sqlx 0.8 always connects with CLIENT_FOUND_ROWS and offers no option to drop it, so the
/// "without" column of the affected-rows table cannot be driven from here. This pins down
/// the ambiguity the claim is built to survive: with the flag, a duplicate that changes
/// nothing reports 1 row, exactly like an insert. If sqlx ever stops setting the flag, the
/// claim still reads 0 as "not 2" and settles it by the token, like 1.
#[tokio::test]
async fn found_rows_makes_an_unchanged_duplicate_look_like_an_insert() {
    let Some(store) = open_store().await else {
        return;
    };
    let sql = format!(
        "INSERT INTO {} (scope, `key`, fingerprint, token, payload, expires_at) \
         VALUES (?, 'k', REPEAT('x', 32), NULL, '', UTC_TIMESTAMP(3) + INTERVAL 1 HOUR) \
         ON DUPLICATE KEY UPDATE payload = payload",
        store.table()
    );
    let scope = conformance::fresh_scope();
    let insert = sqlx::query(sqlx::AssertSqlSafe(sql.as_str()))
        .bind(&scope)
        .execute(store.pool())
        .await
        .unwrap();
    let unchanged = sqlx::query(sqlx::AssertSqlSafe(sql.as_str()))
        .bind(&scope)
        .execute(store.pool())
        .await
        .unwrap();
    assert_eq!(insert.rows_affected(), 1);
    assert_eq!(
        unchanged.rows_affected(),
        1,
        "sqlx no longer sets CLIENT_FOUND_ROWS: unchanged duplicates now report 0"
    );
    // And the store tells the two apart regardless.
    let key = StoreKey::new(scope, "k");
    assert!(matches!(
        store
            .claim(&key, &conformance::fp("a"), LEASE)
            .await
            .unwrap(),
        ClaimOutcome::Existing(Record::Completed { .. })
    ));
}

/// Renewing again within the same millisecond writes an identical expiry; that must never
/// read as a lost claim (it would without CLIENT_FOUND_ROWS, were it not for the fallback).
#[tokio::test]
async fn back_to_back_renews_are_never_stale() {
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
    for _ in 0..200 {
        store.renew(&key, token, LEASE).await.unwrap();
    }
}

#[tokio::test]
async fn multi_megabyte_payload_round_trips() {
    let Some(store) = open_store().await else {
        return;
    };
    let key = StoreKey::new(conformance::fresh_scope(), "big");
    let payload: Bytes = (0..5_000_000u32).map(|i| (i % 253) as u8).collect();
    let token = claimed(
        store
            .claim(&key, &conformance::fp("a"), LEASE)
            .await
            .unwrap(),
    );
    store
        .complete(&key, token, payload.clone(), RETENTION)
        .await
        .unwrap();
    match store.lookup(&key).await.unwrap() {
        Some(Record::Completed { payload: got, .. }) => assert!(got == payload),
        other => panic!("expected the completed record, got {other:?}"),
    }
}

/// 255 four-byte characters fill the 1020-byte column exactly; one more is refused rather
/// than truncated into a different key's record.
#[tokio::test]
async fn widest_keys_fit_and_wider_ones_are_refused() {
    let Some(store) = open_store().await else {
        return;
    };
    // Unique per run, padded to exactly 1020 bytes.
    let mut scope = conformance::fresh_scope();
    while scope.len() + 4 <= 1020 {
        scope.push('🦀');
    }
    scope.push_str(&"x".repeat(1020 - scope.len()));
    assert_eq!(scope.len(), 1020);
    let key = StoreKey::new(scope.clone(), "🦀".repeat(255));
    claimed(
        store
            .claim(&key, &conformance::fp("a"), LEASE)
            .await
            .unwrap(),
    );
    assert!(store.lookup(&key).await.unwrap().is_some());
    store.release(&key, Token::random()).await.unwrap_err();

    let wider = StoreKey::new(scope, "🦀".repeat(256));
    let err = store
        .claim(&wider, &conformance::fp("a"), LEASE)
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Config(_)), "{err:?}");
    assert_eq!(store.lookup(&wider).await.unwrap(), None);
}

/// Trailing spaces are significant: `VARBINARY` does not pad like a `_bin` collation does.
#[tokio::test]
async fn trailing_spaces_make_a_different_key() {
    let Some(store) = open_store().await else {
        return;
    };
    let scope = conformance::fresh_scope();
    claimed(
        store
            .claim(
                &StoreKey::new(scope.clone(), "k"),
                &conformance::fp("a"),
                LEASE,
            )
            .await
            .unwrap(),
    );
    claimed(
        store
            .claim(&StoreKey::new(scope, "k "), &conformance::fp("a"), LEASE)
            .await
            .unwrap(),
    );
}
