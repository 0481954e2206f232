//! The poison-row scenario each outbox database runs: a row the broker refuses (a real
//! refusal: a RabbitMQ `mandatory` return, a NATS subject no stream covers) is tried again
//! with its own count and backoff, parked at its limit, never holds back the rows after it,
//! and comes back in line when an operator re-queues it.
#![allow(dead_code)]

use std::{collections::HashSet, time::Duration};

use async_trait::async_trait;
use sqlx::Pool;
use tokio::time::Instant;
use tower_idempotency::{
    broker::{nats::NatsPublisher, Publisher},
    outbox::{NewEvent, OutboxSource, ParkedRow, RefusalPolicy, Relay, RelayConfig, SqlOutbox},
};

use crate::pipeline::{payment_event, tally, TestBroker};

/// A topic no queue is bound to (RabbitMQ) and no stream covers (NATS).
pub const POISON_TOPIC: &str = "nowhere.bound";

/// An outbox with the pool its producers commit on.
#[async_trait]
pub trait Parking: Send + Sync {
    type Outbox: OutboxSource + Clone;
    fn outbox(&self) -> &Self::Outbox;
    /// Commits `event` in a transaction of its own.
    async fn commit(&self, event: &NewEvent);
    async fn parked(&self) -> Vec<ParkedRow>;
    async fn requeue(&self, id: &str) -> bool;
    async fn requeue_all(&self) -> u64;
}

macro_rules! parking {
    ($feature:literal, $db:ty) => {
        #[cfg(feature = $feature)]
        #[async_trait]
        impl Parking for (Pool<$db>, SqlOutbox<$db>) {
            type Outbox = SqlOutbox<$db>;
            fn outbox(&self) -> &Self::Outbox {
                &self.1
            }
            async fn commit(&self, event: &NewEvent) {
                let mut tx = self.0.begin().await.expect("begin");
                self.1.enqueue(&mut tx, event).await.expect("enqueue");
                tx.commit().await.expect("commit");
            }
            async fn parked(&self) -> Vec<ParkedRow> {
                let rows = self.1.parked(100).await.expect("list parked rows");
                let count = self.1.parked_count().await.expect("count parked rows");
                assert_eq!(count, rows.len() as u64, "parked_count and parked() agree");
                rows
            }
            async fn requeue(&self, id: &str) -> bool {
                self.1.requeue_parked(id).await.expect("requeue")
            }
            async fn requeue_all(&self) -> u64 {
                self.1.requeue_all_parked().await.expect("requeue all")
            }
        }
    };
}

parking!("postgres", sqlx::Postgres);
parking!("mysql", sqlx::MySql);
parking!("sqlite", sqlx::Sqlite);

/// The scenario's policy: three refusals, 300 ms apart.
pub fn three_refusals() -> RefusalPolicy {
    RefusalPolicy {
        max_attempts: 3,
        first_delay: Duration::from_millis(300),
        max_delay: Duration::from_millis(300),
    }
}

/// The test broker's publisher, routing [`POISON_TOPIC`] where the broker refuses it.
pub async fn refusing_publisher(broker: &TestBroker) -> Box<dyn Publisher> {
    match broker {
        // The routing key is the topic, and only the example's is bound.
        TestBroker::Amqp { .. } => broker.publisher().await,
        TestBroker::Nats {
            url,
            topology,
            subject,
            ns,
        } => {
            let (subject, nowhere) = (subject.clone(), format!("nowhere{ns}.created"));
            let publisher = NatsPublisher::connect(url, topology)
                .await
                .expect("TEST_NATS_URL is set but NATS is unreachable");
            Box::new(publisher.route(move |topic| {
                if topic == POISON_TOPIC {
                    nowhere.clone()
                } else {
                    subject.clone()
                }
            }))
        }
        // These scenarios need a route the broker refuses per message; none is set up for
        // Kafka or SQS.
        TestBroker::Kafka { .. } | TestBroker::Sqs { .. } => {
            panic!(
                "the parking tests run on RabbitMQ and NATS, not {}",
                broker.name()
            )
        }
    }
}

