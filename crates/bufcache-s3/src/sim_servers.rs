//! `bufcache sim check --layout log --servers N`: two or three servers on one log-layout disk
//! in one simulated store ([`crate::sim_store`]), taking it from each other under the lease
//! (module `lease`), checked seed by seed.
//!
//! Time is virtual: the harness advances one global instant in ticks of a fiftieth to an
//! eighth of a lease, and every server reads it through its own clock, `offset + t · (1 + r)`,
//! with an offset of its own and a rate error `r` within the stated bound
//! [`crate::lease::CLOCK_RATE_ERROR_MAX`] (a quarter of the seeds put the bound's extremes on
//! the servers). Each server is one process: a standby watches the lock object and takes it
//! with the lock's own protocol once its ETag stood unchanged for a whole lease on the
//! standby's clock ([`LapseWatch`]); the holder renews it every third of a lease with a PUT
//! conditional on its own last ETag, and opens the disk ([`LogStore::open_leased_on`]) under
//! its [`Lease`], which gates every acknowledgement and every segment and checkpoint PUT. The
//! store fails, loses and hangs requests as the seed says, and the harness, at seeded
//! moments, cuts one server off from the store for a while (a partition), freezes one
//! (SIGSTOP: its clock runs on, it does nothing, and a step it was in stays where it was,
//! its hung requests landing only when it resumes, past its lease), crashes one (its process
//! restarts later as a standby), and sends the client's writes, zeroes, reads, FLUSHes and
//! collection rounds to a server that believes it holds the disk (a deposed writer among
//! them, and a resumed one before its overdue renewal, as a client that has not yet
//! reconnected would).
//!
//! The check:
//! - **One writer at a time.** A server's tenure starts at the instant its lock PUT (create
//!   or takeover) was carried out; its acknowledged interval runs from there to its last
//!   acknowledged write, zeroing or FLUSH. No two servers' acknowledged intervals overlap:
//!   every acknowledgement of a server comes before the next tenure starts (instants are
//!   virtual time and, within one, the order events happened in).
//! - **Nothing flushed is lost.** When a new writer opens the disk, the disk it finds is a
//!   prefix of the changes acknowledged since the previous writer's open, in acknowledgement
//!   order, that includes every change a FLUSH acknowledged (unacknowledged changes may be
//!   in it or not), as the single-server check requires of a reopen (module `sim_check`); so
//!   is the disk a last server finds once every process stopped.
//! - **Reads** of the newest writer return the latest acknowledged data, and every segment
//!   its index names exists (a deposed writer's late requests never removed one).
//!
//! Replay: the store's fates and the harness's choices are functions of the seed; the one
//! timing input is how long a step may run before it counts as stuck on a hung request, as
//! in the single-server check.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use bufcache_check::{Notes, Violation, RECENT_STEPS};
use bytes::Bytes;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, PutMode, PutOptions, UpdateVersion};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use bufcache_device::Clock;

use crate::lease::{renewal_interval_ns, LapseWatch, Lease, CLOCK_RATE_ERROR_MAX};
use crate::sim_check::{
    apply, describe_tag, describe_tags, draw_config, draw_disk, draw_world, find_prefix, misread,
    tag_of, writes_of, Allowed, Change, DrawnDisk, BLOCK_BYTES,
};
use crate::sim_store::{FaultRates, SimWorld};
use crate::{LogConfig, LogStore, S3Url, StoreError};

/// The lease every server holds the disk under, in virtual nanoseconds.
const LEASE_NS: u64 = 1_000_000_000;
/// How long a step may run while a request of its server hangs before the harness deems it
/// stuck on that request.
const STUCK_AFTER: Duration = Duration::from_millis(40);
/// How long a step may run with no request of its server hanging before it is reported as
/// never returning.
const NEVER_RETURNS: Duration = Duration::from_secs(10);
/// The most servers on one disk.
pub const SERVERS_MAX: u32 = 3;

/// The properties `sim check --layout log --servers` checks (module docs), as its
/// violations name them.
pub mod property {
    /// One writer at a time: no server acknowledges after another took the disk.
    pub const ONE_WRITER: &str = "one writer at a time";
    /// Nothing flushed is lost: a new writer's disk is a prefix of the writes that includes
    /// every flushed one.
    pub const NOTHING_FLUSHED_LOST: &str = "nothing flushed is lost";
    /// Reads of the newest writer return the latest acknowledged data.
    pub const READS: &str = "reads";
    /// Every segment the newest writer's index names exists.
    pub const SEGMENTS_EXIST: &str = "named segments exist";
    /// Every step returns (or hangs on a request the harness knows of), and the disk opens.
    pub const PROGRESS: &str = "progress";
}

/// What checking one seed found.
#[derive(Clone, Debug, Default)]
pub struct ServersCheckOutcome {
    pub servers: u32,
    /// Ticks of virtual time.
    pub ticks: u64,
    /// Client steps sent to a server (writes, zeroes, reads, FLUSHes, collection rounds).
    pub steps: u64,
    /// Tenures after the first: a server took the disk from another.
    pub takeovers: u64,
    /// Opens of the disk by a new writer checked against the flushed history.
    pub opens_checked: u64,
    pub pauses: u64,
    /// Pauses that froze a server in the middle of a step, its requests landing at resume.
    pub pauses_in_step: u64,
    pub partitions: u64,
    pub crashes: u64,
    /// Writes, zeroings and FLUSHes a server refused because its lease had lapsed or the
    /// disk was taken over (what the lease exists for).
    pub refused_by_lease: u64,
    /// Acknowledged writes and FLUSHes.
    pub acknowledged: u64,
    /// Requests the store failed, lost or hung, and requests that landed late.
    pub faults: u64,
    pub late_landings: u64,
    /// The largest clock-rate error a server ran with, in parts per million.
    pub clock_rate_error_ppm_max: u64,
    /// What broke the contract, with the tick; None when nothing did.
    pub violation: Option<Violation>,
}

impl bufcache_check::SeedOutcome for ServersCheckOutcome {
    fn violation(&self) -> Option<&Violation> {
        self.violation.as_ref()
    }
}

/// A server's clock: the global virtual time at its own rate and offset.
struct SkewedClock {
    time_ns: Arc<AtomicU64>,
    offset_ns: u64,
    /// Rate error in parts per million, within ±[`CLOCK_RATE_ERROR_MAX`].
    rate_error_ppm: i64,
}

