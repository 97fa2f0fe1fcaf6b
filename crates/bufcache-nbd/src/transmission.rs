//! The server's transmission phase for one connection: read requests, validate them, serve
//! them, and write replies in whatever order they finish.
//!
//! The connection's threads take turns at reading (leader/follower, as nbdkit's threads do):
//! the thread holding the reading role reads a request and serves it itself when the export
//! says it will not wait for I/O (a cached read, a write into cache with room), then reads
//! the next — so the common request is read, served and answered on one thread with no
//! hand-off. Before a request that may wait, the thread passes the reading role to a waiting
//! thread (starting one, up to `workers_max`, when none waits) and serves it, so a slow
//! request never holds up the ones behind it. While the client has other requests in
//! flight and a thread waits, the reader instead hands the slow request to that thread and
//! reads on: the wake-up is then paid by that one request, not by every request behind it
//! (in the test VM a wake-up took 30–40 µs; handing FLUSHes over raised a FLUSH-heavy fio
//! run's IOPS by a tenth). A lone request (queue depth one) stays on the reading thread,
//! which spares it the wake-up.
//!
//! A READ whose blocks are all missing, over an upstream whose replies arrive on a thread of
//! their own, is not waited for at all: the reader starts it ([`Export::start_read`]) and
//! reads on. The upstream's reply thread, once the data is in the cache, sends the reply
//! itself when the writer lock is free and the socket takes the whole reply at once;
//! otherwise, or when the read failed, it leaves the work to the connection's threads
//! (a failed read is served again the usual way). It never waits for the client: a reply
//! the socket took only part of leaves its end as the writer's tail, which goes out before
//! any other bytes.
//!
//! Invariants:
//! - exactly one thread reads the socket at a time (the holder of the reading role); the one
//!   that sees the end records it, every later holder leaves, and the connection's own thread
//!   joins all others before returning, so a client's in-flight requests are answered even
//!   on `NBD_CMD_DISC` or server shutdown;
//! - every reply is written whole under the connection's writer lock (or its end is left as
//!   the writer's tail, sent first by whoever takes the lock next), so replies of concurrent
//!   requests never interleave on the wire;
//! - requests are validated before an export sees them, and the export is only called with
//!   ranges inside it; a protocol error costs the client an errno, not the connection, except
//!   where the byte stream cannot be trusted any more (bad magic, a write payload too large
//!   to skip);
//! - the bytes of requests and replies in flight are bounded twice: per connection (over
//!   `connection_inflight_bytes_max` the reader stops taking new requests until replies
//!   drain) and for the whole server (a request's bytes are reserved in the shared
//!   [`ServerBudget`] before its payload is read or its reply buffer allocated; when the
//!   budget is spent the reader waits, leaving the request in the socket, so clients are
//!   slowed by TCP back-pressure and nothing is refused);
//! - with an idle timeout, a connection with nothing in flight and nothing arriving for that
//!   long is closed; a connection with requests in flight is never idle;
//! - a share of the budget is held only while the connection makes progress: the socket's
//!   receive and send timeouts are the stall timeout, so a request header or WRITE payload
//!   that stops arriving, or a reply the client stops reading, ends the connection within
//!   it and releases every byte the connection held (a payload must also keep an average
//!   rate, so a trickle cannot hold its share either);
//! - the last quarter of the server budget (the headroom) is granted only to small requests
//!   of connections with nothing else in flight, at most one per connection and
//!   `headroom / connections_max` bytes each, so stalled large requests, however many, never
//!   keep a prompt client's request waiting.

use std::io::{self, Read};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use bufcache_device::{DeadlineMutex, DeadlineMutexGuard};
use parking_lot::{Condvar, Mutex};

use crate::buffers::BufferRecycler;
use crate::export::{Export, ReadDone, StartedRead};
use crate::handshake::{MetaContexts, Negotiated, BASE_ALLOCATION_ID, CACHE_STATE_ID};
use crate::protocol::*;
use crate::shutdown::ShutdownHandle;
use crate::stream::{read_exact_vectored, send_vectored_until, write_all_vectored, Stream};

/// Unused payload and reply buffers a server keeps for reuse at most (and never more than a
/// quarter of its in-flight budget), so resident memory stays near the cache size plus the
/// in-flight budget.
const BUFFERS_RETAINED_BYTES_MAX: u64 = 64 << 20;

/// Cost charged to every request on top of its data, so a flood of tiny requests is bounded
/// too.
const REQUEST_OVERHEAD_BYTES: u64 = 64;

/// A write larger than `request_size_max` times this is not a confused client but a broken
/// one: its payload is not worth skipping, and the connection is closed.
const OVERSIZED_WRITE_SKIP_FACTOR: u64 = 4;

/// Limits of one connection, from the server configuration.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ConnectionLimits {
    pub(crate) request_size_max: u32,
    pub(crate) connection_inflight_bytes_max: u64,
    pub(crate) workers_max: usize,
    pub(crate) idle_timeout: Option<Duration>,
    /// The socket's receive and send timeout during transmission (see the module's
    /// invariants).
    pub(crate) stall_timeout: Duration,
}

/// Why a connection ended abnormally.
#[derive(Debug, thiserror::Error)]
pub(crate) enum TransmissionError {
    #[error("socket error: {0}")]
    Io(#[from] io::Error),
    #[error("request magic is wrong; the stream cannot be resynchronised")]
    RequestMagic,
    #[error("a WRITE of {length_bytes} bytes waited for the in-flight budget for the stall timeout ({stall_timeout:?}) while its payload was not being sent")]
    PayloadStalledInQueue {
        length_bytes: u64,
        stall_timeout: Duration,
    },
    #[error("a request header stalled: only {received_bytes} of its {header_bytes} bytes arrived within the stall timeout ({stall_timeout:?})")]
    HeaderStalled {
        received_bytes: usize,
        header_bytes: usize,
        stall_timeout: Duration,
    },
    #[error("a payload of {length_bytes} bytes is far above the {request_size_max} byte maximum")]
    WriteTooLarge {
        length_bytes: u64,
        request_size_max: u32,
    },
}

/// A READ reply being sent: whether sending began, and what is left to send, copied, once
/// the export's buffers are let go: with the writer lock still held when the bounded send ran
/// out of time, or without it when the lock could not be had in time at all.
#[derive(Default)]
struct ReplyInProgress<'a> {
    started: bool,
    rest: Option<(Option<DeadlineMutexGuard<'a, Writer>>, Vec<u8>)>,
}

/// A validated request, ready for a worker.
struct Request {
    header: RequestHeader,
    /// A WRITE's data in its first `header.length` bytes (a reused buffer may be longer).
    payload: Vec<u8>,
    /// The metadata contexts a BLOCK_STATUS answers for: all the connection selected, or
    /// those its payload names (extended headers).
    contexts: MetaContexts,
    cost_bytes: u64,
    /// The export says it will not wait for I/O: the reader serves it without a hand-off.
    quick: bool,
    /// A quick WRITE whose data is still in the socket: the reader passes the socket to the
    /// export, which reads it straight into its own buffers.
    payload_in_stream: bool,
}

/// A refusal: the errno and a message for structured error chunks.
struct Refusal {
    errno: Errno,
    message: String,
}

fn refuse(errno: Errno, message: impl Into<String>) -> Refusal {
    Refusal {
        errno,
        message: message.into(),
    }
}

/// The most of a CACHE, or of a WRITE_ZEROES that must allocate, done in one call to the
/// export: pieces that move data. Between pieces a request looks whether the server is
/// shutting down or its client went away.
const MOVING_PIECE_BYTES: u64 = 64 << 20;

/// The same for a TRIM or a WRITE_ZEROES that may deallocate: pieces that only drop data,
/// cheap per byte, so larger (an upstream sees one request per piece).
const DROPPING_PIECE_BYTES: u64 = 64 << 30;

/// When a long request stops before its end (see [`Connection::in_pieces`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Abandon {
    /// Requests that change data run on after their client left (as if it had waited).
    OnShutdown,
    /// A CACHE is only worth finishing for a client that is there to read.
    OnShutdownOrClientGone,
}

/// How a long request is cut (see [`Connection::in_pieces`]).
#[derive(Clone, Copy, Debug)]
struct Pieces {
    bytes_max: u64,
    abandon: Abandon,
}

impl Pieces {
    fn moving(abandon: Abandon) -> Pieces {
        Pieces {
            bytes_max: MOVING_PIECE_BYTES,
            abandon,
        }
    }

    fn dropping(abandon: Abandon) -> Pieces {
        Pieces {
            bytes_max: DROPPING_PIECE_BYTES,
            abandon,
        }
    }
}

/// State shared by the threads serving one connection.
struct Connection {
    export: Arc<dyn Export>,
    /// The reading role: whoever holds it reads the next request from the socket.
    reading: ReadingRole,
    /// Never yields while it waits: a connection's threads meet here on every reply.
    writer: DeadlineMutex<Writer>,
    structured_replies: bool,
    /// Requests and replies have 32-byte headers; every reply is a chunk.
    extended_headers: bool,
    contexts: MetaContexts,
    transmission_flags: u16,
    /// Once triggered, every request read is refused with ESHUTDOWN.
    shutdown: ShutdownHandle,
    limits: ConnectionLimits,
    /// Shared with the server's connection registry, which reads when the connection went
    /// idle to pick the one to evict when every serving slot is taken.
    inflight: Arc<InflightBudget>,
    /// The server-wide budget every request's bytes are reserved in as well.
    budget: Arc<ServerBudget>,
    /// Set when a reply could not be written; the reader stops at its next request.
    broken: AtomicBool,
    /// Set once reading ended (end of stream, NBD_CMD_DISC, a broken stream): a long CACHE
    /// then stops, as no one is left to read what it would bring in.
    reading_ended: AtomicBool,
    /// Set once a request failed in the export and that was logged as a warning.
    failure_logged: AtomicBool,
    /// Threads started besides the connection's own, and how many wait for the reading role.
    crew: Crew,
    /// Requests accepted, and how many of them were served by the thread holding the reading
    /// role without giving it up.
    requests_served: AtomicU64,
    requests_served_inline: AtomicU64,
    /// READs started and not yet ended (their completion has not run to its end).
    started_reads: Outstanding,
    requests_started: AtomicU64,
    /// Threads serving a slow request or work right now: while any is, the client has
    /// requests in flight besides the one just read.
    serving: AtomicUsize,
    /// Slow requests the reader handed to a waiting thread and read on.
    requests_handed_off: AtomicU64,
}

/// The write side of a connection.
struct Writer {
    stream: Stream,
    /// The end of a reply an upstream reply thread could not send without waiting; it goes
    /// out before anything else (see [`Connection::lock_writer`]).
    tail: Vec<u8>,
}

/// A count of things in flight that a connection waits for before it ends.
#[derive(Default)]
struct Outstanding {
    count: Mutex<usize>,
    none_left: Condvar,
}

impl Outstanding {
    fn add(&self) {
        *self.count.lock() += 1;
    }

    fn remove(&self) {
        let mut count = self.count.lock();
        *count -= 1;
        if *count == 0 {
            self.none_left.notify_all();
        }
    }

