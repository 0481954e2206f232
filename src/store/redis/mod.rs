//! The Redis store, on one server or on a Redis Cluster. Its documentation is on
//! [`RedisStore`], the module being private.

mod codec;
mod connection;
mod eviction;
mod journal;
mod notify;
mod prefix;
mod replica_wait;
mod scripts;

use std::{fmt, sync::Arc, time::Duration};

use async_trait::async_trait;
use bytes::Bytes;
use redis::{
    aio::{ConnectionManager, ConnectionManagerConfig},
    cluster::{ClusterClient, ClusterClientBuilder},
    RedisError,
};

pub(crate) use self::journal::JournalSlot;
use self::{
    codec::{claim_value, completed_fence, decode, fence, millis},
    connection::{Cluster, Connection},
    notify::Notifier,
    replica_wait::ReplicaWait,
    scripts::{COMPLETE, RELEASE, RENEW},
};
pub use self::{
    eviction::{EvictingPolicy, OnEvictingPolicy},
    prefix::InvalidPrefix,
    replica_wait::ReplicaWaitTimedOut,
};
use super::{Completions, Store, StoreError};
use crate::record::{ClaimOutcome, Fingerprint, Record, StoreKey, Token};

const BACKEND: &str = "redis";

/// A [`Store`] on Redis 7.0+ (or Valkey), on one server or on a Redis Cluster. On one server
/// it runs over a [`ConnectionManager`] that reconnects by itself: when the server comes back
/// after an outage, the same store works again without a restart. On a cluster it runs over
/// redis-rs's cluster connection, which follows `MOVED`/`ASK` redirects; after an operation
/// failed for a lost node, or was abandoned by its caller (the engine's store timeout) after
/// waiting a second or more, the store replaces that connection with one built on the current
/// slot map, so it finds the promoted replica after a failover (redis-rs 0.32 would keep
/// dialling the dead master) and recovers when redis-rs 1.8's connection stalls as a
/// partitioned master returns as a replica. Clones share the connection.
///
/// ```no_run
/// use tower_idempotency::store::RedisStore;
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let single = RedisStore::open("redis://127.0.0.1:6379").await?;
/// let cluster =
///     RedisStore::open_cluster(["redis://127.0.0.1:7000", "redis://127.0.0.1:7001"]).await?;
/// # let _ = (single, cluster);
/// # Ok(())
/// # }
/// ```
///
/// # How the contract is kept
///
/// - **Claim** is the single command `SET key value NX PX <lease> GET`: it writes the claim
///   only when the key is absent and returns what was there otherwise, in one step. Combining
///   `NX` with `GET` needs **Redis 7.0 or newer** (older servers reject the command with a
///   syntax error, which surfaces as [`StoreError::Backend`]). The value carries the claim's
///   random token, so a claim resent after its reply was lost (the cluster client does that)
///   recognises itself in what it finds and holds the key.
/// - **Expiry** is the server's: a claim carries `PX = lease`, a completed record
///   `PX = retention`. Redis never returns an expired key, so an expired claim or record is
///   simply absent and the next `SET .. NX` wins it. No application clock is involved.
/// - **`complete`, `release` and `renew`** are Lua scripts (run by `EVALSHA`, loaded on a
///   `NOSCRIPT` miss) that compare the stored state and token with the caller's and only then
///   `SET .. PX`, `DEL` or `PEXPIRE`. Scripts run atomically, so nothing can slip in between
///   the check and the write.
/// - **`purge_expired`** does nothing and returns `Ok(0)`: Redis deletes expired keys itself
///   (lazily on access and by its active expiry cycle), and scanning the keyspace to find
///   ours would cost far more than it saves.
///
/// # Keys, slots and hash tags
///
/// A record lives under ONE key, `prefix + hex(SHA-256(scope, key))` (see
/// [`StoreKey::digest`] and [`redis_key`](Self::redis_key)): fixed length, unambiguous, and
/// the raw client key never reaches Redis. Every command and script touches exactly that key
/// (scripts declare it in `KEYS[1]`), so on a cluster each operation runs on the one master
/// that owns the key's slot, and no operation ever needs two slots.
///
/// The default layout carries **no hash tag**: the slot is `CRC16` of the whole key, i.e. in
/// effect of the digest, so records spread evenly over all masters and the cluster's
/// throughput grows with its masters. A prefix with a hash tag, such as `"{idem}:"`, puts
/// every record into the one slot of `idem`: one master holds and serves them all. Do that
/// only to keep the records on a chosen shard, never for throughput.
///
/// # Value layout
///
/// One binary string: a format version byte, a state byte (in progress / completed), the
/// 16-byte token, the 32-byte fingerprint, then the payload (empty while in progress).
/// Anything else under a key is reported as [`StoreError::Corrupt`].
///
/// # Connection and durability
///
/// [`open`](Self::open) connects with [`connection_config`](Self::connection_config) and
/// [`open_cluster`](Self::open_cluster) with [`cluster_client`](Self::cluster_client): while
/// Redis is unreachable operations fail within seconds with [`StoreError::Backend`], and the
/// store reconnects by itself when it is back.
///
/// A record is only as durable as Redis keeps it. Replication is asynchronous: a master
/// acknowledges a claim before its replica has it, so a failover to a replica that had not
/// yet received the claim forgets it, and a duplicate arriving then runs the operation again.
/// [`RedisStoreBuilder::wait_for_replicas`] closes that window for claims:
///
/// | setting | claim costs | a master dies (SIGKILL) | a master is cut from its replica and peers, clients still reach it |
/// |---|---|---|---|
/// | no replica wait (default) | one round trip | a claim not yet replicated is lost: a duplicate arriving at the promoted replica runs the operation **again** | the isolated master takes claims until its node timeout makes it refuse writes; its replica, promoted, never gets them: a duplicate there runs the operation **again** |
/// | `wait_for_replicas(1, t)` | one round trip plus one replication round trip (`WAIT 1 t`, sent in the same pipeline) | a claim the handler runs under is on a replica: **no second run** while its lease lasts; a claim no replica acknowledged within `t` is withdrawn and answered 503 ([`ReplicaWaitTimedOut`]) | the isolated master's `WAIT` times out, so its claims are answered 503 and **no second run** follows; a claim whose withdrawal or answer was lost stays "in progress" until its lease ends |
///
/// The wait covers the claim, not the completed outcome: an outcome lost with its master
/// leaves the replicated claim behind, so duplicates are told "in progress" until the lease
/// runs out, and the operation may run again after that.
///
/// # Memory and persistence
///
/// A key runs once only while Redis remembers its claim or record; whatever makes Redis
/// forget one early lets a duplicate run the operation again, with no error anywhere.
///
/// - **Eviction.** Every record carries an expiry, so with a `maxmemory` limit every
///   `volatile-*` policy picks its victims among our records, and every `allkeys-*` policy
///   may too. Run the nodes with `maxmemory-policy noeviction`: when memory is full Redis
///   then refuses new claims (the layer answers 503) instead of dropping old ones. The
///   `open*` constructors ask every node for its policy and refuse an evicting one with
///   [`StoreError::EvictingPolicy`], or only log it with
///   [`on_evicting_policy`](RedisStoreBuilder::on_evicting_policy); a node that does not let
///   them read it (`CONFIG` renamed or forbidden, as on managed services) is logged as
///   unverified: check the policy in the provider's settings. Without a `maxmemory` limit
///   nothing is evicted, but one set later at runtime arms whatever policy is configured,
///   hence the check looks at the policy alone. Size the memory for the records of one
///   retention: a completed record holds the stored response.
/// - **Restarts.** A node restarted without persistence comes back empty: every claim and
///   completed record is forgotten. With RDB snapshots it comes back as of the last
///   snapshot (minutes of records lost); with the AOF and `appendfsync everysec` (Redis's
///   default for the AOF) about the last second is lost; `appendfsync always` loses nothing
///   a client was answered for, at the cost of an fsync per write. Pick the AOF where a
///   restart must not repeat operations, or accept that a restart reopens the keys of its
///   retention window. A replica promoted by a failover is the other way to lose records
///   (see the table above).
#[derive(Clone)]
pub struct RedisStore {
    connection: Connection,
    prefix: Arc<str>,
    replica_wait: Option<ReplicaWait>,
    notifier: Option<Notifier>,
    on_evicting: OnEvictingPolicy,
}

