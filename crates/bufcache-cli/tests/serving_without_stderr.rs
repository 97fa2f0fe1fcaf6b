//! Goal: serving and shutting down never depend on standard error. Method: real `bufcache
//! serve` processes whose stderr is a pipe with its reader gone, or a pipe nobody reads that
//! fills up, serving many client connections at `-v`; then SIGTERM, which with nothing dirty
//! must exit 0 within a second. And a double SIGTERM on an idle server, repeated enough times
//! to hit the moment between the shutdown's write-back and its flush, must never report data
//! as possibly not durable.

mod common;

use std::os::fd::{FromRawFd, OwnedFd};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bufcache_nbd::NbdClient;
use common::*;

const TIMEOUT: Duration = Duration::from_secs(60);
/// What the issue asks of a shutdown with nothing dirty, whatever stderr is.
const IDLE_SHUTDOWN_MAX: Duration = Duration::from_secs(1);
const CONNECTIONS: u64 = 60;

/// A pipe (read end, write end) whose capacity is one page, so a few lines fill it.
fn small_pipe() -> (OwnedFd, OwnedFd) {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two descriptors into the array.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: both descriptors were just created and are owned here.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: fcntl on a descriptor owned here.
    let size = unsafe { libc::fcntl(fds[0], libc::F_SETPIPE_SZ, 4096) };
    assert!(size >= 4096, "F_SETPIPE_SZ failed");
    (read, write)
}

/// Bytes waiting in the pipe whose read end is `fd`.
fn bytes_in_pipe(fd: &OwnedFd) -> usize {
    use std::os::fd::AsRawFd;
    let mut bytes: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int.
    assert_eq!(
        unsafe { libc::ioctl(fd.as_raw_fd(), libc::FIONREAD, &mut bytes) },
        0
    );
    bytes as usize
}

/// Starts `bufcache serve -v` on a file backend with `stderr`, waiting until it accepts.
fn start(dir: &Path, stderr: Stdio) -> (ChildGuard, String) {
    let socket = dir.join("srv.sock");
    let mut command = Command::new(bufcache_bin());
    command
        .args([
            "-v",
            "serve",
            "--backend",
            "disk.img",
            "--create-size",
            "16M",
        ])
        .arg("--listen")
        .arg(format!("unix:{}", socket.display()))
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr);
    let mut server = ChildGuard::spawn(&mut command, "bufcache serve");
    wait_until("bufcache serve to listen", TIMEOUT, || {
        assert!(server.running(), "bufcache serve exited early");
        std::os::unix::net::UnixStream::connect(&socket).is_ok()
    });
    (server, format!("nbd+unix:///?socket={}", socket.display()))
}

/// CONNECTIONS clients one after another, each writing, flushing and reading back its own
/// block (each connection logs at -v). Returns what the disk must hold.
fn serve_many_clients(uri: &str) -> Vec<u8> {
    let mut expected = vec![0u8; (CONNECTIONS * 4096) as usize];
    for index in 0..CONNECTIONS {
        let data = random_bytes(4096, 100 + index);
        let client = NbdClient::connect(uri)
            .unwrap_or_else(|error| panic!("connection {index} refused: {error}"));
        client.write(index * 4096, &data).unwrap();
        client.flush().unwrap();
        let mut back = vec![0u8; 4096];
        client.read(index * 4096, &mut back).unwrap();
        assert_same_bytes(&data, &back, "read back");
        expected[(index * 4096) as usize..][..4096].copy_from_slice(&data);
    }
    expected
}

fn sigterm_exits_0_quickly(server: &mut ChildGuard) {
    let started = Instant::now();
    let status = server
        .signal_and_wait(SIGTERM, TIMEOUT)
        .expect("bufcache serve did not exit after SIGTERM");
    let elapsed = started.elapsed();
    eprintln!("idle shutdown took {elapsed:?}");
    assert!(status.success(), "exit status {status}");
    assert!(
        elapsed < IDLE_SHUTDOWN_MAX,
        "SIGTERM with nothing dirty took {elapsed:?}"
    );
}

#[test]
fn with_stderr_a_closed_pipe_every_client_is_served_and_sigterm_exits_0_within_a_second() {
    // With -v every connection logs; with the pipe's reader gone each of those writes fails
    // with EPIPE. Clients must be served all the same, and SIGTERM must end the server at
    // once with status 0 and the data on disk.
    let _timer = Timer::new(
        "with_stderr_a_closed_pipe_every_client_is_served_and_sigterm_exits_0_within_a_second",
    );
    let dir = temp_dir();
    let (read, write) = small_pipe();
    let (mut server, uri) = start(dir.path(), Stdio::from(write));
    drop(read);
    let expected = serve_many_clients(&uri);
    sigterm_exits_0_quickly(&mut server);
    let on_disk = std::fs::read(dir.path().join("disk.img")).unwrap();
    assert_same_bytes(&expected, &on_disk[..expected.len()], "disk.img");
}

