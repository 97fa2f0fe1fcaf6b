//! Deterministic simulation testing (`bufcache sim check`): seeded random workloads through
//! the real engine on a data-carrying simulated disk with faults and crashes, checked against
//! a shadow model of what the engine promised.
//!
//! One seed decides everything, through one [`SeededRng`]: the cache's shape (tiny memory,
//! block and cluster sizes, dirty limits, write-behind, policy), the objects, the io queue
//! (none, fifo or elevator, merging or not, depth 1 to 4: the real `bufcache_device::IoQueue`
//! over the simulated disk's own queue, where requests of several clients wait together in
//! virtual time and are reordered and merged), the fault rates,
//! and every step — which simulated client calls what (read, write, FUA write, zeroes,
//! discard, flush, sync), when the syncer and the I/O daemon run, when the memory limit
//! changes, and where the power fails.
//! Time is virtual, so a seed replays exactly.
//!
//! The contract checked (the brief's "never report a write durable before it is"):
//! - **durability**: after a crash, every 512-byte sector holds the last write acknowledged
//!   before the last acknowledged flush (or FUA write) covering it, or something written after
//!   it — never anything older;
//! - **reads**: a read returns, for every sector, the latest acknowledged data (or the data of
//!   a write attempted after it that failed), or an error;
//! - **error reporting**: every failed device write is reported by the next flush of every
//!   handle on its object, unless a write on that handle already returned an error since;
//! - **at the end**, with faults off, a sync succeeds and the disk holds exactly the latest
//!   acknowledged data;
//! - **rescue files** (the [`rescue`] module): a shutdown during an outage saves what it cannot
//!   write back, and with the store loses no flushed write; a restart with a changed URL
//!   replays the file; a file saved before another server opened the disk is refused, kept,
//!   and the refused start leaves the store unchanged.
//!
//! Each sector written carries its write's version number and its own sector index, so a
//! sector read back (through the engine, or from the disk after a crash) names the write it
//! came from, and data landing at the wrong place is caught too.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bufcache::device::SeededRng;
use bufcache::{Cache, CacheConfig, Device, Environment, IdentityMap, ObjectConfig, ObjectHandle};
use bufcache::{IoQueue, IoQueueConfig, PolicyKind, QueueMode, Spawner, Waiter};
use bufcache_check::{catching_panics, Notes, Step, Sweep, Totals, Violation, RECENT_STEPS};

use crate::clock::VirtualClock;
use crate::core::SECTOR_BYTES;
use crate::core::{FaultConfig, SharedRng, SimCore, SimDevice, SimIoQueue, SimSpawner, SimWaiter};
use crate::disk::DiskSpec;
use crate::host::HostCosts;

mod rescue;

/// An S3 disk's identity, as its metadata object's id names it (`bufcache_s3::disk_identity`,
/// which the simulator does not depend on).
pub(crate) fn s3_identity(disk_id: u64) -> String {
    format!("s3-disk:{disk_id:016x}")
}

pub use rescue::RescueCounts;
use rescue::RescueWorld;

/// Steps of one seed's workload, at least and at most.
const STEPS_MIN: u64 = 150;
const STEPS_MAX: u64 = 400;

/// The properties `sim check` checks (module docs), as its violations name them.
pub mod property {
    /// A read returns the latest acknowledged data (or a failed write's attempt).
    pub const READS: &str = "reads";
    /// After a crash every sector holds what the last covering flush promised, or newer.
    pub const DURABILITY: &str = "durability";
    /// Every failed device write is reported by the next flush of every handle.
    pub const ERROR_REPORTING: &str = "error reporting";
    /// With faults off at the end, a sync succeeds and the disk holds the latest data.
    pub const AT_THE_END: &str = "at the end";
    /// Rescue files save, replay and refuse as the rescue rule says.
    pub const RESCUE_FILES: &str = "rescue files";
}

/// What one seed did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SeedOutcome {
    /// Engine calls made.
    pub steps: u64,
    /// Power failures simulated.
    pub crashes: u64,
    /// Device requests failed by seeded faults.
    pub device_faults: u64,
    /// The io queue of the seed's scenario (`None`: no queue).
    pub queue_mode: Option<QueueMode>,
    /// Batches the simulated io queue took while other requests waited too.
    pub queue_choices: u64,
    /// Rescue files saved, replayed and refused.
    pub rescue: RescueCounts,
    /// Restarts that presented a local cache to another disk, refused (`--local-tier`).
    pub wrong_disk_refusals: u64,
    /// The first broken promise, if any.
    pub violation: Option<Violation>,
}

