//! The NBD targets, through real sockets.
//!
//! The server's handshake and transmission code takes bufcache-nbd's private `Stream` (a TCP
//! or unix socket), and no public function runs a connection over a generic `Read + Write`,
//! so the targets go through the public API: one [`Server`] per process, listening on a unix
//! socket in a private temporary directory, and one fresh connection per input. The client
//! target does the reverse: a fake server on a second socket sends the input to a real
//! [`NbdClient`].
//!
//! A panic in any server or client thread is a finding: libFuzzer and the smoke runner both
//! abort the process on every panic, whichever thread it is in.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use bufcache_nbd::protocol::*;
use bufcache_nbd::{
    Export, ListenAddress, MemoryExport, NbdClient, Server, ServerConfig, ShutdownHandle,
};

use crate::seeds::{
    self, EXPORT_NAME, MODE_EXPORT_NAME, MODE_EXTENDED, MODE_MASK, MODE_READ_ONLY, MODE_STRUCTURED,
};

/// Size of both exports.
const EXPORT_BYTES: u64 = 64 << 10;
/// The server's smallest allowed maximum request size, so oversized requests are cheap.
const REQUEST_SIZE_MAX: u32 = 4096;
/// A write up to this size is skipped and refused; above it the server closes.
const WRITE_SKIP_MAX: u32 = 4 * REQUEST_SIZE_MAX;
/// Longest an exchange may take before it counts as a hang.
const IO_TIMEOUT: Duration = Duration::from_secs(10);
const GREETING_BYTES: usize = 18;

struct Harness {
    directory: PathBuf,
    server_socket: PathBuf,
    shutdown: ShutdownHandle,
    server_thread: Mutex<Option<JoinHandle<()>>>,
    fake_server: UnixListener,
    client_uri: String,
}

static HARNESS: OnceLock<Harness> = OnceLock::new();

fn harness() -> &'static Harness {
    HARNESS.get_or_init(|| {
        // A peer that hangs up must cost an EPIPE error, not the process: libFuzzer's C main
        // does not ignore SIGPIPE the way a Rust main does.
        // SAFETY: installing SIG_IGN for SIGPIPE has no preconditions.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_IGN);
        }
        let directory = std::env::temp_dir().join(format!("bufcache-fuzz-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&directory);
        std::fs::create_dir_all(&directory).expect("create the fuzz socket directory");
        let server_socket = directory.join("server.sock");
        let config = ServerConfig {
            listen: vec![ListenAddress::Unix(server_socket.clone())],
            request_size_max: REQUEST_SIZE_MAX,
            inflight_bytes_max: 4 * u64::from(REQUEST_SIZE_MAX),
            workers_per_connection_max: 2,
            connections_max: 65536,
            handshake_timeout: IO_TIMEOUT,
            ..ServerConfig::default()
        };
        let exports: Vec<(String, Arc<dyn Export>)> = vec![
            (
                EXPORT_NAME.into(),
                Arc::new(MemoryExport::new(EXPORT_BYTES).with_description("fuzz disk")),
            ),
            (
                seeds::READ_ONLY_EXPORT_NAME.into(),
                Arc::new(MemoryExport::new(EXPORT_BYTES).with_read_only(true)),
            ),
        ];
        let bound = Server::new(config, exports)
            .expect("valid server configuration")
            .bind()
            .expect("bind the fuzz server socket");
        let shutdown = ShutdownHandle::new();
        let run_shutdown = shutdown.clone();
        let server_thread = std::thread::Builder::new()
            .name("fuzz-nbd-server".into())
            .spawn(move || bound.run(run_shutdown).expect("the fuzz server runs"))
            .expect("spawn the server thread");
        let fake_socket = directory.join("fake-server.sock");
        let fake_server = UnixListener::bind(&fake_socket).expect("bind the fake server");
        let client_uri = format!("nbd+unix:///{EXPORT_NAME}?socket={}", fake_socket.display());
        Harness {
            directory,
            server_socket,
            shutdown,
            server_thread: Mutex::new(Some(server_thread)),
            fake_server,
            client_uri,
        }
    })
}

pub(crate) fn cleanup() {
    if let Some(harness) = HARNESS.get() {
        harness.shutdown.trigger();
        if let Some(thread) = harness.server_thread.lock().unwrap().take() {
            let _ = thread.join();
        }
        let _ = std::fs::remove_dir_all(&harness.directory);
    }
}

