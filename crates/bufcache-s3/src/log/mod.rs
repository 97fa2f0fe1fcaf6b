//! The log layout (`layout=log`): every write-back costs its own bytes once.
//!
//! Writes are appended to an in-memory open segment; a segment is sealed when the next
//! extent would not fit in `segment_bytes_max` or when a FLUSH needs it, and then PUT as one
//! immutable object `PREFIX/log/segments/<sequence>`. An in-memory [`Index`] maps disk byte
//! ranges to (segment, offset in the object); it is written whole as a checkpoint object
//! `PREFIX/log/checkpoints/<sequence>-<epoch>` every `checkpoint_interval_segments` segments
//! (at a FLUSH) and at a clean close, with the epochs an open needs (modules `checkpoint`,
//! `epoch`: segment names carry the epoch of the open that wrote them). TRIM and WRITE_ZEROES only change the index (and append a
//! table entry, no data, so replay sees them).
//!
//! Crash consistency by construction:
//! - segments are numbered in append order and nothing references a segment before it is
//!   durable: a checkpoint `C` is written only once every segment up to `C` is durable, and
//!   segments carry their own extent tables;
//! - opening a disk reads the newest checkpoint and replays the segments after it in sequence
//!   order, stopping at the first missing one; the segments after that gap were never covered
//!   by an acknowledged FLUSH (a FLUSH returns only when every segment up to its own is
//!   durable) and are deleted before anything new is written, so the disk reopens as a prefix
//!   of the appended writes that includes every FLUSH-acknowledged one; a checkpoint covering
//!   them is stored first, so their numbers are never used again (a saved copy put back
//!   later is never read);
//! - what no crash leaves is a loss, refused ([`OpenError::LostObjects`], nothing deleted)
//!   unless the URL says `recover-prefix=on`: each segment header records how far the log
//!   and its checkpoints were durable when it was sealed (module `segment`, `Marks`), so a
//!   segment after a gap sealed once the missing one was stored, or one sealed after a
//!   checkpoint newer than the newest found whose `through` the replay does not reach,
//!   proves objects missing ([`check_nothing_lost`]);
//! - two checkpoints: the writer keeps the newest checkpoint's predecessor and everything an
//!   open from it reads (the segments it names, every segment after its `through`, the
//!   epoch objects newer than its writer; module `checkpoint`, `Kept`), and retires the one
//!   before it, object first, once a newer checkpoint is durable. So a lost or damaged
//!   newest checkpoint costs nothing: the open reads the one left and replays past the lost
//!   one's `through`, logging that it fell back;
//! - a segment or checkpoint that exists but fails its checksums or names another disk is
//!   damage, not a crash (an object PUT is atomic): opening stops with an error naming it,
//!   serving and changing nothing;
//! - a segment whose upload fails stays in memory (reads are served from it) and is uploaded
//!   again by the next FLUSH or the next seal that needs room; its data is never dropped.
//!
//! Sealing (module `seal`, URL parameters `compress=` and `key-file=`, recorded in the
//! metadata object): each extent is compressed and/or encrypted on its own, in pieces of at
//! most `SEALED_EXTENT_BYTES_MAX`; reads fetch such an extent's whole frame, and the
//! collector unseals what it copies and seals it anew for the segment it lands in.
//!
//! Memory: the open segment plus at most `segments_in_flight_max` sealed segments, each at
//! most `segment_bytes_max`; a write that needs room waits for an upload to finish. The
//! garbage collector holds at most `gc_bytes_max` bytes it read besides.
//!
//! Snapshots (module `snapshot`): `log/snapshots/NAME`, the index at a flush point in the
//! checkpoint format; the segments it names are pinned (never rewritten or deleted while it
//! exists). Clones (module `clone`): a disk whose metadata names another disk's snapshot,
//! whose segments it reads for the sequences at or below the snapshot's, its own log after.
//!
//! Garbage collection (module `gc`): the index keeps the live bytes of every segment; a
//! background thread rewrites durable segments whose live fraction is below `gc_threshold`
//! (their live extents are read with ranged GETs and appended as copies, which apply only
//! where the index still maps the range to the source) and deletes a segment only once it has
//! no live bytes and a durable checkpoint taken after that covers it, so no replay ever
//! needs it. Segments no checkpoint names and that it covers are deleted at open (a crash
//! during deletes leaves them).

mod checkpoint;
mod clone;
mod epoch;
mod gc;
mod index;
mod inspect;
mod resize;
mod segment;
mod snapshot;

use bufcache_device::strict_assert;
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

use bytes::Bytes;
use futures::stream::{self, StreamExt};
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, PutMode, PutOptions, PutPayload};

use crate::error::{chain, request_failed, DecodeError, OpenError, StoreError};
use crate::lock::{check_not_held, Acquired, DiskLock, Takeover};
use crate::store::{
    connect, connect_with, get_range_in, Buckets, Connection, Create, DiskMetadata, ReadOnly,
    REQUESTS_IN_FLIGHT_MAX_DEFAULT,
};
use crate::url::{LayoutKind, S3Url};

use crate::seal::Sealer;
pub use crate::seal::{SealParameters, SEALED_EXTENT_BYTES_MAX};
pub(crate) use clone::{
    base_url as clone_base_url, new_metadata as new_clone_metadata,
    read_record as read_clone_record, record_key as clone_record_key,
    recorded_clone as clone_recorded, BASE_NAME as CLONE_BASE_NAME,
};
pub use gc::GcReport;
pub use index::{Index, Mapping};
pub(crate) use inspect::describe_snapshots;
pub use inspect::SnapshotSummary;
pub(crate) use inspect::{summarize, verify};
pub use inspect::{Damage, LogSummary, VerifyProgress};
use segment::{OpenSegment, HEADER_BYTES, TABLE_ENTRY_BYTES};
pub(crate) use snapshot::read as read_snapshot;
pub use snapshot::{check_name as check_snapshot_name, SnapshotError, Taken as SnapshotTaken};
pub(crate) use snapshot::{list as list_snapshots, snapshot_name as snapshot_object_name};

/// Default `segment_bytes_max`: 8 MiB keeps a sequential write-back at one PUT per 8 MiB
/// (WA ≈ 1.00002 from headers and tables) while bounding memory at (1 + in flight) × 8 MiB.
pub const SEGMENT_BYTES_MAX_DEFAULT: u64 = 8 << 20;
/// Default `segments_in_flight_max`: uploads of sealed segments at once (and segments held in
/// memory besides the open one).
pub const SEGMENTS_IN_FLIGHT_MAX_DEFAULT: usize = 4;
/// Default `checkpoint_interval_segments`: at most this many segments are replayed at open.
pub const CHECKPOINT_INTERVAL_SEGMENTS_DEFAULT: u64 = 16;

/// Default `gc_threshold`: a durable segment less than half live is rewritten, so stored
/// bytes stay under about twice the live data and each rewrite moves at most half a segment
/// per segment freed.
pub const GC_THRESHOLD_DEFAULT: f64 = 0.5;
/// Default `gc_stored_ratio_max`: the collector keeps the stored segment bytes within 1.5 ×
/// the live bytes (plus a segment) by rewriting the least live segments, whatever their
/// fraction. Under uniform random overwrites, `gc_threshold` alone leaves segments just above
/// it (stored ≈ 2 × live at 0.5).
pub const GC_STORED_RATIO_MAX_DEFAULT: f64 = 1.5;
/// Default `gc_requests_in_flight_max`: ranged GETs and DELETEs the collector has in flight
/// at once (its share of the store beside the client's requests).
pub const GC_REQUESTS_IN_FLIGHT_MAX_DEFAULT: usize = 2;
/// Default `gc_bytes_max`: the most bytes one collection round reads into memory.
pub const GC_BYTES_MAX_DEFAULT: u64 = SEGMENT_BYTES_MAX_DEFAULT;
/// Default `get_bytes_max`: the most object bytes one ranged GET of a read spans when it
/// joins pieces adjacent in one segment (the runs of a read-ahead window included), so a
/// sequential read of data written sequentially costs about one GET per this many bytes
/// (and one more where a run crosses into the next segment). The stored form of 2 MiB of
/// data (4 KiB blocks with their checksums), a quarter of a default segment: a window of
/// several MiB is still several GETs in flight at once.
pub const GET_BYTES_MAX_DEFAULT: u64 = (2 << 20) / crate::blocks::BLOCK_BYTES
    * (crate::blocks::BLOCK_BYTES + crate::blocks::CHECKSUM_BYTES);
/// Default `gc_interval_ms`: the collector's pause between rounds (its pacing).
pub const GC_INTERVAL_MS_DEFAULT: u64 = 100;

/// The unit a write is split at to fill the end of a segment: pieces are whole multiples of
/// it from the write's start, so no 4 KiB block of a write is ever in two segments (after a
/// crash that keeps the first and loses the second, such a block would read back torn), and
/// smaller remnants of room are left empty (a piece costs a table entry and, when read, a GET
/// of its own).
const SPLIT_BYTES_MIN: u64 = 4096;

/// Tuning of the log layout.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LogConfig {
    /// Most bytes of one segment object (header, data and extent table). Default
    /// [`SEGMENT_BYTES_MAX_DEFAULT`]; URL parameter `segment-size=`.
    pub segment_bytes_max: u64,
    /// Sealed segments uploading (and held in memory) at once. Default
    /// [`SEGMENTS_IN_FLIGHT_MAX_DEFAULT`].
    pub segments_in_flight_max: usize,
    /// A FLUSH writes a checkpoint once this many segments were sealed since the last one.
    /// Default [`CHECKPOINT_INTERVAL_SEGMENTS_DEFAULT`].
    pub checkpoint_interval_segments: u64,
    /// Concurrent ranged GETs of one read. Default [`REQUESTS_IN_FLIGHT_MAX_DEFAULT`].
    pub requests_in_flight_max: usize,
    /// Most object bytes one ranged GET spans when it joins the pieces of a read (or of a
    /// batch of reads) that lie back to back in one segment; a single piece larger than
    /// this is still one GET. Default [`GET_BYTES_MAX_DEFAULT`].
    pub get_bytes_max: u64,
    /// Durable segments whose live fraction (live bytes ÷ object bytes) is below this are
    /// rewritten by the background collector; None: no background collection. Default
    /// [`GC_THRESHOLD_DEFAULT`]; URL parameters `gc-threshold=` and `gc=off`.
    pub gc_threshold: Option<f64>,
    /// The collector also rewrites the least live segments while the stored segment bytes
    /// exceed this many times the live bytes (by more than a segment); at least 1. Default
    /// [`GC_STORED_RATIO_MAX_DEFAULT`].
    pub gc_stored_ratio_max: f64,
    /// Requests the collector has in flight at once. Default
    /// [`GC_REQUESTS_IN_FLIGHT_MAX_DEFAULT`].
    pub gc_requests_in_flight_max: usize,
    /// Most bytes one collection round reads into memory (it picks segments whose object bytes
    /// fit, since it reads through small gaps between live extents); at least `segment_bytes_max`,
    /// so any segment this configuration writes fits in one round. Default
    /// [`GC_BYTES_MAX_DEFAULT`] (raised to `segment_bytes_max` by [`LogConfig::from_url`]).
    pub gc_bytes_max: u64,
    /// Pause of the background collector between rounds. Default [`GC_INTERVAL_MS_DEFAULT`].
    pub gc_interval_ms: u64,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            segment_bytes_max: SEGMENT_BYTES_MAX_DEFAULT,
            segments_in_flight_max: SEGMENTS_IN_FLIGHT_MAX_DEFAULT,
            checkpoint_interval_segments: CHECKPOINT_INTERVAL_SEGMENTS_DEFAULT,
            requests_in_flight_max: REQUESTS_IN_FLIGHT_MAX_DEFAULT,
            get_bytes_max: GET_BYTES_MAX_DEFAULT,
            gc_threshold: Some(GC_THRESHOLD_DEFAULT),
            gc_stored_ratio_max: GC_STORED_RATIO_MAX_DEFAULT,
            gc_requests_in_flight_max: GC_REQUESTS_IN_FLIGHT_MAX_DEFAULT,
            gc_bytes_max: GC_BYTES_MAX_DEFAULT,
            gc_interval_ms: GC_INTERVAL_MS_DEFAULT,
        }
    }
}

impl LogConfig {
    /// The configuration a URL asks for (`segment-size=`, `gc=`, `gc-threshold=`), defaults
    /// elsewhere.
    pub fn from_url(url: &S3Url) -> LogConfig {
        let segment_bytes_max = url.segment_bytes_max.unwrap_or(SEGMENT_BYTES_MAX_DEFAULT);
        let threshold = url
            .gc_threshold_ppm
            .map_or(GC_THRESHOLD_DEFAULT, |ppm| f64::from(ppm) / 1e6);
        LogConfig {
            segment_bytes_max,
            gc_threshold: (url.gc != Some(false)).then_some(threshold),
            gc_bytes_max: GC_BYTES_MAX_DEFAULT.max(segment_bytes_max),
            ..LogConfig::default()
        }
    }

