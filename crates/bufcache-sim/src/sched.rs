//! The discrete-event scheduler: workload processes, the I/O daemons, the syncer and the
//! io queue's dispatches,
//! interleaved deterministically on virtual time.
//!
//! The engine is synchronous, so the simulator runs exactly one entity at a time and each
//! step runs to completion: a process step makes one system call through the engine (its
//! device requests block that process in virtual time), an I/O daemon runs one background
//! job the engine spawned (read-ahead, write-behind), the syncer calls
//! `Cache::writeback_tick` once a period, and with an io queue a dispatch hands the next
//! batch to the disk (see `core`: an entity whose request waits in the queue is blocked until
//! it is served). The entity with the earliest timeline runs next (ties: processes by index,
//! then the daemons, the syncer, the dispatch), so the same seed gives the same run, byte for
//! byte. Data a step read from the disk becomes visible to the others at
//! once, but a reader that finds a block whose read is still in flight in virtual time (read
//! by the daemon ahead of it) waits for that read's completion.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bufcache::{Cache, CacheConfig, CacheError, ConfigError, Environment, ObjectConfig};
use bufcache::{ObjectHandle, PolicyKind};
use serde::Serialize;

use crate::clock::{SimRng, VirtualClock};
use crate::core::{Account, DeviceTotals, SimCore, SimDevice, SimIoQueue, SimSpawner, SimWaiter};
use crate::disk::{DiskSpec, SpecError};
use crate::fs::{Ffs, FileMeta, FsGeometry, NewfsParams, RawMap, DIRECTORY_ENTRY_BYTES};
use crate::host::HostCosts;
use crate::layout::{FileMap, FsLayout, LayoutParams};
use crate::vm::{Activity, Release, VmDevice, VmPages};

/// An error of the simulator.
#[derive(Debug)]
pub enum SimError {
    /// The engine refused the configuration.
    Config(ConfigError),
    /// The engine failed a call.
    Cache(CacheError),
    /// A disk, host or workload description was refused.
    Spec(SpecError),
    /// Anything else (an unknown experiment, a full disk).
    Invalid(String),
}

impl fmt::Display for SimError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SimError::Config(e) => write!(f, "cache configuration: {e}"),
            SimError::Cache(e) => write!(f, "engine: {e}"),
            SimError::Spec(e) => write!(f, "{e}"),
            SimError::Invalid(message) => write!(f, "{message}"),
        }
    }
}

impl std::error::Error for SimError {}

impl From<ConfigError> for SimError {
    fn from(e: ConfigError) -> Self {
        SimError::Config(e)
    }
}
impl From<CacheError> for SimError {
    fn from(e: CacheError) -> Self {
        SimError::Cache(e)
    }
}
impl From<SpecError> for SimError {
    fn from(e: SpecError) -> Self {
        SimError::Spec(e)
    }
}

/// Everything a simulation is built from.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// The disk.
    pub disk: DiskSpec,
    /// The host's CPU costs.
    pub host: HostCosts,
    /// The engine's configuration (sizes, policy, limits).
    pub cache: CacheConfig,
    /// The file-system layout.
    pub layout: LayoutParams,
    /// Seed of every random choice.
    pub seed: u64,
    /// Period of the syncer (`writeback_tick`), virtual time.
    pub syncer_period: Duration,
    /// The io queue between the engine and the disk; `None` (the default): no queue.
    pub io_queue: Option<SimIoQueue>,
    /// I/O daemons running the engine's background jobs (read-ahead, write-behind), each
    /// one job at a time. Default 1; `serve` runs [`SERVE_BACKGROUND_WORKERS`].
    pub io_daemons: usize,
    /// The host's memory shared by the processes and the buffer area, watched (and with
    /// `dynamic`, the area resized) by a pager once a period; `None`: not modelled.
    pub memory: Option<MemoryModel>,
    /// The FFS model (`crate::fs`): cylinder groups, inodes, directories, bitmaps and
    /// indirect blocks written through the cache. `None` (the default): the flat layout of
    /// `layout`, no metadata I/O.
    pub fs: Option<NewfsParams>,
    /// 4.4BSD's update daemon: `sync` every period (30 s in 4.4BSD), from a process of its
    /// own so its writes are asynchronous to the workload. `None` (the default): none.
    pub update_period: Option<Duration>,
}

/// Memory shared by the running processes and the buffer area (seed 003's dynamic buffers):
/// every `period` a pager (the page daemon) computes the processes' demand —
/// `reserved_bytes` plus `process_bytes` (the working set) per primary process started and
/// not finished — and the pressure, the demand plus the buffer pages beyond `ram_bytes`.
///
/// - Fixed (`dynamic` false, 4.x's `buffer_map`): every buffer page is wired, so the page
///   daemon can take memory only from the processes.
/// - Dynamic (`dynamic` true, Tanimura's patch in seed 003): a clean buffer's pages are
///   unwired and passed to `vm_page_dontneed`, so under pressure the page daemon reclaims
///   them before any process page (`Cache::set_limits` evicts clean buffers), down to
///   `area_min_bytes`, the pages that stay wired (dirty or busy). Without pressure the area
///   grows back into the memory the processes leave.
///
/// With `paging`, what the processes lack is paged to a swap area on the same disk, in
/// disk time: see [`PagingModel`]. Without it the pressure is only watched.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryModel {
    /// The host's RAM.
    pub ram_bytes: u64,
    /// Memory the kernel and other programs hold.
    pub reserved_bytes: u64,
    /// Working set of each running primary process.
    pub process_bytes: u64,
    /// Buffer pages the page daemon cannot reclaim from a dynamic area (wired: dirty or
    /// busy).
    pub area_min_bytes: u64,
    /// Unwired, reclaimable buffer pages (dynamic) or a wired area (fixed).
    pub dynamic: bool,
    /// How often the pager looks.
    pub period: Duration,
    /// Paging to swap with a cost; `None`: the pressure is watched, not timed.
    pub paging: Option<PagingModel>,
    /// FreeBSD's global page replacement (`crate::vm`): file pages released by buffers stay
    /// resident in a VM page cache and compete with the processes' pages in one activity
    /// order; reads of resident pages cost no disk time. `false` (the default): the buffer
    /// area is the only file memory and the page daemon takes unwired buffer pages before
    /// any process page.
    pub page_cache: bool,
    /// With the page cache and a dynamic area: released buffer pages pass through
    /// `vm_page_dontneed`, as Tanimura's patch did (default); `false`: they go to the
    /// inactive queue's tail as 4.x's `vfs_vmio_release` puts them (the thread's variant
    /// "where vfs_unwirepages() does not call vm_page_dontneed()").
    pub dontneed: bool,
}

impl MemoryModel {
    /// Seed 003's ThinkPad 600E as `dynamic-buffers` models it at scale 1: 160 MiB of RAM
    /// (the thread), 16 MiB reserved (assumed), 6 MiB per job (assumed), 6 MiB wired
    /// (Tanimura: "only up to 6-7MB ... were wired down"), a fixed area, a look every
    /// 100 ms, and paging to 320 MiB of swap in 64 KiB clusters (twice RAM, assumed;
    /// FreeBSD's 16-page fault and page-out clusters).
    pub fn seed003() -> MemoryModel {
        let mib = 1u64 << 20;
        MemoryModel {
            ram_bytes: 160 * mib,
            reserved_bytes: 16 * mib,
            process_bytes: 6 * mib,
            area_min_bytes: 6 * mib,
            dynamic: false,
            period: Duration::from_millis(100),
            paging: Some(PagingModel {
                swap_bytes: 320 * mib,
                cluster_bytes: 64 << 10,
                page_outs_in_flight_max: PAGE_OUTS_IN_FLIGHT_MAX,
            }),
            page_cache: false,
            dontneed: true,
        }
    }
}

/// Syntax: `key=value,...` over [`MemoryModel::seed003`] — `ram`, `reserved`, `job` (each
/// running process's working set), `wired` (the floor a dynamic area keeps), `dynamic` (`on`
/// or `off`), `period_ms`, `swap` (a size, or `off`: pressure watched, not paged),
/// `cluster` (bytes per page-in and page-out), `pagecache` (`on` or `off`: FreeBSD's VM
/// page cache and global page replacement, see [`MemoryModel::page_cache`]) and `dontneed`
/// (`on` or `off`, [`MemoryModel::dontneed`]). `default` alone is seed 003's machine.
impl std::str::FromStr for MemoryModel {
    type Err = SpecError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        const KEYS: &str =
            "ram, reserved, job, wired, dynamic, period_ms, swap, cluster, pagecache, dontneed";
        let mut model = MemoryModel::seed003();
        let text = text.trim();
        if text.is_empty() || text == "default" {
            return Ok(model);
        }
        let size = |key: &str, value: &str| {
            bufcache::parse_size(value).map_err(|e| SpecError::new(key, value, &e.reason))
        };
        for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (key, value) = item
                .split_once('=')
                .ok_or_else(|| SpecError::new(item, "", &format!("key=value ({KEYS})")))?;
            let (key, value) = (key.trim(), value.trim());
            match key {
                "ram" => model.ram_bytes = size(key, value)?,
                "reserved" => model.reserved_bytes = size(key, value)?,
                "job" => model.process_bytes = size(key, value)?,
                "wired" => model.area_min_bytes = size(key, value)?,
                "dynamic" | "pagecache" | "dontneed" => {
                    let on = match value {
                        "on" | "1" | "true" => true,
                        "off" | "0" | "false" => false,
                        _ => return Err(SpecError::new(key, value, "on or off")),
                    };
                    match key {
                        "dynamic" => model.dynamic = on,
                        "pagecache" => model.page_cache = on,
                        _ => model.dontneed = on,
                    }
                }
                "period_ms" => {
                    let ms: u64 = value
                        .parse()
                        .ok()
                        .filter(|ms| (1..=60_000).contains(ms))
                        .ok_or_else(|| SpecError::new(key, value, "1 to 60000 ms"))?;
                    model.period = Duration::from_millis(ms);
                }
                "swap" if value == "off" => model.paging = None,
                "swap" | "cluster" => {
                    let bytes = size(key, value)?;
                    let paging = model.paging.get_or_insert(PagingModel {
                        swap_bytes: 320 << 20,
                        cluster_bytes: 64 << 10,
                        page_outs_in_flight_max: PAGE_OUTS_IN_FLIGHT_MAX,
                    });
                    if key == "swap" {
                        paging.swap_bytes = bytes;
                    } else {
                        paging.cluster_bytes = bytes;
                    }
                }
                _ => return Err(SpecError::new(key, value, &format!("a memory key: {KEYS}"))),
            }
        }
        if model.ram_bytes <= model.reserved_bytes {
            return Err(SpecError::new(
                "reserved",
                &model.reserved_bytes.to_string(),
                "less than ram",
            ));
        }
        if let Some(paging) = &model.paging {
            if paging.cluster_bytes == 0 || paging.cluster_bytes > paging.swap_bytes {
                return Err(SpecError::new(
                    "cluster",
                    &paging.cluster_bytes.to_string(),
                    "above 0 and at most swap",
                ));
            }
        }
        Ok(model)
    }
}

