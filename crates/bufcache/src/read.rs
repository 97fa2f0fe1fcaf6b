//! The read path: a byte-range read from plan to bytes — the stream table's plan, the read
//! step over cached blocks and miss runs, clustered device reads, streaming past the cache
//! under pressure, read-ahead fills, and reads started without waiting (`start_read`) or
//! attached to a fill in flight. The twin of module `writeback` for reads; the object handle
//! only delegates here.
//!
//! Invariants:
//! - no buffer lock is held while waiting for space, and only buffer locks are held across
//!   device I/O;
//! - a failed device read caches nothing (its buffers never become valid, so their guards
//!   drop them);
//! - read-ahead is best effort: it waits for nothing a reader did not ask for, and its errors
//!   reach no caller (the reader meets them itself).

use std::io::{IoSlice, IoSliceMut};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bufcache_policy::Placement;

use crate::buffer::{Buffer, READAHEAD, VALID};
use crate::cache::{Inner, Urgency};
use crate::error::CacheError;
use crate::guard::{release_guards, BufferGuard, GuardRun};
use crate::object::ObjectState;
use crate::readahead::ReadaheadPlan;
use crate::table::{Lookup, RunLookup};
use bufcache_device::aligned::AlignedBytes;

/// The read path of one object: borrowed from a handle for one call.
#[derive(Clone, Copy)]
pub(crate) struct Reader<'h> {
    inner: &'h Arc<Inner>,
    object: &'h Arc<ObjectState>,
}

/// The read path of one object, owned: what background work (read-ahead, completions,
/// attached reads) carries. It reports no errors to anyone, so it takes no part in flush
/// error reporting.
pub(crate) struct BackgroundReader {
    inner: Arc<Inner>,
    object: Arc<ObjectState>,
}

impl BackgroundReader {
    fn reader(&self) -> Reader<'_> {
        Reader::new(&self.inner, &self.object)
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

/// Receives the bytes of a read ([`crate::ObjectHandle::read_with`]): slices covering them, in order.
pub type ReadSink<'a> = dyn FnMut(&[IoSlice<'_>]) -> std::io::Result<()> + 'a;

/// What [`crate::ObjectHandle::start_read`] runs when its read ends.
pub type StartedReadDone = Box<dyn FnOnce(Result<StartedRead, CacheError>) + Send>;

/// The bytes of a read [`crate::ObjectHandle::start_read`] finished: the cache's own buffers, held
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

