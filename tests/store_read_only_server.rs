//! A pooled connection that reached a server which cannot take writes (a hot standby, a
//! primary demoted by a failover, a Galera node cut from its cluster) must not be lent out
//! again: the pool would keep it forever (it still answers pings), and every claim on it
//! would fail until the process restarts. The store answers "unavailable" and closes it, so
//! the next claim opens a connection anew, which goes where the proxy points now.
//!
//! Played without a cluster: each pool has ONE connection, opened read-only while the test
//! says so (PostgreSQL `default_transaction_read_only`, MariaDB `SET SESSION TRANSACTION READ
//! ONLY`, the same errors a standby or a `read_only` server gives: 25006, 1792); then new
//! connections are writable, as a failover makes them. The next claim must succeed.
#![cfg(all(feature = "postgres", feature = "mysql"))]

#[path = "common/backends.rs"]
mod backends;

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use backends::{reachable, url_or_skip};
use sqlx::{mysql::MySqlPoolOptions, postgres::PgPoolOptions, Executor};
use tower_idempotency::{
    engine::EngineError,
    store::{MySqlStore, PostgresStore, Store, StoreError},
    transactional::{Transactional, TxBegin},
    ClaimOutcome, Fingerprint, StoreKey, Token,
};

fn key() -> StoreKey {
    StoreKey::new(Token::random().to_hex(), "k")
}

fn fingerprint() -> Fingerprint {
    Fingerprint::of([b"read-only".as_slice()])
}

/// A table of this run's own.
fn table() -> String {
    format!("ti_read_only_{}", &Token::random().to_hex()[..12])
}

/// The claim on the read-only connection fails as unavailable, naming the server's error;
/// once the server takes writes, the next claim succeeds on a new connection.
async fn claim_recovers(store: &dyn Store, read_only: &AtomicBool, refusal: &str) {
    let err = store
        .claim(&key(), &fingerprint(), Duration::from_secs(30))
        .await
        .expect_err("a claim on a read-only connection");
    assert!(matches!(err, StoreError::Backend { .. }), "{err:?}");
    assert!(err.is_unavailable());
    let source = std::error::Error::source(&err).map(ToString::to_string);
    assert!(
        source.as_deref().is_some_and(|s| s.contains(refusal)),
        "{source:?}"
    );
    read_only.store(false, Ordering::SeqCst);
    let outcome = store
        .claim(&key(), &fingerprint(), Duration::from_secs(30))
        .await
        .expect("the claim after the failover, on a new connection");
    assert!(matches!(outcome, ClaimOutcome::Claimed(_)), "{outcome:?}");
}

/// A pool of one connection to `url`, opened read-only while `read_only` is set.
async fn pg_pool(url: &str, read_only: Arc<AtomicBool>) -> sqlx::PgPool {
    PgPoolOptions::new()
        .max_connections(1)
        .after_connect(move |conn, _| {
            let read_only = read_only.load(Ordering::SeqCst);
            Box::pin(async move {
                if read_only {
                    conn.execute("SET default_transaction_read_only = on")
                        .await?;
                }
                Ok(())
            })
        })
        .connect(url)
        .await
        .expect("connect")
}

async fn mysql_pool(url: &str, read_only: Arc<AtomicBool>) -> sqlx::MySqlPool {
    MySqlPoolOptions::new()
        .max_connections(1)
        .after_connect(move |conn, _| {
            let read_only = read_only.load(Ordering::SeqCst);
            Box::pin(async move {
                if read_only {
                    conn.execute("SET SESSION TRANSACTION READ ONLY").await?;
                }
                Ok(())
            })
        })
        .connect(url)
        .await
        .expect("connect")
}

#[tokio::test]
async fn postgres_store_drops_a_read_only_connection() {
    let Some(url) = url_or_skip("TEST_POSTGRES_URL") else {
        return;
    };
    let Some(admin) = reachable("TEST_POSTGRES_URL", sqlx::PgPool::connect(&url).await) else {
        return;
    };
    let table = table();
    PostgresStore::builder(admin.clone())
        .table(table.as_str())
        .build()
        .unwrap()
        .migrate()
        .await
        .unwrap();
    let read_only = Arc::new(AtomicBool::new(true));
    let pool = pg_pool(&url, read_only.clone()).await;
    let store = PostgresStore::builder(pool)
        .table(table.as_str())
        .build()
        .unwrap();
    claim_recovers(&store, &read_only, "read-only transaction").await;

    // The transactional mode: its claim's transaction on the read-only connection fails as
    // unavailable; the next one begins on a new connection and owns the key.
    read_only.store(true, Ordering::SeqCst);
    let pool = pg_pool(&url, read_only.clone()).await;
    let mode = Transactional::new(
        PostgresStore::builder(pool)
            .table(table.as_str())
            .build()
            .unwrap(),
    );
    let err = mode
        .begin(key(), fingerprint())
        .await
        .expect_err("read-only");
    assert!(matches!(err, EngineError::Store { .. }), "{err:?}");
    read_only.store(false, Ordering::SeqCst);
    match mode
        .begin(key(), fingerprint())
        .await
        .expect("after the failover")
    {
        TxBegin::Run(owner) => owner.rollback().await,
        TxBegin::Replay(_) => panic!("a fresh key replayed"),
    }
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {table}")))
        .execute(&admin)
        .await
        .unwrap();
}

#[tokio::test]
async fn mysql_store_drops_a_read_only_connection() {
    let Some(url) = url_or_skip("TEST_MYSQL_URL") else {
        return;
    };
    let Some(admin) = reachable("TEST_MYSQL_URL", sqlx::MySqlPool::connect(&url).await) else {
        return;
    };
    let table = table();
    MySqlStore::builder(admin.clone())
        .table(table.as_str())
        .build()
        .unwrap()
        .migrate()
        .await
        .unwrap();
    let read_only = Arc::new(AtomicBool::new(true));
    let pool = mysql_pool(&url, read_only.clone()).await;
    let store = MySqlStore::builder(pool)
        .table(table.as_str())
        .build()
        .unwrap();
    claim_recovers(&store, &read_only, "READ ONLY transaction").await;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {table}")))
        .execute(&admin)
        .await
        .unwrap();
}
