//! Goal: `bufcache serve` shuts down without losing data, reports errors clearly, and serves
//! several named exports. Method: dirty data written by nbdcopy (no flush) must be in the
//! backing file after SIGTERM/SIGINT with exit 0; write-back failures (nbdkit's error filter
//! upstream) must fail FLUSH and the shutdown, and be retried; bad flags must exit non-zero
//! with an error naming the flag; two `--export`s must be listed by `nbdinfo --list` and keep
//! their data apart.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use bufcache_nbd::NbdClient;
use common::*;

const TIMEOUT: Duration = Duration::from_secs(60);
const SIGINT: i32 = 2;

#[test]
fn sigterm_and_sigint_write_back_dirty_data_and_exit_0() {
    let _timer = Timer::new("sigterm_and_sigint_write_back_dirty_data_and_exit_0");
    if !have_tools("signal_writes_back", &["nbdcopy"]) {
        return;
    }
    const SIZE: usize = 16 << 20;
    for (signal, name) in [(SIGTERM, "SIGTERM"), (SIGINT, "SIGINT")] {
        let dir = temp_dir();
        let backing = dir.path().join("disk.img");
        write_file(&backing, &vec![0u8; 64 << 20]);
        let source = random_bytes(SIZE, signal as u64);
        let source_path = dir.path().join("source.raw");
        write_file(&source_path, &source);
        // Keep the data dirty: no write-behind, no age-based write-back; listen on TCP.
        let listen = Listen::Tcp(free_tcp_port());
        let mut server = Server::start_listening(
            dir.path(),
            "srv",
            listen,
            &[
                "--backend",
                "disk.img",
                "--no-write-behind",
                "--dirty-age-max",
                "3600",
            ],
        );
        // nbdcopy does not flush unless given --flush.
        run_ok(
            cmd("nbdcopy", &[source_path.to_str().unwrap(), &server.uri()]),
            TIMEOUT,
        );
        let before = std::fs::read(&backing).unwrap();
        let already = before[..SIZE] == source[..];
        eprintln!(
            "{name}: before the signal the backing file {} the data",
            if already {
                "already had"
            } else {
                "did not yet have"
            }
        );
        let status = server.signal_and_wait(signal, TIMEOUT);
        let log = server.log_text();
        assert!(status.success(), "{name}: exit status {status}:\n{log}");
        assert!(log.contains("all data written back"), "{log}");
        let after = std::fs::read(&backing).unwrap();
        assert_same_bytes(&source, &after[..SIZE], "backing file after the signal");
        assert!(after[SIZE..].iter().all(|b| *b == 0));
    }
}

#[test]
fn sigterm_with_an_idle_client_connected_still_exits() {
    let _timer = Timer::new("sigterm_with_an_idle_client_connected_still_exits");
    let dir = temp_dir();
    let mut server = Server::start(
        dir.path(),
        "srv",
        &["--backend", "disk.img", "--create-size", "16M"],
    );
    let client = NbdClient::connect(&server.uri()).expect("connecting");
    client.write(4096, &[0x5a; 8192]).unwrap();
    // The client stays connected and idle while the server shuts down.
    let status = server.terminate(Duration::from_secs(20));
    assert!(status.success(), "{status}:\n{}", server.log_text());
    let mut buffer = [0u8; 8192];
    assert!(
        client.read(0, &mut buffer).is_err(),
        "the server still answers after exiting"
    );
    let on_disk = std::fs::read(dir.path().join("disk.img")).unwrap();
    assert!(on_disk[4096..12288].iter().all(|b| *b == 0x5a));
    assert!(on_disk[..4096].iter().all(|b| *b == 0));
}

