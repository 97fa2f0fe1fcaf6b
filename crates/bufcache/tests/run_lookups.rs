//! Run-at-a-time table work: a request looks its blocks up a chunk at a time (one probe and
//! one shard lock per 16 blocks) and keeps the found ones pinned while it serves the rest.
//!
//! Method: real caches over memory devices, requests that start and end inside chunks and
//! mix cached and absent blocks, checked against a byte model; the statistics show each
//! block counted once; tiny caches show that pinning a run never starves the request's own
//! misses.

// Tests drive the engine from real threads on real time; only the engine itself may not.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::sync::Arc;
use std::time::Duration;

use bufcache::{
    Cache, CacheConfig, CountingDevice, Device, MemoryDevice, ObjectConfig, ObjectHandle,
    PolicyKind,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const BLOCK: u64 = 4096;

fn cache(memory_bytes_max: u64, buffers_max: u64) -> Cache {
    bufcache_host::system_cache(CacheConfig {
        buffer_bytes_max: BLOCK,
        memory_bytes_max,
        buffers_max,
        readahead_bytes_max: 0,
        policy: PolicyKind::Lru,
        shards: 4,
        space_wait_max: Duration::from_secs(5),
        write_behind: false,
        ..CacheConfig::default()
    })
    .expect("valid config")
}

fn object(cache: &Cache, blocks: u64) -> ObjectHandle {
    let device: Arc<dyn Device> = Arc::new(MemoryDevice::new(blocks * BLOCK));
    cache
        .open_object(ObjectConfig::new("runs", device))
        .expect("open object")
}

fn pattern(seed: u64, length: usize) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut bytes = vec![0u8; length];
    rng.fill(&mut bytes[..]);
    bytes
}

/// An object of `blocks` blocks whose device holds pattern `seed`; returns it and the bytes.
fn object_holding(cache: &Cache, blocks: u64, seed: u64) -> (ObjectHandle, Vec<u8>) {
    let handle = object(cache, blocks);
    let data = pattern(seed, (blocks * BLOCK) as usize);
    handle
        .device()
        .write_vectored_at(&[std::io::IoSlice::new(&data)], 0)
        .expect("fill the device");
    (handle, data)
}

/// `read_with` into `scratch`: the bytes the receiver got, and how many times it was called.
fn read_with_received(handle: &ObjectHandle, offset: u64, scratch: &mut [u8]) -> (Vec<u8>, u32) {
    let mut received = Vec::new();
    let mut calls = 0;
    handle
        .read_with(offset, scratch, &mut |slices| {
            calls += 1;
            for slice in slices {
                received.extend_from_slice(slice);
            }
            Ok(())
        })
        .expect("read_with");
    (received, calls)
}

#[test]
fn a_request_counts_each_cached_block_as_one_hit() {
    // Goal: looking a run up at once must not count hits for blocks twice or for blocks the
    // request never used. Method: cache 300 blocks starting inside a chunk (block 5), read
    // them back in one request, then a range half cached; compare the hit and miss deltas.
    let cache = cache(8 << 20, 2048);
    let handle = object(&cache, 1024);
    let data = pattern(1, 300 * BLOCK as usize);
    handle.write_at(5 * BLOCK, &data, false).expect("write");
    let before = cache.stats();
    let mut back = vec![0u8; data.len()];
    handle.read_at(5 * BLOCK, &mut back).expect("read");
    let after = cache.stats();
    assert_eq!(back, data, "the cached run reads back as written");
    assert_eq!(after.hits - before.hits, 300, "one hit per cached block");
    assert_eq!(after.misses - before.misses, 0, "nothing missed");

    // Blocks 205..405: 100 cached (205..305), 100 never written (305..405).
    let before = cache.stats();
    let mut back = vec![0u8; 200 * BLOCK as usize];
    handle.read_at(205 * BLOCK, &mut back).expect("read");
    let after = cache.stats();
    assert_eq!(
        &back[..100 * BLOCK as usize],
        &data[200 * BLOCK as usize..],
        "the cached half"
    );
    assert!(
        back[100 * BLOCK as usize..].iter().all(|&byte| byte == 0),
        "the never-written half reads as zeroes"
    );
    assert_eq!(after.hits - before.hits, 100, "hits: the cached half");
    assert_eq!(after.misses - before.misses, 100, "misses: the absent half");
}