/// Sends `input` to the server on a fresh connection, half-closes, and returns everything
/// the server sent until it closed the connection.
fn exchange(input: &[u8]) -> Vec<u8> {
    let harness = harness();
    let mut stream = UnixStream::connect(&harness.server_socket).expect("connect to the server");
    stream.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    stream.set_write_timeout(Some(IO_TIMEOUT)).unwrap();
    let mut writer = stream.try_clone().expect("clone the client socket");
    std::thread::scope(|scope| {
        // Written from a second thread: replies may fill the socket before the input is sent.
        scope.spawn(move || {
            // The server may close first (a fatal protocol error): EPIPE is expected then.
            let _ = writer.write_all(input);
            let _ = writer.shutdown(Shutdown::Write);
        });
        let mut output = Vec::new();
        match stream.read_to_end(&mut output) {
            Ok(_) => {}
            Err(error) if error.kind() == io::ErrorKind::ConnectionReset => {}
            Err(error) => panic!(
                "the server did not close the connection within {IO_TIMEOUT:?} of the input's \
                 end ({error}); it had sent {} bytes",
                output.len()
            ),
        }
        output
    })
}

fn check_greeting(output: &[u8]) {
    assert!(
        output.len() >= GREETING_BYTES,
        "the server sent {} bytes, not its greeting",
        output.len()
    );
    assert_eq!(be_u64(&output[0..8]), INIT_MAGIC);
    assert_eq!(be_u64(&output[8..16]), OPTION_MAGIC);
}

/// Walks the option replies at the start of `output`; returns the bytes after them and the
/// (option, reply type) of each. Every reply the server starts must be whole.
fn option_replies(mut output: &[u8], stop_after_go_ack: bool) -> (&[u8], Vec<(u32, u32)>) {
    let mut replies = Vec::new();
    while output.len() >= 8 && be_u64(output) == OPTION_REPLY_MAGIC {
        assert!(
            output.len() >= OPTION_REPLY_HEADER_BYTES,
            "option reply header cut short: {} bytes",
            output.len()
        );
        let option = be_u32(&output[8..12]);
        let reply_type = be_u32(&output[12..16]);
        let length = be_u32(&output[16..20]) as usize;
        let rest = &output[OPTION_REPLY_HEADER_BYTES..];
        assert!(
            rest.len() >= length,
            "option reply of {length} bytes cut short at {}",
            rest.len()
        );
        output = &rest[length..];
        replies.push((option, reply_type));
        if stop_after_go_ack && option == OPT_GO && reply_type == REP_ACK {
            break;
        }
    }
    (output, replies)
}

/// Any client bytes after the greeting: nothing panics or hangs, the greeting comes first,
/// and option replies are never cut short.
pub fn nbd_handshake(data: &[u8]) {
    let output = exchange(data);
    check_greeting(&output);
    let (rest, options) = option_replies(&output[GREETING_BYTES..], true);
    debug!("handshake: options {options:?}, then {} bytes", rest.len());
}

/// A request the server will answer, as the server frames the input.
#[derive(Clone, Copy, Debug)]
struct Sent {
    command: u16,
    handle: u64,
    offset: u64,
    length: u64,
}

/// Splits the transmission input into the requests the server reads whole, stopping where
/// the server stops (short header, bad magic, DISC, a payload too large to skip). With
/// `extended` headers are 32 bytes, and a payload follows a WRITE or any request with
/// `CMD_FLAG_PAYLOAD_LEN`.
fn frame_requests(mut bytes: &[u8], extended: bool) -> Vec<Sent> {
    let header_bytes = if extended {
        EXTENDED_REQUEST_HEADER_BYTES
    } else {
        REQUEST_HEADER_BYTES
    };
    let mut sent = Vec::new();
    while bytes.len() >= header_bytes {
        let header = if extended {
            RequestHeader::decode_extended(bytes[..header_bytes].try_into().unwrap())
        } else {
            RequestHeader::decode(bytes[..header_bytes].try_into().unwrap())
        };
        let Some(header) = header else {
            break;
        };
        bytes = &bytes[header_bytes..];
        if header.command == CMD_DISC {
            break;
        }
        let payload =
            header.command == CMD_WRITE || (extended && header.flags & CMD_FLAG_PAYLOAD_LEN != 0);
        if payload {
            if header.length > u64::from(WRITE_SKIP_MAX) || header.length > bytes.len() as u64 {
                break;
            }
            bytes = &bytes[header.length as usize..];
        }
        sent.push(Sent {
            command: header.command,
            handle: header.handle,
            offset: header.offset,
            length: header.length,
        });
    }
    sent
}

