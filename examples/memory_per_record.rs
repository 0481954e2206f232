//! Memory per stored record of the in-process store: inserts N completed records (claim +
//! complete, distinct keys, a fresh payload each, as the layer stores responses) and reports
//! the growth of the process' resident set per record, and that minus the payload bytes.
//!
//! ```text
//! cargo run --release --example memory_per_record -- [records] [payload bytes]
//! ```
//!
//! Defaults: 1,000,000 records of 195 bytes (the size of a stored `payments` response to
//! `loadgen`: 189 bytes plus the digits of the amount, six for most keys).
//! Linux only (reads `VmRSS` from `/proc/self/status`).

use std::time::Duration;

use bytes::Bytes;
use tower_idempotency::{
    store::{MemoryStore, Store},
    ClaimOutcome, Fingerprint, StoreKey,
};

fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status (Linux)");
    let kib: u64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("a VmRSS line");
    kib * 1024
}

fn arg(position: usize, default: u64) -> u64 {
    std::env::args()
        .nth(position)
        .map(|a| a.parse().expect("a whole number"))
        .unwrap_or(default)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let records = arg(1, 1_000_000);
    let payload_len = arg(2, 195);
    // A budget that is not the limit here: this measures memory, not refusals.
    let store = MemoryStore::builder().max_bytes(u64::MAX).build();
    let fingerprint = Fingerprint::of([b"POST".as_slice(), b"/payments"]);
    // Keys are built before the baseline, so that only the store's own memory is measured.
    let keys: Vec<StoreKey> = (0..records)
        .map(|i| StoreKey::new("c2a9f1e07b3d4e55", format!("key-{i:012}")))
        .collect();
    let before = rss_bytes();
    for key in &keys {
        let ClaimOutcome::Claimed(token) = store
            .claim(key, &fingerprint, Duration::from_secs(30))
            .await
            .expect("claim")
        else {
            panic!("keys are distinct");
        };
        let payload = Bytes::from(vec![b'x'; payload_len as usize]);
        store
            .complete(key, token, payload, Duration::from_secs(86_400))
            .await
            .expect("complete");
    }
    let after = rss_bytes();
    let per_record = (after - before) as f64 / records as f64;
    println!(
        "records {records}, payload {payload_len} B: RSS {:.1} MiB -> {:.1} MiB, {per_record:.0} B per record, {:.0} B overhead beyond the payload",
        before as f64 / 1048576.0,
        after as f64 / 1048576.0,
        per_record - payload_len as f64
    );
}
