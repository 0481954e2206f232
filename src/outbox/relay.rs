use std::{future::Future, sync::Arc, time::Duration};

use tokio::{sync::Notify, time::Instant};

use super::{OutboxError, OutboxSource};
use crate::broker::{error_chain, Backoff, Publisher};

/// How a [`Relay`] works. The defaults suit most services.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// Rows per transaction (default 100).
    pub batch: u32,
    /// How long to wait for a wake-up before looking anyway (default 1 s): the only trigger
    /// where the database has no `LISTEN`, and the safety net where it has.
    pub poll_interval: Duration,
    /// Wait after a failed batch (the broker or the database unreachable, a time limit)
    /// before the next try (default 1 s); it doubles, with jitter, after each further failure
    /// in a row, up to `retry_ceiling`. No row's attempts are spent on such failures.
    pub retry_delay: Duration,
    /// The longest wait between two tries while batches keep failing (default 30 s).
    pub retry_ceiling: Duration,
    /// How long sent rows are kept (default 1 hour), for inspection.
    pub sent_retention: Duration,
    /// How often sent rows are purged (default 1 minute), in batches of `batch` rows, however
    /// busy the relay is: a backlog is interrupted between two batches for the purge.
    /// `Duration::MAX`: once, when the relay starts.
    pub purge_every: Duration,
    /// How long sending may go on after the shutdown signal (default 5 s): the drain under way,
    /// or one more, sends the rows committed since the last batch now rather than at the next
    /// start of a relay, and a broker that is down or a backlog cannot hold the shutdown
    /// longer than this. Zero: stop at once (a batch under way rolls back).
    pub shutdown_drain: Duration,
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            batch: 100,
            poll_interval: Duration::from_secs(1),
            retry_delay: Duration::from_secs(1),
            retry_ceiling: Duration::from_secs(30),
            sent_retention: Duration::from_secs(3600),
            purge_every: Duration::from_secs(60),
            shutdown_drain: Duration::from_secs(5),
        }
    }
}

/// Publishes an outbox's unsent rows, batch after batch, until stopped. Run one in each
/// service process, a separate one, or several: they share the work without losing a row.
///
/// ```no_run
/// # #[cfg(all(feature = "postgres", feature = "amqp"))]
/// # async fn example(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// use tower_idempotency::broker::amqp::{AmqpPublisher, AmqpTopology};
/// use tower_idempotency::outbox::{PgOutbox, Relay};
///
/// let topology = AmqpTopology::new("payments", "receipts", "payment.created");
/// let publisher = AmqpPublisher::connect("amqp://127.0.0.1:5672/%2f", &topology).await?;
/// Relay::new(PgOutbox::new(pool), publisher)
///     .run_until(async { tokio::signal::ctrl_c().await.ok(); })
///     .await;
/// # Ok(()) }
/// ```
pub struct Relay<S, P> {
    source: S,
    publisher: P,
    config: RelayConfig,
}

impl<S: OutboxSource, P: Publisher> Relay<S, P> {
    /// A relay from `source` to `publisher` with the default [`RelayConfig`].
    pub fn new(source: S, publisher: P) -> Self {
        Self {
            source,
            publisher,
            config: RelayConfig::default(),
        }
    }

    /// Replaces the configuration.
    pub fn config(mut self, config: RelayConfig) -> Self {
        self.config = config;
        self
    }

    /// Publishes batches until none is due; returns how many rows it took (sent, or refused
    /// and set aside for a later attempt). For tests, tools and shutdown hooks; services use
    /// [`run_until`](Self::run_until).
    pub async fn drain(&self) -> Result<usize, OutboxError> {
        self.drain_until(None).await.map(|(taken, _)| taken)
    }

    /// Publishes batches until none is due or, between two batches, `purge_at` has come;
    /// returns the rows taken and whether it stopped for the purge (with rows maybe left).
    async fn drain_until(&self, purge_at: Option<Instant>) -> Result<(usize, bool), OutboxError> {
        let mut taken = 0;
        loop {
            let n = self
                .source
                .relay_batch(&self.publisher, self.config.batch)
                .await?;
            taken += n;
            if n == 0 {
                return Ok((taken, false));
            }
            if purge_at.is_some_and(|at| Instant::now() >= at) {
                return Ok((taken, true));
            }
        }
    }

