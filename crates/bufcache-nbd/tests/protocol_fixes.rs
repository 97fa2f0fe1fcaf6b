//! Goal: what an outside conformance run found (issue 33) stays fixed: a read-only upstream
//! makes a read-only export; block status over an upstream with a minimum block size is
//! asked aligned; a failed NBD_OPT_SET_META_CONTEXT forgets the earlier selection; plain
//! newstyle clients may enter with NBD_OPT_EXPORT_NAME; TRIM past the end and oversized
//! requests get the errno the spec asks for; a TLS-only export answers NBD_REP_ERR_TLS_REQD
//! before STARTTLS; shutdown is told to negotiating clients and to new requests.
//! Method: real upstreams (nbdkit -r, nbdkit's blocksize-policy filter) under bufcache's
//! client and cache, and raw-socket probes that send exactly the bytes in question. Where the
//! behaviour is the references' too, the same probe runs against qemu-nbd and nbdkit (when
//! installed) and must give the same answer.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bufcache::Device;
use bufcache_nbd::protocol::*;
use bufcache_nbd::{
    Export, ExportPolicy, MemoryExport, NbdClient, ServerConfig, TlsConfig, TlsMode,
};
use common::raw::*;
use common::*;

const SIZE: u64 = 64 << 20;

/// Our server with a 64 MiB memory export named "".
fn memory_default_server() -> TestServer {
    start_server(vec![(
        "",
        Arc::new(MemoryExport::new(SIZE)) as Arc<dyn Export>,
    )])
}

/// Greets as a modern client, with structured replies and base:allocation, and enters "".
fn open_structured(socket: &Path) -> Raw {
    let mut raw = Raw::modern(socket);
    assert_eq!(raw.structured(), Ok(REP_ACK));
    let (reply, contexts) = raw
        .meta_context(OPT_SET_META_CONTEXT, "", &[BASE_ALLOCATION])
        .expect("SET_META_CONTEXT answered");
    assert_eq!((reply, contexts.len()), (REP_ACK, 1));
    raw.go("");
    raw
}

#[test]
fn a_read_only_upstream_is_served_read_only() {
    let Some(upstream) = Nbdkit::start(&["-r", "memory", "64M"]) else {
        return;
    };
    let client = NbdClient::connect(&upstream.uri()).expect("connect upstream");
    assert!(
        client.capabilities().read_only,
        "the client hears READ_ONLY"
    );
    let (server, object) = cached_server(Arc::new(client));
    assert!(object.is_read_only(), "the object over it refuses writes");
    let mut raw = Raw::modern(&server.socket_path);
    let flags = raw.go("");
    assert_ne!(flags & TRANSMIT_READ_ONLY, 0, "READ_ONLY advertised");
    assert_eq!(flags & (TRANSMIT_SEND_TRIM | TRANSMIT_SEND_WRITE_ZEROES), 0);
    let write = raw.request(0, CMD_WRITE, 0, 4, b"data").unwrap();
    assert_eq!(
        errno_name(write.error),
        "EPERM",
        "a write is refused, not cached"
    );
    let flush = raw.request(0, CMD_FLUSH, 0, 0, &[]).unwrap();
    assert_eq!(
        errno_name(flush.error),
        "ok",
        "nothing dirty, nothing to fail"
    );
    let read = raw.request(0, CMD_READ, 0, 4, &[]).unwrap();
    assert_eq!((read.error, read.data), (0, vec![0u8; 4]));
}

