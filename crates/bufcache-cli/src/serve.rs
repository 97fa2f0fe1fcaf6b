//! `bufcache serve`: exports backing stores through one shared buffer cache over NBD.
//!
//! Each export is a cache object over its backend device: a file or block device, `memory:SIZE`,
//! or an upstream NBD server (`nbd://HOST:PORT/EXPORT`, `nbd+unix:///EXPORT?socket=PATH`).
//! The process owns dirty data, so shutdown (SIGINT, SIGTERM) stops accepting, lets in-flight
//! requests finish, writes back everything dirty and flushes every backend before exiting 0;
//! if that write-back fails the error is printed and the exit status is 1.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bufcache::{
    format_size, parse_size, Cache, CacheError, CountingDevice, Device, FileDevice,
    FileDeviceOptions, MemoryDevice, ObjectConfig, ObjectHandle,
};
use bufcache_export::CacheExport;
use bufcache_nbd::{
    Export, ListenAddress, ReconnectPolicy, ReconnectingClient, Server, ServerConfig,
    ShutdownHandle,
};
use clap::Args;

use crate::backend_lock::BackendLock;
use crate::engine_args::EngineArgs;
use crate::limit_args::LimitArgs;
use crate::log::say;
use crate::metrics::{self, ExportMeters, Meters, ServeTier};
use crate::prefault::{self, PrefaultWhen};
use crate::request_meters::{MeteredExport, RequestMeters};
use crate::rescue::{self, identity_of_url, same_backend, BackendIdentity, Refusal, RescueAction};
use crate::tls_args::TlsArgs;

/// Exit status when dirty data was saved to the rescue file instead of the backend.
pub const EXIT_RESCUED: i32 = 3;
/// How long a second signal waits for the shutdown's last flush when nothing is dirty.
const SECOND_SIGNAL_GRACE: Duration = Duration::from_millis(500);

/// The backing file served when no backend is named, created sparse when absent.
pub const DEFAULT_BACKING_FILE: &str = "bufcache.img";
/// Size of the default backing file when it has to be created.
pub const DEFAULT_BACKING_SIZE_BYTES: u64 = 1 << 30;

/// Arguments of `bufcache serve`.
#[derive(Args, Debug)]
#[command(after_help = "Examples:\n  \
    bufcache serve                                   # ./bufcache.img (1 GiB, sparse) on tcp:127.0.0.1:10809\n  \
    nbdinfo nbd://127.0.0.1                          # try it\n  \
    bufcache serve --backend memory:4G --listen unix:/tmp/nbd.sock\n  \
    bufcache serve --backend nbd://disk-server:10809/vol1 --cache-size 2G   # cache a remote disk\n  \
    bufcache serve --export a=disk-a.img --export b=memory:1G --listen tcp:0.0.0.0:10809\n\n\
    Backends: a file or block device path, memory:SIZE, s3://BUCKET/PREFIX?endpoint=..., nbd://HOST[:PORT]/EXPORT or\n\
    nbd+unix:///EXPORT?socket=PATH. SIGINT or SIGTERM writes back all dirty data and exits.")]
pub struct ServeArgs {
    /// Read flags from a TOML file (keys are these long flags; see `bufcache config
    /// --print-default`). A flag also given on the command line overrides the file's value.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// The backing store of the default (empty-named) export. Default ./bufcache.img.
    #[arg(long, value_name = "BACKEND")]
    backend: Option<String>,
    /// Named exports, NAME=BACKEND; repeatable. All share one cache.
    #[arg(long = "export", value_name = "NAME=BACKEND")]
    exports: Vec<String>,
    /// Where to listen: tcp:HOST:PORT or unix:PATH; repeatable. Default tcp:127.0.0.1:10809
    /// (or the sockets systemd passes, see docs/operations.md).
    #[arg(long, value_name = "ADDRESS")]
    listen: Vec<ListenAddress>,
    /// Listen on TCP port PORT of 127.0.0.1, or of the --bind address (--listen
    /// tcp:127.0.0.1:PORT; use --listen tcp:0.0.0.0:PORT for every interface).
    #[arg(short = 'p', long, value_name = "PORT")]
    port: Option<u16>,
    /// Listen on TCP address ADDR (qemu-nbd's -b), port --port or 10809.
    #[arg(short = 'b', long, value_name = "ADDR")]
    bind: Option<String>,
    /// Listen on the unix socket PATH (--listen unix:PATH; -k/--socket as in qemu-nbd).
    #[arg(
        short = 'U',
        long,
        visible_short_alias = 'k',
        visible_alias = "socket",
        value_name = "PATH"
    )]
    unix: Option<PathBuf>,
    /// The export name of --backend (default: the empty name, which clients get without
    /// asking for one). Note: -e is nbdkit's --exportname; qemu-nbd's -e (--shared=N, most
    /// clients at once) is --connections-max N here.
    #[arg(short = 'e', long, value_name = "NAME")]
    export_name: Option<String>,
    /// Write the server's process id to PATH once it accepts connections; removed at exit.
    #[arg(short = 'P', long, visible_alias = "pidfile", value_name = "PATH")]
    pid_file: Option<PathBuf>,
    /// Captive mode, as nbdkit's --run: once listening, run CMD with `sh -c`, with $uri,
    /// $socket (unix listener) and $port (TCP listener) set; when it exits, shut down as on
    /// SIGTERM and exit with its status (unless dirty data had to go to the rescue file: then
    /// 3, or 1). Without --listen, -p, -b or -U the server listens on a private unix socket.
    #[arg(long, value_name = "CMD")]
    run: Option<String>,
    /// Shut down as on SIGTERM (writing everything back) when the parent process exits
    /// (nbdkit's --exit-with-parent; Linux's PR_SET_PDEATHSIG).
    #[arg(long)]
    exit_with_parent: bool,
    /// Print the URI of the default export on standard output once listening (nbdkit's
    /// --print-uri).
    #[arg(long)]
    print_uri: bool,
    /// Accepted for nbdkit's users; the server always runs in the foreground (a service
    /// manager or `&` puts it in the background).
    #[arg(short = 'f', long)]
    foreground: bool,
    /// Accepted for qemu-nbd's users: the server always keeps serving after the last client
    /// disconnects (qemu-nbd's -t/--persistent); it stops on SIGINT/SIGTERM, or when the
    /// --run command or (with --exit-with-parent) the parent exits.
    #[arg(short = 't', long)]
    persistent: bool,
    /// qemu-nbd's --fork: refused with an explanation (the server stays in the foreground).
    #[arg(long, hide = true)]
    fork: bool,
    /// Size of a backing file to create when it does not exist (the default file: 1G).
    #[arg(long, value_name = "SIZE", value_parser = |text: &str| parse_size(text).map_err(|e| e.to_string()))]
    create_size: Option<u64>,
    /// Refuse writes.
    #[arg(short = 'r', long)]
    read_only: bool,
    /// Stand by for an S3 log-layout disk another server writes: wait (as the disk's one
    /// standby) until that server's lease lapses, then take the disk over with a new epoch and
    /// serve it (docs/s3.md, "Standby").
    #[arg(long)]
    standby: bool,
    /// With --standby: the most bytes the standby reads into its cache per follow round while
    /// it waits (first what the writer wrote most recently, then what each refresh of its view
    /// finds changed), so it serves them from memory once it takes over. 0 keeps the cache
    /// only as clients fill it after the takeover.
    #[arg(long, value_name = "SIZE", value_parser = |text: &str| parse_size(text).map_err(|e| e.to_string()))]
    standby_warm_bytes_max: Option<u64>,
    /// Open backing files with O_DIRECT (bypassing the host page cache).
    #[arg(long)]
    direct: bool,
    /// Worker threads per backing file for the cache's reads and write-back: requests go to a
    /// bounded queue (3 per thread) and run in parallel on the workers. 0 (the default) runs
    /// each request in the thread that asks for it.
    #[arg(long, value_name = "COUNT", default_value_t = 0)]
    file_io_threads: usize,
    /// Requests in flight per backing file through one io_uring (Linux): the cache's reads
    /// and write-back go to the kernel without waiting and complete on one reaper thread.
    /// 0 (the default) uses no ring. Exclusive with --file-io-threads.
    #[arg(long, value_name = "COUNT", default_value_t = 0)]
    file_io_uring_depth: usize,
    /// Largest NBD request in bytes (advertised maximum block size). Default 32M.
    #[arg(long, value_name = "SIZE", value_parser = |text: &str| parse_size(text).map_err(|e| e.to_string()))]
    request_size_max: Option<u64>,
    /// Seconds from SIGINT/SIGTERM to exit: in-flight requests finish and dirty data is written
    /// back, retrying while the backend fails. Data still dirty then (or at a second signal) is
    /// saved to the rescue file and the exit status is 3. Default 10.
    #[arg(long, value_name = "SECONDS", default_value_t = 10.0)]
    shutdown_timeout: f64,
    /// Where dirty data that could not be written back at shutdown is saved, for every export
    /// (see docs/operations.md). Default: one file per export in the working directory,
    /// bufcache-NAME-HASH.rescue, named after the backend, locked while the server runs.
    #[arg(long, value_name = "PATH")]
    rescue_file: Option<PathBuf>,
    /// What to do with a rescue file found at start: replay writes its data to the backends
    /// and flushes before accepting clients (refusing to start if that fails); discard deletes
    /// it.
    #[arg(long, value_name = "ACTION", value_enum, default_value_t = RescueAction::Replay)]
    rescue: RescueAction,
    /// Upstream NBD backends: seconds before the second reconnect attempt after a lost
    /// connection; doubles after each failure. Dirty data stays cached meanwhile; FLUSH fails.
    #[arg(long, value_name = "SECONDS", default_value_t = 0.1)]
    reconnect_delay_initial: f64,
    /// Upstream NBD backends: the longest wait between reconnect attempts, in seconds.
    #[arg(long, value_name = "SECONDS", default_value_t = 5.0)]
    reconnect_delay_max: f64,
    /// Upstream NBD backends: stop reconnecting after this many seconds unreachable (0: never).
    #[arg(long, value_name = "SECONDS", default_value_t = 3600.0)]
    reconnect_give_up: f64,
    /// When to fault the cache's memory in (up to the cache size or the exports' total size,
    /// whichever is smaller, and 90% of the memory available), so a first fill does not pay
    /// the kernel for fresh pages on the data path: auto (the first GiB before accepting
    /// clients, the rest on low-priority threads while serving), background (all of it while
    /// serving), startup (all of it before accepting clients, about 0.5 s per GiB per core)
    /// or off (as data first arrives). `--prefault` alone means startup. That memory is
    /// resident from then on.
    #[arg(
        long,
        value_name = "WHEN",
        value_enum,
        num_args = 0..=1,
        require_equals = true,
        default_value_t = PrefaultWhen::Auto,
        default_missing_value = "startup"
    )]
    prefault: PrefaultWhen,
    /// The same as --prefault=off: memory is faulted in as data first arrives.
    #[arg(long, conflicts_with = "prefault")]
    no_prefault: bool,
    /// A local cache (a file or block device) in front of the backend: a checksummed log of
    /// writes not yet on the backend and a read cache that survives restarts, written back in
    /// flush order so the backend is always a consistent image (docs/local-tier.md). The file
    /// is created with --local-cache-size when missing (a block device is used when its first
    /// 4 KiB are zeroes). It belongs to one backend: one export only, not memory:.
    #[arg(long, value_name = "PATH")]
    local_cache: Option<PathBuf>,
    /// Size of the --local-cache file to create. An existing cache keeps its size; giving
    /// another one is an error.
    #[arg(long, value_name = "SIZE", value_parser = |text: &str| parse_size(text).map_err(|e| e.to_string()))]
    local_cache_size: Option<u64>,
    /// With --local-cache, when a FLUSH returns: local (the default) once the local log
    /// holds its writes, fsynced, the backend following in the background in flush order;
    /// remote once the backend holds them too, flushed (the behaviour without a local cache).
    #[arg(long, value_name = "WHERE", value_enum)]
    flush_to: Option<FlushToArg>,
    /// Seconds a write waits, once the --local-cache log is full of data not yet on the
    /// backend, while write-back makes no progress at all; then it fails (a FLUSH answers
    /// EIO) and the data stays dirty. Progress restarts the wait, so a slow backend that
    /// moves is waited for. Default 10.
    #[arg(long, value_name = "SECONDS")]
    local_cache_stall_max: Option<f64>,
    /// Attach a --local-cache whose log holds a damaged record that a later record proves
    /// had been fsynced (corruption of the local device, not a crash), replaying only the
    /// records before it: every write from that record on is lost. Without it such a cache
    /// is refused, naming the record's offset.
    #[arg(long)]
    local_cache_replay_prefix: bool,
    /// Clean blocks of the --local-cache (copies of what the backend held) compared with the
    /// backend's bytes before the cache is attached; any difference refuses the start (the
    /// backend is another disk reached the same way, or was written around the cache).
    /// 0 attaches without comparing. Default 32, at most 4096.
    #[arg(long, value_name = "N")]
    local_cache_sampled_blocks: Option<usize>,
    /// Serve Prometheus metrics (/metrics) and JSON statistics (/stats) on HOST:PORT.
    #[arg(long, value_name = "HOST:PORT")]
    metrics: Option<String>,
    /// Listen for owner commands on this unix socket (mode 0600), such as
    /// `bufcache disk snapshot URL NAME --control PATH`, which snapshots a served
    /// log-layout disk at a flush point. Not with --local-cache.
    #[arg(long, value_name = "PATH")]
    control: Option<PathBuf>,
    // Boxed: the limit flags would make `ServeArgs` the one huge variant of the commands.
    #[command(flatten)]
    limits: Box<LimitArgs>,
    #[command(flatten)]
    tls: Box<TlsArgs>,
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    observe: crate::observe::ObserveArgs,
}

