//! The io queue (seed 004's disksort and driver-level transaction clustering) as a wrapper
//! device: requests from every thread pass through one bounded queue that orders them
//! (`fifo`, or a one-way `elevator` sweep by offset) and merges adjacent same-direction
//! requests into one vectored request of at most `transfer_bytes_max`.
//!
//! There is no dispatcher thread. A submitting thread enqueues its request and, while fewer
//! than `depth_max` requests are at the device, becomes the dispatcher for the best pending
//! batch (possibly other threads' requests); otherwise it sleeps until its own request is done.
//! Merging therefore happens exactly when requests wait, which is when it pays. A batch of
//! writes (`submit_writes`) is queued whole; its submitter then dispatches as many batches as
//! the depth allows at once and hands their writes to the inner device as one batch, so they
//! stay in flight together below the queue too.
//!
//! Invariants:
//! - at most `queued_max` requests wait and at most `depth_max` batches are at the device,
//!   besides reads submitted to a device that completes them later (`submit_reads`), which go
//!   to the device at once,
//!   past the queue;
//! - a request's memory is touched only while its submitter is blocked in the call, so the
//!   raw slices handed between threads never outlive their borrow;
//! - a batch's result is every member's result: one failed merged request fails all of them
//!   (each caller sees the device's error for a range containing its own);
//! - flush, discard and write_zeroes go straight to the inner device: only requests that
//!   have *returned* are ordered before them, and those are already at the device.

use std::collections::BTreeMap;
use std::io::{self, IoSlice, IoSliceMut};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

use crate::device::{
    read_each_now, total_length, write_and_wait, write_each_now, Capabilities, Device, Extent,
};
use crate::request::{ReadRequest, WriteMemory, WriteRequest};

/// How the queue orders requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueueMode {
    /// No queue: every request goes straight to the device.
    None,
    /// First come, first served (merging still applies).
    Fifo,
    /// One-way sweep by offset (C-LOOK): the next request at or after the last position,
    /// wrapping to the lowest offset.
    Elevator,
}

/// A queue mode name that is none of `none`, `fifo` and `elevator`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown io queue mode `{name}`; expected none, fifo or elevator")]
pub struct QueueModeError {
    /// The name given.
    pub name: String,
}

impl FromStr for QueueMode {
    type Err = QueueModeError;
    fn from_str(text: &str) -> Result<Self, QueueModeError> {
        match text {
            "none" => Ok(QueueMode::None),
            "fifo" => Ok(QueueMode::Fifo),
            "elevator" => Ok(QueueMode::Elevator),
            other => Err(QueueModeError {
                name: other.to_string(),
            }),
        }
    }
}

/// Configuration of an [`IoQueue`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IoQueueConfig {
    /// Ordering. Default elevator.
    pub mode: QueueMode,
    /// Merge adjacent same-direction requests. Default true.
    pub merge: bool,
    /// Batches at the device at once. Default 32; 1 to 1024.
    pub depth_max: usize,
    /// Requests waiting in the queue before submitters block. Default 256; at least 1.
    pub queued_max: usize,
    /// Largest merged request in bytes (MAXPHYS). Default 1 MiB.
    pub transfer_bytes_max: u64,
    /// Read batches the queue takes ahead of waiting writes before it takes a write again:
    /// a read has a caller waiting for it, a write-back write does not, so reads go first,
    /// but a stream of reads never holds writes back for longer than this many batches.
    /// Default 8; 0 takes every request in the mode's order alone (4.4BSD's disksort).
    pub read_batches_ahead_max: usize,
}

impl Default for IoQueueConfig {
    fn default() -> Self {
        IoQueueConfig {
            mode: QueueMode::Elevator,
            merge: true,
            depth_max: 32,
            queued_max: 256,
            transfer_bytes_max: 1 << 20,
            read_batches_ahead_max: 8,
        }
    }
}

impl IoQueueConfig {
    /// Checks the ranges.
    pub fn validate(&self) -> Result<(), IoQueueConfigError> {
        let range =
            |field: &'static str, value: usize, allowed: &str| IoQueueConfigError::OutOfRange {
                field,
                value: value.to_string(),
                allowed: allowed.to_string(),
            };
        if !(1..=1024).contains(&self.depth_max) {
            return Err(range(
                "io_queue_depth_max",
                self.depth_max,
                "must be from 1 to 1024",
            ));
        }
        if self.queued_max == 0 {
            return Err(range("io_queue_queued_max", 0, "must be at least 1"));
        }
        Ok(())
    }
}

/// An io queue setting out of range.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IoQueueConfigError {
    /// One field's value is out of range.
    #[error("{field} = {value} is invalid: {allowed}")]
    OutOfRange {
        /// The setting's name.
        field: &'static str,
        /// The value given.
        value: String,
        /// What is allowed.
        allowed: String,
    },
}

/// A snapshot of the queue's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IoQueueStats {
    /// Requests submitted to the queue.
    pub requests_entered: u64,
    /// Requests issued to the device (after merging).
    pub requests_issued: u64,
    /// Requests that rode along in another request's batch.
    pub requests_merged: u64,
}

/// Direction of a queued request.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Direction {
    /// Data from the device.
    Read,
    /// Data to the device.
    Write,
}

/// A borrowed slice passed to the dispatching thread. Only dereferenced while its submitter
/// is blocked waiting for the request, which keeps the borrow alive.
#[derive(Clone, Copy)]
struct RawSlice {
    pointer: *mut u8,
    length: usize,
}

// SAFETY: see the type's comment; the submitter's borrow outlives every use.
unsafe impl Send for RawSlice {}

/// The slices of a taken batch's writes as the memory of one request to the inner device.
/// [`write_and_wait`] returns only once that request has completed (a request hands its
/// memory to its completion), and the submitters stay blocked until after that, so the
/// slices are never reached once their borrow may have ended.
struct RawWrite(Vec<RawSlice>);

