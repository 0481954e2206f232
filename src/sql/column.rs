use std::{
    fmt,
    hash::{Hash, Hasher},
};

use super::{
    identifier::{check_part, invalid},
    InvalidIdentifier,
};

/// A validated SQL column name: the same rules as one part of a [`TableName`](super::TableName) (1–63 ASCII
/// letters, digits and `_`, not starting with a digit), without a schema qualifier.
///
/// ```
/// use tower_idempotency::sql::ColumnName;
/// assert!(ColumnName::new("status").is_ok());
/// assert!(ColumnName::new("status = 'paid' --").is_err());
///
/// // Unquoted identifiers are case-insensitive in PostgreSQL, MySQL and SQLite alike.
/// assert_eq!(ColumnName::new("Version").unwrap(), ColumnName::new("version").unwrap());
/// ```
///
/// Equality and hashing ignore ASCII case, because the name goes into SQL unquoted, where
/// `Version` and `version` are the same column on every dialect.
#[derive(Clone)]
pub struct ColumnName(String);

impl ColumnName {
    /// Validates `name`.
    pub fn new(name: impl Into<String>) -> Result<Self, InvalidIdentifier> {
        let name = name.into();
        match check_part(&name) {
            Ok(()) => Ok(Self(name)),
            Err(reason) => Err(invalid(name, reason)),
        }
    }

    /// The name as it appears in SQL (unquoted; it needs no quoting by construction).
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl PartialEq for ColumnName {
    fn eq(&self, other: &Self) -> bool {
        self.0.eq_ignore_ascii_case(&other.0)
    }
}

impl Eq for ColumnName {}

impl Hash for ColumnName {
    fn hash<H: Hasher>(&self, state: &mut H) {
        for byte in self.0.bytes() {
            state.write_u8(byte.to_ascii_lowercase());
        }
        // Terminates the name, as `str` hashing does, so that adjacent names stay apart.
        state.write_u8(0xff);
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
