//! The chunk store: a disk of `size_bytes` stored as `chunk_size_bytes` objects
//! `PREFIX/chunks/<index as 16 hex digits>` plus the metadata object `PREFIX/bufcache-disk.json`.
//!
//! Rules that make it cheap and safe against an object store:
//! - a write covering a whole chunk is one PUT; a partial chunk is read once (one GET),
//!   merged and written once (one PUT), under a per-chunk lock so two partial writes to the
//!   same chunk do not lose each other's bytes;
//! - a chunk that would be all zeroes is deleted instead of stored, and a missing chunk reads
//!   as zeroes, so sparse disks cost nothing;
//! - reads are ranged GETs of just the bytes asked for;
//! - while the store holds the disk lock ([`ChunkStore::open_locked`]) nobody else writes, so
//!   the set of stored chunks is known (one LIST at open, then kept up to date): a chunk never
//!   stored is read, partially written or zeroed without asking the store;
//! - a server whose credentials may not write (the store answers the lock's PUT 403) opens
//!   the disk read-only instead, as does one that asks for it ([`ChunkStore::open_read_only`],
//!   which writes nothing at all, not even the lock); see [`ReadOnly`];
//! - every write returns only after the store acknowledged each PUT/DELETE, so `flush` has
//!   nothing left to wait for; a PUT is atomic per object, so after a crash every chunk is
//!   either old or new, never torn;
//! - requests of one call (one write, or every write of a batch) run in parallel, at most
//!   `requests_in_flight_max` at a time;
//!   the client retries errors and timeouts with exponential backoff for `retry-timeout-ms`,
//!   after which the error is returned, never success.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use futures::stream::{self, StreamExt, TryStreamExt};
use object_store::aws::{AmazonS3, AmazonS3Builder, AmazonS3ConfigKey};
use object_store::path::Path as ObjectPath;
use object_store::{
    BackoffConfig, ClientOptions, ObjectStore, PutMode, PutOptions, PutPayload, RetryConfig,
};
use serde_json::json;

use crate::blocks;
use crate::credentials::shared_file_credentials;
use crate::error::{chain, request_failed, DecodeError, OpenError, StoreError};
use crate::lock::{check_not_held, Acquired, DiskLock};
use crate::meters::{CountingConnector, StoreMeters};
use crate::seal::{MetadataTag, SealParameters, Sealer};
use crate::url::{LayoutKind, S3Url, CHUNK_SIZE_DEFAULT_BYTES, LAYOUT_DEFAULT};

/// Version of the chunk layout without checksums, as older servers wrote it (still read and
/// written to; new chunk disks get [`FORMAT_VERSION_CHUNK_CHECKED`]).
pub const FORMAT_VERSION: u64 = 1;
/// Version of the metadata object of a chunk-layout disk whose chunks are stored in checked
/// blocks (module `blocks`: each 4 KiB followed by its CRC-32), recorded with
/// `"chunk_checksums":"crc32-4k"`: a version older servers refuse, so none of them serves
/// the checksums as data.
pub const FORMAT_VERSION_CHUNK_CHECKED: u64 = 3;
/// The `chunk_checksums` value of a chunk disk in checked blocks.
const CHUNK_CHECKSUMS_NAME: &str = "crc32-4k";
/// Version of the metadata object of a log-layout disk: a version chunk-only servers refuse,
/// so none of them mistakes a log disk for an empty chunk disk.
pub const FORMAT_VERSION_LOG: u64 = 2;
/// Version of the metadata object of a log-layout disk that is a clone: it carries its base
/// (`"base":{"prefix","disk_id","snapshot"}`, module `log::clone`), a version servers that
/// know only version 2 refuse, so none of them opens a clone as a disk of its own (its log
/// starts past the base's, and such a server would delete it as orphans).
pub const FORMAT_VERSION_LOG_CLONE: u64 = 4;
pub use crate::url::METADATA_NAME;
/// Default bound on concurrent requests of one read or write call.
pub const REQUESTS_IN_FLIGHT_MAX_DEFAULT: usize = 32;
/// Per-chunk locks are striped over this many mutexes.
const CHUNK_LOCK_STRIPES: usize = 256;

/// The disk's shape, as stored in the metadata object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DiskMetadata {
    pub size_bytes: u64,
    /// The chunk size of a chunk-layout disk; 0 for a log-layout disk.
    pub chunk_size_bytes: u64,
    /// Whether the chunk objects are stored in checked blocks (each 4 KiB followed by its
    /// CRC-32, checked on every read and on the GET of a read-modify-write): true for chunk
    /// disks created since, false for older ones and log-layout disks (whose segments carry
    /// their own checksums).
    pub chunk_checksums: bool,
    pub format_version: u64,
    pub layout: LayoutKind,
    /// Random identity of the disk (`disk_id`, 16 hex digits, in the metadata object): a
    /// log-layout disk writes it in each of its segments and checkpoints so objects of another
    /// disk are never replayed as its own; rescue files and local tiers name their disk by it
    /// ([`disk_identity`]). 0 for a chunk-layout disk created before chunk disks had one (it
    /// gets one at its next writable open, [`advance_generation`]).
    pub disk_id: u64,
    /// `generation` in the metadata object: raised by every writable open
    /// ([`advance_generation`]), so a rescue file records which state of the disk it was
    /// taken against and is never replayed over writes of a later open. 0 when absent.
    pub generation: u64,
    /// Compression and encryption of a log-layout disk's extents (docs/s3.md, "Encryption
    /// and compression"); none for a chunk-layout disk.
    pub seal: SealParameters,
}

/// What opening a disk yields before a layout takes over: the runtime, the client and the
/// disk's metadata (created when the URL asked for it).
pub(crate) struct Connection {
    pub runtime: tokio::runtime::Runtime,
    pub store: Arc<AmazonS3>,
    pub metadata: DiskMetadata,
    /// Reaches the other buckets the disk needs (a clone's base in another bucket).
    pub buckets: Buckets,
}

/// How an open reaches a bucket other than its disk's: a clone's base may live in another
/// bucket of the same store (module `log::clone`).
#[derive(Clone)]
pub(crate) enum Buckets {
    /// Through a client made as the disk's is: the disk URL's endpoint, region, addressing,
    /// credentials and retry timeout, its requests counted in the same meters.
    Connect {
        url: Box<S3Url>,
        meters: Arc<StoreMeters>,
    },
    /// Not at all: an open on a store its caller made (the simulator's, which holds one
    /// bucket).
    None,
}

impl Buckets {
    /// A client for `bucket`.
    pub(crate) fn store(&self, bucket: &str) -> Result<Arc<dyn ObjectStore>, OpenError> {
        match self {
            Buckets::Connect { url, meters } => {
                let mut other = (**url).clone();
                other.bucket = bucket.to_string();
                let store: Arc<dyn ObjectStore> = bucket_client(&other, Arc::clone(meters))?;
                Ok(store)
            }
            Buckets::None => Err(OpenError::Config {
                url: format!("s3://{bucket}/"),
                reason:
                    "this open was given a store for its own bucket only, and cannot reach another"
                        .to_string(),
            }),
        }
    }
}

/// A client for the bucket `url` names (no runtime of its own: it runs on the caller's),
/// with the same settings and meters a connection's client has.
pub(crate) fn bucket_client(
    url: &S3Url,
    meters: Arc<StoreMeters>,
) -> Result<Arc<AmazonS3>, OpenError> {
    let retry_timeout = Duration::from_millis(url.retry_timeout_ms);
    check_credentials(url, &client_builder(url, retry_timeout, RETRIES_UNBOUNDED))?;
    let store = client_builder(url, retry_timeout, RETRIES_UNBOUNDED)
        .with_http_connector(CountingConnector::new(meters))
        .build()
        .map_err(|error| OpenError::Client {
            url: url.to_string(),
            message: chain(&error),
        })?;
    Ok(Arc::new(store))
}

/// Connects to the disk `url` names and reads (or creates, when the URL asks) its metadata
/// object.
pub(crate) fn connect(url: &S3Url) -> Result<Connection, OpenError> {
    connect_with(url, Create::IfAsked)
}

/// [`connect`], creating a missing disk only when `create` allows it.
pub(crate) fn connect_with(url: &S3Url, create: Create) -> Result<Connection, OpenError> {
    connect_counted(url, create, StoreMeters::new())
}

/// A runtime and a client for the bucket `url` names, with no request made yet.
pub(crate) struct Client {
    pub runtime: tokio::runtime::Runtime,
    pub store: Arc<AmazonS3>,
}

/// [`connect_with`] without reading the metadata: for a caller whose first request must be
/// another (a clone's record goes before its base's metadata is read, module `log::clone`).
pub(crate) fn connect_client(url: &S3Url) -> Result<Client, OpenError> {
    let (runtime, store, _) = clients(url, StoreMeters::new())?;
    Ok(Client { runtime, store })
}

