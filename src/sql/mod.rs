//! SQL identifiers, and the sqlx plumbing every SQL part of the crate shares (stores, outbox,
//! inbox, transactional mode, versioned tables).

mod column;
mod identifier;
mod own_tables;
mod plumbing;
mod wrong_server;

pub use column::ColumnName;
pub use identifier::{InvalidIdentifier, TableName};
pub(crate) use own_tables::*;
pub(crate) use plumbing::*;
pub(crate) use wrong_server::*;
