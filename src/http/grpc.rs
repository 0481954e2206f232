//! The gRPC face of the layer: a call is told apart by its `content-type`
//! (`application/grpc`, `application/grpc+proto`, ..., and gRPC-web's `application/grpc-web`,
//! `application/grpc-web-text`, ...), and everything the layer answers by itself on such a
//! call is a gRPC status, never an HTTP error body.
//!
//! gRPC runs over HTTP/2 POSTs whose answers are always HTTP 200; the outcome is the
//! `grpc-status` trailer (or header, in a "trailers-only" answer). So this needs no gRPC
//! library: the rejections are trailers-only answers built from `http` types, and a
//! handler's own status is read from its response's trailers to decide whether to store it.
//!
//! # The key
//!
//! A call's key is its `idempotency-key` metadata entry (the
//! [`header_name`](super::IdempotencyLayer::header_name)), read by the same rules as the HTTP
//! header. A method whose request message carries its own key, as Google AIP-155's
//! `request_id` field does, can have the layer read it from there instead:
//! [`IdempotencyLayer::key_from_message`](super::IdempotencyLayer::key_from_message), one
//! extractor per method path. The metadata entry, when a call sends one, wins; the message
//! key meets the same rules and is refused the same way (`INVALID_ARGUMENT`).
//!
//! # Which statuses are stored
//!
//! As for HTTP, an outcome is stored when a retry should get it again, and the key is
//! released when the call did not happen or may succeed if tried again
//! ([`is_final_grpc_by_default`], replaceable with
//! [`IdempotencyLayer::store_grpc_status`](super::IdempotencyLayer::store_grpc_status)):
//!
//! | stored (replayed) | released (a retry runs again) |
//! |---|---|
//! | `OK`, `INVALID_ARGUMENT`, `NOT_FOUND`, `ALREADY_EXISTS`, `PERMISSION_DENIED`, `FAILED_PRECONDITION`, `OUT_OF_RANGE`, `UNIMPLEMENTED`, `UNAUTHENTICATED` | `CANCELLED`, `UNKNOWN`, `DEADLINE_EXCEEDED`, `RESOURCE_EXHAUSTED`, `ABORTED`, `INTERNAL`, `UNAVAILABLE`, `DATA_LOSS`, an unknown code, and a response without `grpc-status` |
//!
//! # The layer's own answers on a gRPC call
//!
//! | rejection | gRPC status |
//! |---|---|
//! | missing or malformed key (in the metadata, or in the message of a method keyed by it), unreadable request | `INVALID_ARGUMENT` |
//! | the key was used with another request | `INVALID_ARGUMENT` (the message says so) |
//! | no caller identity to scope the key by | `UNAUTHENTICATED` |
//! | request over the fingerprint limit | `RESOURCE_EXHAUSTED` |
//! | a client stream (not exactly one request message) | `UNIMPLEMENTED` |
//! | first call still running, reject policy | `ABORTED` + `grpc-retry-pushback-ms` |
//! | the database is busy with other writers (SQLite, transactional mode) | `ABORTED` + `grpc-retry-pushback-ms` |
//! | store unavailable, transaction not committed, commit outcome unknown | `UNAVAILABLE` + `grpc-retry-pushback-ms` |
//! | commit outcome unknown on a call without a key (a retry may run it twice) | `UNKNOWN` |
//! | the call's `grpc-timeout` passed while it waited for the first one | `DEADLINE_EXCEEDED` |
//! | first call completed but its response was too large to store | `ALREADY_EXISTS` |
//! | the handler panicked, its body failed, it kept the transaction | `INTERNAL` |
//! | the record under the key cannot be read (until an operator forgets it) | `DATA_LOSS` |
//!
//! # Streaming
//!
//! A keyed call must be unary on the request side: a request body that is not exactly one
//! message is refused with `UNIMPLEMENTED` before anything runs, since a client stream has
//! no single request to fingerprint and replay. (A bidirectional stream that waits for a
//! reply before its client half ends would wait on the layer: send no key on such calls.) A
//! server stream under a key is recorded whole — every message and the trailers, up to the
//! response limit — while its key stays claimed, and replayed whole; keep keys off
//! long-lived streams. Calls without a key pass through untouched, as on HTTP.
//!
//! In the transactional mode a server stream over the response limit cannot be held until
//! its commit: its messages stream to the client, and its status is held back until the
//! transaction has committed (a status to store) or rolled back (one a retry may cure), so a
//! stream that ends with `UNAVAILABLE` keeps none of its writes. Should that commit fail, the
//! trailers carry the failure (`UNAVAILABLE`, `INTERNAL`) instead of the stream's own status;
//! on gRPC-web the call ends broken. A client that leaves before the status rolls it back.
//!
//! # gRPC-web
//!
//! A gRPC-web call (tonic-web's `GrpcWebLayer` inside this layer, or a proxy in front that
//! passes gRPC-web through) sends its status in the body, as a last frame flagged `0x80`,
//! since browsers cannot read HTTP trailers. The layer follows the frames of the response as
//! they pass, base64 ones (`-text`) included, and decides on that status exactly as on a
//! gRPC call's trailers, in both modes: the table above applies, a body that ends without a
//! whole trailer frame is not stored, and the trailer frame is handed on only once the
//! outcome is recorded (or, in the transactional mode, committed). The layer's own answers
//! are trailers-only gRPC-web responses in the call's own `content-type`. A `-text` request is
//! decoded to read its one message (the unary check, [`key_from_message`]); its fingerprint
//! is its bytes as sent. With tonic-web *outside* this layer the layer sees plain gRPC.
//!
//! [`key_from_message`]: super::IdempotencyLayer::key_from_message

