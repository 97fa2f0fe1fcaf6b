//! Garbage collection of the log layout: rewriting segments that are mostly dead and
//! deleting the ones nothing needs.
//!
//! A round (one at a time, [`Core::collect_garbage`]):
//! 1. marks every durable segment without live bytes as doomed, with the log position a
//!    checkpoint must cover first (the open segment, or the last sealed one when the open
//!    one is empty: the last live byte went at or before it), and deletes the doomed
//!    segments the newest durable checkpoint covers that far and no kept checkpoint needs
//!    (module `checkpoint`, `Kept`: the newest's predecessor, which an open falls back to);
//! 2. picks durable segments whose live fraction (live bytes ÷ object bytes) is below the
//!    threshold, and beyond them, while the stored segment bytes exceed
//!    `gc_stored_ratio_max` × the live bytes by more than a segment, the least live ones of
//!    any fraction; least live first, as long as their object bytes fit in `gc_bytes_max`;
//! 3. reads their live extents with ranged GETs (at most `gc_requests_in_flight_max` at
//!    once), extents less than `GC_READ_GAP_BYTES_MAX` apart in one GET;
//! 4. appends them to the log as copies of their source (see `segment.rs`): each piece
//!    applies only where the index still maps it to the source, so a client write or trim
//!    that landed after the read wins, both now and when the log is replayed after a crash.
//!    It waits while half the upload slots are taken, so client flushes keep their share;
//! 5. flushes and writes a checkpoint, after which the sources (now without live bytes) are
//!    doomed; then one more checkpoint (over an empty segment when nothing else was
//!    written), which retires the kept checkpoint that names them; once both are durable
//!    the sources are deleted.
//!
//! Why a crash at any step is safe: recovery reads the newest checkpoint and replays the
//! segments after it. A source is deleted only once a durable checkpoint, taken after its
//! last live byte went, covers the log position where that happened: that checkpoint does
//! not name the source, and no segment after it is replayed over the source. A crash before
//! that checkpoint leaves the sources in place, and replay applies the copies under the same
//! rule as live. A crash between the checkpoint and the deletes leaves sources that the
//! checkpoint covers but does not name: opening deletes them.

use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;

use bytes::Bytes;
use futures::stream::{self, StreamExt};
use object_store::path::Path as ObjectPath;
use object_store::ObjectStore;

use std::time::Duration;

use super::{checkpoint, segment, Core, Mapping};
use crate::error::{chain, StoreError};
use crate::store::get_range_in;

/// Live extents of one segment at most this far apart are fetched by one ranged GET.
const GC_READ_GAP_BYTES_MAX: u64 = 256 << 10;

/// What garbage collection did: in one round, or in total since the disk was opened.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Segments whose live extents were read to be rewritten.
    pub segments_rewritten: u64,
    /// Bytes read from those segments (their live bytes when the round looked).
    pub bytes_read: u64,
    /// Segments deleted.
    pub segments_deleted: u64,
    /// Object bytes of the deleted segments.
    pub bytes_deleted: u64,
    /// Collection rounds (`collect_garbage` calls that ended without an error).
    pub rounds: u64,
}

impl GcReport {
    /// Adds `other`'s counts to these.
    pub fn add(&mut self, other: GcReport) {
        self.segments_rewritten += other.segments_rewritten;
        self.bytes_read += other.bytes_read;
        self.segments_deleted += other.segments_deleted;
        self.bytes_deleted += other.bytes_deleted;
        self.rounds += other.rounds;
    }
}

/// One live extent to rewrite: `mapping.length` bytes at disk offset `disk_offset`, at
/// `mapping.object_offset` of segment `mapping.segment`.
type Live = (u64, Mapping);

/// Live bytes read: (disk offset, source segment, bytes).
type LiveRead = (u64, u64, Bytes);

/// One ranged GET of a source: (segment, object range, pieces as (disk offset, where its
/// fetch range starts in the fetched bytes, that range's length, index address, length)).
type Run = (u64, Range<u64>, Vec<(u64, u64, u64, u64, u64)>);

