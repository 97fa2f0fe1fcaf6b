//! The engine's one io path: every device request leaves through the `io` module, write-back
//! keeps to a bounded share of a device's in-flight requests, and a read miss is never queued
//! behind write-back.
//!
//! Method: a source scan for device calls outside `io.rs`, and a device that says it serves
//! sixteen requests at once and holds every write at a gate until the test opens it, so the
//! write-back in flight can be counted while a flush is stuck on it; and one that completes
//! writes later, on a thread of its own, so the background tick can be seen not to wait.

// Tests drive the engine from real threads on real time; only the engine itself may not.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::io::{self, IoSlice, IoSliceMut};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use bufcache::{CacheConfig, Capabilities, Device, Extent, MemoryDevice, ObjectConfig};

const BLOCK: u64 = 4096;
const DEVICE_BYTES: u64 = 16 << 20;
/// Requests the gated device says it serves at once; write-back may take a quarter.
const DEVICE_INFLIGHT_REQUESTS: usize = 16;
const WRITEBACK_SHARE: usize = DEVICE_INFLIGHT_REQUESTS / 4;

#[test]
fn only_the_io_module_calls_a_device() {
    // Goal: one module issues every device request, so bounds, accounting and a future
    // io_uring or local tier have one place to go. Method: scan the engine's sources (comments
    // dropped) for calls of the Device trait's request methods on a device (queries of its
    // shape, `capabilities` and `describe`, are not requests); only io.rs may have them.
    let source = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let requests = [
        "read_vectored_at(",
        "write_vectored_at(",
        "submit_reads(",
        "submit_writes(",
        "flush(",
        "discard(",
        "write_zeroes(",
        "extents(",
    ];
    let mut offenders = Vec::new();
    for entry in std::fs::read_dir(&source).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if name == "io.rs" || path.extension().is_none_or(|extension| extension != "rs") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        for (number, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            for request in requests {
                if code.contains(&format!("device.{request}"))
                    || code.contains(&format!("device().{request}"))
                {
                    offenders.push(format!("{name}:{}: {}", number + 1, line.trim()));
                }
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "device calls outside io.rs:\n{}",
        offenders.join("\n")
    );
}

/// Writes wait at the gate while it is closed; reads pass.
#[derive(Default)]
struct Gate {
    state: Mutex<GateState>,
    changed: Condvar,
}

#[derive(Default)]
struct GateState {
    open: bool,
    writes_inflight: usize,
    writes_inflight_peak: usize,
}

/// A memory device that says it serves `DEVICE_INFLIGHT_REQUESTS` at once and holds writes
/// at its gate, counting how many are in flight.
struct GatedWrites {
    inner: MemoryDevice,
    gate: Arc<Gate>,
}

impl GatedWrites {
    fn enter(&self, count: usize) {
        let mut state = self.gate.state.lock().unwrap();
        state.writes_inflight += count;
        state.writes_inflight_peak = state.writes_inflight_peak.max(state.writes_inflight);
        self.gate.changed.notify_all();
        while !state.open {
            state = self.gate.changed.wait(state).unwrap();
        }
    }
}

impl Gate {
    fn leave(&self, count: usize) {
        let mut state = self.state.lock().unwrap();
        state.writes_inflight -= count;
        self.changed.notify_all();
    }
}

impl Device for GatedWrites {
    fn read_vectored_at(&self, buffers: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<()> {
        self.inner.read_vectored_at(buffers, offset)
    }
    fn write_vectored_at(&self, buffers: &[IoSlice<'_>], offset: u64) -> io::Result<()> {
        self.enter(1);
        let result = self.inner.write_vectored_at(buffers, offset);
        self.gate.leave(1);
        result
    }
    /// Each write leaves the count as it completes (its slot is given back then).
    fn submit_writes(&self, writes: Vec<bufcache::device::WriteRequest>) {
        self.enter(writes.len());
        let writes = writes
            .into_iter()
            .map(|write| {
                let gate = Arc::clone(&self.gate);
                write.on_complete(move |result| {
                    gate.leave(1);
                    result
                })
            })
            .collect();
        self.inner.submit_writes(writes);
    }
    fn submit_reads(&self, reads: Vec<bufcache::device::ReadRequest>) {
        bufcache::device::read_each_now(self, reads)
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
            inflight_requests_max: DEVICE_INFLIGHT_REQUESTS,
            ..self.inner.capabilities()
        }
    }
    fn describe(&self) -> String {
        "gated writes".into()
    }
}

fn pattern(block: u64) -> Vec<u8> {
    (0..BLOCK).map(|index| (block * 13 + index) as u8).collect()
}

#[test]
fn writeback_keeps_to_its_share_and_a_read_miss_passes_it() {
    // Goal: a flush of many scattered runs (with its helper jobs) never has more than its
    // share of the device's in-flight requests out at once, and a read miss meanwhile goes
    // to the device at once instead of queueing behind the write-back. Method: 128 scattered
    // dirty blocks over the gated device, a flush on another thread; once write-back fills
    // its share at the closed gate and another pass waits for a slot, read an uncached block
    // on this thread (it must return while the gate is still closed), then open the gate and
    // check the flush wrote all.
    let gate = Arc::new(Gate::default());
    let device = Arc::new(GatedWrites {
        inner: MemoryDevice::new(DEVICE_BYTES),
        gate: Arc::clone(&gate),
    });
    let cache = bufcache_host::system_cache(CacheConfig {
        memory_bytes_max: 8 << 20,
        readahead_bytes_max: 0,
        ..CacheConfig::default()
    })
    .unwrap();
    let handle = Arc::new(
        cache
            .open_object(ObjectConfig::new(
                "gated",
                Arc::clone(&device) as Arc<dyn Device>,
            ))
            .unwrap(),
    );
    let blocks: Vec<u64> = (0..128).map(|index| index * 8).collect();
    for &block in &blocks {
        handle
            .write_at(block * BLOCK, &pattern(block), false)
            .unwrap();
    }
    let flusher = {
        let handle = Arc::clone(&handle);
        std::thread::spawn(move || handle.flush())
    };
    {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut state = gate.state.lock().unwrap();
        while state.writes_inflight < WRITEBACK_SHARE {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "write-back never filled its share");
            state = gate.changed.wait_timeout(state, left).unwrap().0;
        }
    }
    // Write-back holds its share at the closed gate; the flush's helpers, with runs of their
    // own to write, must come to wait for a slot.
    let deadline = Instant::now() + Duration::from_secs(20);
    while cache.stats().writeback_inflight_waits == 0 {
        assert!(
            Instant::now() < deadline,
            "no write-back pass waited for a slot while the share was full"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    // The gate is closed and write-back holds its share: a read miss must still complete.
    let mut read = vec![0u8; BLOCK as usize];
    handle.read_at(3 * BLOCK, &mut read).unwrap();
    assert!(read.iter().all(|&byte| byte == 0));
    {
        let mut state = gate.state.lock().unwrap();
        assert!(!state.open, "the read finished while write-back was stuck");
        state.open = true;
        gate.changed.notify_all();
    }
    flusher.join().unwrap().unwrap();
    let peak = gate.state.lock().unwrap().writes_inflight_peak;
    assert!(
        peak <= WRITEBACK_SHARE,
        "{peak} write-back requests were in flight at once; the share is {WRITEBACK_SHARE}"
    );
    assert_eq!(cache.stats().writeback_inflight_requests, 0);
    for &block in &blocks {
        let mut stored = vec![0u8; BLOCK as usize];
        device
            .read_vectored_at(&mut [IoSliceMut::new(&mut stored)], block * BLOCK)
            .unwrap();
        assert!(
            stored == pattern(block),
            "block {block} did not reach the device"
        );
    }
}

/// A memory device that completes writes later, on a thread of its own, once its gate is
/// open (as an NBD upstream's reply thread does), counting how many are in flight.
struct LaterWrites {
    inner: Arc<MemoryDevice>,
    gate: Arc<Gate>,
}

impl Device for LaterWrites {
    fn read_vectored_at(&self, buffers: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<()> {
        self.inner.read_vectored_at(buffers, offset)
    }
    fn write_vectored_at(&self, buffers: &[IoSlice<'_>], offset: u64) -> io::Result<()> {
        self.inner.write_vectored_at(buffers, offset)
    }
    fn submit_writes(&self, writes: Vec<bufcache::device::WriteRequest>) {
        let (inner, gate) = (Arc::clone(&self.inner), Arc::clone(&self.gate));
        let count = writes.len();
        {
            let mut state = gate.state.lock().unwrap();
            state.writes_inflight += count;
            state.writes_inflight_peak = state.writes_inflight_peak.max(state.writes_inflight);
            gate.changed.notify_all();
        }
        std::thread::spawn(move || {
            let mut state = gate.state.lock().unwrap();
            while !state.open {
                state = gate.changed.wait(state).unwrap();
            }
            drop(state);
            bufcache::device::write_each_now(inner.as_ref(), writes);
            gate.leave(count);
        });
    }
    fn submit_reads(&self, reads: Vec<bufcache::device::ReadRequest>) {
        bufcache::device::read_each_now(self, reads)
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
            inflight_requests_max: DEVICE_INFLIGHT_REQUESTS,
            completes_later: true,
            ..self.inner.capabilities()
        }
    }
    fn describe(&self) -> String {
        "later writes".into()
    }
}

#[test]
fn the_tick_sends_aged_writes_without_waiting_and_a_flush_waits_for_them() {
    // Goal: background write-back is 4.4BSD's bawrite: the tick sends aged dirty runs and
    // returns while the device still holds them (their blocks stay dirty until each write
    // ends), and a FLUSH arriving meanwhile covers them: it returns only after they ended,
    // with every block on the device. Method: a device that completes writes later, after
    // its gate opens; as many scattered dirty blocks as write-back's share, aged at once
    // (dirty_age_max 0); tick; the writes must be at the closed gate with the tick
    // returned; a flush on another thread must still be waiting 100 ms later; open the gate.
    let gate = Arc::new(Gate::default());
    let memory = Arc::new(MemoryDevice::new(DEVICE_BYTES));
    let device = Arc::new(LaterWrites {
        inner: Arc::clone(&memory),
        gate: Arc::clone(&gate),
    });
    let cache = bufcache_host::system_cache(CacheConfig {
        memory_bytes_max: 8 << 20,
        readahead_bytes_max: 0,
        dirty_age_max: Duration::ZERO,
        ..CacheConfig::default()
    })
    .unwrap();
    let handle = Arc::new(
        cache
            .open_object(ObjectConfig::new(
                "later",
                Arc::clone(&device) as Arc<dyn Device>,
            ))
            .unwrap(),
    );
    let blocks: Vec<u64> = (0..WRITEBACK_SHARE as u64).map(|index| index * 8).collect();
    for &block in &blocks {
        handle
            .write_at(block * BLOCK, &pattern(block), false)
            .unwrap();
    }
    cache.writeback_tick();
    assert_eq!(
        gate.state.lock().unwrap().writes_inflight,
        blocks.len(),
        "the tick returned with its writes at the device"
    );
    assert_eq!(
        cache.stats().dirty_bytes,
        blocks.len() as u64 * BLOCK,
        "blocks stay dirty until their write ends"
    );
    let flusher = {
        let handle = Arc::clone(&handle);
        std::thread::spawn(move || handle.flush())
    };
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        !flusher.is_finished(),
        "a flush returned before the writes it covers ended"
    );
    {
        let mut state = gate.state.lock().unwrap();
        state.open = true;
        gate.changed.notify_all();
    }
    flusher.join().unwrap().unwrap();
    assert_eq!(cache.stats().dirty_bytes, 0);
    assert_eq!(cache.stats().writeback_inflight_requests, 0);
    for &block in &blocks {
        let mut stored = vec![0u8; BLOCK as usize];
        memory
            .read_vectored_at(&mut [IoSliceMut::new(&mut stored)], block * BLOCK)
            .unwrap();
        assert!(stored == pattern(block), "block {block} is on the device");
    }
}

#[test]
fn cleaning_above_the_dirty_thresholds_sends_batches_of_the_writeback_share() {
    // Goal: a writer throttled at the dirty limit (and the tick's pass above the background
    // threshold) writes back a batch of clusters at once over a device that serves requests
    // in parallel, not one cluster per round trip: over a remote disk, one write at a time
    // made a throttled burst of random 4 KiB writes run at one round trip per block. Method:
    // the gated device with its gate open records the most writes it was handed at once;
    // 2,048 scattered 4 KiB writes into an 8 MiB cache whose dirty limit is 20 % must be
    // throttled, must have reached the device in batches of more than one write and at most
    // the write-back share before any flush, and must all be on the device after one.
    let gate = Arc::new(Gate::default());
    gate.state.lock().unwrap().open = true;
    let device = Arc::new(GatedWrites {
        inner: MemoryDevice::new(DEVICE_BYTES),
        gate: Arc::clone(&gate),
    });
    let cache = bufcache_host::system_cache(CacheConfig {
        memory_bytes_max: 8 << 20,
        readahead_bytes_max: 0,
        dirty_background_percent: 10,
        dirty_limit_percent: 20,
        ..CacheConfig::default()
    })
    .unwrap();
    let handle = cache
        .open_object(ObjectConfig::new(
            "throttled",
            Arc::clone(&device) as Arc<dyn Device>,
        ))
        .unwrap();
    let blocks: Vec<u64> = (0..2048).map(|index| index * 2).collect();
    for &block in &blocks {
        handle
            .write_at(block * BLOCK, &pattern(block), false)
            .unwrap();
    }
    assert!(
        cache.stats().throttled_writes > 0,
        "no writer was throttled"
    );
    // Taken before the flush, whose own passes send batches anyway.
    let peak = gate.state.lock().unwrap().writes_inflight_peak;
    handle.flush().unwrap();
    assert!(
        peak > 1 && peak <= WRITEBACK_SHARE,
        "write-back above the thresholds handed the device {peak} writes at once; \
         expected batches of 2..={WRITEBACK_SHARE}"
    );
    for &block in &blocks {
        let mut stored = vec![0u8; BLOCK as usize];
        device
            .read_vectored_at(&mut [IoSliceMut::new(&mut stored)], block * BLOCK)
            .unwrap();
        assert!(
            stored == pattern(block),
            "block {block} is not on the device"
        );
    }
}

/// A memory device that says it serves many requests at once, records the size of every
/// `submit_reads` batch and fails every read that touches `failing_offset`.
struct BatchedReads {
    inner: MemoryDevice,
    batches: Mutex<Vec<usize>>,
    failing_offset: u64,
}

impl Device for BatchedReads {
    fn read_vectored_at(&self, buffers: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<()> {
        let length: u64 = buffers.iter().map(|buffer| buffer.len() as u64).sum();
        if (offset..offset + length).contains(&self.failing_offset) {
            return Err(io::Error::other("injected read error"));
        }
        self.inner.read_vectored_at(buffers, offset)
    }
    fn write_vectored_at(&self, buffers: &[IoSlice<'_>], offset: u64) -> io::Result<()> {
        self.inner.write_vectored_at(buffers, offset)
    }
    fn submit_writes(&self, writes: Vec<bufcache::device::WriteRequest>) {
        bufcache::device::write_each_now(self, writes)
    }
    fn submit_reads(&self, reads: Vec<bufcache::device::ReadRequest>) {
        self.batches.lock().unwrap().push(reads.len());
        bufcache::device::read_each_now(self, reads)
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
            inflight_requests_max: DEVICE_INFLIGHT_REQUESTS,
            ..self.inner.capabilities()
        }
    }
    fn describe(&self) -> String {
        "batched reads".into()
    }
}

#[test]
fn a_readahead_window_reaches_a_parallel_device_as_one_batch_and_a_failed_run_is_not_cached() {
    // Goal: over a device that serves many requests at once (an object store) a read-ahead
    // window larger than a cluster is in flight together: its runs reach the device as one
    // `submit_reads` batch, not one background job per run (which held a 20 ms store to the
    // background pool's four threads). Each run's blocks are cached when it ends; a run the
    // device fails is not cached, and the reader meets the error itself. Method: a memory
    // device holding a pattern, recording each read batch's size and failing reads that
    // touch one block near the end; 64 KiB clusters and 1 MiB windows; read 8 MiB
    // sequentially in 64 KiB pieces; some batch must hold several runs, every piece but the
    // failing one must read back exactly, and that one must fail.
    const READ_BYTES: u64 = 64 << 10;
    const FAILING_OFFSET: u64 = (7 << 20) + (5 << 12);
    let memory = MemoryDevice::new(DEVICE_BYTES);
    for block in 0..DEVICE_BYTES / BLOCK {
        memory
            .write_vectored_at(&[IoSlice::new(&pattern(block))], block * BLOCK)
            .unwrap();
    }
    let device = Arc::new(BatchedReads {
        inner: memory,
        batches: Mutex::new(Vec::new()),
        failing_offset: FAILING_OFFSET,
    });
    let cache = bufcache_host::system_cache(CacheConfig {
        memory_bytes_max: 32 << 20,
        cluster_bytes_max: 64 << 10,
        readahead_bytes_max: 1 << 20,
        readahead_size_initial_bytes: 1 << 20,
        ..CacheConfig::default()
    })
    .unwrap();
    let handle = cache
        .open_object(ObjectConfig::new(
            "batched",
            Arc::clone(&device) as Arc<dyn Device>,
        ))
        .unwrap();
    for offset in (0..8 << 20).step_by(READ_BYTES as usize) {
        let mut piece = vec![0u8; READ_BYTES as usize];
        let result = handle.read_at(offset, &mut piece);
        if (offset..offset + READ_BYTES).contains(&FAILING_OFFSET) {
            assert!(
                result.is_err(),
                "the piece at {offset} read the failed block"
            );
            continue;
        }
        result.unwrap_or_else(|error| panic!("piece at {offset}: {error}"));
        for (index, block) in piece.chunks(BLOCK as usize).enumerate() {
            let number = offset / BLOCK + index as u64;
            assert!(block == pattern(number), "block {number} read back wrong");
        }
    }
    let batches = device.batches.lock().unwrap().clone();
    assert!(
        batches.iter().any(|&reads| reads > 1),
        "every read-ahead run went alone: batches {batches:?}"
    );
}
