use super::Version;

/// What `VersionedTable::update_if_version` (or
/// [`MemoryVersioned::update_if_version`](super::MemoryVersioned::update_if_version)) did.
///
/// `R` is the row type when the caller asked for rows back, `()` otherwise.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use = "a lost race is reported here, not as an error"]
pub enum VersionedUpdate<R = ()> {
    /// The row was at an accepted version and now holds the new values at `version`.
    Updated {
        /// The row's new version (the old one plus one): its new ETag.
        version: Version,
        /// The row as written, when rows were asked for and the database could return it
        /// atomically (PostgreSQL and SQLite `RETURNING`; on MySQL a read in the same
        /// connection that is dropped to `None` if another writer got in between).
        row: Option<R>,
    },
    /// The row exists but another writer changed it first, or the database aborted the
    /// statement to keep transactions serializable. Re-read and try again
    /// ([`retry_on_conflict`](super::retry_on_conflict)), or answer 412 with the current ETag.
    Conflict {
        /// The row's current version, read after the update matched nothing. `None` when the
        /// database aborted the transaction ([`ConflictReason::is_abort`]): it cannot be read
        /// in that transaction; roll back and read again.
        current_version: Option<Version>,
        /// The current row, when rows were asked for and it could be read.
        row: Option<R>,
        /// Why this is a conflict.
        reason: ConflictReason,
    },
    /// No row has this id (never created, or deleted).
    NotFound,
}

impl<R> VersionedUpdate<R> {
    /// True for [`VersionedUpdate::Updated`].
    pub fn is_updated(&self) -> bool {
        matches!(self, Self::Updated { .. })
    }

    /// True for [`VersionedUpdate::Conflict`].
    pub fn is_conflict(&self) -> bool {
        matches!(self, Self::Conflict { .. })
    }

    /// The new version after an update, the current version after a version conflict.
    pub fn version(&self) -> Option<Version> {
        match self {
            Self::Updated { version, .. } => Some(*version),
            Self::Conflict {
                current_version, ..
            } => *current_version,
            Self::NotFound => None,
        }
    }

    /// Keeps the outcome but drops its row.
    pub fn without_row(self) -> VersionedUpdate<()> {
        match self {
            Self::Updated { version, row } => VersionedUpdate::Updated {
                version,
                row: row.map(drop),
            },
            Self::Conflict {
                current_version,
                row,
                reason,
            } => VersionedUpdate::Conflict {
                current_version,
                row: row.map(drop),
                reason,
            },
            Self::NotFound => VersionedUpdate::NotFound,
        }
    }
}

/// Why an update is a [`VersionedUpdate::Conflict`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConflictReason {
    /// The row is at a version the update did not accept.
    VersionMismatch,
    /// PostgreSQL SQLSTATE 40001 (`serialization_failure`, e.g. a concurrent update under
    /// REPEATABLE READ / SERIALIZABLE), or MariaDB's snapshot-isolation error 1020.
    SerializationFailure,
    /// PostgreSQL 40P01 or MySQL 1213: the database broke a deadlock by aborting this
    /// transaction.
    Deadlock,
    /// MySQL 1205: waiting for another transaction's row lock timed out.
    LockTimeout,
    /// SQLite `SQLITE_BUSY` / `SQLITE_BUSY_SNAPSHOT`: another connection wrote the database
    /// first, so this transaction's read snapshot cannot be turned into a write.
    Busy,
}

impl ConflictReason {
    /// True when the database aborted the statement (or the whole transaction) rather than
    /// the row being at another version: the transaction must be rolled back and the work
    /// redone from a fresh read.
    pub fn is_abort(self) -> bool {
        !matches!(self, Self::VersionMismatch)
    }
}

/// What a create-only insert did (the `If-None-Match: *` case).
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use = "\"already exists\" is reported here, not as an error"]
pub enum InsertOutcome {
    /// The row was inserted at [`Version::INITIAL`].
    Created {
        /// The new row's version.
        version: Version,
    },
    /// A unique constraint refused the row: a row with this id (or another unique value
    /// of it) exists. On PostgreSQL this aborts the surrounding transaction; run the insert
    /// in a savepoint (`tx.begin()`) if the transaction must go on.
    AlreadyExists {
        /// The violated constraint's name, when the database reports it (PostgreSQL does).
        constraint: Option<String>,
    },
}
