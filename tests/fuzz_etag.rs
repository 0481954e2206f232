//! Property-based fuzzing (proptest) of entity tags and `If-Match` / `If-None-Match` lists,
//! through the public API: any header bytes give a list or a typed error, never a panic;
//! generated valid tags and lists read back as themselves; weak and strong comparison obey
//! RFC 9110. The hostile inputs in `tests/fuzz/corpus/etag/` are replayed by a plain test.

use std::{fs, path::PathBuf};

use http::{header::IF_MATCH, HeaderMap, HeaderValue};
use proptest::prelude::*;
use tower_idempotency::version::{ETag, ETagList};

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 3000,
        ..ProptestConfig::default()
    }
}

/// `etagc` bytes: `%x21 / %x23-7E / %x80-FF`.
fn opaque() -> impl Strategy<Value = Vec<u8>> {
    let etagc = prop_oneof![Just(0x21u8), 0x23u8..=0x7e, 0x80u8..=0xff];
    prop::collection::vec(etagc, 0..20)
}

fn tag() -> impl Strategy<Value = ETag> {
    (any::<bool>(), opaque()).prop_map(|(weak, opaque)| {
        let tag = if weak {
            ETag::weak(&opaque)
        } else {
            ETag::strong(&opaque)
        };
        tag.expect("etagc bytes only")
    })
}

/// The header `lines` as `If-Match`, or `None` when `http` refuses one as a header value.
fn parse(lines: &[Vec<u8>]) -> Option<Result<Option<ETagList>, String>> {
    let mut headers = HeaderMap::new();
    for line in lines {
        headers.append(IF_MATCH, HeaderValue::from_bytes(line).ok()?);
    }
    Some(ETagList::from_headers(&headers, &IF_MATCH).map_err(|e| e.to_string()))
}

/// The header bytes of `tags` joined by `separator`.
fn joined(tags: &[ETag], separator: &[u8]) -> Vec<u8> {
    let values: Vec<_> = tags.iter().map(ETag::to_header_value).collect();
    values
        .iter()
        .map(|v| v.as_bytes())
        .collect::<Vec<_>>()
        .join(separator)
}

