//! The disk lock: one object `PREFIX/bufcache-lock.json` that a server creates before serving
//! a disk and deletes at a clean shutdown, so a second server opening the same disk is refused
//! with an error naming the holder instead of silently corrupting it.
//!
//! Taking the lock is a create-only PUT (`If-None-Match: *`), which S3, MinIO, Ceph RGW and moto
//! carry out atomically: of two servers starting at once exactly one wins. A lock left by a
//! server that crashed (or was killed) stays until someone breaks it with `break-lock=ID`,
//! naming the id the refusal printed; breaking is a PUT conditional on the stale lock's ETag
//! (`If-Match`), so of two servers breaking the same stale lock exactly one wins too. The lock
//! has no expiry: S3 cannot fence a server that was paused past a lease, so a timed lease
//! would not be safe either (docs/s3.md, "Two servers on one disk").
//!
//! Taking (or breaking) the lock is idempotent: a PUT the store carried out but whose answer
//! was lost (a 500, a timeout) is retried by the client and then fails its condition (412),
//! as if someone else held the lock. The lock body carries this process's random id, so on
//! a failed condition the lock is read back and, when it carries our id, it is ours.

use std::sync::{Arc, Mutex, Weak};
use std::time::SystemTime;

use object_store::aws::AmazonS3;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, PutMode, PutOptions, PutPayload, UpdateVersion};
use serde_json::json;

use bufcache_device::Clock;

use crate::error::{chain, request_failed, DecodeError, OpenError, StoreError};
use crate::lease::{
    renewal_interval_ns, LapseWatch, Lease, LeaseSeen, MonotonicClock, LEASE_ROUND_TRIPS_MIN,
};
use crate::url::S3Url;

/// Name of the lock object under the prefix.
pub const LOCK_NAME: &str = "bufcache-lock.json";
/// Name of the object a standby holds, under a lease like the lock's, while it waits for the
/// disk: a second standby finds it renewed and is refused.
pub const STANDBY_NAME: &str = "bufcache-standby.json";

/// Who holds a lock, as stored in the lock object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LockHolder {
    /// Random id; `break-lock=ID` must name it.
    pub id: String,
    pub host: String,
    pub pid: u64,
    /// When the holder took the lock (RFC 3339, UTC).
    pub since: String,
    /// The holder's lease in milliseconds (module `lease`); None for a lock written before
    /// leases, which only `break-lock=` takes.
    pub lease_ms: Option<u64>,
    /// How many times the holder renewed the lease: every renewal writes a different body, so
    /// the object's ETag changes with each.
    pub renewal: u64,
}

impl std::fmt::Display for LockHolder {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            formatter,
            "host {} pid {} since {} (lock id {})",
            self.host, self.pid, self.since, self.id
        )
    }
}

impl LockHolder {
    fn of_this_process(lease_ms: Option<u64>) -> LockHolder {
        use std::hash::{BuildHasher, Hasher};
        // RandomState is seeded from the OS's randomness: enough for an id that only has to
        // differ between processes.
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u32(std::process::id());
        // The id tells this process's own lock apart from every other (a lost answer is
        // recognised by it): the clock goes in with the random seed.
        let nanoseconds = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |elapsed| elapsed.as_nanos());
        hasher.write_u128(nanoseconds);
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|name| name.trim().to_string())
            .ok()
            .filter(|name| !name.is_empty())
            .unwrap_or_else(|| "unknown-host".to_string());
        LockHolder {
            id: format!("{:016x}", hasher.finish()),
            host,
            pid: u64::from(std::process::id()),
            since: humantime::format_rfc3339_seconds(SystemTime::now()).to_string(),
            lease_ms,
            renewal: 0,
        }
    }

    fn to_json(&self) -> Vec<u8> {
        json!({
            "format": "bufcache-s3-lock",
            "id": self.id,
            "host": self.host,
            "pid": self.pid,
            "since": self.since,
            "lease_ms": self.lease_ms,
            "renewal": self.renewal,
        })
        .to_string()
        .into_bytes()
    }

    pub(crate) fn parse(body: &[u8]) -> Result<LockHolder, DecodeError> {
        let value: serde_json::Value = serde_json::from_slice(body)
            .map_err(|error| DecodeError::NotJson(error.to_string()))?;
        let text = |name: &str| {
            value[name]
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| DecodeError::BadField {
                    field: name.to_string(),
                    problem: "is missing or not a string".to_string(),
                })
        };
        Ok(LockHolder {
            id: text("id")?,
            host: text("host")?,
            pid: value["pid"].as_u64().ok_or_else(|| DecodeError::BadField {
                field: "pid".to_string(),
                problem: "is missing or not a whole number".to_string(),
            })?,
            since: text("since")?,
            lease_ms: value["lease_ms"].as_u64(),
            renewal: value["renewal"].as_u64().unwrap_or(0),
        })
    }
}

