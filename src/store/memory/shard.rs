//! One shard of the memory store: its records packed in a `Vec`, found through a hash table
//! of indexes into it.
//!
//! A record is one fixed-size [`Slot`] (key identity, fingerprint, deadline, token or payload
//! handle); the table holds only a `u32` per record. Keeping the slots out of the table is
//! what keeps the overhead small: a hash table runs up to half empty after it grows, and an
//! empty `u32` costs far less than an empty slot.

use bytes::Bytes;
use hashbrown::HashTable;

use crate::record::{Fingerprint, Record, Token};

/// The 32-byte digest a record is stored under ([`StoreKey::digest`](crate::StoreKey::digest)).
pub(super) type Digest = [u8; 32];

/// What a slot keeps of the digest: its first 16 bytes, a 128-bit identity.
///
/// Two keys are confused only if these bytes are equal (and the shard, chosen from another
/// byte, too). By accident that takes about 2^64 stored keys (the birthday bound); on
/// purpose a client would need a second preimage of someone else's key, since it chooses only
/// its own keys, under its own scope: about 2^128 / (keys stored) SHA-256 evaluations. The
/// other 16 bytes would cost 16 more bytes per record for no practical gain.
type KeyId = [u8; 16];

fn key_id(digest: &Digest) -> KeyId {
    digest[..16].try_into().expect("16 bytes")
}

/// Milliseconds since the store's epoch (its own monotonic clock).
pub(super) type Millis = u64;

/// What the budget charges for one record besides its payload: its slot and its index entry
/// (a `u32` plus the table's control byte, rounded up).
pub(super) const RECORD_BYTES: u64 = (std::mem::size_of::<Slot>() + 8) as u64;

pub(super) struct Slot {
    key: KeyId,
    fingerprint: Fingerprint,
    /// The lease's end for a claim, the retention's end for a completed record.
    deadline: Millis,
    state: State,
}

enum State {
    /// The claim's sequence number, all of its token that is not the shard's (see
    /// [`Tokens`]). Eight bytes fit beside the payload's pointer, whose null value tells the
    /// variants apart; the whole 16-byte token would need a tag word, 8 more bytes per slot.
    InProgress(u64),
    /// The payload in an allocation of exactly its length. Not [`Bytes`]: that handle is 32
    /// bytes to this one's 16, in every slot, whereas only a replay pays for the difference:
    /// it copies the payload out (one allocation and a copy of a few hundred bytes, where a
    /// shared `Bytes` took an atomic increment after allocating its shared header on the
    /// first clone).
    Completed(Box<[u8]>),
}

impl Slot {
    /// A claim with the `sequence` number of its token ([`Shard::issue_token`]).
    pub(super) fn claim(
        key: Digest,
        fingerprint: Fingerprint,
        sequence: u64,
        deadline: Millis,
    ) -> Self {
        Self {
            key: key_id(&key),
            fingerprint,
            deadline,
            state: State::InProgress(sequence),
        }
    }

    pub(super) fn is_live(&self, now: Millis) -> bool {
        self.deadline > now
    }

    fn is_claimed_with(&self, sequence: u64, now: Millis) -> bool {
        self.is_live(now) && matches!(self.state, State::InProgress(held) if held == sequence)
    }

    pub(super) fn record(&self) -> Record {
        match &self.state {
            State::InProgress(_) => Record::InProgress {
                fingerprint: self.fingerprint,
            },
            State::Completed(payload) => Record::Completed {
                fingerprint: self.fingerprint,
                payload: Bytes::copy_from_slice(payload),
            },
        }
    }

    /// The bytes the budget charges for this record.
    pub(super) fn charge(&self) -> u64 {
        RECORD_BYTES + self.payload_len()
    }

    fn payload_len(&self) -> u64 {
        match &self.state {
            State::InProgress(_) => 0,
            State::Completed(payload) => payload.len() as u64,
        }
    }

    pub(super) fn deadline(&self) -> Millis {
        self.deadline
    }

    pub(super) fn renew(&mut self, deadline: Millis) {
        self.deadline = deadline;
    }

    /// Turns the claim into a completed record; returns the bytes added to its charge.
    pub(super) fn complete(&mut self, payload: Box<[u8]>, deadline: Millis) -> u64 {
        self.state = State::Completed(payload);
        self.deadline = deadline;
        self.payload_len()
    }
}

/// Issues the fencing tokens of one shard's claims: 8 random bytes drawn once for the shard,
/// then the claim's sequence number, 8 big-endian bytes.
///
/// Sequence numbers never repeat within a shard (a counter of 2^64 claims), and a key
/// always lives in the same shard, so a token taken over, released or completed never equals
/// the key's current one: the fence is exact, not merely improbable to break. The random
/// half rejects a token that another shard or another store issued (it would have to match
/// both halves). Tokens need no secrecy: they never leave the process.
struct Tokens {
    salt: [u8; 8],
    next: u64,
}

impl Tokens {
    fn new() -> Self {
        Self {
            salt: rand::random(),
            next: 0,
        }
    }

