//! Every duration a builder or a configuration takes, at both ends: `Duration::ZERO`, and
//! `Duration::MAX`, which users write for "no limit". Each gives either a typed error from the
//! builder that refuses it, or a setting that works (saturated where the clock cannot hold it):
//! never a panic, whether at build time, on the first request, or in a background task.
//!
//! The relay and consumer rows need TEST_POSTGRES_URL and TEST_NATS_URL.

mod common;
mod pipeline;
mod process;

use std::{panic::AssertUnwindSafe, time::Duration};

use futures_util::FutureExt;
use http::StatusCode;
use pipeline::{with_broker, TestBroker, WriteReceipt};
use tower_idempotency::{
    broker::{nats::NatsSubscriber, Subscriber},
    engine::ConfigError,
    inbox::{Consumer, ConsumerConfig, InboxClaim, InboxStore, Outcome},
    outbox::{Relay, RelayConfig},
    store::{spawn_purger, MemoryStore},
    version::{retry_on_conflict, MemoryVersioned, RetryPolicy},
    Engine, IdempotencyLayer, InProgressPolicy,
};

const EXTREMES: [Duration; 2] = [Duration::ZERO, Duration::MAX];

/// What a row must do at one extreme.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// The builder accepts it and the layer protects requests with it.
    Works,
    /// The builder refuses it with a [`ConfigError`].
    Refused,
}

use Expect::{Refused, Works};

/// A layer configured with one duration, or the builder's refusal.
type Configure = fn(Duration) -> Result<IdempotencyLayer, ConfigError>;

fn engine(
    configure: impl FnOnce(
        tower_idempotency::engine::EngineBuilder,
    ) -> tower_idempotency::engine::EngineBuilder,
) -> Result<IdempotencyLayer, ConfigError> {
    configure(Engine::builder(MemoryStore::new()))
        .build()
        .map(IdempotencyLayer::from_engine)
}

/// The layer's and the engine's durations: name, setter, what ZERO and MAX must do.
const LAYER_AND_ENGINE: &[(&str, Configure, [Expect; 2])] = &[
    (
        "IdempotencyLayer::detach_limits lifetime",
        |d| Ok(IdempotencyLayer::new(MemoryStore::new()).detach_limits(8, d)),
        [Works, Works],
    ),
    (
        "EngineBuilder::lease",
        |d| engine(|b| b.lease(d)),
        [Refused, Refused],
    ),
    (
        "EngineBuilder::retention",
        |d| engine(|b| b.retention(d)),
        [Refused, Refused],
    ),
    (
        "EngineBuilder::retry_after",
        |d| engine(|b| b.retry_after(d)),
        [Works, Refused],
    ),
    (
        "EngineBuilder::store_timeout",
        |d| engine(|b| b.store_timeout(d)),
        [Refused, Refused],
    ),
    (
        "EngineBuilder::poll_when_notified",
        |d| engine(|b| b.poll_when_notified(d)),
        [Refused, Refused],
    ),
    (
        "EngineBuilder::in_progress(Wait { timeout })",
        |d| engine(|b| b.in_progress(InProgressPolicy::Wait { timeout: d })),
        [Works, Refused],
    ),
];

