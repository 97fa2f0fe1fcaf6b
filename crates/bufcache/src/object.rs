//! Objects and their API: the byte-range calls the NBD server uses and the BSD buffer calls.
//!
//! An object (an export, a file) has its own block size and a [`BlockMap`] from logical
//! blocks to device offsets; the identity map by default. Its mutable state — the dirty set
//! (block → time it became dirty), the write-back error latch and the read-ahead stream table —
//! has one short-held mutex each.
//!
//! Invariants:
//! - a block is in the dirty set exactly when its buffer has DIRTY set; both change under
//!   that buffer's lock;
//! - a partial-block write reads the block first only when it is not cached;
//! - the error latch's sequence number only grows; each [`ObjectHandle`] remembers the last
//!   sequence it reported, so every handle hears of every write-back error once (errseq).

use std::collections::BTreeMap;
use std::io::IoSliceMut;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bufcache_policy::Placement;
use parking_lot::Mutex;

use crate::buffer::{BlockKey, Buffer, DIRTY, READAHEAD, VALID};
use crate::cache::{Cache, Inner, Lookup, Urgency};
use crate::config::CacheConfig;
use crate::dirty;

/// How long `visit_dirty_blocks` waits between tries for a block held exclusively.
const VISIT_LOCK_STEP: std::time::Duration = std::time::Duration::from_millis(1);
use crate::error::CacheError;
use crate::readahead::{StreamTable, WindowLimits};
use crate::stats::WritebackCause;
use crate::writeback::LockMode;
use bufcache_device::{Device, Extent};

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
    /// Block (buffer) size. Default 4 KiB. A multiple of 512 up to `buffer_size_max_bytes`
    /// and `cluster_size_max_bytes`.
    pub block_size_bytes: u32,
    /// Object length. Default (None): the device's length (with the identity map).
    pub length_bytes: Option<u64>,
    /// Block map. Default (None): identity from device offset 0.
    pub block_map: Option<Arc<dyn BlockMap>>,
    /// Refuse writes.
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
    pub length_bytes: u64,
    pub block_count: u64,
    pub read_only: bool,
    pub device: Arc<dyn Device>,
    pub map: Arc<dyn BlockMap>,
    pub dirty: Mutex<BTreeMap<u64, u64>>,
    /// Where the next pressure-driven write-back starts looking (see `claim_dirty_cluster`).
    writeback_cursor: AtomicU64,
    latch: Mutex<ErrorLatch>,
    streams: Mutex<StreamTable>,
    limits: WindowLimits,
    pub cluster_blocks: u64,
    /// The device's preferred write unit in bytes (`Capabilities::write_unit_bytes`) when it
    /// is a whole number of blocks larger than one, else 0: write-back runs end on it.
    write_unit_bytes: u64,
}

