//! Managing a disk without serving it (`bufcache disk`): its description and state
//! ([`info`]), a check of every object it holds ([`verify`]), creating one ([`create`]) and
//! changing its size ([`resize`]). [`info`] and [`verify`] write nothing at all; [`resize`]
//! holds the disk lock while it changes anything, so it is refused while a server has the
//! disk.

use std::sync::Arc;
use std::time::SystemTime;

use futures::stream::{self, StreamExt, TryStreamExt};
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, PutPayload};

use crate::error::{chain, DecodeError, OpenError, StoreError};
use crate::lock::{holder_now, Acquired, DiskLock, LockHolder};
use crate::log::{
    self, check_snapshot_name, GcReport, LogConfig, LogStore, LogSummary, SnapshotError,
    SnapshotSummary, SnapshotTaken, GC_THRESHOLD_DEFAULT,
};
pub use crate::log::{Damage, VerifyProgress};
use crate::meters::StoreMeters;
use crate::store::{
    self, check_new_size, connect_with, write_size, Create, DiskMetadata, METADATA_NAME,
};
use crate::url::{LayoutKind, S3Url};

/// Chunk objects a verification reads at once.
const VERIFY_CHUNK_REQUESTS_IN_FLIGHT_MAX: usize = 8;

/// What a verification found: every damaged object, and what was read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerifyReport {
    pub damaged: Vec<Damage>,
    pub read: VerifyProgress,
}

/// Who holds the disk lock, and since how long (None when the `since` it recorded does not
/// parse, or lies in the future).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LockState {
    pub holder: LockHolder,
    pub age_seconds: Option<u64>,
}

/// A disk's description and state, as `bufcache disk info` shows it.
#[derive(Debug)]
pub struct DiskInfo {
    pub metadata: DiskMetadata,
    /// None: no server holds the disk.
    pub lock: Option<LockState>,
    pub layout: LayoutInfo,
}

/// What the disk's layout holds.
#[derive(Debug)]
pub enum LayoutInfo {
    /// Chunk objects stored (the others read as zeroes) and their bytes.
    Chunk { chunks: u64, chunk_bytes: u64 },
    /// The log as an open would recover it now; Err: why it does not recover (the error an
    /// open would stop with).
    Log(Result<LogSummary, Box<OpenError>>),
}

/// Reads the disk's metadata, lock and objects; writes nothing. A disk another server holds
/// is read as the store has it now (that server may be ahead of it).
pub fn info(url: &S3Url) -> Result<DiskInfo, OpenError> {
    let connection = connect_with(url, Create::Never)?;
    let store: &dyn ObjectStore = &*connection.store;
    let metadata = connection.metadata;
    connection.runtime.block_on(async {
        let lock = read_lock(store, url).await?;
        let layout = match metadata.layout {
            LayoutKind::Chunk => {
                let (chunks, chunk_bytes) = list_chunks(store, url)
                    .await?
                    .iter()
                    .fold((0, 0), |(count, bytes), &(_, size)| {
                        (count + 1, bytes + size)
                    });
                LayoutInfo::Chunk {
                    chunks,
                    chunk_bytes,
                }
            }
            LayoutKind::Log => {
                let sealer = log::sealer_for(url, &metadata, &LogConfig::from_url(url))?;
                let summary =
                    log::summarize(store, &connection.buckets, url, &metadata, &sealer).await;
                LayoutInfo::Log(summary.map_err(Box::new))
            }
        };
        Ok(DiskInfo {
            metadata,
            lock,
            layout,
        })
    })
}

/// Reads every object of the disk and checks it (module docs of `log::inspect` for the log
/// layout; each chunk's block checksums for the chunk layout), calling `progress` after each
/// object. Writes nothing. An error only when the disk cannot be listed or opened at all.
pub fn verify(
    url: &S3Url,
    progress: &mut (dyn FnMut(VerifyProgress) + Send),
) -> Result<VerifyReport, OpenError> {
    let connection = connect_with(url, Create::Never)?;
    let store: &dyn ObjectStore = &*connection.store;
    let metadata = connection.metadata;
    connection.runtime.block_on(async {
        let (damaged, read) = match metadata.layout {
            LayoutKind::Chunk => verify_chunks(store, url, &metadata, progress).await?,
            LayoutKind::Log => {
                let sealer = log::sealer_for(url, &metadata, &LogConfig::from_url(url))?;
                log::verify(
                    store,
                    &connection.buckets,
                    url,
                    &metadata,
                    &sealer,
                    progress,
                )
                .await?
            }
        };
        Ok(VerifyReport { damaged, read })
    })
}

/// Creates a disk of `size_bytes` where `url` names one, with the layout and its parameters
/// the URL gives (`layout=`, `chunk-size=`, `segment-size=`, `compress=`, `key-file=`).
/// Refused when a disk, or any object, is there already.
pub fn create(url: &S3Url, size_bytes: u64) -> Result<DiskMetadata, OpenError> {
    if store::probe(url)?.is_some() {
        return Err(OpenError::Config {
            url: url.to_string(),
            reason: "a disk exists here already: nothing was changed".to_string(),
        });
    }
    let mut asked = url.clone();
    asked.create_size_bytes = Some(size_bytes);
    if asked.layout == Some(LayoutKind::Log) || asked.layout.is_none() {
        // The URL's log parameters are checked as an open would, before anything is written.
        LogConfig::from_url(&asked)
            .validate()
            .map_err(|error| OpenError::Config {
                url: url.to_string(),
                reason: error.to_string(),
            })?;
    }
    Ok(connect_with(&asked, Create::IfAsked)?.metadata)
}

