//! Engine statistics: counted where each event happens, read as one [`CacheStats`] snapshot.
//!
//! Hits and misses are counted inside the shard, under the shard lock the lookup holds anyway,
//! so the hit path adds no shared atomic. Everything else is a relaxed atomic counter: events
//! are rarer (device requests, evictions) and exactness per counter, not cross-counter
//! atomicity, is what the snapshot promises.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use bufcache_device::counting::{DirectionStats, HISTOGRAM_BUCKETS};

/// Upper bounds, in seconds, of the buckets of [`CacheStats::buffer_wait_buckets`]; the
/// last bucket (one more than these) counts longer waits.
pub const BUFFER_WAIT_BUCKETS_SECONDS: [f64; 10] = [
    0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 10.0,
];

/// Buckets of the buffer-wait histogram, the overflow bucket included.
pub const BUFFER_WAIT_BUCKET_COUNT: usize = BUFFER_WAIT_BUCKETS_SECONDS.len() + 1;

/// Why dirty data was written back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WritebackCause {
    /// Older than `dirty_age_max`.
    Age,
    /// Dirty data above the background threshold, or a writer throttled above the limit.
    Threshold,
    /// flush, fsync, sync, a FUA write, bwrite or bawrite.
    Flush,
    /// Room was needed for new buffers.
    Eviction,
    /// A sequential writer completed a whole cluster.
    WriteBehind,
}

impl WritebackCause {
    /// Every cause, in snapshot order.
    pub const ALL: [WritebackCause; 5] = [
        WritebackCause::Age,
        WritebackCause::Threshold,
        WritebackCause::Flush,
        WritebackCause::Eviction,
        WritebackCause::WriteBehind,
    ];

    /// Lower-case name for metrics and reports.
    pub fn name(self) -> &'static str {
        match self {
            WritebackCause::Age => "age",
            WritebackCause::Threshold => "threshold",
            WritebackCause::Flush => "flush",
            WritebackCause::Eviction => "eviction",
            WritebackCause::WriteBehind => "write_behind",
        }
    }
}

#[derive(Default)]
pub(crate) struct Direction {
    requests: AtomicU64,
    bytes: AtomicU64,
    errors: AtomicU64,
    histogram: [AtomicU64; HISTOGRAM_BUCKETS],
}

impl Direction {
    pub fn record(&self, length_bytes: u64, ok: bool) {
        if !ok {
            self.errors.fetch_add(1, Relaxed);
            return;
        }
        self.requests.fetch_add(1, Relaxed);
        self.bytes.fetch_add(length_bytes, Relaxed);
        let bucket = (0..HISTOGRAM_BUCKETS)
            .find(|&index| {
                length_bytes <= bufcache_device::counting::histogram_bucket_limit_bytes(index)
            })
            .unwrap_or(HISTOGRAM_BUCKETS - 1);
        self.histogram[bucket].fetch_add(1, Relaxed);
    }

    fn snapshot(&self) -> DirectionStats {
        DirectionStats {
            requests: self.requests.load(Relaxed),
            bytes: self.bytes.load(Relaxed),
            errors: self.errors.load(Relaxed),
            histogram: std::array::from_fn(|index| self.histogram[index].load(Relaxed)),
        }
    }
}

/// Counters updated by the engine as events happen.
#[derive(Default)]
pub(crate) struct Counters {
    pub device_reads: Direction,
    pub device_writes: Direction,
    pub device_flushes: AtomicU64,
    pub device_flush_errors: AtomicU64,
    pub evictions: AtomicU64,
    pub read_clusters: AtomicU64,
    pub read_cluster_buffers: AtomicU64,
    pub write_clusters: AtomicU64,
    pub write_cluster_buffers: AtomicU64,
    pub write_batches: AtomicU64,
    pub write_batch_writes: AtomicU64,
    pub reads_started: AtomicU64,
    pub reads_attached: AtomicU64,
    pub readahead_issued_blocks: AtomicU64,
    pub readahead_used_blocks: AtomicU64,
    pub readahead_wasted_blocks: AtomicU64,
    pub writeback_blocks: [AtomicU64; 5],
    pub throttled_writes: AtomicU64,
    pub space_waits: AtomicU64,
    pub space_failures: AtomicU64,
    pub writeback_inflight_waits: AtomicU64,
    pub eviction_candidates_examined: AtomicU64,
    pub buffer_waits: AtomicU64,
    pub buffer_wait_ns: AtomicU64,
    pub buffer_wait_buckets: [AtomicU64; BUFFER_WAIT_BUCKET_COUNT],
    pub streamed_reads: AtomicU64,
    pub streamed_blocks: AtomicU64,
    pub writeback_waits: AtomicU64,
}

