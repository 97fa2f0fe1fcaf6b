//! Disk models: a mechanical disk (seek curve, rotation, overhead, media rate, on-drive
//! read-ahead segment), an SSD (latency, bandwidth, channels) and a network disk (RTT,
//! bandwidth, requests in flight), with named presets.
//!
//! A model serves one request at a time as the simulator hands them over: `serve` gets the
//! arrival time and returns the completion time, and keeps its own state (arm position,
//! busy-until, the drive's prefetch segment). Requests are served in the order they are
//! handed over (one arm, FIFO), so a request that arrives while the disk is busy waits; the
//! simulated io queue (in `core`) decides that order and hands a request over only when it
//! dispatches it, so its positioning is computed from where the head is then.
//!
//! The mechanical model follows Ruemmler & Wilkes, "An introduction to disk drive modeling",
//! IEEE Computer 27(3), 1994: seek time `a + b·√d` for short seeks and linear for long ones,
//! rotational latency from the platter's angular position (tracked continuously, so a request
//! for a sector that has just passed under the head waits almost a whole revolution), a fixed
//! per-command controller overhead, transfer at the media rate, and a read-ahead segment that
//! keeps reading after a read so that a sequential reader is served from the drive's buffer.
//! Simplifications: one zone (constant sectors per track), no track or cylinder switch
//! time (drives hide it with skew), no write cache (as in the seeds' SCSI disks and in
//! DiskSim's validation runs), no command queueing inside the drive.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

/// Direction of a device request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Op {
    /// Data from the device.
    Read,
    /// Data to the device.
    Write,
}

/// A disk: serves requests in virtual time.
pub trait DiskModel: Send {
    /// Serves `length` bytes at byte `offset` for a request arriving at `arrival_ns`, and
    /// returns the time the request completes.
    fn serve(&mut self, op: Op, offset: u64, length: u64, arrival_ns: u64) -> u64;
    /// Capacity in bytes.
    fn capacity_bytes(&self) -> u64;
    /// Writes the drive's write cache to the medium from `at_ns` (a flush) and returns when
    /// it is done; `None` for a drive without one (every write is on the medium when it
    /// completes).
    fn drain_write_cache(&mut self, _at_ns: u64) -> Option<u64> {
        None
    }
}

const SECTOR: u64 = 512;

/// Parameters of a mechanical disk.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HddParams {
    /// Spindle speed, revolutions per minute.
    pub rpm: f64,
    /// 512-byte sectors per track (one zone).
    pub sectors_per_track: u32,
    /// Recording surfaces (tracks per cylinder).
    pub heads: u32,
    /// Cylinders.
    pub cylinders: u32,
    /// Seek time over one cylinder, ms.
    pub seek_single_ms: f64,
    /// Mean seek time over random pairs of cylinders, ms.
    pub seek_avg_ms: f64,
    /// Seek time over the full stroke, ms.
    pub seek_full_ms: f64,
    /// Controller overhead per command, ms.
    pub overhead_ms: f64,
    /// On-drive read-ahead segment, bytes (0: no read-ahead).
    pub segment_bytes: u64,
    /// Interface (bus) rate for data served from the drive's buffer, MB/s (10^6 bytes).
    pub bus_mb_s: f64,
    /// Write-behind cache: a write completes once its data crossed the bus; the drive writes
    /// its cached writes to the medium, sorted and back to back, when the cache (the segment
    /// size, at least 64 KiB) is full, before a read, and on a flush, and a write continuing
    /// a drain in progress streams on. Off in every preset (the seeds' timings assume none);
    /// `write_cache=on` turns it on.
    pub write_cache: bool,
}

impl HddParams {
    /// Media transfer rate in bytes per second.
    pub fn media_bytes_per_s(&self) -> f64 {
        self.sectors_per_track as f64 * SECTOR as f64 * self.rpm / 60.0
    }

    /// One revolution in nanoseconds.
    pub fn revolution_ns(&self) -> f64 {
        60e9 / self.rpm
    }

    /// Capacity in bytes.
    pub fn capacity_bytes(&self) -> u64 {
        self.cylinders as u64 * self.heads as u64 * self.sectors_per_track as u64 * SECTOR
    }
}

/// Seek time as a function of distance in cylinders: `a + b·√d` up to a knee at a third of
/// the stroke, linear from the knee to the full stroke. The knee's time is calibrated so that
/// the mean over random cylinder pairs equals the preset's average seek time.
#[derive(Clone, Debug)]
pub struct SeekCurve {
    a_ms: f64,
    b_ms: f64,
    knee_distance: f64,
    knee_ms: f64,
    slope_ms: f64,
}

