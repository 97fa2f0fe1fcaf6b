//! Snapshots of a log-layout disk: `PREFIX/log/snapshots/<NAME>`, each a checkpoint-format
//! object (module `checkpoint`, the same checksum, and on an encrypted disk the same tag,
//! bound to the snapshot's own key name) holding the whole index as it stood at a flush
//! point, with the epochs that own the segments it names. Nothing else is written and no
//! data is copied: the segments the index names stay in the store while the snapshot exists.
//!
//! Invariants:
//! - a snapshot names only segments that were durable when its object was stored (it is
//!   stored only once every segment up to its `through` is, [`Core::take_snapshot`]);
//! - a segment a snapshot names is pinned: no collection (online, `disk gc`) and no open's
//!   cleanup deletes it, and the collector does not rewrite it (a rewrite frees nothing while
//!   the pin holds). A server pins the segments of a snapshot it takes before it lets go of
//!   the lock under which it captured the index, so no delete can slip in between; every
//!   open reads every snapshot object before it deletes anything;
//! - a snapshot object is never rewritten: it is stored with a create-only PUT, so taking a
//!   snapshot under a name that exists fails, and its content never changes afterwards.
//!
//! Deleting a snapshot deletes its object only; the segments it alone held go at the next
//! writable open or `disk gc` (a server that is running keeps the pins it had).

use std::collections::BTreeMap;

use bytes::Bytes;
use object_store::path::Path as ObjectPath;
use object_store::ObjectStore;

use super::checkpoint::{self, Checkpoint};
use super::{get_whole, Core, Index};
use crate::error::{DecodeError, OpenError, StoreError};
use crate::seal::Sealer;
use crate::store::DiskMetadata;
use crate::url::{snapshot_name_problem, S3Url};

/// Attempts at capturing the index at a flush point before a snapshot gives up (each one
/// that fails lost a race with another caller sealing the open segment).
const CAPTURE_ATTEMPTS_MAX: u32 = 16;

/// Why a snapshot command failed; nothing was changed unless the variant says so.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("snapshot name `{shown}`: {reason}; nothing was changed", shown = shown(.name))]
    BadName { name: String, reason: String },
    #[error("{url}: a snapshot named `{shown}` exists already; nothing was changed", shown = shown(.name))]
    Exists { url: String, name: String },
    #[error("{url}: no snapshot named `{shown}` (`bufcache disk snapshots` lists them); nothing was changed", shown = shown(.name))]
    Missing { url: String, name: String },
    #[error("{url}: {reason}; nothing was changed")]
    Refused { url: String, reason: String },
    #[error("{url}: snapshot `{shown}` is the base of clone(s) {}: a clone reads the segments it pins; nothing was changed", clones.join(", "), shown = shown(.name))]
    HasClones {
        url: String,
        name: String,
        clones: Vec<String>,
    },
    #[error(transparent)]
    Open(#[from] OpenError),
    #[error("{url}: snapshot `{shown}`: {source}", shown = shown(.name))]
    Store {
        url: String,
        name: String,
        source: StoreError,
    },
}

impl SnapshotError {
    /// Whether the error is the caller's (a name, a disk in a state that refuses it) rather
    /// than the store's: `bufcache disk` exits 2 for these.
    pub fn is_bad_input(&self) -> bool {
        !matches!(self, SnapshotError::Store { .. })
    }
}

/// A name as an error line shows it: control bytes escaped, so the message stays one line.
fn shown(name: &str) -> String {
    name.escape_debug().to_string()
}

/// Refuses a name [`snapshot_name_problem`] finds wrong, saying why.
pub fn check_name(name: &str) -> Result<(), SnapshotError> {
    match snapshot_name_problem(name) {
        None => Ok(()),
        Some(reason) => Err(SnapshotError::BadName {
            name: name.to_string(),
            reason,
        }),
    }
}

/// A snapshot's object name under the disk's prefix (what its tag names).
pub(crate) fn snapshot_name(name: &str) -> String {
    format!("log/snapshots/{name}")
}

/// One snapshot as listed: its name and its object's bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listed {
    pub name: String,
    pub object_bytes: u64,
}

