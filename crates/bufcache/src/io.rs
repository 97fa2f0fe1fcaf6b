//! The io path: the only module of the engine that calls a [`Device`].
//!
//! Every device request of the engine — clustered reads, started reads, write-back writes and
//! batches, flushes, discards, zeroing, allocation maps — goes through [`Io`]. It counts each
//! request once, turns device errors into [`CacheError::Device`] naming the device, the
//! operation and the range, and bounds write-back per device:
//!
//! - **Write-back slots.** Each device has `writeback_inflight_max` slots for write-back
//!   requests (a batch takes one per write). Over a device that serves many requests at once
//!   (`Capabilities::inflight_requests_max` above 1: an NBD upstream, an object store) the
//!   share is also at most a quarter of the device's in-flight requests, so a read miss — which
//!   takes no slot and is sent at once — finds room and waits behind at most that share of
//!   write-back. A write-back pass that finds no free slot waits for one before it sends.
//! - **Batches follow the device.** Write-back hands several runs to the device as one batch
//!   (in flight together) only when the device serves more than one request at a time; a
//!   batch never holds more writes than the device's share, so a batch is sent whole.
//!
//! - **Mutation guard.** Every request that changes a device's bytes (a write-back write, a
//!   discard, a zeroing) is counted in that device's [`Mutations`] when it starts and when it
//!   ends. A streaming read ([`Io::read_unguarded_if`], which caches nothing) is good only if no
//!   such request touched its bytes while it was at the device: it looks before (nothing in
//!   flight there) and after (nothing started since).
//!
//! Invariants:
//! - a device's write-back requests in flight never exceed its share, except that one batch
//!   always proceeds when nothing of that device is in flight (no pass waits forever);
//! - every slot taken is given back when the device has answered, before the caller sees
//!   the outcome;
//! - state changes that follow a request (valid, clean, latched errors) are made by the
//!   owners of that state (`handle`, `writeback`, `dirty`), never here.

use std::collections::HashMap;
use std::io::IoSliceMut;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use bufcache_device::{
    total_length, Capabilities, Device, Extent, ReadRequest, WriteMemory, WriteRequest,
};
use parking_lot::Mutex;

use crate::environment::Waiter;
use crate::error::CacheError;
use crate::object::ObjectState;
use crate::stats::Counters;

/// Most writes of one write-back batch: its buffers stay locked until the whole batch is
/// answered, so it is kept to what a long link moves in a round trip or two.
pub(crate) const WRITEBACK_BATCH_WRITES_MAX: usize = 32;

/// Over a device that serves several requests at once, write-back takes at most this
/// fraction (1 / divisor) of them: the rest are left to read misses, which then wait behind
/// at most that much write-back at the device. A quarter rather than half, because a store
/// busy with uploads serves a GET more slowly however many slots are free (measured in
/// docs/design.md, "The io path").
const WRITEBACK_SHARE_DIVISOR: usize = 4;

/// How long a pass waiting for a write-back slot (or for its batch's writes) first sleeps
/// before looking again; each further look waits twice as long, up to `SLOT_POLL_MAX_NS`.
/// Every slot given back and every batch's last completion notifies such a waiter (the
/// `waiting` counts), so these looks only bound a wait whose notification went astray. They
/// are kept long: under memory pressure dozens of writer threads wait here at once, and a
/// short look made each of them wake thousands of times per second for nothing.
const SLOT_POLL_NS: u64 = 1_000_000;
const SLOT_POLL_MAX_NS: u64 = 20_000_000;

/// The mutation guard counts device bytes in regions of 1 << this many bytes (64 KiB)...
const MUTATION_REGION_SHIFT: u32 = 16;
/// ...folded onto this many counters (so a range touches at most this many).
const MUTATION_BUCKETS: usize = 256;

/// Requests that change a device's bytes, counted per region of the device when they start
/// and when they end (see the module notes). Both counts only grow, and a request's end is
/// counted after its start, so a bucket whose two counts are equal has nothing in flight,
/// and a bucket whose start count has not moved saw nothing start.
struct Mutations {
    started: [AtomicU64; MUTATION_BUCKETS],
    ended: [AtomicU64; MUTATION_BUCKETS],
}