/// Paging to a swap area on the simulated disk. The memory the running processes lack (the
/// deficit: demand plus wired buffer pages beyond RAM) is taken evenly from their working
/// sets, so a fraction `deficit / (running × process_bytes)` of each is on swap. Each
/// [`Os::compute`] touches the process's whole working set once and so pages that
/// fraction back in first, blocking the process: one disk read per `cluster_bytes`, at a
/// random place in the swap area, each a fault (a trap and the pages' mapping, sys time).
/// The page daemon frees as much again by writing other pages out in `cluster_bytes` writes
/// placed one after another in the swap area; when the deficit grows it writes the growth
/// out too. Every page taken is assumed dirty (anonymous memory: a compiler's heap), so every
/// page-out is a write. The page-outs are asynchronous, as FreeBSD's were
/// (`vm_pageout_flush` → `swap_pager_putpages` with `VM_PAGER_PUT_ASYNC`): the daemon issues a
/// write and goes on scanning, with at most `page_outs_in_flight_max` writes in flight; with
/// every slot taken it waits for the first to finish (`getpbuf(&nsw_wcount_async)` sleeps).
/// The writes occupy the disk like any other request, so they delay the build's file I/O
/// and the page-ins, which still block the faulting process.
#[derive(Clone, Debug, PartialEq)]
pub struct PagingModel {
    /// Size of the swap area, bytes. It lies before the flat file layout (4.4BSD's
    /// disklabel put swap, `b`, after root and before /usr) or, with the FFS model, at the
    /// disk's end.
    pub swap_bytes: u64,
    /// Bytes one page-in reads and one page-out writes.
    pub cluster_bytes: u64,
    /// Page-out writes in flight at once, at least 1 (default
    /// [`PAGE_OUTS_IN_FLIGHT_MAX`]).
    pub page_outs_in_flight_max: usize,
}

/// Asynchronous page-out writes in flight at once: FreeBSD's `nsw_wcount_async`, set to 4 in
/// `swap_pager_swap_init` (sys/vm/swap_pager.c, 4.x and 5.0: "4 is a pretty good value"),
/// the count of swap buffers `swap_pager_putpages` takes with `getpbuf` for an asynchronous
/// write.
pub const PAGE_OUTS_IN_FLIGHT_MAX: usize = 4;

/// What the pager saw over a run.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct MemoryReport {
    /// Largest pressure seen (demand plus buffer pages beyond RAM), bytes.
    pub pressure_bytes_max: u64,
    /// Pressure integrated over time, byte-seconds (mean pressure × run time).
    pub pressure_byte_seconds: f64,
    /// Smallest and largest memory limit the buffer area had.
    pub area_min_bytes: u64,
    /// Largest memory limit the buffer area had.
    pub area_bytes_max: u64,
    /// Times the pager changed the limit.
    pub resizes: u64,
    /// Bytes paged in from swap (with a paging model).
    pub page_in_bytes: u64,
    /// Page-in reads.
    pub page_ins: u64,
    /// Bytes paged out to swap.
    pub page_out_bytes: u64,
    /// Page-out writes.
    pub page_outs: u64,
    /// Page-out writes a faulting process waited for (owed beyond the free minimum:
    /// `VM_WAIT`); the rest the page daemon issued without waiting.
    pub page_outs_waited: u64,
    /// The VM page cache (with [`MemoryModel::page_cache`]).
    pub page_cache: Option<crate::vm::PageCacheReport>,
}

/// The pager's state.
struct Pager {
    model: MemoryModel,
    account: usize,
    next_ns: u64,
    blocked: Option<u64>,
    area_bytes: u64,
    buffers_max: u64,
    last_ns: u64,
    last_pressure_bytes: u64,
    report: MemoryReport,
    /// With the page cache: when the page daemon's next scan of the page queues is due
    /// (bookkeeping only, so it runs on time even while the pager waits for its page-outs).
    scan_next_ns: u64,
    /// With the page cache: the process bytes the last scan left on swap.
    process_deficit_bytes: u64,
    /// When the pager last looked, and the longest time between two of its looks.
    look_last_ns: u64,
    look_gap_ns_max: u64,
}

/// How the pager kept up over a run (for tests and diagnosis).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PagerActivity {
    /// The longest time between two looks of the pager, ns.
    pub look_gap_ns_max: u64,
    /// The most page-out writes in flight at once.
    pub page_outs_in_flight_peak: usize,
    /// The bound on page-out writes in flight.
    pub page_outs_in_flight_max: usize,
    /// Page-out writes issued by the page daemon without waiting for them.
    pub page_outs_async: u64,
    /// Page-out writes a faulting process waited for (`VM_WAIT`: owed page-outs beyond
    /// the free minimum).
    pub page_outs_waited: u64,
}

/// One asynchronous page-out write slot (a swap buffer): its own account on the core, so
/// the write's disk time passes there and not on the pager.
struct PageOutSlot {
    account: usize,
    /// When its write finished (or finishes); a slot is free from then on.
    done_ns: u64,
    /// Its write waits in the io queue (the time it finishes comes later).
    queued: bool,
}

/// The VM page size, bytes (`crate::vm`).
const PAGE_BYTES_VM: u64 = crate::vm::PAGE_BYTES;

/// Where the flat layout's first file (or the swap area before it) starts: past the
/// superblock area.
const FLAT_LAYOUT_START_BYTES: u64 = 64 << 10;

/// Background worker threads `serve` gives the engine (`bufcache_host::BACKGROUND_WORKERS`):
/// with an io queue the simulator runs as many I/O daemons, so their requests can wait in
/// the queue together as they do in `serve`.
pub const SERVE_BACKGROUND_WORKERS: usize = 4;

impl SimConfig {
    /// A configuration for `disk` and `host` with the engine's defaults adjusted for
    /// simulation: one shard (an exact global policy; there is one thread).
    pub fn new(disk: DiskSpec, host: HostCosts) -> Self {
        SimConfig {
            disk,
            host,
            cache: sim_cache_config(CacheConfig::default()),
            layout: LayoutParams::default(),
            seed: 1,
            syncer_period: Duration::from_secs(1),
            io_queue: None,
            io_daemons: 1,
            memory: None,
            fs: None,
            update_period: None,
        }
    }
}

/// Adjusts an engine configuration for simulation: one shard (an exact global policy; one
/// entity runs at a time). Space waits, throttling and write-back stay as configured: waits
/// pass virtual time through [`SimWaiter`] instead of sleeping.
pub fn sim_cache_config(mut config: CacheConfig) -> CacheConfig {
    config.shards = 1;
    config
}

/// What a process step asks of the scheduler.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Run me again when my turn comes.
    Continue,
    /// Run me again after this many ns of virtual time without CPU (think time).
    Sleep(u64),
    /// I am finished.
    Done,
}

