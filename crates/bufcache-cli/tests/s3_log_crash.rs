//! Goal: crash consistency of the log layout (`layout=log`) through the real server: after
//! `kill -9` of `bufcache serve` at any moment during write-back, the disk reopens with every
//! write a FLUSH acknowledged, and as a prefix of the flush epochs — every epoch before the
//! newest one seen complete, the newest one in part (the cache writes an epoch's blocks back
//! in its own order, so within an epoch no order is promised) — with no block torn, stale
//! beyond that or from a write never sent. Method: moto on loopback (it outlives the
//! servers); a writer thread sends tagged 4 KiB blocks through the NBD client with a FLUSH
//! every few writes, over a small cache with eager write-back and small segments, so
//! segments seal and upload all the time; the server is killed with SIGKILL after a random
//! delay, restarted (breaking its stale lock), and the image read back and checked against
//! what was sent and acknowledged. Repeated for several rounds, each continuing from the
//! image the previous one recovered. Run on moto and on SeaweedFS (`_on_seaweedfs`). The
//! servers run with `lease=off`, so the restart goes through `break-lock=` at once (a takeover
//! of a lapsed lease is tested in `s3_takeover.rs`).

mod common;
#[path = "../../bufcache-s3/tests/support/mod.rs"]
mod s3_support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bufcache_nbd::NbdClient;
use common::*;
use s3_support::{have_moto, have_seaweedfs, Moto, S3Server, SeaweedFs};

const BLOCK: usize = 4096;
const BLOCKS: usize = 512;
const FLUSH_EVERY_WRITES: usize = 160;

/// The content of a block written by write `index` of round `round`: a header naming both
/// and the block, and a pattern derived from them, so a torn or misplaced block is seen.
fn block_content(round: u32, index: u32, block: u64) -> Vec<u8> {
    let mut content = vec![0u8; BLOCK];
    content[..4].copy_from_slice(&round.to_le_bytes());
    content[4..8].copy_from_slice(&(index + 1).to_le_bytes());
    content[8..16].copy_from_slice(&block.to_le_bytes());
    let mut state = (u64::from(round) << 40) ^ (u64::from(index) << 16) ^ block ^ 0x9e37_79b9;
    for byte in content[16..].iter_mut() {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *byte = (state >> 56) as u8;
    }
    content
}

/// What a block holds: None for a block never written (all zeroes), else (round, index).
fn block_tag(content: &[u8], block: u64) -> Option<(u32, u32)> {
    if content.iter().all(|&byte| byte == 0) {
        return None;
    }
    let round = u32::from_le_bytes(content[..4].try_into().unwrap());
    let index = u32::from_le_bytes(content[4..8].try_into().unwrap());
    assert!(index > 0, "block {block}: not a tagged block");
    assert!(
        content == block_content(round, index - 1, block),
        "block {block}: torn or misplaced content (tag round {round} write {})",
        index - 1
    );
    Some((round, index - 1))
}

/// What the writer sent and what the server acknowledged.
#[derive(Default)]
struct Journal {
    /// Block of every write sent, in order (the last may be unacknowledged).
    sent: Vec<u64>,
    /// Writes covered by the last acknowledged FLUSH.
    flushed: usize,
}

