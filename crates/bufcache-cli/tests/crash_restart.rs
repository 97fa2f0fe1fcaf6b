//! Goal: `kill -9` of `bufcache serve` in the middle of a write-heavy load never loses a write
//! the client was told is durable (covered by a completed FLUSH, or acknowledged with FUA).
//! Method: two threads (two qemu-io connections, disjoint halves of the export) run rounds
//! of qemu-io (each: 24 unaligned pattern writes, some FUA, some WRITE_ZEROES, then `flush`),
//! recording which rounds completed and which FUA writes were acknowledged; the test kills the
//! server with SIGKILL mid-round, restarts it on the same backing file, reads the whole export
//! back with qemu-img and checks every byte is either its last durable value or the value of a
//! later, unacknowledged write to it. Five iterations with different cache configurations
//! carry the disk forward. A second test checks multi-conn durability: a FLUSH on one
//! connection covers writes completed on another, across kill -9.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;

const EXPORT: usize = 32 << 20;
const WRITES_PER_ROUND: usize = 24;
const WRITERS: usize = 2;

#[derive(Clone, Copy, Debug)]
struct Write {
    offset: usize,
    length: usize,
    /// Fill byte; 0 for WRITE_ZEROES.
    pattern: u8,
    zeroes: bool,
    fua: bool,
}

impl Write {
    fn command(&self) -> String {
        if self.zeroes {
            format!("write -z {} {}", self.offset, self.length)
        } else {
            let fua = if self.fua { "-f " } else { "" };
            format!(
                "write {fua}-P 0x{:02x} {} {}",
                self.pattern, self.offset, self.length
            )
        }
    }
}

/// One qemu-io invocation: its writes and which of them were acknowledged.
struct Round {
    writes: Vec<Write>,
    acknowledged: Vec<bool>,
    /// qemu-io exited 0: every write and the final flush completed.
    flushed: bool,
}

/// The writes of one round inside `[base, base + span)`.
fn plan_round(rng: &mut Rng, round: u64, base: usize, span: usize) -> Vec<Write> {
    let pattern = (round % 254) as u8 + 1;
    (0..WRITES_PER_ROUND)
        .map(|i| {
            let length = match rng.below(4) {
                0 => 1 + rng.below(4096) as usize,
                1 => 4096 * (1 + rng.below(16) as usize),
                _ => 1 + rng.below(256 * 1024) as usize,
            };
            let offset = base + rng.below((span - length) as u64) as usize;
            let zeroes = i % 8 == 5;
            Write {
                offset,
                length,
                pattern: if zeroes { 0 } else { pattern },
                zeroes,
                fua: !zeroes && i % 6 == 1,
            }
        })
        .collect()
}

/// Runs one round; parses qemu-io's per-command output to learn which writes completed.
fn run_round(uri: &str, writes: Vec<Write>) -> Round {
    let mut command = std::process::Command::new(tool("qemu-io"));
    command.args(["-f", "raw"]);
    for write in &writes {
        command.arg("-c").arg(write.command());
    }
    command.args(["-c", "flush", uri]);
    let output = run_timeout(command, Duration::from_secs(60));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let mut acknowledged = Vec::new();
    for line in stdout.lines() {
        if let Some(rest) = line.strip_prefix("wrote ") {
            let write = writes
                .get(acknowledged.len())
                .expect("more results than writes");
            let expected = format!(
                "{}/{} bytes at offset {}",
                write.length, write.length, write.offset
            );
            assert_eq!(rest, expected, "qemu-io output out of step:\n{stdout}");
            acknowledged.push(true);
        } else if line.starts_with("write failed") {
            acknowledged.push(false);
        }
    }
    let flushed = output.status.success();
    if flushed {
        assert_eq!(acknowledged.len(), writes.len(), "{stdout}");
        assert!(acknowledged.iter().all(|a| *a), "{stdout}");
    }
    acknowledged.resize(writes.len(), false);
    Round {
        writes,
        acknowledged,
        flushed,
    }
}

/// The bytes a write may have left behind that are not yet durable.
#[derive(Clone, Copy, Debug)]
struct Pending {
    start: usize,
    end: usize,
    pattern: u8,
}

/// Removes `[start, end)` from every pending range (a later durable write supersedes them).
fn supersede(pending: &mut Vec<Pending>, start: usize, end: usize) {
    let mut kept = Vec::with_capacity(pending.len() + 1);
    for p in pending.drain(..) {
        if p.end <= start || end <= p.start {
            kept.push(p);
            continue;
        }
        if p.start < start {
            kept.push(Pending { end: start, ..p });
        }
        if end < p.end {
            kept.push(Pending { start: end, ..p });
        }
    }
    *pending = kept;
}

