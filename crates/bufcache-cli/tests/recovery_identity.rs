//! Goal: the documented recovery paths of an S3 disk never lose an acknowledged write and never
//! replay stale data (issue 45): a disk's identity is the id in its metadata object, not the
//! URL that reached it, a rescue file records the disk's generation it was saved against, and
//! a refused start changes nothing in the bucket. Method: real `bufcache serve` processes over
//! moto, a TCP proxy in front of it taken down to cut the store; the three reproductions of
//! the issue (a break-lock restart after a rescue, a local cache after kill -9, the log
//! layout's shutdown during an outage), each checked by reading every byte back and by
//! comparing the bucket's listing (keys, ETags, sizes) before and after each refused start.

mod common;
#[path = "../../bufcache-s3/tests/support/mod.rs"]
mod s3_support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use bufcache_nbd::NbdClient;
use common::*;
use s3_support::{have_moto, have_seaweedfs, FaultProxy, Moto, Proxy, S3Server, SeaweedFs};

const MIB: usize = 1 << 20;
/// Exit status of `bufcache serve` when dirty data went to the rescue file.
const EXIT_RESCUED: i32 = 3;
/// Rounds of each reproduction (the target: 20).
const ROUNDS: u64 = 20;

/// (key, ETag, size) of every object in bucket `bucket` of the store on `port`, read with an
/// unsigned ListObjectsV2 (moto does not check signatures), sorted by key.
fn listing(port: u16, bucket: &str) -> Vec<(String, String, u64)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        stream,
        "GET /{bucket}?list-type=2&max-keys=1000 HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n",
    )
    .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    assert!(answer.contains(" 200 "), "listing {bucket}: {answer}");
    assert!(
        !answer.contains("<IsTruncated>true"),
        "listing {bucket} is truncated"
    );
    let field = |object: &str, name: &str| -> String {
        let open = format!("<{name}>");
        let start = object.find(&open).map(|at| at + open.len()).unwrap_or(0);
        let end = object[start..]
            .find(&format!("</{name}>"))
            .map_or(start, |at| start + at);
        object[start..end].to_string()
    };
    let mut objects: Vec<(String, String, u64)> = answer
        .split("<Contents>")
        .skip(1)
        .map(|object| {
            (
                field(object, "Key"),
                field(object, "ETag"),
                field(object, "Size").parse().unwrap_or(u64::MAX),
            )
        })
        .collect();
    objects.sort();
    objects
}

/// Runs `bufcache serve ARGS` in `dir` expecting a refusal: exit status 2; returns its output.
fn serve_refused(dir: &Path, args: &[&str]) -> String {
    let output = run_timeout(
        Command::new(bufcache_bin())
            .arg("serve")
            .args(args)
            .arg("--listen")
            .arg(format!("unix:{}", dir.join("refused.sock").display()))
            .current_dir(dir),
        Duration::from_secs(60),
    );
    let text = output_text(&output);
    assert_eq!(output.status.code(), Some(2), "{args:?}: {text}");
    text
}

/// Asserts that a start with `args` is refused and leaves the bucket as it was; returns the
/// refusal.
fn refused_changing_nothing(port: u16, dir: &Path, args: &[&str]) -> String {
    let before = listing(port, "disks");
    let refusal = serve_refused(dir, args);
    assert_eq!(
        listing(port, "disks"),
        before,
        "a refused start changed the bucket: {refusal}"
    );
    refusal
}

/// The lock id a refusal names in its `break-lock=ID` advice.
fn lock_id_in(refusal: &str) -> String {
    let start = refusal
        .find("add break-lock=")
        .unwrap_or_else(|| panic!("no break-lock advice in: {refusal}"))
        + "add break-lock=".len();
    refusal[start..]
        .chars()
        .take_while(char::is_ascii_hexdigit)
        .collect()
}

/// The `bufcache-*.rescue` files in `dir`.
fn rescue_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| {
            let name = path.file_name().unwrap().to_string_lossy();
            name.starts_with("bufcache-") && name.ends_with(".rescue")
        })
        .collect();
    files.sort();
    files
}

fn read_at(server: &Server, offset: u64, length: usize) -> Vec<u8> {
    let client = NbdClient::connect(&server.uri()).unwrap();
    let mut back = vec![0u8; length];
    client.read(offset, &mut back).unwrap();
    back
}

