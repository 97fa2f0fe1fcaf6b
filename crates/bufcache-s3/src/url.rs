//! Parsing of `s3://BUCKET/PREFIX?key=value&...` backend strings.

use std::fmt;

/// Chunk size used when the URL names none (chosen by measurement: docs/s3.md).
/// Name of the metadata object under the prefix.
pub const METADATA_NAME: &str = "bufcache-disk.json";
pub const CHUNK_SIZE_DEFAULT_BYTES: u64 = 1 << 20;
/// Smallest accepted chunk size: below it the per-request cost dominates every workload.
pub const CHUNK_SIZE_MIN_BYTES: u64 = 4 << 10;
/// Largest accepted chunk size: S3 allows one PUT up to 5 GiB, but a read-modify-write of
/// a partial chunk moves the whole chunk, so keep it modest.
pub const CHUNK_SIZE_MAX_BYTES: u64 = 64 << 20;
/// Smallest accepted `segment-size=` (log layout): below it every segment is mostly header
/// and request overhead.
pub const SEGMENT_SIZE_MIN_BYTES: u64 = 64 << 10;
/// Largest accepted `segment-size=`: the open segment and each one in flight is held in memory.
pub const SEGMENT_SIZE_MAX_BYTES: u64 = 1 << 30;

/// How a disk's bytes are laid out in objects, recorded in its metadata object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayoutKind {
    /// Fixed-size chunk objects, rewritten in place (`chunks/…`).
    Chunk,
    /// Immutable segments appended per write-back, an index and its checkpoints (`log/…`).
    Log,
}

impl LayoutKind {
    /// The name used in URLs and in the metadata object.
    pub fn name(self) -> &'static str {
        match self {
            LayoutKind::Chunk => "chunk",
            LayoutKind::Log => "log",
        }
    }

    /// The layout of `name`, as written by [`LayoutKind::name`].
    pub fn parse(name: &str) -> Option<LayoutKind> {
        match name {
            "chunk" => Some(LayoutKind::Chunk),
            "log" => Some(LayoutKind::Log),
            _ => None,
        }
    }
}

/// How the log layout compresses each extent, recorded in the disk's metadata object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    /// Extents are stored as written.
    Off,
    /// Each extent is compressed with zstd (kept only when that makes it smaller).
    Zstd,
    /// Each extent is compressed with LZ4 (its block format, crate `lz4_flex`): less
    /// compression than zstd at a fraction of its CPU (kept only when it makes it smaller).
    Lz4,
}

impl Compression {
    /// The name used in URLs and in the metadata object.
    pub fn name(self) -> &'static str {
        match self {
            Compression::Off => "off",
            Compression::Zstd => "zstd",
            Compression::Lz4 => "lz4",
        }
    }

    /// The compression of `name`, as written by [`Compression::name`].
    pub fn parse(name: &str) -> Option<Compression> {
        match name {
            "off" => Some(Compression::Off),
            "zstd" => Some(Compression::Zstd),
            "lz4" => Some(Compression::Lz4),
            _ => None,
        }
    }
}

/// Layout of a disk a server creates without `layout=`: the log layout, where every write
/// costs its own bytes once (docs/s3.md, "Log layout"). An existing disk keeps the layout
/// its metadata object records; [`crate::ChunkStore::open`] creates chunk disks.
pub const LAYOUT_DEFAULT: LayoutKind = LayoutKind::Log;

