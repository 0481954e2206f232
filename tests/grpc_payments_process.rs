//! The `grpc_payments` example as a black box: a real process, a tonic client over a real
//! socket, charges counted in PostgreSQL.
//!
//! The PostgreSQL test skips itself ("skipped: TEST_POSTGRES_URL is not set") without a server;
//! `TEST_REQUIRE_ALL_BACKENDS=1` turns the skip into a failure. The binary is built on demand
//! (`tests/common/example_binary.rs`).

#[path = "common/backends.rs"]
mod backends;
#[path = "common/example_binary.rs"]
mod example_binary;
#[path = "common/grpc_metadata.rs"]
mod grpc_metadata;
#[path = "../examples/grpc_payments/messages.rs"]
mod messages;

use grpc_metadata::comparable_metadata;
use std::{
    net::SocketAddr,
    process::{ExitStatus, Stdio},
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, Instant},
};

use http::uri::PathAndQuery;
use messages::{ChargeRequest, Receipt, StatsReply, StatsRequest};
use tokio::{
    io::{AsyncBufReadExt, BufReader},
    process::{Child, Command},
    sync::Barrier,
};
use tonic::{transport::Channel, Code, Request, Status};
use tonic_prost::ProstCodec;

/// How long a start, a call or a shutdown may take before the test fails.
const PATIENCE: Duration = Duration::from_secs(20);

/// A running example; dropping it kills the process.
struct Server {
    child: Child,
    addr: SocketAddr,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Server {
    /// Starts the example on port 0 with `env` (and nothing of the caller's environment that
    /// the example reads), and waits for its start line, which names the port.
    async fn start(env: &[(&str, &str)]) -> Self {
        let mut command = Command::new(example_binary::example_binary("grpc_payments"));
        for var in [
            "BIND",
            "DATABASE_URL",
            "IDEMPOTENCY_DISABLED",
            "PAYMENTS_HANDLER_DELAY_MS",
            "LOG_FORMAT",
            "RUST_LOG",
        ] {
            command.env_remove(var);
        }
        let mut child = command
            .env("BIND", "127.0.0.1:0")
            .env("NO_COLOR", "1")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn the grpc_payments example");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let mut stdout = BufReader::new(child.stdout.take().expect("piped")).lines();
        let collected = lines.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = stdout.next_line().await {
                collected
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(line);
            }
        });
        let deadline = Instant::now() + PATIENCE;
        let addr = loop {
            const MARK: &str = "listening on http://";
            let found = lines
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .iter()
                .find_map(|line| {
                    let rest = &line[line.find(MARK)? + MARK.len()..];
                    rest.split_whitespace().next()?.parse().ok()
                });
            if let Some(addr) = found {
                break addr;
            }
            assert!(
                child.try_wait().expect("try_wait").is_none(),
                "the example exited before listening"
            );
            assert!(Instant::now() < deadline, "no start line in {PATIENCE:?}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        Self { child, addr, lines }
    }

    fn lines(&self) -> Vec<String> {
        self.lines
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// A client on a connection of its own.
    async fn client(&self) -> tonic::client::Grpc<Channel> {
        let channel = Channel::from_shared(format!("http://{}", self.addr))
            .unwrap()
            .connect()
            .await
            .expect("connect to the example");
        tonic::client::Grpc::new(channel)
    }

    /// SIGTERM, then the exit status.
    async fn terminate(mut self) -> ExitStatus {
        let pid = self.child.id().expect("running").to_string();
        let killed = std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("run kill");
        assert!(killed.success());
        tokio::time::timeout(PATIENCE, self.child.wait())
            .await
            .expect("the example exits after SIGTERM")
            .expect("wait")
    }
}

/// A reply as a duplicate must reproduce it: the receipt and the metadata (headers and
/// trailers, merged by tonic for a unary call) but `date`.
type Reply = (Receipt, Vec<(String, String)>);

/// `Charge` of 1200 EUR, from `Bearer <caller>` when given, under metadata `key` when given.
async fn charge(
    mut client: tonic::client::Grpc<Channel>,
    caller: Option<&str>,
    key: Option<&str>,
    request_id: &str,
) -> Result<Reply, Status> {
    let mut request = Request::new(ChargeRequest {
        amount_cents: 1200,
        currency: "EUR".to_owned(),
        request_id: request_id.to_owned(),
    });
    if let Some(caller) = caller {
        let value = format!("Bearer {caller}").parse().unwrap();
        request.metadata_mut().insert("authorization", value);
    }
    if let Some(key) = key {
        request
            .metadata_mut()
            .insert("idempotency-key", key.parse().unwrap());
    }
    client.ready().await.unwrap();
    let path = PathAndQuery::from_static(messages::CHARGE);
    let codec = ProstCodec::<ChargeRequest, Receipt>::default();
    let reply = tokio::time::timeout(PATIENCE, client.unary(request, path, codec))
        .await
        .expect("a charge answers in time")?;
    let metadata = comparable_metadata(reply.metadata());
    Ok((reply.into_inner(), metadata))
}

/// `Stats`: the charges the example recorded.
async fn charges(mut client: tonic::client::Grpc<Channel>) -> u64 {
    client.ready().await.unwrap();
    let path = PathAndQuery::from_static(messages::STATS);
    let codec = ProstCodec::<StatsRequest, StatsReply>::default();
    let reply = client.unary(Request::new(StatsRequest {}), path, codec);
    reply.await.expect("stats").into_inner().charges
}

fn unique(name: &str) -> String {
    format!("{name}-{:016x}", rand::random::<u64>())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thirty_two_concurrent_duplicates_charge_once_in_postgres_and_another_caller_gets_its_own()
{
    let Some(base) = backends::url_or_skip("TEST_POSTGRES_URL") else {
        return;
    };
    let admin = sqlx::PgPool::connect(&base)
        .await
        .expect("TEST_POSTGRES_URL");
    // A schema of its own: the example's tables and records, counted and dropped here alone.
    let schema = format!("grpc_payments_{:016x}", rand::random::<u64>());
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&admin)
        .await
        .expect("create schema");
    let separator = if base.contains('?') { '&' } else { '?' };
    let url = format!("{base}{separator}options=-csearch_path%3D{schema}");
    let rows = || async {
        let count: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT COUNT(*) FROM {schema}.grpc_charges"
        )))
        .fetch_one(&admin)
        .await
        .expect("count charges");
        count
    };

    // Held long enough that the 32 calls overlap the owner's.
    let server = Server::start(&[
        ("DATABASE_URL", url.as_str()),
        ("PAYMENTS_HANDLER_DELAY_MS", "200"),
    ])
    .await;
    let start_line = server.lines();
    assert!(
        start_line[0].contains("charges: postgres, idempotency: postgres, mode: transactional"),
        "{start_line:?}"
    );
    let key = unique("storm");
    let barrier = Arc::new(Barrier::new(32));
    let mut calls = Vec::new();
    for _ in 0..32 {
        let (client, key, barrier) = (server.client().await, key.clone(), barrier.clone());
        calls.push(tokio::spawn(async move {
            barrier.wait().await;
            charge(client, Some("alice"), Some(&key), "").await
        }));
    }
    let mut replies = Vec::new();
    for call in calls {
        replies.push(
            call.await
                .unwrap()
                .expect("every duplicate gets the receipt"),
        );
    }
    let alice = replies[0].clone();
    for reply in &replies {
        assert_eq!(reply, &alice, "receipt, metadata and trailers identical");
    }
    assert!(alice
        .1
        .contains(&("grpc-status".to_owned(), "0".to_owned())));
    assert_eq!(rows().await, 1, "one charge row for 32 calls of one key");

    // Keys are scoped per caller: the same key from bob is bob's own charge.
    let bob = charge(server.client().await, Some("bob"), Some(&key), "")
        .await
        .expect("bob is charged");
    assert_ne!(bob.0.charge_id, alice.0.charge_id);
    assert_eq!(rows().await, 2);
    let bob_again = charge(server.client().await, Some("bob"), Some(&key), "")
        .await
        .unwrap();
    assert_eq!(bob_again, bob, "bob's retry replays bob's receipt");
    assert_eq!(charges(server.client().await).await, 2);
    assert_eq!(rows().await, 2);

    let status = server.terminate().await;
    assert!(status.success(), "exit after SIGTERM: {status}");
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&admin)
        .await
        .expect("drop schema");
}

