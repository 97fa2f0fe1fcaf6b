//! The VM page cache behind the buffer cache (`bufcache_sim::vm`, `MemoryModel::page_cache`):
//! what it serves, what it costs, and what it keeps.

use std::io::{IoSlice, IoSliceMut};
use std::sync::Arc;
use std::time::Duration;

use bufcache::{CacheConfig, Device};
use bufcache_sim::vm::{Release, VmDevice, VmPages, PAGE_BYTES};
use bufcache_sim::workload::Sweep;
use bufcache_sim::{
    sim_cache_config, DiskSpec, HostCosts, MemoryModel, SimConfig, SimCore, SimDevice, Simulation,
    VirtualClock,
};

#[test]
fn a_read_served_from_resident_pages_returns_the_disks_bytes_without_disk_time() {
    // Goal: a page-cache hit returns what the disk holds (the pages are the file's data) and
    // costs no disk time, while a miss is a disk read. Method: write a pattern through the
    // page-cache device, read it back twice over a range half resident, and compare the
    // bytes, the disk's read count and the virtual time spent.
    let clock = Arc::new(VirtualClock::new());
    let disk = DiskSpec::travelstar();
    let core = Arc::new(SimCore::new(disk.build(), HostCosts::pii366(), clock));
    core.add_account("test");
    let inner = Arc::new(SimDevice::new(core.clone(), 1 << 20, "disk"));
    let vm = VmPages::new(Release::InactiveTail);
    let device = VmDevice::new(inner, core.clone(), vm.clone(), 1_000);
    let pattern: Vec<u8> = (0..64 * 1024u32).map(|i| (i * 7 + 3) as u8).collect();
    device
        .write_vectored_at(&[IoSlice::new(&pattern)], 128 << 10)
        .unwrap();
    // Only the first half is resident (as if a buffer had held it).
    vm.reference(128 << 10, 32 << 10, core.cursor());

    let reads_before = core.device_totals().reads;
    let mut back = vec![0u8; pattern.len()];
    device
        .read_vectored_at(&mut [IoSliceMut::new(&mut back)], 128 << 10)
        .unwrap();
    assert_eq!(
        back, pattern,
        "a half-resident read returns the disk's bytes"
    );
    assert_eq!(
        core.device_totals().reads - reads_before,
        1,
        "only the missing half is a disk read"
    );
    assert_eq!(vm.report().hit_bytes, 32 << 10);

    // Now every page is resident: no disk read, and only the rewiring's CPU time passes.
    let start = core.cursor();
    let mut again = vec![0u8; pattern.len()];
    device
        .read_vectored_at(&mut [IoSliceMut::new(&mut again)], 128 << 10)
        .unwrap();
    assert_eq!(again, pattern);
    assert_eq!(core.device_totals().reads - reads_before, 1);
    let pages = pattern.len() as u64 / PAGE_BYTES;
    assert_eq!(core.cursor() - start, pages * 1_000);
}

/// A sweep of a 16 MiB file, read once and then `passes` times, behind a 4 MiB buffer area
/// with or without the page cache; returns (bytes read from the disk, bytes served from
/// resident pages).
fn reread(page_cache: bool, ram_bytes: u64) -> (u64, u64) {
    let mib = 1u64 << 20;
    let mut config = SimConfig::new(DiskSpec::travelstar(), HostCosts::pii366());
    config.cache = sim_cache_config(CacheConfig {
        memory_bytes_max: 4 * mib,
        ..CacheConfig::default()
    });
    config.memory = Some(MemoryModel {
        ram_bytes,
        reserved_bytes: 8 * mib,
        process_bytes: 0,
        area_min_bytes: 0,
        dynamic: false,
        period: Duration::from_millis(100),
        paging: None,
        page_cache,
        dontneed: true,
    });
    let mut sim = Simulation::new(&config).unwrap();
    let file = sim.create_file("f", 16 * mib).unwrap();
    sim.spawn(
        "dd",
        Box::new(Sweep::new(file, vec![16 * mib], mib, 2)),
        0,
        true,
    );
    sim.run().unwrap();
    let report = sim.report();
    let hits = report
        .memory
        .and_then(|m| m.page_cache)
        .map_or(0, |p| p.hit_bytes);
    (report.device.read_bytes, hits)
}

#[test]
fn a_file_larger_than_the_buffer_area_is_reread_from_the_page_cache_while_memory_lasts() {
    // Goal: pages released by buffers stay in memory (Dillon's drop (1): "rewire other pages
    // from the VM page cache. Still no physical I/O"), until memory runs out (drop (2)).
    // Method: three reads of a 16 MiB file behind a 4 MiB buffer area: without the page
    // cache every read comes from the disk; with it and 64 MiB of RAM only the first; with
    // 20 MiB of RAM (12 MiB for files) a looping read larger than that memory misses again,
    // as a least-recently-released order must.
    let mib = 1u64 << 20;
    let (disk_without, _) = reread(false, 64 * mib);
    assert!(disk_without >= 3 * 16 * mib - 4 * mib, "{disk_without}");
    let (disk_with, hits) = reread(true, 64 * mib);
    assert!(disk_with <= 16 * mib + mib, "{disk_with}");
    assert!(hits >= 2 * 16 * mib - 4 * mib, "{hits}");
    let (disk_small, _) = reread(true, 20 * mib);
    assert!(disk_small >= 3 * 16 * mib - 4 * mib, "{disk_small}");
}