/// A workload process: a state machine making one system call per step.
pub trait Process: Send {
    /// Makes the next call.
    fn step(&mut self, os: &mut Os<'_>) -> Result<Step, SimError>;
}

/// A file in the simulated file system.
pub type FileId = usize;

struct SimFile {
    handle: ObjectHandle,
    map: Arc<FileMap>,
    length: u64,
    /// Bytes the file takes on disk: its length rounded up to whole fragments, as the file
    /// system stores a file's tail (the object covers them all, so a write that ends the file
    /// fills its last fragment and the next file's first write starts where it ended).
    stored_bytes: u64,
    block_size: u64,
}

/// The state processes act on.
pub struct World {
    core: Arc<SimCore>,
    cache: Cache,
    layout: FsLayout,
    files: Vec<SimFile>,
    host: HostCosts,
    scratch: Vec<u8>,
    /// Pages wired so far (charged from device reads at once, reconciled with the
    /// engine's miss and read-ahead counters at each sample).
    wired_pages: u64,
    evictions_seen: u64,
    block_pages: u64,
    page_bytes: u64,
    /// Engine calls left before the next full statistics sample.
    calls_to_sample: u64,
    /// The FFS model, when configured.
    ffs: Option<FfsState>,
    /// The paging model's state, when configured.
    paging: Option<Paging>,
    /// The device the engine's objects use: `device`, or the page cache in front of it.
    object_device: Arc<dyn bufcache::Device>,
    /// The VM page cache, when modelled.
    vm: Option<Arc<VmPages>>,
    /// Activity of each process's pages (by account), with the page cache: before its
    /// latest run, and from that run's start on (a step books its CPU ahead of the
    /// scheduler's time, so a scan may come before the run it has already booked).
    activity: std::collections::HashMap<usize, (Activity, Activity, u64)>,
}

/// The paging model's state: the processes page in (in [`Os::compute`]), the pager pages
/// out.
struct Paging {
    model: PagingModel,
    /// First byte of the swap area on the disk.
    swap_offset: u64,
    /// Working set of each running process.
    process_bytes: u64,
    /// Fraction of each running process's working set on swap, as the pager last saw it.
    nonresident_fraction: f64,
    /// The deficit the pager last saw, bytes.
    deficit_bytes: u64,
    /// Bytes the page daemon has still to write out.
    page_out_pending_bytes: u64,
    /// Where the next page-out goes, relative to `swap_offset`.
    page_out_cursor: u64,
    /// Places page-ins in the swap area.
    rng: SimRng,
    page_in_bytes: u64,
    page_ins: u64,
    page_out_bytes: u64,
    page_outs: u64,
    /// The swap buffers for asynchronous page-outs, `model.page_outs_in_flight_max` of
    /// them: at most that many writes are in flight.
    slots: Vec<PageOutSlot>,
    page_outs_in_flight_peak: usize,
    /// Page-outs the daemon may owe (pages taken but not yet written, so not free) before a
    /// faulting process finds no free page and waits for them (`VM_WAIT`): see
    /// [`free_min_bytes`].
    owed_bytes_max: u64,
    /// Page-outs written while a faulting process waited for them.
    page_outs_waited: u64,
    /// The pager's account (the page daemon's CPU for the page-outs goes there), and whether
    /// requests pass an io queue (then a faulting process's continuation cannot switch its
    /// CPU account, and the issue CPU of the page-outs it waits for stays its own).
    pager_account: usize,
    io_queue: bool,
}

/// FreeBSD 4.x's free-page minimum for `ram_bytes` of RAM, below which a faulting process
/// sleeps in `VM_WAIT` until the page daemon has freed pages: `v_free_min = 4 + (pages −
/// 1024) / 200` (vm_pageout.c, `vm_pageout()`), in 4 KiB pages. The `v_free_reserved` that
/// 4.x adds on top (tens of pages more) is left out.
pub fn free_min_bytes(ram_bytes: u64) -> u64 {
    let page = PAGE_BYTES_VM;
    let pages = ram_bytes / page;
    (4 + pages.saturating_sub(1024) / 200) * page
}

impl Paging {
    /// The pager's latest deficit: the share of each running process's working set on swap,
    /// and page-outs owed for its growth (page-ins owe theirs when they happen).
    fn set_deficit(&mut self, deficit: u64, working: u64) {
        self.nonresident_fraction = if working == 0 {
            0.0
        } else {
            (deficit as f64 / working as f64).min(1.0)
        };
        self.page_out_pending_bytes += deficit.saturating_sub(self.deficit_bytes);
        self.deficit_bytes = deficit;
    }
}

/// The FFS model's state: the allocator, the raw-device object caching metadata blocks,
/// each file's metadata and the directories.
struct FfsState {
    ffs: Ffs,
    raw: ObjectHandle,
    block_size: u64,
    /// Per file (by `FileId`): its metadata and how many of its indirect blocks exist yet.
    files: Vec<Option<(FileMeta, usize)>>,
    /// Directories: the file holding them, their group, entries so far.
    directories: Vec<Directory>,
    /// What aging left, when the file system was aged before the run.
    aging: Option<crate::fs::AgingReport>,
}

struct Directory {
    file: FileId,
    group: usize,
    entries: u64,
}

/// A directory of the FFS model (index into the directories; 0 is the root).
pub type DirId = usize;

const DIRECTORY_BLOCK_BYTES_USIZE: usize = crate::fs::DIRECTORY_BLOCK_BYTES as usize;

/// Entries the root directory is sized for. **Assumed**; entries past it reuse its blocks.
const ROOT_DIRECTORY_ENTRIES: u64 = 4096;

impl World {
    /// Pages in the part of the current process's working set that is on swap (it is about
    /// to touch all of it): one blocking read per cluster at a random place in the swap
    /// area, each a fault costing a trap and the mapping of its pages. The page daemon owes
    /// as many bytes of page-outs; while it owes more than the free minimum the faulting
    /// process (`account`) waits for the excess to be written first (`VM_WAIT`).
    fn page_in(&mut self, account: usize) {
        let Some(paging) = self.paging.as_mut() else {
            return;
        };
        if paging.nonresident_fraction <= 0.0 {
            return;
        }
        let page = self.page_bytes;
        let bytes = ((paging.nonresident_fraction * paging.process_bytes as f64) as u64)
            .div_ceil(page)
            * page;
        let cluster = paging.model.cluster_bytes;
        // The pages this fault fills must be free first: the page daemon owes their
        // page-outs. Past the free minimum the faulting process waits (VM_WAIT) while the
        // excess is written, so owed page-outs never pile up beyond it; the daemon issues the
        // rest asynchronously at its next look.
        paging.page_out_pending_bytes += bytes;
        let area = (paging.model.swap_bytes / cluster).max(1) * cluster;
        let waits = paging.page_out_pending_bytes > paging.owed_bytes_max;
        // The writes are the page daemon's: their CPU is its; the process only waits.
        let restore = (waits && !paging.io_queue).then(|| {
            let (cursor, origin) = self.core.cursor_and_origin();
            self.core
                .enter_on_behalf(account, paging.pager_account, cursor);
            origin
        });
        while paging.page_out_pending_bytes > paging.owed_bytes_max {
            let length = paging.page_out_pending_bytes.min(cluster);
            if paging.page_out_cursor + length > area {
                paging.page_out_cursor = 0;
            }
            self.core
                .swap_io(true, paging.swap_offset + paging.page_out_cursor, length);
            paging.page_out_cursor += length;
            paging.page_outs += 1;
            paging.page_outs_waited += 1;
            paging.page_out_bytes += length;
            paging.page_out_pending_bytes -= length;
        }
        if let Some(origin) = restore {
            let cursor = self.core.cursor();
            self.core.enter_on_behalf(account, origin, cursor);
        }
        let slots = (paging.model.swap_bytes / cluster).max(1);
        let mut left = bytes;
        while left > 0 {
            let length = left.min(cluster);
            let offset = paging.swap_offset + paging.rng.below(slots) * cluster;
            let pages = length.div_ceil(page);
            self.core
                .cpu(0, self.host.syscall_ns + pages * self.host.wire_page_ns);
            self.core.swap_io(false, offset, length);
            paging.page_ins += 1;
            paging.page_in_bytes += length;
            left -= length;
        }
    }

    /// The page daemon issues the page-outs it owes at `time`, in clusters placed one after
    /// another in the swap area (wrapping at its end), each as an asynchronous write on a
    /// free slot (its CPU charged to `pager_account`); it does not wait for them. Returns
    /// when the first busy slot frees if page-outs are still owed with every slot taken (the
    /// daemon then resumes), `None` when nothing is owed or that time is not known yet (a
    /// write waits in the io queue: its completion wakes the pager).
    fn page_out(&mut self, time: u64, pager_account: usize) -> Option<u64> {
        let paging = self.paging.as_mut()?;
        let cluster = paging.model.cluster_bytes;
        let area = (paging.model.swap_bytes / cluster).max(1) * cluster;
        while paging.page_out_pending_bytes > 0 {
            let Some(slot) = paging
                .slots
                .iter_mut()
                .find(|slot| !slot.queued && slot.done_ns <= time)
            else {
                break;
            };
            let length = paging.page_out_pending_bytes.min(cluster);
            if paging.page_out_cursor + length > area {
                paging.page_out_cursor = 0;
            }
            self.core.enter_on_behalf(slot.account, pager_account, time);
            self.core
                .swap_io(true, paging.swap_offset + paging.page_out_cursor, length);
            match self.core.end_step() {
                Some(end) => slot.done_ns = end,
                None => slot.queued = true,
            }
            paging.page_out_cursor += length;
            paging.page_outs += 1;
            paging.page_out_bytes += length;
            paging.page_out_pending_bytes -= length;
            let in_flight = paging
                .slots
                .iter()
                .filter(|slot| slot.queued || slot.done_ns > time)
                .count();
            paging.page_outs_in_flight_peak = paging.page_outs_in_flight_peak.max(in_flight);
        }
        if paging.page_out_pending_bytes == 0 || paging.slots.iter().any(|slot| slot.queued) {
            return None;
        }
        paging.slots.iter().map(|slot| slot.done_ns).min()
    }

    /// Charges page wiring for buffers the engine filled and unwiring for buffers it evicted,
    /// to the running entity, at O(1) cost per call.
    ///
    /// Buffers filled from the disk are known at once from the device reads of the step (the
    /// common case: reads and read-ahead). Buffers created without a read (whole-block writes)
    /// and evictions are only visible in `Cache::stats`, which scans every cached entry; it is
    /// sampled once every `buffers_in_use / 8` calls (at least every 64), so the amortized
    /// scan per call stays constant however full the cache is, and those charges land up to
    /// one sample period late (on the entity running then). [`World::sample_engine`] is also
    /// forced when a process finishes, so every run's totals are exact.
    fn charge_engine(&mut self) {
        let read_bytes = self.core.take_read_bytes();
        let pages = read_bytes.div_ceil(self.page_bytes);
        self.wired_pages += pages + self.served_pages();
        self.core.cpu(0, pages * self.host.wire_page_ns);
        self.calls_to_sample = self.calls_to_sample.saturating_sub(1);
        if self.calls_to_sample == 0 {
            self.sample_engine();
        }
    }

    /// One look of the global page replacement (with the page cache): the memory left after
    /// the reserve holds the running processes' working sets and the file pages (the
    /// buffers' and the page cache's). When they do not fit, the page daemon reclaims in
    /// activity order: first every file page whose key is below the least active running
    /// process's (cached pages idle longer than any process), then process pages — taken
    /// evenly from the running processes, as a clock hand over their interleaved pages
    /// takes them — and only when no process page is left, the remaining file pages.
    /// Pages of the wired buffers (the whole area when fixed, the floor when dynamic) are
    /// never reclaimed. Returns the process bytes that must be on swap.
    fn replace_pages(
        &mut self,
        model: &MemoryModel,
        running: &[(usize, u64)],
        memory_used: u64,
        time: u64,
    ) -> u64 {
        let Some(vm) = self.vm.clone() else {
            return 0;
        };
        let page = PAGE_BYTES_VM;
        let processes = running.len() as u64 * model.process_bytes;
        let engine_pages = memory_used.div_ceil(page);
        let file_pages = vm.resident_pages().max(engine_pages);
        let wired_pages = if model.dynamic {
            engine_pages.min(model.area_min_bytes / page)
        } else {
            engine_pages
        };
        let mut reclaimable = vm.resident_pages().saturating_sub(wired_pages);
        let room = model.ram_bytes.saturating_sub(model.reserved_bytes);
        let mut excess = (processes + file_pages * page).saturating_sub(room);
        if excess == 0 {
            return 0;
        }
        // The least active running process: one that has not run yet has a fresh page's
        // count from its start.
        let threshold = running
            .iter()
            .map(|&(account, start)| match self.activity.get(&account) {
                Some(&(_, after, from)) if from <= time => after.key(),
                Some(&(before, _, _)) => before.key(),
                None => Activity::new(start.min(time)).key(),
            })
            .min();
        let idle = vm.reclaim(excess.div_ceil(page).min(reclaimable), threshold);
        reclaimable -= idle;
        excess = excess.saturating_sub(idle * page);
        let deficit = excess.min(processes);
        excess -= deficit;
        if excess > 0 {
            vm.reclaim(excess.div_ceil(page).min(reclaimable), None);
        }
        deficit
    }

