//! Which caller a key belongs to.

use std::sync::Arc;

use http::{header, request::Parts};
use sha2::{Digest, Sha256};

use crate::record::push_hex;

/// Derives the scope (namespace) of a request's key from its head; `None` when the request
/// names no caller.
pub(crate) type ScopeFn = Arc<dyn Fn(&Parts) -> Option<String> + Send + Sync>;

/// The scope shared by requests without identity, when the layer opts into it.
pub(crate) const ANONYMOUS: &str = "";

/// The default scope: a hash of the `Authorization` header, so the same key from two callers
/// is two records, and credentials are never stored. `None` without the header: the layer
/// then refuses the request rather than file it with every other anonymous caller's.
pub(crate) fn by_authorization(parts: &Parts) -> Option<String> {
    let value = parts.headers.get(header::AUTHORIZATION)?;
    // An empty credential names nobody: every client sending one would share its scope.
    if value.as_bytes().iter().all(u8::is_ascii_whitespace) {
        return None;
    }
    // Runs on every protected request: one allocation, hex by table.
    const PREFIX: &str = "auth:";
    let digest = Sha256::digest(value.as_bytes());
    let mut scope = String::with_capacity(PREFIX.len() + 32);
    scope.push_str(PREFIX);
    push_hex(&mut scope, &digest[..16]);
    Some(scope)
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
        let alice = by_authorization(&parts(Some("Bearer alice"))).unwrap();
        let bob = by_authorization(&parts(Some("Bearer bob"))).unwrap();
        assert_ne!(alice, bob);
        assert!(!alice.contains("alice"));
        assert_eq!(Some(alice), by_authorization(&parts(Some("Bearer alice"))));
        assert_eq!(by_authorization(&parts(None)), None);
        assert_eq!(by_authorization(&parts(Some(""))), None);
        assert_eq!(by_authorization(&parts(Some("  "))), None);
    }
}
