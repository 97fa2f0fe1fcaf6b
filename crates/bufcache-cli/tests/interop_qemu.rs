//! Goal: QEMU's NBD client (qemu-img, qemu-io) works against `bufcache serve` over a backing
//! file. Method: start the real binary on a private unix socket, drive it with qemu-img
//! info/convert and qemu-io pattern writes and reads (unaligned, cross-block, aio), and compare
//! against a model of the expected bytes, through the server and in the backing file after a
//! clean SIGTERM shutdown.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;

const TIMEOUT: Duration = Duration::from_secs(120);

/// Runs qemu-io with `commands` against `uri`; asserts exit 0 and no failed verification.
fn qemu_io(uri: &str, commands: &[String]) -> String {
    let mut command = Command::new(tool("qemu-io"));
    command.args(["-f", "raw"]);
    for line in commands {
        command.arg("-c").arg(line);
    }
    command.arg(uri);
    let output = run_ok(&mut command, TIMEOUT);
    let text = output_text(&output);
    assert!(
        !text.contains("failed") && !text.contains("error"),
        "qemu-io reported a failure:\n{text}"
    );
    text
}

/// `read -P` commands covering the whole model, one per run of equal bytes.
fn read_commands_for(model: &[u8]) -> Vec<String> {
    let mut commands = Vec::new();
    let mut start = 0usize;
    while start < model.len() {
        let value = model[start];
        let mut end = start + 1;
        while end < model.len() && model[end] == value {
            end += 1;
        }
        commands.push(format!("read -P 0x{value:02x} {start} {}", end - start));
        start = end;
    }
    commands
}

fn apply(model: &mut [u8], pattern: u8, offset: usize, length: usize) {
    model[offset..offset + length].fill(pattern);
}

fn create_backing(path: &Path, length: usize, fill: u8) {
    write_file(path, &vec![fill; length]);
}

#[test]
fn qemu_img_info_reports_raw_and_the_export_size() {
    let _timer = Timer::new("qemu_img_info_reports_raw_and_the_export_size");
    if !have_tools("qemu_img_info", &["qemu-img"]) {
        return;
    }
    let dir = temp_dir();
    let mut server = Server::start(
        dir.path(),
        "srv",
        &["--backend", "disk.img", "--create-size", "48M"],
    );
    let output = run_ok(
        cmd("qemu-img", &["info", "--output=json", &server.uri()]),
        TIMEOUT,
    );
    let info: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("qemu-img info JSON");
    assert_eq!(info["virtual-size"], 48u64 << 20, "{info}");
    assert_eq!(info["format"], "raw", "{info}");
    let human = run_ok(cmd("qemu-img", &["info", &server.uri()]), TIMEOUT);
    let text = output_text(&human);
    assert!(
        text.contains("virtual size: 48 MiB (50331648 bytes)"),
        "{text}"
    );
    server.stop_clean();
}

#[test]
fn qemu_img_convert_into_and_out_of_the_export_preserves_every_byte() {
    let _timer = Timer::new("qemu_img_convert_into_and_out_of_the_export");
    if !have_tools("qemu_img_convert", &["qemu-img"]) {
        return;
    }
    const EXPORT: usize = 32 << 20;
    const SOURCE: usize = 24 << 20;
    let dir = temp_dir();
    // The backing file starts full of 0xee so zero runs in the source must really be written.
    let backing = dir.path().join("disk.img");
    create_backing(&backing, EXPORT, 0xee);
    let mut source = random_bytes(SOURCE, 7);
    source[8 << 20..12 << 20].fill(0); // a large zero run: qemu-img writes it as WRITE_ZEROES
    for i in 0..16usize {
        let at = (13 << 20) + i * 300_000;
        source[at..at + 65_536].fill(0);
    }
    let source_path = dir.path().join("source.raw");
    write_file(&source_path, &source);

    let mut server = Server::start(dir.path(), "srv", &["--backend", "disk.img"]);
    let uri = server.uri();
    run_ok(
        cmd(
            "qemu-img",
            &[
                "convert",
                "-n",
                "-f",
                "raw",
                "-O",
                "raw",
                source_path.to_str().unwrap(),
                &uri,
            ],
        ),
        TIMEOUT,
    );
    let mut expected = source.clone();
    expected.resize(EXPORT, 0xee);

    let out_path = dir.path().join("out.raw");
    run_ok(
        cmd(
            "qemu-img",
            &[
                "convert",
                "-f",
                "raw",
                "-O",
                "raw",
                &uri,
                out_path.to_str().unwrap(),
            ],
        ),
        TIMEOUT,
    );
    let out = std::fs::read(&out_path).unwrap();
    eprintln!(
        "source checksum {:016x}, converted back {:016x}",
        checksum(&expected),
        checksum(&out)
    );
    assert_same_bytes(&expected, &out, "qemu-img convert out of the export");

    server.stop_clean();
    let on_disk = std::fs::read(&backing).unwrap();
    assert_same_bytes(&expected, &on_disk, "backing file after SIGTERM");
}

