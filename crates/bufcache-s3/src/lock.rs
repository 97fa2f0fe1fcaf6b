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

use crate::error::{chain, request_failed, OpenError, StoreError};
use crate::url::S3Url;

/// Name of the lock object under the prefix.
pub const LOCK_NAME: &str = "bufcache-lock.json";

/// Who holds a lock, as stored in the lock object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LockHolder {
    /// Random id; `break-lock=ID` must name it.
    pub id: String,
    pub host: String,
    pub pid: u64,
    /// When the holder took the lock (RFC 3339, UTC).
    pub since: String,
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
    fn of_this_process() -> LockHolder {
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
        }
    }

    fn to_json(&self) -> Vec<u8> {
        json!({
            "format": "bufcache-s3-lock",
            "id": self.id,
            "host": self.host,
            "pid": self.pid,
            "since": self.since,
        })
        .to_string()
        .into_bytes()
    }

    pub(crate) fn parse(body: &[u8]) -> Result<LockHolder, String> {
        let value: serde_json::Value =
            serde_json::from_slice(body).map_err(|error| format!("not JSON: {error}"))?;
        let text = |name: &str| {
            value[name]
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| format!("field `{name}` is missing or not a string"))
        };
        Ok(LockHolder {
            id: text("id")?,
            host: text("host")?,
            pid: value["pid"]
                .as_u64()
                .ok_or("field `pid` is missing or not a whole number")?,
            since: text("since")?,
        })
    }
}

/// The lock's holder now (None: no lock object, or not a bufcache lock).
async fn read_holder(
    store: &AmazonS3,
    path: &ObjectPath,
) -> Result<Option<LockHolder>, object_store::Error> {
    let body = match store.get(path).await {
        Ok(existing) => existing.bytes().await?,
        Err(object_store::Error::NotFound { .. }) => return Ok(None),
        Err(error) => return Err(error),
    };
    Ok(LockHolder::parse(&body).ok())
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
/// [`release_locks`].
pub struct DiskLock {
    runtime: tokio::runtime::Handle,
    store: Arc<AmazonS3>,
    key: String,
    holder: LockHolder,
    /// True once released (or given up), so a release happens at most once.
    released: Mutex<bool>,
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
        let acquired = Self::take(runtime, store.clone(), url).await?;
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

    /// Takes the lock (see [`DiskLock::acquire`]) without checking the store.
    async fn take(
        runtime: tokio::runtime::Handle,
        store: Arc<AmazonS3>,
        url: &S3Url,
    ) -> Result<Acquired, OpenError> {
        let key = url.key(LOCK_NAME);
        let path = ObjectPath::from(key.as_str());
        let holder = LockHolder::of_this_process();
        let request_error = |operation: &str, error: object_store::Error| OpenError::Request {
            url: url.to_string(),
            operation: format!("{operation} `{key}`"),
            message: chain(&error),
        };
        // A lock deleted between our failed create and our read is retried a few times.
        for _ in 0..3 {
            let created = store
                .put_opts(
                    &path,
                    PutPayload::from(holder.to_json()),
                    PutOptions {
                        mode: PutMode::Create,
                        ..Default::default()
                    },
                )
                .await;
            match created {
                Ok(_) => return Ok(DiskLock::held(runtime, store, key, holder)),
                // S3 checks permissions before the condition: a 403 says nothing of whether
                // the lock exists.
                Err(error @ object_store::Error::PermissionDenied { .. }) => {
                    return Ok(Acquired::WritesRefused(refusal_summary(&error)))
                }
                Err(object_store::Error::AlreadyExists { .. })
                | Err(object_store::Error::Precondition { .. }) => {}
                Err(error) => return Err(request_error("creating the lock", error)),
            }
            let existing = match store.get(&path).await {
                Ok(existing) => existing,
                Err(object_store::Error::NotFound { .. }) => continue,
                Err(error) => return Err(request_error("reading the lock", error)),
            };
            let e_tag = existing.meta.e_tag.clone();
            let body = existing
                .bytes()
                .await
                .map_err(|error| request_error("reading the lock", error))?;
            let stale = LockHolder::parse(&body).map_err(|reason| OpenError::BadLock {
                url: url.to_string(),
                key: key.clone(),
                reason,
            })?;
            if stale.id == holder.id {
                tracing::info!(lock = %key, "the lock's create was carried out though its answer was lost");
                return Ok(DiskLock::held(runtime, store, key, holder));
            }
            if url.break_lock.as_deref() != Some(stale.id.as_str()) {
                return Err(OpenError::Locked {
                    url: url.to_string(),
                    key: key.clone(),
                    holder: stale.to_string(),
                    id: stale.id,
                    asked: url.break_lock.clone(),
                });
            }
            let broken = store
                .put_opts(
                    &path,
                    PutPayload::from(holder.to_json()),
                    PutOptions {
                        mode: PutMode::Update(UpdateVersion {
                            e_tag,
                            version: None,
                        }),
                        ..Default::default()
                    },
                )
                .await;
            return match broken {
                Ok(_) => {
                    tracing::warn!(disk = %url, broken = %stale, "broke the stale disk lock");
                    Ok(DiskLock::held(runtime, store, key, holder))
                }
                // Our own break carried out with its answer lost (the retry then failed its
                // condition), or someone else broke or released it first.
                Err(object_store::Error::Precondition { .. })
                | Err(object_store::Error::NotFound { .. }) => {
                    let now = read_holder(&store, &path).await;
                    if now.is_ok_and(|now| now.as_ref() == Some(&holder)) {
                        tracing::warn!(disk = %url, broken = %stale, "broke the stale disk lock (its answer was lost)");
                        return Ok(DiskLock::held(runtime, store, key, holder));
                    }
                    Err(OpenError::LockRaced {
                        url: url.to_string(),
                        key: key.clone(),
                    })
                }
                Err(error @ object_store::Error::PermissionDenied { .. }) => {
                    Ok(Acquired::WritesRefused(refusal_summary(&error)))
                }
                Err(error) => Err(request_error("breaking the lock", error)),
            };
        }
        Err(OpenError::LockRaced {
            url: url.to_string(),
            key,
        })
    }

    fn held(
        runtime: tokio::runtime::Handle,
        store: Arc<AmazonS3>,
        key: String,
        holder: LockHolder,
    ) -> Acquired {
        tracing::info!(lock = %key, holder = %holder, "took the disk lock");
        let lock = Arc::new(DiskLock {
            runtime,
            store,
            key,
            holder,
            released: Mutex::new(false),
        });
        let mut held = HELD.lock().unwrap();
        held.retain(|weak| weak.strong_count() > 0);
        held.push(Arc::downgrade(&lock));
        Acquired::Held(lock)
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
        let holder = LockHolder::of_this_process();
        assert_eq!(LockHolder::parse(&holder.to_json()).unwrap(), holder);
        assert_eq!(holder.pid, u64::from(std::process::id()));
        assert_ne!(LockHolder::of_this_process().id, holder.id);
        assert!(LockHolder::parse(b"{}").unwrap_err().contains("`id`"));
        assert!(LockHolder::parse(b"nope").unwrap_err().contains("JSON"));
    }
}
