//! The nemesis: one fault at a time, at random intervals, on a random process, each recorded
//! with its kind and when it lasted (the checker matches faults to the keys in flight). The
//! kinds come in rounds, each a shuffle of all of them, so that even a short run sees each.
//!
//! - `kill`: SIGKILL, then a fresh process in its place.
//! - `pause`: SIGSTOP for longer than the lease, then SIGCONT (the other process may take its
//!   keys over meanwhile, in the separate mode).
//! - `conn-kill`: the server ends every store session of both processes.
//! - `commit-kill`: the server ends the sessions that are inside an open transaction (the
//!   example's `PAYMENTS_DELAY_AFTER_CHARGE_MS` holds each one open between the charge and the
//!   statement that carries the `COMMIT`), the way to produce a commit whose outcome is
//!   unknown to its owner. Polled for a moment until one is there.

use std::{
    fmt,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use rand::{seq::SliceRandom, Rng};

use super::{fleet::Fleet, sessions::Sessions};

/// A kind of fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Fault {
    Kill,
    Pause,
    ConnKill,
    CommitKill,
    /// The database's primary SIGKILLed; its standby promoted (tests/pg_failover.rs).
    PrimaryKill,
    /// The database's primary cut from its standby and the clients; its standby promoted.
    PrimaryPartition,
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Kill => "kill",
            Self::Pause => "pause",
            Self::ConnKill => "conn-kill",
            Self::CommitKill => "commit-kill",
            Self::PrimaryKill => "primary-kill",
            Self::PrimaryPartition => "primary-partition",
        })
    }
}

/// One injected fault: its kind, its process, when, and how many sessions it ended (kills
/// of sessions only).
#[derive(Debug, Clone)]
pub struct Injected {
    pub fault: Fault,
    pub process: usize,
    pub started: Instant,
    pub ended: Instant,
    pub sessions: usize,
}

/// The nemesis of one run.
pub struct Nemesis {
    pub fleet: Arc<Fleet>,
    pub sessions: Sessions,
    /// The processes' lease: a pause outlasts it.
    pub lease: Duration,
    /// Which faults to pick from.
    pub kinds: Vec<Fault>,
}

impl Nemesis {
    /// The faults that make sense for this store: session kills need a server, and
    /// `commit-kill` a SQL server in the transactional mode.
    pub fn kinds(sessions: &Sessions, transactional: bool) -> Vec<Fault> {
        let mut kinds = vec![Fault::Kill, Fault::Pause];
        if sessions.killable() {
            kinds.push(Fault::ConnKill);
        }
        if transactional && sessions.sees_transactions() {
            kinds.push(Fault::CommitKill);
        }
        kinds
    }

    /// Injects faults until `stop`; the last one is healed before it returns.
    pub async fn run(self, stop: Arc<AtomicBool>) -> Vec<Injected> {
        let mut injected = Vec::new();
        let mut round = Vec::new();
        while !stop.load(Ordering::SeqCst) {
            if round.is_empty() {
                round = self.kinds.clone();
                round.shuffle(&mut rand::rng());
            }
            let fault = round.pop().expect("a fault of this round");
            let (gap, process) = {
                let mut rng = rand::rng();
                (
                    Duration::from_millis(rng.random_range(300..1200)),
                    rng.random_range(0..self.fleet.size()),
                )
            };
            tokio::time::sleep(gap).await;
            if stop.load(Ordering::SeqCst) {
                break;
            }
            let started = Instant::now();
            let sessions = self.inject(fault, process).await;
            injected.push(Injected {
                fault,
                process,
                started,
                ended: Instant::now(),
                sessions,
            });
        }
        injected
    }

    async fn inject(&self, fault: Fault, process: usize) -> usize {
        match fault {
            Fault::Kill => {
                self.fleet.kill_and_restart(process).await;
                0
            }
            Fault::Pause => {
                let extra = rand::rng().random_range(300..1500);
                self.fleet
                    .pause(process, self.lease + Duration::from_millis(extra))
                    .await;
                0
            }
            Fault::ConnKill => self.sessions.kill(&self.fleet.pids().await, false).await,
            Fault::PrimaryKill | Fault::PrimaryPartition => {
                unreachable!("database faults come from their own source (harness::run_with)")
            }
            Fault::CommitKill => {
                let deadline = Instant::now() + Duration::from_millis(500);
                loop {
                    let killed = self.sessions.kill(&self.fleet.pids().await, true).await;
                    if killed > 0 || Instant::now() > deadline {
                        return killed;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
    }
}
