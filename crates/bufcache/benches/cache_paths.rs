//! Hit and miss paths of the engine: lookup, pin and release of a cached 4 KiB block (no
//! copy) on one and two threads, a 4 KiB read_at hit (with copy), and a miss on a
//! MemoryDevice; and cluster building: a 1 MiB clustered read into 256 new buffers and a
//! 1 MiB write of 256 dirty buffers written back as one cluster. The target: at
//! least 5 million hits per second on one thread.
//!
//! The `bookkeeping` group isolates the engine's own per-block work in a bulk copy (insert,
//! mark dirty, write-behind claim and clear, evict; or miss, read-ahead and demote) by
//! running it over a device that moves no data: what a copy through the server costs on top
//! of the two data copies every server makes. Its time per 1 MiB / 256 is the per-block
//! cost that issue #13's copy rows measure against `nbdkit file`.

// Tests drive the engine from real threads on real time; only the engine itself may not.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::io::{self, IoSlice, IoSliceMut};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bufcache::device::{
    all_data, read_each_now, write_each_now, write_zeroes_by_writing, Capabilities, Extent,
};
use bufcache::{
    Cache, CacheConfig, Device, Environment, InlineSpawner, MemoryDevice, ObjectConfig,
    ObjectHandle,
};
use bufcache_host::{BlockingWaiter, SystemClock};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

const BLOCKS: u64 = 1024;

/// A device that accepts every request and moves no bytes: reads leave the cache's buffers
/// as they are, writes go nowhere. What remains of a copy's cost is the engine's own.
struct NoDataDevice {
    length_bytes: u64,
}