/// Why an offline collection stopped.
#[derive(Debug, thiserror::Error)]
pub enum CollectError {
    #[error(transparent)]
    Open(#[from] OpenError),
    #[error("{url}: {reason}")]
    NotALog { url: String, reason: String },
    #[error("{url}: collecting garbage: {source} (what the rounds before it did is kept)")]
    Store { url: String, source: StoreError },
}

/// Collection rounds an offline collection runs at most: each rewrites up to
/// `GC_BYTES_MAX_DEFAULT` of live bytes, so this bounds one run to some 8 GiB rewritten.
const COLLECT_ROUNDS_MAX: u64 = 1024;

/// Collects a log-layout disk's garbage offline, holding its lock (refused while a server
/// holds it): rounds rewrite the live extents of every segment whose live fraction is below
/// `threshold` (default that of `gc-threshold=`, else [`GC_THRESHOLD_DEFAULT`]) until a round
/// finds nothing to do, then the close's checkpoint lets the dead segments go. `progress`
/// gets the running totals after each round.
pub fn collect(
    url: &S3Url,
    threshold: Option<f64>,
    progress: &mut dyn FnMut(GcReport),
) -> Result<GcReport, CollectError> {
    let state = store::probe(url)?.ok_or_else(|| CollectError::NotALog {
        url: url.to_string(),
        reason: "no disk here: nothing was changed".to_string(),
    })?;
    if state.layout != LayoutKind::Log {
        return Err(CollectError::NotALog {
            url: url.to_string(),
            reason: "a chunk-layout disk rewrites chunks in place and has no garbage to collect"
                .to_string(),
        });
    }
    let threshold = threshold.unwrap_or_else(|| {
        url.gc_threshold_ppm
            .map_or(GC_THRESHOLD_DEFAULT, |ppm| f64::from(ppm) / 1e6)
    });
    // The rounds run here, not in a background collector.
    let mut quiet = url.clone();
    quiet.gc = Some(false);
    let mut store = LogStore::open_locked(&quiet)?;
    let failed = |source: StoreError| CollectError::Store {
        url: url.to_string(),
        source,
    };
    let mut totals = GcReport::default();
    for _ in 0..COLLECT_ROUNDS_MAX {
        let round = store.collect_garbage(threshold).map_err(failed)?;
        totals.add(round);
        progress(totals);
        if round.segments_rewritten == 0 && round.segments_deleted == 0 {
            break;
        }
    }
    store.close().map_err(failed)?;
    Ok(totals)
}

/// What [`resize`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Resized {
    pub size_bytes_before: u64,
    pub size_bytes_after: u64,
    /// Chunk objects past the new end that `force` deleted.
    pub chunks_deleted: u64,
}

/// Sets the disk's size to `size_bytes`, holding the disk lock (refused while another server
/// holds it). Growing adds zeroes. Shrinking is refused when the part cut off holds data,
/// unless `force` (chunk layout: the chunk objects past the end are deleted; the log layout
/// cannot shrink over data, since its segments record extents there).
pub fn resize(url: &S3Url, size_bytes: u64, force: bool) -> Result<Resized, OpenError> {
    let connection = connect_with(url, Create::Never)?;
    let metadata = connection.metadata;
    check_new_size(url, &metadata, size_bytes)?;
    let lock = match connection.runtime.block_on(DiskLock::acquire(
        connection.runtime.handle().clone(),
        connection.store.clone(),
        url,
    ))? {
        Acquired::Held(lock) => lock,
        Acquired::WritesRefused(answer) => {
            return Err(OpenError::Config {
                url: url.to_string(),
                reason: format!(
                "the store refuses writes with these credentials ({answer}): nothing was changed"
            ),
            })
        }
    };
    let store: &dyn ObjectStore = &*connection.store;
    let outcome = connection.runtime.block_on(async {
        let chunks_deleted = if size_bytes < metadata.size_bytes {
            cut_off(store, url, &metadata, size_bytes, force).await?
        } else {
            0
        };
        write_size(store, url, size_bytes).await?;
        Ok::<_, OpenError>(Resized {
            size_bytes_before: metadata.size_bytes,
            size_bytes_after: size_bytes,
            chunks_deleted,
        })
    });
    let released = connection.runtime.block_on(lock.release_async());
    let resized = outcome?;
    released.map_err(|error| OpenError::Request {
        url: url.to_string(),
        operation: "releasing the disk lock after the resize (the resize is done)".to_string(),
        message: error.to_string(),
    })?;
    Ok(resized)
}

