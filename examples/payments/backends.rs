//! Where the example keeps its data, chosen from `DATABASE_URL` and `REDIS_URL`.
//!
//! | `DATABASE_URL` | `REDIS_URL` | payments      | idempotency records |
//! |----------------|-------------|---------------|---------------------|
//! | unset          | unset       | memory        | memory              |
//! | a database     | unset       | that database | that database       |
//! | any            | set         | as above      | Redis               |
//!
//! With a database and no Redis the layer runs in the transactional mode by default
//! (`IDEMPOTENCY_MODE`): the claim, the charge and the stored response commit in one
//! transaction of that database, so a crash can never leave a charge without its record.
//!
//! `REDIS_URL` with several comma-separated nodes, or `REDIS_CLUSTER_URLS`, puts the records
//! on a Redis Cluster.
//!
//! With a database, payments and idempotency records share ONE pool and one database, so
//! every process pointed at it sees the same charges and the same keys: several processes
//! behave as one service.

use std::{str::FromStr, sync::Arc, time::Duration};

use sqlx::{
    mysql::MySqlPoolOptions,
    postgres::PgPoolOptions,
    sqlite::{SqliteConnectOptions, SqlitePoolOptions},
    SqlitePool,
};
use tower_idempotency::{
    engine::ConfigError,
    store::{MemoryStore, MySqlStore, PostgresStore, RedisStore, SqliteStore, Store},
    transactional::{Transactional, TransactionalStore},
    Engine, IdempotencyLayer,
};

use crate::{
    config::{Config, Mode, Redis},
    payments::{MemoryPayments, Payments},
    sql_payments::SqlPayments,
};

pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// The two stores the service runs on, migrated and ready.
pub struct Backends {
    pub payments: Arc<dyn Payments>,
    /// The payments database, if any (the outbox relay drains its outbox).
    pub database: Option<SqlPayments>,
    pub idempotency: Arc<dyn Store>,
    /// The idempotency layer for the configured mode and timings.
    pub layer: IdempotencyLayer,
    /// For the startup log: `payments: postgres, idempotency: redis`.
    pub description: String,
}

pub async fn connect(config: &Config) -> Result<Backends, Error> {
    let database = match &config.database_url {
        // A database that is still starting (a deploy, a machine's boot) is waited for.
        Some(url) => Some(
            crate::pipeline::retry_start(
                "connecting to the database and creating the tables",
                || async {
                    let mut database = open_database(url).await?;
                    if config.events {
                        database = database.with_events();
                    }
                    database.migrate().await.map_err(|e| {
                        format!("creating the payments and outbox tables failed: {e}")
                    })?;
                    Ok::<_, Error>(database)
                },
            )
            .await?,
        ),
        None => None,
    };

    let engine = |store: Arc<dyn Store>| {
        Engine::builder_shared(store)
            .lease(config.lease)
            // Short leases (tests set 1 s) need a store timeout short enough for two failed
            // renewals to fit in one lease; `build` refuses anything else.
            .store_timeout(Duration::from_secs(5).min(config.lease / 6))
            .retention(config.retention)
            .build()
    };
    let (idempotency, idempotency_name, layer): (Arc<dyn Store>, &str, IdempotencyLayer) =
        match (&config.redis, &database, config.mode) {
            (None, Some(database), Mode::Transactional) => {
                let (store, layer) = transactional(database, engine).await?;
                (store, database.database(), layer)
            }
            (Some(redis), _, _) => {
                let (store, name) = redis_store(redis, config.redis_replica_wait).await?;
                (
                    store.clone(),
                    name,
                    IdempotencyLayer::from_engine(engine(store)?),
                )
            }
            (None, Some(database), _) => {
                let store = sql_store(database).await?;
                (
                    store.clone(),
                    database.database(),
                    IdempotencyLayer::from_engine(engine(store)?),
                )
            }
            (None, None, _) => {
                let mut builder = MemoryStore::builder();
                if let Some(bytes) = config.memory_budget {
                    builder = builder.max_bytes(bytes);
                }
                let store: Arc<dyn Store> = Arc::new(builder.build());
                (
                    store.clone(),
                    "memory",
                    IdempotencyLayer::from_engine(engine(store)?),
                )
            }
        };
    let mode = match config.mode {
        Mode::Transactional => "transactional",
        Mode::Separate => "separate",
    };

    let (payments, payments_name): (Arc<dyn Payments>, &str) = match &database {
        Some(database) => (Arc::new(database.clone()), database.database()),
        None => (Arc::new(MemoryPayments::default()), "memory"),
    };
    Ok(Backends {
        payments,
        database,
        idempotency,
        layer,
        description: format!(
            "payments: {payments_name}, idempotency: {idempotency_name}, mode: {mode}"
        ),
    })
}