#[test]
fn with_stderr_a_full_unread_pipe_every_client_is_served_and_sigterm_exits_0_within_a_second() {
    // A log pipe nobody drains fills up, and a write to it blocks. Clients must be served all
    // the same (checked after the pipe is shown full), and SIGTERM must end the server within a
    // second with status 0.
    let _timer = Timer::new(
        "with_stderr_a_full_unread_pipe_every_client_is_served_and_sigterm_exits_0_within_a_second",
    );
    let dir = temp_dir();
    let (read, write) = small_pipe();
    let (mut server, uri) = start(dir.path(), Stdio::from(write));
    let expected = serve_many_clients(&uri);
    let waiting = bytes_in_pipe(&read);
    assert!(
        waiting >= 4096 - 512,
        "only {waiting} bytes in the pipe: it never filled, so the test proves nothing"
    );
    // Served again with the pipe full from the start of the round.
    let again = serve_many_clients(&uri);
    assert_eq!(again, expected);
    sigterm_exits_0_quickly(&mut server);
    let on_disk = std::fs::read(dir.path().join("disk.img")).unwrap();
    assert_same_bytes(&expected, &on_disk[..expected.len()], "disk.img");
    drop(read);
}

#[test]
fn a_double_sigterm_on_an_idle_server_exits_0_without_a_false_alarm() {
    // `timeout` and some supervisors send SIGTERM twice. On an idle server (nothing dirty) the
    // second one must not turn a flush that is a moment away into "may not be durable" and
    // exit 1. The race hit 1 run in 6, so it is run RUNS times, on a file backend after a
    // flushed write and on memory as the report did.
    const RUNS: usize = 24;
    let _timer = Timer::new("a_double_sigterm_on_an_idle_server_exits_0_without_a_false_alarm");
    for run in 0..RUNS {
        let dir = temp_dir();
        let backend = if run % 2 == 0 {
            "disk.img"
        } else {
            "memory:8M"
        };
        let mut server = Server::start(
            dir.path(),
            "srv",
            &["--backend", backend, "--create-size", "8M"][..if run % 2 == 0 { 4 } else { 2 }],
        );
        if run % 4 == 0 {
            let client = NbdClient::connect(&server.uri()).expect("connecting");
            client
                .write(0, &random_bytes(64 << 10, run as u64))
                .unwrap();
            client.flush().unwrap();
        }
        let pid = server.pid();
        send_signal(pid, SIGTERM);
        let status = server.signal_and_wait(SIGTERM, TIMEOUT);
        let log = server.log_text();
        assert!(
            status.success() && !log.contains("not be durable"),
            "run {run} ({backend}): {status}:\n{log}"
        );
    }
}

#[test]
fn with_stderr_a_full_disk_lines_are_dropped_and_counted_and_silent_clients_cost_no_listener() {
    // stderr on /dev/full fails every write with ENOSPC, as a log file on a full disk does.
    // Silent clients time out in the handshake, each logging a warning (the report: the
    // listener disappeared after one). Clients must be served after them, the dropped lines
    // counted on /metrics, and SIGTERM must exit 0 within a second.
    let _timer = Timer::new(
        "with_stderr_a_full_disk_lines_are_dropped_and_counted_and_silent_clients_cost_no_listener",
    );
    let dir = temp_dir();
    let socket = dir.path().join("srv.sock");
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap();
    // The metrics address is printed only on stderr, so the port is chosen here.
    let port = free_tcp_port();
    let mut command = Command::new(bufcache_bin());
    command
        .args([
            "-v",
            "serve",
            "--backend",
            "disk.img",
            "--create-size",
            "16M",
        ])
        .args(["--handshake-timeout", "0.2"])
        .args(["--metrics", &format!("127.0.0.1:{port}")])
        .arg("--listen")
        .arg(format!("unix:{}", socket.display()))
        .current_dir(dir.path())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(full);
    let mut server = ChildGuard::spawn(&mut command, "bufcache serve");
    wait_until("bufcache serve to listen", TIMEOUT, || {
        assert!(server.running(), "bufcache serve exited early");
        std::os::unix::net::UnixStream::connect(&socket).is_ok()
    });
    let log = format!("metrics on http://127.0.0.1:{port}/metrics");
    let silent: Vec<_> = (0..5)
        .map(|_| std::os::unix::net::UnixStream::connect(&socket).unwrap())
        .collect();
    wait_until("the silent clients to be timed out", TIMEOUT, || {
        sample(&scrape_log(&log), "bufcache_log_lines_dropped_total") >= 5.0
    });
    drop(silent);
    let uri = format!("nbd+unix:///?socket={}", socket.display());
    let expected = serve_many_clients(&uri);
    let text = scrape_log(&log);
    assert!(
        sample(&text, "bufcache_log_lines_dropped_total") >= 5.0,
        "{text}"
    );
    sigterm_exits_0_quickly(&mut server);
    let on_disk = std::fs::read(dir.path().join("disk.img")).unwrap();
    assert_same_bytes(&expected, &on_disk[..expected.len()], "disk.img");
}

