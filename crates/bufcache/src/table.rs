//! The buffer table: which blocks are cached, in which slots, under which policy, and how
//! much memory they hold. It knows buffers and keys, never objects or devices.
//!
//! Blocks are mapped in *chunks* of [`CHUNK_BLOCKS`] consecutive blocks of one object: one
//! map entry holds the slots of a whole chunk, and a chunk lives in one shard. A request
//! touching a run of N blocks therefore costs about N / CHUNK_BLOCKS hash probes and shard
//! lock round trips ([`Table::lookup_run`]), not N — the per-block probes were cache misses
//! that cost a 1 MiB request more CPU than its data copy (issue #13's profiles).
//!
//! Who guards what:
//! - each *shard* mutex guards its chunk map, its slot table and its replacement policy
//!   instance; it is held only for table updates, never across device I/O or while waiting
//!   for a buffer lock;
//! - the *memory account* is two atomics (bytes, buffers) charged before a buffer is created
//!   and released when it is dropped, so both limits hold at every moment.
//!
//! Only evictable buffers are eviction candidates (4.4BSD's free lists): a buffer is *held*
//! off its policy's queues (flag `HELD`, [`Policy::hold`]) from its insertion, which is
//! always pinned and locked for its first fill, until an unpin finds it unpinned, clean and
//! not under write-back; a buffer already on the queues that the evictor finds pinned, dirty
//! or under write-back is held then, so it is examined once, not at every eviction. The
//! unpin that ends a hold puts the buffer back at its queue's insertion end. Every change of
//! DIRTY or WRITEBACK happens while the changer holds a pin, so the last unpin after it is
//! the one place a held buffer can become evictable.
//!
//! Invariants (asserted): a charge never pushes usage past the limit it was checked against;
//! `pins` grows only under the shard lock, and eviction (which checks `pins == 0` under that
//! lock) never takes a dirty buffer, one under write-back or a held one; a chunk's occupied
//! count equals its filled slots, and an empty chunk is removed.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use bufcache_policy::{Placement, Policy, Slot, Verdict};
use parking_lot::Mutex;

use crate::buffer::{BlockKey, Buffer, MemoryRelease, DIRTY, HELD, READAHEAD, WRITEBACK};
use crate::config::CacheConfig;
use crate::environment::Waiter;
use crate::stats::{CacheStats, Counters};
use bufcache_device::aligned::{BufferPool, Populate};

/// Consecutive blocks of one object that share a map entry and a shard. 16 slots of 4
/// bytes fill one cache line; a 1 MiB request of 4 KiB blocks touches 16 chunks.
pub(crate) const CHUNK_BLOCKS: u64 = 16;

/// Read-ahead not yet used may hold at most 1 / this of the buffers in use when the cache
/// is full; past it, read-ahead takes no more room (its window shrinks).
const READAHEAD_UNUSED_SHARE_MAX_DIVISOR: u64 = 4;

/// A chunk slot holding no block.
const NO_SLOT: Slot = Slot::MAX;

/// Hashes a [`ChunkKey`] by its own mixing function: keys are already well mixed, so the
/// table's hasher only passes the 64-bit value through.
#[derive(Default)]
struct PassThroughHasher(u64);

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

/// A chunk's identity with its mixed hash computed once.
#[derive(Clone, Copy, PartialEq, Eq)]
struct ChunkKey {
    hash: u64,
    object: u32,
    chunk: u64,
}

impl ChunkKey {
    fn of(object: u32, block: u64) -> ChunkKey {
        let chunk = block / CHUNK_BLOCKS;
        ChunkKey {
            hash: BlockKey {
                object,
                block: chunk,
            }
            .hash64(),
            object,
            chunk,
        }
    }

    fn first_block(&self) -> u64 {
        self.chunk * CHUNK_BLOCKS
    }
}

impl std::hash::Hash for ChunkKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

/// Position of `block` within its chunk.
fn chunk_index(block: u64) -> usize {
    (block % CHUNK_BLOCKS) as usize
}

/// The slots of one chunk's blocks.
struct Chunk {
    slots: [Slot; CHUNK_BLOCKS as usize],
    occupied: u32,
}

impl Chunk {
    fn empty() -> Chunk {
        Chunk {
            slots: [NO_SLOT; CHUNK_BLOCKS as usize],
            occupied: 0,
        }
    }

    fn slot(&self, block: u64) -> Option<Slot> {
        let slot = self.slots[chunk_index(block)];
        (slot != NO_SLOT).then_some(slot)
    }
}

/// One lock domain of the buffer table.
struct Shard {
    chunks: HashMap<ChunkKey, Chunk, BuildHasherDefault<PassThroughHasher>>,
    entries: Vec<Option<Arc<Buffer>>>,
    free_slots: Vec<Slot>,
    policy: Box<dyn Policy>,
    /// Slots the evictor found busy during one `evict` call, held after it (kept to reuse
    /// its allocation).
    busy: Vec<Slot>,
    hits: u64,
    misses: u64,
}

/// True when `buffer` cannot be evicted whatever its place: pinned, dirty or under
/// write-back. Sequentially consistent, paired with the `HELD` flag (see `Table::unpin`).
fn busy(buffer: &Buffer) -> bool {
    buffer.pins.load(Ordering::SeqCst) > 0
        || buffer.flags.load(Ordering::SeqCst) & (DIRTY | WRITEBACK) != 0
}

impl Shard {
    /// The slot mapped for `key`, whose chunk key is `chunk`.
    fn slot_of(&self, chunk: &ChunkKey, key: BlockKey) -> Option<Slot> {
        self.chunks.get(chunk)?.slot(key.block)
    }

    /// Publishes `buffer` under its key in a free slot and tells the policy.
    fn attach(&mut self, chunk: ChunkKey, buffer: &Arc<Buffer>, placement: Placement) {
        let slot = match self.free_slots.pop() {
            Some(slot) => slot,
            None => {
                self.entries.push(None);
                (self.entries.len() - 1) as Slot
            }
        };
        buffer.slot.store(slot, Ordering::Release);
        self.entries[slot as usize] = Some(Arc::clone(buffer));
        let entry = self.chunks.entry(chunk).or_insert_with(Chunk::empty);
        let index = chunk_index(buffer.key.block);
        strict_assert!(
            entry.slots[index] == NO_SLOT,
            "block {:?} attached twice",
            buffer.key
        );
        entry.slots[index] = slot;
        entry.occupied += 1;
        self.policy.insert(slot, buffer.key.hash64(), placement);
        // A new buffer is pinned and locked for its first fill: off the queues until its
        // last unpin.
        strict_assert!(
            buffer.pins.load(Ordering::Acquire) > 0,
            "attached {:?} unpinned",
            buffer.key
        );
        self.policy.hold(slot);
        buffer.flags.fetch_or(HELD, Ordering::SeqCst);
    }

    /// The buffer in `slot` if it is `buffer`.
    fn holds_buffer(&self, slot: Slot, buffer: &Buffer) -> bool {
        self.entries
            .get(slot as usize)
            .and_then(|entry| entry.as_deref())
            .is_some_and(|entry| std::ptr::eq(entry, buffer))
    }

