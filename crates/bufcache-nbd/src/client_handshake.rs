//! The client's side of the fixed newstyle handshake: ask for extended headers (else
//! structured replies) and the `base:allocation` context, then enter the export with
//! `NBD_OPT_GO` (falling back to `NBD_OPT_EXPORT_NAME` when the server knows neither GO nor
//! extended headers), learning its size, transmission flags and block size limits.
//!
//! Invariants: only fixed newstyle servers are accepted; every option reply is checked for
//! magic, option number and a bounded length, so a confused server fails the connect with a
//! message instead of hanging or allocating without bound.

use std::io::{Read, Write};

use crate::protocol::*;
use crate::stream::Stream;

/// Option replies larger than this are refused (real ones are a few hundred bytes).
const OPTION_REPLY_BYTES_MAX: u32 = 64 * 1024;

/// What the client learned about the export during the handshake.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportInfo {
    pub size_bytes: u64,
    pub transmission_flags: u16,
    pub block_size_min: u32,
    pub block_size_preferred: u32,
    pub block_size_max: u32,
    pub structured_replies: bool,
    /// The server agreed to extended headers: 32-byte requests with 64-bit lengths, and every
    /// reply an extended chunk (`structured_replies` is set too).
    pub extended_headers: bool,
    /// Context id of `base:allocation` when the server agreed to it.
    pub base_allocation_id: Option<u32>,
}

impl ExportInfo {
    pub fn has_flag(&self, flag: u16) -> bool {
        self.transmission_flags & flag != 0
    }

    pub fn read_only(&self) -> bool {
        self.has_flag(TRANSMIT_READ_ONLY)
    }

    pub fn can_multi_conn(&self) -> bool {
        self.has_flag(TRANSMIT_CAN_MULTI_CONN)
    }
}

/// Why the handshake failed; the caller adds the URI.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeFailure {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("not an NBD server (bad greeting magic)")]
    NotNbd,
    #[error("the server speaks only the oldstyle handshake, which is not supported")]
    Oldstyle,
    #[error("the server does not support fixed newstyle negotiation")]
    NotFixedNewstyle,
    #[error("malformed reply to option {option}: {reason}")]
    Malformed { option: u32, reason: String },
    #[error("the server refused export {export:?}: {reason}")]
    Refused { export: String, reason: String },
    #[error("the server refused NBD_OPT_STARTTLS (reply type {0:#x}): it does not offer TLS")]
    StartTlsRefused(u32),
    #[error("TLS: {0}")]
    Tls(String),
}

/// One option reply.
struct OptionReply {
    reply_type: u32,
    payload: Vec<u8>,
}

/// Runs the handshake on a freshly connected stream.
/// With `tls`, the client upgrades with `NBD_OPT_STARTTLS` before any other option and
/// fails when the server does not offer TLS (it never falls back to plain text).
pub(crate) fn negotiate(
    stream: &mut Stream,
    export_name: &str,
    tls: Option<(&crate::uri::ClientTls, Option<&str>)>,
) -> Result<ExportInfo, HandshakeFailure> {
    let no_zeroes = read_greeting(stream)?;
    let mut client_flags = CLIENT_FLAG_FIXED_NEWSTYLE;
    if no_zeroes {
        client_flags |= CLIENT_FLAG_NO_ZEROES;
    }
    stream.write_all(&client_flags.to_be_bytes())?;
    if let Some((settings, host)) = tls {
        send_option(stream, OPT_STARTTLS, &[])?;
        let reply = read_option_reply(stream, OPT_STARTTLS)?;
        if reply.reply_type != REP_ACK {
            return Err(HandshakeFailure::StartTlsRefused(reply.reply_type));
        }
        crate::tls::client_upgrade(stream, settings, host)
            .map_err(|error| HandshakeFailure::Tls(error.to_string()))?;
    }
    let extended_headers = request_extended_headers(stream)?;
    let structured_replies = extended_headers || request_structured_replies(stream)?;
    let base_allocation_id = if structured_replies {
        request_base_allocation(stream, export_name)?
    } else {
        None
    };
    let mut info = ExportInfo {
        size_bytes: 0,
        transmission_flags: 0,
        block_size_min: DEFAULT_BLOCK_SIZE_MIN,
        block_size_preferred: DEFAULT_BLOCK_SIZE_PREFERRED,
        block_size_max: DEFAULT_BLOCK_SIZE_MAX,
        structured_replies,
        extended_headers,
        base_allocation_id,
    };
    if !go(stream, export_name, &mut info)? {
        if extended_headers {
            // The spec forbids both a server refusing GO after extended headers and a client
            // using EXPORT_NAME after them.
            return Err(HandshakeFailure::Malformed {
                option: OPT_GO,
                reason: "NBD_OPT_GO unsupported after extended headers were agreed".into(),
            });
        }
        export_name_fallback(stream, export_name, no_zeroes, &mut info)?;
    }
    Ok(info)
}

