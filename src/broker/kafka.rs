//! Kafka through rdkafka (feature `kafka`), which builds its bundled librdkafka: the
//! ecosystem's usual client, with consumer groups, rebalance callbacks and an idempotent
//! producer done by the library the Kafka project's own C client is.
//!
//! Topology ([`KafkaTopology::declare`], idempotent): a topic with some partitions (e.g.
//! `payments`), its dead-letter topic (`payments.dead`), and the consumer group (e.g.
//! `receipts`).
//!
//! Publishing ([`KafkaPublisher`]): an idempotent producer (`enable.idempotence`,
//! `acks=all`), so a retry inside the client never writes a record twice nor reorders a
//! partition; the message id is the header [`ID_HEADER`] and the ordering key the record key
//! (records of one key go to one partition, in order). Each message's delivery report is its
//! [`Verdict`].
//!
//! Consuming ([`KafkaSubscriber`]): a consumer group member. Kafka has no per-message ack:
//! the group keeps one committed offset per partition, where a member that takes the
//! partition over starts reading. Messages are handled concurrently and settle out of order,
//! so the subscriber tracks the settled offsets of each partition and stores for commit only
//! the contiguous prefix ([`librdkafka`'s `enable.auto.offset.store=false`], committed by the
//! client every `auto.commit.interval.ms` and when a partition is revoked): an offset is
//! committed only after the inbox transactions of it and of everything before it committed.
//! A revoked partition's in-flight messages finish unowned, their settling stores nothing,
//! and the new owner reads them again from the committed offset: the inbox answers
//! "duplicate". Kafka cannot redeliver one message, so [`retry`](Delivery::retry) hands the
//! message out again from this subscriber after the delay and commits nothing past it;
//! [`dead_letter`](Delivery::dead_letter) writes it to the dead-letter topic (headers: the
//! id, the reason, where it came from), then settles it.
//!
//! [`librdkafka`'s `enable.auto.offset.store=false`]: https://github.com/confluentinc/librdkafka/blob/master/CONFIGURATION.md

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex, PoisonError,
    },
    time::Duration,
};

use async_trait::async_trait;
use rdkafka::{
    admin::{AdminClient, AdminOptions, NewTopic, TopicReplication},
    client::DefaultClientContext,
    config::ClientConfig,
    consumer::{Consumer, ConsumerContext, Rebalance, StreamConsumer},
    error::{KafkaError, RDKafkaErrorCode},
    message::{Header, Headers, Message, OwnedHeaders, OwnedMessage},
    producer::{DeliveryFuture, FutureProducer, FutureRecord},
    ClientContext, Offset, TopicPartitionList,
};
use tokio::sync::mpsc;

use super::{
    deadline,
    kafka_offsets::{Offsets, Position},
    Backoff, BrokerError, Delivery, OutgoingMessage, Publisher, Refusal, Subscriber, Verdict,
    DEFAULT_CALL_TIMEOUT,
};

/// The client library, for what this module does not wrap (more client settings, admin
/// calls in tests).
pub use rdkafka;

const BROKER: &str = "kafka";

/// The header that carries the outbox event id.
pub const ID_HEADER: &str = "message_id";

/// The header a dead letter carries: why it was dead-lettered.
pub const REASON_HEADER: &str = "dead_letter_reason";

/// The header a dead letter carries: `<topic>/<partition>/<offset>` it was read from.
pub const ORIGIN_HEADER: &str = "dead_letter_origin";

/// Delivery errors that are about the message itself: sending it again cannot help.
const REFUSED: &[RDKafkaErrorCode] = &[
    RDKafkaErrorCode::MessageSizeTooLarge,
    RDKafkaErrorCode::InvalidMessageSize,
    RDKafkaErrorCode::InvalidMessage,
    RDKafkaErrorCode::InvalidRecord,
    RDKafkaErrorCode::InvalidTopic,
    RDKafkaErrorCode::UnknownTopic,
    RDKafkaErrorCode::UnknownTopicOrPartition,
    RDKafkaErrorCode::TopicAuthorizationFailed,
];

