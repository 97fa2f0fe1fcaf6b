//! The harness catches a real engine bug: built with the `planted-defect` feature, the engine
//! marks buffers clean before writing them back, and `sim check` must find a seed that shows
//! it. Run with `cargo test -p bufcache-sim --features planted-defect --test planted_defect`.

#[cfg(feature = "planted-defect")]
#[test]
fn sim_check_finds_the_planted_clean_before_write_defect() {
    // Goal: prove the shadow model detects lost write-backs, not only that correct code
    // passes. Method: sweep seeds against the defective engine; at least one must report a
    // lost write or a stale read, naming its seed.
    let summary = bufcache_sim::check_seeds(1, 50, |_, _| {});
    for violation in summary.violations.iter().take(3) {
        eprintln!("seed {}: {}", violation.seed, violation);
    }
    assert!(
        summary
            .violations
            .iter()
            .any(|v| v.detail.starts_with("lost write") || v.detail.starts_with("stale read")),
        "the planted defect went unnoticed: {}",
        summary.line()
    );
}

#[cfg(not(feature = "planted-defect"))]
#[test]
fn planted_defect_is_absent_from_normal_builds() {
    // Goal: the defect never ships. Method: without the feature, the seeds the defect breaks
    // pass (the sweep in sim_check.rs covers the rest).
    let summary = bufcache_sim::check_seeds(1, 20, |_, _| {});
    assert!(summary.violations.is_empty(), "{}", summary.line());
}