    fn is_zero(&self) -> bool {
        *self.count.lock() == 0
    }

    fn wait_for_zero(&self) {
        let mut count = self.count.lock();
        while *count > 0 {
            self.none_left.wait(&mut count);
        }
    }
}

/// What a READ that was started leaves for the connection's threads when its completion
/// could not finish it alone.
enum Work {
    /// Send its reply (the writer was busy, or had a tail). The data is a copy in a reused
    /// buffer, so the cache's blocks are let go at once: work waits for a connection thread,
    /// and one of those may itself be waiting for those blocks.
    Reply {
        header: RequestHeader,
        cost_bytes: u64,
        data: Vec<u8>,
    },
    /// It failed: serve it again the usual way, which reports the error (or reads after an
    /// upstream reconnect).
    Redo {
        header: RequestHeader,
        cost_bytes: u64,
    },
    /// Send the writer's tail, in case nobody else is about to send.
    Tail,
    /// Serve a request that may wait, which the reader handed to a waiting thread so that it
    /// could read on (see [`ReadingRole::hand_to_waiting`]).
    Serve(Request),
}

/// Bytes a connection reads from its socket at a time when it needs a request header: one
/// `recv` then usually brings the header with a small WRITE's payload, or several queued
/// requests' headers, instead of a `recv` for each header and each payload. Larger reads (a
/// big payload into cache buffers) bypass the buffer, so at most this much of a payload is
/// copied through it.
const READ_BUFFER_BYTES: usize = 16 << 10;

/// The socket as requests are read from it: buffered (see `READ_BUFFER_BYTES`).
type RequestStream = io::BufReader<Stream>;

/// The read side of a connection and how reading ended.
struct Reader {
    stream: RequestStream,
    /// Set by the thread that saw the end (EOF, NBD_CMD_DISC, shutdown, a broken stream);
    /// every thread that takes the reading role afterwards leaves.
    ended: Option<Result<(), TransmissionError>>,
}

/// The reading role, handed from thread to thread, and the work started READs leave. Waiting
/// for either parks at once: the role is held for as long as requests keep arriving quick, so
/// spinning for it (as a mutex does, with `sched_yield` in a loop) only burns the CPU the
/// holder needs; in a FLUSH-heavy run those yields were most of the server's extra context
/// switches.
struct ReadingRole {
    idle: Mutex<RoleState>,
    given_back: Condvar,
    /// Threads waiting for the role or for work; when none is, a thread about to serve a
    /// slow request (or leaving work) starts another, up to the limit.
    waiting: AtomicUsize,
}

struct RoleState {
    /// The reader when no thread holds the role.
    reader: Option<Reader>,
    /// Work for whichever thread comes next, before the role.
    work: std::collections::VecDeque<Work>,
}

/// What a thread waiting at the reading role gets.
enum Taken {
    Reader(Reader),
    Work(Work),
}

impl ReadingRole {
    fn new(reader: Reader) -> Self {
        ReadingRole {
            idle: Mutex::new(RoleState {
                reader: Some(reader),
                work: std::collections::VecDeque::new(),
            }),
            given_back: Condvar::new(),
            waiting: AtomicUsize::new(0),
        }
    }

    /// Waits until there is work or no other thread holds the role; takes the work first.
    fn take(&self) -> Taken {
        let mut idle = self.idle.lock();
        self.waiting.fetch_add(1, Ordering::AcqRel);
        let taken = loop {
            if let Some(work) = idle.work.pop_front() {
                break Taken::Work(work);
            }
            if let Some(reader) = idle.reader.take() {
                break Taken::Reader(reader);
            }
            self.given_back.wait(&mut idle);
        };
        self.waiting.fetch_sub(1, Ordering::AcqRel);
        taken
    }

    /// Waits for the role itself, leaving any work to others.
    fn take_reader(&self) -> Reader {
        let mut idle = self.idle.lock();
        loop {
            if let Some(reader) = idle.reader.take() {
                return reader;
            }
            self.given_back.wait(&mut idle);
        }
    }

    /// Passes the role on to one waiting thread, if any.
    fn give_back(&self, reader: Reader) {
        let mut idle = self.idle.lock();
        bufcache_device::strict_assert!(idle.reader.is_none(), "two threads held the reading role");
        idle.reader = Some(reader);
        drop(idle);
        self.given_back.notify_one();
    }

    /// Leaves work for the next waiting thread.
    fn leave_work(&self, work: Work) {
        self.idle.lock().work.push_back(work);
        self.given_back.notify_one();
    }

    /// Leaves `request` for a waiting thread if one waits that no other work is promised to;
    /// gives it back otherwise. The reader uses this for a slow request while the client has
    /// others in flight: waking a waiting thread for the request costs that request a
    /// wake-up, where passing the reading role on would stall every request behind it for
    /// one (measured: the wake-up took 30–40 µs in the test VM, on every FLUSH of a
    /// FLUSH-heavy run).
    fn hand_to_waiting(&self, request: Request) -> Result<(), Request> {
        let mut idle = self.idle.lock();
        if idle.work.len() >= self.waiting.load(Ordering::Acquire) {
            return Err(request);
        }
        idle.work.push_back(Work::Serve(request));
        drop(idle);
        self.given_back.notify_one();
        Ok(())
    }

    /// Work nobody has taken yet, if any.
    fn take_work(&self) -> Option<Work> {
        self.idle.lock().work.pop_front()
    }

    fn has_work(&self) -> bool {
        !self.idle.lock().work.is_empty()
    }

    /// Whether a thread waits that no queued work is promised to: a thread that was woken
    /// for work still counts as waiting until it runs, and must not be counted on twice.
    fn free_thread_waits(&self) -> bool {
        let idle = self.idle.lock();
        self.waiting.load(Ordering::Acquire) > idle.work.len()
    }
}

/// The threads of one connection beyond its own, started on demand.
struct Crew {
    handles: Mutex<Vec<JoinHandle<()>>>,
}

/// What the holder of the reading role does next.
enum Turn {
    /// A request that may wait for I/O: give up the reading role, then serve it.
    Slow(Request),
    /// Reading has ended.
    Ended,
}

/// Serves one connection from the end of the handshake until the client leaves, the socket
/// fails, or the server shuts the read side down. Returns after every reply was written.
///
/// Threads take turns (leader/follower): the thread holding the reading role reads a
/// request; one that will not wait (a hit, a write into cache with room) it serves itself and
/// reads on, so a request costs no hand-off between threads; before one that may wait, it
/// passes the role on (starting a thread if none is waiting) and serves it, so slow requests
/// never hold up the ones behind them.
pub(crate) fn serve(
    stream: Stream,
    negotiated: Negotiated,
    limits: ConnectionLimits,
    budget: Arc<ServerBudget>,
    inflight: Arc<InflightBudget>,
) -> Result<(), TransmissionError> {
    let connection = Arc::new(Connection {
        export: negotiated.export,
        writer: DeadlineMutex::new(Writer {
            stream: stream.try_clone()?,
            tail: Vec::new(),
        }),
        reading: ReadingRole::new(Reader {
            stream: io::BufReader::with_capacity(READ_BUFFER_BYTES, stream),
            ended: None,
        }),
        structured_replies: negotiated.structured_replies,
        extended_headers: negotiated.extended_headers,
        contexts: negotiated.contexts,
        transmission_flags: negotiated.transmission_flags,
        shutdown: negotiated.shutdown,
        limits,
        inflight,
        budget,
        broken: AtomicBool::new(false),
        reading_ended: AtomicBool::new(false),
        failure_logged: AtomicBool::new(false),
        crew: Crew {
            handles: Mutex::new(Vec::new()),
        },
        requests_served: AtomicU64::new(0),
        requests_served_inline: AtomicU64::new(0),
        started_reads: Outstanding::default(),
        requests_started: AtomicU64::new(0),
        serving: AtomicUsize::new(0),
        requests_handed_off: AtomicU64::new(0),
    });
    take_turns(&connection);
    join_crew(&connection);
    finish_started_reads(&connection);
    tracing::debug!(
        requests = connection.requests_served.load(Ordering::Relaxed),
        served_without_hand_off = connection.requests_served_inline.load(Ordering::Relaxed),
        started_without_waiting = connection.requests_started.load(Ordering::Relaxed),
        handed_off = connection.requests_handed_off.load(Ordering::Relaxed),
        "connection finished"
    );
    let mut reader = connection.reading.take_reader();
    // The outcome is taken out but the end stays recorded, so no thread can ever read
    // again: a request after a protocol violation must never be served.
    let ended = reader.ended.replace(Ok(()));
    connection.reading.give_back(reader);
    ended.unwrap_or(Ok(()))
}

/// Joins every thread the connection started, including ones started while the first were
/// joined: a thread that took a slow request just before reading ended starts a successor
/// before serving it. Each finishes the requests it took; a successor finds reading ended and
/// leaves. The list is empty for good once every thread that could add to it has left.
fn join_crew(connection: &Connection) {
    loop {
        let handles = std::mem::take(&mut *connection.crew.handles.lock());
        if handles.is_empty() {
            return;
        }
        for handle in handles {
            let _ = handle.join();
        }
    }
}

/// After reading ended and the crew left: waits for every started READ to end and does
/// the work they leave, so every request the client sent is answered.
fn finish_started_reads(connection: &Arc<Connection>) {
    loop {
        connection.started_reads.wait_for_zero();
        while let Some(work) = connection.reading.take_work() {
            connection.do_work(work);
        }
        join_crew(connection);
        if connection.started_reads.is_zero() && !connection.reading.has_work() {
            return;
        }
    }
}

/// One thread's part: wait for the reading role (or work started READs left), read and
/// serve until a slow request, pass the role on, serve that request, and again, until
/// reading has ended.
fn take_turns(connection: &Arc<Connection>) {
    loop {
        let mut reader = match connection.reading.take() {
            Taken::Work(work) => {
                let _serving = Serving::enter(connection);
                connection.do_work(work);
                continue;
            }
            Taken::Reader(reader) => reader,
        };
        let turn = read_until_slow(&mut reader, connection);
        connection.reading.give_back(reader);
        match turn {
            Turn::Ended => return,
            Turn::Slow(request) => {
                start_reader_if_none_waits(connection);
                let _serving = Serving::enter(connection);
                connection.execute(request);
            }
        }
    }
}

/// Counts a thread in [`Connection::serving`] while it lives.
struct Serving<'a>(&'a Connection);

impl<'a> Serving<'a> {
    fn enter(connection: &'a Connection) -> Self {
        connection.serving.fetch_add(1, Ordering::AcqRel);
        Serving(connection)
    }
}

