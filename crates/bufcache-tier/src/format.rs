//! The on-disk format of a local tier: superblock, two checkpoint slots, and the log.
//!
//! ```text
//! 0      superblock (4 KiB): written once when the cache is created, checked at every open
//! 4096   checkpoint slot 0 (512 bytes)
//! 4608   checkpoint slot 1 (512 bytes)
//! 8192   log: records, each a 64-byte header and its payload, padded to 512 bytes
//! ```
//!
//! Every structure carries a CRC-32 (crc32fast) over its bytes, so a torn or corrupt one is
//! detected and never trusted. All integers are little-endian. The checkpoint slots alternate
//! (generation `g` goes to slot `g % 2`), so a torn checkpoint write leaves the previous one.
//!
//! The layout is 512-byte granular, but every write to the local device covers whole pages
//! of [`LOG_PAGE_BYTES`] (the head's partial page rewritten with the bytes it already holds),
//! so the device can be opened with O_DIRECT whatever its logical sector size.

/// Version of the format this crate writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// First bytes of the superblock.
pub const SUPERBLOCK_MAGIC: [u8; 8] = *b"BCTIER\0\x01";
/// Bytes of the superblock region.
pub const SUPERBLOCK_BYTES: u64 = 4096;
/// Offsets of the two checkpoint slots.
pub const CHECKPOINT_OFFSETS: [u64; 2] = [4096, 4608];
/// Bytes of one checkpoint slot (one sector, so a sector-atomic device writes it whole).
pub const CHECKPOINT_BYTES: usize = 512;
/// Where the log begins.
pub const LOG_START: u64 = 8192;
/// Records start and end on multiples of this (the sector a torn write tears at).
pub const RECORD_ALIGNMENT_BYTES: u64 = 512;
/// Bytes of a record header.
pub const RECORD_HEADER_BYTES: usize = 64;
/// Every write to the local device starts and ends on a multiple of this (or at the log's
/// end): the alignment O_DIRECT asks of 512-byte and 4 KiB sector devices alike. Not part of
/// the format: caches of any page size read the same.
pub const LOG_PAGE_BYTES: u64 = 4096;

const _: () = assert!(LOG_START.is_multiple_of(LOG_PAGE_BYTES));
const _: () = assert!(LOG_PAGE_BYTES.is_multiple_of(RECORD_ALIGNMENT_BYTES));
const _: () = assert!(CHECKPOINT_OFFSETS[0].is_multiple_of(LOG_PAGE_BYTES));
const _: () = assert!(CHECKPOINT_OFFSETS[1] + CHECKPOINT_BYTES as u64 <= LOG_START);
const _: () = assert!(CHECKPOINT_OFFSETS[1] == CHECKPOINT_OFFSETS[0] + CHECKPOINT_BYTES as u64);
const _: () = assert!(SUPERBLOCK_BYTES.is_multiple_of(LOG_PAGE_BYTES));
/// Longest backend identity a superblock holds.
pub const IDENTITY_BYTES_MAX: usize = 2048;
/// Smallest local cache: the fixed regions and a log of 64 records of one 4 KiB block.
pub const LOCAL_BYTES_MIN: u64 = LOG_START + 64 * (4096 + RECORD_ALIGNMENT_BYTES);

const CHECKPOINT_MAGIC: u32 = 0x4243_4350; // "BCCP"
const RECORD_MAGIC: u32 = 0x4243_5243; // "BCRC"

/// What the superblock records about the cache and the backend it belongs to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Superblock {
    /// Block size of the tier's index, in bytes.
    pub block_bytes: u32,
    /// Size of the backend in bytes.
    pub backend_bytes: u64,
    /// Size of the local device when the cache was created.
    pub local_bytes: u64,
    /// First byte of the log.
    pub log_start: u64,
    /// One past the last byte of the log.
    pub log_end: u64,
    /// The backend's identity (`file:/absolute/path`, a URL without secrets).
    pub identity: String,
}

/// Why a superblock was not accepted (the caller adds the file's name).
#[derive(Debug, PartialEq, Eq)]
pub enum SuperblockProblem {
    /// No magic: not a local cache at all.
    NoMagic,
    /// The magic is there but the checksum does not match.
    Checksum,
    /// Written by another version of the format.
    Version(u32),
}

