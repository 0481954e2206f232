//! What a [`Store`](crate::store::Store) keeps per key: the scoped key itself, the request
//! fingerprint, the owner's fencing token, and the outcome of a claim.
//!
//! Nothing in this module knows about HTTP: the HTTP layer encodes a response into the opaque
//! `payload` bytes, a message consumer stores whatever it wants there.

use std::{
    fmt,
    sync::{Arc, OnceLock},
};

use bytes::Bytes;
use sha2::{Digest, Sha256};

/// The key a record is stored under: the caller's scope plus the client's idempotency key.
///
/// The scope namespaces keys so that one caller's key can never replay another caller's
/// response (by default the HTTP layer derives it from a hash of the `Authorization` header).
/// Stores must treat `(scope, key)` as the identity of a record and must never confuse two
/// keys whose concatenation happens to be equal.
///
/// Cheap to clone (one shared allocation); its [`digest`](Self::digest) is computed once.
#[derive(Clone)]
pub struct StoreKey(Arc<KeyParts>);

struct KeyParts {
    scope: String,
    key: String,
    /// Computed on first use: a request asks for it several times (claim, complete, logs).
    digest: OnceLock<[u8; 32]>,
}

impl StoreKey {
    /// Builds a key from a scope (may be empty: the anonymous scope) and a client key.
    ///
    /// ```
    /// use tower_idempotency::StoreKey;
    /// let key = StoreKey::new("tenant-42", "order-7");
    /// assert_eq!(key.scope(), "tenant-42");
    /// assert_eq!(key.key(), "order-7");
    /// ```
    pub fn new(scope: impl Into<String>, key: impl Into<String>) -> Self {
        Self(Arc::new(KeyParts {
            scope: scope.into(),
            key: key.into(),
            digest: OnceLock::new(),
        }))
    }

    /// The namespace of the key (a tenant, a principal, or a hash of credentials).
    pub fn scope(&self) -> &str {
        &self.0.scope
    }

    /// The client-supplied idempotency key.
    pub fn key(&self) -> &str {
        &self.0.key
    }

    /// A SHA-256 over the length-prefixed scope and key: unambiguous, fixed size, and safe to
    /// log or to use as a storage key where the raw key must not appear.
    pub fn digest(&self) -> [u8; 32] {
        *self.0.digest.get_or_init(|| {
            let mut hasher = FieldHasher::default();
            hasher
                .field(self.0.scope.as_bytes())
                .field(self.0.key.as_bytes());
            *hasher.finish().as_bytes()
        })
    }

    /// The first 16 hex digits of [`digest`](Self::digest): what tracing events show instead
    /// of the key, so logs never carry client keys.
    pub fn log_id(&self) -> String {
        hex(&self.digest()[..8])
    }

    /// [`log_id`](Self::log_id), computed only if something formats it: a span field that
    /// no subscriber records then costs no SHA-256 (the request path creates one per request).
    pub(crate) fn lazy_log_id(&self) -> impl fmt::Display + '_ {
        struct LogId<'a>(&'a StoreKey);
        impl fmt::Display for LogId<'_> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0.log_id())
            }
        }
        LogId(self)
    }
}

// The identity is (scope, key); the digest follows from it.
impl PartialEq for StoreKey {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
            || (self.0.scope == other.0.scope && self.0.key == other.0.key)
    }
}

impl Eq for StoreKey {}

impl std::hash::Hash for StoreKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.scope.hash(state);
        self.0.key.hash(state);
    }
}

impl fmt::Debug for StoreKey {
    // Keys may be secrets chosen by clients: Debug shows the hash, never the raw key.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("StoreKey").field(&self.log_id()).finish()
    }
}

/// A hash that identifies the request a key was first used with.
///
/// A later request under the same key with a different fingerprint is not a retry but a
/// client bug; the HTTP layer answers it with 422.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Wraps raw digest bytes (for example read back from a database column).
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// Hashes a sequence of fields. Each field is length-prefixed, so `["ab", "c"]` and
    /// `["a", "bc"]` give different fingerprints.
    ///
    /// ```
    /// use tower_idempotency::Fingerprint;
    /// let a = Fingerprint::of([b"POST".as_slice(), b"/payments", b"{}"]);
    /// let b = Fingerprint::of([b"POST".as_slice(), b"/payments", b"{ }"]);
    /// assert_ne!(a, b);
    /// ```
    pub fn of<'a>(fields: impl IntoIterator<Item = &'a [u8]>) -> Self {
        let mut hasher = FieldHasher::default();
        for field in fields {
            hasher.field(field);
        }
        hasher.finish()
    }

    /// The raw 32 bytes.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Lower-case hex of the 32 bytes (64 characters).
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }

    /// Parses the output of [`to_hex`](Self::to_hex); `None` for anything else.
    pub fn from_hex(text: &str) -> Option<Self> {
        parse_hex::<32>(text).map(Self)
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", &self.to_hex()[..16])
    }
}

