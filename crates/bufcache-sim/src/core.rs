//! The simulation core: timelines and accounts, the CPU pool, the disk, and the two engine
//! adapters that bring them together: [`SimDevice`] (the engine's `Device`) and
//! [`SimSpawner`] (the engine's `Spawner`).
//!
//! Exactly one entity runs at a time. While it runs, `cursor_ns` is its timeline: CPU work
//! books a CPU from the cursor on and moves the cursor past it; a device request is handed to
//! the disk model at the cursor and the cursor moves to its completion (the entity blocks on
//! its own I/O). Everything is charged to the running entity's [`Account`].

use std::collections::VecDeque;
use std::io::{self, IoSlice, IoSliceMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use bufcache::device::{SeededRng, SparseStore};
use bufcache::environment::Job;
use bufcache::{Device, Spawner, Waiter};
use serde::Serialize;

use crate::clock::VirtualClock;
use crate::disk::{DiskModel, Op};
use crate::host::HostCosts;

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
}

/// The io queue in the simulated path: like `serve`'s, requests that wait for the disk
/// together are merged when adjacent and in the same direction, up to
/// `transfer_size_max_bytes`. The simulator fixes a request's service time when it is issued
/// (its entity blocks on it), so a request can join only the request issued just before it,
/// while that one still waits for the disk; requests already waiting are never reordered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct SimIoQueue {
    /// Merge adjacent waiting requests (`--no-io-merge` turns it off).
    pub merge: bool,
    /// Largest merged request, bytes.
    pub transfer_size_max_bytes: u64,
}

/// The request issued last, while it may still take merges.
#[derive(Clone, Copy, Debug)]
struct LastRequest {
    op: Op,
    offset: u64,
    end: u64,
    start_ns: u64,
}

/// A booking candidate: finish time, CPU, pieces.
type Booking = (u64, usize, Vec<(u64, u64)>);

/// CPUs as lists of booked intervals, so that work booked out of order (an entity that ran
/// ahead in one atomic step) leaves earlier gaps usable by others, and long work time-shares
/// with short work (a copy does not wait for a whole write-back step to end).
struct CpuPool {
    busy: Vec<Vec<(u64, u64)>>,
}

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
            let mut pieces = Vec::new();
            let mut candidate = at;
            let mut remaining = duration;
            let from = intervals.partition_point(|&(_, end)| end <= at);
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
        let intervals = &mut self.busy[cpu];
        for piece in pieces {
            let index = intervals.partition_point(|&(s, _)| s < piece.0);
            // Work that starts where the previous booking ends extends it: the gaps are the
            // same, and the lists stay short for back-to-back work of one entity.
            if index > 0 && intervals[index - 1].1 == piece.0 {
                intervals[index - 1].1 = piece.1;
            } else {
                intervals.insert(index, piece);
            }
        }
        finish
    }

    /// Forgets intervals that end before `floor` (no entity can book before it any more).
    fn prune(&mut self, floor: u64) {
        for intervals in &mut self.busy {
            let keep_from = intervals.partition_point(|&(_, end)| end < floor);
            if keep_from > 256 {
                intervals.drain(..keep_from);
            }
        }
    }
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
    io_queue: Option<SimIoQueue>,
    last_request: Option<LastRequest>,
}

/// Shared simulation state: used by the scheduler, the device and the spawner.
pub struct SimCore {
    state: Mutex<CoreState>,
    clock: Arc<VirtualClock>,
}

