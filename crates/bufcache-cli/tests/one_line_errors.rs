//! Goal: every error is one line that names what was wrong and where, and hints point the
//! right way. Method: run the real binary on each bad input the issue lists and check the
//! whole of standard error: one line, the OS error once, the file or flag named, no raw bytes,
//! no misleading advice; and the TLS start-up hint's URI is checked by connecting with it.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;

const TIMEOUT: Duration = Duration::from_secs(60);

/// Runs `bufcache ARGS` in `dir`, expecting failure; returns stderr, checked to be one line.
fn one_line_failure(dir: &Path, args: &[&str]) -> String {
    let mut command = Command::new(bufcache_bin());
    command.args(args).current_dir(dir);
    failure_of(command)
}

fn failure_of(command: Command) -> String {
    let output = run_timeout(command, TIMEOUT);
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(!output.status.success(), "it succeeded:\n{stderr}");
    // clap's usage errors end with its standard "For more information, try '--help'.".
    let lines = stderr
        .lines()
        .filter(|line| !line.trim().is_empty() && !line.starts_with("For more information"))
        .count();
    assert_eq!(lines, 1, "not one line:\n{stderr}");
    stderr
}

#[test]
fn fractional_sizes_are_exact_or_refused_by_name() {
    // 1.5G is 1.5 GiB; a fraction that is not a whole number of bytes is refused saying so.
    let _timer = Timer::new("fractional_sizes_are_exact_or_refused_by_name");
    let dir = temp_dir();
    let output = run_timeout(
        Command::new(bufcache_bin())
            .args(["serve", "--cache-size", "1.5G", "--prefault=off"])
            .args([
                "--backend",
                "memory:1.5M",
                "--run",
                "nbdinfo --size \"$uri\"",
            ])
            .current_dir(dir.path()),
        TIMEOUT,
    );
    assert!(output.status.success(), "{}", output_text(&output));
    if find_tool("nbdinfo").is_some() {
        assert_eq!(String::from_utf8_lossy(&output.stdout).trim(), "1572864");
    }
    let error = one_line_failure(dir.path(), &["serve", "--cache-size", "0.1k"]);
    assert!(
        error.contains("0.1k") && error.contains("whole number of bytes"),
        "{error}"
    );
}

#[test]
fn backend_errors_name_the_backend_once_and_point_the_right_way() {
    // A missing directory prints the OS error once; an unknown URL scheme or a bad s3:// or
    // nbd:// URL is an error naming the bad part, not a file name; a file the user cannot
    // write suggests -r.
    let _timer = Timer::new("backend_errors_name_the_backend_once_and_point_the_right_way");
    let dir = temp_dir();
    let missing = one_line_failure(
        dir.path(),
        &[
            "serve",
            "--backend",
            "no/such/dir.img",
            "--create-size",
            "1M",
        ],
    );
    assert_eq!(
        missing.matches("No such file or directory").count(),
        1,
        "{missing}"
    );
    assert!(missing.contains("no/such/dir.img"), "{missing}");
    for (backend, says) in [
        ("http://example.com/disk", "no `http` backend"),
        ("nbd:/host", "nbd://"),
        // Bad URLs the `url` crate reads: a port on a bucket, port 0, a password.
        ("s3://disks:9000/vm", "endpoint=http://HOST:PORT"),
        ("nbd://host:0/export", "invalid port \"0\""),
        ("nbds://alice:pw@host/?tls-psk-file=k", "take no password"),
    ] {
        let error = one_line_failure(dir.path(), &["serve", "--backend", backend]);
        assert!(
            error.contains(backend) && error.contains(says),
            "{backend}: {error}"
        );
        assert!(!dir.path().join(backend).exists());
    }

    // A file this process may only read is not an error: it is served read-only, and the
    // server says so (read_only_backends.rs, a_file_that_may_only_be_read_is_served_read_only).
}

