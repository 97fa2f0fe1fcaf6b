//! When `serve` faults the cache's buffer memory in (`--prefault`), and the thread that does it
//! while serving.
//!
//! A cache's first fill otherwise pays the kernel for each fresh page (zeroing and charging it)
//! on the data path: a copy through a fresh server ran at 0.6–0.8 of `nbdkit file`'s
//! throughput that way, and at 1.0–1.2 with the memory faulted in first. Faulting it in before
//! serving delays the start (about 0.5 s per GiB per core); faulting it in on a background
//! thread uses the time a new server waits for its first clients instead, and yields the CPU to
//! requests when they come.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bufcache::device::aligned::POOL_CHUNK_BYTES;
use bufcache::{format_size, Cache, Populate};

/// When the cache's memory is faulted in (`--prefault=WHEN`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PrefaultWhen {
    /// The first GiB before accepting clients, the rest in the background (the default).
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
/// system has available (or the process's memory cgroup allows, if less), so a cache sized
/// beyond the machine is not pushed into swap or the OOM killer at startup. What is left out is faulted in as data arrives; the server says so.
pub fn bytes_to_prefault(wanted: u64) -> u64 {
    let system = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| mem_available_bytes(&text));
    // In a container /proc/meminfo tells the host's memory; the cgroup's limit is the one
    // the OOM killer applies.
    let Some(available) = [system, cgroup_room_bytes()].into_iter().flatten().min() else {
        return wanted;
    };
    // Whole chunks: the unit prefaulting maps.
    let chunk = POOL_CHUNK_BYTES as u64;
    let cap = available / 100 * AVAILABLE_MEMORY_SHARE_PERCENT / chunk * chunk;
    if wanted <= cap {
        return wanted;
    }
    let gib = |bytes: u64| bytes as f64 / f64::from(1u32 << 30);
    crate::log::say!(
        "prefaulting {:.1} GiB of the {:.1} GiB the cache could use: {:.1} GiB is \
         available (MemAvailable, or the memory cgroup's room); the rest is faulted in as data \
         arrives",
        gib(cap),
        gib(wanted),
        gib(available)
    );
    cap
}

/// What the process's memory cgroup lets it still use (limit minus usage), when it has a
/// limit: cgroup v2 (`memory.max`, `memory.current`) or v1 (`memory.limit_in_bytes`,
/// `memory.usage_in_bytes`).
fn cgroup_room_bytes() -> Option<u64> {
    let membership = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let (version, path) = memory_cgroup(&membership)?;
    let read = |name: &str| {
        std::fs::read_to_string(format!("/sys/fs/cgroup{path}/{name}"))
            .ok()
            .and_then(|text| text.trim().parse::<u64>().ok())
    };
    let (limit, usage) = match version {
        CgroupVersion::V2 => (read("memory.max")?, read("memory.current")?),
        CgroupVersion::V1 => (
            read("memory.limit_in_bytes")?,
            read("memory.usage_in_bytes")?,
        ),
    };
    Some(limit.saturating_sub(usage))
}

#[derive(Debug, PartialEq, Eq)]
enum CgroupVersion {
    V1,
    V2,
}

/// The memory cgroup's version and its directory under `/sys/fs/cgroup`, from the text of
/// `/proc/self/cgroup`: a v1 `memory` controller line wins over the v2 line, which a hybrid
/// setup also has.
fn memory_cgroup(membership: &str) -> Option<(CgroupVersion, String)> {
    let mut v2 = None;
    for line in membership.lines() {
        let mut fields = line.splitn(3, ':');
        let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
        if controllers.split(',').any(|name| name == "memory") {
            return Some((CgroupVersion::V1, format!("/memory{path}")));
        }
        if controllers.is_empty() {
            v2 = Some((CgroupVersion::V2, path.to_string()));
        }
    }
    v2
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
    let chunks = on_every_core(cache, bytes_max, Populate::Advise, &AtomicBool::new(false));
    report(chunks, started, "before serving");
}