    fn issue(&mut self) -> (Token, u64) {
        let sequence = self.next;
        self.next = self.next.wrapping_add(1);
        let mut bytes = [0; 16];
        bytes[..8].copy_from_slice(&self.salt);
        bytes[8..].copy_from_slice(&sequence.to_be_bytes());
        (Token::from_bytes(bytes), sequence)
    }

    /// The sequence number of `token` if this issuer made it.
    fn sequence_of(&self, token: Token) -> Option<u64> {
        let bytes = token.to_bytes();
        let (salt, sequence) = bytes.split_at(8);
        (salt == self.salt).then(|| u64::from_be_bytes(sequence.try_into().expect("8 bytes")))
    }
}

/// The records of one shard. Every method runs under the shard's lock.
pub(super) struct Shard {
    tokens: Tokens,
    index: HashTable<u32>,
    slots: Vec<Slot>,
    /// Where the incremental sweep resumes.
    hand: usize,
    /// No record in the shard expires before this (a lower bound: renewals and removals do
    /// not raise it, a full sweep makes it exact). Lets a full store skip a sweep that
    /// cannot free anything.
    earliest: Millis,
}

impl Default for Shard {
    fn default() -> Self {
        Self {
            tokens: Tokens::new(),
            index: HashTable::new(),
            slots: Vec::new(),
            hand: 0,
            earliest: Millis::MAX,
        }
    }
}

/// The in-shard hash: the digest is already uniform, so its first bytes serve as is. (The
/// shard is chosen from other bytes, so the keys of one shard do not share hash bits.)
fn hash(key: &KeyId) -> u64 {
    u64::from_le_bytes(key[..8].try_into().expect("8 bytes"))
}

impl Shard {
    /// The slot stored under `key`, live or not.
    pub(super) fn get_mut(&mut self, key: &Digest) -> Option<&mut Slot> {
        let key = key_id(key);
        let slots = &mut self.slots;
        let &index = self
            .index
            .find(hash(&key), |&i| slots[i as usize].key == key)?;
        Some(&mut slots[index as usize])
    }

    /// The slot stored under `key` if it is a live claim held with `token`.
    pub(super) fn get_claimed(
        &mut self,
        key: &Digest,
        token: Token,
        now: Millis,
    ) -> Option<&mut Slot> {
        let sequence = self.tokens.sequence_of(token)?;
        self.get_mut(key)
            .filter(|slot| slot.is_claimed_with(sequence, now))
    }

    /// A fresh token for a claim in this shard, and its sequence number for
    /// [`Slot::claim`].
    pub(super) fn issue_token(&mut self) -> (Token, u64) {
        self.tokens.issue()
    }

    /// True when no record can be added (its index would not fit in a `u32`).
    pub(super) fn is_at_index_limit(&self) -> bool {
        self.slots.len() >= u32::MAX as usize
    }

    /// Adds a record for a key that has none. The caller checked both the key's absence
    /// and [`is_at_index_limit`](Self::is_at_index_limit).
    pub(super) fn insert(&mut self, slot: Slot) {
        let index = u32::try_from(self.slots.len()).expect("checked by is_at_index_limit");
        self.earliest = self.earliest.min(slot.deadline);
        let slots = &self.slots;
        self.index
            .insert_unique(hash(&slot.key), index, |&i| hash(&slots[i as usize].key));
        self.slots.push(slot);
    }

    /// Notes a deadline set on an existing record, for [`earliest`](Self::earliest).
    pub(super) fn note_deadline(&mut self, deadline: Millis) {
        self.earliest = self.earliest.min(deadline);
    }

    /// Removes the record under `key`; returns its charge.
    pub(super) fn remove(&mut self, key: &Digest) -> Option<u64> {
        let key = key_id(key);
        let slots = &self.slots;
        let entry = self
            .index
            .find_entry(hash(&key), |&i| slots[i as usize].key == key)
            .ok()?;
        let (index, _) = entry.remove();
        Some(self.remove_at(index as usize))
    }

    /// Removes the slot at `index` by moving the last slot into its place; returns its charge.
    fn remove_at(&mut self, index: usize) -> u64 {
        let last = self.slots.len() - 1;
        if index != last {
            let moved = hash(&self.slots[last].key);
            let entry = self
                .index
                .find_mut(moved, |&i| i as usize == last)
                .expect("every slot is indexed");
            *entry = index as u32;
        }
        self.slots.swap_remove(index).charge()
    }

    /// Removes the slot at `index` from both the table and the slots; returns its charge.
    fn evict(&mut self, index: usize) -> u64 {
        let key = self.slots[index].key;
        let found = self
            .index
            .find_entry(hash(&key), |&i| i as usize == index)
            .expect("every slot is indexed");
        found.remove();
        self.remove_at(index)
    }

