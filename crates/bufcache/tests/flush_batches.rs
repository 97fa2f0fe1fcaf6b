//! A flush over a device that serves many requests at once hands its dirty runs to the
//! device in batches, in flight together — from the first flush after start on — and stays
//! exact: every run reaches the device, a run whose write fails stays
//! dirty and fails the flush, and a flush writes what was dirty when it started, not what
//! other writers dirty while it runs.
//!
//! Method: a `FaultDevice` adds 2 ms to every write of a `MemoryDevice`; a wrapper above it
//! says the device serves 16 requests at once (as an NBD upstream says 64) and records every
//! batch the cache hands down (a plain write counts as a batch of one).
//! Scattered 4 KiB writes (no two adjacent, so each is its own run) are flushed and the device
//! is read back. The last test injects its own clock and blocks the flush's device write to
//! dirty another block while the flush runs.

// Tests drive the engine from real threads on real time; only the engine itself may not.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::io::{self, IoSlice, IoSliceMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use bufcache::device::write_each_now;
use bufcache::{
    Cache, CacheConfig, Capabilities, Clock, CountingDevice, Device, Environment, Extent,
    FaultDevice, FaultKind, InlineSpawner, MemoryDevice, ObjectConfig, ObjectHandle, Waiter,
};
use bufcache_host::BlockingWaiter;

const DEVICE_BYTES: u64 = 16 << 20;
const BLOCK: u64 = 4096;
/// Blocks dirtied per round: scattered, so each is a run of its own.
const SCATTERED: u64 = 96;

/// Requests the logged device says it serves at once.
const INFLIGHT_REQUESTS: usize = 16;

/// Records the size of every batch handed to the device, which it says serves
/// `INFLIGHT_REQUESTS` requests at once.
struct BatchLog<D> {
    inner: D,
    batches: Mutex<Vec<usize>>,
}

impl<D: Device> BatchLog<D> {
    fn new(inner: D) -> Self {
        BatchLog {
            inner,
            batches: Mutex::new(Vec::new()),
        }
    }

    fn take(&self) -> Vec<usize> {
        std::mem::take(&mut self.batches.lock().unwrap())
    }
}

