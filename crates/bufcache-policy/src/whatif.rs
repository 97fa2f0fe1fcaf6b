//! Live "what if the cache were bigger (or smaller)?" answers: miniature simulations
//! (Waldspurger et al., "Cache Modeling and Optimization using Miniature Simulations",
//! USENIX ATC '17).
//!
//! A key is *sampled* when a hash of it falls below a threshold (spatial sampling: a block is
//! either always or never sampled, so its reuse is seen whole). Each miniature cache is a
//! [`Simulator`] of the real policy whose capacity is the emulated size scaled by the sampling
//! rate; fed only the sampled keys, its hit ratio estimates the hit ratio a full cache of the
//! emulated size would have. Several emulated sizes and policies run side by side.
//!
//! Cost and memory: a key that is not sampled costs one multiply-xorshift hash and a compare
//! ([`WhatIf::is_sampled`]), which callers run before taking any lock. The sampling rate is
//! clamped so the 1× miniature holds between [`MINIATURE_BLOCKS_MIN`] (accuracy: too few
//! entries and sampling noise dominates) and [`MINIATURE_BLOCKS_MAX`] blocks (memory: a few
//! MiB for all miniatures together, whatever the real cache size), and never above 1.

use crate::simulate::Simulator;
use crate::{PolicyKind, PolicyParameters};

/// Fewest blocks the 1× miniature holds (the rate is raised to reach it, up to 1).
pub const MINIATURE_BLOCKS_MIN: u64 = 1024;
/// Most blocks the 1× miniature holds (the rate is lowered to stay under it).
pub const MINIATURE_BLOCKS_MAX: u64 = 2048;
/// The emulated sizes, as multiples of the configured cache size.
pub const SIZE_MULTIPLIERS: [f64; 6] = [0.25, 0.5, 1.0, 2.0, 4.0, 8.0];

/// The sampling hash: a bijection on u64 (murmur3's finaliser), different from
/// [`crate::simulate::key_hash`] so sampled keys still spread over the policies' ghost tables.
#[inline]
pub fn sampling_hash(key: u64) -> u64 {
    let mut hash = key ^ (key >> 33);
    hash = hash.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    hash ^= hash >> 33;
    hash = hash.wrapping_mul(0xC4CE_B9FE_1A85_EC53);
    hash ^ (hash >> 33)
}

/// The sampling rate actually used for a cache of `cache_blocks` blocks when `requested`
/// was asked for: clamped as the module documentation says.
pub fn effective_sampling_rate(requested: f64, cache_blocks: u64) -> f64 {
    let blocks = cache_blocks.max(1) as f64;
    let low = MINIATURE_BLOCKS_MIN as f64 / blocks;
    let high = MINIATURE_BLOCKS_MAX as f64 / blocks;
    requested.clamp(low, high).min(1.0)
}

/// One predicted point: a policy at an emulated cache size.
#[derive(Clone, Debug, PartialEq)]
pub struct WhatIfEstimate {
    /// The policy simulated.
    pub policy: PolicyKind,
    /// The emulated cache size in bytes.
    pub cache_size_bytes: u64,
    /// The emulated size over the configured one (0.25 … 8).
    pub multiplier: f64,
    /// Estimated hit ratio (hits over sampled block accesses; 0 before any access).
    pub hit_ratio: f64,
    /// Sampled block accesses the estimate rests on.
    pub sampled_accesses: u64,
}

struct Miniature {
    policy: PolicyKind,
    cache_size_bytes: u64,
    multiplier: f64,
    simulator: Simulator,
}

/// Miniature caches of several policies at several sizes, fed the sampled block keys.
pub struct WhatIf {
    threshold: u64,
    sampling_rate: f64,
    miniatures: Vec<Miniature>,
    /// Every access offered, sampled or not (for the sampling-bias correction).
    offered_accesses: u64,
    /// Sampled accesses.
    sampled_accesses: u64,
}

impl WhatIf {
    /// Miniatures of each of `policies` (duplicates removed) at [`SIZE_MULTIPLIERS`] times
    /// `cache_size_bytes`, for blocks of `block_size_bytes`, sampling about `sampling_rate`
    /// of the keys (clamped, see [`effective_sampling_rate`]).
    pub fn new(
        policies: &[PolicyKind],
        cache_size_bytes: u64,
        block_size_bytes: u64,
        sampling_rate: f64,
    ) -> Self {
        Self::with_parameters(
            policies,
            cache_size_bytes,
            block_size_bytes,
            sampling_rate,
            &PolicyParameters::default(),
        )
    }

