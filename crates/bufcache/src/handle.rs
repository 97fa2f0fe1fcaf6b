//! Object handles: the byte-range calls the NBD server uses (read, write, flush, discard,
//! write-zeroes, extents, prefetch), built on the cache table, the object's state and
//! write-back. The BSD buffer calls (`getblk`, `bread`, …) are a thin layer over this in
//! module `bsd`.
//!
//! Invariants:
//! - a partial-block write reads the block first only when it is not cached;
//! - no buffer lock is held while waiting for space, and only buffer locks are held across
//!   device I/O;
//! - each [`ObjectHandle`] remembers the last write-back error sequence it reported, so every
//!   handle hears of every write-back error once (errseq).

use std::io::{IoSlice, IoSliceMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bufcache_policy::Placement;

use crate::buffer::{BlockKey, Buffer, DIRTY, READAHEAD, VALID, WRITTEN_BEHIND};
use crate::cache::{Cache, Inner, Urgency};
use crate::error::CacheError;
use crate::io::Io;
use crate::object::{ObjectConfig, ObjectState};
use crate::readahead::ReadaheadPlan;
use crate::stats::WritebackCause;
use crate::table::{Lookup, RunLookup};
use crate::writeback::LockMode;
use bufcache_device::aligned::AlignedBytes;
use bufcache_device::{Device, Extent, ReadMemory};

/// How [`ObjectHandle::zero`] may zero a range.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ZeroOptions {
    /// The device may deallocate the range (punch a hole) instead of storing zeroes; NBD's
    /// WRITE_ZEROES without NO_HOLE.
    pub may_deallocate: bool,
    /// Fail instead of writing zero bytes to the device; NBD's FAST_ZERO.
    pub fast_only: bool,
    /// The zeroes are durable when the call returns; NBD's FUA.
    pub fua: bool,
}

impl Cache {
    /// Registers an object (an export, a file) stored on `config.device` and returns a handle.
    pub fn open_object(&self, config: ObjectConfig) -> Result<ObjectHandle, CacheError> {
        let state = self.inner.add_object(config)?;
        Ok(ObjectHandle::new(self.clone(), state))
    }
}

/// A buffer held exclusively: what `getblk` and `bread` return. Dropping it releases it
/// (`brelse`); an invalid buffer (never filled) is discarded on release.
pub struct BufferGuard {
    inner: Arc<Inner>,
    buffer: Arc<Buffer>,
    discard_on_release: bool,
    /// The lock was let go and the pin is being released with others ([`release_guards`]):
    /// the drop does neither again.
    released: bool,
}

impl BufferGuard {
    /// The buffer held.
    pub(crate) fn buffer(&self) -> &Arc<Buffer> {
        &self.buffer
    }

    /// Keeps the buffer cached on release even if it was marked no-cache (bqrelse).
    pub(crate) fn keep_on_release(&mut self) {
        self.discard_on_release = false;
    }

    fn new(inner: &Arc<Inner>, _object: &Arc<ObjectState>, buffer: Arc<Buffer>) -> Self {
        BufferGuard {
            inner: Arc::clone(inner),
            buffer,
            discard_on_release: false,
            released: false,
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

    /// The bytes that exist on the device: the block, or less for a short last block.
    fn device_data_mut(&mut self) -> &mut [u8] {
        // SAFETY: the guard holds the buffer lock exclusively and borrows self mutably.
        unsafe { self.buffer.device_bytes_mut() }
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

impl BufferGuard {
    /// What a drop does before its unpin: a buffer never made valid (or marked no-cache
    /// and clean) leaves the table, and the lock is let go. Once only. True when reads were
    /// attached to the buffer while it was held: the caller runs them (`AttachedReads::wake`)
    /// once it holds nothing else.
    #[must_use]
    fn unlock_for_release(&mut self) -> bool {
        strict_assert!(
            !self.released,
            "guard of {:?} released twice",
            self.buffer.key
        );
        let drop_it =
            !self.buffer.has(VALID) || (self.discard_on_release && !self.buffer.has(DIRTY));
        if drop_it {
            self.inner.table().remove(&self.buffer);
        }
        // SAFETY: the guard holds the lock exclusively until now, and lets it go once
        // (`released` is set below, and a released guard's drop does nothing).
        unsafe { self.buffer.unlock_exclusive() };
        self.released = true;
        self.buffer.released_with_reads_attached()
    }
}

impl Drop for BufferGuard {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        let attached = self.unlock_for_release();
        self.inner.table().unpin(&self.buffer);
        if attached {
            self.inner.attached().wake(self.buffer.key);
        }
    }
}

/// Lets every guard of `guards` go as dropping them in order would, but unpins them together
/// ([`Table::unpin_run`]: a shard lock per chunk, not per block, for the buffers their last
/// unpin puts back on the policy's queues). Leaves `guards` empty.
fn release_guards(guards: &mut Vec<BufferGuard>) {
    let Some(inner) = guards.first().map(|guard| Arc::clone(&guard.inner)) else {
        return;
    };
    let mut attached: smallvec::SmallVec<[BlockKey; 4]> = smallvec::SmallVec::new();
    for guard in guards.iter_mut() {
        if guard.unlock_for_release() {
            attached.push(guard.buffer.key);
        }
    }
    inner
        .table()
        .unpin_run(guards.iter().map(|guard| &*guard.buffer));
    guards.clear();
    for key in attached {
        inner.attached().wake(key);
    }
}

/// A run of buffers held exclusively, lent to the device as one read's memory: the guards move
/// with the request and come back with its completion, so the memory lives as long as the
/// read does.
struct GuardRun(Vec<BufferGuard>);

impl Drop for GuardRun {
    fn drop(&mut self) {
        release_guards(&mut self.0);
    }
}

impl GuardRun {
    /// The guards, leaving the run empty.
    fn take(mut self) -> Vec<BufferGuard> {
        std::mem::take(&mut self.0)
    }
}

impl ReadMemory for GuardRun {
    fn slices_mut(&mut self) -> Vec<IoSliceMut<'_>> {
        self.0
            .iter_mut()
            .map(|guard| IoSliceMut::new(guard.device_data_mut()))
            .collect()
    }
}

/// Fills the slices of a write with its data, in order (see [`ObjectHandle::write_from`]).
pub type WriteSource<'a> = dyn FnMut(&mut [IoSliceMut<'_>]) -> std::io::Result<()> + 'a;

/// The byte range of one write, to cut it into block pieces.
#[derive(Clone, Copy)]
struct WriteRange {
    offset: u64,
    end_offset: u64,
}

impl WriteRange {
    /// Where in `block` the write starts, and how many of its bytes it covers.
    fn piece(&self, object: &ObjectState, block: u64) -> (usize, usize) {
        let block_size = object.block_size_bytes as u64;
        let block_start = block * block_size;
        let start = self.offset.max(block_start);
        let end = self.end_offset.min(block_start + block_size);
        ((start - block_start) as usize, (end - start) as usize)
    }
}

/// One byte-range read in progress.
struct ReadRequest<'a> {
    offset: u64,
    /// Where the bytes go; None when the read only makes its blocks resident.
    target: Option<&'a mut [u8]>,
    /// One past the request's last block.
    end: u64,
    /// How far a miss run may extend (the stream's read-ahead window).
    miss_limit: u64,
    placement: Placement,
    /// Set when a block was still being read ahead when the reader reached it.
    waited_for_readahead: bool,
    /// The request's blocks that were cached, looked up together; dropped before anything
    /// that may wait for space, so a reader never pins blocks it is not about to use then.
    cached: Option<RunLookup<'a>>,
}

/// Receives the bytes of a read ([`ObjectHandle::read_with`]): slices covering them, in order.
pub type ReadSink<'a> = dyn FnMut(&[IoSlice<'_>]) -> std::io::Result<()> + 'a;

/// What [`ObjectHandle::start_read`] runs when its read ends.
pub type StartedReadDone = Box<dyn FnOnce(Result<StartedRead, CacheError>) + Send>;

/// The bytes of a read [`ObjectHandle::start_read`] finished: the cache's own buffers, held
/// (writers and, for a read's own fill, other readers of these blocks wait) until this is
/// dropped.
pub struct StartedRead {
    object: Arc<ObjectState>,
    offset: u64,
    length_bytes: u64,
    first: u64,
    held: StartedHold,
}

/// How a [`StartedRead`] holds its blocks.
enum StartedHold {
    /// Filled by the read's own device request, held exclusively.
    Filled(Vec<BufferGuard>),
    /// Filled by another read it waited for (module `attached`), held shared.
    Shared(SharedRun),
}

impl Drop for StartedRead {
    fn drop(&mut self) {
        if let StartedHold::Filled(guards) = &mut self.held {
            release_guards(guards);
        }
    }
}

impl StartedRead {
    /// The bytes read, in order.
    pub fn slices(&self) -> Vec<IoSlice<'_>> {
        let blocks: Vec<&[u8]> = match &self.held {
            StartedHold::Filled(guards) => guards.iter().map(BufferGuard::data).collect(),
            StartedHold::Shared(run) => run.blocks().collect(),
        };
        let block_size = self.object.block_size_bytes as u64;
        let end_offset = self.offset + self.length_bytes;
        blocks
            .into_iter()
            .enumerate()
            .map(|(index, bytes)| {
                let block_start = (self.first + index as u64) * block_size;
                let start = self.offset.max(block_start) - block_start;
                let end = end_offset.min(block_start + block_size) - block_start;
                IoSlice::new(&bytes[start as usize..end as usize])
            })
            .collect()
    }
}

/// Buffers held shared and pinned, owning their hold (no borrow of a handle): what a started
/// read that waited for another's fill lends its caller.
struct SharedRun {
    inner: Arc<Inner>,
    buffers: Vec<Arc<Buffer>>,
}

impl SharedRun {
    /// Each buffer's bytes, in order.
    fn blocks(&self) -> impl Iterator<Item = &[u8]> {
        // SAFETY: every buffer is held shared for as long as `self`.
        self.buffers.iter().map(|buffer| unsafe { buffer.bytes() })
    }
}

