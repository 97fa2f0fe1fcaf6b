//! Cost of the two policy paths the cache takes under its shard lock, per policy, through
//! `Box<dyn Policy>` as the engine calls them: `access` (a hit) on a full 4,096-entry policy in
//! a scattered slot order, and `evict` + `insert` (a miss in a full cache, fresh keys, nothing
//! refused). Run: `cargo bench -p bufcache-policy`.

use std::hint::black_box;
use std::time::Duration;

use bufcache_policy::{Placement, Policy, PolicyKind, Slot, Verdict};
use criterion::{criterion_group, criterion_main, Criterion};

const ENTRIES: u32 = 4_096;

/// A full policy whose history has seen one round of evictions.
fn full_policy(kind: PolicyKind) -> Box<dyn Policy> {
    let mut policy = kind.build(ENTRIES as usize);
    for slot in 0..ENTRIES {
        policy.insert(slot, u64::from(slot), Placement::Normal);
    }
    for key in u64::from(ENTRIES)..2 * u64::from(ENTRIES) {
        let victim = policy.evict(&mut |_| Verdict::Evict).expect("a victim");
        policy.insert(victim, key, Placement::Normal);
    }
    policy
}

/// Slots in a scattered order (an odd multiplier permutes `0..ENTRIES`).
fn scattered_slots() -> Vec<Slot> {
    (0..ENTRIES)
        .map(|index| index.wrapping_mul(2_654_435_761) % ENTRIES)
        .collect()
}

fn access_hit(criterion: &mut Criterion) {
    let mut group = criterion.benchmark_group("access_hit");
    let order = scattered_slots();
    for &kind in PolicyKind::ALL {
        let mut policy = full_policy(kind);
        let mut index = 0usize;
        group.bench_function(kind.name(), |bencher| {
            bencher.iter(|| {
                policy.access(black_box(order[index % order.len()]));
                index += 1;
            })
        });
    }
    group.finish();
}

fn insert_evict(criterion: &mut Criterion) {
    let mut group = criterion.benchmark_group("evict_insert");
    for &kind in PolicyKind::ALL {
        let mut policy = full_policy(kind);
        let mut next_key = 1u64 << 32;
        group.bench_function(kind.name(), |bencher| {
            bencher.iter(|| {
                let victim = policy.evict(&mut |_| Verdict::Evict).expect("a victim");
                policy.insert(victim, black_box(next_key), Placement::Normal);
                next_key += 1;
            })
        });
    }
    group.finish();
}

fn configured() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(50)
}

criterion_group! {
    name = benches;
    config = configured();
    targets = access_hit, insert_evict
}
criterion_main!(benches);
