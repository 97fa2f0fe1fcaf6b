//! The cache: a sharded table of buffers, the memory account, eviction, and objects.
//!
//! Who guards what:
//! - each *shard* mutex guards its key → slot map, its slot table and its replacement policy
//!   instance; it is held only for table updates, never across device I/O or while waiting
//!   for a buffer lock;
//! - each *buffer* lock guards that buffer's bytes and is the only lock held across device
//!   I/O, so a miss blocks only threads that want the same block;
//! - the *memory account* is two atomics (bytes, buffers) reserved before a buffer is created
//!   and released when it is dropped, so both limits hold at every moment;
//! - each *object* mutex guards its dirty set, error latch and stream table; held briefly.
//!
//! A thread never waits for space while it holds a buffer lock, so allocation cannot deadlock
//! against write-back; waits for space are bounded by `space_wait_max`.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bufcache_policy::{Placement, Policy, Slot};
use parking_lot::{Mutex, RwLock};

use crate::buffer::{BlockKey, Buffer, MemoryRelease, DIRTY, READAHEAD, WRITEBACK};
use crate::config::{CacheConfig, ConfigError};
use crate::environment::{Clock, Environment, Spawner, Waiter};
use crate::error::CacheError;
use crate::object::{ObjectConfig, ObjectHandle, ObjectState};
use crate::stats::{CacheStats, Counters, WritebackCause};
use bufcache_device::aligned::BufferPool;

/// Hashes a [`BlockKey`] by its own mixing function: keys are already well mixed, so the
/// table's hasher only passes the 64-bit value through.
#[derive(Default)]
pub(crate) struct PassThroughHasher(u64);

impl Hasher for PassThroughHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = self.0.rotate_left(8) ^ byte as u64;
        }
    }
    fn write_u64(&mut self, value: u64) {
        self.0 = value;
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
struct MixedKey(u64, BlockKey);

impl std::hash::Hash for MixedKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.0);
    }
}

/// One lock domain of the buffer table.
pub(crate) struct Shard {
    map: HashMap<MixedKey, Slot, BuildHasherDefault<PassThroughHasher>>,
    entries: Vec<Option<Arc<Buffer>>>,
    free_slots: Vec<Slot>,
    policy: Box<dyn Policy>,
    hits: u64,
    misses: u64,
}

impl Shard {
    /// Publishes `buffer` under `key` in a free slot and tells the policy.
    fn attach(&mut self, key: MixedKey, buffer: &Arc<Buffer>, placement: Placement) {
        let slot = match self.free_slots.pop() {
            Some(slot) => slot,
            None => {
                self.entries.push(None);
                (self.entries.len() - 1) as Slot
            }
        };
        buffer.slot.store(slot, Ordering::Release);
        self.entries[slot as usize] = Some(Arc::clone(buffer));
        self.map.insert(key, slot);
        self.policy.insert(slot, key.0, placement);
    }

    /// Pins and returns the buffer in `slot`.
    fn pin(&self, slot: Slot) -> Arc<Buffer> {
        let buffer = Arc::clone(
            self.entries[slot as usize]
                .as_ref()
                .expect("mapped slot is occupied"),
        );
        buffer.pins.fetch_add(1, Ordering::AcqRel);
        buffer
    }

    fn detach(&mut self, slot: Slot) -> Arc<Buffer> {
        let buffer = self.entries[slot as usize]
            .take()
            .expect("detached slot is occupied");
        self.map.remove(&MixedKey(buffer.key.hash64(), buffer.key));
        self.free_slots.push(slot);
        buffer
    }
}

/// Memory and buffer-count limits, charged before a buffer exists and released by its drop.
pub(crate) struct MemoryAccount {
    used_bytes: AtomicU64,
    wasted_bytes: AtomicU64,
    buffers: AtomicU64,
    bytes_max: AtomicU64,
    buffers_max: AtomicU64,
    waiters: AtomicUsize,
    waiter: Arc<dyn Waiter>,
}