/// [`connect_with`], every request of the connection counted in `meters`.
pub(crate) fn connect_counted(
    url: &S3Url,
    create: Create,
    meters: Arc<StoreMeters>,
) -> Result<Connection, OpenError> {
    let (runtime, store, probe) = clients(url, Arc::clone(&meters))?;
    let metadata = runtime.block_on(ChunkStore::open_metadata(&probe, url, create))?;
    Ok(Connection {
        runtime,
        store,
        metadata,
        buckets: Buckets::Connect {
            url: Box::new(url.clone()),
            meters,
        },
    })
}

/// The runtime, the client and the probe (the client with few retries, for the first
/// request) of a connection to `url`.
fn clients(
    url: &S3Url,
    meters: Arc<StoreMeters>,
) -> Result<(tokio::runtime::Runtime, Arc<AmazonS3>, AmazonS3), OpenError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("bufcache-s3")
        .enable_all()
        .build()
        .map_err(|source| OpenError::Runtime {
            url: url.to_string(),
            source,
        })?;
    let client_error = |error: object_store::Error| OpenError::Client {
        url: url.to_string(),
        message: chain(&error),
    };
    let retry_timeout = Duration::from_millis(url.retry_timeout_ms);
    let store = bucket_client(url, Arc::clone(&meters))?;
    // Opening probes with few retries so an unreachable endpoint or a refused key is
    // reported in seconds rather than after the full retry timeout.
    let probe = client_builder(url, retry_timeout.min(Duration::from_secs(5)), 2)
        .with_http_connector(CountingConnector::new(meters))
        .build()
        .map_err(client_error)?;
    Ok((runtime, store, probe))
}

/// A random 64-bit id (OS-seeded hasher, the clock and the process id mixed in).
pub(crate) fn random_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    let nanoseconds = std::time::SystemTime::now()
        .duration_since(std::time::SystemTime::UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_nanos());
    hasher.write_u128(nanoseconds);
    hasher.finish()
}

/// The identity rescue files and local tiers give the disk of id `disk_id`:
/// `s3-disk:<16 hex digits>`. It names the disk, not the URL that reached it, so no URL
/// parameter (`break-lock=`, `create-size=`, an endpoint alias ...) changes it.
pub fn disk_identity(disk_id: u64) -> String {
    format!("s3-disk:{disk_id:016x}")
}

/// What a server must know of a disk before it changes anything in the store: which disk it
/// is and how far it has moved on ([`probe`], [`advance_generation`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DiskState {
    /// The disk's id; None for a chunk disk created before chunk disks had one.
    pub disk_id: Option<u64>,
    /// How many writable opens the disk has had (the metadata object's `generation`).
    pub generation: u64,
    pub size_bytes: u64,
    pub layout: LayoutKind,
}

impl DiskState {
    pub(crate) fn of(metadata: &DiskMetadata) -> DiskState {
        DiskState {
            disk_id: (metadata.disk_id != 0).then_some(metadata.disk_id),
            generation: metadata.generation,
            size_bytes: metadata.size_bytes,
            layout: metadata.layout,
        }
    }
}

/// A runtime and client for one short exchange with the disk's store (probe, generation).
fn short_client(
    url: &S3Url,
    retries: usize,
    meters: Option<&Arc<StoreMeters>>,
) -> Result<(tokio::runtime::Runtime, AmazonS3), OpenError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|source| OpenError::Runtime {
            url: url.to_string(),
            source,
        })?;
    let retry_timeout = Duration::from_millis(url.retry_timeout_ms);
    let builder = client_builder(url, retry_timeout.min(Duration::from_secs(5)), retries);
    // Like every connection: no credentials is refused here, before any request could go to
    // the instance-metadata address.
    check_credentials(url, &builder)?;
    let builder = match meters {
        Some(meters) => builder.with_http_connector(CountingConnector::new(Arc::clone(meters))),
        None => builder,
    };
    let client = builder.build().map_err(|error| OpenError::Client {
        url: url.to_string(),
        message: chain(&error),
    })?;
    Ok((runtime, client))
}

/// Reads the disk's metadata object and nothing else, writing nothing: the disk's identity and
/// generation, checked against the URL's parameters; None when no disk exists there yet.
pub fn probe(url: &S3Url) -> Result<Option<DiskState>, OpenError> {
    probe_counted(url, None)
}

/// [`probe`] with its requests counted in `meters` (those of the disk about to be opened).
pub fn probe_counted(
    url: &S3Url,
    meters: Option<&Arc<StoreMeters>>,
) -> Result<Option<DiskState>, OpenError> {
    let (runtime, client) = short_client(url, 2, meters)?;
    match runtime.block_on(ChunkStore::open_metadata(&client, url, Create::Never)) {
        Ok(metadata) => Ok(Some(DiskState::of(&metadata))),
        Err(OpenError::NoDiskReadOnly { .. }) => Ok(None),
        Err(error) => Err(error),
    }
}

/// Raises the disk's generation by one in its metadata object (giving a chunk disk that has
/// no id `proposed_id`), keeping every other field as stored. Called by a writable open once
/// it holds the disk lock, so no other server writes the object meanwhile. `seen` is the
/// generation [`probe`] read before the lock was taken (None: no disk existed then): when it
/// moved since, another server opened the disk in between and the open is refused, since the
/// checks made against what the probe read no longer hold.
pub fn advance_generation(
    url: &S3Url,
    seen: Option<u64>,
    proposed_id: u64,
) -> Result<DiskState, OpenError> {
    advance_generation_counted(url, seen, proposed_id, None)
}

/// [`advance_generation`] with its requests counted in `meters` (those of the disk it opens).
pub(crate) fn advance_generation_counted(
    url: &S3Url,
    seen: Option<u64>,
    proposed_id: u64,
    meters: Option<&Arc<StoreMeters>>,
) -> Result<DiskState, OpenError> {
    assert_ne!(proposed_id, 0, "0 means no disk id");
    let key = url.key(METADATA_NAME);
    let request_error = |operation: String, error: object_store::Error| OpenError::Request {
        url: url.to_string(),
        operation,
        message: chain(&error),
    };
    let (runtime, client) = short_client(url, RETRIES_UNBOUNDED, meters)?;
    let location = ObjectPath::from(key.as_str());
    let body = runtime
        .block_on(async {
            let result = client.get(&location).await?;
            result.bytes().await
        })
        .map_err(|error| request_error(format!("reading `{key}`"), error))?;
    let LoadedMetadata {
        metadata: stored,
        mut value,
        ..
    } = authenticate_metadata(url, &body)?;
    if let Some(seen) = seen.filter(|seen| *seen != stored.generation) {
        return Err(OpenError::Config {
            url: url.to_string(),
            reason: format!(
                "the disk's generation moved from {seen} to {} while this server started (another server opened it meanwhile): nothing was changed; start again",
                stored.generation
            ),
        });
    }
    let generation = stored.generation + 1;
    value["generation"] = json!(generation);
    let disk_id = if stored.disk_id == 0 {
        value["disk_id"] = json!(format!("{proposed_id:016x}"));
        proposed_id
    } else {
        stored.disk_id
    };
    seal_metadata(url, &stored, &mut value)?;
    runtime
        .block_on(client.put(&location, PutPayload::from(value.to_string().into_bytes())))
        .map_err(|error| request_error(format!("writing `{key}`"), error))?;
    Ok(DiskState {
        disk_id: Some(disk_id),
        generation,
        size_bytes: stored.size_bytes,
        layout: stored.layout,
    })
}

/// A random id for a disk that has none yet (never 0, which means none).
pub fn new_disk_id() -> u64 {
    random_id().max(1)
}

/// Why a store opened for serving refuses writes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReadOnly {
    /// The caller asked for it ([`ChunkStore::open_read_only`]): nothing is written, not even
    /// the disk lock.
    Requested,
    /// The store answered the lock's create-only PUT 403 Forbidden, so these credentials (or
    /// the bucket's policy) may not write; the store's answer, on one line. No lock is held.
    WritesRefused(String),
    /// A read replica (`follow=`): it follows the log another server writes, never taking
    /// the lock (module `replica`).
    Replica,
}

impl std::fmt::Display for ReadOnly {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadOnly::Requested => write!(formatter, "opened read-only as asked"),
            ReadOnly::Replica => write!(
                formatter,
                "a read replica, following the server that writes the disk"
            ),
            ReadOnly::WritesRefused(answer) => {
                write!(formatter, "the store refuses writes: {answer}")
            }
        }
    }
}

/// Whether opening may create a missing disk.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Create {
    /// When the URL has `create-size=`.
    IfAsked,
    /// Never: a read-only open writes nothing.
    Never,
}

/// The outcome of reading one piece: where it goes in the buffer and its bytes (None: zeroes).
type PieceRead = Result<(Range<usize>, Option<Bytes>), StoreError>;

/// A set of chunk indexes (one bit each), shared by concurrent requests.
struct ChunkSet {
    /// One bit per chunk; more words are added when the disk grows while held
    /// ([`ChunkStore::grow`]).
    words: std::sync::RwLock<Vec<std::sync::atomic::AtomicU64>>,
}

