//! The lease: how long a writable server may go on acknowledging writes and FLUSHes after its
//! last successful renewal of the disk lock, and how long a server that wants the disk waits
//! before it takes a lock nobody renews (docs/s3.md, "Leases and takeover").
//!
//! Timing argument (clock-rate bound `ρ`, [`CLOCK_RATE_ERROR_MAX`]): the holder renews every
//! `lease / 3` with a PUT conditional on the ETag of its own last write of the lock object,
//! taking the time `s` on its monotonic clock *before* sending it. When that PUT succeeds the
//! holder may acknowledge until `s + lease − margin` ([`Lease::renewed`]); the store carried the
//! PUT out after `s`. A taker that saw the lock object with some ETag at its local time `o`
//! (the GET's answer arrived after the store held that ETag, so after every holder send time
//! `s` of a renewal that produced it) takes the disk only with a PUT conditional on that same
//! ETag, sent once its own clock says `o + lease` passed: so no renewal landed in between, and
//! in real time the taker's PUT comes at least `lease / (1 + ρ)` after `s`, while the holder
//! stopped at most `(lease − margin) / (1 − ρ)` after `s`. With `margin = lease / 5` that order
//! holds for every `ρ ≤ 1/9`; real clocks drift by less than 0.1 %, and the rest of the margin
//! covers the time between the holder's last check and its reply reaching the socket.
//!
//! No wall clock is read here: time comes from an injected [`Clock`], so tests and the
//! simulator can drive the lease on virtual time.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bufcache_device::Clock;

/// Default lease when the URL gives no `lease=`, in milliseconds.
pub const LEASE_DEFAULT_MS: u64 = 15_000;
/// The shortest `lease=` accepted at all; the open also refuses a lease shorter than
/// [`LEASE_ROUND_TRIPS_MIN`] round trips of the lock's own PUT.
pub const LEASE_MIN_MS: u64 = 1_000;
/// The longest `lease=` accepted: a takeover waits a whole lease.
pub const LEASE_MAX_MS: u64 = 600_000;
/// A lease must span at least this many round trips of the lock's PUT (measured at open):
/// renewing every third of it leaves room for a few slow renewals before the holder stops.
pub const LEASE_ROUND_TRIPS_MIN: u64 = 10;
/// The bound on how much two machines' monotonic clocks may differ in rate, which the margin
/// covers (as a fraction: 1/9 ≈ 11 %).
pub const CLOCK_RATE_ERROR_MAX: f64 = 1.0 / 9.0;

/// The margin the holder keeps before its lease ends: a fifth of the lease.
pub fn margin_ns(lease_ns: u64) -> u64 {
    lease_ns / 5
}

/// How often the holder renews: a third of the lease.
pub fn renewal_interval_ns(lease_ns: u64) -> u64 {
    lease_ns / 3
}

/// Why the holder may no longer acknowledge writes.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LeaseError {
    /// No renewal succeeded within the lease (less the margin): another server may take the
    /// disk soon, so nothing more is acknowledged.
    #[error("the lease on the disk lapsed: no renewal of the lock succeeded for {since_renewal_ms} ms (lease {lease_ms} ms); writes are no longer acknowledged")]
    Lapsed {
        lease_ms: u64,
        since_renewal_ms: u64,
    },
    /// The lock object was changed by someone else: another server took the disk.
    #[error(
        "the disk was taken over by another server ({holder}); writes are no longer acknowledged"
    )]
    TakenOver { holder: String },
}

/// The holder's side of a lease: until when it may acknowledge.
pub struct Lease {
    clock: Arc<dyn Clock>,
    lease_ns: u64,
    /// The send time of the newest successful renewal (or of the lock's create), clock ns.
    renewed_sent_ns: AtomicU64,
    /// Set once the lock is known to be someone else's; never cleared.
    taken_over: Mutex<Option<String>>,
}

impl Lease {
    /// A lease of `lease_ns` whose first hold was a PUT sent at `sent_ns` (clock ns).
    pub fn new(clock: Arc<dyn Clock>, lease_ns: u64, sent_ns: u64) -> Lease {
        assert!(lease_ns > 0, "a lease of zero would never hold");
        assert!(margin_ns(lease_ns) < lease_ns);
        Lease {
            clock,
            lease_ns,
            renewed_sent_ns: AtomicU64::new(sent_ns),
            taken_over: Mutex::new(None),
        }
    }