/// A server that wrote `flushed` at `offset` and flushed, then wrote `rescued` there (and
/// elsewhere) with the store cut, and ended with exit 3 at SIGTERM, leaving one rescue file
/// named after the disk (not its URL's parameters) in `dir`.
fn rescue_with_the_store_cut(
    dir: &Path,
    proxy: &Proxy,
    url: &str,
    extra: &[&str],
    flushed: &[u8],
    rescued: &[u8],
    offset: u64,
) -> PathBuf {
    let mut args = vec!["--backend", url, "--create-size", "16M"];
    args.extend_from_slice(&["--shutdown-timeout", "2"]);
    args.extend_from_slice(extra);
    let mut server = Server::start(dir, "first", &args);
    let client = NbdClient::connect(&server.uri()).unwrap();
    client.write(offset, flushed).unwrap();
    client.flush().expect("FLUSH with the store up");
    proxy.set_down(true);
    client.write(offset, rescued).unwrap();
    drop(client);
    let status = server.terminate(Duration::from_secs(60));
    assert_eq!(
        status.code(),
        Some(EXIT_RESCUED),
        "SIGTERM with the store cut:\n{}",
        server.log_text()
    );
    proxy.set_down(false);
    let files = rescue_files(dir);
    assert_eq!(files.len(), 1, "{files:?}:\n{}", server.log_text());
    let name = files[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        !name.contains("create-size") && !name.contains("retry") && !name.contains("endpoint"),
        "rescue file named from the URL's parameters: {name}"
    );
    files[0].clone()
}

// Goal: reproduction 1 of issue 45 — the documented `break-lock=` restart after a rescue
// replays the rescue file, and a rescue file whose disk moved on is refused (kept, the bucket
// untouched) instead of being replayed over newer data; `--rescue force` replays it when
// asked. Method: per round, a chunk-layout disk behind a proxy; 0x11 flushed, the store cut,
// 0x77 acknowledged, SIGTERM (exit 3). Path A: restart in the same directory with
// `break-lock=ID` (and a different retry timeout): offset 0 reads 0x77, the file is gone.
// Path B: a server elsewhere (no rescue file) breaks the lock and flushes 0x99; the restart in
// the first directory is refused (exit 2), the file kept, listing and ETags unchanged; a
// server reads 0x99; then `--rescue force` replays 0x77.
#[test]
fn a_rescue_file_is_replayed_after_break_lock_and_never_over_newer_data() {
    let name = "a_rescue_file_is_replayed_after_break_lock_and_never_over_newer_data";
    if !have_moto(name) {
        return;
    }
    let _timer = Timer::new(name);
    let moto = Moto::start();
    moto.create_bucket("disks");
    let (lost_writes, stale_replays) = break_lock_restart_rounds(moto.port, ROUNDS);
    assert_eq!(
        (lost_writes, stale_replays),
        (0, 0),
        "acknowledged writes lost, stale replays"
    );
}

// Goal: a start that replays a rescue file but cannot write it back (the store failing
// every PUT of the block's chunk) keeps the file, and the next start replays it: the failed
// start raised the disk's generation, and the file records the raised one instead of being
// refused as saved before the disk moved on. Method: a rescue file made with the store cut
// (chunk layout); a break-lock start through a proxy answering every PUT of chunk 0 with 500
// fails; the start after it, on the plain endpoint, reads back the rescued bytes.
#[test]
fn a_replay_that_cannot_write_back_keeps_the_rescue_file_replayable() {
    let name = "a_replay_that_cannot_write_back_keeps_the_rescue_file_replayable";
    if !have_moto(name) {
        return;
    }
    let _timer = Timer::new(name);
    let moto = Moto::start();
    moto.create_bucket("disks");
    let proxy = Proxy::start(moto.port);
    let dir = temp_dir();
    let url = |endpoint: &str| {
        format!("s3://disks/replay?endpoint={endpoint}&layout=chunk&chunk-size=1M&retry-timeout-ms=1000")
    };
    let flushed = vec![0x11; 64 << 10];
    let rescued = random_bytes(64 << 10, 45);
    let rescue = rescue_with_the_store_cut(
        dir.path(),
        &proxy,
        &url(&proxy.endpoint()),
        &[],
        &flushed,
        &rescued,
        0,
    );
    let refusal = refused_changing_nothing(
        moto.port,
        dir.path(),
        &["--backend", &url(&proxy.endpoint())],
    );
    let lock_id = lock_id_in(&refusal);
    let failing = FaultProxy::start(moto.port, "chunks/0000000000000000", 100_000);
    let output = run_timeout(
        Command::new(bufcache_bin())
            .args(["serve", "--backend"])
            .arg(format!("{}&break-lock={lock_id}", url(&failing.endpoint())))
            .arg("--listen")
            .arg(format!(
                "unix:{}",
                dir.path().join("failing.sock").display()
            ))
            .current_dir(dir.path()),
        Duration::from_secs(120),
    );
    let text = output_text(&output);
    assert!(
        !output.status.success(),
        "the replay wrote back through a failing store: {text}"
    );
    assert!(text.contains("writing its data back failed"), "{text}");
    assert!(
        rescue.exists(),
        "the rescue file is gone after a failed replay"
    );
    drop(failing);
    let mut backend = url(&moto.endpoint());
    if let Some(holder) = lock_holder_id(&backend) {
        backend = format!("{backend}&break-lock={holder}");
    }
    let mut server = Server::start(dir.path(), "after", &["--backend", &backend]);
    assert_same_bytes(
        &rescued,
        &read_at(&server, 0, rescued.len()),
        "after the failed replay",
    );
    assert!(!rescue.exists(), "the replayed rescue file is still there");
    server.stop_clean();
}

