//! O_DIRECT through the cache: a `FileDevice` opened with `direct: true` serves unaligned
//! byte-range writes and reads through the cache's aligned buffers, and after `sync` the file
//! holds exactly the model.
//!
//! Method: the test looks for a directory whose file system accepts O_DIRECT (the target
//! directory, /var/tmp, then the system temp dir; tmpfs refuses it) and skips with a printed
//! reason only when every candidate refuses with `FileDeviceError::DirectUnsupported`.

// Tests drive the engine from real threads on real time; only the engine itself may not.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::path::PathBuf;
use std::sync::Arc;

use bufcache::{CacheConfig, Device, FileDevice, FileDeviceError, FileDeviceOptions, ObjectConfig};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const LENGTH: u64 = 4 << 20;

fn open_direct() -> Option<(tempfile::TempDir, PathBuf, FileDevice)> {
    let candidates = [
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")),
        PathBuf::from("/var/tmp"),
        std::env::temp_dir(),
    ];
    let mut reasons = Vec::new();
    for candidate in candidates {
        let Ok(directory) = tempfile::tempdir_in(&candidate) else {
            reasons.push(format!(
                "{}: cannot create a directory",
                candidate.display()
            ));
            continue;
        };
        let path = directory.path().join("direct.img");
        let options = FileDeviceOptions {
            direct: true,
            create_length_bytes: Some(LENGTH),
            ..Default::default()
        };
        match FileDevice::open(&path, &options) {
            Ok(device) => return Some((directory, path, device)),
            Err(error @ FileDeviceError::DirectUnsupported { .. }) => {
                reasons.push(error.to_string())
            }
            Err(error) => panic!("opening {} failed: {error}", path.display()),
        }
    }
    eprintln!(
        "SKIPPED direct_io: no candidate directory accepts O_DIRECT:\n  {}",
        reasons.join("\n  ")
    );
    None
}

#[test]
fn direct_file_device_through_the_cache_round_trips() {
    let Some((_directory, path, device)) = open_direct() else {
        return;
    };
    assert!(device.is_direct());
    assert_eq!(device.capabilities().alignment_bytes, 4096);
    let cache = bufcache_host::system_cache(CacheConfig {
        memory_bytes_max: 256 << 10,
        buffers_max: 64,
        ..CacheConfig::default()
    })
    .unwrap();
    let handle = cache
        .open_object(ObjectConfig::new(
            "direct",
            Arc::new(device) as Arc<dyn Device>,
        ))
        .unwrap();
    let seed = 0xD1EC7;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut model = vec![0u8; LENGTH as usize];
    for op in 0..400 {
        let length = rng.gen_range(1..=20_000u64);
        let offset = rng.gen_range(0..=LENGTH - length);
        if rng.gen_bool(0.6) {
            let mut data = vec![0u8; length as usize];
            rng.fill(&mut data[..]);
            handle
                .write_at(offset, &data, rng.gen_bool(0.05))
                .unwrap_or_else(|e| panic!("seed {seed} op {op}: write: {e}"));
            model[offset as usize..(offset + length) as usize].copy_from_slice(&data);
        } else {
            let mut data = vec![0u8; length as usize];
            handle
                .read_at(offset, &mut data)
                .unwrap_or_else(|e| panic!("seed {seed} op {op}: read: {e}"));
            assert!(
                data[..] == model[offset as usize..(offset + length) as usize],
                "seed {seed} op {op}: read at {offset} differs"
            );
        }
    }
    cache.sync().unwrap();
    handle.invalidate().unwrap();
    let mut everything = vec![0u8; LENGTH as usize];
    handle.read_at(0, &mut everything).unwrap();
    assert!(
        everything == model,
        "seed {seed}: re-read from the device differs"
    );
    let file = std::fs::read(&path).unwrap();
    assert!(
        file == model,
        "seed {seed}: the file differs from the model"
    );
    assert!(cache.stats().device_writes.requests > 0);
}
