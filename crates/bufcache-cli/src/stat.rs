//! `bufcache stat`: a live view of a running server, in the spirit of systat and iostat.
//!
//! It polls the server's `/stats` endpoint and prints one line per interval computed from the
//! difference of two snapshots: transfers per second and MB/s at the backends, the average
//! transfer size (bytes over requests of the same interval, both directions — seed 001's
//! complaint was an iostat that got this wrong), the interval's hit ratio, dirty and wired
//! memory, read-ahead efficiency (used over issued), NBD connections open, NBD requests per
//! second and the interval's 99th-percentile request latency, buffer waits per second and
//! their mean wait (`bufcache_buffer_waits_total`, `bufcache_buffer_wait_seconds`),
//! eviction candidates examined per eviction, and cold reads streamed per second (served from
//! the device without being cached, `bufcache_streamed_reads_total`). `--once` prints the totals so
//! far, with a line per NBD command (requests, bytes, errors, mean, p50 and p99 latency).

use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use serde_json::Value;

use crate::metrics::fetch_stats;

/// Arguments of `bufcache stat`.
#[derive(Args, Debug)]
#[command(after_help = "Examples:\n  \
    bufcache serve --metrics 127.0.0.1:9187 &\n  \
    bufcache stat 127.0.0.1:9187                # a line per second\n  \
    bufcache stat 127.0.0.1:9187 --interval 5 --count 12\n  \
    bufcache stat 127.0.0.1:9187 --once --json  # totals so far, for scripts\n  \
    bufcache stat 127.0.0.1:9187 --plot whatif.svg  # the live what-if curve")]
pub struct StatArgs {
    /// The server's metrics address, HOST:PORT (from `bufcache serve --metrics`).
    address: String,
    /// Seconds between lines.
    #[arg(long, default_value_t = 1.0)]
    interval: f64,
    /// Lines to print before exiting (default: until interrupted).
    #[arg(long)]
    count: Option<u64>,
    /// Print totals since the server started and exit.
    #[arg(long)]
    once: bool,
    /// JSON instead of text.
    #[arg(long)]
    json: bool,
    /// Draw the server's live what-if curve (predicted hit ratio against cache size, a line
    /// per simulated policy) into FILE, SVG or PNG by its extension, and exit.
    #[arg(long, value_name = "FILE.svg|FILE.png", value_parser = crate::plot::parse_plot_path)]
    plot: Option<std::path::PathBuf>,
    /// With --once: the object store's price, in dollars, of 1,000 PUT, POST or LIST
    /// requests (default: AWS S3 Standard's list price).
    #[arg(long, value_name = "DOLLARS", default_value_t = PUT_PRICE_PER_1000_DEFAULT)]
    put_price_per_1000: f64,
    /// With --once: the object store's price, in dollars, of 1,000 GET or HEAD requests
    /// (default: AWS S3 Standard's list price). DELETE is free.
    #[arg(long, value_name = "DOLLARS", default_value_t = GET_PRICE_PER_1000_DEFAULT)]
    get_price_per_1000: f64,
}

/// AWS S3 Standard's list price of 1,000 PUT, COPY, POST or LIST requests, in dollars.
pub const PUT_PRICE_PER_1000_DEFAULT: f64 = 0.005;
/// AWS S3 Standard's list price of 1,000 GET, SELECT or other (HEAD) requests, in dollars.
pub const GET_PRICE_PER_1000_DEFAULT: f64 = 0.0004;

/// Requests of `method` in an export's `store` document, over every outcome but
/// `transport_error` (a request that got no answer is not billed).
fn store_requests(store: &Value, method: &str) -> f64 {
    store
        .pointer(&format!("/requests/{method}"))
        .and_then(Value::as_object)
        .into_iter()
        .flatten()
        .filter(|(outcome, _)| *outcome != "transport_error")
        .filter_map(|(_, count)| count.as_f64())
        .sum()
}

/// The dollars an export's store requests cost at the given prices per 1,000.
fn store_cost(store: &Value, put_price_per_1000: f64, get_price_per_1000: f64) -> f64 {
    let puts: f64 = ["PUT", "POST", "LIST"]
        .iter()
        .map(|method| store_requests(store, method))
        .sum();
    let gets: f64 = ["GET", "HEAD"]
        .iter()
        .map(|method| store_requests(store, method))
        .sum();
    (puts * put_price_per_1000 + gets * get_price_per_1000) / 1000.0
}