    /// Runs until `shutdown` completes. A failed batch is logged (`tracing`, warn) and
    /// retried after `retry_delay`, doubling up to `retry_ceiling` while failures go on.
    ///
    /// Sent rows are purged every `purge_every` even while every batch is full: the drain
    /// pauses for the purge between two batches.
    ///
    /// Shutdown is bounded by [`shutdown_drain`](RelayConfig::shutdown_drain): a drain under
    /// way when `shutdown` completes may go on for that long, and otherwise one more drain
    /// runs for that long, so rows committed since the last batch leave now rather than at
    /// the next start of a relay. Whatever is not sent by then (a broker that is down, a
    /// backlog larger than the time allows) stays unsent for the next relay, with one warning:
    /// a row is marked sent only in the transaction that commits after the broker confirmed
    /// it, so none is lost. A batch cut off mid-way rolls back, and the rows of it the broker
    /// already took are published again (consumers deduplicate by message id).
    pub async fn run_until(self, shutdown: impl Future<Output = ()>) {
        let wake = Arc::new(Notify::new());
        let listener = self.source.listen(wake.clone());
        tokio::pin!(shutdown);
        // Saturated: the backoff doubles its wait, which `Duration::MAX` cannot take.
        let forever = crate::clock::FOREVER;
        let mut backoff = Backoff::new(
            self.config.retry_delay.min(forever),
            self.config.retry_ceiling.min(forever),
        );
        let mut next_purge = Instant::now();
        let in_flight = loop {
            let mut drain = Box::pin(self.drain_until(Some(next_purge)));
            let drained = tokio::select! {
                drained = &mut drain => drained,
                () = &mut shutdown => break Some(drain),
            };
            let failed = drained.is_err();
            let pause = match drained {
                // Stopped for the purge: the backlog goes on right after it.
                Ok((_, purge_due)) => {
                    backoff.reset();
                    (!purge_due).then_some(self.config.poll_interval)
                }
                Err(error) => {
                    let pause = backoff.next_delay();
                    tracing::warn!(
                        error = %error_chain(&error),
                        retry_in = ?pause,
                        "outbox relay: batch failed; no row's attempts were spent, retrying"
                    );
                    Some(pause)
                }
            };
            if Instant::now() >= next_purge {
                // A purge of a long backlog (or on a stalled database) must not hold the
                // shutdown: cut off, each batch is its own statement, and the next purge
                // deletes what this one left.
                tokio::select! {
                    () = self.purge() => {}
                    () = &mut shutdown => break None,
                }
                next_purge = crate::clock::deadline_in(self.config.purge_every);
            }
            let Some(pause) = pause else { continue };
            // After a failure only the backoff ends the wait: on a busy database commits wake
            // the relay all the time, and would make it hammer a broker that is down.
            tokio::select! {
                () = &mut shutdown => break None,
                () = wake.notified(), if !failed => {}
                () = tokio::time::sleep(pause) => {}
            }
        };
        if let Some(listener) = listener {
            listener.abort();
        }
        match in_flight {
            // The drain under way may have stopped for a purge with rows left: go on.
            Some(drain) => {
                self.last_drain(async {
                    drain.await?;
                    self.drain().await
                })
                .await
            }
            None => self.last_drain(self.drain()).await,
        }
        self.publisher.close().await;
    }

    /// Lets the drain under way at shutdown, or a fresh one, run for `shutdown_drain`.
    async fn last_drain(&self, drain: impl Future<Output = Result<usize, OutboxError>>) {
        let limit = self.config.shutdown_drain;
        if limit.is_zero() {
            return;
        }
        match tokio::time::timeout(limit, drain).await {
            Ok(Ok(_)) => {}
            Ok(Err(error)) => tracing::warn!(
                error = %error_chain(&error),
                "outbox relay: the last drain before shutdown failed; an unknown number of rows \
                 stay unsent, and the next relay to start sends them"
            ),
            Err(_) => tracing::warn!(
                shutdown_drain = ?limit,
                "outbox relay: the last drain before shutdown ran out of time; an unknown number \
                 of rows stay unsent, and the next relay to start sends them"
            ),
        }
    }

    async fn purge(&self) {
        let batch = self.config.batch.max(1);
        loop {
            match self
                .source
                .purge_sent(self.config.sent_retention, batch)
                .await
            {
                Ok(n) if n == u64::from(batch) => continue,
                Ok(_) => return,
                Err(error) => {
                    tracing::warn!(error = %error_chain(&error), "outbox relay: purging sent rows failed");
                    return;
                }
            }
        }
    }
}
