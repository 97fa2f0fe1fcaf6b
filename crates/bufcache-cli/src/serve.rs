//! `bufcache serve`: exports backing stores through one shared buffer cache over NBD.
//!
//! Each export is a cache object over its backend device: a file or block device, `memory:SIZE`,
//! or an upstream NBD server (`nbd://HOST:PORT/EXPORT`, `nbd+unix:///EXPORT?socket=PATH`).
//! The process owns dirty data, so shutdown (SIGINT, SIGTERM) stops accepting, lets in-flight
//! requests finish, writes back everything dirty and flushes every backend before exiting 0;
//! if that write-back fails the error is printed and the exit status is 1.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use bufcache::{
    format_size, parse_size, Cache, CacheError, CountingDevice, Device, FileDevice,
    FileDeviceOptions, MemoryDevice, ObjectConfig, ObjectHandle,
};
use bufcache_nbd::{
    BlockStatusExtent, Export, ListenAddress, NbdClient, Server, ServerConfig, ShutdownHandle,
};
use clap::Args;

use crate::engine_args::EngineArgs;
use crate::metrics::{self, ExportMeters, Meters};

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
    /// The backing store of the default (empty-named) export. Default ./bufcache.img.
    #[arg(long, value_name = "BACKEND")]
    backend: Option<String>,
    /// Named exports, NAME=BACKEND; repeatable. All share one cache.
    #[arg(long = "export", value_name = "NAME=BACKEND")]
    exports: Vec<String>,
    /// Where to listen: tcp:HOST:PORT or unix:PATH; repeatable. Default tcp:127.0.0.1:10809.
    #[arg(long, value_name = "ADDRESS")]
    listen: Vec<ListenAddress>,
    /// Size of a backing file to create when it does not exist (the default file: 1G).
    #[arg(long, value_name = "SIZE", value_parser = |text: &str| parse_size(text).map_err(|e| e.to_string()))]
    create_size: Option<u64>,
    /// Refuse writes.
    #[arg(long)]
    read_only: bool,
    /// Open backing files with O_DIRECT (bypassing the host page cache).
    #[arg(long)]
    direct: bool,
    /// Largest NBD request in bytes (advertised maximum block size). Default 32M.
    #[arg(long, value_name = "SIZE", value_parser = |text: &str| parse_size(text).map_err(|e| e.to_string()))]
    request_size_max: Option<u64>,
    /// Seconds to keep retrying write-back of dirty data at shutdown (SIGINT, SIGTERM) when
    /// the backend fails, before giving up with exit status 1. Default 10.
    #[arg(long, value_name = "SECONDS", default_value_t = 10.0)]
    shutdown_timeout: f64,
    /// Serve Prometheus metrics (/metrics) and JSON statistics (/stats) on HOST:PORT.
    #[arg(long, value_name = "HOST:PORT")]
    metrics: Option<String>,
    #[command(flatten)]
    engine: EngineArgs,
}

/// An export served through the cache.
struct CacheExport {
    object: ObjectHandle,
}

fn io_error(error: CacheError) -> std::io::Error {
    error.into()
}

impl Export for CacheExport {
    fn size(&self) -> u64 {
        self.object.len()
    }

    fn read_only(&self) -> bool {
        self.object.is_read_only()
    }

    fn description(&self) -> String {
        format!("bufcache over {}", self.object.device().describe())
    }

    fn preferred_block_size(&self) -> u32 {
        self.object.block_size()
    }

    fn read(&self, offset: u64, buffer: &mut [u8]) -> std::io::Result<()> {
        self.object.read_at(offset, buffer).map_err(io_error)
    }

    fn write(&self, offset: u64, data: &[u8], fua: bool) -> std::io::Result<()> {
        self.object.write_at(offset, data, fua).map_err(io_error)
    }

    fn flush(&self) -> std::io::Result<()> {
        self.object.flush().map_err(io_error)
    }

