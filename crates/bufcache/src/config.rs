//! `CacheConfig`: every knob of the engine, its documented default, and its validation.
//!
//! The vocabulary follows the BSD names the seeds use: `buffer_bytes_max` is MAXBSIZE,
//! `transfer_bytes_max` is MAXPHYS, `cluster_bytes_max` is the cluster limit
//! (maxcontig × block size), `buffers_max` is NBUF and `memory_bytes_max` is BUFPAGES × page
//! size. `validate` checks each value's range and the relations between them and names the
//! field and the allowed range in its error.

use std::fmt;
use std::time::Duration;

pub use bufcache_device::size::{format_size, parse_size, SizeParseError};
use bufcache_policy::{PolicyKind, PolicyParameters};

/// A configuration value outside its allowed range, or two values that contradict each other.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// One field's value is out of range.
    #[error("{field} = {value} is invalid: {allowed}")]
    OutOfRange {
        /// The field, as named in configuration files and `--flags` (with `_` for `-`).
        field: &'static str,
        /// The value given, formatted.
        value: String,
        /// The allowed range in words.
        allowed: String,
    },
    /// Two fields contradict each other.
    #[error("{field} = {value} conflicts with {other_field} = {other_value}: {rule}")]
    Conflict {
        /// The field that must change.
        field: &'static str,
        /// Its value, formatted.
        value: String,
        /// The field it is checked against.
        other_field: &'static str,
        /// That field's value, formatted.
        other_value: String,
        /// The rule, in words.
        rule: &'static str,
    },
}

/// The engine's configuration. `CacheConfig::default()` holds the documented defaults.
#[derive(Clone, Debug, PartialEq)]
pub struct CacheConfig {
    /// Memory is charged to buffers in whole pages of this size. Default 4 KiB. Power of two,
    /// 512 B to 64 KiB.
    pub page_size_bytes: u64,
    /// Largest buffer (MAXBSIZE): no object may use a larger block. Default 64 KiB; a multiple
    /// of 512 from 512 B to 16 MiB.
    pub buffer_bytes_max: u64,
    /// Largest single device request (MAXPHYS). Default 1 MiB; 4 KiB to 256 MiB.
    pub transfer_bytes_max: u64,
    /// Largest clustered read or write (maxcontig × block size). Default 1 MiB (= the default
    /// transfer size); 16 KiB reproduces the 1995 kernel of seed 000. At most
    /// `transfer_bytes_max`; at least one block.
    pub cluster_bytes_max: u64,
    /// Memory for buffer data (BUFPAGES × page size). Default 256 MiB; at least one buffer.
    pub memory_bytes_max: u64,
    /// Buffer headers (NBUF). Default 65,536; at least 1.
    pub buffers_max: u64,
    /// Read-ahead window limit per stream. Default 1 MiB; 0 turns read-ahead off.
    pub readahead_bytes_max: u64,
    /// Read-ahead window limit for a stream whose reader had to wait for read-ahead still in
    /// flight — the sign of a device with a per-request latency the window does not cover.
    /// Each such wait doubles that stream's limit, from `readahead_bytes_max` up to this,
    /// so enough cluster-sized requests are in flight to cover bandwidth × latency. Default
    /// 16 MiB; at least `readahead_bytes_max`, at most 1 GiB.
    pub readahead_latency_bytes_max: u64,
    /// Read-ahead window of a newly detected sequential stream. Default 16 KiB; grows ×4 per
    /// window up to `readahead_bytes_max`.
    pub readahead_size_initial_bytes: u64,
    /// Sequential streams remembered per object. Default 8 (nbdcopy uses 4 connections).
    pub streams_per_object_max: usize,
    /// Place blocks of long sequential streams at the eviction end (seed 003's "don't need").
    /// Default true.
    pub noreuse_sequential: bool,
    /// Replacement policy. Default S3-FIFO (chosen by measurement: docs/policies.md).
    pub policy: PolicyKind,
    /// Parameters of the replacement policy (S3-FIFO queue ratios, 2Q's Kin and Kout, CLOCK
    /// bits). Default: libCacheSim's defaults.
    pub policy_parameters: PolicyParameters,
    /// Dirty data older than this is written back by the background writer. Default 30 s.
    pub dirty_age_max: Duration,
    /// Dirty share of `memory_bytes_max` at which background writeback starts. Default 25 %.
    pub dirty_background_percent: u8,
    /// Dirty share of `memory_bytes_max` above which writers write back themselves before
    /// continuing (throttling). Default 50 %. Above `dirty_background_percent`, at most 90.
    pub dirty_limit_percent: u8,
    /// Write completed clusters back before they age (write-behind): a background job starts
    /// once 4 MiB of an object's completed clusters (or 1/16 of the memory limit) is queued;
    /// whatever never makes a batch goes at the next `writeback_tick`. A write whose every
    /// block write-behind already wrote once (hot data rewritten) is not written behind while
    /// dirty data is under `dirty_background_percent`: its rewrites are absorbed until a
    /// flush, the age limit or the threshold. Default true.
    pub write_behind: bool,
    /// Ask the kernel for transparent huge pages for buffer memory. A cache then fills for the
    /// first time with one page fault per 2 MiB instead of per 4 KiB (measured: cold
    /// sequential 4K reads over a slow upstream twice as fast), at the price of possible
    /// compaction stalls and of huge pages taken from never-touched memory. Default false.
    pub huge_pages: bool,
    /// How long an allocation waits for space when everything is pinned or dirty and cannot be
    /// written before it fails with `CacheError::NoSpace`. Default 30 s; 0 fails at once.
    pub space_wait_max: Duration,
    /// Lock shards of the buffer table (rounded up to a power of two). Default 64; 1 to 4096.
    pub shards: usize,
    /// Background jobs (read-ahead, write-behind) that may wait for a worker. Default 64.
    pub background_jobs_queued_max: usize,
    /// Write-back requests at one device at once, at most. Over a device that serves many
    /// requests at once (`Capabilities::inflight_requests_max` above 1: an NBD upstream, an
    /// object store) write-back also takes at most a quarter of those, so a read miss finds
    /// slots free and waits behind no more than this share. Default 16; 1 to 1024.
    pub writeback_inflight_max: usize,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            page_size_bytes: 4096,
            buffer_bytes_max: 64 << 10,
            transfer_bytes_max: 1 << 20,
            cluster_bytes_max: 1 << 20,
            memory_bytes_max: 256 << 20,
            buffers_max: 65_536,
            readahead_bytes_max: 1 << 20,
            readahead_size_initial_bytes: 16 << 10,
            readahead_latency_bytes_max: 16 << 20,
            streams_per_object_max: 8,
            noreuse_sequential: true,
            policy: PolicyKind::S3Fifo,
            policy_parameters: PolicyParameters::default(),
            dirty_age_max: Duration::from_secs(30),
            dirty_background_percent: 25,
            dirty_limit_percent: 50,
            write_behind: true,
            huge_pages: false,
            space_wait_max: Duration::from_secs(30),
            shards: 64,
            background_jobs_queued_max: 64,
            writeback_inflight_max: 16,
        }
    }
}

