//! The key prefix of a Redis test binary: unique to its process, so that concurrent runs on
//! one server never see each other's keys.
#![allow(dead_code)]

use std::sync::OnceLock;

/// `tower-idempotency-test:<pid>:<random>:`, the same for the whole test binary.
pub fn test_prefix() -> &'static str {
    static PREFIX: OnceLock<String> = OnceLock::new();
    PREFIX.get_or_init(|| {
        format!(
            "tower-idempotency-test:{}:{}:",
            std::process::id(),
            tower_idempotency::Token::random().to_hex()
        )
    })
}
