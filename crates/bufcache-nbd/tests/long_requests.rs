//! Goal: a request over terabytes (extended headers allow 64-bit lengths) ends: CACHE, TRIM
//! and WRITE_ZEROES are done in bounded pieces, a CACHE stops once its client has gone, a
//! shutdown ends any of them within a piece (ESHUTDOWN), a CACHE larger than the cache reads
//! no more than the cache holds, and BLOCK_STATUS of terabytes is answered at once (its work
//! follows what the disk holds, not the range's length). Method: raw
//! extended-header requests against our server, over an export whose every piece is slow
//! and counted, and over a 64 MiB cache of a 4 TiB sparse memory device whose reads are
//! counted.

mod common;

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bufcache::{CountingDevice, MemoryDevice};
use bufcache_nbd::protocol::*;
use bufcache_nbd::{BlockStatusExtent, Export, MemoryExport};
use common::raw::*;
use common::*;

const TIB: u64 = 1 << 40;
const MIB: u64 = 1 << 20;

/// A 4 TiB export whose CACHE, TRIM and WRITE_ZEROES calls each take 20 ms and are counted
/// with the largest length asked of one call; it holds no data.
struct SlowPieces {
    size: u64,
    pieces: AtomicU64,
    piece_bytes_largest: AtomicU64,
    inner: MemoryExport,
}

impl SlowPieces {
    fn new() -> Arc<SlowPieces> {
        Arc::new(SlowPieces {
            size: 4 * TIB,
            pieces: AtomicU64::new(0),
            piece_bytes_largest: AtomicU64::new(0),
            inner: MemoryExport::new(MIB),
        })
    }

    fn piece(&self, length: u64) -> io::Result<()> {
        self.pieces.fetch_add(1, Ordering::SeqCst);
        self.piece_bytes_largest.fetch_max(length, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(20));
        Ok(())
    }

    fn pieces(&self) -> u64 {
        self.pieces.load(Ordering::SeqCst)
    }
}

impl Export for SlowPieces {
    fn size(&self) -> u64 {
        self.size
    }
    fn read_only(&self) -> bool {
        false
    }
    fn read(&self, _offset: u64, buffer: &mut [u8]) -> io::Result<()> {
        buffer.fill(0);
        Ok(())
    }
    fn read_with(
        &self,
        offset: u64,
        buffer: &mut [u8],
        send: &mut bufcache_nbd::ReadSink<'_>,
    ) -> io::Result<()> {
        bufcache_nbd::read_via_buffer(self, offset, buffer, send)
    }
    fn read_is_quick(&self, _offset: u64, _length: u64) -> bool {
        true
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
    ) -> io::Result<()> {
        bufcache_nbd::write_via_buffer(self, offset, length, fua, source)
    }
    fn write(&self, _offset: u64, _data: &[u8], _fua: bool) -> io::Result<()> {
        Ok(())
    }
    fn flush(&self) -> io::Result<()> {
        Ok(())
    }
    fn trim(&self, _offset: u64, length: u64, _fua: bool) -> io::Result<()> {
        self.piece(length)
    }
    fn write_zeroes(
        &self,
        _offset: u64,
        length: u64,
        _may_trim: bool,
        _fast_only: bool,
        _fua: bool,
    ) -> io::Result<()> {
        self.piece(length)
    }
    fn cache(&self, _offset: u64, length: u64) -> io::Result<()> {
        self.piece(length)
    }
    fn cache_request_bytes_max(&self) -> u64 {
        u64::MAX
    }
    fn block_status(&self, _offset: u64, length: u64) -> io::Result<Vec<BlockStatusExtent>> {
        Ok(vec![BlockStatusExtent {
            length,
            hole: true,
            zero: true,
        }])
    }
    fn has_cache_state(&self) -> bool {
        self.inner.has_cache_state()
    }
    fn cache_state(
        &self,
        _offset: u64,
        _length: u64,
    ) -> io::Result<Vec<bufcache_nbd::CacheStateExtent>> {
        bufcache_nbd::no_cache_state()
    }
    fn known_zeroes(&self, _offset: u64, _length: u64) -> Vec<(u64, u64)> {
        Vec::new()
    }
}

/// An extended-headers connection to export "" of `server`, with base:allocation selected.
fn open_extended(server: &TestServer) -> Raw {
    let mut raw = Raw::modern(&server.socket_path);
    assert_eq!(raw.extended_headers().map(reply_name), Ok("ACK".into()));
    let (reply, _contexts) = raw
        .meta_context(OPT_SET_META_CONTEXT, "", &[BASE_ALLOCATION])
        .unwrap();
    assert_eq!(reply, REP_ACK);
    raw.go("");
    raw
}