/// The durability point of a FLUSH with a local cache (--flush-to).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum FlushToArg {
    /// The local log holds the writes, fsynced.
    Local,
    /// The backend holds the writes, flushed.
    Remote,
}

/// Puts the --local-cache tier over `remote` (whose identity is `identity`); the lock on
/// the local cache file is taken before anything in it is read.
fn open_local_tier(
    args: &ServeArgs,
    path: &Path,
    remote: Arc<dyn Device>,
    identity: &BackendIdentity,
) -> anyhow::Result<(Arc<ServeTier>, BackendLock)> {
    let config = tier_config(args);
    let existed = path.exists();
    let early_lock = existed.then(|| BackendLock::acquire(path)).transpose()?;
    // A cache made by an older server names its backend by the URL; once checked to be this
    // disk (check_before_writing), it is given the disk's own identity.
    if let Some(recorded) = bufcache_tier::recorded_identity(path)? {
        if recorded != identity.identity && same_backend(&recorded, identity) {
            bufcache_tier::migrate_identity(path, &recorded, &identity.identity)?;
            say!(
                "local cache {}: its backend `{recorded}` is now named by the disk's identity `{}`",
                path.display(),
                identity.identity
            );
        }
    }
    let tier = bufcache_tier::LocalTier::open_path(
        path,
        args.local_cache_size,
        remote,
        &identity.identity,
        config,
    )
    .map_err(|error| match error {
        // A refusal of what the user named (nothing was written): exit 2, like the others.
        bufcache_tier::TierError::OtherContent { .. } => {
            anyhow::Error::new(crate::BadInput(error.to_string()))
        }
        error => anyhow::Error::new(error),
    })?;
    let lock = match early_lock {
        Some(lock) => lock,
        None => BackendLock::acquire(path)?,
    };
    let stats = tier.stats();
    say!(
        "local cache {} ({} log, flush to {}): {} dirty in {} epochs to write back",
        path.display(),
        format_size(stats.log_capacity_bytes),
        if config_flush_remote(args) {
            "remote"
        } else {
            "local"
        },
        bufcache::device::size::format_size_rounded(stats.dirty_bytes),
        stats.epochs_pending
    );
    Ok((Arc::new(tier), lock))
}

/// The local tier's configuration the flags give.
fn tier_config(args: &ServeArgs) -> bufcache_tier::LocalTierConfig {
    bufcache_tier::LocalTierConfig {
        flush_to: match args.flush_to {
            Some(FlushToArg::Remote) => bufcache_tier::FlushTo::Remote,
            Some(FlushToArg::Local) | None => bufcache_tier::FlushTo::Local,
        },
        remote_stall_max: args.local_cache_stall_max.map_or(
            bufcache_tier::LocalTierConfig::default().remote_stall_max,
            Duration::from_secs_f64,
        ),
        replay_damaged_prefix: args.local_cache_replay_prefix,
        sampled_blocks_max: args
            .local_cache_sampled_blocks
            .unwrap_or(bufcache_tier::LocalTierConfig::default().sampled_blocks_max),
        ..bufcache_tier::LocalTierConfig::default()
    }
}

fn config_flush_remote(args: &ServeArgs) -> bool {
    args.flush_to == Some(FlushToArg::Remote)
}

impl ServeArgs {
    /// The --listen addresses given (empty means the default).
    #[cfg(test)]
    pub fn listen_addresses(&self) -> &[ListenAddress] {
        &self.listen
    }
}

/// A backend's device, and what comes with it.
struct OpenedBackend {
    device: Arc<dyn Device>,
    /// The upstream connection when the backend is an NBD server (for its metrics).
    upstream: Option<Arc<ReconnectingClient>>,
    /// What the backend is, for its rescue file and local cache; None for memory, which does
    /// not outlive the process (so there is nothing to rescue into).
    identity: Option<BackendIdentity>,
    /// The S3 device, whose log layout may hold acknowledged data only in memory (saved to
    /// the rescue file at a shutdown that cannot reach the store).
    s3: Option<Arc<bufcache_s3::S3Device>>,
    /// The object-store disk when the backend is s3:// (for its metrics).
    store: Option<Arc<bufcache_s3::S3Device>>,
    /// Exclusive use of a backing file or block device, held until the process ends.
    _lock: Option<BackendLock>,
    /// A warm standby's device (the replica view until it takes the disk over); its writable
    /// open waits on a thread of its own and is sent as [`Event::TakenOver`].
    standby: Option<Arc<bufcache_s3::standby::Standby>>,
}

/// What a --standby server reads into its cache per follow round without
/// --standby-warm-bytes-max.
pub(crate) const STANDBY_WARM_BYTES_MAX_DEFAULT: u64 = 64 << 20;

/// Faults the cache's memory in as --prefault says: the part before serving now, and returns
/// the thread that does the rest while serving, if any.
fn start_prefault(
    args: &ServeArgs,
    cache: &Cache,
    objects: &[(String, ObjectHandle)],
) -> Option<prefault::Background> {
    let exports_bytes: u64 = objects.iter().map(|(_, object)| object.len()).sum();
    let prefault_when = if args.no_prefault {
        PrefaultWhen::Off
    } else {
        args.prefault
    };
    let prefault_bytes_max = match prefault_when {
        PrefaultWhen::Off => 0,
        _ => prefault::bytes_to_prefault(exports_bytes.min(cache.config().memory_bytes_max)),
    };
    match prefault_when {
        PrefaultWhen::Startup => {
            prefault::before_serving(cache, prefault_bytes_max);
            None
        }
        PrefaultWhen::Auto => {
            prefault::before_serving(
                cache,
                prefault_bytes_max.min(prefault::BEFORE_SERVING_BYTES_MAX),
            );
            (prefault_bytes_max > prefault::BEFORE_SERVING_BYTES_MAX)
                .then(|| prefault::Background::start(cache.clone(), prefault_bytes_max))
                .flatten()
        }
        PrefaultWhen::Background => prefault::Background::start(cache.clone(), prefault_bytes_max),
        PrefaultWhen::Off => None,
    }
}

/// Serves /metrics and /stats over `meters` on `listener`.
fn start_metrics(
    listener: std::net::TcpListener,
    cache: &Cache,
    meters: Vec<ExportMeters>,
    observers: &crate::observe::Observers,
) -> anyhow::Result<()> {
    let local = metrics::start(
        listener,
        Arc::new(Meters {
            cache: cache.clone(),
            exports: meters,
            whatif: observers.whatif.clone(),
        }),
    )?;
    say!("metrics on http://{local}/metrics and /stats   (try: bufcache stat {local})");
    Ok(())
}

/// Acknowledges changes to a warm standby's export only once it took the disk over, and then
/// while its lease holds (a standby serves no client before; this is the second line).
struct StandbyGate(Arc<bufcache_s3::standby::Standby>);

impl bufcache_nbd::AcknowledgeGate for StandbyGate {
    fn may_acknowledge_changes(&self) -> std::io::Result<()> {
        match self.0.writer() {
            None => Err(std::io::Error::other(
                "this server is the disk's standby: it writes only once it takes the disk over",
            )),
            Some(writer) => match writer.lease() {
                Some(lease) => lease.check().map_err(std::io::Error::other),
                None => Ok(()),
            },
        }
    }
}

/// Acknowledges changes to an S3 log-layout export only while this server's lease on the
/// disk holds (docs/s3.md, "Leases and takeover").
struct LeaseGate(Arc<bufcache_s3::lease::Lease>);

impl bufcache_nbd::AcknowledgeGate for LeaseGate {
    fn may_acknowledge_changes(&self) -> std::io::Result<()> {
        self.0.check().map_err(std::io::Error::other)
    }
}

