//! `LocalTier`: a device that keeps a checksummed log on a local device in front of a remote.
//!
//! Invariants (each is relied on by the code that names it):
//! - **Chain.** Records form a chain: record `n+1` follows record `n` in the log, carries
//!   sequence `n+1`, the CRC of record `n`, and the session (open count) that wrote it. Replay
//!   walks the chain from the persisted tail and stops at the first record that does not
//!   continue it (torn, corrupt, stale from an earlier lap or an earlier session), so what is
//!   replayed is always a prefix of what was appended, and a record is never served unless
//!   its CRC matched.
//! - **Damage is not a tear.** Each record carries the durable mark: every record below that
//!   sequence had been fsynced when it was written. A crash tears only records after the last
//!   fsync, so a record whose CRC fails while an intact record chained after it covers it
//!   with its mark is damage, and the open is refused unless `replay_damaged_prefix`.
//! - **Tail.** Log space is reused only after the checkpoint naming the new tail is durable,
//!   so replay never starts at a record that was overwritten.
//! - **Dirty.** A record that is a write (dirty data, zeroes, discard) whose epoch is above
//!   the persisted remote epoch is never dropped: the tail stops at it.
//! - **Epoch order.** Write-back puts epoch `E` on the remote (writes, then the remote's
//!   flush) and persists "epochs up to `E` are on the remote" in a durable checkpoint before
//!   it writes anything of a later epoch. Writes of one epoch may go in any order. So the
//!   remote always holds epochs up to the persisted one and possibly part of the next: a
//!   prefix of the flushed writes at epoch granularity, whatever happens to the local device.
//! - **Durable first.** No record reaches the remote before it is durable in the log, so the
//!   remote is never ahead of what replay finds (older clean copies of a block would
//!   otherwise be served over a newer epoch the remote already holds).
//! - **Pages.** Every write to the local device starts on a multiple of `LOG_PAGE_BYTES` and
//!   ends on one or at the log's end, so the device may be opened with O_DIRECT. Records are
//!   appended at the head, under the state lock, into the log buffer, which covers the log
//!   from the start of a page up to the head: the head's partial page as the device holds
//!   it, then records not yet written. Writing the buffer out rewrites that partial page
//!   with the bytes it already holds (a torn rewrite leaves each sector old or new, both the
//!   same bytes) and fills the rest of its last page with zeroes, or with the bytes already
//!   there from the first tail in that page on: the live tail, or the tail of the last
//!   durable checkpoint, where replay starts after a crash (Tail holds for these bytes too).
//! - **Written before durable.** The log buffer is written out, under the state lock, before
//!   every fsync of the local device whose success marks records durable (a flush, a
//!   checkpoint, write-back's `make_durable`, a write-through's invalidation), before a read
//!   of the log, when it holds `LOG_BUFFER_BYTES_MAX`, and with every clean, invalidation or
//!   wrap record; a failed write-out latches `local_failure`, since records it held were
//!   acknowledged to their writers. So a record is durable only once it is on the device.
//! - **Write-through.** A write that cannot be logged (the log is full of dirty data and
//!   stays so, or it is larger than a record may be) waits until every logged write is on
//!   the remote, holding out other writers, then logs a durable invalidation of its range and
//!   writes it straight to the remote: it stays ordered after everything logged before it.

use std::collections::{BTreeMap, VecDeque};
use std::io::{self, IoSlice, IoSliceMut};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bufcache_device::aligned::AlignedBytes;
use bufcache_device::strict_assert;
use bufcache_device::{
    all_data, check_range, read_each_now, write_and_wait, write_each_now, Capabilities, Device,
    Extent, FileDevice, FileDeviceError, FileDeviceOptions, ReadRequest, WriteRequest,
};
use parking_lot::{Condvar, Mutex, RwLock};

use crate::config::{FlushTo, LocalTierConfig, WritebackDriver};
use crate::error::TierError;
use crate::format::{
    record_total_bytes, Checkpoint, RecordHeader, RecordKind, Superblock, SuperblockProblem,
    CHECKPOINT_BYTES, CHECKPOINT_OFFSETS, FORMAT_VERSION, IDENTITY_BYTES_MAX, LOCAL_BYTES_MIN,
    LOG_PAGE_BYTES, LOG_START, RECORD_ALIGNMENT_BYTES, RECORD_HEADER_BYTES, SUPERBLOCK_BYTES,
    SUPERBLOCK_MAGIC,
};

/// The log buffer is written out once it holds this many bytes (Written before durable), so
/// small appends reach the local device in writes this large rather than a page each.
const LOG_BUFFER_BYTES_MAX: usize = 256 << 10;

/// What the tier has done, for metrics and tests.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TierStats {
    /// Bytes of logged writes not yet on the remote.
    pub dirty_bytes: u64,
    /// Epochs with writes not yet on the remote.
    pub epochs_pending: u64,
    /// Every epoch up to this one is on the remote, flushed.
    pub remote_epoch: u64,
    /// The epoch new writes join.
    pub open_epoch: u64,
    /// Log bytes in use (records and wrap padding).
    pub log_used_bytes: u64,
    /// Log bytes in all.
    pub log_capacity_bytes: u64,
    /// Writes that found the log full of dirty data and fell back to remote durability.
    pub fallbacks: u64,
    /// Blocks read from the local log (dirty or clean records).
    pub read_blocks_local: u64,
    /// Blocks read from the remote.
    pub read_blocks_remote: u64,
    /// Blocks read from the remote that could not be added to the read cache because a local
    /// write failed (the read itself succeeded).
    pub read_cache_insert_failures: u64,
    /// Epochs written back to the remote.
    pub writeback_epochs: u64,
    /// Failed write-back attempts in a row (0 once one succeeds).
    pub writeback_failures_in_a_row: u32,
    /// The last write-back error, while write-back is failing.
    pub writeback_error: Option<String>,
}

/// What one call of [`LocalTier::writeback_step`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WritebackStep {
    /// No closed epoch has writes waiting for the remote.
    Idle,
    /// Epoch `epoch` is on the remote, flushed, and the checkpoint saying so is durable.
    Wrote {
        /// The epoch written back.
        epoch: u64,
    },
    /// Writing epoch `epoch` back failed; the next step retries it.
    Failed {
        /// The epoch tried.
        epoch: u64,
        /// The error, naming the device.
        error: String,
    },
}

/// Where a block's newest local copy is.
#[derive(Clone, Copy, Debug)]
enum Entry {
    /// In a data record with sequence `sequence`, at local byte `position`.
    Data { sequence: u64, position: u64 },
    /// Zeroed or discarded by the record with sequence `sequence`.
    Zero { sequence: u64 },
}

impl Entry {
    fn sequence(self) -> u64 {
        match self {
            Entry::Data { sequence, .. } | Entry::Zero { sequence } => sequence,
        }
    }
}

/// A live record, in log order.
#[derive(Clone, Copy, Debug)]
struct RecordMeta {
    position: u64,
    /// Log bytes it takes (a wrap record takes the rest of the log).
    space_bytes: u64,
    sequence: u64,
    epoch: u64,
    kind: RecordKind,
    disk_offset: u64,
    length_bytes: u64,
    crc: u32,
}

/// A record read from the log during replay.
struct ReadRecord {
    position: u64,
    header: RecordHeader,
    /// The CRC its header claims (what the next record names, whether or not it matches).
    crc: u32,
    space_bytes: u64,
    /// True when the claimed CRC matches the header and payload.
    intact: bool,
}

/// A damaged log record proven durable by a later one (see [`Shared::damage_proof`]).
#[derive(Clone, Copy, Debug)]
struct Damage {
    offset: u64,
    sequence: u64,
    proof_offset: u64,
    proof_sequence: u64,
    valid_after: u64,
}

/// What [`LocalTier::open_or_check`] did.
enum Checked<T> {
    /// Opened: the tier.
    Opened(T),
    /// Checked only, nothing written: the clean blocks compared with the remote.
    Checked { sampled: u64 },
}

/// Why space could not be reserved.
enum NoSpace {
    /// Larger than a record may be: write it through.
    TooLarge,
    /// The tail is dirty: wait for write-back.
    Dirty,
    /// The local device failed.
    Io(io::Error),
}

struct State {
    session: u64,
    checkpoint_generation: u64,
    records: VecDeque<RecordMeta>,
    used_bytes: u64,
    tail_position: u64,
    tail_sequence: u64,
    tail_previous_crc: u32,
    /// The tail of the last checkpoint made durable: replay after a crash may start there
    /// even when `tail_position` has moved on, so its bytes are live too (Pages).
    tail_position_persisted: u64,
    head_position: u64,
    next_sequence: u64,
    last_crc: u32,
    index: BTreeMap<u64, Entry>,
    open_epoch: u64,
    open_epoch_has_writes: bool,
    /// Every record of epochs up to this one is durable on the local device (Durable first).
    durable_epoch: u64,
    /// Every record with a lower sequence is durable on the local device: the mark each new
    /// record carries, so replay can tell a damaged record from a torn one.
    durable_sequence: u64,
    remote_epoch: u64,
    /// Epoch -> bytes of its logged writes, for every epoch not yet on the remote.
    dirty_epochs: BTreeMap<u64, u64>,
    /// Bumped whenever a block's local copy disappears while the remote may hold other data
    /// for it (an invalidation, a dropped write record), so a read that went to the remote
    /// before does not cache what it read.
    generation: u64,
    /// Set when a write straight to the remote failed: the remote may hold some of it without
    /// having made it durable, so what a read finds there may vanish in a crash and must not
    /// be cached (a durable clean record would then serve data the remote lost). Cleared by
    /// the next successful flush of the remote.
    remote_unflushed: bool,
    writeback_failures_in_a_row: u32,
    /// Failed write-back attempts ever: a waiter reports an error only after one of its own.
    writeback_failures_total: u64,
    writeback_error: Option<String>,
    writeback_epochs: u64,
    /// Set when a checkpoint or an fsync of the local device failed: what is durable there is
    /// no longer known (fsyncgate), so every later write and flush is refused until restart.
    local_failure: Option<String>,
    stopping: bool,
    /// The log buffer (Pages): the log from `log_buffer_start` (a page boundary) up to the
    /// head, `log_buffer_bytes` long, in page-aligned memory an O_DIRECT device takes as it
    /// is; `None` until the first append.
    log_buffer: Option<AlignedBytes>,
    log_buffer_start: u64,
    log_buffer_bytes: usize,
    /// True while the log buffer holds records not yet written to the local device.
    log_buffer_unwritten: bool,
    /// Both checkpoint slots as the local device holds them: a checkpoint rewrites the page
    /// holding both, the other slot with the bytes it already has (Pages).
    checkpoint_slots: [[u8; CHECKPOINT_BYTES]; 2],
}

#[derive(Default)]
struct Counters {
    fallbacks: AtomicU64,
    /// Remote requests (writes, zeroings, discards, flushes) write-back completed: a waiter
    /// that sees it unchanged for `remote_stall_max` knows the remote is stuck.
    remote_progress: AtomicU64,
    read_blocks_local: AtomicU64,
    read_blocks_remote: AtomicU64,
    read_cache_insert_failures: AtomicU64,
}

impl State {
    /// The state of a session opening after `checkpoint` (read from `checkpoint_slots`),
    /// before the log's replay.
    fn after_open(checkpoint: &Checkpoint, checkpoint_slots: [[u8; CHECKPOINT_BYTES]; 2]) -> State {
        State {
            session: checkpoint.session + 1,
            checkpoint_generation: checkpoint.generation,
            records: VecDeque::new(),
            used_bytes: 0,
            tail_position: checkpoint.tail_position,
            tail_sequence: checkpoint.tail_sequence,
            tail_previous_crc: checkpoint.tail_previous_crc,
            tail_position_persisted: checkpoint.tail_position,
            head_position: checkpoint.tail_position,
            next_sequence: checkpoint.tail_sequence,
            last_crc: checkpoint.tail_previous_crc,
            index: BTreeMap::new(),
            open_epoch: checkpoint.remote_epoch + 1,
            open_epoch_has_writes: false,
            durable_epoch: 0,
            durable_sequence: 0,
            remote_epoch: checkpoint.remote_epoch,
            dirty_epochs: BTreeMap::new(),
            generation: 0,
            // A server killed after a failed write-through may have left bytes in the
            // remote's volatile cache: until this run has flushed the remote (just
            // below, or by write-back), nothing read there is cached.
            remote_unflushed: true,
            writeback_failures_in_a_row: 0,
            writeback_failures_total: 0,
            writeback_error: None,
            writeback_epochs: 0,
            local_failure: None,
            stopping: false,
            checkpoint_slots,
            log_buffer: None,
            log_buffer_start: checkpoint.tail_position,
            log_buffer_bytes: 0,
            log_buffer_unwritten: false,
        }
    }
}

