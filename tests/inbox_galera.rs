//! The inbox on MariaDB Galera (issue 37): two consumers of one name, one writing through
//! node 0 and one through node 1 of a three-node cluster of the test's own
//! (`tests/failover/galera.rs`), both taking deliveries from one RabbitMQ queue that holds
//! every message twice, back to back, so the broker hands the two copies to the two consumers
//! at once and their claims race on two nodes.
//!
//! Galera certifies at commit: both claims succeed on their nodes, and the copy whose write
//! set comes second fails, with error 1213 (SQLSTATE 40001), at its `COMMIT` (a
//! certification failure) or at its next statement (a brute-force abort by the winner's write
//! set). Half the messages are handled "write, then wait" (the loss lands on the `COMMIT`),
//! half "wait, then write" (it lands on the handler's own statement). Asserted: one receipt
//! per message, nothing dead-lettered, no handler attempt spent (the failure table stays
//! empty) and no delivery given back to the broker: a lost race is claimed again and acked as
//! a duplicate. Measured and printed (`inbox-galera-row:`): the outcomes, the handler
//! statements the cluster aborted, and the nodes' certification failures and brute-force
//! aborts.
#![cfg(all(
    feature = "mysql",
    feature = "postgres",
    feature = "amqp",
    feature = "nats"
))]

mod failover;
mod pipeline;
mod process;

use std::{
    collections::BTreeMap,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use async_trait::async_trait;
use failover::galera::GaleraCluster;
use pipeline::{TestBroker, TOPIC};
use process::shared::{on_database, Shared};
use sqlx::{mysql::MySqlPoolOptions, MySql, MySqlConnection, MySqlPool};
use tower_idempotency::{
    broker::{amqp::AmqpSubscriber, OutgoingMessage, Publisher, Subscriber},
    inbox::{Consumer, ConsumerConfig, Handler, HandlerError, Message, MySqlInbox, Outcome},
};

/// Messages per run (each delivered twice): `INBOX_GALERA_MESSAGES`, default 120.
fn messages() -> usize {
    std::env::var("INBOX_GALERA_MESSAGES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(120)
}
/// Deliveries each consumer takes at once (its prefetch).
const PREFETCH: u16 = 8;
/// The handler's wait, before or after its write: long enough for the other copy's write
/// set to arrive while this copy's transaction is open.
const HANDLER_WAIT: Duration = Duration::from_millis(40);
/// No delivery for this long: the queue is drained (a delivery given back comes again
/// after the consumer's 1 s retry delay).
const QUIET: Duration = Duration::from_secs(4);

const RECEIPTS: &str = "CREATE TABLE IF NOT EXISTS receipts (
    payment_id VARCHAR(191) NOT NULL,
    node       INT          NOT NULL,
    created_at DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6)
)";

/// Writes one receipt per message; even payments "write, then wait", odd ones "wait, then
/// write". Counts its own statements that the cluster aborted (SQLSTATE 40001).
struct WriteReceipt {
    node: usize,
    aborted: Arc<AtomicUsize>,
}

#[async_trait]
impl Handler<MySql> for WriteReceipt {
    async fn handle(
        &self,
        conn: &mut MySqlConnection,
        message: &Message,
    ) -> Result<(), HandlerError> {
        let n = message.payload["n"]
            .as_u64()
            .ok_or_else(|| HandlerError::Reject("no n".into()))?;
        let write_first = n % 2 == 0;
        if !write_first {
            tokio::time::sleep(HANDLER_WAIT).await;
        }
        sqlx::query("INSERT INTO receipts (payment_id, node) VALUES (?, ?)")
            .bind(message.payload["payment_id"].as_str())
            .bind(self.node as i32)
            .execute(&mut *conn)
            .await
            .map_err(|error| {
                if let sqlx::Error::Database(db) = &error {
                    if db.code().as_deref() == Some("40001") {
                        self.aborted.fetch_add(1, Ordering::Relaxed);
                    }
                }
                HandlerError::Retry(error.into())
            })?;
        if write_first {
            tokio::time::sleep(HANDLER_WAIT).await;
        }
        Ok(())
    }
}

/// Runs `consumer` on every delivery of a fresh subscription until none came for [`QUIET`],
/// each delivery in a task of its own (the prefetch bounds them); returns the outcomes.
async fn consume(
    broker: &TestBroker,
    consumer: Consumer<MySqlInbox, WriteReceipt>,
) -> Vec<Outcome> {
    let TestBroker::Amqp { url, topology, .. } = broker else {
        unreachable!("RabbitMQ only: NATS drops a second publish of one id")
    };
    let mut subscriber = AmqpSubscriber::connect(url, topology, PREFETCH)
        .await
        .expect("subscribe");
    let outcomes = Arc::new(Mutex::new(Vec::new()));
    let mut running = tokio::task::JoinSet::new();
    while let Ok(Ok(delivery)) = tokio::time::timeout(QUIET, subscriber.next()).await {
        let (consumer, outcomes) = (consumer.clone(), outcomes.clone());
        running.spawn(async move {
            let outcome = consumer.process(&delivery).await;
            outcomes.lock().unwrap().push(outcome);
        });
    }
    running.join_all().await;
    subscriber.close().await;
    Arc::into_inner(outcomes).unwrap().into_inner().unwrap()
}

async fn pool(url: &str) -> MySqlPool {
    let pool = MySqlPoolOptions::new()
        .max_connections(u32::from(PREFETCH) + 2)
        .connect(url)
        .await
        .expect("connect to a Galera node");
    // In turn, node 0 first: node 1's `IF NOT EXISTS` is ordered after node 0's DDL.
    MySqlInbox::new(pool.clone())
        .migrate()
        .await
        .expect("migrate the inbox");
    sqlx::query(RECEIPTS)
        .execute(&pool)
        .await
        .expect("create receipts");
    pool
}

