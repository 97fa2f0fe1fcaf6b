//! The one error type every reader returns.
//!
//! Every variant names where the problem is (the source path, and either a
//! 1-based line number for text formats or a 0-based record index plus byte
//! offset for binary formats) and what was wrong (which field, what value).
//! Offending values are truncated to [`VALUE_LENGTH_MAX`] characters so that a
//! garbage line of megabytes cannot produce a megabyte error message.

use std::path::PathBuf;

/// Longest excerpt of an offending value kept in an error, in characters.
pub const VALUE_LENGTH_MAX: usize = 64;

/// What went wrong while opening or reading a trace.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be opened or read.
    #[error("{path}: {source}")]
    Io {
        /// The trace file.
        path: PathBuf,
        /// What the operating system reported.
        #[source]
        source: std::io::Error,
    },

    /// A format name that `TraceFormat::from_str` does not know.
    #[error("unknown trace format {name:?} (expected one of: {expected})")]
    UnknownFormat {
        /// The name given.
        name: String,
        /// The names accepted.
        expected: &'static str,
    },

    /// `TraceFormat::guess` could not tell the format from the name or content.
    #[error("{path}: cannot guess the trace format: {reason}")]
    FormatNotGuessed {
        /// The trace file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },

    /// An option key that `TraceOptions::parse` does not know.
    #[error("unknown trace option {key:?} (known: {known})")]
    UnknownOption {
        /// The option key.
        key: String,
        /// The keys accepted.
        known: &'static str,
    },

    /// A known option key with a value it cannot take.
    #[error("trace option {key}={value:?}: {reason}")]
    InvalidOption {
        /// The option key.
        key: &'static str,
        /// The offending value (shortened).
        value: String,
        /// What is wrong.
        reason: String,
    },

    /// The options do not fit the chosen format (for example CSV without `obj-id-col`).
    #[error("{path}: {format} trace: {reason}")]
    MissingOption {
        /// The trace file.
        path: PathBuf,
        /// The trace format.
        format: &'static str,
        /// What is wrong.
        reason: &'static str,
    },

    /// The file's header (first line, or first records) is not what the format requires.
    #[error("{path}: bad header: {reason}")]
    Header {
        /// The trace file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },

    /// A text line that does not parse.
    #[error("{path}:{line_number}: field {field} = {value:?}: {reason}")]
    Line {
        /// The trace file.
        path: PathBuf,
        /// 1-based line number.
        line_number: u64,
        /// The field that is wrong.
        field: &'static str,
        /// The offending value (shortened).
        value: String,
        /// What is wrong.
        reason: String,
    },

    /// A binary record with a field that cannot be turned into a request.
    #[error(
        "{path}: record {record_index} at byte {offset_bytes}: field {field} = {value}: {reason}"
    )]
    Record {
        /// The trace file.
        path: PathBuf,
        /// 0-based index of the record.
        record_index: u64,
        /// Byte offset of the record in the file.
        offset_bytes: u64,
        /// The field that is wrong.
        field: &'static str,
        /// The offending value (shortened).
        value: String,
        /// What is wrong.
        reason: String,
    },

    /// The file ends inside a binary record.
    #[error("{path}: record {record_index} at byte {offset_bytes} is truncated: {present_bytes} of {record_bytes} bytes present")]
    TruncatedRecord {
        /// The trace file.
        path: PathBuf,
        /// 0-based index of the record.
        record_index: u64,
        /// Byte offset of the record in the file.
        offset_bytes: u64,
        /// Bytes of the record present.
        present_bytes: usize,
        /// Bytes a whole record has.
        record_bytes: usize,
    },
}

/// Shortens `value` for display in an error, keeping at most [`VALUE_LENGTH_MAX`] characters,
/// each a printable ASCII character: anything else (control bytes, the replacement characters
/// of a binary file read as text) shows as `.`, so an error never prints raw bytes to a
/// terminal.
pub(crate) fn excerpt(value: &str) -> String {
    let printable = |c: char| {
        if c == ' ' || c.is_ascii_graphic() {
            c
        } else {
            '.'
        }
    };
    let mut text: String = value
        .chars()
        .take(VALUE_LENGTH_MAX)
        .map(printable)
        .collect();
    if value.chars().nth(VALUE_LENGTH_MAX).is_some() {
        text.push_str("...");
    }
    text
}
