//! Objects: what an object is (device, block size, block map) and the state it owns.
//!
//! An object (an export, a file) has its own block size and a [`BlockMap`] from logical
//! blocks to device offsets; the identity map by default. Its mutable state — the dirty set
//! (block → time it became dirty), the write-back error latch and the read-ahead stream table —
//! has one short-held mutex each.
//!
//! Invariants:
//! - a block is in the dirty index exactly when its buffer has DIRTY set; both change under
//!   that buffer's lock, only in the dirty set (module `dirty`);
//! - the error latch's sequence number only grows, so a handle that remembers the last
//!   sequence it reported hears of every write-back error once (errseq).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::buffer::BlockKey;
use crate::config::CacheConfig;
use crate::dirty::{DirtyBlocks, DirtyIndex};
use crate::error::CacheError;
use crate::readahead::{ReadaheadPlan, StreamTable, WindowLimits};
use bufcache_device::Device;

/// Where a run of logical blocks lives on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MappedRun {
    /// Device byte offset of the run's first block.
    pub device_offset: u64,
    /// Blocks, starting with the one asked about, stored back to back on the device (≥ 1).
    pub contiguous_blocks: u64,
}

/// Maps an object's logical blocks to device offsets. A file system or the simulator's
/// layout model implements it to place blocks with gaps; clusters never cross a gap.
pub trait BlockMap: Send + Sync {
    /// Where `block` lives and how many blocks from it on follow contiguously.
    fn map(&self, block: u64) -> MappedRun;
}

/// Logical block `n` at device offset `base + n × block size`.
pub struct IdentityMap {
    base_offset: u64,
    block_size_bytes: u64,
    block_count: u64,
}

impl IdentityMap {
    /// Identity mapping of `block_count` blocks starting at device offset `base_offset`.
    pub fn new(base_offset: u64, block_size_bytes: u64, block_count: u64) -> Self {
        IdentityMap {
            base_offset,
            block_size_bytes,
            block_count,
        }
    }
}

impl BlockMap for IdentityMap {
    fn map(&self, block: u64) -> MappedRun {
        MappedRun {
            device_offset: self.base_offset + block * self.block_size_bytes,
            contiguous_blocks: self.block_count.saturating_sub(block).max(1),
        }
    }
}

/// How to open an object.
#[derive(Clone)]
pub struct ObjectConfig {
    /// Name used in errors and statistics.
    pub name: String,
    /// Where the bytes live.
    pub device: Arc<dyn Device>,
    /// Block (buffer) size. Default 4 KiB. A multiple of 512 up to `buffer_bytes_max`
    /// and `cluster_bytes_max`.
    pub block_size_bytes: u32,
    /// Object length. Default (None): the device's length (with the identity map).
    pub length_bytes: Option<u64>,
    /// Block map. Default (None): identity from device offset 0.
    pub block_map: Option<Arc<dyn BlockMap>>,
    /// Refuse writes (an object over a device whose capabilities say `read_only` refuses them
    /// whatever this says).
    pub read_only: bool,
}

impl ObjectConfig {
    /// An object covering all of `device` with 4 KiB blocks.
    pub fn new(name: impl Into<String>, device: Arc<dyn Device>) -> Self {
        ObjectConfig {
            name: name.into(),
            device,
            block_size_bytes: 4096,
            length_bytes: None,
            block_map: None,
            read_only: false,
        }
    }

    /// Sets the block size.
    pub fn block_size(mut self, block_size_bytes: u32) -> Self {
        self.block_size_bytes = block_size_bytes;
        self
    }
}

/// Completed clusters queued for write-behind at most, per object; more are left to the
/// background writer (they stay dirty and are written by age or threshold).
const WRITE_BEHIND_QUEUED_MAX: usize = 64;

/// Write-behind work of one object: completed clusters, and whether a job is draining them.
#[derive(Default)]
struct WriteBehindQueue {
    ranges: std::collections::VecDeque<(u64, u64)>,
    /// Blocks in `ranges`.
    queued_blocks: u64,
    jobs_running: usize,
}

