//! The warm standby's cache (`serve --standby`, docs/s3.md "Standby"): while the writer holds
//! the disk, the engine cache sits over the standby's replica view ([`Standby`]); each refresh
//! drops the ranges the writer changed and a warming thread reads what the writer wrote most
//! recently into the cache, at most `--standby-warm-bytes-max` per follow round. At the
//! takeover the same cache goes on over the writer's open, less the ranges the recovered log
//! maps differently from the last view followed.
//!
//! Invariant: the cache holds only bytes some replica view read, and at the takeover every
//! cached block the recovered log maps differently is dropped before the server serves, so a
//! client never reads a block older than the writer's last durable write of it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use bufcache::ObjectHandle;
use bufcache_s3::standby::Standby;

/// The largest read a warming thread makes at once.
const WARM_READ_BYTES_MAX: u64 = 1 << 20;
/// Changed ranges waiting to be warmed, at most: older ones are dropped (a writer that
/// rewrites faster than the standby reads is followed by its newest writes).
const PENDING_RANGES_MAX: usize = 1 << 16;
/// How long the warming thread sleeps when no refresh wakes it.
const WARM_IDLE: Duration = Duration::from_secs(1);

/// A standby export's cache warming and takeover.
pub struct WarmStandby {
    pub standby: Arc<Standby>,
    /// Bytes read into the cache by warming.
    warm_bytes: AtomicU64,
    stop: AtomicBool,
    /// Ranges refreshes changed, not yet warmed, oldest first.
    pending: Mutex<VecDeque<(u64, u64)>>,
    thread: Mutex<Option<std::thread::Thread>>,
}

impl WarmStandby {
    /// Wires the standby's refreshes to `object`'s cache (each changed range dropped and
    /// queued for warming) and starts the warming thread, which reads at most `bytes_max`
    /// per round: first the newest-written ranges of the view, then the ranges each refresh
    /// changed, newest first. `bytes_max` 0 warms nothing (the cache still drops changed
    /// ranges).
    pub fn start(
        standby: Arc<Standby>,
        object: ObjectHandle,
        bytes_max: u64,
    ) -> anyhow::Result<Arc<WarmStandby>> {
        let warm = Arc::new(WarmStandby {
            standby: Arc::clone(&standby),
            warm_bytes: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            pending: Mutex::new(VecDeque::new()),
            thread: Mutex::new(None),
        });
        let weak = Arc::downgrade(&warm);
        let forget = object.reopen();
        standby
            .replica()
            .set_on_change(Arc::new(move |offset, length| {
                forget.forget_clean(offset, length);
                if let Some(warm) = weak.upgrade() {
                    warm.queue(offset, length);
                }
            }));
        if bytes_max > 0 {
            let weak = Arc::downgrade(&warm);
            let thread = std::thread::Builder::new()
                .name("bufcache-warm".into())
                .spawn(move || warm_rounds(weak, object, bytes_max))?;
            *warm.thread.lock().unwrap_or_else(PoisonError::into_inner) =
                Some(thread.thread().clone());
        }
        Ok(warm)
    }

    fn queue(&self, offset: u64, length: u64) {
        if self.stop.load(Ordering::Acquire) {
            return;
        }
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        if pending.len() == PENDING_RANGES_MAX {
            pending.pop_front();
        }
        pending.push_back((offset, length));
        drop(pending);
        if let Some(thread) = &*self.thread.lock().unwrap_or_else(PoisonError::into_inner) {
            thread.unpark();
        }
    }

    /// Bytes read into the cache by warming so far.
    pub fn warm_bytes(&self) -> u64 {
        self.warm_bytes.load(Ordering::Relaxed)
    }

    /// Stops warming, swaps the writer's open in under the cache and drops the clean cached
    /// copies of every range the recovered log maps differently from the last view followed;
    /// returns how many ranges that was. A warming read still in flight on the old view holds
    /// its block's buffer, so the drop waits for it and drops it too.
    pub fn take_over(&self, writer: bufcache_s3::S3Device, object: &ObjectHandle) -> usize {
        self.stop.store(true, Ordering::Release);
        self.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        let changed = self.standby.take_over(writer);
        for &(offset, length) in &changed {
            object.forget_clean(offset, length);
        }
        changed.len()
    }
}

/// The warming thread: the view's newest-written ranges, then each refresh's changes.
fn warm_rounds(warm: Weak<WarmStandby>, object: ObjectHandle, bytes_max: u64) {
    let first = match warm.upgrade() {
        Some(warm) => warm.standby.newest_written(bytes_max),
        None => return,
    };
    let mut ranges = first;
    loop {
        {
            let Some(warm) = warm.upgrade() else {
                return;
            };
            if !read_into_cache(&warm, &object, &ranges) {
                return;
            }
        }
        std::thread::park_timeout(WARM_IDLE);
        let Some(warm) = warm.upgrade() else {
            return;
        };
        if warm.stop.load(Ordering::Acquire) {
            return;
        }
        // Newest first, up to the round's bytes; older changes are dropped.
        let pending: Vec<(u64, u64)> = warm
            .pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain(..)
            .rev()
            .collect();
        let mut left = bytes_max;
        ranges = Vec::new();
        for (offset, length) in pending {
            if left == 0 {
                break;
            }
            let taken = length.min(left);
            ranges.push((offset, taken));
            left -= taken;
        }
    }
}

/// Reads `ranges` through the cache; false once stopped.
fn read_into_cache(warm: &WarmStandby, object: &ObjectHandle, ranges: &[(u64, u64)]) -> bool {
    let size = object.len();
    let mut buffer = vec![0u8; WARM_READ_BYTES_MAX as usize];
    for &(offset, length) in ranges {
        let end = offset.saturating_add(length).min(size);
        let mut at = offset;
        while at < end {
            if warm.stop.load(Ordering::Acquire) {
                return false;
            }
            let piece = (end - at).min(WARM_READ_BYTES_MAX);
            match object.read_at(at, &mut buffer[..piece as usize]) {
                Ok(()) => {
                    warm.warm_bytes.fetch_add(piece, Ordering::Relaxed);
                }
                // The next refresh or the takeover reads it again; nothing is served from
                // a failed read.
                Err(error) => {
                    tracing::debug!(offset = at, "warming the standby's cache: {error}");
                }
            }
            at += piece;
        }
    }
    true
}
