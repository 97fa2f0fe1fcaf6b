//! The local tier against a shadow model, over crash-simulating local and remote devices.

use std::io::{IoSlice, IoSliceMut};
use std::sync::Arc;
use std::time::Duration;

use bufcache_device::{CrashDevice, CrashMode, Device, MemoryDevice, SeededRng};
use bufcache_tier::format::LOCAL_BYTES_MIN;
use bufcache_tier::{FlushTo, LocalTier, LocalTierConfig, TierError};

const BLOCK: u64 = 4096;
const SECTOR: u64 = 512;
const BACKEND_BYTES: u64 = 64 * BLOCK;
const IDENTITY: &str = "file:/srv/test.img";

type Tier = LocalTier<Arc<CrashDevice>, Arc<CrashDevice>>;

fn config(flush_to: FlushTo) -> LocalTierConfig {
    LocalTierConfig {
        flush_to,
        record_bytes_max: 4 * BLOCK,
        writeback_run_bytes_max: 2 * BLOCK,
        writeback_requests_in_flight_max: 3,
        writeback_attempts_max: 2,
        writeback_retry_delay_initial: Duration::from_millis(1),
        writeback_retry_delay_max: Duration::from_millis(5),
        zero_record_bytes_max: 8 * BLOCK,
        ..LocalTierConfig::default()
    }
}

fn read(device: &impl Device, offset: u64, length: u64) -> std::io::Result<Vec<u8>> {
    let mut data = vec![0u8; length as usize];
    device.read_vectored_at(&mut [IoSliceMut::new(&mut data)], offset)?;
    Ok(data)
}

fn write(device: &impl Device, offset: u64, data: &[u8]) -> std::io::Result<()> {
    device.write_vectored_at(&[IoSlice::new(data)], offset)
}

/// What the disk looked like at the start of a flush interval, and every write since, in
/// order, as the whole blocks each left behind.
struct Interval {
    start: Vec<u8>,
    writes: Vec<Vec<(u64, Vec<u8>)>>,
}

/// The shadow: the image clients see, and the flush intervals so far.
struct Model {
    image: Vec<u8>,
    intervals: Vec<Interval>,
    /// The index of the first interval whose start every acknowledged flush covers.
    acknowledged: usize,
}

