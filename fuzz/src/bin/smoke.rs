//! The stable fuzz smoke runner: every target in `bufcache_fuzz::TARGETS` gets a share of a
//! time budget, first replaying its seed corpus, then random and mutated inputs (bit flips,
//! interesting values, insertions, deletions, truncation, duplication, splices of corpus
//! files). No coverage feedback and no nightly flags: this is the net that catches
//! regressions in the test suite; cargo-fuzz is the tool for finding deep bugs.
//!
//! Any panic, in any thread, prints the target, seed, iteration and input (hex), writes the
//! input to `fuzz/artifacts/<target>/`, and aborts. An input that runs longer than the hang
//! limit is reported the same way.
//!
//! ```text
//! smoke [--seconds N] [--seed S] [--target NAME]... [--skip NAME]...
//!                                                      run (default 60 s, seed from the clock)
//! smoke --iterations N ...                             a fixed number of inputs per target
//! smoke --replay FILE --target NAME                    run one input
//! smoke gen-corpus                                     (re)write the binary NBD seeds
//! FUZZ_SEED=S and FUZZ_SKIP="NAME ..." in the environment do the same as --seed and --skip.
//! ```

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bufcache_fuzz::{Target, TARGETS};

/// Above the NBD targets' own 10 s socket timeouts, so those report first when they can.
const HANG_LIMIT: Duration = Duration::from_secs(15);
const INPUT_BYTES_MAX: usize = 4096;

/// What is running now, for the panic hook and the hang watchdog.
struct Current {
    target: &'static str,
    seed: u64,
    iteration: u64,
    input: Vec<u8>,
}

static CURRENT: Mutex<Option<Current>> = Mutex::new(None);
/// Milliseconds since `EPOCH` when the current input started; 0 when idle.
static STARTED_MS: AtomicU64 = AtomicU64::new(0);
static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();

fn now_ms() -> u64 {
    EPOCH.get_or_init(Instant::now).elapsed().as_millis() as u64 + 1
}

fn corpus_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus")
}

fn artifacts_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("artifacts")
}

/// Prints the failing input and writes it as an artifact. Called with a panic or a hang.
fn report(reason: &str) {
    // `try_lock`: the panicking thread may hold the lock (it never panics while holding it,
    // but a hang report must not wait on a stuck input).
    let guard = CURRENT.try_lock();
    let Some(current) = guard.as_ref().ok().and_then(|guard| guard.as_ref()) else {
        eprintln!("fuzz-smoke: {reason} outside of any input");
        return;
    };
    let hex: String = current
        .input
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect();
    let directory = artifacts_root().join(current.target);
    let path = directory.join(format!(
        "crash-seed{}-iteration{}",
        current.seed, current.iteration
    ));
    let written = std::fs::create_dir_all(&directory)
        .and_then(|()| std::fs::write(&path, &current.input))
        .map(|()| path.display().to_string())
        .unwrap_or_else(|error| format!("(not written: {error})"));
    eprintln!(
        "\nfuzz-smoke: FAILURE in target {} ({reason})\n  seed {} iteration {}\n  input ({} bytes): {hex}\n  saved as {written}\n  replay: cargo run --release --no-default-features --manifest-path fuzz/Cargo.toml \
         --bin smoke -- --replay {written} --target {}\n  or the same run: ... --bin smoke -- --seed {} --target {}",
        current.target,
        current.seed,
        current.iteration,
        current.input.len(),
        current.target,
        current.seed,
        current.target,
    );
}

fn install_hooks() {
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default_hook(info);
        report("panic");
        // A panic in a server thread would otherwise only end that thread.
        std::process::abort();
    }));
    std::thread::Builder::new()
        .name("hang-watchdog".into())
        .spawn(|| loop {
            std::thread::sleep(Duration::from_millis(500));
            let started = STARTED_MS.load(Ordering::Acquire);
            if started != 0 && now_ms() - started > HANG_LIMIT.as_millis() as u64 {
                report(&format!("hang: one input ran over {HANG_LIMIT:?}"));
                std::process::abort();
            }
        })
        .expect("spawn the watchdog");
}

/// splitmix64: small, fast and good enough to drive mutations reproducibly.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, bound: usize) -> usize {
        if bound == 0 {
            0
        } else {
            (self.next() % bound as u64) as usize
        }
    }

    fn chance(&mut self, numerator: u64, denominator: u64) -> bool {
        self.next() % denominator < numerator
    }
}

/// Values that sit on boundaries parsers check, in 1, 2, 4 and 8 bytes, both byte orders.
const INTERESTING: [u64; 16] = [
    0,
    1,
    0x7f,
    0x80,
    0xff,
    0x1ff,
    0x200,
    0xfff,
    0x1000,
    0x7fff,
    0xffff,
    0x10000,
    0x7fff_ffff,
    0xffff_ffff,
    0x8000_0000_0000_0000,
    u64::MAX,
];