/// Registers this process as the disk's one standby: takes the standby object under a lease
/// (renewed like the lock's); refused ([`OpenError::StandbyExists`]) while another standby
/// renews it.
pub(crate) async fn register_standby(
    runtime: tokio::runtime::Handle,
    store: Arc<AmazonS3>,
    url: &S3Url,
) -> Result<Arc<DiskLock>, OpenError> {
    match DiskLock::acquire_named(
        runtime,
        store,
        url,
        STANDBY_NAME,
        Takeover::AfterLapse,
        None,
    )
    .await
    {
        Ok(Acquired::Held(standby)) => Ok(standby),
        Ok(Acquired::WritesRefused(answer)) => Err(OpenError::Config {
            url: url.to_string(),
            reason: format!(
                "a standby must be able to write, and the store refuses writes ({answer})"
            ),
        }),
        Err(OpenError::LeaseHeld { holder, key, .. })
        | Err(OpenError::Locked { holder, key, .. }) => Err(OpenError::StandbyExists {
            url: url.to_string(),
            key,
            holder,
        }),
        Err(error) => Err(error),
    }
}

/// The lock as it is now with its ETag (None: no lock object); a lock object that is not a
/// bufcache lock is an error naming it.
async fn read_seen(
    store: &AmazonS3,
    path: &ObjectPath,
    url: &S3Url,
    key: &str,
) -> Result<Option<Seen>, OpenError> {
    let request_error = |error: object_store::Error| OpenError::Request {
        url: url.to_string(),
        operation: format!("reading the lock `{key}`"),
        message: chain(&error),
    };
    let existing = match store.get(path).await {
        Ok(existing) => existing,
        Err(object_store::Error::NotFound { .. }) => return Ok(None),
        Err(error) => return Err(request_error(error)),
    };
    let e_tag = existing.meta.e_tag.clone();
    let body = existing.bytes().await.map_err(request_error)?;
    let holder = LockHolder::parse(&body).map_err(|reason| OpenError::BadLock {
        url: url.to_string(),
        key: key.to_string(),
        reason,
    })?;
    Ok(Some(Seen { holder, e_tag }))
}

