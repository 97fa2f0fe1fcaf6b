//! The dirty set: the only code that changes dirty state.
//!
//! Dirty state has three representations that must agree: a buffer's DIRTY flag, its object's
//! dirty index (block → time it became dirty, ordered so write-back finds runs), and the
//! cache's dirty byte count (which drives throttling and background write-back). [`mark`] and
//! [`clear`] change all three together and assert that they agree:
//! in the index ⇔ flag set ⇔ counted.
//!
//! Callers hold the buffer's lock (exclusive to mark; shared or exclusive to clear, after the
//! device accepted the bytes — never before, see the fsyncgate note in docs/design.md).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use bufcache_device::SleepingMutex;

use crate::buffer::{Buffer, DIRTY};

/// An object's dirty blocks, each with the time (ns, injected clock) it became dirty. A writer
/// marking one run and write-behind clearing the last meet on it all the time, so it never
/// yields the CPU while it waits (see [`SleepingMutex`]).
pub(crate) type DirtyIndex = SleepingMutex<BTreeMap<u64, u64>>;

/// Marks `buffer` dirty (if it was not already) in all three places. True when it changed.
pub(crate) fn mark(
    total_bytes: &AtomicU64,
    index: &DirtyIndex,
    buffer: &Buffer,
    now_ns: u64,
) -> bool {
    mark_all(total_bytes, index, &[buffer], now_ns) == 1
}

/// Marks every buffer of `buffers` dirty (those that were not already) in all three places,
/// taking the index lock once. Returns how many changed.
pub(crate) fn mark_all(
    total_bytes: &AtomicU64,
    index: &DirtyIndex,
    buffers: &[&Buffer],
    now_ns: u64,
) -> usize {
    let mut index = index.lock();
    let mut added_bytes = 0u64;
    let mut changed = 0usize;
    for buffer in buffers {
        if !buffer.set_flag_of_dirty_set(DIRTY) {
            strict_assert!(
                index.contains_key(&buffer.key.block),
                "dirty buffer {:?} missing from its object's dirty index",
                buffer.key
            );
            continue;
        }
        let previous = index.insert(buffer.key.block, now_ns);
        strict_assert!(
            previous.is_none(),
            "clean buffer {:?} was in the dirty index",
            buffer.key
        );
        added_bytes += buffer.length_bytes as u64;
        changed += 1;
    }
    total_bytes.fetch_add(added_bytes, Ordering::AcqRel);
    changed
}

/// Marks `buffer` clean (if it was dirty) in all three places. True when it changed.
pub(crate) fn clear(total_bytes: &AtomicU64, index: &DirtyIndex, buffer: &Buffer) -> bool {
    clear_all(total_bytes, index, [buffer]) == 1
}

/// Marks every buffer of `buffers` clean (those that were dirty) in all three places, taking
/// the index lock once. Returns how many changed.
pub(crate) fn clear_all<'b>(
    total_bytes: &AtomicU64,
    index: &DirtyIndex,
    buffers: impl IntoIterator<Item = &'b Buffer>,
) -> u64 {
    let mut index = index.lock();
    let mut removed_bytes = 0u64;
    let mut changed = 0u64;
    for buffer in buffers {
        if !buffer.clear_flag_of_dirty_set(DIRTY) {
            continue;
        }
        let removed = index.remove(&buffer.key.block);
        strict_assert!(
            removed.is_some(),
            "dirty buffer {:?} was missing from the dirty index",
            buffer.key
        );
        removed_bytes += buffer.length_bytes as u64;
        changed += 1;
    }
    let before = total_bytes.fetch_sub(removed_bytes, Ordering::AcqRel);
    strict_assert!(
        before >= removed_bytes,
        "dirty byte count {before} below the {removed_bytes} bytes of dirty buffers"
    );
    changed
}