/// Before a shrink: refuses when the part past `size_bytes` holds data (or, with `force`, on
/// the chunk layout deletes its chunks); returns the chunks deleted.
async fn cut_off(
    store: &dyn ObjectStore,
    url: &S3Url,
    metadata: &DiskMetadata,
    size_bytes: u64,
    force: bool,
) -> Result<u64, OpenError> {
    let refuse = |reason: String| OpenError::Config {
        url: url.to_string(),
        reason,
    };
    match metadata.layout {
        LayoutKind::Chunk => {
            let first_cut = size_bytes / metadata.chunk_size_bytes;
            let past: Vec<u64> = list_chunks(store, url)
                .await?
                .into_iter()
                .map(|(index, _)| index)
                .filter(|&index| index >= first_cut)
                .collect();
            if past.is_empty() {
                return Ok(0);
            }
            if !force {
                return Err(refuse(format!(
                    "{} chunk object(s) hold data past the new end {size_bytes} (first: chunk {}); add --force to delete them: nothing was changed",
                    past.len(),
                    past[0]
                )));
            }
            for &index in &past {
                let key = chunk_key(url, index);
                store
                    .delete(&ObjectPath::from(key.as_str()))
                    .await
                    .map_err(|error| OpenError::Request {
                        url: url.to_string(),
                        operation: format!("deleting `{key}`"),
                        message: chain(&error),
                    })?;
            }
            Ok(past.len() as u64)
        }
        LayoutKind::Log => {
            let sealer = log::sealer_for(url, metadata, &LogConfig::from_url(url))?;
            let reach = log::written_end(store, url, metadata, &sealer).await?;
            if reach > size_bytes {
                return Err(refuse(format!(
                    "the log holds extents up to byte {reach}, past the new end {size_bytes} (written there once, even if trimmed since); a log-layout disk cannot be shrunk over them{}: nothing was changed",
                    if force { " even with --force" } else { "" }
                )));
            }
            Ok(0)
        }
    }
}

fn chunk_key(url: &S3Url, index: u64) -> String {
    url.key(&format!("chunks/{index:016x}"))
}

/// (index, object bytes) of every chunk object, ascending.
async fn list_chunks(store: &dyn ObjectStore, url: &S3Url) -> Result<Vec<(u64, u64)>, OpenError> {
    let objects = crate::store::list_folder(store, url, "chunks").await?;
    let mut chunks = Vec::with_capacity(objects.len());
    for object in objects {
        let name = object.location.filename().unwrap_or_default();
        let index = (name.len() == 16)
            .then(|| u64::from_str_radix(name, 16).ok())
            .flatten()
            .ok_or_else(|| OpenError::BadObject {
                url: url.to_string(),
                key: object.location.to_string(),
                reason: DecodeError::Inconsistent(
                    "not a chunk object name (16 hex digits)".to_string(),
                ),
            })?;
        chunks.push((index, object.size));
    }
    chunks.sort_unstable();
    Ok(chunks)
}

/// Each chunk object read whole: inside the disk, of the size its place allows, and (disks
/// with chunk checksums) every block's checksum.
async fn verify_chunks(
    store: &dyn ObjectStore,
    url: &S3Url,
    metadata: &DiskMetadata,
    progress: &mut (dyn FnMut(VerifyProgress) + Send),
) -> Result<(Vec<Damage>, VerifyProgress), OpenError> {
    let chunks = list_chunks(store, url).await?;
    let mut done = VerifyProgress {
        objects_total: chunks.len() as u64,
        bytes_total: chunks.iter().map(|&(_, bytes)| bytes).sum(),
        ..VerifyProgress::default()
    };
    let mut damaged = Vec::new();
    let mut checks = stream::iter(chunks.iter().map(|&(index, _)| async move {
        let key = chunk_key(url, index);
        let outcome = match store.get(&ObjectPath::from(key.as_str())).await {
            Ok(got) => got.bytes().await.map_err(|error| chain(&error)),
            Err(error) => Err(chain(&error)),
        };
        let checked = outcome.and_then(|body| {
            check_chunk(&body, index, metadata)
                .map(|()| body.len() as u64)
                .map_err(|error| error.to_string())
        });
        (key, checked)
    }))
    .buffered(VERIFY_CHUNK_REQUESTS_IN_FLIGHT_MAX);
    while let Some((key, checked)) = checks.next().await {
        done.objects_done += 1;
        match checked {
            Ok(bytes) => done.bytes_done += bytes,
            Err(reason) => damaged.push(Damage { key, reason }),
        }
        progress(done);
    }
    Ok((damaged, done))
}

fn check_chunk(body: &[u8], index: u64, metadata: &DiskMetadata) -> Result<(), DecodeError> {
    let chunk_size = metadata.chunk_size_bytes;
    if index >= metadata.size_bytes / chunk_size {
        return Err(DecodeError::Inconsistent(format!(
            "chunk {index} lies past the end of the disk ({} bytes)",
            metadata.size_bytes
        )));
    }
    if !metadata.chunk_checksums {
        return if body.len() as u64 == chunk_size {
            Ok(())
        } else {
            Err(DecodeError::Inconsistent(format!(
                "{} bytes, not the chunk size {chunk_size}",
                body.len()
            )))
        };
    }
    crate::blocks::decode(
        body,
        chunk_size,
        crate::blocks::Place {
            object_offset: 0,
            disk_offset: index * chunk_size,
        },
    )
    .map(drop)
}

