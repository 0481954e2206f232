//! A configuration the broker refuses is a permanent error that says so, at connect and
//! later: a subscriber returns it instead of declaring the same refused objects forever, and
//! an inbox consumer stops with it. (A broker that is away is transient: see
//! broker_reconnect.rs.)
//!
//! Needs TEST_AMQP_URL and TEST_NATS_URL (`scripts/test` sets them).

mod pipeline;
mod process;

use std::time::Duration;

use pipeline::TestBroker;
use tower_idempotency::broker::{
    amqp::AmqpSubscriber,
    nats::{self, NatsPublisher, NatsSubscriber, NatsTopology},
    Backoff, BrokerError, Delivery, OutgoingMessage, Publisher, Subscriber,
};

/// A refused declaration, as the test expects it: permanent, and naming the broker.
fn assert_misconfigured(error: &BrokerError, broker: &str) {
    assert!(
        matches!(error, BrokerError::Misconfigured { .. }),
        "not Misconfigured: {error:?}"
    );
    assert!(error.is_permanent(), "{error:?}");
    assert!(error.to_string().starts_with(broker), "{error}");
}

// mutant: `failed` maps PRECONDITION_FAILED to a transient `Broker` error -> fails with
// "not Misconfigured: Broker { broker: \"amqp\", action: \"declare the topology\", ... }".
#[tokio::test]
async fn amqp_a_queue_declared_with_other_arguments_is_misconfigured() {
    let Some(broker) = TestBroker::amqp() else {
        return;
    };
    let TestBroker::Amqp { url, topology, .. } = &broker else {
        unreachable!()
    };
    let first = AmqpSubscriber::connect(url, topology, 1)
        .await
        .expect("the first declaration");
    let mut other = topology.clone();
    other.delivery_limit += 1;
    let error = AmqpSubscriber::connect(url, &other, 1)
        .await
        .err()
        .expect("RabbitMQ took a queue declared again with another delivery limit");
    assert_misconfigured(&error, "amqp");
    drop(first);
    broker.clean_up().await;
}

/// A topology whose stream would cover `subject`, which the stream of `broker` covers.
fn overlapping(broker: &TestBroker) -> (String, NatsTopology) {
    let TestBroker::Nats {
        url, ns, subject, ..
    } = broker
    else {
        unreachable!()
    };
    let topology = NatsTopology::new(
        format!("OVERLAP{ns}"),
        [subject.clone()],
        format!("overlap{ns}"),
    );
    (url.clone(), topology)
}

// mutant: `refuses` answers false (every JetStream answer transient) -> fails with
// "not Misconfigured: Broker { broker: \"nats\", action: \"declare the stream\", ... }".
#[tokio::test]
async fn nats_a_stream_whose_subjects_overlap_another_is_misconfigured_at_connect() {
    let Some(broker) = TestBroker::nats(Duration::from_secs(5)) else {
        return;
    };
    let TestBroker::Nats { url, topology, .. } = &broker else {
        unreachable!()
    };
    NatsSubscriber::connect(url, topology, 1)
        .await
        .expect("the first topology");
    let (url, overlap) = overlapping(&broker);
    let error = NatsSubscriber::connect(&url, &overlap, 1)
        .await
        .err()
        .expect("JetStream took a stream whose subjects overlap another's");
    assert_misconfigured(&error, "nats");
    let error = NatsPublisher::connect(&url, &overlap)
        .await
        .err()
        .expect("the publisher declared it");
    assert_misconfigured(&error, "nats");
    broker.clean_up().await;
}

// mutant: `NatsSubscriber::next` retries every failed declaration (the code before) -> fails
// with "next() still retrying after 20s".
#[tokio::test]
async fn nats_a_subscriber_whose_stream_can_no_longer_be_declared_stops_with_the_reason() {
    let Some(broker) = TestBroker::nats(Duration::from_secs(5)) else {
        return;
    };
    let (url, overlap) = overlapping(&broker);
    // The subscriber's own stream is the overlapping one; the test's topology takes its
    // subject once that stream is gone, so it can never be declared again.
    let mut subscriber = NatsSubscriber::connect(&url, &overlap, 1)
        .await
        .expect("subscribe")
        .idle_check(Duration::from_millis(500))
        .backoff(Backoff::new(
            Duration::from_millis(50),
            Duration::from_millis(200),
        ));
    let js = nats::connect(&url).await.expect("connect");
    js.delete_stream(&overlap.stream)
        .await
        .expect("delete the subscriber's stream");
    let TestBroker::Nats { topology, .. } = &broker else {
        unreachable!()
    };
    topology.declare(&js).await.expect("the other stream");
    let error = tokio::time::timeout(Duration::from_secs(20), subscriber.next())
        .await
        .expect("next() still retrying after 20s")
        .err()
        .expect("a delivery from a stream that is gone");
    assert_misconfigured(&error, "nats");
    broker.clean_up().await;
}

// mutant: no idle check (`next` waits on the pull for ever, the code before) -> fails with
// "no delivery after the consumer was deleted: Elapsed(())".
#[tokio::test]
async fn nats_a_subscriber_whose_consumer_was_deleted_declares_it_again_and_receives() {
    let Some(broker) = TestBroker::nats(Duration::from_secs(5)) else {
        return;
    };
    let TestBroker::Nats {
        url,
        topology,
        subject,
        ..
    } = &broker
    else {
        unreachable!()
    };
    let mut subscriber = NatsSubscriber::connect(url, topology, 1)
        .await
        .expect("subscribe")
        .idle_check(Duration::from_millis(500));
    let js = nats::connect(url).await.expect("connect");
    js.get_stream(&topology.stream)
        .await
        .expect("the stream")
        .delete_consumer(&topology.consumer)
        .await
        .expect("delete the consumer");
    let subject = subject.clone();
    let publisher = NatsPublisher::connect(url, topology)
        .await
        .expect("connect the publisher")
        .route(move |_| subject.clone());
    let message = OutgoingMessage {
        id: process::unique(),
        topic: pipeline::TOPIC.into(),
        key: None,
        payload: b"{}".to_vec(),
    };
    // The consumer declared again starts at the stream's first message: publish after it
    // exists, or before, and either way this message is delivered.
    let verdicts = publisher
        .publish_confirmed(std::slice::from_ref(&message))
        .await
        .expect("publish");
    assert_eq!(verdicts, [Ok(())]);
    let delivery = tokio::time::timeout(Duration::from_secs(20), subscriber.next())
        .await
        .expect("no delivery after the consumer was deleted")
        .expect("a delivery");
    assert_eq!(delivery.message_id(), Some(message.id.as_str()));
    delivery.ack().await.expect("ack");
    broker.clean_up().await;
}