    /// Holds off the queues every slot the last `evict` found busy, unless it stopped being
    /// busy meanwhile or became that call's `victim` (an unpin between two looks of one
    /// walk). `HELD` is set before the second look and the unpinner decrements the pins
    /// before it reads `HELD` (both sequentially consistent), so either this look sees the
    /// unpin or that unpinner sees `HELD` and puts the buffer back.
    fn hold_busy(&mut self, victim: Option<Slot>) {
        let Shard {
            busy: busy_slots,
            entries,
            policy,
            ..
        } = self;
        for slot in busy_slots.drain(..) {
            if victim == Some(slot) {
                continue;
            }
            let Some(buffer) = entries[slot as usize].as_ref() else {
                continue;
            };
            buffer.flags.fetch_or(HELD, Ordering::SeqCst);
            if busy(buffer) {
                policy.hold(slot);
            } else {
                buffer.flags.fetch_and(!HELD, Ordering::SeqCst);
            }
        }
    }

    /// Puts `buffer` back on the policy's queues if it is this shard's, held and evictable
    /// now (its last unpin found `HELD`; see `Table::unpin`).
    fn release_if_held_and_evictable(&mut self, buffer: &Buffer) {
        let slot = buffer.slot.load(Ordering::Acquire);
        if !self.holds_buffer(slot, buffer) || !buffer.has(HELD) || busy(buffer) {
            return;
        }
        buffer.flags.fetch_and(!HELD, Ordering::SeqCst);
        self.policy.release(slot);
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
        let chunk = ChunkKey::of(buffer.key.object, buffer.key.block);
        let entry = self
            .chunks
            .get_mut(&chunk)
            .expect("attached block has a chunk");
        let index = chunk_index(buffer.key.block);
        strict_assert!(
            entry.slots[index] == slot && entry.occupied > 0,
            "chunk of {:?} does not map its slot",
            buffer.key
        );
        entry.slots[index] = NO_SLOT;
        entry.occupied -= 1;
        if entry.occupied == 0 {
            self.chunks.remove(&chunk);
        }
        self.free_slots.push(slot);
        buffer
    }
}

/// Memory and buffer-count limits, charged before a buffer exists and released by its drop.
struct MemoryAccount {
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
        if waste_bytes > 0 {
            // (Skipped when there is nothing to add: a buffer of whole pages, the usual one,
            // costs one atomic read-modify-write less.)
            self.wasted_bytes.fetch_add(waste_bytes, Ordering::Relaxed);
        }
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
    /// True when something woke it or there was room (the caller should look again at once);
    /// false when the wait ran out with no notification.
    fn wait_for_release(&self, charge_bytes: u64, timeout_ns: u64) -> bool {
        self.waiters.fetch_add(1, Ordering::AcqRel);
        let ticket = self.waiter.ticket();
        let bytes_max = self.bytes_max.load(Ordering::Acquire);
        let room = self.used_bytes.load(Ordering::Acquire) + charge_bytes <= bytes_max
            && self.buffers.load(Ordering::Acquire) < self.buffers_max.load(Ordering::Acquire);
        let woken = room || {
            self.waiter.wait(ticket, timeout_ns);
            self.waiter.ticket() != ticket
        };
        self.waiters.fetch_sub(1, Ordering::AcqRel);
        woken
    }

    fn notify(&self) {
        if self.waiters.load(Ordering::Acquire) > 0 {
            self.waiter.notify_all();
        }
    }
}

impl MemoryRelease for MemoryAccount {
    fn release(&self, charge_bytes: u64, waste_bytes: u64) {
        self.used_bytes.fetch_sub(charge_bytes, Ordering::AcqRel);
        if waste_bytes > 0 {
            self.wasted_bytes.fetch_sub(waste_bytes, Ordering::Relaxed);
        }
        self.buffers.fetch_sub(1, Ordering::AcqRel);
        self.notify();
    }
}

/// Memory reserved for one new buffer ([`Table::try_reserve`]): either charged to the
/// account, or the clean buffer an eviction for this reservation just took out of the table,
/// whose header, bytes and charge the new buffer reuses ([`Buffer::recycle_locked`]).
/// Consumed by the insert it was made for; a recycled buffer dropped unused releases its
/// charge as any buffer does.
#[must_use]
pub(crate) enum Reservation {
    Charged,
    Recycled(Arc<Buffer>),
}

/// Result of looking a block up for use.
pub(crate) enum Lookup {
    /// The block was in the table; the buffer is pinned but not locked.
    Found(Arc<Buffer>),
    /// The block was not there; a new invalid buffer was inserted, pinned and locked
    /// exclusively.
    Inserted(Arc<Buffer>),
}

/// The sharded buffer table and its memory account.
pub(crate) struct Table {
    shards: Box<[Mutex<Shard>]>,
    shard_shift: u32,
    memory: Arc<MemoryAccount>,
    /// Where buffer bytes come from (page-aligned slots in large chunks).
    pool: Arc<BufferPool>,
    page_size_bytes: u64,
    evict_cursor: AtomicUsize,
    counters: Arc<Counters>,
}

impl Table {
    /// An empty table sized for `config`'s limits; waits for space go through `waiter`.
    pub(crate) fn new(
        config: &CacheConfig,
        waiter: Arc<dyn Waiter>,
        counters: Arc<Counters>,
    ) -> Table {
        let shard_count = config.shards.next_power_of_two();
        let capacity_hint = (config.buffers_max as usize)
            .min((config.memory_bytes_max / config.page_size_bytes) as usize)
            / shard_count;
        let shards = (0..shard_count)
            .map(|_| {
                Mutex::new(Shard {
                    chunks: HashMap::default(),
                    entries: Vec::new(),
                    free_slots: Vec::new(),
                    policy: config
                        .policy
                        .build_with(capacity_hint.max(1), &config.policy_parameters),
                    busy: Vec::new(),
                    hits: 0,
                    misses: 0,
                })
            })
            .collect();
        Table {
            shard_shift: 64 - shard_count.trailing_zeros(),
            shards,
            memory: Arc::new(MemoryAccount {
                used_bytes: AtomicU64::new(0),
                wasted_bytes: AtomicU64::new(0),
                buffers: AtomicU64::new(0),
                bytes_max: AtomicU64::new(config.memory_bytes_max),
                buffers_max: AtomicU64::new(config.buffers_max),
                waiters: AtomicUsize::new(0),
                waiter,
            }),
            pool: BufferPool::with_huge_pages(config.page_size_bytes as usize, config.huge_pages),
            page_size_bytes: config.page_size_bytes,
            evict_cursor: AtomicUsize::new(0),
            counters,
        }
    }

    /// The shard holding `chunk` (and so every block of it).
    fn shard_of(&self, chunk: &ChunkKey) -> &Mutex<Shard> {
        &self.shards[self.shard_index(chunk)]
    }

    fn shard_index(&self, chunk: &ChunkKey) -> usize {
        if self.shards.len() == 1 {
            0
        } else {
            (chunk.hash >> self.shard_shift) as usize
        }
    }

    /// Memory charged for a buffer of `size_bytes` (whole pages).
    fn charge_bytes(&self, size_bytes: u64) -> u64 {
        size_bytes.next_multiple_of(self.page_size_bytes)
    }

