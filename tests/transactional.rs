//! The transactional mode against real databases: the operation's writes, the claim and the
//! stored outcome commit together or not at all, duplicates wait without holding a pooled
//! connection, and an owner that lost its connection can never commit its effects.
//!
//! Every test counts the operation's side effects as rows in the database, in a table of its
//! own, and runs against PostgreSQL, MariaDB and SQLite (each in its own module).
#![cfg(all(
    feature = "postgres",
    feature = "mysql",
    feature = "sqlite",
    feature = "axum"
))]

#[path = "common/backends.rs"]
mod backends;
#[path = "common/sqlite_file.rs"]
mod sqlite_file;

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
    engine::Execution,
    transactional::{Transactional, TxRunError},
    Fingerprint, StoreKey, Token,
};

fn fresh_key(name: &str) -> StoreKey {
    StoreKey::new(format!("tx-{}", Token::random().to_hex()), name)
}

fn fp(text: &str) -> Fingerprint {
    Fingerprint::of([text.as_bytes()])
}

fn effects_table() -> String {
    format!("tx_effects_{}", &Token::random().to_hex()[..12])
}

#[derive(Debug)]
struct Refused;

/// Generates the same tests for one database. `$open` opens a store on a pool of at most
/// `$max` connections (or `None` when the server is not configured), `$insert` is the
/// statement writing one effect row, `$kill` kills the given connection from elsewhere.
macro_rules! transactional_tests {
    ($db:ty, $store:ident, $conn:ty, insert: $insert:literal, count: $count:literal) => {
        async fn effect(conn: &mut $conn, table: &str, key: &StoreKey) -> Result<(), sqlx::Error> {
            sqlx::query(sqlx::AssertSqlSafe(format!($insert, t = table)))
                .bind(format!("{}/{}", key.scope(), key.key()))
                .execute(&mut *conn)
                .await
                .map(|_| ())
        }

        async fn effects(store: &$store, table: &str, key: &StoreKey) -> i64 {
            sqlx::query_scalar(sqlx::AssertSqlSafe(format!($count, t = table)))
                .bind(format!("{}/{}", key.scope(), key.key()))
                .fetch_one(store.pool())
                .await
                .expect("count effects")
        }

        async fn fixture(max: u32) -> Option<($store, String)> {
            let store = open(max).await?;
            store.migrate().await.expect("migrate");
            let table = effects_table();
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "CREATE TABLE {table} (k VARCHAR(600) NOT NULL)"
            )))
            .execute(store.pool())
            .await
            .expect("create the effects table");
            Some((store, table))
        }

        async fn drop_table(store: &$store, table: &str) {
            let _ = sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {table}")))
                .execute(store.pool())
                .await;
        }

        #[tokio::test]
        async fn run_once_commits_the_effect_with_its_record_and_then_replays() {
            let Some((store, table)) = fixture(4).await else {
                return;
            };
            let mode = Transactional::new(store.clone());
            let key = fresh_key("k");
            let runs = Arc::new(AtomicUsize::new(0));
            for delivery in 0..3 {
                let (table, runs) = (table.clone(), runs.clone());
                let key_for_op = key.clone();
                let execution = mode
                    .run_once(key.clone(), fp("m"), move |conn| {
                        Box::pin(async move {
                            runs.fetch_add(1, Ordering::SeqCst);
                            effect(conn, &table, &key_for_op).await?;
                            Ok::<_, sqlx::Error>(Bytes::from_static(b"done"))
                        })
                    })
                    .await
                    .expect("run_once");
                match execution {
                    Execution::Ran(out) => assert_eq!((delivery, out.as_ref()), (0, &b"done"[..])),
                    Execution::Replayed(out) => {
                        assert!(delivery > 0);
                        assert_eq!(out, "done")
                    }
                }
            }
            assert_eq!(runs.load(Ordering::SeqCst), 1, "the operation ran once");
            assert_eq!(effects(&store, &table, &key).await, 1, "one effect row");
            drop_table(&store, &table).await;
        }

        #[tokio::test]
        async fn a_failing_operation_leaves_nothing_and_the_retry_runs() {
            let Some((store, table)) = fixture(4).await else {
                return;
            };
            let mode = Transactional::new(store.clone());
            let key = fresh_key("k");
            let failed = {
                let (table, key_for_op) = (table.clone(), key.clone());
                mode.run_once(key.clone(), fp("m"), move |conn| {
                    Box::pin(async move {
                        effect(conn, &table, &key_for_op).await.expect("effect");
                        Err::<Bytes, _>(Refused)
                    })
                })
                .await
            };
            assert!(
                matches!(failed, Err(TxRunError::Operation(Refused))),
                "{failed:?}"
            );
            assert_eq!(
                effects(&store, &table, &key).await,
                0,
                "the effect was rolled back"
            );
            use tower_idempotency::store::Store as _;
            assert_eq!(store.lookup(&key).await.unwrap(), None, "the key is free");
            let retried = {
                let (table, key_for_op) = (table.clone(), key.clone());
                mode.run_once(key.clone(), fp("m"), move |conn| {
                    Box::pin(async move {
                        effect(conn, &table, &key_for_op).await?;
                        Ok::<_, sqlx::Error>(Bytes::from_static(b"second"))
                    })
                })
                .await
                .expect("the retry")
            };
            assert_eq!(retried, Execution::Ran(Bytes::from_static(b"second")));
            assert_eq!(effects(&store, &table, &key).await, 1);
            drop_table(&store, &table).await;
        }

        /// 64 copies on two instances (two pools of 5 connections, as two processes would
        /// have): the owner holds one connection, the waiting copies hold none — those of the
        /// owner's instance wait to be woken, those of the other instance find the key busy
        /// without queueing behind the owner's row — so an unrelated key runs to the end on
        /// either instance while the owner is still held open by a gate that only those
        /// unrelated runs release. If waiters held connections, the unrelated runs could not
        /// get one and the test would time out.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_storm_on_small_pools_runs_once_and_leaves_room_for_other_keys() {
            const COPIES: usize = 64;
            let Some((store, table)) = fixture(5).await else {
                return;
            };
            let other_instance = Transactional::new(reopen(&store, 5).await);
            let instances = [Transactional::new(store.clone()), other_instance];
            let key = fresh_key("storm");
            let runs = Arc::new(AtomicUsize::new(0));
            let gate = Arc::new(tokio::sync::Notify::new());
            let barrier = Arc::new(Barrier::new(COPIES));
            let mut copies = Vec::new();
            for copy in 0..COPIES {
                let mode = instances[copy % 2].clone();
                let (key, table) = (key.clone(), table.clone());
                let (runs, gate, barrier) = (runs.clone(), gate.clone(), barrier.clone());
                copies.push(tokio::spawn(async move {
                    barrier.wait().await;
                    let key_for_op = key.clone();
                    mode.run_once(key, fp("storm"), move |conn| {
                        Box::pin(async move {
                            runs.fetch_add(1, Ordering::SeqCst);
                            effect(conn, &table, &key_for_op).await?;
                            gate.notified().await;
                            Ok::<_, sqlx::Error>(Bytes::from_static(b"storm-done"))
                        })
                    })
                    .await
                }));
            }
            // Wait until the owner is inside its operation.
            while runs.load(Ordering::SeqCst) == 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            for mode in instances
                .iter()
                .filter(|_| UNRELATED_KEYS_RUN_BESIDE_AN_OWNER)
            {
                let other = fresh_key("unrelated");
                let (table2, other_for_op) = (table.clone(), other.clone());
                let unrelated = tokio::time::timeout(
                    Duration::from_secs(20),
                    mode.run_once(other.clone(), fp("other"), move |conn| {
                        Box::pin(async move {
                            effect(conn, &table2, &other_for_op).await?;
                            Ok::<_, sqlx::Error>(Bytes::from_static(b"other"))
                        })
                    }),
                )
                .await
                .expect("an unrelated key was blocked by the storm");
                assert_eq!(
                    unrelated.expect("unrelated run"),
                    Execution::Ran(Bytes::from_static(b"other"))
                );
                assert_eq!(effects(&store, &table, &other).await, 1);
            }
            gate.notify_one();
            let mut outputs = Vec::new();
            for copy in copies {
                outputs.push(
                    copy.await
                        .expect("join")
                        .expect("every copy gets the outcome")
                        .into_output(),
                );
            }
            assert!(outputs.iter().all(|out| out == "storm-done"), "{outputs:?}");
            assert_eq!(runs.load(Ordering::SeqCst), 1, "ran once");
            assert_eq!(effects(&store, &table, &key).await, 1, "one effect row");
            drop_table(&store, &table).await;
        }

        /// Through the HTTP layer and the `Tx` extractor: a final answer commits the handler's
        /// write with the stored response (and replays), a 500 or a panic rolls it back and
        /// frees the key.
        #[tokio::test]
        async fn over_http_only_final_answers_commit_the_handlers_writes() {
            use axum::{http::StatusCode, routing::post, Router};
            use tower_idempotency::{transactional::Tx, IdempotencyLayer};

            let Some((store, table)) = fixture(4).await else {
                return;
            };
            let scope = format!("tx-http-{}", Token::random().to_hex());
            let handler = {
                let table = table.clone();
                move |mut tx: Tx<$db>, headers: axum::http::HeaderMap| {
                    let table = table.clone();
                    async move {
                        let key = headers["idempotency-key"].to_str().unwrap().to_owned();
                        let outcome = headers
                            .get("x-outcome")
                            .map(|v| v.to_str().unwrap().to_owned());
                        effect(&mut tx, &table, &StoreKey::new("http", key))
                            .await
                            .unwrap();
                        match outcome.as_deref() {
                            Some("fail") => (StatusCode::INTERNAL_SERVER_ERROR, "failed"),
                            Some("panic") => panic!("the handler panicked after its write"),
                            _ => (StatusCode::CREATED, "created"),
                        }
                    }
                }
            };
            let layer = IdempotencyLayer::transactional(Transactional::new(store.clone()))
                .require_key()
                .scope_with(move |_| scope.clone());
            let app = Router::new().route("/", post(handler)).layer(layer);
            let send = |key: &str, outcome: Option<&str>| {
                let mut request = axum::http::Request::post("/").header("idempotency-key", key);
                if let Some(outcome) = outcome {
                    request = request.header("x-outcome", outcome);
                }
                let request = request.body(axum::body::Body::empty()).unwrap();
                let app = app.clone();
                async move {
                    use tower::ServiceExt;
                    let response = app.oneshot(request).await.unwrap();
                    let status = response.status();
                    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
                        .await
                        .unwrap();
                    (status, body)
                }
            };
            let http_key = |key: &str| StoreKey::new("http", key);

            assert_eq!(
                send("ok", None).await,
                (StatusCode::CREATED, Bytes::from("created"))
            );
            assert_eq!(
                send("ok", None).await,
                (StatusCode::CREATED, Bytes::from("created")),
                "replayed"
            );
            assert_eq!(
                effects(&store, &table, &http_key("ok")).await,
                1,
                "committed once"
            );

            assert_eq!(
                send("fails", Some("fail")).await.0,
                StatusCode::INTERNAL_SERVER_ERROR
            );
            assert_eq!(
                effects(&store, &table, &http_key("fails")).await,
                0,
                "a 500 rolls back"
            );
            assert_eq!(
                send("panics", Some("panic")).await.0,
                StatusCode::INTERNAL_SERVER_ERROR
            );
            assert_eq!(
                effects(&store, &table, &http_key("panics")).await,
                0,
                "a panic rolls back"
            );
            // Both keys are free: the fixed retries run and commit.
            assert_eq!(send("fails", None).await.0, StatusCode::CREATED);
            assert_eq!(send("panics", None).await.0, StatusCode::CREATED);
            assert_eq!(effects(&store, &table, &http_key("fails")).await, 1);
            assert_eq!(effects(&store, &table, &http_key("panics")).await, 1);
            drop_table(&store, &table).await;
        }

        /// A client that hangs up does not cut the owner in half: its transaction finishes in
        /// the background and commits, and the retry replays it.
        #[tokio::test]
        async fn a_client_that_hangs_up_leaves_a_committed_answer_for_its_retry() {
            use axum::{http::StatusCode, routing::post, Router};
            use tower::ServiceExt;
            use tower_idempotency::{transactional::Tx, IdempotencyLayer};

            let Some((store, table)) = fixture(4).await else {
                return;
            };
            let key = format!("hang-up-{}", Token::random().to_hex());
            let runs = Arc::new(AtomicUsize::new(0));
            let handler = {
                let (table, runs) = (table.clone(), runs.clone());
                move |mut tx: Tx<$db>, headers: axum::http::HeaderMap| {
                    let (table, runs) = (table.clone(), runs.clone());
                    async move {
                        runs.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(300)).await;
                        let key = headers["idempotency-key"].to_str().unwrap().to_owned();
                        effect(&mut tx, &table, &StoreKey::new("http", key))
                            .await
                            .unwrap();
                        (StatusCode::CREATED, "created late")
                    }
                }
            };
            let layer = IdempotencyLayer::transactional(Transactional::new(store.clone()))
                .require_key()
                .scope_with(|_| "tx-hang-up".to_owned());
            let app = Router::new().route("/", post(handler)).layer(layer.clone());
            let request = || {
                axum::http::Request::post("/")
                    .header("idempotency-key", key.as_str())
                    .body(axum::body::Body::empty())
                    .unwrap()
            };
            // The client gives up after 50 ms.
            let gave_up =
                tokio::time::timeout(Duration::from_millis(50), app.clone().oneshot(request()))
                    .await;
            assert!(gave_up.is_err(), "the handler takes 300 ms");
            tokio::time::timeout(Duration::from_secs(10), layer.engine().drained())
                .await
                .expect("the detached owner finishes");
            assert_eq!(
                effects(&store, &table, &StoreKey::new("http", key.clone())).await,
                1,
                "committed in the background"
            );
            let retry = app.oneshot(request()).await.unwrap();
            assert_eq!(retry.status(), StatusCode::CREATED);
            assert_eq!(
                axum::body::to_bytes(retry.into_body(), usize::MAX)
                    .await
                    .unwrap(),
                "created late"
            );
            assert_eq!(runs.load(Ordering::SeqCst), 1, "the retry replayed");
            drop_table(&store, &table).await;
        }

        /// The owner's connection is killed by the server while its operation runs (as when
        /// the process dies, or a partition makes the server drop it): its effect can never
        /// commit, and the key is free for the retry at once, without waiting for a lease.
        #[tokio::test]
        async fn an_owner_whose_connection_died_commits_nothing() {
            if !OWNER_CONNECTIONS_CAN_BE_KILLED {
                return;
            }
            let Some((store, table)) = fixture(4).await else {
                return;
            };
            let mode = Transactional::new(store.clone());
            let key = fresh_key("fenced");
            let killer = store.pool().clone();
            let outcome = {
                let (table, key_for_op) = (table.clone(), key.clone());
                mode.run_once(key.clone(), fp("m"), move |conn| {
                    Box::pin(async move {
                        effect(conn, &table, &key_for_op).await?;
                        kill_from_elsewhere(conn, &killer).await?;
                        Ok::<_, sqlx::Error>(Bytes::from_static(b"too late"))
                    })
                })
                .await
            };
            assert!(matches!(outcome, Err(TxRunError::Commit(_))), "{outcome:?}");
            assert_eq!(
                effects(&store, &table, &key).await,
                0,
                "the dead owner's effect never committed"
            );
            let (table2, key_for_op) = (table.clone(), key.clone());
            let retried = mode
                .run_once(key.clone(), fp("m"), move |conn| {
                    Box::pin(async move {
                        effect(conn, &table2, &key_for_op).await?;
                        Ok::<_, sqlx::Error>(Bytes::from_static(b"retried"))
                    })
                })
                .await
                .expect("the retry runs at once");
            assert_eq!(retried, Execution::Ran(Bytes::from_static(b"retried")));
            assert_eq!(effects(&store, &table, &key).await, 1);
            drop_table(&store, &table).await;
        }

        /// A second process starting (its `migrate()`) while an owner's transaction is open
        /// on the records table neither waits for that owner nor makes other writers wait
        /// behind it (on PostgreSQL a `CREATE INDEX IF NOT EXISTS` would queue for a lock
        /// behind the owner, and every later insert behind the `CREATE INDEX`).
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn migrating_again_beside_a_running_owner_blocks_nobody() {
            let Some((store, table)) = fixture(4).await else {
                return;
            };
            let mode = Transactional::new(store.clone());
            let key = fresh_key("held");
            let runs = Arc::new(AtomicUsize::new(0));
            let gate = Arc::new(tokio::sync::Notify::new());
            let owner = {
                let (mode, key, table) = (mode.clone(), key.clone(), table.clone());
                let (runs, gate) = (runs.clone(), gate.clone());
                tokio::spawn(async move {
                    let key_for_op = key.clone();
                    mode.run_once(key, fp("held"), move |conn| {
                        Box::pin(async move {
                            effect(conn, &table, &key_for_op).await?;
                            runs.fetch_add(1, Ordering::SeqCst);
                            gate.notified().await;
                            Ok::<_, sqlx::Error>(Bytes::from_static(b"held"))
                        })
                    })
                    .await
                })
            };
            while runs.load(Ordering::SeqCst) == 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let restarted = reopen(&store, 2).await;
            tokio::time::timeout(Duration::from_secs(3), restarted.migrate())
                .await
                .expect("migrate waited for the running owner")
                .expect("migrate");
            if UNRELATED_KEYS_RUN_BESIDE_AN_OWNER {
                let other = fresh_key("other");
                let (table2, other_for_op) = (table.clone(), other.clone());
                let unrelated = tokio::time::timeout(
                    Duration::from_secs(3),
                    Transactional::new(restarted).run_once(other, fp("other"), move |conn| {
                        Box::pin(async move {
                            effect(conn, &table2, &other_for_op).await?;
                            Ok::<_, sqlx::Error>(Bytes::from_static(b"other"))
                        })
                    }),
                )
                .await
                .expect("another key waited behind the migration");
                assert!(unrelated.is_ok(), "{unrelated:?}");
            }
            gate.notify_one();
            owner.await.expect("join").expect("the owner commits");
            assert_eq!(effects(&store, &table, &key).await, 1);
            drop_table(&store, &table).await;
        }
    };
}

