//! One byte stream type for both transports (TCP and unix-domain sockets), so the protocol
//! code is written once.
//!
//! A [`Stream`] can be cloned into independent handles on the same socket (one reader, one
//! writer), and [`Stream::shutdown_read`] wakes a thread blocked in `read` without closing
//! the socket, which is how the server drains a connection on shutdown while still writing
//! the replies of requests already in flight.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::unix::net::UnixStream;
use std::time::Duration;

/// A connected socket of either kind.
#[derive(Debug)]
pub enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    /// A second handle on the same socket.
    pub fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Tcp(stream) => Stream::Tcp(stream.try_clone()?),
            Stream::Unix(stream) => Stream::Unix(stream.try_clone()?),
        })
    }

    /// Ends reading: a blocked `read` returns end-of-file; writing still works.
    pub fn shutdown_read(&self) {
        // The socket may already be closed by the peer; nothing is left to do then.
        let _ = self.shutdown(Shutdown::Read);
    }

    /// Ends both directions: every blocked call on any handle returns.
    pub fn shutdown_both(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }

    fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match self {
            Stream::Tcp(stream) => stream.shutdown(how),
            Stream::Unix(stream) => stream.shutdown(how),
        }
    }

    /// Bounds how long a `read` may block (`None`: forever).
    pub fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(stream) => stream.set_read_timeout(timeout),
            Stream::Unix(stream) => stream.set_read_timeout(timeout),
        }
    }

    /// Bounds how long a `write` may block (`None`: forever).
    pub fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(stream) => stream.set_write_timeout(timeout),
            Stream::Unix(stream) => stream.set_write_timeout(timeout),
        }
    }

    /// Bytes received and not read yet (FIONREAD).
    pub fn readable_bytes(&self) -> io::Result<usize> {
        let mut bytes: libc::c_int = 0;
        // SAFETY: FIONREAD writes one c_int into `bytes`; the descriptor is open.
        let result = unsafe { libc::ioctl(self.descriptor(), libc::FIONREAD, &mut bytes) };
        if result < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(bytes.max(0) as usize)
    }

    /// Makes the socket's close abortive (SO_LINGER 0, a TCP reset): replies queued for a
    /// client that stopped reading are dropped at once instead of holding kernel memory,
    /// and the client learns at once that it was cut off. Nothing for a unix socket.
    pub fn abort_on_close(&self) {
        let Stream::Tcp(stream) = self else {
            return;
        };
        let linger = libc::linger {
            l_onoff: 1,
            l_linger: 0,
        };
        // SAFETY: setsockopt reads `size_of::<linger>()` bytes from a live `linger` value;
        // the descriptor is open for the call.
        unsafe {
            libc::setsockopt(
                std::os::unix::io::AsRawFd::as_raw_fd(stream),
                libc::SOL_SOCKET,
                libc::SO_LINGER,
                (&linger as *const libc::linger).cast(),
                std::mem::size_of::<libc::linger>() as libc::socklen_t,
            );
        }
    }

    /// Sends small messages (reply headers) at once instead of waiting to coalesce them:
    /// NBD is request/response, and Nagle's delay would add latency to every request.
    pub fn set_no_delay(&self) {
        if let Stream::Tcp(stream) = self {
            let _ = stream.set_nodelay(true);
        }
    }

    /// Waits until the socket has bytes to read (or end-of-file, or an error) for at most
    /// `timeout`; false when the time ran out with nothing to read. Nothing is consumed, so
    /// a timeout never loses part of a message.
    pub fn wait_readable(&self, timeout: Duration) -> io::Result<bool> {
        self.wait_for(libc::POLLIN, timeout)
    }

    /// Waits until the socket can take more bytes (or has failed) for at most `timeout`;
    /// false when the time ran out.
    pub fn wait_writable(&self, timeout: Duration) -> io::Result<bool> {
        self.wait_for(libc::POLLOUT, timeout)
    }

    fn descriptor(&self) -> std::os::unix::io::RawFd {
        use std::os::unix::io::AsRawFd;
        match self {
            Stream::Tcp(stream) => stream.as_raw_fd(),
            Stream::Unix(stream) => stream.as_raw_fd(),
        }
    }

    fn wait_for(&self, events: libc::c_short, timeout: Duration) -> io::Result<bool> {
        let descriptor = self.descriptor();
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let mut poll_fd = libc::pollfd {
                fd: descriptor,
                events,
                revents: 0,
            };
            // Rounded up, so a wait never ends a fraction of a millisecond early and spins.
            let milliseconds = left.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
            // SAFETY: one valid, exclusively borrowed pollfd; the descriptor is open.
            let ready = unsafe { libc::poll(&mut poll_fd, 1, milliseconds) };
            match ready {
                0 if left.is_zero() => return Ok(false),
                0 => continue,
                1.. => return Ok(true),
                _ => {
                    let error = io::Error::last_os_error();
                    if error.kind() != io::ErrorKind::Interrupted {
                        return Err(error);
                    }
                }
            }
        }
    }

    /// Sends as much of `slices` as the socket takes without blocking (one `sendmsg`, at
    /// most `IOV_MAX` slices); Ok(0) when it takes nothing now.
    pub fn send_vectored_now(&self, slices: &[io::IoSlice<'_>]) -> io::Result<usize> {
        const IOV_MAX: usize = 1024;
        let count = slices.len().min(IOV_MAX);
        // SAFETY: all-zero is a valid msghdr (no name, no control data).
        let mut message: libc::msghdr = unsafe { std::mem::zeroed() };
        // IoSlice is guaranteed ABI-compatible with iovec on unix.
        message.msg_iov = slices.as_ptr() as *mut libc::iovec;
        message.msg_iovlen = count as _;
        loop {
            // SAFETY: the msghdr points at `count` live slices borrowed for this call; the
            // kernel only reads them.
            let sent = unsafe {
                libc::sendmsg(
                    self.descriptor(),
                    &message,
                    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                )
            };
            if sent >= 0 {
                return Ok(sent as usize);
            }
            let error = io::Error::last_os_error();
            match error.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock => return Ok(0),
                _ => return Err(error),
            }
        }
    }

    /// The peer's IP address; `None` for unix sockets (or when it is unavailable).
    pub fn peer_ip(&self) -> Option<std::net::IpAddr> {
        match self {
            Stream::Tcp(stream) => stream.peer_addr().ok().map(|address| address.ip()),
            Stream::Unix(_) => None,
        }
    }

    /// The peer's address, for log messages.
    pub fn peer_description(&self) -> String {
        match self {
            Stream::Tcp(stream) => stream
                .peer_addr()
                .map(|address| address.to_string())
                .unwrap_or_else(|_| "tcp peer".into()),
            Stream::Unix(_) => "unix peer".into(),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buffer: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(stream) => stream.read(buffer),
            Stream::Unix(stream) => stream.read(buffer),
        }
    }

    /// One `readv` for all the slices (the default would read only the first slice per
    /// call: one system call per 4 KiB block of a write).
    fn read_vectored(&mut self, buffers: &mut [io::IoSliceMut<'_>]) -> io::Result<usize> {
        match self {
            Stream::Tcp(stream) => stream.read_vectored(buffers),
            Stream::Unix(stream) => stream.read_vectored(buffers),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buffer: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(stream) => stream.write(buffer),
            Stream::Unix(stream) => stream.write(buffer),
        }
    }

    fn write_vectored(&mut self, buffers: &[io::IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Stream::Tcp(stream) => stream.write_vectored(buffers),
            Stream::Unix(stream) => stream.write_vectored(buffers),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Sends `parts` in order, blocking at most until `deadline`; returns how many bytes went.
/// The caller sends the rest, if any, some other way (an NBD reply from cache buffers copies
/// its remainder and lets the buffers go, so a client that stops reading cannot hold them).
pub fn send_vectored_until(
    stream: &Stream,
    parts: &[io::IoSlice<'_>],
    deadline: std::time::Instant,
) -> io::Result<usize> {
    let total: usize = parts.iter().map(|part| part.len()).sum();
    let mut sent_total = 0usize;
    let mut part_index = 0usize;
    let mut offset_in_part = 0usize;
    while sent_total < total {
        let mut slices = Vec::with_capacity(parts.len() - part_index);
        slices.push(io::IoSlice::new(&parts[part_index][offset_in_part..]));
        slices.extend(
            parts[part_index + 1..]
                .iter()
                .map(|part| io::IoSlice::new(part)),
        );
        let sent = stream.send_vectored_now(&slices)?;
        if sent == 0 {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() || !stream.wait_writable(left)? {
                break;
            }
            continue;
        }
        sent_total += sent;
        (part_index, offset_in_part) = advance(
            parts.iter().map(|part| part.len()),
            part_index,
            offset_in_part,
            sent,
        );
    }
    Ok(sent_total)
}

/// Where sending stands after `sent` more bytes went, from part `part_index` at
/// `offset_in_part`, over parts of `lengths`: the next part not wholly sent and the offset in
/// it (empty parts skipped, so a trailing empty part never asks for a zero-byte write).
fn advance(
    lengths: impl Iterator<Item = usize>,
    part_index: usize,
    offset_in_part: usize,
    sent: usize,
) -> (usize, usize) {
    let mut left = offset_in_part + sent;
    let mut index = part_index;
    for length in lengths.skip(part_index) {
        if left < length {
            return (index, left);
        }
        left -= length;
        index += 1;
    }
    (index, 0)
}

/// Writes every byte of every slice, in order, with as few system calls as the socket allows:
/// a header and its payload leave together without copying the payload.
pub fn write_all_vectored(stream: &mut impl Write, parts: &[&[u8]]) -> io::Result<()> {
    let mut part_index = 0;
    let mut offset_in_part = 0;
    while part_index < parts.len() {
        let mut slices = Vec::with_capacity(parts.len() - part_index);
        slices.push(io::IoSlice::new(&parts[part_index][offset_in_part..]));
        slices.extend(
            parts[part_index + 1..]
                .iter()
                .map(|part| io::IoSlice::new(part)),
        );
        let written = match stream.write_vectored(&slices) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(count) => count,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
            Err(error) => return Err(error),
        };
        (part_index, offset_in_part) = advance(
            parts.iter().map(|part| part.len()),
            part_index,
            offset_in_part,
            written,
        );
    }
    Ok(())
}

/// Fills every slice completely, in order, with as few system calls as the socket allows
/// (one `readv` for a whole request when its bytes have arrived). End-of-file before the
/// slices are full is an `UnexpectedEof` error.
pub fn read_exact_vectored(
    stream: &mut impl Read,
    mut slices: &mut [io::IoSliceMut<'_>],
) -> io::Result<()> {
    io::IoSliceMut::advance_slices(&mut slices, 0);
    while !slices.is_empty() {
        match stream.read_vectored(slices) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(count) => io::IoSliceMut::advance_slices(&mut slices, count),
            Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
            Err(error) => return Err(error),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Goal: a vectored read fills every slice whatever the socket delivers at a time, and
    /// reports end-of-file before the end. Method: a reader returning 3 bytes per call.
    #[test]
    fn read_exact_vectored_fills_all_slices_across_short_reads() {
        struct Trickle(Vec<u8>);
        impl Read for Trickle {
            fn read(&mut self, buffer: &mut [u8]) -> io::Result<usize> {
                let count = buffer.len().min(3).min(self.0.len());
                buffer[..count].copy_from_slice(&self.0[..count]);
                self.0.drain(..count);
                Ok(count)
            }
        }
        let mut source = Trickle((0..20u8).collect());
        let (mut first, mut second, mut third) = ([0u8; 4], [0u8; 0], [0u8; 11]);
        let mut slices = [
            io::IoSliceMut::new(&mut first),
            io::IoSliceMut::new(&mut second),
            io::IoSliceMut::new(&mut third),
        ];
        read_exact_vectored(&mut source, &mut slices).unwrap();
        assert_eq!(first, [0, 1, 2, 3]);
        assert_eq!(third, [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]);
        let mut rest = [0u8; 10];
        let error =
            read_exact_vectored(&mut source, &mut [io::IoSliceMut::new(&mut rest)]).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::UnexpectedEof);
    }

    /// A writer that accepts at most three bytes per call, to exercise partial writes.
    struct Trickle(Vec<u8>);

    impl Write for Trickle {
        fn write(&mut self, buffer: &[u8]) -> io::Result<usize> {
            let count = buffer.len().min(3);
            self.0.extend_from_slice(&buffer[..count]);
            Ok(count)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn vectored_write_survives_partial_writes() {
        let mut sink = Trickle(Vec::new());
        write_all_vectored(&mut sink, &[b"head", b"", b"payload!"]).unwrap();
        assert_eq!(sink.0, b"headpayload!");
    }
}
