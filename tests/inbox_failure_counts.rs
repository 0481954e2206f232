//! Where the inbox counts handler failures: a table of its own in the handler's database,
//! per consumer and message, on PostgreSQL, MySQL / MariaDB and SQLite. The count goes up by
//! one per failure (one round trip, also on MySQL, which has no `RETURNING`), is read back
//! in a transaction, stays apart per consumer, and is purged with the message ids.
//!
//! Needs TEST_POSTGRES_URL and TEST_MYSQL_URL (`scripts/test` sets them); SQLite always runs.

mod process;

use std::{str::FromStr, time::Duration};

use process::shared::Shared;
use sqlx::{sqlite::SqliteConnectOptions, MySqlPool, PgPool, SqlitePool};
use tower_idempotency::inbox::{InboxStore, MySqlInbox, PgInbox, SqliteInbox};

/// Counts, reads and purges on `inbox` (migrated), whatever its database.
async fn counts_survive_and_purge<I: InboxStore>(inbox: I) {
    for expected in 1..=3 {
        assert_eq!(
            inbox.count_failure("receipts", "m1").await.unwrap(),
            expected
        );
    }
    assert_eq!(
        inbox.count_failure("ledger", "m1").await.unwrap(),
        1,
        "per consumer"
    );
    let mut tx = inbox.pool().begin().await.unwrap();
    assert_eq!(inbox.failures(&mut *tx, "receipts", "m1").await.unwrap(), 3);
    assert_eq!(
        inbox.failures(&mut *tx, "receipts", "m2").await.unwrap(),
        0,
        "no row"
    );
    drop(tx);
    // Nothing is older than a day; everything is older than nothing.
    assert_eq!(
        inbox.purge(Duration::from_secs(86_400), 100).await.unwrap(),
        0
    );
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(inbox.purge(Duration::ZERO, 100).await.unwrap(), 2);
    let mut tx = inbox.pool().begin().await.unwrap();
    assert_eq!(inbox.failures(&mut *tx, "receipts", "m1").await.unwrap(), 0);
}

#[tokio::test]
async fn failure_counts_on_postgres() {
    let Some(shared) = Shared::postgres().await else {
        return;
    };
    shared
        .run(|shared| async move {
            let Shared::Postgres { url, .. } = &shared else {
                unreachable!()
            };
            let inbox = PgInbox::new(PgPool::connect(url).await.unwrap());
            inbox.migrate().await.unwrap();
            counts_survive_and_purge(inbox).await;
        })
        .await;
}

#[tokio::test]
async fn failure_counts_on_mysql() {
    let Some(shared) = Shared::mysql().await else {
        return;
    };
    shared
        .run(|shared| async move {
            let Shared::MySql { url, .. } = &shared else {
                unreachable!()
            };
            let inbox = MySqlInbox::new(MySqlPool::connect(url).await.unwrap());
            inbox.migrate().await.unwrap();
            counts_survive_and_purge(inbox).await;
        })
        .await;
}

#[tokio::test]
async fn failure_counts_on_sqlite() {
    let shared = Shared::sqlite();
    shared
        .run(|shared| async move {
            let Shared::Sqlite { url, .. } = &shared else {
                unreachable!()
            };
            let options = SqliteConnectOptions::from_str(url)
                .unwrap()
                .create_if_missing(true);
            let inbox = SqliteInbox::new(SqlitePool::connect_with(options).await.unwrap());
            inbox.migrate().await.unwrap();
            counts_survive_and_purge(inbox).await;
        })
        .await;
}
