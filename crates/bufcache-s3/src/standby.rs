//! A warm standby (`serve --standby`, docs/s3.md "Standby"): while another server writes a
//! log-layout disk, the standby follows the log as a read replica does (module `replica`:
//! the newest durable view, refreshed every `follow`), so a cache over it holds only what the
//! writer made durable and drops each range a refresh maps anew. When the writer's lease lapses
//! the standby's writable open (made elsewhere, waiting in [`crate::S3Device::open_locked_watching`])
//! takes the disk with a new epoch and recovers it; [`Standby::take_over`] then swaps that open
//! in under the same device and names the ranges the recovered log maps differently from the
//! last view followed, so the cache above keeps every block that still reads the same.
//!
//! Invariant: before the takeover every read is served from a replica view (durable data only)
//! and every write is refused; after it, every request goes to the writer's open.

use std::io::{self, IoSlice, IoSliceMut};
use std::sync::{Arc, OnceLock};

use bufcache_device::{Capabilities, Device, Extent};

use crate::error::OpenError;
use crate::lease::LeaseSeen;
use crate::meters::StoreMeters;
use crate::replica::{changed_ranges, Replica};
use crate::url::S3Url;
use crate::S3Device;

/// The longest default refresh period of a standby's view, in milliseconds.
pub const STANDBY_FOLLOW_MS_MAX: u64 = 5_000;
/// The shortest default refresh period of a standby's view, in milliseconds.
pub const STANDBY_FOLLOW_MS_MIN: u64 = 1_000;

/// How many times a standby opens its first view when an object it listed went missing.
const FOLLOW_OPEN_ATTEMPTS: u32 = 5;

/// How often a standby refreshes its view without `follow=` in its URL: half the lease,
/// within [`STANDBY_FOLLOW_MS_MIN`] and [`STANDBY_FOLLOW_MS_MAX`].
pub fn follow_ms_default(lease_ms: u64) -> u64 {
    (lease_ms / 2).clamp(STANDBY_FOLLOW_MS_MIN, STANDBY_FOLLOW_MS_MAX)
}

/// A standby's device: a replica view until [`Standby::take_over`], the writer's open after.
pub struct Standby {
    follower: S3Device,
    writer: OnceLock<Arc<S3Device>>,
    lease_seen: Arc<LeaseSeen>,
}

impl Standby {
    /// Starts following the log-layout disk `url` names (the writer's URL; its `follow=`, if
    /// any, sets the refresh period, else [`follow_ms_default`]). Nothing is written. Every
    /// request is counted in `meters`.
    pub fn follow(url: &S3Url, meters: Arc<StoreMeters>) -> Result<Standby, OpenError> {
        let lease_ms = url.lease_ms.ok_or_else(|| OpenError::Config {
            url: url.to_string(),
            reason:
                "a standby takes the disk when the writer's lease lapses, and lease=off has none"
                    .to_string(),
        })?;
        let mut follow_url = url.clone();
        follow_url.standby = false;
        follow_url.follow_ms = Some(url.follow_ms.unwrap_or_else(|| follow_ms_default(lease_ms)));
        // The writer's collector and checkpoints delete segments: one listed by this open may
        // be gone by the time it is read, and a fresh listing no longer names it.
        let mut attempts_left = FOLLOW_OPEN_ATTEMPTS;
        let follower = loop {
            attempts_left -= 1;
            match S3Device::open_read_only_counted(&follow_url, Arc::clone(&meters)) {
                Ok(follower) => break follower,
                Err(error @ OpenError::Config { .. }) => return Err(error),
                Err(error) if attempts_left == 0 => return Err(error),
                Err(error) => {
                    tracing::info!(disk = %url, "opening the standby's view again: {error}");
                }
            }
        };
        Ok(Standby {
            follower,
            writer: OnceLock::new(),
            lease_seen: Arc::new(LeaseSeen::new()),
        })
    }

    /// The URL of the writable open that waits for the lease: the standby's own, without
    /// `follow=` (a writer does not follow).
    pub fn writer_url(url: &S3Url) -> S3Url {
        let mut writer_url = url.clone();
        writer_url.follow_ms = None;
        writer_url.standby = true;
        writer_url
    }

