//! Goal: the FFS model lays out and writes what 4.4BSD's FFS did — metadata in every
//! cylinder group, directories spread over the groups, indirect blocks at blocks 12 and
//! 12 + NINDIR, synchronous inode and directory writes on create, delayed writes pushed by
//! the update daemon — and the experiments print their figures beside the seed's.
//! Method: build the allocator on the RZ25's geometry and check placements; run small
//! workloads through the real engine on the simulator and count device writes and their
//! times; run experiments at a small scale and read their comparison lists.

use std::time::Duration;

use bufcache::CacheConfig;
use bufcache_sim::fs::{AgingParams, Ffs, FsGeometry, NewfsParams, INODE_BYTES};
use bufcache_sim::{
    run_experiment, sim_cache_config, ComparisonKind, DiskKind, DiskSpec, ExperimentOptions,
    HostCosts, Os, Process, SimConfig, SimError, Simulation, Step, WorkloadSpec,
};

fn rz25_geometry() -> FsGeometry {
    let DiskKind::Hdd(p) = DiskSpec::rz25().kind else {
        panic!("the RZ25 is a mechanical disk")
    };
    FsGeometry {
        capacity_bytes: p.capacity_bytes(),
        cylinder_bytes: p.sectors_per_track as u64 * p.heads as u64 * 512,
        track_bytes: p.sectors_per_track as u64 * 512,
    }
}

#[test]
fn ffs_spreads_directories_and_places_indirect_blocks_as_4_4bsd() {
    let mut ffs = Ffs::new(NewfsParams::default(), rz25_geometry()).unwrap();
    assert!(ffs.groups() > 10, "{} groups", ffs.groups());
    // ffs_dirpref: each new directory goes to the group with the fewest directories.
    let groups: Vec<usize> = (0..4)
        .map(|_| ffs.make_directory(12).unwrap().meta.group)
        .collect();
    let mut distinct = groups.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), 4, "directories in groups {groups:?}");
    // A file goes to its directory's group; its inode lies before the group's data.
    let file = ffs.create_file(groups[2], 40 << 20).unwrap();
    assert_eq!(file.meta.group, groups[2]);
    let group_start = ffs.group_start(groups[2]);
    assert!(file.meta.inode_offset >= group_start);
    assert_eq!(file.meta.inode_offset % INODE_BYTES, 0);
    // 40 MiB of 8K blocks = 5120 blocks: the single indirect at 12, the double and the first
    // second-level at 12 + 2048, another second-level at 12 + 4096.
    let lbns: Vec<u64> = file.meta.indirect_blocks.iter().map(|&(l, _)| l).collect();
    assert_eq!(lbns, vec![12, 2060, 2060, 4108], "{lbns:?}");
    // The indirect block breaks the run: block 12 is not right after block 11.
    let ranges = file.map.device_ranges(0, 14);
    assert!(ranges.len() >= 2, "{ranges:?}");
    // 40 MiB spans about nine 4.6 MB groups: every group boundary skips the next group's
    // superblock copy, bitmaps and inodes, and each indirect block breaks a run.
    assert!(file.map.runs() >= 9, "{} runs", file.map.runs());
}

#[test]
fn newfs_refuses_bad_parameters_by_name() {
    let bad = NewfsParams {
        maxcontig: 513,
        ..NewfsParams::default()
    };
    let error = Ffs::new(bad, rz25_geometry()).err().unwrap().to_string();
    assert!(error.contains("-a 513"), "{error}");
    let bad = NewfsParams {
        fragment_size: 3000,
        ..NewfsParams::default()
    };
    let error = Ffs::new(bad, rz25_geometry()).err().unwrap().to_string();
    assert!(error.contains("-f 3000"), "{error}");
    // The command line's form: newfs flags as keys.
    let parsed: NewfsParams = "a=16,d=0,n=1,r=5400,sync=off".parse().unwrap();
    assert_eq!(
        (
            parsed.maxcontig,
            parsed.rotdelay_ms,
            parsed.rotational_positions,
            parsed.rpm
        ),
        (16, 0.0, 1, 5400)
    );
    assert!(!parsed.sync_metadata);
    assert_eq!(
        "default".parse::<NewfsParams>().unwrap(),
        NewfsParams::default()
    );
    let error = "a=513".parse::<NewfsParams>().unwrap_err().to_string();
    assert!(error.contains("a = `513`"), "{error}");
    let error = "q=1".parse::<NewfsParams>().unwrap_err().to_string();
    assert!(error.contains("q = `1`"), "{error}");
}

