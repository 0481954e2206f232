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
        Arc, Mutex,
    },
    time::Duration,
};

use axum::{
    body::{to_bytes, Body},
    http::{HeaderMap, Request, StatusCode},
    routing::post,
    Router,
};
use bytes::Bytes;
use commit_answers::{assert_retryable_503, send};
use proxy::Proxy;
use sqlx::{
    mysql::{MySqlDatabaseError, MySqlPoolOptions},
    postgres::PgPoolOptions,
    MySql, MySqlConnection, MySqlPool,
};
use tokio::sync::Notify;
use tower::ServiceExt;
use tower_idempotency::{
    store::{MySqlStore, PostgresStore},
    transactional::{Transactional, TransactionalStore, Tx},
    Engine, IdempotencyLayer, StoreKey, Token,
};

/// The store time limit of these tests: short, so a bounded wait ends quickly.
const STORE_TIMEOUT: Duration = Duration::from_secs(1);

/// Longer than any answer here may take once bounded; an unbounded wait hits it.
const PATIENCE: Duration = Duration::from_secs(15);

/// The transactional layer on `store` with [`STORE_TIMEOUT`], on a route whose handler is
/// `handler`, keyed by the `idempotency-key` header in one scope (required when `keyed`,
/// optional otherwise).
fn app<S, H, T>(store: &S, keyed: bool, handler: H) -> Router
where
    S: TransactionalStore,
    H: axum::handler::Handler<T, ()>,
    T: 'static,
{
    let engine = Engine::builder(store.clone())
        .store_timeout(STORE_TIMEOUT)
        .build()
        .expect("valid timings");
    let mut layer =
        IdempotencyLayer::transactional(Transactional::with_engine(store.clone(), engine))
            .scope_with(|_| "tx-edges".to_owned());
    if keyed {
        layer = layer.require_key();
    }
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
    let app = app(&proxied, true, handler);

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
    let app = app(&store, true, handler);

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

/// MariaDB picks the owner's transaction as a deadlock's victim (1213) and rolls it back,
/// claim included. Its handler catches the error and carries on: the effect it writes next
/// must not persist (before the fix it ran in autocommit and stayed, without a record), the
/// client must not be told it ran, and the retry runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mariadb_deadlock_victim_that_carries_on_leaves_no_effect() {
    deadlock_victim_carries_on(true, StatusCode::CREATED).await;
}

/// The handler gives up on the deadlock and answers 500. Its failure is an echo of the
/// rollback the server made under it, not the request's outcome: a keyed request is answered
/// as a duplicate would be — here nobody holds the key, so `not-committed` (503, retry), and the
/// retry runs once. On Galera the same path replays the winner's answer instead of a 500
/// (tests/galera.rs). Mutant: `lost_under_handler` (src/http/transactional.rs) always plain
/// rollback -> the client gets the handler's 500 and this test fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mariadb_deadlock_victim_that_answers_500_is_told_not_committed() {
    deadlock_victim_carries_on(true, StatusCode::INTERNAL_SERVER_ERROR).await;
}

/// The same without a key (the key is optional): nothing is recorded, but the request's
/// transaction is just as gone, and what the handler wrote after the rollback must not be
/// committed in its place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mariadb_deadlock_victim_without_a_key_commits_nothing() {
    deadlock_victim_carries_on(false, StatusCode::CREATED).await;
}

/// The deadlock scene: the handler's transaction and a heavier rival lock two rows in
/// opposite orders, InnoDB rolls the handler's back, and the handler writes its effect anyway
/// and answers `after_deadlock`. Keyed or not, that effect must not persist and the answer must
/// be `not-committed`; the retry (no deadlock) writes it once.
async fn deadlock_victim_carries_on(keyed: bool, after_deadlock: StatusCode) {
    let Some((pool, store, table)) = mariadb(4).await else {
        return;
    };
    let rows = format!("{table}_rows");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {rows} (id INT PRIMARY KEY, v INT NOT NULL) ENGINE=InnoDB; \
         INSERT INTO {rows} VALUES (1, 0), (2, 0)"
    )))
    .execute(&pool)
    .await
    .expect("create the rows both transactions lock");

    let key = fresh_key();
    let (handler_holds_1, rival_holds_2) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let deadlocked = Arc::new(Mutex::new(None::<u16>));
    // The rival: heavier (it wrote 50 rows first), so InnoDB rolls the owner back instead.
    let rival = {
        let (pool, rows) = (pool.clone(), rows.clone());
        let (handler_holds_1, rival_holds_2) = (handler_holds_1.clone(), rival_holds_2.clone());
        tokio::spawn(async move {
            let mut tx = pool.begin().await.expect("the rival's transaction");
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {rows} SELECT seq, 0 FROM seq_100_to_149"
            )))
            .execute(&mut *tx)
            .await
            .expect("the rival's weight");
            handler_holds_1.notified().await;
            bump(&mut tx, &rows, 2)
                .await
                .expect("the rival takes row 2");
            rival_holds_2.notify_one();
            bump(&mut tx, &rows, 1)
                .await
                .expect("the rival gets row 1 once the owner is rolled back");
            tx.rollback().await.expect("roll the rival back");
        })
    };
    let first = Arc::new(AtomicBool::new(true));
    let handler = {
        let (table, key, deadlocked) = (table.clone(), key.clone(), deadlocked.clone());
        move |mut tx: Tx<MySql>| {
            let (table, rows, key, first) =
                (table.clone(), rows.clone(), key.clone(), first.clone());
            let (handler_holds_1, rival_holds_2, deadlocked) = (
                handler_holds_1.clone(),
                rival_holds_2.clone(),
                deadlocked.clone(),
            );
            async move {
                if first.swap(false, Ordering::SeqCst) {
                    bump(&mut tx, &rows, 1)
                        .await
                        .expect("the owner takes row 1");
                    handler_holds_1.notify_one();
                    rival_holds_2.notified().await;
                    let error = bump(&mut tx, &rows, 2)
                        .await
                        .expect_err("row 2 is the rival's, which waits for row 1");
                    *deadlocked.lock().unwrap() = error
                        .as_database_error()
                        .and_then(|e| e.try_downcast_ref::<MySqlDatabaseError>())
                        .map(MySqlDatabaseError::number);
                    // Carries on, as if the deadlock did not matter, and ignores what follows.
                    let _ = insert_mysql_effect(&mut tx, &table, &key).await;
                    return after_deadlock;
                }
                insert_mysql_effect(&mut tx, &table, &key)
                    .await
                    .expect("write the effect");
                StatusCode::CREATED
            }
        }
    };
    let app = app(&store, keyed, handler);
    let send = |app: Router| {
        let key = keyed.then(|| key.key().to_owned());
        send_maybe_keyed(app, key)
    };

    let answer = send(app.clone()).await;
    rival.await.expect("the rival's task");
    assert_eq!(
        *deadlocked.lock().unwrap(),
        Some(1213),
        "no deadlock happened"
    );
    assert_eq!(
        effects_table::count_rows(&pool, &table, "k", &key).await,
        0,
        "the effect written after the rollback persisted without its record"
    );
    assert_retryable_503(&answer, "urn:tower-idempotency:not-committed");

    let (status, _, _) = send(app).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(effects_table::count_rows(&pool, &table, "k", &key).await, 1);
}

