//! Goal: `bufcache serve --backend s3://…` works end to end against a real S3 server and is
//! safe under its failures. Method: moto's S3 server on a free loopback port (and, for
//! faults, a TCP proxy in front of it that can be taken down without losing moto's in-memory
//! objects); real clients (qemu-img, nbdcopy, the NBD client) talk to bufcache; the bucket is
//! checked directly through the chunk store.

mod common;
#[path = "../../bufcache-s3/tests/support/mod.rs"]
mod s3_support;

use std::process::Command;
use std::time::Duration;

use bufcache_nbd::NbdClient;
use bufcache_s3::{ChunkStore, S3Url};
use common::*;
use s3_support::{have_moto, have_seaweedfs, Moto, Proxy, S3Server, SeaweedFs};

const MIB: u64 = 1 << 20;

fn disk_url(endpoint: &str, parameters: &str) -> String {
    format!("s3://disks/vm1?endpoint={endpoint}{parameters}")
}

// Goal: random data written by qemu-img comes back identical through nbdcopy, both while
// cached and after a restart (so it was stored in the bucket, not only in the cache).
// Method: 24 MiB through a 64 MiB disk of 1 MiB chunks; stop cleanly, serve again without
// create-size, copy out again and compare.
#[test]
fn random_data_round_trips_through_qemu_img_and_nbdcopy_and_survives_restart() {
    let name = "random_data_round_trips_through_qemu_img_and_nbdcopy_and_survives_restart";
    if !have_moto(name) || !have_tools(name, &["qemu-img", "nbdcopy"]) {
        return;
    }
    let _timer = Timer::new(name);
    random_data_round_trips(&Moto::start());
}

#[test]
fn random_data_round_trips_through_qemu_img_and_nbdcopy_and_survives_restart_on_seaweedfs() {
    // Goal and method: those of
    // `random_data_round_trips_through_qemu_img_and_nbdcopy_and_survives_restart`, on SeaweedFS.
    let name =
        "random_data_round_trips_through_qemu_img_and_nbdcopy_and_survives_restart_on_seaweedfs";
    if !have_seaweedfs(name) || !have_tools(name, &["qemu-img", "nbdcopy"]) {
        return;
    }
    let _timer = Timer::new(name);
    random_data_round_trips(&SeaweedFs::start());
}

/// The body of the qemu-img/nbdcopy round-trip tests, on `store`.
fn random_data_round_trips(store: &dyn S3Server) {
    let dir = temp_dir();
    store.create_bucket("disks");
    let input = dir.path().join("input.raw");
    let mut data = random_bytes(24 * MIB as usize, 11);
    data.resize(64 * MIB as usize, 0);
    write_file(&input, &data);
    let url = disk_url(
        &store.endpoint(),
        "&create-size=64M&chunk-size=1M&layout=chunk",
    );
    let mut server = Server::start(
        dir.path(),
        "s3",
        &["--backend", &url, "--cache-size", "16M"],
    );
    run_ok(
        cmd("qemu-img", &["convert", "-n", "-f", "raw", "-O", "raw"])
            .arg(&input)
            .arg(server.uri()),
        Duration::from_secs(120),
    );
    let output = dir.path().join("output.raw");
    run_ok(
        cmd("nbdcopy", &[server.uri()]).arg(&output),
        Duration::from_secs(120),
    );
    assert_same_file(&input, &output);
    server.stop_clean();
    let url = disk_url(&store.endpoint(), "");
    let mut server = Server::start(dir.path(), "s3-again", &["--backend", &url]);
    let again = dir.path().join("again.raw");
    run_ok(
        cmd("nbdcopy", &[server.uri()]).arg(&again),
        Duration::from_secs(120),
    );
    assert_same_file(&input, &again);
    server.stop_clean();
}

