//! The cache: the buffer table, the write-back side and the objects, put together; the
//! reservation of space that may evict, write back and wait; and the cache-wide calls
//! (statistics, limits, sync, the background tick).
//!
//! Who owns what:
//! - [`Table`] (module `table`): shards, slots, policies, the memory account;
//! - [`Writeback`] (module `writeback`): every write-back trigger and the dirty byte count;
//! - each object's state (module `object`): its dirty index, error latch and streams;
//! - this module: the list of objects and the waiting reservation, which is the one place
//!   that combines the table (evict), write-back (clean) and the injected waiter (wait).
//!
//! A thread never waits for space while it holds a buffer lock, so allocation cannot deadlock
//! against write-back; waits for space are bounded by `space_wait_max`.
//!
//! Objects are isolated from each other's device failures: a write-back that fails while
//! making space is latched on the object it belongs to (and reported to that object's
//! flushers), but it fails only an allocation for that same object. An allocation for
//! another object goes on cleaning elsewhere, waits, and at worst gets `NoSpace`; it never
//! gets another object's I/O error.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bufcache_device::aligned::Populate;
use bufcache_policy::Placement;
use parking_lot::RwLock;

use crate::attached::AttachedReads;
use crate::buffer::{BlockKey, Buffer};
use crate::config::{CacheConfig, ConfigError};
use crate::environment::{Clock, Environment, Spawner, Waiter};
use crate::error::CacheError;
use crate::io::Io;
use crate::object::{ObjectConfig, ObjectState};
use crate::stats::{CacheStats, Counters, WritebackCause};
use crate::table::{Lookup, Reservation, Table};
use crate::writeback::{Awaiting, SpaceCleaning, Writeback};

/// How long one wait for space lasts before the reservation looks again.
const SPACE_WAIT_STEP: Duration = Duration::from_millis(5);

/// One reservation's wait for space: when it began on the injected clock, and the steps
/// that ended with no release waking them, counted whole.
struct SpaceWait {
    started_ns: u64,
    unwoken_ns: u64,
}

impl SpaceWait {
    /// How long the reservation has waited by `now_ns`: the clock's measure, or the whole
    /// steps no release woke, whichever is longer.
    fn waited(&self, now_ns: u64) -> Duration {
        Duration::from_nanos(now_ns.saturating_sub(self.started_ns).max(self.unwoken_ns))
    }
}

/// How hard an allocation may try for space.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Urgency {
    /// Evict clean buffers only; never write back or wait (read-ahead, and every allocation
    /// made while the caller already holds a buffer lock).
    Quick,
    /// Evict, write back dirty buffers, and wait up to `space_wait_max`.
    Wait,
}

/// State shared by every handle on one cache.
pub(crate) struct Inner {
    config: CacheConfig,
    table: Arc<Table>,
    writeback: Writeback,
    io: Arc<Io>,
    counters: Arc<Counters>,
    objects: RwLock<Vec<Arc<ObjectState>>>,
    /// Where the next search for dirty data to clean for space starts, so objects take
    /// turns.
    space_cursor: AtomicUsize,
    spawner: Arc<dyn Spawner>,
    waiter: Arc<dyn Waiter>,
    /// Measures waits for space.
    clock: Arc<dyn Clock>,
    /// Started reads waiting for buffers being filled.
    attached: AttachedReads,
}

/// A concurrent block buffer cache. Cheap to clone; every clone is the same cache.
#[derive(Clone)]
pub struct Cache {
    pub(crate) inner: Arc<Inner>,
}

