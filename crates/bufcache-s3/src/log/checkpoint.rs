//! The checkpoint object: the whole index as it stood once every segment up to and including
//! `through_sequence` was durable, `PREFIX/log/checkpoints/<through_sequence as 16 hex digits>`.
//! Opening a disk reads the newest checkpoint and replays only the segments after it.
//!
//! Format (integers little-endian):
//!
//! ```text
//!  0  magic "BCLOGCKP"     8  format version u32 (1)    12 reserved u32 (0)
//! 16  disk id u64          24 through sequence u64      32 mapping count u64
//! 40  mappings, 32 bytes each: disk offset u64, length u64, segment u64, object offset u64
//! end CRC-32 (IEEE) of every byte before it u32
//! ```

use bytes::{BufMut, Bytes, BytesMut};

use super::index::{Index, Mapping};

const MAGIC: &[u8; 8] = b"BCLOGCKP";
const FORMAT_VERSION: u32 = 1;
const HEADER_BYTES: usize = 40;
const ENTRY_BYTES: usize = 32;

/// A checkpoint's content.
#[derive(Debug, PartialEq, Eq)]
pub struct Checkpoint {
    pub through_sequence: u64,
    pub index: Index,
}

pub fn encode(disk_id: u64, through_sequence: u64, index: &Index) -> Bytes {
    let mut object = BytesMut::with_capacity(HEADER_BYTES + index.len() * ENTRY_BYTES + 4);
    object.put_slice(MAGIC);
    object.put_u32_le(FORMAT_VERSION);
    object.put_u32_le(0);
    object.put_u64_le(disk_id);
    object.put_u64_le(through_sequence);
    object.put_u64_le(index.len() as u64);
    for (offset, mapping) in index.iter() {
        object.put_u64_le(offset);
        object.put_u64_le(mapping.length);
        object.put_u64_le(mapping.segment);
        object.put_u64_le(mapping.object_offset);
    }
    let checksum = crc32fast::hash(&object);
    object.put_u32_le(checksum);
    object.freeze()
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

/// Checks and decodes a checkpoint object; the error says what is wrong.
pub fn decode(object: &[u8], disk_id: u64, disk_size_bytes: u64) -> Result<Checkpoint, String> {
    if object.len() < HEADER_BYTES + 4 {
        return Err(format!(
            "{} bytes, shorter than a checkpoint header (truncated?)",
            object.len()
        ));
    }
    if &object[..8] != MAGIC {
        return Err("no checkpoint magic `BCLOGCKP` (not a bufcache checkpoint)".to_string());
    }
    let (body, stored) = object.split_at(object.len() - 4);
    if crc32fast::hash(body) != u32::from_le_bytes(stored.try_into().expect("4 bytes")) {
        return Err("checksum mismatch (corrupt or truncated)".to_string());
    }
    let version = u32::from_le_bytes(object[8..12].try_into().expect("4 bytes"));
    if version != FORMAT_VERSION {
        return Err(format!(
            "checkpoint format version {version} is not the supported {FORMAT_VERSION}"
        ));
    }
    let stored_disk = u64_at(object, 16);
    if stored_disk != disk_id {
        return Err(format!(
            "belongs to disk {stored_disk:016x}, not this disk {disk_id:016x}"
        ));
    }
    let through_sequence = u64_at(object, 24);
    let count = u64_at(object, 32);
    if count.checked_mul(ENTRY_BYTES as u64) != Some((body.len() - HEADER_BYTES) as u64) {
        return Err(format!("{count} mappings do not fill {} bytes", body.len()));
    }
    let mut index = Index::new();
    let mut previous_end = 0;
    for entry in body[HEADER_BYTES..].chunks_exact(ENTRY_BYTES) {
        let offset = u64_at(entry, 0);
        let mapping = Mapping {
            length: u64_at(entry, 8),
            segment: u64_at(entry, 16),
            object_offset: u64_at(entry, 24),
        };
        let end = offset.checked_add(mapping.length);
        if offset < previous_end || end.is_none_or(|end| end > disk_size_bytes) {
            return Err(format!(
                "mapping of {} bytes at {offset} overlaps another or leaves the disk",
                mapping.length
            ));
        }
        if mapping.segment > through_sequence {
            return Err(format!(
                "mapping at {offset} names segment {} after the checkpoint's {through_sequence}",
                mapping.segment
            ));
        }
        previous_end = end.expect("checked above");
        index.insert(offset, mapping);
    }
    Ok(Checkpoint {
        through_sequence,
        index,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: a checkpoint round-trips and damage is an error, never a different index. Method:
    // encode an index of three mappings, decode it, flip each byte and expect an error.
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
        let object = encode(5, 3, &index);
        let decoded = decode(&object, 5, 1 << 30).unwrap();
        assert_eq!(
            decoded,
            Checkpoint {
                through_sequence: 3,
                index
            }
        );
        assert!(decode(&object, 6, 1 << 30).unwrap_err().contains("disk"));
        for byte in 0..object.len() {
            let mut damaged = object.to_vec();
            damaged[byte] ^= 1;
            assert!(decode(&damaged, 5, 1 << 30).is_err(), "byte {byte}");
        }
    }
}
