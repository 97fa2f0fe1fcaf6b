//! `bufcache sim check --layout log`: the log layout's crash consistency, checked seed by
//! seed over the simulated object store ([`crate::sim_store`]).
//!
//! Each seed opens a [`LogStore`] on a small disk with a small segment size and checkpoint
//! interval (so segments, checkpoints and garbage collection all happen within a few dozen
//! steps), compression and encryption as the seed says, and drives seeded writes, zeroes,
//! reads (batches of runs, as a read-ahead window's, which may share GETs), flushes and garbage collection rounds (with writes landing in the middle of a round)
//! through it, while the store fails, loses, and hangs requests. Some steps close the store
//! cleanly and open the disk again (which must then hold every acknowledged write), so a
//! seed opens its disk about 8 times on average and the servers delete epoch objects their
//! checkpoints no longer need (counted, with the most epoch objects a bucket held). At
//! seeded moments, and whenever a step is stuck on a hung request, the server crashes: its
//! instance is abandoned, its hung requests are dropped, carried out at once or carried out
//! later (after the next server opened the disk and wrote), and the disk is opened again. The check:
//! - every read before a crash returns, block by block, the latest acknowledged data (or, for
//!   a block a failed write touched, the data before or after it);
//! - after a crash, the reopened disk equals the disk after some prefix of the writes in
//!   acknowledgement order since the previous open, and that prefix includes every write a
//!   successful FLUSH acknowledged (a failed write may be in it or not, block by block, and
//!   the write after the prefix may be torn at block boundaries: a write longer than a
//!   segment's room is split across segments, and a disk does not make a multi-block write
//!   atomic either);
//! - the collector's bookkeeping of live bytes per segment matches a recount after every
//!   round (it decides what may be deleted);
//! - a snapshot ([`LogStore::snapshot`], taken at seeded steps) reads, whenever it is checked
//!   (after every collection round and every reopen), block by block what the disk held when
//!   it was taken (a shadow copy of the allowed tags then), across later writes, collection,
//!   crashes and restarts; a snapshot whose request succeeded is also a FLUSH. A snapshot
//!   whose request failed or hung may exist or not, and may name segments a server opened
//!   before its late PUT landed never pinned: it is read when it exists but promises nothing;
//! - a clone of the first snapshot whose request succeeded, driven by a harness of its own
//!   under the same faults and crashes, interleaved with the disk's steps, keeps the same
//!   contract over its own writes, starts from its snapshot's content, and is read whole
//!   after every collection round and reopen of the disk (module [`crate::sim_clones`]);
//! - after some clean closes (seeded) the newest checkpoint is lost, deleted or with a byte
//!   flipped, and the disk must open all the same with every acknowledged write: the open
//!   falls back to the previous checkpoint, which the servers keep with every segment it
//!   needs. (Not when the newest may be the checkpoint an open stored past a crash's gap,
//!   whose loss is refused by design: its predecessor's replay stops at the gap.)
//!
//! Blocks carry a tag (the write that wrote them and the block's number) in their first
//! eight bytes and bytes derived from it after, so a block read back names its write and
//! anything else (torn, corrupt, another write's data at the wrong place) is reported.
//!
//! Replay: a seed's fates are a function of the seed (module `sim_store`); the one timing
//! input is how long the harness waits before it deems a step stuck on a hung request
//! (`STUCK_AFTER`), which under heavy load can move a crash earlier, never hide a violation.

use std::ops::Range;
use std::sync::mpsc;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bufcache_check::{Notes, Violation, RECENT_STEPS};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::sim_store::{mix, FaultRates, LateRates, SimWorld};
use crate::{LogConfig, LogStore, OpenError, S3Url, StoreError};

/// Bytes of one block of the model (the log layout never splits a 4 KiB block of a write).
pub(crate) const BLOCK_BYTES: u64 = 4096;
/// How long a step may run while a request of its instance hangs before the harness deems
/// it stuck on that request and crashes the server.
const STUCK_AFTER: Duration = Duration::from_millis(40);
/// How long a step may run with no request hanging, or after its server crashed, before it
/// is reported as never returning.
const NEVER_RETURNS: Duration = Duration::from_secs(10);
/// Attempts at opening the disk after a crash before faults are turned off for one more.
const REOPEN_ATTEMPTS_MAX: u32 = 20;

/// The properties `sim check --layout log` checks (module docs), as its violations name
/// them.
pub mod property {
    /// A read returns the latest acknowledged data (or a failed write's, block by block).
    pub const READS: &str = "reads";
    /// After a crash the disk opens again and equals a prefix of the writes since the
    /// previous open that includes every flushed one.
    pub const CRASH_CONSISTENCY: &str = "crash consistency";
    /// The collector's live bytes per segment match a recount.
    pub const LIVE_BYTES: &str = "collector bookkeeping";
    /// Every segment the index names exists.
    pub const SEGMENTS_EXIST: &str = "named segments exist";
    /// A snapshot reads what the disk held when it was taken.
    pub const SNAPSHOTS: &str = "snapshots";
    /// A clone starts from its snapshot and keeps the disk's contract over its own writes.
    pub const CLONES: &str = "clones";
    /// Every step returns (or hangs on a request the harness knows of).
    pub const PROGRESS: &str = "progress";
}

/// What checking one seed counted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LogCheckCounts {
    /// Steps (writes, zeroes, reads, flushes, collection rounds) taken.
    pub steps: u64,
    pub crashes: u64,
    /// Requests the store failed, lost or hung.
    pub faults: u64,
    /// Requests of crashed servers carried out after the crash.
    pub late_landings: u64,
    pub gc_rounds: u64,
    /// Clean closes (each followed by an open that must find every acknowledged write).
    pub clean_closes: u64,
    /// Epoch objects the servers deleted (at open and after their checkpoints).
    pub epochs_pruned: u64,
    /// Snapshots taken (their requests succeeded), and how often one was read back whole.
    pub snapshots_taken: u64,
    pub snapshot_checks: u64,
    /// The most epoch objects the bucket held after an open.
    pub epoch_objects_max: u64,
    /// Newest checkpoints lost (deleted or damaged) after a clean close.
    pub checkpoints_lost: u64,
    /// Clones made (module `sim_clones`), the steps their harness took (counted in `steps`
    /// too), and whole reads of a clone checked (at its opens and after its base's
    /// collection rounds and reopens).
    pub clones_made: u64,
    pub clone_steps: u64,
    pub clone_checks: u64,
}

impl LogCheckCounts {
    /// Adds `other`'s counts to these (the most epoch objects: the larger).
    fn add(&mut self, other: &LogCheckCounts) {
        self.steps += other.steps;
        self.crashes += other.crashes;
        self.faults += other.faults;
        self.late_landings += other.late_landings;
        self.gc_rounds += other.gc_rounds;
        self.clean_closes += other.clean_closes;
        self.epochs_pruned += other.epochs_pruned;
        self.snapshots_taken += other.snapshots_taken;
        self.snapshot_checks += other.snapshot_checks;
        self.epoch_objects_max = self.epoch_objects_max.max(other.epoch_objects_max);
        self.checkpoints_lost += other.checkpoints_lost;
        self.clones_made += other.clones_made;
        self.clone_steps += other.clone_steps;
        self.clone_checks += other.clone_checks;
    }
}

/// What checking one seed found.
#[derive(Clone, Debug, Default)]
pub struct LogCheckOutcome {
    /// What it counted.
    pub counts: LogCheckCounts,
    /// What broke the contract, with the step; None when nothing did.
    pub violation: Option<Violation>,
}