impl bufcache_check::SeedOutcome for SeedOutcome {
    fn violation(&self) -> Option<&Violation> {
        self.violation.as_ref()
    }
}

/// The totals of a sweep of seeds (`sim check` and `sim check --local-tier`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CheckTotals {
    /// Engine calls made, over all seeds.
    pub steps: u64,
    /// Crashes simulated, over all seeds.
    pub crashes: u64,
    /// Device faults injected, over all seeds.
    pub device_faults: u64,
    /// Rescue files saved, replayed and refused, over all seeds.
    pub rescue: RescueCounts,
    /// Restarts that presented a local cache to another disk, refused, over all seeds.
    pub wrong_disk_refusals: u64,
}

impl Totals<SeedOutcome> for CheckTotals {
    fn add(&mut self, outcome: &SeedOutcome) {
        self.steps += outcome.steps;
        self.crashes += outcome.crashes;
        self.device_faults += outcome.device_faults;
        self.rescue.saved += outcome.rescue.saved;
        self.rescue.replayed += outcome.rescue.replayed;
        self.rescue.refused += outcome.rescue.refused;
        self.wrong_disk_refusals += outcome.wrong_disk_refusals;
    }
}

/// The result of a sweep of seeds.
pub type CheckSummary = Sweep<CheckTotals>;

/// Runs seeds `first_seed .. first_seed + seeds`, calling `on_seed` after each.
pub fn check_seeds(
    first_seed: u64,
    seeds: u64,
    on_seed: impl FnMut(u64, &SeedOutcome),
) -> CheckSummary {
    bufcache_check::check_seeds(first_seed, seeds, check_seed, on_seed)
}

/// Runs one seed. An engine panic is a violation too (its message is kept).
pub fn check_seed(seed: u64) -> SeedOutcome {
    check_seed_traced(seed, false)
}

/// Runs one seed, printing every step to standard error when `trace` is set.
pub fn check_seed_traced(seed: u64, trace: bool) -> SeedOutcome {
    let mut outcome = SeedOutcome::default();
    outcome.violation = catching_panics(seed, "the engine", || {
        let mut harness = Harness::new(seed, trace);
        let result = harness.run();
        outcome.steps = harness.steps;
        outcome.crashes = harness.crashes;
        outcome.device_faults = harness.device_faults();
        outcome.queue_mode = harness.scenario.io_queue.as_ref().map(|queue| queue.mode);
        outcome.queue_choices = harness.core.device_totals().queue_choices;
        outcome.rescue = harness.rescue.counts;
        result
    });
    outcome
}

/// One object: a disjoint range of the disk.
#[derive(Clone, Copy, Debug)]
struct Region {
    base: u64,
    length: u64,
    block_size: u32,
}

/// The shadow of one sector: versions written to it in order (`acknowledged` or only
/// attempted), and the index of the one a flush made durable.
#[derive(Clone, Debug)]
struct Shadow {
    versions: Vec<(u64, bool)>,
    floor: usize,
}

impl Shadow {
    fn initial() -> Self {
        Shadow {
            versions: vec![(0, true)],
            floor: 0,
        }
    }

    /// Index of the latest acknowledged version.
    fn latest(&self) -> usize {
        self.versions
            .iter()
            .rposition(|&(_, acknowledged)| acknowledged)
            .unwrap_or(0)
    }

    fn readable(&self, version: u64) -> bool {
        self.versions[self.latest()..]
            .iter()
            .any(|&(v, _)| v == version)
    }

    fn survives(&self, version: u64) -> bool {
        self.versions[self.floor..]
            .iter()
            .any(|&(v, _)| v == version)
    }

    fn expected_after_crash(&self) -> Vec<u64> {
        self.versions[self.floor..]
            .iter()
            .map(|&(v, _)| v)
            .collect()
    }

    fn expected_read(&self) -> Vec<u64> {
        self.versions[self.latest()..]
            .iter()
            .map(|&(v, _)| v)
            .collect()
    }
}

/// The content of sector `sector` written by `version` (0 is all zeroes).
pub(crate) fn sector_pattern(version: u64, sector: u64, target: &mut [u8]) {
    if version == 0 {
        target.fill(0);
        return;
    }
    for piece in target.chunks_mut(16) {
        piece[..8].copy_from_slice(&version.to_le_bytes());
        piece[8..].copy_from_slice(&sector.to_le_bytes());
    }
}

/// A sector's bytes that are no write's pattern (torn, misplaced or corrupt).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Garbage {
    /// The version its first word names.
    version: u64,
    /// The sector its second word names.
    claimed_sector: u64,
}

