//! `bufcache disk`: an object-store disk as its owner manages it, without serving it —
//! create, info, verify, resize, delete, snapshots and clones (a served disk is snapshotted
//! and grown through its server's control socket). Exit status: 0 done, 1 damage found
//! (verify) or a failure of the store, 2 bad input (a URL, a size, a disk that is not there
//! or is in use).

use std::io::IsTerminal;

use bufcache::config::parse_size;
use bufcache_s3::admin::{self, DiskInfo, LayoutInfo, VerifyProgress, VerifyReport};
use bufcache_s3::{LayoutKind, S3Url};
use clap::{Args, Subcommand};
use serde_json::json;

use crate::BadInput;

#[derive(Args)]
pub(crate) struct DiskArgs {
    #[command(subcommand)]
    command: DiskCommand,
}

#[derive(Subcommand)]
enum DiskCommand {
    /// Create a disk: its layout and parameters come from the URL (`layout=chunk|log`,
    /// `chunk-size=`, `segment-size=`, `compress=`, `key-file=`). Refused when anything is
    /// stored under the prefix already.
    Create {
        /// The disk's URL (s3://BUCKET/PREFIX?endpoint=...).
        url: String,
        /// The disk's size (bytes, or with a K, M, G, T suffix).
        #[arg(long, value_name = "SIZE", value_parser = size)]
        size: u64,
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show a disk's size, layout, format, objects, live and garbage bytes, epochs and lock
    /// holder. Writes nothing; a disk a server holds is shown as the store has it now.
    Info {
        url: String,
        #[arg(long)]
        json: bool,
    },
    /// Read every object of the disk and check it (checksums, tags of an encrypted disk, the
    /// index against the segments). Writes nothing. Exit 1 naming each damaged object.
    Verify {
        url: String,
        #[arg(long)]
        json: bool,
    },
    /// Collect a log-layout disk's garbage while no server holds it: rewrite the live data of
    /// segments mostly overwritten, then delete them. Progress after each round.
    Gc {
        url: String,
        /// Rewrite segments whose live fraction is below this (default: the URL's
        /// gc-threshold=, else 0.5).
        #[arg(long, value_name = "FRACTION", value_parser = fraction)]
        threshold: Option<f64>,
        #[arg(long)]
        json: bool,
    },
    /// Change a disk's size. Growing adds zeroes; shrinking over data is refused (chunk
    /// layout: --force deletes the chunks past the end). A served disk grows
    /// through its server: give the server's control socket (`bufcache serve --control
    /// PATH`); clients see the new size when they connect again.
    Resize {
        url: String,
        /// The new size (bytes, or with a K, M, G, T suffix).
        #[arg(value_parser = size)]
        size: u64,
        /// Shrink a chunk-layout disk even though chunks past the new end hold data (deleted).
        #[arg(long)]
        force: bool,
        /// The control socket of the server holding the disk (growing only).
        #[arg(long, value_name = "PATH")]
        control: Option<std::path::PathBuf>,
        #[arg(long)]
        json: bool,
    },
    /// Take snapshot NAME of a log-layout disk: an immutable copy of the disk as it stands
    /// at a flush point, costing no data copy. A served disk's snapshot is taken by its
    /// server: give the server's control socket (`bufcache serve --control PATH`).
    Snapshot {
        url: String,
        /// Letters, digits and - _ . : + @, at most 100 bytes.
        name: String,
        /// The control socket of the server holding the disk.
        #[arg(long, value_name = "PATH")]
        control: Option<std::path::PathBuf>,
        #[arg(long)]
        json: bool,
    },
    /// List a log-layout disk's snapshots: what each maps and the bytes only snapshots hold.
    /// Writes nothing. Serve one read-only with snapshot=NAME in the URL.
    Snapshots {
        url: String,
        #[arg(long)]
        json: bool,
    },
    /// Make a writable disk at DST_URL that reads what it has not written from snapshot NAME
    /// of the disk at SRC_URL (in the same bucket or another bucket of the same store: same
    /// endpoint= and region=), copying no data. The snapshot cannot be deleted while the
    /// clone exists.
    Clone {
        src_url: String,
        dst_url: String,
        #[arg(long, value_name = "NAME")]
        snapshot: String,
        #[arg(long)]
        json: bool,
    },
    /// Delete a disk: every object under its prefix (a clone: its record under the base
    /// too, which lets the base's snapshot go). Refused while a server holds it or while
    /// clones of its snapshots exist.
    Delete {
        url: String,
        #[arg(long)]
        json: bool,
    },
    /// Delete snapshot NAME (its object; the segments only it held are freed by the next
    /// writable open or `disk gc`). Refused while a clone depends on it.
    DeleteSnapshot {
        url: String,
        name: String,
        #[arg(long)]
        json: bool,
    },
}

/// A snapshot command's error with the exit status convention: bad input (a name, a disk
/// that refuses it) exits 2, a failure of the store 1.
fn snapshot_failed(error: bufcache_s3::SnapshotError) -> anyhow::Error {
    if error.is_bad_input() {
        BadInput(error.to_string()).into()
    } else {
        anyhow::Error::new(error)
    }
}

fn size(text: &str) -> Result<u64, String> {
    parse_size(text).map_err(|error| error.to_string())
}

fn fraction(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(value) if value > 0.0 && value <= 1.0 => Ok(value),
        _ => Err(format!("`{text}` is not a fraction above 0 and at most 1")),
    }
}