impl Core {
    /// One collection round (see the module docs); `between` is called after the reads and
    /// before the appends.
    pub(super) fn collect_garbage(
        &self,
        threshold: f64,
        between: &mut dyn FnMut(),
    ) -> Result<GcReport, StoreError> {
        self.check_writable()?;
        let _round = self
            .collector
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mut report = self.delete_dead_segments_locked()?;
        let live = self.pick_sources(threshold);
        if !live.is_empty() {
            let mut sources: Vec<u64> = live.iter().map(|(_, mapping)| mapping.segment).collect();
            sources.dedup();
            let read = self.read_live(live)?;
            between();
            let bytes_read: u64 = read.iter().map(|(_, _, data)| data.len() as u64).sum();
            self.append_copies(read)?;
            report.add(GcReport {
                segments_rewritten: sources.len() as u64,
                bytes_read,
                ..GcReport::default()
            });
        }
        // A checkpoint lets the doomed segments go: after a rewrite, or once the ones
        // waiting for it hold a segment's worth of bytes (a checkpoint costs a PUT of the
        // whole index, not worth it for less). Those the kept checkpoint needs wait for it
        // too: the next checkpoint retires it.
        let waiting_bytes: u64 = {
            let state = self.shared.lock();
            state
                .stored
                .iter()
                .filter(|&(sequence, _)| {
                    state.index.live_bytes(*sequence) == 0
                        && (state
                            .doomed
                            .get(sequence)
                            .is_none_or(|&position| position > state.checkpoint_through)
                            || checkpoint::kept_need(&state.checkpoints_kept, *sequence))
                })
                .map(|(_, &bytes)| bytes)
                .sum()
        };
        // After a rewrite, the checkpoint covering the copies and one more: the kept
        // checkpoint (which names the sources) then retires and the sources go this round.
        if report.segments_rewritten > 0 {
            self.flush_and_checkpoint(true)?;
            self.checkpoint_forward()?;
            report.add(self.delete_dead_segments_locked()?);
        } else if waiting_bytes >= self.config.segment_bytes_max {
            self.checkpoint_forward()?;
            report.add(self.delete_dead_segments_locked()?);
        }
        report.rounds = 1;
        self.shared.lock().gc_totals.add(report);
        Ok(report)
    }

    /// At a clean close, after its checkpoint: when a segment without live bytes that holds
    /// extents waits for the kept checkpoint alone, one more checkpoint
    /// ([`Core::checkpoint_forward`]) retires it, so a clean close (and `disk gc`, which
    /// ends with one) leaves no such garbage. (The empty segment a forward checkpoint covers
    /// waits for the next checkpoint; it does not call for one.)
    pub(super) fn release_kept(&self) -> Result<(), StoreError> {
        let empty_bytes = segment::HEADER_BYTES + self.shared.sealer.object_tag_bytes();
        let waiting = {
            let state = self.shared.lock();
            state.stored.iter().any(|(&sequence, &bytes)| {
                bytes > empty_bytes
                    && state.index.live_bytes(sequence) == 0
                    && checkpoint::kept_need(&state.checkpoints_kept, sequence)
            })
        };
        if waiting {
            self.checkpoint_forward()?;
        }
        Ok(())
    }

    /// Writes a checkpoint even when nothing was sealed since the newest one, sealing an
    /// empty segment (a header and no extent) for it to cover: the kept checkpoint then
    /// retires, and the segments only it needed can go. On a disk nobody writes to, this is
    /// what frees the sources of the last rewrite (an empty segment's PUT and a checkpoint).
    fn checkpoint_forward(&self) -> Result<(), StoreError> {
        let state = self.shared.lock();
        if state.open.is_empty() && state.open.sequence - 1 <= state.checkpoint_through {
            let sequence = state.open.sequence;
            drop(self.seal(state, sequence)?);
        } else {
            drop(state);
        }
        self.flush_and_checkpoint(true)
    }

