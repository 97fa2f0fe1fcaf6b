//! Goal: libnbd's tools (nbdcopy, nbdinfo) work against `bufcache serve`. Method: copy 32 MiB
//! in and out with nbdcopy over 4 connections and compare checksums (through the server and in
//! the backing file), read nbdinfo's JSON for size, block sizes and multi-conn, and check
//! `nbdinfo --map` on a sparse backing file: holes and data where they are, and every extent
//! flagged zero really reads as zeros (also after unflushed writes, trims and zeroing); an
//! odd-sized backing file (5,000,003 bytes) is served and written to its last byte.

mod common;

use std::time::Duration;

use bufcache_nbd::NbdClient;
use common::*;

const TIMEOUT: Duration = Duration::from_secs(120);

fn nbdinfo_json(uri: &str) -> serde_json::Value {
    let output = run_ok(cmd("nbdinfo", &["--json", uri]), TIMEOUT);
    serde_json::from_slice(&output.stdout).expect("nbdinfo --json output")
}

#[test]
fn nbdcopy_both_directions_with_four_connections() {
    let _timer = Timer::new("nbdcopy_both_directions_with_four_connections");
    if !have_tools("nbdcopy_both_directions", &["nbdcopy"]) {
        return;
    }
    const SIZE: usize = 32 << 20;
    // Default cache, then a cache far smaller than the data so write-back and eviction run
    // during the copy.
    let configurations: [&[&str]; 2] = [&[], &["--cache-size", "4M", "--dirty-age-max", "0.1"]];
    for (round, extra) in configurations.iter().enumerate() {
        let dir = temp_dir();
        let source = random_bytes(SIZE, 100 + round as u64);
        let source_path = dir.path().join("source.raw");
        write_file(&source_path, &source);
        let mut args = vec!["--backend", "disk.img", "--create-size", "32M"];
        args.extend_from_slice(extra);
        let mut server = Server::start(dir.path(), "srv", &args);
        let uri = server.uri();
        run_ok(
            cmd(
                "nbdcopy",
                &[
                    "--connections=4",
                    "--flush",
                    source_path.to_str().unwrap(),
                    &uri,
                ],
            ),
            TIMEOUT,
        );
        let out_path = dir.path().join("out.raw");
        run_ok(
            cmd(
                "nbdcopy",
                &["--connections=4", &uri, out_path.to_str().unwrap()],
            ),
            TIMEOUT,
        );
        let out = std::fs::read(&out_path).unwrap();
        eprintln!(
            "config {extra:?}: source {:016x}, copied out {:016x}",
            checksum(&source),
            checksum(&out)
        );
        assert_same_bytes(&source, &out, "nbdcopy out of the export");
        server.stop_clean();
        let on_disk = std::fs::read(dir.path().join("disk.img")).unwrap();
        assert_same_bytes(&source, &on_disk, "backing file after SIGTERM");
    }
}

#[test]
fn nbdinfo_reports_size_block_sizes_and_multi_conn() {
    let _timer = Timer::new("nbdinfo_reports_size_block_sizes_and_multi_conn");
    if !have_tools("nbdinfo_reports", &["nbdinfo"]) {
        return;
    }
    let dir = temp_dir();
    let mut server = Server::start(dir.path(), "srv", &["--backend", "memory:96M"]);
    let info = nbdinfo_json(&server.uri());
    let export = &info["exports"][0];
    assert_eq!(export["export-size"], 96u64 << 20, "{info}");
    assert_eq!(export["block_size_minimum"], 1, "{info}");
    assert_eq!(export["block_size_preferred"], 4096, "{info}");
    assert_eq!(export["block_size_maximum"], 32u64 << 20, "{info}");
    assert_eq!(export["can_multi_conn"], true, "{info}");
    assert_eq!(export["can_flush"], true, "{info}");
    assert_eq!(export["is_read_only"], false, "{info}");
    server.stop_clean();

    // The preferred size follows --block-size, the maximum --request-size-max, and
    // --read-only shows.
    let mut server = Server::start(
        dir.path(),
        "srv2",
        &[
            "--backend",
            "memory:8M",
            "--block-size",
            "16k",
            "--request-size-max",
            "8M",
            "--read-only",
        ],
    );
    let info = nbdinfo_json(&server.uri());
    let export = &info["exports"][0];
    assert_eq!(export["export-size"], 8u64 << 20, "{info}");
    assert_eq!(export["block_size_preferred"], 16384, "{info}");
    assert_eq!(export["block_size_maximum"], 8u64 << 20, "{info}");
    assert_eq!(export["is_read_only"], true, "{info}");
    server.stop_clean();
}

