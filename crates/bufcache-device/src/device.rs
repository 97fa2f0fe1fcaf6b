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
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

use crate::aligned::AlignedBytes;
use crate::request::{ReadRequest, WriteMemory, WriteRequest};

/// One run of the device's address space with the same allocation state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    /// Length of the run in bytes.
    pub length: u64,
    /// True when the run is a hole: not allocated, reads as zeroes.
    pub hole: bool,
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
    /// True when [`Device::submit_reads`] and [`Device::submit_writes`] may return before
    /// their requests end, completing them on a thread of the device's own (an NBD upstream's
    /// reply thread), so a caller can go on while they are in flight. False for devices that
    /// finish every request in the caller's thread, before `submit_*` returns.
    pub completes_later: bool,
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
            completes_later: false,
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

    /// Starts every read of `reads`; each completes exactly once, with its own outcome. A
    /// device whose [`Capabilities::completes_later`] is true (an NBD upstream) returns at
    /// once and completes them on a thread of its own; any other does them now, in the
    /// caller's thread ([`read_each_now`]). Reads of one batch never overlap.
    fn submit_reads(&self, reads: Vec<ReadRequest>);

    /// Starts every write of `writes`, as [`Device::write_vectored_at`] would do each; each
    /// completes exactly once, with its own outcome. A device with a per-request round trip
    /// (an NBD upstream, an object store) keeps them in flight together; a local device may
    /// do them in turn ([`write_each_now`]). Writes of one batch never overlap, and none is
    /// durable before the next [`Device::flush`] unless the device says so itself.
    fn submit_writes(&self, writes: Vec<WriteRequest>);

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

/// Does each of `reads` now, in the caller's thread, with [`Device::read_vectored_at`], and
/// completes it: the [`Device::submit_reads`] of devices whose reads finish in the caller's
/// thread anyway.
pub fn read_each_now(device: &(impl Device + ?Sized), reads: Vec<ReadRequest>) {
    for mut read in reads {
        let offset = read.offset();
        let result = device.read_vectored_at(&mut read.slices_mut(), offset);
        read.complete(result);
    }
}

/// Does each of `writes` now, in the caller's thread and in order, with
/// [`Device::write_vectored_at`], and completes it: the [`Device::submit_writes`] of devices
/// for which writes in flight together gain nothing (a local file, memory, a modelled disk).
pub fn write_each_now(device: &(impl Device + ?Sized), writes: Vec<WriteRequest>) {
    for write in writes {
        let offset = write.offset();
        let result = device.write_vectored_at(&write.slices(), offset);
        write.complete(result);
    }
}

/// Writes each `(offset, memory)` of `writes` as one batch of [`WriteRequest`]s
/// ([`Device::submit_writes`]) and waits until every one has completed; each memory comes
/// back with its outcome, in order. For callers that need every outcome before they go on
/// (a tier writing an epoch back, a reconnecting client retrying what a lost connection
/// dropped, an io queue dispatching its blocked submitters' writes, tests).
pub fn write_and_wait<T: WriteMemory>(
    device: &(impl Device + ?Sized),
    writes: Vec<(u64, T)>,
) -> Vec<(T, io::Result<()>)> {
    let count = writes.len();
    let outcomes = Arc::new(Outcomes {
        results: Mutex::new((0, (0..count).map(|_| None).collect())),
        done: Condvar::new(),
    });
    let requests = writes
        .into_iter()
        .enumerate()
        .map(|(index, (offset, memory))| {
            let outcomes = Arc::clone(&outcomes);
            WriteRequest::new(offset, memory, move |memory, result| {
                outcomes.record(index, memory, result)
            })
        })
        .collect();
    device.submit_writes(requests);
    outcomes.wait_all()
}

/// One write's memory, handed back with its outcome.
type Outcome<T> = (T, io::Result<()>);

/// The outcomes of a batch [`write_and_wait`] submitted, filled in by completions on any
/// thread.
struct Outcomes<T> {
    /// (completed so far, one slot per write).
    results: Mutex<(usize, Vec<Option<Outcome<T>>>)>,
    done: Condvar,
}

impl<T> Outcomes<T> {
    fn record(&self, index: usize, memory: T, result: io::Result<()>) {
        let mut results = self.results.lock();
        let slot = &mut results.1[index];
        assert!(slot.is_none(), "a write completes once");
        *slot = Some((memory, result));
        results.0 += 1;
        assert!(results.0 <= results.1.len(), "more completions than writes");
        if results.0 == results.1.len() {
            self.done.notify_all();
        }
    }

    fn wait_all(&self) -> Vec<Outcome<T>> {
        let mut results = self.results.lock();
        while results.0 < results.1.len() {
            self.done.wait(&mut results);
        }
        std::mem::take(&mut results.1)
            .into_iter()
            .map(|outcome| outcome.expect("every write completed"))
            .collect()
    }
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

impl<D: Device + ?Sized> Device for Arc<D> {
    fn read_vectored_at(&self, buffers: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<()> {
        (**self).read_vectored_at(buffers, offset)
    }
    fn write_vectored_at(&self, buffers: &[IoSlice<'_>], offset: u64) -> io::Result<()> {
        (**self).write_vectored_at(buffers, offset)
    }
    fn submit_reads(&self, reads: Vec<ReadRequest>) {
        (**self).submit_reads(reads)
    }
    fn submit_writes(&self, writes: Vec<WriteRequest>) {
        (**self).submit_writes(writes)
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
