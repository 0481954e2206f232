//! The [`Store`] trait — the one place where the race between duplicates is refereed — and its
//! backends, each behind its own cargo feature.
//!
//! # The contract
//!
//! Every implementation must honour all of the following; the shared conformance suite in
//! `tests/` checks each point against every backend with real servers.
//!
//! 1. **`claim` is one atomic operation.** It either records a new in-progress claim with a
//!    fresh [`Token`] and a lease of the given length, or reports the live record that is
//!    there. A record whose lease ran out, or a completed record past its retention, counts
//!    as absent and is taken over *by the same operation*. Two concurrent `claim`s on one key
//!    never both return [`ClaimOutcome::Claimed`] while the first lease is live. A
//!    lookup followed by an insert is not a claim.
//! 2. **`complete`, `release` and `renew` are fenced by the token.** They act only while the
//!    stored record is in progress under exactly that token. Otherwise they change nothing and
//!    return [`StoreError::StaleToken`].
//! 3. **`lookup` reports only live records** (same expiry rule as `claim`), and may be
//!    called freely by waiters: it never decides who runs. **`forget` deletes** whatever is
//!    under a key, unfenced: an operator's tool, which the engine never calls.
//! 4. **Clocks are the store's.** Leases and retention are measured by the store's own clock
//!    (the database's `now()`, Redis server time, the process' monotonic clock in memory),
//!    never by a timestamp the application passes in.
//! 5. **Payloads round-trip byte for byte**, including empty and non-UTF-8 payloads.
//! 6. **Errors stay typed**: a failure of the backend is [`StoreError::Backend`] with the
//!    backend's own error as its source; callers treat it as "the store is unavailable".
//!
//! No operation has a default implementation: a default built from other methods could not be
//! atomic. The one default, [`Store::completions`], is not an operation on records but an
//! optional capability (completion notifications, which only make waiters look sooner); a
//! store without it returns `None` and the waiters of other processes poll.
//!
//! # Backends
//!
//! | feature | store | the one atomic claim |
//! |---|---|---|
//! | `memory` (default) | `MemoryStore` (sharded hash tables, byte budget) | decide and write under the key's shard lock |
//! | `postgres` | `PostgresStore` (sqlx) | `INSERT .. ON CONFLICT .. DO UPDATE .. WHERE expired` |
//! | `sqlite` | `SqliteStore` (sqlx) | `INSERT .. ON CONFLICT .. DO UPDATE .. WHERE expired RETURNING` |
//! | `mysql` | `MySqlStore` (sqlx, MySQL and MariaDB) | `INSERT .. ON DUPLICATE KEY UPDATE` |
//! | `redis` | `RedisStore` | `SET .. NX PX` |
//! | `axum` | — | `IntoResponse` for rejections, precondition extractors |
//!
//! All five pass one conformance suite (`tower_idempotency::conformance`, feature `conformance`)
//! against real servers. Leases and
//! retention use the store's clock (`now()`, Redis `PX`), never the application's.
//!
//! `MemoryStore` never evicts a live claim or a completed record within its retention. It holds
//! at most a byte budget (`MemoryStore::builder().max_bytes(..)`, default 256 MiB), charging each
//! record its payload plus a fixed `MemoryStore::RECORD_OVERHEAD` (80 bytes: the key is kept as
//! the first 16 bytes of its SHA-256, a 128-bit identity). When the budget is used up, a claim on
//! a new key fails with `StoreError::Full`: the layer answers 503 without running the handler,
//! keys already stored still replay, and one warning is logged per episode (`refused_claims()`
//! counts them).
//! `examples/memory_per_record` measures the real memory per record.
//!
//! # Past one database server: failover and Galera
//!
//! Measured with two processes under load while the primary is killed or partitioned and
//! the standby promoted (Patroni, HAProxy in front), and on a MariaDB Galera cluster with
//! writes on two nodes (BENCHMARKS.md, "Database failover and Galera"):
//!
//! - **No double and nothing lost** takes synchronous replication: PostgreSQL with the
//!   standby in `synchronous_standby_names` and `synchronous_commit = on` (Patroni's
//!   `synchronous_mode`), so the primary acknowledges a commit only once the standby has it,
//!   and only that standby is promoted. The transactional mode then has no double and loses
//!   nothing; the separate mode keeps only its documented double (a key whose effect committed
//!   while its record was cut off by the failover). The cost is one standby round trip per
//!   commit: on one machine a few milliseconds, smaller than the runs' own noise there; more
//!   across a real network.
//! - **Asynchronous replication** can lose the last commits the old primary acknowledged. In
//!   the transactional mode the effect and its record go together: a client may hold a `201`
//!   whose charge is gone, and a retry runs the key again (once). In the separate mode a lost
//!   claim or record can also let a retry run a key whose effect survived: a double.
//! - The pools find the new primary by themselves when they connect through something that
//!   follows it (HAProxy on Patroni's `/primary`, a DNS name): sqlx has no multi-host URL. A
//!   connection that reached a server refusing writes (PostgreSQL `25006`, MariaDB 1290 /
//!   1792, Galera 1047) is closed rather than lent out again, and the operation answers
//!   "unavailable", so the next one opens a connection where the proxy points now.
//! - The engine's store time limit bounds every call on a dead primary; the transactional
//!   mode answers a commit cut by the failover `503 outcome-unknown`, and the retry learns it.
//! - **MariaDB Galera** (multi-primary): two claims of one key on two nodes both succeed
//!   locally and one fails at commit (1213, certification). `MySqlStore`'s claim retries and
//!   finds the winner's record; the transactional mode answers the losing commit as a
//!   duplicate (the winner's outcome, by the in-progress policy); no double. An abort that
//!   hits one of the handler's own statements (the handler then fails, a 500 in the example)
//!   is found at the rollback and answered the same way: the winner's outcome, not the 500.
//!
//! # Writing a store
//!
//! A backend is one implementation of `store::Store`. Its contract is above:
//! `claim` is ONE atomic operation (a lookup followed by an insert is not a claim); `renew`,
//! `complete` and `release` act only under the claim's token (else `StoreError::StaleToken`);
//! `lookup` reports live records only; `forget` deletes a key's record whatever its state; leases and retention run on the store's clock; payloads
//! round-trip byte for byte; backend failures are `StoreError::Backend` with their source.
//!
//! Its tests run the public conformance suite (feature `conformance`): each check takes a store
//! and panics on a violation, `conformance::run_all` takes a factory and runs them all. A store
//! outside this crate adds `tower-idempotency = { version = "0.1", features = ["conformance"] }`
//! to its dev-dependencies and runs it as the
//! [`conformance` module docs](https://docs.rs/tower-idempotency/latest/tower_idempotency/conformance/) show.
//!
//! A backend inside this crate touches, in order:
//!
//! 1. **Cargo feature**: `[features]` in `Cargo.toml`, with its client crate as an optional
//!    dependency (`dep:...`), and added to the self dev-dependency's feature list.
//! 2. **Module**: `src/store/<backend>.rs` (or a folder), declared and re-exported in
//!    `src/store/mod.rs` under `#[cfg(feature = "<backend>")]`. A SQL backend uses the shared
//!    pieces in `src/sql/` (`TableName`, error mapping, row decoding) and the one store builder
//!    (`SqlStoreBuilder`: setters never fail, `build()` validates); others follow the same shape.
//! 3. **Tests**: `tests/store_<backend>.rs` invokes `conformance_tests!` (from
//!    `tests/conformance/mod.rs`) with a factory that opens a new instance per call, plus tests
//!    of what is the backend's own (schema, table names, typed errors).
//! 4. **Services**: `scripts/services.sh` starts the server (`ensure_<backend>`) and exports
//!    `TEST_<BACKEND>_URL` from `ensure_services`; tests skip without it unless
//!    `TEST_REQUIRE_ALL_BACKENDS=1`.
//! 5. **Benchmarks**: a case in `benches/stores.rs` (claim and replay), and, for a load figure,
//!    a section of its own in `scripts/bench.d/<name>.sh`.
//! 6. **Docs**: a row in the table under [Backends](#backends) here and in the README's store table.
//!
//! # Clearing a record that cannot be read
//!
//! A record the store cannot decode (`StoreError::Corrupt`: damaged, or written by another
//! program or a format this version does not read), or one whose stored HTTP response does
//! not decode, is a permanent condition: every request with its key is answered `500`
//! `urn:tower-idempotency:record-unreadable` (gRPC `DATA_LOSS`), runs nothing, and is counted
//! (`idempotency_requests_total{outcome="record_unreadable"}`), until the record expires or an
//! operator removes it. Each answer is logged at error level with the key's log id and its
//! scope; the client knows its key. Remove the record with [`Store::forget`]:
//!
//! ```no_run
//! # async fn clear(layer: tower_idempotency::IdempotencyLayer) -> Result<(), tower_idempotency::store::StoreError> {
//! use tower_idempotency::StoreKey;
//! // The scope from the error log, the key from the client.
//! let key = StoreKey::new("auth:3f7a9c0e5b1d2c4a8e6f0b1c2d3e4f5a", "order-7");
//! let removed = layer.engine().store().forget(&key).await?;
//! # let _ = removed; Ok(()) }
//! ```
//!
//! or in the store itself: `DELETE FROM tower_idempotency_records WHERE scope = '…' AND key =
//! '…'` (MySQL: `` `key` ``), or Redis `DEL <prefix><hex digest>` (`RedisStore::redis_key`).
//! The next request with the key then runs the operation again: check first whether the
//! original took effect.
//!
//! # Redis: one node or a Redis Cluster
//!
//! `RedisStore::open(url)` runs on one server; `RedisStore::open_cluster(nodes)` on a Redis
//! Cluster (or Valkey cluster), following `MOVED`/`ASK` redirects. A record is ONE key,
//! `prefix + hex(SHA-256(scope, key))`, and every command and Lua script touches only that key,
//! so each operation runs on the one master owning its slot. The default layout has **no hash
//! tag**: records spread over all masters. A prefix with a tag (`"{idem}:"`) pins them all to one
//! slot, i.e. one master. After an operation fails for a lost node, the store rebuilds its
//! cluster connection from the current slot map, so it reaches the promoted replica after a
//! failover (redis-rs 0.32 alone keeps dialling the dead master).
//!
//! Replication is asynchronous: a master can acknowledge a claim and die before its replica has
//! it. `RedisStore::builder().wait_for_replicas(1, timeout)` pipelines `WAIT 1 <ms>` behind each
//! claim, so the handler runs only under a claim a replica holds:
//!
//! | | no replica wait (default) | `wait_for_replicas(1, t)` |
//! |---|---|---|
//! | cost per claim | one round trip | plus one replication round trip; WAIT holds the connection to that master meanwhile |
//! | a master is SIGKILLed | a claim not yet replicated is lost; a duplicate reaching the promoted replica runs **again** | no second run while the lease lasts (the claim is on the promoted replica) |
//! | a master has no live replica | claims work | every claim on that master waits `t`, is withdrawn and answered 503 (`ReplicaWaitTimedOut`) until a replica is back |
//! | measured failover, two runs (`tests/store_redis_cluster.rs`: 3 masters + 3 replicas on one 2-core machine, 400-460 keys x 2 service instances, one master SIGKILLed, promoted in 2.1-2.6 s, killed node back in sync 4.4-5.7 s later) | 19 / 38 keys saw a 503, **0 ran twice**, every key got its 201 | 61 / 78 keys saw a 503, 41 / 65 got no 201 within 10 s (their master had no replica until the killed node rejoined), **0 ran twice** |
//!
//! Its cost, from `scripts/bench` section 7 (`BENCH_ONLY=redis-cluster`; two payments processes,
//! each with its own loadgen, unique keys, 2 x 5 s per arm, everything on one loaded 2-core
//! machine): one node 14,303 req/s; the 3-master cluster 9,068 req/s (0.63x: six servers and the
//! cluster client share the same two cores, so this shows the client's overhead, not the
//! scale-out separate machines give); the cluster with `WAIT 1 500` 5,046 req/s (0.35x, the wait
//! takes 44% of the cluster's throughput).
//!
//! The wait covers the claim, not the completed outcome: an outcome lost with its master leaves
//! the replicated claim, so duplicates get "in progress" until the lease ends. `scripts/services.sh`
//! starts a local 3-master / 3-replica cluster on 127.0.0.1:7000-7005 for the tests
//! (`TEST_REDIS_CLUSTER_URLS`); the payments example takes `REDIS_CLUSTER_URLS` (or a `REDIS_URL`
//! with several comma-separated nodes) and `REDIS_REPLICA_WAIT_MS`.
//!
//! Redis must keep every record until its own expiry: run it with `maxmemory-policy
//! noeviction` (every record has a `PX`, so `volatile-*` and `allkeys-*` policies evict live
//! claims and completed records, and their duplicates run again). `RedisStore::open*` asks every
//! node and refuses an evicting one (`StoreError::EvictingPolicy`) unless told to warn
//! (`RedisStoreBuilder::on_evicting_policy`). A restart without persistence forgets every
//! record; what RDB and the AOF keep is in `RedisStore`'s "Memory and persistence".

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use bytes::Bytes;

