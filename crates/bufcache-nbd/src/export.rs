//! The [`Export`] trait: what the NBD server needs from whatever it serves, plus
//! [`MemoryExport`], a sparse in-memory export for tests and demos.
//!
//! The server validates every request (range, flags, read-only) before it calls an export,
//! so an implementation may assume `offset + length <= size()` and that writes only reach a
//! writable export. Implementations are called from many worker threads at once and must be
//! internally synchronised. `flush` is the durability barrier: the server does not answer an
//! `NBD_CMD_FLUSH` until it returns, and answers a FUA write only after `write` returned.

use std::io::{self, IoSlice, IoSliceMut};
use std::sync::Arc;

use parking_lot::RwLock;

/// Fills the slices of a write with its data, in order (see [`Export::write_from`]).
pub type WriteSource<'a> = dyn FnMut(&mut [IoSliceMut<'_>]) -> io::Result<()> + 'a;

/// Receives the bytes of a read ([`Export::read_with`]): slices covering them, in order.
pub type ReadSink<'a> = dyn FnMut(&[IoSlice<'_>]) -> io::Result<()> + 'a;

/// The bytes of a read [`Export::start_read`] finished, held by the export (a cache's own
/// buffers, which writers of those blocks wait for) until this is dropped: the server sends
/// them and then lets go.
pub trait HeldRead: Send {
    /// The bytes read, in order.
    fn slices(&self) -> Vec<IoSlice<'_>>;
}

/// A read's bytes as [`Export::start_read`] hands them over.
pub type StartedRead = Box<dyn HeldRead>;

/// What [`Export::start_read`] runs when its read ends: the bytes, or the error.
pub type ReadDone = Box<dyn FnOnce(io::Result<StartedRead>) + Send>;

/// One run of the export's address space with a single allocation state, as reported by
/// [`Export::block_status`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockStatusExtent {
    /// Length of the run in bytes (never zero).
    pub length: u64,
    /// Not allocated in the backing store (`NBD_STATE_HOLE`).
    pub hole: bool,
    /// Reads as zeroes (`NBD_STATE_ZERO`).
    pub zero: bool,
}

/// One run of the export's address space with a single cache state, as reported by
/// [`Export::cache_state`] for the `x-bufcache:state` metadata context.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheStateExtent {
    /// Length of the run in bytes (never zero).
    pub length: u64,
    /// In the cache (`CACHE_STATE_RESIDENT`).
    pub resident: bool,
    /// In the cache and newer than the backend (`CACHE_STATE_DIRTY`; implies resident).
    pub dirty: bool,
}

/// [`Export::start_read`] of an export whose reads always finish in the caller's thread.
pub fn never_start_read(done: ReadDone) -> Result<(), ReadDone> {
    Err(done)
}

