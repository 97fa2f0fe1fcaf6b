//! The checkpoint object: the whole index as it stood once every segment up to and including
//! `through_sequence` was durable, and the epochs that own the segments it names and those
//! after it, `PREFIX/log/checkpoints/<through_sequence>-<epoch>` (16 hex digits each; `epoch`
//! is the writer's). Opening a disk reads the newest checkpoint (the greatest (through,
//! epoch)) and replays only the segments after it.
//!
//! Naming by the writer's epoch fences a crashed server's late checkpoint PUT: it covers only
//! segments that were durable before the crash, so its `through` is at most where the next
//! server's log started and every checkpoint of a later server (a newer epoch) sorts after it.
//!
//! Format version 2 (integers little-endian):
//!
//! ```text
//!  0  magic "BCLOGCKP"     8  format version u32 (2)    12 reserved u32 (0)
//! 16  disk id u64          24 through sequence u64      32 writer's epoch u64
//! 40  epoch count u64      48 mapping count u64
//! 56  epochs, 16 bytes each, ascending: epoch u64, start sequence u64
//! ..  mappings, 32 bytes each: disk offset u64, length u64, segment u64, object offset u64
//! end CRC-32 (IEEE) of every byte before it u32
//! ```
//!
//! The epochs are those owning a sequence at or after the oldest segment the index names
//! (module `epoch`, [`Epochs::needed_from`]), the writer's last among them; with them an
//! open needs only the epoch objects newer than the writer's, and every older epoch object
//! may be deleted once this checkpoint is durable.
//!
//! Format version 1 (disks written before version 2; read, never written): at 32 the mapping
//! count, at 40 the mappings, no epochs (an open reads every epoch object), named
//! `<through_sequence>` alone.

use std::collections::BTreeSet;

use bytes::{BufMut, Bytes, BytesMut};

use super::epoch::Epochs;
use super::index::{Index, Mapping};
use crate::error::DecodeError;

const MAGIC: &[u8; 8] = b"BCLOGCKP";
const FORMAT_VERSION: u32 = 2;
const HEADER_BYTES: usize = 56;
const HEADER_BYTES_V1: usize = 40;
const EPOCH_BYTES: usize = 16;
const ENTRY_BYTES: usize = 32;

/// A checkpoint's content.
#[derive(Debug, PartialEq, Eq)]
pub struct Checkpoint {
    pub through_sequence: u64,
    /// The writer's epoch (0 for version 1).
    pub epoch: u64,
    /// The epochs an open needs besides those newer than `epoch`; None for version 1 (every
    /// epoch object is needed).
    pub epochs: Option<Epochs>,
    pub index: Index,
}

/// A checkpoint the disk keeps besides the newest, with what an open falling back to it
/// needs: every segment it names and every segment after `through` (module docs of `log`,
/// "Two checkpoints"). Kept ones are held oldest first; the oldest needs every segment a
/// newer one needs (a segment a checkpoint does not name had no live byte when it was
/// taken, and live bytes never come back to a segment).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Kept {
    /// (through, epoch) of its object; None for the empty log a disk starts as, which has
    /// no object.
    pub name: Option<(u64, u64)>,
    pub through: u64,
    pub named: BTreeSet<u64>,
    /// Its writer's epoch when it records the epochs an open needs (version 2): the epoch
    /// objects older than that one are not needed to open from it. None: every one is.
    pub epoch: Option<u64>,
}

impl Kept {
    /// The log before its first checkpoint: replaying it needs every segment and epoch.
    pub fn start() -> Kept {
        Kept {
            name: None,
            through: 0,
            named: BTreeSet::new(),
            epoch: None,
        }
    }

    /// A checkpoint object whose content is not known (damaged, or not read): it holds
    /// every segment and epoch object until it is deleted.
    pub fn unknown(name: (u64, u64)) -> Kept {
        Kept {
            name: Some(name),
            ..Kept::start()
        }
    }

    /// What checkpoint `name`, whose content is `checkpoint`, keeps.
    pub fn of(name: (u64, u64), checkpoint: &Checkpoint) -> Kept {
        Kept {
            name: Some(name),
            through: checkpoint.through_sequence,
            named: checkpoint
                .index
                .live_bytes_by_segment()
                .keys()
                .copied()
                .collect(),
            epoch: checkpoint.epochs.is_some().then_some(checkpoint.epoch),
        }
    }

