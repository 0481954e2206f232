//! `receipts`: consumes `payment.created` events and writes one receipt per payment, through
//! the inbox, on RabbitMQ, NATS JetStream, Kafka or SQS.
//!
//! ```text
//! DATABASE_URL=postgres://root@127.0.0.1/test AMQP_URL=amqp://guest:guest@127.0.0.1:5672/%2f \
//!     cargo run --example receipts
//! DATABASE_URL=postgres://root@127.0.0.1/test NATS_URL=nats://127.0.0.1:4222 \
//!     cargo run --example receipts
//! DATABASE_URL=postgres://root@127.0.0.1/test KAFKA_URL=127.0.0.1:9092 \
//!     cargo run --example receipts
//! DATABASE_URL=postgres://root@127.0.0.1/test SQS_URL=http://127.0.0.1:5000 \
//!     cargo run --example receipts
//! ```
//!
//! Environment: `DATABASE_URL` (PostgreSQL, MySQL / MariaDB or SQLite), one of `AMQP_URL` /
//! `NATS_URL` / `KAFKA_URL` / `SQS_URL` (with their own settings and, for SQS, the AWS region
//! and credentials: see `pipeline/mod.rs`), `RECEIPTS_DELAY_MS` (sleep
//! after writing the receipt, before the commit: the crash window; default 0),
//! `RECEIPTS_CONCURRENCY` (default 8), `RECEIPTS_ACK_WAIT_MS` (NATS, default 30000),
//! `RECEIPTS_VISIBILITY_SECS` (SQS, default 30; extended while a handler runs),
//! `INBOX_RETENTION_SECS` (default 7 days), `PIPELINE_NAMESPACE` (see `pipeline/mod.rs`),
//! `STARTUP_PATIENCE_SECS` (how long the first database and broker connections are tried
//! again, default 60). Once running, the subscriber reconnects by itself and a database
//! outage holds deliveries without spending their attempts (see the `inbox` module).
//!
//! The `receipts` table has no unique constraint on `payment_id`: the inbox alone keeps a
//! redelivered event from writing a second receipt.

mod pipeline;

use std::{process::ExitCode, time::Duration};

use async_trait::async_trait;
use pipeline::{Broker, Database};
use sqlx::{MySql, MySqlConnection, PgConnection, Postgres, Sqlite, SqliteConnection};
use tower_idempotency::{
    broker::{amqp::AmqpSubscriber, nats::NatsSubscriber, sqs::SqsSubscriber},
    inbox::{
        Consumer, ConsumerConfig, Handler, HandlerError, InboxStore, Message, MySqlInbox, PgInbox,
        SqliteInbox,
    },
};

const POSTGRES_SCHEMA: &str = "CREATE TABLE IF NOT EXISTS receipts (
    payment_id TEXT        NOT NULL,
    amount     BIGINT      NOT NULL,
    currency   TEXT        NOT NULL,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now()
)";

const SQLITE_SCHEMA: &str = "CREATE TABLE IF NOT EXISTS receipts (
    payment_id TEXT    NOT NULL,
    amount     INTEGER NOT NULL,
    currency   TEXT    NOT NULL,
    created_at TEXT    NOT NULL DEFAULT CURRENT_TIMESTAMP
)";

const MYSQL_SCHEMA: &str = "CREATE TABLE IF NOT EXISTS receipts (
    payment_id VARCHAR(191) NOT NULL,
    amount     BIGINT       NOT NULL,
    currency   VARCHAR(16)  NOT NULL,
    created_at DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6)
)";

struct WriteReceipt {
    delay: Duration,
}

/// The receipt of `message`, or why the event can never make one.
fn receipt(message: &Message) -> Result<(&str, i64, &str), HandlerError> {
    let event = &message.payload;
    let field = |name: &str| {
        event
            .get(name)
            .ok_or_else(|| HandlerError::Reject(format!("the event has no {name:?}")))
    };
    let payment_id = field("payment_id")?
        .as_str()
        .ok_or_else(|| HandlerError::Reject("payment_id is not a string".into()))?;
    let amount = field("amount")?
        .as_i64()
        .ok_or_else(|| HandlerError::Reject("amount is not an integer".into()))?;
    let currency = field("currency")?
        .as_str()
        .ok_or_else(|| HandlerError::Reject("currency is not a string".into()))?;
    Ok((payment_id, amount, currency))
}

/// The handler on one database: only the SQL placeholders differ.
macro_rules! write_receipt_on {
    ($db:ty, $conn:ty, $insert:literal) => {
        #[async_trait]
        impl Handler<$db> for WriteReceipt {
            async fn handle(
                &self,
                conn: &mut $conn,
                message: &Message,
            ) -> Result<(), HandlerError> {
                let (payment_id, amount, currency) = receipt(message)?;
                sqlx::query($insert)
                    .bind(payment_id)
                    .bind(amount)
                    .bind(currency)
                    .execute(&mut *conn)
                    .await
                    .map_err(|e| HandlerError::Retry(e.into()))?;
                // The crash window: the receipt is written, the transaction not committed.
                tokio::time::sleep(self.delay).await;
                Ok(())
            }
        }
    };
}

write_receipt_on!(
    Postgres,
    PgConnection,
    "INSERT INTO receipts (payment_id, amount, currency) VALUES ($1, $2, $3)"
);
write_receipt_on!(
    MySql,
    MySqlConnection,
    "INSERT INTO receipts (payment_id, amount, currency) VALUES (?, ?, ?)"
);
write_receipt_on!(
    Sqlite,
    SqliteConnection,
    "INSERT INTO receipts (payment_id, amount, currency) VALUES (?1, ?2, ?3)"
);