/// Renews the lease of `lock` every third of it with a PUT conditional on the ETag of this
/// process's own last write, until the lock is released or dropped, or someone else took it
/// (then the lease says so and nothing is acknowledged any more). A renewal that fails or
/// takes longer than a third of the lease is tried again soon; the lease lapses on its own
/// when none succeeds (module `lease`).
async fn renew(lock: Weak<DiskLock>, lease: Arc<Lease>) {
    let Some(first) = lock.upgrade() else {
        return;
    };
    let (store, key, mut holder) = (first.store.clone(), first.key.clone(), first.holder.clone());
    drop(first);
    let path = ObjectPath::from(key.as_str());
    let interval = std::time::Duration::from_nanos(renewal_interval_ns(lease.lease_ns()));
    let mut pause = interval;
    loop {
        tokio::time::sleep(pause).await;
        pause = interval / 4;
        let e_tag = {
            let Some(lock) = lock.upgrade() else {
                return;
            };
            if *lock.released.lock().unwrap() {
                return;
            }
            let e_tag = lock.e_tag.lock().unwrap().clone();
            e_tag
        };
        let e_tag = match e_tag {
            Some(e_tag) => e_tag,
            // The store named no ETag for our last write: learn it from a read.
            None => match store.get(&path).await {
                Ok(existing) => {
                    let seen_tag = existing.meta.e_tag.clone();
                    match existing.bytes().await.map(|body| LockHolder::parse(&body)) {
                        Ok(Ok(seen)) if seen.id == holder.id => {
                            holder.renewal = seen.renewal;
                            let Some(lock) = lock.upgrade() else {
                                return;
                            };
                            *lock.e_tag.lock().unwrap() = seen_tag;
                            continue;
                        }
                        Ok(seen) => {
                            let by = seen.map_or_else(
                                |_| "an unreadable lock".to_string(),
                                |seen| seen.to_string(),
                            );
                            tracing::error!(lock = %key, holder = %by, "the disk lock was taken over by another server");
                            lease.taken_over(by);
                            return;
                        }
                        Err(error) => {
                            tracing::warn!(lock = %key, error = %chain(&error), "reading the lock to renew its lease failed");
                            continue;
                        }
                    }
                }
                Err(object_store::Error::NotFound { .. }) => {
                    lease.taken_over("nobody: the lock object was deleted".to_string());
                    return;
                }
                Err(error) => {
                    tracing::warn!(lock = %key, error = %chain(&error), "reading the lock to renew its lease failed");
                    continue;
                }
            },
        };
        holder.renewal += 1;
        let sent_ns = lease.clock().now_ns();
        let put = store.put_opts(
            &path,
            PutPayload::from(holder.to_json()),
            PutOptions {
                mode: PutMode::Update(UpdateVersion {
                    e_tag: Some(e_tag),
                    version: None,
                }),
                ..Default::default()
            },
        );
        match tokio::time::timeout(interval, put).await {
            Ok(Ok(result)) => {
                let Some(lock) = lock.upgrade() else {
                    return;
                };
                *lock.e_tag.lock().unwrap() = result.e_tag;
                lease.renewed(sent_ns);
                pause = interval;
            }
            // Someone else wrote the lock, or our own earlier renewal landed after its
            // answer was lost: the next round reads it back and tells which.
            Ok(Err(object_store::Error::Precondition { .. })) => {
                let Some(lock) = lock.upgrade() else {
                    return;
                };
                *lock.e_tag.lock().unwrap() = None;
                pause = std::time::Duration::ZERO;
            }
            Ok(Err(object_store::Error::NotFound { .. })) => {
                tracing::error!(lock = %key, "the disk lock object was deleted by someone else; writes are no longer acknowledged");
                lease.taken_over("nobody: the lock object was deleted".to_string());
                return;
            }
            Ok(Err(error)) => {
                tracing::warn!(lock = %key, error = %chain(&error), age_ms = lease.age_ns() / 1_000_000, "renewing the disk lock's lease failed; trying again");
            }
            Err(_) => {
                tracing::warn!(lock = %key, age_ms = lease.age_ns() / 1_000_000, "renewing the disk lock's lease took longer than a third of it; trying again");
            }
        }
    }
}

/// What came of trying to take the lock.
pub(crate) enum Acquired {
    /// This process holds the lock.
    Held(Arc<DiskLock>),
    /// The store answered the lock's PUT 403 Forbidden: these credentials (or the bucket's
    /// policy) do not allow writing. Nothing was written; the store's answer, on one line.
    WritesRefused(String),
}

/// The store's 403 answer on one line: the status and, when its XML body has them, the S3
/// error code and message (the full answer is long and spans lines).
fn refusal_summary(error: &object_store::Error) -> String {
    let text = chain(error);
    let element = |name: &str| {
        let start = text.find(&format!("<{name}>"))? + name.len() + 2;
        let end = start + text[start..].find(&format!("</{name}>"))?;
        Some(text[start..end].trim().to_string())
    };
    match (element("Code"), element("Message")) {
        (Some(code), Some(message)) => format!("403 Forbidden, {code}: {message}"),
        (Some(code), None) => format!("403 Forbidden, {code}"),
        _ => text.split_whitespace().collect::<Vec<_>>().join(" "),
    }
}

/// Who holds the disk's lock now (None: no lock object); a lock object that is not a
/// bufcache lock is an error naming it.
pub(crate) async fn holder_now(
    store: &dyn ObjectStore,
    url: &S3Url,
) -> Result<Option<LockHolder>, OpenError> {
    let key = url.key(LOCK_NAME);
    let request_error = |error: object_store::Error| OpenError::Request {
        url: url.to_string(),
        operation: format!("reading the lock `{key}`"),
        message: chain(&error),
    };
    let body = match store.get(&ObjectPath::from(key.as_str())).await {
        Ok(existing) => existing.bytes().await.map_err(request_error)?,
        Err(object_store::Error::NotFound { .. }) => return Ok(None),
        Err(error) => return Err(request_error(error)),
    };
    LockHolder::parse(&body)
        .map(Some)
        .map_err(|reason| OpenError::BadLock {
            url: url.to_string(),
            key: key.clone(),
            reason,
        })
}

