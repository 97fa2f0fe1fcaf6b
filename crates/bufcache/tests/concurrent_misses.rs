//! Concurrent misses and hits: many threads missing on the same block cause exactly one device
//! read; hits never wait for another block's slow miss, and readers of a block are not blocked
//! by each other or by that block's write-back.
//!
//! Method: a `CountingDevice` over a `FaultDevice` whose latency makes the slow request last
//! long enough for every other thread to arrive; a `Barrier` starts the threads together.

// Tests drive the engine from real threads on real time; only the engine itself may not.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use bufcache::{
    Cache, CacheConfig, CountingDevice, Device, FaultDevice, FaultKind, MemoryDevice, ObjectConfig,
    ObjectHandle,
};

type Slow = Arc<FaultDevice<MemoryDevice>>;

fn setup() -> (Cache, ObjectHandle, Arc<CountingDevice<Slow>>, Slow) {
    let fault = Arc::new(FaultDevice::new(MemoryDevice::new(4 << 20), 1));
    let mut content = vec![0u8; 4 << 20];
    for (index, byte) in content.iter_mut().enumerate() {
        *byte = (index / 4096) as u8 ^ index as u8;
    }
    fault
        .inner()
        .write_vectored_at(&[std::io::IoSlice::new(&content)], 0)
        .unwrap();
    let counting = Arc::new(CountingDevice::new(fault.clone()));
    let cache = bufcache_host::system_cache(CacheConfig {
        memory_bytes_max: 1 << 20,
        readahead_bytes_max: 0,
        ..CacheConfig::default()
    })
    .unwrap();
    let handle = cache
        .open_object(ObjectConfig::new("m", counting.clone() as Arc<dyn Device>))
        .unwrap();
    (cache, handle, counting, fault)
}

fn expected_block(block: u64) -> Vec<u8> {
    (0..4096usize)
        .map(|i| block as u8 ^ (block as usize * 4096 + i) as u8)
        .collect()
}

#[test]
fn many_threads_missing_one_block_cause_one_device_read() {
    let (_cache, handle, counting, fault) = setup();
    fault.set_latency(
        FaultKind::Read,
        Duration::from_millis(30),
        Duration::ZERO,
        0.0,
    );
    const THREADS: usize = 12;
    for round in 0..5u64 {
        let block = 10 + round * 7;
        let before = counting.stats().reads.requests;
        let barrier = Arc::new(Barrier::new(THREADS));
        let threads: Vec<_> = (0..THREADS)
            .map(|thread| {
                let handle = handle.reopen();
                let barrier = Arc::clone(&barrier);
                std::thread::spawn(move || {
                    barrier.wait();
                    if thread % 3 == 0 {
                        let guard = handle.bread(block).expect("bread");
                        assert_eq!(guard.data(), &expected_block(block)[..]);
                    } else {
                        let mut data = vec![0u8; 4096];
                        handle.read_at(block * 4096, &mut data).expect("read");
                        assert_eq!(data, expected_block(block));
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().expect("reader panicked");
        }
        assert_eq!(
            counting.stats().reads.requests - before,
            1,
            "round {round}: {THREADS} threads missing block {block} made one device read"
        );
    }
}

#[test]
fn hits_do_not_wait_for_another_blocks_slow_miss() {
    let (cache, handle, _counting, fault) = setup();
    let mut data = vec![0u8; 4096];
    handle.read_at(5 * 4096, &mut data).unwrap();
    fault.set_latency(
        FaultKind::Read,
        Duration::from_millis(600),
        Duration::ZERO,
        0.0,
    );
    let slow = {
        let handle = handle.reopen();
        std::thread::spawn(move || {
            let mut data = vec![0u8; 4096];
            handle.read_at(100 * 4096, &mut data).unwrap();
        })
    };
    std::thread::sleep(Duration::from_millis(50));
    let started = Instant::now();
    for _ in 0..1000 {
        handle.read_at(5 * 4096, &mut data).unwrap();
    }
    let elapsed = started.elapsed();
    assert!(
        !slow.is_finished(),
        "the slow miss is still in flight while the hits ran"
    );
    assert!(
        elapsed < Duration::from_millis(300),
        "1000 hits took {elapsed:?} during another block's miss"
    );
    assert_eq!(data, expected_block(5));
    slow.join().unwrap();
    assert!(cache.stats().hits >= 1000);
}

#[test]
fn readers_of_one_block_do_not_block_each_other_or_its_write_back() {
    let (_cache, handle, _counting, fault) = setup();
    let new = vec![0xA5u8; 4096];
    handle.write_at(7 * 4096, &new, false).unwrap();
    fault.set_latency(
        FaultKind::Write,
        Duration::from_millis(600),
        Duration::ZERO,
        0.0,
    );
    let flusher = {
        let handle = handle.reopen();
        std::thread::spawn(move || handle.flush().unwrap())
    };
    while fault.stats().delayed == 0 {
        std::thread::sleep(Duration::from_millis(1));
    }
    let started = Instant::now();
    let readers: Vec<_> = (0..6)
        .map(|_| {
            let handle = handle.reopen();
            let new = new.clone();
            std::thread::spawn(move || {
                let mut data = vec![0u8; 4096];
                for _ in 0..500 {
                    handle.read_at(7 * 4096, &mut data).unwrap();
                    assert_eq!(data, new);
                }
            })
        })
        .collect();
    for reader in readers {
        reader.join().unwrap();
    }
    let elapsed = started.elapsed();
    assert!(
        !flusher.is_finished() && elapsed < Duration::from_millis(300),
        "3000 reads of a block under write-back took {elapsed:?}"
    );
    flusher.join().unwrap();
}
