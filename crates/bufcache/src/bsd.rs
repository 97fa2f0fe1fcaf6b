//! The BSD buffer calls — getblk, bread, bwrite, bdwrite, bawrite, brelse, bqrelse, plus
//! invalidate, fsync and the dirty-block visitor — as a thin layer over the object handle:
//! each is a few lines on top of the same lookup, read, dirty-marking and write-back paths the
//! byte-range API uses.

use std::sync::Arc;

use crate::buffer::DIRTY;
use crate::error::CacheError;
use crate::guard::BufferGuard;
use crate::handle::ObjectHandle;
use crate::stats::WritebackCause;

/// How long `visit_dirty_blocks` waits between tries for a block held exclusively.
const VISIT_LOCK_STEP: std::time::Duration = std::time::Duration::from_millis(1);

impl ObjectHandle {
    /// getblk: the buffer for `block`, held exclusively; invalid when it was not cached.
    pub fn getblk(&self, block: u64) -> Result<BufferGuard, CacheError> {
        self.check_block(block)?;
        let mut guard = self.writer().hold_exclusive(block)?;
        if !guard.is_valid() {
            // A new buffer's bytes may be an earlier buffer's; the caller sees them (BSD's
            // getblk hands out an invalid buffer to be filled), so they start as zeroes.
            guard.data_mut().fill(0);
        }
        Ok(guard)
    }

    /// bread: the buffer for `block` with its contents, held exclusively.
    pub fn bread(&self, block: u64) -> Result<BufferGuard, CacheError> {
        let guard = self.getblk(block)?;
        if guard.is_valid() {
            return Ok(guard);
        }
        let mut run = vec![guard];
        self.reader()
            .device_read(&mut run, self.object().map.map(block).device_offset)?;
        Ok(run.pop().expect("one guard"))
    }

    /// bwrite: writes the buffer to the device now (no device flush) and releases it.
    pub fn bwrite(&self, guard: BufferGuard) -> Result<(), CacheError> {
        self.object().check_writable()?;
        self.writer().mark_dirty(&guard);
        let result = self.inner().writeback().write_held(
            self.object(),
            std::slice::from_ref(guard.buffer()),
            WritebackCause::Flush,
        );
        drop(guard);
        self.reported(result).map(|_| ())
    }

    /// bdwrite: marks the buffer dirty (delayed write) and releases it.
    pub fn bdwrite(&self, guard: BufferGuard) -> Result<(), CacheError> {
        self.object().check_writable()?;
        self.writer().mark_dirty(&guard);
        let block = guard.block();
        drop(guard);
        if self.inner().config().write_behind {
            self.writer().write_behind(block, block + 1);
        }
        Ok(())
    }

    /// bawrite: marks the buffer dirty and starts writing it in the background; the buffer
    /// stays locked until the write finishes. Errors are latched for the next flush.
    pub fn bawrite(&self, guard: BufferGuard) -> Result<(), CacheError> {
        self.object().check_writable()?;
        self.writer().mark_dirty(&guard);
        let inner = Arc::clone(self.inner());
        let object = Arc::clone(self.object());
        let job = Box::new(move || {
            let _ = inner.writeback().write_held(
                &object,
                std::slice::from_ref(guard.buffer()),
                WritebackCause::Flush,
            );
            drop(guard);
        });
        if let Err(job) = self.inner().spawner().spawn(job) {
            job();
        }
        Ok(())
    }

    /// brelse: releases the buffer (dropping it from the cache if it is invalid or marked
    /// no-cache and clean).
    pub fn brelse(&self, guard: BufferGuard) {
        drop(guard);
    }

    /// bqrelse: releases the buffer and keeps it cached even if marked no-cache.
    pub fn bqrelse(&self, mut guard: BufferGuard) {
        guard.keep_on_release();
        drop(guard);
    }

    /// Drops every cached block of this object after writing back dirty ones (vinvalbuf
    /// with V_SAVE). Fails, keeping the dirty data, if write-back fails.
    pub fn invalidate(&self) -> Result<(), CacheError> {
        self.inner().writeback().fsync_object(self.object())?;
        self.writer()
            .invalidate_blocks(0, self.object().block_count(), false);
        Ok(())
    }

    /// Calls `visit(offset, bytes)` for every block in the dirty set (data not yet known to be
    /// on the device, including blocks whose write-back is in flight), in block order. The
    /// bytes are read under the buffer's shared lock, which an in-flight write-back also holds
    /// shared, so a hung device does not block this; a block held exclusively (being written
    /// by a client) for longer than `lock_wait` is visited with `None`. For saving dirty data
    /// elsewhere when the device cannot take it (the server's rescue file at shutdown).
    pub fn visit_dirty_blocks(
        &self,
        lock_wait: std::time::Duration,
        mut visit: impl FnMut(u64, Option<&[u8]>),
    ) {
        let blocks: Vec<u64> = self.object().dirty.lock().blocks().collect();
        let block_size = self.object().block_size_bytes as u64;
        for block in blocks {
            let Some(buffer) = self.inner().table().lookup_quiet(self.object().key(block)) else {
                continue;
            };
            // Waits go through the injected waiter and are counted as their full step, so the
            // total is bounded by `lock_wait` even on a virtual clock.
            let waiter = self.inner().waiter();
            let mut waited = std::time::Duration::ZERO;
            let mut locked = buffer.try_lock_shared();
            while !locked && waited < lock_wait {
                waiter.wait(waiter.ticket(), VISIT_LOCK_STEP.as_nanos() as u64);
                waited += VISIT_LOCK_STEP;
                locked = buffer.try_lock_shared();
            }
            if locked {
                if buffer.has(DIRTY) {
                    // SAFETY: locked shared just above, released right after.
                    visit(block * block_size, Some(unsafe { buffer.device_bytes() }));
                }
                // SAFETY: locked shared above.
                unsafe { buffer.unlock_shared() };
            } else {
                visit(block * block_size, None);
            }
            self.inner().table().unpin(&buffer);
        }
    }

    /// fsync of this object: the same as [`ObjectHandle::flush`].
    pub fn fsync(&self) -> Result<(), CacheError> {
        self.flush()
    }

    fn check_block(&self, block: u64) -> Result<(), CacheError> {
        if block < self.object().block_count() {
            Ok(())
        } else {
            Err(CacheError::OutOfRange {
                object: self.object().name.clone(),
                offset: block * self.object().block_size_bytes as u64,
                length_bytes: self.object().block_size_bytes as u64,
                object_length_bytes: self.object().length_bytes(),
            })
        }
    }
}