impl Counters {
    pub fn writeback(&self, cause: WritebackCause, blocks: u64) {
        let index = WritebackCause::ALL
            .iter()
            .position(|&c| c == cause)
            .unwrap_or(0);
        self.writeback_blocks[index].fetch_add(blocks, Relaxed);
    }

    /// Counts one finished wait for a buffer that lasted `waited_ns` on the injected clock.
    pub fn buffer_wait(&self, waited_ns: u64) {
        let seconds = waited_ns as f64 / 1e9;
        let bucket = BUFFER_WAIT_BUCKETS_SECONDS
            .iter()
            .position(|&limit| seconds <= limit)
            .unwrap_or(BUFFER_WAIT_BUCKETS_SECONDS.len());
        self.buffer_waits.fetch_add(1, Relaxed);
        self.buffer_wait_ns.fetch_add(waited_ns, Relaxed);
        self.buffer_wait_buckets[bucket].fetch_add(1, Relaxed);
    }
}

/// One consistent-enough view of the engine's counters and gauges.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CacheStats {
    /// Block lookups that found the block cached (including ones that waited for another
    /// thread's read of the same block).
    pub hits: u64,
    /// Block lookups that had to read or create the block.
    pub misses: u64,
    /// Device reads issued by the engine.
    pub device_reads: DirectionStats,
    /// Device writes issued by the engine.
    pub device_writes: DirectionStats,
    /// Device flushes that succeeded.
    pub device_flushes: u64,
    /// Device flushes that failed.
    pub device_flush_errors: u64,
    /// Clean buffers evicted to make room.
    pub evictions: u64,
    /// Clustered device reads and the buffers they filled.
    pub read_clusters: u64,
    /// Buffers filled by clustered reads.
    pub read_cluster_buffers: u64,
    /// Clustered device writes.
    pub write_clusters: u64,
    /// Buffers drained by clustered writes.
    pub write_cluster_buffers: u64,
    /// Batches of write-back writes handed to a slow device together (in flight at once).
    pub write_batches: u64,
    /// Writes those batches carried.
    pub write_batch_writes: u64,
    /// Reads of missing blocks started on a device that ends them on a thread of its own,
    /// so no thread waited for them ([`crate::ObjectHandle::start_read`]).
    pub reads_started: u64,
    /// Started reads whose blocks another read was filling: they waited for that fill with
    /// no thread of their own ([`crate::ObjectHandle::start_read`]).
    pub reads_attached: u64,
    /// Blocks read ahead of a reader.
    pub readahead_issued_blocks: u64,
    /// Read-ahead blocks a reader then used.
    pub readahead_used_blocks: u64,
    /// Read-ahead blocks evicted or invalidated unused.
    pub readahead_wasted_blocks: u64,
    /// Blocks written back, by cause (see [`WritebackCause::ALL`] for the order).
    pub writeback_blocks: [u64; 5],
    /// Writes that had to write back dirty data themselves (above the dirty limit).
    pub throttled_writes: u64,
    /// Allocations that waited for space.
    pub space_waits: u64,
    /// Allocations that gave up waiting for space.
    pub space_failures: u64,
    /// Write-back passes that waited for a slot of their device's write-back share
    /// (`CacheConfig::writeback_inflight_max`).
    pub writeback_inflight_waits: u64,
    /// Candidates the evictor asked about (each policy's `evict` walk). Busy buffers are held
    /// off the queues, so this stays near `evictions` however many buffers are pinned,
    /// dirty or in flight.
    pub eviction_candidates_examined: u64,
    /// Reservations of a buffer that found none free and evictable and waited for a release
    /// (a read or write-back ending, an unpin), however the wait ended.
    pub buffer_waits: u64,
    /// Time those waits lasted in total, ns, on the injected clock.
    pub buffer_wait_ns: u64,
    /// Those waits by duration (not cumulative): bucket `i` counts waits of at most
    /// [`BUFFER_WAIT_BUCKETS_SECONDS`]`[i]`, the last one the longer ones.
    pub buffer_wait_buckets: [u64; BUFFER_WAIT_BUCKET_COUNT],
    /// Device reads that served a cold read straight into the caller's memory, caching
    /// nothing, because no buffer was free without evicting what others use (streaming).
    pub streamed_reads: u64,
    /// Blocks those reads carried.
    pub streamed_blocks: u64,
    /// Reservations under pressure that waited for write-back already in flight to end
    /// instead of writing back themselves.
    pub writeback_waits: u64,
    /// Write-back requests at the devices now.
    pub writeback_inflight_requests: u64,
    /// Bytes of dirty data.
    pub dirty_bytes: u64,
    /// Bytes of buffers someone holds (pinned or locked).
    pub pinned_bytes: u64,
    /// Memory charged to buffers (whole pages).
    pub memory_used_bytes: u64,
    /// Charged memory beyond the buffers' sizes (page rounding).
    pub memory_wasted_bytes: u64,
    /// Memory faulted in ahead of need ([`crate::Cache::prefault`]) that no buffer has used
    /// yet: resident, but not charged to the cache.
    pub memory_prefaulted_bytes: u64,
    /// Live buffers.
    pub buffers_in_use: u64,
    /// Limit on memory now.
    pub memory_bytes_max: u64,
    /// Limit on buffers now.
    pub buffers_max: u64,
}