impl SeekCurve {
    /// Fits the curve to single-cylinder, average and full-stroke times on `cylinders`.
    pub fn fit(cylinders: u32, single_ms: f64, avg_ms: f64, full_ms: f64) -> SeekCurve {
        let max_distance = (cylinders.max(3) - 1) as f64;
        let knee_distance = (max_distance / 3.0).max(2.0);
        let build = |knee_ms: f64| {
            let b_ms = (knee_ms - single_ms) / (knee_distance.sqrt() - 1.0);
            SeekCurve {
                a_ms: single_ms - b_ms,
                b_ms,
                knee_distance,
                knee_ms,
                slope_ms: (full_ms - knee_ms) / (max_distance - knee_distance).max(1.0),
            }
        };
        // Mean seek over random pairs: distance d has weight (C - d) for d in 1..C.
        let mean = |curve: &SeekCurve| {
            let c = cylinders as f64;
            let step = ((cylinders as usize) / 4000).max(1);
            let (mut sum, mut weight) = (0.0, 0.0);
            let mut d = 1usize;
            while d < cylinders as usize {
                let w = c - d as f64;
                sum += w * curve.time_ms(d as u64);
                weight += w;
                d += step;
            }
            sum / weight
        };
        let (mut low, mut high) = (single_ms, full_ms);
        for _ in 0..60 {
            let middle = 0.5 * (low + high);
            if mean(&build(middle)) < avg_ms {
                low = middle;
            } else {
                high = middle;
            }
        }
        build(0.5 * (low + high))
    }