    /// Examines up to `steps` slots from where the last sweep stopped and removes the expired
    /// ones; returns how many it removed and their charge. Called on every insert, so that
    /// expired records go away under steady traffic without a purger.
    pub(super) fn sweep_some(&mut self, now: Millis, steps: usize) -> (u64, u64) {
        let (mut removed, mut bytes) = (0, 0);
        for _ in 0..steps {
            if self.hand >= self.slots.len() {
                self.hand = 0;
                if self.slots.is_empty() {
                    break;
                }
            }
            if self.slots[self.hand].is_live(now) {
                self.hand += 1;
            } else {
                // The last slot moves into `hand`: examine that one next.
                bytes += self.evict(self.hand);
                removed += 1;
            }
        }
        (removed, bytes)
    }

    /// Removes up to `limit` expired records, scanning the whole shard when needed; returns
    /// how many it removed and their charge. A no-op while nothing can have expired.
    pub(super) fn sweep_all(&mut self, now: Millis, limit: u64) -> (u64, u64) {
        if self.earliest > now {
            return (0, 0);
        }
        let (mut removed, mut bytes) = (0, 0);
        let mut earliest = Millis::MAX;
        let mut index = 0;
        while index < self.slots.len() {
            let deadline = self.slots[index].deadline;
            if deadline > now || removed == limit {
                earliest = earliest.min(deadline);
                index += 1;
            } else {
                bytes += self.evict(index);
                removed += 1;
            }
        }
        self.earliest = earliest;
        (removed, bytes)
    }

    pub(super) fn len(&self) -> usize {
        self.slots.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest(i: u32) -> Digest {
        crate::StoreKey::new("s", i.to_string()).digest()
    }

    fn fill(shard: &mut Shard, keys: std::ops::Range<u32>, deadline: impl Fn(u32) -> Millis) {
        for i in keys {
            let (_, sequence) = shard.issue_token();
            let slot = Slot::claim(
                digest(i),
                Fingerprint::from_bytes([0; 32]),
                sequence,
                deadline(i),
            );
            shard.insert(slot);
        }
    }

    #[test]
    fn a_slot_is_key_fingerprint_deadline_and_one_payload_handle() {
        // 16 + 32 + 8 + 16: the state is a `Box<[u8]>` (pointer and length) or the claim's
        // sequence number in the length's place; a null pointer tags it. No padding.
        assert_eq!(std::mem::size_of::<Slot>(), 72);
    }

    #[test]
    fn only_the_current_token_of_a_key_holds_its_claim() {
        let mut shard = Shard::default();
        let key = digest(1);
        let (old, sequence) = shard.issue_token();
        shard.insert(Slot::claim(
            key,
            Fingerprint::from_bytes([0; 32]),
            sequence,
            10,
        ));
        assert!(shard.get_claimed(&key, old, 5).is_some());
        assert!(
            shard.get_claimed(&key, old, 10).is_none(),
            "the lease is over"
        );
        // A takeover: the same slot, a new token.
        let (new, sequence) = shard.issue_token();
        *shard.get_mut(&key).unwrap() =
            Slot::claim(key, Fingerprint::from_bytes([0; 32]), sequence, 20);
        assert_ne!(old, new);
        assert!(
            shard.get_claimed(&key, old, 15).is_none(),
            "a taken-over token"
        );
        assert!(shard.get_claimed(&key, new, 15).is_some());
        // The same sequence number from another shard (another salt) does not hold it.
        let mut other = Shard::default();
        other.issue_token();
        let (foreign, foreign_sequence) = other.issue_token();
        assert_eq!(foreign_sequence, sequence);
        assert!(shard.get_claimed(&key, foreign, 15).is_none());
        assert!(shard.get_claimed(&key, Token::random(), 15).is_none());
    }

    #[test]
    fn removing_moves_the_last_slot_and_keeps_every_key_findable() {
        let mut shard = Shard::default();
        fill(&mut shard, 0..100, |_| 10);
        for i in (0..100).step_by(3) {
            assert_eq!(shard.remove(&digest(i)), Some(RECORD_BYTES));
        }
        assert_eq!(shard.remove(&digest(0)), None);
        for i in 0..100 {
            assert_eq!(shard.get_mut(&digest(i)).is_some(), i % 3 != 0, "key {i}");
        }
    }

    #[test]
    fn sweeps_remove_exactly_the_expired_records() {
        let mut shard = Shard::default();
        // Even keys expire at 5, odd keys live until 50.
        fill(&mut shard, 0..100, |i| if i % 2 == 0 { 5 } else { 50 });
        let mut removed = 0;
        for _ in 0..200 {
            removed += shard.sweep_some(10, 1).0;
        }
        assert_eq!(removed, 50, "one pass of the hand reaches every slot");
        fill(&mut shard, 100..110, |_| 5);
        assert_eq!(shard.sweep_all(10, 4), (4, 4 * RECORD_BYTES));
        assert_eq!(shard.sweep_all(10, u64::MAX).0, 6);
        assert_eq!(
            shard.sweep_all(10, u64::MAX),
            (0, 0),
            "nothing left that expired"
        );
        assert_eq!(shard.len(), 50);
        for i in (1..100).step_by(2) {
            assert!(shard.get_mut(&digest(i)).is_some(), "key {i}");
        }
    }
}
