//! The pipeline fault harness (issue 32): the `payments` service (its relay inside), a
//! separate `outbox_relay` and two `receipts` consumers as real processes on PostgreSQL;
//! clients that send every key twice and retry until 201; a nemesis that SIGKILLs processes,
//! takes the broker away (a proxy of the test's own in front of RabbitMQ or SQS cuts every
//! connection; a `nats-server -js` of the test's own is SIGKILLed and restarted), takes the
//! consumers' database away (a proxy in front of PostgreSQL) and plants poison outbox rows.
//! The checker counts in the database: one receipt per payment, nothing unsent, nothing
//! dead-lettered, no process that gave up.
//!
//! One test per broker and fault kind (Kafka: kills; SQS: kills and broker cuts), `PIPELINE_FAULTS_SECS` seconds of new payments each
//! (default 8); the tests take turns. `scripts/bench.d/pipeline-faults.sh` runs every kind at
//! once, long, and prints the rows of BENCHMARKS.md ("Pipeline faults").
//!
//! Each test names the mutant it catches: a change to the library, applied by hand, run, seen
//! failing, reverted.
#![cfg(all(
    feature = "postgres",
    feature = "amqp",
    feature = "nats",
    feature = "kafka",
    feature = "sqs"
))]

mod pipeline;
mod process;

#[path = "common/nats_server.rs"]
mod nats_server;
#[path = "common/proxy.rs"]
mod proxy;

#[path = "pipeline_faults/checker.rs"]
mod checker;
#[path = "pipeline_faults/fleet.rs"]
mod fleet;
#[path = "pipeline_faults/links.rs"]
mod links;
#[path = "pipeline_faults/load.rs"]
mod load;
#[path = "pipeline_faults/nemesis.rs"]
mod nemesis;

use std::{
    sync::{atomic::AtomicBool, Arc},
    time::Duration,
};

use checker::Report;
use fleet::{Fleet, Role};
use links::{BrokerLink, DatabaseLink};
use load::{env, pay_for};
use nemesis::{Fault, Nemesis};
use pipeline::{clients::Ledger, with_empty_schema, TestBroker};
use process::shared::require_all;
use tower_idempotency::outbox::PgOutbox;

/// One run at a time: each starts four processes, and the machine has two cores.
static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// What a run does.
#[derive(Debug, Clone)]
pub struct Plan {
    pub kinds: Vec<Fault>,
    /// How long the clients start new payments.
    pub duration: Duration,
    pub broker_outage: Duration,
    pub database_outage: Duration,
}

impl Plan {
    /// `kinds`, `PIPELINE_FAULTS_SECS` (default 8) of payments, a broker outage of
    /// `PIPELINE_BROKER_OUTAGE_SECS` (default 5; the bench runs 30) and a 10 s database outage.
    pub fn new(kinds: &[Fault]) -> Self {
        let secs = |name: &str, default: u64| {
            std::env::var(name)
                .ok()
                .and_then(|secs| secs.parse().ok())
                .unwrap_or(default)
        };
        Self {
            kinds: kinds.to_vec(),
            duration: Duration::from_secs(secs("PIPELINE_FAULTS_SECS", 8)),
            broker_outage: Duration::from_secs(secs("PIPELINE_BROKER_OUTAGE_SECS", 5)),
            database_outage: Duration::from_secs(10),
        }
    }
}