/// Checks, for a server that opens the disk read-only and so takes no lock, that no other
/// server holds the disk: that server's writes would make the read-only server's cache serve
/// stale data. Refused unless `url.break_lock` names the holder (the operator says it is
/// gone); the lock object is left as it is either way.
pub(crate) async fn check_not_held(store: &AmazonS3, url: &S3Url) -> Result<(), OpenError> {
    let Some(holder) = holder_now(store, url).await? else {
        return Ok(());
    };
    let key = url.key(LOCK_NAME);
    if url.break_lock.as_deref() == Some(holder.id.as_str()) {
        tracing::warn!(disk = %url, holder = %holder, "serving read-only over a disk another server holds, as break-lock= asked; its lock is left in place");
        return Ok(());
    }
    Err(OpenError::LockedReadOnly {
        url: url.to_string(),
        key,
        holder: holder.to_string().into_boxed_str(),
        id: holder.id,
        asked: url.break_lock.clone(),
    })
}

/// A lock this process holds; released (deleted) by [`DiskLock::release`], on drop, or by
/// [`release_locks`]. While held, a task renews its lease (module `lease`).
pub struct DiskLock {
    runtime: tokio::runtime::Handle,
    store: Arc<AmazonS3>,
    key: String,
    holder: LockHolder,
    /// True once released (or given up), so a release happens at most once.
    released: Mutex<bool>,
    /// Until when this process may acknowledge writes; None with `lease=off`.
    lease: Option<Arc<Lease>>,
    /// The ETag of this process's newest write of the lock object: renewals are conditional
    /// on it.
    e_tag: Mutex<Option<String>>,
    /// How long the PUT that took the lock took: the lease must span several.
    round_trip_ns: u64,
}

/// Every lock taken by this process that may still be held, for [`release_locks`].
static HELD: Mutex<Vec<Weak<DiskLock>>> = Mutex::new(Vec::new());

/// Releases every disk lock this process still holds. A server calls it after its clean
/// shutdown wrote everything back, when other threads may still hold the devices.
pub fn release_locks() {
    let held: Vec<Weak<DiskLock>> = std::mem::take(&mut *HELD.lock().unwrap());
    for lock in held.iter().filter_map(Weak::upgrade) {
        if let Err(error) = lock.release() {
            tracing::warn!(lock = %lock.key, "{error}; the next server must break the lock");
        }
    }
}

/// What an open does with a lock another server holds under a lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Takeover {
    /// Only `break-lock=` takes it (the chunk layout, which has no epochs to fence a paused
    /// holder's late writes, and `bufcache disk`).
    BreakLockOnly,
    /// Watch it for one lease: taken when nobody renewed it, refused
    /// ([`OpenError::LeaseHeld`]) when its holder did.
    AfterLapse,
    /// Watch it until its lease lapses, however long that takes (a standby).
    WaitForLapse,
}

/// The lock object as one read found it.
struct Seen {
    holder: LockHolder,
    e_tag: Option<String>,
}

impl DiskLock {
    /// Takes the lock of the disk `url` names, or breaks the stale lock `url.break_lock`
    /// names. Refused (nothing written) when another holder has it. A 403 answer to the
    /// lock's PUT is [`Acquired::WritesRefused`], not an error: the caller may serve the disk
    /// read-only. Any other failure (a 500 after the retries, an unreachable store) is an
    /// error.
    pub(crate) async fn acquire(
        runtime: tokio::runtime::Handle,
        store: Arc<AmazonS3>,
        url: &S3Url,
    ) -> Result<Acquired, OpenError> {
        Self::acquire_with(runtime, store, url, Takeover::BreakLockOnly, None).await
    }

    /// [`DiskLock::acquire`], taking a lock whose lease lapsed as `takeover` says; each
    /// renewal of the holder's lease seen while watching is told to `watching`.
    pub(crate) async fn acquire_with(
        runtime: tokio::runtime::Handle,
        store: Arc<AmazonS3>,
        url: &S3Url,
        takeover: Takeover,
        watching: Option<Arc<LeaseSeen>>,
    ) -> Result<Acquired, OpenError> {
        Self::acquire_named(runtime, store, url, LOCK_NAME, takeover, watching).await
    }