/// The id of the lock held on the disk `url` names, from `bufcache disk info --json`; None
/// when nothing holds it.
fn lock_holder_id(url: &str) -> Option<String> {
    let output = run_ok(
        Command::new(bufcache_bin()).args(["disk", "info", url, "--json"]),
        Duration::from_secs(60),
    );
    let info: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    info["lock"]["id"].as_str().map(str::to_string)
}

/// Rounds of reproduction 1 on the store at `port` (bucket `disks`): (acknowledged writes
/// lost, stale replays).
fn break_lock_restart_rounds(port: u16, rounds: u64) -> (u32, u32) {
    let proxy = Proxy::start(port);
    let mut lost_writes = 0;
    let mut stale_replays = 0;
    for round in 0..rounds {
        let dir = temp_dir();
        let url = format!(
            "s3://disks/r{round}?endpoint={}&layout=chunk&chunk-size=1M&retry-timeout-ms=1000",
            proxy.endpoint()
        );
        let flushed = vec![0x11; 64 << 10];
        let rescued = random_bytes(64 << 10, round);
        let rescue =
            rescue_with_the_store_cut(dir.path(), &proxy, &url, &[], &flushed, &rescued, 0);
        let refusal = refused_changing_nothing(port, dir.path(), &["--backend", &url]);
        let lock_id = lock_id_in(&refusal);
        let url_break = format!("{url}&break-lock={lock_id}");
        if round % 2 == 0 {
            // Path A: the documented restart, spelled with other opening parameters.
            let restarted = url_break.replace("retry-timeout-ms=1000", "retry-timeout-ms=2000");
            let mut server = Server::start(dir.path(), "restart", &["--backend", &restarted]);
            if read_at(&server, 0, rescued.len()) != rescued {
                lost_writes += 1;
            }
            assert!(!rescue.exists(), "the replayed rescue file is still there");
            server.stop_clean();
        } else {
            // Path B: another server moves the disk on; the rescue file is now stale.
            let elsewhere = temp_dir();
            let newer = vec![0x99; 64 << 10];
            let mut other = Server::start(elsewhere.path(), "other", &["--backend", &url_break]);
            let client = NbdClient::connect(&other.uri()).unwrap();
            client.write(0, &newer).unwrap();
            client.flush().unwrap();
            drop(client);
            other.stop_clean();
            let saved = std::fs::read(&rescue).unwrap();
            let refusal = refused_changing_nothing(port, dir.path(), &["--backend", &url]);
            assert!(
                refusal.contains("moved on") && refusal.contains("--rescue force"),
                "{refusal}"
            );
            assert!(
                !refusal.to_lowercase().contains("delete"),
                "the refusal advises deleting: {refusal}"
            );
            assert_eq!(
                std::fs::read(&rescue).unwrap(),
                saved,
                "the refused rescue file changed"
            );
            let mut reader = Server::start(
                dir.path(),
                "reader",
                &["--backend", &url, "--rescue-file", "elsewhere.rescue"],
            );
            if read_at(&reader, 0, newer.len()) != newer {
                stale_replays += 1;
            }
            reader.stop_clean();
            let mut forced = Server::start(
                dir.path(),
                "forced",
                &["--backend", &url, "--rescue", "force"],
            );
            assert_same_bytes(
                &rescued,
                &read_at(&forced, 0, rescued.len()),
                "--rescue force",
            );
            forced.stop_clean();
        }
    }
    (lost_writes, stale_replays)
}

// Goal: reproduction 2 of issue 45 — a local cache holding flushed writes not yet on S3
// reattaches after kill -9 through the documented restart (no `create-size=`, `break-lock=`
// added), and the start refused for the lock leaves the bucket and the cache untouched.
// Method: per round, a chunk-layout disk behind a proxy that is cut, a local cache with
// --flush-to local, data written and flushed (durable locally only), kill -9; with the store
// back, the restart without break-lock is refused (exit 2) with listing, ETags and the cache
// file unchanged, and so is one with break-lock and another --local-cache-size (the lock is
// not broken); the restart with break-lock reads every byte, and after a clean stop a fresh
// server without the cache reads them from the bucket.
#[test]
fn a_local_cache_reattaches_after_kill_9_through_the_break_lock_restart() {
    let name = "a_local_cache_reattaches_after_kill_9_through_the_break_lock_restart";
    if !have_moto(name) {
        return;
    }
    let _timer = Timer::new(name);
    let moto = Moto::start();
    moto.create_bucket("disks");
    assert_eq!(
        local_cache_kill_9_rounds(moto.port, ROUNDS),
        0,
        "acknowledged writes lost"
    );
}

