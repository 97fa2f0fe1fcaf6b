//! Snapshots of a log-layout disk (issue 50): `admin::snapshot`, `admin::snapshots`,
//! `admin::delete_snapshot` and a read-only open of `snapshot=NAME`. Against moto on loopback.

#[path = "support/fixtures.rs"]
mod fixtures;
#[path = "support/raw.rs"]
mod raw;
mod support;

use bufcache_s3::admin::{self, LayoutInfo};
use bufcache_s3::{ChunkStore, LogStore, LogSummary, OpenError, S3Url, SnapshotError};
use fixtures::{key_file, random};
use rand::SeedableRng;
use raw::Raw;
use support::{have_moto, have_seaweedfs, Moto, S3Server, SeaweedFs};

const DISK_BYTES: usize = 2 << 20;
const WRITTEN_BYTES: usize = 1 << 20;

/// A disk URL in the bucket `bucket`.
fn url(endpoint: &str, prefix: &str, parameters: &str) -> S3Url {
    url_in(endpoint, "bucket", prefix, parameters)
}

/// A disk URL in bucket `bucket`.
fn url_in(endpoint: &str, bucket: &str, prefix: &str, parameters: &str) -> S3Url {
    S3Url::parse(&format!(
        "s3://{bucket}/{prefix}?endpoint={endpoint}{parameters}"
    ))
    .unwrap()
}