use std::{borrow::Cow, time::Duration};

use http::{header, HeaderMap, HeaderValue, Response};

use super::{grpc_web, rejection::Rejection};

/// What a request or response speaks, by its `content-type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Protocol {
    /// Plain HTTP.
    Http,
    /// gRPC: `application/grpc`, `application/grpc+proto`, ...
    Grpc,
    /// gRPC-web, binary: `application/grpc-web`, `application/grpc-web+proto`, ...
    GrpcWeb,
    /// gRPC-web, base64: `application/grpc-web-text`, `application/grpc-web-text+proto`, ...
    GrpcWebText,
}

impl Protocol {
    /// The protocol `headers` announce.
    pub(crate) fn of(headers: &HeaderMap) -> Self {
        let Some(value) = headers.get(header::CONTENT_TYPE) else {
            return Self::Http;
        };
        let value = value.as_bytes();
        if !value.starts_with(b"application/grpc") {
            Self::Http
        } else if value.starts_with(b"application/grpc-web-text") {
            Self::GrpcWebText
        } else if value.starts_with(b"application/grpc-web") {
            Self::GrpcWeb
        } else {
            Self::Grpc
        }
    }

    /// gRPC in either form: answered with gRPC statuses, never HTTP error bodies.
    pub(crate) fn is_grpc(self) -> bool {
        self != Self::Http
    }

    /// The `content-type` of the layer's own answers.
    fn content_type(self) -> &'static str {
        match self {
            Self::Http | Self::Grpc => "application/grpc",
            Self::GrpcWeb => "application/grpc-web+proto",
            Self::GrpcWebText => "application/grpc-web-text+proto",
        }
    }
}

/// gRPC status codes the layer uses (the numbers are fixed by the gRPC protocol).
mod code {
    pub(super) const OK: i32 = 0;
    pub(super) const UNKNOWN: i32 = 2;
    pub(super) const INVALID_ARGUMENT: i32 = 3;
    pub(super) const DEADLINE_EXCEEDED: i32 = 4;
    pub(super) const NOT_FOUND: i32 = 5;
    pub(super) const ALREADY_EXISTS: i32 = 6;
    pub(super) const PERMISSION_DENIED: i32 = 7;
    pub(super) const RESOURCE_EXHAUSTED: i32 = 8;
    pub(super) const FAILED_PRECONDITION: i32 = 9;
    pub(super) const ABORTED: i32 = 10;
    pub(super) const OUT_OF_RANGE: i32 = 11;
    pub(super) const UNIMPLEMENTED: i32 = 12;
    pub(super) const INTERNAL: i32 = 13;
    pub(super) const UNAVAILABLE: i32 = 14;
    pub(super) const DATA_LOSS: i32 = 15;
    pub(super) const UNAUTHENTICATED: i32 = 16;
}

/// The default for gRPC calls: which `grpc-status` codes are stored and replayed (see the
/// table in the [module docs](self)). The others release the key so a retry runs again.
///
/// ```
/// use tower_idempotency::is_final_grpc_by_default;
/// assert!(is_final_grpc_by_default(0)); // OK
/// assert!(is_final_grpc_by_default(3)); // INVALID_ARGUMENT
/// assert!(!is_final_grpc_by_default(14)); // UNAVAILABLE
/// ```
pub fn is_final_grpc_by_default(code: i32) -> bool {
    matches!(
        code,
        code::OK
            | code::INVALID_ARGUMENT
            | code::NOT_FOUND
            | code::ALREADY_EXISTS
            | code::PERMISSION_DENIED
            | code::FAILED_PRECONDITION
            | code::OUT_OF_RANGE
            | code::UNIMPLEMENTED
            | code::UNAUTHENTICATED
    )
}

/// The `grpc-status` in `map` (trailers, or the headers of a trailers-only answer); `None`
/// when absent or not a number.
pub(crate) fn status_of(map: &HeaderMap) -> Option<i32> {
    map.get("grpc-status")?.to_str().ok()?.parse().ok()
}

