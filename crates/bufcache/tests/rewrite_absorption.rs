//! Rewrites of hot data are absorbed: a region written over and over reaches the device once
//! per flush (or age, or background threshold), not once per rewrite, as the kernel's page
//! cache does for a server with no cache of its own; a first write is still written behind at
//! once, and absorbed rewrites never hold more than the background threshold dirty, so
//! writers never throttle because of them.
//!
//! Method: a `CountingDevice` directly below the cache counts every byte written; background
//! work runs inline (`InlineSpawner`), so the counts are deterministic; every test reads the
//! device back through a fresh cache and compares with the last bytes written.

// Tests drive the engine from real threads on real time; only the engine itself may not.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bufcache::{
    Cache, CacheConfig, Clock, CountingDevice, Device, Environment, InlineSpawner, MemoryDevice,
    ObjectConfig, ObjectHandle,
};
use bufcache_host::{BlockingWaiter, SystemClock};

const MIB: u64 = 1 << 20;
const WRITE: u64 = 64 << 10;

fn inline_cache(memory_bytes_max: u64) -> Cache {
    inline_cache_with_clock(memory_bytes_max, Arc::new(SystemClock::new()))
}

fn inline_cache_with_clock(memory_bytes_max: u64, clock: Arc<dyn Clock>) -> Cache {
    Cache::with_environment(
        CacheConfig {
            memory_bytes_max,
            ..CacheConfig::default()
        },
        Environment::new(
            clock,
            Arc::new(InlineSpawner),
            Arc::new(BlockingWaiter::default()),
        ),
    )
    .expect("valid config")
}

/// A clock the test sets.
#[derive(Default)]
struct ManualClock(AtomicU64);

impl ManualClock {
    fn set(&self, at: Duration) {
        self.0.store(at.as_nanos() as u64, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ns(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

fn open(cache: &Cache, device: Arc<dyn Device>) -> ObjectHandle {
    cache.open_object(ObjectConfig::new("r", device)).unwrap()
}

/// The bytes pass `pass` writes at `offset`: different in every pass and every block.
fn pass_bytes(pass: u64, offset: u64) -> Vec<u8> {
    (0..WRITE)
        .map(|index| ((offset + index) / 4096 * 31 + pass * 7 + index) as u8)
        .collect()
}

/// Writes `[0, region)` sequentially in 64 KiB writes, once per pass of `passes`.
fn rewrite(handle: &ObjectHandle, region: u64, passes: std::ops::Range<u64>) {
    for pass in passes {
        for offset in (0..region).step_by(WRITE as usize) {
            handle
                .write_at(offset, &pass_bytes(pass, offset), false)
                .unwrap();
        }
    }
}

/// Checks that `bytes` have been written to `device` in all.
fn assert_written(device: &CountingDevice<MemoryDevice>, bytes: u64, why: &str) {
    assert_eq!(device.stats().writes.bytes, bytes, "{why}");
}

/// Reads the device through a fresh cache and checks it holds the last pass.
fn assert_device_holds_pass(device: Arc<dyn Device>, region: u64, pass: u64) {
    let cache = inline_cache(16 * MIB);
    let handle = open(&cache, device);
    let mut back = vec![0u8; WRITE as usize];
    for offset in (0..region).step_by(WRITE as usize) {
        handle.read_at(offset, &mut back).unwrap();
        assert!(
            back == pass_bytes(pass, offset),
            "the device holds pass {pass}'s bytes at {offset}"
        );
    }
}

#[test]
fn a_region_rewritten_over_and_over_reaches_the_device_once_per_flush() {
    // Goal: twenty rewrites of a 1 MiB region cost the device about two writes of it (the
    // first pass, written behind, and the flush), not twenty; the flush leaves the last
    // bytes on the device. Method: 16 MiB cache (background threshold 4 MiB); count the
    // bytes written before and after the flush.
    let device = Arc::new(CountingDevice::new(MemoryDevice::new(8 * MIB)));
    let cache = inline_cache(16 * MIB);
    let handle = open(&cache, device.clone());
    rewrite(&handle, MIB, 0..1);
    assert_written(&device, MIB, "a first write is written behind at once");
    rewrite(&handle, MIB, 1..20);
    assert_written(
        &device,
        MIB,
        "the rewrites stay in the cache until something asks for them",
    );
    assert_eq!(cache.stats().dirty_bytes, MIB);
    handle.flush().unwrap();
    assert_written(&device, 2 * MIB, "the flush writes the region once");
    assert_eq!(cache.stats().dirty_bytes, 0);
    assert_device_holds_pass(device, MIB, 19);
}

#[test]
fn absorbed_rewrites_stay_under_the_background_threshold_and_never_throttle_writers() {
    // Goal: rewrites of a region larger than the background threshold are absorbed only up
    // to it; past it they are written behind as before, so dirty data never reaches the
    // limit where writers write back themselves. Method: 8 MiB cache (background 2 MiB,
    // limit 4 MiB), a 6 MiB region rewritten 5 times; after every write the dirty bytes stay
    // under the background threshold plus one write-behind batch, no write throttles, and
    // a flush leaves the last pass on the device.
    let memory = 8 * MIB;
    let background = memory / 100 * 25;
    let device = Arc::new(CountingDevice::new(MemoryDevice::new(8 * MIB)));
    let cache = inline_cache(memory);
    let handle = open(&cache, device.clone());
    let region = 6 * MIB;
    for pass in 0..5 {
        for offset in (0..region).step_by(WRITE as usize) {
            handle
                .write_at(offset, &pass_bytes(pass, offset), false)
                .unwrap();
            let dirty = cache.stats().dirty_bytes;
            assert!(
                dirty <= background + MIB,
                "pass {pass} offset {offset}: {dirty} bytes dirty, over the background threshold"
            );
        }
    }
    assert_eq!(cache.stats().throttled_writes, 0, "no writer throttled");
    handle.flush().unwrap();
    assert_device_holds_pass(device, region, 4);
}

#[test]
fn a_region_rewritten_without_pause_still_reaches_the_device_within_the_age_limit() {
    // Goal: absorbing rewrites never keeps data from the device longer than
    // `dirty_age_max` (30 s by default): a block's age counts from when it first became dirty,
    // not from its latest rewrite, so a region rewritten without pause and never flushed is
    // still written once it is that old. Method: a clock the test sets; pass 0 at 0 s
    // (written behind), a rewrite every 0.5 s from 1 s to 30 s; the background tick at 30 s
    // writes nothing (the dirty data is 29 s old), the tick at 31.5 s writes the region once,
    // with the last pass's bytes.
    let clock = Arc::new(ManualClock::default());
    let device = Arc::new(CountingDevice::new(MemoryDevice::new(8 * MIB)));
    let cache = inline_cache_with_clock(16 * MIB, clock.clone());
    let handle = open(&cache, device.clone());
    rewrite(&handle, MIB, 0..1);
    for pass in 1..60 {
        clock.set(Duration::from_millis(500 * (pass + 1)));
        rewrite(&handle, MIB, pass..pass + 1);
    }
    cache.writeback_tick();
    assert_written(
        &device,
        MIB,
        "at 30 s the rewrites (dirty since 1 s) are not old enough yet",
    );
    clock.set(Duration::from_millis(31_500));
    cache.writeback_tick();
    assert_written(&device, 2 * MIB, "at 31.5 s the region is written once");
    assert_eq!(cache.stats().dirty_bytes, 0);
    assert_device_holds_pass(device, MIB, 59);
}
