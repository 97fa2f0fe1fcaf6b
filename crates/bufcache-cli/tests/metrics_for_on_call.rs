//! Goal: the metrics a person on call reads are right: connections open, requests and bytes
//! per NBD command, errors, and per-command latency histograms that are valid Prometheus
//! histograms; and `bufcache stat` shows them. Method: a real server with `--metrics`, real
//! NBD clients doing a known mix of commands, the exact counts checked on `/metrics`, then
//! `bufcache stat --once`.

mod common;

use std::process::Command;
use std::time::Duration;

use bufcache_nbd::NbdClient;
use common::*;

const TIMEOUT: Duration = Duration::from_secs(60);

#[test]
fn connections_requests_bytes_and_latency_histograms_per_command_are_exact() {
    let _timer =
        Timer::new("connections_requests_bytes_and_latency_histograms_per_command_are_exact");
    let dir = temp_dir();
    let mut server = Server::start(
        dir.path(),
        "srv",
        &["--backend", "memory:16M", "--metrics", "127.0.0.1:0"],
    );
    let address = metrics_address(&server.log_text());
    let first = NbdClient::connect(&server.uri()).expect("connecting");
    let second = NbdClient::connect(&server.uri()).expect("connecting");
    for index in 0..5u64 {
        first.write(index * 65536, &vec![7u8; 65536]).unwrap();
    }
    let mut buffer = vec![0u8; 4096];
    for index in 0..3u64 {
        second.read(index * 4096, &mut buffer).unwrap();
    }
    first.flush().unwrap();
    second.trim(1 << 20, 1 << 20).unwrap();
    let text = scrape(&address);
    let export = "export=\"\"";
    assert_eq!(
        sample(&text, &format!("bufcache_nbd_connections_open{{{export}}}")),
        2.0
    );
    for (command, requests, bytes) in [
        ("write", 5.0, 5.0 * 65536.0),
        ("read", 3.0, 3.0 * 4096.0),
        ("flush", 1.0, 0.0),
        ("trim", 1.0, 1048576.0),
        ("cache", 0.0, 0.0),
    ] {
        let labels = format!("{export},command=\"{command}\"");
        assert_eq!(
            sample(&text, &format!("bufcache_nbd_requests_total{{{labels}}}")),
            requests,
            "{command}"
        );
        assert_eq!(
            sample(
                &text,
                &format!("bufcache_nbd_request_bytes_total{{{labels}}}")
            ),
            bytes,
            "{command}"
        );
        // A valid histogram: buckets cumulative, +Inf equal to _count, _count the requests.
        let name = "bufcache_nbd_request_duration_seconds";
        let buckets: Vec<f64> = text
            .lines()
            .filter(|line| line.starts_with(&format!("{name}_bucket{{{labels},le=")))
            .map(|line| line.rsplit(' ').next().unwrap().parse().unwrap())
            .collect();
        assert!(
            buckets.windows(2).all(|pair| pair[0] <= pair[1]),
            "{command}"
        );
        assert_eq!(
            sample(&text, &format!("{name}_bucket{{{labels},le=\"+Inf\"}}")),
            requests
        );
        assert_eq!(
            sample(&text, &format!("{name}_count{{{labels}}}")),
            requests
        );
        assert!(sample(&text, &format!("{name}_sum{{{labels}}}")) >= 0.0);
    }
    assert!(text.contains("# TYPE bufcache_nbd_request_duration_seconds histogram"));
    assert_eq!(sample(&text, "bufcache_log_lines_dropped_total"), 0.0);

    let stat = run_ok(
        Command::new(bufcache_bin()).args(["stat", &address, "--once"]),
        TIMEOUT,
    );
    let stat = String::from_utf8_lossy(&stat.stdout).into_owned();
    assert!(stat.contains("nbd connections open 2"), "{stat}");
    let header = stat.lines().next().unwrap_or_default();
    assert!(
        header.contains("transfers") && header.contains("written") && !header.contains("/s"),
        "--once prints totals under totals' headers, not rates: {header}"
    );
    let write_line = stat
        .lines()
        .find(|line| line.starts_with("nbd write"))
        .unwrap_or_else(|| panic!("no write line:\n{stat}"));
    assert!(
        write_line.contains(" 5 requests") && write_line.contains("320KiB"),
        "{write_line}"
    );

    drop(first);
    drop(second);
    wait_until("both connections to close", TIMEOUT, || {
        sample(
            &scrape(&address),
            &format!("bufcache_nbd_connections_open{{{export}}}"),
        ) == 0.0
    });
    let text = scrape(&address);
    assert_eq!(
        sample(
            &text,
            &format!("bufcache_nbd_connections_total{{{export}}}")
        ),
        2.0
    );
    server.stop_clean();
}
