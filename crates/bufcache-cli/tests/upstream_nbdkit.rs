//! Goal: with an upstream NBD server as the backend, bufcache clusters what it sends upstream:
//! small sequential client writes arrive as ~1 MiB writes, and a cold sequential read becomes
//! few, large upstream reads, with the data intact. Method: nbdkit's memory plugin under its
//! stats filter (which counts every request that reached it, written at nbdkit exit) behind
//! `bufcache serve --backend nbd+unix:///?socket=...`; nbdcopy drives 64 KiB requests; the
//! counts come from the stats file after both servers stopped. Also: FLUSH then kill -9 leaves
//! the data in nbdkit, and fio's crc32c verify passes through a 4 MiB cache over a slow
//! (delay filter) upstream.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;

const TIMEOUT: Duration = Duration::from_secs(120);
const MIB: u64 = 1 << 20;
const DATA: u64 = 64 * MIB;

/// nbdkit memory SIZE under the stats filter on a unix socket.
struct Nbdkit {
    guard: ChildGuard,
    socket: PathBuf,
    stats: PathBuf,
}

impl Nbdkit {
    fn start(dir: &Path, size: &str) -> Nbdkit {
        let socket = dir.join("upstream.sock");
        let stats = dir.join("stats.txt");
        let mut command = Command::new(tool("nbdkit"));
        command
            .arg("-f")
            .arg("-U")
            .arg(&socket)
            .arg("--filter=stats")
            .arg("memory")
            .arg(size)
            .arg(format!("statsfile={}", stats.display()))
            .arg("statsappend=false");
        let mut guard = ChildGuard::spawn(&mut command, "nbdkit");
        wait_until("nbdkit to accept", Duration::from_secs(30), || {
            assert!(guard.running(), "nbdkit exited early");
            socket.exists()
        });
        Nbdkit {
            guard,
            socket,
            stats,
        }
    }

    fn uri(&self) -> String {
        format!("nbd+unix:///?socket={}", self.socket.display())
    }

    /// Stops nbdkit (SIGTERM) and returns its statistics: op name -> (requests, bytes).
    fn stop(mut self) -> HashMap<String, (u64, u64)> {
        let status = self
            .guard
            .signal_and_wait(SIGTERM, Duration::from_secs(30))
            .expect("nbdkit did not exit after SIGTERM");
        eprintln!("nbdkit exited with {status}");
        let text = std::fs::read_to_string(&self.stats).expect("nbdkit stats file");
        eprintln!("nbdkit stats:\n{text}");
        parse_stats(&text)
    }
}

/// Parses lines like `write: 64 ops, 0.043877 s, 64.00 MiB, 1.42 GiB/s op, ...`.
fn parse_stats(text: &str) -> HashMap<String, (u64, u64)> {
    let mut stats = HashMap::new();
    for line in text.lines().filter(|line| !line.starts_with(' ')) {
        let Some((name, rest)) = line.split_once(": ") else {
            continue;
        };
        let fields: Vec<&str> = rest.split(", ").collect();
        if fields.len() < 3 {
            continue;
        }
        let Some(ops) = fields[0]
            .strip_suffix(" ops")
            .and_then(|n| n.parse::<u64>().ok())
        else {
            continue;
        };
        let mut size = fields[2].split(' ');
        let number: f64 = size.next().unwrap_or("0").parse().unwrap_or(0.0);
        let unit = match size.next().unwrap_or("bytes") {
            "bytes" => 1.0,
            "KiB" => 1024.0,
            "MiB" => 1024.0 * 1024.0,
            "GiB" => 1024.0 * 1024.0 * 1024.0,
            "TiB" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
            other => panic!("unknown unit `{other}` in stats line `{line}`"),
        };
        stats.insert(name.to_string(), (ops, (number * unit).round() as u64));
    }
    stats
}

#[test]
fn parse_stats_reads_nbdkit_lines() {
    let stats = parse_stats(
        "total: 65 ops, 3.583136 s, 64.00 MiB, 17.86 MiB/s\n\
         write: 64 ops, 0.043877 s, 64.00 MiB, 1.42 GiB/s op, 17.86 MiB/s total\n  \
         Request size and alignment breakdown:\n    20 bits: 100.0% (64 reqs, 64.00 MiB total)\n\
         flush: 1 ops, 0.000001 s, 0 bytes, 0 bytes/s op, 0 bytes/s total\n",
    );
    assert_eq!(stats["write"], (64, 64 << 20));
    assert_eq!(stats["flush"], (1, 0));
    assert!(!stats.contains_key("    20 bits"));
}