/// Write-behind jobs of one object at most: enough requests in flight for a slow device.
const WRITE_BEHIND_JOBS_MAX: usize = 4;

#[derive(Default)]
struct ErrorLatch {
    sequence: u64,
    kind: Option<std::io::ErrorKind>,
    message: String,
}

/// Shared state of one object.
pub(crate) struct ObjectState {
    pub id: u32,
    pub name: String,
    pub block_size_bytes: u32,
    /// The object's length: it only grows ([`ObjectState::grow`]), and only while it is a
    /// whole number of blocks, so no cached block ever changes its length.
    length_bytes: AtomicU64,
    /// `length_bytes` in blocks, rounded up; grows with it.
    block_count: AtomicU64,
    /// Whether `map` is the object's own identity map (no `ObjectConfig::block_map`): only
    /// then can the object grow.
    identity_mapped: bool,
    pub read_only: bool,
    pub device: Arc<dyn Device>,
    pub map: Arc<dyn BlockMap>,
    pub dirty: DirtyIndex,
    /// Clusters a writer completed, waiting for the one write-behind job (see
    /// `queue_write_behind`).
    write_behind: Mutex<WriteBehindQueue>,
    /// Where the next pressure-driven write-back starts looking (see `claim_dirty_cluster`).
    writeback_cursor: AtomicU64,
    latch: Mutex<ErrorLatch>,
    streams: Mutex<StreamTable>,
    limits: WindowLimits,
    pub cluster_blocks: u64,
    /// The device's preferred write unit in bytes (`Capabilities::write_unit_bytes`) when it
    /// is a whole number of blocks larger than one, else 0: write-back runs end on it.
    write_unit_bytes: u64,
    /// Blocks one device request carries at most (`Capabilities::request_bytes_max`, at least
    /// one block): write-back runs and clustered reads end on it.
    request_blocks_max: u64,
    /// Discards and zeroings between taking their range's dirty blocks out of write-back and
    /// the device's answer: a flush waits for them (see [`ObjectState::begin_replace`]).
    replaces_in_flight: AtomicU64,
}

