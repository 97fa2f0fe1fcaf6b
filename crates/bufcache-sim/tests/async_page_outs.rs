//! The page daemon's page-outs are asynchronous and bounded (`PagingModel`,
//! `sched::PAGE_OUTS_IN_FLIGHT_MAX`, `sched::free_min_bytes`).

use std::time::Duration;

use bufcache::CacheConfig;
use bufcache_sim::sched::{free_min_bytes, PagerActivity, PAGE_OUTS_IN_FLIGHT_MAX};
use bufcache_sim::{
    sim_cache_config, DiskSpec, HostCosts, MemoryModel, MemoryReport, PagingModel, SimConfig,
    Simulation, WorkloadSpec,
};

const MIB: u64 = 1 << 20;

/// A small seed-003 build at -j30 with a fixed 48 MiB area on the ThinkPad's disk, so the
/// jobs page hard: what the pager did and the memory report.
fn paging_build(page_cache: bool, in_flight_max: usize) -> (PagerActivity, MemoryReport) {
    let disk = DiskSpec::travelstar();
    let mut config = SimConfig::new(disk, HostCosts::pii366());
    config.cache = sim_cache_config(CacheConfig {
        memory_bytes_max: 48 * MIB,
        ..CacheConfig::default()
    });
    config.memory = Some(MemoryModel {
        ram_bytes: 160 * MIB,
        reserved_bytes: 16 * MIB,
        process_bytes: 6 * MIB,
        area_min_bytes: 6 * MIB,
        dynamic: false,
        period: Duration::from_millis(100),
        paging: Some(PagingModel {
            swap_bytes: 320 * MIB,
            cluster_bytes: 64 << 10,
            page_outs_in_flight_max: in_flight_max,
        }),
        page_cache,
        dontneed: true,
    });
    let spec: WorkloadSpec = "build:jobs=30,sources=90,headers=150,cpu_ms=1388"
        .parse()
        .expect("a valid workload");
    let mut sim = Simulation::new(&config).expect("a valid configuration");
    spec.install(&mut sim).expect("installed");
    sim.run().expect("the build runs");
    let activity = sim.pager_activity().expect("a memory model");
    let memory = sim.report().memory.expect("a memory model");
    (activity, memory)
}

#[test]
fn the_pager_keeps_looking_every_period_while_its_page_outs_are_in_flight() {
    // Goal: the page daemon issues its page-outs and goes on scanning (FreeBSD's
    // VM_PAGER_PUT_ASYNC), so it re-evaluates memory every period even while the disk is
    // saturated; before, it wrote its page-outs synchronously and did not look again for
    // up to ~100 s at -j30. Method: a paging -j30 build with and without the page cache;
    // the longest gap between two looks of the pager must be at most its period, while the
    // run pages and every slot was busy at once (the disk was the bottleneck).
    for page_cache in [false, true] {
        let (activity, memory) = paging_build(page_cache, PAGE_OUTS_IN_FLIGHT_MAX);
        println!("page_cache {page_cache}: {activity:?}, {memory:?}");
        assert!(memory.page_outs > 100, "the build pages: {memory:?}");
        assert!(
            activity.page_outs_async > 0,
            "the daemon issued page-outs: {activity:?}"
        );
        assert_eq!(
            activity.page_outs_in_flight_peak, PAGE_OUTS_IN_FLIGHT_MAX,
            "every slot was busy at once"
        );
        assert!(
            activity.look_gap_ns_max <= Duration::from_millis(100).as_nanos() as u64,
            "page_cache {page_cache}: the pager looked again within its period: {activity:?}"
        );
    }
}

#[test]
fn page_outs_in_flight_never_exceed_the_bound_and_no_owed_page_out_is_dropped() {
    // Goal: at most `page_outs_in_flight_max` page-out writes are in flight at once, and
    // bounding them loses no work: what the daemon cannot issue waits, and a faulting process
    // waits for the page-outs owed beyond the free minimum (VM_WAIT), so every page paged
    // in is matched by a page-out but for at most the free minimum. Method: the paging -j30
    // build with the bound at 1 and at FreeBSD's 4; the in-flight peak equals the bound and
    // the bytes written out cover the bytes read in less the free minimum.
    for in_flight_max in [1, PAGE_OUTS_IN_FLIGHT_MAX] {
        let (activity, memory) = paging_build(false, in_flight_max);
        println!("in_flight_max {in_flight_max}: {activity:?}, {memory:?}");
        assert_eq!(activity.page_outs_in_flight_max, in_flight_max);
        assert!(
            activity.page_outs_in_flight_peak <= in_flight_max,
            "in flight {} over the bound {in_flight_max}",
            activity.page_outs_in_flight_peak
        );
        assert_eq!(
            activity.page_outs_in_flight_peak, in_flight_max,
            "the bound was reached"
        );
        assert!(memory.page_in_bytes > 0, "the build pages in: {memory:?}");
        assert!(
            memory.page_out_bytes + free_min_bytes(160 * MIB) >= memory.page_in_bytes,
            "page-outs dropped: {} out for {} in",
            memory.page_out_bytes,
            memory.page_in_bytes
        );
        assert_eq!(
            activity.page_outs_async + activity.page_outs_waited,
            memory.page_outs,
            "every page-out is either the daemon's or waited for"
        );
    }
}

#[test]
fn a_page_out_bound_of_zero_is_refused_by_name() {
    // Goal: a paging model with no page-out slot would never write a page out; it is refused
    // with the field's name. Method: build a simulation with the bound at 0.
    let mut config = SimConfig::new(DiskSpec::travelstar(), HostCosts::pii366());
    let mut memory = MemoryModel::seed003();
    if let Some(paging) = memory.paging.as_mut() {
        paging.page_outs_in_flight_max = 0;
    }
    config.memory = Some(memory);
    let error = Simulation::new(&config).err().expect("refused").to_string();
    assert!(error.contains("page_outs_in_flight_max"), "{error}");
}