fn parse_url(text: &str) -> anyhow::Result<S3Url> {
    if !text.starts_with("s3://") {
        return Err(BadInput(format!(
            "`{text}`: `bufcache disk` manages object-store disks (s3://BUCKET/PREFIX?...); for an image file use qemu-img info / check / resize"
        ))
        .into());
    }
    Ok(S3Url::parse(text).map_err(bufcache_s3::OpenError::from)?)
}

pub(crate) fn run(args: DiskArgs) -> anyhow::Result<()> {
    match args.command {
        DiskCommand::Create { url, size, json } => create(url, size, json),
        DiskCommand::Info { url, json } => info(url, json),
        DiskCommand::Verify { url, json } => verify(url, json),
        DiskCommand::Gc {
            url,
            threshold,
            json,
        } => collect(url, threshold, json),
        DiskCommand::Snapshot {
            url,
            name,
            control,
            json,
        } => snapshot(url, name, control, json),
        DiskCommand::Snapshots { url, json } => snapshots(url, json),
        DiskCommand::Clone {
            src_url,
            dst_url,
            snapshot,
            json,
        } => clone(src_url, dst_url, snapshot, json),
        DiskCommand::Delete { url, json } => delete(url, json),
        DiskCommand::DeleteSnapshot { url, name, json } => delete_snapshot(url, name, json),
        DiskCommand::Resize {
            url,
            size,
            force,
            control,
            json,
        } => resize(url, size, force, control, json),
    }
}

/// `bufcache disk create`.
fn create(url: String, size: u64, json: bool) -> anyhow::Result<()> {
    let url = parse_url(&url)?;
    let metadata = admin::create(&url, size)?;
    let info = admin::info(&url)?;
    debug_assert_eq!(info.metadata.disk_id, metadata.disk_id);
    print_info(&url, &info, json);
    Ok(())
}

/// `bufcache disk info`.
fn info(url: String, json: bool) -> anyhow::Result<()> {
    let url = parse_url(&url)?;
    let info = admin::info(&url)?;
    print_info(&url, &info, json);
    Ok(())
}

/// `bufcache disk verify`.
fn verify(url: String, json: bool) -> anyhow::Result<()> {
    let url = parse_url(&url)?;
    let show_progress = !json && std::io::stderr().is_terminal();
    let mut progress = |done: VerifyProgress| {
        if show_progress {
            eprint!(
                "\rverify: {}/{} objects, {}/{} bytes",
                done.objects_done, done.objects_total, done.bytes_done, done.bytes_total
            );
        }
    };
    let report = admin::verify(&url, &mut progress)?;
    if show_progress {
        eprintln!();
    }
    print_verify(&url, &report, json);
    if report.damaged.is_empty() {
        Ok(())
    } else {
        crate::log::flush(crate::log::EXIT_FLUSH_WAIT);
        std::process::exit(1);
    }
}

