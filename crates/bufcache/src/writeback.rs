//! Write-back: clustered writes of dirty buffers, fsync, background and throttled writeback.
//!
//! [`Writeback`] owns every trigger — fsync and FUA, write-behind of a run a write just
//! completed, throttling of writers above the dirty limit, cleaning for space under memory
//! pressure, and the background tick (aged data, data above the background threshold) — and
//! the cache-wide dirty byte count they all act on. It is handed objects and block runs; it
//! reads an object's dirty index but changes dirty state only through the dirty set.
//!
//! Every write-back goes through [`Writeback::write_cluster_from`]: a run of consecutive dirty
//! blocks, contiguous on the device and at most one cluster long, is held shared (readers
//! continue, writers wait) and written with one vectored request. Only after the device
//! accepted every byte are the buffers marked clean; on failure they stay dirty, in memory,
//! and the error is latched on the object for its flushers (the fsyncgate lesson).
//!
//! Passes that need the outcomes (flush, fsync, sync, throttling, space) wait for their
//! writes; the background tick's passes only send them ([`Awaiting::Nothing`], 4.4BSD's
//! `bawrite`), and each write ends on its own through [`RunEnd`], on whichever thread the
//! device completes it. Either way a block stays dirty until its write has ended.

use std::io::IoSlice;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bufcache_device::WriteMemory;

use crate::buffer::{Buffer, DIRTY, VALID, WRITEBACK, WRITEBACK_WAITED, WRITTEN_BEHIND};
use crate::config::CacheConfig;
use crate::dirty;
use crate::environment::{Clock, Waiter};
use crate::error::CacheError;
use crate::io::{Io, WriteBackDone};
use crate::object::ObjectState;
use crate::stats::{Counters, WritebackCause};
use crate::table::Table;

/// How long a caller waiting for another thread's write-back of one buffer first sleeps
/// before looking again; each further look waits twice as long, up to
/// `WRITEBACK_POLL_MAX_NS`. The end of a write-back wakes the shared waiter only when the
/// buffer is marked `WRITEBACK_WAITED` (a broadcast after every write woke every waiter per
/// write and was measured slower); the looks remain as the bound on a wait. A fixed 50 µs
/// poll made a flush waiting on 1 ms upstream writes wake twenty times per block, half of
/// all context switches of a FLUSH-heavy run over a slow upstream.
const WRITEBACK_POLL_NS: u64 = 50_000;
const WRITEBACK_POLL_MAX_NS: u64 = 400_000;

/// Writers waiting above the dirty limit at once before a further write above it is called
/// quick (`write_is_quick`), so that a server serves it in the thread that read it and its
/// connection reads nothing more until it is written. Beyond a few, another thread waiting
/// beside them keeps the device no busier (they share its write-back slots); it only adds a
/// sleeper to wake and a payload held outside the cache, while holding the connection passes
/// the wait back to the client that outruns the device. Not fewer: a connection that also
/// reads would wait behind every write above the limit.
pub(crate) const THROTTLED_WRITERS_MAX: usize = 4;

/// How long a throttled writer that found the device's write-back share busy sleeps before
/// looking again. Every slot given back wakes it (`Io::wait_for_writeback_end`), so the step
/// only bounds a wait whose notification went astray, and it counts whole towards the stall
/// bound when nothing woke it.
const THROTTLE_STEP_NS: u64 = 20_000_000;

/// Helper jobs a flush over a device that serves several requests at once starts at most
/// (besides its own thread); each writes a share of the dirty runs in batches, so several
/// batches are in flight (the device's write-back share bounds the total). A local file is
/// written by the flush's thread alone: parallel writers of one file contend for its inode
/// lock.
pub(crate) const FLUSH_HELPERS_MAX: usize = 7;

/// Bytes one write-back batch carries at most: its buffers stay locked until the whole batch
/// is answered, so it is kept to what a fast link moves in a few round trips.
pub(crate) const WRITEBACK_BATCH_BYTES_MAX: u64 = 8 << 20;

/// What a reservation under memory pressure got from write-back
/// ([`Writeback::clean_for_space`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum SpaceCleaning {
    /// Some write-back ended before the call returned: clean buffers can be evicted now.
    Cleaned,
    /// Write-back is in flight (started by this call, or filling the device's share): its
    /// completions wake space waiters, so the caller waits for them.
    InFlight,
    /// Nothing could be written back now (no dirty data, or all of it held by others).
    Nothing,
}

/// How write-back takes buffer locks.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum LockMode {
    /// Skip buffers someone holds: background work must never wait behind a user.
    Try,
    /// Wait for each buffer: flush and fsync must write everything in their scope.
    Wait,
}

/// Whether a write-back pass waits for the outcomes of its writes.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Awaiting {
    /// The caller needs them (flush, fsync, sync, throttling, space): the pass returns once
    /// every write it sent has ended, with the first error.
    Outcomes,
    /// Nobody waits (the background tick, 4.4BSD's `bawrite`): the pass returns once its
    /// writes are sent; each ends on its own, marking its blocks clean or latching its
    /// error on the object, and releases its claim. A flush that needs those blocks waits
    /// for their write-back in flight like any other.
    Nothing,
}

/// What ends a write-back write, wherever its completion runs (the writer's thread or the
/// device's): marking its blocks clean or latching its error, then releasing its claim.
/// Shared by the [`Writeback`] and every run in flight.
struct RunEnd {
    table: Arc<Table>,
    io: Arc<Io>,
    counters: Arc<Counters>,
    /// Bytes of dirty data in the whole cache (changed only by the dirty set).
    dirty_bytes: AtomicU64,
    waiter: Arc<dyn Waiter>,
}

