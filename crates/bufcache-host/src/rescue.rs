//! The rescue file: dirty data that could not be written back by the end of a shutdown.
//!
//! `bufcache serve` owns acknowledged data until it is on the backend. When the shutdown
//! timeout expires (or a second signal arrives) with data still dirty, that data is saved here
//! instead of being dropped, and the next `bufcache serve` on the same backend replays it (and
//! flushes) before accepting clients, or discards it when told `--rescue discard`.
//!
//! This module is the one implementation of the file and of the rule deciding whether it may
//! be replayed ([`check_saved`]): the server (`bufcache-cli`) and the simulator's checker
//! (`bufcache sim check`, which keeps its files in memory through [`encode`] and [`decode`])
//! both call it, so the checker checks the rule the server runs.
//!
//! A rescue file belongs to the backends it was saved from. By default each export has its own
//! file, named after its backend's name and export name ([`default_path`]); a server holds
//! an exclusive lock ([`RescueLock`]) on every rescue file it may write for as long as it runs,
//! so a second server on the same backend refuses to start rather than share (or rename over)
//! the first one's file. The header records each backend's identity, name, size, block size
//! and state; replay into any other backend is refused naming both, and replay into a disk
//! that moved on since the file was saved (another server opened it and may have written
//! newer data) is refused unless asked for with `--rescue force`.
//!
//! Format (all integers little-endian):
//!
//! ```text
//! file    = magic header record*
//! magic   = "BUFCACHE-RESCUE3" (16 bytes)
//! header  = count:u32 backend*count crc:u32
//! backend = text(export) text(identity) text(name) size:u64 block_size:u32
//!           has_state:u8 state:u64
//! text    = length:u32 bytes:[u8; length]
//! record  = name_len:u32 name:[u8; name_len] offset:u64 data_len:u32 data:[u8; data_len] crc:u32
//! ```
//!
//! `export` is the export name (UTF-8, empty for the default export); `identity` names the
//! backend itself (`s3-disk:<id>`, the id the disk's metadata object records;
//! `file:/absolute/path`; an `nbd://` URI without secrets or options), `name` is how it was
//! reached (`s3://BUCKET/PREFIX`, the same as the identity for the others) and names the
//! default file; `state` (when `has_state` is 1) is the disk's generation the saving server
//! held, which any later writable open raises. `offset` is the byte offset in the export, and
//! each `crc` is the CRC-32 (IEEE) of every byte of the header or record before it. Files of
//! the second format (`BUFCACHE-RESCUE2`: no name, no state) are still read, their identity
//! being the URL as older servers wrote it; files of the first format (`BUFCACHE-RESCUE1`, no
//! header) carry no identity, so they are replayed only when named with `--rescue-file`. The
//! file is written beside its final path, fsynced, renamed into place and its directory
//! fsynced, so a crash while writing it leaves the previous state, never a torn file.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use thiserror::Error;

const MAGIC: &[u8; 16] = b"BUFCACHE-RESCUE3";
/// The second format: backends without a name or state.
const MAGIC_STATELESS: &[u8; 16] = b"BUFCACHE-RESCUE2";
const MAGIC_UNIDENTIFIED: &[u8; 16] = b"BUFCACHE-RESCUE1";
/// Most backends one rescue file describes (a server's exports); a larger count in a header
/// is damage, not a configuration.
const BACKENDS_MAX: usize = 4096;
/// Longest identity or export name kept in a header, in bytes.
const NAME_BYTES_MAX: usize = 64 << 10;
/// The rescue file every server used before files were derived from the backend: found at
/// start it is refused until the operator says whose it is.
pub const LEGACY_PATH: &str = "bufcache.rescue";

/// One saved extent of dirty data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The export the data belongs to (empty for the default export).
    pub export: String,
    /// Where it goes in the export, in bytes.
    pub offset: u64,
    /// The bytes.
    pub data: Vec<u8>,
}

