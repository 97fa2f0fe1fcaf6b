//! A raw NBD client for probes: it sends exactly the bytes a test asks for (compact or
//! extended request headers, any flags, any option) and decodes what comes back without
//! judging it, so one probe can run against bufcache, nbdkit and qemu-nbd alike.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use bufcache_nbd::protocol::*;

/// `NBD_OPT_EXTENDED_HEADERS`, the extended request and reply magics and what they bring
/// (kept here too so a probe still builds against a crate without them).
pub const OPT_EXTENDED_HEADERS_RAW: u32 = 11;
pub const EXTENDED_REQUEST_MAGIC_RAW: u32 = 0x21e4_1c71;
pub const EXTENDED_REPLY_MAGIC_RAW: u32 = 0x6e8a_278c;
pub const CMD_FLAG_PAYLOAD_LEN_RAW: u16 = 1 << 5;
pub const REPLY_TYPE_BLOCK_STATUS_EXT_RAW: u16 = 6;
pub const REP_ERR_EXT_HEADER_REQD_RAW: u32 = (1 << 31) + 10;

/// The final reply type of INFO/GO, the export's (size, transmission flags) and its block
/// sizes (minimum, preferred, maximum) when the server sent them.
pub type GoReply = (u32, Option<(u64, u16)>, Option<(u32, u32, u32)>);

/// Why a probe could not go on: the server closed the connection (or reset it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Closed;

/// A unix or TCP socket.
pub enum Sock {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Read for Sock {
    fn read(&mut self, buffer: &mut [u8]) -> io::Result<usize> {
        match self {
            Sock::Unix(stream) => stream.read(buffer),
            Sock::Tcp(stream) => stream.read(buffer),
        }
    }
}

impl Write for Sock {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        match self {
            Sock::Unix(stream) => stream.write(bytes),
            Sock::Tcp(stream) => stream.write(bytes),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A connection speaking raw NBD.
pub struct Raw {
    stream: Sock,
    /// The server's handshake flags from the greeting.
    pub handshake_flags: u16,
    /// Extended headers are in use (requests and replies are 32 bytes).
    pub extended: bool,
    next_cookie: u64,
}

/// One reply to a request, gathered until its final chunk.
#[derive(Debug, Default, Clone)]
pub struct Answer {
    /// The reply was a simple reply (not chunks).
    pub simple: bool,
    /// The errno of the simple reply or of the first error chunk (0: success).
    pub error: u32,
    /// READ data, assembled at its offsets (holes as zeroes), or the simple reply's data.
    pub data: Vec<u8>,
    /// Every chunk: (type, payload), in arrival order.
    pub chunks: Vec<(u16, Vec<u8>)>,
    /// Every chunk's header length was consistent with its kind of header.
    pub offsets_echoed: bool,
}

impl Answer {
    /// The types of the chunks, in order.
    pub fn kinds(&self) -> Vec<u16> {
        self.chunks.iter().map(|(kind, _)| *kind).collect()
    }

