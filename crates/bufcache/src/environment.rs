//! What the engine takes from its environment, injected: time and background execution.
//!
//! The engine never reads the wall clock or starts threads on its own. A server passes
//! [`SystemClock`] and a [`ThreadPool`]; the simulator passes a virtual clock and an inline or
//! deterministic spawner, so the same engine code runs in simulation.

use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

/// A monotonic clock in nanoseconds from an arbitrary origin.
pub trait Clock: Send + Sync {
    /// Nanoseconds since the clock's origin. Never decreases.
    fn now_ns(&self) -> u64;
}

/// The host's monotonic clock.
pub struct SystemClock {
    origin: Instant,
}

impl SystemClock {
    /// A clock whose origin is now.
    pub fn new() -> Self {
        SystemClock {
            origin: Instant::now(),
        }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    fn now_ns(&self) -> u64 {
        self.origin.elapsed().as_nanos() as u64
    }
}

/// A unit of background work: read-ahead or write-behind.
pub type Job = Box<dyn FnOnce() + Send>;

/// Runs background jobs. A spawner may refuse a job (returning it) when its queue is full;
/// the engine then either runs it inline or drops it when the job is only an optimisation.
pub trait Spawner: Send + Sync {
    /// Queues `job`, or gives it back when no more can be queued.
    fn spawn(&self, job: Job) -> Result<(), Job>;
}

/// Runs every job at once on the caller's thread: deterministic, for tests and simulation.
pub struct InlineSpawner;

impl Spawner for InlineSpawner {
    fn spawn(&self, job: Job) -> Result<(), Job> {
        job();
        Ok(())
    }
}

/// Refuses every job: background work is then skipped (read-ahead) or done inline.
pub struct NoSpawner;

impl Spawner for NoSpawner {
    fn spawn(&self, job: Job) -> Result<(), Job> {
        Err(job)
    }
}

/// A fixed set of worker threads fed by a bounded queue.
pub struct ThreadPool {
    sender: Mutex<Option<SyncSender<Job>>>,
}

impl ThreadPool {
    /// Starts `workers` threads named `name` with room for `queued_max` waiting jobs.
    pub fn new(name: &str, workers: usize, queued_max: usize) -> Arc<Self> {
        let (sender, receiver) = sync_channel::<Job>(queued_max);
        let receiver = Arc::new(Mutex::new(receiver));
        for index in 0..workers.max(1) {
            let receiver = Arc::clone(&receiver);
            std::thread::Builder::new()
                .name(format!("{name}-{index}"))
                .spawn(move || loop {
                    let job = receiver.lock().recv();
                    match job {
                        Ok(job) => job(),
                        Err(_) => return,
                    }
                })
                .expect("starting a worker thread");
        }
        Arc::new(ThreadPool {
            sender: Mutex::new(Some(sender)),
        })
    }

    /// Stops accepting jobs; workers exit once the queue is drained.
    pub fn shutdown(&self) {
        self.sender.lock().take();
    }
}

impl Spawner for ThreadPool {
    fn spawn(&self, job: Job) -> Result<(), Job> {
        let sender = self.sender.lock();
        match sender.as_ref() {
            None => Err(job),
            Some(sender) => sender.try_send(job).map_err(|error| match error {
                TrySendError::Full(job) | TrySendError::Disconnected(job) => job,
            }),
        }
    }
}