/// The backend an export's rescued data belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backend {
    /// The export name (empty for the default export).
    pub export: String,
    /// What the backend is, independent of how it was spelled: `s3-disk:<id>`,
    /// `file:/absolute/path`, an NBD URI without secrets or options. (A file of the second
    /// format holds the URL older servers used instead.)
    pub identity: String,
    /// How the backend was reached, for the default file name and for messages
    /// (`s3://BUCKET/PREFIX`; the identity for the others); empty in a second-format file.
    pub name: String,
    /// The backend's size when the file was saved.
    pub size_bytes: u64,
    /// The export's block size when the file was saved.
    pub block_size_bytes: u32,
    /// The disk's generation the saving server held (S3 disks); None for backends that keep
    /// none, and in a second-format file.
    pub state: Option<u64>,
}

/// A rescue file's contents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Contents {
    /// The backends the data was saved from; None for a file of the first format.
    pub backends: Option<Vec<Backend>>,
    /// The saved data, in the order it is replayed.
    pub records: Vec<Record>,
}

/// Why a rescue file's errors happened: reading, writing or locking it failed, or its bytes
/// are damaged.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum RescueError {
    /// A file system call on the file (or its lock or directory) failed.
    #[error("{action} {}", path.display())]
    Io {
        /// What was being done, with the kind of file: "reading rescue file".
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },
    /// The file's bytes are not a rescue file, or are damaged.
    #[error("rescue file {}", path.display())]
    Damaged {
        /// The file.
        path: PathBuf,
        /// What is wrong, where.
        #[source]
        damage: Damage,
    },
    /// Another process holds the file's lock.
    #[error(
        "rescue file {} ({what}) is locked by another bufcache serve ({holder}) on the same \
         backend: stop that server first, or give this one its own --rescue-file",
        path.display()
    )]
    Locked {
        /// The rescue file.
        path: PathBuf,
        /// Whose file it is (the backends), for the message.
        what: String,
        /// `pid N`, or "another process" when the lock file does not say.
        holder: String,
    },
    /// The lock file was deleted and made again every time it was locked.
    #[error("rescue lock file {} keeps being replaced by another process", path.display())]
    LockReplaced {
        /// The lock file.
        path: PathBuf,
    },
}

/// What is wrong with a rescue file's bytes.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{0}")]
pub struct Damage(pub String);

fn io_error(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> RescueError {
    let path = path.to_path_buf();
    move |source| RescueError::Io {
        action,
        path,
        source,
    }
}

/// Which disk a backend is, and how far it has moved on: what a rescue file's (or a local
/// cache's) record of its backend is compared with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackendIdentity {
    /// The disk itself: `s3-disk:<id>` (the id its metadata object records),
    /// `file-disk:<id>` (the id the file's extended attribute records; `file:/absolute/path`
    /// where the file system keeps none), an NBD URI without its query (but `socket=`).
    pub identity: String,
    /// How it was reached, without any parameter that only says how to open it:
    /// `s3://BUCKET/PREFIX`; the identity for the others. Names the default rescue file.
    pub name: String,
    /// The disk's generation this server holds (S3 disks: raised by every writable open);
    /// None for backends that keep none.
    pub state: Option<u64>,
}

/// The identity of a backend named by an NBD URI: the URI without its query, but for
/// `socket=` (where a unix-socket server listens). The other parameters carry secrets (an
/// identity is written into rescue files in the clear) or say only how the server is reached
/// (TLS files and names), and none of them changes which disk it is.
pub fn identity_of_url(url: &str) -> String {
    let Some((base, query)) = url.split_once('?') else {
        return url.to_string();
    };
    let kept: Vec<&str> = query
        .split('&')
        .filter(|pair| {
            pair.split('=')
                .next()
                .unwrap_or_default()
                .eq_ignore_ascii_case("socket")
        })
        .collect();
    if kept.is_empty() {
        base.to_string()
    } else {
        format!("{base}?{}", kept.join("&"))
    }
}

/// The disk name in an S3 URL (as older servers recorded it as an identity, with its
/// parameters but secrets): `s3://BUCKET/PREFIX`, every parameter left out. None when it is
/// not an `s3://` URL.
pub fn s3_name_of_url(url: &str) -> Option<String> {
    let rest = url.strip_prefix("s3://")?;
    let location = rest.split('?').next().unwrap_or_default();
    let (bucket, prefix) = location.split_once('/').unwrap_or((location, ""));
    Some(format!("s3://{bucket}/{}", prefix.trim_matches('/')))
}