    /// Seek time over `distance` cylinders, ms (0 for no movement).
    pub fn time_ms(&self, distance: u64) -> f64 {
        if distance == 0 {
            return 0.0;
        }
        let d = distance as f64;
        if d <= self.knee_distance {
            self.a_ms + self.b_ms * d.sqrt()
        } else {
            self.knee_ms + self.slope_ms * (d - self.knee_distance)
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Segment {
    /// First sector the drive prefetched.
    start_sector: u64,
    /// When that sector was under the head.
    start_ns: f64,
    /// Prefetch stops when it reaches this sector (the segment is full).
    limit_sector: u64,
}

/// A mechanical disk in virtual time.
pub struct HddModel {
    params: HddParams,
    curve: SeekCurve,
    revolution_ns: f64,
    sector_ns: f64,
    arm_cylinder: u64,
    busy_until_ns: u64,
    segment: Option<Segment>,
    /// Writes in the write cache, not yet on the medium: (first sector, sectors).
    cached_writes: Vec<(u64, u64)>,
    cached_bytes: u64,
    /// Where and when the medium write stream of the last drain ends: a cached write that
    /// continues it while it is still writing joins it without a rotational wait.
    stream_end_sector: u64,
    stream_end_ns: f64,
}

impl HddModel {
    /// A disk at cylinder 0, idle at time 0.
    pub fn new(params: HddParams) -> Self {
        let curve = SeekCurve::fit(
            params.cylinders,
            params.seek_single_ms,
            params.seek_avg_ms,
            params.seek_full_ms,
        );
        let revolution_ns = params.revolution_ns();
        HddModel {
            sector_ns: revolution_ns / params.sectors_per_track as f64,
            revolution_ns,
            curve,
            params,
            arm_cylinder: 0,
            busy_until_ns: 0,
            segment: None,
            cached_writes: Vec::new(),
            cached_bytes: 0,
            stream_end_sector: u64::MAX,
            stream_end_ns: 0.0,
        }
    }

    /// Writes the cached writes to the medium from `t`, in sector order, contiguous runs as
    /// one stream: returns the end.
    fn drain_cache(&mut self, t: f64) -> f64 {
        let mut writes = std::mem::take(&mut self.cached_writes);
        self.cached_bytes = 0;
        writes.sort_unstable();
        let mut end = t;
        let mut run: Option<(u64, u64)> = None;
        for (first, sectors) in writes {
            run = match run {
                Some((start, stop)) if first <= stop => Some((start, stop.max(first + sectors))),
                Some((start, stop)) => {
                    end = self.media_access(start, stop - start, end);
                    Some((first, first + sectors))
                }
                None => Some((first, first + sectors)),
            };
        }
        if let Some((start, stop)) = run {
            end = self.media_access(start, stop - start, end);
            self.stream_end_sector = stop;
            self.stream_end_ns = end;
        }
        end
    }

    /// The fitted seek curve.
    pub fn seek_curve(&self) -> &SeekCurve {
        &self.curve
    }

    /// The parameters.
    pub fn params(&self) -> &HddParams {
        &self.params
    }

    fn cylinder_of(&self, sector: u64) -> u64 {
        (sector / self.params.sectors_per_track as u64 / self.params.heads as u64)
            .min(self.params.cylinders as u64 - 1)
    }

    fn bus_ns(&self, bytes: u64) -> f64 {
        bytes as f64 / (self.params.bus_mb_s * 1e6) * 1e9
    }

    /// Positions the head at `first` from time `t` and transfers `sectors`: returns the end.
    fn media_access(&mut self, first: u64, sectors: u64, t: f64) -> f64 {
        let cylinder = self.cylinder_of(first);
        let seek_ms = self.curve.time_ms(cylinder.abs_diff(self.arm_cylinder));
        let positioned = t + seek_ms * 1e6;
        let spt = self.params.sectors_per_track as u64;
        let target = (first % spt) as f64 / spt as f64;
        let angle = (positioned % self.revolution_ns) / self.revolution_ns;
        let mut wait = (target - angle).rem_euclid(1.0) * self.revolution_ns;
        if wait > self.revolution_ns - 1e-3 {
            wait = 0.0; // exactly on time (floating-point remainder of a full turn)
        }
        let end = positioned + wait + sectors as f64 * self.sector_ns;
        self.arm_cylinder = self.cylinder_of(first + sectors.max(1) - 1);
        end
    }

    fn start_segment(&mut self, next_sector: u64, at_ns: f64) {
        if self.params.segment_bytes >= SECTOR {
            self.segment = Some(Segment {
                start_sector: next_sector,
                start_ns: at_ns,
                limit_sector: next_sector + self.params.segment_bytes / SECTOR,
            });
        }
    }
}

impl DiskModel for HddModel {
    fn serve(&mut self, op: Op, offset: u64, length: u64, arrival_ns: u64) -> u64 {
        let first = offset / SECTOR;
        let sectors = length.div_ceil(SECTOR).max(1);
        let end_sector = first + sectors;
        let mut start = arrival_ns.max(self.busy_until_ns) as f64;
        if op == Op::Read && !self.cached_writes.is_empty() {
            // The head writes the cache out before it can read.
            start = self.drain_cache(start);
        }
        let t = start + self.params.overhead_ms * 1e6;
        let segment_bytes = self.params.segment_bytes / SECTOR;
        let done = match (op, self.segment) {
            (Op::Read, Some(segment))
                if first >= segment.start_sector && first < segment.limit_sector =>
            {
                let reaches_limit = segment.start_ns
                    + (segment.limit_sector - segment.start_sector) as f64 * self.sector_ns;
                if end_sector <= segment.limit_sector || t <= reaches_limit {
                    // Served from the segment; the prefetch keeps streaming behind the reader.
                    let available = segment.start_ns
                        + (end_sector - segment.start_sector) as f64 * self.sector_ns;
                    let done = (t + self.bus_ns(length)).max(available);
                    let mut segment = segment;
                    segment.limit_sector = segment.limit_sector.max(end_sector + segment_bytes);
                    self.segment = Some(segment);
                    self.arm_cylinder = self.cylinder_of(end_sector);
                    done
                } else {
                    // The segment filled up and prefetch stopped: fetch the rest.
                    let rest = segment.limit_sector;
                    let done = self.media_access(rest, end_sector - rest, t);
                    self.start_segment(end_sector, done);
                    done
                }
            }
            (Op::Read, _) => {
                let done = self.media_access(first, sectors, t);
                self.start_segment(end_sector, done);
                done
            }
            (Op::Write, _) if self.params.write_cache => {
                // Acknowledged once the data is in the cache, while the medium keeps writing.
                // Cached writes drain sorted and back to back when the cache fills; a write
                // that continues a drain still in progress streams on without a rotational
                // wait, so contiguous writes reach the media rate and a gap (rotdelay) costs
                // its rotation.
                self.segment = None;
                let capacity = self.params.segment_bytes.max(64 << 10);
                let capacity_ns = (capacity / SECTOR) as f64 * self.sector_ns;
                let accepted =
                    arrival_ns as f64 + self.params.overhead_ms * 1e6 + self.bus_ns(length);
                if first == self.stream_end_sector
                    && self.stream_end_ns > accepted
                    && self.cached_writes.is_empty()
                {
                    self.stream_end_ns += sectors as f64 * self.sector_ns;
                    self.stream_end_sector = end_sector;
                    self.arm_cylinder = self.cylinder_of(end_sector - 1);
                    self.busy_until_ns = self.stream_end_ns.ceil() as u64;
                    // The cache holds at most `capacity` bytes not yet written.
                    return accepted.max(self.stream_end_ns - capacity_ns).ceil() as u64;
                }
                self.cached_writes.push((first, sectors));
                self.cached_bytes += sectors * SECTOR;
                if self.cached_bytes >= capacity {
                    let from = accepted.max(self.busy_until_ns as f64);
                    self.busy_until_ns = self.drain_cache(from).ceil() as u64;
                }
                return accepted.ceil() as u64;
            }
            (Op::Write, _) => {
                self.segment = None;
                self.media_access(first, sectors, t)
            }
        };
        let done = done.ceil() as u64;
        self.busy_until_ns = done;
        done
    }

    fn capacity_bytes(&self) -> u64 {
        self.params.capacity_bytes()
    }

    fn drain_write_cache(&mut self, at_ns: u64) -> Option<u64> {
        if !self.params.write_cache {
            return None;
        }
        let start = at_ns.max(self.busy_until_ns);
        if !self.cached_writes.is_empty() {
            self.busy_until_ns = self.drain_cache(start as f64).ceil() as u64;
        }
        Some(self.busy_until_ns.max(start))
    }
}

/// Parameters of a queueing device: an SSD or a network disk.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct QueueParams {
    /// Fixed latency of a read (SSD: flash read + controller; network: round trip), µs.
    pub read_latency_us: f64,
    /// Fixed latency of a write, µs.
    pub write_latency_us: f64,
    /// Data rate shared by all requests, MB/s (10^6 bytes).
    pub bandwidth_mb_s: f64,
    /// Requests served in parallel (SSD channels, network requests in flight).
    pub channels: u32,
    /// Capacity in bytes.
    pub capacity_bytes: u64,
}

/// An SSD or a network disk: `channels` requests overlap their latency; their data shares
/// one pipe of `bandwidth_mb_s`.
pub struct QueueModel {
    params: QueueParams,
    channel_free_ns: Vec<u64>,
    pipe_free_ns: u64,
}

impl QueueModel {
    /// An idle device.
    pub fn new(params: QueueParams) -> Self {
        QueueModel {
            channel_free_ns: vec![0; params.channels.max(1) as usize],
            pipe_free_ns: 0,
            params,
        }
    }
}

impl DiskModel for QueueModel {
    fn serve(&mut self, op: Op, _offset: u64, length: u64, arrival_ns: u64) -> u64 {
        let (channel, free) = self
            .channel_free_ns
            .iter()
            .copied()
            .enumerate()
            .min_by_key(|&(index, free)| (free, index))
            .expect("at least one channel");
        let start = arrival_ns.max(free);
        let latency_us = match op {
            Op::Read => self.params.read_latency_us,
            Op::Write => self.params.write_latency_us,
        };
        let transfer_ns = (length as f64 / (self.params.bandwidth_mb_s * 1e6) * 1e9).ceil() as u64;
        let data_start = (start + (latency_us * 1e3) as u64).max(self.pipe_free_ns);
        let done = data_start + transfer_ns;
        self.pipe_free_ns = done;
        self.channel_free_ns[channel] = done;
        done
    }

    fn capacity_bytes(&self) -> u64 {
        self.params.capacity_bytes
    }
}

/// A disk description: a preset with optional overrides, parsed from text.
///
/// Syntax: `PRESET[:key=value,...]`, e.g. `rz25`, `rz25:segment=0`, `nvme:channels=1`,
/// `wan:rtt_ms=80,bandwidth_mb_s=5`. Keys of mechanical presets: `rpm`, `sectors_per_track`,
/// `heads`, `cylinders`, `seek_single_ms`, `seek_avg_ms`, `seek_full_ms`, `overhead_ms`,
/// `segment` (size), `bus_mb_s`, `write_cache` (on or off). Keys of SSD and network presets: `read_latency_us`,
/// `write_latency_us`, `latency_us` (both), `rtt_ms` (both), `bandwidth_mb_s`, `channels`,
/// `inflight` (= channels), `capacity` (size).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DiskSpec {
    /// Preset name (or `custom`).
    pub name: String,
    /// The model and its parameters.
    pub kind: DiskKind,
}

/// Which model a disk uses.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub enum DiskKind {
    /// Mechanical disk.
    Hdd(HddParams),
    /// Flash SSD.
    Ssd(QueueParams),
    /// Network disk.
    Network(QueueParams),
}

