//! Test support: a moto S3 server on a free loopback port, started per test and killed on
//! drop, and a TCP proxy in front of it that can be taken down to inject "server stopped"
//! faults without losing moto's in-memory objects; a SeaweedFS store ([`SeaweedFs`]) for the
//! tests that run on both.
#![allow(dead_code)]

mod seaweedfs;
#[allow(unused_imports)]
pub use seaweedfs::{have_seaweedfs, SeaweedFs, SeaweedFsCluster, CLUSTER_VOLUME_SERVERS};

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Credentials moto accepts; set for this process and every child it starts.
pub fn set_test_credentials() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        std::env::set_var("AWS_ACCESS_KEY_ID", "testing");
        std::env::set_var("AWS_SECRET_ACCESS_KEY", "testing");
        std::env::set_var("AWS_REGION", "us-east-1");
    });
}

/// An S3 server on loopback that a test can run against: moto or SeaweedFS.
pub trait S3Server {
    /// `http://127.0.0.1:PORT`, for a disk URL's `endpoint=`.
    fn endpoint(&self) -> String;
    /// Creates bucket `name`, ready for the first request.
    fn create_bucket(&self, name: &str);
}

impl S3Server for Moto {
    fn endpoint(&self) -> String {
        Moto::endpoint(self)
    }

    fn create_bucket(&self, name: &str) {
        Moto::create_bucket(self, name)
    }
}

/// True when moto's server can be started; otherwise prints why `test` is skipped.
pub fn have_moto(test: &str) -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import moto.server, flask"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|status| status.success())
        .unwrap_or(false);
    if !ok {
        eprintln!("skipping {test}: moto server not installed (pip install 'moto[server]')");
    }
    ok
}

/// A free loopback port (bound then released; the tiny race is acceptable in tests).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn wait_for_port(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "moto did not listen on port {port} within 60 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A running moto server; its request log (one line per request) is kept in `log_path`.
pub struct Moto {
    child: Child,
    pub port: u16,
    pub log_path: PathBuf,
    _dir: tempfile::TempDir,
}

impl Moto {
    pub fn start() -> Moto {
        set_test_credentials();
        let dir = tempfile::tempdir().unwrap();
        let log_path = dir.path().join("moto.log");
        let port = free_port();
        let child = Command::new("python3")
            .args([
                "-m",
                "moto.server",
                "-H",
                "127.0.0.1",
                "-p",
                &port.to_string(),
            ])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log_path).unwrap())
            .spawn()
            .expect("starting moto");
        wait_for_port(port);
        Moto {
            child,
            port,
            log_path,
            _dir: dir,
        }
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Creates a bucket with an unsigned PUT (moto does not check signatures).
    pub fn create_bucket(&self, name: &str) {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        write!(
            stream,
            "PUT /{name} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            self.port
        )
        .unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).unwrap();
        assert!(
            answer.starts_with("HTTP/1.1 200") || answer.starts_with("HTTP/1.0 200"),
            "{answer}"
        );
    }

    /// Creates a user whose credentials may only read (s3:GetObject, s3:ListBucket) and turns
    /// on moto's IAM checks (`moto_read_only_user.py`): from then on a write signed with the
    /// key is answered 403 AccessDenied, and the tests' own "testing" key is refused. Returns
    /// (access key id, secret access key).
    pub fn read_only_user(&self) -> (String, String) {
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../bufcache-s3/tests/support/moto_read_only_user.py"
        );
        let output = Command::new("python3")
            .arg(script)
            .arg(self.endpoint())
            .output()
            .expect("running moto_read_only_user.py");
        assert!(
            output.status.success(),
            "moto_read_only_user.py: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let text = String::from_utf8(output.stdout).unwrap();
        let mut words = text.split_whitespace();
        match (words.next(), words.next()) {
            (Some(id), Some(secret)) => (id.to_string(), secret.to_string()),
            _ => panic!("moto_read_only_user.py printed no key: {text:?}"),
        }
    }

    /// Turns moto's IAM checks off again (after [`Moto::read_only_user`]).
    pub fn stop_checking_iam(&self) {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        write!(
            stream,
            "POST /moto-api/reset-auth HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Type: text/plain\r\nContent-Length: 3\r\nConnection: close\r\n\r\ninf",
            self.port
        )
        .unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }

    /// Requests logged so far by method (GET, PUT, DELETE, HEAD, POST). Some moto versions
    /// colour the lines of some status codes (206, 404, 204) with ANSI escapes that sit
    /// between the quote and the method; they are stripped first so every request counts.
    pub fn request_count(&self, method: &str) -> usize {
        let log = std::fs::read_to_string(&self.log_path).unwrap_or_default();
        log.lines()
            .map(strip_ansi)
            .filter(|line| line.contains(&format!("\"{method} ")))
            .count()
    }
}

