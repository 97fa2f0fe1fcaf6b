// Goal: idle or hostile clients cannot keep a good client out, and the connection limits,
// the handshake budget and timeouts, and the idle timeout do what their documentation says.
// Method: our server in-process on 127.0.0.1:0; "silent" clients are raw TCP connections
// that never send a byte (stuck before the handshake), "idle" clients are NbdClient
// connections that finished the handshake and send nothing. A good client then connects and
// writes and reads back; closures are observed as end-of-file on the raw sockets. Waits are
// bounded generously so a busy machine does not fail the tests.

mod common;

use std::io::{self, Read};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bufcache_nbd::{Export, MemoryExport, NbdClient, ServerConfig};
use common::*;

fn memory_server_with(config: ServerConfig) -> TestServer {
    let export = Arc::new(MemoryExport::new(1 << 20));
    start_server_with(vec![("mem", export as Arc<dyn Export>)], config)
}

/// A TCP connection that never sends anything.
fn silent_client(server: &TestServer) -> TcpStream {
    let stream = TcpStream::connect(("127.0.0.1", server.port())).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    stream
}

/// True when the server closed the socket (end-of-file or reset) within the read timeout;
/// the greeting and anything else the server sent first are skipped.
fn closed_by_server(stream: &mut TcpStream) -> bool {
    let mut buffer = [0u8; 256];
    loop {
        match stream.read(&mut buffer) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(error) if error.kind() == io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

/// A good client connects, writes, reads back and flushes; returns how long that took.
fn good_client_round_trip(server: &TestServer) -> Duration {
    let started = Instant::now();
    let client = NbdClient::connect(&server.tcp_uri("mem")).expect("good client connects");
    client.write(8192, b"good client").unwrap();
    let mut back = [0u8; 11];
    client.read(8192, &mut back).unwrap();
    assert_eq!(&back, b"good client");
    client.flush().unwrap();
    started.elapsed()
}

/// The target: 1,000 connections left idle, half before the handshake and half after
/// it, with the default limits; a good client still connects and completes I/O within 2 s.
#[test]
fn a_thousand_idle_connections_do_not_keep_a_good_client_out() {
    let server = memory_server_with(ServerConfig::default());
    let silent: Vec<TcpStream> = (0..500).map(|_| silent_client(&server)).collect();
    let idle: Vec<NbdClient> = (0..500)
        .map(|_| NbdClient::connect(&server.tcp_uri("mem")).expect("idle client connects"))
        .collect();
    let elapsed = good_client_round_trip(&server);
    eprintln!(
        "good client served in {:.1} ms beside {} silent and {} idle connections",
        elapsed.as_secs_f64() * 1000.0,
        silent.len(),
        idle.len()
    );
    assert!(elapsed < Duration::from_secs(2), "took {elapsed:?}");
    // The idle clients that finished the handshake were not disturbed.
    let mut back = [0u8; 11];
    idle[0].read(8192, &mut back).unwrap();
    assert_eq!(&back, b"good client");
}

/// Over the handshake budget, the oldest connection still negotiating is closed: a flood of
/// silent connections costs each other their slots, not a prompt client its own.
#[test]
fn the_oldest_silent_connection_is_evicted_when_the_handshake_budget_is_full() {
    let config = ServerConfig {
        handshake_connections_max: 4,
        ..ServerConfig::default()
    };
    let server = memory_server_with(config);
    let mut silent: Vec<TcpStream> = (0..4).map(|_| silent_client(&server)).collect();
    // Let the server register the four before the fifth arrives, so "oldest" is well defined.
    std::thread::sleep(Duration::from_millis(300));
    let newest = silent_client(&server);
    assert!(
        closed_by_server(&mut silent[0]),
        "the oldest was not evicted"
    );
    assert!(good_client_round_trip(&server) < Duration::from_secs(5));
    drop(newest);
}

/// The handshake timeout bounds the whole handshake, and `connections_max` counts only
/// connections that finished it: with every serving slot taken by idle clients, a new client
/// is served in place of the one idle the longest, while silent connections never took a
/// slot (and evict nobody).
#[test]
fn connections_max_counts_serving_clients_and_the_handshake_timeout_closes_silent_ones() {
    let config = ServerConfig {
        connections_max: 2,
        handshake_timeout: Duration::from_millis(500),
        ..ServerConfig::default()
    };
    let server = memory_server_with(config);
    let mut silent = silent_client(&server);
    let started = Instant::now();
    assert!(closed_by_server(&mut silent), "silent client not closed");
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(400),
        "closed too early: {waited:?}"
    );
    assert!(
        waited < Duration::from_secs(10),
        "closed too late: {waited:?}"
    );
    // Silent connections do not count: two clients are served beside three of them.
    let _silent: Vec<TcpStream> = (0..3).map(|_| silent_client(&server)).collect();
    let first = NbdClient::connect(&server.tcp_uri("mem")).expect("first client");
    let second = NbdClient::connect(&server.tcp_uri("mem")).expect("second client");
    // Both serving slots are taken by idle clients: a third is served, in place of the one
    // idle the longest (the first); the second is untouched. (With no idle client, a new
    // one is refused: `a_client_told_it_may_transmit_always_has_a_serving_slot`.)
    let third = NbdClient::connect(&server.tcp_uri("mem")).expect("third client");
    let mut buffer = [0u8; 512];
    assert!(
        first.read(0, &mut buffer).is_err(),
        "the client idle the longest was not the one closed"
    );
    second
        .read(0, &mut buffer)
        .expect("the other idle client is still served");
    third.flush().unwrap();
}

/// The idle timeout closes a connection that has nothing in flight and sends nothing, and
/// never one that keeps sending requests: with the idle timeout shorter than the stall
/// timeout (waited for on its own) and longer (counted in the socket's receive timeouts).
#[test]
fn idle_timeout_closes_idle_connections_but_not_busy_ones() {
    idle_timeout_closes_only_the_idle_client(Duration::from_millis(400), Duration::from_secs(5));
    idle_timeout_closes_only_the_idle_client(
        Duration::from_millis(400),
        Duration::from_millis(150),
    );
}

/// Goal: the property above for one pair of timeouts. Method: one client sends a request
/// every 50 ms for 1.5 s while another sends nothing; then the silent one's request must
/// fail and the busy one must have been served throughout.
fn idle_timeout_closes_only_the_idle_client(idle_timeout: Duration, stall_timeout: Duration) {
    let config = ServerConfig {
        idle_timeout: Some(idle_timeout),
        stall_timeout,
        ..ServerConfig::default()
    };
    let server = memory_server_with(config);
    let idle = NbdClient::connect(&server.tcp_uri("mem")).expect("idle client");
    let busy = NbdClient::connect(&server.tcp_uri("mem")).expect("busy client");
    let until = Instant::now() + Duration::from_millis(1500);
    let mut buffer = [0u8; 512];
    while Instant::now() < until {
        busy.read(0, &mut buffer)
            .expect("busy client keeps being served");
        std::thread::sleep(Duration::from_millis(50));
    }
    // The idle one was closed by now: its next request fails.
    assert!(
        idle.read(0, &mut buffer).is_err(),
        "idle client still served (idle timeout {idle_timeout:?}, stall timeout {stall_timeout:?})"
    );
}

/// A silent TCP connection to the server from the loopback address `source` (any 127.x.y.z
/// works on Linux), so a test can play two different peers.
fn silent_client_from(server: &TestServer, source: [u8; 4]) -> TcpStream {
    use std::os::unix::io::FromRawFd;
    let address = |ip: [u8; 4], port: u16| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from_be_bytes(ip).to_be(),
        },
        sin_zero: [0; 8],
    };
    let length = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: plain socket calls on a descriptor this function owns; the addresses are
    // valid sockaddr_in values that outlive the calls, with their true length.
    unsafe {
        let descriptor = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
        assert!(descriptor >= 0, "socket: {}", io::Error::last_os_error());
        let local = address(source, 0);
        let bound = libc::bind(
            descriptor,
            (&local as *const libc::sockaddr_in).cast(),
            length,
        );
        assert_eq!(bound, 0, "bind: {}", io::Error::last_os_error());
        let remote = address([127, 0, 0, 1], server.port());
        let connected = libc::connect(
            descriptor,
            (&remote as *const libc::sockaddr_in).cast(),
            length,
        );
        assert_eq!(connected, 0, "connect: {}", io::Error::last_os_error());
        let stream = TcpStream::from_raw_fd(descriptor);
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        stream
    }
}

