//! The NBD server: listening sockets, the accept loop, one thread per connection, and
//! orderly shutdown.
//!
//! Lifecycle: [`Server::new`] validates the configuration and exports, [`Server::bind`]
//! opens every listen address (so the caller can learn the ports it got, port 0 included),
//! and [`BoundServer::run`] serves until its [`ShutdownHandle`] is triggered. Shutdown stops
//! accepting at once and, as the spec suggests, tells clients: for [`SHUTDOWN_NOTICE`] a
//! connection still negotiating has every option answered `NBD_REP_ERR_SHUTDOWN` and one in
//! transmission every new request answered ESHUTDOWN (either client then disconnects), while
//! requests already accepted are served. After that, negotiating connections are closed and
//! the others have their read side shut (a blocked reader sees end-of-file) and end once their
//! accepted requests are answered. [`BoundServer::run`] returns once every connection thread
//! has ended; the caller then flushes its exports. Unix socket
//! files the server created are removed when it returns. A misbehaving client only ever ends
//! its own connection.

use std::collections::HashMap;
use std::fmt;
use std::io;
use std::net::{IpAddr, SocketAddr, TcpListener, ToSocketAddrs};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::io::{AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::config::{ConfigError, ExportPolicy, ListenAddress, ServerConfig};
use crate::export::Export;
use crate::handshake::{self, ExportTable, Outcome};
pub use crate::shutdown::ShutdownHandle;
use crate::stream::Stream;
use crate::tls::TlsServer;
use crate::transmission::{self, ConnectionLimits, InflightBudget, ServerBudget};

/// How long shutdown waits for connections to answer their in-flight requests before it
/// closes them outright.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// How long shutdown answers options with `NBD_REP_ERR_SHUTDOWN` and requests with
/// ESHUTDOWN, so clients hear of it and disconnect, before it closes negotiating connections
/// and shuts the read side of the others (an idle client would never hear of it).
const SHUTDOWN_NOTICE: Duration = Duration::from_millis(500);

/// How often the accept loop looks at the shutdown flag, in milliseconds.
const SHUTDOWN_POLL_MILLISECONDS: i32 = 100;

/// Why the server could not start or keep running.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("invalid server configuration: {0}")]
    Config(#[from] ConfigError),
    #[error("no exports: the server needs at least one")]
    NoExports,
    #[error("export name {0:?} is used twice")]
    DuplicateExport(String),
    #[error("export name {0:?} is longer than the 4096 bytes NBD allows")]
    ExportNameTooLong(String),
    #[error("cannot resolve listen address {address}: {source}")]
    Resolve { address: String, source: io::Error },
    #[error("cannot listen on {address}: {source}")]
    Bind { address: String, source: io::Error },
    #[error("{0}")]
    Tls(#[from] crate::tls::TlsError),
    #[error("an export policy names {0:?}, which is not an export")]
    PolicyForUnknownExport(String),
    #[error("accept loop failed: {0}")]
    Poll(io::Error),
}

/// An address the server is actually listening on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BoundAddress {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

impl BoundAddress {
    /// The NBD URI a client uses to reach `export` here.
    pub fn uri(&self, export: &str) -> String {
        match self {
            BoundAddress::Tcp(address) => format!("nbd://{address}/{export}"),
            BoundAddress::Unix(path) => format!("nbd+unix:///{export}?socket={}", path.display()),
        }
    }
}

impl fmt::Display for BoundAddress {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BoundAddress::Tcp(address) => write!(formatter, "tcp:{address}"),
            BoundAddress::Unix(path) => write!(formatter, "unix:{}", path.display()),
        }
    }
}

/// A configured server that has not opened its sockets yet.
pub struct Server {
    config: ServerConfig,
    exports: Arc<ExportTable>,
    tls: TlsServer,
}

