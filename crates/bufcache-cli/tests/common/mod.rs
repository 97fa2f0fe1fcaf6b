//! Shared helpers for the end-to-end tests: start `bufcache serve` on a private unix socket,
//! run external tools with timeouts, skip when a tool is missing, generate and compare data.
#![allow(dead_code)]

use std::borrow::BorrowMut;
use std::ffi::OsStr;
use std::io::Read;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

pub const SIGKILL: i32 = 9;
pub const SIGTERM: i32 = 15;

extern "C" {
    fn kill(pid: i32, signal: i32) -> i32;
}

/// Sends `signal` to process `pid`.
pub fn send_signal(pid: u32, signal: i32) {
    // SAFETY: kill(2) has no memory-safety preconditions.
    let result = unsafe { kill(pid as i32, signal) };
    assert_eq!(result, 0, "kill({pid}, {signal}) failed");
}

/// The `bufcache` binary under test.
pub fn bufcache_bin() -> &'static str {
    env!("CARGO_BIN_EXE_bufcache")
}

/// A private temporary directory with a short path (unix socket paths are limited to 108 bytes).
pub fn temp_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("bce2e-")
        .tempdir_in("/tmp")
        .expect("creating a temporary directory")
}

/// Where `name` is installed: PATH, then the sbin directories (mkfs.ext4, e2fsck).
pub fn find_tool(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut dirs: Vec<PathBuf> = std::env::split_paths(&path).collect();
    for extra in ["/usr/sbin", "/sbin", "/usr/bin", "/bin"] {
        dirs.push(PathBuf::from(extra));
    }
    dirs.into_iter()
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

/// The path of a tool that `have_tools` already found.
pub fn tool(name: &str) -> PathBuf {
    find_tool(name).unwrap_or_else(|| panic!("tool `{name}` not found"))
}

/// True when every tool is installed; otherwise prints why `test` is skipped.
pub fn have_tools(test: &str, names: &[&str]) -> bool {
    let missing: Vec<&str> = names
        .iter()
        .copied()
        .filter(|name| find_tool(name).is_none())
        .collect();
    if missing.is_empty() {
        true
    } else {
        eprintln!(
            "SKIPPED {test}: needed tool(s) not installed: {}",
            missing.join(", ")
        );
        false
    }
}

/// Prints how long a test took when dropped.
pub struct Timer {
    name: String,
    start: Instant,
}

impl Timer {
    pub fn new(name: &str) -> Timer {
        Timer {
            name: name.to_string(),
            start: Instant::now(),
        }
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        eprintln!(
            "[{}] took {:.2} s",
            self.name,
            self.start.elapsed().as_secs_f64()
        );
    }
}

/// Waits for `child` up to `timeout`; None when it is still running.
pub fn wait_timeout(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().expect("waiting for a child") {
            return Some(status);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn command_text(command: &Command) -> String {
    let mut text = command.get_program().to_string_lossy().into_owned();
    for arg in command.get_args() {
        text.push(' ');
        text.push_str(&arg.to_string_lossy());
    }
    text
}

/// Runs `command` to completion with captured output; kills it and panics after `timeout`.
pub fn run_timeout(mut command: impl BorrowMut<Command>, timeout: Duration) -> Output {
    let command: &mut Command = command.borrow_mut();
    let text = command_text(command);
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|error| panic!("starting `{text}`: {error}"));
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let out_reader = std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = stdout.read_to_end(&mut bytes);
        bytes
    });
    let err_reader = std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = stderr.read_to_end(&mut bytes);
        bytes
    });
    let status = match wait_timeout(&mut child, timeout) {
        Some(status) => status,
        None => {
            let _ = child.kill();
            let _ = child.wait();
            let stderr = err_reader.join().unwrap_or_default();
            panic!(
                "`{text}` did not finish within {timeout:?}; stderr:\n{}",
                String::from_utf8_lossy(&stderr)
            );
        }
    };
    Output {
        status,
        stdout: out_reader.join().unwrap_or_default(),
        stderr: err_reader.join().unwrap_or_default(),
    }
}

