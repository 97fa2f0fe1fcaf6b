//! Where the engine meets the server: [`CacheExport`] serves one cache object as an NBD
//! export. Neither side knows the other: the NBD crate serves any [`Export`], and the engine
//! knows nothing of NBD; this crate is the one place that knows both.
//!
//! It only translates: each NBD command becomes one call on the object handle, and every
//! decision (how to zero, whether a request will wait for I/O) is the engine's. Each
//! connection gets its own handle ([`Export::open_connection`]), so every connection's next
//! FLUSH hears of a write-back error once.

use std::collections::BTreeMap;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use bufcache::{CacheError, ObjectHandle, Residency, StartedReadDone, ZeroOptions};
use bufcache_nbd::export::{
    AcknowledgeGate, BlockStatusExtent, CacheStateExtent, Export, HeldRead, ReadDone, ReadSink,
    StartedRead, WriteSource,
};

/// The cache's buffers holding a started read, as the server takes them.
struct CachedRead(bufcache::StartedRead);

impl HeldRead for CachedRead {
    fn slices(&self) -> Vec<io::IoSlice<'_>> {
        self.0.slices()
    }
}

/// A cache object served as an NBD export.
pub struct CacheExport {
    object: ObjectHandle,
    /// Ranges zeroed or trimmed (on a device whose discards read as zeroes) and not written
    /// since, shared by every connection's view: a structured READ answers them as holes.
    zeroes: Arc<ZeroTracker>,
    /// Asked before a change is acknowledged (a lease on the backend's disk).
    gate: Option<Arc<dyn AcknowledgeGate>>,
}

impl CacheExport {
    /// Serves `object`.
    pub fn new(object: ObjectHandle) -> Self {
        CacheExport {
            object,
            zeroes: Arc::default(),
            gate: None,
        }
    }

    /// Acknowledges WRITE, FLUSH, TRIM and WRITE_ZEROES only while `gate` allows it.
    pub fn with_gate(mut self, gate: Arc<dyn AcknowledgeGate>) -> Self {
        self.gate = Some(gate);
        self
    }

    /// Whole blocks of a byte range as a byte range (what a discard drops), maybe empty.
    fn whole_blocks(&self, offset: u64, length: u64) -> (u64, u64) {
        let block_size = u64::from(self.object.block_size());
        let end = offset + length;
        let first = offset.next_multiple_of(block_size);
        let last = if end == self.object.len() {
            end
        } else {
            end - end % block_size
        };
        (first, last.max(first))
    }
}

/// [`KnownZeroes`] behind a lock, with what lets the hot paths skip the lock: reads look
/// only while some range is known, and writes register only while ranges are known or
/// zeroings are in flight. A write that does not register is counted instead, and a zeroing
/// that starts while such a write is in flight is not trusted: either the zeroing sees the
/// count, or the write sees `tracking` (both are `SeqCst`) and registers.
#[derive(Default)]
struct ZeroTracker {
    known: RwLock<KnownZeroes>,
    /// Some range is known.
    any_known: AtomicBool,
    /// Ranges are known or zeroings are in flight: writes must register.
    tracking: AtomicBool,
    /// Writes in flight that did not register.
    untracked_writes: AtomicU64,
}

/// How a write was noted by [`ZeroTracker::begin_write`].
enum WriteNote {
    Untracked,
    Tracked(u64),
}

impl ZeroTracker {
    fn begin_write(&self, start: u64, end: u64) -> WriteNote {
        self.untracked_writes.fetch_add(1, Ordering::SeqCst);
        if !self.tracking.load(Ordering::SeqCst) {
            return WriteNote::Untracked;
        }
        let mut known = self.known.write();
        self.untracked_writes.fetch_sub(1, Ordering::SeqCst);
        let id = known.writing(start, end);
        self.update(&known);
        WriteNote::Tracked(id)
    }

    fn end_write(&self, note: WriteNote) {
        match note {
            WriteNote::Untracked => {
                self.untracked_writes.fetch_sub(1, Ordering::SeqCst);
            }
            WriteNote::Tracked(id) => {
                let mut known = self.known.write();
                known.wrote(id);
                self.update(&known);
            }
        }
    }

    fn begin_zeroing(&self, start: u64, end: u64) -> u64 {
        let mut known = self.known.write();
        self.tracking.store(true, Ordering::SeqCst);
        let id = known.begin_zeroing(start, end);
        if self.untracked_writes.load(Ordering::SeqCst) > 0 {
            known.spoil(id);
        }
        id
    }

    fn end_zeroing(&self, id: u64, succeeded: bool) {
        let mut known = self.known.write();
        known.end_zeroing(id, succeeded);
        self.update(&known);
    }

    fn within(&self, start: u64, end: u64) -> Vec<(u64, u64)> {
        if !self.any_known.load(Ordering::Acquire) {
            return Vec::new();
        }
        self.known.read().within(start, end)
    }

