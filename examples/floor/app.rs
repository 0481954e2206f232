//! The service of the floor comparison (issue 36): parse a JSON charge, count the execution,
//! answer 201 with JSON. The same router bare, behind the floor, and behind the library's
//! layer on the memory store.

use std::sync::{
    atomic::{AtomicU64, Ordering},
    Arc,
};

use axum::{extract::State, http::StatusCode, routing::post, Json, Router};
use serde::{Deserialize, Serialize};
use tower_idempotency::{store::MemoryStore, IdempotencyLayer};

use crate::floor_layer::FloorLayer;

/// The request body every subject is sent.
#[allow(dead_code)] // the bench sends it; the server reads what it is sent
pub const BODY: &str = r#"{"amount":1200,"currency":"EUR"}"#;

/// What wraps the service.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Subject {
    /// Nothing: the service alone.
    Bare,
    /// The least any idempotency layer must do (see `floor_layer`).
    Floor,
    /// `IdempotencyLayer` on the memory store.
    Layer,
}

impl Subject {
    /// Every subject, in the order the comparisons run them.
    pub const ALL: [Subject; 3] = [Subject::Bare, Subject::Floor, Subject::Layer];

    /// The subject's name on command lines and in tables.
    pub fn name(self) -> &'static str {
        match self {
            Subject::Bare => "bare",
            Subject::Floor => "floor",
            Subject::Layer => "layer",
        }
    }

    /// The subject named `name`.
    pub fn named(name: &str) -> Option<Subject> {
        Subject::ALL.into_iter().find(|s| s.name() == name)
    }
}

#[derive(Deserialize)]
struct Charge {
    amount: u64,
    currency: String,
}

#[derive(Serialize)]
struct Charged {
    id: u64,
    amount: u64,
    currency: String,
}

async fn charge(
    State(executions): State<Arc<AtomicU64>>,
    Json(charge): Json<Charge>,
) -> (StatusCode, Json<Charged>) {
    let id = executions.fetch_add(1, Ordering::Relaxed) + 1;
    let charged = Charged {
        id,
        amount: charge.amount,
        currency: charge.currency,
    };
    (StatusCode::CREATED, Json(charged))
}

/// The router of `subject`, counting its executions in `executions`. The layer's memory store
/// holds 8 GiB: a bench sends millions of distinct keys, more than the default budget holds
/// (a full store refuses new keys).
pub fn router(subject: Subject, executions: Arc<AtomicU64>) -> Router {
    let router = Router::new().route("/payments", post(charge));
    let router = match subject {
        Subject::Bare => router,
        Subject::Floor => router.layer(FloorLayer::default()),
        Subject::Layer => router.layer(IdempotencyLayer::new(
            MemoryStore::builder().max_bytes(8 << 30).build(),
        )),
    };
    // What `axum::serve` does once per connection: the route (and the layer on it) is built
    // now, not again for every request.
    router.with_state(executions)
}
