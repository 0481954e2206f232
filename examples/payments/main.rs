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
//! # Routes
//!
//! - `POST /payments`, body `{"amount": 1..=1000000, "currency": "EUR"}`: creates a charge.
//!   `Idempotency-Key` is required (400 without it or when malformed) and scoped per caller,
//!   named by `Authorization` (401 without it; nothing is recorded). `201` with the payment
//!   (`"status": "pending", "version": 1`), a strong `ETag` and `Location`. The same key again
//!   gets the identical response, whether the first request finished or is still running (it
//!   waits and replays); the same key with another body gets 422. An invalid body gets 422
//!   and records nothing, so it may be fixed and resent under the same key. Each run of the
//!   handler inserts one charge row with no unique constraint on the key: the layer alone
//!   prevents doubles. In the separate mode, a handler whose hold on its key ran out before
//!   it charged (the process stalled past the lease, or lost its store) charges nothing and
//!   answers 503 `urn:payments:lease-lost`; a retry with the same key gets the outcome.
//! - `GET /payments/{id}`: `200` with the payment and its `ETag`, or `404`.
//! - `PATCH /payments/{id}`, body `{"status": "paid" | "refunded" | "failed"}`: `If-Match` is
//!   required (428 without it); a stale or non-matching tag gets 412 with the current `ETag`;
//!   success is `200` with the new version. One conditional update, no read first. An
//!   `Idempotency-Key` is optional here; with one, a retry replays the first answer.
//! - `GET /stats`: `{"charges": n}`, the charge rows in this database (or process).
//!
//! Errors are RFC 9457 `application/problem+json`.
//!
//! # Environment
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `BIND` | address to listen on | `127.0.0.1:3000` |
//! | `DATABASE_URL` | `postgres://`, `mysql://` or `sqlite://`: holds the payments AND the idempotency records, so processes sharing it act as one service | in-memory |
//! | `REDIS_URL` / `REDIS_CLUSTER_URLS` | keep the idempotency records in Redis (several comma-separated nodes name a cluster) | unset |
//! | `REDIS_REPLICA_WAIT_MS` | wait this long for one replica to acknowledge each claim | off |
//! | `IDEMPOTENCY_MODE` | `transactional`: claim, charge and stored response commit in ONE transaction (SQL `DATABASE_URL`, no Redis); `separate`: claim and completion are their own store calls | `transactional` with a SQL database and no Redis, else `separate` |
//! | `IDEMPOTENCY_LEASE_MS` | how long a claim outlives its owner's death | 30000 |
//! | `IDEMPOTENCY_TTL_SECS` | how long a completed key is remembered | 86400 |
//! | `IDEMPOTENCY_MEMORY_MB` | byte budget of the in-memory store | the store's default |
//! | `IDEMPOTENCY_DISABLED` | `1`: no layer at all (a benchmark baseline) | unset |
//! | `PAYMENTS_HANDLER_DELAY_MS` | sleep before recording a charge (widens race windows) | 0 |
//! | `PAYMENTS_DELAY_AFTER_CHARGE_MS` | sleep after writing the charge, before answering (and, transactional, before commit) | 0 |
//! | `PAYMENTS_FAIL_FIRST` | the first N creates answer 503 and record nothing (a flaky processor) | 0 |
//! | `LOG_FORMAT` | `json`: one JSON object a log line (for log shippers); otherwise text, coloured only on a terminal without `NO_COLOR` | text |
//! | `AMQP_URL` / `NATS_URL` / `KAFKA_URL` / `SQS_URL` | a broker for `payment.created` events (below; exactly one; their settings, and the SQS region and credentials, in `pipeline/mod.rs`) | unset |
//! | `OUTBOX_RELAY` | `0`: write outbox events but relay them from another process | `1` |
//! | `OUTBOX_REFUSAL_ATTEMPTS` / `OUTBOX_REFUSAL_DELAY_MS` | refusals of one outbox row before it is parked / the first wait after a refusal (doubling up to 1 min) | 10 / 1000 |
//! | `STARTUP_PATIENCE_SECS` | how long the first database and broker connections are tried again before the process gives up | 60 |
//! | `PROCESSOR_URL` | charge through a card processor (`cargo run --example processor`) in steps with recovery points (`processor.rs`; separate mode, PostgreSQL, MySQL / MariaDB or SQLite) | unset |
//! | `PAYMENTS_STEPS` | `off`: call the processor without steps, a fresh key per attempt (the baseline that charges twice after a crash) | on |
//! | `PAYMENTS_PAUSE_AT` | stop a request for good at a step boundary: `before-charge`, `after-charge`, `after-journal`, `after-local` (crash tests) | unset |
//! | `PAYMENTS_DELAY_BETWEEN_STEPS_MS` | sleep at every step boundary | 0 |
//!
//! A bad value stops the process at start with a message naming the variable (`config.rs`).
//!
//! # Crashes
//!
//! In `transactional` mode a process killed at any instant leaves either nothing (a retry
//! runs once) or the charge and its stored response (a retry replays it). In `separate` mode
//! a process killed between the charge and the completion leaves a charge whose key frees up
//! when the lease ends, and a retry then charges again: that mode is for effects outside the
//! database.
//!
//! # Events
//!
//! With one of `AMQP_URL`, `NATS_URL`, `KAFKA_URL`, `SQS_URL` (and a SQL `DATABASE_URL`),
//! every new payment also writes a `payment.created` event to the outbox in the charge's
//! transaction, and the process relays the outbox to the broker (unless `OUTBOX_RELAY=0`), for `cargo run --example receipts`
//! (see `events.rs`).
//!
//! ```text
//! DATABASE_URL=postgres://root@127.0.0.1/test NATS_URL=nats://127.0.0.1:4222 \
//!     cargo run --example payments
//! DATABASE_URL=postgres://root@127.0.0.1/test KAFKA_URL=127.0.0.1:9092 \
//!     cargo run --example payments
//! ```

mod backends;
mod config;
mod events;
mod handlers;
mod outage;
mod payments;
#[path = "../pipeline/mod.rs"]
mod pipeline;
mod problem;
mod processor;
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
    /// `PROCESSOR_URL`: payments are charged downstream, in steps (`processor.rs`).
    processor: Option<Arc<processor::Processor>>,
}

#[tokio::main]
async fn main() -> ExitCode {
    // sqlx logs PostgreSQL's "already exists, skipping" notices of every start at INFO.
    let default_filter = "info,sqlx=warn";
    pipeline::init_logs(default_filter, std::io::stdout);
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

    let processor = processor::Processor::configured(backends.database.as_ref()).await?;
    let app = App {
        processor,
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
        .with_graceful_shutdown(pipeline::shutdown_signal())
        .await?;
    pipeline::drain(&engine).await;
    // Stopped after the handlers, so it can still take their events; a row committed after
    // its last batch stays unsent for the next relay (or this service's next start).
    if let Some(relay) = relay {
        relay.stop().await;
    }
    purger.abort();
    Ok(())
}