fn tree_copy(fs: bool) -> bufcache_sim::RunReport {
    let disk = DiskSpec::rz25();
    let mut config = SimConfig::new(disk, HostCosts::alpha1995());
    if fs {
        config.fs = Some(NewfsParams::default());
    }
    let spec: WorkloadSpec = "treecopy:files=60,remote=on,dir_files=12".parse().unwrap();
    let mut sim = Simulation::new(&config).unwrap();
    spec.install(&mut sim).unwrap();
    sim.run().unwrap();
    sim.report()
}

#[test]
fn a_tree_copy_writes_inodes_and_directory_entries_synchronously() {
    let flat = tree_copy(false);
    let ffs = tree_copy(true);
    // Flat layout: data only (the copy's files, sorted and clustered by sync).
    // FFS: at least an inode and a directory entry written per file before the data.
    assert!(
        ffs.device.writes >= flat.device.writes + 2 * 60,
        "flat {} writes, ffs {} writes",
        flat.device.writes,
        ffs.device.writes
    );
    // The source is remote: nothing but metadata (inode blocks read before update) is read.
    assert!(ffs.device.reads < 60, "{} reads", ffs.device.reads);
    assert_eq!(ffs.device.interrupts, ffs.device.reads + ffs.device.writes);
}

/// Writes one 8 KiB block, then waits `idle` without syncing.
struct WriteThenIdle {
    idle_ns: u64,
    step: u32,
}

impl Process for WriteThenIdle {
    fn step(&mut self, os: &mut Os<'_>) -> Result<Step, SimError> {
        self.step += 1;
        match self.step {
            1 => {
                let file = os.create("f", 8192)?;
                os.write(file, 0, 8192)?;
                Ok(Step::Sleep(self.idle_ns))
            }
            _ => Ok(Step::Done),
        }
    }
}

fn idle_writer(update: Option<Duration>) -> bufcache_sim::RunReport {
    let mut config = SimConfig::new(DiskSpec::rz25(), HostCosts::alpha1995());
    config.cache = sim_cache_config(CacheConfig {
        // Only the update daemon may push the delayed write.
        dirty_age_max: Duration::from_secs(3600),
        write_behind: false,
        ..CacheConfig::default()
    });
    config.update_period = update;
    let mut sim = Simulation::new(&config).unwrap();
    sim.spawn(
        "writer",
        Box::new(WriteThenIdle {
            idle_ns: 65_000_000_000,
            step: 0,
        }),
        0,
        true,
    );
    sim.run().unwrap();
    sim.report()
}

#[test]
fn the_update_daemon_pushes_delayed_writes_every_30_seconds() {
    let without = idle_writer(None);
    assert_eq!(without.device.writes, 0, "nothing pushes the delayed write");
    let with = idle_writer(Some(Duration::from_secs(30)));
    assert_eq!(
        with.device.writes, 1,
        "the update daemon's first sync writes it"
    );
    let done_s = with.device.last_done_ns as f64 / 1e9;
    assert!((30.0..30.2).contains(&done_s), "written at {done_s} s");
}

