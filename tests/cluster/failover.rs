//! A master dies (SIGKILL), or is partitioned from its replica and its peers while clients
//! still reach it, during a storm of idempotent requests; a replica takes over. Counts per
//! key how often the handler ran and what the clients saw, with and without the replica wait.
//!
//! Two layers, each over its own cluster connection, stand for two service instances (within
//! one instance a duplicate would be held back in memory and never reach the store). Every
//! key gets two clients, one per instance, 20 ms apart; each retries a 409 (after 50 ms) or a
//! 503 (after its 1 s `Retry-After`) until it
//! gets its 201. New keys start every 20 ms; the victim master is faulted after one second.
//! Once its replica was promoted, a killed victim is started again (as an orchestrator would),
//! a partitioned one is let through again a second later; either rejoins as the new master's
//! replica, and the storm goes on until a second after it is in sync.

use std::{
    collections::HashMap,
    fmt,
    sync::{Arc, Mutex, OnceLock, PoisonError},
    time::{Duration, Instant},
};

use axum::{
    body::Body,
    extract::State,
    http::{HeaderMap, Request, StatusCode},
    routing::post,
    Router,
};
use tokio::task::JoinSet;
use tower::ServiceExt;
use tower_idempotency::{store::RedisStore, Engine, IdempotencyLayer, InProgressPolicy};

use super::{in_sync_as_replica, partition::Partition, role, slot_of, Cluster};

const FAULT_AFTER: Duration = Duration::from_secs(1);
/// How long a partition outlasts the promotion: past the isolated master's own node timeout,
/// after which it refuses writes by itself.
const PARTITION_AFTER_PROMOTION: Duration = Duration::from_secs(1);
const STORM_AFTER_HEALING: Duration = Duration::from_secs(1);
/// A failover that has not happened by then fails the test.
const FAILOVER_PATIENCE: Duration = Duration::from_secs(30);
/// How long a key's clients keep retrying. Well inside the lease, so no claim expires: any
/// second run is a claim the cluster lost.
const CLIENT_PATIENCE: Duration = Duration::from_secs(10);
const LEASE: Duration = Duration::from_secs(60);
const HANDLER_TIME: Duration = Duration::from_millis(50);
/// One scope for every request, so the test can name each key's Redis key (and slot).
const SCOPE: &str = "failover";
const REPLICA_WAIT: Duration = Duration::from_millis(100);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    NoWait,
    ReplicaWait,
}

/// What happens to the victim master.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// SIGKILL, then a restart once its replica was promoted.
    Kill,
    /// Cut from its peers and its replica (clients still reach it), healed a second after
    /// its replica was promoted.
    Partition,
}

/// What one key's clients saw.
struct KeyRun {
    key: String,
    started: Instant,
    statuses: Vec<StatusCode>,
    created: bool,
}

/// The figures of one failover.
#[derive(Debug)]
pub struct Figures {
    pub mode: Mode,
    pub fault: Fault,
    pub keys: usize,
    /// Keys in the victim master's slots.
    pub keys_on_victim: usize,
    /// Keys for which some client got a 503 (the handler did not run for that request).
    pub keys_errored: usize,
    /// Keys whose handler ran twice or more.
    pub keys_ran_twice: usize,
    /// Of those, keys in a surviving master's slots (must be 0: their claims were never lost).
    pub ran_twice_elsewhere: usize,
    /// Keys whose handler never ran.
    pub keys_never_ran: usize,
    /// Keys none of whose clients got a 201 within the patience (e.g. an outcome lost with
    /// the master, leaving its replicated claim "in progress" until the lease ends).
    pub keys_without_201: usize,
    /// Keys in the victim master's slots, started after the promotion, that got their 201:
    /// proof that the store follows the failover.
    pub victim_keys_served_after_promotion: usize,
    /// Keys started once the returned victim was in sync as the new replica that got their
    /// 201 from one run: proof that the store survives the victim's return (its demotion
    /// closes its client connections) on every master, not only in the first moments.
    pub keys_served_after_resync: usize,
    pub failover_took: Duration,
    /// From the promotion until the restarted victim was in sync as the new replica.
    pub healing_took: Duration,
}

impl Figures {
    /// What each mode guarantees. Redis replication is asynchronous, so without the wait a
    /// claim can be lost with its master and a key can run twice; that is measured, not
    /// asserted. With the wait, the handler runs only under a claim a replica holds, and
    /// the replica is the one promoted, so no key runs twice (within the lease).
    pub fn assert_guarantees(&self) {
        assert!(self.keys_on_victim > 0, "{self}");
        assert!(
            self.victim_keys_served_after_promotion > 0,
            "the store never reached the promoted replica: {self}"
        );
        assert!(
            self.keys_served_after_resync > 0,
            "the store served no key once the victim was back in sync: {self}"
        );
        assert_eq!(
            self.ran_twice_elsewhere, 0,
            "a key on a surviving master ran twice: {self}"
        );
        if self.mode == Mode::ReplicaWait {
            assert_eq!(
                self.keys_ran_twice, 0,
                "a replica-acknowledged claim was lost: {self}"
            );
        }
    }
}

