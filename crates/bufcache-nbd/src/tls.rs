//! TLS for the server (`NBD_OPT_STARTTLS`), with X.509 certificates or pre-shared keys.
//!
//! OpenSSL (the `openssl` crate over the system libssl) rather than rustls: NBD's PSK
//! deployments (nbdkit `--tls-psk`, qemu `tls-creds-psk`, libnbd `tls-psk-file=`) use
//! external pre-shared keys, which rustls does not support (its issue #174).
//!
//! After the TLS handshake the connection's protocol code keeps working on a plain
//! [`Stream`]: a relay thread moves bytes between one end of a socket pair (handed to the
//! protocol code, which clones it into reader and writer as for any connection) and the TLS
//! session. The relay buffers at most [`RELAY_BUFFER_BYTES`] each way and stops reading a
//! side whose destination is full, so back-pressure passes through it unchanged; it ends when
//! both directions are closed.

use std::io::{self, Read, Write};
use std::os::unix::io::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

use openssl::error::ErrorStack;
use openssl::ex_data::Index;
use openssl::pkey::PKey;
use openssl::ssl::{
    ErrorCode, Ssl, SslAcceptor, SslConnector, SslContextBuilder, SslFiletype, SslMethod, SslMode,
    SslRef, SslStream, SslVerifyMode, SslVersion,
};
use openssl::x509::store::{X509Lookup, X509StoreBuilder};
use openssl::x509::verify::X509VerifyFlags;
use openssl::x509::{X509Crl, X509};

use crate::stream::Stream;

/// Bytes the relay buffers in each direction.
const RELAY_BUFFER_BYTES: usize = 256 * 1024;

/// Whether the server offers TLS, with nbdkit's meaning of each word.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TlsMode {
    /// No TLS: `NBD_OPT_STARTTLS` is answered "unsupported".
    #[default]
    Off,
    /// Clients may upgrade with `NBD_OPT_STARTTLS`, or stay in plain text.
    On,
    /// Every option but `NBD_OPT_STARTTLS` and `NBD_OPT_ABORT` is refused with
    /// `NBD_REP_ERR_TLS_REQD` until the client has upgraded.
    Require,
}

impl FromStr for TlsMode {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "off" => Ok(TlsMode::Off),
            "on" => Ok(TlsMode::On),
            "require" => Ok(TlsMode::Require),
            _ => Err(format!(
                "{text:?} is not a TLS mode: expected off, on or require"
            )),
        }
    }
}

/// The server's TLS settings.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsConfig {
    pub mode: TlsMode,
    /// nbdkit's layout: `ca-cert.pem`, `server-cert.pem`, `server-key.pem`, optional
    /// `ca-crl.pem`.
    pub certificates: Option<PathBuf>,
    /// Ask clients for a certificate signed by `ca-cert.pem` and refuse those without one.
    pub verify_peer: bool,
    /// A psktool file: one `identity:hexkey` per line.
    pub psk_file: Option<PathBuf>,
}

impl TlsConfig {
    /// Checks the settings and loads every file, as the server will at start.
    pub fn validate(&self) -> Result<(), TlsError> {
        TlsServer::new(self).map(|_| ())
    }
}

