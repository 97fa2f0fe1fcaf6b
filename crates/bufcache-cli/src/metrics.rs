//! Metrics: the engine's statistics snapshot and each export's device counters, served over a
//! minimal HTTP/1.0 endpoint as Prometheus text (`/metrics`, written by `prometheus-client`
//! through module `exposition`) and JSON (`/stats`).
//!
//! Names are prefixed `bufcache_`, carry their unit (`_bytes`, `_total`), and device metrics
//! are labelled by export. Nothing is computed at request time beyond reading counters, so a
//! scrape costs a snapshot and some formatting. Requests are parsed with `httparse`; one
//! connection is served at a time, its request head bounded to 8 KiB and to 5 s from accept
//! (the endpoint is the operator's, not a client's: one thread, no connection can make it hold
//! more).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bufcache::device::counting::{histogram_bucket_limit_bytes, HISTOGRAM_BUCKETS};
use bufcache::{
    Cache, CacheStats, CountingDevice, Device, DeviceStats, DirectionStats, IoQueue, IoQueueStats,
    WritebackCause,
};
use serde_json::{json, Value};

use crate::exposition::{with_label, Exposition, Labels, Level};
use crate::request_meters::{RequestMeters, COMMANDS, LATENCY_BUCKETS_SECONDS};

/// The local tier type serve builds: over the counted backend, on a file or block device.
pub type ServeTier = bufcache_tier::LocalTier<std::sync::Arc<dyn bufcache::Device>>;

/// The counters of one export's device stack.
#[derive(Clone)]
pub struct ExportMeters {
    /// Export name ("" for the default export).
    pub name: String,
    /// Counts what reaches the backend.
    pub device: Arc<CountingDevice<Arc<dyn Device>>>,
    /// The io queue above it, if any.
    pub queue: Option<Arc<IoQueue<Arc<dyn Device>>>>,
    /// The upstream NBD connection, for an nbd:// backend.
    pub upstream: Option<Arc<bufcache_nbd::ReconnectingClient>>,
    /// What clients asked of the export: connections and NBD commands.
    pub requests: Arc<RequestMeters>,
    /// The local tier (--local-cache) between the cache and the backend, if any.
    pub tier: Option<Arc<ServeTier>>,
    /// The object-store disk, for an s3:// backend (its store requests and objects).
    pub store: Option<Arc<bufcache_s3::S3Device>>,
    /// The warm standby, for an s3:// backend served with --standby: its view (a replica
    /// until it takes the disk over, the writer's open after) stands for `store`.
    pub standby: Option<Arc<crate::standby::WarmStandby>>,
}

/// What an export is to its object-store disk, for `/metrics` and `/stats`.
struct StoreRole<'a> {
    device: &'a bufcache_s3::S3Device,
    role: Option<&'static str>,
    lease_age_seconds: Option<f64>,
    replica_lag_seconds: Option<f64>,
    /// Bytes a standby read into its cache to keep it warm.
    warm_bytes: Option<u64>,
}

impl ExportMeters {
    fn store_role(&self) -> Option<StoreRole<'_>> {
        if let Some(warm) = &self.standby {
            let standby = &warm.standby;
            let following = standby.writer().is_none();
            return Some(StoreRole {
                device: standby.current(),
                role: Some(standby.role()),
                lease_age_seconds: standby.lease_age_seconds(),
                replica_lag_seconds: following.then(|| standby.replica().lag_seconds()),
                warm_bytes: Some(warm.warm_bytes()),
            });
        }
        let store = self.store.as_deref()?;
        Some(StoreRole {
            device: store,
            role: store.role(),
            lease_age_seconds: store.lease().map(|lease| lease.age_ns() as f64 / 1e9),
            replica_lag_seconds: store.replica().map(|replica| replica.lag_seconds()),
            warm_bytes: None,
        })
    }
}

/// Everything a scrape reports.
pub struct Meters {
    /// The shared cache.
    pub cache: Cache,
    /// One entry per export.
    pub exports: Vec<ExportMeters>,
    /// The live what-if miniature caches, when running.
    pub whatif: Option<Arc<crate::whatif::WhatIfFeed>>,
}

impl Meters {
    /// The `/stats` document.
    pub fn json(&self) -> Value {
        let stats = self.cache.stats();
        let exports: Vec<Value> = self
            .exports
            .iter()
            .map(|export| {
                let device = export.device.stats();
                let queue = export
                    .queue
                    .as_ref()
                    .map(|queue| queue.stats())
                    .unwrap_or_default();
                let upstream = export.upstream.as_ref().map(|upstream| {
                    json!({
                        "connected": upstream.is_connected(),
                        "reconnects": upstream.reconnect_count(),
                    })
                });
                let tier = export.tier.as_ref().map(|tier| {
                    let stats = tier.stats();
                    json!({
                        "dirty_bytes": stats.dirty_bytes,
                        "epochs_pending": stats.epochs_pending,
                        "remote_epoch": stats.remote_epoch,
                        "log_used_bytes": stats.log_used_bytes,
                        "log_capacity_bytes": stats.log_capacity_bytes,
                        "fallbacks": stats.fallbacks,
                        "read_blocks_local": stats.read_blocks_local,
                        "read_blocks_remote": stats.read_blocks_remote,
                        "read_cache_insert_failures": stats.read_cache_insert_failures,
                        "writeback_epochs": stats.writeback_epochs,
                        "writeback_failures_in_a_row": stats.writeback_failures_in_a_row,
                        "writeback_error": stats.writeback_error,
                    })
                });
                let store = export.store_role().map(|store| {
                    let mut figures = store_json(&store.device.store_stats());
                    figures["role"] = json!(store.role);
                    figures["lease_age_seconds"] = json!(store.lease_age_seconds);
                    figures["replica_lag_seconds"] = json!(store.replica_lag_seconds);
                    if let Some(bytes) = store.warm_bytes {
                        figures["standby_warm_bytes"] = json!(bytes);
                    }
                    figures
                });
                json!({
                    "name": export.name,
                    "store": store,
                    "local_tier": tier,
                    "nbd": requests_json(&export.requests),
                    "upstream": upstream,
                    "device": device_json(&device),
                    "io_queue": {
                        "requests_entered": queue.requests_entered,
                        "requests_issued": queue.requests_issued,
                        "requests_merged": queue.requests_merged,
                    },
                })
            })
            .collect();
        let mut document = json!({
            "cache": cache_json(&stats),
            "exports": exports,
            "log": {
                "lines_dropped": crate::log::lines_dropped_total(),
                "events_suppressed": crate::log::events_suppressed_total(),
                "lines_queued": crate::log::lines_queued(),
            },
        });
        if let Some(whatif) = &self.whatif {
            document["whatif"] = whatif.json();
        }
        document
    }

