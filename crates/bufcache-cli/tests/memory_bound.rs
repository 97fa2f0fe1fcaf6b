//! Goal: the server's resident memory stays within `--cache-size` plus a documented overhead
//! under sustained load from many connections, and one connection cannot pile up more than
//! `inflight_bytes_max` of requests. Method: `bufcache serve` over a sparse 1 GiB file (the
//! backend lives in the host page cache, not in our RSS); 16 NbdClient connections × 2
//! threads issue seeded random 64 KiB–1 MiB reads and writes for ~15 s while a sampler reads
//! VmRSS from /proc/PID/status every 20 ms; the kernel's own peak (VmHWM) is asserted against
//! cache + overhead (see docs/reliability.md for the bound and the measurements).
//! A second test floods one connection (96 threads × 1 MiB writes) in front of a slow
//! (nbdkit delay filter) upstream and checks the peak stays below what 96 MiB queued would
//! cost. A third measures many busy connections (16 and 64, each writing 32 MiB requests)
//! against the server-wide in-flight budget (`--inflight-bytes-max`, default the cache size):
//! the peak must stay within cache + budget + 64 MiB. Seeds: MEMORY_BOUND_SEED.

mod reliability_support;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bufcache_nbd::NbdClient;
use reliability_support::*;

const MIB: u64 = 1 << 20;

