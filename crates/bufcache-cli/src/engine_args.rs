//! The engine's knobs as command-line flags, shared by every subcommand that builds a cache.
//!
//! Each flag maps to one `CacheConfig` field; sizes take binary units (`4k`, `64KiB`, `1M`).
//! Validation is the engine's own (`CacheConfig::validate`), so the error names the field.

use std::time::Duration;

use anyhow::Context;
use std::sync::Arc;

use bufcache::{
    parse_size, CacheConfig, ConfigError, Device, IoQueue, IoQueueConfig, PolicyKind, QueueMode,
};
use clap::Args;

fn size(text: &str) -> Result<u64, String> {
    parse_size(text).map_err(|error| error.to_string())
}

/// Engine configuration flags.
#[derive(Args, Clone, Debug, Default)]
pub struct EngineArgs {
    /// Memory for cached data (BUFPAGES). Default 256MiB.
    #[arg(long = "cache-size", value_name = "SIZE", value_parser = size)]
    pub cache_size: Option<u64>,
    /// Buffer headers (NBUF). Default 65536.
    #[arg(long, value_name = "COUNT")]
    pub buffers_max: Option<u64>,
    /// Block size of objects (buffer size). Default 4k.
    #[arg(long, value_name = "SIZE", value_parser = size)]
    pub block_size: Option<u64>,
    /// Largest buffer (MAXBSIZE). Default 64k.
    #[arg(long, value_name = "SIZE", value_parser = size)]
    pub buffer_size_max: Option<u64>,
    /// Largest device request (MAXPHYS). Default 1M.
    #[arg(long, value_name = "SIZE", value_parser = size)]
    pub transfer_size_max: Option<u64>,
    /// Largest clustered read or write. Default = transfer size max; 16k is the 1995 kernel.
    #[arg(long, value_name = "SIZE", value_parser = size)]
    pub cluster_size_max: Option<u64>,
    /// Largest read-ahead window per stream; 0 turns read-ahead off. Default 1M.
    #[arg(long, value_name = "SIZE", value_parser = size)]
    pub readahead_size_max: Option<u64>,
    /// Largest read-ahead window of a stream whose reader waits for read-ahead in flight
    /// (a high-latency backend): each wait doubles that stream's window, up to this. Default
    /// 16M (raised to --readahead-size-max when that is larger).
    #[arg(long, value_name = "SIZE", value_parser = size)]
    pub readahead_latency_size_max: Option<u64>,
    /// Replacement policy.
    #[arg(long, value_name = "POLICY")]
    pub policy: Option<PolicyKind>,
    /// Do not place long sequential streams at the eviction end.
    #[arg(long)]
    pub no_noreuse: bool,
    /// Seconds before dirty data is written back. Default 30.
    #[arg(long, value_name = "SECONDS")]
    pub dirty_age_max: Option<f64>,
    /// Dirty share of memory where background write-back starts. Default 25.
    #[arg(long, value_name = "PERCENT")]
    pub dirty_background_percent: Option<u8>,
    /// Dirty share of memory above which writers are throttled. Default 50.
    #[arg(long, value_name = "PERCENT")]
    pub dirty_limit_percent: Option<u8>,
    /// Do not write completed clusters back early (write-behind, in 4 MiB batches).
    #[arg(long)]
    pub no_write_behind: bool,
    /// Ask for transparent huge pages for buffer memory: a faster first fill, at the risk of
    /// compaction stalls. Default off.
    #[arg(long)]
    pub huge_pages: bool,
    /// Io queue below the cache: none, fifo or elevator (sort and merge). Default elevator in
    /// `serve`; `sim run` puts no queue in without this flag.
    #[arg(long, value_name = "MODE")]
    pub io_queue: Option<QueueMode>,
    /// Requests the io queue keeps at the device at once. Default 32 in `serve`; in `sim run`,
    /// what the modelled drive accepts (1 for a mechanical disk).
    #[arg(long, value_name = "COUNT")]
    pub io_queue_depth: Option<usize>,
    /// Do not merge adjacent requests in the io queue.
    #[arg(long)]
    pub no_io_merge: bool,
    /// Read batches the io queue sends ahead of waiting writes before it sends a write again
    /// (a read has a client waiting; write-back does not). 0 keeps the plain sweep order.
    /// Default 8.
    #[arg(long, value_name = "COUNT")]
    pub io_queue_read_batches_ahead_max: Option<usize>,
    /// Write-back requests at one backend at once, at most. Over an upstream or object store
    /// write-back also takes at most a quarter of the requests the backend serves at once, so a
    /// read miss waits behind no more than this. Default 16.
    #[arg(long, value_name = "COUNT")]
    pub writeback_inflight_max: Option<usize>,
    /// Parameters of the replacement policy (last: clap puts them under their own heading).
    #[command(flatten)]
    pub policy_parameters: crate::replay::PolicyParameterArgs,
}