/// Reads the greeting; true when the server offers to drop the 124 zero bytes.
fn read_greeting(stream: &mut Stream) -> Result<bool, HandshakeFailure> {
    let mut greeting = [0u8; 18];
    stream.read_exact(&mut greeting[..16])?;
    if be_u64(&greeting[0..8]) != INIT_MAGIC {
        return Err(HandshakeFailure::NotNbd);
    }
    if be_u64(&greeting[8..16]) != OPTION_MAGIC {
        return Err(HandshakeFailure::Oldstyle);
    }
    stream.read_exact(&mut greeting[16..18])?;
    let flags = be_u16(&greeting[16..18]);
    if flags & FLAG_FIXED_NEWSTYLE == 0 {
        return Err(HandshakeFailure::NotFixedNewstyle);
    }
    Ok(flags & FLAG_NO_ZEROES != 0)
}

fn send_option(stream: &mut Stream, option: u32, data: &[u8]) -> std::io::Result<()> {
    let mut message = Vec::with_capacity(OPTION_HEADER_BYTES + data.len());
    message.extend_from_slice(&OPTION_MAGIC.to_be_bytes());
    message.extend_from_slice(&option.to_be_bytes());
    message.extend_from_slice(&(data.len() as u32).to_be_bytes());
    message.extend_from_slice(data);
    stream.write_all(&message)
}

fn read_option_reply(stream: &mut Stream, option: u32) -> Result<OptionReply, HandshakeFailure> {
    let malformed = |reason: String| HandshakeFailure::Malformed { option, reason };
    let mut header = [0u8; OPTION_REPLY_HEADER_BYTES];
    stream.read_exact(&mut header)?;
    if be_u64(&header[0..8]) != OPTION_REPLY_MAGIC {
        return Err(malformed("bad option reply magic".into()));
    }
    let replied_option = be_u32(&header[8..12]);
    if replied_option != option {
        return Err(malformed(format!("reply is for option {replied_option}")));
    }
    let length = be_u32(&header[16..20]);
    if length > OPTION_REPLY_BYTES_MAX {
        return Err(malformed(format!("reply of {length} bytes is too long")));
    }
    let mut payload = vec![0u8; length as usize];
    stream.read_exact(&mut payload)?;
    Ok(OptionReply {
        reply_type: be_u32(&header[12..16]),
        payload,
    })
}

/// Asks for extended headers; false when the server does not know them (or refuses).
fn request_extended_headers(stream: &mut Stream) -> Result<bool, HandshakeFailure> {
    send_option(stream, OPT_EXTENDED_HEADERS, &[])?;
    let reply = read_option_reply(stream, OPT_EXTENDED_HEADERS)?;
    Ok(reply.reply_type == REP_ACK)
}

fn request_structured_replies(stream: &mut Stream) -> Result<bool, HandshakeFailure> {
    send_option(stream, OPT_STRUCTURED_REPLY, &[])?;
    let reply = read_option_reply(stream, OPT_STRUCTURED_REPLY)?;
    Ok(reply.reply_type == REP_ACK)
}

/// Selects `base:allocation`; `None` when the server does not offer it.
fn request_base_allocation(
    stream: &mut Stream,
    export_name: &str,
) -> Result<Option<u32>, HandshakeFailure> {
    let mut data = Vec::new();
    data.extend_from_slice(&(export_name.len() as u32).to_be_bytes());
    data.extend_from_slice(export_name.as_bytes());
    data.extend_from_slice(&1u32.to_be_bytes());
    data.extend_from_slice(&(BASE_ALLOCATION.len() as u32).to_be_bytes());
    data.extend_from_slice(BASE_ALLOCATION.as_bytes());
    send_option(stream, OPT_SET_META_CONTEXT, &data)?;
    let mut id = None;
    loop {
        let reply = read_option_reply(stream, OPT_SET_META_CONTEXT)?;
        match reply.reply_type {
            REP_META_CONTEXT => {
                let mut reader = PayloadReader::new(&reply.payload);
                let context_id = reader.u32();
                if reader.rest_string().as_deref() == Some(BASE_ALLOCATION) {
                    id = context_id;
                }
            }
            REP_ACK => return Ok(id),
            // An error (unsupported, unknown export) just means no block status; a real
            // problem with the export shows up in GO with a better message.
            _ => return Ok(None),
        }
    }
}