/// The write-back side of a cache: its triggers and the dirty byte count.
pub(crate) struct Writeback {
    table: Arc<Table>,
    io: Arc<Io>,
    counters: Arc<Counters>,
    /// The dirty byte count and what ends a write, shared with writes in flight.
    end: Arc<RunEnd>,
    /// Round-robin position over objects for pressure-driven write-back.
    object_cursor: AtomicUsize,
    dirty_age_max: Duration,
    dirty_background_percent: u32,
    dirty_limit_percent: u32,
    /// How long a writer above the dirty limit waits for write-back in flight at most
    /// (`space_wait_max`).
    stall_ns_max: u64,
    clock: Arc<dyn Clock>,
    waiter: Arc<dyn Waiter>,
    /// Writers inside [`Writeback::throttle_writer`] now, above the dirty limit.
    throttled_writers: AtomicUsize,
}

impl Writeback {
    pub(crate) fn new(
        table: Arc<Table>,
        io: Arc<Io>,
        counters: Arc<Counters>,
        config: &CacheConfig,
        clock: Arc<dyn Clock>,
        waiter: Arc<dyn Waiter>,
    ) -> Writeback {
        let end = Arc::new(RunEnd {
            table: Arc::clone(&table),
            io: Arc::clone(&io),
            counters: Arc::clone(&counters),
            dirty_bytes: AtomicU64::new(0),
            waiter: Arc::clone(&waiter),
        });
        Writeback {
            table,
            io,
            counters,
            end,
            object_cursor: AtomicUsize::new(0),
            dirty_age_max: config.dirty_age_max,
            dirty_background_percent: config.dirty_background_percent as u32,
            dirty_limit_percent: config.dirty_limit_percent as u32,
            stall_ns_max: u64::try_from(config.space_wait_max.as_nanos()).unwrap_or(u64::MAX),
            clock,
            waiter,
            throttled_writers: AtomicUsize::new(0),
        }
    }

    /// True when [`THROTTLED_WRITERS_MAX`] writers already wait above the dirty limit: a
    /// further write above it is then served in the thread that read it (rule 8 of
    /// "Admission under pressure", docs/design.md).
    pub(crate) fn writers_throttled_enough(&self) -> bool {
        self.throttled_writers.load(Ordering::Acquire) >= THROTTLED_WRITERS_MAX
    }

    /// How many helper jobs a flush of `object` should start: [`FLUSH_HELPERS_MAX`] when its
    /// device serves several requests at once, else none.
    pub(crate) fn flush_helpers_wanted(&self, object: &ObjectState) -> usize {
        if self.io.serves_requests_in_parallel(object) {
            FLUSH_HELPERS_MAX
        } else {
            0
        }
    }

    /// Bytes of dirty data in the cache now.
    pub(crate) fn dirty_bytes(&self) -> u64 {
        self.end.dirty_bytes.load(Ordering::Acquire)
    }

    /// Marks a buffer (held exclusively, its bytes just written) dirty in its object's index.
    pub(crate) fn mark_dirty(&self, object: &ObjectState, buffer: &Buffer) {
        if !buffer.has(DIRTY) {
            let now = self.clock.now_ns();
            dirty::mark(&self.end.dirty_bytes, &object.dirty, buffer, now);
        }
    }

    /// Marks buffers (held exclusively, their bytes just written) dirty, with one update of
    /// the object's dirty index for all of them.
    pub(crate) fn mark_dirty_all(&self, object: &ObjectState, buffers: &[&Buffer]) {
        let now = self.clock.now_ns();
        dirty::mark_all(&self.end.dirty_bytes, &object.dirty, buffers, now);
    }

    /// Marks a buffer (held exclusively) clean without writing it: its contents are being
    /// discarded (discard, write-zeroes, invalidation of replaced data).
    pub(crate) fn forget_dirty(&self, object: &ObjectState, buffer: &Buffer) {
        dirty::clear(&self.end.dirty_bytes, &object.dirty, buffer);
    }

    /// True while dirty data is under the background threshold: a rewrite of hot data may
    /// then stay dirty (absorbing further rewrites) instead of being written behind. Past
    /// it, rewrites are written behind like any write, so absorbed rewrites never hold more
    /// than `dirty_background_percent` of memory and never make writers throttle.
    pub(crate) fn absorbs_rewrites(&self) -> bool {
        self.end.dirty_bytes.load(Ordering::Acquire) < self.dirty_thresholds().0
    }

    /// Dirty byte thresholds (background, limit) for the current memory limit.
    pub(crate) fn dirty_thresholds(&self) -> (u64, u64) {
        let memory = self.table.memory_bytes_max();
        (
            memory / 100 * self.dirty_background_percent as u64,
            memory / 100 * self.dirty_limit_percent as u64,
        )
    }

