//! `RedisStore` at the edges, against servers of the test's own (`redis-server` on PATH) and
//! the shared one behind a proxy of the test's own (`common/proxy.rs`): a claim whose reply
//! was lost, a cluster connection rebuild that meets a silent node, servers that may evict
//! records. Skipped without
//! `redis-server` / `TEST_REDIS_URL`, unless `TEST_REQUIRE_ALL_BACKENDS=1`.

mod conformance;
#[path = "common/proxy.rs"]
mod proxy;
#[path = "common/redis_prefix.rs"]
mod redis_prefix;
#[path = "common/redis_server.rs"]
mod redis_server;

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use bytes::Bytes;
use proxy::Proxy;
use redis_prefix::test_prefix;
use redis_server::{free_port, PrivateServer};
use tower_idempotency::{
    store::{OnEvictingPolicy, RedisStore, Store, StoreError},
    ClaimOutcome, Record, StoreKey,
};

const LEASE: Duration = Duration::from_secs(30);

/// On a Redis Cluster the client resends a command whose connection dropped before its reply
/// came (`retries(3)`). A claim that Redis applied but whose reply was lost comes back from
/// the resent `SET .. NX .. GET` with this very claim as the "previous" value: it is this
/// request's claim, not someone else's, and the request runs and completes under it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_claim_whose_reply_was_lost_is_ours_after_the_retry() {
    let port = free_port();
    let proxy = Proxy::start("127.0.0.1", port).await;
    let Some(_node) = PrivateServer::one_node_cluster(port, proxy.addr().port(), &[]).await else {
        return;
    };
    let store = RedisStore::builder()
        .prefix(test_prefix())
        .open_cluster([format!("redis://{}", proxy.addr())])
        .await
        .expect("open the cluster through the proxy");
    let key = StoreKey::new(conformance::fresh_scope(), "lost-reply");

    // The SET reaches Redis; its reply does not, and the connection drops a moment later.
    proxy.hush_after(store.redis_key(&key).as_bytes(), Duration::from_millis(50));
    let outcome = store.claim(&key, &conformance::fp("a"), LEASE).await;
    proxy.wait_hushed(Duration::ZERO).await;
    let token = match outcome {
        Ok(ClaimOutcome::Claimed(token)) => token,
        other => panic!("the resent claim found its own claim and did not take it: {other:?}"),
    };
    store
        .complete(&key, token, Bytes::from_static(b"done"), LEASE)
        .await
        .expect("the claim is this request's: it completes");
    assert!(matches!(
        store.lookup(&key).await.unwrap(),
        Some(Record::Completed { payload, .. }) if payload == "done"
    ));
}

/// A single server's connection manager does not resend a command: a claim whose reply was
/// lost is a backend error (the request answers 503 and runs nothing), and the claim Redis
/// applied ends with its lease, like an owner's that died.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_server_claim_whose_reply_was_lost_is_a_backend_error() {
    let Some(url) = conformance::url_or_skip("TEST_REDIS_URL") else {
        return;
    };
    let server = redis::Client::open(url.as_str()).expect("TEST_REDIS_URL is a Redis URL");
    let address = server.get_connection_info().addr().to_string();
    let (host, port) = address.rsplit_once(':').expect("host:port");
    let proxy = Proxy::start(host, port.parse().expect("a port")).await;
    let store = RedisStore::builder()
        .prefix(test_prefix())
        .open(&format!("redis://{}", proxy.addr()))
        .await
        .expect("open through the proxy");
    let key = StoreKey::new(conformance::fresh_scope(), "lost-reply");

    proxy.hush_after(store.redis_key(&key).as_bytes(), Duration::from_millis(50));
    let outcome = store.claim(&key, &conformance::fp("a"), LEASE).await;
    proxy.wait_hushed(Duration::ZERO).await;
    assert!(
        matches!(outcome, Err(StoreError::Backend { .. })),
        "{outcome:?}"
    );
    assert!(matches!(
        store.lookup(&key).await,
        Ok(Some(Record::InProgress { .. }))
    ));
}

