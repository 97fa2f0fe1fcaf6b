//! The io_uring engine of a [`FileDevice`](super::FileDevice) (`io_uring_depth` > 0).
//!
//! Submitted reads and writes become `IORING_OP_READV`/`IORING_OP_WRITEV` entries of one ring;
//! one reaper thread waits for their completions and ends each request. Submitters never wait
//! for the kernel, only for a free slot when `depth` requests are already in flight.
//!
//! Invariants:
//! - every request accepted by [`Ring::submit`] completes exactly once: with the kernel's
//!   outcome, finished with blocking calls when the kernel moved only part of it;
//! - a slot's request, and so the memory its iovecs point at, stays in the slot table until
//!   its completion has been reaped: the kernel never writes to memory that was handed back;
//! - at most `depth` requests are in flight, which is also the ring's size, so the submission
//!   queue never overflows;
//! - completions run on the reaper; a completion that submits to the same device while every
//!   slot is taken does that request in its own thread instead of waiting for a slot only it
//!   could free.

use std::io;
use std::os::unix::io::AsRawFd;
use std::sync::Arc;
use std::thread::{JoinHandle, ThreadId};

use io_uring::{opcode, types, IoUring};
use parking_lot::{Condvar, Mutex};

use super::{FileCore, Job};

/// Largest slice count of one request the kernel takes (`IOV_MAX`); requests with more are
/// done in the caller's thread.
const SLICES_PER_REQUEST_MAX: usize = 1024;

/// The `user_data` of the no-op that tells the reaper to stop.
const STOP: u64 = u64::MAX;

/// A request in flight: the request (owner of the memory) and the iovecs the kernel reads.
struct InFlight {
    job: Job,
    /// Read by the kernel until the completion is reaped; boxed so its address is stable.
    _iovecs: Box<[libc::iovec]>,
}

// SAFETY: the iovecs only point into `job`'s memory, which is `Send`; they are raw pointers
// only because the kernel reads them.
unsafe impl Send for InFlight {}

/// The slot table: which requests the kernel holds.
struct Slots {
    in_flight: Vec<Option<InFlight>>,
    free: Vec<usize>,
}

impl Slots {
    fn in_flight_count(&self) -> usize {
        self.in_flight.len() - self.free.len()
    }
}

struct Shared {
    ring: IoUring,
    core: Arc<FileCore>,
    slots: Mutex<Slots>,
    /// Signalled whenever a slot is freed.
    room: Condvar,
    /// The reaper's thread, where a submission must not wait for room.
    reaper: Mutex<Option<ThreadId>>,
}

/// The ring, its slot table and its reaper.
pub(super) struct Ring {
    shared: Arc<Shared>,
    reaper: Option<JoinHandle<()>>,
    depth: usize,
}

impl Ring {
    /// Sets up a ring of `depth` entries over `core`'s file and starts its reaper.
    pub(super) fn start(core: &Arc<FileCore>, depth: usize) -> io::Result<Self> {
        let entries = u32::try_from(depth)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "io_uring depth too big"))?;
        let ring = IoUring::new(entries)?;
        let shared = Arc::new(Shared {
            ring,
            core: Arc::clone(core),
            slots: Mutex::new(Slots {
                in_flight: (0..depth).map(|_| None).collect(),
                free: (0..depth).rev().collect(),
            }),
            room: Condvar::new(),
            reaper: Mutex::new(None),
        });
        let reaping = Arc::clone(&shared);
        let reaper = std::thread::Builder::new()
            .name("file-io-uring".into())
            .spawn(move || reap(&reaping))?;
        *shared.reaper.lock() = Some(reaper.thread().id());
        Ok(Ring {
            shared,
            reaper: Some(reaper),
            depth,
        })
    }

    /// Requests in flight at most.
    pub(super) fn depth(&self) -> usize {
        self.depth
    }

    /// Hands `jobs` to the kernel, waiting for slots while `depth` requests are in flight.
    /// Requests the kernel cannot take as they are (misaligned O_DIRECT memory, too many
    /// slices) are done in this thread.
    pub(super) fn submit(&self, jobs: Vec<Job>) {
        let on_reaper = *self.shared.reaper.lock() == Some(std::thread::current().id());
        let mut slots = self.shared.slots.lock();
        let mut queued = 0;
        for mut job in jobs {
            let iovecs = job.iovecs();
            if !self.kernel_takes(&iovecs, job.offset()) {
                drop_guard_and(&mut slots, || job.finish_here(&self.shared.core, 0));
                continue;
            }
            if slots.free.is_empty() && on_reaper {
                // Only the reaper frees slots: do this one here rather than wait for itself.
                drop_guard_and(&mut slots, || job.finish_here(&self.shared.core, 0));
                continue;
            }
            while slots.free.is_empty() {
                if queued > 0 {
                    self.push_to_kernel();
                    queued = 0;
                }
                self.shared.room.wait(&mut slots);
            }
            let slot = slots.free.pop().expect("a free slot was waited for");
            let iovecs = iovecs.into_boxed_slice();
            let entry = self.entry(&job, &iovecs, slot);
            slots.in_flight[slot] = Some(InFlight {
                job,
                _iovecs: iovecs,
            });
            // SAFETY: the entry's iovecs and the memory they point at live in the slot table
            // until the reaper takes the completion; the queue is pushed only under `slots`,
            // and has `depth` entries, as many as there are slots, so it cannot be full.
            unsafe {
                self.shared
                    .ring
                    .submission_shared()
                    .push(&entry)
                    .expect("the submission queue has a place for every slot");
            }
            queued += 1;
        }
        if queued > 0 {
            self.push_to_kernel();
        }
    }

    fn kernel_takes(&self, iovecs: &[libc::iovec], offset: u64) -> bool {
        let core = &self.shared.core;
        !iovecs.is_empty()
            && iovecs.len() <= SLICES_PER_REQUEST_MAX
            && (!core.direct
                || core.direct_ready(
                    iovecs
                        .iter()
                        .map(|iovec| (iovec.iov_len, iovec.iov_base as usize)),
                    offset,
                ))
    }

    fn entry(&self, job: &Job, iovecs: &[libc::iovec], slot: usize) -> io_uring::squeue::Entry {
        let fd = types::Fd(self.shared.core.file.as_raw_fd());
        let count = iovecs.len() as u32;
        let entry = match job {
            Job::Read(_) => opcode::Readv::new(fd, iovecs.as_ptr(), count)
                .offset(job.offset())
                .build(),
            Job::Write(_) => opcode::Writev::new(fd, iovecs.as_ptr(), count)
                .offset(job.offset())
                .build(),
        };
        entry.user_data(slot as u64)
    }

    /// Tells the kernel about the entries pushed so far. Called with the slot table locked.
    fn push_to_kernel(&self) {
        // A failure here (only EINTR or EBUSY are expected) leaves the entries in the queue,
        // where the reaper's next wait submits them.
        let _ = self.shared.ring.submit();
    }
}

