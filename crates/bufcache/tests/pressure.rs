//! A cache smaller than the work (issue #47): eviction walks only buffers it can take, and a
//! reservation that finds none waits for a release, bounded, instead of spinning.
//!
//! Method: tiny caches over a memory device; buffers made busy through the public API (dirty
//! data under high dirty limits, buffers held with `bread`), then the engine's own counters
//! (`eviction_candidates_examined`, `buffer_waits`, `buffer_wait_ns`) and the outcome of the
//! waiting call checked.

// Tests drive the engine from real threads on real time; only the engine itself may not.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use bufcache::{
    Cache, CacheConfig, CacheError, Device, Environment, FrozenClock, MemoryDevice, ObjectConfig,
    ObjectHandle, PolicyKind,
};

const BLOCK: u64 = 4096;

fn config(buffers: u64, policy: PolicyKind, space_wait_max: Duration) -> CacheConfig {
    CacheConfig {
        buffer_size_max_bytes: BLOCK,
        cluster_size_max_bytes: BLOCK,
        memory_bytes_max: buffers * BLOCK,
        buffers_max: buffers,
        readahead_size_max_bytes: 0,
        write_behind: false,
        dirty_background_percent: 89,
        dirty_limit_percent: 90,
        policy,
        shards: 1,
        space_wait_max,
        ..CacheConfig::default()
    }
}

fn open(cache: &Cache) -> ObjectHandle {
    let device: Arc<dyn Device> = Arc::new(MemoryDevice::new(64 << 20));
    cache
        .open_object(ObjectConfig::new("pressure", device))
        .expect("open object")
}

#[test]
fn eviction_examines_a_bounded_number_of_candidates_when_most_buffers_are_dirty() {
    // Goal: with most of the cache dirty (and so not evictable), each eviction examines about
    // one candidate, not every dirty buffer: dirty buffers are held off the policy's queues.
    // Method: for every policy, a 64-buffer cache with 56 dirty blocks written in scattered
    // order (no write-back below the 90 % limit), then 600 single-block read misses, each
    // evicting among the 8 clean buffers; the candidates examined are compared with the
    // evictions. Walking the dirty buffers at every eviction would examine about 56 each.
    for &policy in PolicyKind::ALL {
        let cache = Cache::with_environment(
            config(64, policy, Duration::from_millis(50)),
            Environment::inline(Arc::new(FrozenClock)),
        )
        .expect("valid config");
        let handle = open(&cache);
        let dirty_blocks: Vec<u64> = (0..56u64).map(|index| (index * 37) % 1009).collect();
        for (index, &block) in dirty_blocks.iter().enumerate() {
            let data = vec![index as u8 + 1; BLOCK as usize];
            handle.write_at(block * BLOCK, &data, false).expect("write");
        }
        assert_eq!(cache.stats().dirty_bytes, 56 * BLOCK, "{policy}: all dirty");
        let before = cache.stats();
        let mut data = vec![0u8; BLOCK as usize];
        for index in 0..600u64 {
            handle
                .read_at((2000 + index * 3) * BLOCK, &mut data)
                .expect("read");
        }
        let after = cache.stats();
        let evictions = after.evictions - before.evictions;
        let examined = after.eviction_candidates_examined - before.eviction_candidates_examined;
        assert!(evictions >= 590, "{policy}: {evictions} evictions");
        assert!(
            examined <= 2 * evictions + 64,
            "{policy}: {examined} candidates examined for {evictions} evictions"
        );
        assert_eq!(
            after.dirty_bytes,
            56 * BLOCK,
            "{policy}: nothing written back"
        );
        for (index, &block) in dirty_blocks.iter().enumerate() {
            handle.read_at(block * BLOCK, &mut data).expect("read back");
            assert!(
                data.iter().all(|&byte| byte == index as u8 + 1),
                "{policy}: dirty block {block} kept its data"
            );
        }
    }
}