struct Shared<R, L> {
    remote: R,
    local: L,
    local_name: String,
    config: LocalTierConfig,
    block_bytes: u64,
    backend_bytes: u64,
    log_start: u64,
    log_end: u64,
    remote_capabilities: Capabilities,
    state: Mutex<State>,
    /// Signalled when epochs close, write-back progresses or fails, or the tier stops.
    changed: Condvar,
    /// Logging writers hold it shared; a write-through holds it exclusively (Write-through).
    order: RwLock<()>,
    /// Serializes writes of partial blocks, whose read-modify-write must not interleave.
    partial_writes: Mutex<()>,
    /// Held for one whole write-back step, by the thread or a caller: epochs are written back
    /// one at a time, so the oldest pending one is always done before the next starts (Epoch
    /// order), whoever drives write-back.
    writeback_turn: Mutex<()>,
    counters: Counters,
}

/// A device that logs writes and caches reads on a local device and writes back to `R`. See
/// the module docs and docs/local-tier.md.
pub struct LocalTier<R: Device + 'static, L: Device + 'static = FileDevice> {
    shared: Arc<Shared<R, L>>,
    writeback: Option<JoinHandle<()>>,
}

/// One piece of an epoch's write-back.
#[derive(Debug)]
enum Run {
    /// Write `length` bytes at `offset`, gathered from local `(position, bytes)` segments.
    Data {
        offset: u64,
        segments: Vec<(u64, u64)>,
    },
    Zero {
        offset: u64,
        length: u64,
    },
    Discard {
        offset: u64,
        length: u64,
    },
}

impl<R: Device + 'static> LocalTier<R, FileDevice> {
    /// Opens the local cache at `path` for `remote` (whose identity is `identity`), creating
    /// it with `size_bytes` when it does not exist. A block device is formatted when its
    /// first 4 KiB are zeroes.
    pub fn open_path(
        path: &Path,
        size_bytes: Option<u64>,
        remote: R,
        identity: &str,
        config: LocalTierConfig,
    ) -> Result<Self, TierError> {
        let local_name = path.display().to_string();
        config.validate()?;
        if !path.exists() {
            let size_bytes = size_bytes.ok_or_else(|| TierError::SizeRequired {
                local: local_name.clone(),
            })?;
            if size_bytes < LOCAL_BYTES_MIN {
                return Err(TierError::TooSmall {
                    local: local_name,
                    size_bytes,
                    minimum_bytes: LOCAL_BYTES_MIN,
                });
            }
            allocate(path, size_bytes).map_err(|source| TierError::Open {
                local: local_name.clone(),
                source,
            })?;
            let local = open_local(path, &local_name)?;
            return Self::create(local, local_name, remote, identity, config);
        }
        let local = open_local(path, &local_name)?;
        let is_block_device = std::fs::metadata(path)
            .map(|metadata| std::os::unix::fs::FileTypeExt::is_block_device(&metadata.file_type()))
            .unwrap_or(false);
        if is_block_device && local.len() >= SUPERBLOCK_BYTES {
            let mut first = vec![0u8; SUPERBLOCK_BYTES as usize];
            local
                .read_vectored_at(&mut [IoSliceMut::new(&mut first)], 0)
                .map_err(|source| TierError::Io {
                    local: local_name.clone(),
                    what: "reading the superblock",
                    source,
                })?;
            if first.iter().all(|&byte| byte == 0) {
                return Self::create(local, local_name, remote, identity, config);
            }
        }
        Self::open_checked(local, local_name, remote, identity, config, size_bytes)
    }
}

/// Runs the checks of its log an open of the local cache at `path` makes before it writes
/// anything — the log replayed in memory, a damaged record proven durable (unless
/// `config.replay_damaged_prefix`) — without a backend and without writing; the identity and
/// sizes are the caller's to check first ([`recorded_superblock`]). A caller whose backend
/// changes when opened for writing (an S3 disk's lock and generation) calls it before, so a
/// cache the open would refuse for its log refuses the start before the backend changed.
/// The comparison of clean blocks with the backend needs the backend and is left to the
/// open. Ok when there is no cache at `path` yet.
pub fn check_log_path(path: &Path, config: LocalTierConfig) -> Result<(), TierError> {
    let Some(superblock) = read_superblock(path)? else {
        return Ok(());
    };
    let local_name = path.display().to_string();
    let options = FileDeviceOptions {
        read_only: true,
        ..FileDeviceOptions::default()
    };
    let local = FileDevice::open(path, &options).map_err(|error| open_error(&local_name, error))?;
    let config = LocalTierConfig {
        sampled_blocks_max: 0,
        writeback_driver: WritebackDriver::Caller,
        ..config
    };
    // Never read: no clean block is sampled, and the check returns before the open's flush.
    let remote = bufcache_device::MemoryDevice::new(superblock.backend_bytes);
    let checked = LocalTier::<bufcache_device::MemoryDevice, FileDevice>::check(
        local,
        local_name,
        remote,
        &superblock.identity,
        config,
    )?;
    assert_eq!(checked, 0, "nothing is sampled without a backend");
    Ok(())
}

/// The superblock of the local cache at `path`, reading nothing else and writing nothing; None
/// when there is no cache there yet (no file, or a device whose first 4 KiB are not a
/// superblock, as a zeroed block device).
pub fn recorded_superblock(path: &Path) -> Result<Option<Superblock>, TierError> {
    read_superblock(path)
}

/// The backend identity recorded in the superblock of the local cache at `path` (see
/// [`recorded_superblock`]).
pub fn recorded_identity(path: &Path) -> Result<Option<String>, TierError> {
    Ok(read_superblock(path)?.map(|superblock| superblock.identity))
}

fn read_superblock(path: &Path) -> Result<Option<Superblock>, TierError> {
    let local_name = path.display().to_string();
    let mut first = vec![0u8; SUPERBLOCK_BYTES as usize];
    let read = std::fs::File::open(path).and_then(|file| {
        use std::os::unix::fs::FileExt;
        let mut filled = 0;
        while filled < first.len() {
            match file.read_at(&mut first[filled..], filled as u64)? {
                0 => break,
                count => filled += count,
            }
        }
        Ok(filled)
    });
    match read {
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TierError::Open {
            local: local_name,
            source,
        }),
        Ok(filled) if filled < first.len() => Ok(None),
        Ok(_) => match Superblock::decode(&first) {
            Ok(superblock) => Ok(Some(superblock)),
            Err(SuperblockProblem::NoMagic) => Ok(None),
            Err(SuperblockProblem::Checksum) => {
                Err(TierError::SuperblockCorrupt { local: local_name })
            }
            Err(SuperblockProblem::Version(found)) => Err(TierError::Version {
                local: local_name,
                found,
                expected: FORMAT_VERSION,
            }),
        },
    }
}

/// Rewrites the backend identity in the superblock of the local cache at `path` from `from`
/// to `to`, changing nothing else: the migration of a cache whose superblock names its
/// backend the way older servers did (a URL) to the identity the backend records itself.
/// The caller holds the cache's lock and has established that both name the same backend.
pub fn migrate_identity(path: &Path, from: &str, to: &str) -> Result<(), TierError> {
    use std::os::unix::fs::FileExt;
    check_identity(to)?;
    let local_name = path.display().to_string();
    let io_error = |what| {
        let local_name = local_name.clone();
        move |source| TierError::Io {
            local: local_name,
            what,
            source,
        }
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|source| TierError::Open {
            local: local_name.clone(),
            source,
        })?;
    let mut first = vec![0u8; SUPERBLOCK_BYTES as usize];
    file.read_exact_at(&mut first, 0)
        .map_err(io_error("reading the superblock"))?;
    let mut superblock = match Superblock::decode(&first) {
        Ok(superblock) => superblock,
        Err(_) => return Err(TierError::SuperblockCorrupt { local: local_name }),
    };
    if superblock.identity != from {
        return Err(TierError::OtherBackend {
            local: local_name,
            found: superblock.identity,
            expected: from.to_string(),
        });
    }
    superblock.identity = to.to_string();
    let encoded = superblock.encode();
    assert_eq!(encoded.len() as u64, SUPERBLOCK_BYTES);
    file.write_all_at(&encoded, 0)
        .and_then(|()| file.sync_all())
        .map_err(io_error("writing the superblock"))
}

/// Creates the cache file with all of its blocks allocated, so a full file system shows up
/// now, as an error naming the file, and never later as a failed log append. A file left
/// behind by a failure is removed.
fn allocate(path: &Path, size_bytes: u64) -> io::Result<()> {
    use std::os::unix::io::AsRawFd;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)?;
    // SAFETY: posix_fallocate on a descriptor this function owns.
    let status = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, size_bytes as libc::off_t) };
    let result = match status {
        0 => file.sync_all(),
        // File systems without fallocate get a sparse file of the right size.
        libc::EOPNOTSUPP | libc::EINVAL => file.set_len(size_bytes).and_then(|()| file.sync_all()),
        error => Err(io::Error::from_raw_os_error(error)),
    };
    if result.is_err() {
        let _ = std::fs::remove_file(path);
    }
    result
}

/// Opens the local cache at `path` with O_DIRECT when every write the tier makes is aligned
/// on it (its length, and the log's end an existing superblock records, are multiples of
/// `LOG_PAGE_BYTES`; Pages) and its file system takes O_DIRECT; through the page cache
/// otherwise. Direct appends go to the device as they are made, at its own speed, instead of
/// piling up in the page cache for the next fsync to write.
fn open_local(path: &Path, local_name: &str) -> Result<FileDevice, TierError> {
    let buffered = FileDevice::open(path, &FileDeviceOptions::default())
        .map_err(|error| open_error(local_name, error))?;
    let log_end_aligned = match read_superblock(path) {
        Ok(Some(superblock)) => superblock.log_end.is_multiple_of(LOG_PAGE_BYTES),
        // No cache yet, or one the open refuses with the right error.
        Ok(None) | Err(_) => true,
    };
    if !buffered.len().is_multiple_of(LOG_PAGE_BYTES) || !log_end_aligned {
        return Ok(buffered);
    }
    let options = FileDeviceOptions {
        direct: true,
        ..FileDeviceOptions::default()
    };
    match FileDevice::open(path, &options) {
        Ok(direct) => Ok(direct),
        Err(error) => {
            tracing::info!(local = %local_name, %error, "local cache: O_DIRECT refused, writing through the page cache");
            Ok(buffered)
        }
    }
}

fn open_error(local: &str, error: FileDeviceError) -> TierError {
    match error {
        FileDeviceError::Open { source, .. }
            if source.kind() == io::ErrorKind::PermissionDenied
                || source.raw_os_error() == Some(libc::EROFS) =>
        {
            TierError::ReadOnly {
                local: local.to_string(),
                source,
            }
        }
        other => TierError::Open {
            local: local.to_string(),
            source: io::Error::other(other.to_string()),
        },
    }
}