/// Runs `cache.prefault` on one scoped thread per core (the calling thread stands in when
/// none can be started: prefaulting is an optimization, never a reason to fail) until it
/// declines or `stop` is set; returns the chunks faulted in.
fn on_every_core(cache: &Cache, bytes_max: u64, populate: Populate, stop: &AtomicBool) -> u64 {
    let prefault = || {
        if populate == Populate::Touch {
            lower_priority();
        }
        let mut chunks = 0;
        while !stop.load(Ordering::Acquire) && cache.prefault(bytes_max, populate) {
            chunks += 1;
        }
        chunks
    };
    let threads = std::thread::available_parallelism().map_or(1, |count| count.get());
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .filter_map(|_| {
                std::thread::Builder::new()
                    .name("bufcache-prefault".into())
                    .spawn_scoped(scope, prefault)
                    .map_err(|error| {
                        tracing::warn!("cannot start a prefault thread: {error}");
                    })
                    .ok()
            })
            .collect();
        if workers.is_empty() {
            return prefault();
        }
        workers
            .into_iter()
            .map(|worker| worker.join().unwrap_or(0))
            .sum()
    })
}

/// The threads faulting memory in while the server runs.
pub struct Background {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

impl Background {
    /// Starts faulting memory in, a 2 MiB chunk at a time on one thread per core at a low
    /// priority, until the cache holds `bytes_max` or its memory limit, or
    /// [`Background::stop`] is called; then says how much was faulted in. None (with a
    /// warning) when no thread can be started: the cache then fills as data arrives.
    pub fn start(cache: Cache, bytes_max: u64) -> Option<Background> {
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("bufcache-prefault".into())
            .spawn(move || {
                let started = Instant::now();
                // Touching pages rather than one madvise call per chunk: these threads may
                // be preempted anywhere, and must not hold the address-space lock then.
                let chunks = on_every_core(&cache, bytes_max, Populate::Touch, &stopping);
                if stopping.load(Ordering::Acquire) {
                    // Said even when nothing was done yet: a shutdown on a busy machine can
                    // come before the low-priority threads faulted in their first chunk.
                    say_prefaulted(chunks, started, "in the background (stopped at shutdown)");
                } else {
                    report(chunks, started, "in the background");
                }
            });
        match thread {
            Ok(thread) => Some(Background { stop, thread }),
            Err(error) => {
                tracing::warn!("cannot start the prefault threads: {error}");
                None
            }
        }
    }

    /// Stops after the chunks in progress and waits for the threads.
    pub fn stop(self) {
        self.stop.store(true, Ordering::Release);
        let _ = self.thread.join();
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

/// Says how much was faulted in, unless nothing was (there was nothing to do).
fn report(chunks: u64, started: Instant, how: &str) {
    if chunks > 0 {
        say_prefaulted(chunks, started, how);
    }
}

/// Says how much was faulted in: `chunks` of `POOL_CHUNK_BYTES`.
fn say_prefaulted(chunks: u64, started: Instant, how: &str) {
    let bytes = chunks * POOL_CHUNK_BYTES as u64;
    let seconds = started.elapsed().as_secs_f64();
    tracing::info!(bytes, seconds, how, "memory prefaulted");
    crate::log::say!(
        "prefaulted {} of buffer memory in {seconds:.2} s {how}",
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
    fn the_memory_cgroup_is_found_in_v1_hybrid_and_v2_membership() {
        // Goal: the prefault cap reads the right cgroup's files. Method: parse the
        // /proc/self/cgroup texts of a v1 host (this CI machine's shape), of a pure v2 host,
        // and one with no memory cgroup.
        let v1 = "9:name=systemd:/\n4:memory:/process_api/abc\n1:cpu:/\n0::/\n";
        assert_eq!(
            memory_cgroup(v1),
            Some((CgroupVersion::V1, "/memory/process_api/abc".to_string()))
        );
        assert_eq!(
            memory_cgroup("0::/system.slice/bufcache.service\n"),
            Some((
                CgroupVersion::V2,
                "/system.slice/bufcache.service".to_string()
            ))
        );
        assert_eq!(memory_cgroup("3:cpu,cpuacct:/\n"), None);
    }

    #[test]
    fn a_prefault_within_available_memory_is_not_capped() {
        // Goal: a small cache is prefaulted whole. Method: 1 MiB is below any machine's
        // available memory; a cap of it would be the bug.
        assert_eq!(bytes_to_prefault(1 << 20), 1 << 20);
    }
}