/// The lock object's holder now, with its age.
async fn read_lock(store: &dyn ObjectStore, url: &S3Url) -> Result<Option<LockState>, OpenError> {
    let Some(holder) = holder_now(store, url).await? else {
        return Ok(None);
    };
    // The one wall-clock reading of this module: how old a lock is, for its reader.
    let age_seconds = humantime::parse_rfc3339(&holder.since)
        .ok()
        .and_then(|since| SystemTime::now().duration_since(since).ok())
        .map(|age| age.as_secs());
    Ok(Some(LockState {
        holder,
        age_seconds,
    }))
}

/// The log-layout disk `url` names, for a snapshot command: refuses no disk, a chunk-layout
/// one and a snapshot URL.
fn snapshot_disk(url: &S3Url) -> Result<store::Connection, SnapshotError> {
    let refused = |reason: &str| SnapshotError::Refused {
        url: url.to_string(),
        reason: reason.to_string(),
    };
    if url.snapshot.is_some() {
        return Err(refused(
            "the URL names a snapshot (snapshot=); name the disk itself",
        ));
    }
    let connection = connect_with(url, Create::Never)?;
    if connection.metadata.layout != LayoutKind::Log {
        return Err(refused(
            "a chunk-layout disk rewrites its chunks in place and has no snapshots (use layout=log)",
        ));
    }
    Ok(connection)
}

/// Takes snapshot `name` of a disk no server holds: opens it (taking the lock, so a served
/// disk is refused with [`OpenError::Locked`]: its server takes snapshots through its
/// control socket), snapshots it ([`LogStore::snapshot`]) and closes it. A name in use, or
/// a bad one, is refused before anything is written.
pub fn snapshot(url: &S3Url, name: &str) -> Result<SnapshotTaken, SnapshotError> {
    check_snapshot_name(name)?;
    let connection = snapshot_disk(url)?;
    let exists = connection
        .runtime
        .block_on(log::list_snapshots(&*connection.store, url))?;
    if exists.iter().any(|listed| listed.name == name) {
        return Err(SnapshotError::Exists {
            url: url.to_string(),
            name: name.to_string(),
        });
    }
    drop(connection);
    // Taken here, not while a collector runs.
    let mut quiet = url.clone();
    quiet.gc = Some(false);
    let mut store = LogStore::open_locked(&quiet)?;
    if let Some(why) = store.read_only() {
        return Err(SnapshotError::Refused {
            url: url.to_string(),
            reason: format!("the disk opens read-only ({why}), and a snapshot is a write"),
        });
    }
    let taken = store.snapshot(name)?;
    store.close().map_err(|source| SnapshotError::Store {
        url: url.to_string(),
        name: name.to_string(),
        source,
    })?;
    Ok(taken)
}

/// Every snapshot of the disk, by name; writes nothing.
pub fn snapshots(url: &S3Url) -> Result<Vec<SnapshotSummary>, SnapshotError> {
    let connection = snapshot_disk(url)?;
    let metadata = connection.metadata;
    let sealer = log::sealer_for(url, &metadata, &LogConfig::from_url(url))?;
    Ok(connection.runtime.block_on(log::describe_snapshots(
        &*connection.store,
        &connection.buckets,
        url,
        &metadata,
        &sealer,
    ))?)
}

/// Deletes snapshot `name`'s object (the segments only it held go at the next writable open
/// or `disk gc`). Needs no lock: a server holding the disk keeps the pins it has.
pub fn delete_snapshot(url: &S3Url, name: &str) -> Result<(), SnapshotError> {
    check_snapshot_name(name)?;
    let connection = snapshot_disk(url)?;
    let store: &dyn ObjectStore = &*connection.store;
    let listed = connection
        .runtime
        .block_on(log::list_snapshots(store, url))?;
    if !listed.iter().any(|listed| listed.name == name) {
        return Err(SnapshotError::Missing {
            url: url.to_string(),
            name: name.to_string(),
        });
    }
    let clones = connection.runtime.block_on(clones_of(store, url, name))?;
    if !clones.is_empty() {
        return Err(SnapshotError::HasClones {
            url: url.to_string(),
            name: name.to_string(),
            clones,
        });
    }
    let key = url.key(&log::snapshot_object_name(name));
    connection
        .runtime
        .block_on(store.delete(&ObjectPath::from(key.as_str())))
        .map_err(|error| SnapshotError::Store {
            url: url.to_string(),
            name: name.to_string(),
            source: crate::error::request_failed("DELETE", &key, error),
        })
}

/// The clones of snapshot `name` of the base disk `url`, as `s3://BUCKET/PREFIX` (in the
/// base's bucket or another), from the clone records under the base (module `log::clone`).
async fn clones_of(
    store: &dyn ObjectStore,
    url: &S3Url,
    name: &str,
) -> Result<Vec<String>, OpenError> {
    let objects = crate::store::list_folder(store, url, &format!("log/clones/{name}")).await?;
    Ok(objects
        .iter()
        .map(|object| {
            let record = object.location.filename().unwrap_or_default();
            log::clone_recorded(url, record)
                .unwrap_or_else(|| format!("(record `{}`)", object.location))
        })
        .collect())
}

/// What [`clone`] made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cloned {
    pub disk_id: u64,
    pub size_bytes: u64,
    /// Disk bytes the clone reads from its base snapshot.
    pub mapped_bytes: u64,
}

