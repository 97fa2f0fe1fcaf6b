//! [`NbdClient`]: a pipelined NBD client over one socket, used as an upstream device.
//!
//! Any number of threads may issue requests at once. Each request gets a fresh handle and a
//! completion slot in the pending table, its bytes are written whole under the writer lock,
//! and the caller blocks on its own slot. One reader thread demultiplexes replies (simple or
//! structured) by handle and completes slots, reading READ data straight into the slot's
//! buffer.
//!
//! Invariants: a slot is completed exactly once; when the connection dies (socket error,
//! protocol violation, close) every pending slot fails with the reason and every later
//! request fails at once, so no caller can hang on a dead server. Requests larger than the
//! server's maximum block size are split into pieces that are all sent before any is waited
//! for. Errors name the server URI and the request.

use std::collections::HashMap;
use std::io::{self, IoSlice, IoSliceMut, Read};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use bufcache_device::{
    check_range, Capabilities, Device, Extent, FlushGroup, ReadRequest, SleepingMutex, WriteRequest,
};
use parking_lot::{Condvar, Mutex};

use crate::client_handshake::{self, ExportInfo, HandshakeFailure};
use crate::export::BlockStatusExtent;
use crate::protocol::*;
use crate::stream::{read_exact_vectored, write_all_vectored, Stream};
use crate::uri::{NbdAddress, NbdUri, UriError};

/// How long one TCP connection attempt may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the handshake may take before the connect fails.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

/// How long the server may leave requests unanswered (no byte of any reply arriving; the
/// connection is declared dead between one and two of these after the oldest request was
/// sent) or leave a request unread (no byte of it taken) before every request in flight
/// fails: a server that stopped answering must not hold the cache's write-back (and so every
/// writer waiting for space) for ever. As long as the cache waits for space at most
/// (`space_wait_max`, 30 s by default); see docs/operations.md for the whole bound.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(30);

/// Largest range one payload-less request (TRIM, WRITE_ZEROES, CACHE, BLOCK_STATUS) covers
/// with compact headers. The maximum block size limits data payloads only; splitting these at
/// it would turn one hole punch into many partial ones. 1 GiB keeps each request's work
/// bounded and is a multiple of every power-of-two minimum block size.
const NO_PAYLOAD_BYTES_MAX: u64 = 1 << 30;

/// The same with extended headers, whose 64-bit lengths let one request cover a whole large
/// disk: 1 TiB, still a multiple of every power-of-two minimum block size.
const NO_PAYLOAD_EXTENDED_BYTES_MAX: u64 = 1 << 40;

/// Requests the client tells the engine to keep in flight at once (`Capabilities`): the
/// connection pipelines without a bound of its own, so this is what keeps a long link busy
/// (64 × 1 MiB covers 64 MiB per round trip) while leaving the engine's write-back share
/// (a quarter of it, at most `writeback_inflight_max`) a bound that read misses only queue behind.
pub const UPSTREAM_INFLIGHT_REQUESTS_MAX: usize = 64;

/// Everything that can go wrong talking to a server. Every variant names the server.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error(transparent)]
    Uri(#[from] UriError),
    #[error("{uri}: cannot connect: {source}")]
    Connect { uri: String, source: io::Error },
    #[error("{uri}: handshake failed: {source}")]
    Handshake {
        uri: String,
        source: HandshakeFailure,
    },
    #[error("{uri}: {command} {length_bytes} bytes at {offset} failed: {errno}{}", server_message(.message))]
    Request {
        uri: String,
        command: String,
        length_bytes: u64,
        offset: u64,
        errno: Errno,
        message: String,
    },
    #[error("{uri}: {command} {length_bytes} bytes at {offset} failed: connection lost: {reason}")]
    Disconnected {
        uri: String,
        command: String,
        length_bytes: u64,
        offset: u64,
        reason: String,
    },
    #[error("{uri}: {command} {length_bytes} bytes at {offset} refused: {reason}")]
    Unsupported {
        uri: String,
        command: String,
        length_bytes: u64,
        offset: u64,
        reason: String,
    },
}

fn server_message(message: &str) -> String {
    if message.is_empty() {
        String::new()
    } else {
        format!(" (server said: {message})")
    }
}

impl ClientError {
    /// The error kind a `Device` caller sees.
    pub fn io_kind(&self) -> io::ErrorKind {
        match self {
            ClientError::Uri(_) => io::ErrorKind::InvalidInput,
            ClientError::Connect { source, .. } => source.kind(),
            ClientError::Handshake { .. } => io::ErrorKind::InvalidData,
            ClientError::Request { errno, .. } => errno.io_kind(),
            ClientError::Disconnected { .. } => io::ErrorKind::BrokenPipe,
            ClientError::Unsupported { .. } => io::ErrorKind::Unsupported,
        }
    }
}

impl From<ClientError> for io::Error {
    fn from(error: ClientError) -> io::Error {
        io::Error::new(error.io_kind(), error)
    }
}

/// What a finished request produced (a READ's data is already in the caller's memory).
#[derive(Default)]
struct Completion {
    /// BLOCK_STATUS descriptors: (length, status flags).
    extents: Vec<(u64, u32)>,
    error: Option<(Errno, String)>,
    connection_lost: Option<String>,
}

/// What the reader must do with the replies to one request.
#[derive(Clone, Copy)]
enum Expect {
    Read { offset: u64, length_bytes: u32 },
    BlockStatus,
    Nothing,
}

/// A request waiting for its reply.
struct Slot {
    expect: Expect,
    state: Mutex<SlotState>,
    finished: Condvar,
}

struct SlotState {
    completion: Completion,
    /// Where a READ's data goes; dropped when the slot is done, after which nothing writes.
    target: Option<ReadTarget>,
    /// Bytes of READ data delivered so far by structured chunks.
    covered_bytes: u64,
    /// The ranges of the request those chunks covered, sorted and disjoint: a chunk that
    /// overlaps one is a protocol violation, and without this check overlapping chunks could
    /// add up to the request's length and leave a gap of the caller's old bytes unwritten.
    covered: Vec<std::ops::Range<usize>>,
    done: bool,
    /// Run with the completion when the slot is done, for a request nobody waits for
    /// ([`Device::submit_reads`], [`Device::submit_writes`]); it runs on whichever thread finishes the slot, after the
    /// slot's lock is let go.
    on_done: Option<SlotCallback>,
}

/// What a request nobody waits for runs when it is done.
type SlotCallback = Box<dyn FnOnce(Completion) + Send>;

/// Work left for after a slot's lock is let go: running its callback.
type Deferred = Box<dyn FnOnce() + Send>;

/// Runs the work a finished slot left, if any.
fn run_deferred(deferred: Option<Deferred>) {
    if let Some(run) = deferred {
        run();
    }
}

/// The caller's memory a READ's data is written to by the reader thread, so replies go from
/// the socket straight into the cache's buffers: through an intermediate buffer, zero-filling
/// and copying it was a fifth of a cold sequential read's server CPU.
///
/// Soundness rests on two rules. The caller keeps the memory borrowed, and untouched, until
/// the slot is done, and waits for that (`NbdClient::read_vectored` waits for every slot it
/// submitted, whatever happens). The reader writes only while it holds the slot's state lock
/// and the slot is not done, and `done` is set (and the target dropped) under that lock
/// before any caller can see it. So no write can follow the caller's return.
struct ReadTarget {
    /// (start, length) pieces of the caller's memory, in order; their lengths add up to the
    /// request's.
    segments: Vec<(NonNull<u8>, usize)>,
}

// SAFETY: see the type's documentation: the memory is only written under the slot's lock,
// while the borrowing caller waits.
unsafe impl Send for ReadTarget {}

