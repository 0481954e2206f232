//! `payments`: a small axum service that charges cards, safe to retry.
//!
//! ```text
//! cargo run --example payments
//! DATABASE_URL=postgres://root@127.0.0.1/test cargo run --example payments
//! DATABASE_URL=sqlite://payments.db REDIS_URL=redis://127.0.0.1:6379 cargo run --example payments
//! curl -i localhost:3000/payments -H 'Idempotency-Key: 4f1c' -H 'Authorization: Bearer alice' \
//!      -d '{"amount": 1200, "currency": "EUR"}'
//! ```
//!
//! The contract (routes, environment, statuses) is in `shared/payments-example.md`; the
//! environment variables are read in `config.rs`.
//!
//! With `AMQP_URL` or `NATS_URL` (and a SQL `DATABASE_URL`), every new payment also writes a
//! `payment.created` event to the outbox in the charge's transaction, and the process relays
//! the outbox to the broker (unless `OUTBOX_RELAY=0`), for `cargo run --example receipts`:
//! see `events.rs` and `shared/pipeline-example.md`.
//!
//! ```text
//! DATABASE_URL=postgres://root@127.0.0.1/test NATS_URL=nats://127.0.0.1:4222 \
//!     cargo run --example payments
//! ```

mod backends;
mod config;
mod events;
mod handlers;
mod payments;
#[path = "../pipeline/mod.rs"]
mod pipeline;
mod problem;
mod sql_payments;

use std::{process::ExitCode, sync::Arc, time::Duration};

use axum::{
    middleware,
    routing::{get, post},
    Router,
};
use tower_idempotency::store::spawn_purger;

use crate::config::Config;

/// What the handlers share.
#[derive(Clone)]
pub struct App {
    payments: Arc<dyn payments::Payments>,
    config: Arc<Config>,
    /// Create calls so far in this process (for `PAYMENTS_FAIL_FIRST`).
    create_calls: Arc<std::sync::atomic::AtomicU64>,
}

#[tokio::main]
async fn main() -> ExitCode {
    // sqlx logs PostgreSQL's "already exists, skipping" notices of every start at INFO.
    let default_filter = "info,sqlx=warn";
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| default_filter.into()),
        )
        .init();
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!("payments stopped: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), backends::Error> {
    let config = Config::from_env()?;
    // The crate records its metrics (requests by outcome, waits, store latency and errors,
    // claims in flight) through the `metrics` facade; this recorder keeps them for
    // `GET /metrics` in the Prometheus text format.
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .expect("the first and only recorder of this process");
    let broker = pipeline::Broker::configured()?;

    let backends = backends::connect(&config).await?;
    // Expired records are harmless (they count as absent) but take space: delete them once
    // a minute in short batches. Each process runs its own purger.
    let purger = spawn_purger(backends.idempotency.clone(), Duration::from_secs(60), 1_000);

    // Keys are scoped by caller (the `Authorization` header); `require_caller` answers 401
    // before the layer sees a request without one.
    let idempotency = backends.layer.enabled(!config.idempotency_disabled);

    // Kept to wait for detached handlers at shutdown.
    let engine = idempotency.engine().clone();

    let app = App {
        payments: backends.payments,
        config: Arc::new(config.clone()),
        create_calls: Arc::default(),
    };
    let router = Router::new()
        // Creating a charge must never happen twice: the key is required.
        .route(
            "/payments",
            post(handlers::create)
                .layer(idempotency.clone().require_key())
                .layer(middleware::from_fn(handlers::require_caller)),
        )
        // A state transition may carry a key (optional): a retried PATCH replays its first
        // answer even though its If-Match has gone stale meanwhile.
        .route(
            "/payments/{id}",
            get(handlers::read)
                .patch(handlers::update)
                .layer(idempotency.clone())
                .layer(middleware::from_fn(handlers::require_caller)),
        )
        .route("/stats", get(handlers::stats))
        .route(
            "/metrics",
            get(move || std::future::ready(metrics.render())),
        )
        .with_state(app);

    // The events are written whenever a broker is configured; this relay is optional (another
    // process may relay them: `outbox_relay`).
    let (relay, events) = match (broker, &backends.database) {
        (Some(broker), Some(database)) if config.outbox_relay => {
            let (relay, destination) = events::RunningRelay::start(database, broker).await?;
            (
                Some(relay),
                format!(", events: outbox relayed to {destination}"),
            )
        }
        (Some(_), _) => (None, ", events: outbox, relayed elsewhere".to_owned()),
        (None, _) => (None, String::new()),
    };

    let listener = tokio::net::TcpListener::bind(&config.bind).await?;
    tracing::info!(
        "payments listening on http://{} ({}{events}{})",
        listener.local_addr()?,
        backends.description,
        if config.idempotency_disabled {
            ", idempotency layer DISABLED"
        } else {
            ""
        }
    );
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown_signal())
        .await?;
    // Handlers whose clients hung up run on, detached: let them finish and record their
    // outcome, rather than leave their keys claimed until the lease runs out.
    if tokio::time::timeout(Duration::from_secs(30), engine.drained())
        .await
        .is_err()
    {
        tracing::warn!(
            in_flight = engine.in_flight(),
            "shut down with handlers still running"
        );
    }
    // Stopped after the handlers, so it can still take their events; a row committed after
    // its last batch stays unsent for the next relay (or this service's next start).
    if let Some(relay) = relay {
        relay.stop().await;
    }
    purger.abort();
    Ok(())
}

/// Resolves on Ctrl-C or SIGTERM, so in-flight requests finish before the process exits.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = terminate => {},
    }
    tracing::info!("shutting down");
}
