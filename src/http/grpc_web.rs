//! gRPC-web: the gRPC framing over HTTP/1.1 and browsers' fetch, where a call's status cannot
//! travel as HTTP trailers. It is sent in the body instead, as a last frame whose flag byte has
//! its high bit set (`0x80`), holding the trailers as `name: value\r\n` lines. In the `-text`
//! variant the whole body is base64, encoded chunk by chunk (padding may appear mid-body).
//!
//! [`WebStatus`] follows a response body's frames as they pass, without keeping them, to find
//! that status; [`decode_text`] turns a `-text` request body into the bytes its messages are
//! read from.

/// The flag byte of a gRPC-web trailer frame.
const TRAILER_FRAME: u8 = 0x80;

/// A frame's header: its flag byte and 4-byte big-endian length.
const FRAME_HEADER: usize = 5;

/// The largest trailer block read: a status, a message and a few custom entries. A larger
/// one is not a status this layer can act on.
const MAX_TRAILER_BLOCK: usize = 16 * 1024;

/// Follows a gRPC-web response body's frames to the status in its trailer frame.
#[derive(Debug)]
pub(crate) struct WebStatus {
    /// For `-text` bodies: base64 characters carried to the next chunk (at most 3).
    text: Option<Vec<u8>>,
    frames: Frames,
}

#[derive(Debug)]
enum Frames {
    /// Reading a frame header; the bytes of it seen so far.
    Header {
        seen: [u8; FRAME_HEADER],
        len: usize,
    },
    /// Inside a message frame: bytes left to skip.
    Message { left: usize },
    /// Inside the trailer frame: the block so far, and bytes left.
    Trailers { block: Vec<u8>, left: usize },
    /// The trailer frame is complete, with this `grpc-status` (if it had a valid one).
    Ended { status: Option<i32> },
    /// Not a gRPC-web body (a bad flag, bytes after the trailer frame, a block too large,
    /// text that is not base64): no status can be trusted.
    Broken,
}

impl WebStatus {
    /// A watch over a binary (`text: false`) or base64 (`text: true`) body.
    pub(crate) fn new(text: bool) -> Self {
        Self {
            text: text.then(Vec::new),
            frames: Frames::Header {
                seen: [0; FRAME_HEADER],
                len: 0,
            },
        }
    }

    /// Follows the next chunk of the body.
    pub(crate) fn data(&mut self, chunk: &[u8]) {
        match &mut self.text {
            None => self.frames.bytes(chunk),
            Some(carried) => {
                carried.extend_from_slice(chunk);
                let whole = carried.len() / 4 * 4;
                match decode_quads(&carried[..whole]) {
                    Some(decoded) => self.frames.bytes(&decoded),
                    None => self.frames = Frames::Broken,
                }
                carried.drain(..whole);
            }
        }
    }

    /// True once the trailer frame is complete: the body's status is known.
    pub(crate) fn ended(&self) -> bool {
        matches!(self.frames, Frames::Ended { .. })
    }

    /// The status of a body that ended here: `None` unless its last bytes completed a trailer
    /// frame with a numeric `grpc-status`.
    pub(crate) fn status(&self) -> Option<i32> {
        let whole = self.text.as_ref().is_none_or(Vec::is_empty);
        match self.frames {
            Frames::Ended { status } if whole => status,
            _ => None,
        }
    }
}

impl Frames {
    fn bytes(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            match self {
                Frames::Header { seen, len } => {
                    let take = (FRAME_HEADER - *len).min(bytes.len());
                    seen[*len..*len + take].copy_from_slice(&bytes[..take]);
                    *len += take;
                    bytes = &bytes[take..];
                    if *len == FRAME_HEADER {
                        *self = Frames::after_header(*seen);
                    }
                }
                Frames::Message { left } => {
                    let take = (*left).min(bytes.len());
                    *left -= take;
                    bytes = &bytes[take..];
                    if *left == 0 {
                        *self = Frames::next_header();
                    }
                }
                Frames::Trailers { block, left } => {
                    let take = (*left).min(bytes.len());
                    block.extend_from_slice(&bytes[..take]);
                    *left -= take;
                    bytes = &bytes[take..];
                    if *left == 0 {
                        *self = Frames::Ended {
                            status: status_in(block),
                        };
                    }
                }
                // The trailer frame is the last one.
                Frames::Ended { .. } | Frames::Broken => {
                    *self = Frames::Broken;
                    return;
                }
            }
        }
        // A trailer frame with an empty block ends as soon as its header is read.
        if let Frames::Trailers { block, left: 0 } = self {
            *self = Frames::Ended {
                status: status_in(block),
            };
        }
    }

    fn next_header() -> Self {
        Frames::Header {
            seen: [0; FRAME_HEADER],
            len: 0,
        }
    }

    fn after_header(header: [u8; FRAME_HEADER]) -> Self {
        let [flag, length @ ..] = header;
        let Ok(left) = usize::try_from(u32::from_be_bytes(length)) else {
            return Frames::Broken;
        };
        match flag {
            // A message, compressed or not.
            0 | 1 if left == 0 => Frames::next_header(),
            0 | 1 => Frames::Message { left },
            // Trailers, uncompressed (the compressed form, 0x81, is not in use).
            TRAILER_FRAME if left <= MAX_TRAILER_BLOCK => Frames::Trailers {
                block: Vec::with_capacity(left),
                left,
            },
            _ => Frames::Broken,
        }
    }
}

