//! The device trait: the narrow interface between the cache and whatever stores the bytes.
//!
//! A device is a flat array of bytes with a fixed length. It is read and written with
//! vectored requests at a byte offset, so that one clustered request can fill or drain many
//! cache buffers without a bounce copy. `flush` is the durability barrier: every write that
//! returned before `flush` was called is durable when `flush` returns `Ok`.
//!
//! Invariants every implementation keeps:
//! - a read or write either transfers every byte it was given or returns an error; there are
//!   no short transfers;
//! - a request that reaches past `len()` is refused with `InvalidInput` and changes nothing;
//! - an error is returned to the caller that issued the request; it is never swallowed.
//!
//! Faults, latency, crashes, queueing and counting are added by wrapper devices (see
//! the `counting` module), never by special cases inside the engine.

use std::io::{self, IoSlice, IoSliceMut};
use std::ptr::NonNull;

use crate::aligned::AlignedBytes;

/// One run of the device's address space with the same allocation state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    /// Length of the run in bytes.
    pub length: u64,
    /// True when the run is a hole: not allocated, reads as zeroes.
    pub hole: bool,
}

/// One write of a [`Device::write_batch_at`] batch: `buffers`, in order, at `offset`.
#[derive(Clone, Copy, Debug)]
pub struct BatchWrite<'a> {
    /// The device byte offset of the first byte.
    pub offset: u64,
    /// The data, gathered in order.
    pub buffers: &'a [IoSlice<'a>],
}

impl BatchWrite<'_> {
    /// Total bytes the write carries.
    pub fn length_bytes(&self) -> u64 {
        total_length(self.buffers.iter().map(|buffer| buffer.len()))
    }
}

/// What runs when an [`AsyncRead`] ends, with its outcome.
pub type ReadCompletion = Box<dyn FnOnce(io::Result<()>) + Send>;

/// A read a device completes later, from a thread of its own ([`Device::start_read`]).
///
/// It carries raw pointers into the caller's memory: whoever makes one promises (it is
/// `unsafe` to make) that the memory stays valid, and untouched by anyone but the device,
/// until the completion has run. The completion runs exactly once: with the device's outcome,
/// or with an error if the read is dropped before it ends.
pub struct AsyncRead {
    offset: u64,
    segments: Vec<(NonNull<u8>, usize)>,
    done: Option<ReadCompletion>,
}

// SAFETY: the memory is the caller's, lent until the completion runs (see the type's docs).
unsafe impl Send for AsyncRead {}

impl AsyncRead {
    /// A read of the bytes at `offset` into `buffers`, in order, that runs `done` when it
    /// ends.
    ///
    /// # Safety
    /// The memory of `buffers` must stay valid and untouched by the caller (and anyone else
    /// but the device) until `done` has run, even though this borrow ends now.
    pub unsafe fn new(
        offset: u64,
        buffers: &mut [IoSliceMut<'_>],
        done: impl FnOnce(io::Result<()>) + Send + 'static,
    ) -> Self {
        AsyncRead {
            offset,
            segments: buffers
                .iter_mut()
                .map(|buffer| {
                    let start = NonNull::new(buffer.as_mut_ptr()).expect("slices are non-null");
                    (start, buffer.len())
                })
                .collect(),
            done: Some(Box::new(done)),
        }
    }

    /// The device byte offset of the first byte.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Total bytes to read.
    pub fn length_bytes(&self) -> u64 {
        total_length(self.segments.iter().map(|&(_, length)| length))
    }

    /// Runs `wrap` instead of the completion, with the outcome and the completion to pass it
    /// on to: how a wrapper device counts or accounts for a read it forwards.
    pub fn wrap_done(
        mut self,
        wrap: impl FnOnce(io::Result<()>, ReadCompletion) + Send + 'static,
    ) -> Self {
        let done = self.done.take().expect("a read's completion runs once");
        self.done = Some(Box::new(move |result| wrap(result, done)));
        self
    }

    /// Ends the read with `result` (a wrapper that fails it without passing it on).
    pub fn finish(mut self, result: io::Result<()>) {
        if let Some(done) = self.done.take() {
            done(result);
        }
    }

    /// The memory, as (start, length) segments in order, and the completion, for a device
    /// that fills the memory from another thread and then runs the completion. The memory
    /// may be written until the completion runs, and never after.
    pub fn into_parts(mut self) -> (u64, Vec<(NonNull<u8>, usize)>, ReadCompletion) {
        let done = self.done.take().expect("a read's completion runs once");
        (self.offset, std::mem::take(&mut self.segments), done)
    }
}

impl Drop for AsyncRead {
    fn drop(&mut self) {
        if let Some(done) = self.done.take() {
            done(Err(io::Error::other(
                "the read was dropped before it was done",
            )));
        }
    }
}

impl std::fmt::Debug for AsyncRead {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("AsyncRead")
            .field("offset", &self.offset)
            .field("length_bytes", &self.length_bytes())
            .finish()
    }
}

