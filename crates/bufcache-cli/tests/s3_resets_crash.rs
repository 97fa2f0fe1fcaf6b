//! Goal: the log layout (`layout=log`) over a store that resets connections (issue 46, item 6):
//! with 2 % of requests of every method answered by a connection reset, every start of
//! `bufcache serve` after a `kill -9` succeeds (0 failed starts) and every write a FLUSH
//! acknowledged reads back after each restart (0 acknowledged writes lost). Method: moto (and,
//! in a second test, SeaweedFS) on loopback behind the fault proxy in `reset-percent` mode (seeded; the seed is printed and
//! `RESETS_SEED` replays it); rounds of: start the real server through the proxy (breaking the
//! killed server's lock), read the whole image and compare it with every write flushed so
//! far, overwrite a shared range and write this round's own blocks, FLUSH, write more without
//! a FLUSH (so the kill can land mid write-back), kill -9. Segments are small (64 KiB) and
//! the shared range's old versions become garbage, so the opens and the collector DELETE.
//! `RESETS_CRASH_ROUNDS` sets the number of rounds (default 30), `RESETS_PERCENT` the share
//! of requests reset (default 2). The servers run with `lease=off`, so each restart breaks the
//! killed server's lock at once instead of waiting for its lease to lapse.

mod common;
#[path = "../../bufcache-s3/tests/support/mod.rs"]
mod s3_support;

use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bufcache_nbd::NbdClient;
use common::*;
use s3_support::{have_moto, have_seaweedfs, FaultProxy, Moto, S3Server, SeaweedFs};

const BLOCK: usize = 4096;
/// Blocks every round overwrites (at the start of the disk): their old versions become
/// garbage, so the collector and the open-time cleanup delete segments.
const SHARED_BLOCKS: usize = 32;
/// Blocks each round writes in its own range (after the shared ones).
const ROUND_BLOCKS: usize = 16;
/// Blocks written after the FLUSH and never flushed (after the checked ones), so the kill
/// lands while write-back is in progress; their content is not checked.
const UNFLUSHED_BLOCKS: usize = 32;
const START_TIMEOUT: Duration = Duration::from_secs(90);
/// Attempts to start the server in one round before the test gives up on the disk.
const START_ATTEMPTS_MAX: usize = 3;

/// The lock id of the killed server, as a refused start directly against moto (not through
/// the proxy) names it (`break-lock=ID`): the way an operator learns it.
fn lock_id(endpoint: &str, dir: &Path) -> String {
    let output = run_timeout(
        Command::new(bufcache_bin())
            .args([
                "serve",
                "--backend",
                &format!("s3://disks/vm1?endpoint={endpoint}"),
                "--listen",
            ])
            .arg(format!("unix:{}", dir.join("refused.sock").display()))
            .current_dir(dir),
        Duration::from_secs(60),
    );
    let text = output_text(&output);
    assert_eq!(output.status.code(), Some(2), "{text}");
    let start = text
        .find("break-lock=")
        .unwrap_or_else(|| panic!("no lock id in: {text}"))
        + "break-lock=".len();
    text[start..]
        .chars()
        .take_while(char::is_ascii_hexdigit)
        .collect()
}

