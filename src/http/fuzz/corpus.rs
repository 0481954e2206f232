//! Replays the committed hostile inputs in `tests/fuzz/corpus/` through the parsers of this
//! module: each file is one input, and every one must give a typed answer without a panic.

use std::{fs, path::PathBuf};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};

use crate::http::{key::parse_key, replay::decode};

/// The inputs of corpus `target`, by file name (sorted, so a failure names the same file).
fn inputs(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fuzz/corpus")
        .join(target);
    let mut files: Vec<_> = fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "{} is empty", dir.display());
    files
        .into_iter()
        .map(|path| {
            let name = path
                .file_name()
                .expect("a file")
                .to_string_lossy()
                .into_owned();
            (name, fs::read(&path).expect("readable"))
        })
        .collect()
}

#[test]
fn the_record_corpus_gives_typed_errors() {
    for (name, bytes) in inputs("record") {
        // Files named `ok-*` are valid records; every other one is damaged.
        let result = decode(Bytes::from(bytes));
        assert_eq!(
            result.is_ok(),
            name.starts_with("ok-"),
            "{name}: {result:?}"
        );
    }
}

#[test]
fn the_key_corpus_gives_typed_errors() {
    let header = HeaderName::from_static("idempotency-key");
    for (name, bytes) in inputs("key") {
        // Files named `ok-*` are valid keys (one header line each, the trailing newline of
        // the file not part of it); every other one is refused.
        let line = bytes.strip_suffix(b"\n").unwrap_or(&bytes);
        let mut headers = HeaderMap::new();
        headers.append(
            &header,
            HeaderValue::from_bytes(line).expect("a header value"),
        );
        let result = parse_key(&headers, &header);
        assert_eq!(
            result.is_ok(),
            name.starts_with("ok-"),
            "{name}: {result:?}"
        );
    }
}
