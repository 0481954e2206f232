//! The transactional mode on PostgreSQL.
//!
//! Who runs a key is decided by a per-key advisory lock taken with
//! `pg_try_advisory_xact_lock` inside the owner's transaction (held until it commits or
//! rolls back, and released by the server when the owner's connection dies). A duplicate
//! that finds the lock taken learns "busy" at once, and never waits on a pooled connection.
//!
//! The record is written once, completed, just before the commit. An uncommitted claim row
//! would protect nothing the lock does not already protect (nobody else can see it, and the
//! lock keeps every other transactional owner out), so writing it at the claim and updating
//! it at the end would only write the row twice. The claim is therefore a read: take the
//! lock, look for a live record, and delete an expired one.
//!
//! The crate begins and ends these transactions itself ([`OpenTx`]), which lets a new key cost
//! no more round trips than the handler's own transaction: the claim travels in the `BEGIN`'s
//! message and answers with its rows, and the record travels in the `COMMIT`'s. Both messages
//! use the simple query protocol, the only one that carries several statements at once; its
//! values are written as hexadecimal by [`pg_text`](super::pg_text), never escaped. A unique
//! violation on the record means another request recorded the key first (its commit came
//! between this claim's snapshot and its lock, or a claim of the separate mode on the same
//! table got in): the server skips the `COMMIT`, everything of this attempt rolls back, and
//! the caller answers as a duplicate ([`TxCommit::KeyTaken`]).
//!
//! The lock uses the two-integer form, whose key space is separate from the one-`bigint`
//! form; its two halves are 64 bits of the key's SHA-256. Two keys whose halves collide only
//! make one wait for the other.

use std::{
    sync::{Arc, OnceLock},
    time::Duration,
};

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::TryStreamExt;
use sqlx::{postgres::PgPoolOptions, Either, PgConnection, Postgres, Row};

use super::{
    dialect::{begin_then_claim, Probe, TransactionalStore, TxClaim, TxCommit, TxDialect, TxStart},
    open_tx::OpenTx,
    pg_text::{self, Value},
};
use crate::{
    record::{Fingerprint, StoreKey, Token},
    sql,
    store::{PostgresStore, StoreError},
};

const BACKEND: &str = "postgres";

/// SQLSTATE `unique_violation`.
const UNIQUE_VIOLATION: &str = "23505";

/// SQLSTATE `lock_not_available`: a wait on an owner's lock ran out of time.
const LOCK_NOT_AVAILABLE: &str = "55P03";

/// Connections a store may hold, per process, blocked on owners' locks for duplicates waiting
/// in this process (one per key being waited on); past that, duplicates poll.
const WAITING_CONNECTIONS: u32 = 4;

struct PgDialect {
    pool: sqlx::PgPool,
    /// Connections of their own for [`TxDialect::await_owner`], opened on first use: a
    /// blocked wait must never take a connection that a request needs.
    waiting: OnceLock<sqlx::PgPool>,
    table: String,
    claim: sqlx::SqlStr,
    probe: sqlx::SqlStr,
    await_owner: sqlx::SqlStr,
}

/// The claim: take the key's lock, delete an expired record if the lock was taken, and say
/// what was found. Writes nothing unless an expired record is in the way of the final INSERT.
/// The statement's snapshot may predate the lock: a record committed in between is caught by
/// the final INSERT's unique violation.
fn claim_sql(table: &str) -> String {
    format!(
        "WITH lock AS (SELECT pg_try_advisory_xact_lock($3, $4) AS got), \
         expired AS ( \
             DELETE FROM {table} WHERE (SELECT got FROM lock) \
                 AND scope = $1 AND key = $2 AND expires_at <= clock_timestamp() \
             RETURNING 1), \
         live AS ({live}) \
         SELECT 'live' AS found, fingerprint, payload FROM live \
         UNION ALL SELECT CASE WHEN got THEN 'claimed' ELSE 'busy' END, NULL, NULL FROM lock",
        live = live_sql(table),
    )
}

/// The key's live record. `clock_timestamp()`, not `now()`: inside a transaction `now()` is
/// the moment it began, and the record's retention must run from its completion.
fn live_sql(table: &str) -> String {
    format!(
        "SELECT fingerprint, payload FROM {table} \
         WHERE scope = $1 AND key = $2 AND expires_at > clock_timestamp()"
    )
}

impl TransactionalStore for PostgresStore {
    type Database = Postgres;

