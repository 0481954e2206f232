//! SQLite database files for tests, in the system's temporary folder.
//!
//! A test cannot delete its file while its pool may still hold it open, and nothing runs after
//! the last test of a process, so each new file first sweeps away the files (and their `-wal`
//! and `-shm` companions) that earlier runs left more than an hour ago.
#![allow(dead_code)]

use std::{
    path::PathBuf,
    time::{Duration, SystemTime},
};

const PREFIX: &str = "tower-idempotency-test-";

/// A file name no other test, process or run uses, mentioning `name`.
pub fn fresh_path(name: &str) -> PathBuf {
    let dir = std::env::temp_dir();
    if let Ok(entries) = std::fs::read_dir(&dir) {
        for entry in entries.flatten() {
            let stale = entry.file_name().to_string_lossy().starts_with(PREFIX)
                && entry
                    .metadata()
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|m| SystemTime::now().duration_since(m).ok())
                    .is_some_and(|age| age > Duration::from_secs(3600));
            if stale {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    dir.join(format!("{PREFIX}{}-{nanos}-{name}.db", std::process::id()))
}
