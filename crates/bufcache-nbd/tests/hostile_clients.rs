// Goal: no client can stop the others (issue #32): requests that stall hold their share of
// the in-flight budget only until the stall timeout, a prompt client never waits for them,
// and idle connections cannot fill the serving slots. Method: our server in-process over the
// real engine (16 MiB cache, so the in-flight budget is the 64 MiB a `--cache-size 16M`
// server gets), attackers speaking raw NBD over TCP, and a good client (NbdClient) that
// connects, writes 4 KiB, reads it back and flushes, timed, again and again while the attack
// runs; attackers are watched for the server closing their connections.

mod common;

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bufcache_export::CacheExport;
use bufcache_nbd::protocol::*;
use bufcache_nbd::{Export, NbdClient, ServerConfig};
use common::*;

/// The stall timeout the attack tests use: short, so attackers are closed within the test.
const STALL_TIMEOUT: Duration = Duration::from_secs(2);

/// The good client's target: connect + 4 KiB write + read + flush, p99 of the tries.
const ROUND_TRIP_P99_MAX: Duration = Duration::from_secs(1);

/// How long after the stall timeout an attacker may still be open, or a large request still
/// waiting: the server's work between its reads, scheduling on a loaded machine, and the
/// time the attacker's own send takes to stall. Generous, since the property is that the
/// attacker is closed at all, after about one stall timeout, not a latency.
const STALL_SLACK: Duration = Duration::from_secs(4);

/// Good-client tries at least, as the target asks.
const TRIES_MIN: usize = 20;

/// A server over a 16 MiB cache of a 256 MiB memory device, export "disk", with the in-flight
/// budget `bufcache serve --cache-size 16M` gets (twice the 32 MiB request size).
fn engine_server(config: ServerConfig) -> TestServer {
    let cache = bufcache_host::system_cache(bufcache::CacheConfig {
        memory_bytes_max: 16 << 20,
        ..bufcache::CacheConfig::default()
    })
    .expect("valid cache config");
    let device: Arc<dyn bufcache::Device> = Arc::new(bufcache::MemoryDevice::new(256 << 20));
    let object = cache
        .open_object(bufcache::ObjectConfig::new("disk", device))
        .expect("open object");
    let export: Arc<dyn Export> = Arc::new(CacheExport::new(object));
    start_server_with(
        vec![("disk", export)],
        ServerConfig {
            inflight_bytes_max: 64 << 20,
            connection_inflight_bytes_max: 64 << 20,
            stall_timeout: STALL_TIMEOUT,
            ..config
        },
    )
}

/// Opens a raw connection and negotiates export `name` with NBD_OPT_GO (simple replies).
fn raw_open(server: &TestServer, name: &str) -> TcpStream {
    let mut stream = TcpStream::connect(("127.0.0.1", server.port())).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut greeting = [0u8; 18];
    stream.read_exact(&mut greeting).unwrap();
    assert_eq!(be_u64(&greeting[8..16]), OPTION_MAGIC);
    let flags = CLIENT_FLAG_FIXED_NEWSTYLE | CLIENT_FLAG_NO_ZEROES;
    let mut message = flags.to_be_bytes().to_vec();
    let mut data = (name.len() as u32).to_be_bytes().to_vec();
    data.extend_from_slice(name.as_bytes());
    data.extend_from_slice(&0u16.to_be_bytes());
    message.extend_from_slice(&OPTION_MAGIC.to_be_bytes());
    message.extend_from_slice(&OPT_GO.to_be_bytes());
    message.extend_from_slice(&(data.len() as u32).to_be_bytes());
    message.extend_from_slice(&data);
    stream.write_all(&message).unwrap();
    loop {
        let mut header = [0u8; 20];
        stream.read_exact(&mut header).unwrap();
        let mut payload = vec![0u8; be_u32(&header[16..20]) as usize];
        stream.read_exact(&mut payload).unwrap();
        match be_u32(&header[12..16]) {
            REP_ACK => return stream,
            REP_INFO => continue,
            other => panic!("GO refused with {other:#x}"),
        }
    }
}

fn request_header(command: u16, handle: u64, offset: u64, length: u32) -> [u8; 28] {
    RequestHeader {
        flags: 0,
        command,
        handle,
        offset,
        length: length.into(),
    }
    .encode()
}

