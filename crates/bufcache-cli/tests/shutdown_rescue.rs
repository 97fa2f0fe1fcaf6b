//! Goal: shutdown always ends, never depends on log output, and never drops acknowledged data
//! silently. Method: real processes — `bufcache serve` with its stderr on a pipe whose reader
//! is gone; an nbdkit upstream whose writes hang (`--filter=delay delay-write=3600`) so
//! write-back can never finish, where SIGTERM must end the server within the shutdown timeout
//! with the dirty data in the rescue file (exit 3), and the next start must replay it to a
//! healthy upstream before serving, byte for byte.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bufcache_nbd::NbdClient;
use common::*;

const TIMEOUT: Duration = Duration::from_secs(60);
const SIGINT: i32 = 2;
/// Exit status of `bufcache serve` when dirty data went to the rescue file.
const EXIT_RESCUED: i32 = 3;

fn wait_for_socket(child: &mut ChildGuard, socket: &Path, what: &str) {
    wait_until(what, TIMEOUT, || {
        assert!(child.running(), "{what}: the process exited early");
        std::os::unix::net::UnixStream::connect(socket).is_ok()
    });
}

#[test]
fn sigterm_with_stderr_on_a_closed_pipe_still_writes_back_and_exits() {
    // The signal thread used to print before triggering shutdown; with stderr a broken pipe
    // the print panicked the thread and the server never stopped. Here the pipe's reader is
    // closed before the signal: the server must still exit 0 with the data in the file.
    let _timer = Timer::new("sigterm_with_stderr_on_a_closed_pipe_still_writes_back_and_exits");
    let dir = temp_dir();
    let socket = dir.path().join("srv.sock");
    let mut command = Command::new(bufcache_bin());
    command
        .args(["serve", "--backend", "disk.img", "--create-size", "16M"])
        .args(["--no-write-behind", "--dirty-age-max", "3600"])
        .arg("--listen")
        .arg(format!("unix:{}", socket.display()))
        .current_dir(dir.path())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = command.spawn().expect("starting bufcache serve");
    let stderr = child.stderr.take().unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut server = ChildGuard {
        child: Some(child),
        name: "bufcache serve".into(),
    };
    wait_for_socket(&mut server, &socket, "bufcache serve to listen");
    let data = random_bytes(1 << 20, 31);
    let client = NbdClient::connect(&format!("nbd+unix:///?socket={}", socket.display()))
        .expect("connecting");
    client.write(64 << 10, &data).unwrap();
    drop(client);
    // Every later write to stderr or stdout now fails with EPIPE.
    drop(stderr);
    drop(stdout);
    let status = server
        .signal_and_wait(SIGTERM, TIMEOUT)
        .expect("bufcache serve did not exit after SIGTERM with stderr a broken pipe");
    assert!(status.success(), "exit status {status}");
    let on_disk = std::fs::read(dir.path().join("disk.img")).unwrap();
    assert_same_bytes(
        &data,
        &on_disk[64 << 10..(64 << 10) + data.len()],
        "disk.img",
    );
}

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
    wait_for_socket(&mut guard, socket, "nbdkit to listen");
    guard
}

