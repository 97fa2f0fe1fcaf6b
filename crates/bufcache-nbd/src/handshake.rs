//! The server's side of the fixed newstyle handshake: greeting, client flags, and option
//! haggling until the client picks an export (`NBD_OPT_GO` / `NBD_OPT_EXPORT_NAME`) or leaves.
//!
//! Invariants: a fixed newstyle client gets exactly one final reply to every option, an
//! unknown option gets `NBD_REP_ERR_UNSUP` and haggling goes on; a client without
//! `NBD_FLAG_C_FIXED_NEWSTYLE` (plain newstyle, which cannot be told about errors) may only
//! send `NBD_OPT_EXPORT_NAME`, and any other option closes its connection; any malformed
//! framing (bad magic, oversized option, unknown client flags) ends only this connection, by
//! returning an error. Metadata contexts selected here apply only if the client then enters
//! the same export, and each `NBD_OPT_SET_META_CONTEXT` replaces the selection, even when it
//! fails. Once the server shuts down, every option but `NBD_OPT_ABORT` is answered
//! `NBD_REP_ERR_SHUTDOWN`.

use std::io::{self, Read, Write};
use std::sync::Arc;

use crate::config::ExportPolicy;
use crate::export::Export;
use crate::protocol::*;
use crate::shutdown::ShutdownHandle;
use crate::stream::Stream;
use crate::tls::{TlsMode, TlsServer};

/// Options longer than this are not haggling but abuse; the connection is closed.
const OPTION_BYTES_MAX: u32 = 64 * 1024;

/// Context id the server gives `base:allocation` when a client selects it.
pub(crate) const BASE_ALLOCATION_ID: u32 = 1;
/// Context id the server gives `x-bufcache:state` when a client selects it.
pub(crate) const CACHE_STATE_ID: u32 = 2;

/// A set of metadata contexts: the ones an export offers, or the ones a client selected.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct MetaContexts {
    /// `base:allocation` (every export offers it).
    pub(crate) base_allocation: bool,
    /// `x-bufcache:state` (offered by exports that are a cache, [`Export::has_cache_state`]).
    pub(crate) cache_state: bool,
}

impl MetaContexts {
    pub(crate) fn any(self) -> bool {
        self.base_allocation || self.cache_state
    }

    /// The contexts of `offered` that `queries` name. Listing, no query names them all and a
    /// namespace alone (`base:`, `x-bufcache:`) names all of its contexts; selecting, a
    /// namespace alone names none (the spec asks for that in `base:`). Unknown queries are
    /// ignored, as the spec requires.
    fn matching(offered: MetaContexts, queries: &[String], listing: bool) -> MetaContexts {
        if listing && queries.is_empty() {
            return offered;
        }
        let mut chosen = MetaContexts::default();
        for query in queries {
            match query.as_str() {
                BASE_ALLOCATION => chosen.base_allocation = true,
                "base:" if listing => chosen.base_allocation = true,
                BUFCACHE_STATE => chosen.cache_state = true,
                BUFCACHE_NAMESPACE if listing => chosen.cache_state = true,
                _ => {}
            }
        }
        MetaContexts {
            base_allocation: chosen.base_allocation && offered.base_allocation,
            cache_state: chosen.cache_state && offered.cache_state,
        }
    }

    /// `(id, name)` of each context in the set.
    fn named(self) -> impl Iterator<Item = (u32, &'static str)> {
        [
            (self.base_allocation, BASE_ALLOCATION_ID, BASE_ALLOCATION),
            (self.cache_state, CACHE_STATE_ID, BUFCACHE_STATE),
        ]
        .into_iter()
        .filter(|(selected, _, _)| *selected)
        .map(|(_, id, name)| (id, name))
    }
}

/// The exports a server offers, by name. The empty name (the "default export") means the
/// export named "" if there is one, otherwise the first export.
pub(crate) struct ExportTable {
    pub(crate) entries: Vec<(String, Arc<dyn Export>)>,
    /// Who may open each export and how, parallel to `entries`.
    pub(crate) policies: Vec<ExportPolicy>,
}

