//! Leases through real `bufcache serve` processes on one moto disk (docs/s3.md, "Leases and
//! takeover"): a server started on a disk whose writer was killed takes it over once the lease
//! lapsed, without `break-lock=` and without losing a FLUSH-acknowledged write; a writer frozen
//! (SIGSTOP) past its lease while another server takes the disk acknowledges nothing after it
//! resumes; a writer cut off from the store stops acknowledging before a standby takes over.

mod common;
#[path = "../../bufcache-s3/tests/support/mod.rs"]
mod s3_support;

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bufcache_nbd::NbdClient;
use common::*;
use s3_support::{have_moto, Moto, Proxy};

const BLOCK: usize = 4096;
const BLOCKS: u64 = 256;
/// The lease the servers run with, in seconds.
const LEASE_SECONDS: u64 = 2;
const SIGSTOP: i32 = 19;
const SIGCONT: i32 = 18;

/// A block tagged with the round and write that wrote it, so a read names its origin.
fn tagged(round: u64, write: u64, block: u64) -> Vec<u8> {
    let mut content = vec![0u8; BLOCK];
    for (index, word) in content.chunks_mut(8).enumerate() {
        let value = (round << 48) ^ (write << 20) ^ (block << 4) ^ index as u64;
        word.copy_from_slice(&value.to_le_bytes());
    }
    content
}

fn serve_args(url: &str) -> Vec<&str> {
    vec![
        "--backend",
        url,
        "--cache-size",
        "4M",
        // Write-back only at FLUSH: what was not flushed stays in the killed server's cache.
        "--dirty-age-max",
        "600",
    ]
}

/// A directory of its own for one server, as on a machine of its own (a rescue file is per
/// machine).
fn home(dir: &std::path::Path, name: &str) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::create_dir_all(&path).unwrap();
    path
}

fn read_block(client: &NbdClient, block: u64) -> Vec<u8> {
    let mut back = vec![0u8; BLOCK];
    client.read(block * BLOCK as u64, &mut back).unwrap();
    back
}

// Goal: after kill -9 of the writer a new server (same URL, no break-lock=) serves writes
// within lease + 5 s, and no write a FLUSH acknowledged is lost. Method: rounds on one moto
// disk (lease 2 s): the current server gets tagged writes with a FLUSH every 8, then more
// writes without a FLUSH, and is killed with SIGKILL; the next server is started at once and
// timed until it accepts and a WRITE and a FLUSH succeed; it must hold the newest flushed
// write of every block. TAKEOVER_ROUNDS sets the rounds (default 3; `TAKEOVER_ROUNDS=50` is
// the long form).
#[test]
fn a_new_server_takes_over_a_killed_writer_within_lease_plus_5s_losing_no_flushed_write() {
    let name =
        "a_new_server_takes_over_a_killed_writer_within_lease_plus_5s_losing_no_flushed_write";
    if have_moto(name) {
        let _timer = Timer::new(name);
        killed_writer_rounds(false);
    }
}

// Goal: a standby (`serve --standby`, started while the writer runs) takes the disk over after
// kill -9 of the writer within lease + 5 s, losing no FLUSH-acknowledged write. Method: the
// rounds of the test above, the next server started with --standby before the kill (each new
// writer gets a new standby).
#[test]
fn a_standby_takes_over_a_killed_writer_within_lease_plus_5s_losing_no_flushed_write() {
    let name = "a_standby_takes_over_a_killed_writer_within_lease_plus_5s_losing_no_flushed_write";
    if have_moto(name) {
        let _timer = Timer::new(name);
        killed_writer_rounds(true);
    }
}

