//! A simulated object store for `bufcache sim check --layout log`: an in-memory bucket
//! ([`object_store::memory::InMemory`]) behind an [`ObjectStore`] that, driven by a seed,
//! makes requests fail, hang, get lost, or land after the server that sent them crashed.
//!
//! One [`SimWorld`] is the bucket; each server instance talks to it through its own
//! [`SimStore`] (an instance number). Every request's fate is a pure function of the seed,
//! the instance, the method, the object name and how many times this instance sent that
//! method for that name, so a seed replays the same fates whatever the threads' timing:
//! - `Apply`: carried out, answered with success;
//! - `Fail`: not carried out, answered with an error (a 500 after the client's retries);
//! - `Lost`: carried out, but the answer is lost, so the client sees an error;
//! - `Hang` (PUT and DELETE only): parked, neither carried out nor answered, until the
//!   harness crashes the instance ([`SimWorld::crash`]);
//! - `Reset` (DELETE and checkpoint PUT only, at their own rates, [`FaultRates::reset_ppm`]):
//!   the connection is reset before the answer; the request was not carried out, and, as
//!   the seed says, never is or lands later ([`SimWorld::land_due`]) while its sender may
//!   still be running, or be gone after a failed open (a proxy that forwarded it first);
//! - `AppliedThenFail` (DELETE and checkpoint PUT only, [`FaultRates::applied_then_fail_ppm`]):
//!   carried out, answered with an error.
//!
//! At a crash the instance is dead: whatever it sends afterwards is refused and never
//! reaches the bucket (a dead server sends nothing), and each of its parked requests is, as
//! the seed says, dropped (never carried out), carried out at once, or kept to be carried out
//! later ([`SimWorld::land_due`]), possibly after the next instance opened the disk and wrote:
//! the late PUT or DELETE of a dead server. Conditional PUTs (create-only, `If-Match`) are
//! decided when they are carried out, as a real store does.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use async_trait::async_trait;
use bytes::Bytes;
use futures::channel::oneshot;
use futures::stream::{self, BoxStream, StreamExt};
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{
    GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult,
};

/// How likely each fate is, in parts per million of requests (the rest are `Apply`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultRates {
    /// Requests answered with an error and not carried out.
    pub fail_ppm: u32,
    /// Requests carried out whose answer is lost (the client sees an error).
    pub lost_ppm: u32,
    /// PUTs and DELETEs that hang until the instance crashes.
    pub hang_ppm: u32,
    /// DELETEs and checkpoint PUTs whose connection is reset before they are carried out
    /// (some land later), on top of the rates above: rare requests whose failure decides
    /// what the collector may delete.
    pub reset_ppm: u32,
    /// DELETEs and checkpoint PUTs carried out and answered with an error, on top of the
    /// rates above.
    pub applied_then_fail_ppm: u32,
}

/// What becomes of a crashed instance's parked requests, in parts per million (the rest
/// are dropped: never carried out).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LateRates {
    /// Carried out at the crash, before the disk is opened again.
    pub at_crash_ppm: u32,
    /// Carried out later, once the harness has taken up to `later_steps_max` more steps.
    pub later_ppm: u32,
    pub later_steps_max: u64,
}

/// A request's fate (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fate {
    Apply,
    Fail,
    Lost,
    Hang,
    Reset,
    AppliedThenFail,
}

/// A change to the bucket, kept while its request is parked or waits to land late.
#[derive(Clone, Debug)]
enum Change {
    Put {
        path: Path,
        body: Bytes,
        options: PutOptions,
    },
    Delete {
        path: Path,
    },
}

impl Change {
    fn describe(&self) -> String {
        match self {
            Change::Put { path, body, .. } => format!("PUT {path} ({} bytes)", body.len()),
            Change::Delete { path } => format!("DELETE {path}"),
        }
    }
}