/// One `nbdinfo --map --json` extent.
#[derive(Debug)]
struct Extent {
    offset: u64,
    length: u64,
    hole: bool,
    zero: bool,
}

fn map(uri: &str) -> Vec<Extent> {
    let output = run_ok(cmd("nbdinfo", &["--map", "--json", uri]), TIMEOUT);
    let value: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("nbdinfo --map --json output");
    value
        .as_array()
        .expect("an array of extents")
        .iter()
        .map(|extent| {
            let kind = extent["type"].as_u64().unwrap();
            Extent {
                offset: extent["offset"].as_u64().unwrap(),
                length: extent["length"].as_u64().unwrap(),
                hole: kind & 1 != 0,
                zero: kind & 2 != 0,
            }
        })
        .collect()
}

/// The extents are contiguous from 0 to `size`, each range `data` is inside non-zero
/// extents, and every extent flagged zero reads back as zeros through `client`.
fn check_map(extents: &[Extent], size: u64, data: &[(u64, u64)], client: &NbdClient) {
    let mut next = 0;
    for extent in extents {
        assert_eq!(
            extent.offset, next,
            "extents are not contiguous: {extents:?}"
        );
        next += extent.length;
    }
    assert_eq!(next, size, "extents do not cover the export: {extents:?}");
    for &(start, length) in data {
        for extent in extents {
            let overlaps = extent.offset < start + length && start < extent.offset + extent.length;
            assert!(
                !(overlaps && extent.zero),
                "written range {start}+{length} is reported as zero by {extent:?}; map {extents:?}"
            );
        }
    }
    for extent in extents.iter().filter(|extent| extent.zero) {
        let mut buffer = vec![0u8; extent.length as usize];
        client.read(extent.offset, &mut buffer).unwrap();
        if let Some(position) = buffer.iter().position(|byte| *byte != 0) {
            panic!(
                "extent {extent:?} is flagged zero but byte {} is {:#x}; map {extents:?}",
                extent.offset + position as u64,
                buffer[position]
            );
        }
    }
}

