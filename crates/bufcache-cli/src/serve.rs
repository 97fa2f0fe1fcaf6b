//! `bufcache serve`: exports backing stores through one shared buffer cache over NBD.
//!
//! Each export is a cache object over its backend device: a file or block device, `memory:SIZE`,
//! or an upstream NBD server (`nbd://HOST:PORT/EXPORT`, `nbd+unix:///EXPORT?socket=PATH`).
//! The process owns dirty data, so shutdown (SIGINT, SIGTERM) stops accepting, lets in-flight
//! requests finish, writes back everything dirty and flushes every backend before exiting 0;
//! if that write-back fails the error is printed and the exit status is 1.
//!
//! [`run`] is the composition root, in three steps: the flags checked ([`validate`]); each
//! export's backend prepared ([`backend`]) and, once every socket is bound, its stack built
//! ([`export_stack`]: the layers from the NBD server down to the backend's device); then
//! serving until shutdown ([`running`], with [`rescuing`] for the rescue files).

use std::path::PathBuf;
use std::sync::mpsc;
use std::time::Duration;

use bufcache::{parse_size, CacheError};
use bufcache_nbd::{ListenAddress, ShutdownHandle};
use clap::Args;

use crate::limit_args::LimitArgs;
use crate::prefault::PrefaultWhen;
use crate::rescue::RescueAction;
use crate::tls_args::TlsArgs;

mod backend;
mod export_stack;
mod rescuing;
mod running;
mod validate;

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
    engine: crate::engine_args::EngineArgs,
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

impl ServeArgs {
    /// The --listen addresses given (empty means the default).
    #[cfg(test)]
    pub fn listen_addresses(&self) -> &[ListenAddress] {
        &self.listen
    }
}

/// What a --standby server reads into its cache per follow round without
/// --standby-warm-bytes-max.
pub(crate) const STANDBY_WARM_BYTES_MAX_DEFAULT: u64 = 64 << 20;

/// What the main thread waits for once serving has started.
pub(super) enum Event {
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

/// Runs `bufcache serve`: checks the flags, prepares every backend (nothing written yet),
/// handles signals and binds every socket, builds each export's stack, then serves.
pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let validate::Validated {
        config,
        block_size,
        server_config,
        inherited,
        specs,
    } = validate::validate(&args)?;
    let observers = crate::observe::Observers::start(
        &args.observe,
        config.policy,
        &config.policy_parameters,
        config.memory_bytes_max,
        u64::from(block_size),
    )?;
    let cache = bufcache_host::system_cache(config)?;
    let mut prepared = Vec::with_capacity(specs.len());
    for spec in specs {
        let backend = backend::prepare_backend(&spec.backend, &args, spec.is_default, &spec.name)?;
        if let backend::PreparedBackend::Opened(opened) = &backend {
            if opened.device.is_empty() {
                anyhow::bail!(
                    "backend `{}` is empty (0 bytes): there is nothing to export",
                    spec.backend
                );
            }
        }
        prepared.push((spec, backend));
    }
    // Signals are handled before the sockets listen: a client can connect (into the
    // kernel's backlog) as soon as they do, and a supervisor that probes the port and then
    // sends SIGTERM, or anyone told the server is up (pid file, READY=1, the listening lines),
    // must get a clean shutdown, not the default action's kill.
    let shutdown = ShutdownHandle::new();
    let (events, event_receiver) = mpsc::channel();
    running::install_signal_handlers(shutdown.clone(), events.clone())?;
    let listeners = match inherited {
        Some(sockets) => bufcache_nbd::Listeners::inherited(sockets)?,
        None => bufcache_nbd::Listeners::bind(&server_config)?,
    };
    let metrics_listener = args
        .metrics
        .as_deref()
        .map(crate::metrics::bind)
        .transpose()?;
    let control = args
        .control
        .as_deref()
        .map(crate::control::bind)
        .transpose()?;
    let context = export_stack::StackContext {
        args: &args,
        cache: &cache,
        block_size,
        observers: &observers,
        events: &events,
    };
    let mut stacks = Vec::with_capacity(prepared.len());
    for (index, (spec, backend)) in prepared.into_iter().enumerate() {
        stacks.push(export_stack::ExportStack::build(
            &context, index, spec, backend,
        )?);
    }
    let started = running::Started {
        server_config,
        listeners,
        metrics_listener,
        control,
        shutdown,
        events,
        event_receiver,
        cache,
        observers,
    };
    running::serve(&args, started, stacks)
}
