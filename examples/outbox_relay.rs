//! `outbox_relay`: publishes the unsent rows of the outbox table (`tower_outbox`) to the
//! broker, as a process of its own; several may run at once.
//!
//! ```text
//! DATABASE_URL=postgres://root@127.0.0.1/test AMQP_URL=amqp://guest:guest@127.0.0.1:5672/%2f \
//!     cargo run --example outbox_relay
//! DATABASE_URL=postgres://root@127.0.0.1/test NATS_URL=nats://127.0.0.1:4222 \
//!     cargo run --example outbox_relay
//! ```
//!
//! Environment: `DATABASE_URL`, one of `AMQP_URL` / `NATS_URL`, `PIPELINE_NAMESPACE` (see
//! `pipeline/mod.rs`), `OUTBOX_POLL_MS` (polling fallback, default 1000). Stops after the
//! batch in flight on SIGTERM.

mod pipeline;

use std::{process::ExitCode, time::Duration};

use pipeline::Broker;
use tower_idempotency::{
    broker::{amqp::AmqpPublisher, nats::NatsPublisher},
    outbox::{PgOutbox, Relay, RelayConfig},
};

#[tokio::main]
async fn main() -> ExitCode {
    pipeline::init_logs();
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!("outbox_relay stopped: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    let broker = Broker::from_env()?;
    let pool = sqlx::PgPool::connect(&pipeline::database_url()?).await?;
    let outbox = PgOutbox::new(pool);
    outbox.migrate().await?;
    let config = RelayConfig {
        poll_interval: Duration::from_millis(pipeline::number("OUTBOX_POLL_MS", 1000)?),
        ..RelayConfig::default()
    };
    match broker {
        Broker::Amqp { url, topology } => {
            let publisher = AmqpPublisher::connect(&url, &topology).await?;
            tracing::info!(exchange = %topology.exchange, "outbox_relay: relaying to RabbitMQ");
            Relay::new(outbox, publisher)
                .config(config)
                .run_until(pipeline::shutdown_signal())
                .await;
        }
        Broker::Nats {
            url,
            topology,
            subject,
        } => {
            let publisher = NatsPublisher::connect(&url, &topology)
                .await?
                .route(move |_| subject.clone());
            tracing::info!(stream = %topology.stream, "outbox_relay: relaying to NATS JetStream");
            Relay::new(outbox, publisher)
                .config(config)
                .run_until(pipeline::shutdown_signal())
                .await;
        }
    }
    Ok(())
}
