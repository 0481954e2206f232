//! Runs the `payments` example as a real process and talks to it over HTTP.
//!
//! The binary is built on demand by the first test that starts one (see
//! `tests/common/example_binary.rs`), so any `cargo test` invocation finds it fresh.
#![allow(dead_code)]

/// One `#[tokio::test]` per line, `name: open => body`: the test skips when `open` (a
/// `Shared` backend, e.g. `Shared::postgres().await`) is `None`, and runs `body` on it.
/// Reach it with `#[macro_use] mod process;`.
#[allow(unused_macros)]
macro_rules! crash_tests {
    ($($name:ident: $open:expr => $body:expr;)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            if let Some(shared) = $open {
                shared.run($body).await;
            }
        }
    )*};
}

pub mod shared;
pub mod worker;

use std::{
    net::SocketAddr,
    process::{ExitStatus, Stdio},
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, Instant},
};

use bytes::Bytes;
use http::{header, HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::{
    client::legacy::{connect::HttpConnector, Client},
    rt::TokioExecutor,
};
use tokio::{
    io::{AsyncBufReadExt, AsyncRead, BufReader},
    process::{Child, Command},
};

/// Every variable of the example's contract: cleared before a start, so that a
/// `DATABASE_URL` in the developer's shell cannot leak into a test.
const CONTRACT_VARS: &[&str] = &[
    "BIND",
    "DATABASE_URL",
    "REDIS_URL",
    "REDIS_CLUSTER_URLS",
    "REDIS_REPLICA_WAIT_MS",
    "IDEMPOTENCY_LEASE_MS",
    "IDEMPOTENCY_TTL_SECS",
    "IDEMPOTENCY_DISABLED",
    "PAYMENTS_HANDLER_DELAY_MS",
    "PAYMENTS_FAIL_FIRST",
    "PAYMENTS_DELAY_AFTER_CHARGE_MS",
    "IDEMPOTENCY_MODE",
    "AMQP_URL",
    "NATS_URL",
    "OUTBOX_RELAY",
    "OUTBOX_POLL_MS",
    "PIPELINE_NAMESPACE",
    "PROCESSOR_URL",
    "PAYMENTS_STEPS",
    "PAYMENTS_PAUSE_AT",
    "PAYMENTS_DELAY_BETWEEN_STEPS_MS",
    "RUST_LOG",
];

/// How long any single request, start or shutdown may take before the test fails.
const PATIENCE: Duration = Duration::from_secs(20);

/// A random hex string, to keep one test run's keys, callers, schemas and files apart.
pub fn unique() -> String {
    format!("{:016x}", rand::random::<u64>())
}

#[path = "../common/example_binary.rs"]
mod example_binary;
pub use example_binary::example_binary;

/// What to start: the example with some environment variables.
#[derive(Debug, Clone, Default)]
pub struct Launch {
    env: Vec<(String, String)>,
    /// A program and its arguments that run the example (e.g. `ip netns exec NS`); empty:
    /// the example runs directly.
    prefix: Vec<String>,
    /// The example to run; `None`: `payments`.
    program: Option<&'static str>,
}

impl Launch {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn env(mut self, name: &str, value: impl ToString) -> Self {
        self.env.push((name.to_owned(), value.to_string()));
        self
    }

    pub fn envs<'a>(mut self, vars: impl IntoIterator<Item = &'a (String, String)>) -> Self {
        self.env.extend(vars.into_iter().cloned());
        self
    }

    /// Runs the example as the last argument of `prefix` (a program that execs it, such as
    /// `ip netns exec NS`, so the pid the test kills is still the example's).
    pub fn prefix(mut self, prefix: Vec<String>) -> Self {
        self.prefix = prefix;
        self
    }

    /// Runs another example than `payments` (one that also logs `listening on http://ADDR`
    /// and answers `GET /stats`, such as `processor`).
    pub fn program(mut self, example: &'static str) -> Self {
        self.program = Some(example);
        self
    }

    /// Starts the process and waits until it answers `GET /stats`.
    ///
    /// The example binds port 0 and the test reads the port from its start line: a port
    /// picked by the test and bound later by the example could be taken in between by a
    /// parallel test, whose server would then answer in this one's place.
    pub async fn start(self) -> Server {
        let binary = example_binary(self.program.unwrap_or("payments"));
        let mut command = match self.prefix.split_first() {
            None => Command::new(binary),
            Some((program, args)) => {
                let mut command = Command::new(program);
                command.args(args).arg(binary);
                command
            }
        };
        for var in CONTRACT_VARS {
            command.env_remove(var);
        }
        command
            .env("BIND", "127.0.0.1:0")
            .env("NO_COLOR", "1")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // A failing test drops its servers: they must not outlive it.
            .kill_on_drop(true);
        let mut child = command.spawn().expect("spawn the payments example");
        let logs = Logs::default();
        logs.collect(child.stdout.take().expect("piped stdout"));
        logs.collect(child.stderr.take().expect("piped stderr"));
        let addr = listening_addr(&mut child, &logs).await;
        let mut server = Server {
            child,
            logs,
            http: Http {
                addr,
                client: Client::builder(TokioExecutor::new()).build_http(),
            },
        };
        server.wait_until_ready().await;
        server
    }
}