/// Runs `work` with the slot table unlocked (a request done in the caller's thread must not
/// hold up the reaper), then locks it again.
fn drop_guard_and(slots: &mut parking_lot::MutexGuard<'_, Slots>, work: impl FnOnce()) {
    parking_lot::MutexGuard::unlocked(slots, work);
}

impl Drop for Ring {
    fn drop(&mut self) {
        // Wait for every request in flight, then stop the reaper with a no-op.
        let mut slots = self.shared.slots.lock();
        while slots.in_flight_count() > 0 {
            self.shared.room.wait(&mut slots);
        }
        let stop = opcode::Nop::new().build().user_data(STOP);
        // SAFETY: no request is in flight, so the queue is empty; the no-op points at nothing.
        unsafe {
            self.shared
                .ring
                .submission_shared()
                .push(&stop)
                .expect("an empty submission queue has room for the no-op");
        }
        self.push_to_kernel();
        drop(slots);
        if let Some(reaper) = self.reaper.take() {
            let _ = reaper.join();
        }
    }
}

/// How long the reaper pauses after a wait for completions failed with none arrived.
const REAP_RETRY_PAUSE: std::time::Duration = std::time::Duration::from_millis(1);

/// The reaper: waits for completions and ends their requests until told to stop.
///
/// A failed wait is tried again: the kernel still holds the memory of every request in
/// flight, so none of them may be handed back before its completion arrives.
fn reap(shared: &Shared) {
    loop {
        let waited = shared.ring.submit_and_wait(1);
        // SAFETY: this thread is the completion queue's only consumer.
        let completions: Vec<(u64, i32)> = unsafe { shared.ring.completion_shared() }
            .map(|entry| (entry.user_data(), entry.result()))
            .collect();
        if completions.is_empty() && waited.is_err() {
            // Interrupted, or refused for now: sleep briefly before waiting again rather
            // than yielding in a loop, which spins if the refusal lasts.
            std::thread::sleep(REAP_RETRY_PAUSE);
        }
        let mut stop = false;
        for (user_data, result) in completions {
            if user_data == STOP {
                stop = true;
                continue;
            }
            let in_flight = take_slot(shared, user_data as usize);
            finish(&shared.core, in_flight.job, result);
        }
        if stop {
            return;
        }
    }
}

fn take_slot(shared: &Shared, slot: usize) -> InFlight {
    let mut slots = shared.slots.lock();
    let in_flight = slots.in_flight[slot]
        .take()
        .expect("a completion names a slot in flight");
    slots.free.push(slot);
    shared.room.notify_all();
    in_flight
}

/// Ends a request with the kernel's `result`: bytes moved, or a negated errno.
fn finish(core: &FileCore, job: Job, result: i32) {
    let length = job.length_bytes();
    match usize::try_from(result) {
        Ok(moved) if moved as u64 == length => job.complete(Ok(())),
        // A short transfer (end of a file being resized, a signal): the rest the usual way,
        // which retries until every byte has moved or says why not.
        Ok(moved) => job.finish_here(core, moved),
        Err(_) => {
            let error = io::Error::from_raw_os_error(-result);
            if matches!(-result, libc::EAGAIN | libc::EINTR) {
                job.finish_here(core, 0);
            } else {
                let what = if matches!(job, Job::Read(_)) {
                    "read"
                } else {
                    "write"
                };
                let error = core.annotate(what, job.offset(), length, error);
                job.complete(Err(error));
            }
        }
    }
}