    /// The `/metrics` document.
    pub fn prometheus(&self) -> String {
        let stats = self.cache.stats();
        let mut text = Exposition::default();
        cache_prometheus(&mut text, &stats);
        counter(
            &mut text,
            "bufcache_log_lines_dropped_total",
            &Labels::new(),
            crate::log::lines_dropped_total(),
            "Log lines dropped: the log queue was full or standard error failed (closed pipe, full disk).",
        );
        counter(
            &mut text,
            "bufcache_log_events_suppressed_total",
            &Labels::new(),
            crate::log::events_suppressed_total(),
            "Repeated warnings and errors held back by the rate limit.",
        );
        gauge(
            &mut text,
            "bufcache_log_lines_queued",
            crate::log::lines_queued() as u64,
            "Log lines waiting to be written to standard error.",
        );
        if let Some(whatif) = &self.whatif {
            whatif.prometheus(&mut text);
        }
        for export in &self.exports {
            let label = crate::exposition::label("export", &export.name);
            requests_prometheus(&mut text, &label, &export.requests);
            let device = export.device.stats();
            direction_prometheus(&mut text, "read", &label, &device.reads);
            direction_prometheus(&mut text, "write", &label, &device.writes);
            counter(
                &mut text,
                "bufcache_device_flushes_total",
                &label,
                device.flushes,
                "Backend flushes that succeeded.",
            );
            counter(
                &mut text,
                "bufcache_device_discards_total",
                &label,
                device.discards,
                "Backend discards and zeroing requests.",
            );
            counter(
                &mut text,
                "bufcache_device_other_errors_total",
                &label,
                device.other_errors,
                "Backend flush and discard failures.",
            );
            if let Some(upstream) = &export.upstream {
                sample(
                    &mut text,
                    "bufcache_upstream_connected",
                    &label,
                    u64::from(upstream.is_connected()),
                    "1 while the upstream NBD connection is up, 0 while reconnecting.",
                );
                counter(
                    &mut text,
                    "bufcache_upstream_reconnects_total",
                    &label,
                    upstream.reconnect_count(),
                    "Successful reconnections to the upstream NBD server.",
                );
            }
            if let Some(tier) = &export.tier {
                tier_prometheus(&mut text, &label, &tier.stats());
            }
            if let Some(store) = export.store_role() {
                store_prometheus(&mut text, &label, &store.device.store_stats());
                store_role_prometheus(&mut text, &label, &store);
            }
            let queue: IoQueueStats = export
                .queue
                .as_ref()
                .map(|queue| queue.stats())
                .unwrap_or_default();
            counter(
                &mut text,
                "bufcache_io_queue_requests_entered_total",
                &label,
                queue.requests_entered,
                "Requests entering the io queue.",
            );
            counter(
                &mut text,
                "bufcache_io_queue_requests_issued_total",
                &label,
                queue.requests_issued,
                "Requests the io queue issued after merging.",
            );
            counter(
                &mut text,
                "bufcache_io_queue_requests_merged_total",
                &label,
                queue.requests_merged,
                "Requests merged into another.",
            );
        }
        text.render()
    }
}

/// The object store's metrics of one export (names as issue 48 gives them).
fn store_prometheus(text: &mut Exposition, label: &Labels, stats: &bufcache_s3::StoreStats) {
    use bufcache_s3::{STORE_DURATION_BUCKETS_SECONDS, STORE_METHODS, STORE_OUTCOMES};
    for (method, outcomes) in STORE_METHODS.iter().zip(&stats.requests) {
        for (outcome, &count) in STORE_OUTCOMES.iter().zip(outcomes) {
            counter(
                text,
                "bufcache_store_requests_total",
                &with_label(&with_label(label, "method", method), "outcome", outcome),
                count,
                "Requests to the object store by method (LIST: a bucket listing) and outcome \
                 (ok, client_error: 4xx, server_error: 5xx, transport_error: no answer), each \
                 retry included.",
            );
        }
    }
    for (direction, bytes) in [
        ("sent", stats.bytes_sent),
        ("received", stats.bytes_received),
    ] {
        counter(
            text,
            "bufcache_store_bytes_total",
            &with_label(label, "direction", direction),
            bytes,
            "Request bodies sent to and response bodies received from the object store.",
        );
    }
    counter(
        text,
        "bufcache_store_retries_total",
        label,
        stats.retries,
        "Store requests that failed in a way the client retries (5xx, 429, no answer) until \
         retry-timeout-ms has passed.",
    );
    sample(
        text,
        "bufcache_store_requests_in_flight",
        label,
        stats.in_flight,
        "Store requests sent and not yet answered.",
    );
    for (index, method) in STORE_METHODS.iter().enumerate() {
        let counts = &stats.duration_buckets[index];
        text.histogram(
            "bufcache_store_request_duration_seconds",
            with_label(label, "method", method),
            buckets(counts.iter().copied(), |bucket| {
                STORE_DURATION_BUCKETS_SECONDS.get(bucket).copied()
            }),
            stats.duration_seconds_sum[index],
            counts.iter().sum(),
            "Time from a store request's start to its answer's headers, by method.",
        );
    }
    if let Some(log) = &stats.log {
        for (name, value, help, kind) in [
            (
                "bufcache_store_live_bytes",
                log.live_bytes,
                "Log layout: bytes of the disk mapped to stored data.",
                "gauge",
            ),
            (
                "bufcache_store_garbage_bytes",
                log.garbage_bytes,
                "Log layout: object bytes of the durable segments beyond the live bytes \
                 (overwritten or trimmed data, checksums, headers, padding).",
                "gauge",
            ),
            (
                "bufcache_store_segments",
                log.segments,
                "Log layout: durable segment objects.",
                "gauge",
            ),
            (
                "bufcache_store_gc_passes_total",
                log.gc_passes,
                "Log layout: garbage-collection rounds.",
                "counter",
            ),
            (
                "bufcache_store_gc_bytes_moved_total",
                log.gc_bytes_moved,
                "Log layout: live bytes the collector copied to new segments.",
                "counter",
            ),
        ] {
            match kind {
                "counter" => counter(text, name, label, value, help),
                _ => text.gauge(name, label.clone(), value, help),
            }
        }
    }
}