impl Cache {
    /// A cache whose time and background execution are injected.
    pub fn with_environment(
        config: CacheConfig,
        environment: Environment,
    ) -> Result<Cache, ConfigError> {
        config.validate()?;
        let counters = Arc::new(Counters::default());
        let table = Arc::new(Table::new(
            &config,
            Arc::clone(environment.waiter()),
            Arc::clone(&counters),
        ));
        let io = Arc::new(Io::new(
            Arc::clone(&counters),
            Arc::clone(environment.waiter()),
            config.writeback_inflight_max,
        ));
        let writeback = Writeback::new(
            Arc::clone(&table),
            Arc::clone(&io),
            Arc::clone(&counters),
            &config,
            Arc::clone(environment.clock()),
            Arc::clone(environment.waiter()),
        );
        Ok(Cache {
            inner: Arc::new(Inner {
                table,
                writeback,
                io,
                counters,
                objects: RwLock::new(Vec::new()),
                space_cursor: AtomicUsize::new(0),
                spawner: Arc::clone(environment.spawner()),
                waiter: Arc::clone(environment.waiter()),
                clock: Arc::clone(environment.clock()),
                attached: AttachedReads::default(),
                config,
            }),
        })
    }

    /// The configuration the cache was built with (limits may since have changed; see
    /// [`Cache::stats`]).
    pub fn config(&self) -> &CacheConfig {
        &self.inner.config
    }

    /// Faults one more 2 MiB chunk of buffer memory in ahead of need, unless the cache's
    /// buffer memory would then exceed `bytes_max` or the memory limit. Returns whether it
    /// did: call it until it returns false, on as many threads as you like.
    ///
    /// A cache's first fill otherwise pays, on the data path, for the kernel zeroing and
    /// charging each fresh page (a fifth to a half of a cold copy's CPU, measured). A server
    /// that calls this before it serves moves that cost to its start (about 0.5 s per GiB on
    /// one core of the machine measured). The memory stays resident, not charged to the cache
    /// (`memory_prefaulted_bytes`), until buffers take it; it is never given back by idle
    /// trimming, only when the memory limit shrinks below it.
    ///
    /// `populate`: [`Populate::Advise`] before serving (fastest), [`Populate::Touch`] from a
    /// low-priority thread while serving (no kernel lock held across a preemption).
    pub fn prefault(&self, bytes_max: u64, populate: Populate) -> bool {
        self.inner.table.prefault_chunk(bytes_max, populate)
    }

    /// A statistics snapshot.
    pub fn stats(&self) -> CacheStats {
        let mut stats = self.stats_without_pinned();
        stats.pinned_bytes = self.inner.table.pinned_bytes();
        stats
    }

    /// [`Cache::stats`] without the one figure that visits every buffer: `pinned_bytes` is
    /// 0. Everything else is as exact, at a lock per shard, so a caller can sample it often
    /// (the simulator reconciles its page-wiring charges from these counters).
    pub fn stats_without_pinned(&self) -> CacheStats {
        let inner = &self.inner;
        let mut stats = CacheStats::default();
        inner.table.fill_stats_without_pinned(&mut stats);
        inner.counters.fill(&mut stats);
        stats.dirty_bytes = inner.writeback.dirty_bytes();
        stats.writeback_inflight_requests = inner.io.writeback_inflight_requests();
        stats
    }

    /// Changes the memory and buffer limits at run time. Shrinking evicts clean buffers and
    /// writes back dirty ones until the cache fits, or fails with `NoSpace` (limits are then
    /// set, and later allocations keep freeing space until they fit).
    pub fn set_limits(&self, memory_bytes_max: u64, buffers_max: u64) -> Result<(), CacheError> {
        let inner = &self.inner;
        let page_rounded = inner.config.charge_bytes(inner.config.buffer_bytes_max);
        if memory_bytes_max < page_rounded || buffers_max == 0 {
            return Err(CacheError::Config(ConfigError::OutOfRange {
                field: "memory_bytes_max",
                value: format!("{memory_bytes_max} bytes, {buffers_max} buffers"),
                allowed: "must hold at least one buffer of the largest size".into(),
            }));
        }
        inner.table.set_limits(memory_bytes_max, buffers_max);
        // Spares first: they are not buffers, so no eviction below would ever free them.
        inner.table.release_spares_over_limit();
        while inner.table.over_limit() {
            if inner.table.evict_one() {
                continue;
            }
            if !inner.clean_for_space(None)? {
                return Err(CacheError::NoSpace {
                    waited: Duration::ZERO,
                });
            }
        }
        // Memory the smaller cache no longer uses goes back to the system.
        inner.table.trim();
        Ok(())
    }

