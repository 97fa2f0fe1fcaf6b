//! Goal: a rescue file can never land on the wrong disk, and two servers never share one
//! image. Method: real processes in one working directory — `bufcache serve` in front of
//! nbdkit upstreams whose writes hang (so shutdown must rescue), restarted in the other order
//! in front of healthy upstreams; a second server on an image (or upstream) another server is
//! using; a rescue file named explicitly for the wrong backend.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use bufcache_nbd::NbdClient;
use common::*;

const TIMEOUT: Duration = Duration::from_secs(60);
/// Exit status of `bufcache serve` when dirty data went to the rescue file.
const EXIT_RESCUED: i32 = 3;

/// nbdkit serving `disk` on `socket`; with `hang_writes` every write sleeps an hour.
fn upstream(dir: &Path, socket: &Path, disk: &Path, hang_writes: bool) -> ChildGuard {
    let _ = std::fs::remove_file(socket);
    let mut command = Command::new(tool("nbdkit"));
    command.arg("-f").arg("-U").arg(socket);
    if hang_writes {
        command.arg("--filter=delay");
    }
    command.arg("file").arg(disk);
    if hang_writes {
        command.arg("delay-write=3600");
    }
    command
        .current_dir(dir)
        .stderr(Stdio::null())
        .stdout(Stdio::null());
    let mut guard = ChildGuard::spawn(&mut command, "nbdkit");
    wait_until("nbdkit to listen", TIMEOUT, || {
        assert!(guard.running(), "nbdkit exited early");
        std::os::unix::net::UnixStream::connect(socket).is_ok()
    });
    guard
}

fn rescue_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| {
            path.extension()
                .is_some_and(|extension| extension == "rescue")
        })
        .collect();
    files.sort();
    files
}

/// Runs `bufcache serve ARGS` expecting it to refuse to start; returns its stderr.
fn refused_start(dir: &Path, args: &[&str]) -> String {
    let socket = dir.join("refused.sock");
    let mut command = Command::new(bufcache_bin());
    command
        .arg("serve")
        .args(args)
        .arg("--listen")
        .arg(format!("unix:{}", socket.display()))
        .current_dir(dir);
    let output = run_timeout(command, TIMEOUT);
    let text = output_text(&output);
    assert!(
        !output.status.success(),
        "a second server started on a backend in use:\n{text}"
    );
    assert!(!socket.exists(), "the refused server listened:\n{text}");
    text
}

#[test]
fn two_servers_with_pending_rescues_neither_lose_nor_cross_replay_data() {
    // Two servers in one directory, each over its own upstream whose writes hang, both shut
    // down with dirty data (exit 3). Each must save to its own file; restarted in the other
    // order over healthy upstreams, each must replay exactly its own data into its own disk;
    // and a rescue file named explicitly for the wrong backend must be refused naming both.
    let _timer = Timer::new("two_servers_with_pending_rescues_neither_lose_nor_cross_replay_data");
    if !have_tools("two_server_rescues", &["nbdkit"]) {
        return;
    }
    let dir = temp_dir();
    let names = ["a", "b"];
    let disks: Vec<PathBuf> = names
        .iter()
        .map(|name| dir.path().join(format!("{name}.img")))
        .collect();
    let sockets: Vec<PathBuf> = names
        .iter()
        .map(|name| dir.path().join(format!("{name}-up.sock")))
        .collect();
    let backends: Vec<String> = sockets
        .iter()
        .map(|socket| format!("nbd+unix:///?socket={}", socket.display()))
        .collect();
    let data: Vec<Vec<u8>> = (0..2)
        .map(|index| random_bytes(1 << 20, 70 + index))
        .collect();
    let offset = 4u64 << 20;
    for disk in &disks {
        write_file(disk, &vec![0u8; 16 << 20]);
    }

    let mut hung: Vec<ChildGuard> = (0..2)
        .map(|index| upstream(dir.path(), &sockets[index], &disks[index], true))
        .collect();
    let mut servers: Vec<Server> = (0..2)
        .map(|index| {
            Server::start(
                dir.path(),
                &format!("srv-{}", names[index]),
                &[
                    "--backend",
                    &backends[index],
                    "--no-write-behind",
                    "--dirty-age-max",
                    "3600",
                    "--shutdown-timeout",
                    "1",
                ],
            )
        })
        .collect();
    for (server, data) in servers.iter().zip(&data) {
        let client = NbdClient::connect(&server.uri()).expect("connecting");
        client.write(offset, data).unwrap();
    }
    for server in &mut servers {
        let status = server.terminate(TIMEOUT);
        let log = server.log_text();
        assert_eq!(status.code(), Some(EXIT_RESCUED), "{status}:\n{log}");
        assert!(!log.contains("LOST"), "{log}");
    }
    let files = rescue_files(dir.path());
    assert_eq!(
        files.len(),
        2,
        "expected one rescue file per backend: {files:?}"
    );
    for upstream in &mut hung {
        let _ = upstream.signal_and_wait(SIGKILL, TIMEOUT);
    }

    // The wrong backend: server b's backend with server a's rescue file named explicitly.
    let a_file = servers[0]
        .log_text()
        .lines()
        .last()
        .and_then(|line| {
            files
                .iter()
                .find(|file| line.contains(file.file_name().unwrap().to_str().unwrap()))
                .cloned()
        })
        .expect("server a's last line names its rescue file");
    let _healthy: Vec<ChildGuard> = (0..2)
        .map(|index| upstream(dir.path(), &sockets[index], &disks[index], false))
        .collect();
    let refusal = refused_start(
        dir.path(),
        &[
            "--backend",
            &backends[1],
            "--rescue-file",
            a_file.to_str().unwrap(),
        ],
    );
    assert!(
        refusal.contains("refusing to replay it into another backend")
            && refusal.contains(sockets[0].to_str().unwrap())
            && refusal.contains(sockets[1].to_str().unwrap()),
        "the refusal does not name both backends:\n{refusal}"
    );
    assert!(a_file.exists(), "a refused replay deleted the rescue file");

    // The right backends, started in the other order. The first to start also says that the
    // other's file is not its own and is left alone.
    for (round, index) in [1, 0].into_iter().enumerate() {
        let mut server = Server::start(
            dir.path(),
            &format!("again-{}", names[index]),
            &["--backend", &backends[index]],
        );
        let log = server.log_text();
        assert!(log.contains("replayed rescue file"), "{log}");
        if round == 0 {
            assert!(
                log.contains("is not replayed here") && log.contains(sockets[0].to_str().unwrap()),
                "{log}"
            );
        }
        server.stop_clean();
    }
    assert!(
        rescue_files(dir.path()).is_empty(),
        "a rescue file was left"
    );
    for (disk, data) in disks.iter().zip(&data) {
        let on_disk = std::fs::read(disk).unwrap();
        let start = offset as usize;
        assert_same_bytes(
            data,
            &on_disk[start..start + data.len()],
            "disk after replay",
        );
    }
}