/// Reads and discards until the server closes the connection; the bytes received, or
/// `None` when it was still open after `timeout`.
fn bytes_until_closed(stream: &mut TcpStream, timeout: Duration) -> Option<u64> {
    stream.set_read_timeout(Some(timeout)).unwrap();
    let deadline = Instant::now() + timeout;
    let mut buffer = vec![0u8; 1 << 20];
    let mut received = 0u64;
    while Instant::now() < deadline {
        match stream.read(&mut buffer) {
            Ok(0) => return Some(received),
            Ok(count) => received += count as u64,
            Err(error) if error.kind() == io::ErrorKind::ConnectionReset => return Some(received),
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
    None
}

/// One good-client round trip: connect, write 4 KiB, read it back, flush.
fn good_round_trip(server: &TestServer, offset: u64, seed: u64) -> Duration {
    let started = Instant::now();
    let client = NbdClient::connect(&server.tcp_uri("disk")).expect("good client connects");
    let data = pattern_bytes(4096, seed);
    client.write(offset, &data).expect("good client writes");
    let mut back = vec![0u8; 4096];
    client.read(offset, &mut back).expect("good client reads");
    assert!(back == data, "the good client reads what it wrote");
    client.flush().expect("good client flushes");
    started.elapsed()
}

/// Times good-client round trips until `attack_over` is set (and at least `TRIES_MIN`);
/// returns the durations sorted.
fn good_client_while(server: &TestServer, attack_over: &AtomicBool) -> Vec<Duration> {
    let mut times = Vec::new();
    while times.len() < TRIES_MIN || !attack_over.load(Ordering::Acquire) {
        let index = times.len() as u64;
        // The good client's blocks are far from the attackers' (the first 128 MiB).
        times.push(good_round_trip(
            server,
            (192 << 20) + (index % 64) * 4096,
            index,
        ));
    }
    times.sort();
    times
}

/// The nearest-rank 99th percentile of sorted `times`.
fn p99(times: &[Duration]) -> Duration {
    let rank = (times.len() * 99).div_ceil(100);
    times[rank - 1]
}

/// Slowloris: attackers each send a 32 MiB WRITE header and one byte of its payload, which
/// reserves (before the stall timeout) more than the whole shared part of the 64 MiB
/// budget. Before the fix two such connections stopped every client for good. Now the good
/// client is served within 1 s (p99) throughout; every attacker is closed about one stall
/// timeout after it sent its header, the one holding the budget by its payload's stall and
/// those queued behind it because their payloads are not arriving, so a large request (a
/// 1 MiB write, which takes its turn in order) waits about one stall timeout, not one per
/// attacker; and not before the stall timeout (so the share really was held).
#[test]
fn slowloris_writes_do_not_stop_a_good_client_and_are_closed_at_the_stall_timeout() {
    let server = engine_server(ServerConfig::default());
    let attackers_count = 4;
    let attack_over = AtomicBool::new(false);
    let started = Instant::now();
    let mut attackers: Vec<TcpStream> = (0..attackers_count)
        .map(|index| {
            let mut stream = raw_open(&server, "disk");
            let mut message =
                request_header(CMD_WRITE, index, index * (32 << 20), 32 << 20).to_vec();
            message.push(0xa5);
            stream.write_all(&message).unwrap();
            stream
        })
        .collect();
    let (times, closed, large) = std::thread::scope(|scope| {
        let watcher = scope.spawn(|| {
            let closed: Vec<(Option<u64>, Duration)> = attackers
                .iter_mut()
                .map(|stream| {
                    let bytes = bytes_until_closed(stream, Duration::from_secs(20));
                    (bytes, started.elapsed())
                })
                .collect();
            attack_over.store(true, Ordering::Release);
            closed
        });
        let large = scope.spawn(|| {
            let client = NbdClient::connect(&server.tcp_uri("disk")).expect("large client");
            let data = pattern_bytes(1 << 20, 99);
            let began = Instant::now();
            client.write(160 << 20, &data).expect("large write");
            let mut back = vec![0u8; 1 << 20];
            client.read(160 << 20, &mut back).expect("large read");
            assert!(back == data, "the large client reads what it wrote");
            began.elapsed()
        });
        let times = good_client_while(&server, &attack_over);
        (times, watcher.join().unwrap(), large.join().unwrap())
    });
    eprintln!(
        "slowloris x{attackers_count}: {} good round trips, median {:?}, p99 {:?}, max {:?}; 1 MiB write + read {large:?}; attackers closed after {:?}",
        times.len(),
        times[times.len() / 2],
        p99(&times),
        times.last().unwrap(),
        closed.iter().map(|(_, at)| *at).collect::<Vec<_>>()
    );
    assert!(
        large < STALL_TIMEOUT + STALL_SLACK,
        "a 1 MiB write waited {large:?}: one stall timeout per attacker"
    );
    assert!(p99(&times) < ROUND_TRIP_P99_MAX, "p99 {:?}", p99(&times));
    for (bytes, at) in closed {
        assert!(bytes.is_some(), "an attacker was never closed");
        assert!(at < STALL_TIMEOUT + STALL_SLACK, "closed after {at:?}");
    }
    assert!(
        started.elapsed() >= STALL_TIMEOUT,
        "the attack ended before the stall timeout: it held nothing"
    );
}

/// Unread replies: an attacker pipelines 32 MiB READs and never reads a byte; each reply
/// holds 32 MiB of the budget while it waits for the client, and before the fix one such
/// connection held a 64 MiB budget for ever. Now the good client is served within 1 s
/// (p99) throughout, the attacker stops being read from at its per-connection cap
/// (`connection_inflight_bytes_max`), and is closed by the stall timeout with most of its
/// replies never sent.
#[test]
fn unread_replies_do_not_stop_a_good_client_and_are_closed_at_the_stall_timeout() {
    let server = engine_server(ServerConfig::default());
    let attackers_count = 2;
    let reads_per_attacker: u64 = 4;
    let attack_over = AtomicBool::new(false);
    let started = Instant::now();
    let mut attackers: Vec<TcpStream> = (0..attackers_count)
        .map(|attacker| {
            let mut stream = raw_open(&server, "disk");
            let mut burst = Vec::new();
            for index in 0..reads_per_attacker {
                let offset = (attacker * reads_per_attacker + index) % 4 * (32 << 20);
                burst.extend_from_slice(&request_header(CMD_READ, index, offset, 32 << 20));
            }
            stream.write_all(&burst).unwrap();
            stream
        })
        .collect();
    let (times, closed) = std::thread::scope(|scope| {
        let watcher = scope.spawn(|| {
            // Reading nothing until the server gives up on us: wait for its FIN without
            // consuming a byte, then count what it had sent.
            let closed: Vec<(Option<u64>, Duration)> = attackers
                .iter_mut()
                .map(|stream| {
                    wait_for_peer_close(stream, Duration::from_secs(30));
                    let closed_at = started.elapsed();
                    (
                        bytes_until_closed(stream, Duration::from_secs(5)),
                        closed_at,
                    )
                })
                .collect();
            attack_over.store(true, Ordering::Release);
            closed
        });
        let times = good_client_while(&server, &attack_over);
        (times, watcher.join().unwrap())
    });
    eprintln!(
        "unread 32 MiB READs x{attackers_count}: {} good round trips, median {:?}, p99 {:?}, max {:?}; attackers closed after {:?}",
        times.len(),
        times[times.len() / 2],
        p99(&times),
        times.last().unwrap(),
        closed.iter().map(|(bytes, at)| (*at, *bytes)).collect::<Vec<_>>()
    );
    assert!(p99(&times) < ROUND_TRIP_P99_MAX, "p99 {:?}", p99(&times));
    for (bytes, at) in closed {
        let bytes = bytes.expect("an attacker was never closed");
        assert!(
            bytes < reads_per_attacker * (32 << 20),
            "all {bytes} bytes of replies went out: the attacker was not cut off"
        );
        assert!(at < Duration::from_secs(30), "closed after {at:?}");
    }
}

/// Waits up to `timeout` for the server to close (or reset) `stream`, without reading the
/// data queued before its FIN (poll for POLLRDHUP, not POLLIN).
fn wait_for_peer_close(stream: &TcpStream, timeout: Duration) {
    use std::os::unix::io::AsRawFd;
    let mut poll_fd = libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one valid pollfd for an open descriptor.
    unsafe { libc::poll(&mut poll_fd, 1, timeout.as_millis() as i32) };
}

/// Idle connections cannot fill the server: 1,024 clients finish the handshake and send
/// nothing (the default `connections_max`, every serving slot); before the fix every new
/// client was refused. Now each of 20 good clients is served within 1 s (p99), by closing
/// the connection idle the longest: the oldest idle ones are closed, the newest still work.
#[test]
fn idle_connections_filling_every_slot_are_evicted_oldest_first_for_good_clients() {
    let config = ServerConfig::default();
    assert_eq!(config.connections_max, 1024);
    let server = engine_server(config);
    let idle: Vec<NbdClient> = (0..1024)
        .map(|_| NbdClient::connect(&server.tcp_uri("disk")).expect("idle client connects"))
        .collect();
    let mut times: Vec<Duration> = (0..TRIES_MIN as u64)
        .map(|index| good_round_trip(&server, (192 << 20) + index * 4096, index))
        .collect();
    times.sort();
    eprintln!(
        "1024 idle connections: {} good clients, median {:?}, p99 {:?}",
        times.len(),
        times[times.len() / 2],
        p99(&times)
    );
    assert!(p99(&times) < ROUND_TRIP_P99_MAX, "p99 {:?}", p99(&times));
    let mut buffer = [0u8; 512];
    assert!(
        idle[0].read(0, &mut buffer).is_err(),
        "the oldest idle connection was not the one closed"
    );
    idle[1023]
        .read(0, &mut buffer)
        .expect("the newest idle connection is still served");
}
