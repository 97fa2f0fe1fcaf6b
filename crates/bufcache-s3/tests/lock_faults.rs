//! The disk lock when the store's connection breaks (issue 46): a reset lock probe is
//! retried like any request, and one that keeps failing is an error, never a panic, with the
//! lock object not left behind. Against moto on loopback behind a fault proxy.

#[path = "support/raw.rs"]
mod raw;
mod support;

use bufcache_s3::{LogStore, S3Url, LOCK_NAME};
use support::{have_moto, FaultProxy, Moto};

fn url(endpoint: &str, parameters: &str) -> S3Url {
    S3Url::parse(&format!("s3://bucket/disk?endpoint={endpoint}{parameters}")).unwrap()
}

// Goal: a connection reset on the lock probe (the second create-only PUT, which checks that
// the store refuses it) is retried: a create-only PUT is safe to repeat (the repeat fails its
// condition, as the probe expects). Method: a fault proxy in front of moto lets the lock's
// first PUT through and resets the second once; open a log disk through it: it opens, and
// the proxy reset one request.
#[test]
fn a_reset_lock_probe_is_retried() {
    let name = "a_reset_lock_probe_is_retried";
    if !have_moto(name) {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let proxy = FaultProxy::resetting(moto.port, LOCK_NAME, 1, 1, false);
    let store = LogStore::open_locked(&url(
        &proxy.endpoint(),
        "&create-size=1M&layout=log&retry-timeout-ms=1000",
    ))
    .unwrap();
    assert_eq!(proxy.faults().len(), 1, "{:?}", proxy.faults());
    store.write(&[1; 4096], 0).unwrap();
    store.flush().unwrap();
}

// Goal: a lock probe whose connection is reset until the retry timeout ends the open with an
// error naming the probe, not a panic from releasing the lock inside async code, and the
// lock is released: the next open needs no break-lock. Method: a fault proxy in front of
// moto lets the lock's first PUT through and resets every later one; open a log disk
// through it with a 1 s retry timeout, then open directly.
#[test]
fn a_lock_probe_reset_until_the_timeout_is_an_error_and_releases_the_lock() {
    let name = "a_lock_probe_reset_until_the_timeout_is_an_error_and_releases_the_lock";
    if !have_moto(name) {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let proxy = FaultProxy::resetting(moto.port, LOCK_NAME, 1, 1000, false);
    let error = LogStore::open_locked(&url(
        &proxy.endpoint(),
        "&create-size=1M&layout=log&retry-timeout-ms=1000",
    ))
    .err()
    .expect("a probe reset every time fails the open");
    let text = error.to_string();
    assert!(text.contains("second create"), "{text}");
    assert!(proxy.faults().len() > 1, "retried: {:?}", proxy.faults());
    let store = LogStore::open_locked(&url(&moto.endpoint(), "")).unwrap();
    store.write(&[1; 4096], 0).unwrap();
    store.flush().unwrap();
}

// Goal: an open whose cleanup DELETEs have their connections reset is retried through, not
// failed (a DELETE is safe to repeat; the lock's PUTs are covered above). Method: 40 flushes
// over one range with 64 KiB segments (checkpoints at the 16th and the 32nd), the store
// abandoned; an open through a fault proxy that carries out and then resets the first 5
// DELETEs of the dead segments: it opens, reads the last write, and the segments no kept
// checkpoint needs are gone.
#[test]
fn an_open_whose_cleanup_deletes_are_reset_is_retried_through() {
    let name = "an_open_whose_cleanup_deletes_are_reset_is_retried_through";
    if !have_moto(name) {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let mut store = LogStore::open_locked(&url(
        &moto.endpoint(),
        "&create-size=1M&layout=log&segment-size=64k&gc=off",
    ))
    .unwrap();
    let mut last = Vec::new();
    for round in 0..40u8 {
        last = vec![round; 48 << 10];
        store.write(&last, 0).unwrap();
        store.flush().unwrap();
    }
    store.stop_gc();
    let id = store.lock().unwrap().holder().id.clone();
    std::mem::forget(store);
    // The keys of epoch 1's segments and checkpoints: at this open, only DELETEs.
    let proxy = FaultProxy::resetting(moto.port, "-0000000000000001", 0, 5, true);
    let reopened = LogStore::open_locked(&url(
        &proxy.endpoint(),
        &format!("&segment-size=64k&gc=off&break-lock={id}&retry-timeout-ms=20000"),
    ))
    .unwrap();
    let faults = proxy.faults();
    assert_eq!(faults.len(), 5, "{faults:?}");
    assert!(
        faults.iter().all(|fault| fault.starts_with("DELETE")),
        "{faults:?}"
    );
    let mut back = vec![0u8; 48 << 10];
    reopened.read(&mut back, 0).unwrap();
    assert!(back == last);
    let raw = raw::Raw::new(&moto);
    let segments = raw.keys("disk/log/segments");
    assert_eq!(
        segments.len(),
        25,
        "16 (the kept checkpoint names it) to 40 stay: {segments:?}"
    );
}