#[test]
fn qemu_io_unaligned_cross_block_writes_read_back_everywhere() {
    let _timer = Timer::new("qemu_io_unaligned_cross_block_writes_read_back_everywhere");
    if !have_tools("qemu_io_unaligned", &["qemu-io"]) {
        return;
    }
    const EXPORT: usize = 32 << 20;
    let dir = temp_dir();
    let backing = dir.path().join("disk.img");
    create_backing(&backing, EXPORT, 0);
    let mut server = Server::start(dir.path(), "srv", &["--backend", "disk.img"]);
    let uri = server.uri();

    // (pattern, offset, length): unaligned, crossing 4 KiB blocks, 64 KiB buffers, 1 MiB
    // clusters, overlapping each other, and touching both ends of the export.
    let writes: [(u8, usize, usize); 12] = [
        (0xab, 1000, 7777),
        (0xcd, 4095, 2),
        (0x22, 5000, 3000),
        (0x5a, 65_535, 131_073),
        (0x77, 1_048_575, 3),
        (0x33, 1_000_000, 100_000),
        (0x44, 3 * 1_048_576 - 511, 2 * 1_048_576 + 1023),
        (0x01, EXPORT - 1, 1),
        (0x02, 0, 1),
        (0x66, 12_345_678, 1),
        (0x99, 20_000_001, 4_194_305),
        (0x9a, 22_000_000, 10),
    ];
    let mut model = vec![0u8; EXPORT];
    let mut commands = Vec::new();
    for &(pattern, offset, length) in &writes {
        commands.push(format!("write -P 0x{pattern:02x} {offset} {length}"));
        apply(&mut model, pattern, offset, length);
    }
    // Read back each write's own surviving bytes right away, in the same connection.
    commands.push("read -P 0xab 1000 3095".to_string());
    commands.push("read -P 0xcd 4095 2".to_string());
    commands.push("read -P 0x22 5000 3000".to_string());
    commands.push("read -P 0xab 8000 777".to_string());
    commands.push("read -P 0x0 8777 56758".to_string());
    let text = qemu_io(&uri, &commands);
    assert_eq!(text.matches("wrote ").count(), writes.len(), "{text}");

    // A new connection reads the whole export, run by run, against the model.
    let reads = read_commands_for(&model);
    let text = qemu_io(&uri, &reads);
    assert_eq!(text.matches("read ").count(), reads.len(), "{text}");

    // Clean shutdown writes everything back; a restarted server serves the same bytes.
    server.stop_clean();
    let on_disk = std::fs::read(&backing).unwrap();
    assert_same_bytes(&model, &on_disk, "backing file after SIGTERM");
    let mut server = Server::start(dir.path(), "srv2", &["--backend", "disk.img"]);
    qemu_io(&server.uri(), &reads);
    server.stop_clean();
}

#[test]
fn qemu_io_aio_writes_then_flush_then_reads() {
    let _timer = Timer::new("qemu_io_aio_writes_then_flush_then_reads");
    if !have_tools("qemu_io_aio", &["qemu-io"]) {
        return;
    }
    const EXPORT: usize = 16 << 20;
    let dir = temp_dir();
    let backing = dir.path().join("disk.img");
    create_backing(&backing, EXPORT, 0xff);
    // A small cache, so the aio burst also exercises write-back under memory pressure.
    let mut server = Server::start(
        dir.path(),
        "srv",
        &["--backend", "disk.img", "--cache-size", "4M"],
    );
    let uri = server.uri();
    let mut model = vec![0xffu8; EXPORT];
    let mut commands = Vec::new();
    let mut reads = Vec::new();
    // 48 concurrent, non-overlapping, unaligned writes (overlapping in-flight writes have no
    // defined order), then aio_flush, then a synchronous flush.
    for i in 0..48usize {
        let pattern = (i as u8).wrapping_mul(5).wrapping_add(1);
        let offset = i * 333_333 + 17;
        let length = 65_536 + i * 1_111;
        commands.push(format!("aio_write -P 0x{pattern:02x} {offset} {length}"));
        reads.push(format!("read -P 0x{pattern:02x} {offset} {length}"));
        apply(&mut model, pattern, offset, length);
    }
    commands.push("aio_flush".to_string());
    commands.push("flush".to_string());
    commands.extend(reads.iter().cloned());
    let text = qemu_io(&uri, &commands);
    assert_eq!(text.matches("wrote ").count(), 48, "{text}");
    assert_eq!(text.matches("read ").count(), 48, "{text}");

    // Aio reads of the whole export from another connection, against the model.
    let mut aio_reads: Vec<String> = read_commands_for(&model)
        .into_iter()
        .map(|line| line.replacen("read", "aio_read", 1))
        .collect();
    aio_reads.push("aio_flush".to_string());
    let text = qemu_io(&uri, &aio_reads);
    assert_eq!(text.matches("read ").count(), aio_reads.len() - 1, "{text}");

    server.stop_clean();
    let on_disk = std::fs::read(&backing).unwrap();
    assert_same_bytes(&model, &on_disk, "backing file after SIGTERM");
}

