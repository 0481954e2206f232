//! One connection type for both deployments, so every operation is written once.

use std::{
    sync::{Arc, PoisonError},
    time::{Duration, Instant},
};

use redis::{
    aio::{ConnectionLike, ConnectionManager},
    cluster::ClusterClient,
    cluster_async::ClusterConnection,
    Cmd, ErrorKind, Pipeline, RedisError, RedisFuture, RedisResult, ServerErrorKind, Value,
};

use crate::sync::{Mutex, MutexGuard};

/// A single server behind a reconnecting manager, or a cluster. Both are cheap handles onto
/// multiplexed connections: clones share them.
#[derive(Clone)]
pub(super) enum Connection {
    Single(ConnectionManager),
    Cluster(Arc<Cluster>),
}

impl Connection {
    pub(super) fn is_cluster(&self) -> bool {
        matches!(self, Self::Cluster(_))
    }
}

/// The shortest time between two slot-map rebuilds: while a dead master's replica is not yet
/// promoted, every rebuild still points at the dead master.
const REBUILD_AT_MOST_EVERY: Duration = Duration::from_millis(100);

/// A cluster connection that rebuilds itself after a failure.
///
/// redis-rs 0.32's cluster connection refreshes its slot map on `MOVED` only. When a master
/// dies, it keeps reconnecting to the dead address, and never learns that a replica took over
/// its slots. So an operation that failed for lack of a node (I/O error, timeout,
/// `CLUSTERDOWN`, ...) makes this handle build a new connection from the client, which asks a
/// live node for the current slot map; later operations use it. The failed operation itself
/// still fails (and is not repeated here): its effect is unknown.
pub(super) struct Cluster {
    client: ClusterClient,
    current: Mutex<Current>,
}

struct Current {
    connection: ClusterConnection,
    generation: u64,
    /// When the last rebuild started, to space them out.
    rebuilt_at: Option<Instant>,
    /// One rebuild at a time: against an unreachable host each may take the connect timeout.
    rebuilding: bool,
}

impl Cluster {
    pub(super) async fn connect(client: ClusterClient) -> RedisResult<Self> {
        let connection = client.get_async_connection().await?;
        Ok(Self {
            client,
            current: Mutex::new(Current {
                connection,
                generation: 0,
                rebuilt_at: None,
                rebuilding: false,
            }),
        })
    }

    fn current(&self) -> (ClusterConnection, u64) {
        let current = self.lock();
        (current.connection.clone(), current.generation)
    }

    fn lock(&self) -> MutexGuard<'_, Current> {
        self.current.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts a rebuild after `error` on the connection of `generation`, unless the error
    /// does not mean a lost node, or that connection was already replaced, or a rebuild
    /// started moments ago.
    fn failed(self: &Arc<Self>, generation: u64, error: &RedisError) {
        if !lost_node(error) {
            return;
        }
        {
            let mut current = self.lock();
            let recent = current
                .rebuilt_at
                .is_some_and(|at| at.elapsed() < REBUILD_AT_MOST_EVERY);
            if current.generation != generation || current.rebuilding || recent {
                return;
            }
            current.rebuilt_at = Some(Instant::now());
            current.rebuilding = true;
        }
        let cluster = self.clone();
        tokio::spawn(async move {
            let rebuilt = cluster.client.get_async_connection().await;
            let mut current = cluster.lock();
            current.rebuilding = false;
            // A failed rebuild changes nothing: the next failure tries again.
            if let Ok(connection) = rebuilt {
                if current.generation == generation {
                    current.connection = connection;
                    current.generation += 1;
                }
            }
        });
    }
}

/// Errors after which the slot map may be wrong: a node is gone or the cluster reconfigures.
fn lost_node(error: &RedisError) -> bool {
    error.is_io_error()
        || error.is_timeout()
        || error.is_connection_dropped()
        || error.is_connection_refusal()
        || matches!(
            error.kind(),
            ErrorKind::Server(ServerErrorKind::ClusterDown)
                | ErrorKind::Server(ServerErrorKind::MasterDown)
                | ErrorKind::Server(ServerErrorKind::TryAgain)
                | ErrorKind::ClusterConnectionNotFound
        )
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(connection) => connection.req_packed_command(cmd),
            Self::Cluster(cluster) => {
                let cluster = cluster.clone();
                Box::pin(async move {
                    let (mut connection, generation) = cluster.current();
                    let result = connection.req_packed_command(cmd).await;
                    if let Err(error) = &result {
                        cluster.failed(generation, error);
                    }
                    result
                })
            }
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(connection) => connection.req_packed_commands(pipeline, offset, count),
            Self::Cluster(cluster) => {
                let cluster = cluster.clone();
                Box::pin(async move {
                    let (mut connection, generation) = cluster.current();
                    let result = connection
                        .req_packed_commands(pipeline, offset, count)
                        .await;
                    if let Err(error) = &result {
                        cluster.failed(generation, error);
                    }
                    result
                })
            }
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(connection) => connection.get_db(),
            // A cluster has database 0 only.
            Self::Cluster(_) => 0,
        }
    }
}
