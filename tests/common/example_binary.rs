//! The example binaries process tests run (`payments`, `loadgen`), built on demand.
//!
//! `cargo test` does not reliably leave them in `target/<profile>/examples/`: `cargo test
//! --test <name>` builds no examples at all, and an example with `test = true` is built as a
//! test harness, not as the real program. So the first test that needs one asks cargo to build
//! it into this test binary's own target directory and profile. That is a no-op when it is
//! fresh, and it keeps a stale binary from answering for newer code.
#![allow(dead_code)]

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    process::Command,
    sync::{Mutex, OnceLock, PoisonError},
};

/// The path of example `name`, built first (once per test binary) with every feature.
pub fn example_binary(name: &str) -> PathBuf {
    static BUILT: OnceLock<Mutex<HashMap<String, PathBuf>>> = OnceLock::new();
    let mut built = BUILT
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    built
        .entry(name.to_owned())
        .or_insert_with(|| build(name))
        .clone()
}

fn build(name: &str) -> PathBuf {
    // This test binary lives in `<target>/<profile>/deps/`.
    let exe = std::env::current_exe().expect("current_exe");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("the test binary is in <target>/<profile>/deps");
    let target_dir = profile_dir.parent().expect("<target>/<profile>");
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => "dev",
        Some(other) => other,
    };
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut command = Command::new(cargo);
    // `cargo test` gives this process the variables of a running crate (CARGO_MANIFEST_DIR,
    // CARGO_PKG_*, ...). A dependency's build script that watches one of them (ring watches
    // CARGO_MANIFEST_DIR) would see it change from the plain `cargo build` before, and the
    // build would redo ring, rustls, the crate and the example (25-40 s per test binary).
    for (name, _) in std::env::vars_os() {
        let Some(name) = name.to_str() else { continue };
        if name.starts_with("CARGO_PKG_")
            || name.starts_with("CARGO_BIN_")
            || matches!(
                name,
                "CARGO_MANIFEST_DIR"
                    | "CARGO_MANIFEST_PATH"
                    | "CARGO_CRATE_NAME"
                    | "CARGO_PRIMARY_PACKAGE"
                    | "CARGO_TARGET_TMPDIR"
                    | "CARGO_RUSTC_CURRENT_DIR"
            )
        {
            command.env_remove(name);
        }
    }
    let output = command
        .args([
            "build",
            "--all-features",
            "--example",
            name,
            "--profile",
            profile,
        ])
        .arg("--target-dir")
        .arg(target_dir)
        .arg("--manifest-path")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"))
        .output()
        .expect("run cargo to build an example");
    assert!(
        output.status.success(),
        "`cargo build --example {name}` failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let path = profile_dir
        .join("examples")
        .join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    assert!(path.exists(), "cargo built no {}", path.display());
    path
}