#[test]
fn qemu_io_zeroes_and_discards_leave_neighbouring_bytes_alone() {
    let _timer = Timer::new("qemu_io_zeroes_and_discards_leave_neighbouring_bytes_alone");
    if !have_tools("qemu_io_zeroes_and_discards", &["qemu-io"]) {
        return;
    }
    const EXPORT: usize = 8 << 20;
    // Block sizes around the unaligned ranges, O_DIRECT (aligned-buffer) file I/O, and a file
    // worker pool (write-back on the workers while zeroing and discards run in the caller's
    // thread), with and without O_DIRECT, and an io_uring, with and without O_DIRECT.
    let configurations: [&[&str]; 8] = [
        &[],
        &["--block-size", "512"],
        &["--block-size", "64k"],
        &["--direct"],
        &["--file-io-threads", "4"],
        &["--direct", "--file-io-threads", "2"],
        &["--file-io-uring-depth", "32"],
        &["--direct", "--file-io-uring-depth", "8"],
    ];
    for extra in configurations {
        let dir = temp_dir();
        let backing = dir.path().join("disk.img");
        create_backing(&backing, EXPORT, 0x11);
        let mut args = vec!["--backend", "disk.img"];
        args.extend_from_slice(extra);
        let mut server = Server::start(dir.path(), "srv", &args);
        let uri = server.uri();
        let mut model = vec![0x11u8; EXPORT];
        let mut commands = Vec::new();
        // WRITE_ZEROES (with and without unmap) over unaligned ranges; writes around them.
        for (i, (offset, length)) in [
            (1000usize, 5000usize),
            (65_535, 65_538),
            (1_048_577, 3_000_000),
            (5_000_000, 1),
        ]
        .into_iter()
        .enumerate()
        {
            let unmap = if i % 2 == 0 { "-u " } else { "" };
            commands.push(format!("write -z {unmap}{offset} {length}"));
            apply(&mut model, 0, offset, length);
        }
        commands.push("write -P 0x22 7000 100".to_string());
        apply(&mut model, 0x22, 7000, 100);
        let text = qemu_io(&uri, &commands);
        assert_eq!(text.matches("wrote ").count(), 5, "{extra:?}: {text}");
        // Discards (TRIM) of unaligned ranges: the discarded bytes are unspecified, but
        // everything outside them must be untouched.
        let discards = [(6_000_000usize, 10_001usize), (6_500_123, 300_000)];
        let discard_commands: Vec<String> = discards
            .iter()
            .map(|(offset, length)| format!("discard {offset} {length}"))
            .collect();
        qemu_io(&uri, &discard_commands);
        let outside = |index: usize| {
            !discards
                .iter()
                .any(|(offset, length)| *offset <= index && index < offset + length)
        };
        let mut reads = Vec::new();
        let mut start = 0usize;
        while start < EXPORT {
            if !outside(start) {
                start += 1;
                continue;
            }
            let value = model[start];
            let mut end = start + 1;
            while end < EXPORT && model[end] == value && outside(end) {
                end += 1;
            }
            reads.push(format!("read -P 0x{value:02x} {start} {}", end - start));
            start = end;
        }
        qemu_io(&uri, &reads);
        server.stop_clean();
        let on_disk = std::fs::read(&backing).unwrap();
        for (index, (want, got)) in model.iter().zip(&on_disk).enumerate() {
            if outside(index) && want != got {
                panic!("{extra:?}: backing file byte {index} is {got:#x}, expected {want:#x}");
            }
        }
    }
}