impl MemoryAccount {
    /// Charges one buffer if both limits allow it. Each counter only ever moves to a value
    /// within its limit (compare-exchange), so no snapshot shows more than the limits.
    fn try_charge(&self, charge_bytes: u64, waste_bytes: u64) -> bool {
        let bytes_max = self.bytes_max.load(Ordering::Acquire);
        let charged = self
            .used_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(charge_bytes)
                    .filter(|&total| total <= bytes_max)
            });
        if charged.is_err() {
            return false;
        }
        let buffers_max = self.buffers_max.load(Ordering::Acquire);
        let counted = self
            .buffers
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |buffers| {
                Some(buffers + 1).filter(|&total| total <= buffers_max)
            });
        if counted.is_err() {
            self.used_bytes.fetch_sub(charge_bytes, Ordering::AcqRel);
            return false;
        }
        self.wasted_bytes.fetch_add(waste_bytes, Ordering::Relaxed);
        // A limit lowered at run time may leave usage above it until eviction catches up, but
        // a charge never pushes usage past the limit it was checked against.
        strict_assert!(
            charge_bytes <= bytes_max,
            "one buffer larger than the memory limit"
        );
        true
    }

    fn over_limit(&self) -> bool {
        self.used_bytes.load(Ordering::Acquire) > self.bytes_max.load(Ordering::Acquire)
            || self.buffers.load(Ordering::Acquire) > self.buffers_max.load(Ordering::Acquire)
    }

    /// Takes a ticket, then blocks (through the injected waiter) until a release after it or
    /// `timeout` — unless space appeared between the caller's last try and the ticket.
    fn wait_for_release(&self, charge_bytes: u64, timeout: Duration) {
        self.waiters.fetch_add(1, Ordering::AcqRel);
        let ticket = self.waiter.ticket();
        let bytes_max = self.bytes_max.load(Ordering::Acquire);
        let room = self.used_bytes.load(Ordering::Acquire) + charge_bytes <= bytes_max
            && self.buffers.load(Ordering::Acquire) < self.buffers_max.load(Ordering::Acquire);
        if !room {
            self.waiter.wait(ticket, timeout.as_nanos() as u64);
        }
        self.waiters.fetch_sub(1, Ordering::AcqRel);
    }

    pub(crate) fn notify(&self) {
        if self.waiters.load(Ordering::Acquire) > 0 {
            self.waiter.notify_all();
        }
    }
}