// Goal: every bad object-store backend is bad input: exit 2, a message naming what was
// wrong, nothing written. Method: a bad parameter, an unreachable endpoint, a missing
// bucket, a missing disk and a size that does not match the stored metadata.
#[test]
fn bad_object_store_backends_exit_2_naming_the_problem_and_write_nothing() {
    let name = "bad_object_store_backends_exit_2_naming_the_problem_and_write_nothing";
    if !have_moto(name) {
        return;
    }
    let dir = temp_dir();
    let moto = Moto::start();
    moto.create_bucket("disks");
    let endpoint = moto.endpoint();
    let existing =
        ChunkStore::open(&S3Url::parse(&disk_url(&endpoint, "&create-size=8M")).unwrap()).unwrap();
    drop(existing);
    let puts_before = moto.request_count("PUT");
    let unreachable = format!("http://127.0.0.1:{}", free_tcp_port());
    let cases = [
        (disk_url(&endpoint, "&chunk-size=3M"), "chunk-size"),
        (disk_url(&unreachable, "&create-size=8M"), "127.0.0.1"),
        (
            format!("s3://no-such-bucket/vm1?endpoint={endpoint}&create-size=8M"),
            "NoSuchBucket",
        ),
        (
            format!("s3://disks/other?endpoint={endpoint}"),
            "create-size=SIZE",
        ),
        (
            disk_url(&endpoint, "&create-size=16M"),
            "`create-size=16MiB`",
        ),
    ];
    for (url, expected) in cases {
        let output = run_timeout(
            Command::new(bufcache_bin())
                .args(["serve", "--backend", &url, "--listen"])
                .arg(format!("unix:{}", dir.path().join("never.sock").display())),
            Duration::from_secs(60),
        );
        let text = output_text(&output);
        assert_eq!(output.status.code(), Some(2), "{url}: {text}");
        assert!(
            text.contains(expected),
            "{url}: expected `{expected}` in: {text}"
        );
    }
    assert_eq!(
        moto.request_count("PUT"),
        puts_before,
        "a refused backend wrote something"
    );
}

// Goal: fsyncgate rules against the object store: with the store down, FLUSH fails (never
// success) and the written data stays readable; once it is back a FLUSH succeeds and the
// data is in the bucket. Method: the server's endpoint is a proxy in front of moto that is
// taken down after the writes and brought back later (moto keeps its in-memory objects);
// the bucket is then read straight through the chunk store.
#[test]
fn flush_fails_while_the_store_is_down_and_succeeds_after_with_data_intact() {
    let name = "flush_fails_while_the_store_is_down_and_succeeds_after_with_data_intact";
    if !have_moto(name) {
        return;
    }
    let dir = temp_dir();
    let moto = Moto::start();
    moto.create_bucket("disks");
    let proxy = Proxy::start(moto.port);
    let url = disk_url(
        &proxy.endpoint(),
        "&create-size=16M&chunk-size=1M&layout=chunk&retry-timeout-ms=1000",
    );
    let mut server = Server::start(dir.path(), "s3", &["--backend", &url]);
    let client = NbdClient::connect(&server.uri()).unwrap();
    let data = random_bytes(6 * MIB as usize, 12);
    proxy.set_down(true);
    client.write(MIB + 4096, &data).unwrap();
    assert!(
        client.flush().is_err(),
        "FLUSH succeeded with the store down"
    );
    let mut back = vec![0u8; data.len()];
    client.read(MIB + 4096, &mut back).unwrap();
    assert_same_bytes(&data, &back, "cached data while the store is down");
    proxy.set_down(false);
    // errseq: the first FLUSH after healing may report a failure latched meanwhile.
    if let Err(error) = client.flush() {
        eprintln!("first FLUSH after healing reported a latched error (allowed once): {error}");
    }
    client.flush().expect("FLUSH after the store came back");
    let store = ChunkStore::open(&S3Url::parse(&disk_url(&moto.endpoint(), "")).unwrap()).unwrap();
    let mut stored = vec![0u8; data.len()];
    store.read(&mut stored, MIB + 4096).unwrap();
    assert_same_bytes(&data, &stored, "bucket after the healed FLUSH");
    drop(client);
    server.stop_clean();
}