impl Model {
    fn new(image: Vec<u8>) -> Self {
        Model {
            intervals: vec![Interval {
                start: image.clone(),
                writes: Vec::new(),
            }],
            image,
            acknowledged: 0,
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        self.image[offset as usize..offset as usize + data.len()].copy_from_slice(data);
        let first = offset / BLOCK;
        let last = (offset + data.len() as u64).div_ceil(BLOCK);
        let blocks = (first..last)
            .map(|block| {
                let at = (block * BLOCK) as usize;
                (block, self.image[at..at + BLOCK as usize].to_vec())
            })
            .collect();
        self.intervals.last_mut().unwrap().writes.push(blocks);
    }

    /// A flush was acknowledged: a new interval starts.
    fn flushed(&mut self) {
        self.intervals.push(Interval {
            start: self.image.clone(),
            writes: Vec::new(),
        });
        self.acknowledged = self.intervals.len() - 1;
    }

    /// After a crash the tier shows `recovered`: it must be the last interval's start with a
    /// prefix of its writes applied. The model continues from there.
    fn recovered(&mut self, recovered: &[u8], seed: u64) {
        let interval = self.intervals.last_mut().unwrap();
        let mut state = interval.start.clone();
        let mut kept = None;
        for count in 0..=interval.writes.len() {
            if count > 0 {
                for (block, data) in &interval.writes[count - 1] {
                    let at = (*block * BLOCK) as usize;
                    state[at..at + BLOCK as usize].copy_from_slice(data);
                }
            }
            if state == recovered {
                kept = Some(count);
            }
        }
        let kept = kept.unwrap_or_else(|| {
            panic!(
                "seed {seed}: after a crash the tier shows neither the last flushed image nor \
                 that image with a prefix of the {} writes after it",
                interval.writes.len()
            )
        });
        interval.writes.truncate(kept);
        self.image = recovered.to_vec();
        // A new interval from what was recovered; the acknowledged one stays what it was
        // (the replayed writes are not on the remote yet).
        self.intervals.push(Interval {
            start: self.image.clone(),
            writes: Vec::new(),
        });
    }

    /// True when `remote` holds, for some interval `i` at or after the last acknowledged
    /// (when `flushed_only`), interval i's start with, per block, at most one of the values
    /// interval i's writes gave it: a prefix at epoch granularity (epochs never span
    /// flushes; write-through may split an interval into several, which this allows).
    fn is_epoch_prefix(&self, remote: &[u8], from: usize) -> bool {
        let found = self.epoch_prefix_at(remote, from);
        if !found {
            self.explain(remote, from);
        }
        found
    }

    /// Prints, per interval, the sectors that keep the remote from matching it.
    fn explain(&self, remote: &[u8], from: usize) {
        for index in from..self.intervals.len() {
            let wrong: Vec<u64> = (0..BACKEND_BYTES / SECTOR)
                .filter(|&sector| !self.sector_fits(index, remote, sector))
                .collect();
            eprintln!("interval {index}: sectors off {wrong:?}");
        }
    }

    /// True when `remote`'s sector holds interval `index`'s start or a value one of its
    /// writes gave that sector. Sectors, not blocks: an unflushed remote write may be torn
    /// at sector granularity (CrashMode::TornSectors), which no device promises against.
    fn sector_fits(&self, index: usize, remote: &[u8], sector: u64) -> bool {
        let interval = &self.intervals[index];
        let at = (sector * SECTOR) as usize;
        let held = &remote[at..at + SECTOR as usize];
        let block = sector * SECTOR / BLOCK;
        let within = (sector * SECTOR % BLOCK) as usize;
        held == &interval.start[at..at + SECTOR as usize]
            || interval.writes.iter().flatten().any(|(written, data)| {
                *written == block && held == &data[within..within + SECTOR as usize]
            })
    }

    fn epoch_prefix_at(&self, remote: &[u8], from: usize) -> bool {
        (from..self.intervals.len()).any(|index| {
            (0..BACKEND_BYTES / SECTOR).all(|sector| self.sector_fits(index, remote, sector))
        })
    }
}

fn random_write(random: &mut SeededRng) -> (u64, Vec<u8>) {
    let offset = if random.chance(0.3) {
        random.below(BACKEND_BYTES - 3 * BLOCK)
    } else {
        random.below(BACKEND_BYTES / BLOCK - 3) * BLOCK
    };
    let length = if random.chance(0.3) {
        1 + random.below(3 * BLOCK)
    } else {
        BLOCK * (1 + random.below(3))
    };
    let value = random.next_u64() as u8;
    (offset, vec![value | 1; length as usize])
}

fn random_mode(random: &mut SeededRng) -> CrashMode {
    CrashMode::ALL[random.below(CrashMode::ALL.len() as u64) as usize]
}

/// Seeds 1..=count (TIER_SEED_COUNT overrides count for a longer run), or TIER_SEED alone.
fn seeds(default_count: u64) -> Vec<u64> {
    if let Ok(seed) = std::env::var("TIER_SEED") {
        return vec![seed.parse().expect("TIER_SEED is a number")];
    }
    let count = std::env::var("TIER_SEED_COUNT")
        .map(|count| count.parse().expect("TIER_SEED_COUNT is a number"))
        .unwrap_or(default_count);
    (1..=count).collect()
}

fn open(local: &Arc<CrashDevice>, remote: &Arc<CrashDevice>, flush_to: FlushTo, seed: u64) -> Tier {
    LocalTier::open(
        Arc::clone(local),
        "crash-local".into(),
        Arc::clone(remote),
        IDENTITY,
        config(flush_to),
    )
    .unwrap_or_else(|error| panic!("seed {seed}: reopen: {error}"))
}

/// The machine loses power (the local device unless it already has, and the remote) and
/// comes back: checks the remote is an epoch prefix, reopens the tier, and checks what it
/// shows against the model.
#[allow(clippy::too_many_arguments)]
fn power_cycle(
    tier: &mut Option<Tier>,
    local: &Arc<CrashDevice>,
    remote: &Arc<CrashDevice>,
    model: &mut Model,
    random: &mut SeededRng,
    flush_to: FlushTo,
    seed: u64,
    step: u64,
) {
    tier.take().unwrap().stop();
    if !local.is_crashed() {
        local.crash(random_mode(random));
    }
    remote.crash(random_mode(random));
    assert!(
        model.is_epoch_prefix(&remote.durable_image(), 0),
        "seed {seed} step {step}: the remote is not an epoch prefix after a crash"
    );
    if flush_to == FlushTo::Remote {
        assert!(
            model.is_epoch_prefix(&remote.durable_image(), model.acknowledged),
            "seed {seed} step {step}: with --flush-to remote the remote lost an acknowledged flush"
        );
    }
    local.restart();
    remote.restart();
    let reopened = open(local, remote, flush_to, seed);
    let recovered = read(&reopened, 0, BACKEND_BYTES).unwrap();
    model.recovered(&recovered, seed);
    *tier = Some(reopened);
}

#[test]
#[cfg_attr(
    feature = "planted-defect",
    should_panic(expected = "not an epoch prefix")
)]
fn every_flushed_write_survives_crashes_and_the_remote_stays_an_epoch_prefix() {
    // Goal: after any crash of the machine (local and remote lose what they had not
    // synced, in every CrashMode), the tier shows every write a flush acknowledged, plus
    // at most a prefix of the later ones; reads always match the model; and the remote's
    // durable image is a prefix at epoch granularity at every crash. Method: random
    // writes (aligned and not), zeroings, reads, flushes and crashes (now, or armed to fire
    // a few local requests later, wherever they come from) over a log small enough to wrap
    // and fill, checked against a shadow model. Seeds print on failure;
    // TIER_SEED=N reruns one.
    for seed in seeds(60) {
        let mut random = SeededRng::new(seed);
        let flush_to = if seed % 3 == 0 {
            FlushTo::Remote
        } else {
            FlushTo::Local
        };
        let local = Arc::new(CrashDevice::new(LOCAL_BYTES_MIN + 16 * BLOCK, seed));
        let remote = Arc::new(CrashDevice::new(BACKEND_BYTES, seed ^ 0xabc));
        let mut tier = Some(
            LocalTier::create(
                Arc::clone(&local),
                "crash-local".into(),
                Arc::clone(&remote),
                IDENTITY,
                config(flush_to),
            )
            .unwrap(),
        );
        let mut model = Model::new(vec![0u8; BACKEND_BYTES as usize]);
        for step in 0..300 {
            let choice = random.below(100);
            // A crash armed earlier has fired (in a client request or in write-back), or one
            // happens now: the machine loses power.
            if local.is_crashed() || choice >= 95 {
                power_cycle(
                    &mut tier,
                    &local,
                    &remote,
                    &mut model,
                    &mut random,
                    flush_to,
                    seed,
                    step,
                );
                continue;
            }
            let device = tier.as_ref().unwrap();
            // Requests fail only once the local device has lost power; those are not
            // acknowledged, so the model does not take them.
            let allowed = |error: std::io::Error, what: &str| {
                assert!(
                    local.is_crashed(),
                    "seed {seed} step {step}: {what} failed: {error}"
                );
            };
            match choice {
                0..=49 => {
                    let (offset, data) = random_write(&mut random);
                    match write(device, offset, &data) {
                        Ok(()) => model.write(offset, &data),
                        Err(error) => allowed(error, "a write"),
                    }
                }
                50..=54 => {
                    let offset = random.below(BACKEND_BYTES / BLOCK - 12) * BLOCK;
                    let length = BLOCK * (1 + random.below(11));
                    match device.write_zeroes(offset, length) {
                        Ok(()) => model.write(offset, &vec![0u8; length as usize]),
                        Err(error) => allowed(error, "a zeroing"),
                    }
                }
                55..=74 => {
                    let offset = random.below(BACKEND_BYTES - 4 * BLOCK);
                    let length = 1 + random.below(4 * BLOCK);
                    match read(device, offset, length) {
                        Ok(seen) => assert!(
                            seen == model.image[offset as usize..(offset + length) as usize],
                            "seed {seed} step {step}: a read of {length} bytes at {offset} differs from the model"
                        ),
                        Err(error) => allowed(error, "a read"),
                    }
                }
                75..=89 => match device.flush() {
                    Ok(()) => model.flushed(),
                    Err(error) => allowed(error, "a flush"),
                },
                _ => {
                    // Power fails by itself a few requests from now: in a client's write,
                    // a flush, or in the middle of write-back's checkpoint.
                    let requests = random.below(12);
                    local.crash_after_requests(requests, random_mode(&mut random));
                }
            }
        }
        // A crash may still be armed: power-cycle once more so it cannot fire below.
        power_cycle(
            &mut tier,
            &local,
            &remote,
            &mut model,
            &mut random,
            flush_to,
            seed,
            300,
        );
        // Write-back finishes: the remote then holds exactly what clients see.
        let device = tier.take().unwrap();
        device.flush().unwrap();
        device.drain().unwrap();
        assert!(
            remote.durable_image() == model.image,
            "seed {seed}: after draining, the remote differs from the model"
        );
        assert_eq!(device.stats().dirty_bytes, 0, "seed {seed}");
    }
}

