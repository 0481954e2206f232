//! What the outbox, inbox and pipeline tests share: a fresh PostgreSQL schema, a broker
//! topology with a random namespace (the example's names plus a suffix, so tests sharing the
//! machine's RabbitMQ, NATS, Kafka and SQS stay apart), a producer that commits payment + outbox rows
//! through the library, and a receipts handler like the example's.
#![allow(dead_code)]

// Kafka and SQS test helpers, shared with the tests of those brokers.
#[path = "../brokers/mod.rs"]
pub mod brokers;
pub mod clients;
pub mod inbox_copies;

use std::{
    collections::{HashMap, HashSet},
    future::Future,
    sync::Arc,
    time::Duration,
};

use async_trait::async_trait;
use sqlx::{MySqlPool, PgConnection, PgPool, Postgres};
use tower_idempotency::{
    broker::{
        amqp::{lapin, AmqpPublisher, AmqpSubscriber, AmqpTopology},
        kafka::KafkaPublisher,
        nats::{self, NatsPublisher, NatsSubscriber, NatsTopology},
        sqs::{
            aws_sdk_sqs::Client as SqsClient, SqsPublisher, SqsQueues, SqsSubscriber, SqsTopology,
        },
        Delivery, Publisher, Subscriber,
    },
    inbox::{Consumer, Handler, HandlerError, Message, Outcome, PgInbox},
    outbox::{MySqlOutbox, NewEvent, OutboxSource, PgOutbox},
};

use tokio::time::Instant;

use crate::process::{
    shared::{require_all, url_or_skip, Shared},
    unique,
    worker::Worker,
};

pub const TOPIC: &str = "payment.created";

/// A broker with this test's own names.
#[derive(Clone)]
pub enum TestBroker {
    Amqp {
        url: String,
        ns: String,
        topology: AmqpTopology,
    },
    Nats {
        url: String,
        ns: String,
        topology: NatsTopology,
        subject: String,
    },
    Kafka {
        ns: String,
        topic: brokers::kafka::TestTopic,
    },
    Sqs {
        url: String,
        ns: String,
        client: SqsClient,
        topology: SqsTopology,
    },
}

/// How soon a Kafka group notices a member that died (the examples'
/// `KAFKA_SESSION_TIMEOUT_MS`): short, since process tests SIGKILL members and every rebalance
/// waits for the dead one.
pub const KAFKA_SESSION: Duration = Duration::from_secs(6);

/// Partitions of a process test's Kafka topic: enough for every consumer to get work.
const KAFKA_PARTITIONS: i32 = 4;

impl TestBroker {
    /// RabbitMQ at `TEST_AMQP_URL` (skips when unset, unless every backend is required).
    pub fn amqp() -> Option<Self> {
        let url = url_or_skip("TEST_AMQP_URL")?;
        let ns = format!("_t{}", unique());
        let topology = AmqpTopology::new(format!("payments{ns}"), format!("receipts{ns}"), TOPIC);
        Some(Self::Amqp { url, ns, topology })
    }

    /// NATS JetStream at `TEST_NATS_URL`, with `ack_wait` for the durable consumer.
    pub fn nats(ack_wait: Duration) -> Option<Self> {
        let url = url_or_skip("TEST_NATS_URL")?;
        let ns = format!("_t{}", unique());
        let mut topology = NatsTopology::new(
            format!("PAYMENTS{ns}"),
            [format!("payments{ns}.>")],
            format!("receipts{ns}"),
        );
        topology.ack_wait = ack_wait;
        let subject = format!("payments{ns}.created");
        Some(Self::Nats {
            url,
            ns,
            topology,
            subject,
        })
    }

    /// Kafka (tansu) at `TEST_KAFKA_URL`. Its topics are declared by the first example
    /// process or test helper that needs them.
    pub fn kafka() -> Option<Self> {
        let url = url_or_skip("TEST_KAFKA_URL")?;
        let ns = format!("_t{}", unique());
        let topic = brokers::kafka::TestTopic::for_namespace(url, &ns, KAFKA_PARTITIONS);
        Some(Self::Kafka { ns, topic })
    }

