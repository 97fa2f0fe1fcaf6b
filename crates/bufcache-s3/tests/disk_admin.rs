//! `bufcache disk` underneath (issue 50): `admin::verify` names every damaged object and finds
//! nothing on a healthy disk, `admin::info` reports what the disk holds and who holds it,
//! `admin::resize` grows, refuses a shrink over data and a disk a server holds, and
//! `admin::create` refuses a disk that exists. Against moto on loopback; objects damaged
//! through the bucket directly.

#[path = "support/fixtures.rs"]
mod fixtures;
#[path = "support/raw.rs"]
mod raw;
mod support;

use bufcache_s3::admin::{self, LayoutInfo, VerifyProgress};
use bufcache_s3::{ChunkStore, LogStore, OpenError, S3Url};
use bytes::Bytes;
use fixtures::{key_file, random};
use rand::{Rng, SeedableRng};
use raw::Raw;
use support::{have_moto, Moto};

fn url(endpoint: &str, prefix: &str, parameters: &str) -> S3Url {
    S3Url::parse(&format!(
        "s3://bucket/{prefix}?endpoint={endpoint}{parameters}"
    ))
    .unwrap()
}

/// The keys `admin::verify` reports damaged (panics when it cannot verify at all).
fn damaged_keys(url: &S3Url) -> Vec<String> {
    let mut last = VerifyProgress::default();
    let report = admin::verify(url, &mut |progress| last = progress).unwrap();
    assert_eq!(report.read, last, "the last progress is the report's");
    assert_eq!(
        report.read.objects_done, report.read.objects_total,
        "every object listed is read"
    );
    report
        .damaged
        .into_iter()
        .map(|damage| damage.key)
        .collect()
}

/// Byte positions to flip in an object of `length` bytes: every other byte of the first 72
/// (the headers) and of the last 72 (tables, tags), and 24 spread over the rest.
fn positions(length: usize) -> Vec<usize> {
    let mut positions: Vec<usize> = (0..length.min(72)).step_by(2).collect();
    positions.extend((length.saturating_sub(72)..length).step_by(2));
    positions.extend((1..=24).map(|step| step * length / 25));
    positions.sort_unstable();
    positions.dedup();
    positions
}

/// Flips each chosen byte of `key` in turn and checks that verify names `key` and only it,
/// then puts the object back.
fn every_flip_is_found(raw: &Raw, url: &S3Url, key: &str) -> usize {
    let original = raw.get(key);
    let positions = positions(original.len());
    for &position in &positions {
        let mut damaged = original.clone();
        damaged[position] ^= 0x20;
        raw.put(key, damaged);
        assert_eq!(
            damaged_keys(url),
            vec![key.to_string()],
            "byte {position} of {} flipped in `{key}`",
            original.len()
        );
    }
    raw.put(key, original);
    positions.len()
}

/// A log disk with several segments, checkpoints and overwrites (garbage), closed cleanly.
fn write_log_disk(url: &S3Url, rng: &mut impl Rng) -> Vec<u8> {
    let mut image = vec![0u8; 1 << 20];
    let mut store = LogStore::open_locked(url).unwrap();
    for round in 0..6 {
        let offset = (round % 3) * (96 << 10);
        let data = random(80 << 10, rng);
        store.write(&data, offset as u64).unwrap();
        image[offset..offset + data.len()].copy_from_slice(&data);
        store.flush().unwrap();
    }
    store.write_zeroes(512 << 10, 64 << 10).unwrap();
    store.close().unwrap();
    image
}

