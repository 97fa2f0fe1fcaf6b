//! Buffers: one cached block of one object, its lock, its state flags and its pin count.
//!
//! States of a buffer (see docs/design.md):
//! - *invalid*: just inserted, its bytes not yet read. An invalid buffer is always held
//!   exclusively by the thread that inserted it; it becomes valid or is removed before that
//!   lock is released, so nobody ever sees an invalid buffer's bytes.
//! - *clean*: valid and equal to the device.
//! - *dirty*: valid and newer than the device; listed in its object's dirty set.
//! - *pinned*: someone holds a handle (`pins > 0`); it cannot be evicted.
//! - *under I/O*: its lock is held (exclusively for a read into it, shared for a write-back
//!   from it) for the duration of the device request.
//!
//! Invariants:
//! - `pins` is incremented only under the owning shard's lock, so the evictor, which checks
//!   `pins == 0` under that lock, can never evict a buffer someone is about to use;
//! - DIRTY is set only under the exclusive lock and cleared only under a lock (shared or
//!   exclusive) after the device accepted the bytes, so data is never marked clean unless
//!   it reached the device;
//! - memory is charged when a buffer is created and released when it is dropped, so the
//!   memory limit covers every live buffer, including ones removed but still referenced.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use parking_lot::lock_api::RawRwLock as _;
use parking_lot::RawRwLock;

use bufcache_device::aligned::{BufferPool, PooledBytes};

/// The data bytes are valid (read from the device or wholly written).
pub(crate) const VALID: u32 = 1;
/// The bytes are newer than the device.
pub(crate) const DIRTY: u32 = 2;
/// Read ahead and not yet used by a reader; evicting it counts as wasted read-ahead.
pub(crate) const READAHEAD: u32 = 4;
/// A write-back of this buffer is in flight; other write-backs skip it or wait for it, so
/// the same bytes are not written twice.
pub(crate) const WRITEBACK: u32 = 8;
/// Write-behind wrote this buffer's bytes since it was cached. A write that dirties it again
/// is rewriting hot data, which write-behind would write over and over; such writes are left
/// to the dirty thresholds, age and flushes, which absorb repeated rewrites (see
/// `ObjectHandle::write_from`). Set by write-back, never cleared: it ends with the buffer.
pub(crate) const WRITTEN_BEHIND: u32 = 16;
/// A thread waits for this buffer's write-back in flight to end; whoever ends it wakes the
/// waiters. Without it a waiter learnt of the end only at its next look, after a sleep that
/// (at 50 µs and up) outlasted a local file's write: 11% of the FLUSHes of a FLUSH-heavy run
/// waited so, about 180 µs each.
pub(crate) const WRITEBACK_WAITED: u32 = 32;
/// The table holds this buffer off its shard policy's eviction queues (4.4BSD's `bremfree`):
/// it was pinned, dirty or under write-back when the table last looked, so the evictor does
/// not walk over it. Set and cleared only under the shard's lock; the unpin that may make the
/// buffer evictable reads it without the lock and, when set, puts the buffer back
/// (`Table::unpin`).
pub(crate) const HELD: u32 = 64;
/// A started read waits for this buffer's exclusive lock to be let go (the attached-reads
/// registry); whoever lets it go runs the reads attached to it. Cleared by that releaser.
pub(crate) const ATTACHED: u32 = 128;

/// Identity of a cached block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockKey {
    /// The object the block belongs to.
    pub object: u32,
    /// Logical block number within the object.
    pub block: u64,
}

impl BlockKey {
    /// A well-mixed 64-bit hash (also used to pick the shard and by policies' ghost lists).
    pub fn hash64(&self) -> u64 {
        let mixed = self.block ^ ((self.object as u64) << 48) ^ ((self.object as u64) >> 16);
        let mut value = mixed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        value ^= value >> 29;
        value = value.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        value ^ (value >> 32)
    }
}

/// Releases charged memory when a buffer is dropped.
pub(crate) trait MemoryRelease: Send + Sync {
    fn release(&self, charge_bytes: u64, waste_bytes: u64);
}

