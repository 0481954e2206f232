//! How a response is stored for replay: status, header pairs in order, body bytes.
//!
//! Headers are kept as a list of (name, value) pairs, never a map, so repeated headers
//! (several `Set-Cookie`, several `Link`) and values containing commas survive replay intact.
//!
//! Layout (all integers big-endian): `TIR` + version byte `1`, kind byte, status `u16`,
//! header count `u32`, then per header: name length `u16`, name, value length `u32`, value;
//! for the kind "response with trailers", the trailers follow in the same form; the rest is
//! the body. Trailers are stored as sent (a gRPC `grpc-status` must be replayed as it was).

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};

const MAGIC: &[u8; 4] = b"TIR\x01";
const KIND_RESPONSE: u8 = 0;
const KIND_NOT_STORED: u8 = 1;
const KIND_RESPONSE_WITH_TRAILERS: u8 = 2;

/// A response as it is replayed to duplicates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum StoredResponse {
    /// The full response.
    Response {
        status: StatusCode,
        headers: HeaderMap,
        body: Bytes,
        /// The trailers the original body ended with, if any (boxed: rare, and a map is large).
        trailers: Option<Box<HeaderMap>>,
    },
    /// The original completed with `status`, but its body was over the storage limit.
    NotStored { status: StatusCode },
}

/// Headers that describe one connection or one moment, not the resource: never replayed.
fn is_per_message(name: &HeaderName) -> bool {
    name == header::CONNECTION
        || name == header::TRANSFER_ENCODING
        || name == header::UPGRADE
        || name == header::TE
        || name == header::TRAILER
        || name == header::PROXY_AUTHENTICATE
        || name == header::PROXY_AUTHORIZATION
        || name == header::DATE
        || name.as_str() == "keep-alive"
        || name.as_str() == "proxy-connection"
}

/// Encodes a response for storage, dropping hop-by-hop headers and `Date`, and `Set-Cookie`
/// unless `keep_set_cookie`.
#[cfg(test)]
pub(crate) fn encode(
    status: StatusCode,
    headers: &HeaderMap,
    body: &[u8],
    keep_set_cookie: bool,
) -> Bytes {
    encode_with_trailers(status, headers, None, body, keep_set_cookie)
}

/// Encodes a response for storage as `encode` does, with the trailers the body ended with
/// (kept whole): for a body read whole (the transactional mode), where a streamed one uses
/// the [`Encoder`] in two steps.
#[cfg(any(test, feature = "sqlx"))]
pub(crate) fn encode_with_trailers(
    status: StatusCode,
    headers: &HeaderMap,
    trailers: Option<&HeaderMap>,
    body: &[u8],
    keep_set_cookie: bool,
) -> Bytes {
    Encoder::start(status, headers, keep_set_cookie, body.len()).finish(trailers, body)
}

/// A response being encoded for storage in two steps: its head when the response starts,
/// so the headers need not be kept (cloned) while the body streams, and its trailers and
/// body when it ends. The trailers come before the body in the layout, so the kind byte is
/// set then.
pub(crate) struct Encoder {
    out: BytesMut,
}

impl Encoder {
    /// Encodes the status and the headers to replay, leaving room for `body_hint` bytes of
    /// body.
    pub(crate) fn start(
        status: StatusCode,
        headers: &HeaderMap,
        keep_set_cookie: bool,
        body_hint: usize,
    ) -> Self {
        let kept = |(name, _): &(&HeaderName, &HeaderValue)| {
            !is_per_message(name) && (keep_set_cookie || *name != header::SET_COOKIE)
        };
        let (count, size) = pairs_size(headers.iter().filter(kept));
        let mut out = BytesMut::with_capacity(7 + size + body_hint);
        out.put_slice(MAGIC);
        out.put_u8(KIND_RESPONSE);
        out.put_u16(status.as_u16());
        put_pairs(&mut out, count, headers.iter().filter(kept));
        Self { out }
    }

