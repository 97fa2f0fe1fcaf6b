//! A server that dies or misbehaves in the middle of a reply fails the client's request with
//! an error instead of leaving the caller waiting forever (found by the fuzz smoke run).
//!
//! Method: a minimal fake fixed-newstyle server on a unix socket negotiates simple replies,
//! answers one READ with a header and a truncated payload, then closes; the client's read must
//! return an error within a bounded time, and so must every later request.

use std::io::{Read, Write};
use std::os::unix::net::UnixListener;
use std::time::{Duration, Instant};

use bufcache_nbd::NbdClient;

const OPTION_MAGIC: u64 = 0x4948_4156_454F_5054; // "IHAVEOPT"
const REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const OPTION_GO: u32 = 7;
const REPLY_ACK: u32 = 1;
const REPLY_INFO: u32 = 3;
const REPLY_ERROR_UNSUPPORTED: u32 = 0x8000_0001;
const EXPORT_BYTES: u64 = 1 << 20;

fn option_reply(stream: &mut impl Write, option: u32, reply: u32, data: &[u8]) {
    let mut bytes = Vec::new();
    bytes.extend_from_slice(&REPLY_MAGIC.to_be_bytes());
    bytes.extend_from_slice(&option.to_be_bytes());
    bytes.extend_from_slice(&reply.to_be_bytes());
    bytes.extend_from_slice(&(data.len() as u32).to_be_bytes());
    bytes.extend_from_slice(data);
    stream.write_all(&bytes).unwrap();
}

/// Serves one connection: handshake, then `answer` for the first request.
fn fake_server(
    listener: UnixListener,
    answer: impl FnOnce(&mut std::os::unix::net::UnixStream, u64, u32),
) {
    let (mut stream, _) = listener.accept().unwrap();
    stream.write_all(b"NBDMAGICIHAVEOPT").unwrap();
    stream.write_all(&3u16.to_be_bytes()).unwrap(); // FIXED_NEWSTYLE | NO_ZEROES
    let mut client_flags = [0u8; 4];
    stream.read_exact(&mut client_flags).unwrap();
    loop {
        let mut header = [0u8; 16];
        stream.read_exact(&mut header).unwrap();
        assert_eq!(
            u64::from_be_bytes(header[..8].try_into().unwrap()),
            OPTION_MAGIC
        );
        let option = u32::from_be_bytes(header[8..12].try_into().unwrap());
        let length = u32::from_be_bytes(header[12..16].try_into().unwrap());
        let mut data = vec![0u8; length as usize];
        stream.read_exact(&mut data).unwrap();
        if option != OPTION_GO {
            option_reply(&mut stream, option, REPLY_ERROR_UNSUPPORTED, &[]);
            continue;
        }
        let mut info = vec![0u8, 0u8]; // NBD_INFO_EXPORT
        info.extend_from_slice(&EXPORT_BYTES.to_be_bytes());
        info.extend_from_slice(&1u16.to_be_bytes()); // HAS_FLAGS
        option_reply(&mut stream, option, REPLY_INFO, &info);
        option_reply(&mut stream, option, REPLY_ACK, &[]);
        break;
    }
    let mut request = [0u8; 28];
    stream.read_exact(&mut request).unwrap();
    let handle = u64::from_be_bytes(request[8..16].try_into().unwrap());
    let length = u32::from_be_bytes(request[24..28].try_into().unwrap());
    answer(&mut stream, handle, length);
}

fn read_fails_within_bounded_time(
    answer: impl FnOnce(&mut std::os::unix::net::UnixStream, u64, u32) + Send + 'static,
) {
    let directory = tempfile::tempdir().unwrap();
    let socket = directory.path().join("fake.sock");
    let listener = UnixListener::bind(&socket).unwrap();
    let server = std::thread::spawn(move || fake_server(listener, answer));
    let client = NbdClient::connect(&format!("nbd+unix:///?socket={}", socket.display()))
        .expect("handshake");
    let (sender, receiver) = std::sync::mpsc::channel();
    let started = Instant::now();
    std::thread::spawn(move || {
        let mut buffer = vec![0u8; 512];
        let first = client.read(0, &mut buffer).map(|_| ());
        let later = client.read(0, &mut buffer).map(|_| ());
        let _ = sender.send((first, later));
    });
    let (first, later) = receiver
        .recv_timeout(Duration::from_secs(20))
        .expect("the client's read returned instead of waiting forever");
    assert!(first.is_err(), "a broken reply is an error");
    assert!(
        later.is_err(),
        "requests after the connection died fail too"
    );
    assert!(started.elapsed() < Duration::from_secs(20));
    server.join().unwrap();
}

#[test]
fn a_read_reply_cut_off_mid_payload_fails_the_read() {
    read_fails_within_bounded_time(|stream, handle, length| {
        let mut reply = Vec::new();
        reply.extend_from_slice(&0x6744_6698u32.to_be_bytes());
        reply.extend_from_slice(&0u32.to_be_bytes());
        reply.extend_from_slice(&handle.to_be_bytes());
        reply.extend(std::iter::repeat_n(0x11u8, (length / 5) as usize));
        stream.write_all(&reply).unwrap();
    });
}

#[test]
fn a_connection_closed_before_the_reply_fails_the_read() {
    read_fails_within_bounded_time(|_, _, _| {});
}
