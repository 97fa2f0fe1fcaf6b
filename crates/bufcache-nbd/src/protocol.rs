//! Wire constants and fixed-size message layouts of the NBD protocol, shared by the server
//! and the client.
//!
//! Everything here is pure: encoding and decoding of the handshake, option, request and reply
//! headers in network byte order, and the mapping between `std::io::Error` and the small set
//! of errno values the protocol allows on the wire. Nothing here touches a socket, so both
//! sides agree on the bytes by construction. Names follow the specification (`NBD_OPT_GO` is
//! [`OPT_GO`]) so the code can be read next to it.

use std::io;

/// `NBDMAGIC`: the first eight bytes the server sends.
pub const INIT_MAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: newstyle negotiation magic, also the prefix of every option the client sends.
pub const OPTION_MAGIC: u64 = 0x4948_4156_454f_5054;
/// Prefix of every option reply the server sends.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Prefix of every transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Prefix of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Prefix of a structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
/// Prefix of every transmission request once extended headers are negotiated.
pub const EXTENDED_REQUEST_MAGIC: u32 = 0x21e4_1c71;
/// Prefix of every reply chunk once extended headers are negotiated.
pub const EXTENDED_REPLY_MAGIC: u32 = 0x6e8a_278c;

/// Handshake flags (server → client, 16 bits).
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// Server will omit the 124 zero bytes after `NBD_OPT_EXPORT_NAME` if the client agrees.
pub const FLAG_NO_ZEROES: u16 = 1 << 1;

/// Client flags (client → server, 32 bits).
pub const CLIENT_FLAG_FIXED_NEWSTYLE: u32 = 1 << 0;
/// Client agrees to the omission of the 124 zero bytes.
pub const CLIENT_FLAG_NO_ZEROES: u32 = 1 << 1;

/// Transmission flags (16 bits), sent with the export's size.
pub const TRANSMIT_HAS_FLAGS: u16 = 1 << 0;
pub const TRANSMIT_READ_ONLY: u16 = 1 << 1;
pub const TRANSMIT_SEND_FLUSH: u16 = 1 << 2;
pub const TRANSMIT_SEND_FUA: u16 = 1 << 3;
pub const TRANSMIT_ROTATIONAL: u16 = 1 << 4;
pub const TRANSMIT_SEND_TRIM: u16 = 1 << 5;
pub const TRANSMIT_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const TRANSMIT_SEND_DF: u16 = 1 << 7;
pub const TRANSMIT_CAN_MULTI_CONN: u16 = 1 << 8;
pub const TRANSMIT_SEND_RESIZE: u16 = 1 << 9;
pub const TRANSMIT_SEND_CACHE: u16 = 1 << 10;
pub const TRANSMIT_SEND_FAST_ZERO: u16 = 1 << 11;
/// BLOCK_STATUS may carry a payload naming the contexts to answer (extended headers only).
pub const TRANSMIT_BLOCK_STATUS_PAYLOAD: u16 = 1 << 12;

/// Option numbers.
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;
pub const OPT_EXTENDED_HEADERS: u32 = 11;

/// Option reply types.
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
const REP_ERROR_BIT: u32 = 1 << 31;
pub const REP_ERR_UNSUP: u32 = REP_ERROR_BIT + 1;
pub const REP_ERR_POLICY: u32 = REP_ERROR_BIT + 2;
pub const REP_ERR_INVALID: u32 = REP_ERROR_BIT + 3;
pub const REP_ERR_PLATFORM: u32 = REP_ERROR_BIT + 4;
pub const REP_ERR_TLS_REQD: u32 = REP_ERROR_BIT + 5;
pub const REP_ERR_UNKNOWN: u32 = REP_ERROR_BIT + 6;
pub const REP_ERR_SHUTDOWN: u32 = REP_ERROR_BIT + 7;
pub const REP_ERR_BLOCK_SIZE_REQD: u32 = REP_ERROR_BIT + 8;
pub const REP_ERR_TOO_BIG: u32 = REP_ERROR_BIT + 9;
pub const REP_ERR_EXT_HEADER_REQD: u32 = REP_ERROR_BIT + 10;

/// True for option reply types that report an error.
pub fn is_option_error(reply_type: u32) -> bool {
    reply_type & REP_ERROR_BIT != 0
}

/// `NBD_INFO_*` types carried in `NBD_REP_INFO` replies to `NBD_OPT_INFO` / `NBD_OPT_GO`.
pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