    /// Dooms the segments without live bytes and deletes those a durable checkpoint allows
    /// (step 1 of the module docs), outside a round.
    pub(super) fn delete_dead_segments(&self) -> Result<(), StoreError> {
        let _round = self
            .collector
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let report = self.delete_dead_segments_locked()?;
        self.shared.lock().gc_totals.add(report);
        Ok(())
    }

    fn delete_dead_segments_locked(&self) -> Result<GcReport, StoreError> {
        let deletable: Vec<(u64, u64)> = {
            let mut state = self.shared.lock();
            let state = &mut *state;
            let position = if state.open.is_empty() {
                state.open.sequence - 1
            } else {
                state.open.sequence
            };
            // A segment a snapshot names is the snapshot's once the index names none of it:
            // it leaves `stored` (the disk's data) and is never doomed (module `snapshot`).
            // The planted defect (tests/log_sim_check.rs): pins are ignored.
            let pinned_dead: Vec<u64> = state
                .stored
                .keys()
                .copied()
                .filter(|sequence| {
                    state.index.live_bytes(*sequence) == 0
                        && state.pinned.contains(sequence)
                        && !cfg!(feature = "planted-snapshot-defect")
                })
                .collect();
            for sequence in pinned_dead {
                let bytes = state.stored.remove(&sequence).expect("listed just now");
                state.pinned_only.insert(sequence, bytes);
            }
            for &sequence in state.stored.keys() {
                if state.index.live_bytes(sequence) == 0 {
                    state.doomed.entry(sequence).or_insert(position);
                }
            }
            // Nor one a kept checkpoint needs: an open falls back to it when the newest is
            // lost (module `checkpoint`, `Kept`).
            let deletable: Vec<(u64, u64)> = state
                .doomed
                .iter()
                .filter(|&(_, &position)| position <= state.checkpoint_through)
                .filter(|&(&sequence, _)| !checkpoint::kept_need(&state.checkpoints_kept, sequence))
                .map(|(&sequence, _)| (sequence, state.stored[&sequence]))
                .collect();
            // Before any is sent (see `State::segment_deletes_sent`).
            state.segment_deletes_sent += deletable.len() as u64;
            deletable
        };
        let mut report = GcReport::default();
        if deletable.is_empty() {
            return Ok(report);
        }
        let outcomes: Vec<(u64, u64, Result<(), StoreError>)> = self.runtime.block_on(
            stream::iter(deletable.into_iter().map(|(sequence, bytes)| {
                let store = self.shared.store.clone();
                let key = self.shared.segment_key(sequence);
                async move {
                    let outcome =
                        store
                            .delete(&ObjectPath::from(key.as_str()))
                            .await
                            .map_err(|error| StoreError::Request {
                                operation: "DELETE",
                                key,
                                message: chain(&error),
                            });
                    (sequence, bytes, outcome)
                }
            }))
            .buffer_unordered(self.config.gc_requests_in_flight_max)
            .collect(),
        );
        let mut first_error = None;
        let mut state = self.shared.lock();
        for (sequence, bytes, outcome) in outcomes {
            match outcome {
                Ok(()) => {
                    state.doomed.remove(&sequence);
                    state.stored.remove(&sequence);
                    report.segments_deleted += 1;
                    report.bytes_deleted += bytes;
                }
                // Kept doomed: the next round tries again (and opening deletes it too).
                Err(error) => {
                    first_error.get_or_insert(error);
                }
            }
        }
        drop(state);
        match first_error {
            Some(error) => Err(error),
            None => Ok(report),
        }
    }