impl Drop for Serving<'_> {
    fn drop(&mut self) {
        self.0.serving.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Starts one more thread for the connection when no thread waits for the reading role (none
/// that queued work is not already promised to) and the limit allows, so the next request
/// is read while this thread serves a slow one.
fn start_reader_if_none_waits(connection: &Arc<Connection>) {
    if connection.reading.free_thread_waits() {
        return;
    }
    let mut handles = connection.crew.handles.lock();
    if handles.len() >= connection.limits.workers_max {
        return;
    }
    let member = Arc::clone(connection);
    let spawned = std::thread::Builder::new()
        .name("nbd-worker".into())
        .spawn(move || take_turns(&member));
    match spawned {
        Ok(handle) => handles.push(handle),
        // This thread reads again once its request is served; nothing is lost.
        Err(error) => tracing::warn!("could not start an NBD worker thread: {error}"),
    }
}

/// Holding the reading role: reads requests, serving the quick ones on the spot, until one
/// that may wait arrives or reading ends.
fn read_until_slow(reader: &mut Reader, connection: &Arc<Connection>) -> Turn {
    if reader.ended.is_some() {
        return Turn::Ended;
    }
    loop {
        match read_request(&mut reader.stream, connection) {
            Ok(Some(request)) => {
                if !request.quick {
                    let request = match start_read(connection, request) {
                        Ok(()) => continue,
                        Err(request) => request,
                    };
                    match hand_off(connection, request, reader.stream.buffer().len()) {
                        Ok(()) => continue,
                        Err(request) => return Turn::Slow(request),
                    }
                }
                connection
                    .requests_served_inline
                    .fetch_add(1, Ordering::Relaxed);
                if !request.payload_in_stream {
                    connection.execute(request);
                } else if let Err(error) =
                    connection.execute_write_from_stream(request, &mut reader.stream)
                {
                    reader.ended = Some(Err(error));
                    connection.reading_ended.store(true, Ordering::Release);
                    return Turn::Ended;
                }
            }
            Ok(None) => continue,
            Err(result) => {
                reader.ended = Some(result);
                connection.reading_ended.store(true, Ordering::Release);
                return Turn::Ended;
            }
        }
    }
}

/// Hands a slow request to a waiting thread, so this one reads on, when the client has other
/// requests in flight (`buffered_bytes` of the socket already read, or requests being served
/// or started): then the next request is likely there already. A lone request (queue depth
/// one) comes back: serving it on this thread spares it a wake-up, and the next one cannot
/// arrive before its reply anyway.
fn hand_off(
    connection: &Connection,
    request: Request,
    buffered_bytes: usize,
) -> Result<(), Request> {
    let others_in_flight = buffered_bytes > 0
        || connection.serving.load(Ordering::Acquire) > 0
        || !connection.started_reads.is_zero();
    if !others_in_flight || !connection.reading.free_thread_waits() {
        return Err(request);
    }
    connection.reading.hand_to_waiting(request)?;
    connection
        .requests_handed_off
        .fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// Starts a READ the export can end on another thread, so this one reads on; the request
/// comes back when it is not a READ or the export cannot start it.
fn start_read(connection: &Arc<Connection>, request: Request) -> Result<(), Request> {
    let header = request.header;
    if header.command != CMD_READ || !connection.known_zeroes(&header).is_empty() {
        return Err(request);
    }
    connection.started_reads.add();
    let cost_bytes = request.cost_bytes;
    let finisher = Arc::clone(connection);
    let done: ReadDone = Box::new(move |outcome| {
        finisher.finish_started_read(header, cost_bytes, outcome);
        finisher.started_reads.remove();
    });
    match connection
        .export
        .start_read(header.offset, header.length as u32, done)
    {
        Ok(()) => {
            connection.requests_started.fetch_add(1, Ordering::Relaxed);
            connection.budget.give_back_payload(request.payload);
            Ok(())
        }
        Err(_not_started) => {
            connection.started_reads.remove();
            Err(request)
        }
    }
}

/// Leaves work for the connection's threads, starting one when none waits (a thread that
/// holds the reading role may be waiting for the client, which waits for this reply).
fn leave_work(connection: &Arc<Connection>, work: Work) {
    connection.reading.leave_work(work);
    start_reader_if_none_waits(connection);
}

/// Reads and validates one request. `Ok(None)` when it was refused and answered already;
/// `Err` with the connection's outcome when reading has ended.
fn read_request(
    stream: &mut RequestStream,
    connection: &Connection,
) -> Result<Option<Request>, Result<(), TransmissionError>> {
    connection
        .inflight
        .wait_below(connection.limits.connection_inflight_bytes_max);
    if connection.broken.load(Ordering::Acquire) {
        return Err(Ok(()));
    }
    // A request already buffered is not waited for. An idle timeout shorter than the
    // socket's receive timeout needs its own wait; a longer one is counted in receive
    // timeouts while the header is read, which costs no system call per request.
    let limits = &connection.limits;
    if let Some(idle_timeout) = limits
        .idle_timeout
        .filter(|&idle_timeout| idle_timeout < limits.stall_timeout)
        .filter(|_| stream.buffer().is_empty())
    {
        let readable = stream
            .get_ref()
            .wait_readable(idle_timeout)
            .map_err(|e| Err(e.into()))?;
        if !readable {
            return idle_timed_out(connection, idle_timeout);
        }
    }
    let header_length = if connection.extended_headers {
        EXTENDED_REQUEST_HEADER_BYTES
    } else {
        REQUEST_HEADER_BYTES
    };
    let header_bytes = match read_header(stream, header_length, limits)? {
        HeaderRead::Header(header_bytes) => header_bytes,
        HeaderRead::End => return Err(Ok(())),
        HeaderRead::Idle(idle_timeout) => return idle_timed_out(connection, idle_timeout),
    };
    let header = if connection.extended_headers {
        RequestHeader::decode_extended(&header_bytes)
    } else {
        let compact: &[u8; REQUEST_HEADER_BYTES] = header_bytes[..REQUEST_HEADER_BYTES]
            .try_into()
            .expect("a compact header's bytes");
        RequestHeader::decode(compact)
    };
    let header = header.ok_or(TransmissionError::RequestMagic).map_err(Err)?;
    if header.command == CMD_DISC {
        return Err(Ok(()));
    }
    // Reserve the request's bytes server-wide before its payload buffer exists; while the
    // budget is spent the payload stays in the socket.
    // Charged to the connection first: from its header on, a request makes the connection
    // busy (never evicted as idle), also while it waits for the budget or its payload.
    let cost_bytes = request_cost(&header, connection.limits.request_size_max);
    let connection_idle = connection.inflight.charge(cost_bytes);
    let stall_timeout = connection.limits.stall_timeout;
    let mut give_up = |waited: Duration| {
        if connection.broken.load(Ordering::Acquire) {
            return true;
        }
        if header.command != CMD_WRITE || waited < stall_timeout {
            return false;
        }
        let wanted = (header.length as usize).min(PAYLOAD_PROBE_BYTES);
        let buffered = stream.buffer().len();
        let available = stream
            .get_ref()
            .readable_bytes()
            .map_or(usize::MAX, |bytes| buffered + bytes);
        available < wanted
    };
    if !connection
        .budget
        .acquire(cost_bytes, connection_idle, &mut give_up)
    {
        connection.inflight.release(cost_bytes);
        return Err(Err(TransmissionError::PayloadStalledInQueue {
            length_bytes: header.length,
            stall_timeout,
        }));
    }
    let validated = connection.validate(&header);
    let quick = validated.is_ok() && connection.is_quick(&header);
    if quick
        && header.command == CMD_WRITE
        && header.length <= connection.limits.request_size_max.into()
    {
        connection.requests_served.fetch_add(1, Ordering::Relaxed);
        return Ok(Some(Request {
            header,
            payload: Vec::new(),
            contexts: connection.contexts,
            cost_bytes,
            quick,
            payload_in_stream: true,
        }));
    }
    let payload = match read_payload(stream, connection, &header) {
        Ok(Ok(payload)) => payload,
        Ok(Err(refusal)) => {
            connection.send_error(&header, &refusal);
            connection.release(cost_bytes);
            return Ok(None);
        }
        Err(error) => {
            connection.release(cost_bytes);
            return Err(Err(error));
        }
    };
    // A BLOCK_STATUS with a payload (extended headers) is validated once the payload says
    // its effect length and contexts.
    let payload_form = validated
        .and_then(|()| connection.block_status_payload(&header, &payload))
        .and_then(|(effective, contexts)| {
            if effective != header {
                connection.validate(&effective)?;
            }
            Ok((effective, contexts))
        });
    let (effective, contexts) = match payload_form {
        Ok(effective) => effective,
        Err(refusal) => {
            tracing::debug!(
                command = %command_name(header.command),
                offset = header.offset,
                length = header.length,
                errno = %refusal.errno,
                "request refused: {}",
                refusal.message
            );
            connection.send_error(&header, &refusal);
            connection.budget.give_back_payload(payload);
            connection.release(cost_bytes);
            return Ok(None);
        }
    };
    connection.requests_served.fetch_add(1, Ordering::Relaxed);
    Ok(Some(Request {
        header: effective,
        payload,
        contexts,
        cost_bytes,
        quick,
        payload_in_stream: false,
    }))
}

/// Reads the next request header (`header_length` bytes: compact or extended); `End` at
/// end-of-file (also mid-header: the client is gone). Waiting for a header to begin is not a
/// stall (an idle client holds nothing), but a header begun and not finished within the stall
/// timeout ends the connection. An idle timeout at least as long as the stall timeout (the
/// socket's receive timeout) is counted here in receive timeouts, its last part waited for
/// exactly: `Idle` when it ran out before a header began.
fn read_header(
    stream: &mut RequestStream,
    header_length: usize,
    limits: &ConnectionLimits,
) -> Result<HeaderRead, Result<(), TransmissionError>> {
    let stall_timeout = limits.stall_timeout;
    // Counted here only when at least one receive timeout long (else `read_request` waits).
    let idle_timeout = limits
        .idle_timeout
        .filter(|&idle_timeout| idle_timeout >= stall_timeout);
    let mut idle_waited = Duration::ZERO;
    let mut header_bytes = [0u8; EXTENDED_REQUEST_HEADER_BYTES];
    let mut received_bytes = 0;
    while received_bytes < header_length {
        match stream.read(&mut header_bytes[received_bytes..header_length]) {
            Ok(0) => return Ok(HeaderRead::End),
            Ok(count) => received_bytes += count,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(error) if is_timeout(&error) && received_bytes == 0 => {
                // A whole receive timeout passed with nothing sent.
                idle_waited += stall_timeout;
                let Some(idle_timeout) = idle_timeout else {
                    continue;
                };
                let rest = idle_timeout.saturating_sub(idle_waited);
                if rest >= stall_timeout {
                    continue;
                }
                // Less than one receive timeout is left: wait exactly that long.
                let readable = rest > Duration::ZERO
                    && stream
                        .get_ref()
                        .wait_readable(rest)
                        .map_err(|e| Err(e.into()))?;
                if !readable {
                    return Ok(HeaderRead::Idle(idle_timeout));
                }
            }
            Err(error) if is_timeout(&error) => {
                return Err(Err(TransmissionError::HeaderStalled {
                    received_bytes,
                    header_bytes: header_length,
                    stall_timeout,
                }))
            }
            Err(error) => return Err(Err(error.into())),
        }
    }
    Ok(HeaderRead::Header(header_bytes))
}

/// What waiting for a request header gave.
enum HeaderRead {
    /// The header's bytes (the first `header_length` are set).
    Header([u8; EXTENDED_REQUEST_HEADER_BYTES]),
    /// The client closed the connection before a header began.
    End,
    /// Nothing arrived for the idle timeout (given).
    Idle(Duration),
}

/// The idle timeout ran out with nothing received: the connection ends when nothing of it
/// is in flight either; otherwise requests are still being served, the client is waiting,
/// not idle, and the wait starts again (`Ok(None)`).
fn idle_timed_out(
    connection: &Connection,
    idle_timeout: Duration,
) -> Result<Option<Request>, Result<(), TransmissionError>> {
    if connection.inflight.is_idle() {
        tracing::info!(
            ?idle_timeout,
            "closing a connection idle for longer than the idle timeout"
        );
        return Err(Ok(()));
    }
    Ok(None)
}

/// True for the error a socket read or write gives when its timeout (the stall timeout)
/// ran out.
fn is_timeout(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// The socket as a WRITE payload is read from it. Each read waits at most the stall timeout
/// (the socket's receive timeout), and all reads of one payload together wait at most
/// `waited_max` (the stall timeout plus the payload's length at
/// [`crate::config::PAYLOAD_BYTES_PER_SECOND_MIN`]), so a client that stops sending, or
/// trickles, loses its connection and the payload's share of the budget. Only time spent
/// waiting for the socket counts, never time the export spends between reads.
struct PayloadReader<'a> {
    stream: &'a mut RequestStream,
    length_bytes: u64,
    stall_timeout: Duration,
    waited: Duration,
    waited_max: Duration,
}

impl<'a> PayloadReader<'a> {
    fn new(stream: &'a mut RequestStream, length_bytes: u64, stall_timeout: Duration) -> Self {
        let trickle_seconds =
            length_bytes as f64 / crate::config::PAYLOAD_BYTES_PER_SECOND_MIN as f64;
        PayloadReader {
            stream,
            length_bytes,
            stall_timeout,
            waited: Duration::ZERO,
            waited_max: stall_timeout + Duration::from_secs_f64(trickle_seconds),
        }
    }

    fn timed(
        &mut self,
        read: impl FnOnce(&mut RequestStream) -> io::Result<usize>,
    ) -> io::Result<usize> {
        if self.waited > self.waited_max {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "a WRITE payload of {} bytes trickled: it took longer than {:?}",
                    self.length_bytes, self.waited_max
                ),
            ));
        }
        let started = std::time::Instant::now();
        let result = read(self.stream);
        self.waited += started.elapsed();
        match result {
            Err(error) if is_timeout(&error) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "a WRITE payload of {} bytes stalled: nothing arrived for the stall timeout ({:?})",
                    self.length_bytes, self.stall_timeout
                ),
            )),
            other => other,
        }
    }
}