/// What this server is to an object-store disk (writer, standby, replica), how old its lease
/// is, and how far a replica is behind (docs/s3.md, "Leases and takeover", "Read replicas").
fn store_role_prometheus(text: &mut Exposition, label: &Labels, store: &StoreRole<'_>) {
    if let Some(role) = store.role {
        for known in ["writer", "standby", "replica"] {
            sample(
                text,
                "bufcache_store_role",
                &with_label(label, "role", known),
                u64::from(known == role),
                "What this server is to the disk: 1 for its role (writer: holds the lock under a lease; standby: follows and takes over when the lease lapses; replica: follows, never writes).",
            );
        }
    }
    if let Some(age) = store.lease_age_seconds {
        sample(
            text,
            "bufcache_store_lease_age_seconds",
            label,
            age,
            "Seconds since the newest renewal of the disk lock's lease: the send time of this writer's own newest successful renewal, or, on a standby, since it last saw the writer's lock change.",
        );
    }
    if let Some(lag) = store.replica_lag_seconds {
        sample(
            text,
            "bufcache_store_replica_lag_seconds",
            label,
            lag,
            "Seconds since the newest successful refresh of the read replica (or standby) started: it serves every write the writer made durable before then.",
        );
    }
    if let Some(bytes) = store.warm_bytes {
        counter(
            text,
            "bufcache_store_standby_warm_bytes_total",
            label,
            bytes,
            "Bytes a standby read into its cache while following the writer, to serve them warm once it takes over.",
        );
    }
}

/// The object store's figures of one export, for `/stats`.
fn store_json(stats: &bufcache_s3::StoreStats) -> Value {
    use bufcache_s3::{STORE_DURATION_BUCKETS_SECONDS, STORE_METHODS, STORE_OUTCOMES};
    let requests: serde_json::Map<String, Value> = STORE_METHODS
        .iter()
        .zip(&stats.requests)
        .map(|(method, outcomes)| {
            let by_outcome: serde_json::Map<String, Value> = STORE_OUTCOMES
                .iter()
                .zip(outcomes)
                .map(|(outcome, &count)| (outcome.to_string(), json!(count)))
                .collect();
            (method.to_string(), Value::Object(by_outcome))
        })
        .collect();
    let durations: serde_json::Map<String, Value> = STORE_METHODS
        .iter()
        .enumerate()
        .map(|(index, method)| {
            (
                method.to_string(),
                json!({
                    "buckets": stats.duration_buckets[index],
                    "seconds_sum": stats.duration_seconds_sum[index],
                }),
            )
        })
        .collect();
    let log = stats.log.map(|log| {
        json!({
            "live_bytes": log.live_bytes,
            "garbage_bytes": log.garbage_bytes,
            "segments": log.segments,
            "gc_passes": log.gc_passes,
            "gc_bytes_moved": log.gc_bytes_moved,
        })
    });
    json!({
        "requests": requests,
        "bytes_sent": stats.bytes_sent,
        "bytes_received": stats.bytes_received,
        "retries": stats.retries,
        "in_flight": stats.in_flight,
        "duration_bucket_limits_seconds": STORE_DURATION_BUCKETS_SECONDS,
        "durations": durations,
        "log": log,
    })
}

/// The local tier's metrics of one export.
fn tier_prometheus(text: &mut Exposition, label: &Labels, stats: &bufcache_tier::TierStats) {
    for (name, value, help) in [
        (
            "bufcache_tier_dirty_bytes",
            stats.dirty_bytes,
            "Bytes in the local cache's log not yet on the backend.",
        ),
        (
            "bufcache_tier_epochs_pending",
            stats.epochs_pending,
            "Flush epochs with writes not yet on the backend.",
        ),
        (
            "bufcache_tier_log_used_bytes",
            stats.log_used_bytes,
            "Bytes of the local cache's log in use.",
        ),
    ] {
        sample(text, name, label, value, help);
    }
    for (name, value, help) in [
        (
            "bufcache_tier_fallbacks_total",
            stats.fallbacks,
            "Writes that found the local cache full of data not yet on the backend and fell back to backend durability.",
        ),
        (
            "bufcache_tier_read_blocks_local_total",
            stats.read_blocks_local,
            "Blocks read from the local cache.",
        ),
        (
            "bufcache_tier_read_blocks_remote_total",
            stats.read_blocks_remote,
            "Blocks the local cache read from the backend.",
        ),
        (
            "bufcache_tier_writeback_epochs_total",
            stats.writeback_epochs,
            "Flush epochs written back to the backend.",
        ),
    ] {
        counter(text, name, label, value, help);
    }
}

/// The `nbd` object of an export on `/stats`: connections, and per command the requests,
/// bytes, errors, latency sum and the histogram's (non-cumulative) bucket counts.
fn requests_json(meters: &RequestMeters) -> Value {
    use std::sync::atomic::Ordering::Relaxed;
    let commands: serde_json::Map<String, Value> = COMMANDS
        .iter()
        .zip(&meters.commands)
        .map(|(name, meter)| {
            let buckets: Vec<u64> = meter
                .latency_buckets
                .iter()
                .map(|bucket| bucket.load(Relaxed))
                .collect();
            (
                (*name).to_string(),
                json!({
                    "requests": meter.requests.load(Relaxed),
                    "bytes": meter.bytes.load(Relaxed),
                    "errors": meter.errors.load(Relaxed),
                    "latency_seconds_sum": meter.latency_ns_sum.load(Relaxed) as f64 / 1e9,
                    "latency_buckets": buckets,
                }),
            )
        })
        .collect();
    json!({
        "connections_open": meters.connections_open.load(Relaxed),
        "connections_total": meters.connections_total.load(Relaxed),
        "latency_bucket_limits_seconds": LATENCY_BUCKETS_SECONDS,
        "commands": commands,
    })
}

/// Connections and per-command counters and latency histograms of one export.
fn requests_prometheus(text: &mut Exposition, export_label: &Labels, meters: &RequestMeters) {
    use std::sync::atomic::Ordering::Relaxed;
    sample(
        text,
        "bufcache_nbd_connections_open",
        export_label,
        meters.connections_open.load(Relaxed),
        "NBD connections in transmission now.",
    );
    counter(
        text,
        "bufcache_nbd_connections_total",
        export_label,
        meters.connections_total.load(Relaxed),
        "NBD connections that entered transmission.",
    );
    for (name, meter) in COMMANDS.iter().zip(&meters.commands) {
        let labels = with_label(export_label, "command", name);
        counter(
            text,
            "bufcache_nbd_requests_total",
            &labels,
            meter.requests.load(Relaxed),
            "NBD requests by command, failed ones included.",
        );
        counter(
            text,
            "bufcache_nbd_request_bytes_total",
            &labels,
            meter.bytes.load(Relaxed),
            "Bytes of the NBD requests that succeeded, by command (the range for trim, \
             zeroing, cache and block status).",
        );
        counter(
            text,
            "bufcache_nbd_request_errors_total",
            &labels,
            meter.errors.load(Relaxed),
            "NBD requests answered with an error, by command.",
        );
        let counts: Vec<u64> = meter
            .latency_buckets
            .iter()
            .map(|bucket| bucket.load(Relaxed))
            .collect();
        let count = counts.iter().sum();
        text.histogram(
            "bufcache_nbd_request_duration_seconds",
            labels,
            buckets(counts.into_iter(), |index| {
                LATENCY_BUCKETS_SECONDS.get(index).copied()
            }),
            meter.latency_ns_sum.load(Relaxed) as f64 / 1e9,
            count,
            "Time from an NBD request's dispatch to its completion, by command.",
        );
    }
}

