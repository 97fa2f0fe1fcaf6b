//! Object storage backend: a virtual disk stored as fixed-size chunk objects in an S3 bucket
//! (AWS S3, MinIO, Ceph RGW, moto ...), named by one URL:
//! `s3://BUCKET/PREFIX?endpoint=http://HOST:PORT&region=R&path-style=true&chunk-size=4M&create-size=100G`.
//!
//! [`ChunkStore`] holds all the logic (metadata object, chunk reads and writes, zero elision,
//! bounded parallel requests over the `object_store` client); [`S3Device`] is a thin adapter to
//! the engine's [`bufcache::Device`] trait.

mod credentials;
mod device;
mod error;
mod lock;
mod store;
mod url;

pub use device::S3Device;
pub use error::{OpenError, StoreError};
pub use lock::{release_locks, DiskLock, LockHolder, LOCK_NAME};
pub use store::{ChunkStore, DiskMetadata, ReadOnly, FORMAT_VERSION};
pub use url::{S3Url, UrlError, CHUNK_SIZE_DEFAULT_BYTES};