mod postgres {
    use super::*;
    use sqlx::{postgres::PgPoolOptions, PgConnection};
    use tower_idempotency::store::PostgresStore;

    const UNRELATED_KEYS_RUN_BESIDE_AN_OWNER: bool = true;
    const OWNER_CONNECTIONS_CAN_BE_KILLED: bool = true;

    /// Ends the server session of `conn` from another connection.
    async fn kill_from_elsewhere(
        conn: &mut PgConnection,
        killer: &sqlx::PgPool,
    ) -> Result<(), sqlx::Error> {
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut *conn)
            .await?;
        sqlx::query("SELECT pg_terminate_backend($1)")
            .bind(pid)
            .execute(killer)
            .await?;
        Ok(())
    }

    async fn reopen(_: &PostgresStore, max: u32) -> PostgresStore {
        open(max).await.expect("a second pool")
    }

    async fn open(max: u32) -> Option<PostgresStore> {
        let url = backends::url_or_skip("TEST_POSTGRES_URL")?;
        let pool = PgPoolOptions::new()
            .max_connections(max)
            .acquire_timeout(Duration::from_secs(5))
            .connect(&url)
            .await
            .expect("TEST_POSTGRES_URL is set but unreachable");
        Some(PostgresStore::new(pool))
    }

    transactional_tests!(sqlx::Postgres, PostgresStore, PgConnection,
        insert: "INSERT INTO {t} (k) VALUES ($1)",
        count: "SELECT COUNT(*) FROM {t} WHERE k = $1");
}

