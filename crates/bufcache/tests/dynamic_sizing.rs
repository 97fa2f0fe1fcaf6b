//! The cache can shrink and grow at run time (seed 003: a buffer cache must give memory back
//! and take it again) without losing dirty data or breaking its limits.
//!
//! Method: fill a cache with clean and dirty blocks, shrink its limits, check the snapshot
//! respects the new limits and that every dirty block reached the device; grow it again and
//! check it fills up to the larger limit.

// Tests drive the engine from real threads on real time; only the engine itself may not.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::sync::Arc;

use bufcache::{Cache, CacheConfig, CountingDevice, Device, MemoryDevice, ObjectConfig, Populate};

fn setup(
    memory_bytes_max: u64,
) -> (
    Cache,
    bufcache::ObjectHandle,
    Arc<CountingDevice<MemoryDevice>>,
) {
    let config = CacheConfig {
        memory_bytes_max,
        buffers_max: memory_bytes_max / 4096,
        readahead_bytes_max: 0,
        dirty_limit_percent: 90,
        dirty_background_percent: 90,
        write_behind: false,
        ..CacheConfig::default()
    };
    let cache = bufcache_host::system_cache(config).unwrap();
    let device = Arc::new(CountingDevice::new(MemoryDevice::new(64 << 20)));
    let object = cache
        .open_object(ObjectConfig::new(
            "sizing",
            Arc::clone(&device) as Arc<dyn Device>,
        ))
        .unwrap();
    (cache, object, device)
}

#[test]
fn shrinking_writes_back_and_evicts_then_growing_fills_again() {
    let (cache, object, device) = setup(8 << 20);
    let mut block = vec![0u8; 4096];
    for index in 0..2048u64 {
        if index % 2 == 0 {
            block.fill(index as u8 ^ 0x5a);
            object.write_at(index * 4096, &block, false).unwrap();
        } else {
            object.read_at(index * 4096, &mut block).unwrap();
        }
    }
    let full = cache.stats();
    assert_eq!(full.memory_used_bytes, 8 << 20);
    assert!(
        full.dirty_bytes >= 3 << 20,
        "half the blocks are dirty: {}",
        full.dirty_bytes
    );

    cache.set_limits(2 << 20, 512).unwrap();
    let small = cache.stats();
    assert!(
        small.memory_used_bytes <= 2 << 20,
        "{} > 2 MiB",
        small.memory_used_bytes
    );
    assert!(small.buffers_in_use <= 512);
    assert_eq!((small.memory_bytes_max, small.buffers_max), (2 << 20, 512));
    // Every dirty block that left the cache reached the device first.
    for index in (0..2048u64).step_by(2) {
        let mut back = vec![0u8; 4096];
        object.read_at(index * 4096, &mut back).unwrap();
        assert!(
            back.iter().all(|&byte| byte == index as u8 ^ 0x5a),
            "block {index}"
        );
    }
    assert!(device.stats().writes.bytes >= 2 << 20);

    cache.set_limits(16 << 20, 4096).unwrap();
    for index in 0..4096u64 {
        object.read_at(index * 4096, &mut block).unwrap();
    }
    let grown = cache.stats();
    assert_eq!(
        grown.memory_used_bytes,
        16 << 20,
        "the larger limit is used"
    );
    assert!(grown.memory_used_bytes <= grown.memory_bytes_max);
}

#[test]
fn a_limit_too_small_for_one_buffer_is_refused() {
    let (cache, _object, _device) = setup(1 << 20);
    let error = cache.set_limits(1024, 16).unwrap_err().to_string();
    assert!(error.contains("memory_bytes_max"), "{error}");
}

