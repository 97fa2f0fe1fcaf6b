//! Goal: bufcache answers the NBD protocol as the reference servers do, and every place it
//! answers differently is known, listed and justified (docs/protocol.md, "Differences from
//! nbdkit and qemu-nbd"). Method: one list of raw-socket probes (handshake, options, metadata
//! contexts, every command's errors, structured and extended replies) runs against bufcache (a
//! cache over a 64 MiB sparse memory device), and where installed against `nbdkit memory 64M`
//! and `qemu-nbd` over a 64 MiB sparse file; each probe's answer is one short string. The test
//! prints the table of every probe where bufcache differs from a reference and fails on a
//! difference that is not in `ALLOWED` (or on an allowed one that no longer happens, so the
//! list stays true).

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use bufcache::MemoryDevice;
use bufcache_nbd::protocol::*;
use common::raw::*;
use common::*;

const SIZE: u64 = 64 << 20;
const MIB: u64 = 1 << 20;

/// Differences from a reference that are allowed: (probe, reference, why). docs/protocol.md
/// explains each `why`.
const ALLOWED: &[(&str, &str, &str)] = &[
    // nbdkit 1.32 predates extended headers (1.36 added them); "*" ends a prefix.
    ("extended*", "nbdkit", "nbdkit 1.32 has no extended headers"),
    // Server-specific contexts: x-bufcache:state.
    (
        "LIST_META_CONTEXT, no query",
        "nbdkit",
        "own metadata contexts",
    ),
    (
        "LIST_META_CONTEXT, no query",
        "qemu-nbd",
        "own metadata contexts",
    ),
    // Holes: qemu-nbd answers from the file's allocation map; the cache from what it knows
    // without a backend round trip; nbdkit never sends holes.
    (
        "READ of a never-written range, structured",
        "qemu-nbd",
        "holes only when known",
    ),
    (
        "READ after WRITE_ZEROES, structured",
        "nbdkit",
        "nbdkit sends no holes",
    ),
    (
        "BLOCK_STATUS around written data",
        "nbdkit",
        "the backend's allocation granularity",
    ),
    ("GO, minimum block size", "nbdkit", "block sizes advertised"),
    // Limits.
    ("option of 70000 bytes", "nbdkit", "option length limit"),
    ("option of 70000 bytes", "qemu-nbd", "option length limit"),
    ("WRITE of 32 MiB + 1", "nbdkit", "request size limit"),
    ("READ of 64 MiB", "nbdkit", "request size limit"),
    (
        "READ of 64 MiB with DF, structured",
        "nbdkit",
        "request size limit",
    ),
    ("READ of 64 MiB, structured", "nbdkit", "request size limit"),
    // Where the spec says SHOULD and bufcache follows it.
    (
        "READ of 64 MiB with DF, structured",
        "qemu-nbd",
        "EOVERFLOW for READ with DF",
    ),
    ("WRITE past the end", "qemu-nbd", "ENOSPC past the end"),
    (
        "WRITE_ZEROES past the end",
        "qemu-nbd",
        "ENOSPC past the end",
    ),
    (
        "plain newstyle, another option",
        "nbdkit",
        "no option replies to plain newstyle",
    ),
    // Unspecified by the spec, or lenient where it is the client's MUST.
    ("READ of 0 bytes", "nbdkit", "zero-length requests"),
    ("WRITE of 0 bytes", "nbdkit", "zero-length requests"),
    ("TRIM of 0 bytes", "nbdkit", "zero-length requests"),
    (
        "READ of 0 bytes, structured",
        "nbdkit",
        "zero-length requests",
    ),
    ("FLUSH with an offset", "nbdkit", "reserved fields"),
    ("STARTTLS, TLS off", "nbdkit", "STARTTLS with TLS off"),
    ("STARTTLS, TLS off", "qemu-nbd", "STARTTLS with TLS off"),
    ("STRUCTURED_REPLY twice", "qemu-nbd", "repeated options"),
    (
        "unknown export (INFO)",
        "nbdkit",
        "nbdkit serves every export name",
    ),
    (
        "unknown export (EXPORT_NAME)",
        "nbdkit",
        "nbdkit serves every export name",
    ),
];

