//! `queue_consumer`: the idempotency engine without HTTP, for message handlers.
//!
//! A broker redelivers the same message while the first delivery is still being handled
//! (a visibility timeout, a consumer-group rebalance). Each delivery calls `run_once` with the
//! message id as the key: the handler moves the order exactly once, and every delivery gets
//! the same outcome.
//!
//! ```text
//! cargo run --example queue_consumer
//! ```

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use bytes::Bytes;
use tokio::sync::Barrier;
use tower_idempotency::{
    engine::{Engine, Execution},
    store::MemoryStore,
    Fingerprint, StoreKey,
};

#[tokio::main]
async fn main() {
    // In production: a PostgresStore or RedisStore shared by every consumer instance.
    let engine = Engine::builder(MemoryStore::new())
        .lease(Duration::from_secs(30))
        .build()
        .expect("valid timings");
    let transitions = Arc::new(AtomicUsize::new(0));

    // Eight deliveries of one message, all at once.
    let message_id = "order-81:paid";
    let body = br#"{"order": 81, "event": "paid"}"#;
    let deliveries = 8;
    let barrier = Arc::new(Barrier::new(deliveries));
    let mut consumers = Vec::new();
    for delivery in 0..deliveries {
        let (engine, barrier, transitions) = (engine.clone(), barrier.clone(), transitions.clone());
        consumers.push(tokio::spawn(async move {
            barrier.wait().await;
            // The queue's name scopes the key: another queue may reuse message ids.
            let key = StoreKey::new("orders-queue", message_id);
            let fingerprint = Fingerprint::of([body.as_slice()]);
            let outcome = engine
                .run_once(key, fingerprint, || async {
                    // The side effect: move order 81 from pending to paid.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    transitions.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, std::io::Error>(Bytes::from_static(b"order 81 is paid"))
                })
                .await
                .expect("the store is in memory and the handler cannot fail");
            let (how, output) = match outcome {
                Execution::Ran(output) => ("ran it", output),
                Execution::Replayed(output) => ("replayed", output),
            };
            println!(
                "delivery {delivery}: {how}: {}",
                String::from_utf8_lossy(&output)
            );
        }));
    }
    for consumer in consumers {
        consumer.await.expect("a consumer panicked");
    }
    let transitions = transitions.load(Ordering::SeqCst);
    println!("order transitions: {transitions} (deliveries: {deliveries})");
    assert_eq!(transitions, 1);
}
