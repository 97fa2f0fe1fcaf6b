//! Goal: `sim run`'s "busy X s of Y s" never says a disk was busy longer than it ran: busy
//! time is the union of the disk's service intervals, and it is set against the time the
//! disk's last request completed, which a write-behind workload reaches long after its
//! processes finished (the README's `dd:write` on rz25 once printed "busy 17.921 s of
//! 7.177 s", the second figure being when the processes finished).
//! Method: run that workload and a build whose processes overlap their requests, and check
//! busy <= last completion, and that the write-behind run's disk did finish after its
//! processes (so comparing busy time with the processes' time was the error).

use bufcache_sim::{run_custom, DiskSpec, WorkloadSpec};

#[test]
fn busy_time_fits_in_the_time_until_the_last_request_completed() {
    let disk: DiskSpec = "rz25".parse().unwrap();
    let cases = [
        (
            "dd:write,bs=1M,count=86",
            bufcache::CacheConfig {
                cluster_bytes_max: 16 << 10,
                ..Default::default()
            },
        ),
        (
            "build:jobs=3,sources=30,headers=40,includes=5,cpu_ms=2",
            bufcache::CacheConfig {
                memory_bytes_max: 1 << 20,
                ..Default::default()
            },
        ),
    ];
    let mut write_behind_tail_ns = 0;
    for (workload, config) in cases {
        let workload_spec: WorkloadSpec = workload.parse().unwrap();
        let report = run_custom(&disk, &workload_spec, config).unwrap().report;
        let device = &report.device;
        assert!(device.busy_ns > 0, "{workload}: the disk did nothing");
        assert!(
            device.busy_ns <= device.last_done_ns,
            "{workload}: busy {} ns of {} ns",
            device.busy_ns,
            device.last_done_ns
        );
        if workload.starts_with("dd:write") {
            let elapsed_ns = (report.elapsed_s * 1e9) as u64;
            write_behind_tail_ns = device.last_done_ns.saturating_sub(elapsed_ns);
            assert!(
                device.busy_ns > elapsed_ns,
                "{workload}: the disk worked {} ns, no longer than the processes' {elapsed_ns} ns",
                device.busy_ns
            );
        }
    }
    assert!(
        write_behind_tail_ns > 0,
        "dd:write's disk finished with its processes"
    );
}