/// Something the server can export: a fixed-size array of bytes. An export that wraps
/// another implements [`ExportLayer`] instead, which forwards whatever it does not add.
pub trait Export: Send + Sync {
    /// Size in bytes. Each connection is told the size once, at its handshake, and keeps it;
    /// an export that grows (a served disk resized) shows the new size to new connections
    /// only, so the size may grow but never shrink while connections are open.
    fn size(&self) -> u64;
    /// True when every write, trim and zero must be refused with EPERM.
    fn read_only(&self) -> bool;
    /// Human-readable description sent in `NBD_INFO_DESCRIPTION` (empty: none sent).
    fn description(&self) -> String {
        String::new()
    }
    /// Preferred block size in bytes, sent in `NBD_INFO_BLOCK_SIZE`.
    fn preferred_block_size(&self) -> u32 {
        4096
    }
    /// Fills `buffer` from `offset`.
    fn read(&self, offset: u64, buffer: &mut [u8]) -> io::Result<()>;
    /// Reads `buffer.len()` bytes at `offset` and hands them to `send` once: as slices of the
    /// export's own memory when it can (a cache sends its buffers; nothing is copied into
    /// `buffer`), else of `buffer` after filling it. `send` is not called when the read
    /// fails; its own error is returned as it is. [`read_via_buffer`] implements it for an
    /// export without buffers of its own.
    fn read_with(&self, offset: u64, buffer: &mut [u8], send: &mut ReadSink<'_>) -> io::Result<()>;
    /// Writes `data` at `offset`; with `fua`, the data is durable when this returns.
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> io::Result<()>;
    /// Writes `length` bytes at `offset` whose data `source` reads straight into the export's
    /// own memory (a cache reads the socket into its buffers: one copy). `source` must be
    /// called until it has filled `length` bytes, unless the export fails first; the server
    /// skips whatever it did not consume. [`write_via_buffer`] implements it for an export
    /// without buffers of its own.
    fn write_from(
        &self,
        offset: u64,
        length: u64,
        fua: bool,
        source: &mut WriteSource<'_>,
    ) -> io::Result<()>;
    /// Makes every write that completed before this call durable.
    fn flush(&self) -> io::Result<()>;
    /// Hint that `length` bytes at `offset` are no longer needed.
    fn trim(&self, offset: u64, length: u64, fua: bool) -> io::Result<()>;
    /// may_trim = !NO_HOLE; fast_only = FAST_ZERO: return Err(ErrorKind::Unsupported) at once if zeroing would be slow.
    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        may_trim: bool,
        fast_only: bool,
        fua: bool,
    ) -> io::Result<()>;
    /// True when [`Export::write_zeroes`] with `fast_only` can ever succeed, so the server
    /// advertises `NBD_FLAG_SEND_FAST_ZERO`.
    fn can_fast_zero(&self) -> bool {
        false
    }
    /// Hint to bring `length` bytes at `offset` into the cache.
    fn cache(&self, offset: u64, length: u64) -> io::Result<()>;
    /// The most of one CACHE request worth doing (for a cache: its size; more would evict
    /// what the request itself brought in). The server does the rest of the range no more.
    fn cache_request_bytes_max(&self) -> u64;
    /// True when a READ of this range will finish without waiting for slow I/O (for a
    /// cache: every block is resident). The thread that read the request then serves it
    /// without passing the reading role on. Required, like every method a wrapper must
    /// forward: a defaulted one would be silently dropped by a wrapper that forgot it.
    fn read_is_quick(&self, offset: u64, length: u64) -> bool;
    /// Starts a READ that ends on a thread of its own, without the caller waiting (for a
    /// cache: every block missing, over an upstream whose replies arrive on their own
    /// thread), and returns; `done` then gets the bytes or the error on whichever thread
    /// ends the read (it may be this one, before this returns). `Err(done)` when the read
    /// cannot start that way: the caller serves it with [`Export::read_with`]. The server
    /// serves a read that failed so again with `read_with`, which is where errors are
    /// reported (and an upstream reconnects). [`never_start_read`] implements it for an
    /// export that always reads in the caller's thread. Required, like `read_is_quick`.
    fn start_read(&self, offset: u64, length: u32, done: ReadDone) -> Result<(), ReadDone>;
    /// True when the thread that read this WRITE should serve it, its payload read by
    /// [`Export::write_from`] straight from the socket: it will finish without waiting for
    /// slow I/O (for a cache: no FUA, the dirty data under its limit, any partly written
    /// block already resident), or its wait is meant to pace this connection (a cache whose
    /// writers already wait for write-back: the client that outruns the device then waits
    /// too, its further requests left in the socket).
    fn write_is_quick(&self, offset: u64, length: u64, fua: bool) -> bool;
    /// A per-connection view of this export, called once when a connection enters
    /// transmission; `None` (the default) shares this export with every connection. A cache
    /// uses it to give each connection its own position for reporting write-back errors, so
    /// every connection's next FLUSH hears of an error once.
    fn open_connection(&self) -> Option<Arc<dyn Export>> {
        None
    }
    /// Consecutive extents covering [offset, offset+length) (may stop early, at least one); hole => NBD_STATE_HOLE|NBD_STATE_ZERO, zero-only => NBD_STATE_ZERO.
    fn block_status(&self, offset: u64, length: u64) -> io::Result<Vec<BlockStatusExtent>>;
    /// True when the export answers [`Export::cache_state`] (it is a cache): the server then
    /// offers the `x-bufcache:state` metadata context for it.
    fn has_cache_state(&self) -> bool;
    /// Which bytes of `[offset, offset + length)` are in the cache and which are dirty, as
    /// consecutive extents from `offset` (at least one; they may stop early). Only called
    /// when [`Export::has_cache_state`] is true.
    fn cache_state(&self, offset: u64, length: u64) -> io::Result<Vec<CacheStateExtent>>;
    /// The parts of `[offset, offset + length)` the export knows read as zeroes without
    /// reading them, as ordered, disjoint `(offset, length)` ranges inside it (a cache: what
    /// was zeroed or trimmed and not written since; a memory export: its unallocated pages).
    /// Empty when it knows of none. A structured READ answers these with `OFFSET_HOLE` chunks.
    fn known_zeroes(&self, offset: u64, length: u64) -> Vec<(u64, u64)>;
    /// Asked after a WRITE, FLUSH, TRIM or WRITE_ZEROES succeeded, just before its success is
    /// sent: an error is sent instead. A server holding its disk under a lease (the S3 log
    /// layout) answers an error once the lease lapsed, so that no two servers ever
    /// acknowledge writes to one disk. An export that wraps another forwards it (see
    /// [`ExportLayer`]).
    fn may_acknowledge_changes(&self) -> io::Result<()> {
        Ok(())
    }
}