impl Mutations {
    fn new() -> Self {
        Mutations {
            started: std::array::from_fn(|_| AtomicU64::new(0)),
            ended: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }

    /// The buckets of the device bytes `[offset, offset + length_bytes)`, each once.
    fn buckets(offset: u64, length_bytes: u64) -> impl Iterator<Item = usize> {
        let first = offset >> MUTATION_REGION_SHIFT;
        let last = (offset + length_bytes.max(1) - 1) >> MUTATION_REGION_SHIFT;
        let count = (last - first + 1).min(MUTATION_BUCKETS as u64);
        (first..first + count).map(|region| (region % MUTATION_BUCKETS as u64) as usize)
    }

    /// Counts the start of a request changing `[offset, offset + length_bytes)`; made before
    /// the request goes to the device.
    fn begin(&self, offset: u64, length_bytes: u64) {
        for bucket in Self::buckets(offset, length_bytes) {
            self.started[bucket].fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Counts the end of a request [`Mutations::begin`] counted; made after the device
    /// answered it.
    fn end(&self, offset: u64, length_bytes: u64) {
        for bucket in Self::buckets(offset, length_bytes) {
            let ended = self.ended[bucket].fetch_add(1, Ordering::SeqCst);
            strict_assert!(
                ended < self.started[bucket].load(Ordering::SeqCst),
                "a mutation ends after it started"
            );
        }
    }

    /// The start count of the range's buckets, if nothing changing them is in flight.
    /// Each bucket's end count is read before its start count: a request in flight then is
    /// in the start count and not yet in the end count.
    fn quiet(&self, offset: u64, length_bytes: u64) -> Option<u64> {
        let mut started_total = 0u64;
        for bucket in Self::buckets(offset, length_bytes) {
            let ended = self.ended[bucket].load(Ordering::SeqCst);
            let started = self.started[bucket].load(Ordering::SeqCst);
            if started != ended {
                return None;
            }
            started_total = started_total.wrapping_add(started);
        }
        Some(started_total)
    }

    /// True when nothing changing the range started since [`Mutations::quiet`] gave
    /// `started_total` (start counts only grow, so an equal sum means no bucket moved).
    fn unchanged_since(&self, offset: u64, length_bytes: u64, started_total: u64) -> bool {
        Self::buckets(offset, length_bytes)
            .map(|bucket| self.started[bucket].load(Ordering::SeqCst))
            .fold(0u64, u64::wrapping_add)
            == started_total
    }
}

/// Write-back's share of one device, and its mutation guard.
struct DeviceSlots {
    /// Write-back requests at the device now.
    writeback_inflight: AtomicUsize,
    /// Passes waiting for a slot: a release wakes waiters only when there are some.
    waiting: AtomicUsize,
    /// The share: write-back requests at the device at once, at most.
    writeback_inflight_max: usize,
    /// Writes one write-back batch carries at most (1: no batches).
    batch_writes_max: usize,
    /// Requests changing the device's bytes, for streaming reads.
    mutations: Mutations,
}

impl DeviceSlots {
    fn new(capabilities: &Capabilities, writeback_inflight_max: usize) -> Self {
        let device_max = capabilities.inflight_requests_max.max(1);
        let share = if device_max > 1 {
            writeback_inflight_max.min((device_max / WRITEBACK_SHARE_DIVISOR).max(1))
        } else {
            writeback_inflight_max
        };
        let batch_writes_max = if device_max > 1 {
            share.min(WRITEBACK_BATCH_WRITES_MAX)
        } else {
            1
        };
        DeviceSlots {
            writeback_inflight: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            writeback_inflight_max: share,
            batch_writes_max,
            mutations: Mutations::new(),
        }
    }

    /// Takes `count` slots if they are free now (or if nothing is in flight, so a batch
    /// larger than the share still goes, alone).
    fn try_take(&self, count: usize) -> bool {
        let mut current = self.writeback_inflight.load(Ordering::Acquire);
        loop {
            if current != 0 && current + count > self.writeback_inflight_max {
                return false;
            }
            match self.writeback_inflight.compare_exchange_weak(
                current,
                current + count,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return true,
                Err(seen) => current = seen,
            }
        }
    }
}

/// What runs when one write of a started write-back ends, with its memory and outcome.
pub(crate) type WriteBackDone<M> = Box<dyn FnOnce(M, std::io::Result<()>) + Send>;

/// The outcomes of one write-back batch, filled in by its completions (on the device's
/// thread, or the submitter's), and waited for through the injected waiter.
struct Outcomes {
    /// One slot per write; each is filled exactly once.
    results: Mutex<Vec<Option<std::io::Result<()>>>>,
    /// Writes not completed yet.
    remaining: AtomicUsize,
    /// Set by the submitter before it first waits, so the last completion wakes the waiter
    /// only when someone sleeps (a device that completes in the caller's thread never
    /// notifies anyone).
    waiting: AtomicBool,
    waiter: Arc<dyn Waiter>,
}

impl Outcomes {
    fn new(count: usize, waiter: Arc<dyn Waiter>) -> Self {
        Outcomes {
            results: Mutex::new((0..count).map(|_| None).collect()),
            remaining: AtomicUsize::new(count),
            waiting: AtomicBool::new(false),
            waiter,
        }
    }

    fn record(&self, index: usize, result: std::io::Result<()>) {
        let previous = self.results.lock()[index].replace(result);
        strict_assert!(previous.is_none(), "a write completes once");
        // SeqCst pairs with the submitter's store of `waiting` and load of `remaining`:
        // either it sees this write done, or this sees it waiting and wakes it.
        if self.remaining.fetch_sub(1, Ordering::SeqCst) == 1 && self.waiting.load(Ordering::SeqCst)
        {
            self.waiter.notify_all();
        }
    }

    /// Waits until every write has completed; their outcomes, in order.
    fn wait_all(&self) -> Vec<std::io::Result<()>> {
        let mut sleep_ns = SLOT_POLL_NS;
        // A device that completes in the caller's thread is done already: no ticket taken.
        while self.remaining.load(Ordering::SeqCst) != 0 {
            // Ticket before the look: the last completion after the look ends the wait.
            let ticket = self.waiter.ticket();
            self.waiting.store(true, Ordering::SeqCst);
            if self.remaining.load(Ordering::SeqCst) == 0 {
                break;
            }
            self.waiter.wait(ticket, sleep_ns);
            sleep_ns = (sleep_ns * 2).min(SLOT_POLL_MAX_NS);
        }
        std::mem::take(&mut *self.results.lock())
            .into_iter()
            .map(|result| result.expect("every write completed"))
            .collect()
    }
}

/// The engine's one path to its devices.
pub(crate) struct Io {
    counters: Arc<Counters>,
    waiter: Arc<dyn Waiter>,
    writeback_inflight_max: usize,
    /// Write-back slots per device, keyed by the device's address (objects that share a
    /// device share its slots).
    slots: Mutex<HashMap<usize, Arc<DeviceSlots>>>,
}

impl Io {
    pub(crate) fn new(
        counters: Arc<Counters>,
        waiter: Arc<dyn Waiter>,
        writeback_inflight_max: usize,
    ) -> Io {
        Io {
            counters,
            waiter,
            writeback_inflight_max,
            slots: Mutex::new(HashMap::new()),
        }
    }

    /// The objects grouped by the device they are stored on (groups in order of first
    /// appearance, objects in order within each).
    pub(crate) fn group_by_device<'a>(
        &self,
        objects: &'a [Arc<ObjectState>],
    ) -> Vec<Vec<&'a Arc<ObjectState>>> {
        let mut groups: Vec<(usize, Vec<&Arc<ObjectState>>)> = Vec::new();
        for object in objects {
            let key = device_key(object);
            match groups.iter_mut().find(|(group_key, _)| *group_key == key) {
                Some((_, group)) => group.push(object),
                None => groups.push((key, vec![object])),
            }
        }
        groups.into_iter().map(|(_, group)| group).collect()
    }

    /// The write-back slots of `object`'s device, made at its first use.
    fn slots(&self, object: &ObjectState) -> Arc<DeviceSlots> {
        let mut slots = self.slots.lock();
        Arc::clone(slots.entry(device_key(object)).or_insert_with(|| {
            Arc::new(DeviceSlots::new(
                &object.device.capabilities(),
                self.writeback_inflight_max,
            ))
        }))
    }

    /// What the object's device can do.
    pub(crate) fn capabilities(&self, object: &ObjectState) -> Capabilities {
        object.device.capabilities()
    }

    /// Writes one write-back batch of `object` carries at most (1 over a device that serves
    /// one request at a time).
    pub(crate) fn batch_writes_max(&self, object: &ObjectState) -> usize {
        self.slots(object).batch_writes_max
    }

    /// True when the object's device serves several requests at once, so write-back passes
    /// in parallel (a flush's helpers) keep more of them busy.
    pub(crate) fn serves_requests_in_parallel(&self, object: &ObjectState) -> bool {
        object.device.capabilities().inflight_requests_max > 1
    }

    /// True when the object's device has a free write-back slot now (or nothing of its
    /// write-back in flight).
    pub(crate) fn writeback_slot_free(&self, object: &ObjectState) -> bool {
        let slots = self.slots(object);
        let inflight = slots.writeback_inflight.load(Ordering::Acquire);
        inflight == 0 || inflight < slots.writeback_inflight_max
    }

    /// Sleeps (through the injected waiter) until one of the device's write-back requests
    /// ends or `timeout_ns` passes, unless a slot is free already. True when a slot is free
    /// or something woke it (the caller should look again at once).
    pub(crate) fn wait_for_writeback_end(&self, object: &ObjectState, timeout_ns: u64) -> bool {
        let slots = self.slots(object);
        slots.waiting.fetch_add(1, Ordering::AcqRel);
        // Ticket before the look: a release after the look ends the wait at once.
        let ticket = self.waiter.ticket();
        let woken = slots.writeback_inflight.load(Ordering::Acquire) < slots.writeback_inflight_max
            || {
                self.waiter.wait(ticket, timeout_ns);
                self.waiter.ticket() != ticket
            };
        slots.waiting.fetch_sub(1, Ordering::AcqRel);
        woken
    }

    /// Write-back requests at all devices now.
    pub(crate) fn writeback_inflight_requests(&self) -> u64 {
        self.slots
            .lock()
            .values()
            .map(|slots| slots.writeback_inflight.load(Ordering::Relaxed) as u64)
            .sum()
    }

    /// A [`CacheError::Device`] for a failed request to `object`'s device.
    pub(crate) fn error(
        &self,
        object: &ObjectState,
        operation: &'static str,
        offset: u64,
        length_bytes: u64,
        source: std::io::Error,
    ) -> CacheError {
        CacheError::Device {
            device: object.device.describe(),
            operation,
            offset,
            length_bytes,
            source,
        }
    }

    /// One vectored read of `slices` at `device_offset`, counted.
    pub(crate) fn read(
        &self,
        object: &ObjectState,
        slices: &mut [IoSliceMut<'_>],
        device_offset: u64,
    ) -> Result<(), CacheError> {
        let length_bytes: u64 = slices.iter().map(|slice| slice.len() as u64).sum();
        let result = object.device.read_vectored_at(slices, device_offset);
        self.counters
            .device_reads
            .record(length_bytes, result.is_ok());
        result.map_err(|source| self.error(object, "read", device_offset, length_bytes, source))
    }

    /// A read of `slices` at `device_offset` for a caller that caches nothing of it (a
    /// streaming read): made only if `still_current` holds before it, and good (true) only
    /// if `still_current` holds after it too and no request changing those device bytes was
    /// in flight before it or started while it was at the device. Otherwise (false) the
    /// slices hold nothing the caller may use.
    ///
    /// Why that suffices: `still_current` says the bytes on the device are the newest (no
    /// newer copy cached, nothing dropped on the way to the device). A write of those bytes
    /// that started before the read began had ended (the device holds its result); one
    /// that started later, or overlapped the read at the device, is seen by the second look,
    /// since its start is counted before it goes to the device and so before the read ends.
    pub(crate) fn read_unguarded_if(
        &self,
        object: &ObjectState,
        slices: &mut [IoSliceMut<'_>],
        device_offset: u64,
        still_current: impl Fn() -> bool,
    ) -> Result<bool, CacheError> {
        let length_bytes: u64 = slices.iter().map(|slice| slice.len() as u64).sum();
        let slots = self.slots(object);
        let Some(started_total) = slots.mutations.quiet(device_offset, length_bytes) else {
            return Ok(false);
        };
        if !still_current() {
            return Ok(false);
        }
        self.read(object, slices, device_offset)?;
        Ok(slots
            .mutations
            .unchanged_since(device_offset, length_bytes, started_total)
            && still_current())
    }

    /// Starts `read` on `object`'s device; it is counted when it ends, before its own
    /// completion runs.
    pub(crate) fn start_read(&self, object: &ObjectState, read: ReadRequest) {
        self.start_reads(object, vec![read]);
    }

    /// Starts every read of `reads` (non-overlapping) on `object`'s device as one batch, so a
    /// device that serves several requests at once has them in flight together; each is
    /// counted when it ends, before its own completion runs.
    pub(crate) fn start_reads(&self, object: &ObjectState, reads: Vec<ReadRequest>) {
        let reads = reads
            .into_iter()
            .map(|read| {
                let length_bytes = read.length_bytes();
                let counters = Arc::clone(&self.counters);
                read.on_complete(move |result| {
                    counters.device_reads.record(length_bytes, result.is_ok());
                    result
                })
            })
            .collect();
        object.device.submit_reads(reads);
    }

    /// Writes each of `writes` (write-back runs of `object`, non-overlapping: a device
    /// offset and the run's memory) and returns one outcome per write, in order, once every
    /// one has completed ([`Io::start_write_back`], then a wait through the injected waiter).
    pub(crate) fn write_back<M: WriteMemory>(
        &self,
        object: &ObjectState,
        writes: Vec<(u64, M)>,
    ) -> Vec<std::io::Result<()>> {
        let outcomes = Arc::new(Outcomes::new(writes.len(), Arc::clone(&self.waiter)));
        let writes = writes
            .into_iter()
            .enumerate()
            .map(|(index, (offset, memory))| {
                let outcomes = Arc::clone(&outcomes);
                let done: WriteBackDone<M> = Box::new(move |memory, result| {
                    // The memory goes before the outcome is seen: nothing of the device's
                    // holds a run once its writer goes on.
                    drop(memory);
                    outcomes.record(index, result);
                });
                (offset, memory, done)
            })
            .collect();
        self.start_write_back(object, writes);
        outcomes.wait_all()
    }

    /// Sends each of `writes` (write-back runs of `object`, non-overlapping: a device offset,
    /// the run's memory and what runs when the write ends) to the device as one batch, in
    /// flight together where the device allows, and returns without waiting for them. Takes
    /// one write-back slot per write first, waiting for free slots; each write gives its slot
    /// back when it ends, is counted, and then runs its `done` with its memory and outcome,
    /// on whichever thread the device completes it.
    pub(crate) fn start_write_back<M: WriteMemory>(
        &self,
        object: &ObjectState,
        writes: Vec<(u64, M, WriteBackDone<M>)>,
    ) {
        let count = writes.len();
        if count == 0 {
            return;
        }
        let slots = self.slots(object);
        self.take_slots(&slots, count);
        if count > 1 {
            self.counters.write_batches.fetch_add(1, Ordering::Relaxed);
            self.counters
                .write_batch_writes
                .fetch_add(count as u64, Ordering::Relaxed);
        }
        let requests = writes
            .into_iter()
            .map(|(offset, memory, done)| {
                let length_bytes = total_length(memory.slices().iter().map(|slice| slice.len()));
                let slots = Arc::clone(&slots);
                let (counters, waiter) = (Arc::clone(&self.counters), Arc::clone(&self.waiter));
                slots.mutations.begin(offset, length_bytes);
                WriteRequest::new(offset, memory, move |memory: M, result| {
                    slots.mutations.end(offset, length_bytes);
                    counters.device_writes.record(length_bytes, result.is_ok());
                    release_slots(&slots, 1, waiter.as_ref());
                    done(memory, result);
                })
            })
            .collect();
        object.device.submit_writes(requests);
    }

    /// Waits until `count` write-back slots of the device are free and takes them.
    fn take_slots(&self, slots: &DeviceSlots, count: usize) {
        if slots.try_take(count) {
            return;
        }
        self.counters
            .writeback_inflight_waits
            .fetch_add(1, Ordering::Relaxed);
        slots.waiting.fetch_add(1, Ordering::AcqRel);
        let mut sleep_ns = SLOT_POLL_NS;
        loop {
            // Ticket before the look: a release after the look ends the wait at once.
            let ticket = self.waiter.ticket();
            if slots.try_take(count) {
                break;
            }
            self.waiter.wait(ticket, sleep_ns);
            sleep_ns = (sleep_ns * 2).min(SLOT_POLL_MAX_NS);
        }
        slots.waiting.fetch_sub(1, Ordering::AcqRel);
    }

    /// Makes every write the device completed durable, counted.
    pub(crate) fn flush(&self, object: &ObjectState) -> Result<(), CacheError> {
        match object.device.flush() {
            Ok(()) => {
                self.counters.device_flushes.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Err(source) => {
                self.counters
                    .device_flush_errors
                    .fetch_add(1, Ordering::Relaxed);
                Err(self.error(object, "flush", 0, 0, source))
            }
        }
    }

    /// Tells the device `length` bytes at `device_offset` are unused.
    pub(crate) fn discard(
        &self,
        object: &ObjectState,
        device_offset: u64,
        length: u64,
    ) -> Result<(), CacheError> {
        let slots = self.slots(object);
        slots.mutations.begin(device_offset, length);
        let result = object.device.discard(device_offset, length);
        slots.mutations.end(device_offset, length);
        result.map_err(|source| self.error(object, "discard", device_offset, length, source))
    }

    /// Writes zeroes over `length` bytes at `device_offset`.
    pub(crate) fn write_zeroes(
        &self,
        object: &ObjectState,
        device_offset: u64,
        length: u64,
    ) -> Result<(), CacheError> {
        let slots = self.slots(object);
        slots.mutations.begin(device_offset, length);
        let result = object.device.write_zeroes(device_offset, length);
        slots.mutations.end(device_offset, length);
        result.map_err(|source| self.error(object, "write_zeroes", device_offset, length, source))
    }

    /// The device's allocation map of `length` bytes at `device_offset`.
    pub(crate) fn extents(
        &self,
        object: &ObjectState,
        device_offset: u64,
        length: u64,
    ) -> Result<Vec<Extent>, CacheError> {
        object
            .device
            .extents(device_offset, length)
            .map_err(|source| self.error(object, "extents", device_offset, length, source))
    }
}

/// Gives `count` write-back slots of a device back, waking passes that wait for one.
fn release_slots(slots: &DeviceSlots, count: usize, waiter: &dyn Waiter) {
    let before = slots.writeback_inflight.fetch_sub(count, Ordering::AcqRel);
    strict_assert!(before >= count, "only slots taken are given back");
    if slots.waiting.load(Ordering::Acquire) > 0 {
        waiter.notify_all();
    }
}

/// What tells devices apart: the address of the object's device (objects opened on one
/// `Arc<dyn Device>` share it).
fn device_key(object: &ObjectState) -> usize {
    Arc::as_ptr(&object.device) as *const () as usize
}