#[test]
fn prefaulted_memory_stays_within_the_limit_and_is_given_back_when_it_shrinks() {
    // Goal: memory faulted in ahead of need never exceeds the smaller of the caller's bound
    // and the memory limit, a fill uses it, and a limit shrunk below it gives it back.
    // Method: prefault an 8 MiB cache with a 6 MiB bound (3 chunks), then with none (1 more);
    // write 2 MiB (one chunk taken); shrink to 4 MiB: the spare chunks go, one chunk fits
    // beside the one in use, and the cache still reads back what was written.
    let (cache, object, _device) = setup(8 << 20);
    let mut chunks = 0;
    while cache.prefault(6 << 20, Populate::Advise) {
        chunks += 1;
    }
    assert_eq!(chunks, 3);
    while cache.prefault(u64::MAX, Populate::Touch) {
        chunks += 1;
    }
    assert_eq!(chunks, 4, "the memory limit bounds an unbounded caller");
    assert_eq!(cache.stats().memory_prefaulted_bytes, 8 << 20);
    let data: Vec<u8> = (0..2 << 20).map(|index| (index % 251) as u8).collect();
    object.write_at(0, &data, false).unwrap();
    let stats = cache.stats();
    assert_eq!(stats.memory_used_bytes, 2 << 20);
    assert_eq!(
        stats.memory_prefaulted_bytes,
        6 << 20,
        "the fill took one chunk"
    );
    cache.set_limits(4 << 20, 1024).unwrap();
    assert_eq!(
        cache.stats().memory_prefaulted_bytes,
        0,
        "spares given back"
    );
    let mut again = 0;
    while cache.prefault(u64::MAX, Populate::Touch) {
        again += 1;
    }
    assert_eq!(
        again, 1,
        "the 2 MiB in use plus one chunk fill the 4 MiB limit"
    );
    let mut back = vec![0u8; data.len()];
    object.read_at(0, &mut back).unwrap();
    assert!(back == data);
}

// Goal: an object grows in place over a device that holds more (a disk grown while served):
// the blocks before the old end keep their cached and dirty bytes, the new blocks read as the
// device has them and take writes that reach the device in clusters, and a shrink, a length
// that is not whole blocks, or one past the device is refused with nothing changed.
// Method: open 1 MiB of a 4 MiB memory device, dirty its last block, grow to 3 MiB, write
// and read across the old end, sync and compare the device; try each refusal and check the
// length.
#[test]
fn an_object_grows_over_its_device_keeping_every_byte() {
    let config = CacheConfig {
        memory_bytes_max: 8 << 20,
        buffers_max: 2048,
        ..CacheConfig::default()
    };
    let cache = bufcache_host::system_cache(config).unwrap();
    let device = Arc::new(CountingDevice::new(MemoryDevice::new(4 << 20)));
    let mut object_config = ObjectConfig::new("growing", Arc::clone(&device) as Arc<dyn Device>);
    object_config.length_bytes = Some(1 << 20);
    let object = cache.open_object(object_config).unwrap();
    assert_eq!(object.len(), 1 << 20);
    let last = vec![0xa5u8; 4096];
    object.write_at((1 << 20) - 4096, &last, false).unwrap();
    assert!(
        object.write_at(1 << 20, &last, false).is_err(),
        "past the end"
    );

    for (length, says) in [
        ((1 << 20) - 4096, "only grows"),
        ((2 << 20) + 512, "whole blocks"),
        (8 << 20, "fewer than"),
    ] {
        let error = object.grow(length).unwrap_err().to_string();
        assert!(error.contains(says), "{length}: {error}");
        assert_eq!(object.len(), 1 << 20, "{length}: nothing changed");
    }
    object.grow(3 << 20).unwrap();
    assert_eq!(object.len(), 3 << 20);
    let across: Vec<u8> = (0..(1 << 20)).map(|at: usize| (at / 4096) as u8).collect();
    let writes_before = device.stats().writes.requests;
    object
        .write_at((1 << 20) + (512 << 10), &across, false)
        .unwrap();
    let mut read = vec![0u8; 2 << 20];
    object.read_at(1 << 20, &mut read).unwrap();
    let mut expected = vec![0u8; 2 << 20];
    expected[512 << 10..(512 << 10) + (1 << 20)].copy_from_slice(&across);
    assert!(read == expected, "the grown part reads as written");
    let mut tail = vec![0u8; 4096];
    object.read_at((1 << 20) - 4096, &mut tail).unwrap();
    assert_eq!(
        tail, last,
        "the block before the old end keeps its dirty bytes"
    );
    cache.sync().unwrap();
    let mut stored = vec![0u8; 3 << 20];
    device.inner().read_into(0, &mut stored).unwrap();
    assert_eq!(stored[(1 << 20) - 4096..1 << 20], last[..]);
    assert!(
        stored[1 << 20..] == expected[..],
        "the device holds the grown part"
    );
    let writes = device.stats().writes.requests - writes_before;
    assert!(
        writes < 256 / 4,
        "1 MiB past the old end written in clusters, not block by block: {writes} writes"
    );
}