/// Builds a [`RedisStore`] with a key prefix other than the default `"tower-idempotency:"`
/// or a replica wait, on one server ([`open`](Self::open), [`build`](Self::build)) or on a
/// cluster ([`open_cluster`](Self::open_cluster), [`open_cluster_with`](Self::open_cluster_with)).
///
/// ```no_run
/// use std::time::Duration;
/// use tower_idempotency::store::RedisStore;
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let store = RedisStore::builder()
///     .prefix("payments:")
///     .wait_for_replicas(1, Duration::from_millis(200))
///     .open_cluster(["redis://10.0.0.1:6379", "redis://10.0.0.2:6379"])
///     .await?;
/// # let _ = store;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct RedisStoreBuilder {
    prefix: String,
    replica_wait: Option<ReplicaWait>,
    notify_with: Option<redis::Client>,
    on_evicting: OnEvictingPolicy,
}

impl RedisStoreBuilder {
    /// Sets the prefix of every key this store writes (default `"tower-idempotency:"`).
    ///
    /// It must be 1 to 256 bytes without whitespace or control characters, so that keys stay
    /// readable in `redis-cli` and `SCAN MATCH prefix*` finds exactly this store's records.
    /// A hash tag (`"{idem}:"`) pins every record to one Redis Cluster slot, i.e. to one
    /// master (see [`RedisStore`]'s key layout).
    ///
    /// It is validated when the store is built.
    ///
    /// ```
    /// # let runtime = tokio::runtime::Runtime::new().unwrap();
    /// # runtime.block_on(async {
    /// use tower_idempotency::store::RedisStore;
    /// let refused = RedisStore::builder().prefix("").open("redis://127.0.0.1:6379").await;
    /// assert!(refused.unwrap_err().to_string().contains("invalid Redis key prefix"));
    /// # });
    /// ```
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// After writing a claim, wait until `replicas` replicas of the master acknowledged it
    /// (`WAIT replicas timeout`, pipelined behind the claim on the same connection) before
    /// the handler runs. A claim that too few replicas acknowledged within `timeout` is
    /// withdrawn and fails with [`StoreError::Backend`] whose source is
    /// [`ReplicaWaitTimedOut`]; the handler does not run. `0` replicas turns the wait off
    /// (the default); the timeout is rounded up to whole milliseconds, at least 1 (Redis would
    /// read `0` as "forever") and at most an hour.
    ///
    /// A master without a live replica then refuses every claim after `timeout`: set it only
    /// where every master has replicas. The trade-off is in [`RedisStore`]'s docs.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::store::RedisStore;
    /// let builder = RedisStore::builder().wait_for_replicas(1, Duration::from_millis(100));
    /// # let _ = builder;
    /// ```
    pub fn wait_for_replicas(mut self, replicas: u32, timeout: Duration) -> Self {
        self.replica_wait = ReplicaWait::new(replicas, timeout);
        self
    }