/// Command types.
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_CACHE: u16 = 5;
pub const CMD_WRITE_ZEROES: u16 = 6;
pub const CMD_BLOCK_STATUS: u16 = 7;

/// Command flags.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const CMD_FLAG_DF: u16 = 1 << 2;
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;
/// Extended headers: the length is a payload's length, and the payload follows.
pub const CMD_FLAG_PAYLOAD_LEN: u16 = 1 << 5;

/// Structured reply flags and chunk types.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const REPLY_TYPE_BLOCK_STATUS_EXT: u16 = 6;
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;
pub const REPLY_TYPE_ERROR_OFFSET: u16 = (1 << 15) + 2;

/// True for structured chunk types that report an error.
pub fn is_reply_error(chunk_type: u16) -> bool {
    chunk_type & (1 << 15) != 0
}

/// `base:allocation` status flags.
pub const STATE_HOLE: u32 = 1 << 0;
pub const STATE_ZERO: u32 = 1 << 1;

/// The metadata context every export offers: holes and zeroes.
pub const BASE_ALLOCATION: &str = "base:allocation";

/// The namespace of bufcache's own metadata contexts. The NBD spec allows only `base`,
/// `nbd-server`, registered third-party namespaces and `x-*` ("for local experiments");
/// `bufcache` is not registered, so its contexts live under `x-bufcache:`
/// (docs/protocol.md, "`x-bufcache:state`").
pub const BUFCACHE_NAMESPACE: &str = "x-bufcache:";

/// The metadata context a cache export offers: which blocks are in the cache, and which of
/// them are dirty (see docs/protocol.md).
pub const BUFCACHE_STATE: &str = "x-bufcache:state";

/// `x-bufcache:state` status flags: the block is in the cache (clean or dirty)...
pub const CACHE_STATE_RESIDENT: u32 = 1 << 0;
/// ...and is newer than the backend (written, not yet written back).
pub const CACHE_STATE_DIRTY: u32 = 1 << 1;

/// Byte sizes of the fixed headers.
pub const REQUEST_HEADER_BYTES: usize = 28;
pub const EXTENDED_REQUEST_HEADER_BYTES: usize = 32;
pub const EXTENDED_REPLY_HEADER_BYTES: usize = 32;
pub const SIMPLE_REPLY_HEADER_BYTES: usize = 16;
pub const STRUCTURED_REPLY_HEADER_BYTES: usize = 20;
pub const OPTION_HEADER_BYTES: usize = 16;
pub const OPTION_REPLY_HEADER_BYTES: usize = 20;

/// Largest string the specification allows (export names, messages, queries).
pub const STRING_BYTES_MAX: usize = 4096;

/// Default block size limits a client assumes when the server sends no `NBD_INFO_BLOCK_SIZE`.
pub const DEFAULT_BLOCK_SIZE_MIN: u32 = 1;
pub const DEFAULT_BLOCK_SIZE_PREFERRED: u32 = 4096;
pub const DEFAULT_BLOCK_SIZE_MAX: u32 = 32 << 20;

/// The TCP port IANA reserved for NBD.
pub const DEFAULT_PORT: u16 = 10809;

/// NBD errno values: the protocol fixes these numbers whatever the host's errno.h says.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Errno {
    Perm,
    Io,
    NoMemory,
    Invalid,
    NoSpace,
    Overflow,
    NotSupported,
    Shutdown,
    /// A value outside the set the protocol defines, kept so a client can report it.
    Other(u32),
}

impl Errno {
    /// The number sent on the wire.
    pub fn code(self) -> u32 {
        match self {
            Errno::Perm => 1,
            Errno::Io => 5,
            Errno::NoMemory => 12,
            Errno::Invalid => 22,
            Errno::NoSpace => 28,
            Errno::Overflow => 75,
            Errno::NotSupported => 95,
            Errno::Shutdown => 108,
            Errno::Other(code) => code,
        }
    }

    /// Decodes a number received on the wire.
    pub fn from_code(code: u32) -> Errno {
        match code {
            1 => Errno::Perm,
            5 => Errno::Io,
            12 => Errno::NoMemory,
            22 => Errno::Invalid,
            28 => Errno::NoSpace,
            75 => Errno::Overflow,
            95 => Errno::NotSupported,
            108 => Errno::Shutdown,
            other => Errno::Other(other),
        }
    }

