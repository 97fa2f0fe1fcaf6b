//! Goal: block status tells the truth while data is dirty. `base:allocation` reports dirty
//! blocks as data and everything else as the backend reports it (one 4 KiB write no longer
//! turns an 8 MiB query into one data extent), so copying tools keep sparseness before the
//! first flush; and the `x-bufcache:state` context tells which ranges are dirty, resident or
//! absent. And a structured READ answers ranges zeroed or trimmed since they were last written
//! with OFFSET_HOLE chunks, so a client skips zeroes without reading them. Method: a cache over
//! a 64 MiB sparse memory device, served by our server; raw BLOCK_STATUS and READ probes check
//! every descriptor and chunk, and real clients (nbdinfo --map, qemu-img map, qemu-io) read the
//! same maps and holes.

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use bufcache::{MemoryDevice, ObjectHandle};
use bufcache_nbd::protocol::*;
use bufcache_nbd::{Export, MemoryExport};
use common::raw::*;
use common::*;

const MIB: u64 = 1 << 20;
const SIZE: u64 = 64 * MIB;
/// The memory device allocates in chunks of this size.
const DEVICE_CHUNK: u64 = 64 << 10;

const HOLE: u64 = (STATE_HOLE | STATE_ZERO) as u64;
const DATA: u64 = 0;
const ABSENT: u64 = 0;
const RESIDENT: u64 = CACHE_STATE_RESIDENT as u64;
const DIRTY: u64 = (CACHE_STATE_RESIDENT | CACHE_STATE_DIRTY) as u64;

fn cached_memory() -> (TestServer, ObjectHandle) {
    cached_server(Arc::new(MemoryDevice::new(SIZE)))
}

/// A structured connection with both contexts selected: (connection, id of base:allocation,
/// id of x-bufcache:state).
fn open_both(socket: &Path) -> (Raw, u32, u32) {
    let mut raw = Raw::modern(socket);
    assert_eq!(raw.structured(), Ok(REP_ACK));
    let (reply, contexts) = raw
        .meta_context(OPT_SET_META_CONTEXT, "", &[BASE_ALLOCATION, BUFCACHE_STATE])
        .unwrap();
    assert_eq!(reply, REP_ACK);
    let id_of = |name: &str| {
        contexts
            .iter()
            .find(|(_, context)| context == name)
            .unwrap_or_else(|| panic!("{name} selected"))
            .0
    };
    let ids = (id_of(BASE_ALLOCATION), id_of(BUFCACHE_STATE));
    raw.go("");
    (raw, ids.0, ids.1)
}

/// A status chunk's descriptors: (length, flags).
type Descriptors = Vec<(u64, u64)>;

/// BLOCK_STATUS of `length` at `offset`: (base:allocation descriptors, x-bufcache:state ones).
fn maps(raw: &mut Raw, ids: (u32, u32), offset: u64, length: u64) -> (Descriptors, Descriptors) {
    let answer = raw
        .request(0, CMD_BLOCK_STATUS, offset, length, &[])
        .unwrap();
    assert_eq!(errno_name(answer.error), "ok");
    let status = answer.status();
    let of = |id: u32| {
        status
            .iter()
            .find(|(context, _)| *context == id)
            .expect("a chunk per context")
            .1
            .clone()
    };
    (of(ids.0), of(ids.1))
}

#[test]
fn block_status_is_exact_while_data_is_dirty_and_after_the_flush() {
    let (server, object) = cached_memory();
    object
        .write_at(MIB, &pattern_bytes(4096, 1), false)
        .unwrap();
    let (mut raw, base, state) = open_both(&server.socket_path);
    let ids = (base, state);
    let (allocation, cache_state) = maps(&mut raw, ids, 0, 8 * MIB);
    assert_eq!(
        allocation,
        vec![(MIB, HOLE), (4096, DATA), (7 * MIB - 4096, HOLE)],
        "the dirty block is data, the rest as the device says"
    );
    assert_eq!(
        cache_state,
        vec![(MIB, ABSENT), (4096, DIRTY), (7 * MIB - 4096, ABSENT)]
    );
    // An unaligned query inside the dirty block, and REQ_ONE.
    let (allocation, cache_state) = maps(&mut raw, ids, MIB + 100, 1000);
    assert_eq!(
        (allocation, cache_state),
        (vec![(1000, DATA)], vec![(1000, DIRTY)])
    );
    let answer = raw
        .request(CMD_FLAG_REQ_ONE, CMD_BLOCK_STATUS, MIB - 512, 8192, &[])
        .unwrap();
    let one_each: Vec<usize> = answer.status().iter().map(|(_, list)| list.len()).collect();
    assert_eq!(one_each, vec![1, 1]);
    assert_eq!(answer.status()[0].1, vec![(512, HOLE)]);
    // Written back: the device now holds a chunk of data, and the block is resident, clean.
    assert_eq!(raw.request(0, CMD_FLUSH, 0, 0, &[]).unwrap().error, 0);
    let (allocation, cache_state) = maps(&mut raw, ids, 0, 8 * MIB);
    assert_eq!(
        allocation,
        vec![
            (MIB, HOLE),
            (DEVICE_CHUNK, DATA),
            (7 * MIB - DEVICE_CHUNK, HOLE)
        ]
    );
    assert_eq!(
        cache_state,
        vec![(MIB, ABSENT), (4096, RESIDENT), (7 * MIB - 4096, ABSENT)]
    );
    // A dirty run across written-back data and a hole, over the whole export.
    object
        .write_at(MIB + DEVICE_CHUNK - 4096, &pattern_bytes(8192, 2), false)
        .unwrap();
    let (allocation, cache_state) = maps(&mut raw, ids, 0, SIZE);
    assert_eq!(
        allocation,
        vec![
            (MIB, HOLE),
            (DEVICE_CHUNK + 4096, DATA),
            (SIZE - MIB - DEVICE_CHUNK - 4096, HOLE)
        ]
    );
    assert_eq!(
        cache_state,
        vec![
            (MIB, ABSENT),
            (4096, RESIDENT),
            (DEVICE_CHUNK - 8192, ABSENT),
            (8192, DIRTY),
            (SIZE - MIB - DEVICE_CHUNK - 4096, ABSENT)
        ]
    );
}

