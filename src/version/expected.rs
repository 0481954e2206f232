use super::Version;

/// Which current versions an update accepts: the compare half of compare-and-set.
///
/// Usually one exact version (`Expected::from(version)`, the `If-Match: "7"` case). HTTP
/// preconditions can also ask for "any existing version" (`If-Match: *`), one of several
/// (`If-Match: "6", "7"`), or exclude versions (`If-None-Match`); [`Preconditions::expected`]
/// builds this from the request headers.
///
/// Whatever is expected, the row must exist: an update never creates a row.
///
/// ```
/// use tower_idempotency::version::{Expected, Version};
/// let exact = Expected::from(Version::new(7));
/// assert!(exact.accepts(Version::new(7)));
/// assert!(!exact.accepts(Version::new(8)));
/// assert!(Expected::any().accepts(Version::new(8)));
/// assert!(!Expected::one_of([]).accepts(Version::new(1)));
/// ```
///
/// [`Preconditions::expected`]: super::Preconditions::expected
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expected {
    /// `None`: any version; `Some(list)`: only these (an empty list accepts nothing).
    one_of: Option<Vec<Version>>,
    /// Versions that are refused even if `one_of` accepts them.
    none_of: Vec<Version>,
    /// Refuses every existing row (`If-None-Match: *` on an update).
    nothing: bool,
}

impl Expected {
    /// Accepts the row at whatever version it is (an unconditional update that still raises
    /// the version).
    pub fn any() -> Self {
        Self {
            one_of: None,
            none_of: Vec::new(),
            nothing: false,
        }
    }

    /// Accepts exactly `version`.
    pub fn exactly(version: Version) -> Self {
        Self::one_of([version])
    }

    /// Accepts any of `versions`; an empty list accepts nothing (every existing row is a
    /// conflict).
    pub fn one_of(versions: impl IntoIterator<Item = Version>) -> Self {
        let mut list: Vec<Version> = versions.into_iter().collect();
        list.sort_unstable();
        list.dedup();
        Self {
            one_of: Some(list),
            none_of: Vec::new(),
            nothing: false,
        }
    }

    /// Additionally refuses `versions` (the `If-None-Match: "7"` case).
    pub fn excluding(mut self, versions: impl IntoIterator<Item = Version>) -> Self {
        self.none_of.extend(versions);
        self.none_of.sort_unstable();
        self.none_of.dedup();
        self
    }

    /// Refuses every existing row (the `If-None-Match: *` case): the update can only end in
    /// a conflict or "not found".
    pub fn nothing() -> Self {
        Self {
            one_of: None,
            none_of: Vec::new(),
            nothing: true,
        }
    }

    /// Whether a row currently at `version` may be updated.
    pub fn accepts(&self, version: Version) -> bool {
        !self.nothing
            && self
                .one_of
                .as_ref()
                .is_none_or(|list| list.contains(&version))
            && !self.none_of.contains(&version)
    }

    /// True when no version at all is accepted, so no statement needs to run.
    pub fn accepts_none(&self) -> bool {
        self.nothing || self.one_of.as_ref().is_some_and(Vec::is_empty)
    }

    /// The accepted versions, `None` meaning any.
    pub fn allowed(&self) -> Option<&[Version]> {
        self.one_of.as_deref()
    }

    /// The refused versions.
    pub fn refused(&self) -> &[Version] {
        &self.none_of
    }
}

impl From<Version> for Expected {
    fn from(version: Version) -> Self {
        Self::exactly(version)
    }
}