impl bufcache_check::SeedOutcome for LogCheckOutcome {
    fn violation(&self) -> Option<&Violation> {
        self.violation.as_ref()
    }
}

impl bufcache_check::Totals<LogCheckOutcome> for LogCheckCounts {
    fn add(&mut self, outcome: &LogCheckOutcome) {
        LogCheckCounts::add(self, &outcome.counts);
    }
}

/// A key file for the seeds that encrypt (one per process, removed at exit).
pub(crate) fn key_file() -> &'static std::path::Path {
    static KEY: OnceLock<tempfile::NamedTempFile> = OnceLock::new();
    KEY.get_or_init(|| {
        let file = tempfile::NamedTempFile::new().expect("creating a temporary key file");
        std::fs::write(file.path(), [0x5au8; 32]).expect("writing the temporary key file");
        file
    })
    .path()
}

/// Fills one block with the bytes of `tag` (0 is a block of zeroes).
pub(crate) fn fill_block(tag: u64, compressible: bool, block: &mut [u8]) {
    if tag == 0 {
        block.fill(0);
        return;
    }
    block[..8].copy_from_slice(&tag.to_le_bytes());
    for (index, chunk) in block[8..].chunks_mut(8).enumerate() {
        let word = if compressible {
            tag
        } else {
            mix(tag ^ ((index as u64) << 40))
        };
        let bytes = word.to_le_bytes();
        chunk.copy_from_slice(&bytes[..chunk.len()]);
    }
}

/// A block read back that carries no write's bytes (torn, corrupt, misplaced).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct NoTag {
    /// The tag its first 8 bytes name.
    tag: u64,
    /// The first byte that differs from that tag's bytes.
    differs_at: usize,
}

impl std::fmt::Display for NoTag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "holds bytes of no write (first 8 bytes say tag {:#x}; differs at byte {})",
            self.tag, self.differs_at
        )
    }
}

/// The tag a block read back carries, or why it carries none.
pub(crate) fn tag_of(block: &[u8], compressible: bool) -> Result<u64, NoTag> {
    let tag = u64::from_le_bytes(block[..8].try_into().expect("8 bytes"));
    let mut expected = vec![0u8; block.len()];
    fill_block(tag, compressible, &mut expected);
    if expected == block {
        Ok(tag)
    } else {
        let differs_at = block
            .iter()
            .zip(&expected)
            .position(|(a, b)| a != b)
            .unwrap_or(0);
        Err(NoTag { tag, differs_at })
    }
}

/// Tags a block may hold, described: `write 3 (block 7) or zeroes`.
pub(crate) fn describe_tags(tags: &[u64]) -> String {
    tags.iter()
        .map(|&tag| describe_tag(tag))
        .collect::<Vec<_>>()
        .join(" or ")
}

pub(crate) fn describe_tag(tag: u64) -> String {
    if tag == 0 {
        "zeroes".to_string()
    } else {
        format!("write {} (block {})", tag >> 24, tag & 0xff_ffff)
    }
}

/// One step of the workload, as acknowledged (or not).
#[derive(Clone, Debug)]
pub(crate) struct Change {
    pub(crate) blocks: Range<u64>,
    /// Write number (tags are `write << 24 | block`); None: zeroes.
    pub(crate) write: Option<u64>,
    pub(crate) acknowledged: bool,
}

impl Change {
    pub(crate) fn tag(&self, block: u64) -> u64 {
        self.write.map_or(0, |write| write << 24 | block)
    }
}

/// Allowed tags of each block: one, or more after a failed write.
pub(crate) type Allowed = Vec<Vec<u64>>;

pub(crate) fn apply(allowed: &mut Allowed, change: &Change) {
    for block in change.blocks.clone() {
        let tag = change.tag(block);
        let set = &mut allowed[block as usize];
        if change.acknowledged {
            set.clear();
            set.push(tag);
        } else if !set.contains(&tag) {
            set.push(tag);
        }
    }
}

/// The writes of `ranges`, each a new write number taken from `next_write` and its blocks
/// filled with that number's tags: `(offset, data)` for the store, and the [`Change`] each
/// makes once acknowledged.
pub(crate) fn writes_of(
    ranges: Vec<Range<u64>>,
    next_write: &mut u64,
    compressible: bool,
) -> (Vec<(u64, Vec<u8>)>, Vec<Change>) {
    let mut writes = Vec::with_capacity(ranges.len());
    let mut changes = Vec::with_capacity(ranges.len());
    for blocks in ranges {
        *next_write += 1;
        let write = *next_write;
        let mut data = vec![0u8; ((blocks.end - blocks.start) * BLOCK_BYTES) as usize];
        for (index, block) in blocks.clone().enumerate() {
            let at = index * BLOCK_BYTES as usize;
            fill_block(
                write << 24 | block,
                compressible,
                &mut data[at..at + BLOCK_BYTES as usize],
            );
        }
        writes.push((blocks.start * BLOCK_BYTES, data));
        changes.push(Change {
            blocks,
            write: Some(write),
            acknowledged: false,
        });
    }
    (writes, changes)
}

/// Why `data`, read at `offset`, is not what `now` allows of its blocks (`None`: it is):
/// the detail of a [`property::READS`] violation. `reader` names who read, after the block
/// (empty, or ` from the newest writer`).
pub(crate) fn misread(
    now: &Allowed,
    offset: u64,
    data: &[u8],
    compressible: bool,
    reader: &str,
) -> Option<String> {
    for (index, bytes) in data.chunks(BLOCK_BYTES as usize).enumerate() {
        let block = offset / BLOCK_BYTES + index as u64;
        let tag = match tag_of(bytes, compressible) {
            Ok(tag) => tag,
            Err(reason) => return Some(format!("a read of block {block} {reason}")),
        };
        let allowed = &now[block as usize];
        if !allowed.contains(&tag) {
            return Some(format!(
                "a read of block {block}{reader} returned {} but the latest acknowledged data is {}",
                describe_tag(tag),
                describe_tags(allowed)
            ));
        }
    }
    None
}

/// A seed's simulated store ([`SimWorld`]) and the rates it drew (for the scenario's
/// description): one seed in `fault_free_one_in` has no faults, the others each fault rate
/// drawn below `fault_maxima`; a crashed instance's parked requests land at the crash (30 %)
/// or later (50 %), within a number of steps drawn from `later_steps`. The draws are in a
/// fixed order and width, so that a seed keeps drawing the same stream.
pub(crate) fn draw_world(
    rng: &mut StdRng,
    seed: u64,
    fault_free_one_in: i32,
    fault_maxima: FaultRates,
    later_steps: Range<u64>,
) -> (Arc<SimWorld>, FaultRates, LateRates) {
    let faulty = rng.gen_range(0..fault_free_one_in) != 0;
    let faults = if faulty {
        FaultRates {
            fail_ppm: rng.gen_range(0..fault_maxima.fail_ppm),
            lost_ppm: rng.gen_range(0..fault_maxima.lost_ppm),
            hang_ppm: rng.gen_range(0..fault_maxima.hang_ppm),
            reset_ppm: rng.gen_range(0..fault_maxima.reset_ppm),
            applied_then_fail_ppm: rng.gen_range(0..fault_maxima.applied_then_fail_ppm),
        }
    } else {
        FaultRates::default()
    };
    let late = LateRates {
        at_crash_ppm: 300_000,
        later_ppm: 500_000,
        later_steps_max: rng.gen_range(later_steps),
    };
    (SimWorld::new(seed, faults, late), faults, late)
}