/// Text fragments the text parsers branch on.
const TOKENS: [&[u8]; 27] = [
    // NBD: the extended request magic, the extended headers option, PAYLOAD_LEN with a length.
    b"\x21\xe4\x1c\x71",
    b"\x00\x00\x00\x0b\x00\x00\x00\x00",
    b"\x00\x20\x00\x07",
    b",",
    b"\n",
    b" ",
    b"\t",
    b"=",
    b"-",
    b"+",
    b".",
    b"0x",
    b"18446744073709551615",
    b"99999999999999999999",
    b"Read",
    b"Write",
    b"k",
    b"GiB",
    b"P",
    b"[",
    b"]",
    b"%",
    b"?socket=",
    b"nbd://",
    b"unix:",
    b"tcp:",
    b"\xff\xfe",
];

fn mutate(rng: &mut Rng, input: &mut Vec<u8>, corpus: &[Vec<u8>]) {
    let mutations = 1 + rng.below(6);
    for _ in 0..mutations {
        match rng.below(10) {
            0 | 1 if !input.is_empty() => {
                let at = rng.below(input.len());
                input[at] ^= 1 << rng.below(8);
            }
            2 if !input.is_empty() => {
                let at = rng.below(input.len());
                input[at] = rng.next() as u8;
            }
            3 if !input.is_empty() => {
                let width = [1usize, 2, 4, 8][rng.below(4)];
                let value = INTERESTING[rng.below(INTERESTING.len())];
                let bytes = if rng.chance(1, 2) {
                    value.to_be_bytes()
                } else {
                    value.to_le_bytes()
                };
                let bytes = if rng.chance(1, 2) {
                    &bytes[8 - width..]
                } else {
                    &bytes[..width]
                };
                let at = rng.below(input.len());
                let end = (at + width).min(input.len());
                input[at..end].copy_from_slice(&bytes[..end - at]);
            }
            4 => {
                let at = rng.below(input.len() + 1);
                let token = TOKENS[rng.below(TOKENS.len())];
                input.splice(at..at, token.iter().copied());
            }
            5 => {
                let at = rng.below(input.len() + 1);
                let count = 1 + rng.below(16);
                let bytes: Vec<u8> = (0..count).map(|_| rng.next() as u8).collect();
                input.splice(at..at, bytes);
            }
            6 if !input.is_empty() => {
                let at = rng.below(input.len());
                let count = 1 + rng.below((input.len() - at).min(64));
                input.drain(at..at + count);
            }
            7 if !input.is_empty() => {
                let keep = rng.below(input.len());
                input.truncate(keep);
            }
            8 if !input.is_empty() => {
                let from = rng.below(input.len());
                let count = 1 + rng.below((input.len() - from).min(128));
                let copy = input[from..from + count].to_vec();
                let at = rng.below(input.len() + 1);
                input.splice(at..at, copy);
            }
            _ if !corpus.is_empty() => {
                let other = &corpus[rng.below(corpus.len())];
                if !other.is_empty() {
                    let from = rng.below(other.len());
                    let count = 1 + rng.below(other.len() - from);
                    let at = rng.below(input.len() + 1);
                    let end = (at + rng.below(count + 1)).min(input.len());
                    input.splice(at..end, other[from..from + count].iter().copied());
                }
            }
            _ => {}
        }
    }
    input.truncate(INPUT_BYTES_MAX);
}

fn generate(rng: &mut Rng, corpus: &[Vec<u8>]) -> Vec<u8> {
    if corpus.is_empty() || rng.chance(1, 16) {
        let length = rng.below(256);
        return (0..length).map(|_| rng.next() as u8).collect();
    }
    let mut input = corpus[rng.below(corpus.len())].clone();
    mutate(rng, &mut input, corpus);
    input
}

fn load_corpus(target: &str) -> Vec<Vec<u8>> {
    let directory = corpus_root().join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&directory)
        .map(|entries| {
            entries
                .filter_map(|entry| Some(entry.ok()?.path()))
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
        .iter()
        .filter(|path| path.is_file())
        .filter_map(|path| std::fs::read(path).ok())
        .collect()
}

fn run_one(target: &'static str, function: Target, seed: u64, iteration: u64, input: &[u8]) {
    *CURRENT.lock().unwrap() = Some(Current {
        target,
        seed,
        iteration,
        input: input.to_vec(),
    });
    STARTED_MS.store(now_ms(), Ordering::Release);
    function(input);
    STARTED_MS.store(0, Ordering::Release);
}

fn target_seed(seed: u64, name: &str) -> u64 {
    name.bytes()
        .fold(seed ^ 0xcbf2_9ce4_8422_2325, |hash, byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x100_0000_01b3)
        })
}

struct Options {
    seconds: f64,
    iterations: Option<u64>,
    seed: u64,
    targets: Vec<String>,
    skip: Vec<String>,
    replay: Option<PathBuf>,
    gen_corpus: bool,
}

