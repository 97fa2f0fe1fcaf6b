//! Wire messages for the NBD targets: the fixed handshake `nbd_requests` prepends, and the
//! binary seed inputs `smoke gen-corpus` writes to `fuzz/corpus/`.

use bufcache_nbd::protocol::*;

/// The export every NBD target talks to (64 KiB, writable) and a read-only twin.
pub const EXPORT_NAME: &str = "disk";
pub const READ_ONLY_EXPORT_NAME: &str = "ro";

/// `nbd_requests` mode bits (the first input byte).
pub const MODE_STRUCTURED: u8 = 1 << 0;
pub const MODE_BASE_ALLOCATION: u8 = 1 << 1;
pub const MODE_READ_ONLY: u8 = 1 << 2;
pub const MODE_EXPORT_NAME: u8 = 1 << 3;
/// `NBD_OPT_EXTENDED_HEADERS` instead of structured replies: 32-byte requests and replies.
pub const MODE_EXTENDED: u8 = 1 << 4;
/// Every mode bit.
pub const MODE_MASK: u8 = 0x1f;

pub fn option(option: u32, data: &[u8]) -> Vec<u8> {
    let mut message = OPTION_MAGIC.to_be_bytes().to_vec();
    message.extend_from_slice(&option.to_be_bytes());
    message.extend_from_slice(&(data.len() as u32).to_be_bytes());
    message.extend_from_slice(data);
    message
}

fn string_u32(out: &mut Vec<u8>, text: &str) {
    out.extend_from_slice(&(text.len() as u32).to_be_bytes());
    out.extend_from_slice(text.as_bytes());
}

/// INFO/GO data: export name and requested info types.
pub fn info_request(name: &str, requested: &[u16]) -> Vec<u8> {
    let mut data = Vec::new();
    string_u32(&mut data, name);
    data.extend_from_slice(&(requested.len() as u16).to_be_bytes());
    for info in requested {
        data.extend_from_slice(&info.to_be_bytes());
    }
    data
}

/// LIST/SET_META_CONTEXT data: export name and queries.
pub fn meta_context_request(name: &str, queries: &[&str]) -> Vec<u8> {
    let mut data = Vec::new();
    string_u32(&mut data, name);
    data.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for query in queries {
        string_u32(&mut data, query);
    }
    data
}

pub fn request(command: u16, flags: u16, handle: u64, offset: u64, length: u32) -> Vec<u8> {
    RequestHeader {
        flags,
        command,
        handle,
        offset,
        length: length.into(),
    }
    .encode()
    .to_vec()
}

/// A 32-byte request (extended headers), with a 64-bit length.
pub fn extended_request(
    command: u16,
    flags: u16,
    handle: u64,
    offset: u64,
    length: u64,
) -> Vec<u8> {
    RequestHeader {
        flags,
        command,
        handle,
        offset,
        length,
    }
    .encode_extended()
    .to_vec()
}

/// An extended WRITE: PAYLOAD_LEN set, as the spec asks (qemu leaves it out; see the mix).
pub fn extended_write(handle: u64, offset: u64, payload: &[u8]) -> Vec<u8> {
    let length = payload.len() as u64;
    let mut bytes = extended_request(CMD_WRITE, CMD_FLAG_PAYLOAD_LEN, handle, offset, length);
    bytes.extend_from_slice(payload);
    bytes
}

pub fn write_request(handle: u64, offset: u64, payload: &[u8]) -> Vec<u8> {
    let mut bytes = request(CMD_WRITE, 0, handle, offset, payload.len() as u32);
    bytes.extend_from_slice(payload);
    bytes
}

