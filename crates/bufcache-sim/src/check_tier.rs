//! `bufcache sim check --local-tier`: the persistent local tier (`bufcache-tier`) over two
//! simulated devices — a local one holding its log and a remote one — with seeded workloads,
//! remote faults, machine crashes and the loss of the whole local device, checked against a
//! shadow model of the tier's two promises (docs/local-tier.md, "Guarantees"):
//!
//! - **no acknowledged loss**: after a machine crash (both devices lose, keep or tear every
//!   write not yet flushed) and a reopen of the tier (log replay), every 512-byte sector reads
//!   as the last write acknowledged before the last acknowledged FLUSH covering it, or as
//!   something written after it;
//! - **remote prefix**: after every step, the remote alone holds the image after some prefix
//!   of epochs `1..=E`, plus possibly part of epoch `E + 1` (each sector of it holding a value
//!   written in `E + 1`); with `--flush-to remote`, `E` is at least the epoch closed by the
//!   last acknowledged FLUSH. An epoch is what the writes between two FLUSHes (or crashes)
//!   form; the tier may cut epochs finer (a fallback closes one), which the check allows:
//!   a finer prefix is still a coarse prefix plus part of the next coarse epoch.
//!
//! The tier runs with [`WritebackDriver::Caller`]: no write-back thread, no sleeping, no wall
//! clock; write-back runs one epoch per [`LocalTier::writeback_step`] at seeded moments (or
//! inside a flush or write that must wait for the remote), so a seed replays exactly. The
//! workload drives the tier directly, not through the engine's `Cache` above it: the engine
//! under `sim check` (check.rs) is checked on its own, and here the shadow must see exactly
//! which writes and flushes reach the tier to know its epochs. Layering the engine on top
//! (observing the tier through a recording device) is the next step.
//!
//! Each sector written carries its write's version and its own index (check.rs's pattern),
//! so a sector on the remote or read back names the write it came from.
//!
//! The remote stands for an S3 disk: the tier's superblock records the disk's identity
//! (`s3-disk:<id>`), and every reopen after a crash is a server restart that checks the
//! superblock as `serve` does (`bufcache_host::rescue::same_backend`, then the tier's own
//! check in `LocalTier::open`), with the URL's open-only parameters changed: the tier must
//! attach. At seeded restarts the tier is first presented to another disk at the same URL
//! (its prefix deleted and created again: a new id): both checks must refuse it, and the
//! refused start must leave the local device and the remote byte for byte as they were.
//! At other seeded restarts it is offered to another disk with its own identity (an NBD
//! upstream records none, so another disk served at the same address looks the same) that
//! holds other bytes everywhere: the tier's check, which compares sampled clean blocks with
//! the disk, must refuse it whenever the cache holds a clean block, changing nothing.

use std::io::{IoSlice, IoSliceMut};
use std::sync::{Arc, Mutex};

use bufcache::device::SeededRng;
use bufcache::Device;
use bufcache_check::{catching_panics, Notes, Step, Violation, RECENT_STEPS};
use bufcache_host::rescue::{s3_name_of_url, same_backend, BackendIdentity};
use bufcache_tier::format::{Superblock, LOCAL_BYTES_MIN, SUPERBLOCK_BYTES};
use bufcache_tier::{FlushTo, LocalTier, LocalTierConfig, WritebackDriver, WritebackStep};

use crate::check::{decode_sector, s3_identity, sector_pattern, CheckSummary, SeedOutcome};
use crate::clock::VirtualClock;
use crate::core::{FaultConfig, SharedRng, SimCore, SimDevice, SECTOR_BYTES};
use crate::disk::DiskSpec;
use crate::host::HostCosts;

/// Every byte of the other disk a restart offers the tier to (see
/// `offer_to_another_disk_with_our_identity`).
const OTHER_DISK_BYTE: u8 = 0xEE;
/// Steps of one seed's workload, at least and at most.
const STEPS_MIN: u64 = 150;
const STEPS_MAX: u64 = 400;
/// Mixed into the seed for the restarts' own random choices (URLs, other disks), so they do
/// not change the workload a seed draws.
const RESTART_SEED_MIX: u64 = 0x7265_7374_6172_7473;
/// The local device's name in errors.
const LOCAL_NAME: &str = "simulated local cache";

type Tier = LocalTier<Arc<SimDevice>, Arc<SimDevice>>;

