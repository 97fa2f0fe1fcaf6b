// Goal: malformed or hostile input ends at most the offending connection, every invalid
// request gets the errno the spec asks for, and good clients keep being served. Method: a
// raw-socket client in this file speaks the protocol byte by byte (including wrong bytes)
// against our server, then a well-behaved client checks the server still works.

mod common;

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bufcache_nbd::protocol::*;
use bufcache_nbd::{BlockStatusExtent, Export, MemoryExport, NbdClient, ServerConfig};
use common::*;

/// A client that sends exactly the bytes a test asks for.
struct RawClient {
    stream: TcpStream,
}

impl RawClient {
    fn connect(server: &TestServer) -> RawClient {
        let stream = TcpStream::connect(("127.0.0.1", server.port())).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        RawClient { stream }
    }

    fn read_bytes(&mut self, count: usize) -> Vec<u8> {
        let mut bytes = vec![0u8; count];
        self.stream.read_exact(&mut bytes).unwrap();
        bytes
    }

    /// Reads the greeting and answers with `client_flags`.
    fn greet(&mut self, client_flags: u32) {
        let greeting = self.read_bytes(18);
        assert_eq!(be_u64(&greeting[0..8]), INIT_MAGIC);
        assert_eq!(be_u64(&greeting[8..16]), OPTION_MAGIC);
        assert_eq!(
            be_u16(&greeting[16..18]),
            FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES
        );
        self.stream.write_all(&client_flags.to_be_bytes()).unwrap();
    }

    fn send_option(&mut self, option: u32, data: &[u8]) {
        let mut message = OPTION_MAGIC.to_be_bytes().to_vec();
        message.extend_from_slice(&option.to_be_bytes());
        message.extend_from_slice(&(data.len() as u32).to_be_bytes());
        message.extend_from_slice(data);
        self.stream.write_all(&message).unwrap();
    }

    /// Returns (option, reply type, payload).
    fn read_option_reply(&mut self) -> (u32, u32, Vec<u8>) {
        let header = self.read_bytes(20);
        assert_eq!(be_u64(&header[0..8]), OPTION_REPLY_MAGIC);
        let payload = self.read_bytes(be_u32(&header[16..20]) as usize);
        (be_u32(&header[8..12]), be_u32(&header[12..16]), payload)
    }

    /// GO for `name`; returns the transmission flags. Panics on refusal.
    fn go(&mut self, name: &str) -> u16 {
        self.send_option(OPT_GO, &info_request(name));
        let mut flags = None;
        loop {
            let (option, reply_type, payload) = self.read_option_reply();
            assert_eq!(option, OPT_GO);
            match reply_type {
                REP_INFO if be_u16(&payload) == INFO_EXPORT => flags = Some(be_u16(&payload[10..])),
                REP_INFO => {}
                REP_ACK => return flags.expect("NBD_INFO_EXPORT before ACK"),
                other => panic!("GO refused with {other:#x}"),
            }
        }
    }

    /// Greets, optionally negotiates structured replies and base:allocation, then GO.
    fn open(server: &TestServer, export: &str, structured: bool) -> (RawClient, u16) {
        let mut client = RawClient::connect(server);
        client.greet(CLIENT_FLAG_FIXED_NEWSTYLE | CLIENT_FLAG_NO_ZEROES);
        if structured {
            client.send_option(OPT_STRUCTURED_REPLY, &[]);
            assert_eq!(client.read_option_reply().1, REP_ACK);
            let mut data = (export.len() as u32).to_be_bytes().to_vec();
            data.extend_from_slice(export.as_bytes());
            data.extend_from_slice(&1u32.to_be_bytes());
            data.extend_from_slice(&(BASE_ALLOCATION.len() as u32).to_be_bytes());
            data.extend_from_slice(BASE_ALLOCATION.as_bytes());
            client.send_option(OPT_SET_META_CONTEXT, &data);
            assert_eq!(client.read_option_reply().1, REP_META_CONTEXT);
            assert_eq!(client.read_option_reply().1, REP_ACK);
        }
        let flags = client.go(export);
        (client, flags)
    }

    fn request(&mut self, command: u16, flags: u16, offset: u64, length: u32, payload: &[u8]) {
        let header = RequestHeader {
            flags,
            command,
            handle: 0x1234_5678 + u64::from(command),
            offset,
            length: length.into(),
        };
        let mut message = header.encode().to_vec();
        message.extend_from_slice(payload);
        self.stream.write_all(&message).unwrap();
    }

    /// Reads a simple reply; returns (error, handle).
    fn simple_reply(&mut self) -> (u32, u64) {
        let reply = self.read_bytes(16);
        assert_eq!(be_u32(&reply), SIMPLE_REPLY_MAGIC);
        (be_u32(&reply[4..8]), be_u64(&reply[8..16]))
    }