#[test]
fn repeated_warnings_of_one_kind_are_rate_limited_and_counted() {
    // Clients that send garbage each make the server warn "handshake failed". Thirty of them
    // may put at most the rate limit's ten such lines in the log; the rest are counted.
    let _timer = Timer::new("repeated_warnings_of_one_kind_are_rate_limited_and_counted");
    let dir = temp_dir();
    let port = free_tcp_port();
    let mut server = Server::start(
        dir.path(),
        "srv",
        &[
            "--backend",
            "memory:1M",
            "--metrics",
            &format!("127.0.0.1:{port}"),
        ],
    );
    for _ in 0..30 {
        use std::io::{Read, Write};
        let mut stream = std::os::unix::net::UnixStream::connect(server.socket()).unwrap();
        let mut greeting = [0u8; 18];
        stream.read_exact(&mut greeting).unwrap();
        // Client flags, then an option header with the wrong magic.
        stream.write_all(&[0, 0, 0, 3]).unwrap();
        stream.write_all(&[0xde; 16]).unwrap();
        let mut rest = Vec::new();
        let _ = stream.read_to_end(&mut rest);
    }
    let log_address = format!("metrics on http://127.0.0.1:{port}/metrics");
    wait_until("thirty warnings to be logged or held back", TIMEOUT, || {
        let logged = server.log_text().matches("handshake failed").count() as f64;
        logged
            + sample(
                &scrape_log(&log_address),
                "bufcache_log_events_suppressed_total",
            )
            >= 30.0
    });
    let log = server.log_text();
    let logged = log.matches("handshake failed").count();
    assert!(
        (1..=10).contains(&logged),
        "{logged} warnings of one kind logged:\n{log}"
    );
    server.stop_clean();
}

#[test]
fn with_stderr_a_closed_pipe_a_flush_after_an_upstream_restart_completes() {
    // The report: with stderr's reader gone, after an upstream restart a FLUSH hung for good
    // (the reconnect's warning panicked the thread that logged it). Here nbdkit is killed and
    // restarted on the same socket while stderr is a closed pipe; the FLUSH after it must
    // complete, and the upstream's file must hold the data.
    let _timer =
        Timer::new("with_stderr_a_closed_pipe_a_flush_after_an_upstream_restart_completes");
    if !have_tools("closed_stderr_upstream_restart", &["nbdkit"]) {
        return;
    }
    let dir = temp_dir();
    let disk = dir.path().join("up.img");
    write_file(&disk, &vec![0u8; 8 << 20]);
    let upstream_socket = dir.path().join("up.sock");
    let nbdkit = |socket: &Path| {
        let _ = std::fs::remove_file(socket);
        let mut command = Command::new(tool("nbdkit"));
        command
            .arg("-f")
            .arg("-U")
            .arg(socket)
            .arg("file")
            .arg(&disk)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let mut guard = ChildGuard::spawn(&mut command, "nbdkit");
        wait_until("nbdkit to listen", TIMEOUT, || {
            assert!(guard.running(), "nbdkit exited early");
            std::os::unix::net::UnixStream::connect(socket).is_ok()
        });
        guard
    };
    let mut upstream = nbdkit(&upstream_socket);
    let socket = dir.path().join("srv.sock");
    let (read, write) = small_pipe();
    let mut command = Command::new(bufcache_bin());
    command
        .args(["serve", "--backend"])
        .arg(format!("nbd+unix:///?socket={}", upstream_socket.display()))
        .args([
            "--reconnect-delay-initial",
            "0.05",
            "--reconnect-delay-max",
            "0.2",
        ])
        .arg("--listen")
        .arg(format!("unix:{}", socket.display()))
        .current_dir(dir.path())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(write));
    let mut server = ChildGuard::spawn(&mut command, "bufcache serve");
    wait_until("bufcache serve to listen", TIMEOUT, || {
        assert!(server.running(), "bufcache serve exited early");
        std::os::unix::net::UnixStream::connect(&socket).is_ok()
    });
    drop(read);
    let client = NbdClient::connect(&format!("nbd+unix:///?socket={}", socket.display()))
        .expect("connecting");
    let data = random_bytes(1 << 20, 131);
    client.write(0, &data).unwrap();
    client.flush().unwrap();
    let _ = upstream.signal_and_wait(SIGKILL, TIMEOUT);
    client.write(2 << 20, &data).unwrap();
    let _upstream = nbdkit(&upstream_socket);
    // The first FLUSH after a reconnect may fail once (the lost connection's unflushed
    // writes); a later one must succeed. Each must answer (a hang fails the test's timeout).
    wait_until(
        "a FLUSH to succeed after the upstream came back",
        TIMEOUT,
        || client.flush().is_ok(),
    );
    drop(client);
    sigterm_exits_0_quickly(&mut server);
    let on_disk = std::fs::read(&disk).unwrap();
    assert_same_bytes(&data, &on_disk[..data.len()], "up.img");
    assert_same_bytes(&data, &on_disk[2 << 20..(2 << 20) + data.len()], "up.img");
}
