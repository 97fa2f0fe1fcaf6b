//! `serve` once every export is built: a warm standby's wait for its disk, the rescue file
//! replayed, the server started on the bound sockets with the control socket and /metrics,
//! the readiness announced, then the event loop until shutdown, which writes everything back
//! or saves it to the rescue file.

use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bufcache::{format_size, Cache, CacheError, CountingDevice, Device, ObjectHandle};
use bufcache_nbd::{Export, Listeners, Server, ServerConfig, ShutdownHandle};

use super::export_stack::ExportStack;
use super::rescuing::{handle_rescue_file, rescue_and_exit, rescue_targets, RescueTarget};
use super::{Event, ServeArgs, SECOND_SIGNAL_GRACE};
use crate::backend_lock::BackendLock;
use crate::log::say;
use crate::metrics::{self, ExportMeters, Meters, ServeTier};
use crate::observe::Observers;
use crate::prefault::{self, PrefaultWhen};
use crate::rescue;
use crate::standby::WarmStandby;

/// What the start made before the exports were built: sockets bound (not yet answering),
/// signals handled, the shared cache and observers.
pub(super) struct Started {
    pub server_config: ServerConfig,
    pub listeners: Listeners,
    pub metrics_listener: Option<std::net::TcpListener>,
    pub control: Option<crate::control::Bound>,
    pub shutdown: ShutdownHandle,
    pub events: mpsc::Sender<Event>,
    pub event_receiver: mpsc::Receiver<Event>,
    pub cache: Cache,
    pub observers: Observers,
}

/// A warm standby waiting for its disk: its export, its warming, a view of its cache object
/// and the index of its backend in [`Held::rescuable`].
struct Waiting {
    name: String,
    warm: Arc<WarmStandby>,
    object: ObjectHandle,
    rescue_index: usize,
}

/// What serving and shutdown hold of the exports' stacks, export by export in order.
struct Held {
    exports: Vec<(String, Arc<dyn Export>)>,
    objects: Vec<(String, ObjectHandle)>,
    rescuable: Vec<rescue::Backend>,
    /// S3 devices whose acknowledged data may be only in memory (saved at shutdown).
    s3_devices: Vec<(String, Arc<bufcache_s3::S3Device>)>,
    tiers: Vec<Arc<ServeTier>>,
    counters: Vec<Arc<CountingDevice<Arc<dyn Device>>>>,
    backend_locks: Vec<BackendLock>,
    /// Handed to /metrics when it starts (None once it did).
    meters: Option<Vec<ExportMeters>>,
    standbys: Vec<Waiting>,
}

impl Held {
    fn new(stacks: Vec<ExportStack>) -> Held {
        let mut held = Held {
            exports: Vec::new(),
            objects: Vec::new(),
            rescuable: Vec::new(),
            s3_devices: Vec::new(),
            tiers: Vec::new(),
            counters: Vec::new(),
            backend_locks: Vec::new(),
            meters: None,
            standbys: Vec::new(),
        };
        let mut meters = Vec::new();
        for stack in stacks {
            if let Some(warm) = stack.standby {
                held.standbys.push(Waiting {
                    name: stack.name.clone(),
                    warm,
                    object: stack.object.reopen(),
                    rescue_index: held.rescuable.len(),
                });
            }
            held.rescuable.extend(stack.rescuable);
            held.objects.push((stack.name.clone(), stack.object));
            held.s3_devices
                .extend(stack.s3.map(|device| (stack.name.clone(), device)));
            held.backend_locks.extend(stack.lock);
            held.tiers.extend(stack.meters.tier.clone());
            held.counters.push(Arc::clone(&stack.meters.device));
            meters.push(stack.meters);
            held.exports.push((stack.name, stack.export));
        }
        held.meters = Some(meters);
        held
    }
}