/// Runs `plan` with `broker` reached through `link`, checks, prints the table row; returns
/// the report for the test to judge (`None`: skipped, no PostgreSQL).
async fn run(broker: TestBroker, link: BrokerLink, plan: Plan) -> Option<Report> {
    let _turn = TURN.lock().await;
    let link = Arc::new(link);
    let outcome = Arc::new(std::sync::Mutex::new(None));
    let kept = outcome.clone();
    with_empty_schema(broker, |shared, broker| async move {
        let ledger = Ledger::new(&shared).await;
        let database = Arc::new(DatabaseLink::new(&ledger.url).await);
        let direct = env(&broker, link.url(), &ledger.url);
        let proxied = env(&broker, link.url(), &database.url);
        let fleet = Arc::new(
            Fleet::start(
                direct.clone(),
                vec![
                    (Role::Relay, direct),
                    (Role::Receipts, proxied.clone()),
                    (Role::Receipts, proxied),
                ],
            )
            .await,
        );
        // The poison rows' table must exist before they are planted: the payments process
        // created it when it started.
        let outbox = PgOutbox::new(ledger.pool.clone());
        let stop = Arc::new(AtomicBool::new(false));
        let nemesis = tokio::spawn(
            Nemesis {
                fleet: fleet.clone(),
                broker: link.clone(),
                database,
                outbox: (ledger.pool.clone(), outbox),
                kinds: plan.kinds.clone(),
                broker_outage: plan.broker_outage,
                database_outage: plan.database_outage,
            }
            .run(stop.clone()),
        );

        let created = pay_for(&fleet, plan.duration).await;
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let faults = nemesis.await.expect("the nemesis");

        let mut report = checker::check(
            &ledger,
            &broker,
            &fleet,
            &created,
            &faults,
            Duration::from_secs(60),
        )
        .await;
        report.secs = plan.duration.as_secs();
        println!("pipeline-faults-row: {}", report.row());
        if report.failures().is_empty() {
            Arc::into_inner(fleet)
                .expect("the nemesis let go of the fleet")
                .terminate()
                .await;
        }
        *kept.lock().unwrap() = Some(report);
    })
    .await;
    let report = outcome.lock().unwrap().take();
    report
}

/// Fails with `report`'s failures, if any.
fn assert_passed(report: &Report) {
    let failures = report.failures();
    assert!(failures.is_empty(), "{failures:?}\n{report:#?}");
    assert!(report.payments > 0, "no payment was made");
}

/// A run of `kinds` on RabbitMQ behind the test's proxy (`None`: skipped).
async fn on_rabbitmq(kinds: &[Fault]) -> Option<Report> {
    let broker = TestBroker::amqp()?;
    let TestBroker::Amqp { url, .. } = &broker else {
        unreachable!()
    };
    let link = BrokerLink::proxied(url).await;
    run(broker, link, Plan::new(kinds)).await
}

/// A run of `kinds` on the machine's Kafka (`None`: skipped); no broker outage (the link
/// is direct).
async fn on_kafka(kinds: &[Fault]) -> Option<Report> {
    let broker = TestBroker::kafka()?;
    let TestBroker::Kafka { topic, .. } = &broker else {
        unreachable!()
    };
    let link = BrokerLink::Direct {
        url: topic.brokers.clone(),
    };
    run(broker, link, Plan::new(kinds)).await
}

/// A run of `kinds` on SQS behind the test's proxy (`None`: skipped). A visibility timeout
/// of 2 s: a killed consumer's messages come back soon.
async fn on_sqs(kinds: &[Fault]) -> Option<Report> {
    let broker = TestBroker::sqs(Duration::from_secs(2))?;
    let TestBroker::Sqs { url, .. } = &broker else {
        unreachable!()
    };
    let link = BrokerLink::proxied(url).await;
    run(broker, link, Plan::new(kinds)).await
}

/// A run of `kinds` on a NATS server of the test's own (`None`: skipped). An ack wait
/// shorter than a handler, so every event also reaches the other consumer while its first
/// copy is being handled.
async fn on_nats(kinds: &[Fault]) -> Option<Report> {
    let broker = TestBroker::nats(Duration::from_millis(500))?;
    let link = BrokerLink::nats(require_all())?;
    run(broker, link, Plan::new(kinds)).await
}

/// Mutant: the inbox takes a message id it has seen for a new one (src/inbox/sql_inbox.rs,
/// `claim`: `Ok(false) => Ok(InboxClaim::New)`) -> fails with "2 payments with two receipts or
/// more" (a relay killed between the broker's confirm and the commit publishes again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_kills() {
    if let Some(report) = on_rabbitmq(&[Fault::Kill]).await {
        assert_passed(&report);
    }
}

/// Same mutant as [`rabbitmq_kills`] -> fails with "32 payments with two receipts or more"
/// (here the ack wait alone delivers copies).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_kills() {
    if let Some(report) = on_nats(&[Fault::Kill]).await {
        assert_passed(&report);
    }
}

/// Same mutant as [`rabbitmq_kills`] -> fails with "6 payments with two receipts or more" (a
/// member killed with settled offsets not yet committed, and partitions that move on every
/// rebalance, hand messages out again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_kills() {
    if let Some(report) = on_kafka(&[Fault::Kill]).await {
        assert_passed(&report);
    }
}

