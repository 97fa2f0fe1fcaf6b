//! A read whose blocks are all missing can be started and left: the device ends it on a
//! thread of its own, and the completion gets exactly the bytes a synchronous read would,
//! with the same accounting; anything else is not started, and a failed start caches nothing.
//!
//! Method: `LaterDevice` wraps a `MemoryDevice` and says its reads complete later; each
//! started read is filled and completed by a thread of its own after a short pause (as an
//! NBD client's reply thread would). Its reads can be held at a gate and made to fail.

// Tests drive the engine from real threads on real time; only the engine itself may not.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::io::{self, IoSlice, IoSliceMut};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use bufcache::device::{read_each_now, write_each_now};
use bufcache::{
    Cache, CacheConfig, CacheError, Capabilities, Device, Extent, MemoryDevice, ObjectConfig,
    ObjectHandle, StartedRead,
};

const DEVICE_BYTES: u64 = 4 << 20;
const BLOCK: u64 = 4096;

/// A memory device whose started reads end on a thread of their own.
struct LaterDevice {
    inner: Arc<MemoryDevice>,
    reads: AtomicU64,
    /// Lengths of the reads started, in order.
    started_lengths: Mutex<Vec<u64>>,
    failing: AtomicBool,
    /// When set, each started read waits for a message here before it ends.
    gate: Mutex<Option<mpsc::Receiver<()>>>,
}

impl LaterDevice {
    fn new(inner: MemoryDevice) -> Self {
        LaterDevice {
            inner: Arc::new(inner),
            reads: AtomicU64::new(0),
            started_lengths: Mutex::new(Vec::new()),
            failing: AtomicBool::new(false),
            gate: Mutex::new(None),
        }
    }

    /// Ends `read` later, on a thread of its own.
    fn start_one(&self, read: bufcache::device::ReadRequest) {
        self.reads.fetch_add(1, Ordering::SeqCst);
        self.started_lengths
            .lock()
            .unwrap()
            .push(read.length_bytes());
        let failing = self.failing.load(Ordering::SeqCst);
        let gate = self.gate.lock().unwrap().take();
        let inner = Arc::clone(&self.inner);
        std::thread::spawn(move || {
            match gate {
                Some(gate) => gate.recv().unwrap(),
                None => std::thread::sleep(Duration::from_millis(5)),
            }
            if failing {
                return read.complete(Err(io::Error::other("injected read fault")));
            }
            read_each_now(inner.as_ref(), vec![read]);
        });
    }
}

impl Device for LaterDevice {
    fn read_vectored_at(&self, buffers: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<()> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        if self.failing.load(Ordering::SeqCst) {
            return Err(io::Error::other("injected read fault"));
        }
        self.inner.read_vectored_at(buffers, offset)
    }

    fn write_vectored_at(&self, buffers: &[IoSlice<'_>], offset: u64) -> io::Result<()> {
        self.inner.write_vectored_at(buffers, offset)
    }

    fn submit_writes(&self, writes: Vec<bufcache::device::WriteRequest>) {
        write_each_now(self, writes)
    }

    fn submit_reads(&self, reads: Vec<bufcache::device::ReadRequest>) {
        for read in reads {
            self.start_one(read);
        }
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
            completes_later: true,
            ..self.inner.capabilities()
        }
    }

    fn describe(&self) -> String {
        "later".into()
    }
}

fn pattern(length: usize, seed: u64) -> Vec<u8> {
    (0..length as u64)
        .map(|index| ((index / BLOCK) * 131 + index * 7 + seed) as u8)
        .collect()
}

/// A cache (no read-ahead unless asked) over a device holding `pattern(DEVICE_BYTES, 1)`.
fn setup(readahead_bytes_max: u64) -> (Cache, Arc<LaterDevice>, ObjectHandle, Vec<u8>) {
    let contents = pattern(DEVICE_BYTES as usize, 1);
    let memory = MemoryDevice::new(DEVICE_BYTES);
    memory
        .write_vectored_at(&[IoSlice::new(&contents)], 0)
        .unwrap();
    let device = Arc::new(LaterDevice::new(memory));
    let cache = bufcache_host::system_cache(CacheConfig {
        memory_bytes_max: 16 << 20,
        readahead_bytes_max,
        ..CacheConfig::default()
    })
    .unwrap();
    let handle = cache
        .open_object(ObjectConfig::new(
            "later",
            device.clone() as Arc<dyn Device>,
        ))
        .unwrap();
    (cache, device, handle, contents)
}