    /// Adds the trailers (if any) and the body: the stored response.
    pub(crate) fn finish(mut self, trailers: Option<&HeaderMap>, body: &[u8]) -> Bytes {
        if let Some(trailers) = trailers.filter(|trailers| !trailers.is_empty()) {
            self.out[MAGIC.len()] = KIND_RESPONSE_WITH_TRAILERS;
            let (count, size) = pairs_size(trailers.iter());
            self.out.reserve(size + body.len());
            put_pairs(&mut self.out, count, trailers.iter());
        }
        self.out.put_slice(body);
        self.out.freeze()
    }
}

/// How many pairs, and the bytes `put_pairs` writes for them.
fn pairs_size<'a>(
    pairs: impl Iterator<Item = (&'a HeaderName, &'a HeaderValue)>,
) -> (usize, usize) {
    pairs.fold((0, 4), |(count, size), (name, value)| {
        (count + 1, size + 6 + name.as_str().len() + value.len())
    })
}

fn put_pairs<'a>(
    out: &mut BytesMut,
    count: usize,
    pairs: impl Iterator<Item = (&'a HeaderName, &'a HeaderValue)>,
) {
    out.put_u32(count as u32);
    for (name, value) in pairs {
        // Header names are at most 64 KiB by the http crate's limits; values are bounded by
        // what a server accepts; both fit the length fields.
        out.put_u16(name.as_str().len() as u16);
        out.put_slice(name.as_str().as_bytes());
        out.put_u32(value.len() as u32);
        out.put_slice(value.as_bytes());
    }
}

/// Encodes the marker for a completed response whose body was too large to store.
pub(crate) fn encode_not_stored(status: StatusCode) -> Bytes {
    let mut out = BytesMut::with_capacity(7);
    out.put_slice(MAGIC);
    out.put_u8(KIND_NOT_STORED);
    out.put_u16(status.as_u16());
    out.freeze()
}

/// Decodes what [`encode_with_trailers`] or [`encode_not_stored`] wrote; `Err` describes the damage.
pub(crate) fn decode(mut payload: Bytes) -> Result<StoredResponse, String> {
    if payload.len() < 7 || &payload[..4] != MAGIC {
        return Err("not a stored HTTP response (unknown format or version)".into());
    }
    payload.advance(4);
    let kind = payload.get_u8();
    let status = StatusCode::from_u16(payload.get_u16()).map_err(|e| e.to_string())?;
    let with_trailers = match kind {
        KIND_NOT_STORED => return Ok(StoredResponse::NotStored { status }),
        KIND_RESPONSE => false,
        KIND_RESPONSE_WITH_TRAILERS => true,
        other => return Err(format!("unknown record kind {other}")),
    };
    let headers = take_pairs(&mut payload)?;
    let trailers = match with_trailers {
        true => Some(Box::new(take_pairs(&mut payload)?)),
        false => None,
    };
    Ok(StoredResponse::Response {
        status,
        headers,
        body: payload,
        trailers,
    })
}

fn take_pairs(payload: &mut Bytes) -> Result<HeaderMap, String> {
    let count = take_u32(payload)?;
    // Room for two more: the server adds `content-length` to a replayed response (axum does
    // it before hyper), and the layer may add `Idempotent-Replayed`; a full map would be
    // copied into a larger one for them.
    let mut headers = HeaderMap::with_capacity(count.min(128) as usize + 2);
    for _ in 0..count {
        let name_len = usize::from(take_u16(payload)?);
        enough(payload, name_len)?;
        let name = HeaderName::from_bytes(&payload[..name_len]).map_err(|e| e.to_string())?;
        payload.advance(name_len);
        let value_len = take_u32(payload)? as usize;
        enough(payload, value_len)?;
        // The value shares the payload's buffer; the name and the lengths are read in place,
        // without a `Bytes` handle (and its reference count) each.
        let value = HeaderValue::from_maybe_shared(payload.split_to(value_len))
            .map_err(|e| e.to_string())?;
        headers.append(name, value);
    }
    Ok(headers)
}

