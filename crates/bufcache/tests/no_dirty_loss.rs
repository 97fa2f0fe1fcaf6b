//! No dirty data is ever lost to eviction: writing far more than the cache holds, in random
//! order, with whole- and partial-block writes, leaves the device equal to the model after
//! `sync` — also over a slow device (FaultDevice latency and spikes) with concurrent readers.
//!
//! Method: tiny caches (8–16 buffers) over a `MemoryDevice`; a shadow `Vec<u8>` records every
//! write; reads during the run are checked against it; after `Cache::sync` the device bytes
//! (read below the cache) must equal the shadow and no dirty bytes may remain. Seeds are
//! printed in every failure message.

// Tests drive the engine from real threads on real time; only the engine itself may not.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bufcache::{
    CacheConfig, Device, FaultDevice, FaultKind, MemoryDevice, ObjectConfig, PolicyKind,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn config(memory: u64, buffers: u64, policy: PolicyKind) -> CacheConfig {
    CacheConfig {
        buffer_bytes_max: 4096,
        memory_bytes_max: memory,
        buffers_max: buffers,
        policy,
        shards: 4,
        space_wait_max: Duration::from_secs(2),
        ..CacheConfig::default()
    }
}

fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y)
}

/// Random writes (random offsets and lengths up to three blocks) over an object 64 times the
/// cache, with occasional verified reads.
#[test]
fn random_order_writes_far_beyond_memory_lose_nothing() {
    const LENGTH: u64 = 4 << 20;
    for seed in 0..16u64 {
        let policy = PolicyKind::ALL[seed as usize % PolicyKind::ALL.len()];
        let label = format!("seed {seed} policy {policy:?}");
        let device = Arc::new(MemoryDevice::new(LENGTH));
        let cache = bufcache_host::system_cache(config(64 << 10, 16, policy)).unwrap();
        let handle = cache
            .open_object(ObjectConfig::new("x", device.clone() as Arc<dyn Device>))
            .unwrap();
        let mut rng = StdRng::seed_from_u64(seed);
        let mut model = vec![0u8; LENGTH as usize];
        for op in 0..3000 {
            let length = rng.gen_range(1..=3 * 4096u64);
            let offset = rng.gen_range(0..=LENGTH - length);
            if rng.gen_bool(0.85) {
                let mut data = vec![0u8; length as usize];
                rng.fill(&mut data[..]);
                handle
                    .write_at(offset, &data, false)
                    .unwrap_or_else(|e| panic!("{label} op {op}: write failed: {e}"));
                model[offset as usize..(offset + length) as usize].copy_from_slice(&data);
            } else {
                let mut data = vec![0u8; length as usize];
                handle
                    .read_at(offset, &mut data)
                    .unwrap_or_else(|e| panic!("{label} op {op}: read failed: {e}"));
                if let Some(at) =
                    first_difference(&data, &model[offset as usize..(offset + length) as usize])
                {
                    panic!(
                        "{label} op {op}: read at {offset} differs at byte {}",
                        offset + at as u64
                    );
                }
            }
            let stats = cache.stats();
            assert!(
                stats.memory_used_bytes <= stats.memory_bytes_max,
                "{label}: memory limit exceeded: {stats:?}"
            );
        }
        cache
            .sync()
            .unwrap_or_else(|e| panic!("{label}: sync: {e}"));
        let stats = cache.stats();
        assert_eq!(stats.dirty_bytes, 0, "{label}: dirty bytes after sync");
        assert!(
            stats.evictions > 100,
            "{label}: the test must evict ({stats:?})"
        );
        let mut on_device = vec![0u8; LENGTH as usize];
        device.read_into(0, &mut on_device).unwrap();
        if let Some(at) = first_difference(&on_device, &model) {
            panic!(
                "{label}: device differs from the model at byte {at} (block {})",
                at / 4096
            );
        }
    }
}

/// One writer writes its half in random order over a device with write latency and spikes;
/// two readers keep reading the other (pre-written, static) half and verify it, so eviction,
/// write-back and read misses all interleave.
#[test]
fn slow_device_with_concurrent_readers_loses_nothing() {
    const LENGTH: u64 = 2 << 20;
    const HALF: u64 = LENGTH / 2;
    for seed in 0..3u64 {
        let label = format!("seed {seed}");
        let fault = Arc::new(FaultDevice::new(MemoryDevice::new(LENGTH), seed));
        let mut model = vec![0u8; LENGTH as usize];
        let mut rng = StdRng::seed_from_u64(seed ^ 0xD1A7);
        rng.fill(&mut model[HALF as usize..]);
        fault
            .inner()
            .write_vectored_at(&[std::io::IoSlice::new(&model[HALF as usize..])], HALF)
            .unwrap();
        fault.set_latency(
            FaultKind::Write,
            Duration::from_micros(200),
            Duration::from_millis(5),
            0.02,
        );
        fault.set_latency(
            FaultKind::Read,
            Duration::from_micros(50),
            Duration::from_millis(3),
            0.01,
        );
        let cache = bufcache_host::system_cache(config(48 << 10, 12, PolicyKind::Lru)).unwrap();
        let handle = cache
            .open_object(ObjectConfig::new("slow", fault.clone() as Arc<dyn Device>))
            .unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let static_half = Arc::new(model[HALF as usize..].to_vec());
        let readers: Vec<_> = (0..2u64)
            .map(|reader| {
                let handle = handle.reopen();
                let stop = Arc::clone(&stop);
                let expected = Arc::clone(&static_half);
                let label = format!("{label} reader {reader}");
                std::thread::spawn(move || {
                    let mut rng = StdRng::seed_from_u64(seed * 10 + reader);
                    let mut reads = 0u64;
                    while !stop.load(Ordering::Relaxed) || reads < 50 {
                        let length = rng.gen_range(1..=8192u64);
                        let within = rng.gen_range(0..=HALF - length);
                        let mut data = vec![0u8; length as usize];
                        handle
                            .read_at(HALF + within, &mut data)
                            .unwrap_or_else(|e| panic!("{label}: read failed: {e}"));
                        let want = &expected[within as usize..(within + length) as usize];
                        assert!(
                            data == want,
                            "{label}: static half read at {within} differs"
                        );
                        reads += 1;
                    }
                })
            })
            .collect();
        for op in 0..600 {
            let length = rng.gen_range(1..=2 * 4096u64);
            let offset = rng.gen_range(0..=HALF - length);
            let mut data = vec![0u8; length as usize];
            rng.fill(&mut data[..]);
            handle
                .write_at(offset, &data, rng.gen_bool(0.02))
                .unwrap_or_else(|e| panic!("{label} op {op}: write failed: {e}"));
            model[offset as usize..(offset + length) as usize].copy_from_slice(&data);
            if op % 50 == 0 {
                let mut back = vec![0u8; length as usize];
                handle.read_at(offset, &mut back).unwrap();
                assert!(back == data, "{label} op {op}: read-your-write failed");
            }
        }
        stop.store(true, Ordering::Relaxed);
        for reader in readers {
            reader.join().expect("reader panicked");
        }
        cache
            .sync()
            .unwrap_or_else(|e| panic!("{label}: sync: {e}"));
        assert_eq!(cache.stats().dirty_bytes, 0, "{label}");
        let mut on_device = vec![0u8; LENGTH as usize];
        fault.inner().read_into(0, &mut on_device).unwrap();
        if let Some(at) = first_difference(&on_device, &model) {
            panic!("{label}: device differs from the model at byte {at}");
        }
        assert!(fault.stats().delayed > 0);
    }
}
