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
//! lock, look for a live record, and delete an expired one; for a new key it travels in the
//! `BEGIN`'s own round trip (see [`TxDialect::begin_claim`]). The completion is a plain
//! `INSERT`, sent in one round trip with the `COMMIT`: a unique violation there means another
//! request recorded the key first (its commit came between this claim's snapshot and its
//! lock, or a claim of the separate mode on the same table got in), so the statement fails,
//! the `COMMIT` never runs, everything of this attempt rolls back, and the caller answers
//! as a duplicate ([`TxCommit::KeyTaken`]).
//!
//! The lock uses the two-integer form, whose key space is separate from the one-`bigint`
//! form; its two halves are 64 bits of the key's SHA-256. Two keys whose halves collide only
//! make one wait for the other.

use std::{
    fmt::Write,
    sync::{Arc, OnceLock},
    time::Duration,
};

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::TryStreamExt;
use sqlx::{postgres::PgPoolOptions, Either, PgConnection, Postgres, Row, Transaction};

use super::dialect::{
    begin_then_claim, Probe, TransactionalStore, TxClaim, TxCommit, TxDialect, TxStart,
};
use crate::{
    record::{Fingerprint, StoreKey, Token},
    sql,
    store::{PostgresStore, StoreError},
};

const BACKEND: &str = "postgres";

/// SQLSTATE `division_by_zero`: how the one-round-trip claim says "not a new key here".
const NOT_CLAIMED: &str = "22012";

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

impl TransactionalStore for PostgresStore {
    type Database = Postgres;