#[test]
fn nbdinfo_map_shows_holes_and_data_of_a_sparse_backing_file() {
    let _timer = Timer::new("nbdinfo_map_shows_holes_and_data_of_a_sparse_backing_file");
    if !have_tools("nbdinfo_map", &["nbdinfo"]) {
        return;
    }
    const SIZE: u64 = 64 << 20;
    const MIB: u64 = 1 << 20;
    let dir = temp_dir();
    let backing = dir.path().join("sparse.img");
    {
        use std::os::unix::fs::FileExt;
        let file = std::fs::File::create(&backing).unwrap();
        file.set_len(SIZE).unwrap();
        file.write_all_at(&random_bytes(MIB as usize, 1), 8 * MIB)
            .unwrap();
        file.write_all_at(&random_bytes(4096, 2), 32 * MIB).unwrap();
        file.sync_all().unwrap();
    }
    let mut server = Server::start(dir.path(), "srv", &["--backend", "sparse.img"]);
    let uri = server.uri();
    let client = NbdClient::connect(&uri).expect("connecting");

    let extents = map(&uri);
    eprintln!("map of the backing file: {extents:?}");
    check_map(&extents, SIZE, &[(8 * MIB, MIB), (32 * MIB, 4096)], &client);
    let hole_at = |offset: u64| {
        extents.iter().any(|extent| {
            extent.hole
                && extent.zero
                && extent.offset <= offset
                && offset < extent.offset + extent.length
        })
    };
    for offset in [0, 4 * MIB, 16 * MIB, 40 * MIB, SIZE - 1] {
        assert!(
            hole_at(offset),
            "offset {offset} is not in a hole: {extents:?}"
        );
    }
    for offset in [8 * MIB, 9 * MIB - 1, 32 * MIB] {
        assert!(
            extents
                .iter()
                .any(|e| !e.zero && e.offset <= offset && offset < e.offset + e.length),
            "offset {offset} is not data: {extents:?}"
        );
    }

    // Data written through the server but not flushed (still dirty in the cache) must not be
    // reported as a zero hole, or copy tools would skip it.
    client
        .write(48 * MIB + 1000, &random_bytes(70_000, 3))
        .unwrap();
    client.write(20 * MIB, &random_bytes(4096, 4)).unwrap();
    let extents = map(&uri);
    eprintln!("map after unflushed writes: {extents:?}");
    check_map(
        &extents,
        SIZE,
        &[
            (8 * MIB, MIB),
            (32 * MIB, 4096),
            (48 * MIB + 1000, 70_000),
            (20 * MIB, 4096),
        ],
        &client,
    );

    // After trimming part of the data and zeroing another part, whatever is flagged zero
    // must read as zero.
    client.trim(8 * MIB, 512 * 1024).unwrap();
    client.zero(32 * MIB, 4096, true).unwrap();
    let extents = map(&uri);
    eprintln!("map after trim and zero: {extents:?}");
    check_map(
        &extents,
        SIZE,
        &[
            (8 * MIB + 512 * 1024, 512 * 1024),
            (48 * MIB + 1000, 70_000),
        ],
        &client,
    );
    let mut buffer = vec![0xffu8; 4096];
    client.read(32 * MIB, &mut buffer).unwrap();
    assert!(
        buffer.iter().all(|b| *b == 0),
        "zeroed range does not read as zero"
    );
    drop(client);
    server.stop_clean();
}

#[test]
fn odd_sized_backing_file_is_served_to_its_last_byte() {
    let _timer = Timer::new("odd_sized_backing_file_is_served_to_its_last_byte");
    if !have_tools("odd_sized_backing_file", &["nbdcopy", "nbdinfo"]) {
        return;
    }
    // Not a multiple of the block size (nor of 512): the tail block is partial.
    const SIZE: usize = 5_000_003;
    let dir = temp_dir();
    let backing = dir.path().join("odd.img");
    let original = random_bytes(SIZE, 55);
    write_file(&backing, &original);
    for block_size in ["4k", "64k"] {
        let mut server = Server::start(
            dir.path(),
            &format!("srv-{block_size}"),
            &["--backend", "odd.img", "--block-size", block_size],
        );
        let info = nbdinfo_json(&server.uri());
        assert_eq!(info["exports"][0]["export-size"], SIZE as u64, "{info}");
        let out = dir.path().join("out.raw");
        run_ok(
            cmd("nbdcopy", &[&server.uri(), out.to_str().unwrap()]),
            TIMEOUT,
        );
        let expected = std::fs::read(&backing).unwrap();
        assert_same_file(&backing, &out);
        // Writes touching the tail, unaligned, then read back.
        let client = NbdClient::connect(&server.uri()).expect("connecting");
        let tail = random_bytes(10_000, 56);
        client.write((SIZE - 10_000) as u64, &tail).unwrap();
        client.write((SIZE - 1) as u64, &[0x42]).unwrap();
        let mut model = expected;
        model[SIZE - 10_000..].copy_from_slice(&tail);
        model[SIZE - 1] = 0x42;
        let mut buffer = vec![0u8; 20_003];
        client.read((SIZE - 20_003) as u64, &mut buffer).unwrap();
        assert_same_bytes(&model[SIZE - 20_003..], &buffer, "tail read back");
        let mut beyond = [0u8; 2];
        assert!(
            client.read((SIZE - 1) as u64, &mut beyond).is_err(),
            "a read past the end succeeded"
        );
        drop(client);
        server.stop_clean();
        let on_disk = std::fs::read(&backing).unwrap();
        assert_same_bytes(&model, &on_disk, "odd-sized backing file after SIGTERM");
    }
}
