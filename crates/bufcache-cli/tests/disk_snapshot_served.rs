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
use s3_support::{have_moto, have_seaweedfs, Moto, S3Server, SeaweedFs};

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
    // The served base with a clone: its delete is refused (a server holds it, and a clone
    // reads its snapshot); the clone's delete frees the snapshot.
    let base_held = disk(&["delete", &url]);
    assert_eq!(
        base_held.status.code(),
        Some(2),
        "{}",
        output_text(&base_held)
    );
    assert!(
        output_text(&base_held).contains("s3://disks/vm-clone"),
        "{}",
        output_text(&base_held)
    );
    let clone_deleted = disk(&["delete", &clone_url, "--json"]);
    assert!(
        clone_deleted.status.success(),
        "{}",
        output_text(&clone_deleted)
    );
    let clone_deleted: serde_json::Value = serde_json::from_slice(&clone_deleted.stdout).unwrap();
    assert_eq!(
        clone_deleted["base"]["snapshot"], "unflushed",
        "{clone_deleted}"
    );
    let again = disk(&["delete", &clone_url]);
    assert_eq!(again.status.code(), Some(2), "{}", output_text(&again));
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

/// The size nbdinfo is told on a new connection.
fn nbdinfo_size(uri: &str) -> u64 {
    let output = run_ok(Command::new("nbdinfo").args(["--size", uri]), TIMEOUT);
    String::from_utf8(output.stdout)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// Asserts a `disk` command exited 2 with one line saying `says`, and returns that line.
fn refused_saying(output: &std::process::Output, says: &str) -> String {
    let text = output_text(output);
    assert_eq!(output.status.code(), Some(2), "{text}");
    let line = String::from_utf8_lossy(&output.stderr).trim().to_string();
    assert!(line.contains(says), "wanted `{says}`: {text}");
    assert!(!line.contains('\n'), "one line: {line:?}");
    line
}

// Goal: a served log-layout disk grows through its server's control socket: a client that
// connects afterwards is told the new size (nbdinfo) and reads and writes past the old end,
// the client connected before keeps working, and the store records the size (a restart
// serves it); each bad input is one line, exit 2, and changes nothing: a shrink, a size not
// a whole number of 4 KiB, --force with --control, a disk the server does not hold, and an
// offline resize of the served disk. Method: serve a 64 MiB disk with --control, write its
// last MiB, `disk resize URL 96M --control`, nbdinfo on a new connection, write and read
// across the old end on a new connection and the old one's range on the old one, try each
// bad input and check the size nbdinfo and `disk info` see is unchanged, restart and compare.
// qemu-img info on a new connection too, when it is installed.
#[test]
fn a_served_disk_grows_through_its_control_socket_and_new_connections_see_it() {
    let name = "a_served_disk_grows_through_its_control_socket_and_new_connections_see_it";
    if !have_moto(name) || !have_tools(name, &["nbdinfo"]) {
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
    let created = disk(&["create", &url, "--size", "64M"]);
    assert!(created.status.success(), "{}", output_text(&created));
    let control = dir.path().join("control.sock");
    let control_arg = control.to_str().unwrap();
    let serve_args = [
        "--backend",
        &url,
        "--cache-size",
        "32M",
        "--control",
        control_arg,
    ];
    let mut server = Server::start(dir.path(), "vm", &serve_args);
    wait_until("the control socket", TIMEOUT, || control.exists());
    assert_eq!(nbdinfo_size(&server.uri()), 64 << 20);
    let before = NbdClient::connect(&server.uri()).unwrap();
    let tail = random_bytes(1 << 20, 61);
    before.write(63 << 20, &tail).unwrap();

    let grown = disk(&["resize", &url, "96M", "--control", control_arg, "--json"]);
    assert!(grown.status.success(), "{}", output_text(&grown));
    let grown: serde_json::Value = serde_json::from_slice(&grown.stdout).unwrap();
    assert_eq!(
        (&grown["size_bytes_before"], &grown["size_bytes_after"]),
        (&serde_json::json!(64 << 20), &serde_json::json!(96 << 20)),
        "{grown}"
    );
    assert_eq!(nbdinfo_size(&server.uri()), 96 << 20, "a new connection");
    if Command::new("qemu-img").arg("--version").output().is_ok() {
        let info = run_ok(
            Command::new("qemu-img").args(["info", "--output=json", &server.uri()]),
            TIMEOUT,
        );
        let info: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
        assert_eq!(
            info["virtual-size"],
            96 << 20,
            "qemu-img on a new connection"
        );
    }
    let after = NbdClient::connect(&server.uri()).unwrap();
    let across = random_bytes(4 << 20, 62);
    after.write(62 << 20, &across).unwrap();
    after.flush().unwrap();
    let mut expected = vec![0u8; 96 << 20];
    expected[63 << 20..64 << 20].copy_from_slice(&tail);
    expected[62 << 20..66 << 20].copy_from_slice(&across);
    assert!(read(&server.uri(), 60 << 20, 36 << 20) == expected[60 << 20..]);
    let mut old_range = vec![0u8; 1 << 20];
    before.read(63 << 20, &mut old_range).unwrap();
    assert!(
        old_range == expected[63 << 20..64 << 20],
        "the connection made before"
    );

    // Bad input: one line, exit 2, nothing changed.
    refused_saying(
        &disk(&["resize", &url, "80M", "--control", control_arg]),
        "only grows",
    );
    refused_saying(
        &disk(&["resize", &url, "100664296", "--control", control_arg]),
        "4096",
    );
    refused_saying(
        &disk(&["resize", &url, "128M", "--force", "--control", control_arg]),
        "only grows",
    );
    let other = format!("s3://disks/other?endpoint={}", moto.endpoint());
    refused_saying(
        &disk(&["resize", &other, "128M", "--control", control_arg]),
        "holds no log-layout disk",
    );
    refused_saying(&disk(&["resize", &url, "128M"]), "--control");
    assert_eq!(nbdinfo_size(&server.uri()), 96 << 20);
    let info = disk(&["info", &url, "--json"]);
    let info: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
    assert_eq!(info["size_bytes"], 96 << 20, "{info}");

    drop((before, after));
    server.stop_clean();
    let server = Server::start(dir.path(), "vm-again", &serve_args);
    assert_eq!(nbdinfo_size(&server.uri()), 96 << 20, "after a restart");
    assert!(read(&server.uri(), 60 << 20, 36 << 20) == expected[60 << 20..]);
}

// Goal: a served chunk-layout disk grows through its server's control socket as a log-layout
// one does: new connections are told the new size, writes across the old end read back,
// the chunks past the old end read as zeroes, a connection made before keeps reading its
// range, bad sizes are refused with one line and nothing changed, and a restart serves the
// new size with the data. Method: serve a 64 MiB chunk disk (1 MiB chunks) with --control,
// write its last MiB, grow it to 96 MiB with `disk resize --control`, check nbdinfo, write
// 4 MiB across the old end, compare the last 36 MiB with the expected image; try a shrink
// and a size that is no whole number of chunks; restart and compare again.
#[test]
fn a_served_chunk_layout_disk_grows_through_its_control_socket() {
    let name = "a_served_chunk_layout_disk_grows_through_its_control_socket";
    if !have_moto(name) || !have_tools(name, &["nbdinfo"]) {
        return;
    }
    let _timer = Timer::new(name);
    let moto = Moto::start();
    moto.create_bucket("disks");
    let dir = temp_dir();
    let url = format!(
        "s3://disks/chunky?endpoint={}&layout=chunk&chunk-size=1M",
        moto.endpoint()
    );
    let created = disk(&["create", &url, "--size", "64M"]);
    assert!(created.status.success(), "{}", output_text(&created));
    let control = dir.path().join("control.sock");
    let control_arg = control.to_str().unwrap();
    let serve_args = [
        "--backend",
        &url,
        "--cache-size",
        "32M",
        "--control",
        control_arg,
    ];
    let mut server = Server::start(dir.path(), "chunky", &serve_args);
    wait_until("the control socket", TIMEOUT, || control.exists());
    assert_eq!(nbdinfo_size(&server.uri()), 64 << 20);
    let before = NbdClient::connect(&server.uri()).unwrap();
    let tail = random_bytes(1 << 20, 63);
    before.write(63 << 20, &tail).unwrap();

    let grown = disk(&["resize", &url, "96M", "--control", control_arg, "--json"]);
    assert!(grown.status.success(), "{}", output_text(&grown));
    let grown: serde_json::Value = serde_json::from_slice(&grown.stdout).unwrap();
    assert_eq!(
        (&grown["size_bytes_before"], &grown["size_bytes_after"]),
        (&serde_json::json!(64 << 20), &serde_json::json!(96 << 20)),
        "{grown}"
    );
    assert_eq!(nbdinfo_size(&server.uri()), 96 << 20, "a new connection");
    let after = NbdClient::connect(&server.uri()).unwrap();
    let across = random_bytes(4 << 20, 64);
    after.write(62 << 20, &across).unwrap();
    after.flush().unwrap();
    let mut expected = vec![0u8; 96 << 20];
    expected[63 << 20..64 << 20].copy_from_slice(&tail);
    expected[62 << 20..66 << 20].copy_from_slice(&across);
    assert!(read(&server.uri(), 60 << 20, 36 << 20) == expected[60 << 20..]);
    let mut old_range = vec![0u8; 1 << 20];
    before.read(63 << 20, &mut old_range).unwrap();
    assert!(
        old_range == expected[63 << 20..64 << 20],
        "the connection made before"
    );

    // Bad input: one line, exit 2, nothing changed.
    refused_saying(
        &disk(&["resize", &url, "80M", "--control", control_arg]),
        "only grows",
    );
    refused_saying(
        &disk(&["resize", &url, "100667392", "--control", control_arg]),
        "chunk size",
    );
    assert_eq!(nbdinfo_size(&server.uri()), 96 << 20);
    let info = disk(&["info", &url, "--json"]);
    let info: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
    assert_eq!(info["size_bytes"], 96 << 20, "{info}");

    drop((before, after));
    server.stop_clean();
    let server = Server::start(dir.path(), "chunky-again", &serve_args);
    assert_eq!(nbdinfo_size(&server.uri()), 96 << 20, "after a restart");
    assert!(read(&server.uri(), 60 << 20, 36 << 20) == expected[60 << 20..]);
}

/// Fails unless `output` is a refusal (exit 2) on one line saying `says`.
fn refused_in_one_line(output: &std::process::Output, says: &str) {
    let text = output_text(output);
    assert_eq!(output.status.code(), Some(2), "{text}");
    assert!(text.contains(says), "{text}");
    assert_eq!(text.trim().lines().count(), 1, "{text}");
}

// Goal: a clone in another bucket of the same store, made with `bufcache disk clone` and
// served over NBD, reads its base's snapshot where it has not written and its own writes
// elsewhere, across a restart, while the base reads as before; its creation costs at most 4
// store requests (moto); `disk delete-snapshot` of its snapshot is refused naming the clone's
// bucket and prefix until `disk delete` of the clone, after which it succeeds; a clone into a
// bucket that does not exist, or onto a disk, is refused in one line with nothing changed.
// Method: on moto and on SeaweedFS, a base in bucket `bases` written over NBD, snapshotted
// offline, cloned into bucket `clones`; the clone served, read, written, flushed, restarted
// and read whole over NBD; the base served and read; then the deletes.
#[test]
fn a_clone_in_another_bucket_is_served_over_nbd_and_holds_its_snapshot() {
    let name = "a_clone_in_another_bucket_is_served_over_nbd_and_holds_its_snapshot";
    if have_moto(name) {
        let moto = Moto::start();
        clone_in_another_bucket_served(&moto, Some(&moto));
    }
    if have_seaweedfs(name) {
        clone_in_another_bucket_served(&SeaweedFs::start(), None);
    }
}

/// The body of [`a_clone_in_another_bucket_is_served_over_nbd_and_holds_its_snapshot`] on
/// `server`; requests counted when `counted` is moto.
fn clone_in_another_bucket_served(server: &dyn S3Server, counted: Option<&Moto>) {
    const DISK_BYTES: usize = 16 << 20;
    const WRITTEN_BYTES: usize = 8 << 20;
    let _timer = Timer::new("clone_in_another_bucket_served");
    server.create_bucket("bases");
    server.create_bucket("clones");
    let dir = temp_dir();
    let endpoint = server.endpoint();
    let base_url = format!("s3://bases/vm?endpoint={endpoint}&layout=log&segment-size=1M");
    let clone_url = format!("s3://clones/vm?endpoint={endpoint}");
    let created = disk(&["create", &base_url, "--size", "16M"]);
    assert!(created.status.success(), "{}", output_text(&created));
    let mut image = vec![0u8; DISK_BYTES];
    image[..WRITTEN_BYTES].copy_from_slice(&random_bytes(WRITTEN_BYTES, 61));
    {
        let mut base = Server::start(
            dir.path(),
            "base",
            &["--backend", &base_url, "--cache-size", "16M"],
        );
        let client = NbdClient::connect(&base.uri()).unwrap();
        client.write(0, &image[..WRITTEN_BYTES]).unwrap();
        client.flush().unwrap();
        drop(client);
        base.stop_clean();
    }
    let taken = disk(&["snapshot", &base_url, "golden"]);
    assert!(taken.status.success(), "{}", output_text(&taken));

    // Bad input: one line, exit 2, nothing left behind.
    let missing = disk(&[
        "clone",
        &base_url,
        &format!("s3://missing-bucket/vm?endpoint={endpoint}"),
        "--snapshot",
        "golden",
    ]);
    refused_in_one_line(&missing, "bucket `missing-bucket` does not exist");
    let occupied_url = format!("s3://clones/occupied?endpoint={endpoint}&layout=log");
    let occupied = disk(&["create", &occupied_url, "--size", "1M"]);
    assert!(occupied.status.success(), "{}", output_text(&occupied));
    let onto_disk = disk(&["clone", &base_url, &occupied_url, "--snapshot", "golden"]);
    refused_in_one_line(&onto_disk, "a disk exists");
    // The refused clones left no record holding the snapshot: it deletes (and is taken
    // again).
    let unheld = disk(&["delete-snapshot", &base_url, "golden"]);
    assert!(unheld.status.success(), "{}", output_text(&unheld));
    let taken = disk(&["snapshot", &base_url, "golden"]);
    assert!(taken.status.success(), "{}", output_text(&taken));

    let before = counted.map(requests);
    let cloned = disk(&[
        "clone",
        &base_url,
        &clone_url,
        "--snapshot",
        "golden",
        "--json",
    ]);
    assert!(cloned.status.success(), "{}", output_text(&cloned));
    if let (Some(moto), Some(before)) = (counted, before) {
        let clone_requests = requests(moto) - before;
        println!("disk clone into another bucket: {clone_requests} store requests");
        assert!(clone_requests <= 4, "{clone_requests} requests");
    }
    let cloned: serde_json::Value = serde_json::from_slice(&cloned.stdout).unwrap();
    assert_eq!(cloned["mapped_bytes"], WRITTEN_BYTES, "{cloned}");

    let mut expected = image.clone();
    {
        let mut served = Server::start(
            dir.path(),
            "clone",
            &["--backend", &clone_url, "--cache-size", "16M"],
        );
        assert!(
            read(&served.uri(), 0, DISK_BYTES) == image,
            "the fresh clone reads its base's snapshot"
        );
        let client = NbdClient::connect(&served.uri()).unwrap();
        let written = random_bytes(2 << 20, 62);
        client.write(3 << 20, &written).unwrap();
        expected[3 << 20..5 << 20].copy_from_slice(&written);
        let past = random_bytes(1 << 20, 63);
        client.write(12 << 20, &past).unwrap();
        expected[12 << 20..13 << 20].copy_from_slice(&past);
        client.flush().unwrap();
        drop(client);
        served.stop_clean();
    }
    {
        let mut served = Server::start(
            dir.path(),
            "clone-again",
            &["--backend", &clone_url, "--cache-size", "16M"],
        );
        assert!(
            read(&served.uri(), 0, DISK_BYTES) == expected,
            "the restarted clone: its writes over its base's snapshot"
        );
        served.stop_clean();
    }
    {
        let mut served = Server::start(
            dir.path(),
            "base-again",
            &["--backend", &base_url, "--read-only", "--cache-size", "16M"],
        );
        assert!(
            read(&served.uri(), 0, DISK_BYTES) == image,
            "the base unchanged"
        );
        served.stop_clean();
    }

    let held = disk(&["delete-snapshot", &base_url, "golden"]);
    refused_in_one_line(&held, "s3://clones/vm");
    let deleted = disk(&["delete", &clone_url, "--json"]);
    assert!(deleted.status.success(), "{}", output_text(&deleted));
    let deleted: serde_json::Value = serde_json::from_slice(&deleted.stdout).unwrap();
    assert_eq!(deleted["base"]["url"], "s3://bases/vm", "{deleted}");
    assert_eq!(deleted["base"]["snapshot"], "golden", "{deleted}");
    let freed = disk(&["delete-snapshot", &base_url, "golden"]);
    assert!(freed.status.success(), "{}", output_text(&freed));
}
