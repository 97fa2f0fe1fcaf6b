//! Fuzz targets for every parser of untrusted input in bufcache.
//!
//! Each target is a plain `fn(&[u8])` that panics on a bug (a panic anywhere, including a
//! server thread, an assertion of an invariant, or a hang caught by a timeout). The same
//! functions run under two engines:
//! - cargo-fuzz / libFuzzer: `fuzz_targets/<name>.rs` wraps each one in `fuzz_target!`;
//! - the stable smoke runner (`src/bin/smoke.rs`), which scripts/fuzz-smoke runs in the test
//!   suite: random and mutated seed inputs, no coverage feedback, no nightly flags.
//!
//! Seed inputs live in `fuzz/corpus/<target>/`; the binary NBD seeds are written by
//! `smoke gen-corpus` from [`seeds`].

/// Prints to stderr when `FUZZ_DEBUG` is set: what an input reached (for checking seeds).
macro_rules! debug {
    ($($argument:tt)*) => {
        if $crate::debug_enabled() {
            eprintln!($($argument)*);
        }
    };
}

mod config;
mod input;
mod nbd;
pub mod seeds;
mod trace;

pub use config::{config_cache, config_server, nbd_addresses, size};
pub use nbd::{nbd_client, nbd_handshake, nbd_requests};
pub use trace::{
    trace_blkparse, trace_csv, trace_fio, trace_msr, trace_options, trace_oracle_general,
    trace_vscsi,
};

/// A fuzz target: panics on a bug, returns on any handled input.
pub type Target = fn(&[u8]);

/// Every target, by the name of its cargo-fuzz binary and corpus directory.
pub const TARGETS: &[(&str, Target)] = &[
    ("nbd_handshake", nbd_handshake),
    ("nbd_requests", nbd_requests),
    ("nbd_client", nbd_client),
    ("nbd_addresses", nbd_addresses),
    ("size", size),
    ("config_cache", config_cache),
    ("config_server", config_server),
    ("trace_options", trace_options),
    ("trace_csv", trace_csv),
    ("trace_blkparse", trace_blkparse),
    ("trace_msr", trace_msr),
    ("trace_fio", trace_fio),
    ("trace_oracle_general", trace_oracle_general),
    ("trace_vscsi", trace_vscsi),
];

/// Releases what the NBD targets hold (servers, socket files). Called by the smoke runner
/// at exit; under libFuzzer the process simply ends.
pub fn cleanup() {
    nbd::cleanup();
}

#[doc(hidden)]
pub fn debug_enabled() -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENABLED.get_or_init(|| std::env::var_os("FUZZ_DEBUG").is_some())
}