impl Superblock {
    /// The superblock region's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(SUPERBLOCK_BYTES as usize);
        bytes.extend_from_slice(&SUPERBLOCK_MAGIC);
        bytes.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        bytes.extend_from_slice(&self.block_bytes.to_le_bytes());
        bytes.extend_from_slice(&self.backend_bytes.to_le_bytes());
        bytes.extend_from_slice(&self.local_bytes.to_le_bytes());
        bytes.extend_from_slice(&self.log_start.to_le_bytes());
        bytes.extend_from_slice(&self.log_end.to_le_bytes());
        bytes.extend_from_slice(&(self.identity.len() as u32).to_le_bytes());
        bytes.extend_from_slice(self.identity.as_bytes());
        bytes.resize(SUPERBLOCK_BYTES as usize - 4, 0);
        let crc = crc32fast::hash(&bytes);
        bytes.extend_from_slice(&crc.to_le_bytes());
        bytes
    }

    /// Parses the superblock region.
    pub fn decode(bytes: &[u8]) -> Result<Superblock, SuperblockProblem> {
        if bytes.len() < SUPERBLOCK_BYTES as usize || bytes[..8] != SUPERBLOCK_MAGIC {
            return Err(SuperblockProblem::NoMagic);
        }
        let end = SUPERBLOCK_BYTES as usize - 4;
        if crc32fast::hash(&bytes[..end]) != u32_at(bytes, end) {
            return Err(SuperblockProblem::Checksum);
        }
        let version = u32_at(bytes, 8);
        if version != FORMAT_VERSION {
            return Err(SuperblockProblem::Version(version));
        }
        let identity_length = (u32_at(bytes, 48) as usize).min(IDENTITY_BYTES_MAX);
        Ok(Superblock {
            block_bytes: u32_at(bytes, 12),
            backend_bytes: u64_at(bytes, 16),
            local_bytes: u64_at(bytes, 24),
            log_start: u64_at(bytes, 32),
            log_end: u64_at(bytes, 40),
            identity: String::from_utf8_lossy(&bytes[52..52 + identity_length]).into_owned(),
        })
    }
}

/// Where replay starts and what is known to be on the remote.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Checkpoint {
    /// Increases with every checkpoint written; the valid slot with the highest wins.
    pub generation: u64,
    /// Increases at every open, so records of an earlier run never chain onto this run's.
    pub session: u64,
    /// Log offset of the oldest live record (or of the next record when the log is empty).
    pub tail_position: u64,
    /// Sequence number of the record at `tail_position`.
    pub tail_sequence: u64,
    /// CRC of the record before the tail: the chain value the tail record must name.
    pub tail_previous_crc: u32,
    /// Every epoch up to this one is on the remote, flushed.
    pub remote_epoch: u64,
}

impl Checkpoint {
    /// One slot's bytes.
    pub fn encode(&self) -> [u8; CHECKPOINT_BYTES] {
        let mut bytes = [0u8; CHECKPOINT_BYTES];
        bytes[0..4].copy_from_slice(&CHECKPOINT_MAGIC.to_le_bytes());
        bytes[4..12].copy_from_slice(&self.generation.to_le_bytes());
        bytes[12..20].copy_from_slice(&self.session.to_le_bytes());
        bytes[20..28].copy_from_slice(&self.tail_position.to_le_bytes());
        bytes[28..36].copy_from_slice(&self.tail_sequence.to_le_bytes());
        bytes[36..40].copy_from_slice(&self.tail_previous_crc.to_le_bytes());
        bytes[40..48].copy_from_slice(&self.remote_epoch.to_le_bytes());
        let crc = crc32fast::hash(&bytes[..CHECKPOINT_BYTES - 4]);
        bytes[CHECKPOINT_BYTES - 4..].copy_from_slice(&crc.to_le_bytes());
        bytes
    }

    /// Parses one slot; None when it is torn, corrupt or was never written.
    pub fn decode(bytes: &[u8]) -> Option<Checkpoint> {
        if bytes.len() < CHECKPOINT_BYTES
            || u32_at(bytes, 0) != CHECKPOINT_MAGIC
            || crc32fast::hash(&bytes[..CHECKPOINT_BYTES - 4])
                != u32_at(bytes, CHECKPOINT_BYTES - 4)
        {
            return None;
        }
        Some(Checkpoint {
            generation: u64_at(bytes, 4),
            session: u64_at(bytes, 12),
            tail_position: u64_at(bytes, 20),
            tail_sequence: u64_at(bytes, 28),
            tail_previous_crc: u32_at(bytes, 36),
            remote_epoch: u64_at(bytes, 40),
        })
    }
}