impl<D: Device> Device for BatchLog<D> {
    fn read_vectored_at(&self, buffers: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<()> {
        self.inner.read_vectored_at(buffers, offset)
    }

    fn write_vectored_at(&self, buffers: &[IoSlice<'_>], offset: u64) -> io::Result<()> {
        self.batches.lock().unwrap().push(1);
        self.inner.write_vectored_at(buffers, offset)
    }

    fn submit_writes(&self, writes: Vec<bufcache::device::WriteRequest>) {
        self.batches.lock().unwrap().push(writes.len());
        self.inner.submit_writes(writes)
    }

    fn submit_reads(&self, reads: Vec<bufcache::device::ReadRequest>) {
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
        Capabilities {
            inflight_requests_max: INFLIGHT_REQUESTS,
            ..self.inner.capabilities()
        }
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }
}

fn block_pattern(block: u64, round: u64) -> Vec<u8> {
    (0..BLOCK)
        .map(|index| (block * 31 + round * 7 + index) as u8)
        .collect()
}

/// A memory device whose every write takes 2 ms.
fn slow_device() -> FaultDevice<MemoryDevice> {
    let slow = FaultDevice::new(MemoryDevice::new(DEVICE_BYTES), 1);
    slow.set_latency(
        FaultKind::Write,
        Duration::from_millis(2),
        Duration::ZERO,
        0.0,
    );
    slow
}

/// The scattered blocks of `round`: every 16th block, shifted by the round.
fn scattered_blocks(round: u64) -> impl Iterator<Item = u64> {
    (0..SCATTERED).map(move |index| index * 16 + round)
}

fn write_round(handle: &ObjectHandle, round: u64) {
    for block in scattered_blocks(round) {
        handle
            .write_at(block * BLOCK, &block_pattern(block, round), false)
            .unwrap();
    }
}

/// A cache (no read-ahead) on `clock` and `waiter` over a counted device whose first write
/// waits at a gate: the device, the receiver that hears the gate reached, and the sender
/// that opens it.
#[allow(clippy::type_complexity)]
fn cache_over_gated_writes(
    clock: Arc<dyn Clock>,
    waiter: Arc<dyn Waiter>,
) -> (
    Cache,
    Arc<CountingDevice<Gated<MemoryDevice>>>,
    mpsc::Receiver<()>,
    mpsc::Sender<()>,
) {
    let (gated, started, release) =
        Gated::new(MemoryDevice::new(DEVICE_BYTES), GatedOperation::Write);
    let cache = Cache::with_environment(
        CacheConfig {
            memory_bytes_max: 8 << 20,
            readahead_size_max_bytes: 0,
            ..CacheConfig::default()
        },
        Environment::new(clock, Arc::new(InlineSpawner), waiter),
    )
    .unwrap();
    (
        cache,
        Arc::new(CountingDevice::new(gated)),
        started,
        release,
    )
}

/// The object over a gated device, shared with the thread that waits at its gate.
fn open_gated<D: Device + 'static>(cache: &Cache, device: &Arc<D>) -> Arc<ObjectHandle> {
    let device = Arc::clone(device) as Arc<dyn Device>;
    Arc::new(
        cache
            .open_object(ObjectConfig::new("gated", device))
            .unwrap(),
    )
}

fn stored_block(device: &dyn Device, block: u64) -> Vec<u8> {
    let mut stored = vec![0u8; BLOCK as usize];
    device
        .read_vectored_at(&mut [IoSliceMut::new(&mut stored)], block * BLOCK)
        .unwrap();
    stored
}

/// A fresh cache (no read-ahead) over the logged slow device: nothing written or flushed yet.
fn open_fresh() -> (
    Cache,
    Arc<BatchLog<FaultDevice<MemoryDevice>>>,
    ObjectHandle,
) {
    let device = Arc::new(BatchLog::new(slow_device()));
    let cache = bufcache_host::system_cache(CacheConfig {
        memory_bytes_max: 8 << 20,
        readahead_size_max_bytes: 0,
        ..CacheConfig::default()
    })
    .unwrap();
    let handle = cache
        .open_object(ObjectConfig::new("slow", device.clone() as Arc<dyn Device>))
        .unwrap();
    (cache, device, handle)
}

/// [`open_fresh`] after one round written and flushed.
fn open_slow() -> (
    Cache,
    Arc<BatchLog<FaultDevice<MemoryDevice>>>,
    ObjectHandle,
) {
    let (cache, device, handle) = open_fresh();
    write_round(&handle, 0);
    handle.flush().unwrap();
    device.take();
    (cache, device, handle)
}

#[test]
fn the_first_flush_after_start_is_batched_like_the_third() {
    // Goal: batching follows what the device says it can take, not a latency the cache has
    // yet to measure, so the first FLUSH of a fresh server is as batched as later ones (it
    // used to go one write at a time and take ten times as long). Method: on a fresh cache,
    // three rounds of 96 scattered blocks, each flushed. Each flush writes every run once;
    // the first must hand them down in batches of more than one write, in no more than
    // 1.5 times the third flush's device requests (helpers split the work differently from
    // run to run, so the counts may differ a little).
    let (_cache, device, handle) = open_fresh();
    let mut rounds = Vec::new();
    for round in 0..3 {
        write_round(&handle, round);
        handle.flush().unwrap();
        let batches = device.take();
        assert_eq!(
            batches.iter().sum::<usize>(),
            SCATTERED as usize,
            "flush {round} wrote each run once ({batches:?})"
        );
        rounds.push(batches);
    }
    assert!(
        rounds[0].iter().any(|&size| size > 1),
        "the first flush went one write at a time: {:?}",
        rounds[0]
    );
    assert!(
        rounds[0].len() * 2 <= rounds[2].len() * 3,
        "the first flush took {} device requests, the third {}: {:?} vs {:?}",
        rounds[0].len(),
        rounds[2].len(),
        rounds[0],
        rounds[2]
    );
}

#[test]
fn a_flush_over_a_slow_device_hands_its_runs_down_in_batches_and_loses_nothing() {
    // Goal: scattered dirty runs reach a slow device as batches of several writes (so a
    // device with a round trip per request keeps them in flight), each run exactly once, and
    // the device holds every byte. Method: 96 scattered blocks, one flush; the batch log
    // must show a batch of more than one write and 96 writes in all.
    let (cache, device, handle) = open_slow();
    let before = cache.stats();
    write_round(&handle, 1);
    handle.flush().unwrap();
    let batches = device.take();
    let largest = batches.iter().copied().max().unwrap_or(0);
    let writes: usize = batches.iter().sum();
    assert!(
        largest > 1,
        "the flush handed the slow device batches of at most {largest} write ({batches:?})"
    );
    assert_eq!(
        writes, SCATTERED as usize,
        "each dirty run is written exactly once ({batches:?})"
    );
    let stats = cache.stats();
    assert!(stats.write_batches > before.write_batches);
    assert_eq!(
        (stats.write_batch_writes - before.write_batch_writes) as usize,
        batches.iter().filter(|&&size| size > 1).sum::<usize>(),
        "the cache counts the batches the device saw"
    );
    for round in 0..2 {
        for block in scattered_blocks(round) {
            assert!(
                stored_block(&device.inner, block) == block_pattern(block, round),
                "block {block} of round {round} did not reach the device"
            );
        }
    }
    assert_eq!(cache.stats().dirty_bytes, 0);
}

#[test]
fn a_run_whose_write_fails_inside_a_batch_stays_dirty_and_fails_the_flush() {
    // Goal: one failed write of a batch fails the flush, keeps exactly that run dirty, and
    // costs the others nothing; the next flush after the device heals writes it. Method: a
    // fault on one block's range during the flush of 96 scattered blocks.
    let (cache, device, handle) = open_slow();
    write_round(&handle, 1);
    let failing_block = 40 * 16 + 1;
    device
        .inner
        .fail_range(FaultKind::Write, failing_block * BLOCK, BLOCK);
    let error = handle
        .flush()
        .expect_err("a flush whose write failed must fail");
    assert!(
        error.to_string().contains("injected write fault"),
        "the flush names the device's error: {error}"
    );
    assert_eq!(
        cache.stats().dirty_bytes,
        BLOCK,
        "only the failed block stays dirty"
    );
    for block in scattered_blocks(1).filter(|&block| block != failing_block) {
        assert!(
            stored_block(&device.inner, block) == block_pattern(block, 1),
            "block {block} of the batch reached the device despite another's failure"
        );
    }
    device.inner.heal();
    handle.flush().unwrap();
    assert!(stored_block(&device.inner, failing_block) == block_pattern(failing_block, 1));
    assert_eq!(cache.stats().dirty_bytes, 0);
}

/// A clock the test sets.
#[derive(Default)]
struct ManualClock(AtomicU64);

impl Clock for ManualClock {
    fn now_ns(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

/// A blocking waiter that counts its waits and tells a wait ended by a notification from one
/// that ran out of time. Every timeout is stretched to `STRETCHED_WAIT`, so a wake-up the
/// engine forgot shows as a timed-out wait (and a long one) instead of being covered by the
/// engine's next look.
#[derive(Default)]
struct ObservedWaiter {
    inner: BlockingWaiter,
    waits: AtomicU64,
    timed_out: AtomicU64,
}

const STRETCHED_WAIT: Duration = Duration::from_secs(30);

impl Waiter for ObservedWaiter {
    fn ticket(&self) -> u64 {
        self.inner.ticket()
    }

    fn wait(&self, ticket: u64, _timeout_ns: u64) {
        self.waits.fetch_add(1, Ordering::SeqCst);
        self.inner.wait(ticket, STRETCHED_WAIT.as_nanos() as u64);
        if self.inner.ticket() == ticket {
            self.timed_out.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn notify_all(&self) {
        self.inner.notify_all();
    }
}

/// Which request a [`Gated`] device holds.
#[derive(Clone, Copy, PartialEq)]
enum GatedOperation {
    Write,
    Discard,
}

/// Holds its first request of one kind until the test lets it go, after saying it started.
struct Gated<D> {
    inner: D,
    operation: GatedOperation,
    started: Mutex<Option<mpsc::Sender<()>>>,
    release: Mutex<mpsc::Receiver<()>>,
}

impl<D> Gated<D> {
    /// A gated device, the receiver that hears when the gate is reached, and the sender
    /// that opens it.
    fn new(inner: D, operation: GatedOperation) -> (Self, mpsc::Receiver<()>, mpsc::Sender<()>) {
        let (started_sender, started) = mpsc::channel();
        let (release, release_receiver) = mpsc::channel();
        let device = Gated {
            inner,
            operation,
            started: Mutex::new(Some(started_sender)),
            release: Mutex::new(release_receiver),
        };
        (device, started, release)
    }

    fn gate(&self, operation: GatedOperation) {
        if operation != self.operation {
            return;
        }
        if let Some(started) = self.started.lock().unwrap().take() {
            started.send(()).unwrap();
            self.release.lock().unwrap().recv().unwrap();
        }
    }
}

impl<D: Device> Device for Gated<D> {
    fn read_vectored_at(&self, buffers: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<()> {
        self.inner.read_vectored_at(buffers, offset)
    }

    fn write_vectored_at(&self, buffers: &[IoSlice<'_>], offset: u64) -> io::Result<()> {
        self.gate(GatedOperation::Write);
        self.inner.write_vectored_at(buffers, offset)
    }

    fn submit_writes(&self, writes: Vec<bufcache::device::WriteRequest>) {
        write_each_now(self, writes)
    }

    fn submit_reads(&self, reads: Vec<bufcache::device::ReadRequest>) {
        bufcache::device::read_each_now(self, reads)
    }

    fn flush(&self) -> io::Result<()> {
        self.inner.flush()
    }

    fn discard(&self, offset: u64, length: u64) -> io::Result<()> {
        self.gate(GatedOperation::Discard);
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

#[test]
fn a_flush_leaves_blocks_dirtied_after_it_started_to_the_next_flush() {
    // Goal: a flush makes durable what was written before it started and does not chase
    // blocks other writers dirty while it runs (over a busy upstream that made each FLUSH
    // wait for everyone's newer writes). Method: block 0 is written at t = 1 s and a flush
    // starts at t = 2 s; while the flush's write of block 0 is held in the device, block 64
    // is written at t = 3 s. The flush writes block 0 only; block 64 stays dirty until the
    // next flush, which writes it.
    let clock = Arc::new(ManualClock::default());
    let (cache, device, started, release) = cache_over_gated_writes(
        clock.clone() as Arc<dyn Clock>,
        Arc::new(BlockingWaiter::default()),
    );
    let handle = open_gated(&cache, &device);
    clock.0.store(1_000_000_000, Ordering::SeqCst);
    handle.write_at(0, &block_pattern(0, 1), false).unwrap();
    clock.0.store(2_000_000_000, Ordering::SeqCst);
    let flusher = {
        let handle = Arc::clone(&handle);
        std::thread::spawn(move || handle.flush())
    };
    started.recv().unwrap();
    clock.0.store(3_000_000_000, Ordering::SeqCst);
    handle
        .write_at(64 * BLOCK, &block_pattern(64, 1), false)
        .unwrap();
    release.send(()).unwrap();
    flusher.join().unwrap().unwrap();
    assert_eq!(
        device.stats().writes.requests,
        1,
        "the flush wrote only the block dirty when it started"
    );
    assert!(stored_block(device.as_ref(), 0) == block_pattern(0, 1));
    assert_eq!(cache.stats().dirty_bytes, BLOCK, "block 64 is still dirty");
    handle.flush().unwrap();
    assert!(stored_block(device.as_ref(), 64) == block_pattern(64, 1));
    assert_eq!(cache.stats().dirty_bytes, 0);
}

#[test]
fn a_flush_waits_for_a_discard_that_dropped_dirty_blocks_it_covers() {
    // Goal: a discard drops its range's dirty blocks before the device discards the range;
    // a FLUSH arriving in between finds nothing of them to write, and must still not answer
    // before the discard reached the device, or a crash could leave neither the writes it
    // covers nor the discard. Method: a write of block 0; a discard of it held at the
    // device's gate; a flush from another thread must not end while the gate is closed,
    // and ends once it opens.
    let (gated, started, release) =
        Gated::new(MemoryDevice::new(DEVICE_BYTES), GatedOperation::Discard);
    let device = Arc::new(gated);
    let cache = bufcache_host::system_cache(CacheConfig {
        memory_bytes_max: 8 << 20,
        readahead_size_max_bytes: 0,
        ..CacheConfig::default()
    })
    .unwrap();
    let handle = open_gated(&cache, &device);
    handle.write_at(0, &block_pattern(0, 1), false).unwrap();
    let discarder = {
        let handle = Arc::clone(&handle);
        std::thread::spawn(move || handle.discard(0, BLOCK))
    };
    started.recv().unwrap();
    let (flushed_sender, flushed) = mpsc::channel();
    let flusher = {
        let handle = Arc::clone(&handle);
        std::thread::spawn(move || flushed_sender.send(handle.flush()).unwrap())
    };
    assert!(
        flushed.recv_timeout(Duration::from_millis(300)).is_err(),
        "the flush answered while the discard of a block it covers was not on the device"
    );
    release.send(()).unwrap();
    discarder.join().unwrap().unwrap();
    flushed
        .recv_timeout(Duration::from_secs(10))
        .expect("the flush ends once the discard is done")
        .unwrap();
    flusher.join().unwrap();
}

#[test]
fn a_flush_waiting_for_another_write_back_is_woken_when_it_ends() {
    // Goal: a flush that finds a block's write-back in flight on another thread learns of
    // its end from that thread, not at its next look after a sleep (which outlasted a local
    // file's write and added ~180 µs to one FLUSH in nine). Method: the first flush's write
    // of block 0 is held at the device's gate; a second flush then waits for that
    // write-back (seen as a wait on an observed waiter whose timeouts are stretched to
    // 30 s); the gate opens. The second flush must end through a notification: no wait of
    // the observed waiter may run out of time, and the block is written once.
    let waiter = Arc::new(ObservedWaiter::default());
    let (cache, device, started, release) = cache_over_gated_writes(
        Arc::new(ManualClock::default()),
        waiter.clone() as Arc<dyn Waiter>,
    );
    let handle = open_gated(&cache, &device);
    handle.write_at(0, &block_pattern(0, 1), false).unwrap();
    let flush_on_thread = || {
        let handle = Arc::clone(&handle);
        std::thread::spawn(move || handle.flush())
    };
    let first = flush_on_thread();
    started.recv().unwrap();
    let second = flush_on_thread();
    while waiter.waits.load(Ordering::SeqCst) == 0 {
        std::thread::sleep(Duration::from_millis(1));
    }
    release.send(()).unwrap();
    first.join().unwrap().unwrap();
    second.join().unwrap().unwrap();
    assert_eq!(
        waiter.timed_out.load(Ordering::SeqCst),
        0,
        "a wait for the write-back's end ran out of time instead of being woken"
    );
    assert_eq!(
        device.stats().writes.requests,
        1,
        "block 0 was written once"
    );
    assert!(stored_block(device.as_ref(), 0) == block_pattern(0, 1));
    assert_eq!(cache.stats().dirty_bytes, 0);
}
