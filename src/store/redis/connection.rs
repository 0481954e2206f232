//! One connection type for both deployments, so every operation is written once.

use redis::{
    aio::{ConnectionLike, ConnectionManager},
    cluster_async::ClusterConnection,
    Cmd, Pipeline, RedisFuture, Value,
};

/// A single server behind a reconnecting manager, or a cluster whose connection follows
/// `MOVED`/`ASK` redirects and refreshes its slot map after a failover. Both are cheap
/// handles onto a multiplexed connection: clones share it.
#[derive(Clone)]
pub(super) enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl Connection {
    pub(super) fn is_cluster(&self) -> bool {
        matches!(self, Self::Cluster(_))
    }
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(connection) => connection.req_packed_command(cmd),
            Self::Cluster(connection) => connection.req_packed_command(cmd),
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
            Self::Cluster(connection) => connection.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(connection) => connection.get_db(),
            Self::Cluster(connection) => connection.get_db(),
        }
    }
}
