#![deny(missing_docs)]
//! Streaming readers for block I/O traces, all producing one record type.
//!
//! This crate owns the translation from trace files (libCacheSim-style CSV, blkparse
//! text, MSR Cambridge CSV, fio iolog v2/v3, libCacheSim oracleGeneral binary,
//! CloudPhysics vscsi v1/v2) to [`TraceRequest`]s. Invariants every reader keeps:
//! it streams with constant memory (one line or one record buffered), it never panics on
//! any input, and every bad input becomes a [`TraceError`] naming the file, the line
//! (text) or record index and byte offset (binary), the field and the value.
//!
//! After a parse error in one line or record, iteration continues with the next one,
//! so a caller may skip bad lines; after an I/O error or a truncated binary record the
//! stream ends.
//!
//! ```
//! use bufcache_trace::{parse_all, TraceFormat, TraceOptions};
//! let options = TraceOptions::parse("time-col=1,obj-id-col=2,obj-size-col=3,op-col=4").unwrap();
//! let count = parse_all(b"1,10,512,r\n2,11,4096,w\n", TraceFormat::Csv, &options).unwrap();
//! assert_eq!(count, 2);
//! ```

mod binary;
mod blkparse;
mod csv;
mod error;
mod fio;
mod format;
mod msr;
mod options;
mod oracle;
mod reader;
mod text;
mod vscsi;

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

pub use error::{TraceError, VALUE_LENGTH_MAX};
pub use format::TraceFormat;
pub use options::{BlkparseAction, TimeUnit, TraceOptions, VscsiVersion};
pub use reader::TraceReader;
pub use text::LINE_LENGTH_MAX;

/// What a request does to the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Operation {
    /// Reads data.
    Read,
    /// Writes data.
    Write,
    /// Anything else the trace records: flush, sync, trim, unknown commands.
    Other,
}

/// One request of a trace, in the units every reader agrees on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TraceRequest {
    /// When the request was issued, in microseconds on the trace's own clock.
    pub time_us: u64,
    /// What the request does.
    pub operation: Operation,
    /// First byte the request touches.
    pub offset_bytes: u64,
    /// Bytes the request touches; 0 for data-less requests and unit-size objects.
    pub length_bytes: u64,
    /// The key as the trace gives it (block number, sector, byte offset or object id).
    pub object_id: u64,
}

/// A boxed stream of requests, as returned by [`open_trace`].
pub type TraceStream = Box<dyn Iterator<Item = Result<TraceRequest, TraceError>> + Send>;

/// Opens `path` as a trace of `format`, buffered, streaming one request at a time.
pub fn open_trace(
    path: impl AsRef<Path>,
    format: TraceFormat,
    options: &TraceOptions,
) -> Result<TraceStream, TraceError> {
    let path = path.as_ref();
    let file = File::open(path).map_err(|source| TraceError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let reader = TraceReader::new(
        BufReader::with_capacity(1 << 16, file),
        path,
        format,
        options,
    )?;
    Ok(Box::new(reader))
}

/// Parses a whole in-memory trace, returning the number of requests or the first error.
///
/// The entry point for fuzz targets: it exercises exactly the code `open_trace` runs.
pub fn parse_all(
    bytes: &[u8],
    format: TraceFormat,
    options: &TraceOptions,
) -> Result<usize, TraceError> {
    let reader = TraceReader::new(bytes, PathBuf::from("<memory>"), format, options)?;
    let mut count = 0;
    for request in reader {
        request?;
        count += 1;
    }
    Ok(count)
}

/// Maps the operation spellings block traces use to an [`Operation`].
///
/// Accepts words (`r`, `read`, `w`, `write`, any case) and SCSI opcodes in hex with or
/// without `0x` (READ(6/10/12/16) = 08/28/a8/88, WRITE = 0a/2a/aa/8a), because
/// CloudPhysics' CSV export writes the opcode as bare hex (`28`, `2a`).
pub fn operation_from_text(text: &str) -> Operation {
    let text = text.trim();
    let code = text
        .strip_prefix("0x")
        .or_else(|| text.strip_prefix("0X"))
        .unwrap_or(text);
    if code.eq_ignore_ascii_case("r") || code.eq_ignore_ascii_case("read") {
        return Operation::Read;
    }
    if code.eq_ignore_ascii_case("w") || code.eq_ignore_ascii_case("write") {
        return Operation::Write;
    }
    match u16::from_str_radix(code, 16) {
        Ok(opcode) if code.len() <= 4 => operation_from_scsi(opcode),
        _ => Operation::Other,
    }
}

/// Maps a SCSI command opcode to an [`Operation`].
pub fn operation_from_scsi(opcode: u16) -> Operation {
    match opcode {
        0x08 | 0x28 | 0xA8 | 0x88 => Operation::Read,
        0x0A | 0x2A | 0xAA | 0x8A => Operation::Write,
        _ => Operation::Other,
    }
}

/// Folds an opaque 64-bit key into a block number whose byte offset fits in 64 bits.
///
/// Keys that already fit map to themselves, so block traces keep their positions;
/// hashed keys (oracleGeneral, string ids) get a stable, aligned pseudo-position.
pub(crate) fn fold_block_number(key: u64, unit_bytes: u64) -> u64 {
    let block_count = u64::MAX / unit_bytes.max(1);
    if key < block_count {
        key
    } else {
        key % block_count
    }
}