fn parse_options() -> Options {
    let mut options = Options {
        seconds: 60.0,
        iterations: None,
        seed: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|elapsed| elapsed.as_nanos() as u64 % 1_000_000_000)
            .unwrap_or(1),
        targets: Vec::new(),
        skip: Vec::new(),
        replay: None,
        gen_corpus: false,
    };
    let mut arguments = std::env::args().skip(1);
    while let Some(argument) = arguments.next() {
        let mut value = |name: &str| {
            arguments
                .next()
                .unwrap_or_else(|| usage(&format!("{name} needs a value")))
        };
        match argument.as_str() {
            "--seconds" => {
                options.seconds = value("--seconds")
                    .parse()
                    .unwrap_or_else(|_| usage("--seconds takes a number"))
            }
            "--iterations" => {
                options.iterations = Some(
                    value("--iterations")
                        .parse()
                        .unwrap_or_else(|_| usage("--iterations takes a number")),
                )
            }
            "--seed" => {
                options.seed = value("--seed")
                    .parse()
                    .unwrap_or_else(|_| usage("--seed takes a number"))
            }
            "--target" => options.targets.push(value("--target")),
            "--skip" => options.skip.push(value("--skip")),
            "--replay" => options.replay = Some(PathBuf::from(value("--replay"))),
            "gen-corpus" => options.gen_corpus = true,
            "--help" | "-h" => usage(""),
            other => usage(&format!("unknown argument {other:?}")),
        }
    }
    if let Ok(skip) = std::env::var("FUZZ_SKIP") {
        options
            .skip
            .extend(skip.split_whitespace().map(str::to_string));
    }
    if let Some(seed) = std::env::var("FUZZ_SEED")
        .ok()
        .and_then(|text| text.parse().ok())
    {
        options.seed = seed;
    }
    options
}

fn usage(problem: &str) -> ! {
    if !problem.is_empty() {
        eprintln!("smoke: {problem}");
    }
    eprintln!(
        "usage: smoke [--seconds N | --iterations N] [--seed S] [--target NAME]... [--skip NAME]... \
         | --replay FILE --target NAME | gen-corpus\ntargets: {}",
        TARGETS
            .iter()
            .map(|(name, _)| *name)
            .collect::<Vec<_>>()
            .join(" ")
    );
    std::process::exit(2);
}

fn gen_corpus() {
    let sets = [
        ("nbd_handshake", bufcache_fuzz::seeds::nbd_handshake_seeds()),
        ("nbd_requests", bufcache_fuzz::seeds::nbd_requests_seeds()),
        ("nbd_client", bufcache_fuzz::seeds::nbd_client_seeds()),
    ];
    for (target, seeds) in sets {
        let directory = corpus_root().join(target);
        std::fs::create_dir_all(&directory).expect("create the corpus directory");
        for (name, bytes) in seeds {
            std::fs::write(directory.join(&name), bytes).expect("write a seed");
        }
        println!("wrote {}", directory.display());
    }
}

fn main() {
    let options = parse_options();
    if options.gen_corpus {
        gen_corpus();
        return;
    }
    install_hooks();
    let selected: Vec<(&'static str, Target)> = TARGETS
        .iter()
        .copied()
        .filter(|(name, _)| options.targets.is_empty() || options.targets.iter().any(|t| t == name))
        .filter(|(name, _)| !options.skip.iter().any(|skipped| skipped == name))
        .collect();
    if selected.is_empty() {
        usage("no target matches");
    }
    if let Some(path) = &options.replay {
        let input = std::fs::read(path).unwrap_or_else(|error| usage(&format!("{error}")));
        for (name, function) in &selected {
            run_one(name, *function, 0, 0, &input);
            println!("{name}: {} bytes replayed without failure", input.len());
        }
        bufcache_fuzz::cleanup();
        return;
    }
    let share = Duration::from_secs_f64(options.seconds / selected.len() as f64);
    println!(
        "fuzz-smoke: seed {} (FUZZ_SEED={} replays this run), {} targets, {:.1} s each",
        options.seed,
        options.seed,
        selected.len(),
        share.as_secs_f64()
    );
    let mut total_inputs = 0u64;
    for (name, function) in selected {
        let corpus = load_corpus(name);
        let start = Instant::now();
        let mut iteration = 0u64;
        for input in &corpus {
            run_one(name, function, options.seed, iteration, input);
            iteration += 1;
        }
        let mut rng = Rng(target_seed(options.seed, name));
        loop {
            let done = match options.iterations {
                Some(count) => iteration >= count,
                None => start.elapsed() >= share,
            };
            if done {
                break;
            }
            let input = generate(&mut rng, &corpus);
            run_one(name, function, options.seed, iteration, &input);
            iteration += 1;
        }
        total_inputs += iteration;
        println!(
            "  {name:<22} {iteration:>9} inputs ({} seeds) in {:.1} s",
            corpus.len(),
            start.elapsed().as_secs_f64()
        );
    }
    bufcache_fuzz::cleanup();
    println!("fuzz-smoke: {total_inputs} inputs, no failures");
}
