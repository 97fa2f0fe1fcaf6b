//! A read replica of a log-layout disk (`serve -r` with `follow=SECONDS` in the URL): it never
//! takes the lock, serves the newest checkpoint plus the durable segments after it (what a
//! read-only open recovers), and every `follow` seconds opens the log again and swaps the new
//! view in, telling its cache which disk ranges now read differently (docs/s3.md, "Read
//! replicas").
//!
//! What it serves is always a state the store held: the segments the writer made durable, in
//! log order up to the first one missing. That includes every write a FLUSH acknowledged before
//! the refresh started listing, and may include writes the writer's cache wrote back before a
//! FLUSH (as a disk may hold writes no FLUSH covered yet); it never includes a write that was
//! only in the writer's memory.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock, Weak};
use std::time::Duration;

use bufcache_device::Clock;

use crate::error::{OpenError, StoreError};
use crate::lease::MonotonicClock;
use crate::log::{LogConfig, LogStore};
use crate::meters::StoreMeters;
use crate::store::{connect_counted, Create, ReadOnly};
use crate::url::{LayoutKind, S3Url};

/// Called with each disk range (offset, length) a refresh changed.
pub type OnChange = Arc<dyn Fn(u64, u64) + Send + Sync>;

/// A read replica: the newest view of the log and how old it is.
pub struct Replica {
    url: S3Url,
    meters: Arc<StoreMeters>,
    follow: Duration,
    current: RwLock<Arc<LogStore>>,
    clock: MonotonicClock,
    /// Clock time at which the newest successful refresh started reading the store.
    refreshed_ns: AtomicU64,
    /// Refreshes one at a time (held while the view is opened and swapped, not while the
    /// changes are told).
    refreshing: Mutex<()>,
    /// Ranges swapped views map differently that `on_change` was not told yet. A read that
    /// finds a segment gone swaps a view in without telling (the callback drops cached blocks,
    /// and waits for a read in flight on one: that read itself), so the next refresh tells
    /// them. Held only to add or take ranges.
    untold: Mutex<Vec<(u64, u64)>>,
    /// Held while `on_change` is told (so a stop can wait for it to end).
    telling: Mutex<()>,
    on_change: Mutex<Option<OnChange>>,
    stopped: AtomicBool,
}

impl Replica {
    /// Opens the log-layout disk `url` names as a replica and starts following it every
    /// `url.follow_ms`; every request is counted in `meters`.
    pub(crate) fn open(url: &S3Url, meters: Arc<StoreMeters>) -> Result<Arc<Replica>, OpenError> {
        let follow_ms = url.follow_ms.ok_or_else(|| OpenError::Config {
            url: url.to_string(),
            reason: "a replica needs follow=SECONDS".to_string(),
        })?;
        let clock = MonotonicClock::new();
        let started_ns = clock.now_ns();
        let first = open_view(url, &meters)?;
        let replica = Arc::new(Replica {
            url: url.clone(),
            meters,
            follow: Duration::from_millis(follow_ms),
            current: RwLock::new(Arc::new(first)),
            clock,
            refreshed_ns: AtomicU64::new(started_ns),
            refreshing: Mutex::new(()),
            untold: Mutex::new(Vec::new()),
            telling: Mutex::new(()),
            on_change: Mutex::new(None),
            stopped: AtomicBool::new(false),
        });
        let weak = Arc::downgrade(&replica);
        std::thread::Builder::new()
            .name("bufcache-follow".to_string())
            .spawn(move || follow(weak))
            .map_err(|error| OpenError::Config {
                url: url.to_string(),
                reason: format!("starting the replica's follower thread: {error}"),
            })?;
        Ok(replica)
    }