    /// Buffer pages the page cache filled since the last call: their rewiring was charged
    /// when served.
    fn served_pages(&mut self) -> u64 {
        self.vm.as_ref().map_or(0, |vm| {
            let pages = vm.take_served_pages();
            pages * PAGE_BYTES_VM / self.page_bytes.max(1)
        })
    }

    /// The process on `account` ran from `start_ns` to `end_ns`: its pages were referenced.
    fn touch_process(&mut self, account: usize, start_ns: u64, end_ns: u64) {
        if self.vm.is_none() {
            return;
        }
        let entry = self
            .activity
            .entry(account)
            .or_insert_with(|| (Activity::new(start_ns), Activity::new(start_ns), start_ns));
        let mut after = entry.1;
        after.reference(start_ns, end_ns);
        *entry = (entry.1, after, start_ns);
    }

    /// A system call used the device bytes of `ranges` at the current time: with the page
    /// cache their pages are resident and referenced.
    fn touch_file(&self, ranges: &[(u64, u64)]) {
        if let Some(vm) = &self.vm {
            let now = self.core.cursor();
            for &(offset, length) in ranges {
                vm.reference(offset, length, now);
            }
        }
    }

    /// Reconciles the charges with the engine's counters: fresh buffers the device reads did
    /// not account for, and evictions.
    fn sample_engine(&mut self) {
        let read_bytes = self.core.take_read_bytes();
        let pages = read_bytes.div_ceil(self.page_bytes);
        self.wired_pages += pages + self.served_pages();
        let stats = self.cache.stats_without_pinned();
        let fresh_pages = (stats.misses + stats.readahead_issued_blocks) * self.block_pages;
        let unwired = fresh_pages.saturating_sub(self.wired_pages);
        self.wired_pages = self.wired_pages.max(fresh_pages);
        let evicted = stats.evictions.saturating_sub(self.evictions_seen);
        self.evictions_seen = stats.evictions;
        let sys = (pages + unwired) * self.host.wire_page_ns
            + evicted * self.block_pages * self.host.unwire_page_ns;
        self.core.cpu(0, sys);
        self.calls_to_sample = (stats.buffers_in_use / 8).max(64);
    }

    fn create(&mut self, name: &str, length: u64) -> Result<FileId, SimError> {
        if self.ffs.is_some() {
            return self.place(name, length, Some(0), false);
        }
        let map = self.layout.allocate(length).ok_or_else(|| {
            SimError::Invalid(format!(
                "the simulated disk is full: cannot place {name} ({length} bytes)"
            ))
        })?;
        let block_size = map.block_size() as u32;
        let stored_bytes = length.next_multiple_of(u64::from(self.layout.params().fragment_size));
        let mut config = ObjectConfig::new(name, self.object_device.clone()).block_size(block_size);
        config.length_bytes = Some(stored_bytes.max(1));
        config.block_map = Some(map.clone() as Arc<dyn bufcache::BlockMap>);
        let handle = self.cache.open_object(config)?;
        self.files.push(SimFile {
            handle,
            map,
            length,
            stored_bytes,
            block_size: block_size as u64,
        });
        if let Some(state) = &mut self.ffs {
            state.files.push(None);
        }
        Ok(self.files.len() - 1)
    }

    /// Places a file (in directory `directory`) or a directory (`make_directory`, in the
    /// group `ffs_dirpref` picks) with the FFS model and opens its object. No I/O.
    fn place(
        &mut self,
        name: &str,
        length: u64,
        directory: Option<DirId>,
        make_directory: bool,
    ) -> Result<FileId, SimError> {
        let state = self.ffs.as_mut().expect("the FFS model is configured");
        let full = |e: crate::fs::FsError| {
            SimError::Invalid(format!("cannot place {name} ({length} bytes): {e}"))
        };
        let (placed, length) = if make_directory {
            let entries = length / DIRECTORY_ENTRY_BYTES;
            let placed = state.ffs.make_directory(entries).map_err(full)?;
            (placed, crate::fs::directory_bytes(entries))
        } else {
            let group = directory.map(|d| state.directories[d].group).unwrap_or(0);
            (state.ffs.create_file(group, length).map_err(full)?, length)
        };
        let fragment = u64::from(state.ffs.params().fragment_size);
        let block_size = placed.map.block_size();
        let stored_bytes = length.next_multiple_of(fragment).max(1);
        let mut config =
            ObjectConfig::new(name, self.object_device.clone()).block_size(block_size as u32);
        config.length_bytes = Some(stored_bytes);
        config.block_map = Some(placed.map.clone() as Arc<dyn bufcache::BlockMap>);
        let handle = self.cache.open_object(config)?;
        self.files.push(SimFile {
            handle,
            map: placed.map,
            length,
            stored_bytes,
            block_size,
        });
        let id = self.files.len() - 1;
        let state = self.ffs.as_mut().expect("the FFS model is configured");
        state.files.push(Some((placed.meta, 0)));
        Ok(id)
    }

    /// Writes `length` bytes of metadata at device offset `offset` through the raw-device
    /// object: synchronously (`bwrite`) or as a delayed write (`bdwrite`).
    fn metadata_write(
        &mut self,
        offset: u64,
        length: u64,
        synchronous: bool,
    ) -> Result<(), SimError> {
        let state = self.ffs.as_ref().expect("the FFS model is configured");
        if self.scratch.len() < length as usize {
            self.scratch.resize(length as usize, 0);
        }
        state
            .raw
            .write_at(offset, &self.scratch[..length as usize], synchronous)?;
        Ok(())
    }

    /// Reads the metadata block at `offset` (`bread`): synchronous, cached.
    fn metadata_read(&mut self, offset: u64) -> Result<(), SimError> {
        let state = self.ffs.as_ref().expect("the FFS model is configured");
        let block = state.block_size;
        if self.scratch.len() < block as usize {
            self.scratch.resize(block as usize, 0);
        }
        state
            .raw
            .read_at(offset, &mut self.scratch[..block as usize])?;
        self.core.wait_for_data(offset, block);
        Ok(())
    }
}

/// The system-call interface a process step uses.
pub struct Os<'a> {
    world: &'a mut World,
    rng: &'a mut SimRng,
    metrics: &'a mut Vec<(String, f64)>,
    account: usize,
}

