//! RFC 9457 problem details: the body of every error response this crate produces.

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use serde::Serialize;

/// The media type of problem details bodies.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// An RFC 9457 problem details object. `type` is a stable URI per kind of problem, so clients
/// can branch on it; `title` is the same for every occurrence; `detail` explains this one.
///
/// ```
/// use http::StatusCode;
/// use tower_idempotency::problem::Problem;
/// let response = Problem::new(StatusCode::CONFLICT, "urn:example:conflict", "Conflict")
///     .detail("try again later")
///     .into_http_response();
/// assert_eq!(response.status(), StatusCode::CONFLICT);
/// assert_eq!(response.headers()["content-type"], "application/problem+json");
/// ```
///
/// With the `axum` feature it is also an axum `IntoResponse`, so a handler can return it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Problem {
    #[serde(rename = "type")]
    type_uri: &'static str,
    title: &'static str,
    #[serde(serialize_with = "serialize_status")]
    status: StatusCode,
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<String>,
}

impl Problem {
    /// A problem with its status, stable type URI and title.
    pub fn new(status: StatusCode, type_uri: &'static str, title: &'static str) -> Self {
        Self {
            type_uri,
            title,
            status,
            detail: None,
        }
    }

    /// Adds the human-readable explanation of this occurrence.
    pub fn detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The stable type URI.
    pub fn type_uri(&self) -> &'static str {
        self.type_uri
    }

    /// The JSON body.
    pub fn to_json(&self) -> Bytes {
        // Serializing a struct of strings and a number cannot fail.
        Bytes::from(serde_json::to_vec(self).unwrap_or_default())
    }

    /// A response with the status, `Content-Type: application/problem+json` and the JSON body.
    pub fn into_http_response(self) -> Response<Bytes> {
        let mut response = Response::new(self.to_json());
        *response.status_mut() = self.status;
        response
            .headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        response
    }
}

#[cfg(feature = "axum")]
impl axum_core::response::IntoResponse for Problem {
    fn into_response(self) -> axum_core::response::Response {
        self.into_http_response().map(axum_core::body::Body::from)
    }
}

fn serialize_status<S: serde::Serializer>(status: &StatusCode, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u16(status.as_u16())
}
