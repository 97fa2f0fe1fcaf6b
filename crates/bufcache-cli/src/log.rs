//! Log output that serving never waits for.
//!
//! Every line for standard error (tracing events and the server's own messages) is queued,
//! at most [`LOG_LINES_QUEUED_MAX`] at a time, and written by one thread of its own. Producers
//! never block and never fail: when the queue is full, or standard error is a closed pipe, a
//! full disk or any other failing file, the line is dropped and counted
//! ([`lines_dropped_total`], exported as `bufcache_log_lines_dropped_total`). A reader that
//! stops reading can stall only the log thread; requests, signals and shutdown go on. Repeated
//! warnings and errors from one place in the code are rate-limited ([`EVENTS_PER_WINDOW_MAX`] per
//! [`RATE_WINDOW`]), with a count of what was held back.
//!
//! The log thread writes with `write(2)` on descriptor 2 itself, not through `std::io::stderr`,
//! so a write stuck in a full pipe holds no lock another thread could need.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, SyncSender, TrySendError};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Most lines waiting for the log thread; beyond it lines are dropped.
pub const LOG_LINES_QUEUED_MAX: usize = 1024;
/// Most events one call site logs per [`RATE_WINDOW`]; later ones in the window are counted
/// and summarised in one line.
pub const EVENTS_PER_WINDOW_MAX: u32 = 10;
/// The rate limit's window.
pub const RATE_WINDOW: Duration = Duration::from_secs(10);
/// Most call sites the rate limiter tracks (call sites are static, so this is a safety bound).
const CALLSITES_MAX: usize = 4096;

struct Sink {
    sender: SyncSender<Vec<u8>>,
    /// Lines queued and not yet written (or dropped) by the log thread.
    pending: Mutex<usize>,
    written: Condvar,
}

static SINK: OnceLock<Sink> = OnceLock::new();
static LINES_DROPPED: AtomicU64 = AtomicU64::new(0);
static EVENTS_SUPPRESSED: AtomicU64 = AtomicU64::new(0);
static QUEUED: AtomicUsize = AtomicUsize::new(0);

/// Starts the log thread. Until it runs (or if it cannot start), lines are dropped and counted.
fn sink() -> Option<&'static Sink> {
    if let Some(sink) = SINK.get() {
        return Some(sink);
    }
    let (sender, receiver) = mpsc::sync_channel::<Vec<u8>>(LOG_LINES_QUEUED_MAX);
    let sink = Sink {
        sender,
        pending: Mutex::new(0),
        written: Condvar::new(),
    };
    if SINK.set(sink).is_err() {
        // Another thread started it first; its receiver is the one in use.
        return SINK.get();
    }
    let started = std::thread::Builder::new()
        .name("bufcache-log".into())
        .spawn(move || {
            let sink = SINK
                .get()
                .expect("the sink is set before its thread starts");
            for line in receiver {
                if write_all_stderr(&line).is_err() {
                    LINES_DROPPED.fetch_add(1, Ordering::Relaxed);
                }
                QUEUED.fetch_sub(1, Ordering::Relaxed);
                let mut pending = sink.pending.lock().unwrap_or_else(|e| e.into_inner());
                *pending = pending.saturating_sub(1);
                sink.written.notify_all();
            }
        });
    if started.is_err() {
        return None;
    }
    SINK.get()
}

fn write_all_stderr(mut bytes: &[u8]) -> io::Result<()> {
    while !bytes.is_empty() {
        // SAFETY: writes from a valid buffer of the given length to descriptor 2.
        let written = unsafe { libc::write(2, bytes.as_ptr().cast(), bytes.len()) };
        if written < 0 {
            let error = io::Error::last_os_error();
            if error.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(error);
        }
        if written == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        bytes = &bytes[written as usize..];
    }
    Ok(())
}

/// Queues raw bytes (one or more whole lines) for standard error; never blocks.
fn enqueue(bytes: Vec<u8>) {
    let Some(sink) = sink() else {
        LINES_DROPPED.fetch_add(1, Ordering::Relaxed);
        return;
    };
    {
        let mut pending = sink.pending.lock().unwrap_or_else(|e| e.into_inner());
        *pending += 1;
    }
    QUEUED.fetch_add(1, Ordering::Relaxed);
    match sink.sender.try_send(bytes) {
        Ok(()) => {}
        Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
            LINES_DROPPED.fetch_add(1, Ordering::Relaxed);
            QUEUED.fetch_sub(1, Ordering::Relaxed);
            let mut pending = sink.pending.lock().unwrap_or_else(|e| e.into_inner());
            *pending = pending.saturating_sub(1);
        }
    }
}

/// Queues `bufcache: TEXT` as one line of standard error; never blocks, never fails.
pub fn line(text: &str) {
    let mut bytes = Vec::with_capacity(text.len() + 11);
    bytes.extend_from_slice(b"bufcache: ");
    bytes.extend_from_slice(text.as_bytes());
    bytes.push(b'\n');
    enqueue(bytes);
}

