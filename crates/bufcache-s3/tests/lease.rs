//! The lease on the disk lock against real S3 servers (moto and SeaweedFS on loopback): a
//! writer that cannot renew stops acknowledging writes and FLUSHes before a second server may
//! take the disk, that second server takes a lapsed lease without `break-lock=`, a renewed
//! lease is refused, and a lease shorter than the store's round trips is refused at open.

mod support;

use std::time::{Duration, Instant};

use bufcache_s3::lease::LeaseError;
use bufcache_s3::{LogStore, OpenError, S3Url, StoreError};
use support::{have_moto, have_seaweedfs, DelayProxy, Moto, Proxy, S3Server, SeaweedFs};

const LEASE_MS: u64 = 1_500;

fn open(endpoint: &str, parameters: &str) -> Result<LogStore, OpenError> {
    LogStore::open_locked(
        &S3Url::parse(&format!(
            "s3://bucket/disk?endpoint={endpoint}&gc=off&lease={}{parameters}",
            LEASE_MS as f64 / 1000.0
        ))
        .unwrap(),
    )
}

fn read_at(store: &LogStore, offset: u64) -> Vec<u8> {
    let mut back = vec![0u8; 4096];
    store.read(&mut back, offset).unwrap();
    back
}

fn lease_error(result: Result<(), StoreError>) -> LeaseError {
    match result {
        Err(StoreError::Lease { error, .. }) => error,
        other => panic!("expected a lease error, got {other:?}"),
    }
}

fn cut_off_writer_then_take_over(server: &dyn S3Server, port: u16) {
    server.create_bucket("bucket");
    let direct = server.endpoint();
    let proxy = Proxy::start(port);
    // The first writer reaches the store only through the proxy; its requests give up fast,
    // so its flushes answer while the proxy is down.
    let first = open(
        &proxy.endpoint(),
        "&create-size=1M&layout=log&retry-timeout-ms=300",
    )
    .unwrap();
    first.write(&[1u8; 4096], 0).unwrap();
    first.flush().unwrap();

    // While the first renews, a second open is refused, naming the live holder, within about
    // a third of the lease plus a poll.
    let started = Instant::now();
    let refused = open(&direct, "").err().expect("a renewed lease is refused");
    assert!(matches!(refused, OpenError::LeaseHeld { .. }), "{refused}");
    assert!(refused.to_string().contains("in use by"), "{refused}");
    assert!(
        started.elapsed() < Duration::from_millis(LEASE_MS),
        "{:?}",
        started.elapsed()
    );

    // Cut the first writer off: within the lease less its margin it stops acknowledging.
    proxy.set_down(true);
    let cut = Instant::now();
    first.write(&[2u8; 4096], 4096).unwrap_or(());
    let lapsed = loop {
        match first.check_lease() {
            Err(StoreError::Lease { error, .. }) => break error,
            _ => {
                assert!(
                    cut.elapsed() < Duration::from_millis(LEASE_MS),
                    "still acknowledging"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    };
    assert!(matches!(lapsed, LeaseError::Lapsed { .. }), "{lapsed}");
    assert!(first.flush().is_err());
    assert!(matches!(
        lease_error(first.write(&[3u8; 4096], 8192)),
        LeaseError::Lapsed { .. }
    ));

    // A second server takes the lapsed lease without break-lock=, after watching the lock
    // unchanged for a whole lease; by then the first has stopped acknowledging.
    let watching = Instant::now();
    let second = open(&direct, "").expect("a lapsed lease is taken");
    assert!(watching.elapsed() >= Duration::from_millis(LEASE_MS));
    assert!(first.check_lease().is_err());
    assert_eq!(read_at(&second, 0), vec![1u8; 4096]);
    second.write(&[4u8; 4096], 4096).unwrap();
    second.flush().unwrap();

    // The first server reaches the store again: its next renewal finds the lock taken, and
    // it never acknowledges again.
    proxy.set_down(false);
    let back = Instant::now();
    loop {
        match first.check_lease() {
            Err(StoreError::Lease {
                error: LeaseError::TakenOver { .. },
                ..
            }) => break,
            Err(_) => {
                assert!(
                    back.elapsed() < Duration::from_secs(10),
                    "the takeover was never noticed"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
            Ok(()) => panic!("a writer whose lock was taken over acknowledges again"),
        }
    }
    assert!(first.flush().is_err());
    drop(first);
    assert_eq!(read_at(&second, 4096), vec![4u8; 4096]);
    drop(second);

    // Reopened after the second's clean close: its write and the first's flushed one, and
    // nothing the first wrote after it lost its lease.
    let third = open(&direct, "").unwrap();
    assert_eq!(read_at(&third, 0), vec![1u8; 4096]);
    assert_eq!(read_at(&third, 4096), vec![4u8; 4096]);
    assert_eq!(read_at(&third, 8192), vec![0u8; 4096]);
}

// Goal: no two servers ever acknowledge writes to one disk, and a dead writer's disk is taken
// without a person. Method: a writer behind a proxy on moto, lease 1.5 s; a second open while
// it renews is refused; the proxy goes down and the writer's lease check, writes and flushes
// fail before the second open (which waits a whole lease) takes the disk; the proxy comes back
// and the first learns it was taken over; a third open reads only what was flushed.
#[test]
fn writer_cut_off_from_the_store_stops_before_a_second_server_takes_over() {
    if have_moto("writer_cut_off_from_the_store_stops_before_a_second_server_takes_over") {
        let moto = Moto::start();
        cut_off_writer_then_take_over(&moto, moto.port);
    }
}

// Goal: SeaweedFS 4.48 carries out the lease's conditional PUTs (If-Match on the lock's
// ETag) as moto does. Method: the moto test's body on SeaweedFS.
#[test]
fn writer_cut_off_from_the_store_stops_before_a_second_server_takes_over_on_seaweedfs() {
    let name = "writer_cut_off_from_the_store_stops_before_a_second_server_takes_over_on_seaweedfs";
    if have_seaweedfs(name) {
        let weed = SeaweedFs::start();
        cut_off_writer_then_take_over(&weed, weed.port);
    }
}

// Goal: a lease the server could not renew in time is refused at open, with the measured
// round trip, and nothing is left locked. Method: a proxy that holds each request 200 ms in
// front of moto; lease=1 (under ten round trips) is refused; lease=5 then opens.
#[test]
fn a_lease_shorter_than_ten_store_round_trips_is_refused() {
    if !have_moto("a_lease_shorter_than_ten_store_round_trips_is_refused") {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let slow = DelayProxy::start(moto.port, Duration::from_millis(200));
    let url = |lease: &str| {
        S3Url::parse(&format!(
            "s3://bucket/disk?endpoint={}&gc=off&create-size=1M&layout=log&lease={lease}",
            slow.endpoint()
        ))
        .unwrap()
    };
    let refused = LogStore::open_locked(&url("1")).err().expect("refused");
    assert!(
        matches!(refused, OpenError::LeaseTooShort { .. }),
        "{refused}"
    );
    assert!(refused.to_string().contains("round trips"), "{refused}");
    let opened = LogStore::open_locked(&url("5")).expect("a lease of 25 round trips opens");
    drop(opened);
}
