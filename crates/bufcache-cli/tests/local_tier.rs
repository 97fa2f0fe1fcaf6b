//! `bufcache serve --local-cache`: the persistent local tier under real clients and kill -9.
//!
//! Goal: a write covered by a completed FLUSH survives kill -9 of the server and is on the
//! backend once write-back has run; the read cache is warm after a restart; a local cache of
//! another backend is refused by name. Method: a real server over a file backend, qemu-io and
//! nbdcopy as clients, the tier's counters read from the metrics endpoint (/metrics).

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;

const TIMEOUT: Duration = Duration::from_secs(60);
const EXPORT_BYTES: usize = 16 << 20;

/// The value of the tier sample `name` of the default export.
fn tier_value(text: &str, name: &str) -> f64 {
    sample(text, &format!("{name}{{export=\"\"}}"))
}

fn serve_args<'a>(backend: &'a str, cache: &'a str, flush_to: &'a str) -> Vec<&'a str> {
    vec![
        "--backend",
        backend,
        "--local-cache",
        cache,
        "--local-cache-size",
        "64M",
        "--flush-to",
        flush_to,
        "--cache-size",
        "4M",
        "--metrics",
        "127.0.0.1:0",
    ]
}

fn qemu_io(uri: &str, commands: &[String]) -> std::process::Output {
    let mut command = cmd("qemu-io", &["-f", "raw"]);
    for line in commands {
        command.arg("-c").arg(line);
    }
    command.arg(uri);
    run_ok(command, TIMEOUT)
}

fn make_backend(dir: &Path, seed: u64) -> (String, Vec<u8>) {
    let path = dir.join("disk.img");
    let contents = random_bytes(EXPORT_BYTES, seed);
    write_file(&path, &contents);
    (path.display().to_string(), contents)
}

#[test]
fn flushed_writes_survive_kill_9_and_reach_the_backend() {
    // Goal: with --flush-to local a FLUSH returns once the local log has the writes; after
    // kill -9 the restarted server serves them and writes them back to the file. Method:
    // qemu-io writes patterns (aligned and not) and flushes; kill -9; restart; qemu-io reads
    // the patterns back; wait until the tier reports nothing dirty; stop; compare the file.
    if !have_tools(
        "flushed_writes_survive_kill_9_and_reach_the_backend",
        &["qemu-io"],
    ) {
        return;
    }
    let _timer = Timer::new("flushed_writes_survive_kill_9_and_reach_the_backend");
    let dir = temp_dir();
    let (backend, mut expected) = make_backend(dir.path(), 1);
    let cache = dir.path().join("local.cache").display().to_string();
    let args = serve_args(&backend, &cache, "local");
    let mut server = Server::start(dir.path(), "first", &args);
    let writes: [(usize, usize, u8); 4] = [
        (0, 1 << 20, 0x5a),
        (3 << 20, 123_457, 0x11),
        (8 << 20, 4096, 0x22),
        (EXPORT_BYTES - 70_000, 70_000, 0x33),
    ];
    let mut commands: Vec<String> = writes
        .iter()
        .map(|(offset, length, pattern)| format!("write -P 0x{pattern:02x} {offset} {length}"))
        .collect();
    commands.push("flush".into());
    qemu_io(&server.uri(), &commands);
    server.kill9();
    for (offset, length, pattern) in writes {
        expected[offset..offset + length].fill(pattern);
    }
    let mut server = Server::start(dir.path(), "second", &args);
    let reads: Vec<String> = writes
        .iter()
        .map(|(offset, length, pattern)| format!("read -P 0x{pattern:02x} {offset} {length}"))
        .collect();
    qemu_io(&server.uri(), &reads);
    let address = metrics_address(&server.log_text());
    wait_until("the tier wrote everything back", TIMEOUT, || {
        tier_value(&scrape(&address), "bufcache_tier_dirty_bytes") == 0.0
    });
    server.stop_clean();
    let on_disk = std::fs::read(&backend).unwrap();
    assert_same_bytes(&expected, &on_disk, "the backing file after write-back");
}