/// The name of the S3 disk a URL reaches: `s3://BUCKET/PREFIX`, every parameter left out
/// but `snapshot=` (a snapshot is a disk of its own for rescue files and local caches).
fn s3_disk_name(url: &bufcache_s3::S3Url) -> String {
    format!("s3://{}/{}{}", url.bucket, url.prefix, snapshot_suffix(url))
}

/// What sets a snapshot's identity apart from its disk's: `?snapshot=NAME`, or nothing.
fn snapshot_suffix(url: &bufcache_s3::S3Url) -> String {
    url.snapshot
        .as_ref()
        .map(|name| format!("?snapshot={name}"))
        .unwrap_or_default()
}

/// Checks, before anything is written to the backend (no lock broken, no epoch, no
/// checkpoint), that what this server will attach belongs to the backend `ours` of export
/// `export`: its rescue file (same disk, and the disk not moved on since the file was saved,
/// unless `--rescue force`), rescue files older servers saved under other names, and the local
/// cache. A refusal says what is held and the command that recovers it.
fn check_before_writing(
    args: &ServeArgs,
    export: &str,
    ours: &BackendIdentity,
    size_bytes: Option<u64>,
) -> anyhow::Result<()> {
    let refuse = |message: String| Err(anyhow::Error::new(crate::BadInput(message)));
    let path = args
        .rescue_file
        .clone()
        .unwrap_or_else(|| rescue::default_path(export, &ours.name));
    if args.rescue != RescueAction::Discard && path.exists() {
        let contents = rescue::read(&path)?;
        let bytes: u64 = contents
            .records
            .iter()
            .filter(|record| record.export == export)
            .map(|record| record.data.len() as u64)
            .sum();
        let age = rescue_age(&path);
        for saved in contents.backends.iter().flatten() {
            if saved.export != export {
                continue;
            }
            let force = args.rescue == RescueAction::Force;
            let stale = |why: String| {
                format!(
                    "rescue file {} holds {bytes} bytes of unwritten data (saved {age}) of {} (export {export:?}), and {why}: refusing to replay it over possibly newer data; nothing was changed and the file is kept. If its data is the newest, replay it anyway by adding --rescue force",
                    path.display(),
                    ours.name,
                )
            };
            let message = match rescue::check_saved(saved, ours, size_bytes, force) {
                Ok(()) => continue,
                Err(Refusal::OtherDisk) => format!(
                    "rescue file {} holds {bytes} bytes of unwritten data (saved {age}) of disk {} (export {export:?}), and this server's backend is {} ({}): refusing to replay it into another backend; nothing was changed. Start a server on {} to replay it, or give this one another --rescue-file",
                    path.display(),
                    saved.identity,
                    if ours.identity.is_empty() {
                        "a disk not made yet"
                    } else {
                        &ours.identity
                    },
                    ours.name,
                    if saved.name.is_empty() { &saved.identity } else { &saved.name },
                ),
                Err(Refusal::Resized { then_bytes, now_bytes }) => format!(
                    "rescue file {} holds {bytes} bytes of unwritten data (saved {age}) of {} when it was {then_bytes} bytes; it is {now_bytes} bytes now: refusing to replay into a resized disk; nothing was changed",
                    path.display(),
                    ours.name,
                ),
                Err(Refusal::MovedOn { then, now }) => stale(format!(
                    "the disk moved on since it was saved (generation {then} then, {now} now: another server opened it for writing and may have written newer data)"
                )),
                Err(Refusal::StateUnknown { .. }) => stale(
                    "it was saved by an older bufcache that did not record the disk's state, so whether the disk moved on since cannot be told".to_string(),
                ),
            };
            return refuse(message);
        }
    }
    if args.rescue_file.is_none() {
        for other in other_rescue_files(&path) {
            let Ok(contents) = rescue::read(&other) else {
                continue;
            };
            let ours_there = contents
                .backends
                .iter()
                .flatten()
                .any(|saved| saved.export == export && same_backend(&saved.identity, ours));
            if ours_there {
                let bytes: u64 = contents
                    .records
                    .iter()
                    .map(|record| record.data.len() as u64)
                    .sum();
                return refuse(format!(
                    "rescue file {} holds {bytes} bytes of unwritten data (saved {}) of this server's disk {} (export {export:?}), saved under another name by an older bufcache: nothing was changed; replay it with --rescue-file {} (and --rescue force if the file does not record the disk's state)",
                    other.display(),
                    rescue_age(&other),
                    ours.name,
                    other.display()
                ));
            }
        }
    }
    if let Some(local) = &args.local_cache {
        if let Some(superblock) = bufcache_tier::recorded_superblock(local)? {
            let recorded = superblock.identity;
            let local_bytes = std::fs::metadata(local).map_or(0, |metadata| metadata.len());
            let is_file = std::fs::metadata(local).is_ok_and(|metadata| metadata.is_file());
            let problem = if let Some(size) =
                size_bytes.filter(|size| *size != superblock.backend_bytes)
            {
                Some(format!(
                    "was made for a backend of {} bytes, and {} is {size} bytes",
                    superblock.backend_bytes, ours.name
                ))
            } else if let Some(asked) = args
                .local_cache_size
                .filter(|asked| *asked != superblock.local_bytes)
            {
                Some(format!("is {} bytes, not the {asked} bytes asked for (--local-cache-size; a local cache is not resized: leave the flag out)", superblock.local_bytes))
            } else if is_file && local_bytes < superblock.local_bytes {
                Some(format!(
                    "is truncated: {local_bytes} bytes, its superblock says {}",
                    superblock.local_bytes
                ))
            } else {
                None
            };
            if let Some(problem) = problem.filter(|_| same_backend(&recorded, ours)) {
                return refuse(format!(
                    "local cache {} (last written {}) {problem}: refusing to attach it; nothing was replayed or written",
                    local.display(),
                    rescue_age(local)
                ));
            }
            if !same_backend(&recorded, ours) {
                return refuse(format!(
                    "local cache {} (last written {}) belongs to backend `{recorded}`, not `{}` ({}): refusing to attach it; nothing was replayed or written. It may hold flushed writes not yet on `{recorded}`: start `bufcache serve` on that backend with --local-cache {} to write them back, and give this backend another --local-cache path",
                    local.display(),
                    rescue_age(local),
                    ours.identity,
                    ours.name,
                    local.display()
                ));
            }
        }
    }
    Ok(())
}

/// How long ago the file at `path` was last written, for messages.
fn rescue_age(path: &Path) -> String {
    std::fs::metadata(path)
        .and_then(|metadata| metadata.modified())
        .ok()
        .and_then(|modified| modified.elapsed().ok())
        .map_or("at an unknown time".to_string(), |age| {
            format!("{} s ago", age.as_secs())
        })
}

/// The `bufcache-*.rescue` files in the working directory other than `ours`.
fn other_rescue_files(ours: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(".") else {
        return Vec::new();
    };
    entries
        .flatten()
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with("bufcache-") && name.ends_with(".rescue"))
        .map(PathBuf::from)
        .filter(|path| path != ours)
        .collect()
}

/// A backend checked and opened as far as it can be without writing to it.
enum PreparedBackend {
    /// Opened: nothing in it changes at open (a file, an NBD upstream, memory).
    Opened(OpenedBackend),
    /// Probed and checked; [`PendingS3::open`] takes the lock and raises the generation.
    S3(Box<PendingS3>),
}

impl PreparedBackend {
    /// Opens what is left to open: called for every export only once all were prepared and
    /// every socket opened, so a start refused for one export never changed another's store.
    /// A warm standby's writable open tells `events` when it took the disk (as export
    /// `index`).
    fn open(self, events: &mpsc::Sender<Event>, index: usize) -> anyhow::Result<OpenedBackend> {
        match self {
            PreparedBackend::Opened(opened) => Ok(opened),
            PreparedBackend::S3(pending) => pending.open(events, index),
        }
    }
}

/// An S3 disk probed (its id, generation and size read) and checked against its rescue file
/// and local cache, nothing written to it yet.
struct PendingS3 {
    url: bufcache_s3::S3Url,
    seen: Option<bufcache_s3::DiskState>,
    proposed_id: u64,
    meters: Arc<bufcache_s3::StoreMeters>,
    name: String,
    read_only: bool,
    /// `--standby` that follows the disk and keeps a cache warm while it waits (a log-layout
    /// disk that exists, with a lease, served without --local-cache); false for a standby
    /// that waits cold (the local cache is its warm copy) or is refused by the open.
    warm_standby: bool,
}

impl PendingS3 {
    /// Opens the disk; for writing, this takes its lock and raises its generation. A warm
    /// standby opens its replica view here and waits for the lock on a thread of its own,
    /// which sends [`Event::TakenOver`] to `events`.
    fn open(self, events: &mpsc::Sender<Event>, index: usize) -> anyhow::Result<OpenedBackend> {
        if self.warm_standby {
            return self.open_warm_standby(events, index);
        }
        let PendingS3 {
            url,
            seen,
            proposed_id,
            meters,
            name,
            read_only,
            warm_standby: _,
        } = self;
        // --read-only writes nothing, not even the disk lock; credentials that may not write
        // (the store answers the lock's PUT 403) make a read-only export too, as a file this
        // process may only read does.
        let device = if read_only {
            bufcache_s3::S3Device::open_read_only_counted(&url, meters)?
        } else {
            bufcache_s3::S3Device::open_locked_after_probe(
                &url,
                seen.as_ref(),
                proposed_id,
                meters,
            )?
        };
        if let Some(bufcache_s3::ReadOnly::WritesRefused(answer)) = device.read_only() {
            say!("{url}: the store refuses writes ({answer}): serving it read-only, without taking the disk lock");
        }
        let state = device.state();
        if seen.is_none() {
            say!(
                "{name}: created a new disk: layout {}, {} bytes, id {}",
                state.layout.name(),
                state.size_bytes,
                state
                    .disk_id
                    .map_or_else(|| "none".to_string(), |id| format!("{id:016x}"))
            );
        }
        let identity = match state.disk_id {
            Some(id) => bufcache_s3::disk_identity(id) + &snapshot_suffix(&url),
            None => {
                say!("{name}: the disk records no id yet (it was made by an older bufcache and is opened read-only, so none is written): its rescue file and local cache are named by {name}");
                name.clone()
            }
        };
        let device = Arc::new(device);
        Ok(OpenedBackend {
            device: Arc::clone(&device) as Arc<dyn Device>,
            upstream: None,
            identity: Some(BackendIdentity {
                identity,
                name,
                state: Some(state.generation),
            }),
            s3: Some(Arc::clone(&device)),
            store: Some(device),
            _lock: None,
            standby: None,
        })
    }

