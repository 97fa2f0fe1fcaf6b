// Goal: our policies and simulator count misses exactly as libCacheSim does. Method: the
// expected values below were produced by libCacheSim 0.3.5 (PyPI `libcachesim`, unit object
// sizes, default parameters; S3-FIFO move-to-main threshold 2) replaying the very traces
// these tests generate, via `examples/miss_table.rs --dump` and
// `scripts/libcachesim_compare.py`. The simulator announces each miss before it evicts for it,
// so ARC adapts `p` when libCacheSim does and matches it exactly too.

mod common;

use bufcache_policy::simulate::Simulator;
use bufcache_policy::{Arc, Placement, Policy, PolicyKind, PolicyParameters, Slot, Verdict};
use common::{loop_trace, miss_ratio, scan_with_working_set, zipf_trace};

const CAPACITY_OBJECTS: usize = 1_000;

/// (policy, scan, zipf 0.9, loop 1.5x) miss ratios from libCacheSim, rounded to 4 places.
const LIBCACHESIM: &[(PolicyKind, [f64; 3])] = &[
    (PolicyKind::Lru, [0.9664, 0.4458, 1.0]),
    (PolicyKind::Fifo, [0.9616, 0.4923, 1.0]),
    (PolicyKind::Clock, [0.9338, 0.4335, 1.0]),
    (PolicyKind::TwoQ, [0.8221, 0.3888, 0.5426]),
    (PolicyKind::Arc, [0.7885, 0.3792, 1.0]),
    (PolicyKind::S3Fifo, [0.7885, 0.3671, 0.6264]),
    (PolicyKind::Sieve, [0.7885, 0.3717, 1.0]),
];

#[test]
fn miss_ratios_match_libcachesim_on_the_same_traces() {
    let scan: Vec<u64> = scan_with_working_set(250, 2, 10_000, 4)
        .iter()
        .map(|request| request.key)
        .collect();
    let traces = [
        scan,
        zipf_trace(10_000, 0.9, 200_000, 9),
        loop_trace(1_500, 20),
    ];
    for &(kind, expected) in LIBCACHESIM {
        let tolerance = 6e-5;
        for (trace, expected) in traces.iter().zip(expected) {
            let ours = miss_ratio(kind, CAPACITY_OBJECTS, trace);
            println!("{kind:>7}: ours {ours:.4}, libCacheSim {expected:.4}");
            assert!(
                (ours - expected).abs() <= tolerance,
                "{kind}: {ours} vs {expected}"
            );
        }
    }
}

/// The shipped CloudPhysics trace's lbn column (one unit-size object per request, as
/// libCacheSim's `--ignore-obj-size`), or None when the trace is not on this machine.
fn cloud_physics_keys() -> Option<Vec<u64>> {
    let candidates = [
        std::path::PathBuf::from("/work/shared/traces/cloudPhysicsIO.csv"),
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../../shared/traces/cloudPhysicsIO.csv"),
    ];
    let path = candidates.iter().find(|path| path.exists())?;
    let text = std::fs::read_to_string(path).expect("readable trace");
    let keys: Vec<u64> = text
        .lines()
        .skip(1)
        .map(|line| {
            let lbn = line.rsplit(',').next().expect("lbn column");
            lbn.trim().parse().expect("numeric lbn")
        })
        .collect();
    assert_eq!(keys.len(), 113_872, "{} changed", path.display());
    Some(keys)
}

/// (cache size in objects, libCacheSim 0.3.5 ARC misses) on cloudPhysicsIO, unit sizes:
/// `libcachesim.ARC(size).get(Request(obj_id=lbn, obj_size=1))` over every request.
const ARC_CLOUD_PHYSICS_MISSES: &[(usize, u64)] = &[
    (100, 97_330),
    (489, 94_229),
    (4_897, 88_002),
    (10_000, 79_413),
    (16_000, 67_162),
    (30_000, 64_282),
];

fn misses(mut simulator: Simulator, keys: &[u64]) -> u64 {
    for &key in keys {
        simulator.access(key);
    }
    simulator.misses()
}

// Goal: ARC counts exactly libCacheSim's misses on the real trace, at sizes from 0.2% to 60% of
// its distinct blocks. Before ARC's `p` became real-valued (the step |B2|/|B1| was rounded
// down) and the simulator announced misses, 10,000 objects differed by 1,352 misses (1.2e-2).
// Method: replay the trace through `Simulator` and compare miss counts.
#[test]
fn arc_matches_libcachesim_exactly_on_the_shipped_trace() {
    let Some(keys) = cloud_physics_keys() else {
        eprintln!("skipped: the cloudPhysicsIO trace is not on this machine");
        return;
    };
    for &(capacity, expected) in ARC_CLOUD_PHYSICS_MISSES {
        let ours = misses(Simulator::new(PolicyKind::Arc, capacity), &keys);
        assert_eq!(ours, expected, "ARC with {capacity} objects");
    }
}

/// ARC driven the way the engine drives it: the key of a miss is known only at `insert`,
/// after the eviction that made room for it.
struct Unannounced(Arc);