/// The topic, its dead-letter topic and the consumer group. See the [module docs](self).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KafkaTopology {
    /// The topic publishers write and the group reads, e.g. `payments`.
    pub topic: String,
    /// Partitions of the topic when [`declare`](Self::declare) creates it: the most consumers
    /// of the group that get work at once.
    pub partitions: i32,
    /// Replicas of each partition when `declare` creates the topics (1 on a one-broker test
    /// cluster; 3 in production).
    pub replication: i32,
    /// The consumer group, e.g. `receipts`.
    pub group: String,
}

impl KafkaTopology {
    /// Topic `topic` with 6 partitions and 1 replica, read by group `group`.
    pub fn new(topic: impl Into<String>, group: impl Into<String>) -> Self {
        Self {
            topic: topic.into(),
            partitions: 6,
            replication: 1,
            group: group.into(),
        }
    }

    /// The dead-letter topic: `<topic>.dead`.
    pub fn dead_letter_topic(&self) -> String {
        format!("{}.dead", self.topic)
    }

    /// Creates the topic and the dead-letter topic on the cluster at `brokers` (a
    /// `bootstrap.servers` list) unless they exist; an existing topic is used as it is.
    pub async fn declare(&self, brokers: &str) -> Result<(), BrokerError> {
        let action = "declare the topics";
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .create()
            .map_err(|e| BrokerError::broker(BROKER, action, e))?;
        let dead_letter = self.dead_letter_topic();
        let replication = || TopicReplication::Fixed(self.replication);
        let topics = [
            NewTopic::new(&self.topic, self.partitions, replication()),
            NewTopic::new(&dead_letter, 1, replication()),
        ];
        let options = AdminOptions::new().operation_timeout(Some(DEFAULT_CALL_TIMEOUT));
        let results = deadline(BROKER, action, DEFAULT_CALL_TIMEOUT, async {
            admin
                .create_topics(&topics, &options)
                .await
                .map_err(|e| BrokerError::broker(BROKER, action, e))
        })
        .await?;
        for result in results {
            match result {
                Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                Err((topic, code)) => {
                    return Err(BrokerError::Misconfigured {
                        broker: BROKER,
                        action,
                        source: format!("topic {topic}: {code}").into(),
                    })
                }
            }
        }
        Ok(())
    }
}

/// Settings every client of this module needs, on top of the caller's.
fn base_config(brokers: &str) -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", brokers);
    config
}

fn producer(mut config: ClientConfig, timeout: Duration) -> Result<FutureProducer, BrokerError> {
    config
        // Retries inside the client write no duplicate and keep each partition's order.
        .set("enable.idempotence", "true")
        .set("acks", "all")
        // A message the cluster does not take in time fails its delivery report, so a
        // batch never waits past its deadline for nothing.
        .set("message.timeout.ms", timeout.as_millis().max(1).to_string());
    config.create().map_err(|e| BrokerError::Misconfigured {
        broker: BROKER,
        action: "create the producer",
        source: e.into(),
    })
}

/// Enqueues `record`, waiting while the client's local queue is full.
async fn enqueue<'a>(
    producer: &FutureProducer,
    mut record: FutureRecord<'a, str, [u8]>,
) -> Result<DeliveryFuture, BrokerError> {
    loop {
        match producer.send_result(record) {
            Ok(delivery) => return Ok(delivery),
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                record = back;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err((error, _)) => return Err(BrokerError::broker(BROKER, "publish", error)),
        }
    }
}

/// The verdict of one delivery report: a refusal when the error is about the message,
/// a [`BrokerError`] for the batch otherwise.
async fn delivered(delivery: DeliveryFuture) -> Result<Verdict, BrokerError> {
    match delivery.await {
        Ok(Ok(_)) => Ok(Ok(())),
        Ok(Err((KafkaError::MessageProduction(code), _))) if REFUSED.contains(&code) => {
            Ok(Err(Refusal::new(BROKER, code.to_string())))
        }
        Ok(Err((error, _))) => Err(BrokerError::broker(BROKER, "publish", error)),
        Err(canceled) => Err(BrokerError::broker(BROKER, "publish", canceled)),
    }
}

