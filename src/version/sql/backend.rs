use futures_util::future::BoxFuture;
use sqlx::Database;

use super::ConflictReason;

/// The databases [`VersionedTable`](super::VersionedTable) can drive: `sqlx::Postgres`,
/// `sqlx::Sqlite` and `sqlx::MySql` (each behind its cargo feature). Sealed: what differs
/// between them (placeholders, `RETURNING`, locking reads, error codes) is this crate's
/// business.
pub trait VersionedBackend: Database + sealed::Backend {}

impl<DB: Database + sealed::Backend> VersionedBackend for DB {}

pub(super) mod sealed {
    use super::*;

    /// What one statement reported.
    pub struct Executed {
        pub rows_affected: u64,
        /// MySQL's `LAST_INSERT_ID(expr)` value, which carries the new version.
        pub last_insert_id: u64,
    }

    pub trait Backend: Database {
        /// Whether `UPDATE .. RETURNING` exists, so the new version (and row) come back from
        /// the update itself.
        const RETURNING: bool;
        /// Appended to the follow-up read after an update matched nothing.
        const LOCKING_READ: &'static str;

        /// The SET expression that raises the version.
        fn bump(version_column: &str) -> String;
        fn add_i64(args: &mut Self::Arguments, value: i64) -> Result<(), sqlx::error::BoxDynError>;
        fn get_i64(row: &Self::Row, column: &str) -> Result<i64, sqlx::Error>;
        fn execute<'c>(
            conn: &'c mut Self::Connection,
            sql: String,
            args: Self::Arguments,
        ) -> BoxFuture<'c, Result<Executed, sqlx::Error>>;
        fn fetch_optional<'c>(
            conn: &'c mut Self::Connection,
            sql: String,
            args: Self::Arguments,
        ) -> BoxFuture<'c, Result<Option<Self::Row>, sqlx::Error>>;
        /// Whether the database aborted the statement for concurrency reasons.
        fn conflict_reason(
            error: &(dyn sqlx::error::DatabaseError + 'static),
        ) -> Option<ConflictReason>;
    }
}

/// A database error that means "lost a race", if it is one.
pub(super) fn conflict_reason<DB: VersionedBackend>(error: &sqlx::Error) -> Option<ConflictReason> {
    error
        .as_database_error()
        .and_then(|e| DB::conflict_reason(e))
}

macro_rules! common {
    ($last_insert_id:expr) => {
        fn add_i64(args: &mut Self::Arguments, value: i64) -> Result<(), sqlx::error::BoxDynError> {
            sqlx::Arguments::add(args, value)
        }

        fn get_i64(row: &Self::Row, column: &str) -> Result<i64, sqlx::Error> {
            sqlx::Row::try_get(row, column)
        }

        fn execute<'c>(
            conn: &'c mut Self::Connection,
            sql: String,
            args: Self::Arguments,
        ) -> BoxFuture<'c, Result<sealed::Executed, sqlx::Error>> {
            Box::pin(async move {
                let done = sqlx::query_with(sqlx::AssertSqlSafe(sql), args)
                    .execute(conn)
                    .await?;
                #[allow(clippy::redundant_closure_call)]
                let last_insert_id = ($last_insert_id)(&done);
                Ok(sealed::Executed {
                    rows_affected: done.rows_affected(),
                    last_insert_id,
                })
            })
        }

        fn fetch_optional<'c>(
            conn: &'c mut Self::Connection,
            sql: String,
            args: Self::Arguments,
        ) -> BoxFuture<'c, Result<Option<Self::Row>, sqlx::Error>> {
            Box::pin(sqlx::query_with(sqlx::AssertSqlSafe(sql), args).fetch_optional(conn))
        }
    };
}

#[cfg(feature = "postgres")]
impl sealed::Backend for sqlx::Postgres {
    const RETURNING: bool = true;
    // READ COMMITTED: the read takes a fresh snapshot and sees the winner's commit.
    // REPEATABLE READ / SERIALIZABLE: a concurrent change makes the UPDATE itself fail
    // with 40001, so the read only runs when the snapshot already shows the other version.
    const LOCKING_READ: &'static str = "";

    fn bump(version_column: &str) -> String {
        format!("{version_column} + 1")
    }

    common!(|_: &sqlx::postgres::PgQueryResult| 0);

    fn conflict_reason(
        error: &(dyn sqlx::error::DatabaseError + 'static),
    ) -> Option<ConflictReason> {
        match error.code().as_deref() {
            Some("40001") => Some(ConflictReason::SerializationFailure),
            Some("40P01") => Some(ConflictReason::Deadlock),
            _ => None,
        }
    }
}

#[cfg(feature = "sqlite")]
impl sealed::Backend for sqlx::Sqlite {
    const RETURNING: bool = true;
    // Writers are serialized on the whole database; nothing to lock per row.
    const LOCKING_READ: &'static str = "";

    fn bump(version_column: &str) -> String {
        format!("{version_column} + 1")
    }

    common!(|_: &sqlx::sqlite::SqliteQueryResult| 0);

    fn conflict_reason(
        error: &(dyn sqlx::error::DatabaseError + 'static),
    ) -> Option<ConflictReason> {
        // SQLITE_BUSY (5) and SQLITE_BUSY_SNAPSHOT (517, WAL): another connection holds or
        // already made the write this transaction wanted; its snapshot is stale. SQLite
        // reports the extended code.
        match error.code().as_deref() {
            Some("5") | Some("517") => Some(ConflictReason::Busy),
            _ => None,
        }
    }
}

#[cfg(feature = "mysql")]
impl sealed::Backend for sqlx::MySql {
    // MySQL has no UPDATE .. RETURNING (MariaDB has it for INSERT and DELETE only).
    const RETURNING: bool = false;
    // Under REPEATABLE READ a plain SELECT reads the transaction's old snapshot, which
    // still shows the version the update expected; a locking read sees the latest commit.
    // `LOCK IN SHARE MODE` rather than `FOR SHARE`: MariaDB does not know the latter.
    const LOCKING_READ: &'static str = " LOCK IN SHARE MODE";

    /// `LAST_INSERT_ID(expr)` returns `expr` and makes it this connection's last insert id,
    /// which the OK packet carries back: the new version without a second statement.
    fn bump(version_column: &str) -> String {
        format!("LAST_INSERT_ID({version_column} + 1)")
    }

    common!(|done: &sqlx::mysql::MySqlQueryResult| done.last_insert_id());

    fn conflict_reason(
        error: &(dyn sqlx::error::DatabaseError + 'static),
    ) -> Option<ConflictReason> {
        let error = error.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()?;
        match error.number() {
            1213 => Some(ConflictReason::Deadlock),
            1205 => Some(ConflictReason::LockTimeout),
            // MariaDB 11.6+ with innodb_snapshot_isolation: "Record has changed since last read".
            1020 => Some(ConflictReason::SerializationFailure),
            _ => None,
        }
    }
}
