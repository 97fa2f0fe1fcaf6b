//! The simulation core: timelines and accounts, the CPU pool, the disk, and the two engine
//! adapters that bring them together: [`SimDevice`] (the engine's `Device`) and
//! [`SimSpawner`] (the engine's `Spawner`).
//!
//! Exactly one entity runs at a time. While it runs, `cursor_ns` is its timeline: CPU work
//! books a CPU from the cursor on and moves the cursor past it; a device request is handed to
//! the disk model at the cursor and the cursor moves to its completion (the entity blocks on
//! its own I/O). Everything is charged to the running entity's [`Account`].
//!
//! With an io queue ([`SimIoQueue`]) a request is not served when it is issued: it waits in
//! the queue, and the scheduler dispatches it (a [`SimCore::dispatch`] event at the time a
//! slot at the disk is free) by the queue's discipline — `bufcache_device::QueueOrder`, the
//! very ordering and merging `serve`'s io queue uses — and only then does the disk model time
//! it from the head's position at that moment. The engine is synchronous, so the step that
//! issued the request goes on at once (its data was stored or read when it was issued); from
//! then on the entity is *blocked*: the rest of its step (CPU work, waits, further requests)
//! is recorded as a continuation and replayed on virtual time once the request completes, and
//! the scheduler runs the entity again only then.

use std::collections::VecDeque;
use std::io::{self, IoSlice, IoSliceMut};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use spin::mutex::{SpinMutex, SpinMutexGuard};

use bufcache::device::io_queue::Direction;
use bufcache::device::{QueueOrder, SeededRng, SparseStore};
use bufcache::environment::Job;
use bufcache::{Device, QueueMode, Spawner, Waiter};
use serde::Serialize;

use crate::clock::VirtualClock;
use crate::disk::{DiskModel, Op};
use crate::host::HostCosts;

/// Requests a simulated device behind an io queue says it takes at once: the depth `serve`'s
/// io queue keeps at the device by default, so the engine hands write-back down in batches
/// that wait in the queue together.
const QUEUED_INFLIGHT_REQUESTS_MAX: usize = 32;

/// Granularity of the "data ready at" map, bytes.
const READY_UNIT: u64 = 4096;

/// Time and work charged to one simulated entity.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Account {
    /// Entity name.
    pub name: String,
    /// User CPU time, ns.
    pub user_ns: u64,
    /// System CPU time, ns.
    pub sys_ns: u64,
    /// Time blocked on the device, ns.
    pub io_wait_ns: u64,
    /// Time waiting for a free CPU, ns.
    pub cpu_wait_ns: u64,
    /// Device reads issued.
    pub reads: u64,
    /// Bytes read from the device.
    pub read_bytes: u64,
    /// Device writes issued.
    pub writes: u64,
    /// Bytes written to the device.
    pub write_bytes: u64,
}

/// Totals of the device.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct DeviceTotals {
    /// Reads served.
    pub reads: u64,
    /// Bytes read.
    pub read_bytes: u64,
    /// Writes served.
    pub writes: u64,
    /// Bytes written.
    pub write_bytes: u64,
    /// Flushes.
    pub flushes: u64,
    /// Time the device was busy, ns.
    pub busy_ns: u64,
    /// Completion time of the last request, ns.
    pub last_done_ns: u64,
    /// Requests that entered the io queue (0 without one).
    pub queue_entered: u64,
    /// Requests the io queue merged into a waiting one (not issued as commands of their own;
    /// `reads` and `writes` count commands issued).
    pub queue_merged: u64,
    /// Batches the io queue took while other requests waited too: the times its discipline
    /// had a choice to make.
    pub queue_choices: u64,
    /// Completion interrupts the disk raised: one per read or write command it served.
    /// **Assumed** one per command, as the sd and wd drivers of the seeds' systems took one
    /// interrupt at each command's completion (the 53c810 runs its SCRIPTS for disconnect and
    /// reselection without interrupting the host); merged requests ride in another's command
    /// and raise none. Flushes are left out: the seeds' drivers issued no cache-flush
    /// command (the engine's flushes of a drive without a write cache cost nothing here).
    pub interrupts: u64,
}

/// The io queue in the simulated path, as `serve` has it: requests wait in the queue, and
/// while fewer than `depth_max` batches are at the disk the next batch is taken by the
/// discipline (`Fifo`: oldest first; `Elevator`: a one-way sweep by offset from the end of the
/// last batch), merging waiting adjacent same-direction requests up to
/// `transfer_size_max_bytes` unless `merge` is off. The modelled drives do no command
/// queueing of their own, so a batch handed to a mechanical disk is committed to its FIFO
/// order: `depth_max` 1 leaves every choice to the queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimIoQueue {
    /// `Fifo` or `Elevator` (`None` is no queue: use `Option::None` instead).
    pub mode: QueueMode,
    /// Merge adjacent waiting requests (`--no-io-merge` turns it off).
    pub merge: bool,
    /// Largest merged request, bytes.
    pub transfer_size_max_bytes: u64,
    /// Batches at the disk at once (`--io-queue-depth`), at least 1.
    pub depth_max: usize,
}

impl SimIoQueue {
    /// A queue of `mode` merging up to `transfer_size_max_bytes`, one batch at the disk.
    pub fn new(mode: QueueMode, merge: bool, transfer_size_max_bytes: u64) -> Self {
        SimIoQueue {
            mode,
            merge,
            transfer_size_max_bytes,
            depth_max: 1,
        }
    }
}

/// One batch the simulated io queue handed to the disk (recorded for checkers).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dispatch {
    /// When the batch was taken, ns.
    pub time_ns: u64,
    /// Its direction.
    pub op: Op,
    /// First byte.
    pub offset: u64,
    /// Bytes.
    pub length: u64,
    /// Requests in it.
    pub requests: usize,
    /// The queue's head position before the batch was taken.
    pub head_before: u64,
    /// Offsets of every request waiting (arrived) when it was taken, the batch's included.
    pub waiting: Vec<u64>,
    /// When the disk completed it, ns.
    pub done_ns: u64,
}

/// A request waiting in the simulated io queue.
#[derive(Clone, Copy, Debug)]
struct Request {
    account: usize,
}

/// The rest of a blocked entity's step, replayed once what it waits for is done.
#[derive(Clone, Copy, Debug)]
enum Deferred {
    Cpu {
        user_ns: u64,
        sys_ns: u64,
        cpu_account: usize,
    },
    Delay {
        ns: u64,
        for_io: bool,
    },
    Io {
        op: Op,
        offset: u64,
        length: u64,
        /// Another request of the same batch follows, submitted at the same time.
        more: bool,
    },
    Data {
        offset: u64,
        length: u64,
    },
    Flush,
}

/// A blocked entity: the request or data it waits for, then the rest of its step.
#[derive(Debug, Default)]
struct Chain {
    /// Waiting (since the time given) for the data of `(offset, length)`, which another
    /// entity's queued read has not delivered yet, instead of for a request of its own.
    data: Option<(u64, u64, u64)>,
    ops: VecDeque<Deferred>,
    /// Requests of this entity in the io queue or at the disk (a batch has several); the
    /// entity goes on when the last of them is done.
    outstanding: usize,
    /// When the outstanding requests were submitted, and the latest completion among those
    /// done so far.
    submitted_ns: u64,
    done_ns: u64,
}

/// The simulated io queue's state.
struct QueueState {
    config: SimIoQueue,
    order: QueueOrder<Request>,
    /// Requests issued but not yet eligible, by (arrival, sequence): a dispatch moves those
    /// that have arrived by its time into `order`, in arrival order.
    future: std::collections::BTreeMap<(u64, u64), (Op, u64, u64, Request)>,
    sequence: u64,
    /// Completion times of the batches at the disk, ascending.
    in_flight: Vec<u64>,
    last_dispatch_ns: u64,
    log: Option<Vec<Dispatch>>,
}

/// Marks bytes in the ready map that a queued read has not delivered yet, or a queued write
/// has not put on the disk yet.
const NOT_READY: u64 = u64::MAX;

/// A booking candidate: finish time, CPU, pieces.
type Booking = (u64, usize, Vec<(u64, u64)>);

/// CPUs as lists of booked intervals, so that work booked out of order (an entity that ran
/// ahead in one atomic step) leaves earlier gaps usable by others, and long work time-shares
/// with short work (a copy does not wait for a whole write-back step to end).
struct CpuPool {
    busy: Vec<Vec<(u64, u64)>>,
}

