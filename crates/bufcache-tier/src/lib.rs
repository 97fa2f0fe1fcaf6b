#![deny(missing_docs)]
//! bufcache-tier: a persistent local tier below the cache.
//!
//! [`LocalTier`] is a [`Device`](bufcache_device::Device) that wraps the remote device (an
//! upstream NBD server, an object store, a slow file) and owns a local file or block device
//! holding a checksummed log: dirty records (writes not yet on the remote) and clean records
//! (a persistent read cache). A flush closes an epoch; write-back (a background thread, or
//! the caller's [`LocalTier::writeback_step`] in the simulator) writes epochs back to the
//! remote strictly in order, so the remote is always a prefix of the flushed writes at
//! epoch granularity. See docs/local-tier.md for the format and the guarantees.

pub mod config;
pub mod error;
pub mod format;
pub mod tier;

pub use config::{FlushTo, LocalTierConfig, LocalTierConfigError, WritebackDriver};
pub use error::TierError;
pub use tier::{
    check_log_path, migrate_identity, recorded_identity, recorded_superblock, LocalTier, TierStats,
    WritebackStep,
};