    /// A warm standby: follows the disk read-only (writing nothing) and starts the writable
    /// open, which registers as the disk's standby and waits for the writer's lease to lapse.
    fn open_warm_standby(
        self,
        events: &mpsc::Sender<Event>,
        index: usize,
    ) -> anyhow::Result<OpenedBackend> {
        let PendingS3 {
            url,
            seen,
            proposed_id,
            meters,
            name,
            ..
        } = self;
        let standby = Arc::new(bufcache_s3::standby::Standby::follow(
            &url,
            Arc::clone(&meters),
        )?);
        let state = standby.current().state();
        let identity = match state.disk_id {
            Some(id) => bufcache_s3::disk_identity(id),
            None => name.clone(),
        };
        let writer_url = bufcache_s3::standby::Standby::writer_url(&url);
        let watching = standby.lease_seen();
        let events = events.clone();
        std::thread::Builder::new()
            .name("bufcache-standby".into())
            .spawn(move || {
                let opened = bufcache_s3::S3Device::open_locked_watching(
                    &writer_url,
                    seen.as_ref(),
                    proposed_id,
                    meters,
                    Some(watching),
                );
                let _ = events.send(Event::TakenOver(index, Box::new(opened)));
            })
            .context("starting the standby's thread")?;
        Ok(OpenedBackend {
            device: Arc::clone(&standby) as Arc<dyn Device>,
            upstream: None,
            // The generation is the one the takeover raises it to, recorded then.
            identity: Some(BackendIdentity {
                identity,
                name,
                state: Some(state.generation),
            }),
            s3: None,
            store: None,
            _lock: None,
            standby: Some(standby),
        })
    }
}

/// Opens the device a backend string names (and, for nbd://, the upstream connection too, for
/// its metrics), as far as it can without writing to it: an S3 disk is probed and left
/// pending ([`PreparedBackend::open`]). `export` and the flags say what
/// [`check_before_writing`] checks, which runs before anything is written to the backend.
fn prepare_backend(
    spec: &str,
    args: &ServeArgs,
    is_default: bool,
    export: &str,
) -> anyhow::Result<PreparedBackend> {
    if let Some(size) = spec.strip_prefix("memory:") {
        let size = parse_size(size).with_context(|| format!("backend `{spec}`"))?;
        if size == 0 {
            bail!("backend `{spec}`: a memory backend needs a size above zero, like memory:1G");
        }
        return Ok(PreparedBackend::Opened(OpenedBackend {
            device: Arc::new(MemoryDevice::new(size)),
            upstream: None,
            store: None,
            identity: None,
            s3: None,
            _lock: None,
            standby: None,
        }));
    }
    if spec.starts_with("nbd://")
        || spec.starts_with("nbd+unix://")
        || spec.starts_with("nbds://")
        || spec.starts_with("nbds+unix://")
    {
        let policy = ReconnectPolicy {
            delay_initial: Duration::from_secs_f64(args.reconnect_delay_initial),
            delay_max: Duration::from_secs_f64(args.reconnect_delay_max),
            give_up_after: Duration::from_secs_f64(args.reconnect_give_up),
        };
        let client = Arc::new(
            ReconnectingClient::connect(spec, policy)
                .with_context(|| format!("backend `{spec}`"))?,
        );
        let identity = identity_of_url(spec);
        let identity = BackendIdentity {
            name: identity.clone(),
            identity,
            state: None,
        };
        check_before_writing(args, export, &identity, Some(client.len()))?;
        return Ok(PreparedBackend::Opened(OpenedBackend {
            device: Arc::clone(&client) as Arc<dyn Device>,
            upstream: Some(client),
            identity: Some(identity),
            s3: None,
            store: None,
            _lock: None,
            standby: None,
        }));
    }
    if spec.starts_with("s3://") {
        let mut url = bufcache_s3::S3Url::parse(spec).map_err(bufcache_s3::OpenError::from)?;
        url.create_size_bytes = url.create_size_bytes.or(args.create_size);
        url.standby = args.standby;
        if args.standby {
            say!(
                "{}: standing by; this server takes the disk over when its writer's lease lapses",
                s3_disk_name(&url)
            );
        }
        let name = s3_disk_name(&url);
        // Read before anything is written: the disk's id and generation decide whether its
        // rescue file and local cache may be attached, and a refusal must leave the store as
        // it was (no broken lock, no epoch, no checkpoint, no new generation).
        // One count of the disk's requests, the probe's included.
        let meters = bufcache_s3::StoreMeters::new();
        let seen = bufcache_s3::probe_counted(&url, Some(&meters))?;
        let proposed_id = bufcache_s3::new_disk_id();
        let expected = BackendIdentity {
            identity: match seen.and_then(|seen| seen.disk_id) {
                Some(id) => bufcache_s3::disk_identity(id) + &snapshot_suffix(&url),
                None if seen.is_some() && args.read_only => name.clone(),
                // A disk without an id gets this one when opened for writing; a new disk
                // gets its own, and nothing saved can belong to a disk not made yet.
                None if seen.is_some() => bufcache_s3::disk_identity(proposed_id),
                None => String::new(),
            },
            name: name.clone(),
            state: seen.map(|seen| seen.generation),
        };
        check_before_writing(args, export, &expected, seen.map(|seen| seen.size_bytes))?;
        // The local cache's log too (a damaged record refuses the attach), while the disk
        // is as it was; its clean blocks are compared with the disk once it is open.
        if let Some(local) = args.local_cache.as_deref().filter(|_| !args.read_only) {
            bufcache_tier::check_log_path(local, tier_config(args))?;
        }
        // Anything else a standby is asked (a chunk layout, lease=off, a snapshot, a disk not
        // made yet) goes to the writable open, which refuses it or waits cold as before.
        let warm_standby = args.standby
            && args.local_cache.is_none()
            && url.snapshot.is_none()
            && url.lease_ms.is_some()
            && seen.is_some_and(|seen| seen.layout == bufcache_s3::LayoutKind::Log);
        return Ok(PreparedBackend::S3(Box::new(PendingS3 {
            url,
            seen,
            proposed_id,
            meters,
            name,
            read_only: args.read_only,
            warm_standby,
        })));
    }
    let path = Path::new(spec);
    if !path.exists() {
        if let Some(scheme) = url_scheme(spec) {
            let hint = match scheme.as_str() {
                "nbd" | "nbds" | "nbd+unix" | "nbds+unix" | "s3" => {
                    format!("write it as {scheme}://..., with two slashes")
                }
                "memory" => "write it as memory:SIZE".to_string(),
                _ => format!("there is no `{scheme}` backend"),
            };
            bail!(
                "backend `{spec}` is not a file, and `{scheme}:` is not a backend scheme ({hint}); \
                 backends are a file or block device path, memory:SIZE, nbd://, nbd+unix://, \
                 nbds://, nbds+unix:// or s3://"
            );
        }
    }
    let create_length = args
        .create_size
        .or(is_default.then_some(DEFAULT_BACKING_SIZE_BYTES));
    if !path.exists() && create_length.is_none() {
        bail!("backend `{spec}` does not exist; pass --create-size SIZE to create it, or use memory:SIZE");
    }
    let mut options = FileDeviceOptions {
        direct: args.direct,
        read_only: args.read_only,
        create_length_bytes: create_length,
        set_length_bytes: None,
        io_threads: args.file_io_threads,
        io_uring_depth: args.file_io_uring_depth,
    };
    let device = match FileDevice::open(path, &options) {
        // A file this process may only read is served read-only (as nbdkit's file plugin
        // does), not refused: the export then says READ_ONLY.
        Err(bufcache::device::FileDeviceError::Open { source, .. })
            if path.exists() && !args.read_only && refuses_writing(&source) =>
        {
            say!("backend `{spec}` cannot be opened for writing ({source}): serving it read-only");
            options.read_only = true;
            FileDevice::open(path, &options)?
        }
        opened => opened?,
    };
    let lock = BackendLock::acquire(path)?;
    let absolute = std::fs::canonicalize(path)
        .with_context(|| format!("backend `{spec}`: resolving its absolute path"))?;
    let name = format!("file:{}", absolute.display());
    // The id goes on the file only once the checks against what it had passed, so a refused
    // start changes nothing; a file system without user extended attributes names the file
    // by its path.
    let is_regular = std::fs::metadata(&absolute).is_ok_and(|metadata| metadata.is_file());
    let recorded_id = if is_regular {
        rescue::read_file_disk_id(&absolute).with_context(|| {
            format!(
                "backend `{spec}`: reading its disk id ({})",
                rescue::FILE_DISK_ID_ATTRIBUTE
            )
        })?
    } else {
        None
    };
    let proposed_id = recorded_id.unwrap_or_else(bufcache_s3::new_disk_id);
    let identity = BackendIdentity {
        identity: match recorded_id {
            Some(id) => rescue::file_disk_identity(id),
            None if options.read_only || !is_regular => name.clone(),
            None => rescue::file_disk_identity(proposed_id),
        },
        name: name.clone(),
        state: None,
    };
    check_before_writing(args, export, &identity, Some(device.len()))?;
    let identity = if recorded_id.is_none() && !options.read_only && is_regular {
        match rescue::write_file_disk_id(&absolute, proposed_id) {
            Ok(()) => identity,
            Err(error) => {
                say!("backend `{spec}`: cannot record a disk id on it ({error}): it is named by its path, so a rescue file or local cache of another image put at this path cannot be told apart");
                BackendIdentity {
                    identity: name.clone(),
                    name,
                    state: None,
                }
            }
        }
    } else {
        identity
    };
    Ok(PreparedBackend::Opened(OpenedBackend {
        device: Arc::new(device),
        upstream: None,
        identity: Some(identity),
        s3: None,
        store: None,
        _lock: Some(lock),
        standby: None,
    }))
}

/// True when opening for writing failed only because writing is not allowed.
fn refuses_writing(error: &std::io::Error) -> bool {
    error.kind() == std::io::ErrorKind::PermissionDenied
        || error.raw_os_error() == Some(libc::EROFS)
}

/// The scheme of a backend spelled like a URL (`http://x`, `nbd:/host`, `foo:`), if it is one:
/// letters first, then letters, digits, `+`, `-` or `.`, then a colon.
fn url_scheme(spec: &str) -> Option<String> {
    let (scheme, _) = spec.split_once(':')?;
    let mut characters = scheme.chars();
    let first = characters.next()?;
    (first.is_ascii_alphabetic()
        && characters.all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c)))
    .then(|| scheme.to_ascii_lowercase())
}

fn export_specs(args: &ServeArgs) -> anyhow::Result<Vec<(String, String, bool)>> {
    let mut specs = Vec::new();
    for export in &args.exports {
        let (name, backend) = export
            .split_once('=')
            .with_context(|| format!("--export `{export}` is not NAME=BACKEND"))?;
        specs.push((name.to_string(), backend.to_string(), false));
    }
    let name = args.export_name.clone().unwrap_or_default();
    match (&args.backend, specs.is_empty()) {
        (Some(backend), _) => specs.push((name, backend.clone(), false)),
        (None, true) => specs.push((name, DEFAULT_BACKING_FILE.to_string(), true)),
        (None, false) if args.export_name.is_some() => {
            bail!("--export-name names the --backend export; with only --export NAME=BACKEND, put the name there")
        }
        (None, false) => {}
    }
    Ok(specs)
}