/// The object store's and the local tier's totals of every export that has them, for
/// `--once`.
fn store_and_tier_lines(
    stats: &Value,
    put_price_per_1000: f64,
    get_price_per_1000: f64,
) -> Vec<String> {
    let mut lines = Vec::new();
    let exports = stats.get("exports").and_then(Value::as_array);
    for export in exports.into_iter().flatten() {
        let name = export.get("name").and_then(Value::as_str).unwrap_or("");
        let size = |value: &Value, key: &str| {
            bufcache::device::size::format_size_rounded(
                value.get(key).and_then(Value::as_u64).unwrap_or(0),
            )
        };
        let count = |value: &Value, key: &str| value.get(key).and_then(Value::as_u64).unwrap_or(0);
        if let Some(store) = export.get("store").filter(|store| store.is_object()) {
            let methods: Vec<String> = bufcache_s3::STORE_METHODS
                .iter()
                .map(|method| {
                    let all: f64 = store
                        .pointer(&format!("/requests/{method}"))
                        .and_then(Value::as_object)
                        .into_iter()
                        .flatten()
                        .filter_map(|(_, count)| count.as_f64())
                        .sum();
                    format!("{method} {all}")
                })
                .collect();
            let outcome = |outcome: &str| -> f64 {
                bufcache_s3::STORE_METHODS
                    .iter()
                    .filter_map(|method| {
                        store
                            .pointer(&format!("/requests/{method}/{outcome}"))
                            .and_then(Value::as_f64)
                    })
                    .sum()
            };
            lines.push(format!(
                "store {name:?}: {}; 4xx {} 5xx {} no answer {}; retries {}; in flight {}; sent {} received {}",
                methods.join(" "),
                outcome("client_error"),
                outcome("server_error"),
                outcome("transport_error"),
                count(store, "retries"),
                count(store, "in_flight"),
                size(store, "bytes_sent"),
                size(store, "bytes_received"),
            ));
            lines.push(format!(
                "store {name:?}: request cost ${:.6} (${put_price_per_1000} per 1,000 PUT/POST/LIST, ${get_price_per_1000} per 1,000 GET/HEAD)",
                store_cost(store, put_price_per_1000, get_price_per_1000)
            ));
            if let Some(role) = store.get("role").and_then(Value::as_str) {
                let seconds = |key: &str| {
                    store
                        .get(key)
                        .and_then(Value::as_f64)
                        .map(|value| {
                            format!(
                                ", {} {value:.1} s",
                                key.trim_end_matches("_seconds").replace('_', " ")
                            )
                        })
                        .unwrap_or_default()
                };
                lines.push(format!(
                    "store {name:?}: role {role}{}{}",
                    seconds("lease_age_seconds"),
                    seconds("replica_lag_seconds")
                ));
            }
            if let Some(log) = store.get("log").filter(|log| log.is_object()) {
                lines.push(format!(
                    "store {name:?} log layout: live {} garbage {} segments {} gc passes {} gc moved {}",
                    size(log, "live_bytes"),
                    size(log, "garbage_bytes"),
                    count(log, "segments"),
                    count(log, "gc_passes"),
                    size(log, "gc_bytes_moved"),
                ));
            }
        }
        if let Some(tier) = export.get("local_tier").filter(|tier| tier.is_object()) {
            lines.push(format!(
                "local tier {name:?}: dirty {} log {} of {} epochs pending {} read blocks local {} remote {} write-back epochs {} failures in a row {} fallbacks {}",
                size(tier, "dirty_bytes"),
                size(tier, "log_used_bytes"),
                size(tier, "log_capacity_bytes"),
                count(tier, "epochs_pending"),
                count(tier, "read_blocks_local"),
                count(tier, "read_blocks_remote"),
                count(tier, "writeback_epochs"),
                count(tier, "writeback_failures_in_a_row"),
                count(tier, "fallbacks"),
            ));
        }
    }
    lines
}