/// The properties `sim check --local-tier` checks (module docs), as its violations name them.
pub mod property {
    /// A read returns the latest acknowledged data (or a failed write's attempt).
    pub const READS: &str = "reads";
    /// No acknowledged loss: after a crash every sector holds what the last covering FLUSH
    /// promised, or newer.
    pub const DURABILITY: &str = "durability";
    /// The remote alone is an epoch prefix of what the tier acknowledged.
    pub const REMOTE_PREFIX: &str = "remote prefix";
    /// A restart attaches the tier to its own disk only, changing nothing when it refuses.
    pub const IDENTITY: &str = "disk identity";
    /// With faults off at the end, a drain leaves the remote holding the latest data.
    pub const AT_THE_END: &str = "at the end";
}

/// Runs seeds `first_seed .. first_seed + seeds` of the local-tier check, calling `on_seed`
/// after each.
pub fn check_tier_seeds(
    first_seed: u64,
    seeds: u64,
    on_seed: impl FnMut(u64, &SeedOutcome),
) -> CheckSummary {
    bufcache_check::check_seeds(
        first_seed,
        seeds,
        |seed| check_tier_seed_traced(seed, false),
        on_seed,
    )
}

/// Runs one seed of the local-tier check, printing every step to standard error when `trace`
/// is set. A panic (of the tier or the harness) is a violation too.
pub fn check_tier_seed_traced(seed: u64, trace: bool) -> SeedOutcome {
    let mut outcome = SeedOutcome::default();
    let mut run = || {
        catching_panics(seed, "the local tier", || {
            let mut harness = Harness::new(seed, trace);
            let result = harness.run();
            outcome.steps = harness.steps;
            outcome.crashes = harness.crashes;
            let counts = harness.remote.fault_counts();
            outcome.device_faults = counts.read_errors + counts.write_errors + counts.flush_errors;
            outcome.wrong_disk_refusals = harness.wrong_disk_refusals;
            result
        })
    };
    // The tier warns of every fallback and failed write-back, which the faults make common:
    // only a traced run shows them.
    let violation = if trace {
        run()
    } else {
        tracing::subscriber::with_default(tracing::subscriber::NoSubscriber::default(), run)
    };
    outcome.violation = violation;
    outcome
}

/// One write that reached a sector: its version (0: zeroes), the epoch it joined, and
/// whether the tier acknowledged it.
#[derive(Clone, Copy, Debug)]
struct Version {
    version: u64,
    epoch: u64,
    acknowledged: bool,
}

/// The shadow of one sector: every version written to it, in order, and the index of the
/// one an acknowledged FLUSH made durable (the floor).
#[derive(Clone, Debug)]
struct History {
    versions: Vec<Version>,
    floor: usize,
}

impl History {
    /// A sector known to hold `version`, durably (at the start, after a crash or a loss).
    fn known(version: u64) -> Self {
        History {
            versions: vec![Version {
                version,
                epoch: 0,
                acknowledged: true,
            }],
            floor: 0,
        }
    }

    /// Index of the latest acknowledged version.
    fn latest(&self) -> usize {
        self.versions
            .iter()
            .rposition(|v| v.acknowledged)
            .expect("the first version is acknowledged")
    }

    /// A read may return the latest acknowledged version or anything attempted after it.
    fn readable(&self, version: u64) -> bool {
        self.versions[self.latest()..]
            .iter()
            .any(|v| v.version == version)
    }

    /// After a crash: the floor's version or anything after it.
    fn survives(&self, version: u64) -> bool {
        self.versions[self.floor..]
            .iter()
            .any(|v| v.version == version)
    }

    /// The remote may hold, after epochs `1..=done` and part of `done + 1`: the last version
    /// acknowledged in an epoch up to `done`, or any version after it of an epoch up to
    /// `done + 1` (unacknowledged ones included: a failed write may have landed in part).
    fn remote_allows(&self, version: u64, done: u64) -> bool {
        let base = self
            .versions
            .iter()
            .rposition(|v| v.acknowledged && v.epoch <= done)
            .expect("the first version is of epoch 0, acknowledged");
        self.versions[base..]
            .iter()
            .any(|v| v.version == version && v.epoch <= done + 1)
    }

    fn after_crash(&self) -> Vec<u64> {
        self.versions[self.floor..]
            .iter()
            .map(|v| v.version)
            .collect()
    }

    fn for_read(&self) -> Vec<u64> {
        self.versions[self.latest()..]
            .iter()
            .map(|v| v.version)
            .collect()
    }

    /// After a crash the sector reads as `version` (one [`History::survives`] allows): the
    /// writes after it are gone, and it is durable now.
    fn settle(&mut self, version: u64) {
        let at = self.floor
            + self.versions[self.floor..]
                .iter()
                .rposition(|v| v.version == version)
                .expect("checked by survives");
        self.versions.truncate(at + 1);
        self.versions[at].acknowledged = true;
        self.floor = at;
    }
}

