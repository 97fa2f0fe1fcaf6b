//! Goal: the log layout reads data written sequentially back at about one GET per MiB or
//! better once the cache is cold (issue #48: the runs of each read-ahead window went to the
//! store as a GET each, or several where a run's extents lay in several places, 2.6 GETs per
//! MiB, against 1.0 for the chunk layout and s3backer's 1 MiB blocks). A request count, not
//! a timing. Method: `bufcache serve --metrics` in the log layout (default segment size) on
//! SeaweedFS; a file of random data copied in with `nbdcopy --flush`; a restart (empty
//! cache); the data read back in order with `qemu-img dd bs=1M` (a sequential reader, as in
//! bench/s3), compared, and the GETs it cost read from the store metrics.

mod common;
#[path = "../../bufcache-s3/tests/support/mod.rs"]
mod s3_support;

use std::time::Duration;

use common::*;
use s3_support::{have_seaweedfs, S3Server, SeaweedFs};

const MIB: u64 = 1 << 20;
/// The data written and read back: more than nbdcopy's 128 MiB of work per thread, so two
/// threads write at once and the cache writes back ranges far apart into one segment (as
/// bench/s3's 256 MiB do), across many 8 MiB segments and read-ahead windows.
const DATA_MIB: u64 = 160;
/// The target of issue #48.
const GETS_PER_MIB_MAX: f64 = 1.1;

/// GETs the server's store metrics count so far, of every outcome.
fn store_gets(address: &str) -> f64 {
    scrape(address)
        .lines()
        .filter(|line| {
            line.starts_with("bufcache_store_requests_total{") && line.contains("method=\"GET\"")
        })
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

// Goal and method: see the file's opening comment.
#[test]
fn log_layout_cold_sequential_read_costs_at_most_1_1_gets_per_mib() {
    let name = "log_layout_cold_sequential_read_costs_at_most_1_1_gets_per_mib";
    if !have_seaweedfs(name) || !have_tools(name, &["nbdcopy", "qemu-img"]) {
        return;
    }
    let _timer = Timer::new(name);
    let dir = temp_dir();
    let store = SeaweedFs::start();
    store.create_bucket("disks");
    let input = dir.path().join("input");
    let output = dir.path().join("output");
    write_file(&input, &random_bytes((DATA_MIB * MIB) as usize, 48));
    let url = format!(
        "s3://disks/seq?endpoint={}&create-size=256M&layout=log",
        store.endpoint()
    );
    let mut server = Server::start(
        dir.path(),
        "write",
        &["--backend", &url, "--cache-size", "64M"],
    );
    run_ok(
        cmd(
            "nbdcopy",
            &["--flush", input.to_str().unwrap(), server.uri().as_str()],
        ),
        Duration::from_secs(300),
    );
    server.stop_clean();

    let url = format!("s3://disks/seq?endpoint={}", store.endpoint());
    let mut server = Server::start(
        dir.path(),
        "read",
        &[
            "--backend",
            &url,
            "--cache-size",
            "64M",
            "--metrics",
            "127.0.0.1:0",
        ],
    );
    let address = metrics_address(&server.log_text());
    let gets_before = store_gets(&address);
    run_ok(
        cmd(
            "qemu-img",
            &[
                "dd".to_string(),
                "-f".to_string(),
                "raw".to_string(),
                "-O".to_string(),
                "raw".to_string(),
                "bs=1M".to_string(),
                format!("count={DATA_MIB}"),
                format!("if={}", server.uri()),
                format!("of={}", output.display()),
            ],
        ),
        Duration::from_secs(300),
    );
    let gets = store_gets(&address) - gets_before;
    server.stop_clean();
    assert_same_bytes(
        &std::fs::read(&input).unwrap(),
        &std::fs::read(&output).unwrap(),
        "the data read back",
    );
    let gets_per_mib = gets / DATA_MIB as f64;
    println!("cold sequential read of {DATA_MIB} MiB: {gets} GETs, {gets_per_mib:.3} per MiB");
    assert!(gets > 0.0, "a cold read of {DATA_MIB} MiB made no GET");
    assert!(
        gets_per_mib <= GETS_PER_MIB_MAX,
        "a cold sequential read made {gets} GETs for {DATA_MIB} MiB, {gets_per_mib:.3} per MiB (at most {GETS_PER_MIB_MAX})"
    );
}
