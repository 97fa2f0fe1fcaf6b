//! Group commit for flushes: callers that ask for a flush while another caller's is running
//! share the next one instead of each waiting for its own.
//!
//! A client with several FLUSH requests in flight (fio `--fsync`, a journaling filesystem
//! on top) otherwise has each of them run `fdatasync` in turn, although one sync that starts
//! after all of them were asked covers them all: it makes durable everything written before
//! it started. Each caller draws a ticket before its sync is due; whoever holds the group's
//! lock records how far the tickets went just before it syncs, and a caller whose ticket is
//! within that range returns that sync's outcome without syncing again.
//!
//! A failed sync fails every caller it covered, even after a later sync succeeds: after a
//! failed `fdatasync` the kernel may have dropped the dirty pages, so a later success proves
//! nothing about the data the failed one was to write (the fsyncgate lesson).

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::sync::SleepingMutex;

/// Failed syncs remembered exactly; beyond this, every ticket up to the oldest forgotten
/// failure counts as failed (wrongly failing a flush is safe, wrongly passing one is not).
const FAILURES_KEPT_MAX: usize = 256;

/// Combines concurrent flushes of one device (see the module notes).
#[derive(Debug, Default)]
pub struct FlushGroup {
    /// Tickets drawn so far; a ticket is drawn when a flush is asked for.
    requested: AtomicU64,
    state: SleepingMutex<GroupState>,
}

#[derive(Debug, Default)]
struct GroupState {
    /// Every ticket up to this one is covered by a sync that has ended.
    completed: u64,
    /// Syncs that failed: the tickets they covered and their error.
    failures: Vec<Failure>,
    /// Tickets up to here count as failed (their records were dropped for the bound).
    failed_through: u64,
    /// Syncs run, and flushes answered by another caller's sync.
    syncs: u64,
    joined: u64,
}

#[derive(Debug)]
struct Failure {
    first: u64,
    last: u64,
    kind: io::ErrorKind,
    message: String,
}

/// How many syncs ran and how many flushes shared another's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlushGroupStats {
    /// Syncs actually run.
    pub syncs: u64,
    /// Flushes answered by a sync another caller ran.
    pub joined: u64,
}

impl FlushGroup {
    /// A group with no flush asked for yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes everything the caller wrote before this call durable with `sync`, or with a
    /// sync another caller starts after this call; returns that sync's outcome.
    pub fn flush(&self, sync: impl FnOnce() -> io::Result<()>) -> io::Result<()> {
        let ticket = self.requested.fetch_add(1, Ordering::AcqRel) + 1;
        let mut state = self.state.lock();
        if ticket <= state.completed {
            state.joined += 1;
            return state.outcome_of(ticket);
        }
        let first = state.completed + 1;
        // Every ticket drawn by now belongs to a flush asked for before this sync starts.
        let last = self.requested.load(Ordering::Acquire);
        debug_assert!(first <= ticket && ticket <= last);
        let result = sync();
        state.completed = last;
        state.syncs += 1;
        if let Err(error) = &result {
            state.record_failure(first, last, error);
        }
        result
    }

    /// Syncs run and flushes that joined another's.
    pub fn stats(&self) -> FlushGroupStats {
        let state = self.state.lock();
        FlushGroupStats {
            syncs: state.syncs,
            joined: state.joined,
        }
    }
}

impl GroupState {
    fn outcome_of(&self, ticket: u64) -> io::Result<()> {
        if ticket <= self.failed_through {
            return Err(io::Error::other(
                "an earlier flush covering this one failed (its error is no longer kept)",
            ));
        }
        match self
            .failures
            .iter()
            .find(|failure| failure.first <= ticket && ticket <= failure.last)
        {
            Some(failure) => Err(io::Error::new(
                failure.kind,
                format!("{} (a concurrent flush's sync)", failure.message),
            )),
            None => Ok(()),
        }
    }