/// The preset names `DiskSpec::from_str` knows.
pub const DISK_PRESETS: &[&str] = &[
    "rz25",
    "rz25-1995est",
    "rz28",
    "fireball-tm",
    "travelstar",
    "cheetah9lp",
    "ata2002",
    "hdd7200",
    "nvme",
    "lan",
    "wan",
];

impl DiskSpec {
    /// DEC RZ25 (1991–95 3.5" SCSI-2, 426 MB, 5400 RPM), the disk of seed 000, behind the
    /// NCR 53c810 (a Fast SCSI-2 controller, 10 MB/s synchronous: `bus_mb_s`).
    ///
    /// Sources: the geometry the drive reports in its SCSI mode pages — 62 sectors per track,
    /// 9 heads, 1492 cylinders, 832,527 blocks of 512 bytes (426 MB) — as the SIMH VAX
    /// emulator reproduces it for the RZ25 (`VAX/vax_rzdev.h`, `RZ25_SECTS/SURFS/CYLS/LBN`);
    /// 5400 RPM (DEC's RZ25 specification, also seed 000's "rz25 (not too fast, but not
    /// horrible)"). The media rate follows: 62 × 512 B × 90 rev/s = 2.86 MB/s (one zone; the
    /// reported geometry is the drive's average track). The 53c810's 10 MB/s synchronous
    /// rate is NCR's figure for Fast SCSI-2. **Assumed** (class-typical for a 1991 3.5"
    /// 5400 RPM drive, not checked against a data sheet): seek 2.5 ms track-to-track,
    /// 14 ms average, 26 ms full stroke; 1 ms command overhead; a 64 KiB read-ahead segment;
    /// no write cache (the seed never mentions one).
    pub fn rz25() -> DiskSpec {
        DiskSpec {
            name: "rz25".into(),
            kind: DiskKind::Hdd(HddParams {
                rpm: 5400.0,
                sectors_per_track: 62,
                heads: 9,
                cylinders: 1492,
                seek_single_ms: 2.5,
                seek_avg_ms: 14.0,
                seek_full_ms: 26.0,
                overhead_ms: 1.0,
                segment_bytes: 64 << 10,
                bus_mb_s: 10.0,
                write_cache: false,
            }),
        }
    }