/// `bufcache disk gc`.
fn collect(url: String, threshold: Option<f64>, json: bool) -> anyhow::Result<()> {
    let url = parse_url(&url)?;
    let show_progress = !json && std::io::stderr().is_terminal();
    let totals = admin::collect(&url, threshold, &mut |totals| {
        if show_progress {
            eprint!(
                "\rgc: round {}: {} segments rewritten ({} bytes read), {} deleted ({} bytes)",
                totals.rounds,
                totals.segments_rewritten,
                totals.bytes_read,
                totals.segments_deleted,
                totals.bytes_deleted
            );
        }
    })
    .map_err(|error| match error {
        admin::CollectError::Open(open) => anyhow::Error::new(open),
        admin::CollectError::NotALog { .. } => BadInput(error.to_string()).into(),
        admin::CollectError::Store { .. } => anyhow::Error::new(error),
    })?;
    if show_progress {
        eprintln!();
    }
    let info = admin::info(&url)?;
    let garbage = match &info.layout {
        LayoutInfo::Log(Ok(log)) => log.garbage_bytes(),
        _ => 0,
    };
    if json {
        print_json(&json!({
            "url": url.to_string(),
            "rounds": totals.rounds,
            "segments_rewritten": totals.segments_rewritten,
            "bytes_read": totals.bytes_read,
            "segments_deleted": totals.segments_deleted,
            "bytes_deleted": totals.bytes_deleted,
            "garbage_bytes_left": garbage,
        }));
    } else {
        crate::print_quietly(&format!(
            "{url}: {} segments rewritten ({} read), {} deleted ({} freed) in {} rounds; {} of garbage left\n",
            totals.segments_rewritten,
            human(totals.bytes_read),
            totals.segments_deleted,
            human(totals.bytes_deleted),
            totals.rounds,
            human(garbage)
        ));
    }
    Ok(())
}

/// `bufcache disk snapshot`.
fn snapshot(
    url: String,
    name: String,
    control: Option<std::path::PathBuf>,
    json: bool,
) -> anyhow::Result<()> {
    let url = parse_url(&url)?;
    let taken = match &control {
        Some(path) => crate::control::request_snapshot(path, &url, &name)?,
        None => admin::snapshot(&url, &name).map_err(|error| match error {
            bufcache_s3::SnapshotError::Open(
                bufcache_s3::OpenError::Locked { ref holder, .. }
                | bufcache_s3::OpenError::LeaseHeld { ref holder, .. },
            ) => BadInput(format!(
                "{url}: the disk is served by {holder}: its server takes the snapshot; run `bufcache disk snapshot URL {} --control PATH` with that server's --control socket (nothing was changed)",
                name.escape_debug()
            ))
            .into(),
            other => snapshot_failed(other),
        })?,
    };
    if json {
        print_json(&json!({
            "url": url.to_string(),
            "name": name,
            "through_sequence": taken.through_sequence,
            "mapped_bytes": taken.mapped_bytes,
            "segments": taken.segments,
            "object_bytes": taken.object_bytes,
            "by_server": control.is_some(),
        }));
    } else {
        crate::print_quietly(&format!(
            "{url}: snapshot `{name}` taken{}: {} mapped in {} segments (log through segment {}), a {}-byte record, no data copied\n",
            if control.is_some() { " by the server" } else { "" },
            human(taken.mapped_bytes),
            taken.segments,
            taken.through_sequence,
            taken.object_bytes,
        ));
    }
    Ok(())
}