    fn record_failure(&mut self, first: u64, last: u64, error: &io::Error) {
        if self.failures.len() >= FAILURES_KEPT_MAX {
            let dropped = self.failures.remove(0);
            self.failed_through = self.failed_through.max(dropped.last);
        }
        self.failures.push(Failure {
            first,
            last,
            kind: error.kind(),
            message: error.to_string(),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::{Arc, Barrier};
    use std::time::Duration;

    #[test]
    fn concurrent_flushes_share_syncs_and_all_succeed() {
        // Goal: flushes asked for while a sync runs share the next one. Method: 8 threads
        // flush at once through a sync that takes 20 ms; fewer than 8 syncs run, every
        // flush succeeds, and the counts add up.
        let group = Arc::new(FlushGroup::new());
        let syncs = Arc::new(AtomicUsize::new(0));
        let start = Arc::new(Barrier::new(8));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (group, syncs, start) = (group.clone(), syncs.clone(), start.clone());
                std::thread::spawn(move || {
                    start.wait();
                    group.flush(|| {
                        syncs.fetch_add(1, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_millis(20));
                        Ok(())
                    })
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap().expect("every flush succeeds");
        }
        let ran = syncs.load(Ordering::SeqCst) as u64;
        assert!(ran < 8, "8 concurrent flushes ran {ran} syncs");
        let stats = group.stats();
        assert_eq!(stats.syncs, ran);
        assert_eq!(stats.syncs + stats.joined, 8);
    }

    #[test]
    fn a_flush_asked_for_during_a_sync_gets_a_sync_of_its_own() {
        // Goal: a sync never answers a flush asked for after it started (that flush's writes
        // may have missed it). Method: the first sync blocks until a second flush has drawn
        // its ticket; the second flush must then run a sync itself.
        let group = Arc::new(FlushGroup::new());
        let syncs = Arc::new(AtomicUsize::new(0));
        let inside = Arc::new(Barrier::new(2));
        let first = {
            let (group, syncs, inside) = (group.clone(), syncs.clone(), inside.clone());
            std::thread::spawn(move || {
                group.flush(|| {
                    syncs.fetch_add(1, Ordering::SeqCst);
                    inside.wait(); // the sync has started
                    std::thread::sleep(Duration::from_millis(50));
                    Ok(())
                })
            })
        };
        inside.wait();
        let counted = syncs.clone();
        group
            .flush(move || {
                counted.fetch_add(1, Ordering::SeqCst);
                Ok(())
            })
            .unwrap();
        first.join().unwrap().unwrap();
        assert_eq!(syncs.load(Ordering::SeqCst), 2);
        assert_eq!(group.stats().joined, 0);
    }

    #[test]
    fn a_failed_sync_fails_every_flush_it_covered_even_after_a_later_success() {
        // Goal: no flush covered by a failed sync is answered with success. Method: draw
        // tickets by hand around a failing sync, then run a succeeding one; the covered
        // tickets keep the failure, a later one succeeds.
        let group = FlushGroup::new();
        let error = group
            .flush(|| Err(io::Error::other("disk on fire")))
            .unwrap_err();
        assert!(error.to_string().contains("disk on fire"));
        group.flush(|| Ok(())).unwrap();
        let state = group.state.lock();
        assert!(
            state.outcome_of(1).is_err(),
            "ticket 1 was covered by the failure"
        );
        assert!(state.outcome_of(2).is_ok());
    }

    #[test]
    fn forgotten_failures_still_fail() {
        // Goal: the bound on kept failures never turns a failure into success. Method: more
        // failing syncs than are kept; the oldest ticket still reads as failed.
        let group = FlushGroup::new();
        for _ in 0..FAILURES_KEPT_MAX + 3 {
            let _ = group.flush(|| Err(io::Error::other("bad sector")));
        }
        let state = group.state.lock();
        assert!(state.failures.len() <= FAILURES_KEPT_MAX);
        assert!(state.outcome_of(1).is_err());
        assert!(state.outcome_of(2).is_err());
    }
}
