//! The segment object: one immutable object per sealed segment, `PREFIX/log/segments/<sequence
//! as 16 hex digits>`, holding the extents appended during its life.
//!
//! Format (integers little-endian):
//!
//! ```text
//! header (64 bytes)
//!   0  magic "BCLOGSEG"
//!   8  format version u32 (4)      12 header length u32 (64)
//!  16  disk id u64                 24 sequence u64
//!  32  data length u64             40 extent count u64
//!  48  CRC-32 (IEEE) of the table u32
//!  52  durable mark u32            56 checkpoint mark u32
//!  60  CRC-32 of bytes 0..60 u32
//! data (data length bytes): the data extents' stored bytes, in append order
//! table (extent count × 56 bytes), in append order, later entries win:
//!   disk offset u64, length u64 (logical), position in data u64 (u64::MAX: zeroes), CRC-32
//!   of the extent's stored bytes u32 (0 for zeroes), kind u32 (1 data, 2 zeroes, 3 copy),
//!   source segment u64 (kind 3: the segment the garbage collector copied the bytes from;
//!   else 0), stored length u64, storage flags u32, reserved u32 (0)
//! ```
//!
//! The marks record what the writer knew to be durable when it sealed the segment, as
//! distances back from its sequence (0: not recorded, as in segments written before them):
//! the durable mark `sequence - d` says every segment up to `d` was durable, the checkpoint
//! mark `sequence - k` that a checkpoint covering the segments up to `k` was (each at most
//! `u32::MAX` back, so a mark may understate, never overstate). An open uses them to tell a
//! crash from a loss ([`Marks`]).
//!
//! Storage flags of a data extent: 4 (version 4): stored as written in checked blocks, each
//! 4 KiB followed by its CRC-32 (module `blocks`: every ranged read checks the blocks it
//! fetches); 1 and/or 2: a sealed frame (module `seal`: 1 compressed, 2 encrypted), read and
//! checked whole; 0 (versions 1 to 3 only): stored as written, without block checksums
//! (only the table's CRC of the whole extent, checked when the segment is replayed).
//!
//! A copy (kind 3) applies only where the index, at that point of the log, still maps the
//! range to its source segment: a client write or trim that reached the log between the
//! collector's read of the source and its append wins over the copy, live and at replay.
//! Version 1 segments (32-byte entries, no copies), version 2 ones (40-byte entries, no
//! sealing) and version 3 ones (plain extents without block checksums) are still read.
//!
//! The data comes first so that an extent's place in the object is known when it is
//! appended (header length + position in data), before the segment is sealed.
//!
//! The index keeps, for each mapped range, an *address* in its segment:
//! - for an extent in checked blocks, bit 62 set, the extent's object offset in bits 32..62
//!   and the range's offset within the extent's logical bytes in bits 0..32;
//! - for a sealed extent (compressed and/or encrypted, readable only whole), bit 63 set, the
//!   frame's object offset in bits 33..63, its stored length in bits 16..33 and the range's
//!   offset within the extent's logical bytes in bits 0..16;
//! - for an extent of an older segment stored as written, the object offset of the range's
//!   first byte (ranged reads fetch just the range, unchecked).
//!
//! Adding `n` to an address moves `n` bytes into the range in every case (the index does that
//! when it splits mappings), since a sealed extent holds at most
//! `seal::SEALED_EXTENT_BYTES_MAX` (64 KiB) logical bytes and a checked one less than 4 GiB.
//! So the index and its checkpoints need no format change, and a segment of version 3 or
//! later is at most [`SEALED_SEGMENT_BYTES_MAX`] (1 GiB, the largest `segment-size=`).

use std::ops::Range;
use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};

use crate::blocks::{self, Place};
use crate::error::DecodeError;
use crate::seal::{Sealer, FRAME_OVERHEAD_BYTES_MAX, SEALED_EXTENT_BYTES_MAX};

const MAGIC: &[u8; 8] = b"BCLOGSEG";
const FORMAT_VERSION: u32 = 4;
/// The version whose extents stored as written carry no block checksums.
const FORMAT_VERSION_3: u32 = 3;
/// Bytes before the data.
pub const HEADER_BYTES: u64 = 64;
/// Bytes of one table entry.
pub const TABLE_ENTRY_BYTES: u64 = 56;
/// Bytes of one table entry of a version 1 segment (no source field).
const TABLE_ENTRY_BYTES_VERSION_1: u64 = 32;
/// Bytes of one table entry of a version 2 segment (no stored length, no seal flags).
const TABLE_ENTRY_BYTES_VERSION_2: u64 = 40;
const KIND_DATA: u32 = 1;
const KIND_ZEROES: u32 = 2;
const KIND_COPY: u32 = 3;
const ZEROES_POSITION: u64 = u64::MAX;
/// Storage flags of a sealed frame (module `seal`: 1 compressed, 2 encrypted).
const FRAME_FLAGS: u32 = 3;
/// Storage flag of an extent stored as written in checked blocks (module `blocks`).
const FLAG_BLOCKS: u32 = 4;