/// [`SimCore::prune`] prunes the CPU lists once per this many calls (one call per scheduler
/// step): pruning only frees memory, so how often it runs changes no booking, and a prune
/// per step cost a lock and a binary search per CPU per simulated call.
const PRUNE_CALLS_PER_PRUNE: u32 = 64;

impl CpuPool {
    fn new(cpus: u32) -> Self {
        CpuPool {
            busy: vec![Vec::new(); cpus.max(1) as usize],
        }
    }

    /// Books `duration` ns of CPU at or after `at`, time-shared: the work fills the gaps
    /// other entities left on one CPU (the one where it finishes first). Returns the end.
    fn book(&mut self, at: u64, duration: u64) -> u64 {
        if duration == 0 {
            return at;
        }
        let mut best: Option<Booking> = None;
        for (cpu, intervals) in self.busy.iter().enumerate() {
            let from = index_after(intervals, |&(_, end)| end <= at);
            let free_until = intervals.get(from).map_or(u64::MAX, |&(start, _)| start);
            if free_until >= at + duration {
                // This CPU is idle for the whole of it, so it finishes first (ties go to the
                // lowest index, and earlier CPUs would have finished later): book it without
                // collecting pieces, the common case for one entity's back-to-back work.
                return self.book_piece(cpu, (at, at + duration));
            }
            let mut pieces = Vec::new();
            let mut candidate = at;
            let mut remaining = duration;
            for &(start, end) in &intervals[from..] {
                if start > candidate {
                    let take = remaining.min(start - candidate);
                    pieces.push((candidate, candidate + take));
                    remaining -= take;
                    if remaining == 0 {
                        break;
                    }
                }
                candidate = candidate.max(end);
            }
            if remaining > 0 {
                pieces.push((candidate, candidate + remaining));
            }
            let finish = pieces.last().map_or(at, |&(_, end)| end);
            if best.as_ref().is_none_or(|(end, _, _)| finish < *end) {
                best = Some((finish, cpu, pieces));
            }
            if finish == at + duration {
                // No CPU can finish earlier, and ties go to the lowest index: stop looking.
                break;
            }
        }
        let (finish, cpu, pieces) = best.expect("one CPU");
        for piece in pieces {
            self.book_piece(cpu, piece);
        }
        finish
    }

    /// Marks `piece` (start, end) busy on `cpu`, which is free then; returns its end.
    fn book_piece(&mut self, cpu: usize, piece: (u64, u64)) -> u64 {
        let intervals = &mut self.busy[cpu];
        let index = index_after(intervals, |&(start, _)| start < piece.0);
        // Work that starts where the previous booking ends extends it: the gaps are the
        // same, and the lists stay short for back-to-back work of one entity.
        if index > 0 && intervals[index - 1].1 == piece.0 {
            intervals[index - 1].1 = piece.1;
        } else {
            intervals.insert(index, piece);
        }
        piece.1
    }

    /// Forgets intervals that end before `floor` (no entity can book before it any more).
    /// Bookings are the same with or without it: an interval ending before `floor` is skipped
    /// by every booking at or after it, and never extended.
    fn prune(&mut self, floor: u64) {
        for intervals in &mut self.busy {
            let keep_from = intervals.partition_point(|&(_, end)| end < floor);
            if keep_from > 256 {
                intervals.drain(..keep_from);
            }
        }
    }
}

/// `intervals.partition_point(before)` for a list of disjoint intervals in order (`before`
/// holds for a prefix of them), walking back from the end first: an entity books at or near
/// the latest work booked (its own, or a daemon's just ahead of it), so the answer is
/// almost always among the last few intervals, not worth a search of the hundreds kept for
/// out-of-order bookings.
fn index_after(intervals: &[(u64, u64)], before: impl Fn(&(u64, u64)) -> bool) -> usize {
    /// Intervals looked at from the end before falling back to a binary search.
    const STEPS_BACK_MAX: usize = 8;
    let mut index = intervals.len();
    for _ in 0..STEPS_BACK_MAX {
        if index == 0 || before(&intervals[index - 1]) {
            return index;
        }
        index -= 1;
    }
    intervals[..index].partition_point(before)
}

pub(crate) struct CoreState {
    pub cursor_ns: u64,
    pub current: usize,
    /// Where CPU time goes: the running entity, or for the I/O daemon the process whose
    /// call spawned the job (BSD starts an asynchronous write in the writer's context).
    pub cpu_account: usize,
    pub accounts: Vec<Account>,
    pub host: HostCosts,
    pub device: DeviceTotals,
    disk: Box<dyn DiskModel>,
    cpu: CpuPool,
    ready: Vec<u64>,
    /// Bytes read from the disk into buffers since the scheduler last collected them: the
    /// pages those buffers wire, charged at the end of the step (O(1), no engine scan).
    pub read_unwired_bytes: u64,
    queue: Option<QueueState>,
    /// Blocked entities by account: what they wait for and the rest of their step.
    chains: Vec<Option<Chain>>,
    /// The running entity is blocked (its step goes on as a recorded continuation).
    deferred: bool,
    /// Entities whose continuation finished since the scheduler last asked: (account, time).
    resolved: Vec<(usize, u64)>,
    /// When each account's last continuation finished (0: never blocked).
    resumed_ns: Vec<u64>,
}

/// Shared simulation state: used by the scheduler, the device and the spawner.
///
/// The state's lock is a spin lock: a simulation runs on one thread, so the lock is never
/// contended, and it is taken several times per simulated call. A spin lock is released with
/// a plain store where a sleeping mutex needs a second atomic read-modify-write to see
/// whether anyone sleeps on it; those were most of the cost of `SimCore::cpu`.
pub struct SimCore {
    state: SpinMutex<CoreState>,
    clock: Arc<VirtualClock>,
    /// Calls of [`SimCore::prune`] until it next prunes.
    prune_countdown: AtomicU32,
    /// An io queue is configured (`state.queue` is Some): read without the lock by
    /// [`SimCore::next_dispatch_ns`], which the scheduler asks at every step.
    has_io_queue: AtomicBool,
    /// A request may have been counted since [`SimCore::take_read_bytes`] last took the read
    /// bytes (set by `io` and `io_batch`, the only callers of `count_request`): while it is
    /// false `state.read_unwired_bytes` is 0, and the take, asked at every step, needs no lock.
    requests_counted: AtomicBool,
}

impl SimCore {
    /// A core with `disk` and `host`, at time 0.
    pub fn new(disk: Box<dyn DiskModel>, host: HostCosts, clock: Arc<VirtualClock>) -> Self {
        SimCore {
            state: SpinMutex::new(CoreState {
                cursor_ns: 0,
                current: 0,
                cpu_account: 0,
                accounts: Vec::new(),
                cpu: CpuPool::new(host.cpus),
                host,
                device: DeviceTotals::default(),
                disk,
                ready: Vec::new(),
                read_unwired_bytes: 0,
                queue: None,
                chains: Vec::new(),
                deferred: false,
                resolved: Vec::new(),
                resumed_ns: Vec::new(),
            }),
            clock,
            prune_countdown: AtomicU32::new(PRUNE_CALLS_PER_PRUNE),
            has_io_queue: AtomicBool::new(false),
            requests_counted: AtomicBool::new(false),
        }
    }

