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

/// What a wait is for. Each cause has its own waiters and its own notifications, so an
/// event wakes only the threads waiting for it (a buffer freed wakes no flush waiting for its
/// writes, a write completing no writer waiting for space).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WaitCause {
    /// Room for a buffer: a buffer freed, a clean buffer's last unpin, write-back that
    /// cleaned buffers. One freed or evictable buffer serves one waiter, so these events wake
    /// one waiter per buffer ([`Wake::One`], [`Wake::Count`]).
    Space,
    /// A device's write-back slot given back, or its write-back in flight ending.
    WritebackSlot,
    /// The writes of a batch a pass waits for have all completed.
    WritesDone,
    /// One buffer's write-back in flight ended (a thread marked it waited for).
    WritebackEnd,
    /// Nothing notifies: a paced look again (a discard or zeroing in flight, a block held
    /// by someone that a visitor waits for).
    Poll,
}

impl WaitCause {
    /// Every cause, in order: an implementation keeps one queue per entry.
    pub const ALL: [WaitCause; 5] = [
        WaitCause::Space,
        WaitCause::WritebackSlot,
        WaitCause::WritesDone,
        WaitCause::WritebackEnd,
        WaitCause::Poll,
    ];

    /// The cause's position in [`WaitCause::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// How many waiters of a cause a notification wakes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wake {
    /// One waiter: one freed buffer can satisfy only one.
    One,
    /// Up to this many waiters: as many units as were freed at once.
    Count(usize),
    /// Every waiter: each needs the event (a batch's writes all done).
    All,
}

/// Blocks the calling thread until something it waits for may have changed (memory released,
/// a write-back finished), or a timeout passes.
///
/// Waiting goes through this trait so that the engine never touches real time: a server
/// injects a blocking implementation (`bufcache-host`), the simulator and deterministic tests
/// inject [`NoWait`] or a virtual-time waiter, and the engine's waits stay bounded because it
/// counts each wait no notification ended as the full timeout.
///
/// The contract, per cause:
/// - a notification after a ticket was taken is never lost: a [`Waiter::wait`] with that
///   ticket returns at once, and among the threads asleep on the cause when it came, at
///   least as many as the [`Wake`] asks for (or all of them, if fewer) wake;
/// - a notification of one cause wakes no waiter of another;
/// - a wait may return early (spuriously); the caller always looks again.
///
/// A waiter woken by [`Wake::One`] that leaves without using what freed up passes the wake
/// on (the engine's space waits do, see `docs/design.md`, "Waits").
pub trait Waiter: Send + Sync {
    /// A ticket naming the cause's current state. Take it before checking the condition and
    /// pass it to [`Waiter::wait`], so a notification between the check and the wait is not
    /// lost.
    fn ticket(&self, cause: WaitCause) -> u64;

    /// Returns when `cause` was notified since `ticket` was taken, or after at most
    /// `timeout_ns`, whichever comes first. May return early.
    fn wait(&self, cause: WaitCause, ticket: u64, timeout_ns: u64);

    /// Wakes waiters of `cause`: one, some or all (see [`Wake`]).
    fn notify(&self, cause: WaitCause, wake: Wake);
}

/// Never blocks: every wait returns at once. Deterministic, for tests and simulation.
pub struct NoWait;

impl Waiter for NoWait {
    fn ticket(&self, _cause: WaitCause) -> u64 {
        0
    }

    fn wait(&self, _cause: WaitCause, _ticket: u64, _timeout_ns: u64) {}

    fn notify(&self, _cause: WaitCause, _wake: Wake) {}
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
