#![deny(missing_docs)]
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
//! - `evict` returns only a slot for which the evictor said [`Verdict::Evict`], and forgets it;
//!   after a [`Verdict::Stop`] it asks about no other slot and returns `None`, leaving that
//!   candidate where it was;
//! - `evict` examines a bounded number of candidates (a few times `len()`, at most), so a shard
//!   full of pinned or dirty buffers costs a bounded scan, not a loop;
//! - a *held* slot ([`Policy::hold`], 4.4BSD's `bremfree`) is still tracked but off every
//!   eviction queue: `evict` never examines it until [`Policy::release`] puts it back, at the
//!   insertion end of the queue it belongs to, with the history it had (frequency, visited
//!   bit, which of the policy's lists). Hits and `remove` work on a held slot as on any
//!   other. The cache holds a buffer while it is pinned, dirty or under I/O, so eviction
//!   walks only buffers it can take; with nothing held every policy behaves exactly as
//!   without holds (the libCacheSim parity tests run without any).
//!
//! Policies that keep a history of evicted keys (ARC, 2Q, S3-FIFO ghosts) key it by the
//! `key_hash` given at insert, so history survives slot reuse.
//!
//! Every policy keeps [`Placement::NoReuse`] entries in a first-in-first-out queue of their
//! own that `evict` drains before anything else, so "no reuse" combines with any base policy.
//! Such entries leave no ghost history and no frequency; a hit on one moves it to the policy's
//! normal insertion point (the stream turned out to be re-read).
//!
//! [`simulate`] runs a policy as a whole single-threaded cache, for miss-ratio experiments.

mod arc;
mod clock;
mod fifo;
mod ghost;
mod list;
mod lru;
pub mod offline;
mod parameters;
mod s3fifo;
mod sieve;
pub mod simulate;
mod two_q;
pub mod whatif;

pub use arc::Arc;
pub use clock::Clock;
pub use fifo::Fifo;
pub use ghost::{BuildMixHasher, MixHasher};
pub use lru::Lru;
pub use parameters::{InvalidParameter, PolicyParameters};
pub use s3fifo::{S3Fifo, MOVE_TO_MAIN_HITS};
pub use sieve::Sieve;
pub use two_q::TwoQ;

use std::fmt;
use std::str::FromStr;

/// An index chosen by the cache for one tracked entry. Dense: the cache keeps slots below the
/// shard's entry count high-water mark, so a policy may index vectors by slot.
pub type Slot = u32;

/// What an evictor says of one eviction candidate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Take it: `evict` forgets it and returns it.
    Evict,
    /// Leave it (busy, say); the policy goes on to its next candidate.
    Skip,
    /// Leave it, and take nothing from this policy now: `evict` asks about no other slot and
    /// returns `None`, with this candidate where it was. A cache's read-ahead, which must not
    /// evict read-ahead nobody has used, says this of the first such candidate instead of
    /// walking past every one of them.
    Stop,
}

impl From<bool> for Verdict {
    /// `true` is [`Verdict::Evict`], `false` [`Verdict::Skip`].
    fn from(evict: bool) -> Self {
        if evict {
            Verdict::Evict
        } else {
            Verdict::Skip
        }
    }
}

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

    /// Tells the policy, before any eviction made for it, that `key_hash` missed and will be
    /// inserted next. Optional: a cache that knows the key before it makes room (the
    /// simulator) calls it so that policies which adapt to history hits (ARC) adapt before
    /// choosing the victim, as their papers and libCacheSim do; a cache that does not call
    /// it gets the same policy adapting at `insert`. The default ignores it.
    fn announce_miss(&mut self, key_hash: u64) {
        let _ = key_hash;
    }

    /// Records a hit on a tracked slot.
    fn access(&mut self, slot: Slot);

    /// Stops tracking `slot` because the cache dropped the entry for its own reasons
    /// (invalidation, discard, a failed read), not because the policy chose it.
    fn remove(&mut self, slot: Slot);

    /// Takes a tracked `slot` off the eviction queues until [`Policy::release`]: `evict` will
    /// not examine it. Holding a held slot changes nothing.
    fn hold(&mut self, slot: Slot);

    /// Puts a held `slot` back at the insertion end of the queue it belongs to. Releasing a
    /// slot that is not held changes nothing.
    fn release(&mut self, slot: Slot);

    /// Number of tracked slots that are held.
    fn held(&self) -> usize;

    /// Chooses a victim. Walks tracked slots in eviction order and asks `verdict` about each;
    /// the first slot it says [`Verdict::Evict`] of is forgotten and returned. Returns `None`
    /// when no examined candidate was taken, and at once after a [`Verdict::Stop`].
    fn evict(&mut self, verdict: &mut dyn FnMut(Slot) -> Verdict) -> Option<Slot>;

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
    /// First in, first out; hits change nothing.
    Fifo,
    /// CLOCK (second chance): FIFO ring with a reference bit.
    Clock,
    /// 2Q (Johnson & Shasha): FIFO A1in, ghost A1out, LRU Am.
    TwoQ,
    /// ARC (Megiddo & Modha): adaptive split between recency and frequency.
    Arc,
    /// S3-FIFO (Yang et al.): small FIFO, main 2-bit CLOCK, ghost FIFO.
    S3Fifo,
    /// SIEVE (Zhang et al.): FIFO with visited bits and a moving hand.
    Sieve,
}

