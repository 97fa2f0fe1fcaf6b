// Goal: data written through our server by real NBD clients reads back intact, including
// unaligned and concurrent I/O. Method: drive the server (backed by MemoryExport) with
// qemu-io, qemu-img convert, nbdcopy (4 connections) and fio's nbd engine, and compare
// contents or let the tools verify their own patterns.

mod common;

use std::process::Command;

use bufcache_nbd::Export;
use common::*;

const IMAGE_BYTES: usize = 8 << 20;

fn output_text(output: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// FNV-1a, enough to show two 8 MiB images differ without printing them.
fn checksum(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[test]
fn qemu_io_patterns_round_trip_at_unaligned_offsets() {
    if !tools(&["qemu-io"]) {
        return;
    }
    let (server, _export) = memory_server(4 << 20);
    let uri = server.tcp_uri("mem");
    let commands = [
        "write -P 0xab 1234 5000",
        "write -P 0xcd 70001 131071",
        "write -P 0x11 4194303 1",
        "read -P 0xab 1234 5000",
        "read -P 0xcd 70001 131071",
        "read -P 0x11 4194303 1",
        "read -P 0 0 1234",
        "read -P 0 6234 63767",
        "flush",
    ];
    let mut command = Command::new("qemu-io");
    command.args(["-f", "raw"]);
    for line in commands {
        command.args(["-c", line]);
    }
    let output = run_ok(command.arg(&uri));
    let text = output_text(&output);
    assert!(!text.contains("failed"), "{text}");
    assert_eq!(text.matches("read ").count(), 5, "{text}");
}

#[test]
fn qemu_img_convert_in_and_out_preserves_every_byte() {
    if !tools(&["qemu-img"]) {
        return;
    }
    let (server, export) = memory_server(IMAGE_BYTES as u64);
    let directory = tempfile::tempdir().unwrap();
    let source = directory.path().join("source.img");
    let copy = directory.path().join("copy.img");
    let data = pattern_bytes(IMAGE_BYTES, 42);
    std::fs::write(&source, &data).unwrap();
    let uri = server.tcp_uri("mem");
    run_ok(
        Command::new("qemu-img")
            .args(["convert", "-n", "-f", "raw", "-O", "raw"])
            .arg(&source)
            .arg(&uri),
    );
    let mut served = vec![0u8; IMAGE_BYTES];
    export.read(0, &mut served).unwrap();
    assert_eq!(
        checksum(&served),
        checksum(&data),
        "image written through NBD differs"
    );
    run_ok(
        Command::new("qemu-img")
            .args(["convert", "-f", "raw", "-O", "raw"])
            .arg(&uri)
            .arg(&copy),
    );
    let copied = std::fs::read(&copy).unwrap();
    assert_eq!(
        checksum(&copied),
        checksum(&data),
        "image read through NBD differs"
    );
}

#[test]
fn nbdcopy_with_four_connections_both_directions() {
    if !tools(&["nbdcopy"]) {
        return;
    }
    let (server, export) = memory_server(IMAGE_BYTES as u64);
    let directory = tempfile::tempdir().unwrap();
    let source = directory.path().join("source.img");
    let copy = directory.path().join("copy.img");
    let mut data = pattern_bytes(IMAGE_BYTES, 7);
    // A zero run in the middle exercises nbdcopy's zero detection (WRITE_ZEROES).
    data[2 << 20..3 << 20].fill(0);
    std::fs::write(&source, &data).unwrap();
    std::fs::write(&copy, []).unwrap();
    let uri = server.unix_uri("mem");
    run_ok(
        Command::new("nbdcopy")
            .args(["--connections=4", "--requests=16"])
            .arg(&source)
            .arg(&uri),
    );
    let mut served = vec![0u8; IMAGE_BYTES];
    export.read(0, &mut served).unwrap();
    assert_eq!(
        checksum(&served),
        checksum(&data),
        "nbdcopy into the server differs"
    );
    run_ok(
        Command::new("nbdcopy")
            .args(["--connections=4", "--requests=16"])
            .arg(server.tcp_uri("mem"))
            .arg(&copy),
    );
    let copied = std::fs::read(&copy).unwrap();
    assert_eq!(
        checksum(&copied),
        checksum(&data),
        "nbdcopy out of the server differs"
    );
}

#[test]
fn fio_nbd_engine_verifies_crc32c_at_queue_depth_16() {
    if !tools(&["fio"]) {
        return;
    }
    let (server, _export) = memory_server(16 << 20);
    let output = run_ok(
        Command::new("fio")
            .args([
                "--name=verify",
                "--ioengine=nbd",
                "--rw=randwrite",
                "--bs=4k",
                "--size=4m",
                "--iodepth=16",
                "--verify=crc32c",
                "--do_verify=1",
                "--verify_fatal=1",
                "--output-format=terse",
            ])
            .arg(format!("--uri={}", server.tcp_uri("mem"))),
    );
    let text = output_text(&output);
    assert!(
        !text.contains("verify:"),
        "fio reported a verify problem: {text}"
    );
    // Terse format v3: field 6 is KiB read (the verify pass), field 47 KiB written.
    let terse_line = text
        .lines()
        .find(|line| line.starts_with("3;"))
        .unwrap_or_default();
    let fields: Vec<&str> = terse_line.split(';').collect();
    assert!(fields.len() > 47, "unexpected fio output: {text}");
    assert_eq!(fields[5], "4096", "fio read back {} KiB: {text}", fields[5]);
    assert_eq!(fields[46], "4096", "fio wrote {} KiB: {text}", fields[46]);
}
