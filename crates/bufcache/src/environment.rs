//! What the engine takes from its environment, injected: time, background execution, waiting.
//!
//! The engine never reads the wall clock, sleeps, blocks on a timer or starts threads on its
//! own (clippy's `disallowed-methods` in this crate's `clippy.toml` enforces it). A server
//! passes the system clock, a thread pool and a blocking waiter from `bufcache-host`; the
//! simulator passes a virtual clock, an inline or deterministic spawner and [`NoWait`], so the
//! same engine code runs in simulation.

use std::sync::Arc;

pub use bufcache_device::clock::Clock;

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

/// Blocks the calling thread until something it waits for may have changed (memory released,
/// a write-back finished), or a timeout passes.
///
/// Waiting goes through this trait so that the engine never touches real time: a server
/// injects a blocking implementation (`bufcache-host`), the simulator and deterministic tests
/// inject [`NoWait`], whose waits return at once, and the engine's waits stay bounded because
/// it counts each wait as the full timeout.
pub trait Waiter: Send + Sync {
    /// A ticket naming the current state. Take it before checking the condition and pass it
    /// to [`Waiter::wait`], so a notification between the check and the wait is not lost.
    fn ticket(&self) -> u64;

    /// Returns when [`Waiter::notify_all`] has been called since `ticket` was taken, or after
    /// at most `timeout_ns`, whichever comes first. May return early.
    fn wait(&self, ticket: u64, timeout_ns: u64);

    /// Wakes every waiter.
    fn notify_all(&self);
}

/// Never blocks: every wait returns at once. Deterministic, for tests and simulation.
pub struct NoWait;

impl Waiter for NoWait {
    fn ticket(&self) -> u64 {
        0
    }

    fn wait(&self, _ticket: u64, _timeout_ns: u64) {}

    fn notify_all(&self) {}
}

/// A clock that always reads zero: for deterministic tests that do not age dirty data.
pub struct FrozenClock;

impl Clock for FrozenClock {
    fn now_ns(&self) -> u64 {
        0
    }
}

/// The injected environment of a cache: time, background execution and waiting.
#[derive(Clone)]
pub struct Environment {
    clock: Arc<dyn Clock>,
    spawner: Arc<dyn Spawner>,
    waiter: Arc<dyn Waiter>,
}

impl Environment {
    /// An environment from its three parts.
    pub fn new(clock: Arc<dyn Clock>, spawner: Arc<dyn Spawner>, waiter: Arc<dyn Waiter>) -> Self {
        Environment {
            clock,
            spawner,
            waiter,
        }
    }

    /// Runs background work at once on the caller's thread and never blocks: deterministic.
    pub fn inline(clock: Arc<dyn Clock>) -> Self {
        Environment::new(clock, Arc::new(InlineSpawner), Arc::new(NoWait))
    }

    /// The time source for dirty ages.
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    /// Runs read-ahead and write-behind in the background.
    pub fn spawner(&self) -> &Arc<dyn Spawner> {
        &self.spawner
    }

    /// Blocks for space and for write-backs in flight.
    pub fn waiter(&self) -> &Arc<dyn Waiter> {
        &self.waiter
    }
}