    /// SQS (moto) at `TEST_SQS_URL`, a standard queue with the visibility timeout
    /// `visibility` (whole seconds); declared by whoever needs it first.
    pub fn sqs(visibility: Duration) -> Option<Self> {
        let url = url_or_skip("TEST_SQS_URL")?;
        let ns = format!("_t{}", unique());
        let mut topology = SqsTopology::new(format!("receipts{ns}"));
        topology.visibility_timeout = visibility;
        let client = brokers::sqs::client(&url);
        Some(Self::Sqs {
            url,
            ns,
            client,
            topology,
        })
    }

    pub fn name(&self) -> &'static str {
        match self {
            Self::Amqp { .. } => "amqp",
            Self::Nats { .. } => "nats",
            Self::Kafka { .. } => "kafka",
            Self::Sqs { .. } => "sqs",
        }
    }

    /// SQS: declares the queues (idempotent) and returns their URLs.
    async fn sqs_queues(client: &SqsClient, topology: &SqsTopology) -> SqsQueues {
        reached("TEST_SQS_URL", topology.declare(client).await)
    }

    /// The examples' environment for this broker and namespace.
    pub fn env(&self) -> Vec<(String, String)> {
        let (var, url, ns) = match self {
            Self::Amqp { url, ns, .. } => ("AMQP_URL", url, ns),
            Self::Nats {
                url, ns, topology, ..
            } => {
                return vec![
                    ("NATS_URL".into(), url.clone()),
                    ("PIPELINE_NAMESPACE".into(), ns.clone()),
                    (
                        "RECEIPTS_ACK_WAIT_MS".into(),
                        topology.ack_wait.as_millis().to_string(),
                    ),
                ]
            }
            Self::Kafka { ns, topic } => {
                return vec![
                    ("KAFKA_URL".into(), topic.brokers.clone()),
                    ("PIPELINE_NAMESPACE".into(), ns.clone()),
                    (
                        "KAFKA_PARTITIONS".into(),
                        topic.topology.partitions.to_string(),
                    ),
                    (
                        "KAFKA_SESSION_TIMEOUT_MS".into(),
                        KAFKA_SESSION.as_millis().to_string(),
                    ),
                    // Settled offsets committed soon: a killed member leaves little to redo.
                    ("KAFKA_COMMIT_INTERVAL_MS".into(), "200".into()),
                ];
            }
            Self::Sqs {
                url, ns, topology, ..
            } => {
                return vec![
                    ("SQS_URL".into(), url.clone()),
                    ("PIPELINE_NAMESPACE".into(), ns.clone()),
                    (
                        "RECEIPTS_VISIBILITY_SECS".into(),
                        topology.visibility_timeout.as_secs().to_string(),
                    ),
                ]
            }
        };
        vec![
            (var.into(), url.clone()),
            ("PIPELINE_NAMESPACE".into(), ns.clone()),
        ]
    }

    pub async fn publisher(&self) -> Box<dyn Publisher> {
        match self {
            Self::Amqp { url, topology, .. } => Box::new(reached(
                "TEST_AMQP_URL",
                AmqpPublisher::connect(url, topology).await,
            )),
            Self::Nats {
                url,
                topology,
                subject,
                ..
            } => {
                let subject = subject.clone();
                Box::new(
                    reached("TEST_NATS_URL", NatsPublisher::connect(url, topology).await)
                        .route(move |_| subject.clone()),
                )
            }
            Self::Kafka { topic, .. } => {
                reached(
                    "TEST_KAFKA_URL",
                    topic.topology.declare(&topic.brokers).await,
                );
                Box::new(reached(
                    "TEST_KAFKA_URL",
                    KafkaPublisher::connect(&topic.brokers, &topic.topology.topic),
                ))
            }
            Self::Sqs {
                client, topology, ..
            } => {
                let queues = Self::sqs_queues(client, topology).await;
                Box::new(SqsPublisher::new(client.clone(), queues.queue_url))
            }
        }
    }

    /// Takes every delivery until none came for `quiet`, acks it, and returns the message
    /// ids (`"<none>"` for a message without one).
    pub async fn drain_ids(&self, quiet: Duration) -> Vec<String> {
        let mut ids = Vec::new();
        self.each_delivery(quiet, |d| {
            ids.push(d.0.unwrap_or_else(|| "<none>".into()));
            true
        })
        .await;
        ids
    }

    /// Runs `consumer` on every delivery until none came for `quiet`; returns the outcomes.
    pub async fn consume<H: Handler<Postgres>>(
        &self,
        consumer: &Consumer<PgInbox, H>,
        quiet: Duration,
    ) -> Vec<Outcome> {
        match self {
            Self::Amqp { url, topology, .. } => {
                let subscriber = reached(
                    "TEST_AMQP_URL",
                    AmqpSubscriber::connect(url, topology, 16).await,
                );
                consume_from(subscriber, consumer, quiet).await
            }
            Self::Nats { url, topology, .. } => {
                let subscriber = reached(
                    "TEST_NATS_URL",
                    NatsSubscriber::connect(url, topology, 16).await,
                );
                consume_from(subscriber, consumer, quiet).await
            }
            Self::Kafka { topic, .. } => {
                reached(
                    "TEST_KAFKA_URL",
                    topic.topology.declare(&topic.brokers).await,
                );
                consume_from(topic.subscriber(KAFKA_SESSION), consumer, quiet).await
            }
            Self::Sqs {
                client, topology, ..
            } => {
                let subscriber = self.sqs_subscriber(client, topology).await;
                consume_from(subscriber, consumer, quiet).await
            }
        }
    }

    async fn sqs_subscriber(&self, client: &SqsClient, topology: &SqsTopology) -> SqsSubscriber {
        let queues = Self::sqs_queues(client, topology).await;
        reached(
            "TEST_SQS_URL",
            SqsSubscriber::connect(client.clone(), &queues).await,
        )
        .wait(Duration::from_secs(1))
    }

    async fn each_delivery(
        &self,
        quiet: Duration,
        seen: impl FnMut((Option<String>, Vec<u8>)) -> bool,
    ) {
        match self {
            Self::Amqp { url, topology, .. } => {
                let subscriber = reached(
                    "TEST_AMQP_URL",
                    AmqpSubscriber::connect(url, topology, 64).await,
                );
                each_from(subscriber, quiet, seen).await;
            }
            Self::Nats { url, topology, .. } => {
                let subscriber = reached(
                    "TEST_NATS_URL",
                    NatsSubscriber::connect(url, topology, 64).await,
                );
                each_from(subscriber, quiet, seen).await;
            }
            Self::Kafka { topic, .. } => {
                reached(
                    "TEST_KAFKA_URL",
                    topic.topology.declare(&topic.brokers).await,
                );
                each_from(topic.subscriber(KAFKA_SESSION), quiet, seen).await;
            }
            Self::Sqs {
                client, topology, ..
            } => {
                let subscriber = self.sqs_subscriber(client, topology).await;
                each_from(subscriber, quiet, seen).await;
            }
        }
    }

    /// Deletes what this test declared on the broker.
    pub async fn clean_up(&self) {
        match self {
            Self::Amqp { url, topology, .. } => {
                let Ok(connection) = tower_idempotency::broker::amqp::connect(url).await else {
                    return;
                };
                let Ok(channel) = connection.create_channel().await else {
                    return;
                };
                for queue in [topology.queue.clone(), topology.dead_letter_queue()] {
                    let _ = channel
                        .queue_delete(&queue, lapin::options::QueueDeleteOptions::default())
                        .await;
                }
                for exchange in [topology.exchange.clone(), topology.dead_letter_exchange()] {
                    let _ = channel
                        .exchange_delete(
                            &exchange,
                            lapin::options::ExchangeDeleteOptions::default(),
                        )
                        .await;
                }
                let _ = connection.close(200, "test done").await;
            }
            Self::Nats { url, topology, .. } => {
                if let Ok(js) = nats::connect(url).await {
                    let _ = js.delete_stream(&topology.stream).await;
                }
            }
            Self::Kafka { topic, .. } => topic.clean_up().await,
            Self::Sqs {
                client, topology, ..
            } => {
                for name in [topology.queue.clone(), topology.dead_letter_queue()] {
                    let Ok(found) = client.get_queue_url().queue_name(name).send().await else {
                        continue;
                    };
                    if let Some(queue_url) = found.queue_url {
                        let _ = client.delete_queue().queue_url(queue_url).send().await;
                    }
                }
            }
        }
    }
}

