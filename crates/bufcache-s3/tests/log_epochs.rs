//! The log layout's epoch objects and checkpoint format version 2 against a real S3 server
//! (moto on loopback): epoch objects stay few however often the disk is opened, a disk whose
//! checkpoint is version 1 opens and is upgraded by its first checkpoint, and a crash between
//! a checkpoint and the deletes of the epoch objects it made unneeded is harmless.

#[path = "support/raw.rs"]
mod raw;
mod support;

use bufcache_s3::{LogStore, OpenError, S3Url};
use raw::Raw;
use support::{have_moto, Moto, RefuseProxy};

const DISK_BYTES: usize = 1 << 20;

fn open(endpoint: &str, parameters: &str) -> Result<LogStore, OpenError> {
    LogStore::open_locked(
        &S3Url::parse(&format!(
            "s3://bucket/disk?endpoint={endpoint}&gc=off{parameters}"
        ))
        .unwrap(),
    )
}

fn read_all(store: &LogStore) -> Vec<u8> {
    let mut back = vec![0u8; DISK_BYTES];
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

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap())
}

/// A version 2 checkpoint (docs/s3.md): (through, (epoch, start) pairs it records, format
/// version 1 body of the same index).
fn checkpoint_as_v1(v2: &[u8]) -> (u64, Vec<(u64, u64)>, Vec<u8>) {
    assert_eq!(&v2[..8], b"BCLOGCKP");
    assert_eq!(u32::from_le_bytes(v2[8..12].try_into().unwrap()), 2);
    let disk_id = u64_at(v2, 16);
    let through = u64_at(v2, 24);
    let epoch_count = u64_at(v2, 40) as usize;
    let mapping_count = u64_at(v2, 48);
    let epochs = (0..epoch_count)
        .map(|at| (u64_at(v2, 56 + 16 * at), u64_at(v2, 64 + 16 * at)))
        .collect();
    let mappings = &v2[56 + 16 * epoch_count..v2.len() - 4];
    let mut v1 = Vec::new();
    v1.extend_from_slice(b"BCLOGCKP");
    v1.extend_from_slice(&1u32.to_le_bytes());
    v1.extend_from_slice(&0u32.to_le_bytes());
    v1.extend_from_slice(&disk_id.to_le_bytes());
    v1.extend_from_slice(&through.to_le_bytes());
    v1.extend_from_slice(&mapping_count.to_le_bytes());
    v1.extend_from_slice(mappings);
    let checksum = crc32fast::hash(&v1);
    v1.extend_from_slice(&checksum.to_le_bytes());
    (through, epochs, v1)
}

/// An epoch object (docs/s3.md) of `disk_id`.
fn epoch_object(disk_id: u64, epoch: u64, start: u64) -> Vec<u8> {
    let mut object = Vec::new();
    object.extend_from_slice(b"BCLOGEPO");
    object.extend_from_slice(&1u32.to_le_bytes());
    object.extend_from_slice(&0u32.to_le_bytes());
    object.extend_from_slice(&disk_id.to_le_bytes());
    object.extend_from_slice(&epoch.to_le_bytes());
    object.extend_from_slice(&start.to_le_bytes());
    let checksum = crc32fast::hash(&object);
    object.extend_from_slice(&checksum.to_le_bytes());
    object
}

