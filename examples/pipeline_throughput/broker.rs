//! One broker under measurement: a fresh topology per name, its publisher, its subscriber,
//! and the clean-up of what was declared.

use std::time::Duration;

use tower_idempotency::{
    broker::{
        amqp::{self, AmqpPublisher, AmqpSubscriber, AmqpTopology},
        kafka::{
            rdkafka::{
                admin::{AdminClient, AdminOptions},
                client::DefaultClientContext,
                config::ClientConfig,
            },
            KafkaPublisher, KafkaSubscriber, KafkaTopology,
        },
        nats::{self, NatsPublisher, NatsSubscriber, NatsTopology},
        sqs::{aws_sdk_sqs::Client as SqsClient, SqsPublisher, SqsSubscriber, SqsTopology},
        BrokerError, OutgoingMessage, Publisher, DEFAULT_CALL_TIMEOUT,
    },
    outbox::NewEvent,
};

/// The topic every message is published on (the AMQP routing key).
pub const TOPIC: &str = "bench.event";

/// A broker and its URL.
#[derive(Clone)]
pub enum Broker {
    Amqp(String),
    Nats(String),
    /// Bootstrap servers.
    Kafka(String),
    /// A client for the endpoint (`pipeline/sqs.rs`).
    Sqs(SqsClient),
}

/// The names one measurement declares on a broker (a queue, a stream or a topic of its own).
pub enum Topology {
    Amqp(String, AmqpTopology),
    Nats(String, NatsTopology, String),
    Kafka(String, KafkaTopology),
    Sqs(SqsClient, SqsTopology),
}

impl Broker {
    /// `amqp`, `nats`, `kafka` or `sqs`, for the report.
    pub fn label(&self) -> &'static str {
        match self {
            Broker::Amqp(_) => "amqp",
            Broker::Nats(_) => "nats",
            Broker::Kafka(_) => "kafka",
            Broker::Sqs(_) => "sqs",
        }
    }

    /// A topology no other run or test uses; `name` is letters, digits and `_`.
    pub fn topology(&self, name: &str) -> Topology {
        match self {
            Broker::Amqp(url) => Topology::Amqp(
                url.clone(),
                AmqpTopology::new(format!("bench_{name}"), format!("bench_{name}"), TOPIC),
            ),
            Broker::Nats(url) => {
                let mut topology = NatsTopology::new(
                    format!("BENCH_{name}"),
                    [format!("bench_{name}.>")],
                    format!("bench_{name}"),
                );
                // No redelivery of a slow message while the clock runs.
                topology.ack_wait = Duration::from_secs(120);
                Topology::Nats(url.clone(), topology, format!("bench_{name}.event"))
            }
            Broker::Kafka(brokers) => Topology::Kafka(
                brokers.clone(),
                KafkaTopology::new(format!("bench_{name}"), format!("bench_{name}")),
            ),
            Broker::Sqs(client) => {
                let mut topology = SqsTopology::new(format!("bench_{name}"));
                // No redelivery of a message that waits while the clock runs.
                topology.visibility_timeout = Duration::from_secs(120);
                Topology::Sqs(client.clone(), topology)
            }
        }
    }
}

impl Topology {
    /// A publisher with confirms (declares the topology).
    pub async fn publisher(&self) -> Result<Box<dyn Publisher>, BrokerError> {
        Ok(match self {
            Topology::Amqp(url, topology) => Box::new(AmqpPublisher::connect(url, topology).await?),
            Topology::Nats(url, topology, subject) => {
                let subject = subject.clone();
                Box::new(
                    NatsPublisher::connect(url, topology)
                        .await?
                        .route(move |_| subject.clone()),
                )
            }
            Topology::Kafka(brokers, topology) => {
                topology.declare(brokers).await?;
                Box::new(KafkaPublisher::connect(brokers, &topology.topic)?)
            }
            Topology::Sqs(client, topology) => {
                let queues = topology.declare(client).await?;
                // A local SQS on a loaded machine can take longer than the default 10 s for
                // a relay batch (ten SendMessageBatch calls); a timeout would end the run.
                Box::new(
                    SqsPublisher::new(client.clone(), queues.queue_url)
                        .timeout(Duration::from_secs(60)),
                )
            }
        })
    }

