//! The segment object: one immutable object per sealed segment, `PREFIX/log/segments/<sequence
//! as 16 hex digits>`, holding the extents appended during its life.
//!
//! Format (integers little-endian):
//!
//! ```text
//! header (64 bytes)
//!   0  magic "BCLOGSEG"
//!   8  format version u32 (2)      12 header length u32 (64)
//!  16  disk id u64                 24 sequence u64
//!  32  data length u64             40 extent count u64
//!  48  CRC-32 (IEEE) of the table u32
//!  52  reserved u32 (0) ×2         60 CRC-32 of bytes 0..60 u32
//! data (data length bytes): the data extents' bytes, in append order
//! table (extent count × 40 bytes), in append order, later entries win:
//!   disk offset u64, length u64, position in data u64 (u64::MAX: zeroes), CRC-32 of the
//!   extent's bytes u32 (0 for zeroes), kind u32 (1 data, 2 zeroes, 3 copy), source segment
//!   u64 (kind 3: the segment the garbage collector copied the bytes from; else 0)
//! ```
//!
//! A copy (kind 3) applies only where the index, at that point of the log, still maps the
//! range to its source segment: a client write or trim that reached the log between the
//! collector's read of the source and its append wins over the copy, live and at replay.
//! Version 1 segments (32-byte entries, no copies) are still read.
//!
//! The data comes first so that an extent's place in the object is known when it is
//! appended (header length + position in data), before the segment is sealed.

use bytes::{BufMut, Bytes, BytesMut};

const MAGIC: &[u8; 8] = b"BCLOGSEG";
const FORMAT_VERSION: u32 = 2;
/// Bytes before the data.
pub const HEADER_BYTES: u64 = 64;
/// Bytes of one table entry.
pub const TABLE_ENTRY_BYTES: u64 = 40;
/// Bytes of one table entry of a version 1 segment (no source field).
const TABLE_ENTRY_BYTES_VERSION_1: u64 = 32;
const KIND_DATA: u32 = 1;
const KIND_ZEROES: u32 = 2;
const KIND_COPY: u32 = 3;
const ZEROES_POSITION: u64 = u64::MAX;

/// One extent of a segment: bytes written at `disk_offset`, or a range zeroed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentExtent {
    pub disk_offset: u64,
    pub length: u64,
    /// Where the bytes are in the data area; None for a zeroed (trimmed) range.
    pub data_position: Option<u64>,
    pub checksum: u32,
    /// For bytes the garbage collector copied: the segment they were copied from.
    pub copy_of: Option<u64>,
}

impl SegmentExtent {
    /// Offset of the extent's bytes in the segment object (None for zeroes).
    pub fn object_offset(&self) -> Option<u64> {
        self.data_position.map(|position| HEADER_BYTES + position)
    }
}

/// A segment being filled in memory.
pub struct OpenSegment {
    pub sequence: u64,
    pub data: BytesMut,
    pub table: Vec<SegmentExtent>,
}

impl OpenSegment {
    pub fn new(sequence: u64) -> OpenSegment {
        OpenSegment {
            sequence,
            data: BytesMut::new(),
            table: Vec::new(),
        }
    }

    /// The object's size once sealed, with `more_data` more bytes and `more_extents` more
    /// extents.
    pub fn sealed_bytes_with(&self, more_data: u64, more_extents: u64) -> u64 {
        HEADER_BYTES
            + self.data.len() as u64
            + more_data
            + (self.table.len() as u64 + more_extents) * TABLE_ENTRY_BYTES
    }

    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// Appends `data` written at `disk_offset`; returns the offset of its bytes in the object.
    pub fn append_data(&mut self, disk_offset: u64, data: &[u8]) -> u64 {
        self.append(disk_offset, data, None)
    }

    /// Appends `data` the garbage collector copied from segment `source` (see the module
    /// docs); returns the offset of its bytes in the object.
    pub fn append_copy(&mut self, disk_offset: u64, data: &[u8], source: u64) -> u64 {
        self.append(disk_offset, data, Some(source))
    }

    fn append(&mut self, disk_offset: u64, data: &[u8], copy_of: Option<u64>) -> u64 {
        let position = self.data.len() as u64;
        self.data.extend_from_slice(data);
        let extent = SegmentExtent {
            disk_offset,
            length: data.len() as u64,
            data_position: Some(position),
            checksum: crc32fast::hash(data),
            copy_of,
        };
        self.table.push(extent);
        HEADER_BYTES + position
    }

