//! Goal: under concurrent load from many connections, with a cache so small that eviction and
//! write-back run all the time, every read returns the latest acknowledged data and nothing is
//! lost at shutdown. Method (in the spirit of nbd-server's integrity tests): 6 NbdClient
//! connections × 3 threads issue seeded random reads, writes (some FUA), flushes, trims and
//! write-zeroes against `bufcache serve --backend FILE --cache-size 256k --block-size 4k`.
//! Each thread owns a disjoint byte range (boundaries fall mid-block, so neighbours share
//! blocks) and one shared range is used under a test-side lock, flushed through a different
//! connection than the one that wrote. A shadow model checks every read; after a FLUSH the
//! owner's range is compared with the backing file; after SIGTERM the whole file is.
//! Seeds: INTEGRITY_SEED replays one seed; otherwise seeds 1, 2, ... run within the budget.

mod reliability_support;

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bufcache_nbd::NbdClient;
use reliability_support::*;

const CONNECTIONS: usize = 6;
const THREADS_PER_CONNECTION: usize = 3;
const OWNERS: usize = CONNECTIONS * THREADS_PER_CONNECTION;
/// Bytes each thread owns; not a multiple of the block size, so owners share edge blocks.
const OWNED: u64 = 384 * 1024 + 1000;
const SHARED_START: u64 = OWNERS as u64 * OWNED + 4096 + 77;
const SHARED: u64 = 1024 * 1024 + 333;
const EXPORT: u64 = 32 << 20;
const INITIAL_SEED_SALT: u64 = 0x1417_e6a1;

/// Byte states: the value is known, or a TRIM left it "old value or zero".
const KNOWN: u8 = 0;
const TRIMMED: u8 = 1;

/// The expected contents of one range.
struct Model {
    start: u64,
    bytes: Vec<u8>,
    state: Vec<u8>,
}

impl Model {
    fn new(start: u64, initial: &[u8]) -> Model {
        Model {
            start,
            bytes: initial.to_vec(),
            state: vec![KNOWN; initial.len()],
        }
    }

    fn range(&self, offset: u64, length: u64) -> std::ops::Range<usize> {
        let at = (offset - self.start) as usize;
        at..at + length as usize
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let range = self.range(offset, data.len() as u64);
        self.bytes[range.clone()].copy_from_slice(data);
        self.state[range].fill(KNOWN);
    }

    fn zero(&mut self, offset: u64, length: u64) {
        let range = self.range(offset, length);
        self.bytes[range.clone()].fill(0);
        self.state[range].fill(KNOWN);
    }

    fn trim(&mut self, offset: u64, length: u64) {
        let range = self.range(offset, length);
        self.state[range].fill(TRIMMED);
    }

    /// Checks `data` read at `offset`; with `settle`, a trimmed byte's observed value becomes
    /// known (it must not change again by itself).
    fn check(&mut self, what: &str, offset: u64, data: &[u8], settle: bool) -> Result<(), String> {
        let range = self.range(offset, data.len() as u64);
        for (index, at) in range.enumerate() {
            let (expected, got) = (self.bytes[at], data[index]);
            let ok = match self.state[at] {
                KNOWN => expected == got,
                _ => got == expected || got == 0,
            };
            if !ok {
                return Err(format!(
                    "{what}: byte at offset {} is {got:#04x}, expected {expected:#04x}{}",
                    self.start + at as u64,
                    if self.state[at] == TRIMMED {
                        " or zero (trimmed)"
                    } else {
                        ""
                    }
                ));
            }
            if settle {
                self.bytes[at] = got;
                self.state[at] = KNOWN;
            }
        }
        Ok(())
    }
}

fn read_file(file: &File, offset: u64, length: u64) -> Vec<u8> {
    let mut bytes = vec![0u8; length as usize];
    file.read_exact_at(&mut bytes, offset)
        .expect("reading the backing file");
    bytes
}

/// One random operation's shape inside `[start, start + size)`.
fn pick_range(rng: &mut Rng, start: u64, size: u64) -> (u64, u64) {
    let length = match rng.below(5) {
        0 => rng.range(1, 700),
        1 => rng.range(1, 4) * 4096,
        2 => rng.range(1, 32) * 512,
        3 => rng.range(4096, 64 << 10),
        _ => rng.range(64 << 10, 160 << 10),
    }
    .min(size);
    let offset = match rng.below(4) {
        // Near an edge (blocks shared with the neighbour).
        0 => start,
        1 => start + size - length,
        2 => start + (rng.below(size - length + 1) / 4096 * 4096).min(size - length),
        _ => start + rng.below(size - length + 1),
    };
    (offset, length)
}