#[test]
fn the_cache_state_context_is_listed_and_selected_like_qemu_allocation_depth() {
    let (server, _object) = cached_memory();
    let mut raw = Raw::modern(&server.socket_path);
    assert_eq!(raw.structured(), Ok(REP_ACK));
    let names = |raw: &mut Raw, option: u32, queries: &[&str]| {
        let (reply, contexts) = raw.meta_context(option, "", queries).unwrap();
        assert_eq!(reply, REP_ACK);
        contexts
            .into_iter()
            .map(|(_, name)| name)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        names(&mut raw, OPT_LIST_META_CONTEXT, &[]),
        vec![BASE_ALLOCATION, BUFCACHE_STATE]
    );
    assert_eq!(
        names(&mut raw, OPT_LIST_META_CONTEXT, &[BUFCACHE_NAMESPACE]),
        vec![BUFCACHE_STATE]
    );
    // The namespace is `x-bufcache:` (the spec allows no unregistered namespace without
    // `x-`); the unprefixed name is no alias.
    assert_eq!(
        names(
            &mut raw,
            OPT_LIST_META_CONTEXT,
            &["bufcache:", "bufcache:state"]
        ),
        Vec::<String>::new()
    );
    assert_eq!(
        names(&mut raw, OPT_LIST_META_CONTEXT, &["qemu:", "x-other:y"]),
        Vec::<String>::new()
    );
    // A namespace alone selects nothing; unknown leaves are ignored.
    assert_eq!(
        names(
            &mut raw,
            OPT_SET_META_CONTEXT,
            &[BUFCACHE_NAMESPACE, "x-bufcache:nope", "bufcache:state"]
        ),
        Vec::<String>::new()
    );
    assert_eq!(
        names(&mut raw, OPT_SET_META_CONTEXT, &[BUFCACHE_STATE]),
        vec![BUFCACHE_STATE]
    );
    raw.go("");
    let answer = raw.request(0, CMD_BLOCK_STATUS, 0, MIB, &[]).unwrap();
    assert_eq!(
        answer.status().len(),
        1,
        "one chunk: the one context selected"
    );
    // An export that is no cache does not offer it.
    let plain = start_server(vec![(
        "",
        Arc::new(MemoryExport::new(MIB)) as Arc<dyn Export>,
    )]);
    let mut raw = Raw::modern(&plain.socket_path);
    assert_eq!(raw.structured(), Ok(REP_ACK));
    assert_eq!(
        names(&mut raw, OPT_LIST_META_CONTEXT, &[]),
        vec![BASE_ALLOCATION]
    );
    assert_eq!(
        names(&mut raw, OPT_SET_META_CONTEXT, &[BUFCACHE_STATE]),
        Vec::<String>::new()
    );
}

/// `nbdinfo --map[=CONTEXT]` lines as (offset, length, flags).
fn nbdinfo_map(uri: &str, context: Option<&str>) -> Vec<(u64, u64, u64)> {
    let map = match context {
        Some(context) => format!("--map={context}"),
        None => "--map".to_string(),
    };
    let output = run_ok(Command::new("nbdinfo").arg(map).arg(uri));
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|line| {
            let fields: Vec<u64> = line
                .split_whitespace()
                .take(3)
                .map(|field| field.parse().expect("a number"))
                .collect();
            (fields[0], fields[1], fields[2])
        })
        .collect()
}

