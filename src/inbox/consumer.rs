use std::{future::Future, sync::Arc, time::Duration};

use async_trait::async_trait;
use tokio::{sync::watch, task::JoinSet, time::Instant};

use super::{InboxClaim, InboxError, InboxStore};
use crate::broker::error_chain;
use crate::broker::{Backoff, BrokerError, Delivery, Subscriber};
use crate::BoxError;

/// A decoded message, as the [`Handler`] sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    /// The broker message id (RabbitMQ `message_id`, NATS `Nats-Msg-Id`).
    pub id: String,
    /// The body, parsed as JSON.
    pub payload: serde_json::Value,
    /// Which run of the handler this is, counting from 1: one more than the handler failures
    /// the inbox counted for this message (read only on a redelivery). Deliveries that failed
    /// for the database's or the broker's sake do not count.
    pub attempt: u32,
}

/// Why a handler did not handle a message. Its transaction is rolled back either way.
#[derive(Debug, thiserror::Error)]
pub enum HandlerError {
    /// A failure that may pass (a timeout, a service down): the message is delivered again,
    /// up to [`ConsumerConfig::max_attempts`] failures, then dead-lettered. A source that
    /// says the database could not be reached (a sqlx I/O, TLS, pool or connection error) is
    /// no failure of the handler: the message is held and tried again like any other
    /// outage. Nor is a source that says the database rolled the transaction back by itself
    /// (SQLSTATE `40001` or `40P01`: a deadlock's victim, a serialization failure, a Galera
    /// certification failure or brute-force abort): the claim went with it, and the message
    /// is claimed again at once, without spending an attempt. Keep sqlx's error as the
    /// source (`HandlerError::Retry(error.into())`) so the consumer can tell.
    #[error("handler failed; the message will be retried")]
    Retry(#[source] BoxError),
    /// The message can never be handled (a field missing, a wrong type): dead-letter it now.
    #[error("message rejected: {0}")]
    Reject(String),
}

/// Handles one message inside the consumer's transaction. Write through `conn` only: those
/// writes commit together with the inbox claim, or not at all.
#[async_trait]
pub trait Handler<DB: sqlx::Database>: Send + Sync + 'static {
    /// Handles `message`; runs at most once per committed message id and consumer name.
    async fn handle(
        &self,
        conn: &mut DB::Connection,
        message: &Message,
    ) -> Result<(), HandlerError>;
}

/// How a [`Consumer`] works.
#[derive(Debug, Clone)]
pub struct ConsumerConfig {
    /// Deliveries handled at once (default 8). Use it as the broker prefetch too.
    pub concurrency: usize,
    /// Handler failures of one message before it is dead-lettered (default 5). They are
    /// counted in the database ([`InboxStore::count_failure`]), so they survive
    /// redeliveries and restarts; the database or the broker failing counts nothing.
    pub max_attempts: u32,
    /// Delay before a failed message is delivered again (default 1 s).
    pub retry_delay: Duration,
    /// How long a delivery is held while the database cannot be reached (a failed `BEGIN`,
    /// claim or `COMMIT`, a pool timeout), tried again after each wait of `outage_backoff`,
    /// before it is given back to the broker, which delivers it again (default 60 s). The
    /// deliveries held fill the consumer's concurrency, so no new ones are taken meanwhile:
    /// an outage costs latency, never an attempt or a dead letter.
    pub outage_patience: Duration,
    /// The waits between two tries while the database cannot be reached (default 100 ms,
    /// doubling up to 5 s, jittered).
    pub outage_backoff: Backoff,
    /// First pause after a [`Busy`](InboxClaim::Busy) claim, or after a transaction the
    /// database rolled back by itself (a lost race); it doubles up to 1 s (default 50 ms),
    /// and no pause lasts past `busy_patience`.
    pub busy_pause: Duration,
    /// How long a busy copy, or one that keeps losing races, keeps looking before it gives
    /// the message back to the broker, uncounted (default 60 s).
    pub busy_patience: Duration,
    /// How long message ids are kept (default 7 days).
    pub retention: Duration,
    /// How often ids past the retention are purged (default 1 minute), 1000 rows at a time.
    pub purge_every: Duration,
}

