//! `Idempotency-Key` header parsing: any header bytes give a key or a typed refusal, and a
//! valid key survives being sent bare or quoted.

use http::{HeaderMap, HeaderName, HeaderValue};
use proptest::prelude::*;

use crate::http::key::{parse_key, InvalidKey, MAX_KEY_LEN};

fn name() -> HeaderName {
    HeaderName::from_static("idempotency-key")
}

/// Parses the header made of `lines` (those `http` accepts as header values).
fn parse(lines: &[Vec<u8>]) -> Option<Result<Option<String>, InvalidKey>> {
    let mut headers = HeaderMap::new();
    for line in lines {
        headers.append(name(), HeaderValue::from_bytes(line).ok()?);
    }
    Some(parse_key(&headers, &name()))
}

/// RFC 8941 quoting of a key: `"` and `\` escaped with `\`.
pub(super) fn quoted(key: &str) -> Vec<u8> {
    let mut out = vec![b'"'];
    for b in key.bytes() {
        if b == b'"' || b == b'\\' {
            out.push(b'\\');
        }
        out.push(b);
    }
    out.push(b'"');
    out
}

proptest! {
    #![proptest_config(super::config())]

    /// Any bytes: a key that obeys the documented rules, or a typed error, never a panic.
    #[test]
    fn any_bytes_give_a_valid_key_or_a_typed_error(
        lines in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..300), 1..3),
    ) {
        let Some(result) = parse(&lines) else { return Ok(()) };
        match result {
            Ok(Some(key)) => {
                prop_assert_eq!(lines.len(), 1);
                prop_assert!(!key.is_empty() && key.len() <= MAX_KEY_LEN);
                prop_assert!(key.bytes().all(|b| (0x21..=0x7e).contains(&b)), "{:?}", key);
            }
            Ok(None) => prop_assert!(false, "a present header read as absent"),
            Err(InvalidKey::Repeated) => prop_assert!(lines.len() > 1),
            Err(_) => prop_assert_eq!(lines.len(), 1),
        }
    }

    /// A valid key reads back as itself quoted, and bare with surrounding spaces unless it
    /// starts with a quote (a leading quote means the quoted form, by design: such a key
    /// must be sent quoted; proptest's first finding, `"`).
    #[test]
    fn a_valid_key_round_trips_bare_and_quoted(key in "[!-~]{1,255}") {
        let quoted = parse(&[quoted(&key)]).expect("a valid header value");
        prop_assert_eq!(quoted, Ok(Some(key.clone())));
        if !key.starts_with('"') {
            let bare = parse(&[key.clone().into_bytes()]).expect("a valid header value");
            prop_assert_eq!(bare, Ok(Some(key.clone())));
            let spaced = parse(&[format!("  {key}\t").into_bytes()]).expect("a valid header value");
            prop_assert_eq!(spaced, Ok(Some(key)));
        }
    }

    /// One character outside visible ASCII anywhere in a key refuses it.
    #[test]
    fn one_bad_character_refuses_the_key(
        key in "[!-~]{2,200}",
        bad in prop_oneof![Just(b' '), 0x80u8..=0xff],
        at in any::<prop::sample::Index>(),
    ) {
        let mut bytes = key.into_bytes();
        let at = 1 + at.index(bytes.len() - 1);
        bytes.insert(at, bad);
        if bytes.first() == Some(&b'"') {
            return Ok(());
        }
        let result = parse(&[bytes]).expect("a valid header value");
        prop_assert_eq!(result, Err(InvalidKey::InvalidCharacter));
    }
}
