//! SQL identifiers, the sqlx plumbing every SQL part of the crate shares (stores, outbox,
//! inbox, transactional mode, versioned tables), and [`migrate_postgres`], with which your own
//! tables are created as safely as the crate's when several processes start at once.

mod column;
mod identifier;
mod own_tables;
mod plumbing;
// SQLite has one writer and no standby: only the client-server databases fail over.
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod wrong_server;

pub use column::ColumnName;
pub use identifier::{InvalidIdentifier, TableName};
pub(crate) use own_tables::*;
#[cfg(feature = "postgres")]
pub use plumbing::migrate_postgres;
pub(crate) use plumbing::*;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) use wrong_server::*;
