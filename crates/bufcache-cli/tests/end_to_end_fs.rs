//! Goal: a real file system runs on bufcache and survives a clean restart. Method: nbdfuse
//! shows the export as a file, mkfs.ext4 formats it, fuse2fs mounts it, a deterministic tree of
//! 2,000 small files is copied in, unmounted, checked clean with `e2fsck -fn` (through the
//! server, and on the backing file after SIGTERM, exit 0), then the server restarts on the same
//! backing file and a read-only mount must give back every file's bytes (checksums).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use common::*;

const FILES: usize = 2000;
const STEP_TIMEOUT: Duration = Duration::from_secs(120);

/// Relative path and contents of file `index` of the tree.
fn tree_file(index: usize) -> (PathBuf, Vec<u8>) {
    let path = PathBuf::from(format!(
        "d{:02}/s{}/f{:04}.dat",
        index % 20,
        (index / 20) % 5,
        index
    ));
    let mut rng = Rng::new(index as u64 * 7919);
    let size = if index % 50 == 7 {
        64 * 1024 + rng.below(256 * 1024) as usize
    } else if index % 10 == 3 {
        0
    } else {
        1 + rng.below(12 * 1024) as usize
    };
    (path, random_bytes(size, 1_000_000 + index as u64))
}

/// Runs `work` on a thread and panics if it takes longer than `timeout` (a hung FUSE mount
/// must fail the test, not hang it; the guards then unmount and kill the daemons).
fn bounded<T: Send + 'static>(
    what: &str,
    timeout: Duration,
    work: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (sender, receiver) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = sender.send(work());
    });
    match receiver.recv_timeout(timeout) {
        Ok(value) => value,
        Err(_) => panic!("{what} did not finish within {timeout:?}"),
    }
}

/// nbdfuse MOUNT/disk URI in the foreground; returns the daemon and its mount guard.
fn nbdfuse(mount: &Path, uri: &str, read_only: bool) -> (ChildGuard, MountGuard) {
    let mut command = Command::new(tool("nbdfuse"));
    if read_only {
        command.arg("--readonly");
    }
    command
        .arg(mount.join("disk"))
        .arg(uri)
        .stdout(Stdio::null());
    let mut daemon = ChildGuard::spawn(&mut command, "nbdfuse");
    let guard = MountGuard::new(mount);
    wait_until("nbdfuse to mount", STEP_TIMEOUT, || {
        assert!(daemon.running(), "nbdfuse exited before mounting");
        is_mounted(mount) && mount.join("disk").exists()
    });
    (daemon, guard)
}

/// fuse2fs IMAGE MOUNT in the foreground; returns the daemon and its mount guard.
fn fuse2fs(image: &Path, mount: &Path, read_only: bool) -> (ChildGuard, MountGuard) {
    let mut command = Command::new(tool("fuse2fs"));
    command.arg("-f").arg("-o").arg("fakeroot");
    if read_only {
        command.arg("-o").arg("ro");
    }
    command.arg(image).arg(mount).stdout(Stdio::null());
    let mut daemon = ChildGuard::spawn(&mut command, "fuse2fs");
    let guard = MountGuard::new(mount);
    wait_until("fuse2fs to mount", STEP_TIMEOUT, || {
        assert!(daemon.running(), "fuse2fs exited before mounting");
        is_mounted(mount)
    });
    (daemon, guard)
}

/// Unmounts and waits for the FUSE daemon to exit (so it has written everything back).
fn unmount(guard: &MountGuard, daemon: &mut ChildGuard) {
    guard.unmount();
    let status = daemon
        .wait(STEP_TIMEOUT)
        .unwrap_or_else(|| panic!("{} did not exit after unmount", daemon.name));
    assert!(status.success(), "{} exited with {status}", daemon.name);
}