impl ObjectState {
    pub fn new(id: u32, config: ObjectConfig, cache: &CacheConfig) -> Result<Self, CacheError> {
        let invalid = |reason: String| CacheError::InvalidObject {
            object: config.name.clone(),
            reason,
        };
        let block_size = config.block_size_bytes as u64;
        if block_size == 0 || !block_size.is_multiple_of(512) || block_size > cache.buffer_bytes_max
        {
            return Err(invalid(format!(
                "block size {block_size} must be a multiple of 512 up to buffer_size_max ({})",
                cache.buffer_bytes_max
            )));
        }
        if block_size > cache.cluster_bytes_max {
            return Err(invalid(format!(
                "block size {block_size} exceeds cluster_size_max ({}): a cluster holds at least one block",
                cache.cluster_bytes_max
            )));
        }
        let device_length = config.device.len();
        let length_bytes = config.length_bytes.unwrap_or(device_length);
        if config.block_map.is_none() && length_bytes > device_length {
            return Err(invalid(format!(
                "length {length_bytes} exceeds the device {} ({device_length} bytes)",
                config.device.describe()
            )));
        }
        let block_count = length_bytes.div_ceil(block_size);
        let identity_mapped = config.block_map.is_none();
        // The object's own identity map spans every block it could grow to: runs are cut at
        // the object's end by their callers, never by the map.
        let map = config
            .block_map
            .clone()
            .unwrap_or_else(|| Arc::new(IdentityMap::new(0, block_size, u64::MAX / block_size)));
        let readahead_blocks = |bytes: u64| bytes.div_ceil(block_size);
        let capabilities = config.device.capabilities();
        let request_blocks_max = (capabilities.request_bytes_max / block_size).max(1);
        let write_unit_bytes = capabilities.write_unit_bytes;
        let write_unit_bytes =
            if write_unit_bytes > block_size && write_unit_bytes.is_multiple_of(block_size) {
                write_unit_bytes
            } else {
                0
            };
        // A write cluster covers at least one whole write unit, or every unit would be
        // written in pieces (an object-store chunk read, merged and uploaded once per piece).
        let cluster_blocks = (cache.cluster_bytes_max / block_size)
            .max(write_unit_bytes / block_size)
            .max(1);
        let readahead_window = |bytes: u64| {
            if cache.readahead_bytes_max == 0 {
                0
            } else {
                bytes.max(write_unit_bytes) / block_size
            }
        };
        Ok(ObjectState {
            id,
            block_size_bytes: config.block_size_bytes,
            length_bytes: AtomicU64::new(length_bytes),
            block_count: AtomicU64::new(block_count),
            identity_mapped,
            // A device that refuses writes makes the object read-only: a write the cache
            // acknowledged could never be written back.
            read_only: config.read_only || config.device.capabilities().read_only,
            device: config.device,
            map,
            dirty: DirtyIndex::default(),
            writeback_cursor: AtomicU64::new(0),
            write_behind: Mutex::new(WriteBehindQueue::default()),
            latch: Mutex::new(ErrorLatch::default()),
            streams: Mutex::new(StreamTable::new()),
            limits: WindowLimits {
                initial_blocks: readahead_blocks(cache.readahead_size_initial_bytes),
                // A window covers at least one write unit when read-ahead is on, so a
                // sequential reader of an object store fetches whole chunks.
                blocks_max: readahead_window(cache.readahead_bytes_max),
                latency_blocks_max: readahead_window(cache.readahead_latency_bytes_max),
                streams_max: cache.streams_per_object_max,
                object_blocks: block_count,
                // Set at each read from the cache's limits then (they change at run time).
                spare_blocks: u64::MAX,
            },
            cluster_blocks,
            write_unit_bytes,
            request_blocks_max,
            replaces_in_flight: AtomicU64::new(0),
            name: config.name,
        })
    }

    /// The object's length in bytes now.
    pub fn length_bytes(&self) -> u64 {
        self.length_bytes.load(Ordering::Acquire)
    }

    /// The object's blocks now (the last may be short).
    pub fn block_count(&self) -> u64 {
        self.block_count.load(Ordering::Acquire)
    }

    /// Grows the object to `length_bytes` over a device that has grown to hold it. Refused
    /// (nothing changed) when it would shrink, when the length now or the new one is not a
    /// whole number of blocks (a cached short last block would keep its length), when the
    /// object has a block map of its own, or when the device is shorter. Callers serialize
    /// their grows; readers see the new length from their next call on.
    pub fn grow(&self, length_bytes: u64) -> Result<(), CacheError> {
        let invalid = |reason: String| CacheError::InvalidObject {
            object: self.name.clone(),
            reason,
        };
        let block_size = self.block_size_bytes as u64;
        let now = self.length_bytes();
        if length_bytes < now {
            return Err(invalid(format!(
                "an object only grows: {length_bytes} bytes is less than its {now}"
            )));
        }
        if !now.is_multiple_of(block_size) || !length_bytes.is_multiple_of(block_size) {
            return Err(invalid(format!(
                "an object grows from and to whole blocks of {block_size} bytes (it has {now}, asked {length_bytes})"
            )));
        }
        if !self.identity_mapped {
            return Err(invalid(
                "an object with a block map of its own cannot grow".to_string(),
            ));
        }
        let device_length = self.device.len();
        if device_length < length_bytes {
            return Err(invalid(format!(
                "the device {} holds {device_length} bytes, fewer than {length_bytes}",
                self.device.describe()
            )));
        }
        // The block count first: a reader that sees the new length finds its blocks counted.
        self.block_count
            .store(length_bytes / block_size, Ordering::Release);
        self.length_bytes.store(length_bytes, Ordering::Release);
        assert_eq!(self.block_count() * block_size, self.length_bytes());
        Ok(())
    }

