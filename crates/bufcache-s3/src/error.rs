//! The crate's errors: why a disk could not be opened, and why a request to the store failed,
//! with the helpers that turn the client's nested errors into one line. Both the chunk store
//! and the disk lock report through these, so neither depends on the other for them.

use crate::url::UrlError;

/// What is wrong with an object read from the store (a segment, checkpoint, epoch, snapshot,
/// clone record, chunk, lock or metadata object): the decoders' error. It never names the
/// object; [`OpenError::BadObject`], [`OpenError::BadMetadata`], [`OpenError::BadLock`] and
/// [`StoreError::BadData`] wrap it with the object's key.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Fewer bytes than the format needs; `needed` says for what.
    #[error("{found} bytes, {needed}")]
    Truncated { found: u64, needed: String },
    /// The object does not start with the format's magic.
    #[error("no {what} magic `{magic}` (not a bufcache {what})")]
    BadMagic {
        what: &'static str,
        magic: &'static str,
    },
    /// A CRC-32 does not match what it covers.
    #[error("{part} checksum mismatch ({meaning})")]
    BadCrc {
        part: &'static str,
        meaning: &'static str,
    },
    /// A 4 KiB block in checked form fails its CRC-32.
    #[error("the 4 KiB block at object offset {object_offset} (disk offset {disk_offset}) fails its checksum (corrupt data)")]
    BadBlock {
        object_offset: u64,
        disk_offset: u64,
    },
    /// The object's tag (an encrypted disk's HMAC-SHA256) does not pass.
    #[error("fails its tag: not made with the disk's key under this name (forged, renamed from another object, or damaged)")]
    BadTag,
    /// A format version this version does not read.
    #[error("{what} format version {found} is not a supported one ({supported})")]
    UnknownVersion {
        what: &'static str,
        found: u64,
        supported: String,
    },
    /// The object names another disk.
    #[error("belongs to disk {found:016x}, not this disk {expected:016x}")]
    OtherDisk { found: u64, expected: u64 },
    /// A JSON object's field is missing or not what the format allows.
    #[error("field `{field}` {problem}")]
    BadField { field: String, problem: String },
    /// Not JSON at all (metadata, lock).
    #[error("not JSON: {0}")]
    NotJson(String),
    /// A value that contradicts the format or another value of the object (an extent past
    /// the disk's end, a count that does not add up, ...): what and why.
    #[error("{0}")]
    Inconsistent(String),
}