    /// What [`open`](Self::open) and [`open_cluster`](Self::open_cluster) do when a Redis
    /// node's `maxmemory-policy` is not `noeviction`: refuse with
    /// [`StoreError::EvictingPolicy`] (the default), or open with a warning in the log.
    ///
    /// Every record carries an expiry, so `volatile-*` policies may evict live claims and
    /// completed records under memory pressure, and `allkeys-*` ones too; a duplicate of an
    /// evicted key runs the operation again. A node that does not let the store read its
    /// policy (`CONFIG` renamed or forbidden, as on most managed services) is logged as
    /// unverified and never refused: check its policy in the provider's settings. See
    /// [`RedisStore`]'s "Memory and persistence".
    ///
    /// ```
    /// use tower_idempotency::store::{OnEvictingPolicy, RedisStore};
    /// let builder = RedisStore::builder().on_evicting_policy(OnEvictingPolicy::Warn);
    /// # let _ = builder;
    /// ```
    pub fn on_evicting_policy(mut self, on_evicting: OnEvictingPolicy) -> Self {
        self.on_evicting = on_evicting;
        self
    }

    /// Builds the store over a connection manager you configured yourself. Start from
    /// [`RedisStore::connection_config`]: redis-rs's own defaults retry a failed reconnect for
    /// minutes while requests wait.
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use redis::aio::ConnectionManager;
    /// use tower_idempotency::store::RedisStore;
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let client = redis::Client::open("redis://127.0.0.1:6379")?;
    /// let config = RedisStore::connection_config().set_response_timeout(Some(Duration::from_secs(1)));
    /// let manager = ConnectionManager::new_with_config(client, config).await?;
    /// let store = RedisStore::builder().prefix("app:").build(manager)?;
    /// store.check_eviction_policy().await?; // `build` cannot: it does not wait on Redis
    /// # Ok(())
    /// # }
    /// ```
    pub fn build(self, connection: ConnectionManager) -> Result<RedisStore, InvalidPrefix> {
        self.with(Connection::Single(connection))
    }