/// Runs `bufcache serve` on `url` expecting a refusal: exit status 2; returns its output.
fn serve_refused(dir: &std::path::Path, url: &str) -> String {
    let output = run_timeout(
        Command::new(bufcache_bin())
            .args(["serve", "--backend", url, "--listen"])
            .arg(format!("unix:{}", dir.join("refused.sock").display())),
        Duration::from_secs(60),
    );
    let text = output_text(&output);
    assert_eq!(output.status.code(), Some(2), "{url}: {text}");
    text
}

/// The lock id a refusal names in its `break-lock=ID` advice.
fn lock_id_in(refusal: &str) -> String {
    let start = refusal
        .find("add break-lock=")
        .unwrap_or_else(|| panic!("no break-lock advice in: {refusal}"))
        + "add break-lock=".len();
    refusal[start..]
        .chars()
        .take_while(char::is_ascii_hexdigit)
        .collect()
}

// Goal: two real servers never serve one S3 disk at once; the refusal names the holder, a
// clean shutdown releases the lock, and a lock left by a killed server can be broken only by
// naming it. Method: server A holds the disk; B (same URL) must exit 2 naming A's pid; A
// stops cleanly, the lock object is gone and B starts; B is killed (SIGKILL), its lock stays;
// C is refused naming B, refused again with a wrong `break-lock=`, and starts with the id the
// refusal printed; data A wrote is still read by C.
#[test]
fn second_server_on_one_s3_disk_is_refused_naming_the_holder_until_released_or_broken() {
    let name = "second_server_on_one_s3_disk_is_refused_naming_the_holder_until_released_or_broken";
    if !have_moto(name) {
        return;
    }
    let _timer = Timer::new(name);
    second_server_is_refused_until_released_or_broken(&Moto::start());
}

#[test]
fn second_server_on_one_s3_disk_is_refused_naming_the_holder_until_released_or_broken_on_seaweedfs()
{
    // Goal and method: those of
    // `second_server_on_one_s3_disk_is_refused_naming_the_holder_until_released_or_broken`,
    // on SeaweedFS.
    let name = "second_server_on_one_s3_disk_is_refused_naming_the_holder_until_released_or_broken_on_seaweedfs";
    if !have_seaweedfs(name) {
        return;
    }
    let _timer = Timer::new(name);
    second_server_is_refused_until_released_or_broken(&SeaweedFs::start());
}

/// The body of the lock tests, on `store`.
fn second_server_is_refused_until_released_or_broken(store: &dyn S3Server) {
    let dir = temp_dir();
    store.create_bucket("disks");
    let url = disk_url(
        &store.endpoint(),
        "&create-size=8M&chunk-size=1M&layout=chunk",
    );

    let mut first = Server::start(dir.path(), "first", &["--backend", &url]);
    // The bucket as it is, read without taking the lock.
    let inspector =
        ChunkStore::open(&S3Url::parse(&disk_url(&store.endpoint(), "")).unwrap()).unwrap();
    let holder_pid = || inspector.lock_holder().unwrap().map(|holder| holder.pid);
    let data = random_bytes(MIB as usize, 21);
    NbdClient::connect(&first.uri())
        .unwrap()
        .write(3 * MIB, &data)
        .unwrap();
    assert_eq!(
        holder_pid(),
        Some(u64::from(first.pid())),
        "no lock while serving"
    );
    let refusal = serve_refused(dir.path(), &url);
    assert!(
        refusal.contains("in use by") && refusal.contains(&format!("pid {}", first.pid())),
        "the refusal does not name the holder: {refusal}"
    );
    first.stop_clean();
    assert_eq!(holder_pid(), None, "a clean shutdown left the lock object");

    let mut second = Server::start(dir.path(), "second", &["--backend", &url]);
    let second_pid = second.pid();
    second.kill9();
    assert_eq!(
        holder_pid(),
        Some(u64::from(second_pid)),
        "a killed server's lock vanished"
    );
    let refusal = serve_refused(dir.path(), &url);
    assert!(
        refusal.contains(&format!("pid {second_pid}")),
        "the refusal does not name the killed holder: {refusal}"
    );
    let stale_id = lock_id_in(&refusal);
    let wrong = serve_refused(dir.path(), &format!("{url}&break-lock=0123456789abcdef"));
    assert!(
        wrong.contains("does not name the current lock"),
        "a wrong break-lock id was not refused as such: {wrong}"
    );
    let mut third = Server::start(
        dir.path(),
        "third",
        &["--backend", &format!("{url}&break-lock={stale_id}")],
    );
    assert_eq!(
        holder_pid(),
        Some(u64::from(third.pid())),
        "the broken lock does not name its new holder"
    );
    let mut back = vec![0u8; data.len()];
    NbdClient::connect(&third.uri())
        .unwrap()
        .read(3 * MIB, &mut back)
        .unwrap();
    assert_same_bytes(&data, &back, "data written by the first server");
    third.stop_clean();
    assert_eq!(
        holder_pid(),
        None,
        "a clean shutdown left the broken-and-retaken lock"
    );
}