/// What a client sends to enter transmission in `mode` (see the `MODE_*` bits).
pub fn preamble(mode: u8) -> Vec<u8> {
    let structured = mode & MODE_STRUCTURED != 0;
    let name = if mode & MODE_READ_ONLY != 0 {
        READ_ONLY_EXPORT_NAME
    } else {
        EXPORT_NAME
    };
    let flags = CLIENT_FLAG_FIXED_NEWSTYLE | CLIENT_FLAG_NO_ZEROES;
    let mut bytes = flags.to_be_bytes().to_vec();
    if mode & MODE_EXTENDED != 0 {
        bytes.extend(option(OPT_EXTENDED_HEADERS, &[]));
    }
    if structured || mode & MODE_EXTENDED != 0 {
        if mode & MODE_EXTENDED == 0 {
            bytes.extend(option(OPT_STRUCTURED_REPLY, &[]));
        }
        if mode & MODE_BASE_ALLOCATION != 0 {
            let data = meta_context_request(name, &[BASE_ALLOCATION]);
            bytes.extend(option(OPT_SET_META_CONTEXT, &data));
        }
    }
    if mode & MODE_EXPORT_NAME != 0 {
        bytes.extend(option(OPT_EXPORT_NAME, name.as_bytes()));
    } else {
        bytes.extend(option(OPT_GO, &info_request(name, &[INFO_BLOCK_SIZE])));
    }
    bytes
}