    /// Completion notifications (one server only): `complete` and `release` publish the
    /// key's digest on the channel `<prefix>settled`, and the store subscribes with `client`
    /// (one pub/sub connection per store value and its clones, opened when the first engine
    /// on it starts), so that a duplicate waiting in another process is woken when the original
    /// finishes instead of at its next poll (see [`Store::completions`]).
    /// [`open`](Self::open) turns them on with its own client; a store from
    /// [`build`](Self::build) notifies only with this. Ignored on a cluster, whose waiters
    /// poll.
    pub fn notify_with(mut self, client: redis::Client) -> Self {
        self.notify_with = Some(client);
        self
    }

    fn with(self, connection: Connection) -> Result<RedisStore, InvalidPrefix> {
        let prefix: Arc<str> = prefix::validate(self.prefix)?.into();
        let notifier = match &connection {
            Connection::Single(_) => self
                .notify_with
                .map(|client| Notifier::new(client, &prefix)),
            Connection::Cluster(_) => None,
        };
        Ok(RedisStore {
            connection,
            prefix,
            replica_wait: self.replica_wait,
            notifier,
            on_evicting: self.on_evicting,
        })
    }

    /// Refuses a bad prefix before connecting: there is no point reaching a server for a
    /// store that cannot be built.
    fn check_prefix(&self) -> Result<(), StoreError> {
        prefix::validate(self.prefix.clone())?;
        Ok(())
    }

    /// Connects to `url` with [`RedisStore::connection_config`] and builds the store.
    ///
    /// Fails with [`StoreError::InvalidPrefix`] when the prefix is invalid (before connecting),
    /// with [`StoreError::Backend`] (the [`RedisError`] as its source) when the URL is
    /// invalid or the server cannot be reached now, and with [`StoreError::EvictingPolicy`]
    /// when the server may evict records (see
    /// [`on_evicting_policy`](Self::on_evicting_policy)); once connected, later outages are
    /// reported per operation and healed by reconnecting.
    pub async fn open(self, url: &str) -> Result<RedisStore, StoreError> {
        self.check_prefix()?;
        let client = redis::Client::open(url).map_err(backend)?;
        let connection =
            ConnectionManager::new_with_config(client.clone(), RedisStore::connection_config())
                .await
                .map_err(backend)?;
        let notify_with = self.notify_with.clone().unwrap_or(client);
        let store = self.notify_with(notify_with).build(connection)?;
        store.check_eviction_policy().await?;
        Ok(store)
    }

