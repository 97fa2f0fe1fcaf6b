//! `FileDevice`: a regular file or a block device, through the page cache or with O_DIRECT.
//!
//! Requests are `preadv`/`pwritev` calls, retried until every byte has moved (short transfers
//! are never returned). Under O_DIRECT, memory, offsets and lengths must be aligned to
//! [`DIRECT_ALIGNMENT`]: the cache's buffers always are; anything else is served through an
//! aligned bounce buffer for reads, and for writes only when offset and length are aligned
//! (a misaligned O_DIRECT write would need a read-modify-write that races with other writers,
//! so it is refused with a clear error instead).
//!
//! `flush` is `fdatasync`, shared by flushes asked for while another runs ([`FlushGroup`]). Holes are reported with SEEK_DATA/SEEK_HOLE; discard punches holes.

use std::fs::{File, OpenOptions};
use std::io::{self, IoSlice, IoSliceMut, Seek, SeekFrom};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use crate::aligned::AlignedBytes;
use crate::device::{
    check_range, total_length, write_zeroes_by_writing, Capabilities, Device, Extent,
};
use crate::flush_group::FlushGroup;

/// Alignment of memory, offsets and lengths for O_DIRECT requests. 4 KiB covers both 512-byte
/// and 4 KiB logical sector devices.
pub const DIRECT_ALIGNMENT: usize = 4096;

/// How to open a [`FileDevice`].
#[derive(Clone, Debug, Default)]
pub struct FileDeviceOptions {
    /// Bypass the kernel's page cache (O_DIRECT).
    pub direct: bool,
    /// Open read-only; writes fail with `PermissionDenied`.
    pub read_only: bool,
    /// When the path does not exist, create a sparse regular file of this many bytes.
    pub create_length_bytes: Option<u64>,
    /// Resize an existing regular file to this many bytes (dd without conv=notrunc).
    pub set_length_bytes: Option<u64>,
}

/// Why a [`FileDevice`] could not be opened. Every variant names the path.
#[derive(Debug, thiserror::Error)]
pub enum FileDeviceError {
    /// open(2) failed.
    #[error("cannot open {path}: {source}")]
    Open {
        /// The path given.
        path: PathBuf,
        /// The operating system's reason.
        source: io::Error,
    },
    /// The file system refused O_DIRECT.
    #[error(
        "cannot open {path} with O_DIRECT (the --direct / oflag=direct option): the file \
         system refuses it ({source}); run without direct I/O"
    )]
    DirectUnsupported {
        /// The path given.
        path: PathBuf,
        /// The operating system's reason.
        source: io::Error,
    },
    /// The path is neither a regular file nor a block device.
    #[error("{path} is not a regular file or a block device")]
    NotAFileOrBlockDevice {
        /// The path given.
        path: PathBuf,
    },
    /// Finding or setting the size failed.
    #[error("cannot size {path}: {source}")]
    Size {
        /// The path given.
        path: PathBuf,
        /// The operating system's reason.
        source: io::Error,
    },
}

/// A device backed by a file or block device.
pub struct FileDevice {
    file: File,
    path: PathBuf,
    length_bytes: u64,
    direct: bool,
    block_device: bool,
    read_only: bool,
    /// Concurrent flushes share one `fdatasync` when they can.
    flushes: FlushGroup,
}

impl FileDevice {
    /// Opens (and if asked, creates or resizes) `path`.
    pub fn open(
        path: impl AsRef<Path>,
        options: &FileDeviceOptions,
    ) -> Result<Self, FileDeviceError> {
        let path = path.as_ref().to_path_buf();
        let exists = path.exists();
        let mut open_options = OpenOptions::new();
        open_options.read(true).write(!options.read_only);
        if !exists && options.create_length_bytes.is_some() {
            open_options.create(true);
        }
        if options.direct {
            open_options.custom_flags(libc::O_DIRECT);
        }
        let mut file = open_options.open(&path).map_err(|source| {
            if options.direct && source.raw_os_error() == Some(libc::EINVAL) {
                FileDeviceError::DirectUnsupported {
                    path: path.clone(),
                    source,
                }
            } else {
                FileDeviceError::Open {
                    path: path.clone(),
                    source,
                }
            }
        })?;
        let metadata = file.metadata().map_err(|source| FileDeviceError::Open {
            path: path.clone(),
            source,
        })?;
        let block_device = metadata.file_type().is_block_device();
        if !metadata.is_file() && !block_device {
            return Err(FileDeviceError::NotAFileOrBlockDevice { path });
        }
        let size_error = |source| FileDeviceError::Size {
            path: path.clone(),
            source,
        };
        let wanted_length = match (exists, options.create_length_bytes) {
            (false, Some(length)) => Some(length),
            _ => options.set_length_bytes,
        };
        if let (Some(length), false) = (wanted_length, block_device) {
            file.set_len(length).map_err(size_error)?;
        }
        let length_bytes = file.seek(SeekFrom::End(0)).map_err(size_error)?;
        Ok(FileDevice {
            file,
            path,
            length_bytes,
            direct: options.direct,
            block_device,
            read_only: options.read_only,
            flushes: FlushGroup::new(),
        })
    }