    pub(crate) fn lock(&self) -> SpinMutexGuard<'_, CoreState> {
        self.state.lock()
    }

    /// Puts an io queue between the engine and the disk (`None`: requests go straight on).
    pub fn set_io_queue(&self, queue: Option<SimIoQueue>) {
        let mut state = self.lock();
        self.has_io_queue.store(queue.is_some(), Ordering::Release);
        state.queue = queue.map(|config| QueueState {
            order: QueueOrder::new(config.mode, config.merge, config.transfer_size_max_bytes),
            config: SimIoQueue {
                depth_max: config.depth_max.max(1),
                ..config
            },
            future: std::collections::BTreeMap::new(),
            sequence: 0,
            in_flight: Vec::new(),
            last_dispatch_ns: 0,
            log: None,
        });
    }

    /// Records every batch the io queue dispatches from now on (see [`SimCore::dispatches`]).
    pub fn record_dispatches(&self) {
        if let Some(queue) = self.lock().queue.as_mut() {
            queue.log = Some(Vec::new());
        }
    }

    /// The batches dispatched since [`SimCore::record_dispatches`], in order.
    pub fn dispatches(&self) -> Vec<Dispatch> {
        self.lock()
            .queue
            .as_ref()
            .and_then(|queue| queue.log.clone())
            .unwrap_or_default()
    }

    /// True when `account` is blocked on the io queue.
    pub fn blocked(&self, account: usize) -> bool {
        self.lock()
            .chains
            .get(account)
            .is_some_and(|chain| chain.is_some())
    }

    /// The end of the running entity's step: its time, or `None` when it is blocked on the io
    /// queue (its time comes from [`SimCore::take_resolved`] later).
    pub(crate) fn end_step(&self) -> Option<u64> {
        let state = self.lock();
        (!state.deferred).then_some(state.cursor_ns)
    }

    /// Entities whose continuation finished since the last call: (account, time).
    pub(crate) fn take_resolved(&self) -> Vec<(usize, u64)> {
        std::mem::take(&mut self.lock().resolved)
    }

    /// When the io queue next hands a batch to the disk, if a request waits.
    pub fn next_dispatch_ns(&self) -> Option<u64> {
        if !self.has_io_queue.load(Ordering::Acquire) {
            return None;
        }
        let state = self.lock();
        let queue = state.queue.as_ref()?;
        let earliest = if !queue.order.is_empty() {
            queue.last_dispatch_ns
        } else {
            queue.future.keys().next()?.0
        };
        let depth = queue.config.depth_max;
        let count = queue.in_flight.len();
        let slot_free = if count < depth {
            0
        } else {
            queue.in_flight[count - depth]
        };
        Some(earliest.max(slot_free).max(queue.last_dispatch_ns))
    }

    /// Hands the next batch to the disk at `time_ns` (from [`SimCore::next_dispatch_ns`]):
    /// every request arrived by then is eligible, the discipline picks, the disk model times
    /// the batch from its state now, and the continuations of the requests' entities replay.
    pub fn dispatch(&self, time_ns: u64) {
        let mut state = self.lock();
        state.dispatch(time_ns);
        let now = state.resolved.iter().map(|&(_, t)| t).max();
        drop(state);
        if let Some(now) = now {
            self.advance_clock(now);
        }
    }

    /// Dispatches until `account` is no longer blocked; returns when its last continuation
    /// finished (0 when it never blocked). For drivers without a scheduler (`sim check`).
    pub fn settle(&self, account: usize) -> u64 {
        while self.blocked(account) {
            let time = self
                .next_dispatch_ns()
                .expect("a blocked entity waits for a queued request");
            self.dispatch(time);
        }
        let mut state = self.lock();
        state.resolved.clear();
        state.resumed_ns.get(account).copied().unwrap_or(0)
    }

    /// Dispatches every batch due by `time_ns` (for drivers without a scheduler).
    pub fn advance_disk(&self, time_ns: u64) {
        while let Some(next) = self.next_dispatch_ns().filter(|&next| next <= time_ns) {
            self.dispatch(next);
        }
    }

    /// Moves the engine's clock forward to `time_ns` (never back). A plain load first: most
    /// calls find the clock there already, and an atomic read-modify-write per simulated
    /// call was a visible share of the simulator's own CPU time.
    fn advance_clock(&self, time_ns: u64) {
        if self.clock.now() < time_ns {
            self.clock.advance_to(time_ns);
        }
    }

    /// The engine's clock.
    pub fn clock(&self) -> &Arc<VirtualClock> {
        &self.clock
    }

    /// Adds an account and returns its index.
    pub fn add_account(&self, name: &str) -> usize {
        let mut state = self.lock();
        state.accounts.push(Account {
            name: name.to_string(),
            ..Default::default()
        });
        state.accounts.len() - 1
    }

    /// Makes entity `account` current at time `time_ns`.
    pub(crate) fn enter(&self, account: usize, time_ns: u64) {
        self.enter_on_behalf(account, account, time_ns);
    }

    /// Makes entity `account` current at `time_ns`, its CPU charged to `cpu_account`.
    pub(crate) fn enter_on_behalf(&self, account: usize, cpu_account: usize, time_ns: u64) {
        let mut state = self.lock();
        debug_assert!(
            state
                .chains
                .get(account)
                .is_none_or(|chain| chain.is_none()),
            "a blocked entity runs only once its continuation is done"
        );
        state.current = account;
        state.cpu_account = cpu_account;
        state.cursor_ns = time_ns;
        state.deferred = false;
        drop(state);
        self.advance_clock(time_ns);
    }

    /// The running entity's time.
    pub fn cursor(&self) -> u64 {
        self.lock().cursor_ns
    }

    /// The running entity's time and the account its CPU time goes to.
    pub(crate) fn cursor_and_origin(&self) -> (u64, usize) {
        let state = self.lock();
        (state.cursor_ns, state.cpu_account)
    }

    /// Runs `user_ns + sys_ns` of CPU work for the running entity.
    pub fn cpu(&self, user_ns: u64, sys_ns: u64) {
        if user_ns == 0 && sys_ns == 0 {
            // No work: nothing to book, now or (for a blocked entity) on replay.
            return;
        }
        let mut state = self.lock();
        if state.deferred {
            let cpu_account = state.cpu_account;
            state.defer(Deferred::Cpu {
                user_ns,
                sys_ns,
                cpu_account,
            });
            return;
        }
        state.cpu_work(user_ns, sys_ns);
        let now = state.cursor_ns;
        drop(state);
        self.advance_clock(now);
    }

    /// Waits (without CPU) for `ns`: a timed wait of the engine, a latency spike.
    pub fn delay(&self, ns: u64, for_io: bool) {
        let mut state = self.lock();
        if state.deferred {
            state.defer(Deferred::Delay { ns, for_io });
            return;
        }
        let until = state.cursor_ns + ns;
        state.wait_until(until, for_io);
        drop(state);
        self.advance_clock(until);
    }

    /// Waits until the data of device bytes `[offset, offset + length)` has arrived from the
    /// disk (a read still in flight, or still in the io queue), or reached it (a write in
    /// flight or still in the io queue: 4.4BSD sleeps on a busy buffer until its write is
    /// done).
    pub fn wait_for_data(&self, offset: u64, length: u64) {
        let mut state = self.lock();
        if state.deferred {
            state.defer(Deferred::Data { offset, length });
            return;
        }
        let ready = state.ready_at(offset, length);
        if ready == NOT_READY {
            let current = state.current;
            let cursor = state.cursor_ns;
            state.block(current).data = Some((offset, length, cursor));
            return;
        }
        // Not deferred (checked above, under the same lock): wait at once.
        state.wait_until(ready, true);
        drop(state);
        self.advance_clock(ready);
    }

    /// Waits (without CPU) until `time_ns`.
    pub fn wait_until(&self, time_ns: u64, for_io: bool) {
        let mut state = self.lock();
        if state.deferred {
            let ns = time_ns.saturating_sub(state.cursor_ns);
            state.defer(Deferred::Delay { ns, for_io });
            return;
        }
        state.wait_until(time_ns, for_io);
        drop(state);
        self.advance_clock(time_ns);
    }

    /// When the data of device bytes `[offset, offset + length)` last arrived from the disk.
    /// `u64::MAX` while a read or write of them waits in the io queue.
    pub fn ready_at(&self, offset: u64, length: u64) -> u64 {
        self.lock().ready_at(offset, length)
    }

    /// Bytes read from the disk since the last call (each read fills fresh buffers whose
    /// pages are wired), and resets the count.
    pub(crate) fn take_read_bytes(&self) -> u64 {
        if !self.requests_counted.load(Ordering::Acquire) {
            return 0;
        }
        let mut state = self.lock();
        self.requests_counted.store(false, Ordering::Release);
        std::mem::take(&mut state.read_unwired_bytes)
    }

    /// Forgets CPU bookings before `floor`, once per [`PRUNE_CALLS_PER_PRUNE`] calls.
    pub(crate) fn prune(&self, floor: u64) {
        // A load and a store, not a read-modify-write: a lost count (two threads at once)
        // only moves the next prune, which changes no booking.
        let countdown = self.prune_countdown.load(Ordering::Relaxed);
        if countdown > 1 {
            self.prune_countdown.store(countdown - 1, Ordering::Relaxed);
            return;
        }
        self.prune_countdown
            .store(PRUNE_CALLS_PER_PRUNE, Ordering::Relaxed);
        self.lock().cpu.prune(floor);
    }

    /// A copy of every account.
    pub fn accounts(&self) -> Vec<Account> {
        self.lock().accounts.clone()
    }

    /// One account.
    pub fn account(&self, index: usize) -> Account {
        self.lock().accounts[index].clone()
    }

    /// Device totals.
    pub fn device_totals(&self) -> DeviceTotals {
        let mut totals = self.lock().device.clone();
        totals.interrupts = totals.reads + totals.writes;
        totals
    }

    /// The host cost model.
    pub fn host(&self) -> HostCosts {
        self.lock().host.clone()
    }

    /// Requests issued together (a batch of writes): with an io queue they wait there
    /// together, where the queue may sort and merge them; without one the disk takes them in
    /// turn.
    fn io_batch(&self, requests: &[(Op, u64, u64)]) {
        let mut state = self.lock();
        self.requests_counted.store(true, Ordering::Release);
        if state.queue.is_some() {
            state.queued_io_batch(requests);
            return;
        }
        drop(state);
        for &(op, offset, length) in requests {
            self.io(op, offset, length);
        }
    }

    /// Requests the device takes at once: with an io queue, what `serve` takes (the queue
    /// holds them), else one at a time.
    fn inflight_requests_max(&self) -> usize {
        if self.lock().queue.is_some() {
            QUEUED_INFLIGHT_REQUESTS_MAX
        } else {
            1
        }
    }

    /// A page-in (`write` false) or page-out of `length` bytes at `offset` in a swap area:
    /// the disk's time and a request, charged to the current entity like any other; no data
    /// is stored.
    pub fn swap_io(&self, write: bool, offset: u64, length: u64) {
        self.io(if write { Op::Write } else { Op::Read }, offset, length);
        if !write {
            // A page-in fills a process's pages, not buffers: `io` counted it (at once, also
            // behind the queue) among the bytes whose buffer pages get wired; take it back.
            let mut state = self.lock();
            state.read_unwired_bytes -= length;
        }
    }

    fn io(&self, op: Op, offset: u64, length: u64) {
        let mut state = self.lock();
        self.requests_counted.store(true, Ordering::Release);
        if state.queue.is_some() {
            state.queued_io(op, offset, length);
            return;
        }
        let io_ns = state.host.io_ns;
        state.cpu_work(0, io_ns);
        let arrival = state.cursor_ns;
        let done = state.disk.serve(op, offset, length, arrival);
        let current = state.current;
        state.record_served(op, offset, length, arrival, done);
        state.count_request(current, op, length);
        state.accounts[current].io_wait_ns += done.saturating_sub(arrival);
        state.cursor_ns = done;
        drop(state);
        self.advance_clock(done);
    }

    /// A flush: one command, and on a drive with a write cache a wait until the cached
    /// writes are on the medium.
    fn flush_disk(&self) {
        let mut state = self.lock();
        if state.deferred {
            let io_ns = state.host.io_ns;
            let cpu_account = state.cpu_account;
            state.defer(Deferred::Cpu {
                user_ns: 0,
                sys_ns: io_ns,
                cpu_account,
            });
            state.defer(Deferred::Flush);
            return;
        }
        let io_ns = state.host.io_ns;
        state.cpu_work(0, io_ns);
        state.device.flushes += 1;
        let now = state.cursor_ns;
        let drained = state.disk.drain_write_cache(now);
        drop(state);
        if let Some(drained) = drained {
            self.wait_until(drained, true);
        }
    }
}