#[test]
fn the_read_cache_is_as_warm_after_kill_9() {
    // Goal: the same read workload hits the local cache as often right after a restart
    // (kill -9) as before it (issue target: at least 0.9 of the hit ratio). Method: a RAM
    // cache far smaller than the export; nbdcopy reads the export twice (the second pass's
    // tier hit ratio is "before"), kill -9, restart, read it once more ("after").
    if !have_tools("the_read_cache_is_as_warm_after_kill_9", &["nbdcopy"]) {
        return;
    }
    let _timer = Timer::new("the_read_cache_is_as_warm_after_kill_9");
    let dir = temp_dir();
    let (backend, contents) = make_backend(dir.path(), 2);
    let cache = dir.path().join("local.cache").display().to_string();
    let args = serve_args(&backend, &cache, "local");
    let copy = dir.path().join("copy.img");
    let read_all = |server: &Server| {
        let _ = std::fs::remove_file(&copy);
        run_ok(
            cmd("nbdcopy", &[server.uri().as_str(), copy.to_str().unwrap()]),
            TIMEOUT,
        );
        assert_same_bytes(&contents, &std::fs::read(&copy).unwrap(), "the export");
        let text = scrape(&metrics_address(&server.log_text()));
        (
            tier_value(&text, "bufcache_tier_read_blocks_local_total"),
            tier_value(&text, "bufcache_tier_read_blocks_remote_total"),
        )
    };
    let mut server = Server::start(dir.path(), "first", &args);
    let (local_first, remote_first) = read_all(&server);
    assert!(remote_first > 0.0, "a cold cache reads the backend");
    let (local_second, remote_second) = read_all(&server);
    let (hits, misses) = (local_second - local_first, remote_second - remote_first);
    let before = hits / (hits + misses);
    server.kill9();
    let server = Server::start(dir.path(), "second", &args);
    let (hits, misses) = read_all(&server);
    let after = hits / (hits + misses);
    eprintln!("tier hit ratio: before restart {before:.3}, after {after:.3}");
    assert!(
        before > 0.5,
        "the second pass hits the local cache: {before}"
    );
    assert!(
        after >= 0.9 * before,
        "warm after restart: {after} vs {before}"
    );
}

fn bufcache(args: &[&str]) -> std::process::Command {
    let mut command = std::process::Command::new(bufcache_bin());
    command.args(args);
    command
}

#[test]
fn a_local_cache_of_another_backend_or_size_is_refused() {
    // Goal: attaching a local cache to a backend it does not belong to would serve another
    // disk's blocks: serve refuses to start, naming the file and both backends. Method: make
    // a cache for one file, start serve with it on another; then ask for another size.
    let _timer = Timer::new("a_local_cache_of_another_backend_or_size_is_refused");
    let dir = temp_dir();
    let (backend, _) = make_backend(dir.path(), 3);
    let other = dir.path().join("other.img");
    write_file(&other, &vec![0u8; EXPORT_BYTES]);
    let cache = dir.path().join("local.cache").display().to_string();
    let mut server = Server::start(dir.path(), "first", &serve_args(&backend, &cache, "local"));
    server.stop_clean();
    let before = std::fs::read(&cache).unwrap();
    let output = run_timeout(
        bufcache(&[
            "serve",
            "--backend",
            other.to_str().unwrap(),
            "--local-cache",
            &cache,
            "--listen",
            &format!("unix:{}", dir.path().join("x.sock").display()),
        ]),
        TIMEOUT,
    );
    let text = output_text(&output);
    assert!(!output.status.success(), "{text}");
    assert!(
        text.contains(&cache) && text.contains("belongs to backend") && text.contains("other.img"),
        "{text}"
    );
    let output = run_timeout(
        bufcache(&[
            "serve",
            "--backend",
            &backend,
            "--local-cache",
            &cache,
            "--local-cache-size",
            "32M",
            "--listen",
            &format!("unix:{}", dir.path().join("y.sock").display()),
        ]),
        TIMEOUT,
    );
    let text = output_text(&output);
    assert!(!output.status.success(), "{text}");
    assert!(text.contains("not the 33554432 bytes asked for"), "{text}");
    assert_eq!(
        std::fs::read(&cache).unwrap(),
        before,
        "the cache is untouched"
    );
}