impl Server {
    /// Checks the configuration and the export list (non-empty, unique names).
    pub fn new(
        config: ServerConfig,
        exports: Vec<(String, Arc<dyn Export>)>,
    ) -> Result<Server, ServerError> {
        config.validate()?;
        if exports.is_empty() {
            return Err(ServerError::NoExports);
        }
        for (index, (name, _)) in exports.iter().enumerate() {
            if name.len() > crate::protocol::STRING_BYTES_MAX {
                return Err(ServerError::ExportNameTooLong(name.clone()));
            }
            if exports[..index].iter().any(|(earlier, _)| earlier == name) {
                return Err(ServerError::DuplicateExport(name.clone()));
            }
        }
        let tls = TlsServer::new(&config.tls)?;
        let mut policies = vec![ExportPolicy::default(); exports.len()];
        for (name, policy) in &config.export_policies {
            let index = exports
                .iter()
                .position(|(export, _)| export == name)
                .ok_or_else(|| ServerError::PolicyForUnknownExport(name.clone()))?;
            policies[index] = policy.clone();
        }
        Ok(Server {
            config,
            exports: Arc::new(ExportTable {
                entries: exports,
                policies,
            }),
            tls,
        })
    }

    /// Opens every listen address.
    pub fn bind(self) -> Result<BoundServer, ServerError> {
        let listeners = Listeners::bind(&self.config)?;
        self.with_listeners(listeners)
    }

    /// Serves on listening sockets already open (systemd socket activation passes them as
    /// file descriptors) instead of the configured listen addresses. Each must be a listening
    /// TCP or unix stream socket.
    pub fn bind_inherited(self, sockets: Vec<OwnedFd>) -> Result<BoundServer, ServerError> {
        let listeners = Listeners::inherited(sockets)?;
        self.with_listeners(listeners)
    }

    /// Serves on `listeners`, bound before the exports were opened (see [`Listeners`]):
    /// they listen from now on.
    pub fn with_listeners(self, listeners: Listeners) -> Result<BoundServer, ServerError> {
        let listeners = listeners.listen()?;
        Ok(BoundServer {
            budget: Arc::new(ServerBudget::new(
                self.config.inflight_bytes_max,
                self.config.connections_max,
            )),
            config: self.config,
            exports: self.exports,
            tls: self.tls,
            listeners,
        })
    }

    /// Binds and serves until `shutdown` is triggered.
    pub fn run(self, shutdown: ShutdownHandle) -> Result<(), ServerError> {
        self.bind()?.run(shutdown)
    }
}

/// Sockets bound to the listen addresses before the exports exist, not yet listening: a
/// program whose exports write to their disks when opened (a lock, an epoch) binds first, so
/// an address in use refuses the start before any disk was changed, while a client (or a
/// readiness probe) still finds nothing to connect to until [`Server::with_listeners`] makes
/// them listen.
pub struct Listeners {
    bound: Vec<BoundSocket>,
    /// Sockets passed by a service manager, already listening.
    inherited: Vec<Listener>,
}

/// A socket bound to an address, not listening yet.
struct BoundSocket {
    socket: socket2::Socket,
    address: String,
    /// A unix socket's paths: where it is bound now, and where it appears once it listens.
    unix_path: Option<UnixPaths>,
}

/// A unix socket is bound under a hidden name beside its path and renamed to the path only
/// once it listens: clients (and scripts) that wait for the path to exist and then connect
/// never find a socket that refuses them, while a path that cannot be bound still refuses the
/// start before any disk is opened.
struct UnixPaths {
    /// Where the socket is bound (the path itself when no hidden name could be bound).
    bound: PathBuf,
    /// The path the listen address names.
    path: PathBuf,
}

impl Drop for BoundSocket {
    fn drop(&mut self) {
        if let Some(paths) = self.unix_path.take() {
            let _ = std::fs::remove_file(paths.bound);
        }
    }
}

impl Listeners {
    /// Binds every listen address of `config`.
    pub fn bind(config: &ServerConfig) -> Result<Listeners, ServerError> {
        let mut bound = Vec::new();
        for address in &config.listen {
            bound.extend(bind_address(address)?);
        }
        if bound.is_empty() {
            return Err(ServerError::Bind {
                address: "the listen addresses".into(),
                source: io::Error::new(io::ErrorKind::InvalidInput, "none were given"),
            });
        }
        Ok(Listeners {
            bound,
            inherited: Vec::new(),
        })
    }