impl MemoryRelease for MemoryAccount {
    fn release(&self, charge_bytes: u64, waste_bytes: u64) {
        self.used_bytes.fetch_sub(charge_bytes, Ordering::AcqRel);
        self.wasted_bytes.fetch_sub(waste_bytes, Ordering::Relaxed);
        self.buffers.fetch_sub(1, Ordering::AcqRel);
        self.notify();
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

/// Result of looking a block up for use.
pub(crate) enum Lookup {
    /// The block was in the table; the buffer is pinned but not locked.
    Found(Arc<Buffer>),
    /// The block was not there; a new invalid buffer was inserted, pinned and locked
    /// exclusively.
    Inserted(Arc<Buffer>),
}

/// State shared by every handle on one cache.
pub(crate) struct Inner {
    pub config: CacheConfig,
    /// Where buffer bytes come from (page-aligned slots in large chunks).
    pub pool: Arc<BufferPool>,
    pub shards: Box<[Mutex<Shard>]>,
    shard_shift: u32,
    pub memory: Arc<MemoryAccount>,
    pub counters: Counters,
    pub dirty_bytes: AtomicU64,
    pub objects: RwLock<Vec<Arc<ObjectState>>>,
    evict_cursor: AtomicUsize,
    writeback_cursor: AtomicUsize,
    pub clock: Arc<dyn Clock>,
    pub spawner: Arc<dyn Spawner>,
    pub waiter: Arc<dyn Waiter>,
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
        let shard_count = config.shards.next_power_of_two();
        let capacity_hint = (config.buffers_max as usize)
            .min((config.memory_bytes_max / config.page_size_bytes) as usize)
            / shard_count;
        let shards = (0..shard_count)
            .map(|_| {
                Mutex::new(Shard {
                    map: HashMap::default(),
                    entries: Vec::new(),
                    free_slots: Vec::new(),
                    policy: config.policy.build(capacity_hint.max(1)),
                    hits: 0,
                    misses: 0,
                })
            })
            .collect();
        let memory = Arc::new(MemoryAccount {
            used_bytes: AtomicU64::new(0),
            wasted_bytes: AtomicU64::new(0),
            buffers: AtomicU64::new(0),
            bytes_max: AtomicU64::new(config.memory_bytes_max),
            buffers_max: AtomicU64::new(config.buffers_max),
            waiters: AtomicUsize::new(0),
            waiter: Arc::clone(environment.waiter()),
        });
        Ok(Cache {
            inner: Arc::new(Inner {
                shard_shift: 64 - shard_count.trailing_zeros(),
                shards,
                memory,
                counters: Counters::default(),
                dirty_bytes: AtomicU64::new(0),
                objects: RwLock::new(Vec::new()),
                pool: BufferPool::new(config.page_size_bytes as usize),
                evict_cursor: AtomicUsize::new(0),
                writeback_cursor: AtomicUsize::new(0),
                clock: Arc::clone(environment.clock()),
                spawner: Arc::clone(environment.spawner()),
                waiter: Arc::clone(environment.waiter()),
                config,
            }),
        })
    }

    /// The configuration the cache was built with (limits may since have changed; see
    /// [`Cache::stats`]).
    pub fn config(&self) -> &CacheConfig {
        &self.inner.config
    }

    /// Registers an object (an export, a file) stored on `config.device` and returns a handle.
    pub fn open_object(&self, config: ObjectConfig) -> Result<ObjectHandle, CacheError> {
        let mut objects = self.inner.objects.write();
        let id = objects.len() as u32;
        let state = Arc::new(ObjectState::new(id, config, &self.inner.config)?);
        objects.push(Arc::clone(&state));
        drop(objects);
        Ok(ObjectHandle::new(self.clone(), state))
    }

    /// A statistics snapshot.
    pub fn stats(&self) -> CacheStats {
        let inner = &self.inner;
        let mut stats = CacheStats::default();
        for shard in inner.shards.iter() {
            let shard = shard.lock();
            stats.hits += shard.hits;
            stats.misses += shard.misses;
            stats.pinned_bytes += shard
                .entries
                .iter()
                .flatten()
                .filter(|buffer| buffer.pins.load(Ordering::Acquire) > 0)
                .map(|buffer| buffer.charge_bytes as u64)
                .sum::<u64>();
        }
        inner.counters.fill(&mut stats);
        stats.dirty_bytes = inner.dirty_bytes.load(Ordering::Acquire);
        stats.memory_used_bytes = inner.memory.used_bytes.load(Ordering::Acquire);
        stats.memory_wasted_bytes = inner.memory.wasted_bytes.load(Ordering::Acquire);
        stats.buffers_in_use = inner.memory.buffers.load(Ordering::Acquire);
        stats.memory_bytes_max = inner.memory.bytes_max.load(Ordering::Acquire);
        stats.buffers_max = inner.memory.buffers_max.load(Ordering::Acquire);
        stats
    }

    /// Changes the memory and buffer limits at run time. Shrinking evicts clean buffers and
    /// writes back dirty ones until the cache fits, or fails with `NoSpace` (limits are then
    /// set, and later allocations keep freeing space until they fit).
    pub fn set_limits(&self, memory_bytes_max: u64, buffers_max: u64) -> Result<(), CacheError> {
        let page_rounded = self
            .inner
            .config
            .charge_bytes(self.inner.config.buffer_size_max_bytes);
        if memory_bytes_max < page_rounded || buffers_max == 0 {
            return Err(CacheError::Config(ConfigError::OutOfRange {
                field: "memory_bytes_max",
                value: format!("{memory_bytes_max} bytes, {buffers_max} buffers"),
                allowed: "must hold at least one buffer of the largest size".into(),
            }));
        }
        self.inner
            .memory
            .bytes_max
            .store(memory_bytes_max, Ordering::Release);
        self.inner
            .memory
            .buffers_max
            .store(buffers_max, Ordering::Release);
        while self.inner.memory.over_limit() {
            if self.inner.evict_one() {
                continue;
            }
            if !self.inner.clean_for_space()? {
                return Err(CacheError::NoSpace {
                    waited: Duration::ZERO,
                });
            }
        }
        // Memory the smaller cache no longer uses goes back to the system.
        self.inner.pool.trim();
        Ok(())
    }

    /// Writes back every dirty buffer of every object, then flushes every device (sync(2)).
    /// Returns the first error; every object's error is still latched for its own flushers.
    pub fn sync(&self) -> Result<(), CacheError> {
        let objects: Vec<Arc<ObjectState>> = self.inner.objects.read().clone();
        let mut first_error = None;
        for object in objects {
            if let Err(error) = self.inner.fsync_object(&object) {
                first_error.get_or_insert(error);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Background writeback work due now: dirty data older than `dirty_age_max`, and dirty
    /// data above the background threshold. Call it periodically (the server runs a thread;
    /// the simulator calls it on its virtual clock). Returns the blocks written.
    pub fn writeback_tick(&self) -> u64 {
        let written = self.inner.writeback_tick();
        // Free buffer memory beyond an eighth of the limit is given back to the system.
        let limit = self.inner.memory.bytes_max.load(Ordering::Acquire);
        if self.inner.pool.idle_resident_bytes() > limit / 8 {
            self.inner.pool.trim();
        }
        written
    }
}

impl Inner {
    fn shard_index(&self, key: &BlockKey) -> (usize, u64) {
        let hash = key.hash64();
        let index = if self.shards.len() == 1 {
            0
        } else {
            (hash >> self.shard_shift) as usize
        };
        (index, hash)
    }

    /// Looks `key` up; on a hit records the access and pins the buffer.
    /// A hit from a no-reuse stream (`placement` NoReuse) is not reported to the policy, so
    /// the block stays at the eviction end where it was inserted: the stream consuming its
    /// own read-ahead must not promote it (seed 003's vm_page_dontneed on release).
    pub fn lookup(&self, key: BlockKey, placement: Placement) -> Option<Arc<Buffer>> {
        let (index, hash) = self.shard_index(&key);
        let mut shard = self.shards[index].lock();
        let slot = *shard.map.get(&MixedKey(hash, key))?;
        if placement == Placement::Normal {
            shard.policy.access(slot);
        }
        shard.hits += 1;
        Some(shard.pin(slot))
    }

    /// Finds `key` or inserts a new invalid buffer for it. Space for the new buffer is
    /// reserved with `urgency` before anything is locked.
    pub fn lookup_or_insert(
        &self,
        key: BlockKey,
        object: &ObjectState,
        placement: Placement,
        urgency: Urgency,
    ) -> Result<Lookup, CacheError> {
        if let Some(buffer) = self.lookup(key, placement) {
            return Ok(Lookup::Found(buffer));
        }
        let size = object.block_size_bytes as usize;
        let charge = self.config.charge_bytes(size as u64);
        self.reserve(charge, charge - size as u64, urgency)?;
        let buffer = Buffer::new_locked(
            key,
            size,
            object.block_length_bytes(key.block),
            &self.pool,
            charge as u32,
            Arc::clone(&self.memory) as Arc<dyn MemoryRelease>,
        );
        let (index, hash) = self.shard_index(&key);
        let mut shard = self.shards[index].lock();
        if let Some(&slot) = shard.map.get(&MixedKey(hash, key)) {
            // Another thread inserted the block while we allocated: use theirs. Dropping ours
            // releases its memory; it was never visible, so its lock does not matter.
            shard.policy.access(slot);
            shard.hits += 1;
            return Ok(Lookup::Found(shard.pin(slot)));
        }
        shard.attach(MixedKey(hash, key), &buffer, placement);
        shard.misses += 1;
        Ok(Lookup::Inserted(buffer))
    }

    /// Removes `buffer` from the table if it is still the one mapped for its key.
    pub fn remove(&self, buffer: &Arc<Buffer>) {
        let (index, _) = self.shard_index(&buffer.key);
        let mut shard = self.shards[index].lock();
        let slot = buffer.slot.load(Ordering::Acquire);
        let mapped = shard
            .entries
            .get(slot as usize)
            .and_then(|entry| entry.as_ref())
            .is_some_and(|entry| Arc::ptr_eq(entry, buffer));
        if mapped {
            shard.policy.remove(slot);
            let removed = shard.detach(slot);
            drop(shard);
            if removed.clear(READAHEAD) {
                self.counters
                    .readahead_wasted_blocks
                    .fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Releases one pin, waking space waiters when the buffer became evictable.
    pub fn unpin(&self, buffer: &Buffer) {
        if buffer.pins.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.memory.notify();
        }
    }

    /// Evicts one clean, unpinned buffer chosen by a shard's policy. Shards are visited
    /// round-robin so eviction pressure spreads evenly. Read-ahead nobody has used yet is
    /// spared while anything else can go: evicting it before its reader arrives would only
    /// turn one clustered read into many single-block misses.
    pub fn evict_one(&self) -> bool {
        self.evict_pass(false) || self.evict_pass(true)
    }

    fn evict_pass(&self, including_unused_readahead: bool) -> bool {
        let shard_count = self.shards.len();
        let start = self.evict_cursor.fetch_add(1, Ordering::Relaxed);
        for step in 0..shard_count {
            let mut shard = self.shards[(start + step) % shard_count].lock();
            let Shard {
                policy, entries, ..
            } = &mut *shard;
            let victim = policy.evict(&mut |slot| {
                entries[slot as usize].as_ref().is_some_and(|buffer| {
                    buffer.pins.load(Ordering::Acquire) == 0
                        && !buffer.has(DIRTY)
                        && (including_unused_readahead || !buffer.has(READAHEAD))
                })
            });
            if let Some(slot) = victim {
                let buffer = shard.detach(slot);
                drop(shard);
                strict_assert!(
                    !buffer.has(DIRTY) && !buffer.has(WRITEBACK),
                    "evicted {:?} while dirty or under write-back",
                    buffer.key
                );
                self.counters.evictions.fetch_add(1, Ordering::Relaxed);
                if buffer.has(READAHEAD) {
                    self.counters
                        .readahead_wasted_blocks
                        .fetch_add(1, Ordering::Relaxed);
                }
                return true;
            }
        }
        false
    }

    /// Moves a block to the eviction end of its shard's policy (a no-reuse stream is done
    /// with it), by forgetting and re-inserting it with `NoReuse` placement.
    pub fn demote(&self, buffer: &Buffer) {
        let (index, hash) = self.shard_index(&buffer.key);
        let mut shard = self.shards[index].lock();
        let slot = buffer.slot.load(Ordering::Acquire);
        if shard.map.get(&MixedKey(hash, buffer.key)) == Some(&slot) {
            shard.policy.remove(slot);
            shard.policy.insert(slot, hash, Placement::NoReuse);
        }
    }

    /// Reserves memory for one buffer, evicting, writing back and waiting as `urgency` allows.
    fn reserve(
        &self,
        charge_bytes: u64,
        waste_bytes: u64,
        urgency: Urgency,
    ) -> Result<(), CacheError> {
        let mut waited = Duration::ZERO;
        let step = Duration::from_millis(5);
        loop {
            if self.memory.try_charge(charge_bytes, waste_bytes) {
                return Ok(());
            }
            if self.evict_one() {
                continue;
            }
            if urgency == Urgency::Quick {
                return Err(CacheError::NoSpace { waited });
            }
            if self.clean_for_space()? {
                continue;
            }
            if waited >= self.config.space_wait_max {
                self.counters.space_failures.fetch_add(1, Ordering::Relaxed);
                return Err(CacheError::NoSpace { waited });
            }
            if waited.is_zero() {
                self.counters.space_waits.fetch_add(1, Ordering::Relaxed);
            }
            self.memory.wait_for_release(charge_bytes, step);
            waited += step;
        }
    }

    /// Writes back one cluster of dirty data so its buffers become evictable. Returns
    /// whether any buffer was cleaned; an error when nothing could be cleaned because
    /// writing failed, so the caller knows waiting would not help.
    pub fn clean_for_space(&self) -> Result<bool, CacheError> {
        let objects: Vec<Arc<ObjectState>> = self.objects.read().clone();
        Ok(self.clean_one_cluster(&objects, WritebackCause::Eviction)? > 0)
    }

    pub fn next_writeback_cursor(&self) -> usize {
        self.writeback_cursor.fetch_add(1, Ordering::Relaxed)
    }

    /// True when `key` is in the table (no pin, no statistics, no policy update).
    pub fn contains(&self, key: BlockKey) -> bool {
        let (index, hash) = self.shard_index(&key);
        self.shards[index]
            .lock()
            .map
            .contains_key(&MixedKey(hash, key))
    }

    /// Pins the buffer for `key` without counting a hit or telling the policy (write-back
    /// and invalidation are not uses).
    pub fn lookup_quiet(&self, key: BlockKey) -> Option<Arc<Buffer>> {
        let (index, hash) = self.shard_index(&key);
        let shard = self.shards[index].lock();
        let slot = *shard.map.get(&MixedKey(hash, key))?;
        Some(shard.pin(slot))
    }

    /// Inserts a new invalid buffer for `key` if it is absent and space is free without
    /// waiting (clustering and read-ahead extend runs only this way). Returns it locked
    /// exclusively and pinned, or None.
    pub fn insert_absent(
        &self,
        key: BlockKey,
        object: &ObjectState,
        placement: Placement,
        count_miss: bool,
    ) -> Option<Arc<Buffer>> {
        let (index, hash) = self.shard_index(&key);
        if self.shards[index]
            .lock()
            .map
            .contains_key(&MixedKey(hash, key))
        {
            return None;
        }
        let size = object.block_size_bytes as usize;
        let charge = self.config.charge_bytes(size as u64);
        self.reserve(charge, charge - size as u64, Urgency::Quick)
            .ok()?;
        let buffer = Buffer::new_locked(
            key,
            size,
            object.block_length_bytes(key.block),
            &self.pool,
            charge as u32,
            Arc::clone(&self.memory) as Arc<dyn MemoryRelease>,
        );
        let mut shard = self.shards[index].lock();
        if shard.map.contains_key(&MixedKey(hash, key)) {
            return None;
        }
        shard.attach(MixedKey(hash, key), &buffer, placement);
        if count_miss {
            shard.misses += 1;
        }
        Some(buffer)
    }

    /// Blocks of object `object_id` in `[first, end)` that are cached now, in order.
    pub fn cached_blocks(&self, object_id: u32, first: u64, end: u64) -> Vec<u64> {
        let mut blocks: Vec<u64> = Vec::new();
        for shard in self.shards.iter() {
            let shard = shard.lock();
            blocks.extend(
                shard
                    .map
                    .keys()
                    .filter(|key| key.1.object == object_id && (first..end).contains(&key.1.block))
                    .map(|key| key.1.block),
            );
        }
        blocks.sort_unstable();
        blocks
    }

    /// Dirty byte thresholds (background, limit) for the current memory limit.
    pub fn dirty_thresholds(&self) -> (u64, u64) {
        let memory = self.memory.bytes_max.load(Ordering::Acquire);
        (
            memory / 100 * self.config.dirty_background_percent as u64,
            memory / 100 * self.config.dirty_limit_percent as u64,
        )
    }
}