/// The extended attribute that holds a file backend's disk id (16 hex digits): it goes with
/// the file's inode, so another image put at the same path (a new file, or one moved or
/// restored there) does not carry it, and a rescue file or local cache of the old image is
/// refused.
pub const FILE_DISK_ID_ATTRIBUTE: &str = "user.bufcache.disk-id";

/// The identity of the file backend whose disk id is `id`: `file-disk:<16 hex digits>`.
pub fn file_disk_identity(id: u64) -> String {
    format!("file-disk:{id:016x}")
}

/// The disk id recorded on the file at `path`; None when it has none, or when its file
/// system keeps no user extended attributes (a block device node, some network file
/// systems): such a backend is named by its path.
pub fn read_file_disk_id(path: &Path) -> std::io::Result<Option<u64>> {
    let path_text = c_path(path)?;
    let name = std::ffi::CString::new(FILE_DISK_ID_ATTRIBUTE).expect("no NUL in the name");
    let mut value = [0u8; 32];
    // SAFETY: both strings are NUL-terminated and the buffer's length is passed with it.
    let length = unsafe {
        libc::getxattr(
            path_text.as_ptr(),
            name.as_ptr(),
            value.as_mut_ptr().cast(),
            value.len(),
        )
    };
    if length < 0 {
        let error = std::io::Error::last_os_error();
        return match error.raw_os_error() {
            Some(libc::ENODATA | libc::ENOTSUP | libc::EPERM | libc::ERANGE) => Ok(None),
            _ => Err(error),
        };
    }
    let text = std::str::from_utf8(&value[..length as usize]).unwrap_or_default();
    Ok((text.len() == 16)
        .then(|| u64::from_str_radix(text, 16).ok())
        .flatten()
        .filter(|id| *id != 0))
}

/// Records `id` as the disk id of the file at `path` (create-only: an id already there is
/// kept, and the error says so). Fails with ENOTSUP or EPERM where the file system keeps no
/// user extended attributes.
pub fn write_file_disk_id(path: &Path, id: u64) -> std::io::Result<()> {
    let path_text = c_path(path)?;
    let name = std::ffi::CString::new(FILE_DISK_ID_ATTRIBUTE).expect("no NUL in the name");
    let value = format!("{id:016x}");
    // SAFETY: both strings are NUL-terminated and the value's length is passed with it.
    let result = unsafe {
        libc::setxattr(
            path_text.as_ptr(),
            name.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            libc::XATTR_CREATE,
        )
    };
    if result < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn c_path(path: &Path) -> std::io::Result<std::ffi::CString> {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|_| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, "a NUL byte in the path")
    })
}

/// True when `recorded` (from a rescue file or a local cache, maybe written by an older
/// server that named backends by their URL) names the backend `ours`.
pub fn same_backend(recorded: &str, ours: &BackendIdentity) -> bool {
    if recorded == ours.identity {
        return true;
    }
    // Made before files carried a disk id: named by the file's path.
    if ours.identity.starts_with("file-disk:") {
        return recorded == ours.name;
    }
    if ours.identity.starts_with("s3-disk:") || ours.identity == ours.name {
        if let Some(name) = s3_name_of_url(recorded) {
            return name == ours.name;
        }
    }
    !recorded.starts_with("s3") && identity_of_url(recorded) == ours.identity
}

/// Why a rescue file's data for one backend may not be replayed into the backend a server
/// opened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// It was saved from another disk.
    OtherDisk,
    /// It was saved from this disk at another size.
    Resized {
        /// The size the file records.
        then_bytes: u64,
        /// The size now.
        now_bytes: u64,
    },
    /// The disk moved on since: another server opened it for writing (raising its
    /// generation) and may have written newer data over what the file holds.
    MovedOn {
        /// The generation the file records.
        then: u64,
        /// The generation now.
        now: u64,
    },
    /// The file records no generation (an older server saved it), and the disk keeps one:
    /// whether it moved on cannot be told.
    StateUnknown {
        /// The generation now.
        now: u64,
    },
}

