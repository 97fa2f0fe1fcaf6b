//! Goal: the file-system layout puts rotdelay gaps after every maxcontig blocks and the
//! engine's clusters stop at them; without rotdelay, runs merge and clusters reach the
//! cluster limit.
//! Method: check `FileMap` directly, then write a file through the engine on a simulated
//! disk and count the device writes and their sizes.

use bufcache::BlockMap;
use bufcache_sim::{
    sim_cache_config, DiskSpec, FsLayout, HostCosts, LayoutParams, SimConfig, Simulation,
    WorkloadSpec,
};

fn layout(maxcontig: u32, rotdelay_ms: f64) -> LayoutParams {
    LayoutParams {
        block_size: 8192,
        fragment_size: 1024,
        maxcontig,
        rotdelay_ms,
    }
}

#[test]
fn file_map_has_gaps_after_maxcontig_blocks() {
    // The 2.0 MB/s RZ25 estimate, on which 4 ms is just under one 8K block.
    let disk = DiskSpec::rz25_estimate();
    let mut fs = FsLayout::new(
        layout(4, 4.0),
        disk.bytes_per_ms(),
        disk.capacity_bytes(),
        0,
    );
    assert_eq!(
        fs.gap_bytes(),
        8192,
        "4 ms on the 2.0 MB/s RZ25 estimate rounds up to one 8K block"
    );
    let map = fs.allocate(10 * 8192 + 1000).unwrap();
    assert_eq!(map.runs(), 3);
    let first = map.map(0);
    assert_eq!(first.contiguous_blocks, 4);
    let second = map.map(4);
    assert_eq!(second.device_offset, first.device_offset + 5 * 8192);
    assert_eq!(map.map(5).contiguous_blocks, 3);
    // The next file starts after the last fragment of this one.
    let next = fs.allocate(8192).unwrap();
    assert_eq!(next.map(0).device_offset, map.map(10).device_offset + 1024);
    let mut flat = FsLayout::new(
        layout(4, 0.0),
        disk.bytes_per_ms(),
        disk.capacity_bytes(),
        0,
    );
    assert_eq!(
        flat.allocate(64 * 8192).unwrap().map(0).contiguous_blocks,
        64
    );
}

fn write_requests(maxcontig: u32, rotdelay_ms: f64) -> (u64, u64) {
    let mut config = SimConfig::new(DiskSpec::hdd7200(), HostCosts::modern());
    config.layout = layout(maxcontig, rotdelay_ms);
    config.cache = sim_cache_config(bufcache::CacheConfig {
        cluster_bytes_max: 256 << 10,
        ..Default::default()
    });
    let mut sim = Simulation::new(&config).unwrap();
    let workload: WorkloadSpec = "dd:write,bs=1M,count=4,fsync".parse().unwrap();
    workload.install(&mut sim).unwrap();
    sim.run().unwrap();
    let device = sim.report().device;
    (device.writes, device.write_bytes / device.writes.max(1))
}

#[test]
fn clusters_stop_at_layout_gaps() {
    // 4 MiB = 512 blocks: runs of 4 blocks with gaps give 128 writes of 32K at most.
    let (writes, average) = write_requests(4, 4.0);
    assert_eq!(writes, 128, "one write per run");
    assert_eq!(average, 32 << 10);
    // Without gaps the cluster limit (256K) decides.
    let (writes, average) = write_requests(4, 0.0);
    assert_eq!(writes, 16);
    assert_eq!(average, 256 << 10);
}