impl Default for ConsumerConfig {
    fn default() -> Self {
        Self {
            concurrency: 8,
            max_attempts: 5,
            retry_delay: Duration::from_secs(1),
            outage_patience: Duration::from_secs(60),
            outage_backoff: Backoff::default(),
            busy_pause: Duration::from_millis(50),
            busy_patience: Duration::from_secs(60),
            retention: Duration::from_secs(7 * 24 * 3600),
            purge_every: Duration::from_secs(60),
        }
    }
}

/// What became of one delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// The handler ran and its transaction committed; acked.
    Handled,
    /// A copy was handled before; nothing ran; acked.
    Duplicate,
    /// Poison (not JSON, no id), rejected by the handler, or out of attempts.
    DeadLettered,
    /// Given back to the broker for a later delivery (a handler failure, a copy busy too
    /// long, a database out of reach for longer than the outage patience).
    Retried,
    /// Settling with the broker failed; the broker delivers it again.
    Unsettled,
}

/// Runs a [`Handler`] for every delivery of a [`Subscriber`], through an inbox.
pub struct Consumer<I, H> {
    inner: Arc<Inner<I, H>>,
}

struct Inner<I, H> {
    name: String,
    inbox: I,
    handler: H,
    config: ConsumerConfig,
}

impl<I, H> Clone for Consumer<I, H> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

const PURGE_BATCH: u32 = 1000;

/// The longest pause between two looks at a message another copy holds.
const MAX_BUSY_PAUSE: Duration = Duration::from_secs(1);

impl<I: InboxStore, H: Handler<I::Database>> Consumer<I, H> {
    /// A consumer named `name` (message ids are deduplicated per name) with the default
    /// [`ConsumerConfig`].
    pub fn new(name: impl Into<String>, inbox: I, handler: H) -> Self {
        Self::with_config(name, inbox, handler, ConsumerConfig::default())
    }

