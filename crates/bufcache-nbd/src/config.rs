//! Server configuration: where to listen and the limits that bound one connection's memory
//! and threads.
//!
//! A [`ServerConfig`] is plain data with documented defaults; [`ServerConfig::validate`]
//! checks every field against its allowed range and names the field in its error, so the
//! command line can pass the message straight to the user. The server refuses to start with
//! an invalid configuration.

use std::fmt;
use std::net::IpAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use ipnet::IpNet;

use crate::protocol::DEFAULT_PORT;

/// Default idle timeout of a connection that finished the handshake: long enough that no
/// client pausing between bursts of work is closed, short enough that connections left
/// behind by clients that vanished without a FIN (a crash, a partition) do not stay for
/// ever. A flood of idle connections is handled by eviction at `connections_max`, not by
/// this timeout.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(3600);

/// Default stall timeout: a few seconds, far above any round trip a working client has
/// (a payload or a reply makes progress within milliseconds on any live network), so only
/// clients that stopped sending or reading reach it.
pub const DEFAULT_STALL_TIMEOUT: Duration = Duration::from_secs(5);

/// The average rate, after the first `stall_timeout`, below which a WRITE payload is taken
/// as a trickle meant to hold the budget: a 32 MiB payload may take 5 s + 128 s.
pub const PAYLOAD_BYTES_PER_SECOND_MIN: u64 = 256 << 10;

/// Why a network (`--allow`/`--deny` value) was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "{0:?} is not an IP network: expected ADDRESS/PREFIX (192.168.0.0/16, fd00::/8) or an address"
)]
pub struct NetworkError(String);

/// Parses a network in CIDR notation, or a single address (a /32 or /128 network).
pub fn parse_network(text: &str) -> Result<IpNet, NetworkError> {
    if let Ok(network) = text.parse::<IpNet>() {
        return Ok(network.trunc());
    }
    text.parse::<IpAddr>()
        .map(IpNet::from)
        .map_err(|_| NetworkError(text.to_string()))
}

/// Who may open one export, and how.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExportPolicy {
    /// TLS identities (PSK identity or client certificate common name) that may open the
    /// export; empty: every client may. A client without a TLS identity may open only
    /// exports with no list.
    pub identities: Vec<String>,
    /// Serve the export read-only, whatever the backend allows.
    pub read_only: bool,
}

impl ExportPolicy {
    pub fn admits(&self, identity: Option<&str>) -> bool {
        self.identities.is_empty()
            || identity.is_some_and(|identity| self.identities.iter().any(|name| name == identity))
    }
}

/// Which TCP peers may connect: checked before any negotiation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AccessRules {
    /// When not empty, only peers inside one of these networks may connect.
    pub allow: Vec<IpNet>,
    /// Peers inside one of these networks may not connect, even when allowed.
    pub deny: Vec<IpNet>,
}

impl AccessRules {
    /// `Err(reason)` when `address` may not connect. IPv4 peers reaching an IPv6 socket
    /// (`::ffff:a.b.c.d`) are judged by their IPv4 address, so IPv4 rules hold for them.
    pub fn check(&self, address: IpAddr) -> Result<(), AccessRefused> {
        let address = address.to_canonical();
        if let Some(network) = self.deny.iter().find(|network| network.contains(&address)) {
            return Err(AccessRefused::Denied(*network));
        }
        if !self.allow.is_empty() && !self.allow.iter().any(|network| network.contains(&address)) {
            return Err(AccessRefused::NotAllowed);
        }
        Ok(())
    }
}

/// Why a peer may not connect ([`AccessRules::check`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AccessRefused {
    #[error("address is inside --deny {0}")]
    Denied(IpNet),
    #[error("address is outside every --allow network")]
    NotAllowed,
    /// The rules could not be checked: fail closed.
    #[error("the peer's address is unknown")]
    UnknownAddress,
}

/// One place the server listens on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ListenAddress {
    /// `host:port` for TCP; port 0 picks a free port (see `BoundServer::local_addrs`).
    Tcp(String),
    /// Path of a unix-domain socket.
    Unix(PathBuf),
}