/// Largest segment object whose sealed and checked extents' addresses fit (see the module
/// docs).
pub const SEALED_SEGMENT_BYTES_MAX: u64 = 1 << OBJECT_OFFSET_BITS;
const CHECKED_BIT: u64 = 1 << 62;
const CHECKED_WITHIN_BITS: u32 = 32;
/// Most logical bytes of one extent in checked blocks (its offset within must fit).
const CHECKED_EXTENT_BYTES_MAX: u64 = 1 << CHECKED_WITHIN_BITS;
const _: () = assert!(CHECKED_WITHIN_BITS + OBJECT_OFFSET_BITS == 62);
const SEALED_BIT: u64 = 1 << 63;
const WITHIN_BITS: u32 = 16;
const STORED_LENGTH_BITS: u32 = 17;
const OBJECT_OFFSET_BITS: u32 = 30;
const STORED_LENGTH_SHIFT: u32 = WITHIN_BITS;
const OBJECT_OFFSET_SHIFT: u32 = WITHIN_BITS + STORED_LENGTH_BITS;
const _: () = assert!(SEALED_EXTENT_BYTES_MAX <= 1 << WITHIN_BITS);
const _: () = assert!(SEALED_EXTENT_BYTES_MAX + FRAME_OVERHEAD_BYTES_MAX < 1 << STORED_LENGTH_BITS);
const _: () = assert!(OBJECT_OFFSET_SHIFT + OBJECT_OFFSET_BITS == 63);

fn sealed_address(object_offset: u64, stored_length: u64) -> u64 {
    debug_assert!(object_offset < SEALED_SEGMENT_BYTES_MAX);
    debug_assert!(stored_length < 1 << STORED_LENGTH_BITS);
    SEALED_BIT | object_offset << OBJECT_OFFSET_SHIFT | stored_length << STORED_LENGTH_SHIFT
}

fn checked_address(object_offset: u64) -> u64 {
    debug_assert!(object_offset < SEALED_SEGMENT_BYTES_MAX);
    CHECKED_BIT | object_offset << CHECKED_WITHIN_BITS
}

/// Where the bytes of a mapped range are, from its address (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Location {
    /// Stored as written without checksums (segments before version 4), from this object
    /// offset on.
    Plain { object_offset: u64 },
    /// In checked blocks (module `blocks`) whose stored form starts at `object_offset`,
    /// `within` bytes into the extent's logical bytes.
    Checked { object_offset: u64, within: u64 },
    /// Inside the sealed extent whose frame is `stored_length` bytes at `object_offset`,
    /// `within` bytes into its logical bytes.
    Sealed {
        object_offset: u64,
        stored_length: u64,
        within: u64,
    },
}

pub fn locate(address: u64) -> Location {
    let field = |shift: u32, bits: u32| (address >> shift) & ((1 << bits) - 1);
    if address & SEALED_BIT == 0 {
        if address & CHECKED_BIT != 0 {
            return Location::Checked {
                object_offset: field(CHECKED_WITHIN_BITS, OBJECT_OFFSET_BITS),
                within: field(0, CHECKED_WITHIN_BITS),
            };
        }
        return Location::Plain {
            object_offset: address,
        };
    }
    let field = |shift: u32, bits: u32| (address >> shift) & ((1 << bits) - 1);
    Location::Sealed {
        object_offset: field(OBJECT_OFFSET_SHIFT, OBJECT_OFFSET_BITS),
        stored_length: field(STORED_LENGTH_SHIFT, STORED_LENGTH_BITS),
        within: field(0, WITHIN_BITS),
    }
}

/// The object bytes a read of `length` bytes at `address` must fetch: the range itself when
/// stored as written without checksums, the whole blocks around it with their checksums when
/// checked, the whole frame when sealed.
pub fn fetch_range(address: u64, length: u64) -> Range<u64> {
    match locate(address) {
        Location::Plain { object_offset } => object_offset..object_offset + length,
        Location::Checked {
            object_offset,
            within,
        } => {
            let stored = blocks::stored_range(within..within + length);
            object_offset + stored.start..object_offset + stored.end
        }
        Location::Sealed {
            object_offset,
            stored_length,
            ..
        } => object_offset..object_offset + stored_length,
    }
}