impl<R: Device + 'static, L: Device + 'static> LocalTier<R, L> {
    /// Formats `local` as a new, empty cache for `remote` and opens it.
    pub fn create(
        local: L,
        local_name: String,
        remote: R,
        identity: &str,
        config: LocalTierConfig,
    ) -> Result<Self, TierError> {
        config.validate()?;
        check_identity(identity)?;
        let local_bytes = local.len();
        if local_bytes < LOCAL_BYTES_MIN {
            return Err(TierError::TooSmall {
                local: local_name,
                size_bytes: local_bytes,
                minimum_bytes: LOCAL_BYTES_MIN,
            });
        }
        check_backend(&remote, identity, &config)?;
        let superblock = Superblock {
            block_bytes: config.block_bytes,
            backend_bytes: remote.len(),
            local_bytes,
            log_start: LOG_START,
            log_end: local_bytes / 512 * 512,
            identity: identity.to_string(),
        };
        let io_error = |what| {
            let local_name = local_name.clone();
            move |source| TierError::Io {
                local: local_name,
                what,
                source,
            }
        };
        let page_bytes = LOG_PAGE_BYTES as usize;
        let mut page = AlignedBytes::zeroed(page_bytes, page_bytes);
        for generation in 0..2u64 {
            let checkpoint = Checkpoint {
                generation,
                session: 0,
                tail_position: LOG_START,
                tail_sequence: 1,
                tail_previous_crc: 0,
                remote_epoch: 0,
            };
            let at = (CHECKPOINT_OFFSETS[generation as usize % 2] - CHECKPOINT_OFFSETS[0]) as usize;
            page[at..at + CHECKPOINT_BYTES].copy_from_slice(&checkpoint.encode());
        }
        local
            .write_vectored_at(&[IoSlice::new(&page)], CHECKPOINT_OFFSETS[0])
            .map_err(io_error("writing a checkpoint"))?;
        // A stale chain from an earlier use of the device must not continue ours: the first
        // record's header slot is cleared (a whole page, Pages).
        let zeroes = AlignedBytes::zeroed(page_bytes, page_bytes);
        local
            .write_vectored_at(&[IoSlice::new(&zeroes)], LOG_START)
            .map_err(io_error("clearing the log"))?;
        local.flush().map_err(io_error("flushing"))?;
        // The superblock last: a cache whose creation was cut short has no magic and is
        // refused, never half-trusted.
        local
            .write_vectored_at(&[IoSlice::new(&superblock.encode())], 0)
            .map_err(io_error("writing the superblock"))?;
        local.flush().map_err(io_error("flushing the superblock"))?;
        Self::open_checked(local, local_name, remote, identity, config, None)
    }

    /// Opens an existing cache on `local` for `remote`: checks the superblock, replays the
    /// log and resumes write-back.
    pub fn open(
        local: L,
        local_name: String,
        remote: R,
        identity: &str,
        config: LocalTierConfig,
    ) -> Result<Self, TierError> {
        Self::open_checked(local, local_name, remote, identity, config, None)
    }

    fn open_checked(
        local: L,
        local_name: String,
        remote: R,
        identity: &str,
        config: LocalTierConfig,
        asked_bytes: Option<u64>,
    ) -> Result<Self, TierError> {
        match Self::open_or_check(
            local,
            local_name,
            remote,
            identity,
            config,
            asked_bytes,
            false,
        )? {
            Checked::Opened(tier) => Ok(tier),
            Checked::Checked { .. } => unreachable!("an open that is not a check opens"),
        }
    }

    /// Runs every check an open makes before it writes — the superblock, the log replayed
    /// in memory, a damaged record, and up to `sampled_blocks_max` clean blocks compared
    /// with `remote` — and attaches nothing: writes nothing to `local` or `remote`. Returns
    /// the clean blocks compared (0 when the cache holds none: then the content could not
    /// tell another disk apart). A caller (the simulator) offers a cache to a disk this way
    /// without the open's side effects.
    pub fn check(
        local: L,
        local_name: String,
        remote: R,
        identity: &str,
        config: LocalTierConfig,
    ) -> Result<u64, TierError> {
        match Self::open_or_check(local, local_name, remote, identity, config, None, true)? {
            Checked::Checked { sampled } => Ok(sampled),
            Checked::Opened(_) => unreachable!("a check attaches nothing"),
        }
    }
    /// Opens the cache, or with `check_only` runs every check an open makes before it
    /// writes (superblock, replay in memory, damage, the sampled clean blocks) and returns
    /// how many clean blocks were compared, having written nothing.
    fn open_or_check(
        local: L,
        local_name: String,
        remote: R,
        identity: &str,
        config: LocalTierConfig,
        asked_bytes: Option<u64>,
        check_only: bool,
    ) -> Result<Checked<Self>, TierError> {
        config.validate()?;
        check_identity(identity)?;
        check_backend(&remote, identity, &config)?;
        let superblock =
            Self::read_superblock(&local, &local_name, &remote, identity, &config, asked_bytes)?;
        let (checkpoint, checkpoint_slots) =
            Self::read_checkpoint(&local, &local_name, &superblock)?;
        let remote_capabilities = remote.capabilities();
        let shared = Shared {
            block_bytes: u64::from(config.block_bytes),
            backend_bytes: remote.len(),
            log_start: superblock.log_start,
            log_end: superblock.log_end,
            remote_capabilities,
            remote,
            local,
            local_name: local_name.clone(),
            config,
            state: Mutex::new(State::after_open(&checkpoint, checkpoint_slots)),
            changed: Condvar::new(),
            order: RwLock::new(()),
            partial_writes: Mutex::new(()),
            writeback_turn: Mutex::new(()),
            counters: Counters::default(),
        };
        {
            let mut state = shared.state.lock();
            let damage = shared.replay(&mut state).map_err(|source| TierError::Io {
                local: local_name.clone(),
                what: "replaying the log",
                source,
            })?;
            shared
                .load_log_buffer(&mut state)
                .map_err(|source| TierError::Io {
                    local: local_name.clone(),
                    what: "reading the log's head",
                    source,
                })?;
            if let Some(damage) = damage.filter(|_| !shared.config.replay_damaged_prefix) {
                return Err(TierError::DamagedRecord {
                    local: local_name,
                    offset: damage.offset,
                    sequence: damage.sequence,
                    proof_offset: damage.proof_offset,
                    proof_sequence: damage.proof_sequence,
                    valid_after: damage.valid_after,
                });
            }
            // Before anything is written (the erased record, the checkpoint) or served.
            let sampled = shared.check_clean_blocks(&state, identity)?;
            if check_only {
                return Ok(Checked::Checked { sampled });
            }
            shared.start_session(&mut state, damage)?;
        }
        let shared = Arc::new(shared);
        let writeback = match shared.config.writeback_driver {
            WritebackDriver::Caller => None,
            WritebackDriver::Thread => {
                let worker = Arc::clone(&shared);
                let thread = std::thread::Builder::new()
                    .name("tier-writeback".into())
                    .spawn(move || worker.writeback_loop())
                    .map_err(|source| TierError::Thread {
                        local: local_name,
                        source,
                    })?;
                Some(thread)
            }
        };
        Ok(Checked::Opened(LocalTier { shared, writeback }))
    }

    /// Reads and checks the superblock of `local`: a cache of ours, whole, of the size
    /// asked (if any), made for the disk `identity` of `remote`'s size with this block size.
    fn read_superblock(
        local: &L,
        local_name: &str,
        remote: &R,
        identity: &str,
        config: &LocalTierConfig,
        asked_bytes: Option<u64>,
    ) -> Result<Superblock, TierError> {
        let local_bytes = local.len();
        let mut first = vec![0u8; local_bytes.min(SUPERBLOCK_BYTES) as usize];
        local
            .read_vectored_at(&mut [IoSliceMut::new(&mut first)], 0)
            .map_err(|source| TierError::Io {
                local: local_name.to_string(),
                what: "reading the superblock",
                source,
            })?;
        if local_bytes < SUPERBLOCK_BYTES {
            return Err(if first.len() >= 8 && first[..8] == SUPERBLOCK_MAGIC {
                TierError::Truncated {
                    local: local_name.to_string(),
                    expected: SUPERBLOCK_BYTES,
                    actual: local_bytes,
                }
            } else {
                TierError::NotACache {
                    local: local_name.to_string(),
                }
            });
        }
        let superblock = match Superblock::decode(&first) {
            Ok(superblock) => superblock,
            Err(SuperblockProblem::NoMagic) => {
                return Err(TierError::NotACache {
                    local: local_name.to_string(),
                })
            }
            Err(SuperblockProblem::Checksum) => {
                return Err(TierError::SuperblockCorrupt {
                    local: local_name.to_string(),
                })
            }
            Err(SuperblockProblem::Version(found)) => {
                return Err(TierError::Version {
                    local: local_name.to_string(),
                    found,
                    expected: FORMAT_VERSION,
                })
            }
        };
        if local_bytes < superblock.local_bytes {
            return Err(TierError::Truncated {
                local: local_name.to_string(),
                expected: superblock.local_bytes,
                actual: local_bytes,
            });
        }
        if let Some(asked) = asked_bytes.filter(|&asked| asked != superblock.local_bytes) {
            return Err(TierError::SizeMismatch {
                local: local_name.to_string(),
                actual: superblock.local_bytes,
                asked,
            });
        }
        if superblock.identity != identity {
            return Err(TierError::OtherBackend {
                local: local_name.to_string(),
                found: superblock.identity,
                expected: identity.to_string(),
            });
        }
        if superblock.backend_bytes != remote.len() {
            return Err(TierError::BackendSize {
                local: local_name.to_string(),
                identity: identity.to_string(),
                found: superblock.backend_bytes,
                expected: remote.len(),
            });
        }
        if superblock.block_bytes != config.block_bytes {
            return Err(TierError::BlockSize {
                local: local_name.to_string(),
                found: superblock.block_bytes,
                expected: config.block_bytes,
            });
        }
        if superblock.log_start != LOG_START
            || superblock.log_end > superblock.local_bytes
            || superblock.log_end < superblock.log_start + LOCAL_BYTES_MIN - LOG_START
        {
            return Err(TierError::SuperblockCorrupt {
                local: local_name.to_string(),
            });
        }
        Ok(superblock)
    }

    /// Reads both checkpoint slots of `local` and picks the newest valid one whose tail lies
    /// in the log; returns it with the slots as read.
    fn read_checkpoint(
        local: &L,
        local_name: &str,
        superblock: &Superblock,
    ) -> Result<(Checkpoint, [[u8; CHECKPOINT_BYTES]; 2]), TierError> {
        let mut best: Option<Checkpoint> = None;
        let mut checkpoint_slots = [[0u8; CHECKPOINT_BYTES]; 2];
        for (slot, offset) in checkpoint_slots.iter_mut().zip(CHECKPOINT_OFFSETS) {
            local
                .read_vectored_at(&mut [IoSliceMut::new(slot)], offset)
                .map_err(|source| TierError::Io {
                    local: local_name.to_string(),
                    what: "reading a checkpoint",
                    source,
                })?;
            if let Some(checkpoint) = Checkpoint::decode(slot) {
                if best.is_none_or(|best| checkpoint.generation > best.generation) {
                    best = Some(checkpoint);
                }
            }
        }
        let checkpoint = best
            .filter(|checkpoint| {
                (superblock.log_start..superblock.log_end).contains(&checkpoint.tail_position)
                    && checkpoint.tail_position % 512 == 0
            })
            .ok_or_else(|| TierError::NoCheckpoint {
                local: local_name.to_string(),
            })?;
        Ok((checkpoint, checkpoint_slots))
    }

    /// Does one unit of write-back, exactly what the write-back thread does each time it
    /// wakes: takes the oldest closed epoch with writes not yet on the remote, makes its
    /// records durable locally, writes them to the remote, flushes the remote and persists
    /// the checkpoint saying so. With [`WritebackDriver::Caller`] this is how write-back
    /// runs; with the thread it is safe too (one step at a time, whoever calls).
    pub fn writeback_step(&self) -> WritebackStep {
        self.shared.writeback_step()
    }

    /// The counters and state now.
    pub fn stats(&self) -> TierStats {
        let state = self.shared.state.lock();
        let counters = &self.shared.counters;
        TierStats {
            dirty_bytes: state.dirty_epochs.values().sum(),
            epochs_pending: state.dirty_epochs.len() as u64,
            remote_epoch: state.remote_epoch,
            open_epoch: state.open_epoch,
            log_used_bytes: state.used_bytes,
            log_capacity_bytes: self.shared.log_end - self.shared.log_start,
            fallbacks: counters.fallbacks.load(Ordering::Relaxed),
            read_blocks_local: counters.read_blocks_local.load(Ordering::Relaxed),
            read_blocks_remote: counters.read_blocks_remote.load(Ordering::Relaxed),
            read_cache_insert_failures: counters.read_cache_insert_failures.load(Ordering::Relaxed),
            writeback_epochs: state.writeback_epochs,
            writeback_failures_in_a_row: state.writeback_failures_in_a_row,
            writeback_error: state.writeback_error.clone(),
        }
    }

