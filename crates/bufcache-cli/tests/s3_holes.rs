//! Goal: on an object-store disk, `base:allocation` reports what reads as zeroes without a
//! request — ranges never written, trimmed or zeroed (log layout: unmapped in the index;
//! chunk layout: chunks not stored) — as holes, so nbdinfo --map, nbdcopy and backup tools
//! skip them and an empty disk costs no data GET. Method: `bufcache serve` on moto (whose
//! request log says which objects were read) and on SeaweedFS, both layouts; the map read
//! with nbdinfo --map and the NBD client's BLOCK_STATUS, the disk copied with nbdcopy.

mod common;
#[path = "../../bufcache-s3/tests/support/mod.rs"]
mod s3_support;

use std::process::Command;
use std::time::{Duration, Instant};

use bufcache_nbd::NbdClient;
use common::*;
use s3_support::{have_moto, have_seaweedfs, strip_ansi, Moto, S3Server, SeaweedFs};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// GETs in moto's request log of objects holding disk data (chunks or segments).
fn data_gets(moto: &Moto) -> usize {
    std::fs::read_to_string(&moto.log_path)
        .unwrap_or_default()
        .lines()
        .map(strip_ansi)
        .filter(|line| {
            line.contains("\"GET ")
                && (line.contains("/chunks/") || line.contains("/log/segments/"))
        })
        .count()
}

/// The map as `nbdinfo --map` prints it: (offset, length, type description) per line.
fn nbdinfo_map(uri: &str) -> Vec<(u64, u64, String)> {
    let output = run_ok(
        Command::new("nbdinfo").args(["--map", uri]),
        Duration::from_secs(60),
    );
    String::from_utf8(output.stdout)
        .unwrap()
        .lines()
        .map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            (
                fields[0].parse().unwrap(),
                fields[1].parse().unwrap(),
                fields[3..].join(" "),
            )
        })
        .collect()
}

/// The map as (start, end, hole) runs from the NBD client's BLOCK_STATUS.
fn block_status(client: &NbdClient) -> Vec<(u64, u64, bool)> {
    let mut position = 0;
    client
        .block_status(0, client.size())
        .unwrap()
        .into_iter()
        .map(|extent| {
            assert_eq!(
                extent.hole, extent.zero,
                "a hole that is not zero: {extent:?}"
            );
            let run = (position, position + extent.length, extent.hole);
            position += extent.length;
            run
        })
        .collect()
}

/// One layout's run on `server`: an empty 1 GiB disk maps as one hole and copies without a
/// data GET (counted by `data_gets` when the server is moto); after 2 MiB written at
/// 256 MiB, 1 MiB of it trimmed and 1 MiB elsewhere zeroed, the map is exactly the written
/// MiB as data, the rest holes, live and after a restart.
fn holes_are_holes(server: &dyn S3Server, data_gets: &dyn Fn() -> usize, layout: &str) {
    let dir = temp_dir();
    server.create_bucket("disks");
    let url = format!(
        "s3://disks/{layout}?endpoint={}&create-size=1G&layout={layout}",
        server.endpoint()
    );
    let mut bufcache = Server::start(
        dir.path(),
        layout,
        &["--backend", &url, "--cache-size", "16M"],
    );
    let uri = bufcache.uri();
    assert!(
        bufcache.log_text().contains(&format!(
            "created a new disk: layout {layout}, 1073741824 bytes"
        )),
        "{layout}: the creation is logged: {}",
        bufcache.log_text()
    );
    assert_eq!(
        nbdinfo_map(&uri),
        vec![(0, GIB, "hole,zero".to_string())],
        "{layout}: an empty disk is one hole"
    );
    let gets_before = data_gets();
    let started = Instant::now();
    run_ok(
        cmd("nbdcopy", &[uri.as_str(), "null:"]),
        Duration::from_secs(120),
    );
    println!(
        "{layout}: empty 1 GiB disk copied in {:?}",
        started.elapsed()
    );
    assert_eq!(
        data_gets(),
        gets_before,
        "{layout}: copying an empty disk read data"
    );

    let client = NbdClient::connect(&uri).unwrap();
    client
        .write(256 * MIB, &random_bytes(2 * MIB as usize, 7))
        .unwrap();
    client
        .write(512 * MIB, &random_bytes(MIB as usize, 8))
        .unwrap();
    client.flush().unwrap();
    client.trim(257 * MIB, MIB).unwrap();
    client.zero(512 * MIB, MIB, true).unwrap();
    client.flush().unwrap();
    let expected = vec![
        (0, 256 * MIB, true),
        (256 * MIB, 257 * MIB, false),
        (257 * MIB, GIB, true),
    ];
    assert_eq!(block_status(&client), expected, "{layout}: live");
    client.disconnect();
    bufcache.stop_clean();

    let url = format!("s3://disks/{layout}?endpoint={}", server.endpoint());
    let mut bufcache = Server::start(dir.path(), &format!("{layout}-again"), &["--backend", &url]);
    let client = NbdClient::connect(&bufcache.uri()).unwrap();
    assert_eq!(block_status(&client), expected, "{layout}: after a restart");
    let gets_before = data_gets();
    run_ok(
        cmd("nbdcopy", &[bufcache.uri().as_str(), "null:"]),
        Duration::from_secs(120),
    );
    // The written MiB costs a GET or a few (log layout: its extents may lie in several
    // places of a segment); reading the 1023 MiB of holes would cost hundreds more.
    let gets = data_gets() - gets_before;
    assert!(
        gets <= 4,
        "{layout}: copying 1 MiB of data took {gets} data GETs"
    );
    client.disconnect();
    bufcache.stop_clean();
}

#[test]
fn never_written_trimmed_and_zeroed_ranges_are_holes_and_cost_no_get() {
    let name = "never_written_trimmed_and_zeroed_ranges_are_holes_and_cost_no_get";
    if !have_moto(name) || !have_tools(name, &["nbdinfo", "nbdcopy"]) {
        return;
    }
    let _timer = Timer::new(name);
    for layout in ["log", "chunk"] {
        let moto = Moto::start();
        holes_are_holes(&moto, &|| data_gets(&moto), layout);
    }
}

#[test]
fn never_written_trimmed_and_zeroed_ranges_are_holes_on_seaweedfs() {
    // Goal and method: those of
    // `never_written_trimmed_and_zeroed_ranges_are_holes_and_cost_no_get`, on SeaweedFS
    // (no request log: the map is checked, not the GETs).
    let name = "never_written_trimmed_and_zeroed_ranges_are_holes_on_seaweedfs";
    if !have_seaweedfs(name) || !have_tools(name, &["nbdinfo", "nbdcopy"]) {
        return;
    }
    let _timer = Timer::new(name);
    let server = SeaweedFs::start();
    for layout in ["log", "chunk"] {
        holes_are_holes(&server, &|| 0, layout);
    }
}
