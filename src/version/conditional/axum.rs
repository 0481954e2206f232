//! axum integration: extractors for preconditions and responses for their rejections.

use std::convert::Infallible;

use axum_core::{
    extract::FromRequestParts,
    response::{IntoResponse, IntoResponseParts, Response, ResponseParts},
};
use http::{header::ETAG, request::Parts};

use super::{ETag, PreconditionRejection, Preconditions};

/// Optional preconditions: extracts `If-Match` / `If-None-Match` when present; rejects only
/// malformed values (400 problem+json).
///
/// ```
/// use axum::{routing::put, Router};
/// use tower_idempotency::version::Preconditions;
/// async fn put_doc(pre: Preconditions) -> String {
///     format!("conditional: {}", !pre.is_empty())
/// }
/// let app: Router = Router::new().route("/docs/{id}", put(put_doc));
/// ```
impl<S: Send + Sync> FromRequestParts<S> for Preconditions {
    type Rejection = PreconditionRejection;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        Ok(Preconditions::from_headers(&parts.headers)?)
    }
}

/// Required preconditions: like [`Preconditions`], but a request without `If-Match` is
/// rejected with 428 problem+json telling the client to send the ETag from a GET. Use it on
/// routes that must never overwrite a change the client has not seen.
///
/// ```
/// use axum::{routing::patch, Router};
/// use tower_idempotency::version::RequireIfMatch;
/// async fn patch_payment(RequireIfMatch(pre): RequireIfMatch) -> String {
///     format!("{:?}", pre.expected())
/// }
/// let app: Router = Router::new().route("/payments/{id}", patch(patch_payment));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequireIfMatch(pub Preconditions);

impl<S: Send + Sync> FromRequestParts<S> for RequireIfMatch {
    type Rejection = PreconditionRejection;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        let preconditions = Preconditions::from_headers(&parts.headers)?;
        Ok(Self(preconditions.require_if_match()?))
    }
}

impl IntoResponse for PreconditionRejection {
    fn into_response(self) -> Response {
        self.into_http_response().map(axum_core::body::Body::from)
    }
}

/// Sets the `ETag` header: return `(ETag::from(version), Json(row))` from a handler.
impl IntoResponseParts for ETag {
    type Error = Infallible;

    fn into_response_parts(self, mut res: ResponseParts) -> Result<ResponseParts, Self::Error> {
        res.headers_mut().insert(ETAG, self.to_header_value());
        Ok(res)
    }
}