/// One address flooding the handshake budget only evicts its own connections: a connection
/// from another address, still negotiating, survives twenty silent ones from the flooder,
/// though together they are far over the whole handshake budget.
#[test]
fn a_flood_from_one_address_evicts_only_its_own_negotiating_connections() {
    let config = ServerConfig {
        handshake_connections_max: 8,
        handshake_connections_per_peer_max: 4,
        ..ServerConfig::default()
    };
    let server = memory_server_with(config);
    let mut bystander = silent_client_from(&server, [127, 0, 0, 1]);
    std::thread::sleep(Duration::from_millis(200));
    let mut flood: Vec<TcpStream> = Vec::new();
    for _ in 0..20 {
        flood.push(silent_client_from(&server, [127, 0, 0, 2]));
        // Let the server register each before the next, so "oldest" is well defined.
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        closed_by_server(&mut flood[0]),
        "the flooder's oldest stayed"
    );
    // The bystander got its greeting and nothing else: the read times out, no end-of-file.
    bystander
        .set_read_timeout(Some(Duration::from_millis(1000)))
        .unwrap();
    assert!(
        !closed_by_server(&mut bystander),
        "the bystander was evicted"
    );
    assert!(good_client_round_trip(&server) < Duration::from_secs(5));
}

#[test]
fn a_client_told_it_may_transmit_always_has_a_serving_slot() {
    // Goal: the serving slot is taken before the reply that ends the handshake, so when two
    // clients race for the last slot the loser is refused at NBD_OPT_GO with an error naming
    // the limit, and the winner is never closed after being told it may transmit (nor while
    // it has a request in flight: only idle connections are evicted). Method: with
    // connections_max 1, a raw client passes the accept-time check and stops before GO; a
    // second client then connects fully, takes the slot and starts a FLUSH the export holds;
    // the raw client's GO must get NBD_REP_ERR_POLICY, and the second client must still work.
    use bufcache_nbd::protocol::*;
    use std::io::Write;
    let config = ServerConfig {
        connections_max: 1,
        ..ServerConfig::default()
    };
    let export = Arc::new(GatedFlushExport {
        inner: MemoryExport::new(1 << 20),
        gate: parking_lot::Mutex::new(GateState::default()),
        changed: parking_lot::Condvar::new(),
    });
    let server = start_server_with(
        vec![("mem", Arc::clone(&export) as Arc<dyn Export>)],
        config,
    );
    let mut raw = silent_client(&server);
    let mut greeting = [0u8; 18];
    raw.read_exact(&mut greeting).unwrap();
    raw.write_all(&(CLIENT_FLAG_FIXED_NEWSTYLE | CLIENT_FLAG_NO_ZEROES).to_be_bytes())
        .unwrap();
    let winner = NbdClient::connect(&server.tcp_uri("mem")).expect("the first to GO is served");
    let refusal = std::thread::scope(|scope| {
        let flushing = scope.spawn(|| winner.flush());
        export.wait_until_flushing();
        let refusal = go_refusal(&mut raw);
        export.open_gate();
        flushing.join().unwrap().expect("the held FLUSH completes");
        refusal
    });
    assert_eq!(refusal.0, REP_ERR_POLICY, "{}", refusal.1);
    assert!(refusal.1.contains("too many connections"), "{}", refusal.1);
    winner.write(0, b"still served").unwrap();
    let mut back = [0u8; 12];
    winner.read(0, &mut back).unwrap();
    assert_eq!(&back, b"still served");
}

