//! The server's control socket (`bufcache serve --control PATH`): how an owner reaches the
//! server that holds a disk, for what only the lock holder may do: taking a snapshot
//! (`bufcache disk snapshot URL NAME --control PATH`) and growing the disk (`bufcache disk
//! resize URL SIZE --control PATH`).
//!
//! A unix stream socket, created with mode 0600 (the server's user only: a snapshot is a
//! write to the disk's bucket). One request per connection, one line of JSON each way:
//!
//! ```text
//! → {"command":"snapshot","disk":"s3://BUCKET/PREFIX","name":"NAME"}
//! ← {"ok":true,"through_sequence":N,"mapped_bytes":N,"segments":N,"object_bytes":N,"seconds":F}
//! → {"command":"resize","disk":"s3://BUCKET/PREFIX","size_bytes":N}
//! ← {"ok":true,"size_bytes_before":N,"size_bytes_after":N,"seconds":F}
//! ← {"ok":false,"bad_input":true|false,"error":"one line"}
//! ```
//!
//! A snapshot: the server writes every dirty buffer back and flushes (the flush point: every
//! write a client had acknowledged is in the snapshot), then the disk takes the snapshot
//! ([`bufcache_s3::LogStore::snapshot`]). A resize only grows: the disk first
//! ([`bufcache_s3::LogStore::grow`], which records the size in the metadata object), then the
//! cache's object, so a client that connects afterwards is told the new size (one connected
//! before keeps the size it was told; NBD has no message for a change). Requests are served
//! one at a time.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bufcache::ObjectHandle;
use bufcache_s3::{S3Device, S3Url, SnapshotTaken};
use serde_json::{json, Value};

use crate::BadInput;

/// The longest request line the server reads (a name is at most 100 bytes; a disk name is
/// a bucket and a prefix).
const REQUEST_BYTES_MAX: u64 = 16 << 10;

/// How long a client waits for the server's answer (a snapshot waits for the write-back of
/// whatever is dirty).
const REPLY_TIMEOUT: Duration = Duration::from_secs(600);

/// Writes back every dirty buffer and flushes the devices below (the engine's sync).
pub(crate) type Sync = Box<dyn Fn() -> Result<(), bufcache::CacheError> + Send>;

/// A disk the server holds: its device, and the cache's object over it (what its export
/// serves).
pub(crate) struct Held {
    pub device: Arc<S3Device>,
    pub object: ObjectHandle,
}

/// The name a disk is addressed by on the control socket: `s3://BUCKET/PREFIX`.
fn disk_name(url: &S3Url) -> String {
    format!("s3://{}/{}", url.bucket, url.prefix)
}

/// The control socket, bound but not yet answering: bound at start before any disk is
/// opened for writing, so that a path in use refuses the start with every store unchanged.
pub(crate) struct Bound {
    listener: UnixListener,
    path: PathBuf,
}

/// Binds `path` (a stale socket file no server answers on is replaced), mode 0600.
pub(crate) fn bind(path: &Path) -> anyhow::Result<Bound> {
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(BadInput(format!(
                "--control {}: another server answers on this socket",
                path.display()
            ))
            .into());
        }
        std::fs::remove_file(path)
            .with_context(|| format!("--control {}: removing a stale socket", path.display()))?;
    }
    let listener = UnixListener::bind(path)
        .with_context(|| format!("--control {}: cannot listen", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("--control {}: cannot restrict to this user", path.display()))?;
    Ok(Bound {
        listener,
        path: path.to_path_buf(),
    })
}

/// Serves requests for `disks` on the bound socket, on a thread of its own for the life of
/// the process.
pub(crate) fn start(bound: Bound, disks: Vec<Held>, sync: Sync) -> anyhow::Result<()> {
    let Bound { listener, path } = bound;
    std::thread::Builder::new()
        .name("bufcache-control".into())
        .spawn(move || {
            for stream in listener.incoming() {
                match stream {
                    Ok(stream) => {
                        if let Err(error) = serve_one(stream, &disks, &sync) {
                            tracing::warn!(control = %path.display(), error = %error, "control request failed");
                        }
                    }
                    Err(error) => {
                        tracing::warn!(control = %path.display(), error = %error, "control socket accept failed");
                    }
                }
            }
        })
        .context("starting the control socket thread")?;
    Ok(())
}

