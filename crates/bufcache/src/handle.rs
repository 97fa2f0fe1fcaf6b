//! Object handles: the byte-range calls the NBD server uses (read, write, flush, discard,
//! write-zeroes, extents, prefetch) as a thin façade. Each call delegates to the module that
//! owns its path: reads to `read`, writes, discards and zeroing to `write`, allocation and
//! residency maps to `residency`; the BSD buffer calls (`getblk`, `bread`, …) are a layer
//! over the same paths in module `bsd`.
//!
//! Invariant: each [`ObjectHandle`] remembers the last write-back error sequence it reported,
//! so every handle hears of every write-back error once (errseq); only the object's error
//! latch (module `object`) changes that position.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use crate::cache::{Cache, Inner};
use crate::error::CacheError;
use crate::object::{ObjectConfig, ObjectState};
use crate::read::{ReadSink, Reader, StartedReadDone};
use crate::residency::{RangeMaps, ResidencyRun};
use crate::write::{WriteSource, Writer, ZeroOptions};
use bufcache_device::{Device, Extent};

impl Cache {
    /// Registers an object (an export, a file) stored on `config.device` and returns a handle.
    pub fn open_object(&self, config: ObjectConfig) -> Result<ObjectHandle, CacheError> {
        let state = self.inner.add_object(config)?;
        Ok(ObjectHandle::new(self.clone(), state))
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

    /// The read path of this object.
    pub(crate) fn reader(&self) -> Reader<'_> {
        Reader::new(self.inner(), &self.object)
    }

    /// The write path of this object, reporting errors to this handle.
    pub(crate) fn writer(&self) -> Writer<'_> {
        Writer::new(self.inner(), &self.object, &self.seen_error_sequence)
    }

    fn ranges(&self) -> RangeMaps<'_> {
        RangeMaps::new(self.inner(), &self.object)
    }

    /// Passes `result` through; an error returned to this handle now also counts as reported
    /// to it, so its next flush does not report the same latched error a second time.
    pub(crate) fn reported<T>(&self, result: Result<T, CacheError>) -> Result<T, CacheError> {
        if result.is_err() {
            self.object.mark_errors_seen(&self.seen_error_sequence);
        }
        result
    }

    /// Writes every dirty block of this object back and flushes the device. Every write that
    /// completed before this call is durable when it returns `Ok`. Reports this handle's
    /// unseen write-back errors once.
    pub fn flush(&self) -> Result<(), CacheError> {
        let started_ns = self.inner().writeback().now_ns();
        self.writer().start_flush_helpers(started_ns);
        let result = self
            .inner()
            .writeback()
            .fsync_dirtied_by(&self.object, started_ns);
        let unseen = self.object.unseen_error(&self.seen_error_sequence);
        result?;
        unseen.map_or(Ok(()), Err)
    }

    // ----- byte-range API -----

    /// Reads `target.len()` bytes at `offset`, through the cache, with read-ahead for
    /// sequential streams and clustered device reads for runs of misses.
    pub fn read_at(&self, offset: u64, target: &mut [u8]) -> Result<(), CacheError> {
        self.reader().read_at(offset, target)
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
        self.reader().read_with(offset, target, send)
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
        self.reader().start_read(offset, length_bytes, done)
    }

    /// True when the byte range is in the cache now, so reading it will not wait for the
    /// device (a hint: it may change at once). A block still being read in counts: a server
    /// serves such a read on the thread that reads requests, which then waits for the fill
    /// before it takes the client's next request (see rule 7 of "Admission under pressure"
    /// in docs/design.md for why that is kept). Every block is checked, one table probe per
    /// chunk of 16 blocks, for ranges of up to 64 chunks; longer ranges are sampled by whole
    /// chunks (see `Table::run_present`).
    pub fn is_resident(&self, offset: u64, length_bytes: u64) -> bool {
        self.reader().is_resident(offset, length_bytes)
    }

    /// NBD_CMD_CACHE: reads `[offset, offset + length)` into the cache.
    pub fn prefetch(&self, offset: u64, length_bytes: u64) -> Result<(), CacheError> {
        self.reader().prefetch(offset, length_bytes)
    }

    /// True when the caller should do a write of the byte range in the thread that received
    /// it, its data copied straight into the cache: no FUA, a block the write covers only in
    /// part is cached (so it need not be read first), and either the dirty data stays under
    /// the throttling limit (the write waits for no device) or enough writers wait above it
    /// already (`THROTTLED_WRITERS_MAX`: this one is to pace whoever sent it, see
    /// docs/design.md, rule 8 of "Admission under pressure"). A hint, like `is_resident`.
    pub fn write_is_quick(&self, offset: u64, length_bytes: u64, fua: bool) -> bool {
        self.writer().write_is_quick(offset, length_bytes, fua)
    }

    /// Writes `data` at `offset` into the cache (delayed write). With `fua`, the written
    /// blocks reach the device and the device is flushed before this returns.
    pub fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), CacheError> {
        self.writer().write_at(offset, data, fua)
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
        self.writer().write_from(offset, length_bytes, fua, source)
    }

    /// Drops the clean cached blocks overlapping `[offset, offset + length_bytes)` (clipped to
    /// the object), so the next read of them asks the device again: for a device whose data
    /// changed under the cache (a read replica that refreshed). Dirty blocks are kept. A read
    /// of such a block in flight holds its buffer, so it finishes first and is dropped too.
    pub fn forget_clean(&self, offset: u64, length_bytes: u64) {
        self.writer().forget_clean(offset, length_bytes)
    }

    /// Drops cached blocks wholly inside the range and tells the device the range is unused.
    /// Blocks partly inside keep their data (a discard is advisory).
    pub fn discard(&self, offset: u64, length_bytes: u64) -> Result<(), CacheError> {
        self.writer().discard(offset, length_bytes)
    }

    /// Makes the range read as zeroes, durable on return with `fua`. The same as
    /// [`ObjectHandle::zero`] with the device allowed to deallocate and no demand for speed.
    pub fn write_zeroes(
        &self,
        offset: u64,
        length_bytes: u64,
        fua: bool,
    ) -> Result<(), CacheError> {
        self.writer().write_zeroes(offset, length_bytes, fua)
    }

    /// True when zeroing whole blocks costs the device no data transfer (a hole, a protocol
    /// command), so a caller asking for a fast zero can be served.
    pub fn can_zero_fast(&self) -> bool {
        self.writer().can_zero_fast()
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
        self.writer().zero(offset, length_bytes, options)
    }

    /// The allocation map of a byte range, exact while data is dirty: blocks dirty in the
    /// cache are data, and every other byte is as the device reports it (a block is clean
    /// only once the device accepted its bytes, so the device's answer is true for it).
    /// Adjacent runs with the same state are merged. The device is asked only about the span
    /// that is not all dirty, widened to its alignment (an NBD upstream with a minimum block
    /// size refuses unaligned queries) and cut back to the range afterwards. The extents
    /// cover the range from `offset`, or a prefix of it when the device answered less.
    pub fn extents(&self, offset: u64, length_bytes: u64) -> Result<Vec<Extent>, CacheError> {
        self.ranges().extents(offset, length_bytes)
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
        self.ranges().residency(offset, length_bytes)
    }
}
