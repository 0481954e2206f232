//! `processor`: a stand-in card processor over HTTP, the downstream of `payments` when that
//! one runs with `PROCESSOR_URL` (recovery points: see `examples/payments/processor.rs`).
//!
//! ```text
//! cargo run --example processor
//! curl -i localhost:3100/charges -H 'Idempotency-Key: k1' -H 'Authorization: Bearer shop' \
//!      -d '{"amount": 1200, "currency": "EUR"}'
//! ```
//!
//! Like a real processor it honours `Idempotency-Key` (required, scoped by `Authorization`),
//! through this library's layer: the same key again replays the first charge.
//!
//! - `POST /charges {"amount": N, "currency": "EUR"}` → `201 {"id": "ch_…", "amount", "currency"}`
//! - `GET /stats` → `{"charges": N}`: how many executions recorded a charge.
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `BIND` | address to listen on | `127.0.0.1:3100` |
//! | `DATABASE_URL` | `postgres://…`: its charges and idempotency records live there (table `processor_charges`) | in memory |
//! | `PROCESSOR_DELAY_MS` | each charge takes this long | 0 |

#[path = "common/mod.rs"]
mod common;

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use axum::{extract::State, http::StatusCode, routing::post, Json, Router};
use serde::Deserialize;
use serde_json::json;
use tower_idempotency::{
    store::{MemoryStore, PostgresStore},
    IdempotencyLayer,
};

type Error = Box<dyn std::error::Error + Send + Sync>;

#[derive(Deserialize)]
struct NewCharge {
    amount: i64,
    currency: String,
}

/// Where charges are counted: this process, or the processor's own database.
#[derive(Clone)]
enum Ledger {
    Memory(Arc<AtomicU64>),
    Postgres(sqlx::PgPool),
}

#[derive(Clone)]
struct App {
    ledger: Ledger,
    delay: Duration,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    common::init_logs("info,sqlx=warn", std::io::stdout);
    match run().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!("processor stopped: {error}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), Error> {
    let delay = Duration::from_millis(common::number("PROCESSOR_DELAY_MS", 0)?);
    let (ledger, layer, name) = match common::var("DATABASE_URL") {
        Some(url) => {
            let pool = sqlx::PgPool::connect(&url).await?;
            sqlx::query(
                "CREATE TABLE IF NOT EXISTS processor_charges (
                    id       TEXT   NOT NULL PRIMARY KEY,
                    amount   BIGINT NOT NULL,
                    currency TEXT   NOT NULL)",
            )
            .execute(&pool)
            .await?;
            let store = PostgresStore::new(pool.clone());
            store.migrate().await?;
            (
                Ledger::Postgres(pool),
                IdempotencyLayer::new(store),
                "postgres",
            )
        }
        None => (
            Ledger::Memory(Arc::default()),
            IdempotencyLayer::new(MemoryStore::new()),
            "memory",
        ),
    };
    let engine = layer.engine().clone();
    let app = Router::new()
        .route("/charges", post(charge).layer(layer.require_key()))
        .route("/stats", axum::routing::get(stats))
        .with_state(App { ledger, delay });
    let bind = common::var("BIND").unwrap_or_else(|| "127.0.0.1:3100".to_owned());
    let listener = tokio::net::TcpListener::bind(&bind).await?;
    tracing::info!(
        "processor listening on http://{} (charges: {name})",
        listener.local_addr()?
    );
    axum::serve(listener, app)
        .with_graceful_shutdown(common::shutdown_signal())
        .await?;
    common::drain(&engine).await;
    Ok(())
}

/// `POST /charges`: one charge per execution; the layer makes a repeated key replay.
async fn charge(
    State(app): State<App>,
    Json(new): Json<NewCharge>,
) -> Result<(StatusCode, Json<serde_json::Value>), (StatusCode, String)> {
    tokio::time::sleep(app.delay).await;
    let id = format!("ch_{:016x}", rand::random::<u64>());
    match &app.ledger {
        Ledger::Memory(count) => {
            count.fetch_add(1, Ordering::SeqCst);
        }
        Ledger::Postgres(pool) => {
            sqlx::query("INSERT INTO processor_charges (id, amount, currency) VALUES ($1, $2, $3)")
                .bind(&id)
                .bind(new.amount)
                .bind(&new.currency)
                .execute(pool)
                .await
                .map_err(|e| (StatusCode::SERVICE_UNAVAILABLE, e.to_string()))?;
        }
    }
    tracing::info!(%id, amount = new.amount, "charged");
    let body = json!({"id": id, "amount": new.amount, "currency": new.currency});
    Ok((StatusCode::CREATED, Json(body)))
}

/// `GET /stats`: the charges recorded so far.
async fn stats(State(app): State<App>) -> Result<Json<serde_json::Value>, (StatusCode, String)> {
    let charges = match &app.ledger {
        Ledger::Memory(count) => count.load(Ordering::SeqCst) as i64,
        Ledger::Postgres(pool) => sqlx::query_scalar("SELECT count(*) FROM processor_charges")
            .fetch_one(pool)
            .await
            .map_err(|e| (StatusCode::SERVICE_UNAVAILABLE, e.to_string()))?,
    };
    Ok(Json(json!({ "charges": charges })))
}
