//! Goal: `--allow` / `--deny` decide which TCP peers may connect, before any negotiation, each
//! refusal is logged with the peer and the reason, unix-socket clients are not judged, and a
//! bad network is refused at start-up naming the flag (exit 2). Method: `bufcache serve` on
//! 127.0.0.1:0 plus a unix socket, nbdinfo (libnbd) as the client; rules that cover or miss
//! 127.0.0.1 decide whether nbdinfo succeeds, and the server log is read for the reason.

mod reliability_support;

use std::process::Command;
use std::time::{Duration, Instant};

use reliability_support::*;

/// The TCP URI of the default export, read from the server's "listening on tcp:..." line.
fn tcp_uri(server: &Server) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let log = server.log_text();
        if let Some(address) = log
            .lines()
            .find_map(|line| line.strip_prefix("bufcache: listening on tcp:"))
            .and_then(|rest| rest.split_whitespace().next())
        {
            return format!("nbd://{address}/");
        }
        assert!(
            Instant::now() < deadline,
            "no TCP address in the log:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// True when `nbdinfo --size URI` succeeds.
fn nbdinfo_works(uri: &str) -> bool {
    Command::new("nbdinfo")
        .args(["--size", uri])
        .output()
        .expect("running nbdinfo")
        .status
        .success()
}

fn start(dir: &std::path::Path, name: &str, rules: &[&str]) -> Server {
    let mut args = vec!["--backend", "memory:1M", "--listen", "tcp:127.0.0.1:0"];
    args.extend_from_slice(rules);
    Server::start(dir, name, &args)
}

/// Waits until one line of the server log contains every one of `texts` (log lines are
/// written asynchronously).
fn log_line_has(server: &Server, texts: &[&str]) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let log = server.log_text();
        if log
            .lines()
            .any(|line| texts.iter().all(|text| line.contains(text)))
        {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

#[test]
fn allow_and_deny_decide_which_tcp_peers_connect_and_refusals_are_logged() {
    let _timer = Timer::new("allow_and_deny_decide_which_tcp_peers_connect");
    if !have_tools("access_control", &["nbdinfo"]) {
        return;
    }
    let dir = temp_dir();
    // Allowed: inside an --allow network, outside every --deny one.
    let mut open = start(
        dir.path(),
        "open",
        &["--allow", "127.0.0.0/8", "--deny", "10.0.0.0/8"],
    );
    assert!(nbdinfo_works(&tcp_uri(&open)), "{}", open.log_text());
    open.stop_clean(Duration::from_secs(30));

    // Denied: --deny wins over a covering --allow.
    let mut denied = start(
        dir.path(),
        "denied",
        &["--allow", "127.0.0.0/8", "--deny", "127.0.0.1"],
    );
    assert!(!nbdinfo_works(&tcp_uri(&denied)));
    assert!(
        log_line_has(
            &denied,
            &[
                "127.0.0.1:",
                "connection refused: address is inside --deny 127.0.0.1/32"
            ]
        ),
        "{}",
        denied.log_text()
    );
    // The unix socket is not judged by address rules.
    assert!(nbdinfo_works(&denied.uri()), "{}", denied.log_text());
    denied.stop_clean(Duration::from_secs(30));

    // Outside every --allow network.
    let mut outside = start(
        dir.path(),
        "outside",
        &["--allow", "10.0.0.0/8", "--allow", "fd00::/8"],
    );
    assert!(!nbdinfo_works(&tcp_uri(&outside)));
    assert!(
        log_line_has(
            &outside,
            &[
                "127.0.0.1:",
                "connection refused: address is outside every --allow network"
            ]
        ),
        "{}",
        outside.log_text()
    );
    outside.stop_clean(Duration::from_secs(30));
}

#[test]
fn a_bad_network_is_refused_at_start_up_naming_the_flag() {
    for (flag, value) in [("--allow", "10.0.0.0/33"), ("--deny", "not-a-network")] {
        let output = Command::new(bufcache_bin())
            .args(["serve", "--backend", "memory:1M", flag, value])
            .output()
            .expect("running bufcache");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains(flag) && stderr.contains(value), "{stderr}");
    }
}