// Goal: `disk verify` finds every flipped byte of a segment, a checkpoint, an epoch object,
// a snapshot record and a chunk, names the object and nothing else, and reports nothing on a healthy disk; on
// an encrypted and compressed disk too (the tag of each object, the sealed frames). Method:
// write disks of each kind through the stores, then flip every other byte of the headers and tails
// and 24 more in each object kind through the bucket, one at a time, verifying after each.
#[test]
fn verify_finds_every_flipped_byte_and_nothing_on_a_healthy_disk() {
    let name = "verify_finds_every_flipped_byte_and_nothing_on_a_healthy_disk";
    if !have_moto(name) {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let raw = Raw::new(&moto);
    let endpoint = moto.endpoint();
    let keys = tempfile::tempdir().unwrap();
    let key = key_file(keys.path());
    let mut rng = rand::rngs::StdRng::seed_from_u64(50);
    for (prefix, parameters) in [
        ("plain", String::new()),
        ("sealed", format!("&compress=lz4&key-file={key}")),
    ] {
        let create = url(
            &endpoint,
            prefix,
            &format!("&create-size=1M&layout=log&segment-size=64k&gc=off{parameters}"),
        );
        write_log_disk(&create, &mut rng);
        let disk = url(&endpoint, prefix, &parameters);
        admin::snapshot(&disk, "kept").unwrap();
        assert_eq!(
            damaged_keys(&disk),
            Vec::<String>::new(),
            "{prefix}: healthy"
        );
        let mut flipped = 0;
        for folder in [
            "log/segments",
            "log/checkpoints",
            "log/epochs",
            "log/snapshots",
        ] {
            let objects = raw.keys(&format!("{prefix}/{folder}/"));
            assert!(!objects.is_empty(), "{prefix}: no object under {folder}");
            flipped += every_flip_is_found(&raw, &disk, &objects[objects.len() / 2]);
        }
        println!("{prefix}: {flipped} flipped bytes, each found");
        assert_eq!(
            damaged_keys(&disk),
            Vec::<String>::new(),
            "{prefix}: restored"
        );
    }

    let chunk = url(
        &endpoint,
        "chunked",
        "&create-size=1M&layout=chunk&chunk-size=64k",
    );
    let store = ChunkStore::open_locked(&chunk).unwrap();
    store
        .write(Bytes::from(random(200 << 10, &mut rng)), 10 << 10)
        .unwrap();
    drop(store);
    let disk = url(&endpoint, "chunked", "");
    assert_eq!(damaged_keys(&disk), Vec::<String>::new(), "chunk: healthy");
    let chunks = raw.keys("chunked/chunks/");
    assert_eq!(chunks.len(), 4, "200 KiB at 10 KiB touch chunks 0 to 3");
    let flipped = every_flip_is_found(&raw, &disk, &chunks[1]);
    println!("chunk: {flipped} flipped bytes, each found");
}

// Goal: a segment the index needs that is gone is reported (the log does not recover), and
// verify changes nothing in the store. Method: delete the newest segment a checkpoint names,
// verify, compare the bucket's listing before and after.
#[test]
fn verify_reports_a_missing_segment_and_changes_nothing() {
    let name = "verify_reports_a_missing_segment_and_changes_nothing";
    if !have_moto(name) {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let raw = Raw::new(&moto);
    let endpoint = moto.endpoint();
    let mut rng = rand::rngs::StdRng::seed_from_u64(51);
    write_log_disk(
        &url(
            &endpoint,
            "disk",
            "&create-size=1M&layout=log&segment-size=64k&gc=off",
        ),
        &mut rng,
    );
    // The newest segment holding data (the newest of all holds only the zeroing, which
    // the checkpoint covers and names nothing of: the disk keeps it until a later one).
    let (newest_named, _) = raw
        .objects("disk/log/segments/")
        .into_iter()
        .rfind(|&(_, bytes)| bytes > 4096)
        .unwrap();
    raw.delete(&newest_named);
    let before = raw.objects("disk/");
    let disk = url(&endpoint, "disk", "");
    let report = admin::verify(&disk, &mut |_| {}).unwrap();
    assert_eq!(report.damaged.len(), 1, "{:?}", report.damaged);
    assert!(
        report.damaged[0].reason.contains("does not recover"),
        "{:?}",
        report.damaged
    );
    assert_eq!(raw.objects("disk/"), before, "verify changed the store");
    match admin::info(&disk).unwrap().layout {
        LayoutInfo::Log(Err(reason)) => {
            assert!(reason.to_string().contains("segment"), "{reason}")
        }
        other => panic!("info of a disk missing a segment: {other:?}"),
    }
}

// Goal: `disk info` reports the size, layout, live and garbage bytes, and the lock holder of
// a served disk, writing nothing. Method: a log disk with 80 KiB written three times over one
// range and kept open (its lock held), then closed; a chunk disk with three chunks stored.
#[test]
fn info_reports_live_and_garbage_bytes_and_the_lock_holder() {
    let name = "info_reports_live_and_garbage_bytes_and_the_lock_holder";
    if !have_moto(name) {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let raw = Raw::new(&moto);
    let endpoint = moto.endpoint();
    let mut rng = rand::rngs::StdRng::seed_from_u64(52);
    let store = LogStore::open_locked(&url(
        &endpoint,
        "disk",
        "&create-size=4M&layout=log&segment-size=64k&gc=off",
    ))
    .unwrap();
    for _ in 0..3 {
        store.write(&random(80 << 10, &mut rng), 0).unwrap();
        store.flush().unwrap();
    }
    let disk = url(&endpoint, "disk", "");
    let before = raw.objects("disk/");
    let info = admin::info(&disk).unwrap();
    assert_eq!(raw.objects("disk/"), before, "info changed the store");
    assert_eq!(info.metadata.size_bytes, 4 << 20);
    let lock = info.lock.expect("the open store holds the lock");
    assert_eq!(lock.holder.id, store.lock().unwrap().holder().id);
    assert!(lock.age_seconds.is_some_and(|age| age < 600), "{lock:?}");
    let LayoutInfo::Log(Ok(log)) = info.layout else {
        panic!("{:?}", info.layout)
    };
    assert_eq!(log.mapped_bytes, 80 << 10);
    assert!(
        log.garbage_bytes() >= 2 * (80 << 10),
        "two overwritten copies are garbage: {log:?}"
    );
    assert!(log.segments >= 3 && log.epoch_newest >= 1, "{log:?}");
    drop(store);
    assert!(
        admin::info(&disk).unwrap().lock.is_none(),
        "closed: lock released"
    );

    let chunk = url(
        &endpoint,
        "chunked",
        "&create-size=1M&layout=chunk&chunk-size=64k",
    );
    let store = ChunkStore::open_locked(&chunk).unwrap();
    store
        .write(Bytes::from(random(130 << 10, &mut rng)), 0)
        .unwrap();
    drop(store);
    let info = admin::info(&url(&endpoint, "chunked", "")).unwrap();
    let LayoutInfo::Chunk {
        chunks,
        chunk_bytes,
    } = info.layout
    else {
        panic!("a chunk disk: {:?}", info.layout);
    };
    assert_eq!(
        (chunks, chunk_bytes),
        (
            3,
            raw.objects("chunked/chunks/")
                .iter()
                .map(|(_, size)| size)
                .sum()
        )
    );
}

// Goal: resize grows a disk (the data kept, the new part zeroes), refuses while a server
// holds the disk and refuses a shrink over data (chunk layout: --force deletes the chunks
// past the end), each refusal changing nothing. Method: both layouts through the stores,
// the metadata object and listing compared around each refusal.
#[test]
fn resize_grows_and_refuses_a_held_disk_and_a_shrink_over_data() {
    let name = "resize_grows_and_refuses_a_held_disk_and_a_shrink_over_data";
    if !have_moto(name) {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let raw = Raw::new(&moto);
    let endpoint = moto.endpoint();
    let mut rng = rand::rngs::StdRng::seed_from_u64(53);
    for layout in ["log", "chunk"] {
        let parameters = match layout {
            "log" => "&create-size=1M&layout=log",
            _ => "&create-size=1M&layout=chunk&chunk-size=64k",
        };
        let create = url(&endpoint, layout, parameters);
        let data = random(100 << 10, &mut rng);
        let disk = url(&endpoint, layout, "");
        match layout {
            "log" => {
                let store = LogStore::open_locked(&create).unwrap();
                store.write(&data, 300 << 10).unwrap();
                store.flush().unwrap();
                let before = raw.objects(&format!("{layout}/"));
                let held = admin::resize(&disk, 2 << 20, false).unwrap_err();
                assert!(matches!(held, OpenError::Locked { .. }), "{held}");
                assert_eq!(raw.objects(&format!("{layout}/")), before);
                drop(store);
            }
            _ => {
                let store = ChunkStore::open_locked(&create).unwrap();
                store.write(Bytes::from(data.clone()), 300 << 10).unwrap();
                let held = admin::resize(&disk, 2 << 20, false).unwrap_err();
                assert!(matches!(held, OpenError::Locked { .. }), "{held}");
                drop(store);
            }
        }
        let before = raw.objects(&format!("{layout}/"));
        let metadata_key = format!("{layout}/bufcache-disk.json");
        let metadata_before = raw.get(&metadata_key);
        let shrink = admin::resize(&disk, 256 << 10, false).unwrap_err();
        assert!(
            shrink.to_string().contains("nothing was changed"),
            "{shrink}"
        );
        assert_eq!(raw.objects(&format!("{layout}/")), before, "{layout}");
        assert_eq!(raw.get(&metadata_key), metadata_before, "{layout}");
        let odd = admin::resize(&disk, (2 << 20) + 512, false).unwrap_err();
        assert!(odd.to_string().contains("multiple"), "{odd}");

        let grown = admin::resize(&disk, 2 << 20, false).unwrap();
        assert_eq!(
            (grown.size_bytes_before, grown.size_bytes_after),
            (1 << 20, 2 << 20)
        );
        let mut back = vec![1u8; 2 << 20];
        match layout {
            "log" => {
                let store = LogStore::open_locked(&disk).unwrap();
                store.read(&mut back, 0).unwrap();
            }
            _ => {
                let store = ChunkStore::open_locked(&disk).unwrap();
                store.read(&mut back, 0).unwrap();
            }
        }
        let mut expected = vec![0u8; 2 << 20];
        expected[300 << 10..400 << 10].copy_from_slice(&data);
        assert!(back == expected, "{layout}: grown disk reads other bytes");
        // Shrinking to just past the data is allowed.
        admin::resize(&disk, 512 << 10, false).unwrap();
        assert_eq!(admin::info(&disk).unwrap().metadata.size_bytes, 512 << 10);
    }
    // --force on the chunk layout deletes the chunks past the end.
    let forced = admin::resize(&url(&endpoint, "chunk", ""), 256 << 10, true).unwrap();
    assert_eq!(forced.chunks_deleted, 3, "chunks 4 to 6 hold 300..400 KiB");
    assert!(admin::resize(&url(&endpoint, "log", ""), 256 << 10, true).is_err());
}

// Goal: `disk create` makes a disk with the URL's layout and refuses one that exists,
// changing nothing. Method: create a log disk, create it again, compare the metadata object.
#[test]
fn create_refuses_a_disk_that_exists() {
    let name = "create_refuses_a_disk_that_exists";
    if !have_moto(name) {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let raw = Raw::new(&moto);
    let disk = url(&moto.endpoint(), "disk", "&layout=log");
    let created = admin::create(&disk, 8 << 20).unwrap();
    assert_eq!(created.size_bytes, 8 << 20);
    let metadata = raw.get("disk/bufcache-disk.json");
    let again = admin::create(&disk, 16 << 20).unwrap_err();
    assert!(again.to_string().contains("exists"), "{again}");
    assert_eq!(raw.get("disk/bufcache-disk.json"), metadata);
}

// Goal: `disk gc` frees the garbage of overwritten data offline and keeps every byte, is
// refused while a server holds the disk and on a chunk-layout disk. Method: 1 MiB written
// in 64 KiB segments with the collector off, then every other 32 KiB of it overwritten (the
// first segments half live); info before and after, the disk read back whole.
#[test]
fn gc_offline_frees_the_garbage_and_keeps_every_byte() {
    let name = "gc_offline_frees_the_garbage_and_keeps_every_byte";
    if !have_moto(name) {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let endpoint = moto.endpoint();
    let mut rng = rand::rngs::StdRng::seed_from_u64(54);
    let create = url(
        &endpoint,
        "disk",
        "&create-size=2M&layout=log&segment-size=64k&gc=off",
    );
    let store = LogStore::open_locked(&create).unwrap();
    let mut image = vec![0u8; 2 << 20];
    let data = random(1 << 20, &mut rng);
    store.write(&data, 0).unwrap();
    image[..1 << 20].copy_from_slice(&data);
    store.flush().unwrap();
    // Every other 32 KiB overwritten: each first segment keeps about half its bytes live.
    for piece in (0..32).step_by(2) {
        let data = random(32 << 10, &mut rng);
        let offset = piece * (32 << 10);
        store.write(&data, offset as u64).unwrap();
        image[offset..offset + data.len()].copy_from_slice(&data);
    }
    store.flush().unwrap();
    let disk = url(&endpoint, "disk", "");
    let held = admin::collect(&disk, None, &mut |_| {}).unwrap_err();
    assert!(
        matches!(held, admin::CollectError::Open(OpenError::LeaseHeld { .. })),
        "{held}"
    );
    drop(store);
    let garbage = |disk: &S3Url| match admin::info(disk).unwrap().layout {
        LayoutInfo::Log(Ok(log)) => log.garbage_bytes(),
        other => panic!("{other:?}"),
    };
    let before = garbage(&disk);
    let mut rounds_seen = 0;
    let totals =
        admin::collect(&disk, Some(0.9), &mut |totals| rounds_seen = totals.rounds).unwrap();
    let after = garbage(&disk);
    println!("gc: {totals:?}; garbage {before} -> {after} bytes");
    assert_eq!(rounds_seen, totals.rounds);
    assert!(totals.segments_deleted > 0, "{totals:?}");
    assert!(after < before / 4, "garbage {before} -> {after}");
    let store = LogStore::open_read_only(&disk).unwrap();
    let mut back = vec![1u8; 2 << 20];
    store.read(&mut back, 0).unwrap();
    assert!(back == image, "gc changed the disk's bytes");
    drop(store);

    let chunk = url(
        &endpoint,
        "chunked",
        "&create-size=1M&layout=chunk&chunk-size=64k",
    );
    drop(ChunkStore::open_locked(&chunk).unwrap());
    let refused = admin::collect(&url(&endpoint, "chunked", ""), None, &mut |_| {}).unwrap_err();
    assert!(
        matches!(refused, admin::CollectError::NotALog { .. }),
        "{refused}"
    );
}
