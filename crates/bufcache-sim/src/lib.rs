//! bufcache-sim: the bufcache engine, unmodified, on simulated disks and a virtual clock.
//!
//! - [`check`]: `sim check`, seeded random workloads with faults and crashes checked against
//!   a shadow model of the engine's durability contract;
//! - [`check_tier`]: `sim check --local-tier`, the persistent local tier over a simulated
//!   local device and a remote, with crashes and the loss of the local device;
//! - [`clock`]: the virtual clock (the engine's injected `Clock`) and a portable RNG;
//! - [`disk`]: mechanical, SSD and network disk models and their presets ([`DiskSpec`]);
//! - [`host`]: CPU costs of system calls, lookups, copies, I/O and page wiring ([`HostCosts`]);
//! - [`core`]: timelines and accounts, [`SimDevice`] (the engine's `Device`) and
//!   [`SimSpawner`] (the engine's `Spawner`, feeding the simulated I/O daemon);
//! - [`fs`]: a 4.4BSD FFS model (cylinder groups, inodes, directories, bitmaps, indirect
//!   blocks) whose metadata goes through the cache;
//! - [`layout`]: newfs-style file layout (block, fragment, maxcontig, rotdelay) as the
//!   engine's `BlockMap`;
//! - [`sched`]: the deterministic scheduler of processes, the I/O daemon and the syncer;
//! - [`workload`]: dd, read-sweep, mixed scan + working set, tree copy, build;
//! - [`experiments`]: the seeds' experiments as tables, CSV, JSON and SVG plots;
//! - [`replay`]: block traces replayed through the engine on a simulated disk (open or
//!   closed loop), for time as well as misses.
//!
//! Entry points for the command line: [`run_experiment`], [`run_custom`], [`replay_trace`],
//! [`EXPERIMENTS`],
//! `DiskSpec::from_str`, `WorkloadSpec::from_str`, `HostCosts::from_str`.

pub mod check;
pub mod check_tier;
pub mod clock;
pub mod core;
pub mod disk;
pub mod experiments;
pub mod fs;
pub mod host;
pub mod layout;
pub mod replay;
pub mod report;
pub mod sched;
pub mod vm;
pub mod workload;

pub use bufcache_check::Violation;
pub use check::{check_seed, check_seeds, CheckSummary, CheckTotals, SeedOutcome};
pub use check_tier::{check_tier_seed_traced, check_tier_seeds};
pub use clock::{SimRng, VirtualClock};
pub use core::{
    Account, CrashOutcome, DeviceTotals, Dispatch, FaultConfig, FaultCounts, SharedRng, SimCore,
    SimDevice, SimIoQueue, SimSpawner, SimWaiter, SECTOR_BYTES,
};
pub use disk::{
    DiskKind, DiskModel, DiskSpec, HddModel, HddParams, Op, QueueModel, QueueParams, SpecError,
    DISK_PRESETS,
};
pub use experiments::{
    host_for, run_custom, run_custom_queued, run_experiment, CustomRun, ExperimentOptions,
    EXPERIMENTS,
};
pub use fs::{Ffs, NewfsParams};
pub use host::{HostCosts, HOST_PRESETS};
pub use layout::{FileMap, FsLayout, LayoutParams};
pub use replay::{
    replay_trace, replay_trace_with, LatencySummary, ReplayMode, ReplayOptions, ReplayReport,
};
pub use report::{Cell, Comparison, ComparisonKind, ExperimentResult, Plot, Series, Table};
pub use sched::{
    sim_cache_config, DirId, FileId, MemoryModel, MemoryReport, Os, PagingModel, Process,
    RunReport, SimConfig, SimError, Simulation, Step, SERVE_BACKGROUND_WORKERS,
};
pub use workload::WorkloadSpec;

/// The trace readers' crate, for [`TraceRequest`](bufcache_trace::TraceRequest) and `open_trace`.
pub use bufcache_trace;
