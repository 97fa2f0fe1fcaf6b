//! Helpers shared by the reliability tests (backend_faults, integrity_concurrency,
//! memory_bound): start `bufcache serve` and nbdkit on private unix sockets, send signals,
//! read a process's resident memory, a seeded random generator, and tool detection.
#![allow(dead_code)]

use std::io::Read;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

// The primitives the end-to-end tests already have (process signals, tool lookup, timing,
// bounded waits) come from their helper module rather than a second copy.
#[path = "../common/mod.rs"]
mod common;
pub use common::{bufcache_bin, have_tools, send_signal, wait_timeout, Timer, SIGTERM};

/// A private temporary directory with a short path (unix socket paths are limited).
pub fn temp_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("bcrel-")
        .tempdir_in("/tmp")
        .expect("creating a temporary directory")
}

/// True when nbdkit has `plugin` (and every filter in `filters`); otherwise prints why.
pub fn have_nbdkit(test: &str, plugin: &str, filters: &[&str]) -> bool {
    if !have_tools(test, &["nbdkit"]) {
        return false;
    }
    let mut command = Command::new("nbdkit");
    for filter in filters {
        command.arg(format!("--filter={filter}"));
    }
    let ok = command
        .arg(plugin)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|status| status.success())
        .unwrap_or(false);
    if !ok {
        eprintln!("SKIPPED {test}: nbdkit lacks plugin {plugin} or filters {filters:?}");
    }
    ok
}