/// Why the TLS settings cannot be used; each names the flag and the file.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("--tls={0:?} needs credentials: --tls-certificates DIR or --tls-psk FILE")]
    NoCredentials(&'static str),
    #[error("--tls-certificates and --tls-psk are alternatives: give one")]
    BothCredentials,
    #[error("--tls-verify-peer needs --tls-certificates DIR with a ca-cert.pem")]
    VerifyPeerWithoutCa,
    #[error("TLS flags were given but --tls is off: add --tls=on or --tls=require")]
    CredentialsWithoutTls,
    #[error("{flag}: cannot read {}: {source}", path.display())]
    Read {
        flag: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("{flag}: {} is not usable: {source}", path.display())]
    Invalid {
        flag: &'static str,
        path: PathBuf,
        source: ErrorStack,
    },
    #[error("--tls-psk: {}, line {line}: {reason}", path.display())]
    PskLine {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    #[error("--tls-psk: {} holds no key", path.display())]
    PskEmpty { path: PathBuf },
    #[error("TLS library: {0}")]
    Library(#[from] ErrorStack),
    #[error("TLS handshake failed: {0}")]
    Handshake(String),
}

/// One pre-shared key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PskEntry {
    pub identity: String,
    pub key: Vec<u8>,
}

/// Parses a psktool file: `identity:hexkey` per line; blank lines are skipped.
pub fn parse_psk_file(path: &Path) -> Result<Vec<PskEntry>, TlsError> {
    let text = std::fs::read_to_string(path).map_err(|source| TlsError::Read {
        flag: "--tls-psk",
        path: path.to_path_buf(),
        source,
    })?;
    let mut entries = Vec::new();
    for (index, line) in text.lines().enumerate() {
        let line_error = |reason: &str| TlsError::PskLine {
            path: path.to_path_buf(),
            line: index + 1,
            reason: reason.to_string(),
        };
        if line.trim().is_empty() {
            continue;
        }
        let Some((identity, hex)) = line.rsplit_once(':') else {
            return Err(line_error("expected identity:hexkey"));
        };
        if identity.is_empty() {
            return Err(line_error("the identity is empty"));
        }
        let hex = hex.trim();
        if hex.is_empty() || hex.len() % 2 != 0 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(line_error(
                "the key is not an even number of hexadecimal digits",
            ));
        }
        let key = (0..hex.len())
            .step_by(2)
            .map(|at| u8::from_str_radix(&hex[at..at + 2], 16).expect("checked hex digits"))
            .collect();
        entries.push(PskEntry {
            identity: identity.to_string(),
            key,
        });
    }
    if entries.is_empty() {
        return Err(TlsError::PskEmpty {
            path: path.to_path_buf(),
        });
    }
    Ok(entries)
}

/// The server's TLS policy, ready for connections.
#[derive(Clone)]
pub(crate) struct TlsServer {
    pub(crate) mode: TlsMode,
    acceptor: Option<Arc<SslAcceptor>>,
    /// Where the PSK callback records the identity it accepted: OpenSSL does not report a
    /// TLS 1.3 external PSK's identity through `SSL_get_psk_identity`.
    identity_index: Option<Index<Ssl, String>>,
}

impl TlsServer {
    /// Checks the settings and loads every file now, so a server never starts without the
    /// protection it was asked for.
    pub(crate) fn new(config: &TlsConfig) -> Result<TlsServer, TlsError> {
        let has_credentials = config.certificates.is_some() || config.psk_file.is_some();
        if config.mode == TlsMode::Off {
            if has_credentials || config.verify_peer {
                return Err(TlsError::CredentialsWithoutTls);
            }
            return Ok(TlsServer {
                mode: TlsMode::Off,
                acceptor: None,
                identity_index: None,
            });
        }
        let identity_index = Ssl::new_ex_index::<String>()?;
        let mode_name = if config.mode == TlsMode::On {
            "on"
        } else {
            "require"
        };
        let mut builder = SslAcceptor::mozilla_intermediate_v5(SslMethod::tls_server())?;
        builder.set_min_proto_version(Some(SslVersion::TLS1_2))?;
        builder.set_mode(SslMode::ACCEPT_MOVING_WRITE_BUFFER | SslMode::ENABLE_PARTIAL_WRITE);
        match (&config.certificates, &config.psk_file) {
            (None, None) => return Err(TlsError::NoCredentials(mode_name)),
            (Some(_), Some(_)) => return Err(TlsError::BothCredentials),
            (Some(directory), None) => load_certificates(&mut builder, directory, config)?,
            (None, Some(path)) => {
                if config.verify_peer {
                    return Err(TlsError::VerifyPeerWithoutCa);
                }
                let entries = parse_psk_file(path)?;
                builder.set_cipher_list(PSK_CIPHERS)?;
                builder.set_psk_server_callback(move |ssl, identity, key_out| {
                    let identity = identity.unwrap_or_default();
                    match entries
                        .iter()
                        .find(|entry| entry.identity.as_bytes() == identity)
                    {
                        Some(entry) if entry.key.len() <= key_out.len() => {
                            // Only counts once the handshake proves the client holds the key.
                            ssl.set_ex_data(identity_index, entry.identity.clone());
                            key_out[..entry.key.len()].copy_from_slice(&entry.key);
                            Ok(entry.key.len())
                        }
                        // Zero means "unknown identity": the handshake fails.
                        _ => Ok(0),
                    }
                });
            }
        }
        Ok(TlsServer {
            mode: config.mode,
            acceptor: Some(Arc::new(builder.build())),
            identity_index: Some(identity_index),
        })
    }