#[test]
fn a_local_cache_is_refused_for_another_image_put_at_the_same_path() {
    // Goal: a local cache belongs to the image it was made for, not to the path: another
    // image put at the same path (as a restore or a copy would) must not be served the old
    // image's cached blocks nor receive its logged writes (#45 item 7). Method: serve a file
    // with a local cache, write and flush through qemu-io, stop; move a new image over the
    // path; a start with the same cache is refused naming both, and neither the new image nor
    // the cache changes. The same image at its path reattaches.
    let name = "a_local_cache_is_refused_for_another_image_put_at_the_same_path";
    if !have_tools(name, &["qemu-io"]) {
        return;
    }
    let _timer = Timer::new(name);
    let dir = temp_dir();
    let (backend, _) = make_backend(dir.path(), 5);
    let cache = dir.path().join("local.cache").display().to_string();
    let mut server = Server::start(dir.path(), "first", &serve_args(&backend, &cache, "local"));
    if server.log_text().contains("cannot record a disk id") {
        println!(
            "{name}: skipped: the test directory's file system keeps no user extended attributes"
        );
        server.stop_clean();
        return;
    }
    qemu_io(
        &server.uri(),
        &["write -P 0x5a 0 1M".to_string(), "flush".to_string()],
    );
    server.stop_clean();
    let mut again = Server::start(dir.path(), "again", &serve_args(&backend, &cache, "local"));
    again.stop_clean();

    let replacement = dir.path().join("replacement.img");
    let new_image = random_bytes(EXPORT_BYTES, 6);
    write_file(&replacement, &new_image);
    std::fs::rename(&replacement, &backend).unwrap();
    let cache_before = std::fs::read(&cache).unwrap();
    let output = run_timeout(
        bufcache(&[
            "serve",
            "--backend",
            &backend,
            "--local-cache",
            &cache,
            "--listen",
            &format!("unix:{}", dir.path().join("x.sock").display()),
        ]),
        TIMEOUT,
    );
    let text = output_text(&output);
    assert_eq!(output.status.code(), Some(2), "{text}");
    assert!(
        text.contains("belongs to backend `file-disk:") && text.contains("disk.img"),
        "{text}"
    );
    assert!(
        std::fs::read(&backend).unwrap() == new_image,
        "the new image changed"
    );
    assert!(
        std::fs::read(&cache).unwrap() == cache_before,
        "the cache changed"
    );
}