    /// Refuses a configuration the store cannot work with, naming the field.
    pub fn validate(&self) -> Result<(), LogConfigError> {
        let smallest = HEADER_BYTES + 4 * TABLE_ENTRY_BYTES + 4096;
        if self.segment_bytes_max < smallest {
            return Err(LogConfigError::Invalid {
                field: "segment_bytes_max",
                problem: format!(
                    "{} is below {smallest} (a header, a 4 KiB extent and its table entries)",
                    self.segment_bytes_max
                ),
            });
        }
        if self.segments_in_flight_max == 0 {
            return Err(LogConfigError::Invalid {
                field: "segments_in_flight_max",
                problem: "is 0: no segment could ever be uploaded".to_string(),
            });
        }
        if self.checkpoint_interval_segments == 0 {
            return Err(LogConfigError::Invalid {
                field: "checkpoint_interval_segments",
                problem: "is 0".to_string(),
            });
        }
        if self.requests_in_flight_max == 0 {
            return Err(LogConfigError::Invalid {
                field: "requests_in_flight_max",
                problem: "is 0".to_string(),
            });
        }
        if self.get_bytes_max == 0 {
            return Err(LogConfigError::Invalid {
                field: "get_bytes_max",
                problem: "is 0: no GET could join two pieces".to_string(),
            });
        }
        if let Some(threshold) = self.gc_threshold {
            if !(threshold > 0.0 && threshold < 1.0) {
                return Err(LogConfigError::Invalid {
                    field: "gc_threshold",
                    problem: format!("{threshold} is not a fraction above 0 and below 1"),
                });
            }
        }
        if self.gc_stored_ratio_max.is_nan() || self.gc_stored_ratio_max < 1.0 {
            return Err(LogConfigError::Invalid {
                field: "gc_stored_ratio_max",
                problem: format!(
                    "{} is below 1: the live bytes alone would exceed it",
                    self.gc_stored_ratio_max
                ),
            });
        }
        if self.gc_requests_in_flight_max == 0 {
            return Err(LogConfigError::Invalid {
                field: "gc_requests_in_flight_max",
                problem: "is 0: the collector could read nothing".to_string(),
            });
        }
        if self.gc_bytes_max < self.segment_bytes_max {
            return Err(LogConfigError::Invalid {
                field: "gc_bytes_max",
                problem: format!(
                    "{} is below segment_bytes_max {}: a segment could not be collected",
                    self.gc_bytes_max, self.segment_bytes_max
                ),
            });
        }
        Ok(())
    }
}

/// A [`LogConfig`] the store cannot work with: the field and what is wrong with it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LogConfigError {
    #[error("{field} {problem}")]
    Invalid {
        field: &'static str,
        problem: String,
    },
}

/// A segment whose live-byte count, as the index keeps it, differs from a recount of the
/// mappings ([`LogStore::check_live_bytes`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("segment {segment}: {kept:?} live bytes kept, {counted:?} counted")]
pub struct LiveBytesMismatch {
    pub segment: u64,
    pub kept: Option<u64>,
    pub counted: Option<u64>,
}

/// Where a sealed segment's upload stands.
enum Upload {
    Running,
    /// The PUT failed after the client's retries; the segment waits for the next FLUSH (or a
    /// seal that needs room) to try again.
    Failed(String),
}

struct Sealed {
    body: Bytes,
    upload: Upload,
}

struct State {
    index: Index,
    open: OpenSegment,
    /// Sealed segments not yet durable, by sequence; their bodies serve reads meanwhile.
    sealed: BTreeMap<u64, Sealed>,
    /// Segments above `durable_through` whose uploads finished (out of order).
    durable_ahead: BTreeSet<u64>,
    /// Every segment up to this sequence is durable.
    durable_through: u64,
    /// The newest checkpoint covers the segments up to this sequence.
    checkpoint_through: u64,
    /// Object bytes of every durable segment in the store (not deleted yet), by sequence.
    stored: BTreeMap<u64, u64>,
    /// Segments without live bytes awaiting deletion, with the log position (a segment
    /// sequence) a durable checkpoint must cover before they go: one taken after their last
    /// live byte went.
    doomed: BTreeMap<u64, u64>,
    /// Segment DELETEs sent so far, counted before each is sent: a read whose GET found its
    /// segment gone looks the index up again when this moved (the collector deleted it
    /// after the read looked the index up). Counted before, not after: a DELETE takes
    /// effect before its answer arrives (or without one, when it is answered with an error
    /// or reset), and a read's 404 in between is no missing data.
    segment_deletes_sent: u64,
    /// The newest durable checkpoint, with what it keeps once a newer one is durable (None
    /// when the disk has none).
    checkpoint_newest: Option<checkpoint::Kept>,
    /// The checkpoints kept besides the newest, oldest first (module docs, "Two
    /// checkpoints"): no segment one of them needs is deleted, and once a checkpoint newer
    /// than the newest is durable every kept one but the newest's predecessor goes, its
    /// object deleted before what it alone needs.
    checkpoints_kept: Vec<checkpoint::Kept>,
    /// Epoch objects older than this open's that were in the store at open and are not
    /// deleted yet: this open's first durable checkpoint records what an open needs of
    /// them, and they go after it (module `checkpoint`).
    epoch_objects: BTreeSet<u64>,
    /// Epoch objects deleted so far (at open and after checkpoints).
    epochs_pruned: u64,
    /// What the collector did so far.
    gc_totals: GcReport,
    /// Segments a snapshot names (module `snapshot`): never deleted or rewritten by this
    /// open, whether or not the index still names them. A pinned segment without live bytes
    /// leaves `stored` (it is the snapshots' data, not the disk's).
    pinned: BTreeSet<u64>,
    /// Object bytes of the pinned segments without live bytes (held by snapshots alone).
    pinned_only: BTreeMap<u64, u64>,
}

struct Shared {
    store: Arc<dyn ObjectStore>,
    url: S3Url,
    metadata: DiskMetadata,
    /// The disk's size now: `metadata.size_bytes` at open, raised by a grow while served
    /// (module `resize`) once the metadata object records the new one.
    size_bytes: std::sync::atomic::AtomicU64,
    /// Seals and unseals extents (compression, encryption) as the disk's metadata says.
    sealer: Arc<Sealer>,
    /// Which epoch owns each segment sequence (module `epoch`), this open's included.
    epochs: epoch::Epochs,
    /// This open's epoch (0 for a read-only open, which writes nothing).
    epoch: u64,
    /// A clone's base (module `clone`): the segments at or below its `through` are the
    /// base disk's, read with its key under its prefix, never deleted or rewritten here.
    base: Option<clone::Base>,
    state: Mutex<State>,
    /// Signalled whenever an upload ends.
    uploaded: Condvar,
    /// The lease of the disk lock this open holds (None without the lock): no segment or
    /// checkpoint is PUT, and nothing acknowledged, once it lapsed (module `lease`).
    lease: Option<Arc<crate::lease::Lease>>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn segment_key(&self, sequence: u64) -> String {
        match self.base_of(sequence) {
            Some(base) => segment_key(&base.url, sequence, base.epochs.owner(sequence)),
            None => segment_key(&self.url, sequence, self.epochs.owner(sequence)),
        }
    }

    /// The clone's base when segment `sequence` is the base's.
    fn base_of(&self, sequence: u64) -> Option<&clone::Base> {
        self.base.as_ref().filter(|base| sequence <= base.through)
    }

    /// The client that reads segment `sequence` (the base bucket's for a base segment in
    /// another bucket).
    fn store_of(&self, sequence: u64) -> &Arc<dyn ObjectStore> {
        self.base_of(sequence)
            .and_then(|base| base.store.as_ref())
            .unwrap_or(&self.store)
    }

    /// The sealer that unseals segment `sequence`'s extents (the base's for a base segment).
    fn sealer_of(&self, sequence: u64) -> &Sealer {
        self.base_of(sequence)
            .map_or(&self.sealer, |base| &base.sealer)
    }

    fn check_lease(&self) -> Result<(), StoreError> {
        match &self.lease {
            Some(lease) => match lease.check() {
                // The planted defect (tests/log_sim_servers.rs): a lapsed lease is ignored, so
                // a writer cut off or frozen past its lease goes on acknowledging.
                #[cfg(feature = "planted-lease-defect")]
                Err(crate::lease::LeaseError::Lapsed { .. }) => Ok(()),
                result => result.map_err(|error| StoreError::Lease {
                    url: self.url.to_string(),
                    error,
                }),
            },
            None => Ok(()),
        }
    }
}

/// The state and calls the client's threads and the collector's thread share.
struct Core {
    shared: Arc<Shared>,
    config: LogConfig,
    runtime: tokio::runtime::Handle,
    /// Held while a checkpoint is written, so checkpoints are written (and the older ones
    /// deleted) one at a time, in order.
    checkpoint_writer: Mutex<()>,
    /// Held during a collection round, so rounds never overlap.
    collector: Mutex<()>,
    /// Why writes are refused (and nothing is ever written); None when they are taken.
    read_only: Option<ReadOnly>,
}

/// True when a sealed segment up to `through` has a failed upload (which the caller's retry
/// loop handles without waiting for a signal).
fn has_failed(state: &State, through: u64) -> bool {
    state
        .sealed
        .range(..=through)
        .any(|(_, sealed)| matches!(sealed.upload, Upload::Failed(_)))
}

/// A segment's key under the disk's prefix (what its tag names, module `seal`).
fn segment_name(sequence: u64, epoch: u64) -> String {
    format!("log/segments/{}", epoch::object_name(sequence, epoch))
}

fn segment_key(url: &S3Url, sequence: u64, epoch: u64) -> String {
    url.key(&segment_name(sequence, epoch))
}

/// An epoch object's key under the disk's prefix.
fn epoch_name(epoch: u64) -> String {
    format!("log/epochs/{epoch:016x}")
}

fn epoch_key(url: &S3Url, epoch: u64) -> String {
    url.key(&epoch_name(epoch))
}

/// Epoch numbers a writable open tries to claim before it gives up (each failed claim means
/// another claim landed meanwhile: a crashed server's late one).
const EPOCH_CLAIMS_MAX: u32 = 8;

/// A checkpoint's key under the disk's prefix.
fn checkpoint_name((through, epoch): (u64, u64)) -> String {
    format!("log/checkpoints/{}", epoch::object_name(through, epoch))
}

fn checkpoint_key(url: &S3Url, name: (u64, u64)) -> String {
    url.key(&checkpoint_name(name))
}

/// A log-layout disk. All methods block the calling thread on the store's own runtime; do not
/// call them from inside another tokio runtime.
pub struct LogStore {
    /// Declared before `_runtime` so that it is released while the runtime runs.
    lock: Option<Arc<DiskLock>>,
    /// The background collector (None with `gc=off`); stopped before the final checkpoint.
    collector: Option<gc::Collector>,
    core: Arc<Core>,
    /// Owns the runtime the core's handle and the uploads run on; dropped last.
    _runtime: tokio::runtime::Runtime,
}

/// A piece of a read that must be fetched from a durable segment.
struct Fetch {
    segment: u64,
    /// The object bytes to fetch ([`segment::fetch_range`]).
    range: Range<u64>,
    /// The piece's index address and disk offset.
    address: u64,
    disk_offset: u64,
    /// Which read of the batch it belongs to, and where it goes in that read's buffer.
    read: usize,
    target: Range<usize>,
}

/// One ranged GET: an object range of one segment covering every fetch range of its pieces,
/// at most `get_bytes_max` long unless it holds a single piece.
struct Get {
    segment: u64,
    range: Range<u64>,
    pieces: Vec<Fetch>,
}

/// Joins the pieces to fetch into GETs: pieces back to back (or overlapping, as pieces of one
/// sealed frame or checked block do) in one segment share a GET while it stays within
/// `get_bytes_max` bytes.
fn coalesce(mut fetches: Vec<Fetch>, get_bytes_max: u64) -> Vec<Get> {
    fetches.sort_by_key(|fetch| (fetch.segment, fetch.range.start));
    let mut gets: Vec<Get> = Vec::new();
    for fetch in fetches {
        if let Some(get) = gets.last_mut() {
            let end = get.range.end.max(fetch.range.end);
            if get.segment == fetch.segment
                && fetch.range.start <= get.range.end
                && end - get.range.start <= get_bytes_max
            {
                get.range.end = end;
                get.pieces.push(fetch);
                continue;
            }
        }
        gets.push(Get {
            segment: fetch.segment,
            range: fetch.range.clone(),
            pieces: vec![fetch],
        });
    }
    for get in &gets {
        debug_assert!(get.pieces.len() == 1 || get.range.end - get.range.start <= get_bytes_max);
        debug_assert!(get.pieces.iter().all(|piece| piece.segment == get.segment
            && get.range.start <= piece.range.start
            && piece.range.end <= get.range.end));
    }
    gets
}

/// Points every mapping into segment `sequence` whose extent `moves` moved at the extent's
/// new place. Every new address is worked out from the index as it was before the first
/// change (an extent's new place may be another's old one).
fn move_addresses(index: &mut Index, sequence: u64, moves: &[segment::Move]) {
    let mut moved = Vec::new();
    for extent in moves {
        for piece in index.lookup(extent.disk_offset, extent.length) {
            let Some((segment, address)) = piece.stored else {
                continue;
            };
            if segment == sequence && segment::extent_object_offset(address) == extent.from {
                moved.push((
                    piece.disk_offset,
                    Mapping {
                        length: piece.length,
                        segment,
                        object_offset: segment::moved_address(address, extent.to),
                    },
                ));
            }
        }
    }
    let live_before = index.live_bytes(sequence);
    for (offset, mapping) in moved {
        index.insert(offset, mapping);
    }
    assert_eq!(
        index.live_bytes(sequence),
        live_before,
        "moving segment {sequence}'s extents changed its live bytes"
    );
}

