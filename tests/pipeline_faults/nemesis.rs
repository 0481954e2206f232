//! The nemesis of a pipeline run: one fault at a time, at random gaps, each recorded with its
//! kind and span. The kinds come in rounds (a shuffle of all of them), so a short run sees
//! each.
//!
//! - `kill`: SIGKILL of a process (payments, relay or consumer; each in turn, in a random
//!   order), then a fresh one.
//! - `broker-outage`: every connection between the processes and the broker gone (RabbitMQ:
//!   the proxy cuts them and turns new ones away; NATS: the test's own server SIGKILLed), for
//!   `broker_outage`, then back.
//! - `database-outage`: the consumers' database out of reach for `database_outage` (the
//!   proxy in front of PostgreSQL cuts every connection and turns new ones away).
//! - `poison`: 1 to 3 outbox rows planted with a topic the broker refuses (no queue bound to
//!   it, no stream covering it), in a transaction of their own, as a producer's bug would.

use std::{
    fmt,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use rand::{seq::SliceRandom, Rng};
use sqlx::PgPool;
use tower_idempotency::outbox::{NewEvent, PgOutbox};

use super::{
    fleet::Fleet,
    links::{BrokerLink, DatabaseLink},
};

/// The topic of a poison row: nothing is bound to it on RabbitMQ; on NATS the payments
/// example routes it to a subject of its own name, which no stream covers.
pub const POISON_TOPIC: &str = "payment.poisoned";

/// A kind of fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Fault {
    Kill,
    BrokerOutage,
    DatabaseOutage,
    Poison,
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Kill => "kill",
            Self::BrokerOutage => "broker-outage",
            Self::DatabaseOutage => "database-outage",
            Self::Poison => "poison",
        })
    }
}

/// One injected fault: its kind, when, and how many it hit (the slot killed, the connections
/// turned away during a database outage, the rows planted).
#[derive(Debug, Clone)]
pub struct Injected {
    pub fault: Fault,
    pub started: Instant,
    pub ended: Instant,
    pub count: usize,
}

/// The nemesis of one run.
pub struct Nemesis {
    pub fleet: Arc<Fleet>,
    pub broker: Arc<BrokerLink>,
    pub database: Arc<DatabaseLink>,
    /// The outbox the poison rows go to, on a direct pool (not through a proxy).
    pub outbox: (PgPool, PgOutbox),
    pub kinds: Vec<Fault>,
    pub broker_outage: Duration,
    pub database_outage: Duration,
}

impl Nemesis {
    /// Injects faults until `stop`; the last one is healed before it returns. Notes the
    /// processes that ended by themselves on the way.
    pub async fn run(self, stop: Arc<AtomicBool>) -> Vec<Injected> {
        let mut injected = Vec::new();
        let mut round = Vec::new();
        let mut victims = Vec::new();
        while !stop.load(Ordering::SeqCst) {
            if round.is_empty() {
                round = self.kinds.clone();
                round.shuffle(&mut rand::rng());
            }
            let fault = round.pop().expect("a fault of this round");
            let gap = Duration::from_millis(rand::rng().random_range(300..1200));
            tokio::time::sleep(gap).await;
            self.fleet.note_exits().await;
            if stop.load(Ordering::SeqCst) {
                break;
            }
            let started = Instant::now();
            if victims.is_empty() {
                // Every process is killed once before any is killed twice.
                victims = (0..self.fleet.size()).collect();
                victims.shuffle(&mut rand::rng());
            }
            let count = self.inject(fault, &mut victims).await;
            injected.push(Injected {
                fault,
                started,
                ended: Instant::now(),
                count,
            });
        }
        self.fleet.note_exits().await;
        injected
    }

    async fn inject(&self, fault: Fault, victims: &mut Vec<usize>) -> usize {
        match fault {
            Fault::Kill => {
                let slot = victims.pop().expect("a victim of this round");
                self.fleet.kill_and_restart(slot).await;
                slot
            }
            Fault::BrokerOutage => {
                self.broker.outage(self.broker_outage).await;
                1
            }
            Fault::DatabaseOutage => self.database.outage(self.database_outage).await,
            Fault::Poison => {
                let rows = rand::rng().random_range(1..=3);
                plant_poison(&self.outbox.0, &self.outbox.1, rows).await;
                rows
            }
        }
    }
}

/// Commits `rows` outbox rows on [`POISON_TOPIC`], through the library as a producer would.
pub async fn plant_poison(pool: &PgPool, outbox: &PgOutbox, rows: usize) {
    let mut tx = pool.begin().await.expect("begin");
    for _ in 0..rows {
        let id = NewEvent::fresh_id();
        let payload = serde_json::json!({ "event_id": id, "poison": true });
        let event = NewEvent::with_id(id, POISON_TOPIC, payload.to_string());
        outbox
            .enqueue(&mut tx, &event)
            .await
            .expect("enqueue poison");
    }
    tx.commit().await.expect("commit poison");
}