    fn trim(&self, offset: u64, length: u64, fua: bool) -> std::io::Result<()> {
        self.object.discard(offset, length).map_err(io_error)?;
        if fua {
            self.object.flush().map_err(io_error)?;
        }
        Ok(())
    }

    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        may_trim: bool,
        fast_only: bool,
        fua: bool,
    ) -> std::io::Result<()> {
        let fast = may_trim && self.object.device().write_zeroes_is_fast();
        if fast_only && !fast {
            return Err(std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                "zeroing would write data",
            ));
        }
        if fast {
            self.object
                .write_zeroes(offset, length, fua)
                .map_err(io_error)
        } else {
            write_zero_bytes(&self.object, offset, length, fua)
        }
    }

    fn can_fast_zero(&self) -> bool {
        self.object.device().write_zeroes_is_fast()
    }

    fn cache(&self, offset: u64, length: u64) -> std::io::Result<()> {
        self.object.prefetch(offset, length).map_err(io_error)
    }

    fn read_is_quick(&self, offset: u64, length: u64) -> bool {
        self.object.is_resident(offset, length)
    }

    fn open_connection(&self) -> Option<Arc<dyn Export>> {
        Some(Arc::new(CacheExport {
            object: self.object.reopen(),
        }))
    }

    fn block_status(&self, offset: u64, length: u64) -> std::io::Result<Vec<BlockStatusExtent>> {
        let extents = self.object.extents(offset, length).map_err(io_error)?;
        Ok(extents
            .into_iter()
            .map(|extent| BlockStatusExtent {
                length: extent.length,
                hole: extent.hole,
                zero: extent.hole,
            })
            .collect())
    }
}

/// Zeroes written as data through the cache (NO_HOLE, or a device that cannot punch holes).
fn write_zero_bytes(
    object: &ObjectHandle,
    offset: u64,
    length: u64,
    fua: bool,
) -> std::io::Result<()> {
    let zeroes = vec![0u8; length.min(1 << 20) as usize];
    let mut done = 0u64;
    while done < length {
        let step = (length - done).min(zeroes.len() as u64) as usize;
        object
            .write_at(offset + done, &zeroes[..step], false)
            .map_err(io_error)?;
        done += step as u64;
    }
    if fua {
        object.flush().map_err(io_error)?;
    }
    Ok(())
}

/// Opens the device a backend string names.
fn open_backend(spec: &str, args: &ServeArgs, is_default: bool) -> anyhow::Result<Arc<dyn Device>> {
    if let Some(size) = spec.strip_prefix("memory:") {
        let size = parse_size(size).with_context(|| format!("backend `{spec}`"))?;
        if size == 0 {
            bail!("backend `{spec}`: a memory backend needs a size above zero, like memory:1G");
        }
        return Ok(Arc::new(MemoryDevice::new(size)));
    }
    if spec.starts_with("nbd://") || spec.starts_with("nbd+unix://") || spec.starts_with("nbds://")
    {
        let client = NbdClient::connect(spec).with_context(|| format!("backend `{spec}`"))?;
        return Ok(Arc::new(client));
    }
    if spec.starts_with("s3://") {
        let mut url = bufcache_s3::S3Url::parse(spec).map_err(bufcache_s3::OpenError::from)?;
        url.create_size_bytes = url.create_size_bytes.or(args.create_size);
        let store = bufcache_s3::ChunkStore::open(&url)?;
        return Ok(Arc::new(bufcache_s3::S3Device::new(store)));
    }
    let path = Path::new(spec);
    let create_length = args
        .create_size
        .or(is_default.then_some(DEFAULT_BACKING_SIZE_BYTES));
    if !path.exists() && create_length.is_none() {
        bail!("backend `{spec}` does not exist; pass --create-size SIZE to create it, or use memory:SIZE");
    }
    let options = FileDeviceOptions {
        direct: args.direct,
        read_only: args.read_only,
        create_length_bytes: create_length,
        set_length_bytes: None,
    };
    Ok(Arc::new(FileDevice::open(path, &options)?))
}

fn export_specs(args: &ServeArgs) -> anyhow::Result<Vec<(String, String, bool)>> {
    let mut specs = Vec::new();
    for export in &args.exports {
        let (name, backend) = export
            .split_once('=')
            .with_context(|| format!("--export `{export}` is not NAME=BACKEND"))?;
        specs.push((name.to_string(), backend.to_string(), false));
    }
    match (&args.backend, specs.is_empty()) {
        (Some(backend), _) => specs.push((String::new(), backend.clone(), false)),
        (None, true) => specs.push((String::new(), DEFAULT_BACKING_FILE.to_string(), true)),
        (None, false) => {}
    }
    Ok(specs)
}

