//! `loadgen`: drives the `payments` example (one or several processes) with real HTTP traffic
//! and checks that idempotency held under that load.
//!
//! ```text
//! cargo run --release --example payments &
//! cargo run --release --example loadgen -- --duration 10 --concurrency 32
//! cargo run --release --example loadgen -- --requests 6400 --duplicates 64 \
//!     --target http://127.0.0.1:3001 --target http://127.0.0.1:3002
//! ```
//!
//! # What it sends
//!
//! Work is a sequence of *operations*. Each operation is sent as `--duplicates` copies at
//! once (all built first, then released together), the way a retry storm or a redelivering
//! broker would send them. `--concurrency` operations are in flight at any time, so up to
//! `concurrency x duplicates` requests are. Requests go round-robin over the targets, so the
//! copies of one key land on different processes.
//!
//! - A *create* is `POST /payments` with a fresh `Idempotency-Key` (or one drawn from
//!   `--key-space` keys, which makes later operations on a key replays) and a body that is a
//!   function of the key, so a reused key always carries the same request.
//! - A *PATCH* (a `--patch-mix` fraction of operations) moves a payment this run created to a
//!   new status with `If-Match` set to its current `ETag`. Its copies carry one fresh
//!   `Idempotency-Key` (so they must all get the same answer), or, with
//!   `--patch-without-key`, none: then they are competing updates of one version, and
//!   exactly one may win (200) while the rest get 412. A payment is PATCHed by one
//!   operation at a time, so `If-Match` is always the current version.
//!
//! # The verdict
//!
//! - Charges: `GET /stats` on the FIRST target, before and after; the difference must equal
//!   the number of distinct keys that were answered `201` (each create executed once).
//!   With several processes this only holds when they share a database.
//! - Answers: all copies of a key that got a stored (final) answer got byte-identical bodies
//!   and the same status; across operations on a reused key (`--key-space`) every `201` body
//!   has the same SHA-256.
//! - Keyless PATCH storms: exactly one `200` per operation, every other copy `412`.
//! - No request failed in transport (a lost answer leaves its key unaccounted for).
//!
//! Exit status: 0 when the verdict is OK, 1 when it fails, 2 for bad arguments or a target
//! that cannot be reached before the run.