impl ReadTarget {
    /// Splits `buffers` into one target per piece length, in order. Every pointer comes from
    /// one pass over the buffers, made before any target is used: taking a fresh `&mut` to a
    /// buffer for each piece would invalidate the pointers an earlier piece holds into it.
    fn carve_all(buffers: &mut [IoSliceMut<'_>], piece_lengths: &[usize]) -> Vec<Self> {
        let whole: Vec<(*mut u8, usize)> = buffers
            .iter_mut()
            .map(|buffer| (buffer.as_mut_ptr(), buffer.len()))
            .collect();
        assert_eq!(
            piece_lengths.iter().sum::<usize>(),
            whole.iter().map(|&(_, length)| length).sum::<usize>(),
            "READ pieces cover exactly the caller's buffers"
        );
        let mut cursor = SliceCursor::default();
        piece_lengths
            .iter()
            .map(|&length_bytes| ReadTarget {
                segments: cursor.take(&whole, length_bytes),
            })
            .collect()
    }

    /// The caller's memory for bytes `range` of the request.
    fn slices(&mut self, range: std::ops::Range<usize>) -> Vec<IoSliceMut<'_>> {
        let mut slices = Vec::new();
        let mut at = 0;
        for &(start, length) in &self.segments {
            let (from, to) = (range.start.max(at), range.end.min(at + length));
            if from < to {
                // SAFETY: within a segment of the caller's memory, which the caller keeps
                // borrowed and untouched while the slot is not done (see the type's docs).
                let bytes = unsafe {
                    std::slice::from_raw_parts_mut(start.as_ptr().add(from - at), to - from)
                };
                slices.push(IoSliceMut::new(bytes));
            }
            at += length;
        }
        slices
    }
}

/// What runs when the last piece of a submitted request ends, with the first error.
type PiecesDone = Box<dyn FnOnce(io::Result<()>) + Send>;

/// The pieces of a submitted request still in flight, the first error among the ended ones,
/// and what completes the request, run when the last piece ends.
struct PiecesLeft {
    state: Mutex<(usize, Option<io::Error>, Option<PiecesDone>)>,
}

impl PiecesLeft {
    fn end_one(&self, outcome: io::Result<()>) {
        let finished = {
            let mut state = self.state.lock();
            state.0 -= 1;
            if let Err(error) = outcome {
                state.1.get_or_insert(error);
            }
            // Without a completion yet, the first error waits for it (`then`).
            if state.0 > 0 || state.2.is_none() {
                return;
            }
            (state.1.take(), state.2.take())
        };
        if let (error, Some(done)) = finished {
            done(error.map_or(Ok(()), Err));
        }
    }
}

impl PiecesLeft {
    fn new(count: usize, done: PiecesDone) -> Arc<PiecesLeft> {
        Arc::new(PiecesLeft {
            state: Mutex::new((count, None, Some(done))),
        })
    }

    /// Pieces whose completion is given later ([`PiecesLeft::then`]), once the request's
    /// memory is no longer borrowed for sending.
    fn waiting(count: usize) -> Arc<PiecesLeft> {
        Arc::new(PiecesLeft {
            state: Mutex::new((count, None, None)),
        })
    }

    /// Gives the completion: it runs when the last piece ends, or now if every piece has.
    fn then(&self, done: PiecesDone) {
        let finished = {
            let mut state = self.state.lock();
            if state.0 > 0 {
                state.2 = Some(done);
                return;
            }
            state.1.take()
        };
        done(finished.map_or(Ok(()), Err));
    }
}

impl Slot {
    fn new(expect: Expect, target: Option<ReadTarget>) -> Arc<Slot> {
        Slot::with_callback(expect, target, None)
    }

    fn with_callback(
        expect: Expect,
        target: Option<ReadTarget>,
        on_done: Option<SlotCallback>,
    ) -> Arc<Slot> {
        Arc::new(Slot {
            expect,
            state: Mutex::new(SlotState {
                completion: Completion::default(),
                target,
                covered_bytes: 0,
                covered: Vec::new(),
                done: false,
                on_done,
            }),
            finished: Condvar::new(),
        })
    }

    /// Marks the slot done (nothing writes its target after this) and wakes its waiter; a
    /// slot with a callback returns it, with the completion, to run once the lock is gone.
    #[must_use]
    fn finish(&self, state: &mut SlotState) -> Option<Deferred> {
        state.done = true;
        state.target = None;
        self.finished.notify_all();
        let callback = state.on_done.take()?;
        let completion = std::mem::take(&mut state.completion);
        Some(Box::new(move || callback(completion)))
    }

    fn fail(&self, reason: &str) {
        let mut state = self.state.lock();
        if state.done {
            return;
        }
        state.completion.connection_lost = Some(reason.to_string());
        let deferred = self.finish(&mut state);
        drop(state);
        run_deferred(deferred);
    }

    fn wait(&self) -> Completion {
        let mut state = self.state.lock();
        while !state.done {
            self.finished.wait(&mut state);
        }
        std::mem::take(&mut state.completion)
    }
}

/// A request sent (or refused before sending) and the slot its reply will fill.
type SentPiece = (RequestHeader, Result<Arc<Slot>, ClientError>);

#[derive(Default)]
struct PendingTable {
    slots: HashMap<u64, Arc<Slot>>,
    /// Why the connection is dead, once it is.
    dead: Option<String>,
}

/// State shared between callers and the reader thread.
struct Shared {
    uri: String,
    /// Never yields while it waits: every thread with a request in flight sends through it.
    writer: SleepingMutex<Stream>,
    /// A handle on the socket used only to shut it down, so that never waits for a writer.
    control: Stream,
    /// The reply timeout in milliseconds (see [`REPLY_TIMEOUT`]), for messages.
    reply_timeout_ms: AtomicU64,
    pending: Mutex<PendingTable>,
    next_handle: AtomicU64,
    info: ExportInfo,
}

impl Shared {
    /// Marks the connection dead and fails every pending request.
    fn die(&self, reason: String) {
        // First, so a reader blocked mid-reply (holding a slot's lock) wakes and lets go.
        self.control.shutdown_both();
        let (slots, reason) = {
            let mut table = self.pending.lock();
            if table.dead.is_none() {
                tracing::warn!(uri = %self.uri, "NBD connection lost: {reason}");
                table.dead = Some(reason);
            }
            let slots: Vec<Arc<Slot>> = table.slots.drain().map(|(_, slot)| slot).collect();
            (slots, table.dead.clone().unwrap_or_default())
        };
        for slot in slots {
            slot.fail(&reason);
        }
    }
}

/// A connection to one export of an NBD server.
pub struct NbdClient {
    shared: Arc<Shared>,
    reader: Mutex<Option<JoinHandle<()>>>,
    /// Concurrent flushes through the [`Device`] interface share one FLUSH upstream when
    /// they can, saving a round trip each.
    flushes: FlushGroup,
}

impl std::fmt::Debug for NbdClient {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("NbdClient")
            .field("uri", &self.shared.uri)
            .field("info", &self.shared.info)
            .finish()
    }
}

/// One request as described in messages.
struct RequestLabel {
    command: u16,
    offset: u64,
    length_bytes: u64,
}

impl NbdClient {
    /// Connects to `uri` (`nbd://HOST[:PORT]/EXPORT` or `nbd+unix:///EXPORT?socket=PATH`)
    /// and completes the handshake.
    pub fn connect(uri: &str) -> Result<NbdClient, ClientError> {
        Self::connect_with_reply_timeout(uri, REPLY_TIMEOUT)
    }

