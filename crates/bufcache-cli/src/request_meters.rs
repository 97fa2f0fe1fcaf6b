//! What clients ask of each export, for the person on call: connections open, and per NBD
//! command the requests, bytes, errors and a latency histogram.
//!
//! [`MeteredExport`] wraps an export as the server sees it. The NBD server asks each export for
//! a per-connection view when a client enters transmission and drops it when the connection
//! ends, so a guard held by that view counts connections open without any hook in the server.
//! Latency is measured around the export call: from the request's dispatch to its completion,
//! including streaming its payload to or from the socket, excluding any wait before dispatch.
//! Every counter is an atomic; a scrape only reads them.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;

use bufcache_nbd::{BlockStatusExtent, CacheStateExtent, Export};

/// The NBD commands counted, in the order they are reported.
pub const COMMANDS: [&str; 7] = [
    "read",
    "write",
    "flush",
    "trim",
    "write_zeroes",
    "cache",
    "block_status",
];
const READ: usize = 0;
const WRITE: usize = 1;
const FLUSH: usize = 2;
const TRIM: usize = 3;
const WRITE_ZEROES: usize = 4;
const CACHE: usize = 5;
const BLOCK_STATUS: usize = 6;

/// Upper bounds of the latency histogram's buckets, in seconds (Prometheus `le`); a last,
/// implicit bucket is `+Inf`.
pub const LATENCY_BUCKETS_SECONDS: [f64; 16] = [
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 10.0,
];

/// One command's counters.
#[derive(Default)]
pub struct CommandMeter {
    pub requests: AtomicU64,
    pub bytes: AtomicU64,
    pub errors: AtomicU64,
    /// Requests by latency, bucket `i` counting those of at most `LATENCY_BUCKETS_SECONDS[i]`
    /// (not cumulative; the exposition accumulates), the last counting the rest.
    pub latency_buckets: [AtomicU64; LATENCY_BUCKETS_SECONDS.len() + 1],
    pub latency_ns_sum: AtomicU64,
}

impl CommandMeter {
    fn record(&self, bytes: u64, started: Instant, failed: bool) {
        let elapsed = started.elapsed();
        self.requests.fetch_add(1, Relaxed);
        if failed {
            self.errors.fetch_add(1, Relaxed);
        } else {
            self.bytes.fetch_add(bytes, Relaxed);
        }
        let seconds = elapsed.as_secs_f64();
        let bucket = LATENCY_BUCKETS_SECONDS
            .iter()
            .position(|limit| seconds <= *limit)
            .unwrap_or(LATENCY_BUCKETS_SECONDS.len());
        self.latency_buckets[bucket].fetch_add(1, Relaxed);
        self.latency_ns_sum.fetch_add(
            u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX),
            Relaxed,
        );
    }
}

/// The counters of one export.
#[derive(Default)]
pub struct RequestMeters {
    pub connections_open: AtomicU64,
    pub connections_total: AtomicU64,
    pub commands: [CommandMeter; COMMANDS.len()],
}

/// Held by a connection's view of the export: counts the connection open until dropped.
struct ConnectionGuard(Arc<RequestMeters>);

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        self.0.connections_open.fetch_sub(1, Relaxed);
    }
}

/// An export whose requests are counted in `meters`.
pub struct MeteredExport {
    inner: Arc<dyn Export>,
    meters: Arc<RequestMeters>,
    _connection: Option<ConnectionGuard>,
}

impl MeteredExport {
    /// Wraps `inner`, counting into `meters`.
    pub fn wrap(inner: Arc<dyn Export>, meters: Arc<RequestMeters>) -> Arc<dyn Export> {
        Arc::new(MeteredExport {
            inner,
            meters,
            _connection: None,
        })
    }

    fn timed<T>(
        &self,
        command: usize,
        bytes: u64,
        call: impl FnOnce() -> std::io::Result<T>,
    ) -> std::io::Result<T> {
        let started = Instant::now();
        let result = call();
        self.meters.commands[command].record(bytes, started, result.is_err());
        result
    }
}

impl Export for MeteredExport {
    fn size(&self) -> u64 {
        self.inner.size()
    }

    fn read_only(&self) -> bool {
        self.inner.read_only()
    }

    fn description(&self) -> String {
        self.inner.description()
    }

    fn preferred_block_size(&self) -> u32 {
        self.inner.preferred_block_size()
    }

    fn read(&self, offset: u64, buffer: &mut [u8]) -> std::io::Result<()> {
        let length = buffer.len() as u64;
        self.timed(READ, length, || self.inner.read(offset, buffer))
    }

    fn read_with(
        &self,
        offset: u64,
        buffer: &mut [u8],
        send: &mut bufcache_nbd::ReadSink<'_>,
    ) -> std::io::Result<()> {
        let length = buffer.len() as u64;
        self.timed(READ, length, || self.inner.read_with(offset, buffer, send))
    }

    fn write(&self, offset: u64, data: &[u8], fua: bool) -> std::io::Result<()> {
        self.timed(WRITE, data.len() as u64, || {
            self.inner.write(offset, data, fua)
        })
    }

    fn write_from(
        &self,
        offset: u64,
        length: u64,
        fua: bool,
        source: &mut bufcache_nbd::export::WriteSource<'_>,
    ) -> std::io::Result<()> {
        self.timed(WRITE, length, || {
            self.inner.write_from(offset, length, fua, source)
        })
    }

