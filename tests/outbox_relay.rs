//! The outbox relay against real PostgreSQL, RabbitMQ and NATS JetStream: every committed row
//! reaches the broker once, rolled-back ones never, racing relays lose nothing, a crash
//! between publish and mark is absorbed (by the inbox on RabbitMQ, by `Nats-Msg-Id` on NATS),
//! a stopping relay sends the rows committed just before its shutdown, within a bound, a row
//! the broker refuses is parked after its attempts without holding back the rows after it, an
//! unreachable broker spends no row's attempts, and sent rows are purged under full load.
//!
//! Needs TEST_POSTGRES_URL plus TEST_AMQP_URL / TEST_NATS_URL (`scripts/test` sets them).

mod outbox_parking;
mod pipeline;
mod process;
#[path = "common/proxy.rs"]
mod proxy;

use std::{
    collections::HashSet,
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use async_trait::async_trait;
use outbox_parking::{
    a_refused_row_is_parked_and_holds_back_nothing, an_upgraded_table_parks_and_sends, one_refusal,
    three_refusals, POISON_TOPIC,
};
use pipeline::{each_broker, race_relays, tally, with_broker, TestBroker, WriteReceipt};
use process::unique;
use proxy::Proxy;
use tower_idempotency::{
    broker::{amqp::AmqpPublisher, BrokerError, OutgoingMessage, Publisher, Verdict},
    inbox::{Consumer, Outcome},
    outbox::{NewEvent, OutboxError, OutboxSource, PgOutbox, RefusalPolicy, Relay, RelayConfig},
};

const QUIET: Duration = Duration::from_millis(1500);

/// The broker got exactly the `committed` events, each of them once.
fn assert_each_published_once(ids: &[String], committed: &HashSet<String>) {
    let counts = tally(ids);
    assert_eq!(
        &counts.keys().cloned().collect::<HashSet<_>>(),
        committed,
        "the broker got exactly the committed events"
    );
    assert!(
        counts.values().all(|&n| n == 1),
        "an event was published twice: {counts:?}"
    );
}

#[tokio::test]
async fn relay_publishes_each_committed_row_once_and_rolled_back_rows_never() {
    each_broker(Duration::from_secs(30), |db, broker| async move {
        let mut committed = HashSet::new();
        for i in 0..30 {
            let (_, event) = db.pay(i % 4 != 3).await;
            if i % 4 != 3 {
                committed.insert(event);
            }
        }
        let relay = Relay::new(db.outbox.clone(), broker.publisher().await);
        let sent = relay.drain().await.expect("drain");
        assert_eq!(sent, committed.len(), "rows sent by the relay");
        assert_eq!(db.unsent().await, 0, "unsent rows after the drain");
        assert_eq!(
            relay.drain().await.expect("drain again"),
            0,
            "a second drain sends nothing"
        );

        assert_each_published_once(&broker.drain_ids(QUIET).await, &committed);
    })
    .await;
}

#[tokio::test]
async fn racing_relays_lose_no_row_and_publish_none_twice() {
    each_broker(Duration::from_secs(30), |db, broker| async move {
        let mut events = HashSet::new();
        for _ in 0..200 {
            events.insert(db.pay(true).await.1);
        }
        // Small batches, so the relays really interleave.
        let per_relay = race_relays(&db.outbox, &broker, 4, 5).await;
        assert_eq!(
            per_relay.iter().sum::<usize>(),
            events.len(),
            "rows sent: {per_relay:?}"
        );
        assert!(
            per_relay.iter().filter(|&&n| n > 0).count() > 1,
            "only one relay did any work, so nothing raced: {per_relay:?}"
        );
        assert_eq!(db.unsent().await, 0);
        assert_each_published_once(&broker.drain_ids(QUIET).await, &events);
    })
    .await;
}

/// Publishes, then fails as a relay would that died after the broker's confirmation and
/// before its commit.
struct DiesAfterPublish(Box<dyn Publisher>);

#[async_trait]
impl Publisher for DiesAfterPublish {
    async fn publish_confirmed(
        &self,
        messages: &[OutgoingMessage],
    ) -> Result<Vec<Verdict>, BrokerError> {
        self.0.publish_confirmed(messages).await?;
        Err(BrokerError::Closed { broker: "test" })
    }
}

#[tokio::test]
async fn a_crash_between_publish_and_mark_republishes_and_the_inbox_drops_the_copy() {
    each_broker(Duration::from_secs(30), |db, broker| async move {
        let mut payments = HashSet::new();
        for _ in 0..10 {
            payments.insert(db.pay(true).await.0);
        }
        let dying = Relay::new(
            db.outbox.clone(),
            DiesAfterPublish(broker.publisher().await),
        );
        assert!(dying.drain().await.is_err(), "the crash is reported");
        assert_eq!(db.unsent().await, 10, "nothing was marked sent");
        let relay = Relay::new(db.outbox.clone(), broker.publisher().await);
        assert_eq!(relay.drain().await.expect("drain"), 10, "published again");
        assert_eq!(db.unsent().await, 0);

        let consumer = Consumer::new(
            "receipts",
            db.inbox.clone(),
            WriteReceipt {
                delay: Duration::ZERO,
            },
        );
        let outcomes = tally(&broker.consume(&consumer, QUIET).await);
        assert_eq!(outcomes.get(&Outcome::Handled), Some(&10), "{outcomes:?}");
        match broker {
            // RabbitMQ, Kafka and a standard SQS queue have no server-side dedup: the copies
            // arrive and the inbox drops them.
            TestBroker::Amqp { .. } | TestBroker::Kafka { .. } | TestBroker::Sqs { .. } => {
                assert_eq!(outcomes.get(&Outcome::Duplicate), Some(&10), "{outcomes:?}")
            }
            // JetStream dropped the re-publish by its Nats-Msg-Id.
            TestBroker::Nats { .. } => {
                assert_eq!(outcomes.get(&Outcome::Duplicate), None, "{outcomes:?}")
            }
        }
        let receipts = db.receipts().await;
        assert_eq!(receipts.keys().cloned().collect::<HashSet<_>>(), payments);
        assert!(receipts.values().all(|&n| n == 1), "{receipts:?}");
    })
    .await;
}

#[tokio::test]
async fn sent_rows_are_purged_in_bounded_batches() {
    each_broker(Duration::from_secs(30), |db, broker| async move {
        for _ in 0..7 {
            db.pay(true).await;
        }
        Relay::new(db.outbox.clone(), broker.publisher().await)
            .drain()
            .await
            .expect("drain");
        let _ = broker.drain_ids(Duration::from_millis(300)).await;
        assert_eq!(
            db.outbox
                .purge_sent(Duration::from_secs(3600), 3)
                .await
                .unwrap(),
            0,
            "rows within the retention stay"
        );
        assert_eq!(
            db.outbox.purge_sent(Duration::ZERO, 3).await.unwrap(),
            3,
            "one bounded batch"
        );
        assert_eq!(db.outbox.purge_sent(Duration::ZERO, 10).await.unwrap(), 4);
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM tower_outbox")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert_eq!(rows, 0);
    })
    .await;
}

#[tokio::test]
async fn a_commit_wakes_the_relay_without_waiting_for_the_poll() {
    each_broker(Duration::from_secs(30), |db, broker| async move {
        // A table (so a NOTIFY channel) of its own: other tests' relays listen too.
        let outbox = PgOutbox::with_table(db.pool.clone(), &format!("outbox_{}", unique())).unwrap();
        outbox.migrate().await.unwrap();
        // Polling once an hour: only the NOTIFY sent at commit can start this batch.
        let config = RelayConfig {
            poll_interval: Duration::from_secs(3600),
            purge_every: Duration::from_secs(3600),
            ..RelayConfig::default()
        };
        let relay = Relay::new(outbox.clone(), broker.publisher().await).config(config);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let running = tokio::spawn(relay.run_until(async {
            let _ = stopped.await;
        }));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        // Wait until the relay listens (a commit before that is left to the poll).
        loop {
            let listening: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE query ILIKE 'LISTEN%' AND strpos(query, $1) > 0",
            )
            .bind(outbox.channel())
            .fetch_one(&db.pool)
            .await
            .unwrap();
            if listening > 0 {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "the relay never listened");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let event = NewEvent::new(pipeline::TOPIC, r#"{"payment_id": "p"}"#);
        let mut tx = db.pool.begin().await.unwrap();
        outbox.enqueue(&mut tx, &event).await.unwrap();
        tx.commit().await.unwrap();
        while outbox.unsent().await.unwrap() > 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the commit did not wake the relay"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(broker.drain_ids(QUIET).await, [event.id]);
        stop.send(()).unwrap();
        running.await.unwrap();
    })
    .await;
}

/// The PostgreSQL outbox without its `LISTEN` wake-up: a relay on it only polls, as on MySQL
/// and SQLite, so between two polls nothing but the shutdown signal ends its wait.
#[derive(Clone)]
struct PollsOnly(PgOutbox);

#[async_trait]
impl OutboxSource for PollsOnly {
    async fn relay_batch(
        &self,
        publisher: &dyn Publisher,
        limit: u32,
    ) -> Result<usize, OutboxError> {
        self.0.relay_batch(publisher, limit).await
    }

    async fn purge_sent(&self, older_than: Duration, limit: u32) -> Result<u64, OutboxError> {
        self.0.purge_sent(older_than, limit).await
    }

    async fn unsent(&self) -> Result<u64, OutboxError> {
        self.0.unsent().await
    }
}

/// Never confirms a publish: a broker that is down without closing the connection.
struct NeverConfirms;

#[async_trait]
impl Publisher for NeverConfirms {
    async fn publish_confirmed(&self, _: &[OutgoingMessage]) -> Result<Vec<Verdict>, BrokerError> {
        std::future::pending().await
    }
}

/// Polling once an hour, purging never: nothing but the shutdown ends the relay's first wait.
fn waits_for_shutdown() -> RelayConfig {
    RelayConfig {
        batch: 2,
        poll_interval: Duration::from_secs(3600),
        purge_every: Duration::from_secs(3600),
        ..RelayConfig::default()
    }
}

#[tokio::test]
async fn rows_committed_just_before_shutdown_are_sent_before_the_relay_stops() {
    each_broker(Duration::from_secs(30), |db, broker| async move {
        let relay = Relay::new(PollsOnly(db.outbox.clone()), broker.publisher().await)
            .config(waits_for_shutdown());
        let mut committed = HashSet::new();
        // The relay first polls the shutdown future once its first drain found nothing and it
        // waits: the future commits the rows then, after the relay's last batch, and completes.
        tokio::time::timeout(
            Duration::from_secs(20),
            relay.run_until(async {
                for _ in 0..5 {
                    committed.insert(db.pay(true).await.1);
                }
            }),
        )
        .await
        .expect("run_until did not return after the shutdown signal");
        assert_eq!(
            db.unsent().await,
            0,
            "rows committed just before the shutdown were left unsent"
        );
        assert_each_published_once(&broker.drain_ids(QUIET).await, &committed);
    })
    .await;
}

#[tokio::test]
async fn a_broker_that_never_confirms_holds_the_shutdown_no_longer_than_shutdown_drain() {
    each_broker(Duration::from_secs(30), |db, broker| async move {
        let config = RelayConfig {
            shutdown_drain: Duration::from_millis(300),
            ..waits_for_shutdown()
        };
        // The rows are there before the relay starts: its first batch hangs on the publish,
        // and the shutdown comes while that drain is under way.
        for _ in 0..3 {
            db.pay(true).await;
        }
        let relay = Relay::new(db.outbox.clone(), NeverConfirms).config(config);
        tokio::time::timeout(
            Duration::from_secs(10),
            relay.run_until(tokio::time::sleep(Duration::from_millis(200))),
        )
        .await
        .expect("a broker that never confirms held the shutdown");
        assert_eq!(db.unsent().await, 3, "the rows stay unsent, none is lost");
        // The next relay sends them, once the cut-off batch's rollback released their locks.
        let next = Relay::new(db.outbox.clone(), broker.publisher().await);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let mut sent = 0;
        while sent < 3 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the next relay sent {sent} of the 3 rows"
            );
            sent += next.drain().await.expect("drain");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(db.unsent().await, 0);
    })
    .await;
}

/// Nothing to send, and a purge that never finishes (a stalled database): it says when the
/// purge began, so the test can signal shutdown while the relay is inside it.
struct PurgeHangs(Arc<tokio::sync::Notify>);

#[async_trait]
impl OutboxSource for PurgeHangs {
    async fn relay_batch(&self, _: &dyn Publisher, _: u32) -> Result<usize, OutboxError> {
        Ok(0)
    }

    async fn purge_sent(&self, _: Duration, _: u32) -> Result<u64, OutboxError> {
        self.0.notify_one();
        std::future::pending().await
    }

    async fn unsent(&self) -> Result<u64, OutboxError> {
        Ok(0)
    }
}

#[tokio::test]
async fn a_shutdown_during_a_purge_stops_the_relay() {
    let purging = Arc::new(tokio::sync::Notify::new());
    let relay = Relay::new(PurgeHangs(purging.clone()), NeverConfirms).config(RelayConfig {
        purge_every: Duration::ZERO,
        ..waits_for_shutdown()
    });
    // The shutdown completes once the relay is inside its first purge: only a relay that
    // watches the shutdown while purging returns; the guard below only turns a hang into a
    // failure.
    tokio::time::timeout(Duration::from_secs(20), relay.run_until(purging.notified()))
        .await
        .expect("run_until did not return: the purge under way held the shutdown");
}

// mutant: `settle` never parks (`let parked = false;`) -> fails with "the refused row was
// never parked"; the code before (a refusal left the row first in line, uncounted) fails the
// same way.
#[tokio::test]
async fn a_refused_row_is_parked_after_its_attempts_and_the_rows_after_it_are_sent() {
    each_broker(Duration::from_secs(30), |db, broker| async move {
        let parking = (
            db.pool.clone(),
            db.outbox.clone().refusals(three_refusals()),
        );
        a_refused_row_is_parked_and_holds_back_nothing(&parking, &broker, 20).await;
    })
    .await;
}

/// `host:port` of an `amqp://user:pass@host:port/vhost` URL, and the URL with another address.
fn amqp_through(url: &str, to: std::net::SocketAddr) -> ((String, u16), String) {
    let after_scheme = url.split_once("://").expect("a URL").1;
    let authority_start = after_scheme.find('@').map_or(0, |at| at + 1);
    let rest = &after_scheme[authority_start..];
    let authority = rest.split('/').next().expect("an authority");
    let (host, port) = authority.rsplit_once(':').unwrap_or((authority, "5672"));
    let through = url.replacen(authority, &to.to_string(), 1);
    ((host.to_owned(), port.parse().expect("a port")), through)
}

// mutant: `publish` answers a BrokerError with a refusal for every message (an outage counted
// as the rows' attempts) -> fails with "(parked rows, attempts spent): left (11, 11)".
#[tokio::test]
async fn batches_that_fail_while_the_broker_is_unreachable_spend_no_attempts() {
    let Some(broker) = TestBroker::amqp() else {
        return;
    };
    with_broker(broker, |db, broker| async move {
        let TestBroker::Amqp { url, topology, .. } = &broker else {
            unreachable!()
        };
        // The proxy's address is known only once it listens: start it on the real broker.
        let ((host, port), _) = amqp_through(url, "127.0.0.1:1".parse().unwrap());
        let proxy = Proxy::start(&host, port).await;
        let (_, through) = amqp_through(url, proxy.addr());
        let publisher = AmqpPublisher::connect(&through, topology)
            .await
            .expect("connect through the proxy")
            .timeout(Duration::from_millis(500));
        // One refusal parks: a single outage counted as an attempt would park every row.
        let outbox = db.outbox.clone().refusals(RefusalPolicy {
            max_attempts: 1,
            ..RefusalPolicy::default()
        });
        let mut tx = db.pool.begin().await.unwrap();
        outbox
            .enqueue(&mut tx, &NewEvent::new(POISON_TOPIC, "{}"))
            .await
            .unwrap();
        tx.commit().await.unwrap();
        for _ in 0..10 {
            db.pay(true).await;
        }

        proxy.cut();
        let relay = Relay::new(outbox.clone(), publisher).config(RelayConfig {
            batch: 4,
            ..RelayConfig::default()
        });
        let mut failed = 0;
        for _ in 0..5 {
            failed += usize::from(relay.drain().await.is_err());
        }
        let spent: (i64, i64) = sqlx::query_as(
            "SELECT count(parked_at), coalesce(sum(attempts), 0)::bigint FROM tower_outbox",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert_eq!(spent, (0, 0), "(parked rows, attempts spent)");
        assert_eq!(failed, 5, "every batch failed: the broker was unreachable");
        assert_eq!(outbox.unsent().await.unwrap(), 11);

        // Back: the refusal is a verdict about its row now, and the rest is sent.
        proxy.restore();
        let relay = Relay::new(outbox.clone(), broker.publisher().await);
        assert_eq!(relay.drain().await.unwrap(), 11);
        assert_eq!(outbox.unsent().await.unwrap(), 0);
        assert_eq!(outbox.parked_count().await.unwrap(), 1);
    })
    .await;
}

/// The real broker a little slowly (a broker farther away), counting the messages it took.
struct Slow {
    inner: Box<dyn Publisher>,
    took: Arc<AtomicUsize>,
}

#[async_trait]
impl Publisher for Slow {
    async fn publish_confirmed(
        &self,
        messages: &[OutgoingMessage],
    ) -> Result<Vec<Verdict>, BrokerError> {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let verdicts = self.inner.publish_confirmed(messages).await?;
        let took = verdicts.iter().filter(|v| v.is_ok()).count();
        self.took.fetch_add(took, Ordering::Relaxed);
        Ok(verdicts)
    }
}

// mutant: `drain_until` ignores `purge_at` (the purge waits for an empty batch, as before) ->
// fails with "sent rows grew to 740 of 750 sent".
// The load lasts OUTBOX_LOAD_SECS (3 s by default; scripts/bench.d/outbox-purge.sh: 600 s).
#[tokio::test]
async fn sent_rows_stay_bounded_while_every_batch_is_full() {
    let load_secs: u64 = std::env::var("OUTBOX_LOAD_SECS")
        .ok()
        .and_then(|secs| secs.parse().ok())
        .unwrap_or(3);
    let Some(broker) = TestBroker::amqp() else {
        return;
    };
    with_broker(broker, |db, broker| async move {
        let stop = Arc::new(AtomicBool::new(false));
        // Keeps a backlog of at least 200 rows, so no batch of the relay comes back short
        // and its drain never ends.
        let producer = {
            let (pool, outbox, stop) = (db.pool.clone(), db.outbox.clone(), stop.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    if outbox.unsent().await.unwrap() >= 300 {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                    let mut tx = pool.begin().await.unwrap();
                    for _ in 0..50 {
                        let (_, event) = pipeline::payment_event();
                        outbox.enqueue(&mut tx, &event).await.unwrap();
                    }
                    tx.commit().await.unwrap();
                }
            })
        };
        while db.unsent().await < 300 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let took = Arc::new(AtomicUsize::new(0));
        let publisher = Slow {
            inner: broker.publisher().await,
            took: took.clone(),
        };
        let relay = Relay::new(db.outbox.clone(), publisher).config(RelayConfig {
            batch: 10,
            poll_interval: Duration::from_secs(3600),
            sent_retention: Duration::ZERO,
            purge_every: Duration::from_millis(200),
            shutdown_drain: Duration::ZERO,
            ..RelayConfig::default()
        });
        let (stop_relay, stopped) = tokio::sync::oneshot::channel::<()>();
        let running = tokio::spawn(relay.run_until(async {
            let _ = stopped.await;
        }));
        let (mut most_sent, mut least_unsent, mut most_rows) = (0, i64::MAX, 0);
        let until = tokio::time::Instant::now() + Duration::from_secs(load_secs);
        while tokio::time::Instant::now() < until {
            let (sent, unsent): (i64, i64) = sqlx::query_as(
                "SELECT count(sent_at), count(*) - count(sent_at) FROM tower_outbox",
            )
            .fetch_one(&db.pool)
            .await
            .unwrap();
            most_sent = most_sent.max(sent);
            least_unsent = least_unsent.min(unsent);
            most_rows = most_rows.max(sent + unsent);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        stop_relay.send(()).unwrap();
        running.await.unwrap();
        stop.store(true, Ordering::Relaxed);
        producer.await.unwrap();

        let took = took.load(Ordering::Relaxed) as i64;
        // One line for scripts/bench.d/outbox-purge.sh.
        eprintln!(
            "outbox-purge: secs={load_secs} sent={took} most_sent_rows={most_sent} \
             most_rows={most_rows} least_backlog={least_unsent}"
        );
        assert!(
            least_unsent >= 10,
            "the backlog ran dry ({least_unsent} rows): the relay was not under full load"
        );
        assert!(took >= 300, "the relay sent only {took} rows");
        assert!(
            most_sent * 3 < took,
            "sent rows grew to {most_sent} of {took} sent: the purge did not run under load"
        );
    })
    .await;
}

// mutant: `migrate` without the added columns (PostgreSQL `upgrades` keeps `ordering_key`
// only) -> fails with `column "attempts" does not exist`.
#[tokio::test]
async fn migrate_upgrades_a_table_of_the_previous_release() {
    let Some(broker) = TestBroker::amqp() else {
        return;
    };
    with_broker(broker, |db, broker| async move {
        let table = format!("outbox_v1_{}", unique());
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE {table} (seq BIGSERIAL PRIMARY KEY, id TEXT COLLATE \"C\" NOT NULL UNIQUE,
                 topic TEXT NOT NULL, payload BYTEA NOT NULL,
                 created_at TIMESTAMPTZ NOT NULL DEFAULT now(), sent_at TIMESTAMPTZ,
                 ordering_key TEXT)"
        )))
        .execute(&db.pool)
        .await
        .unwrap();
        let outbox = PgOutbox::with_table(db.pool.clone(), &table)
            .unwrap()
            .refusals(one_refusal());
        outbox.migrate().await.unwrap();
        an_upgraded_table_parks_and_sends(&(db.pool.clone(), outbox), &broker).await;
    })
    .await;
}