/// What a device can do, returned once as one value so that a wrapper forwards all of it or
/// none of it: a wrapper that forgets a capability does not compile instead of silently
/// reporting a default.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// The device's size in bytes. Constant for the device's lifetime.
    pub length_bytes: u64,
    /// The alignment in bytes that request offsets, lengths and memory must have (1 when any
    /// alignment works; the logical block size under O_DIRECT).
    pub alignment_bytes: usize,
    /// True when a discarded range reads back as zeroes.
    pub discard_zeroes: bool,
    /// True when [`Device::write_zeroes`] moves no data (a punched hole, a protocol command),
    /// so a client asking for a fast zero can be told yes.
    pub write_zeroes_fast: bool,
    /// True when [`Device::extents`] reports real holes (otherwise everything is data).
    pub extents: bool,
    /// The size, and alignment, of the writes the device handles best: an object-store chunk,
    /// where a write covering part of one costs a read, a merge and a whole upload. Write-back
    /// cuts its runs at multiples of it so each write covers whole units. 1 when any size is as
    /// good as another (files, block devices, NBD).
    pub write_unit_bytes: u64,
    /// True when [`Device::start_read`] returns before the read ends and completes it on a
    /// thread of the device's own (an NBD upstream's reply thread), so a caller can go on
    /// while it is in flight. False for devices whose reads finish in the caller's thread.
    pub reads_complete_later: bool,
    /// Requests the device serves at once to good effect: what keeps its pipe full. 1 for a
    /// device that does one request at a time in the caller's thread (a file, memory, a
    /// modelled disk: concurrency there comes from the callers' own threads); the pipelining
    /// depth of an NBD upstream; the concurrent requests of an object store. The engine
    /// batches write-back only for devices above 1, and gives write-back a bounded share of
    /// these slots so read misses find room (`CacheConfig::writeback_inflight_max`).
    pub inflight_requests_max: usize,
    /// The largest request the device takes in one piece (an NBD upstream's maximum block
    /// size); `u64::MAX` when there is no limit. Write-back and clustered reads never build a
    /// request larger than this.
    pub request_bytes_max: u64,
    /// True when the device refuses every write, discard and zeroing (a file opened
    /// read-only, an NBD upstream that said READ_ONLY): an object over it refuses writes too,
    /// so nothing is ever acknowledged that could not reach it.
    pub read_only: bool,
}

impl Capabilities {
    /// A device of `length_bytes` with no alignment needs and no special abilities.
    pub fn plain(length_bytes: u64) -> Self {
        Capabilities {
            length_bytes,
            alignment_bytes: 1,
            discard_zeroes: false,
            write_zeroes_fast: false,
            extents: false,
            write_unit_bytes: 1,
            reads_complete_later: false,
            inflight_requests_max: 1,
            request_bytes_max: u64::MAX,
            read_only: false,
        }
    }
}

