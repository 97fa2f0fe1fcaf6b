//! Trace replay: the requests of a block trace issued through the whole engine on a
//! simulated disk, for time as well as misses.
//!
//! The trace's data requests (reads and writes; other commands and zero-length requests are
//! counted and skipped) become byte-range calls (`read_at` / `write_at`) on **one object**
//! that covers the trace's address range, rounded out to whole blocks: a request touching
//! part of a block covers the whole block (a 512-byte write becomes a 4 KiB block write,
//! with no read-modify-write). The object is laid out contiguously, so device offsets keep
//! the trace's distances (a long jump is a long seek on a mechanical disk).
//!
//! Requests are served by `streams` simulated processes that take them in trace order:
//! - **open loop** ([`ReplayMode::Open`]): request *i* arrives at its trace timestamp
//!   (relative to the first, divided by `speed`); a free stream issues it at once, and when
//!   every stream is busy it queues until one is free. Latency counts from arrival, so it
//!   includes the queueing when the disk cannot keep up.
//! - **closed loop** ([`ReplayMode::Closed`]): each stream issues its next request as soon
//!   as its previous one completes (timestamps are ignored); latency counts from issue.
//!
//! Reads that hit return after the host's CPU costs only; misses block their stream on the
//! disk model; writes are delayed writes that the engine writes back (age, threshold,
//! eviction, write-behind). When the last request has completed, the last stream calls
//! `sync`: its duration and writes are reported apart from the replay's own.
//!
//! The trace is read into memory first (its address range sizes the object); the cache
//! starts cold and the whole trace is measured (no warm-up).

use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, Mutex};

use bufcache::{format_size, CacheConfig, WritebackCause};
use bufcache_trace::{Operation, TraceRequest};
use serde::Serialize;

use crate::disk::DiskSpec;
use crate::experiments::host_for;
use crate::layout::LayoutParams;
use crate::sched::{seconds, sim_cache_config, FileId, Os, Process, SimConfig, SimError};
use crate::sched::{Simulation, Step};

/// Offset of the replayed object on the disk (the layout's first free byte).
const OBJECT_START: u64 = 64 << 10;

/// How requests are issued.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ReplayMode {
    /// At the trace's timestamps (scaled by `speed`); requests queue when every stream is
    /// busy.
    Open,
    /// As fast as possible: each stream issues its next request when its last one completes.
    Closed,
}

impl fmt::Display for ReplayMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReplayMode::Open => "open",
            ReplayMode::Closed => "closed",
        })
    }
}

impl FromStr for ReplayMode {
    type Err = SimError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text.trim().to_ascii_lowercase().as_str() {
            "open" | "open-loop" => Ok(ReplayMode::Open),
            "closed" | "closed-loop" => Ok(ReplayMode::Closed),
            _ => Err(SimError::Invalid(format!(
                "replay mode `{text}` is invalid: expected open or closed"
            ))),
        }
    }
}

/// How a trace is replayed.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ReplayOptions {
    /// Open loop (timestamps) or closed loop (as fast as possible).
    pub mode: ReplayMode,
    /// Open loop: trace time runs this many times faster (2.0 halves every gap). Must be
    /// above 0 and finite; ignored in closed loop.
    pub speed: f64,
    /// Requests outstanding at most: simulated processes issuing requests (1 to 1024;
    /// default 16, a device queue depth). The disk models serve them in issue order.
    pub streams: u32,
    /// Block (buffer) size of the replayed object, bytes: a power of two from 512 to the
    /// engine's `buffer_bytes_max`. Requests are rounded out to whole blocks.
    pub block_size: u64,
    /// Replay only the first this many requests of the trace (counting skipped ones).
    pub requests_max: Option<u64>,
    /// Seed of the simulation's random choices.
    pub seed: u64,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        ReplayOptions {
            mode: ReplayMode::Open,
            speed: 1.0,
            streams: 16,
            block_size: 4096,
            requests_max: None,
            seed: 1,
        }
    }
}