/// Operation mix: percent of reads, writes, FUA writes, zeroes, trims; the rest flushes.
fn do_op(
    rng: &mut Rng,
    client: &NbdClient,
    flusher: &NbdClient,
    model: &mut Model,
    file: &File,
    label: &str,
) -> Result<(), String> {
    let (offset, length) = pick_range(rng, model.start, model.bytes.len() as u64);
    let fail = |what: &str, error: bufcache_nbd::ClientError| {
        format!("{label}: {what} {length} bytes at {offset} failed: {error}")
    };
    match rng.below(100) {
        0..=39 => {
            let mut data = vec![0u8; length as usize];
            client
                .read(offset, &mut data)
                .map_err(|e| fail("read", e))?;
            model.check(&format!("{label}: read"), offset, &data, true)?;
        }
        40..=69 => {
            let mut data = vec![0u8; length as usize];
            rng.fill(&mut data);
            client.write(offset, &data).map_err(|e| fail("write", e))?;
            model.write(offset, &data);
        }
        70..=76 => {
            let mut data = vec![0u8; length as usize];
            rng.fill(&mut data);
            client
                .write_fua(offset, &data)
                .map_err(|e| fail("FUA write", e))?;
            model.write(offset, &data);
            // FUA: durable now, so the file holds it.
            let on_file = read_file(file, offset, length);
            model.check(&format!("{label}: file after FUA"), offset, &on_file, false)?;
        }
        77..=84 => {
            client
                .zero(offset, length, rng.chance(50))
                .map_err(|e| fail("write_zeroes", e))?;
            model.zero(offset, length);
        }
        85..=91 => {
            client.trim(offset, length).map_err(|e| fail("trim", e))?;
            model.trim(offset, length);
        }
        _ => {
            flusher.flush().map_err(|e| fail("flush", e))?;
            // Everything this owner completed before the flush is in the file.
            let size = model.bytes.len() as u64;
            let on_file = read_file(file, model.start, size);
            model.check(
                &format!("{label}: file after FLUSH"),
                model.start,
                &on_file,
                false,
            )?;
        }
    }
    Ok(())
}

struct Outcome {
    operations: u64,
    error: Option<String>,
}

