//! `bufcache serve` flags that bound what clients can hold: connections (serving and still
//! negotiating), how long a handshake, an idle connection or a stalled request may last, and the one in-flight
//! byte budget all connections share; and which TCP peers may connect at all. Values are checked by clap, so a bad one is refused at
//! start-up with the flag's name and exit status 2.

use std::time::Duration;

use bufcache::parse_size;
use bufcache_nbd::{parse_network, IpNet, ServerConfig};
use clap::Args;

/// Default of `--connections-max`.
pub const DEFAULT_CONNECTIONS_MAX: u32 = 1024;
/// Default of `--handshake-connections-max`.
pub const DEFAULT_HANDSHAKE_CONNECTIONS_MAX: u32 = 64;
/// Default of `--handshake-connections-per-peer-max`.
pub const DEFAULT_HANDSHAKE_CONNECTIONS_PER_PEER_MAX: u32 = 16;
/// Default of `--handshake-timeout`, in seconds.
pub const DEFAULT_HANDSHAKE_TIMEOUT_SECONDS: f64 = 10.0;
/// Default of `--idle-timeout`, in seconds (see `bufcache_nbd::DEFAULT_IDLE_TIMEOUT`).
pub const DEFAULT_IDLE_TIMEOUT_SECONDS: f64 = 3600.0;
/// Default of `--stall-timeout`, in seconds (see `bufcache_nbd::DEFAULT_STALL_TIMEOUT`).
pub const DEFAULT_STALL_TIMEOUT_SECONDS: f64 = 5.0;
const _: () =
    assert!(DEFAULT_IDLE_TIMEOUT_SECONDS as u64 == bufcache_nbd::DEFAULT_IDLE_TIMEOUT.as_secs());
const _: () =
    assert!(DEFAULT_STALL_TIMEOUT_SECONDS as u64 == bufcache_nbd::DEFAULT_STALL_TIMEOUT.as_secs());

/// Connection and memory limits of `bufcache serve`.
#[derive(Args, Debug)]
pub struct LimitArgs {
    /// Clients served at once (connections that finished the handshake); further clients are
    /// closed at once. Connections still negotiating do not count here. (qemu-nbd's
    /// -e/--shared N.)
    #[arg(long, visible_alias = "shared", value_name = "N", default_value_t = DEFAULT_CONNECTIONS_MAX,
          value_parser = clap::value_parser!(u32).range(1..=65536))]
    connections_max: u32,
    /// Connections still in the handshake held at once. Over it, the oldest one still
    /// negotiating is closed, so silent clients cannot keep anyone out.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_HANDSHAKE_CONNECTIONS_MAX,
          value_parser = clap::value_parser!(u32).range(1..=65536))]
    handshake_connections_max: u32,
    /// Connections still in the handshake one TCP address holds at once. Over it, that
    /// address's own oldest one is closed, so a flood from one address evicts only itself.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_HANDSHAKE_CONNECTIONS_PER_PEER_MAX,
          value_parser = clap::value_parser!(u32).range(1..=65536))]
    handshake_connections_per_peer_max: u32,
    /// Seconds a client may take for the whole handshake before it is disconnected.
    #[arg(long, value_name = "SECONDS", default_value_t = DEFAULT_HANDSHAKE_TIMEOUT_SECONDS,
          value_parser = |text: &str| seconds(text, 0.001, 3600.0))]
    handshake_timeout: f64,
    /// Disconnect a client with no request in flight and none arriving for SECONDS; 0:
    /// never. The default hour frees connections whose client vanished without closing
    /// them; a client idle for longer that must keep its connection (a kernel nbd device
    /// mounted but unused) needs 0. When --connections-max is reached, the client idle the
    /// longest is disconnected to admit a new one whatever this says.
    #[arg(long, value_name = "SECONDS", default_value_t = DEFAULT_IDLE_TIMEOUT_SECONDS,
          value_parser = |text: &str| seconds_or_never(text, 0.001, 604_800.0))]
    idle_timeout: f64,
    /// Disconnect a client that holds part of the in-flight budget without progress for
    /// SECONDS: a WRITE payload or request header that stops arriving, or a reply it does
    /// not read. A payload must also average 256 KiB/s after the first SECONDS.
    #[arg(long, value_name = "SECONDS", default_value_t = DEFAULT_STALL_TIMEOUT_SECONDS,
          value_parser = |text: &str| seconds(text, 0.001, 3600.0))]
    stall_timeout: f64,
    /// Bytes of requests all connections together may have in flight (payloads and reply
    /// buffers). A request that does not fit waits in its socket until replies drain:
    /// clients are slowed, never refused. Default: the cache size, at least twice
    /// --request-size-max.
    #[arg(long, value_name = "SIZE", value_parser = |text: &str| parse_size(text).map_err(|e| e.to_string()))]
    inflight_bytes_max: Option<u64>,
    /// Only TCP clients inside this network may connect (CIDR like 192.168.0.0/16 or
    /// fd00::/8, or one address); repeatable. Default: every address. Checked before any
    /// negotiation; unix-socket clients are not judged (the socket's permissions are).
    #[arg(long = "allow", value_name = "CIDR", value_parser = |text: &str| parse_network(text).map_err(|e| e.to_string()))]
    allow: Vec<IpNet>,
    /// TCP clients inside this network may not connect, even when --allow covers them;
    /// repeatable.
    #[arg(long = "deny", value_name = "CIDR", value_parser = |text: &str| parse_network(text).map_err(|e| e.to_string()))]
    deny: Vec<IpNet>,
}

