//! CloudPhysics vscsi binary traces, versions 1 and 2.
//!
//! Version 1: 32-byte records `{u32 sn, u32 len, u32 nSG, u16 cmd, u16 ver, u64 lbn,
//! u64 ts_us}`. Version 2: 40-byte records `{u16 cmd, u16 ver, u32 sn, u32 len, u32 nSG,
//! u64 lbn, u64 ts_us, u64 rt}`. All little-endian, no file header. The version lives
//! in the high byte of `ver`; like libCacheSim, we detect it from the first two records
//! (version 2 layout first, since its records are larger), unless `vscsi-version` forces
//! it. `cmd` is a SCSI opcode (see [`operation_from_scsi`]); `len` is bytes; `lbn`
//! is the object id and `offset_bytes = lbn * lbn-size` (512 by default).

use std::io::{BufRead, Chain, Cursor, ErrorKind, Read};
use std::path::PathBuf;

use crate::binary::{le_u16, le_u32, le_u64, RecordSource};
use crate::error::TraceError;
use crate::operation_from_scsi;
use crate::options::{TraceOptions, VscsiVersion};
use crate::TraceRequest;

const V1_RECORD_BYTES: usize = 32;
const V2_RECORD_BYTES: usize = 40;

/// Records inspected to detect the version, as libCacheSim does.
const DETECTION_RECORDS: usize = 2;

/// The input after detection: the bytes read to detect, then the rest.
type Rewound<R> = Chain<Cursor<Vec<u8>>, R>;

/// Streaming reader of one vscsi trace.
#[derive(Debug)]
pub(crate) struct VscsiReader<R> {
    records: RecordSource<Rewound<R>>,
    version: VscsiVersion,
    lbn_size_bytes: u64,
}

/// Field positions of one record layout.
struct Layout {
    command_at: usize,
    length_at: usize,
    lbn_at: usize,
    time_at: usize,
}

const V1_LAYOUT: Layout = Layout {
    command_at: 12,
    length_at: 4,
    lbn_at: 16,
    time_at: 24,
};

const V2_LAYOUT: Layout = Layout {
    command_at: 0,
    length_at: 8,
    lbn_at: 16,
    time_at: 24,
};

impl<R: BufRead> VscsiReader<R> {
    /// Reads the first records to detect the version, then rewinds over them.
    pub fn new(mut input: R, path: PathBuf, options: &TraceOptions) -> Result<Self, TraceError> {
        let head =
            read_head(&mut input, DETECTION_RECORDS * V2_RECORD_BYTES).map_err(|source| {
                TraceError::Io {
                    path: path.clone(),
                    source,
                }
            })?;
        let version = match options.vscsi_version {
            Some(version) => version,
            None => detect_version(&head).ok_or_else(|| TraceError::Header {
                path: path.clone(),
                reason: undetected_reason(&head),
            })?,
        };
        let record_bytes = match version {
            VscsiVersion::V1 => V1_RECORD_BYTES,
            VscsiVersion::V2 => V2_RECORD_BYTES,
        };
        Ok(VscsiReader {
            records: RecordSource::new(Cursor::new(head).chain(input), path, record_bytes),
            version,
            lbn_size_bytes: options.lbn_size_bytes,
        })
    }

    fn next_request(&mut self) -> Result<Option<TraceRequest>, TraceError> {
        if !self.records.advance()? {
            return Ok(None);
        }
        let (bytes, context) = self.records.record();
        let layout = match self.version {
            VscsiVersion::V1 => &V1_LAYOUT,
            VscsiVersion::V2 => &V2_LAYOUT,
        };
        let lbn = le_u64(bytes, layout.lbn_at);
        Ok(Some(TraceRequest {
            time_us: le_u64(bytes, layout.time_at),
            operation: operation_from_scsi(le_u16(bytes, layout.command_at)),
            offset_bytes: context.scale("lbn", lbn, self.lbn_size_bytes)?,
            length_bytes: u64::from(le_u32(bytes, layout.length_at)),
            object_id: lbn,
        }))
    }
}

impl<R: BufRead> Iterator for VscsiReader<R> {
    type Item = Result<TraceRequest, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.next_request().transpose()
    }
}

/// Reads up to `limit` bytes, fewer only at end of input.
fn read_head<R: Read>(input: &mut R, limit: usize) -> std::io::Result<Vec<u8>> {
    let mut head = vec![0u8; limit];
    let mut present = 0;
    while present < limit {
        match input.read(&mut head[present..]) {
            Ok(0) => break,
            Ok(count) => present += count,
            Err(error) if error.kind() == ErrorKind::Interrupted => continue,
            Err(error) => return Err(error),
        }
    }
    head.truncate(present);
    Ok(head)
}

/// The version whose `ver` field reads as that version in every complete record of
/// `head` (at most two); an empty file counts as version 1, having no records to misread.
fn detect_version(head: &[u8]) -> Option<VscsiVersion> {
    if head.is_empty() {
        return Some(VscsiVersion::V1);
    }
    let agrees = |record_bytes: usize, version_at: usize, version: u16| {
        let records: Vec<&[u8]> = head
            .chunks_exact(record_bytes)
            .take(DETECTION_RECORDS)
            .collect();
        !records.is_empty()
            && records
                .iter()
                .all(|record| le_u16(record, version_at) >> 8 == version)
    };
    if agrees(V2_RECORD_BYTES, 2, 2) {
        Some(VscsiVersion::V2)
    } else if agrees(V1_RECORD_BYTES, 14, 1) {
        Some(VscsiVersion::V1)
    } else {
        None
    }
}

fn undetected_reason(head: &[u8]) -> String {
    if head.len() < V1_RECORD_BYTES {
        return format!(
            "{} bytes is shorter than one record ({V1_RECORD_BYTES} bytes)",
            head.len()
        );
    }
    format!(
        "record 0 has ver 0x{:04x} (version 1 layout, byte 14) and 0x{:04x} (version 2 layout, byte 2); expected high byte 1 or 2",
        le_u16(head, 14),
        le_u16(head, 2)
    )
}