/// Acks every delivery of `subscriber` until none came for `quiet` or `seen` says stop.
async fn each_from<S: Subscriber>(
    mut subscriber: S,
    quiet: Duration,
    mut seen: impl FnMut((Option<String>, Vec<u8>)) -> bool,
) {
    while let Ok(Ok(d)) = tokio::time::timeout(quiet, subscriber.next()).await {
        let keep = seen((d.message_id().map(str::to_owned), d.payload().to_vec()));
        d.ack().await.expect("ack");
        if !keep {
            break;
        }
    }
}

async fn consume_from<S: Subscriber, H: Handler<Postgres>>(
    mut subscriber: S,
    consumer: &Consumer<PgInbox, H>,
    quiet: Duration,
) -> Vec<Outcome> {
    let mut outcomes = Vec::new();
    while let Ok(Ok(delivery)) = tokio::time::timeout(quiet, subscriber.next()).await {
        outcomes.push(consumer.process(&delivery).await);
    }
    outcomes
}

/// `result`'s value; an unreachable broker is a failure (the URL was set on purpose).
fn reached<T, E: std::fmt::Display>(var: &str, result: Result<T, E>) -> T {
    match result {
        Ok(value) => value,
        Err(error) => panic!(
            "{var} is set but the broker is unreachable (require all: {}): {error}",
            require_all()
        ),
    }
}

