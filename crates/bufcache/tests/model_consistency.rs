//! Model-based property test: random byte-range and BSD buffer operations from several threads
//! against a shadow `Vec<u8>`; every read is compared with the shadow, the memory and buffer
//! limits are checked after every operation, and after `Cache::sync` the backing file (read
//! with `std::fs::read`) equals the shadow.
//!
//! Method: each thread owns a disjoint, block-aligned region of one object and keeps the exact
//! shadow of it; one more region is shared, and operations on it hold a test mutex so its
//! shadow stays exact too. Caches are tiny (8–16 buffers) so eviction, write-back under
//! pressure, clustering and read-ahead all run across region boundaries. Each thread holds at
//! most one buffer at a time, so no operation may fail with `NoSpace`. Variants: the default
//! LRU with clustering and read-ahead on, the same with both off, the same on with an io
//! queue (elevator, merging) below the cache, and small-block variants (page waste; a
//! buffer-count bound) rotating through every replacement policy. Seeds are
//! printed in every failure message with the last operations of the failing thread.

// Tests drive the engine from real threads on real time; only the engine itself may not.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::collections::VecDeque;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bufcache::{
    Cache, CacheConfig, CacheError, Device, FileDevice, FileDeviceOptions, IoQueue, IoQueueConfig,
    ObjectConfig, ObjectHandle, PolicyKind, QueueMode,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const THREADS: usize = 3;
const REGION_BLOCKS: u64 = 24;
const OPS_PER_THREAD: usize = 250;
const SEEDS_PER_VARIANT: u64 = 40;

#[derive(Clone)]
struct Variant {
    name: &'static str,
    block_bytes: u32,
    config: CacheConfig,
    rotate_policies: bool,
    /// Put an io queue (elevator, merging, depth 2) between the cache and the file.
    io_queue: bool,
}

fn base_config(page: u64, block: u64, memory: u64, buffers: u64) -> CacheConfig {
    CacheConfig {
        page_size_bytes: page,
        buffer_bytes_max: block,
        memory_bytes_max: memory,
        buffers_max: buffers,
        space_wait_max: Duration::from_secs(2),
        shards: 4,
        ..CacheConfig::default()
    }
}

fn variants() -> Vec<Variant> {
    let clustered = CacheConfig {
        policy: PolicyKind::Lru,
        ..base_config(4096, 4096, 64 << 10, 16)
    };
    let unclustered = CacheConfig {
        readahead_bytes_max: 0,
        cluster_bytes_max: 4096,
        ..clustered.clone()
    };
    let queued = clustered.clone();
    vec![
        Variant {
            name: "lru-4k-clustered",
            block_bytes: 4096,
            config: clustered,
            rotate_policies: false,
            io_queue: false,
        },
        Variant {
            name: "lru-4k-unclustered",
            block_bytes: 4096,
            config: unclustered,
            rotate_policies: false,
            io_queue: false,
        },
        Variant {
            // 512-byte blocks charged a whole 4 KiB page each: memory binds at 8 buffers.
            name: "512b-page-waste-clustered",
            block_bytes: 512,
            config: CacheConfig {
                readahead_size_initial_bytes: 2048,
                ..base_config(4096, 512, 32 << 10, 16)
            },
            rotate_policies: true,
            io_queue: false,
        },
        Variant {
            // 1 KiB blocks, 1 KiB pages: the buffer count (6) binds before memory (16 KiB).
            name: "1k-buffers-bound-unclustered",
            block_bytes: 1024,
            config: CacheConfig {
                readahead_bytes_max: 0,
                cluster_bytes_max: 1024,
                ..base_config(1024, 1024, 16 << 10, 6)
            },
            rotate_policies: true,
            io_queue: false,
        },
        Variant {
            // Clustering, read-ahead and the io queue all on: merged device requests
            // carry several callers' buffers.
            name: "lru-4k-clustered-io-queue",
            block_bytes: 4096,
            config: queued,
            rotate_policies: false,
            io_queue: true,
        },
    ]
}

/// One region's shadow and where it starts in the object.
struct Region {
    start: u64,
    shadow: Vec<u8>,
}

struct Context {
    label: String,
    block_bytes: u64,
    log: VecDeque<String>,
}

impl Context {
    fn note(&mut self, op: String) {
        if self.log.len() == 12 {
            self.log.pop_front();
        }
        self.log.push_back(op);
    }

    fn fail(&self, what: String) -> ! {
        panic!(
            "{}: {what}\nlast operations of this thread (oldest first):\n  {}",
            self.label,
            self.log.iter().cloned().collect::<Vec<_>>().join("\n  ")
        )
    }

