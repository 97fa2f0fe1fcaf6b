//! Goal: the same seed gives the same simulation, byte for byte.
//! Method: run experiments and a multi-process custom workload twice each and compare their
//! JSON output exactly; a different seed must still run (and may differ).

use bufcache_sim::{run_custom, run_experiment, DiskSpec, ExperimentOptions, WorkloadSpec};

#[test]
fn experiments_repeat_byte_for_byte() {
    let options = ExperimentOptions {
        scale: 0.1,
        seed: 7,
    };
    // driver-clustering runs the io queue in virtual time (fifo and elevator), dynamic-buffers
    // the pager resizing the buffer area during the run.
    for name in ["maxbsize", "scan", "driver-clustering", "dynamic-buffers"] {
        let first = run_experiment(name, &options).unwrap().to_json();
        let second = run_experiment(name, &options).unwrap().to_json();
        assert_eq!(first, second, "{name} is not deterministic");
    }
}

#[test]
fn parallel_build_repeats_byte_for_byte() {
    let disk: DiskSpec = "cheetah9lp".parse().unwrap();
    let workload: WorkloadSpec = "build:jobs=3,sources=30,headers=40,includes=5,cpu_ms=2"
        .parse()
        .unwrap();
    let config = bufcache::CacheConfig {
        memory_bytes_max: 1 << 20,
        ..Default::default()
    };
    let first = run_custom(&disk, &workload, config.clone()).unwrap();
    let second = run_custom(&disk, &workload, config).unwrap();
    assert_eq!(first.to_json(), second.to_json());
    assert_eq!(first.report.processes.len(), 3);
    assert!(first.report.processes.iter().all(|p| p.finished));
    assert!(first.report.device.reads > 0 && first.report.elapsed_s > 0.0);
}