#[test]
fn experiments_print_their_figures_beside_the_seeds() {
    let options = ExperimentOptions {
        scale: 0.25,
        seed: 1,
    };
    for (name, seed) in [
        ("maxbsize", "000"),
        ("newfs", "002"),
        ("driver-clustering", "004"),
    ] {
        let result = run_experiment(name, &options).unwrap();
        assert!(!result.comparison.is_empty(), "{name}");
        assert!(result.comparison.iter().all(|c| c.seed == seed), "{name}");
        assert!(
            result
                .comparison
                .iter()
                .any(|c| c.kind == ComparisonKind::Shape),
            "{name} has a shape"
        );
        let text = result.to_text();
        let beside = text
            .find("beside the seed")
            .expect("comparison in the text");
        let last_column = result.table.columns.last().unwrap();
        assert!(beside < text.rfind(last_column.as_str()).unwrap(), "{text}");
        let json: serde_json::Value = serde_json::from_str(&result.to_json()).unwrap();
        let first = &json["comparison"][0];
        for key in ["seed", "metric", "theirs", "ours"] {
            assert!(!first[key].is_null(), "{name}: {key} in {first}");
        }
        assert!(result
            .comparison_csv()
            .starts_with("seed,kind,metric,theirs,ours"));
    }
    // Seed 000's sys times are what the host costs were fitted to: an input, not a result.
    let maxbsize = run_experiment("maxbsize", &options).unwrap();
    assert!(maxbsize
        .comparison
        .iter()
        .any(|c| c.kind == ComparisonKind::Calibration && c.metric.contains("sys")));
}

/// Calls mkdir, or creates a file in a directory that was never made.
struct BadDirectoryCall {
    mkdir: bool,
}

impl Process for BadDirectoryCall {
    fn step(&mut self, os: &mut Os<'_>) -> Result<Step, SimError> {
        if self.mkdir {
            os.mkdir("d", 4)?;
        } else {
            os.create_in(7, "f", 100)?;
        }
        Ok(Step::Done)
    }
}

#[test]
fn directory_calls_refuse_what_cannot_apply_by_name() {
    // Without the FFS model there are no directories to make.
    let mut sim =
        Simulation::new(&SimConfig::new(DiskSpec::rz25(), HostCosts::alpha1995())).unwrap();
    sim.spawn("p", Box::new(BadDirectoryCall { mkdir: true }), 0, true);
    let error = sim.run().unwrap_err().to_string();
    assert!(
        error.contains("mkdir d") && error.contains("FFS"),
        "{error}"
    );
    // With it, directory 7 was never made.
    let mut config = SimConfig::new(DiskSpec::rz25(), HostCosts::alpha1995());
    config.fs = Some(NewfsParams::default());
    let mut sim = Simulation::new(&config).unwrap();
    sim.spawn("p", Box::new(BadDirectoryCall { mkdir: false }), 0, true);
    let error = sim.run().unwrap_err().to_string();
    assert!(error.contains("directory 7 does not exist"), "{error}");
}

fn rz28_geometry() -> FsGeometry {
    let DiskKind::Hdd(p) = DiskSpec::rz28().kind else {
        panic!("the RZ28 is a mechanical disk")
    };
    FsGeometry {
        capacity_bytes: p.capacity_bytes(),
        cylinder_bytes: p.sectors_per_track as u64 * p.heads as u64 * 512,
        track_bytes: p.sectors_per_track as u64 * 512,
    }
}

fn aged(positions: u32, seed: u64) -> (Ffs, bufcache_sim::fs::AgingReport) {
    let params = NewfsParams {
        maxcontig: 8,
        rotdelay_ms: 0.0,
        rotational_positions: positions,
        rpm: 5400,
        ..NewfsParams::default()
    };
    let mut ffs = Ffs::new(params, rz28_geometry()).unwrap();
    let report = ffs.age(&AgingParams::default(), seed).unwrap();
    (ffs, report)
}