    /// Bytes of `block` that exist (the last block may be short).
    pub fn block_length_bytes(&self, block: u64) -> u32 {
        let start = block * self.block_size_bytes as u64;
        (self.length_bytes() - start).min(self.block_size_bytes as u64) as u32
    }

    pub fn key(&self, block: u64) -> BlockKey {
        BlockKey {
            object: self.id,
            block,
        }
    }

    /// How many blocks a write-back run starting at `first` may cover: one cluster, within
    /// one contiguous device run, and — on a device with a write unit — ending on the last
    /// unit boundary inside that, so the runs after it start on a unit and cover whole units.
    pub fn write_run_blocks_max(&self, first: u64) -> u64 {
        let mapped = self.map.map(first);
        let limit = self
            .cluster_blocks
            .min(mapped.contiguous_blocks)
            .min(self.request_blocks_max);
        if self.write_unit_bytes == 0 {
            return limit;
        }
        let block_size = self.block_size_bytes as u64;
        let end_bytes = mapped.device_offset + limit * block_size;
        let aligned_end = end_bytes / self.write_unit_bytes * self.write_unit_bytes;
        let aligned_length = aligned_end.saturating_sub(mapped.device_offset);
        if aligned_length == 0 || !aligned_length.is_multiple_of(block_size) {
            return limit;
        }
        aligned_length / block_size
    }

    /// `block` moved forward to the next write-unit boundary (itself when it is on one or
    /// there is no unit), at most the object's end: where a read-ahead window should end so
    /// that a unit is fetched whole.
    pub fn round_up_to_write_unit(&self, block: u64) -> u64 {
        if self.write_unit_bytes == 0 || block >= self.block_count() {
            return block.min(self.block_count());
        }
        let into_unit = self.map.map(block).device_offset % self.write_unit_bytes;
        if into_unit == 0 {
            return block;
        }
        let to_boundary = (self.write_unit_bytes - into_unit) / self.block_size_bytes as u64;
        (block + to_boundary).min(self.block_count())
    }

    /// The blocks `[start, end)` of the write unit holding `block`, when the device has a
    /// write unit and that unit can be written as one run (contiguous on the device, within
    /// one cluster and one request; cut at the object's end). None otherwise.
    pub fn write_unit_of(&self, block: u64) -> Option<(u64, u64)> {
        if self.write_unit_bytes == 0 || block >= self.block_count() {
            return None;
        }
        let start = self.write_unit_start(block);
        let unit_blocks = self.write_unit_bytes / self.block_size_bytes as u64;
        let end = (start + unit_blocks).min(self.block_count());
        (self.write_run_blocks_max(start) >= end - start).then_some((start, end))
    }

    /// The first block of the write unit holding `block` (itself when there is no unit).
    fn write_unit_start(&self, block: u64) -> u64 {
        if self.write_unit_bytes == 0 {
            return block;
        }
        let device_offset = self.map.map(block).device_offset;
        let into_unit = device_offset % self.write_unit_bytes / self.block_size_bytes as u64;
        block.saturating_sub(into_unit)
    }

    /// A dirty block to start a write-back cluster at: the first at or after the object's
    /// write-back cursor, wrapping to the start, moved back to the first dirty block of its
    /// write unit. The cursor moves one cluster past it, so threads cleaning under memory
    /// pressure take different clusters instead of all contending for the first one.
    pub fn claim_dirty_cluster(&self) -> Option<u64> {
        let dirty = self.dirty.lock();
        let cursor = self.writeback_cursor.load(Ordering::Relaxed);
        let found = dirty
            .range(cursor..)
            .next()
            .or_else(|| dirty.range(..).next())
            .map(|(block, _)| block)?;
        let found = self.first_whole_dirty_unit(&dirty, found).unwrap_or(found);
        let unit_start = self.write_unit_start(found);
        let block = dirty
            .range(unit_start..=found)
            .next()
            .map_or(found, |(block, _)| block);
        self.writeback_cursor
            .store(block + self.cluster_blocks, Ordering::Relaxed);
        Some(block)
    }

