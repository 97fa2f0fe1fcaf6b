//! Runs one workload on one disk: `cargo run --release --example run -- DISK WORKLOAD [json]`,
//! e.g. `-- rz25 dd:write,bs=1M,count=86`.

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let disk: bufcache_sim::DiskSpec = args
        .first()
        .map_or("rz25", |s| s.as_str())
        .parse()
        .unwrap_or_else(|e| {
            eprintln!("error: {e}");
            std::process::exit(2)
        });
    let workload: bufcache_sim::WorkloadSpec = args
        .get(1)
        .map_or("dd:write,bs=1M,count=86", |s| s.as_str())
        .parse()
        .unwrap_or_else(|e| {
            eprintln!("error: {e}");
            std::process::exit(2)
        });
    let config = bufcache::CacheConfig {
        memory_bytes_max: std::env::var("SIM_MEMORY")
            .ok()
            .map_or(8 << 20, |m| bufcache::parse_size(&m).expect("SIM_MEMORY")),
        noreuse_sequential: std::env::var("SIM_NOREUSE").map_or(true, |v| v != "0"),
        ..Default::default()
    };
    match bufcache_sim::run_custom(&disk, &workload, config) {
        Ok(run) if args.get(2).is_some_and(|a| a == "json") => println!("{}", run.to_json()),
        Ok(run) => print!("{}", run.to_text()),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1)
        }
    }
}
