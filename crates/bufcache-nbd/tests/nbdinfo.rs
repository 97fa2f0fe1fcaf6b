// Goal: real clients see what the server advertises (size, block sizes, multi-conn, export
// list, structured replies, block status). Method: run nbdinfo (libnbd) against our server
// over TCP and unix sockets and check its JSON and text output.

mod common;

use std::process::Command;
use std::sync::Arc;

use bufcache_nbd::{Export, MemoryExport};
use common::*;

fn stdout_of(command: &mut Command) -> String {
    String::from_utf8(run_ok(command).stdout).expect("utf-8 output")
}

#[test]
fn nbdinfo_shows_size_block_sizes_and_multi_conn() {
    if !tools(&["nbdinfo"]) {
        return;
    }
    let (server, _export) = memory_server(8 << 20);
    let json = stdout_of(
        Command::new("nbdinfo")
            .arg("--json")
            .arg(server.tcp_uri("mem")),
    );
    for expected in [
        "\"export-size\": 8388608",
        "\"block_size_minimum\": 1",
        "\"block_size_preferred\": 4096",
        "\"block_size_maximum\": 33554432",
        "\"can_multi_conn\": true",
        "\"can_flush\": true",
        "\"can_fua\": true",
        "\"can_trim\": true",
        "\"can_zero\": true",
        "\"can_fast_zero\": true",
        "\"can_cache\": true",
        "\"is_read_only\": false",
        "\"structured\": true",
        "\"base:allocation\"",
        "\"description\": \"test memory\"",
    ] {
        assert!(json.contains(expected), "missing {expected} in {json}");
    }
    // The same over the unix socket.
    let size = stdout_of(
        Command::new("nbdinfo")
            .arg("--size")
            .arg(server.unix_uri("mem")),
    );
    assert_eq!(size.trim(), "8388608");
}

#[test]
fn nbdinfo_reports_read_only_exports_truthfully() {
    if !tools(&["nbdinfo"]) {
        return;
    }
    let export = Arc::new(MemoryExport::new(1 << 20).with_read_only(true));
    let server = start_server(vec![("ro", export as Arc<dyn Export>)]);
    let json = stdout_of(
        Command::new("nbdinfo")
            .arg("--json")
            .arg(server.tcp_uri("ro")),
    );
    assert!(json.contains("\"is_read_only\": true"), "{json}");
    assert!(json.contains("\"can_trim\": false"), "{json}");
    assert!(json.contains("\"can_zero\": false"), "{json}");
}

#[test]
fn nbdinfo_lists_every_export() {
    if !tools(&["nbdinfo"]) {
        return;
    }
    let first = Arc::new(MemoryExport::new(1 << 20).with_description("first disk"));
    let second = Arc::new(MemoryExport::new(2 << 20));
    let server = start_server(vec![
        ("alpha", first as Arc<dyn Export>),
        ("beta", second as Arc<dyn Export>),
    ]);
    let listing = stdout_of(
        Command::new("nbdinfo")
            .arg("--list")
            .arg(server.tcp_uri("")),
    );
    assert!(listing.contains("export=\"alpha\""), "{listing}");
    assert!(listing.contains("export=\"beta\""), "{listing}");
    assert!(listing.contains("first disk"), "{listing}");
    assert!(listing.contains("2097152"), "{listing}");
}

#[test]
fn nbdinfo_map_shows_holes_and_data_via_block_status() {
    if !tools(&["nbdinfo"]) {
        return;
    }
    let (server, export) = memory_server(1 << 20);
    // Data in the second 64 KiB page only.
    export.write(65536 + 100, b"data", false).unwrap();
    let map = stdout_of(
        Command::new("nbdinfo")
            .arg("--map")
            .arg(server.tcp_uri("mem")),
    );
    let rows: Vec<Vec<String>> = map
        .lines()
        .map(|line| line.split_whitespace().map(str::to_string).collect())
        .collect();
    assert_eq!(rows.len(), 3, "{map}");
    assert_eq!(rows[0][..3], ["0", "65536", "3"], "{map}");
    assert_eq!(rows[1][..3], ["65536", "65536", "0"], "{map}");
    assert_eq!(rows[2][..3], ["131072", "917504", "3"], "{map}");
}