    /// Claims for write-back the run of consecutive dirty blocks starting at `first` (one
    /// cluster at most, contiguous on the device): each is pinned, locked shared and marked
    /// in write-back. The run ends at the first block that is not dirty, not cached or (in
    /// `Try` mode) held; empty when `first` is one of those. The claim ends when the returned
    /// run is dropped.
    fn claim_run(&self, object: &ObjectState, first: u64, mode: LockMode) -> ClaimedRun {
        let limit = object.write_run_blocks_max(first);
        let mut candidates: Vec<u64> = {
            let dirty = object.dirty.lock();
            dirty
                .range(first..first + limit)
                .map(|(block, _)| block)
                .enumerate()
                .take_while(|&(index, block)| block == first + index as u64)
                .map(|(_, block)| block)
                .collect()
        };
        // A run that would end part-way into a later write unit stops before that unit, so
        // the unit is claimed on its own and may be filled whole (`claim_filled_unit`).
        if let Some(&last) = candidates.last() {
            if let Some((unit_start, unit_end)) = object.write_unit_of(last) {
                if unit_start > first && last + 1 < unit_end {
                    candidates.retain(|&block| block < unit_start);
                }
            }
        }
        let mut held = ClaimedRun {
            end: Arc::clone(&self.end),
            buffers: Vec::with_capacity(candidates.len()),
        };
        let Some(&last) = candidates.last() else {
            return held;
        };
        // Looked up a chunk of the table at a time: a claim often fails at its first block
        // (a cluster another writer is writing back already), and pinning the whole cluster
        // for that cost a throttled upload a tenth of its time.
        const CLAIM_LOOKUP_BLOCKS: u64 = 16;
        let lookup_window = |from: u64| {
            let window_end = (last + 1).min(from + CLAIM_LOOKUP_BLOCKS);
            (
                self.table.lookup_run(object.id, from, window_end, None),
                window_end,
            )
        };
        let (mut cached, mut window_end) = lookup_window(first);
        for block in candidates {
            if block >= window_end {
                (cached, window_end) = lookup_window(block);
            }
            let Some(buffer) = cached.take(block) else {
                break;
            };
            if !self.claim_for_writeback(&buffer, mode) {
                self.table.unpin(&buffer);
                break;
            }
            held.buffers.push(buffer);
        }
        held
    }

    /// Claims the run starting at `first` ([`Self::claim_run`]), or, on a device with a write
    /// unit, the whole unit holding `first` when the unit is not all dirty and none of it is
    /// claimed by this pass yet (`first_unclaimed`) and it can be filled
    /// ([`Self::claim_filled_unit`]).
    fn claim_from(
        &self,
        object: &ObjectState,
        first: u64,
        mode: LockMode,
        first_unclaimed: u64,
    ) -> ClaimedRun {
        if let Some(unit) = object.write_unit_of(first) {
            let (unit_start, unit_end) = unit;
            let partly_dirty = unit_start >= first_unclaimed
                && object.dirty.lock().count(unit_start..unit_end) < unit_end - unit_start;
            if let Some(run) = partly_dirty
                .then(|| self.claim_filled_unit(object, unit))
                .flatten()
            {
                return run;
            }
        }
        self.claim_run(object, first, mode)
    }

    /// Claims every block of the write unit `[start, end)` — the dirty ones for write-back,
    /// the clean ones as filler, all pinned, locked shared and marked `WRITEBACK` — so the unit
    /// reaches the device as one whole write: an object-store chunk is then PUT without the GET
    /// and merge a partial chunk costs. Writing a clean block again is harmless: it holds what
    /// the device holds, and the shared lock keeps writers (and discards, which lock
    /// exclusively) out until the write has ended.
    ///
    /// None, with nothing claimed, when a block is not cached, not valid or held, when none is
    /// dirty, or while a discard or zeroing is in flight on the object: a clean block a reader
    /// fetched meanwhile may hold bytes the replacement is about to change, and writing them
    /// after it would bring them back.
    fn claim_filled_unit(
        &self,
        object: &ObjectState,
        (start, end): (u64, u64),
    ) -> Option<ClaimedRun> {
        let mut cached = self.table.lookup_run(object.id, start, end, None);
        let mut held = ClaimedRun {
            end: Arc::clone(&self.end),
            buffers: Vec::with_capacity((end - start) as usize),
        };
        for block in start..end {
            let buffer = cached.take(block)?;
            if !claim_unit_block(&buffer) {
                self.table.unpin(&buffer);
                return None;
            }
            held.buffers.push(buffer);
        }
        // Checked with every block held: a replacement that starts later must lock them
        // exclusively first, so it waits for this write and its device operation comes after.
        if object.replace_in_flight() || !held.buffers.iter().any(|buffer| buffer.has(DIRTY)) {
            return None;
        }
        Some(held)
    }

    /// Locks a dirty buffer shared and marks its write-back in flight. False when it is not
    /// dirty, or (in `Try` mode) when it is held or already being written. In `Wait` mode a
    /// write-back already in flight is waited for and the buffer checked again, since that
    /// write may fail or the buffer may have been dirtied again since.
    fn claim_for_writeback(&self, buffer: &Buffer, mode: LockMode) -> bool {
        loop {
            match mode {
                LockMode::Try if !buffer.try_lock_shared() => return false,
                LockMode::Try => {}
                LockMode::Wait => buffer.lock_shared(),
            }
            // Claim first, then look at DIRTY: a write-back already in flight may have cleared
            // DIRTY without having finished its bookkeeping (dirty set, dirty bytes), or may
            // still fail and leave the data dirty. Only its end (WRITEBACK cleared) settles
            // whether this buffer still needs writing.
            if buffer.set(WRITEBACK) {
                if buffer.has(DIRTY) {
                    return true;
                }
                let waited = end_writeback(buffer);
                // SAFETY: locked shared just above.
                unsafe { buffer.unlock_shared() };
                if waited {
                    self.waiter.notify_all();
                }
                return false;
            }
            // SAFETY: locked shared just above.
            unsafe { buffer.unlock_shared() };
            if mode == LockMode::Try {
                return false;
            }
            self.wait_for_writeback_end(buffer);
        }
    }