/// Same mutant as [`rabbitmq_kills`] -> fails with "1 payments with two receipts or more" (a
/// relay killed between SQS's answer and its commit publishes again, and a standard queue has
/// no deduplication; one run, the catch depends on where the kills land).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqs_kills() {
    if let Some(report) = on_sqs(&[Fault::Kill]).await {
        assert_passed(&report);
    }
}

/// Mutant: the SQS subscriber gives up on a failed receive (src/broker/sqs.rs `next`: every
/// error returned instead of waiting and receiving again) -> fails with "processes that gave
/// up by themselves" ("receipts stopped: sqs: could not receive"), "36 payments without a
/// receipt".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqs_broker_cuts() {
    if let Some(report) = on_sqs(&[Fault::BrokerOutage]).await {
        assert_passed(&report);
    }
}

/// Mutant: no reconnect (src/broker/nats.rs `connect`:
/// `async_nats::ConnectOptions::new().max_reconnects(1)`) -> fails with "35 payments without a
/// receipt", "35 payment.created rows never sent", "2 processes that gave up by themselves"
/// ("receipts stopped: nats: closed").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_broker_restarts() {
    if let Some(report) = on_nats(&[Fault::BrokerOutage]).await {
        assert_passed(&report);
    }
}

/// Mutant: the AMQP publisher keeps its dead session (src/broker/amqp.rs: `channel()` reuses
/// the session without looking at it, and a failed batch does not drop it) -> fails with "37
/// payments without a receipt", "37 payment.created rows never sent". Before the reconnecting
/// subscriber, the consumers exited ("receipts stopped: amqp: could not receive").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_broker_cuts() {
    if let Some(report) = on_rabbitmq(&[Fault::BrokerOutage]).await {
        assert_passed(&report);
    }
}

/// Mutant: infrastructure failures counted as attempts (src/inbox/consumer.rs `decide`:
/// `Failure::Infrastructure` dead-letters once the broker's delivery count reaches
/// `max_attempts`, else gives the delivery back: the inbox before issue 32) -> fails with "16
/// payments without a receipt", "16 messages dead-lettered".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_database_outage() {
    if let Some(report) = on_rabbitmq(&[Fault::DatabaseOutage]).await {
        assert_passed(&report);
        assert!(
            report.turned_away > 0,
            "the consumers never tried the database"
        );
    }
}

/// Same mutant as [`rabbitmq_database_outage`] -> fails with "33 payments without a
/// receipt", "33 messages dead-lettered".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_database_outage() {
    if let Some(report) = on_nats(&[Fault::DatabaseOutage]).await {
        assert_passed(&report);
        assert!(
            report.turned_away > 0,
            "the consumers never tried the database"
        );
    }
}

/// Mutant: one refused row fails its whole batch (src/outbox/sql_outbox.rs `publish`: any
/// refusal answered as `OutboxError::Verdicts`) -> fails with "18 payment.created rows never
/// sent" (the broker took them, but the rows stay unsent and go out again every retry).
/// Parking off (the refusal that reaches the limit not parking) would fail the last
/// assertion; that mutant was not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_poison_rows() {
    if let Some(report) = on_rabbitmq(&[Fault::Poison]).await {
        assert_passed(&report);
        assert!(report.planted > 0, "no poison row was planted");
        assert_eq!(report.unparked(), 0, "poison rows neither sent nor parked");
    }
}

/// Same mutants as [`rabbitmq_poison_rows`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_poison_rows() {
    if let Some(report) = on_nats(&[Fault::Poison]).await {
        assert_passed(&report);
        assert_eq!(report.unparked(), 0, "poison rows neither sent nor parked");
    }
}

/// Every kind at once, for `scripts/bench.d/pipeline-faults.sh`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the long run: scripts/bench.d/pipeline-faults.sh"]
async fn rabbitmq_every_fault() {
    if let Some(report) = on_rabbitmq(&ALL).await {
        assert_passed(&report);
        assert_eq!(report.unparked(), 0, "poison rows neither sent nor parked");
    }
}

/// Every kind at once, for `scripts/bench.d/pipeline-faults.sh`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the long run: scripts/bench.d/pipeline-faults.sh"]
async fn nats_every_fault() {
    if let Some(report) = on_nats(&ALL).await {
        assert_passed(&report);
        assert_eq!(report.unparked(), 0, "poison rows neither sent nor parked");
    }
}

const ALL: [Fault; 4] = [
    Fault::Kill,
    Fault::BrokerOutage,
    Fault::DatabaseOutage,
    Fault::Poison,
];