impl fmt::Display for Garbage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "garbage (first words: version {}, sector {})",
            self.version, self.claimed_sector
        )
    }
}

/// Which version a sector's bytes are, or what they hold instead.
pub(crate) fn decode_sector(bytes: &[u8], sector: u64) -> Result<u64, Garbage> {
    if bytes.iter().all(|&b| b == 0) {
        return Ok(0);
    }
    let version = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
    let mut expected = vec![0u8; bytes.len()];
    sector_pattern(version, sector, &mut expected);
    if version != 0 && expected == bytes {
        return Ok(version);
    }
    let claimed_sector = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes"));
    Err(Garbage {
        version,
        claimed_sector,
    })
}

/// The seeded shape of one run.
struct Scenario {
    config: CacheConfig,
    regions: Vec<Region>,
    clients: usize,
    steps: u64,
    faults: FaultConfig,
    crash_per_mille: u64,
    /// The real io queue between the engine and the disk, as `serve` has it (or none).
    io_queue: Option<IoQueueConfig>,
    /// The disk's write unit (1: none; else 2 to 8 blocks, as an object-store chunk), so
    /// write-back's whole-unit runs and filling from clean blocks are checked too.
    write_unit_bytes: u64,
    /// Steps (per thousand) where the store stops answering and the server shuts down.
    outage_per_mille: u64,
}

impl Scenario {
    fn draw(rng: &mut SeededRng) -> Scenario {
        let block_size: u32 = if rng.below(3) == 0 { 8192 } else { 4096 };
        let block = block_size as u64;
        let cluster_blocks = 1 + rng.below(8);
        let memory_blocks = 2 + rng.below(15);
        let background = 1 + rng.below(50) as u8;
        let limit = background + rng.below(90 - background as u64 + 1) as u8;
        let policies = PolicyKind::ALL;
        let config = CacheConfig {
            buffer_bytes_max: block,
            transfer_bytes_max: (block * 8).max(4096),
            cluster_bytes_max: block * cluster_blocks,
            memory_bytes_max: block * memory_blocks,
            buffers_max: if rng.below(4) == 0 {
                2 + rng.below(memory_blocks)
            } else {
                1 << 20
            },
            readahead_bytes_max: if rng.below(3) == 0 {
                0
            } else {
                block * (1 + rng.below(8))
            },
            readahead_size_initial_bytes: block,
            policy: policies[rng.below(policies.len() as u64) as usize],
            dirty_age_max: Duration::from_millis(1 + rng.below(200)),
            dirty_background_percent: background,
            dirty_limit_percent: limit,
            write_behind: rng.below(2) == 0,
            space_wait_max: Duration::from_millis(rng.below(3) * 10),
            shards: 1,
            background_jobs_queued_max: 1 + rng.below(8) as usize,
            ..CacheConfig::default()
        };
        let objects = 1 + rng.below(3);
        let mut regions = Vec::new();
        let mut base = 0;
        for _ in 0..objects {
            let blocks = 8 + rng.below(40);
            regions.push(Region {
                base,
                length: blocks * block,
                block_size,
            });
            base += blocks * block;
        }
        let faulty = rng.below(4) != 0;
        let percent = |rng: &mut SeededRng, max: u64| rng.below(max + 1) as f64 / 100.0;
        let faults = if faulty {
            FaultConfig {
                read_error_probability: percent(rng, 5),
                write_error_probability: percent(rng, 15),
                flush_error_probability: percent(rng, 5),
                latency_spike_probability: percent(rng, 5),
                latency_spike_ns: 1_000_000 + rng.below(100_000_000),
            }
        } else {
            FaultConfig::default()
        };
        let modes = [QueueMode::None, QueueMode::Fifo, QueueMode::Elevator];
        let mode = modes[rng.below(3) as usize];
        let io_queue = (mode != QueueMode::None).then(|| IoQueueConfig {
            mode,
            merge: rng.below(4) != 0,
            transfer_bytes_max: config.transfer_bytes_max,
            depth_max: 1 + rng.below(4) as usize,
            ..IoQueueConfig::default()
        });
        let write_unit_bytes = if rng.below(3) == 0 {
            block * (2 + rng.below(7))
        } else {
            1
        };
        Scenario {
            io_queue,
            write_unit_bytes,
            config,
            regions,
            clients: 2 + rng.below(3) as usize,
            steps: STEPS_MIN + rng.below(STEPS_MAX - STEPS_MIN + 1),
            faults,
            crash_per_mille: rng.below(16),
            outage_per_mille: rng.below(12),
        }
    }