    /// Publishes `n` JSON messages with fresh ids, `batch` per confirmed round trip.
    pub async fn fill(&self, n: usize, batch: usize) -> Result<(), BrokerError> {
        let publisher = self.publisher().await?;
        let mut left = n;
        while left > 0 {
            let messages: Vec<_> = (0..left.min(batch))
                .map(|i| {
                    let event = NewEvent::new(TOPIC, format!(r#"{{"amount":{i}}}"#));
                    OutgoingMessage {
                        id: event.id,
                        topic: event.topic,
                        key: event.key,
                        payload: event.payload,
                    }
                })
                .collect();
            publisher.publish_confirmed(&messages).await?;
            left -= messages.len();
        }
        publisher.close().await;
        Ok(())
    }

    /// The AMQP subscriber, if this is RabbitMQ.
    pub async fn amqp_subscriber(
        &self,
        prefetch: u16,
    ) -> Option<Result<AmqpSubscriber, BrokerError>> {
        match self {
            Topology::Amqp(url, topology) => {
                Some(AmqpSubscriber::connect(url, topology, prefetch).await)
            }
            _ => None,
        }
    }

    /// The NATS subscriber, if this is JetStream.
    pub async fn nats_subscriber(
        &self,
        batch: usize,
    ) -> Option<Result<NatsSubscriber, BrokerError>> {
        match self {
            Topology::Nats(url, topology, _) => {
                Some(NatsSubscriber::connect(url, topology, batch).await)
            }
            _ => None,
        }
    }

    /// The Kafka group member, if this is Kafka (the group reads the topic from its start).
    pub async fn kafka_subscriber(&self) -> Option<Result<KafkaSubscriber, BrokerError>> {
        match self {
            Topology::Kafka(brokers, topology) => {
                let mut config = ClientConfig::new();
                config.set("bootstrap.servers", brokers);
                Some(KafkaSubscriber::from_config(config, topology))
            }
            _ => None,
        }
    }

    /// The SQS subscriber, if this is SQS: `batch` messages per receive (at most 10).
    pub async fn sqs_subscriber(&self, batch: u16) -> Option<Result<SqsSubscriber, BrokerError>> {
        match self {
            Topology::Sqs(client, topology) => Some(
                async {
                    let queues = topology.declare(client).await?;
                    let subscriber = SqsSubscriber::connect(client.clone(), &queues).await?;
                    Ok(subscriber.batch(u8::try_from(batch).unwrap_or(u8::MAX)))
                }
                .await,
            ),
            _ => None,
        }
    }

    /// Deletes what was declared; errors are ignored (nothing depends on it).
    pub async fn clean_up(&self) {
        match self {
            Topology::Amqp(url, topology) => {
                let Ok(connection) = amqp::connect(url).await else {
                    return;
                };
                let Ok(channel) = connection.create_channel().await else {
                    return;
                };
                for queue in [topology.queue.clone(), topology.dead_letter_queue()] {
                    let options = amqp::lapin::options::QueueDeleteOptions::default();
                    let _ = channel.queue_delete(&queue, options).await;
                }
                for exchange in [topology.exchange.clone(), topology.dead_letter_exchange()] {
                    let options = amqp::lapin::options::ExchangeDeleteOptions::default();
                    let _ = channel.exchange_delete(&exchange, options).await;
                }
                let _ = connection.close(200, "bench done").await;
            }
            Topology::Nats(url, topology, _) => {
                if let Ok(js) = nats::connect(url).await {
                    let _ = js.delete_stream(&topology.stream).await;
                }
            }
            Topology::Kafka(brokers, topology) => {
                let Ok(admin) = ClientConfig::new()
                    .set("bootstrap.servers", brokers)
                    .create::<AdminClient<DefaultClientContext>>()
                else {
                    return;
                };
                let dead_letter = topology.dead_letter_topic();
                let options = AdminOptions::new().operation_timeout(Some(DEFAULT_CALL_TIMEOUT));
                let _ = admin
                    .delete_topics(&[topology.topic.as_str(), dead_letter.as_str()], &options)
                    .await;
            }
            Topology::Sqs(client, topology) => {
                for name in [topology.queue.clone(), topology.dead_letter_queue()] {
                    if let Ok(found) = client.get_queue_url().queue_name(name).send().await {
                        if let Some(url) = found.queue_url {
                            let _ = client.delete_queue().queue_url(url).send().await;
                        }
                    }
                }
            }
        }
    }
}