    /// On a device with a write unit: the first block of the first unit, from `from`'s unit
    /// on (wrapping), whose blocks are all dirty, looking at most `UNITS_SCANNED_MAX` units.
    /// Writing a unit with holes makes the device read, merge and rewrite it, and again when
    /// the holes are written later (an object-store chunk: a GET and a PUT per piece).
    fn first_whole_dirty_unit(&self, dirty: &DirtyBlocks, from: u64) -> Option<u64> {
        const UNITS_SCANNED_MAX: usize = 256;
        if self.write_unit_bytes == 0 {
            return None;
        }
        let unit_blocks = self.write_unit_bytes / self.block_size_bytes as u64;
        let from_unit = self.write_unit_start(from);
        let mut last_unit = None;
        let mut scanned = 0;
        for (block, _) in dirty.range(from_unit..).chain(dirty.range(..from_unit)) {
            let unit = self.write_unit_start(block);
            if last_unit == Some(unit) {
                continue;
            }
            last_unit = Some(unit);
            if dirty.count(unit..unit + unit_blocks) == unit_blocks {
                return Some(unit);
            }
            scanned += 1;
            if scanned >= UNITS_SCANNED_MAX {
                return None;
            }
        }
        None
    }

    /// Queues the completed cluster `[start, end)` for write-behind. True when the caller
    /// must start one more write-behind job: more batches of `batch_blocks` are queued than
    /// jobs run, and fewer than `WRITE_BEHIND_JOBS_MAX` run. Waiting for a batch means one hand-off to a
    /// worker per batch instead of per cluster (a wake-up and a sleep cost a 1 MiB write
    /// about as much CPU as its table work); a backlog of another batch while jobs run starts
    /// another job, so a slow device still gets several writes in flight. What never makes a
    /// batch is taken by the background writer's next tick ([`ObjectState::take_write_behind`]).
    /// Over `WRITE_BEHIND_QUEUED_MAX` ranges the range is left to the background writer.
    pub fn queue_write_behind(&self, start: u64, end: u64, batch_blocks: u64) -> bool {
        let mut queue = self.write_behind.lock();
        if queue.ranges.len() >= WRITE_BEHIND_QUEUED_MAX {
            return false;
        }
        queue.ranges.push_back((start, end));
        queue.queued_blocks += end - start;
        // Each running job already drains the queue; another starts only when a batch is
        // queued beyond one per running job (the device is not keeping up), so a fast local
        // device is written by one job at a time instead of several contending for its
        // inode lock.
        let batches_waiting = queue.queued_blocks / batch_blocks.max(1);
        if batches_waiting > queue.jobs_running as u64 && queue.jobs_running < WRITE_BEHIND_JOBS_MAX
        {
            queue.jobs_running += 1;
            return true;
        }
        false
    }

    /// The next range for a write-behind job, or None — and then that job is over.
    pub fn next_write_behind(&self) -> Option<(u64, u64)> {
        let mut queue = self.write_behind.lock();
        let next = queue.ranges.pop_front();
        match next {
            Some((start, end)) => queue.queued_blocks -= end - start,
            None => {
                strict_assert!(queue.jobs_running > 0, "a write-behind job ended twice");
                queue.jobs_running -= 1;
            }
        }
        next
    }

    /// Every queued write-behind range, when no job runs to take them (the background
    /// writer's part: a stream that stopped short of a batch is still written soon).
    pub fn take_write_behind(&self) -> Vec<(u64, u64)> {
        let mut queue = self.write_behind.lock();
        if queue.jobs_running > 0 {
            return Vec::new();
        }
        queue.queued_blocks = 0;
        queue.ranges.drain(..).collect()
    }

    /// Ends a write-behind job that could not be started.
    pub fn end_write_behind_job(&self) {
        let mut queue = self.write_behind.lock();
        strict_assert!(queue.jobs_running > 0, "a write-behind job ended twice");
        queue.jobs_running -= 1;
    }

