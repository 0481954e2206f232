use bytes::Bytes;
use http::{header::ETAG, Response, StatusCode};

use super::{ETag, InsertOutcome, InvalidPrecondition, Version, VersionedUpdate};
use crate::problem::Problem;

/// Problem `type` of a malformed `If-Match` / `If-None-Match` header (400).
pub const INVALID_PRECONDITION_TYPE: &str = "urn:tower-idempotency:invalid-precondition";
/// Problem `type` of a request that had to carry `If-Match` and did not (428).
pub const PRECONDITION_REQUIRED_TYPE: &str = "urn:tower-idempotency:precondition-required";
/// Problem `type` of a failed precondition, e.g. a stale `If-Match` (412).
pub const PRECONDITION_FAILED_TYPE: &str = "urn:tower-idempotency:precondition-failed";
/// Problem `type` of a conditional request on a resource that does not exist (404).
pub const NOT_FOUND_TYPE: &str = "urn:tower-idempotency:not-found";

/// Why a conditional request is not performed. Each variant renders its own response:
/// problem+json for the errors, a bodiless 304 for [`NotModified`](Self::NotModified).
///
/// ```
/// use http::StatusCode;
/// use tower_idempotency::version::{ETag, PreconditionRejection, Version};
/// let response = PreconditionRejection::Failed { current: Some(ETag::from(Version::new(8))) }
///     .into_http_response();
/// assert_eq!(response.status(), StatusCode::PRECONDITION_FAILED);
/// assert_eq!(response.headers()["etag"], "\"8\"");
/// assert_eq!(response.headers()["content-type"], "application/problem+json");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PreconditionRejection {
    /// 400: an `If-Match` / `If-None-Match` header is not valid entity-tag syntax.
    #[error(transparent)]
    Malformed(#[from] InvalidPrecondition),
    /// 428: the route requires `If-Match` and the request has none.
    #[error("this request must be conditional: send If-Match with the ETag from a GET of the resource, so that a concurrent change is not overwritten")]
    Required,
    /// 412: a precondition failed; `current` is the resource's current ETag, sent back in
    /// the `ETag` header so the client can re-read or retry deliberately.
    #[error("precondition failed: the resource is not at the version the request expected (it changed since it was read, or it does not exist)")]
    Failed {
        /// The current ETag, when the resource exists and its version is known.
        current: Option<ETag>,
    },
    /// 304: `If-None-Match` matched on a GET or HEAD; the client's copy is current.
    #[error("not modified")]
    NotModified {
        /// The current ETag.
        current: ETag,
    },
    /// 404: the resource does not exist.
    #[error("the resource does not exist")]
    NotFound,
}

impl PreconditionRejection {
    /// The response status.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::Malformed(_) => StatusCode::BAD_REQUEST,
            Self::Required => StatusCode::PRECONDITION_REQUIRED,
            Self::Failed { .. } => StatusCode::PRECONDITION_FAILED,
            Self::NotModified { .. } => StatusCode::NOT_MODIFIED,
            Self::NotFound => StatusCode::NOT_FOUND,
        }
    }

    /// The problem details body; `None` for 304, which has no body.
    pub fn problem(&self) -> Option<Problem> {
        let (type_uri, title) = match self {
            Self::Malformed(_) => (INVALID_PRECONDITION_TYPE, "Malformed precondition header"),
            Self::Required => (PRECONDITION_REQUIRED_TYPE, "Precondition required"),
            Self::Failed { .. } => (PRECONDITION_FAILED_TYPE, "Precondition failed"),
            Self::NotModified { .. } => return None,
            Self::NotFound => (NOT_FOUND_TYPE, "Not found"),
        };
        Some(Problem::new(self.status(), type_uri, title).detail(self.to_string()))
    }

    /// The current ETag the response carries (412 and 304), if known.
    pub fn current(&self) -> Option<&ETag> {
        match self {
            Self::Failed { current } => current.as_ref(),
            Self::NotModified { current } => Some(current),
            _ => None,
        }
    }

    /// The response: status, `ETag` header when known, problem+json body (none for 304).
    pub fn into_http_response(self) -> Response<Bytes> {
        let mut response = match self.problem() {
            Some(problem) => problem.into_http_response(),
            None => {
                let mut response = Response::new(Bytes::new());
                *response.status_mut() = self.status();
                response
            }
        };
        if let Some(tag) = self.current() {
            response.headers_mut().insert(ETAG, tag.to_header_value());
        }
        response
    }
}

impl<R> VersionedUpdate<R> {
    /// The HTTP reading of a conditional update: `Ok((new version, row))` for `Updated`
    /// (send `ETag::from(version)`), a 412 carrying the current ETag for `Conflict` (without
    /// one when the database aborted the transaction and the version is unknown), and 404
    /// for `NotFound`.
    ///
    /// A missing resource is 404 even when the request carried `If-Match`: RFC 9110
    /// §13.2.1 has the server ignore preconditions when the request would fail without
    /// them, and an update of a missing row would. (Use [`Preconditions::evaluate`], which
    /// answers 412, for methods that could create the resource.)
    ///
    /// [`Preconditions::evaluate`]: super::Preconditions::evaluate
    pub fn into_http(self) -> Result<(Version, Option<R>), PreconditionRejection> {
        match self {
            Self::Updated { version, row } => Ok((version, row)),
            Self::Conflict {
                current_version, ..
            } => Err(PreconditionRejection::Failed {
                current: current_version.map(ETag::from),
            }),
            Self::NotFound => Err(PreconditionRejection::NotFound),
        }
    }
}

impl InsertOutcome {
    /// The HTTP reading of a create-only insert (`If-None-Match: *`): `Ok(version)` when
    /// created, 412 when the resource already exists.
    pub fn into_http(self) -> Result<Version, PreconditionRejection> {
        match self {
            Self::Created { version } => Ok(version),
            Self::AlreadyExists { .. } => Err(PreconditionRejection::Failed { current: None }),
        }
    }
}