/// A seed's log-layout disk in the simulated store: its size, and whether it compresses and
/// encrypts.
pub(crate) struct DrawnDisk {
    pub(crate) blocks: u64,
    pub(crate) compress: bool,
    pub(crate) encrypt: bool,
    pub(crate) url: S3Url,
}

/// Draws the disk `s3://sim/{name}`: `blocks` blocks, compressed one seed in two, encrypted
/// with [`key_file`] at `encrypt_probability`.
pub(crate) fn draw_disk(
    rng: &mut StdRng,
    name: &str,
    blocks: std::ops::RangeInclusive<u64>,
    encrypt_probability: f64,
) -> DrawnDisk {
    let blocks = rng.gen_range(blocks);
    let compress = rng.gen_bool(0.5);
    let encrypt = rng.gen_bool(encrypt_probability);
    let mut text = format!(
        "s3://sim/{name}?create-size={}&layout=log",
        blocks * BLOCK_BYTES
    );
    if compress {
        text.push_str("&compress=zstd");
    }
    if encrypt {
        text.push_str(&format!("&key-file={}", key_file().display()));
    }
    let url = S3Url::parse(&text).expect("the harness's URL parses");
    DrawnDisk {
        blocks,
        compress,
        encrypt,
        url,
    }
}

/// Draws a seed's [`LogConfig`], its segment size one of `segment_bytes_choices`.
/// Collection rounds run as steps of the workload (seeded), not on the background
/// thread's clock.
pub(crate) fn draw_config(rng: &mut StdRng, segment_bytes_choices: &[u64]) -> LogConfig {
    let segment_bytes_max = segment_bytes_choices[rng.gen_range(0..segment_bytes_choices.len())];
    LogConfig {
        segment_bytes_max,
        segments_in_flight_max: rng.gen_range(1..=4),
        checkpoint_interval_segments: rng.gen_range(1..=4),
        requests_in_flight_max: rng.gen_range(1..=4),
        gc_threshold: None,
        gc_stored_ratio_max: 1.5,
        gc_requests_in_flight_max: rng.gen_range(1..=2),
        gc_bytes_max: segment_bytes_max * rng.gen_range(1..=4),
        gc_interval_ms: 100,
        get_bytes_max: [4 << 10, 12 << 10, segment_bytes_max][rng.gen_range(0..3)],
    }
}

/// What a step asks of the store (run on the step thread).
enum Step {
    Open,
    Write(Vec<(u64, Vec<u8>)>),
    Zeroes(u64, u64),
    /// A batch of reads, each (offset, length).
    Read(Vec<(u64, usize)>),
    Flush,
    Collect(f64, Vec<(u64, Vec<u8>)>),
    Snapshot(String),
    /// Makes a clone (at the step's URL) of the disk at this URL's snapshot with this name.
    Clone(Box<S3Url>, String),
    /// A clean close of the store (the harness's only reference).
    Close(Arc<LogStore>),
}

/// What a step's thread answers.
enum Answer {
    Opened(Result<LogStore, OpenError>),
    Writes(Vec<Result<(), StoreError>>),
    Done(Result<(), StoreError>),
    /// Each read's bytes or error, in the batch's order.
    Read(Vec<Result<Vec<u8>, StoreError>>),
    /// A close's outcome and the epoch objects the store deleted.
    Closed(Result<(), StoreError>, u64),
    Snapshot(Result<crate::SnapshotTaken, crate::SnapshotError>),
    Cloned(Result<(), crate::sim_clones::CloneError>),
    Collected(
        Result<crate::GcReport, StoreError>,
        Vec<Result<(), StoreError>>,
    ),
}

/// Runs one step on its own thread, so the harness can crash the server while the step is
/// stuck on a hung request.
fn spawn_step(
    store: Option<Arc<LogStore>>,
    world: &Arc<SimWorld>,
    instance: u64,
    url: &S3Url,
    config: LogConfig,
    step: Step,
    trace: bool,
) -> mpsc::Receiver<Answer> {
    let (sender, receiver) = mpsc::channel();
    let backend = world.store(instance);
    let url = url.clone();
    std::thread::Builder::new()
        .name("sim-log-step".to_string())
        .spawn(move || {
            let _quiet = (!trace).then(|| {
                tracing::subscriber::set_default(tracing::subscriber::NoSubscriber::default())
            });
            let answer = match step {
                Step::Open => Answer::Opened(LogStore::open_unlocked_on(&url, backend, config)),
                Step::Write(writes) => {
                    let store = store.expect("a write has a store");
                    Answer::Writes(
                        writes
                            .iter()
                            .map(|(offset, data)| store.write(data, *offset))
                            .collect(),
                    )
                }
                Step::Zeroes(offset, length) => Answer::Done(
                    store
                        .expect("zeroes have a store")
                        .write_zeroes(offset, length),
                ),
                Step::Read(reads) => {
                    let mut buffers: Vec<Vec<u8>> =
                        reads.iter().map(|(_, length)| vec![0u8; *length]).collect();
                    let mut batch: Vec<(&mut [u8], u64)> = buffers
                        .iter_mut()
                        .zip(&reads)
                        .map(|(buffer, (offset, _))| (buffer.as_mut_slice(), *offset))
                        .collect();
                    let outcomes = store.expect("a read has a store").read_batch(&mut batch);
                    Answer::Read(
                        outcomes
                            .into_iter()
                            .zip(buffers)
                            .map(|(outcome, buffer)| outcome.map(|()| buffer))
                            .collect(),
                    )
                }
                Step::Flush => Answer::Done(store.expect("a flush has a store").flush()),
                Step::Snapshot(name) => {
                    Answer::Snapshot(store.expect("a snapshot has a store").snapshot(&name))
                }
                Step::Clone(base_url, name) => Answer::Cloned(crate::sim_clones::create_clone(
                    backend, &base_url, &url, &name,
                )),
                Step::Collect(threshold, writes) => {
                    let store = store.expect("a round has a store");
                    let mut outcomes = Vec::new();
                    let mut between = || {
                        outcomes = writes
                            .iter()
                            .map(|(offset, data)| store.write(data, *offset))
                            .collect();
                    };
                    let report = store.collect_garbage_calling(threshold, &mut between);
                    Answer::Collected(report, outcomes)
                }
                Step::Close(mut store) => {
                    // A step that answered may still be dropping its reference.
                    let mut store = loop {
                        match Arc::try_unwrap(store) {
                            Ok(store) => break store,
                            Err(shared) => {
                                store = shared;
                                std::thread::sleep(Duration::from_millis(1));
                            }
                        }
                    };
                    let closed = store.close();
                    Answer::Closed(closed, store.epochs_pruned())
                }
            };
            let _ = sender.send(answer);
        })
        .expect("starting a step thread");
    receiver
}

/// How waiting for a step ended.
enum Waited {
    Answer(Answer),
    /// A request of the step's instance hangs and the step has not returned.
    Stuck,
}

/// A step that did not come back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stall {
    /// Its thread panicked.
    Panicked,
    /// No answer after [`NEVER_RETURNS`], and no request of its instance hangs.
    NeverReturned,
    /// A step of a crashed server (its requests fail at once) did not return.
    NeverReturnedAfterCrash,
}

impl std::fmt::Display for Stall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stall::Panicked => write!(f, "the step's thread panicked"),
            Stall::NeverReturned => write!(
                f,
                "a step has not returned after {NEVER_RETURNS:?} and no request hangs (deadlock?)"
            ),
            Stall::NeverReturnedAfterCrash => write!(
                f,
                "a step of a crashed server has not returned after {NEVER_RETURNS:?}"
            ),
        }
    }
}

