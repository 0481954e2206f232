//! The pipeline of `shared/pipeline-example.md` as running processes: two `outbox_relay`
//! processes and two `receipts` consumers, killed with SIGKILL at random moments and
//! restarted while a producer commits payment + outbox rows (through the library, standing in
//! for the payments service until it writes the outbox itself). When all is quiet: exactly
//! one receipt per committed payment, none for a rolled-back one, no unsent outbox row — on
//! RabbitMQ and on NATS JetStream with PostgreSQL, and on RabbitMQ with MariaDB.
//!
//! Needs TEST_POSTGRES_URL, TEST_MYSQL_URL, TEST_AMQP_URL, TEST_NATS_URL and the example binaries
//! (`scripts/test` builds them).

mod pipeline;
mod process;

use std::{
    collections::{HashMap, HashSet},
    time::Duration,
};

use pipeline::{with_broker, with_mysql_broker, PipelineDb, TestBroker};
use process::worker::Worker;
use tokio::time::Instant;

const PAYMENTS: usize = 60;

struct Fleet {
    env: Vec<(String, String)>,
    workers: Vec<(&'static str, Worker)>,
}

impl Fleet {
    async fn start(name: &'static str, env: &[(String, String)]) -> Worker {
        let ready = if name == "receipts" {
            "receipts: consuming"
        } else {
            "outbox_relay: relaying"
        };
        Worker::start(name, env, ready).await
    }

    /// SIGKILLs a random process and starts it again.
    async fn kill_one(&mut self) {
        let victim = rand::random_range(0..self.workers.len());
        let (name, worker) = self.workers.swap_remove(victim);
        worker.kill_9().await;
        let restarted = Self::start(name, &self.env).await;
        self.workers.push((name, restarted));
    }
}

async fn run(db: impl PipelineDb, broker: TestBroker) {
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
    let mut fleet = Fleet {
        env: env.clone(),
        workers: Vec::new(),
    };
    for name in ["outbox_relay", "outbox_relay", "receipts", "receipts"] {
        let worker = Fleet::start(name, &env).await;
        fleet.workers.push((name, worker));
    }

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
    // A few more kills after the last commit, into the consumers' work.
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(rand::random_range(50..300))).await;
        fleet.kill_one().await;
    }

    // Quiet: wait (bounded) until every committed payment has a receipt and the
    // outbox is empty, then a little longer for any late duplicate to show up.
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let receipts = db.receipts().await;
        if receipts.len() >= committed.len() && db.unsent().await == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not quiet after 90 s: {} of {} receipts, {} unsent rows",
            receipts.len(),
            committed.len(),
            db.unsent().await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;

    let receipts: HashMap<String, i64> = db.receipts().await;
    let count: i64 = receipts.values().sum();
    let distinct = receipts.len() as i64;
    assert_eq!(
        (count, distinct),
        (PAYMENTS as i64, PAYMENTS as i64),
        "{receipts:?}"
    );
    assert_eq!(
        receipts.keys().cloned().collect::<HashSet<_>>(),
        committed,
        "every committed payment has a receipt and every receipt a committed payment"
    );
    assert_eq!(db.unsent().await, 0, "unsent outbox rows");
    for (name, worker) in fleet.workers {
        let logs = worker.logs.clone();
        assert!(
            worker.terminate().await,
            "{name} did not stop cleanly:\n{}",
            logs.lines().join("\n")
        );
    }
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

#[tokio::test]
async fn killed_relays_and_consumers_leave_one_receipt_per_payment_on_mysql_and_rabbitmq() {
    if let Some(broker) = TestBroker::amqp() {
        with_mysql_broker(broker, run).await;
    }
}