thread_local! {
    /// The global virtual time this thread last read through a server's clock: after a
    /// write or FLUSH returns, the time of its last lease check (the last clock read of
    /// `LogStore::write`, `write_zeroes` and `flush`), when it decided to acknowledge.
    static TIME_LAST_READ_NS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

impl Clock for SkewedClock {
    fn now_ns(&self) -> u64 {
        let global = self.time_ns.load(Ordering::Acquire);
        TIME_LAST_READ_NS.with(|last| last.set(global));
        let time = i128::from(global);
        let skewed = time + time * i128::from(self.rate_error_ppm) / 1_000_000;
        self.offset_ns + u64::try_from(skewed).expect("a rate error below 100 %")
    }
}

/// A moment of the simulation: virtual nanoseconds, then the order of events within them.
type Instant = (u64, u64);

/// What a server's step answers.
enum Answer {
    Acquire(Acquired, LapseWatch),
    Renew(Renewal),
    Opened(Result<LogStore, crate::OpenError>),
    Writes(Vec<Outcome>),
    Done(Outcome),
    Read(Result<Vec<u8>, StoreError>),
    Collected(Result<crate::GcReport, StoreError>, Vec<Outcome>),
}

/// A client request's outcome and the virtual time of its last lease check: the time the
/// step started, unless the step's server was frozen before that check (time only moves
/// while a step's server is frozen).
type Outcome = (Result<(), StoreError>, u64);

/// What one attempt at the lock found.
enum Acquired {
    /// Ours: taken with a PUT sent at this clock time, answered with this ETag.
    Held { sent_ns: u64, e_tag: Option<String> },
    /// Another server's, not (yet) lapsed, or the attempt failed; `uncertain` when a PUT
    /// of ours went unanswered (it may have been carried out).
    Waiting { why: String, uncertain: bool },
    /// Ours, through a PUT whose answer was lost earlier (a read found our id).
    Found { e_tag: Option<String> },
}

/// What one renewal found.
enum Renewal {
    Renewed {
        sent_ns: u64,
        e_tag: Option<String>,
    },
    /// Our ETag is stale (an earlier renewal landed after its answer was lost): learnt anew.
    Learnt {
        e_tag: Option<String>,
        renewal: u64,
    },
    /// The condition failed: the next renewal reads the lock back first.
    Stale,
    TakenOver(String),
    Failed(String),
}

/// The lock object's body: who holds it (the server's instance) and its renewal count.
fn lock_body(instance: u64, renewal: u64) -> Bytes {
    Bytes::from(format!("sim-lock instance {instance} renewal {renewal}"))
}

fn parse_lock_body(body: &[u8]) -> Option<(u64, u64)> {
    let text = std::str::from_utf8(body).ok()?;
    let words: Vec<&str> = text.split_whitespace().collect();
    match words.as_slice() {
        ["sim-lock", "instance", instance, "renewal", renewal] => {
            Some((instance.parse().ok()?, renewal.parse().ok()?))
        }
        _ => None,
    }
}

fn put_mode(e_tag: Option<String>) -> PutOptions {
    PutOptions {
        mode: match e_tag {
            Some(e_tag) => PutMode::Update(UpdateVersion {
                e_tag: Some(e_tag),
                version: None,
            }),
            None => PutMode::Create,
        },
        ..Default::default()
    }
}

/// Why the lock could not be read.
#[derive(Debug, thiserror::Error)]
enum LockReadError {
    #[error(transparent)]
    Store(#[from] object_store::Error),
    #[error("an unreadable lock")]
    Unreadable,
}

/// Reads the lock: (holder instance, renewal, ETag), None when there is none.
async fn read_lock(
    store: &dyn ObjectStore,
    path: &ObjectPath,
) -> Result<Option<(u64, u64, Option<String>)>, LockReadError> {
    match store.get(path).await {
        Ok(found) => {
            let e_tag = found.meta.e_tag.clone();
            let body = found.bytes().await?;
            let (instance, renewal) = parse_lock_body(&body).ok_or(LockReadError::Unreadable)?;
            Ok(Some((instance, renewal, e_tag)))
        }
        Err(object_store::Error::NotFound { .. }) => Ok(None),
        Err(error) => Err(error.into()),
    }
}

/// Runs a lock request on the step's thread (the simulated store runs its own executor
/// inside, so this is a runtime, not `futures`' executor).
fn block_on<T>(future: impl std::future::Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a runtime for a lock request")
        .block_on(future)
}

fn waiting(why: String, uncertain: bool) -> Acquired {
    Acquired::Waiting { why, uncertain }
}

/// One attempt at the lock, as lock.rs's `DiskLock::take` makes it: create it, or take it
/// with a PUT conditional on an ETag that stood unchanged for a whole lease.
async fn acquire(
    store: &dyn ObjectStore,
    path: &ObjectPath,
    instance: u64,
    clock: &dyn Clock,
    mut watch: LapseWatch,
) -> (Acquired, LapseWatch) {
    let sent_ns = clock.now_ns();
    match store
        .put_opts(path, lock_body(instance, 0).into(), put_mode(None))
        .await
    {
        Ok(result) => {
            return (
                Acquired::Held {
                    sent_ns,
                    e_tag: result.e_tag,
                },
                watch,
            )
        }
        Err(object_store::Error::AlreadyExists { .. })
        | Err(object_store::Error::Precondition { .. }) => {}
        Err(error) => return (waiting(format!("create: {error}"), true), watch),
    }
    let (holder, e_tag) = match read_lock(store, path).await {
        Ok(Some((holder, _, e_tag))) => (holder, e_tag),
        Ok(None) => return (waiting("released meanwhile".to_string(), false), watch),
        Err(error) => return (waiting(format!("read: {error}"), false), watch),
    };
    if holder == instance {
        return (Acquired::Found { e_tag }, watch);
    }
    let Some(tag) = e_tag else {
        return (waiting("no ETag".to_string(), false), watch);
    };
    if !watch.observe(&tag, clock.now_ns()) {
        return (waiting(format!("instance {holder} holds it"), false), watch);
    }
    let sent_ns = clock.now_ns();
    match store
        .put_opts(path, lock_body(instance, 0).into(), put_mode(Some(tag)))
        .await
    {
        Ok(result) => (
            Acquired::Held {
                sent_ns,
                e_tag: result.e_tag,
            },
            watch,
        ),
        Err(error) => match read_lock(store, path).await {
            Ok(Some((holder, _, e_tag))) if holder == instance => {
                (Acquired::Found { e_tag }, watch)
            }
            _ => (
                waiting(
                    format!("takeover: {error}"),
                    !matches!(error, object_store::Error::Precondition { .. }),
                ),
                watch,
            ),
        },
    }
}

/// One renewal, as lock.rs's `renew` makes it.
async fn renew(
    store: &dyn ObjectStore,
    path: &ObjectPath,
    instance: u64,
    renewal: u64,
    e_tag: Option<String>,
    clock: &dyn Clock,
) -> Renewal {
    let Some(e_tag) = e_tag else {
        return match read_lock(store, path).await {
            Ok(Some((holder, renewal, e_tag))) if holder == instance => {
                Renewal::Learnt { e_tag, renewal }
            }
            Ok(Some((holder, _, _))) => Renewal::TakenOver(format!("instance {holder}")),
            Ok(None) => Renewal::TakenOver("nobody: the lock was deleted".to_string()),
            Err(error) => Renewal::Failed(error.to_string()),
        };
    };
    let sent_ns = clock.now_ns();
    match store
        .put_opts(
            path,
            lock_body(instance, renewal + 1).into(),
            put_mode(Some(e_tag)),
        )
        .await
    {
        Ok(result) => Renewal::Renewed {
            sent_ns,
            e_tag: result.e_tag,
        },
        Err(object_store::Error::Precondition { .. }) => Renewal::Stale,
        Err(error) => Renewal::Failed(error.to_string()),
    }
}

/// A writer's hold on the disk.
struct Writer {
    lease: Arc<Lease>,
    e_tag: Option<String>,
    renewal: u64,
    /// Clock time of the next renewal.
    renew_at_ns: u64,
    store: Option<Arc<LogStore>>,
    /// The tenure's index in the harness's list.
    tenure: usize,
}

enum Role {
    Standby {
        watch: Option<LapseWatch>,
        /// The first instant this standby sent a lock PUT whose answer it never got (it
        /// may have been carried out).
        uncertain: Option<Instant>,
    },
    Writer(Writer),
    /// Crashed; restarts as a standby at this virtual time.
    Down(u64),
}

/// A step frozen with its server (a pause in the middle of it).
struct Pending {
    receiver: mpsc::Receiver<Answer>,
    kind: PendingKind,
}

enum PendingKind {
    /// Client writes: their history positions, and the instant the step started.
    Writes(Vec<usize>, Instant),
    /// A FLUSH covering this many changes of history, started at this instant.
    Flush(usize, Instant),
    /// A step whose answer acknowledges nothing (a lock request, an open, a read).
    Other,
}

struct Server {
    number: usize,
    clock: Arc<SkewedClock>,
    instance: u64,
    role: Role,
    /// Frozen until this virtual time.
    paused_until: Option<u64>,
    pending: Option<Pending>,
    /// Cut off from the store until this virtual time.
    partitioned_until: Option<u64>,
}

/// A server's hold on the disk, from its lock PUT to its last acknowledgement.
struct Tenure {
    server: usize,
    instance: u64,
    taken: Instant,
    last_acknowledged: Option<Instant>,
}

struct Harness {
    seed: u64,
    /// Every step, the last ones kept for a violation's report (printed when tracing).
    notes: Notes,
    rng: StdRng,
    world: Arc<SimWorld>,
    url: S3Url,
    lock_path: ObjectPath,
    config: LogConfig,
    compressible: bool,
    blocks: u64,
    time_ns: Arc<AtomicU64>,
    order: u64,
    tick: u64,
    next_instance: u64,
    servers: Vec<Server>,
    tenures: Vec<Tenure>,
    /// Tags of every block at the newest writer's open, as read back.
    base: Vec<u64>,
    /// Changes since that open, in acknowledgement order.
    history: Vec<Change>,
    /// How many changes came before `history[0]` (positions held by frozen steps count
    /// from the first change of the seed).
    history_start: usize,
    flushed: usize,
    now: Allowed,
    next_write: u64,
    /// How often a step stuck on a hung request freezes its server rather than crashing it.
    pause_when_stuck: f64,
    outcome: ServersCheckOutcome,
}

fn spawn_step(trace: bool, step: Box<dyn FnOnce() -> Answer + Send>) -> mpsc::Receiver<Answer> {
    let (sender, receiver) = mpsc::channel();
    std::thread::Builder::new()
        .name("sim-server-step".to_string())
        .spawn(move || {
            let _quiet = (!trace).then(|| {
                tracing::subscriber::set_default(tracing::subscriber::NoSubscriber::default())
            });
            let _ = sender.send(step());
        })
        .expect("starting a step thread");
    receiver
}

/// How waiting for a step ended.
enum Waited {
    Answer(Answer),
    /// A request of the step's server hangs and the step has not returned.
    Stuck(mpsc::Receiver<Answer>),
}

/// A step that did not come back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stall {
    /// Its thread panicked.
    Panicked,
    /// No answer after [`NEVER_RETURNS`], and no request of this instance hangs.
    NeverReturned { instance: u64 },
}

impl std::fmt::Display for Stall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stall::Panicked => write!(f, "a step's thread panicked"),
            Stall::NeverReturned { instance } => write!(
                f,
                "a step of instance {instance} has not returned after {NEVER_RETURNS:?} and none of its requests hangs (deadlock?)"
            ),
        }
    }
}

