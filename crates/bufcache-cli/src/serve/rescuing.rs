//! Rescue files: the ones this server may write (locked at start), a file left by an
//! earlier shutdown replayed (or discarded) before serving, and dirty data saved at a
//! shutdown that could not write it back.

use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use anyhow::{bail, Context};
use bufcache::{Cache, CountingDevice, Device, ObjectHandle};

use super::{ServeArgs, EXIT_RESCUED};
use crate::log::say;
use crate::rescue::{self, BackendIdentity, RescueAction};

/// One rescue file this server may write: its path, the backends it holds data for, and the
/// lock that makes it this server's alone.
pub(super) struct RescueTarget {
    pub path: PathBuf,
    pub backends: Vec<rescue::Backend>,
    pub lock: rescue::RescueLock,
}

/// The rescue files of this server, locked: `--rescue-file` for every export, or by default one
/// file per export derived from its backend. Memory backends have none (they end with the
/// process). A second server on the same backend fails here, naming the first one's pid.
pub(super) fn rescue_targets(
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
pub(super) fn rescue_and_exit(
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
pub(super) fn handle_rescue_file(
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