impl ExportTable {
    /// Index of the export `name` names, when `identity` may open it. An export the client
    /// may not open is reported exactly like one that does not exist, so its name stays
    /// hidden.
    fn find_for(&self, name: &str, identity: Option<&str>) -> Option<usize> {
        self.find(name)
            .filter(|&index| self.may_open(index, identity))
    }

    fn may_open(&self, index: usize, identity: Option<&str>) -> bool {
        self.policies
            .get(index)
            .is_none_or(|policy| policy.admits(identity))
    }

    /// Index of the export a client asked for by `name`.
    pub(crate) fn find(&self, name: &str) -> Option<usize> {
        let exact = self.entries.iter().position(|(entry, _)| entry == name);
        match exact {
            Some(index) => Some(index),
            None if name.is_empty() && !self.entries.is_empty() => Some(0),
            None => None,
        }
    }
}

/// What the client agreed to, when it entered transmission.
pub(crate) struct Negotiated {
    pub(crate) export_name: String,
    pub(crate) export: Arc<dyn Export>,
    pub(crate) structured_replies: bool,
    /// `NBD_OPT_EXTENDED_HEADERS` was agreed: 32-byte requests and reply chunks, 64-bit
    /// lengths (`structured_replies` is set too: every reply is a chunk).
    pub(crate) extended_headers: bool,
    /// The metadata contexts BLOCK_STATUS answers for (none: it is refused).
    pub(crate) contexts: MetaContexts,
    pub(crate) transmission_flags: u16,
    /// The server's shutdown: requests read after it are refused with ESHUTDOWN.
    pub(crate) shutdown: ShutdownHandle,
}

/// Why a handshake ended without transmission.
#[derive(Debug, thiserror::Error)]
pub(crate) enum HandshakeError {
    #[error("socket error during handshake: {0}")]
    Io(#[from] io::Error),
    #[error("client flags {0:#x} refused (unknown bits are not allowed)")]
    ClientFlags(u32),
    #[error(
        "option {0} from a client without fixed newstyle, which allows only NBD_OPT_EXPORT_NAME"
    )]
    NotFixedNewstyle(u32),
    #[error("NBD_OPT_EXPORT_NAME while the server shuts down")]
    ShuttingDown,
    #[error("NBD_OPT_EXPORT_NAME after extended headers were agreed, which the spec forbids")]
    ExportNameWithExtendedHeaders,
    #[error("option magic {0:#x} is not IHAVEOPT")]
    OptionMagic(u64),
    #[error(
        "option {option} carries {length_bytes} bytes, more than the {OPTION_BYTES_MAX} allowed"
    )]
    OptionTooLong { option: u32, length_bytes: u32 },
    #[error("too many connections: every serving slot is taken (connections_max)")]
    TooManyConnections,
    #[error("NBD_OPT_EXPORT_NAME asked for unknown export {0:?}")]
    UnknownExport(String),
    #[error("client asked for an export without TLS, which is required")]
    TlsRequired,
    #[error("TLS handshake failed: {0}")]
    Tls(io::Error),
}

/// How the handshake ended.
pub(crate) enum Outcome {
    Transmission(Negotiated),
    /// The client aborted or hung up politely.
    Closed,
}

/// Per-connection haggling state.
struct Haggle<'a> {
    stream: &'a mut Stream,
    exports: &'a ExportTable,
    tls: &'a TlsServer,
    /// True once `NBD_OPT_STARTTLS` succeeded: the stream is the TLS relay's plain end.
    tls_active: bool,
    /// The client's TLS identity (PSK identity or certificate common name), once known.
    identity: Option<String>,
    request_size_max: u32,
    /// The client set `NBD_FLAG_C_FIXED_NEWSTYLE`: it understands option replies.
    fixed_newstyle: bool,
    no_zeroes: bool,
    structured_replies: bool,
    extended_headers: bool,
    /// The export index and the contexts the last SET_META_CONTEXT selected for it.
    contexts_for: Option<(usize, MetaContexts)>,
    shutdown: &'a ShutdownHandle,
    /// Takes a serving slot for the connection; called before the reply that ends the
    /// handshake, so a client told it may transmit always has one.
    admit: &'a mut dyn FnMut() -> bool,
}