/// Applies finished rounds to `durable` and returns what unacknowledged writes may have left.
fn settle(durable: &mut [u8], rounds: &[Round]) -> Vec<Pending> {
    let mut pending: Vec<Pending> = Vec::new();
    for round in rounds {
        for (write, acknowledged) in round.writes.iter().zip(&round.acknowledged) {
            let (start, end) = (write.offset, write.offset + write.length);
            if round.flushed || (*acknowledged && write.fua) {
                // Durable: the last durable value, superseding earlier non-durable ones.
                durable[start..end].fill(write.pattern);
                supersede(&mut pending, start, end);
            } else {
                // Sent, maybe applied, maybe not: acknowledged without FUA or in flight.
                pending.push(Pending {
                    start,
                    end,
                    pattern: write.pattern,
                });
            }
        }
    }
    pending
}

/// Every byte of `actual` is its durable value or the value of a pending write covering it.
fn check(durable: &[u8], pending: &[Pending], actual: &[u8]) -> Result<usize, String> {
    let mut from_pending = 0;
    for (index, (want, got)) in durable.iter().zip(actual).enumerate() {
        if want == got {
            continue;
        }
        if pending
            .iter()
            .any(|p| p.start <= index && index < p.end && p.pattern == *got)
        {
            from_pending += 1;
            continue;
        }
        return Err(format!(
            "byte {index}: read {got:#04x}, durable value {want:#04x}, pending writes there: {:?}",
            pending
                .iter()
                .filter(|p| p.start <= index && index < p.end)
                .collect::<Vec<_>>()
        ));
    }
    Ok(from_pending)
}

#[test]
fn settle_tracks_durable_and_pending_writes() {
    let mut durable = vec![0u8; 100];
    let write = |offset, length, pattern, fua| Write {
        offset,
        length,
        pattern,
        zeroes: false,
        fua,
    };
    let rounds = vec![
        Round {
            writes: vec![write(0, 10, 1, false)],
            acknowledged: vec![true],
            flushed: true,
        },
        Round {
            writes: vec![
                write(5, 10, 2, false),
                write(8, 4, 3, true),
                write(50, 5, 4, true),
            ],
            acknowledged: vec![true, true, false],
            flushed: false,
        },
    ];
    let pending = settle(&mut durable, &rounds);
    assert_eq!(
        &durable[0..15],
        &[1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 0, 0, 0]
    );
    let mut actual = durable.clone();
    actual[5] = 2; // the unflushed write may have landed
    actual[13] = 2;
    actual[52] = 4; // the unacknowledged FUA write too
    assert_eq!(check(&durable, &pending, &actual), Ok(3));
    actual[9] = 2; // but not under the acknowledged FUA write
    assert!(check(&durable, &pending, &actual).is_err());
}

