//! Reads attached to a buffer being filled: a started read
//! ([`crate::ObjectHandle::start_read`]) whose blocks another read is already bringing in
//! (read-ahead in flight, another client's miss) does not take a thread to wait for them.
//! It is parked here, keyed by the block it waits for, and run by whichever thread lets that
//! buffer's exclusive lock go (the device's completion thread, for an upstream's read): one
//! device request then answers every client request that wanted its blocks, with no worker
//! woken and no thread asleep on a buffer lock.
//!
//! Invariants:
//! - a buffer that has a read attached carries [`ATTACHED`]; the releaser of its exclusive
//!   lock looks for the flag after letting the lock go, and the attacher looks at the lock
//!   after setting the flag, each past a sequentially consistent fence, so at least one of
//!   them sees the other: every attached read is run exactly once, by the releaser or (when
//!   the lock was let go meanwhile) by the attacher itself;
//! - at most `attached_reads_max` reads wait at once; past it a read is not attached and its
//!   caller serves it the usual way.

use std::collections::HashMap;
use std::sync::atomic::{fence, Ordering};

use parking_lot::Mutex;

use crate::buffer::{BlockKey, Buffer, ATTACHED};

/// Reads that may wait attached at once, over the whole cache. An NBD server bounds the
/// requests in flight per connection and server-wide; this keeps the registry bounded even
/// without one.
pub(crate) const ATTACHED_READS_MAX: usize = 4096;

/// What runs when the buffer an attached read waits for is let go: it looks at its blocks
/// again (and attaches again, or answers, or gives the read back to its caller).
pub(crate) type AttachedRead = Box<dyn FnOnce() + Send>;

/// The reads waiting for buffers being filled, by block.
#[derive(Default)]
pub(crate) struct AttachedReads {
    waiting: Mutex<Waiting>,
}

#[derive(Default)]
struct Waiting {
    by_block: HashMap<BlockKey, Vec<(u64, AttachedRead)>>,
    /// Reads in `by_block`, all keys together.
    count: usize,
    /// Names each attached read, so an attacher can take back its own.
    next_ticket: u64,
}

impl AttachedReads {
    /// Parks `read` until `buffer`, held exclusively by someone else, is let go. Gives `read`
    /// back when the registry is full, or when the buffer was let go before the read was
    /// parked (then nobody else will run it, and the caller looks again itself).
    pub(crate) fn attach(&self, buffer: &Buffer, read: AttachedRead) -> Result<(), AttachedRead> {
        let key = buffer.key;
        let ticket = {
            let mut waiting = self.waiting.lock();
            if waiting.count >= ATTACHED_READS_MAX {
                return Err(read);
            }
            let ticket = waiting.next_ticket;
            waiting.next_ticket += 1;
            waiting
                .by_block
                .entry(key)
                .or_default()
                .push((ticket, read));
            waiting.count += 1;
            buffer.set(ATTACHED);
            ticket
        };
        // Pairs with the fence in `Buffer`'s releaser (`released_with_reads_attached`).
        fence(Ordering::SeqCst);
        if buffer.is_locked_exclusive() {
            // Its releaser will see the flag and run the read.
            return Ok(());
        }
        let mut waiting = self.waiting.lock();
        let Some(reads) = waiting.by_block.get_mut(&key) else {
            return Ok(());
        };
        let Some(position) = reads.iter().position(|(own, _)| *own == ticket) else {
            // The releaser took it already and runs it.
            return Ok(());
        };
        let (_, read) = reads.swap_remove(position);
        if reads.is_empty() {
            waiting.by_block.remove(&key);
        }
        waiting.count -= 1;
        Err(read)
    }

    /// Runs every read attached to `key`, in the caller's thread, with no lock held.
    pub(crate) fn wake(&self, key: BlockKey) {
        let reads = {
            let mut waiting = self.waiting.lock();
            let reads = waiting.by_block.remove(&key).unwrap_or_default();
            waiting.count -= reads.len();
            strict_assert!(
                waiting.count == waiting.by_block.values().map(Vec::len).sum::<usize>(),
                "attached reads counted {} but {} wait",
                waiting.count,
                waiting.by_block.values().map(Vec::len).sum::<usize>()
            );
            reads
        };
        for (_, read) in reads {
            read();
        }
    }
}
