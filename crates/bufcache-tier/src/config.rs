//! `LocalTierConfig`: the tier's knobs, with documented defaults and `validate()`.

use std::time::Duration;

/// When a flush of the tier returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum FlushTo {
    /// Once the local log holds every write the flush covers, fsynced. Write-back to the
    /// remote goes on in the background, in epoch order. The default: a FLUSH costs a local
    /// fsync instead of a remote round trip, and the remote stays a consistent (possibly
    /// stale) image.
    #[default]
    Local,
    /// Once the remote holds every write the flush covers, flushed (the behaviour without a
    /// local tier); the local log still gives a warm read cache and restart replay.
    Remote,
}

/// Who runs the tier's write-back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum WritebackDriver {
    /// A background thread of the tier, which waits for closed epochs and retries failures
    /// after `writeback_retry_delay_initial` .. `writeback_retry_delay_max`. The default.
    #[default]
    Thread,
    /// Whoever holds the tier: nothing runs unless [`crate::LocalTier::writeback_step`] is
    /// called, or a flush or a write must wait for the remote (`--flush-to remote`, a full
    /// log), which then runs the steps itself, retrying at once (at most
    /// `writeback_attempts_max` failures in a row). No thread, no sleep and no wall clock:
    /// the simulator's deterministic mode (`bufcache sim check --local-tier`).
    Caller,
}

/// How a [`crate::LocalTier`] behaves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalTierConfig {
    /// Block size of the tier's index and records, in bytes: a power of two from 512 to
    /// 1 MiB that divides the backend's size. Default 4096.
    pub block_bytes: u32,
    /// The durability point of a flush. Default [`FlushTo::Local`].
    pub flush_to: FlushTo,
    /// Largest payload of one log record; longer writes become several records. A multiple
    /// of `block_bytes`. Default 1 MiB.
    pub record_bytes_max: u64,
    /// Remote writes write-back keeps in flight at once (one `submit_writes` batch). Default 16.
    pub writeback_requests_in_flight_max: usize,
    /// Largest remote write write-back builds from merged adjacent blocks (further capped by
    /// the remote's own `request_bytes_max`). A multiple of `block_bytes`. Default 1 MiB.
    pub writeback_run_bytes_max: u64,
    /// Failed write-back attempts in a row after which flushes that wait for the remote
    /// (`--flush-to remote`, a full log) return the remote's error instead of waiting.
    /// Write-back itself keeps retrying. Default 3.
    pub writeback_attempts_max: u32,
    /// Wait after the first failed write-back attempt; doubles per failure up to
    /// `writeback_retry_delay_max`. Default 50 ms.
    pub writeback_retry_delay_initial: Duration,
    /// Longest wait between write-back attempts. Default 5 s.
    pub writeback_retry_delay_max: Duration,
    /// Largest zeroing or discard kept as a log record; a longer one is written through to
    /// the remote (after everything logged before it). A multiple of `block_bytes`.
    /// Default 64 MiB.
    pub zero_record_bytes_max: u64,
    /// Who runs write-back. Default [`WritebackDriver::Thread`].
    pub writeback_driver: WritebackDriver,
    /// How long a write that found the log full of dirty data (so it must wait for the
    /// remote) waits while write-back makes no progress at all — no remote write, zeroing,
    /// discard or flush completing — before it fails with the remote's last error (EIO to an
    /// NBD client; the engine keeps the data dirty). Progress restarts the wait, so a slow
    /// remote that moves is waited for. Only with [`WritebackDriver::Thread`]. Default 10 s.
    pub remote_stall_max: Duration,
    /// What opening does when the log holds a damaged record (checksum mismatch) that a
    /// valid later record proves had been fsynced, so the damage is not a crash's torn write
    /// but corruption of the local device. False (the default): the open is refused with
    /// [`crate::TierError::DamagedRecord`], naming the record's offset, and nothing is
    /// replayed or written. True: the records before the damaged one are replayed and the
    /// rest of the log is discarded (its writes, flushed or not, are lost), with a warning.
    pub replay_damaged_prefix: bool,
    /// Clean blocks (read-cache copies, and writes whose epoch is on the remote) compared
    /// with the remote's bytes at every open, after the log is replayed in memory and before
    /// anything is written or served: spread evenly over the clean blocks the index holds.
    /// A clean block equals the remote's copy unless the remote is another disk, or was
    /// written around this cache since, so any mismatch refuses the open with
    /// [`crate::TierError::OtherContent`]. 0 turns the check off. Default 32.
    pub sampled_blocks_max: usize,
}