/// Runs the handshake on a fresh connection.
pub(crate) fn negotiate(
    stream: &mut Stream,
    exports: &ExportTable,
    request_size_max: u32,
    tls: &TlsServer,
    shutdown: &ShutdownHandle,
    admit: &mut dyn FnMut() -> bool,
) -> Result<Outcome, HandshakeError> {
    let mut greeting = Vec::with_capacity(18);
    greeting.extend_from_slice(&INIT_MAGIC.to_be_bytes());
    greeting.extend_from_slice(&OPTION_MAGIC.to_be_bytes());
    greeting.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    stream.write_all(&greeting)?;
    let mut flag_bytes = [0u8; 4];
    stream.read_exact(&mut flag_bytes)?;
    let client_flags = u32::from_be_bytes(flag_bytes);
    let known = CLIENT_FLAG_FIXED_NEWSTYLE | CLIENT_FLAG_NO_ZEROES;
    if client_flags & !known != 0 {
        return Err(HandshakeError::ClientFlags(client_flags));
    }
    let mut haggle = Haggle {
        stream,
        exports,
        tls,
        tls_active: false,
        identity: None,
        request_size_max,
        fixed_newstyle: client_flags & CLIENT_FLAG_FIXED_NEWSTYLE != 0,
        no_zeroes: client_flags & CLIENT_FLAG_NO_ZEROES != 0,
        structured_replies: false,
        extended_headers: false,
        contexts_for: None,
        shutdown,
        admit,
    };
    loop {
        let (option, data) = match haggle.read_option() {
            Ok(option) => option,
            Err(HandshakeError::Io(error)) if error.kind() == io::ErrorKind::UnexpectedEof => {
                return Ok(Outcome::Closed)
            }
            Err(error) => return Err(error),
        };
        if let Some(outcome) = haggle.handle_option(option, &data)? {
            return Ok(outcome);
        }
    }
}