/// Starts a read and returns the receiver of its outcome, with the completing thread's id.
type Outcome = (Result<Vec<u8>, CacheError>, std::thread::ThreadId);

fn start(handle: &ObjectHandle, offset: u64, length: u64) -> mpsc::Receiver<Outcome> {
    let (sender, receiver) = mpsc::channel();
    let done = Box::new(move |outcome: Result<StartedRead, CacheError>| {
        let bytes = outcome.map(|data| data.slices().iter().flat_map(|s| s.to_vec()).collect());
        sender.send((bytes, std::thread::current().id())).unwrap();
    });
    if handle.start_read(offset, length, done).is_err() {
        panic!("the read of {length} bytes at {offset} was not started");
    }
    receiver
}

#[test]
fn a_started_read_ends_on_the_device_thread_with_the_bytes_and_counts_like_a_read() {
    // Goal: a started read of missing blocks returns at once and its completion, on the
    // device's thread, gets exactly the requested bytes (unaligned ends included); its blocks
    // count as misses once and come from one device read; afterwards they are cached hits.
    let (cache, device, handle, contents) = setup(0);
    let (offset, length) = (3 * BLOCK + 100, 5 * BLOCK);
    let before = cache.stats();
    let receiver = start(&handle, offset, length);
    let (bytes, thread) = receiver.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_ne!(
        thread,
        std::thread::current().id(),
        "it ended on the device's thread"
    );
    let bytes = bytes.unwrap();
    assert!(bytes == contents[offset as usize..(offset + length) as usize]);
    let stats = cache.stats();
    assert_eq!(
        stats.misses - before.misses,
        6,
        "blocks 3..=8 missed once each"
    );
    assert_eq!(device.reads.load(Ordering::SeqCst), 1, "one device read");
    let mut back = vec![0u8; length as usize];
    handle.read_at(offset, &mut back).unwrap();
    assert!(back == bytes);
    assert_eq!(
        cache.stats().hits - stats.hits,
        6,
        "then every block is a hit"
    );
    assert_eq!(device.reads.load(Ordering::SeqCst), 1);
}

#[test]
fn only_reads_of_wholly_missing_blocks_over_a_device_that_reads_later_are_started() {
    // Goal: a read with a block cached, an empty read, and a read over a device whose reads
    // finish in the caller's thread are handed back (the caller reads as usual), without
    // counting or caching anything.
    let (cache, _device, handle, _) = setup(0);
    let mut one = vec![0u8; BLOCK as usize];
    handle.read_at(4 * BLOCK, &mut one).unwrap();
    let before = cache.stats();
    let refuse = |handle: &ObjectHandle, offset: u64, length: u64| {
        let done = Box::new(|_: Result<StartedRead, CacheError>| panic!("not started"));
        assert!(handle.start_read(offset, length, done).is_err());
    };
    refuse(&handle, 2 * BLOCK, 4 * BLOCK);
    refuse(&handle, 0, 0);
    let stats = cache.stats();
    assert_eq!((stats.hits, stats.misses), (before.hits, before.misses));
    assert_eq!(stats.reads_started, 0);

    let plain = bufcache_host::system_cache(CacheConfig::default()).unwrap();
    let memory: Arc<dyn Device> = Arc::new(MemoryDevice::new(DEVICE_BYTES));
    let plain_handle = plain
        .open_object(ObjectConfig::new("plain", memory))
        .unwrap();
    refuse(&plain_handle, 0, BLOCK);
}

#[test]
fn a_failed_started_read_reports_the_device_error_and_caches_nothing() {
    // Goal: when the device fails a started read, the completion gets the device's error,
    // none of the blocks stays cached and none is counted, so a later read goes to the
    // device again and counts once.
    let (cache, device, handle, contents) = setup(0);
    device.failing.store(true, Ordering::SeqCst);
    let before = cache.stats();
    let receiver = start(&handle, 0, 2 * BLOCK);
    let (outcome, _) = receiver.recv_timeout(Duration::from_secs(10)).unwrap();
    let error = outcome.expect_err("the device failed the read");
    assert!(error.to_string().contains("injected read fault"), "{error}");
    assert_eq!(
        cache.stats().misses,
        before.misses,
        "a failed started read counts no miss: its caller reads (and counts) again"
    );
    assert!(!handle.is_resident(0, BLOCK));
    device.failing.store(false, Ordering::SeqCst);
    let mut back = vec![0u8; 2 * BLOCK as usize];
    handle.read_at(0, &mut back).unwrap();
    assert!(back == contents[..2 * BLOCK as usize]);
    assert_eq!(device.reads.load(Ordering::SeqCst), 2);
}