use std::{
    collections::{BTreeMap, HashMap, VecDeque},
    process::ExitCode,
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
        Arc, Mutex, PoisonError,
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use futures_util::future::join_all;
use http::{header, Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full};
use hyper_util::{
    client::legacy::{connect::HttpConnector, Client},
    rt::TokioExecutor,
};
use sha2::{Digest, Sha256};

const HELP: &str = "\
loadgen: load and correctness check for the payments example

USAGE: loadgen [OPTIONS]

  --target URL          a payments process; repeat (or comma-separate) for several,
                        used round-robin. /stats is read from the first.
                        [default: http://127.0.0.1:3000]
  --concurrency N       operations in flight at once [default: 16]
  --duration SECS       send for this long (decimals allowed) [default: 10]
  --requests N          or: stop after N requests (rounded up to whole operations)
  --duplicates N        concurrent copies of each operation, released together [default: 1]
  --key-space N         draw create keys from N keys (reuse = replays) [default: every key new]
  --patch-mix F         fraction 0..1 of operations that PATCH a payment [default: 0]
  --patch-without-key   PATCH copies carry no Idempotency-Key: an If-Match storm
  --caller NAME         sends Authorization: Bearer NAME [default: loadgen]
  --timeout SECS        per-request limit; a request over it counts as failed [default: 30]
  --help                this text

Prints throughput, latency percentiles, status counts, for duplicate creates how much later
than the fastest copy the others answered, and a verdict. Exit 0: verdict OK; 1: verdict
FAIL; 2: bad arguments or unreachable target.";

/// What the command line asked for.
#[derive(Debug, Clone)]
struct Options {
    targets: Vec<String>,
    concurrency: usize,
    stop: Stop,
    duplicates: usize,
    key_space: Option<u64>,
    patch_mix: f64,
    patch_without_key: bool,
    caller: String,
    timeout: Duration,
}

#[derive(Debug, Clone, Copy)]
enum Stop {
    After(Duration),
    /// A number of operations (requests / duplicates, rounded up).
    Operations(u64),
}

fn parse_args(args: impl IntoIterator<Item = String>) -> Result<Option<Options>, String> {
    let mut targets = Vec::new();
    let mut options = Options {
        targets: Vec::new(),
        concurrency: 16,
        stop: Stop::After(Duration::from_secs(10)),
        duplicates: 1,
        key_space: None,
        patch_mix: 0.0,
        patch_without_key: false,
        caller: "loadgen".to_owned(),
        timeout: Duration::from_secs(30),
    };
    let mut requests = None;
    let mut args = args.into_iter();
    while let Some(flag) = args.next() {
        if flag == "--help" || flag == "-h" {
            return Ok(None);
        }
        if flag == "--patch-without-key" {
            options.patch_without_key = true;
            continue;
        }
        let value = args
            .next()
            .ok_or_else(|| format!("{flag} needs a value (see --help)"))?;
        match flag.as_str() {
            "--target" => {
                for url in value.split(',').filter(|u| !u.is_empty()) {
                    targets.push(parse_target(url)?);
                }
            }
            "--concurrency" => options.concurrency = positive(&flag, &value)? as usize,
            "--duration" => options.stop = Stop::After(seconds(&flag, &value)?),
            "--requests" => requests = Some(positive(&flag, &value)?),
            "--duplicates" => options.duplicates = positive(&flag, &value)? as usize,
            "--key-space" => options.key_space = Some(positive(&flag, &value)?),
            "--patch-mix" => {
                options.patch_mix = value
                    .parse()
                    .ok()
                    .filter(|f| (0.0..=1.0).contains(f))
                    .ok_or_else(|| format!("{flag} must be a fraction from 0 to 1"))?;
            }
            "--caller" => options.caller = value,
            "--timeout" => options.timeout = seconds(&flag, &value)?,
            _ => return Err(format!("unknown option {flag} (see --help)")),
        }
    }
    if let Some(requests) = requests {
        options.stop = Stop::Operations(requests.div_ceil(options.duplicates as u64));
    }
    options.targets = if targets.is_empty() {
        vec![parse_target("http://127.0.0.1:3000")?]
    } else {
        targets
    };
    Ok(Some(options))
}

/// `http://host:port`, without a trailing slash (paths are appended to it).
fn parse_target(url: &str) -> Result<String, String> {
    let uri: Uri = url
        .trim_end_matches('/')
        .parse()
        .map_err(|e| format!("--target {url:?}: {e}"))?;
    match (uri.scheme_str(), uri.authority()) {
        (Some("http"), Some(authority)) => Ok(format!("http://{authority}")),
        _ => Err(format!("--target {url:?}: expected http://HOST:PORT")),
    }
}

fn positive(flag: &str, value: &str) -> Result<u64, String> {
    value
        .parse()
        .ok()
        .filter(|n| *n > 0)
        .ok_or_else(|| format!("{flag} must be a positive integer, got {value:?}"))
}

fn seconds(flag: &str, value: &str) -> Result<Duration, String> {
    value
        .parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s > 0.0)
        .map(Duration::from_secs_f64)
        .ok_or_else(|| format!("{flag} must be a positive number of seconds, got {value:?}"))
}

// ---------------------------------------------------------------------------------------------
// Talking to the targets

/// One answer, read to the end.
struct Answer {
    status: StatusCode,
    etag: Option<String>,
    body: Bytes,
    latency: Duration,
}

struct Http {
    client: Client<HttpConnector, Full<Bytes>>,
    targets: Vec<String>,
    next_target: AtomicUsize,
    authorization: String,
    timeout: Duration,
}

impl Http {
    fn new(options: &Options) -> Self {
        let mut connector = HttpConnector::new();
        // Small requests and answers: without this, Nagle's algorithm adds tens of ms.
        connector.set_nodelay(true);
        Self {
            client: Client::builder(TokioExecutor::new()).build(connector),
            targets: options.targets.clone(),
            next_target: AtomicUsize::new(0),
            authorization: format!("Bearer {}", options.caller),
            timeout: options.timeout,
        }
    }

    /// Sends one request to the next target (round-robin) and reads the whole answer.
    async fn send(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: Bytes,
    ) -> Result<Answer, String> {
        let n = self.next_target.fetch_add(1, Ordering::Relaxed);
        self.send_to(n % self.targets.len(), method, path, headers, body)
            .await
    }

    async fn send_to(
        &self,
        target: usize,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: Bytes,
    ) -> Result<Answer, String> {
        let uri = format!("{}{path}", self.targets[target]);
        let mut request = Request::builder()
            .method(method)
            .uri(uri)
            .header(header::AUTHORIZATION, &self.authorization)
            .header(header::CONTENT_TYPE, "application/json");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request.body(Full::new(body)).map_err(|e| e.to_string())?;
        let started = Instant::now();
        let exchange = async {
            let response = self.client.request(request).await.map_err(|e| chain(&e))?;
            let status = response.status();
            let etag = response
                .headers()
                .get(header::ETAG)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            let body = response
                .into_body()
                .collect()
                .await
                .map_err(|e| e.to_string())?
                .to_bytes();
            Ok::<_, String>((status, etag, body))
        };
        let (status, etag, body) = tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| format!("no answer within {:?}", self.timeout))??;
        Ok(Answer {
            status,
            etag,
            body,
            latency: started.elapsed(),
        })
    }

    /// `charges` from `GET /stats` of the first target.
    async fn charges(&self) -> Result<u64, String> {
        let answer = self
            .send_to(0, Method::GET, "/stats", &[], Bytes::new())
            .await?;
        let stats: serde_json::Value = serde_json::from_slice(&answer.body)
            .map_err(|e| format!("GET /stats answered {}: {e}", answer.status))?;
        stats["charges"]
            .as_u64()
            .ok_or_else(|| format!("GET /stats has no \"charges\" number: {stats}"))
    }
}

