//! Shared test helpers: start our server on port 0 and a unix socket in a temp dir, find
//! external tools (skipping politely when one is missing), and run nbdkit as an upstream.
#![allow(dead_code)]

pub mod raw;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bufcache_nbd::{
    BoundAddress, Export, ListenAddress, MemoryExport, Server, ServerConfig, ShutdownHandle,
};

/// A running server; dropping it shuts it down and waits for it.
pub struct TestServer {
    pub addresses: Vec<BoundAddress>,
    pub socket_path: PathBuf,
    shutdown: ShutdownHandle,
    thread: Option<JoinHandle<()>>,
    _directory: tempfile::TempDir,
}

impl TestServer {
    /// `nbd://127.0.0.1:PORT/EXPORT`.
    pub fn tcp_uri(&self, export: &str) -> String {
        self.addresses
            .iter()
            .find(|address| matches!(address, BoundAddress::Tcp(_)))
            .expect("a TCP address")
            .uri(export)
    }

    /// `nbd+unix:///EXPORT?socket=PATH`.
    pub fn unix_uri(&self, export: &str) -> String {
        format!("nbd+unix:///{export}?socket={}", self.socket_path.display())
    }

    pub fn port(&self) -> u16 {
        self.addresses
            .iter()
            .find_map(|address| match address {
                BoundAddress::Tcp(socket) => Some(socket.port()),
                BoundAddress::Unix(_) => None,
            })
            .expect("a TCP address")
    }
}

impl TestServer {
    /// Triggers the server's shutdown without waiting for it (dropping waits).
    pub fn begin_shutdown(&self) {
        self.shutdown.trigger();
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.shutdown.trigger();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Starts a server with `exports` on 127.0.0.1:0 and a unix socket.
pub fn start_server(exports: Vec<(&str, Arc<dyn Export>)>) -> TestServer {
    start_server_with(exports, ServerConfig::default())
}

pub fn start_server_with(
    exports: Vec<(&str, Arc<dyn Export>)>,
    mut config: ServerConfig,
) -> TestServer {
    let directory = tempfile::tempdir().expect("temp dir");
    let socket_path = directory.path().join("nbd.sock");
    config.listen = vec![
        ListenAddress::Tcp("127.0.0.1:0".into()),
        ListenAddress::Unix(socket_path.clone()),
    ];
    let exports = exports
        .into_iter()
        .map(|(name, export)| (name.to_string(), export))
        .collect();
    let bound = Server::new(config, exports)
        .expect("valid server")
        .bind()
        .expect("bind");
    let addresses = bound.local_addrs();
    let shutdown = ShutdownHandle::new();
    let run_shutdown = shutdown.clone();
    let thread = std::thread::spawn(move || bound.run(run_shutdown).expect("server run"));
    TestServer {
        addresses,
        socket_path,
        shutdown,
        thread: Some(thread),
        _directory: directory,
    }
}

/// A server with one writable in-memory export named "mem".
pub fn memory_server(size_bytes: u64) -> (TestServer, Arc<MemoryExport>) {
    let export = Arc::new(MemoryExport::new(size_bytes).with_description("test memory"));
    let server = start_server(vec![("mem", export.clone() as Arc<dyn Export>)]);
    (server, export)
}

/// The path of `name` if it is installed; prints why the test is skipped otherwise.
pub fn tool(name: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|directory| directory.join(name))
            .find(|candidate| candidate.is_file())
    });
    if found.is_none() {
        println!("skipping: {name} is not installed");
    }
    found
}

/// True when every tool is installed (messages printed for the missing ones).
pub fn tools(names: &[&str]) -> bool {
    // Every name is looked up (no short-circuit), so each missing tool is reported.
    let missing = names.iter().filter(|name| tool(name).is_none()).count();
    missing == 0
}