const FS_STEP_TIMEOUT: Duration = Duration::from_secs(120);
const TREE_FILES: usize = 400;

/// Relative path and contents of file `index` of the test tree (mostly small, a few larger).
fn tree_file(index: usize) -> (std::path::PathBuf, Vec<u8>) {
    let path = std::path::PathBuf::from(format!("d{:02}/f{:04}.dat", index % 16, index));
    let mut rng = Rng::new(index as u64 * 7919);
    let size = if index % 40 == 7 {
        64 * 1024 + rng.below(192 * 1024) as usize
    } else {
        1 + rng.below(8 * 1024) as usize
    };
    (path, random_bytes(size, 2_000_000 + index as u64))
}

/// A FUSE daemon in the foreground (nbdfuse or fuse2fs) and its mount guard, once mounted.
fn fuse_mount(mut command: Command, mount: &std::path::Path) -> (ChildGuard, MountGuard) {
    command.stdout(std::process::Stdio::null());
    let program = command.get_program().to_string_lossy().to_string();
    let mut daemon = ChildGuard::spawn(&mut command, &program);
    let guard = MountGuard::new(mount);
    wait_until("the FUSE mount", FS_STEP_TIMEOUT, || {
        assert!(daemon.running(), "{program} exited before mounting");
        is_mounted(mount)
    });
    (daemon, guard)
}

/// Unmounts and waits for the FUSE daemon to exit (so it has written everything back).
fn fuse_unmount(guard: &MountGuard, daemon: &mut ChildGuard) {
    guard.unmount();
    let status = daemon
        .wait(FS_STEP_TIMEOUT)
        .unwrap_or_else(|| panic!("{} did not exit after unmount", daemon.name));
    assert!(status.success(), "{} exited with {status}", daemon.name);
}

fn e2fsck_clean(image: &std::path::Path) {
    let output = run_timeout(
        cmd("e2fsck", &["-fn", image.to_str().unwrap()]),
        FS_STEP_TIMEOUT,
    );
    assert!(
        output.status.success(),
        "e2fsck -fn is not clean ({}):\n{}",
        output.status,
        output_text(&output)
    );
}

