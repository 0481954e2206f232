//! The two `payments` processes of a run, sharing one store: the clients find each one's
//! current address here, and the nemesis kills, restarts, pauses and resumes them.

use std::{
    sync::{Mutex, PoisonError},
    time::Duration,
};

use crate::process::{Http, Launch, Server};

/// The processes of a run, by slot; a slot is empty while its process is being restarted.
pub struct Fleet {
    slots: Vec<Slot>,
}

struct Slot {
    /// How this slot's process is started (again, after a kill).
    launch: Launch,
    /// Held for the whole of a fault on this process, so two never overlap.
    server: tokio::sync::Mutex<Option<Server>>,
    /// The address clients use; `None` while the process is dead.
    http: Mutex<Option<Http>>,
}

impl Fleet {
    /// Starts one process per launch, one after the other.
    pub async fn start(launches: Vec<Launch>) -> Self {
        let mut slots = Vec::with_capacity(launches.len());
        for launch in launches {
            let server = launch.clone().start().await;
            slots.push(Slot {
                launch,
                http: Mutex::new(Some(server.http())),
                server: tokio::sync::Mutex::new(Some(server)),
            });
        }
        Self { slots }
    }

    pub fn size(&self) -> usize {
        self.slots.len()
    }

    /// The client of process `slot`, unless it is dead right now.
    pub fn http(&self, slot: usize) -> Option<Http> {
        self.slots[slot]
            .http
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The pids of the processes alive now.
    pub async fn pids(&self) -> Vec<u32> {
        let mut pids = Vec::new();
        for slot in &self.slots {
            if let Some(server) = slot.server.lock().await.as_ref() {
                pids.push(server.pid());
            }
        }
        pids
    }

    /// SIGKILL of process `slot`, whatever it was doing, then a fresh process in its place.
    pub async fn kill_and_restart(&self, slot: usize) {
        let slot = &self.slots[slot];
        let mut server = slot.server.lock().await;
        *slot.http.lock().unwrap_or_else(PoisonError::into_inner) = None;
        if let Some(old) = server.take() {
            old.kill_9().await;
        }
        let fresh = slot.launch.clone().start().await;
        *slot.http.lock().unwrap_or_else(PoisonError::into_inner) = Some(fresh.http());
        *server = Some(fresh);
    }

    /// SIGSTOP of process `slot` for `pause`, then SIGCONT: alive to the kernel (its sockets
    /// accept, its store sessions stay open), silent to everyone else.
    pub async fn pause(&self, slot: usize, pause: Duration) {
        let server = self.slots[slot].server.lock().await;
        let Some(server) = server.as_ref() else {
            return;
        };
        server.pause();
        tokio::time::sleep(pause).await;
        server.resume();
    }
}