/// A pool of `connections` on `TEST_MYSQL_URL`, a migrated store on it and a new effects
/// table; `None` (skip) without the URL.
async fn mariadb(connections: u32) -> Option<(MySqlPool, MySqlStore, String)> {
    let url = backends::url_or_skip("TEST_MYSQL_URL")?;
    let pool = MySqlPoolOptions::new()
        .max_connections(connections)
        .connect(&url)
        .await
        .expect("TEST_MYSQL_URL is set but unreachable");
    let store = MySqlStore::new(pool.clone());
    store.migrate().await.expect("migrate");
    let table = effects_table::create(&pool, "tx_edges").await;
    Some((pool, store, table))
}

/// One `POST /`, with `key` as its idempotency key when given.
async fn send_maybe_keyed(app: Router, key: Option<String>) -> (StatusCode, HeaderMap, Bytes) {
    match key {
        Some(key) => send(app, key, None).await,
        None => {
            let request = Request::post("/").body(Body::empty()).unwrap();
            let response = app.oneshot(request).await.unwrap();
            let (parts, body) = response.into_parts();
            let body = to_bytes(body, usize::MAX).await.unwrap();
            (parts.status, parts.headers, body)
        }
    }
}

/// `UPDATE` of row `id` of `rows`: takes its lock, or waits for it.
async fn bump(tx: &mut MySqlConnection, rows: &str, id: i32) -> Result<(), sqlx::Error> {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE {rows} SET v = v + 1 WHERE id = ?"
    )))
    .bind(id)
    .execute(tx)
    .await
    .map(drop)
}

/// One effect row for `key` in `table`, on the request's transaction.
async fn insert_mysql_effect(
    tx: &mut MySqlConnection,
    table: &str,
    key: &StoreKey,
) -> Result<(), sqlx::Error> {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {table} (k) VALUES (?)"
    )))
    .bind(key.key())
    .execute(tx)
    .await
    .map(drop)
}

/// The owner's session state does not leak into the pool, and sqlx still sees a transaction:
/// a handler's `begin()` on it makes a savepoint (its rollback keeps the outer writes), and
/// the one pooled connection comes back with `autocommit` on and no transaction open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mariadb_owner_nests_savepoints_and_hands_its_connection_back_clean() {
    let Some((pool, store, table)) = mariadb(1).await else {
        return;
    };
    let (kept, undone) = (fresh_key(), fresh_key());
    let handler = {
        let (table, kept, undone) = (table.clone(), kept.clone(), undone.clone());
        move |mut tx: Tx<MySql>| {
            let (table, kept, undone) = (table.clone(), kept.clone(), undone.clone());
            async move {
                insert_mysql_effect(&mut tx, &table, &kept).await.unwrap();
                let mut nested = sqlx::Connection::begin(&mut *tx)
                    .await
                    .expect("a savepoint");
                insert_mysql_effect(&mut nested, &table, &undone)
                    .await
                    .unwrap();
                nested.rollback().await.expect("roll back to the savepoint");
                StatusCode::CREATED
            }
        }
    };
    let app = app(&store, true, handler);
    let (status, _, _) = send(app, kept.key().to_owned(), None).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(
        effects_table::count_rows(&pool, &table, "k", &kept).await,
        1
    );
    assert_eq!(
        effects_table::count_rows(&pool, &table, "k", &undone).await,
        0
    );

    let (autocommit, in_transaction): (i64, u64) =
        sqlx::query_as("SELECT @@autocommit, @@in_transaction")
            .fetch_one(&pool)
            .await
            .expect("ask the pooled connection");
    assert_eq!((autocommit, in_transaction), (1, 0));
}
