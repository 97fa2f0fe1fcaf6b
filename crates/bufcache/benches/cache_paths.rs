//! Hit and miss paths of the engine: lookup, pin and release of a cached 4 KiB block (no
//! copy) on one and two threads, a 4 KiB read_at hit (with copy), and a miss on a
//! MemoryDevice; and cluster building: a 1 MiB clustered read into 256 new buffers and a
//! 1 MiB write of 256 dirty buffers written back as one cluster. The target: at
//! least 5 million hits per second on one thread.

// Tests drive the engine from real threads on real time; only the engine itself may not.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use bufcache::{
    Cache, CacheConfig, Device, Environment, InlineSpawner, MemoryDevice, ObjectConfig,
    ObjectHandle,
};
use bufcache_host::{BlockingWaiter, SystemClock};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

const BLOCKS: u64 = 1024;

fn cache_with(memory_bytes_max: u64) -> (Cache, ObjectHandle) {
    let config = CacheConfig {
        memory_bytes_max,
        buffers_max: memory_bytes_max / 4096,
        readahead_size_max_bytes: 0,
        ..CacheConfig::default()
    };
    let environment = Environment::new(
        Arc::new(SystemClock::new()),
        Arc::new(InlineSpawner),
        Arc::new(BlockingWaiter::default()),
    );
    let cache = Cache::with_environment(config, environment).unwrap();
    let device: Arc<dyn Device> = Arc::new(MemoryDevice::new(1 << 30));
    let object = cache
        .open_object(ObjectConfig::new("bench", device))
        .unwrap();
    (cache, object)
}

fn warm(object: &ObjectHandle) {
    for block in 0..BLOCKS {
        drop(object.bread(block).unwrap());
    }
}

fn hit_path(criterion: &mut Criterion) {
    let (_cache, object) = cache_with(64 << 20);
    warm(&object);
    let mut group = criterion.benchmark_group("hit");
    group.throughput(Throughput::Elements(1));
    group.bench_function("getblk_release_1_thread", |bench| {
        let mut block = 0;
        bench.iter(|| {
            block = (block + 1) % BLOCKS;
            drop(object.getblk(block).unwrap());
        })
    });
    let mut buffer = vec![0u8; 4096];
    group.bench_function("read_at_4k_copy_1_thread", |bench| {
        let mut block = 0;
        bench.iter(|| {
            block = (block + 1) % BLOCKS;
            object.read_at(block * 4096, &mut buffer).unwrap();
        })
    });
    let object = Arc::new(object);
    group.bench_function("getblk_release_2_threads", |bench| {
        bench.iter_custom(|iterations| {
            let started = Instant::now();
            let workers: Vec<_> = (0..2u64)
                .map(|thread| {
                    let object = Arc::clone(&object);
                    std::thread::spawn(move || {
                        let mut block = thread * 512;
                        for _ in 0..iterations / 2 {
                            block = (block + 1) % BLOCKS;
                            drop(object.getblk(block).unwrap());
                        }
                    })
                })
                .collect();
            workers
                .into_iter()
                .for_each(|worker| worker.join().unwrap());
            started.elapsed()
        })
    });
    group.finish();
}

fn miss_path(criterion: &mut Criterion) {
    // A cache of 256 blocks cycling over 1024: every access misses and evicts.
    let (_cache, object) = cache_with(1 << 20);
    let mut group = criterion.benchmark_group("miss");
    group.throughput(Throughput::Elements(1));
    group.bench_function("bread_evict_memory_device", |bench| {
        let mut block = 0;
        bench.iter(|| {
            block = (block + 1) % BLOCKS;
            drop(object.bread(block).unwrap());
        })
    });
    group.finish();
}

fn cluster_paths(criterion: &mut Criterion) {
    let mut group = criterion.benchmark_group("cluster");
    group.throughput(Throughput::Bytes(1 << 20));
    // 16 MiB of cache cycling over 64 MiB: every 1 MiB read misses and builds one cluster.
    let (_cache, object) = cache_with(16 << 20);
    let mut buffer = vec![0u8; 1 << 20];
    group.bench_function("read_1mib_cluster_of_256_buffers", |bench| {
        let mut index = 0u64;
        bench.iter(|| {
            index = (index + 1) % 64;
            object.read_at(index << 20, &mut buffer).unwrap();
        })
    });
    group.bench_function("write_1mib_and_flush_one_cluster", |bench| {
        let mut index = 0u64;
        bench.iter(|| {
            index = (index + 1) % 64;
            object.write_at(index << 20, &buffer, false).unwrap();
            object.flush().unwrap();
        })
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = hit_path, miss_path, cluster_paths
}
criterion_main!(benches);