impl EngineArgs {
    /// The configuration these flags describe, validated.
    pub fn config(&self) -> anyhow::Result<CacheConfig> {
        let mut config = CacheConfig::default();
        if let Some(value) = self.cache_size {
            config.memory_bytes_max = value;
            if self.buffers_max.is_none() {
                config.buffers_max = (value / config.page_size_bytes).max(1);
            }
        }
        if let Some(value) = self.buffers_max {
            config.buffers_max = value;
        }
        if let Some(value) = self.buffer_size_max {
            config.buffer_bytes_max = value;
        }
        if let Some(value) = self.transfer_size_max {
            config.transfer_bytes_max = value;
            if self.cluster_size_max.is_none() {
                config.cluster_bytes_max = value;
            }
        }
        if let Some(value) = self.cluster_size_max {
            config.cluster_bytes_max = value;
        }
        if let Some(value) = self.readahead_size_max {
            config.readahead_bytes_max = value;
            config.readahead_latency_bytes_max = config.readahead_latency_bytes_max.max(value);
        }
        if let Some(value) = self.readahead_latency_size_max {
            config.readahead_latency_bytes_max = value;
        }
        if let Some(value) = self.policy {
            config.policy = value;
        }
        config.policy_parameters = self.policy_parameters.parameters()?;
        config.noreuse_sequential = !self.no_noreuse;
        if let Some(seconds) = self.dirty_age_max {
            if !(0.0..=86_400.0).contains(&seconds) {
                anyhow::bail!(
                    "--dirty-age-max {seconds} is invalid: must be from 0 to 86400 seconds"
                );
            }
            config.dirty_age_max = Duration::from_secs_f64(seconds);
        }
        if let Some(value) = self.dirty_background_percent {
            config.dirty_background_percent = value;
        }
        if let Some(value) = self.dirty_limit_percent {
            config.dirty_limit_percent = value;
        }
        config.write_behind = !self.no_write_behind;
        config.huge_pages = self.huge_pages;
        if let Some(value) = self.writeback_inflight_max {
            config.writeback_inflight_max = value;
        }
        config
            .validate()
            .map_err(|error| anyhow::anyhow!(flag_error(&error)))?;
        Ok(config)
    }

    /// The object block size (default 4 KiB), checked against the configuration.
    pub fn block_size_bytes(&self, config: &CacheConfig) -> anyhow::Result<u32> {
        let block_size = self.block_size.unwrap_or(4096);
        let given = if self.block_size.is_some() {
            ""
        } else {
            " (the default)"
        };
        if block_size == 0
            || !block_size.is_multiple_of(512)
            || block_size > config.buffer_bytes_max
        {
            anyhow::bail!(
                "--block-size {block_size}{given} is invalid: must be a multiple of 512 up to --buffer-size-max ({})",
                config.buffer_bytes_max
            );
        }
        Ok(block_size as u32)
    }
}

/// An io queue over a shared device, kept for its statistics.
pub type SharedQueue = Arc<IoQueue<Arc<dyn Device>>>;

impl EngineArgs {
    /// The io queue these flags describe, checked; None when they ask for no queue.
    pub fn queue_config(&self, config: &CacheConfig) -> anyhow::Result<Option<IoQueueConfig>> {
        let mut queue = IoQueueConfig {
            transfer_bytes_max: config.transfer_bytes_max,
            ..IoQueueConfig::default()
        };
        if let Some(mode) = self.io_queue {
            queue.mode = mode;
        }
        if let Some(depth) = self.io_queue_depth {
            queue.depth_max = depth;
        }
        if let Some(read_batches) = self.io_queue_read_batches_ahead_max {
            queue.read_batches_ahead_max = read_batches;
        }
        queue.merge = !self.no_io_merge;
        if queue.mode == QueueMode::None {
            return Ok(None);
        }
        queue.validate().context("invalid io queue configuration")?;
        Ok(Some(queue))
    }

    /// Puts the io queue these flags describe between the cache and `device`; returns the
    /// device the cache should use and the queue (for its statistics), if there is one.
    pub fn queue_device(
        &self,
        device: Arc<dyn Device>,
        config: &CacheConfig,
    ) -> anyhow::Result<(Arc<dyn Device>, Option<SharedQueue>)> {
        let Some(queue) = self.queue_config(config)? else {
            return Ok((device, None));
        };
        let queue =
            Arc::new(IoQueue::new(device, queue).context("invalid io queue configuration")?);
        Ok((Arc::clone(&queue) as Arc<dyn Device>, Some(queue)))
    }
}

/// The command-line flag that sets an engine configuration field.
fn flag_name(field: &str) -> String {
    match field {
        "memory_bytes_max" => "--cache-size".to_string(),
        other => format!("--{}", other.replace('_', "-")),
    }
}

/// An engine configuration error, reworded in terms of the flags the user typed.
fn flag_error(error: &ConfigError) -> String {
    match error {
        ConfigError::OutOfRange {
            field,
            value,
            allowed,
        } => {
            format!("{} {value} is invalid: {allowed}", flag_name(field))
        }
        ConfigError::Conflict {
            field,
            value,
            other_field,
            other_value,
            rule,
        } => format!(
            "{} {value} conflicts with {} {other_value}: {rule}",
            flag_name(field),
            flag_name(other_field)
        ),
    }
}
