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
use std::ops::{Bound, RangeBounds};
use std::sync::atomic::{AtomicU64, Ordering};

use bufcache_device::SleepingMutex;

use crate::buffer::{Buffer, DIRTY};

/// An object's dirty index (see [`DirtyBlocks`]). A writer marking one run and write-behind
/// clearing the last meet on it all the time, so it never yields the CPU while it waits (see
/// [`SleepingMutex`]).
pub(crate) type DirtyIndex = SleepingMutex<DirtyBlocks>;

/// Consecutive blocks whose dirty bits and times share one entry of the index: a run of N
/// blocks costs about N / 16 map operations instead of N (a 1 MiB write's 256 per-block
/// inserts and removes were a sixth of its bookkeeping). A scattered dirty block costs a
/// whole entry (8-byte key and 136-byte group, about 3.5% of the 4 KiB it tracks, against
/// under 1% before); dirty data is bounded by `dirty_limit_percent` (50% by default), so the
/// index stays under about 2% of the cache size even when every dirty block is scattered.
const GROUP_BLOCKS: u64 = 16;

/// One group's dirty blocks: bit `i` of `mask` is block `group * 16 + i`, and
/// `dirtied_ns[i]` the time (ns, injected clock) it became dirty.
struct DirtyGroup {
    mask: u16,
    dirtied_ns: [u64; GROUP_BLOCKS as usize],
}

impl DirtyGroup {
    fn empty() -> DirtyGroup {
        DirtyGroup {
            mask: 0,
            dirtied_ns: [0; GROUP_BLOCKS as usize],
        }
    }

    /// The group's dirty blocks and their times, in block order.
    fn blocks(&self, group: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        let mut mask = self.mask;
        std::iter::from_fn(move || {
            if mask == 0 {
                return None;
            }
            let bit = mask.trailing_zeros();
            mask &= mask - 1;
            Some((
                group * GROUP_BLOCKS + bit as u64,
                self.dirtied_ns[bit as usize],
            ))
        })
    }
}

/// An object's dirty blocks in block order (so write-back finds runs), each with the time it
/// became dirty. Read by anyone holding the index lock; changed only by this module's
/// [`mark_all`] and [`clear_all`], which keep it equal to the buffers' DIRTY flags.
#[derive(Default)]
pub(crate) struct DirtyBlocks {
    groups: BTreeMap<u64, DirtyGroup>,
    len: usize,
}

impl DirtyBlocks {
    /// How many blocks are dirty.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether `block` is dirty.
    #[cfg(test)]
    pub(crate) fn contains(&self, block: u64) -> bool {
        self.groups
            .get(&(block / GROUP_BLOCKS))
            .is_some_and(|group| group.mask & bit_of(block) != 0)
    }

    /// The dirty blocks within `range` and the times they became dirty, in block order.
    pub(crate) fn range(
        &self,
        range: impl RangeBounds<u64>,
    ) -> impl Iterator<Item = (u64, u64)> + '_ {
        inclusive_bounds(range)
            .into_iter()
            .flat_map(move |(first, last)| {
                self.groups
                    .range(first / GROUP_BLOCKS..=last / GROUP_BLOCKS)
                    .flat_map(move |(&group, entry)| {
                        entry
                            .blocks(group)
                            .filter(move |&(block, _)| first <= block && block <= last)
                    })
            })
    }

    /// How many blocks within `range` are dirty: one population count per group, so a
    /// write completing a cluster asks "is all of it dirty?" in 16 steps, not 256.
    pub(crate) fn count(&self, range: impl RangeBounds<u64>) -> u64 {
        let Some((first, last)) = inclusive_bounds(range) else {
            return 0;
        };
        self.groups
            .range(first / GROUP_BLOCKS..=last / GROUP_BLOCKS)
            .map(|(&group, entry)| {
                let group_first = group * GROUP_BLOCKS;
                let low = first.saturating_sub(group_first);
                let high = last.min(group_first + GROUP_BLOCKS - 1) - group_first;
                let within = ((1u32 << (high + 1)) - (1u32 << low)) as u16;
                u64::from((entry.mask & within).count_ones())
            })
            .sum()
    }

    /// Every dirty block, in order.
    pub(crate) fn blocks(&self) -> impl Iterator<Item = u64> + '_ {
        self.range(..).map(|(block, _)| block)
    }
}

/// The number of the group `clear_all` has just left, when it left it empty: it is removed,
/// so no empty group is ever kept.
fn emptied_group(visited: Option<(u64, &mut DirtyGroup)>) -> Option<u64> {
    visited.and_then(|(number, group)| (group.mask == 0).then_some(number))
}

