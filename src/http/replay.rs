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

/// Why a stored payload is not a response this crate encoded: a corrupt or hostile store.
/// `offset` is the byte of the payload where the damage was found.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DecodeError {
    /// Shorter than the fixed head, or without the `TIR` magic and version 1.
    #[error("not a stored HTTP response (unknown format or version)")]
    UnknownFormat,
    /// The status is not a valid HTTP status code.
    #[error("invalid status {status} at byte {offset}")]
    Status {
        status: u16,
        offset: usize,
        #[source]
        source: http::status::InvalidStatusCode,
    },
    /// The kind byte names no layout this crate writes.
    #[error("unknown record kind {kind} at byte {offset}")]
    Kind { kind: u8, offset: usize },
    /// A length field claims more bytes than the payload has left.
    #[error("stored response is truncated at byte {offset}: {needed} bytes needed, {left} left")]
    Truncated {
        offset: usize,
        needed: usize,
        left: usize,
    },
    /// A stored header name is not a valid header name.
    #[error("invalid header name at byte {offset}")]
    HeaderName {
        offset: usize,
        #[source]
        source: http::header::InvalidHeaderName,
    },
    /// A stored header value is not a valid header value.
    #[error("invalid header value at byte {offset}")]
    HeaderValue {
        offset: usize,
        #[source]
        source: http::header::InvalidHeaderValue,
    },
}

/// A payload being read, with the offset of its next byte for error messages.
struct Reader {
    rest: Bytes,
    offset: usize,
}

impl Reader {
    /// Checks that `len` more bytes are there before anything is read or allocated for them:
    /// a length field comes from the store, and a hostile one may claim gigabytes.
    fn enough(&self, len: usize) -> Result<(), DecodeError> {
        if self.rest.len() < len {
            return Err(DecodeError::Truncated {
                offset: self.offset,
                needed: len,
                left: self.rest.len(),
            });
        }
        Ok(())
    }

    fn advance(&mut self, len: usize) {
        self.rest.advance(len);
        self.offset += len;
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        self.enough(1)?;
        self.offset += 1;
        Ok(self.rest.get_u8())
    }

    fn u16(&mut self) -> Result<u16, DecodeError> {
        self.enough(2)?;
        self.offset += 2;
        Ok(self.rest.get_u16())
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        self.enough(4)?;
        self.offset += 4;
        Ok(self.rest.get_u32())
    }

    /// The next `len` bytes, sharing the payload's buffer.
    fn split(&mut self, len: usize) -> Result<Bytes, DecodeError> {
        self.enough(len)?;
        self.offset += len;
        Ok(self.rest.split_to(len))
    }
}

/// Decodes what [`encode_with_trailers`] or [`encode_not_stored`] wrote; `Err` says what is
/// damaged and where.
pub(crate) fn decode(payload: Bytes) -> Result<StoredResponse, DecodeError> {
    if payload.len() < 7 || &payload[..4] != MAGIC {
        return Err(DecodeError::UnknownFormat);
    }
    let mut reader = Reader {
        rest: payload,
        offset: 0,
    };
    reader.advance(MAGIC.len());
    let kind = reader.u8()?;
    let offset = reader.offset;
    let status = reader.u16()?;
    let status = StatusCode::from_u16(status).map_err(|source| DecodeError::Status {
        status,
        offset,
        source,
    })?;
    let with_trailers = match kind {
        KIND_NOT_STORED => return Ok(StoredResponse::NotStored { status }),
        KIND_RESPONSE => false,
        KIND_RESPONSE_WITH_TRAILERS => true,
        kind => {
            return Err(DecodeError::Kind {
                kind,
                offset: MAGIC.len(),
            })
        }
    };
    let headers = take_pairs(&mut reader)?;
    let trailers = match with_trailers {
        true => Some(Box::new(take_pairs(&mut reader)?)),
        false => None,
    };
    Ok(StoredResponse::Response {
        status,
        headers,
        body: reader.rest,
        trailers,
    })
}

fn take_pairs(reader: &mut Reader) -> Result<HeaderMap, DecodeError> {
    let count = reader.u32()?;
    // Room for two more: the server adds `content-length` to a replayed response (axum does
    // it before hyper), and the layer may add `Idempotent-Replayed`; a full map would be
    // copied into a larger one for them. Capped: the count comes from the store, and each
    // pair takes at least 6 bytes, so no more than that many can follow.
    let plausible = (count as usize).min(reader.rest.len() / 6).min(128);
    let mut headers = HeaderMap::with_capacity(plausible + 2);
    for _ in 0..count {
        let name_len = usize::from(reader.u16()?);
        reader.enough(name_len)?;
        let offset = reader.offset;
        let name = HeaderName::from_bytes(&reader.rest[..name_len])
            .map_err(|source| DecodeError::HeaderName { offset, source })?;
        reader.advance(name_len);
        let value_len = reader.u32()? as usize;
        let offset = reader.offset;
        // The value shares the payload's buffer; the name and the lengths are read in place,
        // without a `Bytes` handle (and its reference count) each.
        let value = HeaderValue::from_maybe_shared(reader.split(value_len)?)
            .map_err(|source| DecodeError::HeaderValue { offset, source })?;
        headers.append(name, value);
    }
    Ok(headers)
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
        assert!(matches!(
            decode(encode_not_stored(StatusCode::CREATED)),
            Ok(StoredResponse::NotStored {
                status: StatusCode::CREATED
            })
        ));
    }
}
