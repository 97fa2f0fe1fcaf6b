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

use bufcache_nbd::{BlockStatusExtent, Export, ExportLayer};

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

// Only what metering adds: every other method forwards to the inner export.
impl ExportLayer for MeteredExport {
    fn inner(&self) -> &Arc<dyn Export> {
        &self.inner
    }

    /// A connection's view: counted open until it is dropped.
    fn over(&self, inner: Arc<dyn Export>) -> Arc<dyn Export> {
        self.meters.connections_open.fetch_add(1, Relaxed);
        self.meters.connections_total.fetch_add(1, Relaxed);
        Arc::new(MeteredExport {
            inner,
            meters: Arc::clone(&self.meters),
            _connection: Some(ConnectionGuard(Arc::clone(&self.meters))),
        })
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

    fn cache(&self, offset: u64, length: u64) -> std::io::Result<()> {
        self.timed(CACHE, length, || self.inner.cache(offset, length))
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

    /// Always a view of its own (the inner export's, or the inner export shared), so that
    /// every connection is counted.
    fn open_connection(&self) -> Option<Arc<dyn Export>> {
        let inner = self
            .inner
            .open_connection()
            .unwrap_or_else(|| Arc::clone(&self.inner));
        Some(self.over(inner))
    }

    fn block_status(&self, offset: u64, length: u64) -> std::io::Result<Vec<BlockStatusExtent>> {
        self.timed(BLOCK_STATUS, length, || {
            self.inner.block_status(offset, length)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bufcache_nbd::layer_testing::{advertised, Distinctive};

    #[test]
    fn the_metering_and_observing_layers_keep_every_capability_of_the_export_they_wrap() {
        // Goal: the two layers serve wraps every export in (request meters, and the trace /
        // what-if observers) add counting and observing and drop nothing: every flag and
        // answer the inner export advertises (size, read-only, fast zero, cache state, the
        // lease gate, per-connection views, ...) is the layered export's too. Method: both
        // layers, alone and stacked as serve stacks them, over an export whose every answer
        // differs from `Export`'s defaults, compared method by method; the meters count the
        // reads made.
        let inner = Distinctive::shared();
        let expected = advertised(inner.as_ref());
        assert!(expected.contains("read_only true"), "{expected}");
        assert!(expected.contains("can_fast_zero true"), "{expected}");
        assert!(expected.contains("has_cache_state true"), "{expected}");
        assert!(
            expected.contains("connection Some(\"distinctive, connection true\")"),
            "{expected}"
        );
        let directory = tempfile::tempdir().unwrap();
        let observers = crate::observe::Observers {
            whatif: None,
            trace: Some(Arc::new(
                crate::trace_capture::TraceRecorder::create(
                    &directory.path().join("trace.csv"),
                    1 << 20,
                )
                .unwrap(),
            )),
        };
        let meters = Arc::new(RequestMeters::default());
        let metered = MeteredExport::wrap(Arc::clone(&inner), Arc::clone(&meters));
        let observed = crate::observe::wrap(&observers, 0, Arc::clone(&inner));
        let stacked = MeteredExport::wrap(
            crate::observe::wrap(&observers, 0, Arc::clone(&inner)),
            Arc::new(RequestMeters::default()),
        );
        assert!(!Arc::ptr_eq(&observed, &inner), "observing is on");
        for (name, layered) in [
            ("metered", &metered),
            ("observed", &observed),
            ("stacked", &stacked),
        ] {
            assert_eq!(advertised(layered.as_ref()), expected, "{name}");
            let view = layered.open_connection().expect("a view per connection");
            assert_eq!(
                view.description(),
                "distinctive, connection true",
                "{name}: a connection's view wraps the inner export's view"
            );
        }
        assert_eq!(meters.commands[READ].requests.load(Relaxed), 3);
        assert_eq!(meters.connections_total.load(Relaxed), 2);
    }

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
