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
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::Mutex;

use crate::aligned::AlignedBytes;
use crate::device::{
    check_range, read_each_now, total_length, write_each_now, write_zeroes_by_writing,
    Capabilities, Device, Extent,
};
use crate::flush_group::FlushGroup;
use crate::request::{ReadRequest, WriteRequest};

mod uring;

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
    /// Worker threads that do submitted requests ([`Device::submit_reads`],
    /// [`Device::submit_writes`]). Default 0: every request runs in the caller's thread. With
    /// more, submitted requests go to a bounded queue of [`IO_QUEUED_PER_THREAD`] per thread
    /// and complete on the workers; the plain vectored calls, `flush` and the rest still run
    /// in the caller's thread.
    pub io_threads: usize,
    /// Requests in flight through one io_uring (`IORING_OP_READV`/`WRITEV`). Default 0: no
    /// ring. With a depth, submitted requests go to the kernel without waiting and complete
    /// on one reaper thread; exclusive with `io_threads`.
    pub io_uring_depth: usize,
}

/// Requests queued per worker thread of a pooled [`FileDevice`] (beyond the one each worker
/// is doing); a submitter blocks while the queue is full. Three, so the device's
/// `inflight_requests_max` (threads plus queue: four per thread) gives write-back, which
/// takes a quarter of it, one slot per worker: write-back alone can keep every worker busy,
/// and a read miss queues behind at most one request per worker of it.
pub const IO_QUEUED_PER_THREAD: usize = 3;

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
    /// The worker threads of `io_threads` could not be started.
    #[error("cannot start the io threads of {path}: {source}")]
    IoThreads {
        /// The path given.
        path: PathBuf,
        /// The operating system's reason.
        source: io::Error,
    },
    /// The kernel refused to set up the io_uring of `io_uring_depth` (too old, or disabled
    /// by `kernel.io_uring_disabled` or a seccomp filter).
    #[error(
        "cannot set up an io_uring for {path}: {source} (the kernel may be too old, or \
         io_uring disabled by sysctl kernel.io_uring_disabled or a sandbox); run without it"
    )]
    IoUring {
        /// The path given.
        path: PathBuf,
        /// The operating system's reason.
        source: io::Error,
    },
    /// Both a worker pool and an io_uring were asked for.
    #[error("{path}: io threads and an io_uring are two ways to do the same requests; choose one")]
    IoEnginesExclusive {
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
    /// The open file and what was learnt opening it; shared with the pool's workers.
    core: Arc<FileCore>,
    /// Concurrent flushes share one `fdatasync` when they can.
    flushes: FlushGroup,
    /// Who does submitted requests: the caller's thread, a worker pool, or the kernel.
    engine: Engine,
}

/// Who does a [`FileDevice`]'s submitted requests.
enum Engine {
    /// The caller's thread, before `submit_*` returns.
    Caller,
    /// A bounded pool of worker threads.
    Pool(IoPool),
    /// The kernel, through one io_uring.
    Ring(uring::Ring),
}

/// The open file and the request paths every thread uses (callers' and workers').
struct FileCore {
    file: File,
    path: PathBuf,
    length_bytes: u64,
    direct: bool,
    block_device: bool,
    read_only: bool,
}

impl FileDevice {
    /// Opens (and if asked, creates or resizes) `path`.
    pub fn open(
        path: impl AsRef<Path>,
        options: &FileDeviceOptions,
    ) -> Result<Self, FileDeviceError> {
        let path = path.as_ref().to_path_buf();
        if options.io_threads > 0 && options.io_uring_depth > 0 {
            return Err(FileDeviceError::IoEnginesExclusive { path });
        }
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
        let core = Arc::new(FileCore {
            file,
            path,
            length_bytes,
            direct: options.direct,
            block_device,
            read_only: options.read_only,
        });
        let engine = match (options.io_threads, options.io_uring_depth) {
            (0, 0) => Engine::Caller,
            (threads, 0) => Engine::Pool(IoPool::start(&core, threads).map_err(|source| {
                FileDeviceError::IoThreads {
                    path: core.path.clone(),
                    source,
                }
            })?),
            (_, depth) => Engine::Ring(uring::Ring::start(&core, depth).map_err(|source| {
                FileDeviceError::IoUring {
                    path: core.path.clone(),
                    source,
                }
            })?),
        };
        Ok(FileDevice {
            core,
            flushes: FlushGroup::new(),
            engine,
        })
    }