impl Drop for SharedRun {
    fn drop(&mut self) {
        for buffer in &self.buffers {
            // SAFETY: the run owns one shared lock of each buffer, let go once, here.
            unsafe { buffer.unlock_shared() };
        }
        self.inner
            .table()
            .unpin_run(self.buffers.iter().map(|buffer| &**buffer));
    }
}

/// What holding a read's blocks found ([`ObjectHandle::hold_blocks`]).
enum Holding<'a> {
    /// Every block, valid and held shared.
    Held(ResidentRun<'a>),
    /// This block is held exclusively by someone (being read in, or written); nothing held.
    Busy(Arc<Buffer>),
    /// A block is not cached; nothing held.
    Absent,
}

/// A started read waiting for blocks another read is filling (module `attached`).
struct AttachedRead {
    handle: ObjectHandle,
    offset: u64,
    length_bytes: u64,
    first: u64,
    end: u64,
    placement: Placement,
    /// How many more times it may wait for a buffer before it gives itself back.
    attaches_left: u32,
    done: StartedReadDone,
}

/// Times one started read may wait for a buffer being filled before it gives itself back:
/// each wait ends with a fill, so a read waits at most once per run of read-ahead it spans
/// (a few), unless its blocks keep being evicted and read again.
const ATTACHES_PER_READ_MAX: u32 = 16;

impl AttachedRead {
    /// Answers the read if every block is in, else attaches it to the buffer still being
    /// filled (or, out of attaches or with a block gone, gives it back to its caller through
    /// `done`). True when it waits for read-ahead.
    fn serve_or_attach(mut self) -> bool {
        let handle = &self.handle;
        let busy = match handle.hold_blocks(self.first, self.end, self.placement, true) {
            Holding::Held(held) => {
                let started = StartedRead {
                    object: Arc::clone(&handle.object),
                    offset: self.offset,
                    length_bytes: self.length_bytes,
                    first: self.first,
                    held: StartedHold::Shared(held.into_shared()),
                };
                (self.done)(Ok(started));
                return false;
            }
            Holding::Busy(buffer) if self.attaches_left > 0 => buffer,
            Holding::Busy(_) | Holding::Absent => {
                (self.done)(Err(CacheError::ReadGivenBack));
                return false;
            }
        };
        self.attaches_left -= 1;
        let readahead = busy.has(READAHEAD);
        let inner = Arc::clone(self.handle.inner());
        let waiting: crate::attached::AttachedRead = Box::new(move || {
            self.serve_or_attach();
        });
        if let Err(waiting) = inner.attached().attach(&busy, waiting) {
            // Let go meanwhile, or no room to wait: look again now (with one attach fewer).
            waiting();
        }
        readahead
    }
}

/// A read after the stream table saw it: its blocks `[first, end)`, the read-ahead plan and
/// the policy placement of its blocks.
struct PlannedRead {
    first: u64,
    end: u64,
    plan: ReadaheadPlan,
    placement: Placement,
}

/// Every block of a read, held shared and pinned, in order from `first`.
struct ResidentRun<'a> {
    inner: &'a Arc<Inner>,
    first: u64,
    /// The lookup counted its blocks as hits (undone if the run is given up).
    counted: bool,
    buffers: Vec<SharedHold<'a>>,
}

impl ResidentRun<'_> {
    /// Slices of the held buffers covering `[offset, offset + length_bytes)`.
    fn slices(&self, object: &ObjectState, offset: u64, length_bytes: u64) -> Vec<IoSlice<'_>> {
        let block_size = object.block_size_bytes as u64;
        let end_offset = offset + length_bytes;
        self.buffers
            .iter()
            .enumerate()
            .map(|(index, hold)| {
                let block_start = (self.first + index as u64) * block_size;
                let start = offset.max(block_start) - block_start;
                let end = end_offset.min(block_start + block_size) - block_start;
                // SAFETY: the hold keeps the buffer locked shared for as long as `self`.
                let bytes = unsafe { hold.buffer.bytes() };
                IoSlice::new(&bytes[start as usize..end as usize])
            })
            .collect()
    }

    /// The same holds, owned: nothing is let go.
    fn into_shared(mut self) -> SharedRun {
        let buffers = self
            .buffers
            .drain(..)
            .map(|mut hold| {
                // The lock and pin pass to the shared run.
                hold.released = true;
                Arc::clone(&hold.buffer)
            })
            .collect();
        SharedRun {
            inner: Arc::clone(self.inner),
            buffers,
        }
    }

    /// Lets everything go without counting the hits: the read is served another way.
    fn release_uncounted(&mut self) {
        for hold in self.buffers.drain(..) {
            if self.counted {
                self.inner.table().uncount_hit(hold.buffer.key);
            }
        }
    }
}

/// A buffer held shared for reading, by the byte-range read path.
struct SharedHold<'a> {
    inner: &'a Inner,
    buffer: Arc<Buffer>,
    /// The shared lock was let go and the pin released with others (`ResidentRun`'s
    /// drop): the hold's own drop does neither again.
    released: bool,
}

impl<'a> SharedHold<'a> {
    fn new(inner: &'a Inner, buffer: Arc<Buffer>) -> Self {
        SharedHold {
            inner,
            buffer,
            released: false,
        }
    }
}

impl Drop for SharedHold<'_> {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        // SAFETY: the hold owns one shared lock, let go once (a released hold's drop does
        // nothing).
        unsafe { self.buffer.unlock_shared() };
        self.inner.table().unpin(&self.buffer);
    }
}