    fn describe(&self) -> String {
        let c = &self.config;
        format!(
            "{} objects of {} KiB blocks, {} clients; cache {} KiB, {} buffers max, cluster {} KiB, \
             read-ahead {} KiB, policy {}, dirty {}%/{}%, write-behind {}, faults r{}/w{}/f{}, \
             io queue {}, write unit {} B, outages {}/1000",
            self.regions.len(),
            self.regions[0].block_size / 1024,
            self.clients,
            c.memory_bytes_max / 1024,
            c.buffers_max,
            c.cluster_bytes_max / 1024,
            c.readahead_bytes_max / 1024,
            c.policy.name(),
            c.dirty_background_percent,
            c.dirty_limit_percent,
            c.write_behind,
            self.faults.read_error_probability,
            self.faults.write_error_probability,
            self.faults.flush_error_probability,
            match &self.io_queue {
                None => "none".to_string(),
                Some(queue) => format!(
                    "{:?}{} depth {}",
                    queue.mode,
                    if queue.merge { " merging" } else { "" },
                    queue.depth_max
                ),
            },
            self.write_unit_bytes,
            self.outage_per_mille,
        )
    }
}

/// The engine and its simulated world for one seed.
struct Harness {
    seed: u64,
    rng: SharedRng,
    scenario: Scenario,
    core: Arc<SimCore>,
    device: Arc<SimDevice>,
    /// What the engine writes to: the disk, or the real io queue over it.
    engine_device: Arc<dyn Device>,
    spawner: Arc<SimSpawner>,
    waiter: Arc<SimWaiter>,
    cache: Option<Cache>,
    /// `handles[client][object]`.
    handles: Vec<Vec<ObjectHandle>>,
    client_accounts: Vec<usize>,
    daemon_account: usize,
    syncer_account: usize,
    now_ns: u64,
    /// One per sector of the disk.
    shadow: Vec<Shadow>,
    /// `unreported[client][object]`: failed device writes the handle has not been told of.
    unreported: Vec<Vec<u64>>,
    next_version: u64,
    steps: u64,
    crashes: u64,
    /// Every step, the last ones kept for a violation's report (printed when tracing).
    notes: Notes,
    /// The disks' identities and generations, and this machine's rescue files.
    rescue: RescueWorld,
}

impl Harness {
    fn new(seed: u64, trace: bool) -> Harness {
        let mut rng = SeededRng::new(seed);
        let scenario = Scenario::draw(&mut rng);
        let rescue = RescueWorld::new(&mut rng, scenario.regions.len());
        let rng: SharedRng = Arc::new(Mutex::new(rng));
        let clock = Arc::new(VirtualClock::new());
        // With an io queue, a mechanical disk: its requests take milliseconds, so the clients'
        // requests (a step every 0-2 ms) wait in the queue together and are reordered.
        let disk: DiskSpec = if scenario.io_queue.is_some() {
            DiskSpec::hdd7200()
        } else {
            DiskSpec::nvme()
        };
        let host = HostCosts::preset("modern").expect("the modern preset exists");
        let core = Arc::new(SimCore::new(disk.build(), host, clock));
        // The simulated disk's queue, where requests wait in virtual time: the real queue
        // above it never holds more than one (one simulated thread calls at a time).
        core.set_io_queue(scenario.io_queue.as_ref().map(|queue| SimIoQueue {
            depth_max: queue.depth_max,
            ..SimIoQueue::new(queue.mode, queue.merge, queue.transfer_bytes_max)
        }));
        let length: u64 = scenario.regions.iter().map(|r| r.length).sum();
        let mut device = SimDevice::new(core.clone(), length, "simulated disk");
        device.set_write_unit_bytes(scenario.write_unit_bytes);
        let device = Arc::new(device);
        device.track_crashes();
        device.set_faults(scenario.faults.clone(), rng.clone());
        // The real io queue dispatches on the submitting thread when nothing else is in
        // flight, so with one simulated thread it never blocks and stays deterministic.
        let engine_device: Arc<dyn Device> = match &scenario.io_queue {
            Some(queue) => Arc::new(
                IoQueue::new(device.clone() as Arc<dyn Device>, queue.clone())
                    .expect("the scenario's io queue is valid"),
            ),
            None => device.clone(),
        };
        let spawner = Arc::new(SimSpawner::new(
            core.clone(),
            scenario.config.background_jobs_queued_max,
        ));
        let waiter = Arc::new(SimWaiter::new(core.clone()));
        let client_accounts = (0..scenario.clients)
            .map(|client| core.add_account(&format!("client{client}")))
            .collect();
        let daemon_account = core.add_account("iod");
        let syncer_account = core.add_account("syncer");
        let sectors = (length / SECTOR_BYTES) as usize;
        let mut harness = Harness {
            seed,
            rng,
            core,
            device,
            engine_device,
            spawner,
            waiter,
            cache: None,
            handles: Vec::new(),
            client_accounts,
            daemon_account,
            syncer_account,
            now_ns: 0,
            shadow: vec![Shadow::initial(); sectors],
            unreported: vec![vec![0; scenario.regions.len()]; scenario.clients],
            next_version: 1,
            steps: 0,
            crashes: 0,
            notes: Notes::new(RECENT_STEPS, trace),
            rescue,
            scenario,
        };
        harness.start_engine();
        harness
    }