/// Every snapshot object of the disk, by name.
pub(crate) async fn list(store: &dyn ObjectStore, url: &S3Url) -> Result<Vec<Listed>, OpenError> {
    let objects = crate::store::list_folder(store, url, "log/snapshots").await?;
    let prefix = url.key("log/snapshots");
    let mut listed: Vec<Listed> = objects
        .into_iter()
        .filter_map(|object| {
            // Only the objects directly under the folder (a clone record lies deeper).
            let name = object.location.as_ref().strip_prefix(prefix.as_str())?;
            let name = name.strip_prefix('/')?;
            (!name.contains('/')).then(|| Listed {
                name: name.to_string(),
                object_bytes: object.size,
            })
        })
        .collect();
    listed.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(listed)
}

/// Reads and checks snapshot `name`; a missing one is Ok(None).
pub(crate) async fn read(
    store: &dyn ObjectStore,
    url: &S3Url,
    metadata: &DiskMetadata,
    sealer: &Sealer,
    name: &str,
) -> Result<Option<Checkpoint>, OpenError> {
    let key = url.key(&snapshot_name(name));
    let what = format!("snapshot `{key}`");
    let Some(body) = crate::store::get_optional(store, url, &key, &what).await? else {
        return Ok(None);
    };
    decode(&body, url, metadata, sealer, name).map(Some)
}

/// Checks a snapshot object's tag and checkpoint format; the error names its key.
pub(super) fn decode(
    body: &[u8],
    url: &S3Url,
    metadata: &DiskMetadata,
    sealer: &Sealer,
    name: &str,
) -> Result<Checkpoint, OpenError> {
    let key = url.key(&snapshot_name(name));
    let snapshot = sealer
        .check_object(&snapshot_name(name), body)
        .and_then(|body| checkpoint::decode(body, metadata.disk_id, metadata.size_bytes))
        .map_err(|reason| super::bad_object(url, &key, reason))?;
    if snapshot.epochs.is_none() {
        return Err(super::bad_object(
            url,
            &key,
            DecodeError::Inconsistent(
                "a version 1 checkpoint, which no snapshot is written as (it records no epochs)"
                    .to_string(),
            ),
        ));
    }
    Ok(snapshot)
}

/// The segments every snapshot names, as (sequence, owning epoch) with the snapshots naming
/// each: what no delete may touch; and how many snapshots there are. One LIST, and a GET of
/// every snapshot object.
pub(super) async fn pins(
    store: &dyn ObjectStore,
    url: &S3Url,
    metadata: &DiskMetadata,
    sealer: &Sealer,
) -> Result<(BTreeMap<(u64, u64), Vec<String>>, u64), OpenError> {
    let mut pinned: BTreeMap<(u64, u64), Vec<String>> = BTreeMap::new();
    let snapshots = list(store, url).await?;
    let count = snapshots.len() as u64;
    for listed in snapshots {
        let key = url.key(&snapshot_name(&listed.name));
        let body = get_whole(store, url, &key).await?;
        let snapshot = decode(&body, url, metadata, sealer, &listed.name)?;
        let epochs = snapshot.epochs.as_ref().expect("decode refuses version 1");
        for &sequence in snapshot.index.live_bytes_by_segment().keys() {
            pinned
                .entry((sequence, epochs.owner(sequence)))
                .or_default()
                .push(listed.name.clone());
        }
    }
    Ok((pinned, count))
}

/// What taking a snapshot did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Taken {
    /// The last segment the snapshot covers.
    pub through_sequence: u64,
    /// Disk bytes the snapshot maps to stored data.
    pub mapped_bytes: u64,
    /// Segments it names (pinned while it exists).
    pub segments: u64,
    /// The snapshot object's bytes (its only write besides the flush's segment).
    pub object_bytes: u64,
}