    fn dialect(&self) -> Arc<dyn TxDialect<Postgres>> {
        let t = self.table().as_str();
        // Outside a transaction the advisory lock lives for this one statement: it only asks
        // whether a transaction holds it right now.
        let probe = format!(
            "WITH lock AS (SELECT pg_try_advisory_xact_lock($3, $4) AS got), live AS ({}) \
             SELECT 'live' AS found, fingerprint, payload FROM live \
             UNION ALL SELECT 'busy', NULL, NULL FROM lock WHERE NOT got",
            live_sql(t)
        );
        Arc::new(PgDialect {
            pool: self.pool().clone(),
            waiting: OnceLock::new(),
            table: t.to_owned(),
            claim: sql::statement(claim_sql(t)),
            probe: sql::statement(probe),
            // The target list runs left to right: the time limit is set before the wait. The
            // shared lock is granted once the owner's transaction has ended, its record
            // visible, and it is let go again at the end of this statement.
            await_owner: sql::statement(
                "SELECT set_config('lock_timeout', $1, false), pg_advisory_xact_lock_shared($2, $3)"
                    .to_owned(),
            ),
        })
    }
}

/// Two 32-bit halves of the key's digest: the name of a per-key advisory lock.
fn lock_id(key: &StoreKey) -> (i32, i32) {
    let digest = key.digest();
    let half = |at: usize| {
        i32::from_be_bytes([digest[at], digest[at + 1], digest[at + 2], digest[at + 3]])
    };
    (half(0), half(4))
}

fn backend(error: sqlx::Error) -> StoreError {
    StoreError::backend(BACKEND, error)
}

/// [`backend`] for a statement that carried a `COMMIT`: a broken connection leaves the
/// outcome unknown.
fn commit_failed(error: sqlx::Error) -> StoreError {
    super::unknown::commit_failed(BACKEND, error)
}

/// What the `found` rows of a claim or a probe say: a live record beats a claim or "busy".
enum Found {
    Claimed,
    Live(crate::Record),
    Busy,
    Nothing,
}

fn found(rows: &[sqlx::postgres::PgRow]) -> Result<Found, StoreError> {
    let mut verdict = Found::Nothing;
    for row in rows {
        match row.try_get::<&str, _>("found").map_err(backend)? {
            "live" => {
                let fingerprint: Vec<u8> = row.try_get("fingerprint").map_err(backend)?;
                let payload: Option<Vec<u8>> = row.try_get("payload").map_err(backend)?;
                return Ok(Found::Live(sql::decode_record(
                    BACKEND,
                    &fingerprint,
                    payload,
                )?));
            }
            "claimed" => verdict = Found::Claimed,
            _ => verdict = Found::Busy,
        }
    }
    Ok(verdict)
}

/// The owner's `BEGIN`, with the setting that ends a transaction left idle for `idle_limit`
/// (an owner stuck without dying), which frees its key.
fn begin_sql(idle_limit: Duration) -> Result<String, StoreError> {
    let idle_ms = sql::millis(idle_limit)?.max(1);
    Ok(format!(
        "BEGIN; SET LOCAL idle_in_transaction_session_timeout = {idle_ms}"
    ))
}

impl PgDialect {
    /// A pooled connection, wrapped before anything is sent on it (see [`OpenTx::own`]).
    async fn connection(&self) -> Result<OpenTx<Postgres>, StoreError> {
        Ok(OpenTx::own(self.pool.acquire().await.map_err(backend)?))
    }

    /// Ends a crate-owned transaction with `statement` (`COMMIT` or `ROLLBACK`); the
    /// connection goes back to the pool only if the server confirmed it, else it is closed.
    async fn end(
        &self,
        mut tx: OpenTx<Postgres>,
        statement: &'static str,
        failed: fn(sqlx::Error) -> StoreError,
    ) -> Result<(), StoreError> {
        sqlx::raw_sql(statement)
            .execute(&mut *tx)
            .await
            .map_err(failed)?;
        drop(tx.into_connection());
        Ok(())
    }

    /// Rolls back a transaction that is already lost (its claim found the key taken, or a
    /// statement failed): a failure here only means the connection is gone, which ends the
    /// transaction too.
    async fn abandon(&self, tx: OpenTx<Postgres>) {
        if let Err(error) = self.end(tx, "ROLLBACK", backend).await {
            tracing::debug!(%error, "rollback failed; the server ends the transaction with the connection");
        }
    }