/// What a record holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordKind {
    /// Blocks written by a client, not known to be on the remote until their epoch is.
    Dirty = 1,
    /// Blocks read from the remote: a persistent read cache entry.
    Clean = 2,
    /// Blocks zeroed by a client (no payload); written back with `write_zeroes`.
    Zero = 3,
    /// Blocks discarded by a client (no payload; the remote discards to zeroes); written back
    /// with `discard`.
    Discard = 4,
    /// Drops every older record of the range: it was written straight to the remote.
    Invalidate = 5,
    /// Fills the end of the log; the next record is at the log's start.
    Wrap = 6,
}

impl RecordKind {
    fn from_byte(byte: u8) -> Option<RecordKind> {
        Some(match byte {
            1 => RecordKind::Dirty,
            2 => RecordKind::Clean,
            3 => RecordKind::Zero,
            4 => RecordKind::Discard,
            5 => RecordKind::Invalidate,
            6 => RecordKind::Wrap,
            _ => return None,
        })
    }

    /// True for records that carry block data after the header.
    pub fn has_payload(self) -> bool {
        matches!(self, RecordKind::Dirty | RecordKind::Clean)
    }

    /// True for records write-back must put on the remote.
    pub fn is_write(self) -> bool {
        matches!(
            self,
            RecordKind::Dirty | RecordKind::Zero | RecordKind::Discard
        )
    }
}

/// A record's header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordHeader {
    /// What the record holds.
    pub kind: RecordKind,
    /// Position in the chain: one more than the record before.
    pub sequence: u64,
    /// The session (open) that wrote it.
    pub session: u64,
    /// The flush epoch it belongs to.
    pub epoch: u64,
    /// Backend byte offset of the first block it covers.
    pub disk_offset: u64,
    /// Backend bytes it covers.
    pub length_bytes: u64,
    /// Payload bytes after the header (`length_bytes` for data records, else 0).
    pub payload_bytes: u32,
    /// CRC of the record before it in the chain.
    pub previous_crc: u32,
    /// Every record with a lower sequence had been fsynced when this one was written; 0 when
    /// unknown (records written before the mark existed). Replay uses it to tell damage from
    /// a crash: a record this mark covers cannot have been torn by one.
    pub durable_sequence: u64,
}

impl RecordHeader {
    /// Bytes the record takes in the log, padding included.
    pub fn total_bytes(&self) -> u64 {
        record_total_bytes(self.payload_bytes as u64)
    }

    /// The header's bytes with its CRC, computed over the header and `payload`.
    pub fn encode(&self, payload: &[&[u8]]) -> ([u8; RECORD_HEADER_BYTES], u32) {
        let mut bytes = [0u8; RECORD_HEADER_BYTES];
        bytes[0..4].copy_from_slice(&RECORD_MAGIC.to_le_bytes());
        bytes[4] = self.kind as u8;
        bytes[8..16].copy_from_slice(&self.sequence.to_le_bytes());
        bytes[16..24].copy_from_slice(&self.session.to_le_bytes());
        bytes[24..32].copy_from_slice(&self.epoch.to_le_bytes());
        bytes[32..40].copy_from_slice(&self.disk_offset.to_le_bytes());
        bytes[40..48].copy_from_slice(&self.length_bytes.to_le_bytes());
        bytes[48..52].copy_from_slice(&self.payload_bytes.to_le_bytes());
        bytes[52..56].copy_from_slice(&self.previous_crc.to_le_bytes());
        bytes[56..60].copy_from_slice(&encode_durable_lag(self.sequence, self.durable_sequence));
        let mut hasher = crc32fast::Hasher::new();
        hasher.update(&bytes[..60]);
        for part in payload {
            hasher.update(part);
        }
        let crc = hasher.finalize();
        bytes[60..64].copy_from_slice(&crc.to_le_bytes());
        (bytes, crc)
    }

