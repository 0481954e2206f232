//! SQS (moto at `TEST_SQS_URL`) between the outbox relay and the inbox, effects counted in
//! PostgreSQL: one receipt per committed payment on standard and FIFO queues, poison in the
//! dead-letter queue, and a consumer SIGKILLed inside its transaction loses nothing.
//!
//! Needs TEST_POSTGRES_URL and TEST_SQS_URL (`scripts/test` sets them).

mod pipeline;
mod process;

use std::{
    collections::HashSet,
    future::Future,
    sync::{Arc, Mutex},
    time::Duration,
};

use async_trait::async_trait;
use pipeline::brokers::{
    child::{self, ChildProcess},
    sqs::{client, TestQueues},
};
use pipeline::{tally, Db, WriteReceipt};
use process::shared::Shared;
use sqlx::{PgConnection, Postgres};
use tokio::{sync::Barrier, time::Instant};
use tower_idempotency::{
    broker::{
        sqs::{SqsPublisher, SqsQueues, SqsSubscriber},
        OutgoingMessage, Publisher, Subscriber,
    },
    inbox::{Consumer, ConsumerConfig, Handler, HandlerError, Message, Outcome, PgInbox},
    outbox::Relay,
};

/// No delivery for this long: the queue is drained.
const QUIET: Duration = Duration::from_secs(3);

/// Runs `test` on a fresh schema and a fresh queue pair; drops both afterwards.
async fn with_queues<F, Fut>(fifo: bool, visibility: Duration, test: F)
where
    F: FnOnce(Db, TestQueues) -> Fut,
    Fut: Future<Output = ()>,
{
    let Some(queues) = TestQueues::new(fifo, visibility).await else {
        return;
    };
    let Some(shared) = Shared::postgres().await else {
        return;
    };
    let cleanup = queues.clone();
    shared
        .run(|shared| async {
            test(Db::new(shared).await, queues).await;
        })
        .await;
    cleanup.clean_up().await;
}

/// `subscribers` subscribers at once, each handling its deliveries one by one through
/// `consumer` until none came for [`QUIET`]; every outcome.
async fn consume<H: Handler<Postgres>>(
    queues: &TestQueues,
    consumer: &Consumer<PgInbox, H>,
    subscribers: usize,
) -> Vec<Outcome> {
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..subscribers {
        let mut subscriber = SqsSubscriber::connect(queues.client.clone(), &queues.queues)
            .await
            .expect("subscribe")
            .wait(Duration::from_secs(1));
        let consumer = consumer.clone();
        tasks.spawn(async move {
            let mut outcomes = Vec::new();
            while let Ok(Ok(delivery)) = tokio::time::timeout(QUIET, subscriber.next()).await {
                outcomes.push(consumer.process(&delivery).await);
            }
            outcomes
        });
    }
    tasks.join_all().await.into_iter().flatten().collect()
}

/// What the relay published, as it published it: every outbox row.
async fn outbox_messages(db: &Db) -> Vec<OutgoingMessage> {
    let rows: Vec<(String, String, Vec<u8>, Option<String>)> =
        sqlx::query_as("SELECT id, topic, payload, ordering_key FROM tower_outbox ORDER BY seq")
            .fetch_all(&db.pool)
            .await
            .expect("read the outbox");
    rows.into_iter()
        .map(|(id, topic, payload, key)| OutgoingMessage {
            id,
            topic,
            key,
            payload,
        })
        .collect()
}

/// Commits `n` payments with their events (and one rolled back), relays them to SQS;
/// returns the committed payment ids.
async fn pay_and_relay(db: &Db, queues: &TestQueues, n: usize) -> HashSet<String> {
    let mut committed = HashSet::new();
    for _ in 0..n {
        committed.insert(db.pay(true).await.0);
    }
    db.pay(false).await;
    let publisher = SqsPublisher::new(queues.client.clone(), &queues.queues.queue_url);
    let sent = Relay::new(db.outbox.clone(), publisher)
        .drain()
        .await
        .expect("relay");
    assert_eq!(sent, n, "rows relayed");
    assert_eq!(db.unsent().await, 0);
    committed
}

