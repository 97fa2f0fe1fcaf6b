//! The NBD (Network Block Device) protocol for bufcache, synchronous: std threads and
//! blocking sockets, no async runtime.
//!
//! Two halves share one wire module ([`protocol`]):
//! - the **server** ([`Server`]) serves any number of [`Export`]s over TCP and unix sockets
//!   with the newstyle handshake, structured replies, extended headers (64-bit lengths),
//!   `base:allocation` and `x-bufcache:state` block status, and many requests in flight per
//!   connection, answered out of order by worker threads (docs/protocol.md);
//! - the **client** ([`NbdClient`]) connects to an upstream NBD server and implements
//!   [`bufcache_device::Device`], so the cache engine can sit in front of another NBD server.
//!
//! The crate knows the device layer only, not the cache engine: the engine is served as an
//! export by `bufcache-export`, where the two meet.
//!
//! The crate owns protocol correctness and robustness (validation, errno mapping, bounded
//! memory per connection); it owns no data: durability is the export's `flush`, and the
//! server never answers a FLUSH before that returns.

mod buffers;
pub mod client;
pub mod client_handshake;
pub mod config;
pub mod export;
mod handshake;
#[cfg(any(test, feature = "test-support"))]
pub mod layer_testing;
pub mod protocol;
pub mod reconnect;
pub mod server;
mod shutdown;
mod stream;
pub mod tls;
mod transmission;
pub mod uri;

pub use client::{ClientError, NbdClient};
pub use client_handshake::{ExportInfo, HandshakeFailure};
pub use config::{
    parse_network, AccessRefused, AccessRules, ConfigError, ExportPolicy, ListenAddress,
    ListenAddressError, NetworkError, ServerConfig, DEFAULT_IDLE_TIMEOUT, DEFAULT_STALL_TIMEOUT,
    PAYLOAD_BYTES_PER_SECOND_MIN,
};
pub use export::{
    never_start_read, no_cache_state, read_via_buffer, write_via_buffer, AcknowledgeGate,
    BlockStatusExtent, CacheStateExtent, Export, ExportLayer, HeldRead, MemoryExport, ReadDone,
    ReadSink, StartedRead, WriteSource,
};
pub use ipnet::IpNet;
pub use reconnect::{ReconnectPolicy, ReconnectingClient};
pub use server::{BoundAddress, BoundServer, Listeners, Server, ServerError, ShutdownHandle};
pub use tls::{parse_psk_file, PskEntry, TlsConfig, TlsError, TlsMode};
pub use uri::{ClientTls, NbdAddress, NbdUri, UriError};
