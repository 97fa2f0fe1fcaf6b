// Goal: every policy keeps the `Policy` contract under arbitrary use. Method: random
// insert/access/remove/hold/release/evict sequences with random refusals (pinned/dirty buffers)
// and stops (read-ahead that must not be evicted), checked
// after every step against a shadow set of tracked slots, over many seeds, capacity hints
// that differ from the real size, and both placements. A failure names the policy and seed.

mod common;

use std::panic::{catch_unwind, AssertUnwindSafe};

use bufcache_policy::{Placement, Policy, PolicyKind, Slot, Verdict};
use common::Rng;

const SEEDS: u64 = 300;
const STEPS_PER_SEED: usize = 3_000;

/// How an eviction call answers `evictable`.
#[derive(Clone, Copy, Debug)]
enum Refusals {
    None,
    /// Each slot refused with this percentage, fixed for the call.
    Some(u64),
    All,
    /// The first this many candidates refused, the next one answered `Verdict::Stop`.
    StopAfter(usize),
}

struct Shadow {
    tracked: Vec<bool>,
    /// Slots held off the eviction queues: `evict` must never ask about them.
    held: Vec<bool>,
}

impl Shadow {
    fn count(&self) -> usize {
        self.tracked.iter().filter(|&&tracked| tracked).count()
    }

    fn random_tracked(&self, rng: &mut Rng) -> Option<Slot> {
        let tracked: Vec<Slot> = (0..self.tracked.len() as Slot)
            .filter(|&slot| self.tracked[slot as usize])
            .collect();
        (!tracked.is_empty()).then(|| tracked[rng.below(tracked.len() as u64) as usize])
    }
}

fn refused(slot: Slot, salt: u64, refusals: Refusals) -> bool {
    match refusals {
        Refusals::None => false,
        Refusals::All | Refusals::StopAfter(_) => true,
        Refusals::Some(percent) => {
            let mut rng = Rng::new(salt ^ (u64::from(slot) << 32));
            rng.percent(percent)
        }
    }
}

fn check_evict(policy: &mut dyn Policy, shadow: &mut Shadow, rng: &mut Rng, step: usize) {
    let refusals = match rng.below(5) {
        0 => Refusals::None,
        1 => Refusals::All,
        2 => Refusals::StopAfter(rng.below(4) as usize),
        _ => Refusals::Some(rng.below(100)),
    };
    let salt = rng.next_u64();
    let length_before = policy.len();
    let mut asked = 0usize;
    let mut stopped_at = None;
    let victim = policy.evict(&mut |slot| {
        assert_eq!(
            stopped_at, None,
            "step {step}: asked about {slot} after a stop"
        );
        asked += 1;
        assert!(
            shadow.tracked.get(slot as usize).copied().unwrap_or(false),
            "step {step}: asked about untracked slot {slot}"
        );
        assert!(
            !shadow.held[slot as usize],
            "step {step}: asked about held slot {slot}"
        );
        if let Refusals::StopAfter(skips) = refusals {
            if asked > skips {
                stopped_at = Some(slot);
                return Verdict::Stop;
            }
        }
        Verdict::from(!refused(slot, salt, refusals))
    });
    if let Some(slot) = stopped_at {
        assert_eq!(victim, None, "step {step}: evicted after a stop");
        assert_eq!(
            policy.len(),
            length_before,
            "step {step}: a stop forgot a slot"
        );
        assert!(shadow.tracked[slot as usize]);
        return;
    }
    assert!(
        asked <= 10 * length_before + 10,
        "step {step}: {asked} examinations for {length_before} entries"
    );
    match victim {
        Some(slot) => {
            assert!(
                shadow.tracked[slot as usize],
                "step {step}: evicted untracked {slot}"
            );
            assert!(
                !refused(slot, salt, refusals),
                "step {step}: evicted refused {slot}"
            );
            shadow.tracked[slot as usize] = false;
        }
        None => {
            let acceptable = (0..shadow.tracked.len() as Slot).find(|&slot| {
                shadow.tracked[slot as usize]
                    && !shadow.held[slot as usize]
                    && !refused(slot, salt, refusals)
            });
            assert_eq!(
                acceptable, None,
                "step {step}: evict gave up ({refusals:?}) though a slot was acceptable"
            );
        }
    }
}