use crate::record::{ClaimOutcome, Fingerprint, Record, StoreKey, Token};

mod completions;
mod error;
#[cfg(feature = "memory")]
mod memory;
#[cfg(feature = "mysql")]
pub(crate) mod mysql;
#[cfg(feature = "postgres")]
pub(crate) mod pg_notify;
#[cfg(feature = "postgres")]
mod postgres;
mod purger;
#[cfg(feature = "redis")]
mod redis;
#[cfg(feature = "sqlx")]
mod sql_builder;
#[cfg(feature = "sqlite")]
pub(crate) mod sqlite;

#[cfg(feature = "redis")]
pub(crate) use self::redis::JournalSlot;
#[cfg(feature = "redis")]
pub use self::redis::{
    EvictingPolicy, InvalidPrefix, OnEvictingPolicy, RedisStore, RedisStoreBuilder,
    ReplicaWaitTimedOut,
};
#[cfg(any(feature = "postgres", feature = "redis"))]
pub(crate) use completions::{keep_listening, Feed, Sender as CompletionSender};
pub use completions::{Completion, Completions};
pub use error::StoreError;
#[cfg(feature = "memory")]
pub use memory::{MemoryStore, MemoryStoreBuilder};
#[cfg(feature = "mysql")]
pub use mysql::{MySqlStore, MySqlStoreBuilder};
#[cfg(feature = "postgres")]
pub use postgres::{PostgresStore, PostgresStoreBuilder};
pub use purger::spawn_purger;
#[cfg(feature = "sqlx")]
pub use sql_builder::{SqlStore, SqlStoreBuilder};
#[cfg(feature = "sqlite")]
pub use sqlite::{SqliteStore, SqliteStoreBuilder};

