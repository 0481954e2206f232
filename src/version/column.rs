use std::fmt;

use crate::store::{InvalidTableName, TableName};

/// A validated SQL column name: the same rules as one part of a [`TableName`] (1–63 ASCII
/// letters, digits and `_`, not starting with a digit), without a schema qualifier.
///
/// ```
/// use tower_idempotency::version::ColumnName;
/// assert!(ColumnName::new("status").is_ok());
/// assert!(ColumnName::new("status = 'paid' --").is_err());
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct ColumnName(String);

impl ColumnName {
    /// Validates `name`.
    pub fn new(name: impl Into<String>) -> Result<Self, InvalidTableName> {
        let name = name.into();
        TableName::check_column(&name)?;
        Ok(Self(name))
    }

    /// The name as it appears in SQL (unquoted; it needs no quoting by construction).
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ColumnName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for ColumnName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ColumnName({})", self.0)
    }
}