/// An error with its causes: the legacy client's own message hides the useful part
/// ("connection refused", "connection reset") in its sources.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

// ---------------------------------------------------------------------------------------------
// Operations

/// What one run shares between its workers.
struct Run {
    http: Http,
    options: Options,
    /// A random prefix, so keys never repeat across runs against one database.
    run_id: String,
    next_operation: AtomicU64,
    deadline: Option<Instant>,
    /// Payments created by this run and not being PATCHed right now: (id, current ETag).
    idle_payments: Mutex<VecDeque<(String, String)>>,
    /// With `--key-space`: the SHA-256 of the first `201` body of each key.
    created_bodies: Mutex<HashMap<u64, [u8; 32]>>,
    patch_available: bool,
}

/// What one worker saw; merged at the end.
#[derive(Default)]
struct Tally {
    latencies_us: Vec<u64>,
    statuses: BTreeMap<u16, u64>,
    transport_errors: u64,
    first_error: Option<String>,
    /// Distinct keys answered `201` (counted once per key).
    keys_created: u64,
    /// For creates sent in several copies: how much later than the fastest copy each other
    /// copy answered. The fastest stands in for the winner: its answer left first.
    loser_lag_us: Vec<u64>,
    patch_operations: u64,
    patch_operations_one_winner: u64,
    /// Descriptions of broken promises (a few are printed).
    violations: Vec<String>,
    violation_count: u64,
}

impl Tally {
    fn violation(&mut self, what: String) {
        self.violation_count += 1;
        if self.violations.len() < 5 {
            self.violations.push(what);
        }
    }