/// Writes back everything dirty, retrying for up to `timeout` while the backend fails: a
/// backend that recovers within it loses nothing. Dirty data still unwritten when it expires
/// is lost when the process exits, which the caller reports with a non-zero status.
fn sync_with_retries(cache: &Cache, timeout: Duration) -> Result<(), CacheError> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        match cache.sync() {
            Ok(()) => return Ok(()),
            Err(error) if std::time::Instant::now() >= deadline => return Err(error),
            Err(error) => {
                eprintln!(
                    "bufcache: write-back failed, retrying until the shutdown timeout: {error}"
                );
                std::thread::sleep(Duration::from_millis(500));
            }
        }
    }
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    if !(0.0..=86_400.0).contains(&args.shutdown_timeout) {
        bail!(
            "--shutdown-timeout {} is invalid: must be from 0 to 86400 seconds",
            args.shutdown_timeout
        );
    }
    let config = args.engine.config()?;
    let block_size = args.engine.block_size_bytes(&config)?;
    let mut server_config = ServerConfig::default();
    if !args.listen.is_empty() {
        server_config.listen = args.listen.clone();
    }
    if let Some(size) = args.request_size_max {
        if !(4096..=1 << 30).contains(&size) {
            bail!("--request-size-max {size} is invalid: must be from 4KiB to 1GiB");
        }
        server_config.request_size_max = size as u32;
        server_config.inflight_bytes_max = server_config.inflight_bytes_max.max(size);
    }
    server_config.validate()?;
    let cache = Cache::new(config)?;
    let mut exports: Vec<(String, Arc<dyn Export>)> = Vec::new();
    let mut meters = Vec::new();
    for (name, backend, is_default) in export_specs(&args)? {
        let counting = Arc::new(CountingDevice::new(open_backend(
            &backend, &args, is_default,
        )?));
        let (device, queue) = args
            .engine
            .queue_device(Arc::clone(&counting) as Arc<dyn Device>, cache.config())?;
        meters.push(ExportMeters {
            name: name.clone(),
            device: counting,
            queue,
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
        tracing::info!(export = %name, backend = %backend, size = %format_size(object.len()), "export ready");
        eprintln!(
            "bufcache: export {:?} = {} ({} bytes)",
            name,
            backend,
            object.len()
        );
        exports.push((name, Arc::new(CacheExport { object })));
    }
    let server = Server::new(server_config, exports)?.bind()?;
    if let Some(address) = &args.metrics {
        let local = metrics::start(
            address,
            Arc::new(Meters {
                cache: cache.clone(),
                exports: meters,
            }),
        )?;
        eprintln!(
            "bufcache: metrics on http://{local}/metrics and /stats   (try: bufcache stat {local})"
        );
    }
    for address in server.local_addrs() {
        eprintln!(
            "bufcache: listening on {}   (try: nbdinfo {})",
            address_text(&address),
            address.uri("")
        );
    }
    let shutdown = ShutdownHandle::new();
    install_signal_handlers(shutdown.clone())?;
    let stop_writer = Arc::new(AtomicBool::new(false));
    let writer = start_background_writer(cache.clone(), Arc::clone(&stop_writer));
    let served = server.run(shutdown);
    stop_writer.store(true, Ordering::Release);
    writer.thread().unpark();
    let _ = writer.join();
    eprintln!("bufcache: shutting down: writing back dirty data");
    let synced = sync_with_retries(&cache, Duration::from_secs_f64(args.shutdown_timeout));
    served?;
    synced.context("writing back dirty data at shutdown")?;
    eprintln!("bufcache: all data written back; bye");
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

fn install_signal_handlers(shutdown: ShutdownHandle) -> anyhow::Result<()> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM])
        .context("installing signal handlers")?;
    std::thread::Builder::new()
        .name("bufcache-signals".into())
        .spawn(move || {
            if let Some(signal) = signals.forever().next() {
                eprintln!("bufcache: signal {signal}: finishing in-flight requests");
                shutdown.trigger();
            }
        })
        .context("starting the signal thread")?;
    Ok(())
}