/// What is wrong with a backend URL; every variant names the offending part.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum UrlError {
    #[error("`{0}` is not an s3:// URL; expected s3://BUCKET/PREFIX?endpoint=...")]
    Scheme(String),
    #[error("`{0}`: missing bucket name; expected s3://BUCKET/PREFIX")]
    MissingBucket(String),
    #[error("`{url}`: bucket `{bucket}`: {reason}; expected s3://BUCKET/PREFIX")]
    Bucket {
        url: String,
        bucket: String,
        reason: String,
    },
    #[error("`{url}`: unknown parameter `{name}`; known: endpoint, region, path-style, layout, chunk-size, segment-size, gc, gc-threshold, key-file, compress, create-size, retry-timeout-ms, break-lock, lock, lease, follow, recover-prefix, credentials, snapshot")]
    UnknownParameter { url: String, name: String },
    #[error("`{url}`: parameter `{name}` given twice")]
    DuplicateParameter { url: String, name: String },
    #[error("`{url}`: parameter `{name}={value}`: {reason}")]
    BadValue {
        url: String,
        name: String,
        value: String,
        reason: String,
    },
}

/// A parsed object-store disk URL.
#[derive(Clone, PartialEq, Eq)]
pub struct S3Url {
    /// The bucket holding the disk.
    pub bucket: String,
    /// Key prefix of the disk's objects, without leading or trailing `/` (may be empty).
    pub prefix: String,
    /// Endpoint URL for non-AWS stores (`http://127.0.0.1:9000`); None means AWS.
    pub endpoint: Option<String>,
    /// Region; None means the environment's (`AWS_REGION`/`AWS_DEFAULT_REGION`) or us-east-1.
    pub region: Option<String>,
    /// Path-style addressing (`http://host/bucket/key`); None means: true when an endpoint is
    /// given (MinIO, Ceph RGW, moto), false for AWS.
    pub path_style: Option<bool>,
    /// `layout=chunk|log` when given: the layout of a new disk; an existing disk must have it.
    pub layout: Option<LayoutKind>,
    /// Chunk size when given.
    pub chunk_size_bytes: Option<u64>,
    /// `segment-size=SIZE` (log layout): the most bytes one segment object holds; None means
    /// `SEGMENT_BYTES_MAX_DEFAULT` (the log module's). Not fixed at creation: each segment describes
    /// itself.
    pub segment_bytes_max: Option<u64>,
    /// `gc=on|off` (log layout): whether garbage collection runs; None means on.
    pub gc: Option<bool>,
    /// `gc-threshold=FRACTION` (log layout): segments whose live fraction is below it are
    /// rewritten, in parts per million (the URL gives a fraction such as 0.5); None means the
    /// log module's `GC_THRESHOLD_DEFAULT`.
    pub gc_threshold_ppm: Option<u32>,
    /// `key-file=PATH` (log layout): a file holding the disk's 32-byte key (raw, or 64 hex
    /// digits): a new disk is created encrypted; an encrypted disk needs it to open.
    pub key_file: Option<std::path::PathBuf>,
    /// `compress=zstd|lz4|off` (log layout): the compression of a new disk; an existing disk
    /// must have the one given. None means off for a new disk, the recorded one otherwise.
    pub compression: Option<Compression>,
    /// Size of a new disk; when the disk exists it must match.
    pub create_size_bytes: Option<u64>,
    /// How long one request is retried (with exponential backoff) before its error is
    /// reported.
    pub retry_timeout_ms: u64,
    /// `break-lock=ID`: take over the disk from the (stale) lock with this id, as named by
    /// the error that refused to start because the disk was in use.
    pub break_lock: Option<String>,
    /// `lock=on|off`: whether opening checks that the store refuses a second create-only PUT
    /// of the lock object (without which the lock keeps nobody out) and refuses the store if
    /// not. Off serves such a store anyway, unprotected against a second server.
    pub lock_check: bool,
    /// `recover-prefix=on|off` (log layout): open a disk whose durable records prove objects
    /// missing (a lost checkpoint, a lost segment before later ones) anyway, as the prefix of
    /// its log that is left, deleting what that prefix does not reach. Off (the default)
    /// refuses such an open, naming the objects, and changes nothing.
    pub recover_prefix: bool,
    /// `credentials=instance`: with no key in the environment or the credentials file, ask
    /// the instance-metadata service even though `endpoint=` names a store other than AWS.
    /// Without it, such a disk with no credentials is refused naming where they were looked
    /// for (no request leaves for the metadata address).
    pub credentials_instance: bool,
    /// `snapshot=NAME` (log layout): open the disk's snapshot `NAME` instead of the disk,
    /// read-only (a writable open is refused).
    pub snapshot: Option<String>,
    /// `lease=SECONDS`: how long a writable server may acknowledge writes after its last
    /// successful renewal of the disk lock, and how long a server that wants the disk waits
    /// for a lock nobody renews before it takes it (module `lease`), in milliseconds.
    /// `lease=off` (None): the lock has no lease, is never renewed, and is taken only with
    /// `break-lock=` (the behaviour before leases).
    pub lease_ms: Option<u64>,
    /// `follow=SECONDS` (log layout, read-only): serve the disk as a read replica that never
    /// takes the lock and refreshes its view of the log this often (module `replica`), in
    /// milliseconds; None: a read-only open that another server's lock refuses.
    pub follow_ms: Option<u64>,
    /// Set by `serve --standby`, not by the URL: a writable open that finds the disk held
    /// waits (registered as the disk's one standby) until the holder's lease lapses, then
    /// takes it over (docs/s3.md, "Standby").
    pub standby: bool,
}

