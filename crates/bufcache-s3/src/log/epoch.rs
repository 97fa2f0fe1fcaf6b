//! Epochs: the fence against a crashed server's late requests.
//!
//! Every writable open of a log-layout disk is a new epoch: after recovery it claims epoch
//! number `max + 1` with a create-only PUT of `PREFIX/log/epochs/<epoch as 16 hex digits>`,
//! recording the first segment sequence it will write (`start`, one past the recovered
//! log), before it writes anything. Its segments are named
//! `PREFIX/log/segments/<sequence>-<epoch>` (16 hex digits each; a disk written before epochs
//! has segments `<sequence>` alone, epoch 0 starting at 1).
//!
//! Sequence `s` belongs to its owner, the newest epoch whose start is at most `s`; only the
//! owner's object for `s` is part of the log, any other object named `s` is void (deleted at
//! open). So a PUT of a crashed server that lands after the next server opened the disk
//! (a segment of the same sequence the new server writes, or after it) can never replace or
//! extend the new server's log: its name carries the old epoch, which no longer owns that
//! sequence. A late claim of an epoch number fails its create-only condition, and an open
//! whose own claim fails recovers again (the claim that won may move ownership).
//!
//! Epoch objects do not accumulate: a version 2 checkpoint records the epochs owning the
//! segments it names and those after it (module `checkpoint`), so an open reads only the
//! epoch objects newer than the checkpoint's writer (every one while that checkpoint is the
//! disk's first: its fallback, the log's start, needs the owners of every segment), and once a checkpoint of epoch `W` is
//! durable the epoch objects older than `W` are deleted. Every later checkpoint sorts after
//! it (a newer epoch, a `through` never smaller), so no open reads them again; a claim is
//! always newer than the newest checkpoint's writer, so a deleted number is never claimed
//! again by a live server, and a crashed server's late claim of one lands below that writer
//! and is ignored. Deleting them before that checkpoint is durable would lose a crashed
//! predecessor's epoch (its segments would read as void): the `planted-prune-defect` feature
//! does that, and `sim check --layout log` catches it.
//!
//! Format of an epoch object (integers little-endian):
//!
//! ```text
//!  0  magic "BCLOGEPO"   8  format version u32 (1)   12 reserved u32 (0)
//! 16  disk id u64       24  epoch u64               32  start sequence u64
//! 40  CRC-32 (IEEE) of every byte before it u32
//! ```

use std::collections::BTreeMap;

use crate::error::DecodeError;
use bytes::{BufMut, Bytes, BytesMut};

const MAGIC: &[u8; 8] = b"BCLOGEPO";
const FORMAT_VERSION: u32 = 1;
const OBJECT_BYTES: usize = 44;

pub fn encode(disk_id: u64, epoch: u64, start: u64) -> Bytes {
    let mut object = BytesMut::with_capacity(OBJECT_BYTES);
    object.put_slice(MAGIC);
    object.put_u32_le(FORMAT_VERSION);
    object.put_u32_le(0);
    object.put_u64_le(disk_id);
    object.put_u64_le(epoch);
    object.put_u64_le(start);
    let checksum = crc32fast::hash(&object);
    object.put_u32_le(checksum);
    object.freeze()
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

/// Checks and decodes an epoch object: (epoch, start sequence); the error says what is wrong.
pub fn decode(object: &[u8], disk_id: u64) -> Result<(u64, u64), DecodeError> {
    if object.len() != OBJECT_BYTES {
        return Err(DecodeError::Truncated {
            found: object.len() as u64,
            needed: format!("not the {OBJECT_BYTES} of an epoch object (truncated?)"),
        });
    }
    if &object[..8] != MAGIC {
        return Err(DecodeError::BadMagic {
            what: "epoch object",
            magic: "BCLOGEPO",
        });
    }
    let (body, stored) = object.split_at(OBJECT_BYTES - 4);
    if crc32fast::hash(body) != u32::from_le_bytes(stored.try_into().expect("4 bytes")) {
        return Err(DecodeError::BadCrc {
            part: "object",
            meaning: "corrupt",
        });
    }
    let version = u32::from_le_bytes(object[8..12].try_into().expect("4 bytes"));
    if version != FORMAT_VERSION {
        return Err(DecodeError::Inconsistent(format!(
            "epoch format version {version} is not the supported {FORMAT_VERSION}"
        )));
    }
    let stored_disk = u64_at(object, 16);
    if stored_disk != disk_id {
        return Err(DecodeError::OtherDisk {
            found: stored_disk,
            expected: disk_id,
        });
    }
    Ok((u64_at(object, 24), u64_at(object, 32)))
}

/// The epochs of a disk: start sequence by epoch number (epoch 0, of disks written before
/// epochs, starts at 1 unless recorded).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Epochs {
    starts: BTreeMap<u64, u64>,
}

