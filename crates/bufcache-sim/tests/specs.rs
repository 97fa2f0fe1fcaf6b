//! Goal: disk, host and workload descriptions parse, round-trip, and refuse bad values with
//! an error naming the field.
//! Method: parse good and bad strings and inspect the values and error fields.

use bufcache_sim::{DiskKind, DiskSpec, HostCosts, WorkloadSpec};

#[test]
fn good_specs_parse_and_round_trip() {
    for name in bufcache_sim::DISK_PRESETS {
        let spec: DiskSpec = name.parse().unwrap();
        assert!(spec.capacity_bytes() > 1 << 20);
    }
    let spec: DiskSpec = "rz25:segment=0,overhead_ms=2".parse().unwrap();
    let DiskKind::Hdd(p) = spec.kind else {
        panic!()
    };
    assert_eq!((p.segment_bytes, p.overhead_ms), (0, 2.0));
    let spec: DiskSpec = "wan:rtt_ms=80,inflight=4".parse().unwrap();
    let DiskKind::Network(p) = spec.kind else {
        panic!()
    };
    assert_eq!((p.read_latency_us, p.channels), (80_000.0, 4));
    for text in [
        "dd:write,bs=1MiB,count=86",
        "dd:read,bs=64KiB,count=10,fsync",
        "sweep:file=64MiB,sizes=16MiB/32MiB,bs=1MiB,passes=2",
        "mixed:scan=64MiB,ws=8MiB,reads=100,think_us=10,bs=64KiB",
        "treecopy:files=10,min=1KiB,max=4KiB,remote=on,dir_files=8",
        "build:jobs=2,sources=10,headers=5,includes=3,cpu_ms=1,header_max=8KiB",
        "build:jobs=1,sources=10,headers=5,includes=3,cpu_ms=1,header_max=8KiB,builds=2",
    ] {
        let spec: WorkloadSpec = text.parse().unwrap();
        assert_eq!(spec.to_string(), text);
        assert_eq!(spec.to_string().parse::<WorkloadSpec>().unwrap(), spec);
    }
    let host: HostCosts = "modern:cpus=2,io_ns=1000".parse().unwrap();
    assert_eq!((host.cpus, host.io_ns), (2, 1000));
}

#[test]
fn bad_specs_name_the_field() {
    let field = |r: Result<(), bufcache_sim::SpecError>| r.unwrap_err().field;
    assert_eq!(field("floppy".parse::<DiskSpec>().map(|_| ())), "disk");
    assert_eq!(
        field("rz25:rpm=fast".parse::<DiskSpec>().map(|_| ())),
        "rpm"
    );
    assert_eq!(
        field("nvme:rpm=5400".parse::<DiskSpec>().map(|_| ())),
        "rpm"
    );
    assert_eq!(
        field("rz25:seek_avg_ms=99".parse::<DiskSpec>().map(|_| ())),
        "seek_avg_ms"
    );
    assert_eq!(
        field("dd:write,bs=1X".parse::<WorkloadSpec>().map(|_| ())),
        "bs"
    );
    assert_eq!(
        field("dd:write,count=0".parse::<WorkloadSpec>().map(|_| ())),
        "count"
    );
    assert_eq!(
        field("build:builds=0".parse::<WorkloadSpec>().map(|_| ())),
        "builds"
    );
    assert_eq!(
        field("dd:colour=red".parse::<WorkloadSpec>().map(|_| ())),
        "colour"
    );
    assert_eq!(field("fio".parse::<WorkloadSpec>().map(|_| ())), "workload");
    assert_eq!(
        field(
            "sweep:file=8M,sizes=16M"
                .parse::<WorkloadSpec>()
                .map(|_| ())
        ),
        "sizes"
    );
    assert_eq!(
        field("modern:cpus=0".parse::<HostCosts>().map(|_| ())),
        "cpus"
    );
    let message = "dd:write,bs=1X"
        .parse::<WorkloadSpec>()
        .unwrap_err()
        .to_string();
    assert!(
        message.contains("bs") && message.contains("1X"),
        "{message}"
    );
}

#[test]
fn unknown_experiment_is_refused_with_the_list() {
    let error = bufcache_sim::run_experiment("nope", &Default::default()).unwrap_err();
    assert!(error.to_string().contains("maxbsize"), "{error}");
}

#[test]
fn builds_at_once_are_separate_trees_sharing_the_disk() {
    // Goal: `builds=2` runs two independent builds at once (seed 001's `make build` beside a
    // kernel build): twice the compile processes, each build reading its own tree.
    // Method: run one build and two builds of the same shape on the same disk and compare the
    // processes and the bytes read.
    let disk: DiskSpec = "fireball-tm".parse().unwrap();
    let run = |text: &str| {
        let workload: WorkloadSpec = text.parse().unwrap();
        bufcache_sim::run_custom(&disk, &workload, bufcache::CacheConfig::default())
            .unwrap()
            .report
    };
    let one = run("build:jobs=2,sources=8,headers=6,includes=2,cpu_ms=1");
    let two = run("build:jobs=2,sources=8,headers=6,includes=2,cpu_ms=1,builds=2");
    let compilers = |r: &bufcache_sim::RunReport| {
        r.processes
            .iter()
            .filter(|p| p.name.contains("cc-"))
            .count()
    };
    assert_eq!((compilers(&one), compilers(&two)), (2, 4));
    // The second tree's files are its own, so its first reads miss: more device reads.
    assert!(
        two.device.reads > one.device.reads,
        "two builds read {} times, one build {}",
        two.device.reads,
        one.device.reads
    );
}