/// Reproduction 2's rounds against the store on `port` (bucket `disks` made): the count of
/// acknowledged writes lost.
fn local_cache_kill_9_rounds(port: u16, rounds: u64) -> u32 {
    let proxy = Proxy::start(port);
    let mut lost_writes = 0;
    for round in 0..rounds {
        let dir = temp_dir();
        let url = format!(
            "s3://disks/t{round}?endpoint={}&layout=chunk&chunk-size=1M&retry-timeout-ms=1000",
            proxy.endpoint()
        );
        let tier = ["--local-cache", "tier.img", "--flush-to", "local"];
        let mut args = vec!["--backend", &url, "--create-size", "16M"];
        args.extend_from_slice(&tier);
        args.extend_from_slice(&["--local-cache-size", "64M"]);
        let mut first = Server::start(dir.path(), "first", &args);
        proxy.set_down(true);
        let data = random_bytes(3 * MIB, 100 + round);
        let client = NbdClient::connect(&first.uri()).unwrap();
        client.write(MIB as u64, &data).unwrap();
        client.flush().expect("FLUSH to the local cache");
        drop(client);
        first.kill9();
        let cache_before = std::fs::read(dir.path().join("tier.img")).unwrap();
        proxy.set_down(false);
        let mut restart = vec!["--backend", &url];
        restart.extend_from_slice(&tier);
        let refusal = refused_changing_nothing(port, dir.path(), &restart);
        assert!(
            std::fs::read(dir.path().join("tier.img")).unwrap() == cache_before,
            "the refused start changed the local cache"
        );
        let url_break = format!("{url}&break-lock={}", lock_id_in(&refusal));
        let mut restart = vec!["--backend", url_break.as_str()];
        restart.extend_from_slice(&tier);
        let mut resized = restart.clone();
        resized.extend_from_slice(&["--local-cache-size", "32M"]);
        let refusal = refused_changing_nothing(port, dir.path(), &resized);
        assert!(refusal.contains("asked for"), "{refusal}");
        let mut second = Server::start(dir.path(), "second", &restart);
        if read_at(&second, MIB as u64, data.len()) != data {
            lost_writes += 1;
        }
        second.stop_clean();
        let mut plain = Server::start(dir.path(), "plain", &["--backend", &url]);
        if read_at(&plain, MIB as u64, data.len()) != data {
            lost_writes += 1;
        }
        plain.stop_clean();
    }
    lost_writes
}

// Goal: reproduction 3 of issue 45 — the log layout (the default) keeps what it acknowledged
// at a shutdown that cannot reach the store: the data only in its unuploaded segments goes to
// the rescue file (exit 3) and the break-lock restart replays it. Method: per round, a
// log-layout disk behind a proxy; data flushed, the store cut, newer data written
// (acknowledged), SIGTERM with a 2 s shutdown timeout: exit 3 and a rescue file; the restart
// with `break-lock=ID` and the store back reads the newer data, and so does a fresh server
// after a clean stop (so it reached the bucket).
#[test]
fn the_log_layout_saves_unuploaded_segments_to_the_rescue_file_at_shutdown() {
    let name = "the_log_layout_saves_unuploaded_segments_to_the_rescue_file_at_shutdown";
    if !have_moto(name) {
        return;
    }
    let _timer = Timer::new(name);
    let moto = Moto::start();
    moto.create_bucket("disks");
    assert_eq!(
        log_layout_shutdown_rounds(moto.port, ROUNDS),
        0,
        "acknowledged writes lost"
    );
}

/// Reproduction 3's rounds against the store on `port` (bucket `disks` made): the count of
/// acknowledged writes lost.
fn log_layout_shutdown_rounds(port: u16, rounds: u64) -> u32 {
    let proxy = Proxy::start(port);
    let mut lost_writes = 0;
    for round in 0..rounds {
        let dir = temp_dir();
        // lease=off: the documented restart of a disk whose lock has no lease, `break-lock=`
        // (with a lease, the restart takes the lapsed lock over by itself: s3_takeover.rs).
        let url = format!(
            "s3://disks/l{round}?endpoint={}&retry-timeout-ms=1000&lease=off",
            proxy.endpoint()
        );
        let flushed = random_bytes(MIB, 200 + round);
        let rescued = random_bytes(MIB, 300 + round);
        let rescue =
            rescue_with_the_store_cut(dir.path(), &proxy, &url, &[], &flushed, &rescued, 4096);
        let refusal = refused_changing_nothing(port, dir.path(), &["--backend", &url]);
        let url_break = format!("{url}&break-lock={}", lock_id_in(&refusal));
        let mut server = Server::start(dir.path(), "restart", &["--backend", &url_break]);
        if read_at(&server, 4096, rescued.len()) != rescued {
            lost_writes += 1;
        }
        assert!(!rescue.exists(), "the replayed rescue file is still there");
        server.stop_clean();
        let mut plain = Server::start(dir.path(), "plain", &["--backend", &url]);
        if read_at(&plain, 4096, rescued.len()) != rescued {
            lost_writes += 1;
        }
        plain.stop_clean();
    }
    lost_writes
}

/// Deletes every object of every bucket (moto's reset API, unsigned) and makes bucket
/// `bucket` again, empty: the disks in it are gone.
fn empty_the_store(moto: &Moto, bucket: &str) {
    let mut stream = TcpStream::connect(("127.0.0.1", moto.port)).unwrap();
    write!(
        stream,
        "POST /moto-api/reset HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        moto.port
    )
    .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    assert!(answer.contains(" 200 "), "resetting moto: {answer}");
    moto.create_bucket(bucket);
}