    fn ok<T>(&self, result: Result<T, CacheError>, what: &str) -> T {
        match result {
            Ok(value) => value,
            Err(error) => self.fail(format!("{what} failed: {error}")),
        }
    }
}

/// Engine bug (see `engine_regressions.rs`, `stats_never_show_memory_or_buffers_above_the_limits`):
/// `MemoryAccount::try_charge` adds a charge before checking it and subtracts it again when it
/// does not fit, so a concurrent `stats()` can see each allocating thread's charge once too
/// often. Until that is fixed, gauges may exceed the limits by this many charges (the test's
/// threads plus the cache's four background workers); set it to 0 once the fix lands.
const TRANSIENT_OVERCHARGE_ALLOWANCE: u64 = 0;

fn check_limits(cache: &Cache, context: &Context) {
    let stats = cache.stats();
    let charge = cache.config().charge_bytes(context.block_bytes);
    if stats.memory_used_bytes > stats.memory_bytes_max + TRANSIENT_OVERCHARGE_ALLOWANCE * charge {
        context.fail(format!(
            "memory_used_bytes {} > memory_bytes_max {}",
            stats.memory_used_bytes, stats.memory_bytes_max
        ));
    }
    if stats.buffers_in_use > stats.buffers_max + TRANSIENT_OVERCHARGE_ALLOWANCE {
        context.fail(format!(
            "buffers_in_use {} > buffers_max {}",
            stats.buffers_in_use, stats.buffers_max
        ));
    }
}

fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y)
}

