//! Checked blocks: how bytes stored as written (a chunk object, a plain extent of a log
//! segment) carry their own checksums so that every ranged read can check what it fetched.
//!
//! The logical bytes are cut into blocks of [`BLOCK_BYTES`] (4 KiB) from their start; each
//! block is stored followed by the CRC-32 (IEEE, the `crc32fast` crate: SIMD, several GB/s
//! per core) of its 4 KiB. A last block shorter than 4 KiB is padded with zeroes to a whole
//! block, so every stored block is [`STORED_BLOCK_BYTES`] (4,100) bytes and the stored place
//! of any logical byte is arithmetic: logical byte `n` is at `n / 4096 × 4100 + n % 4096`.
//!
//! A read of logical bytes `[start, end)` fetches the whole blocks around them with their
//! checksums, one contiguous range ([`stored_range`]): at most 4 KiB more on each side, plus
//! 4 bytes per 4 KiB (0.1 %). A block whose checksum does not match is an error naming its
//! place; its bytes are never returned.
//!
//! Why per block and not per object: reads are ranged GETs of just the bytes asked for (a
//! 4 KiB read of an 8 MiB segment or a 1 MiB chunk), and a checksum of the whole object
//! could only be checked by fetching all of it.

use crate::error::DecodeError;
use std::ops::Range;

use bytes::{Bytes, BytesMut};

/// Logical bytes of one checked block.
pub const BLOCK_BYTES: u64 = 4096;
/// Bytes of a block's checksum.
pub const CHECKSUM_BYTES: u64 = 4;
/// Stored bytes of one block: the block and its checksum.
pub const STORED_BLOCK_BYTES: u64 = BLOCK_BYTES + CHECKSUM_BYTES;

/// Stored bytes of `length` logical bytes (the last block padded to a whole one).
pub fn stored_bytes(length: u64) -> u64 {
    length.div_ceil(BLOCK_BYTES) * STORED_BLOCK_BYTES
}

/// The most logical bytes whose stored bytes fit in `stored` (whole blocks).
pub fn logical_bytes_within(stored: u64) -> u64 {
    stored / STORED_BLOCK_BYTES * BLOCK_BYTES
}

/// The stored bytes (offsets from the start of the stored form) holding the blocks that
/// logical bytes `logical` touch.
pub fn stored_range(logical: Range<u64>) -> Range<u64> {
    let first = logical.start / BLOCK_BYTES;
    let end = logical.end.div_ceil(BLOCK_BYTES).max(first);
    first * STORED_BLOCK_BYTES..end * STORED_BLOCK_BYTES
}

fn checksum(block: &[u8]) -> u32 {
    crc32fast::hash(block)
}

/// Appends the stored form of `data` to `stored`.
pub fn encode_into(data: &[u8], stored: &mut BytesMut) {
    stored.reserve(stored_bytes(data.len() as u64) as usize);
    for block in data.chunks(BLOCK_BYTES as usize) {
        let start = stored.len();
        stored.extend_from_slice(block);
        stored.resize(start + BLOCK_BYTES as usize, 0);
        let sum = checksum(&stored[start..]);
        stored.extend_from_slice(&sum.to_le_bytes());
    }
}

/// The stored form of `data`.
pub fn encode(data: &[u8]) -> Bytes {
    let mut stored = BytesMut::new();
    encode_into(data, &mut stored);
    stored.freeze()
}

/// Where a checked range lies, for error messages: the object offset of the stored form's
/// first byte and the disk offset of its first logical byte.
#[derive(Clone, Copy, Debug)]
pub struct Place {
    pub object_offset: u64,
    pub disk_offset: u64,
}