/// Makes a writable log-layout disk at `clone_url` that reads what it has not written from
/// snapshot `name` of the disk at `base_url` (module `log::clone`), copying no data: a clone
/// record under the base (so the snapshot cannot be deleted while the clone needs it), then
/// the clone's metadata object carrying its base (the base's size and compression; an
/// encrypted base needs the clone URL's `key-file=` to be the base's key), both create-only.
/// The clone may be in the base's bucket or another bucket of the same store: it reaches its
/// base with its own URL's endpoint, region, addressing and credentials, so the two URLs must
/// agree on those. Four requests ([`create_clone_objects`]); one HEAD more when the snapshot
/// names segments of no epoch (written before epochs, or by a clone made before the metadata
/// carried the base: a clone of such a clone is refused). Refused: a bad or missing name, a
/// clone at another endpoint or region, or inside the base's prefix, a base that is a clone
/// or that a `disk delete` is deleting, an existing disk at the clone's prefix, a clone's
/// bucket that does not exist.
pub fn clone(base_url: &S3Url, clone_url: &S3Url, name: &str) -> Result<Cloned, SnapshotError> {
    check_snapshot_name(name)?;
    let refused = |reason: String| SnapshotError::Refused {
        url: clone_url.to_string(),
        reason,
    };
    let shown = |value: &Option<String>, unset: &str| {
        value
            .as_deref()
            .map_or_else(|| unset.to_string(), |value| format!("`{value}`"))
    };
    for (parameter, base, clone, unset) in [
        ("endpoint=", &base_url.endpoint, &clone_url.endpoint, "AWS"),
        ("region=", &base_url.region, &clone_url.region, "none"),
    ] {
        if base != clone {
            return Err(refused(format!(
                "the base's {parameter} is {} and the clone's {}: a clone reads its base through its own URL's store settings (it records the base's bucket and prefix, not how to reach them), so both must name the same store",
                shown(base, unset),
                shown(clone, unset)
            )));
        }
    }
    if base_url.path_style_effective() != clone_url.path_style_effective() {
        return Err(refused(
            "the base's and the clone's path-style= differ: a clone reads its base through its own URL's store settings, so both must name the same store the same way".to_string(),
        ));
    }
    let nested = |outer: &str, inner: &str| {
        outer.is_empty() || inner == outer || inner.starts_with(&format!("{outer}/"))
    };
    let same_bucket = clone_url.bucket == base_url.bucket;
    if same_bucket
        && (nested(&base_url.prefix, &clone_url.prefix)
            || nested(&clone_url.prefix, &base_url.prefix))
    {
        return Err(refused(format!(
            "the clone's prefix `{}` and the base's `{}` overlap",
            clone_url.prefix, base_url.prefix
        )));
    }
    if clone_url.snapshot.is_some() {
        return Err(refused(
            "the clone's URL names a snapshot (snapshot=)".to_string(),
        ));
    }
    if base_url.snapshot.is_some() {
        return Err(SnapshotError::Refused {
            url: base_url.to_string(),
            reason: "the URL names a snapshot (snapshot=); name the disk itself".to_string(),
        });
    }
    let client = store::connect_client(base_url)?;
    let clone_store: Arc<dyn ObjectStore> = if same_bucket {
        client.store.clone()
    } else {
        store::bucket_client(clone_url, StoreMeters::new())?
    };
    client.runtime.block_on(create_clone_objects(
        &*client.store,
        &*clone_store,
        base_url,
        clone_url,
        name,
    ))
}

/// Why [`delete`] stopped.
#[derive(Debug, thiserror::Error)]
pub enum DeleteError {
    #[error("{url}: {reason}; nothing was changed")]
    Refused { url: String, reason: String },
    #[error(transparent)]
    Open(#[from] OpenError),
    #[error("{url}: deleting the disk: {source} (its metadata goes last: run `bufcache disk delete` again to finish)")]
    Store { url: String, source: StoreError },
}

impl DeleteError {
    /// Whether the error is the caller's (a disk in use, with clones, not there) rather
    /// than the store's: `bufcache disk` exits 2 for these.
    pub fn is_bad_input(&self) -> bool {
        match self {
            DeleteError::Refused { .. } => true,
            DeleteError::Open(error) => !matches!(
                error,
                OpenError::Request { .. } | OpenError::Client { .. } | OpenError::Runtime { .. }
            ),
            DeleteError::Store { .. } => false,
        }
    }
}

/// What [`delete`] removed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Deleted {
    /// Objects deleted under the disk's prefix (its metadata included, the lock not).
    pub objects: u64,
    pub bytes: u64,
    /// For a clone: the base's clone record deleted with it (`s3://BUCKET/PREFIX` of the
    /// base, and the snapshot), which lets that snapshot be deleted again.
    pub base: Option<(String, String)>,
}