/// What recovery found: the index and where the sequence numbers stand.
struct Recovered {
    index: Index,
    last_sequence: u64,
    checkpoint_through: u64,
    /// Object bytes of every segment kept, by sequence.
    stored: BTreeMap<u64, u64>,
    /// The disk's epochs as recovery found them (the claimed one included).
    epochs: epoch::Epochs,
    /// The epoch this open claimed (0 for a read-only open).
    epoch: u64,
    /// The checkpoint the log was recovered from; None when there is none.
    checkpoint_newest: Option<checkpoint::Kept>,
    /// The checkpoints kept besides it, oldest first (`State::checkpoints_kept`).
    checkpoints_kept: Vec<checkpoint::Kept>,
    /// Epoch objects listed at open.
    epoch_objects: BTreeSet<u64>,
    /// Epoch objects deleted at open.
    epochs_pruned: u64,
    /// What a writable open deletes (and, after a gap, the checkpoint it stores) once it
    /// claimed its epoch.
    cleanup: Cleanup,
    /// Sequences of the segments some snapshot names (module `snapshot`).
    pinned: BTreeSet<u64>,
    /// Object bytes of the pinned segments the log holds no live byte of, by sequence.
    pinned_only: BTreeMap<u64, u64>,
    /// Snapshot objects read at open.
    snapshots: u64,
    /// A clone's base (module `clone`).
    base: Option<clone::Base>,
}

/// What recovery found to delete: every object but the log itself.
#[derive(Default)]
struct Cleanup {
    /// (sequence, epoch) of segments of an epoch that does not own their sequence.
    void: Vec<(u64, u64)>,
    /// (sequence, object bytes) of the segments the checkpoint covers and does not name
    /// (deleted unless a kept checkpoint needs them).
    dead: Vec<(u64, u64)>,
    /// Segments after a gap in the log.
    orphans: Vec<u64>,
    /// (through, epoch) of the checkpoints other than the one recovered from and its
    /// predecessor (the kept one), deleted before any segment.
    stale_checkpoints: Vec<(u64, u64)>,
}

impl LogStore {
    /// Opens (or creates, with `create-size=` and `layout=log`) the log-layout disk `url`
    /// names, takes its lock and recovers its index.
    pub fn open_locked(url: &S3Url) -> Result<LogStore, OpenError> {
        Self::from_connection(url, connect(url)?, LogConfig::from_url(url), None)
    }

    /// Opens an existing log-layout disk read-only, writing nothing at all: no lock (a disk
    /// whose lock another server holds is refused, [`OpenError::LockedReadOnly`], unless the
    /// URL's `break-lock=` names it), no deletes at recovery (segments after a gap are just
    /// not replayed), no collector, no checkpoint; writes are refused
    /// ([`StoreError::ReadOnly`]) and a flush has nothing to do.
    pub fn open_read_only(url: &S3Url) -> Result<LogStore, OpenError> {
        Self::read_only_from_connection(
            url,
            connect_with(url, Create::Never)?,
            LogConfig::from_url(url),
            ReadOnly::Requested,
        )
    }

    pub(crate) fn read_only_from_connection(
        url: &S3Url,
        connection: Connection,
        config: LogConfig,
        why: ReadOnly,
    ) -> Result<LogStore, OpenError> {
        let sealer = check_layout(url, &connection.metadata, &config)?;
        // A snapshot never changes, so it is served while a server holds the disk (whose
        // collector keeps every segment the snapshot names); a replica follows the server
        // holding the lock; any other read-only open refuses it.
        if url.snapshot.is_none() && !matches!(why, ReadOnly::Replica) {
            connection
                .runtime
                .block_on(check_not_held(&connection.store, url))?;
        }
        let Connection {
            runtime,
            store,
            metadata,
            buckets,
        } = connection;
        Self::build(
            url,
            runtime,
            store,
            buckets,
            metadata,
            config,
            sealer,
            None,
            Some(why),
            None,
        )
    }

    /// A standby's open tells `watching` of each renewal of the writer's lease it sees.
    pub(crate) fn from_connection(
        url: &S3Url,
        connection: Connection,
        config: LogConfig,
        watching: Option<Arc<crate::lease::LeaseSeen>>,
    ) -> Result<LogStore, OpenError> {
        let sealer = check_layout(url, &connection.metadata, &config)?;
        if url.snapshot.is_some() {
            return Err(snapshot_writable(url));
        }
        // A standby first registers as the disk's one standby, then waits for the lock.
        let standby = if url.standby {
            Some(connection.runtime.block_on(crate::lock::register_standby(
                connection.runtime.handle().clone(),
                connection.store.clone(),
                url,
            ))?)
        } else {
            None
        };
        let takeover = if url.standby {
            Takeover::WaitForLapse
        } else {
            Takeover::AfterLapse
        };
        let acquired = connection.runtime.block_on(DiskLock::acquire_with(
            connection.runtime.handle().clone(),
            connection.store.clone(),
            url,
            takeover,
            watching,
        ));
        if let Some(standby) = standby {
            if let Err(error) = connection.runtime.block_on(standby.release_async()) {
                tracing::warn!(disk = %url, "{error}; the next standby waits for its lease to lapse");
            }
        }
        let lock = match acquired? {
            Acquired::Held(lock) => lock,
            // Credentials that may read but not write: served read-only, as a chunk disk.
            Acquired::WritesRefused(answer) => {
                return Self::read_only_from_connection(
                    url,
                    connection,
                    config,
                    ReadOnly::WritesRefused(answer),
                )
            }
        };
        let Connection {
            runtime,
            store,
            mut metadata,
            buckets,
        } = connection;
        if metadata.seal.key_check.is_some() && !metadata.seal.metadata_tagged {
            // Encrypted, its metadata written before metadata tags: tagged now, under the
            // lock, as found (the key check proved the key; logged).
            runtime.block_on(crate::store::tag_untagged_metadata(&*store, url))?;
            metadata.seal.metadata_tagged = true;
        }
        Self::build(
            url,
            runtime,
            store,
            buckets,
            metadata,
            config,
            sealer,
            Some(lock),
            None,
            None,
        )
    }

    /// Opens (or creates, with `create-size=` and `layout=log`) the log-layout disk `url`
    /// names in `store`, which may be any object store (the simulator's among them), on a
    /// runtime of its own, WITHOUT the disk lock: the caller keeps every other writer away.
    /// The URL's endpoint and client parameters are not used.
    pub fn open_unlocked_on(
        url: &S3Url,
        store: Arc<dyn ObjectStore>,
        config: LogConfig,
    ) -> Result<LogStore, OpenError> {
        Self::open_on(url, store, config, None, None)
    }

    /// [`LogStore::open_unlocked_on`] for a caller that holds the disk's lock itself under
    /// `lease` (the simulator's servers, module `sim_servers`): nothing is acknowledged and
    /// no segment or checkpoint PUT once the lease lapsed, as with the lock's own lease.
    pub fn open_leased_on(
        url: &S3Url,
        store: Arc<dyn ObjectStore>,
        config: LogConfig,
        lease: Arc<crate::lease::Lease>,
    ) -> Result<LogStore, OpenError> {
        Self::open_on(url, store, config, None, Some(lease))
    }

    /// [`LogStore::open_read_only`] in `store` (any object store, the simulator's among
    /// them), without looking at the disk lock: a snapshot (`snapshot=` in the URL), or a
    /// disk the caller keeps every writer away from.
    pub fn open_read_only_on(
        url: &S3Url,
        store: Arc<dyn ObjectStore>,
        config: LogConfig,
    ) -> Result<LogStore, OpenError> {
        Self::open_on(url, store, config, Some(ReadOnly::Requested), None)
    }