/// Runs a command with a time limit and asserts it succeeded; returns its output.
pub fn run_ok(command: &mut Command) -> Output {
    let output = run(command);
    assert!(
        output.status.success(),
        "{command:?} failed: {}\nstdout: {}\nstderr: {}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// Runs a command, killing it after 60 s so a hung tool fails the test instead of CI.
pub fn run(command: &mut Command) -> Output {
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|error| panic!("cannot start {command:?}: {error}"));
    let started = Instant::now();
    loop {
        if child.try_wait().expect("wait").is_some() {
            return child.wait_with_output().expect("output");
        }
        if started.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            let output = child.wait_with_output().expect("output");
            panic!(
                "{command:?} timed out\nstderr: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// An nbdkit process serving on a unix socket; killed on drop. Its stderr goes to a file,
/// shown only when the test fails: the conformance probes send what nbdkit rightly refuses
/// and logs, and clients that hang up mid-reply make it print "Broken pipe".
pub struct Nbdkit {
    child: Child,
    pub socket_path: PathBuf,
    directory: tempfile::TempDir,
}

impl Nbdkit {
    /// Starts `nbdkit [args...]` (plugin and filters in `args`), or `None` when nbdkit is not
    /// installed.
    pub fn start(args: &[&str]) -> Option<Nbdkit> {
        let nbdkit = tool("nbdkit")?;
        let directory = tempfile::tempdir().expect("temp dir");
        let socket_path = directory.path().join("nbdkit.sock");
        let pid_path = directory.path().join("nbdkit.pid");
        let log = std::fs::File::create(directory.path().join("nbdkit.log")).expect("nbdkit log");
        let child = Command::new(nbdkit)
            .arg("--foreground")
            .arg("--pidfile")
            .arg(&pid_path)
            .arg("--exit-with-parent")
            .arg("--unix")
            .arg(&socket_path)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start nbdkit");
        // nbdkit writes its pid file once it accepts connections.
        wait_for_file(&pid_path);
        Some(Nbdkit {
            child,
            socket_path,
            directory,
        })
    }

    pub fn uri(&self) -> String {
        format!("nbd+unix:///?socket={}", self.socket_path.display())
    }

    /// Stops nbdkit (politely, so filters such as stats write their report) and waits.
    pub fn stop(&mut self) {
        // SAFETY: kill(2) on the pid of a child we started and have not reaped yet.
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
        let _ = self.child.wait();
    }
}

impl Nbdkit {
    /// Kills nbdkit at once, as a crash would.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Nbdkit {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            let log = self.directory.path().join("nbdkit.log");
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            eprintln!("--- nbdkit stderr:\n{text}");
        }
    }
}

fn wait_for_file(path: &Path) {
    let started = Instant::now();
    while !path.exists() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Deterministic pseudo-random bytes (xorshift), so failures are reproducible.
pub fn pattern_bytes(length: usize, seed: u64) -> Vec<u8> {
    let mut state = seed | 1;
    (0..length)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

/// A qemu-nbd process serving a sparse raw file on a unix socket; killed on drop.
pub struct QemuNbd {
    child: Child,
    pub socket_path: PathBuf,
    _directory: tempfile::TempDir,
}

impl QemuNbd {
    /// Serves a sparse file of `size_bytes` (`qemu-nbd -f raw --persistent --shared=16`, plus
    /// `args`), or `None` when qemu-nbd is not installed.
    pub fn start(size_bytes: u64, args: &[&str]) -> Option<QemuNbd> {
        let qemu_nbd = tool("qemu-nbd")?;
        let directory = tempfile::tempdir().expect("temp dir");
        let socket_path = directory.path().join("qemu-nbd.sock");
        let image = directory.path().join("disk.img");
        std::fs::File::create(&image)
            .and_then(|file| file.set_len(size_bytes))
            .expect("sparse image");
        let child = Command::new(qemu_nbd)
            .arg("--socket")
            .arg(&socket_path)
            .args(["--format=raw", "--persistent", "--shared=16"])
            .args(args)
            .arg(&image)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start qemu-nbd");
        wait_for_file(&socket_path);
        Some(QemuNbd {
            child,
            socket_path,
            _directory: directory,
        })
    }

    pub fn uri(&self) -> String {
        format!("nbd+unix:///?socket={}", self.socket_path.display())
    }
}

impl Drop for QemuNbd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A 64 MiB cache (read-ahead off) over `device`, served by our server as the default export
/// "", and a handle on the cached object.
pub fn cached_server(device: Arc<dyn bufcache::Device>) -> (TestServer, bufcache::ObjectHandle) {
    let cache = bufcache_host::system_cache(bufcache::CacheConfig {
        memory_bytes_max: 64 << 20,
        readahead_bytes_max: 0,
        ..bufcache::CacheConfig::default()
    })
    .expect("valid config");
    let object = cache
        .open_object(bufcache::ObjectConfig::new("disk", device))
        .expect("open object");
    let export: Arc<dyn Export> = Arc::new(bufcache_export::CacheExport::new(object.reopen()));
    (start_server(vec![("", export)]), object)
}