/// Fills `target` (the bytes at `disk_offset`, mapped to `address` of segment `sequence`)
/// from `fetched`, the object bytes [`fetch_range`] named. The error says what is wrong.
pub fn extract(
    sealer: &Sealer,
    sequence: u64,
    fetched: &[u8],
    address: u64,
    disk_offset: u64,
    target: &mut [u8],
) -> Result<(), DecodeError> {
    match locate(address) {
        Location::Plain { .. } => target.copy_from_slice(&fetched[..target.len()]),
        Location::Checked {
            object_offset,
            within,
        } => blocks::decode_range(
            fetched,
            within..within + target.len() as u64,
            Place {
                object_offset,
                disk_offset: disk_offset - within,
            },
            target,
        )?,
        Location::Sealed { within, .. } => {
            let logical = sealer.unseal(fetched, sequence, disk_offset - within)?;
            let range = within as usize..within as usize + target.len();
            let bytes = logical.get(range).ok_or_else(|| {
                DecodeError::Inconsistent(format!(
                    "sealed extent at disk offset {} holds {} bytes, fewer than the index maps",
                    disk_offset - within,
                    logical.len()
                ))
            })?;
            target.copy_from_slice(bytes);
        }
    }
    Ok(())
}

/// The address `address` of a range becomes when the stored form of its extent moves to
/// object offset `to` (the range keeps its place within the extent).
pub fn moved_address(address: u64, to: u64) -> u64 {
    match locate(address) {
        Location::Checked { within, .. } => checked_address(to) + within,
        Location::Sealed {
            stored_length,
            within,
            ..
        } => sealed_address(to, stored_length) + within,
        Location::Plain { object_offset } => {
            unreachable!("address {object_offset}: an open segment stores no plain extents")
        }
    }
}

/// The object offset of the stored form of the extent `address` lies in (for a plain
/// address, the range's own first byte).
pub fn extent_object_offset(address: u64) -> u64 {
    match locate(address) {
        Location::Plain { object_offset }
        | Location::Checked { object_offset, .. }
        | Location::Sealed { object_offset, .. } => object_offset,
    }
}

/// A data extent [`OpenSegment::order_by_disk_offset`] moved: its disk range and the object
/// offsets of its stored form before and after.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Move {
    pub disk_offset: u64,
    pub length: u64,
    pub from: u64,
    pub to: u64,
}

/// One extent of a segment: bytes written at `disk_offset`, or a range zeroed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentExtent {
    pub disk_offset: u64,
    /// Logical bytes (what the client wrote).
    pub length: u64,
    /// Where the stored bytes are in the data area; None for a zeroed (trimmed) range.
    pub data_position: Option<u64>,
    /// CRC-32 of the stored bytes.
    pub checksum: u32,
    /// For bytes the garbage collector copied: the segment they were copied from.
    pub copy_of: Option<u64>,
    /// Bytes stored in the data area (`length` when stored as written without checksums).
    pub stored_length: u64,
    /// Storage flags (module docs): a frame's seal flags, `FLAG_BLOCKS`, or 0 (an older
    /// segment's extent stored as written).
    pub seal_flags: u32,
}

impl SegmentExtent {
    /// Whether the extent is a sealed frame (compressed and/or encrypted, readable only whole).
    pub fn is_sealed(&self) -> bool {
        self.seal_flags & FRAME_FLAGS != 0
    }

    /// The index address of the extent's first byte (None for zeroes): see the module docs.
    pub fn object_offset(&self) -> Option<u64> {
        self.data_position.map(|position| match self.seal_flags {
            0 => HEADER_BYTES + position,
            FLAG_BLOCKS => checked_address(HEADER_BYTES + position),
            _ => sealed_address(HEADER_BYTES + position, self.stored_length),
        })
    }
}

/// What the writer of a segment knew to be durable when it sealed it (see the module docs).
/// A segment after a missing one whose durable mark reaches the missing one proves that
/// segment was stored (a crash never leaves such a gap: its later segments were sealed before
/// it was durable); a checkpoint mark past the newest checkpoint found proves a newer one was
/// stored and is gone.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Marks {
    /// Every segment up to this one was durable; None when not recorded.
    pub durable_through: Option<u64>,
    /// A checkpoint covering the segments up to this one was durable; None when not recorded
    /// (or no checkpoint was).
    pub checkpoint_through: Option<u64>,
}

/// The distance back from `sequence` to `mark` as the header stores it (0: not recorded).
fn mark_distance(sequence: u64, mark: u64) -> u32 {
    debug_assert!(mark < sequence, "a mark lies before its segment");
    u32::try_from(sequence - mark).unwrap_or(u32::MAX)
}

fn mark_of(sequence: u64, distance: u32) -> Option<u64> {
    (distance != 0)
        .then(|| sequence.checked_sub(u64::from(distance)))
        .flatten()
        .filter(|&mark| mark > 0)
}

/// A segment being filled in memory.
pub struct OpenSegment {
    pub sequence: u64,
    /// Stored bytes of the data extents.
    pub data: BytesMut,
    pub table: Vec<SegmentExtent>,
    sealer: Arc<Sealer>,
}