    /// The remote device.
    pub fn remote(&self) -> &R {
        &self.shared.remote
    }

    /// The local device.
    pub fn local(&self) -> &L {
        &self.shared.local
    }

    /// Closes the open epoch and waits until every logged write is on the remote, flushed
    /// (whatever `flush_to` says). Returns the remote's error once write-back has failed
    /// `writeback_attempts_max` times in a row.
    pub fn drain(&self) -> io::Result<()> {
        let target = self.shared.close_epoch();
        self.shared.wait_for_remote(target)
    }

    /// Stops write-back without waiting for it to finish an epoch it has not started; for
    /// tests that model a crash (nothing is flushed or written on the way out).
    pub fn stop(mut self) {
        self.stop_writeback();
    }

    fn stop_writeback(&mut self) {
        self.shared.state.lock().stopping = true;
        self.shared.changed.notify_all();
        if let Some(thread) = self.writeback.take() {
            let _ = thread.join();
        }
    }
}

impl<R: Device + 'static, L: Device + 'static> Drop for LocalTier<R, L> {
    fn drop(&mut self) {
        // Records still in the log buffer go to the device (not fsynced: like any write
        // after the last flush), as they would with a log written through the page cache;
        // `stop` (a modelled crash) has set `stopping` and writes nothing.
        {
            let mut state = self.shared.state.lock();
            if !state.stopping {
                if let Err(error) = self.shared.write_log_buffer(&mut state) {
                    tracing::warn!(local = %self.shared.local_name, %error, "writing the local cache's log buffer on the way out failed");
                }
            }
        }
        self.stop_writeback();
    }
}

fn check_identity(identity: &str) -> Result<(), TierError> {
    if identity.len() > IDENTITY_BYTES_MAX {
        return Err(TierError::IdentityTooLong(identity.len()));
    }
    Ok(())
}

fn check_backend(
    remote: &impl Device,
    identity: &str,
    config: &LocalTierConfig,
) -> Result<(), TierError> {
    if !remote.len().is_multiple_of(u64::from(config.block_bytes)) {
        return Err(TierError::BackendNotBlockMultiple {
            identity: identity.to_string(),
            backend_bytes: remote.len(),
            block_bytes: config.block_bytes,
        });
    }
    Ok(())
}

impl<R: Device, L: Device> Shared<R, L> {
    fn capacity_bytes(&self) -> u64 {
        self.log_end - self.log_start
    }

    fn local_error(&self, what: &str, error: io::Error) -> io::Error {
        io::Error::new(
            error.kind(),
            format!("local cache {}: {what}: {error}", self.local_name),
        )
    }

    /// True when `header`, at `position`, continues a chain whose next record must carry
    /// `sequence` and name `previous_crc`, with `used_bytes` of the log taken before it.
    fn chains(
        &self,
        header: &RecordHeader,
        position: u64,
        sequence: u64,
        previous_crc: u32,
        used_bytes: u64,
    ) -> bool {
        let space_bytes = match header.kind {
            RecordKind::Wrap => self.log_end - position,
            _ => header.total_bytes(),
        };
        let payload_expected = if header.kind.has_payload() {
            header.length_bytes
        } else {
            0
        };
        header.sequence == sequence
            && header.previous_crc == previous_crc
            && u64::from(header.payload_bytes) == payload_expected
            && position + header.total_bytes() <= self.log_end
            && used_bytes + space_bytes <= self.capacity_bytes()
            && (header.kind == RecordKind::Wrap
                || (header.disk_offset.is_multiple_of(self.block_bytes)
                    && header.length_bytes.is_multiple_of(self.block_bytes)
                    && header.length_bytes > 0
                    && header
                        .disk_offset
                        .checked_add(header.length_bytes)
                        .is_some_and(|end| end <= self.backend_bytes)))
    }

    /// Reads the record at `position` (the log's start when it is the log's end): its
    /// header, the CRC it claims, the log bytes it takes, and whether its CRC matches.
    /// None when no record header is there or it does not continue the chain as `chains`
    /// checks.
    fn read_record(
        &self,
        position: u64,
        sequence: u64,
        previous_crc: u32,
        used_bytes: u64,
        payload: &mut Vec<u8>,
    ) -> io::Result<Option<ReadRecord>> {
        let position = if position == self.log_end {
            self.log_start
        } else {
            position
        };
        if position + RECORD_HEADER_BYTES as u64 > self.log_end {
            return Ok(None);
        }
        let mut header_bytes = [0u8; RECORD_HEADER_BYTES];
        self.local
            .read_vectored_at(&mut [IoSliceMut::new(&mut header_bytes)], position)?;
        let Some((header, crc)) = RecordHeader::decode(&header_bytes) else {
            return Ok(None);
        };
        if !self.chains(&header, position, sequence, previous_crc, used_bytes) {
            return Ok(None);
        }
        payload.resize(header.payload_bytes as usize, 0);
        self.local.read_vectored_at(
            &mut [IoSliceMut::new(payload)],
            position + RECORD_HEADER_BYTES as u64,
        )?;
        let space_bytes = match header.kind {
            RecordKind::Wrap => self.log_end - position,
            _ => header.total_bytes(),
        };
        Ok(Some(ReadRecord {
            position,
            header,
            crc,
            space_bytes,
            intact: RecordHeader::verify(&header_bytes, payload, crc),
        }))
    }

    /// Starts this session once the log is replayed and checked: erases a damaged record the
    /// replay stopped at (`damage`, when replaying its prefix was asked), closes the
    /// replayed epochs, makes the new session durable, flushes the remote.
    fn start_session(&self, state: &mut State, damage: Option<Damage>) -> Result<(), TierError> {
        if let Some(damage) = damage {
            tracing::warn!(
                local = %self.local_name,
                offset = damage.offset,
                sequence = damage.sequence,
                valid_after = damage.valid_after,
                "local cache: the log record at this offset is damaged although a later \
                 record proves it was fsynced; replaying only the records before it, as \
                 --local-cache-replay-prefix asks: the writes from it on are discarded"
            );
            // The damaged record's header is erased (made durable by the checkpoint
            // below), so the log now ends there and later opens need no flag; its space
            // is the head, reused by the next record anyway.
            assert_eq!(
                damage.offset, state.head_position,
                "replay ends at the damage"
            );
            self.erase_at_head(state).map_err(|source| TierError::Io {
                local: self.local_name.clone(),
                what: "erasing a damaged record",
                source,
            })?;
        }
        Self::close_replayed_epochs(state);
        // The new session is durable before any record of it is written (Chain).
        self.write_checkpoint(state)
            .map_err(|source| TierError::Io {
                local: self.local_name.clone(),
                what: "writing a checkpoint",
                source,
            })?;
        match self.remote.flush() {
            Ok(()) => state.remote_unflushed = false,
            Err(error) => tracing::warn!(
                local = %self.local_name,
                %error,
                "flushing the backend at start failed: reads are not cached until a flush succeeds"
            ),
        }
        if !state.dirty_epochs.is_empty() {
            tracing::info!(
                local = %self.local_name,
                dirty_bytes = state.dirty_epochs.values().sum::<u64>(),
                epochs = state.dirty_epochs.len(),
                "local cache replayed: resuming write-back"
            );
        }
        Ok(())
    }

    /// Walks the chain from the persisted tail (Chain) and rebuilds the index. Returns the
    /// damage that stopped it when a later record proves the record it stopped at had been
    /// fsynced ([`Shared::damage_proof`]); a torn record with nothing durable after it just
    /// ends the log.
    fn replay(&self, state: &mut State) -> io::Result<Option<Damage>> {
        let mut position = state.tail_position;
        let mut payload = Vec::new();
        while let Some(record) = self.read_record(
            position,
            state.next_sequence,
            state.last_crc,
            state.used_bytes,
            &mut payload,
        )? {
            if !record.intact {
                return self.damage_proof(state, &record, &mut payload);
            }
            let meta = RecordMeta {
                position: record.position,
                space_bytes: record.space_bytes,
                sequence: record.header.sequence,
                epoch: record.header.epoch,
                kind: record.header.kind,
                disk_offset: record.header.disk_offset,
                length_bytes: record.header.length_bytes,
                crc: record.crc,
            };
            self.apply(state, meta);
            position = record.position + record.space_bytes;
            if position == self.log_end {
                position = self.log_start;
            }
            state.head_position = position;
        }
        Ok(None)
    }

    /// Called with a record whose header continues the chain but whose CRC does not match.
    /// A crash may tear any record written after the last fsync, and later ones may survive
    /// it, so the damage is proven (not a crash) only by a later intact record, chained after
    /// it through the CRCs the headers claim, whose durable mark covers its sequence: that
    /// record was written after the damaged one had been fsynced.
    fn damage_proof(
        &self,
        state: &State,
        damaged: &ReadRecord,
        payload: &mut Vec<u8>,
    ) -> io::Result<Option<Damage>> {
        let mut position = damaged.position + damaged.space_bytes;
        let mut sequence = damaged.header.sequence;
        let mut previous_crc = damaged.crc;
        let mut used_bytes = state.used_bytes + damaged.space_bytes;
        let mut proof = None;
        let mut valid_after = 0u64;
        while let Some(record) =
            self.read_record(position, sequence + 1, previous_crc, used_bytes, payload)?
        {
            if record.intact {
                valid_after += 1;
                if proof.is_none() && record.header.durable_sequence > damaged.header.sequence {
                    proof = Some((record.position, record.header.sequence));
                }
            }
            position = record.position + record.space_bytes;
            sequence = record.header.sequence;
            previous_crc = record.crc;
            used_bytes += record.space_bytes;
        }
        Ok(proof.map(|(proof_offset, proof_sequence)| Damage {
            offset: damaged.position,
            sequence: damaged.header.sequence,
            proof_offset,
            proof_sequence,
            valid_after,
        }))
    }

    /// Compares up to `sampled_blocks_max` clean blocks of the replayed index, spread evenly
    /// over them, with the remote's bytes. A clean block is a copy of what the remote held:
    /// a read-cache record, or a write whose epoch the checkpoint says is on the remote and
    /// that no later record of the block supersedes (the index holds only the newest). So a
    /// mismatch means the remote is another disk, or was written around this cache: serving
    /// these copies would serve stale blocks and write-back would replay writes into it. A
    /// remote read that fails leaves its block unchecked (logged), never refuses the open.
    /// Reads only; the caller has written nothing yet. Returns the blocks compared.
    fn check_clean_blocks(&self, state: &State, identity: &str) -> Result<u64, TierError> {
        let sampled_max = self.config.sampled_blocks_max;
        if sampled_max == 0 {
            return Ok(0);
        }
        let clean_position = |entry: &Entry| -> Option<u64> {
            let Entry::Data { sequence, position } = *entry else {
                return None;
            };
            let at = state
                .records
                .binary_search_by_key(&sequence, |record| record.sequence)
                .ok()?;
            let record = &state.records[at];
            let clean = record.kind == RecordKind::Clean
                || (record.kind == RecordKind::Dirty && record.epoch <= state.remote_epoch);
            clean.then_some(position)
        };
        let clean_count = state
            .index
            .values()
            .filter(|entry| clean_position(entry).is_some())
            .count();
        if clean_count == 0 {
            return Ok(0);
        }
        // Every stride-th clean block, so the sample spans the whole disk's cached range.
        let stride = clean_count.div_ceil(sampled_max);
        let chosen: Vec<(u64, u64)> = state
            .index
            .iter()
            .filter_map(|(&block, entry)| clean_position(entry).map(|position| (block, position)))
            .step_by(stride)
            .collect();
        assert!(chosen.len() <= sampled_max, "the sample is bounded");
        assert!(!chosen.is_empty(), "a clean block exists");
        let block_bytes = self.block_bytes as usize;
        let mut local_bytes = vec![0u8; block_bytes];
        let mut remote_bytes = vec![0u8; block_bytes];
        let mut sampled = 0u64;
        let mut mismatched = 0u64;
        let mut first_offset = None;
        for (block, position) in chosen {
            let offset = block * self.block_bytes;
            self.local
                .read_vectored_at(&mut [IoSliceMut::new(&mut local_bytes)], position)
                .map_err(|source| TierError::Io {
                    local: self.local_name.clone(),
                    what: "reading a clean block to compare with the backend",
                    source,
                })?;
            if let Err(error) = self
                .remote
                .read_vectored_at(&mut [IoSliceMut::new(&mut remote_bytes)], offset)
            {
                tracing::warn!(
                    local = %self.local_name,
                    offset,
                    %error,
                    "local cache: the backend did not answer a read of a sampled clean block; left unchecked"
                );
                continue;
            }
            sampled += 1;
            if local_bytes != remote_bytes {
                mismatched += 1;
                first_offset.get_or_insert(offset);
            }
        }
        assert!(mismatched <= sampled);
        match first_offset {
            None => Ok(sampled),
            Some(first_offset) => Err(TierError::OtherContent {
                local: self.local_name.clone(),
                identity: identity.to_string(),
                sampled,
                mismatched,
                first_offset,
                dirty_bytes: state.dirty_epochs.values().sum(),
                epochs: state.dirty_epochs.len() as u64,
            }),
        }
    }