impl Drop for ResidentRun<'_> {
    /// Lets every hold go as their drops would, the unpins together ([`Table::unpin_run`]).
    fn drop(&mut self) {
        for hold in self.buffers.iter_mut() {
            // SAFETY: the hold owns one shared lock; `released` keeps its drop from
            // letting it go again.
            unsafe { hold.buffer.unlock_shared() };
            hold.released = true;
        }
        self.inner
            .table()
            .unpin_run(self.buffers.iter().map(|hold| &*hold.buffer));
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
        self.object.length_bytes()
    }

    /// Grows the object to `length_bytes` once its device holds that many (an export's
    /// clients see the new length from their next connection). Refused, nothing changed: a
    /// shrink, a length now or asked that is not a whole number of blocks, an object with a
    /// block map of its own, a device shorter than asked.
    pub fn grow(&self, length_bytes: u64) -> Result<(), CacheError> {
        self.object.grow(length_bytes)
    }

    /// True for a zero-length object.
    pub fn is_empty(&self) -> bool {
        self.object.length_bytes() == 0
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

    pub(crate) fn object(&self) -> &Arc<ObjectState> {
        &self.object
    }

    pub(crate) fn inner(&self) -> &Arc<Inner> {
        &self.cache.inner
    }

    /// Passes `result` through; an error returned to this handle now also counts as reported
    /// to it, so its next flush does not report the same latched error a second time.
    pub(crate) fn reported<T>(&self, result: Result<T, CacheError>) -> Result<T, CacheError> {
        if result.is_err() {
            self.object.mark_errors_seen(&self.seen_error_sequence);
        }
        result
    }

    // ----- byte-range API -----

    /// Reads `target.len()` bytes at `offset`, through the cache, with read-ahead for
    /// sequential streams and clustered device reads for runs of misses.
    pub fn read_at(&self, offset: u64, target: &mut [u8]) -> Result<(), CacheError> {
        self.object.check_range(offset, target.len() as u64)?;
        if target.is_empty() {
            return Ok(());
        }
        let planned = self.plan(offset, target.len() as u64);
        let waited = self.read_planned(offset, Some(target), &planned)?;
        self.finish_read(&planned, waited);
        Ok(())
    }

    /// Reads `target.len()` bytes at `offset` and hands them to `send` exactly once. When
    /// every block is cached and free to share, `send` gets slices of the cache's own
    /// buffers, held shared for the call (an NBD server writes its reply straight from them:
    /// no copy into a reply buffer); otherwise the bytes are read into `target` as by
    /// [`ObjectHandle::read_at`] and `send` gets that. A `send` failure is
    /// [`CacheError::DataSink`]. While `send` runs, writers of those blocks wait, so it must
    /// bound how long it blocks.
    pub fn read_with(
        &self,
        offset: u64,
        target: &mut [u8],
        send: &mut ReadSink<'_>,
    ) -> Result<(), CacheError> {
        self.object.check_range(offset, target.len() as u64)?;
        let length_bytes = target.len() as u64;
        if length_bytes == 0 {
            return send(&[]).map_err(|source| CacheError::DataSink { source });
        }
        let planned = self.plan(offset, length_bytes);
        let sent = match self.hold_resident(&planned, true) {
            Some(held) => {
                // Read-ahead first, so the device fetches the next window while the bytes go
                // out (it never touches the held blocks: they are cached).
                self.finish_read(&planned, false);
                send_held(&self.object, held, offset, length_bytes, send)
            }
            None => {
                // Bring every block in (waiting for fills, reading misses) without copying,
                // then lend them as above: the bytes cross memory once on their way out, not
                // twice. Nothing is held while the fill waits, as on every miss path; if a
                // block is evicted or taken for a write in between (a small cache under
                // pressure), the read is served by copying after all. The blocks are held
                // before read-ahead starts, so its buffers never evict them (a long stream's
                // blocks sit at the eviction end).
                let waited = self.read_planned(offset, None, &planned)?;
                let held = self.hold_resident(&planned, false);
                self.finish_read(&planned, waited);
                match held {
                    Some(held) => send_held(&self.object, held, offset, length_bytes, send),
                    None => {
                        self.read_planned_quietly(offset, target, &planned)?;
                        send(&[IoSlice::new(target)])
                    }
                }
            }
        };
        sent.map_err(|source| CacheError::DataSink { source })
    }

    /// Starts a read of `length_bytes` at `offset` whose blocks are all missing, over a device
    /// that completes requests on a thread of its own ([`Capabilities::completes_later`]:
    /// an NBD upstream), and returns without waiting. `done` runs on that thread with the
    /// bytes, in the cache's buffers, or with the error; the read counts, extends into
    /// read-ahead and starts further read-ahead as [`ObjectHandle::read_at`] would.
    ///
    /// So a server thread that reads requests need not wait for a miss, nor hand its
    /// reading to another thread first; nothing here waits (no space is waited for, and
    /// read-ahead the background cannot take now is skipped).
    ///
    /// A read whose blocks are all cached but some still being read in (read-ahead in
    /// flight, another request's miss) waits for them without a thread: it is attached to
    /// the buffer being filled, and whoever ends that fill (the device's completion thread)
    /// looks again and runs `done` once every block is in. Should a block be evicted or
    /// taken by a writer meanwhile, `done` gets [`CacheError::ReadGivenBack`] and the caller
    /// serves the read the usual way.
    ///
    /// Any other read (partly cached, longer than a cluster, a device whose reads finish in
    /// the caller's thread, no room without waiting) is not started: `done` comes back as
    /// `Err` and the caller reads as usual.
    ///
    /// [`Capabilities::completes_later`]: bufcache_device::Capabilities
    pub fn start_read(
        &self,
        offset: u64,
        length_bytes: u64,
        done: StartedReadDone,
    ) -> Result<(), StartedReadDone> {
        let object = &self.object;
        if length_bytes == 0
            || object.check_range(offset, length_bytes).is_err()
            || !self.inner().io().capabilities(object).completes_later
        {
            return Err(done);
        }
        let block_size = object.block_size_bytes as u64;
        let (first, end) = (
            offset / block_size,
            (offset + length_bytes).div_ceil(block_size),
        );
        let table = self.inner().table();
        if !table.run_absent(object.id, first, end) {
            if table.first_absent(object.id, first, end) < end {
                // Partly cached: the caller reads the rest as usual.
                return Err(done);
            }
            self.start_attached_read(offset, length_bytes, done);
            return Ok(());
        }
        if end - first > object.write_run_blocks_max(first) {
            return Err(done);
        }
        let planned = self.plan(offset, length_bytes);
        let limit = planned
            .plan
            .extend_to_block
            .max(planned.plan.window_end_block)
            .max(end);
        let inserted =
            self.inner()
                .insert_absent(object.key(first), object, planned.placement, true, false);
        let run = match inserted {
            Some(buffer) => self.collect_run(buffer, limit, end, planned.placement),
            None => Vec::new(),
        };
        if (run.len() as u64) < end - first {
            // Another reader got to a block first, or there is no room without waiting: the
            // caller reads as usual (and counts these blocks then).
            for guard in &run {
                self.inner().table().uncount_miss(guard.buffer.key);
            }
            return Err(done);
        }
        let readahead_blocks = run.len() as u64 - (end - first);
        let counters = self.inner().counters();
        counters
            .readahead_issued_blocks
            .fetch_add(readahead_blocks, Ordering::Relaxed);
        counters.reads_started.fetch_add(1, Ordering::Relaxed);
        let device_offset = object.map.map(first).device_offset;
        let handle = self.background_handle();
        let completion = move |run: GuardRun, result: std::io::Result<()>| {
            let started =
                handle.finish_started_read(run.take(), result, device_offset, offset, length_bytes);
            done(started);
        };
        let read = bufcache_device::ReadRequest::new(device_offset, GuardRun(run), completion);
        self.inner().io().start_read(object, read);
        self.start_planned_readahead_in_background(&planned);
        Ok(())
    }

    /// [`ObjectHandle::start_read`] of a read whose blocks are all cached, some still being
    /// filled: answered now if they are all in already, else attached to the first block
    /// still being filled. Read-ahead goes on as for any read.
    fn start_attached_read(&self, offset: u64, length_bytes: u64, done: StartedReadDone) {
        let planned = self.plan(offset, length_bytes);
        let read = AttachedRead {
            handle: self.background_handle(),
            offset,
            length_bytes,
            first: planned.first,
            end: planned.end,
            placement: planned.placement,
            attaches_left: ATTACHES_PER_READ_MAX,
            done,
        };
        if read.serve_or_attach() {
            // It caught up with read-ahead still in flight: the window did not cover the
            // device's latency (as for a reader that waits, `finish_read`).
            self.object
                .note_readahead_wait(planned.end, self.readahead_spare_blocks());
        }
        self.inner()
            .counters()
            .reads_attached
            .fetch_add(1, Ordering::Relaxed);
        self.start_planned_readahead_in_background(&planned);
    }

    /// The read-ahead [`ObjectHandle::finish_read`] starts, handed to the background; what
    /// it refuses is started here, which over a device that completes later (the only kind a
    /// read is started on) waits for nothing.
    fn start_planned_readahead_in_background(&self, planned: &PlannedRead) {
        let (end, plan) = (planned.end, &planned.plan);
        let windows = [
            (plan.extend_to_block > end).then_some((end, plan.extend_to_block)),
            plan.background,
        ];
        for (start, window_end) in windows.into_iter().flatten() {
            if self.blocks_resident(start, window_end) {
                continue;
            }
            let handle = self.background_handle();
            let job = Box::new(move || handle.fill_readahead(start, window_end));
            // Refused (the background queue is full): filled here after all, which waits for
            // nothing over a device that completes later (`fill_readahead` only starts its
            // reads). Skipping it cost a parallel copy through a small cache a third more
            // demand misses, each a device request of its own.
            if let Err(job) = self.inner().spawner().spawn(job) {
                job();
            }
        }
    }

    /// The completion of a read [`ObjectHandle::start_read`] started: counts it, marks its
    /// blocks valid and lends the requested ones; the read-ahead blocks after them are let go
    /// (cached). On failure nothing is kept.
    fn finish_started_read(
        &self,
        mut run: Vec<BufferGuard>,
        result: std::io::Result<()>,
        device_offset: u64,
        offset: u64,
        length_bytes: u64,
    ) -> Result<StartedRead, CacheError> {
        let counters = self.inner().counters();
        let block_size = self.object.block_size_bytes as u64;
        let first = offset / block_size;
        let end = (offset + length_bytes).div_ceil(block_size);
        if let Err(source) = result {
            // The caller serves a failed started read again (NBD does), and counts its
            // blocks then; nothing of it stays cached.
            for guard in run.iter().filter(|guard| guard.block() < end) {
                self.inner().table().uncount_miss(guard.buffer.key);
            }
            let run_bytes: u64 = run
                .iter()
                .map(|guard| guard.buffer.length_bytes as u64)
                .sum();
            let io = self.inner().io();
            return Err(io.error(&self.object, "read", device_offset, run_bytes, source));
        }
        if run.len() > 1 {
            counters.read_clusters.fetch_add(1, Ordering::Relaxed);
            counters
                .read_cluster_buffers
                .fetch_add(run.len() as u64, Ordering::Relaxed);
        }
        for guard in run.iter_mut() {
            guard.mark_valid();
        }
        // The read-ahead blocks after the request's are let go (cached) now.
        release_guards(&mut run.split_off((end - first) as usize));
        Ok(StartedRead {
            object: Arc::clone(&self.object),
            offset,
            length_bytes,
            first,
            held: StartedHold::Filled(run),
        })
    }

    /// Feeds the read of `[offset, offset + length_bytes)` to the stream table: what to read
    /// ahead, how far a miss may extend, and where its blocks go in the policy.
    fn plan(&self, offset: u64, length_bytes: u64) -> PlannedRead {
        let object = &self.object;
        let block_size = object.block_size_bytes as u64;
        let first = offset / block_size;
        let end = (offset + length_bytes).div_ceil(block_size);
        let spare_blocks = self.readahead_spare_blocks();
        let mut plan = object.plan_read(first, end, spare_blocks);
        // Windows end on a write unit, so an object-store chunk is fetched whole, once.
        if plan.extend_to_block > end {
            plan.extend_to_block = object.round_up_to_write_unit(plan.extend_to_block);
        }
        plan.window_end_block = object.round_up_to_write_unit(plan.window_end_block);
        if let Some((start, window_end)) = plan.background {
            plan.background = Some((start, object.round_up_to_write_unit(window_end)));
        }
        let placement = if plan.no_reuse && self.inner().config().noreuse_sequential {
            Placement::NoReuse
        } else {
            Placement::Normal
        };
        PlannedRead {
            first,
            end,
            plan,
            placement,
        }
    }

    /// Serves a planned read into `target`, or with None only makes every block resident
    /// (waiting for fills, reading misses); true when a block was still being read ahead.
    fn read_planned(
        &self,
        offset: u64,
        target: Option<&mut [u8]>,
        planned: &PlannedRead,
    ) -> Result<bool, CacheError> {
        self.read_planned_counting(offset, target, planned, Some(planned.placement))
    }

    /// [`ObjectHandle::read_planned`] into `target` for a read whose blocks were already
    /// counted: blocks found cached count no second hit (a block evicted since is read, and
    /// counted, again).
    fn read_planned_quietly(
        &self,
        offset: u64,
        target: &mut [u8],
        planned: &PlannedRead,
    ) -> Result<bool, CacheError> {
        self.read_planned_counting(offset, Some(target), planned, None)
    }

    fn read_planned_counting(
        &self,
        offset: u64,
        target: Option<&mut [u8]>,
        planned: &PlannedRead,
        use_placement: Option<Placement>,
    ) -> Result<bool, CacheError> {
        let (first, end) = (planned.first, planned.end);
        let mut request = ReadRequest {
            offset,
            target,
            end,
            // A miss inside the stream's issued window reads to the window's end itself: the
            // background job may not have reached those blocks yet.
            miss_limit: planned
                .plan
                .extend_to_block
                .max(planned.plan.window_end_block),
            placement: planned.placement,
            waited_for_readahead: false,
            cached: Some(self.inner().table().lookup_run(
                self.object.id,
                first,
                end,
                use_placement,
            )),
        };
        let mut block = first;
        while block < end {
            block = self.read_step(block, &mut request)?;
        }
        Ok(request.waited_for_readahead)
    }

    /// Blocks of this object's size that unused read-ahead may hold in the cache now.
    fn readahead_spare_blocks(&self) -> u64 {
        self.inner()
            .table()
            .readahead_spare_blocks(self.object.block_size_bytes as u64)
    }

    /// After a read: the latency signal and the read-ahead the plan asked for.
    fn finish_read(&self, planned: &PlannedRead, waited_for_readahead: bool) {
        let (end, plan) = (planned.end, &planned.plan);
        if waited_for_readahead {
            self.object
                .note_readahead_wait(end, self.readahead_spare_blocks());
        }
        if plan.extend_to_block > end {
            // The part of the synchronous window the request's own miss runs did not cover.
            self.start_readahead(end, plan.extend_to_block);
        }
        if let Some((start, window_end)) = plan.background {
            self.start_readahead(start, window_end);
        }
    }

    /// Holds every block of a planned read shared, if all are cached, valid and not held
    /// exclusively right now; None (holding nothing, counting no hits) otherwise. With
    /// `count` false the blocks were counted already (by the pass that made them resident)
    /// and this lookup counts no hits.
    fn hold_resident(&self, planned: &PlannedRead, count: bool) -> Option<ResidentRun<'_>> {
        match self.hold_blocks(planned.first, planned.end, planned.placement, count) {
            Holding::Held(held) => Some(held),
            Holding::Busy(_) | Holding::Absent => None,
        }
    }

    /// Holds every block of `[first, end)` shared, if all are cached, valid and not held
    /// exclusively right now, counting hits with `count` (false: counted already);
    /// otherwise holds nothing, counts nothing, and says why.
    fn hold_blocks(&self, first: u64, end: u64, placement: Placement, count: bool) -> Holding<'_> {
        let inner = self.inner();
        let table = inner.table();
        let mut cached = table.lookup_run(self.object.id, first, end, count.then_some(placement));
        let mut held = ResidentRun {
            inner,
            first,
            counted: count,
            buffers: Vec::with_capacity((end - first) as usize),
        };
        for block in first..end {
            let Some(buffer) = cached.take(block) else {
                held.release_uncounted();
                return Holding::Absent;
            };
            if !buffer.try_lock_shared() {
                let busy = Arc::clone(&buffer);
                cached.give_back(buffer);
                held.release_uncounted();
                return Holding::Busy(busy);
            }
            let hold = SharedHold::new(inner, buffer);
            if !hold.buffer.has(VALID) {
                // Its filler failed and removed it (an invalid buffer is only ever seen
                // held exclusively).
                held.buffers.push(hold);
                held.release_uncounted();
                return Holding::Absent;
            }
            held.buffers.push(hold);
        }
        // Read-ahead used for the first time: counted, and for a no-reuse stream demoted a
        // chunk at a time, in one pass with nothing allocated on this hit path.
        let mut used_readahead = 0u64;
        let newly_used = held
            .buffers
            .iter()
            .filter(|hold| hold.buffer.clear(READAHEAD))
            .map(|hold| {
                used_readahead += 1;
                &*hold.buffer
            });
        if placement == Placement::NoReuse {
            table.demote_run(newly_used);
        } else {
            newly_used.for_each(drop);
        }
        if used_readahead > 0 {
            inner
                .counters()
                .readahead_used_blocks
                .fetch_add(used_readahead, Ordering::Relaxed);
        }
        Holding::Held(held)
    }

    /// Serves `block` (and, on a miss, the run of missing blocks after it) and returns the
    /// next block to serve.
    fn read_step<'a>(
        &'a self,
        block: u64,
        request: &mut ReadRequest<'a>,
    ) -> Result<u64, CacheError> {
        let inner = self.inner();
        let key = self.object.key(block);
        let found = match request
            .cached
            .as_mut()
            .and_then(|cached| cached.take(block))
        {
            Some(buffer) => Lookup::Found(buffer),
            None => {
                request.cached = None;
                match inner.lookup_or_try_insert(key, &self.object, request.placement) {
                    Some(found) => found,
                    None => {
                        if let Some(next) = self.read_streaming(block, request)? {
                            return Ok(next);
                        }
                        inner.lookup_or_insert(
                            key,
                            &self.object,
                            request.placement,
                            Urgency::Wait,
                        )?
                    }
                }
            }
        };
        match found {
            Lookup::Found(buffer) => {
                if !buffer.try_lock_shared() {
                    // Held exclusively: being filled. If by read-ahead, the window did not
                    // cover the device's latency.
                    request.waited_for_readahead |= buffer.has(READAHEAD);
                    buffer.lock_shared();
                }
                let hold = SharedHold::new(inner, buffer);
                if !hold.buffer.has(VALID) {
                    // The reader that inserted it failed and removed it: look again.
                    return Ok(block);
                }
                // A load first: the flag is set only on a buffer being filled, never on one
                // held shared, and most hits find it clear (an atomic clear is a
                // read-modify-write even then).
                if hold.buffer.has(READAHEAD) && hold.buffer.clear(READAHEAD) {
                    inner
                        .counters()
                        .readahead_used_blocks
                        .fetch_add(1, Ordering::Relaxed);
                    if request.placement == Placement::NoReuse {
                        inner.table().demote(&hold.buffer);
                    }
                }
                if let Some(target) = request.target.as_deref_mut() {
                    // SAFETY: shared lock held by `hold`.
                    let bytes = unsafe { hold.buffer.bytes() };
                    copy_out(&self.object, block, bytes, request.offset, target);
                }
                Ok(block + 1)
            }
            Lookup::Inserted(buffer) => {
                let end = request.end;
                let run_end = request.miss_limit.max(end);
                let mut run = self.read_run(buffer, run_end, end, request.placement)?;
                let served_end = (block + run.len() as u64).min(end);
                if let Some(target) = request.target.as_deref_mut() {
                    for guard in &run[..(served_end - block) as usize] {
                        let (block, bytes) = (guard.block(), guard.data());
                        copy_out(&self.object, block, bytes, request.offset, target);
                    }
                }
                release_guards(&mut run);
                if served_end < end {
                    request.cached = Some(inner.table().lookup_run(
                        self.object.id,
                        served_end,
                        end,
                        Some(request.placement),
                    ));
                }
                Ok(served_end)
            }
        }
    }

    /// Serves the request's blocks from `block` on, while they are absent from the cache
    /// (at most one cluster, within one contiguous device run), with one device read into
    /// the caller's memory, caching nothing (rule 4 of "Admission under pressure" in
    /// docs/design.md): called when `block` found no room without evicting what others use.
    /// Returns the next block to serve, or None when the read could not stream and the
    /// caller should wait for space as before: the device bytes were not the newest (a
    /// write of them in flight, a block cached meanwhile, a discard or zeroing dropping
    /// dirty blocks) or a block is cached after all.
    ///
    /// A read that only makes its blocks resident (no target: [`ObjectHandle::read_with`]'s
    /// first pass) stops at once instead; its copying pass streams.
    fn read_streaming(
        &self,
        block: u64,
        request: &mut ReadRequest<'_>,
    ) -> Result<Option<u64>, CacheError> {
        let Some(target) = request.target.as_deref_mut() else {
            return Ok(Some(request.end));
        };
        let inner = self.inner();
        let object = &self.object;
        let table = inner.table();
        let run_limit = (block + object.write_run_blocks_max(block))
            .min(request.end)
            .min(object.block_count());
        let stop = table.first_present(object.id, block, run_limit);
        if stop == block {
            // Cached meanwhile: the caller's next look finds it.
            return Ok(Some(block));
        }
        let block_size = object.block_size_bytes as u64;
        let alignment = inner.io().capabilities(object).alignment_bytes.max(1);
        // The run's bytes in the object and what the target covers of them: whole blocks
        // in the middle are read straight into the target; a block the target covers only
        // in part (the first or last), or a middle the device cannot use as it is
        // (alignment), is read into a bounce buffer and copied.
        let run_start = block * block_size;
        let run_end = (stop - 1) * block_size + object.block_length_bytes(stop - 1) as u64;
        let target_start = request.offset;
        let target_end = request.offset + target.len() as u64;
        let whole_start = if run_start >= target_start {
            run_start
        } else {
            run_start + block_size
        };
        let whole_end = if run_end <= target_end {
            run_end
        } else {
            (stop - 1) * block_size
        };
        let direct = whole_start < whole_end && {
            let middle = &target[(whole_start - target_start) as usize..];
            (middle.as_ptr() as usize).is_multiple_of(alignment)
                && (whole_end - whole_start).is_multiple_of(alignment as u64)
        };
        // [run_start, middle_start) and [middle_end, run_end) go through bounce buffers.
        let (middle_start, middle_end) = if direct {
            (whole_start, whole_end)
        } else {
            (run_end, run_end)
        };
        let bounce = |from: u64, to: u64| {
            (from < to).then(|| AlignedBytes::zeroed((to - from) as usize, alignment))
        };
        let mut head = bounce(run_start, middle_start);
        let mut tail = bounce(middle_end, run_end);
        let middle: &mut [u8] = if direct {
            &mut target
                [(middle_start - target_start) as usize..(middle_end - target_start) as usize]
        } else {
            &mut []
        };
        let mut slices: smallvec::SmallVec<[IoSliceMut<'_>; 3]> = smallvec::SmallVec::new();
        if let Some(head) = head.as_deref_mut() {
            slices.push(IoSliceMut::new(head));
        }
        if !middle.is_empty() {
            slices.push(IoSliceMut::new(middle));
        }
        if let Some(tail) = tail.as_deref_mut() {
            slices.push(IoSliceMut::new(tail));
        }
        let device_offset = object.map.map(block).device_offset;
        let streamed = inner
            .io()
            .read_unguarded_if(object, &mut slices, device_offset, || {
                !object.replace_in_flight() && table.first_present(object.id, block, stop) == stop
            })?;
        drop(slices);
        if !streamed {
            return Ok(None);
        }
        for (from, bytes) in [(run_start, head), (middle_end, tail)] {
            if let Some(bytes) = bytes {
                copy_range_out(from, &bytes, target_start, target);
            }
        }
        table.count_misses(object.id, block, stop);
        let counters = inner.counters();
        counters.streamed_reads.fetch_add(1, Ordering::Relaxed);
        counters
            .streamed_blocks
            .fetch_add(stop - block, Ordering::Relaxed);
        Ok(Some(stop))
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
        // One cluster within one contiguous device run, ending on a write unit when the
        // device has one (an object-store chunk read with one GET, not in pieces).
        let run_limit = limit
            .min(start + object.write_run_blocks_max(start))
            .min(object.block_count());
        let rest = inner.insert_absent_run(object, start + 1, run_limit, request_end, |block| {
            (
                run_placement(placement, block, request_end),
                block < request_end,
            )
        });
        let mut run = Vec::with_capacity(1 + rest.len());
        run.push(BufferGuard::new(inner, object, first));
        for buffer in rest {
            if buffer.key.block >= request_end {
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
            .counters()
            .readahead_issued_blocks
            .fetch_add(readahead, Ordering::Relaxed);
        Ok(())
    }

    /// One vectored device read into every buffer of `run`. On failure nothing is marked
    /// valid, so dropping the guards removes every buffer: a failed read caches nothing.
    pub(crate) fn device_read(
        &self,
        run: &mut [BufferGuard],
        device_offset: u64,
    ) -> Result<(), CacheError> {
        let inner = self.inner();
        let mut slices: Vec<IoSliceMut<'_>> = run
            .iter_mut()
            .map(|guard| IoSliceMut::new(guard.device_data_mut()))
            .collect();
        inner.io().read(&self.object, &mut slices, device_offset)?;
        drop(slices);
        if run.len() > 1 {
            inner
                .counters()
                .read_clusters
                .fetch_add(1, Ordering::Relaxed);
            inner
                .counters()
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
        if self.blocks_resident(start, end) {
            // Queue nothing for a window already cached (the hot path of a sequential reader).
            return;
        }
        let handle = self.background_handle();
        let job = Box::new(move || handle.fill_readahead(start, end));
        if let Err(job) = self.inner().spawner().spawn(job) {
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
            // Cached blocks are skipped a chunk per probe: a window the reader's own misses
            // already read (it caught up with read-ahead still queued) would otherwise cost a
            // probe per block.
            block = inner.table().first_absent(self.object.id, block, end);
            if block == end {
                break;
            }
            let Some(buffer) = inner.insert_absent(
                self.object.key(block),
                &self.object,
                Placement::Normal,
                false,
                true,
            ) else {
                if inner.table().contains(self.object.key(block)) {
                    // Another thread inserted it meanwhile: go on after it.
                    block += 1;
                    continue;
                }
                // No room without evicting read-ahead not yet used: under pressure the
                // window ends here instead (docs/design.md, "Admission under pressure").
                break;
            };
            buffer.set(READAHEAD);
            let run = self.collect_run(buffer, end, block, Placement::Normal);
            block += run.len() as u64;
            runs.push(run);
        }
        // Over a device that completes requests later (an NBD upstream) the runs are only
        // started, however few: the caller may be a server thread reading requests.
        let io = inner.io();
        if (runs.len() > 1 && io.serves_requests_in_parallel(&self.object))
            || io.capabilities(&self.object).completes_later
        {
            return self.read_runs_together(runs);
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
            if let Err(job) = self.inner().spawner().spawn(job) {
                job();
            }
        }
        let start = first[0].block();
        let _ = self.read_collected(&mut first, start);
    }

    /// Reads every run of a read-ahead window as one batch of device requests, for a device
    /// that serves several at once (an object store, an NBD upstream, a file's worker pool):
    /// the whole window is in flight together, however few background threads there are,
    /// and this thread does not wait for it. Each run's blocks become valid when its own read
    /// ends; a failed run is dropped unread, which removes its buffers, as in
    /// `fill_readahead`.
    fn read_runs_together(&self, runs: Vec<Vec<BufferGuard>>) {
        let reads = runs
            .into_iter()
            .map(|run| {
                let device_offset = self.object.map.map(run[0].block()).device_offset;
                let handle = self.background_handle();
                bufcache_device::ReadRequest::new(
                    device_offset,
                    GuardRun(run),
                    move |mut run: GuardRun, result: std::io::Result<()>| {
                        if result.is_ok() {
                            handle.finish_readahead_run(&mut run.0);
                        }
                    },
                )
            })
            .collect();
        self.inner().io().start_reads(&self.object, reads);
    }

    /// Counts a read-ahead run the device filled and marks its blocks valid (its guards,
    /// dropped next, then leave them cached).
    fn finish_readahead_run(&self, run: &mut [BufferGuard]) {
        let counters = self.inner().counters();
        counters
            .readahead_issued_blocks
            .fetch_add(run.len() as u64, Ordering::Relaxed);
        if run.len() > 1 {
            counters.read_clusters.fetch_add(1, Ordering::Relaxed);
            counters
                .read_cluster_buffers
                .fetch_add(run.len() as u64, Ordering::Relaxed);
        }
        for guard in run.iter_mut() {
            guard.mark_valid();
        }
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

    /// True when the byte range is in the cache now, so reading it will not wait for the
    /// device (a hint: it may change at once). A block still being read in counts: a server
    /// serves such a read on the thread that reads requests, which then waits for the fill
    /// before it takes the client's next request (see rule 7 of "Admission under pressure"
    /// in docs/design.md for why that is kept). Every block is checked, one table probe per
    /// chunk of 16 blocks, for ranges of up to 64 chunks; longer ranges are sampled by whole
    /// chunks (see `Table::run_present`).
    pub fn is_resident(&self, offset: u64, length_bytes: u64) -> bool {
        if self.object.check_range(offset, length_bytes).is_err() || length_bytes == 0 {
            return false;
        }
        let block_size = self.object.block_size_bytes as u64;
        let first = offset / block_size;
        let end = (offset + length_bytes).div_ceil(block_size);
        self.blocks_resident(first, end)
    }

    /// Whether blocks `[first, end)` are cached or being read in (see `is_resident`).
    fn blocks_resident(&self, first: u64, end: u64) -> bool {
        /// 64 chunks of 16 blocks: a 4 MiB range of 4 KiB blocks is checked exactly.
        const CHECKED_CHUNKS_MAX: u64 = 64;
        self.inner()
            .table()
            .run_present(self.object.id, first, end, CHECKED_CHUNKS_MAX)
    }

    /// True when a write of the byte range will complete without waiting for the device: no
    /// FUA, the dirty data stays under the throttling limit, and a block the write covers
    /// only in part is cached (so it need not be read first). A hint, like `is_resident`.
    pub fn write_is_quick(&self, offset: u64, length_bytes: u64, fua: bool) -> bool {
        let object = &self.object;
        if fua || object.read_only || object.check_range(offset, length_bytes).is_err() {
            return false;
        }
        let inner = self.inner();
        let (_, limit) = inner.writeback().dirty_thresholds();
        if inner.writeback().dirty_bytes() + length_bytes > limit {
            return false;
        }
        let block_size = object.block_size_bytes as u64;
        let end_offset = offset + length_bytes;
        let partial_head = !offset.is_multiple_of(block_size);
        let partial_tail =
            !end_offset.is_multiple_of(block_size) && end_offset != object.length_bytes();
        let resident = |block: u64| inner.table().contains(object.key(block));
        (!partial_head || resident(offset / block_size))
            && (!partial_tail || resident(end_offset / block_size))
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
                    self.inner().table().unpin(&buffer);
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
        let mut copied = 0usize;
        let mut copy_in = |slices: &mut [IoSliceMut<'_>]| {
            for slice in slices.iter_mut() {
                let length = slice.len();
                slice.copy_from_slice(&data[copied..copied + length]);
                copied += length;
            }
            Ok(())
        };
        self.write_from(offset, data.len() as u64, fua, &mut copy_in)
    }

    /// Writes `length_bytes` at `offset` whose data `source` puts straight into the cache's
    /// buffers: it is called with slices covering the next bytes of the write, in order, and
    /// must fill them all (an NBD server reads the socket into them: the one copy between the
    /// socket and the cache). Blocks are taken in groups of up to `WRITE_GROUP_BLOCKS_MAX`:
    /// the group's first block may wait for space; the rest join only if they are cached or
    /// space is free at once, so no buffer lock is held while waiting. Each group is marked
    /// dirty with one update of the dirty index.
    ///
    /// If `source` fails, the write is torn, as an unacknowledged write may be: blocks that
    /// were cached keep whatever the source wrote into them (and are dirty), blocks that were
    /// not are dropped, so no byte the client never sent replaces data on the device. The
    /// error is [`CacheError::DataSource`]. A source that panics tears the write the same
    /// way, and its panic then continues to the caller.
    pub fn write_from(
        &self,
        offset: u64,
        length_bytes: u64,
        fua: bool,
        source: &mut WriteSource<'_>,
    ) -> Result<(), CacheError> {
        let object = &self.object;
        object.check_writable()?;
        object.check_range(offset, length_bytes)?;
        if length_bytes == 0 {
            return Ok(());
        }
        self.reported(self.inner().writeback().throttle_writer(object))?;
        let block_size = object.block_size_bytes as u64;
        let first = offset / block_size;
        let end = (offset + length_bytes).div_ceil(block_size);
        let range = WriteRange {
            offset,
            end_offset: offset + length_bytes,
        };
        let mut block = first;
        let mut rewritten_blocks = 0;
        while block < end {
            let (next, rewritten) = self.write_group(block, end, range, source)?;
            block = next;
            rewritten_blocks += rewritten;
        }
        if fua {
            self.reported(self.write_through(first, end))?;
        } else if self.inner().config().write_behind && !self.absorbs(rewritten_blocks, first, end)
        {
            self.write_behind(first, end);
        }
        Ok(())
    }

    /// Writes one group of blocks starting at `block` (see `write_from`); returns the next
    /// block to write, and how many of the group's blocks write-behind had written before.
    fn write_group(
        &self,
        block: u64,
        end: u64,
        range: WriteRange,
        source: &mut WriteSource<'_>,
    ) -> Result<(u64, u64), CacheError> {
        const WRITE_GROUP_BLOCKS_MAX: u64 = 256;
        /// Blocks of a write group looked up at once: one chunk of the table.
        const WRITE_LOOKUP_BLOCKS: u64 = 16;
        let group_end = end.min(block + WRITE_GROUP_BLOCKS_MAX);
        let mut group: Vec<(BufferGuard, bool)> = Vec::with_capacity((group_end - block) as usize);
        let (within, length) = range.piece(&self.object, block);
        let whole = length == self.object.block_length_bytes(block) as usize;
        // The first block may wait for space, so nothing else is pinned yet.
        group.push(self.acquire_for_write(block, whole)?);
        // The rest are looked up a window at a time (a chunk's blocks share a probe and a
        // shard lock): under pressure a group often ends after a block or two, and a look
        // over all of it at every group made a large write quadratic in its blocks.
        let lookup_window = |from: u64| {
            let window_end = group_end.min(from + WRITE_LOOKUP_BLOCKS);
            let lookup = self.inner().table().lookup_run(
                self.object.id,
                from,
                window_end,
                Some(Placement::Normal),
            );
            (lookup, window_end)
        };
        let (mut cached, mut window_end) = lookup_window(block + 1);
        let mut next = block + 1;
        while next < group_end {
            if next >= window_end {
                (cached, window_end) = lookup_window(next);
            }
            let joined = match cached.take(next) {
                Some(buffer) => self.try_acquire_cached_for_write(buffer, &mut group),
                None => self.insert_for_write(next, group_end, range, &cached, &mut group),
            };
            if joined == 0 {
                break;
            }
            next += joined;
        }
        let mut slices: Vec<IoSliceMut<'_>> = Vec::with_capacity(group.len());
        for (index, (guard, _)) in group.iter_mut().enumerate() {
            let piece_block = block + index as u64;
            let (start, length) = if index == 0 {
                (within, length)
            } else {
                range.piece(&self.object, piece_block)
            };
            slices.push(IoSliceMut::new(
                &mut guard.data_mut()[start..start + length],
            ));
        }
        // A source that panics is treated as one that failed, and the panic goes on once the
        // group's bookkeeping is done: blocks it may have written into are kept dirty, as
        // after an error, instead of keeping new bytes while marked clean.
        let filled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| source(&mut slices)));
        drop(slices);
        let (filled, panic) = match filled {
            Ok(filled) => (filled, None),
            Err(panic) => (
                Err(std::io::Error::other("the data source panicked")),
                Some(panic),
            ),
        };
        if filled.is_ok() {
            // Blocks never cached before become valid only now that they are filled. If the
            // source failed they stay invalid and their guards drop them, so no byte nobody
            // sent — stale pool memory — is ever cached or written.
            for (guard, fresh) in group.iter_mut() {
                if *fresh {
                    guard.mark_valid();
                }
            }
        }
        let written: Vec<&Buffer> = group
            .iter()
            .filter(|(guard, _)| guard.is_valid())
            .map(|(guard, _)| guard.buffer().as_ref())
            .collect();
        self.inner()
            .writeback()
            .mark_dirty_all(&self.object, &written);
        drop(written);
        let next = block + group.len() as u64;
        let rewritten = group
            .iter()
            .filter(|(guard, fresh)| !fresh && guard.buffer().has(WRITTEN_BEHIND))
            .count() as u64;
        drop(group);
        drop(cached);
        if let Some(panic) = panic {
            std::panic::resume_unwind(panic);
        }
        filled.map_err(|source| CacheError::DataSource { source })?;
        Ok((next, rewritten))
    }

    /// Holds `block` exclusively with valid contents, or — when the caller overwrites it
    /// whole — contents the caller is about to replace. True with it when the block was not
    /// cached: it stays invalid until the caller has filled it and marks it valid.
    fn acquire_for_write(
        &self,
        block: u64,
        whole: bool,
    ) -> Result<(BufferGuard, bool), CacheError> {
        let guard = self.hold_exclusive(block)?;
        self.make_writable(guard, whole)
    }

    /// Joins a cached block (pinned by the group's lookup) to a group whose earlier blocks
    /// are held, without waiting for its lock; pushes it and returns 1, or 0 when the group
    /// ends here.
    fn try_acquire_cached_for_write(
        &self,
        buffer: Arc<Buffer>,
        group: &mut Vec<(BufferGuard, bool)>,
    ) -> u64 {
        let inner = self.inner();
        if !buffer.try_lock_exclusive() {
            inner.table().unpin(&buffer);
            return 0;
        }
        let guard = BufferGuard::new(inner, &self.object, buffer);
        // Invalid once locked: a failed reader took it out of the table, and data written
        // into it would be lost. The group ends; the next one looks again.
        if !guard.is_valid() {
            return 0;
        }
        group.push((guard, false));
        1
    }

    /// Joins the blocks from `block` on that the group's lookup (`cached`) found absent and
    /// the write covers whole, inserting them a chunk at a time without waiting for space;
    /// pushes them as fresh (invalid until the write fills them) and returns how many
    /// joined. A new block the write covers in part would have to be read first, so it ends
    /// the group.
    fn insert_for_write(
        &self,
        block: u64,
        group_end: u64,
        range: WriteRange,
        cached: &RunLookup<'_>,
        group: &mut Vec<(BufferGuard, bool)>,
    ) -> u64 {
        let object = &self.object;
        let whole = |block: u64| {
            let (_, length) = range.piece(object, block);
            length == object.block_length_bytes(block) as usize
        };
        let stretch_end = (block..group_end)
            .find(|&next| cached.holds(next) || !whole(next))
            .unwrap_or(group_end);
        let inner = self.inner();
        let fresh = inner.insert_absent_run(object, block, stretch_end, u64::MAX, |_| {
            (Placement::Normal, true)
        });
        let joined = fresh.len() as u64;
        for buffer in fresh {
            group.push((BufferGuard::new(inner, object, buffer), true));
        }
        joined
    }

    /// Completes holding a block for writing: valid as it is, read from the device first
    /// when the caller overwrites it in part, or — when the caller overwrites it whole —
    /// left invalid and returned with `true` (fresh): `write_group` marks it valid once
    /// filled.
    fn make_writable(
        &self,
        guard: BufferGuard,
        whole: bool,
    ) -> Result<(BufferGuard, bool), CacheError> {
        if guard.is_valid() {
            return Ok((guard, false));
        }
        if whole {
            return Ok((guard, true));
        }
        let mut run = vec![guard];
        let device_offset = self.object.map.map(run[0].block()).device_offset;
        self.device_read(&mut run, device_offset)?;
        Ok((run.pop().expect("one guard"), false))
    }

    /// Holds `block` exclusively: a cached valid buffer, or a newly inserted invalid one.
    /// A buffer found invalid was being filled by a reader that failed and removed it, so
    /// the block is looked up again.
    pub(crate) fn hold_exclusive(&self, block: u64) -> Result<BufferGuard, CacheError> {
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

    pub(crate) fn mark_dirty(&self, guard: &BufferGuard) {
        guard.buffer.set(VALID);
        self.inner()
            .writeback()
            .mark_dirty(&self.object, &guard.buffer);
    }

    /// Writes the dirty blocks of `[first, end)` to the device now and flushes it (FUA).
    fn write_through(&self, first: u64, end: u64) -> Result<(), CacheError> {
        self.inner().writeback().write_range(
            &self.object,
            first,
            end,
            LockMode::Wait,
            WritebackCause::Flush,
        )?;
        self.inner().writeback().flush_device(&self.object)
    }

    /// Whether a write of `[first, end)` that found `rewritten_blocks` of its blocks already
    /// written behind once is left dirty rather than written behind. A write whose every
    /// block write-behind wrote before rewrites hot data: while dirty data is under the
    /// background threshold it is left to that threshold, age and flushes, so a region
    /// rewritten over and over reaches the device once per flush or age, not once per
    /// rewrite (as the kernel's page cache does for a server without a cache of its own).
    fn absorbs(&self, rewritten_blocks: u64, first: u64, end: u64) -> bool {
        rewritten_blocks == end - first && self.inner().writeback().absorbs_rewrites()
    }

    /// Queues write-back of every cluster this write completed (all its blocks dirty).
    pub(crate) fn write_behind(&self, first: u64, end: u64) {
        /// A write-behind job starts once this much is queued (or 1/16 of the cache, if
        /// less): one hand-off per batch.
        const WRITE_BEHIND_BATCH_BYTES: u64 = 4 << 20;
        let object = &self.object;
        let batch_bytes =
            WRITE_BEHIND_BATCH_BYTES.min(self.inner().table().memory_bytes_max() / 16);
        let batch_blocks = (batch_bytes / object.block_size_bytes as u64).max(1);
        let cluster = object.cluster_blocks;
        let mut cluster_start = first / cluster * cluster;
        while cluster_start < end {
            let cluster_end = (cluster_start + cluster).min(object.block_count());
            let completed = cluster_end <= end && cluster_end > first;
            if completed
                && object.dirty.lock().count(cluster_start..cluster_end)
                    == cluster_end - cluster_start
                && object.queue_write_behind(cluster_start, cluster_end, batch_blocks)
            {
                self.start_write_behind_job();
            }
            cluster_start += cluster;
        }
    }

    /// Starts the object's write-behind job, which writes queued clusters until the queue is
    /// empty. Errors are latched on the object and reported by the next flush.
    fn start_write_behind_job(&self) {
        let inner = Arc::clone(self.inner());
        let target = Arc::clone(&self.object);
        let job = Box::new(move || {
            while let Some((start, end)) = target.next_write_behind() {
                let _ = inner.writeback().write_range(
                    &target,
                    start,
                    end,
                    LockMode::Try,
                    WritebackCause::WriteBehind,
                );
            }
        });
        if self.inner().spawner().spawn(job).is_err() {
            // No worker free: this job never runs, so end it here. The queued clusters are
            // left dirty for the background writer (and for running jobs).
            self.object.end_write_behind_job();
        }
    }

    /// Over a slow device, starts helper jobs that write back shares of the dirty blocks
    /// while this thread does its own pass, so several device writes are in flight instead
    /// of one. They only ever take blocks nobody holds; the flush itself still walks every
    /// dirty block and waits for each write in flight (a helper's too) before it flushes the
    /// device, so its answer does not depend on them.
    fn start_flush_helpers(&self, dirtied_by_ns: u64) {
        /// A helper is worth starting for at least this many dirty blocks.
        const BLOCKS_PER_HELPER_MIN: usize = 4;
        let wanted = self.inner().writeback().flush_helpers_wanted(&self.object);
        if wanted == 0 {
            return;
        }
        let starts: Vec<u64> = {
            let dirty = self.object.dirty.lock();
            let helpers = wanted.min(dirty.len() / BLOCKS_PER_HELPER_MIN);
            if helpers == 0 {
                return;
            }
            // One share per helper plus this thread's, of about equal block counts; share 0
            // (from the start) is this thread's, and its pass goes on into the others'.
            // Shares start on cluster boundaries: a share starting inside a cluster would
            // write that cluster in two requests (the dd demonstration's 86 × 1 MiB writes
            // became 87 when a share began mid-cluster).
            let step = dirty.len().div_ceil(helpers + 1);
            let cluster = self.object.cluster_blocks;
            let mut starts: Vec<u64> = dirty
                .blocks()
                .step_by(step)
                .map(|block| block / cluster * cluster)
                .collect();
            starts.dedup();
            starts
        };
        for (index, &start) in starts.iter().enumerate().skip(1) {
            let end = starts.get(index + 1).copied().unwrap_or(u64::MAX);
            let inner = Arc::clone(self.inner());
            let object = Arc::clone(&self.object);
            let job = Box::new(move || {
                // Errors are latched on the object and reported by the flush.
                let _ = inner.writeback().write_range_dirtied_by(
                    &object,
                    start,
                    end,
                    dirtied_by_ns,
                    LockMode::Try,
                    WritebackCause::Flush,
                );
            });
            if self.inner().spawner().spawn(job).is_err() {
                // No worker free: the flush's own pass writes this share.
                break;
            }
        }
    }

    /// Writes every dirty block of this object back and flushes the device. Every write that
    /// completed before this call is durable when it returns `Ok`. Reports this handle's
    /// unseen write-back errors once.
    pub fn flush(&self) -> Result<(), CacheError> {
        let started_ns = self.inner().writeback().now_ns();
        self.start_flush_helpers(started_ns);
        let result = self
            .inner()
            .writeback()
            .fsync_dirtied_by(&self.object, started_ns);
        let unseen = self.object.unseen_error(&self.seen_error_sequence);
        result?;
        unseen.map_or(Ok(()), Err)
    }

    /// Drops the clean cached blocks overlapping `[offset, offset + length_bytes)` (clipped to
    /// the object), so the next read of them asks the device again: for a device whose data
    /// changed under the cache (a read replica that refreshed). Dirty blocks are kept. A read
    /// of such a block in flight holds its buffer, so it finishes first and is dropped too.
    pub fn forget_clean(&self, offset: u64, length_bytes: u64) {
        let block_size = self.object.block_size_bytes as u64;
        assert!(block_size > 0);
        let first = offset / block_size;
        let end = offset
            .saturating_add(length_bytes)
            .div_ceil(block_size)
            .min(self.object.block_count());
        if first < end {
            self.invalidate_blocks(first, end, false);
        }
    }

    /// Drops cached blocks wholly inside the range and tells the device the range is unused.
    /// Blocks partly inside keep their data (a discard is advisory).
    pub fn discard(&self, offset: u64, length_bytes: u64) -> Result<(), CacheError> {
        self.object.check_writable()?;
        self.object.check_range(offset, length_bytes)?;
        let (first, end) = self.whole_blocks(offset, length_bytes);
        self.replace_on_device(first, end, |io, object, at, length| {
            io.discard(object, at, length)
        })
    }

    /// Makes the range read as zeroes, durable on return with `fua`. The same as
    /// [`ObjectHandle::zero`] with the device allowed to deallocate and no demand for speed.
    pub fn write_zeroes(
        &self,
        offset: u64,
        length_bytes: u64,
        fua: bool,
    ) -> Result<(), CacheError> {
        let options = ZeroOptions {
            may_deallocate: true,
            fast_only: false,
            fua,
        };
        self.zero(offset, length_bytes, options)
    }

    /// True when zeroing whole blocks costs the device no data transfer (a hole, a protocol
    /// command), so a caller asking for a fast zero can be served.
    pub fn can_zero_fast(&self) -> bool {
        self.inner()
            .io()
            .capabilities(&self.object)
            .write_zeroes_fast
    }

    /// Makes the range read as zeroes. The one place that decides how: whole blocks are
    /// zeroed on the device when that is cheap and deallocation is allowed (they leave the
    /// cache), everything else — partial blocks, or all of it when the device would have to
    /// write zeroes anyway — is written as zero bytes through the cache. With `fast_only`,
    /// a range that would need zero bytes written to the device fails with
    /// [`CacheError::ZeroingWouldWrite`] before anything changes.
    pub fn zero(
        &self,
        offset: u64,
        length_bytes: u64,
        options: ZeroOptions,
    ) -> Result<(), CacheError> {
        self.object.check_writable()?;
        self.object.check_range(offset, length_bytes)?;
        let fast = options.may_deallocate && self.can_zero_fast();
        if options.fast_only && !fast {
            return Err(CacheError::ZeroingWouldWrite {
                object: self.object.name.clone(),
            });
        }
        let block_size = self.object.block_size_bytes as u64;
        let (first, end) = self.whole_blocks(offset, length_bytes);
        if first >= end || !fast {
            self.write_zero_bytes(offset, length_bytes)?;
        } else {
            let head_end = first * block_size;
            let tail_start = (end * block_size).min(self.object.length_bytes());
            self.write_zero_bytes(offset, head_end - offset)?;
            self.write_zero_bytes(
                tail_start,
                (offset + length_bytes).saturating_sub(tail_start),
            )?;
            self.replace_on_device(first, end, |io, object, at, length| {
                io.write_zeroes(object, at, length)
            })?;
        }
        if options.fua {
            self.reported(self.inner().writeback().write_range(
                &self.object,
                offset / block_size,
                (offset + length_bytes).div_ceil(block_size),
                LockMode::Wait,
                WritebackCause::Flush,
            ))?;
            self.reported(self.inner().writeback().flush_device(&self.object))?;
        }
        Ok(())
    }

    /// Writes zero bytes through the cache in steps of at most `ZERO_STEP_BYTES`, so the
    /// zero source stays small whatever the range.
    fn write_zero_bytes(&self, offset: u64, length_bytes: u64) -> Result<(), CacheError> {
        const ZERO_STEP_BYTES: u64 = 1 << 20;
        if length_bytes == 0 {
            return Ok(());
        }
        let zeroes = vec![0u8; length_bytes.min(ZERO_STEP_BYTES) as usize];
        let mut done = 0u64;
        while done < length_bytes {
            let step = (length_bytes - done).min(zeroes.len() as u64) as usize;
            self.write_at(offset + done, &zeroes[..step], false)?;
            done += step as u64;
        }
        Ok(())
    }

    /// Blocks wholly inside a byte range: `[first, end)`.
    fn whole_blocks(&self, offset: u64, length_bytes: u64) -> (u64, u64) {
        let block_size = self.object.block_size_bytes as u64;
        let first = offset.div_ceil(block_size);
        let range_end = offset + length_bytes;
        let end = if range_end == self.object.length_bytes() {
            self.object.block_count()
        } else {
            range_end / block_size
        };
        (first, end.max(first))
    }

    /// Replaces the blocks `[first, end)` on the device with `operation` (a discard or
    /// zeroing) and drops them from the cache. Clean blocks are dropped first (they equal the
    /// device). Dirty ones stay in the table, held exclusively and no longer dirty (so flush
    /// and write-back pass them by), until the device has answered: a reader that misses on
    /// one meanwhile would read device bytes older than the write the block held, so it
    /// waits on the held buffer instead, finds it invalid and looks again once the
    /// replacement is on the device. Any clean copy a concurrent reader fetched from the
    /// device meanwhile is dropped at the end. Blocks written meanwhile stay dirty: those
    /// writes are newer than this operation.
    fn replace_on_device(
        &self,
        first: u64,
        end: u64,
        operation: impl Fn(&Io, &ObjectState, u64, u64) -> Result<(), CacheError>,
    ) -> Result<(), CacheError> {
        if first >= end {
            return Ok(());
        }
        let object = &self.object;
        // Until the device answers, a flush waits (the dirty blocks held here may hold writes
        // it must make durable; the replacement covers them once it is on the device).
        let _in_flight = object.begin_replace();
        // Deadlock freedom: the locks are taken in ascending block order, and while they are
        // held this thread waits only for further buffer locks in that order and for its own
        // device operation, never for space; a flush does not lock them (no longer dirty).
        let held = self.hold_dirty_dropping_clean(first, end);
        let mut replaced = Ok(());
        let mut block = first;
        while block < end {
            let mapped = object.map.map(block);
            let blocks = mapped.contiguous_blocks.min(end - block);
            let length = (block + blocks) * object.block_size_bytes as u64;
            let length = length.min(object.length_bytes()) - block * object.block_size_bytes as u64;
            replaced = operation(self.inner().io(), object, mapped.device_offset, length);
            if replaced.is_err() {
                break;
            }
            block += blocks;
        }
        for mut guard in held {
            if replaced.is_ok() {
                guard.set_no_cache();
                guard.buffer.clear(VALID);
            } else {
                // The replacement may not be on the device: the data stays dirty, as if the
                // operation had not begun.
                self.mark_dirty(&guard);
            }
        }
        replaced?;
        self.invalidate_blocks(first, end, false);
        Ok(())
    }

    /// For a replace of `[first, end)`: drops the clean cached blocks and returns the dirty
    /// ones held exclusively (ascending), no longer dirty but still valid and in the table.
    fn hold_dirty_dropping_clean(&self, first: u64, end: u64) -> Vec<BufferGuard> {
        let inner = self.inner();
        let mut held = Vec::new();
        for block in self.cached_candidates(first, end) {
            let Some(buffer) = inner.table().lookup_quiet(self.object.key(block)) else {
                continue;
            };
            buffer.lock_exclusive();
            let mut guard = BufferGuard::new(inner, &self.object, buffer);
            if guard.is_dirty() {
                self.clear_dirty(&guard);
                held.push(guard);
            } else {
                guard.set_no_cache();
                guard.buffer.clear(VALID);
            }
        }
        held
    }

    /// The blocks of `[first, end)` that may be cached, ascending.
    fn cached_candidates(&self, first: u64, end: u64) -> Vec<u64> {
        if end - first <= 4096 {
            (first..end).collect()
        } else {
            self.inner()
                .table()
                .cached_blocks(self.object.id, first, end)
        }
    }

    /// Removes cached blocks of `[first, end)`; dirty ones too when `including_dirty`.
    pub(crate) fn invalidate_blocks(&self, first: u64, end: u64, including_dirty: bool) {
        let inner = self.inner();
        for block in self.cached_candidates(first, end) {
            let Some(buffer) = inner.table().lookup_quiet(self.object.key(block)) else {
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
        self.inner()
            .writeback()
            .forget_dirty(&self.object, &guard.buffer);
    }

    /// The allocation map of a byte range, exact while data is dirty: blocks dirty in the
    /// cache are data, and every other byte is as the device reports it (a block is clean
    /// only once the device accepted its bytes, so the device's answer is true for it).
    /// Adjacent runs with the same state are merged. The device is asked only about the span
    /// that is not all dirty, widened to its alignment (an NBD upstream with a minimum block
    /// size refuses unaligned queries) and cut back to the range afterwards. The extents
    /// cover the range from `offset`, or a prefix of it when the device answered less.
    pub fn extents(&self, offset: u64, length_bytes: u64) -> Result<Vec<Extent>, CacheError> {
        let object = &self.object;
        object.check_range(offset, length_bytes)?;
        let end = offset + length_bytes;
        let dirty = self.dirty_byte_runs(offset, end);
        let clean_start = match dirty.first() {
            Some(&(start, run_end)) if start <= offset => run_end,
            _ => offset,
        };
        let clean_end = match dirty.last() {
            Some(&(start, run_end)) if run_end >= end => start,
            _ => end,
        };
        let device_runs = if clean_start < clean_end {
            self.device_extents(clean_start, clean_end)?
        } else {
            Vec::new()
        };
        let extents = overlay_dirty(offset, end, &dirty, &device_runs);
        strict_assert!(
            extents.iter().map(|extent| extent.length).sum::<u64>() <= length_bytes,
            "extents reach past the range asked for"
        );
        strict_assert!(
            length_bytes == 0 || !extents.is_empty(),
            "a range of bytes has no extents"
        );
        Ok(extents)
    }

    /// The byte ranges of `[offset, end)` whose blocks are dirty, merged into runs, in order.
    fn dirty_byte_runs(&self, offset: u64, end: u64) -> Vec<(u64, u64)> {
        let block_size = u64::from(self.object.block_size_bytes);
        let (first, last) = (offset / block_size, end.div_ceil(block_size));
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for (block, _) in self.object.dirty.lock().range(first..last) {
            let start = (block * block_size).max(offset);
            let run_end = ((block + 1) * block_size).min(end);
            match runs.last_mut() {
                Some(last_run) if last_run.1 == start => last_run.1 = run_end,
                _ => runs.push((start, run_end)),
            }
        }
        runs
    }

    /// The device's allocation map of `[start, end)` as absolute `(start, end, hole)` runs:
    /// asked for the range widened to the device's alignment, answered for the range only.
    fn device_extents(&self, start: u64, end: u64) -> Result<Vec<(u64, u64, bool)>, CacheError> {
        let io = self.inner().io();
        let capabilities = io.capabilities(&self.object);
        let alignment = (capabilities.alignment_bytes as u64).max(1);
        let query_start = start - start % alignment;
        let query_end = end
            .div_ceil(alignment)
            .saturating_mul(alignment)
            .min(capabilities.length_bytes)
            .max(end);
        let answer = io.extents(&self.object, query_start, query_end - query_start)?;
        let mut runs = Vec::with_capacity(answer.len());
        let mut position = query_start;
        for extent in answer {
            let (run_start, run_end) = (position.max(start), (position + extent.length).min(end));
            position += extent.length;
            if run_start < run_end {
                runs.push((run_start, run_end, extent.hole));
            }
            if position >= end {
                break;
            }
        }
        Ok(runs)
    }

    /// Where each block of a byte range is: dirty, resident (cached and clean) or absent, as
    /// consecutive runs covering `[offset, offset + length_bytes)`, adjacent runs with the
    /// same state merged. Blocks being filled count as resident. This is the cache's own view
    /// (the `x-bufcache:state` NBD metadata context): a backup tool copies only the dirty runs
    /// to learn what changed since the last flush.
    pub fn residency(
        &self,
        offset: u64,
        length_bytes: u64,
    ) -> Result<Vec<ResidencyRun>, CacheError> {
        let object = &self.object;
        object.check_range(offset, length_bytes)?;
        let end = offset + length_bytes;
        let block_size = u64::from(object.block_size_bytes);
        let (first, last) = (offset / block_size, end.div_ceil(block_size));
        let table = self.inner().table();
        // A short range is probed block by block; a long one from the table's list of the
        // object's cached blocks, which costs the cache's size instead of the range's.
        let resident: Vec<u64> = if last - first <= RESIDENCY_PROBED_BLOCKS_MAX {
            (first..last)
                .filter(|&block| table.contains(object.key(block)))
                .collect()
        } else {
            table.cached_blocks(object.id, first, last)
        };
        let dirty: Vec<u64> = object
            .dirty
            .lock()
            .range(first..last)
            .map(|(block, _)| block)
            .collect();
        let mut runs: Vec<ResidencyRun> = Vec::new();
        let mut push = |start: u64, run_end: u64, state: Residency| {
            let length = run_end.min(end) - start.max(offset);
            match runs.last_mut() {
                Some(last_run) if last_run.state == state => last_run.length += length,
                _ => runs.push(ResidencyRun { length, state }),
            }
        };
        let (mut resident, mut dirty) = (
            resident.into_iter().peekable(),
            dirty.into_iter().peekable(),
        );
        let mut block = first;
        while block < last {
            // A dirty block is resident too, so it shows up in both lists.
            let next_resident = resident.peek().copied().unwrap_or(last);
            let next_dirty = dirty.peek().copied().unwrap_or(last);
            let next = next_resident.min(next_dirty);
            if next > block {
                push(block * block_size, next * block_size, Residency::Absent);
                block = next;
                continue;
            }
            let state = if next_dirty == block {
                Residency::Dirty
            } else {
                Residency::Resident
            };
            push(block * block_size, (block + 1) * block_size, state);
            resident.next_if_eq(&block);
            dirty.next_if_eq(&block);
            block += 1;
        }
        strict_assert!(
            runs.iter().map(|run| run.length).sum::<u64>() == length_bytes,
            "residency runs do not cover the range"
        );
        Ok(runs)
    }
}

/// Ranges of at most this many blocks are probed block by block by
/// [`ObjectHandle::residency`]; longer ones use the table's list of cached blocks.
const RESIDENCY_PROBED_BLOCKS_MAX: u64 = 4096;

/// Where a run of an object's bytes is, as [`ObjectHandle::residency`] reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Residency {
    /// Not in the cache: the device holds the bytes.
    Absent,
    /// Cached and clean: the same bytes as the device.
    Resident,
    /// Cached and newer than the device (not yet written back).
    Dirty,
}

/// A run of bytes with one [`Residency`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResidencyRun {
    /// Length of the run in bytes (never zero).
    pub length: u64,
    /// Where the run's blocks are.
    pub state: Residency,
}

/// The extents of `[offset, end)`: the `dirty` byte runs as data, the rest from `device`
/// (absolute `(start, end, hole)` runs covering the non-dirty bytes from their start, or a
/// prefix of them), merged. Stops where neither says anything.
fn overlay_dirty(
    offset: u64,
    end: u64,
    dirty: &[(u64, u64)],
    device: &[(u64, u64, bool)],
) -> Vec<Extent> {
    let mut extents: Vec<Extent> = Vec::new();
    let mut push = |length: u64, hole: bool| match extents.last_mut() {
        Some(last) if last.hole == hole => last.length += length,
        _ => extents.push(Extent { length, hole }),
    };
    let (mut dirty, mut device) = (dirty.iter().peekable(), device.iter().peekable());
    let mut position = offset;
    while position < end {
        if let Some(&&(start, run_end)) = dirty.peek() {
            if start <= position {
                push(run_end - position, false);
                position = run_end;
                dirty.next();
                continue;
            }
        }
        let next_dirty = dirty.peek().map_or(end, |&&(start, _)| start);
        while device
            .next_if(|&&(_, run_end, _)| run_end <= position)
            .is_some()
        {}
        let Some(&&(start, run_end, hole)) = device.peek() else {
            break;
        };
        if start > position {
            // The device answered less than asked: report what is known.
            break;
        }
        let stop = run_end.min(next_dirty);
        push(stop - position, hole);
        position = stop;
    }
    extents
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

/// Hands the held blocks' bytes of `[offset, offset + length_bytes)` to `send`, then lets
/// the blocks go.
fn send_held(
    object: &ObjectState,
    held: ResidentRun<'_>,
    offset: u64,
    length_bytes: u64,
    send: &mut ReadSink<'_>,
) -> std::io::Result<()> {
    let slices = held.slices(object, offset, length_bytes);
    let sent = send(&slices);
    drop(slices);
    drop(held);
    sent
}

/// Copies the part of `bytes` (object bytes from `from` on) that a read of `target.len()`
/// bytes at `offset` wants.
fn copy_range_out(from: u64, bytes: &[u8], offset: u64, target: &mut [u8]) {
    let start = offset.max(from);
    let end = (offset + target.len() as u64).min(from + bytes.len() as u64);
    if start < end {
        target[(start - offset) as usize..(end - offset) as usize]
            .copy_from_slice(&bytes[(start - from) as usize..(end - from) as usize]);
    }
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