/// A fresh schema with the payments, receipts, outbox and inbox tables, and a pool on it.
pub struct Db {
    pub shared: Shared,
    pub url: String,
    pub pool: PgPool,
    pub outbox: PgOutbox,
    pub inbox: PgInbox,
}

impl Db {
    pub async fn new(shared: Shared) -> Self {
        let Shared::Postgres { url, .. } = &shared else {
            panic!("the pipeline tests run on PostgreSQL")
        };
        let url = url.clone();
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(32)
            .connect(&url)
            .await
            .expect("connect to the test schema");
        let outbox = PgOutbox::new(pool.clone());
        outbox.migrate().await.expect("migrate the outbox");
        let inbox = PgInbox::new(pool.clone());
        inbox.migrate().await.expect("migrate the inbox");
        for ddl in [
            "CREATE TABLE payments (id TEXT PRIMARY KEY, amount BIGINT NOT NULL, currency TEXT NOT NULL)",
            // Like the example's: no unique constraint, so only the inbox prevents a second receipt.
            "CREATE TABLE IF NOT EXISTS receipts (payment_id TEXT NOT NULL, amount BIGINT NOT NULL,
                 currency TEXT NOT NULL, created_at TIMESTAMPTZ NOT NULL DEFAULT now())",
        ] {
            sqlx::query(ddl).execute(&pool).await.expect("create table");
        }
        Self {
            shared,
            url,
            pool,
            outbox,
            inbox,
        }
    }

    /// The producer: one transaction with a payment row and its `payment.created` outbox
    /// row, committed (or rolled back). Returns the payment id and the event id.
    pub async fn pay(&self, commit: bool) -> (String, String) {
        let (payment_id, event) = payment_event();
        let mut tx = self.pool.begin().await.expect("begin");
        sqlx::query("INSERT INTO payments (id, amount, currency) VALUES ($1, 1200, 'EUR')")
            .bind(&payment_id)
            .execute(&mut *tx)
            .await
            .expect("insert payment");
        self.outbox.enqueue(&mut tx, &event).await.expect("enqueue");
        if commit {
            tx.commit().await.expect("commit");
        } else {
            tx.rollback().await.expect("rollback");
        }
        (payment_id, event.id)
    }

    pub async fn unsent(&self) -> i64 {
        pg_unsent(&self.pool).await
    }

    /// `payment_id -> number of receipts`.
    pub async fn receipts(&self) -> HashMap<String, i64> {
        pg_receipts(&self.pool).await
    }
}

