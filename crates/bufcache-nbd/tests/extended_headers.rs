//! Goal: extended headers (`NBD_OPT_EXTENDED_HEADERS`) work both ways: qemu 10's client
//! negotiates them with our server and sends 64-bit requests; a hand-written probe with TRIM,
//! WRITE_ZEROES and BLOCK_STATUS lengths beyond 4 GiB on a large sparse export gets the same
//! answers from bufcache as from qemu-nbd; block status payload filtering answers only the
//! contexts asked for; and bufcache's own client, as an upstream, uses them (one 6 GiB TRIM is
//! one request). Method: a cache over a 16 GiB sparse memory device behind our server, raw
//! 32-byte requests, qemu-io with its NBD trace events, qemu-nbd with its own.

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use bufcache::MemoryDevice;
use bufcache_nbd::protocol::*;
use bufcache_nbd::NbdClient;
use common::raw::*;
use common::*;

const GIB: u64 = 1 << 30;
const SIZE: u64 = 16 * GIB;
const FOUR_GIB: u64 = 4 * GIB;

/// Our server over a cache of a 16 GiB sparse memory device, as export "".
fn large_cached_server() -> TestServer {
    cached_server(Arc::new(MemoryDevice::new(SIZE))).0
}

/// An extended-headers connection with base:allocation selected: (connection, context id,
/// transmission flags).
fn open_extended(socket: &Path) -> (Raw, u32, u16) {
    let mut raw = Raw::modern(socket);
    assert_eq!(raw.extended_headers().map(reply_name), Ok("ACK".into()));
    let (reply, contexts) = raw
        .meta_context(OPT_SET_META_CONTEXT, "", &[BASE_ALLOCATION])
        .unwrap();
    assert_eq!((reply, contexts.len()), (REP_ACK, 1));
    let flags = raw.go("");
    (raw, contexts[0].0, flags)
}

/// The 64-bit probe: what each step answered, one line each, for comparing servers.
fn probe_64_bit_lengths(socket: &Path) -> Vec<String> {
    let (mut raw, context, _flags) = open_extended(socket);
    let mut said = Vec::new();
    let mut step = |name: &str,
                    raw: &mut Raw,
                    flags: u16,
                    command: u16,
                    offset: u64,
                    length: u64,
                    payload: &[u8]| {
        let answer = raw
            .request(flags, command, offset, length, payload)
            .unwrap();
        assert!(
            !answer.simple,
            "{name}: no simple replies with extended headers"
        );
        assert!(
            answer.offsets_echoed,
            "{name}: every chunk echoes the request's offset"
        );
        said.push(format!("{name}: {}", errno_name(answer.error)));
        answer
    };
    step(
        "write 64K at 0",
        &mut raw,
        CMD_FLAG_PAYLOAD_LEN,
        CMD_WRITE,
        0,
        65536,
        &[0xab; 65536],
    );
    step(
        "write 64K at 10G",
        &mut raw,
        CMD_FLAG_PAYLOAD_LEN,
        CMD_WRITE,
        10 * GIB,
        65536,
        &[0xcd; 65536],
    );
    let map = step(
        "block status 16G",
        &mut raw,
        0,
        CMD_BLOCK_STATUS,
        0,
        SIZE,
        &[],
    );
    assert_eq!(map.kinds(), vec![REPLY_TYPE_BLOCK_STATUS_EXT]);
    let status = map.status();
    assert_eq!(status[0].0, context);
    let descriptors = &status[0].1;
    assert_eq!(descriptors[0], (65536, 0), "the data written at 0");
    assert!(
        descriptors
            .iter()
            .any(|&(length, flags)| length > FOUR_GIB && flags & 1 != 0),
        "a hole longer than 4 GiB in one descriptor: {descriptors:?}"
    );
    step("trim 6G at 1G", &mut raw, 0, CMD_TRIM, GIB, 6 * GIB, &[]);
    step(
        "zero 6G at 1G",
        &mut raw,
        0,
        CMD_WRITE_ZEROES,
        GIB,
        6 * GIB,
        &[],
    );
    step(
        "zero 5G at 10G-64K",
        &mut raw,
        0,
        CMD_WRITE_ZEROES,
        10 * GIB - 65536,
        5 * GIB,
        &[],
    );
    let one = step(
        "block status 12G at 64K, req one",
        &mut raw,
        CMD_FLAG_REQ_ONE,
        CMD_BLOCK_STATUS,
        65536,
        12 * GIB,
        &[],
    );
    let (length, _) = one.status()[0].1[0];
    assert_eq!(one.status()[0].1.len(), 1);
    assert!(
        length > FOUR_GIB && length <= 12 * GIB,
        "one long descriptor, cut to the request: {length}"
    );
    let read = step("read 64K at 0", &mut raw, 0, CMD_READ, 0, 65536, &[]);
    assert_eq!(read.data, vec![0xab; 65536]);
    let zeroed = step(
        "read 64K at 10G",
        &mut raw,
        0,
        CMD_READ,
        10 * GIB,
        65536,
        &[],
    );
    assert_eq!(
        zeroed.data,
        vec![0; 65536],
        "zeroed over the data written there"
    );
    step("read 64M", &mut raw, 0, CMD_READ, 0, 64 << 20, &[]);
    step(
        "trim past the end",
        &mut raw,
        0,
        CMD_TRIM,
        SIZE - GIB,
        2 * GIB,
        &[],
    );
    step(
        "block status of 0 bytes",
        &mut raw,
        0,
        CMD_BLOCK_STATUS,
        0,
        0,
        &[],
    );
    step("flush", &mut raw, 0, CMD_FLUSH, 0, 0, &[]);
    said
}