#[test]
fn runs_mixing_cached_dropped_and_absent_blocks_read_and_write_the_model() {
    // Goal: a run lookup taken before a miss must never serve a block that changed or left
    // the table meanwhile. Method: 2,000 random reads, writes and discards (lengths up to 80
    // blocks, unaligned offsets) on one object, each checked against a byte model.
    let cache = cache(1 << 20, 256);
    let blocks = 512u64;
    let handle = object(&cache, blocks);
    let mut model = vec![0u8; (blocks * BLOCK) as usize];
    let mut rng = StdRng::seed_from_u64(42);
    for step in 0..2000u64 {
        let length = rng.gen_range(1..80 * BLOCK) as usize;
        let offset = rng.gen_range(0..blocks * BLOCK - length as u64);
        let range = offset as usize..offset as usize + length;
        match rng.gen_range(0..10) {
            0..=3 => {
                let data = pattern(step, length);
                handle.write_at(offset, &data, false).expect("write");
                model[range].copy_from_slice(&data);
            }
            4 => {
                // Drops the whole blocks inside from the cache; the memory device reads them
                // back as zeroes. Partial blocks at the edges keep their bytes.
                handle.discard(offset, length as u64).expect("discard");
                let first = offset.div_ceil(BLOCK);
                let end = (offset + length as u64) / BLOCK;
                if first < end {
                    model[(first * BLOCK) as usize..(end * BLOCK) as usize].fill(0);
                }
            }
            _ => {
                let mut back = vec![0u8; length];
                handle.read_at(offset, &mut back).expect("read");
                assert!(
                    back == model[range],
                    "step {step}: read of {length} bytes at {offset} differs from the model"
                );
            }
        }
    }
    handle.flush().expect("flush");
}

#[test]
fn a_request_larger_than_the_cache_never_starves_its_own_misses() {
    // Goal: blocks a request looked up and pinned must not be what its own misses wait for.
    // Method: an 8-buffer cache; every other block of a 64-block range is cached (as far as
    // 8 buffers allow), then one read and one write of the whole range must complete (the
    // space wait is 5 s, so starving would fail with NoSpace) with the right bytes.
    let cache = cache(32 << 10, 8);
    let handle = object(&cache, 128);
    let mut model = vec![0u8; 128 * BLOCK as usize];
    for block in (0..64u64).step_by(2) {
        let data = pattern(block, BLOCK as usize);
        handle.write_at(block * BLOCK, &data, false).expect("write");
        model[(block * BLOCK) as usize..((block + 1) * BLOCK) as usize].copy_from_slice(&data);
    }
    let mut back = vec![0u8; 64 * BLOCK as usize];
    handle
        .read_at(0, &mut back)
        .expect("read larger than the cache");
    assert!(back == model[..back.len()], "read back the model");

    let data = pattern(99, 64 * BLOCK as usize + 100);
    handle
        .write_at(50, &data, false)
        .expect("write larger than the cache");
    model[50..50 + data.len()].copy_from_slice(&data);
    handle.flush().expect("flush");
    let mut back = vec![0u8; model.len()];
    handle.read_at(0, &mut back).expect("read all");
    assert!(back == model, "everything written reads back");
}

#[test]
fn read_with_hands_out_exactly_the_bytes_read_at_returns() {
    // Goal: a read served from the cache's own buffers (every block cached) or through the
    // caller's buffer (some block missing) delivers the same bytes as `read_at`, trimmed to
    // unaligned edges, once. Method: half the blocks of an object cached; 500 random
    // unaligned ranges read both ways and compared; the receiver is called exactly once.
    let cache = cache(8 << 20, 2048);
    let blocks = 256u64;
    let (handle, data) = object_holding(&cache, blocks, 7);
    let mut rng = StdRng::seed_from_u64(8);
    for block in (0..blocks).filter(|_| rng.gen_bool(0.5)) {
        let mut warm = vec![0u8; BLOCK as usize];
        handle.read_at(block * BLOCK, &mut warm).expect("warm");
    }
    for step in 0..500 {
        let length = rng.gen_range(1..20 * BLOCK) as usize;
        let offset = rng.gen_range(0..blocks * BLOCK - length as u64);
        let mut scratch = vec![0u8; length];
        let (received, calls) = read_with_received(&handle, offset, &mut scratch);
        assert_eq!(calls, 1, "step {step}: the receiver is called once");
        assert!(
            received == data[offset as usize..offset as usize + length],
            "step {step}: {length} bytes at {offset} differ from the device"
        );
    }
}