fn out_of_range(field: &'static str, value: impl fmt::Display, allowed: &str) -> ConfigError {
    ConfigError::OutOfRange {
        field,
        value: value.to_string(),
        allowed: allowed.to_string(),
    }
}

fn check_size(
    field: &'static str,
    value: u64,
    minimum: u64,
    maximum: u64,
    multiple: u64,
) -> Result<(), ConfigError> {
    if value < minimum || value > maximum || !value.is_multiple_of(multiple) {
        return Err(out_of_range(
            field,
            format_size(value),
            &format!(
                "must be a multiple of {} from {} to {}",
                format_size(multiple),
                format_size(minimum),
                format_size(maximum)
            ),
        ));
    }
    Ok(())
}

impl CacheConfig {
    /// Checks every field and the relations between them.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Err(error) = self.policy_parameters.validate() {
            return Err(ConfigError::OutOfRange {
                field: error.name,
                value: error.value,
                allowed: error.expected.to_string(),
            });
        }
        if !self.page_size_bytes.is_power_of_two() || !(512..=65536).contains(&self.page_size_bytes)
        {
            return Err(out_of_range(
                "page_size",
                format_size(self.page_size_bytes),
                "must be a power of two from 512B to 64KiB",
            ));
        }
        check_size("buffer_size_max", self.buffer_bytes_max, 512, 16 << 20, 512)?;
        check_size(
            "transfer_size_max",
            self.transfer_bytes_max,
            4096,
            256 << 20,
            512,
        )?;
        check_size(
            "cluster_size_max",
            self.cluster_bytes_max,
            512,
            256 << 20,
            512,
        )?;
        if self.cluster_bytes_max > self.transfer_bytes_max {
            return Err(self.conflict(
                "cluster_size_max",
                self.cluster_bytes_max,
                "transfer_size_max",
                self.transfer_bytes_max,
                "a cluster is one device request, so it cannot exceed the largest request",
            ));
        }
        if self.buffer_bytes_max > self.transfer_bytes_max {
            return Err(self.conflict(
                "buffer_size_max",
                self.buffer_bytes_max,
                "transfer_size_max",
                self.transfer_bytes_max,
                "one buffer must fit in one device request",
            ));
        }
        let page_rounded_buffer = self.buffer_bytes_max.next_multiple_of(self.page_size_bytes);
        if self.memory_bytes_max < page_rounded_buffer {
            return Err(self.conflict(
                "memory_bytes_max",
                self.memory_bytes_max,
                "buffer_size_max",
                self.buffer_bytes_max,
                "the cache must hold at least one buffer of the largest size",
            ));
        }
        if self.buffers_max == 0 || self.buffers_max > 1 << 31 {
            return Err(out_of_range(
                "buffers_max",
                self.buffers_max,
                "must be from 1 to 2^31",
            ));
        }
        if self.readahead_bytes_max > 1 << 30 {
            return Err(out_of_range(
                "readahead_size_max",
                format_size(self.readahead_bytes_max),
                "must be at most 1GiB (0 turns read-ahead off)",
            ));
        }
        if self.readahead_latency_bytes_max < self.readahead_bytes_max
            || self.readahead_latency_bytes_max > 1 << 30
        {
            return Err(out_of_range(
                "readahead_latency_size_max",
                format_size(self.readahead_latency_bytes_max),
                &format!(
                    "must be from readahead_size_max ({}) to 1GiB",
                    format_size(self.readahead_bytes_max)
                ),
            ));
        }
        if self.readahead_size_initial_bytes == 0 {
            return Err(out_of_range(
                "readahead_size_initial",
                0,
                "must be at least 1 byte",
            ));
        }
        if !(1..=1024).contains(&self.writeback_inflight_max) {
            return Err(out_of_range(
                "writeback_inflight_max",
                self.writeback_inflight_max,
                "must be from 1 to 1024",
            ));
        }
        if !(1..=64).contains(&self.streams_per_object_max) {
            return Err(out_of_range(
                "streams_per_object_max",
                self.streams_per_object_max,
                "must be from 1 to 64",
            ));
        }
        if !(1..=90).contains(&self.dirty_limit_percent) {
            return Err(out_of_range(
                "dirty_limit_percent",
                self.dirty_limit_percent,
                "must be from 1 to 90",
            ));
        }
        if self.dirty_background_percent == 0
            || self.dirty_background_percent > self.dirty_limit_percent
        {
            return Err(ConfigError::Conflict {
                field: "dirty_background_percent",
                value: self.dirty_background_percent.to_string(),
                other_field: "dirty_limit_percent",
                other_value: self.dirty_limit_percent.to_string(),
                rule: "background writeback must start (at least 1 %) no later than writers are throttled",
            });
        }
        if !(1..=4096).contains(&self.shards) {
            return Err(out_of_range(
                "shards",
                self.shards,
                "must be from 1 to 4096",
            ));
        }
        if self.background_jobs_queued_max == 0 {
            return Err(out_of_range(
                "background_jobs_queued_max",
                0,
                "must be at least 1",
            ));
        }
        Ok(())
    }

    fn conflict(
        &self,
        field: &'static str,
        value: u64,
        other_field: &'static str,
        other_value: u64,
        rule: &'static str,
    ) -> ConfigError {
        ConfigError::Conflict {
            field,
            value: format_size(value),
            other_field,
            other_value: format_size(other_value),
            rule,
        }
    }

    /// Memory charged for a buffer of `size_bytes`: whole pages.
    pub fn charge_bytes(&self, size_bytes: u64) -> u64 {
        size_bytes.next_multiple_of(self.page_size_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Goal: a policy parameter out of range is refused by the engine's own validation,
    /// naming the parameter as its flag is spelled. Method: validate a config with each bad.
    #[test]
    fn policy_parameters_out_of_range_are_refused_by_name() {
        let mut config = CacheConfig::default();
        config.policy_parameters.s3fifo_small_queue_ratio = 1.5;
        let error = config.validate().unwrap_err().to_string();
        assert!(error.contains("s3fifo-small-queue-ratio"), "{error}");
        let mut config = CacheConfig::default();
        config.policy_parameters.clock_bits = 0;
        let error = config.validate().unwrap_err().to_string();
        assert!(error.contains("clock-bits"), "{error}");
    }

    #[test]
    fn defaults_are_valid_and_relations_are_checked() {
        CacheConfig::default().validate().unwrap();
        let config = CacheConfig {
            cluster_bytes_max: 2 << 20,
            ..CacheConfig::default()
        };
        let error = config.validate().unwrap_err().to_string();
        assert!(
            error.contains("cluster_size_max") && error.contains("transfer_size_max"),
            "{error}"
        );
        let config = CacheConfig {
            buffer_bytes_max: 1000,
            ..CacheConfig::default()
        };
        assert!(config
            .validate()
            .unwrap_err()
            .to_string()
            .contains("buffer_size_max"));
    }
}