/// A keyed request runs once and its retry is replayed.
async fn protects(layer: IdempotencyLayer) {
    let runs = common::Runs::default();
    let app = common::app(layer, runs.clone());
    let first = common::send(&app, common::post_req("/pay", Some("k-1"), "{}")).await;
    let again = common::send(&app, common::post_req("/pay", Some("k-1"), "{}")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(
        (again.status, &again.body),
        (first.status, &first.body),
        "the retry is replayed"
    );
    assert_eq!(runs.count(), 1);
}

#[tokio::test]
async fn layer_and_engine_durations_give_a_working_layer_or_a_typed_error() {
    let mut wrong = Vec::new();
    for (name, configure, expected) in LAYER_AND_ENGINE {
        for (extreme, expected) in EXTREMES.into_iter().zip(expected) {
            let got = AssertUnwindSafe(async {
                match configure(extreme) {
                    Ok(layer) => {
                        protects(layer).await;
                        Works
                    }
                    Err(error) => {
                        assert!(!error.to_string().is_empty());
                        Refused
                    }
                }
            })
            .catch_unwind()
            .await;
            match got {
                Ok(got) if got == *expected => {}
                Ok(got) => wrong.push(format!(
                    "{name}({extreme:?}): {got:?}, expected {expected:?}"
                )),
                Err(_) => wrong.push(format!("{name}({extreme:?}): panicked")),
            }
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
}

/// The purger's period: raised to a millisecond at ZERO, and at MAX the task must survive its
/// first tick (it computes the next one then).
#[tokio::test]
async fn the_purgers_period_at_either_end_keeps_the_purger_running() {
    for every in EXTREMES {
        let purger = spawn_purger(MemoryStore::new(), every, 10);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            !purger.is_finished(),
            "spawn_purger({every:?}) ended (panicked)"
        );
        purger.abort();
    }
}

/// `retry_on_conflict`'s delays: a conflict then a success, at either end of each delay. The
/// clock is paused, so a long jittered wait is skipped rather than slept.
#[tokio::test(start_paused = true)]
async fn retry_delays_at_either_end_retry_and_succeed() {
    type Set = fn(RetryPolicy, Duration) -> RetryPolicy;
    let rows: [(&str, Set); 2] = [
        ("base_delay", |p, d| p.base_delay(d)),
        ("max_delay", |p, d| p.max_delay(d)),
    ];
    for (name, set) in rows {
        for extreme in EXTREMES {
            let counters = MemoryVersioned::new();
            let _ = counters.insert_new("n", 0u64);
            let stale = counters.get(&"n").unwrap().version;
            let mut first = true;
            let policy = set(RetryPolicy::default(), extreme);
            let outcome = retry_on_conflict(&policy, || {
                // The first attempt uses a version another writer already moved past.
                let version = if std::mem::take(&mut first) {
                    let _ = counters.update_if_version(&"n", stale, |n| *n += 1);
                    stale
                } else {
                    counters.get(&"n").unwrap().version
                };
                let outcome = counters.update_if_version(&"n", version, |n| *n += 1);
                async move { Ok::<_, std::convert::Infallible>(outcome) }
            })
            .await
            .unwrap();
            assert!(outcome.is_updated(), "{name}({extreme:?}): {outcome:?}");
        }
    }
}

/// `PgInbox::lock_timeout`: PostgreSQL takes at most `i32::MAX` milliseconds.
#[tokio::test]
async fn the_inbox_lock_timeout_at_either_end_still_claims() {
    let Some(broker) = TestBroker::nats(Duration::from_secs(30)) else {
        return;
    };
    with_broker(broker, |db, _| async move {
        for (i, extreme) in EXTREMES.into_iter().enumerate() {
            let inbox = db.inbox.clone().lock_timeout(extreme);
            let mut tx = inbox.pool().begin().await.unwrap();
            let claim = inbox.claim(&mut tx, "receipts", &format!("m-{i}")).await;
            assert!(
                matches!(claim, Ok(InboxClaim::New)),
                "lock_timeout({extreme:?}): {claim:?}"
            );
        }
    })
    .await;
}

/// One field of a [`RelayConfig`].
type RelayField = fn(&mut RelayConfig, Duration);

/// The relay at either end of each of its durations: it sends the row committed before it
/// started, and stops when asked.
#[tokio::test]
async fn relay_durations_at_either_end_send_and_stop() {
    let Some(broker) = TestBroker::nats(Duration::from_secs(30)) else {
        return;
    };
    let rows: [(&str, RelayField); 6] = [
        ("poll_interval", |c, d| c.poll_interval = d),
        ("retry_delay", |c, d| c.retry_delay = d),
        ("retry_ceiling", |c, d| c.retry_ceiling = d),
        ("sent_retention", |c, d| c.sent_retention = d),
        ("purge_every", |c, d| c.purge_every = d),
        ("shutdown_drain", |c, d| c.shutdown_drain = d),
    ];
    with_broker(broker, |db, broker| async move {
        let mut wrong = Vec::new();
        for (name, set) in rows {
            for extreme in EXTREMES {
                db.pay(true).await;
                let mut config = RelayConfig::default();
                set(&mut config, extreme);
                let relay = Relay::new(db.outbox.clone(), broker.publisher().await).config(config);
                let run = relay.run_until(tokio::time::sleep(Duration::from_millis(300)));
                let ran = tokio::time::timeout(
                    Duration::from_secs(10),
                    AssertUnwindSafe(run).catch_unwind(),
                )
                .await;
                match ran {
                    Ok(Ok(())) if db.unsent().await == 0 => {}
                    Ok(Ok(())) => wrong.push(format!("{name}({extreme:?}): the row was not sent")),
                    Ok(Err(_)) => wrong.push(format!("{name}({extreme:?}): panicked")),
                    Err(_) => wrong.push(format!("{name}({extreme:?}): did not stop")),
                }
            }
        }
        assert!(wrong.is_empty(), "{wrong:#?}");
    })
    .await;
}

/// One field of a [`ConsumerConfig`].
type ConsumerField = fn(&mut ConsumerConfig, Duration);

/// The consumer at either end of each of its durations: a published payment gets its one
/// receipt, and the consumer stops when asked.
#[tokio::test]
async fn consumer_durations_at_either_end_handle_the_message_and_stop() {
    let Some(broker) = TestBroker::nats(Duration::from_secs(30)) else {
        return;
    };
    let rows: [(&str, ConsumerField); 5] = [
        ("retry_delay", |c, d| c.retry_delay = d),
        ("busy_pause", |c, d| c.busy_pause = d),
        ("busy_patience", |c, d| c.busy_patience = d),
        ("retention", |c, d| c.retention = d),
        ("purge_every", |c, d| c.purge_every = d),
    ];
    with_broker(broker.clone(), |db, _| async move {
        let TestBroker::Nats { url, topology, .. } = &broker else {
            unreachable!("a NATS broker")
        };
        let mut wrong = Vec::new();
        for (name, set) in rows {
            for extreme in EXTREMES {
                let payment = format!("{name}-{}", extreme.as_secs());
                let body = serde_json::json!({ "payment_id": payment }).to_string();
                broker.publish_raw(Some(&payment), body.as_bytes()).await;
                let mut config = ConsumerConfig::default();
                set(&mut config, extreme);
                let consumer = Consumer::with_config(
                    "receipts",
                    db.inbox.clone(),
                    WriteReceipt {
                        delay: Duration::ZERO,
                    },
                    config,
                );
                let subscriber = NatsSubscriber::connect(url, topology, 4).await.unwrap();
                let receipts = || async { db.receipts().await.get(&payment).copied() };
                let handled = async {
                    while receipts().await.is_none() {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                };
                let run = consumer.run_until(subscriber, handled);
                let ran = tokio::time::timeout(
                    Duration::from_secs(10),
                    AssertUnwindSafe(run).catch_unwind(),
                )
                .await;
                match ran {
                    Ok(Ok(Ok(()))) if receipts().await == Some(1) => {}
                    Ok(Ok(result)) => wrong.push(format!(
                        "{name}({extreme:?}): {result:?}, receipts {:?}",
                        receipts().await
                    )),
                    Ok(Err(_)) => wrong.push(format!("{name}({extreme:?}): panicked")),
                    Err(_) => {
                        wrong.push(format!("{name}({extreme:?}): did not handle the message"))
                    }
                }
            }
        }
        assert!(wrong.is_empty(), "{wrong:#?}");
    })
    .await;
}

/// `busy_pause` is only slept while another copy holds the message: at MAX the pause must
/// still end within `busy_patience`, giving the message back, rather than sleep forever.
#[tokio::test]
async fn a_busy_pause_at_either_end_gives_the_message_back_within_the_patience() {
    let Some(broker) = TestBroker::nats(Duration::from_secs(30)) else {
        return;
    };
    with_broker(broker.clone(), |db, _| async move {
        let TestBroker::Nats { url, topology, .. } = &broker else {
            unreachable!("a NATS broker")
        };
        for extreme in EXTREMES {
            let payment = format!("busy-{}", extreme.as_secs());
            let body = serde_json::json!({ "payment_id": payment }).to_string();
            broker.publish_raw(Some(&payment), body.as_bytes()).await;
            // Another copy holds the message's inbox row for the whole test.
            let mut holder = db.inbox.pool().begin().await.unwrap();
            let claim = db.inbox.claim(&mut holder, "receipts", &payment).await;
            assert!(matches!(claim, Ok(InboxClaim::New)), "{claim:?}");
            let config = ConsumerConfig {
                busy_pause: extreme,
                busy_patience: Duration::from_millis(500),
                ..ConsumerConfig::default()
            };
            let consumer = Consumer::with_config(
                "receipts",
                db.inbox.clone(),
                WriteReceipt {
                    delay: Duration::ZERO,
                },
                config,
            );
            let mut subscriber = NatsSubscriber::connect(url, topology, 4).await.unwrap();
            let delivery = subscriber.next().await.unwrap();
            let outcome = tokio::time::timeout(
                Duration::from_secs(10),
                AssertUnwindSafe(consumer.process(&delivery)).catch_unwind(),
            )
            .await;
            assert!(
                matches!(outcome, Ok(Ok(Outcome::Retried))),
                "busy_pause({extreme:?}): {:?}",
                outcome.map(|o| o.ok())
            );
            holder.rollback().await.unwrap();
            subscriber.close().await;
        }
    })
    .await;
}