/// Opens a pool for `url`, choosing the database by the URL's scheme.
async fn open_database(url: &str) -> Result<SqlPayments, Error> {
    let scheme = url.split_once(':').map_or("", |(scheme, _)| scheme);
    let failed = |e: sqlx::Error| format!("cannot connect to DATABASE_URL ({scheme}): {e}");
    // Fail within seconds when the database is down, rather than sqlx's default 30 s.
    let acquire_timeout = Duration::from_secs(5);
    Ok(match scheme {
        "postgres" | "postgresql" => SqlPayments::Postgres(
            PgPoolOptions::new()
                .acquire_timeout(acquire_timeout)
                .connect(url)
                .await
                .map_err(failed)?,
            None,
        ),
        "mysql" | "mariadb" => SqlPayments::MySql(
            MySqlPoolOptions::new()
                .acquire_timeout(acquire_timeout)
                .connect(url)
                .await
                .map_err(failed)?,
            None,
        ),
        "sqlite" => {
            // Several processes may share the file. The store's settings (WAL, so readers
            // run beside the one writer; a busy timeout, so a writer waits for its turn
            // instead of failing with "database is locked") suit the payments tables too.
            let options =
                SqliteStore::durable_options(SqliteConnectOptions::from_str(url).map_err(failed)?);
            SqlPayments::Sqlite(
                connect_sqlite(options, acquire_timeout)
                    .await
                    .map_err(failed)?,
                None,
            )
        }
        _ => {
            return Err(format!(
                "DATABASE_URL must start with postgres://, mysql:// or sqlite://, got {scheme:?}"
            )
            .into())
        }
    })
}

/// Opens a SQLite pool, retrying for a moment when another process is switching a brand-new
/// file to WAL mode: that switch takes a lock nobody can wait for (the busy timeout does not
/// apply), so a process starting at the same instant fails with "database is locked"
/// (`SQLITE_BUSY`, code 5). Once the file is in WAL mode, which is permanent, this cannot
/// happen again.
async fn connect_sqlite(
    options: SqliteConnectOptions,
    acquire_timeout: Duration,
) -> Result<SqlitePool, sqlx::Error> {
    let mut attempt = 0;
    loop {
        let result = SqlitePoolOptions::new()
            .acquire_timeout(acquire_timeout)
            .connect_with(options.clone())
            .await;
        match result {
            Err(sqlx::Error::Database(error))
                if error.code().as_deref() == Some("5") && attempt < 10 =>
            {
                attempt += 1;
                tokio::time::sleep(Duration::from_millis(20 * attempt)).await;
            }
            result => return result,
        }
    }
}

/// The idempotency store in the payments database, on the same pool.
async fn sql_store(database: &SqlPayments) -> Result<Arc<dyn Store>, Error> {
    // Each `migrate` is idempotent and safe when several processes start at once.
    let store: Arc<dyn Store> = match database {
        SqlPayments::Postgres(pool, _) => {
            let store = PostgresStore::new(pool.clone());
            store.migrate().await?;
            Arc::new(store)
        }
        SqlPayments::MySql(pool, _) => {
            let store = MySqlStore::new(pool.clone());
            store.migrate().await?;
            Arc::new(store)
        }
        SqlPayments::Sqlite(pool, _) => {
            let store = SqliteStore::new(pool.clone());
            store.migrate().await?;
            Arc::new(store)
        }
    };
    Ok(store)
}

/// The transactional mode on the payments database: the claim, the charge and the stored
/// response commit in one transaction of that pool.
async fn transactional(
    database: &SqlPayments,
    engine: impl Fn(Arc<dyn Store>) -> Result<Engine, ConfigError>,
) -> Result<(Arc<dyn Store>, IdempotencyLayer), Error> {
    fn layer<S: TransactionalStore>(
        store: S,
        engine: Engine,
    ) -> (Arc<dyn Store>, IdempotencyLayer) {
        let shared: Arc<dyn Store> = Arc::new(store.clone());
        let layer = IdempotencyLayer::transactional(Transactional::with_engine(store, engine));
        (shared, layer)
    }
    Ok(match database {
        SqlPayments::Postgres(pool, _) => {
            let store = PostgresStore::new(pool.clone());
            store.migrate().await?;
            layer(store.clone(), engine(Arc::new(store))?)
        }
        SqlPayments::MySql(pool, _) => {
            let store = MySqlStore::new(pool.clone());
            store.migrate().await?;
            layer(store.clone(), engine(Arc::new(store))?)
        }
        SqlPayments::Sqlite(pool, _) => {
            let store = SqliteStore::new(pool.clone());
            store.migrate().await?;
            layer(store.clone(), engine(Arc::new(store))?)
        }
    })
}

/// Redis keeps the records itself (keys expire with `PX`): nothing to migrate. A cluster is
/// found from any of its nodes.
async fn redis_store(
    redis: &Redis,
    replica_wait: Option<Duration>,
) -> Result<(Arc<dyn Store>, &'static str), Error> {
    let mut builder = RedisStore::builder();
    if let Some(timeout) = replica_wait {
        builder = builder.wait_for_replicas(1, timeout);
    }
    let (store, name) = match redis {
        Redis::Single(url) => (
            builder
                .open(url)
                .await
                .map_err(|e| format!("cannot connect to REDIS_URL: {e}"))?,
            "redis",
        ),
        Redis::Cluster(nodes) => (
            builder
                .open_cluster(nodes)
                .await
                .map_err(|e| format!("cannot connect to the Redis Cluster at {nodes:?}: {e}"))?,
            "redis-cluster",
        ),
    };
    Ok((Arc::new(store), name))
}