    /// Connects to the Redis Cluster that `nodes` belong to (one reachable node is enough;
    /// the others are learnt from it) with [`RedisStore::cluster_client`], and builds the
    /// store.
    ///
    /// Fails with [`StoreError::Config`] when `nodes` is empty, and with
    /// [`StoreError::Backend`] (the [`RedisError`] as its source) when a URL is invalid or no
    /// node answers with the cluster's slot map now.
    pub async fn open_cluster<I>(self, nodes: I) -> Result<RedisStore, StoreError>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        let mut nodes = nodes.into_iter().peekable();
        if nodes.peek().is_none() {
            return Err(StoreError::Config(
                "no Redis Cluster node given; pass at least one redis:// URL of a cluster node"
                    .into(),
            ));
        }
        let client = RedisStore::cluster_client(nodes).build().map_err(backend)?;
        self.open_cluster_with(client).await
    }

    /// Connects with a cluster client you configured yourself, and builds the store. Start
    /// from [`RedisStore::cluster_client`]: redis-rs's own defaults retry a failed command 16
    /// times, for minutes, while requests wait. The store keeps the client, to rebuild its
    /// connection with the current slot map after a node was lost (see [`RedisStore`]).
    ///
    /// Fails with [`StoreError::Backend`] (the [`RedisError`] as its source) when no node
    /// answers with the cluster's slot map now, and with [`StoreError::EvictingPolicy`] when a
    /// node may evict records (see [`on_evicting_policy`](Self::on_evicting_policy)).
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use tower_idempotency::store::RedisStore;
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let client = RedisStore::cluster_client(["redis://127.0.0.1:7000"])
    ///     .response_timeout(Duration::from_secs(1))
    ///     .build()?;
    /// let store = RedisStore::builder().open_cluster_with(client).await?;
    /// # let _ = store;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn open_cluster_with(self, client: ClusterClient) -> Result<RedisStore, StoreError> {
        self.check_prefix()?;
        let cluster = Cluster::connect(client).await.map_err(backend)?;
        let store = self.with(Connection::Cluster(Arc::new(cluster)))?;
        store.check_eviction_policy().await?;
        Ok(store)
    }
}

impl Default for RedisStoreBuilder {
    fn default() -> Self {
        Self {
            prefix: RedisStore::DEFAULT_PREFIX.into(),
            replica_wait: None,
            notify_with: None,
            on_evicting: OnEvictingPolicy::default(),
        }
    }
}

impl RedisStore {
    /// The key prefix used unless [`RedisStoreBuilder::prefix`] says otherwise.
    ///
    /// ```
    /// # use tower_idempotency::store::RedisStore;
    /// assert_eq!(RedisStore::DEFAULT_PREFIX, "tower-idempotency:");
    /// ```
    pub const DEFAULT_PREFIX: &'static str = "tower-idempotency:";

    /// A store with the default prefix over `connection`. See [`RedisStoreBuilder::build`]
    /// for how to configure the connection manager.
    ///
    /// ```no_run
    /// use redis::aio::ConnectionManager;
    /// use tower_idempotency::store::RedisStore;
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let client = redis::Client::open("redis://127.0.0.1:6379")?;
    /// let manager =
    ///     ConnectionManager::new_with_config(client, RedisStore::connection_config()).await?;
    /// let store = RedisStore::new(manager);
    /// # let _ = store;
    /// # Ok(())
    /// # }
    /// ```
    pub fn new(connection: ConnectionManager) -> Self {
        Self::builder()
            .build(connection)
            .expect("the default prefix is valid")
    }