#[test]
fn a_local_cache_is_refused_for_another_nbdkit_disk_on_the_same_socket() {
    // Goal: an NBD upstream records no id of its own, so another disk served on the same
    // socket has the cache's identity (URI and socket) and size; attaching the cache there
    // would serve its stale blocks and replay its writes into that disk (#45 item 7). The
    // start compares sampled clean blocks with the upstream and refuses on any difference.
    // Method: two nbdkit memory disks on their own sockets, the served socket path a symlink
    // to one of them. Write 4 MiB through a server over disk A, stop it (write-back done);
    // point the path at disk B (other bytes): the start is refused (exit 2) naming the cache
    // and the count of differing blocks, no client is served, and neither B nor the cache
    // changes. Point it back at A: the cache attaches and every byte reads as written.
    let name = "a_local_cache_is_refused_for_another_nbdkit_disk_on_the_same_socket";
    if !have_tools(name, &["qemu-io", "nbdkit", "nbdcopy"]) {
        return;
    }
    let _timer = Timer::new(name);
    let dir = temp_dir();
    let nbdkit = |socket: &Path| {
        let guard = QuietChild::spawn(
            &mut cmd(
                "nbdkit",
                &["-f", "-U", socket.to_str().unwrap(), "memory", "16M"],
            ),
            "nbdkit",
            &socket.with_extension("log"),
        );
        wait_until("nbdkit listens", TIMEOUT, || socket.exists());
        guard
    };
    let socket_a = dir.path().join("a.sock");
    let socket_b = dir.path().join("b.sock");
    let _disk_a = nbdkit(&socket_a);
    let _disk_b = nbdkit(&socket_b);
    let served = dir.path().join("upstream.sock");
    let point_at = |target: &Path| {
        let _ = std::fs::remove_file(&served);
        std::os::unix::fs::symlink(target, &served).unwrap();
    };
    let uri_of = |socket: &Path| format!("nbd+unix:///?socket={}", socket.display());
    let upstream = uri_of(&served);
    qemu_io(&uri_of(&socket_b), &["write -P 0x33 0 16M".to_string()]);
    let image_path = dir.path().join("image.img");
    let read_disk = |socket: &Path| {
        let _ = std::fs::remove_file(&image_path);
        run_ok(
            cmd(
                "nbdcopy",
                &[uri_of(socket).as_str(), image_path.to_str().unwrap()],
            ),
            TIMEOUT,
        );
        std::fs::read(&image_path).unwrap()
    };

    point_at(&socket_a);
    let cache = dir.path().join("local.cache").display().to_string();
    let args = serve_args(&upstream, &cache, "local");
    let mut server = Server::start(dir.path(), "disk-a", &args);
    qemu_io(
        &server.uri(),
        &["write -P 0x5a 0 4M".to_string(), "flush".to_string()],
    );
    let address = metrics_address(&server.log_text());
    wait_until("the tier wrote everything back", TIMEOUT, || {
        tier_value(&scrape(&address), "bufcache_tier_dirty_bytes") == 0.0
    });
    server.stop_clean();

    point_at(&socket_b);
    let disk_b_before = read_disk(&socket_b);
    let cache_before = std::fs::read(&cache).unwrap();
    let client_socket = dir.path().join("refused.sock");
    let output = run_timeout(
        bufcache(&[
            "serve",
            "--backend",
            &upstream,
            "--local-cache",
            &cache,
            "--listen",
            &format!("unix:{}", client_socket.display()),
        ]),
        TIMEOUT,
    );
    let text = output_text(&output);
    assert_eq!(output.status.code(), Some(2), "{text}");
    assert!(
        text.contains("sampled clean blocks differ from backend")
            && text.contains(&cache)
            && text.contains("--local-cache"),
        "{text}"
    );
    // "N of M sampled clean blocks differ": N is the third word back.
    let differing: u64 = text
        .find(" sampled clean blocks differ")
        .and_then(|at| text[..at].rsplit(' ').nth(2))
        .and_then(|count| count.parse().ok())
        .unwrap_or_else(|| panic!("no count of differing blocks in: {text}"));
    assert!(differing > 0, "{text}");
    println!("{name}: refused: {}", text.trim());
    assert!(!client_socket.exists(), "no client was served: {text}");
    assert!(read_disk(&socket_b) == disk_b_before, "disk B changed");
    assert!(
        std::fs::read(&cache).unwrap() == cache_before,
        "the cache changed"
    );

    point_at(&socket_a);
    let mut server = Server::start(dir.path(), "disk-a-again", &args);
    qemu_io(
        &server.uri(),
        &[
            "read -P 0x5a 0 4M".to_string(),
            "read -P 0 4M 12M".to_string(),
        ],
    );
    server.stop_clean();
}

const CHUNK_BYTES: usize = 256 << 10;
/// Rounds of the kill -9 test: 48, or LOCAL_TIER_ROUNDS (at most 120, the upstream's room).
fn rounds() -> usize {
    std::env::var("LOCAL_TIER_ROUNDS")
        .map(|rounds| {
            rounds
                .parse::<usize>()
                .expect("LOCAL_TIER_ROUNDS is a number")
                .min(120)
        })
        .unwrap_or(48)
}

/// The writes of round `round`: its own 256 KiB chunk in eight 32 KiB writes of pattern
/// `round % 250 + 1`, then a FLUSH.
fn round_commands(round: usize) -> Vec<String> {
    let mut commands: Vec<String> = (0..8)
        .map(|piece| {
            format!(
                "write -P 0x{:02x} {} {}",
                pattern(round),
                round * CHUNK_BYTES + piece * (CHUNK_BYTES / 8),
                CHUNK_BYTES / 8
            )
        })
        .collect();
    commands.push("flush".into());
    commands
}

