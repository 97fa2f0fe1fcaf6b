//! Intrusive doubly linked lists over slots, shared by every list-based policy.
//!
//! `SlotLists` owns one link record per slot and the two ends of a small fixed number of
//! lists (LRU has one, ARC has T1 and T2, ...), plus the *no-reuse* list that every policy
//! keeps for [`Placement::NoReuse`](crate::Placement::NoReuse) entries. A slot is on at most
//! one list at a time; `list_of` says which. All operations are O(1) and allocate only when a
//! slot number beyond the current high-water mark is first seen.
//!
//! Orientation: the *head* is where new entries go, the *tail* is the oldest entry and the
//! first eviction candidate. `toward_head` walks from tail to head.
//!
//! A tracked slot may be *held* ([`SlotLists::hold`]): taken off its list's chain, so no walk
//! sees it, but still tracked, with the list it belongs to (its *home*) remembered.
//! [`SlotLists::release`] puts it back at the head of its home. While held, `list_of` names
//! the home, `move_to_head` only changes the home, and `unlink` forgets the slot: the policy
//! code above reads and moves a held slot as if it were on its list.
//!
//! Invariants (checked by `debug_check` in tests): each list's `len` equals the number of
//! slots on its chain, the links of a list form a chain from head to tail, and `tracked()` is
//! the sum of the list lengths plus the held slots.

use crate::{Slot, Verdict};

/// An evictor's verdicts during one `evict`, remembering a [`Verdict::Stop`]: once the
/// evictor has stopped, every later candidate is refused without asking it.
pub(crate) struct Verdicts<'a> {
    verdict: &'a mut dyn FnMut(Slot) -> Verdict,
    stopped: bool,
}

impl<'a> Verdicts<'a> {
    pub(crate) fn new(verdict: &'a mut dyn FnMut(Slot) -> Verdict) -> Self {
        Verdicts {
            verdict,
            stopped: false,
        }
    }

    /// True when the evictor takes `slot`; false when it leaves it, or has stopped.
    pub(crate) fn takes(&mut self, slot: Slot) -> bool {
        if self.stopped {
            return false;
        }
        match (self.verdict)(slot) {
            Verdict::Evict => true,
            Verdict::Skip => false,
            Verdict::Stop => {
                self.stopped = true;
                false
            }
        }
    }

    /// True once the evictor said [`Verdict::Stop`]: the policy moves nothing more and
    /// returns `None`.
    pub(crate) fn stopped(&self) -> bool {
        self.stopped
    }
}

/// No slot: the end of a chain.
pub(crate) const NONE: Slot = Slot::MAX;

/// Identifies one list inside a [`SlotLists`].
pub(crate) type ListId = u8;

/// `list` value of a slot on no list.
const DETACHED: ListId = ListId::MAX;

/// Bit of the `list` value of a held slot; the other bits name its home list.
const HELD: ListId = 0x80;

#[derive(Clone, Copy, Debug)]
struct Links {
    /// Neighbour toward the head (newer), or `NONE`.
    newer: Slot,
    /// Neighbour toward the tail (older), or `NONE`.
    older: Slot,
    list: ListId,
}

const UNLINKED: Links = Links {
    newer: NONE,
    older: NONE,
    list: DETACHED,
};

#[derive(Clone, Copy, Debug)]
struct Ends {
    head: Slot,
    tail: Slot,
    len: usize,
}

const EMPTY: Ends = Ends {
    head: NONE,
    tail: NONE,
    len: 0,
};

/// `LIST_COUNT` intrusive lists over one slot space.
pub(crate) struct SlotLists<const LIST_COUNT: usize> {
    links: Vec<Links>,
    ends: [Ends; LIST_COUNT],
    tracked: usize,
    held: usize,
}

