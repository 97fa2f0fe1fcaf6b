#![deny(missing_docs)]
//! bufcache: a concurrent block buffer cache with I/O clustering over pluggable devices.
//!
//! The engine owns buffers, the cache table, replacement (through `bufcache-policy`),
//! clustering, read-ahead, write-back and statistics. It knows nothing of NBD, async runtimes,
//! wall clocks, sleeping or randomness: time, background execution and waiting are injected
//! ([`environment`]), so the simulator runs this same code on a virtual clock. This crate's
//! `clippy.toml` refuses real-time and thread primitives. Devices (the `Device` trait, files,
//! memory, and the counting, queueing, fault and crash wrappers) live in `bufcache-device`.
//!
//! Data flows one way: request → object (logical blocks) → buffer lookup → miss or
//! write-back → cluster → device. See `docs/design.md` for the buffer states and locking.

#[macro_use]
mod strict;
mod attached;
mod bsd;
mod buffer;
mod cache;
pub mod config;
mod dirty;
pub mod environment;
mod error;
mod guard;
mod handle;
mod io;
mod object;
mod read;
mod readahead;
mod residency;
pub mod stats;
mod table;
mod write;
mod writeback;

pub use bufcache_policy::{Placement, PolicyKind, PolicyParameters};
pub use buffer::BlockKey;
pub use cache::Cache;
pub use config::{format_size, parse_size, CacheConfig, ConfigError};
// The device crate is the engine's lower layer; it is re-exported (as `bufcache::device` and
// its main types at the top) so an embedder needs one dependency. Each type is defined once,
// in `bufcache-device`.
pub use bufcache_device as device;
pub use bufcache_device::aligned::Populate;
pub use bufcache_device::{
    Capabilities, CountingDevice, CrashDevice, CrashMode, CrashStats, Device, DeviceStats,
    DirectionStats, Extent, FaultDevice, FaultKind, FaultStats, FileDevice, FileDeviceError,
    FileDeviceOptions, IoQueue, IoQueueConfig, IoQueueConfigError, IoQueueStats, MemoryDevice,
    QueueMode, ReadMemory, ReadRequest, WriteMemory, WriteRequest,
};
pub use environment::{
    Clock, Environment, FrozenClock, InlineSpawner, Job, NoSpawner, NoWait, Spawner, Waiter,
};
pub use error::CacheError;
pub use guard::BufferGuard;
pub use handle::ObjectHandle;
pub use object::{BlockMap, IdentityMap, MappedRun, ObjectConfig};
pub use read::{ReadSink, StartedRead, StartedReadDone};
pub use residency::{Residency, ResidencyRun};
pub use stats::{
    CacheStats, WritebackCause, BUFFER_WAIT_BUCKETS_SECONDS, BUFFER_WAIT_BUCKET_COUNT,
};
pub use write::{WriteSource, ZeroOptions};