#[test]
fn a_reader_of_a_block_being_read_by_a_started_read_waits_for_it_instead_of_reading_again() {
    // Goal: while a started read is in flight its blocks are in the cache, held, so another
    // reader of them waits for the data rather than reading the device a second time.
    // Method: hold the started read at the device's gate, read one of its blocks from
    // another thread, then open the gate; both get the device's bytes from one device read.
    let (_cache, device, handle, contents) = setup(0);
    let (open_gate, gate) = mpsc::channel();
    *device.gate.lock().unwrap() = Some(gate);
    let receiver = start(&handle, 8 * BLOCK, 4 * BLOCK);
    let handle = Arc::new(handle);
    let reader = {
        let handle = Arc::clone(&handle);
        std::thread::spawn(move || {
            let mut block = vec![0u8; BLOCK as usize];
            handle.read_at(9 * BLOCK, &mut block).unwrap();
            block
        })
    };
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        !reader.is_finished(),
        "the reader waits for the started read"
    );
    open_gate.send(()).unwrap();
    let (bytes, _) = receiver.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(bytes.unwrap() == contents[8 * BLOCK as usize..12 * BLOCK as usize]);
    let block = reader.join().unwrap();
    assert!(block == contents[9 * BLOCK as usize..10 * BLOCK as usize]);
    assert_eq!(device.reads.load(Ordering::SeqCst), 1);
}

#[test]
fn a_started_read_continues_a_sequential_stream_with_read_ahead_in_the_same_request() {
    // Goal: a started read goes through the stream table like any read: the second read of
    // a sequential stream opens its first read-ahead window in the same device request as
    // its own blocks, so the blocks after it are cached with no further device read. Method:
    // read-ahead on; two started reads of 16 blocks, one after the other.
    let (cache, device, handle, contents) = setup(1 << 20);
    for index in 0..2u64 {
        let offset = index * 16 * BLOCK;
        let receiver = start(&handle, offset, 16 * BLOCK);
        let (bytes, _) = receiver.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(bytes.unwrap() == contents[offset as usize..(offset + 16 * BLOCK) as usize]);
    }
    let lengths = device.started_lengths.lock().unwrap().clone();
    assert_eq!(
        lengths[0],
        16 * BLOCK,
        "the first read of a stream reads no more"
    );
    assert!(
        lengths[1] > 16 * BLOCK,
        "the second read's request reaches into read-ahead: {lengths:?}"
    );
    assert!(
        handle.is_resident(32 * BLOCK, BLOCK),
        "the block after it is cached"
    );
    assert!(cache.stats().readahead_issued_blocks > 0);
}

/// Starts a read that may be attached to blocks being filled; None when it was handed back.
fn try_start(handle: &ObjectHandle, offset: u64, length: u64) -> Option<mpsc::Receiver<Outcome>> {
    let (sender, receiver) = mpsc::channel();
    let done = Box::new(move |outcome: Result<StartedRead, CacheError>| {
        let bytes = outcome.map(|data| data.slices().iter().flat_map(|s| s.to_vec()).collect());
        sender.send((bytes, std::thread::current().id())).unwrap();
    });
    handle
        .start_read(offset, length, done)
        .ok()
        .map(|()| receiver)
}

