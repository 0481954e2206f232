//! The stored record decoder: whatever a corrupt or hostile store hands back gives a typed
//! error or a response, never a panic; and every response this crate encodes decodes to
//! itself.

use bytes::{BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use proptest::prelude::*;

use crate::http::replay::{decode, encode_not_stored, encode_with_trailers, StoredResponse};

/// Header names and values that are kept on replay (no hop-by-hop names, no `Date`).
fn header_map() -> impl Strategy<Value = HeaderMap> {
    let pair = (
        "x-[a-z0-9-]{0,20}",
        prop::collection::vec(0x20u8..0x7f, 0..40),
    );
    prop::collection::vec(pair, 0..6).prop_map(|pairs| {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            let value = HeaderValue::from_bytes(value.trim_ascii()).expect("visible ASCII");
            headers.append(HeaderName::try_from(name).expect("a token"), value);
        }
        headers
    })
}

/// A response as the layer stores it: status, headers, maybe trailers, body.
fn response() -> impl Strategy<Value = (StatusCode, HeaderMap, Option<HeaderMap>, Vec<u8>)> {
    (
        (100u16..1000).prop_map(|s| StatusCode::from_u16(s).expect("100-999")),
        header_map(),
        prop::option::of(header_map()),
        prop::collection::vec(any::<u8>(), 0..200),
    )
}

fn encoded(response: &(StatusCode, HeaderMap, Option<HeaderMap>, Vec<u8>)) -> Bytes {
    let (status, headers, trailers, body) = response;
    encode_with_trailers(*status, headers, trailers.as_ref(), body, true)
}

/// The head of a record (magic, kind, status 200) followed by `rest`.
pub(super) fn with_head(kind: u8, rest: &[u8]) -> Bytes {
    let mut out = BytesMut::new();
    out.put_slice(b"TIR\x01");
    out.put_u8(kind);
    out.put_u16(200);
    out.put_slice(rest);
    out.freeze()
}

proptest! {
    #![proptest_config(super::config())]

    /// Any bytes at all.
    #[test]
    fn any_bytes_decode_or_give_a_typed_error(bytes in prop::collection::vec(any::<u8>(), 0..400)) {
        let _ = decode(Bytes::from(bytes));
    }

    /// Any bytes after a valid head, so the length fields and pairs are what is exercised.
    #[test]
    fn any_body_after_a_valid_head(kind in 0u8..4, rest in prop::collection::vec(any::<u8>(), 0..400)) {
        let _ = decode(with_head(kind, &rest));
    }

    /// What the layer encodes decodes to the same status, headers (in order), trailers and
    /// body.
    #[test]
    fn an_encoded_response_round_trips(response in response()) {
        let (status, headers, trailers, body) = &response;
        let decoded = decode(encoded(&response));
        let Ok(StoredResponse::Response { status: s, headers: h, body: b, trailers: t }) = decoded else {
            return Err(TestCaseError::fail(format!("{decoded:?}")));
        };
        prop_assert_eq!(s, *status);
        let pairs = |m: &HeaderMap| m.iter().map(|(n, v)| (n.clone(), v.clone())).collect::<Vec<_>>();
        prop_assert_eq!(pairs(&h), pairs(headers));
        prop_assert_eq!(b.as_ref(), body.as_slice());
        let expected = trailers.clone().filter(|t| !t.is_empty());
        prop_assert_eq!(t.map(|t| *t), expected);
    }

    /// Every truncation of a valid record decodes (a shorter body) or is a typed error.
    #[test]
    fn truncations_are_errors_or_shorter_bodies(response in response(), cut in any::<prop::sample::Index>()) {
        let full = encoded(&response);
        let cut = cut.index(full.len());
        if let Ok(StoredResponse::Response { body, .. }) = decode(full.slice(..cut)) {
            prop_assert!(body.len() <= response.3.len());
        }
    }

    /// Flipping any bit of a valid record (including the length fields) never panics.
    #[test]
    fn bit_flips_never_panic(response in response(), at in any::<prop::sample::Index>(), bit in 0u8..8) {
        let mut bytes = encoded(&response).to_vec();
        let at = at.index(bytes.len());
        bytes[at] ^= 1 << bit;
        let _ = decode(Bytes::from(bytes));
    }

    /// The marker of a response too large to store keeps its status.
    #[test]
    fn not_stored_round_trips(status in 100u16..1000) {
        let status = StatusCode::from_u16(status).expect("100-999");
        let decoded = decode(encode_not_stored(status));
        prop_assert!(matches!(decoded, Ok(StoredResponse::NotStored { status: s }) if s == status), "{:?}", decoded);
    }
}