fn nbdcopy(args: &[&str]) {
    run_ok(cmd("nbdcopy", args), TIMEOUT);
}

#[test]
fn sequential_small_writes_reach_nbdkit_as_clustered_writes() {
    let _timer = Timer::new("sequential_small_writes_reach_nbdkit_as_clustered_writes");
    if !have_tools("upstream_clustered_writes", &["nbdkit", "nbdcopy"]) {
        return;
    }
    let dir = temp_dir();
    let source = random_bytes(DATA as usize, 64);
    let source_path = dir.path().join("source.raw");
    write_file(&source_path, &source);
    let nbdkit = Nbdkit::start(dir.path(), "256M");
    let mut server = Server::start(dir.path(), "srv", &["--backend", &nbdkit.uri()]);
    let uri = server.uri();
    // One connection, 64 KiB requests, flush at the end.
    nbdcopy(&[
        "--connections=1",
        "--request-size=65536",
        "--flush",
        source_path.to_str().unwrap(),
        &uri,
    ]);
    // Read back through bufcache (the first 64 MiB of the 256 MiB export).
    let out = dir.path().join("out.raw");
    nbdcopy(&["--connections=1", &uri, out.to_str().unwrap()]);
    let out_bytes = std::fs::read(&out).unwrap();
    assert_same_bytes(
        &source,
        &out_bytes[..DATA as usize],
        "read back through bufcache",
    );
    assert!(out_bytes[DATA as usize..].iter().all(|b| *b == 0));
    server.stop_clean();

    // The data reached the upstream server itself.
    let direct = dir.path().join("direct.raw");
    nbdcopy(&[&nbdkit.uri(), direct.to_str().unwrap()]);
    let direct_bytes = std::fs::read(&direct).unwrap();
    assert_same_bytes(
        &source,
        &direct_bytes[..DATA as usize],
        "read from nbdkit directly",
    );

    let stats = nbdkit.stop();
    let (writes, written) = stats.get("write").copied().unwrap_or((0, 0));
    let limit = (DATA / MIB) * 11 / 10 + 4;
    eprintln!(
        "upstream writes: {writes} requests, {written} bytes, average {} KiB (limit {limit})",
        written / writes.max(1) / 1024
    );
    assert!(written >= DATA, "only {written} bytes reached nbdkit");
    assert!(
        written <= DATA * 11 / 10,
        "{written} bytes written upstream for {DATA} bytes of data"
    );
    assert!(
        writes <= limit,
        "{writes} upstream writes for 64 MiB of sequential 64 KiB writes (limit {limit})"
    );
    assert!(
        written / writes >= 512 * 1024,
        "average upstream write {} bytes is below 512 KiB",
        written / writes
    );
    let (flushes, _) = stats.get("flush").copied().unwrap_or((0, 0));
    assert!(flushes >= 1, "the client's FLUSH never reached nbdkit");
}

#[test]
fn cold_sequential_read_makes_few_large_upstream_reads() {
    let _timer = Timer::new("cold_sequential_read_makes_few_large_upstream_reads");
    if !have_tools("upstream_cold_read", &["nbdkit", "nbdcopy"]) {
        return;
    }
    let dir = temp_dir();
    let source = random_bytes(DATA as usize, 65);
    let source_path = dir.path().join("source.raw");
    write_file(&source_path, &source);
    let nbdkit = Nbdkit::start(dir.path(), "64M");
    // Fill nbdkit directly (these writes do not pass bufcache; no reads are counted).
    nbdcopy(&[source_path.to_str().unwrap(), &nbdkit.uri()]);
    let mut server = Server::start(dir.path(), "srv", &["--backend", &nbdkit.uri()]);
    let out = dir.path().join("out.raw");
    // One stream: one connection, one request at a time, 64 KiB each.
    nbdcopy(&[
        "--connections=1",
        "--requests=1",
        "--request-size=65536",
        &server.uri(),
        out.to_str().unwrap(),
    ]);
    assert_same_file(&source_path, &out);
    server.stop_clean();
    let stats = nbdkit.stop();
    let (reads, read) = stats.get("read").copied().unwrap_or((0, 0));
    let limit = (DATA / MIB) * 11 / 10 + 8;
    eprintln!(
        "upstream reads: {reads} requests, {read} bytes, average {} KiB (limit {limit})",
        read / reads.max(1) / 1024
    );
    assert!(read >= DATA, "only {read} bytes read upstream");
    assert!(
        reads <= limit,
        "{reads} upstream reads for a cold 64 MiB sequential read (limit {limit})"
    );
    assert!(
        read / reads >= 512 * 1024,
        "average upstream read {} bytes is below 512 KiB",
        read / reads
    );
}