fn wait(
    receiver: &mpsc::Receiver<Answer>,
    world: &SimWorld,
    instance: u64,
) -> Result<Waited, Stall> {
    let mut waited = Duration::ZERO;
    loop {
        match receiver.recv_timeout(STUCK_AFTER) {
            Ok(answer) => return Ok(Waited::Answer(answer)),
            Err(mpsc::RecvTimeoutError::Disconnected) => return Err(Stall::Panicked),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                waited += STUCK_AFTER;
                // Only this instance's: the other disk's server may have a request hanging.
                if world.parked_of(instance) > 0 {
                    return Ok(Waited::Stuck);
                }
                if waited >= NEVER_RETURNS {
                    return Err(Stall::NeverReturned);
                }
            }
        }
    }
}

/// Waits for a step of a crashed server (its requests now fail at once).
fn wait_after_crash(receiver: mpsc::Receiver<Answer>) -> Result<Option<LogStore>, Stall> {
    match receiver.recv_timeout(NEVER_RETURNS) {
        Ok(Answer::Opened(Ok(store))) => Ok(Some(store)),
        Ok(_) => Ok(None),
        Err(_) => Err(Stall::NeverReturnedAfterCrash),
    }
}

/// The length of the shortest prefix of `history` (changes since the open whose disk read
/// back as `base`) that the disk `image` (tags, block by block) may equal: at least the
/// `flushed` first changes, the change after the prefix possibly torn at block boundaries.
/// None when no prefix fits.
pub(crate) fn find_prefix(
    base: &[u64],
    history: &[Change],
    flushed: usize,
    image: &[u64],
) -> Option<usize> {
    assert_eq!(base.len(), image.len(), "an image of the whole disk");
    assert!(flushed <= history.len(), "a FLUSH covers changes made");
    let mut state: Allowed = base.iter().map(|&tag| vec![tag]).collect();
    let mismatched = |state: &Allowed, block: usize| !state[block].contains(&image[block]);
    let mut mismatches: usize = (0..image.len()).filter(|&b| mismatched(&state, b)).count();
    for length in 0..=history.len() {
        if length > 0 {
            let change = &history[length - 1];
            let before: Vec<bool> = change
                .blocks
                .clone()
                .map(|b| mismatched(&state, b as usize))
                .collect();
            apply(&mut state, change);
            for (b, was) in change.blocks.clone().zip(before) {
                let is = mismatched(&state, b as usize);
                mismatches = mismatches + usize::from(is) - usize::from(was);
            }
        }
        // The next change may be torn at the crash (a write longer than a segment's room
        // is split across segments): its blocks may hold its data instead.
        let torn = history.get(length).map_or(0, |next| {
            next.blocks
                .clone()
                .filter(|&b| mismatched(&state, b as usize) && image[b as usize] == next.tag(b))
                .count()
        });
        if length >= flushed && mismatches == torn {
            return Some(length);
        }
    }
    None
}

/// Snapshots one seed takes at most (each is read back whole at every check).
const SNAPSHOTS_MAX: usize = 4;
/// Clones a disk tries to make (of its first snapshot whose request succeeded); the last
/// attempt runs without faults.
const CLONE_ATTEMPTS_MAX: u32 = 3;
/// The clone's server instances are numbered from this times its attempt, apart from the
/// base's.
const CLONE_INSTANCES: u64 = 1 << 32;
/// The clone's writes are numbered from this, so a block names which disk wrote it.
const CLONE_WRITES: u64 = 1 << 30;

/// A snapshot as taken: the allowed tags of every block when it was taken.
struct Shadow {
    name: String,
    allowed: Allowed,
    /// Its request succeeded: it exists and must read as `allowed`. Otherwise it may not
    /// exist, or be broken (module docs), and is read but promises nothing.
    certain: bool,
}

struct Harness {
    seed: u64,
    /// Every step, the last ones kept for a violation's report (printed when tracing).
    notes: Notes,
    /// Which disk of the seed this harness drives (`disk`, or `clone`), for traces.
    label: &'static str,
    rng: StdRng,
    world: Arc<SimWorld>,
    url: S3Url,
    config: LogConfig,
    compressible: bool,
    blocks: u64,
    instance: u64,
    store: Option<Arc<LogStore>>,
    /// Tags of every block at the last open, as read back.
    base: Vec<u64>,
    /// Writes, zeroes and failed ones since the last open, in acknowledgement order.
    history: Vec<Change>,
    /// How many of `history` the last successful FLUSH covers.
    flushed: usize,
    /// Allowed tags of every block now (base and all of history).
    now: Allowed,
    next_write: u64,
    step: u64,
    counts: LogCheckCounts,
    snapshots: Vec<Shadow>,
    /// The clone of one of this disk's snapshots, driven by a harness of its own (module
    /// `sim_clones`); None before it is made, and in the clone's harness.
    clone: Option<Box<Harness>>,
    /// Clones this disk tried to make (a creation that failed or hung is abandoned).
    clone_attempts: u32,
    /// A new clone's harness before its first open: what each block must read then (its
    /// snapshot's content).
    first_image: Option<Allowed>,
}

impl Harness {
    fn note(&mut self, text: String) {
        let at = format_args!("seed {} step {} {}", self.seed, self.step, self.label);
        self.notes.note(at, text);
    }

    /// Traces what the store did (the world's log), without keeping it.
    fn flush_world_log(&self) {
        for line in self.world.take_log() {
            self.notes.trace(
                format_args!("seed {} step {}", self.seed, self.step),
                format_args!("  store: {line}"),
            );
        }
    }

    /// A broken `property` (module [`property`]) at this step, with the steps before it;
    /// a clone's harness names the clone.
    fn violation(&self, property: &'static str, detail: String) -> Violation {
        let step = bufcache_check::Step::workload(self.step);
        let violation = Violation::new(property, detail, step, self.seed, &self.notes);
        if self.label == "clone" {
            violation.of("clone")
        } else {
            violation
        }
    }

    /// `count` writes of random ranges (see [`writes_of`]).
    fn random_writes(&mut self, count: usize) -> (Vec<(u64, Vec<u8>)>, Vec<Change>) {
        let ranges = (0..count).map(|_| self.random_blocks()).collect();
        writes_of(ranges, &mut self.next_write, self.compressible)
    }

    fn random_blocks(&mut self) -> Range<u64> {
        let length = if self.rng.gen_bool(0.1) {
            self.rng.gen_range(1..=(self.blocks / 4).max(1))
        } else {
            self.rng.gen_range(1..=8u64.min(self.blocks))
        };
        let start = self.rng.gen_range(0..=self.blocks - length);
        start..start + length
    }

    fn record(&mut self, mut change: Change, outcome: &Result<(), StoreError>) {
        change.acknowledged = outcome.is_ok();
        self.note({
            format!(
                "{} blocks {:?}: {}",
                change
                    .write
                    .map_or("zeroes".to_string(), |write| format!("write {write}")),
                change.blocks,
                match outcome {
                    Ok(()) => "acknowledged".to_string(),
                    Err(error) => format!("failed: {error}"),
                }
            )
        });
        apply(&mut self.now, &change);
        self.history.push(change);
    }