#[test]
#[cfg_attr(
    feature = "planted-defect",
    should_panic(expected = "not an epoch prefix")
)]
fn the_remote_is_an_epoch_prefix_when_write_back_dies_and_the_local_device_is_lost() {
    // Goal: whatever point write-back is killed at (the remote loses power in the middle of
    // an epoch, in any CrashMode), and with the local device then gone for good, the remote
    // holds a prefix of the flushed writes at epoch granularity, and with --flush-to remote
    // every flush that was acknowledged. Method: arm the remote to crash after a random
    // number of requests, run random writes and flushes until it does, then check its
    // durable image against the model without ever looking at the local device again.
    for seed in seeds(80) {
        let mut random = SeededRng::new(seed);
        let flush_to = if seed % 2 == 0 {
            FlushTo::Remote
        } else {
            FlushTo::Local
        };
        let local = Arc::new(CrashDevice::new(LOCAL_BYTES_MIN + 8 * BLOCK, seed));
        let remote = Arc::new(CrashDevice::new(BACKEND_BYTES, seed ^ 0x55));
        let tier: Tier = LocalTier::create(
            Arc::clone(&local),
            "crash-local".into(),
            Arc::clone(&remote),
            IDENTITY,
            config(flush_to),
        )
        .unwrap();
        remote.crash_after_requests(random.below(150), random_mode(&mut random));
        let mut model = Model::new(vec![0u8; BACKEND_BYTES as usize]);
        for _ in 0..200 {
            if remote.is_crashed() {
                break;
            }
            if random.chance(0.8) {
                let (offset, data) = random_write(&mut random);
                match write(&tier, offset, &data) {
                    Ok(()) => model.write(offset, &data),
                    // A write that falls back to the remote fails with it: not acknowledged,
                    // but part of it may have reached the remote, so it is a possible value.
                    Err(_) => {
                        assert!(remote.is_crashed(), "seed {seed}: a write failed");
                        model.write(offset, &data);
                    }
                }
            } else {
                match tier.flush() {
                    Ok(()) => model.flushed(),
                    Err(_) => assert!(remote.is_crashed(), "seed {seed}: a flush failed"),
                }
            }
        }
        tier.stop();
        if !remote.is_crashed() {
            remote.crash(random_mode(&mut random));
        }
        let image = remote.durable_image();
        assert!(
            model.is_epoch_prefix(&image, 0),
            "seed {seed}: the remote is not an epoch prefix"
        );
        if flush_to == FlushTo::Remote {
            assert!(
                model.is_epoch_prefix(&image, model.acknowledged),
                "seed {seed}: with --flush-to remote the remote lost an acknowledged flush"
            );
        }
    }
}

#[test]
#[cfg_attr(
    feature = "planted-defect",
    should_panic(expected = "not all of the older one")
)]
fn write_back_goes_oldest_epoch_first_after_an_outage() {
    // Goal: after a remote outage with two flushed epochs waiting, write-back puts the older
    // one on the remote first, so a crash after one epoch leaves the older, never the newer.
    // Method: the remote refuses everything while block 0 (epoch 1) and block 1 (epoch 2)
    // are flushed; once write-back is asleep after a failure, the remote comes back armed to
    // crash after two requests (one epoch's write and flush); then the durable remote must
    // hold block 0 alone. Under the planted-defect feature (newest epoch first) it fails.
    let local = Arc::new(CrashDevice::new(LOCAL_BYTES_MIN, 11));
    let remote = Arc::new(CrashDevice::new(BACKEND_BYTES, 12));
    let tier: Tier = LocalTier::create(
        Arc::clone(&local),
        "crash-local".into(),
        Arc::clone(&remote),
        IDENTITY,
        LocalTierConfig {
            writeback_retry_delay_initial: Duration::from_millis(300),
            writeback_retry_delay_max: Duration::from_millis(300),
            ..config(FlushTo::Local)
        },
    )
    .unwrap();
    remote.crash(CrashMode::DropUnflushed);
    write(&tier, 0, &[1u8; 4096]).unwrap();
    tier.flush().unwrap();
    write(&tier, 4096, &[2u8; 4096]).unwrap();
    tier.flush().unwrap();
    let failures = tier.stats().writeback_failures_in_a_row;
    while tier.stats().writeback_failures_in_a_row == failures {
        std::thread::sleep(Duration::from_millis(1));
    }
    remote.restart();
    remote.crash_after_requests(2, CrashMode::KeepAll);
    while !remote.is_crashed() {
        std::thread::sleep(Duration::from_millis(1));
    }
    tier.stop();
    let image = remote.durable_image();
    let newer = image[4096..8192] == [2u8; 4096];
    let older = image[..4096] == [1u8; 4096];
    assert!(
        older || !newer,
        "the remote holds the newer epoch but not all of the older one"
    );
    assert!(older, "one epoch reached the remote before the crash");
}

#[test]
fn a_full_log_falls_back_to_the_remote_and_loses_nothing() {
    // Goal: writing far more than the log holds without a flush (so the log fills with dirty
    // data of one epoch) neither loses nor reorders writes: the tier falls back to remote
    // durability and counts it. Method: write three log-fulls of distinct blocks, check every
    // block, then drop the local device and check the remote alone.
    let local = Arc::new(CrashDevice::new(LOCAL_BYTES_MIN, 1));
    let remote = Arc::new(CrashDevice::new(1024 * BLOCK, 2));
    let tier: Tier = LocalTier::create(
        Arc::clone(&local),
        "crash-local".into(),
        Arc::clone(&remote),
        IDENTITY,
        config(FlushTo::Local),
    )
    .unwrap();
    let capacity_blocks = tier.stats().log_capacity_bytes / (BLOCK + 512);
    let blocks = (capacity_blocks * 3).min(1024);
    for block in 0..blocks {
        write(
            &tier,
            block * BLOCK,
            &vec![(block % 251) as u8 + 1; BLOCK as usize],
        )
        .unwrap();
    }
    assert!(
        tier.stats().fallbacks > 0,
        "the log was full: {:?}",
        tier.stats()
    );
    for block in 0..blocks {
        assert_eq!(
            read(&tier, block * BLOCK, BLOCK).unwrap(),
            vec![(block % 251) as u8 + 1; BLOCK as usize],
            "block {block}"
        );
    }
    tier.flush().unwrap();
    tier.drain().unwrap();
    tier.stop();
    let image = remote.durable_image();
    for block in 0..blocks {
        let at = (block * BLOCK) as usize;
        assert!(
            image[at..at + BLOCK as usize] == vec![(block % 251) as u8 + 1; BLOCK as usize],
            "remote block {block}"
        );
    }
}