/// stdout and stderr of `output` as one text.
pub fn output_text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Runs `command` and panics (with its output) unless it exits 0.
pub fn run_ok(mut command: impl BorrowMut<Command>, timeout: Duration) -> Output {
    let command: &mut Command = command.borrow_mut();
    let text = command_text(command);
    let output = run_timeout(command, timeout);
    assert!(
        output.status.success(),
        "`{text}` failed with {}:\n{}",
        output.status,
        output_text(&output)
    );
    output
}

/// Where a server listens.
#[derive(Clone, Debug)]
pub enum Listen {
    Unix(PathBuf),
    Tcp(u16),
}

/// A TCP port that was free a moment ago.
pub fn free_tcp_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("binding port 0");
    listener.local_addr().unwrap().port()
}

/// A running `bufcache serve`; killed (SIGKILL) when dropped.
pub struct Server {
    child: Option<Child>,
    pub listen: Listen,
    pub log: PathBuf,
}

impl Server {
    /// Starts `bufcache serve ARGS --listen unix:DIR/NAME.sock` and waits until it accepts.
    pub fn start(dir: &Path, name: &str, args: &[&str]) -> Server {
        Server::start_listening(
            dir,
            name,
            Listen::Unix(dir.join(format!("{name}.sock"))),
            args,
        )
    }

    /// Starts the server listening on `listen` and waits until it accepts.
    pub fn start_listening(dir: &Path, name: &str, listen: Listen, args: &[&str]) -> Server {
        Server::start_with_env(dir, name, listen, args, &[])
    }

    /// Starts the server like [`Server::start_listening`], with `env` added to (or replacing
    /// in) its environment: other credentials, for one.
    pub fn start_with_env(
        dir: &Path,
        name: &str,
        listen: Listen,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Server {
        let log = dir.join(format!("{name}.log"));
        let listen_arg = match &listen {
            Listen::Unix(path) => {
                let _ = std::fs::remove_file(path);
                format!("unix:{}", path.display())
            }
            Listen::Tcp(port) => format!("tcp:127.0.0.1:{port}"),
        };
        let log_file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .expect("creating the server log");
        let child = Command::new(bufcache_bin())
            .arg("serve")
            .args(args)
            .arg("--listen")
            .arg(&listen_arg)
            .envs(env.iter().copied())
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().unwrap())
            .stderr(log_file)
            .spawn()
            .expect("starting bufcache serve");
        let mut server = Server {
            child: Some(child),
            listen,
            log,
        };
        server.wait_accepting(Duration::from_secs(30));
        server
    }