/// An export that adds something to another (counting, observing, gating) and otherwise is
/// that other export: every method forwards to [`ExportLayer::inner`] unless the layer
/// overrides it, and every [`ExportLayer`] is an [`Export`]. This is the one way to wrap an
/// export: a layer names only what it adds, so adding a method to [`Export`] means adding
/// it here with a forwarding default (and to the impl below, which clippy's
/// `missing_trait_methods` keeps complete) and no layer is edited; and no layer can drop a
/// capability of what it wraps by forgetting a method, since no default here answers
/// "unsupported".
pub trait ExportLayer: Send + Sync + 'static {
    /// The export this layer wraps.
    fn inner(&self) -> &Arc<dyn Export>;
    /// This layer over `inner`, a connection's view of [`ExportLayer::inner`] (see
    /// [`Export::open_connection`]): required, so that each layer says how it carries its
    /// own state (counters, observers) into a connection's view.
    fn over(&self, inner: Arc<dyn Export>) -> Arc<dyn Export>;

    /// [`Export::size`].
    fn size(&self) -> u64 {
        self.inner().size()
    }
    /// [`Export::read_only`].
    fn read_only(&self) -> bool {
        self.inner().read_only()
    }
    /// [`Export::description`].
    fn description(&self) -> String {
        self.inner().description()
    }
    /// [`Export::preferred_block_size`].
    fn preferred_block_size(&self) -> u32 {
        self.inner().preferred_block_size()
    }
    /// [`Export::read`].
    fn read(&self, offset: u64, buffer: &mut [u8]) -> io::Result<()> {
        self.inner().read(offset, buffer)
    }
    /// [`Export::read_with`].
    fn read_with(&self, offset: u64, buffer: &mut [u8], send: &mut ReadSink<'_>) -> io::Result<()> {
        self.inner().read_with(offset, buffer, send)
    }
    /// [`Export::write`].
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> io::Result<()> {
        self.inner().write(offset, data, fua)
    }
    /// [`Export::write_from`].
    fn write_from(
        &self,
        offset: u64,
        length: u64,
        fua: bool,
        source: &mut WriteSource<'_>,
    ) -> io::Result<()> {
        self.inner().write_from(offset, length, fua, source)
    }
    /// [`Export::flush`].
    fn flush(&self) -> io::Result<()> {
        self.inner().flush()
    }
    /// [`Export::trim`].
    fn trim(&self, offset: u64, length: u64, fua: bool) -> io::Result<()> {
        self.inner().trim(offset, length, fua)
    }
    /// [`Export::write_zeroes`].
    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        may_trim: bool,
        fast_only: bool,
        fua: bool,
    ) -> io::Result<()> {
        self.inner()
            .write_zeroes(offset, length, may_trim, fast_only, fua)
    }
    /// [`Export::can_fast_zero`].
    fn can_fast_zero(&self) -> bool {
        self.inner().can_fast_zero()
    }
    /// [`Export::cache`].
    fn cache(&self, offset: u64, length: u64) -> io::Result<()> {
        self.inner().cache(offset, length)
    }
    /// [`Export::cache_request_bytes_max`].
    fn cache_request_bytes_max(&self) -> u64 {
        self.inner().cache_request_bytes_max()
    }
    /// [`Export::read_is_quick`].
    fn read_is_quick(&self, offset: u64, length: u64) -> bool {
        self.inner().read_is_quick(offset, length)
    }
    /// [`Export::start_read`].
    fn start_read(&self, offset: u64, length: u32, done: ReadDone) -> Result<(), ReadDone> {
        self.inner().start_read(offset, length, done)
    }
    /// [`Export::write_is_quick`].
    fn write_is_quick(&self, offset: u64, length: u64, fua: bool) -> bool {
        self.inner().write_is_quick(offset, length, fua)
    }
    /// [`Export::open_connection`]: the inner export's view of the connection with this
    /// layer over it ([`ExportLayer::over`]), or `None` (shared) when the inner export
    /// shares itself.
    fn open_connection(&self) -> Option<Arc<dyn Export>> {
        self.inner().open_connection().map(|inner| self.over(inner))
    }
    /// [`Export::block_status`].
    fn block_status(&self, offset: u64, length: u64) -> io::Result<Vec<BlockStatusExtent>> {
        self.inner().block_status(offset, length)
    }
    /// [`Export::has_cache_state`].
    fn has_cache_state(&self) -> bool {
        self.inner().has_cache_state()
    }
    /// [`Export::cache_state`].
    fn cache_state(&self, offset: u64, length: u64) -> io::Result<Vec<CacheStateExtent>> {
        self.inner().cache_state(offset, length)
    }
    /// [`Export::known_zeroes`].
    fn known_zeroes(&self, offset: u64, length: u64) -> Vec<(u64, u64)> {
        self.inner().known_zeroes(offset, length)
    }
    /// [`Export::may_acknowledge_changes`].
    fn may_acknowledge_changes(&self) -> io::Result<()> {
        self.inner().may_acknowledge_changes()
    }
}

