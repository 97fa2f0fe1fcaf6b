//! Snapshots of a served disk (issue 50): `bufcache disk snapshot URL NAME --control PATH`
//! asks the server holding the disk to take it at a flush point, and a second server serves
//! the snapshot read-only with `snapshot=NAME` in its URL. Against moto on loopback.

mod common;
#[path = "../../bufcache-s3/tests/support/mod.rs"]
mod s3_support;

use std::process::Command;
use std::time::{Duration, Instant};

use bufcache_nbd::NbdClient;
use common::*;
use s3_support::{have_moto, Moto};

const TIMEOUT: Duration = Duration::from_secs(60);

fn disk(args: &[&str]) -> std::process::Output {
    run_timeout(Command::new(bufcache_bin()).arg("disk").args(args), TIMEOUT)
}

/// Every request moto logged so far.
fn requests(moto: &Moto) -> usize {
    ["GET", "PUT", "POST", "DELETE", "HEAD"]
        .iter()
        .map(|method| moto.request_count(method))
        .sum()
}

fn read(uri: &str, offset: u64, length: usize) -> Vec<u8> {
    let client = NbdClient::connect(uri).unwrap();
    let mut data = vec![0u8; length];
    client.read(offset, &mut data).unwrap();
    data
}

// Goal: a served 1 GiB disk is snapshotted through its server's control socket within 1 s
// and 4 store requests once its writes are flushed, without copying data; a snapshot holds
// every write the client had been answered for (flushed or not) and none after; a second
// server serves it read-only while the first keeps writing; without --control the command
// says how (exit 2). Method: a client writes 8 MiB, flushes, `disk snapshot --control`
// (requests counted in moto's log, time measured), overwrites 2 MiB without a flush, takes
// a second snapshot, overwrites again; then both snapshots are served with `snapshot=NAME`
// and `--read-only`, and their bytes compared with the images kept at each snapshot.
#[test]
fn a_served_disk_is_snapshotted_through_its_control_socket_at_a_flush_point() {
    let name = "a_served_disk_is_snapshotted_through_its_control_socket_at_a_flush_point";
    if !have_moto(name) {
        return;
    }
    let _timer = Timer::new(name);
    let moto = Moto::start();
    moto.create_bucket("disks");
    let dir = temp_dir();
    let url = format!(
        "s3://disks/vm?endpoint={}&layout=log&segment-size=1M",
        moto.endpoint()
    );
    let created = disk(&["create", &url, "--size", "1G"]);
    assert!(created.status.success(), "{}", output_text(&created));
    let control = dir.path().join("control.sock");
    let control_arg = control.to_str().unwrap();
    let server = Server::start(
        dir.path(),
        "vm",
        &[
            "--backend",
            &url,
            "--cache-size",
            "32M",
            "--control",
            control_arg,
        ],
    );
    wait_until("the control socket", TIMEOUT, || control.exists());
    let client = NbdClient::connect(&server.uri()).unwrap();
    let mut image = random_bytes(8 << 20, 51);
    client.write(0, &image).unwrap();
    client.flush().unwrap();

    let refused = disk(&["snapshot", &url, "flushed"]);
    assert_eq!(refused.status.code(), Some(2), "{}", output_text(&refused));
    assert!(
        output_text(&refused).contains("--control"),
        "{}",
        output_text(&refused)
    );

    let requests_before = requests(&moto);
    let started = Instant::now();
    let taken = disk(&[
        "snapshot",
        &url,
        "flushed",
        "--control",
        control_arg,
        "--json",
    ]);
    let seconds = started.elapsed().as_secs_f64();
    assert!(taken.status.success(), "{}", output_text(&taken));
    let snapshot_requests = requests(&moto) - requests_before;
    println!("snapshot of a served 1 GiB disk (8 MiB written, flushed): {seconds:.3} s, {snapshot_requests} store requests");
    assert!(snapshot_requests <= 4, "{snapshot_requests} requests");
    assert!(seconds <= 1.0, "{seconds} s");
    let taken: serde_json::Value = serde_json::from_slice(&taken.stdout).unwrap();
    assert_eq!(taken["mapped_bytes"], 8 << 20, "{taken}");
    let flushed_image = image.clone();

    // Answered but not flushed: the server's flush point takes it in.
    let second = random_bytes(2 << 20, 52);
    client.write(3 << 20, &second).unwrap();
    image[3 << 20..5 << 20].copy_from_slice(&second);
    let taken = disk(&["snapshot", &url, "unflushed", "--control", control_arg]);
    assert!(taken.status.success(), "{}", output_text(&taken));
    let unflushed_image = image.clone();
    let again = disk(&["snapshot", &url, "unflushed", "--control", control_arg]);
    assert_eq!(again.status.code(), Some(2), "{}", output_text(&again));
    assert!(
        output_text(&again).contains("exists"),
        "{}",
        output_text(&again)
    );

    let third = random_bytes(4 << 20, 53);
    client.write(2 << 20, &third).unwrap();
    client.flush().unwrap();
    image[2 << 20..6 << 20].copy_from_slice(&third);

    for (snapshot, expected) in [("flushed", &flushed_image), ("unflushed", &unflushed_image)] {
        let reader = Server::start(
            dir.path(),
            snapshot,
            &[
                "--backend",
                &format!("{url}&snapshot={snapshot}"),
                "--read-only",
                "--cache-size",
                "16M",
            ],
        );
        assert!(
            read(&reader.uri(), 0, 8 << 20) == *expected,
            "snapshot `{snapshot}` differs from the disk as it was"
        );
    }
    assert!(read(&server.uri(), 0, 8 << 20) == image, "the live disk");
    let listed = disk(&["snapshots", &url, "--json"]);
    assert!(listed.status.success(), "{}", output_text(&listed));
    let listed: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
    assert_eq!(listed["snapshots"].as_array().unwrap().len(), 2, "{listed}");

    // Bad names and a missing one: exit 2, one line naming the name.
    for (bad, says) in [("a/b", "`/`"), ("a\u{7}b", "control"), ("", "empty")] {
        let refused = disk(&["snapshot", &url, bad, "--control", control_arg]);
        assert_eq!(refused.status.code(), Some(2), "{}", output_text(&refused));
        assert!(
            output_text(&refused).contains(says),
            "{}",
            output_text(&refused)
        );
    }
    // A clone of a snapshot holds it: its delete is refused naming the clone.
    let clone_url = format!("s3://disks/vm-clone?endpoint={}", moto.endpoint());
    let cloned = disk(&["clone", &url, &clone_url, "--snapshot", "unflushed"]);
    assert!(cloned.status.success(), "{}", output_text(&cloned));
    let held = disk(&["delete-snapshot", &url, "unflushed"]);
    assert_eq!(held.status.code(), Some(2), "{}", output_text(&held));
    assert!(
        output_text(&held).contains("s3://disks/vm-clone"),
        "{}",
        output_text(&held)
    );
    let deleted = disk(&["delete-snapshot", &url, "flushed"]);
    assert!(deleted.status.success(), "{}", output_text(&deleted));
    let missing = disk(&["delete-snapshot", &url, "flushed"]);
    assert_eq!(missing.status.code(), Some(2), "{}", output_text(&missing));
    assert!(
        output_text(&missing).contains("no snapshot named `flushed`"),
        "{}",
        output_text(&missing)
    );

    let writable = run_timeout(
        Command::new(bufcache_bin()).args([
            "serve",
            "--backend",
            &format!("{url}&snapshot=flushed"),
            "--listen",
            &format!("unix:{}", dir.path().join("writable.sock").display()),
        ]),
        TIMEOUT,
    );
    assert_eq!(
        writable.status.code(),
        Some(2),
        "{}",
        output_text(&writable)
    );
    assert!(
        output_text(&writable).contains("--read-only"),
        "{}",
        output_text(&writable)
    );
}
