//! The message pipeline (README, "Message consumers") as running processes: two `outbox_relay`
//! processes and two `receipts` consumers, killed with SIGKILL at random moments and
//! restarted while a producer commits payment + outbox rows through the library (the
//! `payments` service itself is the producer in `payments_pipeline.rs`). When all is quiet: exactly
//! one receipt per committed payment, none for a rolled-back one, no unsent outbox row — on
//! RabbitMQ, NATS JetStream, Kafka (tansu) and SQS (moto) with PostgreSQL, and on RabbitMQ with
//! MariaDB.
//!
//! Needs TEST_POSTGRES_URL, TEST_MYSQL_URL, TEST_AMQP_URL, TEST_NATS_URL, TEST_KAFKA_URL,
//! TEST_SQS_URL and the example binaries (`scripts/test` builds them).

mod pipeline;
mod process;

use std::{collections::HashSet, time::Duration};

use pipeline::{
    assert_one_receipt_each, with_broker, with_mysql_broker, Fleet, Producer, TestBroker,
};

const PAYMENTS: usize = 60;

async fn run(db: impl Producer, broker: TestBroker) {
    let mut env = broker.env();
    env.push(("DATABASE_URL".into(), db.url().to_owned()));
    // The crash windows: events confirmed by the broker but not marked sent (a kill
    // there publishes them again), receipts written but not committed. On NATS the
    // handler outlasts the ack wait, so every message also reaches the other
    // consumer while its first copy is being handled.
    env.push(("OUTBOX_CONFIRM_DELAY_MS".into(), "300".into()));
    env.push(("RECEIPTS_DELAY_MS".into(), "800".into()));
    env.push(("RECEIPTS_CONCURRENCY".into(), "4".into()));
    env.push(("OUTBOX_POLL_MS".into(), "200".into()));
    let mut fleet = Fleet::start_all(
        &["outbox_relay", "outbox_relay", "receipts", "receipts"],
        &env,
    )
    .await;

    let producer = tokio::spawn(async move {
        let mut committed = HashSet::new();
        for i in 0..PAYMENTS + PAYMENTS / 6 {
            let commit = i % 7 != 6;
            let payment = db.pay(commit).await;
            if commit {
                committed.insert(payment);
            }
            tokio::time::sleep(Duration::from_millis(rand::random_range(0..40))).await;
        }
        (db, committed)
    });
    while !producer.is_finished() {
        tokio::time::sleep(Duration::from_millis(rand::random_range(50..400))).await;
        fleet.kill_one().await;
    }
    let (db, committed) = producer.await.unwrap();
    assert_eq!(committed.len(), PAYMENTS);
    // A few more kills after the last commit, into the consumers' work.
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(rand::random_range(50..300))).await;
        fleet.kill_one().await;
    }

    assert_one_receipt_each(&db, &committed, Duration::from_secs(90)).await;
    fleet.terminate().await;
}

#[tokio::test]
async fn killed_relays_and_consumers_leave_one_receipt_per_payment_on_rabbitmq() {
    if let Some(broker) = TestBroker::amqp() {
        with_broker(broker, run).await;
    }
}

#[tokio::test]
async fn killed_relays_and_consumers_leave_one_receipt_per_payment_on_nats() {
    if let Some(broker) = TestBroker::nats(Duration::from_millis(500)) {
        with_broker(broker, run).await;
    }
}

// A killed member's partitions move once its session (6 s here) ends; every kill of a
// consumer is a rebalance.
#[tokio::test]
async fn killed_relays_and_consumers_leave_one_receipt_per_payment_on_kafka() {
    if let Some(broker) = TestBroker::kafka() {
        with_broker(broker, run).await;
    }
}

// A killed consumer's messages come back when their 2 s visibility ends; the survivors'
// heartbeats keep theirs.
#[tokio::test]
async fn killed_relays_and_consumers_leave_one_receipt_per_payment_on_sqs() {
    if let Some(broker) = TestBroker::sqs(Duration::from_secs(2)) {
        with_broker(broker, run).await;
    }
}

#[tokio::test]
async fn killed_relays_and_consumers_leave_one_receipt_per_payment_on_mysql_and_rabbitmq() {
    if let Some(broker) = TestBroker::amqp() {
        with_mysql_broker(broker, run).await;
    }
}