impl Read for PayloadReader<'_> {
    fn read(&mut self, buffer: &mut [u8]) -> io::Result<usize> {
        self.timed(|stream| stream.read(buffer))
    }

    fn read_vectored(&mut self, buffers: &mut [io::IoSliceMut<'_>]) -> io::Result<usize> {
        self.timed(|stream| stream.read_vectored(buffers))
    }
}

/// Reads a request's payload (a WRITE's data; with extended headers, whatever
/// `CMD_FLAG_PAYLOAD_LEN` announces) whole. An oversized payload is skipped (and refused) when
/// that is cheap enough; beyond that the connection ends.
fn read_payload(
    stream: &mut RequestStream,
    connection: &Connection,
    header: &RequestHeader,
) -> Result<Result<Vec<u8>, Refusal>, TransmissionError> {
    let length = connection.payload_bytes(header);
    if length == 0 {
        return Ok(Ok(Vec::new()));
    }
    let request_size_max = connection.limits.request_size_max;
    let mut stream = PayloadReader::new(stream, length, connection.limits.stall_timeout);
    if length <= u64::from(request_size_max) {
        let mut payload = connection.budget.buffers().take(length as usize);
        if let Err(error) = stream.read_exact(&mut payload[..length as usize]) {
            connection.budget.buffers().give_back(payload);
            return Err(error.into());
        }
        return Ok(Ok(payload));
    }
    if length > u64::from(request_size_max) * OVERSIZED_WRITE_SKIP_FACTOR {
        return Err(TransmissionError::WriteTooLarge {
            length_bytes: length,
            request_size_max,
        });
    }
    let skipped = io::copy(&mut stream.by_ref().take(length), &mut io::sink())?;
    if skipped < length {
        return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
    }
    let message = format!(
        "{} with a payload of {length} bytes exceeds the maximum request size of \
         {request_size_max} bytes",
        command_name(header.command)
    );
    // EINVAL, not EOVERFLOW: the spec keeps EOVERFLOW for READ with DF.
    Ok(Err(refuse(Errno::Invalid, message)))
}

/// Bytes a request holds while in flight: its data (payload or reply) plus a fixed overhead.
/// A READ or WRITE above the maximum request size is refused without a buffer of its size
/// (an oversized payload is skipped through a small one), so it costs only the overhead.
fn request_cost(header: &RequestHeader, request_size_max: u32) -> u64 {
    let data_bytes = match header.command {
        CMD_READ | CMD_WRITE if header.length <= u64::from(request_size_max) => header.length,
        _ => 0,
    };
    data_bytes + REQUEST_OVERHEAD_BYTES
}

impl Connection {
    /// True when the export says the request will not wait for device I/O, so the thread
    /// holding the reading role may serve it without passing the role on.
    fn is_quick(&self, header: &RequestHeader) -> bool {
        let length = header.length;
        match header.command {
            CMD_READ => self.export.read_is_quick(header.offset, length),
            CMD_WRITE => {
                let fua = header.flags & CMD_FLAG_FUA != 0;
                self.export.write_is_quick(header.offset, length, fua)
            }
            _ => false,
        }
    }