impl ChunkSet {
    /// The chunks stored under the disk's prefix, from a LIST of it.
    async fn list(
        store: &AmazonS3,
        url: &S3Url,
        chunk_count: u64,
    ) -> Result<ChunkSet, object_store::Error> {
        let set = ChunkSet {
            words: std::sync::RwLock::new(
                (0..chunk_count.div_ceil(64))
                    .map(|_| std::sync::atomic::AtomicU64::new(0))
                    .collect(),
            ),
        };
        let prefix = ObjectPath::from(url.key("chunks").as_str());
        let mut objects = store.list(Some(&prefix));
        while let Some(object) = objects.next().await {
            let object = object?;
            // A name that is not a chunk of this disk is no chunk; reads of it never happen.
            if let Some(index) = object
                .location
                .filename()
                .and_then(|name| u64::from_str_radix(name, 16).ok())
                .filter(|&index| index < chunk_count)
            {
                set.insert(index);
            }
        }
        Ok(set)
    }

    fn words(&self) -> std::sync::RwLockReadGuard<'_, Vec<std::sync::atomic::AtomicU64>> {
        self.words.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// Makes room for `chunk_count` chunks; the new ones are not stored (holes).
    fn grow(&self, chunk_count: u64) {
        let mut words = self.words.write().unwrap_or_else(PoisonError::into_inner);
        let wanted = chunk_count.div_ceil(64) as usize;
        while words.len() < wanted {
            words.push(std::sync::atomic::AtomicU64::new(0));
        }
    }

    fn contains(&self, index: u64) -> bool {
        let word = self.words()[(index / 64) as usize].load(std::sync::atomic::Ordering::Acquire);
        word & (1 << (index % 64)) != 0
    }

    fn insert(&self, index: u64) {
        self.words()[(index / 64) as usize]
            .fetch_or(1 << (index % 64), std::sync::atomic::Ordering::AcqRel);
    }

    fn remove(&self, index: u64) {
        self.words()[(index / 64) as usize]
            .fetch_and(!(1 << (index % 64)), std::sync::atomic::Ordering::AcqRel);
    }
}

/// One piece of a request that falls in one chunk.
struct Piece {
    chunk: u64,
    /// Byte range inside the chunk.
    within: Range<u64>,
    /// Byte range inside the caller's buffer.
    buffer: Range<usize>,
}

/// The pieces a batch writes into one chunk, in batch order, and the writes they belong to.
#[derive(Default)]
struct ChunkEdits {
    writes: Vec<usize>,
    edits: Vec<(Range<u64>, Option<Bytes>)>,
}

/// True when `ranges` together cover `0..length`.
fn covers(length: u64, ranges: impl Iterator<Item = Range<u64>>) -> bool {
    let mut ranges: Vec<Range<u64>> = ranges.collect();
    ranges.sort_by_key(|range| range.start);
    let mut covered_to = 0;
    for range in ranges {
        if range.start > covered_to {
            return false;
        }
        covered_to = covered_to.max(range.end);
    }
    covered_to >= length
}

/// The chunk store. All methods block the calling thread on the store's own runtime; do not
/// call them from inside another tokio runtime.
pub struct ChunkStore {
    /// Declared before `runtime` so that it is dropped (and released) while the runtime runs.
    lock: Option<Arc<DiskLock>>,
    /// Which chunk objects may exist, known while this store holds the lock (nobody else
    /// writes the disk then); None otherwise, and every chunk is asked for.
    stored: Option<Arc<ChunkSet>>,
    runtime: tokio::runtime::Runtime,
    store: Arc<AmazonS3>,
    url: S3Url,
    /// The metadata as opened; its size is `size_bytes`'s, which grows while served.
    metadata: DiskMetadata,
    size_bytes: std::sync::atomic::AtomicU64,
    chunk_locks: Arc<Vec<tokio::sync::Mutex<()>>>,
    requests_in_flight_max: usize,
    /// Set when the store refuses writes; every write then fails with
    /// [`StoreError::ReadOnly`] without a request.
    read_only: Option<ReadOnly>,
}

/// No count cap on a request's retries: `retry-timeout-ms` alone bounds them, as documented
/// (a count cap of 10 ended retries after 2 to 26 s whatever the timeout said).
const RETRIES_UNBOUNDED: usize = usize::MAX;

/// The most retries `retry_timeout` can hold: every retry first waits at least the initial
/// backoff (100 ms), so a count cap of this size never ends retries before the timeout does,
/// and error messages (which print the cap) show a number a person can read.
fn retries_within(retry_timeout: Duration) -> usize {
    usize::try_from(retry_timeout.as_millis() / 100 + 1).unwrap_or(usize::MAX)
}

fn client_builder(url: &S3Url, retry_timeout: Duration, max_retries: usize) -> AmazonS3Builder {
    let mut builder = AmazonS3Builder::from_env()
        .with_bucket_name(&url.bucket)
        .with_virtual_hosted_style_request(!url.path_style_effective())
        .with_retry(RetryConfig {
            backoff: BackoffConfig {
                init_backoff: Duration::from_millis(100),
                max_backoff: Duration::from_secs(5),
                base: 2.0,
            },
            max_retries: max_retries.min(retries_within(retry_timeout)),
            retry_timeout,
        })
        .with_client_options(
            ClientOptions::new()
                .with_allow_http(true)
                .with_connect_timeout(Duration::from_secs(5))
                .with_timeout(Duration::from_secs(60)),
        )
        // PUTs and DELETEs whose connection broke are retried too (module `retry_writes`).
        .with_http_connector(crate::retry_writes::RetryWritesConnector::default());
    if let Some(endpoint) = &url.endpoint {
        builder = builder.with_endpoint(endpoint);
    }
    match &url.region {
        Some(region) => builder = builder.with_region(region),
        None => {
            if std::env::var_os("AWS_REGION").is_none()
                && std::env::var_os("AWS_DEFAULT_REGION").is_none()
            {
                builder = builder.with_region("us-east-1");
            }
        }
    }
    if let Some(credentials) = shared_file_credentials() {
        builder = builder
            .with_access_key_id(credentials.access_key_id)
            .with_secret_access_key(credentials.secret_access_key);
        if let Some(token) = credentials.session_token {
            builder = builder.with_token(token);
        }
    }
    builder
}

/// Refuses a disk whose client would ask the instance-metadata service for credentials
/// (none in the environment, the credentials file, web identity or container settings) when
/// the URL names a store other than AWS and does not ask for it (`credentials=instance`):
/// on such a store that request can only fail, after leaving the machine for 169.254.169.254.
fn check_credentials(url: &S3Url, builder: &AmazonS3Builder) -> Result<(), OpenError> {
    let configured = |key: AmazonS3ConfigKey| builder.get_config_value(&key).is_some();
    let keys = configured(AmazonS3ConfigKey::AccessKeyId)
        || configured(AmazonS3ConfigKey::SecretAccessKey);
    let web_identity = std::env::var_os("AWS_WEB_IDENTITY_TOKEN_FILE").is_some()
        && std::env::var_os("AWS_ROLE_ARN").is_some();
    let container = configured(AmazonS3ConfigKey::ContainerCredentialsRelativeUri)
        || configured(AmazonS3ConfigKey::ContainerCredentialsFullUri);
    if keys || web_identity || container || url.credentials_instance || url.endpoint.is_none() {
        return Ok(());
    }
    Err(OpenError::NoCredentials {
        url: url.to_string(),
        looked: crate::credentials::places_looked(),
    })
}

impl ChunkStore {
    /// Opens the disk `url` names, creating it when the URL has `create-size=` and no disk
    /// exists. The metadata object is checked against the URL's parameters; on any mismatch
    /// nothing is written.
    pub fn open(url: &S3Url) -> Result<Self, OpenError> {
        // The chunk store creates chunk disks whatever the servers' default layout.
        let mut url = url.clone();
        url.layout.get_or_insert(LayoutKind::Chunk);
        Self::from_connection(&url, connect(&url)?)
    }

    /// The chunk store of a connected disk; refused when the disk has another layout.
    pub(crate) fn from_connection(url: &S3Url, connection: Connection) -> Result<Self, OpenError> {
        let Connection {
            runtime,
            store,
            metadata,
            ..
        } = connection;
        if metadata.layout != LayoutKind::Chunk {
            return Err(OpenError::Mismatch {
                url: url.to_string(),
                parameter: "layout",
                given: LayoutKind::Chunk.name().to_string(),
                stored: metadata.layout.name().to_string(),
            });
        }
        Ok(ChunkStore {
            lock: None,
            stored: None,
            runtime,
            store,
            url: url.clone(),
            metadata,
            size_bytes: std::sync::atomic::AtomicU64::new(metadata.size_bytes),
            chunk_locks: Arc::new(
                (0..CHUNK_LOCK_STRIPES)
                    .map(|_| tokio::sync::Mutex::new(()))
                    .collect(),
            ),
            requests_in_flight_max: REQUESTS_IN_FLIGHT_MAX_DEFAULT,
            read_only: None,
        })
    }