/// The figures of one line.
#[derive(Debug, Default, Clone, PartialEq)]
struct Line {
    transfers_per_second: f64,
    read_megabytes_per_second: f64,
    write_megabytes_per_second: f64,
    average_transfer_kib: f64,
    hit_ratio: f64,
    dirty_bytes: u64,
    pinned_bytes: u64,
    readahead_efficiency: f64,
    /// NBD connections open at the end of the interval, over all exports.
    connections_open: u64,
    /// NBD requests per second (every command, every export).
    nbd_requests_per_second: f64,
    /// The interval's 99th-percentile NBD request latency, as the upper bound of its
    /// histogram bucket, in milliseconds (0 without requests; infinite past the last bound).
    latency_p99_ms: f64,
    /// Reservations per second that found no buffer free and waited for one.
    buffer_waits_per_second: f64,
    /// Their mean wait in milliseconds (0 without waits).
    buffer_wait_mean_ms: f64,
    /// Eviction candidates examined per eviction (about 1 when busy buffers are off the
    /// queues; 0 without evictions).
    candidates_per_eviction: f64,
    /// Device reads per second that served a cold read without caching it (streaming).
    streamed_reads_per_second: f64,
}

/// Every export's NBD latency histogram summed per bucket, for the command `command` (or all
/// commands when None).
fn latency_buckets(stats: &Value, command: Option<&str>) -> Vec<f64> {
    let mut sums: Vec<f64> = Vec::new();
    let exports = stats.get("exports").and_then(Value::as_array);
    for export in exports.into_iter().flatten() {
        let commands = export.pointer("/nbd/commands").and_then(Value::as_object);
        for (name, meter) in commands.into_iter().flatten() {
            if command.is_some_and(|wanted| wanted != name) {
                continue;
            }
            let buckets = meter.get("latency_buckets").and_then(Value::as_array);
            for (index, count) in buckets.into_iter().flatten().enumerate() {
                if sums.len() <= index {
                    sums.resize(index + 1, 0.0);
                }
                sums[index] += count.as_f64().unwrap_or(0.0);
            }
        }
    }
    sums
}

/// The upper bound in milliseconds of the bucket holding quantile `q` of `counts`.
fn quantile_ms(stats: &Value, counts: &[f64], q: f64) -> f64 {
    let total: f64 = counts.iter().sum();
    if total <= 0.0 {
        return 0.0;
    }
    let limits: Vec<f64> = stats
        .get("exports")
        .and_then(Value::as_array)
        .and_then(|exports| exports.first())
        .and_then(|export| export.pointer("/nbd/latency_bucket_limits_seconds"))
        .and_then(Value::as_array)
        .map(|limits| limits.iter().filter_map(Value::as_f64).collect())
        .unwrap_or_default();
    let mut cumulative = 0.0;
    for (index, count) in counts.iter().enumerate() {
        cumulative += count;
        if cumulative >= q * total {
            return limits
                .get(index)
                .map_or(f64::INFINITY, |limit| limit * 1000.0);
        }
    }
    f64::INFINITY
}

/// Sum over exports of the number at `path` inside each export.
fn exports_sum(stats: &Value, path: &str) -> f64 {
    stats
        .get("exports")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|export| export.pointer(path).and_then(Value::as_f64))
        .sum()
}

/// Per-command totals since start, one line each, for `--once`.
fn command_lines(stats: &Value) -> Vec<String> {
    let mut lines = vec![format!(
        "nbd connections open {} (since start {})",
        exports_sum(stats, "/nbd/connections_open"),
        exports_sum(stats, "/nbd/connections_total")
    )];
    for command in crate::request_meters::COMMANDS {
        let requests = exports_sum(stats, &format!("/nbd/commands/{command}/requests"));
        if requests == 0.0 {
            continue;
        }
        let seconds = exports_sum(
            stats,
            &format!("/nbd/commands/{command}/latency_seconds_sum"),
        );
        let buckets = latency_buckets(stats, Some(command));
        lines.push(format!(
            "nbd {command:<12} {requests:>10} requests {:>10} {:>6} errors   mean {:.3} ms  p50 <= {} ms  p99 <= {} ms",
            bufcache::device::size::format_size_rounded(
                exports_sum(stats, &format!("/nbd/commands/{command}/bytes")) as u64
            ),
            exports_sum(stats, &format!("/nbd/commands/{command}/errors")),
            seconds * 1000.0 / requests,
            quantile_ms(stats, &buckets, 0.5),
            quantile_ms(stats, &buckets, 0.99),
        ));
    }
    lines
}

fn number(value: &Value, path: &[&str]) -> f64 {
    path.iter()
        .try_fold(value, |node, key| node.get(key))
        .and_then(Value::as_f64)
        .unwrap_or(0.0)
}