    /// [`DiskLock::acquire_with`] of the object `name` under the prefix (the lock, or the
    /// standby's object).
    pub(crate) async fn acquire_named(
        runtime: tokio::runtime::Handle,
        store: Arc<AmazonS3>,
        url: &S3Url,
        name: &str,
        takeover: Takeover,
        watching: Option<Arc<LeaseSeen>>,
    ) -> Result<Acquired, OpenError> {
        let clock: Arc<dyn Clock> = Arc::new(MonotonicClock::new());
        let acquired =
            Self::take(runtime, store.clone(), url, name, clock, takeover, watching).await?;
        if let (Acquired::Held(lock), Some(lease_ms)) = (
            &acquired,
            url.lease_ms.filter(|_| takeover != Takeover::BreakLockOnly),
        ) {
            let lease_ns = lease_ms * 1_000_000;
            if lock.round_trip_ns.saturating_mul(LEASE_ROUND_TRIPS_MIN) > lease_ns {
                if let Err(release) = lock.release_async().await {
                    tracing::warn!(lock = %lock.key, "{release}; the next server must break the lock");
                }
                return Err(OpenError::LeaseTooShort {
                    url: url.to_string(),
                    lease_ms,
                    round_trip_ms: lock.round_trip_ns / 1_000_000,
                    round_trips: LEASE_ROUND_TRIPS_MIN,
                });
            }
        }
        if let (Acquired::Held(lock), true) = (&acquired, url.lock_check) {
            if let Err(error) = lock.check_store_refuses_second_create(url).await {
                // Released here, awaited: a lock dropped in async code is released in the
                // background, which nobody would wait for.
                if let Err(release) = lock.release_async().await {
                    tracing::warn!(lock = %lock.key, "{release}; the next server must break the lock");
                }
                return Err(error);
            }
        }
        if let Acquired::Held(lock) = &acquired {
            if let Some(lease) = &lock.lease {
                lock.runtime
                    .spawn(renew(Arc::downgrade(lock), Arc::clone(lease)));
            }
        }
        Ok(acquired)
    }

    /// Refuses a store that ignores `If-None-Match: *` (s3rver 3.7.1 stores the object again
    /// and answers 200): there, two servers would both "take" the lock. The probe creates the
    /// lock object again with the very body it holds, so a store that ignores the condition
    /// rewrites identical bytes and nothing changes. `lock=off` skips it.
    async fn check_store_refuses_second_create(&self, url: &S3Url) -> Result<(), OpenError> {
        let probe = self
            .store
            .put_opts(
                &ObjectPath::from(self.key.as_str()),
                PutPayload::from(self.holder.to_json()),
                PutOptions {
                    mode: PutMode::Create,
                    ..Default::default()
                },
            )
            .await;
        match probe {
            Err(object_store::Error::AlreadyExists { .. })
            | Err(object_store::Error::Precondition { .. }) => Ok(()),
            Ok(_) => {
                // Released here, in async code: the drop's blocking release must not run
                // inside the runtime.
                if let Err(error) = self
                    .store
                    .delete(&ObjectPath::from(self.key.as_str()))
                    .await
                {
                    tracing::warn!(lock = %self.key, error = %chain(&error), "could not delete the lock object");
                }
                *self.released.lock().unwrap() = true;
                Err(OpenError::StoreCannotLock {
                    url: url.to_string(),
                    key: self.key.clone(),
                })
            }
            Err(error) => Err(OpenError::Request {
                url: url.to_string(),
                operation: format!(
                    "checking that the store refuses a second create of `{}`",
                    self.key
                ),
                message: chain(&error),
            }),
        }
    }

    /// Takes the lock (see [`DiskLock::acquire`]) without checking the store: creates it,
    /// or watches the one there until it is ours to take over ([`Taking::watch`]) and takes
    /// it over ([`Taking::take_over`]).
    async fn take(
        runtime: tokio::runtime::Handle,
        store: Arc<AmazonS3>,
        url: &S3Url,
        name: &str,
        clock: Arc<dyn Clock>,
        takeover: Takeover,
        watching: Option<Arc<LeaseSeen>>,
    ) -> Result<Acquired, OpenError> {
        let key = url.key(name);
        // A lock only break-lock= takes (the chunk layout, `bufcache disk`) has no use for a
        // lease: it is written without one and never renewed, as before leases.
        let lease_ms = url.lease_ms.filter(|_| takeover != Takeover::BreakLockOnly);
        let taking = Taking {
            runtime,
            store,
            url,
            path: ObjectPath::from(key.as_str()),
            key,
            holder: LockHolder::of_this_process(lease_ms),
            lease_ms,
            clock,
            takeover,
            watching,
        };
        // Every lock seen so far and the clock time its ETag was first seen at.
        let mut watch: Option<LapseWatch> = None;
        // A lock deleted between our failed create and our read is retried a few times.
        let mut creates_left = 3;
        loop {
            if creates_left == 0 {
                return Err(OpenError::LockRaced {
                    url: url.to_string(),
                    key: taking.key,
                });
            }
            creates_left -= 1;
            let sent_ns = taking.clock.now_ns();
            if let Some(acquired) = taking.create(sent_ns).await? {
                return Ok(acquired);
            }
            match taking.watch(&mut watch).await? {
                Watched::Ours(e_tag) => return taking.held(sent_ns, e_tag),
                // Deleted (released) meanwhile: create it again.
                Watched::Gone => continue,
                Watched::Stale(stale, e_tag) => return taking.take_over(stale, e_tag).await,
            }
        }
    }