/// Parses a number of seconds within `minimum..=maximum`.
fn seconds(text: &str, minimum: f64, maximum: f64) -> Result<f64, String> {
    let value: f64 = text
        .parse()
        .map_err(|_| format!("{text:?} is not a number of seconds"))?;
    if !(minimum..=maximum).contains(&value) {
        return Err(format!(
            "{value} seconds is outside the allowed range {minimum} to {maximum}"
        ));
    }
    Ok(value)
}

/// Like [`seconds`], but 0 is accepted too (meaning never).
fn seconds_or_never(text: &str, minimum: f64, maximum: f64) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(0.0) => Ok(0.0),
        _ => seconds(text, minimum, maximum),
    }
}

impl LimitArgs {
    /// Applies the limits to `config`; `cache_bytes` is the cache size, which the in-flight
    /// budget defaults to, so memory stays within about twice the cache size however many
    /// clients connect. Call after `request_size_max` is set. A budget below one request is
    /// refused like any bad flag value: the message names the flag, exit status 2.
    pub fn apply(&self, config: &mut ServerConfig, cache_bytes: u64) {
        config.connections_max = self.connections_max as usize;
        config.handshake_connections_max = self.handshake_connections_max as usize;
        config.handshake_connections_per_peer_max =
            self.handshake_connections_per_peer_max as usize;
        config.handshake_timeout = Duration::from_secs_f64(self.handshake_timeout);
        config.idle_timeout = Some(self.idle_timeout)
            .filter(|&seconds| seconds > 0.0)
            .map(Duration::from_secs_f64);
        config.stall_timeout = Duration::from_secs_f64(self.stall_timeout);
        config.access.allow = self.allow.clone();
        config.access.deny = self.deny.clone();
        let request_size_max = u64::from(config.request_size_max);
        config.inflight_bytes_max = match self.inflight_bytes_max {
            Some(bytes) if bytes < request_size_max => clap::Error::raw(
                clap::error::ErrorKind::ValueValidation,
                format!(
                    "--inflight-bytes-max {bytes} is below --request-size-max \
                     ({request_size_max} bytes): one request must fit\n"
                ),
            )
            .exit(),
            Some(bytes) => bytes,
            None => cache_bytes.max(2 * request_size_max),
        };
        config.connection_inflight_bytes_max = config
            .connection_inflight_bytes_max
            .min(config.inflight_bytes_max);
    }
}