/// Each bucket's upper bound (the last one's `f64::INFINITY`) beside its own count.
fn buckets(
    counts: impl Iterator<Item = u64>,
    bound: impl Fn(usize) -> Option<f64>,
) -> Vec<(f64, u64)> {
    counts
        .enumerate()
        .map(|(index, count)| (bound(index).unwrap_or(f64::INFINITY), count))
        .collect()
}

fn counter(text: &mut Exposition, name: &str, labels: &Labels, value: u64, help: &str) {
    text.counter(name, labels.clone(), value, help);
}

fn gauge(text: &mut Exposition, name: &str, value: u64, help: &str) {
    text.gauge(name, Labels::new(), value, help);
}

/// A gauge sample under `labels`.
fn sample(text: &mut Exposition, name: &str, labels: &Labels, value: impl Into<Level>, help: &str) {
    text.gauge(name, labels.clone(), value, help);
}

/// `bufcache_buffer_wait_seconds`, from the engine's (non-cumulative) buckets.
fn buffer_wait_histogram(text: &mut Exposition, stats: &CacheStats) {
    text.histogram(
        "bufcache_buffer_wait_seconds",
        Labels::new(),
        buckets(stats.buffer_wait_buckets.iter().copied(), |index| {
            bufcache::BUFFER_WAIT_BUCKETS_SECONDS.get(index).copied()
        }),
        stats.buffer_wait_ns as f64 / 1e9,
        stats.buffer_waits,
        "How long reservations waited for a buffer.",
    );
}

/// The cache's own samples (every export's together), in the order they have always had.
fn cache_prometheus(text: &mut Exposition, stats: &CacheStats) {
    for (name, value, help) in cache_lookup_counters(stats) {
        counter(text, name, &Labels::new(), value, help);
    }
    for cause in WritebackCause::ALL {
        let labels = crate::exposition::label("cause", cause.name());
        counter(
            text,
            "bufcache_writeback_blocks_total",
            &labels,
            stats.writeback(cause),
            "Blocks written back, by cause.",
        );
    }
    for (name, value, help) in cache_wait_counters(stats) {
        counter(text, name, &Labels::new(), value, help);
    }
    buffer_wait_histogram(text, stats);
    for (name, value, help) in cache_device_counters(stats) {
        counter(text, name, &Labels::new(), value, help);
    }
    for (name, value, help) in cache_gauges(stats) {
        gauge(text, name, value, help);
    }
}

/// The cache's lookups, evictions, clustered and started reads, write batches and read-ahead.
fn cache_lookup_counters(stats: &CacheStats) -> [(&'static str, u64, &'static str); 15] {
    [
        ("bufcache_cache_hits_total", stats.hits, "Block lookups served from the cache."),
        ("bufcache_cache_misses_total", stats.misses, "Block lookups that needed the device."),
        ("bufcache_evictions_total", stats.evictions, "Clean buffers evicted to make room."),
        ("bufcache_read_clusters_total", stats.read_clusters, "Clustered device reads."),
        (
            "bufcache_reads_started_total",
            stats.reads_started,
            "Reads of missing blocks started on an upstream that ends them on its own thread (no thread waited).",
        ),
        (
            "bufcache_reads_attached_total",
            stats.reads_attached,
            "Started reads of blocks another read was filling, answered by that fill's completion (no thread waited).",
        ),
        (
            "bufcache_write_batches_total",
            stats.write_batches,
            "Batches of write-back writes handed to a slow device together.",
        ),
        (
            "bufcache_write_batch_writes_total",
            stats.write_batch_writes,
            "Writes carried by those batches.",
        ),
        (
            "bufcache_writeback_inflight_waits_total",
            stats.writeback_inflight_waits,
            "Write-back passes that waited for a slot of their backend's write-back share (--writeback-inflight-max).",
        ),
        (
            "bufcache_read_cluster_buffers_total",
            stats.read_cluster_buffers,
            "Buffers filled by clustered reads.",
        ),
        ("bufcache_write_clusters_total", stats.write_clusters, "Clustered device writes."),
        (
            "bufcache_write_cluster_buffers_total",
            stats.write_cluster_buffers,
            "Buffers drained by clustered writes.",
        ),
        (
            "bufcache_readahead_issued_blocks_total",
            stats.readahead_issued_blocks,
            "Blocks read ahead.",
        ),
        (
            "bufcache_readahead_used_blocks_total",
            stats.readahead_used_blocks,
            "Read-ahead blocks a reader used.",
        ),
        (
            "bufcache_readahead_wasted_blocks_total",
            stats.readahead_wasted_blocks,
            "Read-ahead blocks dropped unused.",
        ),
    ]
}

/// Writers and reservations that had to wait for write-back, space or a buffer.
fn cache_wait_counters(stats: &CacheStats) -> [(&'static str, u64, &'static str); 3] {
    [
        (
            "bufcache_throttled_writes_total",
            stats.throttled_writes,
            "Writes that wrote back dirty data themselves.",
        ),
        (
            "bufcache_space_waits_total",
            stats.space_waits,
            "Allocations that waited for space.",
        ),
        (
            "bufcache_buffer_waits_total",
            stats.buffer_waits,
            "Reservations that found no evictable buffer and waited for a release.",
        ),
    ]
}

/// Streamed reads, waits for write-back, the evictor's walk, and the engine's device errors.
fn cache_device_counters(stats: &CacheStats) -> [(&'static str, u64, &'static str); 9] {
    [
        (
            "bufcache_streamed_reads_total",
            stats.streamed_reads,
            "Device reads that served a cold read without caching it: no buffer was free without evicting what others use.",
        ),
        (
            "bufcache_streamed_blocks_total",
            stats.streamed_blocks,
            "Blocks served by streamed reads.",
        ),
        (
            "bufcache_writeback_waits_total",
            stats.writeback_waits,
            "Writers under pressure that waited for write-back in flight instead of writing back themselves.",
        ),
        (
            "bufcache_eviction_candidates_examined_total",
            stats.eviction_candidates_examined,
            "Buffers the evictor asked about; busy ones are held off the queues, not walked.",
        ),
        (
            "bufcache_space_failures_total",
            stats.space_failures,
            "Allocations that gave up waiting for space.",
        ),
        (
            "bufcache_engine_device_flushes_total",
            stats.device_flushes,
            "Device flushes issued by the engine.",
        ),
        (
            "bufcache_engine_device_flush_errors_total",
            stats.device_flush_errors,
            "Device flushes that failed.",
        ),
        (
            "bufcache_engine_device_read_errors_total",
            stats.device_reads.errors,
            "Device reads that failed.",
        ),
        (
            "bufcache_engine_device_write_errors_total",
            stats.device_writes.errors,
            "Device writes that failed.",
        ),
    ]
}