/// The longest snapshot name, in bytes.
pub const SNAPSHOT_NAME_BYTES_MAX: usize = 100;

/// What is wrong with a snapshot name, or None: empty, longer than
/// [`SNAPSHOT_NAME_BYTES_MAX`], holding `/` or a control byte, starting with `.`, or holding
/// anything but letters, digits and `-_.:+@` (a name is an object key's last part).
pub fn snapshot_name_problem(name: &str) -> Option<String> {
    if name.is_empty() {
        return Some("empty".to_string());
    }
    if name.len() > SNAPSHOT_NAME_BYTES_MAX {
        return Some(format!(
            "{} bytes, longer than {SNAPSHOT_NAME_BYTES_MAX}",
            name.len()
        ));
    }
    if name.contains('/') {
        return Some("holds `/` (a name is one path part)".to_string());
    }
    if name.chars().any(char::is_control) {
        return Some("holds a control byte".to_string());
    }
    if name.starts_with('.') {
        return Some("starts with `.`".to_string());
    }
    name.chars()
        .find(|c| !(c.is_ascii_alphanumeric() || "-_.:+@".contains(*c)))
        .map(|other| {
            format!(
                "holds `{}`; a name is letters, digits and - _ . : + @",
                other.escape_debug()
            )
        })
}

/// Default for `retry-timeout-ms`: long enough to ride out a server restart.
pub const RETRY_TIMEOUT_DEFAULT_MS: u64 = 30_000;

impl S3Url {
    /// Parses `s3://BUCKET/PREFIX?key=value&...`.
    ///
    /// The parts are taken literally, as the AWS CLI reads `s3://` URLs: `%` and `+` are
    /// themselves, `#` is text, and `.` or `..` segments of the prefix are part of it. `url`
    /// reads the bucket (refusing a user, password, port or a character no host name has)
    /// and each `endpoint=`; the prefix and the query are split here because `url` would
    /// percent-encode the prefix, resolve its dot segments and form-decode `+` in values.
    pub fn parse(text: &str) -> Result<Self, UrlError> {
        let rest = text
            .strip_prefix("s3://")
            .ok_or_else(|| UrlError::Scheme(text.to_string()))?;
        // RFC 3986's generic split (section 3): the bucket ends at the first `/` or `?`,
        // the prefix at the first `?`.
        let (location, query) = match rest.split_once('?') {
            Some((location, query)) => (location, Some(query)),
            None => (rest, None),
        };
        let (bucket, prefix) = location.split_once('/').unwrap_or((location, ""));
        check_bucket(text, bucket)?;
        let mut url = S3Url::with_defaults(bucket, prefix.trim_matches('/'));
        let mut seen: Vec<&str> = Vec::new();
        let pairs = query.into_iter().flat_map(|query| query.split('&'));
        for pair in pairs.filter(|pair| !pair.is_empty()) {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            if seen.contains(&name) {
                return Err(UrlError::DuplicateParameter {
                    url: text.to_string(),
                    name: name.to_string(),
                });
            }
            seen.push(name);
            let refused = match url.set_store_parameter(name, value) {
                Err(Refusal::Unknown) => url.set_layout_parameter(name, value),
                other => other,
            };
            match refused {
                Ok(()) => {}
                Err(Refusal::Unknown) => {
                    return Err(UrlError::UnknownParameter {
                        url: text.to_string(),
                        name: name.to_string(),
                    })
                }
                Err(Refusal::Bad(reason)) => {
                    return Err(UrlError::BadValue {
                        url: text.to_string(),
                        name: name.to_string(),
                        value: value.to_string(),
                        reason,
                    })
                }
            }
        }
        Ok(url)
    }

