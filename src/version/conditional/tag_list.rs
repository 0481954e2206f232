use http::{HeaderMap, HeaderName};

use super::ETag;

/// The value of an `If-Match` or `If-None-Match` header: `*` or a list of entity tags
/// (RFC 9110 §13.1.1, §13.1.2), gathered from every line of the header.
///
/// Parsing is strict where leniency would change the meaning of a request:
/// - a tag that is not valid entity-tag syntax is an error, never skipped (skipping one tag
///   of `If-Match` could turn "only if unchanged" into "unconditionally");
/// - `*` must stand alone: `*` together with tags (`*, "7"`, or `*` on one header line and
///   a tag on another) is an error, because the grammar is `"*" / #entity-tag` and the two
///   readings ("any" or "only these") contradict each other;
/// - a header present with no tag at all is an error;
/// - empty list elements (`"1", , "2"`) are ignored as RFC 9110 §5.6.1.2 requires;
/// - at most [`MAX_TAGS`](Self::MAX_TAGS) entity tags over all lines: a longer list is an
///   error, so a huge header cannot turn into thousands of comparisons or SQL parameters.
///
/// ```
/// use http::{header::IF_MATCH, HeaderMap, HeaderValue};
/// use tower_idempotency::version::{ETag, ETagList, Version};
/// let mut headers = HeaderMap::new();
/// headers.append(IF_MATCH, HeaderValue::from_static("\"6\", W/\"7\""));
/// headers.append(IF_MATCH, HeaderValue::from_static("\"8\""));
/// let list = ETagList::from_headers(&headers, &IF_MATCH).unwrap().unwrap();
/// assert!(list.matches_strong(&ETag::from(Version::new(8))));
/// assert!(!list.matches_strong(&ETag::from(Version::new(7)))); // W/"7" is weak
/// assert!(list.matches_weak(&ETag::from(Version::new(7))));
///
/// headers.append(IF_MATCH, HeaderValue::from_static("*"));
/// assert!(ETagList::from_headers(&headers, &IF_MATCH).is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ETagList {
    /// `*`: any current representation.
    Any,
    /// One or more entity tags.
    Tags(Vec<ETag>),
}

/// A malformed `If-Match` / `If-None-Match` header. Renders as a 400 problem+json through
/// [`PreconditionRejection::Malformed`](super::PreconditionRejection::Malformed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed {header} header ({value:?}): {reason}; send either * alone or a comma-separated list of entity tags such as \"7\" (the ETag header of a GET)")]
pub struct InvalidPrecondition {
    /// The header that could not be parsed.
    pub header: HeaderName,
    /// The offending header line (lossily decoded, shortened to 64 bytes).
    pub value: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

impl ETagList {
    /// The most entity tags one `If-Match` / `If-None-Match` may carry (over all its lines).
    /// A client sends the one ETag it read, or a few; 64 leaves ample room for that.
    pub const MAX_TAGS: usize = 64;

    /// Parses every line of header `name`; `Ok(None)` when the header is absent.
    pub fn from_headers(
        headers: &HeaderMap,
        name: &HeaderName,
    ) -> Result<Option<Self>, InvalidPrecondition> {
        let mut present = false;
        let mut stars = 0usize;
        let mut tags = Vec::new();
        for line in headers.get_all(name) {
            present = true;
            let bytes = line.as_bytes();
            let fail = |reason| InvalidPrecondition {
                header: name.clone(),
                value: super::etag::shown(bytes),
                reason,
            };
            parse_line(bytes, &mut stars, &mut tags).map_err(fail)?;
        }
        if !present {
            return Ok(None);
        }
        let fail = |reason| InvalidPrecondition {
            header: name.clone(),
            value: joined(headers, name),
            reason,
        };
        match (stars, tags.is_empty()) {
            (0, true) => Err(fail("the header holds no entity tag")),
            (0, false) => Ok(Some(Self::Tags(tags))),
            (1, true) => Ok(Some(Self::Any)),
            _ => Err(fail(
                "* must be the only value, not combined with entity tags or repeated",
            )),
        }
    }

    /// True when `current` matches by strong comparison (the `If-Match` rule): `*`
    /// matches any tag, a weak tag in the list never matches.
    pub fn matches_strong(&self, current: &ETag) -> bool {
        match self {
            Self::Any => true,
            Self::Tags(tags) => tags.iter().any(|t| t.strong_eq(current)),
        }
    }

    /// True when `current` matches by weak comparison (the `If-None-Match` rule).
    pub fn matches_weak(&self, current: &ETag) -> bool {
        match self {
            Self::Any => true,
            Self::Tags(tags) => tags.iter().any(|t| t.weak_eq(current)),
        }
    }
}

fn parse_line(bytes: &[u8], stars: &mut usize, tags: &mut Vec<ETag>) -> Result<(), &'static str> {
    let is_ows = |b: u8| b == b' ' || b == b'\t';
    let mut i = 0;
    loop {
        while i < bytes.len() && (is_ows(bytes[i]) || bytes[i] == b',') {
            i += 1;
        }
        if i == bytes.len() {
            return Ok(());
        }
        if bytes[i] == b'*' {
            *stars += 1;
            i += 1;
        } else {
            let start = i;
            if bytes[i..].starts_with(b"W/") {
                i += 2;
            }
            if bytes.get(i) != Some(&b'"') {
                return Err("expected a quoted entity tag or *");
            }
            let close = bytes[i + 1..]
                .iter()
                .position(|&b| b == b'"')
                .ok_or("an entity tag is missing its closing quote")?;
            let end = i + 1 + close;
            let tag = ETag::parse(&bytes[start..=end]).map_err(|e| e.reason)?;
            if tags.len() == ETagList::MAX_TAGS {
                return Err("more than 64 entity tags; send only the ETags you read");
            }
            tags.push(tag);
            i = end + 1;
        }
        while i < bytes.len() && is_ows(bytes[i]) {
            i += 1;
        }
        if i < bytes.len() && bytes[i] != b',' {
            return Err("list members must be separated by commas");
        }
    }
}

fn joined(headers: &HeaderMap, name: &HeaderName) -> String {
    let all: Vec<String> = headers
        .get_all(name)
        .iter()
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .collect();
    super::etag::shown(all.join(", ").as_bytes())
}

#[cfg(test)]
mod tests {
    use super::ETagList;

    #[test]
    fn the_limit_in_the_message_is_the_constant() {
        let mut stars = 0;
        let mut tags = Vec::new();
        let line = vec!["\"1\""; ETagList::MAX_TAGS + 1].join(",");
        let reason = super::parse_line(line.as_bytes(), &mut stars, &mut tags).unwrap_err();
        assert!(reason.contains(&ETagList::MAX_TAGS.to_string()), "{reason}");
    }
}
