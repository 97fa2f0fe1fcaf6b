//! Crash consistency: the engine over a `CrashDevice`, random writes, flushes, FUA writes,
//! discards and BSD delayed writes, a power cut at a random point (armed inside the engine's
//! own device traffic, so it can land in the middle of a write-back or a flush). Afterwards the
//! durable image holds every write acknowledged by a flush or FUA write that completed before
//! the crash, and every other sector is either its acknowledged value or a value written later
//! — never garbage, never an older value.
//!
//! Method: every 512-byte sector written carries a tag (sector number, version) repeated over
//! its bytes, so a durable sector decodes to exactly one written version (or zeroes). The model
//! keeps each sector's history and the index of its last acknowledged entry. Background work
//! runs inline so every seed is reproducible; hundreds of seeds run in about a second.

// Tests drive the engine from real threads on real time; only the engine itself may not.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::sync::Arc;
use std::time::Duration;

use bufcache::{
    Cache, CacheConfig, CrashDevice, CrashMode, Device, Environment, InlineSpawner, NoSpawner,
    ObjectConfig, PolicyKind, Spawner,
};
use bufcache_host::{BlockingWaiter, SystemClock};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const SECTOR: u64 = 512;
const BLOCKS: u64 = 48;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Content {
    Zero,
    Version(u32),
}

fn sector_bytes(sector: u64, version: u32) -> Vec<u8> {
    let mut tag = [0u8; 8];
    tag[..4].copy_from_slice(&(sector as u32).to_le_bytes());
    tag[4..].copy_from_slice(&version.to_le_bytes());
    tag.iter().copied().cycle().take(SECTOR as usize).collect()
}

fn decode(sector: u64, bytes: &[u8]) -> Option<Content> {
    if bytes.iter().all(|&b| b == 0) {
        return Some(Content::Zero);
    }
    let number = u32::from_le_bytes(bytes[..4].try_into().unwrap());
    let version = u32::from_le_bytes(bytes[4..8].try_into().unwrap());
    let expected = sector_bytes(sector, version);
    (number as u64 == sector && bytes == expected && version > 0)
        .then_some(Content::Version(version))
}

struct Model {
    history: Vec<Vec<Content>>,
    acknowledged: Vec<usize>,
    next_version: u32,
}

impl Model {
    fn new(sectors: u64) -> Self {
        Model {
            history: vec![vec![Content::Zero]; sectors as usize],
            acknowledged: vec![0; sectors as usize],
            next_version: 1,
        }
    }

    fn current(&self, sector: u64) -> Content {
        *self.history[sector as usize].last().unwrap()
    }

    fn set(&mut self, sectors: std::ops::Range<u64>, content: Content) {
        for sector in sectors {
            self.history[sector as usize].push(content);
        }
    }

    fn acknowledge(&mut self, sectors: std::ops::Range<u64>) {
        for sector in sectors {
            self.acknowledged[sector as usize] = self.history[sector as usize].len() - 1;
        }
    }

    fn expected_bytes(&self, sectors: std::ops::Range<u64>) -> Vec<u8> {
        sectors
            .flat_map(|sector| match self.current(sector) {
                Content::Zero => vec![0u8; SECTOR as usize],
                Content::Version(version) => sector_bytes(sector, version),
            })
            .collect()
    }
}