    /// The disk `bucket`/`prefix` with every parameter at its default.
    fn with_defaults(bucket: &str, prefix: &str) -> S3Url {
        S3Url {
            bucket: bucket.to_string(),
            prefix: prefix.to_string(),
            endpoint: None,
            region: None,
            path_style: None,
            layout: None,
            chunk_size_bytes: None,
            segment_bytes_max: None,
            gc: None,
            gc_threshold_ppm: None,
            key_file: None,
            compression: None,
            create_size_bytes: None,
            retry_timeout_ms: RETRY_TIMEOUT_DEFAULT_MS,
            break_lock: None,
            lock_check: true,
            recover_prefix: false,
            credentials_instance: false,
            snapshot: None,
            lease_ms: Some(crate::lease::LEASE_DEFAULT_MS),
            follow_ms: None,
            standby: false,
        }
    }

    /// Sets a parameter of the store and of the disk lock: endpoint, region, path-style,
    /// credentials, retry-timeout-ms, lock, break-lock, lease, follow.
    fn set_store_parameter(&mut self, name: &str, value: &str) -> Result<(), Refusal> {
        match name {
            "endpoint" => self.endpoint = Some(parse_endpoint(value)?),
            "region" if value.is_empty() => return Err(Refusal::bad("empty region")),
            "region" => self.region = Some(value.to_string()),
            "path-style" => {
                self.path_style = Some(match value {
                    "true" => true,
                    "false" => false,
                    _ => return Err(Refusal::bad("expected true or false")),
                })
            }
            "credentials" if value == "instance" => self.credentials_instance = true,
            "credentials" => {
                return Err(Refusal::bad(
                    "expected instance (the instance-metadata service)",
                ))
            }
            "retry-timeout-ms" => {
                self.retry_timeout_ms = value
                    .parse()
                    .map_err(|_| Refusal::bad("expected a whole number of milliseconds"))?;
            }
            "lock" => self.lock_check = on_off(value)?,
            "break-lock" => {
                if value.is_empty() || !value.bytes().all(|byte| byte.is_ascii_hexdigit()) {
                    return Err(Refusal::bad(
                        "expected the lock id (hex digits) that the refusal to start named",
                    ));
                }
                self.break_lock = Some(value.to_ascii_lowercase());
            }
            "lease" if value == "off" => self.lease_ms = None,
            "lease" => self.lease_ms = Some(parse_lease_ms(value)?),
            "follow" => {
                let seconds: f64 = value
                    .parse()
                    .map_err(|_| Refusal::bad("expected a number of seconds such as 5"))?;
                if !(0.1..=3600.0).contains(&seconds) {
                    return Err(Refusal::bad(
                        "a replica refreshes from every 0.1 to every 3600 seconds",
                    ));
                }
                self.follow_ms = Some((seconds * 1000.0).round() as u64);
            }
            _ => return Err(Refusal::Unknown),
        }
        Ok(())
    }

