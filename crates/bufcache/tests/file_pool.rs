//! A cache over a `FileDevice` with a worker pool (`io_threads`) or an io_uring
//! (`io_uring_depth`): requests complete on the device's own threads, write-back goes out in
//! batches, and nothing is lost.

// Tests drive the engine from real threads on real time; only the engine itself may not.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::path::Path;
use std::sync::Arc;

use bufcache::{CacheConfig, Device, FileDevice, FileDeviceOptions, ObjectConfig};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const LENGTH: u64 = 8 << 20;
const IO_THREADS: usize = 4;

const IO_URING_DEPTH: usize = 16;

/// Who does the device's submitted requests.
#[derive(Clone, Copy, Debug)]
enum Engine {
    Pool,
    Ring,
}

/// Opens `path` with `engine`, or `None` (saying why) where the kernel gives us no io_uring.
fn open_with(path: &Path, engine: Engine) -> Option<Arc<dyn Device>> {
    let options = FileDeviceOptions {
        create_length_bytes: Some(LENGTH),
        io_threads: if matches!(engine, Engine::Pool) {
            IO_THREADS
        } else {
            0
        },
        io_uring_depth: if matches!(engine, Engine::Ring) {
            IO_URING_DEPTH
        } else {
            0
        },
        ..Default::default()
    };
    let device = match FileDevice::open(path, &options) {
        Ok(device) => device,
        Err(error @ bufcache::device::FileDeviceError::IoUring { .. }) => {
            eprintln!("SKIPPED: {error}");
            return None;
        }
        Err(error) => panic!("{error}"),
    };
    match engine {
        Engine::Pool => assert_eq!(device.io_threads(), IO_THREADS),
        Engine::Ring => assert_eq!(device.io_uring_depth(), IO_URING_DEPTH),
    }
    assert!(device.capabilities().completes_later);
    Some(Arc::new(device))
}

fn small_cache() -> bufcache::Cache {
    bufcache_host::system_cache(CacheConfig {
        memory_bytes_max: 1 << 20,
        buffers_max: 256,
        ..CacheConfig::default()
    })
    .unwrap()
}

#[test]
fn a_cache_over_a_pooled_file_keeps_random_writes_across_flush_and_reopen() {
    keeps_random_writes_across_flush_and_reopen(Engine::Pool);
}

#[test]
fn a_cache_over_a_ring_file_keeps_random_writes_across_flush_and_reopen() {
    keeps_random_writes_across_flush_and_reopen(Engine::Ring);
}

fn keeps_random_writes_across_flush_and_reopen(engine: Engine) {
    // Goal: over a pooled (or ring) file, random writes survive a flush, the cache's end and a reopen,
    // with write-back reaching the workers in batches. Method: 4 writer threads, each owning
    // a quarter of an 8 MiB file, write random byte ranges (and read some back) through a
    // 1 MiB cache, so eviction writes back too; a flush; then the cache, handle and device are
    // dropped, the file is compared with the model, and a fresh cache over a fresh pooled
    // device reads the whole file back. The first cache must have counted write batches.
    let seed = 0xF11E_9001_u64;
    eprintln!("seed {seed}");
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("pooled.img");
    let Some(device) = open_with(&path, engine) else {
        return;
    };
    let cache = small_cache();
    let handle = cache
        .open_object(ObjectConfig::new("pooled", device))
        .unwrap();
    let quarter = LENGTH / 4;
    let writers: Vec<_> = (0..4u64)
        .map(|writer| {
            let handle = handle.reopen();
            std::thread::spawn(move || {
                let mut rng = StdRng::seed_from_u64(seed + writer);
                let start = writer * quarter;
                let mut model = vec![0u8; quarter as usize];
                for op in 0..300 {
                    let length = rng.gen_range(1..=40_000u64);
                    let offset = rng.gen_range(0..=quarter - length);
                    let range = offset as usize..(offset + length) as usize;
                    if rng.gen_bool(0.7) {
                        let mut data = vec![0u8; length as usize];
                        rng.fill(&mut data[..]);
                        handle
                            .write_at(start + offset, &data, false)
                            .unwrap_or_else(|e| panic!("seed {seed} writer {writer} op {op}: {e}"));
                        model[range].copy_from_slice(&data);
                    } else {
                        let mut data = vec![0u8; length as usize];
                        handle
                            .read_at(start + offset, &mut data)
                            .unwrap_or_else(|e| panic!("seed {seed} writer {writer} op {op}: {e}"));
                        assert!(
                            data[..] == model[range],
                            "seed {seed} writer {writer} op {op}: read at {offset} differs"
                        );
                    }
                }
                model
            })
        })
        .collect();
    let model: Vec<u8> = writers
        .into_iter()
        .flat_map(|writer| writer.join().unwrap())
        .collect();
    handle.flush().unwrap();
    let stats = cache.stats();
    assert!(
        stats.write_batches > 0,
        "write-back to a {engine:?} file went out in batches: {stats:?}"
    );
    drop(handle);
    drop(cache);
    let file = std::fs::read(&path).unwrap();
    assert!(
        file == model,
        "seed {seed}: the file differs from the model"
    );
    let cache = small_cache();
    let handle = cache
        .open_object(ObjectConfig::new(
            "pooled",
            open_with(&path, engine).unwrap(),
        ))
        .unwrap();
    let mut everything = vec![0u8; LENGTH as usize];
    handle.read_at(0, &mut everything).unwrap();
    assert!(
        everything == model,
        "seed {seed}: reading the reopened file through the cache differs"
    );
}