// Goal: a real file system lives on an S3 disk: everything it wrote is in the bucket after a
// clean restart, consistent and intact. Method: nbdfuse shows the export as a file,
// mkfs.ext4 formats it, fuse2fs mounts it and 400 small files (a few of 64-256 KiB) are
// written; unmount, e2fsck clean; the server stops (SIGTERM, exit 0) and a new server on the
// same bucket (empty cache) must give e2fsck clean and every file's bytes back.
#[test]
fn ext4_on_an_s3_disk_survives_a_server_restart_clean_and_intact() {
    let name = "ext4_on_an_s3_disk_survives_a_server_restart_clean_and_intact";
    if !have_moto(name)
        || !have_tools(
            name,
            &["nbdfuse", "mkfs.ext4", "fuse2fs", "e2fsck", "fusermount3"],
        )
    {
        return;
    }
    if !std::path::Path::new("/dev/fuse").exists() {
        eprintln!("skipping {name}: /dev/fuse is missing");
        return;
    }
    let _timer = Timer::new(name);
    let dir = temp_dir();
    let moto = Moto::start();
    moto.create_bucket("disks");
    let nbd_mount = dir.path().join("nbd");
    let fs_mount = dir.path().join("fs");
    std::fs::create_dir(&nbd_mount).unwrap();
    std::fs::create_dir(&fs_mount).unwrap();
    let image = nbd_mount.join("disk");
    let nbdfuse = |uri: &str, read_only: bool| {
        let mut command = Command::new(tool("nbdfuse"));
        if read_only {
            command.arg("--readonly");
        }
        command.arg(&image).arg(uri);
        fuse_mount(command, &nbd_mount)
    };
    let fuse2fs = |read_only: bool| {
        let mut command = Command::new(tool("fuse2fs"));
        command.args(["-f", "-o", "fakeroot"]);
        if read_only {
            command.args(["-o", "ro"]);
        }
        command.arg(&image).arg(&fs_mount);
        fuse_mount(command, &fs_mount)
    };

    let url = disk_url(
        &moto.endpoint(),
        "&create-size=64M&chunk-size=1M&layout=chunk",
    );
    let mut server = Server::start(
        dir.path(),
        "first",
        &["--backend", &url, "--cache-size", "32M"],
    );
    let (mut nbd_daemon, nbd_guard) = nbdfuse(&server.uri(), false);
    run_ok(
        cmd("mkfs.ext4", &["-F", "-q", image.to_str().unwrap()]),
        FS_STEP_TIMEOUT,
    );
    let (mut fs_daemon, fs_guard) = fuse2fs(false);
    for index in 0..TREE_FILES {
        let (relative, contents) = tree_file(index);
        let path = fs_mount.join(relative);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, contents).unwrap();
    }
    fuse_unmount(&fs_guard, &mut fs_daemon);
    e2fsck_clean(&image);
    fuse_unmount(&nbd_guard, &mut nbd_daemon);
    server.stop_clean();

    let url = disk_url(&moto.endpoint(), "");
    let mut server = Server::start(dir.path(), "second", &["--backend", &url]);
    let (mut nbd_daemon, nbd_guard) = nbdfuse(&server.uri(), true);
    e2fsck_clean(&image);
    let (mut fs_daemon, fs_guard) = fuse2fs(true);
    for index in 0..TREE_FILES {
        let (relative, contents) = tree_file(index);
        let actual = std::fs::read(fs_mount.join(&relative)).unwrap();
        assert_same_bytes(&contents, &actual, &relative.display().to_string());
    }
    fuse_unmount(&fs_guard, &mut fs_daemon);
    fuse_unmount(&nbd_guard, &mut nbd_daemon);
    server.stop_clean();
}

// Goal: `serve -r` serves a log-layout disk (the default for new disks) read-only and
// writes nothing to the store. Method: a server creates a disk without `layout=` and
// qemu-io writes a pattern; after a clean stop, `serve -r`: nbdinfo says read-only, qemu-io
// reads the pattern back and may not write; moto's log shows no PUT or DELETE meanwhile.
#[test]
fn serve_read_only_serves_a_log_disk_and_writes_nothing() {
    let name = "serve_read_only_serves_a_log_disk_and_writes_nothing";
    if !have_moto(name) || !have_tools(name, &["nbdinfo", "qemu-io"]) {
        return;
    }
    let dir = temp_dir();
    let moto = Moto::start();
    moto.create_bucket("disks");
    let url = disk_url(&moto.endpoint(), "");
    let create = disk_url(&moto.endpoint(), "&create-size=16M");
    let mut writer = Server::start(dir.path(), "writer", &["--backend", &create]);
    run_ok(
        cmd(
            "qemu-io",
            &["-f", "raw", "-c", "write -P 0xcd 1M 64k", &writer.uri()],
        ),
        Duration::from_secs(30),
    );
    writer.stop_clean();
    let writes_before = (moto.request_count("PUT"), moto.request_count("DELETE"));
    let mut reader = Server::start(dir.path(), "reader", &["-r", "--backend", &url]);
    let info = run_ok(
        cmd("nbdinfo", &["--json", &reader.uri()]),
        Duration::from_secs(30),
    );
    assert!(
        output_text(&info).contains("\"is_read_only\": true"),
        "{}",
        output_text(&info)
    );
    run_ok(
        cmd(
            "qemu-io",
            &[
                "-r",
                "-f",
                "raw",
                "-c",
                "read -P 0xcd 1M 64k",
                "-c",
                "read -P 0 0 1M",
                &reader.uri(),
            ],
        ),
        Duration::from_secs(30),
    );
    let write = run_timeout(
        cmd("qemu-io", &["-f", "raw", "-c", "write 0 4k", &reader.uri()]),
        Duration::from_secs(30),
    );
    assert!(
        !write.status.success(),
        "qemu-io may not write: {}",
        output_text(&write)
    );
    reader.stop_clean();
    assert_eq!(
        (moto.request_count("PUT"), moto.request_count("DELETE")),
        writes_before,
        "(PUT, DELETE): none from a read-only server"
    );
}