impl fmt::Display for Figures {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "failover {:?} {:?}: {} keys, {} on the victim master; errored (503) {}, ran \
             twice {} ({} elsewhere), never ran {}, no 201 within {:?}: {}; failover took \
             {:?}, the new replica synced {:?} later; {} victim keys served after promotion, \
             {} keys served once it was in sync",
            self.fault,
            self.mode,
            self.keys,
            self.keys_on_victim,
            self.keys_errored,
            self.keys_ran_twice,
            self.ran_twice_elsewhere,
            self.keys_never_ran,
            CLIENT_PATIENCE,
            self.keys_without_201,
            self.failover_took,
            self.healing_took,
            self.victim_keys_served_after_promotion,
            self.keys_served_after_resync,
        )
    }
}

/// The closing-note table: one row per mode.
pub fn table(figures: &[Figures]) -> String {
    let mut out = String::from(
        "| victim master | mode | keys | on the victim | keys errored (503) | keys ran twice | no 201 in 10 s | served after resync | failover | replica back in sync |\n|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for f in figures {
        out.push_str(&format!(
            "| {:?} | {:?} | {} | {} | {} | {} | {} | {} | {:.1} s | {:.1} s |\n",
            f.fault,
            f.mode,
            f.keys,
            f.keys_on_victim,
            f.keys_errored,
            f.keys_ran_twice,
            f.keys_without_201,
            f.keys_served_after_resync,
            f.failover_took.as_secs_f64(),
            f.healing_took.as_secs_f64()
        ));
    }
    out
}

type Runs = Arc<Mutex<HashMap<String, u32>>>;

async fn handler(State(runs): State<Runs>, headers: HeaderMap) -> StatusCode {
    let key = headers["idempotency-key"].to_str().unwrap().to_owned();
    *runs
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .entry(key)
        .or_default() += 1;
    tokio::time::sleep(HANDLER_TIME).await;
    StatusCode::CREATED
}

async fn instance(mode: Mode, urls: &[String], runs: Runs) -> Router {
    let mut builder = RedisStore::builder();
    if mode == Mode::ReplicaWait {
        builder = builder.wait_for_replicas(1, REPLICA_WAIT);
    }
    let store = builder.open_cluster(urls).await.expect("open the cluster");
    let engine = Engine::builder(store)
        .lease(LEASE)
        .in_progress(InProgressPolicy::Reject)
        .store_timeout(Duration::from_secs(3))
        .build()
        .expect("valid timings");
    let layer = IdempotencyLayer::from_engine(engine).scope_with(|_| SCOPE.to_owned());
    Router::new()
        .route("/op", post(handler))
        .with_state(runs)
        .layer(layer)
}

/// One client: retries until a 201 or the deadline.
async fn client(app: Router, key: String, deadline: Instant) -> (Vec<StatusCode>, bool) {
    let mut statuses = Vec::new();
    while Instant::now() < deadline {
        let request = Request::post("/op")
            .header("idempotency-key", &key)
            .body(Body::empty())
            .unwrap();
        let status = app.clone().oneshot(request).await.unwrap().status();
        statuses.push(status);
        if status == StatusCode::CREATED {
            return (statuses, true);
        }
        // As a well-behaved client: a 409 soon, a 503 after its `Retry-After` (1 s). Retrying
        // faster only piles claims onto a master that cannot take them.
        let pause = if status == StatusCode::CONFLICT {
            50
        } else {
            1000
        };
        tokio::time::sleep(Duration::from_millis(pause)).await;
    }
    (statuses, false)
}

async fn storm_key(apps: [Router; 2], key: String) -> KeyRun {
    let started = Instant::now();
    let deadline = started + CLIENT_PATIENCE;
    let [a, b] = apps;
    let first = client(a, key.clone(), deadline);
    let second = async {
        tokio::time::sleep(Duration::from_millis(20)).await;
        client(b, key.clone(), deadline).await
    };
    let ((mut statuses, a_created), (more, b_created)) = tokio::join!(first, second);
    statuses.extend(more);
    KeyRun {
        key,
        started,
        statuses,
        created: a_created || b_created,
    }
}

