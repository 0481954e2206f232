//! Reading the idempotency key from a request header, and the rules every key meets.

use http::{HeaderMap, HeaderName};

/// The longest key accepted, in characters.
pub const MAX_KEY_LEN: usize = 255;

/// Why an idempotency key was refused (HTTP 400, gRPC `INVALID_ARGUMENT`): from the
/// `Idempotency-Key` header, or from a request message
/// ([`IdempotencyLayer::key_from_message`](super::IdempotencyLayer::key_from_message)).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidKey {
    /// The header is present but empty.
    #[error("the idempotency key is empty; send 1 to 255 visible ASCII characters, e.g. a UUID")]
    Empty,
    /// Longer than [`MAX_KEY_LEN`].
    #[error("the idempotency key is longer than 255 characters; send a shorter key, e.g. a UUID")]
    TooLong,
    /// A space, control or non-ASCII character.
    #[error("the idempotency key may only contain visible ASCII characters (no spaces, control or non-ASCII characters)")]
    InvalidCharacter,
    /// The header appeared more than once.
    #[error("the idempotency key header was sent more than once; send it exactly once")]
    Repeated,
    /// A quoted (RFC 8941 string) key whose quoting is broken.
    #[error("the idempotency key starts with a quote but is not a valid quoted string")]
    BadQuoting,
}

/// The key in header `name`: `Ok(None)` when absent. Accepts a bare token or an RFC 8941
/// quoted string (`"abc"`, the form the IETF draft specifies), which is unquoted.
pub(crate) fn parse_key(
    headers: &HeaderMap,
    name: &HeaderName,
) -> Result<Option<String>, InvalidKey> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(InvalidKey::Repeated);
    }
    let raw = value.as_bytes().trim_ascii();
    let key = match raw.first() {
        Some(b'"') => unquote(raw)?,
        _ => raw.to_vec(),
    };
    validate(key).map(Some)
}

/// A key, from a header (unquoted) or from a request message: the rules every key meets
/// wherever it came from, 1 to [`MAX_KEY_LEN`] visible ASCII characters.
pub(crate) fn validate(key: Vec<u8>) -> Result<String, InvalidKey> {
    if key.is_empty() {
        return Err(InvalidKey::Empty);
    }
    if key.len() > MAX_KEY_LEN {
        return Err(InvalidKey::TooLong);
    }
    if !key.iter().all(|b| (0x21..=0x7e).contains(b)) {
        return Err(InvalidKey::InvalidCharacter);
    }
    // Only visible ASCII remains, so this cannot fail.
    String::from_utf8(key).map_err(|_| InvalidKey::InvalidCharacter)
}

/// RFC 8941 §3.3.3: `"` … `"` with `\"` and `\\` as the only escapes.
fn unquote(raw: &[u8]) -> Result<Vec<u8>, InvalidKey> {
    let inner = raw
        .strip_prefix(b"\"")
        .and_then(|rest| rest.strip_suffix(b"\""))
        .ok_or(InvalidKey::BadQuoting)?;
    let mut out = Vec::with_capacity(inner.len());
    let mut bytes = inner.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&escaped @ (b'"' | b'\\')) => out.push(escaped),
                _ => return Err(InvalidKey::BadQuoting),
            },
            b'"' => return Err(InvalidKey::BadQuoting),
            _ => out.push(b),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    fn parse(values: &[&[u8]]) -> Result<Option<String>, InvalidKey> {
        let mut headers = HeaderMap::new();
        for v in values {
            headers.append("idempotency-key", HeaderValue::from_bytes(v).unwrap());
        }
        parse_key(&headers, &HeaderName::from_static("idempotency-key"))
    }

    #[test]
    fn accepts_bare_and_quoted_keys() {
        assert_eq!(parse(&[]), Ok(None));
        assert_eq!(parse(&[b"abc-123"]), Ok(Some("abc-123".into())));
        assert_eq!(parse(&[b"\"abc-123\""]), Ok(Some("abc-123".into())));
        assert_eq!(parse(&[br#""a\"b\\c""#]), Ok(Some(r#"a"b\c"#.into())));
        assert_eq!(parse(&[&[b'k'; 255]]), Ok(Some("k".repeat(255))));
    }

    #[test]
    fn refuses_malformed_keys() {
        assert_eq!(parse(&[b""]), Err(InvalidKey::Empty));
        assert_eq!(parse(&[b"\"\""]), Err(InvalidKey::Empty));
        assert_eq!(parse(&[&[b'k'; 256]]), Err(InvalidKey::TooLong));
        assert_eq!(parse(&[b"a b"]), Err(InvalidKey::InvalidCharacter));
        assert_eq!(parse(&[b"a\tb"]), Err(InvalidKey::InvalidCharacter));
        assert_eq!(
            parse(&["caf\u{e9}".as_bytes()]),
            Err(InvalidKey::InvalidCharacter)
        );
        assert_eq!(parse(&[b"a", b"b"]), Err(InvalidKey::Repeated));
        assert_eq!(parse(&[b"\"abc"]), Err(InvalidKey::BadQuoting));
        assert_eq!(parse(&[br#""a\nb""#]), Err(InvalidKey::BadQuoting));
    }
}