    /// Writes of epochs that were open at the crash are written back as closed epochs.
    fn close_replayed_epochs(state: &mut State) {
        let epoch_seen = state
            .records
            .iter()
            .map(|record| record.epoch)
            .max()
            .unwrap_or(0);
        state.open_epoch = state.open_epoch.max(epoch_seen + 1);
    }

    /// Adds a record just written (or replayed) to the state and the index.
    fn apply(&self, state: &mut State, meta: RecordMeta) {
        let first_block = meta.disk_offset / self.block_bytes;
        let blocks = meta.length_bytes / self.block_bytes;
        match meta.kind {
            RecordKind::Dirty | RecordKind::Clean => {
                for index in 0..blocks {
                    state.index.insert(
                        first_block + index,
                        Entry::Data {
                            sequence: meta.sequence,
                            position: meta.position
                                + RECORD_HEADER_BYTES as u64
                                + index * self.block_bytes,
                        },
                    );
                }
            }
            RecordKind::Zero | RecordKind::Discard => {
                for index in 0..blocks {
                    state.index.insert(
                        first_block + index,
                        Entry::Zero {
                            sequence: meta.sequence,
                        },
                    );
                }
            }
            RecordKind::Invalidate => {
                let stale: Vec<u64> = state
                    .index
                    .range(first_block..first_block + blocks)
                    .map(|(&block, _)| block)
                    .collect();
                for block in stale {
                    state.index.remove(&block);
                }
                state.generation += 1;
            }
            RecordKind::Wrap => {}
        }
        if meta.kind.is_write() && meta.epoch > state.remote_epoch {
            *state.dirty_epochs.entry(meta.epoch).or_default() += meta.length_bytes;
        }
        // The log holds records in sequence order, each inside the log area, and never more
        // bytes than the area has.
        strict_assert!(
            state
                .records
                .back()
                .is_none_or(|last| last.sequence < meta.sequence),
            "record {} appended after record {:?}",
            meta.sequence,
            state.records.back().map(|last| last.sequence)
        );
        strict_assert!(
            meta.position >= self.log_start && meta.position + meta.space_bytes <= self.log_end,
            "record {} at {} ({} bytes) outside the log [{}, {})",
            meta.sequence,
            meta.position,
            meta.space_bytes,
            self.log_start,
            self.log_end
        );
        state.records.push_back(meta);
        state.used_bytes += meta.space_bytes;
        strict_assert!(
            state.used_bytes <= self.capacity_bytes(),
            "{} bytes of records in a log of {}",
            state.used_bytes,
            self.capacity_bytes()
        );
        state.next_sequence = meta.sequence + 1;
        state.last_crc = meta.crc;
    }

    /// Writes the next checkpoint (alternating slots) and flushes the local device.
    fn write_checkpoint(&self, state: &mut State) -> io::Result<()> {
        // The fsync below marks every record appended so far durable (Written before durable).
        self.write_log_buffer(state)?;
        strict_assert!(
            state.tail_position >= self.log_start && state.tail_position <= self.log_end,
            "checkpointing tail {} outside the log [{}, {})",
            state.tail_position,
            self.log_start,
            self.log_end
        );
        strict_assert!(
            state
                .records
                .front()
                .is_none_or(|first| first.sequence == state.tail_sequence),
            "the checkpoint's tail sequence {} is not the first record's",
            state.tail_sequence
        );
        let checkpoint = Checkpoint {
            generation: state.checkpoint_generation + 1,
            session: state.session,
            tail_position: state.tail_position,
            tail_sequence: state.tail_sequence,
            tail_previous_crc: state.tail_previous_crc,
            remote_epoch: state.remote_epoch,
        };
        let mut slots = state.checkpoint_slots;
        slots[(checkpoint.generation % 2) as usize] = checkpoint.encode();
        let page_bytes = LOG_PAGE_BYTES as usize;
        let mut page = AlignedBytes::zeroed(page_bytes, page_bytes);
        for (slot, offset) in slots.iter().zip(CHECKPOINT_OFFSETS) {
            let at = (offset - CHECKPOINT_OFFSETS[0]) as usize;
            page[at..at + CHECKPOINT_BYTES].copy_from_slice(slot);
        }
        // Both slots in one page write (Pages); the other slot's bytes are unchanged.
        let written = self
            .local
            .write_vectored_at(&[IoSlice::new(&page)], CHECKPOINT_OFFSETS[0])
            .and_then(|()| self.local.flush());
        if let Err(error) = written {
            state.local_failure = Some(format!("writing a checkpoint: {error}"));
            return Err(error);
        }
        state.checkpoint_slots = slots;
        state.tail_position_persisted = checkpoint.tail_position;
        state.checkpoint_generation = checkpoint.generation;
        // The fsync covered every record appended so far, so every closed epoch's.
        state.durable_epoch = state.durable_epoch.max(state.open_epoch - 1);
        state.durable_sequence = state.durable_sequence.max(state.next_sequence);
        Ok(())
    }

    /// Writes the log buffer out and returns the sequence below which every record is now on
    /// the local device: what the fsync the caller makes next covers (Written before durable).
    fn written_sequence(&self) -> io::Result<u64> {
        let mut state = self.state.lock();
        self.write_log_buffer(&mut state)?;
        Ok(state.next_sequence)
    }

    /// Records that every record with a sequence below `covered` (read before an fsync that
    /// then succeeded) is durable.
    fn mark_durable(&self, covered: u64) {
        let mut state = self.state.lock();
        // Only records appended can be durable.
        strict_assert!(
            covered <= state.next_sequence,
            "records below {covered} marked durable; {} appended",
            state.next_sequence
        );
        state.durable_sequence = state.durable_sequence.max(covered);
    }

    /// Refuses when the local device has failed a checkpoint or an fsync (`local_failure`).
    fn check_local(&self, state: &State) -> io::Result<()> {
        match &state.local_failure {
            None => Ok(()),
            Some(failure) => Err(io::Error::other(format!(
                "local cache {}: refusing writes and flushes after a failure of the local \
                 device ({failure}); restart the server to replay the log",
                self.local_name
            ))),
        }
    }

    /// True when the record at the tail may be dropped (Dirty).
    fn droppable(state: &State, record: &RecordMeta) -> bool {
        !(record.kind.is_write() && record.epoch > state.remote_epoch)
    }

    /// Drops the tail record from the log and the index; the caller persists the new tail
    /// before reusing its space (Tail).
    fn drop_tail(&self, state: &mut State) {
        let record = state.records.pop_front().expect("a record to drop");
        // A write the remote does not hold yet is never dropped (Tail): its log record is
        // the only copy.
        strict_assert!(
            Self::droppable(state, &record),
            "dropping record {} of epoch {} while the remote holds epochs up to {}",
            record.sequence,
            record.epoch,
            state.remote_epoch
        );
        strict_assert!(state.used_bytes >= record.space_bytes);
        state.used_bytes -= record.space_bytes;
        state.tail_sequence = record.sequence + 1;
        state.tail_previous_crc = record.crc;
        state.tail_position = state
            .records
            .front()
            .map_or(state.head_position, |next| next.position);
        if matches!(
            record.kind,
            RecordKind::Dirty | RecordKind::Clean | RecordKind::Zero | RecordKind::Discard
        ) {
            let first_block = record.disk_offset / self.block_bytes;
            for block in first_block..first_block + record.length_bytes / self.block_bytes {
                if state
                    .index
                    .get(&block)
                    .is_some_and(|entry| entry.sequence() == record.sequence)
                {
                    state.index.remove(&block);
                }
            }
            if record.kind != RecordKind::Clean {
                state.generation += 1;
            }
        }
    }

    /// Finds `total_bytes` of contiguous log space at the head, dropping clean records at the
    /// tail (and persisting the new tail) or writing a wrap record as needed.
    fn reserve(&self, state: &mut State, total_bytes: u64) -> Result<u64, NoSpace> {
        if total_bytes > self.capacity_bytes() / 2 {
            return Err(NoSpace::TooLarge);
        }
        loop {
            let full = state.used_bytes > 0 && state.head_position == state.tail_position;
            let head_after_tail =
                state.used_bytes == 0 || state.head_position > state.tail_position;
            enum Fit {
                Here,
                AfterWrap,
                No,
            }
            let fit = if full {
                Fit::No
            } else if head_after_tail {
                if state.head_position + total_bytes <= self.log_end {
                    Fit::Here
                } else if state.tail_position - self.log_start >= total_bytes {
                    Fit::AfterWrap
                } else {
                    Fit::No
                }
            } else if state.tail_position - state.head_position >= total_bytes {
                Fit::Here
            } else {
                Fit::No
            };
            match fit {
                Fit::Here => {
                    strict_assert!(state.head_position + total_bytes <= self.log_end);
                    return Ok(state.head_position);
                }
                Fit::AfterWrap => {
                    let position = state.head_position;
                    self.append_at(state, position, RecordKind::Wrap, 0, 0, &[])
                        .map_err(NoSpace::Io)?;
                }
                Fit::No => {
                    // Drop ahead by an eighth of the log, so the checkpoint this costs is paid
                    // once per many records.
                    let free_wanted =
                        (total_bytes + self.capacity_bytes() / 8).min(self.capacity_bytes());
                    let mut dropped = 0usize;
                    while let Some(record) = state.records.front() {
                        let enough = self.capacity_bytes() - state.used_bytes >= free_wanted;
                        if !Self::droppable(state, record) || (dropped > 0 && enough) {
                            break;
                        }
                        self.drop_tail(state);
                        dropped += 1;
                    }
                    if dropped == 0 {
                        return Err(NoSpace::Dirty);
                    }
                    self.write_checkpoint(state).map_err(NoSpace::Io)?;
                }
            }
        }
    }

    /// Starts the log buffer at the head's page, with the bytes the device holds there
    /// before the head (after replay).
    fn load_log_buffer(&self, state: &mut State) -> io::Result<()> {
        let head = state.head_position;
        let page_start = head / LOG_PAGE_BYTES * LOG_PAGE_BYTES;
        let bytes = (head - page_start) as usize;
        let mut buffer = Self::log_buffer_allocate(bytes);
        if bytes > 0 {
            self.local
                .read_vectored_at(&mut [IoSliceMut::new(&mut buffer[..bytes])], page_start)?;
        }
        state.log_buffer = Some(buffer);
        state.log_buffer_start = page_start;
        state.log_buffer_bytes = bytes;
        state.log_buffer_unwritten = false;
        Ok(())
    }

    /// Page-aligned memory for a log buffer of `bytes`, with room for a page of fill after
    /// it and for the appends up to the next write-out.
    fn log_buffer_allocate(bytes: usize) -> AlignedBytes {
        let page = LOG_PAGE_BYTES as usize;
        let capacity = (bytes + page).max(LOG_BUFFER_BYTES_MAX + 2 * page);
        AlignedBytes::zeroed(capacity.next_multiple_of(page), page)
    }