    /// A new invalid buffer for `key`, locked exclusively and pinned, in the memory of
    /// `reservation` ([`Table::try_reserve`] or the cache's waiting reservation).
    fn new_buffer(
        &self,
        reservation: Reservation,
        key: BlockKey,
        size_bytes: u64,
        length_bytes: u32,
    ) -> Arc<Buffer> {
        if let Reservation::Recycled(buffer) = reservation {
            return Buffer::recycle_locked(buffer, key, length_bytes);
        }
        Buffer::new_locked(
            key,
            size_bytes as usize,
            length_bytes,
            &self.pool,
            self.charge_bytes(size_bytes) as u32,
            Arc::clone(&self.memory) as Arc<dyn MemoryRelease>,
        )
    }

    /// Reserves memory for one buffer of `size_bytes` that will hold `key`, evicting clean
    /// buffers as needed, from `key`'s shard first.
    /// None when nothing more can be evicted now (the caller may write back or wait).
    /// A reservation `for_readahead` never evicts read-ahead nobody has used yet (rule 1 of
    /// "Admission under pressure" in docs/design.md): it fails instead, and the read-ahead
    /// window ends there.
    ///
    /// The buffer an eviction takes out becomes the reservation itself when it is the same
    /// size and nobody else references it (a full cache replacing one block with another,
    /// the common case): the new block reuses its header and bytes, so the eviction frees
    /// nothing and the insert allocates nothing. Which buffer is evicted does not change.
    /// Under a limit lowered at run time the evicted buffer is freed instead, so usage
    /// shrinks toward the limit.
    pub(crate) fn try_reserve(
        &self,
        size_bytes: u64,
        for_readahead: bool,
        key: BlockKey,
    ) -> Option<Reservation> {
        let charge = self.charge_bytes(size_bytes);
        loop {
            if self.memory.try_charge(charge, charge - size_bytes) {
                return Some(Reservation::Charged);
            }
            if for_readahead && self.readahead_unused_over_share() {
                return None;
            }
            let shard = self.shard_index(&ChunkKey::of(key.object, key.block));
            let mut evicted = self.evict_pass(!for_readahead, Some(shard))?;
            if Buffer::recyclable(&mut evicted, size_bytes as usize) && !self.memory.over_limit() {
                return Some(Reservation::Recycled(evicted));
            }
        }
    }

    /// Waits (through the injected waiter) until a buffer is released or `timeout_ns`.
    /// False when the wait ran out with nothing released (see `MemoryAccount`).
    pub(crate) fn wait_for_space(&self, size_bytes: u64, timeout_ns: u64) -> bool {
        self.memory
            .wait_for_release(self.charge_bytes(size_bytes), timeout_ns)
    }

    /// Wakes threads waiting for space (something became evictable or was freed).
    pub(crate) fn notify_space(&self) {
        self.memory.notify();
    }

    /// The memory limit in bytes now.
    pub(crate) fn memory_bytes_max(&self) -> u64 {
        self.memory.bytes_max.load(Ordering::Acquire)
    }

    /// Sets both limits; usage above them is brought down by later evictions.
    pub(crate) fn set_limits(&self, memory_bytes_max: u64, buffers_max: u64) {
        self.memory
            .bytes_max
            .store(memory_bytes_max, Ordering::Release);
        self.memory
            .buffers_max
            .store(buffers_max, Ordering::Release);
    }

    /// True while usage is above either limit.
    pub(crate) fn over_limit(&self) -> bool {
        self.memory.over_limit()
    }

    /// Gives buffer memory no buffer uses back to the system.
    pub(crate) fn trim(&self) {
        self.pool.trim();
    }

    /// Faults one more chunk of buffer memory in ahead of need while the pool stays within
    /// `bytes_max` and the memory limit. Returns whether it did.
    pub(crate) fn prefault_chunk(&self, bytes_max: u64, populate: Populate) -> bool {
        let bound = bytes_max.min(self.memory.bytes_max.load(Ordering::Acquire));
        self.pool
            .prefault_chunk(usize::try_from(bound).unwrap_or(usize::MAX), populate)
    }

    /// Gives back memory faulted in ahead of need when the pool holds more than the memory
    /// limit (the limit shrank).
    pub(crate) fn release_spares_over_limit(&self) {
        if self.pool.mapped_bytes() > self.memory.bytes_max.load(Ordering::Acquire) {
            self.pool.release_spares();
        }
    }

    /// Bytes of free buffer memory still resident.
    pub(crate) fn idle_resident_bytes(&self) -> u64 {
        self.pool.idle_resident_bytes()
    }

    /// Bytes of buffers someone holds. Visits every entry: for snapshots, never per request.
    pub(crate) fn pinned_bytes(&self) -> u64 {
        self.shards
            .iter()
            .map(|shard| {
                let shard = shard.lock();
                shard
                    .entries
                    .iter()
                    .flatten()
                    .filter(|buffer| buffer.pins.load(Ordering::Acquire) > 0)
                    .map(|buffer| buffer.charge_bytes as u64)
                    .sum::<u64>()
            })
            .sum()
    }

    /// Adds the table's counts and gauges to a statistics snapshot, but for `pinned_bytes`
    /// ([`Table::pinned_bytes`]): a lock per shard and no entry visited, so a caller may
    /// sample it often.
    pub(crate) fn fill_stats_without_pinned(&self, stats: &mut CacheStats) {
        for shard in self.shards.iter() {
            let shard = shard.lock();
            stats.hits += shard.hits;
            stats.misses += shard.misses;
        }
        stats.memory_used_bytes = self.memory.used_bytes.load(Ordering::Acquire);
        stats.memory_wasted_bytes = self.memory.wasted_bytes.load(Ordering::Acquire);
        stats.memory_prefaulted_bytes = self.pool.spare_bytes();
        stats.buffers_in_use = self.memory.buffers.load(Ordering::Acquire);
        stats.memory_bytes_max = self.memory.bytes_max.load(Ordering::Acquire);
        stats.buffers_max = self.memory.buffers_max.load(Ordering::Acquire);
    }

    /// Looks `key` up; on a hit records the access and pins the buffer.
    /// A hit from a no-reuse stream (`placement` NoReuse) is not reported to the policy, so
    /// the block stays at the eviction end where it was inserted: the stream consuming its
    /// own read-ahead must not promote it (seed 003's vm_page_dontneed on release).
    pub(crate) fn lookup(&self, key: BlockKey, placement: Placement) -> Option<Arc<Buffer>> {
        let chunk = ChunkKey::of(key.object, key.block);
        let mut shard = self.shard_of(&chunk).lock();
        let slot = shard.slot_of(&chunk, key)?;
        if placement == Placement::Normal {
            shard.policy.access(slot);
        }
        shard.hits += 1;
        Some(shard.pin(slot))
    }

    /// Inserts a new invalid buffer for `key` whose memory the caller has reserved, unless
    /// another thread inserted the block meanwhile: then theirs is found (a hit), and ours,
    /// never visible, is dropped, which releases the reservation.
    pub(crate) fn insert_reserved(
        &self,
        reservation: Reservation,
        key: BlockKey,
        size_bytes: u64,
        length_bytes: u32,
        placement: Placement,
    ) -> Lookup {
        let buffer = self.new_buffer(reservation, key, size_bytes, length_bytes);
        let chunk = ChunkKey::of(key.object, key.block);
        let mut shard = self.shard_of(&chunk).lock();
        if let Some(slot) = shard.slot_of(&chunk, key) {
            shard.policy.access(slot);
            shard.hits += 1;
            return Lookup::Found(shard.pin(slot));
        }
        shard.attach(chunk, &buffer, placement);
        shard.misses += 1;
        Lookup::Inserted(buffer)
    }