impl WriteMemory for RawWrite {
    fn slices(&self) -> Vec<IoSlice<'_>> {
        self.0
            .iter()
            // SAFETY: see the type's comment; write slices are only read.
            .map(|slice| {
                IoSlice::new(unsafe { std::slice::from_raw_parts(slice.pointer, slice.length) })
            })
            .collect()
    }
}

struct Completion {
    result: Mutex<Option<io::Result<()>>>,
}

/// What a submitter waits on: its request's slices and where its result goes.
struct Pending {
    slices: Vec<RawSlice>,
    completion: Arc<Completion>,
}

/// A request waiting in a [`QueueOrder`], with what its owner attached to it.
#[derive(Debug)]
pub struct Queued<T> {
    /// Read or write.
    pub direction: Direction,
    /// Byte offset on the device.
    pub offset: u64,
    /// Length in bytes.
    pub length: u64,
    /// The owner's data (the real queue: the submitter's buffers; the simulator: its
    /// request's bookkeeping).
    pub payload: T,
}

/// The io queue's ordering and merging, apart from devices and threads, so the simulator
/// orders its virtual-time requests with the very rules `serve` uses: `fifo` takes the oldest
/// request, `elevator` the lowest offset at or after the head position (the end of the last
/// batch), wrapping to the lowest (C-LOOK); with merging, every waiting request of the same
/// direction that continues the batch forwards or backwards joins it, up to
/// `transfer_bytes_max`.
///
/// With reads preferred ([`QueueOrder::prefer_reads`]), the next batch is the next *read* in
/// that order while reads and writes both wait, until `read_batches_ahead_max` read batches
/// have gone ahead of waiting writes; then the next write in that order goes, and the count
/// starts again. Invariants: `reads_waiting` and `writes_waiting` count the waiting requests
/// of each direction; a write waits behind at most `read_batches_ahead_max` read batches
/// before a write batch is taken.
#[derive(Debug)]
pub struct QueueOrder<T> {
    mode: QueueMode,
    merge: bool,
    transfer_bytes_max: u64,
    /// Waiting requests by (offset, arrival number), or (arrival, arrival) in FIFO mode.
    pending: BTreeMap<(u64, u64), Queued<T>>,
    arrivals: u64,
    /// Where the elevator is: the end of the last batch taken.
    head_position: u64,
    /// Read batches that may go ahead of waiting writes in a row (0: no preference).
    read_batches_ahead_max: usize,
    /// Read batches taken in a row while writes waited.
    read_batches_ahead: usize,
    reads_waiting: usize,
    writes_waiting: usize,
}

impl<T> QueueOrder<T> {
    /// An empty queue ordering by `mode` (`None` orders like `Fifo`).
    pub fn new(mode: QueueMode, merge: bool, transfer_bytes_max: u64) -> Self {
        QueueOrder {
            mode,
            merge,
            transfer_bytes_max,
            pending: BTreeMap::new(),
            arrivals: 0,
            head_position: 0,
            read_batches_ahead_max: 0,
            read_batches_ahead: 0,
            reads_waiting: 0,
            writes_waiting: 0,
        }
    }

    /// The same queue taking reads ahead of waiting writes, at most `read_batches_ahead_max`
    /// read batches in a row (0: no preference; see the type's docs).
    pub fn prefer_reads(mut self, read_batches_ahead_max: usize) -> Self {
        self.read_batches_ahead_max = read_batches_ahead_max;
        self
    }

    /// Requests waiting.
    pub fn len(&self) -> usize {
        self.pending.len()
    }

    /// True when nothing waits.
    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// The end of the last batch taken: where the elevator continues from.
    pub fn head_position(&self) -> u64 {
        self.head_position
    }

    /// The waiting requests, in queue order (for checkers and traces).
    pub fn waiting(&self) -> impl Iterator<Item = &Queued<T>> {
        self.pending.values()
    }

    /// Adds a request; it is younger than every request added before.
    pub fn push(&mut self, direction: Direction, offset: u64, length: u64, payload: T) {
        let arrival = self.arrivals;
        self.arrivals += 1;
        let key = match self.mode {
            // FIFO orders by arrival alone; the elevator by offset.
            QueueMode::Elevator => (offset, arrival),
            _ => (arrival, arrival),
        };
        *self.waiting_count(direction) += 1;
        self.pending.insert(
            key,
            Queued {
                direction,
                offset,
                length,
                payload,
            },
        );
    }

    /// Removes the next request in queue order and every request that merges with it,
    /// sorted by offset (one contiguous range); `None` when nothing waits.
    pub fn take_batch(&mut self) -> Option<Vec<Queued<T>>> {
        let writes_waited = self.writes_waiting > 0;
        let wanted = self.direction_wanted();
        let first_key = self.next_key(wanted)?;
        let first = self.remove(&first_key);
        let mut start = first.offset;
        let mut end = first.offset + first.length;
        let direction = first.direction;
        let mut batch = vec![first];
        if self.merge {
            self.merge_into(&mut batch, direction, &mut start, &mut end);
        }
        batch.sort_by_key(|member| member.offset);
        self.head_position = end;
        let preferring = self.read_batches_ahead_max > 0;
        self.read_batches_ahead = match direction {
            Direction::Read if writes_waited && preferring => self.read_batches_ahead + 1,
            _ => 0,
        };
        debug_assert!(
            self.read_batches_ahead <= self.read_batches_ahead_max,
            "writes wait behind at most the bound of read batches"
        );
        Some(batch)
    }

    /// The direction the next batch must have: reads while both wait and fewer than the
    /// bound of read batches went ahead of writes, then a write; `None` for any.
    fn direction_wanted(&self) -> Option<Direction> {
        let both_wait = self.reads_waiting > 0 && self.writes_waiting > 0;
        if self.read_batches_ahead_max == 0 || !both_wait {
            return None;
        }
        if self.read_batches_ahead < self.read_batches_ahead_max {
            Some(Direction::Read)
        } else {
            Some(Direction::Write)
        }
    }