    /// Sets the flags from `known` (called with its lock held).
    fn update(&self, known: &KnownZeroes) {
        self.any_known
            .store(!known.ranges.is_empty(), Ordering::Release);
        let tracking = !known.ranges.is_empty() || !known.zeroing.is_empty();
        self.tracking.store(tracking, Ordering::SeqCst);
    }
}

/// Most ranges [`KnownZeroes`] keeps; past that it forgets them all (knowing less is safe).
const KNOWN_ZERO_RANGES_MAX: usize = 4096;

/// Byte ranges known to read as zeroes: disjoint, merged when they touch, start → end.
///
/// Invariant: a range is added only after its zeroing succeeded with no overlapping write in
/// flight at any time during it (a write marks the zeroings it overlaps spoiled, a zeroing
/// starts spoiled when an overlapping write is in flight), and removed before a write into it
/// starts, so a READ never calls written bytes a hole, whatever the order of overlapping
/// requests in flight.
#[derive(Default)]
struct KnownZeroes {
    ranges: BTreeMap<u64, u64>,
    /// Zeroings in flight: (id, start, end, spoiled by an overlapping write).
    zeroing: Vec<(u64, u64, u64, bool)>,
    /// Writes in flight: (id, start, end).
    writes: Vec<(u64, u64, u64)>,
    next_id: u64,
}

impl KnownZeroes {
    /// Notes a zeroing of `[start, end)` that is about to start; its id for [`Self::end_zeroing`].
    fn begin_zeroing(&mut self, start: u64, end: u64) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        let spoiled = self
            .writes
            .iter()
            .any(|&(_, write_start, write_end)| write_start < end && start < write_end);
        self.zeroing.push((id, start, end, spoiled));
        id
    }

    /// Marks the zeroing `id` untrustworthy.
    fn spoil(&mut self, id: u64) {
        if let Some(entry) = self.zeroing.iter_mut().find(|entry| entry.0 == id) {
            entry.3 = true;
        }
    }

    /// The zeroing `id` ended: its range is known zero when it `succeeded` unspoiled.
    fn end_zeroing(&mut self, id: u64, succeeded: bool) {
        let Some(at) = self.zeroing.iter().position(|entry| entry.0 == id) else {
            return;
        };
        let (_, start, end, spoiled) = self.zeroing.swap_remove(at);
        if succeeded && !spoiled {
            self.add(start, end);
        }
    }

    /// A write of `[start, end)` is about to start; its id for [`Self::wrote`].
    fn writing(&mut self, start: u64, end: u64) -> u64 {
        for entry in &mut self.zeroing {
            if entry.1 < end && start < entry.2 {
                entry.3 = true;
            }
        }
        self.remove(start, end);
        let id = self.next_id;
        self.next_id += 1;
        self.writes.push((id, start, end));
        id
    }

    /// The write `id` ended (whether or not it succeeded).
    fn wrote(&mut self, id: u64) {
        if let Some(at) = self.writes.iter().position(|entry| entry.0 == id) {
            self.writes.swap_remove(at);
        }
    }

    fn add(&mut self, start: u64, end: u64) {
        if start >= end {
            return;
        }
        let (mut start, mut end) = (start, end);
        // Absorb every range that overlaps or touches [start, end).
        let touching: Vec<(u64, u64)> = self
            .ranges
            .range(..=end)
            .rev()
            .take_while(|&(_, &range_end)| range_end >= start)
            .map(|(&range_start, &range_end)| (range_start, range_end))
            .collect();
        for (range_start, range_end) in touching {
            self.ranges.remove(&range_start);
            start = start.min(range_start);
            end = end.max(range_end);
        }
        self.ranges.insert(start, end);
        if self.ranges.len() > KNOWN_ZERO_RANGES_MAX {
            self.ranges.clear();
        }
    }

    fn remove(&mut self, start: u64, end: u64) {
        let overlapping: Vec<(u64, u64)> = self
            .ranges
            .range(..end)
            .rev()
            .take_while(|&(_, &range_end)| range_end > start)
            .map(|(&range_start, &range_end)| (range_start, range_end))
            .collect();
        for (range_start, range_end) in overlapping {
            self.ranges.remove(&range_start);
            if range_start < start {
                self.ranges.insert(range_start, start);
            }
            if range_end > end {
                self.ranges.insert(end, range_end);
            }
        }
        if self.ranges.len() > KNOWN_ZERO_RANGES_MAX {
            self.ranges.clear();
        }
    }

    /// The parts of `[start, end)` known to be zero, as `(offset, length)`, in order.
    fn within(&self, start: u64, end: u64) -> Vec<(u64, u64)> {
        let first = self
            .ranges
            .range(..=start)
            .next_back()
            .filter(|&(_, &range_end)| range_end > start)
            .map(|(&range_start, _)| range_start)
            .unwrap_or(start);
        self.ranges
            .range(first..end)
            .map(|(&range_start, &range_end)| (range_start.max(start), range_end.min(end)))
            .filter(|(from, to)| from < to)
            .map(|(from, to)| (from, to - from))
            .collect()
    }
}

