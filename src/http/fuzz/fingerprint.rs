//! The request fingerprint: equal requests hash equal; changing any byte of the method, the
//! path, a fingerprinted header or the body, or moving bytes from one field to the next,
//! changes it.

use http::{header, request::Parts, HeaderName, HeaderValue, Method, Request};
use proptest::prelude::*;

use crate::{http::fingerprint::fingerprint, record::Fingerprint};

/// The request's fields as generated: method, path (after `/`), content-type, body.
type Fields = (String, String, Vec<u8>, Vec<u8>);

fn fields() -> impl Strategy<Value = Fields> {
    (
        "[A-Z]{1,10}",
        "[a-z0-9]{0,30}",
        prop::collection::vec(0x21u8..0x7f, 0..30),
        prop::collection::vec(any::<u8>(), 0..200),
    )
}

fn parts((method, path, content_type, _): &Fields) -> Parts {
    let mut parts = Request::builder()
        .method(Method::from_bytes(method.as_bytes()).expect("a token"))
        .uri(format!("/{path}"))
        .body(())
        .expect("a valid request")
        .into_parts()
        .0;
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_bytes(content_type).expect("visible ASCII"),
    );
    parts
}

fn of(fields: &Fields) -> Fingerprint {
    fingerprint(&parts(fields), &[header::CONTENT_TYPE], &fields.3)
}

/// A byte other than `byte`: `one`, or `other` when `byte` is `one` (both valid in the field).
fn changed(byte: u8, one: u8, other: u8) -> u8 {
    if byte == one {
        other
    } else {
        one
    }
}

proptest! {
    #![proptest_config(super::config())]

    #[test]
    fn equal_requests_have_equal_fingerprints(f in fields()) {
        prop_assert_eq!(of(&f), of(&f.clone()));
        // Headers outside the fingerprinted list do not count.
        let mut other = parts(&f);
        other.headers.insert(HeaderName::from_static("x-trace"), HeaderValue::from_static("1"));
        prop_assert_eq!(fingerprint(&other, &[header::CONTENT_TYPE], &f.3), of(&f));
    }

    #[test]
    fn any_changed_byte_changes_the_fingerprint(
        f in fields(),
        field in 0usize..4,
        at in any::<prop::sample::Index>(),
    ) {
        let mut g = f.clone();
        match field {
            0 => {
                let mut bytes = g.0.into_bytes();
                let i = at.index(bytes.len());
                bytes[i] = changed(bytes[i], b'A', b'B');
                g.0 = String::from_utf8(bytes).expect("ASCII");
            }
            1 if !g.1.is_empty() => {
                let mut bytes = g.1.into_bytes();
                let i = at.index(bytes.len());
                bytes[i] = changed(bytes[i], b'a', b'b');
                g.1 = String::from_utf8(bytes).expect("ASCII");
            }
            1 => g.1.push('a'),
            2 if !g.2.is_empty() => {
                let i = at.index(g.2.len());
                g.2[i] = changed(g.2[i], b'!', b'#');
            }
            2 => g.2.push(b'a'),
            _ if !g.3.is_empty() => {
                let i = at.index(g.3.len());
                g.3[i] ^= 1;
            }
            _ => g.3.push(0),
        }
        prop_assert_ne!(&f, &g);
        prop_assert_ne!(of(&f), of(&g));
    }

    /// Length prefixes: the last byte of the content-type moved to the body's front is a
    /// different request, though the concatenation of the fields is the same.
    #[test]
    fn moving_bytes_between_fields_changes_the_fingerprint(f in fields()) {
        let mut g = f.clone();
        let Some(last) = g.2.pop() else { return Ok(()) };
        g.3.insert(0, last);
        prop_assert_ne!(of(&f), of(&g));
    }
}
