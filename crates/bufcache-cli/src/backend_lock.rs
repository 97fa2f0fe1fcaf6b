//! Exclusive use of file and block-device backends while a server runs.
//!
//! Two servers caching one image each believe their cache is the truth, and the second one's
//! write-back overwrites the first one's data with stale blocks. So `bufcache serve` takes an
//! advisory `flock` on every backing file (and, on a block device, an `O_EXCL` open as qemu
//! does: the kernel refuses it while the device is mounted or claimed by another exclusive
//! opener) and holds it until the process ends. A second server on the same image refuses to
//! start, naming the holder's pid (read from /proc/locks).
//!
//! The lock is taken on a descriptor of its own: flock locks belong to the open file, so the
//! device's own descriptor is untouched, and the kernel drops the lock when the process ends,
//! however it ends.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Why a backing file could not be locked.
#[derive(Debug, thiserror::Error)]
pub enum BackendLockError {
    #[error(
        "backend {path}: in use by another process{holder} (an advisory lock is held on it); \
         two servers caching one image overwrite each other's data: stop the other first"
    )]
    Locked { path: PathBuf, holder: String },
    #[error(
        "backend {path}: the block device is busy (mounted, or opened exclusively by another \
         program such as another bufcache serve or qemu){holder}"
    )]
    DeviceBusy { path: PathBuf, holder: String },
    #[error("backend {path}: cannot lock it: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Held for as long as the server runs; dropping it releases the lock.
#[derive(Debug)]
pub struct BackendLock {
    _file: File,
}

impl BackendLock {
    /// Locks the backing file or block device at `path` for exclusive use by this process.
    pub fn acquire(path: &Path) -> Result<BackendLock, BackendLockError> {
        let io_error = |source| BackendLockError::Io {
            path: path.to_path_buf(),
            source,
        };
        let metadata = std::fs::metadata(path).map_err(io_error)?;
        let block_device = metadata.file_type().is_block_device();
        let mut options = OpenOptions::new();
        options.read(true);
        if block_device {
            options.custom_flags(libc::O_EXCL);
        }
        let file = match options.open(path) {
            Ok(file) => file,
            Err(error) if block_device && error.raw_os_error() == Some(libc::EBUSY) => {
                return Err(BackendLockError::DeviceBusy {
                    path: path.to_path_buf(),
                    holder: holder_text(&metadata),
                })
            }
            Err(error) => return Err(io_error(error)),
        };
        // SAFETY: flock on a descriptor this function owns.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let error = std::io::Error::last_os_error();
            if error.raw_os_error() == Some(libc::EWOULDBLOCK) {
                return Err(BackendLockError::Locked {
                    path: path.to_path_buf(),
                    holder: holder_text(&metadata),
                });
            }
            return Err(io_error(error));
        }
        Ok(BackendLock { _file: file })
    }
}

/// " (pid N)" for the process holding an flock on the file, when /proc/locks says.
fn holder_text(metadata: &std::fs::Metadata) -> String {
    match flock_holder(metadata) {
        Some(pid) => format!(" (pid {pid})"),
        None => String::new(),
    }
}

/// The pid of a process holding an flock on the file of `metadata`, from /proc/locks, whose
/// lines read `1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF` (device in hex, inode decimal).
fn flock_holder(metadata: &std::fs::Metadata) -> Option<u32> {
    let text = std::fs::read_to_string("/proc/locks").ok()?;
    let device = metadata.dev();
    let wanted = format!(
        "{:02x}:{:02x}:{}",
        libc::major(device),
        libc::minor(device),
        metadata.ino()
    );
    text.lines()
        .filter(|line| !line.contains("->"))
        .map(|line| line.split_whitespace().collect::<Vec<_>>())
        .find(|fields| fields.get(1) == Some(&"FLOCK") && fields.get(5) == Some(&wanted.as_str()))
        .and_then(|fields| fields.get(4)?.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_locked_image_refuses_a_second_lock_naming_this_pid() {
        // Goal: a second locker of one image is refused with the first one's pid, and the
        // image is free again once the first lock is dropped. Method: two locks in this
        // process (flock conflicts between open files, so this is the two-server case).
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("disk.img");
        std::fs::write(&path, [0u8; 4096]).unwrap();
        let first = BackendLock::acquire(&path).unwrap();
        let error = BackendLock::acquire(&path).unwrap_err().to_string();
        assert!(
            error.contains(&format!("pid {}", std::process::id())) && error.contains("disk.img"),
            "{error}"
        );
        drop(first);
        BackendLock::acquire(&path).unwrap();
    }
}
