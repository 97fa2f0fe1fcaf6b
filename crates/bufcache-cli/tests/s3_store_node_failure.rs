//! Goal: a store node failing under load loses nothing a FLUSH acknowledged, and what the
//! server could not store is an error to its client, never silence; the server keeps serving
//! through the failure (its requests retried within `retry-timeout-ms`). Method: a SeaweedFS
//! cluster on loopback (a master with `-defaultReplication=001`, three volume servers, a filer
//! with the S3 gateway); `bufcache serve` on it with a small cache and eager write-back, so
//! segments or chunks go to the store all the time; a writer thread sends tagged 64 KiB
//! blocks with a FLUSH every 8 writes, recording each outcome; meanwhile each volume server
//! in turn, then the filer with its gateway, is killed with SIGKILL and restarted a few
//! seconds later. Then every block reads back as the newest write an acknowledged FLUSH
//! covered (or a later write, or, after a failed write, that write), live and after a clean
//! restart of the server; the server's store metrics show requests retried during the kills.
//! `NODE_FAILURE_ROUNDS` repeats the kills (default 1 round: each volume server and the
//! gateway once); the long form, 5 rounds, is 20 kills per layout.

mod common;
#[path = "../../bufcache-s3/tests/support/mod.rs"]
mod s3_support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bufcache_nbd::NbdClient;
use common::*;
use s3_support::{have_seaweedfs, S3Server, SeaweedFsCluster, CLUSTER_VOLUME_SERVERS};

const BLOCK: usize = 64 << 10;
const BLOCKS: u64 = 256;
const FLUSH_EVERY_WRITES: usize = 8;

/// The content of write `index` (to block `index % BLOCKS`): its index and a pattern.
fn write_content(index: u64) -> Vec<u8> {
    let mut content = random_bytes(BLOCK, index ^ 0x5eed_f00d);
    content[..8].copy_from_slice(&(index + 1).to_le_bytes());
    content
}

/// What the writer sent and how each request ended.
#[derive(Default)]
struct Journal {
    /// Outcome of write `index`, in order: true when acknowledged.
    writes: Vec<bool>,
    /// Writes covered by the last acknowledged FLUSH.
    flushed: usize,
    /// Requests answered with an error.
    errors: Vec<String>,
}

/// Checks every block of the disk at `uri` against `journal`: the newest write to it that an
/// acknowledged FLUSH covered, or a write sent after it (acknowledged or not); a block never
/// durably written may also read as zeroes.
fn check_blocks(uri: &str, journal: &Journal, when: &str) {
    let client = NbdClient::connect(uri).unwrap();
    let mut content = vec![0u8; BLOCK];
    for block in 0..BLOCKS {
        client.read(block * BLOCK as u64, &mut content).unwrap();
        let tag = u64::from_le_bytes(content[..8].try_into().unwrap());
        let writes_to_block: Vec<u64> = (block..journal.writes.len() as u64)
            .step_by(BLOCKS as usize)
            .collect();
        let durable = writes_to_block
            .iter()
            .copied()
            .filter(|&index| (index as usize) < journal.flushed && journal.writes[index as usize])
            .max();
        if tag == 0 {
            assert!(
                content.iter().all(|&byte| byte == 0),
                "{when}: block {block} is neither zeroes nor a write"
            );
            assert!(
                durable.is_none(),
                "{when}: block {block} lost write {durable:?}, which a FLUSH acknowledged"
            );
            continue;
        }
        let index = tag - 1;
        assert!(
            writes_to_block.contains(&index),
            "{when}: block {block} holds write {index}, never sent to it"
        );
        assert!(
            content == write_content(index),
            "{when}: block {block} holds a torn write {index}"
        );
        assert!(
            durable.is_none_or(|durable| index >= durable),
            "{when}: block {block} holds write {index}, older than write {durable:?}, which a FLUSH acknowledged"
        );
    }
    client.disconnect();
}

/// Rounds of kills: `NODE_FAILURE_ROUNDS`, 1 when unset.
fn node_failure_rounds() -> usize {
    match std::env::var("NODE_FAILURE_ROUNDS") {
        Err(_) => 1,
        Ok(text) => text
            .parse()
            .ok()
            .filter(|&rounds| rounds > 0)
            .unwrap_or_else(|| panic!("NODE_FAILURE_ROUNDS={text}: not a positive count")),
    }
}

