//! Which real servers a test may use: the one rule every test binary shares.
//!
//! A backend's URL comes from the environment (`TEST_POSTGRES_URL`, `TEST_MYSQL_URL`,
//! `TEST_REDIS_URL`, and the brokers' `TEST_AMQP_URL`, `TEST_NATS_URL`, `TEST_KAFKA_URL`,
//! `TEST_SQS_URL`). Unset means the test
//! is skipped with a note, unless `TEST_REQUIRE_ALL_BACKENDS=1`, which turns a missing server
//! into a failure.
#![allow(dead_code)]

/// True when `TEST_REQUIRE_ALL_BACKENDS=1`: a missing or unreachable server fails the test.
pub fn require_all() -> bool {
    std::env::var("TEST_REQUIRE_ALL_BACKENDS").as_deref() == Ok("1")
}

/// The server URL in `var`, or `None` (with a note on stderr) when it is unset, unless
/// [`require_all`], which makes a missing URL a failure.
pub fn url_or_skip(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(url) if !url.is_empty() => Some(url),
        _ if require_all() => panic!("{var} is not set but TEST_REQUIRE_ALL_BACKENDS=1"),
        _ => {
            eprintln!("skipped: {var} is not set");
            None
        }
    }
}

/// `result`'s value, or `None` with a note when the server named by `var` is set but
/// unreachable, unless [`require_all`], which makes that a failure.
pub fn reachable<T, E: std::fmt::Display>(var: &str, result: Result<T, E>) -> Option<T> {
    match result {
        Ok(value) => Some(value),
        Err(error) if require_all() => {
            panic!("{var} is set but the server is unreachable: {error}")
        }
        Err(error) => {
            eprintln!("skipped: {var} is set but the server is unreachable: {error}");
            None
        }
    }
}