/// The most clean blocks an open may compare with the remote (each costs a remote read).
pub const SAMPLED_BLOCKS_LIMIT: usize = 4096;

impl Default for LocalTierConfig {
    fn default() -> Self {
        LocalTierConfig {
            block_bytes: 4096,
            flush_to: FlushTo::Local,
            record_bytes_max: 1 << 20,
            writeback_requests_in_flight_max: 16,
            writeback_run_bytes_max: 1 << 20,
            writeback_attempts_max: 3,
            writeback_retry_delay_initial: Duration::from_millis(50),
            writeback_retry_delay_max: Duration::from_secs(5),
            zero_record_bytes_max: 64 << 20,
            writeback_driver: WritebackDriver::Thread,
            remote_stall_max: Duration::from_secs(10),
            replay_damaged_prefix: false,
            sampled_blocks_max: 32,
        }
    }
}

/// Why a [`LocalTierConfig`] is refused. Each names the field and the value.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LocalTierConfigError {
    /// `block_bytes` is not a power of two from 512 to 1 MiB.
    #[error("local tier block_bytes {0} is invalid: must be a power of two from 512 to 1MiB")]
    BlockBytes(u32),
    /// A size field is zero or not a multiple of `block_bytes`.
    #[error("local tier {field} {value} is invalid: must be a positive multiple of block_bytes ({block_bytes})")]
    NotBlockMultiple {
        /// The field.
        field: &'static str,
        /// Its value.
        value: u64,
        /// The block size.
        block_bytes: u32,
    },
    /// A count is out of range.
    #[error("local tier {field} {value} is invalid: must be from 1 to {max}")]
    Count {
        /// The field.
        field: &'static str,
        /// Its value.
        value: u64,
        /// The largest accepted.
        max: u64,
    },
    /// `sampled_blocks_max` is above [`SAMPLED_BLOCKS_LIMIT`].
    #[error(
        "local tier sampled_blocks_max {0} is invalid: must be from 0 to {SAMPLED_BLOCKS_LIMIT}"
    )]
    SampledBlocks(usize),
    /// `remote_stall_max` is zero.
    #[error("local tier remote_stall_max {0:?} is invalid: must be above zero")]
    RemoteStallMax(Duration),
    /// The retry delays are zero or the initial one exceeds the largest.
    #[error("local tier write-back retry delays are invalid: initial {initial:?} must be above zero and at most the maximum {max:?}")]
    RetryDelay {
        /// The initial delay.
        initial: Duration,
        /// The largest delay.
        max: Duration,
    },
}

impl LocalTierConfig {
    /// Checks every field.
    pub fn validate(&self) -> Result<(), LocalTierConfigError> {
        if !self.block_bytes.is_power_of_two() || !(512..=1 << 20).contains(&self.block_bytes) {
            return Err(LocalTierConfigError::BlockBytes(self.block_bytes));
        }
        let block = u64::from(self.block_bytes);
        for (field, value) in [
            ("record_bytes_max", self.record_bytes_max),
            ("writeback_run_bytes_max", self.writeback_run_bytes_max),
            ("zero_record_bytes_max", self.zero_record_bytes_max),
        ] {
            if value == 0 || value % block != 0 || value > u64::from(u32::MAX) / 2 {
                return Err(LocalTierConfigError::NotBlockMultiple {
                    field,
                    value,
                    block_bytes: self.block_bytes,
                });
            }
        }
        for (field, value, max) in [
            (
                "writeback_requests_in_flight_max",
                self.writeback_requests_in_flight_max as u64,
                1024,
            ),
            (
                "writeback_attempts_max",
                u64::from(self.writeback_attempts_max),
                1000,
            ),
        ] {
            if value == 0 || value > max {
                return Err(LocalTierConfigError::Count { field, value, max });
            }
        }
        if self.sampled_blocks_max > SAMPLED_BLOCKS_LIMIT {
            return Err(LocalTierConfigError::SampledBlocks(self.sampled_blocks_max));
        }
        if self.writeback_retry_delay_initial.is_zero()
            || self.writeback_retry_delay_initial > self.writeback_retry_delay_max
        {
            return Err(LocalTierConfigError::RetryDelay {
                initial: self.writeback_retry_delay_initial,
                max: self.writeback_retry_delay_max,
            });
        }
        if self.remote_stall_max.is_zero() {
            return Err(LocalTierConfigError::RemoteStallMax(self.remote_stall_max));
        }
        Ok(())
    }
}