/// The cache's levels now: dirty data, write-back in flight, memory and buffers.
fn cache_gauges(stats: &CacheStats) -> [(&'static str, u64, &'static str); 9] {
    [
        (
            "bufcache_dirty_bytes",
            stats.dirty_bytes,
            "Bytes of dirty data.",
        ),
        (
            "bufcache_writeback_inflight_requests",
            stats.writeback_inflight_requests,
            "Write-back requests at the backends now.",
        ),
        (
            "bufcache_pinned_bytes",
            stats.pinned_bytes,
            "Bytes of buffers held (wired).",
        ),
        (
            "bufcache_memory_used_bytes",
            stats.memory_used_bytes,
            "Memory charged to buffers.",
        ),
        (
            "bufcache_memory_wasted_bytes",
            stats.memory_wasted_bytes,
            "Charged memory beyond buffer sizes.",
        ),
        (
            "bufcache_memory_prefaulted_bytes",
            stats.memory_prefaulted_bytes,
            "Memory faulted in ahead of need (--prefault), not yet used by buffers.",
        ),
        (
            "bufcache_memory_limit_bytes",
            stats.memory_bytes_max,
            "Memory limit.",
        ),
        ("bufcache_buffers", stats.buffers_in_use, "Live buffers."),
        (
            "bufcache_buffers_limit",
            stats.buffers_max,
            "Buffer limit (NBUF).",
        ),
    ]
}
fn direction_prometheus(
    text: &mut Exposition,
    direction: &str,
    labels: &Labels,
    stats: &DirectionStats,
) {
    let help = format!("Backend {direction} requests.");
    counter(
        text,
        &format!("bufcache_device_{direction}_requests_total"),
        labels,
        stats.requests,
        &help,
    );
    counter(
        text,
        &format!("bufcache_device_{direction}_bytes_total"),
        labels,
        stats.bytes,
        &format!("Bytes {direction} at the backend."),
    );
    counter(
        text,
        &format!("bufcache_device_{direction}_errors_total"),
        labels,
        stats.errors,
        &format!("Backend {direction} failures."),
    );
    text.histogram(
        &format!("bufcache_device_{direction}_request_size_bytes"),
        labels.clone(),
        buckets(
            stats.histogram[..HISTOGRAM_BUCKETS].iter().copied(),
            |index| {
                let limit = histogram_bucket_limit_bytes(index);
                (limit != u64::MAX).then_some(limit as f64)
            },
        ),
        stats.bytes as f64,
        stats.requests,
        &format!("Backend {direction} request sizes."),
    );
}

fn direction_json(stats: &DirectionStats) -> Value {
    json!({
        "requests": stats.requests,
        "bytes": stats.bytes,
        "errors": stats.errors,
        "average_transfer_bytes": stats.average_transfer_bytes(),
        "histogram": stats.histogram.to_vec(),
    })
}

fn device_json(stats: &DeviceStats) -> Value {
    json!({
        "reads": direction_json(&stats.reads),
        "writes": direction_json(&stats.writes),
        "flushes": stats.flushes,
        "discards": stats.discards,
        "other_errors": stats.other_errors,
    })
}

fn cache_json(stats: &CacheStats) -> Value {
    let writeback: serde_json::Map<String, Value> = WritebackCause::ALL
        .iter()
        .map(|&cause| (cause.name().to_string(), json!(stats.writeback(cause))))
        .collect();
    json!({
        "hits": stats.hits,
        "misses": stats.misses,
        "hit_ratio": stats.hit_ratio(),
        "evictions": stats.evictions,
        "device_reads": direction_json(&stats.device_reads),
        "device_writes": direction_json(&stats.device_writes),
        "device_flushes": stats.device_flushes,
        "device_flush_errors": stats.device_flush_errors,
        "read_clusters": stats.read_clusters,
        "read_cluster_buffers": stats.read_cluster_buffers,
        "reads_started": stats.reads_started,
        "reads_attached": stats.reads_attached,
        "write_batches": stats.write_batches,
        "write_batch_writes": stats.write_batch_writes,
        "writeback_inflight_waits": stats.writeback_inflight_waits,
        "writeback_inflight_requests": stats.writeback_inflight_requests,
        "write_clusters": stats.write_clusters,
        "write_cluster_buffers": stats.write_cluster_buffers,
        "readahead_issued_blocks": stats.readahead_issued_blocks,
        "readahead_used_blocks": stats.readahead_used_blocks,
        "readahead_wasted_blocks": stats.readahead_wasted_blocks,
        "writeback_blocks": writeback,
        "throttled_writes": stats.throttled_writes,
        "space_waits": stats.space_waits,
        "space_failures": stats.space_failures,
        "eviction_candidates_examined": stats.eviction_candidates_examined,
        "buffer_waits": stats.buffer_waits,
        "buffer_wait_seconds": stats.buffer_wait_ns as f64 / 1e9,
        "buffer_wait_buckets": stats.buffer_wait_buckets.to_vec(),
        "buffer_wait_bucket_limits_seconds": bufcache::BUFFER_WAIT_BUCKETS_SECONDS,
        "streamed_reads": stats.streamed_reads,
        "streamed_blocks": stats.streamed_blocks,
        "writeback_waits": stats.writeback_waits,
        "dirty_bytes": stats.dirty_bytes,
        "pinned_bytes": stats.pinned_bytes,
        "memory_used_bytes": stats.memory_used_bytes,
        "memory_wasted_bytes": stats.memory_wasted_bytes,
        "memory_prefaulted_bytes": stats.memory_prefaulted_bytes,
        "memory_limit_bytes": stats.memory_bytes_max,
        "buffers": stats.buffers_in_use,
        "buffers_limit": stats.buffers_max,
    })
}

/// Opens the metrics listener on `address`, before the exports are opened, so an address in
/// use refuses the start before any disk was changed.
pub fn bind(address: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(address).with_context(|| format!("--metrics {address}: cannot listen"))
}

/// The longest request head (request line and headers) the endpoint reads; a longer one is
/// refused with 431, so a client cannot grow the endpoint's memory.
const HEAD_BYTES_MAX: usize = 8 * 1024;
/// The most headers a request head may carry (httparse parses into a fixed array).
const HEADERS_MAX: usize = 64;
/// The time from accept in which the whole request head must arrive: each read waits only for
/// what is left of it, so a client trickling bytes cannot hold the single metrics thread longer.
const HEAD_DEADLINE: Duration = Duration::from_secs(5);
/// How long writing an answer may take in all, on a client that reads slowly or not at all.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// The most bytes read and discarded after refusing a request, so the refusal reaches the
/// client instead of being lost to the reset that closing over unread bytes sends.
const DRAIN_BYTES_MAX: usize = 64 * 1024;