    /// The key of the next request of `direction` (any, when `None`) in the mode's order.
    fn next_key(&self, direction: Option<Direction>) -> Option<(u64, u64)> {
        let fits = |queued: &Queued<T>| direction.is_none_or(|wanted| queued.direction == wanted);
        let first_fitting = |mut entries: std::collections::btree_map::Range<'_, _, Queued<T>>| {
            entries
                .find(|(_, queued)| fits(queued))
                .map(|(key, _): (&(u64, u64), _)| *key)
        };
        match self.mode {
            QueueMode::Elevator => first_fitting(self.pending.range((self.head_position, 0)..))
                .or_else(|| first_fitting(self.pending.range(..))),
            _ => first_fitting(self.pending.range(..)),
        }
    }

    /// Takes a waiting request out, keeping the per-direction counts.
    fn remove(&mut self, key: &(u64, u64)) -> Queued<T> {
        let queued = self.pending.remove(key).expect("key exists");
        *self.waiting_count(queued.direction) -= 1;
        queued
    }

    fn waiting_count(&mut self, direction: Direction) -> &mut usize {
        match direction {
            Direction::Read => &mut self.reads_waiting,
            Direction::Write => &mut self.writes_waiting,
        }
    }

    /// Pulls pending requests that continue the batch forwards or backwards.
    fn merge_into(
        &mut self,
        batch: &mut Vec<Queued<T>>,
        direction: Direction,
        start: &mut u64,
        end: &mut u64,
    ) {
        let limit = self.transfer_bytes_max;
        loop {
            let adjacent = self.pending.iter().find(|(_, candidate)| {
                candidate.direction == direction
                    && (candidate.offset == *end || candidate.offset + candidate.length == *start)
                    && (*end - *start) + candidate.length <= limit
            });
            let Some((&key, _)) = adjacent else { return };
            let member = self.remove(&key);
            if member.offset == *end {
                *end += member.length;
            } else {
                *start = member.offset;
            }
            batch.push(member);
        }
    }
}

struct QueueState {
    order: QueueOrder<Pending>,
    in_flight: usize,
}

/// A device wrapper that orders and merges requests.
pub struct IoQueue<D> {
    inner: D,
    config: IoQueueConfig,
    state: Mutex<QueueState>,
    changed: Condvar,
    entered: AtomicU64,
    issued: AtomicU64,
    merged: AtomicU64,
}

impl<D: Device> IoQueue<D> {
    /// Wraps `inner`.
    pub fn new(inner: D, config: IoQueueConfig) -> Result<Self, IoQueueConfigError> {
        config.validate()?;
        Ok(IoQueue {
            inner,
            state: Mutex::new(QueueState {
                order: QueueOrder::new(config.mode, config.merge, config.transfer_bytes_max)
                    .prefer_reads(config.read_batches_ahead_max),
                in_flight: 0,
            }),
            changed: Condvar::new(),
            config,
            entered: AtomicU64::new(0),
            issued: AtomicU64::new(0),
            merged: AtomicU64::new(0),
        })
    }

    /// The wrapped device.
    pub fn inner(&self) -> &D {
        &self.inner
    }

    /// The counters now.
    pub fn stats(&self) -> IoQueueStats {
        IoQueueStats {
            requests_entered: self.entered.load(Relaxed),
            requests_issued: self.issued.load(Relaxed),
            requests_merged: self.merged.load(Relaxed),
        }
    }

    fn submit(&self, direction: Direction, offset: u64, slices: Vec<RawSlice>) -> io::Result<()> {
        self.entered.fetch_add(1, Relaxed);
        let length = total_length(slices.iter().map(|slice| slice.length));
        let completion = Arc::new(Completion {
            result: Mutex::new(None),
        });
        let mut state = self.state.lock();
        while state.order.len() >= self.config.queued_max {
            self.changed.wait(&mut state);
        }
        state.order.push(
            direction,
            offset,
            length,
            Pending {
                slices,
                completion: Arc::clone(&completion),
            },
        );
        loop {
            if let Some(result) = completion.result.lock().take() {
                return result;
            }
            if state.in_flight < self.config.depth_max && !state.order.is_empty() {
                let batch = state.order.take_batch().expect("a request waits");
                self.issued.fetch_add(1, Relaxed);
                self.merged.fetch_add(batch.len() as u64 - 1, Relaxed);
                state.in_flight += 1;
                drop(state);
                let result = self.execute(&batch);
                state = self.state.lock();
                state.in_flight -= 1;
                for member in &batch {
                    *member.payload.completion.result.lock() = Some(clone_result(&result));
                }
                self.changed.notify_all();
                continue;
            }
            self.changed.wait(&mut state);
        }
    }