    /// Sleeps until `buffer`'s write-back in flight (another thread's) has ended. The buffer
    /// is marked `WRITEBACK_WAITED` first, so the thread that ends the write-back wakes this
    /// one; the sleep is still bounded (50 µs, then twice as long each time, at most 400 µs)
    /// and the flag set again at each look, in case the write-back that ended was another.
    fn wait_for_writeback_end(&self, buffer: &Buffer) {
        let mut sleep_ns = WRITEBACK_POLL_NS;
        loop {
            // Ticket, then mark, then look: both the mark and the end of a write-back change
            // the one flags word, so either the ender sees the mark (and its notification
            // comes after this ticket) or this look sees the write-back ended.
            let ticket = self.waiter.ticket();
            buffer.set(WRITEBACK_WAITED);
            if !buffer.has(WRITEBACK) {
                return;
            }
            self.waiter.wait(ticket, sleep_ns);
            sleep_ns = (sleep_ns * 2).min(WRITEBACK_POLL_MAX_NS);
        }
    }

    /// Writes `buffers` — consecutive blocks, contiguous on the device, held locked by the
    /// caller — with one request, then marks them clean. Returns the blocks cleaned.
    pub(crate) fn write_held(
        &self,
        object: &ObjectState,
        buffers: &[Arc<Buffer>],
        cause: WritebackCause,
    ) -> Result<u64, CacheError> {
        self.write_runs(&[(object, buffers)], cause)
            .pop()
            .expect("one outcome per run")
    }

    /// Writes each run (as [`Self::write_held`] does one) of its object and marks its blocks
    /// clean when its write succeeded. Several runs — of one object, or of objects stored on
    /// one device — go to the device as one batch, in flight together; one goes as a plain
    /// write. One outcome per run, in order.
    fn write_runs(
        &self,
        runs: &[(&ObjectState, &[Arc<Buffer>])],
        cause: WritebackCause,
    ) -> Vec<Result<u64, CacheError>> {
        let Some(&(device_object, _)) = runs.first() else {
            return Vec::new();
        };
        strict_assert!(
            runs.iter()
                .all(|(object, _)| Arc::ptr_eq(&object.device, &device_object.device)),
            "the runs of one batch are stored on one device"
        );
        let writes: Vec<(u64, HeldBytes)> = runs
            .iter()
            .map(|(object, run)| {
                let offset = object.map.map(run[0].key.block).device_offset;
                (offset, HeldBytes(run.to_vec()))
            })
            .collect();
        let offsets: Vec<u64> = writes.iter().map(|&(offset, _)| offset).collect();
        // A deliberate bug, compiled only for `sim check`'s planted-defect test: the buffers
        // are marked clean before their write, so a failed write silently loses them.
        #[cfg(feature = "planted-defect")]
        for &(object, run) in runs {
            dirty::clear_all(
                &self.end.dirty_bytes,
                &object.dirty,
                run.iter().map(|buffer| buffer.as_ref()),
            );
        }
        let results = self.io.write_back(device_object, writes);
        runs.iter()
            .zip(offsets)
            .zip(results)
            .map(|((&(object, run), offset), result)| {
                self.end.finish_write(object, run, offset, result, cause)
            })
            .collect()
    }

    /// Writes every dirty block of `[start, end)` in clusters. Keeps going after a failed
    /// cluster so that as much as possible reaches the device; returns the first error.
    ///
    /// Over a slow device, claimed runs are written in batches
    /// ([`crate::io::WRITEBACK_BATCH_WRITES_MAX`] at most, as the device allows), in flight together.
    pub(crate) fn write_range(
        &self,
        object: &Arc<ObjectState>,
        start: u64,
        end: u64,
        mode: LockMode,
        cause: WritebackCause,
    ) -> Result<u64, CacheError> {
        self.write_range_dirtied_by(object, start, end, u64::MAX, mode, cause)
    }

    /// [`Self::write_range`] for the blocks that became dirty at or before `dirtied_by_ns`
    /// (runs starting at one of them take the dirty blocks after it too).
    ///
    /// In `Wait` mode a block someone else holds is waited for only once the runs claimed so
    /// far are written: a pass never waits while it holds claims of its own.
    pub(crate) fn write_range_dirtied_by(
        &self,
        object: &Arc<ObjectState>,
        start: u64,
        end: u64,
        dirtied_by_ns: u64,
        mode: LockMode,
        cause: WritebackCause,
    ) -> Result<u64, CacheError> {
        let mut batch = Batch::new(Awaiting::Outcomes);
        let range = (start, end, dirtied_by_ns);
        self.claim_range_into(object, range, mode, cause, &mut batch);
        self.write_batch(&mut batch, cause);
        batch.first_error.map_or(Ok(batch.written), Err)
    }

    /// The pass of [`Self::write_range_dirtied_by`] over `(start, end, dirtied_by_ns)`:
    /// claims runs into `batch`, writing it whenever it is full. The batch may already hold
    /// runs of other objects stored on the same device; what it holds at the end is left for
    /// the caller to write.
    fn claim_range_into(
        &self,
        object: &Arc<ObjectState>,
        (start, end, dirtied_by_ns): (u64, u64, u64),
        mode: LockMode,
        cause: WritebackCause,
        batch: &mut Batch,
    ) {
        let blocks: Vec<u64> = object
            .dirty
            .lock()
            .range(start..end)
            .filter(|&(_, dirtied_ns)| dirtied_ns <= dirtied_by_ns)
            .map(|(block, _)| block)
            .collect();
        let writes_max = self.batch_writes_max(object);
        let mut next_unclaimed = 0u64;
        for block in blocks {
            if block < next_unclaimed {
                continue;
            }
            // A batching `Wait` pass tries first, and waits only once its batch is written.
            let batching_wait = mode == LockMode::Wait && writes_max > 1;
            let first_try = if batching_wait { LockMode::Try } else { mode };
            let mut held = self.claim_from(object, block, first_try, next_unclaimed);
            if held.is_empty() && batching_wait {
                self.write_batch(batch, cause);
                held = self.claim_run(object, block, LockMode::Wait);
            }
            if held.is_empty() {
                next_unclaimed = if mode == LockMode::Try {
                    // Held, or being written by another thread whose run may not be fully
                    // claimed yet: taking the blocks after it would split that write in two
                    // (a flush racing write-behind turned one 1 MiB write into two). The
                    // rest of its cluster is left to that writer; a `Wait` pass, the tick
                    // or the next flush finds whatever it leaves.
                    (block / object.cluster_blocks + 1) * object.cluster_blocks
                } else {
                    block + 1
                };
                continue;
            }
            next_unclaimed = held.end_block();
            batch.add(object, held);
            if batch.is_full(writes_max) {
                self.write_batch(batch, cause);
            }
        }
    }