    /// Removes `buffer` from the table if it is still the one mapped for its key.
    pub(crate) fn remove(&self, buffer: &Arc<Buffer>) {
        let chunk = ChunkKey::of(buffer.key.object, buffer.key.block);
        let mut shard = self.shard_of(&chunk).lock();
        let slot = buffer.slot.load(Ordering::Acquire);
        let mapped = shard
            .entries
            .get(slot as usize)
            .and_then(|entry| entry.as_ref())
            .is_some_and(|entry| Arc::ptr_eq(entry, buffer));
        if mapped {
            shard.policy.remove(slot);
            let removed = shard.detach(slot);
            removed.flags.fetch_and(!HELD, Ordering::SeqCst);
            drop(shard);
            if removed.clear(READAHEAD) {
                self.counters
                    .readahead_wasted_blocks
                    .fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Releases one pin. The last one puts a held buffer back on its policy's queues when it
    /// is clean and not under write-back, and then wakes space waiters. A dirty buffer's last
    /// unpin wakes nobody: it frees no space (its write-back's end will, and wakes them
    /// then), and under a parallel upload every write's unpin woke every waiting writer only
    /// to find nothing evictable (a stampede of context switches). A waiter that could write
    /// it back itself looks again within its wait step.
    pub(crate) fn unpin(&self, buffer: &Buffer) {
        if buffer.pins.fetch_sub(1, Ordering::SeqCst) != 1 {
            return;
        }
        let flags = buffer.flags.load(Ordering::SeqCst);
        if flags & HELD != 0 {
            self.release_held(buffer);
        }
        if flags & DIRTY == 0 {
            self.memory.notify();
        }
    }

    /// [`Table::unpin`] for every buffer of `buffers`, in order, taking each shard lock once
    /// per run of consecutive buffers in the same chunk that their last unpins put back on
    /// the queues (a read's blocks come in order), and waking space waiters once (when a
    /// clean buffer was among them: see [`Table::unpin`]). Each buffer goes back at the same
    /// place in its queue as by one unpin after another.
    pub(crate) fn unpin_run<'b>(&self, buffers: impl IntoIterator<Item = &'b Buffer>) {
        let mut released_any = false;
        let mut held: smallvec::SmallVec<[&Buffer; 64]> = smallvec::SmallVec::new();
        for buffer in buffers {
            if buffer.pins.fetch_sub(1, Ordering::SeqCst) != 1 {
                continue;
            }
            let flags = buffer.flags.load(Ordering::SeqCst);
            released_any |= flags & DIRTY == 0;
            if flags & HELD != 0 {
                held.push(buffer);
            }
        }
        let mut held = held.into_iter().peekable();
        while let Some(first) = held.next() {
            let chunk = ChunkKey::of(first.key.object, first.key.block);
            let mut shard = self.shard_of(&chunk).lock();
            let mut next = Some(first);
            while let Some(buffer) = next {
                shard.release_if_held_and_evictable(buffer);
                next = held
                    .next_if(|buffer| ChunkKey::of(buffer.key.object, buffer.key.block) == chunk);
            }
        }
        if released_any {
            self.memory.notify();
        }
    }

    /// Puts `buffer` back on its shard policy's queues if it is held and evictable now.
    fn release_held(&self, buffer: &Buffer) {
        let chunk = ChunkKey::of(buffer.key.object, buffer.key.block);
        self.shard_of(&chunk)
            .lock()
            .release_if_held_and_evictable(buffer);
    }

    /// Blocks of `block_size_bytes` that read-ahead nobody has used yet may hold at most
    /// ([`Table::readahead_unused_over_share`]'s bound, taken from the limits rather than
    /// from the buffers in use, so it is known before the cache fills): what the streams'
    /// windows may claim together.
    pub(crate) fn readahead_spare_blocks(&self, block_size_bytes: u64) -> u64 {
        let by_memory = self.memory.bytes_max.load(Ordering::Acquire)
            / self.charge_bytes(block_size_bytes).max(1);
        let by_count = self.memory.buffers_max.load(Ordering::Acquire);
        by_memory.min(by_count) / READAHEAD_UNUSED_SHARE_MAX_DIVISOR
    }

    /// True when read-ahead nobody has used yet holds at least `READAHEAD_UNUSED_SHARE_MAX`
    /// of the buffers in use (read-ahead issued less used less wasted; reads still in flight
    /// are not counted yet). A full cache then refuses more read-ahead at once: its window
    /// ends without an eviction walk past unused read-ahead it may not take.
    fn readahead_unused_over_share(&self) -> bool {
        let counters = &self.counters;
        let unused = counters
            .readahead_issued_blocks
            .load(Ordering::Relaxed)
            .saturating_sub(counters.readahead_used_blocks.load(Ordering::Relaxed))
            .saturating_sub(counters.readahead_wasted_blocks.load(Ordering::Relaxed));
        unused * READAHEAD_UNUSED_SHARE_MAX_DIVISOR >= self.memory.buffers.load(Ordering::Acquire)
    }

    /// Evicts one clean, unpinned buffer chosen by a shard's policy, in the policy's order,
    /// read-ahead nobody has used yet included (counted as wasted). With no block to make
    /// room for, shards are visited round-robin so eviction pressure spreads evenly. One
    /// pass: sparing unused read-ahead
    /// while anything else could go walked over every unused read-ahead buffer at every
    /// eviction once read-ahead filled the cache; read-ahead is kept from crowding out its
    /// own readers instead by never evicting unused read-ahead itself
    /// ([`Table::try_reserve`]).
    pub(crate) fn evict_one(&self) -> bool {
        self.evict_pass(true, None).is_some()
    }

    /// Evicts one buffer as [`Table::evict_one`] does (sparing unused read-ahead unless
    /// `including_unused_readahead`) and returns it, out of the table. The look starts at
    /// `first_shard`, the shard of the block the room is for, when there is one: each insert
    /// then replaces a block of its own shard, so every shard keeps its share of the cache
    /// and its policy's order holds across the cache. Visited round-robin instead, a shard
    /// that happened to hold fewer blocks was drained as fast as the others, down to the
    /// blocks a request had just read and not yet sent, while other shards kept older ones
    /// (the request then read them again).
    fn evict_pass(
        &self,
        including_unused_readahead: bool,
        first_shard: Option<usize>,
    ) -> Option<Arc<Buffer>> {
        let shard_count = self.shards.len();
        let start = if shard_count == 1 {
            0
        } else if let Some(first_shard) = first_shard {
            first_shard
        } else {
            self.evict_cursor.fetch_add(1, Ordering::Relaxed)
        };
        for step in 0..shard_count {
            let mut shard = self.shards[(start + step) % shard_count].lock();
            let Shard {
                policy,
                entries,
                busy: busy_slots,
                ..
            } = &mut *shard;
            let mut examined = 0u64;
            let victim = policy.evict(&mut |slot| {
                examined += 1;
                let Some(buffer) = entries[slot as usize].as_ref() else {
                    return Verdict::Skip;
                };
                if busy(buffer) {
                    busy_slots.push(slot);
                    return Verdict::Skip;
                }
                if including_unused_readahead || !buffer.has(READAHEAD) {
                    Verdict::Evict
                } else {
                    // The shard's next victim is read-ahead nobody has used: this shard has
                    // nothing to spare for more read-ahead. Walking past every such buffer
                    // to find one that may go cost a buffer header read each, most of an
                    // eviction's work under a parallel copy.
                    Verdict::Stop
                }
            });
            shard.hold_busy(victim);
            self.counters
                .eviction_candidates_examined
                .fetch_add(examined, Ordering::Relaxed);
            if let Some(slot) = victim {
                let buffer = shard.detach(slot);
                drop(shard);
                strict_assert!(
                    !buffer.has(DIRTY) && !buffer.has(WRITEBACK) && !buffer.has(HELD),
                    "evicted {:?} while dirty, under write-back or held",
                    buffer.key
                );
                self.counters.evictions.fetch_add(1, Ordering::Relaxed);
                if buffer.has(READAHEAD) {
                    self.counters
                        .readahead_wasted_blocks
                        .fetch_add(1, Ordering::Relaxed);
                }
                return Some(buffer);
            }
        }
        None
    }

    /// Moves a block to the eviction end of its shard's policy (a no-reuse stream is done
    /// with it), by forgetting and re-inserting it with `NoReuse` placement.
    pub(crate) fn demote(&self, buffer: &Buffer) {
        self.demote_run(std::iter::once(buffer));
    }

    /// [`Table::demote`] for every buffer of `buffers`, taking each shard lock once per run
    /// of consecutive buffers in the same chunk (a stream's blocks come in order).
    pub(crate) fn demote_run<'b>(&self, buffers: impl IntoIterator<Item = &'b Buffer>) {
        let mut buffers = buffers.into_iter().peekable();
        while let Some(first) = buffers.next() {
            let chunk = ChunkKey::of(first.key.object, first.key.block);
            let mut shard = self.shard_of(&chunk).lock();
            let mut next = Some(first);
            while let Some(buffer) = next {
                let slot = buffer.slot.load(Ordering::Acquire);
                if shard.slot_of(&chunk, buffer.key) == Some(slot) {
                    shard.policy.remove(slot);
                    shard
                        .policy
                        .insert(slot, buffer.key.hash64(), Placement::NoReuse);
                    if buffer.has(HELD) {
                        shard.policy.hold(slot);
                    }
                }
                next = buffers
                    .next_if(|buffer| ChunkKey::of(buffer.key.object, buffer.key.block) == chunk);
            }
        }
    }

    /// True when `key` is in the table (no pin, no statistics, no policy update).
    pub(crate) fn contains(&self, key: BlockKey) -> bool {
        let chunk = ChunkKey::of(key.object, key.block);
        self.shard_of(&chunk).lock().slot_of(&chunk, key).is_some()
    }

    /// Pins the buffer for `key` without counting a hit or telling the policy (write-back
    /// and invalidation are not uses).
    pub(crate) fn lookup_quiet(&self, key: BlockKey) -> Option<Arc<Buffer>> {
        let chunk = ChunkKey::of(key.object, key.block);
        let shard = self.shard_of(&chunk).lock();
        let slot = shard.slot_of(&chunk, key)?;
        Some(shard.pin(slot))
    }

    /// Inserts a new invalid buffer for `key` if it is absent and space is free without
    /// waiting (clustering and read-ahead extend runs only this way). Returns it locked
    /// exclusively and pinned, or None. Space `for_readahead` is found without evicting
    /// unused read-ahead ([`Table::try_reserve`]).
    pub(crate) fn insert_absent(
        &self,
        key: BlockKey,
        size_bytes: u64,
        length_bytes: u32,
        placement: Placement,
        count_miss: bool,
        for_readahead: bool,
    ) -> Option<Arc<Buffer>> {
        if self.contains(key) {
            return None;
        }
        let reservation = self.try_reserve(size_bytes, for_readahead, key)?;
        let buffer = self.new_buffer(reservation, key, size_bytes, length_bytes);
        let chunk = ChunkKey::of(key.object, key.block);
        let mut shard = self.shard_of(&chunk).lock();
        if shard.slot_of(&chunk, key).is_some() {
            return None;
        }
        shard.attach(chunk, &buffer, placement);
        if count_miss {
            shard.misses += 1;
        }
        Some(buffer)
    }

    /// [`Table::insert_absent`] for the blocks `first`, `first + 1`, ... of `object` up to
    /// `end`, stopping at the first block already present or when no space is free without
    /// waiting. `block_of` gives each block's length, placement and whether it counts as a
    /// miss. Each shard lock is taken twice per chunk (a look, then the attach) instead of
    /// twice per block, and memory is reserved before either, since reserving may evict from
    /// any shard. Blocks from `readahead_from` on are read-ahead: their space is found
    /// without evicting unused read-ahead, so under pressure the run ends short instead.
    /// Returns the buffers in block order, locked exclusively and pinned.
    pub(crate) fn insert_absent_run(
        &self,
        object: u32,
        first: u64,
        end: u64,
        size_bytes: u64,
        readahead_from: u64,
        mut block_of: impl FnMut(u64) -> (u32, Placement, bool),
    ) -> Vec<Arc<Buffer>> {
        let mut inserted = Vec::with_capacity(end.saturating_sub(first) as usize);
        let mut block = first;
        while block < end {
            let chunk = ChunkKey::of(object, block);
            let stop = end.min(chunk.first_block() + CHUNK_BLOCKS);
            let absent = {
                let shard = self.shard_of(&chunk).lock();
                match shard.chunks.get(&chunk) {
                    None => stop - block,
                    Some(entry) => (block..stop)
                        .take_while(|&block| entry.slot(block).is_none())
                        .count() as u64,
                }
            };
            let mut reservations = Vec::with_capacity(absent as usize);
            while (reservations.len() as u64) < absent {
                let for_readahead = block + reservations.len() as u64 >= readahead_from;
                match self.try_reserve(size_bytes, for_readahead, BlockKey { object, block }) {
                    Some(reservation) => reservations.push(reservation),
                    None => break,
                }
            }
            // Made before the attach, so no allocation happens under the shard lock.
            let fresh: Vec<_> = reservations
                .into_iter()
                .zip(block..)
                .map(|(reservation, block)| {
                    let (length_bytes, placement, count_miss) = block_of(block);
                    let key = BlockKey { object, block };
                    let buffer = self.new_buffer(reservation, key, size_bytes, length_bytes);
                    (buffer, placement, count_miss)
                })
                .collect();
            let mut fresh = fresh.into_iter();
            let attached_from = inserted.len();
            // A buffer that lost its block to another thread meanwhile is dropped (its memory
            // released) after the shard lock, as are the ones after it.
            let mut lost = None;
            {
                let mut shard = self.shard_of(&chunk).lock();
                for (buffer, placement, count_miss) in fresh.by_ref() {
                    if shard.slot_of(&chunk, buffer.key).is_some() {
                        lost = Some(buffer);
                        break;
                    }
                    shard.attach(chunk, &buffer, placement);
                    if count_miss {
                        shard.misses += 1;
                    }
                    inserted.push(buffer);
                }
            }
            drop(lost);
            drop(fresh);
            let attached = (inserted.len() - attached_from) as u64;
            block += attached;
            if block < stop {
                break;
            }
        }
        inserted
    }

    /// Blocks of object `object_id` in `[first, end)` that are cached now, in order.
    pub(crate) fn cached_blocks(&self, object_id: u32, first: u64, end: u64) -> Vec<u64> {
        let mut blocks: Vec<u64> = Vec::new();
        for shard in self.shards.iter() {
            let shard = shard.lock();
            for (key, chunk) in shard.chunks.iter() {
                if key.object != object_id {
                    continue;
                }
                let chunk_first = key.first_block();
                blocks.extend(
                    (chunk_first..chunk_first + CHUNK_BLOCKS)
                        .filter(|block| (first..end).contains(block))
                        .filter(|&block| chunk.slot(block).is_some()),
                );
            }
        }
        blocks.sort_unstable();
        blocks
    }

    /// Looks up every block of object `object` in `[first, end)`, taking each shard lock
    /// once per chunk. Found blocks are pinned; with `use_placement` Some, each counts as a
    /// hit and (for `Normal`) an access, as [`Table::lookup`] does; None looks quietly, as
    /// [`Table::lookup_quiet`] does.
    pub(crate) fn lookup_run(
        &self,
        object: u32,
        first: u64,
        end: u64,
        use_placement: Option<Placement>,
    ) -> RunLookup<'_> {
        let mut buffers = RunBuffers::with_capacity(end.saturating_sub(first) as usize);
        let mut block = first;
        while block < end {
            let chunk = ChunkKey::of(object, block);
            let stop = (chunk.first_block() + CHUNK_BLOCKS).min(end);
            let mut shard = self.shard_of(&chunk).lock();
            let slots = shard.chunks.get(&chunk).map(|entry| entry.slots);
            for block in block..stop {
                let slot = slots
                    .map(|slots| slots[chunk_index(block)])
                    .filter(|&slot| slot != NO_SLOT);
                buffers.push(slot.map(|slot| {
                    if let Some(placement) = use_placement {
                        if placement == Placement::Normal {
                            shard.policy.access(slot);
                        }
                        shard.hits += 1;
                    }
                    shard.pin(slot)
                }));
            }
            block = stop;
        }
        RunLookup {
            table: self,
            first,
            buffers,
            counted_hits: use_placement.is_some(),
        }
    }