fn run_seed(seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let block_bytes: u64 = [512, 1024, 4096][rng.gen_range(0..3)];
    let length = BLOCKS * block_bytes;
    let sectors = length / SECTOR;
    let mode = CrashMode::ALL[rng.gen_range(0..CrashMode::ALL.len())];
    let clustered = rng.gen_bool(0.5);
    let inline_background = rng.gen_bool(0.5);
    let policy = PolicyKind::ALL[rng.gen_range(0..PolicyKind::ALL.len())];
    let crash_after = rng.gen_range(0..120u64);
    let label = format!(
        "seed {seed} (block {block_bytes}, {mode:?}, clustered {clustered}, inline background \
         {inline_background}, {policy:?}, crash after {crash_after} requests)"
    );
    let device = Arc::new(CrashDevice::new(length, seed));
    let config = CacheConfig {
        page_size_bytes: 4096,
        buffer_bytes_max: block_bytes,
        memory_bytes_max: 8 * 4096,
        buffers_max: 8,
        cluster_bytes_max: if clustered { 64 << 10 } else { block_bytes },
        readahead_bytes_max: if clustered { 64 << 10 } else { 0 },
        readahead_size_initial_bytes: block_bytes * 2,
        policy,
        space_wait_max: Duration::from_millis(200),
        shards: 2,
        ..CacheConfig::default()
    };
    let spawner: Arc<dyn Spawner> = if inline_background {
        Arc::new(InlineSpawner)
    } else {
        Arc::new(NoSpawner)
    };
    let cache = Cache::with_environment(
        config,
        Environment::new(
            Arc::new(SystemClock::new()),
            spawner,
            Arc::new(BlockingWaiter::default()),
        ),
    )
    .unwrap();
    let handle = cache
        .open_object(
            ObjectConfig::new("crash", device.clone() as Arc<dyn Device>)
                .block_size(block_bytes as u32),
        )
        .unwrap();
    let mut model = Model::new(sectors);
    device.crash_after_requests(crash_after, mode);
    let sectors_per_block = block_bytes / SECTOR;
    for op in 0..150 {
        if device.is_crashed() {
            break;
        }
        let first = rng.gen_range(0..sectors);
        let count = rng.gen_range(1..=(3 * sectors_per_block).min(sectors - first));
        let range = first..first + count;
        let outcome = match rng.gen_range(0..100) {
            0..=44 => {
                let fua = rng.gen_bool(0.15);
                let version = model.next_version;
                model.next_version += 1;
                let data: Vec<u8> = range
                    .clone()
                    .flat_map(|sector| sector_bytes(sector, version))
                    .collect();
                // The bytes are in the cache (and possibly on the device) from now on, even
                // if the call fails after the crash.
                model.set(range.clone(), Content::Version(version));
                let result = handle.write_at(first * SECTOR, &data, fua);
                if result.is_ok() && fua {
                    model.acknowledge(range.clone());
                }
                result.map(|_| "write")
            }
            45..=59 => {
                let result = handle.flush();
                if result.is_ok() {
                    model.acknowledge(0..sectors);
                }
                result.map(|_| "flush")
            }
            60..=64 => {
                // Whole blocks inside the range are discarded: they read as zeroes.
                let first_block = (first * SECTOR).div_ceil(block_bytes);
                let end_block = ((first + count) * SECTOR) / block_bytes;
                let result = handle.discard(first * SECTOR, count * SECTOR);
                if first_block < end_block {
                    model.set(
                        first_block * sectors_per_block..end_block * sectors_per_block,
                        Content::Zero,
                    );
                }
                result.map(|_| "discard")
            }
            65..=69 => {
                let fua = rng.gen_bool(0.3);
                model.set(range.clone(), Content::Zero);
                let result = handle.write_zeroes(first * SECTOR, count * SECTOR, fua);
                if result.is_ok() && fua {
                    model.acknowledge(range.clone());
                }
                result.map(|_| "write_zeroes")
            }
            70..=79 => {
                // A whole block through the BSD calls: getblk, fill, bdwrite or bawrite.
                let block = rng.gen_range(0..BLOCKS);
                let block_sectors = block * sectors_per_block..(block + 1) * sectors_per_block;
                match handle.getblk(block) {
                    Ok(mut guard) => {
                        let version = model.next_version;
                        model.next_version += 1;
                        let data: Vec<u8> = block_sectors
                            .clone()
                            .flat_map(|sector| sector_bytes(sector, version))
                            .collect();
                        guard.data_mut().copy_from_slice(&data);
                        model.set(block_sectors, Content::Version(version));
                        if rng.gen_bool(0.5) {
                            handle.bdwrite(guard).map(|_| "bdwrite")
                        } else {
                            handle.bawrite(guard).map(|_| "bawrite")
                        }
                    }
                    Err(error) => Err(error),
                }
            }
            _ => {
                let mut data = vec![0u8; (count * SECTOR) as usize];
                let result = handle.read_at(first * SECTOR, &mut data);
                if result.is_ok() && data != model.expected_bytes(range.clone()) {
                    panic!("{label} op {op}: read of sectors {range:?} differs from the model");
                }
                result.map(|_| "read")
            }
        };
        if let Err(error) = outcome {
            assert!(
                device.is_crashed(),
                "{label} op {op}: an operation failed before the crash: {error}"
            );
            break;
        }
    }
    if !device.is_crashed() {
        device.crash(mode);
    }
    let image = device.durable_image();
    for sector in 0..sectors {
        let bytes = &image[(sector * SECTOR) as usize..((sector + 1) * SECTOR) as usize];
        let Some(content) = decode(sector, bytes) else {
            panic!("{label}: durable sector {sector} holds garbage (no written version)");
        };
        let history = &model.history[sector as usize];
        let acknowledged = model.acknowledged[sector as usize];
        if !history[acknowledged..].contains(&content) {
            panic!(
                "{label}: durable sector {sector} (block {}) holds {content:?}, but the \
                 acknowledged value is {:?} and later values are {:?} (older history {:?})",
                sector * SECTOR / block_bytes,
                history[acknowledged],
                &history[acknowledged + 1..],
                &history[..acknowledged]
            );
        }
    }
    // After power returns, a fresh cache serves exactly the durable image.
    device.restart();
    let cache = bufcache_host::system_cache(CacheConfig {
        buffer_bytes_max: block_bytes,
        memory_bytes_max: 16 * 4096,
        ..CacheConfig::default()
    })
    .unwrap();
    let handle = cache
        .open_object(
            ObjectConfig::new("again", device.clone() as Arc<dyn Device>)
                .block_size(block_bytes as u32),
        )
        .unwrap();
    let mut back = vec![0u8; length as usize];
    handle.read_at(0, &mut back).unwrap();
    assert!(
        back == image,
        "{label}: after restart the cache serves the durable image"
    );
}

#[test]
fn acknowledged_writes_survive_a_crash_and_nothing_else_is_invented() {
    let base: u64 = std::env::var("BUFCACHE_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    for seed in base..base + 1500 {
        run_seed(seed);
    }
}