// Goal: a disk deleted and made again at the same URL is another disk: the local cache of the
// old one is refused before anything is written (the new disk is not even created), and a
// fresh cache then serves the new disk's zeroes, not the old data. Method: a chunk-layout
// disk served with a local cache, data written and flushed, clean stop; the bucket deleted
// (moto reset) and made again, empty; the start with the same URL, create size and cache is
// refused (exit 2) with the bucket still empty and the cache file unchanged; a start with
// another cache path reads zeroes where the old data was.
#[test]
fn a_disk_made_again_at_the_same_url_does_not_get_the_old_local_cache() {
    let name = "a_disk_made_again_at_the_same_url_does_not_get_the_old_local_cache";
    if !have_moto(name) {
        return;
    }
    let _timer = Timer::new(name);
    let moto = Moto::start();
    moto.create_bucket("disks");
    let dir = temp_dir();
    let url = format!(
        "s3://disks/again?endpoint={}&layout=chunk&chunk-size=1M",
        moto.endpoint()
    );
    let args = [
        "--backend",
        &url,
        "--create-size",
        "16M",
        "--local-cache",
        "tier.img",
        "--local-cache-size",
        "64M",
    ];
    let mut first = Server::start(dir.path(), "first", &args);
    let data = random_bytes(MIB, 400);
    let client = NbdClient::connect(&first.uri()).unwrap();
    client.write(0, &data).unwrap();
    client.flush().unwrap();
    drop(client);
    first.stop_clean();
    empty_the_store(&moto, "disks");
    assert!(listing(moto.port, "disks").is_empty());
    let cache_before = std::fs::read(dir.path().join("tier.img")).unwrap();
    let refusal = refused_changing_nothing(moto.port, dir.path(), &args);
    assert!(
        refusal.contains("tier.img") && !refusal.to_lowercase().contains("delete"),
        "{refusal}"
    );
    assert!(
        std::fs::read(dir.path().join("tier.img")).unwrap() == cache_before,
        "the refused start changed the local cache"
    );
    let mut fresh = Server::start(
        dir.path(),
        "fresh",
        &[
            "--backend",
            &url,
            "--create-size",
            "16M",
            "--local-cache",
            "tier2.img",
            "--local-cache-size",
            "64M",
        ],
    );
    assert_same_bytes(&vec![0u8; MIB], &read_at(&fresh, 0, MIB), "the new disk");
    fresh.stop_clean();
}

/// A rescue file of the second format (`BUFCACHE-RESCUE2`), as older servers wrote it: one
/// backend named by `identity` (its URL), one record of `data` at `offset`.
fn second_format_rescue_file(
    path: &Path,
    identity: &str,
    size_bytes: u64,
    offset: u64,
    data: &[u8],
) {
    let text = |bytes: &mut Vec<u8>, text: &str| {
        bytes.extend_from_slice(&(text.len() as u32).to_le_bytes());
        bytes.extend_from_slice(text.as_bytes());
    };
    let mut bytes = b"BUFCACHE-RESCUE2".to_vec();
    bytes.extend_from_slice(&1u32.to_le_bytes());
    text(&mut bytes, "");
    text(&mut bytes, identity);
    bytes.extend_from_slice(&size_bytes.to_le_bytes());
    bytes.extend_from_slice(&4096u32.to_le_bytes());
    let crc = crc32(&bytes[16..]);
    bytes.extend_from_slice(&crc.to_le_bytes());
    let start = bytes.len();
    text(&mut bytes, "");
    bytes.extend_from_slice(&offset.to_le_bytes());
    bytes.extend_from_slice(&(data.len() as u32).to_le_bytes());
    bytes.extend_from_slice(data);
    let crc = crc32(&bytes[start..]);
    bytes.extend_from_slice(&crc.to_le_bytes());
    std::fs::write(path, bytes).unwrap();
}

/// CRC-32 (IEEE), bit by bit: the rescue file's checksum.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in bytes {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xedb8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

