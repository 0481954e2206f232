//! What the `receipts` consumer, the `outbox_relay` and the `payments` service (which
//! `#[path]`-includes this file) share: the broker topology (below) and the relay's publisher,
//! beside what every example service shares (`../common`: the environment, the shutdown
//! signal, the log output, the drain at shutdown), re-exported here.
//!
//! Exactly one broker is named by the environment:
//!
//! | variable | broker | names |
//! |---|---|---|
//! | `AMQP_URL`, e.g. `amqp://guest:guest@127.0.0.1:5672/%2f` | RabbitMQ | exchange `payments<ns>`, queue `receipts<ns>` |
//! | `NATS_URL`, e.g. `nats://127.0.0.1:4222` | NATS JetStream | stream `PAYMENTS<ns>` on `payments<ns>.>`, consumer `receipts<ns>` (`RECEIPTS_ACK_WAIT_MS`, default 30000) |
//! | `KAFKA_URL` (bootstrap servers), e.g. `127.0.0.1:9092` | Kafka | topic `payments<ns>` (`KAFKA_PARTITIONS` when it creates it, default 6), dead letters `payments<ns>.dead`, group `receipts<ns>` (`KAFKA_SESSION_TIMEOUT_MS`, default the client's 45000; `KAFKA_COMMIT_INTERVAL_MS`, default 5000) |
//! | `SQS_URL` (the endpoint), e.g. `http://127.0.0.1:5000` | SQS | queue `receipts<ns>`, dead letters `receipts<ns>-dead` (`RECEIPTS_VISIBILITY_SECS`, default 30); region and credentials: `sqs.rs` |
//!
//! `PIPELINE_NAMESPACE` (default empty; letters, digits, `_` and `-`) is the `<ns>` appended
//! to every broker name, so that tests sharing a broker stay apart.
#![allow(dead_code)] // each example uses a part

pub mod sqs;

use std::time::Duration;

#[path = "../common/mod.rs"]
mod common;
#[allow(unused_imports)] // each example uses a part
pub use common::{drain, init_logs, number, retry_start, shutdown_signal, var};

