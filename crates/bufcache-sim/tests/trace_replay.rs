//! Goal: trace replay through the whole engine on a simulated disk is deterministic, replays a
//! real trace completely, and moves time and misses the way cache size and policy should.
//! Method: replay the real CloudPhysics vscsi trace (113,872 requests) completely, open loop
//! at trace speed, on `hdd7200` and `nvme`, and check counts and timing; replay its first
//! 30,000 requests closed loop for the comparisons (cache size, lru vs s3fifo) and twice for
//! byte-identical JSON; small synthetic traces check rounding, skipping and errors.

use std::path::Path;

use bufcache::{CacheConfig, PolicyKind};
use bufcache_sim::bufcache_trace::{
    open_trace, Operation, TraceFormat, TraceOptions, TraceRequest,
};
use bufcache_sim::{replay_trace, DiskSpec, ReplayMode, ReplayOptions, ReplayReport};

const TRACE: &str = "/work/shared/traces/cloudPhysicsIO.vscsi";
const TRACE_REQUESTS: u64 = 113_872;
/// The comparisons replay this prefix: about 20 minutes of the trace, enough for the cache
/// sizes below to fill, and short enough to keep the test under a minute unoptimized.
const PREFIX: u64 = 30_000;

fn trace() -> Option<Vec<TraceRequest>> {
    if !Path::new(TRACE).exists() {
        eprintln!("skipping: {TRACE} is not present");
        return None;
    }
    let stream = open_trace(TRACE, TraceFormat::Vscsi, &TraceOptions::default()).unwrap();
    Some(stream.map(|r| r.unwrap()).collect())
}

fn config(cache: u64, policy: PolicyKind) -> CacheConfig {
    CacheConfig {
        memory_bytes_max: cache,
        policy,
        ..CacheConfig::default()
    }
}

fn closed(max: Option<u64>) -> ReplayOptions {
    ReplayOptions {
        mode: ReplayMode::Closed,
        streams: 8,
        requests_max: max,
        ..ReplayOptions::default()
    }
}

fn run(
    trace: &[TraceRequest],
    disk: &str,
    config: CacheConfig,
    options: &ReplayOptions,
) -> ReplayReport {
    let disk: DiskSpec = disk.parse().unwrap();
    replay_trace(trace.iter().copied(), &disk, config, options).unwrap()
}

fn sane(report: &ReplayReport) {
    assert_eq!(report.requests, report.reads + report.writes);
    assert_eq!(report.latency.count, report.requests);
    assert!(report.latency.p50_ms <= report.latency.p90_ms);
    assert!(report.latency.p90_ms <= report.latency.p99_ms);
    assert!(report.latency.p99_ms <= report.latency.max_ms);
    assert!((0.0..=1.0).contains(&report.hit_ratio));
    assert!((0.0..=1.0).contains(&report.read_request_hit_ratio));
    assert!(report.elapsed_s > 0.0 && report.requests_per_s > 0.0);
    assert!(
        report.device_utilization <= 1.0 + 1e-9,
        "{}",
        report.device_utilization
    );
    assert!(
        report.readahead_used_blocks + report.readahead_wasted_blocks
            <= report.readahead_issued_blocks
    );
    // Every read request that found no block cached issued at least one device read.
    assert!(report.device_reads.requests > 0 && report.device_writes.requests > 0);
}

#[test]
fn replay_is_deterministic() {
    let Some(trace) = trace() else { return };
    let options = ReplayOptions {
        requests_max: Some(10_000),
        ..ReplayOptions::default()
    };
    let first = run(
        &trace,
        "hdd7200",
        config(16 << 20, PolicyKind::S3Fifo),
        &options,
    )
    .to_json();
    let second = run(
        &trace,
        "hdd7200",
        config(16 << 20, PolicyKind::S3Fifo),
        &options,
    )
    .to_json();
    assert_eq!(first, second);
    let first = run(
        &trace,
        "nvme",
        config(16 << 20, PolicyKind::Lru),
        &closed(Some(10_000)),
    );
    let second = run(
        &trace,
        "nvme",
        config(16 << 20, PolicyKind::Lru),
        &closed(Some(10_000)),
    );
    assert_eq!(first.to_json(), second.to_json());
}