fn wait(
    receiver: mpsc::Receiver<Answer>,
    world: &SimWorld,
    instance: u64,
) -> Result<Waited, Stall> {
    let mut waited = Duration::ZERO;
    loop {
        match receiver.recv_timeout(STUCK_AFTER) {
            Ok(answer) => return Ok(Waited::Answer(answer)),
            Err(mpsc::RecvTimeoutError::Disconnected) => return Err(Stall::Panicked),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                waited += STUCK_AFTER;
                if world.parked_of(instance) > 0 {
                    return Ok(Waited::Stuck(receiver));
                }
                if waited >= NEVER_RETURNS {
                    return Err(Stall::NeverReturned { instance });
                }
            }
        }
    }
}

fn lease_refused(result: &Result<(), StoreError>) -> bool {
    matches!(result, Err(StoreError::Lease { .. }))
}

impl Harness {
    fn note(&mut self, text: String) {
        let at = format_args!(
            "seed {} tick {} t={}ms",
            self.seed,
            self.tick,
            self.time_ns.load(Ordering::Acquire) / 1_000_000
        );
        self.notes.note(at, text);
    }

    /// Traces what the store did (the world's log), without keeping it.
    fn flush_world_log(&self) {
        for line in self.world.take_log() {
            self.notes.trace(
                format_args!("seed {} tick {}", self.seed, self.tick),
                format_args!("  store: {line}"),
            );
        }
    }

    /// A broken `property` (module [`property`]) at this tick, with the steps before it.
    fn violation(&self, property: &'static str, detail: String) -> Violation {
        let tick = bufcache_check::Step::tick(self.tick);
        Violation::new(property, detail, tick, self.seed, &self.notes)
    }

    /// A step that did not come back, as a violation.
    fn stalled(&self, stall: Stall) -> Violation {
        self.violation(property::PROGRESS, stall.to_string())
    }

    fn instant(&mut self) -> Instant {
        self.order += 1;
        (self.time_ns.load(Ordering::Acquire), self.order)
    }

    fn time(&self) -> u64 {
        self.time_ns.load(Ordering::Acquire)
    }

    /// Runs a step of server `at`; None when it got stuck (the server then froze or
    /// crashed, and `kind` says what its answer would acknowledge).
    fn run(
        &mut self,
        at: usize,
        kind: PendingKind,
        step: impl FnOnce() -> Answer + Send + 'static,
    ) -> Result<Option<Answer>, Violation> {
        self.run_boxed(at, kind, Box::new(step))
    }

    fn run_boxed(
        &mut self,
        at: usize,
        kind: PendingKind,
        step: Box<dyn FnOnce() -> Answer + Send>,
    ) -> Result<Option<Answer>, Violation> {
        let receiver = spawn_step(self.notes.tracing(), step);
        let instance = self.servers[at].instance;
        let waited = wait(receiver, &self.world, instance).map_err(|stall| self.stalled(stall))?;
        self.flush_world_log();
        match waited {
            Waited::Answer(answer) => Ok(Some(answer)),
            Waited::Stuck(receiver) => {
                if self.rng.gen_bool(self.pause_when_stuck) {
                    let until = self.time() + self.rng.gen_range(LEASE_NS / 4..=3 * LEASE_NS);
                    self.note({
                        format!(
                            "server {at} stuck on a hung request: frozen until t={}ms",
                            until / 1_000_000
                        )
                    });
                    self.outcome.pauses += 1;
                    self.outcome.pauses_in_step += 1;
                    let server = &mut self.servers[at];
                    server.paused_until = Some(until);
                    server.pending = Some(Pending { receiver, kind });
                } else {
                    self.note(format!("server {at} stuck on a hung request: it crashes"));
                    self.crash(at);
                    // Its requests now fail at once: the step ends.
                    let _ = receiver.recv_timeout(NEVER_RETURNS);
                }
                Ok(None)
            }
        }
    }

