//! The Redis store. Its documentation is on [`RedisStore`], the module being private.

use std::{
    fmt,
    sync::{Arc, LazyLock},
    time::Duration,
};

use async_trait::async_trait;
use bytes::Bytes;
use redis::{
    aio::{ConnectionManager, ConnectionManagerConfig},
    RedisError, Script,
};

use super::{Store, StoreError};
use crate::record::{ClaimOutcome, Fingerprint, Record, StoreKey, Token};

const BACKEND: &str = "redis";

/// Bumped whenever the value layout changes; a value with another version is `Corrupt`.
const FORMAT_VERSION: u8 = 1;
const IN_PROGRESS: u8 = 0;
const COMPLETED: u8 = 1;
/// Version, state and token: the bytes the fencing scripts compare.
const FENCE_LEN: usize = 2 + 16;
/// The fence plus the fingerprint; the payload follows.
const HEADER_LEN: usize = FENCE_LEN + 32;

const DEFAULT_PREFIX: &str = "tower-idempotency:";
const MAX_PREFIX_LEN: usize = 256;

// The fencing scripts compare only the first #fence bytes (GETRANGE), so a completed record's
// payload is never copied into Lua just to be refused. A missing key reads as "", which never
// equals a fence. Each returns 1 when it acted and 0 when the token does not hold the claim.

/// KEYS[1] record; ARGV[1] fence; ARGV[2] completed header without fingerprint (version,
/// state, token); ARGV[3] payload; ARGV[4] retention in ms. The fingerprint is spliced from
/// the claim, because `complete` is not given it.
static COMPLETE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local fence = ARGV[1]
if redis.call('GETRANGE', KEYS[1], 0, #fence - 1) ~= fence then
  return 0
end
local fingerprint = redis.call('GETRANGE', KEYS[1], #fence, -1)
redis.call('SET', KEYS[1], ARGV[2] .. fingerprint .. ARGV[3], 'PX', ARGV[4])
return 1
",
    )
});

/// KEYS[1] record; ARGV[1] fence.
static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local fence = ARGV[1]
if redis.call('GETRANGE', KEYS[1], 0, #fence - 1) ~= fence then
  return 0
end
redis.call('DEL', KEYS[1])
return 1
",
    )
});

/// KEYS[1] record; ARGV[1] fence; ARGV[2] lease in ms.
static RENEW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local fence = ARGV[1]
if redis.call('GETRANGE', KEYS[1], 0, #fence - 1) ~= fence then
  return 0
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
",
    )
});

/// A [`Store`] on Redis 7.0+, over a [`ConnectionManager`] that reconnects by itself: when the
/// server comes back after an outage, the same store works again without a restart. Clones
/// share the connection.
///
/// ```no_run
/// use tower_idempotency::store::RedisStore;
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let store = RedisStore::open("redis://127.0.0.1:6379").await?;
/// # let _ = store;
/// # Ok(())
/// # }
/// ```
///
/// # How the contract is kept
///
/// - **Claim** is the single command `SET key value NX PX <lease> GET`: it writes the claim
///   only when the key is absent and returns what was there otherwise, in one step. Combining
///   `NX` with `GET` needs **Redis 7.0 or newer** (older servers reject the command with a
///   syntax error, which surfaces as [`StoreError::Backend`]).
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
/// # Keys and Redis Cluster
///
/// A record lives under `prefix + hex(SHA-256(scope, key))` (see [`StoreKey::digest`]): fixed
/// length, unambiguous, and the raw client key never reaches Redis. Every operation touches
/// exactly one key (scripts declare it in `KEYS`), so the store works unchanged on Redis
/// Cluster. Records spread over all slots; to pin them to one slot, put a hash tag in the
/// prefix, such as `"{idem}:"`.
///
/// # Value layout
///
/// One binary string: a format version byte, a state byte (in progress / completed), the
/// 16-byte token, the 32-byte fingerprint, then the payload (empty while in progress).
/// Anything else under a key is reported as [`StoreError::Corrupt`].
///
/// # Connection and durability
///
/// [`open`](Self::open) connects with [`connection_config`](Self::connection_config): while
/// Redis is unreachable operations fail at once with [`StoreError::Backend`], and the store
/// reconnects by itself when it is back. A record is only as durable as Redis keeps it: a
/// restart without persistence, or a failover to a replica that had not yet received a claim,
/// forgets it, and a duplicate arriving then runs again.
#[derive(Clone)]
pub struct RedisStore {
    connection: ConnectionManager,
    prefix: Arc<str>,
}

/// Builds a [`RedisStore`] with a key prefix other than the default `"tower-idempotency:"`.
///
/// ```no_run
/// use tower_idempotency::store::RedisStore;
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let store = RedisStore::builder()
///     .prefix("payments:{idem}:")?
///     .open("redis://127.0.0.1:6379")
///     .await?;
/// # let _ = store;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct RedisStoreBuilder {
    prefix: Arc<str>,
}