impl CacheStats {
    /// hits / (hits + misses), 0 when idle.
    pub fn hit_ratio(&self) -> f64 {
        let total = self.hits + self.misses;
        if total == 0 {
            0.0
        } else {
            self.hits as f64 / total as f64
        }
    }

    /// Blocks written back for `cause`.
    pub fn writeback(&self, cause: WritebackCause) -> u64 {
        let index = WritebackCause::ALL
            .iter()
            .position(|&c| c == cause)
            .unwrap_or(0);
        self.writeback_blocks[index]
    }
}

impl Counters {
    pub fn fill(&self, stats: &mut CacheStats) {
        stats.device_reads = self.device_reads.snapshot();
        stats.device_writes = self.device_writes.snapshot();
        stats.device_flushes = self.device_flushes.load(Relaxed);
        stats.device_flush_errors = self.device_flush_errors.load(Relaxed);
        stats.evictions = self.evictions.load(Relaxed);
        stats.read_clusters = self.read_clusters.load(Relaxed);
        stats.read_cluster_buffers = self.read_cluster_buffers.load(Relaxed);
        stats.write_clusters = self.write_clusters.load(Relaxed);
        stats.write_cluster_buffers = self.write_cluster_buffers.load(Relaxed);
        stats.write_batches = self.write_batches.load(Relaxed);
        stats.write_batch_writes = self.write_batch_writes.load(Relaxed);
        stats.reads_started = self.reads_started.load(Relaxed);
        stats.reads_attached = self.reads_attached.load(Relaxed);
        stats.readahead_issued_blocks = self.readahead_issued_blocks.load(Relaxed);
        stats.readahead_used_blocks = self.readahead_used_blocks.load(Relaxed);
        stats.readahead_wasted_blocks = self.readahead_wasted_blocks.load(Relaxed);
        stats.writeback_blocks =
            std::array::from_fn(|index| self.writeback_blocks[index].load(Relaxed));
        stats.throttled_writes = self.throttled_writes.load(Relaxed);
        stats.space_waits = self.space_waits.load(Relaxed);
        stats.space_failures = self.space_failures.load(Relaxed);
        stats.writeback_inflight_waits = self.writeback_inflight_waits.load(Relaxed);
        stats.eviction_candidates_examined = self.eviction_candidates_examined.load(Relaxed);
        stats.buffer_waits = self.buffer_waits.load(Relaxed);
        stats.buffer_wait_ns = self.buffer_wait_ns.load(Relaxed);
        stats.buffer_wait_buckets =
            std::array::from_fn(|index| self.buffer_wait_buckets[index].load(Relaxed));
        stats.streamed_reads = self.streamed_reads.load(Relaxed);
        stats.streamed_blocks = self.streamed_blocks.load(Relaxed);
        stats.writeback_waits = self.writeback_waits.load(Relaxed);
    }
}