#[test]
fn unaligned_block_status_over_an_upstream_with_a_4096_byte_minimum_is_asked_aligned() {
    let Some(upstream) = Nbdkit::start(&[
        "--filter=blocksize-policy",
        "memory",
        "64M",
        "blocksize-minimum=4096",
        "blocksize-error-policy=error",
    ]) else {
        return;
    };
    let direct = NbdClient::connect(&upstream.uri()).expect("connect upstream");
    direct.write(65536, &pattern_bytes(8192, 1)).unwrap();
    // What the upstream says about the aligned range, cut to the unaligned one.
    let (start, end) = (100u64, 100u64 + 80_000);
    let mut expected: Vec<(u64, u64)> = Vec::new();
    let mut position = 0;
    for extent in direct.block_status(0, end.next_multiple_of(4096)).unwrap() {
        let (from, to) = (position.max(start), (position + extent.length).min(end));
        position += extent.length;
        if from < to {
            let flags = if extent.hole { 3 } else { 0 };
            match expected.last_mut() {
                Some(last) if last.1 == flags => last.0 += to - from,
                _ => expected.push((to - from, flags)),
            }
        }
    }
    let client = NbdClient::connect(&upstream.uri()).expect("connect upstream");
    assert_eq!(client.capabilities().alignment_bytes, 4096);
    let (server, _object) = cached_server(Arc::new(client));
    let mut raw = open_structured(&server.socket_path);
    let answer = raw
        .request(0, CMD_BLOCK_STATUS, start, end - start, &[])
        .unwrap();
    assert_eq!(errno_name(answer.error), "ok", "block status succeeds");
    let status = answer.status();
    assert_eq!(status.len(), 1);
    assert_eq!(
        status[0].1, expected,
        "the upstream's map, cut to the range"
    );
    // Unaligned data requests work over it too (the cache reads and writes whole blocks).
    let write = raw.request(0, CMD_WRITE, 9000, 3, b"abc").unwrap();
    assert_eq!(write.error, 0);
    let read = raw.request(0, CMD_READ, 8999, 5, &[]).unwrap();
    assert_eq!((read.error, read.data.as_slice()), (0, &b"\0abc\0"[..]));
}

/// SET_META_CONTEXT for base:allocation, then a failing one (`bad` data), GO, BLOCK_STATUS:
/// the errno (EINVAL: nothing is selected any more).
fn block_status_after_a_failed_set(socket: &Path, bad: &[u8]) -> u32 {
    let mut raw = Raw::modern(socket);
    assert_eq!(raw.structured(), Ok(REP_ACK));
    let (reply, _) = raw
        .meta_context(OPT_SET_META_CONTEXT, "", &[BASE_ALLOCATION])
        .unwrap();
    assert_eq!(reply, REP_ACK);
    let reply = raw.option_final(OPT_SET_META_CONTEXT, bad).unwrap();
    assert!(is_option_error(reply), "the second SET fails ({reply:#x})");
    raw.go("");
    raw.request(0, CMD_BLOCK_STATUS, 0, 4096, &[])
        .unwrap()
        .error
}

#[test]
fn a_failed_set_meta_context_forgets_the_earlier_selection() {
    let unknown_export = meta_context_data("no-such-export", &[BASE_ALLOCATION]);
    let mut malformed = meta_context_data("", &[BASE_ALLOCATION]);
    malformed.truncate(malformed.len() - 3);
    let server = memory_default_server();
    for bad in [&unknown_export, &malformed] {
        let errno = block_status_after_a_failed_set(&server.socket_path, bad);
        assert_eq!(errno_name(errno), "EINVAL");
    }
    // qemu-nbd, the reference the finding names, behaves the same.
    if let Some(qemu) = QemuNbd::start(SIZE, &[]) {
        let errno = block_status_after_a_failed_set(&qemu.socket_path, &unknown_export);
        assert_eq!(errno_name(errno), "EINVAL");
    }
}

/// A plain newstyle client (no FIXED_NEWSTYLE) enters with EXPORT_NAME and reads.
fn plain_newstyle_reads(socket: &Path) -> (u64, u32) {
    let mut raw = Raw::start(socket, 0);
    let (size, _flags) = raw.export_name("", false).expect("EXPORT_NAME accepted");
    let read = raw.request(0, CMD_READ, 0, 512, &[]).unwrap();
    (size, read.error)
}

#[test]
fn plain_newstyle_clients_enter_with_export_name() {
    let server = memory_default_server();
    assert_eq!(plain_newstyle_reads(&server.socket_path), (SIZE, 0));
    // Any other option cannot be answered to such a client: the connection closes.
    let mut other = Raw::start(&server.socket_path, 0);
    other.send(&OPTION_MAGIC.to_be_bytes());
    other.send(&OPT_LIST.to_be_bytes());
    other.send(&0u32.to_be_bytes());
    assert!(other.is_closed_by_server());
    if let Some(nbdkit) = Nbdkit::start(&["memory", "64M"]) {
        assert_eq!(plain_newstyle_reads(&nbdkit.socket_path), (SIZE, 0));
    }
    if let Some(qemu) = QemuNbd::start(SIZE, &[]) {
        assert_eq!(plain_newstyle_reads(&qemu.socket_path), (SIZE, 0));
    }
}