/// A key prefix that [`RedisStoreBuilder::prefix`] refused, with the reason.
///
/// ```
/// use tower_idempotency::store::RedisStore;
/// let err = RedisStore::builder().prefix("my app:").unwrap_err();
/// assert_eq!(err.prefix, "my app:");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid Redis key prefix {prefix:?}: {reason}; use 1-256 bytes without whitespace or control characters")]
pub struct InvalidPrefix {
    /// The prefix as given.
    pub prefix: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

impl RedisStoreBuilder {
    /// Sets the prefix of every key this store writes (default `"tower-idempotency:"`).
    ///
    /// It must be 1 to 256 bytes without whitespace or control characters, so that keys stay
    /// readable in `redis-cli` and `SCAN MATCH prefix*` finds exactly this store's records.
    /// A hash tag (`"{idem}:"`) pins every record to one Redis Cluster slot.
    ///
    /// ```
    /// use tower_idempotency::store::RedisStore;
    /// assert!(RedisStore::builder().prefix("app:{idem}:").is_ok());
    /// assert!(RedisStore::builder().prefix("").is_err());
    /// ```
    pub fn prefix(mut self, prefix: impl Into<String>) -> Result<Self, InvalidPrefix> {
        let prefix = prefix.into();
        let reason = if prefix.is_empty() {
            Some("empty")
        } else if prefix.len() > MAX_PREFIX_LEN {
            Some("longer than 256 bytes")
        } else if prefix.chars().any(char::is_whitespace) {
            Some("contains whitespace")
        } else if prefix.chars().any(char::is_control) {
            Some("contains a control character")
        } else {
            None
        };
        match reason {
            Some(reason) => Err(InvalidPrefix { prefix, reason }),
            None => {
                self.prefix = prefix.into();
                Ok(self)
            }
        }
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
    /// let config = RedisStore::connection_config().set_response_timeout(Duration::from_secs(1));
    /// let manager = ConnectionManager::new_with_config(client, config).await?;
    /// let store = RedisStore::builder().prefix("app:")?.build(manager);
    /// # let _ = store;
    /// # Ok(())
    /// # }
    /// ```
    pub fn build(self, connection: ConnectionManager) -> RedisStore {
        RedisStore {
            connection,
            prefix: self.prefix,
        }
    }

    /// Connects to `url` with [`RedisStore::connection_config`] and builds the store.
    ///
    /// Fails with [`StoreError::Backend`] (the [`RedisError`] as its source) when the URL is
    /// invalid or the server cannot be reached now; once connected, later outages are
    /// reported per operation and healed by reconnecting.
    pub async fn open(self, url: &str) -> Result<RedisStore, StoreError> {
        let client = redis::Client::open(url).map_err(backend)?;
        let connection =
            ConnectionManager::new_with_config(client, RedisStore::connection_config())
                .await
                .map_err(backend)?;
        Ok(self.build(connection))
    }
}

impl Default for RedisStoreBuilder {
    fn default() -> Self {
        Self {
            prefix: DEFAULT_PREFIX.into(),
        }
    }
}

impl RedisStore {
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
        Self::builder().build(connection)
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

    /// A builder to set the key prefix.
    ///
    /// ```
    /// use tower_idempotency::store::RedisStore;
    /// let builder = RedisStore::builder().prefix("app:idem:").unwrap();
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
    /// let config = RedisStore::connection_config().set_response_timeout(Duration::from_secs(1));
    /// # let _ = config;
    /// ```
    pub fn connection_config() -> ConnectionManagerConfig {
        ConnectionManagerConfig::new()
            .set_number_of_retries(0)
            .set_connection_timeout(Duration::from_secs(2))
            .set_response_timeout(Duration::from_secs(5))
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
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
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
        let mut value = Vec::with_capacity(HEADER_LEN);
        value.extend_from_slice(&fence(token));
        value.extend_from_slice(fingerprint.as_bytes());
        let previous: Option<Vec<u8>> = redis::cmd("SET")
            .arg(self.redis_key(key))
            .arg(value)
            .arg("NX")
            .arg("PX")
            .arg(millis(lease)?)
            .arg("GET")
            .query_async(&mut self.connection.clone())
            .await
            .map_err(backend)?;
        match previous {
            None => Ok(ClaimOutcome::Claimed(token)),
            Some(value) => decode(value).map(ClaimOutcome::Existing),
        }
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
        let mut completed = [0u8; FENCE_LEN];
        completed[0] = FORMAT_VERSION;
        completed[1] = COMPLETED;
        completed[2..].copy_from_slice(&token.to_bytes());
        self.fenced(
            COMPLETE
                .key(self.redis_key(key))
                .arg(&fence(token)[..])
                .arg(&completed[..])
                .arg(&payload[..])
                .arg(millis(retention)?),
        )
        .await
    }

    async fn release(&self, key: &StoreKey, token: Token) -> Result<(), StoreError> {
        self.fenced(RELEASE.key(self.redis_key(key)).arg(&fence(token)[..]))
            .await
    }

    async fn lookup(&self, key: &StoreKey) -> Result<Option<Record>, StoreError> {
        let value: Option<Vec<u8>> = redis::cmd("GET")
            .arg(self.redis_key(key))
            .query_async(&mut self.connection.clone())
            .await
            .map_err(backend)?;
        value.map(decode).transpose()
    }