#[test]
fn real_trace_replays_completely_on_hdd_and_nvme() {
    let Some(trace) = trace() else { return };
    assert_eq!(trace.len() as u64, TRACE_REQUESTS);
    let options = ReplayOptions::default(); // open loop at trace speed, 16 streams
    let hdd = run(
        &trace,
        "hdd7200",
        config(64 << 20, PolicyKind::S3Fifo),
        &options,
    );
    let nvme = run(
        &trace,
        "nvme",
        config(64 << 20, PolicyKind::S3Fifo),
        &options,
    );
    for report in [&hdd, &nvme] {
        sane(report);
        assert_eq!(report.trace_requests, TRACE_REQUESTS);
        assert_eq!(report.skipped, 0);
        assert_eq!(report.requests, TRACE_REQUESTS);
        assert_eq!((report.reads, report.writes), (46_974, 66_898));
        // Two hours of trace; open loop cannot finish before the last arrival.
        assert!(
            (report.trace_span_s - 7200.09).abs() < 0.01,
            "{}",
            report.trace_span_s
        );
        assert!(report.elapsed_s >= report.trace_span_s);
        assert!(
            report.elapsed_s < report.trace_span_s + 60.0,
            "{}",
            report.elapsed_s
        );
        let written = report.device_writes.bytes + report.final_sync_writes.bytes;
        assert!(
            written >= report.write_bytes / 2,
            "write-back lost data: {written}"
        );
    }
    // The same cache sees about the same misses; the disk decides the time.
    let misses = |r: &ReplayReport| r.misses as f64;
    assert!((misses(&hdd) / misses(&nvme) - 1.0).abs() < 0.05);
    assert!(hdd.read_latency.p50_ms > 10.0 * nvme.read_latency.p50_ms);
    assert!(hdd.read_latency.p99_ms > 10.0 * nvme.read_latency.p99_ms);
    assert!(
        nvme.read_latency.p99_ms < 5.0,
        "{}",
        nvme.read_latency.p99_ms
    );
    assert!(hdd.device_busy_s > 10.0 * nvme.device_busy_s);
}

#[test]
fn bigger_cache_means_fewer_misses_and_less_time() {
    let Some(trace) = trace() else { return };
    let options = closed(Some(PREFIX));
    let sizes = [8u64 << 20, 32 << 20, 128 << 20];
    let reports: Vec<ReplayReport> = sizes
        .iter()
        .map(|&size| {
            run(
                &trace,
                "hdd7200",
                config(size, PolicyKind::S3Fifo),
                &options,
            )
        })
        .collect();
    for pair in reports.windows(2) {
        let (small, big) = (&pair[0], &pair[1]);
        sane(small);
        sane(big);
        assert!(
            big.misses < small.misses,
            "{} !< {}",
            big.misses,
            small.misses
        );
        // Bytes, not requests: with more blocks resident, runs of misses are shorter, so a
        // bigger cache can issue more (smaller) device reads while reading fewer bytes.
        assert!(
            big.device_reads.bytes <= small.device_reads.bytes,
            "device read bytes {} !<= {} (requests {} vs {})",
            big.device_reads.bytes,
            small.device_reads.bytes,
            big.device_reads.requests,
            small.device_reads.requests
        );
        assert!(big.read_request_hit_ratio > small.read_request_hit_ratio);
        assert!(
            big.elapsed_s < small.elapsed_s,
            "{} !< {}",
            big.elapsed_s,
            small.elapsed_s
        );
    }
}

#[test]
fn s3fifo_and_lru_compare_sanely() {
    let Some(trace) = trace() else { return };
    let options = closed(Some(PREFIX));
    for size in [8u64 << 20, 64 << 20] {
        let lru = run(&trace, "nvme", config(size, PolicyKind::Lru), &options);
        let s3fifo = run(&trace, "nvme", config(size, PolicyKind::S3Fifo), &options);
        sane(&lru);
        sane(&s3fifo);
        // Same requests, same lookups; the policies differ by a modest margin at most.
        assert_eq!(lru.requests, s3fifo.requests);
        assert_eq!(lru.hits + lru.misses, s3fifo.hits + s3fifo.misses);
        let ratio = s3fifo.misses as f64 / lru.misses as f64;
        assert!(
            (0.8..1.1).contains(&ratio),
            "s3fifo/lru misses at {size}: {ratio}"
        );
        // Time follows device reads.
        let reads = s3fifo.device_reads.requests as f64 / lru.device_reads.requests as f64;
        assert!((0.8..1.1).contains(&reads), "{reads}");
    }
}