/// The seeded shape of one run.
struct Scenario {
    config: LocalTierConfig,
    backend_bytes: u64,
    local_bytes: u64,
    steps: u64,
    faults: FaultConfig,
    crash_per_mille: u64,
    loss_per_mille: u64,
}

impl Scenario {
    fn draw(rng: &mut SeededRng) -> Scenario {
        let block: u64 = if rng.below(4) == 0 { 512 } else { 4096 };
        let blocks = 16 + rng.below(65);
        let config = LocalTierConfig {
            block_bytes: block as u32,
            flush_to: if rng.below(2) == 0 {
                FlushTo::Local
            } else {
                FlushTo::Remote
            },
            record_bytes_max: block * (1 + rng.below(4)),
            writeback_requests_in_flight_max: 1 + rng.below(4) as usize,
            writeback_run_bytes_max: block * (1 + rng.below(8)),
            writeback_attempts_max: 1 + rng.below(3) as u32,
            // Longer zeroings go straight to the remote after an invalidation record.
            zero_record_bytes_max: block * (1 + rng.below(8)),
            writeback_driver: WritebackDriver::Caller,
            ..LocalTierConfig::default()
        };
        // The smallest logs hold some 64 records of 4 KiB: they fill, wrap and fall back.
        let local_bytes = LOCAL_BYTES_MIN + rng.below(65) * 4096;
        let faults = if rng.below(4) != 0 {
            let percent = |rng: &mut SeededRng, max: u64| rng.below(max + 1) as f64 / 100.0;
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
        Scenario {
            config,
            backend_bytes: blocks * block,
            local_bytes,
            steps: STEPS_MIN + rng.below(STEPS_MAX - STEPS_MIN + 1),
            faults,
            crash_per_mille: rng.below(16),
            loss_per_mille: rng.below(6),
        }
    }

    fn describe(&self) -> String {
        let c = &self.config;
        format!(
            "remote {} KiB, local {} KiB, block {} B, flush-to {:?}, record {} KiB, \
             write-back {} in flight / runs of {} KiB / {} attempts, zero records up to {} KiB, \
             remote faults r{}/w{}/f{}, crashes {}/1000, local losses {}/1000",
            self.backend_bytes / 1024,
            self.local_bytes / 1024,
            c.block_bytes,
            c.flush_to,
            c.record_bytes_max / 1024,
            c.writeback_requests_in_flight_max,
            c.writeback_run_bytes_max / 1024,
            c.writeback_attempts_max,
            c.zero_record_bytes_max / 1024,
            self.faults.read_error_probability,
            self.faults.write_error_probability,
            self.faults.flush_error_probability,
            self.crash_per_mille,
            self.loss_per_mille,
        )
    }
}

/// The tier and its two simulated devices for one seed.
struct Harness {
    rng: SharedRng,
    scenario: Scenario,
    core: Arc<SimCore>,
    local: Arc<SimDevice>,
    remote: Arc<SimDevice>,
    tier: Option<Tier>,
    /// One per sector of the remote.
    shadow: Vec<History>,
    /// The epoch writes join now; a FLUSH (or a crash) closes it.
    epoch: u64,
    /// With `--flush-to remote`: the epoch the last acknowledged FLUSH closed.
    remote_epoch_required: u64,
    /// The last `E` the remote matched (the search starts there).
    remote_epoch_seen: u64,
    next_version: u64,
    steps: u64,
    crashes: u64,
    /// Every step, the last ones kept for a violation's report (printed when tracing).
    notes: Notes,
    seed: u64,
    /// The restarts' own choices (URLs, other disks), apart from the workload's.
    restart_rng: SeededRng,
    /// The identity of the remote's disk, recorded in the tier's superblock.
    disk_identity: String,
    /// Restarts that presented the tier to another disk (and were refused).
    wrong_disk_refusals: u64,
}

impl Harness {
    fn new(seed: u64, trace: bool) -> Harness {
        let mut rng = SeededRng::new(seed);
        let scenario = Scenario::draw(&mut rng);
        let rng: SharedRng = Arc::new(Mutex::new(rng));
        let mut restart_rng = SeededRng::new(seed ^ RESTART_SEED_MIX);
        let disk_identity = s3_identity(restart_rng.next_u64());
        let host = HostCosts::preset("modern").expect("the modern preset exists");
        let core = Arc::new(SimCore::new(
            DiskSpec::nvme().build(),
            host,
            Arc::new(VirtualClock::new()),
        ));
        let account = core.add_account("tier");
        core.enter(account, 0);
        let remote = Arc::new(SimDevice::new(
            core.clone(),
            scenario.backend_bytes,
            "simulated remote",
        ));
        remote.track_crashes();
        let local = Harness::new_local(&core, &scenario);
        let tier = LocalTier::create(
            local.clone(),
            LOCAL_NAME.to_string(),
            remote.clone(),
            &disk_identity,
            scenario.config.clone(),
        )
        .expect("the scenario's tier is valid");
        remote.set_faults(scenario.faults.clone(), rng.clone());
        let sectors = (scenario.backend_bytes / SECTOR_BYTES) as usize;
        Harness {
            rng,
            core,
            local,
            remote,
            tier: Some(tier),
            shadow: vec![History::known(0); sectors],
            epoch: 1,
            remote_epoch_required: 0,
            remote_epoch_seen: 0,
            next_version: 1,
            steps: 0,
            crashes: 0,
            notes: Notes::new(RECENT_STEPS, trace),
            seed,
            restart_rng,
            disk_identity,
            wrong_disk_refusals: 0,
            scenario,
        }
    }

