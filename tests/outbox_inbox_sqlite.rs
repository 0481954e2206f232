//! The outbox and the inbox on SQLite (a fresh file per test): committed rows are published
//! once and rolled-back ones never, relays take turns without repeating a row, and the inbox
//! keeps overlapping copies to one effect. Needs TEST_AMQP_URL for the relay test.

mod pipeline;
mod process;

use std::{collections::HashSet, str::FromStr, sync::Arc, time::Duration};

use pipeline::{race_relays, tally, TestBroker, TOPIC};
use process::shared::Shared;
use sqlx::{sqlite::SqliteConnectOptions, SqlitePool};
use tokio::sync::Barrier;
use tower_idempotency::{
    inbox::{InboxClaim, InboxStore, SqliteInbox},
    outbox::{NewEvent, OutboxSource, SqliteOutbox},
};

async fn with_sqlite<F: std::future::Future<Output = ()>>(test: impl FnOnce(SqlitePool) -> F) {
    let shared = Shared::sqlite();
    let Shared::Sqlite { url, .. } = &shared else {
        unreachable!()
    };
    let options = SqliteConnectOptions::from_str(url)
        .unwrap()
        .create_if_missing(true);
    shared
        .run(|_| async move {
            let pool = SqlitePool::connect_with(options)
                .await
                .expect("open the file");
            test(pool.clone()).await;
            pool.close().await;
        })
        .await;
}

#[tokio::test]
async fn relays_take_turns_and_publish_every_committed_row_once() {
    let Some(broker) = TestBroker::amqp() else {
        return;
    };
    let cleanup = broker.clone();
    with_sqlite(|pool| async move {
        let outbox = SqliteOutbox::new(pool.clone());
        outbox.migrate().await.unwrap();
        let mut committed = HashSet::new();
        for i in 0..60 {
            let event = NewEvent::new(TOPIC, r#"{"payment_id": "p"}"#);
            let mut tx = pool.begin().await.unwrap();
            outbox.enqueue(&mut tx, &event).await.unwrap();
            if i % 5 == 4 {
                tx.rollback().await.unwrap();
            } else {
                tx.commit().await.unwrap();
                committed.insert(event.id);
            }
        }
        // Small batches, so the relays really interleave.
        let per_relay = race_relays(&outbox, &broker, 3, 4).await;
        assert_eq!(
            per_relay.iter().sum::<usize>(),
            committed.len(),
            "{per_relay:?}"
        );
        assert_eq!(outbox.unsent().await.unwrap(), 0);
        let counts = tally(&broker.drain_ids(Duration::from_millis(1500)).await);
        assert_eq!(counts.keys().cloned().collect::<HashSet<_>>(), committed);
        assert!(
            counts.values().all(|&n| n == 1),
            "published twice: {counts:?}"
        );
        assert_eq!(
            outbox.purge_sent(Duration::ZERO, 10).await.unwrap(),
            10,
            "one bounded batch"
        );
    })
    .await;
    cleanup.clean_up().await;
}

#[tokio::test]
async fn overlapping_copies_of_one_message_commit_one_effect() {
    with_sqlite(|pool| async move {
        let inbox = SqliteInbox::new(pool.clone());
        inbox.migrate().await.unwrap();
        sqlx::query("CREATE TABLE receipts (payment_id TEXT NOT NULL)")
            .execute(&pool)
            .await
            .unwrap();
        let copies = 4;
        let barrier = Arc::new(Barrier::new(copies));
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..copies {
            let (inbox, barrier) = (inbox.clone(), barrier.clone());
            tasks.spawn(async move {
                barrier.wait().await;
                loop {
                    let mut tx = inbox.pool().begin().await.unwrap();
                    match inbox.claim(&mut tx, "receipts", "m1").await.unwrap() {
                        InboxClaim::New => {
                            sqlx::query("INSERT INTO receipts VALUES ('m1')")
                                .execute(&mut *tx)
                                .await
                                .unwrap();
                            tokio::time::sleep(Duration::from_millis(300)).await;
                            tx.commit().await.unwrap();
                            return InboxClaim::New;
                        }
                        InboxClaim::Duplicate => return InboxClaim::Duplicate,
                        InboxClaim::Busy => {
                            drop(tx);
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    }
                }
            });
        }
        let claims = tasks.join_all().await;
        assert_eq!(
            claims.iter().filter(|c| **c == InboxClaim::New).count(),
            1,
            "{claims:?}"
        );
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM receipts")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(rows, 1);
        sqlx::query("UPDATE tower_inbox SET received_at = received_at - 8 * 86400000")
            .execute(&pool)
            .await
            .unwrap();
        assert_eq!(
            inbox
                .purge(Duration::from_secs(7 * 86400), 10)
                .await
                .unwrap(),
            1
        );
    })
    .await;
}