    /// Parses a header; None when it is not one. Returns the CRC it claims.
    pub fn decode(bytes: &[u8]) -> Option<(RecordHeader, u32)> {
        if bytes.len() < RECORD_HEADER_BYTES || u32_at(bytes, 0) != RECORD_MAGIC {
            return None;
        }
        let header = RecordHeader {
            kind: RecordKind::from_byte(bytes[4])?,
            sequence: u64_at(bytes, 8),
            session: u64_at(bytes, 16),
            epoch: u64_at(bytes, 24),
            disk_offset: u64_at(bytes, 32),
            length_bytes: u64_at(bytes, 40),
            payload_bytes: u32_at(bytes, 48),
            previous_crc: u32_at(bytes, 52),
            durable_sequence: decode_durable_lag(u64_at(bytes, 8), u32_at(bytes, 56)),
        };
        Some((header, u32_at(bytes, 60)))
    }

    /// True when `crc` (the header's claim) matches the header bytes and `payload`.
    pub fn verify(header_bytes: &[u8], payload: &[u8], crc: u32) -> bool {
        let mut hasher = crc32fast::Hasher::new();
        hasher.update(&header_bytes[..60]);
        hasher.update(payload);
        hasher.finalize() == crc
    }
}

/// The durable mark as bytes 56..60 of a header (zero in caches written before it existed,
/// so the format version is unchanged): 0 for unknown, else `sequence - durable_sequence + 1`.
/// A distance too large for 32 bits is written as unknown (claiming nothing is safe).
fn encode_durable_lag(sequence: u64, durable_sequence: u64) -> [u8; 4] {
    let lag = match sequence.checked_sub(durable_sequence) {
        Some(distance) if durable_sequence > 0 => u32::try_from(distance + 1).unwrap_or(0),
        _ => 0,
    };
    lag.to_le_bytes()
}

fn decode_durable_lag(sequence: u64, lag: u32) -> u64 {
    if lag == 0 {
        0
    } else {
        (sequence + 1).saturating_sub(u64::from(lag))
    }
}

/// Bytes a record with `payload_bytes` of payload takes in the log.
pub fn record_total_bytes(payload_bytes: u64) -> u64 {
    (RECORD_HEADER_BYTES as u64 + payload_bytes).next_multiple_of(RECORD_ALIGNMENT_BYTES)
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().expect("four bytes"))
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("eight bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_structure_round_trips_and_a_flipped_byte_is_refused() {
        // Goal: what is written is read back as written, and any single corrupted byte is
        // detected by the checksum. Method: encode each structure, flip each byte in turn.
        let superblock = Superblock {
            block_bytes: 4096,
            backend_bytes: 1 << 30,
            local_bytes: 1 << 26,
            log_start: LOG_START,
            log_end: 1 << 26,
            identity: "file:/srv/disk.img".into(),
        };
        let bytes = superblock.encode();
        assert_eq!(Superblock::decode(&bytes), Ok(superblock));
        for at in (0..bytes.len()).step_by(97) {
            let mut bad = bytes.clone();
            bad[at] ^= 0x40;
            assert!(Superblock::decode(&bad).is_err(), "byte {at}");
        }
        let checkpoint = Checkpoint {
            generation: 7,
            session: 3,
            tail_position: 9000,
            tail_sequence: 44,
            tail_previous_crc: 0xdead_beef,
            remote_epoch: 12,
        };
        let bytes = checkpoint.encode();
        assert_eq!(Checkpoint::decode(&bytes), Some(checkpoint));
        for at in 0..bytes.len() {
            let mut bad = bytes;
            bad[at] ^= 1;
            assert_eq!(Checkpoint::decode(&bad), None, "byte {at}");
        }
        let header = RecordHeader {
            kind: RecordKind::Dirty,
            sequence: 5,
            session: 2,
            epoch: 4,
            disk_offset: 8192,
            length_bytes: 4,
            payload_bytes: 4,
            previous_crc: 99,
            durable_sequence: 3,
        };
        let payload = [1u8, 2, 3, 4];
        let (bytes, crc) = header.encode(&[&payload]);
        assert_eq!(RecordHeader::decode(&bytes), Some((header, crc)));
        assert!(RecordHeader::verify(&bytes, &payload, crc));
        for at in 0..60 {
            let mut bad = bytes;
            bad[at] ^= 1;
            let intact = RecordHeader::decode(&bad)
                .is_some_and(|(_, claimed)| RecordHeader::verify(&bad, &payload, claimed));
            assert!(!intact, "header byte {at}");
        }
        assert!(!RecordHeader::verify(&bytes, &[1, 2, 3, 5], crc));
    }
}
