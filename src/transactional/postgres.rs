//! The transactional mode on PostgreSQL.
//!
//! Who runs a key is decided by a per-key advisory lock taken with
//! `pg_try_advisory_xact_lock` inside the owner's transaction (held until it commits or
//! rolls back, and released by the server when the owner's connection dies) together with
//! the usual `INSERT .. ON CONFLICT` on the records table. A duplicate that finds the lock
//! taken learns "busy" at once instead of queueing behind the owner's uncommitted row, which
//! would hold a pooled connection for as long as the owner runs.
//!
//! The lock uses the two-integer form, whose key space is separate from the one-`bigint`
//! form; its two halves are 64 bits of the key's SHA-256. Two keys whose halves collide only
//! make one wait for the other.

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use bytes::Bytes;
use sqlx::{PgConnection, Postgres, Row, Transaction};

use super::dialect::{Probe, TransactionalStore, TxClaim, TxDialect};
use crate::{
    record::{Fingerprint, StoreKey, Token},
    sql,
    store::{pg_notify, PostgresStore, StoreError},
};

const BACKEND: &str = "postgres";

/// How often a claim re-runs when its snapshot missed a record committed concurrently.
const CLAIM_ATTEMPTS: usize = 8;

struct PgDialect {
    pool: sqlx::PgPool,
    claim: sqlx::SqlStr,
    complete: sqlx::SqlStr,
    probe: sqlx::SqlStr,
    /// Whether `complete` notifies the store's listeners (at commit), taking the key's
    /// digest as its last parameter.
    notify: bool,
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
        // The lock is taken before the insert is attempted (the INSERT's WHERE reads it), so
        // a busy key never reaches the unique index, where it would wait. `live` and the
        // insert share one snapshot, as in the separate mode's claim; a record committed after
        // that snapshot makes the statement answer nothing, and it runs again.
        let claim = format!(
            "WITH lock AS (SELECT pg_try_advisory_xact_lock($6, $7) AS got), \
             live AS ({live}), \
             claimed AS ( \
                 INSERT INTO {t} AS r (scope, key, fingerprint, token, payload, expires_at) \
                 SELECT $1, $2, $3, $4, NULL, clock_timestamp() + $5 * interval '1 millisecond' \
                 WHERE (SELECT got FROM lock) AND NOT EXISTS (SELECT 1 FROM live) \
                 ON CONFLICT (scope, key) DO UPDATE \
                     SET fingerprint = excluded.fingerprint, token = excluded.token, \
                         payload = NULL, expires_at = excluded.expires_at \
                     WHERE r.expires_at <= clock_timestamp() \
                 RETURNING 1) \
             SELECT 'claimed' AS found, NULL::bytea AS fingerprint, NULL::bytea AS payload FROM claimed \
             UNION ALL SELECT 'live', fingerprint, payload FROM live \
             UNION ALL SELECT 'busy', NULL, NULL FROM lock WHERE NOT got"
        );
        let complete = format!(
            "UPDATE {t} SET token = NULL, payload = $4, \
                 expires_at = clock_timestamp() + $5 * interval '1 millisecond' \
             WHERE scope = $1 AND key = $2 AND token = $3"
        );
        // The notification is queued by the completing statement and delivered at commit,
        // never on rollback.
        let complete = match self.channel() {
            Some(channel) => pg_notify::notifying(&complete, channel, 6),
            None => complete,
        };
        // Outside a transaction the advisory lock lives for this one statement: it only asks
        // whether a transaction holds it right now.
        let probe = format!(
            "WITH lock AS (SELECT pg_try_advisory_xact_lock($3, $4) AS got), live AS ({live}) \
             SELECT 'live' AS found, fingerprint, payload FROM live \
             UNION ALL SELECT 'busy', NULL, NULL FROM lock WHERE NOT got"
        );
        Arc::new(PgDialect {
            pool: self.pool().clone(),
            claim: sql::statement(claim),
            complete: sql::statement(complete),
            probe: sql::statement(probe),
            notify: self.channel().is_some(),
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

/// What the `found` rows of a claim or a probe say: a claim beats a live record beats
/// "busy"; no row at all means the snapshot missed a concurrent commit.
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
            "claimed" => return Ok(Found::Claimed),
            "live" => {
                let fingerprint: Vec<u8> = row.try_get("fingerprint").map_err(backend)?;
                let payload: Option<Vec<u8>> = row.try_get("payload").map_err(backend)?;
                verdict = Found::Live(sql::decode_record(BACKEND, &fingerprint, payload)?);
            }
            _ if matches!(verdict, Found::Nothing) => verdict = Found::Busy,
            _ => {}
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
        // One round trip: the setting rides on the BEGIN. A transaction left idle that long
        // (an owner stuck without dying) is ended by the server, which frees its key.
        let idle_ms = sql::millis(idle_limit)?.max(1);
        self.pool
            .begin_with(sqlx::AssertSqlSafe(format!(
                "BEGIN; SET LOCAL idle_in_transaction_session_timeout = {idle_ms}"
            )))
            .await
            .map_err(backend)
    }

    async fn claim_in(
        &self,
        conn: &mut PgConnection,
        key: &StoreKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<TxClaim, StoreError> {
        let (high, low) = lock_id(key);
        let lease = sql::millis(lease)?;
        for attempt in 1..=CLAIM_ATTEMPTS {
            let token = Token::random();
            let rows = sqlx::query(self.claim.clone())
                .bind(key.scope())
                .bind(key.key())
                .bind(fingerprint.as_bytes().as_slice())
                .bind(token.to_bytes().as_slice())
                .bind(lease)
                .bind(high)
                .bind(low)
                .fetch_all(&mut *conn)
                .await
                .map_err(backend)?;
            match found(&rows)? {
                Found::Claimed => return Ok(TxClaim::Claimed(token)),
                Found::Live(record) => return Ok(TxClaim::Existing(record)),
                Found::Busy => return Ok(TxClaim::Busy),
                Found::Nothing => {
                    tracing::trace!(key = %key.log_id(), attempt, "claim raced a concurrent commit, retrying");
                }
            }
        }
        Err(StoreError::backend(
            BACKEND,
            format!("claim found the key changed by concurrent transactions {CLAIM_ATTEMPTS} times in a row"),
        ))
    }

    async fn complete_in(
        &self,
        conn: &mut PgConnection,
        key: &StoreKey,
        token: Token,
        payload: Bytes,
        retention: Duration,
    ) -> Result<(), StoreError> {
        let token = token.to_bytes();
        let query = sqlx::query(self.complete.clone())
            .bind(key.scope())
            .bind(key.key())
            .bind(token.as_slice())
            .bind(payload.as_ref())
            .bind(sql::millis(retention)?);
        let done = pg_notify::bind_payload(query, key, self.notify)
            .execute(&mut *conn)
            .await
            .map_err(backend)?;
        sql::fenced(done.rows_affected())
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