    /// [`WhatIf::new`] with the policies' parameters (as the cache being predicted uses them).
    pub fn with_parameters(
        policies: &[PolicyKind],
        cache_size_bytes: u64,
        block_size_bytes: u64,
        sampling_rate: f64,
        parameters: &PolicyParameters,
    ) -> Self {
        let cache_blocks = cache_size_bytes / block_size_bytes.max(1);
        let rate = effective_sampling_rate(sampling_rate, cache_blocks);
        let threshold = if rate >= 1.0 {
            u64::MAX
        } else {
            (rate * u64::MAX as f64) as u64
        };
        let mut kinds: Vec<PolicyKind> = Vec::new();
        for &policy in policies {
            if !kinds.contains(&policy) {
                kinds.push(policy);
            }
        }
        let mut miniatures = Vec::new();
        for &policy in &kinds {
            for multiplier in SIZE_MULTIPLIERS {
                let emulated_blocks = cache_blocks as f64 * multiplier;
                let miniature_blocks = (emulated_blocks * rate).round().max(1.0) as usize;
                miniatures.push(Miniature {
                    policy,
                    cache_size_bytes: (cache_size_bytes as f64 * multiplier) as u64,
                    multiplier,
                    simulator: Simulator::with_parameters(policy, miniature_blocks, parameters),
                });
            }
        }
        WhatIf {
            threshold,
            sampling_rate: rate,
            miniatures,
            offered_accesses: 0,
            sampled_accesses: 0,
        }
    }

    /// The sampling rate in use (after clamping).
    pub fn sampling_rate(&self) -> f64 {
        self.sampling_rate
    }

    /// True when `key` belongs to the sample: a hash and a compare, no state touched.
    #[inline]
    pub fn is_sampled(&self, key: u64) -> bool {
        self.threshold == u64::MAX || sampling_hash(key) < self.threshold
    }

    /// The sampling threshold, for callers that test keys before taking a lock on `self`.
    pub fn threshold(&self) -> u64 {
        self.threshold
    }

    /// Feeds one access of `key` to every miniature, if it is sampled.
    pub fn access(&mut self, key: u64) {
        self.offered_accesses += 1;
        if self.is_sampled(key) {
            self.access_sampled(key);
        }
    }

    /// Feeds one access of a key the caller already found sampled. Such a caller counts
    /// every access it offered and reports it with [`WhatIf::set_offered_accesses`].
    pub fn access_sampled(&mut self, key: u64) {
        self.sampled_accesses += 1;
        for miniature in &mut self.miniatures {
            miniature.simulator.access(key);
        }
    }

    /// Drops `key` from every miniature (discarded data is no longer cached).
    pub fn remove(&mut self, key: u64) {
        if self.is_sampled(key) {
            for miniature in &mut self.miniatures {
                miniature.simulator.remove(key);
            }
        }
    }

    /// Sets the number of accesses offered, sampled or not, for callers that test
    /// [`WhatIf::is_sampled`] themselves (before taking a lock) and count in their own way.
    pub fn set_offered_accesses(&mut self, count: u64) {
        self.offered_accesses = count;
    }

    /// The current estimates, policy by policy, sizes ascending.
    ///
    /// Corrected for sampling bias as SHARDS-adj does (Waldspurger et al., FAST '15): a very
    /// hot block that happens to be in (or out of) the sample moves the sampled access count
    /// away from `offered × rate`; the difference is counted as hits at every size, since
    /// such a block hits in any cache. Measured: under fio's zipf:0.9 one unsampled hot
    /// block made the uncorrected estimate 0.06 low at 1× and 2×. The price is noise on
    /// uniform workloads, where the sampled count drifts by chance (see the tests).
    pub fn estimates(&self) -> Vec<WhatIfEstimate> {
        let expected = self.offered_accesses as f64 * self.sampling_rate;
        let surplus = expected - self.sampled_accesses as f64;
        self.miniatures
            .iter()
            .map(|miniature| {
                let simulator = &miniature.simulator;
                let accesses = simulator.hits() + simulator.misses();
                let hit_ratio = if accesses == 0 {
                    0.0
                } else if expected >= 1.0 {
                    ((simulator.hits() as f64 + surplus) / expected).clamp(0.0, 1.0)
                } else {
                    simulator.hits() as f64 / accesses as f64
                };
                WhatIfEstimate {
                    policy: miniature.policy,
                    cache_size_bytes: miniature.cache_size_bytes,
                    multiplier: miniature.multiplier,
                    hit_ratio,
                    sampled_accesses: accesses,
                }
            })
            .collect()
    }