/// Outbox rows not sent yet, in the schema of `pool`.
pub async fn pg_unsent(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM tower_outbox WHERE sent_at IS NULL")
        .fetch_one(pool)
        .await
        .expect("count unsent")
}

/// `payment_id -> number of receipts`, in the schema of `pool`.
pub async fn pg_receipts(pool: &PgPool) -> HashMap<String, i64> {
    sqlx::query_as("SELECT payment_id, count(*) FROM receipts GROUP BY payment_id")
        .fetch_all(pool)
        .await
        .expect("count receipts")
        .into_iter()
        .collect()
}

/// The example's handler: one receipt row per message, then an optional sleep before the
/// commit.
pub struct WriteReceipt {
    pub delay: Duration,
}

#[async_trait]
impl Handler<Postgres> for WriteReceipt {
    async fn handle(&self, conn: &mut PgConnection, message: &Message) -> Result<(), HandlerError> {
        let payment_id = message.payload["payment_id"]
            .as_str()
            .ok_or_else(|| HandlerError::Reject("no payment_id".into()))?;
        sqlx::query("INSERT INTO receipts (payment_id, amount, currency) VALUES ($1, 1200, 'EUR')")
            .bind(payment_id)
            .execute(&mut *conn)
            .await
            .map_err(|e| HandlerError::Retry(e.into()))?;
        tokio::time::sleep(self.delay).await;
        Ok(())
    }
}

/// Counts how many messages were handled (ran to a commit attempt), per id.
pub fn tally<T: Eq + std::hash::Hash + Clone>(items: &[T]) -> HashMap<T, usize> {
    let mut counts = HashMap::new();
    for item in items {
        *counts.entry(item.clone()).or_default() += 1;
    }
    counts
}

impl TestBroker {
    /// Publishes a message as something other than the relay might: any body, with or
    /// without a message id. Declares the topology first (as the relay would).
    pub async fn publish_raw(&self, id: Option<&str>, body: &[u8]) {
        match self {
            Self::Amqp { url, topology, .. } => {
                let (connection, channel) = topology.open(url).await.unwrap();
                channel
                    .confirm_select(lapin::options::ConfirmSelectOptions::default())
                    .await
                    .unwrap();
                let mut properties = lapin::BasicProperties::default().with_delivery_mode(2);
                if let Some(id) = id {
                    properties = properties.with_message_id(id.into());
                }
                let confirm = channel
                    .basic_publish(
                        &topology.exchange,
                        TOPIC,
                        Default::default(),
                        body,
                        properties,
                    )
                    .await
                    .unwrap()
                    .await
                    .unwrap();
                assert!(confirm.is_ack());
                connection.close(200, "done").await.unwrap();
            }
            Self::Nats {
                url,
                topology,
                subject,
                ..
            } => {
                let js = nats::connect(url).await.unwrap();
                topology.declare_stream(&js).await.unwrap();
                let mut headers = nats::async_nats::HeaderMap::new();
                if let Some(id) = id {
                    headers.insert("Nats-Msg-Id", id);
                }
                js.publish_with_headers(subject.clone(), headers, body.to_vec().into())
                    .await
                    .unwrap()
                    .await
                    .unwrap();
            }
            Self::Kafka { topic, .. } => {
                use tower_idempotency::broker::kafka::{
                    rdkafka::{
                        message::{Header, OwnedHeaders},
                        producer::{FutureProducer, FutureRecord},
                    },
                    ID_HEADER,
                };
                reached(
                    "TEST_KAFKA_URL",
                    topic.topology.declare(&topic.brokers).await,
                );
                let producer: FutureProducer = topic.member_config(KAFKA_SESSION).create().unwrap();
                let mut headers = OwnedHeaders::new();
                if let Some(id) = id {
                    headers = headers.insert(Header {
                        key: ID_HEADER,
                        value: Some(id),
                    });
                }
                let record = FutureRecord::<(), [u8]>::to(&topic.topology.topic)
                    .payload(body)
                    .headers(headers);
                producer
                    .send(record, Duration::from_secs(10))
                    .await
                    .map_err(|(e, _)| e)
                    .unwrap();
            }
            Self::Sqs {
                client, topology, ..
            } => {
                use tower_idempotency::broker::sqs::{
                    aws_sdk_sqs::types::MessageAttributeValue, ID_ATTRIBUTE,
                };
                let queues = Self::sqs_queues(client, topology).await;
                let mut request = client
                    .send_message()
                    .queue_url(queues.queue_url)
                    .message_body(String::from_utf8_lossy(body));
                if let Some(id) = id {
                    let value = MessageAttributeValue::builder()
                        .data_type("String")
                        .string_value(id)
                        .build()
                        .unwrap();
                    request = request.message_attributes(ID_ATTRIBUTE, value);
                }
                request.send().await.unwrap();
            }
        }
    }

