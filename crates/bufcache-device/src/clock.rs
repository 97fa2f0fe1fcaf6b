//! The one notion of time below the composition root: a monotonic clock injected by whoever
//! builds the stack (the host's system clock, the simulator's virtual clock), so that the
//! engine and the backends below it never read a wall clock themselves.

/// A monotonic clock in nanoseconds from an arbitrary origin.
pub trait Clock: Send + Sync {
    /// Nanoseconds since the clock's origin. Never decreases.
    fn now_ns(&self) -> u64;
}