/// nbdkit memory under the error filter: pwrites fail with EIO while `fail` exists.
fn failing_upstream(dir: &Path) -> (ChildGuard, PathBuf, PathBuf) {
    let socket = dir.join("upstream.sock");
    let fail = dir.join("fail");
    let mut command = Command::new(tool("nbdkit"));
    command
        .arg("-f")
        .arg("-U")
        .arg(&socket)
        .arg("--filter=error")
        .arg("memory")
        .arg("64M")
        .arg("error-pwrite=EIO")
        .arg("error-pwrite-rate=100%")
        .arg(format!("error-pwrite-file={}", fail.display()))
        .stderr(std::process::Stdio::null());
    let mut guard = ChildGuard::spawn(&mut command, "nbdkit");
    wait_until("nbdkit to listen", TIMEOUT, || {
        assert!(guard.running(), "nbdkit exited early");
        socket.exists()
    });
    (guard, socket, fail)
}

#[test]
fn writeback_errors_fail_flush_are_retried_and_data_is_kept() {
    let _timer = Timer::new("writeback_errors_fail_flush_are_retried_and_data_is_kept");
    if !have_tools("writeback_errors_fail_flush", &["nbdkit"]) {
        return;
    }
    let dir = temp_dir();
    let (_nbdkit, socket, fail) = failing_upstream(dir.path());
    let upstream = format!("nbd+unix:///?socket={}", socket.display());
    let mut server = Server::start(dir.path(), "srv", &["--backend", &upstream]);
    let client = NbdClient::connect(&server.uri()).expect("connecting");
    let data = random_bytes(1 << 20, 9);

    write_file(&fail, b"");
    // The write lands in the cache (it may already fail if written behind at once).
    let _ = client.write(8 << 20, &data);
    assert!(
        client.flush().is_err(),
        "FLUSH succeeded although every upstream write failed"
    );
    assert!(
        client.flush().is_err(),
        "a second FLUSH succeeded although the data never reached the upstream server \
         (dirty data marked clean after a failed write-back)"
    );
    // The cache still serves the data it could not write.
    let mut buffer = vec![0u8; data.len()];
    client.read(8 << 20, &mut buffer).unwrap();
    assert_same_bytes(&data, &buffer, "read back while write-back fails");

    // Once the upstream recovers, a FLUSH writes the data and succeeds.
    std::fs::remove_file(&fail).unwrap();
    client.write(8 << 20, &data).unwrap();
    client.flush().expect("FLUSH after the upstream recovered");
    let direct = NbdClient::connect(&upstream).expect("connecting to nbdkit");
    direct.read(8 << 20, &mut buffer).unwrap();
    assert_same_bytes(&data, &buffer, "upstream contents after recovery");
    drop(direct);
    drop(client);
    server.stop_clean();
}

#[test]
fn writeback_error_at_shutdown_exits_non_zero_with_the_error() {
    let _timer = Timer::new("writeback_error_at_shutdown_exits_non_zero_with_the_error");
    if !have_tools("writeback_error_at_shutdown", &["nbdkit"]) {
        return;
    }
    let dir = temp_dir();
    let (_nbdkit, socket, fail) = failing_upstream(dir.path());
    let upstream = format!("nbd+unix:///?socket={}", socket.display());
    let mut server = Server::start(
        dir.path(),
        "srv",
        &[
            "--backend",
            &upstream,
            "--no-write-behind",
            "--shutdown-timeout",
            "1",
        ],
    );
    let client = NbdClient::connect(&server.uri()).expect("connecting");
    write_file(&fail, b"");
    let _ = client.write(0, &random_bytes(256 << 10, 10));
    drop(client);
    let status = server.terminate(TIMEOUT);
    let log = server.log_text();
    assert!(
        !status.success(),
        "exit status 0 although dirty data could not be written back:\n{log}"
    );
    assert!(
        log.to_lowercase().contains("error") || log.to_lowercase().contains("fail"),
        "no error reported:\n{log}"
    );
    eprintln!("shutdown with failing write-back: {status}");
}