#[test]
fn a_read_that_misses_is_lent_from_the_cache_and_counted_once() {
    // Goal: a read whose blocks are absent still reaches the receiver straight from the
    // cache's buffers (one copy on the way out, not a copy into the caller's buffer first),
    // and its blocks count as one miss each, no hit; in a cache too small to hold the read,
    // it falls back to the caller's buffer with the same bytes. Method: a cold object read
    // with `read_with` and a scratch buffer full of a sentinel; the scratch must come back
    // untouched while the receiver gets the device's bytes; the statistics' deltas; then the
    // same with an 8-buffer cache and a 40-block read, where the scratch must be used.
    let cache = cache(8 << 20, 2048);
    let blocks = 64u64;
    let (handle, data) = object_holding(&cache, blocks, 11);
    let (offset, length) = (3 * BLOCK + 100, 20 * BLOCK as usize);
    let before = cache.stats();
    let mut scratch = vec![0xAA; length];
    let (received, _) = read_with_received(&handle, offset, &mut scratch);
    let after = cache.stats();
    assert!(received == data[offset as usize..offset as usize + length]);
    assert!(
        scratch.iter().all(|&byte| byte == 0xAA),
        "the bytes went out from the cache's buffers, not through the caller's"
    );
    assert_eq!(
        after.misses - before.misses,
        21,
        "one miss per block touched"
    );
    assert_eq!(
        after.hits - before.hits,
        0,
        "lending the filled blocks counts no hit"
    );

    let tiny = cache_with_buffers(8);
    let (handle, data) = object_holding(&tiny, blocks, 11);
    let mut scratch = vec![0xAA; 40 * BLOCK as usize];
    let (offset, length) = (BLOCK, 40 * BLOCK as usize);
    let (received, _) = read_with_received(&handle, offset, &mut scratch);
    assert!(
        received == data[offset as usize..offset as usize + length],
        "a read larger than the cache is served whole"
    );
    assert!(
        scratch[..length] == received[..],
        "it could not be lent whole, so it went through the caller's buffer"
    );
}

fn cache_with_buffers(buffers_max: u64) -> Cache {
    cache(buffers_max * BLOCK, buffers_max)
}

#[test]
fn a_stream_through_a_full_cache_is_lent_without_reading_a_block_twice() {
    // Goal: in a cache already full, a sequential stream's missed reads are still lent
    // (filled, then handed out from the cache's buffers) and cost no second device read:
    // the blocks filled are held before read-ahead for the next window takes buffers, so
    // nothing falls back to reading them again. Method: a 64-block cache, 64 KiB read-ahead,
    // background work inline (read-ahead runs inside the read); a 4 MiB object read
    // sequentially in 64 KiB `read_with` calls; every read is lent (the caller's buffer
    // stays untouched) and the device is read exactly once per byte.
    use bufcache::{CountingDevice, Environment, InlineSpawner};
    use bufcache_host::{BlockingWaiter, SystemClock};
    let cache = Cache::with_environment(
        CacheConfig {
            memory_bytes_max: 64 * BLOCK,
            readahead_bytes_max: 64 << 10,
            ..CacheConfig::default()
        },
        Environment::new(
            Arc::new(SystemClock::new()),
            Arc::new(InlineSpawner),
            Arc::new(BlockingWaiter::default()),
        ),
    )
    .expect("valid config");
    let size = 4u64 << 20;
    let device = Arc::new(CountingDevice::new(MemoryDevice::new(size)));
    let data = pattern(13, size as usize);
    device
        .write_vectored_at(&[std::io::IoSlice::new(&data)], 0)
        .expect("fill the device");
    let handle = cache
        .open_object(ObjectConfig::new("stream", device.clone()))
        .expect("open object");
    let length = 64 << 10;
    for offset in (0..size).step_by(length) {
        let mut scratch = vec![0xAA; length];
        let (received, _) = read_with_received(&handle, offset, &mut scratch);
        assert!(received == data[offset as usize..offset as usize + length]);
        assert!(
            scratch.iter().all(|&byte| byte == 0xAA),
            "the read at {offset} was lent"
        );
    }
    assert_eq!(
        device.stats().reads.bytes,
        size,
        "every byte was read from the device once"
    );
}