#[test]
fn trim_past_the_end_is_einval_and_only_read_with_df_may_overflow() {
    let server = memory_default_server();
    let mut simple = Raw::modern(&server.socket_path);
    simple.go("");
    let cases: [(u16, u64, u64, usize, &str); 4] = [
        (CMD_TRIM, SIZE, 1, 0, "EINVAL"),
        (CMD_TRIM, SIZE - 512, 4096, 0, "EINVAL"),
        (CMD_READ, 0, 64 << 20, 0, "EINVAL"),
        (CMD_WRITE, 0, (32 << 20) + 1, (32 << 20) + 1, "EINVAL"),
    ];
    for (command, offset, length, payload, expected) in cases {
        let answer = simple
            .request(0, command, offset, length, &vec![0u8; payload])
            .unwrap();
        assert_eq!(
            errno_name(answer.error),
            expected,
            "{} of {length} at {offset}",
            command_name(command)
        );
    }
    let mut structured = open_structured(&server.socket_path);
    let df = structured
        .request(CMD_FLAG_DF, CMD_READ, 0, 64 << 20, &[])
        .unwrap();
    assert_eq!(
        errno_name(df.error),
        "EOVERFLOW",
        "READ with DF may overflow"
    );
    let plain = structured.request(0, CMD_READ, 0, 64 << 20, &[]).unwrap();
    assert_eq!(errno_name(plain.error), "EINVAL");
}

#[test]
fn a_tls_only_export_answers_tls_reqd_before_starttls() {
    let directory = tempfile::tempdir().unwrap();
    let psk = directory.path().join("keys.psk");
    std::fs::write(&psk, "alice:0123456789abcdef0123456789abcdef\n").unwrap();
    let config = ServerConfig {
        tls: TlsConfig {
            mode: TlsMode::On,
            psk_file: Some(psk),
            ..TlsConfig::default()
        },
        export_policies: vec![(
            "secret".into(),
            ExportPolicy {
                identities: vec!["alice".into()],
                read_only: false,
            },
        )],
        ..ServerConfig::default()
    };
    let memory = || Arc::new(MemoryExport::new(1 << 20)) as Arc<dyn Export>;
    let server = start_server_with(vec![("public", memory()), ("secret", memory())], config);
    let mut raw = Raw::modern(&server.socket_path);
    for option in [OPT_INFO, OPT_GO] {
        let (reply, _, _) = raw.go_with(option, "secret", &[]).unwrap();
        assert_eq!(reply_name(reply), "ERR_TLS_REQD");
    }
    let (reply, _, _) = raw.go_with(OPT_INFO, "nope", &[]).unwrap();
    assert_eq!(
        reply_name(reply),
        "ERR_UNKNOWN",
        "unknown exports stay unknown"
    );
    // The list still hides TLS-only exports from clients without TLS (documented choice).
    let listed: Vec<String> = raw
        .option(OPT_LIST, &[])
        .unwrap()
        .iter()
        .filter(|(reply_type, _)| *reply_type == REP_SERVER)
        .map(|(_, payload)| {
            let length = be_u32(payload) as usize;
            String::from_utf8_lossy(&payload[4..4 + length]).into_owned()
        })
        .collect();
    assert_eq!(listed, vec!["public".to_string()]);
    raw.go("public");
}

#[test]
fn shutdown_is_answered_to_negotiating_clients_and_new_requests() {
    let server = memory_default_server();
    let mut negotiating = Raw::modern(&server.socket_path);
    assert_eq!(negotiating.structured(), Ok(REP_ACK));
    let mut serving = Raw::connect_tcp(server.port());
    serving.send(&(CLIENT_FLAG_FIXED_NEWSTYLE | CLIENT_FLAG_NO_ZEROES).to_be_bytes());
    serving.go("");
    assert_eq!(serving.request(0, CMD_READ, 0, 512, &[]).unwrap().error, 0);
    server.begin_shutdown();
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        negotiating
            .option_final(OPT_GO, &[0, 0, 0, 0, 0, 0])
            .map(reply_name),
        Ok("ERR_SHUTDOWN".to_string())
    );
    assert_eq!(
        negotiating.option_final(OPT_LIST, &[]).map(reply_name),
        Ok("ERR_SHUTDOWN".to_string())
    );
    assert_eq!(negotiating.option_final(OPT_ABORT, &[]), Ok(REP_ACK));
    assert!(negotiating.is_closed_by_server());
    let read = serving.request(0, CMD_READ, 0, 512, &[]).unwrap();
    assert_eq!(errno_name(read.error), "ESHUTDOWN");
    serving.send_request(0, CMD_DISC, 0, 0, &[]);
    assert!(serving.is_closed_by_server());
}