    /// The descriptors of every status chunk: (context id, [(length, flags)]), 32- or 64-bit
    /// forms alike.
    pub fn status(&self) -> Vec<(u32, Vec<(u64, u64)>)> {
        let mut contexts = Vec::new();
        for (kind, payload) in &self.chunks {
            if *kind == REPLY_TYPE_BLOCK_STATUS && payload.len() >= 4 {
                let descriptors = payload[4..]
                    .chunks_exact(8)
                    .map(|pair| (u64::from(be_u32(pair)), u64::from(be_u32(&pair[4..]))))
                    .collect();
                contexts.push((be_u32(payload), descriptors));
            } else if *kind == REPLY_TYPE_BLOCK_STATUS_EXT_RAW && payload.len() >= 8 {
                let descriptors = payload[8..]
                    .chunks_exact(16)
                    .map(|pair| (be_u64(pair), be_u64(&pair[8..])))
                    .collect();
                contexts.push((be_u32(payload), descriptors));
            }
        }
        contexts
    }
}

impl Raw {
    /// Connects to a unix socket and reads the greeting; panics when the server is not a
    /// newstyle NBD server.
    pub fn connect(socket: &Path) -> Raw {
        // A server's socket file exists from its bind, a moment before it listens: under
        // load a connect can land in between and be refused, so that is tried again.
        let started = std::time::Instant::now();
        let stream = loop {
            match UnixStream::connect(socket) {
                Ok(stream) => break stream,
                Err(error)
                    if error.kind() == std::io::ErrorKind::ConnectionRefused
                        && started.elapsed() < Duration::from_secs(10) =>
                {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(error) => panic!("connect {}: {error}", socket.display()),
            }
        };
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        Raw::greeted(Sock::Unix(stream))
    }

    /// Connects to 127.0.0.1:`port` and reads the greeting.
    pub fn connect_tcp(port: u16) -> Raw {
        let stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        Raw::greeted(Sock::Tcp(stream))
    }

    fn greeted(stream: Sock) -> Raw {
        let mut raw = Raw {
            stream,
            handshake_flags: 0,
            extended: false,
            next_cookie: 1,
        };
        let greeting = raw.read_bytes(18).expect("greeting");
        assert_eq!(be_u64(&greeting), INIT_MAGIC);
        assert_eq!(be_u64(&greeting[8..]), OPTION_MAGIC);
        raw.handshake_flags = be_u16(&greeting[16..]);
        raw
    }

    /// Connects and sends `client_flags`.
    pub fn start(socket: &Path, client_flags: u32) -> Raw {
        let mut raw = Raw::connect(socket);
        raw.send(&client_flags.to_be_bytes());
        raw
    }

    /// Connects as a modern client (fixed newstyle, no zeroes).
    pub fn modern(socket: &Path) -> Raw {
        Raw::start(socket, CLIENT_FLAG_FIXED_NEWSTYLE | CLIENT_FLAG_NO_ZEROES)
    }

    pub fn send(&mut self, bytes: &[u8]) {
        // A server that closed may refuse the bytes; reading then tells the probe.
        let _ = self.stream.write_all(bytes);
    }

    pub fn read_bytes(&mut self, count: usize) -> Result<Vec<u8>, Closed> {
        let mut bytes = vec![0u8; count];
        match self.stream.read_exact(&mut bytes) {
            Ok(()) => Ok(bytes),
            Err(error)
                if matches!(
                    error.kind(),
                    io::ErrorKind::UnexpectedEof
                        | io::ErrorKind::ConnectionReset
                        | io::ErrorKind::BrokenPipe
                ) =>
            {
                Err(Closed)
            }
            Err(error) => panic!("reading from the server: {error}"),
        }
    }

    /// Sends an option (any number, any data) and reads replies up to the final one (ACK or
    /// an error); `(reply type, payload)` each, the final one last.
    pub fn option(&mut self, option: u32, data: &[u8]) -> Result<Vec<(u32, Vec<u8>)>, Closed> {
        let mut message = OPTION_MAGIC.to_be_bytes().to_vec();
        message.extend_from_slice(&option.to_be_bytes());
        message.extend_from_slice(&(data.len() as u32).to_be_bytes());
        message.extend_from_slice(data);
        self.send(&message);
        self.option_replies(option)
    }

    /// Reads option replies up to the final one.
    pub fn option_replies(&mut self, option: u32) -> Result<Vec<(u32, Vec<u8>)>, Closed> {
        let mut replies = Vec::new();
        loop {
            let header = self.read_bytes(20)?;
            assert_eq!(be_u64(&header), OPTION_REPLY_MAGIC, "option reply magic");
            assert_eq!(be_u32(&header[8..]), option, "reply to another option");
            let reply_type = be_u32(&header[12..]);
            let payload = self.read_bytes(be_u32(&header[16..]) as usize)?;
            replies.push((reply_type, payload));
            if reply_type == REP_ACK || is_option_error(reply_type) {
                return Ok(replies);
            }
        }
    }

    /// The final reply type of an option.
    pub fn option_final(&mut self, option: u32, data: &[u8]) -> Result<u32, Closed> {
        Ok(self.option(option, data)?.last().expect("a final reply").0)
    }

    /// `NBD_OPT_STRUCTURED_REPLY`; its final reply type.
    pub fn structured(&mut self) -> Result<u32, Closed> {
        self.option_final(OPT_STRUCTURED_REPLY, &[])
    }

    /// `NBD_OPT_EXTENDED_HEADERS`; on ACK, requests and replies are extended from then on.
    pub fn extended_headers(&mut self) -> Result<u32, Closed> {
        let reply = self.option_final(OPT_EXTENDED_HEADERS_RAW, &[])?;
        if reply == REP_ACK {
            self.extended = true;
        }
        Ok(reply)
    }

    /// SET or LIST_META_CONTEXT for `export` with `queries`: (final type, context names with
    /// their ids).
    pub fn meta_context(
        &mut self,
        option: u32,
        export: &str,
        queries: &[&str],
    ) -> Result<(u32, Vec<(u32, String)>), Closed> {
        let replies = self.option(option, &meta_context_data(export, queries))?;
        let contexts = replies
            .iter()
            .filter(|(reply_type, _)| *reply_type == REP_META_CONTEXT)
            .map(|(_, payload)| {
                (
                    be_u32(payload),
                    String::from_utf8_lossy(&payload[4..]).into_owned(),
                )
            })
            .collect();
        Ok((replies.last().expect("a final reply").0, contexts))
    }

    /// `NBD_OPT_GO` (or INFO) for `export` asking for `infos`: (final type, transmission
    /// flags from NBD_INFO_EXPORT, block sizes from NBD_INFO_BLOCK_SIZE).
    pub fn go_with(&mut self, option: u32, export: &str, infos: &[u16]) -> Result<GoReply, Closed> {
        let mut data = (export.len() as u32).to_be_bytes().to_vec();
        data.extend_from_slice(export.as_bytes());
        data.extend_from_slice(&(infos.len() as u16).to_be_bytes());
        for info in infos {
            data.extend_from_slice(&info.to_be_bytes());
        }
        let replies = self.option(option, &data)?;
        let mut export_info = None;
        let mut sizes = None;
        for (reply_type, payload) in &replies {
            if *reply_type != REP_INFO || payload.len() < 2 {
                continue;
            }
            match be_u16(payload) {
                INFO_EXPORT if payload.len() == 12 => {
                    export_info = Some((be_u64(&payload[2..]), be_u16(&payload[10..])))
                }
                INFO_BLOCK_SIZE if payload.len() == 14 => {
                    sizes = Some((
                        be_u32(&payload[2..]),
                        be_u32(&payload[6..]),
                        be_u32(&payload[10..]),
                    ))
                }
                _ => {}
            }
        }
        Ok((replies.last().expect("a final reply").0, export_info, sizes))
    }

    /// `NBD_OPT_GO` for `export`; the transmission flags. Panics when refused.
    pub fn go(&mut self, export: &str) -> u16 {
        let (reply, info, _) = self
            .go_with(OPT_GO, export, &[INFO_BLOCK_SIZE])
            .expect("GO answered");
        assert_eq!(reply, REP_ACK, "GO refused with {reply:#x}");
        info.expect("NBD_INFO_EXPORT").1
    }

    /// `NBD_OPT_EXPORT_NAME`: (size, transmission flags), or Closed when the server hung up.
    pub fn export_name(&mut self, export: &str, no_zeroes: bool) -> Result<(u64, u16), Closed> {
        let mut message = OPTION_MAGIC.to_be_bytes().to_vec();
        message.extend_from_slice(&OPT_EXPORT_NAME.to_be_bytes());
        message.extend_from_slice(&(export.len() as u32).to_be_bytes());
        message.extend_from_slice(export.as_bytes());
        self.send(&message);
        let reply = self.read_bytes(if no_zeroes { 10 } else { 134 })?;
        Ok((be_u64(&reply), be_u16(&reply[8..])))
    }

    /// Sends one request (compact or extended header as negotiated, `length` the header's
    /// length field) followed by `payload`; returns its cookie.
    pub fn send_request(
        &mut self,
        flags: u16,
        command: u16,
        offset: u64,
        length: u64,
        payload: &[u8],
    ) -> u64 {
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        let mut message = Vec::with_capacity(32 + payload.len());
        if self.extended {
            message.extend_from_slice(&EXTENDED_REQUEST_MAGIC_RAW.to_be_bytes());
        } else {
            message.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        }
        message.extend_from_slice(&flags.to_be_bytes());
        message.extend_from_slice(&command.to_be_bytes());
        message.extend_from_slice(&cookie.to_be_bytes());
        message.extend_from_slice(&offset.to_be_bytes());
        if self.extended {
            message.extend_from_slice(&length.to_be_bytes());
        } else {
            message.extend_from_slice(&(length as u32).to_be_bytes());
        }
        message.extend_from_slice(payload);
        self.send(&message);
        cookie
    }

    /// Sends a request and reads its whole reply. `read_length` is the number of data bytes a
    /// successful simple reply carries (a READ's length; 0 for other commands).
    pub fn request(
        &mut self,
        flags: u16,
        command: u16,
        offset: u64,
        length: u64,
        payload: &[u8],
    ) -> Result<Answer, Closed> {
        let cookie = self.send_request(flags, command, offset, length, payload);
        let read_length = if command == CMD_READ {
            length as usize
        } else {
            0
        };
        self.answer(cookie, offset, read_length)
    }

    /// Reads the reply to request `cookie` (the next reply on the wire must be for it).
    pub fn answer(
        &mut self,
        cookie: u64,
        offset: u64,
        read_length: usize,
    ) -> Result<Answer, Closed> {
        let mut answer = Answer {
            data: vec![0u8; read_length],
            offsets_echoed: true,
            ..Answer::default()
        };
        loop {
            let magic = be_u32(&self.read_bytes(4)?);
            match magic {
                SIMPLE_REPLY_MAGIC => {
                    let rest = self.read_bytes(12)?;
                    assert_eq!(be_u64(&rest[4..]), cookie, "simple reply cookie");
                    answer.simple = true;
                    answer.error = be_u32(&rest);
                    if answer.error == 0 && read_length > 0 {
                        answer.data = self.read_bytes(read_length)?;
                    }
                    return Ok(answer);
                }
                STRUCTURED_REPLY_MAGIC | EXTENDED_REPLY_MAGIC_RAW => {
                    let extended = magic == EXTENDED_REPLY_MAGIC_RAW;
                    let rest = self.read_bytes(if extended { 28 } else { 16 })?;
                    let flags = be_u16(&rest);
                    let kind = be_u16(&rest[2..]);
                    assert_eq!(be_u64(&rest[4..]), cookie, "chunk cookie");
                    let length = if extended {
                        answer.offsets_echoed &= be_u64(&rest[12..]) == offset;
                        be_u64(&rest[20..])
                    } else {
                        u64::from(be_u32(&rest[12..]))
                    };
                    assert!(length <= 128 << 20, "chunk of {length} bytes");
                    let payload = self.read_bytes(length as usize)?;
                    self.apply_chunk(&mut answer, kind, &payload, offset);
                    answer.chunks.push((kind, payload));
                    if flags & REPLY_FLAG_DONE != 0 {
                        return Ok(answer);
                    }
                }
                other => panic!("reply magic {other:#x}"),
            }
        }
    }

    fn apply_chunk(&self, answer: &mut Answer, kind: u16, payload: &[u8], offset: u64) {
        match kind {
            REPLY_TYPE_OFFSET_DATA if payload.len() > 8 => {
                let at = (be_u64(payload) - offset) as usize;
                let data = &payload[8..];
                if at + data.len() <= answer.data.len() {
                    answer.data[at..at + data.len()].copy_from_slice(data);
                }
            }
            kind if is_reply_error(kind) && payload.len() >= 4 && answer.error == 0 => {
                answer.error = be_u32(payload);
            }
            _ => {}
        }
    }

    /// True when the server closes the connection (EOF or reset) within the read timeout.
    pub fn is_closed_by_server(&mut self) -> bool {
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

/// The data of LIST/SET_META_CONTEXT.
pub fn meta_context_data(export: &str, queries: &[&str]) -> Vec<u8> {
    let mut data = (export.len() as u32).to_be_bytes().to_vec();
    data.extend_from_slice(export.as_bytes());
    data.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for query in queries {
        data.extend_from_slice(&(query.len() as u32).to_be_bytes());
        data.extend_from_slice(query.as_bytes());
    }
    data
}

/// The name of an errno, for tables.
pub fn errno_name(code: u32) -> String {
    if code == 0 {
        "ok".into()
    } else {
        Errno::from_code(code).name()
    }
}

/// The name of an option reply type, for tables.
pub fn reply_name(reply_type: u32) -> String {
    match reply_type {
        REP_ACK => "ACK".into(),
        REP_ERR_UNSUP => "ERR_UNSUP".into(),
        REP_ERR_POLICY => "ERR_POLICY".into(),
        REP_ERR_INVALID => "ERR_INVALID".into(),
        REP_ERR_PLATFORM => "ERR_PLATFORM".into(),
        REP_ERR_TLS_REQD => "ERR_TLS_REQD".into(),
        REP_ERR_UNKNOWN => "ERR_UNKNOWN".into(),
        REP_ERR_SHUTDOWN => "ERR_SHUTDOWN".into(),
        REP_ERR_BLOCK_SIZE_REQD => "ERR_BLOCK_SIZE_REQD".into(),
        REP_ERR_TOO_BIG => "ERR_TOO_BIG".into(),
        REP_ERR_EXT_HEADER_REQD_RAW => "ERR_EXT_HEADER_REQD".into(),
        other => format!("{other:#x}"),
    }
}
