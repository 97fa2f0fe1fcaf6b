//! Prints the miss-ratio tables of docs/policies.md for every policy: scan + working set, Zipf and
//! loop workloads, and (with `--trace FILE`) a real block trace in the CloudPhysics CSV format
//! (`version,time,op,size,lbn`; one object per request, keyed by lbn, as libCacheSim's
//! `--ignore-obj-size` does) with a cache of 10% of its distinct blocks. `--dump DIR` also
//! writes each trace (one key per line) and `manifest.txt` (name and capacity per line) so
//! that `scripts/libcachesim_compare.py` can replay the same requests through libCacheSim.
//!
//! Run: `cargo run --release -p bufcache-policy --example miss_table --
//!       [--trace ../../shared/traces/cloudPhysicsIO.csv] [--dump DIR]`

#[path = "../tests/common/mod.rs"]
mod common;

use std::io::Write;

use bufcache_policy::{Placement, PolicyKind};
use common::{loop_trace, miss_ratio, run_scan, scan_with_working_set, zipf_trace};

const CAPACITY_OBJECTS: usize = 1_000;

fn option<'a>(arguments: &'a [String], name: &str) -> Option<&'a String> {
    let index = arguments.iter().position(|argument| argument == name)?;
    arguments.get(index + 1)
}

/// The lbn column of a CloudPhysics CSV trace.
fn read_block_trace(path: &str) -> std::io::Result<Vec<u64>> {
    let text = std::fs::read_to_string(path)?;
    Ok(text
        .lines()
        .skip(1)
        .filter_map(|line| line.rsplit(',').next()?.trim().parse().ok())
        .collect())
}

fn distinct_keys(trace: &[u64]) -> usize {
    trace.iter().collect::<std::collections::HashSet<_>>().len()
}

struct Workload {
    name: String,
    trace: Vec<u64>,
    capacity_objects: usize,
}

fn workloads(block_trace: Option<Vec<u64>>, scan: &[u64]) -> Vec<Workload> {
    let workload = |name: &str, trace: Vec<u64>| Workload {
        name: name.into(),
        trace,
        capacity_objects: CAPACITY_OBJECTS,
    };
    let mut workloads = vec![
        workload("scan", scan.to_vec()),
        workload("zipf0.8", zipf_trace(10_000, 0.8, 200_000, 8)),
        workload("zipf0.9", zipf_trace(10_000, 0.9, 200_000, 9)),
        workload("zipf1.0", zipf_trace(10_000, 1.0, 200_000, 10)),
        workload("loop1.1", loop_trace(1_100, 20)),
        workload("loop1.5", loop_trace(1_500, 20)),
        workload("loop3", loop_trace(3_000, 10)),
    ];
    if let Some(trace) = block_trace {
        let capacity_objects = (distinct_keys(&trace) / 10).max(1);
        workloads.push(Workload {
            name: "cloudphysics".into(),
            trace,
            capacity_objects,
        });
    }
    workloads
}

fn dump(directory: &str, workloads: &[Workload]) -> std::io::Result<()> {
    let mut manifest = std::fs::File::create(format!("{directory}/manifest.txt"))?;
    for workload in workloads {
        writeln!(manifest, "{} {}", workload.name, workload.capacity_objects)?;
        let path = format!("{directory}/{}.txt", workload.name);
        let mut file = std::io::BufWriter::new(std::fs::File::create(path)?);
        for key in &workload.trace {
            writeln!(file, "{key}")?;
        }
    }
    Ok(())
}

fn main() -> std::io::Result<()> {
    let arguments: Vec<String> = std::env::args().collect();
    let block_trace = option(&arguments, "--trace")
        .map(|path| read_block_trace(path))
        .transpose()?;
    let working_set_keys = CAPACITY_OBJECTS as u64 / 4;
    let scan = scan_with_working_set(working_set_keys, 2, 10 * CAPACITY_OBJECTS as u64, 4);
    let warm_requests = 2 * working_set_keys as usize;
    let scan_keys: Vec<u64> = scan.iter().map(|request| request.key).collect();
    let workloads = workloads(block_trace, &scan_keys);
    if let Some(directory) = option(&arguments, "--dump") {
        dump(directory, &workloads)?;
    }

    print!("| policy | scan: working-set hits | scan: working-set hits, scan noreuse |");
    for workload in &workloads {
        print!(
            " {} (c={}) miss |",
            workload.name, workload.capacity_objects
        );
    }
    println!();
    for &kind in PolicyKind::ALL {
        let normal = run_scan(
            kind,
            CAPACITY_OBJECTS,
            warm_requests,
            &scan,
            Placement::Normal,
        );
        let no_reuse = run_scan(
            kind,
            CAPACITY_OBJECTS,
            warm_requests,
            &scan,
            Placement::NoReuse,
        );
        print!(
            "| {kind} | {:.3} | {:.3} |",
            normal.working_set_hit_ratio, no_reuse.working_set_hit_ratio
        );
        for workload in &workloads {
            let ratio = miss_ratio(kind, workload.capacity_objects, &workload.trace);
            print!(" {ratio:.4} |");
        }
        println!();
    }
    Ok(())
}