    /// [`NbdClient::connect`] with another reply timeout than [`REPLY_TIMEOUT`]: how long the
    /// server may leave requests unanswered before the connection is declared dead and
    /// every request in flight fails.
    pub fn connect_with_reply_timeout(
        uri: &str,
        reply_timeout: Duration,
    ) -> Result<NbdClient, ClientError> {
        assert!(
            !reply_timeout.is_zero(),
            "a reply timeout of zero would never expire"
        );
        let parsed: NbdUri = uri.parse()?;
        let connect_error = |source| ClientError::Connect {
            uri: uri.to_string(),
            source,
        };
        let mut stream = match &parsed.address {
            NbdAddress::Tcp { host, port } => {
                Stream::Tcp(connect_tcp(host, *port).map_err(connect_error)?)
            }
            NbdAddress::Unix(path) => {
                Stream::Unix(UnixStream::connect(path).map_err(connect_error)?)
            }
        };
        stream.set_no_delay();
        let handshake_error = |source| ClientError::Handshake {
            uri: uri.to_string(),
            source,
        };
        stream
            .set_read_timeout(Some(HANDSHAKE_TIMEOUT))
            .map_err(|error| handshake_error(error.into()))?;
        let tls_host = match &parsed.address {
            NbdAddress::Tcp { host, .. } => {
                Some(host.trim_start_matches('[').trim_end_matches(']'))
            }
            NbdAddress::Unix(_) => None,
        };
        let tls = parsed.tls.as_ref().map(|settings| (settings, tls_host));
        let info = client_handshake::negotiate(&mut stream, &parsed.export_name, tls)
            .map_err(handshake_error)?;
        stream
            .set_read_timeout(Some(reply_timeout))
            .and_then(|()| stream.set_write_timeout(Some(reply_timeout)))
            .map_err(|error| handshake_error(error.into()))?;
        tracing::info!(uri, size_bytes = info.size_bytes, "connected to NBD server");
        Self::start(uri.to_string(), stream, info, reply_timeout).map_err(connect_error)
    }

    fn start(
        uri: String,
        stream: Stream,
        info: ExportInfo,
        reply_timeout: Duration,
    ) -> io::Result<NbdClient> {
        let reader_stream = stream.try_clone()?;
        let control = stream.try_clone()?;
        let shared = Arc::new(Shared {
            uri,
            writer: SleepingMutex::new(stream),
            control,
            reply_timeout_ms: AtomicU64::new(reply_timeout.as_millis() as u64),
            pending: Mutex::new(PendingTable::default()),
            next_handle: AtomicU64::new(1),
            info,
        });
        let reader_shared = Arc::clone(&shared);
        let reader = std::thread::Builder::new()
            .name("nbd-client-reader".into())
            .spawn(move || reader_loop(reader_stream, &reader_shared))?;
        Ok(NbdClient {
            shared,
            reader: Mutex::new(Some(reader)),
            flushes: FlushGroup::new(),
        })
    }

    /// The URI this client was connected with.
    pub fn uri(&self) -> &str {
        &self.shared.uri
    }

    /// Size, flags and block sizes learned in the handshake.
    pub fn export_info(&self) -> &ExportInfo {
        &self.shared.info
    }

    /// Size of the export in bytes.
    pub fn size(&self) -> u64 {
        self.shared.info.size_bytes
    }

    /// Reads `buffer.len()` bytes at `offset`.
    pub fn read(&self, offset: u64, buffer: &mut [u8]) -> Result<(), ClientError> {
        self.read_vectored(offset, &mut [IoSliceMut::new(buffer)])
    }