impl<const LIST_COUNT: usize> SlotLists<LIST_COUNT> {
    /// Empty lists with link records preallocated for `capacity` slots.
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        debug_assert!(LIST_COUNT < HELD as usize);
        SlotLists {
            links: Vec::with_capacity(capacity),
            ends: [EMPTY; LIST_COUNT],
            tracked: 0,
            held: 0,
        }
    }

    /// Makes sure `slot` has a link record (slots are dense, so this grows rarely).
    pub(crate) fn reserve_slot(&mut self, slot: Slot) {
        let index = slot as usize;
        if index >= self.links.len() {
            self.links.resize(index + 1, UNLINKED);
        }
    }

    /// The list `slot` is on (for a held slot, its home), or `None` when it is not tracked
    /// (or was never seen).
    pub(crate) fn list_of(&self, slot: Slot) -> Option<ListId> {
        match self.links.get(slot as usize) {
            Some(links) if links.list != DETACHED => Some(links.list & !HELD),
            _ => None,
        }
    }

    /// True when `slot` is held off its list.
    pub(crate) fn is_held(&self, slot: Slot) -> bool {
        self.links
            .get(slot as usize)
            .is_some_and(|links| links.list != DETACHED && links.list & HELD != 0)
    }

    /// Number of held slots.
    pub(crate) fn held(&self) -> usize {
        self.held
    }

    /// Takes a tracked `slot` off its list's chain, remembering the list; nothing that walks
    /// a list sees it until [`SlotLists::release`]. Holding a held slot changes nothing.
    pub(crate) fn hold(&mut self, slot: Slot) {
        debug_assert!(self.list_of(slot).is_some(), "slot {slot} is not tracked");
        if self.is_held(slot) {
            return;
        }
        let list = self.unlink(slot);
        self.links[slot as usize].list = list | HELD;
        self.tracked += 1;
        self.held += 1;
    }

    /// Puts a held `slot` back at the head of its home list. Releasing a slot that is not
    /// held changes nothing.
    pub(crate) fn release(&mut self, slot: Slot) {
        if !self.is_held(slot) {
            return;
        }
        let home = self.unlink(slot);
        self.push_head(home, slot);
    }

    /// Number of slots on `list`.
    pub(crate) fn len(&self, list: ListId) -> usize {
        self.ends[list as usize].len
    }

    /// Number of slots on any list.
    pub(crate) fn tracked(&self) -> usize {
        self.tracked
    }

    /// The oldest slot of `list`.
    pub(crate) fn tail(&self, list: ListId) -> Option<Slot> {
        some_slot(self.ends[list as usize].tail)
    }

    /// The neighbour of `slot` one step toward the head of its list.
    pub(crate) fn toward_head(&self, slot: Slot) -> Option<Slot> {
        some_slot(self.links[slot as usize].newer)
    }

    /// Puts an untracked `slot` at the head (newest end) of `list`.
    pub(crate) fn push_head(&mut self, list: ListId, slot: Slot) {
        self.reserve_slot(slot);
        debug_assert_eq!(self.list_of(slot), None, "slot {slot} is already on a list");
        let ends = &mut self.ends[list as usize];
        let old_head = ends.head;
        self.links[slot as usize] = Links {
            newer: NONE,
            older: old_head,
            list,
        };
        match old_head {
            NONE => ends.tail = slot,
            _ => self.links[old_head as usize].newer = slot,
        }
        ends.head = slot;
        ends.len += 1;
        self.tracked += 1;
    }

    /// Takes a tracked `slot` off its list (or its hold) and returns the list it was on (the
    /// held slot's home).
    pub(crate) fn unlink(&mut self, slot: Slot) -> ListId {
        let Links { newer, older, list } = self.links[slot as usize];
        debug_assert_ne!(list, DETACHED, "slot {slot} is not tracked");
        if list & HELD != 0 {
            self.held -= 1;
            self.tracked -= 1;
            self.links[slot as usize] = UNLINKED;
            return list & !HELD;
        }
        let ends = &mut self.ends[list as usize];
        match newer {
            NONE => ends.head = older,
            _ => self.links[newer as usize].older = older,
        }
        match older {
            NONE => ends.tail = newer,
            _ => self.links[older as usize].newer = newer,
        }
        ends.len -= 1;
        self.tracked -= 1;
        self.links[slot as usize] = UNLINKED;
        list
    }

    /// Moves a tracked `slot` to the head of `list` (which may be its own list). A held slot
    /// stays held, with `list` as its new home.
    pub(crate) fn move_to_head(&mut self, list: ListId, slot: Slot) {
        if self.is_held(slot) {
            self.links[slot as usize].list = list | HELD;
            return;
        }
        if self.ends[list as usize].head != slot {
            self.unlink(slot);
            self.push_head(list, slot);
        }
    }

    /// Walks `list` from its tail toward its head and removes and returns the first slot that
    /// `verdicts` takes. Refused slots stay where they are. Examines each slot once, and none
    /// once the evictor has stopped.
    pub(crate) fn take_oldest_accepted(
        &mut self,
        list: ListId,
        verdicts: &mut Verdicts<'_>,
    ) -> Option<Slot> {
        let mut candidate = self.tail(list);
        while let Some(slot) = candidate {
            if verdicts.takes(slot) {
                self.unlink(slot);
                return Some(slot);
            }
            if verdicts.stopped() {
                return None;
            }
            candidate = self.toward_head(slot);
        }
        None
    }

    /// Panics unless the lists are consistent with their recorded lengths. O(slots).
    #[cfg(test)]
    pub(crate) fn debug_check(&self) {
        let held = self
            .links
            .iter()
            .filter(|links| links.list != DETACHED && links.list & HELD != 0)
            .count();
        assert_eq!(held, self.held);
        let mut total = held;
        for list in 0..LIST_COUNT {
            let mut count = 0;
            let mut previous = NONE;
            let mut cursor = self.ends[list].tail;
            while cursor != NONE {
                let links = self.links[cursor as usize];
                assert_eq!(links.list as usize, list);
                assert_eq!(links.older, previous);
                count += 1;
                previous = cursor;
                cursor = links.newer;
            }
            assert_eq!(previous, self.ends[list].head);
            assert_eq!(count, self.ends[list].len);
            total += count;
        }
        assert_eq!(total, self.tracked);
    }
}