/// Drains `relay` until a row is parked (at most 10 s); returns the parked rows.
async fn until_parked<S: OutboxSource, P: Publisher>(
    db: &impl Parking,
    relay: &Relay<S, P>,
) -> Vec<ParkedRow> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        relay.drain().await.expect("drain");
        let parked = db.parked().await;
        if !parked.is_empty() {
            return parked;
        }
        assert!(
            Instant::now() < deadline,
            "the refused row was never parked"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One refused row, then `events` payments: every payment is sent at the first drain, the
/// refused row is parked at its third refusal with its attempts and error, a parked row is
/// never taken again, and a re-queued one is back in line with a fresh budget. `db`'s outbox
/// has the [`three_refusals`] policy.
pub async fn a_refused_row_is_parked_and_holds_back_nothing(
    db: &impl Parking,
    broker: &TestBroker,
    events: usize,
) {
    let poison = NewEvent::new(POISON_TOPIC, r#"{"payment_id": "poison"}"#);
    db.commit(&poison).await;
    let mut sent = HashSet::new();
    for _ in 0..events {
        let (_, event) = payment_event();
        db.commit(&event).await;
        sent.insert(event.id);
    }
    let outbox = db.outbox();
    let relay = Relay::new(outbox.clone(), refusing_publisher(broker).await).config(RelayConfig {
        batch: 4,
        ..RelayConfig::default()
    });
    // The refused row is the first in line and in the first batch: the rows after it go.
    assert!(relay.drain().await.expect("first drain") > events);
    assert_eq!(
        outbox.unsent().await.unwrap(),
        1,
        "only the refused row waits after the first drain"
    );

    let parked = until_parked(db, &relay).await;
    assert_eq!(parked.len(), 1, "{parked:?}");
    let row = &parked[0];
    assert_eq!((&row.id, row.topic.as_str()), (&poison.id, POISON_TOPIC));
    assert_eq!(row.attempts, 3, "parked at its third refusal: {row:?}");
    let error = row.last_error.as_deref().unwrap_or_default();
    assert!(error.contains("refused"), "last_error: {error:?}");
    assert_eq!(
        outbox.unsent().await.unwrap(),
        0,
        "a parked row is not unsent"
    );
    assert_eq!(relay.drain().await.unwrap(), 0, "a parked row is not taken");

    let counts = tally(&broker.drain_ids(Duration::from_millis(1500)).await);
    assert_eq!(counts.keys().cloned().collect::<HashSet<_>>(), sent);
    assert!(counts.values().all(|&n| n == 1), "sent twice: {counts:?}");

    // The operator's way back: re-queued, it is due at once with a full budget.
    assert!(db.requeue(&poison.id).await, "requeue the parked row");
    assert!(!db.requeue(&poison.id).await, "it is parked no longer");
    assert!(db.parked().await.is_empty());
    assert_eq!(outbox.unsent().await.unwrap(), 1);
    let parked = until_parked(db, &relay).await;
    assert_eq!(
        parked[0].attempts, 3,
        "a fresh budget of attempts: {parked:?}"
    );
    assert_eq!(db.requeue_all().await, 1);
    assert_eq!(outbox.unsent().await.unwrap(), 1);
}

/// On a table `migrate` upgraded (created by the release before parking, its new columns
/// added): one refused row among three payments is parked at its first refusal
/// (`max_attempts` 1) and the payments are sent.
pub async fn an_upgraded_table_parks_and_sends(db: &impl Parking, broker: &TestBroker) {
    let poison = NewEvent::new(POISON_TOPIC, r#"{"payment_id": "poison"}"#);
    db.commit(&poison).await;
    for _ in 0..3 {
        db.commit(&payment_event().1).await;
    }
    let relay = Relay::new(db.outbox().clone(), refusing_publisher(broker).await);
    assert_eq!(relay.drain().await.expect("drain"), 4);
    let parked = db.parked().await;
    assert_eq!(parked.len(), 1, "{parked:?}");
    assert_eq!((&parked[0].id, parked[0].attempts), (&poison.id, 1));
    assert_eq!(db.outbox().unsent().await.unwrap(), 0);
}

/// The policy that parks at the first refusal.
pub fn one_refusal() -> RefusalPolicy {
    RefusalPolicy {
        max_attempts: 1,
        ..RefusalPolicy::default()
    }
}
