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
//! [`crate::counting`]), never by special cases inside the engine.

use std::io::{self, IoSlice, IoSliceMut};

/// One run of the device's address space with the same allocation state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    /// Length of the run in bytes.
    pub length: u64,
    /// True when the run is a hole: not allocated, reads as zeroes.
    pub hole: bool,
}

/// A block device, file or remote disk that the cache reads from and writes to.
pub trait Device: Send + Sync {
    /// Fills every slice in `buffers`, in order, from consecutive bytes starting at `offset`.
    fn read_vectored_at(&self, buffers: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<()>;

    /// Writes every slice in `buffers`, in order, to consecutive bytes starting at `offset`.
    fn write_vectored_at(&self, buffers: &[IoSlice<'_>], offset: u64) -> io::Result<()>;

    /// Makes every write that completed before this call durable.
    fn flush(&self) -> io::Result<()>;

    /// Tells the device that `length` bytes at `offset` are no longer needed. Afterwards the
    /// range reads as zeroes on devices whose [`Device::discard_zeroes`] is true, and as
    /// unspecified (but stable) data otherwise.
    fn discard(&self, offset: u64, length: u64) -> io::Result<()>;

    /// The device's size in bytes. Constant for the device's lifetime.
    fn len(&self) -> u64;

    /// True when the device has no bytes at all.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True when a discarded range reads back as zeroes.
    fn discard_zeroes(&self) -> bool {
        false
    }

    /// Writes zeroes over `length` bytes at `offset`. The default writes a zero buffer; devices
    /// that can zero without moving data (punching a hole, a protocol command) override it.
    fn write_zeroes(&self, offset: u64, length: u64) -> io::Result<()> {
        check_range(self.len(), offset, length)?;
        let chunk_size = length.min(1 << 20) as usize;
        let zeroes = vec![0u8; chunk_size];
        let mut done = 0u64;
        while done < length {
            let step = (length - done).min(chunk_size as u64) as usize;
            self.write_vectored_at(&[IoSlice::new(&zeroes[..step])], offset + done)?;
            done += step as u64;
        }
        Ok(())
    }

    /// True when [`Device::write_zeroes`] is cheap (no data is moved), so a client asking for
    /// a fast zero can be told yes.
    fn write_zeroes_is_fast(&self) -> bool {
        false
    }

    /// The allocation map of `length` bytes at `offset`, as consecutive extents covering the
    /// range. The default says everything is data.
    fn extents(&self, offset: u64, length: u64) -> io::Result<Vec<Extent>> {
        check_range(self.len(), offset, length)?;
        Ok(vec![Extent {
            length,
            hole: false,
        }])
    }

    /// The alignment in bytes that request offsets, lengths and memory must have (1 when any
    /// alignment works; the logical block size under O_DIRECT).
    fn alignment(&self) -> usize {
        1
    }

    /// A short human-readable name (a path, a URI) used in error messages.
    fn describe(&self) -> String;
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
    fn flush(&self) -> io::Result<()> {
        (**self).flush()
    }
    fn discard(&self, offset: u64, length: u64) -> io::Result<()> {
        (**self).discard(offset, length)
    }
    fn len(&self) -> u64 {
        (**self).len()
    }
    fn discard_zeroes(&self) -> bool {
        (**self).discard_zeroes()
    }
    fn write_zeroes(&self, offset: u64, length: u64) -> io::Result<()> {
        (**self).write_zeroes(offset, length)
    }
    fn write_zeroes_is_fast(&self) -> bool {
        (**self).write_zeroes_is_fast()
    }
    fn extents(&self, offset: u64, length: u64) -> io::Result<Vec<Extent>> {
        (**self).extents(offset, length)
    }
    fn alignment(&self) -> usize {
        (**self).alignment()
    }
    fn describe(&self) -> String {
        (**self).describe()
    }
}