    /// A fresh local device (all zeroes) that loses unflushed writes in a crash.
    fn new_local(core: &Arc<SimCore>, scenario: &Scenario) -> Arc<SimDevice> {
        let local = Arc::new(SimDevice::new(
            core.clone(),
            scenario.local_bytes,
            "simulated local cache",
        ));
        local.track_crashes();
        local
    }

    fn tier(&self) -> &Tier {
        self.tier.as_ref().expect("the tier is open between steps")
    }

    fn draw(&self, bound: u64) -> u64 {
        self.rng
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .below(bound)
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

    /// A random sector-aligned range: mostly whole blocks, sometimes any sectors (the tier's
    /// read-modify-write of partial blocks). Returns (offset, length) in bytes.
    fn draw_range(&self, blocks_max: u64) -> (u64, u64) {
        let sectors = self.scenario.backend_bytes / SECTOR_BYTES;
        let per_block = u64::from(self.scenario.config.block_bytes) / SECTOR_BYTES;
        let start = self.draw(sectors);
        let (start, count) = if self.draw(3) != 0 {
            let start = start / per_block * per_block;
            (start, per_block * (1 + self.draw(blocks_max)))
        } else {
            (start, 1 + self.draw(per_block * blocks_max))
        };
        let count = count.min(sectors - start);
        (start * SECTOR_BYTES, count * SECTOR_BYTES)
    }

    fn run(&mut self) -> Result<(), Violation> {
        for _ in 0..self.scenario.steps {
            self.step()?;
            self.check_remote("after the step")?;
        }
        self.finish()
    }

    fn step(&mut self) -> Result<(), Violation> {
        self.steps += 1;
        let accident = self.draw(1000);
        if accident < self.scenario.crash_per_mille {
            return self.crash();
        }
        if accident < self.scenario.crash_per_mille + self.scenario.loss_per_mille {
            return self.lose_local();
        }
        match self.draw(100) {
            0..=34 => {
                self.write();
                Ok(())
            }
            35..=54 => self.read(),
            55..=59 => {
                self.zeroes();
                Ok(())
            }
            60..=63 => {
                self.discard();
                Ok(())
            }
            64..=77 => {
                self.flush();
                Ok(())
            }
            78..=89 => {
                // Several steps at once, so closed epochs pile up between them (a planted
                // newest-first write-back needs two to show).
                let steps = 1 + self.draw(3);
                for _ in 0..steps {
                    self.writeback_step();
                    self.check_remote("after a write-back step")?;
                }
                Ok(())
            }
            _ => {
                self.write();
                Ok(())
            }
        }
    }

    /// Records a write of `version` over the sectors in the current epoch.
    fn record(&mut self, offset: u64, length: u64, version: u64, acknowledged: bool) {
        let first = offset / SECTOR_BYTES;
        for sector in first..first + length / SECTOR_BYTES {
            self.shadow[sector as usize].versions.push(Version {
                version,
                epoch: self.epoch,
                acknowledged,
            });
        }
    }

    fn write(&mut self) {
        let (offset, length) = self.draw_range(4);
        let version = self.next_version;
        self.next_version += 1;
        let first = offset / SECTOR_BYTES;
        let mut data = vec![0u8; length as usize];
        for (index, piece) in data.chunks_mut(SECTOR_BYTES as usize).enumerate() {
            sector_pattern(version, first + index as u64, piece);
        }
        let result = self
            .tier()
            .write_vectored_at(&[IoSlice::new(&data)], offset);
        self.record(offset, length, version, result.is_ok());
        self.note(format!(
            "write v{version} [{offset}, +{length}) epoch {} -> {}",
            self.epoch,
            outcome(&result)
        ));
    }

    fn zeroes(&mut self) {
        let (offset, length) = self.draw_range(12);
        let result = self.tier().write_zeroes(offset, length);
        self.record(offset, length, 0, result.is_ok());
        self.note(format!(
            "zeroes [{offset}, +{length}) epoch {} -> {}",
            self.epoch,
            outcome(&result)
        ));
    }

    fn discard(&mut self) {
        let (offset, length) = self.draw_range(12);
        let result = self.tier().discard(offset, length);
        // Advisory: the old data or zeroes may be read afterwards.
        self.record(offset, length, 0, false);
        self.note(format!(
            "discard [{offset}, +{length}) epoch {} -> {}",
            self.epoch,
            outcome(&result)
        ));
    }

    fn read(&mut self) -> Result<(), Violation> {
        let (offset, length) = self.draw_range(8);
        let mut data = vec![0u8; length as usize];
        let result = self
            .tier()
            .read_vectored_at(&mut [IoSliceMut::new(&mut data)], offset);
        self.note(format!(
            "read [{offset}, +{length}) -> {}",
            outcome(&result)
        ));
        if result.is_err() {
            return Ok(());
        }
        self.check_read(offset, &data, "read")
    }

    /// Every sector of `data` (read at `offset`) is the latest acknowledged version or one
    /// attempted after it.
    fn check_read(&self, offset: u64, data: &[u8], what: &str) -> Result<(), Violation> {
        let first = offset / SECTOR_BYTES;
        for (index, bytes) in data.chunks(SECTOR_BYTES as usize).enumerate() {
            let sector = first + index as u64;
            let shadow = &self.shadow[sector as usize];
            match decode_sector(bytes, sector) {
                Ok(version) if shadow.readable(version) => {}
                Ok(version) => {
                    return Err(self.violation(
                        property::READS,
                        format!(
                        "stale {what}: sector {sector} read as version {version}, expected one \
                         of {:?}",
                        shadow.for_read()
                    ),
                    ))
                }
                Err(garbage) => {
                    return Err(self.violation(
                        property::READS,
                        format!("corrupt {what}: sector {sector} holds {garbage}"),
                    ))
                }
            }
        }
        Ok(())
    }

    fn flush(&mut self) {
        let result = self.tier().flush();
        let closed = self.epoch;
        self.epoch += 1;
        if result.is_ok() {
            for shadow in &mut self.shadow {
                shadow.floor = shadow.latest();
            }
            if self.scenario.config.flush_to == FlushTo::Remote {
                self.remote_epoch_required = closed;
            }
        }
        self.note(format!(
            "flush closes epoch {closed} -> {}",
            outcome(&result)
        ));
    }

    fn writeback_step(&mut self) {
        let step = self.tier().writeback_step();
        self.note(match step {
            WritebackStep::Idle => "write-back step: idle".to_string(),
            WritebackStep::Wrote { epoch } => format!("write-back step: tier epoch {epoch}"),
            WritebackStep::Failed { epoch, error } => {
                format!("write-back step: tier epoch {epoch} failed ({error})")
            }
        });
    }

    /// The remote alone is the image after epochs `1..=E` and part of `E + 1`, for some `E`
    /// no lower than what an acknowledged `--flush-to remote` FLUSH requires.
    fn check_remote(&mut self, when: &str) -> Result<(), Violation> {
        let mut versions = Vec::with_capacity(self.shadow.len());
        let mut bytes = vec![0u8; SECTOR_BYTES as usize];
        for sector in 0..self.shadow.len() as u64 {
            self.remote.peek(&mut bytes, sector * SECTOR_BYTES);
            match decode_sector(&bytes, sector) {
                Ok(version) => versions.push(version),
                Err(garbage) => {
                    return Err(self.violation(
                        property::REMOTE_PREFIX,
                        format!("corrupt remote {when}: sector {sector} holds {garbage}"),
                    ))
                }
            }
        }
        let matches = |done: u64| {
            self.shadow
                .iter()
                .zip(&versions)
                .all(|(shadow, &version)| shadow.remote_allows(version, done))
        };
        let low = self.remote_epoch_required;
        let first_guess = self.remote_epoch_seen.max(low);
        let found = (first_guess..=self.epoch)
            .chain(low..first_guess)
            .find(|&done| matches(done));
        match found {
            Some(done) => {
                self.remote_epoch_seen = done;
                Ok(())
            }
            None => {
                // Name the first sector that rules out the lowest candidate and the last one.
                let blame = |done: u64| {
                    self.shadow
                        .iter()
                        .zip(&versions)
                        .enumerate()
                        .find(|(_, (shadow, &version))| !shadow.remote_allows(version, done))
                        .map(|(sector, (shadow, &version))| {
                            let written: Vec<(u64, u64)> = shadow
                                .versions
                                .iter()
                                .map(|v| (v.version, v.epoch))
                                .collect();
                            format!(
                                "with E = {done}, sector {sector} holds version {version} \
                                 (versions, epochs written: {written:?})"
                            )
                        })
                        .unwrap_or_default()
                };
                if self.notes.tracing() {
                    for done in low..=self.epoch {
                        eprintln!("  E = {done}: {}", blame(done));
                    }
                    for (sector, shadow) in self.shadow.iter().enumerate() {
                        eprintln!(
                            "  sector {sector}: remote {} floor {} {:?}",
                            versions[sector], shadow.floor, shadow.versions
                        );
                    }
                }
                Err(self.violation(
                    property::REMOTE_PREFIX,
                    format!(
                        "remote not an epoch prefix {when}: no E from {low} to {} fits; {}; {}",
                        self.epoch,
                        blame(low),
                        blame(self.epoch)
                    ),
                ))
            }
        }
    }

    /// A restart's check of the local cache, as `serve` makes it before anything is written:
    /// the URL respelled with open-only parameters (`break-lock=`, `retry-timeout-ms=`, ...)
    /// must still name the disk the superblock records; at seeded restarts the cache is first
    /// presented to another disk at the same URL, which both `serve`'s check and the tier's
    /// must refuse without changing either device. Returns the disk's identity to open with.
    fn restart_identity(&mut self) -> Result<BackendIdentity, Violation> {
        let mut url = "s3://sim-bucket/disk".to_string();
        if self.restart_rng.below(2) == 0 {
            url.push('/');
        }
        let mut separator = '?';
        for parameter in [
            "break-lock",
            "retry-timeout-ms",
            "create-size",
            "lock",
            "gc",
        ] {
            if self.restart_rng.below(2) == 0 {
                let value = self.restart_rng.below(1000);
                url.push_str(&format!("{separator}{parameter}={value}"));
                separator = '&';
            }
        }
        let name = s3_name_of_url(&url).expect("an s3:// URL");
        let mut first = vec![0u8; SUPERBLOCK_BYTES as usize];
        self.local.peek(&mut first, 0);
        let recorded = Superblock::decode(&first)
            .map_err(|problem| {
                self.violation(
                    property::IDENTITY,
                    format!("the tier's superblock after a crash: {problem:?}"),
                )
            })?
            .identity;
        if self.restart_rng.below(4) == 0 {
            let other = BackendIdentity {
                identity: s3_identity(self.restart_rng.next_u64()),
                name: name.clone(),
                state: None,
            };
            let snapshot = |device: &SimDevice| {
                let mut bytes = vec![0u8; device.len_bytes() as usize];
                device.peek(&mut bytes, 0);
                bytes
            };
            let before = (snapshot(&self.local), snapshot(&self.remote));
            if same_backend(&recorded, &other) {
                return Err(self.violation(
                    property::IDENTITY,
                    format!(
                        "a local cache of {recorded} attached to another disk {} at {url}",
                        other.identity
                    ),
                ));
            }
            let opened = LocalTier::open(
                self.local.clone(),
                LOCAL_NAME.to_string(),
                self.remote.clone(),
                &other.identity,
                self.scenario.config.clone(),
            );
            if opened.is_ok() {
                return Err(self.violation(
                    property::IDENTITY,
                    format!(
                        "the tier opened for another disk {} (it records {recorded})",
                        other.identity
                    ),
                ));
            }
            if (snapshot(&self.local), snapshot(&self.remote)) != before {
                return Err(self.violation(
                    property::IDENTITY,
                    format!(
                        "a refused attach to another disk {} changed the local cache or the remote",
                        other.identity
                    ),
                ));
            }
            self.wrong_disk_refusals += 1;
            self.note(format!(
                "restart on another disk {} at {url}: refused",
                other.identity
            ));
        }
        if self.restart_rng.below(4) == 0 {
            self.offer_to_another_disk_with_our_identity(&recorded)?;
        }
        let ours = BackendIdentity {
            identity: self.disk_identity.clone(),
            name,
            state: None,
        };
        if !same_backend(&recorded, &ours) {
            return Err(self.violation(
                property::IDENTITY,
                format!(
                    "the local cache of {recorded} refused at a restart with {url} (disk {})",
                    ours.identity
                ),
            ));
        }
        self.note(format!("restart with {url}"));
        Ok(ours)
    }

    /// Offers the tier to another disk that has its identity (an NBD upstream records none:
    /// another disk served at the same address) and holds other bytes everywhere. The
    /// tier's check must refuse it whenever the cache holds a clean block (sampled against
    /// the disk, none can match), and must change neither the local device nor that disk.
    fn offer_to_another_disk_with_our_identity(&mut self, recorded: &str) -> Result<(), Violation> {
        let other = Arc::new(SimDevice::new(
            self.core.clone(),
            self.scenario.backend_bytes,
            "another disk at the same address",
        ));
        // No sector the workload writes (each names its write) nor a never-written one
        // (zeroes) reads like this.
        let fill = vec![OTHER_DISK_BYTE; self.scenario.backend_bytes as usize];
        other
            .write_vectored_at(&[IoSlice::new(&fill)], 0)
            .and_then(|()| other.flush())
            .map_err(|error| {
                self.violation(property::IDENTITY, format!("filling another disk: {error}"))
            })?;
        let snapshot = |device: &SimDevice| {
            let mut bytes = vec![0u8; device.len_bytes() as usize];
            device.peek(&mut bytes, 0);
            bytes
        };
        let before = (snapshot(&self.local), snapshot(&other));
        let checked = LocalTier::check(
            self.local.clone(),
            LOCAL_NAME.to_string(),
            other.clone(),
            recorded,
            self.scenario.config.clone(),
        );
        if (snapshot(&self.local), snapshot(&other)) != before {
            return Err(self.violation(
                property::IDENTITY,
                "offering the tier to another disk with its identity changed the local cache or \
                 that disk"
                    .to_string(),
            ));
        }
        match checked {
            Err(bufcache_tier::TierError::OtherContent { .. }) => {
                self.wrong_disk_refusals += 1;
                self.note("offered to another disk with our identity: refused by its content".to_string());
                Ok(())
            }
            Ok(0) => {
                self.note("offered to another disk with our identity: no clean block to compare".to_string());
                Ok(())
            }
            Ok(sampled) => Err(self.violation(property::IDENTITY, format!(
                "the tier's {sampled} sampled clean blocks matched another disk that differs everywhere"
            ))),
            Err(error) => Err(self.violation(property::IDENTITY, format!(
                "offering the tier to another disk with its identity: {error}"
            ))),
        }
    }

    /// Power fails: both devices keep, lose or tear their unflushed writes; the tier reopens
    /// over them and replays its log; every sector must then read as a flushed write or a
    /// later one, and the remote must be a prefix of what survived.
    fn crash(&mut self) -> Result<(), Violation> {
        self.crashes += 1;
        self.note("crash".to_string());
        let local = self.local.crash(&self.rng);
        let remote = self.remote.crash(&self.rng);
        self.tier = None;
        self.local.restart();
        self.remote.restart();
        self.epoch += 1;
        self.note(format!(
            "restart (local: {} unflushed writes kept, {} lost, {} torn; remote: {} kept, {} \
             lost, {} torn)",
            local.writes_kept,
            local.writes_lost,
            local.writes_torn,
            remote.writes_kept,
            remote.writes_lost,
            remote.writes_torn
        ));
        let ours = self.restart_identity()?;
        let tier = LocalTier::open(
            self.local.clone(),
            LOCAL_NAME.to_string(),
            self.remote.clone(),
            &ours.identity,
            self.scenario.config.clone(),
        )
        .map_err(|error| {
            self.violation(
                property::DURABILITY,
                format!("reopening the tier after a crash: {error}"),
            )
        })?;
        self.tier = Some(tier);
        // Everything is read back with the remote's faults off: a read error here would hide
        // what the tier serves.
        self.remote
            .set_faults(FaultConfig::default(), self.rng.clone());
        let mut image = vec![0u8; self.scenario.backend_bytes as usize];
        let read = self
            .tier()
            .read_vectored_at(&mut [IoSliceMut::new(&mut image)], 0);
        self.remote
            .set_faults(self.scenario.faults.clone(), self.rng.clone());
        read.map_err(|error| {
            self.violation(
                property::DURABILITY,
                format!("reading the tier after a crash failed with faults off: {error}"),
            )
        })?;
        for (sector, bytes) in image.chunks(SECTOR_BYTES as usize).enumerate() {
            let shadow = &self.shadow[sector];
            match decode_sector(bytes, sector as u64) {
                Ok(version) if shadow.survives(version) => {}
                Ok(version) => {
                    return Err(self.violation(
                        property::DURABILITY,
                        format!(
                        "lost write after a crash: sector {sector} reads as version {version}, \
                         expected one of {:?}",
                        shadow.after_crash()
                    ),
                    ))
                }
                Err(garbage) => {
                    return Err(self.violation(
                        property::DURABILITY,
                        format!("corrupt sector after a crash: sector {sector} holds {garbage}"),
                    ))
                }
            }
        }
        // What the tier serves now is all there is: writes lost with the log are gone.
        for (sector, bytes) in image.chunks(SECTOR_BYTES as usize).enumerate() {
            let version = decode_sector(bytes, sector as u64).expect("decoded above");
            self.shadow[sector].settle(version);
        }
        self.check_remote("after a crash")
    }

    /// The machine crashes and the local device is gone: the remote alone must be an epoch
    /// prefix. The tier then starts over with a new, empty local device.
    fn lose_local(&mut self) -> Result<(), Violation> {
        self.crashes += 1;
        self.note("crash losing the local device".to_string());
        self.remote.crash(&self.rng);
        self.tier = None;
        self.remote.restart();
        self.check_remote("after the loss of the local device")?;
        self.local = Harness::new_local(&self.core, &self.scenario);
        self.remote
            .set_faults(FaultConfig::default(), self.rng.clone());
        let tier = LocalTier::create(
            self.local.clone(),
            LOCAL_NAME.to_string(),
            self.remote.clone(),
            &self.disk_identity,
            self.scenario.config.clone(),
        );
        self.remote
            .set_faults(self.scenario.faults.clone(), self.rng.clone());
        let tier = tier.map_err(|error| {
            self.violation(
                property::DURABILITY,
                format!("creating a tier on a new local device: {error}"),
            )
        })?;
        self.tier = Some(tier);
        // The remote is all there is now.
        let mut bytes = vec![0u8; SECTOR_BYTES as usize];
        for sector in 0..self.shadow.len() {
            self.remote.peek(&mut bytes, sector as u64 * SECTOR_BYTES);
            let version = decode_sector(&bytes, sector as u64).expect("checked above");
            self.shadow[sector] = History::known(version);
        }
        self.epoch += 1;
        self.remote_epoch_required = 0;
        self.remote_epoch_seen = 0;
        self.note("new local device".to_string());
        Ok(())
    }

    /// With faults off: a drain puts every logged write on the remote, which must then hold
    /// the latest acknowledged image, and the tier must read it back.
    fn finish(&mut self) -> Result<(), Violation> {
        self.remote
            .set_faults(FaultConfig::default(), self.rng.clone());
        let result = self.tier().drain();
        self.note(format!("drain -> {}", outcome(&result)));
        if let Err(error) = result {
            return Err(self.violation(
                property::AT_THE_END,
                format!("drain failed with faults off: {error}"),
            ));
        }
        let mut bytes = vec![0u8; SECTOR_BYTES as usize];
        for (sector, shadow) in self.shadow.iter().enumerate() {
            self.remote.peek(&mut bytes, sector as u64 * SECTOR_BYTES);
            match decode_sector(&bytes, sector as u64) {
                Ok(version) if shadow.readable(version) => {}
                Ok(version) => {
                    return Err(self.violation(
                        property::AT_THE_END,
                        format!(
                        "remote behind after a drain: sector {sector} holds version {version}, \
                         expected one of {:?}",
                        shadow.for_read()
                    ),
                    ))
                }
                Err(garbage) => {
                    return Err(self.violation(
                        property::AT_THE_END,
                        format!("corrupt remote after a drain: sector {sector} holds {garbage}"),
                    ))
                }
            }
        }
        let mut image = vec![0u8; self.scenario.backend_bytes as usize];
        self.tier()
            .read_vectored_at(&mut [IoSliceMut::new(&mut image)], 0)
            .map_err(|error| {
                self.violation(
                    property::AT_THE_END,
                    format!("final read failed with faults off: {error}"),
                )
            })?;
        self.check_read(0, &image, "final read")
    }
}

fn outcome<T>(result: &std::io::Result<T>) -> &'static str {
    if result.is_ok() {
        "ok"
    } else {
        "error"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_remote_prefix_rule_allows_a_partial_next_epoch_and_refuses_a_skipped_one() {
        // Goal: the shadow's remote rule is the guarantee, no weaker and no stronger. Method:
        // a sector written in epochs 1 and 3; check which versions each E allows.
        let mut shadow = History::known(0);
        for (version, epoch) in [(1, 1), (2, 3)] {
            shadow.versions.push(Version {
                version,
                epoch,
                acknowledged: true,
            });
        }
        assert!(shadow.remote_allows(0, 0));
        assert!(shadow.remote_allows(1, 0));
        assert!(!shadow.remote_allows(2, 0));
        assert!(!shadow.remote_allows(0, 1));
        assert!(shadow.remote_allows(1, 2));
        assert!(shadow.remote_allows(2, 2));
        assert!(!shadow.remote_allows(1, 3));
    }
}
