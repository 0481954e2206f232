//! `grpc_payments`: the `payments` example's charges as a gRPC service (tonic + prost), safe
//! to retry.
//!
//! ```text
//! cargo run --example grpc_payments
//! DATABASE_URL=postgres://root@127.0.0.1/test cargo run --example grpc_payments
//! ```
//!
//! The messages and the service are written out by hand (`messages.rs`, `service.rs`), as
//! prost and tonic would generate them from the `.proto` in `messages.rs`: no `protoc`, no
//! build script.
//!
//! # Methods
//!
//! - `payments.Payments/Charge(ChargeRequest{amount_cents, currency, request_id})` →
//!   `Receipt{charge_id, amount_cents, currency}`. A key is required: the `idempotency-key`
//!   metadata entry, or else the message's `request_id` (Google AIP-155); without either,
//!   `INVALID_ARGUMENT`. Keys are scoped per caller, named by the `authorization` metadata:
//!   a keyed call without it gets `UNAUTHENTICATED` and charges nothing. Each run of the
//!   handler records one charge (a row with no unique constraint on the key: the layer alone
//!   prevents doubles). The same key again gets the identical reply (message, metadata and
//!   trailers), whether the first call finished or is still running (it waits and replays,
//!   up to the call's deadline: then `DEADLINE_EXCEEDED`); the same key with another message
//!   gets `INVALID_ARGUMENT`. An invalid message (`amount_cents` outside 1..=1000000,
//!   `currency` not 3 uppercase letters) gets `INVALID_ARGUMENT`, charges nothing and is not
//!   stored, so the fixed call may reuse its key.
//! - `payments.Payments/Stats(StatsRequest{})` → `StatsReply{charges}`: the charges recorded
//!   in this database (or process). Not behind the layer.
//!
//! # Environment
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `BIND` | address to listen on | `127.0.0.1:50051` |
//! | `DATABASE_URL` | `postgres://`: holds the charges AND the idempotency records, and the layer runs in the transactional mode (the claim, the charge and the stored reply commit in ONE transaction), so processes sharing it act as one service | in-memory |
//! | `IDEMPOTENCY_DISABLED` | `1`: the layer passes every call through (a benchmark baseline) | unset |
//! | `PAYMENTS_HANDLER_DELAY_MS` | a charge waits this long before it is recorded (widens race windows) | 0 |
//! | `LOG_FORMAT` | `json`: one JSON object a log line; otherwise text, coloured only on a terminal without `NO_COLOR` | text |
//!
//! # Crashes
//!
//! With PostgreSQL a process killed at any instant leaves either nothing (a retry charges
//! once) or the charge and its stored reply (a retry replays it).

#[path = "../common/mod.rs"]
mod common;
mod config;
mod ledger;
mod messages;
mod service;

use std::{process::ExitCode, sync::Arc, time::Duration};

use sqlx::postgres::PgPoolOptions;
use tower_idempotency::{
    is_final_grpc_by_default,
    store::{spawn_purger, MemoryStore, PostgresStore},
    transactional::Transactional,
    IdempotencyLayer,
};

use crate::{config::Config, ledger::Ledger, service::Payments};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// gRPC's status code for a call the service refused as invalid.
const INVALID_ARGUMENT: i32 = 3;

#[tokio::main]
async fn main() -> ExitCode {
    common::init_logs("info,sqlx=warn", std::io::stdout);
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!("grpc_payments stopped: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), Error> {
    let config = Config::from_env()?;
    let (ledger, layer, purger) = match &config.database_url {
        Some(url) => {
            let pool = PgPoolOptions::new()
                .max_connections(16)
                .connect(url)
                .await
                .map_err(|e| format!("cannot connect to DATABASE_URL: {e}"))?;
            let ledger = Ledger::postgres(pool.clone()).await?;
            let store = PostgresStore::new(pool);
            store.migrate().await?;
            // Expired records count as absent but take space: purged once a minute.
            let purger = spawn_purger(store.clone(), Duration::from_secs(60), 1_000);
            let layer = IdempotencyLayer::transactional(Transactional::new(store));
            (ledger, layer, Some(purger))
        }
        None => {
            let ledger = Ledger::Memory(Default::default());
            (ledger, IdempotencyLayer::new(MemoryStore::new()), None)
        }
    };
    let mode = if config.database_url.is_some() {
        "transactional"
    } else {
        "separate"
    };
    let description = format!(
        "charges: {}, idempotency: {}, mode: {mode}{}",
        ledger.name(),
        ledger.name(),
        if config.idempotency_disabled {
            ", idempotency layer DISABLED"
        } else {
            ""
        }
    );
    let layer = layer
        .require_key()
        // AIP-155: a client that sends no metadata key has it read from the message.
        .key_from_message(messages::CHARGE, messages::request_id)
        // The handler's INVALID_ARGUMENT charged nothing: not stored, so the fixed call may
        // reuse its key. (The layer's own INVALID_ARGUMENT answers are never stored anyway.)
        .store_grpc_status(|code| code != INVALID_ARGUMENT && is_final_grpc_by_default(code))
        .enabled(!config.idempotency_disabled);
    // Kept to wait for detached handlers at shutdown.
    let engine = layer.engine().clone();
    let payments = Payments::new(Arc::new(ledger), config.handler_delay, &layer);

    let listener = tokio::net::TcpListener::bind(&config.bind).await?;
    tracing::info!(
        "grpc_payments listening on http://{} ({description})",
        listener.local_addr()?
    );
    tonic::transport::Server::builder()
        .add_service(payments)
        .serve_with_incoming_shutdown(
            tonic::transport::server::TcpIncoming::from(listener),
            common::shutdown_signal(),
        )
        .await?;
    common::drain(&engine).await;
    if let Some(purger) = purger {
        purger.abort();
    }
    Ok(())
}