#[test]
fn the_read_cache_survives_a_restart() {
    // Goal: blocks read from the remote are served locally after the server restarts (a
    // process crash, which keeps what reached the local file), so the same read workload
    // hits as well right after the restart. Method: fill the remote, read it all through a
    // tier, kill the process (stop without flushing; the local device keeps its writes),
    // reopen, read it all again and count remote reads.
    let local = Arc::new(CrashDevice::new(LOCAL_BYTES_MIN + 64 * (BLOCK + 512), 3));
    let remote = Arc::new(CrashDevice::new(BACKEND_BYTES, 4));
    for block in 0..BACKEND_BYTES / BLOCK {
        write(
            &*remote,
            block * BLOCK,
            &vec![block as u8 + 7; BLOCK as usize],
        )
        .unwrap();
    }
    remote.flush().unwrap();
    let tier = open_new(&local, &remote);
    let before = read(&tier, 0, BACKEND_BYTES).unwrap();
    let first = tier.stats();
    assert_eq!(first.read_blocks_remote, BACKEND_BYTES / BLOCK);
    assert_eq!(read(&tier, 0, BACKEND_BYTES).unwrap(), before);
    let hits_before = tier.stats().read_blocks_local - first.read_blocks_local;
    tier.stop();
    local.crash(CrashMode::KeepAll);
    local.restart();
    let tier = open(&local, &remote, FlushTo::Local, 0);
    assert_eq!(read(&tier, 0, BACKEND_BYTES).unwrap(), before);
    let after = tier.stats();
    assert_eq!(after.read_blocks_remote, 0, "{after:?}");
    assert!(after.read_blocks_local as f64 >= 0.9 * hits_before as f64);
}

fn open_new(local: &Arc<CrashDevice>, remote: &Arc<CrashDevice>) -> Tier {
    LocalTier::create(
        Arc::clone(local),
        "crash-local".into(),
        Arc::clone(remote),
        IDENTITY,
        config(FlushTo::Local),
    )
    .unwrap()
}

#[test]
fn write_back_errors_are_retried_and_reported_by_flush_to_remote() {
    // Goal: a remote that fails is never silently skipped: a flush that waits for the remote
    // returns its error, the stats name it, and once the remote is back the same data lands.
    // Method: crash the remote (it refuses everything), write and flush with --flush-to
    // remote, restart the remote, drain, compare.
    let local = Arc::new(CrashDevice::new(LOCAL_BYTES_MIN, 5));
    let remote = Arc::new(CrashDevice::new(BACKEND_BYTES, 6));
    let tier: Tier = LocalTier::create(
        Arc::clone(&local),
        "crash-local".into(),
        Arc::clone(&remote),
        IDENTITY,
        config(FlushTo::Remote),
    )
    .unwrap();
    remote.crash(CrashMode::DropUnflushed);
    write(&tier, 0, &[9u8; 4096]).unwrap();
    let error = tier.flush().unwrap_err().to_string();
    assert!(
        error.contains("write-back to crash:") && error.contains("crashed"),
        "{error}"
    );
    assert!(tier.stats().writeback_error.is_some());
    remote.restart();
    tier.drain().unwrap();
    assert_eq!(remote.durable_image()[..4096], [9u8; 4096]);
    assert_eq!(tier.stats().writeback_error, None);
}

#[test]
fn a_failed_local_fsync_refuses_every_later_write_and_flush() {
    // Goal: after the local device fails an fsync, what it holds is unknown (fsyncgate): the
    // tier must not acknowledge anything more until it is reopened and has replayed the log.
    // Method: a local device that loses power under a running tier (every request then
    // fails), powered back on: writes and flushes still fail, naming the earlier failure;
    // after a reopen the flushed write is there and new writes work.
    let local = Arc::new(CrashDevice::new(LOCAL_BYTES_MIN, 7));
    let remote = Arc::new(CrashDevice::new(BACKEND_BYTES, 8));
    let tier = open_new(&local, &remote);
    write(&tier, 0, &[1u8; 4096]).unwrap();
    tier.flush().unwrap();
    write(&tier, 4096, &[2u8; 4096]).unwrap();
    local.crash(CrashMode::DropUnflushed);
    assert!(tier.flush().is_err());
    local.restart();
    let error = write(&tier, 8192, &[3u8; 4096]).unwrap_err().to_string();
    assert!(
        error.contains("refusing writes and flushes after a failure"),
        "{error}"
    );
    assert!(tier.flush().is_err());
    tier.stop();
    let tier = open(&local, &remote, FlushTo::Local, 0);
    assert_eq!(read(&tier, 0, 4096).unwrap(), vec![1u8; 4096]);
    write(&tier, 8192, &[3u8; 4096]).unwrap();
    tier.flush().unwrap();
}

#[test]
#[cfg_attr(feature = "planted-defect", should_panic(expected = "a thread failed"))]
fn concurrent_writers_readers_and_flushers_see_their_own_writes_and_lose_none() {
    // Goal: the tier's locking holds up under threads: each thread reads back what it last
    // wrote while others write, read, flush and force fallbacks (a log too small for them),
    // and once drained the remote holds exactly the final image. Method: four threads, each
    // owning a disjoint quarter of the disk with its own shadow, random aligned and unaligned
    // writes, zeroings, reads and flushes; seeds print on failure.
    for seed in seeds(6) {
        let local = Arc::new(CrashDevice::new(LOCAL_BYTES_MIN, seed));
        let remote = Arc::new(CrashDevice::new(BACKEND_BYTES, seed + 1));
        let tier = Arc::new(open_new(&local, &remote));
        let quarter = BACKEND_BYTES / 4;
        let threads: Vec<_> = (0..4u64)
            .map(|thread| {
                let tier = Arc::clone(&tier);
                std::thread::spawn(move || {
                    let mut random = SeededRng::new(seed * 10 + thread);
                    let base = thread * quarter;
                    let mut shadow = vec![0u8; quarter as usize];
                    for step in 0..400 {
                        let offset = random.below(quarter - 2 * BLOCK);
                        let length = 1 + random.below(2 * BLOCK);
                        match random.below(10) {
                            0..=4 => {
                                let byte = (random.next_u64() as u8) | 1;
                                let data = vec![byte; length as usize];
                                write(&*tier, base + offset, &data).unwrap_or_else(|error| {
                                    panic!("seed {seed} thread {thread} step {step}: {error}")
                                });
                                shadow[offset as usize..(offset + length) as usize]
                                    .copy_from_slice(&data);
                            }
                            5 => {
                                let offset = offset / BLOCK * BLOCK;
                                tier.write_zeroes(base + offset, BLOCK).unwrap();
                                shadow[offset as usize..(offset + BLOCK) as usize].fill(0);
                            }
                            6..=8 => {
                                let seen = read(&*tier, base + offset, length).unwrap();
                                assert!(
                                    seen == shadow[offset as usize..(offset + length) as usize],
                                    "seed {seed} thread {thread} step {step}: a read differs"
                                );
                            }
                            _ => tier.flush().unwrap(),
                        }
                    }
                    shadow
                })
            })
            .collect();
        let mut image = Vec::new();
        for thread in threads {
            image.extend(thread.join().expect("a thread failed"));
        }
        tier.flush().unwrap();
        tier.drain().unwrap();
        assert!(
            remote.durable_image() == image,
            "seed {seed}: the remote after draining"
        );
        assert!(
            read(&*tier, 0, BACKEND_BYTES).unwrap() == image,
            "seed {seed}: the tier"
        );
        let stats = tier.stats();
        eprintln!("seed {seed}: {stats:?}");
        assert!(stats.writeback_epochs > 0, "seed {seed}: write-back ran");
    }
}