impl Export for CacheExport {
    fn size(&self) -> u64 {
        self.object.len()
    }

    fn read_only(&self) -> bool {
        self.object.is_read_only()
    }

    fn description(&self) -> String {
        format!("bufcache over {}", self.object.device().describe())
    }

    fn preferred_block_size(&self) -> u32 {
        self.object.block_size()
    }

    fn read(&self, offset: u64, buffer: &mut [u8]) -> io::Result<()> {
        Ok(self.object.read_at(offset, buffer)?)
    }

    fn read_with(&self, offset: u64, buffer: &mut [u8], send: &mut ReadSink<'_>) -> io::Result<()> {
        match self.object.read_with(offset, buffer, send) {
            Ok(()) => Ok(()),
            Err(CacheError::DataSink { source }) => Err(source),
            Err(error) => Err(error.into()),
        }
    }

    fn write(&self, offset: u64, data: &[u8], fua: bool) -> io::Result<()> {
        let note = self.zeroes.begin_write(offset, offset + data.len() as u64);
        let written = self.object.write_at(offset, data, fua);
        self.zeroes.end_write(note);
        Ok(written?)
    }

    fn write_from(
        &self,
        offset: u64,
        length: u64,
        fua: bool,
        source: &mut WriteSource<'_>,
    ) -> io::Result<()> {
        let note = self.zeroes.begin_write(offset, offset + length);
        let written = self.object.write_from(offset, length, fua, source);
        self.zeroes.end_write(note);
        Ok(written?)
    }

    fn flush(&self) -> io::Result<()> {
        Ok(self.object.flush()?)
    }

