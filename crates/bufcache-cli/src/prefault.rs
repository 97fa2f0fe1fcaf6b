//! When `serve` faults the cache's buffer memory in (`--prefault`), and the thread that does it
//! while serving.
//!
//! A cache's first fill otherwise pays the kernel for each fresh page (zeroing and charging it)
//! on the data path: a copy through a fresh server ran at 0.6–0.8 of `nbdkit file`'s
//! throughput that way, and at 1.0–1.2 with the memory faulted in first. Faulting it in before
//! serving delays the start (about 0.5 s per GiB per core); faulting it in on a background
//! thread uses the time a new server waits for its first clients instead, and yields the CPU to
//! requests when they come.

use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bufcache::device::aligned::POOL_CHUNK_BYTES;
use bufcache::{format_size, Cache, Populate};

/// When the cache's memory is faulted in (`--prefault=WHEN`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PrefaultWhen {
    /// Up to `BEFORE_SERVING_BYTES_MAX` before accepting clients, the rest in the background
    /// (the default).
    Auto,
    /// On low-priority threads while serving, from the start.
    Background,
    /// Before accepting clients, on every core (what `--prefault` alone means).
    Startup,
    /// Never: pages are faulted in as data first arrives.
    Off,
}

/// What the default (`auto`) faults in before accepting clients: a copy that starts the
/// moment the server listens then never outruns the background threads (measured: a
/// 256 MiB copy started at once ran at 0.86–1.04 of `nbdkit file` with all of it in the
/// background, 0.89–1.07 with it faulted in first), while a large cache delays the start
/// by at most this much (about 0.25 s on two cores).
pub const BEFORE_SERVING_BYTES_MAX: u64 = 1 << 30;

/// The background thread's nice value: it yields to request threads (nice 0) but is not
/// starved as a `SCHED_IDLE` thread can be, so a lock it holds for a moment (the pool's spare
/// list) is never held for long.
const BACKGROUND_NICE: libc::c_int = 10;

/// The share of the memory the system says is available (`MemAvailable`) that prefaulting
/// may take; the rest stays with the kernel, other processes and request buffers.
const AVAILABLE_MEMORY_SHARE_PERCENT: u64 = 90;

/// How much to fault in ahead of need: `wanted` (the smaller of the cache size and the
/// exports' total size), but no more than `AVAILABLE_MEMORY_SHARE_PERCENT` of the memory the
/// system has available, so a cache sized beyond the machine is not pushed into swap or the
/// OOM killer at startup. What is left out is faulted in as data arrives; the server says so.
pub fn bytes_to_prefault(wanted: u64) -> u64 {
    let Some(available) = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| mem_available_bytes(&text))
    else {
        return wanted;
    };
    // Whole chunks: the unit prefaulting maps.
    let chunk = POOL_CHUNK_BYTES as u64;
    let cap = available / 100 * AVAILABLE_MEMORY_SHARE_PERCENT / chunk * chunk;
    if wanted <= cap {
        return wanted;
    }
    let gib = |bytes: u64| bytes as f64 / f64::from(1u32 << 30);
    let _ = writeln!(
        std::io::stderr(),
        "bufcache: prefaulting {:.1} GiB of the {:.1} GiB the cache could use: the system has \
         {:.1} GiB available (MemAvailable); the rest is faulted in as data arrives",
        gib(cap),
        gib(wanted),
        gib(available)
    );
    cap
}

/// `MemAvailable` from the text of `/proc/meminfo`, in bytes.
fn mem_available_bytes(meminfo: &str) -> Option<u64> {
    let kib = meminfo
        .lines()
        .find_map(|line| line.strip_prefix("MemAvailable:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse::<u64>()
        .ok()?;
    kib.checked_mul(1024)
}

/// Faults buffer memory in on every core until the cache holds `bytes_max` or its memory
/// limit, before the server accepts anyone.
pub fn before_serving(cache: &Cache, bytes_max: u64) {
    let started = Instant::now();
    let threads = std::thread::available_parallelism().map_or(1, |count| count.get());
    let chunks: u64 = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    let mut chunks = 0;
                    while cache.prefault(bytes_max, Populate::Advise) {
                        chunks += 1;
                    }
                    chunks
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|worker| worker.join().unwrap_or(0))
            .sum()
    });
    report(chunks, started, "before serving");
}