/// `line` without ANSI escape sequences (`ESC [ … letter`).
pub fn strip_ansi(line: &str) -> String {
    let mut text = String::with_capacity(line.len());
    let mut characters = line.chars();
    while let Some(character) = characters.next() {
        if character == '\u{1b}' {
            // Skip `[`, parameters and the final letter.
            for inner in characters.by_ref() {
                if inner.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            text.push(character);
        }
    }
    text
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A TCP proxy on a free loopback port in front of `target_port`. While down it closes every
/// connection, new and established, as a stopped server would.
pub struct Proxy {
    pub port: u16,
    down: Arc<AtomicBool>,
    connections: Arc<Mutex<Vec<TcpStream>>>,
}

impl Proxy {
    pub fn start(target_port: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let down = Arc::new(AtomicBool::new(false));
        let connections: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let (thread_down, thread_connections) = (down.clone(), connections.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                if thread_down.load(Ordering::SeqCst) {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                }
                let Ok(server) = TcpStream::connect(("127.0.0.1", target_port)) else {
                    continue;
                };
                {
                    let mut list = thread_connections.lock().unwrap();
                    list.push(client.try_clone().unwrap());
                    list.push(server.try_clone().unwrap());
                }
                pump(client.try_clone().unwrap(), server.try_clone().unwrap());
                pump(server, client);
            }
        });
        Proxy {
            port,
            down,
            connections,
        }
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Takes the "server" down (true) or brings it back (false).
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
        if down {
            for stream in self.connections.lock().unwrap().drain(..) {
                let _ = stream.shutdown(Shutdown::Both);
            }
        }
    }
}