/// Whether the data a rescue file saved from `saved` may be replayed into `ours` (of
/// `size_bytes` now, when known), before anything is written to it: the same disk, the same
/// size, and the disk not moved on since the file was saved — its generation the one the
/// saving server held — unless `force` (the operator says the file's data is the newest).
/// A disk that keeps no generation (a file, an NBD upstream) cannot tell, and is replayed.
pub fn check_saved(
    saved: &Backend,
    ours: &BackendIdentity,
    size_bytes: Option<u64>,
    force: bool,
) -> Result<(), Refusal> {
    if !same_backend(&saved.identity, ours) {
        return Err(Refusal::OtherDisk);
    }
    if let Some(now_bytes) = size_bytes.filter(|size| *size != saved.size_bytes) {
        return Err(Refusal::Resized {
            then_bytes: saved.size_bytes,
            now_bytes,
        });
    }
    let Some(now) = ours.state else {
        return Ok(());
    };
    let current = saved.state == Some(now);
    // Tests only: any recorded generation passes, so a stale file is replayed over newer
    // data; `sim check` must catch it (crates/bufcache-sim/tests/planted_rescue_defect.rs).
    #[cfg(feature = "planted-rescue-defect")]
    let current = current || saved.state.is_some();
    if current || force {
        return Ok(());
    }
    Err(match saved.state {
        Some(then) => Refusal::MovedOn { then, now },
        None => Refusal::StateUnknown { now },
    })
}

/// The default rescue file of an export, in the working directory: `bufcache-NAME-HASH.rescue`
/// where NAME is readable (the export name, or the backend's last path component) and HASH is a
/// 64-bit FNV-1a hash of the export name and the backend's name (`s3://BUCKET/PREFIX`,
/// `file:/absolute/path`, an NBD URI), so two backends never share one and no URL parameter
/// changes it.
pub fn default_path(export: &str, backend_name: &str) -> PathBuf {
    let identity = backend_name;
    let readable = if export.is_empty() {
        identity
            .trim_end_matches('/')
            .rsplit(['/', ':'])
            .next()
            .unwrap_or_default()
    } else {
        export
    };
    let readable: String = readable
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .take(40)
        .collect();
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in export.bytes().chain([0]).chain(identity.bytes()) {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    let readable = if readable.is_empty() {
        String::new()
    } else {
        format!("{readable}-")
    };
    PathBuf::from(format!("bufcache-{readable}{hash:016x}.rescue"))
}

/// The bytes of a rescue file holding `records` of `backends`.
pub fn encode(backends: &[Backend], records: &[Record]) -> Vec<u8> {
    let mut bytes = Vec::new();
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&(backends.len() as u32).to_le_bytes());
    for backend in backends {
        put_text(&mut bytes, &backend.export);
        put_text(&mut bytes, &backend.identity);
        put_text(&mut bytes, &backend.name);
        bytes.extend_from_slice(&backend.size_bytes.to_le_bytes());
        bytes.extend_from_slice(&backend.block_size_bytes.to_le_bytes());
        bytes.push(u8::from(backend.state.is_some()));
        bytes.extend_from_slice(&backend.state.unwrap_or(0).to_le_bytes());
    }
    let crc = crc32fast::hash(&bytes[MAGIC.len()..]);
    bytes.extend_from_slice(&crc.to_le_bytes());
    for record in records {
        let start = bytes.len();
        put_text(&mut bytes, &record.export);
        bytes.extend_from_slice(&record.offset.to_le_bytes());
        bytes.extend_from_slice(&(record.data.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&record.data);
        let crc = crc32fast::hash(&bytes[start..]);
        bytes.extend_from_slice(&crc.to_le_bytes());
    }
    bytes
}

/// Writes `records` of `backends` to `path` durably (temporary file, fsync, rename, directory
/// fsync). The caller holds the path's [`RescueLock`], so the temporary file and the rename
/// target are nobody else's.
pub fn write(path: &Path, backends: &[Backend], records: &[Record]) -> Result<(), RescueError> {
    let temporary = temporary_path(path);
    // Only the owner may read it: it holds clients' data.
    let mut file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&temporary)
        .map_err(io_error("creating rescue file", &temporary))?;
    file.write_all(&encode(backends, records))
        .and_then(|()| file.sync_all())
        .map_err(io_error("writing rescue file", &temporary))?;
    drop(file);
    std::fs::rename(&temporary, path).map_err(|source| RescueError::Io {
        action: "renaming into place rescue file",
        path: temporary.clone(),
        source,
    })?;
    sync_directory(path)
}