/// A block device, file or remote disk that the cache reads from and writes to.
///
/// Every method is required: wrappers (counting, io queue, faults, crashes) forward each one
/// explicitly, so none can drop a capability by inheriting a default. Simple devices use
/// [`write_zeroes_by_writing`] and [`all_data`] for the operations they have no better way to do.
pub trait Device: Send + Sync {
    /// Fills every slice in `buffers`, in order, from consecutive bytes starting at `offset`.
    fn read_vectored_at(&self, buffers: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<()>;

    /// Writes every slice in `buffers`, in order, to consecutive bytes starting at `offset`.
    fn write_vectored_at(&self, buffers: &[IoSlice<'_>], offset: u64) -> io::Result<()>;

    /// Does each of `writes` as [`Device::write_vectored_at`] would and returns one outcome
    /// per write, in order. A device with a per-request round trip (an NBD upstream) keeps
    /// them all in flight at once; a local device may simply do them in turn
    /// ([`write_each`]). Writes of one batch never overlap, and none is durable before the
    /// next [`Device::flush`] unless it says so itself.
    fn write_batch_at(&self, writes: &[BatchWrite<'_>]) -> Vec<io::Result<()>>;

    /// Starts `read`; its completion runs once, when the read ends. A device whose
    /// [`Capabilities::reads_complete_later`] is true (an NBD upstream) returns at once and
    /// completes the read on a thread of its own; any other does it now, in the caller's
    /// thread ([`read_now`]).
    fn start_read(&self, read: AsyncRead);

    /// Makes every write that completed before this call durable.
    fn flush(&self) -> io::Result<()>;

    /// Tells the device that `length` bytes at `offset` are no longer needed. Afterwards the
    /// range reads as zeroes when [`Capabilities::discard_zeroes`] is true, and as
    /// unspecified (but stable) data otherwise.
    fn discard(&self, offset: u64, length: u64) -> io::Result<()>;

    /// Writes zeroes over `length` bytes at `offset`.
    fn write_zeroes(&self, offset: u64, length: u64) -> io::Result<()>;

    /// The allocation map of `length` bytes at `offset`, as consecutive extents covering the
    /// range.
    fn extents(&self, offset: u64, length: u64) -> io::Result<Vec<Extent>>;

    /// What the device can do. Constant for the device's lifetime.
    fn capabilities(&self) -> Capabilities;

    /// A short human-readable name (a path, a URI) used in error messages.
    fn describe(&self) -> String;

    /// The device's size in bytes (from [`Device::capabilities`]).
    fn len(&self) -> u64 {
        self.capabilities().length_bytes
    }

    /// True when the device has no bytes at all.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The one zero-writer: zeroes `length` bytes at `offset` by writing a zero buffer in steps of
/// at most 1 MiB (so zeroing a large range never allocates more than that).
pub fn write_zeroes_by_writing(
    device: &(impl Device + ?Sized),
    offset: u64,
    length: u64,
) -> io::Result<()> {
    check_range(device.len(), offset, length)?;
    let chunk_size = length.min(ZERO_STEP_BYTES_MAX) as usize;
    // Aligned, so the same buffer serves devices opened with O_DIRECT.
    let zeroes = AlignedBytes::zeroed(
        chunk_size.next_multiple_of(ZERO_ALIGNMENT_BYTES),
        ZERO_ALIGNMENT_BYTES,
    );
    let mut done = 0u64;
    while done < length {
        let step = (length - done).min(chunk_size as u64) as usize;
        device.write_vectored_at(&[IoSlice::new(&zeroes[..step])], offset + done)?;
        done += step as u64;
    }
    Ok(())
}

/// A batch written one write after another, each with [`Device::write_vectored_at`]: the
/// [`Device::write_batch_at`] of devices for which in-flight writes gain nothing (a local
/// file, memory, a modelled disk), and of wrappers whose per-request rules need each write
/// on its own.
pub fn write_each(
    device: &(impl Device + ?Sized),
    writes: &[BatchWrite<'_>],
) -> Vec<io::Result<()>> {
    writes
        .iter()
        .map(|write| device.write_vectored_at(write.buffers, write.offset))
        .collect()
}

/// Does `read` now, in the caller's thread, with [`Device::read_vectored_at`], and runs its
/// completion: the [`Device::start_read`] of devices whose reads finish in the caller's
/// thread anyway.
pub fn read_now(device: &(impl Device + ?Sized), read: AsyncRead) {
    let (offset, segments, done) = read.into_parts();
    // SAFETY: the read's maker lent this memory until the completion runs (AsyncRead::new),
    // and the completion runs only after these slices are gone.
    let mut slices: Vec<IoSliceMut<'_>> = segments
        .iter()
        .map(|&(start, length)| {
            IoSliceMut::new(unsafe { std::slice::from_raw_parts_mut(start.as_ptr(), length) })
        })
        .collect();
    let result = device.read_vectored_at(&mut slices, offset);
    drop(slices);
    done(result);
}

/// The alignment of the zero buffer: the largest logical block size O_DIRECT asks for.
const ZERO_ALIGNMENT_BYTES: usize = 4096;

/// The largest single write [`write_zeroes_by_writing`] issues.
pub const ZERO_STEP_BYTES_MAX: u64 = 1 << 20;

/// The allocation map of a device that cannot tell holes from data: one data extent.
pub fn all_data(device_length: u64, offset: u64, length: u64) -> io::Result<Vec<Extent>> {
    check_range(device_length, offset, length)?;
    Ok(vec![Extent {
        length,
        hole: false,
    }])
}

/// Total length in bytes of a list of slices.
pub fn total_length(lengths: impl IntoIterator<Item = usize>) -> u64 {
    lengths.into_iter().map(|length| length as u64).sum()
}

/// Refuses a request that does not lie inside a device of `device_length` bytes.
pub fn check_range(device_length: u64, offset: u64, length: u64) -> io::Result<()> {
    match offset.checked_add(length) {
        Some(end) if end <= device_length => Ok(()),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "request of {length} bytes at offset {offset} reaches past the end of the \
                 device ({device_length} bytes)"
            ),
        )),
    }
}

impl<D: Device + ?Sized> Device for std::sync::Arc<D> {
    fn read_vectored_at(&self, buffers: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<()> {
        (**self).read_vectored_at(buffers, offset)
    }
    fn write_vectored_at(&self, buffers: &[IoSlice<'_>], offset: u64) -> io::Result<()> {
        (**self).write_vectored_at(buffers, offset)
    }
    fn write_batch_at(&self, writes: &[BatchWrite<'_>]) -> Vec<io::Result<()>> {
        (**self).write_batch_at(writes)
    }
    fn start_read(&self, read: AsyncRead) {
        (**self).start_read(read)
    }
    fn flush(&self) -> io::Result<()> {
        (**self).flush()
    }
    fn discard(&self, offset: u64, length: u64) -> io::Result<()> {
        (**self).discard(offset, length)
    }
    fn write_zeroes(&self, offset: u64, length: u64) -> io::Result<()> {
        (**self).write_zeroes(offset, length)
    }
    fn extents(&self, offset: u64, length: u64) -> io::Result<Vec<Extent>> {
        (**self).extents(offset, length)
    }
    fn capabilities(&self) -> Capabilities {
        (**self).capabilities()
    }
    fn describe(&self) -> String {
        (**self).describe()
    }
}