/// Totals of the backend counters over all exports: (requests, read bytes, write bytes).
fn backend_totals(stats: &Value) -> (f64, f64, f64) {
    let exports = stats
        .get("exports")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    exports
        .iter()
        .fold((0.0, 0.0, 0.0), |(requests, read, written), export| {
            (
                requests
                    + number(export, &["device", "reads", "requests"])
                    + number(export, &["device", "writes", "requests"]),
                read + number(export, &["device", "reads", "bytes"]),
                written + number(export, &["device", "writes", "bytes"]),
            )
        })
}

/// One line from the difference between `earlier` and `later`, `seconds` apart.
fn line_between(earlier: &Value, later: &Value, seconds: f64) -> Line {
    let (requests_0, read_0, written_0) = backend_totals(earlier);
    let (requests_1, read_1, written_1) = backend_totals(later);
    let delta = |path: &[&str]| number(later, path) - number(earlier, path);
    let requests = requests_1 - requests_0;
    let bytes = (read_1 - read_0) + (written_1 - written_0);
    let hits = delta(&["cache", "hits"]);
    let lookups = hits + delta(&["cache", "misses"]);
    let issued = delta(&["cache", "readahead_issued_blocks"]);
    let buckets_1 = latency_buckets(later, None);
    let buckets_0 = latency_buckets(earlier, None);
    let interval_buckets: Vec<f64> = buckets_1
        .iter()
        .enumerate()
        .map(|(index, count)| count - buckets_0.get(index).copied().unwrap_or(0.0))
        .collect();
    let nbd_requests: f64 = interval_buckets.iter().sum();
    let buffer_waits = delta(&["cache", "buffer_waits"]);
    let evictions = delta(&["cache", "evictions"]);
    Line {
        buffer_waits_per_second: buffer_waits / seconds,
        buffer_wait_mean_ms: if buffer_waits > 0.0 {
            delta(&["cache", "buffer_wait_seconds"]) / buffer_waits * 1e3
        } else {
            0.0
        },
        candidates_per_eviction: if evictions > 0.0 {
            delta(&["cache", "eviction_candidates_examined"]) / evictions
        } else {
            0.0
        },
        streamed_reads_per_second: delta(&["cache", "streamed_reads"]) / seconds,
        connections_open: exports_sum(later, "/nbd/connections_open") as u64,
        nbd_requests_per_second: nbd_requests / seconds,
        latency_p99_ms: quantile_ms(later, &interval_buckets, 0.99),
        transfers_per_second: requests / seconds,
        read_megabytes_per_second: (read_1 - read_0) / seconds / 1e6,
        write_megabytes_per_second: (written_1 - written_0) / seconds / 1e6,
        average_transfer_kib: if requests > 0.0 {
            bytes / requests / 1024.0
        } else {
            0.0
        },
        hit_ratio: if lookups > 0.0 { hits / lookups } else { 0.0 },
        dirty_bytes: number(later, &["cache", "dirty_bytes"]) as u64,
        pinned_bytes: number(later, &["cache", "pinned_bytes"]) as u64,
        readahead_efficiency: if issued > 0.0 {
            delta(&["cache", "readahead_used_blocks"]) / issued
        } else {
            0.0
        },
    }
}

fn print_line(line: &Line, json: bool) {
    if json {
        let value = serde_json::json!({
            "transfers_per_second": line.transfers_per_second,
            "read_megabytes_per_second": line.read_megabytes_per_second,
            "write_megabytes_per_second": line.write_megabytes_per_second,
            "average_transfer_kib": line.average_transfer_kib,
            "hit_ratio": line.hit_ratio,
            "dirty_bytes": line.dirty_bytes,
            "pinned_bytes": line.pinned_bytes,
            "readahead_efficiency": line.readahead_efficiency,
            "connections_open": line.connections_open,
            "nbd_requests_per_second": line.nbd_requests_per_second,
            "latency_p99_ms": if line.latency_p99_ms.is_finite() { line.latency_p99_ms } else { -1.0 },
            "buffer_waits_per_second": line.buffer_waits_per_second,
            "buffer_wait_mean_ms": line.buffer_wait_mean_ms,
            "candidates_per_eviction": line.candidates_per_eviction,
            "streamed_reads_per_second": line.streamed_reads_per_second,
        });
        println!("{value}");
        return;
    }
    println!(
        "{:>9.1} {:>8.2} {:>8.2} {:>8.1} {:>6.1} {:>10} {:>10} {:>7.1} {:>6} {:>9.1} {:>8.3} {:>8.1} {:>8.3} {:>7.2} {:>8.1}",
        line.transfers_per_second,
        line.read_megabytes_per_second,
        line.write_megabytes_per_second,
        line.average_transfer_kib,
        line.hit_ratio * 100.0,
        bufcache::device::size::format_size_rounded(line.dirty_bytes),
        bufcache::device::size::format_size_rounded(line.pinned_bytes),
        line.readahead_efficiency * 100.0,
        line.connections_open,
        line.nbd_requests_per_second,
        line.latency_p99_ms,
        line.buffer_waits_per_second,
        line.buffer_wait_mean_ms,
        line.candidates_per_eviction,
        line.streamed_reads_per_second
    );
}