impl SimCore {
    /// A core with `disk` and `host`, at time 0.
    pub fn new(disk: Box<dyn DiskModel>, host: HostCosts, clock: Arc<VirtualClock>) -> Self {
        SimCore {
            state: Mutex::new(CoreState {
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
                io_queue: None,
                last_request: None,
            }),
            clock,
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, CoreState> {
        self.state
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    /// Puts an io queue between the engine and the disk (`None`: requests go straight on).
    pub fn set_io_queue(&self, queue: Option<SimIoQueue>) {
        let mut state = self.lock();
        state.io_queue = queue;
        state.last_request = None;
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
        state.current = account;
        state.cpu_account = cpu_account;
        state.cursor_ns = time_ns;
        drop(state);
        self.clock.advance_to(time_ns);
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
        let mut state = self.lock();
        state.cpu_work(user_ns, sys_ns);
        let now = state.cursor_ns;
        drop(state);
        self.clock.advance_to(now);
    }

    /// Waits (without CPU) until `time_ns`.
    pub fn wait_until(&self, time_ns: u64, for_io: bool) {
        let mut state = self.lock();
        if time_ns > state.cursor_ns {
            if for_io {
                let current = state.current;
                state.accounts[current].io_wait_ns += time_ns - state.cursor_ns;
            }
            state.cursor_ns = time_ns;
        }
        drop(state);
        self.clock.advance_to(time_ns);
    }

    /// When the data of device bytes `[offset, offset + length)` last arrived from the disk.
    pub fn ready_at(&self, offset: u64, length: u64) -> u64 {
        let state = self.lock();
        let first = (offset / READY_UNIT) as usize;
        let end = ((offset + length).div_ceil(READY_UNIT) as usize).min(state.ready.len());
        state
            .ready
            .get(first..end.max(first))
            .map_or(0, |units| units.iter().copied().max().unwrap_or(0))
    }

    /// Bytes read from the disk since the last call (each read fills fresh buffers whose
    /// pages are wired), and resets the count.
    pub(crate) fn take_read_bytes(&self) -> u64 {
        std::mem::take(&mut self.lock().read_unwired_bytes)
    }

    /// Forgets CPU bookings before `floor`.
    pub(crate) fn prune(&self, floor: u64) {
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
        self.lock().device.clone()
    }

    /// The host cost model.
    pub fn host(&self) -> HostCosts {
        self.lock().host.clone()
    }

    fn io(&self, op: Op, offset: u64, length: u64) {
        let mut state = self.lock();
        let io_ns = state.host.io_ns;
        state.cpu_work(0, io_ns);
        let arrival = state.cursor_ns;
        let merge_into = match (state.io_queue, state.last_request) {
            (Some(queue), Some(last))
                if queue.merge
                    && last.op == op
                    && last.start_ns > arrival
                    && (offset == last.end || offset + length == last.offset)
                    && last.end - last.offset + length <= queue.transfer_size_max_bytes =>
            {
                Some(last)
            }
            _ => None,
        };
        if state.io_queue.is_some() {
            state.device.queue_entered += 1;
        }
        let done = match merge_into {
            Some(mut last) => {
                let done = state.disk.extend_last(op, length);
                last.offset = last.offset.min(offset);
                last.end = last.end.max(offset + length);
                state.last_request = Some(last);
                state.device.queue_merged += 1;
                done
            }
            None => {
                let start_ns = state.disk.start_ns(arrival);
                if state.io_queue.is_some() {
                    state.last_request = Some(LastRequest {
                        op,
                        offset,
                        end: offset + length,
                        start_ns,
                    });
                }
                state.disk.serve(op, offset, length, arrival)
            }
        };
        let issued = u64::from(merge_into.is_none());
        let current = state.current;
        let busy_from = arrival.max(state.device.last_done_ns);
        state.device.busy_ns += done.saturating_sub(busy_from);
        state.device.last_done_ns = state.device.last_done_ns.max(done);
        let account = &mut state.accounts[current];
        account.io_wait_ns += done.saturating_sub(arrival);
        match op {
            Op::Read => {
                account.reads += 1;
                account.read_bytes += length;
                state.device.reads += issued;
                state.device.read_bytes += length;
                state.read_unwired_bytes += length;
                let first = (offset / READY_UNIT) as usize;
                let end = (offset + length).div_ceil(READY_UNIT) as usize;
                if state.ready.len() < end {
                    state.ready.resize(end, 0);
                }
                for unit in &mut state.ready[first..end] {
                    *unit = done;
                }
            }
            Op::Write => {
                account.writes += 1;
                account.write_bytes += length;
                state.device.writes += issued;
                state.device.write_bytes += length;
            }
        }
        state.cursor_ns = done;
        drop(state);
        self.clock.advance_to(done);
    }
}

impl CoreState {
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
            contents: Mutex::new(Contents::default()),
            faults: Mutex::new(None),
        }
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
            let now = self.core.cursor();
            self.core.wait_until(now + extra, true);
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
        {
            let contents = self.contents();
            let mut at = offset;
            for buffer in buffers.iter_mut() {
                contents.chunks.read(at, buffer);
                at += buffer.len() as u64;
            }
        }
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
        // A flush costs one command, and on a drive with a write cache it waits until the
        // cached writes are on the medium.
        let mut state = self.core.lock();
        let io_ns = state.host.io_ns;
        state.cpu_work(0, io_ns);
        state.device.flushes += 1;
        let now = state.cursor_ns;
        let drained = state.disk.drain_write_cache(now);
        drop(state);
        if let Some(drained) = drained {
            self.core.wait_until(drained, true);
        }
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
        bufcache::Capabilities::plain(self.length)
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
        let now = self.core.cursor();
        self.core.wait_until(now + timeout_ns, false);
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
    queue: Mutex<VecDeque<(u64, usize, Job)>>,
    queued_max: usize,
}

impl SimSpawner {
    /// A spawner holding at most `queued_max` waiting jobs.
    pub fn new(core: Arc<SimCore>, queued_max: usize) -> Self {
        SimSpawner {
            core,
            queue: Mutex::new(VecDeque::new()),
            queued_max: queued_max.max(1),
        }
    }

    fn queue(&self) -> MutexGuard<'_, VecDeque<(u64, usize, Job)>> {
        self.queue
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    /// Spawn time of the oldest waiting job.
    pub(crate) fn next_time(&self) -> Option<u64> {
        self.queue().front().map(|(time, _, _)| *time)
    }

    /// Takes the oldest waiting job: spawn time, account of the spawning process, job.
    pub(crate) fn pop(&self) -> Option<(u64, usize, Job)> {
        self.queue().pop_front()
    }

    /// Drops every waiting job unrun (a crash: the background work dies with the cache).
    pub fn clear(&self) {
        let jobs = std::mem::take(&mut *self.queue());
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
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::disk::DiskSpec;

    fn core_with_queue(merge: bool) -> (Arc<SimCore>, Vec<usize>) {
        let clock = Arc::new(VirtualClock::new());
        let core = Arc::new(SimCore::new(
            DiskSpec::rz25().build(),
            HostCosts::modern(),
            clock,
        ));
        core.set_io_queue(Some(SimIoQueue {
            merge,
            transfer_size_max_bytes: 1 << 20,
        }));
        let accounts = (0..3).map(|i| core.add_account(&format!("p{i}"))).collect();
        (core, accounts)
    }

    #[test]
    fn a_request_merges_into_an_adjacent_one_still_waiting_for_the_disk() {
        // Goal: the simulated io queue merges exactly when a request waits, as the real
        // queue does. Method: one request keeps the disk busy; a second waits behind it; a
        // third, adjacent to the second, arrives while the second still waits and merges
        // (with merging off it is issued on its own).
        for merge in [false, true] {
            let (core, accounts) = core_with_queue(merge);
            core.enter(accounts[0], 0);
            core.io(Op::Write, 100 << 20, 64 << 10);
            core.enter(accounts[1], 1_000);
            core.io(Op::Write, 0, 8192);
            let second_done = core.cursor();
            core.enter(accounts[2], 2_000);
            core.io(Op::Write, 8192, 8192);
            let totals = core.device_totals();
            assert_eq!(totals.queue_entered, 3);
            if merge {
                assert_eq!((totals.queue_merged, totals.writes), (1, 2));
                // The merged request ends one transfer after the request it joined.
                assert!(core.cursor() > second_done);
                assert!(core.cursor() - second_done < 5_000_000);
            } else {
                assert_eq!((totals.queue_merged, totals.writes), (0, 3));
            }
        }
    }

    #[test]
    fn a_request_does_not_merge_into_one_already_at_the_disk() {
        // Goal: no merge with a request the disk has started. Method: an idle disk starts the
        // first request at once; an adjacent one arriving later is issued on its own.
        let (core, accounts) = core_with_queue(true);
        core.enter(accounts[0], 0);
        core.io(Op::Read, 0, 8192);
        core.enter(accounts[1], 1_000);
        core.io(Op::Read, 8192, 8192);
        let totals = core.device_totals();
        assert_eq!((totals.queue_merged, totals.reads), (0, 2));
    }
}
