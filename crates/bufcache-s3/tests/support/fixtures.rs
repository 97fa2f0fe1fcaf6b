//! Test data the S3 tests share: random bytes from a seeded generator and a key file for
//! encrypted disks. Included by the tests that need it (`#[path = "support/fixtures.rs"] mod
//! fixtures;`), not by `support/mod.rs`, which the cli's tests include without `rand`.
#![allow(dead_code)]

use rand::Rng;

/// `length` random bytes from `rng`.
pub fn random(length: usize, rng: &mut impl Rng) -> Vec<u8> {
    let mut data = vec![0u8; length];
    rng.fill(&mut data[..]);
    data
}

/// A key file of 64 hex digits in `directory`; returns its path.
pub fn key_file(directory: &std::path::Path) -> String {
    let path = directory.join("key");
    let hex: String = (0..32u8)
        .map(|n| format!("{:02x}", n.wrapping_mul(29).wrapping_add(5)))
        .collect();
    std::fs::write(&path, format!("{hex}\n")).unwrap();
    path.display().to_string()
}