/// Moto with the bucket `bucket`, and its endpoint; None (the test named `test` then skips)
/// where moto is not installed.
fn moto_with_bucket(test: &str) -> Option<(Moto, String)> {
    if !have_moto(test) {
        return None;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let endpoint = moto.endpoint();
    Some((moto, endpoint))
}

fn summary(url: &S3Url) -> LogSummary {
    match admin::info(url).unwrap().layout {
        LayoutInfo::Log(Ok(summary)) => summary,
        other => panic!("not a recovering log disk: {other:?}"),
    }
}

/// The whole disk as an open of `url` reads it.
fn read_all(url: &S3Url) -> Vec<u8> {
    let store = LogStore::open_read_only(url).unwrap();
    let mut image = vec![0u8; DISK_BYTES];
    store.read(&mut image, 0).unwrap();
    image
}

/// Writes a random image to `store` and returns it: its first `WRITTEN_BYTES` random, in
/// 64 KiB pieces in random order, flushing after every fourth, then 128 KiB at 256 KiB
/// zeroed; the rest of the disk untouched (zeroes).
fn write_random_image(store: &LogStore, rng: &mut impl rand::Rng) -> Vec<u8> {
    let mut image = vec![0u8; DISK_BYTES];
    image[..WRITTEN_BYTES].copy_from_slice(&random(WRITTEN_BYTES, rng));
    let mut order: Vec<usize> = (0..WRITTEN_BYTES / (64 << 10)).collect();
    rand::seq::SliceRandom::shuffle(&mut order[..], rng);
    for (count, piece) in order.into_iter().enumerate() {
        let at = piece * (64 << 10);
        store.write(&image[at..at + (64 << 10)], at as u64).unwrap();
        if count % 4 == 3 {
            store.flush().unwrap();
        }
    }
    store.write_zeroes(256 << 10, 128 << 10).unwrap();
    image[256 << 10..384 << 10].fill(0);
    store.flush().unwrap();
    image
}

/// Creates a 2 MiB log-layout disk (64 KiB segments, no collection) at `prefix` in `bucket`,
/// with `parameters` (`&NAME=VALUE...`) too, writes a random image to it
/// ([`write_random_image`]) and closes it; returns its URL (no collection, `parameters`) and
/// the image.
fn created_disk(
    endpoint: &str,
    bucket: &str,
    prefix: &str,
    parameters: &str,
    rng: &mut impl rand::Rng,
) -> (S3Url, Vec<u8>) {
    let create = url_in(
        endpoint,
        bucket,
        prefix,
        &format!("&create-size=2M&layout=log&segment-size=64k&gc=off{parameters}"),
    );
    let image = create_written(&create, rng);
    (
        url_in(endpoint, bucket, prefix, &format!("&gc=off{parameters}")),
        image,
    )
}

/// Creates the disk `create` names, writes a random image to it ([`write_random_image`]) and
/// closes it; returns the image.
fn create_written(create: &S3Url, rng: &mut impl rand::Rng) -> Vec<u8> {
    let mut store = LogStore::open_locked(create).unwrap();
    let image = write_random_image(&store, rng);
    store.close().unwrap();
    image
}

// Goal: a snapshot reads back exactly as the disk stood when it was taken, whatever is
// written, trimmed and collected afterwards, on a plain and on an encrypted, compressed disk;
// `disk info` and `disk snapshots` report the bytes only snapshots hold, and deleting the
// snapshot lets `disk gc` free them. Method: write 1 MiB, snapshot it offline, overwrite it
// all and collect garbage online (threshold 0.99) and offline, then open `snapshot=before`
// read-only and compare with the image kept at the snapshot; delete it and collect again.
#[test]
fn a_snapshot_reads_as_taken_across_overwrites_collection_and_reopens() {
    let name = "a_snapshot_reads_as_taken_across_overwrites_collection_and_reopens";
    // The server runs until `_moto` drops, at the end of the test.
    let Some((_moto, endpoint)) = moto_with_bucket(name) else {
        return;
    };
    let keys = tempfile::tempdir().unwrap();
    let key = key_file(keys.path());
    let mut rng = rand::rngs::StdRng::seed_from_u64(52);
    for (prefix, parameters) in [
        ("plain", String::new()),
        ("sealed", format!("&compress=zstd&key-file={key}")),
    ] {
        let (disk, before) = created_disk(&endpoint, "bucket", prefix, &parameters, &mut rng);

        let taken = admin::snapshot(&disk, "before").unwrap();
        assert!(taken.segments > 0, "{prefix}: {taken:?}");
        assert_eq!(
            taken.mapped_bytes,
            (WRITTEN_BYTES - (128 << 10)) as u64,
            "{prefix}"
        );

        let mut store = LogStore::open_locked(&disk).unwrap();
        let after = write_random_image(&store, &mut rng);
        for _ in 0..4 {
            store.collect_garbage(0.99).unwrap();
        }
        assert!(
            store.snapshot_only_bytes() > 0,
            "{prefix}: every segment of the snapshot is overwritten"
        );
        store.close().unwrap();
        drop(store);
        admin::collect(&disk, Some(0.99), &mut |_| {}).unwrap();

        let snapshot = url(&endpoint, prefix, &format!("&snapshot=before{parameters}"));
        assert!(
            read_all(&snapshot) == before,
            "{prefix}: the snapshot changed"
        );
        assert!(read_all(&disk) == after, "{prefix}: the disk");
        let held = summary(&disk);
        assert_eq!(held.snapshots, 1, "{prefix}: {held:?}");
        assert!(held.snapshot_only_bytes > 0, "{prefix}: {held:?}");
        let listed = admin::snapshots(&disk).unwrap();
        assert_eq!(listed.len(), 1, "{prefix}: {listed:?}");
        assert_eq!(listed[0].name, "before");
        assert_eq!(listed[0].mapped_bytes, taken.mapped_bytes);
        assert_eq!(
            listed[0].held_bytes, listed[0].segment_bytes,
            "{prefix}: all overwritten"
        );
        let report = admin::verify(&disk, &mut |_| {}).unwrap();
        assert!(report.damaged.is_empty(), "{prefix}: {:?}", report.damaged);

        admin::delete_snapshot(&disk, "before").unwrap();
        admin::collect(&disk, Some(0.99), &mut |_| {}).unwrap();
        let freed = summary(&disk);
        assert_eq!(freed.snapshots, 0, "{prefix}: {freed:?}");
        assert_eq!(freed.snapshot_only_bytes, 0, "{prefix}: {freed:?}");
        assert!(
            freed.segment_bytes + held.snapshot_only_bytes <= held.segment_bytes,
            "{prefix}: the snapshot's segments were freed: {held:?} then {freed:?}"
        );
        assert!(
            read_all(&disk) == after,
            "{prefix}: the disk after the delete"
        );
        match LogStore::open_read_only(&snapshot) {
            Err(OpenError::Config { reason, .. }) => {
                assert!(reason.contains("no snapshot named `before`"), "{reason}")
            }
            other => panic!("{prefix}: a deleted snapshot opened: {:?}", other.err()),
        }
    }
}

// Goal: each bad snapshot request is refused with one line naming what is wrong, and changes
// nothing in the store: bad names, a name in use, a missing name, a writable open of a
// snapshot URL, a snapshot of a disk a server holds, a chunk-layout disk. Method: compare the
// bucket's listing before and after each refusal.
#[test]
fn bad_snapshot_requests_are_refused_and_change_nothing() {
    let name = "bad_snapshot_requests_are_refused_and_change_nothing";
    let Some((moto, endpoint)) = moto_with_bucket(name) else {
        return;
    };
    let raw = Raw::new(&moto);
    let mut rng = rand::rngs::StdRng::seed_from_u64(53);
    let create = url(
        &endpoint,
        "disk",
        "&create-size=2M&layout=log&segment-size=64k",
    );
    let image = create_written(&create, &mut rng);
    let disk = url(&endpoint, "disk", "");
    admin::snapshot(&disk, "s").unwrap();
    let one_line = |error: &dyn std::fmt::Display| {
        let text = error.to_string();
        assert!(!text.contains('\n'), "one line: {text:?}");
        text
    };

    let before = raw.objects("disk/");
    for (bad, says) in [
        ("", "empty"),
        ("a/b", "`/`"),
        ("a\u{1}b", "control"),
        (&"n".repeat(101) as &str, "longer than 100"),
    ] {
        match admin::snapshot(&disk, bad) {
            Err(error @ SnapshotError::BadName { .. }) => {
                assert!(one_line(&error).contains(says), "{bad:?}: {error}")
            }
            other => panic!("{bad:?}: {other:?}"),
        }
        assert!(matches!(
            admin::delete_snapshot(&disk, bad),
            Err(SnapshotError::BadName { .. })
        ));
    }
    match admin::snapshot(&disk, "s") {
        Err(error @ SnapshotError::Exists { .. }) => {
            assert!(one_line(&error).contains("`s` exists"), "{error}")
        }
        other => panic!("a second `s`: {other:?}"),
    }
    match admin::delete_snapshot(&disk, "nope") {
        Err(error @ SnapshotError::Missing { .. }) => {
            assert!(
                one_line(&error).contains("no snapshot named `nope`"),
                "{error}"
            )
        }
        other => panic!("deleting `nope`: {other:?}"),
    }
    match LogStore::open_locked(&url(&endpoint, "disk", "&snapshot=s")) {
        Err(error @ OpenError::Config { .. }) => {
            assert!(one_line(&error).contains("--read-only"), "{error}")
        }
        other => panic!("a writable open of a snapshot: {:?}", other.err()),
    }
    assert_eq!(raw.objects("disk/"), before, "a refusal changed the store");

    let held = LogStore::open_locked(&disk).unwrap();
    let before = raw.objects("disk/");
    match admin::snapshot(&disk, "while-held") {
        Err(SnapshotError::Open(
            error @ (OpenError::Locked { .. } | OpenError::LeaseHeld { .. }),
        )) => {
            one_line(&error);
        }
        other => panic!("a snapshot of a held disk: {other:?}"),
    }
    assert_eq!(
        raw.objects("disk/"),
        before,
        "the refusal changed the store"
    );
    // The snapshot is served while the disk is held.
    let snapshot = url(&endpoint, "disk", "&snapshot=s");
    assert!(
        read_all(&snapshot) == image,
        "the snapshot while the disk is held"
    );
    drop(held);

    let chunk = url(&endpoint, "chunked", "&create-size=1M&layout=chunk");
    drop(ChunkStore::open_locked(&chunk).unwrap());
    match admin::snapshot(&url(&endpoint, "chunked", ""), "c") {
        Err(error @ SnapshotError::Refused { .. }) => {
            assert!(one_line(&error).contains("chunk-layout"), "{error}")
        }
        other => panic!("a chunk disk: {other:?}"),
    }
}

/// GETs moto logged so far.
fn gets(moto: &Moto) -> usize {
    moto.request_count("GET")
}

// Goal: a clone reads its base snapshot exactly where it has not written, across the base's
// later overwrites and collection and the clone's own reopens, on a plain and an encrypted,
// compressed base; a cold read of its unmodified data costs the GETs the same read of the
// snapshot costs; the snapshot cannot be deleted while the clone exists (refused naming the
// clone). Method: write 1 MiB to a base, snapshot it, clone it, write 256 KiB into the clone
// and flush; overwrite the whole base and collect its garbage online and offline; reopen the
// clone and compare with the snapshot's image overlaid with the clone's writes; count moto's
// GETs for a read of the clone's unmodified first 256 KiB against the same read of the
// snapshot served with `snapshot=`.
#[test]
fn a_clone_reads_its_base_snapshot_where_it_has_not_written() {
    let name = "a_clone_reads_its_base_snapshot_where_it_has_not_written";
    let Some((moto, endpoint)) = moto_with_bucket(name) else {
        return;
    };
    let keys = tempfile::tempdir().unwrap();
    let key = key_file(keys.path());
    let mut rng = rand::rngs::StdRng::seed_from_u64(54);
    for (prefix, parameters) in [
        ("plain", String::new()),
        ("sealed", format!("&compress=lz4&key-file={key}")),
    ] {
        let base_prefix = format!("{prefix}-base");
        let clone_prefix = format!("{prefix}-clone");
        let (base, image) = created_disk(&endpoint, "bucket", &base_prefix, &parameters, &mut rng);
        let clone = url(&endpoint, &clone_prefix, &format!("&gc=off{parameters}"));
        admin::snapshot(&base, "golden").unwrap();
        let requests = |moto: &Moto| -> usize {
            ["GET", "PUT", "POST", "DELETE", "HEAD"]
                .iter()
                .map(|method| moto.request_count(method))
                .sum()
        };
        let before = requests(&moto);
        let made = admin::clone(&base, &clone, "golden").unwrap();
        let clone_requests = requests(&moto) - before;
        println!("{prefix}: clone creation: {clone_requests} store requests");
        assert!(clone_requests <= 4, "{prefix}: {clone_requests} requests");
        assert_eq!(made.size_bytes, DISK_BYTES as u64, "{prefix}");
        assert_eq!(made.mapped_bytes, (WRITTEN_BYTES - (128 << 10)) as u64);
        assert!(
            matches!(
                admin::clone(&base, &clone, "golden"),
                Err(SnapshotError::Refused { .. })
            ),
            "{prefix}: a clone onto an existing disk"
        );
        // Onto a disk that is no clone: refused, and its clone record taken back.
        let occupied = url(
            &endpoint,
            &format!("{prefix}-occupied"),
            "&create-size=1M&layout=log",
        );
        drop(LogStore::open_locked(&occupied).unwrap());
        assert!(
            matches!(
                admin::clone(&base, &occupied, "golden"),
                Err(SnapshotError::Refused { .. })
            ),
            "{prefix}: a clone onto a disk that is no clone"
        );
        assert!(read_all(&clone) == image, "{prefix}: a fresh clone");
        admin::snapshot(&clone, "of-clone").unwrap();
        match admin::clone(
            &clone,
            &url(&endpoint, &format!("{prefix}-second"), &parameters),
            "of-clone",
        ) {
            Err(error @ SnapshotError::Refused { .. }) => {
                assert!(error.to_string().contains("clone of a clone"), "{error}")
            }
            other => panic!("{prefix}: a clone of a clone: {other:?}"),
        }
        admin::delete_snapshot(&clone, "of-clone").unwrap();

        // The clone writes; the base is overwritten and collected.
        let mut expected = image.clone();
        let mut store = LogStore::open_locked(&clone).unwrap();
        let written = random(256 << 10, &mut rng);
        store.write(&written, 512 << 10).unwrap();
        expected[512 << 10..768 << 10].copy_from_slice(&written);
        store.flush().unwrap();
        store.write_zeroes(900 << 10, 64 << 10).unwrap();
        expected[900 << 10..964 << 10].fill(0);
        store.close().unwrap();
        drop(store);
        let mut store = LogStore::open_locked(&base).unwrap();
        let after = write_random_image(&store, &mut rng);
        for _ in 0..3 {
            store.collect_garbage(0.99).unwrap();
        }
        store.close().unwrap();
        drop(store);
        admin::collect(&base, Some(0.99), &mut |_| {}).unwrap();
        admin::collect(&clone, Some(0.99), &mut |_| {}).unwrap();
        assert!(
            read_all(&clone) == expected,
            "{prefix}: the clone after the base moved on"
        );
        assert!(read_all(&base) == after, "{prefix}: the base");
        let report = admin::verify(&clone, &mut |_| {}).unwrap();
        assert!(report.damaged.is_empty(), "{prefix}: {:?}", report.damaged);

        // A cold read of unmodified data: the GETs of the same read of the snapshot.
        let snapshot = url(
            &endpoint,
            &base_prefix,
            &format!("&snapshot=golden{parameters}"),
        );
        let mut counted = Vec::new();
        for disk in [&snapshot, &clone] {
            let store = LogStore::open_read_only(disk).unwrap();
            let mut buffer = vec![0u8; 256 << 10];
            let before = gets(&moto);
            store.read(&mut buffer, 0).unwrap();
            counted.push(gets(&moto) - before);
            assert!(buffer[..] == image[..256 << 10], "{prefix}");
        }
        println!("{prefix}: cold read of 256 KiB unmodified: {} GETs from the snapshot, {} from the clone", counted[0], counted[1]);
        assert_eq!(counted[0], counted[1], "{prefix}");

        match admin::delete_snapshot(&base, "golden") {
            Err(error @ SnapshotError::HasClones { .. }) => {
                let error = error.to_string();
                assert!(
                    error.contains(&format!("s3://bucket/{clone_prefix}")),
                    "{error}"
                );
                assert!(!error.contains("occupied"), "{error}");
            }
            other => panic!("{prefix}: deleting a cloned snapshot: {other:?}"),
        }
    }
}

// Goal: a clone made before clones' metadata carried their base (a version 2 metadata object
// beside a `log/base` record) still opens and reads its base where it has not written, and a
// clone of its snapshot is refused as a clone of a clone. Method: clone a snapshot, rewrite
// the clone into the older form by hand (metadata without `base`, version 2; the record in
// the documented `BCLOGBAS` layout), write into it, reopen and compare; snapshot it and try
// to clone that snapshot.
#[test]
fn a_clone_made_before_the_metadata_carried_its_base_is_still_read() {
    let name = "a_clone_made_before_the_metadata_carried_its_base_is_still_read";
    let Some((moto, endpoint)) = moto_with_bucket(name) else {
        return;
    };
    let raw = Raw::new(&moto);
    let mut rng = rand::rngs::StdRng::seed_from_u64(55);
    let (base, image) = created_disk(&endpoint, "bucket", "base", "", &mut rng);
    let clone = url(&endpoint, "old-clone", "&gc=off");
    admin::snapshot(&base, "golden").unwrap();
    admin::clone(&base, &clone, "golden").unwrap();

    // The older form: version 2 metadata, the base in `log/base`.
    let metadata_key = "old-clone/bufcache-disk.json";
    let mut metadata: serde_json::Value = serde_json::from_slice(&raw.get(metadata_key)).unwrap();
    let carried = metadata["base"].clone();
    assert_eq!(metadata["format_version"], 4);
    assert_eq!(carried["prefix"], "base");
    assert_eq!(carried["snapshot"], "golden");
    metadata["format_version"] = 2.into();
    metadata.as_object_mut().unwrap().remove("base");
    raw.put(metadata_key, metadata.to_string().into_bytes());
    let disk_id =
        |text: &serde_json::Value| u64::from_str_radix(text.as_str().unwrap(), 16).unwrap();
    let mut record = b"BCLOGBAS".to_vec();
    record.extend_from_slice(&1u32.to_le_bytes());
    record.extend_from_slice(&0u32.to_le_bytes());
    record.extend_from_slice(&disk_id(&metadata["disk_id"]).to_le_bytes());
    record.extend_from_slice(&disk_id(&carried["disk_id"]).to_le_bytes());
    for text in ["golden", "base"] {
        record.extend_from_slice(&(text.len() as u16).to_le_bytes());
        record.extend_from_slice(text.as_bytes());
    }
    let checksum = crc32fast::hash(&record);
    record.extend_from_slice(&checksum.to_le_bytes());
    raw.put("old-clone/log/base", record);

    assert!(read_all(&clone) == image, "the older clone, fresh");
    let mut expected = image.clone();
    let mut store = LogStore::open_locked(&clone).unwrap();
    let written = random(128 << 10, &mut rng);
    store.write(&written, 64 << 10).unwrap();
    expected[64 << 10..192 << 10].copy_from_slice(&written);
    store.close().unwrap();
    drop(store);
    assert!(read_all(&clone) == expected, "the older clone, written");
    admin::snapshot(&clone, "of-old-clone").unwrap();
    match admin::clone(&clone, &url(&endpoint, "second", ""), "of-old-clone") {
        Err(error @ SnapshotError::Refused { .. }) => {
            assert!(error.to_string().contains("clone of a clone"), "{error}")
        }
        other => panic!("a clone of an older clone: {other:?}"),
    }
    assert!(
        raw.keys("second").is_empty(),
        "nothing written for the refused clone"
    );
}

// Goal: `disk delete` removes a disk whole; a clone's delete takes its record under the base
// with it (so the snapshot can be deleted again) and leaves the base as it was; deleting a
// base whose snapshot a clone reads, or a disk a server holds, is refused naming why, with
// nothing changed. Method: a base with two snapshots and a clone of one; try to delete the
// base, then delete the clone while another server holds it (refused) and once released;
// check no object is left under the clone, the base still reads as before, the snapshot
// deletes; then delete the base and check its prefix is empty and a second delete says there
// is no disk.
#[test]
fn deleting_a_clone_frees_its_snapshot_and_a_base_with_clones_is_refused() {
    let name = "deleting_a_clone_frees_its_snapshot_and_a_base_with_clones_is_refused";
    let Some((moto, endpoint)) = moto_with_bucket(name) else {
        return;
    };
    let raw = Raw::new(&moto);
    let mut rng = rand::rngs::StdRng::seed_from_u64(56);
    let (base, image) = created_disk(&endpoint, "bucket", "base", "", &mut rng);
    let clone = url(&endpoint, "clone", "&gc=off");
    admin::snapshot(&base, "golden").unwrap();
    admin::snapshot(&base, "spare").unwrap();
    admin::clone(&base, &clone, "golden").unwrap();
    let mut store = LogStore::open_locked(&clone).unwrap();
    store.write(&random(64 << 10, &mut rng), 0).unwrap();
    store.close().unwrap();
    drop(store);
    let base_objects = raw.keys("base/");

    match admin::delete(&base) {
        Err(error @ admin::DeleteError::Refused { .. }) => {
            assert!(error.to_string().contains("s3://bucket/clone"), "{error}");
            assert!(error.is_bad_input());
        }
        other => panic!("deleting a base with a clone: {other:?}"),
    }
    assert_eq!(raw.keys("base/"), base_objects, "the base unchanged");
    let mut held = LogStore::open_locked(&clone).unwrap();
    match admin::delete(&clone) {
        Err(error @ admin::DeleteError::Open(OpenError::Locked { .. })) => {
            assert!(error.is_bad_input(), "{error}")
        }
        other => panic!("deleting a held clone: {other:?}"),
    }
    held.close().unwrap();
    drop(held);
    assert!(!raw.keys("clone/").is_empty());

    let deleted = admin::delete(&clone).unwrap();
    assert!(deleted.objects >= 4, "{deleted:?}");
    assert_eq!(
        deleted.base,
        Some(("s3://bucket/base".to_string(), "golden".to_string()))
    );
    assert!(raw.keys("clone/").is_empty(), "{:?}", raw.keys("clone/"));
    assert!(
        raw.keys("base/log/clones").is_empty(),
        "the clone record is gone"
    );
    assert!(matches!(
        admin::delete(&clone),
        Err(admin::DeleteError::Open(OpenError::NoDiskReadOnly { .. }))
    ));
    assert!(read_all(&base) == image, "the base reads as before");
    admin::delete_snapshot(&base, "golden").unwrap();

    let deleted = admin::delete(&base).unwrap();
    assert_eq!(deleted.base, None);
    assert!(raw.keys("base/").is_empty(), "{:?}", raw.keys("base/"));
}

// Goal: a `disk delete` of a base and a `disk clone` of its snapshot running at the same time
// never leave a clone whose base segments are deleted: either the delete finds the clone's
// record and is refused (the base, its snapshot and the clone intact), or the clone finds the
// delete's mark and is refused (nothing of it left). Method: a base with a snapshot; delete
// it with `delete_calling`, making a clone from the hook once the delete has listed the
// records (none) and taken the lock: the delete is refused naming the clone, the base keeps
// every object and no mark, the clone reads the snapshot; delete that clone, then delete the
// base again, trying a clone from the hook once the delete has marked the metadata: the
// clone is refused as being deleted with no object left, and the delete ends with both
// prefixes empty. The same with the clones in another bucket.
#[test]
fn a_clone_made_while_its_base_is_deleted_is_fenced_off() {
    let name = "a_clone_made_while_its_base_is_deleted_is_fenced_off";
    if !have_moto(name) {
        return;
    }
    let keys = tempfile::tempdir().unwrap();
    let key = key_file(keys.path());
    for clone_bucket in ["bucket", "clones"] {
        fenced_off("", clone_bucket);
        // An encrypted base: the delete's mark, set and taken off, leaves its tagged
        // metadata opening as before (the tag does not cover the mark).
        fenced_off(&format!("&key-file={key}"), clone_bucket);
    }
}

/// The body of [`a_clone_made_while_its_base_is_deleted_is_fenced_off`], every URL with
/// `keyed` parameters, the clones in `clone_bucket`.
fn fenced_off(keyed: &str, clone_bucket: &str) {
    let moto = Moto::start();
    moto.create_bucket("bucket");
    moto.create_bucket(clone_bucket);
    let endpoint = moto.endpoint();
    let raw = Raw::new(&moto);
    let clone_raw = Raw::in_bucket(&moto, clone_bucket);
    let mut rng = rand::rngs::StdRng::seed_from_u64(57);
    let (base, image) = created_disk(&endpoint, "bucket", "base", keyed, &mut rng);
    let clone = url_in(&endpoint, clone_bucket, "clone", &format!("&gc=off{keyed}"));
    admin::snapshot(&base, "golden").unwrap();
    let base_objects = raw.keys("base/");
    let metadata_key = "base/bufcache-disk.json";
    let metadata_before: serde_json::Value =
        serde_json::from_slice(&raw.get(metadata_key)).unwrap();

    // The clone lands between the delete's first look for records and its fence.
    let mut moments = Vec::new();
    let refused = admin::delete_calling(&base, &mut |moment| {
        moments.push(moment);
        if moment == admin::DeleteMoment::Locked {
            admin::clone(&base, &clone, "golden").unwrap();
        }
    });
    match refused {
        Err(error @ admin::DeleteError::Refused { .. }) => {
            let error = error.to_string();
            assert!(
                error.contains(&format!("s3://{clone_bucket}/clone")),
                "{error}"
            );
            assert!(error.contains("made while this delete ran"), "{error}");
            assert!(!error.contains('\n'), "{error}");
        }
        other => panic!("a delete racing a clone: {other:?}"),
    }
    assert_eq!(
        moments,
        [admin::DeleteMoment::Locked, admin::DeleteMoment::Marked]
    );
    let mut base_now = raw.keys("base/");
    base_now.retain(|key| !key.starts_with("base/log/clones/"));
    assert_eq!(base_now, base_objects, "the base keeps every object");
    assert_eq!(raw.keys("base/log/clones/").len(), 1, "the clone's record");
    let metadata_after: serde_json::Value = serde_json::from_slice(&raw.get(metadata_key)).unwrap();
    assert_eq!(metadata_after, metadata_before, "the mark is taken off");
    assert!(read_all(&clone) == image, "the clone reads the snapshot");
    assert!(read_all(&base) == image, "the base reads as before");

    // The clone is tried once the delete has marked the base: refused, nothing left of it.
    admin::delete(&clone).unwrap();
    let late = url_in(
        &endpoint,
        clone_bucket,
        "late-clone",
        &format!("&gc=off{keyed}"),
    );
    let mut outcome = None;
    let deleted = admin::delete_calling(&base, &mut |moment| {
        if moment == admin::DeleteMoment::Marked {
            outcome = Some(admin::clone(&base, &late, "golden"));
        }
    })
    .unwrap();
    match outcome {
        Some(Err(error @ SnapshotError::Refused { .. })) => {
            let error = error.to_string();
            assert!(error.contains("is being deleted"), "{error}");
            assert!(!error.contains('\n'), "{error}");
        }
        other => panic!("a clone of a base being deleted: {other:?}"),
    }
    assert!(deleted.objects >= base_objects.len() as u64, "{deleted:?}");
    assert!(raw.keys("base/").is_empty(), "{:?}", raw.keys("base/"));
    assert!(
        clone_raw.keys("late-clone/").is_empty(),
        "{:?}",
        clone_raw.keys("late-clone/")
    );
    assert!(clone_raw.keys("clone/").is_empty());
}

/// An error's text, checked to be one line.
fn one_line(error: &dyn std::fmt::Display) -> String {
    let text = error.to_string();
    assert!(!text.contains('\n'), "one line: {text:?}");
    text
}

/// Every request moto logged so far.
fn requests(moto: &Moto) -> usize {
    ["GET", "PUT", "POST", "DELETE", "HEAD"]
        .iter()
        .map(|method| moto.request_count(method))
        .sum()
}

// Goal: a clone in another bucket of the same store reads its base's snapshot where it has
// not written and its own writes elsewhere, the base unchanged, on a plain and on an
// lz4-compressed encrypted base; on moto its creation costs at most 4 requests and a cold read
// of its unmodified data the GETs of the same read of the snapshot; the snapshot's delete is
// refused naming the clone's bucket and prefix; the encrypted clone's metadata with its base
// bucket changed is refused; deleting the clone removes its record from the base's bucket,
// after which the snapshot deletes. Bad input changes nothing: a clone bucket that does not
// exist, a disk at the clone's prefix, another endpoint. Method: on moto and SeaweedFS, a
// base in `bases` and clones in `clones`; requests counted in moto's log.
#[test]
fn a_clone_in_another_bucket_reads_its_base_and_frees_it_when_deleted() {
    let name = "a_clone_in_another_bucket_reads_its_base_and_frees_it_when_deleted";
    if have_moto(name) {
        let moto = Moto::start();
        clone_in_another_bucket(&moto, Some(&moto));
    }
    if have_seaweedfs(name) {
        clone_in_another_bucket(&SeaweedFs::start(), None);
    }
}

/// The body of [`a_clone_in_another_bucket_reads_its_base_and_frees_it_when_deleted`] on
/// `server`; requests are counted when `counted` is moto.
fn clone_in_another_bucket(server: &dyn S3Server, counted: Option<&Moto>) {
    server.create_bucket("bases");
    server.create_bucket("clones");
    let endpoint = server.endpoint();
    let bases = Raw::in_bucket(server, "bases");
    let clones = Raw::in_bucket(server, "clones");
    let keys = tempfile::tempdir().unwrap();
    let key = key_file(keys.path());
    let mut rng = rand::rngs::StdRng::seed_from_u64(58);
    for (prefix, parameters) in [
        ("plain", String::new()),
        ("sealed", format!("&compress=lz4&key-file={key}")),
    ] {
        let (base, image) = created_disk(&endpoint, "bases", prefix, &parameters, &mut rng);
        // The clone at the same prefix as its base, in its own bucket: they do not overlap.
        let clone = url_in(&endpoint, "clones", prefix, &format!("&gc=off{parameters}"));
        admin::snapshot(&base, "golden").unwrap();
        let base_objects = bases.objects(&format!("{prefix}/"));

        // Bad input first: each refused in one line, nothing left in either bucket.
        let missing_bucket = url_in(&endpoint, "no-such-bucket", prefix, &parameters);
        match admin::clone(&base, &missing_bucket, "golden") {
            Err(error @ SnapshotError::Refused { .. }) => {
                assert!(one_line(&error).contains("no-such-bucket"), "{error}");
                assert!(one_line(&error).contains("does not exist"), "{error}");
                assert!(error.is_bad_input());
            }
            other => panic!("{prefix}: a clone into a missing bucket: {other:?}"),
        }
        let occupied = url_in(
            &endpoint,
            "clones",
            &format!("{prefix}-occupied"),
            &format!("&create-size=1M&layout=log{parameters}"),
        );
        drop(LogStore::open_locked(&occupied).unwrap());
        let occupied_objects = clones.objects(&format!("{prefix}-occupied/"));
        match admin::clone(&base, &occupied, "golden") {
            Err(error @ SnapshotError::Refused { .. }) => {
                assert!(one_line(&error).contains("a disk exists"), "{error}")
            }
            other => panic!("{prefix}: a clone onto a disk: {other:?}"),
        }
        assert_eq!(
            clones.objects(&format!("{prefix}-occupied/")),
            occupied_objects
        );
        let elsewhere = url_in(
            "http://127.0.0.1:1",
            "clones",
            &format!("{prefix}-elsewhere"),
            &parameters,
        );
        match admin::clone(&base, &elsewhere, "golden") {
            Err(error @ SnapshotError::Refused { .. }) => {
                assert!(one_line(&error).contains("endpoint="), "{error}")
            }
            other => panic!("{prefix}: a clone at another endpoint: {other:?}"),
        }
        assert_eq!(
            bases.objects(&format!("{prefix}/")),
            base_objects,
            "{prefix}: the refused clones left the base as it was"
        );

        let before = counted.map(requests);
        let made = admin::clone(&base, &clone, "golden").unwrap();
        if let (Some(moto), Some(before)) = (counted, before) {
            let clone_requests = requests(moto) - before;
            println!("{prefix}: clone into another bucket: {clone_requests} store requests");
            assert!(clone_requests <= 4, "{prefix}: {clone_requests} requests");
        }
        assert_eq!(made.size_bytes, DISK_BYTES as u64);
        let metadata: serde_json::Value =
            serde_json::from_slice(&clones.get(&format!("{prefix}/bufcache-disk.json"))).unwrap();
        assert_eq!(metadata["base"]["bucket"], "bases", "{metadata}");
        assert_eq!(metadata["base"]["prefix"], prefix, "{metadata}");
        assert!(read_all(&clone) == image, "{prefix}: a fresh clone");

        // The clone writes; its base is overwritten and collected; neither sees the other.
        let mut expected = image.clone();
        let mut store = LogStore::open_locked(&clone).unwrap();
        let written = random(256 << 10, &mut rng);
        store.write(&written, 512 << 10).unwrap();
        expected[512 << 10..768 << 10].copy_from_slice(&written);
        store.flush().unwrap();
        store.write_zeroes(900 << 10, 64 << 10).unwrap();
        expected[900 << 10..964 << 10].fill(0);
        store.close().unwrap();
        drop(store);
        assert!(read_all(&base) == image, "{prefix}: the base unchanged");
        let mut store = LogStore::open_locked(&base).unwrap();
        let after = write_random_image(&store, &mut rng);
        store.collect_garbage(0.99).unwrap();
        store.close().unwrap();
        drop(store);
        admin::collect(&base, Some(0.99), &mut |_| {}).unwrap();
        admin::collect(&clone, Some(0.99), &mut |_| {}).unwrap();
        assert!(read_all(&clone) == expected, "{prefix}: the clone");
        assert!(read_all(&base) == after, "{prefix}: the base");
        let report = admin::verify(&clone, &mut |_| {}).unwrap();
        assert!(report.damaged.is_empty(), "{prefix}: {:?}", report.damaged);
        assert!(
            matches!(summary(&clone).mapped_bytes, bytes if bytes > 0),
            "{prefix}: info of the clone"
        );

        if let Some(moto) = counted {
            let snapshot = url_in(
                &endpoint,
                "bases",
                prefix,
                &format!("&snapshot=golden{parameters}"),
            );
            let mut gets = Vec::new();
            for disk in [&snapshot, &clone] {
                let store = LogStore::open_read_only(disk).unwrap();
                let mut buffer = vec![0u8; 256 << 10];
                let before = moto.request_count("GET");
                store.read(&mut buffer, 0).unwrap();
                gets.push(moto.request_count("GET") - before);
                assert!(buffer[..] == image[..256 << 10], "{prefix}");
            }
            println!(
                "{prefix}: cold read of 256 KiB unmodified: {} GETs from the snapshot, {} from the clone in another bucket",
                gets[0], gets[1]
            );
            assert_eq!(gets[0], gets[1], "{prefix}");
        }

        if !parameters.is_empty() {
            // The base's bucket is under the metadata's tag: changed, the open is refused.
            let metadata_key = format!("{prefix}/bufcache-disk.json");
            let stored = clones.get(&metadata_key);
            let mut forged: serde_json::Value = serde_json::from_slice(&stored).unwrap();
            forged["base"]["bucket"] = "clones".into();
            clones.put(&metadata_key, forged.to_string().into_bytes());
            match LogStore::open_read_only(&clone) {
                Err(error @ OpenError::ForgedMetadata { .. }) => {
                    assert!(error.to_string().contains(&metadata_key), "{error}")
                }
                other => panic!("{prefix}: a forged base bucket: {:?}", other.err()),
            }
            clones.put(&metadata_key, stored);
        }

        match admin::delete_snapshot(&base, "golden") {
            Err(error @ SnapshotError::HasClones { .. }) => {
                assert!(
                    one_line(&error).contains(&format!("s3://clones/{prefix}")),
                    "{error}"
                );
            }
            other => panic!("{prefix}: deleting a snapshot cloned elsewhere: {other:?}"),
        }
        match admin::delete(&base) {
            Err(error @ admin::DeleteError::Refused { .. }) => {
                assert!(
                    error.to_string().contains(&format!("s3://clones/{prefix}")),
                    "{error}"
                )
            }
            other => panic!("{prefix}: deleting a base cloned elsewhere: {other:?}"),
        }
        assert_eq!(
            bases.keys(&format!("{prefix}/log/clones/")).len(),
            1,
            "{prefix}: one record"
        );
        let deleted = admin::delete(&clone).unwrap();
        assert_eq!(
            deleted.base,
            Some((format!("s3://bases/{prefix}"), "golden".to_string()))
        );
        assert!(clones.keys(&format!("{prefix}/")).is_empty());
        assert!(
            bases.keys(&format!("{prefix}/log/clones/")).is_empty(),
            "{prefix}: the record in the base's bucket is gone"
        );
        admin::delete_snapshot(&base, "golden").unwrap();
        assert!(read_all(&base) == after, "{prefix}: the base after all");
        admin::delete(&base).unwrap();
        assert!(bases.keys(&format!("{prefix}/")).is_empty());
    }
}