#[tokio::test]
async fn every_payment_gets_one_receipt_through_standard_and_fifo_queues() {
    for fifo in [false, true] {
        with_queues(fifo, Duration::from_secs(30), |db, queues| async move {
            eprintln!("fifo: {fifo}");
            let committed = pay_and_relay(&db, &queues, 12).await;
            // A relay that died between SQS's answer and its commit publishes the batch again.
            let again = SqsPublisher::new(queues.client.clone(), &queues.queues.queue_url)
                .publish_confirmed(&outbox_messages(&db).await)
                .await
                .expect("publish again");
            assert!(again.iter().all(Result::is_ok), "{again:?}");
            // Poison: a message without an id.
            let mut poison = queues
                .client
                .send_message()
                .queue_url(&queues.queues.queue_url)
                .message_body("{\"payment_id\": \"p1\"}");
            if fifo {
                poison = poison
                    .message_group_id("poison")
                    .message_deduplication_id("poison");
            }
            poison.send().await.expect("send poison");

            let consumer = Consumer::new(
                "receipts",
                db.inbox.clone(),
                WriteReceipt {
                    delay: Duration::from_millis(20),
                },
            );
            let outcomes = tally(&consume(&queues, &consumer, 2).await);
            assert_eq!(outcomes.get(&Outcome::Handled), Some(&12), "{outcomes:?}");
            // FIFO deduplication drops the re-published copies; a standard queue delivers
            // them and the inbox finds each a duplicate.
            let duplicates = if fifo { None } else { Some(&12) };
            assert_eq!(
                outcomes.get(&Outcome::Duplicate),
                duplicates,
                "{outcomes:?}"
            );
            assert_eq!(
                outcomes.get(&Outcome::DeadLettered),
                Some(&1),
                "{outcomes:?}"
            );

            let receipts = db.receipts().await;
            assert_eq!(receipts.keys().cloned().collect::<HashSet<_>>(), committed);
            assert!(receipts.values().all(|&n| n == 1), "{receipts:?}");
            assert_eq!(
                queues.count(&queues.queues.queue_url).await,
                0,
                "left in the queue"
            );
            assert_eq!(
                queues.count(&queues.queues.dead_letter_url).await,
                1,
                "dead letters"
            );
        })
        .await;
    }
}

#[tokio::test]
async fn a_message_that_is_not_text_is_refused_and_its_neighbours_are_sent() {
    let Some(queues) = TestQueues::new(false, Duration::from_secs(30)).await else {
        return;
    };
    let message = |id: &str, payload: &[u8]| OutgoingMessage {
        id: id.into(),
        topic: "payment.created".into(),
        key: None,
        payload: payload.to_vec(),
    };
    let verdicts = SqsPublisher::new(queues.client.clone(), &queues.queues.queue_url)
        .publish_confirmed(&[
            message("a", b"{}"),
            message("b", &[0xff, 0xfe]),
            message("c", b"{}"),
        ])
        .await
        .expect("publish");
    assert!(verdicts[0].is_ok() && verdicts[2].is_ok(), "{verdicts:?}");
    assert!(verdicts[1].is_err(), "{verdicts:?}");
    assert_eq!(queues.count(&queues.queues.queue_url).await, 2);
    queues.clean_up().await;
}

/// The child's handler: says which message it is handling (the parent SIGKILLs on that
/// line), writes the receipt, and holds its transaction open for a while.
struct SayingReceipt(WriteReceipt);

#[async_trait]
impl Handler<Postgres> for SayingReceipt {
    async fn handle(&self, conn: &mut PgConnection, message: &Message) -> Result<(), HandlerError> {
        child::say(&format!("handling {}", message.id));
        self.0.handle(conn, message).await
    }
}

// mutant: SqsSubscriber::receive deletes each message as it receives it (an at-most-once
// receive, the delete before the inbox commit) -> fails: the killed consumer's batch is gone,
// 3 of 8 payments have a receipt.
#[tokio::test]
async fn a_consumer_killed_inside_its_transaction_loses_no_message() {
    with_queues(false, Duration::from_secs(2), |db, queues| async move {
        let committed = pay_and_relay(&db, &queues, 8).await;
        let env = [
            (child::ROLE, "sqs-consumer".to_owned()),
            ("CHILD_DATABASE_URL", db.url.clone()),
            ("CHILD_SQS_URL", queues.url.clone()),
            ("CHILD_QUEUE_URL", queues.queues.queue_url.clone()),
            (
                "CHILD_DEAD_LETTER_URL",
                queues.queues.dead_letter_url.clone(),
            ),
        ];
        let mut consumer = ChildProcess::start("sqs_consumer_process", &env);
        // The third message is inside its transaction, the rest of the batch received.
        consumer
            .wait_for("handling ", 3, Duration::from_secs(20))
            .await;
        consumer.kill_9().await;

        let survivor = Consumer::new(
            "receipts",
            db.inbox.clone(),
            WriteReceipt {
                delay: Duration::ZERO,
            },
        );
        let outcomes = tally(&consume(&queues, &survivor, 1).await);
        let receipts = db.receipts().await;
        assert_eq!(
            receipts.keys().cloned().collect::<HashSet<_>>(),
            committed,
            "every committed payment has a receipt ({outcomes:?})"
        );
        assert!(receipts.values().all(|&n| n == 1), "{receipts:?}");
        assert_eq!(queues.count(&queues.queues.queue_url).await, 0);
        assert_eq!(queues.count(&queues.queues.dead_letter_url).await, 0);
    })
    .await;
}

