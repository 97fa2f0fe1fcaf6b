//! CPU cost of the live what-if per block access: the hash-and-compare every block pays, and
//! the average including the miniature caches (s3fifo and LRU at six sizes) at the rate a
//! 64 MiB cache of 4 KiB blocks uses (1024 / 16384 = 6.25%, the clamp's floor).
//!
//! Run: `cargo run --release -p bufcache-policy --example whatif_cost`

use std::time::Instant;

use bufcache_policy::whatif::{sampling_hash, WhatIf};
use bufcache_policy::PolicyKind;

fn main() {
    let accesses = 20_000_000u64;
    // Keys: a skewed pseudo-random stream over 131072 blocks (a 512 MiB disk).
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let keys: Vec<u64> = (0..accesses)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let uniform = (state >> 11) as f64 / (1u64 << 53) as f64;
            (uniform.powi(3) * 131_072.0) as u64
        })
        .collect();
    let mut whatif = WhatIf::new(&[PolicyKind::S3Fifo, PolicyKind::Lru], 64 << 20, 4096, 0.01);
    let threshold = whatif.threshold();
    let start = Instant::now();
    let mut sampled = 0u64;
    for &key in &keys {
        sampled += u64::from(sampling_hash(key) < threshold);
    }
    let test_ns = start.elapsed().as_nanos() as f64 / accesses as f64;
    let start = Instant::now();
    for &key in &keys {
        whatif.access(key);
    }
    let total_ns = start.elapsed().as_nanos() as f64 / accesses as f64;
    println!(
        "rate {:.4}: sampled {sampled} of {accesses}; hash+compare {test_ns:.2} ns/block, \
         with miniatures {total_ns:.2} ns/block",
        whatif.sampling_rate()
    );
}
