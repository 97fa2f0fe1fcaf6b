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