/// Samples VmRSS of `pid` every 20 ms until `stop`; returns (peak sampled, samples).
fn start_sampler(pid: u32, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<(u64, u64)> {
    std::thread::spawn(move || {
        let mut peak = 0;
        let mut samples = 0;
        while !stop.load(Ordering::Acquire) {
            if let Some(rss) = rss_bytes(pid) {
                peak = peak.max(rss);
                samples += 1;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        (peak, samples)
    })
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / MIB as f64
}

/// What one sustained-load run measured.
struct Measured {
    seed: u64,
    cache_bytes: u64,
    inflight_bytes: u64,
    peak_bytes: u64,
}

/// 16 connections × 2 threads of random 64 KiB–1 MiB reads and writes for ~15 s
/// (MEMORY_BOUND_SECONDS) against a `--cache-size` of MEMORY_BOUND_CACHE_MIB (64) MiB.
fn sustained_load() -> Measured {
    let cache_mib: u64 = std::env::var("MEMORY_BOUND_CACHE_MIB")
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or(64);
    let cache_arg = format!("{cache_mib}M");
    let cache_bytes = cache_mib * MIB;
    const CONNECTIONS: usize = 16;
    const THREADS: usize = 2;
    const REQUEST_MAX: u64 = MIB;
    let seed = seed_from_env("MEMORY_BOUND_SEED", 1);
    let duration = Duration::from_secs(
        std::env::var("MEMORY_BOUND_SECONDS")
            .ok()
            .and_then(|text| text.parse().ok())
            .unwrap_or(15),
    );
    let dir = temp_dir();
    let mut server = Server::start(
        dir.path(),
        "bufcache",
        &[
            "--backend",
            "sparse.img",
            "--create-size",
            "1G",
            "--cache-size",
            &cache_arg,
            "--request-size-max",
            "1M",
            "--dirty-age-max",
            "1",
            "--metrics",
            "127.0.0.1:0",
        ],
    );
    let pid = server.pid();
    let clients: Vec<Arc<NbdClient>> = (0..CONNECTIONS)
        .map(|_| Arc::new(NbdClient::connect(&server.uri()).expect("connecting")))
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let idle = rss_bytes(pid).expect("server RSS");
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = start_sampler(pid, Arc::clone(&stop));
    let size = clients[0].size();
    let bytes_moved = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + duration;
    let mut workers = Vec::new();
    for (connection, shared_client) in clients.iter().enumerate().take(CONNECTIONS) {
        for thread in 0..THREADS {
            let client = Arc::clone(shared_client);
            let moved = Arc::clone(&bytes_moved);
            workers.push(std::thread::spawn(move || {
                let mut rng = Rng::new(seed * 1000 + (connection * THREADS + thread) as u64);
                let mut buffer = vec![0u8; REQUEST_MAX as usize];
                rng.fill(&mut buffer);
                while Instant::now() < deadline {
                    let length = rng.range(16, REQUEST_MAX / 4096) * 4096;
                    let offset = rng.below((size - length) / 4096) * 4096;
                    let part = &mut buffer[..length as usize];
                    if rng.chance(50) {
                        client.write(offset, part).expect("write");
                    } else {
                        client.read(offset, part).expect("read");
                    }
                    moved.fetch_add(length, Ordering::Relaxed);
                }
            }));
        }
    }
    for worker in workers {
        worker.join().expect("load thread panicked");
    }
    stop.store(true, Ordering::Release);
    let (sampled_peak, samples) = sampler.join().unwrap();
    let kernel_peak = rss_peak_bytes(pid).expect("server VmHWM");
    let threads = thread_count(pid).unwrap_or(0);
    let stats = server.stats_or_null();
    let inflight = (CONNECTIONS * THREADS) as u64 * REQUEST_MAX;
    eprintln!(
        "seed {seed}: {:.0} MiB moved in {:.0} s by {CONNECTIONS}×{THREADS} threads; idle RSS \
         {:.1} MiB; peak RSS sampled {:.1} MiB ({samples} samples), VmHWM {:.1} MiB; cache \
         {:.0} MiB; overhead over cache {:.1} MiB; client bytes in flight at most {:.0} MiB; \
         server threads {threads}; cache stats {stats}",
        mib(bytes_moved.load(Ordering::Relaxed)),
        duration.as_secs_f64(),
        mib(idle),
        mib(sampled_peak),
        mib(kernel_peak),
        mib(cache_bytes),
        mib(kernel_peak.saturating_sub(cache_bytes)),
        mib(inflight),
    );
    drop(clients);
    server.stop_clean(Duration::from_secs(60));
    Measured {
        seed,
        cache_bytes,
        inflight_bytes: inflight,
        peak_bytes: kernel_peak,
    }
}

fn check_bound(measured: &Measured, bound: u64, what: &str) {
    eprintln!(
        "seed {}: VmHWM {:.1} MiB, {what} bound {:.0} MiB",
        measured.seed,
        mib(measured.peak_bytes),
        mib(bound)
    );
    assert!(
        measured.peak_bytes <= bound,
        "seed {}: peak RSS {:.1} MiB exceeds the {what} bound {:.0} MiB (cache {:.0} MiB, \
         client bytes in flight {:.0} MiB)",
        measured.seed,
        mib(measured.peak_bytes),
        mib(bound),
        mib(measured.cache_bytes),
        mib(measured.inflight_bytes)
    );
}

/// The bound the design intends: cache + 32 MiB base (binary, thread stacks, tables) +
/// twice the bytes clients can have in flight (request payload, and reply buffer or engine
/// copy) + 32 MiB allocator slack. At 64 MiB cache and 32 × 1 MiB in flight: 192 MiB.
#[test]
fn rss_stays_within_cache_plus_design_overhead_under_sustained_load() {
    let _timer = Timer::new("rss_stays_within_cache_plus_design_overhead_under_sustained_load");
    let measured = sustained_load();
    let bound = measured.cache_bytes + 32 * MIB + 2 * measured.inflight_bytes + 32 * MIB;
    check_bound(&measured, bound, "design");
}

/// 256 writers offer 256 MiB at once on one connection in front of an upstream that
/// accepts one 1 MiB write per 100 ms; the server may hold at most inflight_bytes_max (64 MiB)
/// of them, so its peak stays far below what queueing all of them would cost.
#[test]
fn one_connection_cannot_queue_more_than_its_inflight_limit() {
    let _timer = Timer::new("one_connection_cannot_queue_more_than_its_inflight_limit");
    if !have_nbdkit("inflight_limit", "memory", &["delay"]) {
        return;
    }
    const CACHE: u64 = 16 * MIB;
    const THREADS: usize = 256;
    let dir = temp_dir();
    // A slow upstream: every write takes 20 ms, so write-back is the bottleneck, writers are
    // throttled at the dirty limit and requests queue in the server.
    let upstream = Nbdkit::start(
        dir.path(),
        "upstream",
        &[
            "--filter=delay".into(),
            "memory".into(),
            "1G".into(),
            "wdelay=50ms".into(),
        ],
    );
    let backend = upstream.uri();
    let mut server = Server::start(
        dir.path(),
        "bufcache",
        &[
            "--backend",
            &backend,
            "--cache-size",
            "16M",
            "--request-size-max",
            "1M",
            "--io-queue-depth",
            "1",
        ],
    );
    let pid = server.pid();
    let client = Arc::new(NbdClient::connect(&server.uri()).expect("connecting"));
    std::thread::sleep(Duration::from_millis(200));
    let idle = rss_bytes(pid).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = start_sampler(pid, Arc::clone(&stop));
    let deadline = Instant::now() + Duration::from_secs(3);
    let written = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    for thread in 0..THREADS {
        let client = Arc::clone(&client);
        let written = Arc::clone(&written);
        workers.push(std::thread::spawn(move || {
            let data = random_bytes(MIB as usize, thread as u64);
            let mut index = 0u64;
            while Instant::now() < deadline {
                let offset = ((thread as u64 * 7919 + index * 104_729) % 1000) * MIB;
                client.write(offset, &data).expect("write");
                written.fetch_add(MIB, Ordering::Relaxed);
                index += 1;
            }
        }));
    }
    for worker in workers {
        worker.join().unwrap();
    }
    eprintln!(
        "writers done {:.1} s after the deadline",
        deadline.elapsed().as_secs_f64()
    );
    stop.store(true, Ordering::Release);
    let (sampled_peak, _) = sampler.join().unwrap();
    let kernel_peak = rss_peak_bytes(pid).unwrap();
    // inflight_bytes_max is 64 MiB by default; 256 MiB were offered. Bound: the measured
    // cache cost (3 × cache, see the sustained-load test) + 2 × inflight_bytes_max + 32 MiB.
    let inflight_max = 64 * MIB;
    let bound = 3 * CACHE + 2 * inflight_max + 32 * MIB;
    eprintln!(
        "{THREADS} writers × 1 MiB on one connection: {:.0} MiB written; idle RSS {:.1} MiB; \
         peak sampled {:.1} MiB; VmHWM {:.1} MiB; bound {:.0} MiB",
        mib(written.load(Ordering::Relaxed)),
        mib(idle),
        mib(sampled_peak),
        mib(kernel_peak),
        mib(bound)
    );
    assert!(
        kernel_peak <= bound,
        "peak RSS {:.1} MiB above {:.0} MiB: one connection queued more than inflight_bytes_max",
        mib(kernel_peak),
        mib(bound)
    );
    drop(client);
    let stopping = Instant::now();
    server.stop_clean(Duration::from_secs(120));
    eprintln!("shutdown took {:.1} s", stopping.elapsed().as_secs_f64());
}

/// Runs `connections` connections, each one thread writing 32 MiB requests for ~3 s, against
/// `--cache-size 64M` with the default request size (32 MiB) and the default in-flight
/// budget (the cache size, 64 MiB). Returns the server's peak RSS (VmHWM).
fn many_busy_connections(connections: usize) -> u64 {
    const REQUEST: u64 = 32 * MIB;
    let dir = temp_dir();
    let mut server = Server::start(
        dir.path(),
        "bufcache",
        &[
            "--backend",
            "sparse.img",
            "--create-size",
            "2G",
            "--cache-size",
            "64M",
        ],
    );
    let pid = server.pid();
    let clients: Vec<Arc<NbdClient>> = (0..connections)
        .map(|_| Arc::new(NbdClient::connect(&server.uri()).expect("connecting")))
        .collect();
    let size = clients[0].size();
    // One buffer shared by every writer: the test process must not need 64 × 32 MiB itself.
    let data = Arc::new(random_bytes(REQUEST as usize, 7));
    let written = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs(3);
    let workers: Vec<_> = clients
        .iter()
        .enumerate()
        .map(|(index, client)| {
            let client = Arc::clone(client);
            let data = Arc::clone(&data);
            let written = Arc::clone(&written);
            std::thread::spawn(move || {
                let slots = size / REQUEST;
                let mut slot = index as u64;
                // Every connection sends at least one request, so all of them are busy at once.
                loop {
                    client
                        .write((slot % slots) * REQUEST, &data)
                        .expect("write");
                    written.fetch_add(REQUEST, Ordering::Relaxed);
                    slot += 7;
                    if Instant::now() >= deadline {
                        break;
                    }
                }
            })
        })
        .collect();
    for worker in workers {
        worker.join().expect("writer panicked");
    }
    let peak = rss_peak_bytes(pid).expect("server VmHWM");
    eprintln!(
        "{connections} connections × 32 MiB writes: {:.0} MiB written; VmHWM {:.1} MiB \
         (cache 64 MiB, in-flight budget 64 MiB)",
        mib(written.load(Ordering::Relaxed)),
        mib(peak)
    );
    drop(clients);
    server.stop_clean(Duration::from_secs(120));
    peak
}

/// The memory target: 16 and then 64 connections each writing 32 MiB requests with
/// `--cache-size 64M` keep the peak RSS under cache (64 MiB) + in-flight budget (64 MiB,
/// the default) + 64 MiB, where before the server-wide budget 16 reached 1.1 GiB and 64
/// reached 4.2 GiB.
#[test]
fn many_busy_connections_share_one_inflight_budget() {
    let _timer = Timer::new("many_busy_connections_share_one_inflight_budget");
    let bound = 64 * MIB + 64 * MIB + 64 * MIB;
    for connections in [16, 64] {
        let peak = many_busy_connections(connections);
        assert!(
            peak <= bound,
            "{connections} connections: peak RSS {:.1} MiB above the {:.0} MiB bound \
             (cache + in-flight budget + 64 MiB)",
            mib(peak),
            mib(bound)
        );
    }
}

/// `serve` with `prefault` (the prefault flags, if any) over a 32 MiB export: how much it faulted in
/// before any request (waiting up to 10 s for a background prefault to end), the server's
/// resident memory then, the cache's stats after writing and reading back the whole export,
/// and the server's log.
fn prefaulted_server(cache: &str, prefault: &[&str]) -> (u64, u64, serde_json::Value, String) {
    let dir = temp_dir();
    let mut extra = vec!["--metrics", "127.0.0.1:0"];
    extra.extend_from_slice(prefault);
    let mut server = server_over_export(dir.path(), "32M", cache, &extra);
    let expect_prefault = !prefault
        .iter()
        .any(|flag| *flag == "--no-prefault" || *flag == "--prefault=off");
    let deadline = Instant::now() + Duration::from_secs(10);
    while expect_prefault && !server.log_text().contains("prefaulted") && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(10));
    }
    let prefaulted = server.stats()["cache"]["memory_prefaulted_bytes"]
        .as_u64()
        .expect("memory_prefaulted_bytes in /stats");
    let idle_rss = rss_bytes(server.pid()).expect("server RSS");
    let client = NbdClient::connect(&server.uri()).expect("connecting");
    let data = random_bytes(32 * MIB as usize, 7);
    for (index, piece) in data.chunks(MIB as usize).enumerate() {
        client.write(index as u64 * MIB, piece).expect("write");
    }
    let mut back = vec![0u8; data.len()];
    for (index, piece) in back.chunks_mut(MIB as usize).enumerate() {
        client.read(index as u64 * MIB, piece).expect("read");
    }
    assert!(back == data, "the export reads back what was written");
    let stats = server.stats()["cache"].clone();
    drop(client);
    server.stop_clean(Duration::from_secs(60));
    (prefaulted, idle_rss, stats, server.log_text())
}

/// `serve` over a new sparse file of `export_size` behind a cache of `cache`, with `extra`
/// flags.
fn server_over_export(
    dir: &std::path::Path,
    export_size: &str,
    cache: &str,
    extra: &[&str],
) -> Server {
    let mut args = vec![
        "--backend",
        "export.img",
        "--create-size",
        export_size,
        "--cache-size",
        cache,
    ];
    args.extend_from_slice(extra);
    Server::start(dir, "bufcache", &args)
}

/// Asserts the server's log says `first` before `second`.
fn assert_said_in_order(log: &str, first: &str, second: &str) {
    let at = |text: &str| {
        log.find(text)
            .unwrap_or_else(|| panic!("the server never said {text:?}:\n{log}"))
    };
    assert!(at(first) < at(second), "{first:?} after {second:?}:\n{log}");
}

/// Checks what `prefaulted_server` measured for `cache` against `bound`, the smaller of the
/// cache and the export.
fn check_prefaulted(
    cache: &str,
    bound: u64,
    (prefaulted, idle_rss, stats, log): (u64, u64, serde_json::Value, String),
) {
    eprintln!(
        "cache {cache}: prefaulted {:.0} MiB, idle RSS {:.1} MiB; after the fill {stats}",
        mib(prefaulted),
        mib(idle_rss)
    );
    assert_eq!(prefaulted, bound, "cache {cache}: prefaulted bytes\n{log}");
    assert!(
        idle_rss >= bound,
        "cache {cache}: {:.1} MiB resident before any request, below the {:.0} MiB prefaulted",
        mib(idle_rss),
        mib(bound)
    );
    assert_eq!(
        stats["memory_prefaulted_bytes"], 0,
        "cache {cache}: the fill took every prefaulted chunk"
    );
    let used = stats["memory_used_bytes"].as_u64().unwrap();
    assert!(
        used <= bound,
        "cache {cache}: {used} bytes used, over the {bound} bound"
    );
}

#[test]
fn prefault_makes_memory_resident_before_serving_within_the_smaller_of_cache_and_exports() {
    // Goal: --prefault faults buffer memory in before the server accepts a client, never more
    // than the cache size or the exports' total size (the cache cannot use more), and the
    // cache then fills from that memory instead of mapping more. Method: a 32 MiB export
    // behind a 64 MiB cache (bound: the export) and behind a 16 MiB cache (bound: the cache);
    // read /stats and VmRSS before any request, then write and read back the whole export
    // and check that every prefaulted chunk was used and the peak stayed within the bound.
    for (cache, bound) in [("64M", 32 * MIB), ("16M", 16 * MIB)] {
        let measured = prefaulted_server(cache, &["--prefault"]);
        assert_said_in_order(&measured.3, "before serving", "listening on");
        check_prefaulted(cache, bound, measured);
    }
}

#[test]
fn by_default_memory_is_prefaulted_before_serving_up_to_a_gib() {
    // Goal: with no prefault flag (auto), an export smaller than a GiB has its memory faulted
    // in before the server listens, within the same bound as --prefault. Method: a 32 MiB
    // export behind a 64 MiB cache; the server says it prefaulted before it says it listens;
    // then as the --prefault test.
    let measured = prefaulted_server("64M", &[]);
    assert_said_in_order(&measured.3, "before serving", "listening on");
    check_prefaulted("64M", 32 * MIB, measured);
}

#[test]
fn by_default_a_cache_over_a_gib_is_prefaulted_a_gib_before_serving_and_the_rest_after() {
    // Goal: auto bounds the start's delay: one GiB is faulted in before the server listens,
    // the rest on background threads after. Method: a 1088 MiB sparse export behind a cache
    // as large; the log says 1GiB before serving, then that it listens, then 64MiB in the
    // background; /stats then shows all 1088 MiB prefaulted. Skipped on a machine with less
    // than 2 GiB available, where the server would (rightly) prefault less.
    let available = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|line| line.strip_prefix("MemAvailable:"))
                .and_then(|rest| {
                    rest.trim()
                        .trim_end_matches("kB")
                        .trim()
                        .parse::<u64>()
                        .ok()
                })
        })
        .map_or(0, |kib| kib * 1024);
    if available < 2 << 30 {
        eprintln!("skipped: {:.0} MiB available", mib(available));
        return;
    }
    let dir = temp_dir();
    let mut server =
        server_over_export(dir.path(), "1088M", "1088M", &["--metrics", "127.0.0.1:0"]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !server.log_text().contains("in the background") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let log = server.log_text();
    let before = log
        .find("prefaulted 1GiB of buffer memory")
        .unwrap_or_else(|| panic!("a GiB before serving:\n{log}"));
    let listening = log.find("listening on").expect("the server listens");
    let after = log
        .find("prefaulted 64MiB of buffer memory")
        .unwrap_or_else(|| panic!("the rest in the background:\n{log}"));
    assert!(before < listening && listening < after, "{log}");
    assert!(log[before..listening].contains("before serving"), "{log}");
    assert!(log[after..].contains("in the background"), "{log}");
    assert_eq!(
        server.stats()["cache"]["memory_prefaulted_bytes"],
        1088 * MIB,
        "all of it prefaulted"
    );
    server.stop_clean(Duration::from_secs(60));
}