/// A remote that writes best in whole `unit`-byte chunks (an object store's), recording the
/// range of every write it is given.
struct ChunkedRemote {
    inner: CrashDevice,
    unit: u64,
    writes: std::sync::Mutex<Vec<(u64, u64)>>,
}

impl Device for ChunkedRemote {
    fn read_vectored_at(&self, buffers: &mut [IoSliceMut<'_>], offset: u64) -> std::io::Result<()> {
        self.inner.read_vectored_at(buffers, offset)
    }
    fn write_vectored_at(&self, buffers: &[IoSlice<'_>], offset: u64) -> std::io::Result<()> {
        let length = buffers.iter().map(|buffer| buffer.len() as u64).sum();
        self.writes.lock().unwrap().push((offset, length));
        self.inner.write_vectored_at(buffers, offset)
    }
    fn submit_reads(&self, reads: Vec<bufcache_device::ReadRequest>) {
        bufcache_device::read_each_now(self, reads)
    }
    fn submit_writes(&self, writes: Vec<bufcache_device::WriteRequest>) {
        bufcache_device::write_each_now(self, writes)
    }
    fn flush(&self) -> std::io::Result<()> {
        self.inner.flush()
    }
    fn discard(&self, offset: u64, length: u64) -> std::io::Result<()> {
        self.inner.discard(offset, length)
    }
    fn write_zeroes(&self, offset: u64, length: u64) -> std::io::Result<()> {
        self.inner.write_zeroes(offset, length)
    }
    fn extents(&self, offset: u64, length: u64) -> std::io::Result<Vec<bufcache_device::Extent>> {
        self.inner.extents(offset, length)
    }
    fn capabilities(&self) -> bufcache_device::Capabilities {
        bufcache_device::Capabilities {
            write_unit_bytes: self.unit,
            ..self.inner.capabilities()
        }
    }
    fn describe(&self) -> String {
        "chunked".into()
    }
}

#[test]
fn write_back_cuts_runs_at_the_remotes_write_unit() {
    // Goal: over an object store (chunks of `write_unit_bytes`), write-back never sends a
    // write that straddles a chunk boundary, and merges up to whole chunks, so the store does
    // no read-merge-upload it could have avoided. Method: 80 KiB written in 4 KiB pieces
    // from 8 KiB, over a remote with 16 KiB units; drain; look at every remote write.
    let unit = 4 * BLOCK;
    let local = Arc::new(CrashDevice::new(LOCAL_BYTES_MIN, 13));
    let remote = Arc::new(ChunkedRemote {
        inner: CrashDevice::new(BACKEND_BYTES, 14),
        unit,
        writes: std::sync::Mutex::new(Vec::new()),
    });
    let tier = LocalTier::create(
        Arc::clone(&local),
        "crash-local".into(),
        Arc::clone(&remote),
        IDENTITY,
        config(FlushTo::Local),
    )
    .unwrap();
    for block in 2..22u64 {
        write(&tier, block * BLOCK, &[block as u8; 4096]).unwrap();
    }
    tier.flush().unwrap();
    tier.drain().unwrap();
    let writes = remote.writes.lock().unwrap().clone();
    assert_eq!(
        writes,
        vec![
            (2 * BLOCK, 2 * BLOCK),
            (4 * BLOCK, unit),
            (8 * BLOCK, unit),
            (12 * BLOCK, unit),
            (16 * BLOCK, unit),
            (20 * BLOCK, 2 * BLOCK)
        ],
        "whole chunks, cut at chunk boundaries"
    );
}

// ---- Bad local caches: each gives an error naming the file and what is wrong, and the
// file is left as it was (nothing replayed, nothing written).

fn file_tier(
    path: &std::path::Path,
    size: Option<u64>,
    remote_bytes: u64,
    identity: &str,
) -> Result<LocalTier<MemoryDevice>, TierError> {
    LocalTier::open_path(
        path,
        size,
        MemoryDevice::new(remote_bytes),
        identity,
        LocalTierConfig::default(),
    )
}

fn made_cache(directory: &tempfile::TempDir) -> std::path::PathBuf {
    let path = directory.path().join("local.cache");
    let tier = file_tier(&path, Some(1 << 20), BACKEND_BYTES, IDENTITY).unwrap();
    write(&tier, 0, &[3u8; 4096]).unwrap();
    tier.flush().unwrap();
    drop(tier);
    path
}

fn refused(path: &std::path::Path, result: Result<LocalTier<MemoryDevice>, TierError>) -> String {
    let before = std::fs::read(path).ok();
    let message = match result {
        Ok(_) => panic!("{} was accepted", path.display()),
        Err(error) => error.to_string(),
    };
    assert!(
        message.contains(&path.display().to_string()),
        "names the file: {message}"
    );
    assert_eq!(std::fs::read(path).ok(), before, "the file is unchanged");
    message
}

#[test]
fn a_cache_of_another_backend_is_refused() {
    // Goal: a cache attached to another backend would serve that backend's blocks here.
    // Method: make a cache for one identity, open it for another.
    let directory = tempfile::tempdir().unwrap();
    let path = made_cache(&directory);
    let message = refused(
        &path,
        file_tier(&path, None, BACKEND_BYTES, "file:/srv/other.img"),
    );
    assert!(
        message.contains("file:/srv/test.img") && message.contains("file:/srv/other.img"),
        "{message}"
    );
}

#[test]
fn a_backend_of_another_size_is_refused() {
    // Goal: a backend that changed size is not the disk the cache holds blocks of.
    let directory = tempfile::tempdir().unwrap();
    let path = made_cache(&directory);
    let message = refused(&path, file_tier(&path, None, 2 * BACKEND_BYTES, IDENTITY));
    assert!(
        message.contains("was made for a backend of 262144 bytes"),
        "{message}"
    );
}

#[test]
fn a_cache_of_the_wrong_size_is_refused() {
    // Goal: asking for another size than the cache has is an error, not a silent resize.
    let directory = tempfile::tempdir().unwrap();
    let path = made_cache(&directory);
    let message = refused(
        &path,
        file_tier(&path, Some(2 << 20), BACKEND_BYTES, IDENTITY),
    );
    assert!(
        message.contains("not the 2097152 bytes asked for"),
        "{message}"
    );
}

#[test]
fn a_truncated_cache_is_refused() {
    // Goal: a cache cut short (a copy that did not finish) is not replayed.
    let directory = tempfile::tempdir().unwrap();
    let path = made_cache(&directory);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(100_000)
        .unwrap();
    let message = refused(&path, file_tier(&path, None, BACKEND_BYTES, IDENTITY));
    assert!(message.contains("is truncated: 100000 bytes"), "{message}");
    std::fs::write(&path, &std::fs::read(&path).unwrap()[..1000]).unwrap();
    let message = refused(&path, file_tier(&path, None, BACKEND_BYTES, IDENTITY));
    assert!(message.contains("truncated"), "{message}");
}

#[test]
fn garbage_and_a_corrupt_superblock_are_refused() {
    // Goal: a file that is not a cache (or whose superblock is damaged) is never used.
    // Method: random bytes; then a real cache with one superblock byte flipped.
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("garbage");
    let mut random = SeededRng::new(9);
    let garbage: Vec<u8> = (0..1 << 20).map(|_| random.next_u64() as u8).collect();
    std::fs::write(&path, garbage).unwrap();
    let message = refused(
        &path,
        file_tier(&path, Some(1 << 20), BACKEND_BYTES, IDENTITY),
    );
    assert!(
        message.contains("is not a bufcache local cache"),
        "{message}"
    );
    let path = made_cache(&directory);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[40] ^= 0x10;
    std::fs::write(&path, bytes).unwrap();
    let message = refused(&path, file_tier(&path, None, BACKEND_BYTES, IDENTITY));
    assert!(message.contains("superblock is corrupt"), "{message}");
}

#[test]
fn a_read_only_path_and_a_missing_size_are_refused() {
    // Goal: a cache the process may not write cannot hold a log; a new cache needs a size.
    // Method: a sysfs file (read-only even for root); a path that does not exist, no size.
    let read_only = std::path::Path::new("/sys/kernel/notes");
    if read_only.exists() {
        let message = file_tier(read_only, None, BACKEND_BYTES, IDENTITY)
            .err()
            .expect("refused")
            .to_string();
        assert!(
            message.contains("/sys/kernel/notes is read-only"),
            "{message}"
        );
    }
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("new.cache");
    let message = file_tier(&path, None, BACKEND_BYTES, IDENTITY)
        .err()
        .expect("refused")
        .to_string();
    assert!(
        message.contains("does not exist; give its size"),
        "{message}"
    );
    assert!(!path.exists());
}

#[test]
fn a_file_cache_keeps_flushed_writes_across_a_reopen() {
    // Goal: the file-backed path (what serve uses) replays the log: a write flushed before
    // the tier went away is read back after it is opened again, before any write-back.
    // Method: a remote that refuses writes until the reopen, so nothing reaches it first.
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("local.cache");
    let remote = Arc::new(CrashDevice::new(BACKEND_BYTES, 1));
    remote.crash(CrashMode::DropUnflushed);
    let tier = LocalTier::open_path(
        &path,
        Some(1 << 20),
        Arc::clone(&remote),
        IDENTITY,
        config(FlushTo::Local),
    );
    let tier = tier.unwrap();
    write(&tier, 8192, &[5u8; 8192]).unwrap();
    tier.flush().unwrap();
    tier.stop();
    remote.restart();
    let tier = LocalTier::open_path(
        &path,
        Some(1 << 20),
        Arc::clone(&remote),
        IDENTITY,
        config(FlushTo::Local),
    )
    .unwrap();
    assert_eq!(read(&tier, 8192, 8192).unwrap(), vec![5u8; 8192]);
    tier.drain().unwrap();
    assert_eq!(remote.durable_image()[8192..16384], [5u8; 8192]);
}

/// A remote whose writes and flushes wait while its gate is closed: a store that hangs.
struct GatedRemote {
    inner: CrashDevice,
    closed: std::sync::Mutex<bool>,
    opened: std::sync::Condvar,
}

impl GatedRemote {
    fn wait_open(&self) {
        let mut closed = self.closed.lock().unwrap();
        while *closed {
            closed = self.opened.wait(closed).unwrap();
        }
    }

    fn open_gate(&self) {
        *self.closed.lock().unwrap() = false;
        self.opened.notify_all();
    }
}

impl Device for GatedRemote {
    fn read_vectored_at(&self, buffers: &mut [IoSliceMut<'_>], offset: u64) -> std::io::Result<()> {
        self.inner.read_vectored_at(buffers, offset)
    }
    fn write_vectored_at(&self, buffers: &[IoSlice<'_>], offset: u64) -> std::io::Result<()> {
        self.wait_open();
        self.inner.write_vectored_at(buffers, offset)
    }
    fn submit_reads(&self, reads: Vec<bufcache_device::ReadRequest>) {
        bufcache_device::read_each_now(self, reads)
    }
    fn submit_writes(&self, writes: Vec<bufcache_device::WriteRequest>) {
        bufcache_device::write_each_now(self, writes)
    }
    fn flush(&self) -> std::io::Result<()> {
        self.wait_open();
        self.inner.flush()
    }
    fn discard(&self, offset: u64, length: u64) -> std::io::Result<()> {
        self.wait_open();
        self.inner.discard(offset, length)
    }
    fn write_zeroes(&self, offset: u64, length: u64) -> std::io::Result<()> {
        self.wait_open();
        self.inner.write_zeroes(offset, length)
    }
    fn extents(&self, offset: u64, length: u64) -> std::io::Result<Vec<bufcache_device::Extent>> {
        self.inner.extents(offset, length)
    }
    fn capabilities(&self) -> bufcache_device::Capabilities {
        self.inner.capabilities()
    }
    fn describe(&self) -> String {
        "gated".into()
    }
}

#[test]
fn a_full_log_over_a_hung_remote_fails_the_write_within_the_stall_bound() {
    // Goal: once the log is full of data not yet on the remote and the remote hangs, a write
    // that must wait for the remote fails after `remote_stall_max` without progress, instead
    // of waiting for the remote's own timeouts (a FLUSH over it then answers EIO in seconds),
    // and nothing acknowledged before it is lost. Method: a remote whose writes block; fill
    // the log; the write that falls back must return an error naming the stall (a thread and
    // a generous receive timeout catch a hang); open the remote, drain, check every
    // acknowledged block on the remote.
    let local = Arc::new(CrashDevice::new(LOCAL_BYTES_MIN, 11));
    let remote = Arc::new(GatedRemote {
        inner: CrashDevice::new(1024 * BLOCK, 12),
        closed: std::sync::Mutex::new(false),
        opened: std::sync::Condvar::new(),
    });
    let tier = Arc::new(
        LocalTier::create(
            Arc::clone(&local),
            "crash-local".into(),
            Arc::clone(&remote),
            IDENTITY,
            LocalTierConfig {
                remote_stall_max: Duration::from_millis(300),
                ..config(FlushTo::Local)
            },
        )
        .unwrap(),
    );
    // Dropped before the tier, whose write-back thread would otherwise wait on the gate.
    struct OpenOnDrop(Arc<GatedRemote>);
    impl Drop for OpenOnDrop {
        fn drop(&mut self) {
            self.0.open_gate();
        }
    }
    let _open_on_drop = OpenOnDrop(Arc::clone(&remote));
    // Creating the tier flushes the remote; it hangs from here on.
    *remote.closed.lock().unwrap() = true;
    let (sender, receiver) = std::sync::mpsc::channel();
    let writer = Arc::clone(&tier);
    std::thread::spawn(move || {
        let mut acknowledged = 0u64;
        for block in 0..1024u64 {
            let data = vec![(block % 251) as u8 + 1; BLOCK as usize];
            match write(&*writer, block * BLOCK, &data) {
                Ok(()) => acknowledged += 1,
                Err(error) => {
                    let _ = sender.send((acknowledged, error.to_string()));
                    return;
                }
            }
        }
        let _ = sender.send((acknowledged, String::new()));
    });
    let (acknowledged, error) = receiver
        .recv_timeout(Duration::from_secs(60))
        .expect("the write over a hung remote returned");
    assert!(
        error.contains("no progress") && error.contains("gated"),
        "after {acknowledged} blocks: {error:?}"
    );
    assert!(acknowledged > 0 && tier.stats().fallbacks > 0);
    remote.open_gate();
    tier.drain().unwrap();
    let image = remote.inner.durable_image();
    for block in 0..acknowledged {
        let at = (block * BLOCK) as usize;
        assert!(
            image[at..at + BLOCK as usize] == vec![(block % 251) as u8 + 1; BLOCK as usize],
            "acknowledged block {block} is on the remote"
        );
    }
}

/// A tier whose write-back never runs (nothing reaches the remote), optionally replaying a
/// damaged log's prefix.
fn open_without_writeback(
    local: &Arc<CrashDevice>,
    remote: &Arc<CrashDevice>,
    replay_damaged_prefix: bool,
) -> Result<Tier, TierError> {
    LocalTier::open(
        Arc::clone(local),
        "crash-local".into(),
        Arc::clone(remote),
        IDENTITY,
        LocalTierConfig {
            writeback_driver: bufcache_tier::WritebackDriver::Caller,
            replay_damaged_prefix,
            ..config(FlushTo::Local)
        },
    )
}

/// Logs one block of `fill` at each of `blocks` (block numbers), flushing after those
/// marked; returns the local offsets of the records, in order. Nothing goes to the remote.
fn log_blocks(
    local: &Arc<CrashDevice>,
    remote: &Arc<CrashDevice>,
    blocks: &[(u64, u8, bool)],
) -> Vec<u64> {
    drop(open_new(local, remote));
    let tier = open_without_writeback(local, remote, false).unwrap();
    let mut offsets = Vec::new();
    let mut position = bufcache_tier::format::LOG_START;
    for &(block, fill, flush) in blocks {
        write(&tier, block * BLOCK, &vec![fill; BLOCK as usize]).unwrap();
        offsets.push(position);
        position += bufcache_tier::format::record_total_bytes(BLOCK);
        if flush {
            tier.flush().unwrap();
        }
    }
    tier.stop();
    offsets
}

/// Flips one byte of the local device (as bit rot or a misdirected write would) and makes
/// the change durable.
fn flip_byte(local: &Arc<CrashDevice>, offset: u64) {
    let mut byte = read(&**local, offset, 1).unwrap();
    byte[0] ^= 0x20;
    write(&**local, offset, &byte).unwrap();
    local.flush().unwrap();
}

#[test]
fn a_damaged_record_that_a_later_record_proves_durable_refuses_the_attach() {
    // Goal: one flipped byte in the payload of a record that had been fsynced (a later
    // record says so) is damage, not a crash: replay must not stop there silently and
    // revert the acknowledged writes after it to older copies. The open is refused, naming
    // the record's offset and the way out, and nothing is replayed or written to the remote;
    // the explicit flag then attaches the prefix. Method: log three flushed blocks with
    // write-back off, flip a payload byte of the second record, open without and with
    // --local-cache-replay-prefix.
    let local = Arc::new(CrashDevice::new(LOCAL_BYTES_MIN, 21));
    let remote = Arc::new(CrashDevice::new(BACKEND_BYTES, 22));
    let offsets = log_blocks(
        &local,
        &remote,
        &[(0, 0xa1, true), (1, 0xb2, true), (2, 0xc3, true)],
    );
    flip_byte(&local, offsets[1] + 64 + 100);
    let local_before = local.durable_image();
    for _ in 0..2 {
        let error = match open_without_writeback(&local, &remote, false) {
            Ok(_) => panic!("a cache with a damaged durable record was attached"),
            Err(error) => error,
        };
        assert!(
            matches!(error, TierError::DamagedRecord { offset, valid_after: 1, .. } if offset == offsets[1]),
            "{error:?}"
        );
        let message = error.to_string();
        for needle in [
            format!("offset {}", offsets[1]),
            format!("offset {}", offsets[2]),
            "crash-local".to_string(),
            "--local-cache-replay-prefix".to_string(),
        ] {
            assert!(message.contains(&needle), "{needle:?} not in: {message}");
        }
        assert_eq!(
            local.durable_image(),
            local_before,
            "the refused open wrote the local cache"
        );
        assert_eq!(
            local.volatile_image(),
            local_before,
            "the refused open wrote the local cache"
        );
        assert!(
            remote.volatile_image().iter().all(|&byte| byte == 0),
            "the refused open wrote the remote"
        );
    }
    // Nothing but the replay happens before the stop: no record overwrites the damaged one.
    let tier = open_without_writeback(&local, &remote, true).unwrap();
    assert_eq!(read(&tier, 0, BLOCK).unwrap(), vec![0xa1; BLOCK as usize]);
    tier.stop();
    // The prefix is now the log, even with nothing written since: a reopen needs no flag,
    // the writes after the damage are gone, and new writes chain on.
    let tier = open_without_writeback(&local, &remote, false).unwrap();
    assert_eq!(
        read(&tier, BLOCK, 2 * BLOCK).unwrap(),
        vec![0; 2 * BLOCK as usize]
    );
    write(&tier, 3 * BLOCK, &vec![0xd4; BLOCK as usize]).unwrap();
    tier.flush().unwrap();
    tier.stop();
    let tier = open_without_writeback(&local, &remote, false).unwrap();
    assert_eq!(read(&tier, 0, BLOCK).unwrap(), vec![0xa1; BLOCK as usize]);
    assert_eq!(
        read(&tier, 3 * BLOCK, BLOCK).unwrap(),
        vec![0xd4; BLOCK as usize]
    );
    tier.stop();
}

#[test]
fn a_torn_record_after_the_last_flush_ends_the_log_as_before() {
    // Goal: a crash may tear a record written after the last fsync while a later one
    // survives (unflushed writes persist in any order): that is not damage, and the open
    // replays up to it as before, with no flag. Method: log a flushed block and two
    // unflushed ones, tear the first unflushed record's payload (the third stays intact),
    // reopen without the flag.
    let local = Arc::new(CrashDevice::new(LOCAL_BYTES_MIN, 23));
    let remote = Arc::new(CrashDevice::new(BACKEND_BYTES, 24));
    let offsets = log_blocks(
        &local,
        &remote,
        &[(0, 0xa1, true), (1, 0xb2, false), (2, 0xc3, false)],
    );
    flip_byte(&local, offsets[1] + 64 + 100);
    let tier = open_without_writeback(&local, &remote, false).unwrap();
    assert_eq!(read(&tier, 0, BLOCK).unwrap(), vec![0xa1; BLOCK as usize]);
    assert_eq!(
        read(&tier, BLOCK, 2 * BLOCK).unwrap(),
        vec![0; 2 * BLOCK as usize]
    );
    tier.stop();
}

#[test]
#[cfg_attr(
    feature = "planted-defect",
    should_panic(expected = "is not what was written")
)]
fn a_direct_cache_file_takes_every_write_in_whole_pages_and_replays_them() {
    // Goal: the cache file serve opens with O_DIRECT takes every write the tier makes (an
    // O_DIRECT write that does not start and end on a page fails), and the head's partial
    // page, rewritten by each append, keeps the records already in it: everything flushed
    // is read back after every reopen and reaches the remote. Method: a log of the smallest
    // size, so it wraps and drops clean records at the tail again and again; seeded writes
    // of whole and partial blocks, each handed over in up to four buffers of random lengths
    // (records are cut across them), zeroings, reads (clean records) and flushes, the tier
    // reopened from the file after some flushes; checked against a shadow image. Reads of
    // blocks the log dropped go to the remote, so the planted defect (write-back newest
    // epoch first) fails it too.
    for seed in seeds(4) {
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("local.cache");
        let remote = Arc::new(CrashDevice::new(BACKEND_BYTES, seed));
        let open = || {
            LocalTier::open_path(
                &path,
                Some(LOCAL_BYTES_MIN),
                Arc::clone(&remote),
                IDENTITY,
                config(FlushTo::Local),
            )
            .unwrap_or_else(|error| match error {
                // The open's sampled clean blocks found the remote other than the cache
                // wrote it (what the planted defect does).
                TierError::OtherContent { .. } => {
                    panic!("seed {seed}: the remote is not what was written: {error}")
                }
                error => panic!("seed {seed}: {error}"),
            })
        };
        let mut tier = open();
        assert!(
            tier.local().is_direct(),
            "seed {seed}: the cache file is not O_DIRECT"
        );
        let mut random = SeededRng::new(seed);
        let mut image = vec![0u8; BACKEND_BYTES as usize];
        for step in 0..600 {
            let choice = random.below(20);
            if choice < 12 {
                let (offset, mut data) = random_write(&mut random);
                for (index, byte) in data.iter_mut().enumerate() {
                    *byte = byte.wrapping_add(index as u8);
                }
                let mut cuts: Vec<usize> = (0..random.below(4))
                    .map(|_| random.below(data.len() as u64) as usize)
                    .collect();
                cuts.sort_unstable();
                let mut slices = Vec::new();
                let mut from = 0;
                for cut in cuts.into_iter().chain([data.len()]) {
                    slices.push(IoSlice::new(&data[from..cut]));
                    from = cut;
                }
                tier.write_vectored_at(&slices, offset)
                    .unwrap_or_else(|error| panic!("seed {seed} step {step}: {error}"));
                image[offset as usize..offset as usize + data.len()].copy_from_slice(&data);
            } else if choice < 13 {
                let offset = random.below(BACKEND_BYTES - 4 * BLOCK);
                let length = 1 + random.below(4 * BLOCK);
                tier.write_zeroes(offset, length).unwrap();
                image[offset as usize..(offset + length) as usize].fill(0);
            } else if choice < 17 {
                let offset = random.below(BACKEND_BYTES / BLOCK - 4) * BLOCK;
                let length = BLOCK * (1 + random.below(4));
                assert_eq!(
                    read(&tier, offset, length).unwrap(),
                    image[offset as usize..(offset + length) as usize],
                    "seed {seed} step {step}: the read at {offset} is not what was written"
                );
            } else if choice < 19 {
                tier.flush().unwrap();
            } else {
                tier.flush().unwrap();
                tier.stop();
                tier = open();
                assert_eq!(
                    read(&tier, 0, BACKEND_BYTES).unwrap(),
                    image,
                    "seed {seed} step {step}: the image after a reopen is not what was written"
                );
            }
        }
        tier.drain().unwrap();
        assert_eq!(
            remote.durable_image(),
            image,
            "seed {seed}: the remote after the drain is not what was written"
        );
    }
}

#[test]
fn a_cache_over_another_disk_with_the_same_identity_is_refused_by_its_clean_blocks() {
    // Goal: an NBD upstream records no id of its own, so another disk served at the same
    // address has the cache's identity and size; attaching the cache there would serve its
    // stale clean blocks and replay its writes into that disk. The open compares sampled
    // clean blocks with the remote and refuses on any difference, writing nothing.
    // Method: a file cache written through remote A and written back; reopened over remote
    // B (same identity and size, other bytes): refused, naming the cache and the count of
    // differing blocks, with the cache file and B unchanged; reopened over A: attached, and
    // every block reads as written.
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("local.cache");
    let written = Arc::new(MemoryDevice::new(BACKEND_BYTES));
    let tier = LocalTier::open_path(
        &path,
        Some(1 << 20),
        Arc::clone(&written),
        IDENTITY,
        LocalTierConfig::default(),
    )
    .unwrap();
    for block in 0..BACKEND_BYTES / BLOCK {
        write(&tier, block * BLOCK, &[block as u8 + 1; BLOCK as usize]).unwrap();
    }
    tier.flush().unwrap();
    tier.drain().unwrap();
    assert_eq!(tier.stats().dirty_bytes, 0, "everything is written back");
    tier.stop();

    let other = Arc::new(MemoryDevice::new(BACKEND_BYTES));
    write(&*other, 0, &vec![0xEE; BACKEND_BYTES as usize]).unwrap();
    let other_before = read(&*other, 0, BACKEND_BYTES).unwrap();
    let cache_before = std::fs::read(&path).unwrap();
    let refused = LocalTier::open_path(
        &path,
        None,
        Arc::clone(&other),
        IDENTITY,
        LocalTierConfig::default(),
    );
    let message = match refused {
        Ok(_) => panic!("a cache was attached to another disk with the same identity"),
        Err(error @ TierError::OtherContent { .. }) => error.to_string(),
        Err(error) => panic!("refused for another reason: {error}"),
    };
    assert!(
        message.contains(&path.display().to_string())
            && message.contains("32 of 32 sampled clean blocks differ")
            && message.contains("--local-cache"),
        "{message}"
    );
    assert_eq!(
        std::fs::read(&path).unwrap(),
        cache_before,
        "cache unchanged"
    );
    assert_eq!(read(&*other, 0, BACKEND_BYTES).unwrap(), other_before);

    let tier = LocalTier::open_path(
        &path,
        None,
        Arc::clone(&written),
        IDENTITY,
        LocalTierConfig::default(),
    )
    .unwrap();
    for block in 0..BACKEND_BYTES / BLOCK {
        assert_eq!(
            read(&tier, block * BLOCK, BLOCK).unwrap(),
            vec![block as u8 + 1; BLOCK as usize]
        );
    }
    tier.stop();
}
