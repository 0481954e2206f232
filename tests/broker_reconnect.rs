//! Publishers and subscribers that come back by themselves: a relay-like publisher and a
//! consumer-like subscriber keep one session each while the broker goes away, and every
//! message published is received, with no new publisher, subscriber or process.
//!
//! - RabbitMQ (the machine's, behind a TCP proxy of the test's own): every connection cut
//!   for 3 s, then a network that goes silent for 4 s (no connection closed: only the
//!   heartbeat and the call time limit notice).
//! - NATS JetStream (a `nats-server -js` of the test's own): SIGKILLed and restarted on the
//!   same store, then SIGKILLed and restarted on an empty one (stream and consumer lost).
//!
//! Needs TEST_AMQP_URL / TEST_NATS_URL (`scripts/test` sets them) and `nats-server`.

mod pipeline;
mod process;

#[path = "common/nats_server.rs"]
mod nats_server;
#[path = "common/proxy.rs"]
mod proxy;

use std::{
    collections::HashSet,
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use nats_server::PrivateNats;
use pipeline::{TestBroker, TOPIC};
use process::{shared::require_all, unique};
use proxy::Proxy;
use tokio::time::Instant;
use tower_idempotency::broker::{
    amqp::{lapin::uri::AMQPUri, AmqpPublisher, AmqpSubscriber},
    nats::{NatsPublisher, NatsSubscriber},
    Backoff, Delivery, OutgoingMessage, Publisher, Subscriber,
};

/// Messages the publisher sends, one at a time, each retried until the broker confirms it.
const MESSAGES: usize = 80;

/// Quick reconnections, so the test spends its time in outages rather than in backoff.
fn quick() -> Backoff {
    Backoff::new(Duration::from_millis(50), Duration::from_millis(500))
}

/// What the publisher and the subscriber did; shared with their tasks.
#[derive(Default)]
struct Traffic {
    published: Mutex<Vec<String>>,
    received: Mutex<HashSet<String>>,
    /// Batches that failed (broker unreachable, time limit) or were refused.
    failed: AtomicUsize,
    /// While set, the publisher publishes nothing.
    paused: AtomicBool,
    /// Why the subscriber stopped, if it did.
    subscriber_ended: Mutex<Option<String>>,
}

impl Traffic {
    fn received(&self) -> usize {
        self.received.lock().unwrap().len()
    }

    fn published(&self) -> usize {
        self.published.lock().unwrap().len()
    }

    fn failed(&self) -> usize {
        self.failed.load(Ordering::SeqCst)
    }

    /// Waits until `done` holds; fails the test after `limit`, saying `what`.
    async fn wait(&self, what: &str, limit: Duration, done: impl Fn(&Self) -> bool) {
        let deadline = Instant::now() + limit;
        while !done(self) {
            assert!(
                Instant::now() < deadline,
                "{what} not reached within {limit:?}: published {}, received {}, failed \
                 batches {}, subscriber ended: {:?}",
                self.published(),
                self.received(),
                self.failed(),
                self.subscriber_ended.lock().unwrap()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Starts a publisher task (like a relay: retries each message until confirmed) and a
/// subscriber task (like a consumer: acks everything).
fn start(publisher: impl Publisher, mut subscriber: impl Subscriber, topic: &str) -> Arc<Traffic> {
    let traffic = Arc::new(Traffic::default());
    let prefix = unique();
    let topic = topic.to_owned();
    let t = traffic.clone();
    tokio::spawn(async move {
        for i in 0..MESSAGES {
            let message = OutgoingMessage {
                id: format!("{prefix}-{i}"),
                topic: topic.clone(),
                key: None,
                payload: b"{}".to_vec(),
            };
            loop {
                if t.paused.load(Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
                match publisher
                    .publish_confirmed(std::slice::from_ref(&message))
                    .await
                {
                    Ok(verdicts) if verdicts.iter().all(Result::is_ok) => break,
                    _ => {
                        t.failed.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
            t.published.lock().unwrap().push(message.id);
            tokio::time::sleep(Duration::from_millis(40)).await;
        }
    });
    let t = traffic.clone();
    tokio::spawn(async move {
        loop {
            match subscriber.next().await {
                Ok(delivery) => {
                    // A delivery of a lost session fails to ack; the broker delivers it again.
                    if delivery.ack().await.is_ok() {
                        let id = delivery.message_id().unwrap_or("<none>").to_owned();
                        t.received.lock().unwrap().insert(id);
                    }
                }
                Err(error) => {
                    *t.subscriber_ended.lock().unwrap() = Some(error.to_string());
                    return;
                }
            }
        }
    });
    traffic
}

/// Every confirmed message was received, and nothing else.
async fn all_received(traffic: &Traffic) {
    traffic
        .wait("every message received", Duration::from_secs(40), |t| {
            t.published() == MESSAGES && t.received() == MESSAGES
        })
        .await;
    let published: HashSet<String> = traffic.published.lock().unwrap().iter().cloned().collect();
    assert_eq!(*traffic.received.lock().unwrap(), published);
}

// mutant: `AmqpSubscriber::next` returns the session's error instead of reconnecting (the
// code before) -> fails with "progress after the cut not reached ... subscriber ended:
// Some(\"amqp: could not receive ...\")"; mutant: `AmqpPublisher` keeps its dead session
// (`channel()` returns the old channel without checking it) -> fails with "progress after the
// cut not reached", every batch failing.
#[tokio::test]
async fn amqp_publisher_and_subscriber_come_back_after_cuts_and_a_silent_network() {
    let Some(broker) = TestBroker::amqp() else {
        return;
    };
    let TestBroker::Amqp { url, topology, .. } = &broker else {
        unreachable!()
    };
    let uri: AMQPUri = url.parse().expect("TEST_AMQP_URL is an AMQP URL");
    let upstream = format!("{}:{}", uri.authority.host, uri.authority.port);
    assert!(url.contains(&upstream) && !url.contains('?'), "{url}");
    let proxy = Proxy::start(&uri.authority.host, uri.authority.port).await;
    // A heartbeat of 1 s: the silent network is noticed within about 2 s.
    let proxied = url.replacen(&upstream, &proxy.addr().to_string(), 1) + "?heartbeat=1";

    let publisher = AmqpPublisher::connect(&proxied, topology)
        .await
        .expect("connect the publisher")
        .timeout(Duration::from_secs(2))
        .backoff(quick());
    let subscriber = AmqpSubscriber::connect(&proxied, topology, 16)
        .await
        .expect("connect the subscriber")
        .backoff(quick());
    let traffic = start(publisher, subscriber, TOPIC);

    traffic
        .wait("10 received", Duration::from_secs(10), |t| {
            t.received() >= 10
        })
        .await;
    let failed = traffic.failed();
    proxy.cut();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(traffic.failed() > failed, "no batch failed during the cut");
    proxy.restore();
    let seen = traffic.received();
    traffic
        .wait("progress after the cut", Duration::from_secs(15), |t| {
            t.received() >= seen + 10
        })
        .await;

    let failed = traffic.failed();
    proxy.stall();
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(traffic.failed() > failed, "no batch failed while silent");
    proxy.restore();
    all_received(&traffic).await;
    assert!(traffic.subscriber_ended.lock().unwrap().is_none());
    broker.clean_up().await;
}

// mutant: `NatsSubscriber::next` keeps pulling on the failed stream (the code before: sleep
// and retry, never declaring the consumer again) -> fails with "every message received not
// reached within 40s: published 80, received 20".
#[tokio::test]
async fn nats_publisher_and_subscriber_come_back_after_kills_and_a_lost_store() {
    let Some(TestBroker::Nats {
        mut topology,
        subject,
        ..
    }) = TestBroker::nats(Duration::from_secs(2))
    else {
        return;
    };
    let Some(mut server) = PrivateNats::start(require_all()) else {
        return;
    };
    topology.ack_wait = Duration::from_secs(2);
    let url = server.url();
    let publisher = NatsPublisher::connect(&url, &topology)
        .await
        .expect("connect the publisher")
        .route(move |_| subject.clone())
        .timeout(Duration::from_secs(2));
    let subscriber = NatsSubscriber::connect(&url, &topology, 16)
        .await
        .expect("connect the subscriber")
        .backoff(quick());
    let traffic = start(publisher, subscriber, TOPIC);

    traffic
        .wait("10 received", Duration::from_secs(10), |t| {
            t.received() >= 10
        })
        .await;
    let failed = traffic.failed();
    server.kill();
    // Longer than the publish time limit: a publish waiting for its ack fails by then.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(traffic.failed() > failed, "no batch failed while down");
    server.restart();
    let seen = traffic.received();
    traffic
        .wait("progress after the restart", Duration::from_secs(20), |t| {
            t.received() >= seen + 10
        })
        .await;

    // Losing the store loses what it held: only once everything published so far was
    // received is the loss the client's to survive, not the broker's to explain.
    traffic.paused.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(300)).await;
    traffic
        .wait(
            "the published so far received",
            Duration::from_secs(10),
            |t| t.received() == t.published(),
        )
        .await;
    server.kill();
    server.restart_with_fresh_store();
    traffic.paused.store(false, Ordering::SeqCst);
    all_received(&traffic).await;
    assert!(traffic.subscriber_ended.lock().unwrap().is_none());
}

// mutant: `NatsPublisher` refuses a subject whose stream was lost instead of declaring the
// stream again -> fails with "refused: no stream covers subject ..." (a relay would have
// parked a good row).
#[tokio::test]
async fn nats_publisher_declares_a_stream_lost_with_the_store_again() {
    let Some(TestBroker::Nats {
        topology, subject, ..
    }) = TestBroker::nats(Duration::from_secs(2))
    else {
        return;
    };
    let Some(mut server) = PrivateNats::start(require_all()) else {
        return;
    };
    let publisher = NatsPublisher::connect(&server.url(), &topology)
        .await
        .expect("connect the publisher")
        .route(move |_| subject.clone())
        .timeout(Duration::from_secs(2));
    server.kill();
    server.restart_with_fresh_store();
    let message = OutgoingMessage {
        id: unique(),
        topic: TOPIC.into(),
        key: None,
        payload: b"{}".to_vec(),
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        // Errors while the client reconnects are retried, as a relay would; a refusal is a
        // verdict on the message and fails the test.
        if let Ok(verdicts) = publisher
            .publish_confirmed(std::slice::from_ref(&message))
            .await
        {
            assert_eq!(verdicts, [Ok(())], "refused");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "never published after the restart"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