    /// The path this device was opened with.
    pub fn path(&self) -> &Path {
        &self.core.path
    }

    /// True when opened with O_DIRECT.
    pub fn is_direct(&self) -> bool {
        self.core.direct
    }

    /// The worker threads doing submitted requests (0: the caller's thread does them).
    pub fn io_threads(&self) -> usize {
        match &self.engine {
            Engine::Pool(pool) => pool.threads,
            _ => 0,
        }
    }

    /// Requests in flight through the io_uring at most (0: no ring).
    pub fn io_uring_depth(&self) -> usize {
        match &self.engine {
            Engine::Ring(ring) => ring.depth(),
            _ => 0,
        }
    }
}

impl FileCore {
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

    fn read_vectored(&self, buffers: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<()> {
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

    fn write_vectored(&self, buffers: &[IoSlice<'_>], offset: u64) -> io::Result<()> {
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
        self.core.read_vectored(buffers, offset)
    }

    fn write_vectored_at(&self, buffers: &[IoSlice<'_>], offset: u64) -> io::Result<()> {
        self.core.write_vectored(buffers, offset)
    }

    fn submit_reads(&self, reads: Vec<ReadRequest>) {
        match &self.engine {
            Engine::Caller => read_each_now(self, reads),
            Engine::Pool(pool) => reads
                .into_iter()
                .for_each(|read| pool.submit(Job::Read(read))),
            Engine::Ring(ring) => ring.submit(reads.into_iter().map(Job::Read).collect()),
        }
    }

    fn submit_writes(&self, writes: Vec<WriteRequest>) {
        match &self.engine {
            Engine::Caller => write_each_now(self, writes),
            Engine::Pool(pool) => writes
                .into_iter()
                .for_each(|write| pool.submit(Job::Write(write))),
            Engine::Ring(ring) => ring.submit(writes.into_iter().map(Job::Write).collect()),
        }
    }

    fn flush(&self) -> io::Result<()> {
        if self.core.read_only {
            return Ok(());
        }
        self.flushes.flush(|| {
            self.core
                .file
                .sync_data()
                .map_err(|error| self.core.annotate("flush", 0, 0, error))
        })
    }

    fn discard(&self, offset: u64, length: u64) -> io::Result<()> {
        self.core.refuse_if_read_only()?;
        check_range(self.core.length_bytes, offset, length)?;
        if self.core.block_device || length == 0 {
            // Discard is advisory; block devices keep their data and say so (discard_zeroes).
            return Ok(());
        }
        self.write_zeroes(offset, length)
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            length_bytes: self.core.length_bytes,
            alignment_bytes: if self.core.direct {
                DIRECT_ALIGNMENT
            } else {
                1
            },
            discard_zeroes: !self.core.block_device,
            write_zeroes_fast: !self.core.block_device,
            extents: !self.core.block_device,
            write_unit_bytes: 1,
            // In the caller's thread, parallel writers of one file contend for its inode
            // lock, so write-back to it is not batched. With a pool, the pipe is full with
            // every worker busy and the queue full (see `IO_QUEUED_PER_THREAD` for why that
            // gives write-back one slot per worker); with a ring, at its depth.
            completes_later: !matches!(self.engine, Engine::Caller),
            inflight_requests_max: match &self.engine {
                Engine::Caller => 1,
                Engine::Pool(pool) => pool.threads + pool.queued_max,
                Engine::Ring(ring) => ring.depth(),
            },
            request_bytes_max: u64::MAX,
            read_only: self.core.read_only,
        }
    }

    fn write_zeroes(&self, offset: u64, length: u64) -> io::Result<()> {
        self.core.refuse_if_read_only()?;
        check_range(self.core.length_bytes, offset, length)?;
        if length == 0 {
            return Ok(());
        }
        if !self.core.block_device {
            let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
            if self.core.fallocate(punch, offset, length).is_ok()
                || self
                    .core
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
        check_range(self.core.length_bytes, offset, length)?;
        let end = offset + length;
        if self.core.block_device {
            return Ok(vec![Extent {
                length,
                hole: false,
            }]);
        }
        let mut extents = Vec::new();
        let mut position = offset;
        while position < end {
            let data_start = match self.core.seek_data_or_hole(position, libc::SEEK_DATA) {
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
            let hole_start = match self.core.seek_data_or_hole(position, libc::SEEK_HOLE) {
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
        self.core.path.display().to_string()
    }
}

/// One submitted request, waiting for a worker or the kernel.
enum Job {
    Read(ReadRequest),
    Write(WriteRequest),
}

impl Job {
    pub(crate) fn offset(&self) -> u64 {
        match self {
            Job::Read(read) => read.offset(),
            Job::Write(write) => write.offset(),
        }
    }

    pub(crate) fn length_bytes(&self) -> u64 {
        match self {
            Job::Read(read) => read.length_bytes(),
            Job::Write(write) => write.length_bytes(),
        }
    }

    /// Does the request, or what is left of it after `done_bytes`, with blocking calls.
    pub(crate) fn finish_here(mut self, core: &FileCore, done_bytes: usize) {
        let offset = self.offset() + done_bytes as u64;
        match &mut self {
            Job::Read(read) => {
                let mut slices = read.slices_mut();
                let mut rest: &mut [IoSliceMut<'_>] = &mut slices;
                IoSliceMut::advance_slices(&mut rest, done_bytes);
                let result = core.read_vectored(rest, offset);
                drop(slices);
                self.complete(result);
            }
            Job::Write(write) => {
                let mut slices = write.slices();
                let mut rest: &mut [IoSlice<'_>] = &mut slices;
                IoSlice::advance_slices(&mut rest, done_bytes);
                let result = core.write_vectored(rest, offset);
                drop(slices);
                self.complete(result);
            }
        }
    }

    pub(crate) fn complete(self, result: io::Result<()>) {
        match self {
            Job::Read(read) => read.complete(result),
            Job::Write(write) => write.complete(result),
        }
    }

    /// The request's memory as iovecs; they stay valid while the request lives, since the
    /// memory sits behind the request's box and is never moved or resized.
    pub(crate) fn iovecs(&mut self) -> Vec<libc::iovec> {
        match self {
            Job::Read(read) => read
                .slices_mut()
                .iter_mut()
                .map(|slice| libc::iovec {
                    iov_base: slice.as_mut_ptr().cast(),
                    iov_len: slice.len(),
                })
                .collect(),
            Job::Write(write) => write
                .slices()
                .iter()
                .map(|slice| libc::iovec {
                    iov_base: slice.as_ptr() as *mut libc::c_void,
                    iov_len: slice.len(),
                })
                .collect(),
        }
    }
}

/// The bounded worker pool of a [`FileDevice`] opened with `io_threads` > 0.
///
/// Invariants: every job accepted by [`IoPool::submit`] completes exactly once, on a worker
/// (or, if every worker has died, in the submitter's thread with an error); dropping the pool
/// closes the queue and joins the workers, which first do every job still queued, so none is
/// lost. A completion runs on a worker and must not block on submitting to this same device
/// while the queue is full (the engine's completions only change state and wake waiters).
struct IoPool {
    /// The queue's sending side; `None` once the pool is being dropped.
    sender: Option<SyncSender<Job>>,
    workers: Vec<JoinHandle<()>>,
    /// Worker threads.
    threads: usize,
    /// Jobs the queue holds at most, besides the one each worker is doing.
    queued_max: usize,
}

impl IoPool {
    fn start(core: &Arc<FileCore>, threads: usize) -> io::Result<Self> {
        let queued_max = threads * IO_QUEUED_PER_THREAD;
        let (sender, receiver) = sync_channel(queued_max);
        let receiver = Arc::new(Mutex::new(receiver));
        let mut pool = IoPool {
            sender: Some(sender),
            workers: Vec::with_capacity(threads),
            threads,
            queued_max,
        };
        for index in 0..threads {
            let core = Arc::clone(core);
            let receiver = Arc::clone(&receiver);
            // On failure `pool` drops here, joining the workers already started.
            let worker = std::thread::Builder::new()
                .name(format!("file-io-{index}"))
                .spawn(move || work(&core, &receiver))?;
            pool.workers.push(worker);
        }
        Ok(pool)
    }

    /// Queues `job`, blocking while the queue holds `queued_max` jobs.
    fn submit(&self, job: Job) {
        let sender = self.sender.as_ref().expect("the queue is open until drop");
        let job = match sender.try_send(job) {
            Ok(()) => return,
            Err(TrySendError::Full(job)) => match sender.send(job) {
                Ok(()) => return,
                Err(refused) => refused.0,
            },
            Err(TrySendError::Disconnected(job)) => job,
        };
        // Every worker has gone (only a panicking completion ends one): the request still
        // completes, with an error saying why.
        let error = || io::Error::other("the file's io threads have stopped");
        job.complete(Err(error()));
    }
}

impl Drop for IoPool {
    fn drop(&mut self) {
        // Closing the queue ends each worker once it has emptied the queue.
        self.sender = None;
        for worker in self.workers.drain(..) {
            // A worker that panicked has already reported it; its jobs completed with an
            // error as they dropped.
            let _ = worker.join();
        }
    }
}

/// A worker: takes jobs until the queue is closed and empty, doing each through the same
/// preadv/pwritev path as a caller's thread (so O_DIRECT alignment and bounce buffers apply).
fn work(core: &FileCore, receiver: &Mutex<Receiver<Job>>) {
    loop {
        // The lock is held only to take a job, never while doing one.
        let job = receiver.lock().recv();
        match job {
            Ok(job) => job.finish_here(core, 0),
            Err(_closed) => return,
        }
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

    /// What a pooled request's completion reports: its id, the thread it ran on, whether it
    /// succeeded, and for a read the bytes it got.
    type Completion = (usize, String, io::Result<()>, Vec<u8>);

    fn thread_name() -> String {
        std::thread::current().name().unwrap_or("").to_string()
    }

    /// Who should do a test's submitted requests.
    #[derive(Clone, Copy, Debug)]
    enum TestEngine {
        Pool { threads: usize },
        Ring { depth: usize },
    }

    impl TestEngine {
        fn options(self, options: FileDeviceOptions) -> FileDeviceOptions {
            match self {
                TestEngine::Pool { threads } => FileDeviceOptions {
                    io_threads: threads,
                    ..options
                },
                TestEngine::Ring { depth } => FileDeviceOptions {
                    io_uring_depth: depth,
                    ..options
                },
            }
        }

        fn inflight_requests_max(self) -> usize {
            match self {
                TestEngine::Pool { threads } => threads * (1 + IO_QUEUED_PER_THREAD),
                TestEngine::Ring { depth } => depth,
            }
        }
    }

    /// Opens `path` with `options`, or says the test is skipped where the kernel has no
    /// io_uring for us (too old, disabled by sysctl, or a sandbox's seccomp filter).
    fn open_or_skip(path: &Path, options: &FileDeviceOptions) -> Option<FileDevice> {
        match FileDevice::open(path, options) {
            Ok(device) => Some(device),
            Err(error @ FileDeviceError::IoUring { .. }) => {
                eprintln!("SKIPPED: {error}");
                None
            }
            Err(error) => panic!("{error}"),
        }
    }

    fn engine_device(
        directory: &tempfile::TempDir,
        length_bytes: u64,
        engine: TestEngine,
    ) -> Option<(PathBuf, FileDevice)> {
        let path = directory.path().join("engine.img");
        let options = engine.options(FileDeviceOptions {
            create_length_bytes: Some(length_bytes),
            ..Default::default()
        });
        open_or_skip(&path, &options).map(|device| (path, device))
    }

    #[test]
    fn pooled_requests_complete_once_on_the_workers_with_the_right_bytes() {
        requests_complete_once_off_the_callers_thread_with_the_right_bytes(TestEngine::Pool {
            threads: 4,
        });
    }

    #[test]
    fn ring_requests_complete_once_on_the_reaper_with_the_right_bytes() {
        // A depth smaller than the submitters' batches, so submitters wait for slots too.
        requests_complete_once_off_the_callers_thread_with_the_right_bytes(TestEngine::Ring {
            depth: 8,
        });
    }

    fn requests_complete_once_off_the_callers_thread_with_the_right_bytes(engine: TestEngine) {
        // Goal: with a pool of 4 or a ring, submitted reads and writes from many threads each
        // complete exactly once, on a worker (the ring's reaper), and reads return what the
        // writes left. Method:
        // 4 submitter threads each own the blocks whose index is theirs modulo 4, so their
        // batches never overlap; each round submits a batch of writes of fresh random bytes to
        // distinct own blocks, waits for every completion and updates its shadow, then
        // submits a batch of reads of own blocks and compares each with the shadow. Every
        // completion reports its request's id and thread; ids are checked to arrive once.
        const BLOCK: usize = 4096;
        const BLOCKS: usize = 256;
        const SUBMITTERS: usize = 4;
        let seed = 0x9001_u64;
        eprintln!("seed {seed}");
        let directory = tempfile::tempdir().unwrap();
        let Some((_path, device)) = engine_device(&directory, (BLOCK * BLOCKS) as u64, engine)
        else {
            return;
        };
        let capabilities = device.capabilities();
        assert!(capabilities.completes_later);
        assert_eq!(
            capabilities.inflight_requests_max,
            engine.inflight_requests_max()
        );
        let device = Arc::new(device);
        let submitters: Vec<_> = (0..SUBMITTERS)
            .map(|submitter| {
                let device = Arc::clone(&device);
                std::thread::spawn(move || {
                    let mut rng = crate::rng::SeededRng::new(seed + submitter as u64);
                    let own: Vec<usize> = (submitter..BLOCKS).step_by(SUBMITTERS).collect();
                    let mut shadow = vec![vec![0u8; BLOCK]; BLOCKS];
                    let mut next_id = 0usize;
                    for round in 0..40 {
                        let (sender, receiver) = std::sync::mpsc::channel::<Completion>();
                        let mut chosen: Vec<usize> = Vec::new();
                        while chosen.len() < 1 + rng.below(12) as usize {
                            let block = own[rng.below(own.len() as u64) as usize];
                            if !chosen.contains(&block) {
                                chosen.push(block);
                            }
                        }
                        let mut expected_ids = Vec::new();
                        let writes: Vec<WriteRequest> = chosen
                            .iter()
                            .map(|&block| {
                                let data: Vec<u8> =
                                    (0..BLOCK).map(|_| rng.next_u64() as u8).collect();
                                shadow[block] = data.clone();
                                let id = next_id;
                                next_id += 1;
                                expected_ids.push(id);
                                let sender = sender.clone();
                                WriteRequest::new(
                                    (block * BLOCK) as u64,
                                    data,
                                    move |_data: Vec<u8>, result| {
                                        sender
                                            .send((id, thread_name(), result, Vec::new()))
                                            .unwrap()
                                    },
                                )
                            })
                            .collect();
                        device.submit_writes(writes);
                        let reads: Vec<(usize, usize)> = chosen
                            .iter()
                            .map(|_| {
                                let id = next_id;
                                next_id += 1;
                                (id, own[rng.below(own.len() as u64) as usize])
                            })
                            .collect();
                        let mut seen: Vec<usize> = (0..expected_ids.len())
                            .map(|_| {
                                let (id, thread, result, _) = receiver.recv().unwrap();
                                result.unwrap_or_else(|e| panic!("seed {seed} round {round}: {e}"));
                                assert!(thread.starts_with("file-io-"), "completed on {thread:?}");
                                id
                            })
                            .collect();
                        seen.sort_unstable();
                        assert_eq!(seen, expected_ids, "seed {seed} round {round}: writes");
                        let requests = reads
                            .iter()
                            .map(|&(id, block)| {
                                let sender = sender.clone();
                                ReadRequest::new(
                                    (block * BLOCK) as u64,
                                    vec![0u8; BLOCK],
                                    move |data: Vec<u8>, result| {
                                        sender.send((id, thread_name(), result, data)).unwrap()
                                    },
                                )
                            })
                            .collect();
                        device.submit_reads(requests);
                        drop(sender);
                        let mut read_ids = Vec::new();
                        // The channel ends once every request (and so every sender clone)
                        // is gone, so a second completion of any id would show here.
                        for (id, thread, result, data) in receiver {
                            result.unwrap_or_else(|e| panic!("seed {seed} round {round}: {e}"));
                            assert!(thread.starts_with("file-io-"), "completed on {thread:?}");
                            let block = reads.iter().find(|read| read.0 == id).unwrap().1;
                            assert!(
                                data == shadow[block],
                                "seed {seed} round {round}: block {block} differs from its shadow"
                            );
                            read_ids.push(id);
                        }
                        read_ids.sort_unstable();
                        let expected: Vec<usize> = reads.iter().map(|read| read.0).collect();
                        assert_eq!(read_ids, expected, "seed {seed} round {round}: reads");
                    }
                })
            })
            .collect();
        for submitter in submitters {
            submitter.join().unwrap();
        }
    }

    #[test]
    fn a_dropped_pooled_device_completes_every_request_it_accepted() {
        a_dropped_device_completes_every_request_it_accepted(TestEngine::Pool { threads: 1 });
    }

    #[test]
    fn a_dropped_ring_device_completes_every_request_it_accepted() {
        a_dropped_device_completes_every_request_it_accepted(TestEngine::Ring { depth: 4 });
    }

    fn a_dropped_device_completes_every_request_it_accepted(engine: TestEngine) {
        // Goal: dropping a pooled or ring device loses no request: the workers (the kernel)
        // finish what was accepted before they stop, and every accepted write reaches the
        // file. Method: one worker or 4 slots, 64 writes of 256 KiB submitted at once (most
        // wait), then the device is dropped at once; every completion must have arrived,
        // successful, when the drop returns, and the file must hold every write's bytes.
        const WRITE_BYTES: usize = 256 << 10;
        const WRITES: usize = 64;
        let directory = tempfile::tempdir().unwrap();
        let Some((path, device)) = engine_device(&directory, (WRITE_BYTES * WRITES) as u64, engine)
        else {
            return;
        };
        let completed = Arc::new(Mutex::new(Vec::new()));
        let writes = (0..WRITES)
            .map(|index| {
                let completed = Arc::clone(&completed);
                WriteRequest::new(
                    (index * WRITE_BYTES) as u64,
                    vec![index as u8 + 1; WRITE_BYTES],
                    move |_data: Vec<u8>, result: io::Result<()>| {
                        completed.lock().push((index, result.is_ok()))
                    },
                )
            })
            .collect();
        device.submit_writes(writes);
        drop(device);
        let mut completed = std::mem::take(&mut *completed.lock());
        completed.sort_unstable();
        let expected: Vec<(usize, bool)> = (0..WRITES).map(|index| (index, true)).collect();
        assert_eq!(completed, expected);
        let file = std::fs::read(&path).unwrap();
        for (index, chunk) in file.chunks(WRITE_BYTES).enumerate() {
            assert!(
                chunk.iter().all(|&byte| byte == index as u8 + 1),
                "write {index} is not in the file"
            );
        }
    }

    #[test]
    fn direct_io_through_the_pool_serves_aligned_and_bounced_requests() {
        direct_io_serves_aligned_and_bounced_requests(TestEngine::Pool { threads: 2 });
    }

    #[test]
    fn direct_io_through_the_ring_serves_aligned_and_bounced_requests() {
        direct_io_serves_aligned_and_bounced_requests(TestEngine::Ring { depth: 4 });
    }

    fn direct_io_serves_aligned_and_bounced_requests(engine: TestEngine) {
        // Goal: submitted requests take the same O_DIRECT rules as callers': aligned memory
        // goes straight to the file (on a worker, or through the ring), a misaligned read goes
        // through a bounce buffer, and a misaligned write is refused with the alignment
        // error. Method: a device opened with O_DIRECT in /var/tmp or the temp directory
        // (skipped, saying so, where both refuse O_DIRECT: tmpfs does); submit each kind and
        // look at outcomes, bytes and the thread each completed on (a ring does misaligned
        // requests in the caller's thread, since the kernel would refuse them).
        let options = engine.options(FileDeviceOptions {
            direct: true,
            create_length_bytes: Some(1 << 20),
            ..Default::default()
        });
        let misaligned_off_caller = matches!(engine, TestEngine::Pool { .. });
        let mut opened = None;
        let mut refusals = Vec::new();
        for base in [PathBuf::from("/var/tmp"), std::env::temp_dir()] {
            let Ok(directory) = tempfile::tempdir_in(&base) else {
                refusals.push(format!("{}: cannot create a directory", base.display()));
                continue;
            };
            match FileDevice::open(directory.path().join("direct.img"), &options) {
                Ok(device) => {
                    opened = Some((directory, device));
                    break;
                }
                Err(error @ FileDeviceError::DirectUnsupported { .. }) => {
                    refusals.push(error.to_string())
                }
                Err(error @ FileDeviceError::IoUring { .. }) => {
                    eprintln!("SKIPPED: {error}");
                    return;
                }
                Err(error) => panic!("{error}"),
            }
        }
        let Some((_directory, device)) = opened else {
            eprintln!("SKIPPED: no candidate directory accepts O_DIRECT: {refusals:?}");
            return;
        };
        let (sender, receiver) = std::sync::mpsc::channel::<Completion>();
        let mut aligned = AlignedBytes::zeroed(2 * DIRECT_ALIGNMENT, DIRECT_ALIGNMENT);
        aligned
            .iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = (i % 251) as u8);
        let expected = aligned.to_vec();
        let written = sender.clone();
        device.submit_writes(vec![
            WriteRequest::new(8192, aligned, move |_memory: AlignedBytes, result| {
                written
                    .send((0, thread_name(), result, Vec::new()))
                    .unwrap()
            }),
            WriteRequest::new(100, vec![1u8; 10], {
                let sender = sender.clone();
                move |_memory: Vec<u8>, result| {
                    sender.send((1, thread_name(), result, Vec::new())).unwrap()
                }
            }),
        ]);
        let mut outcomes: Vec<Completion> =
            vec![receiver.recv().unwrap(), receiver.recv().unwrap()];
        outcomes.sort_by_key(|outcome| outcome.0);
        assert!(outcomes[0].2.is_ok(), "{:?}", outcomes[0].2);
        let refused = outcomes[1].2.as_ref().unwrap_err().to_string();
        assert!(refused.contains("aligned to 4096"), "{refused}");
        assert!(outcomes[0].1.starts_with("file-io-"), "{}", outcomes[0].1);
        assert_eq!(
            outcomes[1].1.starts_with("file-io-"),
            misaligned_off_caller,
            "{}",
            outcomes[1].1
        );
        device.submit_reads(vec![ReadRequest::new(
            8192 + 7,
            vec![0u8; 5000],
            move |data: Vec<u8>, result| sender.send((2, thread_name(), result, data)).unwrap(),
        )]);
        let (_, thread, result, data) = receiver.recv().unwrap();
        result.unwrap();
        assert_eq!(
            thread.starts_with("file-io-"),
            misaligned_off_caller,
            "{thread}"
        );
        assert!(data[..] == expected[7..5007], "the bounced read differs");
    }
    #[test]
    fn a_completion_that_submits_to_a_full_ring_does_not_wait_for_itself() {
        // Goal: a completion runs on the reaper, the only thread that frees slots; if it
        // submits to the same device while every slot is taken, the request must still be
        // done rather than wait forever. Method: a ring of depth 1 and a chain of 32 writes,
        // each submitted from the completion of the one before, while the test thread keeps
        // the slot busy with reads; the chain must reach its end and the file hold each write.
        const BLOCK: usize = 4096;
        const CHAIN: usize = 32;
        let directory = tempfile::tempdir().unwrap();
        let Some((path, device)) = engine_device(
            &directory,
            (BLOCK * CHAIN) as u64,
            TestEngine::Ring { depth: 1 },
        ) else {
            return;
        };
        let device = Arc::new(device);
        let (done, finished) = std::sync::mpsc::channel::<usize>();
        fn chain(device: Arc<FileDevice>, index: usize, done: std::sync::mpsc::Sender<usize>) {
            if index == CHAIN {
                done.send(index).unwrap();
                return;
            }
            let next = Arc::clone(&device);
            device.submit_writes(vec![WriteRequest::new(
                (index * BLOCK) as u64,
                vec![index as u8 + 1; BLOCK],
                move |_data: Vec<u8>, result| {
                    result.unwrap();
                    chain(next, index + 1, done);
                },
            )]);
        }
        chain(Arc::clone(&device), 0, done);
        let busy = std::sync::atomic::AtomicBool::new(true);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                while busy.load(std::sync::atomic::Ordering::Relaxed) {
                    let (sender, receiver) = std::sync::mpsc::channel();
                    device.submit_reads(vec![ReadRequest::new(
                        0,
                        vec![0u8; BLOCK],
                        move |_data: Vec<u8>, result| sender.send(result.is_ok()).unwrap(),
                    )]);
                    assert!(receiver.recv().unwrap());
                }
            });
            let reached = finished
                .recv_timeout(std::time::Duration::from_secs(60))
                .expect("the chain of completions stalled");
            busy.store(false, std::sync::atomic::Ordering::Relaxed);
            assert_eq!(reached, CHAIN);
        });
        let file = std::fs::read(&path).unwrap();
        for (index, block) in file.chunks(BLOCK).enumerate() {
            assert!(
                block.iter().all(|&byte| byte == index as u8 + 1),
                "block {index}"
            );
        }
    }

    #[test]
    fn a_pool_and_a_ring_together_are_refused_by_name() {
        // Goal: asking for both engines is a clear error naming the file, not a silent choice.
        // Method: open with both set and read the message.
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("both.img");
        let options = FileDeviceOptions {
            create_length_bytes: Some(1 << 20),
            io_threads: 2,
            io_uring_depth: 8,
            ..Default::default()
        };
        let error = FileDevice::open(&path, &options).err().unwrap();
        assert!(matches!(error, FileDeviceError::IoEnginesExclusive { .. }));
        assert!(error.to_string().contains("both.img"), "{error}");
    }
}