    fn merge(&mut self, other: Tally) {
        self.latencies_us.extend(other.latencies_us);
        for (status, n) in other.statuses {
            *self.statuses.entry(status).or_default() += n;
        }
        self.transport_errors += other.transport_errors;
        self.first_error = self.first_error.take().or(other.first_error);
        self.keys_created += other.keys_created;
        self.loser_lag_us.extend(other.loser_lag_us);
        self.patch_operations += other.patch_operations;
        self.patch_operations_one_winner += other.patch_operations_one_winner;
        for v in other.violations {
            if self.violations.len() < 5 {
                self.violations.push(v);
            }
        }
        self.violation_count += other.violation_count;
    }

    /// Records the copies' statuses and latencies; returns the answers that arrived.
    fn record(&mut self, copies: Vec<Result<Answer, String>>) -> Vec<Answer> {
        let mut answers = Vec::with_capacity(copies.len());
        for copy in copies {
            match copy {
                Ok(answer) => {
                    self.latencies_us.push(micros(answer.latency));
                    *self.statuses.entry(answer.status.as_u16()).or_default() += 1;
                    answers.push(answer);
                }
                Err(error) => {
                    self.transport_errors += 1;
                    self.first_error.get_or_insert(error);
                }
            }
        }
        answers
    }
}

/// Statuses the layer stores and replays (see the README): every copy must see the same.
fn is_final(status: StatusCode) -> bool {
    !(status.is_server_error() || [408, 409, 425, 429].contains(&status.as_u16()))
}

fn micros(d: Duration) -> u64 {
    d.as_micros().try_into().unwrap_or(u64::MAX)
}

impl Run {
    async fn worker(self: Arc<Self>) -> Tally {
        let mut tally = Tally::default();
        loop {
            let n = self.next_operation.fetch_add(1, Ordering::Relaxed);
            match (self.options.stop, self.deadline) {
                (Stop::Operations(limit), _) if n >= limit => break,
                (_, Some(deadline)) if Instant::now() >= deadline => break,
                _ => {}
            }
            let wants_patch =
                self.patch_available && rand::random::<f64>() < self.options.patch_mix;
            let payment = if wants_patch {
                self.lock_idle().pop_front()
            } else {
                None
            };
            match payment {
                Some(payment) => self.patch(n, payment, &mut tally).await,
                // No payment free to PATCH yet: create one instead.
                None => self.create(n, &mut tally).await,
            }
        }
        tally
    }

    fn lock_idle(&self) -> std::sync::MutexGuard<'_, VecDeque<(String, String)>> {
        self.idle_payments
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Sends every copy at once and waits for all of them.
    async fn copies(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: Bytes,
    ) -> Vec<Result<Answer, String>> {
        let copies = (0..self.options.duplicates)
            .map(|_| self.http.send(method.clone(), path, headers, body.clone()));
        join_all(copies).await
    }

    async fn create(&self, n: u64, tally: &mut Tally) {
        let index = self.options.key_space.map_or(n, |space| n % space);
        let key = format!("lg-{}-{index}", self.run_id);
        let body = format!(
            r#"{{"amount": {}, "currency": "EUR"}}"#,
            1 + index % 1_000_000
        );
        let copies = self
            .copies(
                Method::POST,
                "/payments",
                &[("idempotency-key", &key)],
                Bytes::from(body),
            )
            .await;
        let answers = tally.record(copies);
        if answers.len() > 1 {
            // Every copy but the fastest: how much later than it did each answer?
            let mut latencies: Vec<Duration> = answers.iter().map(|a| a.latency).collect();
            latencies.sort_unstable();
            let fastest = latencies[0];
            tally
                .loser_lag_us
                .extend(latencies[1..].iter().map(|&l| micros(l - fastest)));
        }
        check_identical(&key, &answers, tally);

        let Some(created) = answers.iter().find(|a| a.status == StatusCode::CREATED) else {
            return;
        };
        let first_time = match self.options.key_space {
            None => true,
            Some(_) => {
                let digest: [u8; 32] = Sha256::digest(&created.body).into();
                let mut bodies = self
                    .created_bodies
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                match bodies.get(&index) {
                    None => {
                        bodies.insert(index, digest);
                        true
                    }
                    Some(first) if *first == digest => false,
                    Some(_) => {
                        drop(bodies);
                        tally.violation(format!(
                            "key {key}: a later 201 body differs from the first one"
                        ));
                        false
                    }
                }
            }
        };
        if first_time {
            tally.keys_created += 1;
            if let (Some(id), Some(etag)) = (payment_id(&created.body), created.etag.clone()) {
                self.lock_idle().push_back((id, etag));
            }
        }
    }