impl Epochs {
    pub fn insert(&mut self, epoch: u64, start: u64) {
        self.starts.insert(epoch, start);
    }

    /// The epoch that owns sequence `sequence`: the newest whose start is at most it.
    pub fn owner(&self, sequence: u64) -> u64 {
        self.starts
            .iter()
            .rev()
            .find(|&(_, &start)| start <= sequence)
            .map_or(0, |(&epoch, _)| epoch)
    }

    /// The newest epoch number (0 when none is recorded).
    pub fn newest(&self) -> u64 {
        self.starts.keys().next_back().copied().unwrap_or(0)
    }

    /// (epoch, start) of every recorded epoch, ascending by epoch.
    pub fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.starts.iter().map(|(&epoch, &start)| (epoch, start))
    }

    pub fn len(&self) -> usize {
        self.starts.len()
    }

    /// The epochs that own some sequence at or after `low`: all [`Epochs::owner`] needs to
    /// name the owner of any such sequence (an epoch owning `s >= low` owns
    /// `max(its start, low)`, since fewer epochs started by then).
    pub fn needed_from(&self, low: u64) -> Epochs {
        Epochs {
            starts: self
                .starts
                .iter()
                .filter(|&(&epoch, &start)| self.owner(start.max(low)) == epoch)
                .map(|(&epoch, &start)| (epoch, start))
                .collect(),
        }
    }
}

/// The name of object `sequence` written by `epoch`: a segment under `log/segments/`, or a
/// checkpoint (`sequence` the last segment it covers) under `log/checkpoints/`. Epoch 0 (disks
/// written before epochs, and version 1 checkpoints) has no suffix.
pub fn object_name(sequence: u64, epoch: u64) -> String {
    if epoch == 0 {
        format!("{sequence:016x}")
    } else {
        format!("{sequence:016x}-{epoch:016x}")
    }
}

/// (sequence, epoch) of a segment's or checkpoint's name; None when it is not one.
pub fn parse_object_name(name: &str) -> Option<(u64, u64)> {
    let hex = |text: &str| {
        (text.len() == 16 && text.bytes().all(|byte| byte.is_ascii_hexdigit()))
            .then(|| u64::from_str_radix(text, 16).ok())
            .flatten()
    };
    match name.split_once('-') {
        None => Some((hex(name)?, 0)),
        Some((sequence, epoch)) => Some((hex(sequence)?, hex(epoch)?)),
    }
    .filter(|&(sequence, _)| sequence > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: an epoch object round-trips and damage is an error; ownership follows the newest
    // epoch that started at or before a sequence. Method: encode, decode, flip every byte;
    // look owners up around three epochs' starts.
    #[test]
    fn epoch_objects_round_trip_and_the_newest_started_epoch_owns_a_sequence() {
        let object = encode(9, 3, 17);
        assert_eq!(decode(&object, 9), Ok((3, 17)));
        assert!(decode(&object, 8).unwrap_err().to_string().contains("disk"));
        for byte in 0..object.len() {
            let mut damaged = object.to_vec();
            damaged[byte] ^= 1;
            assert!(decode(&damaged, 9).is_err(), "byte {byte}");
        }
        let mut epochs = Epochs::default();
        assert_eq!(epochs.owner(5), 0);
        epochs.insert(1, 1);
        epochs.insert(2, 10);
        epochs.insert(3, 10);
        assert_eq!(epochs.owner(9), 1);
        assert_eq!(epochs.owner(10), 3);
        assert_eq!(epochs.newest(), 3);
        // Epoch 2 started where 3 did and owns nothing; 1 owns 9 and below.
        let needed: Vec<_> = epochs.needed_from(5).iter().collect();
        assert_eq!(needed, [(1, 1), (3, 10)]);
        let needed: Vec<_> = epochs.needed_from(10).iter().collect();
        assert_eq!(needed, [(3, 10)]);
        for low in [1, 5, 9, 10, 11, 30] {
            let needed = epochs.needed_from(low);
            for sequence in low..low + 20 {
                assert_eq!(
                    needed.owner(sequence),
                    epochs.owner(sequence),
                    "{low} {sequence}"
                );
            }
        }
        assert_eq!(parse_object_name(&object_name(10, 3)), Some((10, 3)));
        assert_eq!(parse_object_name(&object_name(10, 0)), Some((10, 0)));
        assert_eq!(parse_object_name("000000000000000a-zz"), None);
        assert_eq!(parse_object_name("0000000000000000"), None);
    }
}