    fn draw(&self, bound: u64) -> u64 {
        self.rng
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .below(bound)
    }

    fn device_faults(&self) -> u64 {
        let counts = self.device.fault_counts();
        counts.read_errors + counts.write_errors + counts.flush_errors
    }

    /// A fresh engine over the disk (at the start, after each crash or shutdown), one handle
    /// per client and object: a writable open of every disk, which raises its generation.
    fn start_engine(&mut self) {
        self.rescue.open();
        let environment = Environment::new(
            self.core.clock().clone(),
            self.spawner.clone() as Arc<dyn Spawner>,
            self.waiter.clone() as Arc<dyn Waiter>,
        );
        let cache = Cache::with_environment(self.scenario.config.clone(), environment)
            .expect("the scenario's configuration is valid");
        let mut first_handles = Vec::new();
        for (index, region) in self.scenario.regions.iter().enumerate() {
            let block = region.block_size as u64;
            let mut config =
                ObjectConfig::new(format!("object{index}"), self.engine_device.clone())
                    .block_size(region.block_size);
            config.length_bytes = Some(region.length);
            config.block_map = Some(Arc::new(IdentityMap::new(
                region.base,
                block,
                region.length / block,
            )));
            first_handles.push(cache.open_object(config).expect("the object fits"));
        }
        self.handles = (0..self.scenario.clients)
            .map(|_| first_handles.iter().map(|h| h.reopen()).collect())
            .collect();
        self.cache = Some(cache);
        for row in &mut self.unreported {
            row.fill(0);
        }
    }

    fn note(&mut self, step: String) {
        self.notes.note(Step::workload(self.steps), step);
    }

    /// A broken `property` (module [`property`]) at this step, with the scenario and the
    /// steps before it.
    fn violation(&self, property: &'static str, what: String) -> Violation {
        Violation::new(
            property,
            what,
            Step::workload(self.steps),
            self.seed,
            &self.notes,
        )
        .in_scenario(self.scenario.describe())
    }

    /// A random sector-aligned range inside object `object`: (offset in the object, length).
    fn draw_range(&self, object: usize, blocks_max: u64) -> (u64, u64) {
        let region = self.scenario.regions[object];
        let sectors = region.length / SECTOR_BYTES;
        let per_block = region.block_size as u64 / SECTOR_BYTES;
        let start = self.draw(sectors);
        // Mostly whole, aligned blocks (the common case and the clustering path), sometimes
        // partial ones (read-modify-write).
        let (start, count) = if self.draw(3) != 0 {
            let start = start / per_block * per_block;
            (start, per_block * (1 + self.draw(blocks_max)))
        } else {
            (start, 1 + self.draw(per_block * blocks_max))
        };
        let count = count.min(sectors - start);
        (start * SECTOR_BYTES, count * SECTOR_BYTES)
    }

    fn first_sector(&self, object: usize, offset: u64) -> u64 {
        (self.scenario.regions[object].base + offset) / SECTOR_BYTES
    }

    fn run(&mut self) -> Result<(), Violation> {
        for _ in 0..self.scenario.steps {
            self.step()?;
        }
        self.finish()
    }

    fn enter(&mut self, account: usize) {
        self.now_ns += self.draw(2_000_000);
        self.now_ns = self.now_ns.max(self.core.cursor());
        // The disk serves what is due by now; an entity still blocked on its request (other
        // clients' requests may have come before it in the queue's order), or whose request
        // completes later than now, goes on when it is done.
        self.core.advance_disk(self.now_ns);
        self.now_ns = self.now_ns.max(self.core.settle(account));
        self.core.enter(account, self.now_ns);
    }

    fn leave(&mut self) {
        self.now_ns = self.now_ns.max(self.core.cursor());
    }

    /// Counts failed device writes against every handle of their object.
    fn collect_failed_writes(&mut self) {
        for (offset, length) in self.device.take_failed_writes() {
            self.notes.trace(
                "  failed device write",
                format_args!("[{offset}, +{length})"),
            );
            for (object, region) in self.scenario.regions.iter().enumerate() {
                if offset < region.base + region.length && region.base < offset + length {
                    for row in &mut self.unreported {
                        row[object] += 1;
                    }
                }
            }
        }
    }