// Every method spelled out, the defaulted ones too: a method of `Export` left to its default
// here would answer the default instead of the inner export (clippy refuses that).
#[deny(clippy::missing_trait_methods)]
impl<L: ExportLayer> Export for L {
    fn size(&self) -> u64 {
        ExportLayer::size(self)
    }
    fn read_only(&self) -> bool {
        ExportLayer::read_only(self)
    }
    fn description(&self) -> String {
        ExportLayer::description(self)
    }
    fn preferred_block_size(&self) -> u32 {
        ExportLayer::preferred_block_size(self)
    }
    fn read(&self, offset: u64, buffer: &mut [u8]) -> io::Result<()> {
        ExportLayer::read(self, offset, buffer)
    }
    fn read_with(&self, offset: u64, buffer: &mut [u8], send: &mut ReadSink<'_>) -> io::Result<()> {
        ExportLayer::read_with(self, offset, buffer, send)
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> io::Result<()> {
        ExportLayer::write(self, offset, data, fua)
    }
    fn write_from(
        &self,
        offset: u64,
        length: u64,
        fua: bool,
        source: &mut WriteSource<'_>,
    ) -> io::Result<()> {
        ExportLayer::write_from(self, offset, length, fua, source)
    }
    fn flush(&self) -> io::Result<()> {
        ExportLayer::flush(self)
    }
    fn trim(&self, offset: u64, length: u64, fua: bool) -> io::Result<()> {
        ExportLayer::trim(self, offset, length, fua)
    }
    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        may_trim: bool,
        fast_only: bool,
        fua: bool,
    ) -> io::Result<()> {
        ExportLayer::write_zeroes(self, offset, length, may_trim, fast_only, fua)
    }
    fn can_fast_zero(&self) -> bool {
        ExportLayer::can_fast_zero(self)
    }
    fn cache(&self, offset: u64, length: u64) -> io::Result<()> {
        ExportLayer::cache(self, offset, length)
    }
    fn cache_request_bytes_max(&self) -> u64 {
        ExportLayer::cache_request_bytes_max(self)
    }
    fn read_is_quick(&self, offset: u64, length: u64) -> bool {
        ExportLayer::read_is_quick(self, offset, length)
    }
    fn start_read(&self, offset: u64, length: u32, done: ReadDone) -> Result<(), ReadDone> {
        ExportLayer::start_read(self, offset, length, done)
    }
    fn write_is_quick(&self, offset: u64, length: u64, fua: bool) -> bool {
        ExportLayer::write_is_quick(self, offset, length, fua)
    }
    fn open_connection(&self) -> Option<Arc<dyn Export>> {
        ExportLayer::open_connection(self)
    }
    fn block_status(&self, offset: u64, length: u64) -> io::Result<Vec<BlockStatusExtent>> {
        ExportLayer::block_status(self, offset, length)
    }
    fn has_cache_state(&self) -> bool {
        ExportLayer::has_cache_state(self)
    }
    fn cache_state(&self, offset: u64, length: u64) -> io::Result<Vec<CacheStateExtent>> {
        ExportLayer::cache_state(self, offset, length)
    }
    fn known_zeroes(&self, offset: u64, length: u64) -> Vec<(u64, u64)> {
        ExportLayer::known_zeroes(self, offset, length)
    }
    fn may_acknowledge_changes(&self) -> io::Result<()> {
        ExportLayer::may_acknowledge_changes(self)
    }
}

