//! 2Q (Johnson & Shasha, VLDB'94, the "full" version): a FIFO `A1in` for first-time entries,
//! a ghost FIFO `A1out` of key hashes recently evicted from `A1in`, and an LRU `Am` for
//! entries referenced again after leaving `A1in`.
//!
//! An entry reaches `Am` only by being inserted while its key is in `A1out`, i.e. by being
//! re-referenced after a full trip through `A1in`; a one-time scan therefore flows through
//! `A1in` and `A1out` and never touches `Am`. Hits in `A1in` change nothing (they are
//! "correlated references"). Eviction takes `A1in`'s tail while `A1in` holds more than
//! `Kin` = 25% of the capacity, otherwise `Am`'s tail; `A1out` keeps `Kout` = 50% of the
//! capacity worth of hashes (the paper's and libCacheSim's defaults; [`TwoQ::with_ratios`]
//! sets others).
//!
//! Capacity is re-estimated at every eviction as the number of tracked entries (the cache
//! evicts when full), so the targets follow the real size, not only the hint. If the
//! preferred queue has no acceptable candidate the other one is tried, so a refusal never
//! makes eviction fail while an acceptable entry exists.

use crate::ghost::Ghost;
use crate::list::{ListId, SlotLists, Verdicts};
use crate::parameters::{ghost_share, share};
use crate::{grow_to_slot, Placement, Policy, Slot, Verdict};

const NO_REUSE: ListId = 0;
const A1_IN: ListId = 1;
const A_MAIN: ListId = 2;

/// 2Q replacement.
pub struct TwoQ {
    lists: SlotLists<3>,
    a1_out: Ghost,
    key_hashes: Vec<u64>,
    /// Entries the cache holds when full (re-estimated at each eviction).
    capacity: usize,
    /// `Kin` as a fraction of the capacity.
    a1_in_ratio: f64,
    /// `Kout` as a fraction of the capacity.
    a1_out_ratio: f64,
}

impl TwoQ {
    /// Empty queues sized for a cache of about `capacity` entries.
    pub fn with_capacity(capacity: usize) -> Self {
        let defaults = crate::PolicyParameters::default();
        Self::with_ratios(
            capacity,
            defaults.two_q_ain_size_ratio,
            defaults.two_q_aout_size_ratio,
        )
    }

    /// Empty queues with `Kin` = `a1_in_ratio` and `Kout` = `a1_out_ratio` of the capacity.
    pub fn with_ratios(capacity: usize, a1_in_ratio: f64, a1_out_ratio: f64) -> Self {
        TwoQ {
            lists: SlotLists::with_capacity(capacity),
            a1_out: Ghost::with_capacity(share(capacity, a1_out_ratio) + 1),
            key_hashes: Vec::with_capacity(capacity),
            capacity: capacity.max(1),
            a1_in_ratio,
            a1_out_ratio,
        }
    }

    fn a1_in_target(&self) -> usize {
        share(self.capacity, self.a1_in_ratio).max(1)
    }

    fn a1_out_target(&self) -> usize {
        ghost_share(self.capacity, self.a1_out_ratio)
    }

    fn evict_from_a1_in(&mut self, verdicts: &mut Verdicts<'_>) -> Option<Slot> {
        let slot = self.lists.take_oldest_accepted(A1_IN, verdicts)?;
        self.a1_out.push(self.key_hashes[slot as usize]);
        // One hash of slack: the insert that follows this eviction looks its key up first and
        // trims after, as libCacheSim (which looks up before evicting) effectively does.
        self.a1_out.trim_to(self.a1_out_target() + 1);
        Some(slot)
    }
}

impl Policy for TwoQ {
    fn name(&self) -> &'static str {
        "2q"
    }

    fn insert(&mut self, slot: Slot, key_hash: u64, placement: Placement) {
        grow_to_slot(&mut self.key_hashes, slot);
        self.key_hashes[slot as usize] = key_hash;
        match placement {
            Placement::NoReuse => self.lists.push_head(NO_REUSE, slot),
            Placement::Normal if self.a1_out.remove(key_hash) => self.lists.push_head(A_MAIN, slot),
            Placement::Normal => self.lists.push_head(A1_IN, slot),
        }
        self.a1_out.trim_to(self.a1_out_target());
    }

    fn access(&mut self, slot: Slot) {
        match self.lists.list_of(slot) {
            Some(A_MAIN) => self.lists.move_to_head(A_MAIN, slot),
            Some(NO_REUSE) => {
                self.lists.move_to_head(A1_IN, slot);
            }
            // A1in hits are correlated references: 2Q ignores them.
            other => debug_assert_eq!(other, Some(A1_IN), "slot {slot} is not tracked"),
        }
    }

    fn remove(&mut self, slot: Slot) {
        if self.lists.list_of(slot).is_some() {
            self.lists.unlink(slot);
        }
    }

    fn hold(&mut self, slot: Slot) {
        self.lists.hold(slot);
    }

    fn release(&mut self, slot: Slot) {
        self.lists.release(slot);
    }

    fn held(&self) -> usize {
        self.lists.held()
    }

    fn evict(&mut self, verdict: &mut dyn FnMut(Slot) -> Verdict) -> Option<Slot> {
        let verdicts = &mut Verdicts::new(verdict);
        if let Some(slot) = self.lists.take_oldest_accepted(NO_REUSE, verdicts) {
            return Some(slot);
        }
        if verdicts.stopped() {
            return None;
        }
        self.capacity = self.lists.tracked().max(1);
        if self.lists.len(A1_IN) > self.a1_in_target() {
            self.evict_from_a1_in(verdicts)
                .or_else(|| self.lists.take_oldest_accepted(A_MAIN, verdicts))
        } else {
            self.lists
                .take_oldest_accepted(A_MAIN, verdicts)
                .or_else(|| self.evict_from_a1_in(verdicts))
        }
    }

    fn len(&self) -> usize {
        self.lists.tracked()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn re_reference_after_a1in_promotes_to_am() {
        let mut two_q = TwoQ::with_capacity(4);
        for slot in 0..4 {
            two_q.insert(slot, 100 + u64::from(slot), Placement::Normal);
        }
        // A1in holds 4 > Kin = 1: its tail (key 100) goes to A1out.
        assert_eq!(two_q.evict(&mut |_| Verdict::Evict), Some(0));
        assert!(two_q.a1_out.contains(100));
        two_q.insert(0, 100, Placement::Normal);
        assert_eq!(two_q.lists.list_of(0), Some(A_MAIN));
        assert!(!two_q.a1_out.contains(100));
        two_q.lists.debug_check();
    }

    #[test]
    fn no_reuse_evictions_leave_no_history() {
        let mut two_q = TwoQ::with_capacity(4);
        two_q.insert(0, 7, Placement::NoReuse);
        assert_eq!(two_q.evict(&mut |_| Verdict::Evict), Some(0));
        assert_eq!(two_q.a1_out.len(), 0);
    }
}