    /// Takes listening sockets already open (systemd socket activation passes them as file
    /// descriptors). Each must be a listening TCP or unix stream socket.
    pub fn inherited(sockets: Vec<OwnedFd>) -> Result<Listeners, ServerError> {
        let mut listeners = Vec::new();
        for socket in sockets {
            let fd = socket.as_raw_fd();
            let inherited_error = |source| ServerError::Bind {
                address: format!("inherited socket (file descriptor {fd})"),
                source,
            };
            let listener = match socket_domain(fd).map_err(inherited_error)? {
                libc::AF_UNIX => Listener::Unix(UnixListener::from(socket), None),
                libc::AF_INET | libc::AF_INET6 => Listener::Tcp(TcpListener::from(socket)),
                domain => {
                    return Err(inherited_error(io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("socket family {domain} is neither TCP nor unix"),
                    )))
                }
            };
            let nonblocking = match &listener {
                Listener::Tcp(tcp) => tcp.set_nonblocking(true),
                Listener::Unix(unix, _) => unix.set_nonblocking(true),
            };
            nonblocking.map_err(inherited_error)?;
            listeners.push(listener);
        }
        if listeners.is_empty() {
            return Err(ServerError::Bind {
                address: "inherited sockets".into(),
                source: io::Error::new(io::ErrorKind::InvalidInput, "none were passed"),
            });
        }
        Ok(Listeners {
            bound: Vec::new(),
            inherited: listeners,
        })
    }

    /// Makes every bound socket listen.
    fn listen(self) -> Result<Vec<Listener>, ServerError> {
        let Listeners { bound, inherited } = self;
        let mut listeners = inherited;
        for mut bound in bound {
            let bind_error = |source| ServerError::Bind {
                address: bound.address.clone(),
                source,
            };
            bound.socket.listen(LISTEN_BACKLOG).map_err(bind_error)?;
            bound.socket.set_nonblocking(true).map_err(bind_error)?;
            if let Some(paths) = &bound.unix_path {
                if paths.bound != paths.path {
                    remove_stale_socket(&paths.path);
                    std::fs::rename(&paths.bound, &paths.path).map_err(bind_error)?;
                }
            }
            let unix_path = bound.unix_path.take().map(|paths| paths.path);
            let socket = bound.socket.try_clone().map_err(bind_error)?;
            drop(bound);
            listeners.push(match unix_path {
                Some(path) => Listener::Unix(UnixListener::from(OwnedFd::from(socket)), Some(path)),
                None => Listener::Tcp(TcpListener::from(socket)),
            });
        }
        assert!(!listeners.is_empty(), "a server listens somewhere");
        Ok(listeners)
    }
}

/// Connections a listening socket queues before the server accepts them.
const LISTEN_BACKLOG: i32 = 1024;

enum Listener {
    Tcp(TcpListener),
    /// The path, when given, is removed when the listener is dropped (not for an inherited
    /// socket: its owner, the service manager, keeps it).
    Unix(UnixListener, Option<PathBuf>),
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix(_, Some(path)) = self {
            let _ = std::fs::remove_file(path);
        }
    }
}

impl Listener {
    fn raw_fd(&self) -> i32 {
        match self {
            Listener::Tcp(listener) => listener.as_raw_fd(),
            Listener::Unix(listener, _) => listener.as_raw_fd(),
        }
    }

    fn accept(&self) -> io::Result<Stream> {
        let stream = match self {
            Listener::Tcp(listener) => Stream::Tcp(listener.accept()?.0),
            Listener::Unix(listener, _) => Stream::Unix(listener.accept()?.0),
        };
        // The listener is non-blocking for the accept loop; connections are not.
        match &stream {
            Stream::Tcp(tcp) => tcp.set_nonblocking(false)?,
            Stream::Unix(unix) => unix.set_nonblocking(false)?,
        }
        stream.set_no_delay();
        Ok(stream)
    }

    fn bound_address(&self) -> io::Result<BoundAddress> {
        Ok(match self {
            Listener::Tcp(listener) => BoundAddress::Tcp(listener.local_addr()?),
            Listener::Unix(_, Some(path)) => BoundAddress::Unix(path.clone()),
            Listener::Unix(listener, None) => BoundAddress::Unix(
                listener
                    .local_addr()?
                    .as_pathname()
                    .map_or_else(|| PathBuf::from("(unnamed)"), Path::to_path_buf),
            ),
        })
    }
}