/// A page the endpoint serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Page {
    /// `/metrics`: Prometheus text.
    Metrics,
    /// `/stats`: JSON.
    Stats,
}

/// Serves `/metrics` and `/stats` on `listener` (from [`bind`]) from a background thread.
pub fn start(listener: TcpListener, meters: Arc<Meters>) -> anyhow::Result<std::net::SocketAddr> {
    serve(listener, move |page| match page {
        Page::Metrics => meters.prometheus(),
        Page::Stats => meters.json().to_string(),
    })
}

/// Answers the connections of `listener` one at a time on one thread, each page's body made by
/// `render`. One connection at a time is the design: the endpoint is the operator's, and with
/// the head's size and deadline bounded, no client can make it hold more than one thread for
/// more than [`HEAD_DEADLINE`] plus [`WRITE_TIMEOUT`].
fn serve(
    listener: TcpListener,
    render: impl Fn(Page) -> String + Send + 'static,
) -> anyhow::Result<std::net::SocketAddr> {
    let local = listener.local_addr()?;
    std::thread::Builder::new()
        .name("bufcache-metrics".into())
        .spawn(move || {
            for stream in listener.incoming().flatten() {
                if let Err(error) = answer(stream, &render) {
                    tracing::debug!(%error, "metrics request failed");
                }
            }
        })
        .context("starting the metrics thread")?;
    Ok(local)
}

/// A request head as read: the method and the path without its query, or the status line of
/// the refusal.
enum Head {
    Request { method: String, path: String },
    Refused(&'static str),
}

/// What is left of the head's deadline, or a timeout error once it has passed.
fn time_left(accepted: Instant) -> std::io::Result<Duration> {
    HEAD_DEADLINE
        .checked_sub(accepted.elapsed())
        .filter(|left| !left.is_zero())
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the request head did not arrive in time",
            )
        })
}

/// Reads the request head into a buffer of [`HEAD_BYTES_MAX`] bytes and parses it, reading
/// more while it is incomplete, until [`HEAD_DEADLINE`] after `accepted`.
fn read_head(stream: &mut TcpStream, accepted: Instant) -> std::io::Result<Head> {
    let mut buffer = vec![0_u8; HEAD_BYTES_MAX];
    let mut filled = 0;
    loop {
        if filled == buffer.len() {
            return Ok(Head::Refused("431 Request Header Fields Too Large"));
        }
        stream.set_read_timeout(Some(time_left(accepted)?))?;
        let read = stream.read(&mut buffer[filled..])?;
        if read == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the client closed before the end of the request head",
            ));
        }
        filled += read;
        let mut headers = [httparse::EMPTY_HEADER; HEADERS_MAX];
        let mut request = httparse::Request::new(&mut headers);
        match request.parse(&buffer[..filled]) {
            Ok(httparse::Status::Complete(_)) => {
                let (Some(method), Some(target)) = (request.method, request.path) else {
                    return Ok(Head::Refused("400 Bad Request"));
                };
                let path = target.split('?').next().unwrap_or(target);
                return Ok(Head::Request {
                    method: method.to_string(),
                    path: path.to_string(),
                });
            }
            Ok(httparse::Status::Partial) => continue,
            Err(httparse::Error::TooManyHeaders) => {
                return Ok(Head::Refused("431 Request Header Fields Too Large"))
            }
            Err(_) => return Ok(Head::Refused("400 Bad Request")),
        }
    }
}

fn answer(mut stream: TcpStream, render: &impl Fn(Page) -> String) -> std::io::Result<()> {
    let accepted = Instant::now();
    let (method, path) = match read_head(&mut stream, accepted)? {
        Head::Request { method, path } => (method, path),
        Head::Refused(status) => {
            let body = format!("{status}\n");
            respond(&mut stream, status, "text/plain", "", &body, true)?;
            return drain(stream, accepted);
        }
    };
    let with_body = match method.as_str() {
        "GET" => true,
        "HEAD" => false,
        _ => {
            respond(
                &mut stream,
                "405 Method Not Allowed",
                "text/plain",
                "Allow: GET, HEAD\r\n",
                "try GET /metrics or GET /stats\n",
                true,
            )?;
            return drain(stream, accepted);
        }
    };
    let (status, content_type, body) = match path.as_str() {
        "/metrics" => ("200 OK", "text/plain; version=0.0.4", render(Page::Metrics)),
        "/stats" => ("200 OK", "application/json", render(Page::Stats)),
        _ => (
            "404 Not Found",
            "text/plain",
            "try /metrics or /stats\n".to_string(),
        ),
    };
    respond(&mut stream, status, content_type, "", &body, with_body)
}

/// Writes an HTTP/1.0 answer; `body`'s length is announced even when it is left out (HEAD).
fn respond(
    stream: &mut TcpStream,
    status: &str,
    content_type: &str,
    extra_headers: &str,
    body: &str,
    with_body: bool,
) -> std::io::Result<()> {
    let mut message = format!(
        "HTTP/1.0 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n{extra_headers}Connection: close\r\n\r\n",
        body.len()
    );
    if with_body {
        message.push_str(body);
    }
    // Each write waits only for what is left of the answer's deadline, so a client reading a
    // byte now and then cannot stretch it.
    let started = Instant::now();
    let mut unsent = message.as_bytes();
    while !unsent.is_empty() {
        let left = WRITE_TIMEOUT
            .checked_sub(started.elapsed())
            .filter(|left| !left.is_zero())
            .ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the client did not read the answer in time",
                )
            })?;
        stream.set_write_timeout(Some(left))?;
        match stream.write(unsent) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(written) => unsent = &unsent[written..],
            Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
            Err(error) => return Err(error),
        }
    }
    Ok(())
}

/// After a refusal: ends the writing side and reads what the client still sends (at most
/// [`DRAIN_BYTES_MAX`] bytes, within the head's deadline) before closing, since closing over
/// unread bytes resets the connection and the client could lose the refusal.
fn drain(mut stream: TcpStream, accepted: Instant) -> std::io::Result<()> {
    stream.shutdown(std::net::Shutdown::Write)?;
    let mut scratch = [0_u8; 4096];
    let mut drained = 0;
    while drained < DRAIN_BYTES_MAX {
        let Ok(left) = time_left(accepted) else {
            break;
        };
        stream.set_read_timeout(Some(left))?;
        match stream.read(&mut scratch) {
            Ok(0) | Err(_) => break,
            Ok(read) => drained += read,
        }
    }
    Ok(())
}

