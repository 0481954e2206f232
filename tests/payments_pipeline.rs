//! The `payments` service as the producer of the message pipeline:
//! with `AMQP_URL` / `NATS_URL` it writes `payment.created` to the outbox in the transaction
//! of the charge and relays it. Real processes, real HTTP, PostgreSQL, RabbitMQ and NATS
//! JetStream; the effects are counted in the database (payments, charges, outbox rows,
//! receipts), not inferred from statuses.
//!
//! Needs TEST_POSTGRES_URL, TEST_AMQP_URL and TEST_NATS_URL (skips without them unless
//! TEST_REQUIRE_ALL_BACKENDS=1).

mod pipeline;
mod process;

use std::{collections::HashSet, time::Duration};

use http::StatusCode;
use pipeline::{
    assert_one_receipt_each,
    clients::{pay_twice, Ledger},
    with_empty_schema, Fleet, PipelineDb, TestBroker,
};
use process::{example_binary, shared::Shared, unique, Charge, Launch};
use tokio::{sync::watch, task::JoinSet};

/// Idempotency keys, each sent twice.
const KEYS: usize = 40;

async fn killed_everywhere(shared: Shared, broker: TestBroker) {
    let ledger = Ledger::new(&shared).await;
    let mut env = shared.env();
    env.extend(broker.env());
    // The crash windows: the charge and its event written but not committed (payments),
    // events confirmed by the broker but not marked sent (relay), receipts written but not
    // committed (consumers).
    env.push(("IDEMPOTENCY_MODE".into(), "transactional".into()));
    env.push(("PAYMENTS_DELAY_AFTER_CHARGE_MS".into(), "100".into()));
    env.push(("OUTBOX_CONFIRM_DELAY_MS".into(), "300".into()));
    env.push(("RECEIPTS_DELAY_MS".into(), "800".into()));
    env.push(("RECEIPTS_CONCURRENCY".into(), "4".into()));
    env.push(("OUTBOX_POLL_MS".into(), "200".into()));
    let launch = Launch::new().envs(&env);

    let server = launch.clone().start().await;
    let destination = match broker {
        TestBroker::Amqp { .. } => "relayed to RabbitMQ exchange payments_t",
        TestBroker::Nats { .. } => "relayed to NATS JetStream stream PAYMENTS_t",
        TestBroker::Kafka { .. } => "relayed to Kafka topic payments_t",
        TestBroker::Sqs { .. } => "relayed to SQS queue receipts_t",
    };
    server.wait_for_log(destination).await;
    let (publish, current) = watch::channel(server.http());
    let mut server = Some(server);
    let mut fleet = Fleet::start_all(&["outbox_relay", "receipts", "receipts"], &env).await;

    let mut clients = JoinSet::new();
    for i in 0..KEYS {
        let current = current.clone();
        clients.spawn(async move {
            // Spread over the kills.
            tokio::time::sleep(Duration::from_millis(150 * i as u64)).await;
            pay_twice(current, format!("key-{}", unique()), i % 2 == 0).await
        });
    }
    let mut created = HashSet::new();
    let (mut payments_kills, mut other_kills) = (0, 0);
    while !clients.is_empty() {
        tokio::time::sleep(Duration::from_millis(rand::random_range(200..700))).await;
        // Every other kill is the payments process, whatever it is doing at that moment.
        if payments_kills <= other_kills {
            server.take().expect("running").kill_9().await;
            let restarted = launch.clone().start().await;
            publish.send_replace(restarted.http());
            server = Some(restarted);
            payments_kills += 1;
        } else {
            fleet.kill_one().await;
            other_kills += 1;
        }
        while let Some(done) = clients.try_join_next() {
            created.insert(done.expect("client"));
        }
    }
    assert_eq!(created.len(), KEYS, "one payment per key");
    eprintln!(
        "SIGKILLs during the requests: {payments_kills} payments, {other_kills} relay or consumer"
    );
    assert!(
        payments_kills >= 2,
        "the payments process was killed {payments_kills} times"
    );
    // A few more kills after the last payment, into the relays' and consumers' work.
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(rand::random_range(50..300))).await;
        fleet.kill_one().await;
    }

    assert_one_receipt_each(&ledger, &created, Duration::from_secs(45)).await;
    // What committed is exactly what the clients were told: one payment, one charge and one
    // event per key, whatever was killed in between.
    let sorted = |ids: Vec<String>| {
        let mut ids = ids;
        ids.sort();
        ids
    };
    let mut expected: Vec<String> = created.iter().cloned().collect();
    expected.sort();
    assert_eq!(sorted(ledger.payments().await), expected, "payments rows");
    assert_eq!(sorted(ledger.charges().await), expected, "charges rows");
    let events = ledger.events().await;
    let event_payments = events
        .iter()
        .map(|event| event["payment_id"].as_str().expect("payment_id").to_owned())
        .collect();
    assert_eq!(sorted(event_payments), expected, "outbox rows");

    let server = server.expect("running");
    let logs = server.logs.clone();
    assert!(
        server.terminate().await.success(),
        "payments did not stop cleanly:\n{}",
        logs.lines().join("\n")
    );
    fleet.terminate().await;
}

