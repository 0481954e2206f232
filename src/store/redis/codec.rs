//! The value layout of one record, and the durations Redis is given.

use std::time::Duration;

use bytes::Bytes;

use super::BACKEND;
use crate::{
    record::{Fingerprint, Record, Token},
    store::StoreError,
};

/// Bumped whenever the value layout changes; a value with another version is `Corrupt`.
const FORMAT_VERSION: u8 = 1;
const IN_PROGRESS: u8 = 0;
const COMPLETED: u8 = 1;
/// Version, state and token: the bytes the fencing scripts compare.
pub(super) const FENCE_LEN: usize = 2 + 16;
/// The fence plus the fingerprint; the payload follows.
const HEADER_LEN: usize = FENCE_LEN + 32;

/// The value of a fresh claim held by `token`.
pub(super) fn claim_value(token: Token, fingerprint: &Fingerprint) -> Vec<u8> {
    let mut value = Vec::with_capacity(HEADER_LEN);
    value.extend_from_slice(&fence(token));
    value.extend_from_slice(fingerprint.as_bytes());
    value
}

/// The bytes that identify a live claim held by `token`: the start of its value.
pub(super) fn fence(token: Token) -> [u8; FENCE_LEN] {
    header(IN_PROGRESS, token)
}

/// The start of the completed record `token` turns its claim into (the fingerprint and the
/// payload follow).
pub(super) fn completed_fence(token: Token) -> [u8; FENCE_LEN] {
    header(COMPLETED, token)
}

fn header(state: u8, token: Token) -> [u8; FENCE_LEN] {
    let mut header = [0u8; FENCE_LEN];
    header[0] = FORMAT_VERSION;
    header[1] = state;
    header[2..].copy_from_slice(&token.to_bytes());
    header
}

pub(super) fn decode(value: Vec<u8>) -> Result<Record, StoreError> {
    if value.len() < HEADER_LEN {
        return Err(corrupt(format!(
            "value has {} bytes, shorter than the {HEADER_LEN}-byte header",
            value.len()
        )));
    }
    if value[0] != FORMAT_VERSION {
        return Err(corrupt(format!(
            "value has format version {}, expected {FORMAT_VERSION}",
            value[0]
        )));
    }
    let mut fingerprint = [0u8; 32];
    fingerprint.copy_from_slice(&value[FENCE_LEN..HEADER_LEN]);
    let fingerprint = Fingerprint::from_bytes(fingerprint);
    match value[1] {
        IN_PROGRESS if value.len() == HEADER_LEN => Ok(Record::InProgress { fingerprint }),
        IN_PROGRESS => Err(corrupt("an in-progress value carries a payload".into())),
        // Bytes::from takes the Vec without copying; slicing shares it.
        COMPLETED => Ok(Record::Completed {
            fingerprint,
            payload: Bytes::from(value).slice(HEADER_LEN..),
        }),
        state => Err(corrupt(format!("value has unknown state {state}"))),
    }
}

/// A lease or retention for `PX` / `PEXPIRE`: whole milliseconds, rounded up so a sub-
/// millisecond duration does not become `0` (which Redis refuses); durations Redis cannot
/// add to its clock are a configuration error rather than a wrap-around.
pub(super) fn millis(duration: Duration) -> Result<u64, StoreError> {
    let millis = duration.as_nanos().div_ceil(1_000_000).max(1);
    u64::try_from(millis)
        .ok()
        .filter(|&millis| millis <= i64::MAX as u64 / 2)
        .ok_or_else(|| StoreError::Config(format!("duration {duration:?} is too long for Redis")))
}

fn corrupt(detail: String) -> StoreError {
    StoreError::Corrupt {
        backend: BACKEND,
        detail,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encoded(state: u8, payload: &[u8]) -> Vec<u8> {
        let mut value = vec![FORMAT_VERSION, state];
        value.extend_from_slice(&Token::random().to_bytes());
        value.extend_from_slice(Fingerprint::of([b"f".as_slice()]).as_bytes());
        value.extend_from_slice(payload);
        value
    }

    #[test]
    fn decodes_both_states() {
        assert_eq!(
            decode(encoded(IN_PROGRESS, b"")).unwrap(),
            Record::InProgress {
                fingerprint: Fingerprint::of([b"f".as_slice()])
            }
        );
        assert_eq!(
            decode(encoded(COMPLETED, b"\0body")).unwrap(),
            Record::Completed {
                fingerprint: Fingerprint::of([b"f".as_slice()]),
                payload: Bytes::from_static(b"\0body"),
            }
        );
    }

    #[test]
    fn a_claim_value_decodes_as_in_progress() {
        let fingerprint = Fingerprint::of([b"f".as_slice()]);
        assert_eq!(
            decode(claim_value(Token::random(), &fingerprint)).unwrap(),
            Record::InProgress { fingerprint }
        );
    }

    #[test]
    fn refuses_what_it_did_not_write() {
        let mut wrong_version = encoded(COMPLETED, b"x");
        wrong_version[0] = 9;
        for value in [
            Vec::new(),
            b"hello".to_vec(),
            wrong_version,
            encoded(7, b""),
            encoded(IN_PROGRESS, b"payload"),
        ] {
            assert!(
                matches!(decode(value.clone()), Err(StoreError::Corrupt { .. })),
                "{value:?} decoded"
            );
        }
    }

    #[test]
    fn millis_never_rounds_to_zero_or_wraps() {
        assert_eq!(millis(Duration::from_nanos(1)).unwrap(), 1);
        assert_eq!(millis(Duration::from_micros(1500)).unwrap(), 2);
        assert_eq!(millis(Duration::from_secs(30)).unwrap(), 30_000);
        assert!(matches!(millis(Duration::MAX), Err(StoreError::Config(_))));
    }
}
