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

/// The caller your authentication layer verified, put into the request's extensions for
/// this layer to scope keys by. With it, the default scope is the caller, not its
/// credential: a client whose access token was refreshed between an attempt and its retry
/// (what OAuth SDKs do by themselves) stays in its scope, and its retry is replayed instead
/// of charged twice.
///
/// Insert it only after checking the credentials, and put the authentication layer
/// *outside* this one (it must run first, or the layer never sees the principal and falls
/// back to the `Authorization` hash). Never derive it from unverified token contents (the
/// `sub` of a JWT whose signature nobody checked): whoever can forge the principal reads the
/// stored responses of its owner.
///
/// ```
/// use axum::{extract::Request, middleware::{self, Next}, response::Response, routing::post, Router};
/// use http::StatusCode;
/// use tower_idempotency::{store::MemoryStore, IdempotencyLayer, Principal};
///
/// /// Checks the bearer token (here against a fixed table; a real service verifies a
/// /// signature or asks its identity provider) and names the caller.
/// async fn authenticate(mut request: Request, next: Next) -> Result<Response, StatusCode> {
///     let token = request.headers().get("authorization").and_then(|v| v.to_str().ok());
///     let user = match token {
///         Some("Bearer token-of-alice") | Some("Bearer refreshed-token-of-alice") => "alice",
///         _ => return Err(StatusCode::UNAUTHORIZED),
///     };
///     request.extensions_mut().insert(Principal::new(user));
///     Ok(next.run(request).await)
/// }
///
/// let app: Router = Router::new()
///     .route("/payments", post(|| async { "charged" }))
///     .layer(IdempotencyLayer::new(MemoryStore::new()))
///     // Added last, so it runs first: the idempotency layer sees the principal.
///     .layer(middleware::from_fn(authenticate));
/// # let _ = app;
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Principal(String);

impl Principal {
    /// The verified caller `id` (a user id, a client id, a tenant and user pair): what stays
    /// the same for one caller across credentials. An empty id names nobody and counts as
    /// absent.
    pub fn new(id: impl Into<String>) -> Self {
        Self(id.into())
    }

    /// The caller's id.
    pub fn id(&self) -> &str {
        &self.0
    }
}

/// The default scope: the caller's [`Principal`] when an authentication layer put one in the
/// request's extensions, else a hash of the `Authorization` header. Either way the same key
/// from two callers is two records, and neither the caller's id nor its credential is stored
/// (both are hashed, under different prefixes). `None` with neither: the layer then refuses
/// the request rather than file it with every other anonymous caller's.
pub(crate) fn by_caller(parts: &Parts) -> Option<String> {
    // With no extension at all (the common case without an authentication layer) this is
    // one check of an empty map.
    match parts.extensions.get::<Principal>() {
        Some(principal) if !principal.0.is_empty() => {
            Some(hashed("principal:", principal.0.as_bytes()))
        }
        _ => by_authorization(parts),
    }
}

/// A hash of the `Authorization` header: a new credential of the same caller (a refreshed
/// token) is a new scope.
fn by_authorization(parts: &Parts) -> Option<String> {
    let value = parts.headers.get(header::AUTHORIZATION)?;
    // An empty credential names nobody: every client sending one would share its scope.
    if value.as_bytes().iter().all(u8::is_ascii_whitespace) {
        return None;
    }
    Some(hashed("auth:", value.as_bytes()))
}

/// `prefix` and the first 16 bytes of `identity`'s SHA-256 in hex. Runs on every protected
/// request: one allocation, hex by table.
fn hashed(prefix: &str, identity: &[u8]) -> String {
    let digest = Sha256::digest(identity);
    let mut scope = String::with_capacity(prefix.len() + 32);
    scope.push_str(prefix);
    push_hex(&mut scope, &digest[..16]);
    scope
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

    fn with_principal(auth: Option<&str>, id: &str) -> Parts {
        let mut parts = parts(auth);
        parts.extensions.insert(Principal::new(id));
        parts
    }

    #[test]
    fn a_principal_wins_over_the_credential_and_is_not_stored_raw() {
        let alice = by_caller(&with_principal(Some("Bearer t1"), "alice")).unwrap();
        assert_eq!(
            Some(&alice),
            by_caller(&with_principal(Some("Bearer t2"), "alice")).as_ref()
        );
        assert_ne!(
            Some(&alice),
            by_caller(&with_principal(Some("Bearer t1"), "bob")).as_ref()
        );
        assert!(!alice.contains("alice"));
        // Never the scope of a credential that happens to equal the id.
        assert_ne!(Some(alice), by_caller(&parts(Some("alice"))));
        // An empty principal names nobody: the credential decides.
        assert_eq!(
            by_caller(&with_principal(Some("Bearer t1"), "")),
            by_caller(&parts(Some("Bearer t1")))
        );
        assert_eq!(by_caller(&with_principal(None, "")), None);
    }

    #[test]
    fn callers_get_distinct_scopes_without_the_raw_credential() {
        let alice = by_caller(&parts(Some("Bearer alice"))).unwrap();
        let bob = by_caller(&parts(Some("Bearer bob"))).unwrap();
        assert_ne!(alice, bob);
        assert!(!alice.contains("alice"));
        assert_eq!(Some(alice), by_caller(&parts(Some("Bearer alice"))));
        assert_eq!(by_caller(&parts(None)), None);
        assert_eq!(by_caller(&parts(Some(""))), None);
        assert_eq!(by_caller(&parts(Some("  "))), None);
    }
}
