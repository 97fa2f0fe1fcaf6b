//! The write path of the byte-range calls: writes into the cache (a group of blocks at a
//! time, straight from the caller's source), FUA, write-behind of completed clusters, flush
//! helpers, and the calls that replace a range on the device (discard, zeroing) or drop it
//! from the cache. Write-back itself (clustered writes of dirty buffers, fsync, throttling)
//! is module `writeback`'s; the object handle only delegates here.
//!
//! Invariants:
//! - a partial-block write reads the block first only when it is not cached;
//! - no buffer lock is held while waiting for space;
//! - a byte the client never sent never becomes valid (a failed source drops fresh blocks);
//! - a discard or zeroing keeps dirty blocks held until the device answered, so no reader
//!   reads device bytes older than a write the cache held.

use std::io::IoSliceMut;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use bufcache_policy::Placement;

use crate::buffer::{Buffer, VALID, WRITTEN_BEHIND};
use crate::cache::{Inner, Urgency};
use crate::error::CacheError;
use crate::guard::BufferGuard;
use crate::io::Io;
use crate::object::ObjectState;
use crate::read::Reader;
use crate::stats::WritebackCause;
use crate::table::{Lookup, RunLookup};
use crate::writeback::LockMode;

/// Fills the slices of a write with its data, in order (see [`crate::ObjectHandle::write_from`]).
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

/// How [`crate::ObjectHandle::zero`] may zero a range.
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

/// The write path of one object, borrowed from a handle for one call, with the handle's
/// error-reporting position (errseq).
pub(crate) struct Writer<'h> {
    inner: &'h Arc<Inner>,
    object: &'h Arc<ObjectState>,
    seen_error_sequence: &'h AtomicU64,
}

impl<'h> Writer<'h> {
    pub(crate) fn new(
        inner: &'h Arc<Inner>,
        object: &'h Arc<ObjectState>,
        seen_error_sequence: &'h AtomicU64,
    ) -> Self {
        Writer {
            inner,
            object,
            seen_error_sequence,
        }
    }

    fn inner(&self) -> &'h Arc<Inner> {
        self.inner
    }

    fn reader(&self) -> Reader<'h> {
        Reader::new(self.inner, self.object)
    }

    /// Passes `result` through; an error returned to the handle now also counts as reported
    /// to it (see `ObjectHandle::reported`).
    fn reported<T>(&self, result: Result<T, CacheError>) -> Result<T, CacheError> {
        if result.is_err() {
            self.object.mark_errors_seen(self.seen_error_sequence);
        }
        result
    }

    /// The body of [`crate::ObjectHandle::write_is_quick`].
    pub(crate) fn write_is_quick(&self, offset: u64, length_bytes: u64, fua: bool) -> bool {
        let object = &self.object;
        if fua || object.read_only || object.check_range(offset, length_bytes).is_err() {
            return false;
        }
        let inner = self.inner();
        let (_, limit) = inner.writeback().dirty_thresholds();
        if inner.writeback().dirty_bytes() + length_bytes > limit
            && !inner.writeback().writers_throttled_enough()
        {
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

    /// The body of [`crate::ObjectHandle::write_at`].
    pub(crate) fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), CacheError> {
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

    /// The body of [`crate::ObjectHandle::write_from`].
    pub(crate) fn write_from(
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
        let (within, length) = range.piece(self.object, block);
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
                range.piece(self.object, piece_block)
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
            .mark_dirty_all(self.object, &written);
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
        let guard = BufferGuard::new(inner, self.object, buffer);
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
        self.reader().device_read(&mut run, device_offset)?;
        Ok((run.pop().expect("one guard"), false))
    }

    /// Holds `block` exclusively: a cached valid buffer, or a newly inserted invalid one.
    /// A buffer found invalid was being filled by a reader that failed and removed it, so
    /// the block is looked up again.
    pub(crate) fn hold_exclusive(&self, block: u64) -> Result<BufferGuard, CacheError> {
        let inner = self.inner();
        loop {
            let key = self.object.key(block);
            match inner.lookup_or_insert(key, self.object, Placement::Normal, Urgency::Wait)? {
                Lookup::Found(buffer) => {
                    buffer.lock_exclusive();
                    let guard = BufferGuard::new(inner, self.object, buffer);
                    if guard.is_valid() {
                        return Ok(guard);
                    }
                }
                Lookup::Inserted(buffer) => {
                    return Ok(BufferGuard::new(inner, self.object, buffer))
                }
            }
        }
    }

    pub(crate) fn mark_dirty(&self, guard: &BufferGuard) {
        guard.buffer.set(VALID);
        self.inner()
            .writeback()
            .mark_dirty(self.object, &guard.buffer);
    }

    /// Writes the dirty blocks of `[first, end)` to the device now and flushes it (FUA).
    fn write_through(&self, first: u64, end: u64) -> Result<(), CacheError> {
        self.inner().writeback().write_range(
            self.object,
            first,
            end,
            LockMode::Wait,
            WritebackCause::Flush,
        )?;
        self.inner().writeback().flush_device(self.object)
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
        let target = Arc::clone(self.object);
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
    pub(crate) fn start_flush_helpers(&self, dirtied_by_ns: u64) {
        /// A helper is worth starting for at least this many dirty blocks.
        const BLOCKS_PER_HELPER_MIN: usize = 4;
        let wanted = self.inner().writeback().flush_helpers_wanted(self.object);
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
            let object = Arc::clone(self.object);
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

    /// The body of [`crate::ObjectHandle::forget_clean`].
    pub(crate) fn forget_clean(&self, offset: u64, length_bytes: u64) {
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

    /// The body of [`crate::ObjectHandle::discard`].
    pub(crate) fn discard(&self, offset: u64, length_bytes: u64) -> Result<(), CacheError> {
        self.object.check_writable()?;
        self.object.check_range(offset, length_bytes)?;
        let (first, end) = self.whole_blocks(offset, length_bytes);
        self.replace_on_device(first, end, |io, object, at, length| {
            io.discard(object, at, length)
        })
    }

    /// The body of [`crate::ObjectHandle::write_zeroes`].
    pub(crate) fn write_zeroes(
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

    /// The body of [`crate::ObjectHandle::can_zero_fast`].
    pub(crate) fn can_zero_fast(&self) -> bool {
        self.inner()
            .io()
            .capabilities(self.object)
            .write_zeroes_fast
    }

    /// The body of [`crate::ObjectHandle::zero`].
    pub(crate) fn zero(
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
                self.object,
                offset / block_size,
                (offset + length_bytes).div_ceil(block_size),
                LockMode::Wait,
                WritebackCause::Flush,
            ))?;
            self.reported(self.inner().writeback().flush_device(self.object))?;
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
            let mut guard = BufferGuard::new(inner, self.object, buffer);
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
            let mut guard = BufferGuard::new(inner, self.object, buffer);
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
            .forget_dirty(self.object, &guard.buffer);
    }
}
