//! Read replicas through real `bufcache serve` processes on one moto disk (docs/s3.md, "Read
//! replicas"): `serve -r` with `follow=` beside the writer never takes the lock, reads what the
//! writer flushed within `follow` + a few seconds, never reads what the writer holds only in
//! memory, refuses writes, and says its role and lag on /metrics; bad requests for one are
//! refused with a reason.

mod common;
#[path = "../../bufcache-s3/tests/support/mod.rs"]
mod s3_support;

use std::time::{Duration, Instant};

use bufcache_nbd::NbdClient;
use common::*;
use s3_support::{have_moto, Moto};

const BLOCK: usize = 4096;
const FOLLOW_SECONDS: u64 = 1;
/// How much later than `follow` a flushed write may show on the replica: its refresh's own
/// requests and the writer's segment upload on a loaded machine.
const SLACK_SECONDS: u64 = 5;

fn tagged(round: u64, block: u64) -> Vec<u8> {
    let mut content = vec![0u8; BLOCK];
    for (index, word) in content.chunks_mut(8).enumerate() {
        let value = (round << 40) ^ (block << 16) ^ index as u64 ^ 0x5a5a;
        word.copy_from_slice(&value.to_le_bytes());
    }
    content
}

fn read_block(client: &NbdClient, block: u64) -> Vec<u8> {
    let mut back = vec![0u8; BLOCK];
    client.read(block * BLOCK as u64, &mut back).unwrap();
    back
}

fn home(dir: &std::path::Path, name: &str) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::create_dir_all(&path).unwrap();
    path
}

