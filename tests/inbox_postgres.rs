//! The PostgreSQL inbox claim on its own: overlapping copies of one message produce one
//! effect, a busy copy gives its connection back instead of waiting, ids are scoped per
//! consumer, and purging is bounded. Needs TEST_POSTGRES_URL.

mod pipeline;
mod process;

use std::{future::Future, pin::Pin, time::Duration};

use pipeline::{inbox_copies::race_copies, Db};
use process::shared::Shared;
use sqlx::PgConnection;
use tower_idempotency::inbox::{InboxClaim, InboxStore, PgInbox};

async fn with_db<F: std::future::Future<Output = ()>>(test: impl FnOnce(Db) -> F) {
    let Some(shared) = Shared::postgres().await else {
        return;
    };
    shared
        .run(|shared| async { test(Db::new(shared).await).await })
        .await;
}

/// The receipt of message `id`, written in the claim's transaction.
fn write_receipt<'a>(
    conn: &'a mut PgConnection,
    id: &'a str,
) -> Pin<Box<dyn Future<Output = ()> + Send + 'a>> {
    Box::pin(async move {
        sqlx::query("INSERT INTO receipts (payment_id, amount, currency) VALUES ($1, 1, 'EUR')")
            .bind(id)
            .execute(conn)
            .await
            .expect("insert receipt");
    })
}

#[tokio::test]
async fn overlapping_copies_of_one_message_write_one_receipt() {
    with_db(|db| async move {
        race_copies(
            &db.inbox,
            "msg-1",
            16,
            write_receipt,
            Duration::from_millis(300),
        )
        .await;
        assert_eq!(db.receipts().await.get("msg-1"), Some(&1), "receipt rows");
    })
    .await;
}

#[tokio::test]
async fn a_busy_copy_returns_at_once_and_then_sees_the_outcome_of_the_first() {
    with_db(|db| async move {
        // Two connections: if the second claim waited for the first transaction, the test
        // would hang (the first commits only after the second claim answered).
        let inbox = PgInbox::new(
            sqlx::postgres::PgPoolOptions::new()
                .max_connections(2)
                .connect(&db.url)
                .await
                .unwrap(),
        );
        for commit_first in [true, false] {
            let id = format!("msg-{commit_first}");
            let mut first = inbox.pool().begin().await.unwrap();
            assert_eq!(
                inbox.claim(&mut first, "receipts", &id).await.unwrap(),
                InboxClaim::New
            );
            let mut second = inbox.pool().begin().await.unwrap();
            let busy = tokio::time::timeout(
                Duration::from_secs(10),
                inbox.claim(&mut second, "receipts", &id),
            )
            .await
            .expect("the second claim waited for the first transaction")
            .unwrap();
            assert_eq!(busy, InboxClaim::Busy);
            drop(second);
            if commit_first {
                first.commit().await.unwrap();
            } else {
                first.rollback().await.unwrap();
            }
            let mut third = inbox.pool().begin().await.unwrap();
            let expected = if commit_first {
                InboxClaim::Duplicate
            } else {
                InboxClaim::New
            };
            assert_eq!(
                inbox.claim(&mut third, "receipts", &id).await.unwrap(),
                expected
            );
            // The handler's own statements run without the claim's short lock timeout.
            let timeout: String = sqlx::query_scalar("SELECT current_setting('lock_timeout')")
                .fetch_one(&mut *third)
                .await
                .unwrap();
            assert_eq!(
                timeout, "0",
                "the claim's lock timeout leaked into the transaction"
            );
            third.commit().await.unwrap();
        }
    })
    .await;
}

#[tokio::test]
async fn message_ids_are_scoped_per_consumer_name() {
    with_db(|db| async move {
        for consumer in ["receipts", "ledger"] {
            let mut tx = db.inbox.pool().begin().await.unwrap();
            assert_eq!(
                db.inbox.claim(&mut tx, consumer, "m").await.unwrap(),
                InboxClaim::New
            );
            tx.commit().await.unwrap();
        }
        let mut tx = db.inbox.pool().begin().await.unwrap();
        assert_eq!(
            db.inbox.claim(&mut tx, "ledger", "m").await.unwrap(),
            InboxClaim::Duplicate
        );
    })
    .await;
}

#[tokio::test]
async fn purging_removes_only_ids_past_the_retention_in_bounded_batches() {
    with_db(|db| async move {
        sqlx::query(
            "INSERT INTO tower_inbox (consumer, message_id, received_at)
             SELECT 'receipts', 'old-' || n, now() - interval '8 days' FROM generate_series(1, 5) n
             UNION ALL SELECT 'receipts', 'new-' || n, now() FROM generate_series(1, 3) n",
        )
        .execute(&db.pool)
        .await
        .unwrap();
        let week = Duration::from_secs(7 * 24 * 3600);
        assert_eq!(
            db.inbox.purge(week, 2).await.unwrap(),
            2,
            "one bounded batch"
        );
        assert_eq!(db.inbox.purge(week, 100).await.unwrap(), 3);
        assert_eq!(db.inbox.purge(week, 100).await.unwrap(), 0);
        let left: Vec<String> =
            sqlx::query_scalar("SELECT message_id FROM tower_inbox ORDER BY message_id")
                .fetch_all(&db.pool)
                .await
                .unwrap();
        assert_eq!(left, ["new-1", "new-2", "new-3"]);
    })
    .await;
}