/// Writes back everything dirty and flushes, retrying while the backend fails until `give_up`
/// is set: a backend that recovers in time loses nothing. The caller decides when to give up
/// (the shutdown timeout) and saves what is still dirty to the rescue file.
/// The last failure is kept in `last_error` for the final message if the caller gives up first.
fn sync_with_retries(
    cache: &Cache,
    give_up: &AtomicBool,
    last_error: &std::sync::Mutex<Option<String>>,
) -> Result<(), CacheError> {
    loop {
        match cache.sync() {
            Ok(()) => return Ok(()),
            Err(error) if give_up.load(Ordering::Acquire) => return Err(error),
            Err(error) => {
                if let Ok(mut last) = last_error.lock() {
                    *last = Some(error.to_string());
                }
                say!("write-back failed, retrying until the shutdown timeout: {error}");
                std::thread::sleep(Duration::from_millis(500));
            }
        }
    }
}

/// What the main thread waits for once serving has started.
enum Event {
    /// SIGINT or SIGTERM arrived.
    Signal(i32),
    /// The server stopped accepting and its connections ended.
    Served(Result<(), bufcache_nbd::ServerError>),
    /// Shutdown write-back finished (or gave up).
    Synced(Result<(), CacheError>),
    /// The --run command exited with this status (shell convention: 128+N for signal N).
    CaptiveExited(i32),
    /// A warm standby's writable open of export `index` returned: it took the disk over (or
    /// failed).
    TakenOver(
        usize,
        Box<Result<bufcache_s3::S3Device, bufcache_s3::OpenError>>,
    ),
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    if args.standby && args.read_only {
        return Err(crate::UsageError(
            "--standby waits to take the disk over and write it, and -r never writes: for a server that follows the writer read-only, use -r with follow=SECONDS in the URL".into(),
        )
        .into());
    }
    if args.fork {
        return Err(crate::UsageError(
            "--fork: bufcache serve always stays in the foreground; start it from a service \
             manager (docs/operations.md) or with `&`, and use --pid-file to find it"
                .into(),
        )
        .into());
    }
    if !(0.0..=86_400.0).contains(&args.shutdown_timeout) {
        bail!(
            "--shutdown-timeout {} is invalid: must be from 0 to 86400 seconds",
            args.shutdown_timeout
        );
    }
    if let Some(blocks) = args.local_cache_sampled_blocks {
        if blocks > bufcache_tier::config::SAMPLED_BLOCKS_LIMIT {
            bail!(
                "--local-cache-sampled-blocks {blocks} is invalid: must be from 0 to {}",
                bufcache_tier::config::SAMPLED_BLOCKS_LIMIT
            );
        }
    }
    if let Some(seconds) = args.local_cache_stall_max {
        if !(seconds > 0.0 && seconds <= 86_400.0) {
            bail!("--local-cache-stall-max {seconds} is invalid: must be above 0 and at most 86400 seconds");
        }
    }
    for (flag, value) in [
        ("--reconnect-delay-initial", args.reconnect_delay_initial),
        ("--reconnect-delay-max", args.reconnect_delay_max),
        ("--reconnect-give-up", args.reconnect_give_up),
    ] {
        if !(0.0..=86_400.0 * 365.0).contains(&value) {
            bail!("{flag} {value} is invalid: must be from 0 to 31536000 seconds");
        }
    }
    if args.create_size == Some(0) {
        bail!("--create-size 0 is invalid: an export needs at least one byte");
    }
    let config = args.engine.config()?;
    let block_size = args.engine.block_size_bytes(&config)?;
    // Checked here, before any disk is opened for writing; each export's queue is made later.
    args.engine.queue_config(&config)?;
    let mut server_config = ServerConfig::default();
    let mut listen = args.listen.clone();
    if args.port.is_some() || args.bind.is_some() {
        let host = match args.bind.as_deref() {
            None => "127.0.0.1".to_string(),
            Some(host) if host.contains(':') && !host.starts_with('[') => format!("[{host}]"),
            Some(host) => host.to_string(),
        };
        listen.push(ListenAddress::Tcp(format!(
            "{host}:{}",
            args.port.unwrap_or(10809)
        )));
    }
    if let Some(path) = &args.unix {
        listen.push(ListenAddress::Unix(path.clone()));
    }
    let inherited = crate::daemon::inherited_sockets()?;
    if inherited.is_some() && !listen.is_empty() {
        bail!("started by systemd socket activation (LISTEN_FDS), which passes the listening sockets: --listen, --port and --unix cannot be used too");
    }
    if args.run.is_some() && listen.is_empty() && inherited.is_none() {
        listen.push(ListenAddress::Unix(crate::daemon::private_socket_path()?));
    }
    if !listen.is_empty() {
        server_config.listen = listen;
    }
    if let Some(size) = args.request_size_max {
        if !(4096..=1 << 30).contains(&size) {
            bail!("--request-size-max {size} is invalid: must be from 4KiB to 1GiB");
        }
        server_config.request_size_max = size as u32;
        server_config.connection_inflight_bytes_max =
            server_config.connection_inflight_bytes_max.max(size);
    }
    args.limits
        .apply(&mut server_config, config.memory_bytes_max);
    args.tls.apply(&mut server_config);
    server_config.validate()?;
    let observers = crate::observe::Observers::start(
        &args.observe,
        config.policy,
        &config.policy_parameters,
        config.memory_bytes_max,
        u64::from(block_size),
    )?;
    let cache = bufcache_host::system_cache(config)?;
    let mut exports: Vec<(String, Arc<dyn Export>)> = Vec::new();
    let mut meters = Vec::new();
    let mut objects: Vec<(String, ObjectHandle)> = Vec::new();
    let specs = export_specs(&args)?;
    if args.standby_warm_bytes_max.is_some() && !args.standby {
        return Err(crate::UsageError(
            "--standby-warm-bytes-max bounds what a --standby server reads into its cache while it waits, and --standby is not given".into(),
        )
        .into());
    }
    if args.standby {
        if let Some((_, backend, _)) = specs
            .iter()
            .find(|(_, backend, _)| !backend.starts_with("s3://"))
        {
            return Err(crate::UsageError(format!("--standby takes over an S3 log-layout disk when its writer's lease lapses, and backend `{backend}` is not an s3:// disk")).into());
        }
    }
    let is_file = |spec: &str| {
        ![
            "memory:",
            "nbd://",
            "nbd+unix://",
            "nbds://",
            "nbds+unix://",
            "s3://",
        ]
        .iter()
        .any(|prefix| spec.starts_with(prefix))
    };
    if args.file_io_threads > 0 && args.file_io_uring_depth > 0 {
        bail!(
            "--file-io-threads and --file-io-uring-depth are two ways to do a file's requests; \
             give one of them"
        );
    }
    if !specs.iter().any(|(_, backend, _)| is_file(backend)) {
        if args.direct {
            bail!("--direct opens backing files with O_DIRECT, and no backend is a file");
        }
        if args.create_size.is_some()
            && !specs
                .iter()
                .any(|(_, backend, _)| backend.starts_with("s3://"))
        {
            bail!("--create-size creates a backing file or S3 disk, and no backend is either");
        }
        if args.file_io_threads > 0 {
            bail!("--file-io-threads gives backing files worker threads, and no backend is a file");
        }
        if args.file_io_uring_depth > 0 {
            bail!(
                "--file-io-uring-depth gives backing files an io_uring, and no backend is a file"
            );
        }
    }
    if args.local_cache.is_none() {
        if args.local_cache_size.is_some() {
            bail!("--local-cache-size sizes the --local-cache file, and no --local-cache is given");
        }
        if args.flush_to == Some(FlushToArg::Local) {
            bail!("--flush-to local needs a --local-cache to flush to");
        }
        if args.local_cache_stall_max.is_some() {
            bail!("--local-cache-stall-max bounds waits of a --local-cache, and no --local-cache is given");
        }
        if args.local_cache_replay_prefix {
            bail!("--local-cache-replay-prefix replays a damaged --local-cache, and no --local-cache is given");
        }
    } else if specs.len() != 1 {
        bail!("--local-cache belongs to one backend, and {} exports are given: serve one export per local cache", specs.len());
    }
    let mut rescuable: Vec<rescue::Backend> = Vec::new();
    let mut tiers: Vec<Arc<ServeTier>> = Vec::new();
    let mut backend_locks = Vec::new();
    let mut counters: Vec<Arc<CountingDevice<Arc<dyn Device>>>> = Vec::new();
    let mut s3_devices: Vec<(String, Arc<bufcache_s3::S3Device>)> = Vec::new();
    // Everything that can refuse the start without writing to a disk is checked, and every
    // listen address bound (they listen only once the exports are ready, so a client or a
    // readiness probe that connects is served), before the first disk is written to:
    // opening an S3 disk for writing
    // takes its lock and raises its generation, so a start refused after that (another
    // export that does not open, an address in use) would leave the store changed and the
    // disk's rescue file stale.
    for (policy_export, _) in &server_config.export_policies {
        if !specs.iter().any(|(name, _, _)| name == policy_export) {
            clap::Error::raw(
                clap::error::ErrorKind::ValueValidation,
                format!(
                    "--export-identity / --export-read-only name {policy_export:?}, which is not an export\n"
                ),
            )
            .exit();
        }
    }
    if let Some(path) = &args.pid_file {
        crate::daemon::check_pid_file(path)?;
    }
    let mut prepared = Vec::with_capacity(specs.len());
    for (name, backend, is_default) in specs {
        let backend_prepared = prepare_backend(&backend, &args, is_default, &name)?;
        if let PreparedBackend::Opened(opened) = &backend_prepared {
            if opened.device.is_empty() {
                bail!("backend `{backend}` is empty (0 bytes): there is nothing to export");
            }
        }
        prepared.push((name, backend, backend_prepared));
    }
    // Signals are handled before the sockets listen: a client can connect (into the
    // kernel's backlog) as soon as they do, and a supervisor that probes the port and then
    // sends SIGTERM, or anyone told the server is up (pid file, READY=1, the listening lines),
    // must get a clean shutdown, not the default action's kill.
    let shutdown = ShutdownHandle::new();
    let (events, event_receiver) = mpsc::channel();
    install_signal_handlers(shutdown.clone(), events.clone())?;
    let listeners = match inherited {
        Some(sockets) => bufcache_nbd::Listeners::inherited(sockets)?,
        None => bufcache_nbd::Listeners::bind(&server_config)?,
    };
    let mut metrics_listener = args.metrics.as_deref().map(metrics::bind).transpose()?;
    if args.control.is_some() && args.local_cache.is_some() {
        bail!("--control takes snapshots of a disk as its store has it, and with --local-cache acknowledged writes may be only in the local cache: serve without one to take snapshots");
    }
    let control = args
        .control
        .as_deref()
        .map(crate::control::bind)
        .transpose()?;
    // Warm standbys: (export, its warming, its cache object, index in `rescuable`).
    let mut standbys: Vec<(
        String,
        Arc<crate::standby::WarmStandby>,
        ObjectHandle,
        usize,
    )> = Vec::new();
    for (index, (name, backend, backend_prepared)) in prepared.into_iter().enumerate() {
        let OpenedBackend {
            device,
            upstream,
            store,
            identity,
            s3,
            _lock: lock,
            standby,
        } = backend_prepared.open(&events, index)?;
        let lease = s3.as_ref().and_then(|device| device.lease());
        let replica = s3.as_ref().and_then(|device| device.replica().cloned());
        // With a local cache the cache keeps what the log layout has not uploaded (its epoch
        // is written back only once the backend flushed it): only without one is it saved
        // from the device at shutdown.
        if args.local_cache.is_none() {
            s3_devices.extend(s3.map(|device| (name.clone(), device)));
        }
        backend_locks.extend(lock);
        let counting = Arc::new(CountingDevice::new(device));
        let mut tier = None;
        let mut above_backend = Arc::clone(&counting) as Arc<dyn Device>;
        if let Some(path) = &args.local_cache {
            let Some(identity) = &identity else {
                bail!("--local-cache {}: backend `{backend}` lives in memory and does not outlive the process, so there is nothing to keep a local cache of", path.display());
            };
            let (opened, lock) = open_local_tier(&args, path, above_backend, identity)?;
            // Held until the process ends, not released with the backend locks at shutdown:
            // the tier's write-back thread may still be writing its checkpoint until then.
            std::mem::forget(lock);
            tiers.push(Arc::clone(&opened));
            above_backend = Arc::clone(&opened) as Arc<dyn Device>;
            tier = Some(opened);
        }
        let (device, queue) = args.engine.queue_device(above_backend, cache.config())?;
        counters.push(Arc::clone(&counting));
        let requests = Arc::new(RequestMeters::default());
        let meters_index = meters.len();
        meters.push(ExportMeters {
            name: name.clone(),
            requests: Arc::clone(&requests),
            device: counting,
            queue,
            upstream,
            tier,
            store,
            standby: None,
        });
        let mut object_config = ObjectConfig::new(
            if name.is_empty() {
                backend.clone()
            } else {
                name.clone()
            },
            device,
        );
        object_config.block_size_bytes = block_size;
        object_config.read_only = args.read_only;
        let object = cache.open_object(object_config)?;
        if object.is_empty() {
            bail!("backend `{backend}` is empty (0 bytes): there is nothing to export");
        }
        tracing::info!(export = %name, backend = %backend, size = %format_size(object.len()), "export ready");
        say!("export {:?} = {} ({} bytes)", name, backend, object.len());
        if let Some(standby) = standby {
            let warm = crate::standby::WarmStandby::start(
                Arc::clone(&standby),
                object.reopen(),
                args.standby_warm_bytes_max
                    .unwrap_or(STANDBY_WARM_BYTES_MAX_DEFAULT),
            )?;
            meters[meters_index].standby = Some(Arc::clone(&warm));
            standbys.push((name.clone(), warm, object.reopen(), rescuable.len()));
        }
        if let Some(identity) = identity {
            rescuable.push(rescue::Backend {
                export: name.clone(),
                identity: identity.identity,
                name: identity.name,
                size_bytes: object.len(),
                block_size_bytes: object.block_size(),
                state: identity.state,
            });
        }
        objects.push((name.clone(), object.reopen()));
        if let Some(replica) = replica {
            // A refresh that maps a range anew makes the cache read it again.
            let handle = object.reopen();
            replica.set_on_change(Arc::new(move |offset, length| {
                handle.forget_clean(offset, length)
            }));
        }
        let mut cache_export = CacheExport::new(object);
        if let Some(lease) = lease {
            cache_export = cache_export.with_gate(Arc::new(LeaseGate(lease)));
        }
        if let Some((_, warm, _, _)) = standbys.last().filter(|(export, ..)| *export == name) {
            cache_export = cache_export.with_gate(Arc::new(StandbyGate(Arc::clone(&warm.standby))));
        }
        let export = MeteredExport::wrap(
            crate::observe::wrap(&observers, exports.len(), Arc::new(cache_export)),
            requests,
        );
        exports.push((name, export));
    }
    let mut meters = Some(meters);
    // A standby faults its cache's memory in while it waits, not after it took the disk.
    let mut background_prefault = None;
    if !standbys.is_empty() {
        background_prefault = start_prefault(&args, &cache, &objects);
    }
    if !standbys.is_empty() {
        // A standby shows /metrics while it waits (its role, the writer's lease as it sees
        // it, its lag, its warming); it listens for clients only once it writes.
        if let (Some(listener), Some(meters)) = (metrics_listener.take(), meters.take()) {
            start_metrics(listener, &cache, meters, &observers)?;
        }
        let mut waiting = standbys.len();
        while waiting > 0 {
            match event_receiver.recv() {
                Ok(Event::TakenOver(index, opened)) => {
                    let writer = (*opened)?;
                    let Some((name, warm, object, rescue_index)) =
                        standbys.iter().find(|(name, ..)| {
                            exports.get(index).is_some_and(|(export, _)| export == name)
                        })
                    else {
                        continue;
                    };
                    let state = writer.state();
                    let cached_before = cache.stats().memory_used_bytes;
                    let dropped = warm.take_over(writer, object);
                    if let Some(writer) = warm.standby.writer() {
                        s3_devices.push((name.clone(), Arc::clone(writer)));
                    }
                    if let Some(backend) = rescuable.get_mut(*rescue_index) {
                        backend.state = Some(state.generation);
                    }
                    say!(
                        "export {name:?}: took the disk over with its cache warm ({} cached; {dropped} ranges the writer changed since the last refresh dropped, {} read ahead while standing by)",
                        format_size(cached_before),
                        format_size(warm.warm_bytes())
                    );
                    waiting -= 1;
                }
                Ok(Event::Signal(signal)) => {
                    say!("signal {signal} while standing by: exiting; nothing was written to the disk (its standby registration lapses with its lease)");
                    return Ok(());
                }
                Ok(_) => {}
                Err(_) => bail!("the standby's threads ended without taking the disk over"),
            }
        }
    }
    let mut rescue_targets = rescue_targets(&args, rescuable)?;
    for target in &rescue_targets {
        handle_rescue_file(&args, target, &cache, &objects)?;
    }
    if standbys.is_empty() {
        background_prefault = start_prefault(&args, &cache, &objects);
    }
    let server = match Server::new(server_config, exports) {
        Err(bufcache_nbd::ServerError::PolicyForUnknownExport(name)) => clap::Error::raw(
            clap::error::ErrorKind::ValueValidation,
            format!(
                "--export-identity / --export-read-only name {name:?}, which is not an export\n"
            ),
        )
        .exit(),
        server => server?,
    };
    let server = server.with_listeners(listeners)?;
    if let Some(bound) = control {
        let disks = s3_devices
            .iter()
            .filter_map(|(name, device)| {
                let (_, object) = objects.iter().find(|(export, _)| export == name)?;
                Some(crate::control::Held {
                    device: Arc::clone(device),
                    object: object.reopen(),
                })
            })
            .collect();
        let cache = cache.clone();
        crate::control::start(
            bound,
            disks,
            Box::new(move || cache.sync().map_err(|error| error.to_string())),
        )?;
        let path = args.control.as_deref().unwrap_or(Path::new("")).display();
        say!("control socket on {path}   (try: bufcache disk snapshot URL NAME --control {path}, or disk resize URL SIZE --control {path})");
    }
    if let (Some(listener), Some(meters)) = (metrics_listener, meters) {
        start_metrics(listener, &cache, meters, &observers)?;
    }
    if args.exit_with_parent {
        crate::daemon::exit_with_parent()?;
    }
    let addresses = server.local_addrs();
    for address in &addresses {
        let plain = address.uri("");
        say!(
            "listening on {}   (try: nbdinfo '{}')",
            address_text(address),
            args.tls.client_uri(&plain).unwrap_or(plain)
        );
    }
    let default_export = args.export_name.clone().unwrap_or_default();
    let client_uri = addresses.first().map(|address| {
        let plain = address.uri(&default_export);
        args.tls.client_uri(&plain).unwrap_or(plain)
    });
    if args.print_uri {
        if let Some(uri) = &client_uri {
            let mut stdout = std::io::stdout().lock();
            let _ = writeln!(stdout, "{uri}").and_then(|()| stdout.flush());
        }
    }
    if let Some(path) = &args.pid_file {
        crate::daemon::write_pid_file(path)?;
    }
    if let Err(error) = crate::daemon::notify("READY=1") {
        say!("cannot notify the service manager (NOTIFY_SOCKET) of readiness: {error}");
    }
    if let Some(command) = &args.run {
        start_captive(
            command,
            client_uri.as_deref(),
            &addresses,
            shutdown.clone(),
            events.clone(),
        )?;
    }
    let stop_writer = Arc::new(AtomicBool::new(false));
    let writer = start_background_writer(cache.clone(), Arc::clone(&stop_writer));
    let give_up = Arc::new(AtomicBool::new(false));
    let last_error = Arc::new(std::sync::Mutex::new(None::<String>));
    // Serving and the shutdown write-back run on their own thread, so the main thread can
    // end the process at the deadline whatever a hung backend does to them.
    {
        let cache = cache.clone();
        let give_up = Arc::clone(&give_up);
        let last_error = Arc::clone(&last_error);
        std::thread::Builder::new()
            .name("bufcache-serve".into())
            .spawn(move || {
                let served = server.run(shutdown);
                let _ = events.send(Event::Served(served));
                if let Some(background) = background_prefault {
                    background.stop();
                }
                stop_writer.store(true, Ordering::Release);
                writer.thread().unpark();
                let _ = writer.join();
                say!("shutting down: writing back dirty data");
                let _ = events.send(Event::Synced(sync_with_retries(
                    &cache,
                    &give_up,
                    &last_error,
                )));
            })
            .context("starting the server thread")?;
    }
    let timeout = Duration::from_secs_f64(args.shutdown_timeout);
    let mut deadline: Option<Instant> = None;
    let mut serve_error: Option<bufcache_nbd::ServerError> = None;
    let mut captive_status: Option<i32> = None;
    let outcome = loop {
        let event = match deadline {
            None => event_receiver.recv().ok(),
            Some(deadline) => {
                match event_receiver
                    .recv_timeout(deadline.saturating_duration_since(Instant::now()))
                {
                    Ok(event) => Some(event),
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        say!("shutdown timeout ({timeout:?}) reached");
                        break None;
                    }
                    Err(mpsc::RecvTimeoutError::Disconnected) => None,
                }
            }
        };
        match event {
            Some(Event::Signal(signal)) if deadline.is_none() => {
                deadline = Some(Instant::now() + timeout);
                let _ = crate::daemon::notify("STOPPING=1");
                say!("signal {signal}: finishing in-flight requests and writing back (up to {timeout:?})");
            }
            Some(Event::Signal(signal)) if cache.stats().dirty_bytes == 0 => {
                // Nothing to save: what is left of the shutdown is a flush, a moment away on a
                // healthy backend. Wait for it briefly rather than report it missing.
                let grace = Instant::now() + SECOND_SIGNAL_GRACE;
                deadline = deadline.map(|deadline| deadline.min(grace));
                say!("second signal {signal}: nothing is dirty; waiting up to {SECOND_SIGNAL_GRACE:?} for the backends' flush");
            }
            Some(Event::Signal(signal)) => {
                say!("second signal {signal}: saving dirty data to the rescue file now");
                break None;
            }
            Some(Event::Served(result)) => {
                deadline.get_or_insert_with(|| Instant::now() + timeout);
                serve_error = result.err();
            }
            Some(Event::Synced(result)) => break Some(result),
            Some(Event::CaptiveExited(code)) => {
                captive_status = Some(code);
                if deadline.is_none() {
                    deadline = Some(Instant::now() + timeout);
                    let _ = crate::daemon::notify("STOPPING=1");
                    say!("--run command exited with status {code}: finishing in-flight requests and writing back (up to {timeout:?})");
                }
            }
            // Every standby took its disk over before serving started.
            Some(Event::TakenOver(..)) => {}
            None => break None,
        }
    };
    give_up.store(true, Ordering::Release);
    match outcome {
        Some(Ok(())) => {
            // Everything is written back: other servers may now open the S3 disks.
            bufcache_s3::release_locks();
            for target in rescue_targets.drain(..) {
                target.lock.release();
            }
            drop(backend_locks);
            if let Some(error) = serve_error {
                return Err(error).context("serving");
            }
            for tier in &tiers {
                let stats = tier.stats();
                if stats.dirty_bytes > 0 {
                    say!(
                        "{}: {} in {} flush epochs is in the local cache, not yet on the backend: the next start writes it back",
                        tier.describe(),
                        bufcache::device::size::format_size_rounded(stats.dirty_bytes),
                        stats.epochs_pending
                    );
                }
            }
            say!("all data written back; bye");
            if let Some(code) = captive_status.filter(|code| *code != 0) {
                crate::daemon::cleanup();
                crate::log::exit(code);
            }
            Ok(())
        }
        Some(Err(error)) => {
            say!("writing back dirty data at shutdown failed: {error}");
            rescue_and_exit(rescue_targets, &objects, &s3_devices, &counters)
        }
        None => {
            match last_error.lock().ok().and_then(|last| last.clone()) {
                Some(error) => say!("writing back dirty data at shutdown failed: {error}"),
                None => say!(
                    "writing back dirty data at shutdown did not finish (backend not answering)"
                ),
            }
            rescue_and_exit(rescue_targets, &objects, &s3_devices, &counters)
        }
    }
}