    /// Sets a parameter of the disk's layout and contents: layout, chunk-size, segment-size,
    /// gc, gc-threshold, key-file, compress, create-size, recover-prefix, snapshot.
    fn set_layout_parameter(&mut self, name: &str, value: &str) -> Result<(), Refusal> {
        match name {
            "layout" => {
                let layout = LayoutKind::parse(value);
                self.layout = Some(layout.ok_or_else(|| Refusal::bad("expected chunk or log"))?);
            }
            "chunk-size" => {
                let size = parse_size(value)?;
                if !size.is_power_of_two()
                    || !(CHUNK_SIZE_MIN_BYTES..=CHUNK_SIZE_MAX_BYTES).contains(&size)
                {
                    return Err(Refusal::bad(
                        "the chunk size must be a power of two from 4k to 64M",
                    ));
                }
                self.chunk_size_bytes = Some(size);
            }
            "segment-size" => {
                let size = parse_size(value)?;
                if !(SEGMENT_SIZE_MIN_BYTES..=SEGMENT_SIZE_MAX_BYTES).contains(&size) {
                    return Err(Refusal::bad("the segment size must be from 64k to 1G"));
                }
                self.segment_bytes_max = Some(size);
            }
            "gc" => self.gc = Some(on_off(value)?),
            "gc-threshold" => {
                let fraction: f64 = value
                    .parse()
                    .map_err(|_| Refusal::bad("expected a fraction such as 0.5"))?;
                if !(fraction > 0.0 && fraction < 1.0) {
                    return Err(Refusal::bad(
                        "the live fraction below which a segment is rewritten must be above 0 and below 1",
                    ));
                }
                self.gc_threshold_ppm = Some((fraction * 1e6).round() as u32);
            }
            "key-file" if value.is_empty() => {
                return Err(Refusal::bad(
                    "expected the path of a file holding a 32-byte key",
                ))
            }
            "key-file" => self.key_file = Some(std::path::PathBuf::from(value)),
            "compress" => {
                let compression = Compression::parse(value);
                self.compression =
                    Some(compression.ok_or_else(|| Refusal::bad("expected zstd, lz4 or off"))?);
            }
            "create-size" => {
                let size = parse_size(value)?;
                if size == 0 {
                    return Err(Refusal::bad("the size must be above zero"));
                }
                self.create_size_bytes = Some(size);
            }
            "recover-prefix" => self.recover_prefix = on_off(value)?,
            "snapshot" => {
                if let Some(problem) = snapshot_name_problem(value) {
                    return Err(Refusal::Bad(format!("snapshot name {problem}")));
                }
                self.snapshot = Some(value.to_string());
            }
            _ => return Err(Refusal::Unknown),
        }
        Ok(())
    }

