//! Replacement policies: which clean, unpinned buffer to give up when the cache needs room.
//!
//! A policy sees the cache as numbered *slots* (dense small integers chosen by the cache, reused
//! after removal) and never sees buffers, data or locks. The cache keeps one policy instance per
//! shard and calls it while holding that shard's lock, so a policy is plain single-threaded code
//! (`&mut self`) and a hit on one shard never waits for another shard.
//!
//! Invariants every policy keeps:
//! - a slot is *tracked* from `insert` until it is returned by `evict` or passed to `remove`,
//!   and never inserted twice while tracked;
//! - `evict` returns only a slot for which `evictable` returned true, and forgets it;
//! - `evict` examines a bounded number of candidates (a few times `len()`, at most), so a shard
//!   full of pinned or dirty buffers costs a bounded scan, not a loop.
//!
//! Policies that keep a history of evicted keys (ARC, 2Q, S3-FIFO ghosts) key it by the
//! `key_hash` given at insert, so history survives slot reuse.

mod lru;

pub use lru::Lru;

use std::fmt;
use std::str::FromStr;

/// An index chosen by the cache for one tracked entry. Dense: the cache keeps slots below the
/// shard's entry count high-water mark, so a policy may index vectors by slot.
pub type Slot = u32;

/// Where a newly inserted entry is placed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// The policy's usual insertion point.
    Normal,
    /// The entry belongs to a large sequential stream and is unlikely to be reused (seed 003's
    /// `vm_page_dontneed`, FreeBSD's B_NOREUSE): put it where it is evicted first, so a scan
    /// does not push out another user's working set.
    NoReuse,
}

/// A replacement policy for one shard of the cache.
pub trait Policy: Send {
    /// The policy's name as used on the command line.
    fn name(&self) -> &'static str;

    /// Starts tracking `slot`, which holds the entry whose key hashes to `key_hash`.
    fn insert(&mut self, slot: Slot, key_hash: u64, placement: Placement);

    /// Records a hit on a tracked slot.
    fn access(&mut self, slot: Slot);

    /// Stops tracking `slot` because the cache dropped the entry for its own reasons
    /// (invalidation, discard, a failed read), not because the policy chose it.
    fn remove(&mut self, slot: Slot);

    /// Chooses a victim. Walks tracked slots in eviction order and asks `evictable` about each;
    /// the first slot it accepts is forgotten and returned. Returns `None` when no examined
    /// candidate was accepted.
    fn evict(&mut self, evictable: &mut dyn FnMut(Slot) -> bool) -> Option<Slot>;

    /// Number of tracked slots.
    fn len(&self) -> usize;

    /// True when no slot is tracked.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The policies that can be named in configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    /// Least recently used.
    Lru,
}

impl PolicyKind {
    /// Every policy, in the order documentation lists them.
    pub const ALL: &'static [PolicyKind] = &[PolicyKind::Lru];

    /// Builds a policy for a shard expected to hold about `capacity_hint` entries when full.
    /// Policies that size internal queues use the hint; all of them stay correct when the
    /// real number of entries differs from it.
    pub fn build(self, capacity_hint: usize) -> Box<dyn Policy> {
        match self {
            PolicyKind::Lru => Box::new(Lru::with_capacity(capacity_hint)),
        }
    }

    /// The name used on the command line and in configuration files.
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Lru => "lru",
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(self.name())
    }
}

/// A policy name that is not one of [`PolicyKind::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown replacement policy `{name}`; expected one of: {expected}")]
pub struct UnknownPolicy {
    /// The name that was given.
    pub name: String,
    /// The accepted names, comma separated.
    pub expected: String,
}

impl FromStr for PolicyKind {
    type Err = UnknownPolicy;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let wanted = text.trim().to_ascii_lowercase();
        PolicyKind::ALL
            .iter()
            .copied()
            .find(|kind| kind.name() == wanted)
            .ok_or_else(|| UnknownPolicy {
                name: text.to_string(),
                expected: PolicyKind::ALL
                    .iter()
                    .map(|kind| kind.name())
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }
}
