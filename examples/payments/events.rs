//! `payment.created` events, with one of `AMQP_URL`, `NATS_URL`, `KAFKA_URL` or `SQS_URL`
//! set: the charge's transaction writes them to the outbox table (`sql_payments.rs`), and
//! unless `OUTBOX_RELAY=0` a relay in this process publishes them to the broker. The broker names (and `PIPELINE_NAMESPACE`) are
//! those of `receipts` and `outbox_relay`: see `pipeline/mod.rs`.

use tokio::{sync::oneshot, task::JoinHandle};
use tower_idempotency::outbox::{
    MySqlOutbox, NewEvent, OutboxSource, PgOutbox, Relay, RelayConfig, SqliteOutbox,
};

use crate::{backends::Error, payments::Payment, pipeline, sql_payments::SqlPayments};

/// The event of a new payment: `{"event_id", "payment_id", "amount", "currency"}`, whose
/// `event_id` is also the broker message id that consumers deduplicate on, and whose ordering
/// key is the payment id (the Kafka record key, the SQS FIFO group).
pub fn payment_created(payment: &Payment) -> NewEvent {
    let id = NewEvent::fresh_id();
    let payload = serde_json::json!({
        "event_id": id,
        "payment_id": payment.id,
        "amount": payment.amount,
        "currency": payment.currency,
    });
    NewEvent::with_id(id, pipeline::TOPIC, payload.to_string()).with_key(&payment.id)
}

/// The relay running in this process.
pub struct RunningRelay {
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl RunningRelay {
    /// Connects to the broker and starts relaying the outbox of `database`; returns the relay
    /// and where it publishes (for the startup log).
    pub async fn start(
        database: &SqlPayments,
        broker: pipeline::Broker,
    ) -> Result<(Self, String), Error> {
        let config = pipeline::relay_config()?;
        let refusals = pipeline::refusal_policy()?;
        let (publisher, destination) = broker
            .publisher()
            .await
            .map_err(|e| format!("cannot reach the broker for the outbox relay: {e}"))?;
        let (stop, stopped) = oneshot::channel();
        let task = match database {
            SqlPayments::Postgres(pool, _) => spawn(
                PgOutbox::new(pool.clone()).refusals(refusals),
                publisher,
                config,
                stopped,
            ),
            SqlPayments::MySql(pool, _) => spawn(
                MySqlOutbox::new(pool.clone()).refusals(refusals),
                publisher,
                config,
                stopped,
            ),
            SqlPayments::Sqlite(pool, _) => spawn(
                SqliteOutbox::new(pool.clone()).refusals(refusals),
                publisher,
                config,
                stopped,
            ),
        };
        Ok((Self { stop, task }, destination))
    }

    /// Lets the batch in flight finish, then stops.
    pub async fn stop(self) {
        let _ = self.stop.send(());
        if let Err(error) = self.task.await {
            tracing::warn!("the outbox relay ended abnormally: {error}");
        }
    }
}

fn spawn(
    outbox: impl OutboxSource,
    publisher: Box<dyn tower_idempotency::broker::Publisher>,
    config: RelayConfig,
    stopped: oneshot::Receiver<()>,
) -> JoinHandle<()> {
    tokio::spawn(
        Relay::new(outbox, publisher)
            .config(config)
            .run_until(async {
                // A dropped sender (the service failed) stops the relay as well.
                let _ = stopped.await;
            }),
    )
}