impl Haggle<'_> {
    fn read_option(&mut self) -> Result<(u32, Vec<u8>), HandshakeError> {
        let mut header = [0u8; OPTION_HEADER_BYTES];
        self.stream.read_exact(&mut header)?;
        let magic = be_u64(&header[0..8]);
        if magic != OPTION_MAGIC {
            return Err(HandshakeError::OptionMagic(magic));
        }
        let option = be_u32(&header[8..12]);
        let length_bytes = be_u32(&header[12..16]);
        if length_bytes > OPTION_BYTES_MAX {
            return Err(HandshakeError::OptionTooLong {
                option,
                length_bytes,
            });
        }
        let mut data = vec![0u8; length_bytes as usize];
        self.stream.read_exact(&mut data)?;
        Ok((option, data))
    }

    /// Answers one option; `Some` when haggling is over.
    fn handle_option(
        &mut self,
        option: u32,
        data: &[u8],
    ) -> Result<Option<Outcome>, HandshakeError> {
        if !self.fixed_newstyle && option != OPT_EXPORT_NAME {
            // A plain newstyle client cannot read an option reply: the spec says to close.
            return Err(HandshakeError::NotFixedNewstyle(option));
        }
        if self.shutdown.is_triggered() && option != OPT_ABORT {
            if option == OPT_EXPORT_NAME {
                // No error reply exists for this option: the connection closes.
                return Err(HandshakeError::ShuttingDown);
            }
            self.error(option, REP_ERR_SHUTDOWN, "the server is shutting down")?;
            return Ok(None);
        }
        let tls_missing = self.tls.mode == TlsMode::Require && !self.tls_active;
        if tls_missing && option != OPT_STARTTLS && option != OPT_ABORT {
            if option == OPT_EXPORT_NAME {
                // This option cannot carry an error reply: the spec says to close.
                return Err(HandshakeError::TlsRequired);
            }
            tracing::warn!(
                option,
                "option refused: TLS is required and the client has not started it"
            );
            self.error(
                option,
                REP_ERR_TLS_REQD,
                "TLS is required: upgrade with NBD_OPT_STARTTLS first",
            )?;
            return Ok(None);
        }
        match option {
            OPT_STARTTLS if self.tls.mode != TlsMode::Off => self.start_tls(data),
            OPT_EXPORT_NAME => self.export_name(data).map(Some),
            OPT_ABORT => {
                // The client may already have hung up; the acknowledgement is a courtesy.
                let _ = self.reply(option, REP_ACK, &[]);
                Ok(Some(Outcome::Closed))
            }
            OPT_LIST => self.list(data).map(|()| None),
            OPT_INFO | OPT_GO => self.info_or_go(option, data),
            OPT_STRUCTURED_REPLY => self.structured_reply(data).map(|()| None),
            OPT_EXTENDED_HEADERS => self.extended_headers(data).map(|()| None),
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                self.meta_context(option, data).map(|()| None)
            }
            _ => {
                tracing::debug!(option, "unsupported option");
                self.error(
                    option,
                    REP_ERR_UNSUP,
                    &format!("option {option} is not supported"),
                )?;
                Ok(None)
            }
        }
    }

    /// Acknowledges `NBD_OPT_STARTTLS`, runs the TLS handshake and goes on haggling over
    /// TLS, forgetting what was agreed in plain text, as the spec asks.
    fn start_tls(&mut self, data: &[u8]) -> Result<Option<Outcome>, HandshakeError> {
        if !data.is_empty() {
            self.error(
                OPT_STARTTLS,
                REP_ERR_INVALID,
                "NBD_OPT_STARTTLS takes no data",
            )?;
            return Ok(None);
        }
        if self.tls_active {
            self.error(OPT_STARTTLS, REP_ERR_INVALID, "TLS is already active")?;
            return Ok(None);
        }
        self.reply(OPT_STARTTLS, REP_ACK, &[])?;
        self.identity = self.tls.upgrade(self.stream).map_err(HandshakeError::Tls)?;
        tracing::info!(identity = ?self.identity, "TLS established");
        self.tls_active = true;
        self.structured_replies = false;
        self.extended_headers = false;
        self.contexts_for = None;
        Ok(None)
    }

    fn reply(&mut self, option: u32, reply_type: u32, payload: &[u8]) -> io::Result<()> {
        let mut message = Vec::with_capacity(OPTION_REPLY_HEADER_BYTES + payload.len());
        put_option_reply(&mut message, option, reply_type, payload);
        self.stream.write_all(&message)
    }

    fn error(&mut self, option: u32, reply_type: u32, message: &str) -> io::Result<()> {
        self.reply(option, reply_type, message.as_bytes())
    }

    fn export_name(&mut self, data: &[u8]) -> Result<Outcome, HandshakeError> {
        if self.extended_headers {
            // A MUST NOT for the client, and this option has no error reply: close.
            return Err(HandshakeError::ExportNameWithExtendedHeaders);
        }
        let name = String::from_utf8_lossy(data).into_owned();
        let Some(index) = self.find_export(&name) else {
            // This option cannot carry an error reply: the spec says to close.
            return Err(HandshakeError::UnknownExport(name));
        };
        if !(self.admit)() {
            // As above: no error reply exists for this option, so the connection closes.
            return Err(HandshakeError::TooManyConnections);
        }
        let negotiated = self.enter(index, name);
        let mut message = Vec::with_capacity(10 + 124);
        message.extend_from_slice(&negotiated.export.size().to_be_bytes());
        message.extend_from_slice(&negotiated.transmission_flags.to_be_bytes());
        if !self.no_zeroes {
            message.extend_from_slice(&[0u8; 124]);
        }
        self.stream.write_all(&message)?;
        Ok(Outcome::Transmission(negotiated))
    }

    fn list(&mut self, data: &[u8]) -> Result<(), HandshakeError> {
        if !data.is_empty() {
            self.error(OPT_LIST, REP_ERR_INVALID, "NBD_OPT_LIST takes no data")?;
            return Ok(());
        }
        for index in 0..self.exports.entries.len() {
            if !self.exports.may_open(index, self.identity.as_deref()) {
                continue;
            }
            let (name, export) = &self.exports.entries[index];
            // After the name, the spec allows free text for humans: the description.
            let description = export.description();
            let mut payload = Vec::with_capacity(4 + name.len() + description.len());
            payload.extend_from_slice(&(name.len() as u32).to_be_bytes());
            payload.extend_from_slice(name.as_bytes());
            payload.extend_from_slice(description.as_bytes());
            self.reply(OPT_LIST, REP_SERVER, &payload)?;
        }
        self.reply(OPT_LIST, REP_ACK, &[])?;
        Ok(())
    }

    fn info_or_go(&mut self, option: u32, data: &[u8]) -> Result<Option<Outcome>, HandshakeError> {
        let Some((name, requested)) = parse_info_request(data) else {
            self.error(
                option,
                REP_ERR_INVALID,
                "malformed NBD_OPT_INFO/NBD_OPT_GO data",
            )?;
            return Ok(None);
        };
        let Some(index) = self.find_export(&name) else {
            if self.needs_tls_first(&name) {
                // SELECTIVETLS: the spec requires this answer for a TLS-only export.
                let message =
                    format!("export {name:?} requires TLS: upgrade with NBD_OPT_STARTTLS first");
                self.error(option, REP_ERR_TLS_REQD, &message)?;
                return Ok(None);
            }
            let message = format!("no export named {name:?}");
            self.error(option, REP_ERR_UNKNOWN, &message)?;
            return Ok(None);
        };
        let export = Arc::clone(&self.exports.entries[index].1);
        let flags = self.transmission_flags(index, export.as_ref());
        let mut export_info = INFO_EXPORT.to_be_bytes().to_vec();
        export_info.extend_from_slice(&export.size().to_be_bytes());
        export_info.extend_from_slice(&flags.to_be_bytes());
        self.reply(option, REP_INFO, &export_info)?;
        if requested.contains(&INFO_NAME) {
            let mut info = INFO_NAME.to_be_bytes().to_vec();
            info.extend_from_slice(self.exports.entries[index].0.as_bytes());
            self.reply(option, REP_INFO, &info)?;
        }
        let description = export.description();
        if requested.contains(&INFO_DESCRIPTION) && !description.is_empty() {
            let mut info = INFO_DESCRIPTION.to_be_bytes().to_vec();
            info.extend_from_slice(description.as_bytes());
            self.reply(option, REP_INFO, &info)?;
        }
        // Sent even when not asked for: the spec allows it, and a client that knows our
        // maximum can avoid EOVERFLOW.
        let mut info = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
        info.extend_from_slice(&1u32.to_be_bytes());
        let preferred = preferred_block_size(export.as_ref(), self.request_size_max);
        info.extend_from_slice(&preferred.to_be_bytes());
        info.extend_from_slice(&self.request_size_max.to_be_bytes());
        self.reply(option, REP_INFO, &info)?;
        if option == OPT_GO && !(self.admit)() {
            tracing::warn!("connection refused after the handshake: every serving slot is taken");
            self.error(
                option,
                REP_ERR_POLICY,
                "too many connections: every serving slot is taken (connections_max)",
            )?;
            return Ok(None);
        }
        self.reply(option, REP_ACK, &[])?;
        if option == OPT_INFO {
            return Ok(None);
        }
        Ok(Some(Outcome::Transmission(self.enter(index, name))))
    }

    fn structured_reply(&mut self, data: &[u8]) -> Result<(), HandshakeError> {
        if !data.is_empty() {
            self.error(
                OPT_STRUCTURED_REPLY,
                REP_ERR_INVALID,
                "NBD_OPT_STRUCTURED_REPLY takes no data",
            )?;
            return Ok(());
        }
        if self.extended_headers {
            // The spec: extended headers take precedence; there is no going back.
            self.error(
                OPT_STRUCTURED_REPLY,
                REP_ERR_EXT_HEADER_REQD,
                "extended headers are already in use",
            )?;
            return Ok(());
        }
        self.structured_replies = true;
        self.reply(OPT_STRUCTURED_REPLY, REP_ACK, &[])?;
        Ok(())
    }

    /// `NBD_OPT_EXTENDED_HEADERS`: 32-byte requests with 64-bit lengths and 32-byte reply
    /// chunks from transmission on (structured replies come with them).
    fn extended_headers(&mut self, data: &[u8]) -> Result<(), HandshakeError> {
        if !data.is_empty() {
            self.error(
                OPT_EXTENDED_HEADERS,
                REP_ERR_INVALID,
                "NBD_OPT_EXTENDED_HEADERS takes no data",
            )?;
            return Ok(());
        }
        self.extended_headers = true;
        self.structured_replies = true;
        self.reply(OPT_EXTENDED_HEADERS, REP_ACK, &[])?;
        Ok(())
    }

    fn meta_context(&mut self, option: u32, data: &[u8]) -> Result<(), HandshakeError> {
        let selecting = option == OPT_SET_META_CONTEXT;
        if selecting {
            // The spec: SET replaces every earlier selection, including when it fails.
            self.contexts_for = None;
        }
        if !self.structured_replies {
            let message = "metadata contexts need structured replies first";
            self.error(option, REP_ERR_INVALID, message)?;
            return Ok(());
        }
        let Some((name, queries)) = parse_meta_context_request(data) else {
            self.error(
                option,
                REP_ERR_INVALID,
                "malformed metadata context request",
            )?;
            return Ok(());
        };
        let Some(index) = self.find_export(&name) else {
            self.error(
                option,
                REP_ERR_UNKNOWN,
                &format!("no export named {name:?}"),
            )?;
            return Ok(());
        };
        let offered = MetaContexts {
            base_allocation: true,
            cache_state: self.exports.entries[index].1.has_cache_state(),
        };
        let chosen = MetaContexts::matching(offered, &queries, !selecting);
        for (id, context) in chosen.named() {
            // Listing, the id is reserved and SHOULD be zero.
            let id = if selecting { id } else { 0 };
            let mut payload = id.to_be_bytes().to_vec();
            payload.extend_from_slice(context.as_bytes());
            self.reply(option, REP_META_CONTEXT, &payload)?;
        }
        if selecting && chosen.any() {
            self.contexts_for = Some((index, chosen));
        }
        self.reply(option, REP_ACK, &[])?;
        Ok(())
    }

    /// True when `name` is an export this client may not open only because it has not
    /// upgraded to TLS yet (SELECTIVETLS: `--tls on` and an export limited to TLS identities).
    fn needs_tls_first(&self, name: &str) -> bool {
        self.tls.mode == TlsMode::On
            && !self.tls_active
            && self
                .exports
                .find(name)
                .and_then(|index| self.exports.policies.get(index))
                .is_some_and(|policy| !policy.admits(None))
    }

    /// The export `name` names, when this client may open it; a refusal is logged with the
    /// identity (the client itself is told only that no such export exists).
    fn find_export(&self, name: &str) -> Option<usize> {
        let identity = self.identity.as_deref();
        let found = self.exports.find_for(name, identity);
        if found.is_none() && self.exports.find(name).is_some() {
            tracing::warn!(
                export = %name,
                identity = identity.unwrap_or("(none: no TLS identity)"),
                "export refused: this identity may not open it"
            );
        }
        found
    }

    fn transmission_flags(&self, index: usize, export: &dyn Export) -> u16 {
        let read_only = export.read_only()
            || self
                .exports
                .policies
                .get(index)
                .is_some_and(|policy| policy.read_only);
        let mut flags = TRANSMIT_HAS_FLAGS
            | TRANSMIT_SEND_FLUSH
            | TRANSMIT_SEND_FUA
            | TRANSMIT_SEND_CACHE
            // One export object is shared by every connection, so a flush on one connection
            // covers writes made on all of them.
            | TRANSMIT_CAN_MULTI_CONN;
        if read_only {
            flags |= TRANSMIT_READ_ONLY;
        } else {
            flags |= TRANSMIT_SEND_TRIM | TRANSMIT_SEND_WRITE_ZEROES;
            if export.can_fast_zero() {
                flags |= TRANSMIT_SEND_FAST_ZERO;
            }
        }
        if self.structured_replies {
            // Reads are always answered with a single data chunk, so DF costs nothing.
            flags |= TRANSMIT_SEND_DF;
        }
        let contexts_selected = self
            .contexts_for
            .is_some_and(|(selected_for, _)| selected_for == index);
        if self.extended_headers && contexts_selected {
            flags |= TRANSMIT_BLOCK_STATUS_PAYLOAD;
        }
        flags
    }

    fn enter(&self, index: usize, name: String) -> Negotiated {
        let shared = &self.exports.entries[index].1;
        // Each connection may get its own view of the export (for example its own write-back
        // error reporting position); by default all connections share one.
        let export = shared
            .open_connection()
            .unwrap_or_else(|| Arc::clone(shared));
        Negotiated {
            export_name: name,
            transmission_flags: self.transmission_flags(index, export.as_ref()),
            export,
            structured_replies: self.structured_replies,
            extended_headers: self.extended_headers,
            contexts: self
                .contexts_for
                .filter(|(selected_for, _)| *selected_for == index)
                .map_or_else(MetaContexts::default, |(_, contexts)| contexts),
            shutdown: self.shutdown.clone(),
        }
    }
}

