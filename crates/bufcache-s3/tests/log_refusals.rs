//! What an open of a log-layout disk refuses (issue 46): objects that durable records prove
//! were stored and are missing stop the open, naming them, and nothing is deleted or served;
//! `recover-prefix=on` opens the disk anyway. Against moto and SeaweedFS on loopback, the
//! objects removed through the bucket directly.

#[path = "support/fixtures.rs"]
mod fixtures;
#[path = "support/raw.rs"]
mod raw;
mod support;

use bufcache_s3::{LogStore, OpenError, S3Url};
use fixtures::random;
use rand::SeedableRng;
use raw::Raw;
use support::{have_moto, have_seaweedfs, Moto, S3Server, SeaweedFs};

fn url(endpoint: &str, parameters: &str) -> S3Url {
    S3Url::parse(&format!("s3://bucket/disk?endpoint={endpoint}{parameters}")).unwrap()
}

fn open(endpoint: &str, parameters: &str) -> Result<LogStore, OpenError> {
    LogStore::open_locked(&url(endpoint, parameters))
}

fn read_all(store: &LogStore, size: usize) -> Vec<u8> {
    let mut back = vec![0u8; size];
    store.read(&mut back, 0).unwrap();
    back
}

/// The lock id of a store that is then abandoned as a crashed server would leave it.
fn crash(mut store: LogStore) -> String {
    store.stop_gc();
    let id = store.lock().unwrap().holder().id.clone();
    // No close: no final checkpoint, no lock release, as after kill -9.
    std::mem::forget(store);
    id
}

/// The missing objects a refusal names; panics (with the error) when it is another error.
fn lost(error: OpenError) -> Vec<String> {
    match error {
        OpenError::LostObjects { missing, .. } => missing,
        other => panic!("expected LostObjects, got: {other}"),
    }
}

// Goal: deleting the newest checkpoint of a disk whose early segments were collected never
// empties it: a writable and a read-only open are refused naming a checkpoint, no segment is
// deleted, and with the checkpoint put back the disk reads as before; only recover-prefix=on
// opens it without. Method: 20 flushes of 64 KiB over one range with 64 KiB segments (a
// checkpoint at the 16th flush; the clean close writes the final one and deletes the 19
// dead segments), delete the only checkpoint, open three ways and count segments.
#[test]
fn a_deleted_newest_checkpoint_is_refused_and_deletes_nothing() {
    let name = "a_deleted_newest_checkpoint_is_refused_and_deletes_nothing";
    if have_moto(name) {
        let moto = Moto::start();
        a_deleted_checkpoint_is_refused(&moto, Some(&|| moto.request_count("DELETE")));
    }
}

#[test]
fn a_deleted_newest_checkpoint_is_refused_and_deletes_nothing_on_seaweedfs() {
    let name = "a_deleted_newest_checkpoint_is_refused_and_deletes_nothing_on_seaweedfs";
    if have_seaweedfs(name) {
        a_deleted_checkpoint_is_refused(&SeaweedFs::start(), None);
    }
}

/// The checkpoint test on `server`; `deletes` counts the DELETE requests the store answered,
/// where it keeps a request log (moto).
fn a_deleted_checkpoint_is_refused(server: &dyn S3Server, deletes: Option<&dyn Fn() -> usize>) {
    server.create_bucket("bucket");
    let raw = Raw::new(server);
    let endpoint = server.endpoint();
    let mut rng = rand::rngs::StdRng::seed_from_u64(46);
    let store = open(
        &endpoint,
        "&create-size=1M&layout=log&segment-size=64k&gc=off",
    )
    .unwrap();
    let mut last = Vec::new();
    for _ in 0..20 {
        last = random(48 << 10, &mut rng);
        store.write(&last, 0).unwrap();
        store.flush().unwrap();
    }
    drop(store);
    let segments = raw.objects("disk/log/segments");
    assert_eq!(
        segments.len(),
        1,
        "the dead segments were collected: {segments:?}"
    );
    let checkpoints = raw.objects("disk/log/checkpoints");
    assert_eq!(checkpoints.len(), 1, "{checkpoints:?}");
    let (checkpoint, _) = checkpoints[0].clone();
    let saved = raw.get(&checkpoint);
    raw.delete(&checkpoint);
    let deletes_before = deletes.map(|count| count());
    let missing = lost(open(&endpoint, "").err().expect("refused"));
    assert!(
        missing.len() == 1 && missing[0].starts_with("disk/log/checkpoints/"),
        "{missing:?}"
    );
    let missing = lost(
        LogStore::open_read_only(&url(&endpoint, ""))
            .err()
            .expect("refused read-only too"),
    );
    assert!(
        missing[0].starts_with("disk/log/checkpoints/"),
        "{missing:?}"
    );
    assert_eq!(
        raw.objects("disk/log/segments"),
        segments,
        "nothing deleted"
    );
    if let (Some(count), Some(before)) = (deletes, deletes_before) {
        assert_eq!(
            count(),
            before + 1,
            "no DELETE but the refused writable open's release of its lock"
        );
    }
    assert_eq!(
        raw.objects("disk/log/checkpoints"),
        vec![],
        "nothing written"
    );
    // Put back, the checkpoint opens the disk as it was.
    raw.put(&checkpoint, saved);
    let reopened = open(&endpoint, "").unwrap();
    assert!(read_all(&reopened, 48 << 10) == last);
    drop(reopened);
    // The operator's way: the prefix that is left (nothing, without a checkpoint).
    for (key, _) in raw.objects("disk/log/checkpoints") {
        raw.delete(&key);
    }
    let recovered = open(&endpoint, "&recover-prefix=on").unwrap();
    assert_eq!(recovered.mapped_bytes(), 0);
}