/// Rounds of write, FLUSH, kill -9 and takeover, by a server started after the kill or by a
/// standby started before it.
fn killed_writer_rounds(standby: bool) {
    let rounds: u64 = std::env::var("TAKEOVER_ROUNDS")
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or(3);
    let moto = Moto::start();
    moto.create_bucket("disks");
    let dir = temp_dir();
    let url = format!(
        "s3://disks/vm?endpoint={}&lease={LEASE_SECONDS}",
        moto.endpoint()
    );
    let create = format!("{url}&create-size=1M&layout=log&segment-size=64k");
    let mut server = Server::start(&home(dir.path(), "round0"), "server", &serve_args(&create));
    // The newest write of each block a FLUSH acknowledged: (round, write).
    let mut flushed: Vec<Option<(u64, u64)>> = vec![None; BLOCKS as usize];
    let mut takeover_seconds_max = 0f64;
    for round in 0..rounds {
        let client = NbdClient::connect(&server.uri()).unwrap();
        // Every flushed write survived the takeover before this round.
        for block in 0..BLOCKS {
            let back = read_block(&client, block);
            match flushed[block as usize] {
                Some((tag_round, write)) => assert_eq!(
                    back,
                    tagged(tag_round, write, block),
                    "round {round} block {block}: the write a FLUSH acknowledged is lost"
                ),
                None => assert!(
                    back.iter().all(|&byte| byte == 0),
                    "round {round} block {block}"
                ),
            }
        }
        let mut pending: Vec<(u64, u64)> = Vec::new();
        for write in 0..64u64 {
            let block = (write * 37 + round * 11) % BLOCKS;
            client
                .write(block * BLOCK as u64, &tagged(round, write, block))
                .unwrap();
            pending.push((block, write));
            if write % 8 == 7 {
                client.flush().unwrap();
                for (block, write) in pending.drain(..) {
                    flushed[block as usize] = Some((round, write));
                }
            }
        }
        // Unflushed writes the kill may lose.
        for write in 64..72u64 {
            let block = (write * 37 + round * 11) % BLOCKS;
            client
                .write(block * BLOCK as u64, &tagged(round, write, block))
                .unwrap();
        }
        let next_dir = home(dir.path(), &format!("round{}", round + 1));
        let next_url = url.clone();
        let start_next = move || {
            let mut args = serve_args(&next_url);
            if standby {
                args.push("--standby");
            }
            Server::start(&next_dir, "server", &args)
        };
        let (started, next) = if standby {
            let next = std::thread::spawn(start_next);
            // Registered and watching before the writer dies.
            std::thread::sleep(Duration::from_secs(1));
            server.kill9();
            (Instant::now(), next.join().unwrap())
        } else {
            server.kill9();
            (Instant::now(), start_next())
        };
        server = next;
        let client = NbdClient::connect(&server.uri()).unwrap();
        client.write(0, &read_block(&client, 0)).unwrap();
        client.flush().unwrap();
        let seconds = started.elapsed().as_secs_f64();
        takeover_seconds_max = takeover_seconds_max.max(seconds);
        assert!(
            seconds < (LEASE_SECONDS + 5) as f64,
            "round {round}: the takeover took {seconds:.1} s"
        );
        assert!(
            server.log_text().contains("lapsed"),
            "the new server did not say it took a lapsed lease:\n{}",
            server.log_text()
        );
    }
    println!(
        "{rounds} rounds, slowest takeover {takeover_seconds_max:.1} s (lease {LEASE_SECONDS} s)"
    );
    server.stop_clean();
}

// Goal: a writer frozen past its lease while another server takes the disk acknowledges no
// WRITE and no FLUSH after it resumes, neither for requests it received while frozen nor for
// new ones; the new server keeps every write the old one flushed. Method: writer A on moto
// (lease 2 s) flushes a tagged block and is stopped with SIGSTOP; server B (same URL) takes
// the disk; a client thread writes to A while it is frozen; A gets SIGCONT; that write, a new
// write and a FLUSH to A must all fail; B reads A's flushed block, and a restart after both
// ends reads B's writes and nothing A was sent after it froze.
#[test]
fn a_writer_frozen_past_its_lease_acknowledges_nothing_after_resuming() {
    let name = "a_writer_frozen_past_its_lease_acknowledges_nothing_after_resuming";
    if !have_moto(name) {
        return;
    }
    let _timer = Timer::new(name);
    // FROZEN_ROUNDS repeats it on fresh disks (default 1; `FROZEN_ROUNDS=20` is the long form).
    let rounds: u64 = std::env::var("FROZEN_ROUNDS")
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or(1);
    let moto = Moto::start();
    moto.create_bucket("disks");
    for round in 0..rounds {
        frozen_writer_round(&moto, round);
    }
    println!("{rounds} rounds: the resumed writer acknowledged nothing");
}

/// One round of the frozen-writer test on disk `vm{round}`.
fn frozen_writer_round(moto: &Moto, round: u64) {
    let dir = temp_dir();
    let url = format!(
        "s3://disks/vm{round}?endpoint={}&lease={LEASE_SECONDS}",
        moto.endpoint()
    );
    let create = format!("{url}&create-size=1M&layout=log");
    let mut first = Server::start(&home(dir.path(), "a"), "first", &serve_args(&create));
    let to_first = NbdClient::connect(&first.uri()).unwrap();
    to_first.write(0, &tagged(1, 0, 0)).unwrap();
    to_first.flush().unwrap();

    send_signal(first.pid(), SIGSTOP);
    let started = Instant::now();
    let mut second = Server::start(&home(dir.path(), "b"), "second", &serve_args(&url));
    assert!(started.elapsed() >= Duration::from_secs(LEASE_SECONDS));
    let to_second = NbdClient::connect(&second.uri()).unwrap();
    assert_eq!(read_block(&to_second, 0), tagged(1, 0, 0));
    to_second.write(BLOCK as u64, &tagged(2, 0, 1)).unwrap();
    to_second.flush().unwrap();

    // A request sent to the frozen writer waits in its socket until it resumes.
    let frozen_write = {
        let uri = first.uri();
        std::thread::spawn(move || {
            let client = NbdClient::connect(&uri);
            // The connection itself may only complete after SIGCONT.
            client.map(|client| {
                let write = client.write(2 * BLOCK as u64, &tagged(1, 1, 2));
                let flush = client.flush();
                (write.is_ok(), flush.is_ok())
            })
        })
    };
    let frozen_old_connection = std::thread::spawn(move || {
        let write = to_first.write(BLOCK as u64, &tagged(1, 2, 1));
        let flush = to_first.flush();
        (write.is_ok(), flush.is_ok(), to_first)
    });
    std::thread::sleep(Duration::from_millis(500));
    send_signal(first.pid(), SIGCONT);
    let (write_ok, flush_ok, to_first) = frozen_old_connection.join().unwrap();
    assert!(
        !write_ok,
        "the resumed writer acknowledged a WRITE sent while it was frozen"
    );
    assert!(
        !flush_ok,
        "the resumed writer acknowledged a FLUSH sent while it was frozen"
    );
    if let Ok((write_ok, flush_ok)) = frozen_write.join().unwrap() {
        assert!(
            !write_ok && !flush_ok,
            "a new connection to the resumed writer was acknowledged"
        );
    }
    // And nothing later either.
    assert!(to_first.write(3 * BLOCK as u64, &tagged(1, 3, 3)).is_err());
    assert!(to_first.flush().is_err());
    let log = first.log_text();
    assert!(
        log.contains("lease"),
        "the old writer's log does not name the lease:\n{log}"
    );
    first.kill9();
    second.stop_clean();

    let third = Server::start(&home(dir.path(), "c"), "third", &serve_args(&url));
    let client = NbdClient::connect(&third.uri()).unwrap();
    assert_eq!(read_block(&client, 0), tagged(1, 0, 0));
    assert_eq!(read_block(&client, 1), tagged(2, 0, 1));
    for block in [2, 3] {
        assert!(
            read_block(&client, block).iter().all(|&byte| byte == 0),
            "block {block}: a write the old writer received after its lease lapsed is on the disk"
        );
    }
}