fn run_seed(seed: u64, duration: Duration) -> u64 {
    let dir = temp_dir();
    let disk = dir.path().join("disk.img");
    // Every seed uses the tiny cache; the rest of the configuration rotates.
    let mut args: Vec<&str> = vec![
        "--backend",
        "disk.img",
        "--create-size",
        "32M",
        "--cache-size",
        "256k",
        "--block-size",
        "4k",
        "--dirty-age-max",
        "0.05",
        "--metrics",
        "127.0.0.1:0",
    ];
    let variant: &[&str] = match seed % 3 {
        1 => &["--cluster-size-max", "64k"],
        2 => &[],
        _ => &[
            "--policy",
            "clock",
            "--io-queue",
            "fifo",
            "--cluster-size-max",
            "16k",
        ],
    };
    args.extend_from_slice(variant);
    eprintln!("seed {seed}: configuration {variant:?}");
    let mut server = Server::start(dir.path(), "bufcache", &args);
    // Initial contents: random everywhere we use, written and flushed through the server.
    let used = SHARED_START + SHARED;
    let initial = random_bytes(used as usize, seed ^ INITIAL_SEED_SALT);
    let clients: Vec<Arc<NbdClient>> = (0..CONNECTIONS)
        .map(|_| Arc::new(NbdClient::connect(&server.uri()).expect("connecting")))
        .collect();
    assert_eq!(clients[0].size(), EXPORT);
    for (index, chunk) in initial.chunks(1 << 20).enumerate() {
        clients[0].write(index as u64 * (1 << 20), chunk).unwrap();
    }
    clients[0].flush().unwrap();
    let shared = Arc::new(Mutex::new(Model::new(
        SHARED_START,
        &initial[SHARED_START as usize..],
    )));
    let deadline = Instant::now() + duration;
    let mut threads = Vec::new();
    for owner in 0..OWNERS {
        let connection = owner % CONNECTIONS;
        let clients = clients.clone();
        let shared = Arc::clone(&shared);
        let start = owner as u64 * OWNED;
        let mut model = Model::new(start, &initial[start as usize..(start + OWNED) as usize]);
        let disk = disk.clone();
        threads.push(std::thread::spawn(move || {
            let file = File::open(&disk).unwrap();
            let mut rng = Rng::new(seed.wrapping_mul(1000).wrapping_add(owner as u64));
            let client = &clients[connection];
            let mut operations = 0u64;
            let mut run = || -> Result<(), String> {
                while Instant::now() < deadline {
                    if rng.chance(15) {
                        // Shared range: serialised by the lock; flushed through another
                        // connection (FLUSH covers every connection's completed writes).
                        let mut model = shared.lock().unwrap();
                        let other =
                            &clients[(connection + 1 + rng.below(CONNECTIONS as u64 - 1) as usize)
                                % CONNECTIONS];
                        do_op(
                            &mut rng,
                            client,
                            other,
                            &mut model,
                            &file,
                            &format!("owner {owner} (shared range)"),
                        )?;
                    } else {
                        do_op(
                            &mut rng,
                            client,
                            client,
                            &mut model,
                            &file,
                            &format!("owner {owner}"),
                        )?;
                    }
                    operations += 1;
                }
                Ok(())
            };
            let error = run().err();
            (Outcome { operations, error }, model)
        }));
    }
    let mut operations = 0;
    let mut errors = Vec::new();
    let mut models = Vec::new();
    for thread in threads {
        let (outcome, model) = thread.join().expect("worker thread panicked");
        operations += outcome.operations;
        errors.extend(outcome.error);
        models.push(model);
    }
    if !errors.is_empty() {
        panic!(
            "seed {seed}: {} worker(s) failed (replay: INTEGRITY_SEED={seed}):\n{}\nserver log:\n{}",
            errors.len(),
            errors.join("\n"),
            server.log_text()
        );
    }
    let stats = server.stats();
    let cache = &stats["cache"];
    eprintln!(
        "seed {seed}: evictions {}, write-back blocks {}, space waits {}, space failures {}, \
         throttled writes {}, hit ratio {:.2}",
        cache["evictions"],
        cache["writeback_blocks"],
        cache["space_waits"],
        cache["space_failures"],
        cache["throttled_writes"],
        cache["hit_ratio"].as_f64().unwrap_or(0.0)
    );
    assert!(
        cache["evictions"].as_u64().unwrap_or(0) > 1000,
        "seed {seed}: the cache was not under pressure: {cache}"
    );
    // No final FLUSH: SIGTERM must write everything back.
    drop(clients);
    server.stop_clean(Duration::from_secs(60));
    let file = File::open(&disk).unwrap();
    assert_eq!(file.metadata().unwrap().len(), EXPORT);
    let mut all = models;
    all.push(Arc::try_unwrap(shared).ok().unwrap().into_inner().unwrap());
    for mut model in all {
        let size = model.bytes.len() as u64;
        let on_file = read_file(&file, model.start, size);
        if let Err(message) =
            model.check("backing file after SIGTERM", model.start, &on_file, false)
        {
            panic!("seed {seed}: {message} (replay: INTEGRITY_SEED={seed})");
        }
    }
    // Bytes nobody owns (gap before the shared range, the rest of the export) are unchanged.
    let gap_start = OWNERS as u64 * OWNED;
    let gap = read_file(&file, gap_start, SHARED_START - gap_start);
    assert_eq!(
        gap,
        &initial[gap_start as usize..SHARED_START as usize],
        "seed {seed}: unowned gap changed"
    );
    let tail = read_file(&file, used, EXPORT - used);
    assert!(
        tail.iter().all(|&byte| byte == 0),
        "seed {seed}: bytes past the used range changed"
    );
    operations
}

#[test]
fn concurrent_connections_against_a_shadow_model_with_a_tiny_cache() {
    let _timer = Timer::new("concurrent_connections_against_a_shadow_model_with_a_tiny_cache");
    let fixed = seed_from_env("INTEGRITY_SEED", 0);
    let budget = Duration::from_secs(
        std::env::var("INTEGRITY_BUDGET_SECONDS")
            .ok()
            .and_then(|text| text.parse().ok())
            .unwrap_or(60),
    );
    let per_seed = Duration::from_secs(6);
    let started = Instant::now();
    let mut seed = if fixed != 0 { fixed } else { 1 };
    let mut total = 0;
    loop {
        eprintln!("integrity seed {seed}");
        let operations = run_seed(seed, per_seed);
        total += operations;
        eprintln!("seed {seed}: {operations} operations checked");
        if fixed != 0 || started.elapsed() + per_seed + Duration::from_secs(3) > budget {
            break;
        }
        seed += 1;
    }
    eprintln!(
        "{total} operations over seeds up to {seed} in {:.1} s",
        started.elapsed().as_secs_f64()
    );
}
