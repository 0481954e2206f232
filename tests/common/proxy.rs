//! A TCP proxy in front of a real store server, which a test can cut and restore to play an
//! outage without touching the server.
//!
//! - [`Proxy::cut`] shuts down every live connection at once (the client sees the connection
//!   closed on its next read or write) and, until [`Proxy::restore`], accepts new connections
//!   only to close them straight away. The port stays bound, so the client's pool keeps its
//!   address and reconnects by itself once the proxy forwards again.
//! - [`Proxy::stall`] plays a network that stops answering: connections stay open, but no
//!   byte crosses the proxy (nor does a new connection get through) until
//!   [`Proxy::restore`]. A client only notices through its own timeouts.
//! - [`Proxy::delay`] plays a store farther away: every chunk of bytes is held for that long
//!   in each direction before it is written on (stamped when read, so bytes that arrive in a
//!   burst are not delayed once per chunk). [`Proxy::start_on`] binds a given address, for a
//!   proxy that a process in another network namespace reaches over a veth link.
//! - [`Proxy::hush_after`] plays an answer lost on the way back: once a client→server chunk
//!   containing the given bytes (say `b"COMMIT"`) is forwarded, its connection passes nothing
//!   more server→client and is shut down a moment later. The server acts on the statement;
//!   the client never hears how it went.
//! - Connections turned away while cut are counted, so a test can prove that the client really
//!   tried (and failed) to reach the store, rather than trusting a timing.
#![allow(dead_code)]

use std::{
    collections::HashMap,
    io,
    net::{Shutdown, SocketAddr},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Mutex, PoisonError,
    },
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{
        tcp::{OwnedReadHalf, OwnedWriteHalf},
        TcpListener, TcpStream,
    },
    sync::{watch, Notify},
    time::Instant,
};

/// A handle on the proxy; clones share it. Dropping handles does not stop it: its tasks end
/// with the test's runtime.
#[derive(Clone)]
pub struct Proxy {
    inner: Arc<Inner>,
    addr: SocketAddr,
}

struct Inner {
    upstream: (String, u16),
    state: Mutex<State>,
    /// Signalled on every connection turned away.
    turned_away: Notify,
    /// `false` while stalled: bytes read are held until it turns `true`.
    flowing: watch::Sender<bool>,
    /// Added latency per direction, in milliseconds (0: none).
    delay_ms: AtomicU64,
    /// The armed [`Proxy::hush_after`], if any: taken by the first chunk that matches it.
    hush: Mutex<Option<Hush>>,
    /// Signalled when a hush fires.
    hushed: Notify,
}

/// What [`Proxy::hush_after`] waits for, and how long the hushed connection stays open.
struct Hush {
    pattern: Vec<u8>,
    cut_after: Duration,
}

#[derive(Default)]
struct State {
    cut: bool,
    next_id: u64,
    /// Both sockets of every forwarded connection, as `std` clones so `cut` can shut them
    /// down synchronously, whatever their forwarding task is doing.
    live: HashMap<u64, [std::net::TcpStream; 2]>,
    turned_away: usize,
}

impl Proxy {
    /// Listens on `127.0.0.1:0` and forwards each connection to `host:port`.
    pub async fn start(host: &str, port: u16) -> Proxy {
        Self::start_on("127.0.0.1:0".parse().expect("an address"), host, port).await
    }

    /// Listens on `listen` and forwards each connection to `host:port`.
    pub async fn start_on(listen: SocketAddr, host: &str, port: u16) -> Proxy {
        let listener = TcpListener::bind(listen).await.expect("bind the proxy");
        let addr = listener.local_addr().expect("the proxy's address");
        let inner = Arc::new(Inner {
            upstream: (host.to_owned(), port),
            state: Mutex::default(),
            turned_away: Notify::new(),
            flowing: watch::Sender::new(true),
            delay_ms: AtomicU64::new(0),
            hush: Mutex::new(None),
            hushed: Notify::new(),
        });
        tokio::spawn(accept_loop(listener, inner.clone()));
        Proxy { inner, addr }
    }

    /// Where clients should connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Closes every live connection and turns new ones away until [`restore`](Self::restore).
    /// Takes effect before it returns: no byte is forwarded after it.
    pub fn cut(&self) {
        let mut state = self.inner.lock();
        state.cut = true;
        for (_, sockets) in state.live.drain() {
            shut_down(sockets);
        }
    }

