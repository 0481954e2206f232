//! Topics and groups of a test's own on the Kafka-protocol broker at `TEST_KAFKA_URL`
//! (tansu), client settings that make group changes quick, and what a test reads back: the
//! end of each partition, the group's committed offsets, the dead letters.

use std::{collections::HashMap, time::Duration};

use tower_idempotency::broker::kafka::{
    rdkafka::{
        config::ClientConfig,
        consumer::{BaseConsumer, Consumer},
        message::Message,
        Offset, TopicPartitionList,
    },
    KafkaSubscriber, KafkaTopology,
};

use crate::process::{shared::url_or_skip, unique};

/// A topic, its dead-letter topic and a group of this test's own.
#[derive(Clone)]
pub struct TestTopic {
    pub brokers: String,
    pub topology: KafkaTopology,
}

impl TestTopic {
    /// `payments_<random>` with `partitions` partitions, group `receipts_<random>`.
    pub async fn new(partitions: i32) -> Option<Self> {
        let brokers = url_or_skip("TEST_KAFKA_URL")?;
        let id = unique();
        let mut topology = KafkaTopology::new(format!("payments_{id}"), format!("receipts_{id}"));
        topology.partitions = partitions;
        topology
            .declare(&brokers)
            .await
            .unwrap_or_else(|e| panic!("TEST_KAFKA_URL is set but Kafka is unreachable: {e}"));
        Some(Self { brokers, topology })
    }

    /// The names the pipeline examples use in namespace `ns` (topic `payments<ns>`, group
    /// `receipts<ns>`), not declared: the first example process to start declares them.
    pub fn for_namespace(brokers: String, ns: &str, partitions: i32) -> Self {
        let mut topology = KafkaTopology::new(format!("payments{ns}"), format!("receipts{ns}"));
        topology.partitions = partitions;
        Self { brokers, topology }
    }

    /// Deletes the topic and its dead-letter topic; errors are ignored (nothing depends on
    /// it).
    pub async fn clean_up(&self) {
        use tower_idempotency::broker::kafka::rdkafka::{
            admin::{AdminClient, AdminOptions},
            client::DefaultClientContext,
        };
        let Ok(admin) = ClientConfig::new()
            .set("bootstrap.servers", &self.brokers)
            .create::<AdminClient<DefaultClientContext>>()
        else {
            return;
        };
        let dead_letter = self.topology.dead_letter_topic();
        let topics = [self.topology.topic.as_str(), dead_letter.as_str()];
        let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
        let _ = tokio::time::timeout(
            Duration::from_secs(15),
            admin.delete_topics(&topics, &options),
        )
        .await;
    }

    /// Client settings for members of the test's group: a dead member is noticed within
    /// `session` (heartbeats every tenth of it), stored offsets are committed every 100 ms.
    pub fn member_config(&self, session: Duration) -> ClientConfig {
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", &self.brokers)
            .set("session.timeout.ms", session.as_millis().to_string())
            .set(
                "heartbeat.interval.ms",
                (session / 10).as_millis().to_string(),
            )
            .set("auto.commit.interval.ms", "100")
            .set("topic.metadata.refresh.interval.ms", "1000");
        config
    }

    /// A member of the test's group.
    pub fn subscriber(&self, session: Duration) -> KafkaSubscriber {
        KafkaSubscriber::from_config(self.member_config(session), &self.topology)
            .expect("join the group")
    }

    /// Reads `topic` from its start until nothing came for a second: per partition, one
    /// past the last offset (the end a fully consumed partition's committed offset is at),
    /// and every record's headers by name.
    pub fn read_all(
        &self,
        topic: &str,
        partitions: i32,
    ) -> (HashMap<i32, i64>, Vec<HashMap<String, String>>) {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &self.brokers)
            .set("group.id", format!("reader_{}", unique()))
            .set("enable.auto.commit", "false")
            .create()
            .expect("reader");
        let mut list = TopicPartitionList::new();
        for partition in 0..partitions {
            list.add_partition_offset(topic, partition, Offset::Beginning)
                .expect("partition");
        }
        consumer.assign(&list).expect("assign");
        let mut ends = HashMap::new();
        let mut records = Vec::new();
        let mut quiet_since = std::time::Instant::now();
        while quiet_since.elapsed() < Duration::from_secs(2) {
            match consumer.poll(Duration::from_millis(200)) {
                Some(Ok(message)) => {
                    quiet_since = std::time::Instant::now();
                    ends.insert(message.partition(), message.offset() + 1);
                    let mut headers = HashMap::new();
                    if let Some(all) = message.headers() {
                        use tower_idempotency::broker::kafka::rdkafka::message::Headers;
                        for header in all.iter() {
                            let value = header
                                .value
                                .map(String::from_utf8_lossy)
                                .unwrap_or_default();
                            headers.insert(header.key.to_owned(), value.into_owned());
                        }
                    }
                    records.push(headers);
                }
                Some(Err(error)) => panic!("reading {topic}: {error}"),
                None => {}
            }
        }
        (ends, records)
    }

    /// The group's committed offset per partition (partitions without one left out).
    pub fn committed(&self) -> HashMap<i32, i64> {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &self.brokers)
            .set("group.id", &self.topology.group)
            .create()
            .expect("offset reader");
        let mut list = TopicPartitionList::new();
        for partition in 0..self.topology.partitions {
            list.add_partition(&self.topology.topic, partition);
        }
        consumer
            .committed_offsets(list, Duration::from_secs(10))
            .expect("committed offsets")
            .elements()
            .iter()
            .filter_map(|e| match e.offset() {
                Offset::Offset(offset) => Some((e.partition(), offset)),
                _ => None,
            })
            .collect()
    }

    /// The partition's low and high watermarks as the broker answers ListOffsets.
    pub fn watermarks(&self, partition: i32) -> (i64, i64) {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &self.brokers)
            .create()
            .expect("client");
        consumer
            .fetch_watermarks(&self.topology.topic, partition, Duration::from_secs(10))
            .expect("watermarks")
    }
}