    fn held(
        runtime: tokio::runtime::Handle,
        store: Arc<AmazonS3>,
        key: String,
        holder: LockHolder,
        lease: Option<Arc<Lease>>,
        e_tag: Option<String>,
        round_trip_ns: u64,
    ) -> Acquired {
        tracing::info!(lock = %key, holder = %holder, "took the disk lock");
        let lock = Arc::new(DiskLock {
            runtime,
            store,
            key,
            holder,
            released: Mutex::new(false),
            lease,
            e_tag: Mutex::new(e_tag),
            round_trip_ns,
        });
        let mut held = HELD.lock().unwrap();
        held.retain(|weak| weak.strong_count() > 0);
        held.push(Arc::downgrade(&lock));
        Acquired::Held(lock)
    }

    /// Until when this process may acknowledge writes to the disk; None with `lease=off`.
    pub fn lease(&self) -> Option<&Arc<Lease>> {
        self.lease.as_ref()
    }

    /// Who this process is in the lock object.
    pub fn holder(&self) -> &LockHolder {
        &self.holder
    }

    /// Deletes the lock object if it is still ours (a lock broken by another server is left
    /// to its new holder). Idempotent. Blocks on the lock's runtime; called from inside a
    /// runtime (async code, where blocking would panic) it starts the release there and
    /// returns without waiting for it: async code calls [`DiskLock::release_async`].
    pub fn release(&self) -> Result<(), StoreError> {
        if let Ok(current) = tokio::runtime::Handle::try_current() {
            self.release_in_background(&current);
            return Ok(());
        }
        self.runtime.block_on(self.release_async())
    }

    /// [`DiskLock::release`] for async code.
    pub async fn release_async(&self) -> Result<(), StoreError> {
        // Claimed before the requests, so that releases never overlap; given back when this
        // one fails.
        if std::mem::replace(&mut *self.released.lock().unwrap(), true) {
            return Ok(());
        }
        let result = delete_if_ours(&self.store, &self.key, &self.holder.id).await;
        match &result {
            Ok(()) => tracing::info!(lock = %self.key, "released the disk lock"),
            Err(_) => *self.released.lock().unwrap() = false,
        }
        result
    }

    /// Starts the release on `runtime` without waiting for it (for a drop inside async code).
    fn release_in_background(&self, runtime: &tokio::runtime::Handle) {
        if std::mem::replace(&mut *self.released.lock().unwrap(), true) {
            return;
        }
        let (store, key, id) = (self.store.clone(), self.key.clone(), self.holder.id.clone());
        runtime.spawn(async move {
            match delete_if_ours(&store, &key, &id).await {
                Ok(()) => tracing::info!(lock = %key, "released the disk lock"),
                Err(error) => {
                    tracing::warn!(lock = %key, "{error}; the next server must break the lock")
                }
            }
        });
    }
}

/// Deletes the lock object `key` if it still carries holder id `id`.
async fn delete_if_ours(store: &AmazonS3, key: &str, id: &str) -> Result<(), StoreError> {
    let path = ObjectPath::from(key);
    let body = match store.get(&path).await {
        Ok(existing) => existing.bytes().await,
        Err(object_store::Error::NotFound { .. }) => return Ok(()),
        Err(error) => Err(error),
    }
    .map_err(|error| request_failed("GET", key, error))?;
    match LockHolder::parse(&body) {
        Ok(holder) if holder.id == id => store
            .delete(&path)
            .await
            .map_err(|error| request_failed("DELETE", key, error)),
        _ => {
            tracing::warn!(lock = %key, "the disk lock was broken by another server; leaving it");
            Ok(())
        }
    }
}