/// Serves the built exports until shutdown; returns (or ends the process) as the shutdown
/// ends: everything written back, or saved to the rescue file.
pub(super) fn serve(
    args: &ServeArgs,
    mut started: Started,
    stacks: Vec<ExportStack>,
) -> anyhow::Result<()> {
    let mut held = Held::new(stacks);
    let cache = started.cache.clone();
    // A standby faults its cache's memory in while it waits, not after it took the disk.
    let mut background_prefault = None;
    if !held.standbys.is_empty() {
        background_prefault = start_prefault(args, &cache, &held.objects);
        // A standby shows /metrics while it waits (its role, the writer's lease as it sees
        // it, its lag, its warming); it listens for clients only once it writes.
        if let (Some(listener), Some(meters)) =
            (started.metrics_listener.take(), held.meters.take())
        {
            start_metrics(listener, &cache, meters, &started.observers)?;
        }
        if !wait_for_takeovers(&mut held, &started.event_receiver, &cache)? {
            return Ok(());
        }
    }
    let rescue_targets = rescue_targets(args, std::mem::take(&mut held.rescuable))?;
    for target in &rescue_targets {
        handle_rescue_file(args, target, &cache, &held.objects)?;
    }
    if held.standbys.is_empty() {
        background_prefault = start_prefault(args, &cache, &held.objects);
    }
    let server = match Server::new(started.server_config, std::mem::take(&mut held.exports)) {
        Err(bufcache_nbd::ServerError::PolicyForUnknownExport(name)) => clap::Error::raw(
            clap::error::ErrorKind::ValueValidation,
            format!(
                "--export-identity / --export-read-only name {name:?}, which is not an export\n"
            ),
        )
        .exit(),
        server => server?,
    };
    let server = server.with_listeners(started.listeners)?;
    if let Some(bound) = started.control {
        start_control(args, bound, &cache, &held)?;
    }
    if let (Some(listener), Some(meters)) = (started.metrics_listener, held.meters.take()) {
        start_metrics(listener, &cache, meters, &started.observers)?;
    }
    announce(args, &server, &started.shutdown, &started.events)?;
    let stop_writer = Arc::new(AtomicBool::new(false));
    let writer = start_background_writer(cache.clone(), Arc::clone(&stop_writer));
    let give_up = Arc::new(AtomicBool::new(false));
    let last_error = Arc::new(Mutex::new(None::<String>));
    // Serving and the shutdown write-back run on their own thread, so the main thread can
    // end the process at the deadline whatever a hung backend does to them.
    {
        let cache = cache.clone();
        let give_up = Arc::clone(&give_up);
        let last_error = Arc::clone(&last_error);
        let shutdown = started.shutdown;
        let events = started.events;
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
    let ended = wait_for_shutdown(
        &started.event_receiver,
        &cache,
        Duration::from_secs_f64(args.shutdown_timeout),
    );
    give_up.store(true, Ordering::Release);
    finish(ended, &last_error, rescue_targets, held)
}

/// Waits until every warm standby took its disk over: true then; false when a signal came
/// first (nothing was written to any disk).
fn wait_for_takeovers(
    held: &mut Held,
    event_receiver: &mpsc::Receiver<Event>,
    cache: &Cache,
) -> anyhow::Result<bool> {
    let mut waiting = held.standbys.len();
    while waiting > 0 {
        match event_receiver.recv() {
            Ok(Event::TakenOver(index, opened)) => {
                let writer = (*opened)?;
                let exports = &held.exports;
                let Some(standby) = held.standbys.iter().find(|standby| {
                    exports
                        .get(index)
                        .is_some_and(|(export, _)| *export == standby.name)
                }) else {
                    continue;
                };
                let name = &standby.name;
                let warm = &standby.warm;
                let state = writer.state();
                let cached_before = cache.stats().memory_used_bytes;
                let dropped = warm.take_over(writer, &standby.object);
                if let Some(writer) = warm.standby.writer() {
                    held.s3_devices.push((name.clone(), Arc::clone(writer)));
                }
                if let Some(backend) = held.rescuable.get_mut(standby.rescue_index) {
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
                return Ok(false);
            }
            Ok(_) => {}
            Err(_) => bail!("the standby's threads ended without taking the disk over"),
        }
    }
    Ok(true)
}

/// Answers the control socket for the S3 disks served.
fn start_control(
    args: &ServeArgs,
    bound: crate::control::Bound,
    cache: &Cache,
    held: &Held,
) -> anyhow::Result<()> {
    let disks = held
        .s3_devices
        .iter()
        .filter_map(|(name, device)| {
            let (_, object) = held.objects.iter().find(|(export, _)| export == name)?;
            Some(crate::control::Held {
                device: Arc::clone(device),
                object: object.reopen(),
            })
        })
        .collect();
    let cache = cache.clone();
    crate::control::start(bound, disks, Box::new(move || cache.sync()))?;
    let path = args.control.as_deref().unwrap_or(Path::new("")).display();
    say!("control socket on {path}   (try: bufcache disk snapshot URL NAME --control {path}, or disk resize URL SIZE --control {path})");
    Ok(())
}

/// Once listening: --exit-with-parent armed, the addresses said, --print-uri, the pid file,
/// the service manager told, and the --run command started.
fn announce(
    args: &ServeArgs,
    server: &bufcache_nbd::BoundServer,
    shutdown: &ShutdownHandle,
    events: &mpsc::Sender<Event>,
) -> anyhow::Result<()> {
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
    Ok(())
}

/// How the event loop ended.
struct Ended {
    /// The shutdown write-back's result; None when it did not finish (timeout, second
    /// signal, or the server thread gone).
    synced: Option<Result<(), CacheError>>,
    /// Serving's own failure, if it failed.
    serve_error: Option<bufcache_nbd::ServerError>,
    /// The --run command's exit status, if it exited.
    captive_status: Option<i32>,
}

/// The main thread's loop: waits for a signal, the --run command's exit or the server's
/// end, then for the shutdown write-back until `timeout` (a second signal cuts it short).
fn wait_for_shutdown(
    event_receiver: &mpsc::Receiver<Event>,
    cache: &Cache,
    timeout: Duration,
) -> Ended {
    let mut deadline: Option<Instant> = None;
    let mut serve_error: Option<bufcache_nbd::ServerError> = None;
    let mut captive_status: Option<i32> = None;
    let synced = loop {
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
    Ended {
        synced,
        serve_error,
        captive_status,
    }
}

/// The end of a shutdown: with everything written back, the locks released and the exit
/// status said; else what is dirty saved to the rescue files (the process ends there).
fn finish(
    ended: Ended,
    last_error: &Mutex<Option<String>>,
    mut rescue_targets: Vec<RescueTarget>,
    held: Held,
) -> anyhow::Result<()> {
    match ended.synced {
        Some(Ok(())) => {
            // Everything is written back: other servers may now open the S3 disks.
            bufcache_s3::release_locks();
            for target in rescue_targets.drain(..) {
                target.lock.release();
            }
            drop(held.backend_locks);
            if let Some(error) = ended.serve_error {
                return Err(error).context("serving");
            }
            for tier in &held.tiers {
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
            if let Some(code) = ended.captive_status.filter(|code| *code != 0) {
                crate::daemon::cleanup();
                crate::log::exit(code);
            }
            Ok(())
        }
        Some(Err(error)) => {
            say!("writing back dirty data at shutdown failed: {error}");
            rescue_and_exit(
                rescue_targets,
                &held.objects,
                &held.s3_devices,
                &held.counters,
            )
        }
        None => {
            match last_error.lock().ok().and_then(|last| last.clone()) {
                Some(error) => say!("writing back dirty data at shutdown failed: {error}"),
                None => say!(
                    "writing back dirty data at shutdown did not finish (backend not answering)"
                ),
            }
            rescue_and_exit(
                rescue_targets,
                &held.objects,
                &held.s3_devices,
                &held.counters,
            )
        }
    }
}

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

/// Writes back everything dirty and flushes, retrying while the backend fails until `give_up`
/// is set: a backend that recovers in time loses nothing. The caller decides when to give up
/// (the shutdown timeout) and saves what is still dirty to the rescue file.
/// The last failure is kept in `last_error` for the final message if the caller gives up first.
fn sync_with_retries(
    cache: &Cache,
    give_up: &AtomicBool,
    last_error: &Mutex<Option<String>>,
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
pub(super) fn install_signal_handlers(
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