/// Runs one random operation on `region` (held exclusively by the caller).
fn one_op(
    handle: &ObjectHandle,
    region: &mut Region,
    rng: &mut StdRng,
    context: &mut Context,
    block_bytes: u64,
) {
    let region_bytes = REGION_BLOCKS * block_bytes;
    let random_range = |rng: &mut StdRng| {
        let length = rng.gen_range(1..=3 * block_bytes).min(region_bytes);
        let within = rng.gen_range(0..=region_bytes - length);
        (within, length)
    };
    let choice = rng.gen_range(0..100);
    match choice {
        0..=24 => {
            let (within, length) = random_range(rng);
            context.note(format!("read_at({}, {length})", region.start + within));
            let mut data = vec![0u8; length as usize];
            context.ok(handle.read_at(region.start + within, &mut data), "read_at");
            let expected = &region.shadow[within as usize..(within + length) as usize];
            if let Some(at) = first_difference(&data, expected) {
                context.fail(format!(
                    "read_at({}, {length}) differs from the model at object byte {}: got {}, \
                     expected {}",
                    region.start + within,
                    region.start + within + at as u64,
                    data[at],
                    expected[at]
                ));
            }
        }
        25..=44 => {
            let (within, length) = random_range(rng);
            let fua = rng.gen_bool(0.2);
            let mut data = vec![0u8; length as usize];
            rng.fill(&mut data[..]);
            context.note(format!(
                "write_at({}, {length}, fua={fua})",
                region.start + within
            ));
            context.ok(
                handle.write_at(region.start + within, &data, fua),
                "write_at",
            );
            region.shadow[within as usize..(within + length) as usize].copy_from_slice(&data);
        }
        45..=48 => {
            context.note("flush".into());
            context.ok(handle.flush(), "flush");
        }
        49..=51 => {
            let (within, length) = random_range(rng);
            context.note(format!("discard({}, {length})", region.start + within));
            context.ok(handle.discard(region.start + within, length), "discard");
            // Whole blocks inside the range read as zeroes (the file punches holes); blocks
            // partly inside keep their data.
            let first = within.div_ceil(block_bytes);
            let end = (within + length) / block_bytes;
            if first < end {
                region.shadow[(first * block_bytes) as usize..(end * block_bytes) as usize].fill(0);
            }
        }
        52..=54 => {
            let (within, length) = random_range(rng);
            let fua = rng.gen_bool(0.3);
            context.note(format!(
                "write_zeroes({}, {length}, fua={fua})",
                region.start + within
            ));
            context.ok(
                handle.write_zeroes(region.start + within, length, fua),
                "write_zeroes",
            );
            region.shadow[within as usize..(within + length) as usize].fill(0);
        }
        55..=66 => {
            // getblk, fill or modify, then one of the write calls (or a plain release).
            let block_in_region = rng.gen_range(0..REGION_BLOCKS);
            let block = region.start / block_bytes + block_in_region;
            let range = (block_in_region * block_bytes) as usize
                ..((block_in_region + 1) * block_bytes) as usize;
            let how = rng.gen_range(0..4);
            context.note(format!("getblk({block}) then #{how}"));
            let mut guard = context.ok(handle.getblk(block), "getblk");
            let mut contents = region.shadow[range.clone()].to_vec();
            if guard.is_valid() {
                if let Some(at) = first_difference(guard.data(), &contents) {
                    context.fail(format!(
                        "getblk({block}) returned a valid buffer differing from the model at \
                         byte {at}"
                    ));
                }
                let start = rng.gen_range(0..block_bytes as usize);
                let end = rng.gen_range(start + 1..=block_bytes as usize);
                rng.fill(&mut contents[start..end]);
            } else {
                if how == 3 {
                    // Released without filling: must vanish, not become visible.
                    handle.brelse(guard);
                    return;
                }
                rng.fill(&mut contents[..]);
            }
            guard.data_mut().copy_from_slice(&contents);
            match how {
                0 => context.ok(handle.bwrite(guard), "bwrite"),
                1 => context.ok(handle.bawrite(guard), "bawrite"),
                _ => context.ok(handle.bdwrite(guard), "bdwrite"),
            }
            region.shadow[range].copy_from_slice(&contents);
        }
        67..=78 => {
            let block_in_region = rng.gen_range(0..REGION_BLOCKS);
            let block = region.start / block_bytes + block_in_region;
            let range = (block_in_region * block_bytes) as usize
                ..((block_in_region + 1) * block_bytes) as usize;
            let how = rng.gen_range(0..5);
            context.note(format!("bread({block}) then #{how}"));
            let mut guard = context.ok(handle.bread(block), "bread");
            if !guard.is_valid() {
                context.fail(format!("bread({block}) returned an invalid buffer"));
            }
            if let Some(at) = first_difference(guard.data(), &region.shadow[range.clone()]) {
                context.fail(format!(
                    "bread({block}) differs from the model at byte {at} of the block"
                ));
            }
            match how {
                0 => handle.brelse(guard),
                1 => handle.bqrelse(guard),
                2 => {
                    guard.set_no_cache();
                    handle.brelse(guard)
                }
                3 => {
                    guard.set_no_cache();
                    handle.bqrelse(guard)
                }
                _ => {
                    let at = rng.gen_range(0..block_bytes as usize);
                    let value: u8 = rng.gen();
                    guard.data_mut()[at] = value;
                    region.shadow[range.start + at] = value;
                    context.ok(handle.bdwrite(guard), "bdwrite");
                }
            }
        }
        79..=88 => {
            // A sequential scan of the region in block-sized reads: read-ahead territory.
            context.note(format!("scan({}, {region_bytes})", region.start));
            let mut data = vec![0u8; block_bytes as usize];
            for block_in_region in 0..REGION_BLOCKS {
                let within = block_in_region * block_bytes;
                context.ok(
                    handle.read_at(region.start + within, &mut data),
                    "scan read_at",
                );
                let expected = &region.shadow[within as usize..(within + block_bytes) as usize];
                if let Some(at) = first_difference(&data, expected) {
                    context.fail(format!(
                        "scan read of object byte {} differs from the model",
                        region.start + within + at as u64
                    ));
                }
            }
        }
        89..=92 => {
            let (within, length) = random_range(rng);
            context.note(format!("prefetch({}, {length})", region.start + within));
            context.ok(handle.prefetch(region.start + within, length), "prefetch");
        }
        93..=96 => {
            context.note("invalidate".into());
            context.ok(handle.invalidate(), "invalidate");
        }
        _ => {
            context.note("cache.sync".into());
            context.ok(handle.cache().sync(), "cache.sync");
        }
    }
}

