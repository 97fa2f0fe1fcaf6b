use bufcache_sim::*;
#[test]
fn scratch() {
    for max in [16u64 << 10, 64 << 10] {
        let mut config = SimConfig::new(DiskSpec::rz25(), HostCosts::alpha1995());
        config.layout = LayoutParams { block_size: 8192, fragment_size: 1024, maxcontig: 8, rotdelay_ms: 4.0 };
        config.cache = sim_cache_config(bufcache::CacheConfig {
            page_size_bytes: 8192, buffer_size_max_bytes: max, cluster_size_max_bytes: max,
            transfer_size_max_bytes: 64 << 10, readahead_size_max_bytes: max, readahead_size_initial_bytes: 8192,
            memory_bytes_max: 8 << 20, ..Default::default() });
        let run = experiments::run_custom_with(&config, &"dd:write,bs=1M,count=86".parse().unwrap()).unwrap();
        println!("{}", run.to_text());
        println!("{:?}", run.report.daemons);
        println!("{:?}", run.report.processes[0]);
    }
}