/// One cached block.
pub(crate) struct Buffer {
    pub key: BlockKey,
    /// Bytes of the block that exist on the device (the last block of an object may be short).
    pub length_bytes: u32,
    pub charge_bytes: u32,
    pub slot: AtomicU32,
    pub pins: AtomicU32,
    pub flags: AtomicU32,
    /// When the buffer last became dirty, on the injected clock.
    lock: RawRwLock,
    data: UnsafeCell<PooledBytes>,
    memory: Arc<dyn MemoryRelease>,
}

// SAFETY: `data` is only touched through the guards below, which hold `lock` shared (read) or
// exclusively (write); every other field is atomic or immutable.
unsafe impl Sync for Buffer {}
// SAFETY: as above; PooledBytes is Send.
unsafe impl Send for Buffer {}

impl Buffer {
    /// A new invalid buffer, already locked exclusively and pinned once by its creator.
    pub fn new_locked(
        key: BlockKey,
        size_bytes: usize,
        length_bytes: u32,
        pool: &Arc<BufferPool>,
        charge_bytes: u32,
        memory: Arc<dyn MemoryRelease>,
    ) -> Arc<Buffer> {
        let buffer = Buffer {
            key,
            length_bytes,
            charge_bytes,
            slot: AtomicU32::new(u32::MAX),
            pins: AtomicU32::new(1),
            flags: AtomicU32::new(0),
            lock: RawRwLock::INIT,
            // Not zeroed: an invalid buffer is filled (device read, whole write) before anyone
            // reads it, so zeroing would be a wasted pass; only the part past a short last
            // block, which nothing fills, is zeroed below. `bsd::getblk` zeroes the rest of
            // a new buffer it hands to a caller.
            data: UnsafeCell::new(pool.allocate_unzeroed(size_bytes)),
            memory,
        };
        buffer.lock.lock_exclusive();
        if (length_bytes as usize) < size_bytes {
            // SAFETY: locked exclusively just above, and not yet shared with anyone.
            unsafe { buffer.bytes_mut()[length_bytes as usize..].fill(0) };
        }
        // (Not even an empty fill for a whole block: glibc's AVX-512 memset ends an empty
        // fill with a masked store at the slice's end — the next slot's first byte — which
        // cost 7% of a bulk upload's engine time in page-walk assists.)
        Arc::new(buffer)
    }

    /// True when `buffer`, just evicted, can become a new buffer of `size_bytes` in place
    /// ([`Buffer::recycle_locked`]): nobody else references it and its bytes are that long.
    pub fn recyclable(buffer: &mut Arc<Buffer>, size_bytes: usize) -> bool {
        Arc::get_mut(buffer).is_some_and(|buffer| buffer.data.get_mut().len() == size_bytes)
    }

    /// Makes `buffer`, evicted and [`Buffer::recyclable`], a new invalid buffer for `key` in
    /// place, as [`Buffer::new_locked`] would make one: locked exclusively, pinned once by
    /// its creator, no flags. Its header, bytes and memory charge pass to the new block, so
    /// an eviction made to insert a block frees and allocates nothing.
    pub fn recycle_locked(
        mut buffer: Arc<Buffer>,
        key: BlockKey,
        length_bytes: u32,
    ) -> Arc<Buffer> {
        let recycled =
            Arc::get_mut(&mut buffer).expect("a recyclable buffer is referenced by nobody else");
        recycled.key = key;
        recycled.length_bytes = length_bytes;
        *recycled.slot.get_mut() = u32::MAX;
        *recycled.pins.get_mut() = 1;
        *recycled.flags.get_mut() = 0;
        // Unique, so nobody holds or waits for the lock: this never blocks.
        recycled.lock.lock_exclusive();
        let size_bytes = recycled.data.get_mut().len();
        if (length_bytes as usize) < size_bytes {
            // SAFETY: locked exclusively just above, and referenced by nobody else.
            unsafe { recycled.bytes_mut()[length_bytes as usize..].fill(0) };
        }
        buffer
    }

    pub fn has(&self, flag: u32) -> bool {
        self.flags.load(Ordering::Acquire) & flag != 0
    }

    pub fn set(&self, flag: u32) -> bool {
        strict_assert!(flag & DIRTY == 0, "DIRTY changes only in the dirty set");
        self.flags.fetch_or(flag, Ordering::AcqRel) & flag == 0
    }

