//! The threat model of docs/security.md, "The bucket", line by line: what someone who may
//! write to the bucket but has no key can and cannot do to an encrypted log-layout disk.
//! Against moto and SeaweedFS on loopback; the attacker works through the bucket directly.

#[path = "support/raw.rs"]
mod raw;
mod support;

use bufcache_s3::{LogStore, OpenError, S3Url};
use raw::Raw;
use support::{have_moto, have_seaweedfs, Moto, S3Server, SeaweedFs};

/// A key file of 64 hex digits in `directory`.
fn key_file(directory: &std::path::Path) -> String {
    let path = directory.join("disk.key");
    let hex: String = (0..32u8)
        .map(|n| format!("{:02x}", n.wrapping_mul(29).wrapping_add(7)))
        .collect();
    std::fs::write(&path, format!("{hex}\n")).unwrap();
    path.display().to_string()
}

fn open(endpoint: &str, disk: &str, parameters: &str) -> Result<LogStore, OpenError> {
    LogStore::open_locked(
        &S3Url::parse(&format!(
            "s3://bucket/{disk}?endpoint={endpoint}{parameters}"
        ))
        .unwrap(),
    )
}

/// `object` (a segment or checkpoint of another disk) made to claim disk `disk_id` (and, for
/// a segment, sequence `sequence`), its CRCs fixed as anyone can.
fn forge_segment(mut object: Vec<u8>, disk_id: u64, sequence: u64) -> Vec<u8> {
    object[16..24].copy_from_slice(&disk_id.to_le_bytes());
    object[24..32].copy_from_slice(&sequence.to_le_bytes());
    let crc = crc32fast::hash(&object[..60]);
    object[60..64].copy_from_slice(&crc.to_le_bytes());
    object
}

fn forge_checkpoint(mut object: Vec<u8>, disk_id: u64) -> Vec<u8> {
    object[16..24].copy_from_slice(&disk_id.to_le_bytes());
    let end = object.len() - 4;
    let crc = crc32fast::hash(&object[..end]);
    object[end..].copy_from_slice(&crc.to_le_bytes());
    object
}

/// The error text of an open refused for `key`, which must name it and its failed tag.
fn refused_naming(result: Result<LogStore, OpenError>, key: &str) {
    let text = result.err().expect("refused").to_string();
    assert!(text.contains(key) && text.contains("tag"), "{text}");
}

// Goal: each line of the threat model. Without the key, someone who may write to the bucket
// cannot make an encrypted disk serve data of their choosing: a forged segment holding an
// extent in checked blocks (plaintext), one holding a zeroed range, a genuine segment put
// under another name, a forged epoch object and a forged checkpoint are each refused at open
// naming the object; a forged segment with a random tag appended too. They can deny service
// and delete (refused opens, covered in log_refusals.rs), and roll the disk back to an older
// state they saved whole. Method: an encrypted disk holding A, closed (one segment, one
// checkpoint); forged objects made from an unencrypted disk's (its first segment holds
// plaintext in checked blocks, its second only a zeroed range; disk id, sequence and CRCs
// rewritten), put as the next segment of the current epoch (or the next epoch object, or a
// newer checkpoint), then removed; finally an older saved copy of every log object put back
// after B was written: A reads back.
#[test]
fn without_the_key_the_bucket_can_deny_and_roll_back_but_not_forge() {
    let name = "without_the_key_the_bucket_can_deny_and_roll_back_but_not_forge";
    if have_moto(name) {
        the_bucket_cannot_forge(&Moto::start());
    }
}

#[test]
fn without_the_key_the_bucket_can_deny_and_roll_back_but_not_forge_on_seaweedfs() {
    let name = "without_the_key_the_bucket_can_deny_and_roll_back_but_not_forge_on_seaweedfs";
    if have_seaweedfs(name) {
        the_bucket_cannot_forge(&SeaweedFs::start());
    }
}