/// Why a disk could not be opened; nothing was written when this is returned.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error(transparent)]
    Url(#[from] UrlError),
    #[error("{url}: cannot configure the S3 client: {message}")]
    Client { url: String, message: String },
    #[error("{url}: cannot start the I/O runtime: {source}")]
    Runtime { url: String, source: std::io::Error },
    #[error("{url}: {operation} failed: {}: {message}", diagnosis(.message))]
    Request {
        url: String,
        operation: String,
        message: String,
    },
    #[error("{url}: no disk here (no metadata object `{key}`); add create-size=SIZE to the URL to create one")]
    NoDisk { url: String, key: String },
    #[error("{url}: no metadata object `{key}` but {count} other object(s) under the prefix (first: `{first}`); refusing to create a disk over them")]
    PrefixNotEmpty {
        url: String,
        key: String,
        count: usize,
        first: String,
    },
    #[error("{url}: metadata object `{key}` is not a bufcache disk description: {reason}")]
    BadMetadata {
        url: String,
        key: String,
        reason: DecodeError,
    },
    #[error("{url}: metadata object `{key}` {reason}; nothing was served or changed (put back the genuine metadata object, or open with the key that wrote it)")]
    ForgedMetadata {
        url: String,
        key: String,
        reason: DecodeError,
    },
    #[error("{url}: parameter `{parameter}={given}` does not match the existing disk, which has {parameter} {stored}")]
    Mismatch {
        url: String,
        parameter: &'static str,
        given: String,
        stored: String,
    },
    #[error("{url}: {}the disk is in use by {holder} (lock object `{key}`); if that server is no longer running, add break-lock={id} to the URL", break_lock_mismatch(.asked))]
    Locked {
        url: String,
        key: String,
        holder: String,
        id: String,
        /// The `break-lock=` id given, when it did not name the current lock.
        asked: Option<String>,
    },
    #[error("{url}: the disk is in use by {holder}, which renewed its lease on the lock object `{key}` while this server watched; a server takes the disk only once that lease ({lease_ms} ms) lapses unrenewed (stop that server, or run this one with --standby to take over when it does)")]
    LeaseHeld {
        url: String,
        key: String,
        holder: String,
        lease_ms: u64,
    },
    #[error("{url}: the disk already has a standby: {holder} (it renews `{key}`); one standby per disk, so stop that one first")]
    StandbyExists {
        url: String,
        key: String,
        holder: String,
    },
    #[error("{url}: lease={lease_ms}ms is shorter than {round_trips} round trips of the lock's PUT ({round_trip_ms} ms each): the server could not renew it in time; give a longer lease=")]
    LeaseTooShort {
        url: String,
        lease_ms: u64,
        round_trip_ms: u64,
        round_trips: u64,
    },
    #[error("{url}: {}the disk is in use by {holder} (lock object `{key}`); a read-only server would serve data that server has since overwritten: stop it first, add follow=SECONDS to the URL to serve a log-layout disk as a read replica that follows that server, or add break-lock={} to serve the disk read-only anyway (the lock is left in place)", break_lock_mismatch(.asked), .id)]
    LockedReadOnly {
        url: String,
        key: String,
        /// The holder as the lock object names it (host, pid, since, id); boxed so the
        /// error stays small enough to return by value.
        holder: Box<str>,
        id: String,
        /// The `break-lock=` id given, when it did not name the current lock.
        asked: Option<String>,
    },
    #[error("{url}: no disk here (no metadata object `{key}`), and a read-only server does not create one; start it once without --read-only, with credentials that may write, to create the disk")]
    NoDiskReadOnly { url: String, key: String },
    #[error("{url}: lock object `{key}` is not a bufcache lock: {reason}; if no server uses the disk, delete that object")]
    BadLock {
        url: String,
        key: String,
        reason: DecodeError,
    },
    #[error("{url}: another server took or released lock object `{key}` while this one was taking it; start again to see who holds it")]
    LockRaced { url: String, key: String },
    #[error("{url}: object `{key}` is damaged or not this disk's: {reason}; nothing was served or changed (`bufcache disk verify` lists every damaged object)")]
    BadObject {
        url: String,
        key: String,
        reason: DecodeError,
    },
    #[error("{url}: the index (checkpoint `{checkpoint}`) names segment `{key}`, which does not exist; nothing was served or changed (`bufcache disk verify` lists every damaged object)")]
    MissingSegment {
        url: String,
        checkpoint: String,
        key: String,
    },
    #[error("{url}: objects that durable records prove were stored are missing: {}; {evidence}. Nothing was served or changed; put them back, or add recover-prefix=on to the URL to open the disk as the part of its log that is left (the writes they held are lost)", keys_named(.missing))]
    LostObjects {
        url: String,
        /// The missing objects' keys (a checkpoint's as `…/log/checkpoints/<through>-*`,
        /// its writer's epoch being unknown).
        missing: Vec<String>,
        /// Which object proves they were stored, and how.
        evidence: String,
    },
    #[error("{url}: the store does not honour create-only PUTs (`If-None-Match: *`): a second create of lock object `{key}` succeeded instead of failing with 412, so it cannot keep a second server off this disk; use a store that honours it (AWS S3, MinIO, Ceph RGW, moto), or add lock=off to the URL to serve without that protection")]
    StoreCannotLock { url: String, key: String },
    #[error("{url}: no credentials found (looked for {looked}); set them there, or add credentials=instance to the URL to ask the instance-metadata service")]
    NoCredentials { url: String, looked: String },
    #[error("{url}: configuration: {reason}")]
    Config { url: String, reason: String },
    #[error(
        "{url}: parameter `create-size={size}` is not a multiple of the chunk size {chunk_size}"
    )]
    SizeNotChunkMultiple {
        url: String,
        size: u64,
        chunk_size: u64,
    },
}