    /// Runs a step; None when it got stuck on a hung request (the server then crashed).
    fn run(&mut self, step: Step) -> Result<Option<Answer>, Violation> {
        let receiver = spawn_step(
            self.store.clone(),
            &self.world,
            self.instance,
            &self.url,
            self.config,
            step,
            self.notes.tracing(),
        );
        let waited = wait(&receiver, &self.world, self.instance)
            .map_err(|stall| self.violation(property::PROGRESS, stall.to_string()))?;
        match waited {
            Waited::Answer(answer) => {
                self.flush_world_log();
                Ok(Some(answer))
            }
            Waited::Stuck => {
                self.note("stuck on a hung request: the server crashes".to_string());
                self.world.crash(self.instance);
                let store = wait_after_crash(receiver)
                    .map_err(|stall| self.violation(property::PROGRESS, stall.to_string()))?;
                if let Some(store) = store {
                    // An open that completed as it crashed: abandoned all the same.
                    drop(store);
                }
                self.flush_world_log();
                Ok(None)
            }
        }
    }

    /// Crashes the server (if one is open) and opens the disk again; checks what it finds.
    fn crash_and_reopen(&mut self) -> Result<(), Violation> {
        if let Some(store) = self.store.take() {
            self.counts.crashes += 1;
            self.note(format!("crash of instance {}", self.instance));
            self.world.crash(self.instance);
            // The dead server's close fails at once (its requests are refused): nothing of
            // it reaches the store.
            self.retire(store);
            self.flush_world_log();
        }
        let mut attempts = 0;
        loop {
            self.instance += 1;
            attempts += 1;
            if attempts > REOPEN_ATTEMPTS_MAX {
                self.world.set_calm(true);
            }
            self.note(format!("opening as instance {}", self.instance));
            match self.run(Step::Open)? {
                Some(Answer::Opened(Ok(store))) => {
                    self.store = Some(Arc::new(store));
                    break;
                }
                Some(Answer::Opened(Err(error))) => {
                    self.note(format!("open failed: {error}"));
                    if attempts > REOPEN_ATTEMPTS_MAX {
                        self.world.set_calm(false);
                        let log = self.own_folder("log/");
                        let stored: Vec<String> = self
                            .world
                            .objects()
                            .into_iter()
                            .filter(|(key, _)| {
                                key.starts_with(&log) && !key.contains("/log/epochs/")
                            })
                            .map(|(key, _)| key[log.len()..].to_string())
                            .collect();
                        return Err(self.violation(
                            property::CRASH_CONSISTENCY,
                            format!(
                                "the disk cannot be opened again, even without faults: {error} (its log holds {})",
                                stored.join(", ")
                            ),
                        ));
                    }
                }
                Some(_) => unreachable!("an open answers Opened"),
                None => {
                    self.counts.crashes += 1;
                }
            }
        }
        self.world.set_calm(false);
        let epoch_objects = self
            .world
            .objects()
            .iter()
            .filter(|(key, _)| key.starts_with(&self.own_folder("log/epochs/")))
            .count() as u64;
        self.counts.epoch_objects_max = self.counts.epoch_objects_max.max(epoch_objects);
        self.check_named_segments_exist()?;
        self.verify_reopened()?;
        self.check_snapshots()
    }

    /// Reads every snapshot back whole, without faults, through a read-only open of
    /// `snapshot=NAME` (module docs).
    /// The open clone is read whole too (module `sim_clones`); what either check finds is
    /// reported.
    fn check_snapshots(&mut self) -> Result<(), Violation> {
        let cloned = match self.clone.as_mut() {
            Some(clone) => clone.check_whole(),
            None => Ok(()),
        };
        let checked = if self.snapshots.is_empty() || self.store.is_none() {
            Ok(())
        } else {
            self.world.set_calm(true);
            let checked = (0..self.snapshots.len())
                .map(|at| self.check_snapshot(at))
                .collect::<Result<Vec<()>, Violation>>();
            self.world.set_calm(false);
            self.flush_world_log();
            checked.map(|_| ())
        };
        match (cloned, checked) {
            (Err(mut clone), Err(snapshot)) => {
                clone.detail = format!("{}; and {}", clone.detail, snapshot.detail);
                Err(clone)
            }
            (cloned, checked) => cloned.and(checked),
        }
    }

    fn check_snapshot(&mut self, at: usize) -> Result<(), Violation> {
        let shadow = &self.snapshots[at];
        let mut url = self.url.clone();
        url.snapshot = Some(shadow.name.clone());
        let broken = |what: String| -> Result<(), Violation> {
            if shadow.certain {
                Err(self.violation(
                    property::SNAPSHOTS,
                    format!("snapshot `{}` {what}", shadow.name),
                ))
            } else {
                // A failed request's snapshot (module docs).
                Ok(())
            }
        };
        let reader =
            match LogStore::open_read_only_on(&url, self.world.store(self.instance), self.config) {
                Ok(reader) => reader,
                Err(error) => return broken(format!("does not open: {error}")),
            };
        let mut buffer = vec![0u8; (self.blocks * BLOCK_BYTES) as usize];
        if let Err(error) = reader.read(&mut buffer, 0) {
            return broken(format!("does not read back: {error}"));
        }
        drop(reader);
        let mut tags = Vec::with_capacity(self.blocks as usize);
        for (block, bytes) in buffer.chunks(BLOCK_BYTES as usize).enumerate() {
            let tag = match tag_of(bytes, self.compressible) {
                Ok(tag) => tag,
                Err(reason) => return broken(format!("block {block} {reason}")),
            };
            tags.push(tag);
            if !shadow.allowed[block].contains(&tag) {
                return broken(format!(
                    "block {block} reads {} but held {} when it was taken",
                    describe_tag(tag),
                    describe_tags(&shadow.allowed[block])
                ));
            }
        }
        // A snapshot never changes: once read back, a block a failed write left uncertain
        // must read the same from then on (and so must the clones made of it).
        if shadow.certain {
            self.snapshots[at].allowed = tags.into_iter().map(|tag| vec![tag]).collect();
        }
        self.counts.snapshot_checks += 1;
        Ok(())
    }

    /// The folder `name` of this harness's disk, as the bucket's keys spell it.
    fn own_folder(&self, name: &str) -> String {
        self.url.key(name)
    }

    /// Reads the open clone whole, without faults, and checks every block against its latest
    /// acknowledged data, and that every segment it names (its base's too) exists: run when
    /// its base may have deleted segments (module `sim_clones`).
    fn check_whole(&mut self) -> Result<(), Violation> {
        if self.store.is_none() {
            return Ok(());
        }
        self.check_named_segments_exist()?;
        self.world.set_calm(true);
        let image = self.read_all("the open disk");
        self.world.set_calm(false);
        let image = image?;
        for (block, tag) in image.iter().enumerate() {
            let allowed = &self.now[block];
            if !allowed.contains(tag) {
                return Err(self.violation(
                    property::CLONES,
                    format!(
                        "read whole after its base's collection or reopen, block {block} reads {} but the latest acknowledged data is {}",
                        describe_tag(*tag),
                        describe_tags(allowed)
                    ),
                ));
            }
        }
        self.counts.clone_checks += 1;
        Ok(())
    }