impl Os<'_> {
    /// The process's virtual time, ns. With an io queue it is exact at the start of a step
    /// only: after a request that waits in the queue the rest of the step is replayed later
    /// (see `core`), so a process that times its own I/O reads the clock in its next step.
    pub fn now(&self) -> u64 {
        self.world.core.cursor()
    }

    /// The process's random number generator.
    pub fn rng(&mut self) -> &mut SimRng {
        self.rng
    }

    /// Records a named result of the process (kept in its report, in order).
    pub fn record(&mut self, key: impl Into<String>, value: f64) {
        self.metrics.push((key.into(), value));
    }

    /// The process's account so far.
    pub fn account(&self) -> Account {
        self.world.core.account(self.account)
    }

    /// User-mode computation of `ns`. With a paging model the process first pages in the
    /// part of its working set that is on swap (see [`PagingModel`]).
    pub fn compute(&mut self, ns: u64) {
        self.world.page_in(self.account);
        self.world.core.cpu(ns, 0);
        // The process held the CPU for the last `ns` of the call (before: paging in, waiting
        // for the CPU); its pages were referenced then.
        let end = self.world.core.cursor();
        self.world
            .touch_process(self.account, end.saturating_sub(ns), end);
    }

    /// Length of a file.
    pub fn file_len(&self, file: FileId) -> u64 {
        self.world.files[file].length
    }

    /// Block (buffer) size of a file: the file system's block, or for a file smaller than
    /// one block its length in whole fragments (4.4BSD sizes such buffers that way).
    pub fn block_size(&self, file: FileId) -> u64 {
        self.world.files[file].block_size
    }

    /// Creates a file of `length` bytes (allocated on disk, not written). With the FFS
    /// model it is created in the root directory, as [`Os::create_in`] does.
    pub fn create(&mut self, name: &str, length: u64) -> Result<FileId, SimError> {
        if self.world.ffs.is_some() {
            return self.create_in(0, name, length);
        }
        let host = &self.world.host;
        self.world.core.cpu(host.user_per_call_ns, host.syscall_ns);
        self.world.create(name, length)
    }

    /// Whether the FFS model is on (directories exist).
    pub fn has_directories(&self) -> bool {
        self.world.ffs.is_some()
    }

    /// Adds an entry to directory `directory`: the entry's bytes in the directory's block,
    /// written synchronously without soft updates (`ufs_direnter`'s `bwrite`).
    fn enter(&mut self, directory: DirId) -> Result<(), SimError> {
        let world = &mut *self.world;
        let state = world.ffs.as_mut().expect("the FFS model is configured");
        let sync = state.ffs.params().sync_metadata;
        let dir = &mut state.directories[directory];
        let file = dir.file;
        let stored = world.files[file].stored_bytes;
        let offset = (dir.entries * DIRECTORY_ENTRY_BYTES)
            % (stored - stored % DIRECTORY_ENTRY_BYTES).max(DIRECTORY_ENTRY_BYTES);
        dir.entries += 1;
        let length = DIRECTORY_ENTRY_BYTES.min(stored - offset);
        world.files[file]
            .handle
            .write_at(offset, &world.scratch[..length as usize], sync)?;
        let map = world.files[file].map.clone();
        let block = map.block_size();
        for (at, bytes) in map.device_ranges(offset / block, (offset + length).div_ceil(block)) {
            world.core.wait_for_data(at, bytes);
        }
        Ok(())
    }

    /// The metadata writes of a new inode in `group`: the inode itself (synchronous without
    /// soft updates: `ffs_update` with waitfor) and the group's bitmaps (delayed).
    fn new_inode(&mut self, file: FileId) -> Result<(), SimError> {
        let world = &mut *self.world;
        let state = world.ffs.as_ref().expect("the FFS model is configured");
        let sync = state.ffs.params().sync_metadata;
        let (meta, _) = state.files[file].clone().expect("an FFS file");
        let group_block = state.ffs.group_block_offset(meta.group);
        world.metadata_write(meta.inode_offset, crate::fs::INODE_BYTES, sync)?;
        world.metadata_write(group_block, 512, false)?;
        Ok(())
    }

    /// mkdir(2) in the root directory for a directory of `entries` entries: the new inode
    /// and its first block with `.` and `..` (synchronous), the parent's entry (synchronous)
    /// and the group's bitmaps (delayed), as 4.4BSD's `ufs_mkdir` without soft updates.
    pub fn mkdir(&mut self, name: &str, entries: u64) -> Result<DirId, SimError> {
        if self.world.ffs.is_none() {
            return Err(SimError::Invalid(format!(
                "mkdir {name}: directories need the FFS model (SimConfig::fs)"
            )));
        }
        let host = &self.world.host;
        self.world.core.cpu(host.user_per_call_ns, host.syscall_ns);
        let length = entries.max(2) * DIRECTORY_ENTRY_BYTES;
        let file = self.world.place(name, length, None, true)?;
        let group = {
            let state = self
                .world
                .ffs
                .as_ref()
                .expect("the FFS model is configured");
            state.files[file].as_ref().expect("an FFS file").0.group
        };
        self.new_inode(file)?;
        let sync = self
            .world
            .ffs
            .as_ref()
            .map(|s| s.ffs.params().sync_metadata)
            .unwrap_or(true);
        let first = DIRECTORY_BLOCK_BYTES_USIZE.min(self.world.files[file].stored_bytes as usize);
        if self.world.scratch.len() < first {
            self.world.scratch.resize(first, 0);
        }
        let world = &mut *self.world;
        world.files[file]
            .handle
            .write_at(0, &world.scratch[..first], sync)?;
        let state = world.ffs.as_mut().expect("the FFS model is configured");
        state.directories.push(Directory {
            file,
            group,
            entries: 2,
        });
        let id = state.directories.len() - 1;
        self.enter(0)?;
        self.world.charge_engine();
        Ok(id)
    }

    /// creat(2) of a file of `length` bytes in directory `directory` (FFS model): the inode
    /// (synchronous), the directory entry (synchronous) and the group's bitmaps (delayed).
    /// Without the FFS model, [`Os::create`].
    pub fn create_in(
        &mut self,
        directory: DirId,
        name: &str,
        length: u64,
    ) -> Result<FileId, SimError> {
        let host = &self.world.host;
        self.world.core.cpu(host.user_per_call_ns, host.syscall_ns);
        let directories = match &self.world.ffs {
            None => return self.world.create(name, length),
            Some(state) => state.directories.len(),
        };
        if directory >= directories {
            return Err(SimError::Invalid(format!(
                "create {name}: directory {directory} does not exist ({directories} made)"
            )));
        }
        let file = self.world.place(name, length, Some(directory), false)?;
        self.new_inode(file)?;
        self.enter(directory)?;
        self.world.charge_engine();
        Ok(file)
    }

    /// Reads the indirect blocks mapping blocks `[first, end)` of `file` (`ufs_bmaparray`'s
    /// `bread`s), then allocates (synchronous, zeroed: `ffs_balloc`) those a write needs.
    fn indirect_blocks(
        &mut self,
        file: FileId,
        first: u64,
        end: u64,
        write: bool,
    ) -> Result<(), SimError> {
        let Some(state) = self.world.ffs.as_ref() else {
            return Ok(());
        };
        let Some((meta, allocated)) = state.files[file].clone() else {
            return Ok(());
        };
        let block = state.block_size;
        let nindir = block / 4;
        let mut allocated = allocated;
        let blocks = &meta.indirect_blocks;
        for (index, &(from_lbn, offset)) in blocks.iter().enumerate() {
            // An indirect block maps a block of pointers from `from_lbn`; the double indirect
            // one (allocated just before the first second-level block, at the same block)
            // maps NINDIR of those.
            let double = blocks.get(index + 1).is_some_and(|next| next.0 == from_lbn);
            let span = if double { nindir * nindir } else { nindir };
            if from_lbn >= end || from_lbn + span <= first {
                continue;
            }
            if write && index >= allocated {
                // A new indirect block: zeroed and written at once so it never points at
                // garbage; its pointers are delayed writes after.
                self.world.metadata_write(offset, block, true)?;
                allocated = index + 1;
            } else if write {
                self.world.metadata_write(offset, 512, false)?;
            } else {
                self.world.metadata_read(offset)?;
            }
        }
        if let Some(state) = self.world.ffs.as_mut() {
            if let Some(entry) = state.files[file].as_mut() {
                entry.1 = allocated;
            }
        }
        Ok(())
    }

    /// A system call that zero-fills `length` bytes (reading /dev/zero).
    pub fn read_zero(&mut self, length: u64) {
        let host = &self.world.host;
        self.world.core.cpu(
            host.user_per_call_ns,
            host.syscall_ns + host.copy_ns(length),
        );
    }

    fn enter_call(&mut self, file: FileId, offset: u64, length: u64) {
        let block = self.block_size(file);
        let blocks = (offset + length).div_ceil(block) - offset / block;
        let host = &self.world.host;
        self.world.core.cpu(
            host.user_per_call_ns,
            host.syscall_ns + blocks * host.lookup_ns,
        );
        if self.world.scratch.len() < length as usize {
            self.world.scratch.resize(length as usize, 0);
        }
    }

    /// read(2): `length` bytes of `file` at `offset` through the cache.
    pub fn read(&mut self, file: FileId, offset: u64, length: u64) -> Result<(), SimError> {
        self.enter_call(file, offset, length);
        let block = self.block_size(file);
        self.indirect_blocks(
            file,
            offset / block,
            (offset + length).div_ceil(block),
            false,
        )?;
        let world = &mut *self.world;
        let entry = &world.files[file];
        entry
            .handle
            .read_at(offset, &mut world.scratch[..length as usize])?;
        // Blocks read ahead by the daemon may still be in flight (or wait in the io queue):
        // wait for them.
        let block = entry.block_size;
        let first = offset / block;
        let end = (offset + length).div_ceil(block);
        let ranges = entry.map.device_ranges(first, end);
        for &(at, bytes) in &ranges {
            world.core.wait_for_data(at, bytes);
        }
        world.touch_file(&ranges);
        world.core.cpu(0, world.host.copy_ns(length));
        world.charge_engine();
        Ok(())
    }

    /// write(2): `length` bytes to `file` at `offset` through the cache (delayed write). A
    /// write that reaches the file's end fills its last fragment too, as the file system's
    /// buffer for the tail does.
    pub fn write(&mut self, file: FileId, offset: u64, length: u64) -> Result<(), SimError> {
        let entry = &self.world.files[file];
        let stored = if offset + length == entry.length {
            entry.stored_bytes - offset
        } else {
            length
        };
        self.enter_call(file, offset, stored);
        let block = self.block_size(file);
        self.indirect_blocks(
            file,
            offset / block,
            (offset + stored).div_ceil(block),
            true,
        )?;
        let world = &mut *self.world;
        world.core.cpu(0, world.host.copy_ns(length));
        world.files[file]
            .handle
            .write_at(offset, &world.scratch[..stored as usize], false)?;
        if world.vm.is_some() {
            let entry = &world.files[file];
            let ranges = entry
                .map
                .device_ranges(offset / block, (offset + stored).div_ceil(block));
            world.touch_file(&ranges);
        }
        // The inode's size and block pointers changed: a delayed write of its block.
        if let Some(state) = &world.ffs {
            if let Some((meta, _)) = &state.files[file] {
                let inode = meta.inode_offset;
                world.metadata_write(inode, crate::fs::INODE_BYTES, false)?;
            }
        }
        world.charge_engine();
        Ok(())
    }

    /// fsync(2).
    pub fn fsync(&mut self, file: FileId) -> Result<(), SimError> {
        let host = &self.world.host;
        self.world.core.cpu(host.user_per_call_ns, host.syscall_ns);
        self.world.files[file].handle.flush()?;
        // Writes another entity (a write-behind job) issued for this file may still be on
        // their way to the disk in virtual time: fsync returns when they are there.
        let world = &mut *self.world;
        let entry = &world.files[file];
        let end = entry.stored_bytes.div_ceil(entry.block_size);
        for (at, bytes) in entry.map.device_ranges(0, end) {
            world.core.wait_for_data(at, bytes);
        }
        world.charge_engine();
        Ok(())
    }

    /// sync(2): everything dirty in the cache.
    pub fn sync(&mut self) -> Result<(), SimError> {
        let host = &self.world.host;
        self.world.core.cpu(host.user_per_call_ns, host.syscall_ns);
        self.world.cache.sync()?;
        self.world.charge_engine();
        Ok(())
    }

    /// The engine's statistics now.
    pub fn cache_stats(&self) -> bufcache::CacheStats {
        self.world.cache.stats()
    }

    /// The device's totals now.
    pub fn device_totals(&self) -> DeviceTotals {
        self.world.core.device_totals()
    }
}

/// 4.4BSD's update daemon: `sync(2)` once a period, pushing every delayed write to the
/// disk through the engine's `Cache::sync` (which hands the dirty runs of all objects on a
/// device down together). It blocks only itself while its writes are served.
struct UpdateDaemon {
    period_ns: u64,
}

impl Process for UpdateDaemon {
    fn step(&mut self, os: &mut Os<'_>) -> Result<Step, SimError> {
        os.sync()?;
        Ok(Step::Sleep(self.period_ns))
    }
}

/// One I/O daemon: runs the engine's background jobs one at a time.
struct Daemon {
    account: usize,
    time_ns: u64,
    /// Blocked on the io queue.
    blocked: bool,
}

struct Entity {
    name: String,
    process: Box<dyn Process>,
    account: usize,
    time_ns: u64,
    start_ns: u64,
    end_ns: Option<u64>,
    primary: bool,
    rng: SimRng,
    metrics: Vec<(String, f64)>,
    /// Blocked on the io queue, with what its last step asked for once it goes on.
    blocked: Option<Step>,
}