    /// The live extents of the segments to rewrite (step 2 of the module docs), in source
    /// and then object order.
    fn pick_sources(&self, threshold: f64) -> Vec<Live> {
        let state = self.shared.lock();
        // (live fraction, sequence, live bytes, object bytes) of every segment that could go.
        let mut candidates: Vec<(f64, u64, u64, u64)> = state
            .stored
            .iter()
            .filter(|(sequence, _)| !state.doomed.contains_key(sequence))
            // Rewriting a pinned segment frees nothing while its snapshot exists.
            .filter(|(sequence, _)| {
                !state.pinned.contains(sequence) || cfg!(feature = "planted-snapshot-defect")
            })
            .filter_map(|(&sequence, &bytes)| {
                let live = state.index.live_bytes(sequence);
                let fraction = live as f64 / bytes.max(1) as f64;
                (live > 0).then_some((fraction, sequence, live, bytes))
            })
            .collect();
        candidates.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        // The space rule: while the stored bytes exceed `gc_stored_ratio_max` × the live ones
        // by more than a segment (less is the open segment's and headers' share, not worth a
        // rewrite), the least live segments go too, whatever their fraction.
        let live_total: u64 = candidates.iter().map(|&(_, _, live, _)| live).sum();
        let stored_total: u64 = candidates.iter().map(|&(_, _, _, bytes)| bytes).sum();
        let mut excess = stored_total as f64
            - self.config.gc_stored_ratio_max * live_total as f64
            - self.config.segment_bytes_max as f64;
        let mut chosen = std::collections::BTreeSet::new();
        let mut budget = self.config.gc_bytes_max;
        for (fraction, sequence, live, bytes) in candidates {
            if fraction >= threshold && excess <= 0.0 {
                break;
            }
            // The object's bytes bound what reading its live extents downloads (gaps are
            // read through).
            if bytes <= budget {
                budget -= bytes;
                excess -= (bytes - live) as f64;
                chosen.insert(sequence);
            }
        }
        if chosen.is_empty() {
            return Vec::new();
        }
        let mut live: Vec<Live> = state
            .index
            .iter()
            .filter(|(_, mapping)| chosen.contains(&mapping.segment))
            .collect();
        live.sort_by_key(|(_, mapping)| {
            let fetch = segment::fetch_range(mapping.object_offset, mapping.length);
            (mapping.segment, fetch.start)
        });
        live
    }

    /// Reads the live extents (step 3 of the module docs): (disk offset, source, bytes).
    fn read_live(&self, live: Vec<Live>) -> Result<Vec<LiveRead>, StoreError> {
        // Extents of one object less than GC_READ_GAP_BYTES_MAX apart become one GET (the
        // dead bytes between them are downloaded and dropped: one request instead of one per
        // extent, which for scattered small writes is what bounds the collector's speed).
        let mut requests: Vec<Run> = Vec::new();
        // A sealed extent is fetched whole (its frame), once for all its live pieces.
        for (disk_offset, mapping) in live {
            let range = segment::fetch_range(mapping.object_offset, mapping.length);
            let part = |at: u64| {
                (
                    disk_offset,
                    at,
                    range.end - range.start,
                    mapping.object_offset,
                    mapping.length,
                )
            };
            if let Some((segment, run, parts)) = requests.last_mut() {
                if *segment == mapping.segment
                    && range.start.saturating_sub(run.end) <= GC_READ_GAP_BYTES_MAX
                {
                    parts.push(part(range.start - run.start));
                    run.end = run.end.max(range.end);
                    continue;
                }
            }
            requests.push((mapping.segment, range.clone(), vec![part(0)]));
        }
        let fetched: Vec<Result<Vec<LiveRead>, StoreError>> = self.runtime.block_on(
            stream::iter(requests.into_iter().map(|(segment, range, parts)| {
                let store = self.shared.store.clone();
                let key = self.shared.segment_key(segment);
                let sealer = self.shared.sealer.clone();
                async move {
                    let data = get_range_in(&*store, &key, range)
                        .await?
                        .ok_or_else(|| StoreError::MissingSegment { key: key.clone() })?;
                    parts
                        .into_iter()
                        .map(|(disk_offset, at, fetched, address, length)| {
                            let fetched = data.slice(at as usize..(at + fetched) as usize);
                            // Checked blocks and sealed frames are checked here as on
                            // any read: a damaged source is an error, never copied.
                            let bytes = match segment::locate(address) {
                                segment::Location::Plain { .. } => fetched.slice(..length as usize),
                                segment::Location::Checked { .. }
                                | segment::Location::Sealed { .. } => {
                                    let mut bytes = vec![0u8; length as usize];
                                    segment::extract(
                                        &sealer,
                                        segment,
                                        &fetched,
                                        address,
                                        disk_offset,
                                        &mut bytes,
                                    )
                                    .map_err(|reason| {
                                        StoreError::BadData {
                                            key: key.clone(),
                                            reason: Box::new(reason),
                                        }
                                    })?;
                                    Bytes::from(bytes)
                                }
                            };
                            Ok((disk_offset, segment, bytes))
                        })
                        .collect()
                }
            }))
            .buffer_unordered(self.config.gc_requests_in_flight_max)
            .collect(),
        );
        let mut read = Vec::new();
        for result in fetched {
            read.extend(result?);
        }
        Ok(read)
    }