impl ReplayOptions {
    fn validate(&self) -> Result<(), SimError> {
        if !(self.speed > 0.0 && self.speed.is_finite()) {
            return Err(SimError::Invalid(format!(
                "speed = {} is invalid: must be above 0 and finite",
                self.speed
            )));
        }
        if !(1..=1024).contains(&self.streams) {
            return Err(SimError::Invalid(format!(
                "streams = {} is invalid: must be 1 to 1024",
                self.streams
            )));
        }
        if !self.block_size.is_power_of_two() || !(512..=1 << 20).contains(&self.block_size) {
            return Err(SimError::Invalid(format!(
                "block_size = {} is invalid: must be a power of two from 512 to 1 MiB",
                self.block_size
            )));
        }
        Ok(())
    }
}

/// Latency distribution of a set of requests, ms.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct LatencySummary {
    /// Requests measured.
    pub count: u64,
    /// Mean, ms.
    pub mean_ms: f64,
    /// Median (nearest rank), ms.
    pub p50_ms: f64,
    /// 90th percentile, ms.
    pub p90_ms: f64,
    /// 99th percentile, ms.
    pub p99_ms: f64,
    /// Largest, ms.
    pub max_ms: f64,
}

impl LatencySummary {
    fn from_ns(mut values: Vec<u64>) -> Self {
        if values.is_empty() {
            return LatencySummary::default();
        }
        values.sort_unstable();
        let n = values.len();
        let rank = |p: f64| values[((p * n as f64).ceil() as usize).clamp(1, n) - 1] as f64 / 1e6;
        LatencySummary {
            count: n as u64,
            mean_ms: values.iter().map(|&v| v as f64).sum::<f64>() / n as f64 / 1e6,
            p50_ms: rank(0.50),
            p90_ms: rank(0.90),
            p99_ms: rank(0.99),
            max_ms: values[n - 1] as f64 / 1e6,
        }
    }
}

/// Device requests of one direction.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct DeviceSummary {
    /// Requests.
    pub requests: u64,
    /// Bytes.
    pub bytes: u64,
    /// Mean request size, KiB.
    pub average_kib: f64,
}

impl DeviceSummary {
    fn new(requests: u64, bytes: u64) -> Self {
        DeviceSummary {
            requests,
            bytes,
            average_kib: if requests > 0 {
                bytes as f64 / requests as f64 / 1024.0
            } else {
                0.0
            },
        }
    }
}

/// Blocks written back, by cause.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct WritebackSummary {
    /// Older than `dirty_age_max` (the syncer).
    pub age: u64,
    /// Above the background threshold, or a throttled writer.
    pub threshold: u64,
    /// flush / fsync / sync (during the replay: none; the final sync is counted apart).
    pub flush: u64,
    /// To make room.
    pub eviction: u64,
    /// A sequential writer completed a cluster.
    pub write_behind: u64,
    /// Writes that had to write back themselves (above the dirty limit).
    pub throttled_writes: u64,
}

impl WritebackSummary {
    fn from_stats(stats: &bufcache::CacheStats) -> Self {
        WritebackSummary {
            age: stats.writeback(WritebackCause::Age),
            threshold: stats.writeback(WritebackCause::Threshold),
            flush: stats.writeback(WritebackCause::Flush),
            eviction: stats.writeback(WritebackCause::Eviction),
            write_behind: stats.writeback(WritebackCause::WriteBehind),
            throttled_writes: stats.throttled_writes,
        }
    }
}