pub fn run(args: StatArgs) -> anyhow::Result<()> {
    for (flag, price) in [
        ("--put-price-per-1000", args.put_price_per_1000),
        ("--get-price-per-1000", args.get_price_per_1000),
    ] {
        if !(price.is_finite() && price >= 0.0) {
            bail!("{flag} {price}: must be a price in dollars, 0 or more");
        }
    }
    if !(args.interval > 0.0 && args.interval <= 3600.0) {
        bail!(
            "--interval {}: must be above 0 and at most 3600 seconds",
            args.interval
        );
    }
    let first = fetch_stats(&args.address)?;
    if let Some(path) = &args.plot {
        crate::whatif::whatif_plot(&first)?.write(path)?;
        eprintln!("bufcache: wrote {}", path.display());
        return Ok(());
    }
    if args.once {
        if args.json {
            println!("{first}");
        } else {
            print_totals(&first);
            for line in command_lines(&first) {
                println!("{line}");
            }
            for line in
                store_and_tier_lines(&first, args.put_price_per_1000, args.get_price_per_1000)
            {
                println!("{line}");
            }
            for line in crate::whatif::stat_lines(&first) {
                println!("{line}");
            }
        }
        return Ok(());
    }
    if !args.json {
        print_header();
    }
    let mut earlier = first;
    let mut printed = 0u64;
    while args.count.is_none_or(|count| printed < count) {
        std::thread::sleep(Duration::from_secs_f64(args.interval));
        let later = fetch_stats(&args.address).context("polling the server")?;
        print_line(&line_between(&earlier, &later, args.interval), args.json);
        earlier = later;
        printed += 1;
    }
    Ok(())
}

/// `--once`: the totals since start under headers that say so (no per-second rates).
fn print_totals(stats: &Value) {
    let (transfers, read_bytes, written_bytes) = backend_totals(stats);
    let lookups = number(stats, &["cache", "hits"]) + number(stats, &["cache", "misses"]);
    let issued = number(stats, &["cache", "readahead_issued_blocks"]);
    let percent_of = |part: f64, whole: f64| {
        if whole > 0.0 {
            100.0 * part / whole
        } else {
            0.0
        }
    };
    println!(
        "{:>12} {:>10} {:>10} {:>8} {:>6} {:>10} {:>10} {:>7} {:>6}",
        "transfers", "read", "written", "avg KiB", "hit%", "dirty", "wired", "ra-eff%", "conns"
    );
    println!(
        "{:>12} {:>10} {:>10} {:>8.1} {:>6.1} {:>10} {:>10} {:>7.1} {:>6}",
        transfers,
        bufcache::device::size::format_size_rounded(read_bytes as u64),
        bufcache::device::size::format_size_rounded(written_bytes as u64),
        if transfers > 0.0 {
            (read_bytes + written_bytes) / transfers / 1024.0
        } else {
            0.0
        },
        percent_of(number(stats, &["cache", "hits"]), lookups),
        bufcache::device::size::format_size_rounded(number(stats, &["cache", "dirty_bytes"]) as u64),
        bufcache::device::size::format_size_rounded(
            number(stats, &["cache", "pinned_bytes"]) as u64
        ),
        percent_of(number(stats, &["cache", "readahead_used_blocks"]), issued),
        exports_sum(stats, "/nbd/connections_open"),
    );
}