#[test]
fn a_started_read_of_blocks_being_read_waits_for_that_read_with_no_thread_of_its_own() {
    // Goal: a started read whose blocks another started read is filling is not handed back
    // (which would cost a thread asleep on a buffer lock): it is attached to the fill, and
    // the device's completion thread answers it too, from the one device read, counting its
    // blocks as hits. Method: hold the first read at the device's gate, start a second read
    // inside it, check it has not ended, open the gate.
    let (cache, device, handle, contents) = setup(0);
    let (open_gate, gate) = mpsc::channel();
    *device.gate.lock().unwrap() = Some(gate);
    let first = start(&handle, 8 * BLOCK, 8 * BLOCK);
    let before = cache.stats();
    let second = try_start(&handle, 9 * BLOCK + 10, 3 * BLOCK)
        .expect("a read of blocks being filled is started, not handed back");
    std::thread::sleep(Duration::from_millis(20));
    assert!(second.try_recv().is_err(), "it waits for the fill");
    open_gate.send(()).unwrap();
    let (bytes, _) = first.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(bytes.unwrap() == contents[8 * BLOCK as usize..16 * BLOCK as usize]);
    let (bytes, thread) = second.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_ne!(thread, std::thread::current().id());
    let expected = &contents[(9 * BLOCK + 10) as usize..(12 * BLOCK + 10) as usize];
    assert!(bytes.unwrap() == expected);
    let stats = cache.stats();
    assert_eq!(device.reads.load(Ordering::SeqCst), 1, "one device read");
    assert_eq!(stats.reads_attached - before.reads_attached, 1);
    assert_eq!(stats.hits - before.hits, 4, "blocks 9..=12 hit once each");
    assert_eq!(stats.misses, before.misses);
}

#[test]
fn an_attached_read_whose_fill_failed_is_given_back_and_its_caller_reads_it_again() {
    // Goal: when the fill a read waits for fails, its blocks leave the cache and the waiting
    // read is given back (`ReadGivenBack`, never the other read's error and never a hang);
    // its caller then reads it the usual way. Method: a gated, failing first read; a second
    // read attached to it; the gate opened.
    let (_cache, device, handle, contents) = setup(0);
    let (open_gate, gate) = mpsc::channel();
    *device.gate.lock().unwrap() = Some(gate);
    device.failing.store(true, Ordering::SeqCst);
    let first = start(&handle, 0, 4 * BLOCK);
    let second = try_start(&handle, BLOCK, BLOCK).expect("attached");
    open_gate.send(()).unwrap();
    let (outcome, _) = first.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(outcome.is_err());
    let (outcome, _) = second.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(
        matches!(outcome, Err(CacheError::ReadGivenBack)),
        "{outcome:?}"
    );
    device.failing.store(false, Ordering::SeqCst);
    let mut block = vec![0u8; BLOCK as usize];
    handle.read_at(BLOCK, &mut block).unwrap();
    assert!(block == contents[BLOCK as usize..2 * BLOCK as usize]);
}

#[test]
fn reads_attached_while_their_fill_ends_are_each_answered_once_with_the_right_bytes() {
    // Goal: the attach and the end of the fill race (the fill's thread lets the buffer go
    // while a read attaches to it); every read is answered exactly once, with the device's
    // bytes or given back, never lost or answered twice. Method: 300 rounds, each a started
    // read of 4 fresh blocks ending on the device's thread after about 5 ms, and four more
    // started reads of parts of them from this thread and three others meanwhile; a read
    // handed back or given back is read with `read_at`.
    let (_cache, _device, handle, contents) = setup(0);
    let handle = Arc::new(handle);
    for round in 0..300u64 {
        let base = (round * 4) % (DEVICE_BYTES / BLOCK - 4);
        handle.forget_clean(base * BLOCK, 4 * BLOCK);
        let Some(first) = try_start(&handle, base * BLOCK, 4 * BLOCK) else {
            continue;
        };
        let readers: Vec<_> = (0..4u64)
            .map(|index| {
                let handle = Arc::clone(&handle);
                let contents = contents.clone();
                std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_micros(1000 * index + round % 7 * 300));
                    let offset = (base + index % 4) * BLOCK;
                    let expected = &contents[offset as usize..(offset + BLOCK) as usize];
                    let bytes = match try_start(&handle, offset, BLOCK) {
                        Some(receiver) => {
                            let (outcome, _) = receiver
                                .recv_timeout(Duration::from_secs(10))
                                .expect("an attached read is answered");
                            assert!(receiver.try_recv().is_err(), "answered once");
                            outcome.ok()
                        }
                        None => None,
                    };
                    let bytes = bytes.unwrap_or_else(|| {
                        let mut block = vec![0u8; BLOCK as usize];
                        handle.read_at(offset, &mut block).unwrap();
                        block
                    });
                    assert!(bytes == expected, "round {round} reader {index}");
                })
            })
            .collect();
        let (bytes, _) = first.recv_timeout(Duration::from_secs(10)).unwrap();
        let expected = &contents[(base * BLOCK) as usize..((base + 4) * BLOCK) as usize];
        assert!(bytes.unwrap() == expected);
        for reader in readers {
            reader.join().unwrap();
        }
    }
}
