//! Buffers held exclusively: [`BufferGuard`] (what `getblk` and `bread` return, and what the
//! read and write paths fill), its release (`brelse`), and runs of guards lent to the device
//! as a read's memory.
//!
//! Invariant: a guard lets its buffer's lock go once, and unpins it once; a buffer never made
//! valid leaves the table on release, so a failed fill caches nothing.

use std::io::IoSliceMut;
use std::sync::Arc;

use bufcache_device::ReadMemory;

use crate::buffer::{BlockKey, Buffer, DIRTY, VALID};
use crate::cache::Inner;
use crate::object::ObjectState;

/// A buffer held exclusively: what `getblk` and `bread` return. Dropping it releases it
/// (`brelse`); an invalid buffer (never filled) is discarded on release.
pub struct BufferGuard {
    inner: Arc<Inner>,
    pub(crate) buffer: Arc<Buffer>,
    discard_on_release: bool,
    /// The lock was let go and the pin is being released with others ([`release_guards`]):
    /// the drop does neither again.
    released: bool,
}

impl BufferGuard {
    /// The buffer held.
    pub(crate) fn buffer(&self) -> &Arc<Buffer> {
        &self.buffer
    }

    /// Keeps the buffer cached on release even if it was marked no-cache (bqrelse).
    pub(crate) fn keep_on_release(&mut self) {
        self.discard_on_release = false;
    }

    pub(crate) fn new(inner: &Arc<Inner>, _object: &Arc<ObjectState>, buffer: Arc<Buffer>) -> Self {
        BufferGuard {
            inner: Arc::clone(inner),
            buffer,
            discard_on_release: false,
            released: false,
        }
    }

    /// The logical block number.
    pub fn block(&self) -> u64 {
        self.buffer.key.block
    }

    /// True when the bytes hold the block's contents (read, or written whole).
    pub fn is_valid(&self) -> bool {
        self.buffer.has(VALID)
    }

    /// True when the bytes are newer than the device.
    pub fn is_dirty(&self) -> bool {
        self.buffer.has(DIRTY)
    }

    /// The block's bytes (the block size; bytes past the end of a short last block are
    /// zero and never written).
    pub fn data(&self) -> &[u8] {
        // SAFETY: the guard holds the buffer lock exclusively.
        unsafe { self.buffer.bytes() }
    }

    /// The block's bytes, for filling or modifying; call [`crate::ObjectHandle::bdwrite`] (or
    /// another write) afterwards to keep the change.
    pub fn data_mut(&mut self) -> &mut [u8] {
        // SAFETY: the guard holds the buffer lock exclusively and borrows self mutably.
        unsafe { self.buffer.bytes_mut() }
    }

    /// The bytes that exist on the device: the block, or less for a short last block.
    pub(crate) fn device_data_mut(&mut self) -> &mut [u8] {
        // SAFETY: the guard holds the buffer lock exclusively and borrows self mutably.
        unsafe { self.buffer.device_bytes_mut() }
    }

    /// Declares the bytes valid after the caller filled them itself (a clean buffer).
    pub fn mark_valid(&mut self) {
        self.buffer.set(VALID);
    }

    /// B_NOCACHE: on release, drop the buffer from the cache if it is clean.
    pub fn set_no_cache(&mut self) {
        self.discard_on_release = true;
    }
}

impl BufferGuard {
    /// What a drop does before its unpin: a buffer never made valid (or marked no-cache
    /// and clean) leaves the table, and the lock is let go. Once only. True when reads were
    /// attached to the buffer while it was held: the caller runs them (`AttachedReads::wake`)
    /// once it holds nothing else.
    #[must_use]
    fn unlock_for_release(&mut self) -> bool {
        strict_assert!(
            !self.released,
            "guard of {:?} released twice",
            self.buffer.key
        );
        let drop_it =
            !self.buffer.has(VALID) || (self.discard_on_release && !self.buffer.has(DIRTY));
        if drop_it {
            self.inner.table().remove(&self.buffer);
        }
        // SAFETY: the guard holds the lock exclusively until now, and lets it go once
        // (`released` is set below, and a released guard's drop does nothing).
        unsafe { self.buffer.unlock_exclusive() };
        self.released = true;
        self.buffer.released_with_reads_attached()
    }
}

impl Drop for BufferGuard {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        let attached = self.unlock_for_release();
        self.inner.table().unpin(&self.buffer);
        if attached {
            self.inner.attached().wake(self.buffer.key);
        }
    }
}

/// Lets every guard of `guards` go as dropping them in order would, but unpins them together
/// ([`Table::unpin_run`]: a shard lock per chunk, not per block, for the buffers their last
/// unpin puts back on the policy's queues). Leaves `guards` empty.
pub(crate) fn release_guards(guards: &mut Vec<BufferGuard>) {
    let Some(inner) = guards.first().map(|guard| Arc::clone(&guard.inner)) else {
        return;
    };
    let mut attached: smallvec::SmallVec<[BlockKey; 4]> = smallvec::SmallVec::new();
    for guard in guards.iter_mut() {
        if guard.unlock_for_release() {
            attached.push(guard.buffer.key);
        }
    }
    inner
        .table()
        .unpin_run(guards.iter().map(|guard| &*guard.buffer));
    guards.clear();
    for key in attached {
        inner.attached().wake(key);
    }
}

/// A run of buffers held exclusively, lent to the device as one read's memory: the guards move
/// with the request and come back with its completion, so the memory lives as long as the
/// read does.
pub(crate) struct GuardRun(pub(crate) Vec<BufferGuard>);

impl Drop for GuardRun {
    fn drop(&mut self) {
        release_guards(&mut self.0);
    }
}

impl GuardRun {
    /// The guards, leaving the run empty.
    pub(crate) fn take(mut self) -> Vec<BufferGuard> {
        std::mem::take(&mut self.0)
    }
}

impl ReadMemory for GuardRun {
    fn slices_mut(&mut self) -> Vec<IoSliceMut<'_>> {
        self.0
            .iter_mut()
            .map(|guard| IoSliceMut::new(guard.device_data_mut()))
            .collect()
    }
}