    /// One write-back pass (`LockMode::Try`) over the blocks of every object that became
    /// dirty at or before `dirtied_by_ns`, with the runs of objects stored on one device
    /// handed down together in that device's batches: below, they wait together, and an io
    /// queue sorts and merges adjacent ones (as 4.4BSD's syncer filled the driver queue with
    /// every delayed write at once). Errors are latched on their objects; returns the blocks
    /// cleaned and the first error.
    pub(crate) fn write_objects_dirtied_by(
        &self,
        objects: &[Arc<ObjectState>],
        dirtied_by_ns: u64,
        cause: WritebackCause,
        awaiting: Awaiting,
    ) -> (u64, Option<CacheError>) {
        let mut written = 0;
        let mut first_error = None;
        for group in self.io.group_by_device(objects) {
            let mut batch = Batch::new(awaiting);
            for object in group {
                let range = (0, u64::MAX, dirtied_by_ns);
                self.claim_range_into(object, range, LockMode::Try, cause, &mut batch);
            }
            self.write_batch(&mut batch, cause);
            written += batch.written;
            first_error = first_error.or(batch.first_error);
        }
        (written, first_error)
    }

    /// How many runs a pass writes in one batch: several only over a device that serves
    /// several requests at once (a local file does not: batching would only hold its buffers
    /// locked longer).
    fn batch_writes_max(&self, object: &ObjectState) -> usize {
        self.io.batch_writes_max(object)
    }

    /// Writes the batch's claimed runs, releases them and empties it, keeping its totals; a
    /// batch awaiting nothing is only sent ([`Self::start_batch`]).
    fn write_batch(&self, batch: &mut Batch, cause: WritebackCause) {
        if batch.runs.is_empty() {
            return;
        }
        if batch.awaiting == Awaiting::Nothing {
            return self.start_batch(batch, cause);
        }
        let runs: Vec<(&ObjectState, &[Arc<Buffer>])> = batch
            .runs
            .iter()
            .map(|(object, run)| (object.as_ref(), run.buffers()))
            .collect();
        let results = self.write_runs(&runs, cause);
        // Dropping the runs ends their claims.
        for ((_, run), result) in batch.runs.drain(..).zip(results) {
            drop(run);
            match result {
                Ok(cleaned) => batch.written += cleaned,
                Err(error) => {
                    batch.first_error.get_or_insert(error);
                }
            }
        }
        batch.bytes = 0;
    }

    /// Sends the batch's claimed runs as one batch of writes and empties it without waiting
    /// for them (4.4BSD's `bawrite`): each write's completion marks its blocks clean or
    /// latches its error, and ends its claim, on whichever thread the device completes it.
    /// The batch's `written` counts the blocks of writes that ended before this returned.
    fn start_batch(&self, batch: &mut Batch, cause: WritebackCause) {
        let runs: Vec<(Arc<ObjectState>, ClaimedRun)> = batch.runs.drain(..).collect();
        batch.bytes = 0;
        let device_object = Arc::clone(&runs[0].0);
        #[cfg(feature = "planted-defect")]
        for (object, run) in &runs {
            dirty::clear_all(
                &self.end.dirty_bytes,
                &object.dirty,
                run.buffers().iter().map(|b| b.as_ref()),
            );
        }
        let cleaned = Arc::new(AtomicU64::new(0));
        let writes = runs
            .into_iter()
            .map(|(object, run)| {
                let offset = object.map.map(run.buffers[0].key.block).device_offset;
                let (end, cleaned) = (Arc::clone(&self.end), Arc::clone(&cleaned));
                let done: WriteBackDone<ClaimedRun> = Box::new(move |run, result| {
                    // A failure is latched on the object for its flushers.
                    if let Ok(blocks) =
                        end.finish_write(&object, run.buffers(), offset, result, cause)
                    {
                        cleaned.fetch_add(blocks, Ordering::AcqRel);
                    }
                    // Dropping the run ends its claim.
                    drop(run);
                });
                (offset, run, done)
            })
            .collect();
        self.io.start_write_back(&device_object, writes);
        batch.written += cleaned.load(Ordering::Acquire);
    }

    /// Flushes the object's device; a failure is latched, since data already marked clean
    /// may not be durable.
    pub(crate) fn flush_device(&self, object: &ObjectState) -> Result<(), CacheError> {
        self.io
            .flush(object)
            .inspect_err(|error| object.latch_error(error))
    }

