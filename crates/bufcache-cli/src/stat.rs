//! `bufcache stat`: a live view of a running server, in the spirit of systat and iostat.
//!
//! It polls the server's `/stats` endpoint and prints one line per interval computed from the
//! difference of two snapshots: transfers per second and MB/s at the backends, the average
//! transfer size (bytes over requests of the same interval, both directions — seed 001's
//! complaint was an iostat that got this wrong), the interval's hit ratio, dirty and wired
//! memory, and read-ahead efficiency (used over issued). `--once` prints the totals so far.

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
    Line {
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
        });
        println!("{value}");
        return;
    }
    println!(
        "{:>9.1} {:>8.2} {:>8.2} {:>8.1} {:>6.1} {:>10} {:>10} {:>7.1}",
        line.transfers_per_second,
        line.read_megabytes_per_second,
        line.write_megabytes_per_second,
        line.average_transfer_kib,
        line.hit_ratio * 100.0,
        bufcache::format_size(line.dirty_bytes),
        bufcache::format_size(line.pinned_bytes),
        line.readahead_efficiency * 100.0
    );
}

pub fn run(args: StatArgs) -> anyhow::Result<()> {
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
            let empty = serde_json::json!({});
            print_header();
            print_line(&line_between(&empty, &first, 1.0), false);
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

fn print_header() {
    println!(
        "{:>9} {:>8} {:>8} {:>8} {:>6} {:>10} {:>10} {:>7}",
        "tps", "rMB/s", "wMB/s", "avg KiB", "hit%", "dirty", "wired", "ra-eff%"
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
}
