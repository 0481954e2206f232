//! The inbox consumer on real brokers: poison is dead-lettered (RabbitMQ dead-letter queue,
//! NATS term) and acked without a receipt or a panic, a failing handler is retried a bounded
//! number of times, two copies delivered at once write one receipt, and a handler slower than
//! the broker's lease keeps it.
//!
//! Needs TEST_POSTGRES_URL plus TEST_AMQP_URL / TEST_NATS_URL (`scripts/test` sets them).

mod pipeline;
mod process;

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use async_trait::async_trait;
use pipeline::{each_broker, tally, with_broker, TestBroker, WriteReceipt};
use sqlx::{PgConnection, Postgres};
use tokio::sync::Barrier;
use tower_idempotency::{
    broker::{amqp::AmqpSubscriber, nats::NatsSubscriber, Subscriber},
    inbox::{Consumer, ConsumerConfig, Handler, HandlerError, Message, Outcome},
    outbox::Relay,
};

const QUIET: Duration = Duration::from_millis(1500);

#[tokio::test]
async fn poison_messages_are_dead_lettered_acked_and_leave_no_receipt() {
    each_broker(Duration::from_millis(500), |db, broker| async move {
        broker
            .publish_raw(Some("not-json"), b"{ this is not json")
            .await;
        broker.publish_raw(None, br#"{"payment_id": "p1"}"#).await;
        broker
            .publish_raw(Some("no-payment"), br#"{"amount": 1}"#)
            .await;
        let consumer = Consumer::new(
            "receipts",
            db.inbox.clone(),
            WriteReceipt {
                delay: Duration::ZERO,
            },
        );
        let outcomes = broker.consume(&consumer, QUIET).await;
        assert_eq!(
            outcomes,
            [Outcome::DeadLettered; 3],
            "each poison message once"
        );
        assert!(db.receipts().await.is_empty(), "no receipt");
        // Past NATS' ack wait: nothing comes back.
        let again = broker.consume(&consumer, QUIET).await;
        assert!(
            again.is_empty(),
            "redelivered after dead-lettering: {again:?}"
        );
        let leftovers = broker.leftovers().await;
        match broker {
            TestBroker::Amqp { .. } | TestBroker::Kafka { .. } | TestBroker::Sqs { .. } => {
                assert_eq!(leftovers, 3, "messages in the dead-letter queue")
            }
            TestBroker::Nats { .. } => assert_eq!(leftovers, 0, "messages still pending"),
        }
    })
    .await;
}

/// Fails every time, counting its runs.
struct AlwaysFails(Arc<AtomicUsize>);

#[async_trait]
impl Handler<Postgres> for AlwaysFails {
    async fn handle(&self, _: &mut PgConnection, _: &Message) -> Result<(), HandlerError> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Err(HandlerError::Retry("the ledger is down".into()))
    }
}

#[tokio::test]
async fn a_failing_handler_is_retried_a_bounded_number_of_times_then_dead_lettered() {
    each_broker(Duration::from_secs(30), |db, broker| async move {
        db.pay(true).await;
        Relay::new(db.outbox.clone(), broker.publisher().await)
            .drain()
            .await
            .unwrap();
        let runs = Arc::new(AtomicUsize::new(0));
        let config = ConsumerConfig {
            max_attempts: 3,
            retry_delay: Duration::from_millis(50),
            ..ConsumerConfig::default()
        };
        let consumer = Consumer::with_config(
            "receipts",
            db.inbox.clone(),
            AlwaysFails(runs.clone()),
            config,
        );
        let outcomes = broker.consume(&consumer, QUIET).await;
        assert_eq!(
            outcomes,
            [Outcome::Retried, Outcome::Retried, Outcome::DeadLettered]
        );
        assert_eq!(runs.load(Ordering::SeqCst), 3, "handler runs");
        let inbox_rows: i64 = sqlx::query_scalar("SELECT count(*) FROM tower_inbox")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert_eq!(inbox_rows, 0, "a failed attempt leaves no claim behind");
    })
    .await;
}

/// Writes a receipt slowly, counting its runs.
struct SlowReceipt {
    runs: Arc<AtomicUsize>,
    inner: WriteReceipt,
}

#[async_trait]
impl Handler<Postgres> for SlowReceipt {
    async fn handle(&self, conn: &mut PgConnection, message: &Message) -> Result<(), HandlerError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        self.inner.handle(conn, message).await
    }
}