/// After a cluster operation that was abandoned while it waited, the store rebuilds its
/// connection in the background, one rebuild at a time. A rebuild whose node accepted the
/// connection and then never answered the slot-map query (a client built without a response
/// timeout, redis-rs's default, waits for that forever) must not keep every later rebuild
/// out: the store gives it up and the next abandoned operation rebuilds again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_rebuild_against_a_silent_node_is_given_up() {
    let port = free_port();
    let proxy = Proxy::start("127.0.0.1", port).await;
    let Some(_node) = PrivateServer::one_node_cluster(port, proxy.addr().port(), &[]).await else {
        return;
    };
    let client = redis::cluster::ClusterClientBuilder::new([format!("redis://{}", proxy.addr())])
        .build()
        .expect("a cluster client");
    let store = RedisStore::builder()
        .prefix(test_prefix())
        .open_cluster_with(client)
        .await
        .expect("open the cluster through the proxy");
    let key = StoreKey::new(conformance::fresh_scope(), "silent");
    let waited = Duration::from_millis(1500); // past the store's "abandoned" mark of 1 s

    // The store's connection goes silent: a lookup waits until it is abandoned, and the
    // rebuild that starts then meets a node that never answers its slot-map query.
    proxy.hush_after(store.redis_key(&key).as_bytes(), Duration::from_secs(3600));
    let abandoned = tokio::time::timeout(waited, store.lookup(&key));
    let silence_the_rebuild = async {
        proxy.wait_hushed(waited).await;
        proxy.hush_after(b"SLOTS", Duration::from_secs(3600));
    };
    let (abandoned, ()) = tokio::join!(abandoned, silence_the_rebuild);
    assert!(
        abandoned.is_err(),
        "the silent connection answered: {abandoned:?}"
    );
    proxy.wait_hushed(Duration::from_secs(5)).await;

    // Every operation still goes to the silent connection until a rebuild replaces it.
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        match tokio::time::timeout(waited, store.lookup(&key)).await {
            Ok(found) => {
                assert_eq!(found.expect("the rebuilt connection answers"), None);
                break;
            }
            Err(_) => assert!(
                std::time::Instant::now() < deadline,
                "no rebuild replaced the silent connection within 15 s"
            ),
        }
    }
}

/// What the store logs while the guard lives, on this thread (the test's own future).
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl Logs {
    fn capture() -> (Self, tracing::subscriber::DefaultGuard) {
        let logs = Self::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(logs.clone())
            .with_ansi(false)
            .finish();
        (logs, tracing::subscriber::set_default(subscriber))
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl std::io::Write for Logs {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Logs {
    type Writer = Logs;

    fn make_writer(&'a self) -> Logs {
        self.clone()
    }
}

/// A server whose `maxmemory-policy` evicts keys with an expiry (`volatile-*`: every record
/// has one) or any key (`allkeys-*`) is refused when the store opens, naming the policy; told
/// to warn, the store opens and logs it. `noeviction` opens without a word.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evicting_server_is_refused_unless_told_to_warn() {
    let Some(server) = PrivateServer::start_up(free_port(), &["--maxmemory", "64mb"]).await else {
        return;
    };
    let mut admin = server.connect().await.expect("connect");
    for policy in ["volatile-lru", "allkeys-lfu", "noeviction"] {
        let () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory-policy")
            .arg(policy)
            .query_async(&mut admin)
            .await
            .expect("CONFIG SET on the test's own server");
        let (logs, _guard) = Logs::capture();
        let refused = RedisStore::builder()
            .prefix(test_prefix())
            .open(&server.url())
            .await;
        let warned = RedisStore::builder()
            .prefix(test_prefix())
            .on_evicting_policy(OnEvictingPolicy::Warn)
            .open(&server.url())
            .await
            .expect("told to warn, the store opens");
        let key = StoreKey::new(conformance::fresh_scope(), policy);
        assert!(matches!(
            warned.claim(&key, &conformance::fp("a"), LEASE).await,
            Ok(ClaimOutcome::Claimed(_))
        ));
        if policy == "noeviction" {
            assert!(refused.is_ok(), "{refused:?}");
            assert!(!logs.text().contains("WARN"), "{}", logs.text());
            continue;
        }
        match refused {
            Err(StoreError::EvictingPolicy(evicting)) => {
                assert_eq!((evicting.node, evicting.policy.as_str()), (None, policy));
            }
            other => panic!("{policy}: opened or failed otherwise: {other:?}"),
        }
        let logged = logs.text();
        assert!(
            logged.contains("WARN") && logged.contains(&format!("maxmemory-policy {policy}")),
            "{policy}: {logged}"
        );
    }
}

/// Where `CONFIG` is renamed away (as managed services do), the policy cannot be read: the
/// store opens, and says in the log that it could not check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_without_config_opens_with_a_warning() {
    let Some(server) = PrivateServer::start_up(
        free_port(),
        &[
            "--maxmemory-policy",
            "allkeys-lru",
            "--rename-command",
            "CONFIG",
            "",
        ],
    )
    .await
    else {
        return;
    };
    let (logs, _guard) = Logs::capture();
    RedisStore::builder()
        .prefix(test_prefix())
        .open(&server.url())
        .await
        .expect("a policy that cannot be read is not refused");
    let logged = logs.text();
    assert!(
        logged.contains("WARN") && logged.contains("cannot read Redis's maxmemory-policy"),
        "{logged}"
    );
}

/// On a cluster every node is asked, and the one that evicts is named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evicting_cluster_node_is_refused_by_name() {
    let port = free_port();
    let Some(_node) =
        PrivateServer::one_node_cluster(port, port, &["--maxmemory-policy", "volatile-ttl"]).await
    else {
        return;
    };
    let opened = RedisStore::builder()
        .prefix(test_prefix())
        .open_cluster([format!("redis://127.0.0.1:{port}")])
        .await;
    match opened {
        Err(StoreError::EvictingPolicy(evicting)) => {
            assert_eq!(evicting.node, Some(format!("127.0.0.1:{port}")));
            assert_eq!(evicting.policy, "volatile-ttl");
        }
        other => panic!("opened or failed otherwise: {other:?}"),
    }
}
