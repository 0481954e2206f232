//! The transactional mode at its edges, on real PostgreSQL and MariaDB, effects counted in the
//! database:
//!
//! - a rollback over a network that went silent is bounded by the store time limit, so the
//!   handler's 5xx still reaches the client;
//! - PostgreSQL ends an owner's session for `idle_in_transaction_session_timeout` while its
//!   handler waits on something else: nothing committed, and the answer says so
//!   (`not-committed`), not `outcome-unknown`;
//! - MariaDB rolls an owner's transaction back for a deadlock (1213) that its handler catches
//!   and carries on from: the later statements must not run in autocommit (where their effects
//!   would persist without the record), and the retry runs once.

#![cfg(all(feature = "postgres", feature = "mysql", feature = "axum"))]

#[path = "common/backends.rs"]
mod backends;
#[path = "common/commit_answers.rs"]
mod commit_answers;
#[path = "common/effects_table.rs"]
mod effects_table;
#[path = "common/pg_effects.rs"]
mod pg_effects;
#[path = "common/proxy.rs"]
mod proxy;

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use axum::{http::StatusCode, routing::post, Router};
use commit_answers::{assert_retryable_503, send};
use proxy::Proxy;
use sqlx::postgres::PgPoolOptions;
use tower_idempotency::{
    store::PostgresStore,
    transactional::{Transactional, TransactionalStore, Tx},
    Engine, IdempotencyLayer, StoreKey, Token,
};

/// The store time limit of these tests: short, so a bounded wait ends quickly.
const STORE_TIMEOUT: Duration = Duration::from_secs(1);

/// Longer than any answer here may take once bounded; an unbounded wait hits it.
const PATIENCE: Duration = Duration::from_secs(15);

/// The transactional layer on `store` with [`STORE_TIMEOUT`], on a route whose handler is
/// `handler`, keyed by the `idempotency-key` header in one scope.
fn app<S, H, T>(store: &S, handler: H) -> Router
where
    S: TransactionalStore,
    H: axum::handler::Handler<T, ()>,
    T: 'static,
{
    let engine = Engine::builder(store.clone())
        .store_timeout(STORE_TIMEOUT)
        .build()
        .expect("valid timings");
    let layer = IdempotencyLayer::transactional(Transactional::with_engine(store.clone(), engine))
        .require_key()
        .scope_with(|_| "tx-edges".to_owned());
    Router::new().route("/", post(handler)).layer(layer)
}

fn fresh_key() -> StoreKey {
    StoreKey::new("tx-edges", Token::random().to_hex())
}

/// The handler answers 500 (its writes are rolled back) and the network to PostgreSQL goes
/// silent just then: the `ROLLBACK` is never answered. The client still gets the 500 once the
/// store time limit passed, the write never persists, and the retry runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_over_a_silent_network_is_bounded_by_the_store_time_limit() {
    let Some((store, table)) = pg_effects::store_and_table(2, "tx_edges").await else {
        return;
    };
    let options = (*store.pool().connect_options()).clone();
    let proxy = Proxy::start(options.get_host(), options.get_port()).await;
    let proxied = PostgresStore::new(
        PgPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(options.host("127.0.0.1").port(proxy.addr().port()))
            .await
            .expect("connect through the proxy"),
    );
    let key = fresh_key();
    let first = Arc::new(AtomicBool::new(true));
    let handler = {
        let (table, key, proxy) = (table.clone(), key.clone(), proxy.clone());
        move |mut tx: Tx<sqlx::Postgres>| {
            let (table, key, proxy, first) =
                (table.clone(), key.clone(), proxy.clone(), first.clone());
            async move {
                insert_effect(&mut tx, &table, &key).await;
                if first.swap(false, Ordering::SeqCst) {
                    proxy.stall();
                    return StatusCode::INTERNAL_SERVER_ERROR;
                }
                StatusCode::CREATED
            }
        }
    };
    let app = app(&proxied, handler);

    let answer = tokio::time::timeout(PATIENCE, send(app.clone(), key.key().to_owned(), None))
        .await
        .expect("the 500 waited on a ROLLBACK that is never answered");
    assert_eq!(answer.0, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(pg_effects::effects(&store, &table, &key).await, 0);

    // The network is back: the abandoned transaction ends with its connection, and the retry
    // runs, once.
    proxy.restore();
    let (status, _, _) = tokio::time::timeout(PATIENCE, send(app, key.key().to_owned(), None))
        .await
        .expect("the retry answers");
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(pg_effects::effects(&store, &table, &key).await, 1);
}

/// The handler waits on something else (an external call) inside its transaction past the
/// session's `idle_in_transaction_session_timeout`, which PostgreSQL then ends. Nothing
/// committed, and the answer says so: `503 not-committed`, not `outcome-unknown`. The retry
/// runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_ended_for_idling_in_its_transaction_is_not_committed() {
    let Some((store, table)) = pg_effects::store_and_table(2, "tx_edges").await else {
        return;
    };
    let key = fresh_key();
    let first = Arc::new(AtomicBool::new(true));
    let handler = {
        let (table, key) = (table.clone(), key.clone());
        move |mut tx: Tx<sqlx::Postgres>| {
            let (table, key, first) = (table.clone(), key.clone(), first.clone());
            async move {
                insert_effect(&mut tx, &table, &key).await;
                if first.swap(false, Ordering::SeqCst) {
                    // This session's own limit, shorter than the wait that follows.
                    sqlx::raw_sql("SET LOCAL idle_in_transaction_session_timeout = '200ms'")
                        .execute(&mut *tx)
                        .await
                        .expect("set the idle limit");
                    drop(tx);
                    tokio::time::sleep(Duration::from_millis(1000)).await;
                }
                StatusCode::CREATED
            }
        }
    };
    let app = app(&store, handler);

    let answer = send(app.clone(), key.key().to_owned(), None).await;
    assert_retryable_503(&answer, "urn:tower-idempotency:not-committed");
    assert_eq!(pg_effects::effects(&store, &table, &key).await, 0);

    let (status, _, _) = send(app, key.key().to_owned(), None).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(pg_effects::effects(&store, &table, &key).await, 1);
}

/// One effect row for `key` in `table`, on the request's transaction.
async fn insert_effect(tx: &mut sqlx::PgConnection, table: &str, key: &StoreKey) {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {table} (k) VALUES ($1)"
    )))
    .bind(key.key())
    .execute(tx)
    .await
    .expect("write the effect");
}