/// A started `bufcache serve` and its NBD URI, or why it did not start (its exit and log).
fn start(dir: &Path, name: &str, url: &str) -> Result<(Child, String), String> {
    let socket = dir.join(format!("{name}.sock"));
    let log = dir.join(format!("{name}.log"));
    let log_file = std::fs::File::create(&log).unwrap();
    let mut child = Command::new(bufcache_bin())
        .args(["serve", "--backend", url, "--cache-size", "1M", "--listen"])
        .arg(format!("unix:{}", socket.display()))
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(log_file.try_clone().unwrap())
        .stderr(log_file)
        .spawn()
        .expect("starting bufcache serve");
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if UnixStream::connect(&socket).is_ok() {
            return Ok((child, format!("nbd+unix:///?socket={}", socket.display())));
        }
        let log_text = || std::fs::read_to_string(&log).unwrap_or_default();
        if let Some(status) = child.try_wait().unwrap() {
            return Err(format!("exited with {status}:\n{}", log_text()));
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!(
                "did not accept within {START_TIMEOUT:?}:\n{}",
                log_text()
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Content of `blocks` written in `round`, distinct per round and block, so a stale or
/// misplaced block is seen.
fn range_content(seed: u64, round: usize, blocks: std::ops::Range<usize>) -> Vec<u8> {
    blocks
        .flat_map(|block| random_bytes(BLOCK, seed ^ ((round as u64) << 32) ^ block as u64))
        .collect()
}

#[test]
fn log_layout_starts_every_time_and_keeps_flushed_writes_through_resets_and_kill_9() {
    let name = "log_layout_starts_every_time_and_keeps_flushed_writes_through_resets_and_kill_9";
    if have_moto(name) {
        let _timer = Timer::new(name);
        let moto = Moto::start();
        resets_and_kills_lose_nothing(&moto, moto.port);
    }
}

#[test]
fn log_layout_starts_every_time_and_keeps_flushed_writes_through_resets_and_kill_9_on_seaweedfs() {
    let name = "log_layout_starts_every_time_and_keeps_flushed_writes_through_resets_and_kill_9_on_seaweedfs";
    if have_seaweedfs(name) {
        let _timer = Timer::new(name);
        let seaweedfs = SeaweedFs::start();
        resets_and_kills_lose_nothing(&seaweedfs, seaweedfs.port);
    }
}

/// The rounds (see the file's opening comment) against `store`, which listens on `port`.
fn resets_and_kills_lose_nothing(store: &dyn S3Server, port: u16) {
    let began = Instant::now();
    let seed: u64 = std::env::var("RESETS_SEED")
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    let rounds: usize = std::env::var("RESETS_CRASH_ROUNDS")
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or(30);
    let reset_percent: f64 = std::env::var("RESETS_PERCENT")
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or(2.0);
    println!("seed {seed} (RESETS_SEED), {rounds} rounds, {reset_percent} % resets");
    let dir = temp_dir();
    store.create_bucket("disks");
    let proxy = FaultProxy::resetting_percent(port, reset_percent, seed);
    let endpoint = proxy.endpoint();
    // Blocks checked: the shared ones and every round's own.
    let blocks = SHARED_BLOCKS + rounds * ROUND_BLOCKS;
    let size_bytes = ((blocks + UNFLUSHED_BLOCKS) * BLOCK).next_multiple_of(1 << 20);
    // What the disk must hold: every write a FLUSH acknowledged.
    let mut expected = vec![0u8; size_bytes];
    let mut failed_starts = Vec::new();
    let mut lost = Vec::new();
    let mut failed_flushes = Vec::new();
    let mut rounds_done = 0;
    // The last start only reads back what the last round flushed.
    'rounds: for round in 0..=rounds {
        let mut server = None;
        for attempt in 0..START_ATTEMPTS_MAX {
            let parameters = if round == 0 && attempt == 0 {
                format!("&create-size={size_bytes}&layout=log&segment-size=64k&lease=off")
            } else {
                format!(
                    "&segment-size=64k&lease=off&break-lock={}",
                    lock_id(&store.endpoint(), dir.path())
                )
            };
            let url = format!("s3://disks/vm1?endpoint={endpoint}{parameters}");
            match start(dir.path(), &format!("round{round}-{attempt}"), &url) {
                Ok(child) => {
                    server = Some(child);
                    break;
                }
                Err(why) => {
                    println!("round {round} attempt {attempt}: failed start: {why}");
                    failed_starts.push(format!("round {round} attempt {attempt}: {why}"));
                }
            }
        }
        let Some((mut server, uri)) = server else {
            println!("round {round}: no start in {START_ATTEMPTS_MAX} attempts; stopping");
            break 'rounds;
        };
        let client = NbdClient::connect(&uri).unwrap();
        let mut image = vec![0u8; size_bytes];
        match client.read(0, &mut image) {
            Ok(()) => {
                for block in 0..blocks {
                    let range = block * BLOCK..(block + 1) * BLOCK;
                    if image[range.clone()] != expected[range] {
                        lost.push(format!(
                            "round {round}: block {block} differs from its flushed write"
                        ));
                    }
                }
            }
            Err(error) => lost.push(format!("round {round}: reading the image failed: {error}")),
        }
        if round == rounds {
            send_signal(server.id(), SIGKILL);
            let _ = server.wait();
            break;
        }
        // This round's writes: the shared blocks overwritten, and its own blocks.
        let own = SHARED_BLOCKS + round * ROUND_BLOCKS;
        let mut written = Vec::new();
        for range in [0..SHARED_BLOCKS, own..own + ROUND_BLOCKS] {
            let content = range_content(seed, round, range.clone());
            if let Err(error) = client.write((range.start * BLOCK) as u64, &content) {
                failed_flushes.push(format!("round {round}: write of blocks {range:?}: {error}"));
                break;
            }
            written.push((range, content));
        }
        match client.flush() {
            Ok(()) => {
                for (range, content) in written {
                    expected[range.start * BLOCK..range.end * BLOCK].copy_from_slice(&content);
                }
            }
            Err(error) => failed_flushes.push(format!("round {round}: FLUSH: {error}")),
        }
        // Unflushed writes the kill may interrupt mid write-back (errors are expected once
        // the server is gone, so none is checked).
        let _ = client.write(
            (blocks * BLOCK) as u64,
            &range_content(seed, round, blocks..blocks + UNFLUSHED_BLOCKS),
        );
        send_signal(server.id(), SIGKILL);
        let _ = server.wait();
        rounds_done += 1;
    }
    let faults = proxy.faults();
    let resets_of = |method: &str| {
        faults
            .iter()
            .filter(|fault| fault.starts_with(&format!("{method} ")))
            .count()
    };
    println!(
        "seed {seed}: {rounds_done} of {rounds} rounds, {} failed starts, {} lost, {} failed writes or flushes, {} requests reset (GET {}, HEAD {}, PUT {}, POST {}, DELETE {}), {:.1} s",
        failed_starts.len(),
        lost.len(),
        failed_flushes.len(),
        faults.len(),
        resets_of("GET"),
        resets_of("HEAD"),
        resets_of("PUT"),
        resets_of("POST"),
        resets_of("DELETE"),
        began.elapsed().as_secs_f64()
    );
    assert!(
        failed_starts.is_empty(),
        "seed {seed}: failed starts:\n{}",
        failed_starts.join("\n")
    );
    assert!(
        lost.is_empty(),
        "seed {seed}: acknowledged writes lost:\n{}",
        lost.join("\n")
    );
    assert!(
        failed_flushes.is_empty(),
        "seed {seed}: writes or flushes failed (every request is retried until retry-timeout-ms):\n{}",
        failed_flushes.join("\n")
    );
    assert_eq!(rounds_done, rounds);
    assert!(
        resets_of("GET") > 0 && resets_of("PUT") > 0,
        "seed {seed}: no GET or no PUT was reset; the test proved little: {faults:?}"
    );
}
