//! The cost of a step: one keyed operation through `Engine::run_once` (claim + complete)
//! against the same through `Engine::run_steps` with one foreign step (plus a journal read
//! and a fenced journal write) and with one local phase (plus a fenced transaction holding an
//! insert and the journal entry), per store, a new key per iteration.
//!
//! ```text
//! TEST_POSTGRES_URL=postgres://root@127.0.0.1/test TEST_MYSQL_URL=mysql://root@127.0.0.1/test \
//!     TEST_REDIS_URL=redis://127.0.0.1:6379 cargo bench --bench steps
//! ```
//!
//! SQLite and memory always run; PostgreSQL, MySQL / MariaDB and Redis are skipped with a note
//! when their URL is unset.

use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, Criterion};
use futures_util::future::BoxFuture;
use tokio::runtime::Runtime;
use tower_idempotency::{
    steps::{
        Journal, MemoryJournal, MySqlJournal, PostgresJournal, RedisJournal, SqlJournal,
        SqliteJournal, Steps,
    },
    store::{MemoryStore, MySqlStore, PostgresStore, RedisStore, SqliteStore},
    Engine, Fingerprint, StoreKey,
};

static NEXT: AtomicU64 = AtomicU64::new(0);

fn new_key(scope: &str) -> StoreKey {
    StoreKey::new(scope, NEXT.fetch_add(1, Ordering::Relaxed).to_string())
}

fn fingerprint() -> Fingerprint {
    Fingerprint::of([b"bench".as_slice()])
}

/// `run_once` and `run_steps` with one foreign step, on `engine` and `journal`.
fn plain_and_foreign<J: Journal + Clone>(
    c: &mut Criterion,
    rt: &Runtime,
    group: &str,
    engine: &Engine,
    journal: &J,
) {
    let scope = format!("bench-steps-{:x}", rand::random::<u32>());
    let mut g = c.benchmark_group(group);
    g.bench_function("run_once (no steps)", |b| {
        b.to_async(rt).iter(|| async {
            engine
                .run_once(new_key(&scope), fingerprint(), || async {
                    Ok::<_, std::io::Error>(Bytes::from_static(b"done"))
                })
                .await
                .unwrap()
        })
    });
    g.bench_function("run_steps, one foreign step", |b| {
        b.to_async(rt).iter(|| async {
            engine
                .run_steps(
                    journal.clone(),
                    new_key(&scope),
                    fingerprint(),
                    |steps| async move {
                        let id: u64 = steps
                            .foreign("call", |_key| async { Ok::<_, std::io::Error>(7) })
                            .await
                            .map_err(|e| e.to_string())?;
                        Ok::<_, String>(Bytes::from(id.to_string()))
                    },
                )
                .await
                .unwrap()
        })
    });
    g.finish();
}

/// A SQL store: the above, and `run_steps` with one local phase inserting one row.
macro_rules! sql_bench {
    ($name:ident, $group:literal, $db:ty, $open:expr) => {
        fn $name(c: &mut Criterion, rt: &Runtime) {
            let Some((store, journal, pool)) = rt.block_on($open) else {
                return;
            };
            let engine = Engine::new(store);
            plain_and_foreign(c, rt, $group, &engine, &journal);
            rt.block_on(async {
                sqlx::query("CREATE TABLE IF NOT EXISTS bench_steps_rows (note TEXT NOT NULL)")
                    .execute(&pool)
                    .await
                    .unwrap();
            });
            let scope = format!("bench-steps-{:x}", rand::random::<u32>());
            c.benchmark_group($group)
                .bench_function("run_steps, one local phase", |b| {
                    b.to_async(rt).iter(|| async {
                        engine
                            .run_steps(journal.clone(), new_key(&scope), fingerprint(), local)
                            .await
                            .unwrap()
                    })
                });
        }
    };
}

/// The operation with one local phase: one insert, committed with its journal entry.
fn local<DB>(steps: Steps<SqlJournal<DB>>) -> BoxFuture<'static, Result<Bytes, String>>
where
    DB: tower_idempotency::steps::JournalDatabase,
    Steps<SqlJournal<DB>>: LocalInsert,
{
    Box::pin(async move { steps.insert_row().await })
}

/// One local phase inserting one row, per database (sqlx's connection types differ).
trait LocalInsert {
    fn insert_row(&self) -> BoxFuture<'_, Result<Bytes, String>>;
}