    /// Appends `parts` at the head `position` into the log buffer and moves the head to
    /// `new_head` (the first byte after them, or the log's start when they reach the log's
    /// end, where the buffer is written out: it never spans the wrap). `write_out` asks for
    /// the buffer to go to the device now; it also goes once it holds
    /// `LOG_BUFFER_BYTES_MAX`.
    fn append_bytes(
        &self,
        state: &mut State,
        position: u64,
        parts: &[&[u8]],
        new_head: u64,
        write_out: bool,
    ) -> io::Result<()> {
        assert_eq!(
            position, state.head_position,
            "the log is appended to at its head"
        );
        assert_eq!(
            state.log_buffer_start + state.log_buffer_bytes as u64,
            position,
            "the log buffer ends at the head"
        );
        let length: usize = parts.iter().map(|part| part.len()).sum();
        let end = position + length as u64;
        assert!(end <= self.log_end, "an append past the log's end");
        assert!(
            new_head == end || new_head == self.log_start,
            "the head moves past the appended bytes, or wraps"
        );
        let needed = state.log_buffer_bytes + length + LOG_PAGE_BYTES as usize;
        if state
            .log_buffer
            .as_ref()
            .is_none_or(|buffer| buffer.len() < needed)
        {
            let mut grown = Self::log_buffer_allocate(state.log_buffer_bytes + length);
            if let Some(old) = &state.log_buffer {
                grown[..state.log_buffer_bytes].copy_from_slice(&old[..state.log_buffer_bytes]);
            }
            state.log_buffer = Some(grown);
        }
        let buffer = state.log_buffer.as_mut().expect("a log buffer");
        let mut at = state.log_buffer_bytes;
        for part in parts {
            buffer[at..at + part.len()].copy_from_slice(part);
            at += part.len();
        }
        state.log_buffer_bytes = at;
        state.log_buffer_unwritten = true;
        if new_head != end {
            // A wrap record, or a record that ends the log.
            self.write_log_buffer(state)?;
            state.log_buffer_start = self.log_start;
            state.log_buffer_bytes = 0;
        } else if write_out || state.log_buffer_bytes >= LOG_BUFFER_BYTES_MAX {
            self.write_log_buffer(state)?;
        }
        state.head_position = new_head;
        Ok(())
    }

    /// Writes the log buffer out in whole pages (Pages) when it holds records not yet written,
    /// then keeps only the head's partial page in it. A failure latches `local_failure`
    /// (Written before durable).
    fn write_log_buffer(&self, state: &mut State) -> io::Result<()> {
        if !state.log_buffer_unwritten {
            return Ok(());
        }
        self.check_local(state)?;
        let page = LOG_PAGE_BYTES;
        let start = state.log_buffer_start;
        let bytes = state.log_buffer_bytes;
        let end = start + bytes as u64;
        assert!(start.is_multiple_of(page), "the log buffer starts a page");
        let write_end = end.next_multiple_of(page).min(self.log_end);
        let write_bytes = (write_end - start) as usize;
        // A tail ahead in the last page — the live one, or the persisted one replay would
        // start at after a crash — keeps its bytes there: they are read and written back as
        // they are. The rest of the page after the buffer is free and written as zeroes.
        let live_tail = (state.used_bytes > 0).then_some(state.tail_position);
        let kept_from = [live_tail, Some(state.tail_position_persisted)]
            .into_iter()
            .flatten()
            .filter(|&tail| tail >= end && tail < write_end)
            .min();
        let buffer = state
            .log_buffer
            .as_mut()
            .expect("a log buffer with records");
        assert!(
            buffer.len() >= write_bytes,
            "the log buffer has room for its last page"
        );
        let zero_end = kept_from.unwrap_or(write_end);
        buffer[bytes..(zero_end - start) as usize].fill(0);
        let mut result = Ok(());
        if let Some(tail) = kept_from {
            let from = (tail - start) as usize;
            result = self
                .local
                .read_vectored_at(&mut [IoSliceMut::new(&mut buffer[from..write_bytes])], tail);
        }
        let result = result.and_then(|()| {
            self.local
                .write_vectored_at(&[IoSlice::new(&buffer[..write_bytes])], start)
        });
        if let Err(error) = result {
            state.local_failure = Some(format!("writing the log: {error}"));
            return Err(self.local_error("writing the log", error));
        }
        let kept_start = end / page * page;
        let kept = (end - kept_start) as usize;
        buffer.copy_within((kept_start - start) as usize..bytes, 0);
        state.log_buffer_start = kept_start;
        state.log_buffer_bytes = kept;
        state.log_buffer_unwritten = false;
        Ok(())
    }

    /// Zeroes the record slot at the head (a damaged record replay stopped at), through the
    /// log buffer, and writes it out; the head stays.
    fn erase_at_head(&self, state: &mut State) -> io::Result<()> {
        let head = state.head_position;
        let zeroes = [0u8; RECORD_ALIGNMENT_BYTES as usize];
        let start = state.log_buffer_start;
        let saved =
            state.log_buffer.as_ref().expect("a log buffer")[..state.log_buffer_bytes].to_vec();
        let mut after = head + zeroes.len() as u64;
        if after == self.log_end {
            after = self.log_start;
        }
        self.append_bytes(state, head, &[&zeroes], after, true)?;
        // The head stays: the buffer goes back to the bytes before it.
        state.log_buffer.as_mut().expect("a log buffer")[..saved.len()].copy_from_slice(&saved);
        state.log_buffer_start = start;
        state.log_buffer_bytes = saved.len();
        state.head_position = head;
        Ok(())
    }

    /// Writes a record at `position` (reserved) and applies it.
    fn append_at(
        &self,
        state: &mut State,
        position: u64,
        kind: RecordKind,
        disk_offset: u64,
        length_bytes: u64,
        payload: &[&[u8]],
    ) -> io::Result<()> {
        self.check_local(state)?;
        let payload_bytes: u64 = payload.iter().map(|part| part.len() as u64).sum();
        let header = RecordHeader {
            kind,
            sequence: state.next_sequence,
            session: state.session,
            epoch: state.open_epoch,
            disk_offset,
            length_bytes,
            payload_bytes: payload_bytes as u32,
            previous_crc: state.last_crc,
            durable_sequence: state.durable_sequence,
        };
        let (header_bytes, crc) = header.encode(payload);
        let total_bytes = record_total_bytes(payload_bytes);
        let padding = [0u8; RECORD_ALIGNMENT_BYTES as usize];
        let padding_bytes = (total_bytes - RECORD_HEADER_BYTES as u64 - payload_bytes) as usize;
        let mut parts: Vec<&[u8]> = Vec::with_capacity(payload.len() + 2);
        parts.push(&header_bytes);
        parts.extend_from_slice(payload);
        parts.push(&padding[..padding_bytes]);
        let space_bytes = match kind {
            RecordKind::Wrap => self.log_end - position,
            _ => total_bytes,
        };
        let mut head = position + space_bytes;
        if head == self.log_end {
            head = self.log_start;
        }
        // Clean records go out at once, so a restart after kill -9 finds the read cache as
        // warm as it was; an invalidation is fsynced right after; a wrap ends the buffer.
        let write_out = matches!(
            kind,
            RecordKind::Clean | RecordKind::Invalidate | RecordKind::Wrap
        );
        self.append_bytes(state, position, &parts, head, write_out)?;
        let meta = RecordMeta {
            position,
            space_bytes,
            sequence: header.sequence,
            epoch: header.epoch,
            kind,
            disk_offset,
            length_bytes,
            crc,
        };
        self.apply(state, meta);
        if kind.is_write() {
            state.open_epoch_has_writes = true;
        }
        Ok(())
    }

    /// Logs one write record (dirty data, zeroes or discard), falling back to remote
    /// durability when the log cannot take it (Write-through).
    fn log_write(
        &self,
        kind: RecordKind,
        disk_offset: u64,
        length_bytes: u64,
        payload: &[&[u8]],
    ) -> io::Result<()> {
        let payload_bytes: usize = payload.iter().map(|part| part.len()).sum();
        let total_bytes = record_total_bytes(payload_bytes as u64);
        {
            let _order = self.order.read();
            let mut state = self.state.lock();
            match self.reserve(&mut state, total_bytes) {
                Ok(position) => {
                    return self.append_at(
                        &mut state,
                        position,
                        kind,
                        disk_offset,
                        length_bytes,
                        payload,
                    )
                }
                Err(NoSpace::Io(error)) => return Err(error),
                Err(NoSpace::Dirty | NoSpace::TooLarge) => {}
            }
        }
        self.write_through(kind, disk_offset, length_bytes, &payload.concat())
    }

    /// The fallback: waits until everything logged is on the remote, then logs the write if
    /// it now fits, or else invalidates its range durably and writes it to the remote.
    fn write_through(
        &self,
        kind: RecordKind,
        disk_offset: u64,
        length_bytes: u64,
        payload: &[u8],
    ) -> io::Result<()> {
        let _order = self.order.write();
        let fallbacks = self.counters.fallbacks.fetch_add(1, Ordering::Relaxed) + 1;
        tracing::warn!(
            local = %self.local_name,
            remote = %self.remote.describe(),
            bytes = length_bytes,
            fallbacks,
            "local cache has no room for a write (full of data not yet on the remote, or the \
             write is larger than a record): falling back to remote durability for it"
        );
        let target = self.close_epoch();
        self.wait_for_remote_bounded(target, Some(self.config.remote_stall_max))?;
        let total_bytes = record_total_bytes(payload.len() as u64);
        // Zeroings too long for a record (one index entry per block) always go through.
        let loggable =
            kind == RecordKind::Dirty || length_bytes <= self.config.zero_record_bytes_max;
        {
            let mut state = self.state.lock();
            match loggable.then(|| self.reserve(&mut state, total_bytes)) {
                None => {}
                Some(Ok(position)) => {
                    return self.append_at(
                        &mut state,
                        position,
                        kind,
                        disk_offset,
                        length_bytes,
                        &[payload],
                    )
                }
                Some(Err(NoSpace::Io(error))) => return Err(error),
                Some(Err(NoSpace::Dirty | NoSpace::TooLarge)) => {}
            }
            let position = match self.reserve(&mut state, record_total_bytes(0)) {
                Ok(position) => position,
                Err(NoSpace::Io(error)) => return Err(error),
                Err(NoSpace::Dirty | NoSpace::TooLarge) => {
                    return Err(io::Error::other(format!(
                        "local cache {}: no room even for an invalidation record after \
                         write-back drained the log",
                        self.local_name
                    )))
                }
            };
            self.append_at(
                &mut state,
                position,
                RecordKind::Invalidate,
                disk_offset,
                length_bytes,
                &[],
            )?;
        }
        // The invalidation is durable before the remote changes, so a replay never serves
        // the older local copies over what the remote then holds.
        let covered = self.written_sequence()?;
        if let Err(error) = self.local.flush() {
            self.state.lock().local_failure = Some(format!("flushing an invalidation: {error}"));
            return Err(self.local_error("flushing an invalidation", error));
        }
        self.mark_durable(covered);
        let result = match kind {
            RecordKind::Dirty => {
                let step = self
                    .remote_capabilities
                    .request_bytes_max
                    .max(self.block_bytes)
                    / self.block_bytes
                    * self.block_bytes;
                let mut done = 0u64;
                let mut result = Ok(());
                while done < length_bytes && result.is_ok() {
                    let piece = (length_bytes - done).min(step);
                    result = self.remote.write_vectored_at(
                        &[IoSlice::new(
                            &payload[done as usize..(done + piece) as usize],
                        )],
                        disk_offset + done,
                    );
                    done += piece;
                }
                result
            }
            RecordKind::Zero => self.remote.write_zeroes(disk_offset, length_bytes),
            _ => self.remote.discard(disk_offset, length_bytes),
        };
        // Flushed before returning, so no later write (logged, so durable at the next local
        // flush) can survive a crash that this one does not: replay stays a prefix.
        let result = result.and_then(|()| self.remote.flush());
        let mut state = self.state.lock();
        // A read that went to the remote while this write was landing may have read the old
        // bytes: it must not cache them. After a failure, no read caches what it finds there
        // until the remote is flushed (`remote_unflushed`).
        state.generation += 1;
        state.remote_unflushed = result.is_err();
        result
    }