/// Storage for idempotency records. See the [module docs](self) for the contract every
/// implementation must keep.
///
/// Implementations are cheap to share: the layer keeps one behind an `Arc`.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Atomically claims `key` for a request with `fingerprint`, or reports the live record
    /// that is already there. A claim lives for `lease` unless renewed or completed.
    async fn claim(
        &self,
        key: &StoreKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<ClaimOutcome, StoreError>;

    /// Extends the lease of the claim held with `token` to `lease` from now (store clock).
    async fn renew(&self, key: &StoreKey, token: Token, lease: Duration) -> Result<(), StoreError>;

    /// Turns the claim held with `token` into a completed record holding `payload`, kept for
    /// `retention` from now (store clock).
    async fn complete(
        &self,
        key: &StoreKey,
        token: Token,
        payload: Bytes,
        retention: Duration,
    ) -> Result<(), StoreError>;

    /// Deletes the claim held with `token`, so that the next `claim` runs the operation again.
    async fn release(&self, key: &StoreKey, token: Token) -> Result<(), StoreError>;

    /// The live record under `key`, if any.
    async fn lookup(&self, key: &StoreKey) -> Result<Option<Record>, StoreError>;

    /// Deletes whatever is stored under `key` (a claim in progress, a completed record, a
    /// record the store cannot read), whoever holds it; returns whether there was one. The
    /// next request with the key runs the operation again.
    ///
    /// An operator's tool, never called by the engine: it clears a record that answers
    /// `record-unreadable` ([`StoreError::Corrupt`]), or lets a key run again on purpose. Not
    /// while the key's operation may still be running: its owner loses the claim (its
    /// `complete` and `release` then find a stale token), and a duplicate may run alongside.
    async fn forget(&self, key: &StoreKey) -> Result<bool, StoreError>;

    /// Deletes up to `batch` expired records (expired claims and completed records past their
    /// retention) and returns how many it deleted. Call it repeatedly until it returns less
    /// than `batch` to purge everything; each call is short so it never holds long locks.
    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError>;

    /// A subscription to the store's completion notifications, if it has them: every
    /// `complete` and `release` (by any process) is announced with the key's digest, so that
    /// waiters in this process look at once instead of at their next poll. Called inside a
    /// Tokio runtime; the first call starts the store's one listening connection.
    ///
    /// Optional (the default is `None`: waiters poll). A notification is a hint, never
    /// required for correctness: it may be lost, and waiters keep polling at a slower pace.
    ///
    /// PostgreSQL (`LISTEN`/`NOTIFY`, when turned on with
    /// `PostgresStoreBuilder::completion_notifications`) and Redis on one server (pub/sub)
    /// have them. MySQL /
    /// MariaDB and SQLite have no such primitive and Redis Cluster does not use one (see
    /// `RedisStoreBuilder::notify_with`): their waiters in other processes poll, 5 ms doubling to
    /// 250 ms. The memory store serves one process, whose waiters its owners wake directly.
    fn completions(&self) -> Option<Completions> {
        None
    }
}

#[async_trait]
impl<S: Store + ?Sized> Store for Arc<S> {
    async fn claim(
        &self,
        key: &StoreKey,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<ClaimOutcome, StoreError> {
        (**self).claim(key, fingerprint, lease).await
    }

    async fn renew(&self, key: &StoreKey, token: Token, lease: Duration) -> Result<(), StoreError> {
        (**self).renew(key, token, lease).await
    }

    async fn complete(
        &self,
        key: &StoreKey,
        token: Token,
        payload: Bytes,
        retention: Duration,
    ) -> Result<(), StoreError> {
        (**self).complete(key, token, payload, retention).await
    }

    async fn release(&self, key: &StoreKey, token: Token) -> Result<(), StoreError> {
        (**self).release(key, token).await
    }

    async fn lookup(&self, key: &StoreKey) -> Result<Option<Record>, StoreError> {
        (**self).lookup(key).await
    }

    async fn forget(&self, key: &StoreKey) -> Result<bool, StoreError> {
        (**self).forget(key).await
    }

    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        (**self).purge_expired(batch).await
    }

    fn completions(&self) -> Option<Completions> {
        (**self).completions()
    }
}
