//! A proptest run from one seed that a failure names, for the property tests (the `s3://` URL
//! and NBD URI round trips) that must be replayable like the checkers: the seed comes from
//! an environment variable when it is set, or is drawn at random, and a failing case panics
//! naming the variable and the seed. Proptest's own persistence of failures is off: the seed
//! is the record.

use proptest::strategy::Strategy;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};

/// Cases one run tries.
pub const CASES: u32 = 1024;

/// Runs `test` on [`CASES`] values of `strategy`, drawn from the seed the environment
/// variable `seed_variable` holds (a decimal `u64`) or, when it is unset or not a number,
/// from a seed drawn at random. A failing case panics with `name`, proptest's report of the
/// smallest failing value, and `replay with {seed_variable}={seed}`.
pub fn run_seeded<S: Strategy>(
    name: &str,
    seed_variable: &str,
    strategy: S,
    test: impl Fn(S::Value) -> Result<(), TestCaseError>,
) {
    let seed: u64 = std::env::var(seed_variable)
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or_else(rand::random);
    let mut seed_bytes = [0u8; 32];
    seed_bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let config = Config {
        cases: CASES,
        failure_persistence: None,
        ..Config::default()
    };
    let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &seed_bytes);
    let mut runner = TestRunner::new_with_rng(config, rng);
    if let Err(error) = runner.run(&strategy, test) {
        panic!("{name}: {error}; replay with {seed_variable}={seed}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn a_failing_case_names_its_seed_and_that_seed_replays_the_same_cases() {
        // Goal: a failure can be replayed: the panic names the variable and the seed, and a
        // run from that seed tries the same values. Method: a property that fails on large
        // values, run from a seed set in a variable of this test's own; the values two runs
        // from that seed try are compared.
        let variable = "BUFCACHE_CHECK_SEEDED_PROPTEST_TEST_SEED";
        std::env::set_var(variable, "42");
        let tried = || {
            let values = Mutex::new(Vec::new());
            run_seeded("collect", variable, 0..u32::MAX, |value| {
                values.lock().unwrap().push(value);
                Ok(())
            });
            values.into_inner().unwrap()
        };
        let first = tried();
        assert_eq!(first.len(), CASES as usize);
        assert_eq!(tried(), first, "one seed, one sequence of cases");
        let panic = std::panic::catch_unwind(|| {
            run_seeded("small values", variable, 0..u32::MAX, |value| {
                proptest::prop_assert!(value < 1000);
                Ok(())
            })
        })
        .expect_err("most values are not below 1000");
        let message = panic
            .downcast_ref::<String>()
            .expect("the panic carries a message");
        assert!(message.starts_with("small values: "), "{message}");
        assert!(
            message.ends_with(&format!("replay with {variable}=42")),
            "{message}"
        );
    }
}
