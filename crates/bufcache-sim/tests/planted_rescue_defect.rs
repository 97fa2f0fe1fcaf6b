//! `sim check` catches a stale rescue file replayed over newer data: built with the
//! `planted-rescue-defect` feature, the server's replay rule (`bufcache_host::rescue::
//! check_saved`) lets a file through whatever generation it records, and the checker must
//! report the replay within the first seeds. Run with
//! `cargo test -p bufcache-sim --features planted-rescue-defect --test planted_rescue_defect`.

#[cfg(feature = "planted-rescue-defect")]
#[test]
fn sim_check_finds_the_planted_stale_rescue_replay_defect() {
    // Goal: prove the rescue scenario's checks can fail, not only that the real rule passes.
    // Method: sweep the first seeds against the defective rule; at least one must report a
    // stale rescue file replayed (or the flushed writes it overwrote), naming its seed.
    let summary = bufcache_sim::check_seeds(1, 100, |_, _| {});
    for violation in summary.violations.iter().take(3) {
        eprintln!("seed {}: {}", violation.seed, violation);
    }
    assert!(
        summary
            .violations
            .iter()
            .any(|v| v.detail.starts_with("stale rescue file replayed")
                || v.detail.starts_with("lost write: a stale rescue file")),
        "the planted rescue defect went unnoticed: {}",
        summary.line()
    );
}

#[cfg(not(feature = "planted-rescue-defect"))]
#[test]
fn planted_rescue_defect_is_absent_from_normal_builds() {
    // Goal: the defect never ships, and the seeds it breaks refuse stale files. Method:
    // without the feature, the same seeds pass, and some of them refused a stale file.
    let summary = bufcache_sim::check_seeds(1, 100, |_, _| {});
    assert!(summary.violations.is_empty(), "{}", summary.line());
    assert!(
        summary.totals.rescue.refused > 0,
        "no stale file was presented: {summary:?}"
    );
}