    /// Writes back everything dirty in the object, then flushes its device.
    ///
    /// Two passes. The first writes whatever nobody else holds and skips the rest; the second
    /// waits for what is left. Concurrent FLUSHes (a client with several in flight) used to
    /// walk the same blocks in step, the later one waiting out the earlier one's write of
    /// each block in turn: a sleep and a wake-up per block, 15% of a FLUSH-heavy run's
    /// context switches. Now the later one writes the blocks the earlier has not reached,
    /// and by its second pass most blocks it skipped are clean and out of the index. When
    /// the first pass fails the FLUSH fails, so the second (which would retry the failed
    /// blocks at once) is not needed for its answer.
    pub(crate) fn fsync_object(&self, object: &Arc<ObjectState>) -> Result<(), CacheError> {
        self.fsync_dirtied_by(object, u64::MAX)
    }

    /// [`Self::fsync_object`] for the blocks that became dirty at or before `dirtied_by_ns`:
    /// what a FLUSH received at that time must make durable. A block that became dirty later
    /// was clean at some moment after it, so whatever was written to it before had reached
    /// the device by then, and the device flush below covers it. Without this bound a FLUSH
    /// chased blocks written while it ran, one device write at a time, and its latency grew
    /// with the write rate of everyone else.
    pub(crate) fn fsync_dirtied_by(
        &self,
        object: &Arc<ObjectState>,
        dirtied_by_ns: u64,
    ) -> Result<(), CacheError> {
        let mut written = self.write_range_dirtied_by(
            object,
            0,
            u64::MAX,
            dirtied_by_ns,
            LockMode::Try,
            WritebackCause::Flush,
        );
        if written.is_ok() {
            written = self.write_range_dirtied_by(
                object,
                0,
                u64::MAX,
                dirtied_by_ns,
                LockMode::Wait,
                WritebackCause::Flush,
            );
        }
        self.wait_for_replaces(object);
        let flushed = self.flush_device(object);
        written?;
        flushed
    }

    /// Waits until no discard or zeroing of the object is between dropping dirty blocks and
    /// the device's answer, looking again after the same growing pauses as for a write-back
    /// in flight (they are rare, and last one device request).
    fn wait_for_replaces(&self, object: &ObjectState) {
        let mut sleep_ns = WRITEBACK_POLL_NS;
        while object.replace_in_flight() {
            let ticket = self.waiter.ticket();
            self.waiter.wait(ticket, sleep_ns);
            sleep_ns = (sleep_ns * 2).min(WRITEBACK_POLL_MAX_NS);
        }
    }

    /// The injected clock's time now, for a flush to say which dirty blocks it covers.
    pub(crate) fn now_ns(&self) -> u64 {
        self.clock.now_ns()
    }

    /// Above the dirty limit, a writer first writes back some of its own object's dirty
    /// data. If that write-back fails, the writer gets the error: accepting more dirty data
    /// that cannot be written would only grow what is at risk.
    pub(crate) fn throttle_writer(&self, object: &Arc<ObjectState>) -> Result<(), CacheError> {
        let (_, limit) = self.dirty_thresholds();
        let mut throttled = false;
        // Steps waited for write-back in flight; a step no completion woke counts whole, so
        // the bound holds on a clock that does not move.
        let mut waited_ns = 0u64;
        let mut awaited = false;
        let started_ns = self.clock.now_ns();
        let _counted = ThrottledWriter::new(&self.throttled_writers);
        while self.end.dirty_bytes.load(Ordering::Acquire) > limit {
            if !throttled {
                self.counters
                    .throttled_writes
                    .fetch_add(1, Ordering::Relaxed);
                throttled = true;
            }
            if !self.io.writeback_slot_free(object) {
                // Rule 5 of "Admission under pressure": the device's write-back share is
                // busy, so this writer waits for those writes to end rather than queueing
                // more of its own; after the stall bound it goes on (its data stays dirty,
                // in memory, as above the limit before).
                let stalled_ns = self
                    .clock
                    .now_ns()
                    .saturating_sub(started_ns)
                    .max(waited_ns);
                if stalled_ns >= self.stall_ns_max {
                    break;
                }
                if !awaited {
                    awaited = true;
                    self.counters
                        .writeback_waits
                        .fetch_add(1, Ordering::Relaxed);
                }
                let step_ns = THROTTLE_STEP_NS;
                if !self.io.wait_for_writeback_end(object, step_ns) {
                    waited_ns += step_ns;
                }
                continue;
            }
            if self.clean_claimed_cluster(object, WritebackCause::Threshold)? == 0 {
                break;
            }
        }
        Ok(())
    }

    /// Writes back clusters claimed from the object's write-back cursor, as one batch of up
    /// to the device's batch size (one cluster over a local file, the write-back share over
    /// a device that serves requests in parallel: a throttled writer over a remote disk then
    /// waits one round trip for a batch, not one per cluster), and waits for them. Clusters
    /// being written by others or held by users are skipped, a few times at most. Returns
    /// the blocks cleaned (0 when nothing could be cleaned now); an error only when a write
    /// failed and none cleaned anything.
    fn clean_claimed_cluster(
        &self,
        object: &Arc<ObjectState>,
        cause: WritebackCause,
    ) -> Result<u64, CacheError> {
        let mut batch = Batch::new(Awaiting::Outcomes);
        self.claim_clusters_into(object, &mut batch);
        self.write_batch(&mut batch, cause);
        match batch.first_error {
            Some(error) if batch.written == 0 => Err(error),
            _ => Ok(batch.written),
        }
    }