/// The code and message a rejection is answered with on a gRPC call, and the delay to
/// suggest.
fn status_for(rejection: &Rejection) -> (i32, Option<Duration>) {
    let code = match rejection {
        Rejection::MissingKey
        | Rejection::MissingMessageKey
        | Rejection::InvalidKey(_)
        | Rejection::BodyUnreadable
        | Rejection::KeyReused => code::INVALID_ARGUMENT,
        Rejection::MissingIdentity => code::UNAUTHENTICATED,
        Rejection::BodyTooLarge { .. } => code::RESOURCE_EXHAUSTED,
        Rejection::NotUnary => code::UNIMPLEMENTED,
        Rejection::InProgress { .. } | Rejection::StoreBusy { .. } => code::ABORTED,
        Rejection::StoreUnavailable { .. }
        | Rejection::NotCommitted { .. }
        | Rejection::OutcomeUnknown { .. } => code::UNAVAILABLE,
        Rejection::DeadlineExceeded => code::DEADLINE_EXCEEDED,
        // Not UNAVAILABLE, which gRPC clients retry by themselves: a retry may run it twice.
        Rejection::OutcomeUnknownWithoutKey => code::UNKNOWN,
        Rejection::ResponseNotStored { .. } => code::ALREADY_EXISTS,
        Rejection::HandlerPanicked | Rejection::ResponseBodyFailed | Rejection::TransactionHeld => {
            code::INTERNAL
        }
        Rejection::RecordUnreadable => code::DATA_LOSS,
    };
    (code, rejection.retry_after())
}

/// A rejection as a gRPC trailers-only answer in the call's `protocol` (gRPC-web allows one
/// too): HTTP 200, `grpc-status`, a percent-encoded `grpc-message` (the rejection's text), and
/// `grpc-retry-pushback-ms` where a retry can cure it (gRPC's retry policy honours it).
pub(crate) fn rejection_response<B: Default>(
    rejection: &Rejection,
    protocol: Protocol,
) -> Response<B> {
    let mut response = Response::new(B::default());
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(protocol.content_type()),
    );
    *headers = status_headers(rejection, std::mem::take(headers));
    response
}

/// `headers` plus the gRPC status a rejection is answered with: in the head of a
/// trailers-only answer, or as the trailers of a stream that already sent its head.
pub(crate) fn status_headers(rejection: &Rejection, mut headers: HeaderMap) -> HeaderMap {
    let (code, retry_after) = status_for(rejection);
    headers.insert("grpc-status", HeaderValue::from(code));
    let message = percent_encode(&rejection.to_string());
    if let Ok(message) = HeaderValue::from_str(&message) {
        headers.insert("grpc-message", message);
    }
    if let Some(delay) = retry_after {
        let millis = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        headers.insert("grpc-retry-pushback-ms", HeaderValue::from(millis));
    }
    headers
}