    /// The earlier RZ25 model (44 sectors per track, 14 heads, 1351 cylinders: 2.0 MB/s),
    /// whose geometry was chosen to give 426 MB and a 1–2 MB/s media rate before the drive's
    /// reported geometry (see [`DiskSpec::rz25`]) was found. Kept as `rz25-1995est` so the
    /// figures published before the change can be reproduced; not a sourced preset.
    pub fn rz25_estimate() -> DiskSpec {
        DiskSpec {
            name: "rz25-1995est".into(),
            kind: DiskKind::Hdd(HddParams {
                rpm: 5400.0,
                sectors_per_track: 44,
                heads: 14,
                cylinders: 1351,
                seek_single_ms: 2.5,
                seek_avg_ms: 14.0,
                seek_full_ms: 26.0,
                overhead_ms: 1.0,
                segment_bytes: 64 << 10,
                bus_mb_s: 10.0,
                write_cache: false,
            }),
        }
    }

    /// DEC RZ28B (1994 3.5" Fast SCSI-2, 2.1 GB, 5400 RPM), standing for the 1994 SCSI disk
    /// of seed 002 (whose raw device "delivers about 5 MB/s").
    ///
    /// Source: DEC's SWXD3-SD (RZ28B) data sheet: 2.10 GB formatted, average read seek
    /// 9.9 ms, average latency 5.5 ms (5400 RPM), media transfer rate up to 5.4 MB/s, Fast
    /// SCSI-2 at 10 MB/s synchronous, a 256 KB cache in 3 segments of ≈ 80 KB by default,
    /// banded (zoned) recording. One zone at the outer band's rate stands for the zones
    /// (files of a fresh file system lie at the start of the disk): 5.4 MB/s / (512 B ×
    /// 90 rev/s) = 117 sectors per track. **Assumed**: 16 heads and 2191 cylinders (giving
    /// the 2.1 GB), 1 ms track-to-track and 20 ms full-stroke seeks, 0.5 ms command overhead,
    /// no write cache (the seed never mentions one; its write figures are about clustering).
    pub fn rz28() -> DiskSpec {
        DiskSpec {
            name: "rz28".into(),
            kind: DiskKind::Hdd(HddParams {
                rpm: 5400.0,
                sectors_per_track: 117,
                heads: 16,
                cylinders: 2191,
                seek_single_ms: 1.0,
                seek_avg_ms: 9.9,
                seek_full_ms: 20.0,
                overhead_ms: 0.5,
                segment_bytes: 80 << 10,
                bus_mb_s: 10.0,
                write_cache: false,
            }),
        }
    }

    /// Quantum Fireball TM (1996–97 3.5" ATA, 1.0–3.8 GB), standing for the "IDE disk" of
    /// seed 001's 1997 P150.
    ///
    /// Sources: the Fireball TM product manual (Quantum 81-111394, October 1996) names the
    /// family and capacities; its 4500 RPM spindle (the TM's "better throughput, but slower
    /// seek times due to a 4500 rpm spindle") is from the drive's history as Wikipedia and
    /// Red Hill's hard-drive history tell it. **Assumed** (class values for a 1996 ATA drive,
    /// not checked against the manual's tables): 12 ms average seek, 2.5 ms track-to-track,
    /// 25 ms full stroke, 108 sectors per track (≈ 4.1 MB/s media rate), 2.1 GB (4 heads,
    /// 9600 cylinders), a 128 KiB read-ahead buffer, 0.5 ms command overhead, PIO mode 4 at
    /// 16.7 MB/s on the bus, no write cache.
    pub fn fireball_tm() -> DiskSpec {
        DiskSpec {
            name: "fireball-tm".into(),
            kind: DiskKind::Hdd(HddParams {
                rpm: 4500.0,
                sectors_per_track: 108,
                heads: 4,
                cylinders: 9600,
                seek_single_ms: 2.5,
                seek_avg_ms: 12.0,
                seek_full_ms: 25.0,
                overhead_ms: 0.5,
                segment_bytes: 128 << 10,
                bus_mb_s: 16.7,
                write_cache: false,
            }),
        }
    }