/// Says whether changes to an export may still be acknowledged (see
/// [`Export::may_acknowledge_changes`]).
pub trait AcknowledgeGate: Send + Sync {
    fn may_acknowledge_changes(&self) -> io::Result<()>;
}

/// [`Export::cache_state`] for an export that is no cache.
pub fn no_cache_state() -> io::Result<Vec<CacheStateExtent>> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "the export is not a cache: it has no x-bufcache:state",
    ))
}

/// [`Export::read_with`] for an export without buffers of its own: [`Export::read`] into
/// `buffer`, then `send` it.
pub fn read_via_buffer(
    export: &dyn Export,
    offset: u64,
    buffer: &mut [u8],
    send: &mut ReadSink<'_>,
) -> io::Result<()> {
    export.read(offset, buffer)?;
    send(&[io::IoSlice::new(buffer)])
}

/// [`Export::write_from`] for an export without buffers of its own: reads the data into a
/// temporary buffer, then calls [`Export::write`].
pub fn write_via_buffer(
    export: &dyn Export,
    offset: u64,
    length: u64,
    fua: bool,
    source: &mut WriteSource<'_>,
) -> io::Result<()> {
    let mut data = vec![0u8; length as usize];
    source(&mut [io::IoSliceMut::new(&mut data)])?;
    export.write(offset, &data, fua)
}

/// Size of one page of a [`MemoryExport`]; holes are tracked at this granularity.
pub const MEMORY_PAGE_BYTES: u64 = 64 * 1024;

/// A sparse export held in memory: pages are allocated on first write and freed by trim, so
/// block status reports real holes. Each page has its own lock, so requests to different
/// pages run in parallel.
pub struct MemoryExport {
    size_bytes: u64,
    read_only: bool,
    description: String,
    pages: Vec<RwLock<Option<Box<[u8]>>>>,
}

impl MemoryExport {
    /// A writable export of `size_bytes` zero bytes.
    pub fn new(size_bytes: u64) -> Self {
        let page_count = size_bytes.div_ceil(MEMORY_PAGE_BYTES) as usize;
        MemoryExport {
            size_bytes,
            read_only: false,
            description: String::new(),
            pages: (0..page_count).map(|_| RwLock::new(None)).collect(),
        }
    }

    /// The same export, refusing writes.
    pub fn with_read_only(mut self, read_only: bool) -> Self {
        self.read_only = read_only;
        self
    }

    /// The same export, with a description for `NBD_INFO_DESCRIPTION`.
    pub fn with_description(mut self, description: impl Into<String>) -> Self {
        self.description = description.into();
        self
    }

    /// Calls `visit(page_index, offset_in_page, range_in_request)` for each page piece of
    /// `length` bytes at `offset`.
    fn for_each_piece(
        &self,
        offset: u64,
        length: u64,
        mut visit: impl FnMut(usize, usize, std::ops::Range<usize>),
    ) {
        let mut done = 0u64;
        while done < length {
            let position = offset + done;
            let page_index = (position / MEMORY_PAGE_BYTES) as usize;
            let offset_in_page = (position % MEMORY_PAGE_BYTES) as usize;
            let step = (length - done).min(MEMORY_PAGE_BYTES - offset_in_page as u64) as usize;
            visit(
                page_index,
                offset_in_page,
                done as usize..done as usize + step,
            );
            done += step as u64;
        }
    }