    /// The URL that parses back to this disk and its parameters: each parameter that differs
    /// from its default, written as [`S3Url::parse`] reads it (`standby` is no parameter).
    /// Unlike `Display`, it shows every parameter, the key file's path among them.
    pub fn to_url(&self) -> String {
        let mut parameters: Vec<(&str, String)> = Vec::new();
        let mut add = |name, value: Option<String>| {
            if let Some(value) = value {
                parameters.push((name, value));
            }
        };
        add("endpoint", self.endpoint.clone());
        add("region", self.region.clone());
        add("path-style", self.path_style.map(|on| on.to_string()));
        add(
            "layout",
            self.layout.map(|layout| layout.name().to_string()),
        );
        add(
            "chunk-size",
            self.chunk_size_bytes.map(|bytes| bytes.to_string()),
        );
        add(
            "segment-size",
            self.segment_bytes_max.map(|bytes| bytes.to_string()),
        );
        add(
            "gc",
            self.gc.map(|on| if on { "on" } else { "off" }.to_string()),
        );
        let threshold = self.gc_threshold_ppm;
        add("gc-threshold", threshold.map(|ppm| format!("0.{ppm:06}")));
        let key_file = self.key_file.as_ref();
        add(
            "key-file",
            key_file.map(|path| path.to_string_lossy().into_owned()),
        );
        add(
            "compress",
            self.compression.map(|kind| kind.name().to_string()),
        );
        add(
            "create-size",
            self.create_size_bytes.map(|bytes| bytes.to_string()),
        );
        let retry_ms = self.retry_timeout_ms;
        add(
            "retry-timeout-ms",
            (retry_ms != RETRY_TIMEOUT_DEFAULT_MS).then(|| retry_ms.to_string()),
        );
        add("break-lock", self.break_lock.clone());
        add("lock", (!self.lock_check).then(|| "off".to_string()));
        add(
            "recover-prefix",
            self.recover_prefix.then(|| "on".to_string()),
        );
        add(
            "credentials",
            self.credentials_instance.then(|| "instance".to_string()),
        );
        add("snapshot", self.snapshot.clone());
        let lease = match self.lease_ms {
            None => Some("off".to_string()),
            Some(crate::lease::LEASE_DEFAULT_MS) => None,
            Some(ms) => Some(seconds_text(ms)),
        };
        add("lease", lease);
        add("follow", self.follow_ms.map(seconds_text));
        let mut text = format!("s3://{}/{}", self.bucket, self.prefix);
        for (index, (name, value)) in parameters.iter().enumerate() {
            let separator = if index == 0 { '?' } else { '&' };
            text.push_str(&format!("{separator}{name}={value}"));
        }
        text
    }

    /// The key of an object of this disk, under the prefix.
    pub fn key(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}/{name}", self.prefix)
        }
    }

    /// Path-style addressing in effect.
    pub fn path_style_effective(&self) -> bool {
        self.path_style.unwrap_or(self.endpoint.is_some())
    }
}

/// Why one parameter was refused, before the URL and the parameter are attached.
enum Refusal {
    /// No parameter has this name.
    Unknown,
    /// The value is not one the parameter takes, and why.
    Bad(String),
}

impl Refusal {
    fn bad(reason: &str) -> Refusal {
        Refusal::Bad(reason.to_string())
    }
}

/// Refuses a bucket that is empty or that `url` does not read back as the same host: one
/// holding a user, password or port, or a character no host name has (a space, `<`, `#`, a
/// tab, which `url` would drop...).
fn check_bucket(text: &str, bucket: &str) -> Result<(), UrlError> {
    if bucket.is_empty() {
        return Err(UrlError::MissingBucket(text.to_string()));
    }
    // A user or password is never echoed: it may be a secret key.
    let (shown, bucket_after_user) = match bucket.rsplit_once('@') {
        Some((_, host)) => (text.replacen(bucket, &format!("…@{host}"), 1), host),
        None => (text.to_string(), bucket),
    };
    let bad = |reason: &str| UrlError::Bucket {
        url: shown.clone(),
        bucket: bucket_after_user.to_string(),
        reason: reason.to_string(),
    };
    if bucket_after_user.len() < bucket.len() {
        return Err(bad(
            "credentials do not go in the URL; they come from the environment or the credentials file",
        ));
    }
    let parsed =
        url::Url::parse(&format!("s3://{bucket}")).map_err(|error| bad(&error.to_string()))?;
    if parsed.port().is_some() || bucket.ends_with(':') {
        return Err(bad(
            "a bucket has no port; give the store's address as endpoint=http://HOST:PORT",
        ));
    }
    if parsed.host_str() != Some(bucket) || parsed.path() != "" {
        return Err(bad("a bucket name is letters, digits, `.` and `-`"));
    }
    Ok(())
}

