//! `strict_assert!`: invariant checks that are on in tests and CI and cost nothing otherwise.
//!
//! Enabled when debug assertions are on (every test and CI build) or with the calling crate's
//! feature `strict-asserts` (for a release build under a long soak): `cfg!` expands where the
//! macro is used, so each crate that asserts declares that feature. It lives in the lowest
//! crate so that every layer above (the engine, the backends, the NBD server) asserts with the
//! same macro without depending on the engine.

/// Asserts like `assert!` when strict assertions are enabled; compiles to nothing otherwise
/// (the condition is still type-checked).
#[macro_export]
macro_rules! strict_assert {
    ($($argument:tt)*) => {
        if cfg!(any(debug_assertions, feature = "strict-asserts")) {
            assert!($($argument)*);
        }
    };
}
