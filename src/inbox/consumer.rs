use std::{future::Future, sync::Arc, time::Duration};

use async_trait::async_trait;
use tokio::{task::JoinSet, time::Instant};

use super::{InboxClaim, InboxError, InboxStore};
use crate::broker::error_chain;
use crate::broker::{BrokerError, Delivery, Subscriber};
use crate::BoxError;

/// A decoded message, as the [`Handler`] sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    /// The broker message id (RabbitMQ `message_id`, NATS `Nats-Msg-Id`).
    pub id: String,
    /// The body, parsed as JSON.
    pub payload: serde_json::Value,
    /// Which delivery this is, counting from 1.
    pub attempt: u32,
}

/// Why a handler did not handle a message. Its transaction is rolled back either way.
#[derive(Debug, thiserror::Error)]
pub enum HandlerError {
    /// A failure that may pass (a deadlock, a timeout): the message is delivered again, up
    /// to [`ConsumerConfig::max_attempts`] deliveries, then dead-lettered.
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
    /// Deliveries of one message before a failing handler's message is dead-lettered
    /// (default 5).
    pub max_attempts: u32,
    /// Delay before a failed message is delivered again (default 1 s).
    pub retry_delay: Duration,
    /// First pause after a [`Busy`](InboxClaim::Busy) claim; it doubles up to 1 s
    /// (default 50 ms), and no pause lasts past `busy_patience`.
    pub busy_pause: Duration,
    /// How long a busy copy keeps looking before it gives the message back to the broker
    /// (default 60 s).
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
    /// Given back to the broker for a later delivery.
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
                    running.spawn(async move {
                        this.process(&delivery).await;
                    });
                }
                Err(error) => break Err(error),
            }
        };
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
    /// duplicate, retry a failure, dead-letter poison.
    pub async fn process<D: Delivery>(&self, delivery: &D) -> Outcome {
        let name = &self.inner.name;
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
        let message = Message {
            id,
            payload,
            attempt: delivery.delivery_count(),
        };
        let config = &self.inner.config;
        let deadline = crate::clock::deadline_in(config.busy_patience);
        let mut pause = config.busy_pause;
        loop {
            match self.attempt(&message).await {
                Ok(InboxClaim::New) => return settle(delivery.ack().await, Outcome::Handled),
                Ok(InboxClaim::Duplicate) => {
                    tracing::debug!(consumer = %name, message_id = %message.id, "duplicate delivery; acked");
                    return settle(delivery.ack().await, Outcome::Duplicate);
                }
                Ok(InboxClaim::Busy) if Instant::now() < deadline => {
                    // No connection is held while we wait for the other copy to finish, and
                    // never past the patience, however long the pause.
                    tokio::time::sleep_until(
                        deadline.min(Instant::now() + pause.min(MAX_BUSY_PAUSE)),
                    )
                    .await;
                    pause = pause.saturating_mul(2).min(MAX_BUSY_PAUSE);
                }
                Ok(InboxClaim::Busy) => {
                    return self
                        .retry(delivery, &message, "another copy is still being handled")
                        .await
                }
                Err(Failure::Rejected(reason)) => {
                    return self.dead_letter(delivery, &message.id, &reason).await
                }
                Err(Failure::Retry(error)) => {
                    if message.attempt >= config.max_attempts {
                        let reason = format!(
                            "the handler failed on delivery {} of {} ({})",
                            message.attempt, config.max_attempts, error
                        );
                        return self.dead_letter(delivery, &message.id, &reason).await;
                    }
                    return self.retry(delivery, &message, &error).await;
                }
            }
        }
    }

    /// One transaction: claim, then the handler, then commit.
    async fn attempt(&self, message: &Message) -> Result<InboxClaim, Failure> {
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
            .map_err(|e| Failure::Retry(error_chain(&e)))?;
        if claim != InboxClaim::New {
            // Dropping `tx` rolls it back (and a busy claim's transaction is aborted anyway).
            return Ok(claim);
        }
        match inner.handler.handle(&mut *tx, message).await {
            Ok(()) => {
                tx.commit().await.map_err(Failure::database)?;
                Ok(InboxClaim::New)
            }
            Err(HandlerError::Reject(reason)) => Err(Failure::Rejected(format!(
                "the handler rejected it: {reason}"
            ))),
            Err(error @ HandlerError::Retry(_)) => Err(Failure::Retry(error_chain(&error))),
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

enum Failure {
    Retry(String),
    Rejected(String),
}

impl Failure {
    fn database(error: sqlx::Error) -> Self {
        Failure::Retry(error_chain(&InboxError::Database(error)))
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
