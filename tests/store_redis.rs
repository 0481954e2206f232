//! The conformance suite and Redis-specific checks against a real Redis 7.0+ server.
//!
//! Set `TEST_REDIS_URL` (for example `redis://127.0.0.1:6379`); without it the tests that need
//! a server are skipped, unless `TEST_REQUIRE_ALL_BACKENDS=1`. Every store opened here writes
//! under one prefix unique to this test process, so concurrent runs on one server never see
//! each other's keys.
//!
//! The macro's `unreachable` slot is empty on purpose: a `ConnectionManager` connects when it
//! is created, so a store pointed at a dead address cannot exist. The same typed-error check
//! runs instead in `open_on_a_dead_address_is_a_typed_backend_error` (construction fails) and
//! in `killed_connection_is_a_backend_error_then_heals` (an operation fails after the server
//! dropped the connection).

mod conformance;
#[path = "common/redis_prefix.rs"]
mod redis_prefix;
#[path = "common/redis_server.rs"]
mod redis_server;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::Bytes;
use redis::{aio::ConnectionManager, AsyncCommands};
use redis_prefix::test_prefix;
use redis_server::{free_port, PrivateServer};
use tower_idempotency::{
    store::{OnEvictingPolicy, RedisStore, ReplicaWaitTimedOut, Store, StoreError},
    ClaimOutcome, Record, StoreKey,
};

/// A store on a NEW connection manager, or `None` when `TEST_REDIS_URL` is unset. Opening
/// checks that the server never evicts records (`maxmemory-policy noeviction`): the suite
/// fails on a server that may, since every guarantee it checks would then be luck.
async fn open_store() -> Option<RedisStore> {
    let url = conformance::url_or_skip("TEST_REDIS_URL")?;
    let opened = RedisStore::builder()
        .prefix(test_prefix())
        .on_evicting_policy(OnEvictingPolicy::Refuse)
        .open(&url)
        .await;
    conformance::reachable("TEST_REDIS_URL", opened)
}

async fn open() -> Option<conformance::DynStore> {
    Some(Arc::new(open_store().await?))
}

async fn no_store_on_a_dead_address() -> Option<conformance::DynStore> {
    None
}

conformance_tests!(open: open(), unreachable: no_store_on_a_dead_address(), exact_purge_count: false);

/// A plain connection beside the store, to look at and tamper with what it wrote.
async fn raw() -> redis::aio::MultiplexedConnection {
    let url = std::env::var("TEST_REDIS_URL").expect("checked by open_store");
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

fn assert_backend_error_with_source(err: &StoreError) {
    match err {
        StoreError::Backend { backend, source } => {
            assert_eq!(*backend, "redis");
            assert!(
                source.downcast_ref::<redis::RedisError>().is_some(),
                "the RedisError must be kept as the source, got {source:?}"
            );
            assert!(err.is_unavailable());
        }
        other => panic!("expected a backend error, got {other:?}"),
    }
}

#[tokio::test]
async fn open_on_a_dead_address_is_a_typed_backend_error() {
    let start = Instant::now();
    let err = RedisStore::open("redis://127.0.0.1:1")
        .await
        .expect_err("nothing listens on port 1");
    assert_backend_error_with_source(&err);
    // redis-rs's default backoff would retry for minutes; the store's config fails fast.
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "took {:?}",
        start.elapsed()
    );

    let err = RedisStore::open("not a url").await.unwrap_err();
    assert_backend_error_with_source(&err);
}