/// Waits until a unix socket accepts connections, or panics with `describe()` after
/// `timeout` or when `child` exits first.
fn wait_socket(child: &mut Child, socket: &Path, timeout: Duration, describe: impl Fn() -> String) {
    let deadline = Instant::now() + timeout;
    loop {
        if UnixStream::connect(socket).is_ok() {
            return;
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("exited with {status} before accepting:\n{}", describe());
        }
        if Instant::now() >= deadline {
            panic!("did not accept within {timeout:?}:\n{}", describe());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A running `bufcache serve` on a unix socket; SIGKILLed when dropped.
pub struct Server {
    child: Option<Child>,
    pub socket: PathBuf,
    pub log: PathBuf,
}

impl Server {
    /// Starts `bufcache serve ARGS --listen unix:DIR/NAME.sock`, logging to DIR/NAME.log,
    /// and waits until it accepts.
    pub fn start(dir: &Path, name: &str, args: &[&str]) -> Server {
        let socket = dir.join(format!("{name}.sock"));
        let log = dir.join(format!("{name}.log"));
        let _ = std::fs::remove_file(&socket);
        let log_file = std::fs::File::create(&log).expect("creating the server log");
        let mut child = Command::new(bufcache_bin())
            .arg("serve")
            .args(args)
            .arg("--listen")
            .arg(format!("unix:{}", socket.display()))
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().unwrap())
            .stderr(log_file)
            .spawn()
            .expect("starting bufcache serve");
        let log_for_panic = log.clone();
        wait_socket(&mut child, &socket, Duration::from_secs(30), || {
            format!(
                "bufcache serve {args:?}:\n{}",
                std::fs::read_to_string(&log_for_panic).unwrap_or_default()
            )
        });
        Server {
            child: Some(child),
            socket,
            log,
        }
    }

    /// The NBD URI of the default export.
    pub fn uri(&self) -> String {
        format!("nbd+unix:///?socket={}", self.socket.display())
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("server already stopped").id()
    }

    /// True while the process runs.
    pub fn running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(child) => child.try_wait().unwrap().is_none(),
            None => false,
        }
    }

    /// Everything the server printed so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends `signal` and waits up to `timeout` for the exit status; None (after SIGKILL)
    /// when it did not exit in time.
    pub fn signal_and_wait(&mut self, signal: i32, timeout: Duration) -> Option<ExitStatus> {
        let mut child = self.child.take().expect("server already stopped");
        send_signal(child.id(), signal);
        let status = wait_timeout(&mut child, timeout);
        if status.is_none() {
            let _ = child.kill();
            let _ = child.wait();
        }
        status
    }

    /// SIGTERM and insists on exit status 0 within `timeout`.
    pub fn stop_clean(&mut self, timeout: Duration) {
        let status = self.signal_and_wait(SIGTERM, timeout);
        match status {
            Some(status) if status.success() => {}
            other => panic!(
                "bufcache serve after SIGTERM: {other:?} (expected exit 0):\n{}",
                self.log_text()
            ),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A running `nbdkit -f -U SOCKET ...`; SIGKILLed when dropped.
pub struct Nbdkit {
    child: Option<Child>,
    pub socket: PathBuf,
    pub log: PathBuf,
}

impl Nbdkit {
    /// Starts `nbdkit -f -U DIR/NAME.sock ARGS` (ARGS: filters, plugin, parameters).
    pub fn start(dir: &Path, name: &str, args: &[String]) -> Nbdkit {
        let socket = dir.join(format!("{name}.sock"));
        let log = dir.join(format!("{name}.log"));
        let _ = std::fs::remove_file(&socket);
        let log_file = std::fs::File::create(&log).expect("creating the nbdkit log");
        let mut child = Command::new("nbdkit")
            .arg("-f")
            .arg("--exit-with-parent")
            .arg("-U")
            .arg(&socket)
            .args(args)
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().unwrap())
            .stderr(log_file)
            .spawn()
            .expect("starting nbdkit");
        let log_for_panic = log.clone();
        wait_socket(&mut child, &socket, Duration::from_secs(30), || {
            format!(
                "nbdkit {args:?}:\n{}",
                std::fs::read_to_string(&log_for_panic).unwrap_or_default()
            )
        });
        Nbdkit {
            child: Some(child),
            socket,
            log,
        }
    }

    /// The URI of its (only) export.
    pub fn uri(&self) -> String {
        format!("nbd+unix:///?socket={}", self.socket.display())
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Nbdkit {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A file whose existence switches an nbdkit error trigger on.
pub struct Trigger {
    pub path: PathBuf,
}

impl Trigger {
    pub fn new(path: PathBuf) -> Trigger {
        let _ = std::fs::remove_file(&path);
        Trigger { path }
    }

    pub fn arm(&self) {
        std::fs::write(&self.path, b"on").expect("creating the trigger file");
    }

    pub fn disarm(&self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Resident set size of `pid` in bytes (VmRSS of /proc/PID/status); None once it exited.
pub fn rss_bytes(pid: u32) -> Option<u64> {
    status_field(pid, "VmRSS:")
}

/// Peak resident set size (VmHWM) of `pid` in bytes.
pub fn rss_peak_bytes(pid: u32) -> Option<u64> {
    status_field(pid, "VmHWM:")
}

/// Number of threads of `pid`.
pub fn thread_count(pid: u32) -> Option<u64> {
    let mut text = String::new();
    std::fs::File::open(format!("/proc/{pid}/status"))
        .ok()?
        .read_to_string(&mut text)
        .ok()?;
    text.lines()
        .find_map(|line| line.strip_prefix("Threads:"))
        .and_then(|value| value.trim().parse().ok())
}

fn status_field(pid: u32, field: &str) -> Option<u64> {
    let mut text = String::new();
    std::fs::File::open(format!("/proc/{pid}/status"))
        .ok()?
        .read_to_string(&mut text)
        .ok()?;
    let line = text.lines().find(|line| line.starts_with(field))?;
    let kib: u64 = line[field.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// SplitMix64: a small deterministic generator (seeds are printed by the tests).
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9e37_79b9_7f4a_7c15)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, bound)`.
    pub fn below(&mut self, bound: u64) -> u64 {
        self.next_u64() % bound.max(1)
    }

    /// Uniform in `[low, high]`.
    pub fn range(&mut self, low: u64, high: u64) -> u64 {
        low + self.below(high - low + 1)
    }

    /// True with probability `percent` %.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    pub fn fill(&mut self, bytes: &mut [u8]) {
        for chunk in bytes.chunks_mut(8) {
            let value = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&value[..chunk.len()]);
        }
    }
}

/// `length` pseudo-random bytes from `seed`.
pub fn random_bytes(length: usize, seed: u64) -> Vec<u8> {
    let mut bytes = vec![0u8; length];
    Rng::new(seed).fill(&mut bytes);
    bytes
}

/// Where two byte strings first differ, for messages.
pub fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter()
        .zip(b.iter())
        .position(|(x, y)| x != y)
        .or((a.len() != b.len()).then_some(a.len().min(b.len())))
}

/// A seed from the environment (`name`, decimal) or `default`; printed either way.
pub fn seed_from_env(name: &str, default: u64) -> u64 {
    let seed = std::env::var(name)
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or(default);
    eprintln!("{name}={seed} (set {name} to replay)");
    seed
}

impl Server {
    /// The `--metrics` address the server printed (start it with `--metrics 127.0.0.1:0`).
    /// Waits up to 10 s for the line: the server binds its NBD socket (which is what the
    /// start waited for) before it prints the metrics address.
    pub fn metrics_address(&self) -> Option<String> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let log = self.log_text();
            if let Some(start) = log.find("metrics on http://") {
                let rest = &log[start + "metrics on http://".len()..];
                // The line may be caught half written: without its '/' yet, look again.
                if let Some(end) = rest.find('/') {
                    return Some(rest[..end].to_string());
                }
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The server's `/stats` JSON (needs `--metrics 127.0.0.1:0`).
    pub fn stats(&self) -> serde_json::Value {
        let address = self
            .metrics_address()
            .expect("server started without --metrics");
        let body = http_get(&address, "/stats");
        serde_json::from_str(&body).unwrap_or_else(|error| panic!("/stats: {error}: {body}"))
    }
}

/// GET `path` from `address` (HTTP/1.0, no keep-alive); the body.
pub fn http_get(address: &str, path: &str) -> String {
    use std::io::Write;
    let mut stream = std::net::TcpStream::connect(address).expect("connecting to metrics");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {address}\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    match response.find("\r\n\r\n") {
        Some(at) => response[at + 4..].to_string(),
        None => response,
    }
}

impl Server {
    /// The `cache` object of `/stats` when the server runs with `--metrics`, else null.
    pub fn stats_or_null(&self) -> serde_json::Value {
        if self.metrics_address().is_some() {
            self.stats()["cache"].clone()
        } else {
            serde_json::Value::Null
        }
    }
}