    /// Runs the TLS handshake on `stream` (blocking, bounded by its read timeout) and
    /// replaces it by the plain end of a relay to the TLS session. Returns the client's
    /// identity: its PSK identity, or its certificate's common name.
    pub(crate) fn upgrade(&self, stream: &mut Stream) -> io::Result<Option<String>> {
        let acceptor = self
            .acceptor
            .as_ref()
            .ok_or_else(|| io::Error::other("TLS is off"))?;
        let (plain_end, relay_end) = UnixStream::pair()?;
        let identity = match stream {
            Stream::Tcp(tcp) => {
                let tls = acceptor
                    .accept(tcp.try_clone()?)
                    .map_err(io::Error::other)?;
                let identity = identity_of(tls.ssl(), self.identity_index);
                spawn_relay(tls, relay_end)?;
                identity
            }
            Stream::Unix(unix) => {
                let tls = acceptor
                    .accept(unix.try_clone()?)
                    .map_err(io::Error::other)?;
                let identity = identity_of(tls.ssl(), self.identity_index);
                spawn_relay(tls, relay_end)?;
                identity
            }
        };
        *stream = Stream::Unix(plain_end);
        Ok(identity)
    }
}

/// The PSK identity of a session, or the common name of the client's verified certificate.
fn identity_of(ssl: &SslRef, identity_index: Option<Index<Ssl, String>>) -> Option<String> {
    if let Some(identity) = identity_index.and_then(|index| ssl.ex_data(index)) {
        return Some(identity.clone());
    }
    if let Some(identity) = ssl.psk_identity() {
        return Some(String::from_utf8_lossy(identity).into_owned());
    }
    let certificate = ssl.peer_certificate()?;
    let common_name = certificate
        .subject_name()
        .entries_by_nid(openssl::nid::Nid::COMMONNAME)
        .next()?;
    common_name.data().to_string().ok()
}