    /// Whether every block of object `object` in `[first, end)` is in the table, looking at
    /// no more than `chunks_checked_max` chunks (evenly spaced, and always the last): one
    /// probe per chunk, no pins, no statistics. Past that many chunks it is a sample — runs
    /// are cached and evicted mostly whole (read-ahead, clustering), so a sampled run is
    /// almost always wholly present.
    pub(crate) fn run_present(
        &self,
        object: u32,
        first: u64,
        end: u64,
        chunks_checked_max: u64,
    ) -> bool {
        if first >= end {
            return true;
        }
        let first_chunk = first / CHUNK_BLOCKS;
        let last_chunk = (end - 1) / CHUNK_BLOCKS;
        let step = (last_chunk - first_chunk + 1).div_ceil(chunks_checked_max.max(1));
        let chunk_present = |chunk_number: u64| {
            let chunk = ChunkKey::of(object, chunk_number * CHUNK_BLOCKS);
            let from = first.max(chunk.first_block());
            let to = end.min(chunk.first_block() + CHUNK_BLOCKS);
            let shard = self.shard_of(&chunk).lock();
            shard
                .chunks
                .get(&chunk)
                .is_some_and(|entry| (from..to).all(|block| entry.slot(block).is_some()))
        };
        (first_chunk..=last_chunk)
            .step_by(step as usize)
            .all(chunk_present)
            && chunk_present(last_chunk)
    }

