//! Goal: the simulated disk keeps what is written and returns it, so simulated runs can check
//! data: through the real engine, every synced write reads back from a fresh cache, bytes
//! never written read as zeroes, and writing zeroes gives the memory back.
//! Method: a seeded stream of unaligned writes (some of zeroes) through a cache on a
//! `SimDevice`, mirrored in a plain byte vector; sync; read everything back through a second
//! cache on the same device and compare with the mirror; then check the device directly.

use std::io::{IoSlice, IoSliceMut};
use std::sync::Arc;

use bufcache::{Cache, CacheConfig, Device, Environment, InlineSpawner, NoWait, ObjectConfig};
use bufcache_sim::{
    sim_cache_config, DiskSpec, HostCosts, SimCore, SimDevice, SimRng, VirtualClock,
};

const LENGTH: u64 = 1 << 20;

fn cache(clock: &Arc<VirtualClock>) -> Cache {
    let config = sim_cache_config(CacheConfig {
        memory_bytes_max: 128 << 10,
        ..Default::default()
    });
    Cache::with_environment(
        config,
        Environment::new(clock.clone(), Arc::new(InlineSpawner), Arc::new(NoWait)),
    )
    .unwrap()
}

#[test]
fn synced_writes_read_back_through_a_fresh_cache() {
    let clock = Arc::new(VirtualClock::new());
    let disk = DiskSpec::nvme();
    let core = Arc::new(SimCore::new(
        disk.build(),
        HostCosts::modern(),
        clock.clone(),
    ));
    core.add_account("test");
    let device = Arc::new(SimDevice::new(core, LENGTH, "nvme"));
    let mut mirror = vec![0u8; LENGTH as usize];
    let mut rng = SimRng::new(14);
    let writer = cache(&clock)
        .open_object(ObjectConfig::new("disk", device.clone() as Arc<dyn Device>))
        .unwrap();
    for round in 0..400u64 {
        let offset = rng.below(LENGTH - 20_000);
        let length = rng.between(1, 20_000) as usize;
        let fill = if round % 5 == 0 {
            0
        } else {
            (round % 251) as u8 + 1
        };
        let data = vec![fill; length];
        writer.write_at(offset, &data, round % 7 == 0).unwrap();
        mirror[offset as usize..offset as usize + length].copy_from_slice(&data);
    }
    writer.flush().unwrap();
    let reader = cache(&clock)
        .open_object(ObjectConfig::new("disk", device.clone() as Arc<dyn Device>))
        .unwrap();
    let mut back = vec![0xAAu8; LENGTH as usize];
    reader.read_at(0, &mut back).unwrap();
    assert!(
        back == mirror,
        "the disk returned other bytes than were written"
    );
    let nonzero_chunks = mirror
        .chunks(4096)
        .filter(|c| c.iter().any(|&b| b != 0))
        .count();
    assert_eq!(device.stored_bytes(), nonzero_chunks as u64 * 4096);

    // Directly: an unaligned write across chunks, then zeroes over it free the chunks.
    let data = vec![7u8; 10_000];
    device
        .write_vectored_at(&[IoSlice::new(&data[..3]), IoSlice::new(&data[3..])], 4_000)
        .unwrap();
    let mut check = vec![0u8; 10_000];
    device
        .read_vectored_at(&mut [IoSliceMut::new(&mut check)], 4_000)
        .unwrap();
    assert_eq!(check, data);
    let zeroes = vec![0u8; LENGTH as usize];
    device
        .write_vectored_at(&[IoSlice::new(&zeroes)], 0)
        .unwrap();
    assert_eq!(device.stored_bytes(), 0, "zeroes are not stored");
}