/// The client's side: runs the TLS handshake on `stream` with the URI's credentials and
/// replaces it by the plain end of a relay. The server's certificate is verified against
/// `ca-cert.pem`, and its name against `tls-hostname=` or the TCP host when there is one.
pub(crate) fn client_upgrade(
    stream: &mut Stream,
    settings: &crate::uri::ClientTls,
    host: Option<&str>,
) -> Result<(), TlsError> {
    let mut builder = SslConnector::builder(SslMethod::tls_client())?;
    builder.set_min_proto_version(Some(SslVersion::TLS1_2))?;
    builder.set_mode(SslMode::ACCEPT_MOVING_WRITE_BUFFER | SslMode::ENABLE_PARTIAL_WRITE);
    let hostname = settings.hostname.as_deref().or(host);
    let mut verify_hostname = hostname.is_some();
    if let Some(path) = &settings.psk_file {
        let entries = parse_psk_file(path)?;
        let entry = match &settings.username {
            Some(user) => entries
                .into_iter()
                .find(|entry| &entry.identity == user)
                .ok_or_else(|| TlsError::PskLine {
                    path: path.clone(),
                    line: 0,
                    reason: format!("no key for identity {user:?}"),
                })?,
            None => entries
                .into_iter()
                .next()
                .expect("parse_psk_file never returns none"),
        };
        builder.set_cipher_list(PSK_CIPHERS)?;
        builder.set_psk_client_callback(move |_ssl, _hint, identity_out, key_out| {
            let identity = entry.identity.as_bytes();
            if identity.len() + 1 > identity_out.len() || entry.key.len() > key_out.len() {
                return Ok(0);
            }
            identity_out[..identity.len()].copy_from_slice(identity);
            identity_out[identity.len()] = 0;
            key_out[..entry.key.len()].copy_from_slice(&entry.key);
            Ok(entry.key.len())
        });
        // A PSK session has no server certificate to check.
        builder.set_verify(SslVerifyMode::NONE);
        verify_hostname = false;
    }
    if let Some(directory) = &settings.certificates {
        const FLAG: &str = "tls-certificates=";
        let ca = directory.join("ca-cert.pem");
        builder
            .set_ca_file(&ca)
            .map_err(|source| TlsError::Invalid {
                flag: FLAG,
                path: ca.clone(),
                source,
            })?;
        let certificate = directory.join("client-cert.pem");
        let key = directory.join("client-key.pem");
        if certificate.exists() && key.exists() {
            builder
                .set_certificate_chain_file(&certificate)
                .map_err(|source| TlsError::Invalid {
                    flag: FLAG,
                    path: certificate.clone(),
                    source,
                })?;
            builder
                .set_private_key_file(&key, SslFiletype::PEM)
                .map_err(|source| TlsError::Invalid {
                    flag: FLAG,
                    path: key.clone(),
                    source,
                })?;
        }
        builder.set_verify(SslVerifyMode::PEER);
    }
    let connector = builder.build();
    let mut configuration = connector.configure()?;
    configuration.set_verify_hostname(verify_hostname);
    configuration.set_use_server_name_indication(verify_hostname);
    let name = hostname.unwrap_or("localhost");
    let (plain_end, relay_end) = UnixStream::pair().map_err(io_error)?;
    match stream {
        Stream::Tcp(tcp) => {
            let tls = configuration
                .connect(name, tcp.try_clone().map_err(io_error)?)
                .map_err(|error| client_handshake_error(&error))?;
            spawn_relay(tls, relay_end).map_err(io_error)?;
        }
        Stream::Unix(unix) => {
            let tls = configuration
                .connect(name, unix.try_clone().map_err(io_error)?)
                .map_err(|error| client_handshake_error(&error))?;
            spawn_relay(tls, relay_end).map_err(io_error)?;
        }
    }
    *stream = Stream::Unix(plain_end);
    Ok(())
}

fn client_handshake_error<S>(error: &openssl::ssl::HandshakeError<S>) -> TlsError {
    TlsError::Handshake(match error {
        openssl::ssl::HandshakeError::Failure(stream) => stream.error().to_string(),
        openssl::ssl::HandshakeError::SetupFailure(stack) => stack.to_string(),
        openssl::ssl::HandshakeError::WouldBlock(_) => "timed out".to_string(),
    })
}

fn io_error(error: io::Error) -> TlsError {
    TlsError::Handshake(error.to_string())
}

/// TLS 1.2 PSK suites, for peers that do not offer TLS 1.3.
const PSK_CIPHERS: &str = "PSK-AES256-GCM-SHA384:PSK-AES128-GCM-SHA256:ECDHE-PSK-AES256-CBC-SHA384:ECDHE-PSK-AES128-CBC-SHA256:PSK-AES256-CBC-SHA384:PSK-AES128-CBC-SHA256";