    /// RabbitMQ, Kafka, SQS: how many messages wait in the dead-letter queue (topic). NATS:
    /// how many messages the durable consumer still has pending or unacknowledged (a termed
    /// one has neither).
    pub async fn leftovers(&self) -> u64 {
        match self {
            Self::Amqp { url, topology, .. } => {
                let (connection, channel) = topology.open(url).await.unwrap();
                let queue = channel
                    .queue_declare(
                        &topology.dead_letter_queue(),
                        lapin::options::QueueDeclareOptions {
                            passive: true,
                            ..Default::default()
                        },
                        Default::default(),
                    )
                    .await
                    .unwrap();
                connection.close(200, "done").await.unwrap();
                u64::from(queue.message_count())
            }
            Self::Nats { url, topology, .. } => {
                let js = nats::connect(url).await.unwrap();
                let mut consumer: nats::async_nats::jetstream::consumer::PullConsumer = js
                    .get_consumer_from_stream(&topology.consumer, &topology.stream)
                    .await
                    .unwrap();
                let info = consumer.info().await.unwrap();
                info.num_pending + info.num_ack_pending as u64
            }
            Self::Kafka { topic, .. } => {
                let topic = topic.clone();
                let dead_letters = topic.topology.dead_letter_topic();
                // The reader polls until the topic is quiet: off the runtime's thread.
                let read = tokio::task::spawn_blocking(move || topic.read_all(&dead_letters, 1));
                read.await.unwrap().1.len() as u64
            }
            Self::Sqs {
                client, topology, ..
            } => {
                let queues = Self::sqs_queues(client, topology).await;
                brokers::sqs::queue_count(client, &queues.dead_letter_url).await
            }
        }
    }
}

/// Runs `test` on a fresh schema with `broker`, then drops the schema and the broker's
/// names, whether the test passed or not.
pub async fn with_broker<F, Fut>(broker: TestBroker, test: F)
where
    F: FnOnce(Db, TestBroker) -> Fut,
    Fut: Future<Output = ()>,
{
    with_empty_schema(broker, |shared, broker| async {
        test(Db::new(shared).await, broker).await;
    })
    .await;
}

/// Like [`with_broker`], on an empty schema (for the `payments` example, which creates
/// its own tables).
pub async fn with_empty_schema<F, Fut>(broker: TestBroker, test: F)
where
    F: FnOnce(Shared, TestBroker) -> Fut,
    Fut: Future<Output = ()>,
{
    let Some(shared) = Shared::postgres().await else {
        return;
    };
    let cleanup = broker.clone();
    shared
        .run(|shared| async {
            eprintln!("broker: {}", broker.name());
            test(shared, broker).await;
        })
        .await;
    cleanup.clean_up().await;
}

