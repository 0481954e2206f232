//! One broker under measurement: a fresh topology per name, its publisher, its subscriber,
//! and the clean-up of what was declared.

use std::time::Duration;

use tower_idempotency::{
    broker::{
        amqp::{self, AmqpPublisher, AmqpSubscriber, AmqpTopology},
        nats::{self, NatsPublisher, NatsSubscriber, NatsTopology},
        BrokerError, OutgoingMessage, Publisher,
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
}

/// The names one measurement declares on a broker (a queue or a stream of its own).
pub enum Topology {
    Amqp(String, AmqpTopology),
    Nats(String, NatsTopology, String),
}

impl Broker {
    /// `amqp` or `nats`, for the report.
    pub fn label(&self) -> &'static str {
        match self {
            Broker::Amqp(_) => "amqp",
            Broker::Nats(_) => "nats",
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
            Topology::Nats(..) => None,
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
            Topology::Amqp(..) => None,
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
        }
    }
}
