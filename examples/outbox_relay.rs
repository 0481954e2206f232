//! `outbox_relay`: publishes the unsent rows of the outbox table (`tower_outbox`) to the
//! broker, as a process of its own; several may run at once.
//!
//! ```text
//! DATABASE_URL=postgres://root@127.0.0.1/test AMQP_URL=amqp://guest:guest@127.0.0.1:5672/%2f \
//!     cargo run --example outbox_relay
//! DATABASE_URL=postgres://root@127.0.0.1/test NATS_URL=nats://127.0.0.1:4222 \
//!     cargo run --example outbox_relay
//! DATABASE_URL=postgres://root@127.0.0.1/test KAFKA_URL=127.0.0.1:9092 \
//!     cargo run --example outbox_relay
//! DATABASE_URL=postgres://root@127.0.0.1/test SQS_URL=http://127.0.0.1:5000 \
//!     cargo run --example outbox_relay
//! ```
//!
//! Environment: `DATABASE_URL`, one of `AMQP_URL` / `NATS_URL` / `KAFKA_URL` / `SQS_URL`
//! (their settings, and the SQS region and credentials: see `pipeline/mod.rs`),
//! `PIPELINE_NAMESPACE` (see `pipeline/mod.rs`), `OUTBOX_POLL_MS` (polling fallback, default 1000),
//! `OUTBOX_CONFIRM_DELAY_MS` (sleeps after the broker confirmed a batch and before it is
//! marked sent: the relay's crash window, where a kill makes it publish the batch again;
//! default 0), `OUTBOX_REFUSAL_ATTEMPTS` / `OUTBOX_REFUSAL_DELAY_MS` (rows the broker refuses:
//! see `pipeline/mod.rs`), `STARTUP_PATIENCE_SECS` (how long the first connections are tried
//! again, default 60). Stops after the batch in flight on SIGTERM.

mod pipeline;

use std::{process::ExitCode, time::Duration};

use async_trait::async_trait;
use pipeline::{Broker, Database};
use tower_idempotency::{
    broker::{BrokerError, OutgoingMessage, Publisher, Verdict},
    outbox::{MySqlOutbox, OutboxSource, PgOutbox, Relay, RelayConfig, SqliteOutbox},
};

/// A publisher that lingers after the broker's confirmation (`OUTBOX_CONFIRM_DELAY_MS`).
struct SlowToMark<P> {
    publisher: P,
    delay: Duration,
}

#[async_trait]
impl<P: Publisher> Publisher for SlowToMark<P> {
    async fn publish_confirmed(
        &self,
        messages: &[OutgoingMessage],
    ) -> Result<Vec<Verdict>, BrokerError> {
        let verdicts = self.publisher.publish_confirmed(messages).await?;
        tokio::time::sleep(self.delay).await;
        Ok(verdicts)
    }

    async fn close(&self) {
        self.publisher.close().await;
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    pipeline::main("outbox_relay", run()).await
}

/// What the first connection does, for the log while it is tried again.
const DATABASE: &str = "connecting to the database and creating the outbox table";

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    let broker = Broker::from_env()?;
    let config = pipeline::relay_config()?;
    let refusals = pipeline::refusal_policy()?;
    let delay = Duration::from_millis(pipeline::number("OUTBOX_CONFIRM_DELAY_MS", 0)?);
    match Database::from_env()? {
        Database::Postgres(url) => {
            let outbox = pipeline::retry_start(DATABASE, || async {
                let outbox = PgOutbox::new(sqlx::PgPool::connect(&url).await?).refusals(refusals);
                outbox.migrate().await.map(|()| outbox)
            })
            .await?;
            relay(outbox, broker, config, delay).await
        }
        Database::MySql(url) => {
            let outbox = pipeline::retry_start(DATABASE, || async {
                let outbox =
                    MySqlOutbox::new(sqlx::MySqlPool::connect(&url).await?).refusals(refusals);
                outbox.migrate().await.map(|()| outbox)
            })
            .await?;
            relay(outbox, broker, config, delay).await
        }
        Database::Sqlite(url) => {
            let outbox = pipeline::retry_start(DATABASE, || async {
                let outbox =
                    SqliteOutbox::new(pipeline::sqlite_pool(&url, 2).await?).refusals(refusals);
                outbox.migrate().await.map(|()| outbox)
            })
            .await?;
            relay(outbox, broker, config, delay).await
        }
    }
}

async fn relay<S: OutboxSource>(
    outbox: S,
    broker: Broker,
    config: RelayConfig,
    delay: Duration,
) -> Result<(), Box<dyn std::error::Error>> {
    let (publisher, destination) = broker.publisher().await?;
    tracing::info!("outbox_relay: relaying to {destination}");
    Relay::new(outbox, SlowToMark { publisher, delay })
        .config(config)
        .run_until(pipeline::shutdown_signal())
        .await;
    Ok(())
}