impl PolicyKind {
    /// Every policy, in the order documentation lists them.
    pub const ALL: &'static [PolicyKind] = &[
        PolicyKind::Lru,
        PolicyKind::Fifo,
        PolicyKind::Clock,
        PolicyKind::TwoQ,
        PolicyKind::Arc,
        PolicyKind::S3Fifo,
        PolicyKind::Sieve,
    ];

    /// Builds a policy for a shard expected to hold about `capacity_hint` entries when full.
    /// Policies that size internal queues use the hint; all of them stay correct when the
    /// real number of entries differs from it.
    pub fn build(self, capacity_hint: usize) -> Box<dyn Policy> {
        self.build_with(capacity_hint, &PolicyParameters::default())
    }

    /// [`PolicyKind::build`] with non-default parameters (each policy reads only its own).
    /// `parameters` must have passed [`PolicyParameters::validate`].
    pub fn build_with(
        self,
        capacity_hint: usize,
        parameters: &PolicyParameters,
    ) -> Box<dyn Policy> {
        debug_assert_eq!(parameters.validate(), Ok(()));
        match self {
            PolicyKind::Clock => Box::new(Clock::with_bits(capacity_hint, parameters.clock_bits)),
            PolicyKind::TwoQ => Box::new(TwoQ::with_ratios(
                capacity_hint,
                parameters.two_q_ain_size_ratio,
                parameters.two_q_aout_size_ratio,
            )),
            PolicyKind::S3Fifo => Box::new(S3Fifo::with_parameters(capacity_hint, parameters)),
            other => other.build_default(capacity_hint),
        }
    }

    fn build_default(self, capacity_hint: usize) -> Box<dyn Policy> {
        match self {
            PolicyKind::Lru => Box::new(Lru::with_capacity(capacity_hint)),
            PolicyKind::Fifo => Box::new(Fifo::with_capacity(capacity_hint)),
            PolicyKind::Clock => Box::new(Clock::with_capacity(capacity_hint)),
            PolicyKind::TwoQ => Box::new(TwoQ::with_capacity(capacity_hint)),
            PolicyKind::Arc => Box::new(Arc::with_capacity(capacity_hint)),
            PolicyKind::S3Fifo => Box::new(S3Fifo::with_capacity(capacity_hint)),
            PolicyKind::Sieve => Box::new(Sieve::with_capacity(capacity_hint)),
        }
    }

    /// The name used on the command line and in configuration files.
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Lru => "lru",
            PolicyKind::Fifo => "fifo",
            PolicyKind::Clock => "clock",
            PolicyKind::TwoQ => "2q",
            PolicyKind::Arc => "arc",
            PolicyKind::S3Fifo => "s3fifo",
            PolicyKind::Sieve => "sieve",
        }
    }
}

/// Grows a per-slot vector so that `slot` indexes it. Slots are dense, so this reallocates
/// only when the cache reaches a new high-water mark of entries.
pub(crate) fn grow_to_slot<T: Copy + Default>(values: &mut Vec<T>, slot: Slot) {
    let index = slot as usize;
    if index >= values.len() {
        values.resize(index + 1, T::default());
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