    /// Records that `length` bytes at `disk_offset` were zeroed.
    pub fn append_zeroes(&mut self, disk_offset: u64, length: u64) {
        self.table.push(SegmentExtent {
            disk_offset,
            length,
            data_position: None,
            checksum: 0,
            copy_of: None,
        });
    }

    /// The bytes at `object_offset` of this segment's future object (an extent appended
    /// earlier).
    pub fn read(&self, object_offset: u64, length: u64) -> &[u8] {
        let start = (object_offset - HEADER_BYTES) as usize;
        &self.data[start..start + length as usize]
    }

    /// The whole object.
    pub fn seal(&self, disk_id: u64) -> Bytes {
        let mut table = BytesMut::with_capacity(self.table.len() * TABLE_ENTRY_BYTES as usize);
        for extent in &self.table {
            table.put_u64_le(extent.disk_offset);
            table.put_u64_le(extent.length);
            table.put_u64_le(extent.data_position.unwrap_or(ZEROES_POSITION));
            table.put_u32_le(extent.checksum);
            table.put_u32_le(match (extent.data_position, extent.copy_of) {
                (Some(_), None) => KIND_DATA,
                (Some(_), Some(_)) => KIND_COPY,
                (None, _) => KIND_ZEROES,
            });
            table.put_u64_le(extent.copy_of.unwrap_or(0));
        }
        let mut object =
            BytesMut::with_capacity(HEADER_BYTES as usize + self.data.len() + table.len());
        object.put_slice(MAGIC);
        object.put_u32_le(FORMAT_VERSION);
        object.put_u32_le(HEADER_BYTES as u32);
        object.put_u64_le(disk_id);
        object.put_u64_le(self.sequence);
        object.put_u64_le(self.data.len() as u64);
        object.put_u64_le(self.table.len() as u64);
        object.put_u32_le(crc32fast::hash(&table));
        object.put_u32_le(0);
        object.put_u32_le(0);
        let header_checksum = crc32fast::hash(&object[..60]);
        object.put_u32_le(header_checksum);
        object.put_slice(&self.data);
        object.put_slice(&table);
        object.freeze()
    }
}

/// A segment object read back and checked: its sequence and extents.
#[derive(Debug)]
pub struct DecodedSegment {
    pub sequence: u64,
    pub extents: Vec<SegmentExtent>,
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"))
}

