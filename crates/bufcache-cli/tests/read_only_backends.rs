//! Goal: a backend that refuses writes makes a read-only export (issue 33, bug 1): writes are
//! refused with EPERM at once instead of being cached, failing every FLUSH and ending in the
//! rescue file at SIGTERM. Method: `bufcache serve` in front of `nbdkit -r memory 64M`, in
//! front of a file this process may not open for writing (immutable with chattr +i when root,
//! mode 0444 otherwise), and in front of moto with credentials moto's IAM checks allow only to
//! read; nbdinfo reports the export read-only, qemu-io's write fails, reads work, and SIGTERM
//! exits 0 with no rescue file.

mod common;
#[path = "../../bufcache-s3/tests/support/mod.rs"]
mod s3_support;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use bufcache_nbd::protocol::Errno;
use bufcache_nbd::{ClientError, NbdClient};
use bufcache_s3::{ChunkStore, S3Url};
use common::*;

/// nbdinfo says the export is read-only; a write fails; a read works.
fn assert_served_read_only(server: &Server) {
    let info = run_ok(
        cmd("nbdinfo", &["--json", &server.uri()]),
        Duration::from_secs(30),
    );
    assert!(
        output_text(&info).contains("\"is_read_only\": true"),
        "{}",
        output_text(&info)
    );
    // qemu refuses to open a read-only export for writing; a client that writes anyway is
    // answered EPERM.
    let write = run_timeout(
        cmd("qemu-io", &["-f", "raw", "-c", "write 0 4k", &server.uri()]),
        Duration::from_secs(30),
    );
    assert!(
        !write.status.success() && output_text(&write).contains("Permission denied"),
        "qemu-io may not write: {}",
        output_text(&write)
    );
    let client = NbdClient::connect(&server.uri()).expect("connect");
    match client.write(0, b"data") {
        Err(ClientError::Request { errno, .. }) => assert_eq!(errno, Errno::Perm),
        other => panic!("a write is refused with EPERM, not {other:?}"),
    }
    client.disconnect();
    run_ok(
        cmd(
            "qemu-io",
            &["-r", "-f", "raw", "-c", "read -P 0 0 4k", &server.uri()],
        ),
        Duration::from_secs(30),
    );
}

/// SIGTERM exits 0, with nothing to rescue.
fn assert_clean_exit(server: &mut Server, dir: &Path) {
    server.stop_clean();
    let rescued: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(Result::ok)
        .filter(|entry| entry.file_name().to_string_lossy().contains("rescue"))
        .collect();
    assert!(rescued.is_empty(), "no rescue file: {rescued:?}");
}

#[test]
fn a_read_only_upstream_makes_a_read_only_export() {
    if !have_tools("read_only_upstream", &["nbdkit", "nbdinfo", "qemu-io"]) {
        return;
    }
    let dir = temp_dir();
    let socket = dir.path().join("upstream.sock");
    let mut nbdkit = ChildGuard::spawn(
        Command::new(tool("nbdkit"))
            .args(["-f", "-r", "-U"])
            .arg(&socket)
            .args(["memory", "64M"]),
        "nbdkit",
    );
    wait_until("nbdkit to accept", Duration::from_secs(30), || {
        assert!(nbdkit.running(), "nbdkit exited early");
        socket.exists()
    });
    let backend = format!("nbd+unix:///?socket={}", socket.display());
    let mut server = Server::start(dir.path(), "serve", &["--backend", &backend]);
    assert_served_read_only(&server);
    assert_clean_exit(&mut server, dir.path());
}

/// Makes `path` impossible for this process to open for writing; false when it cannot.
fn forbid_writing(path: &Path) -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let forbidden = if root {
        Command::new("chattr")
            .arg("+i")
            .arg(path)
            .status()
            .is_ok_and(|status| status.success())
    } else {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o444)).is_ok()
    };
    forbidden && std::fs::OpenOptions::new().write(true).open(path).is_err()
}

/// Lifts `chattr +i` again, so the temporary directory can be removed.
struct Immutable<'a>(&'a Path);

impl Drop for Immutable<'_> {
    fn drop(&mut self) {
        let _ = Command::new("chattr").arg("-i").arg(self.0).status();
    }
}

#[test]
fn a_file_that_may_only_be_read_is_served_read_only() {
    if !have_tools("read_only_file", &["nbdinfo", "qemu-io"]) {
        return;
    }
    let dir = temp_dir();
    let image = dir.path().join("disk.img");
    std::fs::File::create(&image)
        .and_then(|file| file.set_len(16 << 20))
        .unwrap();
    let _immutable = Immutable(&image);
    if !forbid_writing(&image) {
        println!("skipping: cannot make a file unwritable here (no chattr, or it had no effect)");
        return;
    }
    let mut server = Server::start(dir.path(), "serve", &["--backend", image.to_str().unwrap()]);
    assert!(
        server.log_text().contains("serving it read-only"),
        "{}",
        server.log_text()
    );
    assert_served_read_only(&server);
    assert_clean_exit(&mut server, dir.path());
}

/// Moto's request log lines for `method` requests (`"PUT /bucket/key HTTP/1.1" 403 -`).
fn moto_requests(moto: &s3_support::Moto, method: &str) -> Vec<String> {
    std::fs::read_to_string(&moto.log_path)
        .unwrap_or_default()
        .lines()
        .filter(|line| line.contains(&format!("\"{method} ")))
        .map(str::to_string)
        .collect()
}