impl OpenSegment {
    pub fn new(sequence: u64, sealer: Arc<Sealer>) -> OpenSegment {
        OpenSegment {
            sequence,
            data: BytesMut::new(),
            table: Vec::new(),
            sealer,
        }
    }

    /// The most the object can be once sealed, with `more_data` more logical bytes in
    /// `more_extents` more extents (sealing may add a frame to each; checked blocks add a
    /// checksum per 4 KiB and pad each extent's last block).
    pub fn sealed_bytes_with(&self, more_data: u64, more_extents: u64) -> u64 {
        let overhead = if self.sealer.seals() {
            more_extents * self.sealer.overhead_bytes_max()
        } else if more_data == 0 {
            // Zeroed ranges: a table entry each, no data.
            0
        } else {
            (more_data.div_ceil(blocks::BLOCK_BYTES) + more_extents) * blocks::CHECKSUM_BYTES
                + more_extents * (blocks::BLOCK_BYTES - 1)
        };
        HEADER_BYTES
            + self.data.len() as u64
            + more_data
            + overhead
            + (self.table.len() as u64 + more_extents) * TABLE_ENTRY_BYTES
            + self.sealer.object_tag_bytes()
    }

    /// The most logical bytes one more extent may hold with the object staying within
    /// `segment_bytes_max` bytes (0: none fit): whole stored blocks when stored as written.
    pub fn room_bytes(&self, segment_bytes_max: u64) -> u64 {
        // With no data, sealed_bytes_with counts the header, the data so far, the table with
        // one more entry and, when sealing, that extent's frame overhead.
        let stored_room = segment_bytes_max.saturating_sub(self.sealed_bytes_with(0, 1));
        if self.sealer.seals() {
            stored_room
        } else {
            blocks::logical_bytes_within(stored_room)
        }
    }

    /// Most logical bytes one appended extent may hold.
    pub fn extent_bytes_max(&self) -> u64 {
        self.sealer.extent_bytes_max().min(CHECKED_EXTENT_BYTES_MAX)
    }

    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// Appends `data` written at `disk_offset` (at most [`OpenSegment::extent_bytes_max`]
    /// bytes); returns the index address of its first byte.
    pub fn append_data(&mut self, disk_offset: u64, data: &[u8]) -> u64 {
        self.append(disk_offset, data, None)
    }

    /// Appends `data` the garbage collector copied from segment `source` (see the module
    /// docs), sealed anew for this segment; returns the index address of its first byte.
    pub fn append_copy(&mut self, disk_offset: u64, data: &[u8], source: u64) -> u64 {
        self.append(disk_offset, data, Some(source))
    }

    fn append(&mut self, disk_offset: u64, data: &[u8], copy_of: Option<u64>) -> u64 {
        assert!(
            data.len() as u64 <= self.extent_bytes_max(),
            "an extent of {} bytes exceeds the most a sealed extent holds",
            data.len()
        );
        let position = self.data.len() as u64;
        let (stored_length, seal_flags) = match self.sealer.seal(self.sequence, disk_offset, data) {
            Some((frame, flags)) => {
                self.data.extend_from_slice(&frame);
                (frame.len() as u64, u32::from(flags))
            }
            None => {
                blocks::encode_into(data, &mut self.data);
                (blocks::stored_bytes(data.len() as u64), FLAG_BLOCKS)
            }
        };
        let extent = SegmentExtent {
            disk_offset,
            length: data.len() as u64,
            data_position: Some(position),
            checksum: crc32fast::hash(&self.data[position as usize..]),
            copy_of,
            stored_length,
            seal_flags,
        };
        self.table.push(extent);
        extent.object_offset().expect("a data extent")
    }

    /// Lays the data extents out in disk order (stably: of two at one disk offset, the one
    /// appended first stays first), so that ranges written out of order (parallel writers, a
    /// cache's write-back order) but adjacent on the disk lie back to back in the object and
    /// one ranged GET reads them. The table keeps append order, which replay needs (later
    /// entries win). Returns every data extent that moved; the index addresses into each
    /// must move with it ([`moved_address`]) before the segment is read again.
    pub fn order_by_disk_offset(&mut self) -> Vec<Move> {
        let mut order: Vec<usize> = (0..self.table.len())
            .filter(|&entry| self.table[entry].data_position.is_some())
            .collect();
        order.sort_by_key(|&entry| self.table[entry].disk_offset);
        let mut data = BytesMut::with_capacity(self.data.len());
        let mut moves = Vec::new();
        for entry in order {
            let extent = &mut self.table[entry];
            let from = extent.data_position.expect("a data extent");
            let to = data.len() as u64;
            data.extend_from_slice(
                &self.data[from as usize..(from + extent.stored_length) as usize],
            );
            if from != to {
                moves.push(Move {
                    disk_offset: extent.disk_offset,
                    length: extent.length,
                    from: HEADER_BYTES + from,
                    to: HEADER_BYTES + to,
                });
                extent.data_position = Some(to);
            }
        }
        assert_eq!(
            data.len(),
            self.data.len(),
            "the data extents of segment {} do not tile its data",
            self.sequence
        );
        self.data = data;
        moves
    }

