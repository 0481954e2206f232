//! What makes two requests "the same request" for a key.

use http::{request::Parts, HeaderName};

use crate::record::Fingerprint;

/// Hashes method, path, query, the chosen headers (all their values, in order) and the body
/// bytes exactly as sent: JSON that differs only in whitespace is a different request.
pub(crate) fn fingerprint(parts: &Parts, headers: &[HeaderName], body: &[u8]) -> Fingerprint {
    let uri = &parts.uri;
    let mut fields: Vec<&[u8]> = vec![
        parts.method.as_str().as_bytes(),
        uri.path().as_bytes(),
        // `None` and `Some("")` are both "no query".
        uri.query().unwrap_or("").as_bytes(),
    ];
    let mut counts = Vec::with_capacity(headers.len());
    for name in headers {
        counts.push(parts.headers.get_all(name).iter().count().to_be_bytes());
    }
    for (name, count) in headers.iter().zip(&counts) {
        fields.push(name.as_str().as_bytes());
        fields.push(count);
        fields.extend(parts.headers.get_all(name).iter().map(|v| v.as_bytes()));
    }
    fields.push(body);
    Fingerprint::of(fields)
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
