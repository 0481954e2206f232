//! Log output and the shutdown signal, as the HTTP `payments` example has them (its
//! `pipeline` module also carries the broker code this example does not need).

/// Installs the log output on stdout, filtered by `RUST_LOG` (else `info,sqlx=warn`).
/// `LOG_FORMAT=json` writes one JSON object a line; otherwise text, coloured only on a
/// terminal without `NO_COLOR`, so a log file or a pipe never holds escape codes.
pub fn init() {
    use std::io::IsTerminal;
    let logs = tracing_subscriber::fmt().with_env_filter(
        tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| "info,sqlx=warn".into()),
    );
    if std::env::var("LOG_FORMAT").is_ok_and(|format| format.eq_ignore_ascii_case("json")) {
        logs.json().init();
    } else {
        let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
        logs.with_ansi(std::io::stdout().is_terminal() && !no_color)
            .init();
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