fn put_text(bytes: &mut Vec<u8>, text: &str) {
    bytes.extend_from_slice(&(text.len() as u32).to_le_bytes());
    bytes.extend_from_slice(text.as_bytes());
}

/// Reads and checks the header and every record of the rescue file at `path`.
pub fn read(path: &Path) -> Result<Contents, RescueError> {
    let mut bytes = Vec::new();
    File::open(path)
        .and_then(|mut file| file.read_to_end(&mut bytes))
        .map_err(io_error("reading rescue file", path))?;
    decode(&bytes).map_err(|damage| RescueError::Damaged {
        path: path.to_path_buf(),
        damage,
    })
}

/// A cursor over a rescue file's bytes that refuses to read past the end.
struct Reader<'a> {
    bytes: &'a [u8],
    position: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, length: usize, what: &str) -> Result<&'a [u8], Damage> {
        let end = self
            .position
            .checked_add(length)
            .filter(|end| *end <= self.bytes.len())
            .ok_or_else(|| Damage(format!("{what} is truncated")))?;
        let field = &self.bytes[self.position..end];
        self.position = end;
        Ok(field)
    }

    fn u32(&mut self, what: &str) -> Result<u32, Damage> {
        let bytes: [u8; 4] = self.take(4, what)?.try_into().expect("took 4 bytes");
        Ok(u32::from_le_bytes(bytes))
    }

    fn u64(&mut self, what: &str) -> Result<u64, Damage> {
        let bytes: [u8; 8] = self.take(8, what)?.try_into().expect("took 8 bytes");
        Ok(u64::from_le_bytes(bytes))
    }

    fn text(&mut self, what: &str) -> Result<String, Damage> {
        let length = self.u32(what)? as usize;
        if length > NAME_BYTES_MAX {
            return Err(Damage(format!(
                "{what}: a name of {length} bytes (damaged file)"
            )));
        }
        String::from_utf8(self.take(length, what)?.to_vec())
            .map_err(|_| Damage(format!("{what}: a name that is not UTF-8")))
    }
}

/// Checks and reads a rescue file's bytes: its header and every record.
pub fn decode(bytes: &[u8]) -> Result<Contents, Damage> {
    let magic = bytes.get(..MAGIC.len());
    let (identified, stateful) = match magic {
        Some(magic) if magic == MAGIC => (true, true),
        Some(magic) if magic == MAGIC_STATELESS => (true, false),
        Some(magic) if magic == MAGIC_UNIDENTIFIED => (false, false),
        _ => return Err(Damage("not a bufcache rescue file (bad magic)".into())),
    };
    let mut reader = Reader {
        bytes,
        position: MAGIC.len(),
    };
    let backends = if identified {
        let count = reader.u32("the header")? as usize;
        if count > BACKENDS_MAX {
            return Err(Damage(format!(
                "the header lists {count} backends (damaged file)"
            )));
        }
        let mut backends = Vec::with_capacity(count);
        for _ in 0..count {
            let export = reader.text("the header")?;
            let identity = reader.text("the header")?;
            let name = if stateful {
                reader.text("the header")?
            } else {
                String::new()
            };
            let size_bytes = reader.u64("the header")?;
            let block_size_bytes = reader.u32("the header")?;
            let state = if stateful {
                let has_state = reader.take(1, "the header")?[0];
                let state = reader.u64("the header")?;
                match has_state {
                    0 => None,
                    1 => Some(state),
                    other => {
                        return Err(Damage(format!(
                            "the header: a state flag of {other} (damaged file)"
                        )))
                    }
                }
            } else {
                None
            };
            backends.push(Backend {
                export,
                identity,
                name,
                size_bytes,
                block_size_bytes,
                state,
            });
        }
        let body_end = reader.position;
        let crc = reader.u32("the header")?;
        if crc32fast::hash(&bytes[MAGIC.len()..body_end]) != crc {
            return Err(Damage("the header fails its checksum".into()));
        }
        Some(backends)
    } else {
        None
    };
    let mut records = Vec::new();
    while reader.position < bytes.len() {
        let start = reader.position;
        let what = format!("record at byte {start}");
        let name_length = reader.u32(&what)? as usize;
        let name = reader.take(name_length, &what)?.to_vec();
        let offset = reader.u64(&what)?;
        let data_length = reader.u32(&what)? as usize;
        let data = reader.take(data_length, &what)?.to_vec();
        let body_end = reader.position;
        let crc = reader.u32(&what)?;
        if crc32fast::hash(&bytes[start..body_end]) != crc {
            return Err(Damage(format!("record at byte {start} fails its checksum")));
        }
        let export = String::from_utf8(name)
            .map_err(|_| Damage(format!("record at byte {start}: export name is not UTF-8")))?;
        records.push(Record {
            export,
            offset,
            data,
        });
    }
    Ok(Contents { backends, records })
}