#[test]
fn kill_9_during_writes_keeps_every_flushed_write() {
    let _timer = Timer::new("kill_9_during_writes_keeps_every_flushed_write");
    if !have_tools("kill_9_during_writes", &["qemu-io", "qemu-img"]) {
        return;
    }
    let dir = temp_dir();
    let backing = dir.path().join("disk.img");
    write_file(&backing, &vec![0u8; EXPORT]);
    let mut durable = vec![0u8; EXPORT];
    let configurations: [&[&str]; 5] = [
        &[],
        &["--cache-size", "8M"],
        &["--dirty-age-max", "0.05"],
        &["--cache-size", "4M", "--no-write-behind"],
        &["--cache-size", "16M", "--dirty-background-percent", "5"],
    ];
    let mut round_number = 0u64;
    for (iteration, extra) in configurations.iter().enumerate() {
        let mut args = vec!["--backend", "disk.img"];
        args.extend_from_slice(extra);
        let mut server = Server::start(dir.path(), &format!("load{iteration}"), &args);
        let uri = server.uri();
        let stop = Arc::new(AtomicBool::new(false));
        let completed = Arc::new(AtomicUsize::new(0));
        // Two connections write at once, each in its own half of the export, so each one's
        // FLUSH covers exactly its own writes.
        let writers: Vec<_> = (0..WRITERS)
            .map(|writer| {
                let (stop, completed, uri) = (stop.clone(), completed.clone(), uri.clone());
                let mut rng = Rng::new(1000 + (iteration * WRITERS + writer) as u64);
                let first_round = round_number;
                let span = EXPORT / WRITERS;
                std::thread::spawn(move || {
                    let mut rounds = Vec::new();
                    let mut number = first_round;
                    while !stop.load(Ordering::Acquire) {
                        number += 1;
                        let writes = plan_round(
                            &mut rng,
                            number * WRITERS as u64 + writer as u64,
                            writer * span,
                            span,
                        );
                        let round = run_round(&uri, writes);
                        let flushed = round.flushed;
                        rounds.push(round);
                        if !flushed {
                            break;
                        }
                        completed.fetch_add(1, Ordering::AcqRel);
                    }
                    (number, rounds)
                })
            })
            .collect();
        // Let a few rounds complete, then kill somewhere inside later rounds.
        let warmup = WRITERS * (3 + iteration);
        wait_until("rounds to complete", Duration::from_secs(120), || {
            completed.load(Ordering::Acquire) >= warmup
        });
        let mut rng = Rng::new(77 + iteration as u64);
        std::thread::sleep(Duration::from_millis(rng.below(120)));
        server.kill9();
        stop.store(true, Ordering::Release);
        let mut pending = Vec::new();
        let mut rounds_run = 0;
        let mut flushed_rounds = 0;
        for writer in writers {
            let (number, rounds) = writer.join().expect("writer thread");
            round_number = round_number.max(number);
            rounds_run += rounds.len();
            flushed_rounds += rounds.iter().filter(|r| r.flushed).count();
            pending.extend(settle(&mut durable, &rounds));
        }

        // Restart on the same backing file and read everything back through the server.
        let mut server = Server::start(dir.path(), &format!("check{iteration}"), &args);
        let out = dir.path().join("out.raw");
        run_ok(
            cmd(
                "qemu-img",
                &[
                    "convert",
                    "-f",
                    "raw",
                    "-O",
                    "raw",
                    &server.uri(),
                    out.to_str().unwrap(),
                ],
            ),
            Duration::from_secs(120),
        );
        let actual = std::fs::read(&out).unwrap();
        assert_eq!(actual.len(), EXPORT);
        match check(&durable, &pending, &actual) {
            Ok(from_pending) => eprintln!(
                "iteration {iteration} {extra:?}: {rounds_run} rounds ({flushed_rounds} flushed) \
                 before kill -9; all durable data present; {from_pending} bytes from \
                 unacknowledged writes"
            ),
            Err(message) => panic!(
                "iteration {iteration} {extra:?}: after kill -9 and restart, durable data is \
                 lost: {message}\nserver log:\n{}",
                server.log_text()
            ),
        }
        server.stop_clean();
        // The backing file holds exactly what the restarted server served.
        let on_disk = std::fs::read(&backing).unwrap();
        assert_same_bytes(&actual, &on_disk, "backing file after the checking server");
        // What is there now is the new durable state.
        durable = actual;
    }
}

#[test]
fn flush_on_one_connection_covers_writes_completed_on_another() {
    let _timer = Timer::new("flush_on_one_connection_covers_writes_completed_on_another");
    // The server advertises multi-conn: a FLUSH on any connection makes every write completed
    // on any connection durable. Connection A writes, connection B flushes, then kill -9.
    let dir = temp_dir();
    let backing = dir.path().join("disk.img");
    write_file(&backing, &vec![0u8; EXPORT]);
    for (iteration, extra) in [&[][..], &["--cache-size", "4M"][..]].iter().enumerate() {
        let mut args = vec!["--backend", "disk.img", "--no-write-behind"];
        args.extend_from_slice(extra);
        let mut server = Server::start(dir.path(), &format!("load{iteration}"), &args);
        let writer = bufcache_nbd::NbdClient::connect(&server.uri()).expect("connecting A");
        let flusher = bufcache_nbd::NbdClient::connect(&server.uri()).expect("connecting B");
        assert!(
            writer
                .export_info()
                .has_flag(bufcache_nbd::protocol::TRANSMIT_CAN_MULTI_CONN),
            "multi-conn is not advertised"
        );
        let mut model = std::fs::read(&backing).unwrap();
        let mut rng = Rng::new(500 + iteration as u64);
        for _ in 0..64 {
            let length = 1 + rng.below(200_000) as usize;
            let offset = rng.below((EXPORT - length) as u64) as usize;
            let data = random_bytes(length, rng.next_u64());
            writer.write(offset as u64, &data).unwrap();
            model[offset..offset + length].copy_from_slice(&data);
        }
        flusher.flush().expect("FLUSH on the other connection");
        server.kill9();
        drop((writer, flusher));
        let mut server = Server::start(dir.path(), &format!("check{iteration}"), &args);
        let reader = bufcache_nbd::NbdClient::connect(&server.uri()).expect("connecting");
        let mut actual = vec![0u8; EXPORT];
        reader.read(0, &mut actual).unwrap();
        assert_same_bytes(
            &model,
            &actual,
            "after FLUSH on another connection and kill -9",
        );
        drop(reader);
        server.stop_clean();
    }
}