/// An object of 1024 blocks over a counting device holding pattern `seed`, with block 37
/// alone cached; returns the device, the object and the device's bytes.
fn counted_object_with_block_37_cached(
    cache: &Cache,
    seed: u64,
) -> (Arc<CountingDevice<MemoryDevice>>, ObjectHandle, Vec<u8>) {
    let blocks = 1024;
    let device = Arc::new(CountingDevice::new(MemoryDevice::new(blocks * BLOCK)));
    let data = pattern(seed, (blocks * BLOCK) as usize);
    device
        .write_vectored_at(&[std::io::IoSlice::new(&data)], 0)
        .expect("fill the device");
    let as_device: Arc<dyn Device> = Arc::clone(&device) as Arc<dyn Device>;
    let handle = cache
        .open_object(ObjectConfig::new("chunk-runs", as_device))
        .expect("open object");
    let mut one = vec![0u8; BLOCK as usize];
    handle.read_at(37 * BLOCK, &mut one).expect("read block 37");
    (device, handle, data)
}

#[test]
fn a_miss_run_spans_chunks_and_stops_at_the_first_cached_block() {
    // Goal: a miss extends into a run a chunk (16 blocks) at a time, across chunk edges,
    // and ends exactly at the first block already cached, which is served from the cache.
    // Method: over a counting device, cache block 37 alone, then read blocks 3..70 in one
    // request; the device must see two reads (3..37 and 38..70, 66 blocks), the statistics
    // 66 misses and one hit, and the bytes must be the device's.
    let cache = cache(8 << 20, 2048);
    let (device, handle, data) = counted_object_with_block_37_cached(&cache, 7);

    let (stats_before, device_before) = (cache.stats(), device.stats());
    let mut back = vec![0u8; 67 * BLOCK as usize];
    handle.read_at(3 * BLOCK, &mut back).expect("read 3..70");
    let (stats_after, device_after) = (cache.stats(), device.stats());
    let reads = device_after.since(&device_before).reads;
    assert_eq!(back, &data[3 * BLOCK as usize..70 * BLOCK as usize]);
    assert_eq!(reads.requests, 2, "one device read per absent stretch");
    assert_eq!(reads.bytes, 66 * BLOCK, "every absent block read once");
    assert_eq!(stats_after.misses - stats_before.misses, 66);
    assert_eq!(
        stats_after.hits - stats_before.hits,
        1,
        "block 37 from the cache"
    );
}

#[test]
fn a_write_over_absent_stretches_inserts_them_whole_and_reads_only_its_partial_ends() {
    // Goal: a write joins the absent blocks it covers whole a chunk at a time, around a
    // block already cached, without reading any of them; only the partial first and last
    // blocks are read, and every byte reaches the device. Method: over a counting device,
    // cache block 37 alone, then write from the middle of block 3 to the middle of block 69
    // in one request; the device must see two one-block reads (blocks 3 and 69), and after
    // a flush it must hold the written bytes with the old ones around them.
    let cache = cache(8 << 20, 2048);
    let (device, handle, mut model) = counted_object_with_block_37_cached(&cache, 11);

    let device_before = device.stats();
    let (offset, end) = (3 * BLOCK + 100, 69 * BLOCK + 50);
    let data = pattern(12, (end - offset) as usize);
    handle.write_at(offset, &data, false).expect("write");
    let reads = device.stats().since(&device_before).reads;
    assert_eq!(reads.requests, 2, "only the partial ends are read");
    assert_eq!(reads.bytes, 2 * BLOCK);

    handle.flush().expect("flush");
    model[offset as usize..end as usize].copy_from_slice(&data);
    let mut on_device = vec![0u8; model.len()];
    device
        .read_vectored_at(&mut [std::io::IoSliceMut::new(&mut on_device)], 0)
        .expect("read the device");
    assert!(
        on_device == model,
        "the device holds the write and nothing else changed"
    );
}
