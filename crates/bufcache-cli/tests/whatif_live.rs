//! The live what-if of `serve` predicts what a bigger cache measures: the hit ratio the
//! miniature caches predict at 2× and 4× the configured size is within 0.03 of the hit ratio a
//! fresh server with that much cache measures on the same workload.
//!
//! Method: run a zipf workload of 4 KiB random reads (no sequential runs, so read-ahead and
//! clustering do not add hits the policy model does not have) against a server with a 16 MiB
//! cache and read its `/stats` what-if section; replay the same requests against fresh
//! servers with 32 MiB and 64 MiB caches and read their measured hit ratios. Also checks that
//! `/metrics` carries the gauge, `bufcache stat --once` prints the readable lines and
//! `bufcache stat --plot` draws the curve. Trace capture (`serve --trace`) is checked here too:
//! it sits at the same export adapter.

mod common;

use std::time::Duration;

use bufcache_nbd::NbdClient;
use common::{bufcache_bin, free_tcp_port, run_ok, temp_dir, Rng, Server};

const BLOCK_BYTES: u64 = 4096;
const CACHE_BYTES: u64 = 16 << 20;

/// Zipf(0.9) over `blocks` blocks, ranks scattered over the disk.
fn zipf_blocks(blocks: u64, count: usize, seed: u64) -> Vec<u64> {
    let weights: Vec<f64> = (1..=blocks)
        .map(|rank| 1.0 / (rank as f64).powf(0.9))
        .collect();
    let total: f64 = weights.iter().sum();
    let mut cumulative = Vec::with_capacity(weights.len());
    let mut sum = 0.0;
    for weight in weights {
        sum += weight / total;
        cumulative.push(sum);
    }
    let mut rng = Rng::new(seed);
    (0..count)
        .map(|_| {
            let target = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
            let rank = cumulative.partition_point(|&value| value < target) as u64;
            (rank.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 20) % blocks
        })
        .collect()
}

fn fetch(port: u16, path: &str) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(stream, "GET {path} HTTP/1.0\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response.split_once("\r\n\r\n").unwrap().1.to_string()
}

/// Serves with `cache_bytes`, runs the reads, calls `inspect` with the metrics port while the
/// server still runs, and returns (measured hit ratio, /stats document).
fn run_workload(
    cache_bytes: u64,
    reads: &[u64],
    dir: &std::path::Path,
    name: &str,
    inspect: impl FnOnce(u16),
) -> (f64, serde_json::Value) {
    let port = free_tcp_port();
    let metrics = format!("127.0.0.1:{port}");
    let cache = cache_bytes.to_string();
    let mut server = Server::start(
        dir,
        name,
        &[
            "--backend",
            "memory:256M",
            "--cache-size",
            &cache,
            "--readahead-size-max",
            "0",
            "--metrics",
            &metrics,
        ],
    );
    let client = NbdClient::connect(&server.uri()).expect("connecting");
    let mut buffer = vec![0u8; BLOCK_BYTES as usize];
    for &block in reads {
        client
            .read(block * BLOCK_BYTES, &mut buffer)
            .expect("reading");
    }
    drop(client);
    let stats: serde_json::Value = serde_json::from_str(&fetch(port, "/stats")).unwrap();
    inspect(port);
    server.stop_clean();
    let hits = stats["cache"]["hits"].as_f64().unwrap();
    let misses = stats["cache"]["misses"].as_f64().unwrap();
    (hits / (hits + misses), stats)
}