/// Waits up to `bound` for `condition`; returns whether it came true.
fn eventually(bound: Duration, condition: impl Fn() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < bound {
        if condition() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    condition()
}

#[test]
fn a_long_cache_stops_soon_after_its_client_goes_away() {
    // Goal: a 4 TiB CACHE (65,536 pieces of 64 MiB, 20 ms each: 22 minutes) stops once the
    // client closed its connection, instead of reading on for no one. Method: send it, wait
    // for its first pieces, close the socket, and check the count of pieces stops growing.
    let export = SlowPieces::new();
    let server = start_server(vec![("", Arc::clone(&export) as Arc<dyn Export>)]);
    let mut raw = open_extended(&server);
    raw.send_request(0, CMD_CACHE, 0, 4 * TIB, &[]);
    assert!(eventually(Duration::from_secs(10), || export.pieces() >= 2));
    assert_eq!(
        export.piece_bytes_largest.load(Ordering::SeqCst),
        64 * MIB,
        "pieces of 64 MiB"
    );
    drop(raw);
    let settled = |export: &SlowPieces| {
        let before = export.pieces();
        std::thread::sleep(Duration::from_millis(300));
        export.pieces() == before
    };
    assert!(
        eventually(Duration::from_secs(10), || settled(&export)),
        "the CACHE went on after its client left: {} pieces",
        export.pieces()
    );
    assert!(export.pieces() < 1000, "{} pieces", export.pieces());
}

#[test]
fn a_shutdown_ends_long_cache_trim_and_zero_requests_with_eshutdown() {
    // Goal: SIGTERM never waits for a request of terabytes: a shutdown ends a running CACHE,
    // TRIM or WRITE_ZEROES at its next piece, answering ESHUTDOWN, and the server's run
    // returns. Method: for each command, start it on a fresh server, trigger the shutdown
    // once pieces run, read the reply and join the server (dropping it waits for `run`).
    for command in [CMD_CACHE, CMD_TRIM, CMD_WRITE_ZEROES] {
        let export = SlowPieces::new();
        let server = start_server(vec![("", Arc::clone(&export) as Arc<dyn Export>)]);
        let mut raw = open_extended(&server);
        let cookie = raw.send_request(0, command, 0, 4 * TIB, &[]);
        assert!(eventually(Duration::from_secs(10), || export.pieces() >= 2));
        server.begin_shutdown();
        let answer = raw.answer(cookie, 0, 0).expect("a reply before the close");
        assert_eq!(
            errno_name(answer.error),
            "ESHUTDOWN",
            "command {command}: {answer:?}"
        );
        let pieces_at_reply = export.pieces();
        drop(server);
        assert!(
            pieces_at_reply < 1000,
            "command {command}: {pieces_at_reply} pieces"
        );
    }
}

#[test]
fn a_cache_larger_than_the_cache_reads_no_more_than_the_cache_holds() {
    // Goal: a CACHE of 4 TiB through a 64 MiB cache is answered, and reads at most what the
    // cache can hold (more would evict the request's own beginning). Method: a cache over a
    // counting 4 TiB sparse memory device; CACHE the whole disk; compare the bytes read.
    let device = Arc::new(CountingDevice::new(MemoryDevice::new(4 * TIB)));
    let (server, _object) = cached_server(Arc::clone(&device) as Arc<dyn bufcache::Device>);
    let mut raw = open_extended(&server);
    let answer = raw.request(0, CMD_CACHE, 0, 4 * TIB, &[]).unwrap();
    assert_eq!(errno_name(answer.error), "ok", "{answer:?}");
    let read_bytes = device.stats().reads.bytes;
    assert!(
        read_bytes > 0 && read_bytes <= 64 * MIB,
        "read {read_bytes} bytes for a 4 TiB CACHE through a 64 MiB cache"
    );
}

#[test]
fn trim_zero_and_block_status_over_terabytes_are_answered() {
    // Goal: TRIM and WRITE_ZEROES of a whole 4 TiB disk finish through the cache (pieces,
    // each quick), and BLOCK_STATUS of 4 TiB is answered whole, data and holes told apart.
    // Method: raw extended requests over a cache of a 4 TiB sparse memory
    // device with data written at 0 and 3 TiB; read both back as zeroes afterwards.
    let device = Arc::new(MemoryDevice::new(4 * TIB));
    let (server, _object) = cached_server(Arc::clone(&device) as Arc<dyn bufcache::Device>);
    let mut raw = open_extended(&server);
    for offset in [0, 3 * TIB] {
        let answer = raw
            .request(CMD_FLAG_PAYLOAD_LEN, CMD_WRITE, offset, 4096, &[0x5a; 4096])
            .unwrap();
        assert_eq!(errno_name(answer.error), "ok");
    }
    let answer = raw.request(0, CMD_BLOCK_STATUS, 0, 4 * TIB, &[]).unwrap();
    assert_eq!(errno_name(answer.error), "ok");
    let descriptors = &answer.status()[0].1;
    let described: u64 = descriptors.iter().map(|(length, _)| length).sum();
    assert_eq!(described, 4 * TIB, "BLOCK_STATUS described {descriptors:?}");
    assert_eq!(descriptors[0].1 & 1, 0, "data at 0: {descriptors:?}");
    assert!(
        descriptors
            .iter()
            .any(|&(length, flags)| length >= TIB && flags & 1 != 0),
        "holes of terabytes: {descriptors:?}"
    );
    let answer = raw.request(0, CMD_TRIM, 0, 4 * TIB, &[]).unwrap();
    assert_eq!(errno_name(answer.error), "ok", "TRIM: {answer:?}");
    let answer = raw
        .request(CMD_FLAG_FUA, CMD_WRITE_ZEROES, 0, 4 * TIB, &[])
        .unwrap();
    assert_eq!(errno_name(answer.error), "ok", "WRITE_ZEROES: {answer:?}");
    for offset in [0, 3 * TIB] {
        let answer = raw.request(0, CMD_READ, offset, 4096, &[]).unwrap();
        assert_eq!(errno_name(answer.error), "ok");
        assert_eq!(answer.data, vec![0u8; 4096], "zeroes at {offset}");
    }
}