/// One rescue file this server may write: its path, the backends it holds data for, and the
/// lock that makes it this server's alone.
struct RescueTarget {
    path: PathBuf,
    backends: Vec<rescue::Backend>,
    lock: rescue::RescueLock,
}

/// The rescue files of this server, locked: `--rescue-file` for every export, or by default one
/// file per export derived from its backend. Memory backends have none (they end with the
/// process). A second server on the same backend fails here, naming the first one's pid.
fn rescue_targets(
    args: &ServeArgs,
    rescuable: Vec<rescue::Backend>,
) -> anyhow::Result<Vec<RescueTarget>> {
    let describe = |backends: &[rescue::Backend]| {
        backends
            .iter()
            .map(|backend| format!("export {:?} on {}", backend.export, backend.identity))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut targets = Vec::new();
    if let Some(path) = &args.rescue_file {
        let lock = rescue::RescueLock::acquire(path, &describe(&rescuable))?;
        targets.push(RescueTarget {
            path: path.clone(),
            backends: rescuable,
            lock,
        });
        return Ok(targets);
    }
    if !rescuable.is_empty() && Path::new(rescue::LEGACY_PATH).exists() {
        bail!(
            "found rescue file {legacy}, saved by an older bufcache serve without the identity of              its backend: if it belongs to this server's backend, start once with --rescue-file              {legacy} to replay it (or add --rescue discard to drop it)",
            legacy = rescue::LEGACY_PATH
        );
    }
    for backend in rescuable {
        let path = rescue::default_path(&backend.export, &backend.name);
        let lock = rescue::RescueLock::acquire(&path, &describe(std::slice::from_ref(&backend)))?;
        targets.push(RescueTarget {
            path,
            backends: vec![backend],
            lock,
        });
    }
    warn_of_other_rescue_files(&targets);
    Ok(targets)
}

/// Says which rescue files in the working directory belong to other backends (a backend named
/// another way, say a relative socket path, has another file): their data is not replayed
/// here, and nobody should think it was.
fn warn_of_other_rescue_files(targets: &[RescueTarget]) {
    let Ok(entries) = std::fs::read_dir(".") else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with("bufcache-") || !name.ends_with(".rescue") {
            continue;
        }
        if targets.iter().any(|target| target.path == Path::new(&name)) {
            continue;
        }
        let owners = match rescue::read(Path::new(&name)) {
            Ok(contents) => contents
                .backends
                .unwrap_or_default()
                .iter()
                .map(|backend| format!("export {:?} on {}", backend.export, backend.identity))
                .collect::<Vec<_>>()
                .join(", "),
            Err(error) => format!("unreadable: {error:#}"),
        };
        say!(
            "rescue file {name} holds unwritten data of another backend ({owners}); it is not \
             replayed here: start a server on that backend (spelled the same way) to replay it"
        );
    }
}