/// The content chunks (data and holes) of the READ replies being walked: each must lie
/// inside its request, and a READ answered without an error chunk must be covered whole.
#[derive(Default)]
struct ContentChunks {
    /// Bytes covered so far, and whether an error chunk came, per handle.
    covered: HashMap<u64, (u64, bool)>,
}

impl ContentChunks {
    fn record(&mut self, request: &Sent, chunk_type: u16, payload: &[u8], flags: u16) {
        let entry = self.covered.entry(request.handle).or_default();
        let (start, length) = match chunk_type {
            REPLY_TYPE_OFFSET_DATA => {
                assert!(payload.len() > 8, "a data chunk of {} bytes", payload.len());
                (be_u64(payload), payload.len() as u64 - 8)
            }
            REPLY_TYPE_OFFSET_HOLE => {
                assert_eq!(payload.len(), 12, "a hole chunk's length");
                let size = u64::from(be_u32(&payload[8..]));
                assert!(size > 0, "an empty hole chunk");
                (be_u64(payload), size)
            }
            kind if kind & (1 << 15) != 0 => {
                entry.1 = true;
                (0, 0)
            }
            _ => (0, 0),
        };
        if length > 0 {
            assert_eq!(request.command, CMD_READ, "content chunk for {request:?}");
            assert!(
                start >= request.offset && start + length <= request.offset + request.length,
                "content chunk {start}+{length} outside {request:?}"
            );
            entry.0 += length;
        }
        if flags & REPLY_FLAG_DONE != 0 {
            let (covered, errored) = self.covered.remove(&request.handle).unwrap_or_default();
            if request.command == CMD_READ && !errored {
                assert_eq!(covered, request.length, "a READ's chunks cover it whole");
            }
        }
    }
}