#[test]
fn a_background_prefault_faults_the_same_memory_in_while_serving() {
    // Goal: --prefault=background listens at once and faults the same memory in on
    // background threads, never more than the smaller of the cache and the exports, and the
    // fill then uses it. Method: as the --prefault test, waiting for the server to say it
    // finished, and checking it listened first.
    for (cache, bound) in [("64M", 32 * MIB), ("16M", 16 * MIB)] {
        let measured = prefaulted_server(cache, &["--prefault=background"]);
        assert_said_in_order(&measured.3, "listening on", "in the background");
        check_prefaulted(cache, bound, measured);
    }
}

#[test]
fn no_prefault_leaves_memory_to_be_faulted_in_as_data_arrives() {
    // Goal: --no-prefault and --prefault=off fault nothing in ahead of need. Method: a 32 MiB
    // export behind a 64 MiB cache; after the fill, nothing was ever prefaulted and the log
    // says nothing of it; the idle RSS before the fill is far below the export.
    for flag in ["--no-prefault", "--prefault=off"] {
        let (prefaulted, idle_rss, stats, log) = prefaulted_server("64M", &[flag]);
        eprintln!(
            "{flag}: idle RSS {:.1} MiB; after the fill {stats}",
            mib(idle_rss)
        );
        assert_eq!(prefaulted, 0, "{flag}: prefaulted bytes");
        assert!(
            !log.contains("prefaulted"),
            "{flag}: nothing prefaulted:\n{log}"
        );
        assert!(
            idle_rss < 24 * MIB,
            "{flag}: {:.1} MiB resident before any request",
            mib(idle_rss)
        );
    }
}

#[test]
fn a_server_stops_promptly_while_it_prefaults_in_the_background() {
    // Goal: a background prefault does not hold up shutdown. Method: a 1 GiB sparse export
    // behind a 1 GiB cache (0.25 s or more of prefaulting on this machine); SIGTERM as soon as
    // the server listens; it exits cleanly within 10 s, and its prefault threads say they
    // were stopped (they were joined) short of the 1 GiB.
    let dir = temp_dir();
    let mut server = server_over_export(dir.path(), "1G", "1G", &["--prefault=background"]);
    let started = Instant::now();
    server.stop_clean(Duration::from_secs(10));
    let log = server.log_text();
    eprintln!(
        "stopped in {:.2} s:\n{log}",
        started.elapsed().as_secs_f64()
    );
    let line = log
        .lines()
        .find(|line| line.contains("prefaulted"))
        .unwrap_or_else(|| panic!("the prefault threads said what they did:\n{log}"));
    assert!(
        line.contains("in the background (stopped at shutdown)"),
        "{line}"
    );
    assert!(!line.contains("prefaulted 1GiB"), "{line}");
}