/// Runs `test` once per configured broker (NATS with `nats_ack_wait`).
pub async fn each_broker<F, Fut>(nats_ack_wait: Duration, test: F)
where
    F: Fn(Db, TestBroker) -> Fut,
    Fut: Future<Output = ()>,
{
    for broker in [TestBroker::amqp(), TestBroker::nats(nats_ack_wait)]
        .into_iter()
        .flatten()
    {
        with_broker(broker, &test).await;
    }
}

/// What a process test needs of the database the examples share, whichever it is.
#[async_trait]
pub trait PipelineDb: Send + Sync + 'static {
    /// The examples' `DATABASE_URL`.
    fn url(&self) -> &str;
    /// `payment_id -> number of receipts`.
    async fn receipts(&self) -> HashMap<String, i64>;
    /// Outbox rows not sent yet.
    async fn unsent(&self) -> i64;
}

/// A database the test itself commits payments to, standing in for the payments service.
#[async_trait]
pub trait Producer: PipelineDb {
    /// Commits (or rolls back) a payment with its outbox event; returns the payment id.
    async fn pay(&self, commit: bool) -> String;
}

#[async_trait]
impl Producer for Db {
    async fn pay(&self, commit: bool) -> String {
        Db::pay(self, commit).await.0
    }
}

#[async_trait]
impl PipelineDb for Db {
    fn url(&self) -> &str {
        &self.url
    }
    async fn receipts(&self) -> HashMap<String, i64> {
        Db::receipts(self).await
    }
    async fn unsent(&self) -> i64 {
        Db::unsent(self).await
    }
}

/// A fresh MySQL / MariaDB database with the same tables as [`Db`].
pub struct MyDb {
    pub url: String,
    pub pool: MySqlPool,
    pub outbox: MySqlOutbox,
}

impl MyDb {
    async fn new(url: String) -> Self {
        let pool = MySqlPool::connect(&url)
            .await
            .expect("connect to the test database");
        let outbox = MySqlOutbox::new(pool.clone());
        outbox.migrate().await.expect("migrate the outbox");
        sqlx::query("CREATE TABLE payments (id VARCHAR(64) PRIMARY KEY, amount BIGINT NOT NULL)")
            .execute(&pool)
            .await
            .expect("create payments");
        Self { url, pool, outbox }
    }
}

#[async_trait]
impl Producer for MyDb {
    async fn pay(&self, commit: bool) -> String {
        let (payment_id, event) = payment_event();
        let mut tx = self.pool.begin().await.expect("begin");
        sqlx::query("INSERT INTO payments (id, amount) VALUES (?, 1200)")
            .bind(&payment_id)
            .execute(&mut *tx)
            .await
            .expect("insert payment");
        self.outbox.enqueue(&mut tx, &event).await.expect("enqueue");
        if commit {
            tx.commit().await.expect("commit");
        } else {
            tx.rollback().await.expect("rollback");
        }
        payment_id
    }
}

#[async_trait]
impl PipelineDb for MyDb {
    fn url(&self) -> &str {
        &self.url
    }
    async fn receipts(&self) -> HashMap<String, i64> {
        // The receipts consumer creates the table when it starts.
        sqlx::query_as("SELECT payment_id, count(*) FROM receipts GROUP BY payment_id")
            .fetch_all(&self.pool)
            .await
            .unwrap_or_default()
            .into_iter()
            .collect()
    }
    async fn unsent(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM tower_outbox WHERE sent_at IS NULL")
            .fetch_one(&self.pool)
            .await
            .expect("count unsent")
    }
}

/// Like [`with_broker`], on a fresh MySQL / MariaDB database.
pub async fn with_mysql_broker<F, Fut>(broker: TestBroker, test: F)
where
    F: FnOnce(MyDb, TestBroker) -> Fut,
    Fut: Future<Output = ()>,
{
    let Some(shared) = Shared::mysql().await else {
        return;
    };
    let Shared::MySql { url, .. } = &shared else {
        unreachable!()
    };
    let url = url.clone();
    let cleanup = broker.clone();
    shared
        .run(|_| async {
            eprintln!("broker: {} on mysql", broker.name());
            test(MyDb::new(url).await, broker).await;
        })
        .await;
    cleanup.clean_up().await;
}

