//! The fencing scripts. Each touches exactly one key, its `KEYS[1]`, so it runs on whichever
//! cluster node owns that key's slot.
//!
//! They compare only the first #fence bytes (GETRANGE), so a completed record's payload is
//! never copied into Lua just to be refused. A missing key reads as "", which never equals a
//! fence. Each returns 1 when it acted and 0 when the token does not hold the claim.

use std::sync::LazyLock;

use redis::Script;

/// `KEYS[1]` record; `ARGV[1]` fence; `ARGV[2]` completed header without fingerprint (version,
/// state, token); `ARGV[3]` payload; `ARGV[4]` retention in ms; optionally `ARGV[5]` a channel to
/// publish `ARGV[6]` (the key's digest) to. The fingerprint is spliced from the claim, because
/// `complete` is not given it.
pub(super) static COMPLETE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local fence = ARGV[1]
if redis.call('GETRANGE', KEYS[1], 0, #fence - 1) ~= fence then
  return 0
end
local fingerprint = redis.call('GETRANGE', KEYS[1], #fence, -1)
redis.call('SET', KEYS[1], ARGV[2] .. fingerprint .. ARGV[3], 'PX', ARGV[4])
if ARGV[5] then
  redis.call('PUBLISH', ARGV[5], ARGV[6])
end
return 1
",
    )
});

/// `KEYS[1]` record; `ARGV[1]` fence; optionally `ARGV[2]` a channel to publish `ARGV[3]` (the
/// key's digest) to.
pub(super) static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local fence = ARGV[1]
if redis.call('GETRANGE', KEYS[1], 0, #fence - 1) ~= fence then
  return 0
end
redis.call('DEL', KEYS[1])
if ARGV[2] then
  redis.call('PUBLISH', ARGV[2], ARGV[3])
end
return 1
",
    )
});

/// `KEYS[1]` record; `ARGV[1]` fence; `ARGV[2]` lease in ms.
pub(super) static RENEW: LazyLock<Script> = LazyLock::new(|| {
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