/// The answer a parked request gets: the store's own when it is carried out as its sender
/// resumes ([`SimWorld::resume`]), an error at a crash.
type ParkedAnswer = Result<Option<PutResult>, ParkedFailure>;

/// Why a parked request failed.
#[derive(Debug, thiserror::Error)]
enum ParkedFailure {
    /// Carried out as its sender resumed, and refused by the store.
    #[error("{0}")]
    Refused(object_store::Error),
    /// Its sender crashed first.
    #[error("no answer, the server crashed (instance {instance})")]
    Crashed { instance: u64 },
}

struct Parked {
    instance: u64,
    change: Change,
    answer: oneshot::Sender<ParkedAnswer>,
}

/// Counts of what the world did, for the check's summary.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorldCounts {
    pub requests: u64,
    pub failed: u64,
    pub lost: u64,
    pub hung: u64,
    /// Parked requests of crashed instances carried out at the crash.
    pub landed_at_crash: u64,
    /// Parked requests of crashed instances carried out later.
    pub landed_late: u64,
    /// Parked requests of crashed instances never carried out.
    pub dropped: u64,
    /// Requests a crashed instance sent after its crash (refused).
    pub refused_dead: u64,
    /// DELETEs and checkpoint PUTs reset before they were carried out.
    pub reset: u64,
    /// DELETEs and checkpoint PUTs carried out and answered with an error.
    pub applied_then_failed: u64,
}

struct WorldState {
    /// Instances that crashed: their requests are refused.
    dead: std::collections::BTreeSet<u64>,
    /// Instances cut off from the store (a network partition): their requests fail at once
    /// without reaching it.
    partitioned: std::collections::BTreeSet<u64>,
    /// Requests sent so far, by (instance, method, name), for the fate's input.
    sent: HashMap<(u64, &'static str, String), u64>,
    parked: Vec<Parked>,
    /// Changes of crashed instances waiting to land, with the step they land at.
    late: Vec<(u64, Change)>,
    /// Faults are off while calm (the harness's own verification reads).
    calm: bool,
    /// The harness's step counter (late changes land by it).
    step: u64,
    counts: WorldCounts,
    /// What happened, for `--trace`.
    log: Vec<String>,
}

/// The simulated bucket shared by every instance of one seed.
pub struct SimWorld {
    seed: u64,
    faults: FaultRates,
    late: LateRates,
    bucket: InMemory,
    state: Mutex<WorldState>,
}

impl fmt::Debug for SimWorld {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "SimWorld(seed {})", self.seed)
    }
}

