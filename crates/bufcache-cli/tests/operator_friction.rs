//! Goal: the small things a new operator trips over are handled the way Unix tools handle
//! them. Method: run the real binary — meaningless or empty configurations refused with the
//! flag named, a closed stdout ending `config --print-default` quietly, no escape codes in
//! a log that is a file, no warning at a clean shutdown with an upstream, `stat` pointed at
//! an NBD port saying so, and TRIM past the end refused like WRITE.

mod common;

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::Duration;

use bufcache_nbd::NbdClient;
use common::*;

const TIMEOUT: Duration = Duration::from_secs(60);

fn serve_refused(args: &[&str]) -> String {
    let dir = temp_dir();
    let output = run_timeout(
        Command::new(bufcache_bin())
            .arg("serve")
            .args(args)
            .arg("-U")
            .arg(dir.path().join("never.sock"))
            .current_dir(dir.path()),
        TIMEOUT,
    );
    let text = output_text(&output);
    assert!(
        !output.status.success(),
        "`serve {}` was accepted:\n{text}",
        args.join(" ")
    );
    text
}

#[test]
fn empty_exports_and_meaningless_flag_combinations_are_refused_by_name() {
    let _timer = Timer::new("empty_exports_and_meaningless_flag_combinations_are_refused_by_name");
    let text = serve_refused(&["--backend", "new.img", "--create-size", "0"]);
    assert!(text.contains("--create-size 0"), "{text}");
    let text = serve_refused(&["--backend", "memory:1M", "--direct"]);
    assert!(text.contains("--direct"), "{text}");
    let text = serve_refused(&["--backend", "memory:1M", "--file-io-threads", "4"]);
    assert!(text.contains("--file-io-threads"), "{text}");
    let text = serve_refused(&["--backend", "memory:1M", "--file-io-uring-depth", "32"]);
    assert!(text.contains("--file-io-uring-depth"), "{text}");
    let text = serve_refused(&[
        "--backend",
        "disk.img",
        "--create-size",
        "1M",
        "--file-io-threads",
        "2",
        "--file-io-uring-depth",
        "8",
    ]);
    assert!(
        text.contains("--file-io-threads") && text.contains("--file-io-uring-depth"),
        "{text}"
    );
    let text = serve_refused(&["--backend", "memory:1M", "--create-size", "1M"]);
    assert!(text.contains("--create-size"), "{text}");
    let dir = temp_dir();
    let empty = dir.path().join("empty.img");
    std::fs::write(&empty, b"").unwrap();
    let text = serve_refused(&["--backend", empty.to_str().unwrap()]);
    assert!(text.contains("empty (0 bytes)"), "{text}");
}

#[test]
fn a_closed_stdout_ends_print_default_quietly() {
    let _timer = Timer::new("a_closed_stdout_ends_print_default_quietly");
    let mut child = Command::new(bufcache_bin())
        .args(["config", "--print-default"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Like `| head -c 1`: take a byte, then go away.
    let mut stdout = child.stdout.take().unwrap();
    let mut first = [0u8; 1];
    stdout.read_exact(&mut first).unwrap();
    drop(stdout);
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}: {stderr}");
    assert!(stderr.is_empty(), "not quiet: {stderr}");
}

#[test]
fn clean_shutdown_with_an_upstream_logs_no_warning_and_no_colour() {
    let _timer = Timer::new("clean_shutdown_with_an_upstream_logs_no_warning_and_no_colour");
    if !have_tools("clean_shutdown_upstream", &["nbdkit"]) {
        return;
    }
    let dir = temp_dir();
    let socket = dir.path().join("upstream.sock");
    let mut command = Command::new(tool("nbdkit"));
    command
        .arg("-f")
        .arg("-U")
        .arg(&socket)
        .args(["memory", "16M"])
        .stderr(Stdio::null());
    let mut upstream = ChildGuard::spawn(&mut command, "nbdkit");
    wait_until("nbdkit to listen", TIMEOUT, || {
        assert!(upstream.running());
        socket.exists()
    });
    let backend = format!("nbd+unix:///?socket={}", socket.display());
    // -v: info-level logs, so there are tracing lines to check for escape codes.
    let mut server = Server::start(dir.path(), "srv", &["--backend", &backend, "-v"]);
    let client = NbdClient::connect(&server.uri()).unwrap();
    client.write(0, &[7u8; 65536]).unwrap();
    drop(client);
    server.stop_clean();
    let log = server.log_text();
    assert!(
        !log.contains('\u{1b}'),
        "escape codes in a log file:\n{log}"
    );
    assert!(
        !log.contains("WARN"),
        "a warning at a clean shutdown:\n{log}"
    );
}

#[test]
fn stat_pointed_at_an_nbd_port_says_so_and_trim_past_the_end_is_refused() {
    let _timer = Timer::new("stat_pointed_at_an_nbd_port_says_so_and_trim_past_the_end_is_refused");
    let dir = temp_dir();
    let port = free_tcp_port();
    let mut server = Server::start_listening(
        dir.path(),
        "srv",
        Listen::Tcp(port),
        &["--backend", "memory:1M"],
    );
    let output = run_timeout(
        Command::new(bufcache_bin()).args(["stat", &format!("127.0.0.1:{port}")]),
        TIMEOUT,
    );
    let text = output_text(&output);
    assert!(!output.status.success());
    assert!(text.contains("is an NBD port"), "{text}");

    let client = NbdClient::connect(&server.uri()).unwrap();
    let trim = client.trim((1 << 20) - 4096, 8192);
    let write = client.write((1 << 20) - 4096, &[1u8; 8192]);
    assert!(trim.is_err(), "TRIM past the end succeeded");
    assert!(write.is_err(), "WRITE past the end succeeded");
    drop(client);
    server.stop_clean();
}