/// Waits up to `timeout` for every queued line to be written: called before the process ends,
/// so its last words are seen when standard error can take them, and not waited for beyond
/// `timeout` when it cannot.
pub fn flush(timeout: Duration) {
    let Some(sink) = SINK.get() else {
        return;
    };
    let pending = sink.pending.lock().unwrap_or_else(|e| e.into_inner());
    let _ = sink
        .written
        .wait_timeout_while(pending, timeout, |pending| *pending > 0);
}

/// How long the process waits, as it ends, for its last lines to reach standard error.
pub const EXIT_FLUSH_WAIT: Duration = Duration::from_millis(250);

/// Ends the process with `code` after giving the queued lines [`EXIT_FLUSH_WAIT`] to be written.
pub fn exit(code: i32) -> ! {
    flush(EXIT_FLUSH_WAIT);
    std::process::exit(code)
}

/// Lines dropped since start: queue full, or standard error failing.
pub fn lines_dropped_total() -> u64 {
    LINES_DROPPED.load(Ordering::Relaxed)
}

/// Events held back by the rate limit since start.
pub fn events_suppressed_total() -> u64 {
    EVENTS_SUPPRESSED.load(Ordering::Relaxed)
}

/// Lines waiting to be written now.
pub fn lines_queued() -> usize {
    QUEUED.load(Ordering::Relaxed)
}

/// Prints `bufcache: …` on standard error through the queue (see the module documentation).
macro_rules! say {
    ($($argument:tt)*) => {
        $crate::log::line(&format!($($argument)*))
    };
}
pub(crate) use say;

/// One call site's rate-limit window.
struct Window {
    started: Instant,
    events: u32,
    suppressed: u64,
}

static WINDOWS: Mutex<Option<HashMap<usize, Window>>> = Mutex::new(None);

/// Whether an event from call site `key` may be logged now; when a window with suppressed
/// events ends, returns how many were held back too.
fn admit(key: usize, now: Instant) -> (bool, u64) {
    let mut windows = WINDOWS.lock().unwrap_or_else(|e| e.into_inner());
    let windows = windows.get_or_insert_with(HashMap::new);
    if windows.len() >= CALLSITES_MAX && !windows.contains_key(&key) {
        windows.clear();
    }
    let window = windows.entry(key).or_insert(Window {
        started: now,
        events: 0,
        suppressed: 0,
    });
    let mut held_back = 0;
    if now.duration_since(window.started) >= RATE_WINDOW {
        held_back = window.suppressed;
        *window = Window {
            started: now,
            events: 0,
            suppressed: 0,
        };
    }
    if window.events >= EVENTS_PER_WINDOW_MAX {
        window.suppressed += 1;
        EVENTS_SUPPRESSED.fetch_add(1, Ordering::Relaxed);
        return (false, held_back);
    }
    window.events += 1;
    (true, held_back)
}

/// The `tracing` writer: each event is collected whole and queued when the writer is dropped.
/// Writes always succeed, so tracing never reports a write error of its own (it would print it
/// with `eprintln!`, which panics on a broken pipe).
pub struct EventWriter {
    bytes: Vec<u8>,
    admitted: bool,
}

impl io::Write for EventWriter {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        if self.admitted {
            self.bytes.extend_from_slice(bytes);
        }
        Ok(bytes.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for EventWriter {
    fn drop(&mut self) {
        if self.admitted && !self.bytes.is_empty() {
            enqueue(std::mem::take(&mut self.bytes));
        }
    }
}

/// Makes an [`EventWriter`] per event, applying the per-call-site rate limit.
pub struct MakeEventWriter;

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for MakeEventWriter {
    type Writer = EventWriter;

    fn make_writer(&'a self) -> EventWriter {
        EventWriter {
            bytes: Vec::new(),
            admitted: true,
        }
    }

    fn make_writer_for(&'a self, metadata: &tracing::Metadata<'_>) -> EventWriter {
        // Warnings and errors repeat when something keeps failing (every silent client, every
        // retry); the levels asked for with -v are the operator's choice and not limited.
        if *metadata.level() > tracing::Level::WARN {
            return self.make_writer();
        }
        let key = metadata as *const tracing::Metadata<'_> as usize;
        let (admitted, held_back) = admit(key, Instant::now());
        if held_back > 0 {
            line(&format!(
                "{held_back} more events from {} were not logged in the last {} s (rate limit)",
                metadata.module_path().unwrap_or_else(|| metadata.target()),
                RATE_WINDOW.as_secs()
            ));
        }
        EventWriter {
            bytes: Vec::new(),
            admitted,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_call_site_is_limited_per_window_and_the_held_back_count_is_reported() {
        // Goal: a flood from one place cannot fill the log, a different place still logs, and
        // what was held back is reported when the window ends. Method: drive `admit` with a
        // made-up clock.
        let start = Instant::now();
        let admitted = (0..100).filter(|_| admit(1, start).0).count();
        assert_eq!(admitted, EVENTS_PER_WINDOW_MAX as usize);
        assert!(admit(2, start).0, "another call site is not limited");
        let (admitted, held_back) = admit(1, start + RATE_WINDOW);
        assert!(admitted);
        assert_eq!(held_back, 100 - u64::from(EVENTS_PER_WINDOW_MAX));
    }
}