    /// Opens the disk like [`ChunkStore::open`] and takes its lock (`bufcache-lock.json`):
    /// refused with [`OpenError::Locked`], naming the holder, when another server holds it,
    /// unless the URL's `break-lock=ID` names that lock. The lock is released when the store
    /// is dropped or by [`crate::release_locks`].
    ///
    /// When the store answers the lock's PUT 403 Forbidden (credentials that may only read),
    /// the disk is opened read-only instead, without a lock, as [`ChunkStore::open_read_only`]
    /// would: [`ChunkStore::read_only`] then says why. Any other failure to take the lock (a
    /// 500 after the retries, an unreachable store) is an error, never a read-only store.
    pub fn open_locked(url: &S3Url) -> Result<Self, OpenError> {
        Self::open(url)?.take_lock(url)
    }

    /// Takes the disk's lock and lists the stored chunks (see [`ChunkStore::open_locked`]);
    /// a store that answers the lock's PUT 403 leaves this one read-only, without a lock.
    pub(crate) fn take_lock(mut self, url: &S3Url) -> Result<Self, OpenError> {
        let store = &mut self;
        let acquired = store.runtime.block_on(DiskLock::acquire(
            store.runtime.handle().clone(),
            store.store.clone(),
            url,
        ))?;
        let lock = match acquired {
            Acquired::Held(lock) => lock,
            Acquired::WritesRefused(answer) => {
                store.runtime.block_on(check_not_held(&store.store, url))?;
                tracing::info!(disk = %url, "the store refuses writes ({answer}): opened read-only, without the disk lock");
                store.read_only = Some(ReadOnly::WritesRefused(answer));
                return Ok(self);
            }
        };
        store.lock = Some(lock);
        // One LIST (per 1,000 chunks) now saves a GET for every read or partial write of a
        // chunk never stored: on a new or sparse disk, most of them.
        let chunk_count = store.metadata.size_bytes / store.metadata.chunk_size_bytes;
        let stored = store
            .runtime
            .block_on(ChunkSet::list(&store.store, url, chunk_count))
            .map_err(|error| OpenError::Request {
                url: url.to_string(),
                operation: format!("listing the chunks under `{}`", url.key("chunks")),
                message: chain(&error),
            })?;
        store.stored = Some(Arc::new(stored));
        Ok(self)
    }

    /// Opens an existing disk read-only for serving, writing nothing at all (not the lock,
    /// not a new disk). Without the lock another server could write the disk underneath, so
    /// a disk whose lock another server holds is refused ([`OpenError::LockedReadOnly`])
    /// unless the URL's `break-lock=ID` names that lock, which is then left in place. Every
    /// chunk is asked for (no LIST at open): without the lock, the set of stored chunks is
    /// not this store's to know.
    pub fn open_read_only(url: &S3Url) -> Result<Self, OpenError> {
        Self::read_only_from_connection(url, connect_with(url, Create::Never)?)
    }

    /// [`ChunkStore::open_read_only`] for a disk already connected (without creating it).
    pub(crate) fn read_only_from_connection(
        url: &S3Url,
        connection: Connection,
    ) -> Result<Self, OpenError> {
        let mut store = Self::from_connection(url, connection)?;
        store.runtime.block_on(check_not_held(&store.store, url))?;
        store.read_only = Some(ReadOnly::Requested);
        Ok(store)
    }

    /// Why this store refuses writes; None when it takes them.
    pub fn read_only(&self) -> Option<&ReadOnly> {
        self.read_only.as_ref()
    }

    /// Who holds the disk's lock now (None: nobody), as stored in the lock object.
    pub fn lock_holder(&self) -> Result<Option<crate::LockHolder>, StoreError> {
        let key = self.url.key(crate::LOCK_NAME);
        self.runtime.block_on(async {
            let body = match self.store.get(&ObjectPath::from(key.as_str())).await {
                Ok(existing) => existing.bytes().await,
                Err(object_store::Error::NotFound { .. }) => return Ok(None),
                Err(error) => Err(error),
            }
            .map_err(|error| request_failed("GET", &key, error))?;
            crate::LockHolder::parse(&body)
                .map(Some)
                .map_err(|reason| StoreError::Request {
                    operation: "GET",
                    key: key.clone(),
                    message: format!("not a bufcache lock: {reason}"),
                })
        })
    }

    /// The lock this store holds (opened with [`ChunkStore::open_locked`]).
    pub fn lock(&self) -> Option<&DiskLock> {
        self.lock.as_deref()
    }

    pub(crate) async fn open_metadata(
        store: &dyn ObjectStore,
        url: &S3Url,
        create: Create,
    ) -> Result<DiskMetadata, OpenError> {
        let key = url.key(METADATA_NAME);
        let request_error = |operation: String, error: object_store::Error| OpenError::Request {
            url: url.to_string(),
            operation,
            message: chain(&error),
        };
        match store.get(&ObjectPath::from(key.as_str())).await {
            Ok(result) => {
                let body = result
                    .bytes()
                    .await
                    .map_err(|error| request_error(format!("reading `{key}`"), error))?;
                parse_checked(url, &key, &body)
            }
            Err(object_store::Error::NotFound { .. }) if create == Create::Never => {
                Err(OpenError::NoDiskReadOnly {
                    url: url.to_string(),
                    key,
                })
            }
            Err(object_store::Error::NotFound { .. }) => {
                // Listing tells a missing bucket (an error) from an empty prefix, and refuses
                // to lay a new disk over objects someone else put there.
                let prefix =
                    (!url.prefix.is_empty()).then(|| ObjectPath::from(url.prefix.as_str()));
                let existing: Vec<_> = store
                    .list(prefix.as_ref())
                    .take(100)
                    .try_collect()
                    .await
                    .map_err(|error| request_error("listing the bucket".to_string(), error))?;
                let Some(size) = url.create_size_bytes else {
                    return Err(OpenError::NoDisk {
                        url: url.to_string(),
                        key,
                    });
                };
                if let Some(first) = existing.first() {
                    return Err(OpenError::PrefixNotEmpty {
                        url: url.to_string(),
                        key,
                        count: existing.len(),
                        first: first.location.to_string(),
                    });
                }
                let layout = url.layout.unwrap_or(LAYOUT_DEFAULT);
                let (metadata, body) = match layout {
                    LayoutKind::Chunk => {
                        check_no_seal_parameters(url)?;
                        let chunk_size = url.chunk_size_bytes.unwrap_or(CHUNK_SIZE_DEFAULT_BYTES);
                        if !size.is_multiple_of(chunk_size) {
                            return Err(OpenError::SizeNotChunkMultiple {
                                url: url.to_string(),
                                size,
                                chunk_size,
                            });
                        }
                        let disk_id = random_id();
                        let metadata = DiskMetadata {
                            size_bytes: size,
                            chunk_size_bytes: chunk_size,
                            chunk_checksums: true,
                            format_version: FORMAT_VERSION_CHUNK_CHECKED,
                            layout,
                            disk_id,
                            generation: 0,
                            seal: SealParameters::default(),
                        };
                        let body = json!({
                            "format": "bufcache-s3",
                            "format_version": FORMAT_VERSION_CHUNK_CHECKED,
                            "disk_id": format!("{disk_id:016x}"),
                            "generation": 0,
                            "size_bytes": size,
                            "chunk_size_bytes": chunk_size,
                            "chunk_checksums": CHUNK_CHECKSUMS_NAME,
                        });
                        (metadata, body)
                    }
                    LayoutKind::Log => new_log_metadata(url, size)?,
                };
                let mut body = body;
                seal_metadata(url, &metadata, &mut body)?;
                let body = body.to_string();
                // Create-only: when two servers create the same disk at once, one loses here
                // instead of overwriting the other's description.
                store
                    .put_opts(
                        &ObjectPath::from(key.as_str()),
                        PutPayload::from(body.into_bytes()),
                        PutOptions {
                            mode: PutMode::Create,
                            ..Default::default()
                        },
                    )
                    .await
                    .map_err(|error| request_error(format!("creating `{key}`"), error))?;
                tracing::info!(disk = %url, size_bytes = size, layout = layout.name(), "created object-store disk");
                Ok(metadata)
            }
            Err(error) => Err(request_error(format!("reading `{key}`"), error)),
        }
    }

    /// The disk's shape (its size as it is now).
    pub fn metadata(&self) -> DiskMetadata {
        DiskMetadata {
            size_bytes: self.size_bytes(),
            ..self.metadata
        }
    }