    /// Whether replaying from this checkpoint reads segment `sequence`.
    pub fn needs(&self, sequence: u64) -> bool {
        sequence > self.through || self.named.contains(&sequence)
    }
}

/// Whether some kept checkpoint needs segment `sequence`: no collection and no open's
/// cleanup deletes it. The planted defects (tests/log_sim_check.rs) answer no: this one's,
/// and the collector's that trusts a checkpoint before it is durable, since a kept
/// predecessor also keeps every segment the newest durable checkpoint names.
pub fn kept_need(kept: &[Kept], sequence: u64) -> bool {
    !cfg!(any(
        feature = "planted-previous-defect",
        feature = "planted-gc-defect"
    )) && kept.iter().any(|kept| kept.needs(sequence))
}

/// The oldest epoch whose object an open from the newest checkpoint (writer epoch
/// `newest`, None when it needs every one) or a kept one may read: the older epoch objects
/// may go. None when every one must stay.
pub fn epochs_needed_from(kept: &[Kept], newest: Option<u64>) -> Option<u64> {
    kept.iter()
        .map(|kept| kept.epoch)
        .chain([newest])
        .try_fold(u64::MAX, |low, epoch| epoch.map(|epoch| low.min(epoch)))
}

/// The epochs a checkpoint of `index` covering the segments up to `through` records: those
/// owning a sequence at or after the oldest segment it names (or after `through`).
pub fn needed_epochs(epochs: &Epochs, through: u64, index: &Index) -> Epochs {
    let oldest = index
        .live_bytes_by_segment()
        .keys()
        .copied()
        .min()
        .unwrap_or(through + 1)
        .min(through + 1);
    epochs.needed_from(oldest)
}

/// Encodes a version 2 checkpoint; `epochs` must hold `epoch` as its newest.
pub fn encode(
    disk_id: u64,
    through_sequence: u64,
    epoch: u64,
    epochs: &Epochs,
    index: &Index,
) -> Bytes {
    debug_assert_eq!(
        epochs.newest(),
        epoch,
        "the writer's epoch is the newest it records"
    );
    let mut object = BytesMut::with_capacity(
        HEADER_BYTES + epochs.len() * EPOCH_BYTES + index.len() * ENTRY_BYTES + 4,
    );
    object.put_slice(MAGIC);
    object.put_u32_le(FORMAT_VERSION);
    object.put_u32_le(0);
    object.put_u64_le(disk_id);
    object.put_u64_le(through_sequence);
    object.put_u64_le(epoch);
    object.put_u64_le(epochs.len() as u64);
    object.put_u64_le(index.len() as u64);
    for (number, start) in epochs.iter() {
        object.put_u64_le(number);
        object.put_u64_le(start);
    }
    put_mappings(&mut object, index);
    let checksum = crc32fast::hash(&object);
    object.put_u32_le(checksum);
    object.freeze()
}

fn put_mappings(object: &mut BytesMut, index: &Index) {
    for (offset, mapping) in index.iter() {
        object.put_u64_le(offset);
        object.put_u64_le(mapping.length);
        object.put_u64_le(mapping.segment);
        object.put_u64_le(mapping.object_offset);
    }
}