fn load_certificates(
    builder: &mut SslContextBuilder,
    directory: &Path,
    config: &TlsConfig,
) -> Result<(), TlsError> {
    const FLAG: &str = "--tls-certificates";
    let file = |name: &str| directory.join(name);
    let read = |path: &Path| {
        std::fs::read(path).map_err(|source| TlsError::Read {
            flag: FLAG,
            path: path.to_path_buf(),
            source,
        })
    };
    let invalid = |path: &Path| {
        let path = path.to_path_buf();
        move |source| TlsError::Invalid {
            flag: FLAG,
            path,
            source,
        }
    };
    let certificate_path = file("server-cert.pem");
    let chain =
        X509::stack_from_pem(&read(&certificate_path)?).map_err(invalid(&certificate_path))?;
    let Some((leaf, rest)) = chain.split_first() else {
        return Err(TlsError::Invalid {
            flag: FLAG,
            path: certificate_path,
            source: ErrorStack::get(),
        });
    };
    builder
        .set_certificate(leaf)
        .map_err(invalid(&certificate_path))?;
    for extra in rest {
        builder
            .add_extra_chain_cert(extra.clone())
            .map_err(invalid(&certificate_path))?;
    }
    let key_path = file("server-key.pem");
    let key = PKey::private_key_from_pem(&read(&key_path)?).map_err(invalid(&key_path))?;
    builder.set_private_key(&key).map_err(invalid(&key_path))?;
    builder.check_private_key().map_err(invalid(&key_path))?;
    let ca_path = file("ca-cert.pem");
    if config.verify_peer {
        if !ca_path.exists() {
            return Err(TlsError::VerifyPeerWithoutCa);
        }
        let mut store = X509StoreBuilder::new()?;
        for ca in X509::stack_from_pem(&read(&ca_path)?).map_err(invalid(&ca_path))? {
            store.add_cert(ca).map_err(invalid(&ca_path))?;
        }
        let crl_path = file("ca-crl.pem");
        if crl_path.exists() {
            // Parsed first so a broken file is reported as such, then loaded by OpenSSL.
            X509Crl::from_pem(&read(&crl_path)?).map_err(invalid(&crl_path))?;
            store
                .add_lookup(X509Lookup::file())?
                .load_crl_file(&crl_path, SslFiletype::PEM)
                .map_err(invalid(&crl_path))?;
            store.set_flags(X509VerifyFlags::CRL_CHECK)?;
        }
        builder.set_verify_cert_store(store.build())?;
        builder.set_verify(SslVerifyMode::PEER | SslVerifyMode::FAIL_IF_NO_PEER_CERT);
    }
    Ok(())
}

fn spawn_relay<S>(tls: SslStream<S>, plain: UnixStream) -> io::Result<()>
where
    S: Read + Write + AsRawFd + Send + 'static,
{
    std::thread::Builder::new()
        .name("nbd-tls-relay".into())
        .spawn(move || {
            if let Err(error) = relay(tls, plain) {
                tracing::debug!("TLS relay ended: {error}");
            }
        })?;
    Ok(())
}