#[tokio::test]
async fn in_memory_a_key_and_a_caller_are_required_the_key_may_be_the_request_id_and_an_invalid_message_is_not_stored(
) {
    let server = Server::start(&[]).await;
    let key = unique("memory");

    let status = charge(server.client().await, Some("alice"), None, "")
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "no key: {status:?}");
    let status = charge(server.client().await, None, Some(&key), "")
        .await
        .unwrap_err();
    assert_eq!(
        status.code(),
        Code::Unauthenticated,
        "no caller: {status:?}"
    );
    assert_eq!(charges(server.client().await).await, 0, "nothing charged");

    // An invalid message charges nothing and is not stored: the fixed call reuses its key.
    let mut invalid = server.client().await;
    invalid.ready().await.unwrap();
    let mut request = Request::new(ChargeRequest {
        amount_cents: 0,
        currency: "EUR".to_owned(),
        request_id: String::new(),
    });
    request
        .metadata_mut()
        .insert("authorization", "Bearer carol".parse().unwrap());
    request
        .metadata_mut()
        .insert("idempotency-key", key.parse().unwrap());
    let path = PathAndQuery::from_static(messages::CHARGE);
    let codec = ProstCodec::<ChargeRequest, Receipt>::default();
    let status = invalid.unary(request, path, codec).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("amount_cents"), "{status:?}");
    charge(server.client().await, Some("carol"), Some(&key), "")
        .await
        .expect("the fixed call runs under the same key");
    assert_eq!(charges(server.client().await).await, 1);

    // AIP-155: without metadata, the message's request_id is the key.
    let first = charge(server.client().await, Some("alice"), None, &key)
        .await
        .expect("keyed by request_id");
    let again = charge(server.client().await, Some("alice"), None, &key)
        .await
        .unwrap();
    assert_eq!(again, first, "the retry replays");
    assert_eq!(charges(server.client().await).await, 2);

    let status = server.terminate().await;
    assert!(status.success(), "exit after SIGTERM: {status}");
}
