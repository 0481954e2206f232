//! Reading the request body before the key is claimed: its bytes are part of the
//! fingerprint, and the inner service gets them back as a body of the same type.

use bytes::{Buf, Bytes, BytesMut};
use http::header;
use http_body::Body;
use http_body_util::BodyExt;

use super::rejection::Rejection;
use crate::BoxError;

/// Reads `body` whole, refusing one past `limit` bytes, by its declared length before reading
/// anything or by what arrives. Nothing is claimed yet, so a refusal leaves no trace.
///
/// A body that arrives as one frame (a `Full` body, most small requests) is handed on as that
/// frame's bytes, uncopied; only a body of several frames is gathered into one buffer.
pub(crate) async fn read_body<B>(
    headers: &http::HeaderMap,
    body: B,
    limit: usize,
) -> Result<Bytes, Rejection>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(Rejection::BodyTooLarge { limit });
    }
    let mut body = std::pin::pin!(body);
    let mut first: Option<Bytes> = None;
    let mut gathered: Option<BytesMut> = None;
    let mut len = 0usize;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|error| {
            let error: BoxError = error.into();
            tracing::debug!(error = %error, "request body unreadable; nothing was claimed");
            Rejection::BodyUnreadable
        })?;
        // Trailers of a request body are not part of what it asks for.
        let Ok(mut data) = frame.into_data() else {
            continue;
        };
        len = len.saturating_add(data.remaining());
        if len > limit {
            return Err(Rejection::BodyTooLarge { limit });
        }
        let chunk = data.copy_to_bytes(data.remaining());
        if let Some(buffer) = &mut gathered {
            buffer.extend_from_slice(&chunk);
        } else if let Some(earlier) = first.take() {
            let mut buffer = BytesMut::with_capacity(declared.map_or(0, |d| d as usize));
            buffer.extend_from_slice(&earlier);
            buffer.extend_from_slice(&chunk);
            gathered = Some(buffer);
        } else {
            first = Some(chunk);
        }
    }
    Ok(match gathered {
        Some(buffer) => buffer.freeze(),
        None => first.unwrap_or_default(),
    })
}
