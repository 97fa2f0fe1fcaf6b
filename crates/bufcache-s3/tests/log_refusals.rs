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

/// How the newest checkpoint is lost.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Loss {
    /// Its object deleted.
    Deleted,
    /// One byte of its object flipped.
    Damaged,
    /// It and its predecessor deleted.
    BothDeleted,
}

fn url_at(endpoint: &str, disk: &str, parameters: &str) -> S3Url {
    S3Url::parse(&format!(
        "s3://bucket/{disk}?endpoint={endpoint}{parameters}"
    ))
    .unwrap()
}

/// Writes a disk `disk` whose collector ran and whose early segments are gone: 60 flushes of
/// 48 KiB at 8 places of 1 MiB with 64 KiB segments (a checkpoint every 16) and a
/// collection round every 10 flushes, then a clean close. Returns the disk's image.
fn collected_disk(endpoint: &str, disk: &str, rng: &mut rand::rngs::StdRng) -> Vec<u8> {
    let store = LogStore::open_locked(&url_at(
        endpoint,
        disk,
        "&create-size=1M&layout=log&segment-size=64k&gc=off",
    ))
    .unwrap();
    let mut expected = vec![0u8; 1 << 20];
    for flush in 0..60usize {
        let data = random(48 << 10, rng);
        let offset = (flush * 7 % 8) << 17;
        store.write(&data, offset as u64).unwrap();
        expected[offset..offset + data.len()].copy_from_slice(&data);
        store.flush().unwrap();
        if flush % 10 == 9 {
            store.collect_garbage(0.9).unwrap();
        }
    }
    assert!(
        store.gc_totals().segments_deleted > 0,
        "{:?}",
        store.gc_totals()
    );
    drop(store);
    expected
}

// Goal: losing the newest checkpoint of a disk whose collector ran (deleted, or damaged)
// loses no flushed write and deletes nothing: the open falls back to the previous
// checkpoint, kept with every segment it needs, and replays the segments after it; losing
// both newest is refused naming a checkpoint, deleting nothing. Method: three disks as
// `collected_disk` writes them; delete or flip a byte of the newest checkpoint of two and
// delete both of the third; open read-only and writable, compare every byte, count the
// segments and (on moto) the DELETE requests; close and open once more.
#[test]
fn a_lost_newest_checkpoint_falls_back_to_the_previous_one_and_loses_nothing() {
    let name = "a_lost_newest_checkpoint_falls_back_to_the_previous_one_and_loses_nothing";
    if have_moto(name) {
        let moto = Moto::start();
        a_lost_checkpoint_falls_back(&moto, Some(&|| moto.request_count("DELETE")));
    }
}

#[test]
fn a_lost_newest_checkpoint_falls_back_to_the_previous_one_and_loses_nothing_on_seaweedfs() {
    let name =
        "a_lost_newest_checkpoint_falls_back_to_the_previous_one_and_loses_nothing_on_seaweedfs";
    if have_seaweedfs(name) {
        a_lost_checkpoint_falls_back(&SeaweedFs::start(), None);
    }
}

/// The fallback test on `server`; `deletes` counts the DELETE requests the store answered,
/// where it keeps a request log (moto).
fn a_lost_checkpoint_falls_back(server: &dyn S3Server, deletes: Option<&dyn Fn() -> usize>) {
    server.create_bucket("bucket");
    let raw = Raw::new(server);
    let endpoint = server.endpoint();
    let mut rng = rand::rngs::StdRng::seed_from_u64(46);
    for (at, loss) in [Loss::Deleted, Loss::Damaged, Loss::BothDeleted]
        .into_iter()
        .enumerate()
    {
        let disk = format!("disk{at}");
        let expected = collected_disk(&endpoint, &disk, &mut rng);
        let segments = raw.objects(&format!("{disk}/log/segments"));
        let checkpoints = raw.keys(&format!("{disk}/log/checkpoints"));
        assert_eq!(
            checkpoints.len(),
            2,
            "the newest and its predecessor: {checkpoints:?}"
        );
        let newest = checkpoints[1].clone();
        match loss {
            Loss::Deleted => raw.delete(&newest),
            Loss::Damaged => {
                let mut body = raw.get(&newest);
                let middle = body.len() / 2;
                body[middle] ^= 0x10;
                raw.put(&newest, body);
            }
            Loss::BothDeleted => {
                raw.delete(&checkpoints[0]);
                raw.delete(&newest);
            }
        }
        let deletes_before = deletes.map(|count| count());
        if loss == Loss::BothDeleted {
            let missing = lost(
                LogStore::open_locked(&url_at(&endpoint, &disk, ""))
                    .err()
                    .expect("refused"),
            );
            assert!(
                missing
                    .iter()
                    .all(|key| key.starts_with(&format!("{disk}/log/checkpoints/"))),
                "{missing:?}"
            );
            let missing = lost(
                LogStore::open_read_only(&url_at(&endpoint, &disk, ""))
                    .err()
                    .expect("refused read-only too"),
            );
            assert!(!missing.is_empty());
            assert_eq!(
                raw.objects(&format!("{disk}/log/segments")),
                segments,
                "nothing deleted"
            );
            if let (Some(count), Some(before)) = (deletes, deletes_before) {
                assert_eq!(
                    count(),
                    before + 1,
                    "no DELETE but the refused open's lock release"
                );
            }
            continue;
        }
        let reader = LogStore::open_read_only(&url_at(&endpoint, &disk, "")).unwrap();
        assert!(
            read_all(&reader, 1 << 20) == expected,
            "{loss:?}: read-only, every flushed write"
        );
        drop(reader);
        let store = LogStore::open_locked(&url_at(&endpoint, &disk, "")).unwrap();
        assert!(
            read_all(&store, 1 << 20) == expected,
            "{loss:?}: every flushed write"
        );
        assert_eq!(
            raw.objects(&format!("{disk}/log/segments")),
            segments,
            "{loss:?}: no segment deleted"
        );
        if let (Some(count), Some(before)) = (deletes, deletes_before) {
            // The damaged checkpoint is deleted (it is stale); no segment is.
            let stale = usize::from(loss == Loss::Damaged);
            assert_eq!(count(), before + stale, "{loss:?}: no other DELETE");
        }
        // Closed, the disk has a new newest checkpoint and opens as it was.
        drop(store);
        let store = LogStore::open_locked(&url_at(&endpoint, &disk, "")).unwrap();
        assert!(
            read_all(&store, 1 << 20) == expected,
            "{loss:?}: after a close"
        );
        drop(store);
    }
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