#[tokio::test]
async fn invalid_prefix_is_a_typed_error() {
    let Some(url) = conformance::url_or_skip("TEST_REDIS_URL") else {
        return;
    };
    let client = redis::Client::open(url.as_str()).unwrap();
    let manager = ConnectionManager::new_with_config(client, RedisStore::connection_config())
        .await
        .unwrap();
    for bad in ["", "has space:", "tab\t", "newline\n", "bell\u{7}"] {
        let err = RedisStore::builder()
            .prefix(bad)
            .build(manager.clone())
            .unwrap_err();
        assert_eq!(err.prefix, bad);
        assert!(!err.reason.is_empty());
        // Opening refuses it before connecting, keeping the typed reason.
        let opened = RedisStore::builder().prefix(bad).open(&url).await;
        match opened {
            Err(StoreError::InvalidPrefix(invalid)) => assert_eq!(invalid, err),
            other => panic!("{bad:?}: {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_key_carries_no_client_key_and_server_expiry() {
    let Some(store) = open_store().await else {
        return;
    };
    let scope = conformance::fresh_scope();
    let key = StoreKey::new(scope.clone(), "raw-client-key-7f3a");
    let redis_key = store.redis_key(&key);
    let digest = &redis_key[test_prefix().len()..];
    assert!(redis_key.starts_with(test_prefix()));
    assert_eq!(digest.len(), 64);
    assert!(digest.bytes().all(|b| b.is_ascii_hexdigit()));

    let ClaimOutcome::Claimed(token) = store
        .claim(&key, &conformance::fp("a"), Duration::from_secs(30))
        .await
        .unwrap()
    else {
        panic!("a fresh key must be claimed");
    };
    let mut raw = raw().await;
    // Only the digest is in Redis: neither the key nor the scope, in any key or value.
    // SCAN, not KEYS: the server is shared, and KEYS blocks it while it walks every key.
    let keys: Vec<String> = {
        let mut found = raw
            .scan_match::<_, String>(format!("{}*", test_prefix()))
            .await
            .unwrap();
        let mut keys = Vec::new();
        while let Some(name) = found.next_item().await {
            keys.push(name.unwrap());
        }
        keys
    };
    assert!(keys.contains(&redis_key), "{keys:?}");
    for name in &keys {
        assert!(!name.contains("raw-client-key") && !name.contains(&scope));
    }
    let value: Vec<u8> = raw.get(&redis_key).await.unwrap();
    assert!(!value
        .windows(b"raw-client-key".len())
        .any(|w| w == b"raw-client-key"));

    // The claim expires by the lease, the completed record by the retention: server-side PX.
    let pttl: i64 = raw.pttl(&redis_key).await.unwrap();
    assert!((25_000..=30_000).contains(&pttl), "lease pttl {pttl}");
    store
        .complete(
            &key,
            token,
            Bytes::from_static(b"ok"),
            Duration::from_secs(600),
        )
        .await
        .unwrap();
    let pttl: i64 = raw.pttl(&redis_key).await.unwrap();
    assert!((595_000..=600_000).contains(&pttl), "retention pttl {pttl}");
    store
        .renew(&key, token, Duration::from_secs(30))
        .await
        .expect_err("a completed record is not renewable");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_value_is_reported_as_corrupt() {
    let Some(store) = open_store().await else {
        return;
    };
    let scope = conformance::fresh_scope();
    let mut raw = raw().await;
    for (name, value) in [
        ("garbage", b"not a record".to_vec()),
        ("empty", Vec::new()),
        ("future-version", {
            let mut v = vec![99u8, 1];
            v.extend_from_slice(&[0; 48]);
            v
        }),
    ] {
        let key = StoreKey::new(scope.clone(), name);
        let () = raw.set_ex(store.redis_key(&key), value, 60).await.unwrap();
        let looked_up = store.lookup(&key).await;
        assert!(
            matches!(
                looked_up,
                Err(StoreError::Corrupt {
                    backend: "redis",
                    ..
                })
            ),
            "{name}: {looked_up:?}"
        );
        let claimed = store
            .claim(&key, &conformance::fp("a"), Duration::from_secs(30))
            .await;
        assert!(
            matches!(claimed, Err(StoreError::Corrupt { .. })),
            "{name}: {claimed:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_connection_is_a_backend_error_then_heals() {
    let Some(url) = conformance::url_or_skip("TEST_REDIS_URL") else {
        return;
    };
    // Built from a manager we keep a clone of, to learn the server-side id of its connection.
    let client = redis::Client::open(url).unwrap();
    let mut manager = ConnectionManager::new_with_config(client, RedisStore::connection_config())
        .await
        .unwrap();
    let store = RedisStore::builder()
        .prefix(test_prefix())
        .build(manager.clone())
        .unwrap();
    let key = StoreKey::new(conformance::fresh_scope(), "k");
    let lease = Duration::from_secs(30);
    assert!(store.lookup(&key).await.unwrap().is_none());

    let id: i64 = redis::cmd("CLIENT")
        .arg("ID")
        .query_async(&mut manager)
        .await
        .unwrap();
    let killed: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("ID")
        .arg(id)
        .query_async(&mut raw().await)
        .await
        .unwrap();
    assert_eq!(killed, 1);

    // The next operation sees the dead connection as a typed backend error...
    let err = store
        .claim(&key, &conformance::fp("a"), lease)
        .await
        .expect_err("the connection was killed");
    assert_backend_error_with_source(&err);
    // ...and the same store reconnects by itself.
    let start = Instant::now();
    loop {
        match store.claim(&key, &conformance::fp("a"), lease).await {
            Ok(ClaimOutcome::Claimed(_)) => break,
            Ok(other) => panic!("the failed claim must not have written: {other:?}"),
            Err(err) if start.elapsed() < Duration::from_secs(5) => {
                assert_backend_error_with_source(&err);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(err) => panic!("did not reconnect within 5 s: {err}"),
        }
    }
    assert!(matches!(
        store.lookup(&key).await.unwrap(),
        Some(Record::InProgress { .. })
    ));
}

async fn open_when_up(url: &str) -> RedisStore {
    let start = Instant::now();
    loop {
        match RedisStore::builder().prefix(test_prefix()).open(url).await {
            Ok(store) => return store,
            Err(_) if start.elapsed() < Duration::from_secs(5) => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(err) => panic!("private redis-server did not come up: {err}"),
        }
    }
}

/// The server goes away and comes back (a restart, a failover): the same store fails fast
/// meanwhile and works again afterwards. Needs `redis-server` on PATH; skipped without it,
/// unless `TEST_REQUIRE_ALL_BACKENDS=1`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_survives_a_server_restart() {
    let port = free_port();
    let Some(server) = PrivateServer::start(port, &[]) else {
        return;
    };
    let store = open_when_up(&server.url()).await;
    let key = StoreKey::new(conformance::fresh_scope(), "k");
    let lease = Duration::from_secs(30);
    assert!(store.lookup(&key).await.unwrap().is_none());

    drop(server);
    for _ in 0..3 {
        let start = Instant::now();
        let err = store
            .claim(&key, &conformance::fp("a"), lease)
            .await
            .expect_err("the server is down");
        assert_backend_error_with_source(&err);
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "{:?}",
            start.elapsed()
        );
    }

    let _server = PrivateServer::start(port, &[]).expect("it started before");
    let start = Instant::now();
    loop {
        match store.claim(&key, &conformance::fp("a"), lease).await {
            Ok(outcome) => {
                assert!(matches!(outcome, ClaimOutcome::Claimed(_)));
                break;
            }
            Err(err) if start.elapsed() < Duration::from_secs(10) => {
                assert_backend_error_with_source(&err);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(err) => panic!("the store did not reconnect: {err}"),
        }
    }
}

/// The shared test server has no replica, so a claim made with a replica wait is never
/// acknowledged: it fails with a typed error naming the shortfall, and is withdrawn, so the
/// key is free again (no claim left to block the client's retry until its lease ends).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unacknowledged_claim_is_withdrawn_with_a_typed_error() {
    let Some(url) = conformance::url_or_skip("TEST_REDIS_URL") else {
        return;
    };
    let replicas: String = redis::cmd("INFO")
        .arg("replication")
        .query_async(&mut raw().await)
        .await
        .unwrap();
    assert!(
        replicas.contains("connected_slaves:0"),
        "this test needs a server without replicas: {replicas}"
    );
    let store = RedisStore::builder()
        .prefix(test_prefix())
        .wait_for_replicas(1, Duration::from_millis(50))
        .open(&url)
        .await
        .unwrap();
    let key = StoreKey::new(conformance::fresh_scope(), "k");
    let err = store
        .claim(&key, &conformance::fp("a"), Duration::from_secs(30))
        .await
        .expect_err("no replica can acknowledge the claim");
    assert!(err.is_unavailable());
    let shortfall = std::error::Error::source(&err)
        .and_then(|source| source.downcast_ref::<ReplicaWaitTimedOut>())
        .unwrap_or_else(|| panic!("expected a ReplicaWaitTimedOut source, got {err:?}"));
    assert_eq!(
        (shortfall.acknowledged, shortfall.wanted),
        (0, 1),
        "{shortfall}"
    );
    assert_eq!(
        store.lookup(&key).await.unwrap(),
        None,
        "the claim was withdrawn"
    );
    let exists: bool = raw().await.exists(store.redis_key(&key)).await.unwrap();
    assert!(!exists);
}

/// The step journal (`RedisJournal`) passes the journal contract beside this store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn step_journal_conformance() {
    let Some(store) = open_store().await else {
        return;
    };
    let journal = tower_idempotency::steps::RedisJournal::for_store(&store).unwrap();
    conformance::journal::run_all(Arc::new(store), journal).await;
}