    /// Appends what was read as copies (step 4 of the module docs), waiting while half the
    /// upload slots are taken. A part a client rewrote since the read is appended all the
    /// same (the window is short) and then not mapped, live as at replay: the copy rule is
    /// the one place that decides.
    fn append_copies(&self, read: Vec<LiveRead>) -> Result<(), StoreError> {
        let uploads_max = (self.config.segments_in_flight_max / 2).max(1);
        let mut state = self.shared.lock();
        let mut retried = std::collections::BTreeSet::new();
        for (disk_offset, source, data) in read {
            while state.sealed.len() >= uploads_max {
                // A failed upload is retried once here (nobody else may be flushing), then
                // ends the round with its error: waiting for it alone would wait forever.
                state = self.retry_failed(state, u64::MAX, &mut retried)?;
                if state.sealed.len() < uploads_max {
                    break;
                }
                if !super::has_failed(&state, u64::MAX) {
                    state = self
                        .shared
                        .uploaded
                        .wait(state)
                        .unwrap_or_else(PoisonError::into_inner);
                }
            }
            state = self.append_locked(state, &data, disk_offset, Some(source))?;
        }
        Ok(())
    }
}

/// The background collector: a thread running a round every `gc_interval_ms` until stopped.
pub(super) struct Collector {
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: JoinHandle<()>,
}

impl Collector {
    pub(super) fn start(core: Arc<Core>, threshold: f64) -> std::io::Result<Collector> {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let stopping = stop.clone();
        let interval = Duration::from_millis(core.config.gc_interval_ms);
        let thread = std::thread::Builder::new()
            .name("bufcache-s3-gc".to_string())
            .spawn(move || {
                let (stopped, signal) = &*stopping;
                let mut guard = stopped.lock().unwrap_or_else(PoisonError::into_inner);
                while !*guard {
                    guard = signal
                        .wait_timeout(guard, interval)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                    if *guard {
                        break;
                    }
                    drop(guard);
                    match core.collect_garbage(threshold, &mut || {}) {
                        Ok(report) if report != GcReport::default() => {
                            tracing::debug!(?report, "garbage collection round")
                        }
                        Ok(_) => {}
                        Err(error) => {
                            tracing::warn!(error = %error, "garbage collection round failed; trying again later")
                        }
                    }
                    guard = stopped.lock().unwrap_or_else(PoisonError::into_inner);
                }
            })?;
        Ok(Collector { stop, thread })
    }

    /// Stops the thread after its current round and waits for it.
    pub(super) fn stop(self) {
        let (stopped, signal) = &*self.stop;
        *stopped.lock().unwrap_or_else(PoisonError::into_inner) = true;
        signal.notify_all();
        if self.thread.join().is_err() {
            tracing::error!("the garbage collector thread panicked");
        }
    }
}
