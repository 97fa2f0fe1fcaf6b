//! `bufcache sim check --layout log`, clones: each seed also makes a base disk, takes a
//! snapshot of it and clones the snapshot in the simulated store ([`crate::sim_store`],
//! without faults), then drives seeded writes, zeroes, flushes, collection rounds and clean
//! reopens into both. The check, after every collection round and reopen:
//! - the clone reads its base's snapshot exactly where it has not written, and its own
//!   writes elsewhere (a shadow: the snapshot's tags overlaid with the clone's);
//! - the snapshot, served with `snapshot=`, reads as the base held it when it was taken,
//!   whatever the base wrote and collected since;
//! - the base reads its own latest writes.
//!
//! The planted defect `planted-snapshot-defect` (an open's cleanup deleting segments only a
//! snapshot holds) is caught here too: the clone then reads a base segment that is gone.
//!
//! Blocks carry a tag (the write and the block) repeated over their bytes; tag 0 is zeroes.

use std::sync::Arc;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::sim_store::{FaultRates, LateRates, SimWorld};
use crate::store::{ChunkStore, Create};
use crate::{LogConfig, LogStore, S3Url};

const BLOCK_BYTES: u64 = 4096;
/// The snapshot the clone is made of.
const SNAPSHOT_NAME: &str = "golden";

/// What checking one seed's clone found.
#[derive(Clone, Debug, Default)]
pub struct CloneCheckOutcome {
    pub steps: u64,
    /// Whole reads of the clone (and of the snapshot and the base) checked against their
    /// shadows.
    pub checks: u64,
    /// What broke the contract; None when nothing did.
    pub violation: Option<String>,
}

fn fill(tag: u64, block: &mut [u8]) {
    for word in block.chunks_mut(8) {
        word.copy_from_slice(&tag.to_le_bytes());
    }
}

/// One side of the check: a disk, its open store and what each block must read.
struct Disk {
    name: &'static str,
    url: S3Url,
    store: Option<LogStore>,
    tags: Vec<u64>,
}

struct Harness {
    rng: StdRng,
    world: Arc<SimWorld>,
    config: LogConfig,
    instance: u64,
    next_tag: u64,
    base: Disk,
    clone: Disk,
    /// The base's tags when the snapshot was taken.
    snapshot: Vec<u64>,
    outcome: CloneCheckOutcome,
}

impl Harness {
    fn open(&mut self, clone: bool) -> Result<(), String> {
        self.instance += 1;
        let store = self.world.store(self.instance);
        let disk = if clone {
            &mut self.clone
        } else {
            &mut self.base
        };
        let opened = LogStore::open_unlocked_on(&disk.url, store, self.config)
            .map_err(|error| format!("the {} does not open: {error}", disk.name))?;
        disk.store = Some(opened);
        Ok(())
    }

    fn close(&mut self, clone: bool) -> Result<(), String> {
        let disk = if clone {
            &mut self.clone
        } else {
            &mut self.base
        };
        let mut store = disk.store.take().expect("an open disk");
        store
            .close()
            .map_err(|error| format!("the {} does not close: {error}", disk.name))
    }

    fn write(&mut self, clone: bool) -> Result<(), String> {
        let disk = if clone {
            &mut self.clone
        } else {
            &mut self.base
        };
        let blocks = disk.tags.len() as u64;
        let first = self.rng.gen_range(0..blocks);
        let count = self.rng.gen_range(1..=(blocks - first).min(8));
        let zeroes = self.rng.gen_bool(0.15);
        let store = disk.store.as_ref().expect("an open disk");
        if zeroes {
            store
                .write_zeroes(first * BLOCK_BYTES, count * BLOCK_BYTES)
                .map_err(|error| format!("zeroing the {}: {error}", disk.name))?;
            disk.tags[first as usize..(first + count) as usize].fill(0);
            return Ok(());
        }
        let mut data = vec![0u8; (count * BLOCK_BYTES) as usize];
        for (at, block) in data.chunks_mut(BLOCK_BYTES as usize).enumerate() {
            self.next_tag += 1;
            fill(self.next_tag, block);
            disk.tags[first as usize + at] = self.next_tag;
        }
        store
            .write(&data, first * BLOCK_BYTES)
            .map_err(|error| format!("writing the {}: {error}", disk.name))
    }

    /// Reads `reader` whole and compares it with `tags`.
    fn compare(what: &str, reader: &LogStore, tags: &[u64]) -> Result<(), String> {
        let mut image = vec![0u8; tags.len() * BLOCK_BYTES as usize];
        reader
            .read(&mut image, 0)
            .map_err(|error| format!("the {what} does not read back: {error}"))?;
        for (block, bytes) in image.chunks(BLOCK_BYTES as usize).enumerate() {
            let mut expected = vec![0u8; BLOCK_BYTES as usize];
            fill(tags[block], &mut expected);
            if bytes != expected {
                return Err(format!(
                    "the {what}'s block {block} does not read tag {} (first word {:#x})",
                    tags[block],
                    u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"))
                ));
            }
        }
        Ok(())
    }