type Route = Arc<dyn Fn(&str) -> String + Send + Sync>;

/// Publishes with an idempotent producer and waits for each delivery report.
pub struct KafkaPublisher {
    producer: FutureProducer,
    route: Route,
    timeout: Duration,
}

impl KafkaPublisher {
    /// A producer for the cluster at `brokers` (a `bootstrap.servers` list) that writes every
    /// message to `topic`, whatever its own topic.
    pub fn connect(brokers: &str, topic: &str) -> Result<Self, BrokerError> {
        let topic = topic.to_owned();
        Ok(Self::from_config(base_config(brokers))?.route(move |_| topic.clone()))
    }

    /// A producer from the caller's client settings (security, client id, linger, ...);
    /// idempotence, `acks=all` and the message timeout are set on top. Messages go to the
    /// topic named by their own topic unless [`route`](Self::route) says otherwise.
    pub fn from_config(config: ClientConfig) -> Result<Self, BrokerError> {
        Ok(Self {
            producer: producer(config, DEFAULT_CALL_TIMEOUT)?,
            route: Arc::new(str::to_owned),
            timeout: DEFAULT_CALL_TIMEOUT,
        })
    }

    /// Maps a message topic (e.g. `payment.created`) to the Kafka topic it is written to.
    pub fn route(mut self, route: impl Fn(&str) -> String + Send + Sync + 'static) -> Self {
        self.route = Arc::new(route);
        self
    }

    /// The time limit of one batch, enqueueing and delivery reports (default
    /// [`DEFAULT_CALL_TIMEOUT`]).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    async fn publish_all(&self, messages: &[OutgoingMessage]) -> Result<Vec<Verdict>, BrokerError> {
        // Everything is enqueued before any report is awaited: one round trip per batch.
        let mut reports = Vec::with_capacity(messages.len());
        for message in messages {
            let topic = (self.route)(&message.topic);
            let headers = OwnedHeaders::new().insert(Header {
                key: ID_HEADER,
                value: Some(message.id.as_str()),
            });
            let mut record = FutureRecord::to(&topic)
                .payload(message.payload.as_slice())
                .headers(headers);
            if let Some(key) = &message.key {
                record = record.key(key.as_str());
            }
            reports.push(enqueue(&self.producer, record).await?);
        }
        let mut verdicts = Vec::with_capacity(reports.len());
        for report in reports {
            verdicts.push(delivered(report).await?);
        }
        Ok(verdicts)
    }
}

#[async_trait]
impl Publisher for KafkaPublisher {
    async fn publish_confirmed(
        &self,
        messages: &[OutgoingMessage],
    ) -> Result<Vec<Verdict>, BrokerError> {
        deadline(BROKER, "publish", self.timeout, self.publish_all(messages)).await
    }

    async fn close(&self) {
        let producer = self.producer.clone();
        let timeout = self.timeout;
        let _ = tokio::task::spawn_blocking(move || {
            rdkafka::producer::Producer::flush(&producer, timeout)
        })
        .await;
    }
}

/// Forgets a partition's in-flight offsets when the group takes it away.
struct GroupContext {
    offsets: Arc<Mutex<Offsets>>,
}

impl ClientContext for GroupContext {}

impl ConsumerContext for GroupContext {
    fn pre_rebalance(&self, _: &rdkafka::consumer::BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let mut offsets = self.offsets.lock().unwrap_or_else(PoisonError::into_inner);
        match rebalance {
            Rebalance::Assign(_) => {}
            Rebalance::Revoke(partitions) => {
                for partition in partitions.elements() {
                    offsets.revoke(&(partition.topic().to_owned(), partition.partition()));
                }
            }
            Rebalance::Error(_) => offsets.revoke_all(),
        }
    }
}

type GroupConsumer = StreamConsumer<GroupContext>;

/// What a subscriber's deliveries share.
struct Shared {
    consumer: GroupConsumer,
    offsets: Arc<Mutex<Offsets>>,
    dead_letters: FutureProducer,
    dead_letter_topic: String,
    redeliver: mpsc::UnboundedSender<Redelivery>,
    timeout: Duration,
}

