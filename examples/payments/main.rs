//! `payments`: a small axum service that charges cards, safe to retry.
//!
//! ```text
//! cargo run --example payments --features axum
//! curl -i localhost:3000/payments -H 'Idempotency-Key: 4f1c' -H 'Authorization: Bearer alice' \
//!      -d '{"amount": 1200, "currency": "EUR"}'
//! ```
//!
//! The contract (routes, environment, statuses) is in `shared/payments-example.md`; the
//! environment variables are read in `config.rs`.

mod config;
mod handlers;
mod payments;
mod problem;

use std::sync::Arc;

use axum::{
    routing::{get, post},
    Router,
};
use tower_idempotency::{store::MemoryStore, IdempotencyLayer};

use crate::{config::Config, payments::MemoryPayments};

/// What the handlers share.
#[derive(Clone)]
pub struct App {
    payments: Arc<dyn payments::Payments>,
    config: Arc<Config>,
    /// Create calls so far in this process (for `PAYMENTS_FAIL_FIRST`).
    create_calls: Arc<std::sync::atomic::AtomicU64>,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let config = Config::from_env()?;
    if config.database_url.is_some() || config.redis_url.is_some() {
        return Err(
            "DATABASE_URL / REDIS_URL are not supported by this build of the example".into(),
        );
    }

    let payments: Arc<dyn payments::Payments> = Arc::new(MemoryPayments::default());
    let store = MemoryStore::new();
    let store_name = "memory";

    let idempotency = IdempotencyLayer::new(store)
        .lease(config.lease)
        .retention(config.retention)
        .enabled(!config.idempotency_disabled);

    let app = App {
        payments,
        config: Arc::new(config.clone()),
        create_calls: Arc::default(),
    };
    let router = Router::new()
        // Creating a charge must never happen twice: the key is required.
        .route(
            "/payments",
            post(handlers::create).layer(idempotency.clone().require_key()),
        )
        .route("/payments/{id}", get(handlers::read))
        .route("/stats", get(handlers::stats))
        .with_state(app);

    let listener = tokio::net::TcpListener::bind(&config.bind).await?;
    tracing::info!(
        "payments listening on http://{} (payments: memory, idempotency store: {}{})",
        listener.local_addr()?,
        store_name,
        if config.idempotency_disabled {
            ", layer DISABLED"
        } else {
            ""
        }
    );
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown_signal())
        .await?;
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