/// Why a listen address string was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ListenAddressError {
    #[error("listen address {0:?} must start with `tcp:` (tcp:HOST:PORT) or `unix:` (unix:PATH)")]
    UnknownScheme(String),
    #[error("listen address {0:?} has no port: expected tcp:HOST:PORT, e.g. tcp:127.0.0.1:{DEFAULT_PORT}")]
    MissingPort(String),
    #[error("listen address {0:?} has no host: expected tcp:HOST:PORT, e.g. tcp:127.0.0.1:{DEFAULT_PORT}")]
    MissingHost(String),
    #[error("listen address {address:?} has an invalid port {port:?}: expected 0 to 65535")]
    InvalidPort { address: String, port: String },
    #[error("listen address {0:?} has an empty path: expected unix:PATH")]
    EmptyPath(String),
}

impl FromStr for ListenAddress {
    type Err = ListenAddressError;

    /// Parses `tcp:HOST:PORT` (IPv6 hosts in brackets: `tcp:[::1]:10809`) or `unix:PATH`.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if let Some(path) = text.strip_prefix("unix:") {
            if path.is_empty() {
                return Err(ListenAddressError::EmptyPath(text.to_string()));
            }
            return Ok(ListenAddress::Unix(PathBuf::from(path)));
        }
        let Some(host_port) = text.strip_prefix("tcp:") else {
            return Err(ListenAddressError::UnknownScheme(text.to_string()));
        };
        let Some((host, port)) = host_port.rsplit_once(':') else {
            return Err(ListenAddressError::MissingPort(text.to_string()));
        };
        if host.is_empty() || host == "[]" {
            return Err(ListenAddressError::MissingHost(text.to_string()));
        }
        if port.parse::<u16>().is_err() {
            return Err(ListenAddressError::InvalidPort {
                address: text.to_string(),
                port: port.to_string(),
            });
        }
        Ok(ListenAddress::Tcp(host_port.to_string()))
    }
}

impl fmt::Display for ListenAddress {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ListenAddress::Tcp(host_port) => write!(formatter, "tcp:{host_port}"),
            ListenAddress::Unix(path) => write!(formatter, "unix:{}", path.display()),
        }
    }
}

/// Limits and addresses of one server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerConfig {
    /// Where to listen. Default: `tcp:127.0.0.1:10809`.
    pub listen: Vec<ListenAddress>,
    /// Largest READ or WRITE a client may send, in bytes; advertised as the maximum block
    /// size. Default 32 MiB; allowed 4 KiB to 1 GiB.
    pub request_size_max: u32,
    /// Bytes of requests and replies all connections together may have in flight: one
    /// memory budget for the whole server. A connection whose next request does not fit
    /// waits (it stops reading its socket, so the client is slowed by TCP back-pressure);
    /// nothing is refused. Default 256 MiB (`bufcache serve` ties it to the cache size); at
    /// least `request_size_max`.
    pub inflight_bytes_max: u64,
    /// Bytes one connection may have in flight before it stops reading new requests, so a
    /// single client cannot take the whole server budget. Default 64 MiB; at least
    /// `request_size_max`.
    pub connection_inflight_bytes_max: u64,
    /// Worker threads one connection may run (started on demand). Default 16; 1 to 1024.
    pub workers_per_connection_max: usize,
    /// Connections that finished the handshake the server serves at once; further clients
    /// are closed at once. Connections still in the handshake do not count here (see
    /// `handshake_connections_max`), so they can never keep a client out. Default 1024;
    /// 1 to 65536.
    pub connections_max: usize,
    /// Connections still in the handshake the server holds at once. When a new one arrives
    /// over this budget the oldest one still negotiating is closed: a flood of silent
    /// connections delays nobody who completes the handshake promptly. Default 64;
    /// 1 to 65536.
    pub handshake_connections_max: usize,
    /// Connections still in the handshake one TCP address holds at once. Over it, that
    /// address's own oldest negotiating connection is closed, so a flood from one address
    /// never evicts anyone else's. Default 16; 1 to 65536.
    pub handshake_connections_per_peer_max: usize,
    /// How long a client may take to finish the whole handshake, from accept to the start of
    /// transmission. Default 10 s; 1 ms to 1 hour.
    pub handshake_timeout: Duration,
    /// A connection with no request in flight and none arriving for this long is closed.
    /// Default 1 hour ([`DEFAULT_IDLE_TIMEOUT`]); `None` keeps idle clients forever; 1 ms to
    /// 1 week when set.
    pub idle_timeout: Option<Duration>,
    /// How long a connection may hold a share of the in-flight budget without progress: a
    /// WRITE payload (or the rest of a request header) that does not arrive, or a reply the
    /// client does not read, for this long closes the connection and releases its share.
    /// A payload must also arrive at [`PAYLOAD_BYTES_PER_SECOND_MIN`] on average after the
    /// first `stall_timeout`. Default 5 s ([`DEFAULT_STALL_TIMEOUT`]); 1 ms to 1 hour.
    pub stall_timeout: Duration,
    /// Which TCP peers may connect. Default: everyone. Unix-socket peers are not judged
    /// (the socket file's permissions decide who reaches it).
    pub access: AccessRules,
    /// TLS: off by default (see [`crate::tls`]).
    pub tls: crate::tls::TlsConfig,
    /// Per-export policies by export name; exports not named here are open to every client
    /// and writable as their backend allows.
    pub export_policies: Vec<(String, ExportPolicy)>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: vec![ListenAddress::Tcp(format!("127.0.0.1:{DEFAULT_PORT}"))],
            request_size_max: 32 << 20,
            inflight_bytes_max: 256 << 20,
            connection_inflight_bytes_max: 64 << 20,
            workers_per_connection_max: 16,
            connections_max: 1024,
            handshake_connections_max: 64,
            handshake_connections_per_peer_max: 16,
            handshake_timeout: Duration::from_secs(10),
            idle_timeout: Some(DEFAULT_IDLE_TIMEOUT),
            stall_timeout: DEFAULT_STALL_TIMEOUT,
            access: AccessRules::default(),
            tls: crate::tls::TlsConfig::default(),
            export_policies: Vec::new(),
        }
    }
}