    fn trim(&self, offset: u64, length: u64, fua: bool) -> io::Result<()> {
        // The cache drops the whole blocks, and a device whose discards read as zeroes then
        // reads them as zeroes.
        let (start, end) = self.whole_blocks(offset, length);
        let zeroes = self.object.device().capabilities().discard_zeroes;
        let zeroing = zeroes.then(|| self.zeroes.begin_zeroing(start, end));
        let discarded = self.object.discard(offset, length);
        if let Some(id) = zeroing {
            self.zeroes.end_zeroing(id, discarded.is_ok());
        }
        discarded?;
        if fua {
            self.object.flush()?;
        }
        Ok(())
    }

    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        may_trim: bool,
        fast_only: bool,
        fua: bool,
    ) -> io::Result<()> {
        let options = ZeroOptions {
            may_deallocate: may_trim,
            fast_only,
            fua,
        };
        let zeroing = self.zeroes.begin_zeroing(offset, offset + length);
        let zeroed = self.object.zero(offset, length, options);
        self.zeroes.end_zeroing(zeroing, zeroed.is_ok());
        Ok(zeroed?)
    }

    fn can_fast_zero(&self) -> bool {
        self.object.can_zero_fast()
    }

    fn cache(&self, offset: u64, length: u64) -> io::Result<()> {
        Ok(self.object.prefetch(offset, length)?)
    }

    fn cache_request_bytes_max(&self) -> u64 {
        self.object.cache().stats_without_pinned().memory_bytes_max
    }

    fn read_is_quick(&self, offset: u64, length: u64) -> bool {
        self.object.is_resident(offset, length)
    }

    fn start_read(&self, offset: u64, length: u32, done: ReadDone) -> Result<(), ReadDone> {
        // The server's callback waits in a slot the engine's callback empties: a read the
        // engine declines hands its callback back unrun, and the server's comes back out.
        let slot = Arc::new(Mutex::new(Some(done)));
        let engine_slot = Arc::clone(&slot);
        let engine_done: StartedReadDone = Box::new(move |outcome| {
            if let Some(done) = engine_slot.lock().take() {
                done(
                    outcome
                        .map(|read| Box::new(CachedRead(read)) as StartedRead)
                        .map_err(io::Error::from),
                );
            }
        });
        match self
            .object
            .start_read(offset, u64::from(length), engine_done)
        {
            Ok(()) => Ok(()),
            Err(declined) => {
                drop(declined);
                let done = slot.lock().take();
                Err(done.expect("a declined read's callback is handed back unrun"))
            }
        }
    }

    fn write_is_quick(&self, offset: u64, length: u64, fua: bool) -> bool {
        self.object.write_is_quick(offset, length, fua)
    }

    fn open_connection(&self) -> Option<Arc<dyn Export>> {
        Some(Arc::new(CacheExport {
            object: self.object.reopen(),
            zeroes: Arc::clone(&self.zeroes),
            gate: self.gate.clone(),
        }))
    }

    fn may_acknowledge_changes(&self) -> io::Result<()> {
        match &self.gate {
            Some(gate) => gate.may_acknowledge_changes(),
            None => Ok(()),
        }
    }

    fn block_status(&self, offset: u64, length: u64) -> io::Result<Vec<BlockStatusExtent>> {
        let extents = self.object.extents(offset, length)?;
        Ok(extents
            .into_iter()
            .map(|extent| BlockStatusExtent {
                length: extent.length,
                hole: extent.hole,
                zero: extent.hole,
            })
            .collect())
    }

    fn has_cache_state(&self) -> bool {
        true
    }

    fn cache_state(&self, offset: u64, length: u64) -> io::Result<Vec<CacheStateExtent>> {
        let runs = self.object.residency(offset, length)?;
        Ok(runs
            .into_iter()
            .map(|run| CacheStateExtent {
                length: run.length,
                resident: run.state != Residency::Absent,
                dirty: run.state == Residency::Dirty,
            })
            .collect())
    }

    fn known_zeroes(&self, offset: u64, length: u64) -> Vec<(u64, u64)> {
        self.zeroes.within(offset, offset + length)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_zeroes_merge_split_and_answer_within_a_range() {
        let mut zeroes = KnownZeroes::default();
        zeroes.add(100, 200);
        zeroes.add(300, 400);
        zeroes.add(200, 300);
        assert_eq!(zeroes.within(0, 1000), vec![(100, 300)]);
        zeroes.remove(150, 160);
        assert_eq!(zeroes.within(0, 1000), vec![(100, 50), (160, 240)]);
        assert_eq!(zeroes.within(120, 170), vec![(120, 30), (160, 10)]);
        assert_eq!(zeroes.within(150, 160), vec![]);
        zeroes.remove(0, 1000);
        assert_eq!(zeroes.within(0, 1000), vec![]);
        zeroes.add(5, 5);
        assert!(zeroes.ranges.is_empty(), "an empty range adds nothing");
    }

    #[test]
    fn a_write_during_a_zeroing_keeps_its_range_from_being_known_zero() {
        let mut zeroes = KnownZeroes::default();
        let spoiled = zeroes.begin_zeroing(0, 100);
        let clean = zeroes.begin_zeroing(200, 300);
        let write = zeroes.writing(50, 60);
        zeroes.wrote(write);
        zeroes.end_zeroing(spoiled, true);
        zeroes.end_zeroing(clean, true);
        assert_eq!(zeroes.within(0, 1000), vec![(200, 100)]);
        let failed = zeroes.begin_zeroing(400, 500);
        zeroes.end_zeroing(failed, false);
        assert_eq!(zeroes.within(0, 1000), vec![(200, 100)]);
        assert!(zeroes.zeroing.is_empty());
        // A zeroing that starts while an overlapping write is in flight is not trusted either.
        let write = zeroes.writing(600, 700);
        let during = zeroes.begin_zeroing(650, 800);
        zeroes.wrote(write);
        zeroes.end_zeroing(during, true);
        let after = zeroes.begin_zeroing(900, 950);
        zeroes.end_zeroing(after, true);
        assert_eq!(zeroes.within(0, 1000), vec![(200, 100), (900, 50)]);
        assert!(zeroes.writes.is_empty());
    }

    #[test]
    fn the_tracker_distrusts_a_zeroing_that_overlaps_an_untracked_write() {
        let tracker = ZeroTracker::default();
        // Nothing known: a write does not register, but is counted.
        let untracked = tracker.begin_write(0, 10);
        assert!(matches!(untracked, WriteNote::Untracked));
        let zeroing = tracker.begin_zeroing(100, 200);
        tracker.end_write(untracked);
        tracker.end_zeroing(zeroing, true);
        assert_eq!(
            tracker.within(0, 1000),
            vec![],
            "spoiled by the write in flight"
        );
        let zeroing = tracker.begin_zeroing(100, 200);
        tracker.end_zeroing(zeroing, true);
        assert_eq!(tracker.within(0, 1000), vec![(100, 100)]);
        // With a range known, writes register and split it.
        let tracked = tracker.begin_write(150, 160);
        assert!(matches!(tracked, WriteNote::Tracked(_)));
        tracker.end_write(tracked);
        assert_eq!(tracker.within(0, 1000), vec![(100, 50), (160, 40)]);
        let all = tracker.begin_write(0, 1000);
        tracker.end_write(all);
        assert_eq!(tracker.within(0, 1000), vec![]);
        assert!(
            !tracker.tracking.load(Ordering::SeqCst),
            "nothing left to track"
        );
        assert_eq!(tracker.untracked_writes.load(Ordering::SeqCst), 0);
    }
}
