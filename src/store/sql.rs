//! Plumbing shared by the sqlx stores (Postgres, SQLite, MySQL): error mapping and decoding of
//! the columns every SQL schema has. Each dialect's statements live in its own module.

use std::time::Duration;

use bytes::Bytes;

use super::StoreError;
use crate::record::{Fingerprint, Record, Token};

/// Wraps a sqlx error as a typed backend error, keeping it as the source.
pub(crate) fn backend(backend: &'static str, error: sqlx::Error) -> StoreError {
    StoreError::backend(backend, error)
}

/// The answer of a fenced statement (`complete`, `release`, `renew`): it touches the one
/// row the token holds, or nothing because the token no longer holds a live claim.
pub(crate) fn fenced(rows_affected: u64) -> Result<(), StoreError> {
    if rows_affected == 0 {
        Err(StoreError::StaleToken)
    } else {
        Ok(())
    }
}

/// Reads a 16-byte token column.
pub(crate) fn decode_token(backend: &'static str, bytes: &[u8]) -> Result<Token, StoreError> {
    <[u8; 16]>::try_from(bytes)
        .map(Token::from_bytes)
        .map_err(|_| {
            corrupt(
                backend,
                format!("token column has {} bytes, expected 16", bytes.len()),
            )
        })
}

/// Reads a 32-byte fingerprint column.
pub(crate) fn decode_fingerprint(
    backend: &'static str,
    bytes: &[u8],
) -> Result<Fingerprint, StoreError> {
    <[u8; 32]>::try_from(bytes)
        .map(Fingerprint::from_bytes)
        .map_err(|_| {
            corrupt(
                backend,
                format!("fingerprint column has {} bytes, expected 32", bytes.len()),
            )
        })
}

/// Reads a live row of the common SQL layout, where a `NULL` payload means "still in
/// progress" (a completed record always has a payload, if only an empty one).
pub(crate) fn decode_record(
    backend: &'static str,
    fingerprint: &[u8],
    payload: Option<Vec<u8>>,
) -> Result<Record, StoreError> {
    let fingerprint = decode_fingerprint(backend, fingerprint)?;
    Ok(match payload {
        None => Record::InProgress { fingerprint },
        Some(payload) => Record::Completed {
            fingerprint,
            payload: Bytes::from(payload),
        },
    })
}

/// A lease or retention as whole milliseconds for SQL interval arithmetic; refuses durations
/// that do not fit (centuries), instead of wrapping around.
pub(crate) fn millis(duration: Duration) -> Result<i64, StoreError> {
    i64::try_from(duration.as_millis())
        .map_err(|_| StoreError::Config(format!("duration {duration:?} is too long for the store")))
}

fn corrupt(backend: &'static str, detail: String) -> StoreError {
    StoreError::Corrupt { backend, detail }
}

/// Runs `schema` (several statements) on PostgreSQL in one transaction under an advisory lock
/// named after `what`, so that processes starting at once do not race on `CREATE .. IF NOT
/// EXISTS` (which is not safe against a concurrent create of the same table).
#[cfg(feature = "postgres")]
pub(crate) async fn migrate_postgres(
    pool: &sqlx::PgPool,
    what: &str,
    schema: &str,
) -> Result<(), sqlx::Error> {
    use sqlx::Executor;
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))")
        .bind(format!("tower-idempotency migrate {what}"))
        .execute(&mut *tx)
        .await?;
    // Through `Executor::execute` (a boxed future) rather than `RawSql::execute`, whose
    // generic async fn makes the caller's future fail to be `Send` (rustc's higher-ranked
    // lifetime limitation), so `migrate` could not be spawned.
    tx.execute(sqlx::raw_sql(schema)).await?;
    tx.commit().await
}