/// `grpc-message` is percent-encoded: every byte outside printable ASCII, and `%` itself.
fn percent_encode(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    for byte in message.bytes() {
        if (0x20..=0x7e).contains(&byte) && byte != b'%' {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// The deadline a call carries in `grpc-timeout` (`<digits><unit>`, unit one of `H M S m u
/// n`): `None` when absent or malformed.
pub(crate) fn timeout_of(headers: &HeaderMap) -> Option<Duration> {
    let value = headers.get("grpc-timeout")?.to_str().ok()?;
    let split = value.len().checked_sub(1)?;
    let (digits, unit) = value.split_at(split);
    // The protocol allows at most 8 digits.
    if digits.is_empty() || digits.len() > 8 {
        return None;
    }
    let amount: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(amount * 3600),
        "M" => Duration::from_secs(amount * 60),
        "S" => Duration::from_secs(amount),
        "m" => Duration::from_millis(amount),
        "u" => Duration::from_micros(amount),
        "n" => Duration::from_nanos(amount),
        _ => return None,
    })
}

/// The one message of a unary request body (length-prefixed: a compression flag byte, a
/// 4-byte big-endian length, the message): `None` unless the body is exactly one whole
/// message. The message is returned as sent, compressed when its flag says so.
pub(crate) fn single_message(body: &[u8]) -> Option<(bool, &[u8])> {
    let (&flag, rest) = body.split_first()?;
    let (length, message) = rest.split_first_chunk::<4>()?;
    let length = usize::try_from(u32::from_be_bytes(*length)).ok()?;
    (message.len() == length && flag <= 1).then_some((flag == 1, message))
}

/// The one message of a unary request body in `protocol`, as [`single_message`] reads it,
/// from the decoded body of a gRPC-web-text call: `None` unless it is exactly one message.
pub(crate) fn request_message(protocol: Protocol, body: &[u8]) -> Option<(bool, Cow<'_, [u8]>)> {
    if protocol != Protocol::GrpcWebText {
        let (compressed, message) = single_message(body)?;
        return Some((compressed, Cow::Borrowed(message)));
    }
    let decoded = grpc_web::decode_text(body)?;
    let (compressed, message) = single_message(&decoded)?;
    Some((compressed, Cow::Owned(message.to_vec())))
}

/// The message of a unary gRPC request body, for a key extractor to decode (e.g. with prost,
/// to read an AIP-155 `request_id`): `None` when the body is not exactly one uncompressed
/// message (a compressed one is left to the service to decode).
///
/// ```
/// use tower_idempotency::grpc_message;
/// let body = [0, 0, 0, 0, 3, b'a', b'b', b'c'];
/// assert_eq!(grpc_message(&body), Some(&b"abc"[..]));
/// assert_eq!(grpc_message(&body[..6]), None);
/// ```
pub fn grpc_message(body: &[u8]) -> Option<&[u8]> {
    match single_message(body)? {
        (false, message) => Some(message),
        (true, _) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detection_is_by_content_type() {
        for (value, protocol) in [
            ("application/grpc", Protocol::Grpc),
            ("application/grpc+proto", Protocol::Grpc),
            ("application/grpc-web", Protocol::GrpcWeb),
            ("application/grpc-web+proto", Protocol::GrpcWeb),
            ("application/grpc-web-text", Protocol::GrpcWebText),
            ("application/grpc-web-text+proto", Protocol::GrpcWebText),
            ("application/json", Protocol::Http),
        ] {
            let mut headers = HeaderMap::new();
            headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(value));
            assert_eq!(Protocol::of(&headers), protocol, "{value}");
        }
        assert_eq!(Protocol::of(&HeaderMap::new()), Protocol::Http);
    }

    #[test]
    fn an_unknown_commit_outcome_is_unavailable_with_pushback() {
        let rejection = Rejection::OutcomeUnknown {
            retry_after: Duration::from_millis(1500),
        };
        let response: Response<()> = rejection_response(&rejection, Protocol::Grpc);
        let headers = response.headers();
        assert_eq!(
            headers["grpc-status"],
            code::UNAVAILABLE.to_string().as_str()
        );
        assert_eq!(headers["grpc-retry-pushback-ms"], "1500");
        assert!(headers["grpc-message"]
            .to_str()
            .unwrap()
            .contains("outcome is unknown"));
    }

    /// A retry cannot cure it: no pushback, and the code that says the data is lost.
    #[test]
    fn an_unreadable_record_is_data_loss_without_pushback() {
        let response: Response<()> =
            rejection_response(&Rejection::RecordUnreadable, Protocol::GrpcWeb);
        let headers = response.headers();
        assert_eq!(headers["grpc-status"], code::DATA_LOSS.to_string().as_str());
        assert!(headers.get("grpc-retry-pushback-ms").is_none());
        assert_eq!(headers[header::CONTENT_TYPE], "application/grpc-web+proto");
    }

    #[test]
    fn timeouts_parse_every_unit_and_refuse_garbage() {
        let parse = |value: &'static str| {
            let mut headers = HeaderMap::new();
            headers.insert("grpc-timeout", HeaderValue::from_static(value));
            timeout_of(&headers)
        };
        assert_eq!(parse("2H"), Some(Duration::from_secs(7200)));
        assert_eq!(parse("3M"), Some(Duration::from_secs(180)));
        assert_eq!(parse("4S"), Some(Duration::from_secs(4)));
        assert_eq!(parse("250m"), Some(Duration::from_millis(250)));
        assert_eq!(parse("7u"), Some(Duration::from_micros(7)));
        assert_eq!(parse("9n"), Some(Duration::from_nanos(9)));
        for garbage in ["", "m", "123456789m", "5x", "-5m"] {
            assert_eq!(parse(garbage), None, "{garbage}");
        }
    }

    #[test]
    fn only_one_whole_message_is_unary() {
        assert_eq!(single_message(&[0, 0, 0, 0, 0]), Some((false, &[][..])));
        assert_eq!(single_message(&[1, 0, 0, 0, 1, 9]), Some((true, &[9][..])));
        // Two messages, a cut one, a bad flag, nothing.
        assert_eq!(single_message(&[0, 0, 0, 0, 0, 0, 0, 0, 0, 0]), None);
        assert_eq!(single_message(&[0, 0, 0, 0, 2, 9]), None);
        assert_eq!(single_message(&[2, 0, 0, 0, 0]), None);
        assert_eq!(single_message(&[]), None);
    }

    #[test]
    fn messages_are_percent_encoded() {
        assert_eq!(percent_encode("100% sûr"), "100%25 s%C3%BBr");
    }
}