    /// True when no block of `[first, end)` of `object` is cached (nor being filled): one
    /// probe per chunk of blocks, nothing counted.
    pub(crate) fn run_absent(&self, object: u32, first: u64, end: u64) -> bool {
        let mut block = first;
        while block < end {
            let chunk = ChunkKey::of(object, block);
            let stop = end.min(chunk.first_block() + CHUNK_BLOCKS);
            let shard = self.shard_of(&chunk).lock();
            if let Some(entry) = shard.chunks.get(&chunk) {
                if (block..stop).any(|block| entry.slot(block).is_some()) {
                    return false;
                }
            }
            block = stop;
        }
        true
    }

    /// The first block of `[first, end)` of `object` that is not in the table (`end` when
    /// every one is): one probe per chunk of blocks, nothing counted. A hint, like
    /// [`Table::run_absent`]: the block may be inserted by someone else at once.
    pub(crate) fn first_absent(&self, object: u32, first: u64, end: u64) -> u64 {
        let mut block = first;
        while block < end {
            let chunk = ChunkKey::of(object, block);
            let stop = end.min(chunk.first_block() + CHUNK_BLOCKS);
            let shard = self.shard_of(&chunk).lock();
            let Some(entry) = shard.chunks.get(&chunk) else {
                return block;
            };
            if let Some(absent) = (block..stop).find(|&block| entry.slot(block).is_none()) {
                return absent;
            }
            block = stop;
        }
        end
    }

    /// The first block of `[first, end)` of `object` that is in the table (`end` when none
    /// is): one probe per chunk of blocks, nothing counted. A hint, like
    /// [`Table::first_absent`].
    pub(crate) fn first_present(&self, object: u32, first: u64, end: u64) -> u64 {
        let mut block = first;
        while block < end {
            let chunk = ChunkKey::of(object, block);
            let stop = end.min(chunk.first_block() + CHUNK_BLOCKS);
            let shard = self.shard_of(&chunk).lock();
            if let Some(entry) = shard.chunks.get(&chunk) {
                if let Some(present) = (block..stop).find(|&block| entry.slot(block).is_some()) {
                    return present;
                }
            }
            block = stop;
        }
        end
    }

    /// Counts a miss for each block of `[first, end)` of `object`, which a streaming read
    /// served without caching: one shard lock per chunk.
    pub(crate) fn count_misses(&self, object: u32, first: u64, end: u64) {
        let mut block = first;
        while block < end {
            let chunk = ChunkKey::of(object, block);
            let stop = end.min(chunk.first_block() + CHUNK_BLOCKS);
            self.shard_of(&chunk).lock().misses += stop - block;
            block = stop;
        }
    }

    /// Takes back the hit counted for a looked-up block its caller did not use.
    pub(crate) fn uncount_hit(&self, key: BlockKey) {
        let chunk = ChunkKey::of(key.object, key.block);
        let mut shard = self.shard_of(&chunk).lock();
        shard.hits = shard.hits.saturating_sub(1);
    }

    /// Takes back the miss counted for an inserted block whose read was given up before it
    /// was issued (the reader will look the block up, and count it, again).
    pub(crate) fn uncount_miss(&self, key: BlockKey) {
        let chunk = ChunkKey::of(key.object, key.block);
        let mut shard = self.shard_of(&chunk).lock();
        shard.misses = shard.misses.saturating_sub(1);
    }
}

/// The buffers of a [`RunLookup`], by block from its first: inline for short runs, so the
/// common read of a block or two allocates nothing.
type RunBuffers = smallvec::SmallVec<[Option<Arc<Buffer>>; 4]>;

