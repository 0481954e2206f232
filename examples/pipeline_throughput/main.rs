//! `pipeline_throughput`: what the outbox relay and the inbox cost, on real PostgreSQL,
//! RabbitMQ, NATS JetStream, Kafka and SQS (`scripts/bench.d/pipeline.sh` runs it and writes
//! the table).
//!
//! ```text
//! DATABASE_URL=postgres://root@127.0.0.1/test AMQP_URL=amqp://guest:guest@127.0.0.1:5672/%2f \
//!     NATS_URL=nats://127.0.0.1:4222 KAFKA_URL=127.0.0.1:9092 SQS_URL=http://127.0.0.1:5000 \
//!     cargo run --release --example pipeline_throughput
//! ```
//!
//! For each broker set (`AMQP_URL`, `NATS_URL`, `KAFKA_URL`, `SQS_URL` with the region and
//! credentials of `pipeline/sqs.rs`; at least one; unlike the other examples, several at
//! once):
//! - relay throughput: `BENCH_PIPELINE_EVENTS` outbox rows (default 20000) committed
//!   `BENCH_PIPELINE_BATCH` per transaction (default 100) by 4 producers while a relay
//!   publishes them; events/s from the first commit to the last row marked sent;
//!   (SQS: `BENCH_PIPELINE_SQS_EVENTS`, default 2000: a local SQS such as moto answers in
//!   milliseconds per call, and the run would take minutes);
//! - consumer throughput: `BENCH_PIPELINE_MESSAGES` messages (default 5000; SQS:
//!   `BENCH_PIPELINE_SQS_MESSAGES`, default 1000) per run, with the
//!   inbox and without, `BENCH_PIPELINE_ROUNDS` rounds of both (default 2, alternating),
//!   prefetch and concurrency `BENCH_PIPELINE_PREFETCH` (default 8).
//!
//! Prints one `key=value` line per figure (`relay ...`, `consume ...`, `consumer ...`) on
//! stdout. Every table, queue and stream it creates has a name of its own and is dropped.

mod broker;
mod consume;
// The environment helpers of the pipeline examples.
#[path = "../pipeline/mod.rs"]
mod pipeline;
mod relay;

use std::process::ExitCode;

use broker::Broker;
use consume::{Arm, Setup};
use pipeline::{number, var};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> ExitCode {
    pipeline::init_logs("warn,sqlx=error", std::io::stderr);
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("pipeline_throughput: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), BoxError> {
    let url = var("DATABASE_URL").ok_or("set DATABASE_URL to a postgres:// URL")?;
    let all_events: usize = number("BENCH_PIPELINE_EVENTS", 20_000)?;
    let sqs_events: usize = number("BENCH_PIPELINE_SQS_EVENTS", 2_000)?;
    let batch: usize = number("BENCH_PIPELINE_BATCH", 100)?;
    let all_messages: usize = number("BENCH_PIPELINE_MESSAGES", 5_000)?;
    let sqs_messages: usize = number("BENCH_PIPELINE_SQS_MESSAGES", 1_000)?;
    let sized = |broker: &Broker, sqs: usize, others: usize| match broker {
        Broker::Sqs(_) => sqs,
        _ => others,
    };
    let rounds: usize = number("BENCH_PIPELINE_ROUNDS", 2)?;
    let prefetch: u16 = number("BENCH_PIPELINE_PREFETCH", 8)?;
    let sqs = match var("SQS_URL") {
        Some(url) => Some(Broker::Sqs(pipeline::sqs::client(&url)?)),
        None => None,
    };
    let brokers: Vec<Broker> = [
        var("AMQP_URL").map(Broker::Amqp),
        var("NATS_URL").map(Broker::Nats),
        var("KAFKA_URL").map(Broker::Kafka),
        sqs,
    ]
    .into_iter()
    .flatten()
    .collect();
    if brokers.is_empty() {
        return Err("set one or more of AMQP_URL, NATS_URL, KAFKA_URL, SQS_URL".into());
    }
    // Enough connections for the consumer's concurrency and the 4 producers plus the relay.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(u32::from(prefetch).max(6) + 2)
        .connect(&url)
        .await?;
    let run = format!("{:08x}", rand::random::<u32>());

    for broker in &brokers {
        let label = broker.label();
        let events = sized(broker, sqs_events, all_events);
        let relayed = relay::measure(&pool, broker, &run, events, batch).await?;
        println!(
            "relay broker={label} events={events} batch={batch} produced_s={:.3} relayed_s={:.3} rate={:.0}",
            relayed.produced,
            relayed.relayed,
            events as f64 / relayed.relayed
        );
    }
    for broker in &brokers {
        let label = broker.label();
        let messages = sized(broker, sqs_messages, all_messages);
        let setup = Setup {
            pool: &pool,
            broker,
            run: &run,
            messages,
            rounds,
            prefetch,
        };
        let timings = consume::measure(&setup).await?;
        for (arm, round, seconds) in &timings {
            println!(
                "consume broker={label} arm={arm} round={round} messages={messages} seconds={seconds:.3} rate={:.0}",
                messages as f64 / seconds
            );
        }
        let rate = |which: Arm| {
            let runs: Vec<f64> = timings
                .iter()
                .filter(|(arm, ..)| *arm == which)
                .map(|(.., s)| *s)
                .collect();
            (messages * runs.len()) as f64 / runs.iter().sum::<f64>()
        };
        let (plain, inbox) = (rate(Arm::Plain), rate(Arm::Inbox));
        println!(
            "consumer broker={label} prefetch={prefetch} plain_rate={plain:.0} inbox_rate={inbox:.0} ratio={:.2}",
            inbox / plain
        );
    }
    pool.close().await;
    Ok(())
}