/// A broker that fails every publish at once (its connection gone), counting the tries.
struct Fails(Arc<AtomicUsize>);

#[async_trait]
impl Publisher for Fails {
    async fn publish_confirmed(&self, _: &[OutgoingMessage]) -> Result<Vec<Verdict>, BrokerError> {
        self.0.fetch_add(1, Ordering::Relaxed);
        Err(BrokerError::Closed { broker: "test" })
    }
}

// mutant: the relay waits `retry_delay` after every failure (no doubling, as before) -> fails
// with "27 tries in 1.5 s: the relay did not back off". Mutant: a commit's wake-up ends the
// backoff's wait -> fails with "47 tries in 1.5 s" (the test commits every 20 ms, as a busy
// service would).
#[tokio::test]
async fn a_relay_backs_off_while_batches_keep_failing() {
    let Some(broker) = TestBroker::amqp() else {
        return;
    };
    with_broker(broker, |db, _| async move {
        db.pay(true).await;
        let tries = Arc::new(AtomicUsize::new(0));
        let relay = Relay::new(db.outbox.clone(), Fails(tries.clone())).config(RelayConfig {
            retry_delay: Duration::from_millis(50),
            retry_ceiling: Duration::from_millis(400),
            shutdown_drain: Duration::ZERO,
            ..waits_for_shutdown()
        });
        let mut committed = 1;
        let commits = async {
            let until = tokio::time::Instant::now() + Duration::from_millis(1500);
            while tokio::time::Instant::now() < until {
                db.pay(true).await;
                committed += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        relay.run_until(commits).await;
        // Waits of 25-50, 50-100, 100-200, 200-400 ms, then 200-400 ms each: 5 to 11 tries
        // in 1.5 s; a fixed 50 ms wait makes about 30.
        let tries = tries.load(Ordering::Relaxed);
        assert!(
            (3..=14).contains(&tries),
            "{tries} tries in 1.5 s: the relay did not back off"
        );
        assert_eq!(db.unsent().await, committed, "nothing was lost");
    })
    .await;
}