    /// Blocks held by all miniatures together (their memory is about 100 bytes a block).
    pub fn blocks_held(&self) -> usize {
        self.miniatures
            .iter()
            .map(|miniature| miniature.simulator.len())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic xorshift generator, so the workloads are the same on every run.
    struct Random(u64);

    impl Random {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        fn unit(&mut self) -> f64 {
            (self.next() >> 11) as f64 / (1u64 << 53) as f64
        }
    }

    /// Zipf(alpha) over `keys` keys by inverting the cumulative distribution.
    fn zipf(keys: u64, alpha: f64, count: usize, seed: u64) -> Vec<u64> {
        let weights: Vec<f64> = (1..=keys)
            .map(|rank| 1.0 / (rank as f64).powf(alpha))
            .collect();
        let total: f64 = weights.iter().sum();
        let mut cumulative = Vec::with_capacity(weights.len());
        let mut sum = 0.0;
        for weight in weights {
            sum += weight / total;
            cumulative.push(sum);
        }
        let mut random = Random(seed);
        (0..count)
            .map(|_| {
                let target = random.unit();
                // Scatter ranks over the key space, as hot blocks are on a real disk.
                let rank = cumulative.partition_point(|&value| value < target) as u64;
                sampling_hash(rank ^ 0x5bd1_e995) % (keys * 16)
            })
            .collect()
    }

    /// A hot working set of `hot` blocks read at random, interleaved with a sequential scan.
    fn working_set_and_scan(hot: u64, count: usize, seed: u64) -> Vec<u64> {
        let mut random = Random(seed);
        let mut scan = 1u64 << 30;
        (0..count)
            .map(|index| {
                if index % 4 == 3 {
                    scan += 1;
                    scan
                } else {
                    random.next() % hot
                }
            })
            .collect()
    }

    /// A loop over `length` blocks, repeated.
    fn looping(length: u64, count: usize) -> Vec<u64> {
        (0..count as u64).map(|index| index % length).collect()
    }

    fn full_hit_ratio(policy: PolicyKind, blocks: u64, keys: &[u64]) -> f64 {
        let mut simulator = Simulator::new(policy, blocks as usize);
        for &key in keys {
            simulator.access(key);
        }
        1.0 - simulator.miss_ratio()
    }

    #[test]
    fn miniature_simulation_predicts_larger_caches_within_three_hundredths() {
        // Goal: the estimate at every larger emulated size (2×, 4×, 8×), for the configured
        // policy and LRU, is within 0.03 of a full simulation of a cache that size (the
        // issue's accuracy target: "would more memory help?")
        // on a zipf workload, a working set plus a scan, and a loop slightly larger than the
        // cache. Method: feed the same key stream to a WhatIf sized for a 10000-block cache
        // at the default 1% rate (clamped to 2048 sampled blocks at 1×), and to full
        // simulators at 0.25×…8×; compare hit ratios. Sizes at or below 1× are printed, not
        // asserted: on the loop, a cache within a few percent of the loop length is a knife
        // edge where sampling noise in the loop's sampled length (±1σ ≈ ±2%) flips S3-FIFO
        // between keeping part of the loop and thrashing.
        let cache_blocks = 10_000u64;
        let block = 4096u64;
        let workloads: Vec<(&str, Vec<u64>)> = vec![
            ("zipf", zipf(200_000, 0.9, 600_000, 1)),
            (
                "working set + scan",
                working_set_and_scan(15_000, 400_000, 2),
            ),
            ("loop 1.1x cache", looping(11_000, 300_000)),
        ];
        let mut report = String::new();
        let mut worst = 0.0f64;
        for (name, keys) in &workloads {
            for policy in [PolicyKind::S3Fifo, PolicyKind::Lru] {
                let mut whatif = WhatIf::new(&[policy], cache_blocks * block, block, 0.01);
                for &key in keys {
                    whatif.access(key);
                }
                for estimate in whatif.estimates() {
                    let blocks = (cache_blocks as f64 * estimate.multiplier) as u64;
                    let reference = full_hit_ratio(policy, blocks, keys);
                    let error = (estimate.hit_ratio - reference).abs();
                    if estimate.multiplier > 1.0 {
                        worst = worst.max(error);
                    }
                    report.push_str(&format!(
                        "{name:>20} {policy:>7} {:>5}x predicted {:.4} reference {reference:.4} error {error:.4}\n",
                        estimate.multiplier, estimate.hit_ratio
                    ));
                }
            }
        }
        println!("{report}");
        assert!(worst <= 0.03, "worst error {worst:.4}:\n{report}");
    }

    #[test]
    fn sampling_rate_is_clamped_to_bound_memory_and_keep_accuracy() {
        // Goal: whatever the configured cache size, the miniatures hold a bounded number of
        // blocks (a few MiB), and small caches are simulated with enough entries.
        // Method: compute the effective rate for a tiny, a medium and a huge cache.
        assert_eq!(effective_sampling_rate(0.01, 100), 1.0);
        let medium = effective_sampling_rate(0.01, 150_000);
        assert!((medium - 0.01).abs() < 1e-12, "{medium}");
        let huge_blocks = 1u64 << 20; // 4 GiB of 4 KiB blocks
        let huge = effective_sampling_rate(0.01, huge_blocks);
        assert!(huge * huge_blocks as f64 <= MINIATURE_BLOCKS_MAX as f64 + 1e-6);
        let mut whatif = WhatIf::new(
            &[PolicyKind::Arc, PolicyKind::Lru],
            huge_blocks * 4096,
            4096,
            0.01,
        );
        for key in 0..4_000_000u64 {
            whatif.access(key);
        }
        let bound = MINIATURE_BLOCKS_MAX as f64 * SIZE_MULTIPLIERS.iter().sum::<f64>() * 2.0;
        assert!(
            whatif.blocks_held() as f64 <= bound + 12.0,
            "{}",
            whatif.blocks_held()
        );
        assert!(whatif.blocks_held() > 0);
    }
}