    /// The path this device was opened with.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// True when opened with O_DIRECT.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    fn annotate(&self, what: &str, offset: u64, length: u64, error: io::Error) -> io::Error {
        io::Error::new(
            error.kind(),
            format!(
                "{}: {what} of {length} bytes at offset {offset} failed: {error}",
                self.path.display()
            ),
        )
    }

    fn direct_ready(
        &self,
        lengths_and_addresses: impl Iterator<Item = (usize, usize)>,
        offset: u64,
    ) -> bool {
        offset.is_multiple_of(DIRECT_ALIGNMENT as u64)
            && lengths_and_addresses.into_iter().all(|(length, address)| {
                length % DIRECT_ALIGNMENT == 0 && address % DIRECT_ALIGNMENT == 0
            })
    }

    fn preadv_all(&self, mut buffers: &mut [IoSliceMut<'_>], mut offset: u64) -> io::Result<()> {
        IoSliceMut::advance_slices(&mut buffers, 0);
        while !buffers.is_empty() {
            let count = buffers.len().min(1024) as libc::c_int;
            // SAFETY: IoSliceMut is ABI-compatible with iovec; the slices are live and writable.
            let moved = unsafe {
                libc::preadv(
                    self.file.as_raw_fd(),
                    buffers.as_ptr() as *const libc::iovec,
                    count,
                    offset as libc::off_t,
                )
            };
            if moved < 0 {
                let error = io::Error::last_os_error();
                if error.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(error);
            }
            if moved == 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "end of file"));
            }
            offset += moved as u64;
            IoSliceMut::advance_slices(&mut buffers, moved as usize);
        }
        Ok(())
    }

    fn pwritev_all(&self, mut buffers: &mut [IoSlice<'_>], mut offset: u64) -> io::Result<()> {
        IoSlice::advance_slices(&mut buffers, 0);
        while !buffers.is_empty() {
            let count = buffers.len().min(1024) as libc::c_int;
            // SAFETY: IoSlice is ABI-compatible with iovec; the slices are live.
            let moved = unsafe {
                libc::pwritev(
                    self.file.as_raw_fd(),
                    buffers.as_ptr() as *const libc::iovec,
                    count,
                    offset as libc::off_t,
                )
            };
            if moved < 0 {
                let error = io::Error::last_os_error();
                if error.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(error);
            }
            if moved == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "device accepted no bytes",
                ));
            }
            offset += moved as u64;
            IoSlice::advance_slices(&mut buffers, moved as usize);
        }
        Ok(())
    }

    /// Reads a misaligned range under O_DIRECT through an aligned bounce buffer.
    fn read_bounced(
        &self,
        buffers: &mut [IoSliceMut<'_>],
        offset: u64,
        length: u64,
    ) -> io::Result<()> {
        let alignment = DIRECT_ALIGNMENT as u64;
        let start = offset / alignment * alignment;
        let end = (offset + length).div_ceil(alignment) * alignment;
        let mut bounce = AlignedBytes::zeroed((end - start) as usize, DIRECT_ALIGNMENT);
        let readable = (self.length_bytes.div_ceil(alignment) * alignment).min(end) - start;
        self.preadv_tolerating_eof(&mut bounce[..readable as usize], start)?;
        let mut position = (offset - start) as usize;
        for buffer in buffers.iter_mut() {
            let step = buffer.len();
            buffer.copy_from_slice(&bounce[position..position + step]);
            position += step;
        }
        Ok(())
    }

    /// Reads into one aligned buffer; a short read at the end of the file leaves zeroes.
    fn preadv_tolerating_eof(&self, target: &mut [u8], offset: u64) -> io::Result<()> {
        let mut done = 0usize;
        while done < target.len() {
            // SAFETY: the target range is live and writable.
            let moved = unsafe {
                libc::pread(
                    self.file.as_raw_fd(),
                    target[done..].as_mut_ptr() as *mut libc::c_void,
                    target.len() - done,
                    (offset + done as u64) as libc::off_t,
                )
            };
            if moved < 0 {
                let error = io::Error::last_os_error();
                if error.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(error);
            }
            if moved == 0 {
                break;
            }
            done += moved as usize;
        }
        Ok(())
    }

    fn write_bounced(&self, buffers: &[IoSlice<'_>], offset: u64, length: u64) -> io::Result<()> {
        let alignment = DIRECT_ALIGNMENT as u64;
        if !offset.is_multiple_of(alignment) || !length.is_multiple_of(alignment) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "O_DIRECT (--direct) needs writes aligned to {DIRECT_ALIGNMENT} bytes; use a \
                     block size that is a multiple of {DIRECT_ALIGNMENT}"
                ),
            ));
        }
        let mut bounce = AlignedBytes::zeroed(length as usize, DIRECT_ALIGNMENT);
        let mut position = 0usize;
        for buffer in buffers {
            bounce[position..position + buffer.len()].copy_from_slice(buffer);
            position += buffer.len();
        }
        self.pwritev_all(&mut [IoSlice::new(&bounce)], offset)
    }

    fn fallocate(&self, mode: libc::c_int, offset: u64, length: u64) -> io::Result<()> {
        // SAFETY: plain system call on an owned descriptor.
        let result = unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                mode,
                offset as libc::off_t,
                length as libc::off_t,
            )
        };
        if result == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    fn seek_data_or_hole(&self, offset: u64, whence: libc::c_int) -> io::Result<Option<u64>> {
        // SAFETY: plain system call on an owned descriptor.
        let result = unsafe { libc::lseek(self.file.as_raw_fd(), offset as libc::off_t, whence) };
        if result >= 0 {
            return Ok(Some(result as u64));
        }
        let error = io::Error::last_os_error();
        match error.raw_os_error() {
            Some(libc::ENXIO) => Ok(None),
            _ => Err(error),
        }
    }

    fn refuse_if_read_only(&self) -> io::Result<()> {
        if self.read_only {
            Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("{} is open read-only", self.path.display()),
            ))
        } else {
            Ok(())
        }
    }
}