/// `NBD_OPT_GO`; false when the server does not support it.
fn go(
    stream: &mut Stream,
    export_name: &str,
    info: &mut ExportInfo,
) -> Result<bool, HandshakeFailure> {
    let mut data = Vec::new();
    data.extend_from_slice(&(export_name.len() as u32).to_be_bytes());
    data.extend_from_slice(export_name.as_bytes());
    data.extend_from_slice(&1u16.to_be_bytes());
    data.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    send_option(stream, OPT_GO, &data)?;
    let mut saw_export_info = false;
    loop {
        let reply = read_option_reply(stream, OPT_GO)?;
        match reply.reply_type {
            REP_INFO => saw_export_info |= apply_info(&reply.payload, info)?,
            REP_ACK if saw_export_info => return Ok(true),
            REP_ACK => {
                return Err(HandshakeFailure::Malformed {
                    option: OPT_GO,
                    reason: "acknowledged without NBD_INFO_EXPORT".into(),
                })
            }
            REP_ERR_UNSUP => return Ok(false),
            error_type => return Err(refusal(export_name, error_type, &reply.payload)),
        }
    }
}

/// Applies one `NBD_REP_INFO`; true when it was `NBD_INFO_EXPORT`.
fn apply_info(payload: &[u8], info: &mut ExportInfo) -> Result<bool, HandshakeFailure> {
    let malformed = |reason: &str| HandshakeFailure::Malformed {
        option: OPT_GO,
        reason: reason.into(),
    };
    let mut reader = PayloadReader::new(payload);
    match reader.u16() {
        Some(INFO_EXPORT) => {
            info.size_bytes = reader
                .u64()
                .ok_or_else(|| malformed("short NBD_INFO_EXPORT"))?;
            info.transmission_flags = reader
                .u16()
                .ok_or_else(|| malformed("short NBD_INFO_EXPORT"))?;
            Ok(true)
        }
        Some(INFO_BLOCK_SIZE) => {
            let short = || malformed("short NBD_INFO_BLOCK_SIZE");
            let minimum = reader.u32().ok_or_else(short)?;
            let preferred = reader.u32().ok_or_else(short)?;
            let maximum = reader.u32().ok_or_else(short)?;
            if minimum == 0 || maximum < minimum {
                return Err(malformed("inconsistent NBD_INFO_BLOCK_SIZE"));
            }
            info.block_size_min = minimum;
            info.block_size_preferred = preferred;
            info.block_size_max = maximum;
            Ok(false)
        }
        Some(_) => Ok(false),
        None => Err(malformed("empty NBD_REP_INFO")),
    }
}

fn refusal(export_name: &str, reply_type: u32, payload: &[u8]) -> HandshakeFailure {
    let kind = match reply_type {
        REP_ERR_UNKNOWN => "unknown export".to_string(),
        REP_ERR_POLICY => "refused by policy".to_string(),
        REP_ERR_TLS_REQD => "TLS required".to_string(),
        REP_ERR_SHUTDOWN => "server shutting down".to_string(),
        REP_ERR_INVALID => "invalid request".to_string(),
        REP_ERR_BLOCK_SIZE_REQD => "block size negotiation required".to_string(),
        other if is_option_error(other) => format!("error {:#x}", other),
        other => format!("unexpected reply type {other}"),
    };
    let message = String::from_utf8_lossy(payload);
    let reason = if message.is_empty() {
        kind
    } else {
        format!("{kind} ({message})")
    };
    HandshakeFailure::Refused {
        export: export_name.to_string(),
        reason,
    }
}

/// `NBD_OPT_EXPORT_NAME`, for servers that predate GO. The server closes the connection
/// instead of answering when the export does not exist.
fn export_name_fallback(
    stream: &mut Stream,
    export_name: &str,
    no_zeroes: bool,
    info: &mut ExportInfo,
) -> Result<(), HandshakeFailure> {
    send_option(stream, OPT_EXPORT_NAME, export_name.as_bytes())?;
    let mut reply = [0u8; 10];
    stream.read_exact(&mut reply).map_err(|error| {
        if error.kind() == std::io::ErrorKind::UnexpectedEof {
            HandshakeFailure::Refused {
                export: export_name.to_string(),
                reason: "the server closed the connection (unknown export?)".into(),
            }
        } else {
            error.into()
        }
    })?;
    info.size_bytes = be_u64(&reply[0..8]);
    info.transmission_flags = be_u16(&reply[8..10]);
    if !no_zeroes {
        let mut zeroes = [0u8; 124];
        stream.read_exact(&mut zeroes)?;
    }
    Ok(())
}