/// One layout's run (see the file's opening comment).
fn node_failures_lose_nothing_flushed(layout: &str) {
    let dir = temp_dir();
    let mut cluster = SeaweedFsCluster::start();
    cluster.create_bucket("disks");
    let url = format!(
        "s3://disks/{layout}?endpoint={}&create-size=16M&layout={layout}&retry-timeout-ms=60000",
        cluster.endpoint()
    );
    let mut server = Server::start(
        dir.path(),
        layout,
        &[
            "--backend",
            &url,
            "--cache-size",
            "4M",
            "--dirty-age-max",
            "0.05",
            "--dirty-background-percent",
            "1",
            "--metrics",
            "127.0.0.1:0",
        ],
    );
    let journal = Arc::new(Mutex::new(Journal::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (journal, stop, uri) = (journal.clone(), stop.clone(), server.uri());
        std::thread::spawn(move || {
            let client = NbdClient::connect(&uri).unwrap();
            let mut index = 0u64;
            while !stop.load(Ordering::SeqCst)
                || !(index as usize).is_multiple_of(FLUSH_EVERY_WRITES)
            {
                let result = client.write((index % BLOCKS) * BLOCK as u64, &write_content(index));
                {
                    let mut journal = journal.lock().unwrap();
                    journal.writes.push(result.is_ok());
                    if let Err(error) = result {
                        journal.errors.push(format!("write {index}: {error}"));
                    }
                }
                index += 1;
                if (index as usize).is_multiple_of(FLUSH_EVERY_WRITES) {
                    let result = client.flush();
                    let mut journal = journal.lock().unwrap();
                    match result {
                        Ok(()) => journal.flushed = index as usize,
                        Err(error) => journal.errors.push(format!("flush after {index}: {error}")),
                    }
                }
            }
            client.disconnect();
        })
    };
    let pause = |seconds: f64| std::thread::sleep(Duration::from_secs_f64(seconds));
    pause(1.0);
    let rounds = node_failure_rounds();
    for _ in 0..rounds {
        for index in 0..CLUSTER_VOLUME_SERVERS {
            cluster.kill9_volume(index);
            pause(3.0);
            cluster.start_volume(index);
            pause(1.5);
        }
        cluster.kill9_filer();
        pause(3.0);
        cluster.start_filer();
        pause(3.0);
    }
    stop.store(true, Ordering::SeqCst);
    writer.join().unwrap();
    let journal = journal.lock().unwrap();
    println!(
        "{layout}: {} kills, {} writes, {} covered by the last acknowledged FLUSH, errors: {:?}",
        rounds * (CLUSTER_VOLUME_SERVERS + 1),
        journal.writes.len(),
        journal.flushed,
        journal.errors
    );
    // The failures were met, not slept through: the gateway's death cost requests that the
    // client retried.
    let metrics = scrape_log(&server.log_text());
    let retries = sample(&metrics, "bufcache_store_retries_total{export=\"\"}");
    println!("{layout}: {retries} store requests retried");
    assert!(
        retries > 0.0,
        "{layout}: no store request failed during the kills"
    );
    assert!(
        journal.flushed == journal.writes.len(),
        "{layout}: the last FLUSH, after every node was back, was not acknowledged: {:?}",
        journal.errors
    );
    check_blocks(&server.uri(), &journal, &format!("{layout}, live"));
    server.stop_clean();
    let url = format!("s3://disks/{layout}?endpoint={}", cluster.endpoint());
    let mut server = Server::start(dir.path(), &format!("{layout}-again"), &["--backend", &url]);
    check_blocks(
        &server.uri(),
        &journal,
        &format!("{layout}, after a restart"),
    );
    server.stop_clean();
}

#[test]
fn kill_9_of_a_volume_server_or_the_gateway_loses_nothing_a_flush_acknowledged() {
    let name = "kill_9_of_a_volume_server_or_the_gateway_loses_nothing_a_flush_acknowledged";
    if !have_seaweedfs(name) {
        return;
    }
    let _timer = Timer::new(name);
    for layout in ["log", "chunk"] {
        node_failures_lose_nothing_flushed(layout);
    }
}
