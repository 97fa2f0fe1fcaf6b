//! A cache smaller than the work (issue #47): eviction walks only buffers it can take, and a
//! reservation that finds none waits for a release, bounded, instead of spinning.
//!
//! Method: tiny caches over a memory device; buffers made busy through the public API (dirty
//! data under high dirty limits, buffers held with `bread`), then the engine's own counters
//! (`eviction_candidates_examined`, `buffer_waits`, `buffer_wait_ns`) and the outcome of the
//! waiting call checked.

// Tests drive the engine from real threads on real time; only the engine itself may not.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::collections::HashSet;
use std::io::{self, IoSlice, IoSliceMut};
use std::ops::RangeInclusive;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bufcache::{
    Cache, CacheConfig, CacheError, Capabilities, Device, Environment, Extent, FaultDevice,
    FaultKind, FrozenClock, MemoryDevice, ObjectConfig, ObjectHandle, PolicyKind,
};
use rand::{Rng, SeedableRng};

const BLOCK: u64 = 4096;

fn config(buffers: u64, policy: PolicyKind, space_wait_max: Duration) -> CacheConfig {
    CacheConfig {
        buffer_bytes_max: BLOCK,
        cluster_bytes_max: BLOCK,
        memory_bytes_max: buffers * BLOCK,
        buffers_max: buffers,
        readahead_bytes_max: 0,
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
    // Goal: a writer that finds every buffer pinned sleeps until one is released and then
    // proceeds at once, and its wait is counted. Method: an 8-buffer cache on the host's
    // waiter and clock; the test holds all 8 with `bread`, a thread writes another block
    // (a read would stream instead: see `a_cold_read_that_finds_every_buffer_busy_is_streamed_not_cached`),
    // the test releases one buffer after 200 ms; the write must end well before the 20 s
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
            let data = vec![7u8; BLOCK as usize];
            let result = handle.write_at(100 * BLOCK, &data, false);
            (result, started.elapsed())
        })
    };
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        !reader.is_finished(),
        "the writer waits while all is pinned"
    );
    handle.brelse(held.pop().expect("a held buffer"));
    let (result, elapsed) = reader.join().expect("writer thread");
    result.expect("the write succeeds once a buffer is released");
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
    // never hangs. Method: an 8-buffer cache with all 8 held by `bread`; a write of another
    // block (a read would stream) on (a) the host's waiter and clock with a 300 ms bound, (b) the inline
    // environment (no waiting, frozen clock) with a 50 ms bound.
    let space_wait_max = Duration::from_millis(300);
    let cache = bufcache_host::system_cache(config(8, PolicyKind::Lru, space_wait_max))
        .expect("valid config");
    let handle = open(&cache);
    let held: Vec<_> = (0..8u64)
        .map(|block| handle.bread(block).expect("bread"))
        .collect();
    let started = Instant::now();
    let data = vec![7u8; BLOCK as usize];
    let error = handle
        .write_at(100 * BLOCK, &data, false)
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
        .write_at(100 * BLOCK, &data, false)
        .expect_err("no buffer can be freed");
    assert!(matches!(error, CacheError::NoSpace { .. }), "{error}");
    let stats = frozen.stats();
    assert_eq!((stats.buffer_waits, stats.space_failures), (1, 1));
    drop(held);
}

/// A memory device whose writes are not atomic, like a disk's: each lands in two halves with
/// a pause between, so a read meeting it at the device sees a torn block.
struct TearingWrites {
    inner: MemoryDevice,
}