impl Shared {
    /// Settles `position`; stores the partition's new commit position, if it grew, for the
    /// client's next commit. A position of a revoked assignment stores nothing.
    fn settle(&self, position: &Position) -> Result<(), BrokerError> {
        // Under the lock, so that no revoke slips between the check and the store.
        let mut offsets = self.offsets.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(commit) = offsets.settled(position) else {
            return Ok(());
        };
        let (topic, partition) = &position.partition;
        let mut list = TopicPartitionList::new();
        list.add_partition_offset(topic, *partition, Offset::Offset(commit))
            .and_then(|()| self.consumer.store_offsets(&list))
            .map_err(|e| BrokerError::broker(BROKER, "store the offset", e))
    }
}

/// A message handed out again by this subscriber (a retry, or a delivery dropped unsettled).
struct Redelivery {
    message: OwnedMessage,
    position: Position,
    count: u32,
}

/// A consumer group member. See the [module docs](self).
pub struct KafkaSubscriber {
    shared: Arc<Shared>,
    redeliveries: mpsc::UnboundedReceiver<Redelivery>,
    backoff: Backoff,
}

impl KafkaSubscriber {
    /// Joins `topology.group` on the cluster at `brokers` and subscribes to the topic.
    pub fn connect(brokers: &str, topology: &KafkaTopology) -> Result<Self, BrokerError> {
        Self::from_config(base_config(brokers), topology)
    }

    /// Like [`connect`](Self::connect), from the caller's client settings (security,
    /// `session.timeout.ms`, `max.poll.interval.ms`, `auto.commit.interval.ms`, ...). Set on
    /// top: the group id, `enable.auto.offset.store=false` (only settled offsets are
    /// stored), auto commit of the stored offsets, and `auto.offset.reset=earliest` (a new
    /// group reads the topic from its start). The dead-letter producer uses the same
    /// settings.
    pub fn from_config(
        config: ClientConfig,
        topology: &KafkaTopology,
    ) -> Result<Self, BrokerError> {
        let misconfigured = |action| {
            move |e: KafkaError| BrokerError::Misconfigured {
                broker: BROKER,
                action,
                source: e.into(),
            }
        };
        let dead_letters = producer(config.clone(), DEFAULT_CALL_TIMEOUT)?;
        let offsets = Arc::new(Mutex::new(Offsets::default()));
        let mut config = config;
        config
            .set("group.id", &topology.group)
            .set("enable.auto.offset.store", "false")
            .set("enable.auto.commit", "true")
            .set("auto.offset.reset", "earliest");
        let consumer: GroupConsumer = config
            .create_with_context(GroupContext {
                offsets: offsets.clone(),
            })
            .map_err(misconfigured("create the consumer"))?;
        consumer
            .subscribe(&[&topology.topic])
            .map_err(misconfigured("subscribe"))?;
        let (redeliver, redeliveries) = mpsc::unbounded_channel();
        Ok(Self {
            shared: Arc::new(Shared {
                consumer,
                offsets,
                dead_letters,
                dead_letter_topic: topology.dead_letter_topic(),
                redeliver,
                timeout: DEFAULT_CALL_TIMEOUT,
            }),
            redeliveries,
            backoff: Backoff::default(),
        })
    }

    fn delivery(&self, message: OwnedMessage, position: Position, count: u32) -> KafkaDelivery {
        KafkaDelivery {
            shared: self.shared.clone(),
            message,
            position,
            count,
            settled: AtomicBool::new(false),
        }
    }
}

#[async_trait]
impl Subscriber for KafkaSubscriber {
    type Delivery = KafkaDelivery;

