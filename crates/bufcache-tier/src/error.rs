//! Why a local tier could not be created or opened. Every variant names the local cache.

use std::io;

use crate::config::LocalTierConfigError;

/// Why a [`crate::LocalTier`] could not be created or opened.
#[derive(Debug, thiserror::Error)]
pub enum TierError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] LocalTierConfigError),
    /// The local cache does not exist and no size was given to create it.
    #[error("local cache {local} does not exist; give its size (--local-cache-size) to create it")]
    SizeRequired {
        /// The local cache.
        local: String,
    },
    /// The local cache could not be opened or created.
    #[error("cannot open local cache {local}: {source}")]
    Open {
        /// The local cache.
        local: String,
        /// The operating system's reason.
        source: io::Error,
    },
    /// The local cache is on a path this process may not write.
    #[error("local cache {local} is read-only ({source}): the tier writes its log there; give a writable path")]
    ReadOnly {
        /// The local cache.
        local: String,
        /// The operating system's reason.
        source: io::Error,
    },
    /// The local device is too small to hold a log.
    #[error("local cache {local} is {size_bytes} bytes: a local cache needs at least {minimum_bytes} bytes")]
    TooSmall {
        /// The local cache.
        local: String,
        /// Its size.
        size_bytes: u64,
        /// The smallest accepted.
        minimum_bytes: u64,
    },
    /// The file holds no superblock: it is not a local cache (garbage, or another file).
    #[error("local cache {local} is not a bufcache local cache (no superblock magic at offset 0): refusing to use it; delete it or give another path")]
    NotACache {
        /// The local cache.
        local: String,
    },
    /// The superblock's checksum does not match.
    #[error(
        "local cache {local}: the superblock is corrupt (checksum mismatch): nothing was replayed"
    )]
    SuperblockCorrupt {
        /// The local cache.
        local: String,
    },
    /// Another version of the format.
    #[error("local cache {local} has format version {found}; this build reads version {expected}")]
    Version {
        /// The local cache.
        local: String,
        /// The version found.
        found: u32,
        /// The version this build reads.
        expected: u32,
    },
    /// The cache belongs to another backend.
    #[error("local cache {local} belongs to backend `{found}`, not `{expected}`: refusing to attach it (nothing was replayed or written); it may hold flushed writes not yet on `{found}`: start `bufcache serve` on that backend with --local-cache {local} to write them back, and give this backend another --local-cache path")]
    OtherBackend {
        /// The local cache.
        local: String,
        /// The identity in the superblock.
        found: String,
        /// The identity of the backend being served.
        expected: String,
    },
    /// The backend's size changed since the cache was created.
    #[error("local cache {local} was made for a backend of {found} bytes, but `{identity}` is {expected} bytes: refusing to attach it (nothing was replayed)")]
    BackendSize {
        /// The local cache.
        local: String,
        /// The backend.
        identity: String,
        /// The size in the superblock.
        found: u64,
        /// The backend's size now.
        expected: u64,
    },
    /// The cache was created with another block size.
    #[error("local cache {local} has block size {found}, not {expected}")]
    BlockSize {
        /// The local cache.
        local: String,
        /// The block size in the superblock.
        found: u32,
        /// The configured block size.
        expected: u32,
    },
    /// The local device is shorter than the superblock says: truncated.
    #[error("local cache {local} is truncated: {actual} bytes, its superblock says {expected}: nothing was replayed")]
    Truncated {
        /// The local cache.
        local: String,
        /// The size the superblock records.
        expected: u64,
        /// Its size now.
        actual: u64,
    },
    /// The size asked for differs from the size the cache was created with.
    #[error("local cache {local} is {actual} bytes, not the {asked} bytes asked for (--local-cache-size): a local cache is not resized; give its size, or leave --local-cache-size out")]
    SizeMismatch {
        /// The local cache.
        local: String,
        /// Its size.
        actual: u64,
        /// The size asked for.
        asked: u64,
    },
    /// Neither checkpoint slot is valid.
    #[error("local cache {local}: both checkpoints are corrupt: nothing was replayed")]
    NoCheckpoint {
        /// The local cache.
        local: String,
    },
    /// The backend's size is not a multiple of the tier's block size.
    #[error("backend `{identity}` is {backend_bytes} bytes, not a multiple of the local tier's block size {block_bytes}")]
    BackendNotBlockMultiple {
        /// The backend.
        identity: String,
        /// Its size.
        backend_bytes: u64,
        /// The block size.
        block_bytes: u32,
    },
    /// The identity is longer than a superblock holds.
    #[error("backend identity is {0} bytes; a local cache's superblock holds at most 2048")]
    IdentityTooLong(usize),
    /// Reading or writing the local device failed.
    #[error("local cache {local}: {what}: {source}")]
    Io {
        /// The local cache.
        local: String,
        /// What was being done.
        what: &'static str,
        /// The device's error.
        source: io::Error,
    },
    /// The write-back thread could not be started.
    #[error("local cache {local}: cannot start the write-back thread: {source}")]
    Thread {
        /// The local cache.
        local: String,
        /// The operating system's reason.
        source: io::Error,
    },
    /// A log record is damaged although a valid record chained after it proves it had been
    /// made durable: corruption of the local device, not a crash's torn write.
    #[error("local cache {local}: the log record at offset {offset} (sequence {sequence}) is damaged (checksum mismatch), but {valid_after} valid record(s) chain after it and the one at offset {proof_offset} (sequence {proof_sequence}) was written after it had been fsynced: this is damage to the local device, not a write torn by a crash; refusing to attach (nothing was replayed or written to the remote), since the records from offset {offset} on may hold flushed writes that are not on the remote; to attach anyway, replaying only the records before offset {offset} and losing every write after them, give --local-cache-replay-prefix (LocalTierConfig::replay_damaged_prefix)")]
    DamagedRecord {
        /// The local cache.
        local: String,
        /// Byte offset of the damaged record in the local cache.
        offset: u64,
        /// The sequence number the damaged record claims.
        sequence: u64,
        /// Offset of the first valid later record whose durable mark covers it.
        proof_offset: u64,
        /// That record's sequence number.
        proof_sequence: u64,
        /// Valid records found chained after the damaged one.
        valid_after: u64,
    },
    /// Clean blocks of the cache (copies the remote held when they were logged) differ
    /// from the remote's bytes now: the remote is another disk reached the same way, or
    /// this disk was written around the cache since. Nothing was replayed or written.
    #[error("local cache {local}: {mismatched} of {sampled} sampled clean blocks differ from backend `{identity}` (first at byte {first_offset}): this cache was written through another disk reached the same way, or this disk was written around it since it was last attached; refusing to attach it (nothing was served, replayed or written, locally or to the backend). {}", other_content_advice(local, *dirty_bytes, *epochs))]
    OtherContent {
        /// The local cache.
        local: String,
        /// The backend's identity.
        identity: String,
        /// Clean blocks compared.
        sampled: u64,
        /// Of those, the ones whose bytes differ.
        mismatched: u64,
        /// Byte offset on the backend of the first block that differs.
        first_offset: u64,
        /// Bytes of logged writes not yet on the remote.
        dirty_bytes: u64,
        /// Epochs those writes are in.
        epochs: u64,
    },
}

/// What a cache refused for another disk's content holds, and the command that recovers it.
fn other_content_advice(local: &str, dirty_bytes: u64, epochs: u64) -> String {
    if dirty_bytes == 0 {
        format!("It holds no write that is not on the disk it was written through (only clean copies): serve that disk (the same export, reached the same way) with --local-cache {local} to keep using it, and give this backend another --local-cache path")
    } else {
        format!("It holds {dirty_bytes} bytes of flushed writes in {epochs} epochs not yet on the disk it was written through: serve that disk (the same export, reached the same way) with --local-cache {local} to write them back, and give this backend another --local-cache path")
    }
}
