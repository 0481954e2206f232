//! What every pipeline run gives its processes and asks of them: the examples' environment,
//! and the clients that pay through whichever `payments` process is up.

use std::{collections::HashSet, time::Duration};

use tokio::task::JoinSet;

use crate::{
    fleet::Fleet,
    pipeline::{clients::pay_twice, TestBroker},
    process::unique,
};

/// The examples' environment, all processes alike: the crash windows of
/// `payments_pipeline.rs` (a charge written and not committed, events confirmed and not
/// marked sent, a receipt written and not committed), and the refusal policy short enough
/// for a poison row to be parked within a run.
pub fn env(broker: &TestBroker, broker_url: &str, database_url: &str) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = broker
        .env()
        .into_iter()
        .map(|(var, value)| match var.as_str() {
            "AMQP_URL" | "NATS_URL" | "KAFKA_URL" | "SQS_URL" => (var, broker_url.to_owned()),
            _ => (var, value),
        })
        .collect();
    for (var, value) in [
        ("DATABASE_URL", database_url),
        ("IDEMPOTENCY_MODE", "transactional"),
        ("PAYMENTS_DELAY_AFTER_CHARGE_MS", "100"),
        ("OUTBOX_CONFIRM_DELAY_MS", "500"),
        ("OUTBOX_POLL_MS", "200"),
        ("OUTBOX_REFUSAL_ATTEMPTS", "3"),
        ("OUTBOX_REFUSAL_DELAY_MS", "200"),
        ("RECEIPTS_DELAY_MS", "800"),
        ("RECEIPTS_CONCURRENCY", "4"),
    ] {
        env.push((var.into(), value.into()));
    }
    env
}

/// One new key every 200 ms for `duration`, each sent twice (at once or one after the
/// other) and retried until 201; returns the payment ids the clients were told about.
pub async fn pay_for(fleet: &Fleet, duration: Duration) -> HashSet<String> {
    let keys = duration.as_millis() / 200;
    let mut clients = JoinSet::new();
    for i in 0..keys {
        let current = fleet.payments();
        clients.spawn(async move {
            tokio::time::sleep(Duration::from_millis(200 * i as u64)).await;
            pay_twice(current, format!("key-{}", unique()), i % 2 == 0).await
        });
    }
    let created: HashSet<String> = clients.join_all().await.into_iter().collect();
    assert_eq!(created.len() as u128, keys, "one payment per key");
    created
}
