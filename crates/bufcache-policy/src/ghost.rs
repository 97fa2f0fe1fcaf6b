//! Ghost history: a FIFO of key hashes of recently evicted entries, with O(1) membership.
//!
//! 2Q's A1out, ARC's B1/B2 and S3-FIFO's ghost queue remember *keys*, not slots, because a
//! slot is reused for an unrelated key as soon as it is freed. `Ghost` keeps the hashes in
//! insertion order (a ring of `(hash, stamp)`) and a map from hash to the stamp of its live
//! ring entry. Removing a hash (a ghost hit) only deletes it from the map; its ring entry goes
//! stale and is skipped when it reaches the front, or dropped by a compaction once stale
//! entries outnumber live ones, so memory stays within a small factor of the live count.
//!
//! Pushing a hash that is already present refreshes it (it becomes the newest).

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

/// Hasher for keys that already are well-mixed 64-bit values (key hashes, block numbers).
/// One multiply spreads sequential integers over the high bits the hash table probes with.
#[derive(Default, Clone, Copy)]
pub struct MixHasher {
    state: u64,
}

impl Hasher for MixHasher {
    fn finish(&self) -> u64 {
        self.state
    }

    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.write_u64(u64::from(byte));
        }
    }

    fn write_u64(&mut self, value: u64) {
        let mixed = (self.state ^ value).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.state = mixed ^ (mixed >> 29);
    }

    fn write_u32(&mut self, value: u32) {
        self.write_u64(u64::from(value));
    }

    fn write_usize(&mut self, value: usize) {
        self.write_u64(value as u64);
    }
}

/// `BuildHasher` for maps keyed by `u64` hashes or block numbers.
pub type BuildMixHasher = BuildHasherDefault<MixHasher>;

/// A FIFO of remembered key hashes.
pub(crate) struct Ghost {
    /// Oldest at the front. Entries whose stamp differs from `stamps[hash]` are stale.
    order: VecDeque<(u64, u64)>,
    /// Live hashes and the stamp of their ring entry.
    stamps: HashMap<u64, u64, BuildMixHasher>,
    next_stamp: u64,
}

impl Ghost {
    /// An empty history with room for about `capacity` hashes before it reallocates.
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        Ghost {
            order: VecDeque::with_capacity(capacity),
            stamps: HashMap::with_capacity_and_hasher(capacity, BuildMixHasher::default()),
            next_stamp: 0,
        }
    }

    /// Number of remembered hashes.
    pub(crate) fn len(&self) -> usize {
        self.stamps.len()
    }

    /// True when `hash` is remembered.
    #[cfg(test)]
    pub(crate) fn contains(&self, hash: u64) -> bool {
        self.stamps.contains_key(&hash)
    }

    /// Forgets `hash`; true when it was remembered (a ghost hit).
    pub(crate) fn remove(&mut self, hash: u64) -> bool {
        // Every insertion of a new key asks; until the first eviction the history is empty,
        // and probing its table (sized for the whole cache, so a cache miss per probe) cost
        // 3% of a cache's first fill.
        if self.stamps.is_empty() {
            return false;
        }
        self.stamps.remove(&hash).is_some()
    }

    /// Remembers `hash` as the newest entry.
    pub(crate) fn push(&mut self, hash: u64) {
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        self.stamps.insert(hash, stamp);
        self.order.push_back((hash, stamp));
        // Stale entries at the front are dropped by the next `pop_oldest`, or by a
        // compaction: one hash probe per push, not two.
        if self.order.len() > 2 * self.stamps.len() + 64 {
            self.compact();
        }
    }

    /// Forgets the oldest hash; false when empty. Each ring entry costs one hash probe: a
    /// live one is looked up and removed in the same probe, a stale one is only looked up.
    pub(crate) fn pop_oldest(&mut self) -> bool {
        while let Some((hash, stamp)) = self.order.pop_front() {
            if let Entry::Occupied(entry) = self.stamps.entry(hash) {
                if *entry.get() == stamp {
                    entry.remove();
                    return true;
                }
            }
        }
        false
    }

    /// Forgets the oldest hashes until at most `target` remain.
    pub(crate) fn trim_to(&mut self, target: usize) {
        while self.len() > target && self.pop_oldest() {}
    }

    /// Drops every stale ring entry. Runs only when stale entries outnumber live ones, so
    /// its cost is amortised over the removals that made them stale.
    fn compact(&mut self) {
        let stamps = &self.stamps;
        self.order
            .retain(|&(hash, stamp)| stamps.get(&hash) == Some(&stamp));
        debug_assert_eq!(self.order.len(), self.stamps.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forgets_oldest_first_and_refreshes_on_repush() {
        let mut ghost = Ghost::with_capacity(4);
        for hash in [10, 20, 30] {
            ghost.push(hash);
        }
        ghost.push(10);
        assert_eq!(ghost.len(), 3);
        ghost.trim_to(2);
        assert!(!ghost.contains(20));
        assert!(ghost.contains(30) && ghost.contains(10));
        assert!(ghost.remove(30));
        assert!(!ghost.remove(30));
        assert!(ghost.pop_oldest());
        assert!(!ghost.pop_oldest());
        assert_eq!(ghost.len(), 0);
    }

    #[test]
    fn ring_stays_bounded_under_many_ghost_hits() {
        let mut ghost = Ghost::with_capacity(8);
        for hash in 0..100_000u64 {
            ghost.push(hash);
            if hash % 3 != 0 {
                ghost.remove(hash);
            }
            ghost.trim_to(100);
        }
        assert!(ghost.order.len() <= 2 * ghost.len() + 65);
    }
}