/// Checks that `image` (the upstream's bytes) holds the flushed rounds as a prefix: no round
/// has reached it while an earlier flushed round is not complete on it. Returns the last
/// round with any of its data there.
fn assert_round_prefix(image: &[u8], flushed: &[bool], when: &str) -> Option<usize> {
    let chunk = |round: usize| &image[round * CHUNK_BYTES..(round + 1) * CHUNK_BYTES];
    let last = (0..flushed.len())
        .rev()
        .find(|&round| chunk(round).iter().any(|&byte| byte != 0));
    for (round, _) in flushed
        .iter()
        .enumerate()
        .take(last.unwrap_or(0))
        .filter(|(_, flushed)| **flushed)
    {
        assert!(
            chunk(round).iter().all(|&byte| byte == pattern(round)),
            "{when}: the upstream holds data of round {last:?} but not all of flushed round {round}: not a prefix of the flushes"
        );
    }
    last
}

fn pattern(round: usize) -> u8 {
    (round % 250) as u8 + 1
}

#[test]
fn kill_9_rounds_over_a_slow_upstream_keep_every_flush_and_a_prefix_upstream() {
    // Goal: with --flush-to local over a slow upstream (write-back lagging behind the
    // clients), kill -9 at random points never loses a flushed round, and the upstream alone
    // always holds a prefix of the flushed rounds (never a round whose predecessors are not
    // all there). Method: nbdkit memory behind the delay filter (20 ms per write) as the
    // backend; 48 qemu-io rounds (LOCAL_TIER_ROUNDS=N for more), each its own 256 KiB chunk
    // then FLUSH; every fourth round is cut by kill -9 after a varying delay; after each kill the upstream is read directly with
    // nbdcopy and checked, the server restarted and every flushed round read back through it;
    // at the end, once write-back has drained, the upstream holds every flushed round.
    let name = "kill_9_rounds_over_a_slow_upstream_keep_every_flush_and_a_prefix_upstream";
    if !have_tools(name, &["qemu-io", "nbdkit", "nbdcopy"]) {
        return;
    }
    let _timer = Timer::new(name);
    let dir = temp_dir();
    let upstream_socket = dir.path().join("upstream.sock");
    // A kill -9 leaves nbdkit replying to a closed socket: its stderr goes to a file.
    let _nbdkit = QuietChild::spawn(
        &mut cmd(
            "nbdkit",
            &[
                "-f",
                "-U",
                upstream_socket.to_str().unwrap(),
                "--filter=delay",
                "memory",
                "32M",
                "delay-write=20ms",
            ],
        ),
        "nbdkit",
        &dir.path().join("nbdkit.log"),
    );
    wait_until("nbdkit listens", TIMEOUT, || upstream_socket.exists());
    let upstream = format!("nbd+unix:///?socket={}", upstream_socket.display());
    let cache = dir.path().join("local.cache").display().to_string();
    let args = serve_args(&upstream, &cache, "local");
    let image_path = dir.path().join("upstream.img");
    let read_upstream = || {
        let _ = std::fs::remove_file(&image_path);
        run_ok(
            cmd(
                "nbdcopy",
                &[upstream.as_str(), image_path.to_str().unwrap()],
            ),
            TIMEOUT,
        );
        std::fs::read(&image_path).unwrap()
    };
    let mut server = Server::start(dir.path(), "start", &args);
    let rounds = rounds();
    let mut flushed = vec![false; rounds];
    let mut rng = Rng::new(36);
    for round in 0..rounds {
        if round % 4 != 3 {
            qemu_io(&server.uri(), &round_commands(round));
            flushed[round] = true;
            continue;
        }
        let mut client = cmd("qemu-io", &["-f", "raw"]);
        for line in round_commands(round) {
            client.arg("-c").arg(line);
        }
        client.arg(server.uri());
        let mut client = ChildGuard::spawn(
            client
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null()),
            "qemu-io",
        );
        std::thread::sleep(Duration::from_millis(rng.below(12)));
        server.kill9();
        let status = client
            .wait(TIMEOUT)
            .expect("qemu-io ends once the server is gone");
        flushed[round] = status.success();
        let last = assert_round_prefix(
            &read_upstream(),
            &flushed,
            &format!("after the kill in round {round}"),
        );
        eprintln!(
            "round {round}: killed; flushed {}; the upstream holds rounds up to {last:?}",
            flushed[round]
        );
        server = Server::start(dir.path(), &format!("restart-{round}"), &args);
        let reads: Vec<String> = (0..=round)
            .filter(|&earlier| flushed[earlier])
            .map(|earlier| {
                format!(
                    "read -P 0x{:02x} {} {CHUNK_BYTES}",
                    pattern(earlier),
                    earlier * CHUNK_BYTES
                )
            })
            .collect();
        qemu_io(&server.uri(), &reads);
    }
    let address = metrics_address(&server.log_text());
    wait_until("the tier wrote everything back", TIMEOUT, || {
        tier_value(&scrape(&address), "bufcache_tier_dirty_bytes") == 0.0
    });
    server.stop_clean();
    let image = read_upstream();
    assert_round_prefix(&image, &flushed, "at the end");
    for round in (0..rounds).filter(|&round| flushed[round]) {
        let chunk = &image[round * CHUNK_BYTES..(round + 1) * CHUNK_BYTES];
        assert!(
            chunk.iter().all(|&byte| byte == pattern(round)),
            "flushed round {round} is on the upstream"
        );
    }
}