    /// Makes the clone of this disk's first certain snapshot, when there is one and no clone
    /// yet, and opens it (module `sim_clones`). A creation that fails or hangs (its server
    /// crashes) is abandoned with its prefix, whatever of it landed; the last attempt runs
    /// without faults, so nearly every seed that takes a snapshot gets a clone.
    fn make_clone(&mut self) -> Result<(), Violation> {
        if self.clone.is_some() || self.clone_attempts >= CLONE_ATTEMPTS_MAX || self.store.is_none()
        {
            return Ok(());
        }
        let Some(at) = self.snapshots.iter().position(|shadow| shadow.certain) else {
            return Ok(());
        };
        // Read back first, so its content is fixed before the clone's is compared with it.
        self.world.set_calm(true);
        let checked = self.check_snapshot(at);
        self.world.set_calm(false);
        checked?;
        self.clone_attempts += 1;
        let calm = self.clone_attempts == CLONE_ATTEMPTS_MAX;
        let name = self.snapshots[at].name.clone();
        let mut text = format!(
            "s3://sim/clone{}-{}?layout=log",
            self.seed, self.clone_attempts
        );
        if let Some(key) = &self.url.key_file {
            text.push_str(&format!("&key-file={}", key.display()));
        }
        let url = S3Url::parse(&text).expect("the harness's clone URL parses");
        let mut clone = Harness {
            seed: self.seed,
            notes: Notes::new(RECENT_STEPS, self.notes.tracing()),
            label: "clone",
            rng: StdRng::seed_from_u64(mix(self.seed ^ 0xc10e) ^ u64::from(self.clone_attempts)),
            world: self.world.clone(),
            url,
            config: self.config,
            compressible: self.compressible,
            blocks: self.blocks,
            // Its servers' instances apart from the base's.
            instance: CLONE_INSTANCES * u64::from(self.clone_attempts),
            store: None,
            base: Vec::new(),
            history: Vec::new(),
            flushed: 0,
            now: Vec::new(),
            // Its writes' tags apart from the base's.
            next_write: CLONE_WRITES,
            step: self.step,
            counts: LogCheckCounts::default(),
            snapshots: Vec::new(),
            clone: None,
            clone_attempts: CLONE_ATTEMPTS_MAX,
            first_image: Some(self.snapshots[at].allowed.clone()),
        };
        clone.instance += 1;
        clone.note({
            format!(
                "making the clone of snapshot `{name}` as instance {}",
                clone.instance
            )
        });
        self.world.set_calm(calm);
        let answer = clone.run(Step::Clone(Box::new(self.url.clone()), name));
        self.world.set_calm(false);
        match answer? {
            Some(Answer::Cloned(Ok(()))) => {}
            Some(Answer::Cloned(Err(error))) => {
                clone.note(format!("the clone's creation failed: {error}; abandoned"));
                self.world.crash(clone.instance);
                return Ok(());
            }
            Some(_) => unreachable!("a clone's creation answers Cloned"),
            None => {
                clone.note("the clone's creation hung; abandoned".to_string());
                return Ok(());
            }
        }
        self.world.crash(clone.instance);
        self.counts.clones_made += 1;
        clone.crash_and_reopen()?;
        self.step = clone.step;
        self.clone = Some(Box::new(clone));
        Ok(())
    }

    /// Drops a store the harness is done with, counting what it pruned.
    fn retire(&mut self, store: Arc<LogStore>) {
        self.counts.epochs_pruned += store.epochs_pruned();
        drop(store);
    }

    /// Closes the store cleanly and opens the disk again, which must then hold every
    /// acknowledged write; a close that fails or hangs is a crash.
    fn close_and_reopen(&mut self) -> Result<bool, Violation> {
        let store = self.store.take().expect("a close has a store");
        self.note(format!("clean close of instance {}", self.instance));
        let Some(answer) = self.run(Step::Close(store))? else {
            return self.stuck(Vec::new());
        };
        let Answer::Closed(outcome, pruned) = answer else {
            unreachable!("a close answers Closed")
        };
        self.counts.epochs_pruned += pruned;
        // The server's process ends: whatever it still sent is refused.
        self.world.crash(self.instance);
        self.flush_world_log();
        match outcome {
            Ok(()) => {
                self.note("closed".to_string());
                self.counts.clean_closes += 1;
                self.flushed = self.history.len();
                if self.rng.gen_bool(0.5) {
                    self.lose_newest_checkpoint();
                }
                self.crash_and_reopen()?;
                Ok(true)
            }
            Err(error) => {
                self.note(format!("close failed: {error}; a crash"));
                self.counts.crashes += 1;
                Ok(false)
            }
        }
    }

    /// Deletes the newest checkpoint, or flips one of its bytes (module docs), unless it may be
    /// an open's checkpoint past a gap: one that covers no segment of its own epoch (a
    /// checkpoint a server writes at a FLUSH or close covers the segment it sealed, which
    /// the kept predecessor keeps).
    fn lose_newest_checkpoint(&mut self) {
        let objects = self.world.objects();
        let parse = |key: &str, folder: &str| {
            let name = key.split_once(folder)?.1;
            let (number, epoch) = name.split_once('-')?;
            Some((
                u64::from_str_radix(number, 16).ok()?,
                u64::from_str_radix(epoch, 16).ok()?,
            ))
        };
        let checkpoints = self.own_folder("log/checkpoints/");
        let segments = self.own_folder("log/segments/");
        let Some((key, (through, epoch))) = objects
            .iter()
            .filter(|(key, _)| key.starts_with(&checkpoints))
            .filter_map(|(key, _)| Some((key, parse(key, "/log/checkpoints/")?)))
            .max_by_key(|&(_, name)| name)
        else {
            return;
        };
        let covers_own = objects.iter().any(|(key, _)| {
            key.starts_with(&segments)
                && parse(key, "/log/segments/")
                    .is_some_and(|(sequence, owner)| owner == epoch && sequence <= through)
        });
        if !covers_own {
            return;
        }
        let flip_at = self.rng.gen_bool(0.5).then(|| self.rng.gen_range(0..4096));
        self.note(format!(
            "losing the newest checkpoint `{key}` (flip at {flip_at:?})"
        ));
        self.world.lose(key, flip_at);
        self.counts.checkpoints_lost += 1;
    }

    /// Reads the whole disk without faults and finds the prefix of history it equals.
    fn verify_reopened(&mut self) -> Result<(), Violation> {
        self.world.set_calm(true);
        let image = self.read_all("the reopened disk");
        self.world.set_calm(false);
        let image = image?;
        if let Some(expected) = self.first_image.take() {
            // A new clone: its snapshot's content, block by block.
            if let Some(block) = (0..image.len()).find(|&b| !expected[b].contains(&image[b])) {
                return Err(self.violation(
                    property::CLONES,
                    format!(
                        "at its first open, block {block} reads {} but its snapshot holds {}",
                        describe_tag(image[block]),
                        describe_tags(&expected[block])
                    ),
                ));
            }
            self.note("opened: the clone reads its snapshot".to_string());
            self.counts.clone_checks += 1;
            self.base = image;
            self.now = self.base.iter().map(|&tag| vec![tag]).collect();
            return Ok(());
        }
        let found = find_prefix(&self.base, &self.history, self.flushed, &image);
        match found {
            Some(length) => {
                if self.label == "clone" {
                    self.counts.clone_checks += 1;
                }
                self.note({
                    format!(
                        "reopened: the disk is the first {length} of {} changes since the last open ({} flushed)",
                        self.history.len(),
                        self.flushed
                    )
                });
                self.base = image;
                self.now = self.base.iter().map(|&tag| vec![tag]).collect();
                self.history.clear();
                self.flushed = 0;
                Ok(())
            }
            None => {
                Err(self.violation(property::CRASH_CONSISTENCY, self.explain_no_prefix(&image)))
            }
        }
    }

