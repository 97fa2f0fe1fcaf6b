//! The experiments added for seeds 003 and 004 measure what they claim.

use bufcache_sim::{run_experiment, ExperimentOptions};

#[test]
fn a_fixed_buffer_area_adds_memory_pressure_that_a_dynamic_one_gives_back() {
    // Goal: `dynamic-buffers` shows seed 003's trade-off: a fixed, wired buffer area pushes a
    // parallel build's memory past RAM where a dynamic area shrinks instead. Method: run it at
    // quarter scale; rows alternate fixed, dynamic for -j 1, 10, 20, 30.
    let options = ExperimentOptions {
        scale: 0.25,
        seed: 1,
    };
    let result = run_experiment("dynamic-buffers", &options).unwrap();
    let text = result.to_text();
    let value = |row: usize, column: &str| result.value(row, column).unwrap();
    // -j1: plenty of memory, no pressure either way.
    assert_eq!(value(0, "pressure_MiB"), 0.0, "{text}");
    assert_eq!(value(1, "pressure_MiB"), 0.0, "{text}");
    // -j30: the fixed area adds pressure the dynamic one does not.
    assert!(
        value(6, "pressure_MiB") > value(7, "pressure_MiB"),
        "{text}"
    );
    // The dynamic area shrinks as the jobs take memory.
    assert!(
        value(1, "buffer_MiB_min") > value(7, "buffer_MiB_min"),
        "{text}"
    );
    // It grows back as the jobs end: its largest size is above its smallest.
    assert!(
        value(7, "buffer_MiB_max") > value(7, "buffer_MiB_min"),
        "{text}"
    );
    assert!(value(7, "resizes") > 0.0, "{text}");
}

#[test]
fn driver_clustering_counts_commands_with_merging_off_and_on() {
    // Goal: `driver-clustering` compares the same workloads with the io queue merging off and
    // on. Method: run it at small scale; merging can only remove commands, never add any, and
    // every request entered the queue.
    let options = ExperimentOptions {
        scale: 0.1,
        seed: 1,
    };
    let result = run_experiment("driver-clustering", &options).unwrap();
    let text = result.to_text();
    for row in 0..2 {
        let off = result.value(row, "commands_merge_off").unwrap();
        let on = result.value(row, "commands_merge_on").unwrap();
        let requests = result.value(row, "requests").unwrap();
        assert!(on <= off && off <= requests && requests > 0.0, "{text}");
        let saved = result.value(row, "saved_%").unwrap();
        assert!((0.0..100.0).contains(&saved), "{text}");
    }
}
