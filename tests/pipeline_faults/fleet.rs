//! The processes of a run: `payments` (its relay inside), a separate `outbox_relay` and two
//! `receipts` consumers, each in a slot the nemesis can SIGKILL and refill. A process that ends
//! without being killed gave up on its infrastructure: it is recorded, and not restarted (a
//! pipeline that needs a restart to carry on has failed).

use std::{
    sync::{Mutex, PoisonError},
    time::Duration,
};

use tokio::sync::watch;

use crate::process::{worker::Worker, Http, Launch, Logs, Server};

/// What runs in a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Payments,
    Relay,
    Receipts,
}

enum Running {
    Payments(Box<Server>),
    Worker(Worker),
}

struct Slot {
    role: Role,
    env: Vec<(String, String)>,
    running: tokio::sync::Mutex<Option<Running>>,
}

/// The processes, the address of the current `payments` process, and what every process ever
/// started logged (a killed one's lines included: the checker counts dead letters there).
pub struct Fleet {
    slots: Vec<Slot>,
    http: watch::Sender<Http>,
    logs: Mutex<Vec<(Role, Logs)>>,
    exits: Mutex<Vec<String>>,
}

impl Fleet {
    /// Starts `payments` with `payments_env`, then one process per entry of `others`.
    pub async fn start(
        payments_env: Vec<(String, String)>,
        others: Vec<(Role, Vec<(String, String)>)>,
    ) -> Self {
        let mut slots = vec![Slot {
            role: Role::Payments,
            env: payments_env,
            running: Default::default(),
        }];
        slots.extend(others.into_iter().map(|(role, env)| Slot {
            role,
            env,
            running: Default::default(),
        }));
        let logs = Mutex::new(Vec::new());
        let mut http = None;
        for slot in &slots {
            let running = launch(slot, &logs).await;
            if let Running::Payments(server) = &running {
                http = Some(server.http());
            }
            *slot.running.lock().await = Some(running);
        }
        Self {
            slots,
            http: watch::Sender::new(http.expect("a payments slot")),
            logs,
            exits: Mutex::default(),
        }
    }

    pub fn size(&self) -> usize {
        self.slots.len()
    }

    /// The address of whichever `payments` process is up, kept current across restarts.
    pub fn payments(&self) -> watch::Receiver<Http> {
        self.http.subscribe()
    }

    /// SIGKILL of the process in `slot`, then a fresh one.
    pub async fn kill_and_restart(&self, slot: usize) {
        let slot = &self.slots[slot];
        let mut running = slot.running.lock().await;
        match running.take() {
            Some(Running::Payments(server)) => server.kill_9().await,
            Some(Running::Worker(worker)) => worker.kill_9().await,
            // It gave up by itself earlier: recorded then, left dead.
            None => return,
        }
        let fresh = launch(slot, &self.logs).await;
        if let Running::Payments(server) = &fresh {
            self.http.send_replace(server.http());
        }
        *running = Some(fresh);
    }

    /// Records every process that ended by itself since the last look.
    pub async fn note_exits(&self) {
        for slot in &self.slots {
            let mut running = slot.running.lock().await;
            let (status, logs) = match running.as_mut() {
                Some(Running::Payments(server)) => (server.exited(), &server.logs),
                Some(Running::Worker(worker)) => (worker.exited(), &worker.logs),
                None => continue,
            };
            if let Some(status) = status {
                // Let the pipe readers catch the last lines.
                tokio::time::sleep(Duration::from_millis(100)).await;
                let last = logs.lines().into_iter().rev().take(3).collect::<Vec<_>>();
                lock(&self.exits).push(format!("{:?} exited with {status}: {last:?}", slot.role));
                *running = None;
            }
        }
    }

    /// What [`note_exits`](Self::note_exits) found so far.
    pub fn exits(&self) -> Vec<String> {
        lock(&self.exits).clone()
    }

    /// The lines containing `text` that processes in `role` ever logged.
    pub fn logged(&self, role: Role, text: &str) -> usize {
        lock(&self.logs)
            .iter()
            .filter(|(of, _)| *of == role)
            .map(|(_, logs)| logs.lines().iter().filter(|l| l.contains(text)).count())
            .sum()
    }

    /// SIGTERM to every process still running; each must exit successfully.
    pub async fn terminate(self) {
        for slot in self.slots {
            let ok = match slot.running.into_inner() {
                Some(Running::Payments(server)) => server.terminate().await.success(),
                Some(Running::Worker(worker)) => worker.terminate().await,
                None => true,
            };
            assert!(ok, "{:?} did not stop cleanly", slot.role);
        }
    }
}

async fn launch(slot: &Slot, logs: &Mutex<Vec<(Role, Logs)>>) -> Running {
    let running = match slot.role {
        Role::Payments => {
            let server = Launch::new().envs(&slot.env).start().await;
            server
                .wait_for_log_within("relayed to", Duration::from_secs(10))
                .await;
            Running::Payments(Box::new(server))
        }
        Role::Relay => Running::Worker(
            Worker::start("outbox_relay", &slot.env, "outbox_relay: relaying").await,
        ),
        Role::Receipts => {
            Running::Worker(Worker::start("receipts", &slot.env, "receipts: consuming").await)
        }
    };
    let log = match &running {
        Running::Payments(server) => server.logs.clone(),
        Running::Worker(worker) => worker.logs.clone(),
    };
    lock(logs).push((slot.role, log));
    running
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