/// Saves every dirty block of every export to its rescue file and ends the process at once
/// (threads stuck on a hung backend are not waited for): exit status 3 when everything dirty
/// was saved, 1 when some could not be (named in the last line).
fn rescue_and_exit(
    targets: Vec<RescueTarget>,
    objects: &[(String, ObjectHandle)],
    s3_devices: &[(String, Arc<bufcache_s3::S3Device>)],
    counters: &[Arc<CountingDevice<Arc<dyn Device>>>],
) -> ! {
    crate::daemon::cleanup();
    let mut saved_bytes = 0u64;
    let mut saved_records = 0usize;
    let mut unreadable_bytes = 0u64;
    let mut lost_bytes = 0u64;
    let mut failures = Vec::new();
    let mut saved_paths = Vec::new();
    let mut undurable_unknown = false;
    for target in &targets {
        let mut records = Vec::new();
        for backend in &target.backends {
            // First what the device acknowledged but holds only in memory (older than any
            // dirty block of the cache, so replayed first).
            if let Some((name, device)) =
                s3_devices.iter().find(|(name, _)| *name == backend.export)
            {
                match undurable_extents(device) {
                    Some((extents, unreadable)) => {
                        unreadable_bytes += unreadable;
                        records.extend(extents.into_iter().map(|(offset, data)| rescue::Record {
                            export: name.clone(),
                            offset,
                            data,
                        }));
                    }
                    None => {
                        say!("export {name:?}: the object store's layout did not answer in time: the writes it held only in memory are not saved");
                        undurable_unknown = true;
                    }
                }
            }
            let Some((name, object)) = objects.iter().find(|(name, _)| *name == backend.export)
            else {
                continue;
            };
            object.visit_dirty_blocks(Duration::from_secs(1), |offset, bytes| match bytes {
                Some(bytes) => records.push(rescue::Record {
                    export: name.clone(),
                    offset,
                    data: bytes.to_vec(),
                }),
                None => unreadable_bytes += object.block_size() as u64,
            });
        }
        if records.is_empty() {
            continue;
        }
        let bytes: u64 = records.iter().map(|record| record.data.len() as u64).sum();
        // Sizes as they are now: a disk grown while served (the control socket) is that
        // size when it opens again.
        let backends: Vec<rescue::Backend> = target
            .backends
            .iter()
            .map(|backend| rescue::Backend {
                size_bytes: objects
                    .iter()
                    .find(|(name, _)| *name == backend.export)
                    .map_or(backend.size_bytes, |(_, object)| object.len()),
                ..backend.clone()
            })
            .collect();
        match rescue::write(&target.path, &backends, &records) {
            Ok(()) => {
                saved_bytes += bytes;
                saved_records += records.len();
                saved_paths.push(target.path.display().to_string());
            }
            Err(error) => {
                lost_bytes += bytes;
                failures.push(format!("{error:#}"));
            }
        }
    }
    let targets_empty = targets.is_empty();
    // Only now may another server take these files: the writes above are complete.
    for target in targets {
        target.lock.release();
    }
    if targets_empty {
        // Only memory backends: their data ends with the process whatever is done here.
        say!("all exports are in memory; their data ends with the process; bye");
        crate::log::exit(0);
    }
    if !failures.is_empty() {
        say!(
            "LOST {lost_bytes} bytes of dirty data: saving them to the rescue file failed: {}",
            failures.join("; ")
        );
        crate::log::exit(1);
    }
    let written_ever = counters.iter().any(|counting| {
        let stats = counting.stats();
        stats.writes.requests + stats.writes.errors + stats.discards + stats.other_errors > 0
    });
    if saved_bytes == 0 && unreadable_bytes == 0 && !written_ever {
        say!("nothing was written since start; bye");
        crate::log::exit(0);
    }
    if saved_bytes == 0 && unreadable_bytes == 0 {
        say!("no dirty data left, but the backend did not confirm a flush: data written last may not be durable");
        crate::log::exit(1);
    }
    if unreadable_bytes > 0 || undurable_unknown {
        say!(
            "saved {saved_bytes} bytes of dirty data to rescue file {}; LOST {unreadable_bytes} bytes held by requests that did not finish",
            saved_paths.join(", ")
        );
        crate::log::exit(1);
    }
    say!(
        "saved {saved_bytes} bytes of dirty data that could not be written back to rescue file {} ({saved_records} records); the next start replays them",
        saved_paths.join(", ")
    );
    crate::log::exit(EXIT_RESCUED);
}

/// Extents (offset, bytes) a device holds only in memory, and the bytes it could not read.
type Undurable = (Vec<(u64, Vec<u8>)>, u64);