/// The swap area's size a configuration asks for (0 without paging), checked against the
/// disk's `capacity`.
fn swap_bytes_checked(
    config: &SimConfig,
    paging: Option<&PagingModel>,
    capacity: u64,
) -> Result<u64, SimError> {
    let Some(paging) = paging else {
        return Ok(0);
    };
    if paging.page_outs_in_flight_max == 0 {
        return Err(SimError::Invalid(
            "memory paging: page_outs_in_flight_max must be at least 1".to_string(),
        ));
    }
    if paging.cluster_bytes == 0 || paging.swap_bytes < paging.cluster_bytes {
        return Err(SimError::Invalid(format!(
            "memory paging: cluster_bytes ({}) must be at least 1 and at most \
             swap_bytes ({})",
            paging.cluster_bytes, paging.swap_bytes
        )));
    }
    if paging.swap_bytes.saturating_add(FLAT_LAYOUT_START_BYTES) >= capacity / 2 {
        return Err(SimError::Invalid(format!(
            "memory paging: swap_bytes ({}) must be under half of the disk \
             {} ({capacity} bytes)",
            paging.swap_bytes, config.disk.name
        )));
    }
    Ok(paging.swap_bytes)
}

impl Pager {
    /// The pager of a configuration with a memory model, on an account of its own.
    fn new(config: &SimConfig, core: &SimCore, model: MemoryModel) -> Pager {
        Pager {
            account: core.add_account("pager"),
            next_ns: 0,
            blocked: None,
            area_bytes: config.cache.memory_bytes_max,
            buffers_max: config.cache.buffers_max,
            last_ns: 0,
            last_pressure_bytes: 0,
            scan_next_ns: 0,
            process_deficit_bytes: 0,
            look_last_ns: 0,
            look_gap_ns_max: 0,
            report: MemoryReport {
                area_min_bytes: config.cache.memory_bytes_max,
                area_bytes_max: config.cache.memory_bytes_max,
                ..MemoryReport::default()
            },
            model,
        }
    }
}

impl Paging {
    /// The paging state of a configuration with a paging model: swap at `swap_offset`,
    /// page-outs through `slots`.
    fn new(
        config: &SimConfig,
        model: PagingModel,
        swap_offset: u64,
        slots: Vec<PageOutSlot>,
        pager_account: usize,
    ) -> Paging {
        Paging {
            swap_offset,
            process_bytes: config.memory.as_ref().map(|m| m.process_bytes).unwrap_or(0),
            nonresident_fraction: 0.0,
            deficit_bytes: 0,
            page_out_pending_bytes: 0,
            page_out_cursor: 0,
            rng: SimRng::new(config.seed ^ 0x5A4B_0000_0000_0001),
            page_in_bytes: 0,
            page_ins: 0,
            page_out_bytes: 0,
            page_outs: 0,
            slots,
            page_outs_in_flight_peak: 0,
            owed_bytes_max: config
                .memory
                .as_ref()
                .map_or(0, |m| free_min_bytes(m.ram_bytes)),
            page_outs_waited: 0,
            pager_account,
            io_queue: config.io_queue.is_some(),
            model,
        }
    }
}

/// A simulation: a disk, a host, a cache running the real engine, files and processes.
pub struct Simulation {
    world: World,
    spawner: Arc<SimSpawner>,
    entities: Vec<Entity>,
    /// The I/O daemons (the engine's background workers): account, time, blocked.
    daemons: Vec<Daemon>,
    syncer_account: usize,
    syncer_next_ns: u64,
    /// Blocked on the io queue since the tick that started at this time.
    syncer_blocked: Option<u64>,
    syncer_period_ns: u64,
    update_period: Option<Duration>,
    update_spawned: bool,
    pager: Option<Pager>,
    seed: u64,
    disk: DiskSpec,
}

impl Simulation {
    /// Builds the disk, the core and the engine.
    pub fn new(config: &SimConfig) -> Result<Simulation, SimError> {
        let clock = Arc::new(VirtualClock::new());
        let core = Arc::new(SimCore::new(
            config.disk.build(),
            config.host.clone(),
            clock.clone(),
        ));
        core.set_io_queue(config.io_queue);
        let capacity = config.disk.capacity_bytes();
        let device = Arc::new(SimDevice::new(core.clone(), capacity, &config.disk.name));
        let spawner = Arc::new(SimSpawner::new(
            core.clone(),
            config.cache.background_jobs_queued_max,
        ));
        let waiter = Arc::new(SimWaiter::new(core.clone()));
        let cache = Cache::with_environment(
            config.cache.clone(),
            Environment::new(clock.clone(), spawner.clone(), waiter),
        )?;
        let paging_model = config.memory.as_ref().and_then(|m| m.paging.clone());
        let swap_bytes = swap_bytes_checked(config, paging_model.as_ref(), capacity)?;
        // Swap before the flat layout's files (as 4.4BSD's `b` before /usr); with the FFS
        // model, which spans the disk it is given, at the disk's end.
        let swap_offset = if config.fs.is_some() {
            capacity - swap_bytes
        } else {
            FLAT_LAYOUT_START_BYTES
        };
        let layout = FsLayout::new(
            config.layout.clone(),
            config.disk.bytes_per_ms(),
            capacity,
            FLAT_LAYOUT_START_BYTES + if config.fs.is_some() { 0 } else { swap_bytes },
        );
        let block_pages = (config.layout.block_size as u64)
            .div_ceil(config.cache.page_size_bytes)
            .max(1);
        let daemons = (0..config.io_daemons.max(1))
            .map(|index| Daemon {
                account: core.add_account(&if index == 0 {
                    "iod".to_string()
                } else {
                    format!("iod{index}")
                }),
                time_ns: 0,
                blocked: false,
            })
            .collect();
        let syncer_account = core.add_account("syncer");
        let page_out_slots: Vec<PageOutSlot> = paging_model
            .as_ref()
            .map(|paging| {
                (0..paging.page_outs_in_flight_max)
                    .map(|index| PageOutSlot {
                        account: core.add_account(&format!("pageout{index}")),
                        done_ns: 0,
                        queued: false,
                    })
                    .collect()
            })
            .unwrap_or_default();
        let pager = config
            .memory
            .clone()
            .map(|model| Pager::new(config, &core, model));
        let vm = config
            .memory
            .as_ref()
            .filter(|memory| memory.page_cache)
            .map(|memory| {
                VmPages::new(if memory.dynamic && memory.dontneed {
                    Release::DontNeed
                } else {
                    Release::InactiveTail
                })
            });
        let object_device: Arc<dyn bufcache::Device> = match &vm {
            Some(vm) => Arc::new(VmDevice::new(
                device.clone(),
                core.clone(),
                vm.clone(),
                config.host.wire_page_ns,
            )),
            None => device.clone(),
        };
        let mut sim = Simulation {
            world: World {
                object_device,
                vm,
                activity: std::collections::HashMap::new(),
                core,
                cache,
                layout,
                files: Vec::new(),
                host: config.host.clone(),
                scratch: Vec::new(),
                wired_pages: 0,
                evictions_seen: 0,
                block_pages,
                page_bytes: config.cache.page_size_bytes.max(1),
                calls_to_sample: 64,
                ffs: None,
                paging: paging_model.map(|model| {
                    let pager_account = pager.as_ref().map_or(0, |pager| pager.account);
                    Paging::new(config, model, swap_offset, page_out_slots, pager_account)
                }),
            },
            spawner,
            entities: Vec::new(),
            daemons,
            syncer_account,
            syncer_blocked: None,
            syncer_next_ns: config.syncer_period.as_nanos() as u64,
            syncer_period_ns: (config.syncer_period.as_nanos() as u64).max(1_000_000),
            pager,
            seed: config.seed,
            disk: config.disk.clone(),
            update_period: config.update_period,
            update_spawned: false,
        };
        if let Some(params) = &config.fs {
            sim.newfs(params.clone(), capacity - swap_bytes)?;
        }
        Ok(sim)
    }

    /// Lays out an empty FFS (`newfs`) and opens the raw-device object for its metadata
    /// and the root directory.
    fn newfs(&mut self, params: NewfsParams, capacity: u64) -> Result<(), SimError> {
        let geometry = match &self.disk.kind {
            crate::disk::DiskKind::Hdd(p) => FsGeometry {
                capacity_bytes: capacity,
                cylinder_bytes: p.sectors_per_track as u64 * p.heads as u64 * 512,
                track_bytes: p.sectors_per_track as u64 * 512,
            },
            // No geometry to read: a 1 MiB "cylinder" of 4 tracks (assumed).
            _ => FsGeometry {
                capacity_bytes: capacity,
                cylinder_bytes: 1 << 20,
                track_bytes: 256 << 10,
            },
        };
        let block = params.block_size as u64;
        let ffs = Ffs::new(params, geometry).map_err(|e| SimError::Invalid(e.to_string()))?;
        let world = &mut self.world;
        let mut config =
            ObjectConfig::new("raw", world.object_device.clone()).block_size(block as u32);
        config.length_bytes = Some(capacity / block * block);
        config.block_map =
            Some(Arc::new(RawMap { block_size: block }) as Arc<dyn bufcache::BlockMap>);
        let raw = world.cache.open_object(config)?;
        world.ffs = Some(FfsState {
            ffs,
            raw,
            block_size: block,
            files: vec![None; world.files.len()],
            directories: Vec::new(),
            aging: None,
        });
        let root = world.place(
            "/",
            ROOT_DIRECTORY_ENTRIES * DIRECTORY_ENTRY_BYTES,
            None,
            true,
        )?;
        let state = world.ffs.as_mut().expect("just configured");
        let group = state.files[root]
            .as_ref()
            .map(|(meta, _)| meta.group)
            .unwrap_or(0);
        state.directories.push(Directory {
            file: root,
            group,
            entries: 2,
        });
        if let Some(aging) = &state.ffs.params().aging.clone() {
            let report = state
                .ffs
                .age(aging, self.seed)
                .map_err(|e| SimError::Invalid(format!("cannot age the file system: {e}")))?;
            state.aging = Some(report);
        }
        Ok(())
    }

    /// What aging the file system left (`None` without the FFS model or aging).
    pub fn aging_report(&self) -> Option<crate::fs::AgingReport> {
        self.world
            .ffs
            .as_ref()
            .and_then(|state| state.aging.clone())
    }

    /// Creates a file of `length` bytes on the disk (its contents are whatever the disk
    /// holds; nothing is written or timed).
    pub fn create_file(&mut self, name: &str, length: u64) -> Result<FileId, SimError> {
        self.world.create(name, length)
    }

    /// The file's layout.
    pub fn file_map(&self, file: FileId) -> Arc<FileMap> {
        self.world.files[file].map.clone()
    }