// Goal: a rescue file and a local cache made by an older bufcache, which named an S3 disk by
// its URL (parameters included), are never lost: the rescue file under its older name refuses
// the start naming the command that replays it, that command without `--rescue force` is
// refused too (the file records no generation), with it the data is replayed; the local cache
// is matched by bucket and prefix and its superblock given the disk's id. Every refused start
// leaves the bucket and the files as they were. Method: a disk made by a server; a local
// cache made through the tier crate with the URL as its identity; a second-format rescue file
// written by hand under a name made from the query string; then the starts above, reading the
// rescued bytes back, and a last start with the cache alone.
#[test]
fn older_rescue_files_and_local_caches_named_by_url_are_migrated_not_lost() {
    let name = "older_rescue_files_and_local_caches_named_by_url_are_migrated_not_lost";
    if !have_moto(name) {
        return;
    }
    let _timer = Timer::new(name);
    let moto = Moto::start();
    moto.create_bucket("disks");
    let dir = temp_dir();
    let url = format!(
        "s3://disks/old?endpoint={}&layout=chunk&chunk-size=1M",
        moto.endpoint()
    );
    let size_bytes = 16 << 20;
    let mut maker = Server::start(
        dir.path(),
        "maker",
        &["--backend", &url, "--create-size", "16M"],
    );
    maker.stop_clean();
    let older_identity = format!("{url}&create-size=16M&retry-timeout-ms=1000");
    let tier_path = dir.path().join("tier.img");
    let tier = bufcache_tier::LocalTier::open_path(
        &tier_path,
        Some(64 << 20),
        bufcache::MemoryDevice::new(size_bytes),
        &older_identity,
        bufcache_tier::LocalTierConfig::default(),
    )
    .unwrap();
    drop(tier);
    let older_name = "bufcache-old_create-size_16M_retry-timeout-ms_-00112233445566ff.rescue";
    let rescued = random_bytes(64 << 10, 500);
    second_format_rescue_file(
        &dir.path().join(older_name),
        &older_identity,
        size_bytes,
        8192,
        &rescued,
    );
    let files_before = (
        std::fs::read(&tier_path).unwrap(),
        std::fs::read(dir.path().join(older_name)).unwrap(),
    );
    let files_now = || {
        (
            std::fs::read(&tier_path).unwrap(),
            std::fs::read(dir.path().join(older_name)).unwrap(),
        )
    };
    let refusal = refused_changing_nothing(
        moto.port,
        dir.path(),
        &["--backend", &url, "--local-cache", "tier.img"],
    );
    assert!(
        refusal.contains(&format!("--rescue-file {older_name}")),
        "{refusal}"
    );
    assert!(
        files_now() == files_before,
        "a refused start changed a file"
    );
    let refusal = refused_changing_nothing(
        moto.port,
        dir.path(),
        &[
            "--backend",
            &url,
            "--local-cache",
            "tier.img",
            "--rescue-file",
            older_name,
        ],
    );
    assert!(refusal.contains("--rescue force"), "{refusal}");
    assert!(
        files_now() == files_before,
        "a refused start changed a file"
    );
    let mut replayed = Server::start(
        dir.path(),
        "replayed",
        &[
            "--backend",
            &url,
            "--local-cache",
            "tier.img",
            "--rescue-file",
            older_name,
            "--rescue",
            "force",
        ],
    );
    assert_same_bytes(
        &rescued,
        &read_at(&replayed, 8192, rescued.len()),
        "replayed",
    );
    assert!(
        replayed
            .log_text()
            .contains("now named by the disk's identity"),
        "{}",
        replayed.log_text()
    );
    assert!(!dir.path().join(older_name).exists());
    replayed.stop_clean();
    let mut again = Server::start(
        dir.path(),
        "again",
        &["--backend", &url, "--local-cache", "tier.img"],
    );
    assert_same_bytes(&rescued, &read_at(&again, 8192, rescued.len()), "again");
    again.stop_clean();
}

/// Runs `bufcache serve ARGS` in `dir` expecting it to fail at start (any status but 0, and
/// not the rescue's 3), and asserts the bucket's listing (keys, ETags, sizes) and the file
/// `rescue` (a rescue file or a local cache) are byte for byte as before; returns its output.
fn failed_start_changing_nothing(port: u16, dir: &Path, rescue: &Path, args: &[&str]) -> String {
    let listing_before = listing(port, "disks");
    let rescue_before = std::fs::read(rescue).ok();
    let output = run_timeout(
        Command::new(bufcache_bin())
            .arg("serve")
            .args(args)
            .arg("--listen")
            .arg(format!("unix:{}", dir.join("failing.sock").display()))
            .current_dir(dir),
        Duration::from_secs(60),
    );
    let text = output_text(&output);
    assert!(
        !output.status.success() && output.status.code() != Some(EXIT_RESCUED),
        "{args:?} started: {text}"
    );
    assert_eq!(
        listing(port, "disks"),
        listing_before,
        "a failed start changed the bucket: {args:?}: {text}"
    );
    assert!(
        std::fs::read(rescue).ok() == rescue_before,
        "a failed start changed {}: {args:?}: {text}",
        rescue.display()
    );
    text
}