#[test]
fn trim_zero_and_block_status_beyond_4_gib_answer_like_qemu_nbd() {
    let server = large_cached_server();
    let ours = probe_64_bit_lengths(&server.socket_path);
    let expected = [
        "write 64K at 0: ok",
        "write 64K at 10G: ok",
        "block status 16G: ok",
        "trim 6G at 1G: ok",
        "zero 6G at 1G: ok",
        "zero 5G at 10G-64K: ok",
        "block status 12G at 64K, req one: ok",
        "read 64K at 0: ok",
        "read 64K at 10G: ok",
        "read 64M: EINVAL",
        "trim past the end: EINVAL",
        "block status of 0 bytes: EINVAL",
        "flush: ok",
    ];
    assert_eq!(ours, expected);
    if let Some(qemu) = QemuNbd::start(SIZE, &[]) {
        let theirs = probe_64_bit_lengths(&qemu.socket_path);
        assert_eq!(theirs, ours, "qemu-nbd answers every step alike");
    }
}

#[test]
fn extended_header_rules_hold() {
    let server = large_cached_server();
    // Structured replies cannot follow extended headers; EXPORT_NAME may not either.
    let mut raw = Raw::modern(&server.socket_path);
    assert_eq!(raw.extended_headers(), Ok(REP_ACK));
    assert_eq!(
        raw.structured().map(reply_name),
        Ok("ERR_EXT_HEADER_REQD".into())
    );
    assert!(raw.export_name("", true).is_err(), "EXPORT_NAME closes");
    // Extended data on the option is refused.
    let mut raw = Raw::modern(&server.socket_path);
    assert_eq!(
        raw.option_final(OPT_EXTENDED_HEADERS, b"x").map(reply_name),
        Ok("ERR_INVALID".into())
    );
    let (mut raw, context, flags) = open_extended(&server.socket_path);
    assert_ne!(flags & TRANSMIT_BLOCK_STATUS_PAYLOAD, 0);
    // BLOCK_STATUS with a payload: an effect length and the contexts to answer.
    let mut payload = (8 * GIB).to_be_bytes().to_vec();
    payload.extend_from_slice(&context.to_be_bytes());
    let answer = raw
        .request(
            CMD_FLAG_PAYLOAD_LEN,
            CMD_BLOCK_STATUS,
            0,
            payload.len() as u64,
            &payload,
        )
        .unwrap();
    assert_eq!(errno_name(answer.error), "ok");
    assert_eq!(answer.status()[0].0, context);
    assert_eq!(
        answer.status()[0].1,
        vec![(8 * GIB, 3)],
        "the effect length, not the payload's"
    );
    for bad in [
        [payload.clone(), context.to_be_bytes().to_vec()].concat(),
        [&payload[..8], &99u32.to_be_bytes()].concat(),
        payload[..8].to_vec(),
    ] {
        let answer = raw
            .request(
                CMD_FLAG_PAYLOAD_LEN,
                CMD_BLOCK_STATUS,
                0,
                bad.len() as u64,
                &bad,
            )
            .unwrap();
        assert_eq!(errno_name(answer.error), "EINVAL", "payload {bad:?}");
    }
    // A payload on a command without a payload form is read and refused; the stream holds.
    let answer = raw
        .request(CMD_FLAG_PAYLOAD_LEN, CMD_TRIM, 0, 16, &[7; 16])
        .unwrap();
    assert_eq!(errno_name(answer.error), "EINVAL");
    // qemu's client sends WRITE without PAYLOAD_LEN; its length is the payload's anyway.
    assert_eq!(raw.request(0, CMD_WRITE, 512, 3, b"abc").unwrap().error, 0);
    let read = raw.request(0, CMD_READ, 512, 3, &[]).unwrap();
    assert_eq!((read.error, read.data.as_slice()), (0, &b"abc"[..]));
    // A compact header after extended headers were agreed: the stream cannot be trusted.
    raw.extended = false;
    raw.send_request(0, CMD_READ, 0, 512, &[]);
    raw.send(&[0; 4]);
    assert!(raw.is_closed_by_server());
}