// Goal: a replica reads every write the writer flushed within follow + a few seconds, and
// never a write the writer holds only in memory; it never takes the lock, refuses writes, and
// /metrics says the roles, the lease's age and the replica's lag. Method: a writer (lease 3 s,
// write-back only at FLUSH) and `serve -r` with follow=1 s on one moto disk; rounds overwrite
// the same blocks (so the replica's cache holds the old ones) and FLUSH, then write a block
// without a FLUSH; the replica is polled until it reads the round's blocks, timed, and must
// read zeroes where only the unflushed write went.
#[test]
fn a_replica_reads_what_the_writer_flushed_within_follow_and_never_what_it_did_not() {
    let name = "a_replica_reads_what_the_writer_flushed_within_follow_and_never_what_it_did_not";
    if !have_moto(name) {
        return;
    }
    let _timer = Timer::new(name);
    let moto = Moto::start();
    moto.create_bucket("disks");
    let dir = temp_dir();
    let url = format!("s3://disks/vm?endpoint={}", moto.endpoint());
    let writer = Server::start(
        &home(dir.path(), "w"),
        "writer",
        &[
            "--backend",
            &format!("{url}&lease=3&create-size=1M&layout=log"),
            "--cache-size",
            "4M",
            "--dirty-age-max",
            "600",
            "--metrics",
            "127.0.0.1:0",
        ],
    );
    let replica = Server::start(
        &home(dir.path(), "r"),
        "replica",
        &[
            "-r",
            "--backend",
            &format!("{url}&follow={FOLLOW_SECONDS}"),
            "--metrics",
            "127.0.0.1:0",
        ],
    );
    let to_writer = NbdClient::connect(&writer.uri()).unwrap();
    let to_replica = NbdClient::connect(&replica.uri()).unwrap();
    // Each round's unflushed write goes to a block of its own (the next round's FLUSH covers it).
    let unflushed = |round: u64| 200 + round;
    let mut slowest = Duration::ZERO;
    for round in 1..=4u64 {
        // The replica's cache holds the previous round's blocks.
        for block in 0..8 {
            read_block(&to_replica, block);
        }
        for block in 0..8 {
            to_writer
                .write(block * BLOCK as u64, &tagged(round, block))
                .unwrap();
        }
        to_writer.flush().unwrap();
        let flushed = Instant::now();
        to_writer
            .write(
                unflushed(round) * BLOCK as u64,
                &tagged(round, unflushed(round)),
            )
            .unwrap();
        loop {
            if (0..8).all(|block| read_block(&to_replica, block) == tagged(round, block)) {
                break;
            }
            assert!(
                flushed.elapsed() < Duration::from_secs(FOLLOW_SECONDS + SLACK_SECONDS),
                "round {round}: the replica did not read the flushed writes within {} s",
                FOLLOW_SECONDS + SLACK_SECONDS
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        slowest = slowest.max(flushed.elapsed());
        assert!(
            read_block(&to_replica, unflushed(round))
                .iter()
                .all(|&byte| byte == 0),
            "round {round}: the replica read a write the writer never flushed"
        );
        if round > 1 {
            assert_eq!(
                read_block(&to_replica, unflushed(round - 1)),
                tagged(round - 1, unflushed(round - 1)),
                "round {round}: the previous round's write, flushed by this round, is not read"
            );
        }
    }
    println!("the replica read each round's flushed writes within {slowest:?} (follow {FOLLOW_SECONDS} s)");
    // Past a few more refreshes the unflushed write is still unseen.
    std::thread::sleep(Duration::from_secs(2 * FOLLOW_SECONDS));
    assert!(read_block(&to_replica, unflushed(4))
        .iter()
        .all(|&byte| byte == 0));

    // A replica asked to write refuses.
    assert!(to_replica.write(0, &tagged(9, 0)).is_err());
    let to_replica = NbdClient::connect(&replica.uri()).unwrap();

    let writer_metrics = scrape_log(&writer.log_text());
    let replica_metrics = scrape_log(&replica.log_text());
    assert_eq!(
        sample(
            &writer_metrics,
            "bufcache_store_role{export=\"\",role=\"writer\"}"
        ),
        1.0
    );
    assert_eq!(
        sample(
            &replica_metrics,
            "bufcache_store_role{export=\"\",role=\"replica\"}"
        ),
        1.0
    );
    assert_eq!(
        sample(
            &replica_metrics,
            "bufcache_store_role{export=\"\",role=\"writer\"}"
        ),
        0.0
    );
    let lease_age = sample(
        &writer_metrics,
        "bufcache_store_lease_age_seconds{export=\"\"}",
    );
    assert!((0.0..3.0).contains(&lease_age), "{lease_age}");
    let lag = sample(
        &replica_metrics,
        "bufcache_store_replica_lag_seconds{export=\"\"}",
    );
    assert!(
        (0.0..(FOLLOW_SECONDS + SLACK_SECONDS) as f64).contains(&lag),
        "{lag}"
    );
    // `/stats` (what `bufcache stat` shows) says the same.
    let stats = |log: &str| {
        use std::io::{Read, Write};
        let mut stream = std::net::TcpStream::connect(metrics_address(log)).unwrap();
        stream
            .write_all(b"GET /stats HTTP/1.0\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut text = String::new();
        stream.read_to_string(&mut text).unwrap();
        text
    };
    let replica_stats = stats(&replica.log_text());
    assert!(
        replica_stats.contains("\"role\":\"replica\""),
        "{replica_stats}"
    );
    let writer_stats = stats(&writer.log_text());
    assert!(
        writer_stats.contains("\"role\":\"writer\""),
        "{writer_stats}"
    );
    assert!(
        writer_stats.contains("\"lease_age_seconds\":"),
        "{writer_stats}"
    );
    drop(to_replica);
    drop(replica);
    // The writer still holds the lock alone: a clean stop releases it and the disk reopens
    // with every flushed write.
    let mut writer = writer;
    writer.stop_clean();
}

// Goal: requests for a replica that cannot be honoured are refused with a reason, changing
// nothing. Method: `follow=` on a writable server; `follow=` on a chunk-layout disk; a
// read-only server without `follow=` on a held log disk (the refusal names follow=).
#[test]
fn replica_requests_that_cannot_be_honoured_are_refused_with_a_reason() {
    let name = "replica_requests_that_cannot_be_honoured_are_refused_with_a_reason";
    if !have_moto(name) {
        return;
    }
    let _timer = Timer::new(name);
    let moto = Moto::start();
    moto.create_bucket("disks");
    let dir = temp_dir();
    let refused = |args: &[&str]| {
        let output = run_timeout(
            std::process::Command::new(bufcache_bin())
                .arg("serve")
                .args(args)
                .arg("--listen")
                .arg(format!(
                    "unix:{}",
                    dir.path().join("refused.sock").display()
                ))
                .current_dir(dir.path()),
            Duration::from_secs(60),
        );
        assert_eq!(output.status.code(), Some(2), "{}", output_text(&output));
        output_text(&output)
    };
    let chunk = format!(
        "s3://disks/chunk?endpoint={}&layout=chunk&create-size=1M",
        moto.endpoint()
    );
    let log = format!("s3://disks/log?endpoint={}", moto.endpoint());
    // A writable server asked to follow.
    let text = refused(&["--backend", &format!("{log}&create-size=1M&follow=1")]);
    assert!(
        text.contains("read replica") && text.contains("-r"),
        "{text}"
    );
    // A chunk disk (made by a writer that then stopped) cannot be followed.
    let mut maker = Server::start(&home(dir.path(), "m"), "maker", &["--backend", &chunk]);
    maker.stop_clean();
    let text = refused(&["-r", "--backend", &format!("{chunk}&follow=1")]);
    assert!(text.contains("log layout"), "{text}");
    // A read-only server without follow= beside a writer is told of follow=.
    let writer = Server::start(
        &home(dir.path(), "w"),
        "writer",
        &["--backend", &format!("{log}&create-size=1M&lease=3")],
    );
    let text = refused(&["-r", "--backend", &log]);
    assert!(text.contains("follow=SECONDS"), "{text}");
    drop(writer);
}
