// Goal: NbdClient is a correct, pipelined, fail-fast upstream device. Method: drive it from
// several threads against nbdkit (memory plugin, with the stats filter counting what reached
// the backend) and against our own server, through both its own API and bufcache's Device
// trait; kill servers under it and check that callers get errors naming the URI, not hangs.

mod common;

use std::io::{IoSlice, IoSliceMut};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bufcache::{Device, ReadRequest};
use bufcache_nbd::{ClientError, Export, MemoryExport, NbdClient, ServerConfig};
use common::*;

/// Eight threads each write then read back 1 MiB in 64 KiB pieces at their own offsets.
fn hammer(client: &Arc<NbdClient>) {
    let threads: Vec<_> = (0..8u64)
        .map(|index| {
            let client = Arc::clone(client);
            std::thread::spawn(move || {
                let base = index << 20;
                let data = pattern_bytes(1 << 20, index + 1);
                for (piece, chunk) in data.chunks(65536).enumerate() {
                    client.write(base + piece as u64 * 65536, chunk).unwrap();
                }
                let mut back = vec![0u8; 1 << 20];
                client.read(base, &mut back).unwrap();
                assert!(back == data, "thread {index} read back different data");
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
    client.flush().unwrap();
}

#[test]
fn pipelined_io_against_nbdkit_memory() {
    let Some(nbdkit) = Nbdkit::start(&["memory", "64M"]) else {
        return;
    };
    let client = Arc::new(NbdClient::connect(&nbdkit.uri()).unwrap());
    assert_eq!(client.size(), 64 << 20);
    assert!(client.export_info().structured_replies);
    assert!(client.export_info().base_allocation_id.is_some());
    hammer(&client);
    // Block status: the first 8 MiB hold data, the rest was never written.
    let extents = client.block_status(0, 64 << 20).unwrap();
    assert_eq!(
        extents.iter().map(|extent| extent.length).sum::<u64>(),
        64 << 20
    );
    assert!(!extents[0].hole);
    assert!(extents.last().unwrap().hole && extents.last().unwrap().zero);
    client.write_fua(12345, b"durable").unwrap();
    client.zero(8 << 20, 1 << 20, true).unwrap();
    client.trim(9 << 20, 1 << 20).unwrap();
    client.cache(0, 1 << 20).unwrap();
}

#[test]
fn nbdkit_stats_show_what_reached_the_backend() {
    let Some(stats_directory) = tempfile::tempdir().ok() else {
        return;
    };
    let stats_path = stats_directory.path().join("stats.txt");
    let stats_argument = format!("statsfile={}", stats_path.display());
    let Some(mut nbdkit) =
        Nbdkit::start(&["--filter=stats", "memory", "64M", stats_argument.as_str()])
    else {
        return;
    };
    let client = Arc::new(NbdClient::connect(&nbdkit.uri()).unwrap());
    hammer(&client);
    client.zero(8 << 20, 1 << 20, true).unwrap();
    drop(client);
    nbdkit.stop();
    let stats = std::fs::read_to_string(&stats_path).expect("stats file");
    // 8 threads × 16 writes of 64 KiB, one read of 1 MiB each, one zero, one flush.
    assert!(stats.contains("write: 128 ops"), "{stats}");
    assert!(stats.contains("read: 8 ops"), "{stats}");
    assert!(stats.contains("zero: 1 ops"), "{stats}");
    assert!(stats.contains("flush: 1 ops"), "{stats}");
}

#[test]
fn concurrent_device_flushes_share_upstream_flushes() {
    // Goal: flushes asked for while one is in flight share the next FLUSH upstream (group
    // commit) and every caller still gets an answer. Method: 16 threads each write, then
    // flush through the Device interface, 4 times, against nbdkit's file plugin (FLUSH is
    // fdatasync, which takes a while) with the stats filter; fewer FLUSHes than the 64
    // asked for reach the plugin, and every write is there.
    let Some(directory) = tempfile::tempdir().ok() else {
        return;
    };
    let stats_path = directory.path().join("stats.txt");
    let stats_argument = format!("statsfile={}", stats_path.display());
    let disk_path = directory.path().join("disk.raw");
    std::fs::File::create(&disk_path)
        .and_then(|file| file.set_len(8 << 20))
        .expect("backing file");
    let disk_argument = format!("file={}", disk_path.display());
    let Some(mut nbdkit) = Nbdkit::start(&[
        "--filter=stats",
        "file",
        disk_argument.as_str(),
        stats_argument.as_str(),
    ]) else {
        return;
    };
    let client = Arc::new(NbdClient::connect(&nbdkit.uri()).unwrap());
    // Each round's flushes are asked for together, so they overlap even on a loaded machine.
    let together = Arc::new(std::sync::Barrier::new(16));
    let threads: Vec<_> = (0..16u64)
        .map(|index| {
            let (client, together) = (Arc::clone(&client), Arc::clone(&together));
            std::thread::spawn(move || {
                for round in 0..4u64 {
                    let offset = (index * 4 + round) << 16;
                    let data = pattern_bytes(65536, index * 4 + round + 1);
                    client
                        .write_vectored_at(&[IoSlice::new(&data)], offset)
                        .unwrap();
                    together.wait();
                    Device::flush(&*client).unwrap();
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
    for chunk in 0..64u64 {
        let mut back = vec![0u8; 65536];
        client.read(chunk << 16, &mut back).unwrap();
        assert!(back == pattern_bytes(65536, chunk + 1), "chunk {chunk}");
    }
    drop(client);
    nbdkit.stop();
    let stats = std::fs::read_to_string(&stats_path).expect("stats file");
    let flushes: u64 = stats
        .lines()
        .find_map(|line| line.trim().strip_prefix("flush: "))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|count| count.parse().ok())
        .unwrap_or_else(|| panic!("no flush count in {stats}"));
    assert!(
        (1..64).contains(&flushes),
        "64 concurrent flushes reached nbdkit as {flushes}: {stats}"
    );
}

#[test]
fn pipelined_io_against_our_server_over_tcp_and_unix() {
    let (server, export) = memory_server(16 << 20);
    for uri in [server.tcp_uri("mem"), server.unix_uri("mem")] {
        let client = Arc::new(NbdClient::connect(&uri).unwrap());
        assert_eq!(client.export_info().block_size_max, 32 << 20);
        assert!(client.export_info().can_multi_conn());
        hammer(&client);
    }
    let mut direct = vec![0u8; 1 << 20];
    export.read(3 << 20, &mut direct).unwrap();
    assert!(direct == pattern_bytes(1 << 20, 4));
}

#[test]
fn device_trait_round_trips_vectored_io_split_across_requests() {
    let config = ServerConfig {
        request_size_max: 4096,
        inflight_bytes_max: 1 << 20,
        ..ServerConfig::default()
    };
    let export = Arc::new(MemoryExport::new(1 << 20));
    let server = start_server_with(vec![("mem", export as Arc<dyn Export>)], config);
    let client = NbdClient::connect(&server.tcp_uri("mem")).unwrap();
    let device: &dyn Device = &client;
    assert_eq!(device.len(), 1 << 20);
    assert_eq!(device.describe(), server.tcp_uri("mem"));
    // Three slices of odd sizes, 10 000 bytes in all: three pieces on the wire.
    let first = pattern_bytes(3000, 1);
    let second = pattern_bytes(5001, 2);
    let third = pattern_bytes(1999, 3);
    let slices = [
        IoSlice::new(&first),
        IoSlice::new(&second),
        IoSlice::new(&third),
    ];
    device.write_vectored_at(&slices, 777).unwrap();
    let mut back_first = vec![0u8; 6000];
    let mut back_second = vec![0u8; 4000];
    let mut buffers = [
        IoSliceMut::new(&mut back_first),
        IoSliceMut::new(&mut back_second),
    ];
    device.read_vectored_at(&mut buffers, 777).unwrap();
    let expected: Vec<u8> = [first, second, third].concat();
    assert!([back_first, back_second].concat() == expected);
    device.flush().unwrap();
    device.discard(0, 65536).unwrap();
    device.write_zeroes(65536, 65536).unwrap();
    assert!(device.capabilities().write_zeroes_fast);
    let extents = device.extents(0, 1 << 20).unwrap();
    assert_eq!(
        extents.iter().map(|extent| extent.length).sum::<u64>(),
        1 << 20
    );
    assert!(extents[0].hole, "{extents:?}");
    let past_end = device.read_vectored_at(&mut [IoSliceMut::new(&mut [0u8; 2])], (1 << 20) - 1);
    assert_eq!(
        past_end.unwrap_err().kind(),
        std::io::ErrorKind::InvalidInput
    );
}

#[test]
fn server_errors_name_the_uri_and_the_request() {
    let export = Arc::new(MemoryExport::new(1 << 20).with_read_only(true));
    let server = start_server(vec![("ro", export as Arc<dyn Export>)]);
    let uri = server.tcp_uri("ro");
    let client = NbdClient::connect(&uri).unwrap();
    let error = client.write(1 << 16, &[0u8; 4096]).unwrap_err();
    let message = error.to_string();
    assert!(
        message.starts_with(&format!("{uri}: WRITE 4096 bytes at 65536 failed: EPERM")),
        "{message}"
    );
    let io_error = std::io::Error::from(error);
    assert_eq!(io_error.kind(), std::io::ErrorKind::PermissionDenied);
}

#[test]
fn connect_errors_are_clear() {
    let error = NbdClient::connect("http://example/").unwrap_err();
    assert!(matches!(error, ClientError::Uri(_)), "{error}");
    let (server, _export) = memory_server(1 << 20);
    let error = NbdClient::connect(&server.tcp_uri("missing")).unwrap_err();
    let message = error.to_string();
    assert!(message.contains("unknown export"), "{message}");
    assert!(message.contains("missing"), "{message}");
    let directory = tempfile::tempdir().unwrap();
    let uri = format!(
        "nbd+unix:///x?socket={}",
        directory.path().join("none").display()
    );
    let message = NbdClient::connect(&uri).unwrap_err().to_string();
    assert!(
        message.starts_with(&format!("{uri}: cannot connect")),
        "{message}"
    );
}

#[test]
fn a_dying_server_fails_pending_and_later_requests_without_hanging() {
    let Some(mut nbdkit) = Nbdkit::start(&["--filter=delay", "memory", "64M", "rdelay=2"]) else {
        return;
    };
    let client = Arc::new(NbdClient::connect(&nbdkit.uri()).unwrap());
    let reader = {
        let client = Arc::clone(&client);
        std::thread::spawn(move || client.read(0, &mut [0u8; 4096]))
    };
    std::thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    nbdkit.kill();
    let pending = reader.join().unwrap().unwrap_err().to_string();
    assert!(
        pending.contains("READ 4096 bytes at 0 failed: connection lost"),
        "{pending}"
    );
    assert!(pending.starts_with(&nbdkit.uri()), "{pending}");
    let later = client.write(0, b"x").unwrap_err().to_string();
    assert!(later.contains("connection lost"), "{later}");
    assert!(started.elapsed() < Duration::from_secs(5));
}

/// A memory export whose reads take 300 ms, to keep a request in flight.
struct SlowExport(MemoryExport);

impl Export for SlowExport {
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn read_only(&self) -> bool {
        false
    }
    fn read(&self, offset: u64, buffer: &mut [u8]) -> std::io::Result<()> {
        std::thread::sleep(Duration::from_millis(300));
        self.0.read(offset, buffer)
    }
    fn read_with(
        &self,
        offset: u64,
        buffer: &mut [u8],
        send: &mut bufcache_nbd::ReadSink<'_>,
    ) -> std::io::Result<()> {
        bufcache_nbd::read_via_buffer(self, offset, buffer, send)
    }
    fn read_is_quick(&self, _offset: u64, _length: u64) -> bool {
        false
    }
    fn start_read(
        &self,
        _offset: u64,
        _length: u32,
        done: bufcache_nbd::ReadDone,
    ) -> Result<(), bufcache_nbd::ReadDone> {
        bufcache_nbd::never_start_read(done)
    }
    fn write_is_quick(&self, _offset: u64, _length: u64, _fua: bool) -> bool {
        false
    }
    fn write_from(
        &self,
        offset: u64,
        length: u64,
        fua: bool,
        source: &mut bufcache_nbd::export::WriteSource<'_>,
    ) -> std::io::Result<()> {
        bufcache_nbd::write_via_buffer(self, offset, length, fua, source)
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> std::io::Result<()> {
        self.0.write(offset, data, fua)
    }
    fn flush(&self) -> std::io::Result<()> {
        Ok(())
    }
    fn trim(&self, offset: u64, length: u64, fua: bool) -> std::io::Result<()> {
        self.0.trim(offset, length, fua)
    }
    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        may_trim: bool,
        fast_only: bool,
        fua: bool,
    ) -> std::io::Result<()> {
        self.0
            .write_zeroes(offset, length, may_trim, fast_only, fua)
    }
    fn cache(&self, offset: u64, length: u64) -> std::io::Result<()> {
        self.0.cache(offset, length)
    }
    fn cache_request_bytes_max(&self) -> u64 {
        self.0.cache_request_bytes_max()
    }
    fn block_status(
        &self,
        offset: u64,
        length: u64,
    ) -> std::io::Result<Vec<bufcache_nbd::BlockStatusExtent>> {
        self.0.block_status(offset, length)
    }

    fn has_cache_state(&self) -> bool {
        false
    }

    fn cache_state(
        &self,
        _offset: u64,
        _length: u64,
    ) -> std::io::Result<Vec<bufcache_nbd::CacheStateExtent>> {
        bufcache_nbd::no_cache_state()
    }

    fn known_zeroes(&self, _offset: u64, _length: u64) -> Vec<(u64, u64)> {
        Vec::new()
    }
}

#[test]
fn server_shutdown_answers_in_flight_requests_then_closes() {
    let export = Arc::new(SlowExport(MemoryExport::new(1 << 20)));
    let server = start_server(vec![("mem", export as Arc<dyn Export>)]);
    let client = Arc::new(NbdClient::connect(&server.tcp_uri("mem")).unwrap());
    client.write(0, b"before shutdown").unwrap();
    let reader = {
        let client = Arc::clone(&client);
        std::thread::spawn(move || {
            let mut buffer = [0u8; 15];
            client.read(0, &mut buffer).map(|()| buffer)
        })
    };
    std::thread::sleep(Duration::from_millis(100));
    // Triggers shutdown and waits for the server: the in-flight read is answered first.
    drop(server);
    assert_eq!(&reader.join().unwrap().unwrap(), b"before shutdown");
    let error = client.read(0, &mut [0u8; 4]).unwrap_err().to_string();
    assert!(error.contains("connection lost"), "{error}");
}

#[test]
fn pipelined_io_against_qemu_nbd() {
    if !tools(&["qemu-nbd"]) {
        return;
    }
    let directory = tempfile::tempdir().unwrap();
    let image = directory.path().join("disk.img");
    let socket = directory.path().join("qemu-nbd.sock");
    std::fs::write(&image, vec![0u8; 16 << 20]).unwrap();
    let mut qemu_nbd = std::process::Command::new("qemu-nbd")
        .args([
            "--format=raw",
            "--persistent",
            "--export-name=disk",
            "--shared=4",
        ])
        .arg(format!("--socket={}", socket.display()))
        .arg(&image)
        .stdin(std::process::Stdio::null())
        .spawn()
        .expect("start qemu-nbd");
    let uri = format!("nbd+unix:///disk?socket={}", socket.display());
    let started = Instant::now();
    let client = loop {
        match NbdClient::connect(&uri) {
            Ok(client) => break Arc::new(client),
            Err(error) if started.elapsed() > Duration::from_secs(10) => {
                let _ = qemu_nbd.kill();
                panic!("qemu-nbd never answered: {error}");
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    };
    assert_eq!(client.size(), 16 << 20);
    hammer(&client);
    let extents = client.block_status(0, 16 << 20).unwrap();
    assert_eq!(
        extents.iter().map(|extent| extent.length).sum::<u64>(),
        16 << 20
    );
    drop(client);
    let _ = qemu_nbd.kill();
    let _ = qemu_nbd.wait();
    let on_disk = std::fs::read(&image).unwrap();
    assert!(on_disk[5 << 20..6 << 20] == pattern_bytes(1 << 20, 6));
}

#[test]
fn simple_replies_only_server_still_works() {
    let Some(nbdkit) = Nbdkit::start(&["--no-sr", "memory", "64M"]) else {
        return;
    };
    let client = Arc::new(NbdClient::connect(&nbdkit.uri()).unwrap());
    assert!(!client.export_info().structured_replies);
    assert_eq!(client.export_info().base_allocation_id, None);
    hammer(&client);
    // Without block status everything is reported as data.
    let extents = client.block_status(0, 64 << 20).unwrap();
    assert_eq!(extents.len(), 1);
    assert!(!extents[0].hole);
}

#[test]
fn oldstyle_servers_are_refused_clearly() {
    let Some(nbdkit) = Nbdkit::start(&["--oldstyle", "memory", "1M"]) else {
        return;
    };
    let message = NbdClient::connect(&nbdkit.uri()).unwrap_err().to_string();
    assert!(message.contains("oldstyle"), "{message}");
}

#[test]
fn many_small_pipelined_reads_come_back_whole_through_the_reply_buffer() {
    // Goal: the client reads replies through a buffer (one recv may hold several replies, a
    // reply's header and data, or part of a chunk), so no reply may take another's bytes or
    // lose its own, with data and hole chunks mixed. Method: nbdkit memory (structured
    // replies; unwritten ranges come back as hole chunks) holds a 4 MiB pattern; 8 threads
    // each read 300 ranges of 1 byte to 40 KiB, seeded, across the 4 MiB boundary, all in
    // flight together, and compare each with the pattern (zero past 4 MiB).
    let Some(nbdkit) = Nbdkit::start(&["memory", "64M"]) else {
        return;
    };
    let client = Arc::new(NbdClient::connect(&nbdkit.uri()).unwrap());
    let data = pattern_bytes(4 << 20, 77);
    client.write(0, &data).unwrap();
    let data = Arc::new(data);
    let threads: Vec<_> = (0..8u64)
        .map(|index| {
            let client = Arc::clone(&client);
            let data = Arc::clone(&data);
            std::thread::spawn(move || {
                let mut seed = 0x2545_f491_4f6c_dd1d ^ (index + 1);
                for round in 0..300 {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    let length = 1 + (seed % (40 << 10)) as usize;
                    let offset = ((seed >> 20) % (6 << 20)) as usize;
                    let mut back = vec![0xAAu8; length];
                    client.read(offset as u64, &mut back).unwrap();
                    let expected: Vec<u8> = (offset..offset + length)
                        .map(|at| data.get(at).copied().unwrap_or(0))
                        .collect();
                    assert!(
                        back == expected,
                        "thread {index} round {round}: {length} bytes at {offset} differ"
                    );
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
}

#[test]
fn a_write_batch_is_in_flight_upstream_at_once_and_answers_each_write() {
    // Goal: `Device::write_batch_at` over NBD sends every write before it waits for any
    // reply, so a batch costs one round trip upstream, and each write gets its own outcome.
    // Method: nbdkit memory behind the delay filter (20 ms per write) and, above it, the log
    // filter, which logs each write when it arrives and when it returns; a batch of 16
    // scattered writes and one past the end of the export. The log must show all 16 arrived
    // before the first returned; the bad write alone fails; the data reads back.
    let Some(log_directory) = tempfile::tempdir().ok() else {
        return;
    };
    let log_path = log_directory.path().join("log.txt");
    let log_argument = format!("logfile={}", log_path.display());
    let Some(mut nbdkit) = Nbdkit::start(&[
        "--filter=log",
        "--filter=delay",
        "memory",
        "16M",
        log_argument.as_str(),
        "wdelay=20ms",
    ]) else {
        return;
    };
    let client = NbdClient::connect(&nbdkit.uri()).unwrap();
    let data: Vec<Vec<u8>> = (0..17u64).map(|seed| pattern_bytes(4096, seed)).collect();
    let offsets: Vec<u64> = (0..16u64)
        .map(|index| index * 65536)
        .chain([16 << 20])
        .collect();
    let writes: Vec<(u64, Vec<u8>)> = offsets.iter().copied().zip(data.clone()).collect();
    let results: Vec<std::io::Result<()>> = bufcache_device::write_and_wait(&client, writes)
        .into_iter()
        .map(|(_, result)| result)
        .collect();
    assert_eq!(results.len(), 17);
    assert!(results[..16].iter().all(Result::is_ok), "{results:?}");
    let past_end = results[16].as_ref().unwrap_err();
    assert_eq!(
        past_end.kind(),
        std::io::ErrorKind::InvalidInput,
        "{past_end}"
    );
    for (index, &offset) in offsets[..16].iter().enumerate() {
        let mut back = vec![0u8; 4096];
        client
            .read_vectored_at(&mut [IoSliceMut::new(&mut back)], offset)
            .unwrap();
        assert!(back == data[index], "write {index} reads back");
    }
    drop(client);
    nbdkit.stop();
    let log = std::fs::read_to_string(&log_path).expect("log file");
    let mut in_flight = 0usize;
    let mut most = 0usize;
    for line in log.lines() {
        if line.contains("...Write id=") {
            in_flight -= 1;
        } else if line.contains(" Write id=") {
            in_flight += 1;
            most = most.max(in_flight);
        }
    }
    assert_eq!(most, 16, "writes in flight at once upstream:\n{log}");
}

#[test]
fn a_started_read_larger_than_the_server_takes_ends_once_on_the_reply_thread_with_every_piece() {
    // Goal: `Device::submit_reads` over NBD never reads in the caller's thread: a read longer
    // than the server's maximum block size goes out as several READs, and the completion runs
    // once, on the reply thread, after the last piece, with every byte; a read past the end
    // fails at once. Method: our server with a 64 KiB maximum request; a started read of
    // 200 KiB at an odd offset into two buffers.
    let export = Arc::new(MemoryExport::new(1 << 20));
    let contents = pattern_bytes(1 << 20, 9);
    export.write(0, &contents, false).unwrap();
    let server = start_server_with(
        vec![("mem", export as Arc<dyn Export>)],
        ServerConfig {
            request_size_max: 64 << 10,
            ..ServerConfig::default()
        },
    );
    let client = NbdClient::connect(&server.tcp_uri("mem")).unwrap();
    let (offset, first_part, second_part) = (4097u64, 70_000usize, 134_800usize);
    let (sender, receiver) = std::sync::mpsc::channel();
    let memory = vec![vec![0u8; first_part], vec![0u8; second_part]];
    let read = ReadRequest::new(offset, memory, move |memory: Vec<Vec<u8>>, result| {
        sender
            .send((memory, result, std::thread::current().id()))
            .unwrap()
    });
    client.submit_reads(vec![read]);
    let (memory, result, thread) = receiver.recv_timeout(Duration::from_secs(10)).unwrap();
    result.unwrap();
    let (first, second) = (&memory[0], &memory[1]);
    assert_ne!(
        thread,
        std::thread::current().id(),
        "ended on the reply thread"
    );
    assert!(receiver.try_recv().is_err(), "the completion ran once");
    let start = offset as usize;
    assert!(*first == contents[start..start + first_part]);
    assert!(*second == contents[start + first_part..start + first_part + second_part]);

    let (sender, receiver) = std::sync::mpsc::channel();
    let read = ReadRequest::new((1 << 20) - 100, vec![0u8; 4096], move |_: Vec<u8>, r| {
        sender.send(r).unwrap()
    });
    client.submit_reads(vec![read]);
    let error = receiver
        .recv_timeout(Duration::from_secs(10))
        .unwrap()
        .unwrap_err();
    assert_eq!(error.kind(), std::io::ErrorKind::InvalidInput, "{error}");
}

/// Goal: an upstream that never answers cannot hold a caller for ever (issue #32: writes to
/// such an upstream blocked for over 190 s): once the reply timeout passes with requests
/// waiting and no byte of a reply, every request in flight fails and later ones fail at once.
/// Method: nbdkit's delay filter holds every WRITE for 60 s; with a 1 s reply timeout a write
/// must fail within one to two seconds (one to two reply timeouts), naming the timeout, and
/// the client is dead afterwards.
#[test]
fn an_upstream_that_never_answers_fails_requests_after_the_reply_timeout() {
    let Some(nbdkit) = Nbdkit::start(&["--filter=delay", "memory", "16M", "delay-write=60"]) else {
        return;
    };
    let client =
        NbdClient::connect_with_reply_timeout(&nbdkit.uri(), Duration::from_secs(1)).unwrap();
    let started = Instant::now();
    let error = client
        .write(0, b"never answered")
        .expect_err("a write the upstream never answers fails");
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(10),
        "failed after {waited:?}"
    );
    assert!(error.to_string().contains("reply timeout"), "{error}");
    let mut buffer = [0u8; 16];
    assert!(
        client.read(0, &mut buffer).is_err(),
        "the connection is dead"
    );
}
