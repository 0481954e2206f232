//! Server-side connection kills of the example's own store sessions, and of nobody else's
//! (other tests share the servers): PostgreSQL `pg_terminate_backend` of the backends whose
//! client port belongs to an example process, MariaDB `KILL` of the connections on the
//! test's private database, Redis `CLIENT KILL` of the clients whose port belongs to an
//! example process. SQLite has no server, so no sessions to kill.

use std::collections::HashSet;

use sqlx::{MySqlPool, PgPool};

use super::sockets::local_ports;
use crate::process::shared::Shared;

/// The store server a run's processes talk to, seen from an admin connection.
pub enum Sessions {
    Postgres(PgPool),
    MySql {
        admin: MySqlPool,
        database: String,
    },
    Redis(redis::Client),
    /// SQLite: nothing to kill.
    None,
}

impl Sessions {
    /// The sessions of `shared`'s store.
    pub fn of(shared: &Shared) -> Self {
        match shared {
            Shared::Postgres { admin, .. } => Self::Postgres(admin.clone()),
            Shared::MySql {
                admin, database, ..
            } => Self::MySql {
                admin: admin.clone(),
                database: database.clone(),
            },
            Shared::Sqlite { .. } => {
                match shared.env().iter().find(|(var, _)| var == "REDIS_URL") {
                    Some((_, url)) => {
                        Self::Redis(redis::Client::open(url.as_str()).expect("a Redis URL"))
                    }
                    None => Self::None,
                }
            }
        }
    }

    /// Whether there is a server whose sessions can be killed.
    pub fn killable(&self) -> bool {
        !matches!(self, Self::None)
    }

    /// Whether sessions can be told apart by an open transaction (the SQL servers).
    pub fn sees_transactions(&self) -> bool {
        matches!(self, Self::Postgres(_) | Self::MySql { .. })
    }

    /// Kills the store sessions of processes `pids` (only those inside an open transaction
    /// when `in_transaction`); returns how many it killed.
    pub async fn kill(&self, pids: &[u32], in_transaction: bool) -> usize {
        let ports: HashSet<u16> = pids.iter().flat_map(|pid| local_ports(*pid)).collect();
        match self {
            Self::Postgres(admin) => {
                let ports: Vec<i32> = ports.into_iter().map(i32::from).collect();
                let killed: i64 = sqlx::query_scalar(
                    "SELECT COUNT(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity \
                     WHERE client_port = ANY($1) AND pid <> pg_backend_pid() \
                       AND (NOT $2 OR state = 'idle in transaction')",
                )
                .bind(ports)
                .bind(in_transaction)
                .fetch_one(admin)
                .await
                .expect("terminate the example's backends");
                usize::try_from(killed).unwrap_or(0)
            }
            Self::MySql { admin, database } => {
                let ids: Vec<i64> = sqlx::query_scalar(
                    "SELECT ID FROM information_schema.PROCESSLIST \
                     WHERE DB = ? AND ID <> CONNECTION_ID() \
                       AND (NOT ? OR ID IN (SELECT trx_mysql_thread_id FROM information_schema.INNODB_TRX))",
                )
                .bind(database)
                .bind(in_transaction)
                .fetch_all(admin)
                .await
                .expect("list the example's connections");
                let mut killed = 0;
                for id in ids {
                    // Gone already (it ended on its own) is not a failure.
                    let done = sqlx::query(sqlx::AssertSqlSafe(format!("KILL {id}")))
                        .execute(admin)
                        .await;
                    killed += usize::from(done.is_ok());
                }
                killed
            }
            Self::Redis(client) => {
                let mut redis = client
                    .get_multiplexed_async_connection()
                    .await
                    .expect("connect to Redis");
                let list: String = redis::cmd("CLIENT")
                    .arg("LIST")
                    .arg("TYPE")
                    .arg("normal")
                    .query_async(&mut redis)
                    .await
                    .expect("CLIENT LIST");
                let mut killed = 0;
                for id in clients_on(&list, &ports) {
                    let done: redis::RedisResult<()> = redis::cmd("CLIENT")
                        .arg("KILL")
                        .arg("ID")
                        .arg(id)
                        .arg("SKIPME")
                        .arg("yes")
                        .query_async(&mut redis)
                        .await;
                    killed += usize::from(done.is_ok());
                }
                killed
            }
            Self::None => 0,
        }
    }
}

/// The ids of the clients in a `CLIENT LIST` whose `addr=HOST:PORT` has one of `ports`.
fn clients_on<'a>(list: &'a str, ports: &'a HashSet<u16>) -> impl Iterator<Item = &'a str> {
    list.lines().filter_map(move |line| {
        let field = |name: &str| {
            line.split_whitespace()
                .find_map(|pair| pair.strip_prefix(name)?.strip_prefix('='))
        };
        let port: u16 = field("addr")?.rsplit_once(':')?.1.parse().ok()?;
        ports.contains(&port).then_some(field("id")?)
    })
}
