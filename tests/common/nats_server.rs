//! A `nats-server -js` of the test's own, on a port and a store directory of its own, for tests
//! that SIGKILL and restart the broker (the machine's shared server is never restarted).
#![allow(dead_code)]

use std::{
    net::TcpStream,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

/// How long a server may take to accept connections.
const PATIENCE: Duration = Duration::from_secs(10);

pub struct PrivateNats {
    child: Option<Child>,
    port: u16,
    /// Holds one store directory per [`fresh_store`](Self::restart_with_fresh_store).
    root: PathBuf,
    store: PathBuf,
}

impl PrivateNats {
    /// Starts `nats-server -js` on a free port; `None` (a skip, unless every backend is
    /// required) when it cannot be started.
    pub fn start(require_all: bool) -> Option<Self> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let root = std::env::temp_dir().join(format!(
            "tower-idempotency-nats-{port}-{:016x}",
            rand::random::<u64>()
        ));
        let mut server = Self {
            child: None,
            port,
            store: root.join("store-0"),
            root,
        };
        match server.spawn() {
            Ok(()) => Some(server),
            Err(error) => {
                assert!(
                    !require_all,
                    "nats-server cannot be started ({error}) but TEST_REQUIRE_ALL_BACKENDS=1"
                );
                eprintln!("skipped: nats-server cannot be started: {error}");
                None
            }
        }
    }

    fn spawn(&mut self) -> std::io::Result<()> {
        std::fs::create_dir_all(&self.store)?;
        let child = Command::new("nats-server")
            .args(["-js", "-a", "127.0.0.1", "-p", &self.port.to_string()])
            .arg("-sd")
            .arg(&self.store)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        self.child = Some(child);
        let deadline = Instant::now() + PATIENCE;
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(Instant::now() < deadline, "nats-server did not come up");
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// SIGKILL: no goodbye to any client, nothing flushed that was not.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port and store.
    pub fn restart(&mut self) {
        self.spawn().expect("restart nats-server");
    }

    /// Starts it again on the same port with an empty store: every stream and consumer is
    /// gone, as after losing the server's disk.
    pub fn restart_with_fresh_store(&mut self) {
        let n = std::fs::read_dir(&self.root).map_or(0, Iterator::count);
        self.store = self.root.join(format!("store-{n}"));
        self.spawn().expect("restart nats-server");
    }
}

impl Drop for PrivateNats {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}
