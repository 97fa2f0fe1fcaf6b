//! `sim check --local-tier` catches a real tier bug: built with the `planted-tier-defect`
//! feature, the tier writes back the newest closed epoch first, and the checker must report
//! a remote that is not an epoch prefix within the first seeds. Run with
//! `cargo test -p bufcache-sim --features planted-tier-defect --test planted_tier_defect`.

#[cfg(feature = "planted-tier-defect")]
#[test]
fn sim_check_local_tier_finds_the_planted_newest_epoch_first_defect() {
    // Goal: prove the remote-prefix check can fail, not only that a correct tier passes.
    // Method: sweep the first seeds against the defective tier; one of the first few must
    // report a remote that is not an epoch prefix, naming its seed.
    let summary = bufcache_sim::check_tier_seeds(1, 10, |_, _| {});
    for violation in summary.violations.iter().take(3) {
        eprintln!("seed {}: {}", violation.seed, violation);
    }
    assert!(
        summary
            .violations
            .iter()
            .any(|v| v.detail.starts_with("remote not an epoch prefix")),
        "the planted tier defect went unnoticed: {}",
        summary.line()
    );
}

#[cfg(not(feature = "planted-tier-defect"))]
#[test]
fn planted_tier_defect_is_absent_from_normal_builds() {
    // Goal: the defect never ships. Method: without the feature, the seeds the defect breaks
    // pass (tier_check.rs sweeps more).
    let summary = bufcache_sim::check_tier_seeds(1, 10, |_, _| {});
    assert!(summary.violations.is_empty(), "{}", summary.line());
}