/// Deletes the rescue file and makes the deletion durable.
pub fn remove(path: &Path) -> Result<(), RescueError> {
    std::fs::remove_file(path).map_err(io_error("removing rescue file", path))?;
    sync_directory(path)
}

fn temporary_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".partial");
    path.with_file_name(name)
}

fn lock_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".lock");
    path.with_file_name(name)
}

fn sync_directory(path: &Path) -> Result<(), RescueError> {
    let directory = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    File::open(directory)
        .and_then(|directory| directory.sync_all())
        .map_err(io_error("syncing the directory of", path))
}

/// The exclusive right to write (and replay) one rescue file, held from start to exit: an
/// `flock` on `PATH.lock`, which holds the holder's pid so a refused server can name it.
/// The lock file is never renamed; it is deleted only by its holder, and a server that locked
/// a file deleted meanwhile tries again, so two servers never both believe they hold it.
#[derive(Debug)]
pub struct RescueLock {
    file: File,
    lock_path: PathBuf,
}

impl RescueLock {
    /// Takes the lock of the rescue file `path` (`what` says whose file it is, for the error),
    /// or fails naming the pid of the server that holds it.
    pub fn acquire(path: &Path, what: &str) -> Result<RescueLock, RescueError> {
        let lock_path = lock_path(path);
        // Bounded: each retry means the holder deleted the file between our open and lock.
        for _ in 0..100 {
            let mut file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&lock_path)
                .map_err(io_error("opening rescue lock file", &lock_path))?;
            // SAFETY: flock on a descriptor this function owns.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                let error = std::io::Error::last_os_error();
                if error.raw_os_error() != Some(libc::EWOULDBLOCK) {
                    return Err(io_error("locking rescue lock file", &lock_path)(error));
                }
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let holder = match holder.trim().parse::<u32>() {
                    Ok(pid) => format!("pid {pid}"),
                    Err(_) => "another process".to_string(),
                };
                return Err(RescueError::Locked {
                    path: path.to_path_buf(),
                    what: what.to_string(),
                    holder,
                });
            }
            let same = match (file.metadata(), std::fs::metadata(&lock_path)) {
                (Ok(held), Ok(named)) => held.dev() == named.dev() && held.ino() == named.ino(),
                _ => false,
            };
            if !same {
                continue;
            }
            file.set_len(0)
                .and_then(|()| file.write_all(format!("{}\n", std::process::id()).as_bytes()))
                .map_err(io_error("writing rescue lock file", &lock_path))?;
            return Ok(RescueLock { file, lock_path });
        }
        Err(RescueError::LockReplaced { path: lock_path })
    }

    /// Deletes the lock file while still holding the lock, then releases it. Called after the
    /// last write of the rescue file.
    pub fn release(self) {
        let _ = std::fs::remove_file(&self.lock_path);
        drop(self.file);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: a file's disk id goes with its inode: it reads back, is not overwritten, and a new
    // file moved to the same path has none; records of the file by id match it, records of
    // the path (older servers) match it, another id does not. Method: xattrs on files of a
    // temporary directory (skipped where the file system keeps no user attributes).
    #[test]
    fn a_file_disk_id_follows_the_inode_and_another_id_is_another_disk() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.img");
        std::fs::write(&path, [0u8; 4096]).unwrap();
        assert_eq!(read_file_disk_id(&path).unwrap(), None);
        if let Err(error) = write_file_disk_id(&path, 0x1234) {
            println!("skipped: no user extended attributes here ({error})");
            return;
        }
        assert_eq!(read_file_disk_id(&path).unwrap(), Some(0x1234));
        assert!(
            write_file_disk_id(&path, 0x5678).is_err(),
            "an id is never replaced"
        );
        assert_eq!(read_file_disk_id(&path).unwrap(), Some(0x1234));
        let other = dir.path().join("other.img");
        std::fs::write(&other, [0u8; 4096]).unwrap();
        std::fs::rename(&other, &path).unwrap();
        assert_eq!(
            read_file_disk_id(&path).unwrap(),
            None,
            "a new inode has no id"
        );

        let ours = BackendIdentity {
            identity: file_disk_identity(0x1234),
            name: "file:/srv/disk.img".into(),
            state: None,
        };
        assert!(same_backend("file-disk:0000000000001234", &ours));
        assert!(!same_backend("file-disk:0000000000005678", &ours));
        assert!(
            same_backend("file:/srv/disk.img", &ours),
            "recorded by an older server"
        );
        assert!(!same_backend("file:/srv/other.img", &ours));
    }

    fn backends() -> Vec<Backend> {
        vec![
            Backend {
                export: String::new(),
                identity: "file:/srv/disk.img".into(),
                name: "file:/srv/disk.img".into(),
                size_bytes: 1 << 30,
                block_size_bytes: 4096,
                state: None,
            },
            Backend {
                export: "b".into(),
                identity: "s3-disk:00000000000000ab".into(),
                name: "s3://bucket/vol".into(),
                size_bytes: 1 << 41,
                block_size_bytes: 65536,
                state: Some(7),
            },
        ]
    }

    #[test]
    fn records_round_trip_and_any_flipped_byte_is_detected() {
        // Goal: what is written (header and records) is read back exactly, and corruption
        // anywhere is refused rather than replayed. Method: write two backends and two
        // records, read them back, then flip each byte after the magic in turn and expect an
        // error.
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("rescue");
        let records = vec![
            Record {
                export: String::new(),
                offset: 4096,
                data: vec![7; 4096],
            },
            Record {
                export: "b".into(),
                offset: 1 << 40,
                data: (0..=255).collect(),
            },
        ];
        write(&path, &backends(), &records).unwrap();
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o077, 0, "a rescue file others can read: {mode:o}");
        let contents = read(&path).unwrap();
        assert_eq!(contents.records, records);
        assert_eq!(contents.backends, Some(backends()));
        let bytes = std::fs::read(&path).unwrap();
        for index in MAGIC.len()..bytes.len() {
            let mut damaged = bytes.clone();
            damaged[index] ^= 0x40;
            assert!(
                decode(&damaged).is_err(),
                "flipped byte {index} not detected"
            );
        }
        assert!(decode(&bytes[..bytes.len() - 1]).is_err());
        assert!(decode(b"something else").is_err());
    }

    #[test]
    fn a_second_format_file_is_read_without_a_name_or_state() {
        // Goal: rescue files saved before disks recorded a state are still readable (and so
        // never silently lost), marked as carrying no state. Method: a hand-made
        // second-format file with one backend and one record.
        let mut bytes = MAGIC_STATELESS.to_vec();
        bytes.extend_from_slice(&1u32.to_le_bytes());
        put_text(&mut bytes, "");
        put_text(&mut bytes, "s3://bucket/disk?create-size=1G");
        bytes.extend_from_slice(&(1u64 << 30).to_le_bytes());
        bytes.extend_from_slice(&4096u32.to_le_bytes());
        let crc = crc32fast::hash(&bytes[MAGIC.len()..]);
        bytes.extend_from_slice(&crc.to_le_bytes());
        let contents = decode(&bytes).unwrap();
        let backends = contents.backends.unwrap();
        assert_eq!(backends.len(), 1);
        assert_eq!(backends[0].identity, "s3://bucket/disk?create-size=1G");
        assert_eq!(backends[0].state, None);
        assert!(backends[0].name.is_empty());
        assert!(contents.records.is_empty());
    }

    #[test]
    fn a_first_format_file_is_read_without_an_identity() {
        // Goal: rescue files saved before the header existed are still readable (and so never
        // silently lost), marked as carrying no identity. Method: a hand-made first-format
        // file with one record.
        let mut bytes = MAGIC_UNIDENTIFIED.to_vec();
        let start = bytes.len();
        put_text(&mut bytes, "");
        bytes.extend_from_slice(&512u64.to_le_bytes());
        bytes.extend_from_slice(&3u32.to_le_bytes());
        bytes.extend_from_slice(b"abc");
        let crc = crc32fast::hash(&bytes[start..]);
        bytes.extend_from_slice(&crc.to_le_bytes());
        let contents = decode(&bytes).unwrap();
        assert_eq!(contents.backends, None);
        assert_eq!(
            contents.records,
            vec![Record {
                export: String::new(),
                offset: 512,
                data: b"abc".to_vec()
            }]
        );
    }

    #[test]
    #[cfg_attr(
        feature = "planted-rescue-defect",
        ignore = "the planted defect lets stale files through"
    )]
    fn a_file_saved_before_the_disk_moved_on_is_refused_unless_forced() {
        // Goal: the replay rule the server and `sim check` share: a file is replayed only into
        // its own disk, at its size, at the generation it records (or with force), and a
        // disk that keeps no generation cannot tell. Method: one saved S3 backend against
        // disks that differ in one way each.
        let saved = &backends()[1];
        let ours = BackendIdentity {
            identity: "s3-disk:00000000000000ab".into(),
            name: "s3://bucket/vol".into(),
            state: Some(7),
        };
        let size = Some(saved.size_bytes);
        assert_eq!(check_saved(saved, &ours, size, false), Ok(()));
        let moved_on = BackendIdentity {
            state: Some(8),
            ..ours.clone()
        };
        assert_eq!(
            check_saved(saved, &moved_on, size, false),
            Err(Refusal::MovedOn { then: 7, now: 8 })
        );
        assert_eq!(check_saved(saved, &moved_on, size, true), Ok(()));
        let stateless = Backend {
            state: None,
            ..saved.clone()
        };
        assert_eq!(
            check_saved(&stateless, &ours, size, false),
            Err(Refusal::StateUnknown { now: 7 })
        );
        let other = BackendIdentity {
            identity: "s3-disk:00000000000000ac".into(),
            ..ours.clone()
        };
        assert_eq!(
            check_saved(saved, &other, size, true),
            Err(Refusal::OtherDisk)
        );
        assert_eq!(
            check_saved(saved, &ours, Some(1 << 40), true),
            Err(Refusal::Resized {
                then_bytes: 1 << 41,
                now_bytes: 1 << 40
            })
        );
        let keeps_none = BackendIdentity {
            state: None,
            ..ours.clone()
        };
        assert_eq!(check_saved(saved, &keeps_none, size, false), Ok(()));
    }

    #[test]
    fn default_paths_differ_by_backend_and_by_export() {
        // Goal: two backends (or two exports of one) never share a default rescue file, and
        // the name says whose it is. Method: compare the paths of near-identical identities.
        let a = default_path("", "file:/srv/a/disk.img");
        let b = default_path("", "file:/srv/b/disk.img");
        let named = default_path("x", "file:/srv/a/disk.img");
        assert_ne!(a, b);
        assert_ne!(a, named);
        assert_eq!(a, default_path("", "file:/srv/a/disk.img"));
        let text = a.to_string_lossy();
        assert!(
            text.starts_with("bufcache-disk.img-") && text.ends_with(".rescue"),
            "{text}"
        );
        assert!(named.to_string_lossy().starts_with("bufcache-x-"));
    }

    #[test]
    fn a_held_rescue_lock_refuses_a_second_holder_naming_the_pid() {
        // Goal: one rescue file has one writer; the refusal names the holder so the operator
        // can find it. Method: take the lock, try again in the same process (flock locks
        // belong to open files, so the second open conflicts), then release and retake.
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("r.rescue");
        let held = RescueLock::acquire(&path, "export \"\"").unwrap();
        let error = RescueLock::acquire(&path, "export \"\"")
            .unwrap_err()
            .to_string();
        assert!(
            error.contains(&format!("pid {}", std::process::id())),
            "{error}"
        );
        held.release();
        assert!(!directory.path().join("r.rescue.lock").exists());
        RescueLock::acquire(&path, "export \"\"").unwrap().release();
    }
}
