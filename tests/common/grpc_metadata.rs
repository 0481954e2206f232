//! A unary gRPC reply's metadata as comparable pairs, for tests that check replays are
//! identical.

/// The reply's headers and trailers (tonic merges them for a unary call) minus `date`, which
/// differs between an answer and its replay by design, sorted so that order does not matter.
pub fn comparable_metadata(metadata: &tonic::metadata::MetadataMap) -> Vec<(String, String)> {
    let mut pairs: Vec<(String, String)> = metadata
        .clone()
        .into_headers()
        .iter()
        .filter(|(name, _)| name.as_str() != "date")
        .map(|(n, v)| (n.to_string(), v.to_str().unwrap().to_owned()))
        .collect();
    pairs.sort();
    pairs
}
