//! Goal: an upstream NBD server that dies and comes back (same socket) costs availability for
//! the outage only, never data: cached reads and writes keep working, FLUSH fails while the
//! upstream is away (never a false success), and after it returns write-back resumes and the
//! next FLUSH puts everything on it. Method: real nbdkit (file plugin) killed with SIGKILL
//! and restarted on the same unix socket and file; afterwards the file itself is compared
//! with everything written.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bufcache_nbd::NbdClient;
use common::*;

const TIMEOUT: Duration = Duration::from_secs(60);

fn nbdkit_file(socket: &Path, disk: &Path) -> ChildGuard {
    let _ = std::fs::remove_file(socket);
    let mut command = Command::new(tool("nbdkit"));
    command
        .arg("-f")
        .arg("-U")
        .arg(socket)
        .arg("file")
        .arg(disk)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut guard = ChildGuard::spawn(&mut command, "nbdkit");
    wait_until("nbdkit to listen", TIMEOUT, || {
        assert!(guard.running(), "nbdkit exited early");
        std::os::unix::net::UnixStream::connect(socket).is_ok()
    });
    guard
}

#[test]
fn upstream_killed_and_restarted_loses_nothing_and_flush_never_lies() {
    let _timer = Timer::new("upstream_killed_and_restarted_loses_nothing_and_flush_never_lies");
    if !have_tools("upstream_reconnect", &["nbdkit"]) {
        return;
    }
    let dir = temp_dir();
    let disk = dir.path().join("disk.img");
    write_file(&disk, &vec![0u8; 32 << 20]);
    let socket = dir.path().join("upstream.sock");
    let backend = format!("nbd+unix:///?socket={}", socket.display());
    let mut upstream = nbdkit_file(&socket, &disk);
    let mut server = Server::start(
        dir.path(),
        "srv",
        &[
            "--backend",
            &backend,
            "--reconnect-delay-initial",
            "0.05",
            "--reconnect-delay-max",
            "0.5",
            "--metrics",
            "127.0.0.1:0",
            "-v",
        ],
    );
    let client = NbdClient::connect(&server.uri()).expect("connecting");
    let before = random_bytes(2 << 20, 61);
    client.write(0, &before).unwrap();
    client.flush().expect("FLUSH with the upstream up");

    // The outage: SIGKILL, so nothing the upstream held in flight is finished.
    let _ = upstream.signal_and_wait(SIGKILL, TIMEOUT);
    let outage_started = Instant::now();
    let during = random_bytes(3 << 20, 62);
    client
        .write(4 << 20, &during)
        .expect("a write into the cache while the upstream is down");
    assert!(
        client.flush().is_err(),
        "FLUSH succeeded while the upstream was down:\n{}",
        server.log_text()
    );
    let mut buffer = vec![0u8; before.len()];
    client
        .read(0, &mut buffer)
        .expect("a cached read during the outage");
    assert_same_bytes(&before, &buffer, "cached read during the outage");
    std::thread::sleep(Duration::from_secs(2));

    // Back on the same socket and file.
    let _upstream = nbdkit_file(&socket, &disk);
    let outage = outage_started.elapsed();
    let mut flushed = false;
    let deadline = Instant::now() + TIMEOUT;
    while Instant::now() < deadline {
        if client.flush().is_ok() {
            flushed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(
        flushed,
        "FLUSH never succeeded after the upstream returned:\n{}",
        server.log_text()
    );
    eprintln!("survived an upstream outage of {outage:?}");
    let after = random_bytes(1 << 20, 63);
    client.write(8 << 20, &after).unwrap();
    client.flush().expect("FLUSH after the reconnect");
    let on_disk = std::fs::read(&disk).unwrap();
    assert_same_bytes(
        &before,
        &on_disk[..before.len()],
        "data flushed before the outage",
    );
    assert_same_bytes(
        &during,
        &on_disk[4 << 20..(4 << 20) + during.len()],
        "data written during the outage",
    );
    assert_same_bytes(
        &after,
        &on_disk[8 << 20..(8 << 20) + after.len()],
        "data after",
    );
    assert!(
        server.log_text().contains("upstream reconnected"),
        "{}",
        server.log_text()
    );
    let metrics = scrape_log(&server.log_text());
    assert!(
        metrics.contains("bufcache_upstream_reconnects_total{export=\"\"} 1")
            && metrics.contains("bufcache_upstream_connected{export=\"\"} 1"),
        "{metrics}"
    );
    drop(client);
    server.stop_clean();
}

#[test]
fn an_upstream_returning_with_another_size_is_refused_by_name() {
    // A different disk behind the same address must not receive the old disk's dirty data.
    let _timer = Timer::new("an_upstream_returning_with_another_size_is_refused_by_name");
    if !have_tools("upstream_resized", &["nbdkit"]) {
        return;
    }
    let dir = temp_dir();
    let disk = dir.path().join("disk.img");
    write_file(&disk, &vec![0u8; 16 << 20]);
    let other = dir.path().join("other.img");
    write_file(&other, &vec![0u8; 8 << 20]);
    let socket = dir.path().join("upstream.sock");
    let backend = format!("nbd+unix:///?socket={}", socket.display());
    let mut upstream = nbdkit_file(&socket, &disk);
    let mut server = Server::start(
        dir.path(),
        "srv",
        &[
            "--backend",
            &backend,
            "--reconnect-delay-max",
            "0.2",
            "--shutdown-timeout",
            "1",
        ],
    );
    let client = NbdClient::connect(&server.uri()).expect("connecting");
    let _ = upstream.signal_and_wait(SIGKILL, TIMEOUT);
    let _other = nbdkit_file(&socket, &other);
    client.write(0, &[1u8; 65536]).unwrap();
    let mut message = String::new();
    wait_until("a flush to report the size change", TIMEOUT, || {
        match client.flush() {
            Ok(()) => panic!("FLUSH succeeded against a disk of another size"),
            Err(error) => message = error.to_string(),
        }
        server.log_text().contains("different size")
    });
    let log = server.log_text();
    assert!(
        log.contains("8388608 bytes, was 16777216 bytes"),
        "{message}\n{log}"
    );
    assert!(std::fs::read(&other).unwrap().iter().all(|byte| *byte == 0));
    drop(client);
    let status = server.terminate(TIMEOUT);
    assert!(!status.success());
}

#[test]
fn upstream_killed_during_a_writeback_burst_and_flush_loses_nothing() {
    // The upstream dies while write-back of 16 MiB is in full flow and a FLUSH is waiting on
    // it: requests in flight on the dead connection fail, their blocks stay dirty, and once
    // the upstream is back a FLUSH that succeeds means every byte is in the file.
    let _timer = Timer::new("upstream_killed_during_a_writeback_burst_and_flush_loses_nothing");
    if !have_tools("upstream_reconnect_burst", &["nbdkit"]) {
        return;
    }
    let dir = temp_dir();
    let disk = dir.path().join("disk.img");
    write_file(&disk, &vec![0u8; 32 << 20]);
    let socket = dir.path().join("upstream.sock");
    let backend = format!("nbd+unix:///?socket={}", socket.display());
    let mut upstream = nbdkit_file(&socket, &disk);
    let mut server = Server::start(
        dir.path(),
        "srv",
        &["--backend", &backend, "--reconnect-delay-max", "0.5"],
    );
    let client = std::sync::Arc::new(NbdClient::connect(&server.uri()).expect("connecting"));
    let data = random_bytes(16 << 20, 64);
    client.write(1 << 20, &data).unwrap();
    let flusher = {
        let client = std::sync::Arc::clone(&client);
        std::thread::spawn(move || client.flush())
    };
    let _ = upstream.signal_and_wait(SIGKILL, TIMEOUT);
    let first_flush = flusher.join().unwrap();
    eprintln!("FLUSH racing the kill: {first_flush:?}");
    let _upstream = nbdkit_file(&socket, &disk);
    let deadline = Instant::now() + TIMEOUT;
    let mut flushed = false;
    while Instant::now() < deadline && !flushed {
        flushed = client.flush().is_ok();
        if !flushed {
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    assert!(flushed, "no FLUSH succeeded:\n{}", server.log_text());
    let on_disk = std::fs::read(&disk).unwrap();
    assert_same_bytes(&data, &on_disk[1 << 20..(1 << 20) + data.len()], "disk");
    drop(client);
    server.stop_clean();
}

#[test]
fn cold_reads_are_started_without_waiting_and_survive_an_upstream_restart() {
    // Goal: through the whole serving stack (counting device, io queue, reconnecting client)
    // a READ that misses is started and ended by the upstream's reply thread, and one whose
    // upstream connection died since is served again the usual way, reconnecting, so the
    // client sees the data and no error. Method: 64 scattered cold 4 KiB reads over nbdkit
    // file, checked against the file and counted in `bufcache_reads_started_total`; then the
    // upstream is killed and restarted on the same socket, and 64 more cold reads must all
    // succeed with the file's bytes.
    let _timer =
        Timer::new("cold_reads_are_started_without_waiting_and_survive_an_upstream_restart");
    if !have_tools("upstream_reconnect", &["nbdkit"]) {
        return;
    }
    let dir = temp_dir();
    let disk = dir.path().join("disk.img");
    let contents = random_bytes(32 << 20, 71);
    write_file(&disk, &contents);
    let socket = dir.path().join("upstream.sock");
    let backend = format!("nbd+unix:///?socket={}", socket.display());
    let mut upstream = nbdkit_file(&socket, &disk);
    let mut server = Server::start(
        dir.path(),
        "srv",
        &[
            "--backend",
            &backend,
            "--reconnect-delay-initial",
            "0.05",
            "--reconnect-delay-max",
            "0.5",
            "--metrics",
            "127.0.0.1:0",
        ],
    );
    let client = NbdClient::connect(&server.uri()).expect("connecting");
    let read_cold = |first: u64| {
        for index in 0..64u64 {
            let offset = first + index * (128 << 10);
            let mut block = vec![0u8; 4096];
            client
                .read(offset, &mut block)
                .unwrap_or_else(|error| panic!("cold read at {offset}: {error}"));
            assert_same_bytes(
                &contents[offset as usize..offset as usize + 4096],
                &block,
                "a cold read",
            );
        }
    };
    read_cold(0);
    let metrics = scrape_log(&server.log_text());
    let started: u64 = metrics
        .lines()
        .find_map(|line| line.strip_prefix("bufcache_reads_started_total "))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or_else(|| panic!("no bufcache_reads_started_total in:\n{metrics}"));
    assert!(
        started >= 60,
        "only {started} of 64 cold reads were started"
    );

    let _ = upstream.signal_and_wait(SIGKILL, TIMEOUT);
    let _upstream = nbdkit_file(&socket, &disk);
    read_cold(16 << 20);
    drop(client);
    server.stop_clean();
}