    /// Reads a structured chunk; returns (flags, type, handle, payload).
    fn chunk(&mut self) -> (u16, u16, u64, Vec<u8>) {
        let header = self.read_bytes(20);
        assert_eq!(be_u32(&header), STRUCTURED_REPLY_MAGIC);
        let payload = self.read_bytes(be_u32(&header[16..20]) as usize);
        (
            be_u16(&header[4..6]),
            be_u16(&header[6..8]),
            be_u64(&header[8..16]),
            payload,
        )
    }

    /// True when the server closed the connection (EOF or reset) within a few seconds.
    fn is_closed_by_server(&mut self) -> bool {
        let mut byte = [0u8; 1];
        loop {
            match self.stream.read(&mut byte) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(error) if error.kind() == io::ErrorKind::ConnectionReset => return true,
                Err(_) => return false,
            }
        }
    }
}

fn info_request(name: &str) -> Vec<u8> {
    let mut data = (name.len() as u32).to_be_bytes().to_vec();
    data.extend_from_slice(name.as_bytes());
    data.extend_from_slice(&0u16.to_be_bytes());
    data
}

/// The server still serves a well-behaved client: write, read back, flush.
fn assert_still_serving(server: &TestServer) {
    let client = NbdClient::connect(&server.tcp_uri("mem")).expect("good client connects");
    client.write(4096, b"still alive").unwrap();
    let mut back = [0u8; 11];
    client.read(4096, &mut back).unwrap();
    assert_eq!(&back, b"still alive");
    client.flush().unwrap();
}

#[test]
fn garbage_bytes_close_only_that_connection() {
    let (server, _export) = memory_server(1 << 20);
    let mut garbage = RawClient::connect(&server);
    garbage.read_bytes(18);
    garbage.stream.write_all(&pattern_bytes(4096, 1)).unwrap();
    assert!(garbage.is_closed_by_server());
    // Garbage where a request header belongs, after a good handshake.
    let (mut client, _) = RawClient::open(&server, "mem", false);
    client.stream.write_all(&pattern_bytes(64, 2)).unwrap();
    assert!(client.is_closed_by_server());
    assert_still_serving(&server);
}

#[test]
fn nothing_after_a_bad_request_magic_is_ever_served() {
    // Goal: once a request header has the wrong magic the byte stream cannot be trusted, so
    // no later request may be served, however the connection's threads are interleaved.
    // (Fuzzing found a race: a thread that took a slow request just before the end started
    // a successor after the connection had collected its outcome, and the successor read
    // on.) Method: 200 connections each send several slow requests (FLUSH, TRIM, CACHE,
    // which always pass the reading role on), a header with a bad magic, then READs with
    // their own handles, all in one write; read every reply until the server closes and
    // check none answers a request after the bad header.
    const AFTER_HANDLE: u64 = 0xbad0_0000;
    let (server, _export) = memory_server(1 << 20);
    for round in 0..200u64 {
        let (mut client, _) = RawClient::open(&server, "mem", false);
        let mut message = Vec::new();
        for (index, command) in [CMD_FLUSH, CMD_TRIM, CMD_CACHE, CMD_FLUSH, CMD_TRIM]
            .into_iter()
            .enumerate()
        {
            let length = if command == CMD_FLUSH { 0 } else { 4096 };
            let header = RequestHeader {
                flags: 0,
                command,
                handle: index as u64,
                offset: 0,
                length,
            };
            message.extend_from_slice(&header.encode());
        }
        let mut bad = RequestHeader {
            flags: 0,
            command: CMD_READ,
            handle: 99,
            offset: 0,
            length: 512,
        }
        .encode();
        bad[1] ^= 0xff;
        message.extend_from_slice(&bad);
        for index in 0..4u64 {
            let read = RequestHeader {
                flags: 0,
                command: CMD_READ,
                handle: AFTER_HANDLE + index,
                offset: 0,
                length: 0,
            };
            message.extend_from_slice(&read.encode());
        }
        client.stream.write_all(&message).unwrap();
        // The server closes with our unread requests in its buffer, so TCP may end in a
        // reset; whatever arrived before it is checked.
        let mut replies = Vec::new();
        let mut piece = [0u8; 4096];
        loop {
            match client.stream.read(&mut piece) {
                Ok(0) => break,
                Ok(count) => replies.extend_from_slice(&piece[..count]),
                Err(error) if error.kind() == io::ErrorKind::ConnectionReset => break,
                Err(error) => panic!(
                    "round {round}: the server kept reading after a bad magic instead of \
                     closing ({error})"
                ),
            }
        }
        for reply in replies.chunks_exact(16) {
            assert_eq!(be_u32(reply), SIMPLE_REPLY_MAGIC, "round {round}");
            let handle = be_u64(&reply[8..16]);
            assert!(
                handle < AFTER_HANDLE,
                "round {round}: request {handle:#x}, sent after a bad magic, was served"
            );
        }
    }
    assert_still_serving(&server);
}