    fn step(&mut self) -> Result<(), Violation> {
        self.steps += 1;
        if self.draw(1000) < self.scenario.crash_per_mille {
            return self.crash();
        }
        if self.draw(1000) < self.scenario.outage_per_mille {
            return self.outage();
        }
        let client = self.draw(self.scenario.clients as u64) as usize;
        let object = self.draw(self.scenario.regions.len() as u64) as usize;
        let choice = self.draw(100);
        if choice < 84 {
            // Queued read-ahead jobs hold their buffers locked until they run; in a server a
            // worker runs them while a client waits on the lock, but here the client would
            // wait forever, so they finish before the next call (they still run after any
            // number of syncer ticks and daemon steps, and die in a crash).
            self.drain_jobs();
        }
        match choice {
            0..=29 => self.read(client, object),
            30..=59 => {
                let fua = self.draw(6) == 0;
                self.write(client, object, fua)
            }
            60..=64 => {
                let fua = self.draw(4) == 0;
                self.zeroes(client, object, fua)
            }
            65..=69 => self.discard(client, object),
            70..=79 => self.flush(client, object),
            80..=81 => self.sync(),
            82..=83 => {
                self.resize();
                Ok(())
            }
            84..=89 => {
                self.tick();
                Ok(())
            }
            _ => {
                self.daemon();
                Ok(())
            }
        }
    }

    fn read(&mut self, client: usize, object: usize) -> Result<(), Violation> {
        let (offset, length) = self.draw_range(object, 6);
        self.enter(self.client_accounts[client]);
        let mut data = vec![0u8; length as usize];
        let result = self.handles[client][object].read_at(offset, &mut data);
        self.leave();
        self.collect_failed_writes();
        self.note(format!(
            "client{client} read object{object} [{offset}, +{length}) -> {}",
            if result.is_ok() { "ok" } else { "error" }
        ));
        if result.is_err() {
            return Ok(());
        }
        let first = self.first_sector(object, offset);
        for (index, bytes) in data.chunks(SECTOR_BYTES as usize).enumerate() {
            let sector = first + index as u64;
            let shadow = &self.shadow[sector as usize];
            match decode_sector(bytes, sector) {
                Ok(version) if shadow.readable(version) => {}
                Ok(version) => {
                    return Err(self.violation(
                        property::READS,
                        format!(
                        "stale read: sector {sector} (object{object} offset {}) read as version \
                         {version}, expected one of {:?}",
                        offset + index as u64 * SECTOR_BYTES,
                        shadow.expected_read()
                    ),
                    ))
                }
                Err(garbage) => {
                    return Err(self.violation(
                        property::READS,
                        format!("corrupt read: sector {sector} holds {garbage}"),
                    ))
                }
            }
        }
        Ok(())
    }

    /// Records a write of `version` over the sectors, acknowledged or not; a durable one
    /// (FUA) also moves the floor.
    fn record_write(&mut self, first: u64, sectors: u64, version: u64, acknowledged: bool) {
        for sector in first..first + sectors {
            let shadow = &mut self.shadow[sector as usize];
            shadow.versions.push((version, acknowledged));
        }
    }

    fn make_durable(&mut self, first: u64, sectors: u64) {
        for sector in first..first + sectors {
            let shadow = &mut self.shadow[sector as usize];
            shadow.floor = shadow.latest();
        }
    }

    fn write(&mut self, client: usize, object: usize, fua: bool) -> Result<(), Violation> {
        let (offset, length) = self.draw_range(object, 4);
        let version = self.next_version;
        self.next_version += 1;
        let first = self.first_sector(object, offset);
        let mut data = vec![0u8; length as usize];
        for (index, piece) in data.chunks_mut(SECTOR_BYTES as usize).enumerate() {
            sector_pattern(version, first + index as u64, piece);
        }
        self.enter(self.client_accounts[client]);
        let result = self.handles[client][object].write_at(offset, &data, fua);
        self.leave();
        self.collect_failed_writes();
        let sectors = length / SECTOR_BYTES;
        self.record_write(first, sectors, version, result.is_ok());
        match result {
            Ok(()) if fua => self.make_durable(first, sectors),
            Ok(()) => {}
            Err(_) => self.unreported[client][object] = 0,
        }
        self.note(format!(
            "client{client} write{} v{version} object{object} [{offset}, +{length}) -> {}",
            if fua { " fua" } else { "" },
            if result.is_ok() { "ok" } else { "error" }
        ));
        Ok(())
    }