// Goal: a standby that cannot be honoured is refused with a reason, changing nothing. Method:
// a second --standby while one waits; --standby on a chunk-layout disk; --standby with -r;
// --standby on a file backend; --standby with lease=off. Each must exit 2 naming the problem.
#[test]
fn standby_requests_that_cannot_be_honoured_are_refused_with_a_reason() {
    let name = "standby_requests_that_cannot_be_honoured_are_refused_with_a_reason";
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
    let url = format!(
        "s3://disks/vm?endpoint={}&lease={LEASE_SECONDS}",
        moto.endpoint()
    );
    let writer = Server::start(
        &home(dir.path(), "w"),
        "writer",
        &serve_args(&format!("{url}&create-size=1M&layout=log")),
    );
    let mut first_standby = ChildGuard::spawn(
        std::process::Command::new(bufcache_bin())
            .args(["serve", "--standby", "--backend", &url, "--listen"])
            .arg(format!(
                "unix:{}",
                dir.path().join("standby.sock").display()
            ))
            .current_dir(home(dir.path(), "s")),
        "standby",
    );
    std::thread::sleep(Duration::from_secs(1));
    let text = refused(&["--standby", "--backend", &url]);
    assert!(text.contains("already has a standby"), "{text}");
    assert!(first_standby.running(), "the first standby gave up");
    drop(first_standby);
    drop(writer);

    let chunk = format!(
        "s3://disks/chunk?endpoint={}&layout=chunk&create-size=1M",
        moto.endpoint()
    );
    let text = refused(&["--standby", "--backend", &chunk]);
    assert!(text.contains("log layout"), "{text}");
    let text = refused(&["--standby", "-r", "--backend", &url]);
    assert!(text.contains("follow="), "{text}");
    let file = dir.path().join("disk.img");
    let text = refused(&[
        "--standby",
        "--backend",
        file.to_str().unwrap(),
        "--create-size",
        "1M",
    ]);
    assert!(text.contains("not an s3:// disk"), "{text}");
    let text = refused(&["--standby", "--backend", &format!("{url}&lease=off")]);
    assert!(text.contains("lease=off"), "{text}");
}

// Goal: issue 51 item 4 — a client that reconnects and retries its unacknowledged requests
// rides through a takeover: qemu's NBD driver with `reconnect-delay`, pointed at a name that
// moves to the new writer (as a floating address or a DNS name would), loses nothing a FLUSH
// acknowledged and keeps writing after the writer it started with died. Method: writer W and
// a standby S (lease 2 s) on one moto disk, each on a unix socket of its own; the client
// reaches them through a symlink P, pointing at W. One qemu-io process over P
// (`reconnect-delay=30`) writes pattern 0x11, FLUSHes, then sleeps; meanwhile W is killed with
// SIGKILL, S takes the disk over and P is repointed at S (an atomic rename); qemu-io then
// writes 0x22 elsewhere, FLUSHes and reads both patterns back (`read -P` verifies them). A
// client of S afterwards reads both as well.
#[test]
fn a_reconnecting_client_rides_through_a_takeover_losing_no_flushed_write() {
    let name = "a_reconnecting_client_rides_through_a_takeover_losing_no_flushed_write";
    if !have_moto(name) || !have_tools(name, &["qemu-io"]) {
        return;
    }
    let _timer = Timer::new(name);
    let moto = Moto::start();
    moto.create_bucket("disks");
    let dir = temp_dir();
    let url = format!(
        "s3://disks/ride?endpoint={}&lease={LEASE_SECONDS}",
        moto.endpoint()
    );
    let create = format!("{url}&create-size=1M&layout=log&segment-size=64k");
    let mut writer = Server::start(&home(dir.path(), "writer"), "writer", &serve_args(&create));
    let standby = {
        let (standby_dir, url) = (home(dir.path(), "standby"), url.clone());
        std::thread::spawn(move || {
            let mut args = serve_args(&url);
            args.push("--standby");
            Server::start(&standby_dir, "standby", &args)
        })
    };
    let moving = dir.path().join("disk.sock");
    std::os::unix::fs::symlink(writer.socket(), &moving).unwrap();
    // The sleep leaves time for the kill, the takeover (a lease and a poll) and the repoint.
    let mut client = Command::new(tool("qemu-io"));
    client.args([
        "--image-opts",
        &format!(
            "driver=nbd,server.type=unix,server.path={},reconnect-delay=30",
            moving.display()
        ),
        "-c",
        "write -P 0x11 0 64k",
        "-c",
        "flush",
        "-c",
        "sleep 8000",
        "-c",
        "write -P 0x22 64k 64k",
        "-c",
        "flush",
        "-c",
        "read -P 0x11 0 64k",
        "-c",
        "read -P 0x22 64k 64k",
    ]);
    client.stdout(Stdio::piped()).stderr(Stdio::piped());
    let client = client.spawn().unwrap();
    // The first write and FLUSH are done well before the kill.
    std::thread::sleep(Duration::from_secs(2));
    writer.kill9();
    let killed = Instant::now();
    let mut standby = standby.join().unwrap();
    let repointed = dir.path().join("disk.sock.new");
    std::os::unix::fs::symlink(standby.socket(), &repointed).unwrap();
    std::fs::rename(&repointed, &moving).unwrap();
    println!(
        "{name}: the standby served {:.1} s after the kill",
        killed.elapsed().as_secs_f64()
    );
    let output = client.wait_with_output().unwrap();
    let text = output_text(&output);
    println!("{name}: qemu-io said:\n{text}");
    assert!(output.status.success(), "qemu-io failed:\n{text}");
    assert!(
        !text.contains("fail")
            && !text.contains("error")
            && text.matches("read 65536/65536").count() == 2,
        "qemu-io did not ride through the takeover:\n{text}"
    );
    let reader = NbdClient::connect(&standby.uri()).unwrap();
    let mut back = vec![0u8; 128 << 10];
    reader.read(0, &mut back).unwrap();
    assert!(
        back[..64 << 10].iter().all(|&byte| byte == 0x11),
        "the first FLUSH's write"
    );
    assert!(
        back[64 << 10..].iter().all(|&byte| byte == 0x22),
        "the write after the takeover"
    );
    drop(reader);
    standby.stop_clean();
}

