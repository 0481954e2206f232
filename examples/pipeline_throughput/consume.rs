//! Consumer throughput with the inbox and without it: the same number of pre-published
//! messages, the same handler (one small INSERT in a PostgreSQL transaction), the same
//! prefetch and the same driving loop; only the inbox claim in the transaction differs.
//! Arms alternate (plain, inbox, then inbox, plain, ...) so drift in the machine's load
//! falls on both.

use std::{fmt, future::Future, sync::Arc};

use async_trait::async_trait;
use sqlx::{PgConnection, PgPool, Postgres};
use tokio::{task::JoinSet, time::Instant};
use tower_idempotency::{
    broker::{Delivery, Subscriber},
    inbox::{Consumer, ConsumerConfig, Handler, HandlerError, Message, Outcome, PgInbox},
};

use crate::{broker::Broker, BoxError};

/// With the inbox or without it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Arm {
    /// Begin, the handler's INSERT, commit, ack.
    Plain,
    /// The same through `inbox::Consumer::process`: the claim first, in the same transaction.
    Inbox,
}

impl fmt::Display for Arm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Arm::Plain => "plain",
            Arm::Inbox => "inbox",
        })
    }
}

/// How one broker's consumer arms are run.
pub struct Setup<'a> {
    pub pool: &'a PgPool,
    pub broker: &'a Broker,
    pub run: &'a str,
    pub messages: usize,
    pub rounds: usize,
    pub prefetch: u16,
}

/// One arm's run: which, and how many seconds it took for `Setup::messages`.
pub type Timing = (Arm, usize, f64);

/// Runs `rounds` of both arms, alternating; returns each run's timing.
pub async fn measure(setup: &Setup<'_>) -> Result<Vec<Timing>, BoxError> {
    let name = format!("{}_{}", setup.run, setup.broker.label());
    let effects = format!("bench_effects_{name}");
    let inbox_table = format!("bench_inbox_{name}");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {effects} (seq BIGSERIAL PRIMARY KEY, message_id TEXT NOT NULL, amount BIGINT NOT NULL)"
    )))
    .execute(setup.pool)
    .await?;
    let inbox = PgInbox::with_table(setup.pool.clone(), &inbox_table)?;
    inbox.migrate().await?;
    let handler = Record {
        insert: format!("INSERT INTO {effects} (message_id, amount) VALUES ($1, $2)").into(),
    };

    let mut timings = Vec::new();
    let mut failure = None;
    'rounds: for round in 1..=setup.rounds {
        let order = if round % 2 == 1 {
            [Arm::Plain, Arm::Inbox]
        } else {
            [Arm::Inbox, Arm::Plain]
        };
        for arm in order {
            let consumer = Consumer::with_config(
                format!("{name}_{round}"),
                inbox.clone(),
                handler.clone(),
                ConsumerConfig {
                    concurrency: usize::from(setup.prefetch),
                    ..ConsumerConfig::default()
                },
            );
            match one_arm(
                setup,
                &format!("{name}_{arm}{round}"),
                arm,
                consumer,
                &handler,
            )
            .await
            {
                Ok(seconds) => timings.push((arm, round, seconds)),
                Err(error) => {
                    failure = Some(error);
                    break 'rounds;
                }
            }
        }
    }
    let effect_rows: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {effects}"
    )))
    .fetch_one(setup.pool)
    .await?;
    for table in [&effects, &inbox_table] {
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS {table}")))
            .execute(setup.pool)
            .await?;
    }
    if let Some(error) = failure {
        return Err(error);
    }
    let expected = setup.messages * timings.len();
    if usize::try_from(effect_rows) != Ok(expected) {
        return Err(format!("{effect_rows} effect rows, expected {expected}").into());
    }
    Ok(timings)
}