/// Reads `endpoint=`: an http or https URL with a host (kept as typed, without trailing `/`).
fn parse_endpoint(value: &str) -> Result<String, Refusal> {
    let expected = "expected http://HOST:PORT or https://HOST[:PORT]";
    let parsed =
        url::Url::parse(value).map_err(|error| Refusal::Bad(format!("{error}; {expected}")))?;
    if !matches!(parsed.scheme(), "http" | "https")
        || !value.starts_with(parsed.scheme())
        || parsed.host_str().is_none_or(str::is_empty)
    {
        return Err(Refusal::bad(expected));
    }
    Ok(value.trim_end_matches('/').to_string())
}

/// Reads `on` or `off`.
fn on_off(value: &str) -> Result<bool, Refusal> {
    match value {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(Refusal::bad("expected on or off")),
    }
}

/// Reads a size such as `64M` (bufcache's size syntax).
fn parse_size(value: &str) -> Result<u64, Refusal> {
    bufcache_device::size::parse_size(value).map_err(|error| Refusal::Bad(error.to_string()))
}

/// Reads `lease=SECONDS` into milliseconds, within the lease module's bounds.
fn parse_lease_ms(value: &str) -> Result<u64, Refusal> {
    let seconds: f64 = value
        .parse()
        .map_err(|_| Refusal::bad("expected a number of seconds such as 15, or off"))?;
    let (min_ms, max_ms) = (crate::lease::LEASE_MIN_MS, crate::lease::LEASE_MAX_MS);
    let lease_ms = seconds * 1000.0;
    if !(lease_ms >= min_ms as f64 && lease_ms <= max_ms as f64) {
        return Err(Refusal::Bad(format!(
            "the lease must be from {} to {} seconds: renewing a shorter one would take most of it, and a takeover waits a whole lease",
            min_ms / 1000,
            max_ms / 1000
        )));
    }
    Ok(lease_ms.round() as u64)
}

/// Milliseconds as the seconds `lease=` and `follow=` take (`2.5`).
fn seconds_text(ms: u64) -> String {
    format!("{}.{:03}", ms / 1000, ms % 1000)
}

