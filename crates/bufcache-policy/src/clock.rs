//! CLOCK (second chance): a FIFO ring with one reference bit per entry.
//!
//! Hits only set the bit (no list surgery, so the hit path is a single store). The hand is
//! the ring's tail: a referenced entry has its bit cleared and is passed over (moved to the
//! head, which in a circular ring is the same as the hand advancing past it); an unreferenced
//! entry is the victim. New entries enter at the head with the bit clear, as in libCacheSim's
//! `Clock`. A refused candidate is passed over like a referenced one, so it stays tracked and
//! comes round again.
//!
//! Bound: one eviction examines at most `2 × len + 1` ring entries, because after one full
//! turn every bit is clear and the second turn asks `evictable` about every entry.

use crate::list::{ListId, SlotLists};
use crate::{grow_to_slot, Placement, Policy, Slot};

const NO_REUSE: ListId = 0;
const RING: ListId = 1;

/// CLOCK replacement.
pub struct Clock {
    lists: SlotLists<2>,
    /// Reference bit per slot.
    referenced: Vec<bool>,
}

impl Clock {
    /// An empty ring with room for `capacity` slots before it reallocates.
    pub fn with_capacity(capacity: usize) -> Self {
        Clock {
            lists: SlotLists::with_capacity(capacity),
            referenced: Vec::with_capacity(capacity),
        }
    }
}

impl Policy for Clock {
    fn name(&self) -> &'static str {
        "clock"
    }

    fn insert(&mut self, slot: Slot, _key_hash: u64, placement: Placement) {
        grow_to_slot(&mut self.referenced, slot);
        self.referenced[slot as usize] = false;
        match placement {
            Placement::Normal => self.lists.push_head(RING, slot),
            Placement::NoReuse => self.lists.push_head(NO_REUSE, slot),
        }
    }

    fn access(&mut self, slot: Slot) {
        if self.lists.list_of(slot) == Some(NO_REUSE) {
            self.lists.unlink(slot);
            self.lists.push_head(RING, slot);
            return;
        }
        debug_assert_eq!(self.lists.list_of(slot), Some(RING));
        self.referenced[slot as usize] = true;
    }

    fn remove(&mut self, slot: Slot) {
        if self.lists.list_of(slot).is_some() {
            self.lists.unlink(slot);
        }
    }

    fn evict(&mut self, evictable: &mut dyn FnMut(Slot) -> bool) -> Option<Slot> {
        if let Some(slot) = self.lists.take_oldest_accepted(NO_REUSE, evictable) {
            return Some(slot);
        }
        let examinations_max = 2 * self.lists.len(RING) + 1;
        for _ in 0..examinations_max {
            let hand = self.lists.tail(RING)?;
            let referenced = std::mem::replace(&mut self.referenced[hand as usize], false);
            if !referenced && evictable(hand) {
                self.lists.unlink(hand);
                return Some(hand);
            }
            self.lists.move_to_head(RING, hand);
        }
        None
    }

    fn len(&self) -> usize {
        self.lists.tracked()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn referenced_entries_get_a_second_chance() {
        let mut clock = Clock::with_capacity(3);
        for slot in 0..3 {
            clock.insert(slot, u64::from(slot), Placement::Normal);
        }
        clock.access(0);
        clock.access(1);
        assert_eq!(clock.evict(&mut |_| true), Some(2));
        // 0 and 1 lost their bits on the way past the hand; 0 is now the oldest.
        assert_eq!(clock.evict(&mut |_| true), Some(0));
        clock.lists.debug_check();
    }

    #[test]
    fn all_refused_gives_up_and_keeps_everything() {
        let mut clock = Clock::with_capacity(3);
        for slot in 0..3 {
            clock.insert(slot, u64::from(slot), Placement::Normal);
            clock.access(slot);
        }
        let mut asked = 0;
        assert_eq!(
            clock.evict(&mut |_| {
                asked += 1;
                false
            }),
            None
        );
        assert!(asked <= 2 * 3 + 1);
        assert_eq!(clock.len(), 3);
    }
}