/// Runs `bufcache serve ARGS`, expecting it to refuse; returns its output.
fn refused(args: &[&str]) -> String {
    let dir = temp_dir();
    let socket = format!("unix:{}", dir.path().join("never.sock").display());
    let output = run_timeout(
        Command::new(bufcache_bin())
            .arg("serve")
            .args(args)
            .args(["--listen", &socket])
            .current_dir(dir.path()),
        Duration::from_secs(20),
    );
    let text = output_text(&output);
    assert!(
        !output.status.success(),
        "`bufcache serve {}` was accepted:\n{text}",
        args.join(" ")
    );
    assert!(!text.contains("panicked"), "{text}");
    text
}

#[test]
fn bad_flags_exit_non_zero_naming_the_flag() {
    let _timer = Timer::new("bad_flags_exit_non_zero_naming_the_flag");
    let cases: [(&[&str], &[&str]); 9] = [
        (&["--cache-size", "12q"], &["--cache-size", "12q"]),
        (&["--listen", "foo"], &["--listen", "foo"]),
        (
            &["--backend", "/nonexistent/x"],
            &["/nonexistent/x", "does not exist"],
        ),
        (&["--backend", "memory:0"], &["memory:0"]),
        (&["--backend", "memory:12q"], &["memory:12q"]),
        (&["--block-size", "1000"], &["--block-size", "1000"]),
        (&["--dirty-age-max=100000"], &["--dirty-age-max", "86400"]),
        (&["--export", "noequals"], &["--export", "noequals"]),
        (&["--policy", "bogus"], &["--policy", "bogus"]),
    ];
    for (args, needles) in cases {
        let text = refused(args);
        for needle in needles {
            assert!(
                text.contains(needle),
                "`bufcache serve {}`: error does not mention `{needle}`:\n{text}",
                args.join(" ")
            );
        }
    }
}

#[test]
fn engine_and_server_value_errors_name_the_flag() {
    let cases: [(&[&str], &str); 10] = [
        (&["--cluster-size-max", "2M"], "--cluster-size-max"),
        (&["--cache-size", "0"], "--cache-size"),
        (&["--transfer-size-max", "0"], "--transfer-size-max"),
        (&["--dirty-limit-percent", "150"], "--dirty-limit-percent"),
        (&["--buffers-max", "0"], "--buffers-max"),
        (&["--readahead-size-max", "3G"], "--readahead-size-max"),
        (&["--request-size-max", "1k"], "--request-size-max"),
        (
            &["--readahead-latency-size-max", "64k"],
            "--readahead-latency-size-max",
        ),
        (
            &["--s3fifo-small-queue-ratio", "1.5"],
            "--s3fifo-small-queue-ratio",
        ),
        (&["--clock-bits", "9"], "--clock-bits"),
    ];
    let mut failures = Vec::new();
    for (args, flag) in cases {
        let text = refused(&[&["--backend", "memory:1M"], args].concat());
        if !text.contains(flag) {
            failures.push(format!("`{}` -> {}", args.join(" "), text.trim()));
        }
    }
    assert!(
        failures.is_empty(),
        "errors that do not name the flag:\n{}",
        failures.join("\n")
    );
}

