#![deny(missing_docs)]
//! bufcache-device: the narrow interface between the cache and whatever stores the bytes.
//!
//! [`Device`] has vectored read and write, flush, discard, write-zeroes and extents, and
//! returns what it can do once as [`Capabilities`]. The real devices ([`FileDevice`],
//! [`MemoryDevice`]) and the wrappers that add counting ([`CountingDevice`]), a sorting and
//! merging request queue ([`IoQueue`]), injected faults ([`FaultDevice`]) and crashes
//! ([`CrashDevice`]) live here, outside the engine: they touch the operating system (threads,
//! sleeping, files), which the engine never does.

#![warn(missing_docs)]

pub mod aligned;
pub mod clock;
pub mod counting;
pub mod crash;
pub mod device;
pub mod fault;
pub mod file;
pub mod flush_group;
pub mod io_queue;
pub mod memory;
pub mod request;
pub mod rng;
pub mod size;
pub mod sparse;
mod strict;
pub mod sync;

pub use clock::Clock;
pub use counting::{CountingDevice, DeviceStats, DirectionStats};
pub use crash::{CrashDevice, CrashMode, CrashStats};
pub use device::{
    all_data, check_range, read_each_now, total_length, write_and_wait, write_each_now,
    write_zeroes_by_writing, Capabilities, Device, Extent,
};
pub use fault::{FaultDevice, FaultKind, FaultStats};
pub use file::{FileDevice, FileDeviceError, FileDeviceOptions};
pub use flush_group::{FlushGroup, FlushGroupStats};
pub use io_queue::{
    Direction, IoQueue, IoQueueConfig, IoQueueConfigError, IoQueueStats, QueueMode, QueueModeError,
    QueueOrder, Queued,
};
pub use memory::MemoryDevice;
pub use request::{ReadMemory, ReadRequest, Request, WriteMemory, WriteRequest};
pub use rng::SeededRng;
pub use sparse::SparseStore;
pub use sync::{DeadlineMutex, DeadlineMutexGuard, SleepingMutex};