    fn open_on(
        url: &S3Url,
        store: Arc<dyn ObjectStore>,
        config: LogConfig,
        read_only: Option<ReadOnly>,
        lease: Option<Arc<crate::lease::Lease>>,
    ) -> Result<LogStore, OpenError> {
        // The store's threads log where the thread opening it does.
        let dispatch = tracing::dispatcher::get_default(|dispatch| dispatch.clone());
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("bufcache-s3")
            .on_thread_start(move || {
                // Kept for the thread's life (it ends with the runtime).
                std::mem::forget(tracing::dispatcher::set_default(&dispatch));
            })
            .enable_all()
            .build()
            .map_err(|source| OpenError::Runtime {
                url: url.to_string(),
                source,
            })?;
        let create = if read_only.is_some() {
            Create::Never
        } else {
            Create::IfAsked
        };
        let metadata = runtime.block_on(crate::store::ChunkStore::open_metadata(
            &*store, url, create,
        ))?;
        let sealer = check_layout(url, &metadata, &config)?;
        // The caller's store reaches one bucket: a clone whose base is in another is
        // refused naming it (`Buckets::None`).
        Self::build(
            url,
            runtime,
            store,
            Buckets::None,
            metadata,
            config,
            sealer,
            None,
            read_only,
            lease,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        url: &S3Url,
        runtime: tokio::runtime::Runtime,
        store: Arc<dyn ObjectStore>,
        buckets: Buckets,
        metadata: DiskMetadata,
        config: LogConfig,
        sealer: Sealer,
        lock: Option<Arc<DiskLock>>,
        read_only: Option<ReadOnly>,
        lease: Option<Arc<crate::lease::Lease>>,
    ) -> Result<LogStore, OpenError> {
        let sealer = Arc::new(sealer);
        // The lock's own lease, or the one the caller holds the lock under.
        let lease = lease.or_else(|| lock.as_ref().and_then(|lock| lock.lease().cloned()));
        let writable = read_only.is_none();
        let recovered = match runtime.block_on(recover_and_claim(
            &*store, &buckets, url, &metadata, &sealer, writable,
        )) {
            Ok(recovered) => recovered,
            Err(error) => {
                // The lock is released on the runtime, so it goes first.
                drop(lock);
                return Err(error);
            }
        };
        tracing::info!(
            disk = %url,
            segments_through = recovered.last_sequence,
            checkpoint_through = recovered.checkpoint_through,
            mapped_bytes = recovered.index.mapped_bytes(),
            "opened log-layout disk"
        );
        let recovered_epochs = recovered.epochs;
        let state = State {
            index: recovered.index,
            open: OpenSegment::new(recovered.last_sequence + 1, sealer.clone()),
            sealed: BTreeMap::new(),
            durable_ahead: BTreeSet::new(),
            durable_through: recovered.last_sequence,
            checkpoint_through: recovered.checkpoint_through,
            stored: recovered.stored,
            doomed: BTreeMap::new(),
            segment_deletes_sent: 0,
            checkpoint_newest: recovered.checkpoint_newest,
            checkpoints_kept: recovered.checkpoints_kept,
            epoch_objects: recovered
                .epoch_objects
                .range(..recovered.epoch)
                .copied()
                .collect(),
            epochs_pruned: recovered.epochs_pruned,
            gc_totals: GcReport::default(),
            pinned: recovered.pinned,
            pinned_only: recovered.pinned_only,
        };
        let core = Arc::new(Core {
            shared: Arc::new(Shared {
                store,
                url: url.clone(),
                metadata,
                size_bytes: std::sync::atomic::AtomicU64::new(metadata.size_bytes),
                sealer,
                epochs: recovered_epochs,
                epoch: recovered.epoch,
                base: recovered.base,
                state: Mutex::new(state),
                uploaded: Condvar::new(),
                lease,
            }),
            config,
            runtime: runtime.handle().clone(),
            checkpoint_writer: Mutex::new(()),
            collector: Mutex::new(()),
            read_only,
        });
        let collector = match config
            .gc_threshold
            .filter(|_| writable)
            .map(|threshold| gc::Collector::start(core.clone(), threshold))
            .transpose()
        {
            Ok(collector) => collector,
            Err(error) => {
                drop(lock);
                return Err(OpenError::Request {
                    url: url.to_string(),
                    operation: "starting the garbage collector thread".to_string(),
                    message: error.to_string(),
                });
            }
        };
        Ok(LogStore {
            lock,
            collector,
            core,
            _runtime: runtime,
        })
    }

    /// The disk's shape.
    pub fn metadata(&self) -> DiskMetadata {
        DiskMetadata {
            size_bytes: self.core.size_bytes(),
            ..self.core.shared.metadata
        }
    }

    /// The URL the store was opened with.
    pub fn url(&self) -> &S3Url {
        &self.core.shared.url
    }

    /// The layout's tuning.
    pub fn config(&self) -> LogConfig {
        self.core.config
    }

    /// The lock this store holds.
    pub fn lock(&self) -> Option<&DiskLock> {
        self.lock.as_deref()
    }

    /// Why the disk refuses writes; None when it takes them.
    pub fn read_only(&self) -> Option<&ReadOnly> {
        self.core.read_only.as_ref()
    }

    /// Bytes of the disk that the index maps to stored data (the rest reads as zeroes).
    pub fn mapped_bytes(&self) -> u64 {
        self.core.shared.lock().index.mapped_bytes()
    }

    /// The runs of `[offset, offset + length)` in disk order as (length, mapped): a run the
    /// index does not map (never written, trimmed or zeroed) reads as zeroes without a request.
    pub fn mapped_runs(&self, offset: u64, length: u64) -> Vec<(u64, bool)> {
        let pieces = self.core.shared.lock().index.lookup(offset, length);
        let mut runs: Vec<(u64, bool)> = Vec::new();
        for piece in pieces {
            let mapped = piece.stored.is_some();
            match runs.last_mut() {
                Some((run_length, run_mapped)) if *run_mapped == mapped => {
                    *run_length += piece.length
                }
                _ => runs.push((piece.length, mapped)),
            }
        }
        runs
    }

    /// Ranges the index maps now. Each stored as written may cost up to one checked block of
    /// padding beyond its bytes (its last block is stored whole), which matters only for
    /// extents that do not end on a 4 KiB boundary.
    pub fn mapped_extents(&self) -> usize {
        self.core.shared.lock().index.len()
    }

    /// Every segment up to this sequence is durable.
    pub fn durable_through(&self) -> u64 {
        self.core.shared.lock().durable_through
    }

    /// Object bytes of the durable segments in the store (what the disk's data costs to
    /// keep, checkpoints and metadata aside).
    pub fn stored_segment_bytes(&self) -> u64 {
        self.core.shared.lock().stored.values().sum()
    }

    /// Durable segment objects in the store.
    pub fn stored_segments(&self) -> u64 {
        self.core.shared.lock().stored.len() as u64
    }

    /// Epoch objects this store deleted so far (at open and after its checkpoints), since a
    /// durable checkpoint records what an open needs of them.
    pub fn epochs_pruned(&self) -> u64 {
        self.core.shared.lock().epochs_pruned
    }

    /// Takes snapshot `name` at a flush point (module `snapshot`): every write that returned
    /// before this call is in it. Costs a segment PUT when anything was written since the
    /// last flush, and one PUT of the snapshot object; no data is copied.
    pub fn snapshot(&self, name: &str) -> Result<SnapshotTaken, SnapshotError> {
        self.core.take_snapshot(name)
    }

    /// Segments some snapshot names (kept by this open whatever the index says).
    pub fn pinned_segments(&self) -> u64 {
        self.core.shared.lock().pinned.len() as u64
    }

    /// Object bytes of the segments only snapshots need (the disk's index names none of
    /// their bytes).
    pub fn snapshot_only_bytes(&self) -> u64 {
        self.core.shared.lock().pinned_only.values().sum()
    }

    /// What the garbage collector did since the disk was opened.
    pub fn gc_totals(&self) -> GcReport {
        self.core.shared.lock().gc_totals
    }

    /// Checks the live bytes the index keeps per segment against a recount of its mappings;
    /// the error names the first difference.
    /// The object keys of the segments the index names that are durable (neither the open
    /// segment nor a sealed one still uploading): each must exist in the store, or a read of
    /// it fails (`sim check --layout log` checks it after every step).
    pub fn durable_named_segment_keys(&self) -> Vec<String> {
        let state = self.core.shared.lock();
        let named: BTreeSet<u64> = state
            .index
            .live_bytes_by_segment()
            .keys()
            .copied()
            .filter(|sequence| {
                *sequence != state.open.sequence && !state.sealed.contains_key(sequence)
            })
            .collect();
        drop(state);
        named
            .into_iter()
            .map(|sequence| self.core.shared.segment_key(sequence))
            .collect()
    }

    pub fn check_live_bytes(&self) -> Result<(), LiveBytesMismatch> {
        let state = self.core.shared.lock();
        let kept = state.index.live_bytes_by_segment();
        let counted = state.index.recount_live_bytes();
        if kept == &counted {
            return Ok(());
        }
        let segment = kept
            .keys()
            .chain(counted.keys())
            .find(|segment| kept.get(segment) != counted.get(segment))
            .expect("the maps differ");
        Err(LiveBytesMismatch {
            segment: *segment,
            kept: kept.get(segment).copied(),
            counted: counted.get(segment).copied(),
        })
    }

    /// Every mapping of the index as (disk offset, length, segment, object address): two opens
    /// map a range alike exactly when they read the same bytes there (a replica's refresh
    /// compares them).
    pub(crate) fn index_entries(&self) -> Vec<(u64, u64, u64, u64)> {
        let state = self.core.shared.lock();
        state
            .index
            .iter()
            .map(|(offset, mapping)| {
                (
                    offset,
                    mapping.length,
                    mapping.segment,
                    mapping.object_offset,
                )
            })
            .collect()
    }

    /// Writes `data` at `offset` (durable at the next successful [`LogStore::flush`]).
    /// Checked against the lease before and after: a write can wait for room among the
    /// uploads in flight for longer than a lease, and must not be acknowledged once another
    /// server may have taken the disk.
    pub fn write(&self, data: &[u8], offset: u64) -> Result<(), StoreError> {
        self.check_lease()?;
        self.core.write(data, offset)?;
        self.check_lease()
    }

    /// Ok while this open may acknowledge writes: its lease on the disk lock holds (module
    /// `lease`); an open without the lock (read-only, or the caller keeps writers away) has
    /// nothing to check.
    pub fn check_lease(&self) -> Result<(), StoreError> {
        self.core.shared.check_lease()
    }

    /// Writes each `(data, offset)` in order, one outcome per write.
    pub fn write_batch(&self, writes: Vec<(Bytes, u64)>) -> Vec<Result<(), StoreError>> {
        if let Err(error) = self.check_lease() {
            return writes.iter().map(|_| Err(error.clone())).collect();
        }
        writes
            .into_iter()
            .map(|(data, offset)| {
                self.core.write(&data, offset)?;
                self.check_lease()
            })
            .collect()
    }

    /// Zeroes `length` bytes at `offset`: an index change and one table entry, no data.
    pub fn write_zeroes(&self, offset: u64, length: u64) -> Result<(), StoreError> {
        self.check_lease()?;
        self.core.write_zeroes(offset, length)?;
        self.check_lease()
    }

    /// Every disk range whose newest data is only in memory (the open segment, or a sealed
    /// segment not yet uploaded), with its bytes, in pieces of at most 1 MiB: what a shutdown
    /// that cannot reach the store must save elsewhere. Zeroings not yet durable are not
    /// included (the index keeps no trace of them). The second value counts the bytes that
    /// could not be read back.
    pub fn undurable_extents(&self) -> (Vec<(u64, Vec<u8>)>, u64) {
        const PIECE_BYTES_MAX: u64 = 1 << 20;
        let ranges: Vec<(u64, u64)> = {
            let state = self.core.shared.lock();
            state
                .index
                .iter()
                .filter(|(_, mapping)| {
                    mapping.segment == state.open.sequence
                        || state.sealed.contains_key(&mapping.segment)
                })
                .map(|(offset, mapping)| (offset, mapping.length))
                .collect()
        };
        let mut extents = Vec::new();
        let mut unreadable_bytes = 0;
        for (offset, length) in ranges {
            let mut position = offset;
            while position < offset + length {
                let piece = PIECE_BYTES_MAX.min(offset + length - position);
                let mut data = vec![0u8; piece as usize];
                // In memory: served without a request, so it works with the store gone.
                match self.core.read(&mut data, position) {
                    Ok(()) => extents.push((position, data)),
                    Err(_) => unreadable_bytes += piece,
                }
                position += piece;
            }
        }
        (extents, unreadable_bytes)
    }

    /// Makes every write and zeroing that returned before this call durable: seals the open
    /// segment, waits until every segment up to it is durable (uploading failed ones again,
    /// once each) and writes a checkpoint when one is due. Checked against the lease after
    /// the segments are durable: a FLUSH is acknowledged only while no other server may have
    /// taken the disk (and so listed the log without them).
    pub fn flush(&self) -> Result<(), StoreError> {
        self.core.flush_and_checkpoint(false)?;
        self.check_lease()
    }

    /// Fills `buffer` from the disk at `offset`: bytes still in memory are copied, the rest
    /// fetched with ranged GETs, one per run of extents adjacent in one segment object (at
    /// most `get_bytes_max` bytes each).
    pub fn read(&self, buffer: &mut [u8], offset: u64) -> Result<(), StoreError> {
        self.core.read(buffer, offset)
    }

    /// Fills each `(buffer, offset)` of `reads` as [`LogStore::read`] does, one outcome per
    /// read, in order: the pieces of every read are fetched together, those back to back in
    /// one segment (a read-ahead window's runs of data written sequentially) by one ranged
    /// GET of at most `get_bytes_max` bytes, so a batch costs GETs by the segment ranges it
    /// spans, not by its reads.
    pub fn read_batch(&self, reads: &mut [(&mut [u8], u64)]) -> Vec<Result<(), StoreError>> {
        self.core.read_batch(reads)
    }

    /// Runs one garbage collection round now, with `threshold` as the live fraction below
    /// which a segment is rewritten (whether or not the background collector runs): see
    /// [`GcReport`].
    pub fn collect_garbage(&self, threshold: f64) -> Result<GcReport, StoreError> {
        self.core.collect_garbage(threshold, &mut || {})
    }

    /// [`LogStore::collect_garbage`], calling `between` after the round read the live extents
    /// and before it appends them (tests use it to write in that window).
    #[doc(hidden)]
    pub fn collect_garbage_calling(
        &self,
        threshold: f64,
        between: &mut dyn FnMut(),
    ) -> Result<GcReport, StoreError> {
        self.core.collect_garbage(threshold, between)
    }

    /// Runs `check` between collection rounds: no segment is deleted and no count of the
    /// stored ones changes meanwhile (tests compare a bucket listing with the counts while a
    /// background collector runs).
    #[doc(hidden)]
    pub fn between_collector_rounds<T>(&self, check: impl FnOnce() -> T) -> T {
        let _round = self
            .core
            .collector
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        check()
    }

    /// Stops the background collector after its current round, if it runs (a test stops it
    /// before abandoning the store as a crashed server would leave it).
    pub fn stop_gc(&mut self) {
        if let Some(collector) = self.collector.take() {
            collector.stop();
        }
    }

    /// Stops the collector, flushes and writes a checkpoint covering every segment (so the
    /// next open replays nothing), then deletes the segments that checkpoint no longer
    /// needs. Called at drop; an error leaves the disk as a crash would (still consistent).
    pub fn close(&mut self) -> Result<(), StoreError> {
        self.stop_gc();
        if self.core.read_only.is_some() {
            return Ok(());
        }
        self.core.flush_and_checkpoint(true)?;
        self.core.release_kept()?;
        self.core.delete_dead_segments()
    }
}

impl Core {
    fn check_range(&self, offset: u64, length: u64) -> Result<(), StoreError> {
        let size = self.size_bytes();
        match offset.checked_add(length) {
            Some(end) if end <= size => Ok(()),
            _ => Err(StoreError::OutOfRange {
                offset,
                length,
                size,
            }),
        }
    }

    /// Starts the PUT of sealed segment `sequence`; its outcome lands in the state.
    fn start_upload(&self, sequence: u64, body: Bytes) {
        let shared = self.shared.clone();
        let body_bytes = body.len() as u64;
        self.runtime.spawn(async move {
            let key = shared.segment_key(sequence);
            let result = match shared.check_lease() {
                Ok(()) => shared
                    .store
                    .put(&ObjectPath::from(key.as_str()), PutPayload::from(body))
                    .await
                    .map_err(|error| chain(&error)),
                Err(error) => Err(error.to_string()),
            };
            let mut state = shared.lock();
            match result {
                Ok(_) => {
                    // One upload of a segment runs at a time (a retry only after a failure),
                    // so a segment becomes durable once.
                    strict_assert!(
                        sequence > state.durable_through && !state.durable_ahead.contains(&sequence),
                        "segment {sequence} uploaded twice (durable through {})",
                        state.durable_through
                    );
                    state.sealed.remove(&sequence);
                    state.stored.insert(sequence, body_bytes);
                    state.durable_ahead.insert(sequence);
                    let state = &mut *state;
                    while state.durable_ahead.remove(&(state.durable_through + 1)) {
                        state.durable_through += 1;
                    }
                    strict_assert!(
                        state.durable_ahead.iter().all(|&ahead| ahead > state.durable_through + 1),
                        "a segment right after the durable prefix was left out of it"
                    );
                }
                Err(message) => {
                    tracing::warn!(segment = %key, error = %message, "segment upload failed; kept in memory for the next flush");
                    if let Some(sealed) = state.sealed.get_mut(&sequence) {
                        sealed.upload = Upload::Failed(message);
                    }
                }
            }
            drop(state);
            shared.uploaded.notify_all();
        });
    }