/// The blocks of a run looked up at once ([`Table::lookup_run`]): the caller takes the
/// buffers it uses, in any order; the ones it leaves are unpinned (and their hits taken
/// back) when this is dropped.
pub(crate) struct RunLookup<'table> {
    table: &'table Table,
    first: u64,
    buffers: RunBuffers,
    counted_hits: bool,
}

impl RunLookup<'_> {
    /// The pinned buffer of `block` if it was cached at lookup time and is not taken yet.
    pub(crate) fn take(&mut self, block: u64) -> Option<Arc<Buffer>> {
        let index = usize::try_from(block.checked_sub(self.first)?).ok()?;
        self.buffers.get_mut(index)?.take()
    }

    /// Whether `block` was cached at lookup time and its buffer is not taken yet.
    pub(crate) fn holds(&self, block: u64) -> bool {
        block
            .checked_sub(self.first)
            .and_then(|index| self.buffers.get(usize::try_from(index).ok()?))
            .is_some_and(Option::is_some)
    }

    /// Returns a taken buffer its caller did not use after all: unpinned, its hit taken back.
    pub(crate) fn give_back(&self, buffer: Arc<Buffer>) {
        if self.counted_hits {
            self.table.uncount_hit(buffer.key);
        }
        self.table.unpin(&buffer);
    }
}