    /// [`abandon`](Self::abandon) after `error`; but a connection whose server refuses
    /// writes (a standby, a primary demoted by a failover) is closed instead, so that the
    /// pool opens a new one, which goes where the proxy points now (see
    /// `sql::is_wrong_server`). Closing it ends the transaction too.
    async fn abandon_after(&self, tx: OpenTx<Postgres>, error: &sqlx::Error) {
        if sql::is_wrong_server(error) {
            sql::log_closing(error);
            drop(tx);
        } else {
            self.abandon(tx).await;
        }
    }
}

#[async_trait]
impl TxDialect<Postgres> for PgDialect {
    async fn begin(&self, idle_limit: Duration) -> Result<OpenTx<Postgres>, StoreError> {
        let mut tx = self.connection().await?;
        // One round trip: the setting rides on the BEGIN. Its only value is a number.
        sqlx::raw_sql(sqlx::AssertSqlSafe(begin_sql(idle_limit)?))
            .execute(&mut *tx)
            .await
            .map_err(backend)?;
        Ok(tx)
    }

    async fn claim_in(
        &self,
        conn: &mut PgConnection,
        key: &StoreKey,
        _fingerprint: &Fingerprint,
        _lease: Duration,
    ) -> Result<TxClaim, StoreError> {
        let (high, low) = lock_id(key);
        let rows = sqlx::query(self.claim.clone())
            .bind(key.scope())
            .bind(key.key())
            .bind(high)
            .bind(low)
            .fetch_all(&mut *conn)
            .await
            .map_err(backend)?;
        Ok(match found(&rows)? {
            Found::Claimed => TxClaim::Claimed(Token::random()),
            Found::Live(record) => TxClaim::Existing(record),
            Found::Busy | Found::Nothing => TxClaim::Busy,
        })
    }

