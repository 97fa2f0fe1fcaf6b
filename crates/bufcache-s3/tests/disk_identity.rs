//! Goal: an S3 disk's identity is the id its metadata object records, written when the disk is
//! made (or, for a disk made before chunk disks had one, at its first writable open) and never
//! changed by an open; every writable open raises the generation, a read-only open writes
//! nothing, and an open whose probe is stale changes nothing. Method: moto; the metadata object
//! read and (for the older disk) written directly beside the store under test.

#[path = "support/raw.rs"]
mod raw;
mod support;

use bufcache_s3::{advance_generation, disk_identity, probe, S3Device, S3Url};
use raw::Raw;
use support::{have_moto, Moto};

fn url(endpoint: &str, prefix: &str, parameters: &str) -> S3Url {
    S3Url::parse(&format!(
        "s3://bucket/{prefix}?endpoint={endpoint}{parameters}"
    ))
    .unwrap()
}

// Goal: a new disk of either layout has an id from the start, which every later open keeps
// whatever its URL's parameters, while each writable open raises the generation by one.
// Method: create a chunk and a log disk, open each again with other parameters (retry
// timeout, create size), compare ids and generations with what probe reads.
#[test]
fn a_new_disk_has_an_id_that_opens_keep_and_each_writable_open_raises_the_generation() {
    if !have_moto(
        "a_new_disk_has_an_id_that_opens_keep_and_each_writable_open_raises_the_generation",
    ) {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    for layout in ["chunk", "log"] {
        let create = url(
            &moto.endpoint(),
            layout,
            &format!("&create-size=8M&layout={layout}"),
        );
        let first = S3Device::open_locked(&create).unwrap();
        let state = first.state();
        let id = state.disk_id.expect("a new disk has an id");
        assert_eq!(state.generation, 1, "{layout}: the creating open");
        drop(first);
        let seen = probe(&url(&moto.endpoint(), layout, "")).unwrap().unwrap();
        assert_eq!((seen.disk_id, seen.generation), (Some(id), 1), "{layout}");
        let again = S3Device::open_locked(&url(
            &moto.endpoint(),
            layout,
            "&retry-timeout-ms=2000&create-size=8M",
        ))
        .unwrap();
        assert_eq!(again.state().disk_id, Some(id), "{layout}: the id changed");
        assert_eq!(again.state().generation, 2, "{layout}");
        assert!(disk_identity(id).starts_with("s3-disk:"));
    }
}

// Goal: a chunk disk made before chunk disks had an id gets one at its first writable open
// (every other field kept), a read-only open writes nothing, and an open whose probe saw
// another generation is refused without writing. Method: put an older metadata object by
// hand; probe; open read-only (the object unchanged); advance with a stale generation (an
// error, the object unchanged); open for writing (id and generation 1 recorded, the other
// fields as they were).
#[test]
fn an_older_chunk_disk_gets_an_id_at_its_first_writable_open_and_only_then() {
    if !have_moto("an_older_chunk_disk_gets_an_id_at_its_first_writable_open_and_only_then") {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let raw = Raw::new(&moto);
    let older = br#"{"format":"bufcache-s3","format_version":3,"size_bytes":8388608,"chunk_size_bytes":1048576,"chunk_checksums":"crc32-4k"}"#;
    raw.put("old/bufcache-disk.json", older.to_vec());
    let disk = url(&moto.endpoint(), "old", "");
    let seen = probe(&disk).unwrap().unwrap();
    assert_eq!((seen.disk_id, seen.generation), (None, 0));
    let read_only = S3Device::open_read_only(&disk).unwrap();
    assert_eq!(read_only.state().disk_id, None);
    drop(read_only);
    assert_eq!(raw.get("old/bufcache-disk.json"), older.to_vec());
    assert!(advance_generation(&disk, Some(5), 0xabc).is_err());
    assert_eq!(
        raw.get("old/bufcache-disk.json"),
        older.to_vec(),
        "a stale advance wrote"
    );
    let device = S3Device::open_locked_after_probe(
        &disk,
        Some(&seen),
        0xabc,
        bufcache_s3::StoreMeters::new(),
    )
    .unwrap();
    assert_eq!(device.state().disk_id, Some(0xabc));
    assert_eq!(device.state().generation, 1);
    drop(device);
    let metadata: serde_json::Value =
        serde_json::from_slice(&raw.get("old/bufcache-disk.json")).unwrap();
    assert_eq!(metadata["disk_id"], "0000000000000abc");
    assert_eq!(metadata["generation"], 1);
    assert_eq!(metadata["chunk_checksums"], "crc32-4k");
    assert_eq!(metadata["size_bytes"], 8388608);
    assert_eq!(metadata["chunk_size_bytes"], 1048576);
}