/// One [`DiskLock::take`]: what each of its steps needs.
struct Taking<'a> {
    runtime: tokio::runtime::Handle,
    store: Arc<AmazonS3>,
    url: &'a S3Url,
    key: String,
    path: ObjectPath,
    /// This process as the lock names it.
    holder: LockHolder,
    lease_ms: Option<u64>,
    clock: Arc<dyn Clock>,
    takeover: Takeover,
    watching: Option<Arc<LeaseSeen>>,
}

/// What watching a lock someone else held came to ([`Taking::watch`]).
enum Watched {
    /// Ours: our create was carried out though its answer was lost (its ETag).
    Ours(Option<String>),
    /// Deleted (released) meanwhile.
    Gone,
    /// Ours to take over, at this ETag: named by break-lock=, or its lease lapsed.
    Stale(LockHolder, Option<String>),
}

impl Taking<'_> {
    fn request_error(&self, operation: &str, error: object_store::Error) -> OpenError {
        OpenError::Request {
            url: self.url.to_string(),
            operation: format!("{operation} `{}`", self.key),
            message: chain(&error),
        }
    }

    /// The lock as held from a request sent at `sent_ns` that stored it with `e_tag`.
    fn held(&self, sent_ns: u64, e_tag: Option<String>) -> Result<Acquired, OpenError> {
        let round_trip_ns = self.clock.now_ns().saturating_sub(sent_ns);
        let lease = self.lease_ms.map(|lease_ms| {
            Arc::new(Lease::new(
                self.clock.clone(),
                lease_ms * 1_000_000,
                sent_ns,
            ))
        });
        Ok(DiskLock::held(
            self.runtime.clone(),
            self.store.clone(),
            self.key.clone(),
            self.holder.clone(),
            lease,
            e_tag,
            round_trip_ns,
        ))
    }

    /// Creates the lock (create-only PUT sent at `sent_ns`): the lock held, or the store's
    /// refusal to write; None when a lock is there already.
    async fn create(&self, sent_ns: u64) -> Result<Option<Acquired>, OpenError> {
        let created = self
            .store
            .put_opts(
                &self.path,
                PutPayload::from(self.holder.to_json()),
                PutOptions {
                    mode: PutMode::Create,
                    ..Default::default()
                },
            )
            .await;
        match created {
            Ok(result) => self.held(sent_ns, result.e_tag).map(Some),
            // S3 checks permissions before the condition: a 403 says nothing of whether
            // the lock exists.
            Err(error @ object_store::Error::PermissionDenied { .. }) => {
                Ok(Some(Acquired::WritesRefused(refusal_summary(&error))))
            }
            Err(object_store::Error::AlreadyExists { .. })
            | Err(object_store::Error::Precondition { .. }) => Ok(None),
            Err(error) => Err(self.request_error("creating the lock", error)),
        }
    }

    /// Watches the lock until it is ours to take, or refused: a lock of another holder
    /// without a lease (or with `Takeover::BreakLockOnly`) is refused unless break-lock=
    /// names it; one with a lease is taken once it lapses unrenewed, waited for
    /// (`Takeover::WaitForLapse`) or refused when seen renewed (`Takeover::AfterLapse`).
    /// `watch` keeps the ETags seen across calls.
    async fn watch(&self, watch: &mut Option<LapseWatch>) -> Result<Watched, OpenError> {
        let (url, key) = (self.url, &self.key);
        loop {
            let Some(seen) = read_seen(&self.store, &self.path, url, key).await? else {
                return Ok(Watched::Gone);
            };
            let Seen {
                holder: stale,
                e_tag,
            } = seen;
            if stale.id == self.holder.id {
                tracing::info!(lock = %key, "the lock's create was carried out though its answer was lost");
                return Ok(Watched::Ours(e_tag));
            }
            if url.break_lock.as_deref() == Some(stale.id.as_str()) {
                return Ok(Watched::Stale(stale, e_tag));
            }
            let (Some(stale_lease_ms), Some(tag), true) = (
                stale.lease_ms,
                &e_tag,
                self.takeover != Takeover::BreakLockOnly,
            ) else {
                return Err(OpenError::Locked {
                    url: url.to_string(),
                    key: key.clone(),
                    holder: stale.to_string(),
                    id: stale.id,
                    asked: url.break_lock.clone(),
                });
            };
            let lease_ns = stale_lease_ms.saturating_mul(1_000_000);
            let watch = watch.get_or_insert_with(|| {
                if self.takeover == Takeover::WaitForLapse {
                    tracing::info!(disk = %url, holder = %stale, lease_ms = stale_lease_ms, "standing by: the disk is taken over when its holder's lease lapses");
                }
                LapseWatch::new(lease_ns)
            });
            let first_seen_ns = watch.since_ns();
            let lapsed = watch.observe(tag, self.clock.now_ns());
            if let Some(watching) = self
                .watching
                .as_ref()
                .filter(|_| watch.since_ns() != first_seen_ns)
            {
                watching.renewal_seen();
            }
            if lapsed {
                tracing::warn!(disk = %url, holder = %stale, lease_ms = stale_lease_ms, "the lock's lease lapsed unrenewed; taking the disk over");
                return Ok(Watched::Stale(stale, e_tag));
            }
            if self.takeover == Takeover::AfterLapse
                && first_seen_ns.is_some_and(|first| watch.since_ns() != Some(first))
            {
                return Err(OpenError::LeaseHeld {
                    url: url.to_string(),
                    key: key.clone(),
                    holder: stale.to_string(),
                    lease_ms: stale_lease_ms,
                });
            }
            // Polled often enough to see every renewal (one per third of a lease).
            let poll_ms = (stale_lease_ms / 10).clamp(50, 1_000);
            tokio::time::sleep(std::time::Duration::from_millis(poll_ms)).await;
        }
    }

    /// Takes over the lock `stale` holds, conditional on the ETag `e_tag` it was seen at.
    async fn take_over(
        &self,
        stale: LockHolder,
        e_tag: Option<String>,
    ) -> Result<Acquired, OpenError> {
        let url = self.url;
        let sent_ns = self.clock.now_ns();
        let broken = self
            .store
            .put_opts(
                &self.path,
                PutPayload::from(self.holder.to_json()),
                PutOptions {
                    mode: PutMode::Update(UpdateVersion {
                        e_tag,
                        version: None,
                    }),
                    ..Default::default()
                },
            )
            .await;
        match broken {
            Ok(result) => {
                tracing::warn!(disk = %url, broken = %stale, "took the disk lock over");
                self.held(sent_ns, result.e_tag)
            }
            // Our own break carried out with its answer lost (the retry then failed its
            // condition), or someone else broke, renewed or released it first.
            Err(object_store::Error::Precondition { .. })
            | Err(object_store::Error::NotFound { .. }) => {
                let now = read_seen(&self.store, &self.path, url, &self.key).await;
                if let Ok(Some(now)) = now {
                    if now.holder == self.holder {
                        tracing::warn!(disk = %url, broken = %stale, "took the disk lock over (its answer was lost)");
                        return self.held(sent_ns, now.e_tag);
                    }
                }
                Err(OpenError::LockRaced {
                    url: url.to_string(),
                    key: self.key.clone(),
                })
            }
            Err(error @ object_store::Error::PermissionDenied { .. }) => {
                Ok(Acquired::WritesRefused(refusal_summary(&error)))
            }
            Err(error) => Err(self.request_error("breaking the lock", error)),
        }
    }
}

impl Drop for DiskLock {
    fn drop(&mut self) {
        if let Err(error) = self.release() {
            tracing::warn!(lock = %self.key, "{error}; the next server must break the lock");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: the lock record round-trips and a foreign body is refused, not misread. Method:
    // serialise this process's holder, parse it back; parse garbage.
    #[test]
    fn lock_record_round_trips_and_garbage_is_refused() {
        let mut holder = LockHolder::of_this_process(Some(15_000));
        holder.renewal = 7;
        assert_eq!(LockHolder::parse(&holder.to_json()).unwrap(), holder);
        assert_eq!(holder.pid, u64::from(std::process::id()));
        assert_ne!(LockHolder::of_this_process(Some(15_000)).id, holder.id);
        // A lock written before leases has none: only break-lock= takes it.
        let old = br#"{"format":"bufcache-s3-lock","id":"0a","host":"h","pid":1,"since":"s"}"#;
        assert_eq!(LockHolder::parse(old).unwrap().lease_ms, None);
        assert!(LockHolder::parse(b"{}")
            .unwrap_err()
            .to_string()
            .contains("`id`"));
        assert!(LockHolder::parse(b"nope")
            .unwrap_err()
            .to_string()
            .contains("JSON"));
    }
}