/// Requests after a fixed handshake (first byte: `seeds::MODE_*` bits). Besides no panic or
/// hang: the handshake succeeds, every request the server read whole gets exactly one
/// final reply, replies are well framed, and successful reads return the length asked for.
pub fn nbd_requests(data: &[u8]) {
    let Some((&mode, requests)) = data.split_first() else {
        return;
    };
    let mut mode = mode & MODE_MASK;
    let extended = mode & MODE_EXTENDED != 0;
    if extended {
        // A client that agreed to extended headers may not use EXPORT_NAME (the server
        // closes); the handshake seeds cover that.
        mode &= !MODE_EXPORT_NAME;
    }
    let structured = mode & MODE_STRUCTURED != 0 || extended;
    let mut input = seeds::preamble(mode);
    input.extend_from_slice(requests);
    let output = exchange(&input);
    check_greeting(&output);
    let (mut replies, options) = option_replies(&output[GREETING_BYTES..], true);
    if mode & MODE_EXPORT_NAME != 0 {
        assert!(
            replies.len() >= 10,
            "EXPORT_NAME was not answered (option replies {options:?})"
        );
        replies = &replies[10..];
    } else {
        assert_eq!(
            options.last(),
            Some(&(OPT_GO, REP_ACK)),
            "GO was not acknowledged"
        );
    }
    let sent = frame_requests(requests, extended);
    let mut pending: HashMap<u64, Vec<Sent>> = HashMap::new();
    for request in &sent {
        pending.entry(request.handle).or_default().push(*request);
    }
    let unique_handles = pending.values().all(|requests| requests.len() == 1);
    let mut content = ContentChunks::default();
    let mut answered = 0usize;
    while !replies.is_empty() {
        assert!(
            replies.len() >= 4,
            "reply cut short: {} bytes",
            replies.len()
        );
        let magic = be_u32(replies);
        let (handle, done, consumed) = match magic {
            SIMPLE_REPLY_MAGIC if extended => panic!("a simple reply with extended headers"),
            STRUCTURED_REPLY_MAGIC if extended => {
                panic!("a structured reply with extended headers")
            }
            EXTENDED_REPLY_MAGIC => {
                assert!(extended, "an extended reply that was not negotiated");
                assert!(
                    replies.len() >= EXTENDED_REPLY_HEADER_BYTES,
                    "extended reply header cut short"
                );
                let flags = be_u16(&replies[4..6]);
                let chunk_type = be_u16(&replies[6..8]);
                let handle = be_u64(&replies[8..16]);
                let offset = be_u64(&replies[16..24]);
                let length = be_u64(&replies[24..32]);
                assert!(length <= 1 << 24, "extended chunk of {length} bytes");
                let consumed = EXTENDED_REPLY_HEADER_BYTES + length as usize;
                assert!(replies.len() >= consumed, "extended chunk cut short");
                if unique_handles {
                    let request = pending
                        .get(&handle)
                        .and_then(|requests| requests.first())
                        .unwrap_or_else(|| panic!("chunk for unknown handle {handle}"));
                    assert_eq!(
                        offset, request.offset,
                        "the chunk echoes the request's offset"
                    );
                    let payload = &replies[EXTENDED_REPLY_HEADER_BYTES..consumed];
                    content.record(request, chunk_type, payload, flags);
                    if chunk_type == REPLY_TYPE_BLOCK_STATUS_EXT {
                        let payload = &replies[EXTENDED_REPLY_HEADER_BYTES..consumed];
                        let count = be_u32(&payload[4..8]) as usize;
                        assert_eq!(payload.len(), 8 + 16 * count, "descriptor count");
                        assert!(count > 0, "a status chunk without descriptors");
                    }
                }
                assert_ne!(chunk_type, REPLY_TYPE_BLOCK_STATUS, "a 32-bit status chunk");
                (handle, flags & REPLY_FLAG_DONE != 0, consumed)
            }
            SIMPLE_REPLY_MAGIC => {
                assert!(
                    replies.len() >= SIMPLE_REPLY_HEADER_BYTES,
                    "simple reply cut short"
                );
                let error = be_u32(&replies[4..8]);
                let handle = be_u64(&replies[8..16]);
                let mut consumed = SIMPLE_REPLY_HEADER_BYTES;
                let request = pending
                    .get(&handle)
                    .and_then(|requests| requests.first())
                    .unwrap_or_else(|| panic!("simple reply for unknown handle {handle}"));
                if error == 0 && request.command == CMD_READ {
                    if !unique_handles {
                        // Which request this answers, and so its length, is ambiguous.
                        return;
                    }
                    assert!(
                        !structured,
                        "simple reply with data after structured replies"
                    );
                    consumed += request.length as usize;
                    assert!(replies.len() >= consumed, "read data cut short");
                }
                (handle, true, consumed)
            }
            STRUCTURED_REPLY_MAGIC => {
                assert!(structured, "structured reply that was not negotiated");
                assert!(
                    replies.len() >= STRUCTURED_REPLY_HEADER_BYTES,
                    "structured reply header cut short"
                );
                let flags = be_u16(&replies[4..6]);
                let chunk_type = be_u16(&replies[6..8]);
                let handle = be_u64(&replies[8..16]);
                let length = be_u32(&replies[16..20]) as usize;
                let consumed = STRUCTURED_REPLY_HEADER_BYTES + length;
                assert!(replies.len() >= consumed, "structured chunk cut short");
                if unique_handles {
                    let request = pending
                        .get(&handle)
                        .and_then(|requests| requests.first())
                        .unwrap_or_else(|| panic!("chunk for unknown handle {handle}"));
                    let payload = &replies[STRUCTURED_REPLY_HEADER_BYTES..consumed];
                    content.record(request, chunk_type, payload, flags);
                }
                (handle, flags & REPLY_FLAG_DONE != 0, consumed)
            }
            other => panic!("reply magic {other:#x} after {answered} replies"),
        };
        if done {
            let requests = pending
                .get_mut(&handle)
                .unwrap_or_else(|| panic!("final reply for handle {handle}, which was not sent"));
            assert!(
                !requests.is_empty(),
                "second final reply for handle {handle}"
            );
            requests.remove(0);
            answered += 1;
        }
        replies = &replies[consumed..];
    }
    debug!(
        "requests: mode {mode}, options {options:?}, {} requests, {answered} answered",
        sent.len()
    );
    let unanswered: Vec<&Sent> = pending.values().flatten().collect();
    assert!(
        unanswered.is_empty(),
        "{} of {} requests never answered, e.g. {:?} (read-only: {})",
        unanswered.len(),
        sent.len(),
        unanswered[0],
        mode & MODE_READ_ONLY != 0
    );
}

