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

#[test]
fn paging_costs_disk_time_where_the_jobs_outgrow_memory() {
    // Goal: seed 003's make -j30 real-time jump can appear: what the jobs and a wired buffer
    // area need beyond RAM is paged to swap on the same disk, in disk time, and Tanimura's
    // unwire/reclaim gives buffer pages back before the jobs page. Method: run
    // `dynamic-buffers` at full scale (paging per compile does not scale down with memory;
    // about 5 s; rows: fixed, dynamic for -j 1, 10, 20, 30) and compare paging and real time
    // between rows.
    let options = ExperimentOptions {
        scale: 1.0,
        seed: 1,
    };
    let result = run_experiment("dynamic-buffers", &options).unwrap();
    let text = result.to_text();
    let value = |row: usize, column: &str| result.value(row, column).unwrap();
    // -j1 and -j10 fit in memory: no paging, either way.
    for row in 0..4 {
        assert_eq!(value(row, "page_outs"), 0.0, "{text}");
        assert_eq!(value(row, "page_in_MiB"), 0.0, "{text}");
    }
    // -j30 with the wired area pages, and paging takes time: real -j30 > -j10.
    assert!(value(6, "page_outs") > 0.0, "{text}");
    assert!(value(6, "page_in_MiB") > 0.0, "{text}");
    assert!(value(6, "real_s") > value(2, "real_s") * 1.05, "{text}");
    // Reclaiming unwired buffer pages first leaves the jobs less to page.
    assert!(
        value(7, "page_out_MiB") < value(6, "page_out_MiB"),
        "{text}"
    );
    assert!(value(7, "real_s") < value(6, "real_s"), "{text}");
}

#[test]
fn a_paging_model_that_cannot_fit_is_refused_by_name() {
    // Goal: a swap area or cluster that cannot work is refused with an error naming the
    // field, not run. Method: build simulations with a zero cluster and a swap area as
    // large as the disk.
    use std::time::Duration;

    use bufcache_sim::sched::PAGE_OUTS_IN_FLIGHT_MAX;
    use bufcache_sim::{DiskSpec, HostCosts, MemoryModel, PagingModel, SimConfig, Simulation};
    let memory = |paging: PagingModel| MemoryModel {
        ram_bytes: 64 << 20,
        reserved_bytes: 8 << 20,
        process_bytes: 4 << 20,
        area_min_bytes: 1 << 20,
        dynamic: false,
        period: Duration::from_millis(100),
        paging: Some(paging),
        page_cache: false,
        dontneed: true,
    };
    let disk = DiskSpec::travelstar();
    let capacity = disk.capacity_bytes();
    for (paging, field) in [
        (
            PagingModel {
                swap_bytes: 64 << 20,
                cluster_bytes: 0,
                page_outs_in_flight_max: PAGE_OUTS_IN_FLIGHT_MAX,
            },
            "cluster_bytes",
        ),
        (
            PagingModel {
                swap_bytes: capacity,
                cluster_bytes: 64 << 10,
                page_outs_in_flight_max: PAGE_OUTS_IN_FLIGHT_MAX,
            },
            "swap_bytes",
        ),
    ] {
        let mut config = SimConfig::new(disk.clone(), HostCosts::pii366());
        config.memory = Some(memory(paging));
        let error = Simulation::new(&config).err().expect("refused").to_string();
        assert!(error.contains(field), "{error}");
    }
}

#[test]
fn memory_keys_parse_and_bad_ones_are_refused_by_name() {
    // Goal: `sim run --memory` takes seed 003's machine by default and refuses a bad key or
    // value naming it. Method: parse the default, a full set of keys, and bad inputs.
    use std::time::Duration;

    use bufcache_sim::MemoryModel;
    let default: MemoryModel = "default".parse().unwrap();
    assert_eq!(default, MemoryModel::seed003());
    let model: MemoryModel =
        "ram=64M,reserved=8M,job=4M,wired=2M,dynamic=on,period_ms=50,swap=128M,cluster=32k"
            .parse()
            .unwrap();
    assert_eq!(model.ram_bytes, 64 << 20);
    assert_eq!(model.process_bytes, 4 << 20);
    assert!(model.dynamic);
    assert_eq!(model.period, Duration::from_millis(50));
    let paging = model.paging.expect("swap given");
    assert_eq!(
        (paging.swap_bytes, paging.cluster_bytes),
        (128 << 20, 32 << 10)
    );
    let watched: MemoryModel = "swap=off".parse().unwrap();
    assert!(watched.paging.is_none());
    for (text, field) in [
        ("rams=1M", "rams"),
        ("dynamic=maybe", "dynamic"),
        ("period_ms=0", "period_ms"),
        ("ram=8M", "reserved"),
        ("swap=1M,cluster=2M", "cluster"),
        ("job", "job"),
    ] {
        let error = text.parse::<MemoryModel>().unwrap_err().to_string();
        assert!(error.contains(field), "{text}: {error}");
    }
}