/// Everything a replay measured. Counters are taken when the last request completed, before
/// the final sync (which is reported in `final_sync_*`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ReplayReport {
    /// The disk.
    pub disk: String,
    /// The host cost model.
    pub host: String,
    /// Replacement policy.
    pub policy: String,
    /// No-reuse placement of sequential streams.
    pub noreuse: bool,
    /// Cache memory limit, bytes.
    pub cache_bytes: u64,
    /// How the trace was replayed.
    pub options: ReplayOptions,
    /// Requests taken from the trace.
    pub trace_requests: u64,
    /// Of those, skipped: neither read nor write, or zero length.
    pub skipped: u64,
    /// Requests replayed.
    pub requests: u64,
    /// Reads replayed.
    pub reads: u64,
    /// Writes replayed.
    pub writes: u64,
    /// Bytes the trace's reads asked for.
    pub read_bytes: u64,
    /// Bytes the trace's writes carried.
    pub write_bytes: u64,
    /// First byte of the replayed object (the trace's lowest offset, rounded down to a block).
    pub address_start: u64,
    /// Length of the object (the trace's address range, whole blocks), bytes.
    pub address_bytes: u64,
    /// Trace time from the first to the last request, s (unscaled).
    pub trace_span_s: f64,
    /// Virtual time from the first arrival to the last completion, s.
    pub elapsed_s: f64,
    /// Requests per second of elapsed time.
    pub requests_per_s: f64,
    /// Trace bytes (read + written) per second of elapsed time, MB/s (10^6 bytes).
    pub mb_per_s: f64,
    /// Latency of every request (open loop: from arrival; closed loop: from issue).
    pub latency: LatencySummary,
    /// Latency of reads.
    pub read_latency: LatencySummary,
    /// Latency of writes.
    pub write_latency: LatencySummary,
    /// Engine block lookups that hit.
    pub hits: u64,
    /// Engine block lookups that missed.
    pub misses: u64,
    /// hits / (hits + misses), blocks, reads and writes.
    pub hit_ratio: f64,
    /// Share of read requests served without a device read of their own.
    pub read_request_hit_ratio: f64,
    /// Device reads (demand, clustered and read-ahead).
    pub device_reads: DeviceSummary,
    /// Device writes (write-back).
    pub device_writes: DeviceSummary,
    /// Time the disk was busy, s.
    pub device_busy_s: f64,
    /// Busy time / elapsed time.
    pub device_utilization: f64,
    /// Blocks read ahead.
    pub readahead_issued_blocks: u64,
    /// Read-ahead blocks a request then used.
    pub readahead_used_blocks: u64,
    /// Read-ahead blocks evicted unused.
    pub readahead_wasted_blocks: u64,
    /// Clean buffers evicted.
    pub evictions: u64,
    /// Blocks written back during the replay, by cause.
    pub writeback_blocks: WritebackSummary,
    /// Dirty bytes left when the last request completed.
    pub dirty_at_end_bytes: u64,
    /// Duration of the final sync, s.
    pub final_sync_s: f64,
    /// Device writes of the final sync.
    pub final_sync_writes: DeviceSummary,
}

impl ReplayReport {
    /// A readable summary.
    pub fn to_text(&self) -> String {
        let o = &self.options;
        let mut out = String::new();
        let mode = match o.mode {
            ReplayMode::Open => format!("open loop at {}x trace speed", o.speed),
            ReplayMode::Closed => "closed loop".to_string(),
        };
        out.push_str(&format!(
            "replay: {} requests ({} reads, {} writes; {} of {} skipped), {mode}, {} streams\n",
            self.requests, self.reads, self.writes, self.skipped, self.trace_requests, o.streams
        ));
        out.push_str(&format!(
            "disk {}, host {}, cache {} {}{}, block {}, object {} at offset {}\n",
            self.disk,
            self.host,
            format_size(self.cache_bytes),
            self.policy,
            if self.noreuse { " + noreuse" } else { "" },
            format_size(o.block_size),
            format_size(self.address_bytes),
            self.address_start
        ));
        out.push_str(&format!(
            "elapsed {:.3} s (trace span {:.3} s), {:.1} requests/s, {:.2} MB/s; final sync {:.3} s, {} writes\n",
            self.elapsed_s,
            self.trace_span_s,
            self.requests_per_s,
            self.mb_per_s,
            self.final_sync_s,
            self.final_sync_writes.requests
        ));
        out.push_str("latency_ms  count     mean      p50      p90      p99      max\n");
        for (name, l) in [
            ("all", &self.latency),
            ("reads", &self.read_latency),
            ("writes", &self.write_latency),
        ] {
            out.push_str(&format!(
                "{name:<10} {:>6} {:>8.3} {:>8.3} {:>8.3} {:>8.3} {:>8.3}\n",
                l.count, l.mean_ms, l.p50_ms, l.p90_ms, l.p99_ms, l.max_ms
            ));
        }
        out.push_str(&format!(
            "cache: hit ratio {:.4} ({} hits, {} misses), read requests without device I/O {:.4}, {} evictions\n",
            self.hit_ratio, self.hits, self.misses, self.read_request_hit_ratio, self.evictions
        ));
        out.push_str(&format!(
            "device: {} reads ({:.1} KiB avg), {} writes ({:.1} KiB avg), busy {:.3} s ({:.1} %)\n",
            self.device_reads.requests,
            self.device_reads.average_kib,
            self.device_writes.requests,
            self.device_writes.average_kib,
            self.device_busy_s,
            self.device_utilization * 100.0
        ));
        out.push_str(&format!(
            "read-ahead: {} blocks issued, {} used, {} wasted\n",
            self.readahead_issued_blocks, self.readahead_used_blocks, self.readahead_wasted_blocks
        ));
        let w = &self.writeback_blocks;
        out.push_str(&format!(
            "write-back blocks: age {}, threshold {}, flush {}, eviction {}, write-behind {}; {} throttled writes; {} dirty at end\n",
            w.age, w.threshold, w.flush, w.eviction, w.write_behind, w.throttled_writes,
            format_size(self.dirty_at_end_bytes)
        ));
        out
    }