impl Policy for Unannounced {
    fn name(&self) -> &'static str {
        "arc-unannounced"
    }
    fn insert(&mut self, slot: Slot, key_hash: u64, placement: Placement) {
        self.0.insert(slot, key_hash, placement);
    }
    fn access(&mut self, slot: Slot) {
        self.0.access(slot);
    }
    fn remove(&mut self, slot: Slot) {
        self.0.remove(slot);
    }
    fn hold(&mut self, slot: Slot) {
        self.0.hold(slot);
    }
    fn release(&mut self, slot: Slot) {
        self.0.release(slot);
    }
    fn held(&self) -> usize {
        self.0.held()
    }
    fn evict(&mut self, verdict: &mut dyn FnMut(Slot) -> Verdict) -> Option<Slot> {
        self.0.evict(verdict)
    }
    fn len(&self) -> usize {
        self.0.len()
    }
}

// Goal: pin how far ARC drifts from libCacheSim when the cache cannot announce a miss before
// evicting for it (the engine's shards today): `p` then adapts one eviction late, REPLACE lacks
// the `x in B2 && |T1| == p` tie-break and ghosts are trimmed to the paper's bounds instead of
// one per eviction. Measured: at most 15 misses in 113,872 (1.3e-4, at 100 objects). Method:
// the same replay through a wrapper that drops the announcement; the bound catches a regression
// on the engine path, and the test fails if the two paths ever agree (then drop this pin).
#[test]
fn arc_without_miss_announcement_stays_within_3e_4_of_libcachesim() {
    let Some(keys) = cloud_physics_keys() else {
        eprintln!("skipped: the cloudPhysicsIO trace is not on this machine");
        return;
    };
    let mut largest_difference = 0.0f64;
    for &(capacity, expected) in ARC_CLOUD_PHYSICS_MISSES {
        let policy = Box::new(Unannounced(Arc::with_capacity(capacity)));
        let ours = misses(Simulator::with_policy(policy, capacity), &keys);
        let difference = (ours as f64 - expected as f64).abs() / keys.len() as f64;
        println!("{capacity:>6} objects: {ours} misses, libCacheSim {expected}, {difference:.2e}");
        largest_difference = largest_difference.max(difference);
    }
    assert!(largest_difference <= 3e-4, "{largest_difference}");
    assert!(
        largest_difference > 0.0,
        "the paths agree now: drop this pin"
    );
}

/// (policy, parameters, libCacheSim 0.3.5 misses) on cloudPhysicsIO at 4,897 objects (10% of
/// its distinct blocks), from the Python binding: `S3FIFO(c, small_size_ratio=…,
/// ghost_size_ratio=…, move_to_main_threshold=…)`, `TwoQ(c, a_in_size_ratio=…,
/// a_out_size_ratio=…)`, `Clock(c, n_bit_counter=…)`.
fn parameter_cases() -> Vec<(PolicyKind, PolicyParameters, u64)> {
    let defaults = PolicyParameters::default();
    vec![
        (PolicyKind::S3Fifo, defaults, 86_006),
        (
            PolicyKind::S3Fifo,
            PolicyParameters {
                s3fifo_small_queue_ratio: 0.2,
                s3fifo_ghost_size_ratio: 0.5,
                s3fifo_move_to_main_threshold: 1,
                ..defaults
            },
            88_485,
        ),
        (
            PolicyKind::S3Fifo,
            PolicyParameters {
                s3fifo_small_queue_ratio: 0.05,
                s3fifo_ghost_size_ratio: 2.0,
                s3fifo_move_to_main_threshold: 3,
                ..defaults
            },
            87_047,
        ),
        (PolicyKind::TwoQ, defaults, 88_160),
        (
            PolicyKind::TwoQ,
            PolicyParameters {
                two_q_ain_size_ratio: 0.1,
                two_q_aout_size_ratio: 1.0,
                ..defaults
            },
            84_810,
        ),
        (
            PolicyKind::TwoQ,
            PolicyParameters {
                two_q_ain_size_ratio: 0.5,
                two_q_aout_size_ratio: 0.25,
                ..defaults
            },
            89_858,
        ),
        (PolicyKind::Clock, defaults, 91_599),
        (
            PolicyKind::Clock,
            PolicyParameters {
                clock_bits: 2,
                ..defaults
            },
            91_531,
        ),
        (
            PolicyKind::Clock,
            PolicyParameters {
                clock_bits: 3,
                ..defaults
            },
            91_518,
        ),
    ]
}

// Goal: policy parameters mean what libCacheSim's mean, so a parameter sweep in `replay`
// compares with libCacheSim's. Method: replay the shipped trace with non-default S3-FIFO,
// 2Q and CLOCK parameters and compare miss counts with libCacheSim's for the same parameters.
#[test]
fn policy_parameters_match_libcachesim_on_the_shipped_trace() {
    let Some(keys) = cloud_physics_keys() else {
        eprintln!("skipped: the cloudPhysicsIO trace is not on this machine");
        return;
    };
    for (kind, parameters, expected) in parameter_cases() {
        parameters.validate().expect("valid parameters");
        let simulator = Simulator::with_parameters(kind, 4_897, &parameters);
        let ours = misses(simulator, &keys);
        assert_eq!(ours, expected, "{kind} with {parameters:?}");
    }
}
