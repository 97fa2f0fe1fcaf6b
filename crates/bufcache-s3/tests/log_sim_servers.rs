//! `sim check --layout log --servers N` in CI size: two and three servers on one log-layout
//! disk take it from each other under the lease, through partitions, frozen processes, clock
//! skew within the bound and crashes, and never acknowledge at once or lose a flushed write;
//! and the check catches a writer that acknowledges past its lease:
//! `cargo test -p bufcache-s3 --features planted-lease-defect --test log_sim_servers`.

use bufcache_s3::sim_servers::check_servers_seeds;

#[cfg(not(feature = "planted-lease-defect"))]
#[test]
fn servers_on_one_log_disk_never_acknowledge_at_once_nor_lose_a_flush_on_60_seeds() {
    // Goal: at most one server acknowledges at any simulated instant (no two acknowledged
    // intervals overlap) and every FLUSH-acknowledged write survives every takeover, with
    // two and three servers per seed. Method: run seeds 1 to 60, each server count picked
    // by the seed (replay one with `bufcache sim check --layout log --servers 2-3 --seeds 1
    // --seed SEED --trace`).
    let summary = check_servers_seeds(1, 60, None, false, |_, _| {});
    for violation in &summary.violations {
        eprintln!("seed {}: {violation}", violation.seed);
    }
    assert!(
        summary.violations.is_empty(),
        "{} of {} seeds broke the contract",
        summary.violations.len(),
        summary.seeds
    );
    // The seeds exercise what they claim to: both server counts, takeovers checked at the
    // new writer's open, frozen writers whose requests land late, partitions, and writers
    // the lease stopped.
    assert!(
        summary.totals.seeds_two > 0 && summary.totals.seeds_three > 0,
        "{summary:?}"
    );
    assert!(summary.totals.takeovers >= 60, "{summary:?}");
    assert!(
        summary.totals.opens_checked > summary.totals.takeovers,
        "{summary:?}"
    );
    assert!(summary.totals.pauses_in_step > 0, "{summary:?}");
    assert!(summary.totals.partitions > 0, "{summary:?}");
    assert!(summary.totals.refused_by_lease > 0, "{summary:?}");
    assert!(summary.totals.late_landings > 0, "{summary:?}");
}

#[cfg(feature = "planted-lease-defect")]
#[test]
fn servers_check_finds_the_planted_writer_acknowledging_past_its_lease() {
    // Goal: prove the check detects a writer that keeps acknowledging after its lease ran
    // out (until it learns of the takeover). Method: run seeds against the defective build;
    // at least one must report overlapping acknowledged intervals.
    let summary = check_servers_seeds(1, 60, None, false, |_, _| {});
    for violation in summary.violations.iter().take(3) {
        eprintln!("seed {}: {violation}", violation.seed);
    }
    assert!(
        summary
            .violations
            .iter()
            .map(ToString::to_string)
            .any(|message| message.contains("acknowledged intervals overlap")),
        "the planted defect went unnoticed: {summary:?}"
    );
}