// Goal: issue 45 item 3 — a start that would open an S3 disk for writing and then fail
// elsewhere (a later export that does not open, a listen or metrics address already in use, a
// pid file that cannot be written, an io queue out of range, a control socket another server
// answers on) changes nothing: no broken lock, no new generation, no
// epoch or checkpoint in the bucket, and the disk's rescue file is not made stale, so the
// next correct start replays it. Method: a rescue file of export `a` on a chunk-layout disk
// over moto, made with the store cut (exit 3); the documented restart (`break-lock=ID`)
// tried six ways that each fail after the disk would be opened — a second export naming a
// missing file, a TCP listen port and a metrics port held by this test, a pid file in a
// missing directory, `--io-queue-depth 0`, a `--control` socket this test answers on — each
// leaving the listing, ETags and rescue file byte-identical; then
// the correct restart replays the rescue file (the rescued bytes read back, the file gone).
#[test]
fn a_start_that_fails_after_its_s3_disk_would_open_changes_no_store_and_keeps_the_rescue_replayable(
) {
    let name = "a_start_that_fails_after_its_s3_disk_would_open_changes_no_store_and_keeps_the_rescue_replayable";
    if !have_moto(name) {
        return;
    }
    let _timer = Timer::new(name);
    let moto = Moto::start();
    moto.create_bucket("disks");
    let proxy = Proxy::start(moto.port);
    let dir = temp_dir();
    let url = |endpoint: &str| {
        format!(
            "s3://disks/order?endpoint={endpoint}&layout=chunk&chunk-size=1M&retry-timeout-ms=1000"
        )
    };
    let flushed = vec![0x11; 64 << 10];
    let rescued = random_bytes(64 << 10, 46);
    let first_export = format!("a={}", url(&proxy.endpoint()));
    let mut server = Server::start(
        dir.path(),
        "first",
        &[
            "--export",
            &first_export,
            "--create-size",
            "16M",
            "--shutdown-timeout",
            "2",
        ],
    );
    let client = NbdClient::connect(&server.uri_of("a")).unwrap();
    client.write(0, &flushed).unwrap();
    client.flush().expect("FLUSH with the store up");
    proxy.set_down(true);
    client.write(0, &rescued).unwrap();
    drop(client);
    let status = server.terminate(Duration::from_secs(60));
    assert_eq!(status.code(), Some(EXIT_RESCUED), "{}", server.log_text());
    proxy.set_down(false);
    let files = rescue_files(dir.path());
    assert_eq!(files.len(), 1, "{files:?}");
    let rescue = files[0].clone();

    let refusal = refused_changing_nothing(
        moto.port,
        dir.path(),
        &["--export", &format!("a={}", url(&moto.endpoint()))],
    );
    let restart = format!(
        "a={}&break-lock={}",
        url(&moto.endpoint()),
        lock_id_in(&refusal)
    );
    let missing = format!("b={}", dir.path().join("missing.img").display());
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let busy_address = busy.local_addr().unwrap().to_string();
    let busy_listen = format!("tcp:{busy_address}");
    let pid_file = dir.path().join("no-such-directory").join("serve.pid");
    let control = dir.path().join("control.sock");
    let _answering = std::os::unix::net::UnixListener::bind(&control).unwrap();
    let failures: [(&str, Vec<&str>); 6] = [
        (
            "a later export",
            vec!["--export", &restart, "--export", &missing],
        ),
        (
            "a listen address in use",
            vec!["--export", &restart, "--listen", &busy_listen],
        ),
        (
            "a metrics address in use",
            vec!["--export", &restart, "--metrics", &busy_address],
        ),
        (
            "a pid file that cannot be written",
            vec![
                "--export",
                &restart,
                "--pid-file",
                pid_file.to_str().unwrap(),
            ],
        ),
        (
            "an io queue out of range",
            vec![
                "--export",
                &restart,
                "--io-queue",
                "elevator",
                "--io-queue-depth",
                "0",
            ],
        ),
        (
            "a control socket another server answers on",
            vec!["--export", &restart, "--control", control.to_str().unwrap()],
        ),
    ];
    for (what, args) in &failures {
        let text = failed_start_changing_nothing(moto.port, dir.path(), &rescue, args);
        println!("{name}: {what}: {}", text.trim());
    }
    drop(busy);

    let mut server = Server::start(dir.path(), "restart", &["--export", &restart]);
    let client = NbdClient::connect(&server.uri_of("a")).unwrap();
    let mut back = vec![0u8; rescued.len()];
    client.read(0, &mut back).unwrap();
    drop(client);
    assert_same_bytes(
        &rescued,
        &back,
        "the rescue file replayed after the failed starts",
    );
    assert!(!rescue.exists(), "the replayed rescue file is still there");
    server.stop_clean();
}

/// Rounds of each reproduction on SeaweedFS: the 20, or SEAWEEDFS_ROUNDS.
fn seaweedfs_rounds() -> u64 {
    std::env::var("SEAWEEDFS_ROUNDS")
        .ok()
        .and_then(|rounds| rounds.parse().ok())
        .unwrap_or(ROUNDS)
}

/// A SeaweedFS store (`weed server -s3`) with bucket `disks`, or None when `weed` is missing.
fn seaweedfs_with_disks(test: &str) -> Option<SeaweedFs> {
    if !have_seaweedfs(test) {
        return None;
    }
    let store = SeaweedFs::start();
    store.create_bucket("disks");
    Some(store)
}