    /// The whole report as pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("reports serialize")
    }
}

/// One request, ready to issue.
#[derive(Clone, Copy, Debug)]
struct Prepared {
    arrival_ns: u64,
    write: bool,
    /// Offset in the object, whole blocks.
    offset: u64,
    /// Length, whole blocks.
    length: u64,
}

/// What the streams share.
struct Shared {
    requests: Vec<Prepared>,
    next: usize,
    latencies: Vec<u64>,
    read_hits: u64,
    last_done_ns: u64,
    active: u32,
    end: Option<EndSnapshot>,
}

/// The state when the last request completed, and the final sync.
struct EndSnapshot {
    stats: bufcache::CacheStats,
    busy_ns: u64,
    sync_ns: u64,
    sync_writes: u64,
    sync_write_bytes: u64,
}

/// One replay stream: takes the next request, issues it, records its latency.
struct Stream {
    shared: Arc<Mutex<Shared>>,
    file: FileId,
    open: bool,
}

impl Stream {
    fn shared(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }
}

impl Process for Stream {
    fn step(&mut self, os: &mut Os<'_>) -> Result<Step, SimError> {
        let now = os.now();
        let mut shared = self.shared();
        let index = shared.next;
        let Some(&request) = shared.requests.get(index) else {
            shared.active -= 1;
            if shared.active == 0 {
                // Every other stream has finished (the scheduler runs the earliest timeline
                // first, so this one is the latest): snapshot, then sync.
                let stats = os.cache_stats();
                let before = os.device_totals();
                os.sync()?;
                let after = os.device_totals();
                shared.end = Some(EndSnapshot {
                    stats,
                    busy_ns: before.busy_ns,
                    sync_ns: os.now() - now,
                    sync_writes: after.writes - before.writes,
                    sync_write_bytes: after.write_bytes - before.write_bytes,
                });
            }
            return Ok(Step::Done);
        };
        if self.open && request.arrival_ns > now {
            return Ok(Step::Sleep(request.arrival_ns - now));
        }
        shared.next += 1;
        drop(shared);
        let issued = if self.open { request.arrival_ns } else { now };
        let reads_before = os.account().reads;
        if request.write {
            os.write(self.file, request.offset, request.length)?;
        } else {
            os.read(self.file, request.offset, request.length)?;
        }
        let done = os.now();
        let own_reads = os.account().reads - reads_before;
        let mut shared = self.shared();
        shared.latencies[index] = done - issued;
        if !request.write && own_reads == 0 {
            shared.read_hits += 1;
        }
        shared.last_done_ns = shared.last_done_ns.max(done);
        Ok(Step::Continue)
    }
}

/// Replays `requests` on `disk` through the engine configured by `config` (the simulator
/// forces one shard and no real-time space waits), with the host paired with the disk (see
/// [`host_for`]).
///
/// Errors: invalid options or configuration, a trace without data requests, or an address
/// range larger than the disk (pick a larger one, e.g. `nvme:capacity=2T`).
pub fn replay_trace(
    requests: impl IntoIterator<Item = TraceRequest>,
    disk: &DiskSpec,
    config: CacheConfig,
    options: &ReplayOptions,
) -> Result<ReplayReport, SimError> {
    let mut sim_config = SimConfig::new(disk.clone(), host_for(disk));
    sim_config.cache = sim_cache_config(config);
    replay_trace_with(requests, &sim_config, options)
}