/// A 16 MiB disk of 1 MiB chunks at `url`, created by a server with the tests' own (full)
/// credentials, holding 0xab in [1 MiB, 1 MiB + 64 KiB); the server is stopped cleanly, so
/// the data is in the bucket and the lock released.
fn s3_disk_with_data(dir: &Path, url: &str) {
    let create = format!("{url}&create-size=16M&chunk-size=1M&layout=chunk");
    let mut writer = Server::start(dir, "writer", &["--backend", &create]);
    run_ok(
        cmd(
            "qemu-io",
            &["-f", "raw", "-c", "write -P 0xab 1M 64k", &writer.uri()],
        ),
        Duration::from_secs(30),
    );
    writer.stop_clean();
}

/// The data [`s3_disk_with_data`] wrote reads back through `server`.
fn assert_s3_data_reads_back(server: &Server) {
    run_ok(
        cmd(
            "qemu-io",
            &[
                "-r",
                "-f",
                "raw",
                "-c",
                "read -P 0xab 1M 64k",
                &server.uri(),
            ],
        ),
        Duration::from_secs(30),
    );
}

// Goal: S3 credentials that may only read make a read-only export (issue 33, bug 1), said on
// one line, instead of a server that cannot start (or one that caches writes it can never
// store): no lock is taken, the only write ever tried is the lock's PUT, refused 403, and the
// data already in the bucket is served. Method: moto with IAM checks on and a user allowed
// only s3:GetObject and s3:ListBucket (moto_read_only_user.py); a disk written first with
// full credentials; `serve` with the reader's key; nbdinfo, qemu-io and the NBD client check
// the export; moto's log counts the PUTs; after turning the checks off, no lock object.
#[test]
fn credentials_that_cannot_write_serve_a_read_only_export() {
    let name = "credentials_that_cannot_write_serve_a_read_only_export";
    if !s3_support::have_moto(name) || !have_tools(name, &["nbdinfo", "qemu-io"]) {
        return;
    }
    let _timer = Timer::new(name);
    let dir = temp_dir();
    let moto = s3_support::Moto::start();
    moto.create_bucket("disks");
    let url = format!("s3://disks/vm1?endpoint={}", moto.endpoint());
    s3_disk_with_data(dir.path(), &url);
    let (key_id, secret) = moto.read_only_user();
    let puts_before = moto_requests(&moto, "PUT").len();
    let mut server = Server::start_with_env(
        dir.path(),
        "reader",
        Listen::Unix(dir.path().join("reader.sock")),
        &["--backend", &url],
        &[
            ("AWS_ACCESS_KEY_ID", key_id.as_str()),
            ("AWS_SECRET_ACCESS_KEY", secret.as_str()),
        ],
    );
    let log = server.log_text();
    let said: Vec<&str> = log
        .lines()
        .filter(|line| line.contains("serving it read-only"))
        .collect();
    assert!(
        said.len() == 1 && said[0].contains("refuses writes") && said[0].contains("AccessDenied"),
        "one line says why the export is read-only:\n{log}"
    );
    assert_served_read_only(&server);
    assert_s3_data_reads_back(&server);
    assert_clean_exit(&mut server, dir.path());
    let puts = moto_requests(&moto, "PUT");
    let tried = &puts[puts_before..];
    assert!(
        tried.len() == 1 && tried[0].contains("bufcache-lock.json") && tried[0].contains("\" 403"),
        "the only write tried is the lock's PUT, refused: {tried:?}"
    );
    moto.stop_checking_iam();
    let store = ChunkStore::open(&S3Url::parse(&url).unwrap()).unwrap();
    assert_eq!(store.lock_holder().unwrap(), None, "no lock object is left");
}

// Goal: `serve --read-only` over S3 writes nothing to the store, not even the disk lock, and
// serves what the bucket holds. Method: a disk written first by a server with the same
// (full) credentials; `serve -r`; nbdinfo, qemu-io and the NBD client check the export;
// moto's log must show no PUT and no DELETE from the read-only server, and no lock object.
#[test]
fn an_explicit_read_only_request_over_s3_puts_nothing_not_even_the_lock() {
    let name = "an_explicit_read_only_request_over_s3_puts_nothing_not_even_the_lock";
    if !s3_support::have_moto(name) || !have_tools(name, &["nbdinfo", "qemu-io"]) {
        return;
    }
    let _timer = Timer::new(name);
    let dir = temp_dir();
    let moto = s3_support::Moto::start();
    moto.create_bucket("disks");
    let url = format!("s3://disks/vm1?endpoint={}", moto.endpoint());
    s3_disk_with_data(dir.path(), &url);
    let before = (
        moto_requests(&moto, "PUT").len(),
        moto_requests(&moto, "DELETE").len(),
    );
    let mut server = Server::start(dir.path(), "reader", &["-r", "--backend", &url]);
    assert_served_read_only(&server);
    assert_s3_data_reads_back(&server);
    let store = ChunkStore::open(&S3Url::parse(&url).unwrap()).unwrap();
    assert_eq!(store.lock_holder().unwrap(), None, "no lock while serving");
    assert_clean_exit(&mut server, dir.path());
    assert_eq!(
        (
            moto_requests(&moto, "PUT").len(),
            moto_requests(&moto, "DELETE").len()
        ),
        before,
        "(PUT, DELETE) requests: none from a read-only server"
    );
}