/// The address family of socket `fd` (SO_DOMAIN).
fn socket_domain(fd: i32) -> io::Result<i32> {
    let mut domain: libc::c_int = 0;
    let mut length = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `length` bytes into `domain`, which is that large.
    let result = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_DOMAIN,
            (&mut domain as *mut libc::c_int).cast(),
            &mut length,
        )
    };
    if result == 0 {
        Ok(domain)
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Opens one listen address (a host name may resolve to several sockets).
fn bind_address(address: &ListenAddress) -> Result<Vec<BoundSocket>, ServerError> {
    let bind_error = |source| ServerError::Bind {
        address: address.to_string(),
        source,
    };
    match address {
        ListenAddress::Tcp(host_port) => {
            let resolved: Vec<SocketAddr> = host_port
                .to_socket_addrs()
                .map_err(|source| ServerError::Resolve {
                    address: address.to_string(),
                    source,
                })?
                .collect();
            let mut bound = Vec::new();
            for socket_address in resolved {
                let socket = socket2::Socket::new(
                    socket2::Domain::for_address(socket_address),
                    socket2::Type::STREAM,
                    None,
                )
                .map_err(bind_error)?;
                // As std's TcpListener::bind: a port in TIME_WAIT is reused, one another
                // socket listens on is refused here.
                socket.set_reuse_address(true).map_err(bind_error)?;
                socket.bind(&socket_address.into()).map_err(bind_error)?;
                bound.push(BoundSocket {
                    socket,
                    address: address.to_string(),
                    unix_path: None,
                });
            }
            Ok(bound)
        }
        ListenAddress::Unix(path) => {
            remove_stale_socket(path);
            if std::fs::symlink_metadata(path).is_ok() {
                // A live server's socket, or a file that is not a socket: bind would refuse it.
                return Err(bind_error(io::Error::from(io::ErrorKind::AddrInUse)));
            }
            let bind_at = |at: &Path| -> io::Result<socket2::Socket> {
                let socket =
                    socket2::Socket::new(socket2::Domain::UNIX, socket2::Type::STREAM, None)?;
                socket.bind(&socket2::SockAddr::unix(at)?)?;
                Ok(socket)
            };
            let hidden = hidden_name(path);
            let (socket, bound) = match hidden.as_deref().map(|hidden| (bind_at(hidden), hidden)) {
                Some((Ok(socket), hidden)) => (socket, hidden.to_path_buf()),
                // Too long for a socket address, or a directory that refuses the name: bound
                // at the path itself, as before.
                _ => (bind_at(path).map_err(bind_error)?, path.clone()),
            };
            Ok(vec![BoundSocket {
                socket,
                address: address.to_string(),
                unix_path: Some(UnixPaths {
                    bound,
                    path: path.clone(),
                }),
            }])
        }
    }
}

/// `.NAME.PID.binding` beside `path`, where its socket is bound until it listens.
fn hidden_name(path: &Path) -> Option<PathBuf> {
    let name = path.file_name()?.to_str()?;
    Some(path.with_file_name(format!(".{name}.{}.binding", std::process::id())))
}

/// Removes a socket file left behind by a server that died, but never a live server's socket
/// or a file that is not a socket.
fn remove_stale_socket(path: &Path) {
    let is_socket = std::fs::symlink_metadata(path)
        .map(|metadata| metadata.file_type().is_socket())
        .unwrap_or(false);
    if is_socket && UnixStream::connect(path).is_err() {
        let _ = std::fs::remove_file(path);
    }
}

/// A server with open sockets, ready to run.
pub struct BoundServer {
    config: ServerConfig,
    /// The in-flight byte budget all connections share.
    budget: Arc<ServerBudget>,
    tls: TlsServer,
    exports: Arc<ExportTable>,
    listeners: Vec<Listener>,
}

impl BoundServer {
    /// The addresses the server listens on, with the real port when port 0 was asked for.
    pub fn local_addrs(&self) -> Vec<BoundAddress> {
        self.listeners
            .iter()
            .filter_map(|listener| listener.bound_address().ok())
            .collect()
    }

    /// Serves until `shutdown` is triggered, then drains every connection and returns.
    pub fn run(self, shutdown: ShutdownHandle) -> Result<(), ServerError> {
        for address in self.local_addrs() {
            tracing::info!(%address, "NBD server listening");
        }
        let connections = Connections::default();
        let result = self.accept_loop(&shutdown, &connections);
        drop(self.listeners);
        connections.drain();
        tracing::info!("NBD server stopped");
        result
    }

    fn accept_loop(
        &self,
        shutdown: &ShutdownHandle,
        connections: &Connections,
    ) -> Result<(), ServerError> {
        let mut poll_fds: Vec<libc::pollfd> = self
            .listeners
            .iter()
            .map(|listener| libc::pollfd {
                fd: listener.raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        while !shutdown.is_triggered() {
            connections.reap_finished();
            connections.expire_handshakes(self.config.handshake_timeout);
            // SAFETY: `poll_fds` is a valid, exclusively borrowed array of `pollfd` whose
            // length is passed alongside; the descriptors stay open for the whole call.
            let ready = unsafe {
                libc::poll(
                    poll_fds.as_mut_ptr(),
                    poll_fds.len() as libc::nfds_t,
                    SHUTDOWN_POLL_MILLISECONDS,
                )
            };
            if ready < 0 {
                let error = io::Error::last_os_error();
                if error.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(ServerError::Poll(error));
            }
            for (index, poll_fd) in poll_fds.iter().enumerate() {
                if poll_fd.revents != 0 {
                    self.accept_one(&self.listeners[index], connections, shutdown);
                }
            }
        }
        Ok(())
    }

    fn accept_one(
        &self,
        listener: &Listener,
        connections: &Connections,
        shutdown: &ShutdownHandle,
    ) {
        let stream = match listener.accept() {
            Ok(stream) => stream,
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => return,
            Err(error) => {
                // Typically out of descriptors; the next poll round tries again.
                tracing::warn!("accept failed: {error}");
                return;
            }
        };
        let peer = stream.peer_description();
        if let Stream::Tcp(_) = stream {
            let access = &self.config.access;
            let verdict = match stream.peer_ip() {
                Some(address) => access.check(address),
                // Fail closed: rules that cannot be checked are not skipped.
                None if access.allow.is_empty() && access.deny.is_empty() => Ok(()),
                None => Err(crate::config::AccessRefused::UnknownAddress),
            };
            if let Err(reason) = verdict {
                // Closed before a byte of negotiation: the peer learns nothing.
                tracing::warn!(%peer, "connection refused: {reason}");
                return;
            }
        }
        if !connections.admit(&peer, stream.peer_ip(), &self.config) {
            return;
        }
        let exports = Arc::clone(&self.exports);
        let config = self.config.clone();
        let budget = Arc::clone(&self.budget);
        let tls = self.tls.clone();
        let shutdown = shutdown.clone();
        let thread_peer = peer.clone();
        if let Err(error) = connections.spawn(stream, peer, move |stream, admission| {
            let context = ConnectionContext {
                exports: &exports,
                config: &config,
                budget: &budget,
                tls: &tls,
                shutdown: &shutdown,
            };
            serve_connection(stream, &context, admission, &thread_peer)
        }) {
            tracing::warn!("could not start a connection thread: {error}");
        }
    }
}

/// Handshake then transmission for one client. Errors end only this connection.
/// What every connection of a server shares.
struct ConnectionContext<'a> {
    exports: &'a ExportTable,
    config: &'a ServerConfig,
    budget: &'a Arc<ServerBudget>,
    tls: &'a TlsServer,
    shutdown: &'a ShutdownHandle,
}

fn serve_connection(
    mut stream: Stream,
    context: &ConnectionContext<'_>,
    admission: &Admission,
    peer: &str,
) {
    let config = context.config;
    let budget = context.budget;
    // Every log line of this connection (handshake and TLS included) names the peer. The
    // span is at WARN level so it is enabled whenever the warnings it frames are.
    let _span = tracing::warn_span!("connection", %peer).entered();
    // A client that never finishes the handshake must not hold a thread forever. Writes are
    // bounded too: the serving slot is taken before the last handshake reply is written, and
    // a client that stops reading must not keep it (the handshake budget's expiry no longer
    // covers a connection that holds a serving slot).
    let timeouts = stream
        .set_read_timeout(Some(config.handshake_timeout))
        .and_then(|()| stream.set_write_timeout(Some(config.handshake_timeout)));
    if let Err(error) = timeouts {
        tracing::warn!(%peer, "cannot set the handshake timeout: {error}");
        return;
    }
    let mut admit = || admission.establish(config.connections_max);
    let negotiated = match handshake::negotiate(
        &mut stream,
        context.exports,
        config.request_size_max,
        context.tls,
        context.shutdown,
        &mut admit,
    ) {
        Ok(Outcome::Transmission(negotiated)) => negotiated,
        Ok(Outcome::Closed) => {
            tracing::debug!(%peer, "client left during the handshake");
            return;
        }
        // A peer gone before or during the greeting (a port probe, a health check, a
        // readiness poll) is routine, not a warning.
        Err(handshake::HandshakeError::Io(error))
            if matches!(
                error.kind(),
                io::ErrorKind::ConnectionReset
                    | io::ErrorKind::BrokenPipe
                    | io::ErrorKind::UnexpectedEof
            ) =>
        {
            tracing::debug!(%peer, "client left during the handshake: {error}");
            return;
        }
        Err(error) => {
            tracing::warn!(%peer, "handshake failed: {error}");
            return;
        }
    };
    let export_name = negotiated.export_name.clone();
    tracing::info!(
        %peer,
        export = %export_name,
        structured_replies = negotiated.structured_replies,
        "client connected"
    );
    // From here a connection holds a share of the in-flight budget only while it makes
    // progress: a read or write waiting longer than the stall timeout ends it (waiting for
    // the next request to begin excepted, see `transmission`).
    let stall_timeouts = stream
        .set_read_timeout(Some(config.stall_timeout))
        .and_then(|()| stream.set_write_timeout(Some(config.stall_timeout)));
    if let Err(error) = stall_timeouts {
        tracing::warn!(%peer, "cannot set the stall timeout: {error}");
        return;
    }
    let limits = ConnectionLimits {
        request_size_max: config.request_size_max,
        connection_inflight_bytes_max: config.connection_inflight_bytes_max,
        workers_max: config.workers_per_connection_max,
        idle_timeout: config.idle_timeout,
        stall_timeout: config.stall_timeout,
    };
    let inflight = Arc::clone(&admission.inflight);
    match transmission::serve(stream, negotiated, limits, Arc::clone(budget), inflight) {
        Ok(()) => tracing::info!(%peer, export = %export_name, "client disconnected"),
        Err(error) => {
            tracing::warn!(%peer, export = %export_name, "connection closed: {error}")
        }
    }
}

/// Where a connection is in its life, for the connection budgets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Accepted, still negotiating: counts against `handshake_connections_max`.
    Handshake,
    /// In transmission: counts against `connections_max`.
    Serving,
    /// Evicted or timed out; its socket is shut and its thread is ending. Counts nowhere.
    Closing,
}

/// One open connection: a handle on its socket (so it can be woken or evicted), when it was
/// accepted, and its phase.
struct Entry {
    socket: Stream,
    peer: String,
    /// The TCP peer's address (`None` for unix sockets), for the per-peer handshake budget.
    peer_ip: Option<IpAddr>,
    accepted: Instant,
    phase: Phase,
    /// The connection's requests in flight, and since when it has had none: when every
    /// serving slot is taken, the connection idle the longest is evicted.
    inflight: Arc<InflightBudget>,
}

type Registry = Arc<Mutex<HashMap<u64, Entry>>>;

/// A connection thread's handle on its own registry entry.
struct Admission {
    id: u64,
    registry: Registry,
    inflight: Arc<InflightBudget>,
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.registry.lock().remove(&self.id);
    }
}