    /// Checks a request against the negotiated features and the export's bounds.
    fn validate(&self, header: &RequestHeader) -> Result<(), Refusal> {
        if self.shutdown.is_triggered() {
            // Requests read before the shutdown are served; these are answered at once, as
            // the spec suggests, and the client then disconnects.
            return Err(refuse(Errno::Shutdown, "the server is shutting down"));
        }
        let command = header.command;
        let allowed_flags = self
            .allowed_flags(command)
            .ok_or_else(|| refuse(Errno::Invalid, format!("unknown command {command}")))?;
        if header.flags & !allowed_flags != 0 {
            let message = format!(
                "flags {:#x} are not valid for {}",
                header.flags & !allowed_flags,
                command_name(command)
            );
            return Err(refuse(Errno::Invalid, message));
        }
        let writes = matches!(command, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
        if writes && self.transmission_flags & TRANSMIT_READ_ONLY != 0 {
            return Err(refuse(Errno::Perm, "the export is read-only"));
        }
        // ENOSPC past the end is for the commands that store data; TRIM only forgets it.
        let stores = matches!(command, CMD_WRITE | CMD_WRITE_ZEROES);
        if header.flags & CMD_FLAG_PAYLOAD_LEN != 0 && command == CMD_BLOCK_STATUS {
            // Checked again once the payload gives the effect length and contexts.
            return Ok(());
        }
        if command == CMD_READ && header.length > u64::from(self.limits.request_size_max) {
            let message = format!(
                "READ of {} bytes exceeds the maximum request size of {} bytes",
                header.length, self.limits.request_size_max
            );
            // EOVERFLOW only where the spec documents it: a READ that may not be fragmented.
            let errno = if header.flags & CMD_FLAG_DF != 0 {
                Errno::Overflow
            } else {
                Errno::Invalid
            };
            return Err(refuse(errno, message));
        }
        if command == CMD_BLOCK_STATUS {
            if !self.contexts.any() {
                return Err(refuse(Errno::Invalid, "no metadata context was negotiated"));
            }
            if header.length == 0 {
                return Err(refuse(Errno::Invalid, "BLOCK_STATUS of zero bytes"));
            }
        }
        self.check_range(header, stores)
    }

    /// Flags valid for `command`, or `None` for an unknown command. FUA is accepted on every
    /// command because it is advertised and the spec says so.
    fn allowed_flags(&self, command: u16) -> Option<u16> {
        let specific = match command {
            CMD_READ if self.structured_replies => CMD_FLAG_DF,
            CMD_READ | CMD_FLUSH | CMD_TRIM | CMD_CACHE => 0,
            CMD_WRITE if self.extended_headers => CMD_FLAG_PAYLOAD_LEN,
            CMD_WRITE => 0,
            CMD_WRITE_ZEROES if self.transmission_flags & TRANSMIT_SEND_FAST_ZERO != 0 => {
                CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO
            }
            CMD_WRITE_ZEROES => CMD_FLAG_NO_HOLE,
            CMD_BLOCK_STATUS if self.extended_headers => CMD_FLAG_REQ_ONE | CMD_FLAG_PAYLOAD_LEN,
            CMD_BLOCK_STATUS => CMD_FLAG_REQ_ONE,
            _ => return None,
        };
        Some(specific | CMD_FLAG_FUA)
    }

    /// Bytes of payload that follow `header`: a WRITE's data, or with extended headers what
    /// `CMD_FLAG_PAYLOAD_LEN` announces. Read even when the request is refused, so the stream
    /// stays in step. The spec asks an extended WRITE to set the flag, but qemu's client does
    /// not: a WRITE's length is its payload's either way (as qemu-nbd takes it).
    fn payload_bytes(&self, header: &RequestHeader) -> u64 {
        let has_payload = header.command == CMD_WRITE
            || (self.extended_headers && header.flags & CMD_FLAG_PAYLOAD_LEN != 0);
        if has_payload {
            header.length
        } else {
            0
        }
    }

    /// For a BLOCK_STATUS whose payload (extended headers, `CMD_FLAG_PAYLOAD_LEN`) gives the
    /// effect length and the context ids to answer: the request as it acts (that length, no
    /// payload flag) and those contexts. Any other request comes back as it is, with every
    /// context the connection selected. Unknown or repeated ids are refused, as the spec asks.
    fn block_status_payload(
        &self,
        header: &RequestHeader,
        payload: &[u8],
    ) -> Result<(RequestHeader, MetaContexts), Refusal> {
        if header.command != CMD_BLOCK_STATUS || header.flags & CMD_FLAG_PAYLOAD_LEN == 0 {
            return Ok((*header, self.contexts));
        }
        let payload = &payload[..payload.len().min(header.length as usize)];
        let malformed = || {
            refuse(
                Errno::Invalid,
                "a BLOCK_STATUS payload is an 8-byte length and 4-byte context ids",
            )
        };
        if payload.len() < 12 || !(payload.len() - 8).is_multiple_of(4) {
            return Err(malformed());
        }
        let mut contexts = MetaContexts::default();
        for id in payload[8..].chunks_exact(4).map(be_u32) {
            let (selected, seen) = match id {
                BASE_ALLOCATION_ID => {
                    (self.contexts.base_allocation, &mut contexts.base_allocation)
                }
                CACHE_STATE_ID => (self.contexts.cache_state, &mut contexts.cache_state),
                _ => (false, &mut contexts.base_allocation),
            };
            if !selected || *seen {
                let message = format!("context id {id} is not selected, or named twice");
                return Err(refuse(Errno::Invalid, message));
            }
            *seen = true;
        }
        let effective = RequestHeader {
            flags: header.flags & !CMD_FLAG_PAYLOAD_LEN,
            length: be_u64(payload),
            ..*header
        };
        Ok((effective, contexts))
    }

    /// Refuses ranges outside the export: ENOSPC for WRITE and WRITE_ZEROES (`stores`), EINVAL
    /// for the others (READ, TRIM, CACHE, BLOCK_STATUS), as the spec asks.
    fn check_range(&self, header: &RequestHeader, stores: bool) -> Result<(), Refusal> {
        if header.command == CMD_FLUSH {
            return Ok(());
        }
        let size = self.export.size();
        let end = header.offset.checked_add(header.length);
        if end.is_some_and(|end| end <= size) {
            return Ok(());
        }
        let errno = if stores {
            Errno::NoSpace
        } else {
            Errno::Invalid
        };
        let message = format!(
            "{} of {} bytes at offset {} reaches past the end of the export ({size} bytes)",
            command_name(header.command),
            header.length,
            header.offset
        );
        Err(refuse(errno, message))
    }

    /// Runs a validated request on a worker thread and sends its reply.
    fn execute(&self, request: Request) {
        let header = request.header;
        if header.command == CMD_READ {
            self.execute_read(&header);
        } else {
            let payload = &request.payload[..request.payload.len().min(header.length as usize)];
            match self
                .run_command(&header, payload, request.contexts)
                .and_then(|reply| self.check_acknowledge(&header).map(|()| reply))
            {
                Ok(None) => self.send_ok(&header),
                Ok(Some(chunk)) => self.send_parts(&[&chunk]),
                Err(error) => self.send_io_error(&header, &error),
            }
        }
        self.budget.give_back_payload(request.payload);
        self.inflight.release(request.cost_bytes);
        self.budget.release(request.cost_bytes);
    }

    /// Serves a quick WRITE whose data is still in the socket: the export reads it straight
    /// into its buffers. Whatever the export did not consume (it failed first) is skipped, so
    /// the stream stays in step. An error means the socket failed and the connection is over.
    fn execute_write_from_stream(
        &self,
        request: Request,
        stream: &mut RequestStream,
    ) -> Result<(), TransmissionError> {
        let header = request.header;
        let length = header.length;
        let fua = header.flags & CMD_FLAG_FUA != 0;
        let mut consumed = 0u64;
        let mut socket_error: Option<io::Error> = None;
        let mut stream = PayloadReader::new(stream, header.length, self.limits.stall_timeout);
        let result = {
            let mut source = |slices: &mut [io::IoSliceMut<'_>]| {
                let wanted: u64 = slices.iter().map(|slice| slice.len() as u64).sum();
                let read = read_exact_vectored(&mut stream, slices);
                match &read {
                    Ok(()) => consumed += wanted,
                    Err(error) => {
                        socket_error = Some(io::Error::new(error.kind(), error.to_string()))
                    }
                }
                read
            };
            self.export
                .write_from(header.offset, length, fua, &mut source)
        };
        let outcome = if let Some(error) = socket_error {
            drop(result);
            Err(error.into())
        } else {
            let skipped = io::copy(
                &mut stream.by_ref().take(length - consumed),
                &mut io::sink(),
            );
            match skipped {
                Ok(count) if count == length - consumed => {
                    match result.and_then(|()| self.check_acknowledge(&header)) {
                        Ok(()) => self.send_ok(&header),
                        Err(error) => self.send_io_error(&header, &error),
                    }
                    Ok(())
                }
                Ok(_) => Err(io::Error::from(io::ErrorKind::UnexpectedEof).into()),
                Err(error) => Err(error.into()),
            }
        };
        self.inflight.release(request.cost_bytes);
        self.budget.release(request.cost_bytes);
        outcome
    }

    /// The export's word on acknowledging a change that succeeded (a WRITE, FLUSH, TRIM or
    /// WRITE_ZEROES), taken just before its reply is sent.
    fn check_acknowledge(&self, header: &RequestHeader) -> io::Result<()> {
        match header.command {
            CMD_WRITE | CMD_FLUSH | CMD_TRIM | CMD_WRITE_ZEROES => {
                self.export.may_acknowledge_changes()
            }
            _ => Ok(()),
        }
    }

    /// Runs a non-READ command; `Some` carries a ready structured reply (block status).
    fn run_command(
        &self,
        header: &RequestHeader,
        payload: &[u8],
        contexts: MetaContexts,
    ) -> io::Result<Option<Vec<u8>>> {
        let export = self.export.as_ref();
        let fua = header.flags & CMD_FLAG_FUA != 0;
        match header.command {
            CMD_WRITE => export.write(header.offset, payload, fua)?,
            CMD_FLUSH => export.flush()?,
            CMD_TRIM => {
                let pieces = Pieces::dropping(Abandon::OnShutdown);
                self.in_pieces(header, pieces, |offset, length| {
                    export.trim(offset, length, false)
                })?;
                if fua {
                    export.flush()?;
                }
            }
            CMD_CACHE => {
                // Past what the export can hold, a CACHE would evict its own beginning.
                let taken = header.length.min(export.cache_request_bytes_max());
                let range = RequestHeader {
                    length: taken,
                    ..*header
                };
                let pieces = Pieces::moving(Abandon::OnShutdownOrClientGone);
                self.in_pieces(&range, pieces, |offset, length| {
                    export.cache(offset, length)
                })?;
            }
            CMD_WRITE_ZEROES => {
                let may_trim = header.flags & CMD_FLAG_NO_HOLE == 0;
                let fast_only = header.flags & CMD_FLAG_FAST_ZERO != 0;
                let pieces = if may_trim {
                    Pieces::dropping(Abandon::OnShutdown)
                } else {
                    Pieces::moving(Abandon::OnShutdown)
                };
                self.in_pieces(header, pieces, |offset, length| {
                    export.write_zeroes(offset, length, may_trim, fast_only, false)
                })?;
                if fua {
                    export.flush()?;
                }
            }
            CMD_BLOCK_STATUS => return self.block_status_reply(header, contexts).map(Some),
            other => unreachable!("command {other} passed validation"),
        }
        Ok(None)
    }

    /// Runs a request over a range (TRIM, WRITE_ZEROES, CACHE) as pieces of at most
    /// `pieces.bytes_max`, looking between pieces whether to go on: a request of
    /// terabytes (extended headers allow them) then ends soon after a shutdown, or after its
    /// client went away when no one is left to benefit (CACHE). A request cut short answers
    /// an error (ESHUTDOWN, or ECONNABORTED to a client that is gone): the NBD protocol leaves
    /// a failed TRIM's or WRITE_ZEROES's range in an unspecified state, and the pieces done
    /// are as valid as any.
    fn in_pieces(
        &self,
        header: &RequestHeader,
        pieces: Pieces,
        mut piece: impl FnMut(u64, u64) -> io::Result<()>,
    ) -> io::Result<()> {
        let end = header.offset + header.length;
        let mut offset = header.offset;
        while offset < end {
            if offset > header.offset {
                self.check_going_on(pieces.abandon)?;
            }
            let length = (end - offset).min(pieces.bytes_max);
            piece(offset, length)?;
            offset += length;
        }
        Ok(())
    }

    /// Whether a long request may take its next piece (see [`Connection::in_pieces`]).
    fn check_going_on(&self, abandon: Abandon) -> io::Result<()> {
        if self.shutdown.is_triggered() {
            return Err(io::Error::from_raw_os_error(libc::ESHUTDOWN));
        }
        let client_gone =
            self.reading_ended.load(Ordering::Acquire) || self.broken.load(Ordering::Acquire);
        if abandon == Abandon::OnShutdownOrClientGone && client_gone {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "the client went away; the rest of the request was not done",
            ));
        }
        Ok(())
    }

    /// The reply to a BLOCK_STATUS: one status chunk per metadata context in `contexts`, the
    /// last marked final. Every context is asked before anything is sent, so a failure is
    /// answered with one error reply.
    fn block_status_reply(
        &self,
        header: &RequestHeader,
        contexts: MetaContexts,
    ) -> io::Result<Vec<u8>> {
        // The work is bounded by what the disk holds (extents, dirty and cached blocks), not by
        // the range's length, and the reply by `STATUS_DESCRIPTORS_MAX`: a range of terabytes
        // is answered whole, as qemu-nbd does.
        let length = header.length;
        let mut chunks: Vec<(u32, Vec<(u64, u32)>)> = Vec::with_capacity(2);
        if contexts.base_allocation {
            let extents = self.export.block_status(header.offset, length)?;
            let descriptors = extents.iter().map(|extent| {
                let hole = if extent.hole { STATE_HOLE } else { 0 };
                let zero = if extent.zero { STATE_ZERO } else { 0 };
                (extent.length, hole | zero)
            });
            chunks.push((BASE_ALLOCATION_ID, descriptors.collect()));
        }
        if contexts.cache_state {
            let extents = self.export.cache_state(header.offset, length)?;
            let descriptors = extents.iter().map(|extent| {
                let resident = if extent.resident {
                    CACHE_STATE_RESIDENT
                } else {
                    0
                };
                let dirty = if extent.dirty { CACHE_STATE_DIRTY } else { 0 };
                (extent.length, resident | dirty)
            });
            chunks.push((CACHE_STATE_ID, descriptors.collect()));
        }
        let req_one = header.flags & CMD_FLAG_REQ_ONE != 0;
        let mut reply = Vec::new();
        for (index, (context_id, descriptors)) in chunks.iter().enumerate() {
            let done = index + 1 == chunks.len();
            let form = StatusChunk {
                context_id: *context_id,
                req_one,
                done,
                extended: self.extended_headers,
            };
            put_status_chunk(&mut reply, header, descriptors, form)?;
        }
        Ok(reply)
    }

    /// The end of a started READ, on whichever thread ended it (usually the upstream's reply
    /// thread): sends the reply now if that cannot wait for the client, else leaves it to
    /// the connection's threads; a failed read is left to be served again.
    fn finish_started_read(
        self: &Arc<Self>,
        header: RequestHeader,
        cost_bytes: u64,
        outcome: io::Result<StartedRead>,
    ) {
        let data = match outcome {
            Ok(data) => data,
            Err(_) => return leave_work(self, Work::Redo { header, cost_bytes }),
        };
        let free_writer = self
            .writer
            .try_lock()
            .filter(|writer| writer.tail.is_empty());
        let Some(mut writer) = free_writer else {
            return self.leave_reply(header, cost_bytes, &data);
        };
        if !self.broken.load(Ordering::Acquire) {
            let prefix = self.read_reply_prefix(&header);
            let slices = data.slices();
            let mut parts = Vec::with_capacity(slices.len() + 1);
            parts.push(io::IoSlice::new(&prefix));
            parts.extend(slices.iter().map(|slice| io::IoSlice::new(slice)));
            // One attempt that never blocks; whatever the socket did not take becomes the tail.
            match send_vectored_until(&writer.stream, &parts, std::time::Instant::now()) {
                Ok(sent) => {
                    let rest = unsent(&parts, sent);
                    if !rest.is_empty() {
                        writer.tail = rest;
                        drop(writer);
                        leave_work(self, Work::Tail);
                    }
                }
                Err(error) => {
                    self.reply_failed(Some(&writer.stream), &error);
                    self.broken.store(true, Ordering::Release);
                    writer.stream.shutdown_both();
                }
            }
        }
        self.release(cost_bytes);
    }

    /// Leaves a started READ's reply to the connection's threads, with its data copied.
    fn leave_reply(self: &Arc<Self>, header: RequestHeader, cost_bytes: u64, data: &StartedRead) {
        let mut copy = self.budget.buffers().take(header.length as usize);
        copy.clear();
        for slice in data.slices() {
            copy.extend_from_slice(&slice);
        }
        leave_work(
            self,
            Work::Reply {
                header,
                cost_bytes,
                data: copy,
            },
        );
    }

    /// Does work a started READ left.
    fn do_work(&self, work: Work) {
        match work {
            Work::Reply {
                header,
                cost_bytes,
                data,
            } => {
                let prefix = self.read_reply_prefix(&header);
                self.send_parts(&[&prefix, &data]);
                self.budget.buffers().give_back(data);
                self.release(cost_bytes);
            }
            Work::Redo { header, cost_bytes } => {
                self.execute_read(&header);
                self.release(cost_bytes);
            }
            Work::Tail => drop(self.lock_writer()),
            Work::Serve(request) => self.execute(request),
        }
    }

    /// Releases a finished request's bytes from both in-flight budgets.
    fn release(&self, cost_bytes: u64) {
        self.inflight.release(cost_bytes);
        self.budget.release(cost_bytes);
    }

    /// The writer, once any tail a reply thread left has gone out before anything else; an
    /// error when the connection is broken (or breaks sending the tail).
    fn lock_writer(&self) -> io::Result<DeadlineMutexGuard<'_, Writer>> {
        let mut writer = self.writer.lock();
        if self.broken.load(Ordering::Acquire) {
            return Err(io::ErrorKind::BrokenPipe.into());
        }
        if !writer.tail.is_empty() {
            let tail = std::mem::take(&mut writer.tail);
            if let Err(error) = write_all_vectored(&mut writer.stream, &[&tail]) {
                self.reply_failed(Some(&writer.stream), &error);
                self.broken.store(true, Ordering::Release);
                writer.stream.shutdown_both();
                return Err(error);
            }
        }
        Ok(writer)
    }

    /// The bytes before a READ reply's data: a simple reply header, or a structured (or
    /// extended) OFFSET_DATA chunk header with the offset (the read is not empty).
    fn read_reply_prefix(&self, header: &RequestHeader) -> Vec<u8> {
        let mut prefix = Vec::with_capacity(EXTENDED_REPLY_HEADER_BYTES + 8);
        if !self.structured_replies {
            put_simple_reply(&mut prefix, 0, header.handle);
        } else {
            self.put_chunk_header(
                &mut prefix,
                REPLY_FLAG_DONE,
                REPLY_TYPE_OFFSET_DATA,
                header,
                8 + header.length,
            );
            prefix.extend_from_slice(&header.offset.to_be_bytes());
        }
        prefix
    }

    /// Appends a reply chunk's header for `header`'s request: extended (the request's offset
    /// echoed, a 64-bit length) or structured, as negotiated.
    fn put_chunk_header(
        &self,
        out: &mut Vec<u8>,
        flags: u16,
        chunk_type: u16,
        header: &RequestHeader,
        payload_length: u64,
    ) {
        if self.extended_headers {
            put_extended_header(
                out,
                flags,
                chunk_type,
                header.handle,
                header.offset,
                payload_length,
            );
        } else {
            put_structured_header(out, flags, chunk_type, header.handle, payload_length as u32);
        }
    }

    /// Serves a READ with one reply written from the export's own memory when it can (a
    /// cache's buffers, held shared for the send), else from a reused buffer it fills. A
    /// client that stops reading cannot hold the export's buffers: after
    /// `REPLY_FROM_EXPORT_HOLD_MAX` the rest of the reply is copied and sent without them.
    fn execute_read(&self, header: &RequestHeader) {
        let length = header.length as usize;
        if self.structured_replies && length == 0 {
            // A data chunk must carry at least one byte; an empty read is just "done" (a
            // chunk: a READ never gets a simple reply once structured replies are on).
            let mut done = Vec::with_capacity(EXTENDED_REPLY_HEADER_BYTES);
            self.put_chunk_header(&mut done, REPLY_FLAG_DONE, REPLY_TYPE_NONE, header, 0);
            self.send_parts(&[&done]);
            return;
        }
        let holes = self.known_zeroes(header);
        if !holes.is_empty() {
            self.execute_read_with_holes(header, &holes);
            return;
        }
        let prefix = self.read_reply_prefix(header);
        // A reused buffer, for when the export cannot lend its own memory; nothing in it
        // needs zero-filling (the export overwrites what is sent).
        let mut buffer = self.budget.buffers().take(length);
        let mut reply = ReplyInProgress::default();
        let result = self
            .export
            .read_with(header.offset, &mut buffer[..length], &mut |data| {
                self.send_reply_bounded(&prefix, data, &mut reply)
            });
        self.budget.buffers().give_back(buffer);
        match (result, reply.started) {
            (Ok(()), _) => self.finish_reply(reply),
            (Err(error), false) => self.send_io_error(header, &error),
            (Err(error), true) => {
                // The reply itself failed part-way: the stream cannot be resynchronised.
                self.reply_failed(None, &error);
                self.break_connection();
            }
        }
    }

    /// The parts of a READ's range the export knows read as zeroes, when its reply may say
    /// so: structured replies and no DF (which asks for a single data chunk).
    fn known_zeroes(&self, header: &RequestHeader) -> Vec<(u64, u64)> {
        if !self.structured_replies || header.flags & CMD_FLAG_DF != 0 {
            return Vec::new();
        }
        self.export.known_zeroes(header.offset, header.length)
    }

    /// Serves a structured READ part of which the export knows reads as zeroes: those parts
    /// as OFFSET_HOLE chunks (the client skips them without a byte of data), the rest read and
    /// sent as OFFSET_DATA chunks, the last chunk final. Everything is read before anything is
    /// sent, so a failure is one error reply.
    fn execute_read_with_holes(&self, header: &RequestHeader, holes: &[(u64, u64)]) {
        let end = header.offset + header.length;
        // (start, length, is a hole), in order, covering the request.
        let mut segments: Vec<(u64, u64, bool)> = Vec::with_capacity(2 * holes.len() + 1);
        let mut position = header.offset;
        for &(start, length) in holes {
            if start < position || length == 0 || start + length > end {
                continue;
            }
            if start > position {
                segments.push((position, start - position, false));
            }
            segments.push((start, length, true));
            position = start + length;
        }
        if position < end {
            segments.push((position, end - position, false));
        }
        let data_bytes: u64 = segments
            .iter()
            .filter(|segment| !segment.2)
            .map(|segment| segment.1)
            .sum();
        let mut buffer = self.budget.buffers().take(data_bytes as usize);
        let mut at = 0usize;
        for &(start, length, _) in segments.iter().filter(|segment| !segment.2) {
            let piece = &mut buffer[at..at + length as usize];
            if let Err(error) = self.export.read(start, piece) {
                self.budget.buffers().give_back(buffer);
                return self.send_io_error(header, &error);
            }
            at += length as usize;
        }
        let mut headers: Vec<Vec<u8>> = Vec::with_capacity(segments.len());
        for (index, &(start, length, hole)) in segments.iter().enumerate() {
            let flags = if index + 1 == segments.len() {
                REPLY_FLAG_DONE
            } else {
                0
            };
            let mut chunk = Vec::with_capacity(EXTENDED_REPLY_HEADER_BYTES + 12);
            if hole {
                self.put_chunk_header(&mut chunk, flags, REPLY_TYPE_OFFSET_HOLE, header, 12);
                chunk.extend_from_slice(&start.to_be_bytes());
                chunk.extend_from_slice(&(length as u32).to_be_bytes());
            } else {
                self.put_chunk_header(
                    &mut chunk,
                    flags,
                    REPLY_TYPE_OFFSET_DATA,
                    header,
                    8 + length,
                );
                chunk.extend_from_slice(&start.to_be_bytes());
            }
            headers.push(chunk);
        }
        let mut parts: Vec<&[u8]> = Vec::with_capacity(2 * segments.len());
        let mut at = 0usize;
        for (chunk, &(_, length, hole)) in headers.iter().zip(&segments) {
            parts.push(chunk);
            if !hole {
                parts.push(&buffer[at..at + length as usize]);
                at += length as usize;
            }
        }
        self.send_parts(&parts);
        self.budget.buffers().give_back(buffer);
    }

    /// Sends a reply's prefix and data under the writer lock, waiting for the lock and the
    /// socket together at most `REPLY_FROM_EXPORT_HOLD_MAX`; whatever is left is copied into
    /// `reply`, and [`Connection::finish_reply`] sends it once the export's buffers are let
    /// go (with the writer lock this kept, or the lock taken then), so replies never
    /// interleave. The lock is waited for with a bound too: its holder may be blocked on a
    /// client that stopped reading (a reply's rest, a reply thread's tail).
    fn send_reply_bounded<'a>(
        &'a self,
        prefix: &[u8],
        data: &[io::IoSlice<'_>],
        reply: &mut ReplyInProgress<'a>,
    ) -> io::Result<()> {
        /// Longest time a reply may keep the export's buffers (writers of those blocks wait).
        const REPLY_FROM_EXPORT_HOLD_MAX: Duration = Duration::from_millis(20);
        reply.started = true;
        let deadline = std::time::Instant::now() + REPLY_FROM_EXPORT_HOLD_MAX;
        let Some(mut writer) = self.writer.lock_until(deadline) else {
            let mut parts = vec![io::IoSlice::new(prefix)];
            parts.extend(data.iter().map(|slice| io::IoSlice::new(slice)));
            reply.rest = Some((None, unsent(&parts, 0)));
            return Ok(());
        };
        if self.broken.load(Ordering::Acquire) {
            return Err(io::ErrorKind::BrokenPipe.into());
        }
        // A tail a reply thread left goes first, within the same bounded send: waiting for
        // it without a bound would let a client that stops reading hold the export's buffers.
        let tail = std::mem::take(&mut writer.tail);
        let mut parts = Vec::with_capacity(data.len() + 2);
        parts.push(io::IoSlice::new(&tail));
        parts.push(io::IoSlice::new(prefix));
        parts.extend(data.iter().map(|slice| io::IoSlice::new(slice)));
        let sent = match send_vectored_until(&writer.stream, &parts, deadline) {
            Ok(sent) => sent,
            Err(error) => {
                drop(writer);
                self.break_connection();
                return Err(error);
            }
        };
        let rest = unsent(&parts, sent);
        if !rest.is_empty() {
            reply.rest = Some((Some(writer), rest));
        }
        Ok(())
    }

    /// Sends the part of a reply the bounded send left: with the writer lock it kept, or
    /// (when it could not have the lock in time) with the lock taken now.
    fn finish_reply(&self, reply: ReplyInProgress<'_>) {
        let Some((writer, rest)) = reply.rest else {
            return;
        };
        let mut writer = match writer {
            Some(writer) => writer,
            None => match self.lock_writer() {
                Ok(writer) => writer,
                Err(_) => return,
            },
        };
        if let Err(error) = write_all_vectored(&mut writer.stream, &[&rest]) {
            self.reply_failed(Some(&writer.stream), &error);
            drop(writer);
            self.break_connection();
        }
    }

    /// Logs why a reply could not be written (the connection closes): a warning when the
    /// client left a reply unread for the stall timeout (it held its share of the budget
    /// without progress), else at debug level (the client is simply gone). A stalled
    /// client's socket (`stream`) is closed abortively: what is queued for it is dropped.
    fn reply_failed(&self, stream: Option<&Stream>, error: &io::Error) {
        if is_timeout(error) {
            if let Some(stream) = stream {
                stream.abort_on_close();
            }
            tracing::warn!(
                stall_timeout = ?self.limits.stall_timeout,
                "closing the connection: the client did not read a reply for the stall timeout"
            );
        } else {
            tracing::debug!("reply could not be written, closing the connection: {error}");
        }
    }

    /// Marks the connection broken and shuts the socket, so the reader stops too.
    fn break_connection(&self) {
        let writer = self.writer.lock();
        self.broken.store(true, Ordering::Release);
        writer.stream.shutdown_both();
    }

    fn send_io_error(&self, header: &RequestHeader, error: &io::Error) {
        let refusal = refuse(Errno::from_io_error(error), error.to_string());
        // The first failure of a connection is a warning (a full or failing backend must be
        // visible at the default log level); the rest would flood the log.
        if !self.failure_logged.swap(true, Ordering::AcqRel) {
            tracing::warn!(
                command = %command_name(header.command),
                offset = header.offset,
                length = header.length,
                errno = %refusal.errno,
                "request failed (later failures of this connection are logged at debug level): {error}"
            );
        } else {
            tracing::debug!(
                command = %command_name(header.command),
                offset = header.offset,
                length = header.length,
                errno = %refusal.errno,
                "request failed: {error}"
            );
        }
        self.send_error(header, &refusal);
    }

    /// Sends an error reply: a structured error chunk (with the message) when structured
    /// replies were negotiated, else a simple reply with the errno.
    fn send_error(&self, header: &RequestHeader, refusal: &Refusal) {
        if !self.structured_replies {
            self.send_simple(header.handle, refusal.errno.code());
            return;
        }
        let message = truncate_utf8(&refusal.message, STRING_BYTES_MAX);
        let payload_length = 6 + message.len() as u64;
        let mut chunk = Vec::with_capacity(EXTENDED_REPLY_HEADER_BYTES + payload_length as usize);
        self.put_chunk_header(
            &mut chunk,
            REPLY_FLAG_DONE,
            REPLY_TYPE_ERROR,
            header,
            payload_length,
        );
        chunk.extend_from_slice(&refusal.errno.code().to_be_bytes());
        chunk.extend_from_slice(&(message.len() as u16).to_be_bytes());
        chunk.extend_from_slice(message.as_bytes());
        self.send_parts(&[&chunk]);
    }

    /// Answers a request that succeeded without data: a simple reply, or with extended
    /// headers (which have no simple replies) a final NONE chunk.
    fn send_ok(&self, header: &RequestHeader) {
        if !self.extended_headers {
            self.send_simple(header.handle, 0);
            return;
        }
        let mut done = Vec::with_capacity(EXTENDED_REPLY_HEADER_BYTES);
        self.put_chunk_header(&mut done, REPLY_FLAG_DONE, REPLY_TYPE_NONE, header, 0);
        self.send_parts(&[&done]);
    }

    fn send_simple(&self, handle: u64, error: u32) {
        let mut reply = Vec::with_capacity(SIMPLE_REPLY_HEADER_BYTES);
        put_simple_reply(&mut reply, error, handle);
        self.send_parts(&[&reply]);
    }

    /// Writes one whole reply under the writer lock. A failed write means the client is gone:
    /// the socket is shut so the reader stops too.
    fn send_parts(&self, parts: &[&[u8]]) {
        let Ok(mut writer) = self.lock_writer() else {
            return;
        };
        if let Err(error) = write_all_vectored(&mut writer.stream, parts) {
            self.reply_failed(Some(&writer.stream), &error);
            self.broken.store(true, Ordering::Release);
            writer.stream.shutdown_both();
        }
    }
}

