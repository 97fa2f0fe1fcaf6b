//! CLOCK (second chance): a FIFO ring with a reference counter per entry, one bit by default
//! (`n` bits with [`Clock::with_bits`], libCacheSim's `n-bit-counter`).
//!
//! Hits only increment the counter, saturating at `2^n - 1` (no list surgery, so the hit path
//! is a single store). The hand is the ring's tail: an entry with a non-zero counter has it
//! decremented and is passed over (moved to the head, which in a circular ring is the same as
//! the hand advancing past it); an entry at zero is the victim. New entries enter at the head
//! with the counter at zero, as in libCacheSim's `Clock`. A refused candidate is passed over
//! like a referenced one, so it stays tracked and comes round again.
//!
//! Bound: one eviction examines at most `2^n × len + 1` ring entries, because after `2^n - 1`
//! full turns every counter is zero and the next turn asks the evictor about every entry.

use crate::list::{ListId, SlotLists, Verdicts};
use crate::{grow_to_slot, Placement, Policy, Slot, Verdict};

const NO_REUSE: ListId = 0;
const RING: ListId = 1;

/// CLOCK replacement.
pub struct Clock {
    lists: SlotLists<2>,
    /// Reference counter per slot.
    referenced: Vec<u8>,
    /// The counter's saturation value, `2^bits - 1`.
    counter_max: u8,
}

impl Clock {
    /// An empty ring with room for `capacity` slots before it reallocates.
    pub fn with_capacity(capacity: usize) -> Self {
        Self::with_bits(capacity, 1)
    }

    /// An empty ring whose entries carry a `bits`-bit reference counter (1 to 8).
    pub fn with_bits(capacity: usize, bits: u8) -> Self {
        assert!((1..=8).contains(&bits), "CLOCK counter of {bits} bits");
        Clock {
            lists: SlotLists::with_capacity(capacity),
            referenced: Vec::with_capacity(capacity),
            counter_max: ((1u16 << bits) - 1) as u8,
        }
    }
}

impl Policy for Clock {
    fn name(&self) -> &'static str {
        "clock"
    }

    fn insert(&mut self, slot: Slot, _key_hash: u64, placement: Placement) {
        grow_to_slot(&mut self.referenced, slot);
        self.referenced[slot as usize] = 0;
        match placement {
            Placement::Normal => self.lists.push_head(RING, slot),
            Placement::NoReuse => self.lists.push_head(NO_REUSE, slot),
        }
    }

    fn access(&mut self, slot: Slot) {
        if self.lists.list_of(slot) == Some(NO_REUSE) {
            self.lists.move_to_head(RING, slot);
            return;
        }
        debug_assert_eq!(self.lists.list_of(slot), Some(RING));
        let counter = &mut self.referenced[slot as usize];
        *counter = counter.saturating_add(1).min(self.counter_max);
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
        let turns = usize::from(self.counter_max) + 1;
        let examinations_max = turns * self.lists.len(RING) + 1;
        for _ in 0..examinations_max {
            let hand = self.lists.tail(RING)?;
            let counter = &mut self.referenced[hand as usize];
            let referenced = *counter > 0;
            *counter = counter.saturating_sub(1);
            if !referenced && verdicts.takes(hand) {
                self.lists.unlink(hand);
                return Some(hand);
            }
            if verdicts.stopped() {
                return None;
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
        assert_eq!(clock.evict(&mut |_| Verdict::Evict), Some(2));
        // 0 and 1 lost their bits on the way past the hand; 0 is now the oldest.
        assert_eq!(clock.evict(&mut |_| Verdict::Evict), Some(0));
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
                Verdict::Skip
            }),
            None
        );
        assert!(asked <= 2 * 3 + 1);
        assert_eq!(clock.len(), 3);
    }

    #[test]
    fn two_bit_counters_survive_three_passes_of_the_hand() {
        let mut clock = Clock::with_bits(2, 2);
        clock.insert(0, 0, Placement::Normal);
        clock.insert(1, 1, Placement::Normal);
        for _ in 0..5 {
            clock.access(0);
        }
        // 0's counter saturates at 3: the hand passes it three times (1 is re-inserted each
        // time as a fresh entry) before it is taken.
        for _ in 0..3 {
            assert_eq!(clock.evict(&mut |_| Verdict::Evict), Some(1));
            clock.insert(1, 1, Placement::Normal);
        }
        assert_eq!(clock.evict(&mut |_| Verdict::Evict), Some(0));
        clock.lists.debug_check();
    }
}