    /// Marks a discard or zeroing that is about to take its range's dirty blocks out of
    /// write-back (held locked in the table) and replace them on the device; the returned
    /// guard ends it. Those blocks may hold writes completed
    /// before a FLUSH that then finds nothing of them to write: the FLUSH must not flush the
    /// device before the replacement reached it, or a crash could leave neither the writes
    /// nor the replacement.
    pub fn begin_replace(&self) -> ReplaceInFlight<'_> {
        self.replaces_in_flight.fetch_add(1, Ordering::AcqRel);
        ReplaceInFlight { object: self }
    }

    /// True while a discard or zeroing has taken dirty blocks out of write-back and its device
    /// operation has not answered.
    pub fn replace_in_flight(&self) -> bool {
        self.replaces_in_flight.load(Ordering::Acquire) > 0
    }

    /// Records a write-back failure.
    pub fn latch_error(&self, error: &CacheError) {
        let mut latch = self.latch.lock();
        latch.sequence += 1;
        latch.kind = Some(error.kind());
        latch.message = error.to_string();
    }

    /// Feeds a read of blocks `[first, end)` to the object's stream table and returns what to
    /// read ahead; the streams' windows share `spare_blocks` of unused read-ahead.
    pub fn plan_read(&self, first: u64, end: u64, spare_blocks: u64) -> ReadaheadPlan {
        let limits = WindowLimits {
            spare_blocks,
            object_blocks: self.block_count(),
            ..self.limits
        };
        self.streams.lock().on_read(first, end, limits)
    }

    /// Records that the reader of the stream now at `next_block` waited for read-ahead in
    /// flight: that stream's windows may grow larger, within its share of `spare_blocks`.
    pub fn note_readahead_wait(&self, next_block: u64, spare_blocks: u64) {
        let limits = WindowLimits {
            spare_blocks,
            object_blocks: self.block_count(),
            ..self.limits
        };
        self.streams.lock().reader_waited(next_block, limits);
    }

    pub fn latch_sequence(&self) -> u64 {
        self.latch.lock().sequence
    }

    /// Records that every latched error so far has been reported to the holder of `seen`.
    pub fn mark_errors_seen(&self, seen: &AtomicU64) {
        seen.store(self.latch.lock().sequence, Ordering::Release);
    }

    /// The latched error if it is newer than `seen`, updating `seen`.
    pub fn unseen_error(&self, seen: &AtomicU64) -> Option<CacheError> {
        let latch = self.latch.lock();
        let previous = seen.swap(latch.sequence, Ordering::AcqRel);
        if latch.sequence > previous {
            Some(CacheError::WritebackFailed {
                device: self.device.describe(),
                kind: latch.kind.unwrap_or(std::io::ErrorKind::Other),
                message: latch.message.clone(),
            })
        } else {
            None
        }
    }

    pub fn check_range(&self, offset: u64, length_bytes: u64) -> Result<(), CacheError> {
        match offset.checked_add(length_bytes) {
            Some(end) if end <= self.length_bytes() => Ok(()),
            _ => Err(CacheError::OutOfRange {
                object: self.name.clone(),
                offset,
                length_bytes,
                object_length_bytes: self.length_bytes(),
            }),
        }
    }

    pub fn check_writable(&self) -> Result<(), CacheError> {
        if self.read_only {
            Err(CacheError::ReadOnly {
                object: self.name.clone(),
            })
        } else {
            Ok(())
        }
    }
}

/// A discard or zeroing in flight on an object ([`ObjectState::begin_replace`]).
pub(crate) struct ReplaceInFlight<'a> {
    object: &'a ObjectState,
}

impl Drop for ReplaceInFlight<'_> {
    fn drop(&mut self) {
        let before = self
            .object
            .replaces_in_flight
            .fetch_sub(1, Ordering::AcqRel);
        strict_assert!(before > 0, "a replace ended twice");
    }
}