#[test]
fn flush_to_remote_puts_every_flushed_write_on_the_upstream_before_it_returns() {
    // Goal: with --flush-to remote, a FLUSH that returned means the upstream itself holds the
    // writes (flushed), whatever happens to the server and its local cache afterwards.
    // Method: nbdkit memory behind the delay filter as the upstream; qemu-io writes and
    // flushes; kill -9 at once; the upstream, read directly with nbdcopy, has the writes.
    // (With --flush-to local in its place this test fails: write-back is still running.)
    let name = "flush_to_remote_puts_every_flushed_write_on_the_upstream_before_it_returns";
    if !have_tools(name, &["qemu-io", "nbdkit", "nbdcopy"]) {
        return;
    }
    let _timer = Timer::new(name);
    let dir = temp_dir();
    let upstream_socket = dir.path().join("upstream.sock");
    // A kill -9 leaves nbdkit replying to a closed socket: its stderr goes to a file.
    let _nbdkit = QuietChild::spawn(
        &mut cmd(
            "nbdkit",
            &[
                "-f",
                "-U",
                upstream_socket.to_str().unwrap(),
                "--filter=delay",
                "memory",
                "16M",
                "delay-write=10ms",
            ],
        ),
        "nbdkit",
        &dir.path().join("nbdkit.log"),
    );
    wait_until("nbdkit listens", TIMEOUT, || upstream_socket.exists());
    let upstream = format!("nbd+unix:///?socket={}", upstream_socket.display());
    let cache = dir.path().join("local.cache").display().to_string();
    let mut server = Server::start(
        dir.path(),
        "remote",
        &serve_args(&upstream, &cache, "remote"),
    );
    qemu_io(
        &server.uri(),
        &[
            "write -P 0x6b 0 1048576".to_string(),
            "write -P 0x6c 4194304 12345".to_string(),
            "flush".to_string(),
        ],
    );
    server.kill9();
    let image_path = dir.path().join("upstream.img");
    run_ok(
        cmd(
            "nbdcopy",
            &[upstream.as_str(), image_path.to_str().unwrap()],
        ),
        TIMEOUT,
    );
    let image = std::fs::read(&image_path).unwrap();
    assert!(
        image[..1 << 20].iter().all(|&byte| byte == 0x6b),
        "the first write is on the upstream"
    );
    assert!(
        image[4 << 20..(4 << 20) + 12345]
            .iter()
            .all(|&byte| byte == 0x6c),
        "the second write is on the upstream"
    );
}