fn enough(payload: &Bytes, len: usize) -> Result<(), String> {
    if payload.len() < len {
        return Err("stored response is truncated".into());
    }
    Ok(())
}

fn take_u16(payload: &mut Bytes) -> Result<u16, String> {
    enough(payload, 2)?;
    Ok(payload.get_u16())
}

fn take_u32(payload: &mut Bytes) -> Result<u32, String> {
    enough(payload, 4)?;
    Ok(payload.get_u32())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_and_comma_headers_round_trip_in_order() {
        let mut headers = HeaderMap::new();
        headers.append(header::SET_COOKIE, HeaderValue::from_static("a=1"));
        headers.append(
            header::SET_COOKIE,
            HeaderValue::from_static("b=2; Expires=Wed, 21 Oct 2026 07:28:00 GMT"),
        );
        headers.append(
            header::LINK,
            HeaderValue::from_static("</a>; rel=next, </b>; rel=prev"),
        );
        headers.append(header::CONNECTION, HeaderValue::from_static("close"));
        headers.append(
            header::DATE,
            HeaderValue::from_static("Wed, 21 Oct 2026 07:28:00 GMT"),
        );
        let body = Bytes::from_static(b"\0\xffbody");
        let stored = decode(encode(StatusCode::CREATED, &headers, &body, true)).unwrap();
        let StoredResponse::Response {
            status,
            headers: got,
            body: got_body,
            trailers: None,
        } = stored
        else {
            panic!()
        };
        assert_eq!(status, StatusCode::CREATED);
        assert_eq!(got_body, body);
        let cookies: Vec<_> = got.get_all(header::SET_COOKIE).iter().collect();
        assert_eq!(
            cookies,
            ["a=1", "b=2; Expires=Wed, 21 Oct 2026 07:28:00 GMT"]
        );
        assert_eq!(got[header::LINK], "</a>; rel=next, </b>; rel=prev");
        assert!(got.get(header::CONNECTION).is_none() && got.get(header::DATE).is_none());
    }

    #[test]
    fn trailers_round_trip() {
        let trailers = HeaderMap::from_iter([(
            HeaderName::from_static("grpc-status"),
            HeaderValue::from_static("0"),
        )]);
        let stored = encode_with_trailers(
            StatusCode::OK,
            &HeaderMap::new(),
            Some(&trailers),
            b"frames",
            false,
        );
        let Ok(StoredResponse::Response {
            body,
            trailers: Some(got),
            ..
        }) = decode(stored)
        else {
            panic!("trailers were not kept")
        };
        assert_eq!((body.as_ref(), *got), (b"frames".as_slice(), trailers));
    }

    #[test]
    fn set_cookie_is_dropped_unless_kept() {
        let mut headers = HeaderMap::new();
        headers.append(
            header::SET_COOKIE,
            HeaderValue::from_static("session=secret"),
        );
        let StoredResponse::Response { headers, .. } =
            decode(encode(StatusCode::OK, &headers, b"", false)).unwrap()
        else {
            panic!()
        };
        assert!(headers.is_empty());
    }

    #[test]
    fn damaged_payloads_are_errors_not_panics() {
        let good = encode(
            StatusCode::OK,
            &HeaderMap::from_iter([(header::ETAG, HeaderValue::from_static("\"1\""))]),
            b"x",
            false,
        );
        for cut in 0..good.len() - 1 {
            // Every prefix either decodes (the body is simply shorter) or reports damage.
            let _ = decode(good.slice(..cut));
        }
        assert!(decode(Bytes::from_static(b"garbage")).is_err());
        assert_eq!(
            decode(encode_not_stored(StatusCode::CREATED)),
            Ok(StoredResponse::NotStored {
                status: StatusCode::CREATED
            })
        );
    }
}