    /// Clears `flag`; true when it was set.
    pub fn clear(&self, flag: u32) -> bool {
        strict_assert!(flag & DIRTY == 0, "DIRTY changes only in the dirty set");
        self.flags.fetch_and(!flag, Ordering::AcqRel) & flag != 0
    }

    /// Clears every flag in `flags` at once; returns which of them were set.
    pub fn take(&self, flags: u32) -> u32 {
        strict_assert!(flags & DIRTY == 0, "DIRTY changes only in the dirty set");
        self.flags.fetch_and(!flags, Ordering::AcqRel) & flags
    }

    /// Sets a flag; for the dirty-set module only, the one home of the DIRTY flag.
    pub(crate) fn set_flag_of_dirty_set(&self, flag: u32) -> bool {
        self.flags.fetch_or(flag, Ordering::AcqRel) & flag == 0
    }

    /// Clears a flag; for the dirty-set module only, the one home of the DIRTY flag.
    pub(crate) fn clear_flag_of_dirty_set(&self, flag: u32) -> bool {
        self.flags.fetch_and(!flag, Ordering::AcqRel) & flag != 0
    }

    pub fn lock_shared(&self) {
        self.lock.lock_shared();
    }

    pub fn try_lock_shared(&self) -> bool {
        self.lock.try_lock_shared()
    }

    pub fn try_lock_exclusive(&self) -> bool {
        self.lock.try_lock_exclusive()
    }

    pub fn lock_exclusive(&self) {
        self.lock.lock_exclusive();
    }

    /// Any thread may release a hold another took (parking_lot's `send_guard`): a write-back
    /// or read the device completes later ends on the device's thread.
    ///
    /// # Safety
    /// The caller holds the lock shared.
    pub unsafe fn unlock_shared(&self) {
        // SAFETY: the caller holds the lock shared (this function's contract).
        unsafe { self.lock.unlock_shared() };
    }

    /// # Safety
    /// The caller holds the lock exclusively.
    pub unsafe fn unlock_exclusive(&self) {
        // SAFETY: the caller holds the lock exclusively (this function's contract).
        unsafe { self.lock.unlock_exclusive() };
    }

    /// True while someone holds the lock exclusively (a hint, except to the attached-reads
    /// registry, which pairs it with a fence).
    pub fn is_locked_exclusive(&self) -> bool {
        self.lock.is_locked_exclusive()
    }

    /// After its exclusive lock was let go: true when reads were attached to the buffer
    /// meanwhile (the flag is cleared), which the releaser must now run
    /// (`AttachedReads::wake`, in the module that keeps attached reads).
    pub fn released_with_reads_attached(&self) -> bool {
        // Pairs with the fence in `AttachedReads::attach`: either the attacher sees the lock
        // let go, or this sees its flag.
        std::sync::atomic::fence(Ordering::SeqCst);
        self.flags.load(Ordering::Relaxed) & ATTACHED != 0 && self.take(ATTACHED) != 0
    }

    /// # Safety
    /// The caller holds the lock (shared or exclusive) for the lifetime of the slice.
    pub unsafe fn bytes(&self) -> &[u8] {
        // SAFETY: the caller holds the lock, so no one writes the bytes meanwhile.
        unsafe { &*self.data.get() }
    }

    /// # Safety
    /// The caller holds the lock exclusively for the lifetime of the slice, and takes no other
    /// reference to the bytes meanwhile.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self) -> &mut [u8] {
        // SAFETY: the caller holds the lock exclusively and takes no other reference.
        unsafe { &mut *self.data.get() }
    }

    /// The bytes that exist on the device: all but the tail of a short last block.
    ///
    /// # Safety
    /// As for [`Buffer::bytes`].
    pub unsafe fn device_bytes(&self) -> &[u8] {
        // SAFETY: forwarded contract of `bytes`.
        unsafe { &self.bytes()[..self.length_bytes as usize] }
    }

    /// # Safety
    /// As for [`Buffer::bytes_mut`].
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn device_bytes_mut(&self) -> &mut [u8] {
        // SAFETY: forwarded contract of `bytes_mut`.
        unsafe { &mut self.bytes_mut()[..self.length_bytes as usize] }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        let size = self.data.get_mut().len() as u64;
        self.memory
            .release(self.charge_bytes as u64, self.charge_bytes as u64 - size);
    }
}