/// Deletes the disk at `url`, every object under its prefix, holding its lock (refused while
/// a server holds it). Refused, nothing changed, while clones of its snapshots exist (named;
/// delete them first). A clone's record under its base goes too, after its own objects and
/// before its metadata: the metadata goes last, so a delete cut short leaves a disk that
/// another `disk delete` finishes, never a record or a clone half there.
///
/// A clone made while the delete runs is fenced off: once it holds the lock, the delete of a
/// log-layout disk marks the metadata as being deleted, then lists the clone records again
/// (a record found: the mark is taken off and the delete refused, nothing else changed).
/// A clone's creation stores its record before it reads the base's metadata
/// ([`create_clone_objects`]), so either that list finds the record or the creation finds
/// the mark and is refused: no clone is left reading segments this delete removes.
pub fn delete(url: &S3Url) -> Result<Deleted, DeleteError> {
    delete_calling(url, &mut |_| {})
}

/// The moments of a [`delete`] at which [`delete_calling`] calls its caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeleteMoment {
    /// The clone records were listed (none) and the lock taken; nothing is changed yet.
    Locked,
    /// The metadata is marked as being deleted; the records are listed next.
    Marked,
}

/// [`delete`], calling `between` at each [`DeleteMoment`] (a test makes a clone there).
pub fn delete_calling(
    url: &S3Url,
    between: &mut dyn FnMut(DeleteMoment),
) -> Result<Deleted, DeleteError> {
    let refused = |reason: String| DeleteError::Refused {
        url: url.to_string(),
        reason,
    };
    if url.snapshot.is_some() {
        return Err(refused(
            "the URL names a snapshot (snapshot=): `bufcache disk delete-snapshot` deletes one"
                .to_string(),
        ));
    }
    let connection = connect_with(url, Create::Never)?;
    let metadata = connection.metadata;
    if metadata.layout == LayoutKind::Log {
        let clones = connection
            .runtime
            .block_on(clones_recorded(&*connection.store, url))?;
        if !clones.is_empty() {
            return Err(refused(has_clones(&clones)));
        }
    }
    let lock = match connection.runtime.block_on(DiskLock::acquire(
        connection.runtime.handle().clone(),
        connection.store.clone(),
        url,
    ))? {
        Acquired::Held(lock) => lock,
        Acquired::WritesRefused(answer) => {
            return Err(refused(format!(
                "the store refuses writes with these credentials ({answer})"
            )))
        }
    };
    between(DeleteMoment::Locked);
    if metadata.layout == LayoutKind::Log {
        fence_off_clones(&connection, url, &lock, between)?;
    }
    let outcome = connection
        .runtime
        .block_on(delete_objects(&connection, url, &metadata));
    let released = connection.runtime.block_on(lock.release_async());
    let deleted = outcome?;
    released.map_err(|source| DeleteError::Store {
        url: url.to_string(),
        source,
    })?;
    Ok(deleted)
}

/// The clones the records under the base `url` name (empty: none): by snapshot, and a
/// record under no snapshot (its snapshot deleted by hand) named by its folder.
async fn clones_recorded(store: &dyn ObjectStore, url: &S3Url) -> Result<Vec<String>, OpenError> {
    let clones = clones_of_every_snapshot(store, url).await?;
    let recorded = crate::store::list_folder(store, url, "log/clones").await?;
    if !recorded.is_empty() && clones.is_empty() {
        return Ok(vec![records_folder(url)]);
    }
    Ok(clones)
}

/// The clones of every snapshot of the base `url` ([`clones_of`]).
async fn clones_of_every_snapshot(
    store: &dyn ObjectStore,
    url: &S3Url,
) -> Result<Vec<String>, OpenError> {
    let mut clones = Vec::new();
    for listed in log::list_snapshots(store, url).await? {
        clones.extend(clones_of(store, url, &listed.name).await?);
    }
    Ok(clones)
}

/// Names the clone records of the base `url` when none names its clone.
fn records_folder(url: &S3Url) -> String {
    format!("(records under `{}`)", url.key("log/clones"))
}

/// The fence of [`delete`] against a clone made meanwhile, holding `lock`: marks the metadata
/// as being deleted and lists the clone records again. A record found: the mark is taken off,
/// the lock released, and the delete refused naming the clones; a failure releases the lock.
fn fence_off_clones(
    connection: &store::Connection,
    url: &S3Url,
    lock: &DiskLock,
    between: &mut dyn FnMut(DeleteMoment),
) -> Result<(), DeleteError> {
    let store: &dyn ObjectStore = &*connection.store;
    let marked = connection
        .runtime
        .block_on(store::write_deleting(store, url, true));
    if marked.is_ok() {
        between(DeleteMoment::Marked);
    }
    let fenced = connection.runtime.block_on(async {
        marked?;
        let recorded = crate::store::list_folder(store, url, "log/clones").await?;
        if recorded.is_empty() {
            return Ok(None);
        }
        store::write_deleting(store, url, false).await?;
        let mut clones = clones_of_every_snapshot(store, url).await?;
        if clones.is_empty() {
            clones.push(records_folder(url));
        }
        Ok::<_, OpenError>(Some(clones))
    });
    let clones = match fenced {
        Ok(None) => return Ok(()),
        Ok(Some(clones)) => clones,
        Err(error) => {
            let _ = connection.runtime.block_on(lock.release_async());
            return Err(error.into());
        }
    };
    connection
        .runtime
        .block_on(lock.release_async())
        .map_err(|source| DeleteError::Store {
            url: url.to_string(),
            source,
        })?;
    Err(DeleteError::Refused {
        url: url.to_string(),
        reason: format!("{} (made while this delete ran)", has_clones(&clones)),
    })
}