mod mysql {
    use super::*;
    use sqlx::{mysql::MySqlPoolOptions, MySqlConnection};
    use tower_idempotency::store::MySqlStore;

    const UNRELATED_KEYS_RUN_BESIDE_AN_OWNER: bool = true;
    const OWNER_CONNECTIONS_CAN_BE_KILLED: bool = true;

    /// Ends the server session of `conn` from another connection.
    async fn kill_from_elsewhere(
        conn: &mut MySqlConnection,
        killer: &sqlx::MySqlPool,
    ) -> Result<(), sqlx::Error> {
        let id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
            .fetch_one(&mut *conn)
            .await?;
        sqlx::query(sqlx::AssertSqlSafe(format!("KILL {id}")))
            .execute(killer)
            .await?;
        Ok(())
    }

    async fn reopen(_: &MySqlStore, max: u32) -> MySqlStore {
        open(max).await.expect("a second pool")
    }

    async fn open(max: u32) -> Option<MySqlStore> {
        let url = backends::url_or_skip("TEST_MYSQL_URL")?;
        let pool = MySqlPoolOptions::new()
            .max_connections(max)
            .acquire_timeout(Duration::from_secs(5))
            .connect(&url)
            .await
            .expect("TEST_MYSQL_URL is set but unreachable");
        Some(MySqlStore::new(pool))
    }