    /// A consumer with its own configuration.
    pub fn with_config(
        name: impl Into<String>,
        inbox: I,
        handler: H,
        config: ConsumerConfig,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                name: name.into(),
                inbox,
                handler,
                config,
            }),
        }
    }

    /// Takes deliveries until `shutdown` completes, handles up to `concurrency` at once, then
    /// waits for those in flight. Purges old message ids on the way. Returns an error when
    /// the subscription ends (reconnect and call again).
    pub async fn run_until<S: Subscriber>(
        &self,
        mut subscriber: S,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), BrokerError> {
        tokio::pin!(shutdown);
        // Tells the deliveries held through a database outage to give up at shutdown.
        let (stop, stopping) = watch::channel(false);
        let mut running = JoinSet::new();
        let mut next_purge = Instant::now();
        let result = loop {
            if Instant::now() >= next_purge {
                let this = self.clone();
                running.spawn(async move {
                    this.purge().await;
                });
                next_purge = crate::clock::deadline_in(self.inner.config.purge_every);
            }
            while running.len() >= self.inner.config.concurrency.max(1) {
                running.join_next().await;
            }
            let delivery = tokio::select! {
                () = &mut shutdown => break Ok(()),
                delivery = subscriber.next() => delivery,
            };
            match delivery {
                Ok(delivery) => {
                    let this = self.clone();
                    let stopping = stopping.clone();
                    running.spawn(async move {
                        this.process_until(&delivery, stopping).await;
                    });
                }
                Err(error) => break Err(error),
            }
        };
        stop.send_replace(true);
        while running.join_next().await.is_some() {}
        subscriber.close().await;
        result
    }

    /// Deletes message ids past the retention, in bounded batches.
    pub async fn purge(&self) -> u64 {
        let mut purged = 0;
        loop {
            match self
                .inner
                .inbox
                .purge(self.inner.config.retention, PURGE_BATCH)
                .await
            {
                Ok(n) => {
                    purged += n;
                    if n < u64::from(PURGE_BATCH) {
                        return purged;
                    }
                }
                Err(error) => {
                    tracing::warn!(error = %error_chain(&error), "inbox: purging old message ids failed");
                    return purged;
                }
            }
        }
    }

    /// Handles one delivery and settles it with the broker: ack after commit, ack a
    /// duplicate, retry a failure, dead-letter poison, hold it through a database outage.
    pub async fn process<D: Delivery>(&self, delivery: &D) -> Outcome {
        let (_never, stopping) = watch::channel(false);
        self.process_until(delivery, stopping).await
    }

    /// [`process`](Self::process), giving a held delivery back when `stopping` turns true.
    async fn process_until<D: Delivery>(
        &self,
        delivery: &D,
        stopping: watch::Receiver<bool>,
    ) -> Outcome {
        let Some(id) = delivery.message_id().map(str::to_owned) else {
            return self
                .dead_letter(delivery, "<none>", "it has no message id")
                .await;
        };
        let payload = match serde_json::from_slice(delivery.payload()) {
            Ok(payload) => payload,
            Err(error) => {
                let reason = format!("its body is not JSON ({error})");
                return self.dead_letter(delivery, &id, &reason).await;
            }
        };
        let mut message = Message {
            id,
            payload,
            attempt: 1,
        };
        let decision = kept_alive(delivery, self.decide(delivery, &mut message, stopping)).await;
        match decision {
            Decision::Ack(outcome) => settle(delivery.ack().await, outcome),
            Decision::Retry(why) => self.retry(delivery, &message, &why).await,
            Decision::DeadLetter(reason) => self.dead_letter(delivery, &message.id, &reason).await,
        }
    }

    /// Runs attempts until one decides the delivery's fate.
    async fn decide<D: Delivery>(
        &self,
        delivery: &D,
        message: &mut Message,
        mut stopping: watch::Receiver<bool>,
    ) -> Decision {
        let name = &self.inner.name;
        let config = &self.inner.config;
        let redelivered = delivery.delivery_count() > 1;
        let busy_deadline = crate::clock::deadline_in(config.busy_patience);
        let mut pause = config.busy_pause;
        // Since when the database is out of reach, and the waits between tries.
        let mut outage: Option<(Instant, Backoff)> = None;
        loop {
            let why = match self.attempt(message, redelivered).await {
                Ok(InboxClaim::New) => return Decision::Ack(Outcome::Handled),
                Ok(InboxClaim::Duplicate) => {
                    tracing::debug!(consumer = %name, message_id = %message.id, "duplicate delivery; acked");
                    return Decision::Ack(Outcome::Duplicate);
                }
                Ok(InboxClaim::Busy) if Instant::now() < busy_deadline => {
                    // No connection is held while we wait for the other copy to finish, and
                    // never past the patience, however long the pause.
                    tokio::time::sleep_until(
                        busy_deadline.min(Instant::now() + pause.min(MAX_BUSY_PAUSE)),
                    )
                    .await;
                    pause = pause.saturating_mul(2).min(MAX_BUSY_PAUSE);
                    continue;
                }
                Ok(InboxClaim::Busy) => {
                    return Decision::Retry("another copy is still being handled".into())
                }
                // The claim went with the transaction, so the message may be another copy's
                // by now: the next claim tells (a duplicate, acked; busy; or a fresh run).
                // Looked at again like a busy claim, and as patiently.
                Err(Failure::LostRace(why)) if Instant::now() < busy_deadline => {
                    tracing::debug!(consumer = %name, message_id = %message.id, "the database rolled the transaction back ({why}); claiming again, no attempt counted");
                    tokio::time::sleep_until(
                        busy_deadline.min(Instant::now() + pause.min(MAX_BUSY_PAUSE)),
                    )
                    .await;
                    pause = pause.saturating_mul(2).min(MAX_BUSY_PAUSE);
                    continue;
                }
                Err(Failure::LostRace(why)) => {
                    return Decision::Retry(format!(
                        "the database kept rolling the transaction back ({why}); no attempt counted"
                    ))
                }
                Err(Failure::Rejected(reason)) => return Decision::DeadLetter(reason),
                Err(Failure::Handler(error)) => {
                    match self.inner.inbox.count_failure(name, &message.id).await {
                        Ok(failures) if failures >= config.max_attempts => {
                            return Decision::DeadLetter(format!(
                                "the handler failed {failures} times, the most allowed is {}                                  (last: {error})",
                                config.max_attempts
                            ))
                        }
                        Ok(_) => return Decision::Retry(error),
                        // Not counted, so not the handler's: held like any other outage.
                        Err(counting) => format!(
                            "the handler failed ({error}) and its failure could not be counted: {}",
                            error_chain(&counting)
                        ),
                    }
                }
                Err(Failure::Infrastructure(why)) => why,
            };
            let (since, backoff) = outage.get_or_insert_with(|| {
                tracing::warn!(
                    consumer = %name,
                    message_id = %message.id,
                    "the database failed ({why}); holding the message and trying again, \
                     no attempt counted"
                );
                (Instant::now(), config.outage_backoff.clone())
            });
            if since.elapsed() >= config.outage_patience || *stopping.borrow() {
                return Decision::Retry(format!(
                    "the database failed for {:?} ({why}); no attempt counted",
                    since.elapsed()
                ));
            }
            tokio::select! {
                () = tokio::time::sleep(backoff.next_delay()) => {}
                _ = stopping.wait_for(|&stop| stop) => {}
            }
        }
    }

    /// One transaction: claim, then the handler, then commit.
    async fn attempt(
        &self,
        message: &mut Message,
        redelivered: bool,
    ) -> Result<InboxClaim, Failure> {
        let inner = &self.inner;
        let mut tx = inner
            .inbox
            .pool()
            .begin()
            .await
            .map_err(Failure::database)?;
        let claim = inner
            .inbox
            .claim(&mut *tx, &inner.name, &message.id)
            .await
            .map_err(Failure::inbox)?;
        if claim != InboxClaim::New {
            // Dropping `tx` rolls it back (and a busy claim's transaction is aborted anyway).
            return Ok(claim);
        }
        if redelivered {
            let failures = inner
                .inbox
                .failures(&mut *tx, &inner.name, &message.id)
                .await
                .map_err(Failure::inbox)?;
            message.attempt = failures.saturating_add(1);
        }
        match inner.handler.handle(&mut *tx, message).await {
            Ok(()) => {
                // A commit that fails may have committed anyway: the next try's claim tells
                // (a duplicate, acked, or a fresh claim that runs the handler).
                tx.commit().await.map_err(Failure::database)?;
                Ok(InboxClaim::New)
            }
            Err(HandlerError::Reject(reason)) => Err(Failure::Rejected(format!(
                "the handler rejected it: {reason}"
            ))),
            Err(HandlerError::Retry(source)) if rolled_back_by_database(&*source) => Err(
                Failure::LostRace(format!("under the handler: {}", error_chain(&*source))),
            ),
            Err(HandlerError::Retry(source)) if unreachable_database(&*source) => {
                Err(Failure::Infrastructure(format!(
                    "the handler could not reach the database: {}",
                    error_chain(&*source)
                )))
            }
            Err(error @ HandlerError::Retry(_)) => Err(Failure::Handler(error_chain(&error))),
        }
    }

    async fn retry<D: Delivery>(&self, delivery: &D, message: &Message, why: &str) -> Outcome {
        tracing::warn!(
            consumer = %self.inner.name,
            message_id = %message.id,
            attempt = message.attempt,
            "message not handled ({why}); it will be delivered again"
        );
        settle(
            delivery.retry(self.inner.config.retry_delay).await,
            Outcome::Retried,
        )
    }

    async fn dead_letter<D: Delivery>(&self, delivery: &D, id: &str, reason: &str) -> Outcome {
        tracing::error!(
            consumer = %self.inner.name,
            message_id = %id,
            "dead-lettered a message that cannot be handled: {reason}; it will not be retried"
        );
        settle(delivery.dead_letter(reason).await, Outcome::DeadLettered)
    }
}