    pub fn lease_ns(&self) -> u64 {
        self.lease_ns
    }

    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    /// A renewal PUT sent at `sent_ns` succeeded. A renewal that answers after a later one
    /// never moves the hold back.
    pub fn renewed(&self, sent_ns: u64) {
        let previous = self.renewed_sent_ns.fetch_max(sent_ns, Ordering::AcqRel);
        debug_assert!(previous <= self.clock.now_ns());
    }

    /// The lock now belongs to `holder`: nothing is acknowledged any more, whatever the time.
    pub fn taken_over(&self, holder: String) {
        let mut taken = self.taken_over.lock().unwrap_or_else(|p| p.into_inner());
        taken.get_or_insert(holder);
    }

    /// Nanoseconds since the send time of the newest successful renewal.
    pub fn age_ns(&self) -> u64 {
        self.clock
            .now_ns()
            .saturating_sub(self.renewed_sent_ns.load(Ordering::Acquire))
    }

    /// Ok while the holder may acknowledge writes and FLUSHes: the lock is still its own and
    /// less than `lease − margin` passed since the send time of its newest renewal.
    pub fn check(&self) -> Result<(), LeaseError> {
        if let Some(holder) = &*self.taken_over.lock().unwrap_or_else(|p| p.into_inner()) {
            return Err(LeaseError::TakenOver {
                holder: holder.clone(),
            });
        }
        let age_ns = self.age_ns();
        if age_ns >= self.lease_ns - margin_ns(self.lease_ns) {
            return Err(LeaseError::Lapsed {
                lease_ms: self.lease_ns / 1_000_000,
                since_renewal_ms: age_ns / 1_000_000,
            });
        }
        Ok(())
    }
}

/// The taker's side: watches the lock object's ETag and says when it has stood unchanged for
/// a whole lease on the taker's clock.
pub struct LapseWatch {
    lease_ns: u64,
    /// The ETag last seen and the clock time it was first seen.
    seen: Option<(String, u64)>,
}

impl LapseWatch {
    pub fn new(lease_ns: u64) -> LapseWatch {
        LapseWatch {
            lease_ns,
            seen: None,
        }
    }

    /// Records that a read answered at `now_ns` found the lock with `e_tag`; true when that
    /// ETag has now been seen unchanged for at least a whole lease, so a PUT conditional on
    /// it may take the disk.
    pub fn observe(&mut self, e_tag: &str, now_ns: u64) -> bool {
        match &self.seen {
            Some((seen, since_ns)) if seen == e_tag => {
                now_ns.saturating_sub(*since_ns) >= self.lease_ns
            }
            _ => {
                self.seen = Some((e_tag.to_string(), now_ns));
                false
            }
        }
    }

    /// Whether the lock changed (was renewed) since the first read.
    pub fn since_ns(&self) -> Option<u64> {
        self.seen.as_ref().map(|(_, since)| *since)
    }
}

/// The writer's lease as a standby sees it: when the standby last saw the lock object change
/// (each renewal writes a new body, so a new ETag). Its age is how long the writer has gone
/// unrenewed as far as this standby knows; the standby takes the disk once it reaches a lease.
pub struct LeaseSeen {
    clock: MonotonicClock,
    /// Clock time at which the lock's current ETag was first seen, plus one; 0: not seen yet.
    since_ns_plus_one: AtomicU64,
}

impl LeaseSeen {
    pub fn new() -> LeaseSeen {
        LeaseSeen {
            clock: MonotonicClock::new(),
            since_ns_plus_one: AtomicU64::new(0),
        }
    }

    /// A read of the lock found an ETag not seen before: the writer renewed.
    pub fn renewal_seen(&self) {
        self.since_ns_plus_one
            .store(self.clock.now_ns().saturating_add(1), Ordering::Release);
    }