/// The preferred block size advertised: the export's wish, made a power of two between 512
/// and the maximum, as the spec requires.
fn preferred_block_size(export: &dyn Export, request_size_max: u32) -> u32 {
    let wish = export.preferred_block_size().clamp(512, request_size_max);
    if wish.is_power_of_two() {
        wish
    } else {
        wish.next_power_of_two() / 2
    }
}

/// Parses INFO/GO data: export name, then the list of requested info types.
fn parse_info_request(data: &[u8]) -> Option<(String, Vec<u16>)> {
    let mut reader = PayloadReader::new(data);
    let name = reader.string_u32()?;
    let count = reader.u16()?;
    let requested = (0..count)
        .map(|_| reader.u16())
        .collect::<Option<Vec<u16>>>()?;
    (reader.remaining() == 0).then_some((name, requested))
}

/// Parses LIST/SET_META_CONTEXT data: export name, then the queries.
fn parse_meta_context_request(data: &[u8]) -> Option<(String, Vec<String>)> {
    let mut reader = PayloadReader::new(data);
    let name = reader.string_u32()?;
    let count = reader.u32()?;
    let mut queries = Vec::new();
    for _ in 0..count {
        queries.push(reader.string_u32()?);
    }
    (reader.remaining() == 0).then_some((name, queries))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn info_request_parses_and_refuses_trailing_bytes() {
        let mut data = 3u32.to_be_bytes().to_vec();
        data.extend_from_slice(b"abc");
        data.extend_from_slice(&1u16.to_be_bytes());
        data.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        assert_eq!(
            parse_info_request(&data),
            Some(("abc".to_string(), vec![INFO_BLOCK_SIZE]))
        );
        data.push(0);
        assert_eq!(parse_info_request(&data), None);
    }

    #[test]
    fn default_export_is_the_first_when_none_is_named_empty() {
        let table = ExportTable {
            entries: vec![(
                "disk".to_string(),
                Arc::new(crate::MemoryExport::new(4096)) as Arc<dyn Export>,
            )],
            policies: vec![ExportPolicy::default()],
        };
        assert_eq!(table.find(""), Some(0));
        assert_eq!(table.find("disk"), Some(0));
        assert_eq!(table.find("other"), None);
    }
}