fn set_nonblocking(descriptor: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor this relay owns; no pointers involved.
    unsafe {
        let flags = libc::fcntl(descriptor, libc::F_GETFL);
        if flags < 0 || libc::fcntl(descriptor, libc::F_SETFL, flags | libc::O_NONBLOCK) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Moves bytes both ways between the TLS session and the plain end until both are closed.
fn relay<S: Read + Write + AsRawFd>(
    mut tls: SslStream<S>,
    mut plain: UnixStream,
) -> io::Result<()> {
    let tls_fd = tls.get_ref().as_raw_fd();
    set_nonblocking(tls_fd)?;
    plain.set_nonblocking(true)?;
    let mut to_plain: Vec<u8> = Vec::new();
    let mut to_tls: Vec<u8> = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    let mut tls_closed = false;
    let mut plain_closed = false;
    let mut plain_write_shut = false;
    loop {
        let mut progress = false;
        // TLS -> plain.
        if !tls_closed && to_plain.len() < RELAY_BUFFER_BYTES {
            match tls.ssl_read(&mut chunk) {
                Ok(0) => tls_closed = true,
                Ok(count) => {
                    to_plain.extend_from_slice(&chunk[..count]);
                    progress = true;
                }
                Err(error) if would_block(&error) => {}
                Err(_) => tls_closed = true,
            }
        }
        if !to_plain.is_empty() {
            match plain.write(&to_plain) {
                Ok(count) => {
                    to_plain.drain(..count);
                    progress |= count > 0;
                }
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
                Err(error) => return Err(error),
            }
        }
        if tls_closed && to_plain.is_empty() && !plain_write_shut {
            // The client sent its last byte: the protocol reader sees end-of-file.
            let _ = plain.shutdown(std::net::Shutdown::Write);
            plain_write_shut = true;
        }
        // Plain -> TLS.
        if !plain_closed && to_tls.len() < RELAY_BUFFER_BYTES {
            match plain.read(&mut chunk) {
                Ok(0) => plain_closed = true,
                Ok(count) => {
                    to_tls.extend_from_slice(&chunk[..count]);
                    progress = true;
                }
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
                Err(_) => plain_closed = true,
            }
        }
        let mut tls_write_wants_read = false;
        if !to_tls.is_empty() {
            match tls.ssl_write(&to_tls) {
                Ok(count) => {
                    to_tls.drain(..count);
                    progress |= count > 0;
                }
                Err(error) if error.code() == ErrorCode::WANT_READ => tls_write_wants_read = true,
                Err(error) if error.code() == ErrorCode::WANT_WRITE => {}
                // The client is gone: nothing more can reach it.
                Err(error) => return Err(io::Error::other(error)),
            }
        }
        if plain_closed && to_tls.is_empty() {
            // The server side is done: say so to the client and end.
            let _ = tls.shutdown();
            return Ok(());
        }
        if progress {
            continue;
        }
        let mut tls_events = 0;
        if (!tls_closed && to_plain.len() < RELAY_BUFFER_BYTES) || tls_write_wants_read {
            tls_events |= libc::POLLIN;
        }
        if !to_tls.is_empty() {
            tls_events |= libc::POLLOUT;
        }
        let mut plain_events = 0;
        if !plain_closed && to_tls.len() < RELAY_BUFFER_BYTES {
            plain_events |= libc::POLLIN;
        }
        if !to_plain.is_empty() {
            plain_events |= libc::POLLOUT;
        }
        let mut poll_fds = [
            libc::pollfd {
                fd: tls_fd,
                events: tls_events,
                revents: 0,
            },
            libc::pollfd {
                fd: plain.as_raw_fd(),
                events: plain_events,
                revents: 0,
            },
        ];
        // SAFETY: a valid array of two pollfd with its true length; both descriptors are
        // open for the call. The timeout only guards against a missed wake-up.
        let ready = unsafe { libc::poll(poll_fds.as_mut_ptr(), 2, 1000) };
        if ready < 0 {
            let error = io::Error::last_os_error();
            if error.kind() != io::ErrorKind::Interrupted {
                return Err(error);
            }
        }
    }
}

fn would_block(error: &openssl::ssl::Error) -> bool {
    matches!(error.code(), ErrorCode::WANT_READ | ErrorCode::WANT_WRITE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psk_files_parse_and_bad_lines_are_named() {
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("keys.psk");
        std::fs::write(&path, "alice:0a0b0c\n\nbob:ffee\n").unwrap();
        let entries = parse_psk_file(&path).unwrap();
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0].identity, "alice");
        assert_eq!(entries[0].key, vec![0x0a, 0x0b, 0x0c]);
        for (text, line) in [
            ("alice:0a0b\nbob\n", 2),
            ("alice:xyz0\n", 1),
            (":0a0b\n", 1),
            ("alice:0a0\n", 1),
        ] {
            std::fs::write(&path, text).unwrap();
            let message = parse_psk_file(&path).unwrap_err().to_string();
            assert!(
                message.contains(&format!("line {line}")) && message.contains("keys.psk"),
                "{message}"
            );
        }
        std::fs::write(&path, "\n").unwrap();
        assert!(parse_psk_file(&path).is_err());
    }
}