    /// Queues every write of a batch, then dispatches while any of them is unfinished: as
    /// many batches as the depth allows at a time (other threads' requests included), their
    /// writes handed to the inner device together so they are in flight at once.
    fn submit_batch(&self, writes: &mut [WriteRequest]) -> Vec<io::Result<()>> {
        self.entered.fetch_add(writes.len() as u64, Relaxed);
        let completions: Vec<Arc<Completion>> = writes
            .iter()
            .map(|_| {
                Arc::new(Completion {
                    result: Mutex::new(None),
                })
            })
            .collect();
        let mut outcomes: Vec<Option<io::Result<()>>> = writes.iter().map(|_| None).collect();
        let mut queued = 0;
        let mut state = self.state.lock();
        loop {
            while queued < writes.len() && state.order.len() < self.config.queued_max {
                let write = &mut writes[queued];
                let (offset, length_bytes) = (write.offset(), write.length_bytes());
                let slices = write
                    .slices()
                    .iter()
                    .map(|buffer| RawSlice {
                        pointer: buffer.as_ptr() as *mut u8,
                        length: buffer.len(),
                    })
                    .collect();
                state.order.push(
                    Direction::Write,
                    offset,
                    length_bytes,
                    Pending {
                        slices,
                        completion: Arc::clone(&completions[queued]),
                    },
                );
                queued += 1;
            }
            for (outcome, completion) in outcomes.iter_mut().zip(&completions) {
                if outcome.is_none() {
                    *outcome = completion.result.lock().take();
                }
            }
            if queued == writes.len() && outcomes.iter().all(Option::is_some) {
                return outcomes.into_iter().flatten().collect();
            }
            let room = self.config.depth_max.saturating_sub(state.in_flight);
            if room > 0 && !state.order.is_empty() {
                let batches: Vec<Vec<Queued<Pending>>> =
                    std::iter::from_fn(|| state.order.take_batch())
                        .take(room)
                        .collect();
                self.issued.fetch_add(batches.len() as u64, Relaxed);
                let members: usize = batches.iter().map(Vec::len).sum();
                self.merged
                    .fetch_add((members - batches.len()) as u64, Relaxed);
                state.in_flight += batches.len();
                drop(state);
                let results = self.execute_many(&batches);
                state = self.state.lock();
                state.in_flight -= batches.len();
                for (batch, result) in batches.iter().zip(&results) {
                    for member in batch {
                        *member.payload.completion.result.lock() = Some(clone_result(result));
                    }
                }
                self.changed.notify_all();
                continue;
            }
            self.changed.wait(&mut state);
        }
    }

    /// Executes several taken batches: their writes as one batch of the inner device, their
    /// reads one after another. One result per batch, in order.
    fn execute_many(&self, batches: &[Vec<Queued<Pending>>]) -> Vec<io::Result<()>> {
        let writes: Vec<(u64, RawWrite)> = batches
            .iter()
            .filter(|batch| batch[0].direction == Direction::Write)
            .map(|batch| {
                let slices = batch
                    .iter()
                    .flat_map(|member| member.payload.slices.iter().copied())
                    .collect();
                (batch[0].offset, RawWrite(slices))
            })
            .collect();
        let mut write_results = write_and_wait(&self.inner, writes)
            .into_iter()
            .map(|(_, result)| result);
        batches
            .iter()
            .map(|batch| match batch[0].direction {
                Direction::Write => write_results
                    .next()
                    .expect("the inner device answers every write of the batch"),
                Direction::Read => self.execute(batch),
            })
            .collect()
    }

    fn execute(&self, batch: &[Queued<Pending>]) -> io::Result<()> {
        let offset = batch[0].offset;
        let raw: Vec<RawSlice> = batch
            .iter()
            .flat_map(|member| member.payload.slices.iter().copied())
            .collect();
        match batch[0].direction {
            Direction::Read => {
                // SAFETY: every submitter is blocked until its completion is set, after this.
                let mut slices: Vec<IoSliceMut<'_>> = raw
                    .iter()
                    .map(|slice| {
                        IoSliceMut::new(unsafe {
                            std::slice::from_raw_parts_mut(slice.pointer, slice.length)
                        })
                    })
                    .collect();
                self.inner.read_vectored_at(&mut slices, offset)
            }
            Direction::Write => {
                // SAFETY: as above; write slices are only read.
                let slices: Vec<IoSlice<'_>> = raw
                    .iter()
                    .map(|slice| {
                        IoSlice::new(unsafe {
                            std::slice::from_raw_parts(slice.pointer, slice.length)
                        })
                    })
                    .collect();
                self.inner.write_vectored_at(&slices, offset)
            }
        }
    }
}

fn clone_result(result: &io::Result<()>) -> io::Result<()> {
    match result {
        Ok(()) => Ok(()),
        Err(error) => Err(io::Error::new(error.kind(), error.to_string())),
    }
}