    /// Writes `data` at `offset`.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), ClientError> {
        self.write_vectored(offset, &[IoSlice::new(data)], false)
    }

    /// Writes `data` at `offset` and returns once it is durable: with FUA when the server
    /// supports it, else with a write followed by a flush.
    pub fn write_fua(&self, offset: u64, data: &[u8]) -> Result<(), ClientError> {
        if self.shared.info.has_flag(TRANSMIT_SEND_FUA) {
            self.write_vectored(offset, &[IoSlice::new(data)], true)
        } else {
            self.write(offset, data)?;
            self.flush()
        }
    }

    /// Makes every completed write durable (a no-op when the server has no write cache to
    /// flush, i.e. does not advertise FLUSH).
    pub fn flush(&self) -> Result<(), ClientError> {
        if !self.shared.info.has_flag(TRANSMIT_SEND_FLUSH) {
            return Ok(());
        }
        let header = self.header(CMD_FLUSH, 0, 0, 0);
        let slot = self.submit(header, &[], Expect::Nothing, None)?;
        self.complete(&header, &slot).map(drop)
    }

    /// Tells the server `length_bytes` at `offset` are unused; a no-op when TRIM is not
    /// supported (it is only a hint).
    pub fn trim(&self, offset: u64, length_bytes: u64) -> Result<(), ClientError> {
        if !self.shared.info.has_flag(TRANSMIT_SEND_TRIM) {
            return Ok(());
        }
        self.ranged_command(CMD_TRIM, 0, offset, length_bytes)
    }

    /// Zeroes `length_bytes` at `offset` with WRITE_ZEROES (`may_trim`: the server may
    /// punch a hole), or by writing zero buffers when the server lacks the command. (Named
    /// apart from `Device::write_zeroes`, which calls it with `may_trim` set.)
    pub fn zero(&self, offset: u64, length_bytes: u64, may_trim: bool) -> Result<(), ClientError> {
        if !self.shared.info.has_flag(TRANSMIT_SEND_WRITE_ZEROES) {
            return self.write_zero_buffers(offset, length_bytes);
        }
        let flags = if may_trim { 0 } else { CMD_FLAG_NO_HOLE };
        self.ranged_command(CMD_WRITE_ZEROES, flags, offset, length_bytes)
    }

    /// Asks the server to prefetch a range; a no-op when CACHE is not supported.
    pub fn cache(&self, offset: u64, length_bytes: u64) -> Result<(), ClientError> {
        if !self.shared.info.has_flag(TRANSMIT_SEND_CACHE) {
            return Ok(());
        }
        self.ranged_command(CMD_CACHE, 0, offset, length_bytes)
    }

    /// The `base:allocation` map of a range, as consecutive extents covering all of it. When
    /// the server offers no block status, the whole range is reported as data.
    pub fn block_status(
        &self,
        offset: u64,
        length_bytes: u64,
    ) -> Result<Vec<BlockStatusExtent>, ClientError> {
        if self.shared.info.base_allocation_id.is_none() {
            let whole = BlockStatusExtent {
                length: length_bytes,
                hole: false,
                zero: false,
            };
            return Ok(vec![whole]);
        }
        let mut extents: Vec<BlockStatusExtent> = Vec::new();
        let mut done = 0u64;
        while done < length_bytes {
            let step = (length_bytes - done).min(self.no_payload_bytes_max());
            let piece = self.block_status_once(offset + done, step)?;
            for extent in piece {
                done += extent.length;
                match extents.last_mut() {
                    Some(last) if last.hole == extent.hole && last.zero == extent.zero => {
                        last.length += extent.length
                    }
                    _ => extents.push(extent),
                }
            }
        }
        Ok(extents)
    }

    /// One BLOCK_STATUS request; the answer may cover less than asked, never more.
    fn block_status_once(
        &self,
        offset: u64,
        length_bytes: u64,
    ) -> Result<Vec<BlockStatusExtent>, ClientError> {
        let header = self.header(CMD_BLOCK_STATUS, 0, offset, length_bytes);
        let slot = self.submit(header, &[], Expect::BlockStatus, None)?;
        let completion = self.complete(&header, &slot)?;
        let mut extents = Vec::new();
        let mut covered = 0u64;
        for (length, flags) in completion.extents {
            let length = length.min(length_bytes - covered);
            if length == 0 {
                break;
            }
            covered += length;
            extents.push(BlockStatusExtent {
                length,
                hole: flags & STATE_HOLE != 0,
                zero: flags & STATE_ZERO != 0,
            });
        }
        if extents.is_empty() {
            return Err(self.protocol_error(&header, "BLOCK_STATUS reply had no extents"));
        }
        Ok(extents)
    }

    /// Sends DISC and closes the connection; later requests fail.
    pub fn disconnect(&self) {
        let header = self.header(CMD_DISC, 0, 0, 0);
        // A disconnect we asked for is not a lost connection: mark it dead before DISC goes
        // out, so the reader thread, which sees the server close the socket as soon as DISC
        // arrives, does not warn (it did, now and then, at a clean shutdown with an upstream).
        {
            let mut table = self.shared.pending.lock();
            if table.dead.is_none() {
                table.dead = Some("the client disconnected".into());
            }
        }
        {
            let mut writer = self.shared.writer.lock();
            let _ = if self.shared.info.extended_headers {
                write_all_vectored(&mut *writer, &[&header.encode_extended()])
            } else {
                write_all_vectored(&mut *writer, &[&header.encode()])
            };
        }
        self.shared.die("the client disconnected".into());
        self.join_reader();
    }

    /// Waits for the reader thread to end, unless this is the reader thread: a started
    /// read's completion runs there and may drop the last reference to this client (at
    /// shutdown, with the whole cache above it), and a thread cannot join itself.
    fn join_reader(&self) {
        let Some(reader) = self.reader.lock().take() else {
            return;
        };
        if reader.thread().id() != std::thread::current().id() {
            let _ = reader.join();
        }
    }

    /// Reads into `buffers` from `offset`, splitting at the server's maximum block size and
    /// keeping every piece in flight at once.
    pub fn read_vectored(
        &self,
        offset: u64,
        buffers: &mut [IoSliceMut<'_>],
    ) -> Result<(), ClientError> {
        let total_bytes: u64 = buffers.iter().map(|buffer| buffer.len() as u64).sum();
        let splits = self.pieces(offset, total_bytes);
        let lengths: Vec<usize> = splits.iter().map(|&(_, length)| length as usize).collect();
        let targets = ReadTarget::carve_all(buffers, &lengths);
        let mut pieces = Vec::new();
        for ((piece_offset, piece_length), target) in splits.into_iter().zip(targets) {
            let header = self.header(CMD_READ, 0, piece_offset, piece_length.into());
            let expect = Expect::Read {
                offset: piece_offset,
                length_bytes: piece_length,
            };
            pieces.push((header, self.submit(header, &[], expect, Some(target))));
        }
        // Every submitted slot is waited for, even after an error (`complete_all` does): until
        // then the reader may write into `buffers` (see `ReadTarget`).
        self.complete_all(pieces)
    }

    /// Writes `buffers` at `offset`, splitting at the server's maximum block size; payloads
    /// go straight from the caller's slices to the socket.
    pub fn write_vectored(
        &self,
        offset: u64,
        buffers: &[IoSlice<'_>],
        fua: bool,
    ) -> Result<(), ClientError> {
        let pieces = self.send_write(offset, buffers, fua);
        self.complete_all(pieces)
    }

    /// Sends the WRITE requests for `buffers` at `offset` without waiting for a reply.
    fn send_write(&self, offset: u64, buffers: &[IoSlice<'_>], fua: bool) -> Vec<SentPiece> {
        let flags = if fua { CMD_FLAG_FUA } else { 0 };
        let total_bytes: u64 = buffers.iter().map(|buffer| buffer.len() as u64).sum();
        let mut pieces = Vec::new();
        let mut position = 0usize;
        for (piece_offset, piece_length) in self.pieces(offset, total_bytes) {
            let header = self.header(CMD_WRITE, flags, piece_offset, piece_length.into());
            let parts = gather(buffers, position, piece_length as usize);
            position += piece_length as usize;
            pieces.push((header, self.submit(header, &parts, Expect::Nothing, None)));
        }
        pieces
    }

    /// Waits for every sent piece, even after an error; the first error, if any.
    fn complete_all(&self, pieces: Vec<SentPiece>) -> Result<(), ClientError> {
        let mut first_error = None;
        for (header, slot) in pieces {
            if let Err(error) = slot.and_then(|slot| self.complete(&header, &slot)) {
                first_error.get_or_insert(error);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// A payload-less command over a range, split and pipelined like reads.
    fn ranged_command(
        &self,
        command: u16,
        flags: u16,
        offset: u64,
        length_bytes: u64,
    ) -> Result<(), ClientError> {
        let mut pieces = Vec::new();
        for (piece_offset, piece_length) in split(offset, length_bytes, self.no_payload_bytes_max())
        {
            let header = self.header(command, flags, piece_offset, piece_length);
            pieces.push((header, self.submit(header, &[], Expect::Nothing, None)));
        }
        self.complete_all(pieces)
    }

    fn write_zero_buffers(&self, offset: u64, length_bytes: u64) -> Result<(), ClientError> {
        let chunk_bytes = length_bytes.min(u64::from(self.piece_bytes_max())) as usize;
        let zeroes = vec![0u8; chunk_bytes];
        let mut done = 0u64;
        while done < length_bytes {
            let step = (length_bytes - done).min(chunk_bytes as u64) as usize;
            self.write(offset + done, &zeroes[..step])?;
            done += step as u64;
        }
        Ok(())
    }

    /// Refuses a write outside the export or to a read-only export.
    fn check_writable(&self, offset: u64, length_bytes: u64) -> io::Result<()> {
        check_range(self.size(), offset, length_bytes)?;
        if self.shared.info.read_only() {
            let error =
                self.unsupported(CMD_WRITE, offset, length_bytes, "the export is read-only");
            return Err(io::Error::new(io::ErrorKind::PermissionDenied, error));
        }
        Ok(())
    }

    /// The largest piece: the server's maximum block size, rounded down to its minimum.
    fn piece_bytes_max(&self) -> u32 {
        let info = &self.shared.info;
        let maximum = info.block_size_max.max(info.block_size_min);
        maximum - maximum % info.block_size_min
    }

    /// Splits a data range into pieces no larger than the server accepts.
    fn pieces(&self, offset: u64, length_bytes: u64) -> Vec<(u64, u32)> {
        split(offset, length_bytes, u64::from(self.piece_bytes_max()))
            .into_iter()
            .map(|(piece_offset, length)| (piece_offset, length as u32))
            .collect()
    }

    /// The largest range one payload-less request covers (see [`NO_PAYLOAD_BYTES_MAX`]).
    fn no_payload_bytes_max(&self) -> u64 {
        if self.shared.info.extended_headers {
            NO_PAYLOAD_EXTENDED_BYTES_MAX
        } else {
            NO_PAYLOAD_BYTES_MAX
        }
    }

    /// A request header; with extended headers a WRITE says its length is a payload's.
    fn header(&self, command: u16, flags: u16, offset: u64, length: u64) -> RequestHeader {
        let payload = self.shared.info.extended_headers && command == CMD_WRITE;
        RequestHeader {
            flags: if payload {
                flags | CMD_FLAG_PAYLOAD_LEN
            } else {
                flags
            },
            command,
            handle: self.shared.next_handle.fetch_add(1, Ordering::Relaxed),
            offset,
            length,
        }
    }

    /// Registers a slot and sends the request. The slot is in the table before the bytes
    /// leave, so the reply always finds it.
    fn submit(
        &self,
        header: RequestHeader,
        payload: &[&[u8]],
        expect: Expect,
        target: Option<ReadTarget>,
    ) -> Result<Arc<Slot>, ClientError> {
        let slot = Slot::new(expect, target);
        self.submit_slot(header, payload, &slot)?;
        Ok(slot)
    }

    /// [`NbdClient::submit`] for a slot made by the caller. On `Err` the slot was never
    /// registered, and nothing will finish it.
    fn submit_slot(
        &self,
        header: RequestHeader,
        payload: &[&[u8]],
        slot: &Arc<Slot>,
    ) -> Result<(), ClientError> {
        {
            let mut table = self.shared.pending.lock();
            if let Some(reason) = &table.dead {
                return Err(self.disconnected(&header, reason));
            }
            table.slots.insert(header.handle, Arc::clone(slot));
        }
        let extended_bytes;
        let compact_bytes;
        let header_bytes: &[u8] = if self.shared.info.extended_headers {
            extended_bytes = header.encode_extended();
            &extended_bytes
        } else {
            compact_bytes = header.encode();
            &compact_bytes
        };
        let mut parts: Vec<&[u8]> = Vec::with_capacity(payload.len() + 1);
        parts.push(header_bytes);
        parts.extend_from_slice(payload);
        let mut writer = self.shared.writer.lock();
        if let Err(error) = write_all_vectored(&mut *writer, &parts) {
            drop(writer);
            self.shared
                .die(format!("sending a request failed: {error}"));
        }
        Ok(())
    }

    /// Sends the READs for `read` (one per piece the server takes) and returns; the reply
    /// thread writes the data into the read's memory and, once every piece has ended,
    /// completes it with the first error, if any.
    fn submit_read(&self, mut read: ReadRequest) {
        let (offset, length_bytes) = (read.offset(), read.length_bytes());
        if let Err(error) = check_range(self.size(), offset, length_bytes) {
            return read.complete(Err(error));
        }
        if length_bytes == 0 {
            return read.complete(Ok(()));
        }
        let splits = self.pieces(offset, length_bytes);
        let lengths: Vec<usize> = splits.iter().map(|&(_, length)| length as usize).collect();
        // The memory is owned by the request and stays where it is while the request is held
        // (below, until the last piece ends), so targets into it stay valid that long: the
        // reply thread writes a piece only before that piece's slot is done.
        let targets = ReadTarget::carve_all(&mut read.slices_mut(), &lengths);
        let pieces = PiecesLeft::new(splits.len(), Box::new(move |result| read.complete(result)));
        for ((piece_offset, piece_length), target) in splits.into_iter().zip(targets) {
            let header = self.header(CMD_READ, 0, piece_offset, piece_length.into());
            let expect = Expect::Read {
                offset: piece_offset,
                length_bytes: piece_length,
            };
            self.submit_piece(header, &[], expect, Some(target), &pieces);
        }
    }

    /// Sends the WRITEs for `write` (one per piece the server takes) and returns; the reply
    /// thread completes it once every piece has ended, with the first error, if any. The
    /// bytes have left when this returns; the request is held until its replies come.
    fn submit_write(&self, write: WriteRequest) {
        let (offset, length_bytes) = (write.offset(), write.length_bytes());
        if let Err(error) = self.check_writable(offset, length_bytes) {
            return write.complete(Err(error));
        }
        let splits = self.pieces(offset, length_bytes);
        if splits.is_empty() {
            return write.complete(Ok(()));
        }
        let pieces = PiecesLeft::waiting(splits.len());
        {
            let buffers = write.slices();
            let mut position = 0usize;
            for (piece_offset, piece_length) in splits {
                let header = self.header(CMD_WRITE, 0, piece_offset, piece_length.into());
                let parts = gather(&buffers, position, piece_length as usize);
                position += piece_length as usize;
                self.submit_piece(header, &parts, Expect::Nothing, None, &pieces);
            }
        }
        pieces.then(Box::new(move |result| write.complete(result)));
    }

    /// Registers and sends one piece of a submitted request; its end (or its failure to be
    /// sent) counts towards `pieces`.
    fn submit_piece(
        &self,
        header: RequestHeader,
        payload: &[&[u8]],
        expect: Expect,
        target: Option<ReadTarget>,
        pieces: &Arc<PiecesLeft>,
    ) {
        let uri = self.shared.uri.clone();
        let pieces = Arc::clone(pieces);
        let callback: SlotCallback = Box::new(move |completion| {
            let outcome = completion_outcome(&uri, &header, completion);
            pieces.end_one(outcome.map(|_| ()).map_err(io::Error::from));
        });
        let slot = Slot::with_callback(expect, target, Some(callback));
        if let Err(error) = self.submit_slot(header, payload, &slot) {
            slot.fail(&error.to_string());
        }
    }

    /// Waits for a slot and turns its outcome into a result.
    fn complete(&self, header: &RequestHeader, slot: &Slot) -> Result<Completion, ClientError> {
        completion_outcome(&self.shared.uri, header, slot.wait())
    }

    fn disconnected(&self, header: &RequestHeader, reason: &str) -> ClientError {
        disconnected(&self.shared.uri, header, reason)
    }

    fn protocol_error(&self, header: &RequestHeader, reason: &str) -> ClientError {
        let label = label(header);
        ClientError::Request {
            uri: self.shared.uri.clone(),
            command: command_name(label.command),
            length_bytes: label.length_bytes,
            offset: label.offset,
            errno: Errno::Io,
            message: reason.to_string(),
        }
    }

    fn unsupported(
        &self,
        command: u16,
        offset: u64,
        length_bytes: u64,
        reason: &str,
    ) -> ClientError {
        ClientError::Unsupported {
            uri: self.shared.uri.clone(),
            command: command_name(command),
            length_bytes,
            offset,
            reason: reason.to_string(),
        }
    }
}

/// A finished request's completion as a result: its error, or the lost connection.
fn completion_outcome(
    uri: &str,
    header: &RequestHeader,
    completion: Completion,
) -> Result<Completion, ClientError> {
    if let Some(reason) = &completion.connection_lost {
        return Err(disconnected(uri, header, reason));
    }
    if let Some((errno, message)) = &completion.error {
        let label = label(header);
        return Err(ClientError::Request {
            uri: uri.to_string(),
            command: command_name(label.command),
            length_bytes: label.length_bytes,
            offset: label.offset,
            errno: *errno,
            message: message.clone(),
        });
    }
    Ok(completion)
}

/// The error for a request whose connection was lost.
fn disconnected(uri: &str, header: &RequestHeader, reason: &str) -> ClientError {
    let label = label(header);
    ClientError::Disconnected {
        uri: uri.to_string(),
        command: command_name(label.command),
        length_bytes: label.length_bytes,
        offset: label.offset,
        reason: reason.to_string(),
    }
}

fn label(header: &RequestHeader) -> RequestLabel {
    RequestLabel {
        command: header.command,
        offset: header.offset,
        length_bytes: header.length,
    }
}

impl Drop for NbdClient {
    fn drop(&mut self) {
        let alive = self.shared.pending.lock().dead.is_none();
        if alive {
            self.disconnect();
        } else {
            self.join_reader();
        }
    }
}

/// Connects to the first address of `host` that answers, each attempt bounded so an
/// unreachable host fails the connect instead of hanging it.
fn connect_tcp(host: &str, port: u16) -> io::Result<TcpStream> {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let mut last_error = io::Error::new(io::ErrorKind::NotFound, "the host has no address");
    for address in (host, port).to_socket_addrs()? {
        match TcpStream::connect_timeout(&address, CONNECT_TIMEOUT) {
            Ok(stream) => return Ok(stream),
            Err(error) => last_error = error,
        }
    }
    Err(last_error)
}

/// Splits a range into `(offset, length)` pieces of at most `piece_bytes_max` bytes.
fn split(offset: u64, length_bytes: u64, piece_bytes_max: u64) -> Vec<(u64, u64)> {
    let mut pieces = Vec::new();
    let mut done = 0u64;
    while done < length_bytes {
        let step = (length_bytes - done).min(piece_bytes_max);
        pieces.push((offset + done, step));
        done += step;
    }
    pieces
}

/// The slices of `buffers` covering `length` bytes from byte `start` of their concatenation.
fn gather<'a>(buffers: &'a [IoSlice<'_>], start: usize, length: usize) -> Vec<&'a [u8]> {
    let mut parts = Vec::new();
    let mut skip = start;
    let mut left = length;
    for buffer in buffers {
        if left == 0 {
            break;
        }
        let bytes: &[u8] = buffer;
        if skip >= bytes.len() {
            skip -= bytes.len();
            continue;
        }
        let take = (bytes.len() - skip).min(left);
        parts.push(&bytes[skip..skip + take]);
        left -= take;
        skip = 0;
    }
    parts
}

/// Position in a list of destination slices, for carving them into pieces.
#[derive(Default)]
struct SliceCursor {
    buffer_index: usize,
    offset_in_buffer: usize,
}

impl SliceCursor {
    /// The next `length_bytes` of `whole` (start, length) as segments; empty buffers are
    /// stepped over.
    fn take(
        &mut self,
        whole: &[(*mut u8, usize)],
        length_bytes: usize,
    ) -> Vec<(NonNull<u8>, usize)> {
        let mut segments = Vec::new();
        let mut left = length_bytes;
        while self.buffer_index < whole.len() {
            let (start, length) = whole[self.buffer_index];
            let step = (length - self.offset_in_buffer).min(left);
            if step > 0 {
                // SAFETY: `offset_in_buffer` < `length`, so the pointer stays in the buffer.
                let at = unsafe { start.add(self.offset_in_buffer) };
                segments.extend(NonNull::new(at).map(|at| (at, step)));
            }
            left -= step;
            self.offset_in_buffer += step;
            if self.offset_in_buffer == length {
                self.buffer_index += 1;
                self.offset_in_buffer = 0;
            } else if left == 0 {
                break;
            }
        }
        segments
    }
}

/// Bytes the reply reader takes from the socket at a time: one `recv` then brings a reply's
/// header with a small READ's data, or several replies, where it took a read for the magic,
/// one for the rest of the header, one for a chunk's offset and one for the data (four for a
/// 4 KiB structured READ reply). Data larger than this goes straight into its request's buffer.
const REPLY_READ_BUFFER_BYTES: usize = 16 << 10;

/// The socket as replies are read from it: buffered (see `REPLY_READ_BUFFER_BYTES`).
type ReplyStream = io::BufReader<Stream>;

/// Why the reply reader stopped: the connection is dead then, and every request still
/// waiting on it fails with this as its reason.
#[derive(Clone, Debug, thiserror::Error)]
enum ReplyError {
    #[error("the server closed the connection")]
    Closed,
    #[error("the server closed the connection mid-reply")]
    ClosedMidReply,
    #[error("the server sent nothing for the reply timeout ({timeout_ms} ms) with {waiting} request(s) waiting for replies")]
    Silent { timeout_ms: u64, waiting: usize },
    #[error("reading a reply failed: {0}")]
    Read(Arc<io::Error>),
    /// The server broke the protocol: what it sent.
    #[error("protocol violation: {0}")]
    Protocol(String),
}

/// Reads replies until the connection ends, then fails whatever is still pending.
fn reader_loop(stream: Stream, shared: &Shared) {
    let mut stream = io::BufReader::with_capacity(REPLY_READ_BUFFER_BYTES, stream);
    let reason = loop {
        if let Err(reason) = read_one_reply(&mut stream, shared) {
            break reason;
        }
    };
    shared.die(reason.to_string());
}

/// Reads one simple reply or structured chunk and applies it to its slot.
fn read_one_reply(stream: &mut ReplyStream, shared: &Shared) -> Result<(), ReplyError> {
    let mut magic = [0u8; 4];
    let mut received = 0;
    // The socket's receive timeout is the reply timeout. Running out of it between replies is
    // fine while nothing is in flight. With requests waiting it ends the connection only the
    // second time in a row: a request sent just before the first time ran out has not waited
    // a whole timeout, one pending across a whole quiet timeout has. So a silent server is
    // declared dead between one and two reply timeouts after the oldest request was sent.
    let mut quiet_with_requests_waiting = false;
    while received < magic.len() {
        match stream.read(&mut magic[received..]) {
            Ok(0) => return Err(ReplyError::Closed),
            Ok(count) => received += count,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(error)
                if matches!(
                    error.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                let waiting = shared.pending.lock().slots.len();
                if received > 0 || (waiting > 0 && quiet_with_requests_waiting) {
                    let timeout_ms = shared.reply_timeout_ms.load(Ordering::Relaxed);
                    return Err(ReplyError::Silent {
                        timeout_ms,
                        waiting,
                    });
                }
                quiet_with_requests_waiting = waiting > 0;
            }
            Err(error) => return Err(io_reason(error)),
        }
    }
    let extended = shared.info.extended_headers;
    match be_u32(&magic) {
        SIMPLE_REPLY_MAGIC if !extended => read_simple_reply(stream, shared),
        STRUCTURED_REPLY_MAGIC if !extended => read_structured_chunk(stream, shared),
        EXTENDED_REPLY_MAGIC if extended => read_extended_chunk(stream, shared),
        other => Err(ReplyError::Protocol(format!(
            "reply magic {other:#x} (extended headers: {extended})"
        ))),
    }
}

fn io_reason(error: io::Error) -> ReplyError {
    ReplyError::Read(Arc::new(error))
}

fn take_slot(shared: &Shared, handle: u64, remove: bool) -> Result<Arc<Slot>, ReplyError> {
    let mut table = shared.pending.lock();
    let slot = if remove {
        table.slots.remove(&handle)
    } else {
        table.slots.get(&handle).cloned()
    };
    slot.ok_or_else(|| ReplyError::Protocol(format!("reply for unknown handle {handle}")))
}

fn read_simple_reply(stream: &mut ReplyStream, shared: &Shared) -> Result<(), ReplyError> {
    let mut rest = [0u8; SIMPLE_REPLY_HEADER_BYTES - 4];
    stream.read_exact(&mut rest).map_err(io_reason)?;
    let error = be_u32(&rest[0..4]);
    let handle = be_u64(&rest[4..12]);
    let slot = take_slot(shared, handle, true)?;
    // The slot has left the pending table, so `die` can no longer fail it: any error from
    // here on must fail it directly, or its caller would wait forever.
    let mut state = slot.state.lock();
    let result = fill_simple_reply(stream, shared, &slot, &mut state, error);
    let deferred = fail_or_finish(&slot, &mut state, &result);
    drop(state);
    run_deferred(deferred);
    result
}

fn fill_simple_reply(
    stream: &mut ReplyStream,
    shared: &Shared,
    slot: &Slot,
    state: &mut SlotState,
    error: u32,
) -> Result<(), ReplyError> {
    if error != 0 {
        state.completion.error = Some((Errno::from_code(error), String::new()));
    } else if let Expect::Read { length_bytes, .. } = slot.expect {
        if shared.info.structured_replies {
            return Err(ReplyError::Protocol("simple reply to a READ".to_string()));
        }
        read_into_target(stream, state, 0..length_bytes as usize)?;
    }
    Ok(())
}

/// Completes a slot that was removed from the pending table: with the reply, or, when the
/// reply could not be read, as failed with the connection.
#[must_use]
fn fail_or_finish(
    slot: &Slot,
    state: &mut SlotState,
    result: &Result<(), ReplyError>,
) -> Option<Deferred> {
    if let Err(reason) = result {
        state.completion.connection_lost = Some(reason.to_string());
    }
    slot.finish(state)
}

fn read_structured_chunk(stream: &mut ReplyStream, shared: &Shared) -> Result<(), ReplyError> {
    let mut rest = [0u8; STRUCTURED_REPLY_HEADER_BYTES - 4];
    stream.read_exact(&mut rest).map_err(io_reason)?;
    let flags = be_u16(&rest[0..2]);
    let chunk_type = be_u16(&rest[2..4]);
    let handle = be_u64(&rest[4..12]);
    let length = be_u32(&rest[12..16]);
    read_chunk_payload(stream, shared, flags, chunk_type, handle, length)
}

/// An extended reply chunk: a structured chunk with the request's offset and a 64-bit length,
/// which must still fit a READ's data or [`CHUNK_BYTES_MAX`].
fn read_extended_chunk(stream: &mut ReplyStream, shared: &Shared) -> Result<(), ReplyError> {
    let mut rest = [0u8; EXTENDED_REPLY_HEADER_BYTES - 4];
    stream.read_exact(&mut rest).map_err(io_reason)?;
    let flags = be_u16(&rest[0..2]);
    let chunk_type = be_u16(&rest[2..4]);
    let handle = be_u64(&rest[4..12]);
    let length = be_u64(&rest[20..28]);
    let length = u32::try_from(length)
        .ok()
        .filter(|&length| {
            length
                <= shared
                    .info
                    .block_size_max
                    .saturating_add(8)
                    .max(CHUNK_BYTES_MAX)
        })
        .ok_or_else(|| ReplyError::Protocol(format!("extended chunk of {length} bytes")))?;
    read_chunk_payload(stream, shared, flags, chunk_type, handle, length)
}

/// Applies a structured or extended chunk's payload of `length` bytes to its slot.
fn read_chunk_payload(
    stream: &mut ReplyStream,
    shared: &Shared,
    flags: u16,
    chunk_type: u16,
    handle: u64,
    length: u32,
) -> Result<(), ReplyError> {
    let done = flags & REPLY_FLAG_DONE != 0;
    let slot = take_slot(shared, handle, done)?;
    let mut state = slot.state.lock();
    let mut result = apply_chunk(stream, &slot, &mut state, chunk_type, length);
    if done && result.is_ok() && state.completion.error.is_none() {
        result = check_read_coverage(&slot, &state);
    }
    // A final chunk's slot has left the pending table (see read_simple_reply); a failure on
    // a non-final chunk leaves the slot in the table, where `die` fails it.
    if done {
        let deferred = fail_or_finish(&slot, &mut state, &result);
        drop(state);
        run_deferred(deferred);
    }
    result
}

/// A successful structured READ must have delivered every byte it asked for.
impl SlotState {
    /// Records that a chunk delivered `range` of a READ; refuses one that overlaps an earlier
    /// chunk (the spec forbids it).
    fn cover(&mut self, range: &std::ops::Range<usize>) -> Result<(), ReplyError> {
        let at = self.covered.partition_point(|done| done.end <= range.start);
        if self
            .covered
            .get(at)
            .is_some_and(|next| next.start < range.end)
        {
            return Err(ReplyError::Protocol(format!(
                "READ reply chunks overlap at bytes {}..{} of the request",
                range.start, range.end
            )));
        }
        self.covered.insert(at, range.clone());
        self.covered_bytes += range.len() as u64;
        Ok(())
    }
}

fn check_read_coverage(slot: &Slot, state: &SlotState) -> Result<(), ReplyError> {
    match slot.expect {
        Expect::Read { length_bytes, .. } if state.covered_bytes != u64::from(length_bytes) => {
            Err(ReplyError::Protocol(format!(
                "READ reply covered {} of {length_bytes} bytes",
                state.covered_bytes
            )))
        }
        _ => Ok(()),
    }
}

/// Largest structured chunk the client accepts apart from READ data.
const CHUNK_BYTES_MAX: u32 = 1 << 20;

fn apply_chunk(
    stream: &mut ReplyStream,
    slot: &Slot,
    state: &mut SlotState,
    chunk_type: u16,
    length: u32,
) -> Result<(), ReplyError> {
    match (chunk_type, slot.expect) {
        (REPLY_TYPE_NONE, _) if length == 0 => Ok(()),
        (
            REPLY_TYPE_OFFSET_DATA,
            Expect::Read {
                offset,
                length_bytes,
            },
        ) if length > 8 => {
            let mut chunk_offset = [0u8; 8];
            stream.read_exact(&mut chunk_offset).map_err(io_reason)?;
            let range = chunk_range(offset, length_bytes, be_u64(&chunk_offset), length - 8)?;
            state.cover(&range)?;
            read_into_target(stream, state, range)
        }
        (
            REPLY_TYPE_OFFSET_HOLE,
            Expect::Read {
                offset,
                length_bytes,
            },
        ) if length == 12 => {
            let payload = read_payload(stream, length)?;
            let range = chunk_range(
                offset,
                length_bytes,
                be_u64(&payload),
                be_u32(&payload[8..]),
            )?;
            state.cover(&range)?;
            if let Some(target) = state.target.as_mut().filter(|_| !state.done) {
                for slice in target.slices(range).iter_mut() {
                    slice.fill(0);
                }
            }
            Ok(())
        }
        (REPLY_TYPE_BLOCK_STATUS, Expect::BlockStatus) if length >= 12 && length % 8 == 4 => {
            let payload = read_payload(stream, length)?;
            state.completion.extents = payload[4..]
                .chunks_exact(8)
                .map(|pair| (u64::from(be_u32(&pair[0..4])), be_u32(&pair[4..8])))
                .collect();
            Ok(())
        }
        (REPLY_TYPE_BLOCK_STATUS_EXT, Expect::BlockStatus) if length >= 24 && length % 16 == 8 => {
            let payload = read_payload(stream, length)?;
            if be_u32(&payload[4..8]) as usize != (payload.len() - 8) / 16 {
                return Err(ReplyError::Protocol(
                    "BLOCK_STATUS_EXT count disagrees with its length".to_string(),
                ));
            }
            // base:allocation has 32 bits of status; the upper half is zero.
            state.completion.extents = payload[8..]
                .chunks_exact(16)
                .map(|pair| (be_u64(&pair[0..8]), be_u64(&pair[8..16]) as u32))
                .collect();
            Ok(())
        }
        (chunk_type, _) if is_reply_error(chunk_type) && length >= 6 => {
            let payload = read_payload(stream, length)?;
            let mut reader = PayloadReader::new(&payload);
            let errno = Errno::from_code(reader.u32().unwrap_or(5));
            let message_length = reader.u16().unwrap_or(0) as usize;
            let message = reader
                .take(message_length)
                .map(|bytes| String::from_utf8_lossy(bytes).into_owned())
                .ok_or(ReplyError::Protocol(
                    "error message longer than its chunk".to_string(),
                ))?;
            state.completion.error.get_or_insert((errno, message));
            Ok(())
        }
        (chunk_type, _) => Err(ReplyError::Protocol(format!(
            "unexpected structured chunk type {chunk_type} of {length} bytes"
        ))),
    }
}

/// Reads bytes `range` of a READ's data from the socket into the caller's memory; when the
/// slot was already failed (the connection died meanwhile), the caller may be gone, so the
/// bytes are read and dropped instead.
fn read_into_target(
    stream: &mut ReplyStream,
    state: &mut SlotState,
    range: std::ops::Range<usize>,
) -> Result<(), ReplyError> {
    let length = range.len() as u64;
    match state.target.as_mut().filter(|_| !state.done) {
        Some(target) => read_exact_vectored(stream, &mut target.slices(range)).map_err(io_reason),
        None => match io::copy(&mut stream.by_ref().take(length), &mut io::sink()) {
            Ok(copied) if copied == length => Ok(()),
            Ok(_) => Err(ReplyError::ClosedMidReply),
            Err(error) => Err(io_reason(error)),
        },
    }
}

fn read_payload(stream: &mut ReplyStream, length: u32) -> Result<Vec<u8>, ReplyError> {
    if length > CHUNK_BYTES_MAX {
        return Err(ReplyError::Protocol(format!("chunk of {length} bytes")));
    }
    let mut payload = vec![0u8; length as usize];
    stream.read_exact(&mut payload).map_err(io_reason)?;
    Ok(payload)
}

/// Where a content chunk lands in the request's buffer; refuses chunks outside the request.
fn chunk_range(
    request_offset: u64,
    request_length: u32,
    chunk_offset: u64,
    chunk_length: u32,
) -> Result<std::ops::Range<usize>, ReplyError> {
    let start = chunk_offset.checked_sub(request_offset);
    let end = start.and_then(|start| start.checked_add(u64::from(chunk_length)));
    match (start, end) {
        (Some(start), Some(end)) if end <= u64::from(request_length) => {
            Ok(start as usize..end as usize)
        }
        _ => Err(ReplyError::Protocol(format!(
            "chunk of {chunk_length} bytes at {chunk_offset} lies outside \
             the request ({request_length} bytes at {request_offset})"
        ))),
    }
}

impl Device for NbdClient {
    fn read_vectored_at(&self, buffers: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<()> {
        let length: u64 = buffers.iter().map(|buffer| buffer.len() as u64).sum();
        check_range(self.size(), offset, length)?;
        Ok(self.read_vectored(offset, buffers)?)
    }

    fn write_vectored_at(&self, buffers: &[IoSlice<'_>], offset: u64) -> io::Result<()> {
        let length: u64 = buffers.iter().map(|buffer| buffer.len() as u64).sum();
        self.check_writable(offset, length)?;
        Ok(self.write_vectored(offset, buffers, false)?)
    }

    /// Every piece of every read is sent before this returns; the reply thread completes
    /// each read.
    fn submit_reads(&self, reads: Vec<ReadRequest>) {
        for read in reads {
            self.submit_read(read);
        }
    }

    /// Every piece of every write is sent before this returns, and none waits for a reply,
    /// so a batch costs about one round trip instead of one per write; the reply thread
    /// completes each write.
    fn submit_writes(&self, writes: Vec<WriteRequest>) {
        for write in writes {
            self.submit_write(write);
        }
    }

    /// A FLUSH asked for while another is in flight waits for it and then shares the next
    /// one ([`FlushGroup`]): a FLUSH covers every write completed before it was sent.
    fn flush(&self) -> io::Result<()> {
        self.flushes.flush(|| Ok(NbdClient::flush(self)?))
    }

    fn discard(&self, offset: u64, length: u64) -> io::Result<()> {
        check_range(self.size(), offset, length)?;
        Ok(self.trim(offset, length)?)
    }

    fn write_zeroes(&self, offset: u64, length: u64) -> io::Result<()> {
        check_range(self.size(), offset, length)?;
        Ok(self.zero(offset, length, true)?)
    }

    fn extents(&self, offset: u64, length: u64) -> io::Result<Vec<Extent>> {
        check_range(self.size(), offset, length)?;
        let extents = self.block_status(offset, length)?;
        Ok(extents
            .into_iter()
            .map(|extent| Extent {
                length: extent.length,
                hole: extent.hole,
            })
            .collect())
    }

    fn capabilities(&self) -> Capabilities {
        let info = &self.shared.info;
        Capabilities {
            length_bytes: self.size(),
            alignment_bytes: info.block_size_min as usize,
            // TRIM may leave old data behind; only WRITE_ZEROES promises zeroes.
            discard_zeroes: false,
            // Fast only when the server says so (it advertises FAST_ZERO); WRITE_ZEROES alone
            // may still be implemented by writing zeroes on the server's side.
            write_zeroes_fast: info.has_flag(TRANSMIT_SEND_WRITE_ZEROES)
                && info.has_flag(TRANSMIT_SEND_FAST_ZERO),
            extents: true,
            write_unit_bytes: 1,
            // The reply thread completes reads started with `start_read`.
            completes_later: true,
            inflight_requests_max: UPSTREAM_INFLIGHT_REQUESTS_MAX,
            request_bytes_max: u64::from(self.piece_bytes_max()),
            // Every write would fail with EPERM upstream: the cache must not accept any.
            read_only: info.read_only(),
        }
    }

    fn describe(&self) -> String {
        self.shared.uri.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gather_splits_slices_at_piece_boundaries() {
        let first = [1u8, 2, 3];
        let second = [4u8, 5];
        let buffers = [IoSlice::new(&first), IoSlice::new(&second)];
        let parts = gather(&buffers, 2, 2);
        assert_eq!(parts, vec![&[3u8][..], &[4u8][..]]);
    }

    #[test]
    fn read_targets_carve_pieces_across_buffers_and_expose_sub_ranges() {
        // Goal: a READ split into pieces writes each piece's bytes to the right place of the
        // caller's buffers, whatever the buffer boundaries (an empty buffer included). Method:
        // carve 2 + 3 bytes from 3-, 0- and 2-byte buffers, then write through sub-ranges of
        // each target.
        let mut first = [0u8; 3];
        let mut empty = [0u8; 0];
        let mut second = [0u8; 2];
        let mut buffers = [
            IoSliceMut::new(&mut first),
            IoSliceMut::new(&mut empty),
            IoSliceMut::new(&mut second),
        ];
        let mut targets = ReadTarget::carve_all(&mut buffers, &[2, 3]).into_iter();
        let (mut head, mut tail) = (targets.next().unwrap(), targets.next().unwrap());
        assert_eq!(head.segments.len(), 1);
        assert_eq!(
            tail.segments.len(),
            2,
            "the second piece spans both buffers"
        );
        for slice in head.slices(0..2).iter_mut() {
            let length = slice.len();
            slice.copy_from_slice(&[1, 2][..length]);
        }
        let mut tail_bytes = [3u8, 4, 5].into_iter();
        for slice in tail.slices(0..3).iter_mut() {
            for byte in slice.iter_mut() {
                *byte = tail_bytes.next().unwrap();
            }
        }
        for slice in tail.slices(1..2).iter_mut() {
            slice.fill(9);
        }
        drop((head, tail));
        assert_eq!((first, second), ([1, 2, 3], [9, 5]));
    }

    #[test]
    fn overlapping_read_chunks_are_refused() {
        // Goal: chunks that overlap cannot add up to a READ's length and leave a gap of the
        // caller's old bytes (the spec forbids overlap). Method: cover 0..256 twice, and
        // check that touching ranges are fine.
        let mut state = SlotState {
            completion: Completion::default(),
            target: None,
            covered_bytes: 0,
            covered: Vec::new(),
            done: false,
            on_done: None,
        };
        state.cover(&(256..512)).unwrap();
        state.cover(&(0..256)).unwrap();
        assert!(state.cover(&(0..256)).is_err());
        assert!(state.cover(&(500..600)).is_err());
        state.cover(&(512..600)).unwrap();
        assert_eq!(state.covered_bytes, 600);
    }

    #[test]
    fn chunk_range_refuses_chunks_outside_the_request() {
        assert_eq!(chunk_range(100, 50, 110, 10).unwrap(), 10..20);
        assert!(chunk_range(100, 50, 90, 10).is_err());
        assert!(chunk_range(100, 50, 140, 20).is_err());
    }
}
