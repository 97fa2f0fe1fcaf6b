//! A flush over a slow device writes its dirty runs several at a time, and is still exact.
//!
//! Method: a `FaultDevice` adds 2 ms to every write of a `MemoryDevice`; a wrapper counts how
//! many writes are in flight at once. Scattered 4 KiB writes (no two adjacent, so each is its
//! own device write) are flushed; the flush must have had more than one write in flight, and
//! afterwards the device must hold every byte, so helpers never trade exactness for speed.

// Tests drive the engine from real threads on real time; only the engine itself may not.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::io::{self, IoSlice, IoSliceMut};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bufcache::{
    CacheConfig, Capabilities, Device, Extent, FaultDevice, FaultKind, MemoryDevice, ObjectConfig,
};

const DEVICE_BYTES: u64 = 16 << 20;

/// Counts the writes in flight and remembers the most seen at once.
struct InFlight<D> {
    inner: D,
    now: AtomicUsize,
    most: AtomicUsize,
}

impl<D: Device> Device for InFlight<D> {
    fn read_vectored_at(&self, buffers: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<()> {
        self.inner.read_vectored_at(buffers, offset)
    }

    fn write_vectored_at(&self, buffers: &[IoSlice<'_>], offset: u64) -> io::Result<()> {
        let now = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(now, Ordering::SeqCst);
        let result = self.inner.write_vectored_at(buffers, offset);
        self.now.fetch_sub(1, Ordering::SeqCst);
        result
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

fn block_pattern(block: u64, round: u64) -> Vec<u8> {
    (0..4096u64)
        .map(|index| (block * 31 + round * 7 + index) as u8)
        .collect()
}

#[test]
fn a_flush_over_a_slow_device_keeps_several_writes_in_flight_and_loses_nothing() {
    let slow = FaultDevice::new(MemoryDevice::new(DEVICE_BYTES), 1);
    slow.set_latency(
        FaultKind::Write,
        Duration::from_millis(2),
        Duration::ZERO,
        0.0,
    );
    let device = Arc::new(InFlight {
        inner: slow,
        now: AtomicUsize::new(0),
        most: AtomicUsize::new(0),
    });
    let cache = bufcache_host::system_cache(CacheConfig {
        memory_bytes_max: 8 << 20,
        readahead_size_max_bytes: 0,
        ..CacheConfig::default()
    })
    .unwrap();
    let handle = cache
        .open_object(ObjectConfig::new("slow", device.clone() as Arc<dyn Device>))
        .unwrap();
    // Round 0 teaches the cache that writes are slow (one flush, written one at a time);
    // round 1 is the flush under test.
    for round in 0..2u64 {
        for index in 0..64u64 {
            let block = index * 16 + round;
            handle
                .write_at(block * 4096, &block_pattern(block, round), false)
                .unwrap();
        }
        device.most.store(0, Ordering::SeqCst);
        handle.flush().unwrap();
    }
    let most = device.most.load(Ordering::SeqCst);
    assert!(
        most > 1,
        "the flush over a 2 ms device had at most {most} write in flight"
    );
    for round in 0..2u64 {
        for index in 0..64u64 {
            let block = index * 16 + round;
            let mut stored = vec![0u8; 4096];
            device
                .inner
                .inner()
                .read_vectored_at(&mut [IoSliceMut::new(&mut stored)], block * 4096)
                .unwrap();
            assert!(
                stored == block_pattern(block, round),
                "block {block} of round {round} did not reach the device"
            );
        }
    }
    assert_eq!(cache.stats().dirty_bytes, 0);
}