impl Device for NoDataDevice {
    fn read_vectored_at(&self, _buffers: &mut [IoSliceMut<'_>], _offset: u64) -> io::Result<()> {
        Ok(())
    }
    fn write_vectored_at(&self, _buffers: &[IoSlice<'_>], _offset: u64) -> io::Result<()> {
        Ok(())
    }
    fn submit_writes(&self, writes: Vec<bufcache::device::WriteRequest>) {
        write_each_now(self, writes)
    }
    fn submit_reads(&self, reads: Vec<bufcache::device::ReadRequest>) {
        read_each_now(self, reads)
    }
    fn flush(&self) -> io::Result<()> {
        Ok(())
    }
    fn discard(&self, _offset: u64, _length: u64) -> io::Result<()> {
        Ok(())
    }
    fn write_zeroes(&self, offset: u64, length: u64) -> io::Result<()> {
        write_zeroes_by_writing(self, offset, length)
    }
    fn extents(&self, offset: u64, length: u64) -> io::Result<Vec<Extent>> {
        all_data(self.length_bytes, offset, length)
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities::plain(self.length_bytes)
    }
    fn describe(&self) -> String {
        "no-data".to_string()
    }
}

fn cache_with(memory_bytes_max: u64) -> (Cache, ObjectHandle) {
    cache_over(memory_bytes_max, 0, Arc::new(MemoryDevice::new(1 << 30)))
}

fn cache_over(
    memory_bytes_max: u64,
    readahead_bytes_max: u64,
    device: Arc<dyn Device>,
) -> (Cache, ObjectHandle) {
    let config = CacheConfig {
        memory_bytes_max,
        buffers_max: memory_bytes_max / 4096,
        readahead_bytes_max,
        ..CacheConfig::default()
    };
    let environment = Environment::new(
        Arc::new(SystemClock::new()),
        Arc::new(InlineSpawner),
        Arc::new(BlockingWaiter::default()),
    );
    let cache = Cache::with_environment(config, environment).unwrap();
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

/// A bulk copy's engine work per 1 MiB over a device that moves no data, as the copy rows of
/// `bench/run` see it: a cache of 64 MiB filled 1 MiB at a time (written behind, or read with
/// read-ahead) and then emptied by a discard (not timed), so nothing is evicted, as in a copy
/// no larger than the cache, and no page is faulted in after the first round. The
/// `_evicting` variants keep the cache cycling over 1 GiB instead, so every block also costs
/// an eviction.
fn bookkeeping_paths(criterion: &mut Criterion) {
    const CACHE_BYTES: u64 = 64 << 20;
    let mut group = criterion.benchmark_group("bookkeeping");
    group.throughput(Throughput::Elements(256));
    let device = || {
        Arc::new(NoDataDevice {
            length_bytes: 1 << 30,
        }) as Arc<dyn Device>
    };
    let source = vec![7u8; 1 << 20];
    let mut target = vec![0u8; 1 << 20];
    // Runs `iterations` 1 MiB steps, emptying the cache whenever it is full; times the steps.
    let filling = |object: &ObjectHandle, iterations: u64, step: &mut dyn FnMut(u64)| {
        let mut elapsed = Duration::ZERO;
        let mut done = 0;
        while done < iterations {
            object.discard(0, CACHE_BYTES).unwrap();
            let steps = (iterations - done).min(CACHE_BYTES >> 20);
            let started = Instant::now();
            for index in 0..steps {
                step(index << 20);
            }
            elapsed += started.elapsed();
            done += steps;
        }
        elapsed
    };
    let (_write_cache, writer) = cache_over(CACHE_BYTES, 0, device());
    let (_read_cache, reader) = cache_over(CACHE_BYTES, 1 << 20, device());
    group.bench_function("upload_1mib_new_blocks_written_behind", |bench| {
        bench.iter_custom(|iterations| {
            filling(&writer, iterations, &mut |offset| {
                writer.write_at(offset, &source, false).unwrap()
            })
        })
    });
    group.bench_function("download_1mib_sequential_misses", |bench| {
        bench.iter_custom(|iterations| {
            filling(&reader, iterations, &mut |offset| {
                reader.read_at(offset, &mut target).unwrap()
            })
        })
    });
    // Two writers at once, each filling half of one cache through its own object: the time
    // per MiB against the one-writer row shows what sharing the table, the memory account and
    // the allocator costs (on two cores, no sharing cost would halve it).
    let (shared_cache, _) = cache_over(CACHE_BYTES, 0, device());
    let writers: Vec<Arc<ObjectHandle>> = (0..2)
        .map(|index| {
            let config = ObjectConfig::new(format!("writer-{index}"), device());
            Arc::new(shared_cache.open_object(config).unwrap())
        })
        .collect();
    group.bench_function("upload_1mib_new_blocks_written_behind_2_threads", |bench| {
        bench.iter_custom(|iterations| {
            let half_bytes = CACHE_BYTES / 2;
            let mut elapsed = Duration::ZERO;
            let mut done = 0;
            while done < iterations {
                for writer in &writers {
                    writer.discard(0, half_bytes).unwrap();
                }
                let steps = (iterations - done).min(CACHE_BYTES >> 20);
                let started = Instant::now();
                std::thread::scope(|scope| {
                    for (index, writer) in writers.iter().enumerate() {
                        let source = &source;
                        let share = steps / 2 + (index as u64) * (steps % 2);
                        scope.spawn(move || {
                            for step in 0..share {
                                writer.write_at(step << 20, source, false).unwrap();
                            }
                        });
                    }
                });
                elapsed += started.elapsed();
                done += steps;
            }
            elapsed
        })
    });
    group.bench_function("upload_1mib_new_blocks_written_behind_evicting", |bench| {
        let mut index = 0u64;
        bench.iter(|| {
            index = (index + 1) % 1024;
            writer.write_at(index << 20, &source, false).unwrap();
        })
    });
    group.bench_function("download_1mib_sequential_misses_evicting", |bench| {
        let mut index = 0u64;
        bench.iter(|| {
            index = (index + 1) % 1024;
            reader.read_at(index << 20, &mut target).unwrap();
        })
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = hit_path, miss_path, cluster_paths, bookkeeping_paths
}
criterion_main!(benches);
