//! SIEVE (Zhang et al., NSDI'24): a FIFO queue, one visited bit per entry, and a hand that
//! moves from the oldest entry toward the newest.
//!
//! Hits only set the visited bit. New entries enter at the head; the hand is *not* the tail:
//! it remembers where the last eviction stopped, so entries that survived a pass keep their
//! place (unlike CLOCK, nothing is moved). Eviction clears visited bits as the hand passes and
//! takes the first unvisited entry; the hand then rests on that entry's newer neighbour, and
//! wraps to the tail after passing the head. Refused candidates are passed over in place.
//!
//! Invariant: `hand` is `NONE` (start at the tail) or a slot on `QUEUE`; `remove` of the
//! hand's slot advances the hand first. Bound: at most `2 × len + 1` examinations per
//! eviction, since one full turn clears every bit.

use crate::list::{ListId, SlotLists, Verdicts, NONE};
use crate::{grow_to_slot, Placement, Policy, Slot, Verdict};

const NO_REUSE: ListId = 0;
const QUEUE: ListId = 1;

/// SIEVE replacement.
pub struct Sieve {
    lists: SlotLists<2>,
    visited: Vec<bool>,
    /// Next candidate to examine, or `NONE` to start at the tail.
    hand: Slot,
}

impl Sieve {
    /// An empty queue with room for `capacity` slots before it reallocates.
    pub fn with_capacity(capacity: usize) -> Self {
        Sieve {
            lists: SlotLists::with_capacity(capacity),
            visited: Vec::with_capacity(capacity),
            hand: NONE,
        }
    }

    /// The slot the hand examines next.
    fn hand_slot(&self) -> Option<Slot> {
        match self.hand {
            NONE => self.lists.tail(QUEUE),
            slot => Some(slot),
        }
    }

    /// The slot after `slot` in hand order, wrapping from the head to the tail.
    fn after(&self, slot: Slot) -> Option<Slot> {
        self.lists
            .toward_head(slot)
            .or_else(|| self.lists.tail(QUEUE))
    }
}

impl Policy for Sieve {
    fn name(&self) -> &'static str {
        "sieve"
    }

    fn insert(&mut self, slot: Slot, _key_hash: u64, placement: Placement) {
        grow_to_slot(&mut self.visited, slot);
        self.visited[slot as usize] = false;
        match placement {
            Placement::Normal => self.lists.push_head(QUEUE, slot),
            Placement::NoReuse => self.lists.push_head(NO_REUSE, slot),
        }
    }

    fn access(&mut self, slot: Slot) {
        if self.lists.list_of(slot) == Some(NO_REUSE) {
            self.lists.move_to_head(QUEUE, slot);
            return;
        }
        debug_assert_eq!(self.lists.list_of(slot), Some(QUEUE));
        self.visited[slot as usize] = true;
    }

    fn remove(&mut self, slot: Slot) {
        match self.lists.list_of(slot) {
            None => {}
            Some(QUEUE) if slot == self.hand => {
                self.hand = self.lists.toward_head(slot).unwrap_or(NONE);
                self.lists.unlink(slot);
            }
            Some(_) => {
                self.lists.unlink(slot);
            }
        }
    }

    fn hold(&mut self, slot: Slot) {
        // The hand never rests on a slot off the queue.
        if slot == self.hand && !self.lists.is_held(slot) {
            self.hand = self.lists.toward_head(slot).unwrap_or(NONE);
        }
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
        debug_assert!(self.hand == NONE || self.lists.list_of(self.hand) == Some(QUEUE));
        let examinations_max = 2 * self.lists.len(QUEUE) + 1;
        let mut cursor = self.hand_slot();
        for _ in 0..examinations_max {
            let slot = cursor?;
            let visited = std::mem::replace(&mut self.visited[slot as usize], false);
            if !visited && verdicts.takes(slot) {
                self.hand = self.lists.toward_head(slot).unwrap_or(NONE);
                self.lists.unlink(slot);
                return Some(slot);
            }
            if verdicts.stopped() {
                // The hand stays on the candidate the evictor stopped at.
                self.hand = slot;
                return None;
            }
            cursor = self.after(slot);
        }
        self.hand = cursor.unwrap_or(NONE);
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
    fn hand_resumes_where_the_last_eviction_stopped() {
        let mut sieve = Sieve::with_capacity(4);
        for slot in 0..4 {
            sieve.insert(slot, u64::from(slot), Placement::Normal);
        }
        sieve.access(0);
        sieve.access(2);
        // Hand passes 0 (clearing it), evicts 1, rests on 2.
        assert_eq!(sieve.evict(&mut |_| Verdict::Evict), Some(1));
        sieve.insert(4, 4, Placement::Normal);
        // 2 is visited: cleared and passed; 3 is evicted, not the old 0 behind the hand.
        assert_eq!(sieve.evict(&mut |_| Verdict::Evict), Some(3));
        assert_eq!(sieve.evict(&mut |_| Verdict::Evict), Some(4));
        assert_eq!(sieve.evict(&mut |_| Verdict::Evict), Some(0));
        sieve.lists.debug_check();
    }

    #[test]
    fn removing_the_hand_slot_moves_the_hand() {
        let mut sieve = Sieve::with_capacity(3);
        for slot in 0..3 {
            sieve.insert(slot, u64::from(slot), Placement::Normal);
        }
        assert_eq!(sieve.evict(&mut |_| Verdict::Evict), Some(0));
        sieve.remove(1);
        assert_eq!(sieve.evict(&mut |_| Verdict::Evict), Some(2));
        assert!(sieve.is_empty());
    }
}