/// True when an `ALLOWED` name covers `probe` (a name ending in `*` is a prefix).
fn matches(name: &str, probe: &str) -> bool {
    match name.strip_suffix('*') {
        Some(prefix) => probe.starts_with(prefix),
        None => name == probe,
    }
}

/// What a probe does: given the server's socket, one short answer.
type ProbeFn = fn(&Path) -> String;

/// A modern client in transmission, simple replies.
fn simple(socket: &Path) -> Raw {
    let mut raw = Raw::modern(socket);
    raw.go("");
    raw
}

/// A modern client in transmission with structured replies and base:allocation.
fn structured(socket: &Path) -> Raw {
    let mut raw = Raw::modern(socket);
    assert_eq!(raw.structured(), Ok(REP_ACK));
    raw.meta_context(OPT_SET_META_CONTEXT, "", &[BASE_ALLOCATION])
        .unwrap();
    raw.go("");
    raw
}

/// A modern client in transmission with extended headers and base:allocation, or `None`
/// when the server does not offer them.
fn extended(socket: &Path) -> Option<Raw> {
    let mut raw = Raw::modern(socket);
    if raw.extended_headers() != Ok(REP_ACK) {
        return None;
    }
    raw.meta_context(OPT_SET_META_CONTEXT, "", &[BASE_ALLOCATION])
        .unwrap();
    raw.go("");
    Some(raw)
}

/// The errno (or "closed") of one request.
fn errno_of(
    raw: &mut Raw,
    flags: u16,
    command: u16,
    offset: u64,
    length: u64,
    payload: &[u8],
) -> String {
    match raw.request(flags, command, offset, length, payload) {
        Ok(answer) => errno_name(answer.error),
        Err(Closed) => "closed".into(),
    }
}

/// An option's final reply (or "closed").
fn final_reply(raw: &mut Raw, option: u32, data: &[u8]) -> String {
    raw.option_final(option, data)
        .map_or_else(|Closed| "closed".into(), reply_name)
}

/// The chunk types of a reply, by name.
fn chunk_names(answer: &Answer) -> String {
    if answer.simple {
        return format!("simple {}", errno_name(answer.error));
    }
    let names: Vec<String> = answer
        .kinds()
        .iter()
        .map(|kind| match *kind {
            REPLY_TYPE_NONE => "NONE".to_string(),
            REPLY_TYPE_OFFSET_DATA => "DATA".to_string(),
            REPLY_TYPE_OFFSET_HOLE => "HOLE".to_string(),
            REPLY_TYPE_BLOCK_STATUS => "STATUS".to_string(),
            REPLY_TYPE_BLOCK_STATUS_EXT_RAW => "STATUS_EXT".to_string(),
            kind if is_reply_error(kind) => format!("ERROR {}", errno_name(answer.error)),
            other => format!("type {other}"),
        })
        .collect();
    names.join(",")
}

fn info_data(name: &str, extra: &[u8]) -> Vec<u8> {
    let mut data = (name.len() as u32).to_be_bytes().to_vec();
    data.extend_from_slice(name.as_bytes());
    data.extend_from_slice(&0u16.to_be_bytes());
    data.extend_from_slice(extra);
    data
}