/// A configuration field outside its allowed range.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("listen: at least one listen address is required")]
    NoListenAddress,
    #[error("request_size_max: {value} bytes is outside the allowed range 4096 to 1073741824")]
    RequestSizeMax { value: u32 },
    #[error(
        "inflight_bytes_max: {value} bytes is below request_size_max ({request_size_max} bytes)"
    )]
    InflightBytesMax { value: u64, request_size_max: u32 },
    #[error(
        "connection_inflight_bytes_max: {value} bytes is below request_size_max ({request_size_max} bytes)"
    )]
    ConnectionInflightBytesMax { value: u64, request_size_max: u32 },
    #[error("workers_per_connection_max: {value} is outside the allowed range 1 to 1024")]
    WorkersPerConnectionMax { value: usize },
    #[error("connections_max: {value} is outside the allowed range 1 to 65536")]
    ConnectionsMax { value: usize },
    #[error("handshake_connections_max: {value} is outside the allowed range 1 to 65536")]
    HandshakeConnectionsMax { value: usize },
    #[error("handshake_connections_per_peer_max: {value} is outside the allowed range 1 to 65536")]
    HandshakeConnectionsPerPeerMax { value: usize },
    #[error("handshake_timeout: {value:?} is outside the allowed range 1 ms to 1 hour")]
    HandshakeTimeout { value: Duration },
    #[error("idle_timeout: {value:?} is outside the allowed range 1 ms to 1 week")]
    IdleTimeout { value: Duration },
    #[error("stall_timeout: {value:?} is outside the allowed range 1 ms to 1 hour")]
    StallTimeout { value: Duration },
}

