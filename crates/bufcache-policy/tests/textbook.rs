// Goal: each policy behaves as its paper describes on tiny hand-made sequences. Method: drive
// a `Simulator` (or the policy itself) with a few requests and check exactly which keys stay
// cached; each test names the behaviour it pins down.

use bufcache_policy::simulate::Simulator;
use bufcache_policy::{Arc, Placement, Policy, PolicyKind, Slot, Verdict};

/// Requests `keys` in order; returns the hit pattern.
fn hits(kind: PolicyKind, capacity_objects: usize, keys: &[u64]) -> Vec<bool> {
    let mut simulator = Simulator::new(kind, capacity_objects);
    keys.iter().map(|&key| simulator.access(key)).collect()
}

#[test]
fn lru_keeps_a_recently_hit_key_that_fifo_evicts() {
    // Cache of 3: 1 is hit, then 4 needs room. LRU evicts 2; FIFO evicts 1 (oldest insert).
    let keys = [1, 2, 3, 1, 4, 1];
    assert!(hits(PolicyKind::Lru, 3, &keys)[5], "lru");
    assert!(!hits(PolicyKind::Fifo, 3, &keys)[5], "fifo");
    // CLOCK gives 1 a second chance because of its reference bit.
    assert!(hits(PolicyKind::Clock, 3, &keys)[5], "clock");
}

#[test]
fn clock_clears_reference_bits_as_the_hand_passes() {
    // All three are referenced: the hand clears 1, 2, 3 and comes back to 1, which goes.
    let keys = [1, 2, 3, 1, 2, 3, 4, 1, 2];
    let pattern = hits(PolicyKind::Clock, 3, &keys);
    assert_eq!(&pattern[6..], &[false, false, false]);
}

#[test]
fn sieve_hand_skips_visited_keys_without_moving_them() {
    let mut simulator = Simulator::new(PolicyKind::Sieve, 4);
    for key in [1, 2, 3, 4, 1] {
        simulator.access(key);
    }
    // Hand starts at the tail: 1 is visited (cleared, kept in place), 2 is evicted.
    simulator.access(5);
    assert!(simulator.contains(1) && !simulator.contains(2));
    // The hand rests on 3, not back at 1: 3 goes next although 1 is older.
    simulator.access(6);
    assert!(simulator.contains(1) && !simulator.contains(3));
    // The hand moves on to 4: the oldest key, 1, survives every eviction of this pass.
    simulator.access(7);
    assert!(!simulator.contains(4) && simulator.contains(1));
}

#[test]
fn two_q_promotes_only_keys_re_referenced_after_leaving_a1in() {
    let mut simulator = Simulator::new(PolicyKind::TwoQ, 4);
    // Correlated references: 1 hit twice while in A1in, then pushed out by new keys.
    for key in [1, 1, 1, 2, 3, 4, 5, 6] {
        simulator.access(key);
    }
    assert!(!simulator.contains(1), "A1in hits must not protect a key");
    // 1 is in A1out: this miss inserts it into Am, where new keys cannot push it out.
    assert!(!simulator.access(1));
    for key in 10..30 {
        simulator.access(key);
    }
    assert!(
        simulator.contains(1),
        "a key in Am survives a stream of new keys"
    );
}

/// A minimal cache around one policy, so tests can read the policy's internals.
struct TinyCache<P> {
    policy: P,
    keys: Vec<Option<u64>>,
}

impl<P: Policy> TinyCache<P> {
    fn access(&mut self, key: u64) {
        if let Some(slot) = self.keys.iter().position(|&cached| cached == Some(key)) {
            return self.policy.access(slot as Slot);
        }
        let slot = match self.keys.iter().position(Option::is_none) {
            Some(free) => free as Slot,
            None => self
                .policy
                .evict(&mut |_| Verdict::Evict)
                .expect("a victim"),
        };
        self.keys[slot as usize] = Some(key);
        self.policy.insert(slot, key, Placement::Normal);
    }
}

#[test]
fn arc_grows_p_on_recency_misses_and_shrinks_it_on_frequency_misses() {
    let mut cache = TinyCache {
        policy: Arc::with_capacity(4),
        keys: vec![None; 4],
    };
    // Two frequent keys fill T2; then keys cycling just beyond T1's share miss in B1.
    for key in [100, 100, 101, 101] {
        cache.access(key);
    }
    for key in [1, 2, 3, 1, 2, 3, 1, 2, 3] {
        cache.access(key);
    }
    let grown = cache.policy.recent_target();
    assert!(grown > 0.0, "B1 hits must grow p (p = {grown})");
    // Now re-request the frequent keys after they were pushed out: B2 hits shrink p.
    for key in [4, 5, 6, 7, 8, 100, 101, 9, 10, 11, 12, 100, 101] {
        cache.access(key);
    }
    assert!(
        cache.policy.recent_target() < grown,
        "B2 hits must shrink p ({} -> {})",
        grown,
        cache.policy.recent_target()
    );
}

#[test]
fn s3fifo_one_hit_wonders_leave_through_the_small_queue() {
    let mut s3fifo = Simulator::new(PolicyKind::S3Fifo, 10);
    let mut lru = Simulator::new(PolicyKind::Lru, 10);
    for simulator in [&mut s3fifo, &mut lru] {
        // Five hot keys, each hit twice (S3-FIFO's bar for leaving the small queue), then 100
        // keys that are requested exactly once.
        for key in (0..5).chain(0..5).chain(0..5) {
            simulator.access(key);
        }
        for key in 1_000..1_100 {
            simulator.access(key);
        }
    }
    assert!(
        (0..5).all(|key| s3fifo.contains(key)),
        "s3fifo keeps the hot keys"
    );
    assert!(
        (0..5).all(|key| !lru.contains(key)),
        "lru lets the one-hit wonders win"
    );
}

#[test]
fn no_reuse_placement_recycles_the_streams_own_buffers_in_every_policy() {
    for &kind in PolicyKind::ALL {
        let mut simulator = Simulator::new(kind, 8);
        for key in 0..6 {
            simulator.access(key);
        }
        for key in 100..200 {
            simulator.access_with_placement(key, Placement::NoReuse);
        }
        assert!((0..6).all(|key| simulator.contains(key)), "{kind}");
    }
}
