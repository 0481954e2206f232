//! What the `receipts` consumer, the `outbox_relay` and the `payments` service (which
//! `#[path]`-includes this file) share: the broker topology (below) and the relay's publisher,
//! beside what every example service shares (`../common`: the environment, the shutdown
//! signal, the log output, the drain at shutdown), re-exported here.
//!
//! `PIPELINE_NAMESPACE` (default empty; letters, digits, `_` and `-`) is appended to every
//! broker name — exchange `payments<ns>`, queue `receipts<ns>`, stream `PAYMENTS<ns>` on
//! `payments<ns>.>`, consumer `receipts<ns>` — so that tests sharing a broker stay apart.
#![allow(dead_code)] // each example uses a part

use std::time::Duration;

#[path = "../common/mod.rs"]
mod common;
#[allow(unused_imports)] // each example uses a part
pub use common::{drain, init_logs, number, retry_start, shutdown_signal, var};

use tower_idempotency::{
    broker::{
        amqp::{AmqpPublisher, AmqpTopology},
        nats::{NatsPublisher, NatsTopology},
        BrokerError, Publisher,
    },
    outbox::{RefusalPolicy, RelayConfig},
};

/// The routing key of the event (RabbitMQ) and the outbox topic.
pub const TOPIC: &str = "payment.created";

/// Which broker the environment names.
pub enum Broker {
    Amqp {
        url: String,
        topology: AmqpTopology,
    },
    Nats {
        url: String,
        topology: NatsTopology,
        subject: String,
    },
}

impl Broker {
    /// From `AMQP_URL` or `NATS_URL` (exactly one), `PIPELINE_NAMESPACE` and
    /// `RECEIPTS_ACK_WAIT_MS` (default 30000).
    pub fn from_env() -> Result<Self, String> {
        Self::configured()?.ok_or_else(|| {
            "set AMQP_URL (e.g. amqp://guest:guest@127.0.0.1:5672/%2f) or NATS_URL (e.g. nats://127.0.0.1:4222)"
                .to_owned()
        })
    }

    /// Like [`from_env`](Self::from_env), but `None` when neither URL is set.
    pub fn configured() -> Result<Option<Self>, String> {
        let ns = var("PIPELINE_NAMESPACE").unwrap_or_default();
        if !ns
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        {
            return Err(format!(
                "PIPELINE_NAMESPACE={ns:?} may hold only ASCII letters, digits, '_' and '-'"
            ));
        }
        match (var("AMQP_URL"), var("NATS_URL")) {
            (Some(url), None) => Ok(Some(Broker::Amqp {
                url,
                topology: AmqpTopology::new(
                    format!("payments{ns}"),
                    format!("receipts{ns}"),
                    TOPIC,
                ),
            })),
            (None, Some(url)) => {
                let mut topology = NatsTopology::new(
                    format!("PAYMENTS{ns}"),
                    [format!("payments{ns}.>")],
                    format!("receipts{ns}"),
                );
                topology.ack_wait = Duration::from_millis(number("RECEIPTS_ACK_WAIT_MS", 30_000)?);
                Ok(Some(Broker::Nats {
                    url,
                    topology,
                    subject: format!("payments{ns}.created"),
                }))
            }
            (Some(_), Some(_)) => Err("set only one of AMQP_URL and NATS_URL".to_owned()),
            (None, None) => Ok(None),
        }
    }

    /// Connects a relay's publisher (declaring the topology), trying again while the broker
    /// cannot be reached ([`retry_start`]), and says where it publishes, for the startup log:
    /// `RabbitMQ exchange payments` or `NATS JetStream stream PAYMENTS`. Once connected, the
    /// publisher reconnects by itself.
    pub async fn publisher(&self) -> Result<(Box<dyn Publisher>, String), BrokerError> {
        retry_start("connecting to the broker", || self.connect_publisher()).await
    }

    async fn connect_publisher(&self) -> Result<(Box<dyn Publisher>, String), BrokerError> {
        Ok(match self {
            Broker::Amqp { url, topology } => (
                Box::new(AmqpPublisher::connect(url, topology).await?),
                format!("RabbitMQ exchange {}", topology.exchange),
            ),
            Broker::Nats {
                url,
                topology,
                subject,
            } => {
                let subject = subject.clone();
                // The event goes to the stream's subject; any other topic to a subject of its
                // own name, which no stream covers: the broker refuses it, and the relay
                // parks the row after its attempts.
                let route = move |topic: &str| {
                    if topic == TOPIC {
                        subject.clone()
                    } else {
                        topic.to_owned()
                    }
                };
                (
                    Box::new(NatsPublisher::connect(url, topology).await?.route(route)),
                    format!("NATS JetStream stream {}", topology.stream),
                )
            }
        })
    }
}

/// The relay's settings: `OUTBOX_POLL_MS` (polling fallback, default 1000).
pub fn relay_config() -> Result<RelayConfig, String> {
    Ok(RelayConfig {
        poll_interval: Duration::from_millis(number("OUTBOX_POLL_MS", 1000)?),
        ..RelayConfig::default()
    })
}

/// What the relay does with rows the broker refuses: `OUTBOX_REFUSAL_ATTEMPTS` (refusals
/// before a row is parked, default 10) and `OUTBOX_REFUSAL_DELAY_MS` (the first wait after a
/// refusal, doubling up to a minute; default 1000).
pub fn refusal_policy() -> Result<RefusalPolicy, String> {
    let default = RefusalPolicy::default();
    Ok(RefusalPolicy {
        max_attempts: number("OUTBOX_REFUSAL_ATTEMPTS", default.max_attempts)?,
        first_delay: Duration::from_millis(number(
            "OUTBOX_REFUSAL_DELAY_MS",
            u64::try_from(default.first_delay.as_millis()).unwrap_or(u64::MAX),
        )?),
        ..default
    })
}

/// The database `DATABASE_URL` names.
pub enum Database {
    Postgres(String),
    MySql(String),
    Sqlite(String),
}

impl Database {
    /// From `DATABASE_URL`: PostgreSQL, MySQL / MariaDB or SQLite.
    pub fn from_env() -> Result<Self, String> {
        match var("DATABASE_URL") {
            Some(url) if url.starts_with("postgres://") || url.starts_with("postgresql://") => {
                Ok(Database::Postgres(url))
            }
            Some(url) if url.starts_with("mysql://") || url.starts_with("mariadb://") => {
                Ok(Database::MySql(url))
            }
            Some(url) if url.starts_with("sqlite:") => Ok(Database::Sqlite(url)),
            Some(url) => Err(format!(
                "DATABASE_URL={url:?} is not a postgres://, mysql:// or sqlite:// URL"
            )),
            None => Err("set DATABASE_URL (a postgres://, mysql:// or sqlite:// URL)".to_owned()),
        }
    }
}

/// Sets up logging, runs `run`, and turns its error into one log line and a failure exit.
pub async fn main<F>(name: &str, run: F) -> std::process::ExitCode
where
    F: std::future::Future<Output = Result<(), Box<dyn std::error::Error>>>,
{
    init_logs("info,sqlx=warn", std::io::stdout);
    match run.await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!("{name} stopped: {error}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// A SQLite pool on `url`, creating the file if needed.
pub async fn sqlite_pool(url: &str, connections: u32) -> Result<sqlx::SqlitePool, sqlx::Error> {
    let options = url
        .parse::<sqlx::sqlite::SqliteConnectOptions>()?
        .create_if_missing(true);
    sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(connections)
        .connect_with(options)
        .await
}