/// Runs one failover on a fresh cluster on `base_port..base_port + 6`; `None` when
/// `redis-server` is missing (and not required).
pub async fn run(mode: Mode, fault: Fault, base_port: u16) -> Option<Figures> {
    let mut cluster = Cluster::start(base_port).await?;
    let victim = cluster.masters().await[0];
    let replica = cluster.replica_of(victim).await;
    let victim_slots = cluster.slots_of(victim).await;
    let witness = cluster
        .ports()
        .find(|&p| p != victim && p != replica)
        .unwrap();

    let runs = Runs::default();
    let urls = cluster.urls();
    let apps = [
        instance(mode, &urls, runs.clone()).await,
        instance(mode, &urls, runs.clone()).await,
    ];
    let prefix = format!("failover-{:016x}-", rand::random::<u64>());

    let promoted: Arc<OnceLock<Instant>> = Arc::default();
    let healed: Arc<OnceLock<Instant>> = Arc::default();
    let start = Instant::now();
    let ports: Vec<u16> = cluster.ports().collect();
    let mut partition = None;
    let mut faulted_at = None;
    let mut restarted = false;
    let mut keys = JoinSet::new();
    let mut next = 0;
    loop {
        let now = Instant::now();
        if faulted_at.is_none() && now - start >= FAULT_AFTER {
            match fault {
                Fault::Kill => cluster.kill(victim),
                Fault::Partition => partition = Some(Partition::isolate(victim, replica, &ports)),
            }
            faulted_at = Some(now);
            let promoted = promoted.clone();
            tokio::spawn(async move {
                while role(replica).await.as_deref() != Some("master") {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                let _ = promoted.set(Instant::now());
            });
        }
        let rejoin = promoted.get().is_some_and(|at| match fault {
            Fault::Kill => true,
            Fault::Partition => at.elapsed() >= PARTITION_AFTER_PROMOTION,
        });
        if !restarted && rejoin {
            match fault {
                Fault::Kill => cluster.restart(victim),
                Fault::Partition => partition.take().expect("partitioned").heal(),
            }
            restarted = true;
            let healed = healed.clone();
            tokio::spawn(async move {
                while !in_sync_as_replica(victim).await {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                let _ = healed.set(Instant::now());
            });
        }
        if let Some(at) = healed.get() {
            if now - *at >= STORM_AFTER_HEALING {
                break;
            }
        }
        assert!(
            now - start < FAULT_AFTER + FAILOVER_PATIENCE,
            "{fault:?} {mode:?}: the replica {replica} of {victim} was not promoted, or {victim} did not \
             rejoin in sync, within {FAILOVER_PATIENCE:?}"
        );
        keys.spawn(storm_key(apps.clone(), format!("{prefix}{next}")));
        next += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let outcomes = keys.join_all().await;
    let faulted_at = faulted_at.expect("faulted");
    let promoted_at = *promoted.get().expect("promoted");
    let healed_at = *healed.get().expect("healed");

    // The Redis key of each request key, to find its slot; the store is only used for that.
    let naming = RedisStore::builder().open_cluster(&urls).await.unwrap();
    let runs = runs.lock().unwrap_or_else(PoisonError::into_inner).clone();
    let mut figures = Figures {
        mode,
        fault,
        keys: outcomes.len(),
        keys_on_victim: 0,
        keys_errored: 0,
        keys_ran_twice: 0,
        ran_twice_elsewhere: 0,
        keys_never_ran: 0,
        keys_without_201: 0,
        victim_keys_served_after_promotion: 0,
        keys_served_after_resync: 0,
        failover_took: promoted_at - faulted_at,
        healing_took: healed_at - promoted_at,
    };
    for outcome in &outcomes {
        let store_key = tower_idempotency::StoreKey::new(SCOPE, outcome.key.as_str());
        let slot = slot_of(witness, &naming.redis_key(&store_key)).await;
        let on_victim = victim_slots
            .iter()
            .any(|&(low, high)| (low..=high).contains(&slot));
        let ran = runs.get(&outcome.key).copied().unwrap_or(0);
        figures.keys_on_victim += usize::from(on_victim);
        figures.keys_errored +=
            usize::from(outcome.statuses.contains(&StatusCode::SERVICE_UNAVAILABLE));
        figures.keys_ran_twice += usize::from(ran >= 2);
        figures.ran_twice_elsewhere += usize::from(ran >= 2 && !on_victim);
        figures.keys_never_ran += usize::from(ran == 0);
        figures.keys_without_201 += usize::from(!outcome.created);
        figures.victim_keys_served_after_promotion +=
            usize::from(on_victim && outcome.started > promoted_at && outcome.created && ran == 1);
        figures.keys_served_after_resync +=
            usize::from(outcome.started > healed_at && outcome.created && ran == 1);
    }
    Some(figures)
}