/// The bytes of `parts` after the first `sent`, copied.
fn unsent(parts: &[io::IoSlice<'_>], sent: usize) -> Vec<u8> {
    let total: usize = parts.iter().map(|part| part.len()).sum();
    let mut rest = Vec::with_capacity(total.saturating_sub(sent));
    let mut skip = sent;
    for part in parts {
        if skip >= part.len() {
            skip -= part.len();
            continue;
        }
        rest.extend_from_slice(&part[skip..]);
        skip = 0;
    }
    rest
}

/// How one status chunk is sent: for which context, whether it holds one descriptor
/// (REQ_ONE), whether it is the reply's last, and in which form.
#[derive(Clone, Copy)]
struct StatusChunk {
    context_id: u32,
    req_one: bool,
    done: bool,
    /// BLOCK_STATUS_EXT in an extended header (64-bit lengths and status) instead of
    /// BLOCK_STATUS in a structured one.
    extended: bool,
}

/// Most descriptors one status chunk carries (the spec's SHOULD); the client asks again from
/// where the reply stops.
const STATUS_DESCRIPTORS_MAX: usize = 1 << 20;

/// Appends one status chunk to `reply`: `descriptors` (length, status flags) cut to the
/// request's length (REQ_ONE: the first only), each within 32 bits in the compact form.
fn put_status_chunk(
    reply: &mut Vec<u8>,
    header: &RequestHeader,
    descriptors: &[(u64, u32)],
    form: StatusChunk,
) -> io::Result<()> {
    let descriptor_bytes = if form.extended { 16 } else { 8 };
    let mut encoded = Vec::with_capacity(descriptor_bytes * descriptors.len().min(1024));
    let mut left = header.length;
    let mut count = 0u32;
    for &(length, flags) in descriptors.iter().take(STATUS_DESCRIPTORS_MAX) {
        let length = length.min(left);
        if length == 0 {
            break;
        }
        if form.extended {
            encoded.extend_from_slice(&length.to_be_bytes());
            encoded.extend_from_slice(&u64::from(flags).to_be_bytes());
        } else {
            // A compact request's length fits in 32 bits, so this cut never shortens it.
            encoded.extend_from_slice(&(length.min(u64::from(u32::MAX)) as u32).to_be_bytes());
            encoded.extend_from_slice(&flags.to_be_bytes());
        }
        left -= length;
        count += 1;
        if form.req_one {
            break;
        }
    }
    if encoded.is_empty() {
        return Err(io::Error::other("the export reported no extents"));
    }
    let flags = if form.done { REPLY_FLAG_DONE } else { 0 };
    if form.extended {
        let payload_length = 8 + encoded.len() as u64;
        put_extended_header(
            reply,
            flags,
            REPLY_TYPE_BLOCK_STATUS_EXT,
            header.handle,
            header.offset,
            payload_length,
        );
        reply.extend_from_slice(&form.context_id.to_be_bytes());
        reply.extend_from_slice(&count.to_be_bytes());
    } else {
        let payload_length = 4 + encoded.len() as u32;
        put_structured_header(
            reply,
            flags,
            REPLY_TYPE_BLOCK_STATUS,
            header.handle,
            payload_length,
        );
        reply.extend_from_slice(&form.context_id.to_be_bytes());
    }
    reply.extend_from_slice(&encoded);
    Ok(())
}

/// The longest prefix of `text` that fits in `bytes_max` bytes without splitting a character.
fn truncate_utf8(text: &str, bytes_max: usize) -> &str {
    if text.len() <= bytes_max {
        return text;
    }
    let mut end = bytes_max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// Bytes in flight on one connection, with a wait for "below the limit", and since when the
/// connection has been idle (for eviction of the longest-idle connection).
pub(crate) struct InflightBudget {
    state: Mutex<InflightState>,
    drained: Condvar,
}

struct InflightState {
    bytes: u64,
    /// When the last request in flight ended (or the connection began).
    active: std::time::Instant,
}

impl Default for InflightBudget {
    fn default() -> Self {
        InflightBudget {
            state: Mutex::new(InflightState {
                bytes: 0,
                active: std::time::Instant::now(),
            }),
            drained: Condvar::new(),
        }
    }
}

impl InflightBudget {
    /// Adds a request's cost; true when nothing else was in flight.
    fn charge(&self, cost_bytes: u64) -> bool {
        let mut state = self.state.lock();
        let was_idle = state.bytes == 0;
        state.bytes += cost_bytes;
        was_idle
    }

    fn release(&self, cost_bytes: u64) {
        let mut state = self.state.lock();
        bufcache_device::strict_assert!(state.bytes >= cost_bytes, "released more than charged");
        state.bytes -= cost_bytes;
        if state.bytes == 0 {
            state.active = std::time::Instant::now();
        }
        self.drained.notify_all();
    }

    fn is_idle(&self) -> bool {
        self.state.lock().bytes == 0
    }

    /// When the connection became idle: `None` while it has a request in flight.
    pub(crate) fn idle_since(&self) -> Option<std::time::Instant> {
        let state = self.state.lock();
        (state.bytes == 0).then_some(state.active)
    }

    /// Blocks while more than `limit_bytes` are in flight. A single request larger than the
    /// limit still goes through once the connection is idle, so nothing can deadlock.
    fn wait_below(&self, limit_bytes: u64) {
        let mut state = self.state.lock();
        while state.bytes >= limit_bytes {
            self.drained.wait(&mut state);
        }
    }
}

/// The bytes of requests in flight on all connections of a server, bounded by one limit.
///
/// Reservations are granted strictly in arrival order, so a large request is not starved by
/// a stream of small ones. A request larger than the whole budget is granted once nothing
/// else is reserved, so nothing can wait forever. Reservations are released when the reply
/// has been written, and every reservation belongs to a request that is being read or
/// served (never one waiting for the budget), so the budget always drains.
///
/// The last quarter of the limit, the headroom, is kept for small requests of connections
/// with nothing else in flight (a prompt client at queue depth one): requests in arrival
/// order are granted only up to `limit - headroom`, while a small request of an idle
/// connection is granted at once whenever it fits in the whole limit. Each connection has
/// at most one such request and each costs at most `headroom / connections_max`, so they
/// always fit: requests that stall (until the stall timeout closes their connections) can
/// delay large requests, never a prompt client's small one.
pub(crate) struct ServerBudget {
    limit_bytes: u64,
    headroom_bytes: u64,
    /// The largest cost that may use the headroom.
    headroom_cost_bytes_max: u64,
    state: Mutex<BudgetState>,
    changed: Condvar,
    /// Payload and reply buffers of finished requests, kept for the next ones.
    buffers: BufferRecycler,
}

#[derive(Default)]
struct BudgetState {
    reserved_bytes: u64,
    /// The request whose turn it is costs more than the shared part and waits for an empty
    /// budget: small requests wait behind it instead of using the headroom.
    oversized_waiting: bool,
    /// Tickets whose requests left the queue before their turn; skipped when it comes.
    abandoned_tickets: std::collections::BTreeSet<u64>,
    next_ticket: u64,
    serving_ticket: u64,
}

/// The share of the server budget kept for small requests of idle connections: 1/this.
const HEADROOM_FRACTION: u64 = 4;

/// How often a request waiting in order for the budget asks whether to give up.
const GIVE_UP_CHECK_INTERVAL: Duration = Duration::from_millis(250);

/// A WRITE waiting for the budget whose connection has not even this much of its payload
/// (or all of it, if shorter) buffered after a stall timeout is stalled: a client that is
/// sending fills the socket's receive buffer, which holds more, while it waits.
const PAYLOAD_PROBE_BYTES: usize = 64 << 10;

impl BudgetState {
    /// Passes the turn to the next ticket still waiting.
    fn advance_serving_ticket(&mut self) {
        self.serving_ticket += 1;
        while self.abandoned_tickets.remove(&self.serving_ticket) {
            self.serving_ticket += 1;
        }
    }
}

impl ServerBudget {
    /// A budget of `limit_bytes` for a server of at most `connections_max` serving
    /// connections (which sizes the requests that may use the headroom).
    pub(crate) fn new(limit_bytes: u64, connections_max: usize) -> ServerBudget {
        assert!(
            connections_max > 0,
            "a server serves at least one connection"
        );
        let headroom_bytes = limit_bytes / HEADROOM_FRACTION;
        // At least a 4 KiB request may always use it: with a tiny budget and many
        // connections, small requests may then wait for each other, never for large ones.
        let headroom_cost_bytes_max =
            (headroom_bytes / connections_max as u64).max(4096 + REQUEST_OVERHEAD_BYTES);
        ServerBudget {
            limit_bytes,
            headroom_bytes,
            headroom_cost_bytes_max,
            state: Mutex::new(BudgetState::default()),
            changed: Condvar::new(),
            buffers: BufferRecycler::new((limit_bytes / 4).min(BUFFERS_RETAINED_BYTES_MAX) as usize),
        }
    }

    /// The server's reusable request and reply buffers.
    pub(crate) fn buffers(&self) -> &BufferRecycler {
        &self.buffers
    }

    /// Keeps a finished request's payload buffer for reuse (requests without one have an
    /// empty, unallocated buffer).
    fn give_back_payload(&self, payload: Vec<u8>) {
        if payload.capacity() > 0 {
            self.buffers.give_back(payload);
        }
    }

    /// Waits for room, then reserves `cost_bytes`: at once from the headroom when the
    /// request is small and its connection has nothing else in flight
    /// (`connection_idle`), else in arrival order below the headroom. While it waits in
    /// order, `give_up` is asked now and then how long it has waited; when it says so the
    /// request leaves the queue unreserved (false), so a stalled request does not hold the
    /// line for the requests behind it.
    pub(crate) fn acquire(
        &self,
        cost_bytes: u64,
        connection_idle: bool,
        give_up: &mut dyn FnMut(Duration) -> bool,
    ) -> bool {
        let mut state = self.state.lock();
        if connection_idle && cost_bytes <= self.headroom_cost_bytes_max {
            // Fits at once unless a single request larger than everything but the headroom
            // was granted alone, or waits to be (a budget barely above one request): then
            // it waits too, so that request is not starved. Like any request, one larger
            // than the whole budget is granted once nothing else is reserved.
            while state.oversized_waiting
                || (state.reserved_bytes != 0
                    && state.reserved_bytes + cost_bytes > self.limit_bytes)
            {
                self.changed.wait(&mut state);
            }
            state.reserved_bytes += cost_bytes;
            return true;
        }
        let shared_limit_bytes = self.limit_bytes - self.headroom_bytes;
        let ticket = state.next_ticket;
        state.next_ticket += 1;
        let started = std::time::Instant::now();
        let mut next_check = started + GIVE_UP_CHECK_INTERVAL;
        while ticket != state.serving_ticket
            || (state.reserved_bytes != 0 && state.reserved_bytes + cost_bytes > shared_limit_bytes)
        {
            if ticket == state.serving_ticket && cost_bytes > shared_limit_bytes {
                state.oversized_waiting = true;
            }
            // Woken by every release, so the check is by the clock, not by a timed-out wait.
            self.changed.wait_until(&mut state, next_check);
            let now = std::time::Instant::now();
            if now < next_check {
                continue;
            }
            next_check = now + GIVE_UP_CHECK_INTERVAL;
            if give_up(now - started) {
                if ticket == state.serving_ticket {
                    state.oversized_waiting = false;
                    state.advance_serving_ticket();
                } else {
                    state.abandoned_tickets.insert(ticket);
                }
                self.changed.notify_all();
                return false;
            }
        }
        state.oversized_waiting = false;
        state.reserved_bytes += cost_bytes;
        state.advance_serving_ticket();
        // The next ticket holder may fit too.
        self.changed.notify_all();
        true
    }

    pub(crate) fn release(&self, cost_bytes: u64) {
        let mut state = self.state.lock();
        bufcache_device::strict_assert!(
            state.reserved_bytes >= cost_bytes,
            "released more than reserved"
        );
        state.reserved_bytes -= cost_bytes;
        self.changed.notify_all();
    }

    #[cfg(test)]
    fn reserved_bytes(&self) -> u64 {
        self.state.lock().reserved_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Goal: the server-wide budget never grants more than its limit, grants in arrival order,
    /// and still grants a request larger than the limit once nothing else is reserved.
    /// Method: reserve most of a 100-byte budget, start a waiter for 60 bytes, check it stays
    /// blocked until the release, then an oversized 500-byte request on an empty budget.
    #[test]
    fn server_budget_blocks_until_released_and_never_deadlocks_on_large_requests() {
        let budget = Arc::new(ServerBudget::new(100, 1));
        budget.acquire(70, false, &mut |_| false);
        let granted = Arc::new(AtomicBool::new(false));
        let waiter = {
            let budget = Arc::clone(&budget);
            let granted = Arc::clone(&granted);
            std::thread::spawn(move || {
                budget.acquire(60, false, &mut |_| false);
                granted.store(true, Ordering::Release);
            })
        };
        std::thread::sleep(Duration::from_millis(100));
        assert!(!granted.load(Ordering::Acquire), "granted past the limit");
        assert_eq!(budget.reserved_bytes(), 70);
        budget.release(70);
        waiter.join().unwrap();
        assert_eq!(budget.reserved_bytes(), 60);
        budget.release(60);
        budget.acquire(500, false, &mut |_| false);
        assert_eq!(budget.reserved_bytes(), 500);
        budget.release(500);
    }

    /// Goal: requests that hold the shared part of the budget (stalled ones, until the stall
    /// timeout) never keep a small request of an idle connection waiting, and the headroom
    /// it uses is bounded. Method: a 1 MiB budget for 4 connections (256 KiB headroom, 64 KiB
    /// per small request); 700 KiB taken in order, a 100 KiB request then waits (over the
    /// 768 KiB shared part) while four 64 KiB requests of idle connections are granted at
    /// once, past it.
    #[test]
    fn small_requests_of_idle_connections_use_the_headroom_past_stalled_ones() {
        let budget = Arc::new(ServerBudget::new(1 << 20, 4));
        budget.acquire(700 << 10, false, &mut |_| false);
        let waiting = {
            let budget = Arc::clone(&budget);
            std::thread::spawn(move || budget.acquire(100 << 10, false, &mut |_| false))
        };
        while budget.state.lock().next_ticket < 2 {
            std::thread::yield_now();
        }
        for _ in 0..4 {
            budget.acquire(64 << 10, true, &mut |_| false);
        }
        assert_eq!(budget.reserved_bytes(), (700 + 4 * 64) << 10);
        assert!(
            !waiting.is_finished(),
            "the large one waits below the headroom"
        );
        budget.release(700 << 10);
        assert!(waiting.join().unwrap());
        for _ in 0..4 {
            budget.release(64 << 10);
        }
        budget.release(100 << 10);
        assert_eq!(budget.reserved_bytes(), 0);
    }

    #[test]
    fn status_chunks_clamp_to_the_request_and_honour_req_one() {
        let header = RequestHeader {
            flags: 0,
            command: CMD_BLOCK_STATUS,
            handle: 7,
            offset: 0,
            length: 1000,
        };
        let descriptors = [(600, STATE_HOLE | STATE_ZERO), (600, 0)];
        let form = StatusChunk {
            context_id: 1,
            req_one: false,
            done: true,
            extended: false,
        };
        let mut chunk = Vec::new();
        put_status_chunk(&mut chunk, &header, &descriptors, form).unwrap();
        assert_eq!(be_u16(&chunk[4..6]), REPLY_FLAG_DONE);
        let payload = &chunk[STRUCTURED_REPLY_HEADER_BYTES + 4..];
        assert_eq!(be_u32(&payload[0..4]), 600);
        assert_eq!(be_u32(&payload[4..8]), STATE_HOLE | STATE_ZERO);
        assert_eq!(be_u32(&payload[8..12]), 400);
        assert_eq!(payload.len(), 16);
        let mut one = Vec::new();
        let form = StatusChunk {
            context_id: 2,
            req_one: true,
            done: false,
            ..form
        };
        put_status_chunk(&mut one, &header, &descriptors, form).unwrap();
        assert_eq!(one.len(), STRUCTURED_REPLY_HEADER_BYTES + 4 + 8);
        assert_eq!(be_u16(&one[4..6]), 0, "not the last chunk");
        assert_eq!(be_u32(&one[STRUCTURED_REPLY_HEADER_BYTES..]), 2);
    }

    #[test]
    fn extended_status_chunks_carry_64_bit_lengths_and_a_count() {
        let header = RequestHeader {
            flags: 0,
            command: CMD_BLOCK_STATUS,
            handle: 7,
            offset: 1 << 32,
            length: 6 << 30,
        };
        let descriptors = [(5 << 30, STATE_HOLE), (4 << 30, 0)];
        let form = StatusChunk {
            context_id: 1,
            req_one: false,
            done: true,
            extended: true,
        };
        let mut chunk = Vec::new();
        put_status_chunk(&mut chunk, &header, &descriptors, form).unwrap();
        assert_eq!(be_u32(&chunk), EXTENDED_REPLY_MAGIC);
        assert_eq!(be_u16(&chunk[6..8]), REPLY_TYPE_BLOCK_STATUS_EXT);
        assert_eq!(
            be_u64(&chunk[16..24]),
            1 << 32,
            "the request's offset is echoed"
        );
        assert_eq!(be_u64(&chunk[24..32]), 8 + 2 * 16);
        let payload = &chunk[EXTENDED_REPLY_HEADER_BYTES..];
        assert_eq!((be_u32(payload), be_u32(&payload[4..])), (1, 2));
        assert_eq!(be_u64(&payload[8..]), 5 << 30);
        assert_eq!(be_u64(&payload[16..]), u64::from(STATE_HOLE));
        assert_eq!(be_u64(&payload[24..]), 1 << 30, "cut to the request");
    }

    #[test]
    fn utf8_truncation_keeps_whole_characters() {
        assert_eq!(truncate_utf8("héllo", 2), "h");
        assert_eq!(truncate_utf8("abc", 10), "abc");
    }
}