/// Every probe, in table order.
fn probes() -> Vec<(&'static str, ProbeFn)> {
    vec![
        // Handshake.
        ("greeting flags", |socket| {
            format!("{:#x}", Raw::connect(socket).handshake_flags)
        }),
        ("unknown client flag", |socket| {
            let mut raw = Raw::start(socket, CLIENT_FLAG_FIXED_NEWSTYLE | 0x80);
            final_reply(&mut raw, OPT_LIST, &[])
        }),
        ("plain newstyle EXPORT_NAME", |socket| {
            let mut raw = Raw::start(socket, 0);
            match raw.export_name("", false) {
                Ok((size, _)) => format!(
                    "size {size}, {}",
                    errno_of(&mut raw, 0, CMD_READ, 0, 512, &[])
                ),
                Err(Closed) => "closed".into(),
            }
        }),
        ("plain newstyle, another option", |socket| {
            let mut raw = Raw::start(socket, 0);
            final_reply(&mut raw, OPT_LIST, &[])
        }),
        ("EXPORT_NAME with zeroes", |socket| {
            let mut raw = Raw::start(socket, CLIENT_FLAG_FIXED_NEWSTYLE);
            match raw.export_name("", false) {
                Ok(_) => errno_of(&mut raw, 0, CMD_READ, 0, 512, &[]),
                Err(Closed) => "closed".into(),
            }
        }),
        ("unknown option", |socket| {
            final_reply(&mut Raw::modern(socket), 99, b"data")
        }),
        ("LIST", |socket| {
            let mut raw = Raw::modern(socket);
            match raw.option(OPT_LIST, &[]) {
                Ok(replies) => format!(
                    "{} exports, {}",
                    replies
                        .iter()
                        .filter(|(kind, _)| *kind == REP_SERVER)
                        .count(),
                    reply_name(replies.last().unwrap().0)
                ),
                Err(Closed) => "closed".into(),
            }
        }),
        ("LIST with data", |socket| {
            final_reply(&mut Raw::modern(socket), OPT_LIST, b"x")
        }),
        ("ABORT", |socket| {
            let mut raw = Raw::modern(socket);
            let reply = final_reply(&mut raw, OPT_ABORT, &[]);
            format!("{reply}, closed {}", raw.is_closed_by_server())
        }),
        ("unknown export (INFO)", |socket| {
            final_reply(
                &mut Raw::modern(socket),
                OPT_INFO,
                &info_data("no-such-export", &[]),
            )
        }),
        ("unknown export (EXPORT_NAME)", |socket| {
            let mut raw = Raw::modern(socket);
            raw.export_name("no-such-export", true)
                .map_or_else(|Closed| "closed".into(), |_| "entered".into())
        }),
        ("GO, trailing bytes", |socket| {
            final_reply(&mut Raw::modern(socket), OPT_GO, &info_data("", &[0]))
        }),
        ("GO, minimum block size", |socket| {
            let mut raw = Raw::modern(socket);
            match raw.go_with(OPT_GO, "", &[INFO_BLOCK_SIZE]) {
                Ok((reply, _, sizes)) => format!(
                    "{}, minimum {}",
                    reply_name(reply),
                    sizes.map_or("none".into(), |sizes| sizes.0.to_string())
                ),
                Err(Closed) => "closed".into(),
            }
        }),
        ("STARTTLS, TLS off", |socket| {
            final_reply(&mut Raw::modern(socket), OPT_STARTTLS, &[])
        }),
        ("option of 70000 bytes", |socket| {
            final_reply(&mut Raw::modern(socket), OPT_INFO, &vec![0; 70_000])
        }),
        ("STRUCTURED_REPLY with data", |socket| {
            final_reply(&mut Raw::modern(socket), OPT_STRUCTURED_REPLY, b"x")
        }),
        ("STRUCTURED_REPLY twice", |socket| {
            let mut raw = Raw::modern(socket);
            raw.structured().unwrap();
            final_reply(&mut raw, OPT_STRUCTURED_REPLY, &[])
        }),
        // Metadata contexts.
        ("SET_META_CONTEXT before structured replies", |socket| {
            final_reply(
                &mut Raw::modern(socket),
                OPT_SET_META_CONTEXT,
                &meta_context_data("", &[BASE_ALLOCATION]),
            )
        }),
        ("LIST_META_CONTEXT, no query", |socket| {
            contexts(socket, OPT_LIST_META_CONTEXT, &[])
        }),
        ("LIST_META_CONTEXT base:", |socket| {
            contexts(socket, OPT_LIST_META_CONTEXT, &["base:"])
        }),
        ("SET_META_CONTEXT base:", |socket| {
            contexts(socket, OPT_SET_META_CONTEXT, &["base:"])
        }),
        ("SET_META_CONTEXT, unknown namespace", |socket| {
            contexts(socket, OPT_SET_META_CONTEXT, &["x-unknown:thing"])
        }),
        ("SET_META_CONTEXT, malformed", |socket| {
            let mut raw = Raw::modern(socket);
            raw.structured().unwrap();
            let mut data = meta_context_data("", &[BASE_ALLOCATION]);
            data.truncate(data.len() - 2);
            final_reply(&mut raw, OPT_SET_META_CONTEXT, &data)
        }),
        ("BLOCK_STATUS after a failed SET", |socket| {
            let mut raw = Raw::modern(socket);
            raw.structured().unwrap();
            raw.meta_context(OPT_SET_META_CONTEXT, "", &[BASE_ALLOCATION])
                .unwrap();
            raw.option_final(
                OPT_SET_META_CONTEXT,
                &meta_context_data("nope", &[BASE_ALLOCATION]),
            )
            .unwrap();
            raw.go("");
            errno_of(&mut raw, 0, CMD_BLOCK_STATUS, 0, 4096, &[])
        }),
        // Transmission, simple replies.
        ("READ", |socket| {
            errno_of(&mut simple(socket), 0, CMD_READ, 0, 512, &[])
        }),
        ("WRITE then READ back", |socket| {
            let mut raw = simple(socket);
            let written = errno_of(&mut raw, 0, CMD_WRITE, 4096, 5, b"hello");
            let back = raw.request(0, CMD_READ, 4096, 5, &[]).unwrap();
            format!("{written}, {}", back.data == b"hello")
        }),
        ("READ of 0 bytes", |socket| {
            errno_of(&mut simple(socket), 0, CMD_READ, 0, 0, &[])
        }),
        ("WRITE of 0 bytes", |socket| {
            errno_of(&mut simple(socket), 0, CMD_WRITE, 0, 0, &[])
        }),
        ("TRIM of 0 bytes", |socket| {
            errno_of(&mut simple(socket), 0, CMD_TRIM, 0, 0, &[])
        }),
        ("READ past the end", |socket| {
            errno_of(&mut simple(socket), 0, CMD_READ, SIZE, 512, &[])
        }),
        ("READ across the end", |socket| {
            errno_of(&mut simple(socket), 0, CMD_READ, SIZE - 256, 512, &[])
        }),
        ("READ at an offset that overflows", |socket| {
            errno_of(&mut simple(socket), 0, CMD_READ, u64::MAX - 255, 512, &[])
        }),
        ("WRITE past the end", |socket| {
            errno_of(
                &mut simple(socket),
                0,
                CMD_WRITE,
                SIZE - 256,
                512,
                &[0; 512],
            )
        }),
        ("TRIM past the end", |socket| {
            errno_of(&mut simple(socket), 0, CMD_TRIM, SIZE, 4096, &[])
        }),
        ("WRITE_ZEROES past the end", |socket| {
            errno_of(&mut simple(socket), 0, CMD_WRITE_ZEROES, SIZE, 4096, &[])
        }),
        ("CACHE past the end", |socket| {
            errno_of(&mut simple(socket), 0, CMD_CACHE, SIZE, 4096, &[])
        }),
        ("unknown command", |socket| {
            errno_of(&mut simple(socket), 0, 42, 0, 0, &[])
        }),
        ("unknown flag", |socket| {
            errno_of(&mut simple(socket), 1 << 7, CMD_READ, 0, 512, &[])
        }),
        ("FUA on READ", |socket| {
            errno_of(&mut simple(socket), CMD_FLAG_FUA, CMD_READ, 0, 512, &[])
        }),
        ("NO_HOLE on WRITE", |socket| {
            errno_of(
                &mut simple(socket),
                CMD_FLAG_NO_HOLE,
                CMD_WRITE,
                0,
                4,
                b"data",
            )
        }),
        ("DF without structured replies", |socket| {
            errno_of(&mut simple(socket), CMD_FLAG_DF, CMD_READ, 0, 512, &[])
        }),
        ("REQ_ONE on READ", |socket| {
            errno_of(&mut simple(socket), CMD_FLAG_REQ_ONE, CMD_READ, 0, 512, &[])
        }),
        ("WRITE_ZEROES, NO_HOLE", |socket| {
            errno_of(
                &mut simple(socket),
                CMD_FLAG_NO_HOLE,
                CMD_WRITE_ZEROES,
                0,
                4096,
                &[],
            )
        }),
        ("READ of 64 MiB", |socket| {
            errno_of(&mut simple(socket), 0, CMD_READ, 0, 64 * MIB, &[])
        }),
        ("WRITE of 32 MiB + 1", |socket| {
            let length = 32 * MIB + 1;
            errno_of(
                &mut simple(socket),
                0,
                CMD_WRITE,
                0,
                length,
                &vec![1; length as usize],
            )
        }),
        ("BLOCK_STATUS without a context", |socket| {
            errno_of(&mut simple(socket), 0, CMD_BLOCK_STATUS, 0, 4096, &[])
        }),
        ("FLUSH with an offset", |socket| {
            errno_of(&mut simple(socket), 0, CMD_FLUSH, 4096, 0, &[])
        }),
        ("a bad request magic", |socket| {
            let mut raw = simple(socket);
            raw.send(&[0x12; 28]);
            format!("closed {}", raw.is_closed_by_server())
        }),
        // Structured replies.
        ("READ, structured", |socket| {
            let mut raw = structured(socket);
            raw.request(0, CMD_WRITE, 0, 512, &[1; 512]).unwrap();
            chunk_names(&raw.request(0, CMD_READ, 0, 512, &[]).unwrap())
        }),
        ("READ of 0 bytes, structured", |socket| {
            chunk_names(&structured(socket).request(0, CMD_READ, 0, 0, &[]).unwrap())
        }),
        ("READ past the end, structured", |socket| {
            chunk_names(
                &structured(socket)
                    .request(0, CMD_READ, SIZE, 512, &[])
                    .unwrap(),
            )
        }),
        ("READ of a never-written range, structured", |socket| {
            chunk_names(
                &structured(socket)
                    .request(0, CMD_READ, 32 * MIB, 65536, &[])
                    .unwrap(),
            )
        }),
        ("READ after WRITE_ZEROES, structured", |socket| {
            let mut raw = structured(socket);
            raw.request(0, CMD_WRITE, 8 * MIB, 65536, &[1; 65536])
                .unwrap();
            raw.request(0, CMD_WRITE_ZEROES, 8 * MIB, 65536, &[])
                .unwrap();
            chunk_names(&raw.request(0, CMD_READ, 8 * MIB, 65536, &[]).unwrap())
        }),
        ("READ of 64 MiB with DF, structured", |socket| {
            chunk_names(
                &structured(socket)
                    .request(CMD_FLAG_DF, CMD_READ, 0, 64 * MIB, &[])
                    .unwrap(),
            )
        }),
        ("READ of 64 MiB, structured", |socket| {
            chunk_names(
                &structured(socket)
                    .request(0, CMD_READ, 0, 64 * MIB, &[])
                    .unwrap(),
            )
        }),
        ("BLOCK_STATUS around written data", |socket| {
            let mut raw = structured(socket);
            raw.request(0, CMD_WRITE, 16 * MIB, 65536, &[1; 65536])
                .unwrap();
            let answer = raw
                .request(0, CMD_BLOCK_STATUS, 15 * MIB, 2 * MIB, &[])
                .unwrap();
            format!(
                "{:?}",
                answer.status().first().map(|(_, list)| list.clone())
            )
        }),
        ("BLOCK_STATUS, REQ_ONE", |socket| {
            let answer = structured(socket)
                .request(CMD_FLAG_REQ_ONE, CMD_BLOCK_STATUS, 0, SIZE, &[])
                .unwrap();
            format!(
                "{} descriptor",
                answer.status().first().map_or(0, |(_, list)| list.len())
            )
        }),
        ("BLOCK_STATUS of 0 bytes", |socket| {
            errno_of(&mut structured(socket), 0, CMD_BLOCK_STATUS, 0, 0, &[])
        }),
        ("BLOCK_STATUS past the end", |socket| {
            errno_of(
                &mut structured(socket),
                0,
                CMD_BLOCK_STATUS,
                SIZE,
                4096,
                &[],
            )
        }),
        // Extended headers.
        ("extended headers", |socket| {
            final_reply(&mut Raw::modern(socket), OPT_EXTENDED_HEADERS_RAW, &[])
        }),
        ("extended: with data", |socket| {
            final_reply(&mut Raw::modern(socket), OPT_EXTENDED_HEADERS_RAW, b"x")
        }),
        ("extended: then structured", |socket| {
            let mut raw = Raw::modern(socket);
            raw.extended_headers().unwrap();
            final_reply(&mut raw, OPT_STRUCTURED_REPLY, &[])
        }),
        ("extended: then EXPORT_NAME", |socket| {
            let mut raw = Raw::modern(socket);
            if raw.extended_headers() != Ok(REP_ACK) {
                return "no extended headers".into();
            }
            raw.export_name("", true)
                .map_or_else(|Closed| "closed".into(), |_| "entered".into())
        }),
        ("extended: READ, WRITE, FLUSH", |socket| {
            let Some(mut raw) = extended(socket) else {
                return "no extended headers".into();
            };
            let write = raw
                .request(CMD_FLAG_PAYLOAD_LEN_RAW, CMD_WRITE, 4096, 4, b"data")
                .unwrap();
            let read = raw.request(0, CMD_READ, 4096, 4, &[]).unwrap();
            let flush = raw.request(0, CMD_FLUSH, 0, 0, &[]).unwrap();
            format!(
                "{}; {} {}; {}; offsets echoed {}",
                chunk_names(&write),
                chunk_names(&read),
                read.data == b"data",
                chunk_names(&flush),
                write.offsets_echoed && read.offsets_echoed
            )
        }),
        ("extended: WRITE without PAYLOAD_LEN", |socket| {
            let Some(mut raw) = extended(socket) else {
                return "no extended headers".into();
            };
            chunk_names(&raw.request(0, CMD_WRITE, 4096, 4, b"data").unwrap())
        }),
        ("extended: BLOCK_STATUS", |socket| {
            let Some(mut raw) = extended(socket) else {
                return "no extended headers".into();
            };
            let answer = raw.request(0, CMD_BLOCK_STATUS, 0, SIZE, &[]).unwrap();
            format!(
                "{}, {:?}",
                chunk_names(&answer),
                answer.status().first().map(|(_, list)| list.len())
            )
        }),
        ("extended: TRIM 48 MiB", |socket| {
            let Some(mut raw) = extended(socket) else {
                return "no extended headers".into();
            };
            chunk_names(&raw.request(0, CMD_TRIM, 0, 48 * MIB, &[]).unwrap())
        }),
        ("extended: payload on TRIM", |socket| {
            let Some(mut raw) = extended(socket) else {
                return "no extended headers".into();
            };
            let refused = errno_of(&mut raw, CMD_FLAG_PAYLOAD_LEN_RAW, CMD_TRIM, 0, 8, &[0; 8]);
            format!(
                "{refused}, then {}",
                errno_of(&mut raw, 0, CMD_READ, 0, 512, &[])
            )
        }),
        ("extended: a compact header", |socket| {
            let Some(mut raw) = extended(socket) else {
                return "no extended headers".into();
            };
            raw.extended = false;
            raw.send_request(0, CMD_READ, 0, 512, &[]);
            raw.send(&[0; 4]);
            format!("closed {}", raw.is_closed_by_server())
        }),
    ]
}