fn run_seed(kind: PolicyKind, seed: u64) {
    let mut rng = Rng::new(seed);
    let slot_count = 1 + rng.below(48) as usize;
    // Hints both smaller and larger than the real number of slots.
    let capacity_hint = rng.below(2 * slot_count as u64 + 2) as usize;
    let key_space = 1 + 3 * slot_count as u64;
    let mut policy = kind.build(capacity_hint);
    let mut shadow = Shadow {
        tracked: vec![false; slot_count],
        held: vec![false; slot_count],
    };
    for step in 0..STEPS_PER_SEED {
        match rng.below(100) {
            0..=39 => {
                let slot = rng.below(slot_count as u64) as Slot;
                if shadow.tracked[slot as usize] {
                    check_evict(policy.as_mut(), &mut shadow, &mut rng, step);
                } else {
                    let placement = if rng.percent(15) {
                        Placement::NoReuse
                    } else {
                        Placement::Normal
                    };
                    policy.insert(slot, rng.below(key_space), placement);
                    shadow.tracked[slot as usize] = true;
                }
            }
            40..=69 => {
                if let Some(slot) = shadow.random_tracked(&mut rng) {
                    policy.access(slot);
                }
            }
            70..=77 => {
                let slot = rng.below(slot_count as u64) as Slot;
                policy.remove(slot);
                shadow.tracked[slot as usize] = false;
                shadow.held[slot as usize] = false;
            }
            78..=83 => {
                if let Some(slot) = shadow.random_tracked(&mut rng) {
                    policy.hold(slot);
                    shadow.held[slot as usize] = true;
                }
            }
            84..=88 => {
                let slot = rng.below(slot_count as u64) as Slot;
                policy.release(slot);
                shadow.held[slot as usize] = false;
            }
            _ => check_evict(policy.as_mut(), &mut shadow, &mut rng, step),
        }
        assert_eq!(policy.len(), shadow.count(), "step {step}: len differs");
        let held = shadow.held.iter().filter(|&&held| held).count();
        assert_eq!(policy.held(), held, "step {step}: held count differs");
    }
    for slot in 0..slot_count as Slot {
        policy.release(slot);
        shadow.held[slot as usize] = false;
    }
    drain(policy.as_mut(), &mut shadow);
}

/// Evicting with nothing refused returns every tracked slot exactly once, then `None`.
fn drain(policy: &mut dyn Policy, shadow: &mut Shadow) {
    while let Some(slot) = policy.evict(&mut |_| Verdict::Evict) {
        assert!(
            shadow.tracked[slot as usize],
            "drain returned untracked {slot}"
        );
        shadow.tracked[slot as usize] = false;
    }
    assert_eq!(shadow.count(), 0, "drain lost tracked slots");
    assert!(policy.is_empty());
}

#[test]
fn every_policy_keeps_the_contract_under_random_use() {
    for &kind in PolicyKind::ALL {
        for seed in 0..SEEDS {
            let outcome = catch_unwind(AssertUnwindSafe(|| run_seed(kind, seed)));
            if outcome.is_err() {
                panic!("policy `{kind}` failed with seed {seed} (see the panic above)");
            }
        }
    }
}

#[test]
fn names_round_trip_and_unknown_names_are_rejected() {
    for &kind in PolicyKind::ALL {
        assert_eq!(kind.name().parse::<PolicyKind>(), Ok(kind));
        assert_eq!(kind.build(4).name(), kind.name());
    }
    assert_eq!(" S3FIFO ".parse::<PolicyKind>(), Ok(PolicyKind::S3Fifo));
    let error = "mru".parse::<PolicyKind>().unwrap_err();
    assert!(error.to_string().contains("2q"), "{error}");
}

#[test]
fn every_policy_survives_a_real_size_far_from_the_hint() {
    for &kind in PolicyKind::ALL {
        for (capacity_hint, real_size) in [(0, 50), (1_000, 3), (8, 800)] {
            let mut policy = kind.build(capacity_hint);
            let mut keys = vec![u64::MAX; real_size];
            for request in 0..20 * real_size as u64 {
                let key = request % (2 * real_size as u64);
                let cached = keys.iter().position(|&cached| cached == key);
                match cached {
                    Some(slot) => policy.access(slot as Slot),
                    None => {
                        let slot = match keys.iter().position(|&cached| cached == u64::MAX) {
                            Some(free) => free as Slot,
                            None => policy.evict(&mut |_| Verdict::Evict).expect("a victim"),
                        };
                        keys[slot as usize] = key;
                        policy.insert(slot, key, Placement::Normal);
                    }
                }
                assert_eq!(
                    policy.len(),
                    keys.iter().filter(|&&k| k != u64::MAX).count()
                );
            }
        }
    }
}