#[test]
fn sigterm_with_a_hung_upstream_ends_in_time_and_the_rescue_file_is_replayed() {
    // Phase 1: writes to the upstream hang forever; SIGTERM with --shutdown-timeout 2 must end
    // the server within the timeout plus a small constant, exit 3 and save every dirty byte.
    // Phase 2: a healthy upstream on the same disk; the next start replays the rescue file
    // (default action), deletes it, and the disk then holds exactly what was written.
    let _timer =
        Timer::new("sigterm_with_a_hung_upstream_ends_in_time_and_the_rescue_file_is_replayed");
    if !have_tools("hung_upstream_rescue", &["nbdkit"]) {
        return;
    }
    let dir = temp_dir();
    let disk = dir.path().join("disk.img");
    write_file(&disk, &vec![0u8; 32 << 20]);
    let socket = dir.path().join("upstream.sock");
    let backend = format!("nbd+unix:///?socket={}", socket.display());
    let writes = [
        (0u64, random_bytes(256 << 10, 41)),
        (8 << 20, random_bytes(3 << 20, 42)),
        ((32 << 20) - 4096, random_bytes(4096, 43)),
    ];

    let mut hung = upstream(dir.path(), &socket, &disk, true);
    let mut server = Server::start(
        dir.path(),
        "srv",
        &[
            "--backend",
            &backend,
            "--no-write-behind",
            "--dirty-age-max",
            "3600",
            "--shutdown-timeout",
            "2",
        ],
    );
    let client = NbdClient::connect(&server.uri()).expect("connecting");
    for (offset, data) in &writes {
        client.write(*offset, data).unwrap();
    }
    drop(client);
    let started = Instant::now();
    let status = server.terminate(TIMEOUT);
    let elapsed = started.elapsed();
    let log = server.log_text();
    eprintln!("shutdown under a hung upstream took {elapsed:?}");
    assert!(
        elapsed < Duration::from_secs(2 + 8),
        "shutdown took {elapsed:?} with --shutdown-timeout 2:\n{log}"
    );
    assert_eq!(status.code(), Some(EXIT_RESCUED), "{status}:\n{log}");
    let total: usize = writes.iter().map(|(_, data)| data.len()).sum();
    // The default rescue file is named after the backend: bufcache-NAME-HASH.rescue.
    let rescue = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .find(|path| {
            path.extension()
                .is_some_and(|extension| extension == "rescue")
        })
        .expect("no rescue file was written");
    let rescue_name = rescue.file_name().unwrap().to_str().unwrap();
    let last = log.lines().last().unwrap_or_default();
    assert!(
        last.contains(&format!("saved {total} bytes")) && last.contains(rescue_name),
        "the last log line does not say how many bytes went to the rescue file:\n{log}"
    );
    let _ = hung.signal_and_wait(SIGKILL, TIMEOUT);
    assert!(
        std::fs::read(&disk).unwrap().iter().all(|byte| *byte == 0),
        "the hung upstream wrote something after all; the test proves nothing"
    );

    let _healthy = upstream(dir.path(), &socket, &disk, false);
    let mut server = Server::start(dir.path(), "srv2", &["--backend", &backend]);
    let log = server.log_text();
    assert!(
        log.contains("replayed rescue file") && log.contains(&format!("{total} bytes")),
        "{log}"
    );
    assert!(
        !rescue.exists(),
        "the rescue file is still there after replay"
    );
    // Replay flushed before serving: the upstream's disk has the data already.
    let on_disk = std::fs::read(&disk).unwrap();
    for (offset, data) in &writes {
        let offset = *offset as usize;
        assert_same_bytes(
            data,
            &on_disk[offset..offset + data.len()],
            "disk after replay",
        );
    }
    server.stop_clean();
}

#[test]
fn a_second_sigint_skips_the_shutdown_wait() {
    // With a long --shutdown-timeout and a hung upstream, the first SIGINT starts the wait and
    // a second one must go straight to the rescue file (exit 3) long before the timeout.
    let _timer = Timer::new("a_second_sigint_skips_the_shutdown_wait");
    if !have_tools("second_sigint", &["nbdkit"]) {
        return;
    }
    let dir = temp_dir();
    let disk = dir.path().join("disk.img");
    write_file(&disk, &vec![0u8; 8 << 20]);
    let socket = dir.path().join("upstream.sock");
    let backend = format!("nbd+unix:///?socket={}", socket.display());
    let _hung = upstream(dir.path(), &socket, &disk, true);
    let rescue = dir.path().join("saved.rescue");
    let mut server = Server::start(
        dir.path(),
        "srv",
        &[
            "--backend",
            &backend,
            "--no-write-behind",
            "--shutdown-timeout",
            "600",
            "--rescue-file",
            rescue.to_str().unwrap(),
        ],
    );
    let client = NbdClient::connect(&server.uri()).expect("connecting");
    client.write(4096, &random_bytes(64 << 10, 51)).unwrap();
    drop(client);
    send_signal(server.pid(), SIGINT);
    wait_until("the first signal to be handled", TIMEOUT, || {
        server.log_text().contains("writing back dirty data")
    });
    let started = Instant::now();
    let status = server.signal_and_wait(SIGINT, TIMEOUT);
    let log = server.log_text();
    assert!(started.elapsed() < Duration::from_secs(30), "{log}");
    assert_eq!(status.code(), Some(EXIT_RESCUED), "{status}:\n{log}");
    assert!(log.contains("second signal"), "{log}");
    assert!(rescue.exists());
}
