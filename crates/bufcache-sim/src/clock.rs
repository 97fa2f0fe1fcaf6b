//! The virtual clock the engine reads, and a small deterministic random number generator.
//!
//! Every simulated entity (workload process, I/O daemon, syncer) has its own timeline; the
//! scheduler always runs the entity whose timeline is earliest. The engine only needs a
//! monotonic clock for dirty ages, so [`VirtualClock`] reports the high-water mark of all
//! timelines: it never goes backwards, and it is at most one step ahead of the entity running.

use std::sync::atomic::{AtomicU64, Ordering};

/// A monotonic virtual clock in nanoseconds, injected into the engine as its `Clock`.
#[derive(Debug, Default)]
pub struct VirtualClock {
    now_ns: AtomicU64,
}

impl VirtualClock {
    /// A clock at time zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// Moves the clock to `time_ns` if that is later than now.
    pub fn advance_to(&self, time_ns: u64) {
        self.now_ns.fetch_max(time_ns, Ordering::AcqRel);
    }

    /// The current virtual time.
    pub fn now(&self) -> u64 {
        self.now_ns.load(Ordering::Acquire)
    }
}

impl bufcache::Clock for VirtualClock {
    fn now_ns(&self) -> u64 {
        self.now()
    }
}

/// SplitMix64: tiny, fast and identical on every platform and Rust version, so a seed gives
/// the same simulation everywhere (the `rand` crate's small generators make no such promise).
#[derive(Clone, Debug)]
pub struct SimRng {
    state: u64,
}

impl SimRng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        SimRng { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform integer in `[0, bound)` (0 when `bound` is 0).
    pub fn below(&mut self, bound: u64) -> u64 {
        if bound == 0 {
            0
        } else {
            ((self.next_u64() as u128 * bound as u128) >> 64) as u64
        }
    }

    /// A uniform integer in `[low, high]`.
    pub fn between(&mut self, low: u64, high: u64) -> u64 {
        low + self.below(high.saturating_sub(low) + 1)
    }
}
