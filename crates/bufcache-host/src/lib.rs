#![deny(missing_docs)]
//! The engine's environment on a real machine.
//!
//! The engine (`bufcache`) takes time, background execution and waiting as injected traits and
//! touches no operating-system primitive itself. This crate holds their system implementations:
//! [`SystemClock`] (the monotonic clock), [`ThreadPool`] (bounded background workers) and
//! [`BlockingWaiter`] (a condition variable with a timeout). Servers and command-line tools
//! build caches with [`system_cache`]; the simulator uses its own virtual implementations.
//! It also holds [`rescue`]: the file a server saves dirty data to when it cannot write it
//! back, and the rule deciding whether it may be replayed, shared by the server and the
//! simulator's checker.

#![warn(missing_docs)]

pub mod rescue;

use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bufcache::{Cache, CacheConfig, Clock, ConfigError, Environment, Job, Spawner, Waiter};
use parking_lot::{Condvar, Mutex};

/// Background workers a cache built by [`system_cache`] runs read-ahead and write-behind on.
pub const BACKGROUND_WORKERS: usize = 4;

/// A cache with the host clock, [`BACKGROUND_WORKERS`] background threads and a blocking waiter.
pub fn system_cache(config: CacheConfig) -> Result<Cache, ConfigError> {
    let environment = system_environment(BACKGROUND_WORKERS, config.background_jobs_queued_max);
    Cache::with_environment(config, environment)
}

/// The host clock, a pool of `workers` threads with room for `queued_max` jobs, and a
/// blocking waiter.
pub fn system_environment(workers: usize, queued_max: usize) -> Environment {
    Environment::new(
        Arc::new(SystemClock::new()),
        ThreadPool::new("bufcache-io", workers, queued_max),
        Arc::new(BlockingWaiter::default()),
    )
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

/// Blocks on a condition variable; a generation counter makes tickets, so a notification
/// between taking a ticket and waiting wakes the waiter at once.
#[derive(Default)]
pub struct BlockingWaiter {
    generation: Mutex<u64>,
    changed: Condvar,
}

impl Waiter for BlockingWaiter {
    fn ticket(&self) -> u64 {
        *self.generation.lock()
    }

    fn wait(&self, ticket: u64, timeout_ns: u64) {
        let mut generation = self.generation.lock();
        if *generation == ticket {
            self.changed
                .wait_for(&mut generation, Duration::from_nanos(timeout_ns));
        }
    }

    fn notify_all(&self) {
        *self.generation.lock() += 1;
        self.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notification_after_ticket_is_not_lost() {
        // Goal: the ticket protocol never misses a wake-up (a lost one would stall a space
        // wait for its whole timeout). Method: notify after taking the ticket, then wait with
        // an hour's timeout; the wait must return at once.
        let waiter = BlockingWaiter::default();
        let ticket = waiter.ticket();
        waiter.notify_all();
        let start = Instant::now();
        waiter.wait(ticket, 3_600_000_000_000);
        assert!(start.elapsed() < Duration::from_secs(60));
    }

    #[test]
    fn thread_pool_runs_jobs_and_refuses_after_shutdown() {
        // Goal: jobs run on the workers; a stopped pool hands jobs back instead of losing them.
        // Method: run one job and wait for its signal; shut down; the next spawn returns Err.
        let pool = ThreadPool::new("test", 1, 4);
        let (sender, receiver) = std::sync::mpsc::channel();
        pool.spawn(Box::new(move || sender.send(7).unwrap()))
            .unwrap_or_else(|_| panic!("queue has room"));
        assert_eq!(receiver.recv().unwrap(), 7);
        pool.shutdown();
        assert!(pool.spawn(Box::new(|| {})).is_err());
    }
}