    /// Restarts the upload of the oldest failed segment at or below `through`, unless it was
    /// already retried in this call (`retried`), in which case its error is returned.
    fn retry_failed<'a>(
        &'a self,
        mut state: MutexGuard<'a, State>,
        through: u64,
        retried: &mut BTreeSet<u64>,
    ) -> Result<MutexGuard<'a, State>, StoreError> {
        let failed = state
            .sealed
            .range(..=through)
            .find_map(|(&sequence, sealed)| match &sealed.upload {
                Upload::Failed(message) => Some((sequence, message.clone())),
                Upload::Running => None,
            });
        if let Some((sequence, message)) = failed {
            if !retried.insert(sequence) {
                return Err(StoreError::Request {
                    operation: "PUT",
                    key: self.shared.segment_key(sequence),
                    message,
                });
            }
            let sealed = state.sealed.get_mut(&sequence).expect("found just now");
            sealed.upload = Upload::Running;
            let body = sealed.body.clone();
            drop(state);
            self.start_upload(sequence, body);
            state = self.shared.lock();
        }
        Ok(state)
    }

    /// Seals open segment `sequence` and starts its upload, first waiting until fewer than
    /// `segments_in_flight_max` segments are in flight (retrying a failed one once). The lock
    /// is let go while waiting: when another caller sealed `sequence` meanwhile, the segment
    /// open now (holding only newer writes) is left open.
    fn seal<'a>(
        &'a self,
        state: MutexGuard<'a, State>,
        sequence: u64,
    ) -> Result<MutexGuard<'a, State>, StoreError> {
        self.seal_then(state, sequence, &mut |_| {})
    }

    /// [`Core::seal`], calling `at_seal` with the state right after this call sealed
    /// `sequence` (the open segment is new and empty), before the lock is let go: the state
    /// then is a flush point (module `snapshot`). Not called when another caller sealed it.
    fn seal_then<'a>(
        &'a self,
        mut state: MutexGuard<'a, State>,
        sequence: u64,
        at_seal: &mut dyn FnMut(&mut State),
    ) -> Result<MutexGuard<'a, State>, StoreError> {
        let mut retried = BTreeSet::new();
        while state.open.sequence == sequence
            && state.sealed.len() >= self.config.segments_in_flight_max
        {
            state = self.retry_failed(state, u64::MAX, &mut retried)?;
            if state.sealed.len() < self.config.segments_in_flight_max {
                break;
            }
            // An upload retried just now may have failed again before the lock was taken
            // back (its signal then went to nobody): look again instead of waiting.
            if !has_failed(&state, u64::MAX) {
                state = self
                    .shared
                    .uploaded
                    .wait(state)
                    .unwrap_or_else(PoisonError::into_inner);
            }
        }
        if state.open.sequence != sequence {
            return Ok(state);
        }
        let moves = state.open.order_by_disk_offset();
        move_addresses(&mut state.index, sequence, &moves);
        let body = self.shared.sealer.tag_object(
            &segment_name(sequence, self.shared.epochs.owner(sequence)),
            state.open.seal(
                self.shared.metadata.disk_id,
                state.durable_through,
                state.checkpoint_through,
            ),
        );
        tracing::debug!(
            segment = sequence,
            bytes = body.len(),
            extents = state.open.table.len(),
            "sealed a segment"
        );
        let resealed = state.sealed.insert(
            sequence,
            Sealed {
                body: body.clone(),
                upload: Upload::Running,
            },
        );
        strict_assert!(
            resealed.is_none() && sequence > state.durable_through,
            "segment {sequence} sealed twice"
        );
        state.open = OpenSegment::new(sequence + 1, self.shared.sealer.clone());
        at_seal(&mut state);
        drop(state);
        self.start_upload(sequence, body);
        Ok(self.shared.lock())
    }

    /// Appends `data` written at `offset` (already range-checked), sealing segments as they
    /// fill. A write that does not fit is split at the segment's end, so segments are full
    /// (a sequential write-back costs one PUT per `segment_bytes_max`). Returns once the data
    /// is in memory: durable at the next successful FLUSH.
    fn append(&self, data: &[u8], offset: u64) -> Result<(), StoreError> {
        drop(self.append_locked(self.shared.lock(), data, offset, None)?);
        Ok(())
    }

    /// [`Core::append`] under the caller's lock, of client data (`copy_of` None) or of bytes
    /// the collector copied from segment `copy_of`. A copy is mapped only where the index
    /// still maps the range to its source when each piece is appended (the lock is let go
    /// while a seal waits for room, and a client write may land meanwhile), as replay does.
    fn append_locked<'a>(
        &'a self,
        mut state: MutexGuard<'a, State>,
        data: &[u8],
        offset: u64,
        copy_of: Option<u64>,
    ) -> Result<MutexGuard<'a, State>, StoreError> {
        let mut position = 0usize;
        while position < data.len() {
            let remaining = (data.len() - position) as u64;
            let room = state.open.room_bytes(self.config.segment_bytes_max);
            // A fresh segment has room for at least 4 KiB (LogConfig::validate), so this
            // loop always makes progress; below that, no sliver is split off.
            if room < remaining.min(SPLIT_BYTES_MIN) {
                let sequence = state.open.sequence;
                state = self.seal(state, sequence)?;
                continue;
            }
            // A sealed extent holds at most SEALED_EXTENT_BYTES_MAX bytes (a multiple of
            // SPLIT_BYTES_MIN, so pieces still start at whole multiples of it).
            let take = if remaining <= room {
                remaining
            } else {
                room - room % SPLIT_BYTES_MIN
            }
            .min(state.open.extent_bytes_max()) as usize;
            let piece = &data[position..position + take];
            let piece_offset = offset + position as u64;
            let segment = state.open.sequence;
            match copy_of {
                None => {
                    let object_offset = state.open.append_data(piece_offset, piece);
                    state.index.insert(
                        piece_offset,
                        Mapping {
                            length: take as u64,
                            segment,
                            object_offset,
                        },
                    );
                }
                Some(source) => {
                    let object_offset = state.open.append_copy(piece_offset, piece, source);
                    let mapping = Mapping {
                        length: take as u64,
                        segment,
                        object_offset,
                    };
                    state.index.insert_copy(piece_offset, mapping, source);
                }
            }
            position += take;
        }
        Ok(state)
    }

    fn write(&self, data: &[u8], offset: u64) -> Result<(), StoreError> {
        self.check_range(offset, data.len() as u64)?;
        self.check_writable()?;
        self.append(data, offset)
    }

    fn check_writable(&self) -> Result<(), StoreError> {
        match &self.read_only {
            None => Ok(()),
            Some(why) => Err(StoreError::ReadOnly {
                url: self.shared.url.to_string(),
                reason: why.to_string(),
            }),
        }
    }

    fn write_zeroes(&self, offset: u64, length: u64) -> Result<(), StoreError> {
        self.check_range(offset, length)?;
        self.check_writable()?;
        if length == 0 {
            return Ok(());
        }
        let mut state = self.shared.lock();
        while state.open.sealed_bytes_with(0, 1) > self.config.segment_bytes_max {
            let sequence = state.open.sequence;
            state = self.seal(state, sequence)?;
        }
        state.open.append_zeroes(offset, length);
        state.index.remove(offset, length);
        Ok(())
    }

    fn flush_and_checkpoint(&self, checkpoint_always: bool) -> Result<(), StoreError> {
        if self.read_only.is_some() {
            // Nothing was written, and a read-only store writes no checkpoint.
            return Ok(());
        }
        let mut state = self.shared.lock();
        // Every write that returned before this call is in a segment up to `target`.
        let target = if state.open.is_empty() {
            state.open.sequence - 1
        } else {
            let sequence = state.open.sequence;
            state = self.seal(state, sequence)?;
            sequence
        };
        let since_checkpoint = target.saturating_sub(state.checkpoint_through);
        // The snapshot must name no segment after the one it covers and is written only once
        // every segment up to that one is durable: it covers every sealed segment, taken while
        // the open segment is empty (when it is not, another writer got in while this flush
        // waited, and the checkpoint waits for a later flush).
        let covered = state.open.sequence - 1;
        let snapshot = (since_checkpoint > 0
            && state.open.is_empty()
            && (checkpoint_always || since_checkpoint >= self.config.checkpoint_interval_segments))
            .then(|| (covered, state.index.clone()));
        let wait_through = snapshot.as_ref().map_or(target, |&(covered, _)| covered);
        // The planted defect (tests/log_sim_check.rs): acknowledge the FLUSH (and write the
        // checkpoint) without waiting for the segments to be durable.
        #[cfg(feature = "planted-defect")]
        let wait_through = wait_through.min(state.durable_through);
        drop(state);
        self.wait_durable(wait_through)?;
        if let Some((covered, index)) = snapshot {
            self.write_checkpoint(covered, &index)?;
        }
        Ok(())
    }

    /// Waits until every segment up to `through` is durable, uploading failed ones again
    /// (once each); the error is a segment's second failure.
    fn wait_durable(&self, through: u64) -> Result<(), StoreError> {
        let mut state = self.shared.lock();
        let mut retried = BTreeSet::new();
        while state.durable_through < through {
            state = self.retry_failed(state, through, &mut retried)?;
            if state.durable_through >= through {
                break;
            }
            // As in `seal`: a retried upload that already failed again signalled nobody.
            if !has_failed(&state, through) {
                state = self
                    .shared
                    .uploaded
                    .wait(state)
                    .unwrap_or_else(PoisonError::into_inner);
            }
        }
        Ok(())
    }

    /// PUTs the checkpoint of `index` covering the segments up to `through`; then the
    /// previous newest is kept and the ones kept before it go ([`Core::retire_checkpoints`]),
    /// with the epoch objects no open from a remaining checkpoint reads (module `checkpoint`).
    fn write_checkpoint(&self, through: u64, index: &Index) -> Result<(), StoreError> {
        let _writer = self
            .checkpoint_writer
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if self.shared.lock().checkpoint_through >= through {
            // A checkpoint at least as new was written meanwhile.
            return Ok(());
        }
        let name = (through, self.shared.epoch);
        let key = checkpoint_key(&self.shared.url, name);
        let epochs = checkpoint::needed_epochs(&self.shared.epochs, through, index);
        let body = self.shared.sealer.tag_object(
            &checkpoint_name(name),
            checkpoint::encode(
                self.shared.metadata.disk_id,
                through,
                self.shared.epoch,
                &epochs,
                index,
            ),
        );
        // The planted defect (tests/log_sim_check.rs): the collector may delete what this
        // checkpoint no longer names before the checkpoint is durable (its PUT may fail).
        #[cfg(feature = "planted-gc-defect")]
        {
            let mut state = self.shared.lock();
            state.checkpoint_through = state.checkpoint_through.max(through);
        }
        let store = self.shared.store.clone();
        self.shared.check_lease()?;
        self.runtime.block_on(async {
            store
                .put(&ObjectPath::from(key.as_str()), PutPayload::from(body))
                .await
                .map_err(|error| request_failed("PUT", &key, error))
        })?;
        {
            let mut state = self.shared.lock();
            state.checkpoint_through = state.checkpoint_through.max(through);
            let newest = checkpoint::Kept {
                name: Some(name),
                through,
                named: index.live_bytes_by_segment().keys().copied().collect(),
                epoch: Some(self.shared.epoch),
            };
            if let Some(previous) = state.checkpoint_newest.replace(newest) {
                assert!(
                    previous.through < through,
                    "checkpoint {through} is not newer than {}",
                    previous.through
                );
                state.checkpoints_kept.push(previous);
            }
        }
        self.retire_checkpoints();
        self.prune_epochs();
        Ok(())
    }

    /// Deletes the kept checkpoints but the newest one (the newest checkpoint's
    /// predecessor), oldest first, each object before what it alone needs is released; a
    /// failed delete stops there and keeps its segments for a later checkpoint.
    fn retire_checkpoints(&self) {
        loop {
            let oldest = {
                let state = self.shared.lock();
                if state.checkpoints_kept.len() <= 1 {
                    return;
                }
                state.checkpoints_kept[0].name
            };
            if let Some(name) = oldest {
                let key = checkpoint_key(&self.shared.url, name);
                let store = self.shared.store.clone();
                let deleted = self
                    .runtime
                    .block_on(async { store.delete(&ObjectPath::from(key.as_str())).await });
                if let Err(error) = deleted {
                    tracing::warn!(checkpoint = %key, error = %chain(&error), "could not delete an old checkpoint; the segments it needs stay until a later checkpoint deletes it");
                    return;
                }
            }
            let mut state = self.shared.lock();
            let retired = state.checkpoints_kept.remove(0);
            assert!(
                state.checkpoints_kept[0].through >= retired.through,
                "kept checkpoints are held oldest first"
            );
        }
    }

    /// Deletes the epoch objects older than this open's that were in the store at open and
    /// that no open from the newest or a kept checkpoint reads (call only once a checkpoint
    /// of this open is durable). A failed delete is left for a later checkpoint or open.
    fn prune_epochs(&self) {
        let older: Vec<u64> = {
            let state = self.shared.lock();
            let newest = state
                .checkpoint_newest
                .as_ref()
                .and_then(|newest| newest.epoch);
            match checkpoint::epochs_needed_from(&state.checkpoints_kept, newest) {
                Some(low) => state.epoch_objects.range(..low).copied().collect(),
                None => Vec::new(),
            }
        };
        for number in older {
            let key = epoch_key(&self.shared.url, number);
            let store = self.shared.store.clone();
            let deleted = self
                .runtime
                .block_on(async { store.delete(&ObjectPath::from(key.as_str())).await });
            match deleted {
                Ok(()) => {
                    let mut state = self.shared.lock();
                    state.epoch_objects.remove(&number);
                    state.epochs_pruned += 1;
                }
                Err(error) => {
                    tracing::warn!(epoch = %key, error = %chain(&error), "could not delete an epoch object no open needs; a later checkpoint or open will");
                    return;
                }
            }
        }
    }

    fn read(&self, buffer: &mut [u8], offset: u64) -> Result<(), StoreError> {
        let mut reads = [(buffer, offset)];
        let [outcome] = <[_; 1]>::try_from(self.read_batch(&mut reads))
            .unwrap_or_else(|_| unreachable!("one outcome per read"));
        outcome
    }

    /// Fills each `(buffer, offset)` of `reads`, one outcome per read, in order.
    fn read_batch(&self, reads: &mut [(&mut [u8], u64)]) -> Vec<Result<(), StoreError>> {
        let mut outcomes: Vec<Result<(), StoreError>> = reads
            .iter()
            .map(|(buffer, offset)| self.check_range(*offset, buffer.len() as u64))
            .collect();
        let mut pending: Vec<usize> = (0..reads.len())
            .filter(|&read| outcomes[read].is_ok())
            .collect();
        while !pending.is_empty() {
            let deletes_before = self.shared.lock().segment_deletes_sent;
            let results = self.read_once(reads, &pending);
            assert_eq!(results.len(), pending.len(), "one outcome per pending read");
            let deletes_moved = self.shared.lock().segment_deletes_sent != deletes_before;
            let mut again = Vec::new();
            for (read, result) in pending.into_iter().zip(results) {
                match result {
                    // The collector deleted a segment this read had looked up (after
                    // copying its live bytes elsewhere): look the index up again.
                    Err(StoreError::MissingSegment { .. }) if deletes_moved => again.push(read),
                    outcome => outcomes[read] = outcome,
                }
            }
            pending = again;
        }
        outcomes
    }

    /// Reads `reads[pending[i]]` for each `i` once, with every piece that must be fetched
    /// from the store joined into as few ranged GETs as `get_bytes_max` allows; the outcomes
    /// follow `pending`.
    fn read_once(
        &self,
        reads: &mut [(&mut [u8], u64)],
        pending: &[usize],
    ) -> Vec<Result<(), StoreError>> {
        let bad = |segment: u64, reason: DecodeError| StoreError::BadData {
            key: self.shared.segment_key(segment),
            reason: Box::new(reason),
        };
        let mut outcomes: Vec<Result<(), StoreError>> = vec![Ok(()); pending.len()];
        // Every piece that must be fetched: the piece itself when stored as written, its
        // whole frame when sealed (module `segment`).
        let mut remote: Vec<Fetch> = Vec::new();
        {
            let state = self.shared.lock();
            for (slot, &read) in pending.iter().enumerate() {
                let (buffer, offset) = &mut reads[read];
                let offset = *offset;
                let mut fetches = Vec::new();
                let mut outcome = Ok(());
                for piece in state.index.lookup(offset, buffer.len() as u64) {
                    let start = (piece.disk_offset - offset) as usize;
                    let target = start..start + piece.length as usize;
                    let filled = match piece.stored {
                        None => {
                            buffer[target].fill(0);
                            Ok(())
                        }
                        Some((segment, address)) if segment == state.open.sequence => state
                            .open
                            .read_into(address, piece.disk_offset, &mut buffer[target])
                            .map_err(|reason| bad(segment, reason)),
                        Some((segment, address)) => {
                            let range = segment::fetch_range(address, piece.length);
                            match state.sealed.get(&segment) {
                                Some(sealed) => segment::extract(
                                    self.shared.sealer_of(segment),
                                    segment,
                                    &sealed.body[range.start as usize..range.end as usize],
                                    address,
                                    piece.disk_offset,
                                    &mut buffer[target],
                                )
                                .map_err(|reason| bad(segment, reason)),
                                // Not in memory, so durable (a segment leaves memory only
                                // then).
                                None => {
                                    fetches.push(Fetch {
                                        segment,
                                        range,
                                        address,
                                        disk_offset: piece.disk_offset,
                                        read: slot,
                                        target,
                                    });
                                    Ok(())
                                }
                            }
                        }
                    };
                    if let Err(error) = filled {
                        outcome = Err(error);
                        break;
                    }
                }
                // A read that already failed fetches nothing.
                match outcome {
                    Ok(()) => remote.append(&mut fetches),
                    Err(error) => outcomes[slot] = Err(error),
                }
            }
        }
        if remote.is_empty() {
            return outcomes;
        }
        // A sequential write-back stores consecutive disk ranges back to back, so the runs
        // of a read-ahead window mostly join into one GET per `get_bytes_max` bytes.
        let gets = coalesce(remote, self.config.get_bytes_max);
        let fetched: Vec<(Get, Result<Bytes, StoreError>)> = self.runtime.block_on(
            stream::iter(gets.into_iter().map(|get| {
                let store = self.shared.store_of(get.segment).clone();
                let key = self.shared.segment_key(get.segment);
                async move {
                    let result = match get_range_in(&*store, &key, get.range.clone()).await {
                        Ok(Some(data)) => Ok(data),
                        Ok(None) => Err(StoreError::MissingSegment { key }),
                        Err(error) => Err(error),
                    };
                    (get, result)
                }
            }))
            .buffer_unordered(self.config.requests_in_flight_max)
            .collect(),
        );
        for (get, result) in fetched {
            for piece in get.pieces {
                if outcomes[piece.read].is_err() {
                    continue;
                }
                let data = match &result {
                    Ok(data) => data,
                    Err(error) => {
                        outcomes[piece.read] = Err(error.clone());
                        continue;
                    }
                };
                let within = (piece.range.start - get.range.start) as usize;
                let length = (piece.range.end - piece.range.start) as usize;
                let buffer = &mut reads[pending[piece.read]].0;
                if let Err(reason) = segment::extract(
                    self.shared.sealer_of(get.segment),
                    get.segment,
                    &data[within..within + length],
                    piece.address,
                    piece.disk_offset,
                    &mut buffer[piece.target],
                ) {
                    outcomes[piece.read] = Err(bad(get.segment, reason));
                }
            }
        }
        outcomes
    }
}