    /// What the waiting open tells of each renewal of the writer's lease it sees.
    pub fn lease_seen(&self) -> Arc<LeaseSeen> {
        Arc::clone(&self.lease_seen)
    }

    /// The replica view followed until the takeover.
    pub fn replica(&self) -> &Arc<Replica> {
        self.follower
            .replica()
            .expect("a standby's follower is opened as a replica")
    }

    /// The writer's open, once taken over.
    pub fn writer(&self) -> Option<&Arc<S3Device>> {
        self.writer.get()
    }

    /// The device requests go to now.
    pub fn current(&self) -> &S3Device {
        self.writer.get().map_or(&self.follower, |writer| writer)
    }

    /// `standby` until the takeover, `writer` after.
    pub fn role(&self) -> &'static str {
        if self.writer.get().is_some() {
            "writer"
        } else {
            "standby"
        }
    }

    /// Seconds since the writer's lease was last renewed: as this standby saw the lock change
    /// while it waits (None before its first look), this server's own lease once it writes.
    pub fn lease_age_seconds(&self) -> Option<f64> {
        match self.writer.get() {
            Some(writer) => writer.lease().map(|lease| lease.age_ns() as f64 / 1e9),
            None => self.lease_seen.age_seconds(),
        }
    }

    /// Disk ranges (offset, length) the current view maps, newest segment first, up to
    /// `bytes_max` bytes in all (the last one cut short): what the writer wrote most recently,
    /// which a standby reads into its cache first.
    pub fn newest_written(&self, bytes_max: u64) -> Vec<(u64, u64)> {
        let mut entries = self.replica().current().index_entries();
        entries.sort_by_key(|&(offset, _, segment, object_offset)| {
            (
                std::cmp::Reverse(segment),
                std::cmp::Reverse(object_offset),
                offset,
            )
        });
        let mut left = bytes_max;
        let mut ranges = Vec::new();
        for (offset, length, _, _) in entries {
            if left == 0 {
                break;
            }
            let taken = length.min(left);
            ranges.push((offset, taken));
            left -= taken;
        }
        ranges
    }

    /// Swaps the writer's open in (every request from now on goes to it), stops following,
    /// and returns the disk ranges (offset, length) the writer's recovered log maps
    /// differently from the last view followed: a cache over this device must drop its clean
    /// copies of them before anyone writes.
    pub fn take_over(&self, writer: S3Device) -> Vec<(u64, u64)> {
        let writer = self.writer.get_or_init(|| Arc::new(writer));
        let replica = self.replica();
        let mut changed = replica.stop_and_wait();
        let followed = replica.current().index_entries();
        let recovered = writer
            .log_store()
            .map(|store| store.index_entries())
            .unwrap_or_default();
        changed.extend(changed_ranges(&followed, &recovered));
        changed
    }
}

impl Device for Standby {
    fn read_vectored_at(&self, buffers: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<()> {
        self.current().read_vectored_at(buffers, offset)
    }

    fn write_vectored_at(&self, buffers: &[IoSlice<'_>], offset: u64) -> io::Result<()> {
        self.current().write_vectored_at(buffers, offset)
    }

    fn submit_writes(&self, writes: Vec<bufcache_device::WriteRequest>) {
        self.current().submit_writes(writes)
    }

    fn submit_reads(&self, reads: Vec<bufcache_device::ReadRequest>) {
        self.current().submit_reads(reads)
    }

    fn flush(&self) -> io::Result<()> {
        self.current().flush()
    }

    fn discard(&self, offset: u64, length: u64) -> io::Result<()> {
        self.current().discard(offset, length)
    }

    fn write_zeroes(&self, offset: u64, length: u64) -> io::Result<()> {
        self.current().write_zeroes(offset, length)
    }

    fn extents(&self, offset: u64, length: u64) -> io::Result<Vec<Extent>> {
        self.current().extents(offset, length)
    }

    /// The writer's capabilities from the start (a cache object over this device is opened
    /// writable once, before the takeover): writes before it are refused by the replica view,
    /// and the server does not serve clients until then.
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            read_only: false,
            ..self.current().capabilities()
        }
    }

    fn describe(&self) -> String {
        self.current().describe()
    }
}