    /// The clone and the base through their open stores (their writes not yet uploaded
    /// included), the snapshot through a read-only open of `snapshot=`.
    fn check(&mut self) -> Result<(), String> {
        for disk in [&self.clone, &self.base] {
            Self::compare(
                disk.name,
                disk.store.as_ref().expect("an open disk"),
                &disk.tags,
            )?;
        }
        let mut snapshot_url = self.base.url.clone();
        snapshot_url.snapshot = Some(SNAPSHOT_NAME.to_string());
        self.instance += 1;
        let reader = LogStore::open_read_only_on(
            &snapshot_url,
            self.world.store(self.instance),
            self.config,
        )
        .map_err(|error| format!("the snapshot does not open: {error}"))?;
        Self::compare("snapshot", &reader, &self.snapshot)?;
        self.outcome.checks += 1;
        Ok(())
    }

    fn step(&mut self) -> Result<(), String> {
        self.outcome.steps += 1;
        let clone = self.rng.gen_bool(0.5);
        match self.rng.gen_range(0..100) {
            0..=69 => self.write(clone),
            70..=79 => {
                let disk = if clone { &self.clone } else { &self.base };
                disk.store
                    .as_ref()
                    .expect("an open disk")
                    .flush()
                    .map_err(|error| format!("flushing the {}: {error}", disk.name))
            }
            80..=89 => {
                let disk = if clone { &self.clone } else { &self.base };
                disk.store
                    .as_ref()
                    .expect("an open disk")
                    .collect_garbage(0.99)
                    .map_err(|error| format!("collecting the {}: {error}", disk.name))?;
                self.check()
            }
            _ => {
                self.close(clone)?;
                self.open(clone)?;
                self.check()
            }
        }
    }
}

/// Checks one seed's clone (module docs).
pub fn check_clone_seed(seed: u64) -> CloneCheckOutcome {
    let _quiet = tracing::subscriber::set_default(tracing::subscriber::NoSubscriber::default());
    let mut rng = StdRng::seed_from_u64(seed ^ 0xc10e_c10e_c10e_c10e);
    let late = LateRates {
        at_crash_ppm: 0,
        later_ppm: 0,
        later_steps_max: 1,
    };
    let world = SimWorld::new(seed, FaultRates::default(), late);
    let blocks: u64 = rng.gen_range(8..=48);
    let segment_bytes_max = [8u64 << 10, 16 << 10, 32 << 10][rng.gen_range(0..3)];
    let config = LogConfig {
        segment_bytes_max,
        segments_in_flight_max: rng.gen_range(1..=4),
        checkpoint_interval_segments: rng.gen_range(1..=4),
        requests_in_flight_max: rng.gen_range(1..=4),
        gc_threshold: None,
        gc_stored_ratio_max: 1.5,
        gc_requests_in_flight_max: 1,
        gc_bytes_max: segment_bytes_max * 2,
        gc_interval_ms: 100,
        get_bytes_max: [4 << 10, segment_bytes_max][rng.gen_range(0..2)],
    };
    let url = |prefix: &str, parameters: &str| {
        S3Url::parse(&format!("s3://sim/{prefix}{seed}?layout=log{parameters}"))
            .expect("the harness's URL parses")
    };
    let mut harness = Harness {
        rng,
        world: world.clone(),
        config,
        instance: 0,
        next_tag: 0,
        base: Disk {
            name: "base",
            url: url("base", &format!("&create-size={}", blocks * BLOCK_BYTES)),
            store: None,
            tags: vec![0; blocks as usize],
        },
        clone: Disk {
            name: "clone",
            url: url("clone", ""),
            store: None,
            tags: Vec::new(),
        },
        snapshot: Vec::new(),
        outcome: CloneCheckOutcome::default(),
    };
    let result = (|| -> Result<(), String> {
        harness.open(false)?;
        for _ in 0..harness.rng.gen_range(4..24) {
            harness.write(false)?;
        }
        let base_store = harness.base.store.as_ref().expect("the base is open");
        base_store
            .snapshot(SNAPSHOT_NAME)
            .map_err(|error| format!("the snapshot: {error}"))?;
        harness.snapshot = harness.base.tags.clone();
        harness.clone.tags = harness.snapshot.clone();
        harness.instance += 1;
        let store = world.store(harness.instance);
        let base_url = harness.base.url.clone();
        let clone_url = harness.clone.url.clone();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|error| format!("a runtime: {error}"))?;
        runtime
            .block_on(async {
                let base_metadata =
                    ChunkStore::open_metadata(&*store, &base_url, Create::Never).await?;
                crate::admin::create_clone_objects(
                    &*store,
                    &base_url,
                    &base_metadata,
                    &clone_url,
                    SNAPSHOT_NAME,
                )
                .await
                .map(drop)
                .map_err(|error| crate::OpenError::Config {
                    url: clone_url.to_string(),
                    reason: error.to_string(),
                })
            })
            .map_err(|error| format!("making the clone: {error}"))?;
        harness.open(true)?;
        harness.check()?;
        for _ in 0..harness.rng.gen_range(20..80) {
            harness.step()?;
        }
        harness.close(false)?;
        harness.close(true)?;
        harness.open(false)?;
        harness.open(true)?;
        harness.check()
    })();
    if let Err(message) = result {
        harness.outcome.violation = Some(format!("step {}: {message}", harness.outcome.steps));
    }
    harness.outcome
}