/// A request the replay makes: a read or write of data (not a flush or other operation).
fn is_data(r: &&TraceRequest) -> bool {
    r.operation != Operation::Other && r.length_bytes > 0
}

/// The range of addresses the trace's data requests cover, in whole blocks: (base, length);
/// it must fit the disk.
fn address_range(
    trace: &[TraceRequest],
    block: u64,
    config: &SimConfig,
) -> Result<(u64, u64), SimError> {
    let mut start = u64::MAX;
    let mut end = 0u64;
    for r in trace.iter().filter(is_data) {
        let last = r.offset_bytes.checked_add(r.length_bytes).ok_or_else(|| {
            SimError::Invalid(format!(
                "a request at offset {} of {} bytes ends beyond 2^64",
                r.offset_bytes, r.length_bytes
            ))
        })?;
        start = start.min(r.offset_bytes);
        end = end.max(last);
    }
    if start == u64::MAX {
        return Err(SimError::Invalid(format!(
            "the trace has no read or write requests to replay ({} requests read)",
            trace.len()
        )));
    }
    let base = start / block * block;
    let length = end.div_ceil(block) * block - base;
    let capacity = config.disk.capacity_bytes();
    if length > capacity.saturating_sub(OBJECT_START) {
        return Err(SimError::Invalid(format!(
            "the trace covers {} (offsets {base} to {end}), more than disk {} holds ({}); \
             use a larger disk, e.g. `nvme:capacity=...`",
            format_size(length),
            config.disk,
            format_size(capacity)
        )));
    }
    Ok((base, length))
}

/// The trace's data requests as the replay makes them, and their counts.
struct PreparedTrace {
    requests: Vec<Prepared>,
    reads: u64,
    writes: u64,
    read_bytes: u64,
    write_bytes: u64,
    /// Trace times of the first data request and the last.
    first_us: u64,
    last_us: u64,
}

/// The data requests of `trace` in whole blocks from `base`, arriving at their trace times
/// relative to the first, divided by `speed`, never before the previous one.
fn prepare(trace: &[TraceRequest], base: u64, block: u64, speed: f64) -> PreparedTrace {
    let first_us = trace.iter().find(is_data).map_or(0, |r| r.time_us);
    let mut prepared = PreparedTrace {
        requests: Vec::new(),
        reads: 0,
        writes: 0,
        read_bytes: 0,
        write_bytes: 0,
        first_us,
        last_us: first_us,
    };
    for r in trace.iter().filter(is_data) {
        prepared.last_us = prepared.last_us.max(r.time_us);
        let write = r.operation == Operation::Write;
        if write {
            prepared.writes += 1;
            prepared.write_bytes += r.length_bytes;
        } else {
            prepared.reads += 1;
            prepared.read_bytes += r.length_bytes;
        }
        let first = (r.offset_bytes - base) / block * block;
        let last = (r.offset_bytes + r.length_bytes - base).div_ceil(block) * block;
        prepared.requests.push(Prepared {
            arrival_ns: ((prepared.last_us - first_us) as f64 * 1000.0 / speed) as u64,
            write,
            offset: first,
            length: last - first,
        });
    }
    prepared
}