    /// Records that `length` bytes at `disk_offset` were zeroed.
    pub fn append_zeroes(&mut self, disk_offset: u64, length: u64) {
        self.table.push(SegmentExtent {
            disk_offset,
            length,
            data_position: None,
            checksum: 0,
            copy_of: None,
            stored_length: 0,
            seal_flags: 0,
        });
    }

    /// Fills `target` with the bytes at `disk_offset`, which the index maps to `address` of
    /// this segment (an extent appended earlier).
    pub fn read_into(
        &self,
        address: u64,
        disk_offset: u64,
        target: &mut [u8],
    ) -> Result<(), DecodeError> {
        let range = fetch_range(address, target.len() as u64);
        let fetched =
            &self.data[(range.start - HEADER_BYTES) as usize..(range.end - HEADER_BYTES) as usize];
        extract(
            &self.sealer,
            self.sequence,
            fetched,
            address,
            disk_offset,
            target,
        )
    }

    /// The whole object, with the writer's marks (`durable_through`, `checkpoint_through`:
    /// every segment up to the first, and a checkpoint up to the second, were durable when it
    /// was sealed).
    pub fn seal(&self, disk_id: u64, durable_through: u64, checkpoint_through: u64) -> Bytes {
        assert!(
            durable_through < self.sequence && checkpoint_through < self.sequence,
            "segment {} sealed with durable mark {durable_through} and checkpoint mark {checkpoint_through}",
            self.sequence
        );
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
            table.put_u64_le(extent.stored_length);
            table.put_u32_le(extent.seal_flags);
            table.put_u32_le(0);
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
        object.put_u32_le(mark_distance(self.sequence, durable_through));
        object.put_u32_le(mark_distance(self.sequence, checkpoint_through));
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
    pub marks: Marks,
    pub extents: Vec<SegmentExtent>,
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"))
}

/// Checks and decodes a segment's header (its first [`HEADER_BYTES`] bytes at least): magic,
/// header checksum, version, header length and disk id; returns its sequence and marks.
pub fn decode_header(object: &[u8], disk_id: u64) -> Result<(u32, u64, Marks), DecodeError> {
    if object.len() < HEADER_BYTES as usize {
        return Err(DecodeError::Truncated {
            found: object.len() as u64,
            needed: format!("shorter than the {HEADER_BYTES}-byte header (truncated?)"),
        });
    }
    if &object[..8] != MAGIC {
        return Err(DecodeError::BadMagic {
            what: "log segment",
            magic: "BCLOGSEG",
        });
    }
    if crc32fast::hash(&object[..60]) != u32_at(object, 60) {
        return Err(DecodeError::BadCrc {
            part: "header",
            meaning: "corrupt header",
        });
    }
    let version = u32_at(object, 8);
    if !(1..=FORMAT_VERSION).contains(&version) {
        return Err(DecodeError::UnknownVersion {
            what: "segment",
            found: version.into(),
            supported: format!("1 to {FORMAT_VERSION}"),
        });
    }
    if u64::from(u32_at(object, 12)) != HEADER_BYTES {
        return Err(DecodeError::Inconsistent(format!(
            "header length {} is not {HEADER_BYTES}",
            u32_at(object, 12)
        )));
    }
    let stored_disk = u64_at(object, 16);
    if stored_disk != disk_id {
        return Err(DecodeError::OtherDisk {
            found: stored_disk,
            expected: disk_id,
        });
    }
    let sequence = u64_at(object, 24);
    // Versions before 4 kept these bytes reserved (0: not recorded).
    let marks = Marks {
        durable_through: mark_of(sequence, u32_at(object, 52)),
        checkpoint_through: mark_of(sequence, u32_at(object, 56)),
    };
    Ok((version, sequence, marks))
}

/// Checks and decodes a whole segment object: magic, version, header and table checksums,
/// the disk id, every extent's checksum and that every extent lies inside the disk. The
/// error says what is wrong (the caller names the object).
pub fn decode(
    object: &[u8],
    disk_id: u64,
    disk_size_bytes: u64,
) -> Result<DecodedSegment, DecodeError> {
    let (version, sequence, marks) = decode_header(object, disk_id)?;
    let entry_bytes = match version {
        1 => TABLE_ENTRY_BYTES_VERSION_1,
        2 => TABLE_ENTRY_BYTES_VERSION_2,
        FORMAT_VERSION_3 | FORMAT_VERSION => TABLE_ENTRY_BYTES,
        _ => {
            return Err(DecodeError::UnknownVersion {
                what: "segment",
                found: version.into(),
                supported: format!("1 to {FORMAT_VERSION}"),
            })
        }
    };
    let data_bytes = u64_at(object, 32);
    let extent_count = u64_at(object, 40);
    let expected = extent_count
        .checked_mul(entry_bytes)
        .and_then(|table| table.checked_add(data_bytes))
        .and_then(|body| body.checked_add(HEADER_BYTES));
    if expected != Some(object.len() as u64) {
        return Err(DecodeError::Truncated {
            found: object.len() as u64,
            needed: format!("where the header promises {HEADER_BYTES} + {data_bytes} data + {extent_count} extents (truncated?)"),
        });
    }
    let data = &object[HEADER_BYTES as usize..(HEADER_BYTES + data_bytes) as usize];
    let table = &object[(HEADER_BYTES + data_bytes) as usize..];
    if crc32fast::hash(table) != u32_at(object, 48) {
        return Err(DecodeError::BadCrc {
            part: "extent table",
            meaning: "corrupt table",
        });
    }
    let table_context = TableContext {
        version,
        entry_bytes,
        sequence,
        data,
        data_bytes,
        disk_size_bytes,
    };
    let extents = table
        .chunks_exact(entry_bytes as usize)
        .enumerate()
        .map(|(number, entry)| table_context.decode_entry(number, entry))
        .collect::<Result<Vec<_>, _>>()?;
    debug_assert_eq!(extents.len() as u64, extent_count);
    Ok(DecodedSegment {
        sequence,
        marks,
        extents,
    })
}

/// What checking one extent-table entry needs of its segment.
#[derive(Clone, Copy)]
struct TableContext<'a> {
    version: u32,
    entry_bytes: u64,
    sequence: u64,
    /// The segment's data area.
    data: &'a [u8],
    data_bytes: u64,
    disk_size_bytes: u64,
}