/// The lock id of the killed server, as the refusal to start names it (`break-lock=ID`):
/// the way an operator learns it.
fn lock_id(endpoint: &str, dir: &std::path::Path) -> String {
    let output = run_timeout(
        std::process::Command::new(bufcache_bin())
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

#[test]
fn log_layout_reopens_as_a_prefix_of_flush_epochs_after_kill_9_during_write_back() {
    let name = "log_layout_reopens_as_a_prefix_of_flush_epochs_after_kill_9_during_write_back";
    if !have_moto(name) {
        return;
    }
    let _timer = Timer::new(name);
    log_layout_reopens_as_a_prefix_of_flush_epochs(&Moto::start());
}

#[test]
fn log_layout_reopens_as_a_prefix_of_flush_epochs_after_kill_9_during_write_back_on_seaweedfs() {
    // Goal and method: those of
    // `log_layout_reopens_as_a_prefix_of_flush_epochs_after_kill_9_during_write_back` (the
    // file's opening comment), on SeaweedFS.
    let name =
        "log_layout_reopens_as_a_prefix_of_flush_epochs_after_kill_9_during_write_back_on_seaweedfs";
    if !have_seaweedfs(name) {
        return;
    }
    let _timer = Timer::new(name);
    log_layout_reopens_as_a_prefix_of_flush_epochs(&SeaweedFs::start());
}

/// The body of the kill -9 tests, on `store` (which outlives the bufcache servers).
fn log_layout_reopens_as_a_prefix_of_flush_epochs(store: &dyn S3Server) {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    println!("seed {seed}");
    let mut rng = Rng::new(seed);
    let dir = temp_dir();
    store.create_bucket("disks");
    let endpoint = store.endpoint();
    // Tag of every block as the disk holds it now (None: never written).
    let mut base: Vec<Option<(u32, u32)>> = vec![None; BLOCKS];
    let rounds = 6u32;
    let mut killed_with_unflushed = 0;
    for round in 0..rounds {
        let parameters = if round == 0 {
            "&create-size=2M&layout=log&segment-size=64k&lease=off".to_string()
        } else {
            format!(
                "&segment-size=64k&lease=off&break-lock={}",
                lock_id(&endpoint, dir.path())
            )
        };
        let url = format!("s3://disks/vm1?endpoint={endpoint}{parameters}");
        let mut server = Server::start(
            dir.path(),
            &format!("round{round}"),
            &[
                "--backend",
                &url,
                "--cache-size",
                "256K",
                "--dirty-age-max",
                "0.05",
                "--dirty-background-percent",
                "1",
            ],
        );
        let journal = Arc::new(Mutex::new(Journal::default()));
        let writer = {
            let journal = journal.clone();
            let uri = server.uri();
            let writer_seed = rng.next_u64();
            std::thread::spawn(move || {
                let client = NbdClient::connect(&uri).unwrap();
                let mut rng = Rng::new(writer_seed);
                for index in 0..100_000u32 {
                    let block = rng.below(BLOCKS as u64);
                    journal.lock().unwrap().sent.push(block);
                    let data = block_content(round, index, block);
                    if client.write(block * BLOCK as u64, &data).is_err() {
                        return;
                    }
                    if (index as usize + 1).is_multiple_of(FLUSH_EVERY_WRITES) {
                        if client.flush().is_err() {
                            return;
                        }
                        journal.lock().unwrap().flushed = index as usize + 1;
                    }
                }
            })
        };
        std::thread::sleep(Duration::from_millis(300 + rng.below(1500)));
        server.kill9();
        writer.join().unwrap();
        let journal = journal.lock().unwrap();
        let sent = &journal.sent;
        if sent.len() > journal.flushed {
            killed_with_unflushed += 1;
        }
        // Reopen and read the image.
        let server = Server::start(
            dir.path(),
            &format!("check{round}"),
            &[
                "--backend",
                &format!(
                    "s3://disks/vm1?endpoint={endpoint}&lease=off&break-lock={}",
                    lock_id(&endpoint, dir.path())
                ),
            ],
        );
        let client = NbdClient::connect(&server.uri()).unwrap();
        let mut image = vec![0u8; BLOCKS * BLOCK];
        client.read(0, &mut image).unwrap();
        client.disconnect();
        drop(server);
        // Each block holds a write of this round or, when none of this round reached it,
        // what the previous round recovered.
        let tags: Vec<Option<(u32, u32)>> = (0..BLOCKS)
            .map(|block| {
                let tag = block_tag(&image[block * BLOCK..(block + 1) * BLOCK], block as u64);
                if tag.is_none_or(|(tag_round, _)| tag_round != round) {
                    assert_eq!(
                        tag, base[block],
                        "seed {seed} round {round} block {block}: holds neither a write of this round nor the recovered base"
                    );
                }
                tag
            })
            .collect();
        // The newest write seen: its epoch is the one in progress; every write before that
        // epoch's start, and every write a FLUSH acknowledged, must be present (its own value
        // or a later one).
        let newest = tags
            .iter()
            .filter_map(|tag| tag.filter(|&(tag_round, _)| tag_round == round))
            .map(|(_, index)| index as usize)
            .max();
        if let Some(newest) = newest {
            assert!(
                newest < sent.len(),
                "seed {seed} round {round}: write {newest} was never sent"
            );
        }
        let epoch_start =
            newest.map_or(0, |newest| newest / FLUSH_EVERY_WRITES * FLUSH_EVERY_WRITES);
        let complete_through = epoch_start.max(journal.flushed);
        for (block, tag) in tags.iter().enumerate() {
            let required = sent[..complete_through.min(sent.len())]
                .iter()
                .rposition(|&written| written == block as u64);
            let observed = tag
                .filter(|&(tag_round, _)| tag_round == round)
                .map(|(_, index)| index as usize);
            if let Some(required) = required {
                let observed = observed.unwrap_or_else(|| {
                    panic!(
                        "seed {seed} round {round} block {block}: write {required} (before write {complete_through}, flushed through {}) is missing",
                        journal.flushed
                    )
                });
                assert!(
                    observed >= required,
                    "seed {seed} round {round} block {block}: holds write {observed}, older than write {required} which precedes the newest epoch"
                );
                assert_eq!(sent[observed], block as u64);
            }
            if let Some(observed) = observed {
                assert_eq!(
                    sent[observed], block as u64,
                    "seed {seed}: write {observed} went to block {block}?"
                );
            }
        }
        println!(
            "round {round}: {} writes sent, {} flushed, newest recovered {newest:?}",
            sent.len(),
            journal.flushed
        );
        base = tags;
    }
    assert!(
        killed_with_unflushed > 0,
        "seed {seed}: no round was killed with unflushed writes; the test proved nothing"
    );
}