#[test]
fn aging_fragments_free_space_and_n_decides_where_taken_requests_go() {
    // Goal: aging (create/remove churn through the allocator's free-block maps) leaves a
    // file system at its fill with free space in short runs, deterministically per seed,
    // and on it a new file's requested blocks are often taken, so -n (4.4BSD's rotational
    // search in ffs_alloccgblk) changes where the file goes — while on a fresh file system
    // a large file lies in a few long runs whatever -n is.
    // Method: age the RZ28's file system with -n 1 and with -n 8 (seed 7, printed), check
    // the reports, then place the same 4 MiB file in the first group and count its runs.
    let seed = 7;
    println!("seed {seed}");
    let (mut n1, report_n1) = aged(1, seed);
    let (mut n8, report_n8) = aged(8, seed);
    for report in [&report_n1, &report_n8] {
        assert!(
            (report.used_fraction - 0.7).abs() < 0.02,
            "used {:.3}",
            report.used_fraction
        );
        assert!(report.files_removed > 1000, "{report:?}");
        // A fresh group is one free run of ≈ 1800 blocks; aged ones are cut short.
        assert!(report.free_run_mean_blocks < 100.0, "{report:?}");
    }
    assert_eq!(
        aged(1, seed).1,
        report_n1,
        "aging is deterministic in its seed"
    );
    let file_n1 = n1.create_file(0, 4 << 20).unwrap();
    let file_n8 = n8.create_file(0, 4 << 20).unwrap();
    let mut fresh = Ffs::new(NewfsParams::default(), rz28_geometry()).unwrap();
    let file_fresh = fresh.create_file(0, 4 << 20).unwrap();
    // Fresh: the direct blocks, the indirect block, the rest (rotdelay gaps every 8 blocks).
    assert!(
        file_fresh.map.runs() <= 70,
        "{} runs",
        file_fresh.map.runs()
    );
    assert!(
        file_n1.map.runs() > 20 && file_n8.map.runs() > 20,
        "aged: {} runs with -n 1, {} with -n 8",
        file_n1.map.runs(),
        file_n8.map.runs()
    );
    let ranges_n1 = file_n1.map.device_ranges(0, 512);
    let ranges_n8 = file_n8.map.device_ranges(0, 512);
    assert_ne!(
        ranges_n1, ranges_n8,
        "-n changes the placement on an aged file system"
    );
    // Aging refuses what it cannot do, by name.
    let bad = AgingParams {
        fill: 0.95,
        ..AgingParams::default()
    };
    let error = n1.age(&bad, seed).unwrap_err().to_string();
    assert!(error.contains("age 0.95"), "{error}");
    let error = "age=x".parse::<NewfsParams>().unwrap_err().to_string();
    assert!(error.contains("age = `x`"), "{error}");
    let parsed: NewfsParams = "age=0.5,churn=1".parse().unwrap();
    assert_eq!(
        parsed.aging,
        Some(AgingParams {
            fill: 0.5,
            churn: 1.0,
            ..AgingParams::default()
        })
    );
}

#[test]
fn a_taken_request_goes_to_the_nearest_rotational_position_with_n_above_1() {
    // Goal: ffs_alloccgblk's rotational search — with -n 8 a taken requested block is
    // replaced by the first free block of the same cylinder at the requested rotational
    // position (or the next one around), with -n 1 by the next free block after it.
    // Method: on a fresh RZ28 file system a file's first request is the group's second
    // block, which is metadata (taken); place one block-sized file with -n 1 and with -n 8
    // and compare where each went, computing rotational positions from the label's track.
    let geometry = rz28_geometry();
    let with = |positions: u32| {
        let params = NewfsParams {
            rotational_positions: positions,
            ..NewfsParams::default()
        };
        let mut ffs = Ffs::new(params, geometry).unwrap();
        ffs.create_file(0, 8192).unwrap().map.device_ranges(0, 1)[0].0
    };
    let block = 8192u64;
    let sectors_per_track = geometry.track_bytes / 512;
    let position = |offset: u64| (offset / 512 % sectors_per_track) * 8 / sectors_per_track;
    let first_free = with(1);
    let rotational = with(8);
    // The requested block (the group's second) is at rotational position 1.
    let wanted = position(block);
    assert_eq!(wanted, 1);
    assert_eq!(position(rotational), wanted, "-n 8 took {rotational}");
    assert!(rotational / geometry.cylinder_bytes == 0, "same cylinder");
    // It is the first free block at that position: every block from the first free one up
    // to it lies at another position.
    assert!(rotational > first_free, "{rotational} <= {first_free}");
    for offset in (first_free..rotational).step_by(block as usize) {
        assert_ne!(
            position(offset),
            wanted,
            "block at {offset} was free at the position"
        );
    }
}