#[tokio::test]
async fn two_consumers_given_the_same_message_at_once_write_one_receipt() {
    // Two copies of one message (a publisher that published it twice), one to each consumer,
    // while the first copy's handler still sleeps inside its transaction.
    let Some(broker) = TestBroker::amqp() else {
        return;
    };
    with_broker(broker, |db, broker| async move {
        let payment = format!("pay_{}", process::unique());
        let body = format!(r#"{{"payment_id": "{payment}"}}"#);
        for _ in 0..2 {
            broker.publish_raw(Some(&payment), body.as_bytes()).await;
        }
        let TestBroker::Amqp { url, topology, .. } = &broker else {
            unreachable!()
        };
        let runs = Arc::new(AtomicUsize::new(0));
        let handler = SlowReceipt {
            runs: runs.clone(),
            inner: WriteReceipt {
                delay: Duration::from_millis(1500),
            },
        };
        let consumer = Consumer::new("receipts", db.inbox.clone(), handler);
        let barrier = Arc::new(Barrier::new(2));
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..2 {
            let (consumer, barrier) = (consumer.clone(), barrier.clone());
            let mut subscriber = AmqpSubscriber::connect(url, topology, 1).await.unwrap();
            tasks.spawn(async move {
                barrier.wait().await;
                let mut outcomes = Vec::new();
                if let Ok(Ok(delivery)) =
                    tokio::time::timeout(Duration::from_secs(5), subscriber.next()).await
                {
                    outcomes.push(consumer.process(&delivery).await);
                }
                outcomes
            });
        }
        let outcomes: Vec<Outcome> = tasks.join_all().await.into_iter().flatten().collect();
        let counts = tally(&outcomes);
        assert_eq!(counts.get(&Outcome::Handled), Some(&1), "{outcomes:?}");
        assert_eq!(
            counts.get(&Outcome::Duplicate),
            Some(&1),
            "both consumers got the message: {outcomes:?}"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran once");
        assert_eq!(db.receipts().await.get(&payment), Some(&1));
        assert_eq!(db.receipts().await.len(), 1);
    })
    .await;
}

/// Locks two rows in the order the message gives, waiting at a barrier between the two on
/// its first run of each message, so that two messages taken in opposite orders deadlock.
struct LocksInOrder {
    runs: Arc<AtomicUsize>,
    barrier: Arc<Barrier>,
}

#[async_trait]
impl Handler<Postgres> for LocksInOrder {
    async fn handle(&self, conn: &mut PgConnection, message: &Message) -> Result<(), HandlerError> {
        let first_runs = self.runs.fetch_add(1, Ordering::SeqCst) < 2;
        for (i, row) in ["first", "second"].into_iter().enumerate() {
            if i == 1 && first_runs {
                self.barrier.wait().await;
            }
            sqlx::query("UPDATE locks SET n = n + 1 WHERE id = $1")
                .bind(message.payload[row].as_i64())
                .execute(&mut *conn)
                .await
                .map_err(|e| HandlerError::Retry(e.into()))?;
        }
        Ok(())
    }
}

/// Mutant: the inbox takes a transaction the database rolled back for a handler failure
/// (src/inbox/consumer.rs `attempt`: the `rolled_back_by_database` arm disabled) -> fails
/// with "the deadlock's victim was claimed again: [Handled, Retried]".
#[tokio::test]
async fn a_deadlocks_victim_is_claimed_again_without_spending_an_attempt() {
    // Two messages, one to each consumer, whose handlers lock two rows in opposite orders:
    // PostgreSQL rolls one transaction back (40P01), claim and all.
    let Some(broker) = TestBroker::amqp() else {
        return;
    };
    with_broker(broker, |db, broker| async move {
        sqlx::query("CREATE TABLE locks (id INT PRIMARY KEY, n INT NOT NULL)")
            .execute(&db.pool)
            .await
            .unwrap();
        sqlx::query("INSERT INTO locks VALUES (1, 0), (2, 0)")
            .execute(&db.pool)
            .await
            .unwrap();
        for (id, first, second) in [("a", 1, 2), ("b", 2, 1)] {
            let body = format!(r#"{{"first": {first}, "second": {second}}}"#);
            broker
                .publish_raw(
                    Some(&format!("{id}-{}", process::unique())),
                    body.as_bytes(),
                )
                .await;
        }
        let TestBroker::Amqp { url, topology, .. } = &broker else {
            unreachable!()
        };
        let runs = Arc::new(AtomicUsize::new(0));
        let handler = LocksInOrder {
            runs: runs.clone(),
            barrier: Arc::new(Barrier::new(2)),
        };
        let consumer = Consumer::new("receipts", db.inbox.clone(), handler);
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..2 {
            let consumer = consumer.clone();
            let mut subscriber = AmqpSubscriber::connect(url, topology, 1).await.unwrap();
            tasks.spawn(async move {
                let delivery = tokio::time::timeout(Duration::from_secs(10), subscriber.next())
                    .await
                    .expect("a delivery")
                    .unwrap();
                consumer.process(&delivery).await
            });
        }
        let mut outcomes: Vec<Outcome> = tasks.join_all().await;
        outcomes.sort_by_key(|outcome| format!("{outcome:?}"));
        assert_eq!(
            outcomes,
            [Outcome::Handled, Outcome::Handled],
            "the deadlock's victim was claimed again: {outcomes:?}"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 3, "the victim ran again");
        let spent: i64 = sqlx::query_scalar("SELECT count(*) FROM tower_inbox_failures")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert_eq!(spent, 0, "an attempt was spent on the deadlock");
        let n: i64 = sqlx::query_scalar("SELECT sum(n) FROM locks")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert_eq!(n, 4, "each message's two updates, once");
    })
    .await;
}

// mutant: `kept_alive` runs the work without keep-alives -> NATS hands the message to the
// second consumer after the 300 ms ack wait: fails with "a second copy was handed out while
// the first was held".
#[tokio::test]
async fn a_handler_slower_than_the_ack_wait_keeps_its_lease() {
    // The ack wait is 300 ms, the handler takes 1.5 s: the consumer extends the lease (NATS
    // `+WPI`) while it works, so no second consumer is handed the message.
    let Some(broker) = TestBroker::nats(Duration::from_millis(300)) else {
        return;
    };
    with_broker(broker, |db, broker| async move {
        let (payment, _) = db.pay(true).await;
        Relay::new(db.outbox.clone(), broker.publisher().await)
            .drain()
            .await
            .unwrap();
        let TestBroker::Nats { url, topology, .. } = &broker else {
            unreachable!()
        };
        let runs = Arc::new(AtomicUsize::new(0));
        let handler = SlowReceipt {
            runs: runs.clone(),
            inner: WriteReceipt {
                delay: Duration::from_millis(1500),
            },
        };
        let consumer = Consumer::new("receipts", db.inbox.clone(), handler);
        let mut first = NatsSubscriber::connect(url, topology, 1).await.unwrap();
        let mut second = NatsSubscriber::connect(url, topology, 1).await.unwrap();
        let delivery = first.next().await.unwrap();
        let (outcome, other) = tokio::join!(
            consumer.process(&delivery),
            tokio::time::timeout(Duration::from_secs(3), second.next())
        );
        assert_eq!(outcome, Outcome::Handled);
        assert!(
            other.is_err(),
            "a second copy was handed out while the first was held"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran once");
        assert_eq!(db.receipts().await.get(&payment), Some(&1));
    })
    .await;
}