impl CoreState {
    /// Books one disk command issued at `issued_ns` and done at `done_ns`: busy time, the
    /// device's totals, and (for a read) when its bytes are ready.
    fn record_served(&mut self, op: Op, offset: u64, length: u64, issued_ns: u64, done_ns: u64) {
        let busy_from = issued_ns.max(self.device.last_done_ns);
        self.device.busy_ns += done_ns.saturating_sub(busy_from);
        self.device.last_done_ns = self.device.last_done_ns.max(done_ns);
        match op {
            Op::Read => {
                self.device.reads += 1;
                self.device.read_bytes += length;
                self.mark_ready(offset, length, done_ns);
            }
            Op::Write => {
                self.device.writes += 1;
                self.device.write_bytes += length;
                // Written bytes are on the disk (durable without a write cache) from here: a
                // later fsync of them waits for this, as 4.4BSD's waits for a busy buffer's
                // write to finish; while the write waits in the io queue they are not ready
                // (see `submit`).
                self.mark_ready(offset, length, done_ns);
            }
        }
    }

    fn ready_at(&self, offset: u64, length: u64) -> u64 {
        let first = (offset / READY_UNIT) as usize;
        let end = ((offset + length).div_ceil(READY_UNIT) as usize).min(self.ready.len());
        self.ready
            .get(first..end.max(first))
            .map_or(0, |units| units.iter().copied().max().unwrap_or(0))
    }

    fn mark_ready(&mut self, offset: u64, length: u64, time_ns: u64) {
        let first = (offset / READY_UNIT) as usize;
        let end = (offset + length).div_ceil(READY_UNIT) as usize;
        if self.ready.len() < end {
            self.ready.resize(end, 0);
        }
        for unit in &mut self.ready[first..end] {
            *unit = time_ns;
        }
    }

    /// Counts a request against the entity that issued it (when it is issued, so a process
    /// sees its own reads at once).
    fn count_request(&mut self, account: usize, op: Op, length: u64) {
        let account = &mut self.accounts[account];
        match op {
            Op::Read => {
                account.reads += 1;
                account.read_bytes += length;
                self.read_unwired_bytes += length;
            }
            Op::Write => {
                account.writes += 1;
                account.write_bytes += length;
            }
        }
    }

    /// The chain of a blocked `account` (created empty); the running entity is blocked.
    fn block(&mut self, account: usize) -> &mut Chain {
        if self.chains.len() <= account {
            self.chains.resize_with(account + 1, || None);
        }
        if account == self.current {
            self.deferred = true;
        }
        self.chains[account].get_or_insert_with(Chain::default)
    }

    /// Appends to the running (blocked) entity's continuation.
    fn defer(&mut self, op: Deferred) {
        let current = self.current;
        self.block(current).ops.push_back(op);
    }

    /// A request of the running entity through the io queue: counted now, served later.
    fn queued_io(&mut self, op: Op, offset: u64, length: u64) {
        let current = self.current;
        self.count_request(current, op, length);
        if self.deferred {
            let cpu_account = self.cpu_account;
            let io_ns = self.host.io_ns;
            self.defer(Deferred::Cpu {
                user_ns: 0,
                sys_ns: io_ns,
                cpu_account,
            });
            self.defer(Deferred::Io {
                op,
                offset,
                length,
                more: false,
            });
            return;
        }
        self.queued_io_batch(&[(op, offset, length)]);
    }

    /// Requests of the running entity through the io queue, all waiting there together (a
    /// batch of writes the engine keeps in flight at once): counted now, served later; the
    /// entity goes on when the last is done.
    fn queued_io_batch(&mut self, requests: &[(Op, u64, u64)]) {
        let current = self.current;
        let io_ns = self.host.io_ns;
        if self.deferred {
            let cpu_account = self.cpu_account;
            for _ in requests {
                self.defer(Deferred::Cpu {
                    user_ns: 0,
                    sys_ns: io_ns,
                    cpu_account,
                });
            }
            for (index, &(op, offset, length)) in requests.iter().enumerate() {
                self.count_request(current, op, length);
                self.defer(Deferred::Io {
                    op,
                    offset,
                    length,
                    more: index + 1 < requests.len(),
                });
            }
            return;
        }
        for &(op, _, length) in requests {
            if requests.len() > 1 {
                self.count_request(current, op, length);
            }
            self.cpu_work(0, io_ns);
        }
        let arrival = self.cursor_ns;
        let chain = self.block(current);
        chain.outstanding += requests.len();
        chain.submitted_ns = arrival;
        chain.done_ns = arrival;
        for &(op, offset, length) in requests {
            self.submit(current, op, offset, length, arrival);
        }
    }

    /// Puts a request into the io queue at `arrival_ns`; `account` is blocked on it. Its
    /// bytes are not ready until it is served: a read's have not arrived, a write's have not
    /// reached the disk (so an fsync waits for a queued write-behind write).
    fn submit(&mut self, account: usize, op: Op, offset: u64, length: u64, arrival_ns: u64) {
        self.mark_ready(offset, length, NOT_READY);
        self.device.queue_entered += 1;
        let queue = self.queue.as_mut().expect("submit needs the io queue");
        let sequence = queue.sequence;
        queue.sequence += 1;
        queue.future.insert(
            (arrival_ns, sequence),
            (op, offset, length, Request { account }),
        );
    }

