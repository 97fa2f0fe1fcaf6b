//! Each export's backend, checked and opened as far as it can be without writing to it
//! ([`prepare_backend`]), then opened ([`PreparedBackend::open`]) once every export was
//! prepared: a file or block device, `memory:SIZE`, an upstream NBD server or an S3 disk
//! (a warm standby's too); and the checks that what this server will attach to a backend
//! (its rescue file, its local cache) belongs to it.

use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use anyhow::{bail, Context};
use bufcache::{format_size, parse_size, Device, FileDevice, FileDeviceOptions, MemoryDevice};
use bufcache_nbd::{ReconnectPolicy, ReconnectingClient};

use super::{Event, FlushToArg, ServeArgs, DEFAULT_BACKING_SIZE_BYTES};
use crate::backend_lock::BackendLock;
use crate::log::say;
use crate::metrics::ServeTier;
use crate::rescue::{self, identity_of_url, same_backend, BackendIdentity, Refusal, RescueAction};

/// Puts the --local-cache tier over `remote` (whose identity is `identity`); the lock on
/// the local cache file is taken before anything in it is read.
pub(super) fn open_local_tier(
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

/// A backend's device, and what comes with it.
pub(super) struct OpenedBackend {
    pub device: Arc<dyn Device>,
    /// The upstream connection when the backend is an NBD server (for its metrics).
    pub upstream: Option<Arc<ReconnectingClient>>,
    /// What the backend is, for its rescue file and local cache; None for memory, which does
    /// not outlive the process (so there is nothing to rescue into).
    pub identity: Option<BackendIdentity>,
    /// The S3 device, whose log layout may hold acknowledged data only in memory (saved to
    /// the rescue file at a shutdown that cannot reach the store).
    pub s3: Option<Arc<bufcache_s3::S3Device>>,
    /// The object-store disk when the backend is s3:// (for its metrics).
    pub store: Option<Arc<bufcache_s3::S3Device>>,
    /// Exclusive use of a backing file or block device, held until the process ends.
    pub lock: Option<BackendLock>,
    /// A warm standby's device (the replica view until it takes the disk over); its writable
    /// open waits on a thread of its own and is sent as [`Event::TakenOver`].
    pub standby: Option<Arc<bufcache_s3::standby::Standby>>,
}

/// The name of the S3 disk a URL reaches: `s3://BUCKET/PREFIX`, every parameter left out
/// but `snapshot=` (a snapshot is a disk of its own for rescue files and local caches).
pub(super) fn s3_disk_name(url: &bufcache_s3::S3Url) -> String {
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
    let path = args
        .rescue_file
        .clone()
        .unwrap_or_else(|| rescue::default_path(export, &ours.name));
    if args.rescue != RescueAction::Discard && path.exists() {
        check_rescue_file(args, &path, export, ours, size_bytes)?;
    }
    if args.rescue_file.is_none() {
        check_rescue_files_named_otherwise(&path, export, ours)?;
    }
    if let Some(local) = &args.local_cache {
        check_local_cache(args, local, ours, size_bytes)?;
    }
    Ok(())
}

/// A refusal of what the user named: exit 2, like the others.
fn refuse(message: String) -> anyhow::Result<()> {
    Err(anyhow::Error::new(crate::BadInput(message)))
}

/// The rescue file at `path` holds nothing of export `export` that may not be replayed into
/// `ours` (another disk, another size, a disk that moved on since, unless `--rescue force`).
fn check_rescue_file(
    args: &ServeArgs,
    path: &Path,
    export: &str,
    ours: &BackendIdentity,
    size_bytes: Option<u64>,
) -> anyhow::Result<()> {
    let contents = rescue::read(path)?;
    let bytes: u64 = contents
        .records
        .iter()
        .filter(|record| record.export == export)
        .map(|record| record.data.len() as u64)
        .sum();
    let age = rescue_age(path);
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
    Ok(())
}

/// No rescue file an older server saved under another name holds data of `ours`.
fn check_rescue_files_named_otherwise(
    path: &Path,
    export: &str,
    ours: &BackendIdentity,
) -> anyhow::Result<()> {
    for other in other_rescue_files(path) {
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
    Ok(())
}

/// The --local-cache, if it was made already, belongs to `ours` and fits it (its size, the
/// backend's size, not truncated).
fn check_local_cache(
    args: &ServeArgs,
    local: &Path,
    ours: &BackendIdentity,
    size_bytes: Option<u64>,
) -> anyhow::Result<()> {
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
pub(super) enum PreparedBackend {
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
    pub(super) fn open(
        self,
        events: &mpsc::Sender<Event>,
        index: usize,
    ) -> anyhow::Result<OpenedBackend> {
        match self {
            PreparedBackend::Opened(opened) => Ok(opened),
            PreparedBackend::S3(pending) => pending.open(events, index),
        }
    }
}

/// An S3 disk probed (its id, generation and size read) and checked against its rescue file
/// and local cache, nothing written to it yet.
pub(super) struct PendingS3 {
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
            lock: None,
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
            lock: None,
            standby: Some(standby),
        })
    }
}

