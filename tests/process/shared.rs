//! A database several example processes share, private to one test: a fresh PostgreSQL
//! schema, a fresh MySQL database, or a fresh SQLite file (plus Redis, or a Redis Cluster,
//! for the idempotency records). Each knows the environment that points the example at it and can count the
//! charge rows behind the example's back.
//!
//! PostgreSQL keeps the example's unqualified table names (`payments`, `charges`,
//! `tower_idempotency_records`) and isolates them with a schema of their own: the example's
//! `DATABASE_URL` carries `options=-csearch_path=<schema>`, so every connection of its pool
//! creates and finds its tables there. No table-prefix setting was needed in the example.

use std::{future::Future, panic::AssertUnwindSafe, path::PathBuf};

use futures_util::FutureExt;
use sqlx::{MySqlPool, PgPool, SqlitePool};

use super::unique;

#[path = "../common/backends.rs"]
mod backends;
use backends::reachable;
#[allow(unused_imports)] // each test binary uses a different part
pub use backends::{require_all, url_or_skip};

/// The variable that points the example at Redis, and its value.
#[derive(Clone)]
pub struct RedisEnv {
    var: &'static str,
    value: String,
}

#[derive(Clone)]
pub enum Shared {
    Postgres {
        admin: PgPool,
        schema: String,
        url: String,
    },
    MySql {
        admin: MySqlPool,
        database: String,
        url: String,
    },
    /// Payments in a SQLite file; idempotency records in the same file, or in Redis.
    Sqlite {
        dir: PathBuf,
        url: String,
        redis: Option<RedisEnv>,
    },
}

impl Shared {
    /// A fresh schema in `TEST_POSTGRES_URL`'s database.
    pub async fn postgres() -> Option<Self> {
        let base = url_or_skip("TEST_POSTGRES_URL")?;
        let admin = reachable("TEST_POSTGRES_URL", PgPool::connect(&base).await)?;
        Some(Self::postgres_on(admin, &base).await)
    }

    /// A fresh schema in the database at `base` (a server the test started itself), with
    /// `admin` a pool on it.
    pub async fn postgres_on(admin: PgPool, base: &str) -> Self {
        let schema = format!("payments_process_{}", unique());
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
            .execute(&admin)
            .await
            .expect("create schema");
        let separator = if base.contains('?') { '&' } else { '?' };
        let url = format!("{base}{separator}options=-csearch_path%3D{schema}");
        Self::Postgres { admin, schema, url }
    }

    /// A fresh database on `TEST_MYSQL_URL`'s server.
    pub async fn mysql() -> Option<Self> {
        let base = url_or_skip("TEST_MYSQL_URL")?;
        let admin = reachable("TEST_MYSQL_URL", MySqlPool::connect(&base).await)?;
        Some(Self::mysql_on(admin, &base).await)
    }

