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

use bufcache::{
    Cache, CacheConfig, Clock, ConfigError, Environment, Job, Spawner, WaitCause, Waiter, Wake,
};
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

/// Blocks on a condition variable per [`WaitCause`]; a generation counter per cause makes
/// tickets, so a notification between taking a ticket and waiting wakes the waiter at once,
/// and a notification of one cause never wakes a waiter of another. [`Wake::One`] and
/// [`Wake::Count`] wake that many sleepers of the cause (the condition variable's
/// `notify_one`, which reaches a thread asleep on it if there is one); a thread that took its
/// ticket before the notification but was not yet asleep sees the generation moved and
/// returns at once as well, so a wake may reach more threads than asked, never fewer.
pub struct BlockingWaiter {
    queues: [CauseQueue; WaitCause::ALL.len()],
}

/// The waiters of one cause.
#[derive(Default)]
struct CauseQueue {
    generation: Mutex<u64>,
    changed: Condvar,
}

impl Default for BlockingWaiter {
    fn default() -> Self {
        BlockingWaiter {
            queues: std::array::from_fn(|_| CauseQueue::default()),
        }
    }
}

impl Waiter for BlockingWaiter {
    fn ticket(&self, cause: WaitCause) -> u64 {
        *self.queues[cause.index()].generation.lock()
    }

    fn wait(&self, cause: WaitCause, ticket: u64, timeout_ns: u64) {
        let queue = &self.queues[cause.index()];
        let mut generation = queue.generation.lock();
        if *generation == ticket {
            queue
                .changed
                .wait_for(&mut generation, Duration::from_nanos(timeout_ns));
        }
    }

    fn notify(&self, cause: WaitCause, wake: Wake) {
        let queue = &self.queues[cause.index()];
        // The generation moves under the lock a sleeper checks it under, so a thread either
        // sees it moved or is asleep (and reachable by the notify below) when it moves.
        *queue.generation.lock() += 1;
        match wake {
            Wake::One => {
                queue.changed.notify_one();
            }
            Wake::Count(count) => {
                for _ in 0..count {
                    if !queue.changed.notify_one() {
                        break;
                    }
                }
            }
            Wake::All => {
                queue.changed.notify_all();
            }
        }
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
        for cause in WaitCause::ALL {
            for wake in [Wake::One, Wake::Count(3), Wake::All] {
                let ticket = waiter.ticket(cause);
                waiter.notify(cause, wake);
                let start = Instant::now();
                waiter.wait(cause, ticket, 3_600_000_000_000);
                assert!(
                    start.elapsed() < Duration::from_secs(60),
                    "{cause:?} {wake:?}"
                );
            }
        }
    }

    #[test]
    fn a_notification_wakes_no_waiter_of_another_cause() {
        // Goal: causes are separate queues (a buffer freed must not wake a flush waiting for
        // its writes). Method: a thread waits on `WritesDone` with a 300 ms timeout while
        // every other cause is notified, to all; it must sleep its whole timeout, and a
        // notification of its own cause then ends a second wait at once.
        let waiter = Arc::new(BlockingWaiter::default());
        let ticket = waiter.ticket(WaitCause::WritesDone);
        let sleeper = {
            let waiter = Arc::clone(&waiter);
            std::thread::spawn(move || {
                let start = Instant::now();
                waiter.wait(WaitCause::WritesDone, ticket, 300_000_000);
                start.elapsed()
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        for cause in WaitCause::ALL {
            if cause != WaitCause::WritesDone {
                waiter.notify(cause, Wake::All);
            }
        }
        let slept = sleeper.join().unwrap();
        assert!(slept >= Duration::from_millis(250), "woken after {slept:?}");
        let ticket = waiter.ticket(WaitCause::WritesDone);
        waiter.notify(WaitCause::WritesDone, Wake::One);
        let start = Instant::now();
        waiter.wait(WaitCause::WritesDone, ticket, 3_600_000_000_000);
        assert!(start.elapsed() < Duration::from_secs(60));
    }

    #[test]
    fn wake_one_loses_no_wakeup_and_a_waiter_that_leaves_passes_it_on() {
        // Goal: with wake-one, every unit released reaches a waiter that can use it: no
        // waiter sleeps on while a unit is free (a lost wakeup), including when a woken
        // waiter leaves without taking the unit and passes the wake on, as the engine's
        // space waits do. Method: for each seed, C consumers take U units through the
        // ticket protocol (ticket, try to take, else wait an hour); a producer releases the
        // units one at a time with `Wake::One`, at seeded pauses; seeded "quitters" (extra
        // waiters) leave after their first wake without taking, passing it on. Every
        // consumer must finish within 60 s (an hour-long wait means a lost wakeup), with every
        // unit taken; seeds are printed on failure. Quitters still asleep then (no wake was
        // theirs) are ended with a wake-all.
        use std::sync::atomic::{AtomicU64, Ordering};
        for seed in 1..=20u64 {
            let mut rng = bufcache::device::SeededRng::new(seed);
            let consumers = 2 + rng.below(10) as usize;
            let quitters = rng.below(4) as usize;
            let waiter = Arc::new(BlockingWaiter::default());
            let units = Arc::new(AtomicU64::new(0));
            let take = |units: &AtomicU64| {
                units
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |free| {
                        free.checked_sub(1)
                    })
                    .is_ok()
            };
            let mut threads = Vec::new();
            for _ in 0..consumers {
                let (waiter, units) = (Arc::clone(&waiter), Arc::clone(&units));
                threads.push(std::thread::spawn(move || loop {
                    let ticket = waiter.ticket(WaitCause::Space);
                    if take(&units) {
                        return;
                    }
                    waiter.wait(WaitCause::Space, ticket, 3_600_000_000_000);
                }));
            }
            let mut quitting = Vec::new();
            for _ in 0..quitters {
                let (waiter, units) = (Arc::clone(&waiter), Arc::clone(&units));
                quitting.push(std::thread::spawn(move || {
                    let ticket = waiter.ticket(WaitCause::Space);
                    if units.load(Ordering::Acquire) == 0 {
                        waiter.wait(WaitCause::Space, ticket, 3_600_000_000_000);
                    }
                    // Leaves without taking what woke it: the next waiter gets the wake.
                    waiter.notify(WaitCause::Space, Wake::One);
                }));
            }
            let pauses: Vec<u64> = (0..consumers).map(|_| rng.below(3)).collect();
            for pause_ms in pauses {
                std::thread::sleep(Duration::from_millis(pause_ms));
                units.fetch_add(1, Ordering::AcqRel);
                waiter.notify(WaitCause::Space, Wake::One);
            }
            let deadline = Instant::now() + Duration::from_secs(60);
            for thread in threads {
                while !thread.is_finished() {
                    assert!(
                        Instant::now() < deadline,
                        "seed {seed}: a waiter slept on with a unit free (lost wakeup): \
                         {consumers} consumers, {quitters} quitters"
                    );
                    std::thread::sleep(Duration::from_millis(1));
                }
                thread.join().unwrap();
            }
            assert_eq!(units.load(Ordering::Acquire), 0, "seed {seed}");
            // A quitter still asleep got no wake (every one went to a consumer, as it
            // should): end it.
            waiter.notify(WaitCause::Space, Wake::All);
            for thread in quitting {
                thread.join().unwrap();
            }
        }
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