impl Device for FileDevice {
    fn read_vectored_at(&self, buffers: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<()> {
        let length = total_length(buffers.iter().map(|b| b.len()));
        check_range(self.length_bytes, offset, length)?;
        if length == 0 {
            return Ok(());
        }
        let aligned = !self.direct
            || self.direct_ready(
                buffers.iter().map(|b| (b.len(), b.as_ptr() as usize)),
                offset,
            );
        let result = if aligned {
            self.preadv_all(buffers, offset)
        } else {
            self.read_bounced(buffers, offset, length)
        };
        result.map_err(|error| self.annotate("read", offset, length, error))
    }

    fn write_vectored_at(&self, buffers: &[IoSlice<'_>], offset: u64) -> io::Result<()> {
        self.refuse_if_read_only()?;
        let length = total_length(buffers.iter().map(|b| b.len()));
        check_range(self.length_bytes, offset, length)?;
        if length == 0 {
            return Ok(());
        }
        let aligned = !self.direct
            || self.direct_ready(
                buffers.iter().map(|b| (b.len(), b.as_ptr() as usize)),
                offset,
            );
        let result = if aligned {
            let mut slices: Vec<IoSlice<'_>> = buffers.to_vec();
            self.pwritev_all(&mut slices, offset)
        } else {
            self.write_bounced(buffers, offset, length)
        };
        result.map_err(|error| self.annotate("write", offset, length, error))
    }

    fn submit_reads(&self, reads: Vec<crate::request::ReadRequest>) {
        crate::device::read_each_now(self, reads)
    }

    fn submit_writes(&self, writes: Vec<crate::request::WriteRequest>) {
        crate::device::write_each_now(self, writes)
    }

    fn flush(&self) -> io::Result<()> {
        if self.read_only {
            return Ok(());
        }
        self.flushes.flush(|| {
            self.file
                .sync_data()
                .map_err(|error| self.annotate("flush", 0, 0, error))
        })
    }

    fn discard(&self, offset: u64, length: u64) -> io::Result<()> {
        self.refuse_if_read_only()?;
        check_range(self.length_bytes, offset, length)?;
        if self.block_device || length == 0 {
            // Discard is advisory; block devices keep their data and say so (discard_zeroes).
            return Ok(());
        }
        self.write_zeroes(offset, length)
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            length_bytes: self.length_bytes,
            alignment_bytes: if self.direct { DIRECT_ALIGNMENT } else { 1 },
            discard_zeroes: !self.block_device,
            write_zeroes_fast: !self.block_device,
            extents: !self.block_device,
            write_unit_bytes: 1,
            completes_later: false,
            // Requests run in the caller's thread; parallel writers of one file contend for
            // its inode lock, so write-back to it is not batched.
            inflight_requests_max: 1,
            request_bytes_max: u64::MAX,
            read_only: self.read_only,
        }
    }

    fn write_zeroes(&self, offset: u64, length: u64) -> io::Result<()> {
        self.refuse_if_read_only()?;
        check_range(self.length_bytes, offset, length)?;
        if length == 0 {
            return Ok(());
        }
        if !self.block_device {
            let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
            if self.fallocate(punch, offset, length).is_ok()
                || self
                    .fallocate(
                        libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
                        offset,
                        length,
                    )
                    .is_ok()
            {
                return Ok(());
            }
        }
        // The file system cannot zero without writing.
        write_zeroes_by_writing(self, offset, length)
    }

    fn extents(&self, offset: u64, length: u64) -> io::Result<Vec<Extent>> {
        check_range(self.length_bytes, offset, length)?;
        let end = offset + length;
        if self.block_device {
            return Ok(vec![Extent {
                length,
                hole: false,
            }]);
        }
        let mut extents = Vec::new();
        let mut position = offset;
        while position < end {
            let data_start = match self.seek_data_or_hole(position, libc::SEEK_DATA) {
                Ok(found) => found.unwrap_or(end).min(end),
                // File systems without SEEK_DATA: everything is data.
                Err(_) => position,
            };
            if data_start > position {
                extents.push(Extent {
                    length: data_start - position,
                    hole: true,
                });
                position = data_start;
                continue;
            }
            let hole_start = match self.seek_data_or_hole(position, libc::SEEK_HOLE) {
                Ok(found) => found.unwrap_or(end).min(end),
                Err(_) => end,
            };
            let hole_start = hole_start.max(position + 1).min(end);
            extents.push(Extent {
                length: hole_start - position,
                hole: false,
            });
            position = hole_start;
        }
        Ok(extents)
    }

    fn describe(&self) -> String {
        self.path.display().to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn creates_a_sparse_file_and_reads_back_writes() {
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("disk.img");
        let options = FileDeviceOptions {
            create_length_bytes: Some(1 << 20),
            ..Default::default()
        };
        let device = FileDevice::open(&path, &options).unwrap();
        assert_eq!(device.len(), 1 << 20);
        device
            .write_vectored_at(&[IoSlice::new(b"hello"), IoSlice::new(b" world")], 8192)
            .unwrap();
        device.flush().unwrap();
        let mut back = [0u8; 11];
        device
            .read_vectored_at(&mut [IoSliceMut::new(&mut back)], 8192)
            .unwrap();
        assert_eq!(&back, b"hello world");
        let extents = device.extents(0, 1 << 20).unwrap();
        assert_eq!(extents.iter().map(|e| e.length).sum::<u64>(), 1 << 20);
        assert!(
            extents.iter().any(|e| e.hole),
            "a sparse file reports holes: {extents:?}"
        );
    }

    #[test]
    fn open_errors_name_the_path() {
        let error = FileDevice::open("/nonexistent/dir/x.img", &FileDeviceOptions::default())
            .err()
            .unwrap();
        assert!(
            error.to_string().contains("/nonexistent/dir/x.img"),
            "{error}"
        );
    }
}