/// `bufcache disk snapshots`.
fn snapshots(url: String, json: bool) -> anyhow::Result<()> {
    let url = parse_url(&url)?;
    let listed = admin::snapshots(&url).map_err(snapshot_failed)?;
    if json {
        print_json(&json!({
            "url": url.to_string(),
            "snapshots": listed.iter().map(|snapshot| json!({
                "name": snapshot.name,
                "through_sequence": snapshot.through_sequence,
                "mapped_bytes": snapshot.mapped_bytes,
                "mapped_extents": snapshot.mapped_extents,
                "segments": snapshot.segments,
                "segment_bytes": snapshot.segment_bytes,
                "held_bytes": snapshot.held_bytes,
                "object_bytes": snapshot.object_bytes,
            })).collect::<Vec<_>>(),
        }));
    } else {
        let mut text = format!("{url}: {} snapshot(s)\n", listed.len());
        for snapshot in &listed {
            text += &format!(
                "{:<24} {} mapped, {} segments ({}), {} held by snapshots alone, through segment {}\n",
                snapshot.name,
                human(snapshot.mapped_bytes),
                snapshot.segments,
                human(snapshot.segment_bytes),
                human(snapshot.held_bytes),
                snapshot.through_sequence
            );
        }
        crate::print_quietly(&text);
    }
    Ok(())
}

/// `bufcache disk clone`.
fn clone(src_url: String, dst_url: String, snapshot: String, json: bool) -> anyhow::Result<()> {
    let base = parse_url(&src_url)?;
    let clone = parse_url(&dst_url)?;
    let made = admin::clone(&base, &clone, &snapshot).map_err(snapshot_failed)?;
    if json {
        print_json(&json!({
            "url": clone.to_string(),
            "base": base.to_string(),
            "snapshot": snapshot,
            "disk_id": format!("{:016x}", made.disk_id),
            "size_bytes": made.size_bytes,
            "mapped_bytes": made.mapped_bytes,
        }));
    } else {
        crate::print_quietly(&format!(
            "{clone}: a clone of snapshot `{snapshot}` of {base}, {} bytes, {} read from the snapshot, no data copied\n",
            made.size_bytes,
            human(made.mapped_bytes)
        ));
    }
    Ok(())
}

/// `bufcache disk delete`.
fn delete(url: String, json: bool) -> anyhow::Result<()> {
    let url = parse_url(&url)?;
    let deleted = admin::delete(&url).map_err(|error| -> anyhow::Error {
        if error.is_bad_input() {
            BadInput(error.to_string()).into()
        } else {
            anyhow::Error::new(error)
        }
    })?;
    if json {
        print_json(&json!({
            "url": url.to_string(),
            "objects_deleted": deleted.objects,
            "bytes_deleted": deleted.bytes,
            "base": deleted.base.as_ref().map(|(base, snapshot)| json!({
                "url": base,
                "snapshot": snapshot,
            })),
        }));
    } else {
        crate::print_quietly(&format!(
            "{url}: deleted, {} objects, {}{}\n",
            deleted.objects,
            human(deleted.bytes),
            match &deleted.base {
                Some((base, snapshot)) => format!(
                    "; its record under {base} is gone, so snapshot `{snapshot}` can be deleted when no other clone needs it"
                ),
                None => String::new(),
            }
        ));
    }
    Ok(())
}

/// `bufcache disk delete-snapshot`.
fn delete_snapshot(url: String, name: String, json: bool) -> anyhow::Result<()> {
    let url = parse_url(&url)?;
    admin::delete_snapshot(&url, &name).map_err(snapshot_failed)?;
    if json {
        print_json(&json!({ "url": url.to_string(), "deleted": name }));
    } else {
        crate::print_quietly(&format!(
            "{url}: snapshot `{name}` deleted; the segments only it held go at the next open or `disk gc`\n"
        ));
    }
    Ok(())
}

