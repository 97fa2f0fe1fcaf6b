//! Looking at a log-layout disk without serving it (`bufcache disk info` and `disk verify`):
//! what its objects hold, and whether every one of them is intact. Nothing here writes: no
//! lock, no epoch, no checkpoint, no delete.

use std::collections::{BTreeMap, BTreeSet};

use futures::stream::{self, StreamExt};

use super::{
    checkpoint, checkpoint_key, checkpoint_name, epoch, epoch_key, epoch_name, get_whole,
    list_named, list_numbered, recover, segment, segment_key, segment_name, snapshot, Recovered,
};
use crate::error::{DecodeError, OpenError};
use crate::seal::Sealer;
use crate::store::{Buckets, DiskMetadata};
use crate::url::S3Url;
use object_store::ObjectStore;

/// One damaged object: its key and what is wrong with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Damage {
    pub key: String,
    pub reason: String,
}

/// How far a verification got: objects and bytes read of those listed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VerifyProgress {
    pub objects_done: u64,
    pub objects_total: u64,
    pub bytes_done: u64,
    pub bytes_total: u64,
}

/// Objects a verification reads at once (each a whole segment, up to `segment-size=`).
const VERIFY_REQUESTS_IN_FLIGHT_MAX: usize = 4;

/// What a log-layout disk's objects hold, as an open would recover it now.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LogSummary {
    /// Segment objects in the store, and their bytes.
    pub segments: u64,
    pub segment_bytes: u64,
    /// Checkpoint objects (an open reads the newest), and the segment the newest covers to.
    pub checkpoints: u64,
    pub checkpoint_through: u64,
    /// Epoch objects, and the newest epoch (one per writable open).
    pub epoch_objects: u64,
    pub epoch_newest: u64,
    /// The last segment of the log an open replays.
    pub sequence_last: u64,
    /// Disk bytes the index maps to stored data (the rest reads as zeroes).
    pub mapped_bytes: u64,
    /// Extents (mapped ranges) of the index.
    pub mapped_extents: u64,
    /// Segment objects the log holds a live byte of, and their bytes.
    pub live_segments: u64,
    pub live_segment_bytes: u64,
    /// Segments no open needs (dead, void or after a gap), which the next writable open
    /// deletes.
    pub unneeded_segments: u64,
    /// Snapshot objects, and the segments they name (pinned: no collection deletes them).
    pub snapshots: u64,
    pub snapshot_segments: u64,
    /// Segments only snapshots need (the index names none of their bytes), and their bytes:
    /// what deleting every snapshot would let the next open or `disk gc` free.
    pub snapshot_only_segments: u64,
    pub snapshot_only_bytes: u64,
}

impl LogSummary {
    /// Bytes of the live segments no mapping points at (what the collector can win back),
    /// counting a live segment's header, table and block checksums as live.
    pub fn garbage_bytes(&self) -> u64 {
        self.live_segment_bytes
            .saturating_sub(crate::blocks::stored_bytes(self.mapped_bytes))
    }
}

/// The summary of the disk as [`recover`] finds it (changing nothing).
pub(crate) async fn summarize(
    store: &dyn ObjectStore,
    buckets: &Buckets,
    url: &S3Url,
    metadata: &DiskMetadata,
    sealer: &Sealer,
) -> Result<LogSummary, OpenError> {
    let recovered = recover(store, buckets, url, metadata, sealer).await?;
    let segments = list_named(store, url, "log/segments").await?;
    let checkpoints = list_numbered(store, url, "log/checkpoints").await?;
    Ok(summary_of(&recovered, &segments, checkpoints.len() as u64))
}

fn summary_of(recovered: &Recovered, segments: &[(u64, u64, u64)], checkpoints: u64) -> LogSummary {
    let cleanup = &recovered.cleanup;
    LogSummary {
        segments: segments.len() as u64,
        segment_bytes: segments.iter().map(|&(_, _, bytes)| bytes).sum(),
        checkpoints,
        checkpoint_through: recovered.checkpoint_through,
        epoch_objects: recovered.epoch_objects.len() as u64,
        epoch_newest: recovered.epochs.newest(),
        sequence_last: recovered.last_sequence,
        mapped_bytes: recovered.index.mapped_bytes(),
        mapped_extents: recovered.index.len() as u64,
        live_segments: recovered.stored.len() as u64,
        live_segment_bytes: recovered.stored.values().sum(),
        unneeded_segments: (cleanup.void.len() + cleanup.dead.len() + cleanup.orphans.len()) as u64,
        snapshots: recovered.snapshots,
        snapshot_segments: recovered.pinned.len() as u64,
        snapshot_only_segments: recovered.pinned_only.len() as u64,
        snapshot_only_bytes: recovered.pinned_only.values().sum(),
    }
}