impl Drop for LogStore {
    fn drop(&mut self) {
        if let Err(error) = self.close() {
            tracing::error!(disk = %self.core.shared.url, error = %error, "closing the log: writes after the last successful flush may be lost");
        }
    }
}

/// Refuses a disk of another layout, or a configuration [`LogConfig::validate`] refuses, or
/// seal parameters [`Sealer::open`] refuses (a wrong key among them); else the disk's sealer.
fn check_layout(
    url: &S3Url,
    metadata: &DiskMetadata,
    config: &LogConfig,
) -> Result<Sealer, OpenError> {
    config.validate().map_err(|error| OpenError::Config {
        url: url.to_string(),
        reason: error.to_string(),
    })?;
    if metadata.layout != LayoutKind::Log {
        return Err(OpenError::Mismatch {
            url: url.to_string(),
            parameter: "layout",
            given: LayoutKind::Log.name().to_string(),
            stored: metadata.layout.name().to_string(),
        });
    }
    let sealer = Sealer::open(url, metadata.disk_id, metadata.seal)?;
    if config.segment_bytes_max > segment::SEALED_SEGMENT_BYTES_MAX {
        return Err(OpenError::Config {
            url: url.to_string(),
            reason: format!(
                "segment_bytes_max {} is above {}, the largest segment whose extents' addresses fit",
                config.segment_bytes_max,
                segment::SEALED_SEGMENT_BYTES_MAX
            ),
        });
    }
    Ok(sealer)
}

/// The sealer of the log-layout disk `metadata` describes, once the URL's parameters are
/// checked against it (`bufcache disk` opens no store but needs both).
pub(crate) fn sealer_for(
    url: &S3Url,
    metadata: &DiskMetadata,
    config: &LogConfig,
) -> Result<Sealer, OpenError> {
    check_layout(url, metadata, config)
}

/// The end of the furthest extent any segment of the disk records (0 for an empty log),
/// reading every segment: a disk cannot shrink below it, since replay and the collector
/// check that every extent lies inside the disk.
pub(crate) async fn written_end(
    store: &dyn ObjectStore,
    url: &S3Url,
    metadata: &DiskMetadata,
    sealer: &Sealer,
) -> Result<u64, OpenError> {
    let mut end = 0;
    for (sequence, owner, _) in list_segments(store, url).await? {
        let key = segment_key(url, sequence, owner);
        let body = get_whole(store, url, &key).await?;
        let decoded = sealer
            .check_object(&segment_name(sequence, owner), &body)
            .and_then(|body| segment::decode(body, metadata.disk_id, metadata.size_bytes))
            .map_err(|reason| bad_object(url, &key, reason))?;
        for extent in decoded.extents {
            end = end.max(extent.disk_offset + extent.length);
        }
    }
    Ok(end)
}

/// Reads and checks checkpoint `name`; the error names its key.
async fn read_checkpoint(
    store: &dyn ObjectStore,
    url: &S3Url,
    metadata: &DiskMetadata,
    sealer: &Sealer,
    name: (u64, u64),
) -> Result<checkpoint::Checkpoint, OpenError> {
    let key = checkpoint_key(url, name);
    let body = get_whole(store, url, &key).await?;
    let checkpoint = sealer
        .check_object(&checkpoint_name(name), &body)
        .and_then(|body| checkpoint::decode(body, metadata.disk_id, metadata.size_bytes))
        .map_err(|reason| bad_object(url, &key, reason))?;
    if (checkpoint.through_sequence, checkpoint.epoch) != name {
        return Err(bad_object(
            url,
            &key,
            DecodeError::Inconsistent(format!(
                "covers segments to {} written by epoch {}, not the {} and {} its name says",
                checkpoint.through_sequence, checkpoint.epoch, name.0, name.1
            )),
        ));
    }
    Ok(checkpoint)
}

fn bad_object(url: &S3Url, key: &str, reason: DecodeError) -> OpenError {
    OpenError::BadObject {
        url: url.to_string(),
        key: key.to_string(),
        reason,
    }
}

async fn get_whole(store: &dyn ObjectStore, url: &S3Url, key: &str) -> Result<Bytes, OpenError> {
    let request_error = |error: object_store::Error| OpenError::Request {
        url: url.to_string(),
        operation: format!("reading `{key}`"),
        message: chain(&error),
    };
    store
        .get(&ObjectPath::from(key))
        .await
        .map_err(request_error)?
        .bytes()
        .await
        .map_err(request_error)
}

/// Reads the newest checkpoint and the epochs it needs, and replays the segments after it
/// (see the module docs for the rule); changes nothing (a writable open then claims its epoch
/// and carries the cleanup out, [`recover_and_claim`]).
async fn recover(
    store: &dyn ObjectStore,
    buckets: &Buckets,
    url: &S3Url,
    metadata: &DiskMetadata,
    sealer: &Sealer,
) -> Result<Recovered, OpenError> {
    // A clone starts from its base snapshot's index; its own log starts after it.
    let base = clone::read_base(store, buckets, url, metadata, sealer).await?;
    let mut checkpoints = list_numbered(store, url, "log/checkpoints").await?;
    let (checkpoint, damaged) =
        read_newest_checkpoint(store, url, metadata, sealer, &mut checkpoints).await?;
    let kept = read_kept(store, url, metadata, sealer, checkpoints.pop()).await?;
    let checkpoint_newest = checkpoint
        .as_ref()
        .map(|(name, read)| checkpoint::Kept::of(*name, read));
    let checkpoint = checkpoint.map(|(name, read)| (checkpoint_key(url, name), read));
    let checkpoint_epoch = checkpoint
        .as_ref()
        .and_then(|(_, checkpoint)| checkpoint.epochs.is_some().then_some(checkpoint.epoch));
    let epoch_objects = list_epoch_objects(store, url).await?;
    // A version 2 checkpoint records the epochs an open needs up to its writer's; only the
    // newer ones are read (module `checkpoint`). Older epoch objects are not needed: at
    // most not deleted yet, or a crashed server's late claim of a deleted number. Except
    // when the checkpoint is the disk's first: its fallback, the log's start, replays
    // segments of epochs it no longer records (their data all overwritten), whose owners
    // only their objects tell (none is deleted while the start is kept), so every one is
    // read; without them those segments would read as void and be deleted.
    let newer_than = if kept.name.is_none() {
        0
    } else {
        checkpoint_epoch.unwrap_or(0)
    };
    let mut epochs: epoch::Epochs = checkpoint
        .as_ref()
        .and_then(|(_, c)| c.epochs.clone())
        .unwrap_or_default();
    read_epochs_newer(
        store,
        url,
        metadata,
        sealer,
        &epoch_objects,
        newer_than,
        &mut epochs,
    )
    .await?;
    let mut cleanup = Cleanup {
        stale_checkpoints: checkpoints
            .into_iter()
            .chain(damaged.as_ref().map(|&(name, _, _)| name))
            .collect(),
        ..Cleanup::default()
    };
    // Every snapshot's segments are kept, whatever the log says of them (module `snapshot`);
    // a snapshot records the owners of the segments it names, which the newest checkpoint
    // may no longer know.
    let (snapshot_pins, snapshots) = snapshot::pins(store, url, metadata, sealer).await?;
    let Sorted {
        owned: segments,
        pinned,
        mut pinned_only,
    } = sort_segments(
        store,
        url,
        &snapshot_pins,
        &epochs,
        &epoch_objects,
        checkpoint_epoch,
        &mut cleanup.void,
    )
    .await?;
    let (mut index, checkpoint_through) =
        replay_start(url, checkpoint, base.as_ref(), &segments, &epochs)?;
    let mut last_sequence = checkpoint_through;
    // The newest checkpoint mark of the segments replayed, with the segment's key.
    let mut checkpoint_marked: Option<(u64, String)> = None;
    let mut stored = BTreeMap::new();
    // Segments the checkpoint covers but does not name hold no live byte and no replay needs
    // them: the collector's deletes were cut short (or it had not got to them yet).
    for &(sequence, bytes) in segments
        .iter()
        .filter(|&&(sequence, _)| sequence <= checkpoint_through)
    {
        if index.live_bytes(sequence) > 0 {
            stored.insert(sequence, bytes);
        } else if pinned.contains(&sequence) && !cfg!(feature = "planted-snapshot-defect") {
            pinned_only.insert(sequence, bytes);
        } else {
            cleanup.dead.push((sequence, bytes));
        }
    }
    for &(sequence, bytes) in segments
        .iter()
        .filter(|&&(sequence, _)| sequence > checkpoint_through)
    {
        if sequence != last_sequence + 1 || !cleanup.orphans.is_empty() {
            cleanup.orphans.push(sequence);
            continue;
        }
        let owner = epochs.owner(sequence);
        if let Some(marked) =
            replay_segment(store, url, metadata, sealer, sequence, owner, &mut index).await?
        {
            checkpoint_marked = Some(marked);
        }
        stored.insert(sequence, bytes);
        last_sequence = sequence;
    }
    check_replay_passed_damaged(url, damaged.as_ref(), last_sequence)?;
    let lost_mark = if url.recover_prefix {
        None
    } else {
        check_nothing_lost(
            store,
            url,
            metadata,
            &epochs,
            checkpoint_through,
            last_sequence + 1,
            &cleanup.orphans,
            checkpoint_marked,
        )
        .await?
    };
    warn_of_fallback(
        url,
        checkpoint_newest.as_ref(),
        damaged.as_ref(),
        lost_mark,
        last_sequence - checkpoint_through,
    );
    Ok(Recovered {
        index,
        last_sequence,
        checkpoint_through,
        stored,
        epochs,
        epoch: 0,
        checkpoint_newest,
        checkpoints_kept: vec![kept],
        epoch_objects,
        epochs_pruned: 0,
        cleanup,
        pinned,
        pinned_only,
        snapshots,
        base: base.map(|(base, _)| base),
    })
}