    fn zeroes(&mut self, client: usize, object: usize, fua: bool) -> Result<(), Violation> {
        let (offset, length) = self.draw_range(object, 8);
        self.enter(self.client_accounts[client]);
        let result = self.handles[client][object].write_zeroes(offset, length, fua);
        self.leave();
        self.collect_failed_writes();
        let first = self.first_sector(object, offset);
        let sectors = length / SECTOR_BYTES;
        self.record_write(first, sectors, 0, result.is_ok());
        match result {
            Ok(()) if fua => self.make_durable(first, sectors),
            Ok(()) => {}
            // Zeroes are written through the cache like a write: its error is reported.
            Err(_) => self.unreported[client][object] = 0,
        }
        self.note(format!(
            "client{client} zeroes{} object{object} [{offset}, +{length}) -> {}",
            if fua { " fua" } else { "" },
            if result.is_ok() { "ok" } else { "error" }
        ));
        Ok(())
    }

    fn discard(&mut self, client: usize, object: usize) -> Result<(), Violation> {
        let (offset, length) = self.draw_range(object, 8);
        self.enter(self.client_accounts[client]);
        let result = self.handles[client][object].discard(offset, length);
        self.leave();
        self.collect_failed_writes();
        // A discard is advisory: the old data or zeroes may be read afterwards, so zeroes
        // join the candidates without replacing the acknowledged data.
        let first = self.first_sector(object, offset);
        self.record_write(first, length / SECTOR_BYTES, 0, false);
        self.note(format!(
            "client{client} discard object{object} [{offset}, +{length}) -> {}",
            if result.is_ok() { "ok" } else { "error" }
        ));
        Ok(())
    }

    fn region_sectors(&self, object: usize) -> (u64, u64) {
        let region = self.scenario.regions[object];
        (region.base / SECTOR_BYTES, region.length / SECTOR_BYTES)
    }

    fn flush(&mut self, client: usize, object: usize) -> Result<(), Violation> {
        self.enter(self.client_accounts[client]);
        let result = self.handles[client][object].flush();
        self.leave();
        self.collect_failed_writes();
        self.note(format!(
            "client{client} flush object{object} -> {}",
            if result.is_ok() { "ok" } else { "error" }
        ));
        match result {
            Ok(()) => {
                if self.unreported[client][object] > 0 {
                    return Err(self.violation(
                        property::ERROR_REPORTING,
                        format!(
                        "unreported write-back error: {} failed device write(s) on object{object} \
                         since client{client} last saw an error, yet its flush succeeded",
                        self.unreported[client][object]
                    ),
                    ));
                }
                let (first, sectors) = self.region_sectors(object);
                self.make_durable(first, sectors);
            }
            Err(_) => self.unreported[client][object] = 0,
        }
        Ok(())
    }

    fn sync(&mut self) -> Result<(), Violation> {
        self.enter(self.client_accounts[0]);
        let result = self.cache.as_ref().expect("running").sync();
        self.leave();
        self.collect_failed_writes();
        self.note(format!(
            "sync -> {}",
            if result.is_ok() { "ok" } else { "error" }
        ));
        if result.is_ok() {
            for object in 0..self.scenario.regions.len() {
                let (first, sectors) = self.region_sectors(object);
                self.make_durable(first, sectors);
            }
        }
        Ok(())
    }

    /// Changes the memory limit at run time (seed 003's dynamic buffer area): shrinking
    /// evicts clean buffers and writes dirty ones back, which must lose nothing.
    fn resize(&mut self) {
        let block = self.scenario.config.buffer_bytes_max;
        let memory = block * (2 + self.draw(15));
        let buffers = 2 + self.draw(32);
        self.enter(self.syncer_account);
        let result = self
            .cache
            .as_ref()
            .expect("running")
            .set_limits(memory, buffers);
        self.leave();
        self.collect_failed_writes();
        self.note(format!(
            "limits {} KiB, {buffers} buffers -> {}",
            memory / 1024,
            if result.is_ok() { "ok" } else { "error" }
        ));
    }

    fn tick(&mut self) {
        // The syncer runs after some idle time, so dirty data ages past its limit.
        self.now_ns += self.draw(self.scenario.config.dirty_age_max.as_nanos() as u64 * 2);
        self.enter(self.syncer_account);
        let written = self.cache.as_ref().expect("running").writeback_tick();
        self.leave();
        self.collect_failed_writes();
        self.note(format!("syncer tick wrote {written} blocks"));
    }

