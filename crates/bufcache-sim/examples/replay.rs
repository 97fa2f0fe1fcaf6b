//! Replays a block trace through the engine on a simulated disk.
//!
//! One run: `cargo run --release -p bufcache-sim --example replay -- TRACE FORMAT
//! [disk=hdd7200] [policy=s3fifo] [cache=64M] [mode=open|closed] [speed=1] [streams=8]
//! [block=4k] [max=N] [noreuse=on|off] [json]`.
//!
//! The README's table: `... --example replay -- TRACE FORMAT table [mode=...] [streams=...]`
//! runs open and closed loop × hdd7200 and nvme × 8, 32, 128 MiB × lru and s3fifo (four at
//! a time) and prints markdown tables.

use bufcache::{format_size, parse_size, CacheConfig, PolicyKind};
use bufcache_sim::bufcache_trace::{open_trace, TraceFormat, TraceOptions, TraceRequest};
use bufcache_sim::{replay_trace, DiskSpec, ReplayMode, ReplayOptions, ReplayReport};

fn load(path: &str, format: &str) -> Vec<TraceRequest> {
    let format: TraceFormat = format.parse().expect("trace format");
    let stream = open_trace(path, format, &TraceOptions::default()).expect("open trace");
    stream.map(|r| r.expect("trace record")).collect()
}

fn run(
    trace: &[TraceRequest],
    disk: &DiskSpec,
    policy: PolicyKind,
    cache: u64,
    noreuse: bool,
    options: &ReplayOptions,
) -> ReplayReport {
    let config = CacheConfig {
        memory_bytes_max: cache,
        buffers_max: (cache / options.block_size).max(65_536),
        policy,
        noreuse_sequential: noreuse,
        ..CacheConfig::default()
    };
    replay_trace(trace.iter().copied(), disk, config, options).expect("replay")
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (path, format) = (&args[0], &args[1]);
    let mut options = ReplayOptions::default();
    let mut disk = "hdd7200".to_string();
    let mut policy = PolicyKind::S3Fifo;
    let mut cache = 64u64 << 20;
    let mut noreuse = true;
    let mut json = false;
    let mut table = false;
    for arg in &args[2..] {
        let (key, value) = arg.split_once('=').unwrap_or((arg, ""));
        match key {
            "disk" => disk = value.to_string(),
            "policy" => policy = value.parse().expect("policy"),
            "cache" => cache = parse_size(value).expect("cache size"),
            "mode" => options.mode = value.parse().expect("mode"),
            "speed" => options.speed = value.parse().expect("speed"),
            "streams" => options.streams = value.parse().expect("streams"),
            "block" => options.block_size = parse_size(value).expect("block size"),
            "max" => options.requests_max = Some(value.parse().expect("max")),
            "noreuse" => noreuse = value != "off",
            "json" => json = true,
            "table" => table = true,
            _ => panic!("unknown argument {arg}"),
        }
    }
    let started = std::time::Instant::now();
    let trace = load(path, format);
    if !table {
        let disk: DiskSpec = disk.parse().expect("disk");
        let report = run(&trace, &disk, policy, cache, noreuse, &options);
        if json {
            println!("{}", report.to_json());
        } else {
            print!("{}", report.to_text());
        }
        eprintln!("(ran in {:.2} s)", started.elapsed().as_secs_f64());
        return;
    }
    let mut cases = Vec::new();
    for mode in [ReplayMode::Open, ReplayMode::Closed] {
        for disk in ["hdd7200", "nvme"] {
            for size in [8u64 << 20, 32 << 20, 128 << 20] {
                for policy in [PolicyKind::Lru, PolicyKind::S3Fifo] {
                    cases.push((mode, disk, size, policy));
                }
            }
        }
    }
    // A few at a time: each run holds the trace, its cache and a per-4 KiB map of the disk.
    let mut reports: Vec<ReplayReport> = Vec::new();
    for chunk in cases.chunks(4) {
        reports.extend(std::thread::scope(|scope| {
            let handles: Vec<_> = chunk
                .iter()
                .map(|&(mode, disk, size, policy)| {
                    let trace = &trace;
                    let options = ReplayOptions {
                        mode,
                        ..options.clone()
                    };
                    scope.spawn(move || {
                        let disk: DiskSpec = disk.parse().unwrap();
                        run(trace, &disk, policy, size, noreuse, &options)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        }));
    }
    for mode in [ReplayMode::Open, ReplayMode::Closed] {
        println!(
            "\n{} loop, {} streams{}:\n",
            mode,
            options.streams,
            if mode == ReplayMode::Open {
                format!(", speed {}", options.speed)
            } else {
                String::new()
            }
        );
        println!(
            "| disk | cache | policy | elapsed_s | req/s | p50_ms | p90_ms | p99_ms | read_p99_ms | block_hit | read_req_hit | dev_reads | avg_KiB | dev_writes | avg_KiB | RA used/wasted | wb age/thr/evict/behind |"
        );
        println!(
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        );
        for r in reports.iter().filter(|r| r.options.mode == mode) {
            let w = &r.writeback_blocks;
            println!(
                "| {} | {} | {} | {:.1} | {:.1} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {} | {:.1} | {} | {:.1} | {}/{} | {}/{}/{}/{} |",
                r.disk.split(' ').next().unwrap_or(""),
                format_size(r.cache_bytes),
                r.policy,
                r.elapsed_s,
                r.requests_per_s,
                r.latency.p50_ms,
                r.latency.p90_ms,
                r.latency.p99_ms,
                r.read_latency.p99_ms,
                r.hit_ratio,
                r.read_request_hit_ratio,
                r.device_reads.requests,
                r.device_reads.average_kib,
                r.device_writes.requests,
                r.device_writes.average_kib,
                r.readahead_used_blocks,
                r.readahead_wasted_blocks,
                w.age,
                w.threshold,
                w.eviction,
                w.write_behind
            );
        }
    }
    eprintln!("(ran in {:.2} s)", started.elapsed().as_secs_f64());
}