fn e2fsck_clean(image: &Path) {
    let output = run_timeout(
        cmd("e2fsck", &["-fn", image.to_str().unwrap()]),
        STEP_TIMEOUT,
    );
    assert!(
        output.status.success(),
        "e2fsck -fn {} is not clean ({}):\n{}",
        image.display(),
        output.status,
        output_text(&output)
    );
    eprintln!(
        "e2fsck -fn {}: clean: {}",
        image.display(),
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .last()
            .unwrap_or("")
    );
}

fn count_files(dir: &Path) -> usize {
    let mut count = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let entry = entry.unwrap();
        let kind = entry.file_type().unwrap();
        if kind.is_dir() {
            if entry.file_name() != "lost+found" {
                count += count_files(&entry.path());
            }
        } else {
            count += 1;
        }
    }
    count
}

#[test]
fn ext4_on_nbdfuse_survives_a_clean_restart() {
    let _timer = Timer::new("ext4_on_nbdfuse_survives_a_clean_restart");
    if !have_tools(
        "ext4_on_nbdfuse",
        &["nbdfuse", "mkfs.ext4", "fuse2fs", "e2fsck", "fusermount3"],
    ) {
        return;
    }
    if !Path::new("/dev/fuse").exists() {
        eprintln!("SKIPPED ext4_on_nbdfuse: /dev/fuse is missing");
        return;
    }
    let dir = temp_dir();
    let nbd_mount = dir.path().join("nbd");
    let fs_mount = dir.path().join("fs");
    std::fs::create_dir(&nbd_mount).unwrap();
    std::fs::create_dir(&fs_mount).unwrap();
    let image = nbd_mount.join("disk");
    let backing = dir.path().join("disk.img");

    // Phase 1: format, mount, copy the tree, unmount, check.
    let mut server = Server::start(
        dir.path(),
        "srv",
        &["--backend", "disk.img", "--create-size", "256M"],
    );
    let (mut nbd_daemon, nbd_guard) = nbdfuse(&nbd_mount, &server.uri(), false);
    run_ok(
        cmd("mkfs.ext4", &["-F", "-q", image.to_str().unwrap()]),
        STEP_TIMEOUT,
    );
    let (mut fs_daemon, fs_guard) = fuse2fs(&image, &fs_mount, false);
    let root = fs_mount.clone();
    let written: usize = bounded("copying the tree", Duration::from_secs(240), move || {
        let mut bytes = 0;
        for index in 0..FILES {
            let (relative, contents) = tree_file(index);
            let path = root.join(&relative);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, &contents)
                .unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
            bytes += contents.len();
        }
        bytes
    });
    eprintln!("copied {FILES} files, {written} bytes");
    unmount(&fs_guard, &mut fs_daemon);
    e2fsck_clean(&image);
    unmount(&nbd_guard, &mut nbd_daemon);
    server.stop_clean();
    // Everything the file system wrote is in the backing file itself.
    e2fsck_clean(&backing);

    // Phase 2: restart on the same backing file, mount read-only, verify every file.
    let mut server = Server::start(dir.path(), "srv2", &["--backend", "disk.img"]);
    let (mut nbd_daemon, nbd_guard) = nbdfuse(&nbd_mount, &server.uri(), true);
    let (mut fs_daemon, fs_guard) = fuse2fs(&image, &fs_mount, true);
    let root = fs_mount.clone();
    bounded("verifying the tree", Duration::from_secs(240), move || {
        for index in 0..FILES {
            let (relative, contents) = tree_file(index);
            let path = root.join(&relative);
            let actual =
                std::fs::read(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
            if checksum(&actual) != checksum(&contents) || actual != contents {
                assert_same_bytes(&contents, &actual, &relative.display().to_string());
            }
        }
        assert_eq!(count_files(&root), FILES, "unexpected files in the tree");
    });
    eprintln!("verified {FILES} files after restart");
    unmount(&fs_guard, &mut fs_daemon);
    unmount(&nbd_guard, &mut nbd_daemon);
    server.stop_clean();
}