#[test]
fn a_second_server_on_an_image_in_use_refuses_to_start_naming_the_first() {
    // Two servers caching one image overwrite each other's data. The second server on a file
    // backend (from another directory, so no rescue file is shared) must refuse to start,
    // naming the first one's pid; so must a second server on the same upstream in the same
    // directory (its rescue file is locked). The first keeps serving, and what it wrote
    // reaches the image.
    let _timer = Timer::new("a_second_server_on_an_image_in_use_refuses_to_start_naming_the_first");
    let dir = temp_dir();
    let other = temp_dir();
    let image = dir.path().join("disk.img");
    let mut first = Server::start(
        dir.path(),
        "first",
        &["--backend", "disk.img", "--create-size", "8M"],
    );
    let refusal = refused_start(other.path(), &["--backend", image.to_str().unwrap()]);
    assert!(
        refusal.contains(&format!("pid {}", first.pid())) && refusal.contains("disk.img"),
        "the refusal does not name the image and the first server's pid:\n{refusal}"
    );
    let data = random_bytes(256 << 10, 81);
    let client = NbdClient::connect(&first.uri()).expect("connecting");
    client.write(8192, &data).unwrap();
    drop(client);
    first.stop_clean();
    let on_disk = std::fs::read(&image).unwrap();
    assert_same_bytes(&data, &on_disk[8192..8192 + data.len()], "disk.img");

    if !have_tools("second_server_same_upstream", &["nbdkit"]) {
        return;
    }
    let socket = dir.path().join("up.sock");
    let _upstream = upstream(dir.path(), &socket, &image, false);
    let backend = format!("nbd+unix:///?socket={}", socket.display());
    let mut first = Server::start(dir.path(), "first-nbd", &["--backend", &backend]);
    let refusal = refused_start(dir.path(), &["--backend", &backend]);
    assert!(
        refusal.contains(&format!("pid {}", first.pid())) && refusal.contains("rescue file"),
        "the refusal does not name the first server's pid:\n{refusal}"
    );
    first.stop_clean();
}

/// A loop device over a file, detached when dropped.
struct LoopDevice(String);

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.0]).status();
    }
}

#[test]
fn a_second_server_on_a_block_device_in_use_refuses_to_start_naming_the_first() {
    // Block devices are opened O_EXCL as qemu does (the kernel refuses a second exclusive
    // opener, and a mounted device); the refusal names the first server's pid. Needs root and
    // a free loop device; skipped otherwise.
    let _timer =
        Timer::new("a_second_server_on_a_block_device_in_use_refuses_to_start_naming_the_first");
    let dir = temp_dir();
    let image = dir.path().join("loop.img");
    write_file(&image, &vec![0u8; 8 << 20]);
    let attached = Command::new("losetup")
        .args(["-f", "--show"])
        .arg(&image)
        .output();
    let device = match attached {
        Ok(output) if output.status.success() => {
            String::from_utf8_lossy(&output.stdout).trim().to_string()
        }
        _ => {
            eprintln!("SKIP: cannot attach a loop device (needs root and losetup)");
            return;
        }
    };
    let _device = LoopDevice(device.clone());
    let mut first = Server::start(dir.path(), "first", &["--backend", &device]);
    let refusal = refused_start(dir.path(), &["--backend", &device]);
    assert!(
        refusal.contains("block device is busy")
            && refusal.contains(&format!("pid {}", first.pid())),
        "{refusal}"
    );
    first.stop_clean();
}