    /// Crashes server `at`: its process is gone, its lock (if it held it) stays to lapse;
    /// it restarts as a standby a while later.
    fn crash(&mut self, at: usize) {
        self.outcome.crashes += 1;
        let restart = self.time() + self.rng.gen_range(LEASE_NS / 2..=4 * LEASE_NS);
        self.stop(at, restart);
    }

    /// Ends server `at`'s process; it restarts as a standby at virtual time `restart_ns`.
    fn stop(&mut self, at: usize, restart: u64) {
        let instance = self.servers[at].instance;
        self.world.crash(instance);
        let server = &mut self.servers[at];
        server.role = Role::Down(restart);
        server.paused_until = None;
        if let Some(pending) = server.pending.take() {
            let _ = pending.receiver.recv_timeout(NEVER_RETURNS);
        }
        self.flush_world_log();
    }

    /// The tenure that started last.
    fn newest_tenure(&self) -> Option<usize> {
        self.tenures.len().checked_sub(1)
    }

    /// The instant a request of a step started at `started` was acknowledged, given the
    /// virtual time of its last lease check: the step's own instant, or, when the check came
    /// after its server was frozen and time moved, the end of that time's events (no order
    /// within it is known, so every event at that time counts as before it).
    fn when(&mut self, started: Instant, checked_ns: u64) -> Instant {
        if checked_ns == started.0 {
            started
        } else {
            (checked_ns, u64::MAX)
        }
    }

    /// Server `at` acknowledged a write or FLUSH at instant `now`: no other tenure may have
    /// started between its own and then.
    fn acknowledged(&mut self, at: usize, what: &str, now: Instant) -> Result<(), Violation> {
        self.outcome.acknowledged += 1;
        let instance = self.servers[at].instance;
        if let Role::Writer(writer) = &self.servers[at].role {
            let (age, check) = (writer.lease.age_ns(), writer.lease.check());
            self.note({
                format!(
                    "server {at} acknowledges {what}: lease age {}ms, {check:?}",
                    age / 1_000_000
                )
            });
        }
        let Some(own) = self
            .tenures
            .iter()
            .position(|tenure| tenure.instance == instance)
        else {
            return Err(self.violation(
                property::ONE_WRITER,
                format!(
                    "server {at} (instance {instance}) acknowledged {what} without ever holding the disk"
                ),
            ));
        };
        if let Some(next) = self.tenures.get(own + 1).filter(|next| next.taken <= now) {
            return Err(self.violation(
                property::ONE_WRITER,
                format!(
                    "server {at} (instance {instance}) acknowledged {what} at t={}ms, after server {} (instance {}) took the disk at t={}ms: two servers' acknowledged intervals overlap",
                    now.0 / 1_000_000,
                    next.server,
                    next.instance,
                    next.taken.0 / 1_000_000
                ),
            ));
        }
        let last = &mut self.tenures[own].last_acknowledged;
        *last = (*last).max(Some(now));
        Ok(())
    }

    /// `count` writes of random ranges (see [`writes_of`]).
    fn random_writes(&mut self, count: usize) -> (Vec<(u64, Vec<u8>)>, Vec<Change>) {
        let ranges = (0..count).map(|_| self.random_blocks()).collect();
        writes_of(ranges, &mut self.next_write, self.compressible)
    }

    fn random_blocks(&mut self) -> std::ops::Range<u64> {
        let length = self.rng.gen_range(1..=8u64.min(self.blocks));
        let start = self.rng.gen_range(0..=self.blocks - length);
        start..start + length
    }

    /// Adds unacknowledged changes to history (they may reach the disk or not); returns
    /// their positions.
    fn push_unacknowledged(&mut self, changes: Vec<Change>) -> Vec<usize> {
        let mut positions = Vec::new();
        for change in changes {
            apply(&mut self.now, &change);
            positions.push(self.history_start + self.history.len());
            self.history.push(change);
        }
        positions
    }

    /// The changes at `positions` were acknowledged (each outcome) by server `at`.
    fn settle_writes(
        &mut self,
        at: usize,
        positions: &[usize],
        started: Instant,
        outcomes: Vec<Outcome>,
    ) -> Result<(), Violation> {
        for (&position, (outcome, returned_ns)) in positions.iter().zip(outcomes) {
            match &outcome {
                Ok(()) => {
                    let when = self.when(started, returned_ns);
                    self.acknowledged(at, "a write", when)?;
                    // A change from before the newest open is part of that open's disk
                    // (or was lost, which only a FLUSH forbids).
                    if let Some(change) = position
                        .checked_sub(self.history_start)
                        .and_then(|index| self.history.get_mut(index))
                    {
                        change.acknowledged = true;
                    }
                }
                Err(error) => {
                    if lease_refused(&outcome) {
                        self.outcome.refused_by_lease += 1;
                    }
                    self.note(format!("server {at}: change {position} failed: {error}"));
                }
            }
        }
        // The allowed tags again from the newest open's disk (a change acknowledged late
        // narrows them).
        self.now = self.base.iter().map(|&tag| vec![tag]).collect();
        for change in &self.history {
            apply(&mut self.now, change);
        }
        Ok(())
    }

    fn settle_flush(
        &mut self,
        at: usize,
        covers: usize,
        started: Instant,
        (outcome, returned_ns): Outcome,
    ) -> Result<(), Violation> {
        match outcome {
            Ok(()) => {
                let when = self.when(started, returned_ns);
                self.acknowledged(at, "a FLUSH", when)?;
                self.note(format!(
                    "server {at}: FLUSH acknowledged ({covers} changes)"
                ));
                // Positions count from the seed's first change; a FLUSH that covers only
                // changes from before the newest open adds nothing to check.
                let covered = covers.saturating_sub(self.history_start);
                self.flushed = self.flushed.max(covered.min(self.history.len()));
            }
            Err(error) => {
                if matches!(error, StoreError::Lease { .. }) {
                    self.outcome.refused_by_lease += 1;
                }
                self.note(format!("server {at}: FLUSH failed: {error}"));
            }
        }
        Ok(())
    }

    /// Settles the answer of a step that was frozen with its server.
    fn settle_pending(
        &mut self,
        at: usize,
        kind: PendingKind,
        answer: Answer,
    ) -> Result<(), Violation> {
        match (kind, answer) {
            (PendingKind::Writes(positions, started), Answer::Writes(outcomes)) => {
                self.settle_writes(at, &positions, started, outcomes)
            }
            (PendingKind::Writes(positions, started), Answer::Done(outcome)) => {
                self.settle_writes(at, &positions, started, vec![outcome])
            }
            (PendingKind::Writes(positions, started), Answer::Collected(_, outcomes)) => {
                self.settle_writes(at, &positions, started, outcomes)
            }
            (PendingKind::Flush(covers, started), Answer::Done(outcome)) => {
                self.settle_flush(at, covers, started, outcome)
            }
            (_, answer) => self.settle_other(at, answer),
        }
    }

