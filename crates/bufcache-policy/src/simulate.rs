//! A single-threaded cache simulator for miss-ratio experiments, counting the way libCacheSim
//! does: a request for a cached key is a hit; any other request is a miss that inserts the
//! key, evicting first until it fits. Nothing is ever refused (no pins, no dirty buffers).
//!
//! The simulator owns what the engine owns in real use: the key → slot map, the slot → key
//! table, and the free-slot list, so slots stay dense and are reused after eviction exactly
//! as the engine reuses them. Capacity is counted in *units*: one per object for
//! [`Simulator::new`] (libCacheSim's `--ignore-obj-size`), or bytes for
//! [`Simulator::with_byte_capacity`] where each request carries its size. An object larger
//! than the whole cache is a miss and is not inserted, as in libCacheSim.
//!
//! Invariant: `used_units <= capacity_units`, and the policy tracks exactly the cached keys.

use std::collections::HashMap;

use crate::ghost::BuildMixHasher;
use crate::{Placement, Policy, PolicyKind, PolicyParameters, Slot, Verdict};

/// Hash of a key as the simulator hands it to the policy. Different keys get different
/// hashes (the function is a bijection), so ghost lists never confuse two keys.
pub fn key_hash(key: u64) -> u64 {
    let mixed = (key ^ (key >> 31)).wrapping_mul(0x7FB5_D329_728E_A185);
    mixed ^ (mixed >> 27)
}

/// One cache driven by one policy.
pub struct Simulator {
    policy: Box<dyn Policy>,
    capacity_units: u64,
    used_units: u64,
    slots_by_key: HashMap<u64, Slot, BuildMixHasher>,
    /// Key and size held by each slot (meaningful only while the slot is in use).
    entries: Vec<(u64, u64)>,
    free_slots: Vec<Slot>,
    hits: u64,
    misses: u64,
}

impl Simulator {
    /// A cache of `capacity_objects` objects of unit size.
    pub fn new(kind: PolicyKind, capacity_objects: usize) -> Self {
        Self::with_units(kind, capacity_objects as u64, capacity_objects)
    }

    /// A cache of `capacity_bytes` bytes; `typical_object_bytes` (e.g. the block size) only
    /// sizes the policy's queues and ghost lists before the first eviction.
    pub fn with_byte_capacity(
        kind: PolicyKind,
        capacity_bytes: u64,
        typical_object_bytes: u64,
    ) -> Self {
        let capacity_hint = capacity_bytes / typical_object_bytes.max(1);
        Self::with_units(kind, capacity_bytes, capacity_hint as usize)
    }

    /// A cache of `capacity_objects` objects of unit size, with non-default policy
    /// parameters (which must have passed [`PolicyParameters::validate`]).
    pub fn with_parameters(
        kind: PolicyKind,
        capacity_objects: usize,
        parameters: &PolicyParameters,
    ) -> Self {
        let policy = kind.build_with(capacity_objects, parameters);
        Self::with_built_policy(policy, capacity_objects as u64, capacity_objects)
    }

    /// A cache of `capacity_objects` unit-size objects driven by a policy built elsewhere
    /// (with non-default parameters, or wrapped for an experiment).
    pub fn with_policy(policy: Box<dyn Policy>, capacity_objects: usize) -> Self {
        Self::with_built_policy(policy, capacity_objects as u64, capacity_objects)
    }

    fn with_units(kind: PolicyKind, capacity_units: u64, capacity_hint: usize) -> Self {
        Self::with_built_policy(kind.build(capacity_hint), capacity_units, capacity_hint)
    }

    fn with_built_policy(
        policy: Box<dyn Policy>,
        capacity_units: u64,
        capacity_hint: usize,
    ) -> Self {
        Simulator {
            policy,
            capacity_units,
            used_units: 0,
            slots_by_key: HashMap::with_capacity_and_hasher(
                capacity_hint,
                BuildMixHasher::default(),
            ),
            entries: Vec::with_capacity(capacity_hint),
            free_slots: Vec::new(),
            hits: 0,
            misses: 0,
        }
    }

    /// Requests `key` (unit size, normal placement); true on a hit.
    pub fn access(&mut self, key: u64) -> bool {
        self.access_sized_with_placement(key, 1, Placement::Normal)
    }

    /// Requests `key` (unit size); a miss inserts it with `placement`. True on a hit.
    pub fn access_with_placement(&mut self, key: u64, placement: Placement) -> bool {
        self.access_sized_with_placement(key, 1, placement)
    }