    /// The symbolic name, for messages (`EIO`).
    pub fn name(self) -> String {
        match self {
            Errno::Perm => "EPERM".into(),
            Errno::Io => "EIO".into(),
            Errno::NoMemory => "ENOMEM".into(),
            Errno::Invalid => "EINVAL".into(),
            Errno::NoSpace => "ENOSPC".into(),
            Errno::Overflow => "EOVERFLOW".into(),
            Errno::NotSupported => "ENOTSUP".into(),
            Errno::Shutdown => "ESHUTDOWN".into(),
            Errno::Other(code) => format!("errno {code}"),
        }
    }

    /// The error kind a local caller sees for this remote error.
    pub fn io_kind(self) -> io::ErrorKind {
        match self {
            Errno::Perm => io::ErrorKind::PermissionDenied,
            Errno::Invalid | Errno::Overflow => io::ErrorKind::InvalidInput,
            Errno::NoMemory => io::ErrorKind::OutOfMemory,
            Errno::NotSupported => io::ErrorKind::Unsupported,
            Errno::Shutdown => io::ErrorKind::ConnectionAborted,
            // Kept as a kind, so an upstream's ENOSPC reaches our own clients as ENOSPC.
            Errno::NoSpace => io::ErrorKind::StorageFull,
            Errno::Io | Errno::Other(_) => io::ErrorKind::Other,
        }
    }

    /// Chooses the errno to send for a local error. The host errno wins when there is one,
    /// because it is the most precise; otherwise the error kind decides, and EIO is the
    /// default because it is what every client treats as "the device failed".
    pub fn from_io_error(error: &io::Error) -> Errno {
        if let Some(code) = error.raw_os_error() {
            match code {
                libc::EPERM | libc::EACCES | libc::EROFS => return Errno::Perm,
                libc::ENOMEM => return Errno::NoMemory,
                libc::EINVAL => return Errno::Invalid,
                libc::ENOSPC | libc::EDQUOT | libc::EFBIG => return Errno::NoSpace,
                libc::EOVERFLOW => return Errno::Overflow,
                libc::ENOTSUP => return Errno::NotSupported,
                libc::ESHUTDOWN => return Errno::Shutdown,
                _ => return Errno::Io,
            }
        }
        match error.kind() {
            io::ErrorKind::PermissionDenied => Errno::Perm,
            io::ErrorKind::InvalidInput => Errno::Invalid,
            io::ErrorKind::OutOfMemory => Errno::NoMemory,
            io::ErrorKind::Unsupported => Errno::NotSupported,
            // A device's ENOSPC, EDQUOT or EFBIG keeps its kind through the engine's errors
            // (which carry no OS code): the client hears "no space", as from nbdkit.
            io::ErrorKind::StorageFull
            | io::ErrorKind::QuotaExceeded
            | io::ErrorKind::FileTooLarge => Errno::NoSpace,
            _ => Errno::Io,
        }
    }
}

impl std::fmt::Display for Errno {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(&self.name())
    }
}

/// The symbolic name of a command type, for messages.
pub fn command_name(command: u16) -> String {
    match command {
        CMD_READ => "READ".into(),
        CMD_WRITE => "WRITE".into(),
        CMD_DISC => "DISC".into(),
        CMD_FLUSH => "FLUSH".into(),
        CMD_TRIM => "TRIM".into(),
        CMD_CACHE => "CACHE".into(),
        CMD_WRITE_ZEROES => "WRITE_ZEROES".into(),
        CMD_BLOCK_STATUS => "BLOCK_STATUS".into(),
        other => format!("command {other}"),
    }
}

/// A transmission request header (without the write payload), compact (28 bytes, 32-bit
/// length) or extended (32 bytes, 64-bit length).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestHeader {
    pub flags: u16,
    pub command: u16,
    pub handle: u64,
    pub offset: u64,
    /// The effect length, or with `CMD_FLAG_PAYLOAD_LEN` (and for a compact WRITE) the
    /// payload's length. At most `u32::MAX` in a compact header.
    pub length: u64,
}