    async fn next(&mut self) -> Result<KafkaDelivery, BrokerError> {
        loop {
            tokio::select! {
                // A redelivery first: it holds back its partition's commits.
                biased;
                Some(again) = self.redeliveries.recv() => {
                    let current = self
                        .shared
                        .offsets
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .is_current(&again.position);
                    // A revoked partition's new owner reads it from the committed offset.
                    if current {
                        return Ok(self.delivery(again.message, again.position, again.count));
                    }
                }
                received = self.shared.consumer.recv() => match received {
                    Ok(message) => {
                        self.backoff.reset();
                        let message = message.detach();
                        let position = self
                            .shared
                            .offsets
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .received(
                                (message.topic().to_owned(), message.partition()),
                                message.offset(),
                            );
                        // Kafka cannot tell whether an earlier member handed this offset
                        // out before it died or lost the partition: not provably the first.
                        return Ok(self.delivery(message, position, 2));
                    }
                    Err(error) => {
                        // The client reconnects and rejoins by itself.
                        tracing::warn!(%error, "kafka: receiving failed; retrying");
                        self.backoff.wait().await;
                    }
                },
            }
        }
    }
}

/// A Kafka delivery: the record and where it sits in its partition.
pub struct KafkaDelivery {
    shared: Arc<Shared>,
    message: OwnedMessage,
    position: Position,
    count: u32,
    settled: AtomicBool,
}

impl KafkaDelivery {
    /// Hands the message out again from this subscriber.
    fn redeliver(&self) {
        let _ = self.shared.redeliver.send(Redelivery {
            message: self.message.clone(),
            position: self.position.clone(),
            count: self.count.saturating_add(1),
        });
    }

    fn header(&self, name: &str) -> Option<&[u8]> {
        self.message
            .headers()?
            .iter()
            .find(|header| header.key == name)?
            .value
    }

    async fn write_dead_letter(&self, reason: &str) -> Result<(), BrokerError> {
        let origin = format!(
            "{}/{}/{}",
            self.message.topic(),
            self.message.partition(),
            self.message.offset()
        );
        let mut headers = OwnedHeaders::new();
        if let Some(id) = self.header(ID_HEADER) {
            headers = headers.insert(Header {
                key: ID_HEADER,
                value: Some(id),
            });
        }
        headers = headers
            .insert(Header {
                key: REASON_HEADER,
                value: Some(reason),
            })
            .insert(Header {
                key: ORIGIN_HEADER,
                value: Some(origin.as_str()),
            });
        let mut record = FutureRecord::to(&self.shared.dead_letter_topic)
            .payload(self.message.payload().unwrap_or_default())
            .headers(headers);
        if let Some(key) = self.message.key() {
            record = record.key(std::str::from_utf8(key).unwrap_or_default());
        }
        let report = enqueue(&self.shared.dead_letters, record).await?;
        match delivered(report).await? {
            Ok(()) => Ok(()),
            Err(refusal) => Err(BrokerError::broker(
                BROKER,
                "write to the dead-letter topic",
                refusal,
            )),
        }
    }
}

#[async_trait]
impl Delivery for KafkaDelivery {
    fn message_id(&self) -> Option<&str> {
        self.header(ID_HEADER)
            .and_then(|id| std::str::from_utf8(id).ok())
    }

    fn payload(&self) -> &[u8] {
        self.message.payload().unwrap_or_default()
    }

    fn delivery_count(&self) -> u32 {
        self.count
    }

    async fn ack(&self) -> Result<(), BrokerError> {
        self.settled.store(true, Ordering::SeqCst);
        self.shared.settle(&self.position)
    }

    async fn retry(&self, delay: Duration) -> Result<(), BrokerError> {
        self.settled.store(true, Ordering::SeqCst);
        tokio::time::sleep(delay).await;
        self.redeliver();
        Ok(())
    }

    async fn dead_letter(&self, reason: &str) -> Result<(), BrokerError> {
        self.settled.store(true, Ordering::SeqCst);
        let written = deadline(
            BROKER,
            "write to the dead-letter topic",
            self.shared.timeout,
            self.write_dead_letter(reason),
        )
        .await;
        match written {
            Ok(()) => self.shared.settle(&self.position),
            Err(error) => {
                // Not settled: it comes back here, as the contract promises of a broker.
                self.redeliver();
                Err(error)
            }
        }
    }
}

impl Drop for KafkaDelivery {
    fn drop(&mut self) {
        // Dropped unsettled (its task was cancelled): hand it out again, or the partition's
        // commits would wait behind it until the next rebalance.
        if !self.settled.load(Ordering::SeqCst) {
            self.redeliver();
        }
    }
}
