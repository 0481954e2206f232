//! `grpc_loadgen`: unary `Charge` calls against `grpc_payments` for a fixed time, each under
//! a new key, from `--concurrency` tasks over 4 HTTP/2 connections; prints one
//! `summary: requests=N seconds=S errors=E` line (scripts/bench.d/grpc.sh reads it).
//!
//! ```text
//! grpc_loadgen --target 127.0.0.1:50051 --concurrency 32 --duration 5
//! ```

#[path = "grpc_payments/messages.rs"]
mod messages;

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use http::uri::PathAndQuery;
use messages::{ChargeRequest, Receipt};
use tonic::{transport::Channel, Request};
use tonic_prost::ProstCodec;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (mut target, mut concurrency, mut duration) = (None, 32usize, 5u64);
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let value = args.next().ok_or(format!("{arg} needs a value"))?;
        match arg.as_str() {
            "--target" => target = Some(value),
            "--concurrency" => concurrency = value.parse()?,
            "--duration" => duration = value.parse()?,
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    let target = target.ok_or("--target HOST:PORT is required")?;
    let mut channels = Vec::new();
    for _ in 0..4 {
        let endpoint = Channel::from_shared(format!("http://{target}"))?;
        channels.push(endpoint.connect().await?);
    }
    let (done, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let start = Instant::now();
    let end = start + Duration::from_secs(duration);
    let mut tasks = Vec::new();
    for task in 0..concurrency {
        let mut client = tonic::client::Grpc::new(channels[task % channels.len()].clone());
        let (done, failed) = (done.clone(), failed.clone());
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while Instant::now() < end {
                n += 1;
                let mut request = Request::new(ChargeRequest {
                    amount_cents: 1200,
                    currency: "EUR".to_owned(),
                    request_id: String::new(),
                });
                let metadata = request.metadata_mut();
                metadata.insert("authorization", "Bearer bench".parse().unwrap());
                let key = format!("bench-{task}-{n}-{:08x}", rand::random::<u32>());
                metadata.insert("idempotency-key", key.parse().unwrap());
                let path = PathAndQuery::from_static(messages::CHARGE);
                let codec = ProstCodec::<ChargeRequest, Receipt>::default();
                let ok = client.ready().await.is_ok()
                    && client.unary(request, path, codec).await.is_ok();
                let counter = if ok { &done } else { &failed };
                counter.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    for task in tasks {
        task.await?;
    }
    let seconds = start.elapsed().as_secs_f64();
    println!(
        "summary: requests={} seconds={seconds:.3} errors={}",
        done.load(Ordering::Relaxed),
        failed.load(Ordering::Relaxed)
    );
    Ok(())
}