// Goal: epoch objects do not accumulate, one per open, while the data of every open stays
// readable, though its segments are named after epochs whose objects are gone. Method: 12
// open cycles, each writing a 4 KiB block of its own that stays live (so the checkpoint must
// record a dozen epochs), flushing, and then closing or (every third cycle) crashing; after
// each open, the bucket holds at most 2 epoch objects plus one per crash since the last
// close, after each close exactly one, every open after a close makes the same number of
// GETs (LISTs included) however many opens came before, and the whole disk reads back as the
// model.
#[test]
fn epoch_objects_stay_bounded_over_many_reopens_and_every_epochs_data_reads_back() {
    let name = "epoch_objects_stay_bounded_over_many_reopens_and_every_epochs_data_reads_back";
    if !have_moto(name) {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let raw = Raw::new(&moto);
    let mut expected = vec![0u8; DISK_BYTES];
    let mut lock_id: Option<String> = None;
    let mut crashes_since_close = 0;
    // Crashes between the two closes before the last one: their epoch objects stay while
    // the checkpoint of the earlier close is the kept predecessor.
    let mut crashes_kept = 0;
    let mut pruned = 0;
    let mut gets_after_close = Vec::new();
    for cycle in 0..12u8 {
        let mut parameters = String::new();
        if cycle == 0 {
            parameters.push_str("&create-size=1M&layout=log");
        }
        if let Some(id) = lock_id.take() {
            parameters.push_str(&format!("&break-lock={id}"));
        }
        let gets_before = moto.request_count("GET");
        let store = open(&moto.endpoint(), &parameters).unwrap();
        if crashes_since_close == 0 && cycle > 0 {
            // After a clean close an open GETs the same objects however many epochs came
            // before: no epoch object at all (the checkpoint records them).
            gets_after_close.push(moto.request_count("GET") - gets_before);
        }
        // The kept predecessor's writer's, the newest checkpoint's writer's, this open's,
        // and one per crash since the predecessor.
        let epochs = raw.keys("disk/log/epochs");
        assert!(
            epochs.len() <= 3 + crashes_since_close + crashes_kept,
            "cycle {cycle}, {crashes_since_close} crashes since the last close: {epochs:?}"
        );
        assert!(read_all(&store) == expected, "cycle {cycle}: data");
        let offset = usize::from(cycle) * 4096;
        store.write(&[cycle + 1; 4096], offset as u64).unwrap();
        expected[offset..offset + 4096].fill(cycle + 1);
        store.flush().unwrap();
        if cycle % 3 == 2 {
            pruned += store.epochs_pruned();
            lock_id = Some(crash(store));
            crashes_since_close += 1;
        } else {
            let mut store = store;
            store.close().unwrap();
            pruned += store.epochs_pruned();
            drop(store);
            // The newest checkpoint's writer's epoch object, its predecessor's, and those of
            // the servers that crashed between them (an open from the predecessor reads them).
            let epochs = raw.keys("disk/log/epochs");
            assert!(
                epochs.len() <= 2 + crashes_since_close,
                "cycle {cycle}: after a close: {epochs:?}"
            );
            crashes_kept = crashes_since_close;
            crashes_since_close = 0;
            let checkpoints = raw.keys("disk/log/checkpoints");
            assert!(
                (1..=2).contains(&checkpoints.len()),
                "cycle {cycle}: {checkpoints:?}"
            );
        }
    }
    assert!(pruned >= 8, "{pruned} epoch objects deleted over 12 opens");
    eprintln!("GETs of each open after a clean close: {gets_after_close:?}");
    assert!(gets_after_close[0] > 0, "{gets_after_close:?}");
    // (Equal; a spread of one allows for a request log line moto had not written yet. One
    // epoch object read per past open would spread them by 6 or more.)
    let fewest = gets_after_close.iter().min().unwrap();
    let most = gets_after_close.iter().max().unwrap();
    assert!(
        gets_after_close.len() >= 6 && most - fewest <= 1,
        "GETs of each open after a clean close: {gets_after_close:?}"
    );
    // The last checkpoint records the epochs of all the opens whose blocks are live.
    let checkpoint = raw.get(raw.keys("disk/log/checkpoints").last().unwrap());
    let (_, recorded, _) = checkpoint_as_v1(&checkpoint);
    assert!(recorded.len() >= 11, "{recorded:?}");
    // The last cycle crashed: its lock is broken.
    let id = lock_id.expect("cycle 11 crashed");
    let store = open(&moto.endpoint(), &format!("&break-lock={id}")).unwrap();
    assert!(read_all(&store) == expected, "after the last open");
}

// Goal: a disk written before checkpoint format 2 (a version 1 checkpoint named
// `<through>`, every epoch object kept) opens with all its data, and its first checkpoint
// upgrades it: a version 2 checkpoint named `<through>-<epoch>`, the version 1 one and the
// older epoch objects deleted. Method: write A in epoch 1 (crash) and B in epoch 2 (close),
// then rewrite the bucket as such a disk: the checkpoint re-encoded as version 1 under the
// plain name, the epoch objects put back; open, check, write C, close (the version 1
// checkpoint is kept as the predecessor); write D, close; check the bucket and read A to D
// back after another open.
#[test]
fn a_version_1_checkpoint_disk_opens_and_its_first_checkpoint_upgrades_it() {
    let name = "a_version_1_checkpoint_disk_opens_and_its_first_checkpoint_upgrades_it";
    if !have_moto(name) {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let raw = Raw::new(&moto);
    let store = open(&moto.endpoint(), "&create-size=1M&layout=log").unwrap();
    let disk_id = store.metadata().disk_id;
    store.write(&[1; 8192], 0).unwrap();
    store.flush().unwrap();
    let id = crash(store);
    let mut store = open(&moto.endpoint(), &format!("&break-lock={id}")).unwrap();
    store.write(&[2; 4096], 4096).unwrap();
    store.close().unwrap();
    drop(store);
    let v2_key = raw.keys("disk/log/checkpoints").pop().unwrap();
    assert!(v2_key.ends_with("-0000000000000002"), "{v2_key}");
    let (through, epochs, v1) = checkpoint_as_v1(&raw.get(&v2_key));
    assert_eq!(
        epochs.len(),
        2,
        "epochs 1 and 2 own live segments: {epochs:?}"
    );
    raw.delete(&v2_key);
    let v1_key = format!("disk/log/checkpoints/{through:016x}");
    raw.put(&v1_key, v1);
    for &(epoch, start) in &epochs {
        raw.put(
            &format!("disk/log/epochs/{epoch:016x}"),
            epoch_object(disk_id, epoch, start),
        );
    }

    let mut store = open(&moto.endpoint(), "").unwrap();
    let mut expected = vec![0u8; DISK_BYTES];
    expected[..4096].fill(1);
    expected[4096..8192].fill(2);
    assert!(read_all(&store) == expected, "the version 1 disk's data");
    assert_eq!(
        raw.keys("disk/log/checkpoints"),
        std::slice::from_ref(&v1_key)
    );
    assert_eq!(
        raw.keys("disk/log/epochs").len(),
        3,
        "nothing deleted before a version 2 checkpoint"
    );
    store.write(&[3; 4096], 8192).unwrap();
    expected[8192..12288].fill(3);
    store.close().unwrap();
    drop(store);
    // The version 1 checkpoint stays as the kept predecessor, with every epoch object (an
    // open falling back to it reads them all).
    let checkpoints = raw.keys("disk/log/checkpoints");
    assert_eq!(checkpoints.len(), 2, "{checkpoints:?}");
    assert_eq!(checkpoints[0], v1_key);
    assert!(
        checkpoints[1].ends_with("-0000000000000003"),
        "{checkpoints:?}"
    );
    let upgraded = raw.get(&checkpoints[1]);
    assert_eq!(u32::from_le_bytes(upgraded[8..12].try_into().unwrap()), 2);
    assert_eq!(raw.keys("disk/log/epochs").len(), 3);
    // The next checkpoint retires it and the epoch objects older than both kept writers.
    let mut store = open(&moto.endpoint(), "").unwrap();
    store.write(&[4; 4096], 12288).unwrap();
    expected[12288..16384].fill(4);
    store.close().unwrap();
    drop(store);
    let checkpoints = raw.keys("disk/log/checkpoints");
    assert!(
        checkpoints.len() == 2 && !checkpoints.contains(&v1_key),
        "{checkpoints:?}"
    );
    assert_eq!(
        raw.keys("disk/log/epochs"),
        [
            "disk/log/epochs/0000000000000003".to_string(),
            "disk/log/epochs/0000000000000004".to_string()
        ]
    );
    let store = open(&moto.endpoint(), "").unwrap();
    assert!(read_all(&store) == expected, "after the upgrade");
}

// Goal: a crash after a checkpoint is stored and before the epoch objects it made unneeded
// are deleted leaves a disk that opens with all its data, and that open's first checkpoint
// deletes them (the open keeps them while the log's start is the kept checkpoint).
// Method: two opens write and crash (two epoch objects, no checkpoint); a third open, through
// a proxy refusing every DELETE, writes and closes: its checkpoint lands, its deletes fail,
// as if it crashed right after the PUT. A fourth open (directly) reads everything back,
// writes and closes, reports the two deletes, and leaves only the third and fourth epochs'
// objects.
#[test]
fn an_open_after_a_crash_between_a_checkpoint_and_its_epoch_deletes_recovers_and_deletes_them() {
    let name =
        "an_open_after_a_crash_between_a_checkpoint_and_its_epoch_deletes_recovers_and_deletes_them";
    if !have_moto(name) {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let raw = Raw::new(&moto);
    let mut expected = vec![0u8; DISK_BYTES];
    let mut lock_id = None;
    for epoch in 1..=2u8 {
        let parameters = match lock_id.take() {
            None => "&create-size=1M&layout=log".to_string(),
            Some(id) => format!("&break-lock={id}"),
        };
        let store = open(&moto.endpoint(), &parameters).unwrap();
        let offset = usize::from(epoch) * 4096;
        store.write(&[epoch; 4096], offset as u64).unwrap();
        expected[offset..offset + 4096].fill(epoch);
        store.flush().unwrap();
        lock_id = Some(crash(store));
    }
    assert_eq!(raw.keys("disk/log/epochs").len(), 2);
    assert!(raw.keys("disk/log/checkpoints").is_empty());
    let proxy = RefuseProxy::start(moto.port, "DELETE", 403, "AccessDenied");
    let mut store = open(
        &proxy.endpoint(),
        &format!("&break-lock={}", lock_id.take().unwrap()),
    )
    .unwrap();
    store.write(&[3; 4096], 3 * 4096).unwrap();
    expected[3 * 4096..4 * 4096].fill(3);
    store.close().unwrap();
    assert_eq!(store.epochs_pruned(), 0, "every DELETE is refused");
    let id = store.lock().unwrap().holder().id.clone();
    drop(store);
    drop(proxy);
    let checkpoints = raw.keys("disk/log/checkpoints");
    assert_eq!(checkpoints.len(), 1, "{checkpoints:?}");
    assert!(
        checkpoints[0].ends_with("-0000000000000003"),
        "{checkpoints:?}"
    );
    assert_eq!(
        raw.keys("disk/log/epochs").len(),
        3,
        "the deletes never happened"
    );

    let mut store = open(&moto.endpoint(), &format!("&break-lock={id}")).unwrap();
    assert!(read_all(&store) == expected, "after the crash");
    // The checkpoint that landed is the disk's only one: its predecessor is the log's start,
    // an open from which reads every epoch object, so they stay until a newer checkpoint.
    assert_eq!(store.epochs_pruned(), 0);
    store.write(&[4; 4096], 4 * 4096).unwrap();
    store.close().unwrap();
    assert_eq!(store.epochs_pruned(), 2);
    drop(store);
    assert_eq!(
        raw.keys("disk/log/epochs"),
        [
            "disk/log/epochs/0000000000000003".to_string(),
            "disk/log/epochs/0000000000000004".to_string()
        ]
    );
}