    /// A lock or open step's answer arriving now (possibly after a pause).
    fn settle_other(&mut self, at: usize, answer: Answer) -> Result<(), Violation> {
        match answer {
            Answer::Acquire(acquired, watch) => self.settle_acquire(at, acquired, watch),
            Answer::Renew(renewed) => {
                self.settle_renew(at, renewed);
                Ok(())
            }
            Answer::Opened(opened) => self.settle_open(at, opened),
            _ => Ok(()),
        }
    }

    fn settle_acquire(
        &mut self,
        at: usize,
        acquired: Acquired,
        watch: LapseWatch,
    ) -> Result<(), Violation> {
        let now = self.instant();
        let Role::Standby {
            watch: slot,
            uncertain,
        } = &mut self.servers[at].role
        else {
            return Ok(());
        };
        let (sent_ns, e_tag, taken) = match acquired {
            Acquired::Held { sent_ns, e_tag } => (sent_ns, e_tag, now),
            // A lost answer: an earlier PUT was carried out. Its tenure started no earlier
            // than the first unanswered PUT; its lease counts as lapsed until the first
            // renewal (its send time is not known).
            Acquired::Found { e_tag } => (0, e_tag, uncertain.unwrap_or(now)),
            Acquired::Waiting {
                why,
                uncertain: unanswered,
            } => {
                *slot = Some(watch);
                if unanswered && uncertain.is_none() {
                    *uncertain = Some(now);
                }
                self.note(format!("server {at} stands by: {why}"));
                return Ok(());
            }
        };
        let server = &self.servers[at];
        let lease = Arc::new(Lease::new(server.clock.clone(), LEASE_NS, sent_ns));
        let instance = server.instance;
        if !self.tenures.is_empty() {
            self.outcome.takeovers += 1;
        }
        self.tenures.push(Tenure {
            server: at,
            instance,
            taken,
            last_acknowledged: None,
        });
        let tenure = self.tenures.len() - 1;
        self.note(format!(
            "server {at} (instance {instance}) takes the disk (tenure {tenure})"
        ));
        let renew_at_ns = sent_ns + renewal_interval_ns(LEASE_NS);
        self.servers[at].role = Role::Writer(Writer {
            lease,
            e_tag,
            renewal: 0,
            renew_at_ns,
            store: None,
            tenure,
        });
        Ok(())
    }

    fn settle_renew(&mut self, at: usize, renewed: Renewal) {
        let now_ns = self.servers[at].clock.now_ns();
        let Role::Writer(writer) = &mut self.servers[at].role else {
            return;
        };
        let interval = renewal_interval_ns(LEASE_NS);
        let mut text = String::new();
        match renewed {
            Renewal::Renewed { sent_ns, e_tag } => {
                writer.lease.renewed(sent_ns);
                writer.e_tag = e_tag;
                writer.renewal += 1;
                writer.renew_at_ns = now_ns + interval;
            }
            Renewal::Learnt { e_tag, renewal } => {
                writer.e_tag = e_tag;
                writer.renewal = renewal;
                writer.renew_at_ns = now_ns;
            }
            Renewal::Stale => {
                writer.e_tag = None;
                writer.renew_at_ns = now_ns;
            }
            Renewal::TakenOver(by) => {
                text = format!("server {at} learns the disk was taken over by {by}");
                writer.lease.taken_over(by);
            }
            Renewal::Failed(why) => {
                text = format!("server {at}: renewal failed: {why}");
                writer.renew_at_ns = now_ns + interval / 4;
            }
        }
        if !text.is_empty() {
            self.note(text);
        }
    }

    /// A writer's open answered now: a new writer's disk must hold what was flushed.
    fn settle_open(
        &mut self,
        at: usize,
        opened: Result<LogStore, crate::OpenError>,
    ) -> Result<(), Violation> {
        let store = match opened {
            Ok(store) => Arc::new(store),
            Err(error) => {
                self.note(format!("server {at}: open failed: {error}"));
                return Ok(());
            }
        };
        let newest = self.newest_tenure();
        let Role::Writer(writer) = &mut self.servers[at].role else {
            return Ok(());
        };
        if Some(writer.tenure) != newest || writer.lease.check().is_err() {
            // Opened too late to serve: a deposed writer's open writes nothing more.
            self.note(format!("server {at}: opened after its lease ended; unused"));
            return Ok(());
        }
        writer.store = Some(store.clone());
        self.note(format!("server {at} opened the disk"));
        self.verify_open(&store)
    }

    /// Reads the whole disk without faults and finds the prefix of history it equals.
    fn verify_open(&mut self, store: &LogStore) -> Result<(), Violation> {
        self.world.set_calm(true);
        let image = self.read_all(store);
        self.world.set_calm(false);
        let image = image?;
        self.outcome.opens_checked += 1;
        match find_prefix(&self.base, &self.history, self.flushed, &image) {
            Some(length) => {
                self.note({
                    format!(
                        "the disk is the first {length} of {} changes since the last open ({} flushed)",
                        self.history.len(),
                        self.flushed
                    )
                });
                self.base = image;
                self.now = self.base.iter().map(|&tag| vec![tag]).collect();
                self.history_start += self.history.len();
                self.history.clear();
                self.flushed = 0;
                Ok(())
            }
            None => {
                let mut state: Allowed = self.base.iter().map(|&tag| vec![tag]).collect();
                for change in &self.history[..self.flushed] {
                    apply(&mut state, change);
                }
                let block = (0..image.len()).find(|&b| !state[b].contains(&image[b]));
                Err(self.violation(
                    property::NOTHING_FLUSHED_LOST,
                    format!(
                        "the disk a new writer opened is no prefix of the {} changes acknowledged since the last open that includes the {} a FLUSH acknowledged{}",
                        self.history.len(),
                        self.flushed,
                        block.map_or(String::new(), |block| format!(
                            ": block {block} reads {} but the flushed changes leave {}",
                            describe_tag(image[block]),
                            describe_tags(&state[block])
                        ))
                    ),
                ))
            }
        }
    }

    fn read_all(&self, store: &LogStore) -> Result<Vec<u64>, Violation> {
        let mut buffer = vec![0u8; (self.blocks * BLOCK_BYTES) as usize];
        store.read(&mut buffer, 0).map_err(|error| {
            self.violation(
                property::READS,
                format!("reading the opened disk (no faults): {error}"),
            )
        })?;
        buffer
            .chunks(BLOCK_BYTES as usize)
            .enumerate()
            .map(|(block, bytes)| {
                tag_of(bytes, self.compressible).map_err(|reason| {
                    self.violation(
                        property::NOTHING_FLUSHED_LOST,
                        format!("after an open, block {block} {reason}"),
                    )
                })
            })
            .collect()
    }

