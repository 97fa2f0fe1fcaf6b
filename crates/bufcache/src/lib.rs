//! bufcache: a concurrent block buffer cache with I/O clustering over pluggable devices.
//!
//! The engine owns buffers, the cache table, replacement (through `bufcache-policy`),
//! clustering, read-ahead, write-back and statistics. It knows nothing of NBD, async runtimes,
//! wall clocks or randomness: time and background execution are injected
//! ([`environment`]), so the simulator runs this same code on a virtual clock.
//!
//! Data flows one way: request → object (logical blocks) → buffer lookup → miss or
//! write-back → cluster → device. See `docs/design.md` for the buffer states and locking.

pub mod aligned;
mod buffer;
mod cache;
pub mod config;
pub mod counting;
pub mod crash;
pub mod device;
pub mod environment;
mod error;
pub mod fault;
pub mod file;
pub mod io_queue;
pub mod memory;
mod object;
mod readahead;
pub mod stats;
mod writeback;

pub use bufcache_policy::{Placement, PolicyKind};
pub use buffer::BlockKey;
pub use cache::{Cache, Environment};
pub use config::{format_size, parse_size, CacheConfig, ConfigError};
pub use counting::{CountingDevice, DeviceStats, DirectionStats};
pub use crash::{CrashDevice, CrashMode, CrashStats};
pub use device::{Device, Extent};
pub use environment::{Clock, InlineSpawner, NoSpawner, Spawner, SystemClock, ThreadPool};
pub use error::CacheError;
pub use fault::{FaultDevice, FaultKind, FaultStats};
pub use file::{FileDevice, FileDeviceError, FileDeviceOptions};
pub use io_queue::{IoQueue, IoQueueConfig, IoQueueStats, QueueMode};
pub use memory::MemoryDevice;
pub use object::{BlockMap, BufferGuard, IdentityMap, MappedRun, ObjectConfig, ObjectHandle};
pub use stats::{CacheStats, WritebackCause};
