//! The disk lock when the store's answers are lost (issue 46): a reset lock probe is an error,
//! never a panic, and the lock object does not stay behind. Against moto on loopback behind
//! a fault proxy.

mod support;

use bufcache_s3::{LogStore, S3Url, LOCK_NAME};
use support::{have_moto, FaultProxy, Moto};

// Goal: a connection reset on the lock probe (the second create-only PUT, which checks that
// the store refuses it) ends the open with an error naming the probe, not a panic from
// releasing the lock inside async code, and the lock is released: the next open needs no
// break-lock. Method: a fault proxy in front of moto lets the lock's first PUT through and
// resets the second; open a log disk through it, then open directly.
#[test]
fn a_reset_lock_probe_is_an_error_and_releases_the_lock() {
    let name = "a_reset_lock_probe_is_an_error_and_releases_the_lock";
    if !have_moto(name) {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let proxy = FaultProxy::resetting(moto.port, LOCK_NAME, 1, 1);
    let url = |endpoint: &str, parameters: &str| {
        S3Url::parse(&format!(
            "s3://bucket/disk?endpoint={endpoint}&retry-timeout-ms=1000{parameters}"
        ))
        .unwrap()
    };
    let error = LogStore::open_locked(&url(&proxy.endpoint(), "&create-size=1M&layout=log"))
        .err()
        .expect("a reset probe fails the open");
    let text = error.to_string();
    assert!(text.contains("second create"), "{text}");
    assert_eq!(proxy.faults().len(), 1, "{:?}", proxy.faults());
    let store = LogStore::open_locked(&url(&moto.endpoint(), "")).unwrap();
    store.write(&[1; 4096], 0).unwrap();
    store.flush().unwrap();
}