    fn drain_jobs(&mut self) {
        while self.spawner.next_time().is_some() {
            self.daemon();
        }
    }

    fn daemon(&mut self) {
        let jobs = 1 + self.draw(4);
        let mut ran = 0;
        for _ in 0..jobs {
            let Some((_, _, job)) = self.spawner.pop() else {
                break;
            };
            self.enter(self.daemon_account);
            job();
            self.leave();
            ran += 1;
        }
        self.collect_failed_writes();
        self.note(format!("daemon ran {ran} jobs"));
    }

    /// Power fails: the disk keeps, loses or tears its unflushed writes, the engine and its
    /// background work vanish; then the disk must hold, sector by sector, what was promised.
    fn crash(&mut self) -> Result<(), Violation> {
        self.crashes += 1;
        self.note("crash".to_string());
        let outcome = self.device.crash(&self.rng);
        self.spawner.clear();
        self.handles.clear();
        self.cache = None;
        self.device.restart();
        self.device.take_failed_writes();
        self.note(format!(
            "restart ({} unflushed writes kept, {} lost, {} torn)",
            outcome.writes_kept, outcome.writes_lost, outcome.writes_torn
        ));
        self.verify_disk(|shadow, version| shadow.survives(version), "after a crash")?;
        // What is on the disk now is all there is: the shadow starts over from it.
        let mut bytes = vec![0u8; SECTOR_BYTES as usize];
        for sector in 0..self.shadow.len() {
            self.device.peek(&mut bytes, sector as u64 * SECTOR_BYTES);
            let version = decode_sector(&bytes, sector as u64).expect("verified above");
            self.shadow[sector] = Shadow {
                versions: vec![(version, true)],
                floor: 0,
            };
        }
        self.start_engine();
        Ok(())
    }

    /// Checks every sector on the disk against the shadow with `allowed` (`when`: "after a
    /// crash" or "at the end").
    fn verify_disk(
        &self,
        allowed: impl Fn(&Shadow, u64) -> bool,
        when: &str,
    ) -> Result<(), Violation> {
        let mut bytes = vec![0u8; SECTOR_BYTES as usize];
        for (sector, shadow) in self.shadow.iter().enumerate() {
            self.device.peek(&mut bytes, sector as u64 * SECTOR_BYTES);
            match decode_sector(&bytes, sector as u64) {
                Ok(version) if allowed(shadow, version) => {}
                Ok(version) => {
                    let expected = if when == "at the end" {
                        shadow.expected_read()
                    } else {
                        shadow.expected_after_crash()
                    };
                    return Err(self.violation(
                        property_of(when),
                        format!(
                        "lost write {when}: sector {sector} holds version {version}, expected one \
                         of {expected:?}"
                    ),
                    ));
                }
                Err(garbage) => {
                    return Err(self.violation(
                        property_of(when),
                        format!("corrupt sector {when}: sector {sector} holds {garbage}"),
                    ))
                }
            }
        }
        Ok(())
    }

    /// With faults off: background work finishes, every handle's flush reports what it has
    /// not seen, a sync succeeds, and the disk holds the latest acknowledged data.
    fn finish(&mut self) -> Result<(), Violation> {
        if self.rescue.is_stale() {
            self.outage()?;
        }
        self.device
            .set_faults(FaultConfig::default(), self.rng.clone());
        self.drain_jobs();
        for client in 0..self.scenario.clients {
            for object in 0..self.scenario.regions.len() {
                self.flush(client, object)?;
            }
        }
        self.enter(self.client_accounts[0]);
        let result = self.cache.as_ref().expect("running").sync();
        self.leave();
        if let Err(error) = result {
            return Err(self.violation(
                property::AT_THE_END,
                format!("final sync failed with faults off: {error}"),
            ));
        }
        self.verify_disk(|shadow, version| shadow.readable(version), "at the end")
    }
}

/// The property a disk check `when` (`after a crash`, `at the end`) checks.
fn property_of(when: &str) -> &'static str {
    if when == "at the end" {
        property::AT_THE_END
    } else {
        property::DURABILITY
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sector_patterns_decode_to_their_version_and_catch_misplacement() {
        // Goal: the shadow's sector encoding is unambiguous. Method: encode, decode at the
        // right and at a wrong sector index.
        let mut bytes = vec![0u8; SECTOR_BYTES as usize];
        sector_pattern(7, 3, &mut bytes);
        assert_eq!(decode_sector(&bytes, 3), Ok(7));
        assert!(decode_sector(&bytes, 4).is_err());
        sector_pattern(0, 3, &mut bytes);
        assert_eq!(decode_sector(&bytes, 3), Ok(0));
    }
}