#[test]
fn real_clients_see_dirty_data_as_data_and_the_rest_as_holes() {
    if !tools(&["nbdinfo", "qemu-img"]) {
        return;
    }
    let (server, object) = cached_memory();
    object
        .write_at(MIB, &pattern_bytes(4096, 1), false)
        .unwrap();
    let uri = server.unix_uri("");
    assert_eq!(
        nbdinfo_map(&uri, None),
        vec![
            (0, MIB, HOLE),
            (MIB, 4096, DATA),
            (MIB + 4096, SIZE - MIB - 4096, HOLE)
        ]
    );
    assert_eq!(
        nbdinfo_map(&uri, Some(BUFCACHE_STATE)),
        vec![
            (0, MIB, ABSENT),
            (MIB, 4096, DIRTY),
            (MIB + 4096, SIZE - MIB - 4096, ABSENT)
        ]
    );
    let output = run_ok(Command::new("qemu-img").args([
        "map",
        "--output=json",
        "--image-opts",
        &format!("driver=nbd,path={},export=", server.socket_path.display()),
    ]));
    let text = String::from_utf8_lossy(&output.stdout);
    let data: Vec<&str> = text
        .lines()
        .filter(|line| line.contains("\"data\": true"))
        .collect();
    assert_eq!(data.len(), 1, "one data extent:\n{text}");
    assert!(
        data[0].contains(&format!("\"start\": {MIB}, \"length\": 4096,")),
        "the dirty block:\n{text}"
    );
}

/// A structured READ's chunks as (type, offset, length) and its assembled data.
fn read_chunks(
    raw: &mut Raw,
    flags: u16,
    offset: u64,
    length: u64,
) -> (Vec<(u16, u64, u64)>, Vec<u8>) {
    let answer = raw.request(flags, CMD_READ, offset, length, &[]).unwrap();
    assert_eq!(errno_name(answer.error), "ok");
    let chunks = answer
        .chunks
        .iter()
        .map(|(kind, payload)| match *kind {
            REPLY_TYPE_OFFSET_HOLE => (*kind, be_u64(payload), u64::from(be_u32(&payload[8..]))),
            REPLY_TYPE_OFFSET_DATA => (*kind, be_u64(payload), payload.len() as u64 - 8),
            other => (other, 0, 0),
        })
        .collect();
    (chunks, answer.data)
}

#[test]
fn reads_of_zeroed_and_trimmed_ranges_come_back_as_hole_chunks() {
    const K: u64 = 1024;
    const HOLE_CHUNK: u16 = REPLY_TYPE_OFFSET_HOLE;
    const DATA_CHUNK: u16 = REPLY_TYPE_OFFSET_DATA;
    let (server, object) = cached_memory();
    object
        .write_at(0, &pattern_bytes(3 * MIB as usize, 3), false)
        .unwrap();
    let (mut raw, _, _) = open_both(&server.socket_path);
    let zero = raw.request(0, CMD_WRITE_ZEROES, 256 * K, MIB, &[]).unwrap();
    assert_eq!(zero.error, 0);
    let trim = raw.request(0, CMD_TRIM, 2 * MIB, 256 * K, &[]).unwrap();
    assert_eq!(trim.error, 0);
    let (chunks, data) = read_chunks(&mut raw, 0, 0, 3 * MIB);
    assert_eq!(
        chunks,
        vec![
            (DATA_CHUNK, 0, 256 * K),
            (HOLE_CHUNK, 256 * K, MIB),
            (DATA_CHUNK, 1280 * K, 768 * K),
            (HOLE_CHUNK, 2 * MIB, 256 * K),
            (DATA_CHUNK, 2304 * K, 768 * K),
        ]
    );
    let mut expected = pattern_bytes(3 * MIB as usize, 3);
    expected[256 * K as usize..1280 * K as usize].fill(0);
    expected[2 * MIB as usize..2304 * K as usize].fill(0);
    assert!(data == expected, "the data around the holes is intact");
    // A write into a hole splits it, seen from another connection too.
    let mut other = Raw::modern(&server.socket_path);
    assert_eq!(other.structured(), Ok(REP_ACK));
    other.go("");
    let write = other
        .request(0, CMD_WRITE, 512 * K, 4096, &[7; 4096])
        .unwrap();
    assert_eq!(write.error, 0);
    let (chunks, data) = read_chunks(&mut raw, 0, 256 * K, MIB);
    assert_eq!(
        chunks,
        vec![
            (HOLE_CHUNK, 256 * K, 256 * K),
            (DATA_CHUNK, 512 * K, 4096),
            (HOLE_CHUNK, 516 * K, 764 * K),
        ]
    );
    assert_eq!(
        &data[256 * K as usize..256 * K as usize + 4096],
        &[7; 4096][..]
    );
    // DF asks for one data chunk: the zeroes are sent.
    let (chunks, data) = read_chunks(&mut raw, CMD_FLAG_DF, 256 * K, 8192);
    assert_eq!(
        (chunks, data),
        (vec![(DATA_CHUNK, 256 * K, 8192)], vec![0; 8192])
    );
    // qemu's client takes the holes as zeroes.
    if tool("qemu-io").is_some() {
        let output = run_ok(Command::new("qemu-io").args([
            "--trace",
            "nbd_receive_reply_chunk_header",
            "-f",
            "raw",
            "-c",
            "read -P 0 600k 64k",
            &server.unix_uri(""),
        ]));
        let text = String::from_utf8_lossy(&output.stderr);
        assert!(text.contains("type = 2 (hole)"), "{text}");
        assert!(String::from_utf8_lossy(&output.stdout).contains("read 65536/65536"));
    }
}