macro_rules! local_insert {
    ($db:ty) => {
        impl LocalInsert for Steps<SqlJournal<$db>> {
            fn insert_row(&self) -> BoxFuture<'_, Result<Bytes, String>> {
                Box::pin(async move {
                    let n: i64 = self
                        .local("insert", |conn| {
                            Box::pin(async move {
                                sqlx::query("INSERT INTO bench_steps_rows (note) VALUES ('x')")
                                    .execute(&mut *conn)
                                    .await?;
                                Ok::<_, sqlx::Error>(1)
                            })
                        })
                        .await
                        .map_err(|e| e.to_string())?;
                    Ok(Bytes::from(n.to_string()))
                })
            }
        }
    };
}

local_insert!(sqlx::Postgres);
local_insert!(sqlx::MySql);
local_insert!(sqlx::Sqlite);

/// The server URL in `var`, or `None` with a note.
fn url(var: &str) -> Option<String> {
    let url = std::env::var(var).ok().filter(|u| !u.is_empty());
    if url.is_none() {
        eprintln!("skipped: {var} is not set");
    }
    url
}

async fn open_postgres() -> Option<(PostgresStore, PostgresJournal, sqlx::PgPool)> {
    let url = url("TEST_POSTGRES_URL")?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .expect("TEST_POSTGRES_URL is set but PostgreSQL is unreachable");
    let store = PostgresStore::new(pool.clone());
    store.migrate().await.expect("migrate");
    let journal = PostgresJournal::for_store(&store);
    journal.migrate().await.expect("migrate the journal");
    Some((store, journal, pool))
}

async fn open_mysql() -> Option<(MySqlStore, MySqlJournal, sqlx::MySqlPool)> {
    let url = url("TEST_MYSQL_URL")?;
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .expect("TEST_MYSQL_URL is set but MySQL is unreachable");
    let store = MySqlStore::new(pool.clone());
    store.migrate().await.expect("migrate");
    let journal = MySqlJournal::for_store(&store);
    journal.migrate().await.expect("migrate the journal");
    Some((store, journal, pool))
}

async fn open_sqlite() -> Option<(SqliteStore, SqliteJournal, sqlx::SqlitePool)> {
    let path = std::env::temp_dir().join(format!("bench-steps-{:x}.db", rand::random::<u64>()));
    let store = SqliteStore::open(&path).await.expect("open SQLite");
    store.migrate().await.expect("migrate");
    let journal = SqliteJournal::for_store(&store);
    journal.migrate().await.expect("migrate the journal");
    let pool = store.pool().clone();
    Some((store, journal, pool))
}

sql_bench!(postgres, "steps postgres", sqlx::Postgres, open_postgres());
sql_bench!(mysql, "steps mysql", sqlx::MySql, open_mysql());
sql_bench!(sqlite, "steps sqlite", sqlx::Sqlite, open_sqlite());

fn memory(c: &mut Criterion, rt: &Runtime) {
    let store = MemoryStore::new();
    let journal = MemoryJournal::for_store(&store);
    // New keys would fill the store's byte budget within a day's retention: keep them briefly.
    let engine = Engine::builder(store)
        .retention(std::time::Duration::from_millis(100))
        .build()
        .expect("valid timings");
    plain_and_foreign(c, rt, "steps memory", &engine, &journal);
}

fn redis(c: &mut Criterion, rt: &Runtime) {
    let Some(url) = url("TEST_REDIS_URL") else {
        return;
    };
    let store = rt
        .block_on(
            RedisStore::builder()
                .prefix(format!("bench-steps-{:x}:", rand::random::<u32>()))
                .open(&url),
        )
        .expect("TEST_REDIS_URL is set but Redis is unreachable");
    let journal = RedisJournal::for_store(&store).expect("the prefix has no stray brace");
    plain_and_foreign(c, rt, "steps redis", &Engine::new(store), &journal);
}

fn benches(c: &mut Criterion) {
    let rt = Runtime::new().expect("a tokio runtime");
    memory(c, &rt);
    redis(c, &rt);
    sqlite(c, &rt);
    postgres(c, &rt);
    mysql(c, &rt);
}

criterion_group! {
    name = steps;
    config = Criterion::default().sample_size(30).measurement_time(std::time::Duration::from_secs(3));
    targets = benches
}
criterion_main!(steps);