impl RequestHeader {
    /// Encodes the header in wire order, compact. The length must fit in 32 bits.
    pub fn encode(&self) -> [u8; REQUEST_HEADER_BYTES] {
        assert!(
            self.length <= u64::from(u32::MAX),
            "a compact request header holds a 32-bit length, not {}",
            self.length
        );
        let mut bytes = [0u8; REQUEST_HEADER_BYTES];
        bytes[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        bytes[4..6].copy_from_slice(&self.flags.to_be_bytes());
        bytes[6..8].copy_from_slice(&self.command.to_be_bytes());
        bytes[8..16].copy_from_slice(&self.handle.to_be_bytes());
        bytes[16..24].copy_from_slice(&self.offset.to_be_bytes());
        bytes[24..28].copy_from_slice(&(self.length as u32).to_be_bytes());
        bytes
    }

    /// Encodes the header in wire order, extended.
    pub fn encode_extended(&self) -> [u8; EXTENDED_REQUEST_HEADER_BYTES] {
        let mut bytes = [0u8; EXTENDED_REQUEST_HEADER_BYTES];
        bytes[0..4].copy_from_slice(&EXTENDED_REQUEST_MAGIC.to_be_bytes());
        bytes[4..6].copy_from_slice(&self.flags.to_be_bytes());
        bytes[6..8].copy_from_slice(&self.command.to_be_bytes());
        bytes[8..16].copy_from_slice(&self.handle.to_be_bytes());
        bytes[16..24].copy_from_slice(&self.offset.to_be_bytes());
        bytes[24..32].copy_from_slice(&self.length.to_be_bytes());
        bytes
    }

    /// Decodes a compact header; `None` when the magic is wrong (the stream cannot be
    /// resynchronised).
    pub fn decode(bytes: &[u8; REQUEST_HEADER_BYTES]) -> Option<RequestHeader> {
        if be_u32(&bytes[0..4]) != REQUEST_MAGIC {
            return None;
        }
        Some(RequestHeader {
            flags: be_u16(&bytes[4..6]),
            command: be_u16(&bytes[6..8]),
            handle: be_u64(&bytes[8..16]),
            offset: be_u64(&bytes[16..24]),
            length: u64::from(be_u32(&bytes[24..28])),
        })
    }

    /// Decodes an extended header; `None` when the magic is wrong.
    pub fn decode_extended(bytes: &[u8; EXTENDED_REQUEST_HEADER_BYTES]) -> Option<RequestHeader> {
        if be_u32(&bytes[0..4]) != EXTENDED_REQUEST_MAGIC {
            return None;
        }
        Some(RequestHeader {
            flags: be_u16(&bytes[4..6]),
            command: be_u16(&bytes[6..8]),
            handle: be_u64(&bytes[8..16]),
            offset: be_u64(&bytes[16..24]),
            length: be_u64(&bytes[24..32]),
        })
    }
}

/// Appends a simple reply header to `out`.
pub fn put_simple_reply(out: &mut Vec<u8>, error: u32, handle: u64) {
    out.extend_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&error.to_be_bytes());
    out.extend_from_slice(&handle.to_be_bytes());
}

/// Appends a structured reply chunk header to `out`.
pub fn put_structured_header(
    out: &mut Vec<u8>,
    flags: u16,
    chunk_type: u16,
    handle: u64,
    payload_length: u32,
) {
    out.extend_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
    out.extend_from_slice(&chunk_type.to_be_bytes());
    out.extend_from_slice(&handle.to_be_bytes());
    out.extend_from_slice(&payload_length.to_be_bytes());
}

/// Appends an extended reply chunk header to `out`: like a structured one, with the request's
/// offset echoed and a 64-bit payload length.
pub fn put_extended_header(
    out: &mut Vec<u8>,
    flags: u16,
    chunk_type: u16,
    handle: u64,
    offset: u64,
    payload_length: u64,
) {
    out.extend_from_slice(&EXTENDED_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
    out.extend_from_slice(&chunk_type.to_be_bytes());
    out.extend_from_slice(&handle.to_be_bytes());
    out.extend_from_slice(&offset.to_be_bytes());
    out.extend_from_slice(&payload_length.to_be_bytes());
}

/// Appends an option reply (header and payload) to `out`.
pub fn put_option_reply(out: &mut Vec<u8>, option: u32, reply_type: u32, payload: &[u8]) {
    out.extend_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&reply_type.to_be_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
}

/// Reads a big-endian u16 from the first two bytes of `bytes`.
pub fn be_u16(bytes: &[u8]) -> u16 {
    u16::from_be_bytes([bytes[0], bytes[1]])
}

/// Reads a big-endian u32 from the first four bytes of `bytes`.
pub fn be_u32(bytes: &[u8]) -> u32 {
    u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
}

/// Reads a big-endian u64 from the first eight bytes of `bytes`.
pub fn be_u64(bytes: &[u8]) -> u64 {
    let mut array = [0u8; 8];
    array.copy_from_slice(&bytes[..8]);
    u64::from_be_bytes(array)
}

/// A cursor over an option or chunk payload that refuses to read past its end, so malformed
/// input from the peer becomes `None` instead of a panic.
pub struct PayloadReader<'a> {
    bytes: &'a [u8],
}