fn some_slot(slot: Slot) -> Option<Slot> {
    (slot != NONE).then_some(slot)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn push_unlink_and_walk_keep_the_chain_consistent() {
        let mut lists = SlotLists::<2>::with_capacity(4);
        lists.push_head(0, 0);
        lists.push_head(0, 1);
        lists.push_head(0, 2);
        lists.push_head(1, 4);
        lists.push_head(1, 5);
        lists.debug_check();
        assert_eq!(lists.tail(0), Some(0));
        assert_eq!(lists.toward_head(0), Some(1));
        assert_eq!(lists.tail(1), Some(4));
        assert_eq!(
            lists.take_oldest_accepted(0, &mut Verdicts::new(&mut |slot| (slot != 0).into())),
            Some(1)
        );
        assert_eq!(lists.unlink(5), 1);
        lists.move_to_head(0, 0);
        lists.debug_check();
        assert_eq!(lists.toward_head(2), Some(0));
        assert_eq!(lists.tracked(), 3);
        assert_eq!(lists.list_of(5), None);
        assert_eq!(lists.list_of(99), None);
    }

    #[test]
    fn held_slots_leave_the_walk_and_come_back_at_the_head_of_their_home() {
        // Goal: a held slot is never walked over, stays tracked, follows moves of its home,
        // and comes back at its home's head. Method: hold the tail, walk, move, release.
        let mut lists = SlotLists::<2>::with_capacity(4);
        for slot in 0..3 {
            lists.push_head(0, slot);
        }
        lists.hold(0);
        lists.hold(0);
        lists.debug_check();
        assert_eq!(lists.tracked(), 3);
        assert_eq!(lists.held(), 1);
        assert_eq!(lists.len(0), 2);
        assert_eq!(lists.list_of(0), Some(0));
        let mut seen = Vec::new();
        assert_eq!(
            lists.take_oldest_accepted(
                0,
                &mut Verdicts::new(&mut |slot| {
                    seen.push(slot);
                    Verdict::Skip
                })
            ),
            None
        );
        assert_eq!(seen, vec![1, 2]);
        lists.move_to_head(1, 0);
        assert_eq!(lists.list_of(0), Some(1));
        assert!(lists.is_held(0));
        lists.release(0);
        lists.debug_check();
        assert!(!lists.is_held(0));
        assert_eq!(lists.tail(1), Some(0));
        lists.hold(2);
        assert_eq!(lists.unlink(2), 0);
        lists.debug_check();
        assert_eq!(lists.tracked(), 2);
        assert_eq!(lists.held(), 0);
    }
}