#[test]
fn flush_then_kill_9_leaves_the_data_upstream() {
    let _timer = Timer::new("flush_then_kill_9_leaves_the_data_upstream");
    if !have_tools("upstream_flush_then_kill", &["nbdkit"]) {
        return;
    }
    let dir = temp_dir();
    let nbdkit = Nbdkit::start(dir.path(), "64M");
    let mut server = Server::start(
        dir.path(),
        "srv",
        &["--backend", &nbdkit.uri(), "--no-write-behind"],
    );
    let client = bufcache_nbd::NbdClient::connect(&server.uri()).expect("connecting");
    let mut model = vec![0u8; DATA as usize];
    let mut rng = Rng::new(31);
    for _ in 0..200 {
        let length = 1 + rng.below(100_000) as usize;
        let offset = rng.below(DATA - length as u64) as usize;
        let data = random_bytes(length, rng.next_u64());
        client.write(offset as u64, &data).unwrap();
        model[offset..offset + length].copy_from_slice(&data);
    }
    client.flush().expect("FLUSH");
    server.kill9();
    drop(client);
    let direct = bufcache_nbd::NbdClient::connect(&nbdkit.uri()).expect("connecting to nbdkit");
    let mut actual = vec![0u8; DATA as usize];
    direct.read(0, &mut actual).unwrap();
    assert_same_bytes(&model, &actual, "nbdkit contents after FLUSH and kill -9");
    drop(direct);
    let stats = nbdkit.stop();
    assert!(
        stats.get("flush").map_or(0, |s| s.0) >= 1,
        "the FLUSH was not passed upstream"
    );
}

#[test]
fn fio_verify_through_a_slow_upstream_with_a_small_cache() {
    let _timer = Timer::new("fio_verify_through_a_slow_upstream_with_a_small_cache");
    if !have_tools("upstream_fio_verify", &["nbdkit", "fio"]) {
        return;
    }
    let dir = temp_dir();
    let socket = dir.path().join("slow.sock");
    let mut command = Command::new(tool("nbdkit"));
    command
        .arg("-f")
        .arg("-U")
        .arg(&socket)
        .arg("--filter=delay")
        .arg("memory")
        .arg("32M")
        .arg("delay-read=1ms")
        .arg("delay-write=1ms");
    let mut nbdkit = ChildGuard::spawn(&mut command, "nbdkit");
    wait_until("nbdkit to listen", Duration::from_secs(30), || {
        assert!(nbdkit.running(), "nbdkit exited early");
        socket.exists()
    });
    let upstream = format!("nbd+unix:///?socket={}", socket.display());
    let mut server = Server::start(
        dir.path(),
        "srv",
        &["--backend", &upstream, "--cache-size", "4M"],
    );
    let uri = format!("--uri={}", server.uri());
    let output = run_timeout(
        cmd(
            "fio",
            &[
                "--name=slow-upstream",
                "--ioengine=nbd",
                &uri,
                "--rw=randwrite",
                "--bsrange=4k-64k",
                "--iodepth=16",
                "--size=16M",
                "--verify=crc32c",
                "--do_verify=1",
            ],
        ),
        TIMEOUT,
    );
    let text = output_text(&output);
    assert!(output.status.success(), "fio failed:\n{text}");
    assert!(!text.contains("verify: bad"), "fio verify errors:\n{text}");
    server.stop_clean();
    let _ = nbdkit.signal_and_wait(SIGTERM, Duration::from_secs(30));
}
