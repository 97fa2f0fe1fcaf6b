//! Service-manager conventions for `bufcache serve`: systemd socket activation
//! (`LISTEN_FDS`/`LISTEN_PID`), readiness notification (`NOTIFY_SOCKET`, sd_notify's protocol)
//! and a pid file. The protocols are small and fixed (see sd_listen_fds(3), sd_notify(3)), so
//! they are spoken directly rather than through libsystemd.

use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{bail, Context};

/// The first file descriptor systemd passes (SD_LISTEN_FDS_START).
const LISTEN_FDS_START: i32 = 3;

/// The listening sockets systemd passed, or None when the process was not socket-activated
/// (no LISTEN_FDS, or LISTEN_PID naming another process). The variables are removed so child
/// processes do not take the sockets for theirs.
pub fn inherited_sockets() -> anyhow::Result<Option<Vec<OwnedFd>>> {
    let (Some(pid), Some(count)) = (
        std::env::var_os("LISTEN_PID"),
        std::env::var_os("LISTEN_FDS"),
    ) else {
        return Ok(None);
    };
    let pid = pid.to_string_lossy();
    if pid.parse::<u32>().ok() != Some(std::process::id()) {
        return Ok(None);
    }
    let count = count.to_string_lossy();
    let count: i32 = count
        .parse()
        .ok()
        .filter(|count| (1..=1024).contains(count))
        .with_context(|| format!("LISTEN_FDS={count} is not a count of sockets from 1 to 1024"))?;
    std::env::remove_var("LISTEN_PID");
    std::env::remove_var("LISTEN_FDS");
    std::env::remove_var("LISTEN_FDNAMES");
    let mut sockets = Vec::new();
    for fd in LISTEN_FDS_START..LISTEN_FDS_START + count {
        // SAFETY: fcntl on a descriptor number only inspects or sets its flags.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
        if flags < 0 {
            bail!("LISTEN_FDS={count}, but file descriptor {fd} is not open");
        }
        // SAFETY: as above; FD_CLOEXEC keeps the socket out of any program we start.
        unsafe { libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC) };
        // SAFETY: systemd hands these descriptors to this process, which owns them from now.
        sockets.push(unsafe { OwnedFd::from_raw_fd(fd) });
    }
    Ok(Some(sockets))
}

/// Sends `state` (like "READY=1") to the service manager when NOTIFY_SOCKET is set. A failure
/// is returned for the caller to report; the service keeps running either way.
pub fn notify(state: &str) -> std::io::Result<()> {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return Ok(());
    };
    let socket = std::os::unix::net::UnixDatagram::unbound()?;
    let path = path.to_string_lossy().to_string();
    if let Some(name) = path.strip_prefix('@') {
        use std::os::linux::net::SocketAddrExt;
        let address = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
        socket.send_to_addr(state.as_bytes(), &address)?;
    } else {
        socket.send_to(state.as_bytes(), &path)?;
    }
    Ok(())
}

static PID_FILE: Mutex<Option<PathBuf>> = Mutex::new(None);
static PRIVATE_DIRECTORY: Mutex<Option<PathBuf>> = Mutex::new(None);

/// A unix socket path in a new directory only this user can enter (for --run without a
/// listener, as nbdkit does); [`cleanup`] removes both.
pub fn private_socket_path() -> anyhow::Result<PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    let directory = std::env::temp_dir().join(format!("bufcache-{}", std::process::id()));
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&directory)
        .with_context(|| format!("--run: cannot create {}", directory.display()))?;
    if let Ok(mut slot) = PRIVATE_DIRECTORY.lock() {
        *slot = Some(directory.clone());
    }
    Ok(directory.join("nbd.sock"))
}

/// Asks the kernel to send SIGTERM when the parent exits (--exit-with-parent), so shutdown
/// writes everything back as on any SIGTERM. Fails if the parent is already gone.
pub fn exit_with_parent() -> anyhow::Result<()> {
    // SAFETY: getppid and prctl(PR_SET_PDEATHSIG) have no memory-safety preconditions.
    let parent = unsafe { libc::getppid() };
    if unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) } != 0 {
        return Err(std::io::Error::last_os_error()).context("--exit-with-parent: prctl");
    }
    // The parent may have exited before the request: then no signal will come.
    if unsafe { libc::getppid() } != parent {
        bail!("--exit-with-parent: the parent process has already exited");
    }
    Ok(())
}

/// Writes this process's id to `path` (replacing it atomically); [`cleanup`] removes it.
pub fn write_pid_file(path: &Path) -> anyhow::Result<()> {
    let temporary = pid_file_partial(path);
    std::fs::write(&temporary, format!("{}\n", std::process::id()))
        .and_then(|()| std::fs::rename(&temporary, path))
        .with_context(|| format!("--pid-file {}: cannot write it", path.display()))?;
    if let Ok(mut slot) = PID_FILE.lock() {
        *slot = Some(path.to_path_buf());
    }
    Ok(())
}

/// Checks that the pid file can be written where `path` says (its directory exists and may
/// be written) by writing and removing its temporary file: done before any disk is opened,
/// so a start refused for its pid file changes no disk.
pub fn check_pid_file(path: &Path) -> anyhow::Result<()> {
    let temporary = pid_file_partial(path);
    std::fs::write(&temporary, b"")
        .and_then(|()| std::fs::remove_file(&temporary))
        .with_context(|| format!("--pid-file {}: cannot write it", path.display()))
}

/// The file a pid file is written to before it is renamed into place.
fn pid_file_partial(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".partial");
    path.with_file_name(name)
}

/// Removes the pid file, if one was written; called on every way out of `serve`.
pub fn cleanup() {
    if let Ok(mut slot) = PID_FILE.lock() {
        if let Some(path) = slot.take() {
            let _ = std::fs::remove_file(path);
        }
    }
    if let Ok(mut slot) = PRIVATE_DIRECTORY.lock() {
        if let Some(directory) = slot.take() {
            let _ = std::fs::remove_dir_all(directory);
        }
    }
}