fn run_one(variant: &Variant, seed: u64) {
    let mut config = variant.config.clone();
    if variant.rotate_policies {
        config.policy = PolicyKind::ALL[seed as usize % PolicyKind::ALL.len()];
    }
    let label = format!(
        "variant {} (policy {:?}) seed {seed}",
        variant.name, config.policy
    );
    let block_bytes = variant.block_bytes as u64;
    let regions = THREADS as u64 + 1;
    let length = regions * REGION_BLOCKS * block_bytes;
    let directory = tempfile::tempdir().expect("tempdir");
    let path = directory.path().join("model.img");
    let device = FileDevice::open(
        &path,
        &FileDeviceOptions {
            create_length_bytes: Some(length),
            ..Default::default()
        },
    )
    .expect("open backing file");
    let device: Arc<dyn Device> = if variant.io_queue {
        let queue = IoQueueConfig {
            mode: QueueMode::Elevator,
            merge: true,
            depth_max: 2,
            ..IoQueueConfig::default()
        };
        Arc::new(IoQueue::new(device, queue).expect("valid io queue"))
    } else {
        Arc::new(device)
    };
    let cache = bufcache_host::system_cache(config).expect("valid config");
    let handle = cache
        .open_object(ObjectConfig::new("model", device).block_size(variant.block_bytes))
        .expect("open object");
    let shared = Arc::new(Mutex::new(Region {
        start: THREADS as u64 * REGION_BLOCKS * block_bytes,
        shadow: vec![0u8; (REGION_BLOCKS * block_bytes) as usize],
    }));
    let (done_sender, done_receiver) = mpsc::channel();
    let mut threads = Vec::new();
    for thread in 0..THREADS {
        let handle = handle.reopen();
        let shared = Arc::clone(&shared);
        let done = done_sender.clone();
        let label = format!("{label} thread {thread}");
        threads.push(std::thread::spawn(move || {
            let mut rng = StdRng::seed_from_u64(seed.wrapping_mul(1_000_003) + thread as u64);
            let mut own = Region {
                start: thread as u64 * REGION_BLOCKS * block_bytes,
                shadow: vec![0u8; (REGION_BLOCKS * block_bytes) as usize],
            };
            let mut context = Context {
                label,
                block_bytes,
                log: VecDeque::new(),
            };
            for op in 0..OPS_PER_THREAD {
                context.label = format!("{} op {op}", context.label.split(" op ").next().unwrap());
                if rng.gen_bool(0.25) {
                    let Ok(mut region) = shared.lock() else {
                        // Another thread panicked in the middle of a shared-region operation:
                        // the shadow is no longer exact, and that panic is the failure.
                        return own;
                    };
                    one_op(&handle, &mut region, &mut rng, &mut context, block_bytes);
                } else {
                    one_op(&handle, &mut own, &mut rng, &mut context, block_bytes);
                }
                check_limits(handle.cache(), &context);
            }
            let _ = done.send(());
            own
        }));
    }
    drop(done_sender);
    let deadline = Instant::now() + Duration::from_secs(60);
    for _ in 0..THREADS {
        let left = deadline.saturating_duration_since(Instant::now());
        match done_receiver.recv_timeout(left) {
            Ok(()) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break, // a thread panicked
            Err(mpsc::RecvTimeoutError::Timeout) => {
                panic!("{label}: threads did not finish within 60 s (deadlock?)")
            }
        }
    }
    let mut model = Vec::with_capacity(length as usize);
    let mut panics = Vec::new();
    for thread in threads {
        match thread.join() {
            Ok(region) => model.extend_from_slice(&region.shadow),
            Err(panic) => panics.push(
                panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default(),
            ),
        }
    }
    if !panics.is_empty() {
        panic!("{}", panics.join("\n----\n"));
    }
    model.extend_from_slice(&shared.lock().unwrap().shadow);
    if let Err(error) = cache.sync() {
        panic!("{label}: final sync failed: {error}");
    }
    let stats = cache.stats();
    assert_eq!(stats.dirty_bytes, 0, "{label}: dirty data left after sync");
    assert!(
        stats.memory_used_bytes <= stats.memory_bytes_max
            && stats.buffers_in_use <= stats.buffers_max,
        "{label}: limits exceeded at rest: {stats:?}"
    );
    let mut through_cache = vec![0u8; length as usize];
    handle
        .read_at(0, &mut through_cache)
        .unwrap_or_else(|e| panic!("{label}: final read failed: {e}"));
    if let Some(at) = first_difference(&through_cache, &model) {
        panic!("{label}: final read through the cache differs from the model at byte {at}");
    }
    let file = std::fs::read(&path).expect("read the backing file");
    assert_eq!(file.len(), model.len(), "{label}: file length");
    if let Some(at) = first_difference(&file, &model) {
        panic!(
            "{label}: after sync the backing file differs from the model at byte {at} (block \
             {}): file {} model {}",
            at as u64 / block_bytes,
            file[at],
            model[at]
        );
    }
    assert_eq!(stats.space_failures, 0, "{label}: NoSpace failures");
}

fn run_variant(index: usize) {
    let variant = &variants()[index];
    let base: u64 = std::env::var("BUFCACHE_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_0000);
    for seed in base..base + SEEDS_PER_VARIANT {
        run_one(variant, seed);
    }
}

#[test]
fn model_lru_clustered_readahead_on() {
    run_variant(0);
}

#[test]
fn model_lru_clustering_and_readahead_off() {
    run_variant(1);
}

#[test]
fn model_small_blocks_page_waste_all_policies() {
    run_variant(2);
}

#[test]
fn model_buffer_count_bound_all_policies() {
    run_variant(3);
}

#[test]
fn model_clustered_with_io_queue() {
    run_variant(4);
}
