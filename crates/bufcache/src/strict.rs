//! `strict_assert!`: invariant checks that are on in tests and CI and cost nothing otherwise.
//!
//! Enabled when debug assertions are on (every test and CI build) or with the crate feature
//! `strict-asserts` (for a release build under a long soak). Each state transition of the
//! engine asserts what it relies on: limits hold, dirty bookkeeping agrees, a buffer under I/O
//! is never evicted.

/// Asserts like `assert!` when strict assertions are enabled; compiles to nothing otherwise
/// (the condition is still type-checked). The device crate's macro, so every layer asserts
/// alike; `cfg!` expands in the crate using it, whose `strict-asserts` feature counts.
#[macro_export]
macro_rules! strict_assert {
    ($($argument:tt)*) => {
        $crate::device::strict_assert!($($argument)*)
    };
}