    /// Closes the open epoch if it has writes; returns the last closed epoch.
    fn close_epoch(&self) -> u64 {
        let mut state = self.state.lock();
        if state.open_epoch_has_writes {
            state.open_epoch += 1;
            state.open_epoch_has_writes = false;
            self.changed.notify_all();
        }
        // A closed epoch is never one the remote or the local device already covers wrongly:
        // the remote holds only closed epochs.
        strict_assert!(state.remote_epoch < state.open_epoch);
        state.open_epoch - 1
    }

    /// Waits until every logged write of epochs up to `target` is on the remote. Fails once
    /// write-back has failed `writeback_attempts_max` times in a row, the last of them while
    /// this call waited (so a remote that is back gets its retry first).
    fn wait_for_remote(&self, target: u64) -> io::Result<()> {
        self.wait_for_remote_bounded(target, None)
    }

    /// [`Shared::wait_for_remote`], giving up once write-back has made no progress for
    /// `stall_max` (see [`LocalTierConfig::remote_stall_max`]).
    fn wait_for_remote_bounded(&self, target: u64, stall_max: Option<Duration>) -> io::Result<()> {
        let mut state = self.state.lock();
        let failures_before = state.writeback_failures_total;
        let mut progress_seen = self.counters.remote_progress.load(Ordering::Acquire);
        let mut progress_at = Instant::now();
        loop {
            if state
                .dirty_epochs
                .first_key_value()
                .is_none_or(|(&epoch, _)| epoch > target)
            {
                return Ok(());
            }
            if state.writeback_failures_in_a_row >= self.config.writeback_attempts_max
                && state.writeback_failures_total > failures_before
            {
                return Err(io::Error::other(format!(
                    "write-back to {} failed {} times in a row: {}",
                    self.remote.describe(),
                    state.writeback_failures_in_a_row,
                    state.writeback_error.as_deref().unwrap_or("unknown error")
                )));
            }
            if state.stopping {
                return Err(io::Error::other("the local tier is stopping"));
            }
            match (self.config.writeback_driver, stall_max) {
                (WritebackDriver::Thread, None) => self.changed.wait(&mut state),
                (WritebackDriver::Thread, Some(stall_max)) => {
                    let progress = self.counters.remote_progress.load(Ordering::Acquire);
                    if progress != progress_seen {
                        progress_seen = progress;
                        progress_at = Instant::now();
                    }
                    let stalled = progress_at.elapsed();
                    if stalled >= stall_max {
                        return Err(self.stalled_error(&state, target, stall_max));
                    }
                    self.changed.wait_for(&mut state, stall_max - stalled);
                }
                (WritebackDriver::Caller, _) => {
                    // Nobody else writes back: this caller does, one epoch per step, until
                    // its target is on the remote or the failures above stop it.
                    drop(state);
                    let step = self.writeback_step();
                    state = self.state.lock();
                    if step == WritebackStep::Idle {
                        return Err(io::Error::other(format!(
                            "local cache {}: epochs up to {target} are not on the remote, yet \
                             write-back found nothing to do",
                            self.local_name
                        )));
                    }
                }
            }
        }
    }

    /// Writes whole blocks at a block-aligned offset, record by record: `parts` (the
    /// client's buffers, in order) are cut at every `record_bytes_max` and go into the log
    /// buffer as they are, without being gathered first.
    fn write_blocks(&self, offset: u64, parts: &[&[u8]]) -> io::Result<()> {
        let step = self.config.record_bytes_max as usize;
        let mut record: Vec<&[u8]> = Vec::new();
        let mut record_bytes = 0usize;
        let mut at = offset;
        for part in parts {
            let mut rest: &[u8] = part;
            while !rest.is_empty() {
                let take = rest.len().min(step - record_bytes);
                record.push(&rest[..take]);
                record_bytes += take;
                rest = &rest[take..];
                if record_bytes == step {
                    self.log_write(RecordKind::Dirty, at, record_bytes as u64, &record)?;
                    at += record_bytes as u64;
                    record.clear();
                    record_bytes = 0;
                }
            }
        }
        if record_bytes > 0 {
            self.log_write(RecordKind::Dirty, at, record_bytes as u64, &record)?;
        }
        Ok(())
    }

    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.write_parts(offset, &[data])
    }

    /// Writes the concatenation of `parts` at `offset`.
    fn write_parts(&self, offset: u64, parts: &[&[u8]]) -> io::Result<()> {
        let length: usize = parts.iter().map(|part| part.len()).sum();
        check_range(self.backend_bytes, offset, length as u64)?;
        if self.remote_capabilities.read_only {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("{} is read-only", self.remote.describe()),
            ));
        }
        if length == 0 {
            return Ok(());
        }
        let end = offset + length as u64;
        if offset.is_multiple_of(self.block_bytes) && end.is_multiple_of(self.block_bytes) {
            return self.write_blocks(offset, parts);
        }
        let data = parts.concat();
        let _partial = self.partial_writes.lock();
        let start = offset / self.block_bytes * self.block_bytes;
        let stop = end.next_multiple_of(self.block_bytes);
        let mut whole = vec![0u8; (stop - start) as usize];
        let block = self.block_bytes as usize;
        self.read_at(start, &mut whole[..block])?;
        let last = whole.len() - block;
        self.read_at(stop - self.block_bytes, &mut whole[last..])?;
        whole[(offset - start) as usize..(end - start) as usize].copy_from_slice(&data);
        self.write_blocks(start, &[&whole])
    }

    /// Zeroes (or discards) a range: partial blocks at the edges by writing zeroes, whole
    /// blocks by a record, or through to the remote when longer than a zero record may be.
    fn zero_at(&self, offset: u64, length: u64, kind: RecordKind) -> io::Result<()> {
        check_range(self.backend_bytes, offset, length)?;
        if length == 0 {
            return Ok(());
        }
        let end = offset + length;
        let first_whole = offset.next_multiple_of(self.block_bytes);
        let last_whole = end / self.block_bytes * self.block_bytes;
        if first_whole >= last_whole {
            return match kind {
                RecordKind::Zero => self.write_at(offset, &vec![0u8; length as usize]),
                _ => Ok(()),
            };
        }
        if kind == RecordKind::Zero {
            if offset < first_whole {
                self.write_at(offset, &vec![0u8; (first_whole - offset) as usize])?;
            }
            if last_whole < end {
                self.write_at(last_whole, &vec![0u8; (end - last_whole) as usize])?;
            }
        }
        if last_whole - first_whole > self.config.zero_record_bytes_max {
            // A huge zeroing (mkfs's discard of a whole disk) would fill the index with one
            // entry per block: it goes to the remote in one piece instead.
            return self.write_through(kind, first_whole, last_whole - first_whole, &[]);
        }
        let mut at = first_whole;
        while at < last_whole {
            let piece = (last_whole - at).min(self.config.zero_record_bytes_max);
            self.log_write(kind, at, piece, &[])?;
            at += piece;
        }
        Ok(())
    }

    /// Reads `target.len()` bytes at `offset`: each block from its newest local record, or
    /// from the remote (then cached as a clean record).
    fn read_at(&self, offset: u64, target: &mut [u8]) -> io::Result<()> {
        check_range(self.backend_bytes, offset, target.len() as u64)?;
        if target.is_empty() {
            return Ok(());
        }
        let block = self.block_bytes;
        let first_block = offset / block;
        let end_block = (offset + target.len() as u64).div_ceil(block);
        let mut whole = vec![0u8; ((end_block - first_block) * block) as usize];
        let mut missing: Vec<(u64, u64)> = Vec::new();
        let generation_before;
        let mut local_blocks = 0u64;
        {
            let mut state = self.state.lock();
            // The log is read below where the index points: the records must be there.
            self.write_log_buffer(&mut state)?;
            generation_before = state.generation;
            for number in first_block..end_block {
                let at = ((number - first_block) * block) as usize;
                match state.index.get(&number) {
                    Some(Entry::Data { position, .. }) => {
                        self.local
                            .read_vectored_at(
                                &mut [IoSliceMut::new(&mut whole[at..at + block as usize])],
                                *position,
                            )
                            .map_err(|error| self.local_error("reading the log", error))?;
                        local_blocks += 1;
                    }
                    Some(Entry::Zero { .. }) => local_blocks += 1,
                    None => {
                        let relative = number - first_block;
                        match missing.last_mut() {
                            Some((start, count)) if *start + *count == relative => *count += 1,
                            _ => missing.push((relative, 1)),
                        }
                    }
                }
            }
        }
        let step = (self.remote_capabilities.request_bytes_max.max(block) / block).max(1);
        for &(start, count) in &missing {
            let mut done = 0u64;
            while done < count {
                let piece = (count - done).min(step);
                let at = ((start + done) * block) as usize;
                self.remote.read_vectored_at(
                    &mut [IoSliceMut::new(
                        &mut whole[at..at + (piece * block) as usize],
                    )],
                    (first_block + start + done) * block,
                )?;
                done += piece;
            }
        }
        let remote_blocks: u64 = missing.iter().map(|&(_, count)| count).sum();
        self.counters
            .read_blocks_local
            .fetch_add(local_blocks, Ordering::Relaxed);
        self.counters
            .read_blocks_remote
            .fetch_add(remote_blocks, Ordering::Relaxed);
        if !missing.is_empty() {
            self.cache_clean(first_block, &whole, &missing, generation_before);
        }
        let skip = (offset - first_block * block) as usize;
        target.copy_from_slice(&whole[skip..skip + target.len()]);
        Ok(())
    }

    /// Adds blocks read from the remote as clean records, when nothing changed them since and
    /// the log has room without waiting for write-back.
    fn cache_clean(&self, first_block: u64, whole: &[u8], missing: &[(u64, u64)], generation: u64) {
        let block = self.block_bytes;
        let blocks_per_record = self.config.record_bytes_max / block;
        let mut state = self.state.lock();
        if state.generation != generation || state.remote_unflushed {
            return;
        }
        for &(start, count) in missing {
            let mut done = 0u64;
            while done < count {
                let piece = (count - done).min(blocks_per_record);
                let number = first_block + start + done;
                let at = ((start + done) * block) as usize;
                done += piece;
                if state.index.range(number..number + piece).next().is_some() {
                    continue;
                }
                let payload = &whole[at..at + (piece * block) as usize];
                let position = match self.reserve(&mut state, record_total_bytes(piece * block)) {
                    Ok(position) => position,
                    Err(NoSpace::Dirty | NoSpace::TooLarge) => return,
                    Err(NoSpace::Io(error)) => {
                        self.insert_failed(&error);
                        return;
                    }
                };
                if let Err(error) = self.append_at(
                    &mut state,
                    position,
                    RecordKind::Clean,
                    number * block,
                    piece * block,
                    &[payload],
                ) {
                    self.insert_failed(&error);
                    return;
                }
            }
        }
    }

    fn insert_failed(&self, error: &io::Error) {
        self.counters
            .read_cache_insert_failures
            .fetch_add(1, Ordering::Relaxed);
        tracing::warn!(local = %self.local_name, %error, "could not add a block read from the remote to the local read cache");
    }

    /// The epoch write-back takes next: the oldest closed one with writes not yet on the
    /// remote (Epoch order).
    fn next_epoch(state: &State) -> Option<u64> {
        #[cfg(not(feature = "planted-defect"))]
        let next = state.dirty_epochs.first_key_value();
        // The planted defect (tests only): the newest closed epoch first.
        #[cfg(feature = "planted-defect")]
        let next = state.dirty_epochs.range(..state.open_epoch).next_back();
        next.map(|(&epoch, _)| epoch)
            .filter(|&epoch| epoch < state.open_epoch)
    }

    /// One unit of write-back (see [`LocalTier::writeback_step`]): epoch `E` written, the
    /// remote flushed, and "epochs up to `E` are on the remote" persisted, or the failure
    /// recorded for waiters and `/stats`.
    fn writeback_step(&self) -> WritebackStep {
        let _turn = self.writeback_turn.lock();
        let (epoch, runs) = {
            let state = self.state.lock();
            match Self::next_epoch(&state) {
                None => return WritebackStep::Idle,
                Some(epoch) => (epoch, self.plan(&state, epoch)),
            }
        };
        let outcome = self
            .make_durable(epoch)
            .and_then(|()| self.write_epoch(&runs))
            .and_then(|()| {
                let mut state = self.state.lock();
                let previous = state.remote_epoch;
                // (The planted defect breaks exactly this; its checkers must see it, so the
                // assertion stays out of that build.)
                #[cfg(not(feature = "planted-defect"))]
                assert!(
                    epoch > previous,
                    "write-back of epoch {epoch} after epoch {previous} is on the remote"
                );
                state.remote_epoch = epoch;
                match self.write_checkpoint(&mut state) {
                    Ok(()) => {
                        // write_epoch flushed the remote: what a failed write-through left
                        // there is durable now.
                        state.remote_unflushed = false;
                        state.dirty_epochs.remove(&epoch);
                        // Epochs reach the remote in order: none at or below it stays dirty.
                        #[cfg(not(feature = "planted-defect"))]
                        strict_assert!(
                            state.dirty_epochs.keys().all(|&dirty| dirty > epoch),
                            "epoch {epoch} on the remote before dirty epochs {:?}",
                            state.dirty_epochs.keys().collect::<Vec<_>>()
                        );
                        state.writeback_epochs += 1;
                        state.writeback_failures_in_a_row = 0;
                        state.writeback_error = None;
                        self.changed.notify_all();
                        Ok(())
                    }
                    Err(error) => {
                        state.remote_epoch = previous;
                        Err(self.local_error("persisting write-back progress", error))
                    }
                }
            });
        match outcome {
            Ok(()) => WritebackStep::Wrote { epoch },
            Err(error) => {
                let mut state = self.state.lock();
                state.writeback_failures_in_a_row += 1;
                state.writeback_failures_total += 1;
                state.writeback_error = Some(error.to_string());
                tracing::warn!(
                    remote = %self.remote.describe(),
                    epoch,
                    failures = state.writeback_failures_in_a_row,
                    %error,
                    "write-back of an epoch failed; retrying"
                );
                self.changed.notify_all();
                WritebackStep::Failed {
                    epoch,
                    error: error.to_string(),
                }
            }
        }
    }

    /// The write-back thread ([`WritebackDriver::Thread`]): waits for a closed epoch, runs
    /// [`Shared::writeback_step`], and after a failure waits before the retry (doubling).
    fn writeback_loop(&self) {
        let mut delay = self.config.writeback_retry_delay_initial;
        loop {
            {
                let mut state = self.state.lock();
                loop {
                    if state.stopping {
                        return;
                    }
                    if Self::next_epoch(&state).is_some() {
                        break;
                    }
                    self.changed.wait(&mut state);
                }
            }
            match self.writeback_step() {
                WritebackStep::Idle | WritebackStep::Wrote { .. } => {
                    delay = self.config.writeback_retry_delay_initial
                }
                WritebackStep::Failed { .. } => {
                    let mut state = self.state.lock();
                    if !state.stopping {
                        self.changed.wait_for(&mut state, delay);
                    }
                    delay = (delay * 2).min(self.config.writeback_retry_delay_max);
                }
            }
        }
    }

    /// Makes every record of `epoch` durable locally before any of it goes to the remote
    /// (Durable first): otherwise a crash could keep the epoch on the remote while the log
    /// loses it and keeps older clean copies of its blocks, and replay would serve a mix.
    /// Epochs closed by an acknowledged flush are durable already; those closed by a
    /// fallback, a drain or a failed flush are not.
    fn make_durable(&self, epoch: u64) -> io::Result<()> {
        if self.state.lock().durable_epoch >= epoch {
            return Ok(());
        }
        // The epoch is closed, so all its records were appended before this fsync.
        let covered = self.written_sequence()?;
        if let Err(error) = self.local.flush() {
            self.state.lock().local_failure = Some(format!("flushing the log: {error}"));
            return Err(self.local_error("flushing the log before write-back", error));
        }
        let mut state = self.state.lock();
        state.durable_epoch = state.durable_epoch.max(epoch);
        state.durable_sequence = state.durable_sequence.max(covered);
        Ok(())
    }

    /// The runs that put epoch `epoch` on the remote: the newest copy within the epoch of each
    /// block it wrote, sorted, adjacent blocks merged.
    fn plan(&self, state: &State, epoch: u64) -> Vec<Run> {
        #[derive(Clone, Copy, PartialEq)]
        enum Source {
            Data(u64),
            Zero,
            Discard,
        }
        let block = self.block_bytes;
        let mut newest: BTreeMap<u64, Source> = BTreeMap::new();
        for record in state.records.iter().filter(|record| record.epoch == epoch) {
            let first_block = record.disk_offset / block;
            for index in 0..record.length_bytes / block {
                let source = match record.kind {
                    RecordKind::Dirty => {
                        Source::Data(record.position + RECORD_HEADER_BYTES as u64 + index * block)
                    }
                    RecordKind::Zero => Source::Zero,
                    RecordKind::Discard => Source::Discard,
                    _ => continue,
                };
                newest.insert(first_block + index, source);
            }
        }
        // An object store writes whole chunks best (`write_unit_bytes`): data runs are cut at
        // its multiples and may grow to one, so each write covers whole units where it can.
        let unit = self.remote_capabilities.write_unit_bytes.max(1);
        let run_bytes_max = self
            .config
            .writeback_run_bytes_max
            .max(unit)
            .min(self.remote_capabilities.request_bytes_max.max(block));
        let mut runs: Vec<Run> = Vec::new();
        let mut previous: Option<(u64, Source)> = None;
        for (number, source) in newest {
            let offset = number * block;
            let adjacent = previous.is_some_and(|(last, kind)| {
                last + 1 == number
                    && std::mem::discriminant(&kind) == std::mem::discriminant(&source)
            }) && (unit == 1 || !offset.is_multiple_of(unit));
            let extended = adjacent
                && match (runs.last_mut(), source) {
                    (Some(Run::Data { segments, .. }), Source::Data(position)) => {
                        let length: u64 = segments.iter().map(|&(_, bytes)| bytes).sum();
                        if length + block > run_bytes_max {
                            false
                        } else {
                            match segments.last_mut() {
                                Some((start, bytes)) if *start + *bytes == position => {
                                    *bytes += block
                                }
                                _ => segments.push((position, block)),
                            }
                            true
                        }
                    }
                    (
                        Some(Run::Zero { length, .. } | Run::Discard { length, .. }),
                        Source::Zero | Source::Discard,
                    ) if *length + block <= self.config.zero_record_bytes_max => {
                        *length += block;
                        true
                    }
                    _ => false,
                };
            if !extended {
                runs.push(match source {
                    Source::Data(position) => Run::Data {
                        offset,
                        segments: vec![(position, block)],
                    },
                    Source::Zero => Run::Zero {
                        offset,
                        length: block,
                    },
                    Source::Discard => Run::Discard {
                        offset,
                        length: block,
                    },
                });
            }
            previous = Some((number, source));
        }
        runs
    }

    /// Puts `runs` on the remote (data runs up to `writeback_requests_in_flight_max` at once)
    /// and flushes it. The records they read from cannot be reused meanwhile (Dirty).
    fn write_epoch(&self, runs: &[Run]) -> io::Result<()> {
        let mut data_runs = Vec::new();
        for run in runs {
            match run {
                Run::Data { offset, segments } => data_runs.push((*offset, segments)),
                Run::Zero { offset, length } => self.remote.write_zeroes(*offset, *length)?,
                Run::Discard { offset, length } => self.remote.discard(*offset, *length)?,
            }
        }
        for batch in data_runs.chunks(self.config.writeback_requests_in_flight_max) {
            let mut buffers = Vec::with_capacity(batch.len());
            for (_, segments) in batch {
                let length: u64 = segments.iter().map(|&(_, bytes)| bytes).sum();
                let mut buffer = vec![0u8; length as usize];
                let mut at = 0usize;
                for &(position, bytes) in segments.iter() {
                    self.local
                        .read_vectored_at(
                            &mut [IoSliceMut::new(&mut buffer[at..at + bytes as usize])],
                            position,
                        )
                        .map_err(|error| {
                            self.local_error("reading the log for write-back", error)
                        })?;
                    at += bytes as usize;
                }
                buffers.push(buffer);
            }
            let writes: Vec<(u64, Vec<u8>)> = batch
                .iter()
                .zip(buffers)
                .map(|((offset, _), buffer)| (*offset, buffer))
                .collect();
            for (_, outcome) in write_and_wait(&self.remote, writes) {
                outcome?;
            }
            self.counters
                .remote_progress
                .fetch_add(1, Ordering::Release);
        }
        self.remote.flush()?;
        self.counters
            .remote_progress
            .fetch_add(1, Ordering::Release);
        Ok(())
    }

    /// The error of a write that waited `stall_max` for a remote that made no progress.
    fn stalled_error(&self, state: &State, target: u64, stall_max: Duration) -> io::Error {
        io::Error::other(format!(
            "local cache {} is full of data not yet on the remote {}, and write-back made no \
             progress for {stall_max:?} (epochs up to {target} wait; last write-back error: {}); \
             this write is refused, nothing written before it is lost",
            self.local_name,
            self.remote.describe(),
            state
                .writeback_error
                .as_deref()
                .unwrap_or("none yet, a request is still running")
        ))
    }
}