    fn dialect(&self) -> Arc<dyn TxDialect<Postgres>> {
        let t = self.table().as_str();
        // `clock_timestamp()`, not `now()`: inside a transaction `now()` is the moment it
        // began, and the record's retention must run from its completion.
        let live = format!(
            "SELECT fingerprint, payload FROM {t} \
             WHERE scope = $1 AND key = $2 AND expires_at > clock_timestamp()"
        );
        // Writes nothing unless an expired record is in the way of the final INSERT. The
        // statement's snapshot may predate the lock: a record committed in between is caught
        // by the final INSERT's unique violation.
        let claim = format!(
            "WITH lock AS (SELECT pg_try_advisory_xact_lock($3, $4) AS got), \
             expired AS ( \
                 DELETE FROM {t} WHERE (SELECT got FROM lock) \
                     AND scope = $1 AND key = $2 AND expires_at <= clock_timestamp() \
                 RETURNING 1), \
             live AS ({live}) \
             SELECT 'live' AS found, fingerprint, payload FROM live \
             UNION ALL SELECT CASE WHEN got THEN 'claimed' ELSE 'busy' END, NULL, NULL FROM lock"
        );
        // Outside a transaction the advisory lock lives for this one statement: it only asks
        // whether a transaction holds it right now.
        let probe = format!(
            "WITH lock AS (SELECT pg_try_advisory_xact_lock($3, $4) AS got), live AS ({live}) \
             SELECT 'live' AS found, fingerprint, payload FROM live \
             UNION ALL SELECT 'busy', NULL, NULL FROM lock WHERE NOT got"
        );
        Arc::new(PgDialect {
            pool: self.pool().clone(),
            waiting: OnceLock::new(),
            table: t.to_owned(),
            claim: sql::statement(claim),
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

/// `text` as an escape string constant, `E'...'`: backslashes and quotes doubled, read the
/// same whatever `standard_conforming_strings` says. `text` holds no NUL: a key with one is
/// claimed with bound parameters, which the server refuses.
fn text_literal(out: &mut String, text: &str) {
    out.push_str("E'");
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\'' => out.push_str("''"),
            c => out.push(c),
        }
    }
    out.push('\'');
}

/// `bytes` as a `bytea` constant in the hex format.
fn bytea_literal(out: &mut String, bytes: &[u8]) {
    out.push_str("E'\\\\x");
    for byte in bytes {
        // Writing into a String cannot fail.
        let _ = write!(out, "{byte:02x}");
    }
    out.push_str("'::bytea");
}

/// What the `found` rows of a claim or a probe say: a live record beats a claim or "busy".
enum Found {
    Claimed,
    Live(crate::Record),
    Busy,
    Nothing,
}

/// The owner's `BEGIN`, with the setting that ends a transaction left idle for `idle_limit`
/// (an owner stuck without dying), which frees its key.
fn begin_text(idle_limit: Duration) -> Result<String, StoreError> {
    let idle_ms = sql::millis(idle_limit)?.max(1);
    Ok(format!(
        "BEGIN; SET LOCAL idle_in_transaction_session_timeout = {idle_ms}"
    ))
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

#[async_trait]
impl TxDialect<Postgres> for PgDialect {
    async fn begin(
        &self,
        idle_limit: Duration,
    ) -> Result<Transaction<'static, Postgres>, StoreError> {
        // One round trip: the setting rides on the BEGIN.
        self.pool
            .begin_with(sqlx::AssertSqlSafe(begin_text(idle_limit)?))
            .await
            .map_err(backend)
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
        // A NUL cannot travel inside a query text: such a key takes the bound claim, whose
        // parameters the server refuses with a clear error.
        if key.scope().contains('\0') || key.key().contains('\0') {
            return begin_then_claim(self, idle_limit, key, fingerprint, lease).await;
        }
        let begin = begin_text(idle_limit)?;
        let (high, low) = lock_id(key);
        let t = &self.table;
        let mut this_key = String::with_capacity(40 + key.scope().len() + key.key().len());
        this_key.push_str("scope = ");
        text_literal(&mut this_key, key.scope());
        this_key.push_str(" AND key = ");
        text_literal(&mut this_key, key.key());
        // The BEGIN, the claim and the removal of an expired record in one text, hence one
        // round trip, for the common case of a new key. The claim's SELECT divides by zero
        // unless it took the key's lock and found no live record (in whatever order the
        // server evaluates the two), which aborts the text with the transaction: the key is
        // busy or recorded, and the probe below tells which. A DELETE runs only under the lock.
        let text = format!(
            "{begin}; \
             SELECT 1 / (pg_try_advisory_xact_lock({high}, {low}) AND NOT EXISTS ( \
                 SELECT 1 FROM {t} WHERE {this_key} AND expires_at > clock_timestamp()))::int; \
             DELETE FROM {t} WHERE {this_key} AND expires_at <= clock_timestamp()"
        );
        // Every value in the text is a number or a literal escaped above.
        match self.pool.begin_with(sqlx::AssertSqlSafe(text)).await {
            Ok(tx) => {
                return Ok(TxStart::Owner {
                    tx,
                    token: Token::random(),
                })
            }
            // sqlx has queued the ROLLBACK of the aborted transaction on that connection.
            Err(sqlx::Error::Database(error)) if error.code().as_deref() == Some(NOT_CLAIMED) => {}
            Err(error) => return Err(backend(error)),
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
        mut tx: Transaction<'static, Postgres>,
        key: &StoreKey,
        fingerprint: &Fingerprint,
        _token: Token,
        payload: Bytes,
        retention: Duration,
    ) -> Result<TxCommit, StoreError> {
        // One simple query, so one round trip: the record, the COMMIT, and a BEGIN that
        // leaves the connection in the transaction sqlx still counts, which it rolls back
        // (empty, so silently) when `tx` is dropped, riding on the pool's release ping. An
        // error anywhere abandons the rest of the text: a failed INSERT never commits.
        let retention = sql::millis(retention)?;
        let mut text = String::with_capacity(200 + 2 * payload.len() + key.key().len());
        let _ = write!(
            text,
            "INSERT INTO {} (scope, key, fingerprint, token, payload, expires_at) VALUES (",
            self.table
        );
        text_literal(&mut text, key.scope());
        text.push_str(", ");
        text_literal(&mut text, key.key());
        text.push_str(", ");
        bytea_literal(&mut text, fingerprint.as_bytes());
        text.push_str(", NULL, ");
        bytea_literal(&mut text, &payload);
        // No NOTIFY: PostgreSQL serialises the commits of notifying transactions, which would
        // cap every owner's commit; duplicates elsewhere wait on the key's lock instead.
        let _ = write!(
            text,
            ", clock_timestamp() + {retention} * interval '1 millisecond'); COMMIT; BEGIN"
        );
        // Every value in the text is a literal escaped above.
        let mut results = sqlx::raw_sql(sqlx::AssertSqlSafe(text)).fetch_many(&mut *tx);
        let mut done = 0;
        loop {
            match results.try_next().await {
                Ok(Some(Either::Left(_))) => done += 1,
                Ok(Some(Either::Right(_))) => {}
                Ok(None) => break,
                // The INSERT itself failed on the key: someone recorded it first.
                Err(sqlx::Error::Database(error))
                    if done == 0 && error.code().as_deref() == Some(UNIQUE_VIOLATION) =>
                {
                    return Ok(TxCommit::KeyTaken)
                }
                Err(error) => return Err(backend(error)),
            }
        }
        Ok(TxCommit::Committed)
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