/// What holding a read's blocks found (`Reader::hold_blocks`).
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
    handle: BackgroundReader,
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
        let handle = self.handle.reader();
        let busy = match handle.hold_blocks(self.first, self.end, self.placement, true) {
            Holding::Held(held) => {
                let started = StartedRead {
                    object: Arc::clone(handle.object),
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
        let inner = Arc::clone(&self.handle.inner);
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

impl<'h> Reader<'h> {
    pub(crate) fn new(inner: &'h Arc<Inner>, object: &'h Arc<ObjectState>) -> Self {
        Reader { inner, object }
    }

    fn inner(&self) -> &'h Arc<Inner> {
        self.inner
    }

    /// An owned reader of the same object, for background work.
    fn background(&self) -> BackgroundReader {
        BackgroundReader {
            inner: Arc::clone(self.inner),
            object: Arc::clone(self.object),
        }
    }

    /// The body of [`crate::ObjectHandle::read_at`].
    pub(crate) fn read_at(&self, offset: u64, target: &mut [u8]) -> Result<(), CacheError> {
        self.object.check_range(offset, target.len() as u64)?;
        if target.is_empty() {
            return Ok(());
        }
        let planned = self.plan(offset, target.len() as u64);
        let waited = self.read_planned(offset, Some(target), &planned)?;
        self.finish_read(&planned, waited);
        Ok(())
    }

    /// The body of [`crate::ObjectHandle::read_with`].
    pub(crate) fn read_with(
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
                send_held(self.object, held, offset, length_bytes, send)
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
                    Some(held) => send_held(self.object, held, offset, length_bytes, send),
                    None => {
                        self.read_planned_quietly(offset, target, &planned)?;
                        send(&[IoSlice::new(target)])
                    }
                }
            }
        };
        sent.map_err(|source| CacheError::DataSink { source })
    }

    /// The body of [`crate::ObjectHandle::start_read`].
    pub(crate) fn start_read(
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
        let handle = self.background();
        let completion = move |run: GuardRun, result: std::io::Result<()>| {
            let started = handle.reader().finish_started_read(
                run.take(),
                result,
                device_offset,
                offset,
                length_bytes,
            );
            done(started);
        };
        let read = bufcache_device::ReadRequest::new(device_offset, GuardRun(run), completion);
        self.inner().io().start_read(object, read);
        self.start_planned_readahead_in_background(&planned);
        Ok(())
    }

    /// [`crate::ObjectHandle::start_read`] of a read whose blocks are all cached, some still being
    /// filled: answered now if they are all in already, else attached to the first block
    /// still being filled. Read-ahead goes on as for any read.
    fn start_attached_read(&self, offset: u64, length_bytes: u64, done: StartedReadDone) {
        let planned = self.plan(offset, length_bytes);
        let read = AttachedRead {
            handle: self.background(),
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

    /// The read-ahead `Reader::finish_read` starts, handed to the background; what
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
            let handle = self.background();
            let job = Box::new(move || handle.reader().fill_readahead(start, window_end));
            // Refused (the background queue is full): filled here after all, which waits for
            // nothing over a device that completes later (`fill_readahead` only starts its
            // reads). Skipping it cost a parallel copy through a small cache a third more
            // demand misses, each a device request of its own.
            if let Err(job) = self.inner().spawner().spawn(job) {
                job();
            }
        }
    }

    /// The completion of a read [`crate::ObjectHandle::start_read`] started: counts it, marks its
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
            return Err(io.error(self.object, "read", device_offset, run_bytes, source));
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
            object: Arc::clone(self.object),
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

    /// `Reader::read_planned` into `target` for a read whose blocks were already
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
                match inner.lookup_or_try_insert(key, self.object, request.placement) {
                    Some(found) => found,
                    None => {
                        if let Some(next) = self.read_streaming(block, request)? {
                            return Ok(next);
                        }
                        inner.lookup_or_insert(
                            key,
                            self.object,
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
                    copy_out(self.object, block, bytes, request.offset, target);
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
                        copy_out(self.object, block, bytes, request.offset, target);
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
    /// A read that only makes its blocks resident (no target: [`crate::ObjectHandle::read_with`]'s
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
        inner.io().read(self.object, &mut slices, device_offset)?;
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
        let handle = self.background();
        let job = Box::new(move || handle.reader().fill_readahead(start, end));
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
                self.object,
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
        if (runs.len() > 1 && io.serves_requests_in_parallel(self.object))
            || io.capabilities(self.object).completes_later
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
            let handle = self.background();
            let job: crate::environment::Job = Box::new(move || {
                let start = run[0].block();
                let _ = handle.reader().read_collected(&mut run, start);
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
                let handle = self.background();
                bufcache_device::ReadRequest::new(
                    device_offset,
                    GuardRun(run),
                    move |mut run: GuardRun, result: std::io::Result<()>| {
                        if result.is_ok() {
                            handle.reader().finish_readahead_run(&mut run.0);
                        }
                    },
                )
            })
            .collect();
        self.inner().io().start_reads(self.object, reads);
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

    /// The body of [`crate::ObjectHandle::is_resident`].
    pub(crate) fn is_resident(&self, offset: u64, length_bytes: u64) -> bool {
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

    /// The body of [`crate::ObjectHandle::prefetch`].
    pub(crate) fn prefetch(&self, offset: u64, length_bytes: u64) -> Result<(), CacheError> {
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
                self.object,
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