use tower_idempotency::{
    broker::{
        amqp::{AmqpPublisher, AmqpTopology},
        kafka::{rdkafka::config::ClientConfig, KafkaPublisher, KafkaSubscriber, KafkaTopology},
        nats::{NatsPublisher, NatsTopology},
        sqs::{aws_sdk_sqs::Client as SqsClient, SqsPublisher, SqsQueues, SqsTopology},
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
    Kafka {
        brokers: String,
        topology: KafkaTopology,
        /// `KAFKA_SESSION_TIMEOUT_MS`: how soon the group notices a member that died.
        session_timeout: Option<Duration>,
        /// `KAFKA_COMMIT_INTERVAL_MS`: how often settled offsets are committed.
        commit_interval: Option<Duration>,
    },
    Sqs {
        client: SqsClient,
        topology: SqsTopology,
    },
}

/// The variables that name a broker, with an example value each.
const BROKER_VARS: [(&str, &str); 4] = [
    ("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f"),
    ("NATS_URL", "nats://127.0.0.1:4222"),
    ("KAFKA_URL", "127.0.0.1:9092"),
    ("SQS_URL", "http://127.0.0.1:5000"),
];

/// An optional duration in milliseconds from the environment.
fn millis(name: &str) -> Result<Option<Duration>, String> {
    Ok(match var(name) {
        None => None,
        Some(_) => Some(Duration::from_millis(number(name, 0)?)),
    })
}

impl Broker {
    /// From exactly one of `AMQP_URL`, `NATS_URL`, `KAFKA_URL`, `SQS_URL`, with
    /// `PIPELINE_NAMESPACE` and the broker's own settings (the table above).
    pub fn from_env() -> Result<Self, String> {
        Self::configured()?.ok_or_else(|| {
            let choices: Vec<String> = BROKER_VARS
                .iter()
                .map(|(name, example)| format!("{name} (e.g. {example})"))
                .collect();
            format!("set one of {}", choices.join(", "))
        })
    }

    /// Whether any broker variable is set (its value is checked by [`from_env`](Self::from_env)).
    pub fn named() -> bool {
        BROKER_VARS.iter().any(|(name, _)| var(name).is_some())
    }

    /// Like [`from_env`](Self::from_env), but `None` when no broker URL is set.
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
        let set: Vec<(&str, String)> = BROKER_VARS
            .iter()
            .filter_map(|(name, _)| Some((*name, var(name)?)))
            .collect();
        let (name, url) = match set.as_slice() {
            [] => return Ok(None),
            [(name, url)] => (*name, url.clone()),
            several => {
                let names: Vec<&str> = several.iter().map(|(name, _)| *name).collect();
                return Err(format!(
                    "set only one broker variable; found {}",
                    names.join(", ")
                ));
            }
        };
        match name {
            "AMQP_URL" => Ok(Some(Broker::Amqp {
                url,
                topology: AmqpTopology::new(
                    format!("payments{ns}"),
                    format!("receipts{ns}"),
                    TOPIC,
                ),
            })),
            "NATS_URL" => {
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
            "KAFKA_URL" => {
                let mut topology =
                    KafkaTopology::new(format!("payments{ns}"), format!("receipts{ns}"));
                topology.partitions = number("KAFKA_PARTITIONS", topology.partitions)?;
                Ok(Some(Broker::Kafka {
                    brokers: url,
                    topology,
                    session_timeout: millis("KAFKA_SESSION_TIMEOUT_MS")?,
                    commit_interval: millis("KAFKA_COMMIT_INTERVAL_MS")?,
                }))
            }
            _ => {
                let mut topology = SqsTopology::new(format!("receipts{ns}"));
                topology.visibility_timeout =
                    Duration::from_secs(number("RECEIPTS_VISIBILITY_SECS", 30)?);
                Ok(Some(Broker::Sqs {
                    client: sqs::client(&url)?,
                    topology,
                }))
            }
        }
    }

    /// Kafka: the client settings of a member of the group (and of its producers).
    pub fn kafka_config(
        brokers: &str,
        session_timeout: Option<Duration>,
        commit_interval: Option<Duration>,
    ) -> ClientConfig {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", brokers);
        if let Some(session) = session_timeout {
            // Heartbeats well inside the session, as the client's defaults are (3 s of 45 s).
            config
                .set("session.timeout.ms", session.as_millis().to_string())
                .set(
                    "heartbeat.interval.ms",
                    (session / 10).as_millis().max(100).to_string(),
                );
        }
        if let Some(interval) = commit_interval {
            config.set("auto.commit.interval.ms", interval.as_millis().to_string());
        }
        config
    }

    /// Kafka: declares the topics (as whoever starts first does) and joins the group.
    pub async fn kafka_subscriber(&self) -> Result<KafkaSubscriber, BrokerError> {
        let Broker::Kafka {
            brokers,
            topology,
            session_timeout,
            commit_interval,
        } = self
        else {
            unreachable!("kafka_subscriber on another broker")
        };
        topology.declare(brokers).await?;
        let config = Self::kafka_config(brokers, *session_timeout, *commit_interval);
        KafkaSubscriber::from_config(config, topology)
    }

    /// SQS: declares the queue and its dead-letter queue, returns their URLs.
    pub async fn sqs_queues(&self) -> Result<SqsQueues, BrokerError> {
        let Broker::Sqs { client, topology } = self else {
            unreachable!("sqs_queues on another broker")
        };
        topology.declare(client).await
    }

    /// Connects a relay's publisher (declaring the topology), trying again while the broker
    /// cannot be reached ([`retry_start`]), and says where it publishes, for the startup log:
    /// `RabbitMQ exchange payments`, `NATS JetStream stream PAYMENTS`, `Kafka topic payments`
    /// or `SQS queue receipts`. Once connected, the publisher reconnects by itself.
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
            Broker::Kafka {
                brokers, topology, ..
            } => {
                topology.declare(brokers).await?;
                let topic = topology.topic.clone();
                // As on NATS: any other topic goes to a topic of its own name.
                let route = move |name: &str| {
                    if name == TOPIC {
                        topic.clone()
                    } else {
                        name.to_owned()
                    }
                };
                // The group's settings are a consumer's: the producer takes none of them.
                let config = Self::kafka_config(brokers, None, None);
                (
                    Box::new(KafkaPublisher::from_config(config)?.route(route)),
                    format!("Kafka topic {}", topology.topic),
                )
            }
            Broker::Sqs { client, topology } => {
                let queues = topology.declare(client).await?;
                (
                    Box::new(SqsPublisher::new(client.clone(), queues.queue_url)),
                    format!("SQS queue {}", topology.queue),
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
