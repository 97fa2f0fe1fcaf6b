// Shared helpers for the policy tests: a seeded PRNG, Zipf sampling and workload generators,
// so every test is deterministic and prints the seed it used.
#![allow(dead_code)]

use bufcache_policy::simulate::Simulator;
use bufcache_policy::{Placement, PolicyKind};

/// SplitMix64: tiny, fast, and good enough for test workloads.
pub struct Rng {
    state: u64,
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng {
            state: seed ^ 0x005E_ED0F_B0FC_AC4E,
        }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut mixed = self.state;
        mixed = (mixed ^ (mixed >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        mixed = (mixed ^ (mixed >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        mixed ^ (mixed >> 31)
    }

    /// Uniform in `0..bound` (`bound > 0`).
    pub fn below(&mut self, bound: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(bound)) >> 64) as u64
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// True with probability `percent` / 100.
    pub fn percent(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// Samples keys `0..key_count` with probability proportional to `1 / (rank + 1)^alpha`.
pub struct Zipf {
    cumulative: Vec<f64>,
}

impl Zipf {
    pub fn new(key_count: usize, alpha: f64) -> Self {
        let mut total = 0.0;
        let cumulative = (0..key_count)
            .map(|rank| {
                total += 1.0 / ((rank + 1) as f64).powf(alpha);
                total
            })
            .collect::<Vec<_>>();
        let cumulative = cumulative.into_iter().map(|value| value / total).collect();
        Zipf { cumulative }
    }

    pub fn sample(&self, rng: &mut Rng) -> u64 {
        let target = rng.unit();
        self.cumulative.partition_point(|&value| value < target) as u64
    }
}

/// `request_count` Zipf(`alpha`) requests over `key_count` keys.
pub fn zipf_trace(key_count: usize, alpha: f64, request_count: usize, seed: u64) -> Vec<u64> {
    let zipf = Zipf::new(key_count, alpha);
    let mut rng = Rng::new(seed);
    (0..request_count).map(|_| zipf.sample(&mut rng)).collect()
}

/// Keys `0..loop_keys` requested in order, `rounds` times.
pub fn loop_trace(loop_keys: u64, rounds: u64) -> Vec<u64> {
    (0..rounds).flat_map(|_| 0..loop_keys).collect()
}

/// Miss ratio of `kind` over `trace` with a cache of `capacity_objects`.
pub fn miss_ratio(kind: PolicyKind, capacity_objects: usize, trace: &[u64]) -> f64 {
    let mut simulator = Simulator::new(kind, capacity_objects);
    for &key in trace {
        simulator.access(key);
    }
    simulator.miss_ratio()
}

/// One request of a mixed workload: a key and whether it belongs to the working set.
#[derive(Clone, Copy)]
pub struct Request {
    pub key: u64,
    pub working_set: bool,
}

/// Scan + working set: the working set (`working_set_keys` keys, re-read in order) is read
/// `warm_rounds` times alone, then re-read while a one-time scan of `scan_keys` new keys
/// streams through, `scan_per_reread` scan requests per working-set request.
pub fn scan_with_working_set(
    working_set_keys: u64,
    warm_rounds: u64,
    scan_keys: u64,
    scan_per_reread: u64,
) -> Vec<Request> {
    const SCAN_BASE: u64 = 1 << 40;
    let mut trace = Vec::new();
    for key in loop_trace(working_set_keys, warm_rounds) {
        trace.push(Request {
            key,
            working_set: true,
        });
    }
    let mut next_working_key = 0;
    for scan_key in 0..scan_keys {
        trace.push(Request {
            key: SCAN_BASE + scan_key,
            working_set: false,
        });
        if (scan_key + 1) % scan_per_reread == 0 {
            trace.push(Request {
                key: next_working_key,
                working_set: true,
            });
            next_working_key = (next_working_key + 1) % working_set_keys;
        }
    }
    trace
}

/// Hit ratio of the working-set requests *during the scan* (after the warm-up), and the miss
/// ratio of the whole trace. Scan requests use `scan_placement`.
pub struct ScanOutcome {
    pub working_set_hit_ratio: f64,
    pub overall_miss_ratio: f64,
}

pub fn run_scan(
    kind: PolicyKind,
    capacity_objects: usize,
    warm_requests: usize,
    trace: &[Request],
    scan_placement: Placement,
) -> ScanOutcome {
    let mut simulator = Simulator::new(kind, capacity_objects);
    let (mut working_hits, mut working_requests) = (0u64, 0u64);
    for (index, request) in trace.iter().enumerate() {
        let placement = if request.working_set {
            Placement::Normal
        } else {
            scan_placement
        };
        let hit = simulator.access_with_placement(request.key, placement);
        if request.working_set && index >= warm_requests {
            working_requests += 1;
            working_hits += u64::from(hit);
        }
    }
    ScanOutcome {
        working_set_hit_ratio: working_hits as f64 / working_requests.max(1) as f64,
        overall_miss_ratio: simulator.miss_ratio(),
    }
}
