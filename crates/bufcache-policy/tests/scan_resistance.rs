// Goal: seed 003's "LRU isn't always the best policy" as a measurement. Method: a working set
// of a quarter of the cache is read twice, then re-read while a one-time scan of 10x the
// cache streams through (4 scan requests per working-set request); we print the working
// set's hit ratio during the scan per policy and assert what the measurements show: the
// scan-resistant policies keep it, LRU and FIFO lose it, and "no reuse" placement of the scan
// lets every policy keep it.

mod common;

use bufcache_policy::{Placement, PolicyKind};
use common::{run_scan, scan_with_working_set, Request, ScanOutcome};

const CAPACITY_OBJECTS: usize = 1_000;
const WORKING_SET_KEYS: u64 = CAPACITY_OBJECTS as u64 / 4;
const WARM_ROUNDS: u64 = 2;
const SCAN_KEYS: u64 = 10 * CAPACITY_OBJECTS as u64;
const SCAN_PER_REREAD: u64 = 4;

fn trace() -> Vec<Request> {
    scan_with_working_set(WORKING_SET_KEYS, WARM_ROUNDS, SCAN_KEYS, SCAN_PER_REREAD)
}

fn outcome(kind: PolicyKind, trace: &[Request], placement: Placement) -> ScanOutcome {
    let warm_requests = (WARM_ROUNDS * WORKING_SET_KEYS) as usize;
    let outcome = run_scan(kind, CAPACITY_OBJECTS, warm_requests, trace, placement);
    println!(
        "{kind:>7} scan {placement:?}: working-set hit ratio {:.3}, overall miss ratio {:.4}",
        outcome.working_set_hit_ratio, outcome.overall_miss_ratio
    );
    outcome
}

#[test]
fn scan_resistant_policies_keep_the_working_set_and_lru_loses_it() {
    let trace = trace();
    let minimum_hit_ratio = |kind| match kind {
        PolicyKind::Arc | PolicyKind::S3Fifo | PolicyKind::Sieve => Some(0.95),
        // 2Q's A1out remembers half a cache of keys: most, not all, re-reads are detected.
        PolicyKind::TwoQ => Some(0.75),
        _ => None,
    };
    for &kind in PolicyKind::ALL {
        let hit_ratio = outcome(kind, &trace, Placement::Normal).working_set_hit_ratio;
        if let Some(minimum) = minimum_hit_ratio(kind) {
            assert!(hit_ratio >= minimum, "{kind}: {hit_ratio:.3} < {minimum}");
        }
        if matches!(kind, PolicyKind::Lru | PolicyKind::Fifo) {
            assert!(
                hit_ratio <= 0.15,
                "{kind} kept the working set: {hit_ratio:.3}"
            );
        }
    }
}

#[test]
fn no_reuse_placement_of_the_scan_lets_every_policy_keep_the_working_set() {
    let trace = trace();
    for &kind in PolicyKind::ALL {
        let hit_ratio = outcome(kind, &trace, Placement::NoReuse).working_set_hit_ratio;
        assert!(
            hit_ratio >= 0.99,
            "{kind} with no-reuse scan: {hit_ratio:.3}"
        );
    }
}