impl<'a> PayloadReader<'a> {
    pub fn new(bytes: &'a [u8]) -> Self {
        PayloadReader { bytes }
    }

    pub fn remaining(&self) -> usize {
        self.bytes.len()
    }

    pub fn take(&mut self, count: usize) -> Option<&'a [u8]> {
        if count > self.bytes.len() {
            return None;
        }
        let (head, tail) = self.bytes.split_at(count);
        self.bytes = tail;
        Some(head)
    }

    pub fn u16(&mut self) -> Option<u16> {
        self.take(2).map(be_u16)
    }

    pub fn u32(&mut self) -> Option<u32> {
        self.take(4).map(be_u32)
    }

    pub fn u64(&mut self) -> Option<u64> {
        self.take(8).map(be_u64)
    }

    /// A length-prefixed (u32) UTF-8 string of at most [`STRING_BYTES_MAX`] bytes.
    pub fn string_u32(&mut self) -> Option<String> {
        let length = self.u32()? as usize;
        if length > STRING_BYTES_MAX {
            return None;
        }
        let bytes = self.take(length)?;
        String::from_utf8(bytes.to_vec()).ok()
    }

    /// Everything left, as one UTF-8 string.
    pub fn rest_string(&mut self) -> Option<String> {
        let bytes = self.take(self.bytes.len())?;
        String::from_utf8(bytes.to_vec()).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_header_round_trips() {
        let header = RequestHeader {
            flags: CMD_FLAG_FUA,
            command: CMD_WRITE,
            handle: 0x0102_0304_0506_0708,
            offset: 1 << 40,
            length: 65536,
        };
        assert_eq!(RequestHeader::decode(&header.encode()), Some(header));
    }

    #[test]
    fn extended_request_header_round_trips_a_64_bit_length_and_magics_do_not_mix() {
        let header = RequestHeader {
            flags: CMD_FLAG_REQ_ONE,
            command: CMD_BLOCK_STATUS,
            handle: 9,
            offset: 1 << 33,
            length: (1 << 35) + 17,
        };
        let bytes = header.encode_extended();
        assert_eq!(RequestHeader::decode_extended(&bytes), Some(header));
        let compact: [u8; REQUEST_HEADER_BYTES] = bytes[..REQUEST_HEADER_BYTES].try_into().unwrap();
        assert_eq!(RequestHeader::decode(&compact), None);
        let mut extended = [0u8; EXTENDED_REQUEST_HEADER_BYTES];
        extended[..REQUEST_HEADER_BYTES].copy_from_slice(
            &RequestHeader {
                length: 1,
                ..header
            }
            .encode(),
        );
        assert_eq!(RequestHeader::decode_extended(&extended), None);
    }

    #[test]
    fn request_header_with_bad_magic_is_refused() {
        let mut bytes = RequestHeader {
            flags: 0,
            command: CMD_READ,
            handle: 1,
            offset: 0,
            length: 1,
        }
        .encode();
        bytes[0] ^= 0xff;
        assert_eq!(RequestHeader::decode(&bytes), None);
    }

    #[test]
    fn errno_codes_round_trip_and_io_errors_map() {
        for errno in [
            Errno::Perm,
            Errno::Io,
            Errno::NoMemory,
            Errno::Invalid,
            Errno::NoSpace,
            Errno::Overflow,
            Errno::NotSupported,
            Errno::Shutdown,
        ] {
            assert_eq!(Errno::from_code(errno.code()), errno);
        }
        let enospc = io::Error::from_raw_os_error(libc::ENOSPC);
        assert_eq!(Errno::from_io_error(&enospc), Errno::NoSpace);
        let unsupported = io::Error::from(io::ErrorKind::Unsupported);
        assert_eq!(Errno::from_io_error(&unsupported), Errno::NotSupported);
        let other = io::Error::other("boom");
        assert_eq!(Errno::from_io_error(&other), Errno::Io);
    }

    #[test]
    fn payload_reader_refuses_to_overrun() {
        let mut reader = PayloadReader::new(&[0, 0, 0, 9, b'a']);
        assert_eq!(reader.string_u32(), None);
    }
}
