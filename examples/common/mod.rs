//! What every example service shares, whatever it serves: its environment, the shutdown
//! signal, the log output and the drain of detached work at shutdown.
#![allow(dead_code)] // each example uses a part

use std::str::FromStr;

/// An environment variable's value; unset and empty are the same.
pub fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// A number from the environment, `default` when unset; a clear message when it is not one.
pub fn number<T: FromStr>(name: &str, default: T) -> Result<T, String> {
    match var(name) {
        None => Ok(default),
        Some(text) => text
            .parse()
            .map_err(|_| format!("{name}={text:?} is not a valid non-negative integer")),
    }
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let mut terminate =
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(signal) => signal,
            Err(_) => return std::future::pending().await,
        };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {},
        _ = terminate.recv() => {},
    }
    tracing::info!("shutting down");
}

/// Installs every example's log output on `stream`, filtered by `RUST_LOG` (else
/// `default_filter`). `LOG_FORMAT=json` writes one JSON object a line, for services that ship
/// logs; otherwise text, coloured only when `stream` is a terminal and `NO_COLOR` is unset, so
/// a log file or a pipe never holds escape codes.
pub fn init_logs<W>(default_filter: &str, stream: fn() -> W)
where
    W: std::io::Write + std::io::IsTerminal + 'static,
{
    let logs = tracing_subscriber::fmt()
        .with_writer(stream)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| default_filter.into()),
        );
    if std::env::var("LOG_FORMAT").is_ok_and(|format| format.eq_ignore_ascii_case("json")) {
        logs.json().init();
    } else {
        let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
        logs.with_ansi(stream().is_terminal() && !no_color).init();
    }
}

/// After the server stopped taking requests: waits (up to 30 s) for the work whose clients hung
/// up, which runs on detached, so it records its outcome rather than leave its key claimed
/// until the lease runs out.
pub async fn drain(engine: &tower_idempotency::Engine) {
    if tokio::time::timeout(std::time::Duration::from_secs(30), engine.drained())
        .await
        .is_err()
    {
        tracing::warn!(
            in_flight = engine.in_flight(),
            "shut down with requests still running"
        );
    }
}

/// Runs `start` (connecting to a database or a broker, creating tables) until it succeeds,
/// with a jittered backoff (100 ms doubling up to 5 s) between tries and one warning per
/// failure, for at most `STARTUP_PATIENCE_SECS` (default 60); then returns its last error.
/// A service started together with its database or broker (a deploy, a machine's boot)
/// waits for them instead of exiting.
pub async fn retry_start<T, E, F>(what: &str, mut start: impl FnMut() -> F) -> Result<T, E>
where
    E: std::fmt::Display,
    F: std::future::Future<Output = Result<T, E>>,
{
    let patience =
        std::time::Duration::from_secs(number("STARTUP_PATIENCE_SECS", 60).unwrap_or(60));
    let deadline = tokio::time::Instant::now() + patience;
    let mut backoff = tower_idempotency::broker::Backoff::default();
    loop {
        match start().await {
            Ok(value) => return Ok(value),
            Err(error) if tokio::time::Instant::now() < deadline => {
                tracing::warn!("{what} failed ({error}); trying again");
                backoff.wait().await;
            }
            Err(error) => return Err(error),
        }
    }
}
