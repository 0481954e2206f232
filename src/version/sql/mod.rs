//! The SQL half of optimistic concurrency: the versioned table and its dialects.

mod backend;
mod error;
mod set;
mod table;

use super::{ConflictReason, Expected, InsertOutcome, Version, VersionedUpdate};
use crate::sql::ColumnName;

pub use backend::VersionedBackend;
pub use error::VersionedTableError;
pub use set::SetValues;
pub use table::{commit_if_updated, VersionedTable};