impl Device for TearingWrites {
    fn read_vectored_at(&self, buffers: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<()> {
        self.inner.read_vectored_at(buffers, offset)
    }
    fn write_vectored_at(&self, buffers: &[IoSlice<'_>], offset: u64) -> io::Result<()> {
        let bytes: Vec<u8> = buffers
            .iter()
            .flat_map(|buffer| buffer.iter().copied())
            .collect();
        let (first, second) = bytes.split_at(bytes.len() / 2);
        self.inner
            .write_vectored_at(&[IoSlice::new(first)], offset)?;
        std::thread::sleep(Duration::from_micros(200));
        self.inner
            .write_vectored_at(&[IoSlice::new(second)], offset + first.len() as u64)
    }
    fn submit_writes(&self, writes: Vec<bufcache::device::WriteRequest>) {
        bufcache::device::write_each_now(self, writes)
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
        self.inner.capabilities()
    }
    fn describe(&self) -> String {
        "tearing writes".into()
    }
}

/// Marks a stamped word, so no stamp is zero.
const STAMPED: u64 = 1 << 63;

/// The 8-byte word every word of `block` holds at `version`: the block in the high bits, so
/// a word in the wrong place is caught as well as an old one.
fn stamp(block: u64, version: u64) -> u64 {
    STAMPED | (block << 40) | version
}

fn stamped_block(block: u64, version: u64) -> Vec<u8> {
    stamp(block, version)
        .to_le_bytes()
        .iter()
        .copied()
        .cycle()
        .take(BLOCK as usize)
        .collect()
}

/// What the two streamed-read race tests share: a 12-buffer cache (dirty limits 50 % and
/// 75 %) with one object over a device of `blocks` blocks that tears writes
/// ([`TearingWrites`]), every block stamped at version 0; and per block, the shadow
/// versions of the last write acknowledged and the last begun (0: the stamp).
struct Race {
    cache: Cache,
    handle: ObjectHandle,
    acknowledged: Arc<Vec<AtomicU64>>,
    begun: Arc<Vec<AtomicU64>>,
}

/// The [`Race`] of `seed`: its device delays 30 % of reads and of writes by up to 300 us,
/// and as `latencies` (kind, least, most, probability) adds.
fn start_race(seed: u64, blocks: u64, latencies: &[(FaultKind, Duration, Duration, f64)]) -> Race {
    let mut config = config(12, PolicyKind::S3Fifo, Duration::from_secs(10));
    config.dirty_background_percent = 50;
    config.dirty_limit_percent = 75;
    let cache = bufcache_host::system_cache(config).expect("valid config");
    let tearing = TearingWrites {
        inner: MemoryDevice::new(blocks * BLOCK),
    };
    let device = Arc::new(FaultDevice::new(tearing, seed));
    for block in 0..blocks {
        device
            .write_vectored_at(&[IoSlice::new(&stamped_block(block, 0))], block * BLOCK)
            .expect("device write");
    }
    let most = Duration::from_micros(300);
    let delayed = [
        (FaultKind::Read, Duration::ZERO, most, 0.3),
        (FaultKind::Write, Duration::ZERO, most, 0.3),
    ];
    for &(kind, least, most, probability) in delayed.iter().chain(latencies) {
        device.set_latency(kind, least, most, probability);
    }
    let handle = cache
        .open_object(ObjectConfig::new("race", device as Arc<dyn Device>))
        .expect("open object");
    let versions = || Arc::new((0..blocks).map(|_| AtomicU64::new(0)).collect());
    Race {
        cache,
        handle,
        acknowledged: versions(),
        begun: versions(),
    }
}

/// Asserts that `word`, read from `block`, is that block's stamp at a version in `allowed`.
fn assert_stamped(seed: u64, block: u64, word: u64, allowed: &RangeInclusive<u64>) {
    assert_eq!(
        (word & !STAMPED) >> 40,
        block,
        "seed {seed}: block {block} holds no stamp of its own ({word:#x})"
    );
    let version = word & ((1 << 40) - 1);
    assert!(
        allowed.contains(&version),
        "seed {seed}: block {block} read version {version}, allowed {allowed:?}"
    );
}

/// Starts the three readers of the [`Race`] of `seed`, each with a seeded stream of its own,
/// each making `operations` reads of a random 512-byte-aligned range of up to 12 KiB. A read
/// checks that no block of it is torn and hands `check` each block's word with the versions
/// the read may return: from the last write acknowledged before it began to the last begun
/// before it ended.
fn spawn_readers(
    race: &Race,
    seed: u64,
    operations: u64,
    check: impl Fn(u64, u64, RangeInclusive<u64>) + Clone + Send + 'static,
) -> Vec<std::thread::JoinHandle<()>> {
    (0..3u64)
        .map(|reader| {
            let (handle, acknowledged, begun, check) = (
                race.handle.reopen(),
                Arc::clone(&race.acknowledged),
                Arc::clone(&race.begun),
                check.clone(),
            );
            std::thread::spawn(move || {
                let mut random = rand::rngs::StdRng::seed_from_u64(seed * 16 + 8 + reader);
                for _ in 0..operations {
                    read_racing(&handle, &mut random, seed, &acknowledged, &begun, &check);
                }
            })
        })
        .collect()
}

/// One read of [`spawn_readers`].
fn read_racing(
    handle: &ObjectHandle,
    random: &mut rand::rngs::StdRng,
    seed: u64,
    acknowledged: &[AtomicU64],
    begun: &[AtomicU64],
    mut check: impl FnMut(u64, u64, RangeInclusive<u64>),
) {
    let blocks = acknowledged.len() as u64;
    let offset = random.gen_range(0..blocks * 8) * 512;
    let length_bytes = (random.gen_range(1..=24u64) * 512).min(blocks * BLOCK - offset);
    let (first, end) = (offset / BLOCK, (offset + length_bytes).div_ceil(BLOCK));
    let oldest: Vec<u64> = (first..end)
        .map(|block| acknowledged[block as usize].load(Ordering::SeqCst))
        .collect();
    let mut data = vec![0u8; length_bytes as usize];
    handle
        .read_at(offset, &mut data)
        .unwrap_or_else(|error| panic!("seed {seed}: read: {error}"));
    let newest: Vec<u64> = (first..end)
        .map(|block| begun[block as usize].load(Ordering::SeqCst))
        .collect();
    for block in first..end {
        let from = offset.max(block * BLOCK);
        let to = (offset + length_bytes).min((block + 1) * BLOCK);
        let words: HashSet<u64> = data[(from - offset) as usize..(to - offset) as usize]
            .chunks_exact(8)
            .map(|word| u64::from_le_bytes(word.try_into().unwrap()))
            .collect();
        assert_eq!(words.len(), 1, "seed {seed}: block {block} torn");
        let word = *words.iter().next().unwrap();
        let index = (block - first) as usize;
        check(block, word, oldest[index]..=newest[index]);
    }
}

#[test]
fn a_cold_read_that_finds_every_buffer_busy_is_streamed_not_cached() {
    // Goal: rule 4 of "Admission under pressure" (docs/design.md): a cold read that finds no
    // buffer it could take without evicting what others use is served straight from the
    // device into the caller's memory, caching nothing, instead of waiting for space; a
    // read that covers cached blocks takes those from the cache (here: a dirty one, newer
    // than the device). Method: an 8-buffer cache (inline, frozen clock); block 101 is
    // written (dirty), then 7 other blocks held with `bread`, so no buffer is free; a read of
    // 3.5 blocks at an unaligned offset over blocks 100..104 must return the device's bytes
    // for 100, 102 and 103 and the dirty bytes of 101, with no buffer wait, two streamed
    // device reads (around the cached block) and nothing new cached.
    let mut config = config(8, PolicyKind::S3Fifo, Duration::from_millis(50));
    config.cluster_bytes_max = 16 * BLOCK;
    let cache = Cache::with_environment(config, Environment::inline(Arc::new(FrozenClock)))
        .expect("valid config");
    let device = Arc::new(MemoryDevice::new(64 << 20));
    for block in 100..104u64 {
        device
            .write_vectored_at(&[IoSlice::new(&stamped_block(block, 1))], block * BLOCK)
            .expect("device write");
    }
    let handle = cache
        .open_object(ObjectConfig::new("stream", device as Arc<dyn Device>))
        .expect("open object");
    handle
        .write_at(101 * BLOCK, &stamped_block(101, 2), false)
        .expect("write");
    let held: Vec<_> = (0..7u64)
        .map(|block| handle.bread(block).expect("bread"))
        .collect();
    let before = cache.stats();
    let offset = 100 * BLOCK + 512;
    let mut data = vec![0u8; (3 * BLOCK + BLOCK / 2) as usize];
    handle.read_at(offset, &mut data).expect("read");
    for (index, word) in data.chunks_exact(8).enumerate() {
        let block = (offset + index as u64 * 8) / BLOCK;
        let version = if block == 101 { 2 } else { 1 };
        let word = u64::from_le_bytes(word.try_into().expect("a word"));
        assert_eq!(word, stamp(block, version), "word {index} of block {block}");
    }
    let after = cache.stats();
    assert_eq!(after.buffer_waits, before.buffer_waits, "nobody waited");
    assert_eq!(after.streamed_reads - before.streamed_reads, 2);
    assert_eq!(after.streamed_blocks - before.streamed_blocks, 3);
    for block in [100u64, 102, 103] {
        assert!(
            !handle.is_resident(block * BLOCK, BLOCK),
            "{block} not cached"
        );
    }
    drop(held);
}

#[test]
fn streamed_reads_never_return_data_older_than_a_completed_write() {
    // Goal: a streaming read (which bypasses the cache) never returns a block older than a
    // write of it that completed before the read began, nor one newer than the last write
    // begun before the read ended, nor a torn block; with writes (some FUA) and flushes of
    // the same blocks racing it (a write landing between the read's look at the table and
    // its device read, a write-back at the device meanwhile). Method: a shadow model per
    // block (the version of the last write acknowledged, of the last begun) against a
    // 12-buffer cache on real threads and time over a device that delays some reads and
    // writes and writes each request in two halves (a torn block if a read meets it); two
    // writers (each owning half the blocks, so a block's versions only grow) write stamped
    // blocks, some FUA, three readers read 512-byte-aligned ranges and check every word.
    // Seeds are printed; a failure names its seed. At least some reads must have streamed,
    // or the property was not exercised. (Zeroing races reads in the sibling test
    // `a_read_during_a_zeroing_never_returns_data_older_than_a_completed_write`.)
    const BLOCKS: u64 = 64;
    const SEEDS: u64 = 16;
    const OPERATIONS: u64 = 250;
    let mut streamed_total = 0;
    for seed in 0..SEEDS {
        eprintln!("streamed_reads_never_return_data_older_than_a_completed_write: seed {seed}");
        let race = start_race(seed, BLOCKS, &[]);
        let writers: Vec<_> = (0..2u64)
            .map(|writer| {
                let (handle, acknowledged, begun) = (
                    race.handle.reopen(),
                    Arc::clone(&race.acknowledged),
                    Arc::clone(&race.begun),
                );
                std::thread::spawn(move || {
                    let mut random = rand::rngs::StdRng::seed_from_u64(seed * 16 + writer);
                    let owned = writer * BLOCKS / 2..(writer + 1) * BLOCKS / 2;
                    for version in 1..=OPERATIONS {
                        let first = random.gen_range(owned.clone());
                        let end = (first + random.gen_range(1..=3)).min(owned.end);
                        for block in first..end {
                            begun[block as usize].store(version, Ordering::SeqCst);
                        }
                        let data: Vec<u8> = (first..end)
                            .flat_map(|block| stamped_block(block, version))
                            .collect();
                        handle
                            .write_at(first * BLOCK, &data, random.gen_bool(0.3))
                            .unwrap_or_else(|error| panic!("seed {seed}: write: {error}"));
                        for block in first..end {
                            acknowledged[block as usize].store(version, Ordering::SeqCst);
                        }
                        if random.gen_bool(0.03) {
                            handle
                                .flush()
                                .unwrap_or_else(|error| panic!("seed {seed}: flush: {error}"));
                        }
                    }
                })
            })
            .collect();
        let readers = spawn_readers(&race, seed, OPERATIONS, move |block, word, allowed| {
            assert_stamped(seed, block, word, &allowed)
        });
        for thread in writers.into_iter().chain(readers) {
            thread
                .join()
                .unwrap_or_else(|_| panic!("seed {seed}: a thread failed"));
        }
        streamed_total += race.cache.stats().streamed_reads;
    }
    eprintln!("streamed reads over all seeds: {streamed_total}");
    assert!(
        streamed_total > 0,
        "no read streamed: the property was not exercised"
    );
}

#[test]
fn a_read_during_a_zeroing_never_returns_data_older_than_a_completed_write() {
    // Goal: a read that meets a zeroing of its block at the device returns the data of a
    // write completed before the read began (or newer), or zeroes of a zeroing begun before
    // the read ended, never older device bytes: a zeroing must not let a reader miss on a
    // dirty block it is replacing and read what that block's write had not yet replaced on
    // the device. Method: the shadow model of
    // `streamed_reads_never_return_data_older_than_a_completed_write` (versions acknowledged
    // and begun per block; a 12-buffer cache on real threads and time; a device that delays
    // some reads and writes and tears writes in two halves), where a third of the writers'
    // operations zero whole blocks instead of writing them (half a fast zeroing, half a
    // discard, which this device reads back as zeroes; either takes the device 100-400 us,
    // so reads meet it); a block read as zeroes must have a zeroing in the versions the
    // read allows. Seeds are printed; a failure names its seed. Some
    // reads must have returned zeroes, or the property was not exercised.
    const BLOCKS: u64 = 64;
    const SEEDS: u64 = 16;
    const OPERATIONS: u64 = 250;
    let mut zero_reads_total = 0u64;
    for seed in 0..SEEDS {
        eprintln!(
            "a_read_during_a_zeroing_never_returns_data_older_than_a_completed_write: seed {seed}"
        );
        let discard_latency = (
            FaultKind::Discard,
            Duration::from_micros(100),
            Duration::from_micros(300),
            0.5,
        );
        let race = start_race(seed, BLOCKS, &[discard_latency]);
        // The versions of each block that were zeroings, recorded before they begin.
        let zeroings: Arc<Vec<Mutex<Vec<u64>>>> =
            Arc::new((0..BLOCKS).map(|_| Mutex::new(Vec::new())).collect());
        let zero_reads = Arc::new(AtomicU64::new(0));
        let writers: Vec<_> = (0..2u64)
            .map(|writer| {
                let (handle, acknowledged, begun, zeroings) = (
                    race.handle.reopen(),
                    Arc::clone(&race.acknowledged),
                    Arc::clone(&race.begun),
                    Arc::clone(&zeroings),
                );
                std::thread::spawn(move || {
                    let mut random = rand::rngs::StdRng::seed_from_u64(seed * 16 + writer);
                    let owned = writer * BLOCKS / 2..(writer + 1) * BLOCKS / 2;
                    for version in 1..=OPERATIONS {
                        let first = random.gen_range(owned.clone());
                        let end = (first + random.gen_range(1..=3)).min(owned.end);
                        let zeroing = random.gen_bool(0.33);
                        let fua = random.gen_bool(0.3);
                        for block in first..end {
                            if zeroing {
                                zeroings[block as usize].lock().unwrap().push(version);
                            }
                            begun[block as usize].store(version, Ordering::SeqCst);
                        }
                        if zeroing && random.gen_bool(0.5) {
                            // The memory device's discards read back as zeroes.
                            handle
                                .discard(first * BLOCK, (end - first) * BLOCK)
                                .unwrap_or_else(|error| panic!("seed {seed}: discard: {error}"));
                        } else if zeroing {
                            handle
                                .write_zeroes(first * BLOCK, (end - first) * BLOCK, fua)
                                .unwrap_or_else(|error| panic!("seed {seed}: zeroing: {error}"));
                        } else {
                            let data: Vec<u8> = (first..end)
                                .flat_map(|block| stamped_block(block, version))
                                .collect();
                            handle
                                .write_at(first * BLOCK, &data, fua)
                                .unwrap_or_else(|error| panic!("seed {seed}: write: {error}"));
                        }
                        for block in first..end {
                            acknowledged[block as usize].store(version, Ordering::SeqCst);
                        }
                        if random.gen_bool(0.03) {
                            handle
                                .flush()
                                .unwrap_or_else(|error| panic!("seed {seed}: flush: {error}"));
                        }
                    }
                })
            })
            .collect();
        let (zeroings_read, zero_reads_counted) = (Arc::clone(&zeroings), Arc::clone(&zero_reads));
        let readers = spawn_readers(&race, seed, OPERATIONS, move |block, word, allowed| {
            if word == 0 {
                zero_reads_counted.fetch_add(1, Ordering::Relaxed);
                let zeroed = zeroings_read[block as usize]
                    .lock()
                    .unwrap()
                    .iter()
                    .any(|version| allowed.contains(version));
                assert!(
                    zeroed,
                    "seed {seed}: block {block} read as zeroes, no zeroing in {allowed:?}"
                );
                return;
            }
            assert_stamped(seed, block, word, &allowed);
        });
        for thread in writers.into_iter().chain(readers) {
            thread
                .join()
                .unwrap_or_else(|_| panic!("seed {seed}: a thread failed"));
        }
        zero_reads_total += zero_reads.load(Ordering::Relaxed);
    }
    eprintln!("blocks read as zeroes over all seeds: {zero_reads_total}");
    assert!(
        zero_reads_total > 0,
        "no block read as zeroes: the property was not exercised"
    );
}

#[test]
fn writers_under_pressure_wait_for_writeback_in_flight_instead_of_writing_back_themselves() {
    // Goal: rule 5 of "Admission under pressure" (docs/design.md): a writer under pressure
    // (no buffer to evict, or above the dirty limit) while its device's write-back share is
    // full waits for those writes to end (woken by their completion) instead of writing
    // back too, and no dirty data is lost. Method: an 8-buffer cache on the host's waiter, a write-back share of one
    // request, a device whose writes take 20 ms; four threads each write 24 distinct blocks
    // (far more than the cache); some reservations must have waited for write-back in
    // flight, none may fail, and after a flush the device holds every block's data.
    let mut config = config(8, PolicyKind::Lru, Duration::from_secs(20));
    config.writeback_inflight_max = 1;
    let cache = bufcache_host::system_cache(config).expect("valid config");
    let device = Arc::new(FaultDevice::new(MemoryDevice::new(64 << 20), 1));
    device.set_latency(
        FaultKind::Write,
        Duration::from_millis(20),
        Duration::ZERO,
        0.0,
    );
    let handle = cache
        .open_object(ObjectConfig::new(
            "writers",
            Arc::clone(&device) as Arc<dyn Device>,
        ))
        .expect("open object");
    let writers: Vec<_> = (0..4u64)
        .map(|writer| {
            let handle = handle.reopen();
            std::thread::spawn(move || {
                for index in 0..24u64 {
                    let block = writer * 1000 + index * 2;
                    handle
                        .write_at(block * BLOCK, &stamped_block(block, 1), false)
                        .expect("write under pressure");
                }
            })
        })
        .collect();
    for writer in writers {
        writer.join().expect("writer thread");
    }
    handle.flush().expect("flush");
    let stats = cache.stats();
    assert!(
        stats.writeback_waits > 0,
        "writers waited for write-back in flight: {stats:?}"
    );
    assert_eq!(stats.space_failures, 0);
    let mut data = vec![0u8; BLOCK as usize];
    for writer in 0..4u64 {
        for index in 0..24u64 {
            let block = writer * 1000 + index * 2;
            device
                .read_vectored_at(&mut [IoSliceMut::new(&mut data)], block * BLOCK)
                .expect("device read");
            assert_eq!(
                data,
                stamped_block(block, 1),
                "block {block} reached the device"
            );
        }
    }
}

/// The host's waiter with every wait stretched to `STRETCHED_WAIT_NS` and counted: a wakeup
/// the engine lost shows as a wait that slept its whole stretched timeout instead of being
/// covered by the engine's next look a few milliseconds later. (A wait may also return early
/// with no notification of its own: a notification sent just after its ticket was taken
/// can reach it; that is allowed and not counted.)
#[derive(Default)]
struct StretchedWaiter {
    inner: bufcache_host::BlockingWaiter,
    waits: AtomicU64,
    timed_out: AtomicU64,
}

const STRETCHED_WAIT_NS: u64 = 20_000_000_000;

impl bufcache::Waiter for StretchedWaiter {
    fn ticket(&self) -> u64 {
        self.inner.ticket()
    }

    fn wait(&self, ticket: u64, _timeout_ns: u64) {
        self.waits.fetch_add(1, Ordering::SeqCst);
        let started = Instant::now();
        self.inner.wait(ticket, STRETCHED_WAIT_NS);
        if started.elapsed() >= Duration::from_nanos(STRETCHED_WAIT_NS) {
            self.timed_out.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn notify_all(&self) {
        self.inner.notify_all();
    }
}

#[test]
fn many_clients_on_a_few_buffers_lose_no_wakeup_and_never_deadlock() {
    // Goal: many clients on a cache of a few buffers: no waiter sleeps on while a buffer it
    // could take is free (a lost wakeup), and nothing deadlocks.
    // Method: for each seed, 12 threads share a cache of 3 buffers; each takes 60 seeded
    // blocks of 32 with `bread` (which waits for space when all 3 are held), holds each for
    // a seeded few hundred microseconds and lets it go. Every wait is stretched to 20 s by
    // the injected waiter, so a lost wakeup would show as a wait that slept all 20 s; none may,
    // every call must succeed, and the threads must have waited (the test exercised the
    // wake path). Seeds are printed on failure.
    const THREADS: u64 = 12;
    const BLOCKS_PER_THREAD: usize = 60;
    for seed in 1..=4u64 {
        let waiter = Arc::new(StretchedWaiter::default());
        let environment = Environment::new(
            Arc::new(FrozenClock),
            Arc::new(bufcache::InlineSpawner),
            waiter.clone() as Arc<dyn bufcache::Waiter>,
        );
        let cache = Cache::with_environment(
            config(3, PolicyKind::S3Fifo, Duration::from_secs(60)),
            environment,
        )
        .expect("valid config");
        let handle = open(&cache);
        let started = Instant::now();
        let threads: Vec<_> = (0..THREADS)
            .map(|thread| {
                let handle = handle.reopen();
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed * 1000 + thread);
                std::thread::spawn(move || -> Result<(), CacheError> {
                    for _ in 0..BLOCKS_PER_THREAD {
                        let guard = handle.bread(rng.gen_range(0..32))?;
                        std::thread::sleep(Duration::from_micros(rng.gen_range(0..400)));
                        handle.brelse(guard);
                    }
                    Ok(())
                })
            })
            .collect();
        for thread in threads {
            thread
                .join()
                .expect("client thread")
                .unwrap_or_else(|error| panic!("seed {seed}: a client failed: {error}"));
        }
        let elapsed = started.elapsed();
        let stats = cache.stats();
        assert_eq!(
            waiter.timed_out.load(Ordering::SeqCst),
            0,
            "seed {seed}: a wait ran out with a buffer free (lost wakeup) after {elapsed:?}"
        );
        assert!(
            elapsed < Duration::from_secs(15),
            "seed {seed}: {elapsed:?}"
        );
        assert!(
            stats.buffer_waits > 0 && waiter.waits.load(Ordering::SeqCst) > 0,
            "seed {seed}: no client waited for space ({} waits)",
            stats.buffer_waits
        );
        assert_eq!(stats.space_failures, 0, "seed {seed}");
    }
}

/// A cache of `buffers` with a dirty limit of a quarter and one write-back slot, and an
/// object "paced" on it over a device whose writes take `write_latency`: a few writers keep
/// it above the dirty limit for as long as they write.
fn paced_object(
    buffers: u64,
    policy: PolicyKind,
    write_latency: Duration,
) -> (Cache, Arc<FaultDevice<MemoryDevice>>, ObjectHandle) {
    let mut config = config(buffers, policy, Duration::from_secs(30));
    config.dirty_background_percent = 20;
    config.dirty_limit_percent = 25;
    config.writeback_inflight_max = 1;
    let cache = bufcache_host::system_cache(config).expect("valid config");
    let device = Arc::new(FaultDevice::new(MemoryDevice::new(64 << 20), 1));
    device.set_latency(FaultKind::Write, write_latency, Duration::ZERO, 0.0);
    let handle = cache
        .open_object(ObjectConfig::new(
            "paced",
            Arc::clone(&device) as Arc<dyn Device>,
        ))
        .expect("open object");
    (cache, device, handle)
}

const PACED_WRITERS: u64 = 8;
const PACED_WRITES_PER_WRITER: u64 = 12;

/// The distinct blocks the paced writers write, writer by writer.
fn paced_blocks() -> impl Iterator<Item = u64> {
    (0..PACED_WRITERS).flat_map(|writer| {
        (0..PACED_WRITES_PER_WRITER).map(move |index| 100 + writer * 1000 + index * 2)
    })
}

/// Eight threads, each writing its share of [`paced_blocks`] (version 1) through its own
/// handle on `handle`'s object.
fn spawn_paced_writers(handle: &ObjectHandle) -> Vec<std::thread::JoinHandle<()>> {
    let blocks: Vec<u64> = paced_blocks().collect();
    blocks
        .chunks(PACED_WRITES_PER_WRITER as usize)
        .map(|share| {
            let handle = handle.reopen();
            let share = share.to_vec();
            std::thread::spawn(move || {
                for block in share {
                    handle
                        .write_at(block * BLOCK, &stamped_block(block, 1), false)
                        .expect("write under pressure");
                }
            })
        })
        .collect()
}

/// Joins the paced writers, flushes, and checks every block they wrote on `device`.
fn assert_paced_writes_reach_the_device(
    writers: Vec<std::thread::JoinHandle<()>>,
    handle: &ObjectHandle,
    device: &FaultDevice<MemoryDevice>,
) {
    for writer in writers {
        writer.join().expect("writer thread");
    }
    handle.flush().expect("flush");
    let mut data = vec![0u8; BLOCK as usize];
    for block in paced_blocks() {
        device
            .read_vectored_at(&mut [IoSliceMut::new(&mut data)], block * BLOCK)
            .expect("device read");
        assert!(
            data == stamped_block(block, 1),
            "block {block} did not reach the device"
        );
    }
}

/// Waits until `handle` says a write of `length_bytes` above the dirty limit would be paced
/// (enough writers wait above it), or panics after a minute.
fn wait_until_paced(handle: &ObjectHandle, length_bytes: u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !handle.write_is_quick(0, length_bytes, false) {
        assert!(
            Instant::now() < deadline,
            "the writers never waited above the dirty limit"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn writes_above_the_dirty_limit_are_paced_in_their_own_thread_once_enough_writers_wait() {
    // Goal: rule 8 of "Admission under pressure" (docs/design.md): a write that would go
    // above the dirty limit is not quick (a server hands it to a worker thread) while few
    // writers wait for write-back, and is quick (a server does it in the thread that read
    // it, pacing that connection) once enough writers already wait above the limit; when
    // they are done it is not quick again, and every block written reaches the device.
    // Method: a 16-buffer cache with a dirty limit of a quarter, one write-back slot and a
    // device whose writes take 100 ms; a write of the whole cache's size is above the limit
    // by itself. Asked with no writer waiting, then while eight threads write 12 distinct
    // blocks each (all of them throttled most of the time), then after they end.
    let (_cache, device, handle) = paced_object(16, PolicyKind::Lru, Duration::from_millis(100));
    let above_the_limit = 16 * BLOCK;
    assert!(
        !handle.write_is_quick(0, above_the_limit, false),
        "no writer waits: a write above the limit goes to a worker"
    );
    let writers = spawn_paced_writers(&handle);
    wait_until_paced(&handle, above_the_limit);
    for writer in writers {
        writer.join().expect("writer thread");
    }
    assert!(
        !handle.write_is_quick(0, above_the_limit, false),
        "the writers are gone: a write above the limit goes to a worker again"
    );
    assert!(
        !handle.write_is_quick(0, BLOCK, true),
        "a FUA write is never quick"
    );
    assert_paced_writes_reach_the_device(Vec::new(), &handle, &device);
}

#[test]
fn a_writer_paced_on_one_object_never_holds_up_reads_of_another() {
    // Goal: two exports of one cache share its dirty limit and its throttled-writer count
    // (rule 8), but pacing is for writers only: while one object's writers wait above the
    // limit for a slow device, another object's readers, hits and cold misses alike, are
    // served at once, with their own bytes. Method: a 64-buffer cache with a dirty limit of
    // a quarter and one write-back slot; object "paced" over a device whose writes take
    // 50 ms, eight threads writing 12 blocks each to it (seconds of write-back backlog);
    // once enough of them wait that a write above the limit is paced (`write_is_quick`),
    // a reader of object "fast" (a memory device filled beforehand) reads 48 distinct
    // blocks twice and checks every byte. It must be done while the writers still wait
    // (the backlog is far longer than the reads); then the writers' blocks are flushed and
    // checked on the device. With reads made to wait while writers are paced, it fails.
    let (cache, slow_device, slow) =
        paced_object(64, PolicyKind::S3Fifo, Duration::from_millis(50));
    let fast_device = MemoryDevice::new(1 << 20);
    const FAST_BLOCKS: u64 = 48;
    for block in 0..FAST_BLOCKS {
        fast_device
            .write_vectored_at(&[IoSlice::new(&stamped_block(block, 7))], block * BLOCK)
            .expect("fill the fast device");
    }
    let fast = cache
        .open_object(ObjectConfig::new(
            "fast",
            Arc::new(fast_device) as Arc<dyn Device>,
        ))
        .expect("open the fast object");
    let writers = spawn_paced_writers(&slow);
    let above_the_limit = 64 * BLOCK;
    wait_until_paced(&slow, above_the_limit);
    let mut data = vec![0u8; BLOCK as usize];
    for pass in 0..2 {
        for block in 0..FAST_BLOCKS {
            fast.read_at(block * BLOCK, &mut data)
                .expect("read of the fast object");
            assert!(
                data == stamped_block(block, 7),
                "pass {pass}: block {block} of the fast object read other bytes"
            );
        }
    }
    assert!(
        slow.write_is_quick(0, above_the_limit, false),
        "the slow object's writers stopped waiting before the fast object's reads were done: \
         the reads waited behind their write-back"
    );
    assert_paced_writes_reach_the_device(writers, &slow, &slow_device);
}