fn the_bucket_cannot_forge(server: &dyn S3Server) {
    server.create_bucket("bucket");
    let raw = Raw::new(server);
    let endpoint = server.endpoint();
    let directory = tempfile::tempdir().unwrap();
    let key = format!("&key-file={}&gc=off", key_file(directory.path()));
    let store = open(
        &endpoint,
        "disk",
        &format!("&create-size=1M&layout=log{key}"),
    )
    .unwrap();
    let disk_id = store.metadata().disk_id;
    let a = [0xa5u8; 4096];
    store.write(&a, 0).unwrap();
    drop(store);
    let genuine = raw.keys("disk/log/segments");
    assert_eq!(
        genuine,
        ["disk/log/segments/0000000000000001-0000000000000001"]
    );
    // The attacker's material: an unencrypted disk's segments and checkpoint.
    let plain = open(&endpoint, "plain", "&create-size=1M&layout=log&gc=off").unwrap();
    plain
        .write(b"EVIL-PLAINTEXT!!".repeat(256).as_slice(), 0)
        .unwrap();
    drop(plain);
    let mut plain = open(&endpoint, "plain", "&gc=off").unwrap();
    plain.write_zeroes(8192, 4096).unwrap();
    plain.flush().unwrap();
    // Abandoned: the segment holding only a zeroed range stays (a close would delete it).
    plain.stop_gc();
    std::mem::forget(plain);
    let plain_segments = raw.keys("plain/log/segments");
    assert_eq!(plain_segments.len(), 2, "{plain_segments:?}");
    let next = "disk/log/segments/0000000000000002-0000000000000001";
    for (what, object) in [
        ("checked-block extent", raw.get(&plain_segments[0])),
        ("zeroed range", raw.get(&plain_segments[1])),
    ] {
        raw.put(next, forge_segment(object.clone(), disk_id, 2));
        refused_naming(open(&endpoint, "disk", &key), next);
        // A random tag appended does not pass either.
        let mut tagged = forge_segment(object, disk_id, 2);
        tagged.extend_from_slice(&[0x5a; 32]);
        raw.put(next, tagged);
        refused_naming(open(&endpoint, "disk", &key), next);
        raw.delete(next);
        eprintln!("{what}: refused");
    }
    // A genuine segment under another name.
    raw.put(next, raw.get(&genuine[0]));
    refused_naming(open(&endpoint, "disk", &key), next);
    raw.delete(next);
    // A forged epoch object, newer than the checkpoint's writer (so an open reads it): its
    // disk id and CRC rewritten like a checkpoint's, the CRC being the last 4 bytes.
    let forged_epoch = "disk/log/epochs/0000000000000005";
    let plain_epoch = raw.keys("plain/log/epochs")[0].clone();
    raw.put(
        forged_epoch,
        forge_checkpoint(raw.get(&plain_epoch), disk_id),
    );
    refused_naming(open(&endpoint, "disk", &key), forged_epoch);
    raw.delete(forged_epoch);
    // A forged checkpoint, newer than the genuine one: it fails its tag, so the open falls
    // back to the genuine one (whose replay reaches past the forged one's `through`), serves
    // A and none of the forgery, and a writable open deletes it.
    let forged = "disk/log/checkpoints/0000000000000001-0000000000000002";
    let plain_checkpoint = raw.keys("plain/log/checkpoints")[0].clone();
    raw.put(
        forged,
        forge_checkpoint(raw.get(&plain_checkpoint), disk_id),
    );
    let store = open(&endpoint, "disk", &key).unwrap();
    let mut back = vec![0u8; 4096];
    store.read(&mut back, 0).unwrap();
    assert_eq!(back, a, "the genuine checkpoint's data");
    drop(store);
    assert!(!raw
        .keys("disk/log/checkpoints")
        .contains(&forged.to_string()));
    // A forged checkpoint the replay cannot reach past (it claims a `through` beyond the
    // log) is refused naming it.
    let beyond = "disk/log/checkpoints/0000000000000009-0000000000000009";
    raw.put(
        beyond,
        forge_checkpoint(raw.get(&plain_checkpoint), disk_id),
    );
    refused_naming(open(&endpoint, "disk", &key), beyond);
    raw.delete(beyond);
    // Nothing forged is left and the disk reads A; saved whole now, it can be rolled back.
    let saved: Vec<(String, Vec<u8>)> = raw
        .keys("disk/log")
        .into_iter()
        .map(|key| {
            let body = raw.get(&key);
            (key, body)
        })
        .collect();
    let store = open(&endpoint, "disk", &key).unwrap();
    store.read(&mut back, 0).unwrap();
    assert_eq!(back, a);
    store.write(&[0xb6; 4096], 0).unwrap();
    drop(store);
    for key in raw.keys("disk/log") {
        raw.delete(&key);
    }
    for (key, body) in saved {
        raw.put(&key, body);
    }
    let store = open(&endpoint, "disk", &key).unwrap();
    store.read(&mut back, 0).unwrap();
    assert_eq!(
        back, a,
        "rolled back to the saved state: the tags cannot tell"
    );
    drop(store);
    the_small_objects_cannot_be_forged(server, &raw, &key, &plain_checkpoint);
}