#[test]
fn a_reservation_waiting_for_a_buffer_wakes_when_one_is_released() {
    // Goal: a reader that finds every buffer pinned sleeps until one is released and then
    // proceeds at once, and its wait is counted. Method: an 8-buffer cache on the host's
    // waiter and clock; the test holds all 8 with `bread`, a thread reads another block,
    // the test releases one buffer after 200 ms; the read must end well before the 20 s
    // bound, with one buffer wait of at least the 200 ms recorded.
    let cache = bufcache_host::system_cache(config(8, PolicyKind::S3Fifo, Duration::from_secs(20)))
        .expect("valid config");
    let handle = open(&cache);
    let mut held: Vec<_> = (0..8u64)
        .map(|block| handle.bread(block).expect("bread"))
        .collect();
    let reader = {
        let handle = handle.reopen();
        std::thread::spawn(move || {
            let started = Instant::now();
            let mut data = vec![0u8; BLOCK as usize];
            let result = handle.read_at(100 * BLOCK, &mut data);
            (result, started.elapsed())
        })
    };
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        !reader.is_finished(),
        "the reader waits while all is pinned"
    );
    handle.brelse(held.pop().expect("a held buffer"));
    let (result, elapsed) = reader.join().expect("reader thread");
    result.expect("the read succeeds once a buffer is released");
    assert!(
        elapsed < Duration::from_secs(5),
        "woken by the release, not the bound: {elapsed:?}"
    );
    let stats = cache.stats();
    assert_eq!(stats.buffer_waits, 1);
    assert_eq!(stats.space_failures, 0);
    assert!(
        stats.buffer_wait_ns >= 150_000_000,
        "wait measured on the clock: {} ns",
        stats.buffer_wait_ns
    );
    assert_eq!(stats.buffer_wait_buckets.iter().sum::<u64>(), 1);
    drop(held);
}

#[test]
fn a_wait_for_a_buffer_that_cannot_end_fails_after_the_bound() {
    // Goal: a reservation whose wait can never end (every buffer pinned for good) fails with
    // `NoSpace` after `space_wait_max`, on real time and on a clock that never moves, and
    // never hangs. Method: an 8-buffer cache with all 8 held by `bread`; a read of another
    // block on (a) the host's waiter and clock with a 300 ms bound, (b) the inline
    // environment (no waiting, frozen clock) with a 50 ms bound.
    let space_wait_max = Duration::from_millis(300);
    let cache = bufcache_host::system_cache(config(8, PolicyKind::Lru, space_wait_max))
        .expect("valid config");
    let handle = open(&cache);
    let held: Vec<_> = (0..8u64)
        .map(|block| handle.bread(block).expect("bread"))
        .collect();
    let started = Instant::now();
    let mut data = vec![0u8; BLOCK as usize];
    let error = handle
        .read_at(100 * BLOCK, &mut data)
        .expect_err("no buffer can be freed");
    let elapsed = started.elapsed();
    assert!(
        matches!(error, CacheError::NoSpace { waited } if waited >= space_wait_max),
        "{error}"
    );
    assert!(elapsed >= space_wait_max, "waited the bound: {elapsed:?}");
    assert!(
        elapsed < space_wait_max + Duration::from_secs(2),
        "bounded: {elapsed:?}"
    );
    let stats = cache.stats();
    assert_eq!((stats.buffer_waits, stats.space_failures), (1, 1));
    drop(held);

    let frozen = Cache::with_environment(
        config(8, PolicyKind::Clock, Duration::from_millis(50)),
        Environment::inline(Arc::new(FrozenClock)),
    )
    .expect("valid config");
    let handle = open(&frozen);
    let held: Vec<_> = (0..8u64)
        .map(|block| handle.bread(block).expect("bread"))
        .collect();
    let error = handle
        .read_at(100 * BLOCK, &mut data)
        .expect_err("no buffer can be freed");
    assert!(matches!(error, CacheError::NoSpace { .. }), "{error}");
    let stats = frozen.stats();
    assert_eq!((stats.buffer_waits, stats.space_failures), (1, 1));
    drop(held);
}