    /// The view reads are served from now.
    pub fn current(&self) -> Arc<LogStore> {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Sets what is told of each disk range a refresh changes (a cache drops its copies).
    pub fn set_on_change(&self, on_change: OnChange) {
        *self
            .on_change
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(on_change);
    }

    /// Seconds since the newest successful refresh started reading the store: the replica
    /// serves at least every write that was durable then.
    pub fn lag_seconds(&self) -> f64 {
        let since_ns = self
            .clock
            .now_ns()
            .saturating_sub(self.refreshed_ns.load(Ordering::Acquire));
        since_ns as f64 / 1e9
    }

    /// Opens the log again and swaps the new view in; returns how many disk ranges now read
    /// differently (each told to the `on_change` callback after the swap, so a read after the
    /// callback reads the new view; ranges an earlier [`Replica::swap_view`] left untold are
    /// told too).
    pub fn refresh(&self) -> Result<usize, OpenError> {
        let changed = self.swap_view()?;
        let _telling = self.telling.lock().unwrap_or_else(PoisonError::into_inner);
        let untold =
            std::mem::take(&mut *self.untold.lock().unwrap_or_else(PoisonError::into_inner));
        let on_change = self
            .on_change
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if let Some(on_change) = on_change {
            for (offset, length) in untold {
                on_change(offset, length);
            }
        }
        if changed > 0 {
            tracing::debug!(disk = %self.url, ranges = changed, "the replica's refresh found new data");
        }
        Ok(changed)
    }

    /// Opens the log again and swaps the new view in, adding the ranges it maps differently
    /// to those not told yet; returns how many they are.
    fn swap_view(&self) -> Result<usize, OpenError> {
        let _one = self
            .refreshing
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let started_ns = self.clock.now_ns();
        let view = Arc::new(open_view(&self.url, &self.meters)?);
        let old = self.current();
        let changed = changed_ranges(&old.index_entries(), &view.index_entries());
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = view;
        self.refreshed_ns.fetch_max(started_ns, Ordering::AcqRel);
        let count = changed.len();
        self.untold
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend(changed);
        Ok(count)
    }

    /// Reads from the current view; a segment the writer's collector deleted since the view
    /// was opened is read again from a fresh view.
    pub fn read(&self, buffer: &mut [u8], offset: u64) -> Result<(), StoreError> {
        match self.current().read(buffer, offset) {
            Err(StoreError::MissingSegment { key }) => {
                // Not told here: this read holds its block's buffer, which telling a cache
                // would wait for.
                if let Err(error) = self.swap_view() {
                    tracing::warn!(disk = %self.url, "refreshing the replica after segment `{key}` went missing: {error}");
                }
                self.current().read(buffer, offset)
            }
            other => other,
        }
    }

    /// Stops following (the view stays).
    pub fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
    }

    /// Stops following, waits for a refresh in progress to end (the view is final when this
    /// returns: a standby compares it with the log it recovered when taking over), and returns
    /// the ranges swapped views changed that `on_change` was not told.
    pub(crate) fn stop_and_wait(&self) -> Vec<(u64, u64)> {
        self.stop();
        drop(
            self.refreshing
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        drop(self.telling.lock().unwrap_or_else(PoisonError::into_inner));
        std::mem::take(&mut *self.untold.lock().unwrap_or_else(PoisonError::into_inner))
    }

    pub fn url(&self) -> &S3Url {
        &self.url
    }
}

/// One read-only open of the log, as a replica: no lock, nothing written.
fn open_view(url: &S3Url, meters: &Arc<StoreMeters>) -> Result<LogStore, OpenError> {
    let connection = connect_counted(url, Create::Never, Arc::clone(meters))?;
    if connection.metadata.layout != LayoutKind::Log {
        return Err(OpenError::Config {
            url: url.to_string(),
            reason: "follow= makes a read replica, which needs the log layout: a chunk-layout disk is rewritten in place, so a replica could read a chunk half old and half new".to_string(),
        });
    }
    LogStore::read_only_from_connection(
        url,
        connection,
        LogConfig::from_url(url),
        ReadOnly::Replica,
    )
}

/// The follower thread: refreshes every `follow` until the replica is dropped or stopped.
fn follow(replica: Weak<Replica>) {
    loop {
        let Some(pause) = replica.upgrade().map(|replica| replica.follow) else {
            return;
        };
        std::thread::sleep(pause);
        let Some(replica) = replica.upgrade() else {
            return;
        };
        if replica.stopped.load(Ordering::Acquire) {
            return;
        }
        if let Err(error) = replica.refresh() {
            tracing::warn!(disk = %replica.url, lag_seconds = replica.lag_seconds(), "the replica could not refresh: {error}");
        }
    }
}

/// The disk ranges mapped differently in `new` than in `old` (added, removed or moved), as
/// (offset, length), possibly overlapping.
pub(crate) fn changed_ranges(
    old: &[(u64, u64, u64, u64)],
    new: &[(u64, u64, u64, u64)],
) -> Vec<(u64, u64)> {
    let old_set: HashSet<_> = old.iter().copied().collect();
    let new_set: HashSet<_> = new.iter().copied().collect();
    let mut changed: Vec<(u64, u64)> = old
        .iter()
        .filter(|entry| !new_set.contains(entry))
        .chain(new.iter().filter(|entry| !old_set.contains(entry)))
        .map(|&(offset, length, _, _)| (offset, length))
        .collect();
    changed.sort_unstable();
    changed.dedup();
    changed
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: a refresh tells the cache of every range that reads differently and of no other.
    // Method: two index listings with a mapping kept, one moved to another segment, one
    // removed and one added.
    #[test]
    fn a_refresh_names_exactly_the_ranges_mapped_differently() {
        let old = [(0, 4096, 1, 0), (4096, 4096, 1, 4100), (65536, 8192, 2, 0)];
        let new = [(0, 4096, 1, 0), (4096, 4096, 3, 0), (131072, 4096, 3, 4100)];
        assert_eq!(
            changed_ranges(&old, &new),
            vec![(4096, 4096), (65536, 8192), (131072, 4096)]
        );
        assert!(changed_ranges(&old, &old).is_empty());
    }
}