    fn flush(&self) -> std::io::Result<()> {
        self.timed(FLUSH, 0, || self.inner.flush())
    }

    fn trim(&self, offset: u64, length: u64, fua: bool) -> std::io::Result<()> {
        self.timed(TRIM, length, || self.inner.trim(offset, length, fua))
    }

    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        may_trim: bool,
        fast_only: bool,
        fua: bool,
    ) -> std::io::Result<()> {
        self.timed(WRITE_ZEROES, length, || {
            self.inner
                .write_zeroes(offset, length, may_trim, fast_only, fua)
        })
    }

    fn can_fast_zero(&self) -> bool {
        self.inner.can_fast_zero()
    }

    fn cache(&self, offset: u64, length: u64) -> std::io::Result<()> {
        self.timed(CACHE, length, || self.inner.cache(offset, length))
    }

    fn cache_request_bytes_max(&self) -> u64 {
        self.inner.cache_request_bytes_max()
    }

    fn read_is_quick(&self, offset: u64, length: u64) -> bool {
        self.inner.read_is_quick(offset, length)
    }

    fn write_is_quick(&self, offset: u64, length: u64, fua: bool) -> bool {
        self.inner.write_is_quick(offset, length, fua)
    }

    /// Counted when it completes: `done` is wrapped to record the outcome and the time since
    /// the start. A read not started is served (and counted) by `read_with`.
    fn start_read(
        &self,
        offset: u64,
        length: u32,
        done: bufcache_nbd::ReadDone,
    ) -> Result<(), bufcache_nbd::ReadDone> {
        let meters = Arc::clone(&self.meters);
        let started = Instant::now();
        // The wrapper is handed back unchanged in spirit when the read does not start: the
        // caller then serves it with `read_with`, which counts it, and the wrapper (never
        // called) counts nothing. A started read that ends in an error (the device failed,
        // or a read waiting for another's fill was given back) is served again the same way,
        // where it is counted (and its error reported), so it counts nothing here either.
        let wrapped: bufcache_nbd::ReadDone = Box::new(move |result| {
            if result.is_ok() {
                meters.commands[READ].record(u64::from(length), started, false);
            }
            done(result)
        });
        self.inner.start_read(offset, length, wrapped)
    }

    fn open_connection(&self) -> Option<Arc<dyn Export>> {
        let inner = self
            .inner
            .open_connection()
            .unwrap_or_else(|| Arc::clone(&self.inner));
        self.meters.connections_open.fetch_add(1, Relaxed);
        self.meters.connections_total.fetch_add(1, Relaxed);
        Some(Arc::new(MeteredExport {
            inner,
            meters: Arc::clone(&self.meters),
            _connection: Some(ConnectionGuard(Arc::clone(&self.meters))),
        }))
    }

    fn block_status(&self, offset: u64, length: u64) -> std::io::Result<Vec<BlockStatusExtent>> {
        self.timed(BLOCK_STATUS, length, || {
            self.inner.block_status(offset, length)
        })
    }

    fn has_cache_state(&self) -> bool {
        self.inner.has_cache_state()
    }

    fn cache_state(&self, offset: u64, length: u64) -> std::io::Result<Vec<CacheStateExtent>> {
        self.inner.cache_state(offset, length)
    }

    fn known_zeroes(&self, offset: u64, length: u64) -> Vec<(u64, u64)> {
        self.inner.known_zeroes(offset, length)
    }

    fn may_acknowledge_changes(&self) -> std::io::Result<()> {
        self.inner.may_acknowledge_changes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_bytes_latency_and_connections_are_counted_per_command() {
        // Goal: each command lands in its own counters, with its bytes, one latency sample
        // and errors apart; a connection counts open exactly while its view lives. Method: a
        // memory export wrapped, driven directly.
        let meters = Arc::new(RequestMeters::default());
        let shared = MeteredExport::wrap(
            Arc::new(bufcache_nbd::MemoryExport::new(1 << 20)),
            Arc::clone(&meters),
        );
        let connection = shared.open_connection().unwrap();
        assert_eq!(meters.connections_open.load(Relaxed), 1);
        connection.write(0, &[1; 8192], false).unwrap();
        let mut buffer = [0u8; 4096];
        connection.read(4096, &mut buffer).unwrap();
        connection.flush().unwrap();
        assert!(connection.read(1 << 20, &mut buffer).is_err());
        let write = &meters.commands[WRITE];
        assert_eq!(write.requests.load(Relaxed), 1);
        assert_eq!(write.bytes.load(Relaxed), 8192);
        let read = &meters.commands[READ];
        assert_eq!(read.requests.load(Relaxed), 2);
        assert_eq!(read.errors.load(Relaxed), 1);
        assert_eq!(read.bytes.load(Relaxed), 4096);
        assert_eq!(meters.commands[FLUSH].requests.load(Relaxed), 1);
        let samples: u64 = read
            .latency_buckets
            .iter()
            .map(|bucket| bucket.load(Relaxed))
            .sum();
        assert_eq!(samples, 2);
        drop(connection);
        assert_eq!(meters.connections_open.load(Relaxed), 0);
        assert_eq!(meters.connections_total.load(Relaxed), 1);
    }
}