    /// One dispatch event (see [`SimCore::dispatch`]).
    fn dispatch(&mut self, time_ns: u64) {
        let queue = self.queue.as_mut().expect("dispatch needs the io queue");
        queue.last_dispatch_ns = queue.last_dispatch_ns.max(time_ns);
        while let Some(entry) = queue.future.first_entry() {
            if entry.key().0 > time_ns {
                break;
            }
            let (op, offset, length, request) = entry.remove();
            let direction = match op {
                Op::Read => Direction::Read,
                Op::Write => Direction::Write,
            };
            queue.order.push(direction, offset, length, request);
        }
        queue.in_flight.retain(|&done| done > time_ns);
        let head_before = queue.order.head_position();
        let choice = queue.order.len() > 1;
        let waiting: Option<Vec<u64>> = queue.log.is_some().then(|| {
            queue
                .order
                .waiting()
                .map(|request| request.offset)
                .collect()
        });
        let Some(batch) = queue.order.take_batch() else {
            return;
        };
        let op = match batch[0].direction {
            Direction::Read => Op::Read,
            Direction::Write => Op::Write,
        };
        let offset = batch[0].offset;
        let length: u64 = batch.iter().map(|member| member.length).sum();
        let done = self.disk.serve(op, offset, length, time_ns);
        let queue = self.queue.as_mut().expect("checked above");
        let at = queue.in_flight.partition_point(|&t| t <= done);
        queue.in_flight.insert(at, done);
        if let (Some(log), Some(waiting)) = (queue.log.as_mut(), waiting) {
            log.push(Dispatch {
                time_ns,
                op,
                offset,
                length,
                requests: batch.len(),
                head_before,
                waiting,
                done_ns: done,
            });
        }
        self.record_served(op, offset, length, time_ns, done);
        self.device.queue_merged += batch.len() as u64 - 1;
        self.device.queue_choices += u64::from(choice);
        for member in &batch {
            self.request_done(member.payload.account, done);
        }
        {
            // Entities waiting for these bytes go on: read by another entity, or written
            // (an fsync waiting for a write-behind write). Waking only after reads left a
            // waiter for a queued write blocked for ever while the periodic entities ran on.
            let waiting: Vec<(usize, u64)> = self
                .chains
                .iter()
                .enumerate()
                .filter_map(|(account, chain)| {
                    let (at, bytes, since) = chain.as_ref()?.data?;
                    let ready = self.ready_at(at, bytes);
                    (ready != NOT_READY).then(|| (account, since.max(ready)))
                })
                .collect();
            for (account, ready) in waiting {
                let chain = self.chains[account].as_mut().expect("found above");
                let (_, _, since) = chain.data.take().expect("found above");
                self.accounts[account].io_wait_ns += ready - since;
                self.resume(account, ready);
            }
        }
    }

    /// One of `account`'s outstanding requests is done at `done_ns`: when it was the last, the
    /// entity waited from their submission to the latest completion, and goes on from there.
    fn request_done(&mut self, account: usize, done_ns: u64) {
        let Some(chain) = self.chains.get_mut(account).and_then(Option::as_mut) else {
            return;
        };
        assert!(
            chain.outstanding > 0,
            "a request is done that was never submitted"
        );
        chain.outstanding -= 1;
        chain.done_ns = chain.done_ns.max(done_ns);
        if chain.outstanding > 0 {
            return;
        }
        let (since, done) = (chain.submitted_ns, chain.done_ns);
        self.accounts[account].io_wait_ns += done - since.min(done);
        self.resume(account, done);
    }

    /// Replays `account`'s continuation from `time_ns`, up to its next request or wait for
    /// data, or to its end (then the entity is resolved at the time reached).
    fn resume(&mut self, account: usize, mut time_ns: u64) {
        let Some(mut chain) = self.chains.get_mut(account).and_then(Option::take) else {
            return;
        };
        while let Some(op) = chain.ops.pop_front() {
            match op {
                Deferred::Cpu {
                    user_ns,
                    sys_ns,
                    cpu_account,
                } => {
                    let total = user_ns + sys_ns;
                    if total > 0 {
                        let finish = self.cpu.book(time_ns, total);
                        self.accounts[account].cpu_wait_ns += finish - time_ns - total;
                        self.accounts[cpu_account].user_ns += user_ns;
                        self.accounts[cpu_account].sys_ns += sys_ns;
                        time_ns = finish;
                    }
                }
                Deferred::Delay { ns, for_io } => {
                    if for_io {
                        self.accounts[account].io_wait_ns += ns;
                    }
                    time_ns += ns;
                }
                Deferred::Io {
                    op,
                    offset,
                    length,
                    more,
                } => {
                    if chain.outstanding == 0 {
                        chain.submitted_ns = time_ns;
                        chain.done_ns = time_ns;
                    }
                    chain.outstanding += 1;
                    self.submit(account, op, offset, length, time_ns);
                    if !more {
                        self.chains[account] = Some(chain);
                        return;
                    }
                }
                Deferred::Data { offset, length } => {
                    let ready = self.ready_at(offset, length);
                    if ready == NOT_READY {
                        chain.data = Some((offset, length, time_ns));
                        self.chains[account] = Some(chain);
                        return;
                    }
                    if ready > time_ns {
                        self.accounts[account].io_wait_ns += ready - time_ns;
                        time_ns = ready;
                    }
                }
                Deferred::Flush => {
                    self.device.flushes += 1;
                    if let Some(drained) = self.disk.drain_write_cache(time_ns) {
                        if drained > time_ns {
                            self.accounts[account].io_wait_ns += drained - time_ns;
                            time_ns = drained;
                        }
                    }
                }
            }
        }
        if self.resumed_ns.len() <= account {
            self.resumed_ns.resize(account + 1, 0);
        }
        self.resumed_ns[account] = time_ns;
        if account == self.current {
            // The entity last entered goes on from here (a driver may keep charging it).
            self.deferred = false;
            self.cursor_ns = time_ns;
        }
        self.resolved.push((account, time_ns));
    }

    /// The running entity, not deferred, waits (without CPU) until `time_ns`.
    fn wait_until(&mut self, time_ns: u64, for_io: bool) {
        if time_ns > self.cursor_ns {
            if for_io {
                let current = self.current;
                self.accounts[current].io_wait_ns += time_ns - self.cursor_ns;
            }
            self.cursor_ns = time_ns;
        }
    }

    fn cpu_work(&mut self, user_ns: u64, sys_ns: u64) {
        let total = user_ns + sys_ns;
        if total == 0 {
            return;
        }
        let finish = self.cpu.book(self.cursor_ns, total);
        let wait = finish - self.cursor_ns - total;
        self.accounts[self.current].cpu_wait_ns += wait;
        let account = &mut self.accounts[self.cpu_account];
        account.user_ns += user_ns;
        account.sys_ns += sys_ns;
        self.cursor_ns = finish;
    }
}

/// Granularity of the simulated disk's contents, bytes.
const CHUNK_BYTES: u64 = 4096;

/// Granularity of a torn write: a crash keeps or loses each sector of an unflushed write
/// independently, as a disk that writes 512-byte sectors atomically would.
pub const SECTOR_BYTES: u64 = 512;

/// The one seeded generator of a simulation, shared by the device's faults and crashes and
/// the workload that drives them, so a run is reproduced exactly from its seed.
pub type SharedRng = Arc<Mutex<SeededRng>>;

/// Seeded faults of a [`SimDevice`]: each request fails or is slowed with its probability,
/// drawn from the simulation's one generator.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FaultConfig {
    /// Probability that a read fails with an I/O error (no data returned).
    pub read_error_probability: f64,
    /// Probability that a write fails with an I/O error (nothing stored).
    pub write_error_probability: f64,
    /// Probability that a flush fails (nothing made durable).
    pub flush_error_probability: f64,
    /// Probability that a request takes `latency_spike_ns` longer.
    pub latency_spike_probability: f64,
    /// Extra latency of a spike, ns of virtual time.
    pub latency_spike_ns: u64,
}

/// What a crash did to the writes the disk had accepted but not yet made durable.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CrashOutcome {
    /// Unflushed writes that reached the medium whole.
    pub writes_kept: u64,
    /// Unflushed writes lost whole.
    pub writes_lost: u64,
    /// Unflushed writes torn: some sectors reached the medium, others did not.
    pub writes_torn: u64,
}

/// Fault and crash counters of a [`SimDevice`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct FaultCounts {
    /// Reads failed.
    pub read_errors: u64,
    /// Writes failed.
    pub write_errors: u64,
    /// Flushes failed.
    pub flush_errors: u64,
    /// Requests slowed by a latency spike.
    pub latency_spikes: u64,
    /// Crashes.
    pub crashes: u64,
}

