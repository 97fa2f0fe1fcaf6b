//! The disk lock when the store's connection breaks (issue 46): a reset lock probe is
//! retried like any request, and one that keeps failing is an error, never a panic, with the
//! lock object not left behind. Against moto on loopback behind a fault proxy.

mod support;

use bufcache_s3::{LogStore, S3Url, LOCK_NAME};
use support::{have_moto, FaultProxy, Moto};

fn url(endpoint: &str, parameters: &str) -> S3Url {
    S3Url::parse(&format!(
        "s3://bucket/disk?endpoint={endpoint}&retry-timeout-ms=1000{parameters}"
    ))
    .unwrap()
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
    let proxy = FaultProxy::resetting(moto.port, LOCK_NAME, 1, 1);
    let store =
        LogStore::open_locked(&url(&proxy.endpoint(), "&create-size=1M&layout=log")).unwrap();
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
    let proxy = FaultProxy::resetting(moto.port, LOCK_NAME, 1, 1000);
    let error = LogStore::open_locked(&url(&proxy.endpoint(), "&create-size=1M&layout=log"))
        .err()
        .expect("a probe reset every time fails the open");
    let text = error.to_string();
    assert!(text.contains("second create"), "{text}");
    assert!(proxy.faults().len() > 1, "retried: {:?}", proxy.faults());
    let store = LogStore::open_locked(&url(&moto.endpoint(), "")).unwrap();
    store.write(&[1; 4096], 0).unwrap();
    store.flush().unwrap();
}
