//! Goal: the simulator charges page wiring for every buffer the engine fills and unwiring for
//! every buffer it evicts, exactly, although it no longer reads the engine's full statistics
//! on every call (it charges device reads at once and reconciles with sampled statistics).
//! Method: run the same workloads with wiring free and with wiring priced, check the engine
//! did the same work in both, and that the extra system time is exactly the priced pages.

use bufcache_sim::experiments::run_custom_with;
use bufcache_sim::{sim_cache_config, DiskSpec, HostCosts, SimConfig, WorkloadSpec};

fn total_sys_ns(report: &bufcache_sim::RunReport) -> u64 {
    let processes: f64 = report.processes.iter().map(|p| p.sys_s).sum();
    let daemons: u64 = report.daemons.iter().map(|a| a.sys_ns).sum();
    (processes * 1e9).round() as u64 + daemons
}

fn run(workload: &str, wire_page_ns: u64, unwire_page_ns: u64) -> bufcache_sim::RunReport {
    let disk: DiskSpec = "nvme".parse().unwrap();
    let host = HostCosts {
        wire_page_ns,
        unwire_page_ns,
        ..HostCosts::modern()
    };
    let mut config = SimConfig::new(disk, host);
    config.cache = sim_cache_config(bufcache::CacheConfig {
        memory_bytes_max: 4 << 20,
        page_size_bytes: 4096,
        ..Default::default()
    });
    let workload: WorkloadSpec = workload.parse().unwrap();
    run_custom_with(&config, &workload).unwrap().report
}

#[test]
fn wiring_and_unwiring_are_charged_for_every_buffer() {
    // A read larger than the cache (fills and evictions through read-ahead) and a write of
    // whole blocks (buffers created without any device read).
    for workload in ["dd:read,bs=4k,count=4096", "dd:write,bs=8k,count=2048"] {
        let free = run(workload, 0, 0);
        let priced = run(workload, 1_000, 300);
        let (a, b) = (&free.cache, &priced.cache);
        assert_eq!(
            (a.misses, a.readahead_issued_blocks, a.evictions),
            (b.misses, b.readahead_issued_blocks, b.evictions),
            "{workload}: pricing CPU work must not change what the engine does here"
        );
        assert!(b.evictions > 0, "{workload}: the cache must fill and evict");
        // 8 KiB blocks of 4 KiB pages.
        let block_pages = 2;
        let expected = (b.misses + b.readahead_issued_blocks) * block_pages * 1_000
            + b.evictions * block_pages * 300;
        let extra = total_sys_ns(&priced) - total_sys_ns(&free);
        // Process times are reported in seconds (f64): allow rounding of a few ns.
        assert!(
            extra.abs_diff(expected) <= 16,
            "{workload}: extra sys {extra} ns, expected {expected} ns"
        );
    }
}