impl Admission {
    /// Moves the connection from the handshake budget to the serving one; false (and the
    /// connection must end) when every serving slot is taken by a connection with requests
    /// in flight, or when this connection was evicted or timed out meanwhile. When every
    /// slot is taken, the serving connection idle the longest is closed to make room: an
    /// idle client can reconnect when it needs to, a new one could not be served at all.
    fn establish(&self, connections_max: usize) -> bool {
        let mut registry = self.registry.lock();
        if registry.get(&self.id).map(|entry| entry.phase) != Some(Phase::Handshake) {
            return false;
        }
        let serving = registry
            .values()
            .filter(|entry| entry.phase == Phase::Serving)
            .count();
        if serving >= connections_max && !evict_longest_idle(&mut registry, connections_max) {
            return false;
        }
        let entry = registry.get_mut(&self.id).expect("checked above");
        entry.phase = Phase::Serving;
        true
    }
}

/// Closes the serving connection idle the longest (none in flight); false when none is idle.
fn evict_longest_idle(registry: &mut HashMap<u64, Entry>, connections_max: usize) -> bool {
    let longest_idle = registry
        .values_mut()
        .filter(|entry| entry.phase == Phase::Serving)
        .filter_map(|entry| entry.inflight.idle_since().map(|since| (since, entry)))
        .min_by_key(|(since, _)| *since);
    let Some((since, victim)) = longest_idle else {
        return false;
    };
    tracing::warn!(
        peer = %victim.peer,
        idle = ?since.elapsed(),
        connections_max,
        "closing the connection idle the longest: every serving slot is taken and a new client finished its handshake"
    );
    victim.socket.shutdown_both();
    victim.phase = Phase::Closing;
    true
}