#[tokio::test]
async fn killed_payments_relay_and_consumers_leave_one_receipt_per_payment_on_rabbitmq() {
    if let Some(broker) = TestBroker::amqp() {
        with_empty_schema(broker, killed_everywhere).await;
    }
}

#[tokio::test]
async fn killed_payments_relay_and_consumers_leave_one_receipt_per_payment_on_nats() {
    // An ack wait shorter than the handler: every event also reaches the other consumer
    // while its first copy is being handled.
    if let Some(broker) = TestBroker::nats(Duration::from_millis(500)) {
        with_empty_schema(broker, killed_everywhere).await;
    }
}

/// Counts the charges and the outbox rows.
async fn rows(ledger: &Ledger) -> (usize, usize) {
    (ledger.charges().await.len(), ledger.events().await.len())
}

#[tokio::test]
async fn failed_invalid_and_killed_requests_enqueue_no_event() {
    let Some(shared) = Shared::postgres().await else {
        return;
    };
    shared
        .run(|shared| async move {
            let ledger = Ledger::new(&shared).await;
            // No relay: the events stay in the outbox, to be counted. The broker is never
            // contacted, so its URL needs no server.
            let launch = Launch::new()
                .envs(&shared.env())
                .env("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f")
                .env("OUTBOX_RELAY", "0");
            for mode in ["transactional", "separate"] {
                let server = launch
                    .clone()
                    .env("IDEMPOTENCY_MODE", mode)
                    .env("PAYMENTS_FAIL_FIRST", 1)
                    .start()
                    .await;
                server
                    .wait_for_log("events: outbox, relayed elsewhere")
                    .await;
                let http = server.http();
                let before = rows(&ledger).await;
                let failed = http.charge(&Charge::new(&unique(), "alice")).await;
                failed.assert_problem(StatusCode::SERVICE_UNAVAILABLE);
                let invalid =
                    Charge::new(&unique(), "alice").body(r#"{"amount": 0, "currency": "EUR"}"#);
                http.charge(&invalid)
                    .await
                    .assert_problem(StatusCode::UNPROCESSABLE_ENTITY);
                assert_eq!(
                    rows(&ledger).await,
                    before,
                    "{mode}: a 503 or a 422 wrote rows"
                );

                // The control: a payment writes its charge and exactly one event.
                let created = http
                    .charge(
                        &Charge::new(&unique(), "alice")
                            .body(r#"{"amount": 7, "currency": "USD"}"#),
                    )
                    .await;
                assert_eq!(created.status, StatusCode::CREATED, "{mode}");
                assert_eq!(rows(&ledger).await, (before.0 + 1, before.1 + 1), "{mode}");
                let event = ledger.events().await.pop().expect("the event");
                assert_eq!(event["payment_id"], created.json()["id"], "{mode}");
                assert_eq!(
                    (event["amount"].as_i64(), event["currency"].as_str()),
                    (Some(7), Some("USD"))
                );
                assert_eq!(
                    ledger.unsent().await,
                    before.1 as i64 + 1,
                    "OUTBOX_RELAY=0 relays nothing"
                );
                assert!(server.terminate().await.success());
            }

            // Killed after the charge and its event were written, before the commit.
            let server = launch
                .env("IDEMPOTENCY_MODE", "transactional")
                .env("PAYMENTS_DELAY_AFTER_CHARGE_MS", 10_000)
                .start()
                .await;
            let before = rows(&ledger).await;
            let http = server.http();
            let request =
                tokio::spawn(
                    async move { http.try_charge(&Charge::new(&unique(), "alice")).await },
                );
            server
                .wait_for_log_within("charge written", Duration::from_secs(10))
                .await;
            server.kill_9().await;
            assert!(
                request.await.expect("client").is_err(),
                "no answer from a killed process"
            );
            assert_eq!(
                rows(&ledger).await,
                before,
                "the killed transaction left rows"
            );
        })
        .await;
}

#[tokio::test]
async fn a_broker_without_a_database_is_refused_at_start() {
    for (var, url) in [
        ("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f"),
        ("NATS_URL", "nats://127.0.0.1:4222"),
    ] {
        let output = tokio::process::Command::new(example_binary("payments"))
            .env_clear()
            .env("NO_COLOR", "1")
            .env("BIND", "127.0.0.1:0")
            .env(var, url)
            .output()
            .await
            .expect("run the payments example");
        let log = String::from_utf8_lossy(&output.stdout) + String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{var} alone started: {log}");
        assert!(log.contains("need a SQL DATABASE_URL"), "{log}");
    }
}