/// The fencing token of one claim.
///
/// Every successful [`claim`](crate::store::Store::claim) — including one that takes over an
/// expired lease — gets a fresh token: 128 random bits in the database stores; in the memory
/// store, random bits for its shard and a sequence number that never repeats there (it keeps
/// only the latter per claim). `complete`, `release` and `renew` act only while the stored
/// token still equals theirs, so an owner whose lease was taken over cannot overwrite the new
/// owner's record.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Token(u128);

impl Token {
    /// A new random token (128 bits from the thread-local CSPRNG).
    pub fn random() -> Self {
        Self(rand::random())
    }

    /// Rebuilds a token from its 16 big-endian bytes.
    pub const fn from_bytes(bytes: [u8; 16]) -> Self {
        Self(u128::from_be_bytes(bytes))
    }

    /// The 16 big-endian bytes of the token.
    pub const fn to_bytes(self) -> [u8; 16] {
        self.0.to_be_bytes()
    }

    /// Lower-case hex (32 characters), for stores that keep text.
    pub fn to_hex(self) -> String {
        hex(&self.to_bytes())
    }

    /// Parses the output of [`to_hex`](Self::to_hex); `None` for anything else.
    pub fn from_hex(text: &str) -> Option<Self> {
        parse_hex::<16>(text).map(Self::from_bytes)
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Token({})", &self.to_hex()[..8])
    }
}

/// A live record as a store reports it. Expired records (a lease that ran out, a completed
/// record past its retention) are never reported: they count as absent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    /// Someone holds a live claim and is running the operation.
    InProgress {
        /// Fingerprint of the request that made the claim.
        fingerprint: Fingerprint,
    },
    /// The operation finished; its outcome is kept for replay until the record expires.
    Completed {
        /// Fingerprint of the request that made the claim.
        fingerprint: Fingerprint,
        /// The stored outcome, byte for byte as given to `complete`.
        payload: Bytes,
    },
}

impl Record {
    /// The fingerprint of the request that created the record.
    pub fn fingerprint(&self) -> &Fingerprint {
        match self {
            Record::InProgress { fingerprint } | Record::Completed { fingerprint, .. } => {
                fingerprint
            }
        }
    }
}

/// What one atomic [`claim`](crate::store::Store::claim) found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// The caller now owns the key (it was absent, expired, or its lease had run out) and must
    /// run the operation, then `complete` or `release` with this token.
    Claimed(Token),
    /// Someone else's live record is there; the caller must not run the operation.
    Existing(Record),
}

/// SHA-256 over length-prefixed fields, one at a time: what [`Fingerprint::of`] and
/// [`StoreKey::digest`] hash, for callers whose fields are not at hand as one sequence (the
/// HTTP fingerprint would otherwise collect them into a list per request).
#[derive(Default)]
pub(crate) struct FieldHasher(Sha256);

impl FieldHasher {
    /// Adds one field, length-prefixed.
    pub(crate) fn field(&mut self, field: &[u8]) -> &mut Self {
        self.0.update((field.len() as u64).to_be_bytes());
        self.0.update(field);
        self
    }

    /// The fingerprint of the fields added so far.
    pub(crate) fn finish(self) -> Fingerprint {
        Fingerprint(self.0.finalize().into())
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    push_hex(&mut out, bytes);
    out
}

/// Appends the lower-case hex of `bytes` to `out`.
pub(crate) fn push_hex(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for byte in bytes {
        out.push(DIGITS[usize::from(byte >> 4)] as char);
        out.push(DIGITS[usize::from(byte & 0xf)] as char);
    }
}

fn parse_hex<const N: usize>(text: &str) -> Option<[u8; N]> {
    let text = text.as_bytes();
    if text.len() != N * 2 {
        return None;
    }
    let mut out = [0u8; N];
    for (i, pair) in text.chunks_exact(2).enumerate() {
        let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
        out[i] = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scope_and_key_are_not_concatenated() {
        assert_ne!(
            StoreKey::new("ab", "c").digest(),
            StoreKey::new("a", "bc").digest()
        );
    }

    /// A golden value: stores find a record by this digest (the Redis key, the PostgreSQL
    /// advisory lock of the transactional mode, the settle notifications), so records written
    /// by one build must be found by the next. If the hashed bytes change, every record stored
    /// before an upgrade becomes unreachable after it, and a retry across the deploy runs its
    /// handler a second time. Never change this value without a migration note for users.
    #[test]
    fn the_key_digest_never_changes() {
        assert_eq!(
            hex(&StoreKey::new("tenant-42", "order-7").digest()),
            "651cc0439eee4229f98a70d0d025a9b161c59399b9a448f14f8234f8051d4b95"
        );
    }

    #[test]
    fn hex_round_trips() {
        let token = Token::random();
        assert_eq!(Token::from_hex(&token.to_hex()), Some(token));
        let fp = Fingerprint::of([b"x".as_slice()]);
        assert_eq!(Fingerprint::from_hex(&fp.to_hex()), Some(fp));
        assert_eq!(Token::from_hex("zz"), None);
        assert_eq!(Token::from_hex(&"g".repeat(32)), None);
    }

    #[test]
    fn debug_never_shows_the_raw_key() {
        let shown = format!("{:?}", StoreKey::new("scope", "secret-key"));
        assert!(!shown.contains("secret-key"), "{shown}");
    }
}