/// Open connections: their threads, and a handle on each socket so shutdown can wake them.
#[derive(Default)]
struct Connections {
    next_id: AtomicU64,
    registry: Registry,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Connections {
    fn active(&self) -> usize {
        self.registry.lock().len()
    }

    /// Decides whether a new connection may start: refused when every serving slot is taken
    /// by a connection with requests in flight (it could not be served anyway); when some
    /// are idle, the one idle the longest makes room once the new one finishes its
    /// handshake (see [`Admission::establish`]), so silent connections evict nobody. Room
    /// in the handshake budget is made by closing the oldest connection still negotiating:
    /// first among the new peer's own when that address already holds
    /// `handshake_connections_per_peer_max` of them (so one address flooding the server
    /// only evicts itself), else among all. Silent, slow or idle clients thus delay nobody
    /// who finishes the handshake promptly.
    fn admit(&self, peer: &str, peer_ip: Option<IpAddr>, config: &ServerConfig) -> bool {
        let mut registry = self.registry.lock();
        let serving = registry
            .values()
            .filter(|entry| entry.phase == Phase::Serving)
            .count();
        let any_idle = || {
            registry
                .values()
                .any(|entry| entry.phase == Phase::Serving && entry.inflight.idle_since().is_some())
        };
        if serving >= config.connections_max && !any_idle() {
            tracing::warn!(
                %peer,
                connections_max = config.connections_max,
                "connection refused: too many connections, none of them idle"
            );
            return false;
        }
        let negotiating = |entry: &&mut Entry| entry.phase == Phase::Handshake;
        let same_peer = registry
            .values()
            .filter(|entry| entry.phase == Phase::Handshake)
            .filter(|entry| peer_ip.is_some() && entry.peer_ip == peer_ip)
            .count();
        let total = registry
            .values()
            .filter(|entry| entry.phase == Phase::Handshake)
            .count();
        let victim = if same_peer >= config.handshake_connections_per_peer_max {
            registry
                .values_mut()
                .filter(negotiating)
                .filter(|entry| entry.peer_ip == peer_ip)
                .min_by_key(|entry| entry.accepted)
        } else if total >= config.handshake_connections_max {
            registry
                .values_mut()
                .filter(negotiating)
                .min_by_key(|entry| entry.accepted)
        } else {
            None
        };
        if let Some(oldest) = victim {
            tracing::warn!(
                peer = %oldest.peer,
                handshake_connections_max = config.handshake_connections_max,
                handshake_connections_per_peer_max = config.handshake_connections_per_peer_max,
                "closing the oldest connection still in the handshake to admit {peer}"
            );
            oldest.socket.shutdown_both();
            oldest.phase = Phase::Closing;
        }
        true
    }

    /// Closes every connection that has been negotiating for longer than `timeout`: the
    /// handshake timeout bounds the whole handshake, not each read, so a client trickling
    /// bytes cannot hold its slot.
    fn expire_handshakes(&self, timeout: Duration) {
        let now = Instant::now();
        for entry in self.registry.lock().values_mut() {
            if entry.phase == Phase::Handshake && now.duration_since(entry.accepted) > timeout {
                tracing::warn!(
                    peer = %entry.peer,
                    ?timeout,
                    "closing a connection that did not finish the handshake in time"
                );
                entry.socket.shutdown_both();
                entry.phase = Phase::Closing;
            }
        }
    }

    fn spawn(
        &self,
        stream: Stream,
        peer: String,
        serve: impl FnOnce(Stream, &Admission) + Send + 'static,
    ) -> io::Result<()> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let inflight = Arc::new(InflightBudget::default());
        self.registry.lock().insert(
            id,
            Entry {
                peer_ip: stream.peer_ip(),
                socket: stream.try_clone()?,
                peer,
                accepted: Instant::now(),
                phase: Phase::Handshake,
                inflight: Arc::clone(&inflight),
            },
        );
        let admission = Admission {
            id,
            registry: Arc::clone(&self.registry),
            inflight,
        };
        let spawned = std::thread::Builder::new()
            .name(format!("nbd-connection-{id}"))
            // The entry leaves the registry when `admission` drops: when serving ends, when
            // it panics, or with the closure if the thread cannot start.
            .spawn(move || serve(stream, &admission));
        let handle = spawned?;
        self.threads.lock().push(handle);
        Ok(())
    }