/// Why an attempt did not handle the message.
enum Failure {
    /// The handler failed: one attempt spent.
    Handler(String),
    /// The database or the pool failed: no attempt spent; the delivery is held.
    Infrastructure(String),
    /// Never handleable: dead-letter it.
    Rejected(String),
    /// The database rolled the transaction back on its own (a deadlock's victim, a
    /// serialization failure; on Galera, a write set of the same message that certified
    /// first): the claim went with it. No attempt spent; claimed again at once.
    LostRace(String),
}

impl Failure {
    fn database(error: sqlx::Error) -> Self {
        let lost = rolled_back_by_database(&error);
        let why = error_chain(&InboxError::Database(error));
        if lost {
            Failure::LostRace(why)
        } else {
            Failure::Infrastructure(why)
        }
    }

    fn inbox(error: InboxError) -> Self {
        match error {
            InboxError::Database(error) => Self::database(error),
            other => Failure::Infrastructure(error_chain(&other)),
        }
    }
}

/// What becomes of a delivery.
enum Decision {
    Ack(Outcome),
    Retry(String),
    DeadLetter(String),
}

/// The first sqlx error among `error` and its sources: what the database said, however the
/// handler wrapped it.
fn sqlx_cause<'e>(error: &'e (dyn std::error::Error + 'static)) -> Option<&'e sqlx::Error> {
    let mut source = Some(error);
    while let Some(error) = source {
        if let Some(error) = error.downcast_ref::<sqlx::Error>() {
            return Some(error);
        }
        source = error.source();
    }
    None
}

/// Whether `error` (a handler's) says that the database could not be reached rather than
/// that the handler's work failed: a sqlx connection, pool or I/O error anywhere in its
/// sources, or a server that is going away (SQLSTATE class 08, `57P0x`).
fn unreachable_database(error: &(dyn std::error::Error + 'static)) -> bool {
    match sqlx_cause(error) {
        Some(
            sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::Protocol(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::WorkerCrashed,
        ) => true,
        Some(sqlx::Error::Database(error)) => error
            .code()
            .is_some_and(|code| code.starts_with("08") || code.starts_with("57P0")),
        _ => false,
    }
}

/// Whether `error` (a handler's, or the claim's or the commit's) says that the database
/// rolled the whole transaction back by itself: SQLSTATE `40001` (a serialization failure;
/// MySQL / MariaDB give it with error 1213, a deadlock's victim, and Galera with a
/// certification failure or a brute-force abort) or `40P01` (a PostgreSQL deadlock), anywhere
/// in its sources.
fn rolled_back_by_database(error: &(dyn std::error::Error + 'static)) -> bool {
    matches!(
        sqlx_cause(error),
        Some(sqlx::Error::Database(error))
            if error.code().is_some_and(|code| code == "40001" || code == "40P01")
    )
}

/// Runs `work` while keeping the broker's lease on `delivery` (NATS `+WPI`, SQS visibility),
/// so a slow handler or a delivery held through an outage is not handed to another consumer.
async fn kept_alive<D: Delivery, T>(delivery: &D, work: impl Future<Output = T>) -> T {
    let Some(every) = delivery.keep_alive_every().filter(|every| !every.is_zero()) else {
        return work.await;
    };
    tokio::pin!(work);
    let mut tick = tokio::time::interval_at(Instant::now() + every, every);
    loop {
        tokio::select! {
            done = &mut work => return done,
            _ = tick.tick() => {
                if let Err(error) = delivery.keep_alive().await {
                    tracing::debug!(error = %error_chain(&error), "keeping a delivery failed; the broker may deliver it again");
                }
            }
        }
    }
}

fn settle(result: Result<(), BrokerError>, outcome: Outcome) -> Outcome {
    match result {
        Ok(()) => outcome,
        Err(error) => {
            tracing::warn!(error = %error_chain(&error), "settling a delivery failed; the broker will deliver it again");
            Outcome::Unsettled
        }
    }
}
