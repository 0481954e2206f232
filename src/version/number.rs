use std::fmt;

/// A row's version: a counter that every successful update raises by exactly one.
///
/// New rows start at [`Version::INITIAL`] (1). The version is what becomes the strong
/// [`ETag`](super::ETag) `"<n>"` of the row's representation.
///
/// ```
/// use tower_idempotency::version::Version;
/// let v = Version::INITIAL;
/// assert_eq!(v.get(), 1);
/// assert_eq!(v.next(), Version::new(2));
/// assert_eq!(v.to_string(), "1");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Version(i64);

impl Version {
    /// The version of a freshly created row.
    pub const INITIAL: Version = Version(1);

    /// Wraps a version number as stored in the version column (a 64-bit signed integer,
    /// the `BIGINT` every SQL database has).
    pub const fn new(version: i64) -> Self {
        Self(version)
    }

    /// The number.
    pub const fn get(self) -> i64 {
        self.0
    }

    /// The version an update of this version produces.
    pub const fn next(self) -> Self {
        Self(self.0.wrapping_add(1))
    }
}

impl From<i64> for Version {
    fn from(version: i64) -> Self {
        Self(version)
    }
}

impl From<Version> for i64 {
    fn from(version: Version) -> Self {
        version.0
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}
