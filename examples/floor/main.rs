//! The floor comparison over HTTP (issue 36): serves the JSON charge service bare, behind
//! the floor (the least any idempotency layer must do) or behind the library's layer, for an
//! HTTP load generator (`scripts/bench.d/floor.sh` drives it with wrk).
//!
//! ```text
//! cargo run --release --example floor -- layer      # bare | floor | layer
//! ```
//!
//! `BIND` sets the address (default 127.0.0.1:0: a free port); the address is printed as
//! `floor listening on http://...`. `GET /executions` answers how many charges ran.

mod app;
mod floor_layer;

use std::sync::{
    atomic::{AtomicU64, Ordering},
    Arc,
};

use axum::{extract::State, routing::get, Router};

#[tokio::main]
async fn main() {
    let name = std::env::args().nth(1).unwrap_or_default();
    let Some(subject) = app::Subject::named(&name) else {
        eprintln!("usage: floor bare|floor|layer");
        std::process::exit(2);
    };
    let executions = Arc::new(AtomicU64::new(0));
    let count =
        Router::new()
            .route(
                "/executions",
                get(|State(n): State<Arc<AtomicU64>>| async move {
                    n.load(Ordering::Relaxed).to_string()
                }),
            )
            .with_state(executions.clone());
    let app = app::router(subject, executions).merge(count);
    let bind = std::env::var("BIND").unwrap_or_else(|_| "127.0.0.1:0".into());
    let listener = tokio::net::TcpListener::bind(&bind)
        .await
        .unwrap_or_else(|error| panic!("cannot bind {bind}: {error}"));
    let address = listener.local_addr().expect("a bound address");
    println!("floor listening on http://{address} ({name})");
    axum::serve(listener, app).await.expect("the server failed");
}