    fn size_bytes(&self) -> u64 {
        self.size_bytes.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Grows the disk while this store holds it (a server asked through its control socket):
    /// rewrites the size in the metadata object (a GET and a PUT), then serves the new size.
    /// The chunks past the old end are holes (a shrink leaves none there). Refused, nothing
    /// changed: a smaller size (clients were told the larger one), a size that is not a
    /// multiple of the chunk size, a store that does not hold the disk's lock.
    pub fn grow(&self, size_bytes: u64) -> Result<(), OpenError> {
        static GROWING: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _serialized = GROWING.lock().unwrap_or_else(PoisonError::into_inner);
        let refused = |reason: String| OpenError::Config {
            url: self.url.to_string(),
            reason: format!("{reason}: nothing was changed"),
        };
        let now = self.size_bytes();
        if size_bytes < now {
            return Err(refused(format!(
                "a served disk only grows ({size_bytes} bytes is less than its {now}: its clients were told {now} when they connected); stop the server and run `bufcache disk resize` to shrink it"
            )));
        }
        check_new_size(&self.url, &self.metadata, size_bytes)?;
        if size_bytes == now {
            return Ok(());
        }
        if self.lock.is_none() || self.read_only.is_some() {
            return Err(refused(
                "the disk cannot be grown here: this server does not hold it for writing"
                    .to_string(),
            ));
        }
        self.runtime
            .block_on(write_size(&*self.store, &self.url, size_bytes))?;
        if let Some(stored) = &self.stored {
            stored.grow(size_bytes / self.metadata.chunk_size_bytes);
        }
        self.size_bytes
            .store(size_bytes, std::sync::atomic::Ordering::Release);
        tracing::info!(disk = %self.url, size_bytes_before = now, size_bytes, "grew the disk while serving it");
        Ok(())
    }

    /// The URL the store was opened with.
    pub fn url(&self) -> &S3Url {
        &self.url
    }

    /// Sets the bound on concurrent requests of one call (at least 1).
    pub fn set_requests_in_flight_max(&mut self, requests_in_flight_max: usize) {
        self.requests_in_flight_max = requests_in_flight_max.max(1);
    }

    /// The bound on concurrent requests of one call.
    pub fn requests_in_flight_max(&self) -> usize {
        self.requests_in_flight_max
    }

    /// The object key of chunk `index`.
    pub fn chunk_key(&self, index: u64) -> String {
        self.url.key(&format!("chunks/{index:016x}"))
    }

    fn check_range(&self, offset: u64, length: u64) -> Result<(), StoreError> {
        match offset.checked_add(length) {
            Some(end) if end <= self.size_bytes() => Ok(()),
            _ => Err(StoreError::OutOfRange {
                offset,
                length,
                size: self.size_bytes(),
            }),
        }
    }

    fn pieces(&self, offset: u64, length: u64) -> Vec<Piece> {
        let chunk_size = self.metadata.chunk_size_bytes;
        let mut pieces = Vec::new();
        let mut position = offset;
        while position < offset + length {
            let chunk = position / chunk_size;
            let start = position % chunk_size;
            let end = chunk_size.min(start + (offset + length - position));
            let buffer_start = (position - offset) as usize;
            pieces.push(Piece {
                chunk,
                within: start..end,
                buffer: buffer_start..buffer_start + (end - start) as usize,
            });
            position += end - start;
        }
        pieces
    }

    /// Fills `buffer` from the disk at `offset`: one ranged GET per chunk touched, in
    /// parallel; chunks that are not stored read as zeroes.
    pub fn read(&self, buffer: &mut [u8], offset: u64) -> Result<(), StoreError> {
        self.check_range(offset, buffer.len() as u64)?;
        let pieces = self.pieces(offset, buffer.len() as u64);
        let checked = self.metadata.chunk_checksums;
        let chunk_size = self.metadata.chunk_size_bytes;
        let results: Vec<PieceRead> = self.runtime.block_on(
            stream::iter(pieces.into_iter().map(|piece| {
                let store = self.store.clone();
                let key = self.chunk_key(piece.chunk);
                let absent = self.known_absent(piece.chunk);
                async move {
                    if absent {
                        return Ok((piece.buffer, None));
                    }
                    if !checked {
                        let data = get_range(&store, &key, piece.within.clone()).await?;
                        return Ok((piece.buffer, data));
                    }
                    // The whole blocks around the piece with their checksums, one ranged GET.
                    let stored = blocks::stored_range(piece.within.clone());
                    let Some(fetched) = get_range(&store, &key, stored.clone()).await? else {
                        return Ok((piece.buffer, None));
                    };
                    let mut data = vec![0u8; (piece.within.end - piece.within.start) as usize];
                    blocks::decode_range(
                        &fetched,
                        piece.within.clone(),
                        blocks::Place {
                            object_offset: 0,
                            disk_offset: piece.chunk * chunk_size,
                        },
                        &mut data,
                    )
                    .map_err(|reason| StoreError::BadData {
                        key: key.clone(),
                        reason: Box::new(reason),
                    })?;
                    Ok((piece.buffer, Some(Bytes::from(data))))
                }
            }))
            .buffer_unordered(self.requests_in_flight_max)
            .collect(),
        );
        for result in results {
            let (range, data) = result?;
            match data {
                Some(data) => buffer[range].copy_from_slice(&data),
                None => buffer[range].fill(0),
            }
        }
        Ok(())
    }

    /// Writes `data` at `offset` and returns once the store acknowledged every request.
    pub fn write(&self, data: Bytes, offset: u64) -> Result<(), StoreError> {
        self.check_range(offset, data.len() as u64)?;
        let length = data.len() as u64;
        self.modify(offset, length, Some(data))
    }

    /// Zeroes `length` bytes at `offset`: whole chunks are deleted, partial ones rewritten.
    pub fn write_zeroes(&self, offset: u64, length: u64) -> Result<(), StoreError> {
        self.check_range(offset, length)?;
        self.modify(offset, length, None)
    }

    /// Writes `data` (or zeroes when None) over `length` bytes at `offset`.
    fn modify(&self, offset: u64, length: u64, data: Option<Bytes>) -> Result<(), StoreError> {
        self.modify_batch(vec![(offset, length, data)])
            .pop()
            .expect("one outcome per write")
    }

    /// Writes each `(data, offset)` as [`ChunkStore::write`] would, with the chunk requests of
    /// every write in flight together (at most `requests_in_flight_max` at a time), and
    /// returns one outcome per write, in order. Writes of one batch do not overlap; two that
    /// touch one chunk are merged into it one after the other under its lock.
    pub fn write_batch(&self, writes: Vec<(Bytes, u64)>) -> Vec<Result<(), StoreError>> {
        let mut outcomes: Vec<Option<Result<(), StoreError>>> = Vec::with_capacity(writes.len());
        let mut valid = Vec::with_capacity(writes.len());
        for (index, (data, offset)) in writes.into_iter().enumerate() {
            match self.check_range(offset, data.len() as u64) {
                Ok(()) => {
                    outcomes.push(None);
                    valid.push((index, offset, data.len() as u64, Some(data)));
                }
                Err(error) => outcomes.push(Some(Err(error))),
            }
        }
        let indexes: Vec<usize> = valid.iter().map(|&(index, ..)| index).collect();
        let results = self.modify_batch(
            valid
                .into_iter()
                .map(|(_, offset, length, data)| (offset, length, data))
                .collect(),
        );
        for (index, result) in indexes.into_iter().zip(results) {
            outcomes[index] = Some(result);
        }
        outcomes
            .into_iter()
            .map(|outcome| outcome.expect("every write has an outcome"))
            .collect()
    }

    /// Applies each `(offset, length, data or zeroes)`, every chunk request of the batch in
    /// flight together; one outcome per write, its first failed request's error.
    fn modify_batch(&self, writes: Vec<(u64, u64, Option<Bytes>)>) -> Vec<Result<(), StoreError>> {
        if let Some(read_only) = &self.read_only {
            return writes
                .iter()
                .map(|_| {
                    Err(StoreError::ReadOnly {
                        url: self.url.to_string(),
                        reason: read_only.to_string(),
                    })
                })
                .collect();
        }
        // Every piece of one chunk, in batch order: one read-modify-write per chunk however
        // many runs of the batch touch it.
        let mut chunks: BTreeMap<u64, ChunkEdits> = BTreeMap::new();
        for (write, (offset, length, data)) in writes.iter().enumerate() {
            for piece in self.pieces(*offset, *length) {
                let source = data.as_ref().map(|data| data.slice(piece.buffer.clone()));
                let edits = chunks.entry(piece.chunk).or_default();
                edits.writes.push(write);
                edits.edits.push((piece.within, source));
            }
        }
        let outcomes: Vec<(Vec<usize>, Result<(), StoreError>)> = self.runtime.block_on(
            stream::iter(chunks.into_iter().map(|(chunk, edits)| {
                let request = self.modify_chunk(chunk, edits.edits);
                async move { (edits.writes, request.await) }
            }))
            .buffer_unordered(self.requests_in_flight_max)
            .collect(),
        );
        // Every request ran to completion (success or error) before any outcome is reported,
        // so no request is still in flight when the caller sees the result.
        let mut results: Vec<Result<(), StoreError>> = writes.iter().map(|_| Ok(())).collect();
        for (chunk_writes, outcome) in outcomes {
            if let Err(error) = outcome {
                for write in chunk_writes {
                    if results[write].is_ok() {
                        results[write] = Err(error.clone());
                    }
                }
            }
        }
        results
    }

    /// One chunk's part of a batch: the edits (byte range inside the chunk, and the bytes or
    /// zeroes) applied in order. A PUT of the whole chunk when the edits cover it; otherwise
    /// one GET, the merge, one PUT; a DELETE when the result would be all zeroes.
    fn modify_chunk(
        &self,
        chunk_index: u64,
        edits: Vec<(Range<u64>, Option<Bytes>)>,
    ) -> impl std::future::Future<Output = Result<(), StoreError>> {
        let chunk_size = self.metadata.chunk_size_bytes;
        let checked = self.metadata.chunk_checksums;
        let store = self.store.clone();
        let key = self.chunk_key(chunk_index);
        let locks = self.chunk_locks.clone();
        let stored = self.stored.clone();
        async move {
            // Serialises read-modify-write of one chunk against any other write of it.
            let _guard = locks[(chunk_index as usize) % locks.len()].lock().await;
            let covered = covers(chunk_size, edits.iter().map(|(within, _)| within.clone()));
            let absent = stored
                .as_ref()
                .is_some_and(|set| !set.contains(chunk_index));
            let old = if covered || absent {
                None
            } else {
                tracing::debug!(
                    chunk = chunk_index,
                    edits = edits.len(),
                    "partial chunk write: read, merge, write"
                );
                let stored_size = if checked {
                    blocks::stored_bytes(chunk_size)
                } else {
                    chunk_size
                };
                get_range(&store, &key, 0..stored_size).await?
            };
            let mut merged = match old {
                // A damaged chunk is an error: merging into it would store the damage
                // under fresh checksums.
                Some(old) if checked => blocks::decode(
                    &old,
                    chunk_size,
                    blocks::Place {
                        object_offset: 0,
                        disk_offset: chunk_index * chunk_size,
                    },
                )
                .map_err(|reason| StoreError::BadData {
                    key: key.clone(),
                    reason: Box::new(reason),
                })?,
                Some(old) => old.to_vec(),
                None => vec![0u8; chunk_size as usize],
            };
            for (within, source) in edits {
                let target = &mut merged[within.start as usize..within.end as usize];
                match source {
                    Some(source) => target.copy_from_slice(&source),
                    None => target.fill(0),
                }
            }
            if merged.iter().all(|&byte| byte == 0) {
                if absent {
                    return Ok(()); // nothing stored: already reads as zeroes
                }
                store
                    .delete(&ObjectPath::from(key.as_str()))
                    .await
                    .map_err(|error| request_failed("DELETE", &key, error))?;
                if let Some(set) = &stored {
                    set.remove(chunk_index);
                }
                Ok(())
            } else {
                // Marked before the PUT: a failed PUT may still have stored it.
                if let Some(set) = &stored {
                    set.insert(chunk_index);
                }
                let body = if checked {
                    blocks::encode(&merged)
                } else {
                    Bytes::from(merged)
                };
                store
                    .put(&ObjectPath::from(key.as_str()), PutPayload::from(body))
                    .await
                    .map(|_| ())
                    .map_err(|error| request_failed("PUT", &key, error))
            }
        }
    }

    /// True when chunk `index` is known not to be stored (reads as zeroes without a GET).
    fn known_absent(&self, index: u64) -> bool {
        self.stored.as_ref().is_some_and(|set| !set.contains(index))
    }

    /// The runs of `[offset, offset + length)` in disk order as (length, stored): a run of
    /// chunks not stored (never written, or zeroed whole) reads as zeroes. Known only while
    /// this store holds the disk lock (the chunk set listed at open and kept up to date);
    /// otherwise one stored run, without a request.
    pub fn stored_runs(&self, offset: u64, length: u64) -> Vec<(u64, bool)> {
        let Some(set) = &self.stored else {
            return vec![(length, true)];
        };
        let chunk_size = self.metadata.chunk_size_bytes;
        let end = offset + length;
        let mut runs: Vec<(u64, bool)> = Vec::new();
        let mut position = offset;
        while position < end {
            let chunk = position / chunk_size;
            let piece_end = ((chunk + 1) * chunk_size).min(end);
            let stored = set.contains(chunk);
            match runs.last_mut() {
                Some((run_length, run_stored)) if *run_stored == stored => {
                    *run_length += piece_end - position
                }
                _ => runs.push((piece_end - position, stored)),
            }
            position = piece_end;
        }
        runs
    }

    /// Number of chunk objects stored and their total bytes (one LIST walk).
    pub fn stored_chunks(&self) -> Result<(u64, u64), StoreError> {
        let prefix = ObjectPath::from(self.url.key("chunks").as_str());
        self.runtime.block_on(async {
            let objects: Vec<_> = self
                .store
                .list(Some(&prefix))
                .try_collect()
                .await
                .map_err(|error| request_failed("LIST", prefix.as_ref(), error))?;
            Ok((
                objects.len() as u64,
                objects.iter().map(|object| object.size).sum(),
            ))
        })
    }
}

/// A ranged GET; None when the object does not exist (a chunk never written or all zeroes).
pub(crate) async fn get_range(
    store: &AmazonS3,
    key: &str,
    range: Range<u64>,
) -> Result<Option<Bytes>, StoreError> {
    get_range_in(store, key, range).await
}

/// [`get_range`] through any store (the log layout takes its store as a trait object).
pub(crate) async fn get_range_in(
    store: &dyn ObjectStore,
    key: &str,
    range: Range<u64>,
) -> Result<Option<Bytes>, StoreError> {
    let expected = (range.end - range.start) as usize;
    match store.get_range(&ObjectPath::from(key), range).await {
        Ok(data) if data.len() == expected => Ok(Some(data)),
        Ok(data) => Err(StoreError::ShortObject {
            key: key.to_string(),
            found: data.len(),
            expected,
        }),
        Err(object_store::Error::NotFound { .. }) => Ok(None),
        Err(error) => Err(request_failed("GET", key, error)),
    }
}

/// The metadata of a new log-layout disk of `size_bytes` with the URL's seal parameters, and
/// its object's JSON (created with a create-only PUT by the caller).
pub(crate) fn new_log_metadata(
    url: &S3Url,
    size_bytes: u64,
) -> Result<(DiskMetadata, serde_json::Value), OpenError> {
    if url.chunk_size_bytes.is_some() {
        return Err(OpenError::Mismatch {
            url: url.to_string(),
            parameter: "chunk-size",
            given: "a chunk size".to_string(),
            stored: "none: a new disk gets `layout=log` (segments, not chunks) unless `layout=chunk` is given".to_string(),
        });
    }
    let disk_id = random_id();
    let seal = SealParameters::for_new_disk(url, disk_id).map_err(|error| OpenError::Config {
        url: url.to_string(),
        reason: error.to_string(),
    })?;
    let metadata = DiskMetadata {
        size_bytes,
        chunk_size_bytes: 0,
        chunk_checksums: false,
        format_version: FORMAT_VERSION_LOG,
        layout: LayoutKind::Log,
        disk_id,
        generation: 0,
        seal,
    };
    let mut body = json!({
        "format": "bufcache-s3",
        "format_version": FORMAT_VERSION_LOG,
        "layout": "log",
        "disk_id": format!("{disk_id:016x}"),
        "generation": 0,
        "size_bytes": size_bytes,
    });
    seal.write_json(&mut body);
    Ok((metadata, body))
}

/// Stores a new disk's metadata object create-only (`If-None-Match: *`): Ok(false) when an
/// object is there already, which is left as it was.
pub(crate) async fn create_metadata(
    store: &dyn ObjectStore,
    url: &S3Url,
    metadata: &DiskMetadata,
    body: &serde_json::Value,
) -> Result<bool, OpenError> {
    let key = url.key(METADATA_NAME);
    let mut body = body.clone();
    seal_metadata(url, metadata, &mut body)?;
    match store
        .put_opts(
            &ObjectPath::from(key.as_str()),
            PutPayload::from(body.to_string().into_bytes()),
            PutOptions {
                mode: PutMode::Create,
                ..Default::default()
            },
        )
        .await
    {
        Ok(_) => Ok(true),
        Err(
            object_store::Error::AlreadyExists { .. } | object_store::Error::Precondition { .. },
        ) => Ok(false),
        Err(error) => Err(OpenError::Request {
            url: url.to_string(),
            operation: format!("creating `{key}`"),
            message: chain(&error),
        }),
    }
}

/// The metadata object's JSON, as stored (for the fields [`DiskMetadata`] does not hold),
/// authenticated as [`authenticate_metadata`] does.
pub(crate) async fn read_metadata_json(
    store: &dyn ObjectStore,
    url: &S3Url,
) -> Result<serde_json::Value, OpenError> {
    let key = url.key(METADATA_NAME);
    let body = get_optional(store, url, &key, &format!("`{key}`"))
        .await?
        .ok_or_else(|| OpenError::NoDisk {
            url: url.to_string(),
            key: key.clone(),
        })?;
    Ok(authenticate_metadata(url, &body)?.value)
}

/// A metadata object as read: its JSON, what it records, and what its tag proved.
pub(crate) struct LoadedMetadata {
    pub value: serde_json::Value,
    pub metadata: DiskMetadata,
    pub tag: MetadataTag,
}

/// Parses the metadata object `body` and, for an encrypted disk opened with a key file,
/// proves the key (its key check) and checks the object's tag before anything it records is
/// used: a metadata object changed by someone without the key (its size, compression, a
/// clone's base, its key check's kind) is refused naming it. Without a key file nothing can
/// be checked ([`MetadataTag::Unchecked`]): every open that reads data refuses then
/// ([`Sealer::open`]), so only what `bufcache disk info` shows is unproven.
pub(crate) fn authenticate_metadata(url: &S3Url, body: &[u8]) -> Result<LoadedMetadata, OpenError> {
    let key = url.key(METADATA_NAME);
    let bad = |reason: DecodeError| OpenError::BadMetadata {
        url: url.to_string(),
        key: key.clone(),
        reason,
    };
    let value: serde_json::Value = serde_json::from_slice(body)
        .map_err(|error| bad(DecodeError::NotJson(error.to_string())))?;
    let metadata = parse_metadata_value(&value).map_err(bad)?;
    let tag = if metadata.seal.key_check.is_none() {
        MetadataTag::Unencrypted
    } else if url.key_file.is_none() {
        MetadataTag::Unchecked
    } else {
        Sealer::open_keyed(url, metadata.disk_id, metadata.seal)?
            .check_metadata(&value)
            .map_err(|reason| OpenError::ForgedMetadata {
                url: url.to_string(),
                key: key.clone(),
                reason,
            })?
    };
    Ok(LoadedMetadata {
        value,
        metadata,
        tag,
    })
}

/// Tags the metadata object `value` of the disk `metadata` describes before it is stored
/// (nothing for an unencrypted disk): every writer of the metadata object calls this. An
/// encrypted disk needs the URL's key file (proven by its key check); one whose metadata
/// predated tags gets the kind of key check that says it carries one, which is logged.
pub(crate) fn seal_metadata(
    url: &S3Url,
    metadata: &DiskMetadata,
    value: &mut serde_json::Value,
) -> Result<(), OpenError> {
    if metadata.seal.key_check.is_none() {
        return Ok(());
    }
    let sealer = Sealer::open_keyed(url, metadata.disk_id, metadata.seal)?;
    if sealer.tag_metadata(value) {
        tracing::warn!(
            disk = %url,
            size_bytes = metadata.size_bytes,
            compress = metadata.seal.compression.name(),
            "the metadata object `{}` of this encrypted disk carried no tag (written before metadata tags existed): tagged now as found, with the size and compression shown; from now on a change made without the key is refused",
            url.key(METADATA_NAME)
        );
    }
    Ok(())
}

/// A stored metadata object's body, parsed and checked against the URL.
fn parse_checked(url: &S3Url, key: &str, body: &[u8]) -> Result<DiskMetadata, OpenError> {
    let loaded = authenticate_metadata(url, body)?;
    if loaded.tag == MetadataTag::UntaggedBeforeTags {
        tracing::warn!(
            disk = %url,
            size_bytes = loaded.metadata.size_bytes,
            compress = loaded.metadata.seal.compression.name(),
            "the metadata object `{key}` of this encrypted disk carries no tag (written before metadata tags existed): accepted as found, with the size and compression shown; the next writable open tags it"
        );
    }
    check_metadata(url, &loaded.metadata)?;
    Ok(loaded.metadata)
}

/// The field of the metadata object that marks a disk a `disk delete` is deleting (set
/// before it looks for clone records the last time, module `admin`): a clone of it is
/// refused. Servers ignore it.
const DELETING_FIELD: &str = "deleting";

/// Reads the metadata of the disk `url` names (an existing one) and whether it is marked as
/// being deleted ([`DELETING_FIELD`]): one GET.
pub(crate) async fn read_metadata_marked(
    store: &dyn ObjectStore,
    url: &S3Url,
) -> Result<(DiskMetadata, bool), OpenError> {
    let key = url.key(METADATA_NAME);
    let body = get_optional(store, url, &key, &format!("`{key}`"))
        .await?
        .ok_or_else(|| OpenError::NoDiskReadOnly {
            url: url.to_string(),
            key: key.clone(),
        })?;
    let metadata = parse_checked(url, &key, &body)?;
    let value: serde_json::Value =
        serde_json::from_slice(&body).expect("parse_metadata parsed it as JSON");
    Ok((
        metadata,
        value[DELETING_FIELD] == serde_json::Value::Bool(true),
    ))
}

/// Marks the disk as being deleted, or takes the mark off ([`DELETING_FIELD`]), keeping
/// every other field as stored: a GET and a PUT. The metadata's tag does not cover the mark
/// (`seal::UNTAGGED_METADATA_FIELDS`), so the tag is the same before and after.
pub(crate) async fn write_deleting(
    store: &dyn ObjectStore,
    url: &S3Url,
    deleting: bool,
) -> Result<(), OpenError> {
    rewrite_metadata(store, url, |value, _| {
        if deleting {
            value[DELETING_FIELD] = serde_json::Value::Bool(true);
        } else if let Some(fields) = value.as_object_mut() {
            fields.remove(DELETING_FIELD);
        }
    })
    .await
}

#[cfg(test)]
fn parse_metadata(body: &[u8]) -> Result<DiskMetadata, DecodeError> {
    let value: serde_json::Value =
        serde_json::from_slice(body).map_err(|error| DecodeError::NotJson(error.to_string()))?;
    parse_metadata_value(&value)
}

fn parse_metadata_value(value: &serde_json::Value) -> Result<DiskMetadata, DecodeError> {
    if value["format"] != "bufcache-s3" {
        return Err(DecodeError::Inconsistent(
            "field `format` is not \"bufcache-s3\"".to_string(),
        ));
    }
    let field = |name: &str| {
        value[name].as_u64().ok_or_else(|| {
            DecodeError::Inconsistent(format!("field `{name}` is missing or not a whole number"))
        })
    };
    let format_version = field("format_version")?;
    let size_bytes = field("size_bytes")?;
    let generation = match &value["generation"] {
        serde_json::Value::Null => 0,
        other => other.as_u64().ok_or(DecodeError::Inconsistent(
            "field `generation` is not a whole number".to_string(),
        ))?,
    };
    let disk_id = match &value["disk_id"] {
        serde_json::Value::Null => None,
        other => Some(
            other
                .as_str()
                .filter(|text| text.len() == 16)
                .and_then(|text| u64::from_str_radix(text, 16).ok())
                .ok_or(DecodeError::Inconsistent(
                    "field `disk_id` is not 16 hex digits".to_string(),
                ))?,
        ),
    };
    match format_version {
        FORMAT_VERSION | FORMAT_VERSION_CHUNK_CHECKED => {
            let chunk_checksums = format_version == FORMAT_VERSION_CHUNK_CHECKED;
            if chunk_checksums && value["chunk_checksums"] != CHUNK_CHECKSUMS_NAME {
                return Err(DecodeError::Inconsistent(format!(
                    "field `chunk_checksums` is not \"{CHUNK_CHECKSUMS_NAME}\" (the only supported one for format version {FORMAT_VERSION_CHUNK_CHECKED})"
                )));
            }
            let metadata = DiskMetadata {
                format_version,
                size_bytes,
                chunk_size_bytes: field("chunk_size_bytes")?,
                chunk_checksums,
                layout: LayoutKind::Chunk,
                disk_id: disk_id.unwrap_or(0),
                generation,
                seal: SealParameters::default(),
            };
            if !metadata.chunk_size_bytes.is_power_of_two()
                || !metadata
                    .size_bytes
                    .is_multiple_of(metadata.chunk_size_bytes)
            {
                return Err(DecodeError::Inconsistent("chunk size is not a power of two dividing the size".to_string()));
            }
            Ok(metadata)
        }
        FORMAT_VERSION_LOG | FORMAT_VERSION_LOG_CLONE => {
            if format_version == FORMAT_VERSION_LOG_CLONE && !value["base"].is_object() {
                return Err(DecodeError::Inconsistent(format!(
                    "format version {FORMAT_VERSION_LOG_CLONE} (a clone) without the object `base`"
                )));
            }
            if value["layout"] != "log" {
                return Err(DecodeError::Inconsistent("field `layout` is not \"log\"".to_string()));
            }
            let disk_id = disk_id.ok_or(DecodeError::Inconsistent("field `disk_id` is missing or not hex digits".to_string()))?;
            if size_bytes == 0 {
                return Err(DecodeError::Inconsistent("field `size_bytes` is 0".to_string()));
            }
            Ok(DiskMetadata {
                format_version,
                size_bytes,
                chunk_size_bytes: 0,
                chunk_checksums: false,
                layout: LayoutKind::Log,
                disk_id,
                generation,
                seal: SealParameters::read_json(value)?,
            })
        }
        other => Err(DecodeError::Inconsistent(format!(
            "format version {other} is not one of the supported {FORMAT_VERSION} and {FORMAT_VERSION_CHUNK_CHECKED} (chunk layout) and {FORMAT_VERSION_LOG} and {FORMAT_VERSION_LOG_CLONE} (log layout, a clone)"
        ))),
    }
}

/// Refuses `key-file=` and `compress=` for a chunk-layout disk, which has neither.
fn check_no_seal_parameters(url: &S3Url) -> Result<(), OpenError> {
    if url.key_file.is_some() || url.compression.is_some() {
        return Err(OpenError::Config {
            url: url.to_string(),
            reason: "key-file= and compress= apply to log-layout disks only; this is a chunk-layout disk".to_string(),
        });
    }
    Ok(())
}

fn check_metadata(url: &S3Url, stored: &DiskMetadata) -> Result<(), OpenError> {
    if stored.layout == LayoutKind::Chunk {
        check_no_seal_parameters(url)?;
    }
    if let Some(given) = url.layout {
        if given != stored.layout {
            return Err(OpenError::Mismatch {
                url: url.to_string(),
                parameter: "layout",
                given: given.name().to_string(),
                stored: stored.layout.name().to_string(),
            });
        }
    }
    if let Some(given) = url.chunk_size_bytes {
        if given != stored.chunk_size_bytes {
            return Err(OpenError::Mismatch {
                url: url.to_string(),
                parameter: "chunk-size",
                given: bufcache_device::size::format_size(given),
                stored: bufcache_device::size::format_size(stored.chunk_size_bytes),
            });
        }
    }
    if let Some(given) = url.create_size_bytes {
        if given != stored.size_bytes {
            return Err(OpenError::Mismatch {
                url: url.to_string(),
                parameter: "create-size",
                given: bufcache_device::size::format_size(given),
                stored: bufcache_device::size::format_size(stored.size_bytes),
            });
        }
    }
    Ok(())
}

/// Every object under `folder` of the disk at `url` (one LIST, paged by the client), in the
/// store's order; a failed LIST is an error naming the prefix.
pub(crate) async fn list_folder(
    store: &dyn ObjectStore,
    url: &S3Url,
    folder: &str,
) -> Result<Vec<object_store::ObjectMeta>, OpenError> {
    let prefix = ObjectPath::from(url.key(folder).as_str());
    store
        .list(Some(&prefix))
        .try_collect()
        .await
        .map_err(|error| OpenError::Request {
            url: url.to_string(),
            operation: format!("listing `{prefix}`"),
            message: chain(&error),
        })
}

/// The whole object `key`, or None when the store has none; `what` names it in an error
/// ("snapshot `KEY`").
pub(crate) async fn get_optional(
    store: &dyn ObjectStore,
    url: &S3Url,
    key: &str,
    what: &str,
) -> Result<Option<Bytes>, OpenError> {
    let body = match store.get(&ObjectPath::from(key)).await {
        Ok(result) => result.bytes().await,
        Err(object_store::Error::NotFound { .. }) => return Ok(None),
        Err(error) => Err(error),
    };
    body.map(Some).map_err(|error| OpenError::Request {
        url: url.to_string(),
        operation: format!("reading {what}"),
        message: chain(&error),
    })
}

/// A log-layout disk's size is a whole number of these (the local tier's and most clients'
/// block).
const LOG_SIZE_UNIT_BYTES: u64 = 4096;

pub(crate) fn check_new_size(
    url: &S3Url,
    metadata: &DiskMetadata,
    size_bytes: u64,
) -> Result<(), OpenError> {
    let unit = match metadata.layout {
        LayoutKind::Chunk => metadata.chunk_size_bytes,
        LayoutKind::Log => LOG_SIZE_UNIT_BYTES,
    };
    if size_bytes == 0 || !size_bytes.is_multiple_of(unit) {
        return Err(OpenError::Config {
            url: url.to_string(),
            reason: format!(
                "new size {size_bytes} is not a positive multiple of {unit} bytes (the disk's {}): nothing was changed",
                match metadata.layout {
                    LayoutKind::Chunk => "chunk size",
                    LayoutKind::Log => "block size",
                }
            ),
        });
    }
    Ok(())
}

/// Rewrites `size_bytes` in the metadata object, keeping every other field as stored.
pub(crate) async fn write_size(
    store: &dyn ObjectStore,
    url: &S3Url,
    size_bytes: u64,
) -> Result<(), OpenError> {
    rewrite_metadata(store, url, |value, metadata| {
        value["size_bytes"] = serde_json::json!(size_bytes);
        metadata.size_bytes = size_bytes;
    })
    .await
}

/// Rewrites the metadata object with its tag, keeping every field as stored: what the first
/// writable open of an encrypted disk whose metadata predates tags does (its key check
/// proved the key; see [`seal_metadata`]).
pub(crate) async fn tag_untagged_metadata(
    store: &dyn ObjectStore,
    url: &S3Url,
) -> Result<(), OpenError> {
    rewrite_metadata(store, url, |_, _| {}).await
}

/// Reads and authenticates the metadata object, applies `change` to its JSON (and to what
/// it records), tags it and stores it. Called under the disk lock, so nobody else writes it.
async fn rewrite_metadata(
    store: &dyn ObjectStore,
    url: &S3Url,
    change: impl FnOnce(&mut serde_json::Value, &mut DiskMetadata),
) -> Result<(), OpenError> {
    let key = url.key(METADATA_NAME);
    let location = ObjectPath::from(key.as_str());
    let request_error = |operation: String, error: object_store::Error| OpenError::Request {
        url: url.to_string(),
        operation,
        message: chain(&error),
    };
    let body = store
        .get(&location)
        .await
        .map_err(|error| request_error(format!("reading `{key}`"), error))?
        .bytes()
        .await
        .map_err(|error| request_error(format!("reading `{key}`"), error))?;
    let LoadedMetadata {
        mut value,
        mut metadata,
        ..
    } = authenticate_metadata(url, &body)?;
    change(&mut value, &mut metadata);
    seal_metadata(url, &metadata, &mut value)?;
    store
        .put(&location, PutPayload::from(value.to_string().into_bytes()))
        .await
        .map_err(|error| request_error(format!("writing `{key}`"), error))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: a metadata object from another tool or version is refused, not misread. Method:
    // parse good and bad bodies.
    #[test]
    fn metadata_of_another_format_or_version_is_refused() {
        let good = br#"{"format":"bufcache-s3","format_version":1,"size_bytes":8388608,"chunk_size_bytes":4194304}"#;
        assert_eq!(
            parse_metadata(good).unwrap(),
            DiskMetadata {
                size_bytes: 8 << 20,
                chunk_size_bytes: 4 << 20,
                chunk_checksums: false,
                format_version: 1,
                layout: LayoutKind::Chunk,
                disk_id: 0,
                generation: 0,
                seal: SealParameters::default(),
            }
        );
        let version = br#"{"format":"bufcache-s3","format_version":5,"size_bytes":8388608,"chunk_size_bytes":4194304}"#;
        assert!(parse_metadata(version)
            .unwrap_err()
            .to_string()
            .contains("format version 5"));
        let checked = br#"{"format":"bufcache-s3","format_version":3,"size_bytes":8388608,"chunk_size_bytes":4194304,"chunk_checksums":"crc32-4k"}"#;
        assert!(parse_metadata(checked).unwrap().chunk_checksums);
        let unknown_checksums = br#"{"format":"bufcache-s3","format_version":3,"size_bytes":8388608,"chunk_size_bytes":4194304,"chunk_checksums":"sha256"}"#;
        assert!(parse_metadata(unknown_checksums)
            .unwrap_err()
            .to_string()
            .contains("chunk_checksums"));
        let log = br#"{"format":"bufcache-s3","format_version":2,"layout":"log","disk_id":"00000000000000ab","size_bytes":8388608}"#;
        let parsed = parse_metadata(log).unwrap();
        assert_eq!((parsed.layout, parsed.disk_id), (LayoutKind::Log, 0xab));
        let no_id =
            br#"{"format":"bufcache-s3","format_version":2,"layout":"log","size_bytes":8388608}"#;
        assert!(parse_metadata(no_id)
            .unwrap_err()
            .to_string()
            .contains("disk_id"));
        let odd = br#"{"format":"bufcache-s3","format_version":1,"size_bytes":100,"chunk_size_bytes":4194304}"#;
        assert!(parse_metadata(odd).is_err());
        assert!(parse_metadata(b"{}")
            .unwrap_err()
            .to_string()
            .contains("format"));
        assert!(parse_metadata(b"garbage")
            .unwrap_err()
            .to_string()
            .contains("JSON"));
    }
}