/// Encodes a version 1 checkpoint, as disks written before version 2 hold them.
#[cfg(test)]
pub fn encode_v1(disk_id: u64, through_sequence: u64, index: &Index) -> Bytes {
    let mut object = BytesMut::new();
    object.put_slice(MAGIC);
    object.put_u32_le(1);
    object.put_u32_le(0);
    object.put_u64_le(disk_id);
    object.put_u64_le(through_sequence);
    object.put_u64_le(index.len() as u64);
    put_mappings(&mut object, index);
    let checksum = crc32fast::hash(&object);
    object.put_u32_le(checksum);
    object.freeze()
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

/// Checks and decodes a checkpoint object (version 2 or 1); the error says what is wrong.
pub fn decode(
    object: &[u8],
    disk_id: u64,
    disk_size_bytes: u64,
) -> Result<Checkpoint, DecodeError> {
    if object.len() < HEADER_BYTES_V1 + 4 {
        return Err(DecodeError::Truncated {
            found: object.len() as u64,
            needed: "shorter than a checkpoint header (truncated?)".to_string(),
        });
    }
    if &object[..8] != MAGIC {
        return Err(DecodeError::BadMagic {
            what: "checkpoint",
            magic: "BCLOGCKP",
        });
    }
    let (body, stored) = object.split_at(object.len() - 4);
    if crc32fast::hash(body) != u32::from_le_bytes(stored.try_into().expect("4 bytes")) {
        return Err(DecodeError::BadCrc {
            part: "object",
            meaning: "corrupt or truncated",
        });
    }
    let version = u32::from_le_bytes(object[8..12].try_into().expect("4 bytes"));
    let stored_disk = u64_at(object, 16);
    if stored_disk != disk_id {
        return Err(DecodeError::OtherDisk {
            found: stored_disk,
            expected: disk_id,
        });
    }
    let through_sequence = u64_at(object, 24);
    let (epoch, epochs, mappings) = match version {
        1 => (0, None, (u64_at(object, 32), HEADER_BYTES_V1)),
        FORMAT_VERSION if body.len() >= HEADER_BYTES => {
            let epoch = u64_at(object, 32);
            let epoch_count = u64_at(object, 40);
            let room = ((body.len() - HEADER_BYTES) / EPOCH_BYTES) as u64;
            if epoch_count > room {
                return Err(DecodeError::Inconsistent(format!(
                    "{epoch_count} epochs do not fit in {} bytes",
                    body.len()
                )));
            }
            let mappings_at = HEADER_BYTES + epoch_count as usize * EPOCH_BYTES;
            let mut epochs = Epochs::default();
            let mut previous = None;
            for entry in body[HEADER_BYTES..mappings_at].chunks_exact(EPOCH_BYTES) {
                let (number, start) = (u64_at(entry, 0), u64_at(entry, 8));
                if previous.is_some_and(|previous| previous >= number) || start == 0 {
                    return Err(DecodeError::Inconsistent(format!(
                        "epoch {number} (start {start}) is out of order or starts at 0"
                    )));
                }
                previous = Some(number);
                epochs.insert(number, start);
            }
            if epoch == 0 || previous != Some(epoch) {
                return Err(DecodeError::Inconsistent(format!(
                    "the writer's epoch {epoch} is not the newest of the {epoch_count} it records"
                )));
            }
            (epoch, Some(epochs), (u64_at(object, 48), mappings_at))
        }
        _ => {
            return Err(DecodeError::Inconsistent(format!(
                "checkpoint format version {version} is not a supported one (1 or {FORMAT_VERSION})"
            )))
        }
    };
    let (count, mappings_at) = mappings;
    if count.checked_mul(ENTRY_BYTES as u64) != Some((body.len() - mappings_at) as u64) {
        return Err(DecodeError::Inconsistent(format!(
            "{count} mappings do not fill {} bytes",
            body.len()
        )));
    }
    let mut index = Index::new();
    let mut previous_end = 0;
    for entry in body[mappings_at..].chunks_exact(ENTRY_BYTES) {
        let offset = u64_at(entry, 0);
        let mapping = Mapping {
            length: u64_at(entry, 8),
            segment: u64_at(entry, 16),
            object_offset: u64_at(entry, 24),
        };
        let end = offset.checked_add(mapping.length);
        if offset < previous_end || end.is_none_or(|end| end > disk_size_bytes) {
            return Err(DecodeError::Inconsistent(format!(
                "mapping of {} bytes at {offset} overlaps another or leaves the disk",
                mapping.length
            )));
        }
        if mapping.segment > through_sequence {
            return Err(DecodeError::Inconsistent(format!(
                "mapping at {offset} names segment {} after the checkpoint's {through_sequence}",
                mapping.segment
            )));
        }
        previous_end = end.expect("checked above");
        index.insert(offset, mapping);
    }
    Ok(Checkpoint {
        through_sequence,
        epoch,
        epochs,
        index,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: a kept checkpoint holds exactly what an open falling back to it reads (the
    // segments it names and every one after its `through`), the log's start and an unknown
    // checkpoint hold everything, and epoch objects go only below every kept writer's epoch
    // (none while one needs them all). Method: kept records of a checkpoint naming segments
    // 2 and 5 through 6, of the log's start and of an unknown object; ask about segments
    // 1 to 9 and about the pruning bound of several combinations.
    #[cfg(not(any(feature = "planted-previous-defect", feature = "planted-gc-defect")))]
    #[test]
    fn kept_checkpoints_hold_what_a_fallback_reads_and_bound_epoch_pruning() {
        let mut index = Index::new();
        for (offset, segment) in [(0u64, 2u64), (8192, 5)] {
            index.insert(
                offset,
                Mapping {
                    length: 4096,
                    segment,
                    object_offset: 64,
                },
            );
        }
        let mut epochs = Epochs::default();
        epochs.insert(3, 1);
        let checkpoint = Checkpoint {
            through_sequence: 6,
            epoch: 3,
            epochs: Some(epochs),
            index,
        };
        let kept = Kept::of((6, 3), &checkpoint);
        let needed: Vec<u64> = (1..=9).filter(|&sequence| kept.needs(sequence)).collect();
        assert_eq!(needed, [2, 5, 7, 8, 9]);
        for sequence in 1..=9 {
            assert!(Kept::start().needs(sequence));
            assert!(Kept::unknown((6, 3)).needs(sequence));
            assert_eq!(
                kept_need(std::slice::from_ref(&kept), sequence),
                needed.contains(&sequence)
            );
        }
        assert!(!kept_need(&[], 1), "nothing kept keeps nothing");
        assert_eq!(
            epochs_needed_from(std::slice::from_ref(&kept), Some(7)),
            Some(3)
        );
        assert_eq!(
            epochs_needed_from(std::slice::from_ref(&kept), Some(2)),
            Some(2)
        );
        assert_eq!(
            epochs_needed_from(&[kept.clone(), Kept::start()], Some(7)),
            None
        );
        assert_eq!(epochs_needed_from(&[kept], None), None);
        assert_eq!(epochs_needed_from(&[], Some(4)), Some(4));
    }

    // Goal: a checkpoint (version 2 and the version 1 disks hold) round-trips and damage is
    // an error, never a different index. Method: encode an index of three mappings, decode
    // it, flip each byte and expect an error.
    #[test]
    fn checkpoints_round_trip_and_every_flipped_byte_is_detected() {
        let mut index = Index::new();
        for (offset, segment) in [(0u64, 1u64), (8192, 2), (1 << 20, 3)] {
            index.insert(
                offset,
                Mapping {
                    length: 4096,
                    segment,
                    object_offset: 64 + offset,
                },
            );
        }
        let mut epochs = Epochs::default();
        epochs.insert(2, 1);
        epochs.insert(4, 3);
        let object = encode(5, 3, 4, &epochs, &index);
        let decoded = decode(&object, 5, 1 << 30).unwrap();
        assert_eq!(
            decoded,
            Checkpoint {
                through_sequence: 3,
                epoch: 4,
                epochs: Some(epochs),
                index: index.clone(),
            }
        );
        assert!(decode(&object, 6, 1 << 30)
            .unwrap_err()
            .to_string()
            .contains("disk"));
        for byte in 0..object.len() {
            let mut damaged = object.to_vec();
            damaged[byte] ^= 1;
            assert!(decode(&damaged, 5, 1 << 30).is_err(), "byte {byte}");
        }
        // Version 1, as disks written before version 2 hold them: no epochs.
        let object = encode_v1(5, 3, &index);
        let decoded = decode(&object, 5, 1 << 30).unwrap();
        assert_eq!(
            decoded,
            Checkpoint {
                through_sequence: 3,
                epoch: 0,
                epochs: None,
                index,
            }
        );
        for byte in 0..object.len() {
            let mut damaged = object.to_vec();
            damaged[byte] ^= 1;
            assert!(decode(&damaged, 5, 1 << 30).is_err(), "v1 byte {byte}");
        }
    }
}