fn request(time_us: u64, operation: Operation, offset: u64, length: u64) -> TraceRequest {
    TraceRequest {
        time_us,
        operation,
        offset_bytes: offset,
        length_bytes: length,
        object_id: offset / 512,
    }
}

#[test]
fn requests_are_rounded_to_blocks_and_others_skipped() {
    let trace = vec![
        request(1_000, Operation::Write, 1_000_000 + 100, 512),
        request(2_000, Operation::Other, 0, 0),
        request(3_000, Operation::Read, 1_000_000, 3000),
        request(4_000, Operation::Read, 1_000_000 + 8192, 0),
        request(5_000, Operation::Read, 3_000_000, 10_000),
    ];
    let disk = DiskSpec::nvme();
    let report = replay_trace(
        trace.clone(),
        &disk,
        CacheConfig::default(),
        &ReplayOptions::default(),
    )
    .unwrap();
    assert_eq!(
        (report.trace_requests, report.skipped, report.requests),
        (5, 2, 3)
    );
    assert_eq!((report.reads, report.writes), (2, 1));
    assert_eq!(report.read_bytes, 3000 + 10_000);
    // 1,000,000 rounds down to 999,424 (block 244); 3,010,000 rounds up to 3,010,560.
    assert_eq!(report.address_start, 999_424);
    assert_eq!(report.address_bytes, 3_010_560 - 999_424);
    // The 512-byte write covered its whole block, so the read of it hits.
    assert_eq!(report.read_request_hit_ratio, 0.5);
    assert!((report.trace_span_s - 0.004).abs() < 1e-9);
    // Open loop at speed 4: the last request arrives at 1 ms.
    let fast = ReplayOptions {
        speed: 4.0,
        ..ReplayOptions::default()
    };
    let report = replay_trace(trace.clone(), &disk, CacheConfig::default(), &fast).unwrap();
    assert!(
        report.elapsed_s >= 0.001 && report.elapsed_s < 0.002,
        "{}",
        report.elapsed_s
    );
    // requests_max counts skipped requests too.
    let capped = ReplayOptions {
        requests_max: Some(3),
        ..ReplayOptions::default()
    };
    let report = replay_trace(trace, &disk, CacheConfig::default(), &capped).unwrap();
    assert_eq!((report.trace_requests, report.requests), (3, 2));
}

#[test]
fn bad_input_is_refused_with_a_reason() {
    let disk: DiskSpec = "nvme:capacity=1G".parse().unwrap();
    let options = ReplayOptions::default();
    let far = vec![
        request(0, Operation::Read, 0, 4096),
        request(1, Operation::Read, 4 << 30, 4096),
    ];
    let error = replay_trace(far, &disk, CacheConfig::default(), &options)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("more than disk") && error.contains("capacity"),
        "{error}"
    );
    let none = vec![request(0, Operation::Other, 0, 0)];
    let error = replay_trace(none, &disk, CacheConfig::default(), &options)
        .unwrap_err()
        .to_string();
    assert!(error.contains("no read or write"), "{error}");
    for bad in [
        ReplayOptions {
            speed: 0.0,
            ..ReplayOptions::default()
        },
        ReplayOptions {
            streams: 0,
            ..ReplayOptions::default()
        },
        ReplayOptions {
            block_size: 3000,
            ..ReplayOptions::default()
        },
    ] {
        let one = vec![request(0, Operation::Read, 0, 4096)];
        assert!(replay_trace(one, &disk, CacheConfig::default(), &bad).is_err());
    }
    assert_eq!("closed".parse::<ReplayMode>().unwrap(), ReplayMode::Closed);
    assert!("sideways".parse::<ReplayMode>().is_err());
}