/// The threads faulting memory in while the server runs.
pub struct Background {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<u64>>,
}

impl Background {
    /// Starts faulting memory in, a 2 MiB chunk at a time on one thread per core, until the
    /// cache holds `bytes_max` or its memory limit, or [`Background::stop`] is called. The
    /// last thread to finish says how much was faulted in.
    pub fn start(cache: Cache, bytes_max: u64) -> std::io::Result<Background> {
        let stop = Arc::new(AtomicBool::new(false));
        let count = std::thread::available_parallelism().map_or(1, |count| count.get());
        let running = Arc::new(AtomicUsize::new(count));
        let total_chunks = Arc::new(AtomicU64::new(0));
        let started = Instant::now();
        let mut threads = Vec::with_capacity(count);
        for _ in 0..count {
            let cache = cache.clone();
            let stopping = Arc::clone(&stop);
            let running = Arc::clone(&running);
            let total_chunks = Arc::clone(&total_chunks);
            let thread = std::thread::Builder::new()
                .name("bufcache-prefault".into())
                .spawn(move || {
                    lower_priority();
                    let mut chunks = 0;
                    // Touching pages rather than one madvise call per chunk: this thread may
                    // be preempted anywhere, and must not hold the address-space lock then.
                    while !stopping.load(Ordering::Acquire)
                        && cache.prefault(bytes_max, Populate::Touch)
                    {
                        chunks += 1;
                    }
                    total_chunks.fetch_add(chunks, Ordering::AcqRel);
                    if running.fetch_sub(1, Ordering::AcqRel) == 1 {
                        let how = if stopping.load(Ordering::Acquire) {
                            "in the background (stopped at shutdown)"
                        } else {
                            "in the background"
                        };
                        report(total_chunks.load(Ordering::Acquire), started, how);
                    }
                    chunks
                });
            match thread {
                Ok(thread) => threads.push(thread),
                Err(error) => {
                    stop.store(true, Ordering::Release);
                    return Err(error);
                }
            }
        }
        Ok(Background { stop, threads })
    }

    /// Stops after the chunks in progress and waits for the threads.
    pub fn stop(self) {
        self.stop.store(true, Ordering::Release);
        for thread in self.threads {
            let _ = thread.join();
        }
    }
}

/// Gives the calling thread a lower CPU priority than request threads.
fn lower_priority() {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: gettid has no preconditions; on Linux, PRIO_PROCESS with a thread id sets
        // that one thread's nice value. Failure leaves the priority as it was, which only
        // costs requests some CPU while the thread runs.
        let result = unsafe {
            libc::setpriority(
                libc::PRIO_PROCESS,
                libc::gettid() as libc::id_t,
                BACKGROUND_NICE,
            )
        };
        if result != 0 {
            tracing::debug!(
                error = %std::io::Error::last_os_error(),
                "cannot lower the prefault thread's priority"
            );
        }
    }
}

/// Says how much was faulted in: `chunks` of `POOL_CHUNK_BYTES`.
fn report(chunks: u64, started: Instant, how: &str) {
    if chunks == 0 {
        return;
    }
    let bytes = chunks * POOL_CHUNK_BYTES as u64;
    let seconds = started.elapsed().as_secs_f64();
    tracing::info!(bytes, seconds, how, "memory prefaulted");
    let _ = writeln!(
        std::io::stderr(),
        "bufcache: prefaulted {} of buffer memory in {seconds:.2} s {how}",
        format_size(bytes)
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_available_is_read_from_meminfo_in_bytes() {
        // Goal: the prefault cap reads the kernel's figure right, and an unreadable one means
        // no cap rather than a wrong one. Method: parse meminfo texts.
        let text = "MemTotal:       24565432 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(mem_available_bytes(text), Some(20_000_000 * 1024));
        assert_eq!(mem_available_bytes("MemTotal: 5 kB\n"), None);
        assert_eq!(mem_available_bytes("MemAvailable: lots\n"), None);
    }

    #[test]
    fn a_prefault_within_available_memory_is_not_capped() {
        // Goal: a small cache is prefaulted whole. Method: 1 MiB is below any machine's
        // available memory; a cap of it would be the bug.
        assert_eq!(bytes_to_prefault(1 << 20), 1 << 20);
    }
}