/// An Authorization header naming the tests' access key: moto refuses an anonymous GET of an
/// object but does not check signatures.
const TEST_AUTHORIZATION: &str = "AWS4-HMAC-SHA256 Credential=testing/20260101/us-east-1/s3/aws4_request, SignedHeaders=host, Signature=00";

/// The id in the lock object `key` of bucket `bucket`, read straight from moto (a GET with
/// an unchecked signature); None when there is no lock or moto did not answer.
fn lock_holder_id(moto: &Moto, bucket: &str, key: &str) -> Option<String> {
    lock_holder_id_at(moto.port, bucket, key)
}

fn lock_holder_id_at(port: u16, bucket: &str, key: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    write!(
        stream,
        "GET /{bucket}/{key} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: {TEST_AUTHORIZATION}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    if !(answer.starts_with("HTTP/1.1 200") || answer.starts_with("HTTP/1.0 200")) {
        return None;
    }
    // The body is the lock's JSON record: `"id": "…"`, with or without a space.
    let after_key = &answer[answer.find("\"id\"")? + "\"id\"".len()..];
    let value = &after_key[after_key.find('"')? + 1..];
    Some(value[..value.find('"')?].to_string())
}

// Goal: a writer whose connection to the store is cut stops acknowledging before a standby
// takes the disk over, and the standby holds every write a FLUSH acknowledged. Method: writer
// A reaches moto through a TCP proxy (lease 2 s, retry-timeout 1 s), standby B reaches moto
// directly; a client writes tagged blocks to A throughout, a FLUSH after every eighth write; a
// watcher reads the lock object from moto every 20 ms and keeps the send time of the last read
// that still named A (B's lock PUT landed after it). The proxy goes down. Once B serves, the
// client's last acknowledgement from A must have arrived before that send time, and B must
// read every block as A's last acknowledged FLUSH left it (or as a later write sent to A);
// when the proxy comes back A still acknowledges nothing. `CUT_ROUNDS=N` repeats it on fresh
// disks (default 1).
#[test]
fn a_writer_cut_off_from_the_store_stops_acknowledging_before_a_standby_takes_over() {
    let name = "a_writer_cut_off_from_the_store_stops_acknowledging_before_a_standby_takes_over";
    if !have_moto(name) {
        return;
    }
    let _timer = Timer::new(name);
    let rounds: u64 = std::env::var("CUT_ROUNDS")
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or(1);
    let moto = Moto::start();
    moto.create_bucket("disks");
    let mut gap_seconds_min = f64::MAX;
    for round in 0..rounds {
        gap_seconds_min = gap_seconds_min.min(cut_writer_round(&moto, round));
    }
    println!(
        "{rounds} rounds: the cut-off writer's last acknowledgement came at least {gap_seconds_min:.2} s before the standby's takeover could land; no flushed write lost"
    );
}

