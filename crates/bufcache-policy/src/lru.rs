//! Least-recently-used: an intrusive doubly linked list over slots. Hits move a slot to the
//! head; victims are taken from the tail. `NoReuse` entries are inserted at the tail, so a
//! large sequential stream recycles its own buffers instead of the working set's.

use crate::{Placement, Policy, Slot};

const NONE: Slot = Slot::MAX;

#[derive(Clone, Copy)]
struct Links {
    previous: Slot,
    next: Slot,
    tracked: bool,
}

const UNTRACKED: Links = Links {
    previous: NONE,
    next: NONE,
    tracked: false,
};

/// Least-recently-used replacement.
pub struct Lru {
    links: Vec<Links>,
    /// Most recently used end.
    head: Slot,
    /// Least recently used end: victims come from here.
    tail: Slot,
    count: usize,
}

impl Lru {
    /// An empty list with room for `capacity` slots before it reallocates.
    pub fn with_capacity(capacity: usize) -> Self {
        Lru {
            links: Vec::with_capacity(capacity),
            head: NONE,
            tail: NONE,
            count: 0,
        }
    }

    fn unlink(&mut self, slot: Slot) {
        let Links { previous, next, .. } = self.links[slot as usize];
        match previous {
            NONE => self.head = next,
            _ => self.links[previous as usize].next = next,
        }
        match next {
            NONE => self.tail = previous,
            _ => self.links[next as usize].previous = previous,
        }
        self.links[slot as usize] = UNTRACKED;
        self.count -= 1;
    }

    fn push_head(&mut self, slot: Slot) {
        self.links[slot as usize] = Links {
            previous: NONE,
            next: self.head,
            tracked: true,
        };
        match self.head {
            NONE => self.tail = slot,
            old_head => self.links[old_head as usize].previous = slot,
        }
        self.head = slot;
        self.count += 1;
    }

    fn push_tail(&mut self, slot: Slot) {
        self.links[slot as usize] = Links {
            previous: self.tail,
            next: NONE,
            tracked: true,
        };
        match self.tail {
            NONE => self.head = slot,
            old_tail => self.links[old_tail as usize].next = slot,
        }
        self.tail = slot;
        self.count += 1;
    }
}

impl Policy for Lru {
    fn name(&self) -> &'static str {
        "lru"
    }

    fn insert(&mut self, slot: Slot, _key_hash: u64, placement: Placement) {
        let index = slot as usize;
        if index >= self.links.len() {
            self.links.resize(index + 1, UNTRACKED);
        }
        debug_assert!(!self.links[index].tracked, "slot {slot} inserted twice");
        match placement {
            Placement::Normal => self.push_head(slot),
            Placement::NoReuse => self.push_tail(slot),
        }
    }

    fn access(&mut self, slot: Slot) {
        debug_assert!(self.links[slot as usize].tracked);
        if self.head != slot {
            self.unlink(slot);
            self.push_head(slot);
        }
    }

    fn remove(&mut self, slot: Slot) {
        if self.links.get(slot as usize).is_some_and(|links| links.tracked) {
            self.unlink(slot);
        }
    }

    fn evict(&mut self, evictable: &mut dyn FnMut(Slot) -> bool) -> Option<Slot> {
        let mut candidate = self.tail;
        while candidate != NONE {
            let previous = self.links[candidate as usize].previous;
            if evictable(candidate) {
                self.unlink(candidate);
                return Some(candidate);
            }
            candidate = previous;
        }
        None
    }

    fn len(&self) -> usize {
        self.count
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
        assert_eq!(lru.evict(&mut |_| true), Some(1));
        assert_eq!(lru.evict(&mut |slot| slot != 2), Some(3));
        assert_eq!(lru.evict(&mut |_| true), Some(2));
        assert_eq!(lru.evict(&mut |_| true), Some(0));
        assert_eq!(lru.evict(&mut |_| true), None);
        assert!(lru.is_empty());
    }

    #[test]
    fn no_reuse_entries_are_evicted_before_the_working_set() {
        let mut lru = Lru::with_capacity(4);
        lru.insert(0, 0, Placement::Normal);
        lru.insert(1, 1, Placement::NoReuse);
        lru.insert(2, 2, Placement::Normal);
        assert_eq!(lru.evict(&mut |_| true), Some(1));
        lru.remove(0);
        assert_eq!(lru.len(), 1);
        assert_eq!(lru.evict(&mut |_| true), Some(2));
    }
}