    transactional_tests!(sqlx::MySql, MySqlStore, MySqlConnection,
        insert: "INSERT INTO {t} (k) VALUES (?)",
        count: "SELECT COUNT(*) FROM {t} WHERE k = ?");
}

mod sqlite {
    use super::*;
    use sqlx::{
        sqlite::{SqliteConnectOptions, SqlitePoolOptions},
        SqliteConnection,
    };
    use tower_idempotency::store::SqliteStore;

    /// SQLite has one writer: the owner's transaction holds the write lock, so another key's
    /// owner waits for it (documented). The rest of the storm test still applies.
    const UNRELATED_KEYS_RUN_BESIDE_AN_OWNER: bool = false;
    /// An embedded database has no server session to end: a dead process' transaction is
    /// covered by the SIGKILL tests of tests/payments_crash.rs instead.
    const OWNER_CONNECTIONS_CAN_BE_KILLED: bool = false;

    async fn kill_from_elsewhere(
        _: &mut SqliteConnection,
        _: &sqlx::SqlitePool,
    ) -> Result<(), sqlx::Error> {
        unreachable!("OWNER_CONNECTIONS_CAN_BE_KILLED is false")
    }

    /// A second pool on the same database file, as a second process would open.
    async fn reopen(store: &SqliteStore, max: u32) -> SqliteStore {
        let options = (*store.pool().connect_options()).clone();
        let pool = SqlitePoolOptions::new()
            .max_connections(max)
            .connect_with(options)
            .await
            .expect("a second pool on the file");
        SqliteStore::new(pool)
    }