#[tokio::main]
async fn main() -> ExitCode {
    pipeline::main("receipts", run()).await
}

/// What the first connection does, for the log while it is tried again.
const DATABASE: &str = "connecting to the database and creating the tables";

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    let broker = Broker::from_env()?;
    let concurrency: usize = pipeline::number::<usize>("RECEIPTS_CONCURRENCY", 8)?.max(1);
    let config = ConsumerConfig {
        concurrency,
        retention: Duration::from_secs(pipeline::number("INBOX_RETENTION_SECS", 7 * 24 * 3600)?),
        ..ConsumerConfig::default()
    };
    let handler = WriteReceipt {
        delay: Duration::from_millis(pipeline::number("RECEIPTS_DELAY_MS", 0)?),
    };
    // One connection per message in flight, one for purging.
    let connections = u32::try_from(concurrency + 1).unwrap_or(u32::MAX);
    match Database::from_env()? {
        Database::Postgres(url) => {
            let inbox = pipeline::retry_start(DATABASE, || async {
                let pool = sqlx::postgres::PgPoolOptions::new()
                    .max_connections(connections)
                    .connect(&url)
                    .await?;
                let inbox = PgInbox::new(pool.clone());
                inbox.migrate().await?;
                // Under the lock the library's own tables are created with: several
                // consumers starting at once would race on `CREATE TABLE IF NOT EXISTS`.
                tower_idempotency::sql::migrate_postgres(&pool, "receipts", POSTGRES_SCHEMA)
                    .await?;
                Ok::<_, Box<dyn std::error::Error>>(inbox)
            })
            .await?;
            consume(
                Consumer::with_config("receipts", inbox, handler, config),
                broker,
                concurrency,
            )
            .await
        }
        Database::MySql(url) => {
            let inbox = pipeline::retry_start(DATABASE, || async {
                let pool = sqlx::mysql::MySqlPoolOptions::new()
                    .max_connections(connections)
                    .connect(&url)
                    .await?;
                let inbox = MySqlInbox::new(pool.clone());
                inbox.migrate().await?;
                // MySQL queues concurrent DDL behind a metadata lock: no race to guard.
                sqlx::query(MYSQL_SCHEMA).execute(&pool).await?;
                Ok::<_, Box<dyn std::error::Error>>(inbox)
            })
            .await?;
            consume(
                Consumer::with_config("receipts", inbox, handler, config),
                broker,
                concurrency,
            )
            .await
        }
        Database::Sqlite(url) => {
            let inbox = pipeline::retry_start(DATABASE, || async {
                let pool = pipeline::sqlite_pool(&url, connections).await?;
                let inbox = SqliteInbox::new(pool.clone());
                inbox.migrate().await?;
                // One writer at a time: concurrent DDL waits its turn.
                sqlx::query(SQLITE_SCHEMA).execute(&pool).await?;
                Ok::<_, Box<dyn std::error::Error>>(inbox)
            })
            .await?;
            consume(
                Consumer::with_config("receipts", inbox, handler, config),
                broker,
                concurrency,
            )
            .await
        }
    }
}

/// What connecting to the broker does, for the log while it is tried again. Once connected,
/// the subscriber reconnects by itself.
const BROKER: &str = "connecting to the broker";

async fn consume<I: InboxStore, H: Handler<I::Database>>(
    consumer: Consumer<I, H>,
    broker: Broker,
    concurrency: usize,
) -> Result<(), Box<dyn std::error::Error>> {
    match broker {
        Broker::Amqp { url, topology } => {
            let prefetch = u16::try_from(concurrency).unwrap_or(u16::MAX);
            let subscriber = pipeline::retry_start(BROKER, || {
                AmqpSubscriber::connect(&url, &topology, prefetch)
            })
            .await?;
            tracing::info!(queue = %topology.queue, "receipts: consuming from RabbitMQ");
            consumer
                .run_until(subscriber, pipeline::shutdown_signal())
                .await?;
        }
        Broker::Nats { url, topology, .. } => {
            let subscriber = pipeline::retry_start(BROKER, || {
                NatsSubscriber::connect(&url, &topology, concurrency)
            })
            .await?;
            tracing::info!(stream = %topology.stream, consumer = %topology.consumer, "receipts: consuming from NATS JetStream");
            consumer
                .run_until(subscriber, pipeline::shutdown_signal())
                .await?;
        }
        Broker::Kafka { ref topology, .. } => {
            let subscriber = pipeline::retry_start(BROKER, || broker.kafka_subscriber()).await?;
            tracing::info!(topic = %topology.topic, group = %topology.group, "receipts: consuming from Kafka");
            consumer
                .run_until(subscriber, pipeline::shutdown_signal())
                .await?;
        }
        Broker::Sqs {
            ref client,
            ref topology,
        } => {
            let subscriber = pipeline::retry_start(BROKER, || async {
                let queues = broker.sqs_queues().await?;
                SqsSubscriber::connect(client.clone(), &queues).await
            })
            .await?;
            // Received messages wait for a free handler while their visibility runs: take
            // no more than can be handled at once.
            let subscriber = subscriber.batch(u8::try_from(concurrency).unwrap_or(u8::MAX));
            tracing::info!(queue = %topology.queue, "receipts: consuming from SQS");
            consumer
                .run_until(subscriber, pipeline::shutdown_signal())
                .await?;
        }
    }
    Ok(())
}
