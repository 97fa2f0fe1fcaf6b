//! A flush over a device that serves several requests at once writes its dirty runs several
//! at a time, and is still exact.
//!
//! Method: a `FaultDevice` adds 2 ms to every write of a `MemoryDevice`; a wrapper says the
//! device serves 16 requests at once (a batch's writes run together) and counts how many
//! writes are in flight at once. Scattered 4 KiB writes (no two adjacent, so each is its
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

    /// Every write of a batch in flight at once, as a pipelined device does them.
    fn submit_writes(&self, writes: Vec<bufcache::device::WriteRequest>) {
        std::thread::scope(|scope| {
            for write in writes {
                scope.spawn(move || {
                    let offset = write.offset();
                    let result = self.write_vectored_at(&write.slices(), offset);
                    write.complete(result);
                });
            }
        })
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
            inflight_requests_max: 16,
            ..self.inner.capabilities()
        }
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

#[test]
fn a_flush_over_a_slow_device_keeps_several_writes_in_flight_and_loses_nothing() {
    let slow = slow_device();
    let device = Arc::new(InFlight {
        inner: slow,
        now: AtomicUsize::new(0),
        most: AtomicUsize::new(0),
    });
    let cache = bufcache_host::system_cache(CacheConfig {
        memory_bytes_max: 8 << 20,
        readahead_bytes_max: 0,
        ..CacheConfig::default()
    })
    .unwrap();
    let handle = cache
        .open_object(ObjectConfig::new("slow", device.clone() as Arc<dyn Device>))
        .unwrap();
    // Two rounds, each flushed; the second is the one measured.
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

#[test]
fn flush_helpers_write_each_whole_cluster_with_one_request() {
    // Goal: the shares a flush hands its helpers start on cluster boundaries, so over a slow
    // device every wholly dirty cluster is still one device write. (Shares used to start at
    // every n-th dirty block; one starting inside a cluster wrote it as two requests.)
    // Method: 2 ms writes under a `CountingDevice`, write-behind off; a first flush of one
    // cluster teaches the cache that writes are slow; then 7 whole 1 MiB clusters (shares
    // of 224 blocks, not a multiple of a cluster) and a flush: exactly 7 device writes of
    // 1 MiB, and the device holds every byte.
    const MIB: u64 = 1 << 20;
    let slow = slow_device();
    let device = Arc::new(bufcache::CountingDevice::new(slow));
    let cache = bufcache_host::system_cache(CacheConfig {
        memory_bytes_max: 32 << 20,
        readahead_bytes_max: 0,
        write_behind: false,
        ..CacheConfig::default()
    })
    .unwrap();
    let handle = cache
        .open_object(ObjectConfig::new("slow", device.clone() as Arc<dyn Device>))
        .unwrap();
    let data: Vec<u8> = (0..8 * MIB)
        .map(|index| (index / 4096 * 13 + index) as u8)
        .collect();
    handle.write_at(0, &data[..MIB as usize], false).unwrap();
    handle.flush().unwrap();
    let before = device.stats().writes;
    handle.write_at(MIB, &data[MIB as usize..], false).unwrap();
    handle.flush().unwrap();
    let writes = device.stats().writes.since(&before);
    assert_eq!(writes.bytes, 7 * MIB);
    assert_eq!(
        writes.requests, 7,
        "7 wholly dirty clusters, {} device writes",
        writes.requests
    );
    let mut stored = vec![0u8; data.len()];
    device
        .read_vectored_at(&mut [IoSliceMut::new(&mut stored)], 0)
        .unwrap();
    assert!(stored == data, "the device holds every byte");
}