/// `bufcache disk resize`.
fn resize(
    url: String,
    size: u64,
    force: bool,
    control: Option<std::path::PathBuf>,
    json: bool,
) -> anyhow::Result<()> {
    let url = parse_url(&url)?;
    let resized = match &control {
        Some(_) if force => {
            return Err(BadInput(format!(
                "{url}: --force shrinks over data, and a served disk only grows: stop the server to shrink it (nothing was changed)"
            ))
            .into())
        }
        Some(path) => {
            let (before, after) = crate::control::request_resize(path, &url, size)?;
            admin::Resized {
                size_bytes_before: before,
                size_bytes_after: after,
                chunks_deleted: 0,
            }
        }
        None => admin::resize(&url, size, force).map_err(|error| match error {
            bufcache_s3::OpenError::Locked {
                ref holder, ref id, ..
            } => BadInput(format!(
                "{url}: the disk is in use by {holder}: a served disk grows through its server, `bufcache disk resize URL {size} --control PATH` with that server's control socket; if that server is no longer running, add break-lock={id} to the URL (nothing was changed)"
            ))
            .into(),
            error => anyhow::Error::new(error)
                .context(format!("resizing {url} to {size} bytes")),
        })?,
    };
    if json {
        print_json(&json!({
            "url": url.to_string(),
            "size_bytes_before": resized.size_bytes_before,
            "size_bytes_after": resized.size_bytes_after,
            "chunks_deleted": resized.chunks_deleted,
            "by_server": control.is_some(),
        }));
    } else {
        crate::print_quietly(&format!(
            "{url}: resized from {} to {} bytes{}\n",
            resized.size_bytes_before,
            resized.size_bytes_after,
            if resized.chunks_deleted > 0 {
                format!(
                    " ({} chunk objects past the end deleted)",
                    resized.chunks_deleted
                )
            } else {
                String::new()
            }
        ));
    }
    Ok(())
}

fn print_json(value: &serde_json::Value) {
    crate::print_quietly(&format!(
        "{}\n",
        serde_json::to_string_pretty(value).expect("JSON values always serialize")
    ));
}

fn info_json(url: &S3Url, info: &DiskInfo) -> serde_json::Value {
    let metadata = &info.metadata;
    let seal = &metadata.seal;
    let lock = info.lock.as_ref().map(|lock| {
        json!({
            "id": lock.holder.id,
            "host": lock.holder.host,
            "pid": lock.holder.pid,
            "since": lock.holder.since,
            "age_seconds": lock.age_seconds,
        })
    });
    let layout = match &info.layout {
        LayoutInfo::Chunk {
            chunks,
            chunk_bytes,
        } => json!({
            "chunk_size_bytes": metadata.chunk_size_bytes,
            "chunk_checksums": metadata.chunk_checksums,
            "chunks": chunks,
            "chunk_bytes": chunk_bytes,
        }),
        LayoutInfo::Log(Ok(log)) => json!({
            "segments": log.segments,
            "segment_bytes": log.segment_bytes,
            "live_segments": log.live_segments,
            "live_segment_bytes": log.live_segment_bytes,
            "garbage_bytes": log.garbage_bytes(),
            "unneeded_segments": log.unneeded_segments,
            "mapped_bytes": log.mapped_bytes,
            "mapped_extents": log.mapped_extents,
            "checkpoints": log.checkpoints,
            "checkpoint_through": log.checkpoint_through,
            "sequence_last": log.sequence_last,
            "epoch_objects": log.epoch_objects,
            "epoch_newest": log.epoch_newest,
            "snapshots": log.snapshots,
            "snapshot_segments": log.snapshot_segments,
            "snapshot_only_segments": log.snapshot_only_segments,
            "snapshot_only_bytes": log.snapshot_only_bytes,
        }),
        LayoutInfo::Log(Err(reason)) => json!({ "error": reason.to_string() }),
    };
    json!({
        "url": url.to_string(),
        "disk_id": format!("{:016x}", metadata.disk_id),
        "size_bytes": metadata.size_bytes,
        "layout": metadata.layout.name(),
        "format_version": metadata.format_version,
        "generation": metadata.generation,
        "compression": seal.compression.name(),
        "encrypted": seal.key_check.is_some(),
        "lock": lock,
        "objects": layout,
    })
}