fn predicted(stats: &serde_json::Value, policy: &str, cache_bytes: u64) -> f64 {
    stats["whatif"]["estimates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|row| row["policy"] == policy && row["cache_size_bytes"] == cache_bytes)
        .unwrap_or_else(|| panic!("no estimate for {policy} at {cache_bytes}: {stats}"))
        ["hit_ratio"]
        .as_f64()
        .unwrap()
}

#[test]
fn whatif_predicts_the_hit_ratio_a_bigger_cache_measures() {
    let dir = temp_dir();
    // 256 MiB of blocks, 90000 reads; a 16 MiB cache (4096 blocks) samples 1 block in 4.
    let reads = zipf_blocks(65_536, 90_000, 17);
    let (measured_1x, stats) = run_workload(CACHE_BYTES, &reads, dir.path(), "base", |port| {
        let metrics = fetch(port, "/metrics");
        assert!(
            metrics.contains(&format!(
                "bufcache_whatif_hit_ratio{{policy=\"s3fifo\",cache_size_bytes=\"{}\"}}",
                2 * CACHE_BYTES
            )),
            "{metrics}"
        );
        let stat = run_ok(
            std::process::Command::new(bufcache_bin()).args([
                "stat",
                &format!("127.0.0.1:{port}"),
                "--once",
            ]),
            Duration::from_secs(30),
        );
        let text = String::from_utf8_lossy(&stat.stdout).to_string();
        assert!(text.contains("at 2× memory (32MiB): hit ratio"), "{text}");
        // The same curve as a plot: both simulated policies against sizes in MiB.
        let plot = dir.path().join("whatif.svg");
        run_ok(
            std::process::Command::new(bufcache_bin()).args([
                "stat",
                &format!("127.0.0.1:{port}"),
                "--plot",
                plot.to_str().unwrap(),
            ]),
            Duration::from_secs(30),
        );
        let svg = std::fs::read_to_string(&plot).unwrap();
        for label in ["cache size (MiB)", "hit ratio (predicted)", "s3fifo", "lru"] {
            assert!(svg.contains(label), "{label} missing from the what-if plot");
        }
    });
    let mut report = format!(
        "1x: measured {measured_1x:.4} predicted {:.4}\n",
        predicted(&stats, "s3fifo", CACHE_BYTES)
    );
    let mut worst = 0.0f64;
    for multiplier in [2u64, 4] {
        let size = multiplier * CACHE_BYTES;
        let (measured, _) =
            run_workload(size, &reads, dir.path(), &format!("x{multiplier}"), |_| {});
        let estimate = predicted(&stats, "s3fifo", size);
        let error = (estimate - measured).abs();
        worst = worst.max(error);
        report.push_str(&format!(
            "{multiplier}x: measured {measured:.4} predicted {estimate:.4} error {error:.4}\n"
        ));
    }
    println!("{report}");
    assert!(worst <= 0.03, "{report}");
}

#[test]
fn trace_capture_records_every_request_for_replay_and_stops_at_its_limit() {
    // Goal: `serve --trace` writes one line per request that `bufcache replay` reads back
    // (same request count, same offsets), and a trace with a size limit stops at it and says
    // so in the log. Method: known reads and writes through the NBD client, then replay the
    // file with the options the server printed; a second server with a 2000-byte limit.
    let dir = temp_dir();
    let trace = dir.path().join("requests.csv");
    let mut server = Server::start(
        dir.path(),
        "traced",
        &[
            "--backend",
            "memory:16M",
            "--trace",
            trace.to_str().unwrap(),
        ],
    );
    let client = NbdClient::connect(&server.uri()).expect("connecting");
    let data = vec![7u8; 8192];
    let mut buffer = vec![0u8; 4096];
    for block in 0..10u64 {
        client.write(block * 8192, &data).expect("writing");
    }
    for round in 0..3u64 {
        for block in 0..20u64 {
            client
                .read((block + round) * 4096, &mut buffer)
                .expect("reading");
        }
    }
    drop(client);
    server.stop_clean();
    let log = server.log_text();
    let options = log
        .split("--trace-options \"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .unwrap_or_else(|| panic!("the log prints the replay command: {log}"));
    let text = std::fs::read_to_string(&trace).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines[0],
        "time_us,export,op,offset_bytes,length_bytes,obj_id"
    );
    assert!(
        lines
            .iter()
            .any(|line| line.ends_with(",0,write,8192,8192,8192")),
        "the second write, as time,export,op,offset,length,obj_id: {text}"
    );
    let reads = lines.iter().filter(|line| line.contains(",read,")).count();
    let writes = lines.iter().filter(|line| line.contains(",write,")).count();
    assert_eq!((reads, writes), (60, 10), "{text}");
    let replay = run_ok(
        std::process::Command::new(bufcache_bin()).args([
            "replay",
            trace.to_str().unwrap(),
            "--format",
            "csv",
            "--trace-options",
            options,
            "--policy",
            "lru",
            "--cache-size",
            "1MiB",
            "--json",
        ]),
        Duration::from_secs(30),
    );
    let rows: serde_json::Value = serde_json::from_slice(&replay.stdout).unwrap();
    assert_eq!(rows[0]["requests"], 70, "{rows}");
    // 20 distinct blocks written (10 × 8 KiB), reads cover blocks 0..22: 2 cold read misses.
    assert_eq!(rows[0]["misses"], 22, "{rows}");
    // A capture needs neither --format nor --trace-options: replay recognises its header.
    let bare = run_ok(
        std::process::Command::new(bufcache_bin()).args([
            "replay",
            trace.to_str().unwrap(),
            "--policy",
            "lru",
            "--cache-size",
            "1MiB",
            "--json",
        ]),
        Duration::from_secs(30),
    );
    let bare_rows: serde_json::Value = serde_json::from_slice(&bare.stdout).unwrap();
    assert_eq!(bare_rows, rows, "{}", String::from_utf8_lossy(&bare.stderr));

    let limited = dir.path().join("limited.csv");
    let mut server = Server::start(
        dir.path(),
        "limited",
        &[
            "--backend",
            "memory:16M",
            "--trace",
            limited.to_str().unwrap(),
            "--trace-size-max",
            "2000",
        ],
    );
    let client = NbdClient::connect(&server.uri()).expect("connecting");
    for block in 0..200u64 {
        client.read(block * 4096, &mut buffer).expect("reading");
    }
    drop(client);
    server.stop_clean();
    let size = std::fs::metadata(&limited).unwrap().len();
    assert!(size <= 2000 && size > 1000, "trace size {size}");
    assert!(
        server.log_text().contains("reached --trace-size-max"),
        "{}",
        server.log_text()
    );
}
