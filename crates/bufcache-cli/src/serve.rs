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
use bufcache_nbd::{
    CacheExport, Export, ListenAddress, ReconnectPolicy, ReconnectingClient, Server, ServerConfig,
    ShutdownHandle,
};
use clap::Args;

use crate::engine_args::EngineArgs;
use crate::limit_args::LimitArgs;
use crate::metrics::{self, ExportMeters, Meters};
use crate::prefault::{self, PrefaultWhen};
use crate::rescue::{self, RescueAction};
use crate::tls_args::TlsArgs;

/// Exit status when dirty data was saved to the rescue file instead of the backend.
pub const EXIT_RESCUED: i32 = 3;

/// Prints a line on standard error, ignoring failure: a closed or broken stderr (a pipe
/// whose reader went away) must never stop the server from shutting down or saving data.
macro_rules! say {
    ($($argument:tt)*) => {{
        let _ = writeln!(std::io::stderr(), "bufcache: {}", format_args!($($argument)*));
    }};
}

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
    /// Listen on TCP port PORT of 127.0.0.1 (--listen tcp:127.0.0.1:PORT; use --listen
    /// tcp:0.0.0.0:PORT for every interface).
    #[arg(short = 'p', long, value_name = "PORT")]
    port: Option<u16>,
    /// Listen on the unix socket PATH (--listen unix:PATH).
    #[arg(short = 'U', long, value_name = "PATH")]
    unix: Option<PathBuf>,
    /// The export name of --backend (default: the empty name, which clients get without
    /// asking for one).
    #[arg(short = 'e', long, value_name = "NAME")]
    export_name: Option<String>,
    /// Write the server's process id to PATH once it accepts connections; removed at exit.
    #[arg(long, value_name = "PATH")]
    pid_file: Option<PathBuf>,
    /// Size of a backing file to create when it does not exist (the default file: 1G).
    #[arg(long, value_name = "SIZE", value_parser = |text: &str| parse_size(text).map_err(|e| e.to_string()))]
    create_size: Option<u64>,
    /// Refuse writes.
    #[arg(short = 'r', long)]
    read_only: bool,
    /// Open backing files with O_DIRECT (bypassing the host page cache).
    #[arg(long)]
    direct: bool,
    /// Largest NBD request in bytes (advertised maximum block size). Default 32M.
    #[arg(long, value_name = "SIZE", value_parser = |text: &str| parse_size(text).map_err(|e| e.to_string()))]
    request_size_max: Option<u64>,
    /// Seconds from SIGINT/SIGTERM to exit: in-flight requests finish and dirty data is written
    /// back, retrying while the backend fails. Data still dirty then (or at a second signal) is
    /// saved to the rescue file and the exit status is 3. Default 10.
    #[arg(long, value_name = "SECONDS", default_value_t = 10.0)]
    shutdown_timeout: f64,
    /// Where dirty data that could not be written back at shutdown is saved (see
    /// docs/operations.md for the format). Default ./bufcache.rescue.
    #[arg(long, value_name = "PATH", default_value = "bufcache.rescue")]
    rescue_file: PathBuf,
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
    /// Serve Prometheus metrics (/metrics) and JSON statistics (/stats) on HOST:PORT.
    #[arg(long, value_name = "HOST:PORT")]
    metrics: Option<String>,
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

impl ServeArgs {
    /// The --listen addresses given (empty means the default).
    #[cfg(test)]
    pub fn listen_addresses(&self) -> &[ListenAddress] {
        &self.listen
    }
}

/// A backend's device, and its upstream connection when it is an NBD server.
type OpenedBackend = (Arc<dyn Device>, Option<Arc<ReconnectingClient>>);

