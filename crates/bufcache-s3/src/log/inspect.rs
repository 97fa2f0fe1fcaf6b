//! Looking at a log-layout disk without serving it (`bufcache disk info` and `disk verify`):
//! what its objects hold, and whether every one of them is intact. Nothing here writes: no
//! lock, no epoch, no checkpoint, no delete.

use std::collections::{BTreeMap, BTreeSet};

use futures::stream::{self, StreamExt};

use super::{
    checkpoint, checkpoint_key, checkpoint_name, epoch, epoch_key, epoch_name, get_whole,
    list_named, list_numbered, recover, segment, segment_key, segment_name, Recovered,
};
use crate::error::OpenError;
use crate::seal::Sealer;
use crate::store::DiskMetadata;
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
    url: &S3Url,
    metadata: &DiskMetadata,
    sealer: &Sealer,
) -> Result<LogSummary, OpenError> {
    let recovered = recover(store, url, metadata, sealer).await?;
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
    }
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
    url: &S3Url,
    metadata: &DiskMetadata,
    sealer: &Sealer,
    progress: &mut (dyn FnMut(VerifyProgress) + Send),
) -> Result<(Vec<Damage>, VerifyProgress), OpenError> {
    let segments = list_named(store, url, "log/segments").await?;
    let checkpoints = list_numbered(store, url, "log/checkpoints").await?;
    let epochs = list_numbered(store, url, "log/epochs").await?;
    let mut done = VerifyProgress {
        objects_total: (segments.len() + checkpoints.len() + epochs.len()) as u64,
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
                damaged.push(Damage { key, reason });
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
                        Err(format!(
                            "covers segments to {} written by epoch {}, not what its name says",
                            decoded.through_sequence, decoded.epoch
                        ))
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
                        format!("records epoch {recorded}, not the {number} its name says")
                    })
                })
        });
        record(&mut damaged, key, outcome);
        done.objects_done += 1;
        progress(done);
    }
    if damaged.is_empty() {
        damaged.extend(check_index(store, url, metadata, sealer, &intact).await);
    }
    Ok((damaged, done))
}

fn record(damaged: &mut Vec<Damage>, key: String, outcome: Result<Result<(), String>, OpenError>) {
    match outcome {
        Ok(Ok(())) => {}
        Ok(Err(reason)) => damaged.push(Damage { key, reason }),
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
) -> (u64, Result<ExtentAddresses, String>) {
    let checked = sealer
        .check_object(&segment_name(sequence, owner), body)
        .and_then(|object| {
            let decoded = segment::decode(object, metadata.disk_id, metadata.size_bytes)?;
            if decoded.sequence != sequence {
                return Err(format!(
                    "holds segment {}, not the {sequence} its name says",
                    decoded.sequence
                ));
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

/// Recovers the index as an open would and checks that each mapping lies inside an extent of
/// an intact segment.
async fn check_index(
    store: &dyn ObjectStore,
    url: &S3Url,
    metadata: &DiskMetadata,
    sealer: &Sealer,
    intact: &BTreeMap<u64, ExtentAddresses>,
) -> Vec<Damage> {
    let recovered = match recover(store, url, metadata, sealer).await {
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
    for (disk_offset, mapping) in recovered.index.iter() {
        let inside = intact.get(&mapping.segment).is_some_and(|extents| {
            let at = extents.partition_point(|&(address, _)| address <= mapping.object_offset);
            at > 0 && {
                let (address, length) = extents[at - 1];
                mapping.object_offset + mapping.length <= address + length
            }
        });
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
