//! `sim check`: seeded random workloads with faults and crashes through the real engine keep
//! the durability contract, and a seed replays exactly.

use bufcache_sim::{check_seed, check_seeds};

/// Seeds the CI sweep runs: about half a minute on the project's two-core test machine.
const CI_SEEDS: u64 = 1200;

#[test]
#[cfg_attr(
    feature = "planted-defect",
    ignore = "the planted defect breaks the contract"
)]
fn seeded_workloads_with_faults_and_crashes_keep_the_durability_contract() {
    // Goal: no seed finds a lost acknowledged write, a stale read, an unreported write-back
    // error, or a rescue file lost, replayed stale or refused fresh. Method: a sweep of seeds
    // through the real engine, each with tiny caches, several clients, seeded device faults,
    // crashes and store outages ending in rescue files, checked against the shadow model.
    let summary = check_seeds(1, CI_SEEDS, |_, _| {});
    for violation in &summary.violations {
        eprintln!("seed {}: {}", violation.seed, violation);
    }
    assert_eq!(summary.seeds, CI_SEEDS);
    assert!(
        summary.totals.crashes > CI_SEEDS / 2,
        "the sweep must exercise crashes: {}",
        summary.totals.crashes
    );
    assert!(
        summary.totals.device_faults > CI_SEEDS,
        "the sweep must exercise device faults: {}",
        summary.totals.device_faults
    );
    assert!(
        summary.totals.rescue.replayed > CI_SEEDS / 10
            && summary.totals.rescue.refused > CI_SEEDS / 10,
        "the sweep must replay fresh rescue files and refuse stale ones: {:?}",
        summary.totals.rescue
    );
    assert!(summary.violations.is_empty(), "{}", summary.line());
}

#[test]
fn a_seed_replays_exactly() {
    // Goal: a violation's seed reproduces it. Method: run the same seeds twice in one process
    // (after other seeds ran in between) and compare everything each run reports.
    let first: Vec<_> = (40..44).map(check_seed).collect();
    let _ = check_seed(7);
    let second: Vec<_> = (40..44).map(check_seed).collect();
    assert_eq!(first, second);
    assert!(first.iter().any(|outcome| outcome.crashes > 0));
}