impl<R: Device + 'static, L: Device + 'static> Device for LocalTier<R, L> {
    fn read_vectored_at(&self, buffers: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<()> {
        if let [single] = buffers {
            return self.shared.read_at(offset, single);
        }
        let length: usize = buffers.iter().map(|buffer| buffer.len()).sum();
        let mut data = vec![0u8; length];
        self.shared.read_at(offset, &mut data)?;
        let mut at = 0;
        for buffer in buffers.iter_mut() {
            let length = buffer.len();
            buffer.copy_from_slice(&data[at..at + length]);
            at += length;
        }
        Ok(())
    }

    fn write_vectored_at(&self, buffers: &[IoSlice<'_>], offset: u64) -> io::Result<()> {
        let parts: Vec<&[u8]> = buffers.iter().map(|buffer| &**buffer).collect();
        self.shared.write_parts(offset, &parts)
    }

    fn submit_reads(&self, reads: Vec<ReadRequest>) {
        read_each_now(self, reads)
    }

    fn submit_writes(&self, writes: Vec<WriteRequest>) {
        write_each_now(self, writes)
    }

    fn flush(&self) -> io::Result<()> {
        let shared = &self.shared;
        shared.check_local(&shared.state.lock())?;
        let target = shared.close_epoch();
        let covered = shared.written_sequence()?;
        if let Err(error) = shared.local.flush() {
            shared.state.lock().local_failure = Some(format!("flushing the log: {error}"));
            return Err(shared.local_error("flushing the log", error));
        }
        {
            let mut state = shared.state.lock();
            state.durable_epoch = state.durable_epoch.max(target);
            state.durable_sequence = state.durable_sequence.max(covered);
        }
        if shared.config.flush_to == FlushTo::Remote {
            shared.wait_for_remote(target)?;
        }
        Ok(())
    }

    fn discard(&self, offset: u64, length: u64) -> io::Result<()> {
        if !self.shared.remote_capabilities.discard_zeroes {
            // Advisory where discarded data is unspecified: keeping the old data is stable.
            return check_range(self.shared.backend_bytes, offset, length);
        }
        self.shared.zero_at(offset, length, RecordKind::Discard)
    }

    fn write_zeroes(&self, offset: u64, length: u64) -> io::Result<()> {
        self.shared.zero_at(offset, length, RecordKind::Zero)
    }

    fn extents(&self, offset: u64, length: u64) -> io::Result<Vec<Extent>> {
        all_data(self.shared.backend_bytes, offset, length)
    }

    fn capabilities(&self) -> Capabilities {
        let remote = self.shared.remote_capabilities;
        Capabilities {
            length_bytes: self.shared.backend_bytes,
            alignment_bytes: 1,
            discard_zeroes: remote.discard_zeroes,
            // Short zeroings are records, but long ones go to the remote: only as fast as it.
            write_zeroes_fast: remote.write_zeroes_fast,
            extents: false,
            write_unit_bytes: 1,
            completes_later: false,
            inflight_requests_max: 1,
            request_bytes_max: remote.request_bytes_max,
            read_only: remote.read_only,
        }
    }

    fn describe(&self) -> String {
        format!(
            "{} (local cache {})",
            self.shared.remote.describe(),
            self.shared.local_name
        )
    }
}