    fn check_read(&self, offset: u64, data: &[u8]) -> Result<(), Violation> {
        let reader = " from the newest writer";
        match misread(&self.now, offset, data, self.compressible, reader) {
            Some(detail) => Err(self.violation(property::READS, detail)),
            None => Ok(()),
        }
    }

    /// Every durable segment the newest writer's index names exists.
    fn check_named_segments_exist(&self) -> Result<(), Violation> {
        let Some(store) = self.newest_store() else {
            return Ok(());
        };
        let named = store.durable_named_segment_keys();
        let present: std::collections::BTreeSet<String> = self
            .world
            .objects()
            .into_iter()
            .map(|(key, _)| key)
            .collect();
        match named.into_iter().find(|key| !present.contains(key)) {
            Some(key) => Err(self.violation(
                property::SEGMENTS_EXIST,
                format!(
                    "segment `{key}` named by the newest writer's index does not exist (deleted while it named it)"
                ),
            )),
            None => Ok(()),
        }
    }

    /// The newest tenure's open store, if its server has one.
    fn newest_store(&self) -> Option<Arc<LogStore>> {
        let tenure = &self.tenures[self.newest_tenure()?];
        match &self.servers[tenure.server].role {
            Role::Writer(writer) if writer.tenure + 1 == self.tenures.len() => writer.store.clone(),
            _ => None,
        }
    }

    /// Server `at`'s own business this tick: restart, heal, resume, the lock.
    fn server_tick(&mut self, at: usize) -> Result<(), Violation> {
        let time = self.time();
        if let Role::Down(until) = self.servers[at].role {
            if time < until {
                return Ok(());
            }
            self.next_instance += 1;
            let instance = self.next_instance;
            self.note(format!(
                "server {at} restarts as a standby (instance {instance})"
            ));
            let server = &mut self.servers[at];
            if server.partitioned_until.take().is_some() {
                self.world.set_partitioned(server.instance, false);
            }
            server.instance = instance;
            server.role = Role::Standby {
                watch: None,
                uncertain: None,
            };
        }
        if let Some(until) = self.servers[at].partitioned_until {
            if time >= until {
                self.servers[at].partitioned_until = None;
                self.world.set_partitioned(self.servers[at].instance, false);
            }
        }
        if let Some(until) = self.servers[at].paused_until {
            if time < until {
                return Ok(());
            }
            self.servers[at].paused_until = None;
            let instance = self.servers[at].instance;
            let landed = self.world.resume(instance);
            self.note(format!("server {at} resumes ({landed} requests land now)"));
            if let Some(Pending { receiver, kind }) = self.servers[at].pending.take() {
                let waited =
                    wait(receiver, &self.world, instance).map_err(|stall| self.stalled(stall))?;
                match waited {
                    Waited::Answer(answer) => self.settle_pending(at, kind, answer)?,
                    Waited::Stuck(receiver) => {
                        // Stuck again on a new hung request: frozen once more.
                        let until = time + self.rng.gen_range(LEASE_NS / 4..=LEASE_NS);
                        self.servers[at].paused_until = Some(until);
                        self.servers[at].pending = Some(Pending { receiver, kind });
                        return Ok(());
                    }
                }
                self.flush_world_log();
            }
            // A resumed process's client requests race its overdue renewal.
            if self.rng.gen_bool(0.5) {
                self.client_step(at)?;
            }
        }
        let store = self.world.store(self.servers[at].instance);
        let path = self.lock_path.clone();
        let instance = self.servers[at].instance;
        let clock = self.servers[at].clock.clone();
        let step: Box<dyn FnOnce() -> Answer + Send> = match &mut self.servers[at].role {
            Role::Down(_) => return Ok(()),
            Role::Standby { watch, .. } => {
                let watch = watch.take().unwrap_or_else(|| LapseWatch::new(LEASE_NS));
                Box::new(move || {
                    let (acquired, watch) =
                        block_on(acquire(&*store, &path, instance, &*clock, watch));
                    Answer::Acquire(acquired, watch)
                })
            }
            Role::Writer(writer) => {
                if let Err(crate::lease::LeaseError::TakenOver { .. }) = writer.lease.check() {
                    // A deposed server's process ends (and restarts as a standby).
                    if self.rng.gen_bool(0.3) {
                        self.note(format!("server {at} exits: its disk was taken over"));
                        self.stop(at, time);
                    }
                    return Ok(());
                }
                if writer.store.is_none() {
                    if writer.lease.check().is_err() {
                        return Ok(());
                    }
                    let lease = writer.lease.clone();
                    let (url, config) = (self.url.clone(), self.config);
                    Box::new(move || {
                        Answer::Opened(LogStore::open_leased_on(&url, store, config, lease))
                    })
                } else if clock.now_ns() < writer.renew_at_ns {
                    return Ok(());
                } else {
                    let (renewal, e_tag) = (writer.renewal, writer.e_tag.clone());
                    Box::new(move || {
                        Answer::Renew(block_on(renew(
                            &*store, &path, instance, renewal, e_tag, &*clock,
                        )))
                    })
                }
            }
        };
        match self.run_boxed(at, PendingKind::Other, step)? {
            Some(answer) => self.settle_other(at, answer),
            None => Ok(()),
        }
    }