fn print_header() {
    println!(
        "{:>9} {:>8} {:>8} {:>8} {:>6} {:>10} {:>10} {:>7} {:>6} {:>9} {:>8} {:>8} {:>8} {:>7} {:>8}",
        "tps",
        "rMB/s",
        "wMB/s",
        "avg KiB",
        "hit%",
        "dirty",
        "wired",
        "ra-eff%",
        "conns",
        "nbd req/s",
        "p99 ms",
        "bwait/s",
        "bwait ms",
        "exam/ev",
        "strm/s"
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn snapshot(requests: u64, bytes: u64, hits: u64, misses: u64) -> Value {
        json!({
            "cache": {"hits": hits, "misses": misses, "dirty_bytes": 8192, "pinned_bytes": 0,
                      "readahead_issued_blocks": 10, "readahead_used_blocks": 5},
            "exports": [{"device": {"reads": {"requests": requests, "bytes": bytes},
                                    "writes": {"requests": requests, "bytes": bytes}}}]
        })
    }

    // Goal: the store's request cost is the list price of what was billed: PUT, POST and
    // LIST at the PUT price, GET and HEAD at the GET price, DELETE free, requests without an
    // answer not billed. Method: a store document with known counts, default and given prices.
    #[test]
    fn store_cost_prices_each_method_at_its_list_price() {
        let store = json!({"requests": {
            "GET": {"ok": 9000, "client_error": 1000, "server_error": 0, "transport_error": 500},
            "HEAD": {"ok": 0, "client_error": 0, "server_error": 0, "transport_error": 0},
            "PUT": {"ok": 1500, "client_error": 0, "server_error": 500, "transport_error": 7},
            "LIST": {"ok": 0, "client_error": 0, "server_error": 0, "transport_error": 0},
            "POST": {"ok": 0, "client_error": 0, "server_error": 0, "transport_error": 0},
            "DELETE": {"ok": 4000, "client_error": 0, "server_error": 0, "transport_error": 0},
        }});
        let cost = store_cost(
            &store,
            PUT_PRICE_PER_1000_DEFAULT,
            GET_PRICE_PER_1000_DEFAULT,
        );
        assert!(
            (cost - (2.0 * 0.005 + 10.0 * 0.0004)).abs() < 1e-12,
            "{cost}"
        );
        assert!((store_cost(&store, 1.0, 0.0) - 2.0).abs() < 1e-12);
        let lines = store_and_tier_lines(
            &json!({"exports": [{"name": "", "store": store}]}),
            1.0,
            0.0,
        );
        assert!(
            lines
                .iter()
                .any(|line| line.contains("request cost $2.000000")),
            "{lines:?}"
        );
    }

    #[test]
    fn rates_come_from_the_difference_of_two_snapshots() {
        let line = line_between(
            &snapshot(10, 40960, 0, 0),
            &snapshot(20, 1_089_536, 30, 10),
            2.0,
        );
        assert_eq!(line.transfers_per_second, 10.0);
        assert_eq!(
            line.average_transfer_kib,
            2.0 * (1_089_536.0 - 40960.0) / 20.0 / 1024.0
        );
        assert_eq!(line.hit_ratio, 0.75);
        assert_eq!(line.dirty_bytes, 8192);
        assert_eq!(
            line.readahead_efficiency, 0.0,
            "no read-ahead in the interval"
        );
    }

    #[test]
    fn buffer_waits_and_eviction_work_come_from_the_difference_of_two_snapshots() {
        // Goal: the wait, eviction and streaming columns are per interval. Method: two
        // snapshots 2 s apart with 4 more waits lasting 0.02 s in all, 10 more evictions
        // examining 15, and 6 more streamed reads.
        let earlier = json!({"cache": {"buffer_waits": 1, "buffer_wait_seconds": 1.0,
                                       "evictions": 5, "eviction_candidates_examined": 5,
                                       "streamed_reads": 10}});
        let later = json!({"cache": {"buffer_waits": 5, "buffer_wait_seconds": 1.02,
                                     "evictions": 15, "eviction_candidates_examined": 20,
                                     "streamed_reads": 16}});
        let line = line_between(&earlier, &later, 2.0);
        assert_eq!(line.buffer_waits_per_second, 2.0);
        assert!((line.buffer_wait_mean_ms - 5.0).abs() < 1e-9, "{line:?}");
        assert_eq!(line.candidates_per_eviction, 1.5);
        assert_eq!(line.streamed_reads_per_second, 3.0);
    }
}