#[test]
fn a_client_gone_mid_payload_ends_only_its_connection_and_writes_nothing() {
    // Goal: a WRITE whose payload stops half-way (the client died) ends that connection only;
    // the export, which reads quick writes' payloads straight from the socket, is left as it
    // was (the memory export applies a write only once all its data has arrived), and the
    // server keeps serving. Method: a raw client sends a 64 KiB WRITE header with 10 KiB of
    // data and closes; then the region is read back through a good client.
    let (server, _export) = memory_server(1 << 20);
    {
        let (mut client, _) = RawClient::open(&server, "mem", false);
        let header = RequestHeader {
            flags: 0,
            command: CMD_WRITE,
            handle: 7,
            offset: 65536,
            length: 65536,
        };
        let mut message = header.encode().to_vec();
        message.extend_from_slice(&pattern_bytes(10 * 1024, 9));
        client.stream.write_all(&message).unwrap();
        client.stream.shutdown(std::net::Shutdown::Write).unwrap();
        assert!(client.is_closed_by_server());
    }
    let good = NbdClient::connect(&server.tcp_uri("mem")).expect("good client connects");
    let mut back = vec![1u8; 65536];
    good.read(65536, &mut back).unwrap();
    assert!(
        back.iter().all(|&byte| byte == 0),
        "nothing of the torn write was applied"
    );
    assert_still_serving(&server);
}