    async fn patch(&self, n: u64, (id, etag): (String, String), tally: &mut Tally) {
        const STATUSES: [&str; 3] = ["paid", "refunded", "failed"];
        let key = format!("lg-{}-patch-{n}", self.run_id);
        let body = format!(r#"{{"status": "{}"}}"#, STATUSES[n as usize % 3]);
        let mut headers = vec![("if-match", etag.as_str())];
        if !self.options.patch_without_key {
            headers.push(("idempotency-key", key.as_str()));
        }
        let path = format!("/payments/{id}");
        let copies = self
            .copies(Method::PATCH, &path, &headers, Bytes::from(body))
            .await;
        let answers = tally.record(copies);
        tally.patch_operations += 1;
        let winners = answers
            .iter()
            .filter(|a| a.status == StatusCode::OK)
            .count();
        if self.options.patch_without_key {
            let lost = answers
                .iter()
                .filter(|a| a.status == StatusCode::PRECONDITION_FAILED)
                .count();
            if winners == 1 && winners + lost == answers.len() {
                tally.patch_operations_one_winner += 1;
            } else {
                tally.violation(format!(
                    "PATCH {path} If-Match {etag}: {winners} x 200 and {} other answers, want exactly one 200 and the rest 412",
                    answers.len() - winners
                ));
            }
        } else {
            if winners > 0 {
                tally.patch_operations_one_winner += 1;
            }
            check_identical(&key, &answers, tally);
        }
        // Hand the payment back with its current version, for a later PATCH.
        let current = answers
            .iter()
            .find(|a| a.status == StatusCode::OK)
            .or_else(|| {
                answers
                    .iter()
                    .find(|a| a.status == StatusCode::PRECONDITION_FAILED)
            })
            .and_then(|a| a.etag.clone());
        if let Some(current) = current {
            self.lock_idle().push_back((id, current));
        }
    }
}

/// Every copy with a final answer must have the same status and body bytes.
fn check_identical(key: &str, answers: &[Answer], tally: &mut Tally) {
    let mut finals = answers.iter().filter(|a| is_final(a.status));
    let Some(first) = finals.next() else { return };
    if let Some(other) = finals.find(|a| a.status != first.status || a.body != first.body) {
        tally.violation(format!(
            "key {key}: copies answered differently: {} {} vs {} {}",
            first.status,
            String::from_utf8_lossy(&first.body),
            other.status,
            String::from_utf8_lossy(&other.body),
        ));
    }
}

fn payment_id(body: &[u8]) -> Option<String> {
    let json: serde_json::Value = serde_json::from_slice(body).ok()?;
    json["id"].as_str().map(str::to_owned)
}

/// Is there a PATCH route? A payment we just created answers PATCH without `If-Match` with
/// 428 if there is; 404 / 405 mean the route does not exist (yet). The probe's payment joins
/// the run's pool.
async fn probe_patch(run: &Run) -> Result<bool, String> {
    let key = format!("lg-{}-probe", run.run_id);
    let created = run
        .http
        .send_to(
            0,
            Method::POST,
            "/payments",
            &[("idempotency-key", &key)],
            Bytes::from_static(br#"{"amount": 1, "currency": "EUR"}"#),
        )
        .await?;
    let (Some(id), Some(etag)) = (payment_id(&created.body), created.etag) else {
        return Err(format!(
            "the probe's POST /payments answered {}, not a payment",
            created.status
        ));
    };
    let path = format!("/payments/{id}");
    let answer = run
        .http
        .send_to(
            0,
            Method::PATCH,
            &path,
            &[],
            Bytes::from_static(br#"{"status": "paid"}"#),
        )
        .await?;
    match answer.status {
        StatusCode::NOT_FOUND | StatusCode::METHOD_NOT_ALLOWED => {
            println!(
                "patch: PATCH {path} answered {}: the PATCH route is not available, PATCH mix skipped",
                answer.status
            );
            Ok(false)
        }
        _ => {
            run.lock_idle().push_back((id, etag));
            Ok(true)
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The report

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1] as f64 / 1000.0
}

#[tokio::main]
async fn main() -> ExitCode {
    let options = match parse_args(std::env::args().skip(1)) {
        Ok(Some(options)) => options,
        Ok(None) => {
            println!("{HELP}");
            return ExitCode::SUCCESS;
        }
        Err(error) => {
            eprintln!("loadgen: {error}");
            return ExitCode::from(2);
        }
    };
    match run(options).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!("loadgen: {error}");
            ExitCode::from(2)
        }
    }
}

/// Runs the load and prints the report; `Ok(verdict)`.
async fn run(options: Options) -> Result<bool, String> {
    let mut run = Run {
        http: Http::new(&options),
        options: options.clone(),
        run_id: format!("{:016x}", rand::random::<u64>()),
        next_operation: AtomicU64::new(0),
        deadline: None,
        idle_payments: Mutex::default(),
        created_bodies: Mutex::default(),
        patch_available: false,
    };
    println!(
        "loadgen: {} target(s) {}, concurrency {}, duplicates {}, {}, patch mix {}{}",
        options.targets.len(),
        options.targets.join(" "),
        options.concurrency,
        options.duplicates,
        match options.stop {
            Stop::After(d) => format!("for {:.1} s", d.as_secs_f64()),
            Stop::Operations(n) => format!("{n} operations"),
        },
        options.patch_mix,
        if options.patch_without_key {
            " (without keys: If-Match storm)"
        } else {
            ""
        },
    );
    if options.patch_mix > 0.0 {
        run.patch_available = probe_patch(&run).await?;
    }
    let charges_before = run.http.charges().await?;

    let started = Instant::now();
    if let Stop::After(duration) = options.stop {
        run.deadline = Some(started + duration);
    }
    let run = Arc::new(run);
    let workers: Vec<_> = (0..options.concurrency)
        .map(|_| tokio::spawn(run.clone().worker()))
        .collect();
    let mut tally = Tally::default();
    for worker in workers {
        tally.merge(
            worker
                .await
                .map_err(|e| format!("a worker panicked: {e}"))?,
        );
    }
    let elapsed = started.elapsed();
    let charges_after = run.http.charges().await?;

    Ok(report(&run, tally, elapsed, charges_after - charges_before))
}

fn report(run: &Run, mut tally: Tally, elapsed: Duration, charges: u64) -> bool {
    let requests = tally.latencies_us.len() as u64 + tally.transport_errors;
    let rps = requests as f64 / elapsed.as_secs_f64();
    tally.latencies_us.sort_unstable();
    tally.loser_lag_us.sort_unstable();
    let lat = |p| percentile(&tally.latencies_us, p);
    let lag = |p| percentile(&tally.loser_lag_us, p);

    println!(
        "requests: {requests} in {:.2} s = {rps:.0} req/s",
        elapsed.as_secs_f64()
    );
    println!(
        "latency: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        lat(0.5),
        lat(0.99),
        lat(1.0)
    );
    let statuses: Vec<String> = tally
        .statuses
        .iter()
        .map(|(status, n)| format!("{status} x {n}"))
        .collect();
    println!(
        "statuses: {}{}",
        statuses.join(", "),
        match tally.transport_errors {
            0 => String::new(),
            n => format!(
                ", transport errors x {n} (first: {})",
                tally.first_error.as_deref().unwrap_or("?")
            ),
        }
    );
    if !tally.loser_lag_us.is_empty() {
        println!(
            "duplicates: the other copies answered after the fastest one by p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
            lag(0.5),
            lag(0.99),
            lag(1.0)
        );
    }
    if run.options.patch_mix > 0.0 {
        if run.patch_available {
            println!(
                "patch: {} operations, {} with {}",
                tally.patch_operations,
                tally.patch_operations_one_winner,
                if run.options.patch_without_key {
                    "exactly one 200 (the rest 412)"
                } else {
                    "a 200"
                }
            );
        } else {
            println!("patch: not measured: PATCH route not available");
        }
    }
    println!(
        "charges: {charges} recorded, {} distinct keys created",
        tally.keys_created
    );

    let mut failures = Vec::new();
    if charges != tally.keys_created {
        failures.push(format!(
            "charges {charges} != keys {} (executions per key: {:.3})",
            tally.keys_created,
            charges as f64 / tally.keys_created.max(1) as f64
        ));
    }
    if tally.violation_count > 0 {
        for violation in &tally.violations {
            println!("violation: {violation}");
        }
        failures.push(format!(
            "{} operation(s) got answers that break the contract",
            tally.violation_count,
        ));
    }
    if tally.transport_errors > 0 {
        failures.push(format!(
            "{} request(s) got no answer, so their keys cannot be accounted for",
            tally.transport_errors
        ));
    }
    let ok = failures.is_empty();
    let patch = match (run.options.patch_mix > 0.0, run.patch_available) {
        (false, _) => "none".to_owned(),
        (true, false) => "unavailable".to_owned(),
        (true, true) => format!(
            "{}/{}",
            tally.patch_operations_one_winner, tally.patch_operations
        ),
    };
    // One line for scripts (scripts/bench reads it).
    println!(
        "summary: requests={requests} seconds={:.3} rps={rps:.1} p50_ms={:.3} p99_ms={:.3} max_ms={:.3} lag_p50_ms={:.3} lag_p99_ms={:.3} lag_max_ms={:.3} charges={charges} keys={} patch={patch} errors={} verdict={}",
        elapsed.as_secs_f64(),
        lat(0.5),
        lat(0.99),
        lat(1.0),
        lag(0.5),
        lag(0.99),
        lag(1.0),
        tally.keys_created,
        tally.transport_errors,
        if ok { "OK" } else { "FAIL" },
    );
    if ok {
        println!(
            "verdict: OK: charges {charges} = keys {}; every copy of a key answered identically",
            tally.keys_created
        );
    } else {
        println!("verdict: FAIL: {}", failures.join("; "));
    }
    ok
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Option<Options>, String> {
        parse_args(args.iter().map(|a| a.to_string()))
    }

    #[test]
    fn requests_round_up_to_whole_operations() {
        let options = parse(&["--requests", "10", "--duplicates", "4"])
            .unwrap()
            .unwrap();
        assert!(matches!(options.stop, Stop::Operations(3)));
    }

    #[test]
    fn targets_repeat_or_comma_separate() {
        let options = parse(&[
            "--target",
            "http://a:1,http://b:2/",
            "--target",
            "http://c:3",
        ])
        .unwrap()
        .unwrap();
        assert_eq!(options.targets.len(), 3);
        assert!(parse(&["--target", "ftp://x"]).is_err());
        assert!(parse(&["--patch-mix", "1.5"]).is_err());
        assert!(parse(&["--help"]).unwrap().is_none());
    }

    #[test]
    fn percentiles_pick_ranks() {
        let sorted: Vec<u64> = (1..=100).map(|ms| ms * 1000).collect();
        assert_eq!(percentile(&sorted, 0.5), 50.0);
        assert_eq!(percentile(&sorted, 0.99), 99.0);
        assert_eq!(percentile(&sorted, 1.0), 100.0);
    }
}
