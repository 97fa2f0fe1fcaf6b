//! Fixed-size record input for the binary formats, and little-endian field decoding.
//!
//! [`RecordSource`] reads one record at a time into a fixed buffer (constant memory).
//! Record indexes are 0-based; a record's byte offset is `header_bytes + index *
//! record_bytes`. A file that ends inside a record yields one
//! [`TraceError::TruncatedRecord`] and then nothing: the bytes after a short record
//! cannot be framed.

use std::io::{BufRead, ErrorKind};
use std::path::{Path, PathBuf};

use crate::error::TraceError;

/// Largest record any binary format here uses, in bytes (vscsi version 2).
pub const RECORD_BYTES_MAX: usize = 40;

/// A buffered reader handing out one fixed-size record at a time.
#[derive(Debug)]
pub(crate) struct RecordSource<R> {
    input: R,
    path: PathBuf,
    record_bytes: usize,
    buffer: [u8; RECORD_BYTES_MAX],
    /// Index of the record in `buffer`, or of the next one before the first advance.
    record_index: u64,
    started: bool,
    finished: bool,
}

/// Where a record came from: everything an error about it needs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RecordContext<'a> {
    pub path: &'a Path,
    pub record_index: u64,
    pub offset_bytes: u64,
}

impl<R: BufRead> RecordSource<R> {
    /// `record_bytes` must be at most [`RECORD_BYTES_MAX`]; the callers use constants.
    pub fn new(input: R, path: PathBuf, record_bytes: usize) -> Self {
        debug_assert!(record_bytes <= RECORD_BYTES_MAX);
        RecordSource {
            input,
            path,
            record_bytes: record_bytes.min(RECORD_BYTES_MAX),
            buffer: [0; RECORD_BYTES_MAX],
            record_index: 0,
            started: false,
            finished: false,
        }
    }

    /// Reads the next record; `Ok(false)` at a clean end of input.
    pub fn advance(&mut self) -> Result<bool, TraceError> {
        if self.finished {
            return Ok(false);
        }
        if self.started {
            self.record_index += 1;
        }
        self.started = true;
        let present_bytes = match self.fill() {
            Ok(present_bytes) => present_bytes,
            Err(source) => {
                self.finished = true;
                return Err(TraceError::Io {
                    path: self.path.clone(),
                    source,
                });
            }
        };
        if present_bytes == self.record_bytes {
            return Ok(true);
        }
        self.finished = true;
        if present_bytes == 0 {
            return Ok(false);
        }
        Err(TraceError::TruncatedRecord {
            path: self.path.clone(),
            record_index: self.record_index,
            offset_bytes: self.context().offset_bytes,
            present_bytes,
            record_bytes: self.record_bytes,
        })
    }

    /// Reads up to one record's bytes, returning how many arrived before end of input.
    fn fill(&mut self) -> std::io::Result<usize> {
        let mut present_bytes = 0;
        while present_bytes < self.record_bytes {
            match self
                .input
                .read(&mut self.buffer[present_bytes..self.record_bytes])
            {
                Ok(0) => break,
                Ok(count) => present_bytes += count,
                Err(error) if error.kind() == ErrorKind::Interrupted => continue,
                Err(error) => return Err(error),
            }
        }
        Ok(present_bytes)
    }

    fn context(&self) -> RecordContext<'_> {
        RecordContext {
            path: &self.path,
            record_index: self.record_index,
            offset_bytes: self.record_index * self.record_bytes as u64,
        }
    }

    /// The current record's bytes and context.
    pub fn record(&self) -> (&[u8], RecordContext<'_>) {
        (&self.buffer[..self.record_bytes], self.context())
    }
}

impl RecordContext<'_> {
    /// An error about `field` of this record.
    pub fn error(&self, field: &'static str, value: String, reason: &str) -> TraceError {
        TraceError::Record {
            path: self.path.to_path_buf(),
            record_index: self.record_index,
            offset_bytes: self.offset_bytes,
            field,
            value,
            reason: reason.to_owned(),
        }
    }

    /// `value * unit_bytes`, or an error naming `field` when it does not fit in 64 bits.
    pub fn scale(
        &self,
        field: &'static str,
        value: u64,
        unit_bytes: u64,
    ) -> Result<u64, TraceError> {
        value.checked_mul(unit_bytes).ok_or_else(|| {
            self.error(
                field,
                value.to_string(),
                &format!("times {unit_bytes} bytes overflows 64 bits"),
            )
        })
    }
}

/// Copies `N` bytes starting at `at`; the callers' offsets are constants inside the record.
fn array<const N: usize>(bytes: &[u8], at: usize) -> [u8; N] {
    let mut array = [0u8; N];
    array.copy_from_slice(&bytes[at..at + N]);
    array
}

pub(crate) fn le_u16(bytes: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(array(bytes, at))
}

pub(crate) fn le_u32(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(array(bytes, at))
}

pub(crate) fn le_u64(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(array(bytes, at))
}