    /// A fresh database on the server at `base` (a server the test started itself), with
    /// `admin` a pool on it.
    pub async fn mysql_on(admin: MySqlPool, base: &str) -> Self {
        let database = format!("payments_process_{}", unique());
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}")))
            .execute(&admin)
            .await
            .expect("create database");
        let url = with_database(base, &database);
        Self::MySql {
            admin,
            database,
            url,
        }
    }

    /// A fresh SQLite file (SQLite needs no server, so this never skips).
    pub fn sqlite() -> Self {
        let dir = std::env::temp_dir().join(format!("payments-process-{}", unique()));
        std::fs::create_dir_all(&dir).expect("create temp dir");
        let url = format!("sqlite://{}", dir.join("payments.db").display());
        Self::Sqlite {
            dir,
            url,
            redis: None,
        }
    }

    /// Idempotency records in `TEST_REDIS_URL`, payments in a fresh SQLite file (so that the
    /// charges of every process, dead or alive, can be counted in one place). Keys are kept
    /// apart from other runs by the random keys and callers the tests use.
    pub fn redis() -> Option<Self> {
        Self::with_redis("TEST_REDIS_URL", "REDIS_URL")
    }

    /// Like [`redis`](Self::redis), on the Redis Cluster in `TEST_REDIS_CLUSTER_URLS`, which
    /// the example is given as `REDIS_CLUSTER_URLS`.
    pub fn redis_cluster() -> Option<Self> {
        Self::with_redis("TEST_REDIS_CLUSTER_URLS", "REDIS_CLUSTER_URLS")
    }

    fn with_redis(test_var: &str, var: &'static str) -> Option<Self> {
        let value = url_or_skip(test_var)?;
        match Self::sqlite() {
            Self::Sqlite { dir, url, .. } => Some(Self::Sqlite {
                dir,
                url,
                redis: Some(RedisEnv { var, value }),
            }),
            _ => unreachable!(),
        }
    }

    /// Runs `test` on this backend, then drops the schema, database or file, whether the
    /// test passed or panicked.
    pub async fn run<F: Future<Output = ()>>(self, test: impl FnOnce(Self) -> F) {
        let outcome = AssertUnwindSafe(test(self.clone())).catch_unwind().await;
        self.clean_up().await;
        if let Err(panic) = outcome {
            std::panic::resume_unwind(panic);
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Self::Postgres { .. } => "postgres",
            Self::MySql { .. } => "mysql",
            Self::Sqlite { redis: None, .. } => "sqlite",
            Self::Sqlite {
                redis: Some(redis), ..
            } if redis.var == "REDIS_CLUSTER_URLS" => "redis-cluster",
            Self::Sqlite { redis: Some(_), .. } => "redis",
        }
    }

    /// The example's environment for this backend.
    pub fn env(&self) -> Vec<(String, String)> {
        let mut env = Vec::new();
        match self {
            Self::Postgres { url, .. } | Self::MySql { url, .. } => {
                env.push(("DATABASE_URL".to_owned(), url.clone()));
            }
            Self::Sqlite { url, redis, .. } => {
                env.push(("DATABASE_URL".to_owned(), url.clone()));
                if let Some(RedisEnv { var, value }) = redis {
                    env.push(((*var).to_owned(), value.clone()));
                }
            }
        }
        env
    }

    /// The rows in the `charges` table, counted directly in the database.
    pub async fn charge_rows(&self) -> i64 {
        self.rows("charges").await
    }

    /// How many rows `table` of the shared database holds, counted behind the example's back.
    pub async fn rows(&self, table: &str) -> i64 {
        let count = match self {
            Self::Postgres { admin, schema, .. } => {
                sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                    "SELECT COUNT(*) FROM {schema}.{table}"
                )))
                .fetch_one(admin)
                .await
            }
            Self::MySql {
                admin, database, ..
            } => {
                sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                    "SELECT COUNT(*) FROM {database}.{table}"
                )))
                .fetch_one(admin)
                .await
            }
            Self::Sqlite { url, .. } => {
                let pool = SqlitePool::connect(url)
                    .await
                    .expect("open the SQLite file");
                let count = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                    "SELECT COUNT(*) FROM {table}"
                )))
                .fetch_one(&pool)
                .await;
                pool.close().await;
                count
            }
        };
        count.unwrap_or_else(|e| panic!("count the rows of {table}: {e}"))
    }

    async fn clean_up(self) {
        match self {
            Self::Postgres { admin, schema, .. } => {
                sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
                    .execute(&admin)
                    .await
                    .expect("drop schema");
            }
            Self::MySql {
                admin, database, ..
            } => {
                sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE {database}")))
                    .execute(&admin)
                    .await
                    .expect("drop database");
            }
            Self::Sqlite { dir, .. } => {
                let _ = std::fs::remove_dir_all(dir);
            }
        }
    }
}

/// `url` (a MySQL URL) with its database replaced by `database`'s name in `shared`: the same
/// database on another server of a cluster.
pub fn on_database(url: &str, shared: &Shared) -> String {
    match shared {
        Shared::MySql { database, .. } => with_database(url, database),
        _ => url.to_owned(),
    }
}

/// `url` with its database (the path) replaced: `mysql://root@host:3306/test?x=y` ->
/// `mysql://root@host:3306/<database>?x=y`.
fn with_database(url: &str, database: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let authority_start = base.find("://").map_or(0, |i| i + 3);
    let path_start = base[authority_start..]
        .find('/')
        .map_or(base.len(), |i| authority_start + i);
    let mut out = format!("{}/{database}", &base[..path_start]);
    if let Some(query) = query {
        out.push('?');
        out.push_str(query);
    }
    out
}
