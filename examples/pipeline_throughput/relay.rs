//! Relay throughput: producers commit N outbox rows in batches while one relay (woken by
//! LISTEN/NOTIFY) publishes them with confirms and marks them sent. The clock runs from the
//! first commit to the moment no row is unsent (the last batch was confirmed and marked).

use std::time::Duration;

use sqlx::PgPool;
use tokio::{task::JoinSet, time::Instant};
use tower_idempotency::outbox::{NewEvent, OutboxSource, PgOutbox, Relay};

use crate::{broker::Broker, broker::TOPIC, BoxError};

/// Producers committing at once, like request handlers of a service.
const PRODUCERS: usize = 4;

/// What one relay run took.
pub struct Relayed {
    /// Seconds until every producer had committed.
    pub produced: f64,
    /// Seconds until every row was confirmed by the broker and marked sent.
    pub relayed: f64,
}

/// Relays `events` rows committed `batch` per transaction to `broker`.
pub async fn measure(
    pool: &PgPool,
    broker: &Broker,
    run: &str,
    events: usize,
    batch: usize,
) -> Result<Relayed, BoxError> {
    let name = format!("{run}_relay_{}", broker.label());
    let table = format!("bench_outbox_{name}");
    let topology = broker.topology(&name);
    let outbox = PgOutbox::with_table(pool.clone(), &table)?;
    outbox.migrate().await?;
    let result = relay(pool, &outbox, topology.publisher().await?, events, batch).await;
    topology.clean_up().await;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS {table}")))
        .execute(pool)
        .await?;
    result
}

async fn relay(
    pool: &PgPool,
    outbox: &PgOutbox,
    publisher: Box<dyn tower_idempotency::broker::Publisher>,
    events: usize,
    batch: usize,
) -> Result<Relayed, BoxError> {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let relay = tokio::spawn(Relay::new(outbox.clone(), publisher).run_until(async {
        let _ = stopped.await;
    }));
    // Let the relay's LISTEN connect: a wake-up lost before it would cost a poll interval.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let start = Instant::now();
    let mut producers = JoinSet::new();
    for p in 0..PRODUCERS {
        let (pool, outbox) = (pool.clone(), outbox.clone());
        let rows = events / PRODUCERS + usize::from(p < events % PRODUCERS);
        producers.spawn(async move { produce(&pool, &outbox, rows, batch).await });
    }
    while let Some(done) = producers.join_next().await {
        done??;
    }
    let produced = start.elapsed().as_secs_f64();
    while outbox.unsent().await? > 0 {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let relayed = start.elapsed().as_secs_f64();
    let _ = stop.send(());
    relay.await?;
    Ok(Relayed { produced, relayed })
}

/// Commits `rows` events, `batch` per transaction.
async fn produce(
    pool: &PgPool,
    outbox: &PgOutbox,
    rows: usize,
    batch: usize,
) -> Result<(), BoxError> {
    let mut left = rows;
    while left > 0 {
        let n = left.min(batch.max(1));
        let mut tx = pool.begin().await?;
        for i in 0..n {
            let event = NewEvent::new(TOPIC, format!(r#"{{"amount":{i}}}"#));
            outbox.enqueue(&mut tx, &event).await?;
        }
        tx.commit().await?;
        left -= n;
    }
    Ok(())
}