impl ServerConfig {
    /// Checks every field; the error names the first field out of range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.listen.is_empty() {
            return Err(ConfigError::NoListenAddress);
        }
        if !(4096..=1 << 30).contains(&self.request_size_max) {
            return Err(ConfigError::RequestSizeMax {
                value: self.request_size_max,
            });
        }
        if self.inflight_bytes_max < u64::from(self.request_size_max) {
            return Err(ConfigError::InflightBytesMax {
                value: self.inflight_bytes_max,
                request_size_max: self.request_size_max,
            });
        }
        if self.connection_inflight_bytes_max < u64::from(self.request_size_max) {
            return Err(ConfigError::ConnectionInflightBytesMax {
                value: self.connection_inflight_bytes_max,
                request_size_max: self.request_size_max,
            });
        }
        if !(1..=1024).contains(&self.workers_per_connection_max) {
            return Err(ConfigError::WorkersPerConnectionMax {
                value: self.workers_per_connection_max,
            });
        }
        if !(1..=65536).contains(&self.connections_max) {
            return Err(ConfigError::ConnectionsMax {
                value: self.connections_max,
            });
        }
        if !(1..=65536).contains(&self.handshake_connections_max) {
            return Err(ConfigError::HandshakeConnectionsMax {
                value: self.handshake_connections_max,
            });
        }
        if !(1..=65536).contains(&self.handshake_connections_per_peer_max) {
            return Err(ConfigError::HandshakeConnectionsPerPeerMax {
                value: self.handshake_connections_per_peer_max,
            });
        }
        let timeout_range = Duration::from_millis(1)..=Duration::from_secs(3600);
        if !timeout_range.contains(&self.handshake_timeout) {
            return Err(ConfigError::HandshakeTimeout {
                value: self.handshake_timeout,
            });
        }
        if !timeout_range.contains(&self.stall_timeout) {
            return Err(ConfigError::StallTimeout {
                value: self.stall_timeout,
            });
        }
        if let Some(idle_timeout) = self.idle_timeout {
            let idle_range = Duration::from_millis(1)..=Duration::from_secs(7 * 86_400);
            if !idle_range.contains(&idle_timeout) {
                return Err(ConfigError::IdleTimeout {
                    value: idle_timeout,
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_addresses_parse() {
        assert_eq!(
            "tcp:127.0.0.1:10809".parse(),
            Ok(ListenAddress::Tcp("127.0.0.1:10809".into()))
        );
        assert_eq!(
            "tcp:[::1]:0".parse(),
            Ok(ListenAddress::Tcp("[::1]:0".into()))
        );
        assert_eq!(
            "unix:/tmp/nbd.sock".parse(),
            Ok(ListenAddress::Unix("/tmp/nbd.sock".into()))
        );
    }

    #[test]
    fn bad_listen_addresses_say_why() {
        let cases = [
            "127.0.0.1:10809",
            "tcp:127.0.0.1",
            "tcp::10809",
            "tcp:localhost:99999",
            "unix:",
        ];
        for text in cases {
            let error = text.parse::<ListenAddress>().unwrap_err();
            assert!(error.to_string().contains(text), "{error}");
        }
    }

    /// Goal: deny wins over allow, an empty allow list allows everyone, IPv4-mapped IPv6
    /// peers meet the IPv4 rules, and bad networks are refused with the text in the message.
    #[test]
    fn access_rules_deny_first_then_allow() {
        let network = |text| parse_network(text).unwrap();
        let rules = AccessRules {
            allow: vec![network("10.0.0.0/8"), network("::1")],
            deny: vec![network("10.9.0.0/16")],
        };
        let address = |text: &str| text.parse::<IpAddr>().unwrap();
        assert_eq!(rules.check(address("10.1.2.3")), Ok(()));
        assert_eq!(rules.check(address("::ffff:10.1.2.3")), Ok(()));
        assert_eq!(rules.check(address("::1")), Ok(()));
        assert!(rules
            .check(address("10.9.1.1"))
            .unwrap_err()
            .to_string()
            .contains("10.9.0.0/16"));
        assert!(rules
            .check(address("192.168.1.1"))
            .unwrap_err()
            .to_string()
            .contains("--allow"));
        assert_eq!(AccessRules::default().check(address("192.168.1.1")), Ok(()));
        assert_eq!(network("10.1.2.3/8").to_string(), "10.0.0.0/8");
        for bad in ["10.0.0.0/33", "10.0.0", "example.com", ""] {
            assert!(parse_network(bad).unwrap_err().to_string().contains(bad));
        }
    }

    #[test]
    fn defaults_are_valid_and_bad_fields_are_named() {
        assert_eq!(ServerConfig::default().validate(), Ok(()));
        let config = ServerConfig {
            workers_per_connection_max: 0,
            ..ServerConfig::default()
        };
        let message = config.validate().unwrap_err().to_string();
        assert!(
            message.starts_with("workers_per_connection_max"),
            "{message}"
        );
        let config = ServerConfig {
            inflight_bytes_max: 1,
            ..ServerConfig::default()
        };
        let message = config.validate().unwrap_err().to_string();
        assert!(message.starts_with("inflight_bytes_max"), "{message}");
        let config = ServerConfig {
            handshake_connections_max: 0,
            ..ServerConfig::default()
        };
        let message = config.validate().unwrap_err().to_string();
        assert!(
            message.starts_with("handshake_connections_max"),
            "{message}"
        );
        let config = ServerConfig {
            idle_timeout: Some(Duration::ZERO),
            ..ServerConfig::default()
        };
        let message = config.validate().unwrap_err().to_string();
        assert!(message.starts_with("idle_timeout"), "{message}");
        let config = ServerConfig {
            stall_timeout: Duration::ZERO,
            ..ServerConfig::default()
        };
        let message = config.validate().unwrap_err().to_string();
        assert!(message.starts_with("stall_timeout"), "{message}");
    }
}