/// Sparse 4 KiB chunks, absent where all zero (the project's one sparse store).
type Chunks = SparseStore;

/// The disk's contents. With crash tracking on, `chunks` is what reads see (the medium plus
/// the disk's volatile write cache), `durable` what survives power loss, and `unflushed`
/// the writes accepted since the last flush, in order.
struct Contents {
    chunks: Chunks,
    durable: Option<Chunks>,
    unflushed: Vec<(u64, Vec<u8>)>,
}

/// Seeded faults and their generator.
struct Faults {
    config: FaultConfig,
    rng: SharedRng,
    counts: FaultCounts,
    /// Byte ranges of failed writes since the last [`SimDevice::take_failed_writes`].
    failed_writes: Vec<(u64, u64)>,
    /// Powered off between a crash and the restart: every request fails.
    offline: bool,
}

/// The engine's device: every request is timed by the disk model and charged to the entity
/// running. It keeps what is written, sparsely: 4 KiB chunks in a map, where a chunk of zeroes
/// is not stored (the workloads mostly write zeroes, so timing runs stay small), and returns
/// it; bytes never written read as zeroes.
///
/// With [`SimDevice::set_faults`] requests fail or slow down at seeded random; with
/// [`SimDevice::track_crashes`] it keeps a volatile write cache, so [`SimDevice::crash`] can
/// lose or tear (per 512-byte sector) every write not yet flushed, all in virtual time.
pub struct SimDevice {
    core: Arc<SimCore>,
    length: u64,
    name: String,
    /// The write unit the device reports (`Capabilities::write_unit_bytes`; 1: none), so
    /// `sim check` runs the engine's whole-unit write-back as over an object store.
    write_unit_bytes: u64,
    contents: Mutex<Contents>,
    faults: Mutex<Option<Faults>>,
}

impl Default for Contents {
    fn default() -> Self {
        Contents {
            chunks: SparseStore::new(CHUNK_BYTES),
            durable: None,
            unflushed: Vec::new(),
        }
    }
}

impl Contents {
    fn store(&mut self, source: &[u8], offset: u64) {
        self.chunks.write(offset, source);
        if self.durable.is_some() {
            self.unflushed.push((offset, source.to_vec()));
        }
    }
}

/// The error a simulated fault returns.
fn fault_error(what: &str, offset: u64, length: u64) -> io::Error {
    io::Error::other(format!(
        "simulated {what} fault at offset {offset}, {length} bytes"
    ))
}

impl SimDevice {
    /// A device of `length` bytes on `core`'s disk, all zeroes.
    pub fn new(core: Arc<SimCore>, length: u64, name: &str) -> Self {
        SimDevice {
            core,
            length,
            name: name.to_string(),
            write_unit_bytes: 1,
            contents: Mutex::new(Contents::default()),
            faults: Mutex::new(None),
        }
    }

    /// Reports `bytes` as the device's write unit (before the device is shared).
    pub fn set_write_unit_bytes(&mut self, bytes: u64) {
        assert!(bytes >= 1, "a write unit is at least one byte");
        self.write_unit_bytes = bytes;
    }

    fn contents(&self) -> MutexGuard<'_, Contents> {
        self.contents
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    fn fault_state(&self) -> MutexGuard<'_, Option<Faults>> {
        self.faults
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    /// Length in bytes.
    pub fn len_bytes(&self) -> u64 {
        self.length
    }

    /// Bytes of the disk's contents stored (non-zero chunks).
    pub fn stored_bytes(&self) -> u64 {
        self.contents().chunks.allocated_bytes()
    }

    /// Copies what a read at `offset` would return into `target`, without timing or faults
    /// (for checkers).
    pub fn peek(&self, target: &mut [u8], offset: u64) {
        self.contents().chunks.read(offset, target);
    }

    /// Turns seeded faults on (or changes them), drawing from `rng`.
    pub fn set_faults(&self, config: FaultConfig, rng: SharedRng) {
        let mut faults = self.fault_state();
        match faults.as_mut() {
            Some(state) => {
                state.config = config;
                state.rng = rng;
            }
            None => {
                *faults = Some(Faults {
                    config,
                    rng,
                    counts: FaultCounts::default(),
                    failed_writes: Vec::new(),
                    offline: false,
                })
            }
        }
    }

    /// Fault and crash counters so far.
    pub fn fault_counts(&self) -> FaultCounts {
        self.fault_state()
            .as_ref()
            .map_or_else(FaultCounts::default, |state| state.counts)
    }

    /// Byte ranges `(offset, length)` of the writes that failed since the last call.
    pub fn take_failed_writes(&self) -> Vec<(u64, u64)> {
        self.fault_state()
            .as_mut()
            .map_or_else(Vec::new, |state| std::mem::take(&mut state.failed_writes))
    }

    /// Keeps a volatile write cache from now on: what is on the disk now is durable, later
    /// writes only after a flush.
    pub fn track_crashes(&self) {
        let mut contents = self.contents();
        if contents.durable.is_none() {
            contents.durable = Some(contents.chunks.clone());
        }
    }

    /// Power loss: every write accepted since the last flush is kept, lost or torn (each
    /// 512-byte sector kept or lost), drawn from `rng`; what survives is then all the disk
    /// holds, and every request fails until [`SimDevice::restart`]. Needs
    /// [`SimDevice::track_crashes`] (without it every write is durable at once).
    pub fn crash(&self, rng: &SharedRng) -> CrashOutcome {
        let mut outcome = CrashOutcome::default();
        {
            let mut contents = self.contents();
            let unflushed = std::mem::take(&mut contents.unflushed);
            if let Some(mut durable) = contents.durable.take() {
                let mut rng = rng.lock().unwrap_or_else(|poison| poison.into_inner());
                for (offset, data) in unflushed {
                    match rng.below(3) {
                        0 => outcome.writes_lost += 1,
                        1 => {
                            outcome.writes_kept += 1;
                            durable.write(offset, &data);
                        }
                        _ => {
                            outcome.writes_torn += 1;
                            for (index, sector) in data.chunks(SECTOR_BYTES as usize).enumerate() {
                                if rng.below(2) == 0 {
                                    let at = offset + index as u64 * SECTOR_BYTES;
                                    durable.write(at, sector);
                                }
                            }
                        }
                    }
                }
                contents.chunks = durable.clone();
                contents.durable = Some(durable);
            }
        }
        let mut faults = self.fault_state();
        if faults.is_none() {
            *faults = Some(Faults {
                config: FaultConfig::default(),
                rng: rng.clone(),
                counts: FaultCounts::default(),
                failed_writes: Vec::new(),
                offline: false,
            });
        }
        let state = faults.as_mut().expect("set above");
        state.offline = true;
        state.counts.crashes += 1;
        outcome
    }

    /// Power back on after a crash.
    pub fn restart(&self) {
        if let Some(state) = self.fault_state().as_mut() {
            state.offline = false;
        }
    }

    /// Draws the faults of one request: an error (when `fails` picks one) and a latency spike.
    fn draw(
        &self,
        probability: impl Fn(&FaultConfig) -> f64,
        what: &str,
        offset: u64,
        length: u64,
    ) -> io::Result<()> {
        let mut faults = self.fault_state();
        let Some(state) = faults.as_mut() else {
            return Ok(());
        };
        if state.offline {
            return Err(io::Error::new(
                io::ErrorKind::NotConnected,
                format!("simulated disk {} is powered off (crashed)", self.name),
            ));
        }
        let (fail, spike) = {
            let mut rng = state
                .rng
                .lock()
                .unwrap_or_else(|poison| poison.into_inner());
            let fail = rng.chance(probability(&state.config));
            let spike = rng.chance(state.config.latency_spike_probability);
            (fail, spike)
        };
        if spike {
            state.counts.latency_spikes += 1;
            let extra = state.config.latency_spike_ns;
            drop(faults);
            self.core.delay(extra, true);
            faults = self.fault_state();
        }
        if !fail {
            return Ok(());
        }
        let state = faults.as_mut().expect("checked above");
        match what {
            "read" => state.counts.read_errors += 1,
            "write" => {
                state.counts.write_errors += 1;
                state.failed_writes.push((offset, length));
            }
            _ => state.counts.flush_errors += 1,
        }
        Err(fault_error(what, offset, length))
    }
}