/// Sends NBD_OPT_GO for "mem" on a raw connection past its greeting and returns the reply
/// that ends it (type and message); panics when it is acknowledged.
fn go_refusal(raw: &mut TcpStream) -> (u32, String) {
    use bufcache_nbd::protocol::*;
    use std::io::Write;
    let mut option = OPTION_MAGIC.to_be_bytes().to_vec();
    option.extend_from_slice(&OPT_GO.to_be_bytes());
    option.extend_from_slice(&(4 + 3 + 2u32).to_be_bytes());
    option.extend_from_slice(&3u32.to_be_bytes());
    option.extend_from_slice(b"mem");
    option.extend_from_slice(&0u16.to_be_bytes());
    raw.write_all(&option).unwrap();
    loop {
        let mut header = [0u8; 20];
        raw.read_exact(&mut header).unwrap();
        let reply_type = u32::from_be_bytes(header[12..16].try_into().unwrap());
        let mut payload =
            vec![0u8; u32::from_be_bytes(header[16..20].try_into().unwrap()) as usize];
        raw.read_exact(&mut payload).unwrap();
        match reply_type {
            REP_INFO => continue,
            REP_ACK => panic!("the second GO was acknowledged with no serving slot left"),
            other => return (other, String::from_utf8_lossy(&payload).into_owned()),
        };
    }
}