/// The `grpc-status` of a trailer block (`name: value` lines, names in any case).
fn status_in(block: &[u8]) -> Option<i32> {
    block
        .split(|&byte| byte == b'\n')
        .filter_map(|line| {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            let colon = line.iter().position(|&byte| byte == b':')?;
            let (name, value) = (&line[..colon], &line[colon + 1..]);
            name.eq_ignore_ascii_case(b"grpc-status").then_some(value)
        })
        .next()
        .and_then(|value| std::str::from_utf8(value).ok()?.trim().parse().ok())
}

/// A `-text` request body decoded, for reading its message; `None` when it is not base64.
pub(crate) fn decode_text(body: &[u8]) -> Option<Vec<u8>> {
    body.len()
        .is_multiple_of(4)
        .then(|| decode_quads(body))
        .flatten()
}

/// Decodes whole groups of four base64 characters, each group padded or not (gRPC-web-text
/// encodes chunk by chunk, so padding may end any group): `None` on anything else.
fn decode_quads(text: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(text.len() / 4 * 3);
    for quad in text.chunks_exact(4) {
        let pad = quad.iter().rev().take_while(|&&c| c == b'=').count();
        if pad > 2 {
            return None;
        }
        let mut bits = 0u32;
        for &c in &quad[..4 - pad] {
            bits = bits << 6 | u32::from(sextet(c)?);
        }
        bits <<= 6 * pad;
        let bytes = bits.to_be_bytes();
        out.extend_from_slice(&bytes[1..4 - pad]);
    }
    Some(out)
}

fn sextet(c: u8) -> Option<u8> {
    match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' => Some(62),
        b'/' => Some(63),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(flag: u8, payload: &[u8]) -> Vec<u8> {
        let mut frame = vec![flag];
        frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        frame.extend_from_slice(payload);
        frame
    }

    fn body(status: &str) -> Vec<u8> {
        let trailers = format!("grpc-status:{status}\r\ngrpc-message:done\r\n");
        [
            frame(0, b"msg-1"),
            frame(0, b""),
            frame(TRAILER_FRAME, trailers.as_bytes()),
        ]
        .concat()
    }

    /// Base64 as gRPC-web-text servers send it: each chunk encoded (and padded) on its own.
    fn encode(chunk: &[u8]) -> Vec<u8> {
        const ALPHABET: &[u8; 64] =
            b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut out = Vec::new();
        for group in chunk.chunks(3) {
            let mut bits = [0u8; 3];
            bits[..group.len()].copy_from_slice(group);
            let n = u32::from_be_bytes([0, bits[0], bits[1], bits[2]]);
            for i in 0..4 {
                if i <= group.len() {
                    out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize]);
                } else {
                    out.push(b'=');
                }
            }
        }
        out
    }

    fn watched(text: bool, chunks: &[Vec<u8>]) -> WebStatus {
        let mut watch = WebStatus::new(text);
        for chunk in chunks {
            watch.data(chunk);
        }
        watch
    }

    #[test]
    fn the_status_is_read_however_the_body_is_cut() {
        let whole = body("14");
        for cut in 0..=whole.len() {
            let (a, b) = whole.split_at(cut);
            let watch = watched(false, &[a.to_vec(), b.to_vec()]);
            assert!(watch.ended(), "cut at {cut}");
            assert_eq!(watch.status(), Some(14), "cut at {cut}");
        }
        // Byte by byte.
        let bytes: Vec<_> = whole.iter().map(|&b| vec![b]).collect();
        assert_eq!(watched(false, &bytes).status(), Some(14));
    }

    #[test]
    fn text_bodies_are_decoded_chunk_by_chunk_padding_included() {
        let frames = [
            frame(0, b"msg"),
            frame(TRAILER_FRAME, b"Grpc-Status: 0\r\n"),
        ];
        // Each frame encoded apart, then the text cut anywhere.
        let text: Vec<u8> = frames.iter().flat_map(|f| encode(f)).collect();
        for cut in 0..=text.len() {
            let (a, b) = text.split_at(cut);
            assert_eq!(
                watched(true, &[a.to_vec(), b.to_vec()]).status(),
                Some(0),
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn no_status_without_a_whole_trailer_frame_at_the_end() {
        let whole = body("0");
        // Cut short, nothing after the messages, bytes after the trailers, a bad flag.
        assert_eq!(
            watched(false, &[whole[..whole.len() - 1].to_vec()]).status(),
            None
        );
        assert_eq!(watched(false, &[frame(0, b"msg")]).status(), None);
        assert_eq!(watched(false, &[whole.clone(), vec![0]]).status(), None);
        assert_eq!(watched(false, &[frame(7, b"x")]).status(), None);
        // A trailer frame without grpc-status, or with one that is not a number.
        assert_eq!(
            watched(false, &[frame(TRAILER_FRAME, b"x: 1\r\n")]).status(),
            None
        );
        assert_eq!(
            watched(false, &[frame(TRAILER_FRAME, b"grpc-status: ok\r\n")]).status(),
            None
        );
        // Text that is not base64, or that stops mid-group.
        assert_eq!(watched(true, &[b"!!!!".to_vec()]).status(), None);
        let text = encode(&whole);
        assert_eq!(
            watched(true, &[text[..text.len() - 1].to_vec()]).status(),
            None
        );
    }

    #[test]
    fn a_text_request_body_decodes_to_its_message_frame() {
        let message = frame(0, b"\x08\x01");
        assert_eq!(decode_text(&encode(&message)), Some(message));
        assert_eq!(decode_text(b"abc"), None);
        assert_eq!(decode_text(b"ab=c"), None);
        assert_eq!(decode_text(b""), Some(Vec::new()));
    }
}
