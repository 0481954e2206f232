//! `RedisStore` on a real Redis Cluster: the conformance suite (with and without the replica
//! wait), the spread of records over the masters, and a failover measured during a storm.
//!
//! `TEST_REDIS_CLUSTER_URLS` lists the nodes of the shared cluster, comma-separated
//! (`scripts/services.sh` starts one on 127.0.0.1:7000-7005); without it these tests are
//! skipped, unless `TEST_REQUIRE_ALL_BACKENDS=1`. The failover tests start and kill (or
//! partition, with iptables) a cluster of their own (127.0.0.1:7100-7105 and 7110-7115), so
//! the shared one survives them.

mod cluster;
mod conformance;
#[path = "common/redis_prefix.rs"]
mod redis_prefix;

use std::{sync::Arc, time::Duration};

use cluster::{
    failover::{self, Fault, Mode},
    partition::Partition,
};
use redis::AsyncCommands;
use redis_prefix::test_prefix;
use tower_idempotency::{
    store::{OnEvictingPolicy, RedisStore, Store, StoreError},
    ClaimOutcome, StoreKey,
};

fn cluster_urls() -> Option<Vec<String>> {
    let urls = conformance::url_or_skip("TEST_REDIS_CLUSTER_URLS")?;
    Some(urls.split(',').map(|url| url.trim().to_owned()).collect())
}

/// A store on a NEW cluster connection, or `None` when `TEST_REDIS_CLUSTER_URLS` is unset.
/// Opening checks that no node evicts records (`maxmemory-policy noeviction` on all six).
async fn open_store(replica_wait: bool) -> Option<RedisStore> {
    let urls = cluster_urls()?;
    let mut builder = RedisStore::builder()
        .prefix(test_prefix())
        .on_evicting_policy(OnEvictingPolicy::Refuse);
    if replica_wait {
        builder = builder.wait_for_replicas(1, Duration::from_secs(1));
    }
    conformance::reachable("TEST_REDIS_CLUSTER_URLS", builder.open_cluster(&urls).await)
}

async fn open() -> Option<conformance::DynStore> {
    Some(Arc::new(open_store(false).await?))
}

/// The step journal passes the journal contract on the cluster, with an untagged prefix (the
/// journal key wraps the record key in a hash tag) and with a tagged one (it keeps the tag):
/// its script touches both keys, which a cluster refuses unless they share a slot.
///
/// mutant: the journal key is always `<record key>:steps` (no tag) -> fails on the untagged
/// prefix with `Backend { backend: "redis", source: CrossSlot: Keys in request don't hash to
/// the same slot }`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn step_journal_conformance() {
    let Some(urls) = cluster_urls() else { return };
    for prefix in [test_prefix().to_owned(), format!("{{{}}}", test_prefix())] {
        let store = RedisStore::builder()
            .prefix(prefix)
            .on_evicting_policy(OnEvictingPolicy::Refuse)
            .open_cluster(&urls)
            .await
            .unwrap();
        let journal = tower_idempotency::steps::RedisJournal::for_store(&store).unwrap();
        conformance::journal::run_all(Arc::new(store), journal).await;
    }
}

/// A cluster connection is built by asking a live node for the slot map, so a store on a
/// dead cluster cannot exist: see `open_cluster_fails_typed_on_no_nodes_or_dead_nodes`.
async fn no_store_on_a_dead_address() -> Option<conformance::DynStore> {
    None
}

conformance_tests!(open: open(), unreachable: no_store_on_a_dead_address(), exact_purge_count: false);

/// The same suite with `WAIT 1` pipelined behind every claim: nothing of the contract changes.
mod with_replica_wait {
    use crate::conformance;

    async fn open() -> Option<conformance::DynStore> {
        Some(std::sync::Arc::new(crate::open_store(true).await?))
    }

    crate::conformance_tests!(open: open(), unreachable: crate::no_store_on_a_dead_address(), exact_purge_count: false);
}

#[tokio::test]
async fn open_cluster_fails_typed_on_no_nodes_or_dead_nodes() {
    let none: [&str; 0] = [];
    let err = RedisStore::open_cluster(none).await.unwrap_err();
    assert!(matches!(err, StoreError::Config(_)), "{err:?}");

    for nodes in [vec!["redis://127.0.0.1:1"], vec!["not a url"]] {
        match RedisStore::open_cluster(&nodes).await.unwrap_err() {
            StoreError::Backend { backend, source } => {
                assert_eq!(backend, "redis");
                assert!(source.downcast_ref::<redis::RedisError>().is_some());
            }
            other => panic!("{nodes:?}: expected a backend error, got {other:?}"),
        }
    }
}

/// Records spread over every master (the key carries no hash tag), and the store follows the
/// redirects to each: every record is found again by `lookup`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_spread_over_every_master() {
    let Some(store) = open_store(false).await else {
        return;
    };
    assert!(store.is_cluster());
    let scope = conformance::fresh_scope();
    let keys: Vec<StoreKey> = (0..64)
        .map(|i| StoreKey::new(scope.clone(), format!("k{i}")))
        .collect();
    for key in &keys {
        let outcome = store
            .claim(key, &conformance::fp("a"), Duration::from_secs(60))
            .await
            .unwrap();
        assert!(matches!(outcome, ClaimOutcome::Claimed(_)));
    }
    for key in &keys {
        assert!(store.lookup(key).await.unwrap().is_some());
    }

    let urls = cluster_urls().expect("checked by open_store");
    let mut masters_with_records = 0;
    for url in &urls {
        let mut node = redis::Client::open(url.as_str())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let role: Vec<redis::Value> = redis::cmd("ROLE").query_async(&mut node).await.unwrap();
        if role.first() != Some(&redis::Value::BulkString(b"master".to_vec())) {
            continue;
        }
        let mut found = 0;
        for key in &keys {
            // A master answers only for its own slots; others redirect (an error here).
            let exists: redis::RedisResult<bool> = node.exists(store.redis_key(key)).await;
            found += usize::from(exists.unwrap_or(false));
        }
        assert!(found > 0, "master {url} holds none of the 64 records");
        masters_with_records += 1;
    }
    assert_eq!(masters_with_records, 3, "a 3-master cluster");
}

/// SIGKILL a master during a storm, once without and once with the replica wait, on a
/// throw-away cluster; prints the figures and asserts what each mode guarantees (see
/// `tests/cluster/failover.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failover_during_a_storm() {
    failovers(Fault::Kill, 7100).await;
}

/// The same storm, with the master cut from its replica and its peers (clients still reach
/// it) until a second after its replica was promoted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn partitioned_master_during_a_storm() {
    if !Partition::available() {
        assert!(
            !conformance::require_all(),
            "iptables cannot be run (root and the iptables package are needed) but \
             TEST_REQUIRE_ALL_BACKENDS=1"
        );
        eprintln!("skipped: iptables cannot be run");
        return;
    }
    failovers(Fault::Partition, 7110).await;
}

/// Runs the storm without and with the replica wait, one cluster at a time: two clusters
/// and their storms at once on two cores would slow the failovers they measure.
async fn failovers(fault: Fault, base_port: u16) {
    static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    if cluster_urls().is_none() {
        return;
    }
    let _turn = ONE_AT_A_TIME.lock().await;
    let mut figures = Vec::new();
    for mode in [Mode::NoWait, Mode::ReplicaWait] {
        let Some(result) = failover::run(mode, fault, base_port).await else {
            return;
        };
        println!("{result}");
        result.assert_guarantees();
        figures.push(result);
    }
    println!("{}", failover::table(&figures));
}
