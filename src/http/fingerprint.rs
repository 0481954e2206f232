//! What makes two requests "the same request" for a key.

use http::{request::Parts, HeaderName};

use crate::record::{FieldHasher, Fingerprint};

/// Hashes method, path, query, the chosen headers (all their values, in order) and the body
/// bytes exactly as sent: JSON that differs only in whitespace is a different request.
pub(crate) fn fingerprint(parts: &Parts, headers: &[HeaderName], body: &[u8]) -> Fingerprint {
    let uri = &parts.uri;
    let mut hasher = FieldHasher::default();
    hasher
        .field(parts.method.as_str().as_bytes())
        .field(uri.path().as_bytes())
        // `None` and `Some("")` are both "no query".
        .field(uri.query().unwrap_or("").as_bytes());
    for name in headers {
        let values = parts.headers.get_all(name);
        // As u64, like the length prefixes: the same bytes on every platform.
        let count = (values.iter().count() as u64).to_be_bytes();
        hasher.field(name.as_str().as_bytes()).field(&count);
        for value in values {
            hasher.field(value.as_bytes());
        }
    }
    hasher.field(body);
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use http::{header, Request};

    use super::*;

    fn fp(method: &str, uri: &str, content_type: Option<&str>, body: &[u8]) -> Fingerprint {
        let mut builder = Request::builder().method(method).uri(uri);
        if let Some(ct) = content_type {
            builder = builder.header(header::CONTENT_TYPE, ct);
        }
        let (parts, ()) = builder.body(()).unwrap().into_parts();
        fingerprint(&parts, &[header::CONTENT_TYPE], body)
    }

    /// The head of a request with a query and a header given twice.
    fn fixed_request() -> Parts {
        Request::post("/pay?a=1")
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::ACCEPT, "a")
            .header(header::ACCEPT, "b")
            .body(())
            .unwrap()
            .into_parts()
            .0
    }

    /// Fingerprints are stored (in databases, across deploys): the fields and their order
    /// are a format, and a request fingerprinted by an earlier build must match.
    #[test]
    fn the_fields_and_their_order_are_fixed() {
        let parts = fixed_request();
        let got = fingerprint(&parts, &[header::CONTENT_TYPE, header::ACCEPT], b"{}");
        let expected = Fingerprint::of([
            b"POST".as_slice(),
            b"/pay",
            b"a=1",
            b"content-type",
            &1u64.to_be_bytes(),
            b"application/json",
            b"accept",
            &2u64.to_be_bytes(),
            b"a",
            b"b",
            b"{}",
        ]);
        assert_eq!(got, expected);
    }

    /// A golden value: the test above compares two computations over the same hasher, so a
    /// change to the hashed bytes (the length prefixes, the header value count, the hash)
    /// passes it. Records keep the fingerprint of their first request: if it changes, every
    /// retry of a request stored before an upgrade is refused as a reused key after it. Never
    /// change this value without a migration note for users.
    #[test]
    fn the_fingerprint_of_a_fixed_request_never_changes() {
        let parts = fixed_request();
        assert_eq!(
            fingerprint(&parts, &[header::CONTENT_TYPE, header::ACCEPT], b"{}").to_hex(),
            "f64502c3111f50f8d037391538dc4b6b4934803a9eb468a2dbfc637331cf42bf"
        );
    }

    #[test]
    fn every_part_of_the_request_counts() {
        let base = fp("POST", "/pay?a=1", Some("application/json"), b"{}");
        assert_eq!(
            base,
            fp("POST", "/pay?a=1", Some("application/json"), b"{}")
        );
        assert_ne!(
            base,
            fp("PATCH", "/pay?a=1", Some("application/json"), b"{}")
        );
        assert_ne!(
            base,
            fp("POST", "/pay2?a=1", Some("application/json"), b"{}")
        );
        assert_ne!(
            base,
            fp("POST", "/pay?a=2", Some("application/json"), b"{}")
        );
        assert_ne!(base, fp("POST", "/pay?a=1", Some("text/plain"), b"{}"));
        assert_ne!(base, fp("POST", "/pay?a=1", None, b"{}"));
        assert_ne!(
            base,
            fp("POST", "/pay?a=1", Some("application/json"), b"{ }")
        );
        assert_eq!(
            fp("POST", "/pay", None, b""),
            fp("POST", "/pay?", None, b"")
        );
    }
}