fn pump(mut from: TcpStream, mut to: TcpStream) {
    std::thread::spawn(move || {
        let mut buffer = vec![0u8; 64 << 10];
        loop {
            match from.read(&mut buffer) {
                Ok(0) | Err(_) => break,
                Ok(count) => {
                    if to.write_all(&buffer[..count]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = to.shutdown(Shutdown::Write);
    });
}

/// A TCP proxy on a free loopback port in front of `target_port` that holds each HTTP
/// request's first bytes `delay` before passing them on (a remote store's round trip) and
/// counts the requests in flight: a connection has one from its request's first byte until
/// its answer's first byte (the S3 client does not pipeline, so a connection carries one
/// request at a time).
pub struct DelayProxy {
    pub port: u16,
    inflight: Arc<std::sync::atomic::AtomicUsize>,
    peak: Arc<std::sync::atomic::AtomicUsize>,
}

impl DelayProxy {
    pub fn start(target_port: u16, delay: Duration) -> DelayProxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let inflight: Arc<std::sync::atomic::AtomicUsize> = Arc::default();
        let peak: Arc<std::sync::atomic::AtomicUsize> = Arc::default();
        let (thread_inflight, thread_peak) = (inflight.clone(), peak.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(("127.0.0.1", target_port)) else {
                    continue;
                };
                let active = Arc::new(AtomicBool::new(false));
                let counts = (thread_inflight.clone(), thread_peak.clone());
                let (requests, answers) =
                    (client.try_clone().unwrap(), server.try_clone().unwrap());
                let request_active = active.clone();
                let request_counts = counts.clone();
                std::thread::spawn(move || {
                    relay(requests, server, |_| {
                        if !request_active.swap(true, Ordering::SeqCst) {
                            let now = request_counts.0.fetch_add(1, Ordering::SeqCst) + 1;
                            request_counts.1.fetch_max(now, Ordering::SeqCst);
                            std::thread::sleep(delay);
                        }
                    })
                });
                std::thread::spawn(move || {
                    relay(answers, client, |_| {
                        if active.swap(false, Ordering::SeqCst) {
                            counts.0.fetch_sub(1, Ordering::SeqCst);
                        }
                    })
                });
            }
        });
        DelayProxy {
            port,
            inflight,
            peak,
        }
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The most requests in flight at once since the last reset.
    pub fn peak(&self) -> usize {
        self.peak.load(Ordering::SeqCst)
    }

    pub fn reset_peak(&self) {
        self.peak
            .store(self.inflight.load(Ordering::SeqCst), Ordering::SeqCst);
    }
}

/// Copies `from` to `to`, calling `before` with each piece before it goes on.
fn relay(mut from: TcpStream, mut to: TcpStream, mut before: impl FnMut(&[u8])) {
    let mut buffer = vec![0u8; 64 << 10];
    loop {
        match from.read(&mut buffer) {
            Ok(0) | Err(_) => break,
            Ok(count) => {
                before(&buffer[..count]);
                if to.write_all(&buffer[..count]).is_err() {
                    break;
                }
            }
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

/// An HTTP proxy in front of a server (`fault_proxy.py`) that carries out the first `count`
/// PUTs to a key ending in `suffix` but answers them 500, as a store whose answer was lost.
pub struct FaultProxy {
    child: Child,
    pub port: u16,
    faults_log: PathBuf,
    _dir: tempfile::TempDir,
}

impl FaultProxy {
    pub fn start(target_port: u16, suffix: &str, count: usize) -> FaultProxy {
        FaultProxy::start_with(target_port, suffix, count, None)
    }

    /// A proxy that drops If-None-Match and If-Match from every request: the server then
    /// behaves as a store that ignores conditional PUTs.
    pub fn ignoring_conditions(target_port: u16) -> FaultProxy {
        FaultProxy::start_with(target_port, "", 0, Some("ignore-conditions".to_string()))
    }

    /// A proxy that lets the first `skip` PUTs of a key ending in `suffix` through, then
    /// carries out the next `count` and answers each with a connection reset (no answer);
    /// with `deletes_too`, DELETEs of such keys count and are reset as well.
    pub fn resetting(
        target_port: u16,
        suffix: &str,
        skip: usize,
        count: usize,
        deletes_too: bool,
    ) -> FaultProxy {
        let mode = if deletes_too {
            "reset-deletes-too"
        } else {
            "reset"
        };
        FaultProxy::start_with(target_port, suffix, count, Some(format!("{mode}:{skip}")))
    }

    /// A proxy that carries out every request, of any method, and answers `percent` % of
    /// them (drawn from a generator seeded with `seed`) with a connection reset instead.
    pub fn resetting_percent(target_port: u16, percent: f64, seed: u64) -> FaultProxy {
        FaultProxy::start_with(
            target_port,
            "",
            0,
            Some(format!("reset-percent:{percent}:{seed}")),
        )
    }

    fn start_with(
        target_port: u16,
        suffix: &str,
        count: usize,
        mode: Option<String>,
    ) -> FaultProxy {
        let dir = tempfile::tempdir().unwrap();
        let faults_log = dir.path().join("faults.log");
        let port = free_port();
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../bufcache-s3/tests/support/fault_proxy.py"
        );
        let child = Command::new("python3")
            .arg(script)
            .args([&port.to_string(), &target_port.to_string()])
            .arg(&faults_log)
            .args([suffix, &count.to_string()])
            .args(mode)
            .stdout(Stdio::null())
            .spawn()
            .expect("starting the fault proxy");
        wait_for_port(port);
        FaultProxy {
            child,
            port,
            faults_log,
            _dir: dir,
        }
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The faults injected so far: one line per request, with the server's real status.
    pub fn faults(&self) -> Vec<String> {
        std::fs::read_to_string(&self.faults_log)
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An HTTP proxy in front of a server (`refuse_proxy.py`) that answers every request whose
/// method is in `methods` with `status` and an S3 error document of `code`, without
/// forwarding it (status 0: closes the connection unanswered); other requests go through.
pub struct RefuseProxy {
    child: Child,
    pub port: u16,
}

impl RefuseProxy {
    pub fn start(target_port: u16, methods: &str, status: u16, code: &str) -> RefuseProxy {
        let port = free_port();
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../bufcache-s3/tests/support/refuse_proxy.py"
        );
        let child = Command::new("python3")
            .arg(script)
            .args([&port.to_string(), &target_port.to_string(), methods])
            .args([&status.to_string(), code])
            .stdout(Stdio::null())
            .spawn()
            .expect("starting the refusing proxy");
        wait_for_port(port);
        RefuseProxy { child, port }
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Drop for RefuseProxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