    /// Claims clusters from the object's write-back cursor into `batch`, up to the device's
    /// batch size; clusters being written by others or held by users are skipped, a few
    /// times at most.
    fn claim_clusters_into(&self, object: &Arc<ObjectState>, batch: &mut Batch) {
        const SKIPS_MAX: usize = 4;
        let writes_max = self.batch_writes_max(object);
        let mut skips = 0;
        while !batch.is_full(writes_max) && skips < SKIPS_MAX {
            let Some(first) = object.claim_dirty_cluster() else {
                break;
            };
            let held = self.claim_from(object, first, LockMode::Try, 0);
            if held.is_empty() {
                skips += 1;
                continue;
            }
            batch.add(object, held);
        }
    }

    /// Write-back for a reservation that found no buffer to evict (rule 5 of "Admission
    /// under pressure" in docs/design.md): writers under pressure wait for write-back
    /// completions rather than each writing back and waiting for its own writes. While the
    /// device's write-back share is full, nothing more is sent (`InFlight`: those writes'
    /// ends wake the caller). Otherwise one batch of the object's dirty clusters is sent;
    /// over a device that completes requests later (an NBD upstream, an object store) the
    /// batch is only sent ([`Awaiting::Nothing`]: its end marks the blocks clean or latches
    /// its error, and wakes space waiters), over one that completes them in the caller's
    /// thread it is written and its first error returned when nothing was cleaned, as before.
    pub(crate) fn clean_for_space(
        &self,
        object: &Arc<ObjectState>,
    ) -> Result<SpaceCleaning, CacheError> {
        if !self.io.writeback_slot_free(object) {
            return Ok(SpaceCleaning::InFlight);
        }
        if !self.io.capabilities(object).completes_later {
            return Ok(
                match self.clean_claimed_cluster(object, WritebackCause::Eviction)? {
                    0 => SpaceCleaning::Nothing,
                    _ => SpaceCleaning::Cleaned,
                },
            );
        }
        let mut batch = Batch::new(Awaiting::Nothing);
        self.claim_clusters_into(object, &mut batch);
        if batch.runs.is_empty() {
            return Ok(SpaceCleaning::Nothing);
        }
        self.write_batch(&mut batch, WritebackCause::Eviction);
        Ok(if batch.written > 0 {
            SpaceCleaning::Cleaned
        } else {
            SpaceCleaning::InFlight
        })
    }

    /// One round of background write-back: write-behind ranges that never made a batch,
    /// aged data, then data above the background threshold. The first two hand down the runs
    /// of all objects stored on one device together, in that device's batches, and do not
    /// wait for them ([`Awaiting::Nothing`]). Errors are latched on their objects. Returns
    /// the blocks cleaned by writes that ended before it returned.
    pub(crate) fn writeback_tick(&self, objects: &[Arc<ObjectState>]) -> u64 {
        let now = self.clock.now_ns();
        let deadline = now.saturating_sub(self.dirty_age_max.as_nanos() as u64);
        let mut written = 0u64;
        for group in self.io.group_by_device(objects) {
            let mut batch = Batch::new(Awaiting::Nothing);
            for object in group {
                for (start, end) in object.take_write_behind() {
                    let range = (start, end, u64::MAX);
                    let cause = WritebackCause::WriteBehind;
                    self.claim_range_into(object, range, LockMode::Try, cause, &mut batch);
                }
            }
            self.write_batch(&mut batch, WritebackCause::WriteBehind);
            written += batch.written;
        }
        written += self
            .write_objects_dirtied_by(objects, deadline, WritebackCause::Age, Awaiting::Nothing)
            .0;
        let (background, _) = self.dirty_thresholds();
        while self.end.dirty_bytes.load(Ordering::Acquire) > background {
            match self.clean_one_cluster(objects, WritebackCause::Threshold) {
                Ok(0) | Err(_) => break,
                Ok(cleaned) => written += cleaned,
            }
        }
        written
    }

    /// Writes back one cluster of some object's dirty data, visiting objects round-robin.
    /// Returns the blocks cleaned; an error only when nothing could be cleaned and some
    /// write failed.
    pub(crate) fn clean_one_cluster(
        &self,
        objects: &[Arc<ObjectState>],
        cause: WritebackCause,
    ) -> Result<u64, CacheError> {
        if objects.is_empty() {
            return Ok(0);
        }
        let start = self.object_cursor.fetch_add(1, Ordering::Relaxed);
        let mut last_error = None;
        for step in 0..objects.len() {
            let object = &objects[(start + step) % objects.len()];
            match self.clean_claimed_cluster(object, cause) {
                Ok(0) => continue,
                Ok(cleaned) => return Ok(cleaned),
                Err(error) => last_error = Some(error),
            }
        }
        last_error.map_or(Ok(0), Err)
    }
}

impl RunEnd {
    /// After one write-back write: counts it, and marks its blocks clean if it succeeded or
    /// latches its error on the object if it failed (the blocks stay dirty).
    fn finish_write(
        &self,
        object: &ObjectState,
        buffers: &[Arc<Buffer>],
        offset: u64,
        result: std::io::Result<()>,
        cause: WritebackCause,
    ) -> Result<u64, CacheError> {
        if let Err(source) = result {
            let length_bytes = buffers.iter().map(|b| b.length_bytes as u64).sum();
            let error = self.io.error(object, "write", offset, length_bytes, source);
            object.latch_error(&error);
            return Err(error);
        }
        let cleaned = dirty::clear_all(
            &self.dirty_bytes,
            &object.dirty,
            buffers.iter().map(|buffer| buffer.as_ref()),
        );
        self.counters.writeback(cause, cleaned);
        if cause == WritebackCause::WriteBehind {
            for buffer in buffers {
                buffer.set(WRITTEN_BEHIND);
            }
        }
        // Clean buffers can be evicted: wake allocations waiting for space.
        self.table.notify_space();
        if buffers.len() > 1 {
            self.counters.write_clusters.fetch_add(1, Ordering::Relaxed);
            self.counters
                .write_cluster_buffers
                .fetch_add(buffers.len() as u64, Ordering::Relaxed);
        }
        Ok(cleaned)
    }