impl<D: Device> Device for IoQueue<D> {
    fn read_vectored_at(&self, buffers: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<()> {
        if self.config.mode == QueueMode::None {
            return self.inner.read_vectored_at(buffers, offset);
        }
        let slices = buffers
            .iter_mut()
            .map(|buffer| RawSlice {
                pointer: buffer.as_mut_ptr(),
                length: buffer.len(),
            })
            .collect();
        self.submit(Direction::Read, offset, slices)
    }

    fn write_vectored_at(&self, buffers: &[IoSlice<'_>], offset: u64) -> io::Result<()> {
        if self.config.mode == QueueMode::None {
            return self.inner.write_vectored_at(buffers, offset);
        }
        let slices = buffers
            .iter()
            .map(|buffer| RawSlice {
                pointer: buffer.as_ptr() as *mut u8,
                length: buffer.len(),
            })
            .collect();
        self.submit(Direction::Write, offset, slices)
    }

    /// A batch of writes is queued whole and dispatched by the submitting thread (see the
    /// module's docs); each write completes with its batch's outcome before this returns.
    fn submit_writes(&self, mut writes: Vec<WriteRequest>) {
        if self.config.mode == QueueMode::None {
            return self.inner.submit_writes(writes);
        }
        if writes.len() == 1 {
            return write_each_now(self, writes);
        }
        let results = self.submit_batch(&mut writes);
        for (write, result) in writes.into_iter().zip(results) {
            write.complete(result);
        }
    }

    /// Reads the inner device completes later go to it at once, past the queue: they have no
    /// submitter blocked in the call to dispatch them, the thread that started them must not
    /// block (it is reading a client's next request), and counting them in the depth would
    /// let a client with many reads in flight hold back everyone's queued requests. So do the
    /// reads of a device that serves many requests at once (an object store): it keeps a
    /// batch in flight together, which taking turns in the queue would undo, and there is no
    /// head position for an elevator to save. Over a device that does one request at a time
    /// in the caller's thread each read takes its turn in the queue now.
    fn submit_reads(&self, reads: Vec<ReadRequest>) {
        if self.config.mode != QueueMode::None {
            let capabilities = self.inner.capabilities();
            if !capabilities.completes_later && capabilities.inflight_requests_max <= 1 {
                return read_each_now(self, reads);
            }
            self.entered.fetch_add(reads.len() as u64, Relaxed);
            self.issued.fetch_add(reads.len() as u64, Relaxed);
        }
        self.inner.submit_reads(reads)
    }

    fn flush(&self) -> io::Result<()> {
        self.inner.flush()
    }

    fn discard(&self, offset: u64, length: u64) -> io::Result<()> {
        self.inner.discard(offset, length)
    }

    fn write_zeroes(&self, offset: u64, length: u64) -> io::Result<()> {
        self.inner.write_zeroes(offset, length)
    }

    fn extents(&self, offset: u64, length: u64) -> io::Result<Vec<Extent>> {
        self.inner.extents(offset, length)
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::counting::CountingDevice;
    use crate::memory::MemoryDevice;
    use std::time::Duration;

    // Goal: every queue mode parses from its name, and any other name is refused with a typed
    // error naming it and the names accepted. Method: parse each name and one misspelling.
    #[test]
    fn queue_modes_parse_from_their_names_and_others_are_named_in_the_error() {
        let modes = [
            ("none", QueueMode::None),
            ("fifo", QueueMode::Fifo),
            ("elevator", QueueMode::Elevator),
        ];
        for (name, mode) in modes {
            assert_eq!(name.parse::<QueueMode>(), Ok(mode));
        }
        let error = "elevater".parse::<QueueMode>().unwrap_err();
        assert_eq!(error.name, "elevater");
        assert_eq!(
            error.to_string(),
            "unknown io queue mode `elevater`; expected none, fifo or elevator"
        );
    }

    /// A device that is slow, so requests pile up in the queue and can merge.
    struct Slow(CountingDevice<MemoryDevice>);

    impl Device for Slow {
        fn read_vectored_at(&self, buffers: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<()> {
            std::thread::sleep(Duration::from_millis(5));
            self.0.read_vectored_at(buffers, offset)
        }
        fn write_vectored_at(&self, buffers: &[IoSlice<'_>], offset: u64) -> io::Result<()> {
            std::thread::sleep(Duration::from_millis(5));
            self.0.write_vectored_at(buffers, offset)
        }

        fn submit_writes(&self, writes: Vec<crate::request::WriteRequest>) {
            crate::device::write_each_now(self, writes)
        }

        fn submit_reads(&self, reads: Vec<crate::request::ReadRequest>) {
            crate::device::read_each_now(self, reads)
        }
        fn flush(&self) -> io::Result<()> {
            Ok(())
        }
        fn discard(&self, offset: u64, length: u64) -> io::Result<()> {
            self.0.discard(offset, length)
        }
        fn write_zeroes(&self, offset: u64, length: u64) -> io::Result<()> {
            self.0.write_zeroes(offset, length)
        }
        fn extents(&self, offset: u64, length: u64) -> io::Result<Vec<Extent>> {
            self.0.extents(offset, length)
        }
        fn capabilities(&self) -> Capabilities {
            self.0.capabilities()
        }
        fn describe(&self) -> String {
            "slow".into()
        }
    }

    fn run_writers(mode: QueueMode, merge: bool) -> (IoQueueStats, u64, Vec<u8>) {
        let config = IoQueueConfig {
            mode,
            merge,
            depth_max: 1,
            ..IoQueueConfig::default()
        };
        let queue = Arc::new(
            IoQueue::new(
                Slow(CountingDevice::new(MemoryDevice::new(1 << 20))),
                config,
            )
            .unwrap(),
        );
        let workers: Vec<_> = (0..16u8)
            .map(|index| {
                let queue = Arc::clone(&queue);
                std::thread::spawn(move || {
                    let data = vec![index; 4096];
                    queue
                        .write_vectored_at(&[IoSlice::new(&data)], index as u64 * 4096)
                        .unwrap();
                })
            })
            .collect();
        workers
            .into_iter()
            .for_each(|worker| worker.join().unwrap());
        let mut back = vec![0u8; 16 * 4096];
        queue
            .read_vectored_at(&mut [IoSliceMut::new(&mut back)], 0)
            .unwrap();
        (queue.stats(), queue.inner().0.stats().writes.requests, back)
    }

    #[test]
    fn adjacent_queued_writes_merge_and_land_intact() {
        let (stats, device_writes, back) = run_writers(QueueMode::Elevator, true);
        assert_eq!(stats.requests_entered, 17);
        assert!(
            device_writes < 16,
            "16 adjacent writes behind a busy device merge: {device_writes}"
        );
        assert_eq!(stats.requests_issued, device_writes + 1);
        for (index, chunk) in back.chunks(4096).enumerate() {
            assert!(
                chunk.iter().all(|&byte| byte == index as u8),
                "block {index} intact"
            );
        }
    }

    #[test]
    fn queue_order_sweeps_by_offset_from_the_head_and_merges_neighbours() {
        // Goal: the ordering the simulator shares with `IoQueue` is C-LOOK with merging, and
        // FIFO by arrival. Method: queue requests out of order, take batches, and compare
        // the offsets taken with the sweep worked out by hand.
        let mut elevator = QueueOrder::new(QueueMode::Elevator, true, 16 << 10);
        for (offset, tag) in [
            (40u64 << 10, 'a'),
            (8 << 10, 'b'),
            (12 << 10, 'c'),
            (4 << 10, 'd'),
        ] {
            elevator.push(Direction::Write, offset, 4096, tag);
        }
        let first = elevator.take_batch().unwrap();
        // Head at 0: the lowest offset (4K) and its neighbours 8K and 12K, in one batch.
        let tags: Vec<char> = first.iter().map(|member| member.payload).collect();
        assert_eq!(tags, ['d', 'b', 'c']);
        assert_eq!(elevator.head_position(), 16 << 10);
        elevator.push(Direction::Write, 0, 4096, 'e');
        // 40K lies ahead of the head; 0 waits for the next sweep.
        assert_eq!(elevator.take_batch().unwrap()[0].payload, 'a');
        assert_eq!(elevator.take_batch().unwrap()[0].payload, 'e');
        assert!(elevator.take_batch().is_none());

        let mut fifo = QueueOrder::new(QueueMode::Fifo, false, 16 << 10);
        for (offset, tag) in [(40u64 << 10, 'a'), (8 << 10, 'b'), (12 << 10, 'c')] {
            fifo.push(Direction::Read, offset, 4096, tag);
        }
        let order: Vec<char> = std::iter::from_fn(|| fifo.take_batch())
            .map(|batch| batch[0].payload)
            .collect();
        assert_eq!(order, ['a', 'b', 'c']);
    }

    /// The tags of every batch `order` hands out, in order (first member of each).
    fn drain_tags(order: &mut QueueOrder<char>) -> Vec<char> {
        std::iter::from_fn(|| order.take_batch())
            .map(|batch| batch[0].payload)
            .collect()
    }

    /// Writes at 0, 20K, 40K, 60K and reads at 10K, 30K, 50K, none adjacent.
    fn mixed(order: &mut QueueOrder<char>) {
        for (offset, tag) in [
            (0u64, 'w'),
            (20 << 10, 'x'),
            (40 << 10, 'y'),
            (60 << 10, 'z'),
        ] {
            order.push(Direction::Write, offset, 4096, tag);
        }
        for (offset, tag) in [(10u64 << 10, 'a'), (30 << 10, 'b'), (50 << 10, 'c')] {
            order.push(Direction::Read, offset, 4096, tag);
        }
    }

    #[test]
    fn reads_go_ahead_of_waiting_writes_for_at_most_the_bound() {
        // Goal: a read waits behind no write-back a caller is not waiting for, yet a stream
        // of reads never holds writes back for more than the bound of read batches; with no
        // bound the order is plain C-LOOK. Method: the same reads and writes, queued
        // together, drained with bounds 0, 1 and 8; compare the order with the rule worked
        // out by hand.
        let mut plain = QueueOrder::new(QueueMode::Elevator, true, 1 << 20);
        mixed(&mut plain);
        assert_eq!(drain_tags(&mut plain), ['w', 'a', 'x', 'b', 'y', 'c', 'z']);

        let mut reads_first = QueueOrder::new(QueueMode::Elevator, true, 1 << 20).prefer_reads(8);
        mixed(&mut reads_first);
        assert_eq!(
            drain_tags(&mut reads_first),
            ['a', 'b', 'c', 'z', 'w', 'x', 'y'],
            "reads in sweep order first, then the writes' sweep on from the head"
        );

        let mut bounded = QueueOrder::new(QueueMode::Elevator, true, 1 << 20).prefer_reads(1);
        mixed(&mut bounded);
        assert_eq!(
            drain_tags(&mut bounded),
            ['a', 'x', 'b', 'y', 'c', 'z', 'w'],
            "one read batch ahead, then the next write along the sweep"
        );

        let mut fifo = QueueOrder::new(QueueMode::Fifo, false, 1 << 20).prefer_reads(2);
        mixed(&mut fifo);
        assert_eq!(drain_tags(&mut fifo), ['a', 'b', 'w', 'c', 'x', 'y', 'z']);
    }

    /// A device that records the order requests reach it and holds the first write at a gate
    /// until the test opens it, so other requests wait in the queue meanwhile.
    struct GatedFirstWrite {
        inner: MemoryDevice,
        order: Mutex<Vec<(Direction, u64)>>,
        first_write_started: Mutex<Option<std::sync::mpsc::Sender<()>>>,
        gate: Mutex<Option<std::sync::mpsc::Receiver<()>>>,
    }

    impl Device for GatedFirstWrite {
        fn read_vectored_at(&self, buffers: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<()> {
            self.order.lock().push((Direction::Read, offset));
            self.inner.read_vectored_at(buffers, offset)
        }
        fn write_vectored_at(&self, buffers: &[IoSlice<'_>], offset: u64) -> io::Result<()> {
            self.order.lock().push((Direction::Write, offset));
            if let Some(started) = self.first_write_started.lock().take() {
                started.send(()).unwrap();
                let gate = self.gate.lock().take().expect("the gate");
                gate.recv().unwrap();
            }
            self.inner.write_vectored_at(buffers, offset)
        }
        fn submit_writes(&self, writes: Vec<WriteRequest>) {
            write_each_now(self, writes)
        }
        fn submit_reads(&self, reads: Vec<ReadRequest>) {
            read_each_now(self, reads)
        }
        fn flush(&self) -> io::Result<()> {
            Ok(())
        }
        fn discard(&self, offset: u64, length: u64) -> io::Result<()> {
            self.inner.discard(offset, length)
        }
        fn write_zeroes(&self, offset: u64, length: u64) -> io::Result<()> {
            self.inner.write_zeroes(offset, length)
        }
        fn extents(&self, offset: u64, length: u64) -> io::Result<Vec<Extent>> {
            self.inner.extents(offset, length)
        }
        fn capabilities(&self) -> Capabilities {
            self.inner.capabilities()
        }
        fn describe(&self) -> String {
            "gated".into()
        }
    }

    #[test]
    fn a_read_miss_is_dispatched_ahead_of_queued_write_back() {
        // Goal: a read that arrives while a batch of write-back waits in the queue reaches the
        // device next, not after the batch. Method: depth 1; a batch of eight scattered
        // writes whose first is held at the device; a read beyond them queued meanwhile; once
        // the gate opens, the read must be the second request the device sees (plain C-LOOK
        // would send it last, the writes lying between the head and it).
        let (started_sender, first_write_started) = std::sync::mpsc::channel();
        let (open_gate, gate) = std::sync::mpsc::channel();
        let queue = Arc::new(
            IoQueue::new(
                GatedFirstWrite {
                    inner: MemoryDevice::new(4 << 20),
                    order: Mutex::new(Vec::new()),
                    first_write_started: Mutex::new(Some(started_sender)),
                    gate: Mutex::new(Some(gate)),
                },
                IoQueueConfig {
                    depth_max: 1,
                    merge: false,
                    ..IoQueueConfig::default()
                },
            )
            .unwrap(),
        );
        let writer = {
            let queue = Arc::clone(&queue);
            std::thread::spawn(move || {
                let writes: Vec<(u64, Vec<u8>)> = (0..8u64)
                    .map(|index| (index * (64 << 10), vec![5u8; 4096]))
                    .collect();
                write_and_wait(queue.as_ref(), writes)
            })
        };
        first_write_started.recv().unwrap();
        let reader = {
            let queue = Arc::clone(&queue);
            std::thread::spawn(move || {
                let mut back = vec![0u8; 4096];
                queue.read_vectored_at(&mut [IoSliceMut::new(&mut back)], 3 << 20)
            })
        };
        while queue.state.lock().order.reads_waiting == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        open_gate.send(()).unwrap();
        assert!(writer
            .join()
            .unwrap()
            .iter()
            .all(|(_, result)| result.is_ok()));
        reader.join().unwrap().unwrap();
        let order = queue.inner().order.lock().clone();
        assert_eq!(order.len(), 9);
        assert_eq!(order[0], (Direction::Write, 0));
        assert_eq!(
            order[1],
            (Direction::Read, 3 << 20),
            "the read goes next: {order:?}"
        );
    }

    #[test]
    fn without_merging_every_request_reaches_the_device() {
        let (stats, device_writes, _) = run_writers(QueueMode::Fifo, false);
        assert_eq!(device_writes, 16);
        assert_eq!(stats.requests_merged, 0);
    }

    /// Records every batch handed to it (a plain write is a batch of one) and fails writes
    /// at one offset.
    struct Recording {
        inner: MemoryDevice,
        batches: Mutex<Vec<Vec<(u64, u64)>>>,
        failing_offset: u64,
    }

    impl Device for Recording {
        fn read_vectored_at(&self, buffers: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<()> {
            self.inner.read_vectored_at(buffers, offset)
        }
        fn write_vectored_at(&self, buffers: &[IoSlice<'_>], offset: u64) -> io::Result<()> {
            let data: Vec<u8> = buffers
                .iter()
                .flat_map(|buffer| buffer.iter().copied())
                .collect();
            write_and_wait(self, vec![(offset, data)])
                .pop()
                .expect("one outcome")
                .1
        }
        fn submit_writes(&self, writes: Vec<WriteRequest>) {
            self.batches.lock().push(
                writes
                    .iter()
                    .map(|write| (write.offset(), write.length_bytes()))
                    .collect(),
            );
            for write in writes {
                let offset = write.offset();
                let result = if offset == self.failing_offset {
                    Err(io::Error::other("bad sector"))
                } else {
                    self.inner.write_vectored_at(&write.slices(), offset)
                };
                write.complete(result);
            }
        }
        fn submit_reads(&self, reads: Vec<crate::request::ReadRequest>) {
            read_each_now(self, reads)
        }
        fn flush(&self) -> io::Result<()> {
            Ok(())
        }
        fn discard(&self, offset: u64, length: u64) -> io::Result<()> {
            self.inner.discard(offset, length)
        }
        fn write_zeroes(&self, offset: u64, length: u64) -> io::Result<()> {
            self.inner.write_zeroes(offset, length)
        }
        fn extents(&self, offset: u64, length: u64) -> io::Result<Vec<Extent>> {
            self.inner.extents(offset, length)
        }
        fn capabilities(&self) -> Capabilities {
            self.inner.capabilities()
        }
        fn describe(&self) -> String {
            "recording".into()
        }
    }

    #[test]
    fn a_batch_through_the_queue_reaches_the_device_as_one_batch_merged_and_sorted() {
        // Goal: a batch of writes submitted to the queue keeps its writes in flight together
        // below it (one inner batch, up to the depth), merges neighbours, and answers each
        // write with its own outcome. Method: five writes out of order — two pairs of
        // neighbours and one at the failing offset — through an elevator queue over a
        // recording device; then read everything back.
        let queue = IoQueue::new(
            Recording {
                inner: MemoryDevice::new(1 << 20),
                batches: Mutex::new(Vec::new()),
                failing_offset: 64 << 10,
            },
            IoQueueConfig::default(),
        )
        .unwrap();
        let offsets = [32u64 << 10, 4 << 10, 64 << 10, 0, 36 << 10];
        let writes: Vec<(u64, Vec<u8>)> = offsets
            .iter()
            .zip(1u8..)
            .map(|(&offset, pattern)| (offset, vec![pattern; 4096]))
            .collect();
        let results = write_and_wait(&queue, writes);
        let failed: Vec<bool> = results.iter().map(|(_, result)| result.is_err()).collect();
        assert_eq!(failed, [false, false, true, false, false]);
        let batches = queue.inner().batches.lock().clone();
        assert_eq!(
            batches,
            [vec![(0, 8192), (32 << 10, 8192), (64 << 10, 4096)]],
            "one inner batch: neighbours merged, sorted by offset"
        );
        assert_eq!(queue.stats().requests_entered, 5);
        assert_eq!(queue.stats().requests_issued, 3);
        for (index, &offset) in offsets.iter().enumerate() {
            let mut back = vec![0u8; 4096];
            queue
                .read_vectored_at(&mut [IoSliceMut::new(&mut back)], offset)
                .unwrap();
            let expected = if failed[index] { 0 } else { index as u8 + 1 };
            assert!(back.iter().all(|&byte| byte == expected), "write {index}");
        }
    }

    #[test]
    fn a_batch_larger_than_the_queue_still_completes() {
        // Goal: a batch of more writes than the queue holds waits for room instead of
        // blocking on itself. Method: 40 scattered writes through a queue of 8 slots and depth
        // 2; every write succeeds and reads back.
        let queue = IoQueue::new(
            Recording {
                inner: MemoryDevice::new(1 << 20),
                batches: Mutex::new(Vec::new()),
                failing_offset: u64::MAX,
            },
            IoQueueConfig {
                depth_max: 2,
                queued_max: 8,
                ..IoQueueConfig::default()
            },
        )
        .unwrap();
        let writes: Vec<(u64, Vec<u8>)> = (0..40u8)
            .map(|index| (u64::from(index) * 8192, vec![index + 1; 512]))
            .collect();
        assert!(write_and_wait(&queue, writes)
            .iter()
            .all(|(_, result)| result.is_ok()));
        let batches = queue.inner().batches.lock().clone();
        assert!(
            batches.iter().all(|batch| batch.len() <= 2),
            "never more than the depth at the device: {batches:?}"
        );
        assert_eq!(batches.iter().map(Vec::len).sum::<usize>(), 40);
        for index in 0..40u64 {
            let mut back = vec![0u8; 512];
            queue
                .read_vectored_at(&mut [IoSliceMut::new(&mut back)], index * 8192)
                .unwrap();
            assert!(back.iter().all(|&byte| byte == index as u8 + 1));
        }
    }

    /// A memory device whose started reads end on a thread of their own, and whose writes
    /// wait at a gate after saying they started.
    struct LaterInner {
        inner: Arc<MemoryDevice>,
        write_started: Mutex<Option<std::sync::mpsc::Sender<()>>>,
        write_gate: Mutex<Option<std::sync::mpsc::Receiver<()>>>,
    }

    impl Device for LaterInner {
        fn read_vectored_at(&self, buffers: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<()> {
            self.inner.read_vectored_at(buffers, offset)
        }
        fn write_vectored_at(&self, buffers: &[IoSlice<'_>], offset: u64) -> io::Result<()> {
            if let Some(started) = self.write_started.lock().take() {
                started.send(()).unwrap();
            }
            if let Some(gate) = self.write_gate.lock().take() {
                gate.recv().unwrap();
            }
            self.inner.write_vectored_at(buffers, offset)
        }
        fn submit_writes(&self, writes: Vec<crate::request::WriteRequest>) {
            crate::device::write_each_now(self, writes)
        }
        fn submit_reads(&self, reads: Vec<ReadRequest>) {
            let inner = Arc::clone(&self.inner);
            std::thread::spawn(move || read_each_now(inner.as_ref(), reads));
        }
        fn flush(&self) -> io::Result<()> {
            Ok(())
        }
        fn discard(&self, offset: u64, length: u64) -> io::Result<()> {
            self.inner.discard(offset, length)
        }
        fn write_zeroes(&self, offset: u64, length: u64) -> io::Result<()> {
            self.inner.write_zeroes(offset, length)
        }
        fn extents(&self, offset: u64, length: u64) -> io::Result<Vec<Extent>> {
            self.inner.extents(offset, length)
        }
        fn capabilities(&self) -> Capabilities {
            Capabilities {
                completes_later: true,
                ..self.inner.capabilities()
            }
        }
        fn describe(&self) -> String {
            "later".into()
        }
    }

    #[test]
    fn a_started_read_goes_out_at_once_even_when_the_depth_is_full() {
        // Goal: a read started through the queue never waits in it (its starter must not
        // block) and takes no place in its depth: it goes to the device at once even with
        // the depth used up and ends with the right bytes. Method: depth 1, taken by a write
        // held at the device's gate; a started read must end while the write is still held;
        // then the write ends and a plain read goes through.
        let (started_sender, write_started) = std::sync::mpsc::channel();
        let (open_gate, gate) = std::sync::mpsc::channel();
        let memory = MemoryDevice::new(1 << 20);
        memory
            .write_vectored_at(&[IoSlice::new(&[7u8; 4096])], 65536)
            .unwrap();
        let queue = Arc::new(
            IoQueue::new(
                LaterInner {
                    inner: Arc::new(memory),
                    write_started: Mutex::new(Some(started_sender)),
                    write_gate: Mutex::new(Some(gate)),
                },
                IoQueueConfig {
                    depth_max: 1,
                    ..IoQueueConfig::default()
                },
            )
            .unwrap(),
        );
        let writer = {
            let queue = Arc::clone(&queue);
            std::thread::spawn(move || {
                queue
                    .write_vectored_at(&[IoSlice::new(&[1u8; 4096])], 0)
                    .unwrap()
            })
        };
        write_started.recv().unwrap();
        let (done_sender, done) = std::sync::mpsc::channel();
        let read = ReadRequest::new(65536, vec![0u8; 4096], move |target: Vec<u8>, result| {
            done_sender.send((target, result)).unwrap()
        });
        queue.submit_reads(vec![read]);
        let (target, result) = done
            .recv_timeout(Duration::from_secs(10))
            .expect("the started read ended while the depth was full");
        result.unwrap();
        assert!(target.iter().all(|&byte| byte == 7));
        assert!(!writer.is_finished(), "the write still holds the depth");
        open_gate.send(()).unwrap();
        writer.join().unwrap();
        let mut back = vec![0u8; 4096];
        queue
            .read_vectored_at(&mut [IoSliceMut::new(&mut back)], 0)
            .unwrap();
        assert!(back.iter().all(|&byte| byte == 1));
        assert_eq!(queue.state.lock().in_flight, 0);
    }
}