/// Why the server refused a control request: the reply's `error`, and whether the request
/// itself was wrong (`bad_input`: nothing was changed) or the server failed doing it.
#[derive(Debug, thiserror::Error)]
enum ControlError {
    #[error("not a JSON request line: {0}")]
    NotJson(#[source] serde_json::Error),
    #[error("the request has no string field `{0}`")]
    NoStringField(&'static str),
    #[error("the request has no whole-number field `size_bytes`")]
    NoSize,
    #[error("unknown command `{}`; known: snapshot, resize", .0.escape_debug())]
    UnknownCommand(String),
    #[error("this server holds no log-layout disk {disk} (it holds: {})", held_names(.held))]
    NotHeld { disk: String, held: Vec<String> },
    #[error(transparent)]
    Snapshot(Box<bufcache_s3::SnapshotError>),
    #[error("writing back dirty data before the snapshot: {0}")]
    WriteBack(#[source] Box<bufcache::CacheError>),
    #[error("{disk}: new size {size_bytes} is not a whole number of the export's {block_size}-byte blocks: nothing was changed")]
    NotWholeBlocks {
        disk: String,
        size_bytes: u64,
        block_size: u64,
    },
    #[error(transparent)]
    Grow(Box<bufcache_s3::OpenError>),
    #[error("{disk}: the disk grew to {size_bytes} bytes, but the export did not: {error}")]
    ExportNotGrown {
        disk: String,
        size_bytes: u64,
        #[source]
        error: Box<bufcache::CacheError>,
    },
}

/// The disks a server holds, for a refusal naming them.
fn held_names(held: &[String]) -> String {
    if held.is_empty() {
        "none".to_string()
    } else {
        held.join(", ")
    }
}

impl ControlError {
    /// True when the request was wrong, not the server (the reply's `bad_input`).
    fn is_bad_input(&self) -> bool {
        match self {
            ControlError::NotJson(_)
            | ControlError::NoStringField(_)
            | ControlError::NoSize
            | ControlError::UnknownCommand(_)
            | ControlError::NotHeld { .. }
            | ControlError::NotWholeBlocks { .. } => true,
            ControlError::Snapshot(error) => error.is_bad_input(),
            // A store that could not be reached is the server's failure; any other refusal
            // of the new size (smaller, too large) is the request's.
            ControlError::Grow(error) => !matches!(**error, bufcache_s3::OpenError::Request { .. }),
            ControlError::WriteBack(_) | ControlError::ExportNotGrown { .. } => false,
        }
    }
}

fn serve_one(stream: UnixStream, disks: &[Held], sync: &Sync) -> std::io::Result<()> {
    let mut line = String::new();
    BufReader::new(std::io::Read::take(&stream, REQUEST_BYTES_MAX)).read_line(&mut line)?;
    let reply = match answer(&line, disks, sync) {
        Ok(reply) => reply,
        Err(error) => json!({
            "ok": false,
            "bad_input": error.is_bad_input(),
            "error": error.to_string(),
        }),
    };
    let mut stream = stream;
    writeln!(stream, "{reply}")?;
    stream.flush()
}

/// The reply to one request line.
fn answer(line: &str, disks: &[Held], sync: &Sync) -> Result<Value, ControlError> {
    let request: Value = serde_json::from_str(line.trim()).map_err(ControlError::NotJson)?;
    let field = |name: &'static str| {
        request[name]
            .as_str()
            .ok_or(ControlError::NoStringField(name))
    };
    let size_bytes = || request["size_bytes"].as_u64().ok_or(ControlError::NoSize);
    let command = field("command")?;
    if command != "snapshot" && command != "resize" {
        return Err(ControlError::UnknownCommand(command.to_string()));
    }
    let disk = field("disk")?;
    if command == "resize" {
        // A chunk-layout disk grows in its store alone (no log, no snapshot).
        if let Some(held) = disks.iter().find(|held| {
            held.device
                .store()
                .is_some_and(|store| disk_name(store.url()) == disk)
        }) {
            return resize(held, disk, size_bytes()?);
        }
    }
    let held = disks
        .iter()
        .find(|held| {
            held.device
                .log_store()
                .is_some_and(|store| disk_name(store.url()) == disk)
        })
        .ok_or_else(|| ControlError::NotHeld {
            disk: disk.to_string(),
            held: disks
                .iter()
                .filter_map(|held| held.device.log_store().map(|store| disk_name(store.url())))
                .collect(),
        })?;
    if command == "resize" {
        return resize(held, disk, size_bytes()?);
    }
    let name = field("name")?;
    let store = held.device.log_store().expect("found by its log store");
    let snapshot_error = |error| ControlError::Snapshot(Box::new(error));
    bufcache_s3::check_snapshot_name(name).map_err(snapshot_error)?;
    let started = Instant::now();
    sync().map_err(|error| ControlError::WriteBack(Box::new(error)))?;
    let taken = store.snapshot(name).map_err(snapshot_error)?;
    tracing::info!(disk = %disk, snapshot = name, seconds = started.elapsed().as_secs_f64(), "snapshot taken through the control socket");
    Ok(json!({
        "ok": true,
        "through_sequence": taken.through_sequence,
        "mapped_bytes": taken.mapped_bytes,
        "segments": taken.segments,
        "object_bytes": taken.object_bytes,
        "seconds": started.elapsed().as_secs_f64(),
    }))
}

/// Grows the held disk (either layout), then its object (checked first, so that a size the
/// object refuses changes nothing).
fn resize(held: &Held, disk: &str, size_bytes: u64) -> Result<Value, ControlError> {
    let started = Instant::now();
    let before = match (held.device.log_store(), held.device.store()) {
        (Some(store), _) => store.metadata().size_bytes,
        (None, Some(store)) => store.metadata().size_bytes,
        (None, None) => unreachable!("found by its log or chunk store"),
    };
    let block_size = u64::from(held.object.block_size());
    if !size_bytes.is_multiple_of(block_size) || !held.object.len().is_multiple_of(block_size) {
        return Err(ControlError::NotWholeBlocks {
            disk: disk.to_string(),
            size_bytes,
            block_size,
        });
    }
    match (held.device.log_store(), held.device.store()) {
        (Some(store), _) => store.grow(size_bytes),
        (None, Some(store)) => store.grow(size_bytes),
        (None, None) => unreachable!("found by its log or chunk store"),
    }
    .map_err(|error| ControlError::Grow(Box::new(error)))?;
    held.object
        .grow(size_bytes)
        .map_err(|error| ControlError::ExportNotGrown {
            disk: disk.to_string(),
            size_bytes,
            error: Box::new(error),
        })?;
    tracing::info!(disk = %disk, size_bytes_before = before, size_bytes, "resized through the control socket");
    Ok(json!({
        "ok": true,
        "size_bytes_before": before,
        "size_bytes_after": size_bytes,
        "seconds": started.elapsed().as_secs_f64(),
    }))
}

/// Sends one request line to the server listening on `path` and returns its reply (an
/// error, bad input when the server says so, for a refusal).
fn request(path: &PathBuf, url: &S3Url, request: Value) -> anyhow::Result<Value> {
    let mut stream = UnixStream::connect(path).map_err(|error| {
        BadInput(format!(
            "--control {}: cannot reach the server's control socket ({error}); is the server holding {url} running with --control {}?",
            path.display(),
            path.display()
        ))
    })?;
    stream.set_read_timeout(Some(REPLY_TIMEOUT))?;
    writeln!(stream, "{request}")?;
    stream.flush()?;
    let mut line = String::new();
    BufReader::new(&stream)
        .read_line(&mut line)
        .with_context(|| format!("--control {}: reading the reply", path.display()))?;
    let reply: Value = serde_json::from_str(line.trim())
        .with_context(|| format!("--control {}: a reply that is not JSON", path.display()))?;
    if reply["ok"] != json!(true) {
        let error = reply["error"].as_str().unwrap_or("no reason given");
        let message = format!("the server ({}) refused: {error}", path.display());
        return Err(if reply["bad_input"] == json!(true) {
            BadInput(message).into()
        } else {
            anyhow::anyhow!(message)
        });
    }
    Ok(reply)
}

/// Asks the server listening on `path` to snapshot disk `url` as `name`.
pub(crate) fn request_snapshot(
    path: &PathBuf,
    url: &S3Url,
    name: &str,
) -> anyhow::Result<SnapshotTaken> {
    bufcache_s3::check_snapshot_name(name).map_err(|error| BadInput(error.to_string()))?;
    let reply = request(
        path,
        url,
        json!({ "command": "snapshot", "disk": disk_name(url), "name": name }),
    )?;
    let number = |field: &str| {
        reply[field]
            .as_u64()
            .ok_or_else(|| anyhow::anyhow!("the server's reply has no `{field}`: {reply}"))
    };
    Ok(SnapshotTaken {
        through_sequence: number("through_sequence")?,
        mapped_bytes: number("mapped_bytes")?,
        segments: number("segments")?,
        object_bytes: number("object_bytes")?,
    })
}

/// Asks the server listening on `path` to grow disk `url` to `size_bytes`: (before, after).
pub(crate) fn request_resize(
    path: &PathBuf,
    url: &S3Url,
    size_bytes: u64,
) -> anyhow::Result<(u64, u64)> {
    let reply = request(
        path,
        url,
        json!({ "command": "resize", "disk": disk_name(url), "size_bytes": size_bytes }),
    )?;
    let number = |field: &str| {
        reply[field]
            .as_u64()
            .ok_or_else(|| anyhow::anyhow!("the server's reply has no `{field}`: {reply}"))
    };
    Ok((number("size_bytes_before")?, number("size_bytes_after")?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refused_requests_keep_their_words_and_say_whether_the_request_was_at_fault() {
        // Goal: a refused control request answers the one-line error clients have always
        // been given, and `bad_input` true for a request that is wrong (the client exits 2).
        // Method: request lines a server holding no disk refuses, answered directly.
        let sync: Sync = Box::new(|| Ok(()));
        for (line, expected) in [
            ("{}", "the request has no string field `command`"),
            (
                r#"{"command":"drop\n","disk":"s3://b/p"}"#,
                "unknown command `drop\\n`; known: snapshot, resize",
            ),
            (
                r#"{"command":"snapshot"}"#,
                "the request has no string field `disk`",
            ),
            (
                r#"{"command":"snapshot","disk":"s3://b/p","name":"a"}"#,
                "this server holds no log-layout disk s3://b/p (it holds: none)",
            ),
            (
                r#"{"command":"resize","disk":"s3://b/p","size_bytes":1}"#,
                "this server holds no log-layout disk s3://b/p (it holds: none)",
            ),
        ] {
            let error = answer(line, &[], &sync).expect_err(line);
            assert_eq!(error.to_string(), expected, "{line}");
            assert!(error.is_bad_input(), "{line}");
        }
        let error = answer("snapshot please", &[], &sync).expect_err("not JSON");
        assert!(error
            .to_string()
            .starts_with("not a JSON request line: expected"));
        assert!(error.is_bad_input());
        let failed = ControlError::WriteBack(Box::new(bufcache::CacheError::NoSpace {
            waited: Duration::from_secs(1),
        }));
        assert!(!failed.is_bad_input());
        assert_eq!(
            failed.to_string(),
            "writing back dirty data before the snapshot: no buffer space: every buffer is \
             pinned or dirty and could not be written back (waited 1s)"
        );
    }
}