/// One snapshot as `bufcache disk snapshots` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotSummary {
    pub name: String,
    /// The last segment of the log it covers.
    pub through_sequence: u64,
    /// Disk bytes it maps to stored data, in how many extents.
    pub mapped_bytes: u64,
    pub mapped_extents: u64,
    /// Segments it names, and their object bytes.
    pub segments: u64,
    pub segment_bytes: u64,
    /// Bytes of the segments it names that the disk's index names nothing of (held for
    /// snapshots alone; shared with other snapshots when they name them too).
    pub held_bytes: u64,
    /// The snapshot object's own bytes.
    pub object_bytes: u64,
}

/// Every snapshot of the disk, described against the log as an open would recover it.
pub(crate) async fn describe_snapshots(
    store: &dyn ObjectStore,
    buckets: &Buckets,
    url: &S3Url,
    metadata: &DiskMetadata,
    sealer: &Sealer,
) -> Result<Vec<SnapshotSummary>, OpenError> {
    let recovered = recover(store, buckets, url, metadata, sealer).await?;
    let sizes: BTreeMap<(u64, u64), u64> = list_named(store, url, "log/segments")
        .await?
        .into_iter()
        .map(|(sequence, epoch, bytes)| ((sequence, epoch), bytes))
        .collect();
    let mut described = Vec::new();
    for listed in snapshot::list(store, url).await? {
        let Some(taken) = snapshot::read(store, url, metadata, sealer, &listed.name).await? else {
            // Deleted since it was listed.
            continue;
        };
        let epochs = taken
            .epochs
            .as_ref()
            .expect("snapshot::decode refuses version 1");
        let (mut segment_bytes, mut held_bytes) = (0, 0);
        for &sequence in taken.index.live_bytes_by_segment().keys() {
            let bytes = sizes
                .get(&(sequence, epochs.owner(sequence)))
                .copied()
                .unwrap_or(0);
            segment_bytes += bytes;
            if recovered.index.live_bytes(sequence) == 0 {
                held_bytes += bytes;
            }
        }
        described.push(SnapshotSummary {
            name: listed.name,
            through_sequence: taken.through_sequence,
            mapped_bytes: taken.index.mapped_bytes(),
            mapped_extents: taken.index.len() as u64,
            segments: taken.index.live_bytes_by_segment().len() as u64,
            segment_bytes,
            held_bytes,
            object_bytes: listed.object_bytes,
        });
    }
    Ok(described)
}

/// The extents of one segment by index address: (address of the first byte, logical length).
type ExtentAddresses = Vec<(u64, u64)>;

