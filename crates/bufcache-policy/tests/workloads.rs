// Goal: miss ratios of every policy on Zipf and loop workloads, asserting only robust facts.
// Method: deterministic traces (Zipf alpha 0.8/0.9/1.0 over 10,000 keys; loops of 1.1x, 1.5x
// and 3x the cache) through the simulator with a 1,000-object cache; the table is printed
// (run with --nocapture) and docs/policies.md quotes it.

mod common;

use bufcache_policy::PolicyKind;
use common::{loop_trace, miss_ratio, zipf_trace};

const CAPACITY_OBJECTS: usize = 1_000;

fn ratios(name: &str, trace: &[u64]) -> Vec<(PolicyKind, f64)> {
    PolicyKind::ALL
        .iter()
        .map(|&kind| {
            let ratio = miss_ratio(kind, CAPACITY_OBJECTS, trace);
            println!("{name:>8} {kind:>7}: miss ratio {ratio:.4}");
            (kind, ratio)
        })
        .collect()
}

fn ratio_of(ratios: &[(PolicyKind, f64)], wanted: PolicyKind) -> f64 {
    ratios.iter().find(|(kind, _)| *kind == wanted).unwrap().1
}

#[test]
fn zipf_every_policy_beats_fifo_and_the_modern_ones_beat_lru() {
    for (alpha, seed) in [(0.8, 8), (0.9, 9), (1.0, 10)] {
        let trace = zipf_trace(10_000, alpha, 200_000, seed);
        let ratios = ratios(&format!("zipf{alpha}"), &trace);
        let fifo = ratio_of(&ratios, PolicyKind::Fifo);
        let lru = ratio_of(&ratios, PolicyKind::Lru);
        let best = ratios.iter().map(|(_, ratio)| *ratio).fold(1.0, f64::min);
        for &(kind, ratio) in &ratios {
            if kind != PolicyKind::Fifo {
                assert!(
                    ratio < fifo,
                    "zipf {alpha} seed {seed}: {kind} {ratio} >= fifo"
                );
            }
            if matches!(
                kind,
                PolicyKind::TwoQ | PolicyKind::Arc | PolicyKind::S3Fifo | PolicyKind::Sieve
            ) {
                assert!(
                    ratio < lru - 0.03,
                    "zipf {alpha} seed {seed}: {kind} {ratio} vs lru"
                );
            }
        }
        let s3fifo = ratio_of(&ratios, PolicyKind::S3Fifo);
        assert!(
            s3fifo <= best + 0.01,
            "zipf {alpha} seed {seed}: s3fifo {s3fifo} vs {best}"
        );
    }
}

#[test]
fn loops_larger_than_the_cache_defeat_recency() {
    for (loop_keys, rounds) in [(1_100, 20), (1_500, 20), (3_000, 10)] {
        let trace = loop_trace(loop_keys, rounds);
        let ratios = ratios(&format!("loop{loop_keys}"), &trace);
        for &(kind, ratio) in &ratios {
            match kind {
                // Every entry is evicted just before its next request.
                PolicyKind::Lru
                | PolicyKind::Fifo
                | PolicyKind::Clock
                | PolicyKind::Sieve
                | PolicyKind::Arc => assert!(ratio > 0.99, "loop {loop_keys}: {kind} {ratio}"),
                // Ghost-fed main queue: part of the loop settles in M and stays.
                PolicyKind::S3Fifo => assert!(ratio < 0.75, "loop {loop_keys}: {kind} {ratio}"),
                PolicyKind::TwoQ if loop_keys <= 1_500 => {
                    assert!(ratio < 0.6, "loop {loop_keys}: {kind} {ratio}")
                }
                PolicyKind::TwoQ => assert!(ratio > 0.99, "loop {loop_keys}: {kind} {ratio}"),
            }
        }
    }
}

#[test]
fn a_loop_that_fits_misses_only_once_per_key() {
    let trace = loop_trace(900, 10);
    for (kind, ratio) in ratios("loop900", &trace) {
        assert!((ratio - 0.1).abs() < 1e-9, "{kind}: {ratio}");
    }
}