/// The consumer process of `a_consumer_killed_inside_its_transaction_loses_no_message`: one
/// delivery at a time, 400 ms inside each transaction, until it is killed.
#[tokio::test]
#[ignore = "a consumer process that a_consumer_killed_inside_its_transaction_loses_no_message starts"]
async fn sqs_consumer_process() {
    if std::env::var(child::ROLE).is_err() {
        eprintln!("started by a_consumer_killed_inside_its_transaction_loses_no_message only");
        return;
    }
    let var = |name: &str| std::env::var(name).expect(name);
    let pool = sqlx::PgPool::connect(&var("CHILD_DATABASE_URL"))
        .await
        .expect("connect");
    let queues = SqsQueues {
        queue_url: var("CHILD_QUEUE_URL"),
        dead_letter_url: var("CHILD_DEAD_LETTER_URL"),
    };
    let subscriber = SqsSubscriber::connect(client(&var("CHILD_SQS_URL")), &queues)
        .await
        .expect("subscribe")
        .wait(Duration::from_secs(1));
    let handler = SayingReceipt(WriteReceipt {
        delay: Duration::from_millis(400),
    });
    let config = ConsumerConfig {
        concurrency: 1,
        ..ConsumerConfig::default()
    };
    Consumer::with_config("receipts", PgInbox::new(pool), handler, config)
        .run_until(subscriber, std::future::pending())
        .await
        .expect("consume");
}

/// Writes the receipt and holds the transaction `hold`, recording when each run started and
/// ended.
struct TimedReceipt {
    hold: Duration,
    runs: Arc<Mutex<Vec<(Instant, Instant)>>>,
}

#[async_trait]
impl Handler<Postgres> for TimedReceipt {
    async fn handle(&self, conn: &mut PgConnection, message: &Message) -> Result<(), HandlerError> {
        let start = Instant::now();
        WriteReceipt { delay: self.hold }
            .handle(conn, message)
            .await?;
        self.runs.lock().unwrap().push((start, Instant::now()));
        Ok(())
    }
}

/// One message, a handler slower than the visibility timeout, two consumers: how many
/// deliveries arrived while the handler worked, with the outcomes and the receipts.
async fn slow_handler_on_two_consumers(heartbeat: bool) {
    let visibility = Duration::from_secs(1);
    with_queues(false, visibility, |db, queues| async move {
        let committed = pay_and_relay(&db, &queues, 1).await;
        let runs = Arc::new(Mutex::new(Vec::new()));
        let handler = TimedReceipt {
            hold: Duration::from_secs(4),
            runs: runs.clone(),
        };
        let consumer = Consumer::new("receipts", db.inbox.clone(), handler);
        let barrier = Arc::new(Barrier::new(2));
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..2 {
            let mut subscriber = SqsSubscriber::connect(queues.client.clone(), &queues.queues)
                .await
                .expect("subscribe")
                .wait(Duration::from_secs(1))
                .heartbeat(heartbeat);
            let (consumer, barrier) = (consumer.clone(), barrier.clone());
            tasks.spawn(async move {
                barrier.wait().await;
                // Each handles its deliveries one at a time: a copy that reaches the other
                // consumer overlaps the first, and one that comes back to the same consumer
                // waits for it.
                let mut seen = Vec::new();
                while let Ok(Ok(delivery)) =
                    tokio::time::timeout(Duration::from_secs(6), subscriber.next()).await
                {
                    let received = Instant::now();
                    seen.push((received, consumer.process(&delivery).await));
                }
                seen
            });
        }
        let seen: Vec<(Instant, Outcome)> = tasks.join_all().await.into_iter().flatten().collect();
        let runs = runs.lock().unwrap().clone();
        assert_eq!(runs.len(), 1, "the handler committed once: {seen:?}");
        let (start, end) = runs[0];
        let overlapping = seen
            .iter()
            .filter(|(received, _)| *received > start && *received < end)
            .count();
        let outcomes = tally(&seen.iter().map(|(_, o)| *o).collect::<Vec<_>>());
        eprintln!(
            "heartbeat {heartbeat}: {} deliveries, {overlapping} while the handler worked: {outcomes:?}",
            seen.len()
        );
        if heartbeat {
            assert_eq!(overlapping, 0, "a second delivery despite the heartbeat");
            assert_eq!(seen.len(), 1, "deliveries: {outcomes:?}");
        } else {
            assert!(overlapping >= 1, "no second delivery while the handler worked");
            assert_eq!(outcomes.get(&Outcome::Handled), Some(&1), "{outcomes:?}");
        }
        assert_one_receipt(&db, &committed).await;
        assert_eq!(queues.count(&queues.queues.queue_url).await, 0);
    })
    .await;
}

async fn assert_one_receipt(db: &Db, committed: &HashSet<String>) {
    let receipts = db.receipts().await;
    assert_eq!(&receipts.keys().cloned().collect::<HashSet<_>>(), committed);
    assert!(receipts.values().all(|&n| n == 1), "{receipts:?}");
}

// mutant: the inbox claim always answers New (no inbox) -> fails: the handler committed twice
// (two receipts for the payment).
#[tokio::test]
async fn without_heartbeat_a_slow_handler_s_message_reaches_the_second_consumer_and_runs_once() {
    slow_handler_on_two_consumers(false).await;
}

// mutant: SqsDelivery::keep_alive extends nothing -> fails: a second delivery while the
// handler works.
#[tokio::test]
async fn with_heartbeat_a_slow_handler_s_message_is_delivered_once() {
    slow_handler_on_two_consumers(true).await;
}
