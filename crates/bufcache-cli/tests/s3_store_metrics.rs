//! Goal: what a server asks of its object store is on `/metrics` and in `bufcache stat
//! --once`, exactly: requests by method and outcome, bytes, retries, durations, requests in
//! flight, the log layout's live/garbage bytes, segments and collector figures, and the
//! request cost at list prices. Method: `bufcache serve --metrics` on moto, whose request
//! log counts every request it answered; a known write through the NBD client and a FLUSH;
//! the scraped counters compared with moto's log.

mod common;
#[path = "../../bufcache-s3/tests/support/mod.rs"]
mod s3_support;

use std::process::Command;
use std::time::Duration;

use bufcache_nbd::NbdClient;
use common::*;
use s3_support::{have_moto, Moto};

const MIB: u64 = 1 << 20;

/// The sum of every sample of `name` whose labels contain all of `labels`.
fn sum_of(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|line| line.starts_with(&format!("{name}{{")))
        .filter(|line| labels.iter().all(|label| line.contains(label)))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

// Goal and method: see the file's opening comment. 8 MiB written on a log-layout disk and
// flushed: the store's PUT, GET, DELETE and HEAD counts on /metrics equal moto's log (less the
// test's own bucket creation), bytes sent cover the data, nothing is in flight once idle, the
// duration histogram counts every request, the log gauges show 8 MiB live in at least one
// segment, and `stat --once` prints the store's lines with a cost at the given prices.
#[test]
fn store_requests_bytes_and_log_figures_on_metrics_match_the_store() {
    let name = "store_requests_bytes_and_log_figures_on_metrics_match_the_store";
    if !have_moto(name) {
        return;
    }
    let _timer = Timer::new(name);
    let dir = temp_dir();
    let moto = Moto::start();
    moto.create_bucket("disks");
    let puts_before = moto.request_count("PUT");
    // A lease renewed every 200 s: no renewal PUT lands between the scrape and moto's count.
    let url = format!(
        "s3://disks/vm1?endpoint={}&create-size=64M&layout=log&segment-size=1M&gc=off&lease=600",
        moto.endpoint()
    );
    let mut server = Server::start(
        dir.path(),
        "store-metrics",
        &["--backend", &url, "--metrics", "127.0.0.1:0"],
    );
    let address = metrics_address(&server.log_text());
    let client = NbdClient::connect(&server.uri()).unwrap();
    client
        .write(MIB, &random_bytes(8 * MIB as usize, 3))
        .unwrap();
    client.flush().unwrap();
    let text = scrape(&address);
    for (method, moto_method, before) in [
        ("PUT", "PUT", puts_before),
        ("DELETE", "DELETE", 0),
        ("HEAD", "HEAD", 0),
    ] {
        assert_eq!(
            sum_of(
                &text,
                "bufcache_store_requests_total",
                &[&format!("method=\"{method}\"")]
            ),
            (moto.request_count(moto_method) - before) as f64,
            "{method} requests differ from moto's log"
        );
    }
    let gets = sum_of(&text, "bufcache_store_requests_total", &["method=\"GET\""])
        + sum_of(&text, "bufcache_store_requests_total", &["method=\"LIST\""]);
    assert_eq!(gets, moto.request_count("GET") as f64, "GET and LIST");
    let all = sum_of(&text, "bufcache_store_requests_total", &[]);
    assert_eq!(
        sum_of(&text, "bufcache_store_request_duration_seconds_count", &[]),
        all,
        "the duration histogram counts every request"
    );
    assert!(
        sample(
            &text,
            "bufcache_store_bytes_total{export=\"\",direction=\"sent\"}"
        ) >= (8 * MIB) as f64,
        "{text}"
    );
    assert_eq!(
        sample(&text, "bufcache_store_requests_in_flight{export=\"\"}"),
        0.0
    );
    assert_eq!(
        sample(&text, "bufcache_store_retries_total{export=\"\"}"),
        0.0
    );
    assert_eq!(
        sample(&text, "bufcache_store_live_bytes{export=\"\"}"),
        (8 * MIB) as f64
    );
    assert!(sample(&text, "bufcache_store_segments{export=\"\"}") >= 8.0);
    assert!(sample(&text, "bufcache_store_garbage_bytes{export=\"\"}") >= 0.0);
    assert_eq!(
        sample(&text, "bufcache_store_gc_passes_total{export=\"\"}"),
        0.0
    );
    assert_eq!(
        sample(&text, "bufcache_store_gc_bytes_moved_total{export=\"\"}"),
        0.0
    );

    let output = run_ok(
        Command::new(bufcache_bin()).args([
            "stat",
            &address,
            "--once",
            "--put-price-per-1000",
            "1",
            "--get-price-per-1000",
            "0",
        ]),
        Duration::from_secs(30),
    );
    let printed = String::from_utf8_lossy(&output.stdout).to_string();
    let puts = sum_of(
        &scrape(&address),
        "bufcache_store_requests_total",
        &["method=\"PUT\"", "outcome=\"ok\""],
    );
    assert!(
        printed.contains("store \"\": GET") && printed.contains("log layout: live 8"),
        "{printed}"
    );
    let cost_line = printed
        .lines()
        .find(|line| line.contains("request cost $"))
        .unwrap_or_else(|| panic!("no cost line: {printed}"));
    let cost: f64 = cost_line
        .split('$')
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|number| number.parse().ok())
        .unwrap_or_else(|| panic!("no cost in: {cost_line}"));
    assert!(
        cost >= puts / 1000.0,
        "{puts} PUTs at $1 per 1,000 cost at least {}: {cost_line}",
        puts / 1000.0
    );
    client.disconnect();
    server.stop_clean();
}