fn print_info(url: &S3Url, info: &DiskInfo, as_json: bool) {
    if as_json {
        print_json(&info_json(url, info));
        return;
    }
    let metadata = &info.metadata;
    let mut text = format!(
        "disk         {url}\nid           {:016x}\nsize         {} bytes ({})\nlayout       {} (format version {})\ngeneration   {} (writable opens)\n",
        metadata.disk_id,
        metadata.size_bytes,
        human(metadata.size_bytes),
        metadata.layout.name(),
        metadata.format_version,
        metadata.generation,
    );
    if metadata.layout == LayoutKind::Log {
        text += &format!(
            "sealing      compression {}, {}\n",
            metadata.seal.compression.name(),
            if metadata.seal.key_check.is_some() {
                "encrypted (every object tagged)"
            } else {
                "not encrypted"
            }
        );
    }
    text += &match &info.lock {
        None => "lock         free (no server holds the disk)\n".to_string(),
        Some(lock) => format!(
            "lock         held by {}{}\n",
            lock.holder,
            lock.age_seconds
                .map(|age| format!(", for {age} s"))
                .unwrap_or_default()
        ),
    };
    text += &match &info.layout {
        LayoutInfo::Chunk {
            chunks,
            chunk_bytes,
        } => format!(
            "chunks       {chunks} stored of {} ({} each{}), {chunk_bytes} bytes ({})\n",
            metadata.size_bytes / metadata.chunk_size_bytes.max(1),
            human(metadata.chunk_size_bytes),
            if metadata.chunk_checksums {
                ", block checksums"
            } else {
                ", no checksums"
            },
            human(*chunk_bytes)
        ),
        LayoutInfo::Log(Ok(log)) => format!(
            "segments     {} ({}), {} live ({}), {} no open needs\nlive data    {} bytes mapped in {} extents ({})\ngarbage      {} bytes in live segments ({})\ncheckpoints  {}, the newest covering segments to {}; log ends at segment {}\nepochs       {} objects, newest {}\nsnapshots    {}, naming {} segments; {} segments ({}) held by snapshots alone\n",
            log.segments,
            human(log.segment_bytes),
            log.live_segments,
            human(log.live_segment_bytes),
            log.unneeded_segments,
            log.mapped_bytes,
            log.mapped_extents,
            human(log.mapped_bytes),
            log.garbage_bytes(),
            human(log.garbage_bytes()),
            log.checkpoints,
            log.checkpoint_through,
            log.sequence_last,
            log.epoch_objects,
            log.epoch_newest,
            log.snapshots,
            log.snapshot_segments,
            log.snapshot_only_segments,
            human(log.snapshot_only_bytes),
        ),
        LayoutInfo::Log(Err(reason)) => {
            format!("log          does not recover: {reason}\n")
        }
    };
    crate::print_quietly(&text);
}

fn print_verify(url: &S3Url, report: &VerifyReport, as_json: bool) {
    if as_json {
        print_json(&json!({
            "url": url.to_string(),
            "objects_read": report.read.objects_done,
            "bytes_read": report.read.bytes_done,
            "damaged": report.damaged.iter().map(|damage| json!({
                "key": damage.key,
                "reason": damage.reason,
            })).collect::<Vec<_>>(),
        }));
        return;
    }
    let mut text = String::new();
    for damage in &report.damaged {
        text += &format!("damaged: {}: {}\n", damage.key, damage.reason);
    }
    text += &format!(
        "{url}: {} object(s), {} bytes read; {}\n",
        report.read.objects_done,
        report.read.bytes_done,
        if report.damaged.is_empty() {
            "no damage found".to_string()
        } else {
            format!("{} damaged", report.damaged.len())
        }
    );
    crate::print_quietly(&text);
}

fn human(bytes: u64) -> String {
    bufcache::device::size::format_size_rounded(bytes)
}