    /// The simulation core (timelines, accounts, the disk and its io queue).
    pub fn core(&self) -> &Arc<SimCore> {
        &self.world.core
    }

    /// The engine.
    pub fn cache(&self) -> &Cache {
        &self.world.cache
    }

    /// The disk.
    pub fn disk(&self) -> &DiskSpec {
        &self.disk
    }

    /// The current virtual time (high-water mark).
    pub fn now(&self) -> u64 {
        self.world.core.clock().now()
    }

    /// Adds a process starting at `start_ns`. The run ends when every *primary* process is
    /// done; background processes (a scan competing with a working set) are then stopped.
    pub fn spawn(
        &mut self,
        name: &str,
        process: Box<dyn Process>,
        start_ns: u64,
        primary: bool,
    ) -> usize {
        let account = self.world.core.add_account(name);
        let index = self.entities.len() as u64;
        self.entities.push(Entity {
            name: name.to_string(),
            process,
            account,
            time_ns: start_ns,
            start_ns,
            end_ns: None,
            primary,
            // Each entity's stream starts at a mixed point: seeding with `seed ^ k·γ` alone
            // gave entity k the stream of entity k+1 shifted by one draw (SplitMix64 adds γ
            // per draw), so parallel clients chose the same blocks.
            rng: SimRng::new(
                SimRng::new(self.seed ^ (index + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)).next_u64(),
            ),
            metrics: Vec::new(),
            blocked: None,
        });
        self.entities.len() - 1
    }

    /// Runs until every primary process is done.
    pub fn run(&mut self) -> Result<(), SimError> {
        if let (Some(period), false) = (self.update_period, self.update_spawned) {
            // Spawned last, so the workload's processes keep their indices.
            self.update_spawned = true;
            let period_ns = period.as_nanos() as u64;
            self.spawn(
                "update",
                Box::new(UpdateDaemon { period_ns }),
                period_ns,
                false,
            );
        }
        enum Pick {
            Process(usize),
            Daemon(usize),
            Syncer,
            Pager,
            Scan,
            Disk,
        }
        loop {
            if !self
                .entities
                .iter()
                .any(|e| e.primary && e.end_ns.is_none())
            {
                return Ok(());
            }
            let mut best: Option<(u64, u8, usize)> = None;
            let mut consider = |time: u64, rank: u8, index: usize| {
                if best.is_none() || (time, rank, index) < best.unwrap() {
                    best = Some((time, rank, index));
                }
            };
            for (index, entity) in self.entities.iter().enumerate() {
                if entity.end_ns.is_none() && entity.blocked.is_none() {
                    consider(entity.time_ns, 0, index);
                }
            }
            if let Some(spawned) = self.spawner.next_time() {
                for (index, daemon) in self.daemons.iter().enumerate() {
                    if !daemon.blocked {
                        consider(daemon.time_ns.max(spawned), 1, index);
                    }
                }
            }
            if self.syncer_blocked.is_none() {
                consider(self.syncer_next_ns, 2, 0);
            }
            if let Some(pager) = self.pager.as_ref().filter(|p| p.blocked.is_none()) {
                consider(pager.next_ns, 2, 1);
            }
            if let Some(pager) = self.pager.as_ref().filter(|p| p.model.page_cache) {
                consider(pager.scan_next_ns, 2, 2);
            }
            // The io queue dispatches after every entity due at the same time has issued
            // its requests, so requests arriving together wait together.
            if let Some(dispatch) = self.world.core.next_dispatch_ns() {
                consider(dispatch, 3, 0);
            }
            let Some((time, rank, index)) = best else {
                return Err(SimError::Invalid(
                    "the simulation stalled: every entity is blocked and no request waits"
                        .to_string(),
                ));
            };
            self.world.core.prune(time);
            let pick = match rank {
                0 => Pick::Process(index),
                1 => Pick::Daemon(index),
                2 if index == 0 => Pick::Syncer,
                2 if index == 1 => Pick::Pager,
                2 => Pick::Scan,
                _ => Pick::Disk,
            };
            match pick {
                Pick::Process(index) => {
                    let entity = &mut self.entities[index];
                    self.world.core.enter(entity.account, time);
                    let mut os = Os {
                        world: &mut self.world,
                        rng: &mut entity.rng,
                        metrics: &mut entity.metrics,
                        account: entity.account,
                    };
                    let step = entity.process.step(&mut os)?;
                    if step == Step::Done {
                        // Settle the sampled charges, so the process's totals are exact.
                        self.world.sample_engine();
                    }
                    match self.world.core.end_step() {
                        Some(end) => Self::finish_step(entity, step, end),
                        None => entity.blocked = Some(step),
                    }
                }
                Pick::Daemon(index) => {
                    let daemon = &mut self.daemons[index];
                    if let Some((_, origin, job)) = self.spawner.pop() {
                        self.world
                            .core
                            .enter_on_behalf(daemon.account, origin, time);
                        job();
                    }
                    self.world.charge_engine();
                    match self.world.core.end_step() {
                        Some(end) => daemon.time_ns = end,
                        None => daemon.blocked = true,
                    }
                }
                Pick::Syncer => {
                    self.world.core.enter(self.syncer_account, time);
                    self.world.cache.writeback_tick();
                    self.world.charge_engine();
                    match self.world.core.end_step() {
                        Some(finished) => {
                            self.syncer_next_ns = (time + self.syncer_period_ns).max(finished)
                        }
                        None => self.syncer_blocked = Some(time),
                    }
                }
                Pick::Pager => self.page(time),
                Pick::Scan => self.scan_pages(time),
                Pick::Disk => {
                    self.world.core.dispatch(time);
                    self.apply_resolved();
                }
            }
        }
    }

    /// One look of the pager at `time`: the demand of the processes running now and the
    /// pressure; with a dynamic area the reclaim of unwired buffer pages (or the area's
    /// growth into free memory); with paging the deficit the processes page, and the
    /// page daemon's asynchronous writes. The pager never waits for its writes: it looks
    /// again after its period, or sooner when a page-out slot frees while it still owes.
    fn page(&mut self, time: u64) {
        let running_count = self.running(time).len() as u64;
        let memory_used = self.world.cache.stats().memory_used_bytes;
        let pager = self
            .pager
            .as_mut()
            .expect("the pager runs only when modelled");
        let model = pager.model.clone();
        let demand = model.reserved_bytes + running_count * model.process_bytes;
        let pressure = (demand + memory_used).saturating_sub(model.ram_bytes);
        pager.report.pressure_byte_seconds +=
            pager.last_pressure_bytes as f64 * seconds(time - pager.last_ns);
        pager.last_ns = time;
        pager.last_pressure_bytes = pressure;
        pager.report.pressure_bytes_max = pager.report.pressure_bytes_max.max(pressure);
        pager.look_gap_ns_max = pager.look_gap_ns_max.max(time - pager.look_last_ns);
        pager.look_last_ns = time;
        let period = (model.period.as_nanos() as u64).max(1);
        // Without the page cache: under pressure the page daemon reclaims unwired buffer
        // pages first (they were passed to vm_page_dontneed), down to the wired ones; without
        // pressure the area may grow into what the processes leave. Both are this one limit.
        // With it, the global replacement decides what the processes keep (below).
        let process_deficit = if model.page_cache {
            pager.process_deficit_bytes
        } else {
            (demand + memory_used).saturating_sub(model.ram_bytes)
        };
        let process_resident =
            (running_count * model.process_bytes).saturating_sub(process_deficit);
        let area = if model.page_cache {
            model
                .ram_bytes
                .saturating_sub(model.reserved_bytes + process_resident)
                .max(model.area_min_bytes)
        } else {
            model
                .ram_bytes
                .saturating_sub(demand)
                .max(model.area_min_bytes)
        };
        let pager = self.pager.as_mut().expect("checked above");
        let account = pager.account;
        let mut entered = false;
        let mut buffer_bytes = memory_used;
        if model.dynamic && area != pager.area_bytes {
            pager.area_bytes = area;
            pager.report.resizes += 1;
            pager.report.area_min_bytes = pager.report.area_min_bytes.min(area);
            pager.report.area_bytes_max = pager.report.area_bytes_max.max(area);
            let buffers_max = pager.buffers_max;
            self.world.core.enter(account, time);
            entered = true;
            // Reclaiming evicts clean buffers and writes dirty ones back; a limit the cache
            // cannot reach at once (everything pinned) stays set, and later allocations free
            // the rest.
            let _ = self.world.cache.set_limits(area, buffers_max);
            self.world.charge_engine();
            buffer_bytes = self.world.cache.stats().memory_used_bytes;
        }
        if let Some(paging) = self.world.paging.as_mut() {
            if !model.page_cache {
                // (With the page cache the scans set the deficit.)
                let deficit = (demand + buffer_bytes).saturating_sub(model.ram_bytes);
                paging.set_deficit(deficit, running_count * model.process_bytes);
            }
        }
        let pager = self.pager.as_mut().expect("checked above");
        let mut next = time + period;
        if entered {
            match self.world.core.end_step() {
                Some(end) => next = next.max(end),
                None => pager.blocked = Some(time),
            }
        }
        // The page-outs go on their own slots, so the pager's next look does not wait for
        // them; with every slot taken and page-outs still owed it resumes when one frees.
        if let Some(free) = self.world.page_out(time, account) {
            next = next.min(free.max(time + 1));
        }
        let pager = self.pager.as_mut().expect("checked above");
        pager.next_ns = next;
    }

    /// The primary processes running at `time`: (account, start).
    fn running(&self, time: u64) -> Vec<(usize, u64)> {
        self.entities
            .iter()
            .filter(|e| e.primary && e.start_ns <= time && e.end_ns.is_none_or(|end| end > time))
            .map(|e| (e.account, e.start_ns))
            .collect()
    }

    /// One scan of the page queues (with the page cache): the global replacement decides
    /// which file pages stay resident and how much of the processes' working sets is on
    /// swap. Bookkeeping only: the page-outs it owes are written by the pager's next look.
    fn scan_pages(&mut self, time: u64) {
        let running = self.running(time);
        let memory_used = self.world.cache.stats().memory_used_bytes;
        let pager = self.pager.as_mut().expect("scans run with a pager");
        let model = pager.model.clone();
        pager.scan_next_ns = time + (model.period.as_nanos() as u64).max(1);
        let deficit = self
            .world
            .replace_pages(&model, &running, memory_used, time);
        let pager = self.pager.as_mut().expect("checked above");
        pager.process_deficit_bytes = deficit;
        if let Some(paging) = self.world.paging.as_mut() {
            paging.set_deficit(deficit, running.len() as u64 * model.process_bytes);
        }
    }

