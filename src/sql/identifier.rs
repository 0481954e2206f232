use std::fmt;

/// A validated SQL table name: 1–63 characters, ASCII letters, digits and `_`, not starting
/// with a digit, optionally qualified once by a schema (`schema.table`) of the same form.
///
/// SQL cannot bind identifiers as parameters, so every identifier that reaches a statement
/// goes through this type: user input is never pasted into SQL.
///
/// ```
/// use tower_idempotency::sql::TableName;
/// assert!(TableName::new("idempotency_records").is_ok());
/// assert!(TableName::new("app.idempotency").is_ok());
/// assert!(TableName::new("records; DROP TABLE users").is_err());
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct TableName(String);

/// An SQL identifier that [`TableName::new`] or [`ColumnName::new`](super::ColumnName::new)
/// refused, with the reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid SQL identifier {name:?}: {reason}; use 1-63 ASCII letters, digits or '_', not starting with a digit, optionally 'schema.table'")]
pub struct InvalidIdentifier {
    /// The name as given.
    pub name: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

impl TableName {
    /// Validates `name`.
    pub fn new(name: impl Into<String>) -> Result<Self, InvalidIdentifier> {
        let name = name.into();
        let mut parts = name.split('.');
        let first = parts.next().unwrap_or_default();
        let second = parts.next();
        if parts.next().is_some() {
            return Err(invalid(name, "more than one '.'"));
        }
        for part in std::iter::once(first).chain(second) {
            if let Err(reason) = check_part(part) {
                return Err(invalid(name, reason));
            }
        }
        Ok(Self(name))
    }

    /// The name as it appears in SQL (unquoted; it needs no quoting by construction).
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// A derived identifier such as an index name: `<table>_<suffix>` with any schema
    /// qualifier dropped (index names live in the table's schema).
    ///
    /// Databases cut identifiers at 63/64 characters, which would make two long table names
    /// share an index name; past that length the table part is shortened and a hash of the
    /// full name keeps it unique.
    pub fn derived(&self, suffix: &str) -> String {
        let bare = self.0.rsplit('.').next().unwrap_or(&self.0);
        let name = format!("{bare}_{suffix}");
        if name.len() <= 63 {
            return name;
        }
        let hash = crate::record::Fingerprint::of([self.0.as_bytes()]).to_hex();
        let keep = 63usize.saturating_sub(suffix.len() + 10);
        format!("{}_{}_{suffix}", &bare[..keep.min(bare.len())], &hash[..8])
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TableName({})", self.0)
    }
}

/// Checks one identifier part (no `.`): the rule every identifier this crate writes into SQL
/// obeys, tables and columns alike.
pub(super) fn check_part(part: &str) -> Result<(), &'static str> {
    if part.is_empty() {
        return Err("empty name");
    }
    if part.len() > 63 {
        return Err("longer than 63 characters");
    }
    if part.as_bytes()[0].is_ascii_digit() {
        return Err("starts with a digit");
    }
    if !part.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
        return Err("contains a character other than ASCII letters, digits and '_'");
    }
    Ok(())
}

pub(super) fn invalid(name: String, reason: &'static str) -> InvalidIdentifier {
    InvalidIdentifier { name, reason }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_what_could_escape_an_identifier() {
        for bad in [
            "",
            "1abc",
            "a b",
            "a\"b",
            "a.b.c",
            "a.",
            ".a",
            "ümlaut",
            &"x".repeat(64),
        ] {
            assert!(TableName::new(bad).is_err(), "{bad:?} was accepted");
        }
        assert_eq!(
            TableName::new("s.t").unwrap().derived("expires_idx"),
            "t_expires_idx"
        );
        let a = TableName::new(format!("{}a", "x".repeat(62)))
            .unwrap()
            .derived("expires_at_idx");
        let b = TableName::new(format!("{}b", "x".repeat(62)))
            .unwrap()
            .derived("expires_at_idx");
        assert!(a.len() <= 63 && b.len() <= 63, "{a} {b}");
        assert_ne!(a, b, "long names must not share an index name");
    }
}