/// `range` as its first and last block, or None when it holds none.
fn inclusive_bounds(range: impl RangeBounds<u64>) -> Option<(u64, u64)> {
    let first = match range.start_bound() {
        Bound::Included(&first) => Some(first),
        Bound::Excluded(&before) => before.checked_add(1),
        Bound::Unbounded => Some(0),
    };
    let last = match range.end_bound() {
        Bound::Included(&last) => Some(last),
        Bound::Excluded(&end) => end.checked_sub(1),
        Bound::Unbounded => Some(u64::MAX),
    };
    first.zip(last).filter(|(first, last)| first <= last)
}

/// The bit of `block` in its group's mask.
fn bit_of(block: u64) -> u16 {
    1 << (block % GROUP_BLOCKS)
}

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
/// taking the index lock once and looking each group of the index up once per run of its
/// blocks. Returns how many changed.
pub(crate) fn mark_all(
    total_bytes: &AtomicU64,
    index: &DirtyIndex,
    buffers: &[&Buffer],
    now_ns: u64,
) -> usize {
    let mut index = index.lock();
    let DirtyBlocks { groups, len } = &mut *index;
    let mut added_bytes = 0u64;
    let mut changed = 0usize;
    let mut current: Option<(u64, &mut DirtyGroup)> = None;
    for buffer in buffers {
        let block = buffer.key.block;
        let number = block / GROUP_BLOCKS;
        if !buffer.set_flag_of_dirty_set(DIRTY) {
            // Already dirty (a rewrite): nothing to change, and in release builds nothing
            // to look up either.
            current = None;
            strict_assert!(
                groups
                    .get(&number)
                    .is_some_and(|group| group.mask & bit_of(block) != 0),
                "dirty buffer {:?} missing from its object's dirty index",
                buffer.key
            );
            continue;
        }
        if current.as_ref().map(|(current, _)| *current) != Some(number) {
            current = Some((
                number,
                groups.entry(number).or_insert_with(DirtyGroup::empty),
            ));
        }
        let (_, group) = current.as_mut().expect("set just above");
        let absent = group.mask & bit_of(block) == 0;
        strict_assert!(
            absent,
            "clean buffer {:?} was in the dirty index",
            buffer.key
        );
        if absent {
            group.mask |= bit_of(block);
            group.dirtied_ns[(block % GROUP_BLOCKS) as usize] = now_ns;
            *len += 1;
        }
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
/// the index lock once and looking each group up once per run of its blocks. Returns how
/// many changed.
pub(crate) fn clear_all<'b>(
    total_bytes: &AtomicU64,
    index: &DirtyIndex,
    buffers: impl IntoIterator<Item = &'b Buffer>,
) -> u64 {
    let mut index = index.lock();
    let DirtyBlocks { groups, len } = &mut *index;
    let mut removed_bytes = 0u64;
    let mut changed = 0u64;
    let mut current: Option<(u64, &mut DirtyGroup)> = None;
    for buffer in buffers {
        if !buffer.clear_flag_of_dirty_set(DIRTY) {
            continue;
        }
        let block = buffer.key.block;
        let number = block / GROUP_BLOCKS;
        if current.as_ref().map(|(current, _)| *current) != Some(number) {
            if let Some(emptied) = emptied_group(current.take()) {
                groups.remove(&emptied);
            }
            current = groups.get_mut(&number).map(|group| (number, group));
        }
        let present = current
            .as_mut()
            .is_some_and(|(_, group)| group.mask & bit_of(block) != 0);
        strict_assert!(
            present,
            "dirty buffer {:?} was missing from the dirty index",
            buffer.key
        );
        if let Some((_, group)) = current.as_mut().filter(|_| present) {
            group.mask &= !bit_of(block);
            *len -= 1;
        }
        removed_bytes += buffer.length_bytes as u64;
        changed += 1;
    }
    if let Some(emptied) = emptied_group(current) {
        groups.remove(&emptied);
    }
    let before = total_bytes.fetch_sub(removed_bytes, Ordering::AcqRel);
    strict_assert!(
        before >= removed_bytes,
        "dirty byte count {before} below the {removed_bytes} bytes of dirty buffers"
    );
    changed
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buffer::{BlockKey, MemoryRelease};
    use bufcache_device::aligned::BufferPool;
    use bufcache_device::SeededRng;
    use std::sync::Arc;

    struct Unaccounted;

    impl MemoryRelease for Unaccounted {
        fn release(&self, _charge_bytes: u64, _waste_bytes: u64) {}
    }

    #[test]
    fn the_grouped_index_answers_every_range_as_a_per_block_map_would() {
        // Goal: grouping blocks 16 to an entry changes no answer: membership, counts, times
        // and every kind of range (open, closed, inclusive, excluded starts, the u64::MAX
        // edge, across and inside groups, empty) match a per-block map, and no empty group is
        // kept. Method: 3 seeds × 3,000 random runs marked dirty or clean (runs crossing group
        // edges, some already in the wanted state, a quarter shuffled with a duplicate)
        // against a BTreeMap shadow, checking random ranges after each step.
        for seed in [1u64, 2, 3] {
            let mut rng = SeededRng::new(seed);
            let pool = BufferPool::new(4096);
            let memory: Arc<dyn MemoryRelease> = Arc::new(Unaccounted);
            let buffers: Vec<Arc<Buffer>> = (0..200u64)
                .map(|block| {
                    let key = BlockKey { object: 0, block };
                    Buffer::new_locked(key, 4096, 4096, &pool, 4096, Arc::clone(&memory))
                })
                .collect();
            let total = AtomicU64::new(0);
            let index = DirtyIndex::default();
            let mut shadow: BTreeMap<u64, u64> = BTreeMap::new();
            for step in 0..3000u64 {
                let first = rng.below(200);
                let end = (first + 1 + rng.below(40)).min(200);
                let mut run: Vec<&Buffer> = buffers[first as usize..end as usize]
                    .iter()
                    .map(|buffer| buffer.as_ref())
                    .collect();
                // Callers pass runs in order; the index must not depend on it.
                if rng.below(4) == 0 {
                    for index in (1..run.len()).rev() {
                        run.swap(index, rng.below(index as u64 + 1) as usize);
                    }
                    let again = run[rng.below(run.len() as u64) as usize];
                    run.push(again);
                }
                if rng.below(2) == 0 {
                    let changed = mark_all(&total, &index, &run, step);
                    let mut expected = 0;
                    for block in run.iter().map(|buffer| buffer.key.block) {
                        if let std::collections::btree_map::Entry::Vacant(entry) =
                            shadow.entry(block)
                        {
                            entry.insert(step);
                            expected += 1;
                        }
                    }
                    assert_eq!(changed, expected, "seed {seed} step {step}: marked");
                } else {
                    let changed = clear_all(&total, &index, run.iter().copied());
                    let expected = run
                        .iter()
                        .filter(|buffer| shadow.remove(&buffer.key.block).is_some())
                        .count();
                    assert_eq!(
                        changed as usize, expected,
                        "seed {seed} step {step}: cleared"
                    );
                }
                let index = index.lock();
                assert_eq!(index.len(), shadow.len(), "seed {seed} step {step}: length");
                assert_eq!(total.load(Ordering::Acquire), 4096 * shadow.len() as u64);
                assert!(index.groups.values().all(|group| group.mask != 0));
                let (low, high) = (rng.below(210), rng.below(210));
                let both = |got: Vec<(u64, u64)>, want: Vec<(u64, u64)>, what: &str| {
                    assert_eq!(got, want, "seed {seed} step {step}: {what} {low} {high}");
                };
                let pairs = |map: std::collections::btree_map::Range<'_, u64, u64>| {
                    map.map(|(&block, &ns)| (block, ns)).collect::<Vec<_>>()
                };
                both(
                    index.range(low..).collect(),
                    pairs(shadow.range(low..)),
                    "from",
                );
                both(
                    index.range(..low).collect(),
                    pairs(shadow.range(..low)),
                    "to",
                );
                if low <= high {
                    both(
                        index.range(low..high).collect(),
                        pairs(shadow.range(low..high)),
                        "range",
                    );
                    both(
                        index.range(low..=high).collect(),
                        pairs(shadow.range(low..=high)),
                        "inclusive",
                    );
                    assert_eq!(
                        index.count(low..high),
                        shadow.range(low..high).count() as u64,
                        "seed {seed} step {step}: count {low}..{high}"
                    );
                    assert_eq!(
                        index.count(low..=high),
                        shadow.range(low..=high).count() as u64,
                        "seed {seed} step {step}: count {low}..={high}"
                    );
                }
                use std::ops::Bound::{Excluded, Included, Unbounded};
                both(
                    index.range((Excluded(low), Unbounded)).collect(),
                    pairs(shadow.range((Excluded(low), Unbounded))),
                    "after",
                );
                if low < high {
                    both(
                        index.range((Excluded(low), Included(high))).collect(),
                        pairs(shadow.range((Excluded(low), Included(high)))),
                        "after, inclusive",
                    );
                }
                assert_eq!(index.range((Excluded(u64::MAX), Unbounded)).count(), 0);
                assert_eq!(index.range(u64::MAX..).count(), 0);
                assert_eq!(index.range(..=u64::MAX).count(), shadow.len());
                assert_eq!(index.count(..), shadow.len() as u64);
                assert_eq!(index.count(u64::MAX..), 0);
                assert!(index.blocks().eq(shadow.keys().copied()));
                assert_eq!(index.contains(low), shadow.contains_key(&low));
            }
        }
    }
}