/// splitmix64's finaliser: a well-mixed 64-bit function of its input.
pub(crate) fn mix(mut value: u64) -> u64 {
    value = value.wrapping_add(0x9e37_79b9_7f4a_7c15);
    value = (value ^ (value >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    value = (value ^ (value >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    value ^ (value >> 31)
}

fn mix_text(mut hash: u64, text: &str) -> u64 {
    for byte in text.bytes() {
        hash = mix(hash ^ u64::from(byte));
    }
    hash
}

fn simulated(message: String) -> object_store::Error {
    object_store::Error::Generic {
        store: "sim",
        source: message.into(),
    }
}

fn not_simulated(operation: String) -> object_store::Error {
    simulated(format!(
        "{operation}: not simulated (the log layout never asks for it)"
    ))
}

impl SimWorld {
    pub fn new(seed: u64, faults: FaultRates, late: LateRates) -> Arc<SimWorld> {
        Arc::new(SimWorld {
            seed,
            faults,
            late,
            bucket: InMemory::new(),
            state: Mutex::new(WorldState {
                dead: Default::default(),
                partitioned: Default::default(),
                sent: HashMap::new(),
                parked: Vec::new(),
                late: Vec::new(),
                calm: false,
                step: 0,
                counts: WorldCounts::default(),
                log: Vec::new(),
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, WorldState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The store instance `instance` (a server's connection) sees.
    pub fn store(self: &Arc<Self>, instance: u64) -> Arc<dyn ObjectStore> {
        Arc::new(SimStore {
            world: self.clone(),
            instance,
        })
    }

    /// Turns faults off (true) or on again: the harness's own checks are not under test.
    pub fn set_calm(&self, calm: bool) {
        self.lock().calm = calm;
    }

    pub fn counts(&self) -> WorldCounts {
        self.lock().counts
    }

    /// Takes what happened since the last call (one line per event).
    pub fn take_log(&self) -> Vec<String> {
        std::mem::take(&mut self.lock().log)
    }

    /// Requests parked (hung) now, of live instances.
    pub fn parked(&self) -> usize {
        self.lock().parked.len()
    }

    /// A number in 0..1_000_000 from the seed and `parts`.
    fn draw(&self, parts: &[u64], name: &str) -> u32 {
        let mut hash = mix(self.seed);
        for &part in parts {
            hash = mix(hash ^ part);
        }
        (mix_text(hash, name) % 1_000_000) as u32
    }

    fn fate(
        &self,
        state: &mut WorldState,
        instance: u64,
        method: &'static str,
        name: &str,
    ) -> Fate {
        state.counts.requests += 1;
        let count = state
            .sent
            .entry((instance, method, name.to_string()))
            .or_insert(0);
        *count += 1;
        if state.calm {
            return Fate::Apply;
        }
        let method_code = mix_text(0, method);
        let draw = self.draw(&[instance, method_code, *count], name);
        let FaultRates {
            fail_ppm,
            lost_ppm,
            hang_ppm,
            reset_ppm,
            applied_then_fail_ppm,
        } = self.faults;
        let mutates = method == "PUT" || method == "DELETE";
        let targeted =
            method == "DELETE" || (method == "PUT" && name.contains("/log/checkpoints/"));
        if targeted {
            let draw = self.draw(&[instance, method_code ^ 0x7e5e, *count], name);
            if draw < reset_ppm {
                return Fate::Reset;
            }
            if draw < reset_ppm + applied_then_fail_ppm {
                return Fate::AppliedThenFail;
            }
        }
        if draw < fail_ppm {
            Fate::Fail
        } else if mutates && draw < fail_ppm + lost_ppm {
            Fate::Lost
        } else if mutates && draw < fail_ppm + lost_ppm + hang_ppm {
            Fate::Hang
        } else {
            Fate::Apply
        }
    }

    /// Carries a change out on the bucket (a conditional PUT's condition decided now).
    fn carry_out(&self, change: &Change) -> object_store::Result<()> {
        self.carry_out_answered(change).map(drop)
    }

    /// [`SimWorld::carry_out`], with the store's answer (a PUT's ETag).
    fn carry_out_answered(&self, change: &Change) -> object_store::Result<Option<PutResult>> {
        futures::executor::block_on(async {
            match change {
                Change::Put {
                    path,
                    body,
                    options,
                } => self
                    .bucket
                    .put_opts(path, PutPayload::from(body.clone()), options.clone())
                    .await
                    .map(Some),
                Change::Delete { path } => self.bucket.delete(path).await.map(|()| None),
            }
        })
    }

    /// Cuts `instance` off from the store (true) or heals the cut: while cut, its requests
    /// fail at once and never reach the bucket.
    pub fn set_partitioned(&self, instance: u64, partitioned: bool) {
        let mut state = self.lock();
        if partitioned {
            state.partitioned.insert(instance);
        } else {
            state.partitioned.remove(&instance);
        }
        state.log.push(format!(
            "instance {instance}: {}",
            if partitioned {
                "cut off from the store"
            } else {
                "reaches the store again"
            }
        ));
    }

    /// Refuses a request of a cut-off instance (counted as failed).
    fn check_reachable(
        state: &mut WorldState,
        instance: u64,
        method: &str,
        name: &str,
    ) -> object_store::Result<()> {
        if state.partitioned.contains(&instance) {
            state.counts.failed += 1;
            return Err(simulated(format!(
                "{method} {name}: the store is unreachable (simulated partition of instance {instance})"
            )));
        }
        Ok(())
    }

    /// A paused process resumes (module `sim_servers`): each of `instance`'s parked requests
    /// is carried out now, late, its condition decided now, and answered with the store's
    /// answer. Returns how many there were.
    pub fn resume(&self, instance: u64) -> usize {
        let mut state = self.lock();
        let (theirs, others): (Vec<Parked>, Vec<Parked>) = std::mem::take(&mut state.parked)
            .into_iter()
            .partition(|parked| parked.instance == instance);
        state.parked = others;
        let count = theirs.len();
        for parked in theirs {
            let outcome = self.carry_out_answered(&parked.change);
            state.counts.landed_late += 1;
            state.log.push(format!(
                "instance {instance} resumes: its {} lands ({})",
                parked.change.describe(),
                match &outcome {
                    Ok(_) => "ok".to_string(),
                    Err(error) => format!("refused: {error}"),
                }
            ));
            let _ = parked.answer.send(outcome.map_err(ParkedFailure::Refused));
        }
        count
    }

    /// Requests of `instance` parked now.
    pub fn parked_of(&self, instance: u64) -> usize {
        self.lock()
            .parked
            .iter()
            .filter(|parked| parked.instance == instance)
            .count()
    }

    /// A PUT or DELETE of `instance`, after its fate.
    async fn mutate(
        &self,
        instance: u64,
        method: &'static str,
        change: Change,
    ) -> object_store::Result<Option<PutResult>> {
        let name = match &change {
            Change::Put { path, .. } | Change::Delete { path } => path.to_string(),
        };
        let receiver = {
            let mut state = self.lock();
            if state.dead.contains(&instance) {
                state.counts.refused_dead += 1;
                return Err(simulated(format!(
                    "{method} {name}: the server crashed (instance {instance})"
                )));
            }
            Self::check_reachable(&mut state, instance, method, &name)?;
            match self.fate(&mut state, instance, method, &name) {
                Fate::Fail => {
                    state.counts.failed += 1;
                    state.log.push(format!(
                        "instance {instance}: {} failed (500)",
                        change.describe()
                    ));
                    return Err(simulated(format!(
                        "{method} {name}: 500 Internal Error (simulated)"
                    )));
                }
                Fate::Lost => {
                    state.counts.lost += 1;
                    let outcome = self.carry_out(&change);
                    state.log.push(format!(
                        "instance {instance}: {} carried out ({}), answer lost",
                        change.describe(),
                        if outcome.is_ok() { "ok" } else { "refused" }
                    ));
                    return Err(simulated(format!(
                        "{method} {name}: connection reset before the answer (simulated)"
                    )));
                }
                Fate::AppliedThenFail => {
                    state.counts.applied_then_failed += 1;
                    let outcome = self.carry_out(&change);
                    state.log.push(format!(
                        "instance {instance}: {} carried out ({}), answered 500",
                        change.describe(),
                        if outcome.is_ok() { "ok" } else { "refused" }
                    ));
                    return Err(simulated(format!(
                        "{method} {name}: 500 Internal Error after it was carried out (simulated)"
                    )));
                }
                Fate::Reset => {
                    state.counts.reset += 1;
                    let count = state.counts.reset;
                    // Half the resets were forwarded first: they land a few steps later.
                    let draw = self.draw(&[instance, 0x4e5e7, count], &name);
                    if draw < 500_000 {
                        let steps = 1 + u64::from(draw) % self.late.later_steps_max.max(1);
                        let at = state.step + steps;
                        state.log.push(format!(
                            "instance {instance}: {} reset, will land at step {at}",
                            change.describe()
                        ));
                        state.late.push((at, change));
                    } else {
                        state.log.push(format!(
                            "instance {instance}: {} reset, never carried out",
                            change.describe()
                        ));
                    }
                    return Err(simulated(format!(
                        "{method} {name}: connection reset before the answer (simulated)"
                    )));
                }
                Fate::Apply => return self.carry_out_answered(&change),
                Fate::Hang => {
                    state.counts.hung += 1;
                    state
                        .log
                        .push(format!("instance {instance}: {} hangs", change.describe()));
                    let (answer, receiver) = oneshot::channel();
                    state.parked.push(Parked {
                        instance,
                        change,
                        answer,
                    });
                    receiver
                }
            }
        };
        // Answered at a crash (or dropped with the world) with an error, or with the store's
        // answer when its sender resumes after a pause.
        match receiver.await {
            Ok(Ok(result)) => Ok(result),
            Ok(Err(failure)) => Err(simulated(format!("{method} {name}: {failure}"))),
            Err(_) => Err(simulated(format!(
                "{method} {name}: no answer, the server crashed (instance {instance})"
            ))),
        }
    }

    /// Crashes `instance`: refuses whatever it sends from now on and decides the fate of
    /// its parked requests (see the module docs). Returns how many it parked.
    pub fn crash(&self, instance: u64) -> usize {
        let mut state = self.lock();
        state.dead.insert(instance);
        let parked: Vec<Parked> = {
            let (theirs, others): (Vec<Parked>, Vec<Parked>) = std::mem::take(&mut state.parked)
                .into_iter()
                .partition(|parked| parked.instance == instance);
            state.parked = others;
            theirs
        };
        let count = parked.len();
        for (position, parked) in parked.into_iter().enumerate() {
            let draw = self.draw(&[instance, 0x1a7e, position as u64], "");
            let LateRates {
                at_crash_ppm,
                later_ppm,
                later_steps_max,
            } = self.late;
            if draw < at_crash_ppm {
                let outcome = self.carry_out(&parked.change);
                state.counts.landed_at_crash += 1;
                state.log.push(format!(
                    "crash of instance {instance}: its {} lands now ({})",
                    parked.change.describe(),
                    if outcome.is_ok() { "ok" } else { "refused" }
                ));
            } else if draw < at_crash_ppm + later_ppm {
                let steps = 1 + u64::from(self.draw(&[instance, 0x57e9, position as u64], ""))
                    % later_steps_max.max(1);
                let at = state.step + steps;
                state.log.push(format!(
                    "crash of instance {instance}: its {} will land at step {at}",
                    parked.change.describe()
                ));
                state.late.push((at, parked.change));
            } else {
                state.counts.dropped += 1;
                state.log.push(format!(
                    "crash of instance {instance}: its {} is never carried out",
                    parked.change.describe()
                ));
            }
            // The dead client gets its error (its thread may be waiting for it).
            let _ = parked.answer.send(Err(ParkedFailure::Crashed { instance }));
        }
        count
    }

    /// Advances the harness's step counter to `step` and carries out the late changes due
    /// by then, in the order they were sent.
    pub fn land_due(&self, step: u64) {
        let mut state = self.lock();
        state.step = step;
        let (due, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut state.late)
            .into_iter()
            .partition(|(at, _)| *at <= step);
        state.late = waiting;
        for (_, change) in due {
            let outcome = self.carry_out(&change);
            state.counts.landed_late += 1;
            state.log.push(format!(
                "late: a dead server's {} lands ({})",
                change.describe(),
                match outcome {
                    Ok(()) => "ok".to_string(),
                    Err(error) => format!("refused: {error}"),
                }
            ));
        }
    }

    /// Removes object `key` from the bucket, as a store that loses it (or a person) would;
    /// with `flip_at`, flips the bits of that byte of it instead (when it has that many).
    pub fn lose(&self, key: &str, flip_at: Option<usize>) {
        let path = object_store::path::Path::from(key);
        futures::executor::block_on(async {
            match flip_at {
                None => self
                    .bucket
                    .delete(&path)
                    .await
                    .expect("deleting from memory"),
                Some(at) => {
                    let mut body = self
                        .bucket
                        .get(&path)
                        .await
                        .expect("the object exists")
                        .bytes()
                        .await
                        .expect("reading from memory")
                        .to_vec();
                    let at = at % body.len();
                    body[at] ^= 0xff;
                    self.bucket
                        .put(&path, body.into())
                        .await
                        .expect("writing to memory");
                }
            }
        });
    }

    /// Object names and sizes in the bucket now (for traces and diagnostics).
    pub fn objects(&self) -> Vec<(String, u64)> {
        futures::executor::block_on(async {
            self.bucket
                .list(None)
                .filter_map(|meta| async move { meta.ok() })
                .map(|meta| (meta.location.to_string(), meta.size))
                .collect()
                .await
        })
    }
}

/// One instance's connection to a [`SimWorld`].
#[derive(Debug)]
pub struct SimStore {
    world: Arc<SimWorld>,
    instance: u64,
}

impl fmt::Display for SimStore {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            formatter,
            "SimStore(seed {}, instance {})",
            self.world.seed, self.instance
        )
    }
}

impl SimStore {
    /// Refuses a request of a dead instance, or one whose fate is `Fail`.
    fn admit(&self, method: &'static str, name: &str) -> object_store::Result<()> {
        let mut state = self.world.lock();
        if state.dead.contains(&self.instance) {
            state.counts.refused_dead += 1;
            return Err(simulated(format!(
                "{method} {name}: the server crashed (instance {})",
                self.instance
            )));
        }
        SimWorld::check_reachable(&mut state, self.instance, method, name)?;
        match self.world.fate(&mut state, self.instance, method, name) {
            Fate::Fail => {
                state.counts.failed += 1;
                Err(simulated(format!(
                    "{method} {name}: 500 Internal Error (simulated)"
                )))
            }
            _ => Ok(()),
        }
    }
}

#[async_trait]
impl ObjectStore for SimStore {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        options: PutOptions,
    ) -> object_store::Result<PutResult> {
        let body: Bytes = {
            let mut whole = Vec::with_capacity(payload.content_length());
            for part in payload.iter() {
                whole.extend_from_slice(part);
            }
            whole.into()
        };
        let change = Change::Put {
            path: location.clone(),
            body,
            options,
        };
        self.world
            .mutate(self.instance, "PUT", change)
            .await
            .map(|result| result.expect("a PUT answers a PutResult"))
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        _options: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        Err(not_simulated(format!("multipart upload of {location}")))
    }

    async fn get_opts(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        self.admit("GET", location.as_ref())?;
        self.world.bucket.get_opts(location, options).await
    }

    async fn delete(&self, location: &Path) -> object_store::Result<()> {
        let change = Change::Delete {
            path: location.clone(),
        };
        self.world
            .mutate(self.instance, "DELETE", change)
            .await
            .map(drop)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        let name = prefix.map(|prefix| prefix.to_string()).unwrap_or_default();
        if let Err(error) = self.admit("LIST", &name) {
            return stream::once(async move { Err(error) }).boxed();
        }
        // Collected now, so the listing is one request at one moment.
        let listed: Vec<object_store::Result<ObjectMeta>> =
            futures::executor::block_on(self.world.bucket.list(prefix).collect());
        stream::iter(listed).boxed()
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> object_store::Result<ListResult> {
        let name = prefix.map(|prefix| prefix.to_string()).unwrap_or_default();
        self.admit("LIST", &name)?;
        self.world.bucket.list_with_delimiter(prefix).await
    }

    async fn copy(&self, from: &Path, to: &Path) -> object_store::Result<()> {
        Err(not_simulated(format!("copy of {from} to {to}")))
    }

    async fn copy_if_not_exists(&self, from: &Path, to: &Path) -> object_store::Result<()> {
        Err(not_simulated(format!("copy of {from} to {to}")))
    }
}
