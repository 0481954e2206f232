use crate::{sql::InvalidIdentifier, BoxError};

/// Why a versioned SQL operation failed. A lost race is not an error: it is
/// [`VersionedUpdate::Conflict`](crate::version::VersionedUpdate::Conflict).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VersionedTableError {
    /// A table or column name is not a valid identifier.
    #[error("invalid {role} name: {source}")]
    InvalidIdentifier {
        /// Which name: `"table"`, `"id column"`, `"version column"` or `"value column"`.
        role: &'static str,
        /// What is wrong with it.
        #[source]
        source: InvalidIdentifier,
    },

    /// The values tried to set the id or version column, which the statement manages.
    #[error("column {column:?} is the table's {role}; it cannot be set as a value (the version is raised by the update itself, the id selects the row)")]
    ReservedColumn {
        /// The column.
        column: String,
        /// `"id column"` or `"version column"`.
        role: &'static str,
    },

    /// The same column was given two values.
    #[error("column {column:?} is set twice; give each column one value")]
    DuplicateColumn {
        /// The column.
        column: String,
    },

    /// A value could not be encoded for the database.
    #[error("the value for column {column:?} could not be encoded for the database")]
    Bind {
        /// The column.
        column: String,
        /// The encoder's error.
        #[source]
        source: BoxError,
    },

    /// The version column could not be read as a 64-bit integer.
    #[error("the version column {column:?} of {table} could not be read as a 64-bit integer; declare it BIGINT NOT NULL")]
    VersionColumn {
        /// The table.
        table: String,
        /// The version column.
        column: String,
        /// The decoding error.
        #[source]
        source: sqlx::Error,
    },

    /// The database failed (connection, syntax, missing table, constraint other than the
    /// ones this crate reads as outcomes, ...).
    #[error("the {backend} database failed during a versioned {operation}; check the connection and that the table and columns exist")]
    Database {
        /// sqlx's name of the database: `"PostgreSQL"`, `"SQLite"` or `"MySQL"`.
        backend: &'static str,
        /// `"update"`, `"insert"`, `"read"` or `"commit"`.
        operation: &'static str,
        /// sqlx's error.
        #[source]
        source: sqlx::Error,
    },
}
