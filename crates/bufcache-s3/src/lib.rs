//! Object storage backend: a virtual disk stored as fixed-size chunk objects in an S3 bucket
//! (AWS S3, MinIO, Ceph RGW, moto ...), named by one URL:
//! `s3://BUCKET/PREFIX?endpoint=http://HOST:PORT&region=R&path-style=true&chunk-size=4M&create-size=100G`.
//!
//! Two layouts, recorded in the disk's metadata object: [`ChunkStore`] (fixed-size chunk
//! objects rewritten in place, zero elision, bounded parallel requests over the
//! `object_store` client) and [`LogStore`] (`layout=log`: immutable segments, an index and its
//! checkpoints). [`S3Device`] is a thin adapter from either to the engine's
//! [`bufcache_device::Device`] trait.

pub mod admin;
mod blocks;
mod credentials;
mod device;
mod error;
mod layout;
pub mod lease;
mod lock;
mod log;
mod meters;
pub mod replica;
mod retry_writes;
mod seal;
pub mod sim_check;
pub mod sim_clones;
pub mod sim_servers;
pub mod sim_store;
pub mod standby;
mod store;
mod url;

pub use device::S3Device;
pub use error::{DecodeError, OpenError, StoreError};
pub use lock::{release_locks, DiskLock, LockHolder, LOCK_NAME};
pub use log::{
    check_snapshot_name, GcReport, LiveBytesMismatch, LogConfig, LogConfigError, LogStore,
    LogSummary, SealParameters, SnapshotError, SnapshotSummary, SnapshotTaken,
    CHECKPOINT_INTERVAL_SEGMENTS_DEFAULT, GC_BYTES_MAX_DEFAULT, GC_INTERVAL_MS_DEFAULT,
    GC_REQUESTS_IN_FLIGHT_MAX_DEFAULT, GC_STORED_RATIO_MAX_DEFAULT, GC_THRESHOLD_DEFAULT,
    GET_BYTES_MAX_DEFAULT, SEALED_EXTENT_BYTES_MAX, SEGMENTS_IN_FLIGHT_MAX_DEFAULT,
    SEGMENT_BYTES_MAX_DEFAULT,
};
pub use meters::{
    LogStoreStats, StoreMeters, StoreStats, STORE_DURATION_BUCKETS_SECONDS, STORE_METHODS,
    STORE_OUTCOMES,
};
pub use store::{
    advance_generation, disk_identity, new_disk_id, probe, probe_counted, ChunkStore, DiskMetadata,
    DiskState, ReadOnly, FORMAT_VERSION, FORMAT_VERSION_CHUNK_CHECKED, FORMAT_VERSION_LOG,
};
pub use url::{
    Compression, LayoutKind, S3Url, UrlError, CHUNK_SIZE_DEFAULT_BYTES, LAYOUT_DEFAULT,
    SNAPSHOT_NAME_BYTES_MAX,
};