impl Drop for RunLookup<'_> {
    fn drop(&mut self) {
        for buffer in self.buffers.drain(..).flatten() {
            if self.counted_hits {
                self.table.uncount_hit(buffer.key);
            }
            self.table.unpin(&buffer);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::environment::NoWait;

    const BLOCK: u64 = 4096;

    fn table(buffers: u64) -> Table {
        let config = CacheConfig {
            buffer_bytes_max: BLOCK,
            memory_bytes_max: buffers * BLOCK,
            buffers_max: buffers,
            shards: 1,
            ..CacheConfig::default()
        };
        Table::new(&config, Arc::new(NoWait), Arc::new(Counters::default()))
    }

    /// Inserts `[first, end)` of object 0 as `Table::insert_absent_run` does for a run whose
    /// read-ahead starts at `readahead_from`.
    fn insert(table: &Table, first: u64, end: u64, readahead_from: u64) -> Vec<Arc<Buffer>> {
        table.insert_absent_run(0, first, end, BLOCK, readahead_from, |_| {
            (BLOCK as u32, Placement::Normal, false)
        })
    }

    /// Ends the first fill of `buffers` as a reader would: unlocked, unpinned, and the
    /// references let go (an evicted buffer's memory returns when its last one goes).
    fn release(table: &Table, buffers: Vec<Arc<Buffer>>) {
        for buffer in &buffers {
            // SAFETY: inserted buffers are locked exclusively by their inserter, this test.
            unsafe { buffer.unlock_exclusive() };
            table.unpin(buffer);
        }
    }

    #[test]
    fn an_insert_evicts_in_its_own_shard_so_a_small_shard_keeps_its_newest_blocks() {
        // Goal: room for a block is made in that block's shard first, so a shard holding
        // fewer blocks than the others is not drained down to the blocks just read into it
        // while other shards keep older ones. Method: a 16-buffer table of two shards, 12
        // old blocks in shard 0 and 4 in shard 1; 4 new blocks go to shard 1, then 8 to
        // shard 0. Every new block of shard 1 is still cached, and shard 0's 8 inserts took
        // 8 of its own old blocks. Round-robin eviction took shard 1's new blocks.
        let config = CacheConfig {
            buffer_bytes_max: BLOCK,
            memory_bytes_max: 16 * BLOCK,
            buffers_max: 16,
            shards: 2,
            ..CacheConfig::default()
        };
        let table = Table::new(&config, Arc::new(NoWait), Arc::new(Counters::default()));
        let chunks_of_shard = |shard: usize| -> Vec<u64> {
            (0..)
                .map(|chunk| chunk * CHUNK_BLOCKS)
                .filter(|&block| table.shard_index(&ChunkKey::of(0, block)) == shard)
                .take(2)
                .collect()
        };
        let (shard0, shard1) = (chunks_of_shard(0), chunks_of_shard(1));
        let old0 = insert(&table, shard0[0], shard0[0] + 12, u64::MAX);
        let old1 = insert(&table, shard1[0], shard1[0] + 4, u64::MAX);
        assert_eq!((old0.len(), old1.len()), (12, 4));
        release(&table, old0);
        release(&table, old1);
        let new1 = insert(&table, shard1[1], shard1[1] + 4, u64::MAX);
        assert_eq!(new1.len(), 4);
        release(&table, new1);
        let new0 = insert(&table, shard0[1], shard0[1] + 8, u64::MAX);
        assert_eq!(new0.len(), 8);
        release(&table, new0);
        let cached = |first: u64, end: u64| {
            (first..end)
                .filter(|&block| table.contains(BlockKey { object: 0, block }))
                .count()
        };
        assert_eq!(
            cached(shard1[1], shard1[1] + 4),
            4,
            "shard 1's new blocks stay"
        );
        assert_eq!(
            cached(shard1[0], shard1[0] + 4),
            0,
            "shard 1's old blocks made room"
        );
        assert_eq!(
            cached(shard0[0], shard0[0] + 12),
            4,
            "shard 0 replaced its own"
        );
    }

    #[test]
    fn readahead_never_evicts_readahead_not_yet_used() {
        // Goal: rule 3 of "Admission under pressure" (docs/design.md): read-ahead finds room
        // only in what its policy would evict before unused read-ahead, so under pressure its
        // window ends short, after one look; a reader's own blocks may still evict unused
        // read-ahead. Method: an 8-buffer table filled with unused read-ahead; a read-ahead
        // run of 4 blocks gets none, evicts nothing and examines one candidate; then a
        // reader's run of 2 gets both, evicting 2 (counted wasted); once the reader has used
        // them (a stream's used blocks go to the eviction end), a read-ahead run of 4 gets
        // only those 2.
        let table = table(8);
        let examined = || {
            table
                .counters
                .eviction_candidates_examined
                .load(Ordering::Relaxed)
        };
        let filled = insert(&table, 0, 8, 0);
        assert_eq!(filled.len(), 8);
        for buffer in &filled {
            buffer.set(READAHEAD);
        }
        release(&table, filled);
        assert!(insert(&table, 100, 104, 100).is_empty(), "window ends");
        assert_eq!(table.counters.evictions.load(Ordering::Relaxed), 0);
        assert_eq!(examined(), 1, "the first unused read-ahead ends the look");
        let reader = insert(&table, 200, 202, u64::MAX);
        assert_eq!(reader.len(), 2, "a reader evicts unused read-ahead");
        assert_eq!(
            table
                .counters
                .readahead_wasted_blocks
                .load(Ordering::Relaxed),
            2
        );
        table.demote_run(reader.iter().map(|buffer| &**buffer));
        release(&table, reader);
        // The reader's two used blocks may go for read-ahead, nothing more: the window
        // shrinks to 2 of its 4 blocks.
        let examined_before = examined();
        let shrunk = insert(&table, 300, 304, 300);
        assert_eq!(shrunk.len(), 2, "window shrunk to what the cache can spare");
        assert_eq!(examined() - examined_before, 3, "two taken, one stop");
        assert_eq!(table.counters.evictions.load(Ordering::Relaxed), 4);
        assert_eq!(
            table
                .counters
                .readahead_wasted_blocks
                .load(Ordering::Relaxed),
            2
        );
        release(&table, shrunk);
    }

    #[test]
    fn busy_buffers_are_held_off_the_queues_and_come_back_on_their_last_unpin() {
        // Goal: a pinned buffer is not an eviction candidate, and comes back as one when its
        // last pin goes. Method: a 4-buffer table; 3 buffers stay pinned, 1 is released; an
        // eviction takes the released one after examining only it; once the pinned ones are
        // released, 3 more evictions each examine one candidate.
        let table = table(4);
        let mut buffers = insert(&table, 0, 4, u64::MAX);
        assert_eq!(buffers.len(), 4);
        release(&table, buffers.split_off(3));
        let examined = || {
            table
                .counters
                .eviction_candidates_examined
                .load(Ordering::Relaxed)
        };
        assert!(table.evict_one());
        assert_eq!(examined(), 1, "only the released buffer was a candidate");
        assert!(!table.evict_one(), "the pinned ones are not evictable");
        assert_eq!(examined(), 1, "and not examined");
        release(&table, buffers);
        for _ in 0..3 {
            assert!(table.evict_one());
        }
        assert_eq!(examined(), 4);
    }

    #[test]
    fn an_insert_that_evicts_reuses_the_victim_and_evicts_in_the_policys_order() {
        // Goal: an eviction made for an insert hands the victim's header and bytes to the new
        // block (nothing freed, nothing allocated) without changing which buffer is evicted
        // or what the memory account holds. Method: an 8-buffer table filled and released;
        // a reader's run of 4 new blocks; the blocks left must be those the same policy,
        // fed the same inserts, holds and releases, keeps after 4 evictions; each new buffer
        // must be one of the victims' allocations, under its new key, locked and unflagged
        // but for HELD; the account still holds 8 buffers of one block each.
        let table = table(8);
        let filled = insert(&table, 0, 8, u64::MAX);
        let addresses: Vec<usize> = filled
            .iter()
            .map(|buffer| Arc::as_ptr(buffer) as usize)
            .collect();
        release(&table, filled);
        let config = CacheConfig::default();
        let mut policy = config.policy.build_with(8, &config.policy_parameters);
        for slot in 0..8 {
            policy.insert(
                slot,
                BlockKey {
                    object: 0,
                    block: slot as u64,
                }
                .hash64(),
                Placement::Normal,
            );
            policy.hold(slot);
        }
        for slot in 0..8 {
            policy.release(slot);
        }
        let victims: Vec<u64> = (0..4)
            .map(|_| u64::from(policy.evict(&mut |_| Verdict::Evict).expect("a victim")))
            .collect();
        let reader = insert(&table, 100, 104, u64::MAX);
        assert_eq!(reader.len(), 4);
        for block in 0..8 {
            assert_eq!(
                table.contains(BlockKey { object: 0, block }),
                !victims.contains(&block),
                "block {block}: victims in the policy's order are {victims:?}"
            );
        }
        for (buffer, block) in reader.iter().zip(100..) {
            let address = Arc::as_ptr(buffer) as usize;
            let victim = addresses.iter().position(|&a| a == address);
            assert!(
                victim.is_some_and(|index| victims.contains(&(index as u64))),
                "block {block} got a victim's buffer"
            );
            assert_eq!(buffer.key, BlockKey { object: 0, block });
            assert_eq!(buffer.pins.load(Ordering::Acquire), 1);
            assert_eq!(buffer.flags.load(Ordering::Acquire), HELD);
            assert!(!buffer.try_lock_shared(), "locked exclusively for its fill");
        }
        assert_eq!(table.memory.used_bytes.load(Ordering::Acquire), 8 * BLOCK);
        assert_eq!(table.memory.buffers.load(Ordering::Acquire), 8);
        assert_eq!(table.counters.evictions.load(Ordering::Relaxed), 4);
        release(&table, reader);
    }

    #[test]
    fn an_evicted_buffer_someone_still_references_is_never_reused() {
        // Goal: only a victim nobody else references becomes a new block's buffer, so no
        // holder of an old reference ever sees its key or bytes change, and its memory stays
        // charged until the last reference goes. Method: a 4-buffer table filled, its blocks
        // written, released, but every reference kept; an insert evicts all four and gets
        // no room (their memory is still live); the kept buffers keep their keys and bytes;
        // once they are let go the insert gets its buffer.
        let table = table(4);
        let filled = insert(&table, 0, 4, u64::MAX);
        for buffer in &filled {
            // SAFETY: locked exclusively by this test since the insert.
            unsafe { buffer.bytes_mut().fill(buffer.key.block as u8 + 1) };
        }
        let kept: Vec<Arc<Buffer>> = filled.iter().map(Arc::clone).collect();
        release(&table, filled);
        assert!(insert(&table, 100, 101, u64::MAX).is_empty(), "no room");
        assert_eq!(table.counters.evictions.load(Ordering::Relaxed), 4);
        for (buffer, block) in kept.iter().zip(0..) {
            assert_eq!(buffer.key, BlockKey { object: 0, block });
            buffer.lock_shared();
            // SAFETY: locked shared just above.
            let intact = unsafe { buffer.bytes() }
                .iter()
                .all(|&byte| byte == block as u8 + 1);
            // SAFETY: locked shared just above.
            unsafe { buffer.unlock_shared() };
            assert!(intact, "block {block}'s bytes unchanged");
        }
        assert_eq!(table.memory.buffers.load(Ordering::Acquire), 4);
        drop(kept);
        assert_eq!(table.memory.buffers.load(Ordering::Acquire), 0);
        let reader = insert(&table, 100, 101, u64::MAX);
        assert_eq!(reader.len(), 1);
        release(&table, reader);
    }

    #[test]
    fn unpinning_a_run_together_requeues_in_the_same_order_as_one_by_one() {
        // Goal: `unpin_run` (one shard lock per chunk) puts buffers back on the policy's
        // queues exactly as unpinning them one after another does. Method: two identical
        // 8-buffer tables, blocks in two chunks, released in an interleaved order, one table
        // buffer by buffer and the other with `unpin_run`; evicting everything from each
        // must take the blocks in the same order.
        let blocks = [16, 0, 1, 17, 2, 18, 3, 19];
        let order_of = |together: bool| -> Vec<u64> {
            let table = table(8);
            let mut buffers = insert(&table, 0, 4, u64::MAX);
            buffers.extend(insert(&table, 16, 20, u64::MAX));
            let ordered: Vec<Arc<Buffer>> = blocks
                .iter()
                .map(|&block| {
                    let index = buffers.iter().position(|buffer| buffer.key.block == block);
                    Arc::clone(&buffers[index.expect("inserted")])
                })
                .collect();
            drop(buffers);
            for buffer in &ordered {
                // SAFETY: locked exclusively by this test since the insert.
                unsafe { buffer.unlock_exclusive() };
            }
            if together {
                table.unpin_run(ordered.iter().map(|buffer| &**buffer));
            } else {
                for buffer in &ordered {
                    table.unpin(buffer);
                }
            }
            drop(ordered);
            std::iter::from_fn(|| table.evict_pass(true, None).map(|buffer| buffer.key.block))
                .collect()
        };
        let one_by_one = order_of(false);
        assert_eq!(one_by_one.len(), 8);
        assert_eq!(order_of(true), one_by_one);
    }
}
