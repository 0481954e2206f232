//! One connection type for both deployments, so every operation is written once.

use std::{
    future::Future,
    sync::{Arc, PoisonError},
    time::{Duration, Instant},
};

use redis::{
    aio::{ConnectionLike, ConnectionManager},
    cluster::ClusterClient,
    cluster_async::ClusterConnection,
    cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo},
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

    /// `command`'s answer from every node, each with the node's address: the one server
    /// (`None`), or every node of the cluster, replicas included (a replica promoted later
    /// serves with its own settings). An error reply is that node's `Err`; failing to reach a
    /// cluster at all is the outer `Err` (the one server's is its own answer's).
    pub(super) async fn ask_every_node(
        &self,
        command: &Cmd,
    ) -> RedisResult<Vec<(Option<String>, RedisResult<Value>)>> {
        match self {
            Self::Single(connection) => Ok(vec![(
                None,
                command.query_async(&mut connection.clone()).await,
            )]),
            Self::Cluster(cluster) => {
                let (mut connection, _) = cluster.current();
                let every_node = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllNodes, None));
                // Without a response policy the answer maps each node's address to its reply.
                let Value::Map(answers) = connection
                    .route_command(command.clone(), every_node)
                    .await?
                else {
                    return Err(RedisError::from((
                        ErrorKind::UnexpectedReturnType,
                        "a command sent to every cluster node did not answer per node",
                    )));
                };
                Ok(answers
                    .into_iter()
                    .map(|(node, answer)| {
                        let node = redis::from_redis_value::<String>(node).ok();
                        (node, answer.extract_error())
                    })
                    .collect())
            }
        }
    }
}

/// The shortest time between two slot-map rebuilds: while a dead master's replica is not yet
/// promoted, every rebuild still points at the dead master.
const REBUILD_AT_MOST_EVERY: Duration = Duration::from_millis(100);

/// How long a request must have waited before its caller dropped it for the drop to mean a
/// stalled connection rather than a caller that lost interest (a client gone, a `select!`).
/// A healthy cluster answers in milliseconds; a replica wait longer than this makes the
/// occasional abandoned claim cost a spare rebuild, nothing worse.
const ABANDONED_AFTER: Duration = Duration::from_secs(1);

/// How long a rebuild may take before it is given up. With the store's own client settings
/// (2 s to connect, 5 s per command) a rebuild that has not finished by then met a node that
/// accepted the connection and went silent; a client built without a response timeout (the
/// redis-rs default) would wait for it forever, and the rebuild in flight keeps every later
/// one out. Given up, the next failure rebuilds again.
const REBUILD_GIVES_UP_AFTER: Duration = Duration::from_secs(5);

/// A cluster connection that rebuilds itself after a failure.
///
/// redis-rs 0.32's cluster connection refreshes its slot map on `MOVED` only. When a master
/// dies, it keeps reconnecting to the dead address, and never learns that a replica took over
/// its slots. So an operation that failed for lack of a node (I/O error, timeout,
/// `CLUSTERDOWN`, ...) makes this handle build a new connection from the client, which asks a
/// live node for the current slot map; later operations use it. The failed operation itself
/// still fails (and is not repeated here): its effect is unknown.
///
/// An operation its caller abandoned after waiting [`ABANDONED_AFTER`] or longer starts a
/// rebuild too. redis-rs 1.8 can stall a whole cluster connection: when a node's connection
/// drops (a partitioned master demoted on healing closes its clients) it repairs it in the
/// background and refreshes the slot map at the same time, and the refresh can wait forever
/// for the lock the unpolled repair holds; every request on every node then queues behind
/// it and none ever fails. The engine's store timeout drops such requests before redis-rs
/// answers, so without this no error would ever reach [`failed`](Self::failed), and the store
/// would answer 503 for every key until restarted.
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
    /// Cleared when the rebuild ends or is given up ([`REBUILD_GIVES_UP_AFTER`]).
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
        if lost_node(error) {
            self.rebuild(generation);
        }
    }

    /// Replaces the connection of `generation` with a new one, in the background.
    fn rebuild(self: &Arc<Self>, generation: u64) {
        // Called from a drop too, which may run after the runtime shut down.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
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
        runtime.spawn(async move {
            let rebuilt = tokio::time::timeout(
                REBUILD_GIVES_UP_AFTER,
                cluster.client.get_async_connection(),
            )
            .await;
            let mut current = cluster.lock();
            current.rebuilding = false;
            // A failed or given-up rebuild changes nothing: the next failure tries again.
            if let Ok(Ok(connection)) = rebuilt {
                if current.generation == generation {
                    current.connection = connection;
                    current.generation += 1;
                }
            }
        });
    }
}

impl Cluster {
    /// Runs `request` on the connection of `generation`, and rebuilds that connection when
    /// the request fails for a lost node or is abandoned after a long wait.
    async fn watched<T>(
        self: Arc<Self>,
        generation: u64,
        request: impl Future<Output = RedisResult<T>>,
    ) -> RedisResult<T> {
        let mut watch = Abandoned {
            cluster: self,
            generation,
            since: Instant::now(),
            pending: true,
        };
        let result = request.await;
        watch.pending = false;
        if let Err(error) = &result {
            watch.cluster.failed(generation, error);
        }
        result
    }
}

/// Rebuilds the connection when dropped while its request is still pending after
/// [`ABANDONED_AFTER`]: the caller gave up on a connection that may never answer.
struct Abandoned {
    cluster: Arc<Cluster>,
    generation: u64,
    since: Instant,
    pending: bool,
}

impl Drop for Abandoned {
    fn drop(&mut self) {
        if self.pending && self.since.elapsed() >= ABANDONED_AFTER {
            self.cluster.rebuild(self.generation);
        }
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
                    let request = connection.req_packed_command(cmd);
                    cluster.watched(generation, request).await
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
                    let request = connection.req_packed_commands(pipeline, offset, count);
                    cluster.watched(generation, request).await
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