// Goal: a missing first segment after the newest checkpoint, with later segments sealed once
// it was stored, is a loss, not a crash: a writable and a read-only open are refused naming
// it, no segment is deleted, and put back the disk reads every flushed write; with
// recover-prefix=on the disk opens as the checkpoint's prefix. Method: A written and the
// store closed (checkpoint), reopened, B, C and D flushed one segment each, the store
// abandoned; B's segment deleted through the bucket; open, count segments, restore.
#[test]
fn a_deleted_first_segment_after_the_checkpoint_is_refused_and_deletes_nothing() {
    let name = "a_deleted_first_segment_after_the_checkpoint_is_refused_and_deletes_nothing";
    if have_moto(name) {
        a_deleted_first_segment_is_refused(&Moto::start());
    }
}

#[test]
fn a_deleted_first_segment_after_the_checkpoint_is_refused_and_deletes_nothing_on_seaweedfs() {
    let name =
        "a_deleted_first_segment_after_the_checkpoint_is_refused_and_deletes_nothing_on_seaweedfs";
    if have_seaweedfs(name) {
        a_deleted_first_segment_is_refused(&SeaweedFs::start());
    }
}

fn a_deleted_first_segment_is_refused(server: &dyn S3Server) {
    server.create_bucket("bucket");
    let raw = Raw::new(server);
    let endpoint = server.endpoint();
    let mut rng = rand::rngs::StdRng::seed_from_u64(47);
    let parameters = "&segment-size=64k&gc=off";
    let store = open(
        &endpoint,
        &format!("&create-size=1M&layout=log{parameters}"),
    )
    .unwrap();
    let mut expected = vec![0u8; 256 << 10];
    let a = random(48 << 10, &mut rng);
    store.write(&a, 0).unwrap();
    expected[..a.len()].copy_from_slice(&a);
    drop(store);
    let store = open(&endpoint, parameters).unwrap();
    for part in 1..4usize {
        let data = random(48 << 10, &mut rng);
        store.write(&data, (part << 16) as u64).unwrap();
        store.flush().unwrap();
        expected[part << 16..(part << 16) + data.len()].copy_from_slice(&data);
    }
    let id = crash(store);
    let segments = raw.objects("disk/log/segments");
    assert_eq!(segments.len(), 4, "{segments:?}");
    let (first_after, _) = segments[1].clone();
    let saved = raw.get(&first_after);
    raw.delete(&first_after);
    let left = raw.objects("disk/log/segments");
    let breaking = format!("{parameters}&break-lock={id}");
    let missing = lost(open(&endpoint, &breaking).err().expect("refused"));
    assert_eq!(missing, std::slice::from_ref(&first_after));
    let missing = lost(
        LogStore::open_read_only(&url(&endpoint, &breaking))
            .err()
            .expect("refused read-only too"),
    );
    assert_eq!(missing, std::slice::from_ref(&first_after));
    assert_eq!(raw.objects("disk/log/segments"), left, "nothing deleted");
    raw.put(&first_after, saved);
    let reopened = open(&endpoint, &breaking).unwrap();
    assert!(
        read_all(&reopened, 256 << 10) == expected,
        "every flushed write"
    );
    let id = crash(reopened);
    raw.delete(&first_after);
    let recovered = open(
        &endpoint,
        &format!("{parameters}&break-lock={id}&recover-prefix=on"),
    )
    .unwrap();
    let image = read_all(&recovered, 256 << 10);
    assert!(image[..a.len()] == a[..], "the checkpoint's prefix");
    assert!(image[64 << 10..].iter().all(|&byte| byte == 0));
}
