//! Size and configuration parsing: `parse_size`, `CacheConfig::validate` (and the engine a
//! validated configuration builds), `ServerConfig::validate`, listen addresses and NBD URIs.

use std::sync::Arc;
use std::time::Duration;

use bufcache::{
    format_size, parse_size, Cache, CacheConfig, Environment, FrozenClock, MemoryDevice,
    ObjectConfig, PolicyKind,
};
use bufcache_nbd::{Export, ListenAddress, MemoryExport, NbdUri, Server, ServerConfig};

use crate::input::Input;

/// `parse_size` never panics, and whatever `format_size` prints parses back to the same
/// number.
pub fn size(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    match parse_size(&text) {
        Ok(bytes) => round_trip_size(bytes),
        Err(error) => {
            let _ = error.to_string();
        }
    }
    if let Some(first) = data.get(..8) {
        round_trip_size(u64::from_le_bytes(first.try_into().unwrap()));
    }
}

fn round_trip_size(bytes: u64) {
    let formatted = format_size(bytes);
    assert_eq!(
        parse_size(&formatted).ok(),
        Some(bytes),
        "format_size({bytes}) = {formatted:?} does not parse back"
    );
}

/// `CacheConfig::validate` never panics; a configuration it accepts builds a cache that
/// stores and returns data.
pub fn config_cache(data: &[u8]) {
    let mut input = Input::new(data);
    let defaults = CacheConfig::default();
    let config = CacheConfig {
        page_size_bytes: input.size(defaults.page_size_bytes),
        buffer_bytes_max: input.size(defaults.buffer_bytes_max),
        transfer_bytes_max: input.size(defaults.transfer_bytes_max),
        cluster_bytes_max: input.size(defaults.cluster_bytes_max),
        memory_bytes_max: input.size(defaults.memory_bytes_max),
        buffers_max: input.size(defaults.buffers_max),
        readahead_bytes_max: input.size(defaults.readahead_bytes_max),
        readahead_size_initial_bytes: input.size(defaults.readahead_size_initial_bytes),
        readahead_latency_bytes_max: input.size(defaults.readahead_latency_bytes_max),
        streams_per_object_max: input.size(defaults.streams_per_object_max as u64) as usize,
        noreuse_sequential: input.bool(),
        policy: PolicyKind::ALL[usize::from(input.u8()) % PolicyKind::ALL.len()],
        policy_parameters: bufcache::PolicyParameters {
            s3fifo_small_queue_ratio: f64::from(input.u8()) / 128.0,
            s3fifo_ghost_size_ratio: f64::from(input.u8()) / 16.0,
            s3fifo_move_to_main_threshold: input.u8() % 5,
            two_q_ain_size_ratio: f64::from(input.u8()) / 128.0,
            two_q_aout_size_ratio: f64::from(input.u8()) / 16.0,
            clock_bits: input.u8() % 10,
        },
        dirty_age_max: Duration::from_millis(u64::from(input.u16())),
        dirty_background_percent: input.u8(),
        dirty_limit_percent: input.u8(),
        write_behind: input.bool(),
        huge_pages: input.bool(),
        space_wait_max: Duration::from_millis(u64::from(input.u8())),
        shards: input.size(defaults.shards as u64) as usize,
        background_jobs_queued_max: input.size(defaults.background_jobs_queued_max as u64) as usize,
        writeback_inflight_max: input.size(defaults.writeback_inflight_max as u64) as usize,
    };
    let block_size = input.size(4096) as u32;
    let device_bytes = (u64::from(input.u16()) % 512 + 1) * 512;
    let offset = u64::from(input.u32()) % device_bytes;
    let length = (usize::from(input.u16()) % 65536).min((device_bytes - offset) as usize);
    if let Err(error) = config.validate() {
        let _ = error.to_string();
        return;
    }
    // What validate promises: at least one largest buffer fits in memory.
    assert!(config.charge_bytes(config.buffer_bytes_max) <= config.memory_bytes_max);
    // Build the engine only when its tables are small: the policies preallocate for
    // min(buffers_max, memory / page) entries per shard.
    let shard_count = config.shards.next_power_of_two() as u64;
    let entries = config
        .buffers_max
        .min(config.memory_bytes_max / config.page_size_bytes);
    if entries / shard_count > 1 << 16 || shard_count > 256 {
        return;
    }
    let environment = Environment::inline(Arc::new(FrozenClock));
    let cache = Cache::with_environment(config.clone(), environment)
        .unwrap_or_else(|error| panic!("validated config {config:?} refused: {error}"));
    let device = Arc::new(MemoryDevice::new(device_bytes));
    let Ok(object) = cache.open_object(ObjectConfig::new("fuzz", device).block_size(block_size))
    else {
        return;
    };
    let pattern: Vec<u8> = (0..length).map(|index| (index % 251) as u8 + 1).collect();
    object
        .write_at(offset, &pattern, false)
        .unwrap_or_else(|error| panic!("write {length}@{offset} with {config:?}: {error}"));
    let mut back = vec![0u8; length];
    object
        .read_at(offset, &mut back)
        .unwrap_or_else(|error| panic!("read {length}@{offset} with {config:?}: {error}"));
    assert!(back == pattern, "read-back differs with {config:?}");
    object
        .flush()
        .unwrap_or_else(|error| panic!("flush with {config:?}: {error}"));
}