/// A newest checkpoint that does not read: its name (through, epoch), its key and why.
type DamagedCheckpoint = ((u64, u64), String, DecodeError);

/// The newest checkpoint, popped from `checkpoints` (oldest first), or when it is damaged
/// its predecessor (module docs, "Two checkpoints"; none: the log's start), with the damaged
/// one: the open then stands only if the replay reaches past the damaged one's `through`
/// ([`check_replay_passed_damaged`]). Two unusable ones are an error naming both.
async fn read_newest_checkpoint(
    store: &dyn ObjectStore,
    url: &S3Url,
    metadata: &DiskMetadata,
    sealer: &Sealer,
    checkpoints: &mut Vec<(u64, u64)>,
) -> Result<
    (
        Option<((u64, u64), checkpoint::Checkpoint)>,
        Option<DamagedCheckpoint>,
    ),
    OpenError,
> {
    let mut damaged: Option<DamagedCheckpoint> = None;
    while let Some(name) = checkpoints.pop() {
        match read_checkpoint(store, url, metadata, sealer, name).await {
            Ok(read) => return Ok((Some((name, read)), damaged)),
            // With no predecessor the replay starts at the log's start, which the first
            // checkpoint's writer kept whole.
            Err(OpenError::BadObject { key, reason, .. }) if damaged.is_none() => {
                damaged = Some((name, key, reason));
            }
            Err(error) => {
                return Err(match damaged {
                    Some((_, key, reason)) => bad_object(
                        url,
                        &key,
                        DecodeError::Inconsistent(format!(
                            "{reason}; the previous checkpoint is unusable too: {error}"
                        )),
                    ),
                    None => error,
                })
            }
        }
    }
    Ok((None, damaged))
}

/// What the open keeps besides the checkpoint it reads: its `predecessor` (its object
/// unread when damaged, so it keeps everything), or the log's start when there is none.
async fn read_kept(
    store: &dyn ObjectStore,
    url: &S3Url,
    metadata: &DiskMetadata,
    sealer: &Sealer,
    predecessor: Option<(u64, u64)>,
) -> Result<checkpoint::Kept, OpenError> {
    Ok(match predecessor {
        Some(name) => match read_checkpoint(store, url, metadata, sealer, name).await {
            Ok(read) => checkpoint::Kept::of(name, &read),
            Err(OpenError::BadObject { .. }) => checkpoint::Kept::unknown(name),
            Err(error) => return Err(error),
        },
        None => checkpoint::Kept::start(),
    })
}

/// The numbers of the disk's epoch objects; a name that is not one's is an error naming it.
async fn list_epoch_objects(
    store: &dyn ObjectStore,
    url: &S3Url,
) -> Result<BTreeSet<u64>, OpenError> {
    list_numbered(store, url, "log/epochs")
        .await?
        .into_iter()
        .map(|(number, epoch)| {
            if epoch == 0 {
                Ok(number)
            } else {
                Err(bad_object(
                    url,
                    &epoch_key(url, number),
                    DecodeError::Inconsistent(
                        "not a bufcache epoch object name (16 hex digits)".to_string(),
                    ),
                ))
            }
        })
        .collect()
}

/// Reads the epoch objects numbered above `newer_than` into `epochs`, each checked (its tag,
/// disk id, and the number it records against its name).
async fn read_epochs_newer(
    store: &dyn ObjectStore,
    url: &S3Url,
    metadata: &DiskMetadata,
    sealer: &Sealer,
    epoch_objects: &BTreeSet<u64>,
    newer_than: u64,
    epochs: &mut epoch::Epochs,
) -> Result<(), OpenError> {
    for &number in epoch_objects.range(newer_than + 1..) {
        let key = epoch_key(url, number);
        let body = get_whole(store, url, &key).await?;
        let (recorded, start) = sealer
            .check_object(&epoch_name(number), &body)
            .and_then(|body| epoch::decode(body, metadata.disk_id))
            .map_err(|reason| bad_object(url, &key, reason))?;
        if recorded != number {
            return Err(bad_object(
                url,
                &key,
                DecodeError::Inconsistent(format!(
                    "records epoch {recorded}, not the {number} its name says"
                )),
            ));
        }
        epochs.insert(number, start);
    }
    Ok(())
}

/// The stored segments as [`sort_segments`] sorts them.
struct Sorted {
    /// (sequence, object bytes) of the segments of their sequence's owner: the log.
    owned: Vec<(u64, u64)>,
    /// Sequences some snapshot names.
    pinned: BTreeSet<u64>,
    /// Object bytes of the pinned segments the log does not own, by sequence.
    pinned_only: BTreeMap<u64, u64>,
}

/// Lists the stored segments and sorts them: only the owner's object of each sequence is
/// part of the log (module `epoch`); the others are void (pushed onto `void`): a crashed
/// server's late PUTs, or the segments after a gap it wrote. (Below the oldest segment the
/// checkpoint names, the owners may be unknown: such segments are dead or void, deleted
/// either way.) A segment a snapshot names (`snapshot_pins`) is kept whatever its owner.
/// A segment of an epoch with no object while no version 2 checkpoint was read
/// (`checkpoint_epoch` None) is an error naming it.
async fn sort_segments(
    store: &dyn ObjectStore,
    url: &S3Url,
    snapshot_pins: &BTreeMap<(u64, u64), Vec<String>>,
    epochs: &epoch::Epochs,
    epoch_objects: &BTreeSet<u64>,
    checkpoint_epoch: Option<u64>,
    void: &mut Vec<(u64, u64)>,
) -> Result<Sorted, OpenError> {
    let mut sorted = Sorted {
        owned: Vec::new(),
        pinned: BTreeSet::new(),
        pinned_only: BTreeMap::new(),
    };
    for (sequence, epoch, bytes) in list_segments(store, url).await? {
        if snapshot_pins.contains_key(&(sequence, epoch)) {
            sorted.pinned.insert(sequence);
            if epoch != epochs.owner(sequence) {
                sorted.pinned_only.insert(sequence, bytes);
                continue;
            }
        }
        // Epoch objects are deleted only once a version 2 checkpoint records what opens need
        // of them; without one, a segment's epoch always has its object (it was claimed
        // before the segment was written). One that does not means the newest checkpoint
        // is gone: refused rather than its segments taken for void and deleted.
        if checkpoint_epoch.is_none() && epoch != 0 && !epoch_objects.contains(&epoch) {
            return Err(bad_object(
                url,
                &segment_key(url, sequence, epoch),
                DecodeError::Inconsistent(format!(
                    "names epoch {epoch}, which has no epoch object and no version 2 checkpoint records (the newest checkpoint is missing?)"
                )),
            ));
        }
        if epoch == epochs.owner(sequence) {
            sorted.owned.push((sequence, bytes));
        } else {
            void.push((sequence, epoch));
        }
    }
    Ok(sorted)
}

/// The index the replay starts from and the segment it covers the log through: the
/// checkpoint's (refused when it names a segment of this disk's own, above a clone's base,
/// that is not among `segments`), else a clone's base snapshot's, else an empty one.
fn replay_start(
    url: &S3Url,
    checkpoint: Option<(String, checkpoint::Checkpoint)>,
    base: Option<&(clone::Base, Index)>,
    segments: &[(u64, u64)],
    epochs: &epoch::Epochs,
) -> Result<(Index, u64), OpenError> {
    let base_through = base.map_or(0, |(base, _)| base.through);
    Ok(match checkpoint {
        Some((key, checkpoint)) => {
            let present: BTreeSet<u64> = segments.iter().map(|&(sequence, _)| sequence).collect();
            if let Some((_, missing)) = checkpoint.index.iter().find(|(_, mapping)| {
                mapping.segment > base_through && !present.contains(&mapping.segment)
            }) {
                return Err(OpenError::MissingSegment {
                    url: url.to_string(),
                    checkpoint: key,
                    key: segment_key(url, missing.segment, epochs.owner(missing.segment)),
                });
            }
            (checkpoint.index, checkpoint.through_sequence)
        }
        None => match base {
            Some((base, index)) => (index.clone(), base.through),
            None => (Index::new(), 0),
        },
    })
}

/// Replays segment `sequence` (of epoch `owner`) onto `index`: reads it, checks its tag,
/// checksums and the sequence it records, and applies its extents in order. Returns the
/// checkpoint mark it carries, with its key.
async fn replay_segment(
    store: &dyn ObjectStore,
    url: &S3Url,
    metadata: &DiskMetadata,
    sealer: &Sealer,
    sequence: u64,
    owner: u64,
    index: &mut Index,
) -> Result<Option<(u64, String)>, OpenError> {
    let key = segment_key(url, sequence, owner);
    let body = get_whole(store, url, &key).await?;
    let decoded = sealer
        .check_object(&segment_name(sequence, owner), &body)
        .and_then(|body| segment::decode(body, metadata.disk_id, metadata.size_bytes))
        .map_err(|reason| bad_object(url, &key, reason))?;
    if decoded.sequence != sequence {
        return Err(bad_object(
            url,
            &key,
            DecodeError::Inconsistent(format!(
                "holds segment {}, not the {sequence} its name says",
                decoded.sequence
            )),
        ));
    }
    let marked = decoded
        .marks
        .checkpoint_through
        .map(|mark| (mark, key.clone()));
    for extent in decoded.extents {
        match (extent.object_offset(), extent.copy_of) {
            (Some(object_offset), copy_of) => {
                let mapping = Mapping {
                    length: extent.length,
                    segment: sequence,
                    object_offset,
                };
                match copy_of {
                    None => index.insert(extent.disk_offset, mapping),
                    // As when it was appended: only where the range still maps to the
                    // source (a newer write or trim before it in the log wins).
                    Some(source) => {
                        index.insert_copy(extent.disk_offset, mapping, source);
                    }
                }
            }
            (None, _) => index.remove(extent.disk_offset, extent.length),
        }
    }
    Ok(marked)
}

/// A damaged checkpoint was stored once every segment it covers was: the replay from its
/// predecessor must reach past it (to `last_sequence`), or the open is refused naming it.
fn check_replay_passed_damaged(
    url: &S3Url,
    damaged: Option<&DamagedCheckpoint>,
    last_sequence: u64,
) -> Result<(), OpenError> {
    if let Some(((through, _), key, reason)) = damaged {
        if last_sequence < *through {
            return Err(bad_object(
                url,
                key,
                DecodeError::Inconsistent(format!(
                    "{reason}; the previous checkpoint's replay stops at segment {}, which is missing",
                    last_sequence + 1
                )),
            ));
        }
    }
    Ok(())
}

/// Logs an open that fell back past its newest checkpoint (`damaged`) or past a missing one
/// (`lost_mark`, [`check_nothing_lost`]) and replayed `replayed` segments.
fn warn_of_fallback(
    url: &S3Url,
    checkpoint_newest: Option<&checkpoint::Kept>,
    damaged: Option<&DamagedCheckpoint>,
    lost_mark: Option<(u64, String)>,
    replayed: u64,
) {
    let from = match checkpoint_newest {
        Some(newest) => format!(
            "the previous checkpoint `{}`",
            checkpoint_key(url, newest.name.expect("a checkpoint read has a name"))
        ),
        None => "the start of the log".to_string(),
    };
    if let Some((_, key, reason)) = damaged {
        tracing::warn!(disk = %url, "the newest checkpoint `{key}` is unusable ({reason}); opened from {from} and replayed the {replayed} segments after it, which reach past it");
    } else if let Some((mark, key)) = lost_mark {
        tracing::warn!(disk = %url, "a checkpoint covering the segments up to {mark} is missing (segment `{key}` was sealed after it was stored); opened from {from} and replayed the {replayed} segments after it, which reach past it");
    }
}

/// What a read-only open of snapshot `name` serves: the snapshot's index, read through the
/// epochs it records; nothing else of the log is read.
async fn recover_snapshot(
    store: &dyn ObjectStore,
    buckets: &Buckets,
    url: &S3Url,
    metadata: &DiskMetadata,
    sealer: &Sealer,
    name: &str,
) -> Result<Recovered, OpenError> {
    let taken = snapshot::read(store, url, metadata, sealer, name)
        .await?
        .ok_or_else(|| OpenError::Config {
            url: url.to_string(),
            reason: format!(
                "no snapshot named `{}` (`bufcache disk snapshots` lists them)",
                name.escape_debug()
            ),
        })?;
    let epochs = taken.epochs.expect("snapshot::decode refuses version 1");
    // A clone's snapshot names its base's segments too.
    let base = clone::read_base(store, buckets, url, metadata, sealer)
        .await?
        .map(|(base, _)| base);
    Ok(Recovered {
        index: taken.index,
        last_sequence: taken.through_sequence,
        checkpoint_through: taken.through_sequence,
        stored: BTreeMap::new(),
        epochs,
        epoch: 0,
        checkpoint_newest: None,
        checkpoints_kept: Vec::new(),
        epoch_objects: BTreeSet::new(),
        epochs_pruned: 0,
        cleanup: Cleanup::default(),
        pinned: BTreeSet::new(),
        pinned_only: BTreeMap::new(),
        snapshots: 1,
        base,
    })
}

/// Missing segments a [`OpenError::LostObjects`] names at most.
const MISSING_NAMED_MAX: usize = 16;