    /// An IBM Travelstar-class 2.5" 4200 RPM ATA drive of 1998–99, standing for the disk of
    /// seed 003's ThinkPad 600E (which IBM shipped with 4.3–6.4 GB Travelstars).
    ///
    /// Sources: 4200 RPM, the speed of the bulk of notebook drives even in 2003 (Disk/Trend's
    /// analyst quoted by eWeek, "Hitachi cranks up mobile drives"); the seed's own uncached
    /// reads, 5.8–6.2 MB/s for 128–256 MB, bound the media rate from below. **Assumed**:
    /// 6.4 GB (4 heads × 14,700 cylinders), 13 ms average seek (IBM quoted 13 ms
    /// for the 1995 Travelstar 2LP, Computerwoche 20.10.1995), 2.5 ms track-to-track, 24 ms
    /// full stroke, 213 sectors per track (≈ 7.6 MB/s media rate at the outer zone), a 512 KiB
    /// buffer, 0.5 ms overhead, Ultra DMA/33 on the bus, no write cache.
    pub fn travelstar() -> DiskSpec {
        DiskSpec {
            name: "travelstar".into(),
            kind: DiskKind::Hdd(HddParams {
                rpm: 4200.0,
                sectors_per_track: 213,
                heads: 4,
                cylinders: 14_700,
                seek_single_ms: 2.5,
                seek_avg_ms: 13.0,
                seek_full_ms: 24.0,
                overhead_ms: 0.5,
                segment_bytes: 512 << 10,
                bus_mb_s: 33.0,
                write_cache: false,
            }),
        }
    }

    /// Seagate Cheetah 9LP (ST39102LW) as DiskSim 2.0 validated it: 10,045 RPM, 6,962
    /// cylinders, 12 surfaces, seek 0.831 ms single-cylinder and 10.627 ms full stroke
    /// (Bucy, Ganger et al., "The DiskSim Simulation Environment Version 2.0 Reference
    /// Manual", CMU, 1999; `cheetah9LP.diskspecs`). Average seek 5.4 ms and the 20 MB/s class
    /// media rate (210 sectors/track, one zone standing for 167–254) are from Seagate's
    /// product manual; 0.3 ms overhead and a 256 KiB segment are assumptions.
    pub fn cheetah9lp() -> DiskSpec {
        DiskSpec {
            name: "cheetah9lp".into(),
            kind: DiskKind::Hdd(HddParams {
                rpm: 10045.0,
                sectors_per_track: 210,
                heads: 12,
                cylinders: 6962,
                seek_single_ms: 0.831,
                seek_avg_ms: 5.4,
                seek_full_ms: 10.627,
                overhead_ms: 0.3,
                segment_bytes: 256 << 10,
                bus_mb_s: 80.0,
                write_cache: false,
            }),
        }
    }

    /// A generic 2002 desktop ATA disk, the class of seed 003's PC: 7200 RPM, 8.9 ms average
    /// seek, ≈ 35 MB/s media rate, 40 GB. Class-typical values (no single datasheet).
    pub fn ata2002() -> DiskSpec {
        DiskSpec {
            name: "ata2002".into(),
            kind: DiskKind::Hdd(HddParams {
                rpm: 7200.0,
                sectors_per_track: 570,
                heads: 4,
                cylinders: 34_000,
                seek_single_ms: 1.0,
                seek_avg_ms: 8.9,
                seek_full_ms: 18.0,
                overhead_ms: 0.3,
                segment_bytes: 512 << 10,
                bus_mb_s: 100.0,
                write_cache: false,
            }),
        }
    }

    /// A modern 7200 RPM 3.5" SATA disk (≈ 1 TB, ≈ 150 MB/s media rate, 8.5 ms average
    /// seek, 0.8 ms track-to-track, 17 ms full stroke; the values current datasheets such as
    /// Seagate BarraCuda / WD Blue give), write cache off, 1 MiB read-ahead segment.
    pub fn hdd7200() -> DiskSpec {
        DiskSpec {
            name: "hdd7200".into(),
            kind: DiskKind::Hdd(HddParams {
                rpm: 7200.0,
                sectors_per_track: 2440,
                heads: 4,
                cylinders: 200_000,
                seek_single_ms: 0.8,
                seek_avg_ms: 8.5,
                seek_full_ms: 17.0,
                overhead_ms: 0.1,
                segment_bytes: 1 << 20,
                bus_mb_s: 550.0,
                write_cache: false,
            }),
        }
    }

    /// A PCIe 3 NVMe SSD: 80 µs read and 20 µs (buffered) write latency, 3,000 MB/s, 8
    /// channels (class values of datasheets such as Samsung 970 EVO: 3.4 GB/s sequential read,
    /// ≈ 15k IOPS at queue depth 1 for 4 KiB random reads).
    pub fn nvme() -> DiskSpec {
        DiskSpec {
            name: "nvme".into(),
            kind: DiskKind::Ssd(QueueParams {
                read_latency_us: 80.0,
                write_latency_us: 20.0,
                bandwidth_mb_s: 3000.0,
                channels: 8,
                capacity_bytes: 512 << 30,
            }),
        }
    }