#[test]
fn half_open_handshakes_do_not_block_others_and_time_out() {
    let config = ServerConfig {
        handshake_timeout: Duration::from_millis(300),
        ..ServerConfig::default()
    };
    let export = Arc::new(MemoryExport::new(1 << 20));
    let server = start_server_with(vec![("mem", export as Arc<dyn Export>)], config);
    let mut silent = RawClient::connect(&server);
    let mut half = RawClient::connect(&server);
    half.greet(CLIENT_FLAG_FIXED_NEWSTYLE);
    half.stream.write_all(&OPTION_MAGIC.to_be_bytes()).unwrap();
    assert_still_serving(&server);
    let started = Instant::now();
    assert!(silent.is_closed_by_server());
    assert!(half.is_closed_by_server());
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn clients_without_fixed_newstyle_may_only_send_export_name() {
    let (server, _export) = memory_server(1 << 20);
    let mut old = RawClient::connect(&server);
    old.greet(0);
    // Plain newstyle allows NBD_OPT_EXPORT_NAME only (tests/protocol_fixes.rs enters with it).
    old.send_option(OPT_LIST, &[]);
    assert!(old.is_closed_by_server());
    let mut unknown_flags = RawClient::connect(&server);
    unknown_flags.greet(CLIENT_FLAG_FIXED_NEWSTYLE | 0x80);
    assert!(unknown_flags.is_closed_by_server());
    assert_still_serving(&server);
}

#[test]
fn unknown_options_and_exports_get_errors_and_haggling_continues() {
    let (server, _export) = memory_server(1 << 20);
    let mut client = RawClient::connect(&server);
    client.greet(CLIENT_FLAG_FIXED_NEWSTYLE | CLIENT_FLAG_NO_ZEROES);
    client.send_option(99, b"whatever");
    assert_eq!(
        client.read_option_reply(),
        (99, REP_ERR_UNSUP, b"option 99 is not supported".to_vec())
    );
    client.send_option(OPT_GO, &info_request("nope"));
    let (_, reply_type, _) = client.read_option_reply();
    assert_eq!(reply_type, REP_ERR_UNKNOWN);
    client.send_option(OPT_LIST, b"x");
    assert_eq!(client.read_option_reply().1, REP_ERR_INVALID);
    // Metadata contexts need structured replies first.
    client.send_option(OPT_SET_META_CONTEXT, &[0, 0, 0, 0, 0, 0, 0, 0]);
    assert_eq!(client.read_option_reply().1, REP_ERR_INVALID);
    let flags = client.go("mem");
    assert!(flags & TRANSMIT_CAN_MULTI_CONN != 0);
    client.request(CMD_READ, 0, 0, 16, &[]);
    assert_eq!(client.simple_reply().0, 0);
    assert_eq!(client.read_bytes(16), vec![0u8; 16]);
    // EXPORT_NAME cannot carry an error: an unknown name closes the connection.
    let mut by_name = RawClient::connect(&server);
    by_name.greet(CLIENT_FLAG_FIXED_NEWSTYLE);
    by_name.send_option(OPT_EXPORT_NAME, b"nope");
    assert!(by_name.is_closed_by_server());
    assert_still_serving(&server);
}

#[test]
fn invalid_requests_get_the_errno_the_spec_asks_for() {
    let (server, _export) = memory_server(1 << 20);
    let (mut client, flags) = RawClient::open(&server, "mem", false);
    assert!(flags & TRANSMIT_SEND_FAST_ZERO != 0);
    let size = 1u64 << 20;
    let cases: Vec<(u16, u16, u64, u32, usize, u32)> = vec![
        // command, flags, offset, length, payload bytes, expected errno
        (CMD_READ, 0, size - 10, 20, 0, 22),
        (CMD_WRITE, 0, size - 10, 20, 20, 28),
        (CMD_TRIM, 0, size, 1, 0, 22),
        (CMD_WRITE_ZEROES, 0, u64::MAX - 5, 10, 0, 28),
        (CMD_CACHE, 0, size + 1, 1, 0, 22),
        (CMD_READ, CMD_FLAG_REQ_ONE, 0, 1, 0, 22),
        (CMD_READ, CMD_FLAG_DF, 0, 1, 0, 22),
        (CMD_WRITE, CMD_FLAG_NO_HOLE, 0, 4, 4, 22),
        (42, 0, 0, 0, 0, 22),
        (CMD_BLOCK_STATUS, 0, 0, 4096, 0, 22),
        (CMD_READ, 0, 0, 64 << 20, 0, 22),
        (CMD_WRITE, 0, 0, (32 << 20) + 1, (32 << 20) + 1, 22),
    ];
    for (command, command_flags, offset, length, payload_bytes, errno) in cases {
        client.request(
            command,
            command_flags,
            offset,
            length,
            &vec![7u8; payload_bytes],
        );
        let (error, handle) = client.simple_reply();
        assert_eq!(
            (error, handle),
            (errno, 0x1234_5678 + u64::from(command)),
            "command {command} flags {command_flags:#x} offset {offset} length {length}"
        );
    }
    // The connection survived all of that.
    client.request(CMD_WRITE, CMD_FLAG_FUA, 10, 3, b"abc");
    assert_eq!(client.simple_reply().0, 0);
    client.request(CMD_READ, 0, 10, 3, &[]);
    assert_eq!(client.simple_reply().0, 0);
    assert_eq!(client.read_bytes(3), b"abc");
    // A write far too large to skip ends the connection.
    client.request(CMD_WRITE, 0, 0, u32::MAX, &[]);
    assert!(client.is_closed_by_server());
    assert_still_serving(&server);
}

#[test]
fn read_only_exports_refuse_writes_with_eperm() {
    let export = Arc::new(MemoryExport::new(1 << 20).with_read_only(true));
    let server = start_server(vec![("ro", export as Arc<dyn Export>)]);
    let (mut client, flags) = RawClient::open(&server, "ro", false);
    assert!(flags & TRANSMIT_READ_ONLY != 0);
    assert!(flags & TRANSMIT_SEND_TRIM == 0);
    client.request(CMD_WRITE, 0, 0, 4, b"nope");
    assert_eq!(client.simple_reply().0, 1);
    client.request(CMD_TRIM, 0, 0, 4096, &[]);
    assert_eq!(client.simple_reply().0, 1);
    client.request(CMD_READ, 0, 0, 4, &[]);
    assert_eq!(client.simple_reply().0, 0);
    assert_eq!(client.read_bytes(4), vec![0u8; 4]);
}

/// An export whose reads at offset 0 fail and whose reads at 8192 are slow, and which
/// cannot zero fast.
struct FaultyExport {
    inner: MemoryExport,
    slow_read_started: AtomicBool,
}

impl Export for FaultyExport {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_only(&self) -> bool {
        false
    }
    fn read(&self, offset: u64, buffer: &mut [u8]) -> io::Result<()> {
        if offset == 0 {
            return Err(io::Error::other("injected read fault"));
        }
        if offset == 8192 {
            self.slow_read_started.store(true, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(300));
        }
        self.inner.read(offset, buffer)
    }
    fn read_with(
        &self,
        offset: u64,
        buffer: &mut [u8],
        send: &mut bufcache_nbd::ReadSink<'_>,
    ) -> std::io::Result<()> {
        bufcache_nbd::read_via_buffer(self, offset, buffer, send)
    }
    fn read_is_quick(&self, _offset: u64, _length: u64) -> bool {
        // Reads may be slow on purpose: each must go to its own thread.
        false
    }
    fn start_read(
        &self,
        _offset: u64,
        _length: u32,
        done: bufcache_nbd::ReadDone,
    ) -> Result<(), bufcache_nbd::ReadDone> {
        bufcache_nbd::never_start_read(done)
    }
    fn write_is_quick(&self, _offset: u64, _length: u64, _fua: bool) -> bool {
        false
    }
    fn write_from(
        &self,
        offset: u64,
        length: u64,
        fua: bool,
        source: &mut bufcache_nbd::export::WriteSource<'_>,
    ) -> io::Result<()> {
        bufcache_nbd::write_via_buffer(self, offset, length, fua, source)
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> io::Result<()> {
        if offset == 0 {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        self.inner.write(offset, data, fua)
    }
    fn flush(&self) -> io::Result<()> {
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
        if fast_only {
            return Err(io::ErrorKind::Unsupported.into());
        }
        self.inner
            .write_zeroes(offset, length, may_trim, false, fua)
    }
    fn can_fast_zero(&self) -> bool {
        true
    }
    fn cache(&self, offset: u64, length: u64) -> io::Result<()> {
        self.inner.cache(offset, length)
    }
    fn cache_request_bytes_max(&self) -> u64 {
        self.inner.cache_request_bytes_max()
    }
    fn block_status(&self, offset: u64, length: u64) -> io::Result<Vec<BlockStatusExtent>> {
        self.inner.block_status(offset, length)
    }

    fn has_cache_state(&self) -> bool {
        false
    }

    fn cache_state(
        &self,
        _offset: u64,
        _length: u64,
    ) -> io::Result<Vec<bufcache_nbd::CacheStateExtent>> {
        bufcache_nbd::no_cache_state()
    }

    fn known_zeroes(&self, _offset: u64, _length: u64) -> Vec<(u64, u64)> {
        Vec::new()
    }
}

fn faulty_server() -> TestServer {
    let export = Arc::new(FaultyExport {
        inner: MemoryExport::new(1 << 20),
        slow_read_started: AtomicBool::new(false),
    });
    start_server(vec![("mem", export as Arc<dyn Export>)])
}

#[test]
fn export_errors_map_to_errnos_in_simple_and_structured_replies() {
    let server = faulty_server();
    let (mut simple, _) = RawClient::open(&server, "mem", false);
    simple.request(CMD_READ, 0, 0, 512, &[]);
    assert_eq!(simple.simple_reply().0, 5);
    simple.request(CMD_WRITE, 0, 0, 4, b"full");
    assert_eq!(simple.simple_reply().0, 28);
    simple.request(CMD_WRITE_ZEROES, CMD_FLAG_FAST_ZERO, 4096, 4096, &[]);
    assert_eq!(simple.simple_reply().0, 95);
    let (mut structured, _) = RawClient::open(&server, "mem", true);
    structured.request(CMD_READ, 0, 0, 512, &[]);
    let (flags, chunk_type, _, payload) = structured.chunk();
    assert_eq!((flags, chunk_type), (REPLY_FLAG_DONE, REPLY_TYPE_ERROR));
    assert_eq!(be_u32(&payload), 5);
    let message_length = be_u16(&payload[4..6]) as usize;
    assert_eq!(&payload[6..6 + message_length], b"injected read fault");
    structured.request(CMD_READ, CMD_FLAG_DF, 4096, 100, &[]);
    let (flags, chunk_type, _, payload) = structured.chunk();
    assert_eq!(
        (flags, chunk_type),
        (REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA)
    );
    assert_eq!(be_u64(&payload), 4096);
    assert_eq!(payload.len(), 108);
    structured.request(CMD_BLOCK_STATUS, CMD_FLAG_REQ_ONE, 0, 1 << 20, &[]);
    let (_, chunk_type, _, payload) = structured.chunk();
    assert_eq!(chunk_type, REPLY_TYPE_BLOCK_STATUS);
    assert_eq!(payload.len(), 12, "REQ_ONE gives one descriptor");
    assert_eq!(be_u32(&payload[8..12]), STATE_HOLE | STATE_ZERO);
}

#[test]
fn replies_come_back_out_of_order_when_requests_finish_out_of_order() {
    let server = faulty_server();
    let (mut client, _) = RawClient::open(&server, "mem", false);
    // The slow read is sent first, the fast flush second; the flush must not wait for it.
    client.request(CMD_READ, 0, 8192, 16, &[]);
    client.request(CMD_FLUSH, 0, 0, 0, &[]);
    let (error, handle) = client.simple_reply();
    assert_eq!((error, handle), (0, 0x1234_5678 + u64::from(CMD_FLUSH)));
    let (error, handle) = client.simple_reply();
    assert_eq!((error, handle), (0, 0x1234_5678 + u64::from(CMD_READ)));
    assert_eq!(client.read_bytes(16), vec![0u8; 16]);
}

#[test]
fn slow_requests_handed_to_waiting_threads_are_all_answered_even_at_disconnect() {
    // Goal: while a client has requests in flight, the reader hands each slow request to a
    // waiting thread and reads on; every such request is answered once, with its own data,
    // also when the client disconnects right behind them (work still queued then). Method:
    // write distinct bytes over 64 KiB; then one burst: a 300 ms READ (keeps a thread
    // serving), 64 slow 16-byte READs with a FLUSH after every eighth, and NBD_CMD_DISC;
    // every reply is a success for a handle sent, each READ carries its range's bytes, and
    // the server closes the connection only after the last.
    let server = faulty_server();
    let (mut client, _) = RawClient::open(&server, "mem", false);
    let data: Vec<u8> = (0..65536u32).map(|index| (index * 7 + 3) as u8).collect();
    client.request(CMD_WRITE, 0, 65536, data.len() as u32, &data);
    assert_eq!(client.simple_reply().0, 0);
    let mut burst = Vec::new();
    let mut push = |command: u16, handle: u64, offset: u64, length: u32| {
        let header = RequestHeader {
            flags: 0,
            command,
            handle,
            offset,
            length: length.into(),
        };
        burst.extend_from_slice(&header.encode());
    };
    push(CMD_READ, 5000, 8192, 16);
    let mut expected = std::collections::HashMap::new();
    for index in 0..64u64 {
        let offset = 65536 + index * 1000;
        push(CMD_READ, index, offset, 16);
        expected.insert(index, Some(offset));
        if index % 8 == 7 {
            push(CMD_FLUSH, 1000 + index, 0, 0);
            expected.insert(1000 + index, None);
        }
    }
    expected.insert(5000, Some(8192));
    push(CMD_DISC, 9999, 0, 0);
    client.stream.write_all(&burst).unwrap();
    for _ in 0..expected.len() {
        let (error, handle) = client.simple_reply();
        assert_eq!(error, 0, "request {handle} failed");
        let offset = expected
            .remove(&handle)
            .unwrap_or_else(|| panic!("a second reply, or one for a handle never sent: {handle}"));
        if let Some(offset) = offset {
            let bytes = client.read_bytes(16);
            let want = if offset >= 65536 {
                data[(offset - 65536) as usize..][..16].to_vec()
            } else {
                vec![0u8; 16]
            };
            assert_eq!(bytes, want, "READ {handle} at {offset}");
        }
    }
    assert!(expected.is_empty());
    assert!(
        client.is_closed_by_server(),
        "the server ends the connection after DISC"
    );
    assert_still_serving(&server);
}

#[test]
fn a_request_behind_two_slow_ones_is_read_while_they_run() {
    // Goal: a thread already promised a handed-off request is not counted on to read next,
    // so a third request behind two slow ones is read and answered while they run. Method:
    // one slow READ alone first (after it, one thread waits and another holds the reading
    // role); then, in one write, two 300 ms READs and a fast one. The fast one's reply must
    // come first: the first slow READ goes to the waiting thread, the second stays with the
    // reader, and a new thread must take the role for the third.
    let server = faulty_server();
    let (mut client, _) = RawClient::open(&server, "mem", false);
    let read = |handle: u64, offset: u64| {
        RequestHeader {
            flags: 0,
            command: CMD_READ,
            handle,
            offset,
            length: 16,
        }
        .encode()
    };
    client.stream.write_all(&read(1, 8192)).unwrap();
    assert_eq!(client.simple_reply(), (0, 1));
    client.read_bytes(16);
    let mut burst = Vec::new();
    for (handle, offset) in [(2, 8192), (3, 8192), (4, 4096)] {
        burst.extend_from_slice(&read(handle, offset));
    }
    client.stream.write_all(&burst).unwrap();
    let mut order = Vec::new();
    for _ in 0..3 {
        let (error, handle) = client.simple_reply();
        assert_eq!(error, 0, "READ {handle} failed");
        client.read_bytes(16);
        order.push(handle);
    }
    assert_eq!(
        order[0], 4,
        "the fast READ waited for a slow one: replies in order {order:?}"
    );
}

#[test]
fn tiny_inflight_budget_still_serves_deep_pipelines() {
    let config = ServerConfig {
        request_size_max: 4096,
        inflight_bytes_max: 4096,
        workers_per_connection_max: 2,
        ..ServerConfig::default()
    };
    let export = Arc::new(MemoryExport::new(1 << 20));
    let server = start_server_with(vec![("mem", export as Arc<dyn Export>)], config);
    let client = Arc::new(NbdClient::connect(&server.tcp_uri("mem")).unwrap());
    assert_eq!(client.export_info().block_size_max, 4096);
    let threads: Vec<_> = (0..8u8)
        .map(|index| {
            let client = Arc::clone(&client);
            std::thread::spawn(move || {
                // 64 KiB per thread: split by the client into 16 pipelined 4 KiB requests.
                let data = vec![index; 65536];
                client.write(u64::from(index) * 65536, &data).unwrap();
                let mut back = vec![0u8; 65536];
                client.read(u64::from(index) * 65536, &mut back).unwrap();
                assert_eq!(back, data);
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
}

#[test]
fn a_client_that_stops_reading_never_holds_cached_blocks_from_writers() {
    // Goal: a READ reply is written straight from the cache's buffers, held shared while it
    // goes out; a client that stops reading its replies must not keep them held, or every
    // writer of those blocks would wait for it forever. Method: a raw client asks for 4 MiB
    // of cached data (several times what the socket buffers take) and reads nothing; another
    // client then rewrites that range, which must finish within seconds. Finally the stalled
    // client reads its reply, which must be the data as it was when it asked.
    let cache = bufcache_host::system_cache(bufcache::CacheConfig {
        memory_bytes_max: 64 << 20,
        ..bufcache::CacheConfig::default()
    })
    .expect("valid config");
    let device: Arc<dyn bufcache::Device> = Arc::new(bufcache::MemoryDevice::new(16 << 20));
    let object = cache
        .open_object(bufcache::ObjectConfig::new("disk", device))
        .expect("open object");
    let before = pattern_bytes(4 << 20, 1);
    object.write_at(0, &before, false).expect("fill the cache");
    let export: Arc<dyn Export> = Arc::new(bufcache_export::CacheExport::new(object));
    let server = start_server_with(
        vec![("disk", export)],
        ServerConfig {
            request_size_max: 4 << 20,
            ..ServerConfig::default()
        },
    );

    let (mut stalled, _) = RawClient::open(&server, "disk", false);
    stalled.request(CMD_READ, 0, 0, 4 << 20, &[]);
    std::thread::sleep(Duration::from_millis(300));

    let writer = NbdClient::connect(&server.tcp_uri("disk")).expect("second client");
    let after = pattern_bytes(4 << 20, 2);
    let started = Instant::now();
    writer
        .write(0, &after)
        .expect("rewrite while a reply is stalled");
    writer.flush().expect("flush");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "a writer waited {:?} for a client that stopped reading",
        started.elapsed()
    );

    let (error, _) = stalled.simple_reply();
    assert_eq!(error, 0, "the stalled READ succeeds");
    let data = stalled.read_bytes(4 << 20);
    assert!(data == before, "the stalled client gets the data as it was");
    let mut back = vec![0u8; 4 << 20];
    writer.read(0, &mut back).expect("read back");
    assert!(back == after, "the rewrite is what is cached now");
}

#[test]
fn pipelined_requests_sent_in_one_burst_keep_their_boundaries_and_data() {
    // Goal: the server reads requests through a buffer (one recv brings several headers and
    // small payloads), so no byte may be lost, reordered or taken for the wrong request when
    // headers and payloads straddle its boundaries. Method: one write() carries 64 WRITEs of
    // seeded sizes from 1 byte to 70 KiB (smaller and larger than the 16 KiB buffer) at
    // distinct offsets, with FLUSHes among them; every reply must be a success for a handle
    // sent; a second burst READs every range back, and each reply carries its range's data,
    // which the export also holds.
    let (server, export) = memory_server(8 << 20);
    let (mut client, _) = RawClient::open(&server, "mem", false);
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut ranges = Vec::new();
    let mut offset = 0u64;
    let mut burst = Vec::new();
    for index in 0..64u64 {
        let length = match index % 4 {
            0 => 1 + next() % 600,
            1 => 4096,
            2 => 1 + next() % (20 << 10),
            _ => 1 + next() % (70 << 10),
        };
        let data: Vec<u8> = (0..length).map(|_| next() as u8).collect();
        let header = RequestHeader {
            flags: 0,
            command: CMD_WRITE,
            handle: index,
            offset,
            length,
        };
        burst.extend_from_slice(&header.encode());
        burst.extend_from_slice(&data);
        if index % 16 == 15 {
            let flush = RequestHeader {
                flags: 0,
                command: CMD_FLUSH,
                handle: 1000 + index,
                offset: 0,
                length: 0,
            };
            burst.extend_from_slice(&flush.encode());
        }
        ranges.push((offset, data));
        offset += length + next() % 3000;
    }
    client.stream.write_all(&burst).unwrap();
    let mut answered = std::collections::HashSet::new();
    for _ in 0..64 + 4 {
        let (error, handle) = client.simple_reply();
        assert_eq!(error, 0, "request {handle} failed");
        assert!(
            handle < 64 || (1000..1064).contains(&handle),
            "reply for a handle never sent: {handle:#x}"
        );
        assert!(answered.insert(handle), "two replies for {handle}");
    }
    let mut burst = Vec::new();
    for (index, (offset, data)) in ranges.iter().enumerate() {
        let header = RequestHeader {
            flags: 0,
            command: CMD_READ,
            handle: index as u64,
            offset: *offset,
            length: data.len() as u64,
        };
        burst.extend_from_slice(&header.encode());
    }
    client.stream.write_all(&burst).unwrap();
    for _ in 0..ranges.len() {
        let (error, handle) = client.simple_reply();
        assert_eq!(error, 0, "read {handle} failed");
        let (offset, data) = &ranges[handle as usize];
        let payload = client.read_bytes(data.len());
        assert!(
            payload == *data,
            "read {handle} ({} bytes at {offset}) returned other bytes",
            data.len()
        );
        let mut held = vec![0u8; data.len()];
        export.read(*offset, &mut held).unwrap();
        assert!(held == *data, "the export holds other bytes at {offset}");
    }
    assert_still_serving(&server);
}

#[test]
fn a_client_that_stops_reading_does_not_hold_up_other_clients_reads_that_miss() {
    // Goal: a READ that misses over an upstream is started and ended by the upstream's reply
    // thread, which sends the reply itself only when that cannot wait for the client; so a
    // client that stops reading its replies must never stall that thread, or every other
    // client's misses would wait behind it. Method: the cache's device is an NBD client of a
    // second (memory) server. A raw client asks for 8 MiB of uncached data in eight 1 MiB
    // READs and reads nothing; another client then reads 64 other uncached blocks, which must
    // all come back within seconds. Then the stalled client asks for one of those (now
    // cached) blocks and the other client rewrites it, which must not wait for the stalled
    // client either. Finally the stalled client reads its nine replies, in whatever order
    // they come: each must carry its own range's data.
    const MIB: u64 = 1 << 20;
    let (upstream, upstream_export) = memory_server(32 * MIB);
    let contents = pattern_bytes(32 * MIB as usize, 3);
    upstream_export
        .write(0, &contents, false)
        .expect("fill the upstream");
    let device: Arc<dyn bufcache::Device> =
        Arc::new(NbdClient::connect(&upstream.tcp_uri("mem")).expect("upstream client"));
    let cache = bufcache_host::system_cache(bufcache::CacheConfig {
        memory_bytes_max: 64 << 20,
        readahead_bytes_max: 0,
        ..bufcache::CacheConfig::default()
    })
    .expect("valid config");
    let object = cache
        .open_object(bufcache::ObjectConfig::new("disk", device))
        .expect("open object");
    let export: Arc<dyn Export> = Arc::new(bufcache_export::CacheExport::new(object));
    let server = start_server_with(
        vec![("disk", export)],
        ServerConfig {
            request_size_max: 4 << 20,
            ..ServerConfig::default()
        },
    );

    let (mut stalled, _) = RawClient::open(&server, "disk", false);
    for index in 0..8u64 {
        let header = RequestHeader {
            flags: 0,
            command: CMD_READ,
            handle: index,
            offset: index * MIB,
            length: MIB,
        };
        stalled.stream.write_all(&header.encode()).unwrap();
    }
    std::thread::sleep(Duration::from_millis(300));

    let other = NbdClient::connect(&server.tcp_uri("disk")).expect("second client");
    let started = Instant::now();
    for index in 0..64u64 {
        let offset = 16 * MIB + index * 64 * 1024;
        let mut block = vec![0u8; 4096];
        other
            .read(offset, &mut block)
            .expect("read a missing block");
        assert!(block == contents[offset as usize..offset as usize + 4096]);
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "another client's misses waited {:?} behind a client that stopped reading",
        started.elapsed()
    );

    // The stalled client now also asks for a block the other client made cached: that reply
    // goes out from the cache's buffers behind the stalled replies, and a writer of the block
    // must still not wait for the stalled client.
    let cached_offset = 16 * MIB;
    let header = RequestHeader {
        flags: 0,
        command: CMD_READ,
        handle: 100,
        offset: cached_offset,
        length: 4096,
    };
    stalled.stream.write_all(&header.encode()).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    other
        .write(cached_offset, &[0xAB; 4096])
        .expect("rewrite a block the stalled client is being sent");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "a writer waited {:?} for a client that stopped reading",
        started.elapsed()
    );

    let mut seen = [false; 8];
    for _ in 0..9 {
        let (error, handle) = stalled.simple_reply();
        assert_eq!(error, 0, "READ {handle} succeeds");
        if handle == 100 {
            let data = stalled.read_bytes(4096);
            let start = cached_offset as usize;
            assert!(
                data == contents[start..start + 4096],
                "the cached block as it was"
            );
            continue;
        }
        let data = stalled.read_bytes(MIB as usize);
        let start = (handle * MIB) as usize;
        assert!(
            data == contents[start..start + MIB as usize],
            "READ {handle} carries its own range"
        );
        assert!(!std::mem::replace(&mut seen[handle as usize], true));
    }
}
