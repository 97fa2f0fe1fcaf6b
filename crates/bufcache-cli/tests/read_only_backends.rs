//! Goal: a backend that refuses writes makes a read-only export (issue 33, bug 1): writes are
//! refused with EPERM at once instead of being cached, failing every FLUSH and ending in the
//! rescue file at SIGTERM. Method: `bufcache serve` in front of `nbdkit -r memory 64M`, and in
//! front of a file this process may not open for writing (immutable with chattr +i when root,
//! mode 0444 otherwise); nbdinfo reports the export read-only, qemu-io's write fails, reads
//! work, and SIGTERM exits 0 with no rescue file.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use bufcache_nbd::protocol::Errno;
use bufcache_nbd::{ClientError, NbdClient};
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