    /// Why no prefix fits: the first block that differs from the flushed prefix's image, and
    /// from the whole history's.
    fn explain_no_prefix(&self, image: &[u64]) -> String {
        let mut state: Allowed = self.base.iter().map(|&tag| vec![tag]).collect();
        for change in &self.history[..self.flushed] {
            apply(&mut state, change);
        }
        let flushed_block = (0..image.len()).find(|&b| !state[b].contains(&image[b]));
        let mut detail = String::new();
        if let Some(block) = flushed_block {
            detail = format!(
                "block {block} reads {} but the {} flushed changes leave {}",
                describe_tag(image[block]),
                self.flushed,
                describe_tags(&state[block])
            );
        }
        format!(
            "after reopening (instance {}), the disk is no prefix of the {} changes acknowledged since the last open that includes the {} a FLUSH acknowledged{}{detail}",
            self.instance,
            self.history.len(),
            self.flushed,
            if detail.is_empty() { "" } else { ": " }
        )
    }

    fn read_all(&mut self, what: &str) -> Result<Vec<u64>, Violation> {
        let store = self.store.clone().expect("reopened");
        let mut tags = Vec::with_capacity(self.blocks as usize);
        let chunk_blocks = 16u64;
        let mut block = 0;
        while block < self.blocks {
            let count = chunk_blocks.min(self.blocks - block);
            let mut buffer = vec![0u8; (count * BLOCK_BYTES) as usize];
            store
                .read(&mut buffer, block * BLOCK_BYTES)
                .map_err(|error| {
                    self.violation(
                        property::READS,
                        format!("reading {what} at block {block} (no faults): {error}"),
                    )
                })?;
            for (index, data) in buffer.chunks(BLOCK_BYTES as usize).enumerate() {
                tags.push(tag_of(data, self.compressible).map_err(|reason| {
                    self.violation(
                        property::READS,
                        format!("reading {what}, block {} {reason}", block + index as u64),
                    )
                })?);
            }
            block += count;
        }
        Ok(tags)
    }

    fn check_read(&self, offset: u64, data: &[u8]) -> Result<(), Violation> {
        match misread(&self.now, offset, data, self.compressible, "") {
            Some(detail) => Err(self.violation(property::READS, detail)),
            None => Ok(()),
        }
    }

    /// One step of the workload; false when the server crashed.
    fn one_step(&mut self) -> Result<bool, Violation> {
        self.step += 1;
        self.counts.steps += 1;
        self.world.land_due(self.step);
        self.flush_world_log();
        let choice = self.rng.gen_range(0..100);
        let alive = if choice < 50 {
            self.write_step()?
        } else if choice < 60 {
            self.zeroes_step()?
        } else if choice < 75 {
            self.read_step()?
        } else if (86..90).contains(&choice) && self.snapshots.len() < SNAPSHOTS_MAX {
            self.snapshot_step()?
        } else if choice < 90 {
            self.flush_step()?
        } else if choice >= 97 {
            return self.close_and_reopen();
        } else {
            self.collect_step()?
        };
        if !alive {
            return Ok(false);
        }
        self.check_named_segments_exist()?;
        Ok(true)
    }

    /// Writes one to three ranges. False when the server crashed under it.
    fn write_step(&mut self) -> Result<bool, Violation> {
        let count = if self.rng.gen_bool(0.2) { 3 } else { 1 };
        let (writes, changes) = self.random_writes(count);
        let Some(answer) = self.run(Step::Write(writes))? else {
            return self.stuck(changes);
        };
        let Answer::Writes(outcomes) = answer else {
            unreachable!("writes answer Writes")
        };
        for (change, outcome) in changes.into_iter().zip(outcomes) {
            self.record(change, &outcome);
        }
        Ok(true)
    }

    /// Zeroes a range. False when the server crashed under it.
    fn zeroes_step(&mut self) -> Result<bool, Violation> {
        let blocks = self.random_blocks();
        let change = Change {
            blocks: blocks.clone(),
            write: None,
            acknowledged: false,
        };
        let step = Step::Zeroes(
            blocks.start * BLOCK_BYTES,
            (blocks.end - blocks.start) * BLOCK_BYTES,
        );
        let Some(answer) = self.run(step)? else {
            return self.stuck(vec![change]);
        };
        let Answer::Done(outcome) = answer else {
            unreachable!("zeroes answer Done")
        };
        self.record(change, &outcome);
        Ok(true)
    }

    /// Reads a batch of runs and checks them. False when the server crashed under it.
    fn read_step(&mut self) -> Result<bool, Violation> {
        // A batch of one to three reads: a range cut at block boundaries into runs
        // (as a read-ahead window's runs, which may share GETs), in a seeded order.
        let blocks = self.random_blocks();
        let mut cuts = vec![blocks.start, blocks.end];
        for _ in 0..self.rng.gen_range(0..=2) {
            cuts.push(self.rng.gen_range(blocks.clone()));
        }
        cuts.sort_unstable();
        cuts.dedup();
        let mut runs: Vec<Range<u64>> = cuts.windows(2).map(|cut| cut[0]..cut[1]).collect();
        if self.rng.gen_bool(0.5) {
            runs.reverse();
        }
        let reads = runs
            .iter()
            .map(|run| {
                (
                    run.start * BLOCK_BYTES,
                    ((run.end - run.start) * BLOCK_BYTES) as usize,
                )
            })
            .collect();
        let Some(answer) = self.run(Step::Read(reads))? else {
            return self.stuck(Vec::new());
        };
        let Answer::Read(outcomes) = answer else {
            unreachable!("a read answers Read")
        };
        assert_eq!(
            outcomes.len(),
            runs.len(),
            "one outcome per read of a batch"
        );
        for (run, outcome) in runs.into_iter().zip(outcomes) {
            match outcome {
                Ok(data) => {
                    self.note(format!("read blocks {run:?}"));
                    self.check_read(run.start * BLOCK_BYTES, &data)?;
                }
                Err(error) => self.note(format!("read blocks {run:?} failed: {error}")),
            }
        }
        Ok(true)
    }

    /// Takes a snapshot. False when the server crashed under it.
    fn snapshot_step(&mut self) -> Result<bool, Violation> {
        let covers = self.history.len();
        let name = format!("s{}", self.snapshots.len() + 1);
        let shadow = Shadow {
            name: name.clone(),
            allowed: self.now.clone(),
            certain: false,
        };
        let Some(answer) = self.run(Step::Snapshot(name))? else {
            self.snapshots.push(shadow);
            return self.stuck(Vec::new());
        };
        let Answer::Snapshot(outcome) = answer else {
            unreachable!("a snapshot answers Snapshot")
        };
        match outcome {
            Ok(taken) => {
                self.note(format!("snapshot `{}` taken ({taken:?})", shadow.name));
                self.counts.snapshots_taken += 1;
                self.snapshots.push(Shadow {
                    certain: true,
                    ..shadow
                });
                // Every segment it names is durable: it is a FLUSH too.
                self.flushed = covers;
            }
            Err(error) => {
                self.note(format!("snapshot `{}` failed: {error}", shadow.name));
                self.snapshots.push(shadow);
            }
        }
        Ok(true)
    }

    /// Flushes. False when the server crashed under it.
    fn flush_step(&mut self) -> Result<bool, Violation> {
        let covers = self.history.len();
        let Some(answer) = self.run(Step::Flush)? else {
            return self.stuck(Vec::new());
        };
        let Answer::Done(outcome) = answer else {
            unreachable!("a flush answers Done")
        };
        match outcome {
            Ok(()) => {
                self.note(format!("flush acknowledged ({covers} changes)"));
                self.flushed = covers;
            }
            Err(error) => self.note(format!("flush failed: {error}")),
        }
        Ok(true)
    }