/// The disk's name for messages: bucket, prefix and endpoint, never credentials.
impl fmt::Display for S3Url {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "s3://{}/{}", self.bucket, self.prefix)?;
        if let Some(endpoint) = &self.endpoint {
            write!(formatter, " at {endpoint}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for S3Url {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, formatter)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: every documented parameter is understood. Method: parse a URL that sets each.
    #[test]
    fn every_documented_parameter_is_parsed() {
        let url = S3Url::parse(
            "s3://vm-disks/db1/?endpoint=http://127.0.0.1:9000&region=eu-west-1&path-style=false\
             &chunk-size=1M&create-size=100G&retry-timeout-ms=500&break-lock=0A1b\
             &layout=log&segment-size=16M&lock=off&gc=off&gc-threshold=0.25&recover-prefix=on&lease=2.5&follow=2",
        )
        .unwrap();
        assert_eq!(url.bucket, "vm-disks");
        assert_eq!(url.prefix, "db1");
        assert_eq!(url.endpoint.as_deref(), Some("http://127.0.0.1:9000"));
        assert_eq!(url.region.as_deref(), Some("eu-west-1"));
        assert_eq!(url.path_style, Some(false));
        assert!(!url.path_style_effective());
        assert_eq!(url.chunk_size_bytes, Some(1 << 20));
        assert_eq!(url.create_size_bytes, Some(100 << 30));
        assert_eq!(url.retry_timeout_ms, 500);
        assert_eq!(url.break_lock.as_deref(), Some("0a1b"));
        assert_eq!(url.layout, Some(LayoutKind::Log));
        assert_eq!(url.segment_bytes_max, Some(16 << 20));
        assert_eq!(url.gc, Some(false));
        assert_eq!(url.gc_threshold_ppm, Some(250_000));
        assert!(url.recover_prefix);
        assert_eq!(url.lease_ms, Some(2_500));
        assert_eq!(url.follow_ms, Some(2_000));
        assert_eq!(S3Url::parse("s3://b/p?lease=off").unwrap().lease_ms, None);
        assert_eq!(
            S3Url::parse("s3://b/p").unwrap().lease_ms,
            Some(crate::lease::LEASE_DEFAULT_MS)
        );
        let sealed = S3Url::parse("s3://b/p?key-file=/etc/disk.key&compress=zstd").unwrap();
        assert_eq!(
            sealed.key_file.as_deref(),
            Some(std::path::Path::new("/etc/disk.key"))
        );
        assert_eq!(sealed.compression, Some(Compression::Zstd));
        assert_eq!(
            S3Url::parse("s3://b/p?compress=off").unwrap().compression,
            Some(Compression::Off)
        );
        assert_eq!(
            S3Url::parse("s3://b/p?compress=lz4").unwrap().compression,
            Some(Compression::Lz4)
        );
        assert!(!url.lock_check);
        assert_eq!(url.key("meta"), "db1/meta");
    }

    // Goal: defaults follow the store kind. Method: an endpoint implies path style, no
    // endpoint (AWS) implies virtual-hosted style; an empty prefix keys objects at the root.
    #[test]
    fn path_style_defaults_to_true_only_with_an_endpoint() {
        let aws = S3Url::parse("s3://bucket").unwrap();
        assert!(!aws.path_style_effective());
        assert_eq!(aws.key("meta"), "meta");
        let minio = S3Url::parse("s3://bucket/p?endpoint=http://h:9000").unwrap();
        assert!(minio.path_style_effective());
    }

    // Goal: a bad URL is refused with an error naming the bad part. Method: one bad string per
    // rule, checking the variant and that the message names the parameter.
    #[test]
    fn bad_urls_name_the_bad_parameter() {
        assert!(matches!(S3Url::parse("s4://b/p"), Err(UrlError::Scheme(_))));
        assert!(matches!(
            S3Url::parse("s3:///p"),
            Err(UrlError::MissingBucket(_))
        ));
        let cases = [
            ("s3://b/p?chunk-size=3M", "chunk-size"),
            ("s3://b/p?chunk-size=1k", "chunk-size"),
            ("s3://b/p?chunk-size=1X", "chunk-size"),
            ("s3://b/p?create-size=0", "create-size"),
            ("s3://b/p?path-style=yes", "path-style"),
            ("s3://b/p?endpoint=127.0.0.1:9000", "endpoint"),
            ("s3://b/p?region=", "region"),
            ("s3://b/p?retry-timeout-ms=soon", "retry-timeout-ms"),
            ("s3://b/p?colour=blue", "colour"),
            ("s3://b/p?layout=tree", "layout"),
            ("s3://b/p?lock=maybe", "lock"),
            ("s3://b/p?gc=maybe", "gc"),
            ("s3://b/p?gc-threshold=1.5", "gc-threshold"),
            ("s3://b/p?gc-threshold=half", "gc-threshold"),
            ("s3://b/p?segment-size=4k", "segment-size"),
            ("s3://b/p?segment-size=2G", "segment-size"),
            ("s3://b/p?break-lock=", "break-lock"),
            ("s3://b/p?lease=0.5", "lease"),
            ("s3://b/p?follow=0", "follow"),
            ("s3://b/p?follow=often", "follow"),
            ("s3://b/p?lease=soon", "lease"),
            ("s3://b/p?lease=100000", "lease"),
            ("s3://b/p?key-file=", "key-file"),
            ("s3://b/p?compress=lz5", "compress"),
            ("s3://b/p?break-lock=holder", "break-lock"),
            ("s3://b/p?region=a&region=b", "region"),
        ];
        for (text, parameter) in cases {
            let error = S3Url::parse(text).unwrap_err();
            assert!(
                error.to_string().contains(&format!("`{parameter}")),
                "{text}: {error}"
            );
        }
    }
}