/// Publishes the messages to a queue or stream of this arm's own, then times their
/// consumption.
async fn one_arm(
    setup: &Setup<'_>,
    name: &str,
    arm: Arm,
    consumer: Consumer<PgInbox, Record>,
    handler: &Record,
) -> Result<f64, BoxError> {
    let topology = setup.broker.topology(name);
    let result = async {
        topology.fill(setup.messages, 500).await?;
        let go = Go {
            pool: setup.pool.clone(),
            arm,
            consumer,
            handler: handler.clone(),
            messages: setup.messages,
            concurrency: usize::from(setup.prefetch),
        };
        if let Some(subscriber) = topology.amqp_subscriber(setup.prefetch).await {
            go.drive(subscriber?).await
        } else if let Some(subscriber) = topology.nats_subscriber(usize::from(setup.prefetch)).await
        {
            go.drive(subscriber?).await
        } else if let Some(subscriber) = topology.kafka_subscriber().await {
            go.drive(subscriber?).await
        } else if let Some(subscriber) = topology.sqs_subscriber(setup.prefetch).await {
            go.drive(subscriber?).await
        } else {
            unreachable!("a topology is AMQP, NATS, Kafka or SQS")
        }
    }
    .await;
    topology.clean_up().await;
    result
}

struct Go {
    pool: PgPool,
    arm: Arm,
    consumer: Consumer<PgInbox, Record>,
    handler: Record,
    messages: usize,
    concurrency: usize,
}

impl Go {
    /// Takes `messages` deliveries, at most `concurrency` in flight (the shape of
    /// `Consumer::run_until`), and returns the seconds from the first delivery until the last
    /// one was settled (a Kafka member joins its group on its first poll: not counted).
    async fn drive<S: Subscriber>(self, mut subscriber: S) -> Result<f64, BoxError> {
        let mut start = None;
        let mut running = JoinSet::new();
        for _ in 0..self.messages {
            while running.len() >= self.concurrency.max(1) {
                settled(running.join_next().await)?;
            }
            let delivery = subscriber.next().await?;
            start.get_or_insert_with(Instant::now);
            running.spawn(self.process(delivery));
        }
        while !running.is_empty() {
            settled(running.join_next().await)?;
        }
        let seconds = start.map_or(0.0, |start| start.elapsed().as_secs_f64());
        subscriber.close().await;
        Ok(seconds)
    }

    fn process<D: Delivery>(
        &self,
        delivery: D,
    ) -> impl Future<Output = Result<(), BoxError>> + Send + 'static {
        let (arm, consumer) = (self.arm, self.consumer.clone());
        let (pool, handler) = (self.pool.clone(), self.handler.clone());
        async move {
            match arm {
                Arm::Inbox => match consumer.process(&delivery).await {
                    Outcome::Handled => Ok(()),
                    other => Err(format!("inbox consumer: {other:?}, expected Handled").into()),
                },
                Arm::Plain => plain(&pool, &handler, &delivery).await,
            }
        }
    }
}

fn settled(
    joined: Option<Result<Result<(), BoxError>, tokio::task::JoinError>>,
) -> Result<(), BoxError> {
    match joined {
        Some(result) => result?,
        None => Ok(()),
    }
}

/// What a consumer without an inbox does: decode, the handler in a transaction, commit, ack.
async fn plain<D: Delivery>(pool: &PgPool, handler: &Record, delivery: &D) -> Result<(), BoxError> {
    let message = Message {
        id: delivery.message_id().ok_or("no message id")?.to_owned(),
        payload: serde_json::from_slice(delivery.payload())?,
        attempt: delivery.delivery_count(),
    };
    let mut tx = pool.begin().await?;
    handler.handle(&mut tx, &message).await?;
    tx.commit().await?;
    delivery.ack().await?;
    Ok(())
}

/// The handler: records the message's amount, one INSERT.
#[derive(Clone)]
pub struct Record {
    insert: Arc<str>,
}

#[async_trait]
impl Handler<Postgres> for Record {
    async fn handle(&self, conn: &mut PgConnection, message: &Message) -> Result<(), HandlerError> {
        let amount = message.payload["amount"]
            .as_i64()
            .ok_or_else(|| HandlerError::Reject("no integer amount".to_owned()))?;
        sqlx::query(sqlx::AssertSqlSafe(Arc::clone(&self.insert)))
            .bind(&message.id)
            .bind(amount)
            .execute(conn)
            .await
            .map_err(|e| HandlerError::Retry(e.into()))?;
        Ok(())
    }
}
