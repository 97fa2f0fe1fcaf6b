//! `sim check --local-tier` in CI size: the persistent local tier over a simulated local
//! device and remote, with remote faults, machine crashes and the loss of the local device.

#[test]
fn local_tier_seeds_lose_no_flushed_write_and_keep_the_remote_an_epoch_prefix() {
    // Goal: the tier's two promises (no acknowledged write lost in a crash; the remote alone
    // always an epoch prefix) hold over a few hundred seeds, and every restart (its URL
    // respelled) reattaches the tier while one presenting it to another disk is refused
    // without a byte changed. Method: run seeds 1..=300 of the checker; any violation names
    // its seed (`bufcache sim check --local-tier --seeds 1 --seed SEED --trace` replays it).
    // `TIER_CHECK_SEEDS=N` runs more.
    let seeds = std::env::var("TIER_CHECK_SEEDS")
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or(300);
    let summary = bufcache_sim::check_tier_seeds(1, seeds, |_, _| {});
    for violation in summary.violations.iter().take(10) {
        eprintln!("seed {}: {}", violation.seed, violation);
    }
    assert!(summary.violations.is_empty(), "{}", summary.line());
    assert!(
        summary.totals.crashes > 0,
        "no seed crashed: {}",
        summary.line()
    );
    assert!(
        summary.totals.device_faults > 0,
        "no seed injected a remote fault: {}",
        summary.line()
    );
    assert!(
        summary.totals.wrong_disk_refusals > 0,
        "no restart presented the tier to another disk: {}",
        summary.line()
    );
}

#[test]
fn a_local_tier_seed_replays_exactly() {
    // Goal: a violating seed can be replayed. Method: run the same seeds twice and compare
    // every outcome (steps, crashes, faults, verdict).
    for seed in [1, 7, 42] {
        let first = bufcache_sim::check_tier_seed_traced(seed, false);
        let second = bufcache_sim::check_tier_seed_traced(seed, false);
        assert_eq!(first, second, "seed {seed}");
    }
}

#[test]
fn a_read_after_a_failed_write_through_does_not_cache_what_the_remote_may_lose() {
    // Goal: a regression the checker found. A zeroing too long for a record went straight to
    // the remote and failed half-way, leaving zeroes the remote had not flushed; a read then
    // found them there and logged them as a clean record, which outlived the crash that made
    // the remote lose them: the tier served zeroes over a remote holding the older data, and
    // the remote no longer matched any epoch prefix of what the tier served. Method: replay
    // seed 1113, which showed it, and 403 and 3336, which failed the same check before the fix.
    for seed in [403, 1113, 3336] {
        let outcome = bufcache_sim::check_tier_seed_traced(seed, false);
        assert_eq!(outcome.violation, None, "seed {seed}");
    }
    let outcome = bufcache_sim::check_tier_seed_traced(1113, false);
    assert!(
        outcome.crashes > 0 && outcome.device_faults > 0,
        "seed 1113 no longer crashes after remote faults: {outcome:?}"
    );
}