/// [`replay_trace`] with every part of the simulation given (host, syncer period; the
/// layout and seed are set from `options`).
pub fn replay_trace_with(
    requests: impl IntoIterator<Item = TraceRequest>,
    config: &SimConfig,
    options: &ReplayOptions,
) -> Result<ReplayReport, SimError> {
    options.validate()?;
    let block = options.block_size;
    if block > config.cache.buffer_bytes_max {
        return Err(SimError::Invalid(format!(
            "block_size = {} is invalid: above the engine's buffer_size_max ({})",
            block, config.cache.buffer_bytes_max
        )));
    }
    let limit = options.requests_max.unwrap_or(u64::MAX);
    let trace: Vec<TraceRequest> = requests
        .into_iter()
        .take(limit.min(usize::MAX as u64) as usize)
        .collect();
    let (base, length) = address_range(&trace, block, config)?;
    let PreparedTrace {
        requests: prepared,
        reads,
        writes,
        read_bytes,
        write_bytes,
        first_us,
        last_us,
    } = prepare(&trace, base, block, options.speed);
    let skipped = trace.len() as u64 - prepared.len() as u64;
    let count = prepared.len();

    let mut sim_config = config.clone();
    sim_config.seed = options.seed;
    sim_config.layout = LayoutParams {
        block_size: block as u32,
        fragment_size: block.min(1024) as u32,
        maxcontig: u32::MAX,
        rotdelay_ms: 0.0,
    };
    let mut sim = Simulation::new(&sim_config)?;
    let file = sim.create_file("trace", length)?;
    let shared = Arc::new(Mutex::new(Shared {
        requests: prepared,
        next: 0,
        latencies: vec![0; count],
        read_hits: 0,
        last_done_ns: 0,
        active: options.streams,
        end: None,
    }));
    for index in 0..options.streams {
        sim.spawn(
            &format!("replay-{index}"),
            Box::new(Stream {
                shared: shared.clone(),
                file,
                open: options.mode == ReplayMode::Open,
            }),
            0,
            true,
        );
    }
    sim.run()?;

    let shared = shared.lock().unwrap_or_else(|p| p.into_inner());
    let end = shared
        .end
        .as_ref()
        .ok_or_else(|| SimError::Invalid("the replay ended before its last stream".into()))?;
    let stats = &end.stats;
    let mut all = Vec::with_capacity(count);
    let mut read_latencies = Vec::with_capacity(reads as usize);
    let mut write_latencies = Vec::with_capacity(writes as usize);
    for (request, &latency) in shared.requests.iter().zip(&shared.latencies) {
        all.push(latency);
        if request.write {
            write_latencies.push(latency);
        } else {
            read_latencies.push(latency);
        }
    }
    let elapsed = seconds(shared.last_done_ns);
    let per_s = |x: f64| if elapsed > 0.0 { x / elapsed } else { 0.0 };
    let report = sim.report();
    Ok(ReplayReport {
        disk: report.disk,
        host: report.host,
        policy: config.cache.policy.name().to_string(),
        noreuse: config.cache.noreuse_sequential,
        cache_bytes: config.cache.memory_bytes_max,
        options: options.clone(),
        trace_requests: trace.len() as u64,
        skipped,
        requests: count as u64,
        reads,
        writes,
        read_bytes,
        write_bytes,
        address_start: base,
        address_bytes: length,
        trace_span_s: (last_us - first_us) as f64 / 1e6,
        elapsed_s: elapsed,
        requests_per_s: per_s(count as f64),
        mb_per_s: per_s((read_bytes + write_bytes) as f64 / 1e6),
        latency: LatencySummary::from_ns(all),
        read_latency: LatencySummary::from_ns(read_latencies),
        write_latency: LatencySummary::from_ns(write_latencies),
        hits: stats.hits,
        misses: stats.misses,
        hit_ratio: stats.hit_ratio(),
        read_request_hit_ratio: if reads > 0 {
            shared.read_hits as f64 / reads as f64
        } else {
            0.0
        },
        device_reads: DeviceSummary::new(stats.device_reads.requests, stats.device_reads.bytes),
        device_writes: DeviceSummary::new(stats.device_writes.requests, stats.device_writes.bytes),
        device_busy_s: seconds(end.busy_ns),
        device_utilization: per_s(seconds(end.busy_ns)),
        readahead_issued_blocks: stats.readahead_issued_blocks,
        readahead_used_blocks: stats.readahead_used_blocks,
        readahead_wasted_blocks: stats.readahead_wasted_blocks,
        evictions: stats.evictions,
        writeback_blocks: WritebackSummary::from_stats(stats),
        dirty_at_end_bytes: stats.dirty_bytes,
        final_sync_s: seconds(end.sync_ns),
        final_sync_writes: DeviceSummary::new(end.sync_writes, end.sync_write_bytes),
    })
}