    fn reap_finished(&self) {
        let mut threads = self.threads.lock();
        let (finished, running): (Vec<_>, Vec<_>) =
            threads.drain(..).partition(|handle| handle.is_finished());
        *threads = running;
        drop(threads);
        for handle in finished {
            let _ = handle.join();
        }
    }

    /// Waits for all connection threads once the shutdown was triggered. For
    /// [`SHUTDOWN_NOTICE`] connections go on reading, so clients are answered that the server
    /// shuts down (the handshake and transmission see the trigger); then negotiating
    /// connections are closed and every other reader is woken by shutting its read side. A
    /// connection whose client stopped reading replies would block its writer forever, so
    /// after [`SHUTDOWN_GRACE`] the remaining sockets are closed in both directions.
    fn drain(&self) {
        let started = Instant::now();
        let mut noticed = false;
        while started.elapsed() < SHUTDOWN_GRACE && self.active() > 0 {
            if !noticed && started.elapsed() >= SHUTDOWN_NOTICE {
                noticed = true;
                for entry in self.registry.lock().values() {
                    match entry.phase {
                        Phase::Handshake => entry.socket.shutdown_both(),
                        Phase::Serving => entry.socket.shutdown_read(),
                        Phase::Closing => {}
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        for entry in self.registry.lock().values() {
            tracing::warn!(
                peer = %entry.peer,
                "closing a connection that did not drain within {SHUTDOWN_GRACE:?}"
            );
            entry.socket.shutdown_both();
        }
        for handle in self.threads.lock().drain(..) {
            let _ = handle.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Goal: a unix socket's path appears only once the socket listens (a script that waits
    /// for the path and then connects is never refused), while a path a live server holds
    /// still refuses the bind at once. Method: bind a path in a fresh directory and check it is
    /// absent while the hidden name holds the socket; listen and connect through the path;
    /// then bind the same path again while the first listens.
    #[test]
    fn a_unix_socket_path_appears_only_once_it_listens() {
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("nbd.sock");
        let address = ListenAddress::Unix(path.clone());
        let listeners = Listeners {
            bound: bind_address(&address).unwrap(),
            inherited: Vec::new(),
        };
        assert!(
            std::fs::symlink_metadata(&path).is_err(),
            "the path exists before the socket listens"
        );
        let hidden = hidden_name(&path).unwrap();
        assert!(hidden.exists(), "the socket is bound under its hidden name");
        let listening = listeners.listen().unwrap();
        assert!(!hidden.exists(), "the hidden name is left behind");
        UnixStream::connect(&path).expect("the path connects once it appears");
        let again = bind_address(&address)
            .err()
            .expect("a live server's path is refused");
        assert!(again.to_string().contains("nbd.sock"), "{again}");
        drop(listening);
        assert!(!path.exists(), "the path is removed with its listener");
    }
}