#[derive(Default)]
struct GateState {
    flushing: bool,
    open: bool,
}

/// A memory export whose FLUSH waits until the test opens its gate, so a connection has a
/// request in flight for as long as the test needs.
struct GatedFlushExport {
    inner: MemoryExport,
    gate: parking_lot::Mutex<GateState>,
    changed: parking_lot::Condvar,
}

impl GatedFlushExport {
    fn wait_until_flushing(&self) {
        let mut gate = self.gate.lock();
        while !gate.flushing {
            self.changed.wait(&mut gate);
        }
    }

    fn open_gate(&self) {
        self.gate.lock().open = true;
        self.changed.notify_all();
    }
}

impl Export for GatedFlushExport {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_only(&self) -> bool {
        false
    }
    fn read(&self, offset: u64, buffer: &mut [u8]) -> io::Result<()> {
        self.inner.read(offset, buffer)
    }
    fn read_with(
        &self,
        offset: u64,
        buffer: &mut [u8],
        send: &mut bufcache_nbd::ReadSink<'_>,
    ) -> io::Result<()> {
        self.inner.read_with(offset, buffer, send)
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> io::Result<()> {
        self.inner.write(offset, data, fua)
    }
    fn write_from(
        &self,
        offset: u64,
        length: u64,
        fua: bool,
        source: &mut bufcache_nbd::export::WriteSource<'_>,
    ) -> io::Result<()> {
        self.inner.write_from(offset, length, fua, source)
    }
    fn flush(&self) -> io::Result<()> {
        let mut gate = self.gate.lock();
        gate.flushing = true;
        self.changed.notify_all();
        while !gate.open {
            self.changed.wait(&mut gate);
        }
        Ok(())
    }
    fn trim(&self, offset: u64, length: u64, fua: bool) -> io::Result<()> {
        self.inner.trim(offset, length, fua)
    }
    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        may_trim: bool,
        fast_only: bool,
        fua: bool,
    ) -> io::Result<()> {
        self.inner
            .write_zeroes(offset, length, may_trim, fast_only, fua)
    }
    fn cache(&self, offset: u64, length: u64) -> io::Result<()> {
        self.inner.cache(offset, length)
    }
    fn cache_request_bytes_max(&self) -> u64 {
        self.inner.cache_request_bytes_max()
    }
    fn read_is_quick(&self, offset: u64, length: u64) -> bool {
        self.inner.read_is_quick(offset, length)
    }
    fn start_read(
        &self,
        offset: u64,
        length: u32,
        done: bufcache_nbd::ReadDone,
    ) -> Result<(), bufcache_nbd::ReadDone> {
        self.inner.start_read(offset, length, done)
    }
    fn write_is_quick(&self, offset: u64, length: u64, fua: bool) -> bool {
        self.inner.write_is_quick(offset, length, fua)
    }
    fn block_status(
        &self,
        offset: u64,
        length: u64,
    ) -> io::Result<Vec<bufcache_nbd::BlockStatusExtent>> {
        self.inner.block_status(offset, length)
    }
    fn has_cache_state(&self) -> bool {
        self.inner.has_cache_state()
    }
    fn cache_state(
        &self,
        offset: u64,
        length: u64,
    ) -> io::Result<Vec<bufcache_nbd::CacheStateExtent>> {
        self.inner.cache_state(offset, length)
    }
    fn known_zeroes(&self, offset: u64, length: u64) -> Vec<(u64, u64)> {
        self.inner.known_zeroes(offset, length)
    }
}