    /// A network disk on a LAN (NBD over 1 GbE): 0.2 ms round trip, 117 MB/s, 16 in flight.
    pub fn lan() -> DiskSpec {
        DiskSpec {
            name: "lan".into(),
            kind: DiskKind::Network(QueueParams {
                read_latency_us: 200.0,
                write_latency_us: 200.0,
                bandwidth_mb_s: 117.0,
                channels: 16,
                capacity_bytes: 64 << 30,
            }),
        }
    }

    /// A network disk over a WAN: 40 ms round trip (a continental path), 12.5 MB/s
    /// (100 Mbit/s), 16 requests in flight.
    pub fn wan() -> DiskSpec {
        DiskSpec {
            name: "wan".into(),
            kind: DiskKind::Network(QueueParams {
                read_latency_us: 40_000.0,
                write_latency_us: 40_000.0,
                bandwidth_mb_s: 12.5,
                channels: 16,
                capacity_bytes: 64 << 30,
            }),
        }
    }

    /// The preset called `name`.
    pub fn preset(name: &str) -> Option<DiskSpec> {
        Some(match name.to_ascii_lowercase().as_str() {
            "rz25" => Self::rz25(),
            "rz25-1995est" => Self::rz25_estimate(),
            "rz28" => Self::rz28(),
            "fireball-tm" | "fireball" => Self::fireball_tm(),
            "travelstar" => Self::travelstar(),
            "cheetah9lp" | "cheetah" => Self::cheetah9lp(),
            "ata2002" => Self::ata2002(),
            "hdd7200" | "hdd" => Self::hdd7200(),
            "nvme" | "ssd" => Self::nvme(),
            "lan" | "net" => Self::lan(),
            "wan" => Self::wan(),
            _ => return None,
        })
    }

    /// Builds the model.
    pub fn build(&self) -> Box<dyn DiskModel> {
        match &self.kind {
            DiskKind::Hdd(params) => Box::new(HddModel::new(params.clone())),
            DiskKind::Ssd(params) | DiskKind::Network(params) => {
                Box::new(QueueModel::new(params.clone()))
            }
        }
    }

    /// Commands the drive accepts at once: 1 for a mechanical disk (the model does no
    /// command queueing), the channels (requests in flight) of an SSD or network disk.
    pub fn commands_max(&self) -> usize {
        match &self.kind {
            DiskKind::Hdd(_) => 1,
            DiskKind::Ssd(params) | DiskKind::Network(params) => params.channels.max(1) as usize,
        }
    }

    /// Capacity in bytes.
    pub fn capacity_bytes(&self) -> u64 {
        match &self.kind {
            DiskKind::Hdd(params) => params.capacity_bytes(),
            DiskKind::Ssd(params) | DiskKind::Network(params) => params.capacity_bytes,
        }
    }

    /// Bytes the disk moves per revolution when mechanical (for rotdelay gaps).
    pub fn bytes_per_ms(&self) -> f64 {
        match &self.kind {
            DiskKind::Hdd(params) => params.media_bytes_per_s() / 1000.0,
            DiskKind::Ssd(params) | DiskKind::Network(params) => params.bandwidth_mb_s * 1000.0,
        }
    }