// Goal: a small write into a chunk the cache holds whole costs one PUT and no GET (write-back
// fills the chunk from the cached clean blocks instead of reading, merging and rewriting it),
// and the chunk keeps every byte. Method: a 1 MiB-chunk disk; qemu-io writes and flushes
// 4 MiB (four chunks, all cached afterwards), then two 4 KiB writes into chunk 1 and a flush;
// moto's log counts the GETs and PUTs of that second session; after a clean stop a second
// server reads the whole 4 MiB back through qemu-io's pattern checks.
#[test]
fn a_small_write_into_a_wholly_cached_chunk_is_one_put_and_no_get() {
    let name = "a_small_write_into_a_wholly_cached_chunk_is_one_put_and_no_get";
    if !have_moto(name) || !have_tools(name, &["qemu-io"]) {
        return;
    }
    let dir = temp_dir();
    let moto = Moto::start();
    moto.create_bucket("disks");
    let create = disk_url(
        &moto.endpoint(),
        "&create-size=16M&layout=chunk&chunk-size=1M",
    );
    let mut server = Server::start(dir.path(), "filler", &["--backend", &create]);
    run_ok(
        cmd(
            "qemu-io",
            &[
                "-f",
                "raw",
                "-c",
                "write -P 0x11 0 4M",
                "-c",
                "flush",
                &server.uri(),
            ],
        ),
        Duration::from_secs(60),
    );
    let before = (moto.request_count("GET"), moto.request_count("PUT"));
    let log_lines = || {
        std::fs::read_to_string(&moto.log_path)
            .unwrap_or_default()
            .lines()
            .count()
    };
    let lines_before = log_lines();
    run_ok(
        cmd(
            "qemu-io",
            &[
                // Write-back mode: qemu-io's default (writethrough) flushes after every write.
                "-t",
                "writeback",
                "-f",
                "raw",
                "-c",
                "write -P 0x22 1036k 4k",
                "-c",
                "write -P 0x33 1536k 4k",
                "-c",
                "flush",
                &server.uri(),
            ],
        ),
        Duration::from_secs(60),
    );
    let after = (moto.request_count("GET"), moto.request_count("PUT"));
    assert_eq!(
        (after.0 - before.0, after.1 - before.1),
        (0, 1),
        "(GETs, PUTs) of two 4 KiB writes into a cached chunk and a flush; requests:\n{}",
        std::fs::read_to_string(&moto.log_path)
            .unwrap_or_default()
            .lines()
            .skip(lines_before)
            .collect::<Vec<_>>()
            .join("\n")
    );
    server.stop_clean();
    let url = disk_url(&moto.endpoint(), "");
    let mut reader = Server::start(dir.path(), "reader", &["-r", "--backend", &url]);
    run_ok(
        cmd(
            "qemu-io",
            &[
                "-r",
                "-f",
                "raw",
                "-c",
                "read -P 0x11 0 1036k",
                "-c",
                "read -P 0x22 1036k 4k",
                "-c",
                "read -P 0x11 1040k 496k",
                "-c",
                "read -P 0x33 1536k 4k",
                "-c",
                "read -P 0x11 1540k 2556k",
                &reader.uri(),
            ],
        ),
        Duration::from_secs(60),
    );
    reader.stop_clean();
}
