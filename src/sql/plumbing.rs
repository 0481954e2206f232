//! Plumbing shared by the sqlx stores (Postgres, SQLite, MySQL): error mapping and decoding of
//! the columns every SQL schema has. Each dialect's statements live in its own module.

use std::time::Duration;

use bytes::Bytes;

use crate::record::{Fingerprint, Record};
use crate::store::StoreError;

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

/// A statement this crate built once (when a store is built) around a validated
/// [`TableName`](super::TableName), which admits identifiers only, never user data.
/// Held as an `Arc<str>`, so the clone handed to each query bumps a reference count instead
/// of copying the text.
pub(crate) fn statement(sql: String) -> sqlx::SqlStr {
    sqlx::SqlSafeStr::into_sql_str(sqlx::AssertSqlSafe(std::sync::Arc::<str>::from(sql)))
}

/// Reads a 16-byte token column.
#[cfg(feature = "mysql")]
pub(crate) fn decode_token(
    backend: &'static str,
    bytes: &[u8],
) -> Result<crate::record::Token, StoreError> {
    <[u8; 16]>::try_from(bytes)
        .map(crate::record::Token::from_bytes)
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

/// Runs `schema` (one or more statements) on PostgreSQL the way this crate creates its own
/// tables: in one transaction, under a transaction-scoped advisory lock named after `name`,
/// so that processes starting at the same moment take turns. Use it for your own tables
/// (the handlers' tables of an inbox consumer, say).
///
/// Two sessions that run `CREATE TABLE IF NOT EXISTS t` at once can both find `t` missing,
/// and one then fails on a catalog index (`duplicate key value violates unique constraint
/// "pg_type_typname_nsp_index"`): `IF NOT EXISTS` does not guard against a concurrent create.
/// MySQL / MariaDB (a metadata lock) and SQLite (one writer) queue concurrent DDL instead, so
/// plain `IF NOT EXISTS` statements are safe there.
///
/// `schema` must be idempotent (`CREATE TABLE IF NOT EXISTS`, `CREATE INDEX IF NOT EXISTS`,
/// ...). When every table and index it creates that way exists already (every start after
/// the first), nothing runs and no lock is taken: even `CREATE INDEX IF NOT EXISTS` takes a
/// SHARE lock on its table before it finds the index there, which would queue behind any
/// open transaction that wrote to the table. `name` is the lock's name; when it is a
/// schema-qualified table name (`app.receipts`), indexes `schema` creates are looked up in
/// that schema. `schema` is your own DDL, never user input.
///
/// ```no_run
/// # async fn start(pool: sqlx::PgPool) -> Result<(), sqlx::Error> {
/// tower_idempotency::sql::migrate_postgres(
///     &pool,
///     "receipts",
///     "CREATE TABLE IF NOT EXISTS receipts (payment_id TEXT NOT NULL, amount BIGINT NOT NULL)",
/// )
/// .await?;
/// # Ok(())
/// # }
/// ```
#[cfg(feature = "postgres")]
pub async fn migrate_postgres(
    pool: &sqlx::PgPool,
    name: &str,
    schema: &str,
) -> Result<(), sqlx::Error> {
    use sqlx::Executor;
    let relations = created_relations(schema, name);
    let present: Option<bool> =
        sqlx::query_scalar("SELECT bool_and(to_regclass(r) IS NOT NULL) FROM unnest($1::text[]) r")
            .bind(&relations)
            .fetch_one(pool)
            .await?;
    if present == Some(true) {
        return Ok(());
    }
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))")
        .bind(format!("tower-idempotency migrate {name}"))
        .execute(&mut *tx)
        .await?;
    // Through `Executor::execute` (a boxed future) rather than `RawSql::execute`, whose
    // generic async fn makes the caller's future fail to be `Send` (rustc's higher-ranked
    // lifetime limitation), so `migrate` could not be spawned.
    tx.execute(sqlx::raw_sql(sqlx::AssertSqlSafe(schema)))
        .await?;
    tx.commit().await
}

/// The tables and indexes `schema` creates (`CREATE TABLE|INDEX IF NOT EXISTS <name>`), each
/// index qualified with the schema of `table` when it has one (an index lives in its table's
/// schema). The text is this crate's own DDL, never user input.
#[cfg(feature = "postgres")]
fn created_relations(schema: &str, table: &str) -> Vec<String> {
    let table_schema = table.rsplit_once('.').map(|(schema, _)| schema);
    let mut relations = Vec::new();
    for (marker, qualify) in [
        ("CREATE TABLE IF NOT EXISTS ", false),
        ("CREATE INDEX IF NOT EXISTS ", true),
    ] {
        for (at, _) in schema.match_indices(marker) {
            let name = schema[at + marker.len()..]
                .split(|c: char| c.is_whitespace() || c == '(')
                .next()
                .unwrap_or_default();
            match table_schema {
                Some(prefix) if qualify => relations.push(format!("{prefix}.{name}")),
                _ => relations.push(name.to_owned()),
            }
        }
    }
    relations
}

#[cfg(all(test, feature = "postgres"))]
mod tests {
    use super::created_relations;

    #[test]
    fn the_relations_a_schema_creates_are_found_and_indexes_qualified() {
        let schema = "CREATE TABLE IF NOT EXISTS s.t (a INT);\nCREATE INDEX IF NOT EXISTS t_a_idx\n    ON s.t (a);\n";
        assert_eq!(created_relations(schema, "s.t"), ["s.t", "s.t_a_idx"]);
        let schema =
            "CREATE TABLE IF NOT EXISTS t (a INT);\nCREATE INDEX IF NOT EXISTS t_a_idx ON t (a);";
        assert_eq!(created_relations(schema, "t"), ["t", "t_a_idx"]);
    }
}
