//! The outbox and the inbox on MySQL / MariaDB (a fresh database per test): committed rows
//! are published once and rolled-back ones never, racing relays (`SKIP LOCKED`) lose and
//! repeat nothing, a refused row is parked without holding back the rest, and the inbox keeps
//! overlapping copies to one effect.
//!
//! Needs TEST_MYSQL_URL and TEST_AMQP_URL (`scripts/test` sets them).

mod outbox_parking;
mod pipeline;
mod process;

use std::{collections::HashSet, future::Future, pin::Pin, time::Duration};

use outbox_parking::{
    a_refused_row_is_parked_and_holds_back_nothing, an_upgraded_table_parks_and_sends, one_refusal,
    three_refusals,
};
use pipeline::{inbox_copies::race_copies, race_relays, tally, TestBroker, TOPIC};
use process::shared::Shared;
use sqlx::{MySqlConnection, MySqlPool};
use tower_idempotency::{
    inbox::{InboxClaim, InboxStore, MySqlInbox},
    outbox::{MySqlOutbox, NewEvent, OutboxSource, Relay},
};

async fn with_mysql<F: std::future::Future<Output = ()>>(test: impl FnOnce(MySqlPool) -> F) {
    let Some(shared) = Shared::mysql().await else {
        return;
    };
    let Shared::MySql { url, .. } = &shared else {
        unreachable!()
    };
    let url = url.clone();
    shared
        .run(|_| async move {
            let pool = sqlx::mysql::MySqlPoolOptions::new()
                .max_connections(16)
                .connect(&url)
                .await
                .expect("connect to the test database");
            test(pool).await;
        })
        .await;
}

/// Enqueues `n` events, each in its own transaction, committed or not.
async fn enqueue(
    pool: &MySqlPool,
    outbox: &MySqlOutbox,
    n: usize,
    commit: bool,
) -> HashSet<String> {
    let mut ids = HashSet::new();
    for _ in 0..n {
        let event = NewEvent::new(TOPIC, r#"{"payment_id": "p"}"#);
        let mut tx = pool.begin().await.unwrap();
        outbox.enqueue(&mut tx, &event).await.unwrap();
        if commit {
            tx.commit().await.unwrap();
        } else {
            tx.rollback().await.unwrap();
        }
        ids.insert(event.id);
    }
    ids
}

#[tokio::test]
async fn racing_relays_publish_every_committed_row_once_and_no_rolled_back_row() {
    let Some(broker) = TestBroker::amqp() else {
        return;
    };
    let cleanup = broker.clone();
    with_mysql(|pool| async move {
        let outbox = MySqlOutbox::new(pool.clone());
        outbox.migrate().await.unwrap();
        let committed = enqueue(&pool, &outbox, 120, true).await;
        enqueue(&pool, &outbox, 10, false).await;
        // Small batches, so the relays really interleave.
        let per_relay = race_relays(&outbox, &broker, 3, 5).await;
        assert_eq!(
            per_relay.iter().sum::<usize>(),
            committed.len(),
            "{per_relay:?}"
        );
        assert!(
            per_relay.iter().filter(|&&n| n > 0).count() > 1,
            "nothing raced: {per_relay:?}"
        );
        assert_eq!(outbox.unsent().await.unwrap(), 0);
        let counts = tally(&broker.drain_ids(Duration::from_millis(1500)).await);
        assert_eq!(counts.keys().cloned().collect::<HashSet<_>>(), committed);
        assert!(
            counts.values().all(|&n| n == 1),
            "published twice: {counts:?}"
        );
        assert_eq!(
            Relay::new(outbox.clone(), broker.publisher().await)
                .drain()
                .await
                .unwrap(),
            0
        );
        assert_eq!(
            outbox.purge_sent(Duration::ZERO, 100).await.unwrap(),
            100,
            "one bounded batch"
        );
    })
    .await;
    cleanup.clean_up().await;
}

/// The receipt of message `id`, written in the claim's transaction.
fn write_receipt<'a>(
    conn: &'a mut MySqlConnection,
    id: &'a str,
) -> Pin<Box<dyn Future<Output = ()> + Send + 'a>> {
    Box::pin(async move {
        sqlx::query("INSERT INTO receipts VALUES (?)")
            .bind(id)
            .execute(conn)
            .await
            .expect("insert receipt");
    })
}

#[tokio::test]
async fn overlapping_copies_of_one_message_commit_one_effect() {
    with_mysql(|pool| async move {
        let inbox = MySqlInbox::new(pool.clone());
        inbox.migrate().await.unwrap();
        sqlx::query("CREATE TABLE receipts (payment_id VARCHAR(64) NOT NULL)")
            .execute(&pool)
            .await
            .unwrap();
        // The winner holds its transaction longer than the claim's lock wait: the other
        // copies see "busy".
        let outcomes =
            race_copies(&inbox, "m1", 8, write_receipt, Duration::from_millis(1500)).await;
        assert!(
            outcomes.iter().any(|o| o.busy > 0),
            "no copy was ever busy: {outcomes:?}"
        );
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM receipts")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(rows, 1);
        // The session setting the claim changed is back to what it was.
        let mut conn = pool.acquire().await.unwrap();
        let before: u64 = sqlx::query_scalar("SELECT @@SESSION.innodb_lock_wait_timeout")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        let mut tx = sqlx::Acquire::begin(&mut *conn).await.unwrap();
        assert_eq!(
            inbox.claim(&mut tx, "other", "m1").await.unwrap(),
            InboxClaim::New
        );
        let after: u64 = sqlx::query_scalar("SELECT @@SESSION.innodb_lock_wait_timeout")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        assert_eq!(after, before);
    })
    .await;
}

// mutant: `settle` never parks -> fails with "the refused row was never parked".
#[tokio::test]
async fn a_refused_row_is_parked_after_its_attempts_and_holds_back_nothing() {
    let Some(broker) = TestBroker::amqp() else {
        return;
    };
    let cleanup = broker.clone();
    with_mysql(|pool| async move {
        let outbox = MySqlOutbox::new(pool.clone()).refusals(three_refusals());
        outbox.migrate().await.unwrap();
        a_refused_row_is_parked_and_holds_back_nothing(&(pool, outbox), &broker, 10).await;
    })
    .await;
    cleanup.clean_up().await;
}

// mutant: `migrate` without the added columns (MySQL `upgrades` keeps `ordering_key` only)
// -> fails with "Unknown column 'attempts'".
#[tokio::test]
async fn migrate_upgrades_a_table_of_the_previous_release() {
    let Some(broker) = TestBroker::amqp() else {
        return;
    };
    let cleanup = broker.clone();
    with_mysql(|pool| async move {
        sqlx::query(
            "CREATE TABLE tower_outbox (seq BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
                 id VARCHAR(64) NOT NULL UNIQUE, topic VARCHAR(255) NOT NULL,
                 payload LONGBLOB NOT NULL,
                 created_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
                 sent_at DATETIME(6) NULL, ordering_key VARCHAR(255) NULL,
                 INDEX (sent_at, seq)) ENGINE = InnoDB",
        )
        .execute(&pool)
        .await
        .unwrap();
        let outbox = MySqlOutbox::new(pool.clone()).refusals(one_refusal());
        outbox.migrate().await.unwrap();
        an_upgraded_table_parks_and_sends(&(pool, outbox), &broker).await;
    })
    .await;
    cleanup.clean_up().await;
}