/// Fetches `/stats` from a running server at `address` (HOST:PORT).
pub fn fetch_stats(address: &str) -> anyhow::Result<Value> {
    let mut stream = TcpStream::connect(address)
        .with_context(|| format!("cannot connect to the metrics endpoint {address}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    // An NBD server speaks first ("NBDMAGIC") and then drops the connection on our request, so
    // what arrived is kept even when the read ends in an error, to recognise it.
    // One write: a server that reads the request once and answers gets all of it, and
    // closing with none of it unread sends no reset that could cut its answer short.
    let request = format!("GET /stats HTTP/1.0\r\nHost: {address}\r\n\r\n");
    let sent = stream.write_all(request.as_bytes());
    let mut bytes = Vec::new();
    let received = stream.read_to_end(&mut bytes);
    if bytes.starts_with(b"NBDMAGIC") {
        anyhow::bail!(
            "{address} is an NBD port, not the metrics endpoint: start `bufcache serve --metrics HOST:PORT` and point stat at that address"
        );
    }
    sent.with_context(|| format!("sending the request to {address}"))?;
    received.with_context(|| format!("reading the answer from {address}"))?;
    let mut headers = [httparse::EMPTY_HEADER; HEADERS_MAX];
    let mut response = httparse::Response::new(&mut headers);
    let head_bytes = match response.parse(&bytes) {
        Ok(httparse::Status::Complete(head_bytes)) => head_bytes,
        _ => anyhow::bail!("malformed HTTP response from the metrics endpoint"),
    };
    if response.code != Some(200) {
        let status_line = bytes.split(|&byte| byte == b'\n').next().unwrap_or(b"");
        anyhow::bail!(
            "{address}/stats answered: {}",
            String::from_utf8_lossy(status_line).trim_end()
        );
    }
    let mut body = &bytes[head_bytes..];
    let length = response
        .headers
        .iter()
        .find(|header| header.name.eq_ignore_ascii_case("Content-Length"));
    if let Some(length) = length {
        let length: usize = std::str::from_utf8(length.value)
            .ok()
            .and_then(|value| value.trim().parse().ok())
            .context("malformed HTTP response from the metrics endpoint")?;
        anyhow::ensure!(
            body.len() >= length,
            "the metrics endpoint's answer ended after {} of its {length} bytes",
            body.len()
        );
        body = &body[..length];
    }
    serde_json::from_slice(body).context("the metrics endpoint sent invalid JSON")
}

#[cfg(test)]
mod tests {
    use super::*;

    const METRICS_BODY: &str = "bufcache_test_total 1\n";
    const STATS_BODY: &str = "{\"exports\":[],\"test\":1}";

    /// The endpoint on 127.0.0.1 port 0, its pages rendered from fixed bodies.
    fn endpoint() -> std::net::SocketAddr {
        let listener = bind("127.0.0.1:0").unwrap();
        serve(listener, |page| match page {
            Page::Metrics => METRICS_BODY.to_string(),
            Page::Stats => STATS_BODY.to_string(),
        })
        .unwrap()
    }

    /// Sends `request` and reads the whole answer (the server closes after answering).
    fn exchange(address: std::net::SocketAddr, request: &[u8]) -> String {
        let mut stream = TcpStream::connect(address).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        stream.write_all(request).unwrap();
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).unwrap();
        String::from_utf8(answer).unwrap()
    }

    #[test]
    fn a_slow_client_cannot_hold_the_endpoint_past_the_head_deadline() {
        // Goal: a client trickling its head one byte a second is cut off at the head's deadline,
        // so the single metrics thread answers the next scrape soon after.
        // Method: a thread sends "GET /metrics HTTP/1.0\r\n" then one header byte a second,
        // never finishing; a second client connected just after asks for /metrics and must be
        // answered within the deadline plus 1 s (plus slack for a loaded machine).
        let address = endpoint();
        let mut slow = TcpStream::connect(address).unwrap();
        let started = Instant::now();
        slow.write_all(b"GET /metrics HTTP/1.0\r\n").unwrap();
        let trickle = std::thread::spawn(move || {
            for _ in 0..12 {
                std::thread::sleep(Duration::from_secs(1));
                if slow.write_all(b"X").is_err() {
                    break;
                }
            }
        });
        std::thread::sleep(Duration::from_millis(200));
        let answer = exchange(address, b"GET /metrics HTTP/1.0\r\n\r\n");
        let waited = started.elapsed();
        assert!(answer.starts_with("HTTP/1.0 200 OK\r\n"), "{answer}");
        assert!(answer.ends_with(METRICS_BODY), "{answer}");
        assert!(
            waited >= HEAD_DEADLINE - Duration::from_millis(500),
            "the slow client was served first, so the scrape waited ({waited:?})"
        );
        assert!(
            waited <= HEAD_DEADLINE + Duration::from_secs(2),
            "the scrape waited {waited:?}, past the {HEAD_DEADLINE:?} head deadline"
        );
        trickle.join().unwrap();
    }

    #[test]
    fn a_client_that_does_not_read_cannot_hold_the_endpoint_past_the_write_deadline() {
        // Goal: an answer the client never reads is abandoned at WRITE_TIMEOUT in all, so the
        // next scrape is answered soon after.
        // Method: /metrics renders 32 MiB (more than loopback's socket buffers hold); a client
        // asks for it and never reads; a second client asks for /stats and must be answered
        // within WRITE_TIMEOUT plus 2 s.
        let listener = bind("127.0.0.1:0").unwrap();
        let address = serve(listener, |page| match page {
            Page::Metrics => "x".repeat(32 << 20),
            Page::Stats => STATS_BODY.to_string(),
        })
        .unwrap();
        let mut stuck = TcpStream::connect(address).unwrap();
        let started = Instant::now();
        stuck.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
        std::thread::sleep(Duration::from_millis(200));
        let answer = exchange(address, b"GET /stats HTTP/1.0\r\n\r\n");
        let waited = started.elapsed();
        assert!(answer.ends_with(STATS_BODY), "{answer}");
        assert!(
            waited >= WRITE_TIMEOUT - Duration::from_millis(500),
            "the stuck answer was not being written first ({waited:?})"
        );
        assert!(
            waited <= WRITE_TIMEOUT + Duration::from_secs(2),
            "the scrape waited {waited:?}, past the {WRITE_TIMEOUT:?} write deadline"
        );
        drop(stuck);
    }

    #[test]
    fn an_oversized_head_is_refused_and_the_next_scrape_is_answered() {
        // Goal: a head longer than HEAD_BYTES_MAX is refused with 431 without growing memory,
        // and the endpoint goes on serving.
        // Method: a request line followed by one 16 KiB header (no end of head); the answer's
        // status is 431; then a normal scrape of /stats gets the JSON.
        let address = endpoint();
        let mut request = b"GET /metrics HTTP/1.0\r\nX-Filler: ".to_vec();
        request.extend(std::iter::repeat_n(b'a', 16 * 1024));
        let answer = exchange(address, &request);
        assert!(
            answer.starts_with("HTTP/1.0 431 Request Header Fields Too Large\r\n"),
            "{answer}"
        );
        let answer = exchange(address, b"GET /stats HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(answer.starts_with("HTTP/1.0 200 OK\r\n"), "{answer}");
        assert!(
            answer.contains("Content-Type: application/json\r\n"),
            "{answer}"
        );
        assert!(answer.ends_with(STATS_BODY), "{answer}");
    }

    #[test]
    fn a_method_other_than_get_or_head_is_answered_405_with_allow() {
        // Goal: POST is refused as a method, naming the allowed ones.
        // Method: POST /metrics with a small body; the answer is 405 with `Allow: GET, HEAD`.
        let address = endpoint();
        let answer = exchange(
            address,
            b"POST /metrics HTTP/1.0\r\nContent-Length: 2\r\n\r\nhi",
        );
        assert!(
            answer.starts_with("HTTP/1.0 405 Method Not Allowed\r\n"),
            "{answer}"
        );
        assert!(answer.contains("\r\nAllow: GET, HEAD\r\n"), "{answer}");
    }

    #[test]
    fn head_answers_the_headers_of_get_without_the_body() {
        // Goal: HEAD gets GET's status and headers (Content-Length included) and no body.
        // Method: HEAD /metrics; the answer ends right after the blank line and announces the
        // length of the body GET would send.
        let address = endpoint();
        let answer = exchange(address, b"HEAD /metrics HTTP/1.0\r\n\r\n");
        assert!(answer.starts_with("HTTP/1.0 200 OK\r\n"), "{answer}");
        assert!(
            answer.contains("Content-Type: text/plain; version=0.0.4\r\n"),
            "{answer}"
        );
        assert!(
            answer.contains(&format!("Content-Length: {}\r\n", METRICS_BODY.len())),
            "{answer}"
        );
        assert!(answer.ends_with("Connection: close\r\n\r\n"), "{answer}");
    }

    #[test]
    fn a_query_string_is_ignored_and_an_unknown_path_is_404() {
        // Goal: `/metrics?x=1` is `/metrics` (curl users add queries); other paths keep the
        // 404 body of before.
        // Method: GET /metrics?x=1 is 200 with the metrics body; GET /other is 404 with
        // "try /metrics or /stats".
        let address = endpoint();
        let answer = exchange(address, b"GET /metrics?x=1 HTTP/1.0\r\n\r\n");
        assert!(answer.starts_with("HTTP/1.0 200 OK\r\n"), "{answer}");
        assert!(answer.ends_with(METRICS_BODY), "{answer}");
        let answer = exchange(address, b"GET /other HTTP/1.0\r\n\r\n");
        assert!(answer.starts_with("HTTP/1.0 404 Not Found\r\n"), "{answer}");
        assert!(
            answer.ends_with("\r\n\r\ntry /metrics or /stats\n"),
            "{answer}"
        );
    }

    #[test]
    fn a_malformed_request_line_is_answered_400() {
        // Goal: a line that is not an HTTP request line is refused as malformed.
        // Method: "hello there\r\n\r\n" gets 400 and the endpoint then answers /metrics.
        let address = endpoint();
        let answer = exchange(address, b"hello there\r\n\r\n");
        assert!(
            answer.starts_with("HTTP/1.0 400 Bad Request\r\n"),
            "{answer}"
        );
        let answer = exchange(address, b"GET /metrics HTTP/1.0\r\n\r\n");
        assert!(answer.starts_with("HTTP/1.0 200 OK\r\n"), "{answer}");
    }

    #[test]
    fn fetch_stats_reads_the_json_of_the_endpoint_and_names_a_refusal_status() {
        // Goal: `bufcache stat`'s client parses the endpoint's answer by its head and
        // Content-Length, and names the status line when it is not 200.
        // Method: fetch_stats against the endpoint returns the /stats document; against a
        // one-shot listener answering 404 the error names "404 Not Found".
        let address = endpoint();
        let stats = fetch_stats(&address.to_string()).unwrap();
        assert_eq!(stats["test"], 1);
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let other = listener.local_addr().unwrap();
        let refuser = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            // The whole head is read before answering: closing with request bytes unread
            // would reset the connection and could cut the answer short.
            let mut request = Vec::new();
            let mut piece = [0_u8; 1024];
            while !request.windows(4).any(|window| window == b"\r\n\r\n") {
                let read = stream.read(&mut piece).unwrap();
                assert!(read > 0, "the client sent its whole request head");
                request.extend_from_slice(&piece[..read]);
            }
            stream
                .write_all(b"HTTP/1.0 404 Not Found\r\nContent-Length: 4\r\n\r\nnope")
                .unwrap();
        });
        let error = fetch_stats(&other.to_string()).unwrap_err().to_string();
        assert_eq!(
            error,
            format!("{other}/stats answered: HTTP/1.0 404 Not Found")
        );
        refuser.join().unwrap();
    }

    #[test]
    fn buffer_waits_and_eviction_work_are_exposed_as_prometheus_counters_and_a_histogram() {
        // Goal: the names appear on /metrics with a well-formed cumulative histogram.
        // Method: a snapshot with 3 waits (two in the first bucket, one past the last bound)
        // rendered; the counters, buckets, sum and count are checked line by line.
        let mut stats = CacheStats {
            buffer_waits: 3,
            buffer_wait_ns: 12_000_000_000,
            eviction_candidates_examined: 42,
            ..CacheStats::default()
        };
        stats.buffer_wait_buckets[0] = 2;
        stats.buffer_wait_buckets[bufcache::BUFFER_WAIT_BUCKET_COUNT - 1] = 1;
        let mut text = Exposition::default();
        cache_prometheus(&mut text, &stats);
        let text = text.render();
        let lines: Vec<&str> = text.lines().collect();
        for expected in [
            "bufcache_buffer_waits_total 3",
            "bufcache_eviction_candidates_examined_total 42",
            "# TYPE bufcache_buffer_wait_seconds histogram",
            "bufcache_buffer_wait_seconds_bucket{le=\"0.0001\"} 2",
            "bufcache_buffer_wait_seconds_bucket{le=\"10\"} 2",
            "bufcache_buffer_wait_seconds_bucket{le=\"+Inf\"} 3",
            "bufcache_buffer_wait_seconds_sum 12.0",
            "bufcache_buffer_wait_seconds_count 3",
        ] {
            assert!(
                lines.contains(&expected),
                "missing `{expected}` in:\n{text}"
            );
        }
        let json = cache_json(&stats);
        assert_eq!(json["buffer_waits"], 3);
        assert_eq!(json["buffer_wait_seconds"], 12.0);
        assert_eq!(json["eviction_candidates_examined"], 42);
    }
}