/// The address in the example's start line (`listening on http://ADDR ...`).
async fn listening_addr(child: &mut Child, logs: &Logs) -> SocketAddr {
    const MARK: &str = "listening on http://";
    let deadline = Instant::now() + PATIENCE;
    loop {
        let found = logs.lines().iter().find_map(|line| {
            let rest = &line[line.find(MARK)? + MARK.len()..];
            rest.split_whitespace().next()?.parse().ok()
        });
        if let Some(addr) = found {
            return addr;
        }
        if let Some(status) = child.try_wait().expect("try_wait") {
            tokio::time::sleep(Duration::from_millis(100)).await;
            panic!(
                "the example exited with {status} before listening:\n{}",
                logs.lines().join("\n")
            );
        }
        assert!(
            Instant::now() < deadline,
            "the example did not log its address within {PATIENCE:?}:\n{}",
            logs.lines().join("\n")
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The lines the process wrote to stdout and stderr, kept for assertions and failure messages.
#[derive(Clone, Default)]
pub struct Logs(Arc<Mutex<Vec<String>>>);

impl Logs {
    fn collect(&self, pipe: impl AsyncRead + Unpin + Send + 'static) {
        let lines = self.0.clone();
        tokio::spawn(async move {
            let mut reader = BufReader::new(pipe).lines();
            while let Ok(Some(line)) = reader.next_line().await {
                lines
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(line);
            }
        });
    }

    pub fn lines(&self) -> Vec<String> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// A running example process. Dropping it kills the process. It derefs to its [`Http`]
/// client.
pub struct Server {
    child: Child,
    pub logs: Logs,
    http: Http,
}

impl std::ops::Deref for Server {
    type Target = Http;

    fn deref(&self) -> &Http {
        &self.http
    }
}

/// An HTTP client for one server; clone it into tasks.
#[derive(Clone)]
pub struct Http {
    pub addr: SocketAddr,
    client: Client<HttpConnector, Full<Bytes>>,
}

/// A response with its body read.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn header(&self, name: impl header::AsHeaderName) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "body is not JSON ({e}): {:?}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    /// What a replay must reproduce exactly: status, body, `ETag` and `Location`.
    pub fn identity(&self) -> (StatusCode, Bytes, Option<String>, Option<String>) {
        (
            self.status,
            self.body.clone(),
            self.header(header::ETAG).map(str::to_owned),
            self.header(header::LOCATION).map(str::to_owned),
        )
    }

    /// Asserts an RFC 9457 problem with this status.
    pub fn assert_problem(&self, status: StatusCode) {
        assert_eq!(
            self.status,
            status,
            "body: {:?}",
            String::from_utf8_lossy(&self.body)
        );
        assert_eq!(
            self.header(header::CONTENT_TYPE),
            Some("application/problem+json")
        );
        let problem = self.json();
        assert_eq!(problem["status"], status.as_u16(), "{problem}");
        for field in ["type", "title", "detail"] {
            assert!(
                problem[field].is_string(),
                "problem without {field}: {problem}"
            );
        }
    }
}

/// A charge request: its key, its caller and its body.
#[derive(Debug, Clone)]
pub struct Charge {
    pub key: Option<String>,
    pub caller: Option<String>,
    pub body: String,
}

impl Charge {
    /// `{"amount": 1200, "currency": "EUR"}` from `Bearer <caller>` under `key`.
    pub fn new(key: &str, caller: &str) -> Self {
        Self {
            key: Some(key.to_owned()),
            caller: Some(caller.to_owned()),
            body: r#"{"amount": 1200, "currency": "EUR"}"#.to_owned(),
        }
    }

    pub fn body(self, body: &str) -> Self {
        Self {
            body: body.to_owned(),
            ..self
        }
    }

    pub fn without_key(self) -> Self {
        Self { key: None, ..self }
    }

    pub fn key(self, key: &str) -> Self {
        Self {
            key: Some(key.to_owned()),
            ..self
        }
    }

    pub fn without_caller(self) -> Self {
        Self {
            caller: None,
            ..self
        }
    }
}

impl Server {
    pub fn pid(&self) -> u32 {
        self.child.id().expect("the process is running")
    }

    /// A client that outlives the borrow of the server, e.g. for a spawned task.
    pub fn http(&self) -> Http {
        self.http.clone()
    }

    /// Waits up to a second for a log line containing `text` (the pipes are read by
    /// background tasks, so a line printed just now may not be there yet).
    pub async fn wait_for_log(&self, text: &str) -> Vec<String> {
        self.wait_for_log_within(text, Duration::from_secs(1)).await
    }

    /// Like [`wait_for_log`](Self::wait_for_log), with a patience of `limit`.
    pub async fn wait_for_log_within(&self, text: &str, limit: Duration) -> Vec<String> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            let lines = self.logs.lines();
            if lines.iter().any(|line| line.contains(text)) {
                return lines;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!(
            "no log line contains {text:?}:\n{}",
            self.logs.lines().join("\n")
        );
    }

    async fn wait_until_ready(&mut self) {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                // Give the log readers a moment to drain the pipes.
                tokio::time::sleep(Duration::from_millis(100)).await;
                panic!(
                    "the example exited with {status} before answering:\n{}",
                    self.logs.lines().join("\n")
                );
            }
            if let Ok(Ok(reply)) = tokio::time::timeout(
                Duration::from_secs(1),
                self.try_send(Method::GET, "/stats", &[], ""),
            )
            .await
            {
                if reply.status == StatusCode::OK {
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "the example did not answer on {} within {PATIENCE:?}:\n{}",
                self.addr,
                self.logs.lines().join("\n")
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// SIGSTOP: alive to the kernel (its sockets accept, its store sessions stay open),
    /// silent to everyone else until [`resume`](Self::resume).
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// SIGCONT after [`pause`](Self::pause).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let status = std::process::Command::new("kill")
            .args([signal, &self.pid().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {signal} {} failed", self.pid());
    }

    /// Sends SIGTERM and waits for the process to exit.
    pub async fn terminate(mut self) -> ExitStatus {
        self.signal("-TERM");
        tokio::time::timeout(PATIENCE, self.child.wait())
            .await
            .expect("the example did not exit after SIGTERM")
            .expect("wait")
    }

    /// SIGKILL: the process dies on the spot, whatever it was doing.
    pub async fn kill_9(mut self) {
        self.child.start_kill().expect("SIGKILL");
        self.child.wait().await.expect("wait");
    }

    /// How the process ended, if it did (nobody killed it: it gave up by itself).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().expect("try_wait")
    }
}

impl Http {
    async fn try_send(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Result<Reply, Box<dyn std::error::Error + Send + Sync>> {
        let mut request = Request::builder()
            .method(method)
            .uri(format!("http://{}{path}", self.addr));
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request.body(Full::new(Bytes::copy_from_slice(body.as_bytes())))?;
        let response = self.client.request(request).await?;
        let (parts, body) = response.into_parts();
        Ok(Reply {
            status: parts.status,
            headers: parts.headers,
            body: body.collect().await?.to_bytes(),
        })
    }

    /// Sends a request; a transport error or a hang fails the test.
    pub async fn send(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Reply {
        match tokio::time::timeout(PATIENCE, self.try_send(method.clone(), path, headers, body))
            .await
        {
            Ok(Ok(reply)) => reply,
            Ok(Err(error)) => panic!("{method} {path} on {} failed: {error}", self.addr),
            Err(_) => panic!(
                "{method} {path} on {} took longer than {PATIENCE:?}",
                self.addr
            ),
        }
    }

    /// `POST /payments`, with the key and `Authorization` when given.
    pub async fn charge(&self, charge: &Charge) -> Reply {
        self.try_charge(charge)
            .await
            .unwrap_or_else(|error| panic!("POST /payments on {} failed: {error}", self.addr))
    }

    /// Like [`charge`](Self::charge), but a transport error is returned (the process may be
    /// killed while the request runs).
    pub async fn try_charge(
        &self,
        charge: &Charge,
    ) -> Result<Reply, Box<dyn std::error::Error + Send + Sync>> {
        let authorization = charge
            .caller
            .as_ref()
            .map(|caller| format!("Bearer {caller}"));
        let mut headers = vec![("content-type", "application/json")];
        if let Some(key) = &charge.key {
            headers.push(("idempotency-key", key));
        }
        if let Some(authorization) = &authorization {
            headers.push(("authorization", authorization));
        }
        tokio::time::timeout(
            PATIENCE,
            self.try_send(Method::POST, "/payments", &headers, &charge.body),
        )
        .await
        .map_err(|_| format!("POST /payments took longer than {PATIENCE:?}"))?
    }

    pub async fn get(&self, path: &str) -> Reply {
        self.send(Method::GET, path, &[], "").await
    }

    /// `GET /stats`: the charges recorded in this process' payments store.
    pub async fn charges(&self) -> u64 {
        let reply = self.get("/stats").await;
        assert_eq!(reply.status, StatusCode::OK);
        reply.json()["charges"]
            .as_u64()
            .expect("charges is a number")
    }
}