/// Deletes every object under the disk's prefix but the metadata and the lock, then a
/// clone's record under its base (in the base's bucket, which may be another), then the
/// metadata, last, so a delete cut short leaves a disk another delete finishes.
async fn delete_objects(
    connection: &store::Connection,
    url: &S3Url,
    metadata: &DiskMetadata,
) -> Result<Deleted, DeleteError> {
    let store: &dyn ObjectStore = &*connection.store;
    let failed = |key: &str, error: object_store::Error| DeleteError::Store {
        url: url.to_string(),
        source: crate::error::request_failed("DELETE", key, error),
    };
    let base = if metadata.layout == LayoutKind::Log {
        clone_base_of(store, url, metadata).await?
    } else {
        None
    };
    let prefix = ObjectPath::from(url.prefix.as_str());
    let objects: Vec<object_store::ObjectMeta> = store
        .list((!url.prefix.is_empty()).then_some(&prefix))
        .try_collect()
        .await
        .map_err(|error| {
            DeleteError::Open(OpenError::Request {
                url: url.to_string(),
                operation: format!("listing `{}`", url.prefix),
                message: chain(&error),
            })
        })?;
    let metadata_key = url.key(METADATA_NAME);
    let lock_key = url.key(crate::lock::LOCK_NAME);
    let mut deleted = Deleted {
        objects: 0,
        bytes: 0,
        base: None,
    };
    for object in &objects {
        let key = object.location.as_ref();
        if key == metadata_key || key == lock_key {
            continue;
        }
        store
            .delete(&object.location)
            .await
            .map_err(|error| failed(key, error))?;
        deleted.objects += 1;
        deleted.bytes += object.size;
    }
    if let Some((base_url, snapshot)) = base {
        let key = log::clone_record_key(&base_url, &snapshot, url);
        let base_store = if base_url.bucket == url.bucket {
            None
        } else {
            Some(connection.buckets.store(&base_url.bucket)?)
        };
        let record_store: &dyn ObjectStore = base_store.as_deref().unwrap_or(store);
        match record_store.delete(&ObjectPath::from(key.as_str())).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
            Err(error) => return Err(failed(&key, error)),
        }
        deleted.base = Some((
            format!("s3://{}/{}", base_url.bucket, base_url.prefix),
            snapshot,
        ));
    }
    store
        .delete(&ObjectPath::from(metadata_key.as_str()))
        .await
        .map_err(|error| failed(&metadata_key, error))?;
    deleted.objects += 1;
    deleted.bytes += objects
        .iter()
        .find(|object| object.location.as_ref() == metadata_key)
        .map_or(0, |object| object.size);
    Ok(deleted)
}

/// Why a disk whose snapshots have `clones` is not deleted.
fn has_clones(clones: &[String]) -> String {
    format!(
        "clone(s) {} read segments of this disk's snapshots: delete them first",
        clones.join(", ")
    )
}

/// A clone's base (its URL and the snapshot) from its metadata or, for a clone made before
/// the metadata carried it, its `log/base` record; None for a disk that is no clone.
async fn clone_base_of(
    store: &dyn ObjectStore,
    url: &S3Url,
    metadata: &DiskMetadata,
) -> Result<Option<(S3Url, String)>, OpenError> {
    let sealer = log::sealer_for(url, metadata, &LogConfig::from_url(url))?;
    Ok(log::read_clone_record(store, url, metadata, &sealer)
        .await?
        .map(|(_, record)| (log::clone_base_url(url, &record), record.snapshot)))
}

/// Makes a clone of snapshot `name` of the disk at `base_url` at `clone_url` ([`clone`]
/// checked the URLs): `base_store` reaches the base's bucket, `clone_store` the clone's. In
/// this order, four requests:
/// 1. the clone record under the base, create-only (a record that is there already, a
///    clone at that prefix or a creation that crashed, is known not to be this call's, and
///    stays);
/// 2. the base's metadata (GET): refused when `disk delete` marked it as being deleted;
/// 3. the snapshot (GET);
/// 4. the clone's metadata carrying its base, create-only (a disk there is refused).
///
/// The record goes first, so a crash after it leaves a record naming no clone (the snapshot
/// stays until it is removed), never a clone whose snapshot may be deleted; and before the
/// base's metadata is read, which fences a concurrent `disk delete` of the base: the delete
/// marks the metadata before it looks for records the last time, so either it finds this
/// record, or this call finds the mark ([`delete`]). Refused after the record: it is
/// deleted again when this call made it.
pub(crate) async fn create_clone_objects(
    base_store: &dyn ObjectStore,
    clone_store: &dyn ObjectStore,
    base_url: &S3Url,
    clone_url: &S3Url,
    name: &str,
) -> Result<Cloned, SnapshotError> {
    let failed =
        |key: &str, operation: &'static str, error: object_store::Error| SnapshotError::Store {
            url: clone_url.to_string(),
            name: name.to_string(),
            source: crate::error::request_failed(operation, key, error),
        };
    let record_key = log::clone_record_key(base_url, name, clone_url);
    let record_location = ObjectPath::from(record_key.as_str());
    let recorded = base_store
        .put_opts(
            &record_location,
            PutPayload::from(format!("s3://{}/{}", clone_url.bucket, clone_url.prefix)),
            object_store::PutOptions {
                mode: object_store::PutMode::Create,
                ..Default::default()
            },
        )
        .await;
    let record_is_ours = match recorded {
        Ok(_) => true,
        Err(
            object_store::Error::AlreadyExists { .. } | object_store::Error::Precondition { .. },
        ) => false,
        Err(error) => return Err(failed(&record_key, "PUT", error)),
    };
    let made = clone_behind_record(base_store, clone_store, base_url, clone_url, name).await;
    if made.is_err() && record_is_ours {
        base_store
            .delete(&record_location)
            .await
            .map_err(|error| failed(&record_key, "DELETE", error))?;
    }
    made
}