    /// Connects to `url` (for example `redis://127.0.0.1:6379`) and returns a store with the
    /// default prefix. See [`RedisStoreBuilder::open`].
    ///
    /// ```no_run
    /// use tower_idempotency::store::RedisStore;
    /// # async fn run() -> Result<(), tower_idempotency::store::StoreError> {
    /// let store = RedisStore::open("redis://127.0.0.1:6379").await?;
    /// # let _ = store;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn open(url: &str) -> Result<Self, StoreError> {
        Self::builder().open(url).await
    }

    /// Connects to the Redis Cluster `nodes` belong to and returns a store with the default
    /// prefix. See [`RedisStoreBuilder::open_cluster`].
    ///
    /// ```no_run
    /// use tower_idempotency::store::RedisStore;
    /// # async fn run() -> Result<(), tower_idempotency::store::StoreError> {
    /// let store = RedisStore::open_cluster(["redis://127.0.0.1:7000"]).await?;
    /// # let _ = store;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn open_cluster<I>(nodes: I) -> Result<Self, StoreError>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        Self::builder().open_cluster(nodes).await
    }

    /// A builder to set the key prefix and the replica wait.
    ///
    /// ```
    /// use tower_idempotency::store::RedisStore;
    /// let builder = RedisStore::builder().prefix("app:idem:");
    /// # let _ = builder;
    /// ```
    pub fn builder() -> RedisStoreBuilder {
        RedisStoreBuilder::default()
    }

    /// The connection settings [`open`](Self::open) uses: fail fast, reconnect on demand.
    ///
    /// A connect attempt gives up after 2 s and is not retried in a loop; a command waits at
    /// most 5 s for its answer. While Redis is down every operation fails at once with
    /// [`StoreError::Backend`] (the HTTP layer answers 503) and starts a new connect attempt,
    /// so the first operation after Redis returns reconnects. redis-rs's defaults instead
    /// retry the connect with delays of up to a minute, six times, and every request waits
    /// for that.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::store::RedisStore;
    /// let config = RedisStore::connection_config().set_response_timeout(Some(Duration::from_secs(1)));
    /// # let _ = config;
    /// ```
    pub fn connection_config() -> ConnectionManagerConfig {
        ConnectionManagerConfig::new()
            .set_number_of_retries(0)
            .set_connection_timeout(Some(Duration::from_secs(2)))
            .set_response_timeout(Some(Duration::from_secs(5)))
    }

    /// The cluster client settings [`open_cluster`](Self::open_cluster) uses for `nodes`:
    /// the same 2 s connect and 5 s response limits as
    /// [`connection_config`](Self::connection_config), and at most 3 retries 10-500 ms apart.
    ///
    /// Retries let a command ride out a redirect or a short failover (the client refreshes
    /// its slot map and tries the new master); redis-rs's defaults (16 retries, up to minutes
    /// apart) would hold a request far longer than any client waits. Retrying is safe for
    /// every operation of this store. The client also resends a command whose connection
    /// dropped before its reply came, although Redis may have applied it: a resent claim that
    /// finds its own value (its token) under the key knows it is that claim and holds the key,
    /// rather than waiting on itself; the fenced scripts act at most once, and a completion
    /// whose answer was lost is looked up by the engine before it is reported as failed.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::store::RedisStore;
    /// let builder = RedisStore::cluster_client(["redis://127.0.0.1:7000"]).retries(1);
    /// # let _ = builder;
    /// ```
    pub fn cluster_client<I>(nodes: I) -> ClusterClientBuilder
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        ClusterClientBuilder::new(nodes.into_iter().map(|node| node.as_ref().to_owned()))
            .connection_timeout(Duration::from_secs(2))
            .response_timeout(Duration::from_secs(5))
            .retries(3)
            .min_retry_wait(10)
            .max_retry_wait(500)
    }

    /// The key prefix.
    ///
    /// ```no_run
    /// # use tower_idempotency::store::RedisStore;
    /// # async fn run(store: RedisStore) {
    /// assert_eq!(store.prefix(), "tower-idempotency:");
    /// # }
    /// ```
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// True when the store runs on a Redis Cluster.
    ///
    /// ```no_run
    /// # use tower_idempotency::store::RedisStore;
    /// # async fn run() -> Result<(), tower_idempotency::store::StoreError> {
    /// let store = RedisStore::open_cluster(["redis://127.0.0.1:7000"]).await?;
    /// assert!(store.is_cluster());
    /// # Ok(())
    /// # }
    /// ```
    pub fn is_cluster(&self) -> bool {
        self.connection.is_cluster()
    }

    /// Asks every node for its `maxmemory-policy` and refuses (or warns about) one that may
    /// evict records, as [`RedisStoreBuilder::on_evicting_policy`] says. The `open*`
    /// constructors run it; a store from [`RedisStoreBuilder::build`] or [`RedisStore::new`]
    /// has not, as those do not wait on Redis. A node that cannot be asked (`CONFIG` renamed
    /// or forbidden) is logged as unverified, never refused.
    ///
    /// Fails with [`StoreError::EvictingPolicy`] for an evicting node under the default
    /// [`OnEvictingPolicy::Refuse`], and with [`StoreError::Backend`] when Redis cannot be
    /// reached.
    ///
    /// ```no_run
    /// # use tower_idempotency::store::RedisStore;
    /// # async fn run(store: RedisStore) -> Result<(), tower_idempotency::store::StoreError> {
    /// store.check_eviction_policy().await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn check_eviction_policy(&self) -> Result<(), StoreError> {
        eviction::check(&self.connection, self.on_evicting).await
    }

    /// The Redis key the record for `key` lives under: the prefix and 64 hex digits of
    /// [`StoreKey::digest`]. Useful to inspect or delete one record by hand.
    ///
    /// ```no_run
    /// # use tower_idempotency::{store::RedisStore, StoreKey};
    /// # async fn run(store: RedisStore) {
    /// let redis_key = store.redis_key(&StoreKey::new("tenant-42", "order-7"));
    /// assert!(redis_key.starts_with("tower-idempotency:"));
    /// assert!(!redis_key.contains("order-7"));
    /// # }
    /// ```
    pub fn redis_key(&self, key: &StoreKey) -> String {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let digest = key.digest();
        let mut out = String::with_capacity(self.prefix.len() + digest.len() * 2);
        out.push_str(&self.prefix);
        for byte in digest {
            out.push(DIGITS[usize::from(byte >> 4)] as char);
            out.push(DIGITS[usize::from(byte & 0xf)] as char);
        }
        out
    }

    /// Adds the channel and the key's digest (`redis_key` without the prefix) to a settling
    /// script's arguments when this store notifies.
    fn publishing<'a, 'b>(
        &self,
        script: &'a mut redis::ScriptInvocation<'b>,
        redis_key: &str,
    ) -> &'a mut redis::ScriptInvocation<'b> {
        if let Some(notifier) = &self.notifier {
            script
                .arg(notifier.channel())
                .arg(&redis_key[self.prefix.len()..]);
        }
        script
    }

    /// Runs a fencing script; its 0 means the token does not hold the claim.
    async fn fenced(&self, invocation: &redis::ScriptInvocation<'_>) -> Result<(), StoreError> {
        let acted: i64 = invocation
            .invoke_async(&mut self.connection.clone())
            .await
            .map_err(backend)?;
        if acted == 1 {
            Ok(())
        } else {
            Err(StoreError::StaleToken)
        }
    }

    /// `SET .. NX PX .. GET`, and with a replica wait `WAIT` in the same pipeline: a pipeline
    /// goes to one node as a whole (on a cluster, the master of the key's slot, redirects
    /// included), and `WAIT` counts the replicas that have every write that connection sent
    /// before it, so the claim among them. Returns the previous value and, with a replica
    /// wait, how many replicas acknowledged.
    async fn set_claim(
        &self,
        redis_key: &str,
        value: Vec<u8>,
        lease: Duration,
    ) -> Result<(Option<Vec<u8>>, Option<i64>), StoreError> {
        let mut set = redis::cmd("SET");
        set.arg(redis_key)
            .arg(value)
            .arg("NX")
            .arg("PX")
            .arg(millis(lease)?)
            .arg("GET");
        let mut connection = self.connection.clone();
        match self.replica_wait {
            None => {
                let previous = set.query_async(&mut connection).await.map_err(backend)?;
                Ok((previous, None))
            }
            Some(wait) => {
                let (previous, acknowledged) = redis::pipe()
                    .add_command(set)
                    .cmd("WAIT")
                    .arg(wait.replicas)
                    .arg(wait.timeout_ms)
                    .query_async(&mut connection)
                    .await
                    .map_err(backend)?;
                Ok((previous, Some(acknowledged)))
            }
        }
    }
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .field("cluster", &self.is_cluster())
            .field("replica_wait", &self.replica_wait)
            .field("on_evicting", &self.on_evicting)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl Store for RedisStore {
    async fn claim(
        &self,
        key: &StoreKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<ClaimOutcome, StoreError> {
        let token = Token::random();
        let redis_key = self.redis_key(key);
        let (previous, acknowledged) = self
            .set_claim(&redis_key, claim_value(token, fingerprint), lease)
            .await?;
        // A value that starts with this claim's own fence is this claim: the command was
        // applied once already and only its reply was lost, and the cluster client resent it.
        if let Some(value) = previous.filter(|value| !value.starts_with(&fence(token))) {
            return decode(value).map(ClaimOutcome::Existing);
        }
        if let (Some(wait), Some(acknowledged)) = (self.replica_wait, acknowledged) {
            if acknowledged < i64::from(wait.replicas) {
                // Withdraw it, so the client's retry need not wait for the lease. Should the
                // release fail too, the claim ends with its lease like a dead owner's.
                let _ = self
                    .fenced(RELEASE.key(&redis_key).arg(&fence(token)[..]))
                    .await;
                return Err(StoreError::backend(BACKEND, wait.fell_short(acknowledged)));
            }
        }
        Ok(ClaimOutcome::Claimed(token))
    }

    async fn renew(&self, key: &StoreKey, token: Token, lease: Duration) -> Result<(), StoreError> {
        self.fenced(
            RENEW
                .key(self.redis_key(key))
                .arg(&fence(token)[..])
                .arg(millis(lease)?),
        )
        .await
    }

    async fn complete(
        &self,
        key: &StoreKey,
        token: Token,
        payload: Bytes,
        retention: Duration,
    ) -> Result<(), StoreError> {
        let redis_key = self.redis_key(key);
        let mut complete = COMPLETE.key(&redis_key);
        complete
            .arg(&fence(token)[..])
            .arg(&completed_fence(token)[..])
            .arg(&payload[..])
            .arg(millis(retention)?);
        self.fenced(self.publishing(&mut complete, &redis_key))
            .await
    }

    async fn release(&self, key: &StoreKey, token: Token) -> Result<(), StoreError> {
        let redis_key = self.redis_key(key);
        let mut release = RELEASE.key(&redis_key);
        release.arg(&fence(token)[..]);
        self.fenced(self.publishing(&mut release, &redis_key)).await
    }

    async fn lookup(&self, key: &StoreKey) -> Result<Option<Record>, StoreError> {
        let value: Option<Vec<u8>> = redis::cmd("GET")
            .arg(self.redis_key(key))
            .query_async(&mut self.connection.clone())
            .await
            .map_err(backend)?;
        value.map(decode).transpose()
    }

    async fn forget(&self, key: &StoreKey) -> Result<bool, StoreError> {
        let deleted: u64 = redis::cmd("DEL")
            .arg(self.redis_key(key))
            .query_async(&mut self.connection.clone())
            .await
            .map_err(backend)?;
        Ok(deleted > 0)
    }

    async fn purge_expired(&self, _batch: u32) -> Result<u64, StoreError> {
        // Every record carries its own PX, and Redis deletes expired keys by itself; finding
        // ours would mean a SCAN of the whole keyspace, on every node of a cluster.
        Ok(0)
    }

    fn completions(&self) -> Option<Completions> {
        self.notifier.as_ref().map(Notifier::subscribe)
    }
}

fn backend(error: RedisError) -> StoreError {
    StoreError::backend(BACKEND, error)
}