fn pattern(length: usize, seed: u8) -> Vec<u8> {
    (0..length)
        .map(|index| (index as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// A mix of valid and refused requests (out of range, unknown command, oversized write).
fn request_mix() -> Vec<u8> {
    let mut bytes = Vec::new();
    bytes.extend(write_request(1, 0, &pattern(512, 1)));
    bytes.extend(request(CMD_READ, 0, 2, 0, 512));
    bytes.extend(request(CMD_FLUSH, 0, 3, 0, 0));
    bytes.extend(request(CMD_TRIM, CMD_FLAG_FUA, 4, 4096, 4096));
    bytes.extend(request(CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE, 5, 8192, 4096));
    bytes.extend(request(CMD_CACHE, 0, 6, 0, 65536));
    bytes.extend(request(CMD_BLOCK_STATUS, CMD_FLAG_REQ_ONE, 7, 0, 65536));
    bytes.extend(request(CMD_READ, 0, 8, 65536 - 512, 1024));
    bytes.extend(request(CMD_READ, 0, 9, 0, 0));
    bytes.extend(request(9, 0, 10, 0, 0));
    bytes.extend(write_request(11, 4096, &pattern(8192, 2)));
    bytes.extend(request(CMD_READ, 0, 12, 4096, 4096));
    bytes.extend(request(CMD_DISC, 0, 13, 0, 0));
    bytes
}

/// The mix with 32-byte headers, plus what only they can say: 64-bit effect lengths, a WRITE
/// without PAYLOAD_LEN (as qemu sends it), BLOCK_STATUS payloads (a good one, a bad id, a
/// short one), and a payload on a command that takes none.
fn extended_request_mix() -> Vec<u8> {
    let mut bytes = Vec::new();
    bytes.extend(extended_write(1, 0, &pattern(512, 1)));
    bytes.extend(extended_request(CMD_READ, 0, 2, 0, 512));
    bytes.extend(extended_request(CMD_TRIM, 0, 3, 4096, 1 << 33));
    bytes.extend(extended_request(CMD_WRITE_ZEROES, 0, 4, 8192, 4096));
    bytes.extend(extended_request(CMD_BLOCK_STATUS, 0, 5, 0, 1 << 40));
    bytes.extend(extended_request(
        CMD_BLOCK_STATUS,
        CMD_FLAG_REQ_ONE,
        6,
        0,
        65536,
    ));
    let mut filter = 65536u64.to_be_bytes().to_vec();
    filter.extend_from_slice(&1u32.to_be_bytes());
    for (handle, payload) in [
        (7, filter.clone()),
        (8, [&filter[..8], &[0, 0, 0, 9]].concat()),
        (9, filter[..8].to_vec()),
    ] {
        let flags = CMD_FLAG_PAYLOAD_LEN;
        bytes.extend(extended_request(
            CMD_BLOCK_STATUS,
            flags,
            handle,
            0,
            payload.len() as u64,
        ));
        bytes.extend(payload);
    }
    bytes.extend(extended_request(CMD_FLUSH, CMD_FLAG_PAYLOAD_LEN, 10, 0, 8));
    bytes.extend([0u8; 8]);
    bytes.extend(extended_request(CMD_WRITE, 0, 11, 4096, 16));
    bytes.extend(pattern(16, 3));
    bytes.extend(extended_request(CMD_READ, 0, 12, 4096, 1 << 32));
    bytes.extend(extended_request(CMD_READ, CMD_FLAG_DF, 13, 4096, 4096));
    bytes.extend(extended_request(CMD_DISC, 0, 14, 0, 0));
    bytes
}

/// Seeds for `nbd_requests`: (file name, bytes).
pub fn nbd_requests_seeds() -> Vec<(String, Vec<u8>)> {
    let mut seeds = Vec::new();
    for mode in [0, 1, 3, 4, 7, 8, 11] {
        let mut bytes = vec![mode];
        bytes.extend(request_mix());
        seeds.push((format!("mix-mode{mode}"), bytes));
    }
    for mode in [
        MODE_EXTENDED,
        MODE_EXTENDED | MODE_BASE_ALLOCATION,
        MODE_EXTENDED | MODE_BASE_ALLOCATION | MODE_READ_ONLY,
    ] {
        let mut bytes = vec![mode];
        bytes.extend(extended_request_mix());
        seeds.push((format!("extended-mix-mode{mode}"), bytes));
    }
    let mut pipelined = vec![MODE_STRUCTURED | MODE_BASE_ALLOCATION];
    for handle in 0..16u64 {
        pipelined.extend(write_request(
            100 + handle,
            handle * 4096,
            &pattern(4096, handle as u8),
        ));
        pipelined.extend(request(
            CMD_READ,
            CMD_FLAG_DF,
            200 + handle,
            handle * 4096,
            4096,
        ));
        pipelined.extend(request(
            CMD_BLOCK_STATUS,
            0,
            300 + handle,
            handle * 4096,
            8192,
        ));
    }
    seeds.push(("pipelined".into(), pipelined));
    seeds
}

/// Seeds for `nbd_handshake`: the client's bytes from the client flags on.
pub fn nbd_handshake_seeds() -> Vec<(String, Vec<u8>)> {
    let flags = (CLIENT_FLAG_FIXED_NEWSTYLE | CLIENT_FLAG_NO_ZEROES).to_be_bytes();
    let mut seeds = Vec::new();

    let mut full = flags.to_vec();
    full.extend(option(OPT_STRUCTURED_REPLY, &[]));
    full.extend(option(OPT_LIST, &[]));
    let all_info = [INFO_EXPORT, INFO_NAME, INFO_DESCRIPTION, INFO_BLOCK_SIZE];
    full.extend(option(OPT_INFO, &info_request(EXPORT_NAME, &all_info)));
    full.extend(option(
        OPT_LIST_META_CONTEXT,
        &meta_context_request(EXPORT_NAME, &[]),
    ));
    full.extend(option(
        OPT_SET_META_CONTEXT,
        &meta_context_request(EXPORT_NAME, &["base:", BASE_ALLOCATION]),
    ));
    full.extend(option(OPT_GO, &info_request(EXPORT_NAME, &[INFO_NAME])));
    full.extend(request(CMD_READ, 0, 1, 0, 4096));
    full.extend(request(CMD_BLOCK_STATUS, 0, 2, 0, 4096));
    full.extend(request(CMD_DISC, 0, 3, 0, 0));
    seeds.push(("structured-go".into(), full));

    let mut oldstyle_name = CLIENT_FLAG_FIXED_NEWSTYLE.to_be_bytes().to_vec();
    oldstyle_name.extend(option(OPT_EXPORT_NAME, EXPORT_NAME.as_bytes()));
    oldstyle_name.extend(write_request(1, 0, b"hello"));
    oldstyle_name.extend(request(CMD_READ, 0, 2, 0, 5));
    oldstyle_name.extend(request(CMD_FLUSH, 0, 3, 0, 0));
    seeds.push(("export-name-zeroes".into(), oldstyle_name));

    let mut refused = flags.to_vec();
    refused.extend(option(42, b"unknown option data"));
    refused.extend(option(OPT_STARTTLS, &[]));
    refused.extend(option(OPT_LIST, b"junk"));
    refused.extend(option(OPT_GO, &info_request("no-such-export", &[])));
    refused.extend(option(
        OPT_SET_META_CONTEXT,
        &meta_context_request(EXPORT_NAME, &[]),
    ));
    refused.extend(option(OPT_INFO, &[0, 0, 0, 9, b'd']));
    refused.extend(option(OPT_ABORT, &[]));
    seeds.push(("refusals-then-abort".into(), refused));

    let mut default_export = flags.to_vec();
    default_export.extend(option(OPT_GO, &info_request("", &[])));
    default_export.extend(request(CMD_WRITE_ZEROES, 0, 7, 0, 512));
    seeds.push(("go-default-export".into(), default_export));

    let mut read_only = flags.to_vec();
    read_only.extend(option(OPT_STRUCTURED_REPLY, &[]));
    read_only.extend(option(OPT_GO, &info_request(READ_ONLY_EXPORT_NAME, &[])));
    read_only.extend(write_request(1, 0, b"refused"));
    read_only.extend(request(CMD_TRIM, 0, 2, 0, 512));
    seeds.push(("read-only".into(), read_only));

    seeds.push(("bad-flags".into(), 0xffff_ffffu32.to_be_bytes().to_vec()));

    // Extended headers: refused data, structured replies after them, two contexts listed,
    // then GO and 32-byte requests with 64-bit lengths and a BLOCK_STATUS payload.
    let mut extended = flags.to_vec();
    extended.extend(option(OPT_EXTENDED_HEADERS, b"junk"));
    extended.extend(option(OPT_EXTENDED_HEADERS, &[]));
    extended.extend(option(OPT_STRUCTURED_REPLY, &[]));
    extended.extend(option(
        OPT_LIST_META_CONTEXT,
        &meta_context_request(EXPORT_NAME, &["base:", BUFCACHE_STATE, BUFCACHE_NAMESPACE]),
    ));
    extended.extend(option(
        OPT_SET_META_CONTEXT,
        &meta_context_request(EXPORT_NAME, &[BASE_ALLOCATION, BUFCACHE_STATE]),
    ));
    extended.extend(option(
        OPT_GO,
        &info_request(EXPORT_NAME, &[INFO_BLOCK_SIZE]),
    ));
    extended.extend(extended_write(1, 0, b"hello"));
    extended.extend(extended_request(CMD_BLOCK_STATUS, 0, 2, 0, 1 << 36));
    let mut filter = 4096u64.to_be_bytes().to_vec();
    filter.extend_from_slice(&1u32.to_be_bytes());
    extended.extend(extended_request(
        CMD_BLOCK_STATUS,
        CMD_FLAG_PAYLOAD_LEN,
        3,
        0,
        12,
    ));
    extended.extend(filter);
    extended.extend(extended_request(CMD_TRIM, 0, 4, 0, u64::MAX));
    extended.extend(request(CMD_READ, 0, 5, 0, 5));
    seeds.push(("extended-headers".into(), extended));

    // EXPORT_NAME after extended headers (the spec forbids it), and a failed SET that
    // forgets the earlier one.
    let mut export_name = flags.to_vec();
    export_name.extend(option(OPT_STRUCTURED_REPLY, &[]));
    export_name.extend(option(
        OPT_SET_META_CONTEXT,
        &meta_context_request(EXPORT_NAME, &[BASE_ALLOCATION]),
    ));
    export_name.extend(option(
        OPT_SET_META_CONTEXT,
        &meta_context_request("no-such-export", &[BASE_ALLOCATION]),
    ));
    export_name.extend(option(OPT_EXTENDED_HEADERS, &[]));
    export_name.extend(option(OPT_EXPORT_NAME, EXPORT_NAME.as_bytes()));
    seeds.push(("extended-then-export-name".into(), export_name));

    // Plain newstyle (no FIXED_NEWSTYLE): EXPORT_NAME with the 124 zeroes, then requests.
    let mut plain = 0u32.to_be_bytes().to_vec();
    plain.extend(option(OPT_EXPORT_NAME, EXPORT_NAME.as_bytes()));
    plain.extend(write_request(1, 0, b"plain"));
    plain.extend(request(CMD_READ, 0, 2, 0, 5));
    seeds.push(("plain-newstyle".into(), plain));
    seeds
}

fn option_reply(option: u32, reply_type: u32, payload: &[u8]) -> Vec<u8> {
    let mut bytes = Vec::new();
    put_option_reply(&mut bytes, option, reply_type, payload);
    bytes
}

fn greeting(flags: u16) -> Vec<u8> {
    let mut bytes = INIT_MAGIC.to_be_bytes().to_vec();
    bytes.extend_from_slice(&OPTION_MAGIC.to_be_bytes());
    bytes.extend_from_slice(&flags.to_be_bytes());
    bytes
}

fn info_export(size: u64, flags: u16) -> Vec<u8> {
    let mut payload = INFO_EXPORT.to_be_bytes().to_vec();
    payload.extend_from_slice(&size.to_be_bytes());
    payload.extend_from_slice(&flags.to_be_bytes());
    payload
}

fn info_block_size(minimum: u32, preferred: u32, maximum: u32) -> Vec<u8> {
    let mut payload = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
    for value in [minimum, preferred, maximum] {
        payload.extend_from_slice(&value.to_be_bytes());
    }
    payload
}

fn simple_reply(error: u32, handle: u64, data: &[u8]) -> Vec<u8> {
    let mut bytes = Vec::new();
    put_simple_reply(&mut bytes, error, handle);
    bytes.extend_from_slice(data);
    bytes
}

fn chunk(flags: u16, chunk_type: u16, handle: u64, payload: &[u8]) -> Vec<u8> {
    let mut bytes = Vec::new();
    put_structured_header(&mut bytes, flags, chunk_type, handle, payload.len() as u32);
    bytes.extend_from_slice(payload);
    bytes
}

fn extended_chunk(
    flags: u16,
    chunk_type: u16,
    handle: u64,
    offset: u64,
    payload: &[u8],
) -> Vec<u8> {
    let mut bytes = Vec::new();
    put_extended_header(
        &mut bytes,
        flags,
        chunk_type,
        handle,
        offset,
        payload.len() as u64,
    );
    bytes.extend_from_slice(payload);
    bytes
}

const ALL_FLAGS: u16 = TRANSMIT_HAS_FLAGS
    | TRANSMIT_SEND_FLUSH
    | TRANSMIT_SEND_FUA
    | TRANSMIT_SEND_TRIM
    | TRANSMIT_SEND_WRITE_ZEROES
    | TRANSMIT_SEND_CACHE
    | TRANSMIT_SEND_DF
    | TRANSMIT_CAN_MULTI_CONN;

/// Encodes an `nbd_client` input: the handshake bytes the fake server sends at once, then
/// one reply unit sent per request the client makes (each with a little-endian u16 length).
pub fn client_input(handshake: &[u8], units: &[Vec<u8>]) -> Vec<u8> {
    let mut bytes = (handshake.len() as u16).to_le_bytes().to_vec();
    bytes.extend_from_slice(handshake);
    for unit in units {
        bytes.extend_from_slice(&(unit.len() as u16).to_le_bytes());
        bytes.extend_from_slice(unit);
    }
    bytes
}

/// Seeds for `nbd_client`: what a server sends to a client that runs the requests of
/// `nbd::exercise_client` (read, write, flush, block status, zero, trim).
pub fn nbd_client_seeds() -> Vec<(String, Vec<u8>)> {
    let mut seeds = Vec::new();
    let handshake_structured = |size: u64| {
        let mut bytes = greeting(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
        bytes.extend(option_reply(OPT_EXTENDED_HEADERS, REP_ERR_UNSUP, &[]));
        bytes.extend(option_reply(OPT_STRUCTURED_REPLY, REP_ACK, &[]));
        let mut context = 1u32.to_be_bytes().to_vec();
        context.extend_from_slice(BASE_ALLOCATION.as_bytes());
        bytes.extend(option_reply(
            OPT_SET_META_CONTEXT,
            REP_META_CONTEXT,
            &context,
        ));
        bytes.extend(option_reply(OPT_SET_META_CONTEXT, REP_ACK, &[]));
        bytes.extend(option_reply(
            OPT_GO,
            REP_INFO,
            &info_export(size, ALL_FLAGS),
        ));
        bytes.extend(option_reply(
            OPT_GO,
            REP_INFO,
            &info_block_size(1, 4096, 1 << 20),
        ));
        bytes.extend(option_reply(OPT_GO, REP_ACK, &[]));
        bytes
    };

    // Structured replies: read (data chunk), write, flush, block status, zero, trim.
    let mut data = 0u64.to_be_bytes().to_vec();
    data.extend(pattern(512, 3));
    let mut status = 1u32.to_be_bytes().to_vec();
    for (length, flags) in [(1024u32, 0u32), (3072, STATE_HOLE | STATE_ZERO)] {
        status.extend_from_slice(&length.to_be_bytes());
        status.extend_from_slice(&flags.to_be_bytes());
    }
    let units = vec![
        chunk(REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, 1, &data),
        simple_reply(0, 2, &[]),
        chunk(REPLY_FLAG_DONE, REPLY_TYPE_NONE, 3, &[]),
        chunk(REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, 4, &status),
        simple_reply(0, 5, &[]),
        simple_reply(0, 6, &[]),
    ];
    seeds.push((
        "structured".into(),
        client_input(&handshake_structured(65536), &units),
    ));

    // A read answered in two chunks (data, then a hole), and error chunks.
    let mut first = 0u64.to_be_bytes().to_vec();
    first.extend(pattern(256, 4));
    let mut read = chunk(0, REPLY_TYPE_OFFSET_DATA, 1, &first);
    let mut hole = 256u64.to_be_bytes().to_vec();
    hole.extend_from_slice(&256u32.to_be_bytes());
    read.extend(chunk(REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_HOLE, 1, &hole));
    let mut error = 5u32.to_be_bytes().to_vec();
    error.extend_from_slice(&(11u16).to_be_bytes());
    error.extend_from_slice(b"disk failed");
    let mut error_offset = 28u32.to_be_bytes().to_vec();
    error_offset.extend_from_slice(&0u16.to_be_bytes());
    error_offset.extend_from_slice(&0u64.to_be_bytes());
    let mut status = 1u32.to_be_bytes().to_vec();
    status.extend_from_slice(&8192u32.to_be_bytes());
    status.extend_from_slice(&0u32.to_be_bytes());
    let units = vec![
        read,
        chunk(REPLY_FLAG_DONE, REPLY_TYPE_ERROR, 2, &error),
        chunk(REPLY_FLAG_DONE, REPLY_TYPE_ERROR_OFFSET, 3, &error_offset),
        chunk(REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, 4, &status),
        simple_reply(28, 5, &[]),
    ];
    seeds.push((
        "structured-chunks-and-errors".into(),
        client_input(&handshake_structured(1 << 30), &units),
    ));

    // No structured replies, no GO: the EXPORT_NAME fallback, then simple replies.
    let mut handshake = greeting(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
    handshake.extend(option_reply(OPT_EXTENDED_HEADERS, REP_ERR_UNSUP, &[]));
    handshake.extend(option_reply(OPT_STRUCTURED_REPLY, REP_ERR_UNSUP, &[]));
    handshake.extend(option_reply(OPT_GO, REP_ERR_UNSUP, b"no GO here"));
    handshake.extend_from_slice(&65536u64.to_be_bytes());
    handshake.extend_from_slice(&ALL_FLAGS.to_be_bytes());
    let units = vec![
        simple_reply(0, 1, &pattern(512, 5)),
        simple_reply(0, 2, &[]),
        simple_reply(5, 3, &[]),
        simple_reply(0, 4, &[]),
        simple_reply(0, 5, &[]),
    ];
    seeds.push((
        "export-name-simple".into(),
        client_input(&handshake, &units),
    ));

    // Zeroes after EXPORT_NAME, no flags at all (so writes of zeroes are plain writes).
    let mut handshake = greeting(FLAG_FIXED_NEWSTYLE);
    handshake.extend(option_reply(OPT_EXTENDED_HEADERS, REP_ERR_UNSUP, &[]));
    handshake.extend(option_reply(OPT_STRUCTURED_REPLY, REP_ERR_UNSUP, &[]));
    handshake.extend(option_reply(OPT_GO, REP_ERR_UNSUP, &[]));
    handshake.extend_from_slice(&4096u64.to_be_bytes());
    handshake.extend_from_slice(&TRANSMIT_HAS_FLAGS.to_be_bytes());
    handshake.extend_from_slice(&[0u8; 124]);
    let units = vec![
        simple_reply(0, 1, &pattern(512, 6)),
        simple_reply(0, 2, &[]),
        simple_reply(0, 3, &[]),
    ];
    seeds.push((
        "export-name-zeroes".into(),
        client_input(&handshake, &units),
    ));

    // GO with small block sizes: requests are split.
    let mut handshake = greeting(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
    handshake.extend(option_reply(OPT_EXTENDED_HEADERS, REP_ERR_UNSUP, &[]));
    handshake.extend(option_reply(OPT_STRUCTURED_REPLY, REP_ERR_UNSUP, &[]));
    handshake.extend(option_reply(
        OPT_GO,
        REP_INFO,
        &info_export(8192, ALL_FLAGS),
    ));
    handshake.extend(option_reply(
        OPT_GO,
        REP_INFO,
        &info_block_size(512, 512, 512),
    ));
    handshake.extend(option_reply(OPT_GO, REP_ACK, &[]));
    let units = vec![
        simple_reply(0, 1, &pattern(512, 7)),
        simple_reply(0, 2, &[]),
    ];
    seeds.push(("block-size-512".into(), client_input(&handshake, &units)));

    let mut refused = greeting(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
    refused.extend(option_reply(OPT_EXTENDED_HEADERS, REP_ERR_UNSUP, &[]));
    refused.extend(option_reply(OPT_STRUCTURED_REPLY, REP_ACK, &[]));
    refused.extend(option_reply(OPT_SET_META_CONTEXT, REP_ERR_UNSUP, &[]));
    refused.extend(option_reply(OPT_GO, REP_ERR_UNKNOWN, b"no such export"));
    seeds.push(("refused".into(), client_input(&refused, &[])));

    // Extended headers: every reply an extended chunk (data, none, 64-bit block status, an
    // error), and the rest of an unknown chunk type.
    let mut handshake = greeting(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
    handshake.extend(option_reply(OPT_EXTENDED_HEADERS, REP_ACK, &[]));
    let mut context = 1u32.to_be_bytes().to_vec();
    context.extend_from_slice(BASE_ALLOCATION.as_bytes());
    handshake.extend(option_reply(
        OPT_SET_META_CONTEXT,
        REP_META_CONTEXT,
        &context,
    ));
    handshake.extend(option_reply(OPT_SET_META_CONTEXT, REP_ACK, &[]));
    handshake.extend(option_reply(
        OPT_GO,
        REP_INFO,
        &info_export(1 << 33, ALL_FLAGS),
    ));
    handshake.extend(option_reply(OPT_GO, REP_ACK, &[]));
    let mut data = 0u64.to_be_bytes().to_vec();
    data.extend(pattern(512, 8));
    let mut status = 1u32.to_be_bytes().to_vec();
    status.extend_from_slice(&2u32.to_be_bytes());
    for (length, flags) in [(1024u64, 0u64), (3072, u64::from(STATE_HOLE | STATE_ZERO))] {
        status.extend_from_slice(&length.to_be_bytes());
        status.extend_from_slice(&flags.to_be_bytes());
    }
    let mut error = 5u32.to_be_bytes().to_vec();
    error.extend_from_slice(&0u16.to_be_bytes());
    let units = vec![
        extended_chunk(REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, 1, 0, &data),
        extended_chunk(REPLY_FLAG_DONE, REPLY_TYPE_NONE, 2, 0, &[]),
        extended_chunk(REPLY_FLAG_DONE, REPLY_TYPE_NONE, 3, 0, &[]),
        extended_chunk(REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS_EXT, 4, 0, &status),
        extended_chunk(REPLY_FLAG_DONE, REPLY_TYPE_ERROR, 5, 0, &error),
        simple_reply(0, 6, &[]),
    ];
    seeds.push(("extended".into(), client_input(&handshake, &units)));

    let mut oldstyle = INIT_MAGIC.to_be_bytes().to_vec();
    oldstyle.extend_from_slice(&0x0000_4202_8186_1253u64.to_be_bytes());
    seeds.push(("oldstyle".into(), client_input(&oldstyle, &[])));
    seeds
}