impl Core {
    /// Takes snapshot `name` at a flush point: seals the open segment and captures the index
    /// in the same critical section (so it holds every write that returned before this call
    /// and nothing half-written), pins the segments it names, waits until they are durable
    /// and stores the snapshot object with a create-only PUT. Costs the flush's segment PUT
    /// (when anything was written since the last one) and one PUT.
    pub(super) fn take_snapshot(&self, name: &str) -> Result<Taken, SnapshotError> {
        check_name(name)?;
        let url = self.shared.url.to_string();
        let failed = |source: StoreError| SnapshotError::Store {
            url: url.clone(),
            name: name.to_string(),
            source,
        };
        self.check_writable()
            .map_err(|error| SnapshotError::Refused {
                url: url.clone(),
                reason: format!("a snapshot is taken by the disk's writer: {error}"),
            })?;
        let mut captured: Option<(u64, Index)> = None;
        for _ in 0..CAPTURE_ATTEMPTS_MAX {
            let state = self.shared.lock();
            if state.open.is_empty() {
                let through = state.open.sequence - 1;
                captured = Some((through, state.index.clone()));
                let mut state = state;
                pin_index(&mut state, through);
                break;
            }
            let sequence = state.open.sequence;
            let state = self
                .seal_then(state, sequence, &mut |state| {
                    let through = state.open.sequence - 1;
                    captured = Some((through, state.index.clone()));
                    pin_index(state, through);
                })
                .map_err(failed)?;
            drop(state);
            if captured.is_some() {
                break;
            }
        }
        let Some((through, index)) = captured else {
            return Err(SnapshotError::Refused {
                url,
                reason: format!(
                    "writes kept sealing the open segment first in {CAPTURE_ATTEMPTS_MAX} attempts at a flush point; try again"
                ),
            });
        };
        self.wait_durable(through).map_err(failed)?;
        let epochs = checkpoint::needed_epochs(&self.shared.epochs, through, &index);
        let body: Bytes = self.shared.sealer.tag_object(
            &snapshot_name(name),
            checkpoint::encode(
                self.shared.metadata.disk_id,
                through,
                self.shared.epoch,
                &epochs,
                &index,
            ),
        );
        let object_bytes = body.len() as u64;
        let key = self.shared.url.key(&snapshot_name(name));
        let store = self.shared.store.clone();
        let stored = self.runtime.block_on(async {
            store
                .put_opts(
                    &ObjectPath::from(key.as_str()),
                    object_store::PutPayload::from(body),
                    object_store::PutOptions {
                        mode: object_store::PutMode::Create,
                        ..Default::default()
                    },
                )
                .await
        });
        match stored {
            Ok(_) => {}
            Err(
                object_store::Error::AlreadyExists { .. }
                | object_store::Error::Precondition { .. },
            ) => {
                return Err(SnapshotError::Exists {
                    url,
                    name: name.to_string(),
                })
            }
            Err(error) => return Err(failed(crate::error::request_failed("PUT", &key, error))),
        }
        tracing::info!(disk = %self.shared.url, snapshot = name, through, "took a snapshot");
        Ok(Taken {
            through_sequence: through,
            mapped_bytes: index.mapped_bytes(),
            segments: index.live_bytes_by_segment().len() as u64,
            object_bytes,
        })
    }
}

/// Pins every segment the index names (called under the state lock, where the index was
/// captured): the collector skips them from now on.
fn pin_index(state: &mut super::State, through: u64) {
    let named: Vec<u64> = state
        .index
        .live_bytes_by_segment()
        .keys()
        .copied()
        .collect();
    for sequence in named {
        assert!(
            sequence <= through,
            "a snapshot through {through} names segment {sequence} after it"
        );
        state.pinned.insert(sequence);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::url::SNAPSHOT_NAME_BYTES_MAX;

    // Goal: bad snapshot names are refused with a reason naming them, good ones pass.
    // Method: check_name over each kind of bad name and a few good ones.
    #[test]
    fn snapshot_names_with_slashes_control_bytes_or_wrong_lengths_are_refused() {
        for (name, says) in [
            ("", "empty"),
            ("a/b", "`/`"),
            ("a\nb", "control"),
            ("a\u{7f}b", "control"),
            (".hidden", "starts with"),
            ("two words", "holds ` `"),
            (&"x".repeat(SNAPSHOT_NAME_BYTES_MAX + 1), "longer"),
        ] {
            let error = check_name(name).unwrap_err().to_string();
            assert!(error.contains(says), "{name:?}: {error}");
            assert!(!error.contains('\n'), "one line: {error:?}");
        }
        for name in ["before-upgrade", "2026-12-07T01:00", "v1.2+build@x", "a_b"] {
            check_name(name).unwrap();
        }
        check_name(&"x".repeat(SNAPSHOT_NAME_BYTES_MAX)).unwrap();
    }
}
