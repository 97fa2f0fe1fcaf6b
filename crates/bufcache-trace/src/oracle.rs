//! libCacheSim oracleGeneral binary traces.
//!
//! 24-byte little-endian records `{u32 time, u64 obj_id, u32 obj_size, i64
//! next_access_vtime}`, no header. Time is in seconds (libCacheSim's clock) and becomes
//! microseconds; the trace carries no operation, and every request is a lookup, so it is
//! a Read. Object ids are opaque keys (often hashes): `offset_bytes` is
//! `object_id * lbn-size` when that fits, otherwise a folded, aligned pseudo-position.
//! `next_access_vtime` is oracle information for offline policies and is not returned.

use std::io::BufRead;
use std::path::PathBuf;

use crate::binary::{le_u32, le_u64, RecordSource};
use crate::error::TraceError;
use crate::fold_block_number;
use crate::options::TraceOptions;
use crate::{Operation, TraceRequest};

/// Bytes per record.
pub const RECORD_BYTES: usize = 24;

const SECOND_MICROSECONDS: u64 = 1_000_000;

/// Streaming reader of one oracleGeneral trace.
#[derive(Debug)]
pub(crate) struct OracleGeneralReader<R> {
    records: RecordSource<R>,
    lbn_size_bytes: u64,
}

impl<R: BufRead> OracleGeneralReader<R> {
    pub fn new(input: R, path: PathBuf, options: &TraceOptions) -> Self {
        OracleGeneralReader {
            records: RecordSource::new(input, path, RECORD_BYTES),
            lbn_size_bytes: options.lbn_size_bytes,
        }
    }

    fn next_request(&mut self) -> Result<Option<TraceRequest>, TraceError> {
        if !self.records.advance()? {
            return Ok(None);
        }
        let (bytes, _) = self.records.record();
        let object_id = le_u64(bytes, 4);
        let block_number = fold_block_number(object_id, self.lbn_size_bytes);
        Ok(Some(TraceRequest {
            time_us: u64::from(le_u32(bytes, 0)) * SECOND_MICROSECONDS,
            operation: Operation::Read,
            // Cannot overflow: fold_block_number keeps block_number * lbn_size in range.
            offset_bytes: block_number * self.lbn_size_bytes,
            length_bytes: u64::from(le_u32(bytes, 12)),
            object_id,
        }))
    }
}

impl<R: BufRead> Iterator for OracleGeneralReader<R> {
    type Item = Result<TraceRequest, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.next_request().transpose()
    }
}