#[test]
fn trace_errors_name_the_file_show_a_working_example_and_print_no_raw_bytes() {
    // A CSV without obj-id-col names the file and shows --trace-options that work (checked by
    // running them); a binary file read as text shows only printable characters; a file that
    // cannot be read is not told to pass --format.
    let _timer =
        Timer::new("trace_errors_name_the_file_show_a_working_example_and_print_no_raw_bytes");
    let dir = temp_dir();
    std::fs::write(
        dir.path().join("t.csv"),
        "time,id,size,op\n1,10,4096,r\n2,11,4096,w\n",
    )
    .unwrap();
    let error = one_line_failure(dir.path(), &["replay", "t.csv", "--cache-size", "1M"]);
    assert!(error.contains("t.csv"), "{error}");
    let example = error
        .split("--trace-options \"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .unwrap_or_else(|| panic!("no --trace-options example: {error}"));
    run_ok(
        Command::new(bufcache_bin())
            .args([
                "replay",
                "t.csv",
                "--cache-size",
                "1M",
                "--trace-options",
                example,
            ])
            .current_dir(dir.path()),
        TIMEOUT,
    );

    let binary: Vec<u8> = (0..4096u32)
        .map(|index| (index * 7919 % 251) as u8)
        .collect();
    std::fs::write(dir.path().join("b.trace"), &binary).unwrap();
    let error = one_line_failure(
        dir.path(),
        &["replay", "b.trace", "--format", "fio", "--cache-size", "1M"],
    );
    assert!(error.contains("b.trace"), "{error}");
    assert!(
        error
            .chars()
            .all(|c| c == '\n' || c == ' ' || c.is_ascii_graphic()),
        "raw bytes in the error: {error:?}"
    );

    let error = one_line_failure(
        dir.path(),
        &["replay", "no-such.trace", "--cache-size", "1M"],
    );
    assert!(
        error.contains("no-such.trace") && !error.contains("--format"),
        "{error}"
    );
}

#[test]
fn under_tls_require_the_start_up_hint_is_an_nbds_uri_that_connects() {
    // The "try: nbdinfo URI" hint must work as printed when TLS is required: the nbds scheme
    // with the PSK file and username. Method: the --run command connects with the same URI.
    let _timer = Timer::new("under_tls_require_the_start_up_hint_is_an_nbds_uri_that_connects");
    if !have_tools("tls_hint", &["psktool", "nbdinfo"]) {
        return;
    }
    let dir = temp_dir();
    let keys = dir.path().join("keys.psk");
    run_ok(
        Command::new("psktool")
            .args(["-u", "alice", "-p"])
            .arg(&keys),
        TIMEOUT,
    );
    let port = free_tcp_port().to_string();
    let output = run_timeout(
        Command::new(bufcache_bin())
            .args(["serve", "--backend", "memory:1M", "-p", &port])
            .args(["--tls=require", "--tls-psk"])
            .arg(&keys)
            .args(["--run", "nbdinfo --size \"$uri\""])
            .current_dir(dir.path()),
        TIMEOUT,
    );
    let text = output_text(&output);
    assert!(output.status.success(), "{text}");
    assert_eq!(String::from_utf8_lossy(&output.stdout).trim(), "1048576");
    let expected = format!(
        "nbds://alice@127.0.0.1:{port}/?tls-psk-file={}",
        keys.display()
    );
    assert!(
        text.contains(&format!("try: nbdinfo '{expected}'")),
        "{text}"
    );
}

#[test]
fn a_local_cache_stall_bound_out_of_range_or_without_a_local_cache_is_refused_by_name() {
    // Goal: --local-cache-stall-max is checked before anything opens: zero, negative or over a
    // day, and given without a --local-cache, each is one line naming the flag. Method: run
    // the real binary with each bad value.
    let _timer = Timer::new(
        "a_local_cache_stall_bound_out_of_range_or_without_a_local_cache_is_refused_by_name",
    );
    let dir = temp_dir();
    let cache = dir.path().join("disk.cache");
    let cache = cache.to_str().unwrap();
    for value in ["0", "-1", "100000"] {
        let error = one_line_failure(
            dir.path(),
            &[
                "serve",
                "--backend",
                "disk.img",
                "--local-cache",
                cache,
                &format!("--local-cache-stall-max={value}"),
            ],
        );
        assert!(
            error.contains("--local-cache-stall-max") && error.contains("invalid"),
            "{value}: {error}"
        );
    }
    let error = one_line_failure(
        dir.path(),
        &[
            "serve",
            "--backend",
            "memory:1M",
            "--local-cache-stall-max",
            "5",
        ],
    );
    assert!(
        error.contains("--local-cache-stall-max") && error.contains("no --local-cache"),
        "{error}"
    );
}

#[test]
fn replaying_a_damaged_prefix_without_a_local_cache_is_refused_by_name() {
    // Goal: --local-cache-replay-prefix without a --local-cache is a mistake named in one
    // line, not silently ignored. Method: run the real binary with it alone.
    let _timer = Timer::new("replaying_a_damaged_prefix_without_a_local_cache_is_refused_by_name");
    let dir = temp_dir();
    let error = one_line_failure(
        dir.path(),
        &[
            "serve",
            "--backend",
            "memory:1M",
            "--local-cache-replay-prefix",
        ],
    );
    assert!(
        error.contains("--local-cache-replay-prefix") && error.contains("no --local-cache"),
        "{error}"
    );
}