/// Checks every block of `fetched` (the bytes [`stored_range`] named for `logical`) and
/// copies the logical bytes `logical` into `target` (`logical`'s length). The error names
/// the first bad block by object and disk offset; `target` is then left unspecified and
/// must not be used.
pub fn decode_range(
    fetched: &[u8],
    logical: Range<u64>,
    place: Place,
    target: &mut [u8],
) -> Result<(), DecodeError> {
    let stored = stored_range(logical.clone());
    if fetched.len() as u64 != stored.end - stored.start {
        return Err(DecodeError::Truncated {
            found: fetched.len() as u64,
            needed: format!(
                "where the blocks of logical bytes {}..{} take {} (truncated?)",
                logical.start,
                logical.end,
                stored.end - stored.start
            ),
        });
    }
    debug_assert_eq!(target.len() as u64, logical.end - logical.start);
    let first_block = logical.start / BLOCK_BYTES;
    for (number, block) in fetched
        .chunks_exact(STORED_BLOCK_BYTES as usize)
        .enumerate()
    {
        let (bytes, stored_sum) = block.split_at(BLOCK_BYTES as usize);
        let stored_sum = u32::from_le_bytes(stored_sum.try_into().expect("4 bytes"));
        let block_index = first_block + number as u64;
        if checksum(bytes) != stored_sum {
            return Err(DecodeError::BadBlock {
                object_offset: place.object_offset + block_index * STORED_BLOCK_BYTES,
                disk_offset: place.disk_offset + block_index * BLOCK_BYTES,
            });
        }
        // The part of this block the caller asked for.
        let block_start = block_index * BLOCK_BYTES;
        let from = logical.start.max(block_start);
        let to = logical.end.min(block_start + BLOCK_BYTES);
        if from < to {
            target[(from - logical.start) as usize..(to - logical.start) as usize].copy_from_slice(
                &bytes[(from - block_start) as usize..(to - block_start) as usize],
            );
        }
    }
    Ok(())
}

/// The logical bytes `0..length` of a whole stored form, checked (see [`decode_range`]).
pub fn decode(stored: &[u8], length: u64, place: Place) -> Result<Vec<u8>, DecodeError> {
    let mut data = vec![0u8; length as usize];
    decode_range(stored, 0..length, place, &mut data)?;
    Ok(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PLACE: Place = Place {
        object_offset: 64,
        disk_offset: 1 << 20,
    };

    // Goal: any logical range decodes from its stored range to the bytes encoded, and any
    // flipped stored byte inside the fetched blocks is an error naming the block, never
    // other bytes. Method: encode 3 blocks and a 100-byte tail; decode every range with
    // ends at interesting offsets; flip each byte of the stored form and decode the whole.
    #[test]
    fn every_range_decodes_and_every_flipped_byte_is_an_error() {
        let data: Vec<u8> = (0..3 * 4096 + 100).map(|n| (n * 7 % 251) as u8).collect();
        let stored = encode(&data);
        assert_eq!(stored.len() as u64, stored_bytes(data.len() as u64));
        assert_eq!(stored.len(), 4 * 4100);
        let ends = [
            0u64, 1, 4095, 4096, 4097, 8191, 8192, 12_000, 12_288, 12_388,
        ];
        for &start in &ends {
            for &end in ends.iter().filter(|&&end| end > start) {
                let range = stored_range(start..end);
                let mut target = vec![0u8; (end - start) as usize];
                decode_range(
                    &stored[range.start as usize..range.end as usize],
                    start..end,
                    PLACE,
                    &mut target,
                )
                .unwrap();
                assert_eq!(target, data[start as usize..end as usize], "{start}..{end}");
            }
        }
        for index in 0..stored.len() {
            let mut damaged = stored.to_vec();
            damaged[index] ^= 0x08;
            let error = decode(&damaged, data.len() as u64, PLACE).unwrap_err();
            let block = index as u64 / STORED_BLOCK_BYTES;
            assert!(
                error
                    .to_string()
                    .contains(&format!("disk offset {}", (1 << 20) + block * 4096)),
                "byte {index}: {error}"
            );
        }
        assert!(
            decode(&stored[..stored.len() - 1], data.len() as u64, PLACE)
                .unwrap_err()
                .to_string()
                .contains("truncated")
        );
        assert_eq!(logical_bytes_within(4100 * 3 + 4099), 3 * 4096);
    }
}