// Goal: reproduction 1 of issue 45 on a real distributed store: the break-lock restart
// replays the rescue file and a rescue file whose disk moved on is refused (kept, the bucket
// untouched). Method: the rounds of the moto test (`break_lock_restart_rounds`) against
// SeaweedFS behind the proxy.
#[test]
fn a_rescue_file_is_replayed_after_break_lock_and_never_over_newer_data_on_seaweedfs() {
    let name = "a_rescue_file_is_replayed_after_break_lock_and_never_over_newer_data_on_seaweedfs";
    let Some(store) = seaweedfs_with_disks(name) else {
        return;
    };
    let _timer = Timer::new(name);
    assert_eq!(
        break_lock_restart_rounds(store.port, seaweedfs_rounds()),
        (0, 0),
        "acknowledged writes lost, stale replays"
    );
}

// Goal: reproduction 2 of issue 45 on SeaweedFS: a local cache holding flushed writes not yet
// on the store reattaches after kill -9 through the break-lock restart, and the refused
// starts leave bucket and cache untouched. Method: `local_cache_kill_9_rounds` against
// SeaweedFS behind the proxy.
#[test]
fn a_local_cache_reattaches_after_kill_9_through_the_break_lock_restart_on_seaweedfs() {
    let name = "a_local_cache_reattaches_after_kill_9_through_the_break_lock_restart_on_seaweedfs";
    let Some(store) = seaweedfs_with_disks(name) else {
        return;
    };
    let _timer = Timer::new(name);
    assert_eq!(
        local_cache_kill_9_rounds(store.port, seaweedfs_rounds()),
        0,
        "acknowledged writes lost"
    );
}

// Goal: reproduction 3 of issue 45 on SeaweedFS: the log layout saves the data of its
// unuploaded segments to the rescue file at a shutdown that cannot reach the store, and the
// break-lock restart replays it. Method: `log_layout_shutdown_rounds` against SeaweedFS behind
// the proxy.
#[test]
fn the_log_layout_saves_unuploaded_segments_to_the_rescue_file_at_shutdown_on_seaweedfs() {
    let name =
        "the_log_layout_saves_unuploaded_segments_to_the_rescue_file_at_shutdown_on_seaweedfs";
    let Some(store) = seaweedfs_with_disks(name) else {
        return;
    };
    let _timer = Timer::new(name);
    assert_eq!(
        log_layout_shutdown_rounds(store.port, seaweedfs_rounds()),
        0,
        "acknowledged writes lost"
    );
}

// Goal: issue 45 item 3 with a local cache over S3 — a local cache whose log holds a damaged
// record that later records prove was fsynced refuses the start before the S3 disk is opened
// for writing: no broken lock, no new generation, nothing in the bucket or the cache changed.
// Method: a chunk-layout disk over moto behind a proxy, a local cache with --flush-to local;
// with the store cut, three writes each flushed (held only in the cache's log), kill -9; one
// byte of the first record's payload flipped; the restart with the lock's `break-lock=ID`
// fails naming the damage, with listing, ETags and the cache byte-identical and the lock held.
#[test]
fn a_damaged_local_cache_refuses_the_start_before_its_s3_disk_is_opened_for_writing() {
    let name = "a_damaged_local_cache_refuses_the_start_before_its_s3_disk_is_opened_for_writing";
    if !have_moto(name) {
        return;
    }
    let _timer = Timer::new(name);
    let moto = Moto::start();
    moto.create_bucket("disks");
    let proxy = Proxy::start(moto.port);
    let dir = temp_dir();
    let url = format!(
        "s3://disks/damaged?endpoint={}&layout=chunk&chunk-size=1M&retry-timeout-ms=1000",
        proxy.endpoint()
    );
    let tier = ["--local-cache", "tier.img", "--flush-to", "local"];
    let mut args = vec!["--backend", &url, "--create-size", "16M"];
    args.extend_from_slice(&tier);
    args.extend_from_slice(&["--local-cache-size", "64M"]);
    let mut first = Server::start(dir.path(), "first", &args);
    proxy.set_down(true);
    let client = NbdClient::connect(&first.uri()).unwrap();
    for index in 0..3u64 {
        client
            .write(index * MIB as u64, &vec![0x21 + index as u8; 64 << 10])
            .unwrap();
        client.flush().expect("FLUSH to the local cache");
    }
    drop(client);
    first.kill9();
    proxy.set_down(false);
    // The first record: the log starts at 8 KiB, a record's payload after its 64-byte header.
    let cache = dir.path().join("tier.img");
    let mut bytes = std::fs::read(&cache).unwrap();
    bytes[8192 + 64 + 10] ^= 0xFF;
    std::fs::write(&cache, &bytes).unwrap();
    let holder = lock_holder_id(&url).expect("the killed server's lock is held");
    let url_break = format!("{url}&break-lock={holder}");
    let mut restart = vec!["--backend", url_break.as_str()];
    restart.extend_from_slice(&tier);
    let text = failed_start_changing_nothing(moto.port, dir.path(), &cache, &restart);
    assert!(text.contains("is damaged"), "{text}");
    assert_eq!(
        lock_holder_id(&url),
        Some(holder),
        "the refused start broke the lock"
    );
}
