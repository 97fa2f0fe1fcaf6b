//! Least-recently-used: an intrusive doubly linked list over slots. Hits move a slot to the
//! head; victims are taken from the tail.
//!
//! `NoReuse` entries go to a separate first-in-first-out queue that is drained before the LRU
//! list, so a large sequential stream recycles its own buffers instead of the working set's,
//! and a stream's read-ahead blocks leave in the order they arrived (oldest first) rather
//! than the newest being dropped before it is read. A hit on a no-reuse entry moves it to the
//! LRU head like any hit. Refused candidates keep their place.

use crate::list::{ListId, SlotLists, Verdicts};
use crate::{Placement, Policy, Slot, Verdict};

const NO_REUSE: ListId = 0;
const RECENCY: ListId = 1;

/// Least-recently-used replacement.
pub struct Lru {
    lists: SlotLists<2>,
}

impl Lru {
    /// An empty list with room for `capacity` slots before it reallocates.
    pub fn with_capacity(capacity: usize) -> Self {
        Lru {
            lists: SlotLists::with_capacity(capacity),
        }
    }
}

impl Policy for Lru {
    fn name(&self) -> &'static str {
        "lru"
    }

    fn insert(&mut self, slot: Slot, _key_hash: u64, placement: Placement) {
        match placement {
            Placement::Normal => self.lists.push_head(RECENCY, slot),
            Placement::NoReuse => self.lists.push_head(NO_REUSE, slot),
        }
    }

    fn access(&mut self, slot: Slot) {
        debug_assert!(
            self.lists.list_of(slot).is_some(),
            "slot {slot} is not tracked"
        );
        self.lists.move_to_head(RECENCY, slot);
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
        self.lists
            .take_oldest_accepted(NO_REUSE, verdicts)
            .or_else(|| self.lists.take_oldest_accepted(RECENCY, verdicts))
    }

    fn len(&self) -> usize {
        self.lists.tracked()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_least_recently_used_first() {
        let mut lru = Lru::with_capacity(4);
        for slot in 0..4 {
            lru.insert(slot, slot as u64, Placement::Normal);
        }
        lru.access(0);
        assert_eq!(lru.evict(&mut |_| Verdict::Evict), Some(1));
        assert_eq!(lru.evict(&mut |slot| (slot != 2).into()), Some(3));
        assert_eq!(lru.evict(&mut |_| Verdict::Evict), Some(2));
        assert_eq!(lru.evict(&mut |_| Verdict::Evict), Some(0));
        assert_eq!(lru.evict(&mut |_| Verdict::Evict), None);
        assert!(lru.is_empty());
    }

    #[test]
    fn no_reuse_entries_are_evicted_before_the_working_set() {
        let mut lru = Lru::with_capacity(4);
        lru.insert(0, 0, Placement::Normal);
        lru.insert(1, 1, Placement::NoReuse);
        lru.insert(2, 2, Placement::Normal);
        assert_eq!(lru.evict(&mut |_| Verdict::Evict), Some(1));
        lru.remove(0);
        assert_eq!(lru.len(), 1);
        assert_eq!(lru.evict(&mut |_| Verdict::Evict), Some(2));
    }

    #[test]
    fn no_reuse_entries_leave_oldest_first() {
        let mut lru = Lru::with_capacity(4);
        lru.insert(0, 0, Placement::Normal);
        lru.insert(1, 1, Placement::NoReuse);
        lru.insert(2, 2, Placement::NoReuse);
        assert_eq!(lru.evict(&mut |_| Verdict::Evict), Some(1));
        assert_eq!(lru.evict(&mut |_| Verdict::Evict), Some(2));
        lru.lists.debug_check();
    }
}
