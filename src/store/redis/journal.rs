//! What the step journal (`steps::RedisJournal`) needs of the store: a hash of entries per
//! record, in the record's cluster slot, appended by a script fenced like `complete`.

use std::{collections::HashMap, sync::LazyLock, time::Duration};

use redis::Script;

use super::{backend, codec::fence, codec::millis, prefix::InvalidPrefix, RedisStore};
use crate::{
    record::{StoreKey, Token},
    store::StoreError,
};

/// `KEYS[1]` record; `KEYS[2]` its journal (a hash: step -> entry); `ARGV[1]` fence; `ARGV[2]`
/// step; `ARGV[3]` entry; `ARGV[4]` retention in ms. The entry is written only while the
/// record is in progress under the fence's token, in one atomic script, so a takeover comes
/// wholly before it (refused: 0) or after it (and reads it).
static APPEND: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local fence = ARGV[1]
if redis.call('GETRANGE', KEYS[1], 0, #fence - 1) ~= fence then
  return 0
end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
return 1
",
    )
});

/// Where a journal key's cluster slot comes from, decided by the prefix once.
#[derive(Clone, Copy, Debug)]
pub(crate) enum JournalSlot {
    /// The prefix carries a hash tag: the record key's slot is the tag's, so a suffix keeps it.
    Tagged,
    /// No hash tag: the record key hashes whole, so the journal key wraps it in braces.
    Wrapped,
}

/// How journal keys under `prefix` share their records' slots; refuses a prefix with a `}`
/// outside a hash tag, around which no journal key could be built in the record's slot.
pub(crate) fn journal_slot(prefix: &str) -> Result<JournalSlot, InvalidPrefix> {
    // Redis's rule: the tag is what lies between the first `{` and the first `}` after it,
    // if that is not empty.
    let tagged = prefix
        .find('{')
        .is_some_and(|open| prefix[open + 1..].find('}').is_some_and(|close| close > 0));
    if tagged {
        Ok(JournalSlot::Tagged)
    } else if !prefix.contains('}') {
        Ok(JournalSlot::Wrapped)
    } else {
        Err(InvalidPrefix {
            prefix: prefix.to_owned(),
            reason: "it contains a `}` outside a hash tag, so no step journal key can share its records' cluster slot",
        })
    }
}

impl RedisStore {
    /// How this store's journal keys share their records' slots ([`journal_slot`]).
    pub(crate) fn journal_slot(&self) -> Result<JournalSlot, InvalidPrefix> {
        journal_slot(&self.prefix)
    }

    /// The key of `key`'s journal, in the cluster slot of its record.
    pub(crate) fn journal_key(&self, slot: JournalSlot, key: &StoreKey) -> String {
        let record = self.redis_key(key);
        match slot {
            JournalSlot::Tagged => format!("{record}:steps"),
            JournalSlot::Wrapped => format!("{{{record}}}:steps"),
        }
    }

    /// Writes `entry` for `step` into `key`'s journal while `token` holds the claim.
    pub(crate) async fn journal_append(
        &self,
        slot: JournalSlot,
        key: &StoreKey,
        token: Token,
        step: &str,
        entry: &[u8],
        retention: Duration,
    ) -> Result<(), StoreError> {
        self.fenced(
            APPEND
                .key(self.redis_key(key))
                .key(self.journal_key(slot, key))
                .arg(&fence(token)[..])
                .arg(step)
                .arg(entry)
                .arg(millis(retention)?),
        )
        .await
    }

    /// Every entry of `key`'s journal: step -> entry.
    pub(crate) async fn journal_entries(
        &self,
        slot: JournalSlot,
        key: &StoreKey,
    ) -> Result<HashMap<Vec<u8>, Vec<u8>>, StoreError> {
        redis::cmd("HGETALL")
            .arg(self.journal_key(slot, key))
            .query_async(&mut self.connection.clone())
            .await
            .map_err(backend)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tagged prefix keeps its tag (a suffix), an untagged one is wrapped whole, and one
    /// with a stray `}` is refused. The cluster tests prove the slots on a real cluster.
    #[test]
    fn journal_slots_follow_the_hash_tag_rule() {
        for tagged in ["{idem}:", "a{b}c:", "}{a}"] {
            assert!(
                matches!(journal_slot(tagged), Ok(JournalSlot::Tagged)),
                "{tagged:?}"
            );
        }
        for wrapped in ["tower-idempotency:", "a{b:", "{:"] {
            assert!(
                matches!(journal_slot(wrapped), Ok(JournalSlot::Wrapped)),
                "{wrapped:?}"
            );
        }
        // An empty tag (`{}`) counts as none: the key hashes whole, and the `}` is stray.
        for refused in ["a}b:", "{}:", "{}{x}:"] {
            assert!(journal_slot(refused).is_err(), "{refused:?}");
        }
    }
}