/// Refuses an open whose segments prove objects missing (the marks of module `segment`): a
/// segment sealed after a checkpoint newer than the newest found (`checkpoint_through`)
/// that covers the gap `gap` (so segments before the gap were durable and are gone), or a
/// segment after the gap sealed once the missing one was stored. A crash leaves neither:
/// the segments after a crash's gap were sealed before the missing one was stored.
///
/// A newer checkpoint that is missing but covers only segments before the gap is no loss:
/// the replay from the one found (its predecessor, kept with every segment it needs, module
/// docs "Two checkpoints") passed it; its (mark, segment key) is the answer, for the open to
/// say it fell back. Reads the headers of the segments after the gap (`orphans`), newest
/// first (the newest carry the highest marks).
#[allow(clippy::too_many_arguments)]
async fn check_nothing_lost(
    store: &dyn ObjectStore,
    url: &S3Url,
    metadata: &DiskMetadata,
    epochs: &epoch::Epochs,
    checkpoint_through: u64,
    gap: u64,
    orphans: &[u64],
    checkpoint_marked: Option<(u64, String)>,
) -> Result<Option<(u64, String)>, OpenError> {
    let lost_checkpoint = |mark: u64, key: &str| {
        OpenError::LostObjects {
        url: url.to_string(),
        missing: vec![url.key(&format!("log/checkpoints/{mark:016x}-*"))],
        evidence: format!(
            "segment `{key}` was sealed after a checkpoint covering the segments up to {mark} was stored, but the newest checkpoint left covers {}, and the replay from it stops at segment {gap}, which is missing",
            match checkpoint_through {
                0 => "none".to_string(),
                through => format!("those up to {through}"),
            }
        ),
    }
    };
    // A replayed segment was sealed after its mark's checkpoint, which covers only segments
    // before it: before the gap.
    let mut passed = checkpoint_marked.filter(|&(mark, _)| mark > checkpoint_through);
    debug_assert!(passed.as_ref().is_none_or(|&(mark, _)| mark < gap));
    let present: BTreeSet<u64> = orphans.iter().copied().collect();
    for &sequence in orphans.iter().rev() {
        let key = segment_key(url, sequence, epochs.owner(sequence));
        let header = store
            .get_range(&ObjectPath::from(key.as_str()), 0..HEADER_BYTES)
            .await
            .map_err(|error| OpenError::Request {
                url: url.to_string(),
                operation: format!("reading the header of `{key}`"),
                message: chain(&error),
            })?;
        let (_, recorded, marks) = segment::decode_header(&header, metadata.disk_id)
            .map_err(|reason| bad_object(url, &key, reason))?;
        if recorded != sequence {
            return Err(bad_object(
                url,
                &key,
                DecodeError::Inconsistent(format!(
                    "holds segment {recorded}, not the {sequence} its name says"
                )),
            ));
        }
        if let Some(mark) = marks
            .checkpoint_through
            .filter(|&mark| mark > checkpoint_through)
        {
            if mark >= gap {
                return Err(lost_checkpoint(mark, &key));
            }
            if passed.as_ref().is_none_or(|&(passed, _)| passed < mark) {
                passed = Some((mark, key.clone()));
            }
        }
        if let Some(durable) = marks.durable_through.filter(|&durable| durable >= gap) {
            let missing = (gap..=durable)
                .filter(|sequence| !present.contains(sequence))
                .take(MISSING_NAMED_MAX)
                .map(|sequence| segment_key(url, sequence, epochs.owner(sequence)))
                .collect();
            return Err(OpenError::LostObjects {
                url: url.to_string(),
                missing,
                evidence: format!(
                    "segment `{key}` was sealed once every segment up to {durable} was stored, so the log has a gap no crash leaves"
                ),
            });
        }
    }
    Ok(passed)
}

/// The refusal of a writable open of a snapshot URL.
fn snapshot_writable(url: &S3Url) -> OpenError {
    OpenError::Config {
        url: url.to_string(),
        reason: format!(
            "snapshot=`{}` names a snapshot, which never changes: serve it with --read-only, or make a writable disk from it with `bufcache disk clone`",
            url.snapshot.as_deref().unwrap_or_default().escape_debug()
        ),
    }
}

/// Recovers the log and, for a writable open, claims the next epoch (module `epoch`) with a
/// create-only PUT before anything is written (when the claim fails because that epoch
/// appeared meanwhile, a crashed server's late claim, it recovers again under it); then
/// carries recovery's cleanup out ([`clean_up`]).
async fn recover_and_claim(
    store: &dyn ObjectStore,
    buckets: &Buckets,
    url: &S3Url,
    metadata: &DiskMetadata,
    sealer: &Sealer,
    writable: bool,
) -> Result<Recovered, OpenError> {
    if let Some(name) = &url.snapshot {
        if writable {
            return Err(snapshot_writable(url));
        }
        return recover_snapshot(store, buckets, url, metadata, sealer, name).await;
    }
    let mut claims = 0;
    loop {
        let mut recovered = recover(store, buckets, url, metadata, sealer).await?;
        if !writable {
            // Read-only: the dead segments, those after a gap and the void ones stay; none
            // is read.
            return Ok(recovered);
        }
        let epoch = recovered.epochs.newest() + 1;
        // The segments after a gap are skipped (module docs): this epoch starts after them.
        let start = recovered
            .cleanup
            .orphans
            .last()
            .copied()
            .unwrap_or(recovered.last_sequence)
            + 1;
        let key = epoch_key(url, epoch);
        let claimed = store
            .put_opts(
                &ObjectPath::from(key.as_str()),
                PutPayload::from(sealer.tag_object(
                    &epoch_name(epoch),
                    epoch::encode(metadata.disk_id, epoch, start),
                )),
                PutOptions {
                    mode: PutMode::Create,
                    ..Default::default()
                },
            )
            .await;
        claims += 1;
        match claimed {
            Ok(_) => {
                recovered.epochs.insert(epoch, start);
                recovered.epoch = epoch;
                clean_up(store, url, metadata, sealer, &mut recovered).await?;
                return Ok(recovered);
            }
            Err(
                object_store::Error::AlreadyExists { .. }
                | object_store::Error::Precondition { .. },
            ) if claims < EPOCH_CLAIMS_MAX => {
                tracing::warn!(epoch = %key, "another open claimed this epoch meanwhile (a crashed server's late request); recovering again");
            }
            Err(error) => {
                return Err(OpenError::Request {
                    url: url.to_string(),
                    operation: format!("claiming epoch `{key}` (create-only PUT)"),
                    message: chain(&error),
                })
            }
        }
    }
}

/// A writable open's cleanup, after it claimed its epoch: past a gap, stores a checkpoint
/// covering the segments after it; deletes the void and orphaned segments, the checkpoints
/// but the newest and its predecessor (first: a stale one that stays keeps everything),
/// the dead segments no kept checkpoint needs, and the epoch objects no open from a
/// remaining checkpoint reads.
async fn clean_up(
    store: &dyn ObjectStore,
    url: &S3Url,
    metadata: &DiskMetadata,
    sealer: &Sealer,
    recovered: &mut Recovered,
) -> Result<(), OpenError> {
    let cleanup = std::mem::take(&mut recovered.cleanup);
    let delete = |key: String, what: &'static str| async move {
        store
            .delete(&ObjectPath::from(key.as_str()))
            .await
            .map_err(|error| OpenError::Request {
                url: url.to_string(),
                operation: format!("deleting {what} `{key}`"),
                message: chain(&error),
            })
    };
    for (sequence, epoch) in cleanup.void {
        let key = segment_key(url, sequence, epoch);
        tracing::info!(segment = %key, owner = recovered.epochs.owner(sequence), "deleting a segment of an epoch that does not own its sequence (a crashed server's)");
        delete(key, "void segment").await?;
    }
    let stale_checkpoints = cleanup.stale_checkpoints;
    if let Some(&newest_orphan) = cleanup.orphans.last() {
        // Segment numbers are never used twice: a saved copy of a segment deleted here, put
        // back under its number after a new segment took it, would be replayed as that new
        // segment (and its sealed extents authenticate: their associated data names the
        // disk and that number). So a checkpoint covering the segments after the gap is
        // stored before they go: no replay reads a segment at or below it that its index
        // does not name, and new segments are numbered after it.
        let name = (newest_orphan, recovered.epoch);
        let key = checkpoint_key(url, name);
        let epochs = checkpoint::needed_epochs(&recovered.epochs, newest_orphan, &recovered.index);
        let body = sealer.tag_object(
            &checkpoint_name(name),
            checkpoint::encode(
                metadata.disk_id,
                newest_orphan,
                recovered.epoch,
                &epochs,
                &recovered.index,
            ),
        );
        store
            .put(&ObjectPath::from(key.as_str()), PutPayload::from(body))
            .await
            .map_err(|error| OpenError::Request {
                url: url.to_string(),
                operation: format!("storing checkpoint `{key}` past the unflushed segments"),
                message: chain(&error),
            })?;
        // The checkpoint recovered from is kept (its replay stops at the gap, as this
        // open's did, so an open falling back to it refuses rather than loses anything).
        let newest = checkpoint::Kept {
            name: Some(name),
            through: newest_orphan,
            named: recovered
                .index
                .live_bytes_by_segment()
                .keys()
                .copied()
                .collect(),
            epoch: Some(recovered.epoch),
        };
        recovered
            .checkpoints_kept
            .extend(recovered.checkpoint_newest.replace(newest));
        recovered.checkpoint_through = newest_orphan;
        recovered.last_sequence = newest_orphan;
    }
    for name in stale_checkpoints {
        let key = checkpoint_key(url, name);
        if let Err(error) = store.delete(&ObjectPath::from(key.as_str())).await {
            // It stays, and keeps every segment until a later checkpoint deletes it.
            tracing::warn!(checkpoint = %key, error = %chain(&error), "could not delete an old checkpoint");
            recovered
                .checkpoints_kept
                .insert(0, checkpoint::Kept::unknown(name));
        }
    }
    for (sequence, bytes) in cleanup.dead {
        if checkpoint::kept_need(&recovered.checkpoints_kept, sequence) {
            // The collector deletes it once no kept checkpoint needs it.
            recovered.stored.insert(sequence, bytes);
            continue;
        }
        let key = segment_key(url, sequence, recovered.epochs.owner(sequence));
        tracing::info!(segment = %key, checkpoint_through = recovered.checkpoint_through, "deleting a segment no kept checkpoint needs");
        delete(key, "unneeded segment").await?;
    }
    // Segments after a gap were never covered by an acknowledged FLUSH; the checkpoint just
    // stored covers them, so they go before anything new is written.
    for sequence in cleanup.orphans {
        if recovered.pinned.contains(&sequence) {
            // A snapshot names it: the checkpoint just stored covers it, so it is never
            // replayed, and it stays for the snapshot.
            continue;
        }
        let key = segment_key(url, sequence, recovered.epochs.owner(sequence));
        tracing::warn!(segment = %key, after = recovered.last_sequence, "deleting a segment written after a missing one (its writes were never flushed)");
        delete(key, "unflushed segment").await?;
    }
    // The newest checkpoint is durable (it was read, or just stored), and so are the kept
    // ones: the epoch objects older than all their writers' are needed by no open.
    // The planted defect (tests/log_sim_check.rs): every epoch object older than this open's
    // goes now, before a checkpoint recording the epochs this open needs is durable.
    let prune_below = if cfg!(feature = "planted-prune-defect") {
        Some(recovered.epoch)
    } else {
        checkpoint::epochs_needed_from(
            &recovered.checkpoints_kept,
            recovered
                .checkpoint_newest
                .as_ref()
                .and_then(|newest| newest.epoch),
        )
    };
    if let Some(checkpoint_epoch) = prune_below {
        let older: Vec<u64> = recovered
            .epoch_objects
            .range(..checkpoint_epoch)
            .copied()
            .collect();
        for number in older {
            // Housekeeping only: what is left is deleted by a later checkpoint or open.
            let key = epoch_key(url, number);
            if let Err(error) = store.delete(&ObjectPath::from(key.as_str())).await {
                tracing::warn!(epoch = %key, error = %chain(&error), "could not delete an epoch object no open needs");
                break;
            }
            recovered.epoch_objects.remove(&number);
            recovered.epochs_pruned += 1;
        }
    }
    Ok(())
}

/// (number, epoch) of the objects under `folder` named `<number>` or `<number>-<epoch>` (16
/// hex digits each; epoch 0 when absent), ascending.
async fn list_numbered(
    store: &dyn ObjectStore,
    url: &S3Url,
    folder: &str,
) -> Result<Vec<(u64, u64)>, OpenError> {
    let named = list_named(store, url, folder).await?;
    Ok(named
        .into_iter()
        .map(|(number, epoch, _)| (number, epoch))
        .collect())
}

/// (sequence, epoch, object bytes) of the segment objects, ascending.
async fn list_segments(
    store: &dyn ObjectStore,
    url: &S3Url,
) -> Result<Vec<(u64, u64, u64)>, OpenError> {
    list_named(store, url, "log/segments").await
}

/// (number, epoch, object bytes) of the objects under `folder`, ascending; an object named
/// otherwise than `<number>` or `<number>-<epoch>` is an error naming it.
async fn list_named(
    store: &dyn ObjectStore,
    url: &S3Url,
    folder: &str,
) -> Result<Vec<(u64, u64, u64)>, OpenError> {
    let objects = crate::store::list_folder(store, url, folder).await?;
    let mut named = Vec::with_capacity(objects.len());
    for object in objects {
        let name = object.location.filename().unwrap_or_default();
        let Some((number, epoch)) = epoch::parse_object_name(name) else {
            return Err(bad_object(
                url,
                object.location.as_ref(),
                DecodeError::Inconsistent(format!("not a bufcache object name under `{}` (16 hex digits, then optionally `-` and 16 more)", url.key(folder))),
            ));
        };
        named.push((number, epoch, object.size));
    }
    named.sort_unstable();
    Ok(named)
}