/// Checks and decodes a whole segment object: magic, version, header and table checksums,
/// the disk id, every extent's checksum and that every extent lies inside the disk. The
/// error says what is wrong (the caller names the object).
pub fn decode(object: &[u8], disk_id: u64, disk_size_bytes: u64) -> Result<DecodedSegment, String> {
    if object.len() < HEADER_BYTES as usize {
        return Err(format!(
            "{} bytes, shorter than the {HEADER_BYTES}-byte header (truncated?)",
            object.len()
        ));
    }
    if &object[..8] != MAGIC {
        return Err("no segment magic `BCLOGSEG` (not a bufcache log segment)".to_string());
    }
    if crc32fast::hash(&object[..60]) != u32_at(object, 60) {
        return Err("header checksum mismatch (corrupt header)".to_string());
    }
    let version = u32_at(object, 8);
    let entry_bytes = match version {
        1 => TABLE_ENTRY_BYTES_VERSION_1,
        FORMAT_VERSION => TABLE_ENTRY_BYTES,
        _ => {
            return Err(format!(
                "segment format version {version} is not a supported one (1 or {FORMAT_VERSION})"
            ))
        }
    };
    if u64::from(u32_at(object, 12)) != HEADER_BYTES {
        return Err(format!(
            "header length {} is not {HEADER_BYTES}",
            u32_at(object, 12)
        ));
    }
    let stored_disk = u64_at(object, 16);
    if stored_disk != disk_id {
        return Err(format!(
            "belongs to disk {stored_disk:016x}, not this disk {disk_id:016x}"
        ));
    }
    let sequence = u64_at(object, 24);
    let data_bytes = u64_at(object, 32);
    let extent_count = u64_at(object, 40);
    let expected = extent_count
        .checked_mul(entry_bytes)
        .and_then(|table| table.checked_add(data_bytes))
        .and_then(|body| body.checked_add(HEADER_BYTES));
    if expected != Some(object.len() as u64) {
        return Err(format!(
            "{} bytes where the header promises {HEADER_BYTES} + {data_bytes} data + {extent_count} extents (truncated?)",
            object.len()
        ));
    }
    let data = &object[HEADER_BYTES as usize..(HEADER_BYTES + data_bytes) as usize];
    let table = &object[(HEADER_BYTES + data_bytes) as usize..];
    if crc32fast::hash(table) != u32_at(object, 48) {
        return Err("extent table checksum mismatch (corrupt table)".to_string());
    }
    let mut extents = Vec::with_capacity(extent_count as usize);
    for (number, entry) in table.chunks_exact(entry_bytes as usize).enumerate() {
        let disk_offset = u64_at(entry, 0);
        let length = u64_at(entry, 8);
        let position = u64_at(entry, 16);
        let checksum = u32_at(entry, 24);
        let kind = u32_at(entry, 28);
        if disk_offset
            .checked_add(length)
            .is_none_or(|end| end > disk_size_bytes)
        {
            return Err(format!(
                "extent {number} ({length} bytes at {disk_offset}) reaches past the end of the disk ({disk_size_bytes} bytes)"
            ));
        }
        let source = (entry_bytes == TABLE_ENTRY_BYTES).then(|| u64_at(entry, 32));
        let copy_of = match (kind, source) {
            (KIND_COPY, Some(source)) if source > 0 && source < sequence => Some(source),
            (KIND_COPY, _) => {
                return Err(format!(
                    "extent {number} is a copy of segment {source:?}, not of an earlier segment"
                ))
            }
            (_, Some(0) | None) => None,
            (_, Some(other)) => {
                return Err(format!(
                    "extent {number} names source segment {other} but is no copy"
                ))
            }
        };
        let data_position = match kind {
            KIND_DATA | KIND_COPY => {
                let bytes = position
                    .checked_add(length)
                    .filter(|&end| end <= data_bytes)
                    .map(|end| &data[position as usize..end as usize])
                    .ok_or_else(|| format!("extent {number} lies outside the data area"))?;
                if crc32fast::hash(bytes) != checksum {
                    return Err(format!(
                        "extent {number} ({length} bytes at disk offset {disk_offset}) fails its checksum (corrupt data)"
                    ));
                }
                Some(position)
            }
            KIND_ZEROES => None,
            other => return Err(format!("extent {number} has unknown kind {other}")),
        };
        extents.push(SegmentExtent {
            disk_offset,
            length,
            data_position,
            checksum,
            copy_of,
        });
    }
    Ok(DecodedSegment { sequence, extents })
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: a sealed segment decodes to what was appended, and any flipped byte or truncation
    // is detected. Method: seal a segment of two data extents and a zeroed range, decode it,
    // then flip every byte in turn (and cut it short) and expect an error each time.
    #[test]
    fn sealed_segments_decode_and_every_flipped_byte_is_detected() {
        let mut segment = OpenSegment::new(7);
        let first = segment.append_data(4096, &[1u8; 100]);
        segment.append_zeroes(0, 8192);
        let second = segment.append_data(1 << 20, &[2u8; 50]);
        let copy = segment.append_copy(1 << 21, &[3u8; 30], 4);
        assert_eq!(segment.read(copy, 30), &[3u8; 30]);
        assert_eq!(segment.read(first, 100), &[1u8; 100]);
        assert_eq!(segment.read(second, 50), &[2u8; 50]);
        let object = segment.seal(0xabc);
        assert_eq!(object.len() as u64, segment.sealed_bytes_with(0, 0));
        assert_eq!(&object[first as usize..first as usize + 100], &[1u8; 100]);
        let decoded = decode(&object, 0xabc, 1 << 30).unwrap();
        assert_eq!(decoded.sequence, 7);
        assert_eq!(decoded.extents, segment.table);
        assert!(decode(&object, 0xabd, 1 << 30)
            .unwrap_err()
            .contains("disk"));
        assert!(decode(&object, 0xabc, 4096)
            .unwrap_err()
            .contains("past the end"));
        for index in 0..object.len() {
            let mut damaged = object.to_vec();
            damaged[index] ^= 0x40;
            assert!(decode(&damaged, 0xabc, 1 << 30).is_err(), "byte {index}");
        }
        assert!(decode(&object[..object.len() - 1], 0xabc, 1 << 30)
            .unwrap_err()
            .contains("truncated"));
    }
}