impl TableContext<'_> {
    /// Checks and decodes extent-table entry `number`: inside the disk, known storage flags
    /// that fit its kind and sizes, a copy naming an earlier segment, data inside the data
    /// area with a matching checksum.
    fn decode_entry(&self, number: usize, entry: &[u8]) -> Result<SegmentExtent, DecodeError> {
        let TableContext {
            version,
            entry_bytes,
            sequence,
            data,
            data_bytes,
            disk_size_bytes,
        } = *self;
        let disk_offset = u64_at(entry, 0);
        let length = u64_at(entry, 8);
        let position = u64_at(entry, 16);
        let checksum = u32_at(entry, 24);
        let kind = u32_at(entry, 28);
        if disk_offset
            .checked_add(length)
            .is_none_or(|end| end > disk_size_bytes)
        {
            return Err(DecodeError::Inconsistent(format!(
                "extent {number} ({length} bytes at {disk_offset}) reaches past the end of the disk ({disk_size_bytes} bytes)"
            )));
        }
        let source = (entry_bytes >= TABLE_ENTRY_BYTES_VERSION_2).then(|| u64_at(entry, 32));
        let (stored_length, seal_flags) = if entry_bytes == TABLE_ENTRY_BYTES {
            (u64_at(entry, 40), u32_at(entry, 48))
        } else {
            (length, 0)
        };
        let flags_known = if version >= FORMAT_VERSION {
            FRAME_FLAGS | FLAG_BLOCKS
        } else {
            FRAME_FLAGS
        };
        if seal_flags & !flags_known != 0
            || (seal_flags & FLAG_BLOCKS != 0 && seal_flags != FLAG_BLOCKS)
        {
            return Err(DecodeError::Inconsistent(format!(
                "extent {number} has unknown storage flags {seal_flags:#x}"
            )));
        }
        if version >= FORMAT_VERSION && kind != KIND_ZEROES && seal_flags == 0 {
            return Err(DecodeError::Inconsistent(format!(
                "extent {number} is stored as written without block checksums, which a version {FORMAT_VERSION} segment never does"
            )));
        }
        if seal_flags == FLAG_BLOCKS
            && (stored_length != blocks::stored_bytes(length)
                || length >= CHECKED_EXTENT_BYTES_MAX
                || HEADER_BYTES + data_bytes > SEALED_SEGMENT_BYTES_MAX)
        {
            return Err(DecodeError::Inconsistent(format!(
                "extent {number} in checked blocks ({length} bytes, {stored_length} stored) does not add up, or lies past {SEALED_SEGMENT_BYTES_MAX} bytes"
            )));
        }
        if seal_flags & FRAME_FLAGS != 0
            && (length > SEALED_EXTENT_BYTES_MAX
                || stored_length > SEALED_EXTENT_BYTES_MAX + FRAME_OVERHEAD_BYTES_MAX
                || HEADER_BYTES + data_bytes > SEALED_SEGMENT_BYTES_MAX)
        {
            return Err(DecodeError::Inconsistent(format!(
                "sealed extent {number} ({length} bytes, {stored_length} stored) is larger than a sealed extent can be, or lies past {SEALED_SEGMENT_BYTES_MAX} bytes"
            )));
        }
        let copy_of = match (kind, source) {
            (KIND_COPY, Some(source)) if source > 0 && source < sequence => Some(source),
            (KIND_COPY, _) => {
                return Err(DecodeError::Inconsistent(format!(
                    "extent {number} is a copy of segment {source:?}, not of an earlier segment"
                )))
            }
            (_, Some(0) | None) => None,
            (_, Some(other)) => {
                return Err(DecodeError::Inconsistent(format!(
                    "extent {number} names source segment {other} but is no copy"
                )))
            }
        };
        let data_position = match kind {
            KIND_DATA | KIND_COPY => {
                let bytes = position
                    .checked_add(stored_length)
                    .filter(|&end| end <= data_bytes)
                    .map(|end| &data[position as usize..end as usize])
                    .ok_or_else(|| {
                        DecodeError::Inconsistent(format!(
                            "extent {number} lies outside the data area"
                        ))
                    })?;
                if crc32fast::hash(bytes) != checksum {
                    return Err(DecodeError::Inconsistent(format!(
                        "extent {number} ({length} bytes at disk offset {disk_offset}) fails its checksum (corrupt data)"
                    )));
                }
                Some(position)
            }
            KIND_ZEROES if seal_flags == 0 => None,
            KIND_ZEROES => {
                return Err(DecodeError::Inconsistent(format!(
                    "extent {number} is a zeroed range but has seal flags {seal_flags:#x}"
                )))
            }
            other => {
                return Err(DecodeError::Inconsistent(format!(
                    "extent {number} has unknown kind {other}"
                )))
            }
        };
        Ok(SegmentExtent {
            disk_offset,
            length,
            data_position,
            checksum,
            copy_of,
            stored_length: if data_position.is_some() {
                stored_length
            } else {
                0
            },
            seal_flags,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::url::Compression;

    fn read(segment: &OpenSegment, address: u64, disk_offset: u64, length: usize) -> Vec<u8> {
        let mut bytes = vec![0u8; length];
        segment.read_into(address, disk_offset, &mut bytes).unwrap();
        bytes
    }

    // Goal: laying a segment's data out in disk order keeps every extent readable at its
    // moved address and replay unchanged, and puts extents adjacent on the disk back to back
    // in the object. Method: for a plain and a compressing-and-encrypting sealer, append
    // extents at disk offsets 3, 1, 2 (× 8 KiB; 1 twice) and a zeroed range, order them, read
    // each at its moved address (also from inside), check that the data positions follow
    // disk order with no gap, and that the sealed object decodes to the table in append
    // order.
    #[test]
    fn ordering_by_disk_offset_moves_extents_and_keeps_them_readable() {
        const UNIT: u64 = 8192;
        for sealer in [
            Sealer::plain(0xabc),
            Sealer::with(0xabc, Compression::Zstd, Some([9u8; 32])),
        ] {
            let mut segment = OpenSegment::new(7, Arc::new(sealer));
            let data = |fill: u8| vec![fill; UNIT as usize];
            let mut addresses = Vec::new();
            for (disk, fill) in [(3, 30u8), (1, 10), (2, 20), (1, 11)] {
                addresses.push((
                    disk * UNIT,
                    fill,
                    segment.append_data(disk * UNIT, &data(fill)),
                ));
            }
            segment.append_zeroes(0, UNIT);
            let appended = segment.table.clone();
            let moves = segment.order_by_disk_offset();
            assert!(!moves.is_empty(), "out-of-order extents moved");
            for (disk, fill, address) in addresses {
                let moved = moves
                    .iter()
                    .find(|extent| {
                        extent.disk_offset == disk && extent.from == extent_object_offset(address)
                    })
                    .map_or(address, |extent| moved_address(address, extent.to));
                assert_eq!(read(&segment, moved, disk, UNIT as usize), data(fill));
                assert_eq!(read(&segment, moved + 100, disk + 100, 50), vec![fill; 50]);
            }
            let mut positions: Vec<(u64, u64, u64)> = segment
                .table
                .iter()
                .filter_map(|extent| {
                    Some((
                        extent.data_position?,
                        extent.stored_length,
                        extent.disk_offset,
                    ))
                })
                .collect();
            positions.sort_unstable();
            let mut next = 0;
            for &(position, stored, _) in &positions {
                assert_eq!(position, next, "the data extents tile the data area");
                next += stored;
            }
            let disks: Vec<u64> = positions.iter().map(|&(.., disk)| disk).collect();
            assert!(disks.windows(2).all(|pair| pair[0] <= pair[1]), "{disks:?}");
            let decoded = decode(&segment.seal(0xabc, 5, 2), 0xabc, 1 << 20).unwrap();
            let order = |extents: &[SegmentExtent]| {
                extents
                    .iter()
                    .map(|extent| (extent.disk_offset, extent.length))
                    .collect::<Vec<_>>()
            };
            assert_eq!(
                order(&decoded.extents),
                order(&appended),
                "append order kept"
            );
        }
    }

    // Goal: a sealed segment decodes to what was appended, with every seal setting, and any
    // flipped byte or truncation is detected. Method: for a plain, a compressing, an
    // encrypting and a compressing-and-encrypting sealer, seal a segment of data extents, a
    // copy and a zeroed range, read the extents back (also from inside: address + n), decode
    // it, then flip every byte in turn (and cut it short) and expect an error each time.
    #[test]
    fn sealed_segments_decode_and_every_flipped_byte_is_detected() {
        let key = Some([9u8; 32]);
        for sealer in [
            Sealer::plain(0xabc),
            Sealer::with(0xabc, Compression::Zstd, None),
            Sealer::with(0xabc, Compression::Lz4, None),
            Sealer::with(0xabc, Compression::Off, key),
            Sealer::with(0xabc, Compression::Zstd, key),
        ] {
            let mut segment = OpenSegment::new(7, Arc::new(sealer));
            let first = segment.append_data(4096, &[1u8; 100]);
            segment.append_zeroes(0, 8192);
            let counting: Vec<u8> = (0..50).collect();
            let second = segment.append_data(1 << 20, &counting);
            let copy = segment.append_copy(1 << 21, &[3u8; 30], 4);
            assert_eq!(read(&segment, copy, 1 << 21, 30), [3u8; 30]);
            assert_eq!(read(&segment, first, 4096, 100), [1u8; 100]);
            assert_eq!(read(&segment, second, 1 << 20, 50), counting);
            assert_eq!(
                read(&segment, second + 10, (1 << 20) + 10, 5),
                counting[10..15]
            );
            let object = segment.seal(0xabc, 5, 2);
            assert_eq!(
                object.len() as u64,
                HEADER_BYTES + segment.data.len() as u64 + 4 * TABLE_ENTRY_BYTES
            );
            let decoded = decode(&object, 0xabc, 1 << 30).unwrap();
            assert_eq!(decoded.sequence, 7);
            assert_eq!(
                decoded.marks,
                Marks {
                    durable_through: Some(5),
                    checkpoint_through: Some(2)
                }
            );
            assert_eq!(decoded.extents, segment.table);
            assert_eq!(decoded.extents[0].object_offset(), Some(first));
            assert!(decode(&object, 0xabd, 1 << 30)
                .unwrap_err()
                .to_string()
                .contains("disk"));
            assert!(decode(&object, 0xabc, 4096)
                .unwrap_err()
                .to_string()
                .contains("past the end"));
            for index in 0..object.len() {
                let mut damaged = object.to_vec();
                damaged[index] ^= 0x40;
                assert!(decode(&damaged, 0xabc, 1 << 30).is_err(), "byte {index}");
            }
            assert!(decode(&object[..object.len() - 1], 0xabc, 1 << 30)
                .unwrap_err()
                .to_string()
                .contains("truncated"));
        }
    }

    // Goal: sealed addresses survive the arithmetic the index applies and decode to their
    // fields. Method: build one, add offsets within the extent, locate each.
    #[test]
    fn sealed_addresses_carry_frame_and_offset_within() {
        let address = sealed_address(HEADER_BYTES + 12_345, 65_581);
        for within in [0, 1, 4096, 65_535] {
            assert_eq!(
                locate(address + within),
                Location::Sealed {
                    object_offset: HEADER_BYTES + 12_345,
                    stored_length: 65_581,
                    within
                }
            );
            assert_eq!(
                fetch_range(address + within, 1),
                HEADER_BYTES + 12_345..HEADER_BYTES + 12_345 + 65_581
            );
        }
        assert_eq!(fetch_range(100, 10), 100..110);
        let checked = checked_address(HEADER_BYTES + 8200);
        for within in [0, 1, 4096, 1 << 31] {
            assert_eq!(
                locate(checked + within),
                Location::Checked {
                    object_offset: HEADER_BYTES + 8200,
                    within
                }
            );
        }
        assert_eq!(
            fetch_range(checked + 5000, 4000),
            HEADER_BYTES + 8200 + 4100..HEADER_BYTES + 8200 + 3 * 4100
        );
    }
}