proptest! {
    #![proptest_config(config())]

    /// Any bytes as one tag: a tag that formats back to those bytes, or a typed error.
    #[test]
    fn any_bytes_parse_as_a_tag_or_a_typed_error(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
        if let Ok(tag) = ETag::parse(&bytes) {
            let value = tag.to_header_value();
            prop_assert_eq!(value.as_bytes(), bytes.as_slice());
        }
    }

    /// Any bytes over one or two header lines: a list or a typed error, never a panic; a
    /// list never holds more than the documented maximum.
    #[test]
    fn any_header_lines_give_a_list_or_a_typed_error(
        lines in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..120), 1..3),
    ) {
        match parse(&lines) {
            None | Some(Err(_)) | Some(Ok(Some(ETagList::Any))) => {}
            Some(Ok(Some(ETagList::Tags(tags)))) => {
                prop_assert!(!tags.is_empty() && tags.len() <= ETagList::MAX_TAGS);
            }
            Some(Ok(None)) => prop_assert!(false, "a present header read as absent"),
        }
    }

    /// Any bytes built from the list's own alphabet, so the parser's branches are reached
    /// far more often than by uniform bytes.
    #[test]
    fn list_shaped_bytes_give_a_list_or_a_typed_error(
        line in prop::collection::vec(prop::sample::select(b"\"W/*, \t7a\x80".to_vec()), 0..60),
    ) {
        let _ = parse(&[line]);
    }

    /// parse(format(tag)) == tag, weak or strong.
    #[test]
    fn a_formatted_tag_parses_back(tag in tag()) {
        let parsed = ETag::parse(tag.to_header_value().as_bytes());
        prop_assert_eq!(parsed, Ok(tag));
    }

    /// `Display` loses nothing: two different tags never display alike (bytes 0x80-0xFF
    /// included, which are not text), and a tag whose bytes are UTF-8 text without a
    /// backslash displays as itself, so its display parses back.
    #[test]
    fn display_tells_every_tag_apart(a in tag(), b in tag()) {
        prop_assert_eq!(a.to_string() == b.to_string(), a == b, "{} / {}", a, b);
        if std::str::from_utf8(a.opaque()).is_ok() && !a.opaque().contains(&b'\\') {
            prop_assert_eq!(ETag::parse(a.to_string()), Ok(a));
        }
    }

    /// The case uniform pairs almost never hit: two tags one byte apart, both bytes obs-text.
    #[test]
    fn display_tells_obs_text_bytes_apart(
        mut opaque in opaque(),
        (x, y) in (0x80u8..=0xff, 0x80u8..=0xff).prop_filter("two bytes", |(x, y)| x != y),
    ) {
        opaque.push(x);
        let a = ETag::strong(&opaque).unwrap();
        *opaque.last_mut().unwrap() = y;
        let b = ETag::strong(&opaque).unwrap();
        prop_assert_ne!(a.to_string(), b.to_string());
    }

    /// A list of valid tags with any spacing and empty elements reads back as the same tags
    /// in order, whether on one header line or one line each.
    #[test]
    fn a_formatted_list_parses_back(
        tags in prop::collection::vec(tag(), 1..=16),
        separator in prop::sample::select(vec![&b","[..], b", ", b" ,\t", b", ,"]),
    ) {
        let one_line = parse(&[joined(&tags, separator)]).expect("valid header bytes");
        prop_assert_eq!(one_line, Ok(Some(ETagList::Tags(tags.clone()))));
        let lines: Vec<_> = tags.iter().map(|t| t.to_header_value().as_bytes().to_vec()).collect();
        prop_assert_eq!(parse(&lines).expect("valid header bytes"), Ok(Some(ETagList::Tags(tags))));
    }

    /// Strong comparison needs two strong tags; weak comparison ignores weakness; both
    /// compare the opaque bytes exactly.
    #[test]
    fn weak_and_strong_comparison(a in tag(), b in tag()) {
        prop_assert_eq!(a.weak_eq(&b), a.opaque() == b.opaque());
        prop_assert_eq!(a.strong_eq(&b), !a.is_weak() && !b.is_weak() && a.opaque() == b.opaque());
        let list = ETagList::Tags(vec![a.clone()]);
        prop_assert_eq!(list.matches_strong(&b), a.strong_eq(&b));
        prop_assert_eq!(list.matches_weak(&b), a.weak_eq(&b));
    }

}

proptest! {
    // Lists of 65+ tags are slow to generate; a few hundred cases cover the boundary.
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// One tag over the maximum is refused, not truncated.
    #[test]
    fn more_than_the_maximum_is_refused(tags in prop::collection::vec(tag(), ETagList::MAX_TAGS + 1..ETagList::MAX_TAGS + 4)) {
        prop_assert!(parse(&[joined(&tags, b",")]).expect("valid header bytes").is_err());
    }
}

/// The committed hostile inputs: files named `ok-*` parse, every other one is refused.
#[test]
fn the_etag_corpus_gives_typed_errors() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz/corpus/etag");
    let mut files: Vec<_> = fs::read_dir(&dir)
        .expect("the corpus")
        .map(|entry| entry.expect("an entry").path())
        .collect();
    files.sort();
    assert!(!files.is_empty());
    for path in files {
        let name = path
            .file_name()
            .expect("a file")
            .to_string_lossy()
            .into_owned();
        let bytes = fs::read(&path).expect("readable");
        let line = bytes.strip_suffix(b"\n").unwrap_or(&bytes).to_vec();
        let result = parse(&[line]).expect("a header value");
        assert_eq!(
            result.is_ok(),
            name.starts_with("ok-"),
            "{name}: {result:?}"
        );
    }
}