/// Reads every object of the disk and checks it: each segment's tag (encrypted disks),
/// header, table and extent checksums, every sealed frame unsealed; each checkpoint and epoch
/// object; then that the index an open recovers names only intact segments, inside one of
/// their extents. Every damaged object is named once in the result; an error is returned only
/// when the store cannot be listed or read at all.
pub(crate) async fn verify(
    store: &dyn ObjectStore,
    buckets: &Buckets,
    url: &S3Url,
    metadata: &DiskMetadata,
    sealer: &Sealer,
    progress: &mut (dyn FnMut(VerifyProgress) + Send),
) -> Result<(Vec<Damage>, VerifyProgress), OpenError> {
    let segments = list_named(store, url, "log/segments").await?;
    let checkpoints = list_numbered(store, url, "log/checkpoints").await?;
    let epochs = list_numbered(store, url, "log/epochs").await?;
    let snapshots = snapshot::list(store, url).await?;
    let mut done = VerifyProgress {
        objects_total: (segments.len() + checkpoints.len() + epochs.len() + snapshots.len()) as u64,
        bytes_total: segments.iter().map(|&(_, _, bytes)| bytes).sum(),
        ..VerifyProgress::default()
    };
    let mut damaged = Vec::new();
    let mut intact: BTreeMap<u64, ExtentAddresses> = BTreeMap::new();
    let mut checks = stream::iter(segments.iter().map(|&(sequence, owner, _)| async move {
        let key = segment_key(url, sequence, owner);
        let body = get_whole(store, url, &key).await;
        (
            sequence,
            key,
            body.map(|body| check_segment(&body, sequence, owner, metadata, sealer)),
        )
    }))
    .buffered(VERIFY_REQUESTS_IN_FLIGHT_MAX);
    while let Some((sequence, key, outcome)) = checks.next().await {
        done.objects_done += 1;
        match outcome {
            Ok((bytes, Ok(extents))) => {
                done.bytes_done += bytes;
                intact.insert(sequence, extents);
            }
            Ok((bytes, Err(reason))) => {
                done.bytes_done += bytes;
                damaged.push(Damage {
                    key,
                    reason: reason.to_string(),
                });
            }
            Err(error) => damaged.push(Damage {
                key,
                reason: error.to_string(),
            }),
        }
        progress(done);
    }
    drop(checks);
    for &name in &checkpoints {
        let key = checkpoint_key(url, name);
        let outcome = get_whole(store, url, &key).await.map(|body| {
            sealer
                .check_object(&checkpoint_name(name), &body)
                .and_then(|body| checkpoint::decode(body, metadata.disk_id, metadata.size_bytes))
                .and_then(|decoded| {
                    if (decoded.through_sequence, decoded.epoch) == name {
                        Ok(())
                    } else {
                        Err(DecodeError::Inconsistent(format!(
                            "covers segments to {} written by epoch {}, not what its name says",
                            decoded.through_sequence, decoded.epoch
                        )))
                    }
                })
        });
        record(&mut damaged, key, outcome);
        done.objects_done += 1;
        progress(done);
    }
    for &(number, _) in &epochs {
        let key = epoch_key(url, number);
        let outcome = get_whole(store, url, &key).await.map(|body| {
            sealer
                .check_object(&epoch_name(number), &body)
                .and_then(|body| epoch::decode(body, metadata.disk_id))
                .and_then(|(recorded, _)| {
                    (recorded == number).then_some(()).ok_or_else(|| {
                        DecodeError::Inconsistent(format!(
                            "records epoch {recorded}, not the {number} its name says"
                        ))
                    })
                })
        });
        record(&mut damaged, key, outcome);
        done.objects_done += 1;
        progress(done);
    }
    let listed: BTreeSet<u64> = segments.iter().map(|&(sequence, _, _)| sequence).collect();
    // A clone's base segments are the base disk's, verified with it.
    let base_through = match super::clone::read_base(store, buckets, url, metadata, sealer).await {
        Ok(base) => base.map_or(0, |(base, _)| base.through),
        Err(error) => {
            damaged.push(Damage {
                key: url.key(
                    if metadata.format_version == crate::store::FORMAT_VERSION_LOG_CLONE {
                        crate::store::METADATA_NAME
                    } else {
                        super::clone::BASE_NAME
                    },
                ),
                reason: error.to_string(),
            });
            0
        }
    };
    for snapshot_listed in &snapshots {
        let key = url.key(&snapshot::snapshot_name(&snapshot_listed.name));
        let outcome = get_whole(store, url, &key).await.map(|body| {
            snapshot::decode(&body, url, metadata, sealer, &snapshot_listed.name)
                .map_err(|error| match error {
                    OpenError::BadObject { reason, .. } => reason,
                    other => DecodeError::Inconsistent(other.to_string()),
                })
                .and_then(|taken| {
                    // Every segment it names must be there, intact, and hold its extents.
                    let epochs = taken.epochs.as_ref().expect("decode refuses version 1");
                    // A damaged one is named on its own already.
                    match taken.index.iter().find(|(_, mapping)| {
                        if mapping.segment <= base_through {
                            false
                        } else if intact.contains_key(&mapping.segment) {
                            !inside_intact(&intact, mapping.segment, mapping.object_offset, mapping.length)
                        } else {
                            !listed.contains(&mapping.segment)
                        }
                    }) {
                        None => Ok(()),
                        Some((disk_offset, mapping)) => Err(DecodeError::Inconsistent(format!(
                            "maps {} bytes at disk offset {disk_offset} to segment `{}`, which is missing, damaged or holds no such extent",
                            mapping.length,
                            segment_key(url, mapping.segment, epochs.owner(mapping.segment))
                        ))),
                    }
                })
        });
        record(&mut damaged, key, outcome);
        done.objects_done += 1;
        progress(done);
    }
    if damaged.is_empty() {
        damaged.extend(check_index(store, buckets, url, metadata, sealer, &intact).await);
    }
    Ok((damaged, done))
}