impl Device for SimDevice {
    fn read_vectored_at(&self, buffers: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<()> {
        let length = bufcache::device::total_length(buffers.iter().map(|b| b.len()));
        bufcache::device::check_range(self.length, offset, length)?;
        self.draw(|c| c.read_error_probability, "read", offset, length)?;
        self.contents().chunks.read_vectored(offset, buffers);
        self.core.io(Op::Read, offset, length);
        Ok(())
    }

    fn write_vectored_at(&self, buffers: &[IoSlice<'_>], offset: u64) -> io::Result<()> {
        let length = bufcache::device::total_length(buffers.iter().map(|b| b.len()));
        bufcache::device::check_range(self.length, offset, length)?;
        if let Err(error) = self.draw(|c| c.write_error_probability, "write", offset, length) {
            // A failed write still costs the disk its time.
            self.core.io(Op::Write, offset, length);
            return Err(error);
        }
        {
            let mut contents = self.contents();
            let mut at = offset;
            for buffer in buffers {
                contents.store(buffer, at);
                at += buffer.len() as u64;
            }
        }
        self.core.io(Op::Write, offset, length);
        Ok(())
    }

    /// Every write of a batch is issued at once, so behind an io queue they wait there
    /// together (sorted, and merged where adjacent); each keeps its own outcome. A single
    /// write is a plain write. Every write completes before this returns.
    fn submit_writes(&self, mut writes: Vec<bufcache::device::WriteRequest>) {
        if writes.len() == 1 {
            return bufcache::device::write_each_now(self, writes);
        }
        let mut requests = Vec::with_capacity(writes.len());
        let results: Vec<io::Result<()>> = writes
            .iter_mut()
            .map(|write| {
                let (offset, length) = (write.offset(), write.length_bytes());
                bufcache::device::check_range(self.length, offset, length)?;
                // A failed write still costs the disk its time.
                requests.push((Op::Write, offset, length));
                self.draw(|c| c.write_error_probability, "write", offset, length)?;
                let mut contents = self.contents();
                let mut at = offset;
                for buffer in write.slices() {
                    contents.store(&buffer, at);
                    at += buffer.len() as u64;
                }
                Ok(())
            })
            .collect();
        self.core.io_batch(&requests);
        for (write, result) in writes.into_iter().zip(results) {
            write.complete(result);
        }
    }

    fn submit_reads(&self, reads: Vec<bufcache::device::ReadRequest>) {
        bufcache::device::read_each_now(self, reads)
    }

    fn flush(&self) -> io::Result<()> {
        self.draw(|c| c.flush_error_probability, "flush", 0, 0)?;
        {
            let mut contents = self.contents();
            let unflushed = std::mem::take(&mut contents.unflushed);
            if let Some(durable) = contents.durable.as_mut() {
                for (offset, data) in unflushed {
                    durable.write(offset, &data);
                }
            }
        }
        self.core.flush_disk();
        Ok(())
    }

    fn discard(&self, offset: u64, length: u64) -> io::Result<()> {
        bufcache::device::check_range(self.length, offset, length)?;
        // A discard is advisory, so it is not failed at random; a powered-off disk refuses it.
        self.draw(|_| 0.0, "discard", offset, length)?;
        // Discarded bytes read back as zeroes (deterministic, like WRITE_ZEROES).
        let zeroes = vec![0u8; CHUNK_BYTES as usize];
        let mut contents = self.contents();
        let mut at = offset;
        let end = offset + length;
        while at < end {
            let step = (CHUNK_BYTES - at % CHUNK_BYTES).min(end - at);
            contents.store(&zeroes[..step as usize], at);
            at += step;
        }
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, length: u64) -> io::Result<()> {
        bufcache::device::write_zeroes_by_writing(self, offset, length)
    }

    fn extents(&self, offset: u64, length: u64) -> io::Result<Vec<bufcache::Extent>> {
        bufcache::device::all_data(self.length, offset, length)
    }

    fn capabilities(&self) -> bufcache::Capabilities {
        bufcache::Capabilities {
            inflight_requests_max: self.core.inflight_requests_max(),
            write_unit_bytes: self.write_unit_bytes,
            ..bufcache::Capabilities::plain(self.length)
        }
    }

    fn describe(&self) -> String {
        self.name.clone()
    }
}

/// The engine's waiter on virtual time. The engine is synchronous and exactly one simulated
/// entity runs at a time, so nothing else can release space or finish a write-back while a
/// call waits: a wait not already satisfied by a notification lasts its whole timeout, which
/// moves the running entity's timeline on (time passes, no CPU is used). The engine's waits
/// are bounded (it counts every wait as its full timeout), so a space wait ends after
/// `space_wait_max` of virtual time, deterministically, instead of sleeping in real time.
pub struct SimWaiter {
    core: Arc<SimCore>,
    notifications: AtomicU64,
    waits: AtomicU64,
    waited_ns: AtomicU64,
}

impl SimWaiter {
    /// A waiter moving `core`'s running entity on.
    pub fn new(core: Arc<SimCore>) -> Self {
        SimWaiter {
            core,
            notifications: AtomicU64::new(0),
            waits: AtomicU64::new(0),
            waited_ns: AtomicU64::new(0),
        }
    }

    /// Waits that passed virtual time.
    pub fn waits(&self) -> u64 {
        self.waits.load(Ordering::Relaxed)
    }

    /// Virtual time spent waiting, ns.
    pub fn waited_ns(&self) -> u64 {
        self.waited_ns.load(Ordering::Relaxed)
    }
}

impl Waiter for SimWaiter {
    fn ticket(&self) -> u64 {
        self.notifications.load(Ordering::Acquire)
    }

    fn wait(&self, ticket: u64, timeout_ns: u64) {
        if self.notifications.load(Ordering::Acquire) != ticket || timeout_ns == 0 {
            return;
        }
        self.waits.fetch_add(1, Ordering::Relaxed);
        self.waited_ns.fetch_add(timeout_ns, Ordering::Relaxed);
        self.core.delay(timeout_ns, false);
    }

    fn notify_all(&self) {
        self.notifications.fetch_add(1, Ordering::AcqRel);
    }
}

/// The engine's spawner: background jobs (read-ahead, write-behind) are queued with the time
/// they were spawned and run later by the simulated I/O daemon, one at a time, on its own
/// timeline; their CPU time is charged to the process whose call spawned them, as BSD's
/// asynchronous I/O is started in that process's context. The queue is bounded like the engine's thread pool; a refused job is run inline
/// or skipped by the engine, as in production.
pub struct SimSpawner {
    core: Arc<SimCore>,
    /// A spin lock, as the core's (see [`SimCore`]): one thread, asked at every step.
    queue: SpinMutex<VecDeque<(u64, usize, Job)>>,
    queued_max: usize,
    /// Jobs in `queue`, changed under its lock: [`SimSpawner::next_time`], which the
    /// scheduler asks at every step, reads it without the lock when nothing waits.
    queued: AtomicUsize,
}

impl SimSpawner {
    /// A spawner holding at most `queued_max` waiting jobs.
    pub fn new(core: Arc<SimCore>, queued_max: usize) -> Self {
        SimSpawner {
            core,
            queue: SpinMutex::new(VecDeque::new()),
            queued_max: queued_max.max(1),
            queued: AtomicUsize::new(0),
        }
    }

    fn queue(&self) -> SpinMutexGuard<'_, VecDeque<(u64, usize, Job)>> {
        self.queue.lock()
    }

    /// Spawn time of the oldest waiting job.
    pub(crate) fn next_time(&self) -> Option<u64> {
        if self.queued.load(Ordering::Acquire) == 0 {
            return None;
        }
        self.queue().front().map(|(time, _, _)| *time)
    }

    /// Takes the oldest waiting job: spawn time, account of the spawning process, job.
    pub(crate) fn pop(&self) -> Option<(u64, usize, Job)> {
        let mut queue = self.queue();
        let job = queue.pop_front();
        self.queued.store(queue.len(), Ordering::Release);
        job
    }

    /// Drops every waiting job unrun (a crash: the background work dies with the cache).
    pub fn clear(&self) {
        let mut queue = self.queue();
        let jobs = std::mem::take(&mut *queue);
        self.queued.store(0, Ordering::Release);
        drop(queue);
        drop(jobs);
    }
}

impl Spawner for SimSpawner {
    fn spawn(&self, job: Job) -> Result<(), Job> {
        let (now, origin) = self.core.cursor_and_origin();
        let mut queue = self.queue();
        if queue.len() >= self.queued_max {
            return Err(job);
        }
        queue.push_back((now, origin, job));
        self.queued.store(queue.len(), Ordering::Release);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Goal: the backward walk of `index_after` finds exactly what a binary search finds,
    /// for both of the predicates the CPU pool uses, on lists shorter and longer than the
    /// walk. Method: seeded random lists of disjoint intervals in order, probed at times
    /// before, inside, between and after them, compared with `partition_point`; the seed is
    /// printed.
    #[test]
    fn index_after_matches_partition_point() {
        let seed = 0x0034_5EED_u64;
        println!("seed {seed:#x}");
        let mut rng = SeededRng::new(seed);
        let mut next = move |bound: u64| rng.below(bound);
        for round in 0..500 {
            let count = next(40) as usize;
            let mut intervals = Vec::with_capacity(count);
            let mut time = next(5);
            for _ in 0..count {
                let start = time + next(4);
                let end = start + 1 + next(4);
                intervals.push((start, end));
                time = end;
            }
            for at in 0..time + 3 {
                let by_end = |&(_, end): &(u64, u64)| end <= at;
                let by_start = |&(start, _): &(u64, u64)| start < at;
                assert_eq!(
                    index_after(&intervals, by_end),
                    intervals.partition_point(by_end),
                    "seed {seed:#x} round {round}: ends at {at} in {intervals:?}"
                );
                assert_eq!(
                    index_after(&intervals, by_start),
                    intervals.partition_point(by_start),
                    "seed {seed:#x} round {round}: starts at {at} in {intervals:?}"
                );
            }
        }
    }
    use crate::disk::DiskSpec;

    fn core_with_queue(mode: QueueMode, merge: bool) -> (Arc<SimCore>, Vec<usize>) {
        let clock = Arc::new(VirtualClock::new());
        let core = Arc::new(SimCore::new(
            DiskSpec::rz25().build(),
            HostCosts::modern(),
            clock,
        ));
        core.set_io_queue(Some(SimIoQueue::new(mode, merge, 1 << 20)));
        core.record_dispatches();
        let accounts = (0..4).map(|i| core.add_account(&format!("p{i}"))).collect();
        (core, accounts)
    }

    /// Runs the disk until nothing waits.
    fn run_disk(core: &SimCore) {
        while let Some(time) = core.next_dispatch_ns() {
            core.dispatch(time);
        }
    }

    #[test]
    fn a_request_merges_into_an_adjacent_one_still_waiting_for_the_disk() {
        // Goal: the simulated io queue merges exactly when requests wait together, as the
        // real queue does. Method: one request keeps the disk busy; two adjacent ones arrive
        // while it is served and wait; when the disk frees they go as one command (with
        // merging off, as two).
        for merge in [false, true] {
            let (core, accounts) = core_with_queue(QueueMode::Fifo, merge);
            core.enter(accounts[0], 0);
            core.io(Op::Write, 100 << 20, 64 << 10);
            assert_eq!(
                core.end_step(),
                None,
                "the writer blocks on its queued request"
            );
            core.dispatch(core.next_dispatch_ns().unwrap());
            core.enter(accounts[1], 1_000);
            core.io(Op::Write, 0, 8192);
            core.enter(accounts[2], 2_000);
            core.io(Op::Write, 8192, 8192);
            run_disk(&core);
            let resolved = core.take_resolved();
            assert_eq!(resolved.len(), 3, "every entity goes on: {resolved:?}");
            let totals = core.device_totals();
            assert_eq!(totals.queue_entered, 3);
            if merge {
                assert_eq!((totals.queue_merged, totals.writes), (1, 2));
                // Both waiting writers complete together.
                assert_eq!(resolved[1].1, resolved[2].1);
            } else {
                assert_eq!((totals.queue_merged, totals.writes), (0, 3));
            }
        }
    }

    #[test]
    fn a_wait_for_written_data_holds_until_a_queued_write_reaches_the_disk() {
        // Goal: fsync's wait for a file's written data (`wait_for_data`) holds until a
        // write-behind write still waiting in the io queue has reached the disk, and the
        // write's dispatch wakes the waiter (it neither returns early nor waits for ever).
        // Method: a read keeps the disk busy; a write of [0, 64 KiB) arrives and waits in the
        // queue; a third entity then waits for those bytes: it must block, and go on at the
        // write's completion once the disk has run.
        let (core, accounts) = core_with_queue(QueueMode::Fifo, true);
        core.enter(accounts[0], 0);
        core.io(Op::Read, 100 << 20, 64 << 10);
        core.dispatch(core.next_dispatch_ns().unwrap());
        core.enter(accounts[1], 1_000);
        core.io(Op::Write, 0, 64 << 10);
        core.enter(accounts[2], 2_000);
        core.wait_for_data(0, 64 << 10);
        assert_eq!(
            core.end_step(),
            None,
            "the waiter blocks while the write waits in the queue"
        );
        run_disk(&core);
        let resolved = core.take_resolved();
        let done = |account: usize| {
            resolved
                .iter()
                .find(|&&(a, _)| a == account)
                .map(|&(_, time)| time)
        };
        let written = done(accounts[1]).expect("the writer goes on");
        let waited = done(accounts[2]).expect("the waiter goes on");
        assert!(written > 2_000, "the write was queued behind the read");
        assert_eq!(waited, written, "the waiter goes on when the write is done");
    }

    #[test]
    fn a_request_does_not_merge_into_one_already_at_the_disk() {
        // Goal: no merge with a request the disk has started. Method: an idle disk starts the
        // first request when it arrives; an adjacent one arriving later is issued on its own.
        let (core, accounts) = core_with_queue(QueueMode::Fifo, true);
        core.enter(accounts[0], 0);
        core.io(Op::Read, 0, 8192);
        core.dispatch(core.next_dispatch_ns().unwrap());
        core.enter(accounts[1], 1_000);
        core.io(Op::Read, 8192, 8192);
        run_disk(&core);
        let totals = core.device_totals();
        assert_eq!((totals.queue_merged, totals.reads), (0, 2));
    }

    #[test]
    fn the_elevator_serves_waiting_requests_in_one_sweep_and_fifo_in_arrival_order() {
        // Goal: the queue discipline, not the arrival order, decides what the disk serves
        // next, and service is timed only then. Method: a request at the disk's start keeps
        // it busy while three requests arrive in the order high, low, middle; fifo serves them
        // in that order, the elevator sweeps on from the head in ascending order, with less
        // positioning time.
        let mut busy = Vec::new();
        for mode in [QueueMode::Fifo, QueueMode::Elevator] {
            let (core, accounts) = core_with_queue(mode, true);
            core.enter(accounts[0], 0);
            core.io(Op::Read, 0, 4096);
            core.dispatch(core.next_dispatch_ns().unwrap());
            for (index, offset) in [(1, 200u64 << 20), (2, 10 << 20), (3, 100 << 20)] {
                core.enter(accounts[index], 1_000 * index as u64);
                core.io(Op::Read, offset, 4096);
            }
            run_disk(&core);
            let served: Vec<u64> = core.dispatches().iter().map(|d| d.offset >> 20).collect();
            match mode {
                QueueMode::Fifo => assert_eq!(served, [0, 200, 10, 100]),
                _ => assert_eq!(served, [0, 10, 100, 200]),
            }
            busy.push(core.device_totals().busy_ns);
        }
        assert!(busy[1] < busy[0], "the sweep positions less: {busy:?}");
    }

    #[test]
    fn a_blocked_entity_replays_the_rest_of_its_step_after_its_request() {
        // Goal: the work a step does after a queued request happens after that request
        // completes, in order. Method: a request, then CPU work and a second request in the
        // same step; the entity resolves after both, and the second request arrives only
        // after the first one completed plus the CPU work.
        let (core, accounts) = core_with_queue(QueueMode::Elevator, true);
        core.enter(accounts[0], 0);
        core.io(Op::Read, 50 << 20, 4096);
        core.cpu(5_000_000, 0);
        core.io(Op::Read, 60 << 20, 4096);
        assert_eq!(core.end_step(), None);
        run_disk(&core);
        let log = core.dispatches();
        assert_eq!(log.len(), 2);
        assert!(log[1].time_ns >= log[0].done_ns + 5_000_000);
        let resolved = core.take_resolved();
        assert_eq!(resolved, [(accounts[0], log[1].done_ns)]);
        assert_eq!(core.account(accounts[0]).user_ns, 5_000_000);
        assert!(!core.blocked(accounts[0]));
    }
}