    async fn purge_expired(&self, _batch: u32) -> Result<u64, StoreError> {
        // Every record carries its own PX, and Redis deletes expired keys by itself; finding
        // ours would mean a SCAN of the whole keyspace, on every node of a cluster.
        Ok(0)
    }
}

/// The bytes that identify a live claim held by `token`: the start of its value.
fn fence(token: Token) -> [u8; FENCE_LEN] {
    let mut fence = [0u8; FENCE_LEN];
    fence[0] = FORMAT_VERSION;
    fence[1] = IN_PROGRESS;
    fence[2..].copy_from_slice(&token.to_bytes());
    fence
}

fn decode(value: Vec<u8>) -> Result<Record, StoreError> {
    if value.len() < HEADER_LEN {
        return Err(corrupt(format!(
            "value has {} bytes, shorter than the {HEADER_LEN}-byte header",
            value.len()
        )));
    }
    if value[0] != FORMAT_VERSION {
        return Err(corrupt(format!(
            "value has format version {}, expected {FORMAT_VERSION}",
            value[0]
        )));
    }
    let mut fingerprint = [0u8; 32];
    fingerprint.copy_from_slice(&value[FENCE_LEN..HEADER_LEN]);
    let fingerprint = Fingerprint::from_bytes(fingerprint);
    match value[1] {
        IN_PROGRESS if value.len() == HEADER_LEN => Ok(Record::InProgress { fingerprint }),
        IN_PROGRESS => Err(corrupt("an in-progress value carries a payload".into())),
        // Bytes::from takes the Vec without copying; slicing shares it.
        COMPLETED => Ok(Record::Completed {
            fingerprint,
            payload: Bytes::from(value).slice(HEADER_LEN..),
        }),
        state => Err(corrupt(format!("value has unknown state {state}"))),
    }
}

/// A lease or retention for `PX` / `PEXPIRE`: whole milliseconds, rounded up so a sub-
/// millisecond duration does not become `0` (which Redis refuses); durations Redis cannot
/// add to its clock are a configuration error rather than a wrap-around.
fn millis(duration: Duration) -> Result<u64, StoreError> {
    let millis = duration.as_nanos().div_ceil(1_000_000).max(1);
    u64::try_from(millis)
        .ok()
        .filter(|&millis| millis <= i64::MAX as u64 / 2)
        .ok_or_else(|| StoreError::Config(format!("duration {duration:?} is too long for Redis")))
}

fn backend(error: RedisError) -> StoreError {
    StoreError::backend(BACKEND, error)
}

fn corrupt(detail: String) -> StoreError {
    StoreError::Corrupt {
        backend: BACKEND,
        detail,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encoded(state: u8, payload: &[u8]) -> Vec<u8> {
        let mut value = vec![FORMAT_VERSION, state];
        value.extend_from_slice(&Token::random().to_bytes());
        value.extend_from_slice(Fingerprint::of([b"f".as_slice()]).as_bytes());
        value.extend_from_slice(payload);
        value
    }

    #[test]
    fn decodes_both_states() {
        assert_eq!(
            decode(encoded(IN_PROGRESS, b"")).unwrap(),
            Record::InProgress {
                fingerprint: Fingerprint::of([b"f".as_slice()])
            }
        );
        assert_eq!(
            decode(encoded(COMPLETED, b"\0body")).unwrap(),
            Record::Completed {
                fingerprint: Fingerprint::of([b"f".as_slice()]),
                payload: Bytes::from_static(b"\0body"),
            }
        );
    }

    #[test]
    fn refuses_what_it_did_not_write() {
        let mut wrong_version = encoded(COMPLETED, b"x");
        wrong_version[0] = 9;
        for value in [
            Vec::new(),
            b"hello".to_vec(),
            wrong_version,
            encoded(7, b""),
            encoded(IN_PROGRESS, b"payload"),
        ] {
            assert!(
                matches!(decode(value.clone()), Err(StoreError::Corrupt { .. })),
                "{value:?} decoded"
            );
        }
    }

    #[test]
    fn millis_never_rounds_to_zero_or_wraps() {
        assert_eq!(millis(Duration::from_nanos(1)).unwrap(), 1);
        assert_eq!(millis(Duration::from_micros(1500)).unwrap(), 2);
        assert_eq!(millis(Duration::from_secs(30)).unwrap(), 30_000);
        assert!(matches!(millis(Duration::MAX), Err(StoreError::Config(_))));
    }

    #[test]
    fn prefix_validation() {
        for bad in [
            "",
            "a b",
            "a\tb",
            "line\n",
            "nul\0",
            "\u{7f}",
            &"x".repeat(257),
        ] {
            assert!(RedisStore::builder().prefix(bad).is_err(), "{bad:?}");
        }
        for good in ["tower-idempotency:", "{idem}:", "ünï:", "x"] {
            assert!(RedisStore::builder().prefix(good).is_ok(), "{good:?}");
        }
    }
}