    /// A client request to server `at` (a writer; a deposed one's must all be refused).
    fn client_step(&mut self, at: usize) -> Result<(), Violation> {
        let Role::Writer(writer) = &self.servers[at].role else {
            return Ok(());
        };
        let Some(store) = writer.store.clone() else {
            return Ok(());
        };
        if self.servers[at].paused_until.is_some() {
            return Ok(());
        }
        self.outcome.steps += 1;
        let choice = self.rng.gen_range(0..100);
        let newest = self
            .newest_store()
            .is_some_and(|newest| Arc::ptr_eq(&newest, &store));
        let started = self.instant();
        let time_ns = self.time_ns.clone();
        // A request is acknowledged at its last lease check: the thread may be preempted
        // between that check and returning, and the harness may freeze the server (and move
        // time) meanwhile, as a SIGSTOP between the check and the reply would.
        let returned = move |outcome: Result<(), StoreError>| -> Outcome {
            let checked_ns = TIME_LAST_READ_NS.with(|last| last.get());
            debug_assert!(checked_ns <= time_ns.load(Ordering::Acquire));
            (outcome, checked_ns)
        };
        if choice < 50 {
            let count = if self.rng.gen_bool(0.2) { 3 } else { 1 };
            let (writes, changes) = self.random_writes(count);
            let positions = self.push_unacknowledged(changes);
            let kind = PendingKind::Writes(positions.clone(), started);
            let Some(answer) = self.run(at, kind, move || {
                Answer::Writes(
                    writes
                        .iter()
                        .map(|(offset, data)| returned(store.write(data, *offset)))
                        .collect(),
                )
            })?
            else {
                return Ok(());
            };
            let Answer::Writes(outcomes) = answer else {
                unreachable!("writes answer Writes")
            };
            self.settle_writes(at, &positions, started, outcomes)
        } else if choice < 60 {
            let blocks = self.random_blocks();
            let change = Change {
                blocks: blocks.clone(),
                write: None,
                acknowledged: false,
            };
            let positions = self.push_unacknowledged(vec![change]);
            let kind = PendingKind::Writes(positions.clone(), started);
            let Some(answer) = self.run(at, kind, move || {
                Answer::Done(returned(store.write_zeroes(
                    blocks.start * BLOCK_BYTES,
                    (blocks.end - blocks.start) * BLOCK_BYTES,
                )))
            })?
            else {
                return Ok(());
            };
            let Answer::Done(outcome) = answer else {
                unreachable!("zeroes answer Done")
            };
            self.settle_writes(at, &positions, started, vec![outcome])
        } else if choice < 75 {
            let blocks = self.random_blocks();
            let Some(answer) = self.run(at, PendingKind::Other, move || {
                let mut buffer = vec![0u8; ((blocks.end - blocks.start) * BLOCK_BYTES) as usize];
                Answer::Read(
                    store
                        .read(&mut buffer, blocks.start * BLOCK_BYTES)
                        .map(|()| buffer),
                )
            })?
            else {
                return Ok(());
            };
            let Answer::Read(outcome) = answer else {
                unreachable!("a read answers Read")
            };
            // Only the newest writer's reads promise the latest data; a deposed writer
            // serves what it last knew.
            match outcome {
                Ok(data) if newest => self.check_read(blocks.start * BLOCK_BYTES, &data),
                _ => Ok(()),
            }
        } else if choice < 92 {
            let covers = self.history_start + self.history.len();
            let kind = PendingKind::Flush(covers, started);
            let Some(answer) = self.run(at, kind, move || Answer::Done(returned(store.flush())))?
            else {
                return Ok(());
            };
            let Answer::Done(outcome) = answer else {
                unreachable!("a flush answers Done")
            };
            self.settle_flush(at, covers, started, outcome)
        } else {
            let threshold = self.rng.gen_range(0.2..0.9);
            // Drawn as an i32, as every seed so far drew it: the width decides how much of the
            // stream the draw takes, and so every later draw of the seed.
            let count: i32 = self.rng.gen_range(0..3);
            let count = usize::try_from(count).expect("0 to 2 writes");
            let (writes, changes) = self.random_writes(count);
            let positions = self.push_unacknowledged(changes);
            let kind = PendingKind::Writes(positions.clone(), started);
            let Some(answer) = self.run(at, kind, move || {
                let mut outcomes = Vec::new();
                let mut between = || {
                    outcomes = writes
                        .iter()
                        .map(|(offset, data)| returned(store.write(data, *offset)))
                        .collect();
                };
                let report = store.collect_garbage_calling(threshold, &mut between);
                Answer::Collected(report, outcomes)
            })?
            else {
                return Ok(());
            };
            let Answer::Collected(report, outcomes) = answer else {
                unreachable!("a round answers Collected")
            };
            self.note(format!("server {at}: collection round: {report:?}"));
            // A round that failed before its reads wrote nothing in between.
            let made = outcomes.len();
            self.settle_writes(at, &positions[..made], started, outcomes)
        }
    }

    /// One fault the harness injects, or a client step.
    fn event(&mut self) -> Result<(), Violation> {
        let choice = self.rng.gen_range(0..100);
        let at = self.rng.gen_range(0..self.servers.len());
        let live = !matches!(self.servers[at].role, Role::Down(_))
            && self.servers[at].paused_until.is_none();
        if choice < 3 && live {
            let until = self.time() + self.rng.gen_range(LEASE_NS / 4..=3 * LEASE_NS);
            self.note(format!(
                "server {at} frozen until t={}ms",
                until / 1_000_000
            ));
            self.outcome.pauses += 1;
            self.servers[at].paused_until = Some(until);
        } else if choice < 6 && live && self.servers[at].partitioned_until.is_none() {
            let until = self.time() + self.rng.gen_range(LEASE_NS / 4..=3 * LEASE_NS);
            self.note(format!(
                "server {at} cut off until t={}ms",
                until / 1_000_000
            ));
            self.outcome.partitions += 1;
            self.servers[at].partitioned_until = Some(until);
            self.world.set_partitioned(self.servers[at].instance, true);
        } else if choice < 8 && live {
            self.note(format!("server {at} crashes"));
            self.crash(at);
        } else {
            // Clients talk to whichever server believes it holds the disk: usually the
            // newest writer, sometimes a deposed one.
            let writers: Vec<usize> = (0..self.servers.len())
                .filter(
                    |&at| matches!(&self.servers[at].role, Role::Writer(w) if w.store.is_some()),
                )
                .collect();
            if let Some(&at) = writers.get(self.rng.gen_range(0..writers.len().max(1))) {
                self.client_step(at)?;
                self.check_named_segments_exist()?;
            }
        }
        Ok(())
    }

    /// Every process stops; a last server opens the disk (no lease: nobody else is left)
    /// and must find what was flushed.
    fn finish(&mut self) -> Result<(), Violation> {
        for at in 0..self.servers.len() {
            if !matches!(self.servers[at].role, Role::Down(_)) {
                self.stop(at, u64::MAX);
            }
        }
        self.world.land_due(u64::MAX);
        self.flush_world_log();
        self.next_instance += 1;
        self.world.set_calm(true);
        let opened = LogStore::open_unlocked_on(
            &self.url,
            self.world.store(self.next_instance),
            self.config,
        );
        self.world.set_calm(false);
        let store = opened.map_err(|error| {
            self.violation(property::PROGRESS, format!("the last open fails: {error}"))
        })?;
        self.note("the last server opens the disk".to_string());
        let checked = self.verify_open(&store);
        self.world.crash(self.next_instance);
        checked
    }
}

/// Checks one seed with `servers` servers (2 or 3; None: the seed picks) (module docs);
/// `trace` prints every step to standard error.
pub fn check_servers_seed(seed: u64, servers: Option<u32>, trace: bool) -> ServersCheckOutcome {
    let _quiet = (!trace)
        .then(|| tracing::subscriber::set_default(tracing::subscriber::NoSubscriber::default()));
    let (mut harness, ticks) = Harness::draw(seed, servers, trace);
    let result = harness.run_ticks(ticks);
    let world = harness.world.clone();
    let counts = world.counts();
    harness.outcome.faults =
        counts.failed + counts.lost + counts.hung + counts.reset + counts.applied_then_failed;
    harness.outcome.late_landings = counts.landed_at_crash + counts.landed_late;
    harness.outcome.violation = result.err();
    for at in 0..harness.servers.len() {
        let instance = harness.servers[at].instance;
        world.crash(instance);
        if let Some(pending) = harness.servers[at].pending.take() {
            let _ = pending.receiver.recv_timeout(NEVER_RETURNS);
        }
    }
    harness.servers.clear();
    harness.outcome
}