fn keys_named(keys: &[String]) -> String {
    keys.iter()
        .map(|key| format!("`{key}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Whether a failed request's message says its bucket does not exist.
pub(crate) fn says_no_bucket(message: &str) -> bool {
    ["NoSuchBucket", "bucket does not exist"]
        .iter()
        .any(|word| message.contains(word))
}

/// What a failed request's message says went wrong, in the user's terms, and what to check:
/// the store's error code when it answered, the transport's failure when it did not.
pub(crate) fn diagnosis(message: &str) -> &'static str {
    let says = |words: &[&str]| words.iter().any(|word| message.contains(word));
    if says_no_bucket(message) {
        "the bucket does not exist (check the bucket name and endpoint=, or create it)"
    } else if says(&[
        "AuthorizationHeaderMalformed",
        "PermanentRedirect",
        "IllegalLocationConstraintException",
        "wrong region",
        "region is wrong",
    ]) {
        "wrong region (set region= to the bucket's region)"
    } else if says(&[
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "AccessDenied",
        "InvalidToken",
        "ExpiredToken",
        "403 Forbidden",
        "Forbidden",
    ]) {
        "the store refused the credentials (check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or the credentials file's profile, and what they may do)"
    } else if says(&[
        "Connection refused",
        "connection refused",
        "dns error",
        "tcp connect error",
        "error trying to connect",
        "timed out",
        "Timeout",
        "error sending request",
    ]) {
        "the endpoint did not answer (check endpoint= and that the store is running)"
    } else {
        "the store's answer follows"
    }
}

fn break_lock_mismatch(asked: &Option<String>) -> String {
    match asked {
        Some(asked) => format!("`break-lock={asked}` does not name the current lock: "),
        None => String::new(),
    }
}

/// A request to the store failed (after the client's retries).
#[derive(Clone, Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{operation} of `{key}` failed: {message}")]
    Request {
        operation: &'static str,
        key: String,
        message: String,
    },
    #[error("request of {length} bytes at offset {offset} reaches past the end of the disk ({size} bytes)")]
    OutOfRange { offset: u64, length: u64, size: u64 },
    #[error("{url}: {error}")]
    Lease {
        url: String,
        error: crate::lease::LeaseError,
    },
    #[error("{url} is open read-only ({reason}): writes are refused")]
    ReadOnly { url: String, reason: String },
    #[error(
        "segment `{key}` named by the index does not exist (deleted behind this server's back?)"
    )]
    MissingSegment { key: String },
    #[error("object `{key}` is damaged or not this disk's: {reason}; nothing was served from it")]
    BadData {
        key: String,
        /// Boxed so the error stays small enough to return by value.
        reason: Box<DecodeError>,
    },
    #[error("object `{key}` holds {found} bytes where {expected} were asked for")]
    ShortObject {
        key: String,
        found: usize,
        expected: usize,
    },
}

impl From<StoreError> for std::io::Error {
    fn from(error: StoreError) -> Self {
        let kind = match error {
            StoreError::OutOfRange { .. } => std::io::ErrorKind::InvalidInput,
            StoreError::ReadOnly { .. } => std::io::ErrorKind::PermissionDenied,
            _ => std::io::ErrorKind::Other,
        };
        std::io::Error::new(kind, error)
    }
}

/// An error and its sources on one line (object_store nests the server's answer).
pub(crate) fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(inner) = source {
        let inner_text = inner.to_string();
        if !text.contains(&inner_text) {
            text.push_str(": ");
            text.push_str(&inner_text);
        }
        source = inner.source();
    }
    text
}

pub(crate) fn request_failed(
    operation: &'static str,
    key: &str,
    error: object_store::Error,
) -> StoreError {
    StoreError::Request {
        operation,
        key: key.to_string(),
        message: chain(&error),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: each common way to point at the wrong place gets its own plain cause. Method:
    // the answers AWS S3 and the HTTP client give for each (their codes as documented).
    #[test]
    fn a_failed_request_is_diagnosed_from_the_stores_answer() {
        for (message, cause) in [
            ("Generic S3 error: Error performing GET … 404 Not Found: <Code>NoSuchBucket</Code>", "bucket does not exist"),
            ("Client error with status 400 Bad Request: <Code>AuthorizationHeaderMalformed</Code><Message>the region 'us-east-1' is wrong; expecting 'eu-west-1'</Message>", "wrong region"),
            ("Client error with status 301 Moved Permanently: <Code>PermanentRedirect</Code>", "wrong region"),
            ("Client error with status 403 Forbidden: <Code>InvalidAccessKeyId</Code>", "refused the credentials"),
            ("Client error with status 403 Forbidden: <Code>SignatureDoesNotMatch</Code>", "refused the credentials"),
            ("HTTP error: error sending request: client error (Connect): tcp connect error: Connection refused (os error 111)", "did not answer"),
        ] {
            assert!(diagnosis(message).contains(cause), "{message}: {}", diagnosis(message));
        }
    }
}