/// One round of the cut-off-writer test on disk `cut{round}`; returns how long before the
/// watcher's last read naming the writer its last acknowledgement arrived, in seconds.
fn cut_writer_round(moto: &Moto, round: u64) -> f64 {
    let dir = temp_dir();
    let proxy = Proxy::start(moto.port);
    let disk = format!("cut{round}");
    let direct = format!(
        "s3://disks/{disk}?endpoint={}&lease={LEASE_SECONDS}&retry-timeout-ms=1000",
        moto.endpoint()
    );
    let through_proxy = format!(
        "s3://disks/{disk}?endpoint={}&lease={LEASE_SECONDS}&retry-timeout-ms=1000&create-size=1M&layout=log&segment-size=64k",
        proxy.endpoint()
    );
    let mut writer = Server::start(
        &home(dir.path(), "writer"),
        "writer",
        &serve_args(&through_proxy),
    );
    let lock_key = format!("{disk}/bufcache-lock.json");
    let writer_id = lock_holder_id(moto, "disks", &lock_key)
        .unwrap_or_else(|| panic!("no lock `{lock_key}` to read: {}", writer.log_text()));
    let standby = {
        let (standby_dir, url) = (home(dir.path(), "standby"), direct.clone());
        std::thread::spawn(move || {
            let mut args = serve_args(&url);
            args.push("--standby");
            Server::start(&standby_dir, "standby", &args)
        })
    };
    // The watcher: the send time of the last read of the lock that named the writer.
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (stop, moto_port, lock_key, writer_id) =
            (stop.clone(), moto.port, lock_key.clone(), writer_id.clone());
        std::thread::spawn(move || {
            let moto = MotoPort(moto_port);
            let mut last_naming_writer = Instant::now();
            while !stop.load(Ordering::SeqCst) {
                let sent = Instant::now();
                if moto.holder(&lock_key).as_deref() == Some(writer_id.as_str()) {
                    last_naming_writer = sent;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            last_naming_writer
        })
    };
    // The client: tagged writes to the writer, a FLUSH after every eighth; per block the
    // tags the disk may hold (the last flushed one, and every write sent since).
    let allowed: Allowed = Arc::new(Mutex::new(vec![
        vec![vec![0u8; BLOCK]];
        2 * CUT_BLOCKS as usize
    ]));
    // One client FLUSHes after every eighth write; another only writes, so the writer's cache
    // would acknowledge its writes without the store until the lease stops it.
    let clients = [(8, 0u64), (0, 1u64 << 30)].map(|(flush_every, first_write)| {
        let (stop, allowed, uri) = (stop.clone(), allowed.clone(), writer.uri());
        std::thread::spawn(move || {
            cut_client(&uri, round, flush_every, first_write, &stop, &allowed)
        })
    });
    // Writes and FLUSHes reach the store for a while, then the writer is cut off from it.
    std::thread::sleep(Duration::from_millis(1500));
    proxy.set_down(true);
    let cut = Instant::now();
    let mut standby = standby.join().unwrap();
    let serving = cut.elapsed();
    // The client goes on sending to the writer for a while after the takeover.
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::SeqCst);
    let [flushing, writing] = clients.map(|client| client.join().unwrap());
    let last_acknowledged = flushing.last_acknowledged.max(writing.last_acknowledged);
    let acknowledged = flushing.acknowledged + writing.acknowledged;
    let refused = flushing.refused + writing.refused;
    let connection = flushing.connection;
    let last_naming_writer = watcher.join().unwrap();
    assert!(
        acknowledged > 16 && refused > 0,
        "round {round}: {acknowledged} acknowledged, {refused} refused: the load did not span the cut"
    );
    assert!(
        last_acknowledged < last_naming_writer,
        "round {round}: the writer acknowledged {:.3} s after the cut, after the lock last named it ({:.3} s after the cut)",
        (last_acknowledged - cut).as_secs_f64(),
        (last_naming_writer.saturating_duration_since(cut)).as_secs_f64()
    );
    assert!(
        serving < Duration::from_secs(LEASE_SECONDS + 5),
        "round {round}: the standby served {serving:?} after the cut"
    );
    // Every block as the last acknowledged FLUSH left it, or a later write.
    let reader = NbdClient::connect(&standby.uri()).unwrap();
    let allowed = allowed.lock().unwrap();
    for block in 0..2 * CUT_BLOCKS {
        let back = read_block(&reader, block);
        assert!(
            allowed[block as usize].contains(&back),
            "round {round} block {block}: not what the writer's last acknowledged FLUSH left"
        );
    }
    // The standby serves writes; the old writer, reaching the store again, learns of the
    // takeover and still acknowledges nothing.
    reader.write(0, &tagged(round, 1 << 20, 0)).unwrap();
    reader.flush().unwrap();
    proxy.set_down(false);
    std::thread::sleep(Duration::from_secs(LEASE_SECONDS));
    assert!(connection
        .write(BLOCK as u64, &tagged(round, 1 << 21, 1))
        .is_err());
    assert!(connection.flush().is_err());
    let gap = (last_naming_writer - last_acknowledged).as_secs_f64();
    println!(
        "round {round}: {acknowledged} acknowledged, {refused} refused; last acknowledgement {:.2} s after the cut, the standby served {:.2} s after it",
        (last_acknowledged.saturating_duration_since(cut)).as_secs_f64(),
        serving.as_secs_f64()
    );
    drop(reader);
    writer.kill9();
    standby.stop_clean();
    gap
}

/// Blocks each client of the cut-off-writer test writes to (one range per client).
const CUT_BLOCKS: u64 = 64;

/// Per block, the contents the disk may hold: the last flushed write, and every write sent
/// since.
type Allowed = Arc<Mutex<Vec<Vec<Vec<u8>>>>>;

