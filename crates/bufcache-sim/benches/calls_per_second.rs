//! Simulated calls per second: `dd:read,bs=4k` on the nvme preset at two sizes, the larger
//! one filling and cycling the cache many times. Cost per call must not grow with the cache's
//! contents, so both figures should be about the same (the target: ≥ 1 million/s).
//! Run with `cargo bench -p bufcache-sim --bench calls_per_second`. Time is this thread's CPU
//! time where Linux reports it (`/proc/thread-self/schedstat`), so that a busy machine does not
//! skew the figure; wall-clock time elsewhere.

use std::time::Instant;

use bufcache_sim::{run_custom, DiskSpec, WorkloadSpec};

/// Nanoseconds this thread has run on a CPU, if the kernel says.
fn cpu_ns() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    text.split_whitespace().next()?.parse().ok()
}

fn main() {
    let disk: DiskSpec = "nvme".parse().expect("nvme preset");
    for count in [65_536u64, 262_144, 1_048_576] {
        let workload: WorkloadSpec = format!("dd:read,bs=4k,count={count}")
            .parse()
            .expect("workload");
        let started = Instant::now();
        let cpu_before = cpu_ns();
        let run = run_custom(&disk, &workload, bufcache::CacheConfig::default()).expect("run");
        let (seconds, kind) = match (cpu_before, cpu_ns()) {
            (Some(before), Some(after)) => ((after - before) as f64 / 1e9, "CPU"),
            _ => (started.elapsed().as_secs_f64(), "wall"),
        };
        println!(
            "dd:read bs=4k count={count:>8}: {:>6.3} s {kind}, {:>9.0} simulated calls/s, hit ratio {:.4}",
            seconds,
            count as f64 / seconds,
            run.report.cache.hit_ratio
        );
    }
}