/// A change made to a metadata object's JSON by someone without the key.
type Forgery = fn(&mut serde_json::Value);

/// Every object under `prefixes` but the lock, with its bytes: what a refused open must leave
/// as it was.
fn objects_of(raw: &Raw, prefixes: &[&str]) -> Vec<(String, Vec<u8>)> {
    prefixes
        .iter()
        .flat_map(|prefix| raw.keys(prefix))
        .filter(|key| !key.ends_with("bufcache-lock.json"))
        .map(|key| {
            let body = raw.get(&key);
            (key, body)
        })
        .collect()
}

/// The metadata object, snapshots and a clone's base: an encrypted disk `meta` with snapshot
/// `golden` and its clone `meta-clone`; each forgery below is refused naming the object, with
/// nothing changed in the bucket, and the genuine object put back opens again.
fn the_small_objects_cannot_be_forged(
    server: &dyn S3Server,
    raw: &Raw,
    key: &str,
    plain_checkpoint: &str,
) {
    let endpoint = server.endpoint();
    let url = |disk: &str, parameters: &str| {
        S3Url::parse(&format!(
            "s3://bucket/{disk}?endpoint={endpoint}{key}{parameters}"
        ))
        .unwrap()
    };
    let a = [0x3cu8; 4096];
    let store = open(
        &endpoint,
        "meta",
        &format!("{key}&create-size=1M&layout=log"),
    )
    .unwrap();
    store.write(&a, 0).unwrap();
    store.snapshot("golden").unwrap();
    let disk_id = store.metadata().disk_id;
    drop(store);
    bufcache_s3::admin::clone(&url("meta", ""), &url("meta-clone", ""), "golden").unwrap();
    let reads_a = |disk: &str| {
        let store = open(&endpoint, disk, key).unwrap();
        let mut back = vec![0u8; 4096];
        store.read(&mut back, 0).unwrap();
        assert_eq!(back, a, "{disk}");
    };
    reads_a("meta");
    reads_a("meta-clone");
    let prefixes = ["meta", "meta-clone"];
    // The metadata object: each change is refused by a writable and a read-only open, and by
    // `disk resize`, naming the object.
    let metadata_key = "meta/bufcache-disk.json";
    let genuine = raw.get(metadata_key);
    let value: serde_json::Value = serde_json::from_slice(&genuine).unwrap();
    assert!(value["metadata_tag"].is_string(), "{value}");
    let forgeries: [(&str, Forgery); 6] = [
        ("size up", |value| value["size_bytes"] = (2u64 << 20).into()),
        ("size down", |value| {
            value["size_bytes"] = (512u64 << 10).into()
        }),
        ("compression", |value| value["compress"] = "zstd".into()),
        ("generation", |value| value["generation"] = 77.into()),
        ("tag removed", |value| {
            value.as_object_mut().unwrap().remove("metadata_tag");
        }),
        ("passed off as written before metadata tags", |value| {
            value.as_object_mut().unwrap().remove("metadata_tag");
            value["encryption"] = "xchacha20-poly1305+hmac-sha256".into();
        }),
    ];
    for (what, forge) in forgeries {
        let mut forged = value.clone();
        forge(&mut forged);
        raw.put(metadata_key, forged.to_string().into_bytes());
        let before = objects_of(raw, &prefixes);
        for result in [
            open(&endpoint, "meta", key),
            LogStore::open_read_only(&url("meta", "")),
        ] {
            let text = result.err().expect(what).to_string();
            assert!(text.contains(metadata_key), "{what}: {text}");
        }
        let text = bufcache_s3::admin::resize(&url("meta", ""), 4 << 20, false)
            .unwrap_err()
            .to_string();
        assert!(text.contains(metadata_key), "{what}: {text}");
        assert!(
            objects_of(raw, &prefixes) == before,
            "{what}: a refused open changed the bucket"
        );
        eprintln!("metadata, {what}: refused");
    }
    raw.put(metadata_key, genuine.clone());
    reads_a("meta");
    // Snapshots: a genuine one under another name, and one forged from an unencrypted
    // disk's checkpoint, are refused naming them.
    let evil = "meta/log/snapshots/evil";
    for (what, object) in [
        ("renamed", raw.get("meta/log/snapshots/golden")),
        (
            "forged",
            forge_checkpoint(raw.get(plain_checkpoint), disk_id),
        ),
    ] {
        raw.put(evil, object);
        let before = objects_of(raw, &prefixes);
        refused_naming(open(&endpoint, "meta", key), evil);
        assert!(
            objects_of(raw, &prefixes) == before,
            "snapshot {what}: a refused open changed the bucket"
        );
        raw.delete(evil);
        eprintln!("snapshot {what}: refused");
    }
    // A clone's base, carried in its metadata: another snapshot, another base disk id.
    let clone_key = "meta-clone/bufcache-disk.json";
    let genuine_clone = raw.get(clone_key);
    let clone_value: serde_json::Value = serde_json::from_slice(&genuine_clone).unwrap();
    let forgeries: [(&str, Forgery); 2] = [
        ("snapshot", |value| {
            value["base"]["snapshot"] = "other".into()
        }),
        ("base prefix", |value| {
            value["base"]["prefix"] = "disk".into()
        }),
    ];
    for (what, forge) in forgeries {
        let mut forged = clone_value.clone();
        forge(&mut forged);
        raw.put(clone_key, forged.to_string().into_bytes());
        let before = objects_of(raw, &prefixes);
        refused_naming(open(&endpoint, "meta-clone", key), clone_key);
        assert!(
            objects_of(raw, &prefixes) == before,
            "clone base {what}: a refused open changed the bucket"
        );
        eprintln!("clone base, {what}: refused");
    }
    raw.put(clone_key, genuine_clone);
    reads_a("meta-clone");
}

