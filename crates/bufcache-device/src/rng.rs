//! The one seeded generator of the project: fault and crash devices and the simulator draw
//! every random choice from it, so a run is reproduced exactly from its seed.
//!
//! It wraps xoshiro256++ from `rand_xoshiro` (a well-kept crate with a fixed, documented
//! output sequence) instead of a hand-written generator.

use rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;

/// A seeded, deterministic generator.
#[derive(Clone, Debug)]
pub struct SeededRng(Xoshiro256PlusPlus);

impl SeededRng {
    /// A generator starting from `seed`; the same seed always gives the same sequence.
    pub fn new(seed: u64) -> Self {
        SeededRng(Xoshiro256PlusPlus::seed_from_u64(seed))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// A uniform value in `[0, 1)`.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// A uniform value in `[0, bound)` (0 when `bound` is 0). Lemire's multiply-shift: no
    /// division, and the bias is below 2^-64 per draw, far under anything a test can see.
    pub fn below(&mut self, bound: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(bound)) >> 64) as u64
    }

    /// True with probability `probability`.
    pub fn chance(&mut self, probability: f64) -> bool {
        probability > 0.0 && self.next_f64() < probability
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_gives_same_sequence_and_bounds_hold() {
        // Goal: reproducibility from a seed, and `below` stays inside its bound.
        // Method: two generators from one seed agree on 1,000 draws; every draw is in range.
        let mut first = SeededRng::new(42);
        let mut second = SeededRng::new(42);
        for bound in 1..1_000u64 {
            let value = first.below(bound);
            assert_eq!(value, second.below(bound));
            assert!(value < bound);
        }
        assert_eq!(SeededRng::new(7).below(0), 0);
    }
}