/// Opens the device a backend string names (and, for nbd://, the upstream connection too, for
/// its metrics).
fn open_backend(spec: &str, args: &ServeArgs, is_default: bool) -> anyhow::Result<OpenedBackend> {
    if let Some(size) = spec.strip_prefix("memory:") {
        let size = parse_size(size).with_context(|| format!("backend `{spec}`"))?;
        if size == 0 {
            bail!("backend `{spec}`: a memory backend needs a size above zero, like memory:1G");
        }
        return Ok((Arc::new(MemoryDevice::new(size)), None));
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
        return Ok((Arc::clone(&client) as Arc<dyn Device>, Some(client)));
    }
    if spec.starts_with("s3://") {
        let mut url = bufcache_s3::S3Url::parse(spec).map_err(bufcache_s3::OpenError::from)?;
        url.create_size_bytes = url.create_size_bytes.or(args.create_size);
        let store = bufcache_s3::ChunkStore::open_locked(&url)?;
        return Ok((Arc::new(bufcache_s3::S3Device::new(store)), None));
    }
    let path = Path::new(spec);
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
    Ok((Arc::new(device), None))
}

/// True when opening for writing failed only because writing is not allowed.
fn refuses_writing(error: &std::io::Error) -> bool {
    error.kind() == std::io::ErrorKind::PermissionDenied
        || error.raw_os_error() == Some(libc::EROFS)
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
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    if !(0.0..=86_400.0).contains(&args.shutdown_timeout) {
        bail!(
            "--shutdown-timeout {} is invalid: must be from 0 to 86400 seconds",
            args.shutdown_timeout
        );
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
    let mut server_config = ServerConfig::default();
    let mut listen = args.listen.clone();
    if let Some(port) = args.port {
        listen.push(ListenAddress::Tcp(format!("127.0.0.1:{port}")));
    }
    if let Some(path) = &args.unix {
        listen.push(ListenAddress::Unix(path.clone()));
    }
    let inherited = crate::daemon::inherited_sockets()?;
    if inherited.is_some() && !listen.is_empty() {
        bail!("started by systemd socket activation (LISTEN_FDS), which passes the listening sockets: --listen, --port and --unix cannot be used too");
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
    if !specs.iter().any(|(_, backend, _)| is_file(backend)) {
        if args.direct {
            bail!("--direct opens backing files with O_DIRECT, and no backend is a file");
        }
        if args.create_size.is_some() {
            bail!("--create-size creates a backing file, and no backend is a file");
        }
    }
    for (name, backend, is_default) in specs {
        let (device, upstream) = open_backend(&backend, &args, is_default)?;
        let counting = Arc::new(CountingDevice::new(device));
        let (device, queue) = args
            .engine
            .queue_device(Arc::clone(&counting) as Arc<dyn Device>, cache.config())?;
        meters.push(ExportMeters {
            name: name.clone(),
            device: counting,
            queue,
            upstream,
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
        objects.push((name.clone(), object.reopen()));
        let export = crate::observe::wrap(
            &observers,
            exports.len(),
            Arc::new(CacheExport::new(object)),
        );
        exports.push((name, export));
    }
    handle_rescue_file(&args, &cache, &objects)?;
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
    let background_prefault = match prefault_when {
        PrefaultWhen::Startup => {
            prefault::before_serving(&cache, prefault_bytes_max);
            None
        }
        PrefaultWhen::Auto => {
            prefault::before_serving(
                &cache,
                prefault_bytes_max.min(prefault::BEFORE_SERVING_BYTES_MAX),
            );
            (prefault_bytes_max > prefault::BEFORE_SERVING_BYTES_MAX)
                .then(|| prefault::Background::start(cache.clone(), prefault_bytes_max))
                .flatten()
        }
        PrefaultWhen::Background => prefault::Background::start(cache.clone(), prefault_bytes_max),
        PrefaultWhen::Off => None,
    };
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
    let server = match inherited {
        Some(sockets) => server.bind_inherited(sockets)?,
        None => server.bind()?,
    };
    if let Some(address) = &args.metrics {
        let local = metrics::start(
            address,
            Arc::new(Meters {
                cache: cache.clone(),
                exports: meters,
                whatif: observers.whatif.clone(),
            }),
        )?;
        say!("metrics on http://{local}/metrics and /stats   (try: bufcache stat {local})");
    }
    for address in server.local_addrs() {
        say!(
            "listening on {}   (try: nbdinfo {})",
            address_text(&address),
            address.uri("")
        );
    }
    if let Some(path) = &args.pid_file {
        crate::daemon::write_pid_file(path)?;
    }
    if let Err(error) = crate::daemon::notify("READY=1") {
        say!("cannot notify the service manager (NOTIFY_SOCKET) of readiness: {error}");
    }
    let shutdown = ShutdownHandle::new();
    let (events, event_receiver) = mpsc::channel();
    install_signal_handlers(shutdown.clone(), events.clone())?;
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
            Some(Event::Signal(signal)) => {
                say!("second signal {signal}: saving dirty data to the rescue file now");
                break None;
            }
            Some(Event::Served(result)) => {
                deadline.get_or_insert_with(|| Instant::now() + timeout);
                serve_error = result.err();
            }
            Some(Event::Synced(result)) => break Some(result),
            None => break None,
        }
    };
    give_up.store(true, Ordering::Release);
    match outcome {
        Some(Ok(())) => {
            // Everything is written back: other servers may now open the S3 disks.
            bufcache_s3::release_locks();
            if let Some(error) = serve_error {
                return Err(error).context("serving");
            }
            say!("all data written back; bye");
            Ok(())
        }
        Some(Err(error)) => {
            say!("writing back dirty data at shutdown failed: {error}");
            rescue_and_exit(&args.rescue_file, &objects)
        }
        None => {
            match last_error.lock().ok().and_then(|last| last.clone()) {
                Some(error) => say!("writing back dirty data at shutdown failed: {error}"),
                None => say!(
                    "writing back dirty data at shutdown did not finish (backend not answering)"
                ),
            }
            rescue_and_exit(&args.rescue_file, &objects)
        }
    }
}

/// Saves every dirty block of every export to the rescue file and ends the process at once
/// (threads stuck on a hung backend are not waited for): exit status 3 when everything dirty
/// was saved, 1 when some could not be (named in the last line).
fn rescue_and_exit(path: &Path, objects: &[(String, ObjectHandle)]) -> ! {
    crate::daemon::cleanup();
    let mut records = Vec::new();
    let mut unreadable_bytes = 0u64;
    for (name, object) in objects {
        object.visit_dirty_blocks(Duration::from_secs(1), |offset, bytes| match bytes {
            Some(bytes) => records.push(rescue::Record {
                export: name.clone(),
                offset,
                data: bytes.to_vec(),
            }),
            None => unreadable_bytes += object.block_size() as u64,
        });
    }
    let saved_bytes: u64 = records.iter().map(|record| record.data.len() as u64).sum();
    if records.is_empty() && unreadable_bytes == 0 {
        say!("no dirty data left, but the backend did not confirm a flush: data written last may not be durable");
        std::process::exit(1);
    }
    if let Err(error) = rescue::write(path, &records) {
        say!(
            "LOST {saved_bytes} bytes of dirty data: saving them to the rescue file failed: {error:#}"
        );
        std::process::exit(1);
    }
    if unreadable_bytes > 0 {
        say!(
            "saved {saved_bytes} bytes of dirty data to rescue file {}; LOST {unreadable_bytes} bytes held by requests that did not finish",
            path.display()
        );
        std::process::exit(1);
    }
    say!(
        "saved {saved_bytes} bytes of dirty data that could not be written back to rescue file {} ({} records); the next start replays them",
        path.display(),
        records.len()
    );
    std::process::exit(EXIT_RESCUED);
}

/// Replays (or discards) a rescue file left by an earlier shutdown, before serving.
fn handle_rescue_file(
    args: &ServeArgs,
    cache: &Cache,
    objects: &[(String, ObjectHandle)],
) -> anyhow::Result<()> {
    let path = &args.rescue_file;
    if !path.exists() {
        return Ok(());
    }
    let records = rescue::read(path)?;
    let bytes: u64 = records.iter().map(|record| record.data.len() as u64).sum();
    if args.rescue == RescueAction::Discard {
        rescue::remove(path)?;
        say!(
            "--rescue discard: deleted rescue file {} ({bytes} bytes of unwritten data dropped)",
            path.display()
        );
        return Ok(());
    }
    for record in &records {
        let Some((_, object)) = objects.iter().find(|(name, _)| *name == record.export) else {
            bail!(
                "rescue file {} holds data for export {:?}, which this server does not have; \
                 start with that export, or pass --rescue discard to drop it",
                path.display(),
                record.export
            );
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
    rescue::remove(path)?;
    say!(
        "replayed rescue file {}: {bytes} bytes in {} records written back and flushed",
        path.display(),
        records.len()
    );
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