    /// Holds every byte in both directions, on live and new connections alike, until
    /// [`restore`](Self::restore): a network that went silent, with no connection closed.
    pub fn stall(&self) {
        self.inner.flowing.send_replace(false);
    }

    /// Forwards again, after a [`cut`](Self::cut) or a [`stall`](Self::stall).
    pub fn restore(&self) {
        self.inner.lock().cut = false;
        self.inner.flowing.send_replace(true);
    }

    /// Holds every byte for `one_way` in each direction from now on, on live and new
    /// connections (a round trip gets twice that); `Duration::ZERO` forwards at once again.
    pub fn delay(&self, one_way: Duration) {
        let ms = u64::try_from(one_way.as_millis()).unwrap_or(u64::MAX);
        self.inner.delay_ms.store(ms, Ordering::SeqCst);
    }

    /// Arms a one-shot fault: the first client→server chunk (from now on) containing
    /// `pattern` is forwarded, but nothing the server sends back on that connection is, and
    /// the connection is shut down `cut_after` later. Other connections are unaffected.
    pub fn hush_after(&self, pattern: &[u8], cut_after: Duration) {
        *self.inner.hush_slot() = Some(Hush {
            pattern: pattern.to_vec(),
            cut_after,
        });
    }

    /// Waits until the armed [`hush_after`](Self::hush_after) has fired; panics after `limit`.
    pub async fn wait_hushed(&self, limit: Duration) {
        let waited = tokio::time::timeout(limit, async {
            loop {
                let notified = self.inner.hushed.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if self.inner.hush_slot().is_none() {
                    return;
                }
                notified.await;
            }
        })
        .await;
        assert!(waited.is_ok(), "no matching chunk crossed within {limit:?}");
    }

    /// How many connections were turned away while cut.
    pub fn turned_away(&self) -> usize {
        self.inner.lock().turned_away
    }

    /// Waits until at least `n` connections have been turned away in total; panics after
    /// `limit`.
    pub async fn wait_turned_away(&self, n: usize, limit: Duration) {
        let waited = tokio::time::timeout(limit, async {
            loop {
                let notified = self.inner.turned_away.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if self.turned_away() >= n {
                    return;
                }
                notified.await;
            }
        })
        .await;
        assert!(
            waited.is_ok(),
            "the proxy turned away {} connections within {limit:?}, expected {n}",
            self.turned_away()
        );
    }
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Shuts down the live connection `id`, if it still is.
    fn shut_down(&self, id: u64) {
        let sockets = self.lock().live.remove(&id);
        if let Some(sockets) = sockets {
            shut_down(sockets);
        }
    }

    fn hush_slot(&self) -> std::sync::MutexGuard<'_, Option<Hush>> {
        self.hush.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The armed hush's delay if `chunk` fires it (disarming it), `None` otherwise.
    fn fires_hush(&self, chunk: &[u8]) -> Option<Duration> {
        let mut slot = self.hush_slot();
        let hush = slot.as_ref()?;
        let fires = chunk
            .windows(hush.pattern.len().max(1))
            .any(|window| window == hush.pattern.as_slice());
        if !fires {
            return None;
        }
        let cut_after = slot.take()?.cut_after;
        drop(slot);
        self.hushed.notify_waiters();
        Some(cut_after)
    }
}

async fn accept_loop(listener: TcpListener, inner: Arc<Inner>) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            // EMFILE and friends: give the system a moment rather than spinning.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        if inner.lock().cut {
            turn_away(&inner, client);
            continue;
        }
        tokio::spawn(forward(client, inner.clone()));
    }
}

/// Shuts down both sockets of a forwarded connection; the pumps then see it closed.
fn shut_down(sockets: [std::net::TcpStream; 2]) {
    for socket in sockets {
        // Already closed by the peer is fine: it is down either way.
        let _ = socket.shutdown(Shutdown::Both);
    }
}

fn turn_away(inner: &Inner, client: TcpStream) {
    drop(client);
    inner.lock().turned_away += 1;
    inner.turned_away.notify_waiters();
}