    /// Zeroes a range; whole pages are freed when `may_free` (so they read as holes).
    fn zero_range(&self, offset: u64, length: u64, may_free: bool) {
        let mut position = offset;
        let end = offset + length;
        while position < end {
            let page_index = (position / MEMORY_PAGE_BYTES) as usize;
            let offset_in_page = (position % MEMORY_PAGE_BYTES) as usize;
            let step = (end - position).min(MEMORY_PAGE_BYTES - offset_in_page as u64) as usize;
            let mut page = self.pages[page_index].write();
            if may_free && step as u64 == MEMORY_PAGE_BYTES {
                *page = None;
            } else if let Some(bytes) = page.as_mut() {
                bytes[offset_in_page..offset_in_page + step].fill(0);
            }
            position += step as u64;
        }
    }

    fn check_range(&self, offset: u64, length: u64) -> io::Result<()> {
        bufcache_device::check_range(self.size_bytes, offset, length)
    }
}

impl Export for MemoryExport {
    fn size(&self) -> u64 {
        self.size_bytes
    }

    fn read_only(&self) -> bool {
        self.read_only
    }

    fn description(&self) -> String {
        self.description.clone()
    }

    fn read(&self, offset: u64, buffer: &mut [u8]) -> io::Result<()> {
        self.check_range(offset, buffer.len() as u64)?;
        self.for_each_piece(offset, buffer.len() as u64, |page_index, at, range| {
            let page = self.pages[page_index].read();
            match page.as_ref() {
                Some(bytes) => buffer[range.clone()].copy_from_slice(&bytes[at..at + range.len()]),
                None => buffer[range].fill(0),
            }
        });
        Ok(())
    }

    fn read_with(&self, offset: u64, buffer: &mut [u8], send: &mut ReadSink<'_>) -> io::Result<()> {
        read_via_buffer(self, offset, buffer, send)
    }

    fn write(&self, offset: u64, data: &[u8], _fua: bool) -> io::Result<()> {
        self.check_range(offset, data.len() as u64)?;
        self.for_each_piece(offset, data.len() as u64, |page_index, at, range| {
            let mut page = self.pages[page_index].write();
            let bytes = page
                .get_or_insert_with(|| vec![0u8; MEMORY_PAGE_BYTES as usize].into_boxed_slice());
            bytes[at..at + range.len()].copy_from_slice(&data[range]);
        });
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        Ok(())
    }