/// Any server bytes to a real client running a fixed set of requests: nothing panics or
/// hangs, and every failure is an error.
///
/// Input: a little-endian u16 length and that many handshake bytes, sent at once; then
/// units (u16 length, bytes), one sent after each request the client makes, so replies
/// never arrive before their request (which the client rightly treats as a violation).
pub fn nbd_client(data: &[u8]) {
    let harness = harness();
    std::thread::scope(|scope| {
        let fake_server = scope.spawn(|| {
            let (stream, _) = harness.fake_server.accept().expect("accept the client");
            fake_server(stream, data);
        });
        match NbdClient::connect(&harness.client_uri) {
            Ok(client) => {
                exercise_client(&client);
                drop(client);
            }
            Err(error) => {
                debug!("client: connect failed: {error}");
            }
        }
        let start = std::time::Instant::now();
        fake_server.join().expect("the fake server thread");
        assert!(
            start.elapsed() < IO_TIMEOUT,
            "the client did not close its connection"
        );
    });
}

/// How long the fake server waits for the client's next request before it assumes the
/// client waits for it, and sends everything left.
const CLIENT_IDLE: Duration = Duration::from_millis(20);

fn take_unit<'a>(input: &mut &'a [u8]) -> &'a [u8] {
    let length = match input {
        [low, high, ..] => usize::from(u16::from_le_bytes([*low, *high])),
        _ => usize::MAX,
    };
    let bytes = &input[input.len().min(2)..];
    let (unit, rest) = bytes.split_at(length.min(bytes.len()));
    *input = rest;
    unit
}

fn fake_server(mut stream: UnixStream, mut input: &[u8]) {
    stream.set_write_timeout(Some(IO_TIMEOUT)).unwrap();
    stream.set_read_timeout(Some(CLIENT_IDLE)).unwrap();
    let handshake = take_unit(&mut input);
    // The client hangs up when it fails: EPIPE and ECONNRESET are expected all along.
    let mut open = stream.write_all(handshake).is_ok();
    // Skip the client's flags and options, then send one unit per request.
    let mut client_flags = [0u8; 4];
    open = open && stream.read_exact(&mut client_flags).is_ok();
    while open && !input.is_empty() {
        let mut magic = [0u8; 8];
        if stream.read_exact(&mut magic).is_err() {
            break;
        }
        if be_u64(&magic) == OPTION_MAGIC {
            let mut header = [0u8; 8];
            let mut data = Vec::new();
            open = stream.read_exact(&mut header).is_ok()
                && (&mut stream)
                    .take(u64::from(be_u32(&header[4..8])))
                    .read_to_end(&mut data)
                    .is_ok();
            continue;
        }
        // A compact request, or an extended one once the handshake agreed to them.
        let extended = be_u32(&magic) == EXTENDED_REQUEST_MAGIC;
        let header_bytes = if extended {
            EXTENDED_REQUEST_HEADER_BYTES
        } else {
            REQUEST_HEADER_BYTES
        };
        let mut header = magic.to_vec();
        header.resize(header_bytes, 0);
        if !(extended || be_u32(&magic) == REQUEST_MAGIC)
            || stream.read_exact(&mut header[8..]).is_err()
        {
            break;
        }
        let header = if extended {
            RequestHeader::decode_extended(header.as_slice().try_into().unwrap()).unwrap()
        } else {
            RequestHeader::decode(header.as_slice().try_into().unwrap()).unwrap()
        };
        if header.command == CMD_WRITE || header.flags & CMD_FLAG_PAYLOAD_LEN != 0 {
            let mut payload = Vec::new();
            open = (&mut stream)
                .take(header.length)
                .read_to_end(&mut payload)
                .is_ok();
        }
        open = open && stream.write_all(take_unit(&mut input)).is_ok();
    }
    // The client is gone, waits for us, or has all its replies: send what is left.
    let _ = stream.write_all(input);
    let _ = stream.shutdown(Shutdown::Write);
    stream.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    // Until the client hangs up; a client that never does is caught by the caller.
    let _ = io::copy(&mut stream, &mut io::sink());
}

/// The requests the `nbd_client` seeds answer, in handle order 1, 2, ...
fn exercise_client(client: &NbdClient) {
    let info = client.export_info();
    let _ = format!("{info:?} {}", client.size());
    let mut buffer = vec![0u8; 512];
    let read = client.read(0, &mut buffer);
    let write = client.write(0, &[0xa5; 512]);
    let flush = client.flush();
    let status = client.block_status(0, 4096);
    if let Ok(extents) = &status {
        let covered: u64 = extents.iter().map(|extent| extent.length).sum();
        assert!(
            covered <= 4096,
            "block status describes {covered} bytes of 4096"
        );
    }
    let zero = client.zero(0, 4096, true);
    let trim = client.trim(0, 4096);
    debug!("client: {info:?}\n read {read:?}\n write {write:?}\n flush {flush:?}\n status {status:?}\n zero {zero:?}\n trim {trim:?}");
}