async fn forward(client: TcpStream, inner: Arc<Inner>) {
    let (host, port) = &inner.upstream;
    let Ok(server) = TcpStream::connect((host.as_str(), *port)).await else {
        return; // The client sees its connection closed, as if the server were down.
    };
    let Ok((client, server, id)) = register(&inner, client, server) else {
        return;
    };
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let hushed = AtomicBool::new(false);
    let connection = Connection {
        inner: &inner,
        id,
        hushed: &hushed,
    };
    tokio::join!(
        pump(client_read, server_write, connection, Direction::ToServer),
        pump(server_read, client_write, connection, Direction::ToClient),
    );
    inner.lock().live.remove(&id);
}

/// Copies one direction until either side closes, holding the bytes while stalled. Reading
/// and writing are split by a queue of chunks stamped with their delivery time, so a delay
/// holds each chunk for the delay after it was read, not once more per chunk queued before it.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    connection: Connection<'_>,
    direction: Direction,
) {
    let inner = connection.inner;
    let mut flowing = inner.flowing.subscribe();
    let (queue, mut queued) = tokio::sync::mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let read = async move {
        let mut buffer = vec![0; 16 * 1024];
        loop {
            let read = match from.read(&mut buffer).await {
                Ok(0) | Err(_) => break,
                Ok(read) => read,
            };
            if flowing.wait_for(|flowing| *flowing).await.is_err() {
                break;
            }
            let delay = Duration::from_millis(inner.delay_ms.load(Ordering::SeqCst));
            if queue
                .send((Instant::now() + delay, buffer[..read].to_vec()))
                .is_err()
            {
                break;
            }
        }
        // Dropping `queue` here ends the writer once it has written what is queued.
    };
    let write = async move {
        while let Some((at, chunk)) = queued.recv().await {
            tokio::time::sleep_until(at).await;
            if !connection.passes(direction, &chunk) {
                continue;
            }
            if to.write_all(&chunk).await.is_err() {
                break;
            }
        }
        // Pass the half-close on, so the other side sees the end of the stream.
        let _ = to.shutdown().await;
    };
    tokio::join!(read, write);
}

/// Which way a pump copies.
#[derive(Clone, Copy)]
enum Direction {
    ToServer,
    ToClient,
}

/// What both pumps of one forwarded connection share.
#[derive(Clone, Copy)]
struct Connection<'a> {
    inner: &'a Arc<Inner>,
    /// The connection's entry in [`State::live`].
    id: u64,
    /// Set once a [`Proxy::hush_after`] fired on this connection: nothing more reaches the
    /// client.
    hushed: &'a AtomicBool,
}

impl Connection<'_> {
    /// Whether `chunk` is to be written on. A chunk to the server that fires the armed hush
    /// is, but hushes the connection first (before the server can answer it) and schedules
    /// its shutdown; a chunk to a hushed client is dropped.
    fn passes(&self, direction: Direction, chunk: &[u8]) -> bool {
        match direction {
            Direction::ToClient => !self.hushed.load(Ordering::SeqCst),
            Direction::ToServer => {
                if let Some(cut_after) = self.inner.fires_hush(chunk) {
                    self.hushed.store(true, Ordering::SeqCst);
                    let (inner, id) = (self.inner.clone(), self.id);
                    tokio::spawn(async move {
                        tokio::time::sleep(cut_after).await;
                        inner.shut_down(id);
                    });
                }
                true
            }
        }
    }
}

/// Records the connection's sockets so `cut` can reach them — unless a cut came first, in
/// which case the connection is turned away. Checked under the same lock `cut` takes, so a
/// connection is either shut down by the cut or never forwards a byte after it.
fn register(
    inner: &Inner,
    client: TcpStream,
    server: TcpStream,
) -> io::Result<(TcpStream, TcpStream, u64)> {
    let client = client.into_std()?;
    let server = server.into_std()?;
    let clones = [client.try_clone()?, server.try_clone()?];
    let mut state = inner.lock();
    if state.cut {
        drop(state);
        drop(server);
        turn_away(inner, TcpStream::from_std(client)?);
        return Err(io::ErrorKind::ConnectionAborted.into());
    }
    let id = state.next_id;
    state.next_id += 1;
    state.live.insert(id, clones);
    drop(state);
    Ok((
        TcpStream::from_std(client)?,
        TcpStream::from_std(server)?,
        id,
    ))
}