    fn set(&mut self, key: &str, value: &str) -> Result<(), SpecError> {
        let number = || -> Result<f64, SpecError> {
            value
                .parse::<f64>()
                .ok()
                .filter(|v| v.is_finite() && *v >= 0.0)
                .ok_or_else(|| SpecError::new(key, value, "a non-negative number"))
        };
        let positive = || -> Result<f64, SpecError> {
            number().and_then(|v| {
                if v > 0.0 {
                    Ok(v)
                } else {
                    Err(SpecError::new(key, value, "a number above 0"))
                }
            })
        };
        let count = || -> Result<u32, SpecError> {
            value
                .parse::<u32>()
                .ok()
                .filter(|&v| v > 0)
                .ok_or_else(|| SpecError::new(key, value, "a whole number from 1 to 2^32-1"))
        };
        let size = || -> Result<u64, SpecError> {
            bufcache::parse_size(value).map_err(|e| SpecError::new(key, value, &e.reason))
        };
        match &mut self.kind {
            DiskKind::Hdd(p) => {
                match key {
                    "rpm" => p.rpm = positive()?,
                    "sectors_per_track" | "spt" => p.sectors_per_track = count()?,
                    "heads" => p.heads = count()?,
                    "cylinders" => p.cylinders = count()?.max(3),
                    "seek_single_ms" => p.seek_single_ms = number()?,
                    "seek_avg_ms" => p.seek_avg_ms = number()?,
                    "seek_full_ms" => p.seek_full_ms = number()?,
                    "overhead_ms" => p.overhead_ms = number()?,
                    "segment" => p.segment_bytes = size()?,
                    "bus_mb_s" => p.bus_mb_s = positive()?,
                    "write_cache" => {
                        p.write_cache = match value {
                            "on" | "1" | "true" => true,
                            "off" | "0" | "false" => false,
                            _ => return Err(SpecError::new(key, value, "on or off")),
                        }
                    }
                    _ => return Err(SpecError::new(
                        key,
                        value,
                        "a key of a mechanical disk: rpm, sectors_per_track, heads, cylinders, \
                         seek_single_ms, seek_avg_ms, seek_full_ms, overhead_ms, segment, bus_mb_s, \
                         write_cache",
                    )),
                }
            }
            DiskKind::Ssd(p) | DiskKind::Network(p) => match key {
                "read_latency_us" => p.read_latency_us = number()?,
                "write_latency_us" => p.write_latency_us = number()?,
                "latency_us" => {
                    p.read_latency_us = number()?;
                    p.write_latency_us = p.read_latency_us;
                }
                "rtt_ms" => {
                    p.read_latency_us = number()? * 1000.0;
                    p.write_latency_us = p.read_latency_us;
                }
                "bandwidth_mb_s" => p.bandwidth_mb_s = positive()?,
                "channels" | "inflight" => p.channels = count()?,
                "capacity" => p.capacity_bytes = size()?,
                _ => {
                    return Err(SpecError::new(
                        key,
                        value,
                        "a key of an SSD or network disk: read_latency_us, write_latency_us, \
                         latency_us, rtt_ms, bandwidth_mb_s, channels, inflight, capacity",
                    ))
                }
            },
        }
        if let DiskKind::Hdd(p) = &self.kind {
            if !(p.seek_single_ms <= p.seek_avg_ms && p.seek_avg_ms <= p.seek_full_ms) {
                return Err(SpecError::new(
                    key,
                    value,
                    "seek times ordered seek_single_ms <= seek_avg_ms <= seek_full_ms",
                ));
            }
        }
        Ok(())
    }
}

impl fmt::Display for DiskSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            DiskKind::Hdd(p) => write!(
                f,
                "{} (HDD {:.0} RPM, seek {}/{}/{} ms, {:.2} MB/s media, overhead {} ms, segment {}{})",
                self.name,
                p.rpm,
                p.seek_single_ms,
                p.seek_avg_ms,
                p.seek_full_ms,
                p.media_bytes_per_s() / 1e6,
                p.overhead_ms,
                bufcache::format_size(p.segment_bytes),
                if p.write_cache { ", write cache" } else { "" }
            ),
            DiskKind::Ssd(p) => write!(
                f,
                "{} (SSD {}/{} µs, {} MB/s, {} channels)",
                self.name, p.read_latency_us, p.write_latency_us, p.bandwidth_mb_s, p.channels
            ),
            DiskKind::Network(p) => write!(
                f,
                "{} (network RTT {} ms, {} MB/s, {} in flight)",
                self.name,
                p.read_latency_us / 1000.0,
                p.bandwidth_mb_s,
                p.channels
            ),
        }
    }
}

/// A disk, workload or host description that could not be parsed; names the bad field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecError {
    /// The field (key) that was refused.
    pub field: String,
    /// The value given.
    pub value: String,
    /// What is allowed.
    pub expected: String,
}

impl SpecError {
    /// A refusal of `value` for `field`, which should have been `expected`.
    pub fn new(field: &str, value: &str, expected: &str) -> Self {
        SpecError {
            field: field.to_string(),
            value: value.to_string(),
            expected: expected.to_string(),
        }
    }
}

impl fmt::Display for SpecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} = `{}` is invalid: expected {}",
            self.field, self.value, self.expected
        )
    }
}

impl std::error::Error for SpecError {}

/// Splits `name[:k=v,k=v]` into the name and its pairs.
pub(crate) fn split_spec(text: &str) -> Result<(String, Vec<(String, String)>), SpecError> {
    let text = text.trim();
    let (name, rest) = match text.split_once(':') {
        Some((name, rest)) => (name, rest),
        None => (text, ""),
    };
    let mut pairs = Vec::new();
    for item in rest.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        match item.split_once('=') {
            Some((key, value)) => pairs.push((key.trim().to_string(), value.trim().to_string())),
            None => pairs.push((item.to_string(), String::new())),
        }
    }
    Ok((name.trim().to_ascii_lowercase(), pairs))
}

impl FromStr for DiskSpec {
    type Err = SpecError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let (name, pairs) = split_spec(text)?;
        let mut spec = DiskSpec::preset(&name).ok_or_else(|| {
            SpecError::new(
                "disk",
                &name,
                &format!("one of {}", DISK_PRESETS.join(", ")),
            )
        })?;
        for (key, value) in pairs {
            spec.set(&key, &value)?;
        }
        Ok(spec)
    }
}
