//! The fault harness (issue 24, part 4): two `payments` processes sharing one store, clients
//! that send every key twice at once and retry until a final answer, a nemesis injecting one
//! fault at a time, and a checker that counts each key's effects in the database.
//!
//! - [`fleet`]: the two processes, killed, restarted, paused, resumed;
//! - [`clients`]: the keys, their two copies and their retries;
//! - [`nemesis`]: the faults, recorded by kind ([`sessions`] ends store sessions, found by
//!   [`sockets`]);
//! - [`effects`]: the charge rows, read in the database;
//! - [`checker`]: doubles, lost, stuck and differing keys, and the table row.
#![allow(dead_code)]

pub mod checker;
pub mod clients;
pub mod effects;
pub mod fleet;
pub mod nemesis;
pub mod sessions;
pub mod sockets;

use std::{
    sync::{atomic::AtomicBool, Arc},
    time::{Duration, Instant},
};

use futures_util::{future::BoxFuture, stream, StreamExt};

use crate::process::{shared::Shared, Launch};
use checker::Report;
use clients::{Answer, Clients, KeyLog};
use fleet::Fleet;
use nemesis::{Injected, Nemesis};

/// One run: a mode, how long the clients send new keys, the processes' lease.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    pub separate: bool,
    pub duration: Duration,
    pub lease: Duration,
    /// Keys in flight at once.
    pub workers: usize,
}

impl Plan {
    /// `FAULT_HARNESS_SECS` seconds of new keys (default 10) in `mode`, with a 2 s lease.
    pub fn from_env(separate: bool) -> Self {
        let secs = std::env::var("FAULT_HARNESS_SECS")
            .ok()
            .and_then(|secs| secs.parse().ok())
            .unwrap_or(10);
        Self {
            separate,
            duration: Duration::from_secs(secs),
            lease: Duration::from_millis(2_000),
            workers: 4,
        }
    }

    pub fn mode(&self) -> &'static str {
        if self.separate {
            "separate"
        } else {
            "transactional"
        }
    }
}

/// Everything a run recorded, for the checker (and for its own test, which re-checks it with
/// a planted fault).
pub struct History {
    pub logs: Vec<KeyLog>,
    pub fresh: Vec<Option<Answer>>,
    pub faults: Vec<Injected>,
}

impl History {
    /// Checks this history against the charge rows in `shared`'s database now.
    pub async fn check(&self, shared: &Shared, plan: &Plan) -> Report {
        let charges = effects::charges(shared).await;
        checker::check(
            plan.separate,
            &self.logs,
            &self.fresh,
            &charges,
            &self.faults,
        )
    }
}

/// A source of faults other than the process nemesis (a database failover, say): given the
/// fleet and the stop flag, a task that injects faults until the flag is set, heals the last
/// one and returns what it did.
pub type Faults =
    Box<dyn FnOnce(Arc<Fleet>, Arc<AtomicBool>) -> BoxFuture<'static, Vec<Injected>> + Send>;

/// Runs `plan` on `shared`: the processes, the clients and the nemesis; then, with the
/// nemesis stopped, a fresh copy of every key.
pub async fn run(shared: &Shared, plan: &Plan) -> History {
    let sessions = sessions::Sessions::of(shared);
    let (transactional, lease) = (!plan.separate, plan.lease);
    run_with(
        shared,
        plan,
        Box::new(move |fleet, stop| {
            let nemesis = Nemesis {
                fleet,
                kinds: Nemesis::kinds(&sessions, transactional),
                sessions,
                lease,
            };
            Box::pin(nemesis.run(stop))
        }),
    )
    .await
}

/// Like [`run`], with `faults` in place of the process nemesis.
pub async fn run_with(shared: &Shared, plan: &Plan, faults: Faults) -> History {
    run_on(shared, &[Vec::new(), Vec::new()], plan, faults).await
}

/// Like [`run_with`], with one process per entry of `own_env`, each started with those
/// variables on top of `shared`'s (another `DATABASE_URL`: a node of a cluster, say).
pub async fn run_on(
    shared: &Shared,
    own_env: &[Vec<(String, String)>],
    plan: &Plan,
    faults: Faults,
) -> History {
    let launch = Launch::new()
        .envs(&shared.env())
        .env("IDEMPOTENCY_MODE", plan.mode())
        .env("IDEMPOTENCY_LEASE_MS", plan.lease.as_millis())
        // Widen the windows the faults aim at: before the charge, and between the charge and
        // its record (in the transactional mode: inside the open transaction).
        .env("PAYMENTS_HANDLER_DELAY_MS", 20)
        .env("PAYMENTS_DELAY_AFTER_CHARGE_MS", 100);
    let begun = Instant::now();
    let launches = own_env.iter().map(|env| launch.clone().envs(env)).collect();
    let fleet = Arc::new(Fleet::start(launches).await);
    let started = begun.elapsed();
    let stop = Arc::new(AtomicBool::new(false));
    let faults = tokio::spawn(faults(fleet.clone(), stop.clone()));
    let clients = Clients {
        workers: plan.workers,
        patience: Duration::from_secs(60),
        attempt: plan.lease * 2,
    };
    let logs = clients
        .drive(fleet.clone(), Instant::now() + plan.duration)
        .await;
    let driven = begun.elapsed();
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let faults = faults.await.expect("the nemesis");
    let healed = begun.elapsed();

    // No key stuck: with every fault healed, a fresh copy of each key gets its final answer
    // within a bound (a dead owner's lease, and some).
    let fresh_copy = Clients {
        patience: plan.lease * 3 + Duration::from_secs(5),
        ..clients
    };
    let fresh = stream::iter(logs.iter().enumerate())
        .map(|(i, log)| {
            let fleet = &fleet;
            async move {
                fresh_copy
                    .copy(fleet, &log.key.charge, i % fleet.size())
                    .await
                    .answer
            }
        })
        .buffered(8)
        .collect()
        .await;
    // Where a run's wall time goes, for whoever wants it shorter.
    eprintln!(
        "fault-harness: processes up at {started:?}, last key answered at {driven:?}, \
         last fault healed at {healed:?}, fresh copies done at {:?}",
        begun.elapsed()
    );
    History {
        logs,
        fresh,
        faults,
    }
}