/// What one client of the cut-off writer saw.
struct CutClient {
    last_acknowledged: Instant,
    acknowledged: u64,
    refused: u64,
    connection: NbdClient,
}

/// Writes tagged blocks to `uri` until `stop` (write numbers from `first_write`, blocks in
/// the range of its own), a FLUSH after every `flush_every`-th write (0: never).
fn cut_client(
    uri: &str,
    round: u64,
    flush_every: u64,
    first_write: u64,
    stop: &AtomicBool,
    allowed: &Allowed,
) -> CutClient {
    let connection = NbdClient::connect(uri).unwrap();
    let first_block = if flush_every == 0 { CUT_BLOCKS } else { 0 };
    let mut last_acknowledged = Instant::now();
    let (mut acknowledged, mut refused) = (0u64, 0u64);
    // Writes acknowledged since the last acknowledged FLUSH: (block, contents).
    let mut unflushed: Vec<(u64, Vec<u8>)> = Vec::new();
    let mut write = first_write;
    while !stop.load(Ordering::SeqCst) {
        let block = first_block + (write * 37) % CUT_BLOCKS;
        let data = tagged(round, write, block);
        allowed.lock().unwrap()[block as usize].push(data.clone());
        match connection.write(block * BLOCK as u64, &data) {
            Ok(()) => {
                last_acknowledged = Instant::now();
                acknowledged += 1;
                unflushed.push((block, data));
            }
            Err(_) => {
                refused += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        write += 1;
        if flush_every == 0 || !write.is_multiple_of(flush_every) {
            continue;
        }
        if connection.flush().is_ok() {
            last_acknowledged = Instant::now();
            acknowledged += 1;
            // Every block a flushed write touched now holds that write or a later one.
            let mut allowed = allowed.lock().unwrap();
            for (block, data) in unflushed.drain(..) {
                let contents = &mut allowed[block as usize];
                let at = contents.iter().position(|sent| *sent == data).unwrap();
                contents.drain(..at);
            }
        } else {
            refused += 1;
        }
    }
    CutClient {
        last_acknowledged,
        acknowledged,
        refused,
        connection,
    }
}

/// Moto's port, for a thread that reads the lock (moto itself stays with the test).
struct MotoPort(u16);

impl MotoPort {
    fn holder(&self, key: &str) -> Option<String> {
        lock_holder_id_at(self.0, "disks", key)
    }
}

/// Blocks of the warm-standby test's working set: written, flushed and read back after the
/// takeover.
const WARM_BLOCKS: u64 = 64;
/// Blocks of the working set the writer changes after the standby's first warming, while it
/// follows (one refresh drops and re-reads them).
const CHANGED_WHILE_FOLLOWING: std::ops::Range<u64> = 0..16;
/// Blocks of the working set the writer changes and flushes just before it is killed: the
/// standby's last view may not have them, so the takeover must drop its copies.
const CHANGED_BEFORE_KILL: std::ops::Range<u64> = 16..24;

/// What one warm-standby run measured after the takeover.
struct WarmRun {
    takeover_seconds: f64,
    /// Cache hits, cache misses and store GETs of reading the unchanged part of the working
    /// set (blocks `CHANGED_BEFORE_KILL.end..WARM_BLOCKS`) once after the takeover.
    unchanged_hits: f64,
    unchanged_misses: f64,
    unchanged_gets: f64,
    /// Store GETs of reading the whole working set once after the takeover.
    working_set_gets: f64,
}

fn metrics_of(log: &std::path::Path) -> Option<String> {
    let text = std::fs::read_to_string(log).ok()?;
    text.contains("metrics on http://")
        .then(|| scrape(&metrics_address(&text)))
}

fn gets(metrics: &str) -> f64 {
    sample(
        metrics,
        "bufcache_store_requests_total{export=\"\",method=\"GET\",outcome=\"ok\"}",
    )
}

fn warm_bytes(metrics: &str) -> f64 {
    sample(
        metrics,
        "bufcache_store_standby_warm_bytes_total{export=\"\"}",
    )
}

/// A writer and a `--standby` (reading at most `warm_bytes_max` into its cache per follow
/// round) on one moto disk: the writer writes and flushes the working set, changes part of it
/// while the standby follows and part just before kill -9; the standby takes over.
fn warm_standby_run(moto: &Moto, disk: &str, warm_bytes_max: &str) -> WarmRun {
    let warm = warm_bytes_max != "0";
    let dir = temp_dir();
    let url = format!(
        "s3://disks/{disk}?endpoint={}&lease={LEASE_SECONDS}",
        moto.endpoint()
    );
    let create = format!("{url}&create-size=1M&layout=log&segment-size=64k");
    let mut writer_args = serve_args(&create);
    writer_args.extend(["--metrics", "127.0.0.1:0"]);
    let mut writer = Server::start(&home(dir.path(), "writer"), "server", &writer_args);
    let to_writer = NbdClient::connect(&writer.uri()).unwrap();
    for block in 0..WARM_BLOCKS {
        to_writer
            .write(block * BLOCK as u64, &tagged(1, 0, block))
            .unwrap();
    }
    to_writer.flush().unwrap();

    let standby_home = home(dir.path(), "standby");
    let standby_log = standby_home.join("server.log");
    let standby_url = format!("{url}&follow=1");
    let warm_arg = warm_bytes_max.to_string();
    let standby = std::thread::spawn(move || {
        let mut args = serve_args(&standby_url);
        args.extend([
            "--standby",
            "--metrics",
            "127.0.0.1:0",
            "--standby-warm-bytes-max",
            &warm_arg,
        ]);
        Server::start(&standby_home, "server", &args)
    });
    // While it waits the standby shows its role, the writer's lease as it sees it, its lag,
    // and (warming) the working set read into its cache.
    let working_set_bytes = (WARM_BLOCKS * BLOCK as u64) as f64;
    let mut metrics = String::new();
    wait_until("the standby's metrics", Duration::from_secs(20), || {
        metrics = metrics_of(&standby_log).unwrap_or_default();
        metrics.contains("bufcache_store_role")
            && (!warm || warm_bytes(&metrics) >= working_set_bytes)
    });
    assert_eq!(
        sample(
            &metrics,
            "bufcache_store_role{export=\"\",role=\"standby\"}"
        ),
        1.0
    );
    assert_eq!(
        sample(&metrics, "bufcache_store_role{export=\"\",role=\"writer\"}"),
        0.0
    );
    let lag = sample(&metrics, "bufcache_store_replica_lag_seconds{export=\"\"}");
    assert!(lag < 10.0, "lag {lag}");
    wait_until(
        "the standby sees the writer's lease",
        Duration::from_secs(10),
        || {
            let metrics = metrics_of(&standby_log).unwrap_or_default();
            metrics.contains("bufcache_store_lease_age_seconds")
        },
    );
    let metrics = metrics_of(&standby_log).unwrap();
    let age = sample(&metrics, "bufcache_store_lease_age_seconds{export=\"\"}");
    assert!(
        age < LEASE_SECONDS as f64,
        "the writer renews, yet the standby sees a lease {age} s old"
    );
    let warmed_first = warm_bytes(&metrics);

    // Blocks the writer changes while the standby follows: a refresh drops and re-reads them.
    for block in CHANGED_WHILE_FOLLOWING {
        to_writer
            .write(block * BLOCK as u64, &tagged(2, 0, block))
            .unwrap();
    }
    to_writer.flush().unwrap();
    if warm {
        let changed_bytes = (CHANGED_WHILE_FOLLOWING.count() * BLOCK) as f64;
        wait_until(
            "the standby re-reads the changed blocks",
            Duration::from_secs(10),
            || {
                metrics_of(&standby_log)
                    .is_some_and(|metrics| warm_bytes(&metrics) >= warmed_first + changed_bytes)
            },
        );
    }
    // Blocks changed and flushed just before the kill, and writes no FLUSH covered.
    for block in CHANGED_BEFORE_KILL {
        to_writer
            .write(block * BLOCK as u64, &tagged(3, 0, block))
            .unwrap();
    }
    to_writer.flush().unwrap();
    for block in CHANGED_BEFORE_KILL.end..CHANGED_BEFORE_KILL.end + 4 {
        to_writer
            .write(block * BLOCK as u64, &tagged(3, 1, block))
            .unwrap();
    }
    writer.kill9();
    let killed = Instant::now();
    let mut server = standby.join().unwrap();
    let client = NbdClient::connect(&server.uri()).unwrap();
    let before = scrape_log(&server.log_text());
    assert_eq!(
        sample(&before, "bufcache_store_role{export=\"\",role=\"writer\"}"),
        1.0
    );
    // The first writes and FLUSH go elsewhere on the disk, past the working set.
    client
        .write(200 * BLOCK as u64, &tagged(4, 0, 200))
        .unwrap();
    client.flush().unwrap();
    let takeover_seconds = killed.elapsed().as_secs_f64();
    assert!(
        takeover_seconds < (LEASE_SECONDS + 5) as f64,
        "the takeover took {takeover_seconds:.1} s"
    );

    let before = scrape_log(&server.log_text());
    let expected = |block: u64| {
        if CHANGED_WHILE_FOLLOWING.contains(&block) {
            tagged(2, 0, block)
        } else if CHANGED_BEFORE_KILL.contains(&block) {
            tagged(3, 0, block)
        } else {
            tagged(1, 0, block)
        }
    };
    // In an order read-ahead does not follow, as a working set is re-read.
    let unchanged = WARM_BLOCKS - CHANGED_BEFORE_KILL.end;
    for step in 0..unchanged {
        let block = CHANGED_BEFORE_KILL.end + step * 17 % unchanged;
        let back = read_block(&client, block);
        // A write no FLUSH covered may or may not have reached the store.
        if (CHANGED_BEFORE_KILL.end..CHANGED_BEFORE_KILL.end + 4).contains(&block)
            && back == tagged(3, 1, block)
        {
            continue;
        }
        assert_eq!(back, expected(block), "block {block}");
    }
    let after = scrape_log(&server.log_text());
    let delta = |series: &str| sample(&after, series) - sample(&before, series);
    let unchanged_hits = delta("bufcache_cache_hits_total");
    let unchanged_misses = delta("bufcache_cache_misses_total");
    let unchanged_gets = gets(&after) - gets(&before);
    for step in 0..CHANGED_BEFORE_KILL.end {
        let block = step * 7 % CHANGED_BEFORE_KILL.end;
        assert_eq!(
            read_block(&client, block),
            expected(block),
            "block {block}: a block the writer changed reads its old data"
        );
    }
    let last = scrape_log(&server.log_text());
    let working_set_gets = gets(&last) - gets(&before);
    assert_eq!(read_block(&client, 200), tagged(4, 0, 200));
    drop(client);
    server.stop_clean();
    WarmRun {
        takeover_seconds,
        unchanged_hits,
        unchanged_misses,
        unchanged_gets,
        working_set_gets,
    }
}

// Goal: a standby keeps its cache warm while it waits and serves it after taking over: its
// /metrics shows role standby, the writer's lease as it sees it and its lag; after kill -9 of
// the writer it serves writes within lease + 5 s, holds every flushed write, its first reads of
// blocks it held are cache hits with no GET, and blocks the writer changed after the standby
// cached them (while it followed, and just before the kill) read the new data. Method: a writer
// and a `--standby` (follow=1, lease 2 s) on moto; tagged blocks written and flushed, the
// standby's warm-bytes counter awaited, part of them rewritten while it follows and part just
// before the kill; after the takeover the hit, miss and GET counters are compared across
// reads; the same run with `--standby-warm-bytes-max 0` (a cold cache) is the baseline.
#[test]
fn a_standby_keeps_its_cache_warm_and_serves_it_after_taking_over() {
    let name = "a_standby_keeps_its_cache_warm_and_serves_it_after_taking_over";
    if !have_moto(name) {
        return;
    }
    let _timer = Timer::new(name);
    let moto = Moto::start();
    moto.create_bucket("disks");
    let warm = warm_standby_run(&moto, "warm", "64M");
    let unchanged_blocks = (WARM_BLOCKS - CHANGED_BEFORE_KILL.end) as f64;
    assert!(
        warm.unchanged_hits >= unchanged_blocks,
        "{} hits reading {unchanged_blocks} blocks the standby held",
        warm.unchanged_hits
    );
    assert_eq!(
        warm.unchanged_misses, 0.0,
        "reading blocks the standby held missed"
    );
    assert_eq!(
        warm.unchanged_gets, 0.0,
        "reading blocks the standby held sent GETs"
    );
    let cold = warm_standby_run(&moto, "cold", "0");
    assert!(
        cold.unchanged_misses > 0.0 && cold.unchanged_gets > 0.0,
        "a cold standby's cache held the working set"
    );
    println!(
        "takeover after kill -9: warm {:.2} s, cold {:.2} s (lease {LEASE_SECONDS} s); GETs reading the {WARM_BLOCKS}-block working set after the takeover: warm {}, cold {}; of its {unchanged_blocks} unchanged blocks: warm {} GETs ({} hits, {} misses), cold {} GETs ({} hits, {} misses)",
        warm.takeover_seconds,
        cold.takeover_seconds,
        warm.working_set_gets,
        cold.working_set_gets,
        warm.unchanged_gets,
        warm.unchanged_hits,
        warm.unchanged_misses,
        cold.unchanged_gets,
        cold.unchanged_hits,
        cold.unchanged_misses,
    );
}

// Goal: a standby waiting for the disk ends at SIGTERM at once, exit 0, without touching the
// disk, and the writer goes on serving. Method: a writer on moto, a `--standby` started beside
// it and sent SIGTERM once its /metrics shows role standby; it must exit 0 within 5 s, and the
// writer must still take a write and a FLUSH.
#[test]
fn a_waiting_standby_ends_at_a_signal_leaving_the_writer_serving() {
    let name = "a_waiting_standby_ends_at_a_signal_leaving_the_writer_serving";
    if !have_moto(name) {
        return;
    }
    let _timer = Timer::new(name);
    let moto = Moto::start();
    moto.create_bucket("disks");
    let dir = temp_dir();
    let url = format!(
        "s3://disks/vm?endpoint={}&lease={LEASE_SECONDS}",
        moto.endpoint()
    );
    let create = format!("{url}&create-size=1M&layout=log");
    let mut writer = Server::start(&home(dir.path(), "writer"), "server", &serve_args(&create));
    let standby_home = home(dir.path(), "standby");
    let log = standby_home.join("standby.log");
    let log_file = std::fs::File::create(&log).unwrap();
    let mut standby = std::process::Command::new(bufcache_bin())
        .arg("serve")
        .args(serve_args(&url))
        .args(["--standby", "--metrics", "127.0.0.1:0", "--listen"])
        .arg(format!(
            "unix:{}",
            standby_home.join("standby.sock").display()
        ))
        .current_dir(&standby_home)
        .stdout(log_file.try_clone().unwrap())
        .stderr(log_file)
        .spawn()
        .unwrap();
    wait_until(
        "the standby's role on /metrics",
        Duration::from_secs(20),
        || {
            metrics_of(&log).is_some_and(|metrics| {
                metrics.contains("bufcache_store_role{export=\"\",role=\"standby\"} 1")
            })
        },
    );
    send_signal(standby.id(), 15);
    let status = wait_timeout(&mut standby, Duration::from_secs(5)).unwrap_or_else(|| {
        let _ = standby.kill();
        panic!(
            "the standby did not end within 5 s of SIGTERM:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        )
    });
    assert_eq!(
        status.code(),
        Some(0),
        "{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    let client = NbdClient::connect(&writer.uri()).unwrap();
    client.write(0, &tagged(1, 0, 0)).unwrap();
    client.flush().unwrap();
    drop(client);
    writer.stop_clean();
}