    /// Moves a process on after a step that ended at `end`.
    fn finish_step(entity: &mut Entity, step: Step, end: u64) {
        entity.time_ns = end;
        match step {
            Step::Continue => {}
            Step::Sleep(ns) => entity.time_ns += ns,
            Step::Done => entity.end_ns = Some(entity.time_ns),
        }
    }

    /// Lets the entities whose continuations finished go on.
    fn apply_resolved(&mut self) {
        for (account, end) in self.world.core.take_resolved() {
            let slot = self.world.paging.as_mut().and_then(|paging| {
                let owed = paging.page_out_pending_bytes > 0;
                paging
                    .slots
                    .iter_mut()
                    .find(|slot| slot.account == account)
                    .map(|slot| (slot, owed))
            });
            if let Some((slot, owed)) = slot {
                slot.queued = false;
                slot.done_ns = end;
                // A freed swap buffer wakes a pager that still owes page-outs.
                if let Some(pager) = self.pager.as_mut().filter(|p| owed && p.blocked.is_none()) {
                    pager.next_ns = pager.next_ns.min(end);
                }
            } else if let Some(daemon) = self.daemons.iter_mut().find(|d| d.account == account) {
                daemon.blocked = false;
                daemon.time_ns = end;
            } else if let Some(pager) = self.pager.as_mut().filter(|pager| pager.account == account)
            {
                if let Some(started) = pager.blocked.take() {
                    let period = pager.model.period.as_nanos() as u64;
                    pager.next_ns = (started + period.max(1)).max(end);
                }
            } else if account == self.syncer_account {
                if let Some(started) = self.syncer_blocked.take() {
                    self.syncer_next_ns = (started + self.syncer_period_ns).max(end);
                }
            } else if let Some(entity) = self.entities.iter_mut().find(|e| e.account == account) {
                if let Some(step) = entity.blocked.take() {
                    Self::finish_step(entity, step, end);
                }
            }
        }
    }

    /// Dispatches until the io queue is empty and nothing is blocked on it.
    fn settle_disk(&mut self) {
        while let Some(time) = self.world.core.next_dispatch_ns() {
            self.world.core.dispatch(time);
            self.apply_resolved();
        }
    }

    /// Runs every queued background job now (after the processes finished), so the device
    /// totals include them.
    pub fn drain(&mut self) {
        let mut ran = false;
        loop {
            self.settle_disk();
            let Some((spawned, origin, job)) = self.spawner.pop() else {
                break;
            };
            let daemon = &mut self.daemons[0];
            let time = daemon.time_ns.max(spawned);
            self.world
                .core
                .enter_on_behalf(daemon.account, origin, time);
            job();
            self.world.charge_engine();
            match self.world.core.end_step() {
                Some(end) => daemon.time_ns = end,
                None => daemon.blocked = true,
            }
            ran = true;
        }
        if ran {
            self.world.sample_engine();
            match self.world.core.end_step() {
                Some(end) => self.daemons[0].time_ns = end,
                None => {
                    self.daemons[0].blocked = true;
                    self.settle_disk();
                }
            }
        }
    }

    /// How the pager kept up so far (`None` without a memory model).
    pub fn pager_activity(&self) -> Option<PagerActivity> {
        let pager = self.pager.as_ref()?;
        let paging = self.world.paging.as_ref();
        Some(PagerActivity {
            look_gap_ns_max: pager.look_gap_ns_max,
            page_outs_in_flight_peak: paging.map_or(0, |p| p.page_outs_in_flight_peak),
            page_outs_in_flight_max: paging.map_or(0, |p| p.model.page_outs_in_flight_max),
            page_outs_async: paging.map_or(0, |p| p.page_outs - p.page_outs_waited),
            page_outs_waited: paging.map_or(0, |p| p.page_outs_waited),
        })
    }

    /// The report of the run so far.
    pub fn report(&self) -> RunReport {
        let accounts = self.world.core.accounts();
        let processes: Vec<ProcessReport> = self
            .entities
            .iter()
            .map(|entity| {
                let account = &accounts[entity.account];
                let end = entity.end_ns.unwrap_or(entity.time_ns);
                ProcessReport {
                    name: entity.name.clone(),
                    start_s: seconds(entity.start_ns),
                    end_s: seconds(end),
                    real_s: seconds(end - entity.start_ns),
                    user_s: seconds(account.user_ns),
                    sys_s: seconds(account.sys_ns),
                    io_wait_s: seconds(account.io_wait_ns),
                    cpu_wait_s: seconds(account.cpu_wait_ns),
                    device_reads: account.reads,
                    device_read_bytes: account.read_bytes,
                    device_writes: account.writes,
                    device_write_bytes: account.write_bytes,
                    finished: entity.end_ns.is_some(),
                    metrics: entity.metrics.clone(),
                }
            })
            .collect();
        let elapsed = self
            .entities
            .iter()
            .filter(|e| e.primary)
            .filter_map(|e| e.end_ns)
            .max()
            .unwrap_or(0);
        RunReport {
            disk: self.disk.to_string(),
            host: self.world.host.to_string(),
            elapsed_s: seconds(elapsed),
            processes,
            daemons: self
                .daemons
                .iter()
                .map(|daemon| accounts[daemon.account].clone())
                .chain([accounts[self.syncer_account].clone()])
                .collect(),
            device: self.world.core.device_totals(),
            cache: CacheSummary::from_stats(&self.world.cache.stats()),
            memory: self.pager.as_ref().map(|pager| {
                let mut report = pager.report.clone();
                if let Some(paging) = &self.world.paging {
                    report.page_in_bytes = paging.page_in_bytes;
                    report.page_ins = paging.page_ins;
                    report.page_out_bytes = paging.page_out_bytes;
                    report.page_outs = paging.page_outs;
                    report.page_outs_waited = paging.page_outs_waited;
                }
                report.page_cache = self.world.vm.as_ref().map(|vm| vm.report());
                report.pressure_byte_seconds += pager.last_pressure_bytes as f64
                    * seconds(elapsed.saturating_sub(pager.last_ns));
                report
            }),
        }
    }
}

/// Nanoseconds to seconds.
pub fn seconds(ns: u64) -> f64 {
    ns as f64 / 1e9
}

/// One process's times and I/O, as `time` and `iostat` would report them.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ProcessReport {
    /// Process name.
    pub name: String,
    /// Start, s of virtual time.
    pub start_s: f64,
    /// End (or where it was stopped), s.
    pub end_s: f64,
    /// Elapsed (real) time, s.
    pub real_s: f64,
    /// User CPU, s.
    pub user_s: f64,
    /// System CPU, s.
    pub sys_s: f64,
    /// Blocked on the device, s.
    pub io_wait_s: f64,
    /// Waiting for a CPU, s.
    pub cpu_wait_s: f64,
    /// Device reads it issued itself.
    pub device_reads: u64,
    /// Bytes of those.
    pub device_read_bytes: u64,
    /// Device writes it issued itself.
    pub device_writes: u64,
    /// Bytes of those.
    pub device_write_bytes: u64,
    /// False when it was stopped (a background process).
    pub finished: bool,
    /// What the process recorded.
    pub metrics: Vec<(String, f64)>,
}

/// The engine's counters at the end of a run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CacheSummary {
    /// Lookups that hit.
    pub hits: u64,
    /// Lookups that missed.
    pub misses: u64,
    /// Hit ratio.
    pub hit_ratio: f64,
    /// Clean buffers evicted.
    pub evictions: u64,
    /// Device reads issued by the engine.
    pub device_reads: u64,
    /// Mean read size, bytes.
    pub read_average_bytes: f64,
    /// Device writes issued by the engine.
    pub device_writes: u64,
    /// Mean write size, bytes.
    pub write_average_bytes: f64,
    /// Clustered reads.
    pub read_clusters: u64,
    /// Clustered writes.
    pub write_clusters: u64,
    /// Blocks read ahead.
    pub readahead_issued_blocks: u64,
    /// Read-ahead blocks used.
    pub readahead_used_blocks: u64,
    /// Read-ahead blocks evicted unused.
    pub readahead_wasted_blocks: u64,
    /// Buffers in use at the end.
    pub buffers_in_use: u64,
    /// Memory charged at the end, bytes.
    pub memory_used_bytes: u64,
    /// Memory charged but not holding data (page rounding), bytes.
    pub memory_wasted_bytes: u64,
}

impl CacheSummary {
    /// Extracts the summary from an engine snapshot.
    pub fn from_stats(stats: &bufcache::CacheStats) -> Self {
        CacheSummary {
            hits: stats.hits,
            misses: stats.misses,
            hit_ratio: stats.hit_ratio(),
            evictions: stats.evictions,
            device_reads: stats.device_reads.requests,
            read_average_bytes: stats.device_reads.average_transfer_bytes(),
            device_writes: stats.device_writes.requests,
            write_average_bytes: stats.device_writes.average_transfer_bytes(),
            read_clusters: stats.read_clusters,
            write_clusters: stats.write_clusters,
            readahead_issued_blocks: stats.readahead_issued_blocks,
            readahead_used_blocks: stats.readahead_used_blocks,
            readahead_wasted_blocks: stats.readahead_wasted_blocks,
            buffers_in_use: stats.buffers_in_use,
            memory_used_bytes: stats.memory_used_bytes,
            memory_wasted_bytes: stats.memory_wasted_bytes,
        }
    }
}

/// Everything a run measured.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RunReport {
    /// The disk.
    pub disk: String,
    /// The host.
    pub host: String,
    /// When the last primary process finished, s.
    pub elapsed_s: f64,
    /// Every process.
    pub processes: Vec<ProcessReport>,
    /// The I/O daemons' and the syncer's accounts.
    pub daemons: Vec<Account>,
    /// Device totals.
    pub device: DeviceTotals,
    /// Engine counters.
    pub cache: CacheSummary,
    /// What the pager saw (with a memory model).
    pub memory: Option<MemoryReport>,
}

/// Names of the engine's replacement policies, for tables.
pub fn policy_name(policy: PolicyKind) -> &'static str {
    policy.name()
}