    async fn begin_claim(
        &self,
        idle_limit: Duration,
        key: &StoreKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<TxStart<Postgres>, StoreError> {
        let (high, low) = lock_id(key);
        let (mut scope, mut key_text) = (String::new(), String::new());
        pg_text::push(&mut scope, Value::Text(key.scope()));
        pg_text::push(&mut key_text, Value::Text(key.key()));
        // The BEGIN, the claim and the removal of an expired record in one message, hence one
        // round trip, for the common case of a new key: two flags, "took the lock" and "a live
        // record is there". The DELETE asks for the lock again (it is the transaction's
        // already, or it was not free and the DELETE removes nothing). Anything but a new key
        // is settled the slower way, after a rollback, by a probe.
        let t = &self.table;
        let (this_key, high, low) = (format!("scope = {scope} AND key = {key_text}"), &high, &low);
        let text = format!(
            "{begin}; \
             SELECT pg_try_advisory_xact_lock({high}, {low}) AS got, EXISTS ( \
                 SELECT 1 FROM {t} WHERE {this_key} AND expires_at > clock_timestamp()) AS live; \
             DELETE FROM {t} WHERE {this_key} AND expires_at <= clock_timestamp() \
                 AND pg_try_advisory_xact_lock({high}, {low})",
            begin = begin_sql(idle_limit)?,
        );
        let mut tx = self.connection().await?;
        // Every value in the text is a number or written by `pg_text`.
        // All rows read (only the SELECT gives one): an error of the DELETE must surface here.
        let flags = sqlx::raw_sql(sqlx::AssertSqlSafe(text))
            .fetch_all(&mut *tx)
            .await
            .and_then(|rows| match rows.first() {
                Some(row) => Ok((
                    row.try_get::<bool, _>("got")?,
                    row.try_get::<bool, _>("live")?,
                )),
                None => Err(sqlx::Error::RowNotFound),
            });
        match flags {
            Ok((true, false)) => {
                return Ok(TxStart::Owner {
                    tx,
                    token: Token::random(),
                })
            }
            Ok(_) => self.abandon(tx).await,
            Err(error) => {
                self.abandon_after(tx, &error).await;
                return Err(backend(error));
            }
        }
        match self.probe(key).await? {
            Probe::Live(record) => Ok(TxStart::Existing(record)),
            Probe::Busy => Ok(TxStart::Busy),
            // Whoever held it gave up in between: claim the slow way.
            Probe::Absent => begin_then_claim(self, idle_limit, key, fingerprint, lease).await,
        }
    }

    async fn commit_with(
        &self,
        mut tx: OpenTx<Postgres>,
        key: &StoreKey,
        fingerprint: &Fingerprint,
        _token: Token,
        payload: Bytes,
        retention: Duration,
    ) -> Result<TxCommit, StoreError> {
        // The record and the COMMIT in one message, hence one round trip. An error in the
        // INSERT makes the server skip the COMMIT: a failed INSERT never commits.
        let retention = sql::millis(retention)?;
        let mut text = String::with_capacity(300 + 2 * payload.len() + 2 * key.key().len());
        text.push_str("INSERT INTO ");
        text.push_str(&self.table);
        text.push_str(" (scope, key, fingerprint, token, payload, expires_at) VALUES (");
        pg_text::push(&mut text, Value::Text(key.scope()));
        text.push_str(", ");
        pg_text::push(&mut text, Value::Text(key.key()));
        text.push_str(", ");
        pg_text::push(&mut text, Value::Bytes(fingerprint.as_bytes()));
        text.push_str(", NULL, ");
        pg_text::push(&mut text, Value::Bytes(&payload));
        // No NOTIFY: PostgreSQL serialises the commits of notifying transactions, which would
        // cap every owner's commit; duplicates elsewhere wait on the key's lock instead.
        text.push_str(&format!(
            ", clock_timestamp() + {retention} * interval '1 millisecond'); COMMIT"
        ));
        // Every value in the text is a number or written by `pg_text`.
        let outcome = {
            let mut results = sqlx::raw_sql(sqlx::AssertSqlSafe(text)).fetch_many(&mut *tx);
            let mut done = 0;
            loop {
                match results.try_next().await {
                    Ok(Some(Either::Left(_))) => done += 1,
                    Ok(Some(Either::Right(_))) => {}
                    Ok(None) => break Ok(TxCommit::Committed),
                    // The INSERT itself failed on the key: someone recorded it first.
                    Err(sqlx::Error::Database(error))
                        if done == 0 && error.code().as_deref() == Some(UNIQUE_VIOLATION) =>
                    {
                        break Ok(TxCommit::KeyTaken)
                    }
                    Err(error) => break Err(error),
                }
            }
        };
        match outcome {
            Ok(TxCommit::Committed) => {
                drop(tx.into_connection());
                Ok(TxCommit::Committed)
            }
            Ok(TxCommit::KeyTaken) => {
                self.abandon(tx).await;
                Ok(TxCommit::KeyTaken)
            }
            Err(error) => {
                self.abandon_after(tx, &error).await;
                Err(commit_failed(error))
            }
        }
    }

    async fn commit(&self, tx: OpenTx<Postgres>) -> Result<(), StoreError> {
        self.end(tx, "COMMIT", commit_failed).await
    }

    async fn rollback(&self, tx: OpenTx<Postgres>) -> Result<(), StoreError> {
        self.end(tx, "ROLLBACK", backend).await
    }

    fn can_await_owner(&self) -> bool {
        true
    }

    async fn await_owner(&self, key: &StoreKey, at_most: Duration) -> Result<bool, StoreError> {
        let waiting = self.waiting.get_or_init(|| {
            PgPoolOptions::new()
                .max_connections(WAITING_CONNECTIONS)
                // All taken: poll rather than queue behind other keys' waits.
                .acquire_timeout(Duration::from_millis(20))
                .connect_lazy_with((*self.pool.connect_options()).clone())
        });
        let Ok(mut conn) = waiting.acquire().await else {
            return Ok(false);
        };
        let (high, low) = lock_id(key);
        let limit = format!("{}ms", sql::millis(at_most)?.max(1));
        match sqlx::query(self.await_owner.clone())
            .bind(limit)
            .bind(high)
            .bind(low)
            .execute(&mut *conn)
            .await
        {
            Ok(_) => Ok(true),
            Err(sqlx::Error::Database(error))
                if error.code().as_deref() == Some(LOCK_NOT_AVAILABLE) =>
            {
                Ok(false)
            }
            Err(error) => Err(backend(error)),
        }
    }

    async fn probe(&self, key: &StoreKey) -> Result<Probe, StoreError> {
        let (high, low) = lock_id(key);
        let rows = sqlx::query(self.probe.clone())
            .bind(key.scope())
            .bind(key.key())
            .bind(high)
            .bind(low)
            .fetch_all(&self.pool)
            .await
            .map_err(backend)?;
        Ok(match found(&rows)? {
            Found::Live(record) => Probe::Live(record),
            Found::Busy => Probe::Busy,
            Found::Claimed | Found::Nothing => Probe::Absent,
        })
    }
}