/// The servers of a seed, `count` of them, on clocks over the global virtual time
/// `time_ns` with seeded rate errors and offsets.
fn draw_servers(rng: &mut StdRng, count: u32, time_ns: &Arc<AtomicU64>) -> Vec<Server> {
    // Rate errors within the bound; a quarter of the seeds put its extremes on the servers.
    let bound_ppm = (CLOCK_RATE_ERROR_MAX * 1_000_000.0) as i64;
    let extremes = rng.gen_bool(0.25);
    (0..count as usize)
        .map(|number| {
            let rate_error_ppm = if extremes {
                if rng.gen_bool(0.5) {
                    bound_ppm
                } else {
                    -bound_ppm
                }
            } else {
                rng.gen_range(-bound_ppm..=bound_ppm)
            };
            Server {
                number,
                clock: Arc::new(SkewedClock {
                    time_ns: time_ns.clone(),
                    offset_ns: rng.gen_range(0..1_000_000_000_000),
                    rate_error_ppm,
                }),
                instance: number as u64 + 1,
                role: Role::Standby {
                    watch: None,
                    uncertain: None,
                },
                paused_until: None,
                pending: None,
                partitioned_until: None,
            }
        })
        .collect()
}

impl Harness {
    /// The harness of seed `seed` with `servers` servers (None: the seed picks), and the
    /// ticks it runs.
    fn draw(seed: u64, servers: Option<u32>, trace: bool) -> (Harness, u64) {
        // Another stream than the single-server check's for the same seed.
        let mut rng = StdRng::seed_from_u64(crate::sim_store::mix(seed ^ 0x5e7e_5e7e));
        let count = servers.unwrap_or_else(|| rng.gen_range(2..=SERVERS_MAX));
        assert!((2..=SERVERS_MAX).contains(&count), "2 or 3 servers");
        let fault_maxima = FaultRates {
            fail_ppm: 30_000,
            lost_ppm: 15_000,
            hang_ppm: 20_000,
            reset_ppm: 40_000,
            applied_then_fail_ppm: 40_000,
        };
        let (world, faults, _) = draw_world(&mut rng, seed, 3, fault_maxima, 1..40);
        let DrawnDisk {
            blocks,
            compress,
            encrypt,
            url,
        } = draw_disk(&mut rng, &format!("servers{seed}"), 16..=64, 0.3);
        let lock_path = ObjectPath::from(url.key(crate::LOCK_NAME).as_str());
        let config = draw_config(&mut rng, &[8 << 10, 16 << 10, 32 << 10]);
        let time_ns = Arc::new(AtomicU64::new(0));
        let servers = draw_servers(&mut rng, count, &time_ns);
        // Drawn as an i32, as every seed so far drew it: the width decides how much of the
        // stream the draw takes, and so every later draw of the seed.
        let ticks: i32 = rng.gen_range(150..300);
        let ticks = u64::try_from(ticks).expect("a positive number of ticks");
        let mut harness = Harness {
            seed,
            notes: Notes::new(RECENT_STEPS, trace),
            compressible: rng.gen_bool(0.5),
            pause_when_stuck: rng.gen_range(0.3..0.9),
            rng,
            world: world.clone(),
            url,
            lock_path,
            config,
            blocks,
            time_ns,
            order: 0,
            tick: 0,
            next_instance: u64::from(count),
            servers,
            tenures: Vec::new(),
            base: vec![0; blocks as usize],
            history: Vec::new(),
            history_start: 0,
            flushed: 0,
            now: vec![vec![0]; blocks as usize],
            next_write: 0,
            outcome: ServersCheckOutcome {
                servers: count,
                clock_rate_error_ppm_max: 0,
                ..Default::default()
            },
        };
        harness.outcome.clock_rate_error_ppm_max = harness
            .servers
            .iter()
            .map(|server| server.clock.rate_error_ppm.unsigned_abs())
            .max()
            .unwrap_or(0);
        harness.note({
            format!(
                "{count} servers (clock rate errors {:?} ppm), {} blocks, {config:?}, compress {compress}, encrypt {encrypt}, faults {faults:?}, {ticks} ticks",
                harness
                    .servers
                    .iter()
                    .map(|server| server.clock.rate_error_ppm)
                    .collect::<Vec<_>>(),
                harness.blocks
            )
        });
        (harness, ticks)
    }

    /// Creates the disk, runs `ticks` ticks of the servers and their clients, and the last
    /// open.
    fn run_ticks(&mut self, ticks: u64) -> Result<(), Violation> {
        // The disk exists before its servers start (as `bufcache disk create` leaves it).
        self.world.set_calm(true);
        let failed = match LogStore::open_unlocked_on(&self.url, self.world.store(0), self.config) {
            Ok(mut store) => store.close().err().map(|error| error.to_string()),
            Err(error) => Some(error.to_string()),
        };
        self.world.set_calm(false);
        self.world.crash(0);
        if let Some(error) = failed {
            return Err(self.violation(property::PROGRESS, format!("creating the disk: {error}")));
        }
        for _ in 0..ticks {
            self.tick += 1;
            self.outcome.ticks += 1;
            let step = self.rng.gen_range(LEASE_NS / 50..=LEASE_NS / 8);
            self.time_ns.fetch_add(step, Ordering::AcqRel);
            self.world.land_due(self.tick);
            self.flush_world_log();
            for at in 0..self.servers.len() {
                debug_assert_eq!(self.servers[at].number, at);
                self.server_tick(at)?;
            }
            for _ in 0..self.rng.gen_range(1..=3) {
                self.event()?;
            }
        }
        self.finish()
    }
}

/// The totals of a sweep of seeds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServersCheckTotals {
    /// Seeds run with two servers and with three.
    pub seeds_two: u64,
    pub seeds_three: u64,
    pub steps: u64,
    pub takeovers: u64,
    pub opens_checked: u64,
    pub pauses: u64,
    pub pauses_in_step: u64,
    pub partitions: u64,
    pub crashes: u64,
    pub refused_by_lease: u64,
    pub acknowledged: u64,
    pub faults: u64,
    pub late_landings: u64,
    pub clock_rate_error_ppm_max: u64,
}

impl bufcache_check::Totals<ServersCheckOutcome> for ServersCheckTotals {
    fn add(&mut self, outcome: &ServersCheckOutcome) {
        match outcome.servers {
            2 => self.seeds_two += 1,
            _ => self.seeds_three += 1,
        }
        self.steps += outcome.steps;
        self.takeovers += outcome.takeovers;
        self.opens_checked += outcome.opens_checked;
        self.pauses += outcome.pauses;
        self.pauses_in_step += outcome.pauses_in_step;
        self.partitions += outcome.partitions;
        self.crashes += outcome.crashes;
        self.refused_by_lease += outcome.refused_by_lease;
        self.acknowledged += outcome.acknowledged;
        self.faults += outcome.faults;
        self.late_landings += outcome.late_landings;
        self.clock_rate_error_ppm_max = self
            .clock_rate_error_ppm_max
            .max(outcome.clock_rate_error_ppm_max);
    }
}

/// What checking a range of seeds found.
pub type ServersCheckSummary = bufcache_check::Sweep<ServersCheckTotals>;

/// Checks seeds `first..first + count` with `servers` servers each (None: each seed picks
/// two or three), calling `each` after every seed.
pub fn check_servers_seeds(
    first: u64,
    count: u64,
    servers: Option<u32>,
    trace: bool,
    each: impl FnMut(u64, &ServersCheckOutcome),
) -> ServersCheckSummary {
    bufcache_check::check_seeds(
        first,
        count,
        |seed| check_servers_seed(seed, servers, trace),
        each,
    )
}