/// A fresh payment id and its `payment.created` event, as the example describes it.
pub fn payment_event() -> (String, NewEvent) {
    let payment_id = format!("pay_{}", unique());
    let event_id = NewEvent::fresh_id();
    let payload = serde_json::json!({
        "event_id": event_id, "payment_id": payment_id, "amount": 1200, "currency": "EUR"
    });
    let event = NewEvent::with_id(event_id, TOPIC, payload.to_string());
    (payment_id, event)
}

/// Runs `relays` relays on `outbox` at once (released by a barrier), each taking batches of
/// `batch` until none is left; returns how many rows each sent.
pub async fn race_relays<S: OutboxSource + Clone>(
    outbox: &S,
    broker: &TestBroker,
    relays: usize,
    batch: u32,
) -> Vec<usize> {
    let barrier = Arc::new(tokio::sync::Barrier::new(relays));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..relays {
        let (outbox, barrier) = (outbox.clone(), barrier.clone());
        let publisher = broker.publisher().await;
        tasks.spawn(async move {
            barrier.wait().await;
            let mut sent = 0;
            loop {
                let n = outbox
                    .relay_batch(&publisher, batch)
                    .await
                    .expect("relay batch");
                if n == 0 {
                    return sent;
                }
                sent += n;
            }
        });
    }
    tasks.join_all().await
}

/// The `outbox_relay` and `receipts` processes of a process test, each restartable.
pub struct Fleet {
    pub env: Vec<(String, String)>,
    pub workers: Vec<(&'static str, Worker)>,
}

impl Fleet {
    /// Starts `names` (`outbox_relay` or `receipts`) with `env`, each once it is ready.
    pub async fn start_all(names: &[&'static str], env: &[(String, String)]) -> Self {
        let mut fleet = Self {
            env: env.to_vec(),
            workers: Vec::new(),
        };
        for &name in names {
            let worker = Self::start(name, env).await;
            fleet.workers.push((name, worker));
        }
        fleet
    }

    async fn start(name: &'static str, env: &[(String, String)]) -> Worker {
        let ready = if name == "receipts" {
            "receipts: consuming"
        } else {
            "outbox_relay: relaying"
        };
        Worker::start(name, env, ready).await
    }

    /// SIGKILLs a random process and starts it again.
    pub async fn kill_one(&mut self) {
        let victim = rand::random_range(0..self.workers.len());
        let (name, worker) = self.workers.swap_remove(victim);
        worker.kill_9().await;
        let restarted = Self::start(name, &self.env).await;
        self.workers.push((name, restarted));
    }

    /// SIGTERMs every process; each must exit successfully.
    pub async fn terminate(self) {
        for (name, worker) in self.workers {
            let logs = worker.logs.clone();
            assert!(
                worker.terminate().await,
                "{name} did not stop cleanly:\n{}",
                logs.lines().join("\n")
            );
        }
    }
}

/// Waits (at most `limit`) until `committed` payments have a receipt each and the outbox is
/// empty, then a little longer for any late duplicate to show up; then asserts exactly one
/// receipt per committed payment, none for another, and no unsent outbox row.
pub async fn assert_one_receipt_each(
    db: &impl PipelineDb,
    committed: &HashSet<String>,
    limit: Duration,
) {
    let deadline = Instant::now() + limit;
    loop {
        let receipts = db.receipts().await;
        if receipts.len() >= committed.len() && db.unsent().await == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not quiet after {limit:?}: {} of {} receipts, {} unsent rows",
            receipts.len(),
            committed.len(),
            db.unsent().await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;

    let receipts = db.receipts().await;
    let count: i64 = receipts.values().sum();
    let expected = committed.len() as i64;
    assert_eq!(
        (count, receipts.len() as i64),
        (expected, expected),
        "receipts and distinct payments with one: {receipts:?}"
    );
    assert_eq!(
        &receipts.keys().cloned().collect::<HashSet<_>>(),
        committed,
        "every committed payment has a receipt and every receipt a committed payment"
    );
    assert_eq!(db.unsent().await, 0, "unsent outbox rows");
}