    fn trim(&self, offset: u64, length: u64, _fua: bool) -> io::Result<()> {
        self.check_range(offset, length)?;
        self.zero_range(offset, length, true);
        Ok(())
    }

    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        may_trim: bool,
        _fast_only: bool,
        _fua: bool,
    ) -> io::Result<()> {
        self.check_range(offset, length)?;
        self.zero_range(offset, length, may_trim);
        Ok(())
    }

    fn can_fast_zero(&self) -> bool {
        true
    }

    fn read_is_quick(&self, _offset: u64, _length: u64) -> bool {
        true
    }
    fn start_read(&self, _offset: u64, _length: u32, done: ReadDone) -> Result<(), ReadDone> {
        never_start_read(done)
    }

    fn write_is_quick(&self, _offset: u64, _length: u64, _fua: bool) -> bool {
        true
    }

    fn write_from(
        &self,
        offset: u64,
        length: u64,
        fua: bool,
        source: &mut WriteSource<'_>,
    ) -> io::Result<()> {
        write_via_buffer(self, offset, length, fua, source)
    }

    fn cache(&self, offset: u64, length: u64) -> io::Result<()> {
        self.check_range(offset, length)
    }

    fn cache_request_bytes_max(&self) -> u64 {
        // Memory holds everything already: a CACHE costs nothing at any length.
        u64::MAX
    }

    fn block_status(&self, offset: u64, length: u64) -> io::Result<Vec<BlockStatusExtent>> {
        self.check_range(offset, length)?;
        let mut extents: Vec<BlockStatusExtent> = Vec::new();
        self.for_each_piece(offset, length, |page_index, _, range| {
            let hole = self.pages[page_index].read().is_none();
            match extents.last_mut() {
                Some(last) if last.hole == hole => last.length += range.len() as u64,
                _ => extents.push(BlockStatusExtent {
                    length: range.len() as u64,
                    hole,
                    zero: hole,
                }),
            }
        });
        Ok(extents)
    }

    fn has_cache_state(&self) -> bool {
        false
    }

    fn cache_state(&self, _offset: u64, _length: u64) -> io::Result<Vec<CacheStateExtent>> {
        no_cache_state()
    }

    fn known_zeroes(&self, offset: u64, length: u64) -> Vec<(u64, u64)> {
        if self.check_range(offset, length).is_err() {
            return Vec::new();
        }
        let mut zeroes: Vec<(u64, u64)> = Vec::new();
        self.for_each_piece(offset, length, |page_index, _, range| {
            if self.pages[page_index].read().is_some() {
                return;
            }
            let start = offset + range.start as u64;
            match zeroes.last_mut() {
                Some(last) if last.0 + last.1 == start => last.1 += range.len() as u64,
                _ => zeroes.push((start, range.len() as u64)),
            }
        });
        zeroes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layer_testing::{advertised, Distinctive};

    /// A layer that adds nothing.
    struct Transparent(Arc<dyn Export>);

    impl ExportLayer for Transparent {
        fn inner(&self) -> &Arc<dyn Export> {
            &self.0
        }
        fn over(&self, inner: Arc<dyn Export>) -> Arc<dyn Export> {
            Arc::new(Transparent(inner))
        }
    }

    #[test]
    fn a_layer_that_adds_nothing_answers_every_method_as_the_export_it_wraps() {
        // Goal: an `ExportLayer` that overrides nothing keeps every capability and answer of
        // what it wraps (the defaults forward; none answers "unsupported"), on the shared
        // export and on a connection's view; writes reach the inner export. Method: a layer
        // over an export whose every answer differs from `Export`'s defaults, compared
        // method by method.
        let inner = Distinctive::shared();
        let layer: Arc<dyn Export> = Arc::new(Transparent(Arc::clone(&inner)));
        let expected = advertised(inner.as_ref());
        assert!(expected.contains("connection Some(\"distinctive, connection true\")"));
        assert!(expected.contains("may_acknowledge_changes Err(\"the lease lapsed\")"));
        assert_eq!(advertised(layer.as_ref()), expected);
        let view = layer.open_connection().expect("the inner export has views");
        assert_eq!(
            view.description(),
            "distinctive, connection true",
            "a connection's view is the inner's view"
        );
        let writable: Arc<dyn Export> =
            Arc::new(Transparent(Arc::new(MemoryExport::new(MEMORY_PAGE_BYTES))));
        writable.write(10, &[1, 2, 3], false).unwrap();
        writable.write_zeroes(11, 1, false, false, false).unwrap();
        let mut back = [0u8; 3];
        writable.read(10, &mut back).unwrap();
        assert_eq!(back, [1, 0, 3]);
    }

    #[test]
    fn memory_export_reads_back_writes_across_pages() {
        let export = MemoryExport::new(4 * MEMORY_PAGE_BYTES);
        let data: Vec<u8> = (0..100_000u32).map(|value| value as u8).collect();
        export.write(1000, &data, false).unwrap();
        let mut back = vec![0u8; data.len()];
        export.read(1000, &mut back).unwrap();
        assert_eq!(back, data);
    }

    #[test]
    fn memory_export_reports_holes_and_frees_trimmed_pages() {
        let export = MemoryExport::new(4 * MEMORY_PAGE_BYTES);
        export.write(MEMORY_PAGE_BYTES, &[1], false).unwrap();
        let extents = export.block_status(0, 4 * MEMORY_PAGE_BYTES).unwrap();
        let holes: Vec<bool> = extents.iter().map(|extent| extent.hole).collect();
        assert_eq!(holes, vec![true, false, true]);
        export
            .trim(MEMORY_PAGE_BYTES, MEMORY_PAGE_BYTES, false)
            .unwrap();
        assert_eq!(
            export.block_status(0, 4 * MEMORY_PAGE_BYTES).unwrap().len(),
            1
        );
    }

    #[test]
    fn memory_export_refuses_ranges_past_the_end() {
        let export = MemoryExport::new(MEMORY_PAGE_BYTES);
        assert!(export.read(MEMORY_PAGE_BYTES - 1, &mut [0u8; 2]).is_err());
    }
}