    /// Writes back every dirty buffer of every object, then flushes every device (sync(2)).
    /// Returns the first error; every object's error is still latched for its own flushers.
    ///
    /// A first pass hands down the runs of all objects stored on one device together, in
    /// that device's batches (what an io queue below can sort and merge); then each object
    /// is fsynced, which writes what that pass skipped and flushes its device.
    pub fn sync(&self) -> Result<(), CacheError> {
        let objects = self.inner.objects();
        let (_, mut first_error) = self.inner.writeback.write_objects_dirtied_by(
            &objects,
            u64::MAX,
            WritebackCause::Flush,
            Awaiting::Outcomes,
        );
        for object in objects {
            if let Err(error) = self.inner.writeback.fsync_object(&object) {
                first_error.get_or_insert(error);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Background writeback work due now: dirty data older than `dirty_age_max`, and dirty
    /// data above the background threshold. Call it periodically (the server runs a thread;
    /// the simulator calls it on its virtual clock). Aged and written-behind data is sent
    /// without waiting for the device (4.4BSD's `bawrite`): returns the blocks whose writes
    /// had ended by then (all of them over a device that completes in the caller's thread).
    pub fn writeback_tick(&self) -> u64 {
        let inner = &self.inner;
        let written = inner.writeback.writeback_tick(&inner.objects());
        // Free buffer memory beyond an eighth of the limit is given back to the system.
        if inner.table.idle_resident_bytes() > inner.table.memory_bytes_max() / 8 {
            inner.table.trim();
        }
        written
    }
}

impl Inner {
    pub(crate) fn config(&self) -> &CacheConfig {
        &self.config
    }

    pub(crate) fn attached(&self) -> &AttachedReads {
        &self.attached
    }

    pub(crate) fn table(&self) -> &Table {
        &self.table
    }

    pub(crate) fn writeback(&self) -> &Writeback {
        &self.writeback
    }

    pub(crate) fn io(&self) -> &Io {
        &self.io
    }

    pub(crate) fn counters(&self) -> &Counters {
        &self.counters
    }

    pub(crate) fn spawner(&self) -> &Arc<dyn Spawner> {
        &self.spawner
    }

    pub(crate) fn waiter(&self) -> &Arc<dyn Waiter> {
        &self.waiter
    }

    /// Every object opened so far.
    pub(crate) fn objects(&self) -> Vec<Arc<ObjectState>> {
        self.objects.read().clone()
    }

    /// Registers a new object and returns its state.
    pub(crate) fn add_object(&self, config: ObjectConfig) -> Result<Arc<ObjectState>, CacheError> {
        let mut objects = self.objects.write();
        let id = objects.len() as u32;
        let state = Arc::new(ObjectState::new(id, config, &self.config)?);
        objects.push(Arc::clone(&state));
        Ok(state)
    }

    /// Finds `key` or inserts a new invalid buffer for it. Space for the new buffer is
    /// reserved with `urgency` before anything is locked.
    pub(crate) fn lookup_or_insert(
        &self,
        key: BlockKey,
        object: &ObjectState,
        placement: Placement,
        urgency: Urgency,
    ) -> Result<Lookup, CacheError> {
        if let Some(buffer) = self.table.lookup(key, placement) {
            return Ok(Lookup::Found(buffer));
        }
        let size_bytes = object.block_size_bytes as u64;
        let reservation = self.reserve(size_bytes, urgency, object, key)?;
        Ok(self.table.insert_reserved(
            reservation,
            key,
            size_bytes,
            object.block_length_bytes(key.block),
            placement,
        ))
    }

    /// Finds `key` or inserts a new invalid buffer for it if room is free now, evicting
    /// clean idle buffers only (never writing back or waiting). None when there is no such
    /// room: every buffer is pinned, dirty, under I/O or unused read-ahead a reservation
    /// may not take. A read then streams (the handle's `read_streaming`).
    pub(crate) fn lookup_or_try_insert(
        &self,
        key: BlockKey,
        object: &ObjectState,
        placement: Placement,
    ) -> Option<Lookup> {
        if let Some(buffer) = self.table.lookup(key, placement) {
            return Some(Lookup::Found(buffer));
        }
        let size_bytes = object.block_size_bytes as u64;
        let reservation = self.table.try_reserve(size_bytes, false, key)?;
        Some(self.table.insert_reserved(
            reservation,
            key,
            size_bytes,
            object.block_length_bytes(key.block),
            placement,
        ))
    }

    /// Inserts a new invalid buffer for `key` if it is absent and space is free without
    /// waiting (clustering and read-ahead extend runs only this way). Returns it locked
    /// exclusively and pinned, or None. Read-ahead (`for_readahead`) never evicts
    /// read-ahead not yet used.
    pub(crate) fn insert_absent(
        &self,
        key: BlockKey,
        object: &ObjectState,
        placement: Placement,
        count_miss: bool,
        for_readahead: bool,
    ) -> Option<Arc<Buffer>> {
        self.table.insert_absent(
            key,
            object.block_size_bytes as u64,
            object.block_length_bytes(key.block),
            placement,
            count_miss,
            for_readahead,
        )
    }

    /// [`Cache::insert_absent`] for the blocks `first..end` of `object` in order, stopping at
    /// the first that cannot be inserted; each block's placement and miss counting come from
    /// `placement_of`. Shard locks are taken per chunk (see `Table::insert_absent_run`).
    /// Blocks from `readahead_from` on are read-ahead, which never evicts read-ahead not yet
    /// used.
    pub(crate) fn insert_absent_run(
        &self,
        object: &ObjectState,
        first: u64,
        end: u64,
        readahead_from: u64,
        mut placement_of: impl FnMut(u64) -> (Placement, bool),
    ) -> Vec<Arc<Buffer>> {
        self.table.insert_absent_run(
            object.id,
            first,
            end,
            object.block_size_bytes as u64,
            readahead_from,
            |block| {
                let (placement, count_miss) = placement_of(block);
                (object.block_length_bytes(block), placement, count_miss)
            },
        )
    }

    /// Reserves memory for one buffer of `object` that will hold `key`, evicting, writing
    /// back and waiting as `urgency` allows.
    ///
    /// Nobody spins: a reservation that finds nothing evictable and nothing to clean sleeps
    /// on the injected waiter until a release (an unpin, a read or write-back ending) or
    /// `SPACE_WAIT_STEP`, then looks again. The wait is bounded by `space_wait_max`, measured
    /// on the injected clock; a look that no release woke counts as a whole step besides, so
    /// the bound holds under a clock that does not move (deterministic tests) and a wait
    /// that cannot end (a device that never completes) ends with `NoSpace`, never a hang.
    fn reserve(
        &self,
        size_bytes: u64,
        urgency: Urgency,
        object: &ObjectState,
        key: BlockKey,
    ) -> Result<Reservation, CacheError> {
        let mut wait: Option<SpaceWait> = None;
        // The object's error latch when this reservation first found no room: a write-back
        // it sent that fails later is latched there, and returned (see below).
        let mut latch_seen: Option<AtomicU64> = None;
        let mut awaited_writeback = false;
        let outcome = loop {
            if let Some(reservation) = self.table.try_reserve(size_bytes, false, key) {
                break Ok(reservation);
            }
            if urgency == Urgency::Quick {
                break Err(CacheError::NoSpace {
                    waited: Duration::ZERO,
                });
            }
            match self.clean_or_await_for_space(object, &mut latch_seen) {
                Ok(SpaceCleaning::Cleaned) => continue,
                Ok(SpaceCleaning::InFlight) if !awaited_writeback => {
                    awaited_writeback = true;
                    self.counters
                        .writeback_waits
                        .fetch_add(1, Ordering::Relaxed);
                }
                Ok(_) => {}
                Err(error) => break Err(error),
            }
            let now_ns = self.clock.now_ns();
            let wait = wait.get_or_insert_with(|| {
                self.counters.space_waits.fetch_add(1, Ordering::Relaxed);
                SpaceWait {
                    started_ns: now_ns,
                    unwoken_ns: 0,
                }
            });
            let waited = wait.waited(now_ns);
            if waited >= self.config.space_wait_max {
                self.counters.space_failures.fetch_add(1, Ordering::Relaxed);
                break Err(CacheError::NoSpace { waited });
            }
            let step_ns = SPACE_WAIT_STEP.as_nanos() as u64;
            if !self.table.wait_for_space(size_bytes, step_ns) {
                wait.unwoken_ns += step_ns;
            }
        };
        if let Some(wait) = wait {
            let waited = wait.waited(self.clock.now_ns());
            self.counters
                .buffer_wait(u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX));
        }
        outcome
    }

    /// Write-back for a reservation of `object` that found nothing to evict, visiting
    /// objects in turn ([`Writeback::clean_for_space`]: it sends write-back only while the
    /// device's share has room, and over a device that completes later does not wait for
    /// it). `Cleaned` when some ended already, `InFlight` when the caller should wait for
    /// completions. An error is the requester's own: a write it waited for that failed with
    /// nothing cleaned, or a failure latched on `object` since `latch_seen` was first set
    /// (a write-back sent without waiting that failed): waiting would not help then.
    fn clean_or_await_for_space(
        &self,
        object: &ObjectState,
        latch_seen: &mut Option<AtomicU64>,
    ) -> Result<SpaceCleaning, CacheError> {
        let latch_seen = latch_seen.get_or_insert_with(|| AtomicU64::new(object.latch_sequence()));
        if let Some(error) = object.unseen_error(latch_seen) {
            return Err(error);
        }
        let objects = self.objects();
        let start = self.space_cursor.fetch_add(1, Ordering::Relaxed);
        let mut outcome = SpaceCleaning::Nothing;
        for step in 0..objects.len() {
            let candidate = &objects[(start + step) % objects.len()];
            match self.writeback.clean_for_space(candidate) {
                Ok(SpaceCleaning::Cleaned) => return Ok(SpaceCleaning::Cleaned),
                Ok(SpaceCleaning::InFlight) => outcome = SpaceCleaning::InFlight,
                Ok(SpaceCleaning::Nothing) => {}
                Err(error) if candidate.id == object.id => return Err(error),
                Err(_latched_on_its_object) => {}
            }
        }
        Ok(outcome)
    }

    /// Writes back one cluster of dirty data so its buffers become evictable, visiting
    /// objects in turn. Returns whether any buffer was cleaned. A failed write-back is
    /// latched on its own object by write-back; it is returned only when nothing could be
    /// cleaned and it belongs to `requester` (the object that needs the space; `None`: the
    /// cache itself, which hears of any): waiting would not help that object, while
    /// another object's failure is none of the requester's business.
    pub(crate) fn clean_for_space(
        &self,
        requester: Option<&ObjectState>,
    ) -> Result<bool, CacheError> {
        let objects = self.objects();
        if objects.is_empty() {
            return Ok(false);
        }
        let start = self.space_cursor.fetch_add(1, Ordering::Relaxed);
        let mut own_error = None;
        for step in 0..objects.len() {
            let object = &objects[(start + step) % objects.len()];
            match self
                .writeback
                .clean_one_cluster(std::slice::from_ref(object), WritebackCause::Eviction)
            {
                Ok(0) => {}
                Ok(_) => return Ok(true),
                Err(error) if requester.is_none_or(|requester| requester.id == object.id) => {
                    own_error.get_or_insert(error);
                }
                Err(_latched_on_its_object) => {}
            }
        }
        own_error.map_or(Ok(false), Err)
    }
}