#[test]
fn two_named_exports_are_listed_and_kept_apart() {
    let _timer = Timer::new("two_named_exports_are_listed_and_kept_apart");
    if !have_tools("two_named_exports", &["nbdinfo", "qemu-io"]) {
        return;
    }
    let dir = temp_dir();
    let mut server = Server::start(
        dir.path(),
        "srv",
        &[
            "--export",
            "a=a.img",
            "--export",
            "b=memory:64M",
            "--create-size",
            "32M",
        ],
    );
    let output = run_ok(
        cmd("nbdinfo", &["--list", "--json", &server.uri()]),
        TIMEOUT,
    );
    let list: serde_json::Value = serde_json::from_slice(&output.stdout).expect("nbdinfo JSON");
    let exports = list["exports"].as_array().expect("exports");
    let size_of = |name: &str| {
        exports
            .iter()
            .find(|e| e["export-name"] == name)
            .unwrap_or_else(|| panic!("export {name} not listed: {list}"))["export-size"]
            .as_u64()
    };
    assert_eq!(size_of("a"), Some(32 << 20), "{list}");
    assert_eq!(size_of("b"), Some(64 << 20), "{list}");
    let text = output_text(&run_ok(cmd("nbdinfo", &["--list", &server.uri()]), TIMEOUT));
    assert!(
        text.contains("export=\"a\"") && text.contains("export=\"b\""),
        "{text}"
    );

    // Same offsets, different data: the shared cache must not mix the two objects up.
    let qemu_io = |uri: &str, commands: &[&str]| {
        let mut command = Command::new(tool("qemu-io"));
        command.args(["-f", "raw"]);
        for line in commands {
            command.args(["-c", line]);
        }
        let output = run_ok(command.arg(uri), TIMEOUT);
        let text = output_text(&output);
        assert!(!text.contains("failed"), "{text}");
    };
    let (a, b) = (server.uri_of("a"), server.uri_of("b"));
    qemu_io(&a, &["write -P 0xaa 0 1M", "write -P 0xa1 5000 3000"]);
    qemu_io(&b, &["write -P 0xbb 0 1M", "write -P 0xb1 40M 1M"]);
    qemu_io(
        &a,
        &[
            "read -P 0xaa 0 5000",
            "read -P 0xa1 5000 3000",
            "read -P 0xaa 8000 1040576",
        ],
    );
    qemu_io(
        &b,
        &[
            "read -P 0xbb 0 1M",
            "read -P 0xb1 40M 1M",
            "read -P 0 1M 1M",
        ],
    );
    // The empty name is the default export, which is the first one named (documented in
    // bufcache-nbd's handshake): it serves a's data.
    let mut command = Command::new(tool("qemu-io"));
    let output = run_ok(
        command.args([
            "-f",
            "raw",
            "-r",
            "-c",
            "read -P 0xa1 5000 3000",
            &server.uri(),
        ]),
        TIMEOUT,
    );
    assert!(
        !output_text(&output).contains("failed"),
        "{}",
        output_text(&output)
    );
    server.stop_clean();
    let on_disk = std::fs::read(dir.path().join("a.img")).unwrap();
    assert!(on_disk[..5000].iter().all(|b| *b == 0xaa));
    assert!(on_disk[5000..8000].iter().all(|b| *b == 0xa1));
    assert!(on_disk[8000..1 << 20].iter().all(|b| *b == 0xaa));
    assert!(on_disk[1 << 20..].iter().all(|b| *b == 0));
}

#[test]
fn read_only_export_refuses_every_modification() {
    let _timer = Timer::new("read_only_export_refuses_every_modification");
    let dir = temp_dir();
    let backing = dir.path().join("disk.img");
    let original = random_bytes(4 << 20, 21);
    write_file(&backing, &original);
    let mut server = Server::start(dir.path(), "srv", &["--backend", "disk.img", "--read-only"]);
    let client = NbdClient::connect(&server.uri()).expect("connecting");
    assert!(client.write(1000, &[1u8; 5000]).is_err(), "WRITE accepted");
    assert!(
        client.write_fua(0, &[1u8; 4096]).is_err(),
        "FUA WRITE accepted"
    );
    assert!(
        client.zero(0, 1 << 20, true).is_err(),
        "WRITE_ZEROES accepted"
    );
    let _ = client.trim(0, 1 << 20); // a hint; may be refused or ignored, never applied
    let _ = client.flush();
    let mut buffer = vec![0u8; original.len()];
    client.read(0, &mut buffer).unwrap();
    assert_same_bytes(&original, &buffer, "read-only export");
    drop(client);
    server.stop_clean();
    let on_disk = std::fs::read(&backing).unwrap();
    assert_same_bytes(&original, &on_disk, "backing file of a read-only export");
}
