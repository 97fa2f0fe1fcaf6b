//! `CacheError`: everything the engine's operations can fail with.
//!
//! Device errors carry the device's name, the operation and the byte range, so a message read
//! by a person says which disk failed doing what. Errors convert into `std::io::Error` with a
//! matching kind for protocol layers (the NBD server maps kinds to errno values).

use std::io;
use std::time::Duration;

use crate::config::ConfigError;

/// An engine operation failed.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A device request failed.
    #[error("{device}: {operation} of {length_bytes} bytes at offset {offset} failed: {source}")]
    Device {
        /// The device's description.
        device: String,
        /// read, write, flush, discard or write_zeroes.
        operation: &'static str,
        /// Device byte offset.
        offset: u64,
        /// Bytes in the request.
        length_bytes: u64,
        /// The device's error.
        source: io::Error,
    },
    /// Write-back of this object's dirty data failed earlier; the data is still dirty and
    /// will be retried. Reported once to each flusher (errseq).
    #[error("write-back to {device} failed earlier: {message}")]
    WritebackFailed {
        /// The device's description.
        device: String,
        /// Kind of the original error.
        kind: io::ErrorKind,
        /// The original error's message.
        message: String,
    },
    /// No buffer could be made available: everything is pinned or dirty and cannot be
    /// written.
    #[error("no buffer space: every buffer is pinned or dirty and could not be written back (waited {waited:?})")]
    NoSpace {
        /// How long the allocation waited.
        waited: Duration,
    },
    /// A byte range reaches outside the object.
    #[error("{object}: range of {length_bytes} bytes at offset {offset} reaches past the end ({object_length_bytes} bytes)")]
    OutOfRange {
        /// The object's name.
        object: String,
        /// Start of the range.
        offset: u64,
        /// Length of the range.
        length_bytes: u64,
        /// The object's length.
        object_length_bytes: u64,
    },
    /// A fast zero was asked for, but zeroing this range would write zero bytes to the
    /// device (it cannot deallocate, or deallocation was not allowed).
    #[error("{object}: zeroing would write data (no fast zero)")]
    ZeroingWouldWrite {
        /// The object's name.
        object: String,
    },
    /// The data of a write could not be read from its source (an NBD client's socket); the
    /// write is torn (see `ObjectHandle::write_from`).
    #[error("the data of a write could not be read: {source}")]
    DataSource {
        /// What the source reported.
        source: io::Error,
    },
    /// The receiver of a read's bytes failed ([`crate::ObjectHandle::read_with`]); the
    /// cache is unchanged.
    #[error("the data of a read could not be delivered: {source}")]
    DataSink {
        /// What the receiver reported.
        source: io::Error,
    },
    /// The object was opened read-only.
    #[error("{object} is read-only")]
    ReadOnly {
        /// The object's name.
        object: String,
    },
    /// An object's configuration does not fit the cache or its device.
    #[error("object {object}: {reason}")]
    InvalidObject {
        /// The object's name.
        object: String,
        /// What is wrong.
        reason: String,
    },
    /// A read [`crate::ObjectHandle::start_read`] attached to blocks being filled found a
    /// block evicted or taken by a writer when it looked again; nothing failed, and the
    /// caller serves the read the usual way.
    #[error("a started read was given back to be served the usual way")]
    ReadGivenBack,
}

impl CacheError {
    /// The `io::ErrorKind` that best describes this error.
    pub fn kind(&self) -> io::ErrorKind {
        match self {
            CacheError::Config(_) | CacheError::InvalidObject { .. } => io::ErrorKind::InvalidInput,
            CacheError::Device { source, .. } => source.kind(),
            CacheError::WritebackFailed { kind, .. } => *kind,
            CacheError::NoSpace { .. } => io::ErrorKind::OutOfMemory,
            CacheError::OutOfRange { .. } => io::ErrorKind::InvalidInput,
            CacheError::ReadOnly { .. } => io::ErrorKind::PermissionDenied,
            CacheError::ZeroingWouldWrite { .. } => io::ErrorKind::Unsupported,
            CacheError::ReadGivenBack => io::ErrorKind::WouldBlock,
            CacheError::DataSource { source } | CacheError::DataSink { source } => source.kind(),
        }
    }
}

impl From<CacheError> for io::Error {
    fn from(error: CacheError) -> io::Error {
        let kind = match error.kind() {
            // A device's own "invalid input" is an I/O failure for the caller of the cache.
            io::ErrorKind::InvalidInput if matches!(error, CacheError::Device { .. }) => {
                io::ErrorKind::Other
            }
            kind => kind,
        };
        io::Error::new(kind, error.to_string())
    }
}