/// What `device` holds only in memory (see [`bufcache_s3::S3Device::undurable_extents`]),
/// asked on a thread of its own so a layout stuck on the store cannot stop the shutdown: None
/// when it did not answer within 5 s.
fn undurable_extents(device: &Arc<bufcache_s3::S3Device>) -> Option<Undurable> {
    let (sender, receiver) = mpsc::channel();
    let device = Arc::clone(device);
    std::thread::Builder::new()
        .name("bufcache-rescue".into())
        .spawn(move || {
            let _ = sender.send(device.undurable_extents());
        })
        .ok()?;
    receiver.recv_timeout(Duration::from_secs(5)).ok()
}

/// Replays (or discards) a rescue file left by an earlier shutdown, before serving. A file
/// saved from another backend (or another size of it) is refused naming both.
fn handle_rescue_file(
    args: &ServeArgs,
    target: &RescueTarget,
    cache: &Cache,
    objects: &[(String, ObjectHandle)],
) -> anyhow::Result<()> {
    let path = &target.path;
    if !path.exists() {
        return Ok(());
    }
    let contents = rescue::read(path)?;
    let records = contents.records;
    let bytes: u64 = records.iter().map(|record| record.data.len() as u64).sum();
    if args.rescue == RescueAction::Discard {
        rescue::remove(path)?;
        say!(
            "--rescue discard: deleted rescue file {} ({bytes} bytes of unwritten data dropped)",
            path.display()
        );
        return Ok(());
    }
    // Each backend's disk and state were checked before it was opened (check_before_writing);
    // this catches an export the file names that this server does not have.
    for saved in contents.backends.iter().flatten() {
        let Some(ours) = target
            .backends
            .iter()
            .find(|ours| ours.export == saved.export)
        else {
            return Err(anyhow::Error::new(crate::BadInput(format!(
                "rescue file {} holds data of export {:?} on {}, which this server does not serve: nothing was replayed and the file is kept; start with that export to replay it",
                path.display(),
                saved.export,
                saved.identity
            ))));
        };
        let identity = BackendIdentity {
            identity: ours.identity.clone(),
            name: ours.name.clone(),
            state: ours.state,
        };
        // The same disk at the same size; its generation was checked before the disk was
        // opened (which raised it), so it is not checked again here.
        let force = true;
        if rescue::check_saved(saved, &identity, Some(ours.size_bytes), force).is_err() {
            return Err(anyhow::Error::new(crate::BadInput(format!(
                "rescue file {} was saved from {} (export {:?}, {} bytes), and this server's export {:?} is {} ({} bytes): refusing to replay it into another backend; nothing was replayed and the file is kept",
                path.display(),
                saved.identity,
                saved.export,
                saved.size_bytes,
                ours.export,
                ours.identity,
                ours.size_bytes
            ))));
        }
    }
    if let Err(error) = replay_records(path, cache, objects, &records) {
        // This start raised the disk's generation when it opened it, and nothing else has
        // written to the disk since (this server holds it): the file records that generation
        // now, so the next start replays it instead of refusing it as saved before the disk
        // moved on.
        let restamped: Vec<rescue::Backend> = contents
            .backends
            .iter()
            .flatten()
            .map(|saved| {
                let ours = target
                    .backends
                    .iter()
                    .find(|ours| ours.export == saved.export)
                    .expect("every saved backend was matched above");
                rescue::Backend {
                    identity: ours.identity.clone(),
                    state: ours.state.or(saved.state),
                    ..saved.clone()
                }
            })
            .collect();
        if contents.backends.is_some() {
            if let Err(restamp) = rescue::write(path, &restamped, &records) {
                say!(
                    "rescue file {}: recording the disk's new generation failed ({restamp}): the next start may need --rescue force to replay it",
                    path.display()
                );
            }
        }
        return Err(error);
    }
    rescue::remove(path)?;
    say!(
        "replayed rescue file {}: {bytes} bytes in {} records written back and flushed",
        path.display(),
        records.len()
    );
    Ok(())
}

/// Writes the rescue file's records to their exports and writes them back (the file is kept
/// when this fails).
fn replay_records(
    path: &Path,
    cache: &Cache,
    objects: &[(String, ObjectHandle)],
    records: &[rescue::Record],
) -> anyhow::Result<()> {
    for record in records {
        let Some((_, object)) = objects.iter().find(|(name, _)| *name == record.export) else {
            return Err(anyhow::Error::new(crate::BadInput(format!(
                "rescue file {} holds data for export {:?}, which this server does not have: nothing was replayed and the file is kept; start with that export to replay it",
                path.display(),
                record.export
            ))));
        };
        object
            .write_at(record.offset, &record.data, false)
            .with_context(|| {
                format!(
                    "replaying rescue file {}: export {:?} offset {}",
                    path.display(),
                    record.export,
                    record.offset
                )
            })?;
    }
    cache.sync().with_context(|| {
        format!(
            "replaying rescue file {}: writing its data back failed (the file is kept)",
            path.display()
        )
    })?;
    Ok(())
}

/// Starts the --run command (nbdkit's captive mode) with $uri, $socket and $port set; when
/// it exits, the server shuts down as on SIGTERM and `events` hears its status.
fn start_captive(
    command: &str,
    uri: Option<&str>,
    addresses: &[bufcache_nbd::BoundAddress],
    shutdown: ShutdownHandle,
    events: mpsc::Sender<Event>,
) -> anyhow::Result<()> {
    let mut child = std::process::Command::new("/bin/sh");
    child.arg("-c").arg(command);
    if let Some(uri) = uri {
        child.env("uri", uri);
    }
    for address in addresses {
        match address {
            bufcache_nbd::BoundAddress::Tcp(socket) => {
                child.env("port", socket.port().to_string());
            }
            bufcache_nbd::BoundAddress::Unix(path) => {
                child.env("socket", path);
            }
        }
    }
    let mut child = child
        .spawn()
        .with_context(|| format!("--run: cannot start `{command}`"))?;
    std::thread::Builder::new()
        .name("bufcache-run".into())
        .spawn(move || {
            use std::os::unix::process::ExitStatusExt;
            let code = match child.wait() {
                Ok(status) => status
                    .code()
                    .or_else(|| status.signal().map(|signal| 128 + signal))
                    .unwrap_or(1),
                Err(_) => 1,
            };
            shutdown.trigger();
            let _ = events.send(Event::CaptiveExited(code));
        })
        .context("starting the --run thread")?;
    Ok(())
}

fn address_text(address: &bufcache_nbd::BoundAddress) -> String {
    match address {
        bufcache_nbd::BoundAddress::Tcp(socket) => format!("tcp:{socket}"),
        bufcache_nbd::BoundAddress::Unix(path) => format!("unix:{}", path.display()),
    }
}

/// Runs `writeback_tick` periodically: aged dirty data and data above the background threshold.
fn start_background_writer(cache: Cache, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    let interval =
        (cache.config().dirty_age_max / 8).clamp(Duration::from_millis(50), Duration::from_secs(1));
    std::thread::Builder::new()
        .name("bufcache-writeback".into())
        .spawn(move || {
            // Parked between rounds, so shutdown can wake it at once (unpark).
            loop {
                std::thread::park_timeout(interval);
                if stop.load(Ordering::Acquire) {
                    return;
                }
                cache.writeback_tick();
            }
        })
        .expect("starting the write-back thread")
}

/// SIGINT/SIGTERM start the shutdown; a second one skips the wait. The thread only
/// triggers and forwards: it prints nothing, so no output failure can stop it.
fn install_signal_handlers(
    shutdown: ShutdownHandle,
    events: mpsc::Sender<Event>,
) -> anyhow::Result<()> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM])
        .context("installing signal handlers")?;
    std::thread::Builder::new()
        .name("bufcache-signals".into())
        .spawn(move || {
            for signal in signals.forever() {
                shutdown.trigger();
                if events.send(Event::Signal(signal)).is_err() {
                    return;
                }
            }
        })
        .context("starting the signal thread")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_parameter_that_only_says_how_to_reach_a_disk_changes_its_identity_or_rescue_file() {
        // Goal: break-lock=, create-size=, retry-timeout-ms=, lock=, gc*, segment-size= and
        // the endpoint never change which disk a rescue file or local cache belongs to, nor
        // the rescue file's name, while another prefix or another disk id does. Method: two
        // spellings of one S3 disk and of one NBD export, compared through the functions that
        // name them; older URL identities matched by bucket and prefix.
        let plain = bufcache_s3::S3Url::parse("s3://disks/vm/1?endpoint=http://a:9000").unwrap();
        let spelled = bufcache_s3::S3Url::parse(
            "s3://disks/vm/1/?endpoint=http://b:9000&break-lock=0a&create-size=1G\
             &retry-timeout-ms=5&lock=off&gc=off&gc-threshold=0.3&segment-size=16M",
        )
        .unwrap();
        assert_eq!(s3_disk_name(&plain), "s3://disks/vm/1");
        assert_eq!(s3_disk_name(&plain), s3_disk_name(&spelled));
        // The simulator's checker names its disks from URLs with this function: it must
        // agree with the server's parse.
        for url in [
            "s3://disks/vm/1?endpoint=http://a:9000",
            "s3://disks/vm/1/?break-lock=0a&create-size=1G&retry-timeout-ms=5",
        ] {
            let parsed = bufcache_s3::S3Url::parse(url).unwrap();
            assert_eq!(
                rescue::s3_name_of_url(url).as_deref(),
                Some(s3_disk_name(&parsed).as_str())
            );
        }
        assert_eq!(
            rescue::default_path("", &s3_disk_name(&plain)),
            rescue::default_path("", &s3_disk_name(&spelled))
        );
        let path = rescue::default_path("", &s3_disk_name(&spelled));
        assert!(
            !path.to_string_lossy().contains("create-size"),
            "{}",
            path.display()
        );
        let ours = BackendIdentity {
            identity: bufcache_s3::disk_identity(1),
            name: s3_disk_name(&plain),
            state: Some(3),
        };
        assert!(same_backend("s3-disk:0000000000000001", &ours));
        assert!(!same_backend("s3-disk:0000000000000002", &ours));
        assert!(same_backend(
            "s3://disks/vm/1?endpoint=http://a:9000&create-size=1G&break-lock=0a",
            &ours
        ));
        assert!(!same_backend(
            "s3://disks/vm/2?endpoint=http://a:9000",
            &ours
        ));
        assert_eq!(
            identity_of_url("nbd+unix:///vol?socket=/run/a.sock&tls-certificates=/etc/x"),
            "nbd+unix:///vol?socket=/run/a.sock"
        );
        assert_eq!(
            identity_of_url("nbd://host:10809/vol?psk=secret"),
            "nbd://host:10809/vol"
        );
        let nbd = BackendIdentity {
            identity: identity_of_url("nbd://host:10809/vol"),
            name: identity_of_url("nbd://host:10809/vol"),
            state: None,
        };
        assert!(same_backend("nbd://host:10809/vol?tls=on", &nbd));
        assert!(!same_backend("nbd://host:10809/other", &nbd));
    }
}