/// Opens the device a backend string names (and, for nbd://, the upstream connection too, for
/// its metrics), as far as it can without writing to it: an S3 disk is probed and left
/// pending ([`PreparedBackend::open`]). `export` and the flags say what
/// [`check_before_writing`] checks, which runs before anything is written to the backend.
pub(super) fn prepare_backend(
    spec: &str,
    args: &ServeArgs,
    is_default: bool,
    export: &str,
) -> anyhow::Result<PreparedBackend> {
    if let Some(size) = spec.strip_prefix("memory:") {
        return prepare_memory(spec, size);
    }
    if spec.starts_with("nbd://")
        || spec.starts_with("nbd+unix://")
        || spec.starts_with("nbds://")
        || spec.starts_with("nbds+unix://")
    {
        return prepare_upstream(spec, args, export);
    }
    if spec.starts_with("s3://") {
        return prepare_s3(spec, args, export);
    }
    prepare_file(spec, args, is_default, export)
}

/// `memory:SIZE`: nothing to check, nothing outlives the process.
fn prepare_memory(spec: &str, size: &str) -> anyhow::Result<PreparedBackend> {
    let size = parse_size(size).with_context(|| format!("backend `{spec}`"))?;
    if size == 0 {
        bail!("backend `{spec}`: a memory backend needs a size above zero, like memory:1G");
    }
    Ok(PreparedBackend::Opened(OpenedBackend {
        device: Arc::new(MemoryDevice::new(size)),
        upstream: None,
        store: None,
        identity: None,
        s3: None,
        lock: None,
        standby: None,
    }))
}

/// An upstream NBD server, connected (connecting writes nothing) and checked.
fn prepare_upstream(spec: &str, args: &ServeArgs, export: &str) -> anyhow::Result<PreparedBackend> {
    let policy = ReconnectPolicy {
        delay_initial: Duration::from_secs_f64(args.reconnect_delay_initial),
        delay_max: Duration::from_secs_f64(args.reconnect_delay_max),
        give_up_after: Duration::from_secs_f64(args.reconnect_give_up),
    };
    let client = Arc::new(
        ReconnectingClient::connect(spec, policy).with_context(|| format!("backend `{spec}`"))?,
    );
    let identity = identity_of_url(spec);
    let identity = BackendIdentity {
        name: identity.clone(),
        identity,
        state: None,
    };
    check_before_writing(args, export, &identity, Some(client.len()))?;
    Ok(PreparedBackend::Opened(OpenedBackend {
        device: Arc::clone(&client) as Arc<dyn Device>,
        upstream: Some(client),
        identity: Some(identity),
        s3: None,
        store: None,
        lock: None,
        standby: None,
    }))
}

/// An S3 disk, probed (read only) and checked, left pending: opening it for writing takes
/// its lock and raises its generation, so that waits for every export to be prepared.
fn prepare_s3(spec: &str, args: &ServeArgs, export: &str) -> anyhow::Result<PreparedBackend> {
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
    Ok(PreparedBackend::S3(Box::new(PendingS3 {
        url,
        seen,
        proposed_id,
        meters,
        name,
        read_only: args.read_only,
        warm_standby,
    })))
}

/// A backing file or block device (created when missing and a size is given), opened and
/// locked; the disk id it records (or is given once the checks passed) names it.
fn prepare_file(
    spec: &str,
    args: &ServeArgs,
    is_default: bool,
    export: &str,
) -> anyhow::Result<PreparedBackend> {
    let path = Path::new(spec);
    let (device, read_only) = open_file(spec, args, is_default)?;
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
            None if read_only || !is_regular => name.clone(),
            None => rescue::file_disk_identity(proposed_id),
        },
        name: name.clone(),
        state: None,
    };
    check_before_writing(args, export, &identity, Some(device.len()))?;
    let identity = if recorded_id.is_none() && !read_only && is_regular {
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
        lock: Some(lock),
        standby: None,
    }))
}

/// Opens (or creates) the backing file `spec` names: the device, and whether it is served
/// read-only (asked, or a file this process may only read).
fn open_file(spec: &str, args: &ServeArgs, is_default: bool) -> anyhow::Result<(FileDevice, bool)> {
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
    Ok((device, options.read_only))
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