    /// Runs a collection round with writes landing in the middle of it, then checks the collector's bookkeeping and the snapshots. False when the server crashed under it.
    fn collect_step(&mut self) -> Result<bool, Violation> {
        let threshold = self.rng.gen_range(0.2..0.9);
        // Drawn as an i32, as every seed so far drew it: the width decides how much of the
        // stream the draw takes, and so every later draw of the seed.
        let count: i32 = self.rng.gen_range(0..3);
        let count = usize::try_from(count).expect("0 to 2 writes");
        let (writes, changes) = self.random_writes(count);
        self.counts.gc_rounds += 1;
        let Some(answer) = self.run(Step::Collect(threshold, writes))? else {
            return self.stuck(changes);
        };
        let Answer::Collected(report, outcomes) = answer else {
            unreachable!("a round answers Collected")
        };
        // A round that failed before its reads wrote nothing in between.
        let mut outcomes = outcomes.into_iter();
        for change in changes {
            match outcomes.next() {
                Some(outcome) => self.record(change, &outcome),
                None => self.note("a write of the round was never made".to_string()),
            }
        }
        match report {
            Ok(report) => self.note(format!("collection round: {report:?}")),
            Err(error) => self.note(format!("collection round failed: {error}")),
        }
        if let Some(store) = &self.store {
            store.check_live_bytes().map_err(|reason| {
                self.violation(
                    property::LIVE_BYTES,
                    format!("after a collection round, {reason}"),
                )
            })?;
        }
        self.check_snapshots()?;
        Ok(true)
    }

    /// Every durable segment the open server's index names is in the bucket: the collector
    /// (or an open's cleanup, or a late DELETE) never deleted what a read still needs.
    fn check_named_segments_exist(&self) -> Result<(), Violation> {
        let Some(store) = &self.store else {
            return Ok(());
        };
        // Named first, listed after: an upload that ends in between adds an object.
        let named = store.durable_named_segment_keys();
        let present: std::collections::BTreeSet<String> = self
            .world
            .objects()
            .into_iter()
            .map(|(key, _)| key)
            .collect();
        match named.into_iter().find(|key| !present.contains(key))
        {
            Some(key) => Err(self.violation(
                property::SEGMENTS_EXIST,
                format!(
                    "segment `{key}` named by the index does not exist (deleted while the index named it)"
                ),
            )),
            None => Ok(()),
        }
    }

    /// A step got stuck and the server crashed under it: its writes were never acknowledged
    /// (each may have reached the log or not).
    fn stuck(&mut self, changes: Vec<Change>) -> Result<bool, Violation> {
        for change in changes {
            apply(&mut self.now, &change);
            self.history.push(change);
        }
        self.counts.crashes += 1;
        // The crashed store is dropped by the reopen (its requests are refused already).
        if let Some(store) = self.store.take() {
            self.retire(store);
            self.flush_world_log();
        }
        Ok(false)
    }
}

/// Checks one seed (see the module docs); `trace` prints every step to standard error.
pub fn check_log_seed(seed: u64, trace: bool) -> LogCheckOutcome {
    // The crashed servers' stores log their failures; only a trace wants them.
    let _quiet = (!trace)
        .then(|| tracing::subscriber::set_default(tracing::subscriber::NoSubscriber::default()));
    let mut rng = StdRng::seed_from_u64(seed);
    let fault_maxima = FaultRates {
        fail_ppm: 40_000,
        lost_ppm: 20_000,
        hang_ppm: 30_000,
        reset_ppm: 80_000,
        applied_then_fail_ppm: 80_000,
    };
    let (world, faults, late) = draw_world(&mut rng, seed, 4, fault_maxima, 1..60);
    let DrawnDisk {
        blocks,
        compress,
        encrypt,
        url,
    } = draw_disk(&mut rng, &format!("disk{seed}"), 16..=128, 0.5);
    let config = draw_config(&mut rng, &[8 << 10, 16 << 10, 32 << 10, 64 << 10]);
    let lives = rng.gen_range(2..=5);
    let mut harness = Harness {
        seed,
        notes: Notes::new(RECENT_STEPS, trace),
        label: "disk",
        compressible: rng.gen_bool(0.5),
        rng,
        world: world.clone(),
        url,
        config,
        blocks,
        instance: 0,
        store: None,
        base: vec![0; blocks as usize],
        history: Vec::new(),
        flushed: 0,
        now: vec![vec![0]; blocks as usize],
        next_write: 0,
        step: 0,
        counts: LogCheckCounts::default(),
        snapshots: Vec::new(),
        clone: None,
        clone_attempts: 0,
        first_image: None,
    };
    // Whether the clone or the base takes the next step (module `sim_clones`), apart from
    // the base's own draws.
    let mut turns = StdRng::seed_from_u64(mix(seed ^ 0x7e57_c10e));
    harness.note({
        format!(
            "{} blocks, {config:?}, compress {compress}, encrypt {encrypt}, faults {faults:?}, late {late:?}, {lives} lives",
            harness.blocks
        )
    });
    let result = (|| -> Result<(), Violation> {
        harness.crash_and_reopen()?;
        for _ in 0..lives {
            let steps = harness.rng.gen_range(5..120);
            for _ in 0..steps {
                if harness.clone.is_some() && turns.gen_bool(0.5) {
                    clone_step(&mut harness)?;
                    continue;
                }
                if !harness.one_step()? {
                    break;
                }
                harness.make_clone()?;
            }
            harness.crash_and_reopen()?;
            // The clone's server crashes with the base's half the time.
            if let Some(clone) = harness.clone.as_mut() {
                if turns.gen_bool(0.5) {
                    clone.step = harness.step;
                    clone.crash_and_reopen()?;
                }
            }
        }
        Ok(())
    })();
    if let Some(mut clone) = harness.clone.take() {
        world.crash(clone.instance);
        if let Some(store) = clone.store.take() {
            clone.retire(store);
        }
        // The clone's harness counts no store faults, landings or clones of its own: those
        // are the world's and the base's.
        harness.counts.add(&clone.counts);
        harness.counts.clone_steps += clone.counts.steps;
    }
    let counts = world.counts();
    harness.counts.faults =
        counts.failed + counts.lost + counts.hung + counts.reset + counts.applied_then_failed;
    harness.counts.late_landings = counts.landed_at_crash + counts.landed_late;
    // The last server is abandoned as a crash would leave it.
    world.crash(harness.instance);
    if let Some(store) = harness.store.take() {
        harness.retire(store);
    }
    LogCheckOutcome {
        counts: harness.counts,
        violation: result.err(),
    }
}

/// One step of the base's clone (its step counter shared with the base's, which lands the
/// late requests), and its crash and reopen when the step crashed it.
fn clone_step(harness: &mut Harness) -> Result<(), Violation> {
    let clone = harness.clone.as_mut().expect("a clone");
    clone.step = harness.step;
    let alive = clone.one_step()?;
    if !alive {
        clone.crash_and_reopen()?;
    }
    harness.step = clone.step;
    Ok(())
}

/// What checking a range of seeds found.
pub type LogCheckSummary = bufcache_check::Sweep<LogCheckCounts>;

/// Checks seeds `first..first + count`, calling `each` after every seed.
pub fn check_log_seeds(
    first: u64,
    count: u64,
    trace: bool,
    each: impl FnMut(u64, &LogCheckOutcome),
) -> LogCheckSummary {
    bufcache_check::check_seeds(first, count, |seed| check_log_seed(seed, trace), each)
}
