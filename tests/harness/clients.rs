//! The clients: every key is sent twice at once, one copy to each process, and each copy
//! retries until it has a final answer (a 2xx, or a 4xx other than "in progress" and "too
//! many requests") or runs out of patience.
//!
//! Retried: 503 (store unavailable, not committed, outcome unknown), 409 in progress, any
//! other 5xx, a connection error and an attempt that hangs (a paused process accepts
//! connections and never answers). The wait honours `Retry-After`, capped to keep a short run
//! moving; a copy whose process is dead or silent switches to the other one.

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use http::{header, StatusCode};

use super::{effects::charge_of, fleet::Fleet};
use crate::process::{unique, Charge, Reply};

/// The problem type of a commit whose connection broke: it may have committed.
const OUTCOME_UNKNOWN: &str = "urn:tower-idempotency:outcome-unknown";

/// One key of a run: its charge, whose amount (unique in the run) finds its charge rows.
#[derive(Debug, Clone)]
pub struct Key {
    pub charge: Charge,
    pub amount: i64,
}

/// What a client can compare: the final status and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub status: StatusCode,
    pub body: Bytes,
}

/// One copy's history: its final answer (`None`: out of patience) and the
/// `outcome-unknown` answers it saw on the way.
#[derive(Debug, Clone)]
pub struct CopyLog {
    pub answer: Option<Answer>,
    pub outcome_unknown: usize,
    /// The status of every reply on the way, in order (a transport error or a hung attempt
    /// is not one).
    pub seen: Vec<u16>,
}

/// Both copies of a key, and when the key was in flight.
#[derive(Debug, Clone)]
pub struct KeyLog {
    pub key: Key,
    pub copies: [CopyLog; 2],
    pub started: Instant,
    pub ended: Instant,
}

/// How the clients behave.
#[derive(Debug, Clone, Copy)]
pub struct Clients {
    /// Keys in flight at once (each with its two copies).
    pub workers: usize,
    /// How long one copy may try before it gives up (the key then counts as stuck).
    pub patience: Duration,
    /// How long one attempt may hang before the copy tries again elsewhere.
    pub attempt: Duration,
}

/// What to do after one attempt.
enum Step {
    Final(Answer),
    Again { wait: Duration, switch: bool },
}

impl Clients {
    /// Sends fresh keys until `until`, `workers` at a time; returns every key's history.
    pub async fn drive(self, fleet: Arc<Fleet>, until: Instant) -> Vec<KeyLog> {
        let caller = unique();
        let next = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for _ in 0..self.workers {
            let (fleet, caller, next) = (fleet.clone(), caller.clone(), next.clone());
            tasks.push(tokio::spawn(async move {
                let mut logs = Vec::new();
                while Instant::now() < until {
                    let index = next.fetch_add(1, Ordering::SeqCst);
                    logs.push(self.both_copies(&fleet, key(index, &caller)).await);
                }
                logs
            }));
        }
        let mut logs = Vec::new();
        for task in tasks {
            logs.extend(task.await.expect("a client task"));
        }
        logs
    }

    /// The key's two copies at once, one starting at each process.
    async fn both_copies(&self, fleet: &Fleet, key: Key) -> KeyLog {
        let started = Instant::now();
        let (first, second) = tokio::join!(
            self.copy(fleet, &key.charge, 0),
            self.copy(fleet, &key.charge, 1)
        );
        KeyLog {
            key,
            copies: [first, second],
            started,
            ended: Instant::now(),
        }
    }

    /// One copy of `charge`, first sent to process `target`, retried until final.
    pub async fn copy(&self, fleet: &Fleet, charge: &Charge, mut target: usize) -> CopyLog {
        let deadline = Instant::now() + self.patience;
        let mut log = CopyLog {
            answer: None,
            outcome_unknown: 0,
            seen: Vec::new(),
        };
        while Instant::now() < deadline {
            let step = match fleet.http(target) {
                None => Step::Again {
                    wait: Duration::from_millis(50),
                    switch: true,
                },
                Some(http) => {
                    match tokio::time::timeout(self.attempt, http.try_charge(charge)).await {
                        Ok(Ok(reply)) => {
                            log.outcome_unknown += usize::from(is_outcome_unknown(&reply));
                            log.seen.push(reply.status.as_u16());
                            step(reply)
                        }
                        Ok(Err(_)) | Err(_) => Step::Again {
                            wait: Duration::from_millis(50),
                            switch: true,
                        },
                    }
                }
            };
            match step {
                Step::Final(answer) => {
                    log.answer = Some(answer);
                    return log;
                }
                Step::Again { wait, switch } => {
                    if switch {
                        target = (target + 1) % fleet.size();
                    }
                    tokio::time::sleep(wait).await;
                }
            }
        }
        log
    }
}

/// Key `index` of a run: a fresh key, and the amount `index + 1`.
fn key(index: usize, caller: &str) -> Key {
    let amount = i64::try_from(index + 1).expect("a small index");
    Key {
        charge: charge_of(amount, caller),
        amount,
    }
}

fn step(reply: Reply) -> Step {
    let status = reply.status;
    let retried = status.is_server_error()
        || status == StatusCode::CONFLICT
        || status == StatusCode::TOO_MANY_REQUESTS;
    if !retried && (status.is_success() || status.is_client_error()) {
        return Step::Final(Answer {
            status,
            body: reply.body,
        });
    }
    // Capped: a short run cannot wait the full advice, and retrying early is harmless.
    let advised = reply
        .header(header::RETRY_AFTER)
        .and_then(|secs| secs.parse::<u64>().ok())
        .map_or(Duration::from_millis(100), Duration::from_secs);
    Step::Again {
        wait: advised.min(Duration::from_millis(500)),
        switch: false,
    }
}

/// A 503 `outcome-unknown`: a commit whose connection broke.
fn is_outcome_unknown(reply: &Reply) -> bool {
    reply.status == StatusCode::SERVICE_UNAVAILABLE
        && serde_json::from_slice::<serde_json::Value>(&reply.body)
            .is_ok_and(|problem| problem["type"] == OUTCOME_UNKNOWN)
}