    fn wait_accepting(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let accepted = match &self.listen {
                Listen::Unix(path) => UnixStream::connect(path).is_ok(),
                Listen::Tcp(port) => std::net::TcpStream::connect(("127.0.0.1", *port)).is_ok(),
            };
            if accepted {
                return;
            }
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!(
                    "bufcache serve exited with {status} before accepting:\n{}",
                    self.log_text()
                );
            }
            if Instant::now() >= deadline {
                panic!(
                    "bufcache serve did not accept within {timeout:?}:\n{}",
                    self.log_text()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The NBD URI of export `name` ("" for the default export).
    pub fn uri_of(&self, name: &str) -> String {
        match &self.listen {
            Listen::Unix(path) => format!("nbd+unix:///{name}?socket={}", path.display()),
            Listen::Tcp(port) => format!("nbd://127.0.0.1:{port}/{name}"),
        }
    }

    /// The NBD URI of the default export.
    pub fn uri(&self) -> String {
        self.uri_of("")
    }

    /// The socket path (unix listeners only).
    pub fn socket(&self) -> &Path {
        match &self.listen {
            Listen::Unix(path) => path,
            Listen::Tcp(_) => panic!("not a unix listener"),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("server already stopped").id()
    }

    /// Everything the server printed so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM, then waits up to `timeout` for the exit status (SIGKILL and panic after that).
    pub fn terminate(&mut self, timeout: Duration) -> ExitStatus {
        self.signal_and_wait(SIGTERM, timeout)
    }

    /// Sends `signal`, then waits up to `timeout` for the exit status (SIGKILL and panic
    /// after that).
    pub fn signal_and_wait(&mut self, signal: i32, timeout: Duration) -> ExitStatus {
        let mut child = self.child.take().expect("server already stopped");
        send_signal(child.id(), signal);
        match wait_timeout(&mut child, timeout) {
            Some(status) => status,
            None => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "bufcache serve did not exit within {timeout:?} of signal {signal}:\n{}",
                    self.log_text()
                );
            }
        }
    }

    /// SIGTERM and insists on exit status 0.
    pub fn stop_clean(&mut self) {
        let status = self.terminate(Duration::from_secs(60));
        assert!(
            status.success(),
            "bufcache serve exited with {status} after SIGTERM:\n{}",
            self.log_text()
        );
    }

    /// SIGKILL: the process dies without writing anything back.
    pub fn kill9(&mut self) {
        let mut child = self.child.take().expect("server already stopped");
        send_signal(child.id(), SIGKILL);
        let _ = child.wait();
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

/// A helper process (nbdkit, nbdfuse, fuse2fs...) killed when dropped unless already reaped.
pub struct ChildGuard {
    pub child: Option<Child>,
    pub name: String,
}

impl ChildGuard {
    pub fn spawn(command: &mut Command, name: &str) -> ChildGuard {
        let child = command
            .stdin(Stdio::null())
            .spawn()
            .unwrap_or_else(|error| panic!("starting {name}: {error}"));
        ChildGuard {
            child: Some(child),
            name: name.to_string(),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// True while the process has not exited.
    pub fn running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(child) => child.try_wait().unwrap().is_none(),
            None => false,
        }
    }

    /// Sends `signal` and waits up to `timeout`.
    pub fn signal_and_wait(&mut self, signal: i32, timeout: Duration) -> Option<ExitStatus> {
        let mut child = self.child.take()?;
        if child.try_wait().unwrap().is_none() {
            send_signal(child.id(), signal);
        }
        let status = wait_timeout(&mut child, timeout);
        if status.is_none() {
            let _ = child.kill();
            let _ = child.wait();
        }
        status
    }

    /// Waits up to `timeout` for the process to exit on its own.
    pub fn wait(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let child = self.child.as_mut()?;
        let status = wait_timeout(child, timeout);
        if status.is_some() {
            self.child = None;
        }
        status
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A helper process whose standard error goes to a file, shown only when the test fails.
/// Tools such as nbdkit report on stderr what a test does on purpose (a server killed with
/// writes in flight makes nbdkit print "write reply: ... Broken pipe"), which is noise in the
/// output of a passing test and a clue in a failing one.
pub struct QuietChild {
    pub guard: ChildGuard,
    log: PathBuf,
}

impl QuietChild {
    /// Spawns `command` (stdout discarded) with its stderr written to `log`.
    pub fn spawn(command: &mut Command, name: &str, log: &Path) -> QuietChild {
        let file = std::fs::File::create(log)
            .unwrap_or_else(|error| panic!("creating {}: {error}", log.display()));
        command.stdout(Stdio::null()).stderr(file);
        QuietChild {
            guard: ChildGuard::spawn(command, name),
            log: log.to_path_buf(),
        }
    }
}

impl Drop for QuietChild {
    fn drop(&mut self) {
        if let Some(mut child) = self.guard.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            let text = std::fs::read_to_string(&self.log).unwrap_or_default();
            eprintln!(
                "--- {} stderr ({}):\n{text}",
                self.guard.name,
                self.log.display()
            );
        }
    }
}

/// Polls `condition` every 20 ms until it holds; panics with `what` after `timeout`.
pub fn wait_until(what: &str, timeout: Duration, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !condition() {
        if Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// True when `path` is a mount point (per /proc/self/mountinfo).
pub fn is_mounted(path: &Path) -> bool {
    let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let wanted = path.to_string_lossy().replace(' ', "\\040");
    text.lines()
        .any(|line| line.split(' ').nth(4) == Some(wanted.as_str()))
}

/// Unmounts a FUSE mount point when dropped (lazily if it is busy), so failures leave no mounts.
pub struct MountGuard {
    pub path: PathBuf,
}

impl MountGuard {
    pub fn new(path: &Path) -> MountGuard {
        MountGuard {
            path: path.to_path_buf(),
        }
    }

    /// `fusermount3 -u`, insisting it succeeds.
    pub fn unmount(&self) {
        run_ok(
            Command::new(tool("fusermount3")).arg("-u").arg(&self.path),
            Duration::from_secs(60),
        );
    }
}

impl Drop for MountGuard {
    fn drop(&mut self) {
        if is_mounted(&self.path) {
            let program = find_tool("fusermount3").unwrap_or_else(|| "fusermount3".into());
            let _ = Command::new(program)
                .arg("-u")
                .arg("-z")
                .arg(&self.path)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// SplitMix64: a small deterministic generator for test data.
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

    /// Uniform in `0..bound` (bound > 0).
    pub fn below(&mut self, bound: u64) -> u64 {
        self.next_u64() % bound
    }

    pub fn fill(&mut self, buffer: &mut [u8]) {
        let mut chunks = buffer.chunks_exact_mut(8);
        for chunk in &mut chunks {
            chunk.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        let last = self.next_u64().to_le_bytes();
        rest.copy_from_slice(&last[..rest.len()]);
    }
}

/// `length` pseudo-random bytes from `seed`.
pub fn random_bytes(length: usize, seed: u64) -> Vec<u8> {
    let mut bytes = vec![0u8; length];
    Rng::new(seed).fill(&mut bytes);
    bytes
}

/// A 64-bit checksum (FNV-1a over 8-byte words, then the tail), fast enough for 64 MiB.
pub fn checksum(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut chunks = bytes.chunks_exact(8);
    for chunk in &mut chunks {
        hash ^= u64::from_le_bytes(chunk.try_into().unwrap());
        hash = hash.wrapping_mul(0x0100_0000_01b3).rotate_left(29);
    }
    for byte in chunks.remainder() {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash ^ bytes.len() as u64
}

/// Asserts two byte strings are equal, reporting checksums and the first difference.
pub fn assert_same_bytes(expected: &[u8], actual: &[u8], what: &str) {
    if expected == actual {
        return;
    }
    let first = expected
        .iter()
        .zip(actual.iter())
        .position(|(a, b)| a != b)
        .unwrap_or(expected.len().min(actual.len()));
    panic!(
        "{what}: contents differ: expected {} bytes (checksum {:016x}), got {} bytes \
         (checksum {:016x}); first difference at byte {first}",
        expected.len(),
        checksum(expected),
        actual.len(),
        checksum(actual)
    );
}

/// Asserts two files have the same contents.
pub fn assert_same_file(expected: &Path, actual: &Path) {
    let a = std::fs::read(expected).unwrap_or_else(|e| panic!("{}: {e}", expected.display()));
    let b = std::fs::read(actual).unwrap_or_else(|e| panic!("{}: {e}", actual.display()));
    assert_same_bytes(
        &a,
        &b,
        &format!("{} vs {}", expected.display(), actual.display()),
    );
}

/// Writes `bytes` to a new file at `path`.
pub fn write_file(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
}

/// A command for `tool` with arguments.
pub fn cmd<S: AsRef<OsStr>>(tool_name: &str, args: &[S]) -> Command {
    let mut command = Command::new(tool(tool_name));
    command.args(args);
    command
}

/// The `host:port` of the metrics endpoint a server printed in `log` (its newest line, so a
/// log holding several starts names the server that runs now).
pub fn metrics_address(log: &str) -> String {
    const PREFIX: &str = "metrics on http://";
    log.rfind(PREFIX)
        .and_then(|start| log[start + PREFIX.len()..].split('/').next())
        .unwrap_or_else(|| panic!("no metrics address in the log:\n{log}"))
        .to_string()
}

/// The text of `GET /metrics` at `address` (`host:port`).
pub fn scrape(address: &str) -> String {
    use std::io::Write;
    let mut stream = std::net::TcpStream::connect(address)
        .unwrap_or_else(|error| panic!("connecting to the metrics endpoint {address}: {error}"));
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    text
}

/// The text of `GET /metrics` from the server whose log is `log`.
pub fn scrape_log(log: &str) -> String {
    scrape(&metrics_address(log))
}

/// The value of the sample whose name and labels are exactly `series` (`name{labels}`, or a
/// bare name for a sample without labels).
pub fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no sample {series}:\n{text}"))
        .parse()
        .unwrap_or_else(|error| panic!("sample {series} is not a number ({error}):\n{text}"))
}