/// `ServerConfig::validate` never panics, and `Server::new` accepts every configuration it
/// validates (with a valid export list).
pub fn config_server(data: &[u8]) {
    let mut input = Input::new(data);
    let listen_count = input.u8() % 3;
    let config = ServerConfig {
        listen: (0..listen_count)
            .map(|index| ListenAddress::Tcp(format!("127.0.0.1:{index}")))
            .collect(),
        request_size_max: match input.u8() % 3 {
            0 => input.u32(),
            1 => 1 << (input.u8() % 32),
            _ => 32 << 20,
        },
        inflight_bytes_max: input.size(64 << 20),
        workers_per_connection_max: input.size(16) as usize,
        connections_max: input.size(64) as usize,
        handshake_timeout: Duration::new(input.u64(), input.u32() % 1_000_000_000),
        ..ServerConfig::default()
    };
    let name = String::from_utf8_lossy(input.rest()).into_owned();
    match config.validate() {
        Ok(()) => {
            let export: Arc<dyn Export> = Arc::new(MemoryExport::new(4096));
            let result = Server::new(config, vec![(name.clone(), export)]);
            if name.len() <= bufcache_nbd::protocol::STRING_BYTES_MAX {
                if let Err(error) = result {
                    panic!("Server::new refused a validated config: {error}");
                }
            }
        }
        Err(error) => {
            let _ = error.to_string();
        }
    }
}

/// Listen addresses and NBD URIs: parsing never panics, and a parsed listen address prints
/// as text that parses back to it.
pub fn nbd_addresses(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    match text.parse::<ListenAddress>() {
        Ok(address) => {
            let printed = address.to_string();
            assert_eq!(
                printed.parse::<ListenAddress>().ok(),
                Some(address),
                "{printed:?} does not parse back"
            );
        }
        Err(error) => {
            let _ = error.to_string();
        }
    }
    match text.parse::<NbdUri>() {
        Ok(uri) => {
            assert_eq!(uri.text, text, "the URI keeps the text it was given");
            let _ = format!("{uri} {:?}", uri.address);
            // What was read, written again, reads back the same.
            let written = NbdUri::new(
                uri.address.clone(),
                uri.export_name.clone(),
                uri.tls.clone(),
            );
            assert_eq!(
                written.to_string().parse::<NbdUri>().as_ref(),
                Ok(&written),
                "{text:?} read and written as {written}"
            );
        }
        Err(error) => {
            let _ = error.to_string();
        }
    }
}