/// Context names a LIST or SET answers with (base: ones by name, others counted).
fn contexts(socket: &Path, option: u32, queries: &[&str]) -> String {
    let mut raw = Raw::modern(socket);
    raw.structured().unwrap();
    match raw.meta_context(option, "", queries) {
        Ok((reply, contexts)) => {
            let base: Vec<String> = contexts
                .iter()
                .filter(|(_, name)| name.starts_with("base:"))
                .map(|(_, name)| name.clone())
                .collect();
            let others = contexts.len() - base.len();
            format!("{} [{}] +{others}", reply_name(reply), base.join(","))
        }
        Err(Closed) => "closed".into(),
    }
}

/// Runs every probe against a server listening on `socket`.
fn answers(socket: &Path) -> Vec<String> {
    probes().iter().map(|(_, probe)| probe(socket)).collect()
}

/// bufcache: a cache over a 64 MiB sparse memory device.
fn bufcache_server() -> TestServer {
    cached_server(Arc::new(MemoryDevice::new(SIZE))).0
}

#[test]
fn one_probe_list_against_bufcache_nbdkit_and_qemu_nbd() {
    let bufcache = bufcache_server();
    let ours = answers(&bufcache.socket_path);
    let mut references: Vec<(&str, Vec<String>)> = Vec::new();
    let nbdkit = Nbdkit::start(&["memory", "64M"]);
    if let Some(nbdkit) = &nbdkit {
        references.push(("nbdkit", answers(&nbdkit.socket_path)));
    }
    let qemu = QemuNbd::start(SIZE, &["--discard=unmap"]);
    if let Some(qemu) = &qemu {
        references.push(("qemu-nbd", answers(&qemu.socket_path)));
    }
    let probes = probes();
    let mut table = format!(
        "| probe | bufcache | {} | allowed because |\n|---|---|{}---|\n",
        references
            .iter()
            .map(|(name, _)| *name)
            .collect::<Vec<_>>()
            .join(" | "),
        "---|".repeat(references.len())
    );
    let mut unexpected = Vec::new();
    let mut seen: BTreeMap<(&str, &str), bool> = BTreeMap::new();
    for (index, (probe, _)) in probes.iter().enumerate() {
        let differing: Vec<&str> = references
            .iter()
            .filter(|(_, theirs)| theirs[index] != ours[index])
            .map(|(name, _)| *name)
            .collect();
        if differing.is_empty() {
            continue;
        }
        let reasons: Vec<&str> = differing
            .iter()
            .map(|reference| {
                let allowed = ALLOWED
                    .iter()
                    .find(|(name, server, _)| matches(name, probe) && server == reference);
                match allowed {
                    Some((name, server, why)) => {
                        seen.insert((name, server), true);
                        *why
                    }
                    None => {
                        unexpected.push(format!("{probe} ({reference})"));
                        "NOT ALLOWED"
                    }
                }
            })
            .collect();
        let cells: Vec<&str> = references
            .iter()
            .map(|(_, theirs)| theirs[index].as_str())
            .collect();
        table.push_str(&format!(
            "| {probe} | {} | {} | {} |\n",
            ours[index],
            cells.join(" | "),
            reasons.join("; ")
        ));
    }
    println!(
        "{} probes; differences from {}:\n{table}",
        probes.len(),
        references
            .iter()
            .map(|(name, _)| *name)
            .collect::<Vec<_>>()
            .join(", ")
    );
    for (index, (probe, _)) in probes.iter().enumerate() {
        println!("  {probe}: {}", ours[index]);
    }
    assert!(
        unexpected.is_empty(),
        "differences not in ALLOWED: {unexpected:?}"
    );
    let stale: Vec<_> = ALLOWED
        .iter()
        .filter(|(_, server, _)| references.iter().any(|(name, _)| name == server))
        .filter(|(name, server, _)| !seen.contains_key(&(*name, *server)))
        .collect();
    assert!(
        stale.is_empty(),
        "allowed differences that no longer happen: {stale:?}"
    );
}
