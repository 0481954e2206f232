use std::fmt;

use http::HeaderValue;

use super::Version;

/// An entity tag (RFC 9110 §8.8.3): an opaque validator, strong (`"7"`) or weak (`W/"7"`).
///
/// Versions become strong tags: `ETag::from(Version::new(7))` is `"7"`, because a version
/// changes whenever the row's bytes do.
///
/// ```
/// use tower_idempotency::version::{ETag, Version};
/// let tag = ETag::from(Version::new(7));
/// assert_eq!(tag.to_string(), "\"7\"");
/// assert_eq!(tag.version(), Some(Version::new(7)));
/// let weak: ETag = "W/\"7\"".parse().unwrap();
/// assert!(weak.is_weak());
/// assert!(!tag.strong_eq(&weak)); // weak tags never match strongly
/// assert!(tag.weak_eq(&weak));
/// assert!("7".parse::<ETag>().is_err()); // the quotes are part of the syntax
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ETag {
    weak: bool,
    /// The characters between the quotes: `%x21 / %x23-7E / %x80-FF`.
    opaque: Box<[u8]>,
}

/// Text that is not an entity tag; see [`ETag`] for the syntax.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid entity tag {value:?}: {reason}; an entity tag is a quoted string such as \"7\", optionally prefixed by W/ for a weak tag")]
pub struct InvalidETag {
    /// The offending text: its first 64 bytes, lossily decoded (each invalid byte becomes
    /// U+FFFD, so the string may be longer than 64 bytes).
    pub value: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

impl ETag {
    /// A strong tag with `opaque` between the quotes.
    pub fn strong(opaque: impl AsRef<[u8]>) -> Result<Self, InvalidETag> {
        Self::with(false, opaque.as_ref())
    }

    /// A weak tag with `opaque` between the quotes.
    pub fn weak(opaque: impl AsRef<[u8]>) -> Result<Self, InvalidETag> {
        Self::with(true, opaque.as_ref())
    }

    fn with(weak: bool, opaque: &[u8]) -> Result<Self, InvalidETag> {
        check_opaque(opaque).map_err(|reason| invalid(opaque, reason))?;
        Ok(Self {
            weak,
            opaque: opaque.into(),
        })
    }

    /// Parses one entity tag, such as `"7"` or `W/"7"`.
    pub fn parse(text: impl AsRef<[u8]>) -> Result<Self, InvalidETag> {
        let text = text.as_ref();
        let (weak, rest) = match text.strip_prefix(b"W/") {
            Some(rest) => (true, rest),
            None => (false, text),
        };
        let opaque = rest
            .strip_prefix(b"\"")
            .and_then(|r| r.strip_suffix(b"\""))
            .ok_or_else(|| invalid(text, "not enclosed in double quotes"))?;
        check_opaque(opaque).map_err(|reason| invalid(text, reason))?;
        Ok(Self {
            weak,
            opaque: opaque.into(),
        })
    }

    /// True for a weak tag (`W/"…"`).
    pub fn is_weak(&self) -> bool {
        self.weak
    }

    /// The bytes between the quotes.
    pub fn opaque(&self) -> &[u8] {
        &self.opaque
    }

    /// Strong comparison (RFC 9110 §8.8.3.2): both tags strong and their opaque parts equal.
    /// Used by `If-Match`.
    pub fn strong_eq(&self, other: &ETag) -> bool {
        !self.weak && !other.weak && self.opaque == other.opaque
    }

    /// Weak comparison: the opaque parts are equal, weakness ignored. Used by
    /// `If-None-Match`.
    pub fn weak_eq(&self, other: &ETag) -> bool {
        self.opaque == other.opaque
    }

    /// The version a strong tag made by `ETag::from(version)` stands for; `None` for weak
    /// tags and tags this crate did not make (which therefore never match a version).
    pub fn version(&self) -> Option<Version> {
        if self.weak {
            return None;
        }
        self.opaque_version()
    }

    /// The version named by the opaque part, weakness ignored (for weak comparison).
    pub(super) fn opaque_version(&self) -> Option<Version> {
        let text = std::str::from_utf8(&self.opaque).ok()?;
        let number: i64 = text.parse().ok()?;
        // Only the canonical spelling: "07" or "+7" is a different opaque tag than "7".
        (number.to_string() == text).then_some(Version::new(number))
    }

    /// The tag as an `ETag` header value.
    pub fn to_header_value(&self) -> HeaderValue {
        let mut bytes = Vec::with_capacity(self.opaque.len() + 4);
        if self.weak {
            bytes.extend_from_slice(b"W/");
        }
        bytes.push(b'"');
        bytes.extend_from_slice(&self.opaque);
        bytes.push(b'"');
        // Every byte was checked to be etagc, '"' or 'W/', all valid in header values.
        HeaderValue::from_bytes(&bytes).unwrap_or_else(|_| HeaderValue::from_static("\"\""))
    }
}

impl From<Version> for ETag {
    fn from(version: Version) -> Self {
        Self {
            weak: false,
            opaque: version.to_string().into_bytes().into(),
        }
    }
}

impl std::str::FromStr for ETag {
    type Err = InvalidETag;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

/// The tag as text, for logs and messages (the header bytes are
/// [`to_header_value`](ETag::to_header_value)'s). Nothing is lost: the opaque part's UTF-8
/// text is written as it is, every other byte (obs-text, 0x80-0xFF, that is not UTF-8) as
/// `\xNN`, and a backslash as `\\`, so two different tags never display alike, and a tag
/// whose bytes are text without a backslash displays exactly as it is sent.
impl fmt::Display for ETag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.weak {
            f.write_str("W/")?;
        }
        f.write_str("\"")?;
        for chunk in self.opaque.utf8_chunks() {
            for (i, text) in chunk.valid().split('\\').enumerate() {
                if i > 0 {
                    f.write_str("\\\\")?;
                }
                f.write_str(text)?;
            }
            for byte in chunk.invalid() {
                write!(f, "\\x{byte:02x}")?;
            }
        }
        f.write_str("\"")
    }
}

/// `etagc = %x21 / %x23-7E / obs-text`: visible characters except `"`, and bytes 0x80-0xFF.
pub(super) fn is_etagc(b: u8) -> bool {
    b == 0x21 || (0x23..=0x7E).contains(&b) || b >= 0x80
}

fn check_opaque(opaque: &[u8]) -> Result<(), &'static str> {
    if opaque.iter().all(|&b| is_etagc(b)) {
        Ok(())
    } else {
        Err("contains a quote, space or control character between the quotes")
    }
}

fn invalid(text: &[u8], reason: &'static str) -> InvalidETag {
    InvalidETag {
        value: shown(text),
        reason,
    }
}

/// Header bytes for an error message: lossily decoded, at most 64 bytes of input.
pub(super) fn shown(text: &[u8]) -> String {
    String::from_utf8_lossy(&text[..text.len().min(64)]).into_owned()
}
