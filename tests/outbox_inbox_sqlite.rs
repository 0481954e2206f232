//! The outbox and the inbox on SQLite (a fresh file per test): committed rows are published
//! once and rolled-back ones never, relays take turns without repeating a row, a relay waiting
//! for the broker holds no write lock, the rows of a relay that died mid-publish come back
//! when its lease ends, a refused row is parked without holding back the rest (on a table
//! created before the parking columns existed), and the inbox keeps overlapping copies to one
//! effect. Needs TEST_AMQP_URL for the relay tests.

mod outbox_parking;
mod pipeline;
mod process;

use std::{
    collections::HashSet, future::Future, pin::Pin, str::FromStr, sync::Arc, time::Duration,
};

use async_trait::async_trait;
use outbox_parking::{a_refused_row_is_parked_and_holds_back_nothing, three_refusals};
use pipeline::{inbox_copies::race_copies, race_relays, tally, TestBroker, TOPIC};
use process::shared::Shared;
use sqlx::{sqlite::SqliteConnectOptions, SqliteConnection, SqlitePool};
use tokio::{sync::Notify, time::Instant};
use tower_idempotency::{
    broker::{BrokerError, OutgoingMessage, Publisher, Verdict},
    inbox::{InboxStore, SqliteInbox},
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

/// The receipt of message `id`, written in the claim's transaction.
fn write_receipt<'a>(
    conn: &'a mut SqliteConnection,
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
    with_sqlite(|pool| async move {
        let inbox = SqliteInbox::new(pool.clone());
        inbox.migrate().await.unwrap();
        sqlx::query("CREATE TABLE receipts (payment_id TEXT NOT NULL)")
            .execute(&pool)
            .await
            .unwrap();
        race_copies(&inbox, "m1", 4, write_receipt, Duration::from_millis(300)).await;
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

/// Commits `n` events, each in its own transaction; returns their ids.
async fn commit_events(pool: &SqlitePool, outbox: &SqliteOutbox, n: usize) -> HashSet<String> {
    let mut ids = HashSet::new();
    for _ in 0..n {
        let event = NewEvent::new(TOPIC, r#"{"payment_id": "p"}"#);
        let mut tx = pool.begin().await.unwrap();
        outbox.enqueue(&mut tx, &event).await.unwrap();
        tx.commit().await.unwrap();
        ids.insert(event.id);
    }
    ids
}

/// The real broker behind a gate: each publish says it started, then waits until the test
/// opens the gate (a broker that takes its time).
struct Gated {
    inner: Box<dyn Publisher>,
    entered: Arc<Notify>,
    gate: Arc<Notify>,
}

impl Gated {
    async fn new(broker: &TestBroker) -> Self {
        Self {
            inner: broker.publisher().await,
            entered: Arc::new(Notify::new()),
            gate: Arc::new(Notify::new()),
        }
    }
}

#[async_trait]
impl Publisher for Gated {
    async fn publish_confirmed(
        &self,
        messages: &[OutgoingMessage],
    ) -> Result<Vec<Verdict>, BrokerError> {
        self.entered.notify_one();
        self.gate.notified().await;
        self.inner.publish_confirmed(messages).await
    }
}

// mutant: `const LEASES: bool = false` for SQLite (the relay's one transaction held across the
// publish, as before) -> fails with "a producer could not commit while the relay waited for
// the broker".
#[tokio::test]
async fn a_producer_commits_while_a_relay_waits_for_the_broker() {
    let Some(broker) = TestBroker::amqp() else {
        return;
    };
    let cleanup = broker.clone();
    with_sqlite(|pool| async move {
        let outbox = SqliteOutbox::new(pool.clone());
        outbox.migrate().await.unwrap();
        let first = commit_events(&pool, &outbox, 3).await;
        let gated = Gated::new(&broker).await;
        let (entered, gate) = (gated.entered.clone(), gated.gate.clone());
        let relay = {
            let outbox = outbox.clone();
            tokio::spawn(async move { outbox.relay_batch(&gated, 10).await })
        };
        entered.notified().await;
        // The relay is inside the publish: a producer's transaction must get the write lock.
        let started = Instant::now();
        let committed =
            tokio::time::timeout(Duration::from_secs(3), commit_events(&pool, &outbox, 1)).await;
        let waited = started.elapsed();
        gate.notify_one();
        assert!(
            committed.is_ok(),
            "a producer could not commit while the relay waited for the broker"
        );
        assert!(
            waited < Duration::from_secs(1),
            "a producer waited {waited:?} for the write lock"
        );
        assert_eq!(relay.await.unwrap().unwrap(), 3);
        assert_eq!(
            outbox.unsent().await.unwrap(),
            1,
            "the producer's row is next"
        );
        let counts = tally(&broker.drain_ids(Duration::from_millis(1000)).await);
        assert_eq!(counts.keys().cloned().collect::<HashSet<_>>(), first);
    })
    .await;
    cleanup.clean_up().await;
}

// mutant: the SQLite `take` without `AND (leased_until IS NULL OR leased_until <= now)` ->
// fails with "a second relay took the rows another one leased".
#[tokio::test]
async fn rows_of_a_relay_that_died_mid_publish_are_sent_when_its_lease_ends() {
    let Some(broker) = TestBroker::amqp() else {
        return;
    };
    let cleanup = broker.clone();
    with_sqlite(|pool| async move {
        // Leases last twice the publish limit: 600 ms.
        let outbox = SqliteOutbox::new(pool.clone()).publish_timeout(Duration::from_millis(300));
        outbox.migrate().await.unwrap();
        let events = commit_events(&pool, &outbox, 4).await;
        let gated = Gated::new(&broker).await;
        let entered = gated.entered.clone();
        let dying = {
            let outbox = outbox.clone();
            tokio::spawn(async move { outbox.relay_batch(&gated, 10).await })
        };
        entered.notified().await;
        let leased = Instant::now();
        // The relay dies inside the publish: its rows stay leased, none is marked.
        dying.abort();
        let _ = dying.await;
        let publisher = broker.publisher().await;
        assert_eq!(
            outbox.relay_batch(&publisher, 10).await.unwrap(),
            0,
            "a second relay took the rows another one leased"
        );
        let deadline = leased + Duration::from_secs(5);
        loop {
            let taken = outbox.relay_batch(&publisher, 10).await.unwrap();
            if taken > 0 {
                assert_eq!(taken, 4);
                break;
            }
            assert!(Instant::now() < deadline, "the lease never ended");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            leased.elapsed() >= Duration::from_millis(400),
            "taken again after {:?}, before the lease ended",
            leased.elapsed()
        );
        assert_eq!(outbox.unsent().await.unwrap(), 0);
        let counts = tally(&broker.drain_ids(Duration::from_millis(1000)).await);
        assert_eq!(counts.keys().cloned().collect::<HashSet<_>>(), events);
        assert!(counts.values().all(|&n| n == 1), "{counts:?}");
    })
    .await;
    cleanup.clean_up().await;
}

// mutant: `settle` never parks -> fails with "the refused row was never parked".
#[tokio::test]
async fn a_refused_row_is_parked_on_an_upgraded_table_and_holds_back_nothing() {
    let Some(broker) = TestBroker::amqp() else {
        return;
    };
    let cleanup = broker.clone();
    with_sqlite(|pool| async move {
        // The table as the previous release created it: `migrate` adds the new columns.
        sqlx::query(
            "CREATE TABLE tower_outbox (seq INTEGER PRIMARY KEY AUTOINCREMENT,
                 id TEXT NOT NULL UNIQUE, topic TEXT NOT NULL, payload BLOB NOT NULL,
                 created_at INTEGER NOT NULL, sent_at INTEGER, ordering_key TEXT)",
        )
        .execute(&pool)
        .await
        .unwrap();
        let outbox = SqliteOutbox::new(pool.clone()).refusals(three_refusals());
        outbox.migrate().await.unwrap();
        a_refused_row_is_parked_and_holds_back_nothing(&(pool, outbox), &broker, 10).await;
    })
    .await;
    cleanup.clean_up().await;
}