    /// Seconds since the newest renewal seen; None before the lock was first read.
    pub fn age_seconds(&self) -> Option<f64> {
        let since = self
            .since_ns_plus_one
            .load(Ordering::Acquire)
            .checked_sub(1)?;
        Some(self.clock.now_ns().saturating_sub(since) as f64 / 1e9)
    }
}

impl Default for LeaseSeen {
    fn default() -> Self {
        LeaseSeen::new()
    }
}

/// A monotonic clock for the lease outside the simulator.
pub struct MonotonicClock {
    origin: std::time::Instant,
}

impl MonotonicClock {
    pub fn new() -> MonotonicClock {
        MonotonicClock {
            origin: std::time::Instant::now(),
        }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        MonotonicClock::new()
    }
}

impl Clock for MonotonicClock {
    fn now_ns(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct ManualClock(AtomicU64);

    impl Clock for ManualClock {
        fn now_ns(&self) -> u64 {
            self.0.load(Ordering::Acquire)
        }
    }

    const SECOND_NS: u64 = 1_000_000_000;

    // Goal: the holder acknowledges only within lease − margin of its newest renewal's send
    // time, a late answer never moves the hold back, and a takeover is final. Method: a lease
    // of 10 s on a manual clock; renew, advance across the edges, renew out of order, take.
    #[test]
    fn a_holder_acknowledges_only_within_lease_less_margin_of_its_last_renewal_sent() {
        let clock = Arc::new(ManualClock(AtomicU64::new(100 * SECOND_NS)));
        let lease = Lease::new(clock.clone(), 10 * SECOND_NS, 100 * SECOND_NS);
        assert_eq!(lease.check(), Ok(()));
        clock.0.store(108 * SECOND_NS - 1, Ordering::Release);
        assert_eq!(lease.check(), Ok(()));
        clock.0.store(108 * SECOND_NS, Ordering::Release);
        assert!(matches!(lease.check(), Err(LeaseError::Lapsed { .. })));
        // A renewal sent at 105 s answered now holds until 113 s.
        lease.renewed(105 * SECOND_NS);
        assert_eq!(lease.check(), Ok(()));
        // An older renewal answering late changes nothing.
        lease.renewed(101 * SECOND_NS);
        clock.0.store(112 * SECOND_NS, Ordering::Release);
        assert_eq!(lease.check(), Ok(()));
        clock.0.store(113 * SECOND_NS, Ordering::Release);
        assert!(lease.check().is_err());
        lease.renewed(112 * SECOND_NS);
        assert_eq!(lease.check(), Ok(()));
        lease.taken_over("host b".to_string());
        lease.renewed(113 * SECOND_NS);
        assert!(matches!(lease.check(), Err(LeaseError::TakenOver { .. })));
    }

    // Goal: a taker takes only an ETag it saw unchanged for a whole lease, and every change
    // restarts the wait; with the margin, the holder has stopped by then for any clock-rate
    // error within the bound. Method: observe ETags on a timeline; check the inequality of
    // the timing argument at the bound.
    #[test]
    fn a_taker_waits_a_whole_lease_after_the_last_change_it_saw() {
        let lease_ns = 10 * SECOND_NS;
        let mut watch = LapseWatch::new(lease_ns);
        assert!(!watch.observe("a", 0));
        assert!(!watch.observe("a", lease_ns - 1));
        assert!(!watch.observe("b", lease_ns));
        assert!(!watch.observe("b", 2 * lease_ns - 1));
        assert!(watch.observe("b", 2 * lease_ns));
        assert_eq!(watch.since_ns(), Some(lease_ns));
        // (lease − margin) / (1 − ρ) ≤ lease / (1 + ρ) at ρ = CLOCK_RATE_ERROR_MAX.
        let rho = CLOCK_RATE_ERROR_MAX;
        let holder_stop = (lease_ns - margin_ns(lease_ns)) as f64 / (1.0 - rho);
        let taker_take = lease_ns as f64 / (1.0 + rho);
        assert!(
            holder_stop <= taker_take + 1.0,
            "{holder_stop} > {taker_take}"
        );
        assert!(renewal_interval_ns(lease_ns) * 2 < lease_ns - margin_ns(lease_ns));
    }
}