    /// Ends the claim [`Writeback::claim_run`] took, whether or not the write succeeded (only
    /// [`ClaimedRun`]'s drop calls it).
    fn release_claimed(&self, held: &[Arc<Buffer>]) {
        let mut waited = false;
        for buffer in held {
            waited |= end_writeback(buffer);
            // SAFETY: each was locked shared by claim_for_writeback.
            unsafe { buffer.unlock_shared() };
            self.table.unpin(buffer);
        }
        if waited {
            self.waiter.notify_all();
        }
    }
}

/// Runs claimed by one write-back pass and not yet written (each with its object; all
/// stored on one device), and what the pass has done.
struct Batch {
    runs: Vec<(Arc<ObjectState>, ClaimedRun)>,
    bytes: u64,
    /// Blocks cleaned by the pass's writes that ended before it returned.
    written: u64,
    first_error: Option<CacheError>,
    awaiting: Awaiting,
}

/// A run claimed for write-back ([`Writeback::claim_run`]): every buffer pinned, locked
/// shared and marked `WRITEBACK`, consecutive blocks contiguous on the device. Dropping it
/// ends the claim — after its write, whether or not that succeeded, or on an early return or
/// a panic — so no claim is ever left behind and no caller unlocks a buffer by hand. It owns
/// what it needs to end, so a write the device completes later carries it as its memory.
struct ClaimedRun {
    end: Arc<RunEnd>,
    buffers: Vec<Arc<Buffer>>,
}

impl WriteMemory for ClaimedRun {
    fn slices(&self) -> Vec<IoSlice<'_>> {
        self.buffers
            .iter()
            // SAFETY: the claim holds every buffer locked shared for as long as it exists.
            .map(|buffer| IoSlice::new(unsafe { buffer.device_bytes() }))
            .collect()
    }
}

impl ClaimedRun {
    fn buffers(&self) -> &[Arc<Buffer>] {
        &self.buffers
    }

    fn len(&self) -> usize {
        self.buffers.len()
    }

    fn is_empty(&self) -> bool {
        self.buffers.is_empty()
    }

    /// The block after the run's last (the run is not empty).
    fn end_block(&self) -> u64 {
        self.buffers.last().expect("a claimed run").key.block + 1
    }
}

impl Drop for ClaimedRun {
    fn drop(&mut self) {
        self.end.release_claimed(&self.buffers);
    }
}

impl Batch {
    fn new(awaiting: Awaiting) -> Self {
        Batch {
            runs: Vec::new(),
            bytes: 0,
            written: 0,
            first_error: None,
            awaiting,
        }
    }

    fn add(&mut self, object: &Arc<ObjectState>, run: ClaimedRun) {
        self.bytes += run.len() as u64 * u64::from(object.block_size_bytes);
        self.runs.push((Arc::clone(object), run));
    }

    /// True when `writes_max` runs or `WRITEBACK_BATCH_BYTES_MAX` are claimed.
    fn is_full(&self, writes_max: usize) -> bool {
        self.runs.len() >= writes_max || self.bytes >= WRITEBACK_BATCH_BYTES_MAX
    }
}

/// The bytes of a run held for write-back (locked shared by its claim, or exclusively by its
/// writer), lent to the device as one write's memory.
///
/// Its slices are read only while the run is held: [`Writeback::write_runs`] does not return,
/// and so does not let the hold go, until the device has completed the write, and a completed
/// write hands this memory to its completion, which drops it.
struct HeldBytes(Vec<Arc<Buffer>>);

impl WriteMemory for HeldBytes {
    fn slices(&self) -> Vec<IoSlice<'_>> {
        self.0
            .iter()
            // SAFETY: the run is held (see the type's docs) while any slice is in use.
            .map(|buffer| IoSlice::new(unsafe { buffer.device_bytes() }))
            .collect()
    }
}

/// Claims one block of a write unit being filled ([`Writeback::claim_filled_unit`]): locked
/// shared without waiting, valid, and not in another write-back. Dirty or clean alike.
fn claim_unit_block(buffer: &Buffer) -> bool {
    if !buffer.try_lock_shared() {
        return false;
    }
    if buffer.has(VALID) && buffer.set(WRITEBACK) {
        return true;
    }
    // SAFETY: locked shared just above.
    unsafe { buffer.unlock_shared() };
    false
}

/// Ends `buffer`'s write-back in flight (and forgets any waiter's mark with it, in the same
/// step); true when a thread marked that it waits, so the caller must wake the waiters.
fn end_writeback(buffer: &Buffer) -> bool {
    let ended = buffer.take(WRITEBACK | WRITEBACK_WAITED);
    strict_assert!(ended & WRITEBACK != 0, "only a write-back in flight ends");
    ended & WRITEBACK_WAITED != 0
}

/// Counts a writer in `throttle_writer` for as long as it is there (also when it returns
/// early with an error).
struct ThrottledWriter<'a>(&'a AtomicUsize);

impl<'a> ThrottledWriter<'a> {
    fn new(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::AcqRel);
        ThrottledWriter(count)
    }
}

impl Drop for ThrottledWriter<'_> {
    fn drop(&mut self) {
        let before = self.0.fetch_sub(1, Ordering::AcqRel);
        strict_assert!(before > 0, "a throttled writer leaves once");
    }
}