/// Stdout and stderr (where qemu's `--trace` events go) of a command that must succeed.
fn traced(command: &mut Command) -> String {
    let output = run_ok(command);
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

#[test]
fn qemu_negotiates_extended_headers_and_asks_64_bit_block_status() {
    if !tools(&["qemu-io", "qemu-img"]) {
        return;
    }
    let server = large_cached_server();
    let uri = server.unix_uri("");
    let trace = traced(Command::new("qemu-io").args([
        "--trace",
        "nbd_*",
        "-f",
        "raw",
        "-c",
        "write -P 0xab 0 64k",
        "-c",
        "read -P 0xab 0 64k",
        &uri,
    ]));
    assert!(
        trace.contains("Received option reply 11 (extended headers), type 1 (ack)"),
        "qemu asked for extended headers and we agreed:\n{trace}"
    );
    assert!(!trace.contains("failed"), "{trace}");
    let map = traced(Command::new("qemu-img").args([
        "--trace",
        "nbd_send_request",
        "map",
        "--output=json",
        &uri,
    ]));
    let block_status =
        format!(".len = {SIZE}, .cookie = 1, .flags = 0x8, .type = 7 (block status)");
    assert!(
        map.contains(&block_status),
        "a 16 GiB BLOCK_STATUS went out in one request:\n{map}"
    );
    assert!(
        map.contains("\"start\": 0, \"length\": 65536, ") && map.contains("\"data\": true"),
        "the dirty 64 KiB is data:\n{map}"
    );
    assert!(
        map.contains(&format!("\"start\": 65536, \"length\": {}, ", SIZE - 65536)),
        "the rest one hole:\n{map}"
    );
    let info = run_ok(Command::new("qemu-img").args(["info", &uri]));
    assert!(String::from_utf8_lossy(&info.stdout).contains("virtual size: 16 GiB"));
}

#[test]
fn our_client_uses_extended_headers_upstream() {
    // Against our own server.
    let server = large_cached_server();
    let client = NbdClient::connect(&server.unix_uri("")).expect("connect");
    assert!(client.export_info().extended_headers);
    client.write(10 * GIB, &[1; 4096]).unwrap();
    client.zero(GIB, 9 * GIB, true).unwrap();
    let map = client.block_status(0, SIZE).unwrap();
    assert!(
        map.len() >= 2 && map[0].hole && map[0].length == 10 * GIB,
        "{map:?}"
    );
    let mut back = [9u8; 4096];
    client.read(10 * GIB, &mut back).unwrap();
    assert_eq!(back, [1; 4096]);
    // Against qemu-nbd, whose trace shows each request as it arrived: one TRIM of 6 GiB.
    let Some(qemu_nbd) = tool("qemu-nbd") else {
        return;
    };
    let directory = tempfile::tempdir().unwrap();
    let image = directory.path().join("big.img");
    std::fs::File::create(&image)
        .and_then(|file| file.set_len(SIZE))
        .unwrap();
    let socket = directory.path().join("q.sock");
    let trace_file = directory.path().join("trace.txt");
    let mut child = Command::new(qemu_nbd)
        .arg("--socket")
        .arg(&socket)
        .args([
            "--format=raw",
            "--persistent",
            "--trace",
            "nbd_receive_request",
        ])
        .arg(&image)
        .stderr(std::fs::File::create(&trace_file).unwrap())
        .spawn()
        .unwrap();
    while !socket.exists() {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let client = NbdClient::connect(&format!("nbd+unix:///?socket={}", socket.display()))
        .expect("connect to qemu-nbd");
    assert!(client.export_info().extended_headers, "qemu-nbd agreed");
    client.trim(GIB, 6 * GIB).unwrap();
    client.zero(8 * GIB, 5 * GIB, false).unwrap();
    let map = client.block_status(0, SIZE).unwrap();
    assert_eq!(map.iter().map(|extent| extent.length).sum::<u64>(), SIZE);
    client.disconnect();
    let _ = child.kill();
    let _ = child.wait();
    let trace = std::fs::read_to_string(&trace_file).unwrap();
    for (kind, offset, length) in [(4, GIB, 6 * GIB), (6, 8 * GIB, 5 * GIB), (7, 0, SIZE)] {
        let line = format!(".type = {kind:#x}, from = {offset}, len = {length} }}");
        assert!(trace.contains(&line), "{line} in:\n{trace}");
    }
    assert!(
        trace.contains("magic = 0x21e41c71"),
        "extended requests:\n{trace}"
    );
}
