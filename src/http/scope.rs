//! Which caller a key belongs to.

use std::sync::Arc;

use http::{header, request::Parts};
use sha2::{Digest, Sha256};

use crate::record::hex;

/// Derives the scope (namespace) of a request's key from its head.
pub(crate) type ScopeFn = Arc<dyn Fn(&Parts) -> String + Send + Sync>;

/// The default scope: a hash of the `Authorization` header, so the same key from two callers
/// is two records, and credentials are never stored. Requests without the header share the
/// anonymous scope `""`.
pub(crate) fn by_authorization(parts: &Parts) -> String {
    match parts.headers.get(header::AUTHORIZATION) {
        None => String::new(),
        Some(value) => {
            // Runs on every protected request: hex by table, not one `format!` per byte.
            let digest = Sha256::digest(value.as_bytes());
            format!("auth:{}", hex(&digest[..16]))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(auth: Option<&str>) -> Parts {
        let mut builder = http::Request::builder();
        if let Some(auth) = auth {
            builder = builder.header(header::AUTHORIZATION, auth);
        }
        builder.body(()).unwrap().into_parts().0
    }

    #[test]
    fn callers_get_distinct_scopes_without_the_raw_credential() {
        let alice = by_authorization(&parts(Some("Bearer alice")));
        let bob = by_authorization(&parts(Some("Bearer bob")));
        assert_ne!(alice, bob);
        assert!(!alice.contains("alice"));
        assert_eq!(alice, by_authorization(&parts(Some("Bearer alice"))));
        assert_eq!(by_authorization(&parts(None)), "");
    }
}