    async fn open(max: u32) -> Option<SqliteStore> {
        let path = crate::sqlite_file::fresh_path("transactional");
        let options = SqliteStore::durable_options(
            SqliteConnectOptions::new()
                .filename(&path)
                .create_if_missing(true),
        );
        let pool = SqlitePoolOptions::new()
            .max_connections(max)
            .connect_with(options)
            .await
            .expect("open a SQLite file");
        Some(SqliteStore::new(pool))
    }

    /// SQLite's one writer: the owners of two new keys take turns. The second waits for the
    /// first's transaction as long as a duplicate would wait (here 300 ms), then is told the
    /// database is busy (`EngineError::Busy`, 409 over HTTP) — not that the store is down —
    /// and nothing of it ran; once the first commits, the second key claims at once.
    #[tokio::test]
    async fn an_owner_waits_its_turn_then_hears_busy_not_unavailable() {
        use tower_idempotency::{
            engine::EngineError, transactional::TxBegin, Engine, InProgressPolicy,
        };
        let store = open(4).await.expect("a SQLite file");
        store.migrate().await.unwrap();
        let engine = Engine::builder(store.clone())
            .in_progress(InProgressPolicy::Wait {
                timeout: Duration::from_millis(300),
            })
            .build()
            .expect("valid timings");
        let mode = Transactional::with_engine(store, engine);
        let (first, second) = (fresh_key("first"), fresh_key("second"));

        let TxBegin::Run(owner) = mode.begin(first, fp("a")).await.unwrap() else {
            panic!("a new key is claimed");
        };
        let started = tokio::time::Instant::now();
        let waited = mode.begin(second.clone(), fp("b")).await;
        assert!(
            matches!(waited, Err(EngineError::Busy { .. })),
            "the second owner is told busy: {waited:?}"
        );
        assert!(
            started.elapsed() >= Duration::from_millis(300),
            "it waited its turn first"
        );

        owner.commit(Bytes::from_static(b"first")).await.unwrap();
        let TxBegin::Run(owner) = mode.begin(second, fp("b")).await.unwrap() else {
            panic!("the second key was never claimed, so it is new");
        };
        owner.rollback().await;
    }

    transactional_tests!(sqlx::Sqlite, SqliteStore, SqliteConnection,
        insert: "INSERT INTO {t} (k) VALUES (?)",
        count: "SELECT COUNT(*) FROM {t} WHERE k = ?");
}