/// The key check an encrypted disk's metadata recorded before metadata tags existed: the
/// nonce and tag of an empty message sealed with `key`, its associated data the first key
/// check context and the disk id (seal.rs).
fn key_check_before_tags(key: &[u8; 32], disk_id: u64) -> String {
    use chacha20poly1305::aead::{Aead, Payload};
    use chacha20poly1305::{KeyInit, XChaCha20Poly1305, XNonce};
    let nonce = [9u8; 24];
    let mut aad = b"bufcache-s3 key check v1".to_vec();
    aad.extend_from_slice(&disk_id.to_le_bytes());
    let tag = XChaCha20Poly1305::new(key.into())
        .encrypt(
            &XNonce::from(nonce),
            Payload {
                msg: &[],
                aad: &aad,
            },
        )
        .unwrap();
    nonce
        .iter()
        .chain(tag.iter())
        .map(|byte| format!("{byte:02x}"))
        .collect()
}

// Goal: an encrypted disk whose metadata object was written before metadata tags existed
// still opens (no disk is made unopenable by the upgrade), but never silently: a read-only
// open accepts it with a warning and changes nothing, the first writable open tags it (its
// key check proves the key) and from then on a change made without the key is refused, and
// removing the tag again (passing it off as old) is refused too. Method: an encrypted disk
// holding A, its metadata object rewritten as the previous version wrote it (no tag, the
// previous `encryption`, a key check in the previous context); open read-only, then
// writable, then forge its size and strip its tag.
#[test]
fn metadata_written_before_tags_opens_and_the_first_writable_open_tags_it() {
    let name = "metadata_written_before_tags_opens_and_the_first_writable_open_tags_it";
    if !have_moto(name) {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let raw = Raw::new(&moto);
    let endpoint = moto.endpoint();
    let directory = tempfile::tempdir().unwrap();
    let key_path = key_file(directory.path());
    let key_bytes: [u8; 32] = std::array::from_fn(|n| (n as u8).wrapping_mul(29).wrapping_add(7));
    let key = format!("&key-file={key_path}");
    let store = open(
        &endpoint,
        "disk",
        &format!("{key}&create-size=1M&layout=log"),
    )
    .unwrap();
    let a = [0x71u8; 4096];
    store.write(&a, 8192).unwrap();
    let disk_id = store.metadata().disk_id;
    drop(store);
    let metadata_key = "disk/bufcache-disk.json";
    let mut old: serde_json::Value = serde_json::from_slice(&raw.get(metadata_key)).unwrap();
    let object = old.as_object_mut().unwrap();
    object.remove("metadata_tag");
    object.insert(
        "encryption".to_string(),
        "xchacha20-poly1305+hmac-sha256".into(),
    );
    object.insert(
        "key_check".to_string(),
        key_check_before_tags(&key_bytes, disk_id).into(),
    );
    let old = old.to_string().into_bytes();
    raw.put(metadata_key, old.clone());
    let reads_a = |store: &LogStore| {
        let mut back = vec![0u8; 4096];
        store.read(&mut back, 8192).unwrap();
        assert_eq!(back, a);
    };
    let url = S3Url::parse(&format!("s3://bucket/disk?endpoint={endpoint}{key}")).unwrap();
    let store = LogStore::open_read_only(&url).unwrap();
    reads_a(&store);
    drop(store);
    assert_eq!(
        raw.get(metadata_key),
        old,
        "a read-only open writes nothing"
    );
    let store = open(&endpoint, "disk", &key).unwrap();
    reads_a(&store);
    drop(store);
    let tagged: serde_json::Value = serde_json::from_slice(&raw.get(metadata_key)).unwrap();
    assert!(tagged["metadata_tag"].is_string(), "{tagged}");
    assert_ne!(tagged["encryption"], "xchacha20-poly1305+hmac-sha256");
    let store = open(&endpoint, "disk", &key).unwrap();
    reads_a(&store);
    drop(store);
    let mut forged = tagged.clone();
    forged["size_bytes"] = (2u64 << 20).into();
    raw.put(metadata_key, forged.to_string().into_bytes());
    let text = open(&endpoint, "disk", &key).err().unwrap().to_string();
    assert!(
        text.contains(metadata_key) && text.contains("tag"),
        "{text}"
    );
    let mut stripped = tagged.clone();
    stripped.as_object_mut().unwrap().remove("metadata_tag");
    stripped["encryption"] = "xchacha20-poly1305+hmac-sha256".into();
    raw.put(metadata_key, stripped.to_string().into_bytes());
    let text = open(&endpoint, "disk", &key).err().unwrap().to_string();
    assert!(
        text.contains(metadata_key) && text.contains("key check"),
        "{text}"
    );
}