/// Mutant: the inbox takes a handler statement the database rolled back for a handler
/// failure (src/inbox/consumer.rs `attempt`: the `rolled_back_by_database` arm on the
/// handler's error disabled) -> fails with "handler attempts spent on lost races: 10" (10
/// deliveries given back to the broker, acked as duplicates on their redelivery).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_consumed_on_two_nodes_make_one_receipt_and_spend_no_attempt() {
    let Some(broker) = TestBroker::amqp() else {
        return;
    };
    let Some(cluster) = GaleraCluster::start(18600).await else {
        return;
    };
    let admin = MySqlPool::connect(&cluster.url(0))
        .await
        .expect("connect to node 0");
    let shared = Shared::mysql_on(admin, &cluster.url(0)).await;
    let urls: Vec<String> = (0..2)
        .map(|node| on_database(&cluster.url(node), &shared))
        .collect();
    let cleanup = broker.clone();
    let (cluster, broker) = (&cluster, &broker);
    shared
        .run(|_| async move {
            let pools = [pool(&urls[0]).await, pool(&urls[1]).await];
            let aborted = Arc::new(AtomicUsize::new(0));
            let consumers = pools.iter().enumerate().map(|(node, pool)| {
                Consumer::with_config(
                    "receipts",
                    MySqlInbox::new(pool.clone()),
                    WriteReceipt {
                        node,
                        aborted: aborted.clone(),
                    },
                    ConsumerConfig {
                        concurrency: usize::from(PREFETCH),
                        ..ConsumerConfig::default()
                    },
                )
            });
            let consuming: Vec<_> = consumers
                .map(|consumer| {
                    let broker = broker.clone();
                    tokio::spawn(async move { consume(&broker, consumer).await })
                })
                .collect();
            let before = cluster.conflicts().await;
            // Both subscriptions open before the first message, so the broker alternates.
            tokio::time::sleep(Duration::from_secs(1)).await;
            publish_twice(broker).await;
            let mut outcomes = Vec::new();
            for node in consuming {
                outcomes.push(pipeline::tally(&node.await.expect("a consumer")));
            }
            let after = cluster.conflicts().await;
            let (cert, bf) = (after.0 - before.0, after.1 - before.1);

            let receipts: Vec<(String, i64)> = sqlx::query_as(
                "SELECT payment_id, count(*) FROM receipts GROUP BY payment_id",
            )
            .fetch_all(&pools[0])
            .await
            .expect("count receipts");
            let doubles = receipts.iter().filter(|(_, n)| *n > 1).count();
            let spent: i64 = sqlx::query_scalar(
                "SELECT CAST(COALESCE(SUM(failures), 0) AS SIGNED) FROM tower_inbox_failures",
            )
            .fetch_one(&pools[0])
            .await
            .expect("count handler failures");
            let total = |outcome: Outcome| -> usize {
                outcomes.iter().map(|o| o.get(&outcome).copied().unwrap_or(0)).sum()
            };
            let handled: BTreeMap<usize, usize> = outcomes
                .iter()
                .enumerate()
                .map(|(node, o)| (node, o.get(&Outcome::Handled).copied().unwrap_or(0)))
                .collect();
            let aborted = aborted.load(Ordering::Relaxed);
            println!(
                "inbox-galera-row: | mariadb galera, 3 nodes, consumers on 2 | {} | {} | {doubles} | {} | {} | {} | {spent} | {aborted} | {cert} | {bf} |",
                messages(),
                receipts.len(),
                total(Outcome::Duplicate),
                total(Outcome::Retried),
                total(Outcome::DeadLettered),
            );
            let context = format!(
                "outcomes per node {outcomes:?}, handled per node {handled:?}, \
                 handler statements aborted {aborted}, certification failures {cert}, \
                 brute-force aborts {bf}"
            );
            assert_eq!(receipts.len(), messages(), "messages with a receipt: {context}");
            assert_eq!(doubles, 0, "messages with two receipts: {context}");
            assert_eq!(total(Outcome::DeadLettered), 0, "dead-lettered: {context}");
            assert_eq!(spent, 0, "handler attempts spent on lost races: {spent}: {context}");
            assert_eq!(total(Outcome::Retried), 0, "given back to the broker: {context}");
            assert_eq!(total(Outcome::Handled), messages(), "handled: {context}");
            assert!(
                handled.values().all(|&n| n > 0),
                "one node handled every message, so no copies raced: {context}"
            );
            assert!(cert + bf > 0, "no copy lost a race on the cluster: {context}");
            assert!(aborted > 0, "no handler statement was aborted: the path is untested: {context}");
        })
        .await;
    cleanup.clean_up().await;
}

/// Publishes [`messages`] messages, each twice in a row under one id, in one confirmed batch.
async fn publish_twice(broker: &TestBroker) {
    let messages: Vec<OutgoingMessage> = (0..messages())
        .flat_map(|n| {
            let id = format!("evt-{n}-{}", process::unique());
            let payload = serde_json::json!({ "n": n, "payment_id": format!("pay-{n}") });
            let message = OutgoingMessage {
                id,
                topic: TOPIC.to_owned(),
                key: None,
                payload: payload.to_string().into_bytes(),
            };
            [message.clone(), message]
        })
        .collect();
    let verdicts = broker
        .publisher()
        .await
        .publish_confirmed(&messages)
        .await
        .expect("publish");
    assert!(verdicts.iter().all(Result::is_ok), "refused: {verdicts:?}");
}