impl ObjectState {
    pub fn new(id: u32, config: ObjectConfig, cache: &CacheConfig) -> Result<Self, CacheError> {
        let invalid = |reason: String| CacheError::InvalidObject {
            object: config.name.clone(),
            reason,
        };
        let block_size = config.block_size_bytes as u64;
        if block_size == 0
            || !block_size.is_multiple_of(512)
            || block_size > cache.buffer_size_max_bytes
        {
            return Err(invalid(format!(
                "block size {block_size} must be a multiple of 512 up to buffer_size_max ({})",
                cache.buffer_size_max_bytes
            )));
        }
        if block_size > cache.cluster_size_max_bytes {
            return Err(invalid(format!(
                "block size {block_size} exceeds cluster_size_max ({}): a cluster holds at least one block",
                cache.cluster_size_max_bytes
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
        let map = config
            .block_map
            .clone()
            .unwrap_or_else(|| Arc::new(IdentityMap::new(0, block_size, block_count)));
        let readahead_blocks = |bytes: u64| bytes.div_ceil(block_size);
        let write_unit_bytes = config.device.capabilities().write_unit_bytes;
        let write_unit_bytes = if write_unit_bytes > block_size
            && write_unit_bytes.is_multiple_of(block_size)
        {
            write_unit_bytes
        } else {
            0
        };
        // A write cluster covers at least one whole write unit, or every unit would be
        // written in pieces (an object-store chunk read, merged and uploaded once per piece).
        let cluster_blocks = (cache.cluster_size_max_bytes / block_size)
            .max(write_unit_bytes / block_size)
            .max(1);
        Ok(ObjectState {
            id,
            block_size_bytes: config.block_size_bytes,
            length_bytes,
            block_count,
            read_only: config.read_only,
            device: config.device,
            map,
            dirty: Mutex::new(BTreeMap::new()),
            writeback_cursor: AtomicU64::new(0),
            latch: Mutex::new(ErrorLatch::default()),
            streams: Mutex::new(StreamTable::new()),
            limits: WindowLimits {
                initial_blocks: readahead_blocks(cache.readahead_size_initial_bytes),
                max_blocks: cache.readahead_size_max_bytes / block_size,
                streams_max: cache.streams_per_object_max,
                object_blocks: block_count,
            },
            cluster_blocks,
            write_unit_bytes,
            name: config.name,
        })
    }

    /// Bytes of `block` that exist (the last block may be short).
    pub fn block_length_bytes(&self, block: u64) -> u32 {
        let start = block * self.block_size_bytes as u64;
        (self.length_bytes - start).min(self.block_size_bytes as u64) as u32
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
        let limit = self.cluster_blocks.min(mapped.contiguous_blocks);
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
            .or_else(|| dirty.iter().next())
            .map(|(&block, _)| block)?;
        let unit_start = self.write_unit_start(found);
        let block = dirty
            .range(unit_start..=found)
            .next()
            .map_or(found, |(&block, _)| block);
        self.writeback_cursor
            .store(block + self.cluster_blocks, Ordering::Relaxed);
        Some(block)
    }

    /// Records a write-back failure.
    pub fn latch_error(&self, error: &CacheError) {
        let mut latch = self.latch.lock();
        latch.sequence += 1;
        latch.kind = Some(error.kind());
        latch.message = error.to_string();
    }

    fn latch_sequence(&self) -> u64 {
        self.latch.lock().sequence
    }

    /// Records that every latched error so far has been reported to the holder of `seen`.
    fn mark_errors_seen(&self, seen: &AtomicU64) {
        seen.store(self.latch.lock().sequence, Ordering::Release);
    }

    /// The latched error if it is newer than `seen`, updating `seen`.
    fn unseen_error(&self, seen: &AtomicU64) -> Option<CacheError> {
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

    fn check_range(&self, offset: u64, length_bytes: u64) -> Result<(), CacheError> {
        match offset.checked_add(length_bytes) {
            Some(end) if end <= self.length_bytes => Ok(()),
            _ => Err(CacheError::OutOfRange {
                object: self.name.clone(),
                offset,
                length_bytes,
                object_length_bytes: self.length_bytes,
            }),
        }
    }

    fn check_writable(&self) -> Result<(), CacheError> {
        if self.read_only {
            Err(CacheError::ReadOnly {
                object: self.name.clone(),
            })
        } else {
            Ok(())
        }
    }
}

/// A buffer held exclusively: what `getblk` and `bread` return. Dropping it releases it
/// (`brelse`); an invalid buffer (never filled) is discarded on release.
pub struct BufferGuard {
    inner: Arc<Inner>,
    buffer: Arc<Buffer>,
    discard_on_release: bool,
}

impl BufferGuard {
    fn new(inner: &Arc<Inner>, _object: &Arc<ObjectState>, buffer: Arc<Buffer>) -> Self {
        BufferGuard {
            inner: Arc::clone(inner),
            buffer,
            discard_on_release: false,
        }
    }

    /// The logical block number.
    pub fn block(&self) -> u64 {
        self.buffer.key.block
    }

    /// True when the bytes hold the block's contents (read, or written whole).
    pub fn is_valid(&self) -> bool {
        self.buffer.has(VALID)
    }

    /// True when the bytes are newer than the device.
    pub fn is_dirty(&self) -> bool {
        self.buffer.has(DIRTY)
    }

    /// The block's bytes (the block size; bytes past the end of a short last block are
    /// zero and never written).
    pub fn data(&self) -> &[u8] {
        // SAFETY: the guard holds the buffer lock exclusively.
        unsafe { self.buffer.bytes() }
    }

    /// The block's bytes, for filling or modifying; call [`ObjectHandle::bdwrite`] (or
    /// another write) afterwards to keep the change.
    pub fn data_mut(&mut self) -> &mut [u8] {
        // SAFETY: the guard holds the buffer lock exclusively and borrows self mutably.
        unsafe { self.buffer.bytes_mut() }
    }

    /// Declares the bytes valid after the caller filled them itself (a clean buffer).
    pub fn mark_valid(&mut self) {
        self.buffer.set(VALID);
    }

    /// B_NOCACHE: on release, drop the buffer from the cache if it is clean.
    pub fn set_no_cache(&mut self) {
        self.discard_on_release = true;
    }
}

impl Drop for BufferGuard {
    fn drop(&mut self) {
        let drop_it =
            !self.buffer.has(VALID) || (self.discard_on_release && !self.buffer.has(DIRTY));
        if drop_it {
            self.inner.remove(&self.buffer);
        }
        // SAFETY: the guard holds the lock exclusively until now.
        unsafe { self.buffer.unlock_exclusive() };
        self.inner.unpin(&self.buffer);
    }
}

/// A buffer held shared for reading, by the byte-range read path.
struct SharedHold<'a> {
    inner: &'a Inner,
    buffer: Arc<Buffer>,
}

impl Drop for SharedHold<'_> {
    fn drop(&mut self) {
        // SAFETY: the hold owns one shared lock.
        unsafe { self.buffer.unlock_shared() };
        self.inner.unpin(&self.buffer);
    }
}

/// A handle on one object of a cache. Each handle is one "opener" for error reporting: a
/// write-back error is reported by the next `flush` of every handle that existed (or was
/// opened) before it happened, once each.
pub struct ObjectHandle {
    cache: Cache,
    object: Arc<ObjectState>,
    seen_error_sequence: AtomicU64,
}

impl ObjectHandle {
    pub(crate) fn new(cache: Cache, object: Arc<ObjectState>) -> Self {
        let seen = object.latch_sequence();
        ObjectHandle {
            cache,
            object,
            seen_error_sequence: AtomicU64::new(seen),
        }
    }

    /// A new handle on the same object, with its own error reporting position (now).
    pub fn reopen(&self) -> ObjectHandle {
        ObjectHandle::new(self.cache.clone(), Arc::clone(&self.object))
    }

    /// The cache this object lives in.
    pub fn cache(&self) -> &Cache {
        &self.cache
    }

    /// The object's name.
    pub fn name(&self) -> &str {
        &self.object.name
    }

    /// The object's length in bytes.
    pub fn len(&self) -> u64 {
        self.object.length_bytes
    }

    /// True for a zero-length object.
    pub fn is_empty(&self) -> bool {
        self.object.length_bytes == 0
    }

    /// The block size in bytes.
    pub fn block_size(&self) -> u32 {
        self.object.block_size_bytes
    }

    /// True when writes are refused.
    pub fn is_read_only(&self) -> bool {
        self.object.read_only
    }

    /// The device below.
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.object.device
    }

    fn inner(&self) -> &Arc<Inner> {
        &self.cache.inner
    }

    /// Passes `result` through; an error returned to this handle now also counts as reported
    /// to it, so its next flush does not report the same latched error a second time.
    fn reported<T>(&self, result: Result<T, CacheError>) -> Result<T, CacheError> {
        if result.is_err() {
            self.object.mark_errors_seen(&self.seen_error_sequence);
        }
        result
    }

    // ----- byte-range API -----

    /// Reads `target.len()` bytes at `offset`, through the cache, with read-ahead for
    /// sequential streams and clustered device reads for runs of misses.
    pub fn read_at(&self, offset: u64, target: &mut [u8]) -> Result<(), CacheError> {
        let object = &self.object;
        object.check_range(offset, target.len() as u64)?;
        if target.is_empty() {
            return Ok(());
        }
        let block_size = object.block_size_bytes as u64;
        let first = offset / block_size;
        let end = (offset + target.len() as u64).div_ceil(block_size);
        let plan = object.streams.lock().on_read(first, end, object.limits);
        let placement = if plan.no_reuse && self.cache.inner.config.noreuse_sequential {
            Placement::NoReuse
        } else {
            Placement::Normal
        };
        let mut block = first;
        while block < end {
            // A miss inside the stream's issued window reads to the window's end itself: the
            // background job may not have reached those blocks yet.
            let miss_limit = plan.extend_to_block.max(plan.window_end_block);
            block = self.read_step(block, end, miss_limit, placement, offset, target)?;
        }
        if plan.extend_to_block > end {
            // The part of the synchronous window the request's own miss runs did not cover.
            self.start_readahead(end, plan.extend_to_block);
        }
        if let Some((start, window_end)) = plan.background {
            self.start_readahead(start, window_end);
        }
        Ok(())
    }

    /// Serves `block` (and, on a miss, the run of missing blocks after it) and returns the
    /// next block to serve.
    fn read_step(
        &self,
        block: u64,
        end: u64,
        extend_to: u64,
        placement: Placement,
        offset: u64,
        target: &mut [u8],
    ) -> Result<u64, CacheError> {
        let inner = self.inner();
        let key = self.object.key(block);
        match inner.lookup_or_insert(key, &self.object, placement, Urgency::Wait)? {
            Lookup::Found(buffer) => {
                buffer.lock_shared();
                let hold = SharedHold { inner, buffer };
                if !hold.buffer.has(VALID) {
                    // The reader that inserted it failed and removed it: look again.
                    return Ok(block);
                }
                if hold.buffer.clear(READAHEAD) {
                    inner
                        .counters
                        .readahead_used_blocks
                        .fetch_add(1, Ordering::Relaxed);
                    if placement == Placement::NoReuse {
                        inner.demote(&hold.buffer);
                    }
                }
                // SAFETY: shared lock held by `hold`.
                copy_out(
                    &self.object,
                    block,
                    unsafe { hold.buffer.bytes() },
                    offset,
                    target,
                );
                Ok(block + 1)
            }
            Lookup::Inserted(buffer) => {
                let run_end = extend_to.max(end);
                let run = self.read_run(buffer, run_end, end, placement)?;
                let served_end = (block + run.len() as u64).min(end);
                for guard in &run[..(served_end - block) as usize] {
                    copy_out(&self.object, guard.block(), guard.data(), offset, target);
                }
                Ok(served_end)
            }
        }
    }

    /// Extends a freshly inserted buffer into a run of absent blocks up to `limit`, one
    /// cluster at most and never across a block-map gap, and reads the run with one vectored
    /// device request. Blocks at or past `request_end` are read-ahead.
    fn read_run(
        &self,
        first: Arc<Buffer>,
        limit: u64,
        request_end: u64,
        placement: Placement,
    ) -> Result<Vec<BufferGuard>, CacheError> {
        let mut run = self.collect_run(first, limit, request_end, placement);
        self.read_collected(&mut run, request_end)?;
        Ok(run)
    }

    /// The buffers of a run: `first` and the absent blocks after it, inserted locked.
    fn collect_run(
        &self,
        first: Arc<Buffer>,
        limit: u64,
        request_end: u64,
        placement: Placement,
    ) -> Vec<BufferGuard> {
        let inner = self.inner();
        let object = &self.object;
        let start = first.key.block;
        let mapped = object.map.map(start);
        let run_limit = limit
            .min(start + object.cluster_blocks)
            .min(start + mapped.contiguous_blocks)
            .min(object.block_count);
        let mut run = vec![BufferGuard::new(inner, object, first)];
        for block in start + 1..run_limit {
            let Some(buffer) = inner.insert_absent(
                object.key(block),
                object,
                run_placement(placement, block, request_end),
                block < request_end,
            ) else {
                break;
            };
            if block >= request_end {
                buffer.set(READAHEAD);
            }
            run.push(BufferGuard::new(inner, object, buffer));
        }
        run
    }

    /// Reads a collected run; blocks at or past `request_end` count as read-ahead.
    fn read_collected(&self, run: &mut [BufferGuard], request_end: u64) -> Result<(), CacheError> {
        let start = run[0].block();
        let readahead =
            run.len() as u64 - (request_end.saturating_sub(start)).min(run.len() as u64);
        self.device_read(run, self.object.map.map(start).device_offset)?;
        self.inner()
            .counters
            .readahead_issued_blocks
            .fetch_add(readahead, Ordering::Relaxed);
        Ok(())
    }

    /// One vectored device read into every buffer of `run`. On failure nothing is marked
    /// valid, so dropping the guards removes every buffer: a failed read caches nothing.
    fn device_read(&self, run: &mut [BufferGuard], device_offset: u64) -> Result<(), CacheError> {
        let inner = self.inner();
        let mut slices: Vec<IoSliceMut<'_>> = run
            .iter()
            // SAFETY: every guard holds its buffer exclusively.
            .map(|guard| IoSliceMut::new(unsafe { guard.buffer.device_bytes_mut() }))
            .collect();
        let length_bytes: u64 = slices.iter().map(|slice| slice.len() as u64).sum();
        let result = self
            .object
            .device
            .read_vectored_at(&mut slices, device_offset);
        inner
            .counters
            .device_reads
            .record(length_bytes, result.is_ok());
        result.map_err(|source| CacheError::Device {
            device: self.object.device.describe(),
            operation: "read",
            offset: device_offset,
            length_bytes,
            source,
        })?;
        if run.len() > 1 {
            inner.counters.read_clusters.fetch_add(1, Ordering::Relaxed);
            inner
                .counters
                .read_cluster_buffers
                .fetch_add(run.len() as u64, Ordering::Relaxed);
        }
        for guard in run.iter_mut() {
            guard.mark_valid();
        }
        Ok(())
    }

    /// Reads `[start, end)` into the cache in the background (or inline when the spawner
    /// refuses). Best effort: blocks already cached and blocks that find no free space are
    /// skipped; errors are counted but not reported, since no reader asked for these blocks.
    fn start_readahead(&self, start: u64, end: u64) {
        let handle = self.background_handle();
        let job = Box::new(move || handle.fill_readahead(start, end));
        if let Err(job) = self.cache.inner.spawner.spawn(job) {
            job();
        }
    }

    /// Makes blocks `[start, end)` resident without copying them anywhere.
    fn fill_readahead(&self, start: u64, end: u64) {
        // Insert the whole window before the first read, so a reader arriving meanwhile
        // waits on these buffers instead of reading the same blocks itself in small pieces.
        let inner = self.inner();
        let mut runs = Vec::new();
        let mut block = start;
        while block < end {
            let Some(buffer) = inner.insert_absent(
                self.object.key(block),
                &self.object,
                Placement::Normal,
                false,
            ) else {
                block += 1;
                continue;
            };
            buffer.set(READAHEAD);
            let run = self.collect_run(buffer, end, block, Placement::Normal);
            block += run.len() as u64;
            runs.push(run);
        }
        // Every run after the first is read by its own background job, so a window larger
        // than a cluster keeps several requests in flight (what a high-latency backend
        // needs); the first run, which the reader wants soonest, is read here. A failed run
        // is dropped unread, which removes its buffers: read-ahead caches nothing on error,
        // and the reader meets the error itself.
        let mut runs = runs.into_iter();
        let Some(mut first) = runs.next() else { return };
        for mut run in runs {
            let handle = self.background_handle();
            let job: crate::environment::Job = Box::new(move || {
                let start = run[0].block();
                let _ = handle.read_collected(&mut run, start);
            });
            if let Err(job) = self.inner().spawner.spawn(job) {
                job();
            }
        }
        let start = first[0].block();
        let _ = self.read_collected(&mut first, start);
    }

    /// A handle for background work; it reports no errors to anyone (its errseq position is
    /// irrelevant), so it does not take part in flush error reporting.
    fn background_handle(&self) -> ObjectHandle {
        ObjectHandle {
            cache: self.cache.clone(),
            object: Arc::clone(&self.object),
            seen_error_sequence: AtomicU64::new(0),
        }
    }

    /// True when every block of the byte range is in the cache now (a hint: it may change
    /// at once). Ranges over 64 blocks answer false without looking, to keep the check cheap.
    pub fn is_resident(&self, offset: u64, length_bytes: u64) -> bool {
        const BLOCKS_MAX: u64 = 64;
        if self.object.check_range(offset, length_bytes).is_err() || length_bytes == 0 {
            return false;
        }
        let block_size = self.object.block_size_bytes as u64;
        let first = offset / block_size;
        let end = (offset + length_bytes).div_ceil(block_size);
        end - first <= BLOCKS_MAX
            && (first..end).all(|block| self.inner().contains(self.object.key(block)))
    }

    /// NBD_CMD_CACHE: reads `[offset, offset + length)` into the cache.
    pub fn prefetch(&self, offset: u64, length_bytes: u64) -> Result<(), CacheError> {
        self.object.check_range(offset, length_bytes)?;
        if length_bytes == 0 {
            return Ok(());
        }
        let block_size = self.object.block_size_bytes as u64;
        let first = offset / block_size;
        let end = (offset + length_bytes).div_ceil(block_size);
        let mut block = first;
        while block < end {
            match self.inner().lookup_or_insert(
                self.object.key(block),
                &self.object,
                Placement::Normal,
                Urgency::Wait,
            )? {
                Lookup::Found(buffer) => {
                    self.inner().unpin(&buffer);
                    block += 1;
                }
                Lookup::Inserted(buffer) => {
                    block += self.read_run(buffer, end, end, Placement::Normal)?.len() as u64;
                }
            }
        }
        Ok(())
    }

    /// Writes `data` at `offset` into the cache (delayed write). With `fua`, the written
    /// blocks reach the device and the device is flushed before this returns.
    pub fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), CacheError> {
        let object = &self.object;
        object.check_writable()?;
        object.check_range(offset, data.len() as u64)?;
        if data.is_empty() {
            return Ok(());
        }
        self.reported(self.inner().throttle_writer(object))?;
        let block_size = object.block_size_bytes as u64;
        let first = offset / block_size;
        let end = (offset + data.len() as u64).div_ceil(block_size);
        for block in first..end {
            let (within, source) = piece_of(object, block, offset, data);
            let whole = source.len() == object.block_length_bytes(block) as usize;
            let mut guard = self.acquire_for_write(block, whole)?;
            guard.data_mut()[within..within + source.len()].copy_from_slice(source);
            self.mark_dirty(&guard);
        }
        if fua {
            self.reported(self.write_through(first, end))?;
        } else if self.inner().config.write_behind {
            self.write_behind(first, end);
        }
        Ok(())
    }

    /// Holds `block` exclusively with valid contents, or — when the caller overwrites it
    /// whole — possibly invalid contents that the caller is about to replace.
    fn acquire_for_write(&self, block: u64, whole: bool) -> Result<BufferGuard, CacheError> {
        let guard = self.hold_exclusive(block)?;
        if guard.is_valid() {
            return Ok(guard);
        }
        let mut run = vec![guard];
        if whole {
            run[0].mark_valid();
        } else {
            let device_offset = self.object.map.map(block).device_offset;
            self.device_read(&mut run, device_offset)?;
        }
        Ok(run.pop().expect("one guard"))
    }

    /// Holds `block` exclusively: a cached valid buffer, or a newly inserted invalid one.
    /// A buffer found invalid was being filled by a reader that failed and removed it, so
    /// the block is looked up again.
    fn hold_exclusive(&self, block: u64) -> Result<BufferGuard, CacheError> {
        let inner = self.inner();
        loop {
            let key = self.object.key(block);
            match inner.lookup_or_insert(key, &self.object, Placement::Normal, Urgency::Wait)? {
                Lookup::Found(buffer) => {
                    buffer.lock_exclusive();
                    let guard = BufferGuard::new(inner, &self.object, buffer);
                    if guard.is_valid() {
                        return Ok(guard);
                    }
                }
                Lookup::Inserted(buffer) => {
                    return Ok(BufferGuard::new(inner, &self.object, buffer))
                }
            }
        }
    }

    fn mark_dirty(&self, guard: &BufferGuard) {
        let buffer = &guard.buffer;
        buffer.set(VALID);
        if !buffer.has(DIRTY) {
            let now = self.inner().clock.now_ns();
            dirty::mark(&self.inner().dirty_bytes, &self.object.dirty, buffer, now);
        }
    }

    /// Writes the dirty blocks of `[first, end)` to the device now and flushes it (FUA).
    fn write_through(&self, first: u64, end: u64) -> Result<(), CacheError> {
        self.inner().write_range(
            &self.object,
            first,
            end,
            LockMode::Wait,
            WritebackCause::Flush,
        )?;
        self.inner().flush_device(&self.object)
    }

    /// Queues write-back of every cluster this write completed (all its blocks dirty).
    fn write_behind(&self, first: u64, end: u64) {
        let object = &self.object;
        let cluster = object.cluster_blocks;
        let mut cluster_start = first / cluster * cluster;
        while cluster_start < end {
            let cluster_end = (cluster_start + cluster).min(object.block_count);
            let completed = cluster_end <= end && cluster_end > first;
            if completed
                && object
                    .dirty
                    .lock()
                    .range(cluster_start..cluster_end)
                    .count() as u64
                    == cluster_end - cluster_start
            {
                let inner = Arc::clone(self.inner());
                let target = Arc::clone(object);
                let job = Box::new(move || {
                    // Errors are latched on the object and reported by the next flush.
                    let _ = inner.write_range(
                        &target,
                        cluster_start,
                        cluster_end,
                        LockMode::Try,
                        WritebackCause::WriteBehind,
                    );
                });
                // When no worker is free the background writer will get to it.
                let _ = self.inner().spawner.spawn(job);
            }
            cluster_start += cluster;
        }
    }

    /// Writes every dirty block of this object back and flushes the device. Every write that
    /// completed before this call is durable when it returns `Ok`. Reports this handle's
    /// unseen write-back errors once.
    pub fn flush(&self) -> Result<(), CacheError> {
        let result = self.inner().fsync_object(&self.object);
        let unseen = self.object.unseen_error(&self.seen_error_sequence);
        result?;
        unseen.map_or(Ok(()), Err)
    }

    /// Drops cached blocks wholly inside the range and tells the device the range is unused.
    /// Blocks partly inside keep their data (a discard is advisory).
    pub fn discard(&self, offset: u64, length_bytes: u64) -> Result<(), CacheError> {
        self.object.check_writable()?;
        self.object.check_range(offset, length_bytes)?;
        let (first, end) = self.whole_blocks(offset, length_bytes);
        self.replace_on_device(first, end, "discard", |device, at, length| {
            device.discard(at, length)
        })
    }

    /// Makes the range read as zeroes. Whole blocks are zeroed on the device when that is
    /// cheap (holes), otherwise written as zero blocks through the cache.
    pub fn write_zeroes(
        &self,
        offset: u64,
        length_bytes: u64,
        fua: bool,
    ) -> Result<(), CacheError> {
        self.object.check_writable()?;
        self.object.check_range(offset, length_bytes)?;
        let block_size = self.object.block_size_bytes as u64;
        let (first, end) = self.whole_blocks(offset, length_bytes);
        if first >= end || !self.object.device.capabilities().write_zeroes_fast {
            return self.write_zero_bytes(offset, length_bytes, fua);
        }
        let head_end = first * block_size;
        let tail_start = (end * block_size).min(self.object.length_bytes);
        self.write_zero_bytes(offset, head_end - offset, fua)?;
        self.write_zero_bytes(
            tail_start,
            (offset + length_bytes).saturating_sub(tail_start),
            fua,
        )?;
        self.replace_on_device(first, end, "write_zeroes", |device, at, length| {
            device.write_zeroes(at, length)
        })?;
        if fua {
            self.inner().flush_device(&self.object)?;
        }
        Ok(())
    }

    fn write_zero_bytes(
        &self,
        offset: u64,
        length_bytes: u64,
        fua: bool,
    ) -> Result<(), CacheError> {
        let zeroes = vec![0u8; length_bytes.min(1 << 20) as usize];
        let mut done = 0u64;
        while done < length_bytes {
            let step = (length_bytes - done).min(zeroes.len() as u64) as usize;
            self.write_at(offset + done, &zeroes[..step], fua)?;
            done += step as u64;
        }
        Ok(())
    }

    /// Blocks wholly inside a byte range: `[first, end)`.
    fn whole_blocks(&self, offset: u64, length_bytes: u64) -> (u64, u64) {
        let block_size = self.object.block_size_bytes as u64;
        let first = offset.div_ceil(block_size);
        let range_end = offset + length_bytes;
        let end = if range_end == self.object.length_bytes {
            self.object.block_count
        } else {
            range_end / block_size
        };
        (first, end.max(first))
    }

    /// Drops the blocks `[first, end)` from the cache (dirty ones included: their contents
    /// are being replaced), applies `operation` to their device ranges, then drops any clean
    /// copy a concurrent reader fetched from the device meanwhile. Blocks written meanwhile
    /// stay dirty: those writes are newer than this operation.
    fn replace_on_device(
        &self,
        first: u64,
        end: u64,
        name: &'static str,
        operation: impl Fn(&dyn Device, u64, u64) -> std::io::Result<()>,
    ) -> Result<(), CacheError> {
        if first >= end {
            return Ok(());
        }
        self.invalidate_blocks(first, end, true);
        let object = &self.object;
        let mut block = first;
        while block < end {
            let mapped = object.map.map(block);
            let blocks = mapped.contiguous_blocks.min(end - block);
            let length = (block + blocks) * object.block_size_bytes as u64;
            let length = length.min(object.length_bytes) - block * object.block_size_bytes as u64;
            operation(object.device.as_ref(), mapped.device_offset, length).map_err(|source| {
                CacheError::Device {
                    device: object.device.describe(),
                    operation: name,
                    offset: mapped.device_offset,
                    length_bytes: length,
                    source,
                }
            })?;
            block += blocks;
        }
        self.invalidate_blocks(first, end, false);
        Ok(())
    }

    /// Removes cached blocks of `[first, end)`; dirty ones too when `including_dirty`.
    fn invalidate_blocks(&self, first: u64, end: u64, including_dirty: bool) {
        let inner = self.inner();
        let cached: Vec<u64> = if end - first <= 4096 {
            (first..end).collect()
        } else {
            inner.cached_blocks(self.object.id, first, end)
        };
        for block in cached {
            let Some(buffer) = inner.lookup_quiet(self.object.key(block)) else {
                continue;
            };
            buffer.lock_exclusive();
            let mut guard = BufferGuard::new(inner, &self.object, buffer);
            if guard.is_dirty() && !including_dirty {
                continue;
            }
            self.clear_dirty(&guard);
            guard.set_no_cache();
            guard.buffer.clear(VALID);
        }
    }

    fn clear_dirty(&self, guard: &BufferGuard) {
        dirty::clear(&self.inner().dirty_bytes, &self.object.dirty, &guard.buffer);
    }

    /// The allocation map of a byte range: the device's holes, except that blocks dirty in
    /// the cache are data.
    pub fn extents(&self, offset: u64, length_bytes: u64) -> Result<Vec<Extent>, CacheError> {
        self.object.check_range(offset, length_bytes)?;
        let device_extents =
            self.object
                .device
                .extents(offset, length_bytes)
                .map_err(|source| CacheError::Device {
                    device: self.object.device.describe(),
                    operation: "extents",
                    offset,
                    length_bytes,
                    source,
                })?;
        let block_size = self.object.block_size_bytes as u64;
        let dirty = self.object.dirty.lock();
        let mut position = offset;
        let extents = device_extents
            .into_iter()
            .map(|extent| {
                let (start, end) = (
                    position / block_size,
                    (position + extent.length).div_ceil(block_size),
                );
                position += extent.length;
                let hole = extent.hole && dirty.range(start..end).next().is_none();
                Extent {
                    length: extent.length,
                    hole,
                }
            })
            .collect();
        Ok(extents)
    }

    // ----- BSD buffer API -----

    /// getblk: the buffer for `block`, held exclusively; invalid when it was not cached.
    pub fn getblk(&self, block: u64) -> Result<BufferGuard, CacheError> {
        self.check_block(block)?;
        self.hold_exclusive(block)
    }

    /// bread: the buffer for `block` with its contents, held exclusively.
    pub fn bread(&self, block: u64) -> Result<BufferGuard, CacheError> {
        let guard = self.getblk(block)?;
        if guard.is_valid() {
            return Ok(guard);
        }
        let mut run = vec![guard];
        self.device_read(&mut run, self.object.map.map(block).device_offset)?;
        Ok(run.pop().expect("one guard"))
    }

    /// bwrite: writes the buffer to the device now (no device flush) and releases it.
    pub fn bwrite(&self, guard: BufferGuard) -> Result<(), CacheError> {
        self.object.check_writable()?;
        self.mark_dirty(&guard);
        let result = self.inner().write_held(
            &self.object,
            std::slice::from_ref(&guard.buffer),
            WritebackCause::Flush,
        );
        drop(guard);
        self.reported(result).map(|_| ())
    }

    /// bdwrite: marks the buffer dirty (delayed write) and releases it.
    pub fn bdwrite(&self, guard: BufferGuard) -> Result<(), CacheError> {
        self.object.check_writable()?;
        self.mark_dirty(&guard);
        let block = guard.block();
        drop(guard);
        if self.inner().config.write_behind {
            self.write_behind(block, block + 1);
        }
        Ok(())
    }

    /// bawrite: marks the buffer dirty and starts writing it in the background; the buffer
    /// stays locked until the write finishes. Errors are latched for the next flush.
    pub fn bawrite(&self, guard: BufferGuard) -> Result<(), CacheError> {
        self.object.check_writable()?;
        self.mark_dirty(&guard);
        let inner = Arc::clone(self.inner());
        let object = Arc::clone(&self.object);
        let job = Box::new(move || {
            let _ = inner.write_held(
                &object,
                std::slice::from_ref(&guard.buffer),
                WritebackCause::Flush,
            );
            drop(guard);
        });
        if let Err(job) = self.inner().spawner.spawn(job) {
            job();
        }
        Ok(())
    }

    /// brelse: releases the buffer (dropping it from the cache if it is invalid or marked
    /// no-cache and clean).
    pub fn brelse(&self, guard: BufferGuard) {
        drop(guard);
    }

    /// bqrelse: releases the buffer and keeps it cached even if marked no-cache.
    pub fn bqrelse(&self, mut guard: BufferGuard) {
        guard.discard_on_release = false;
        drop(guard);
    }

    /// Drops every cached block of this object after writing back dirty ones (vinvalbuf
    /// with V_SAVE). Fails, keeping the dirty data, if write-back fails.
    pub fn invalidate(&self) -> Result<(), CacheError> {
        self.inner().fsync_object(&self.object)?;
        self.invalidate_blocks(0, self.object.block_count, false);
        Ok(())
    }

    /// Calls `visit(offset, bytes)` for every block in the dirty set (data not yet known to be
    /// on the device, including blocks whose write-back is in flight), in block order. The
    /// bytes are read under the buffer's shared lock, which an in-flight write-back also holds
    /// shared, so a hung device does not block this; a block held exclusively (being written
    /// by a client) for longer than `lock_wait` is visited with `None`. For saving dirty data
    /// elsewhere when the device cannot take it (the server's rescue file at shutdown).
    pub fn visit_dirty_blocks(
        &self,
        lock_wait: std::time::Duration,
        mut visit: impl FnMut(u64, Option<&[u8]>),
    ) {
        let blocks: Vec<u64> = self.object.dirty.lock().keys().copied().collect();
        let block_size = self.object.block_size_bytes as u64;
        for block in blocks {
            let Some(buffer) = self.inner().lookup_quiet(self.object.key(block)) else {
                continue;
            };
            // Waits go through the injected waiter and are counted as their full step, so the
            // total is bounded by `lock_wait` even on a virtual clock.
            let waiter = &self.inner().waiter;
            let mut waited = std::time::Duration::ZERO;
            let mut locked = buffer.try_lock_shared();
            while !locked && waited < lock_wait {
                waiter.wait(waiter.ticket(), VISIT_LOCK_STEP.as_nanos() as u64);
                waited += VISIT_LOCK_STEP;
                locked = buffer.try_lock_shared();
            }
            if locked {
                if buffer.has(DIRTY) {
                    // SAFETY: locked shared just above, released right after.
                    visit(block * block_size, Some(unsafe { buffer.device_bytes() }));
                }
                // SAFETY: locked shared above.
                unsafe { buffer.unlock_shared() };
            } else {
                visit(block * block_size, None);
            }
            self.inner().unpin(&buffer);
        }
    }

    /// fsync of this object: the same as [`ObjectHandle::flush`].
    pub fn fsync(&self) -> Result<(), CacheError> {
        self.flush()
    }

    fn check_block(&self, block: u64) -> Result<(), CacheError> {
        if block < self.object.block_count {
            Ok(())
        } else {
            Err(CacheError::OutOfRange {
                object: self.object.name.clone(),
                offset: block * self.object.block_size_bytes as u64,
                length_bytes: self.object.block_size_bytes as u64,
                object_length_bytes: self.object.length_bytes,
            })
        }
    }
}

/// Placement of a block of a run: read-ahead (at or past the request's end) is placed
/// normally until a reader uses it; only blocks a no-reuse stream has consumed go to the
/// eviction end.
fn run_placement(placement: Placement, block: u64, request_end: u64) -> Placement {
    if block >= request_end {
        Placement::Normal
    } else {
        placement
    }
}

/// The part of a write's `data` that lands in `block`, and where in the block it starts.
fn piece_of<'a>(
    object: &ObjectState,
    block: u64,
    offset: u64,
    data: &'a [u8],
) -> (usize, &'a [u8]) {
    let block_size = object.block_size_bytes as u64;
    let block_start = block * block_size;
    let start = offset.max(block_start);
    let end = (offset + data.len() as u64).min(block_start + block_size);
    (
        (start - block_start) as usize,
        &data[(start - offset) as usize..(end - offset) as usize],
    )
}

/// Copies the part of `block`'s bytes that a read of `target.len()` bytes at `offset` wants.
fn copy_out(object: &ObjectState, block: u64, bytes: &[u8], offset: u64, target: &mut [u8]) {
    let block_size = object.block_size_bytes as u64;
    let block_start = block * block_size;
    let start = offset.max(block_start);
    let end = (offset + target.len() as u64).min(block_start + block_size);
    target[(start - offset) as usize..(end - offset) as usize]
        .copy_from_slice(&bytes[(start - block_start) as usize..(end - block_start) as usize]);
}