/// [`create_clone_objects`] once the record is stored: checks the base and its snapshot and
/// writes the clone's metadata.
async fn clone_behind_record(
    base_store: &dyn ObjectStore,
    clone_store: &dyn ObjectStore,
    base_url: &S3Url,
    clone_url: &S3Url,
    name: &str,
) -> Result<Cloned, SnapshotError> {
    let refused = |reason: String| SnapshotError::Refused {
        url: clone_url.to_string(),
        reason,
    };
    let (base_metadata, deleting) = store::read_metadata_marked(base_store, base_url).await?;
    if deleting {
        return Err(refused(format!(
            "{base_url} is being deleted (a `bufcache disk delete` of it is running, or was cut short: run it again to finish)"
        )));
    }
    if base_metadata.layout != LayoutKind::Log {
        return Err(SnapshotError::Refused {
            url: base_url.to_string(),
            reason: "a chunk-layout disk rewrites its chunks in place and has no snapshots (use layout=log)".to_string(),
        });
    }
    let clone_of_clone = || {
        refused(format!(
            "{base_url} is itself a clone, and a clone of a clone is not supported"
        ))
    };
    if base_metadata.format_version == store::FORMAT_VERSION_LOG_CLONE {
        return Err(clone_of_clone());
    }
    if base_metadata.seal.key_check.is_some() && clone_url.key_file.is_none() {
        return Err(refused(
            "the base is encrypted: give the clone's URL key-file= with the base's key".to_string(),
        ));
    }
    let base_sealer = log::sealer_for(base_url, &base_metadata, &LogConfig::from_url(base_url))?;
    let taken = log::read_snapshot(base_store, base_url, &base_metadata, &base_sealer, name)
        .await?
        .ok_or_else(|| SnapshotError::Missing {
            url: base_url.to_string(),
            name: name.to_string(),
        })?;
    // A segment of no epoch was written before epochs, or is the base's own base's (a clone
    // made before the metadata carried the base names those so): only then can the base be
    // such a clone, which its `log/base` tells.
    let epochs = taken
        .epochs
        .as_ref()
        .expect("snapshots record their epochs");
    let names_epochless = taken
        .index
        .live_bytes_by_segment()
        .keys()
        .any(|&sequence| epochs.owner(sequence) == 0);
    if names_epochless {
        let base_record = base_url.key(log::CLONE_BASE_NAME);
        match base_store
            .head(&ObjectPath::from(base_record.as_str()))
            .await
        {
            Err(object_store::Error::NotFound { .. }) => {}
            Ok(_) => return Err(clone_of_clone()),
            Err(error) => {
                return Err(SnapshotError::Open(OpenError::Request {
                    url: base_url.to_string(),
                    operation: format!("looking for `{base_record}`"),
                    message: chain(&error),
                }))
            }
        }
    }
    let mut asked = clone_url.clone();
    asked.compression = Some(base_metadata.seal.compression);
    let (clone_metadata, body, _) = log::new_clone_metadata(
        &asked,
        base_metadata.size_bytes,
        base_metadata.disk_id,
        name,
        &base_url.prefix,
        Some(&base_url.bucket),
    )?;
    let created = match store::create_metadata(clone_store, &asked, &clone_metadata, &body).await {
        // Stores answer a PUT into a missing bucket differently (moto: NoSuchBucket,
        // SeaweedFS: AccessDenied); a LIST says which it was (a request more, on failure only).
        Err(OpenError::Request { message, .. })
            if crate::error::says_no_bucket(&message)
                || bucket_missing(clone_store, clone_url).await =>
        {
            return Err(refused(format!(
                "bucket `{}` does not exist at this endpoint (create it first)",
                clone_url.bucket
            )))
        }
        created => created?,
    };
    if !created {
        return Err(refused(
            "a disk exists at the clone's prefix already".to_string(),
        ));
    }
    Ok(Cloned {
        disk_id: clone_metadata.disk_id,
        size_bytes: clone_metadata.size_bytes,
        mapped_bytes: taken.index.mapped_bytes(),
    })
}

/// Whether the bucket `url` names does not exist, as a LIST of its prefix answers (false when
/// the LIST works or fails otherwise).
async fn bucket_missing(store: &dyn ObjectStore, url: &S3Url) -> bool {
    let prefix = ObjectPath::from(url.prefix.as_str());
    match store
        .list_with_delimiter((!url.prefix.is_empty()).then_some(&prefix))
        .await
    {
        Ok(_) => false,
        Err(error) => crate::error::says_no_bucket(&chain(&error)),
    }
}