    /// Requests `key` of `size_bytes` (byte-capacity caches); true on a hit.
    pub fn access_sized(&mut self, key: u64, size_bytes: u64) -> bool {
        self.access_sized_with_placement(key, size_bytes, Placement::Normal)
    }

    /// Requests `key` occupying `size_units`; a miss inserts it with `placement`.
    /// A hit does not change the recorded size.
    pub fn access_sized_with_placement(
        &mut self,
        key: u64,
        size_units: u64,
        placement: Placement,
    ) -> bool {
        if let Some(&slot) = self.slots_by_key.get(&key) {
            self.policy.access(slot);
            self.hits += 1;
            return true;
        }
        self.misses += 1;
        if size_units > self.capacity_units {
            return false;
        }
        if placement == Placement::Normal {
            self.policy.announce_miss(key_hash(key));
        }
        if self.make_room(size_units) {
            self.insert(key, size_units, placement);
        }
        false
    }

    /// Evicts until `size_units` more fit; false if the policy found no victim.
    fn make_room(&mut self, size_units: u64) -> bool {
        while self.used_units + size_units > self.capacity_units {
            let Some(victim) = self.policy.evict(&mut |_| Verdict::Evict) else {
                debug_assert!(false, "policy found no victim with nothing refused");
                return false;
            };
            let (key, size) = self.entries[victim as usize];
            let removed = self.slots_by_key.remove(&key);
            debug_assert_eq!(removed, Some(victim), "policy evicted an unknown slot");
            self.used_units -= size;
            self.free_slots.push(victim);
        }
        true
    }

    fn insert(&mut self, key: u64, size_units: u64, placement: Placement) {
        let slot = match self.free_slots.pop() {
            Some(slot) => slot,
            None => {
                self.entries.push((0, 0));
                (self.entries.len() - 1) as Slot
            }
        };
        self.entries[slot as usize] = (key, size_units);
        self.slots_by_key.insert(key, slot);
        self.used_units += size_units;
        self.policy.insert(slot, key_hash(key), placement);
        debug_assert_eq!(self.policy.len(), self.slots_by_key.len());
    }

    /// Drops `key` from the cache (the engine's invalidation path); true if it was cached.
    pub fn remove(&mut self, key: u64) -> bool {
        let Some(slot) = self.slots_by_key.remove(&key) else {
            return false;
        };
        self.policy.remove(slot);
        self.used_units -= self.entries[slot as usize].1;
        self.free_slots.push(slot);
        true
    }

    /// True when `key` is cached (does not count as a request).
    pub fn contains(&self, key: u64) -> bool {
        self.slots_by_key.contains_key(&key)
    }

    /// Requests that hit.
    pub fn hits(&self) -> u64 {
        self.hits
    }

    /// Requests that missed.
    pub fn misses(&self) -> u64 {
        self.misses
    }

    /// Misses over requests (0 when there were none).
    pub fn miss_ratio(&self) -> f64 {
        let requests = self.hits + self.misses;
        if requests == 0 {
            0.0
        } else {
            self.misses as f64 / requests as f64
        }
    }

    /// Forgets the hit and miss counts (e.g. after a warm-up), keeping the cache contents.
    pub fn reset_counters(&mut self) {
        self.hits = 0;
        self.misses = 0;
    }

    /// Number of cached objects.
    pub fn len(&self) -> usize {
        self.slots_by_key.len()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.slots_by_key.is_empty()
    }

    /// Units (objects or bytes) in use.
    pub fn used_units(&self) -> u64 {
        self.used_units
    }

    /// The policy's name.
    pub fn policy_name(&self) -> &'static str {
        self.policy.name()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_policy_hits_when_the_working_set_fits() {
        for &kind in PolicyKind::ALL {
            let mut simulator = Simulator::new(kind, 8);
            for round in 0..3 {
                for key in 0..8 {
                    assert_eq!(simulator.access(key), round > 0, "{kind} key {key}");
                }
            }
            assert_eq!(simulator.misses(), 8);
        }
    }

    #[test]
    fn byte_capacity_counts_sizes_and_rejects_oversized_objects() {
        let mut simulator = Simulator::with_byte_capacity(PolicyKind::Lru, 16 * 4096, 4096);
        for key in 0..20 {
            simulator.access_sized(key, 4096);
        }
        assert_eq!(simulator.len(), 16);
        assert!(!simulator.access_sized(99, 1 << 20));
        assert!(!simulator.contains(99));
        assert!(simulator.used_units() <= 16 * 4096);
    }
}
