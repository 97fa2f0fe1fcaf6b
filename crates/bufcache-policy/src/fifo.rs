//! First in, first out: entries leave in insertion order and hits change nothing.
//!
//! The baseline every other policy is measured against, and the cheapest hit path there is
//! (`access` only checks a debug invariant). One queue plus the shared no-reuse queue, which
//! is drained first. A refused candidate keeps its place, so a pinned buffer is the next
//! victim once it is released.

use crate::list::{ListId, SlotLists, Verdicts};
use crate::{Placement, Policy, Slot, Verdict};

const NO_REUSE: ListId = 0;
const QUEUE: ListId = 1;

/// First-in-first-out replacement.
pub struct Fifo {
    lists: SlotLists<2>,
}

impl Fifo {
    /// An empty queue with room for `capacity` slots before it reallocates.
    pub fn with_capacity(capacity: usize) -> Self {
        Fifo {
            lists: SlotLists::with_capacity(capacity),
        }
    }
}

impl Policy for Fifo {
    fn name(&self) -> &'static str {
        "fifo"
    }

    fn insert(&mut self, slot: Slot, _key_hash: u64, placement: Placement) {
        match placement {
            Placement::Normal => self.lists.push_head(QUEUE, slot),
            Placement::NoReuse => self.lists.push_head(NO_REUSE, slot),
        }
    }

    fn access(&mut self, slot: Slot) {
        // A re-read no-reuse entry turned out to be reused: give it a normal place.
        if self.lists.list_of(slot) == Some(NO_REUSE) {
            self.lists.move_to_head(QUEUE, slot);
        }
        debug_assert_eq!(self.lists.list_of(slot), Some(QUEUE));
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
            .or_else(|| self.lists.take_oldest_accepted(QUEUE, verdicts))
    }

    fn len(&self) -> usize {
        self.lists.tracked()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hits_do_not_change_the_order() {
        let mut fifo = Fifo::with_capacity(3);
        for slot in 0..3 {
            fifo.insert(slot, u64::from(slot), Placement::Normal);
        }
        fifo.access(0);
        assert_eq!(fifo.evict(&mut |slot| (slot != 0).into()), Some(1));
        assert_eq!(fifo.evict(&mut |_| Verdict::Evict), Some(0));
        fifo.lists.debug_check();
    }
}