fn record(
    damaged: &mut Vec<Damage>,
    key: String,
    outcome: Result<Result<(), DecodeError>, OpenError>,
) {
    match outcome {
        Ok(Ok(())) => {}
        Ok(Err(reason)) => damaged.push(Damage {
            key,
            reason: reason.to_string(),
        }),
        Err(error) => damaged.push(Damage {
            key,
            reason: error.to_string(),
        }),
    }
}

/// One segment object checked whole: (its bytes, its extents' addresses or what is wrong).
fn check_segment(
    body: &[u8],
    sequence: u64,
    owner: u64,
    metadata: &DiskMetadata,
    sealer: &Sealer,
) -> (u64, Result<ExtentAddresses, DecodeError>) {
    let checked = sealer
        .check_object(&segment_name(sequence, owner), body)
        .and_then(|object| {
            let decoded = segment::decode(object, metadata.disk_id, metadata.size_bytes)?;
            if decoded.sequence != sequence {
                return Err(DecodeError::Inconsistent(format!(
                    "holds segment {}, not the {sequence} its name says",
                    decoded.sequence
                )));
            }
            let mut addresses = Vec::with_capacity(decoded.extents.len());
            for extent in &decoded.extents {
                let (Some(address), Some(position)) =
                    (extent.object_offset(), extent.data_position)
                else {
                    continue;
                };
                if extent.is_sealed() {
                    let start = (segment::HEADER_BYTES + position) as usize;
                    let frame = &object[start..start + extent.stored_length as usize];
                    sealer.unseal(frame, sequence, extent.disk_offset)?;
                }
                addresses.push((address, extent.length));
            }
            addresses.sort_unstable();
            Ok(addresses)
        });
    (body.len() as u64, checked)
}

/// Whether `length` bytes at index address `address` of segment `sequence` lie inside one
/// extent of it, the segment being intact.
fn inside_intact(
    intact: &BTreeMap<u64, ExtentAddresses>,
    sequence: u64,
    address: u64,
    length: u64,
) -> bool {
    intact.get(&sequence).is_some_and(|extents| {
        let at = extents.partition_point(|&(start, _)| start <= address);
        at > 0 && {
            let (start, extent_length) = extents[at - 1];
            address + length <= start + extent_length
        }
    })
}

/// Recovers the index as an open would and checks that each mapping lies inside an extent of
/// an intact segment.
async fn check_index(
    store: &dyn ObjectStore,
    buckets: &Buckets,
    url: &S3Url,
    metadata: &DiskMetadata,
    sealer: &Sealer,
    intact: &BTreeMap<u64, ExtentAddresses>,
) -> Vec<Damage> {
    let recovered = match recover(store, buckets, url, metadata, sealer).await {
        Ok(recovered) => recovered,
        Err(error) => {
            return vec![Damage {
                key: url.key("log"),
                reason: format!("the log does not recover: {error}"),
            }]
        }
    };
    let mut damaged = Vec::new();
    let mut named_badly: BTreeSet<u64> = BTreeSet::new();
    let base_through = recovered.base.as_ref().map_or(0, |base| base.through);
    for (disk_offset, mapping) in recovered.index.iter() {
        if mapping.segment <= base_through {
            // The base disk's, verified with it.
            continue;
        }
        let inside = inside_intact(
            intact,
            mapping.segment,
            mapping.object_offset,
            mapping.length,
        );
        if !inside && named_badly.insert(mapping.segment) {
            damaged.push(Damage {
                key: segment_key(url, mapping.segment, recovered.epochs.owner(mapping.segment)),
                reason: format!(
                    "the index maps {} bytes at disk offset {disk_offset} to address {:#x} of this segment, which no extent of it holds",
                    mapping.length, mapping.object_offset
                ),
            });
        }
    }
    damaged
}
