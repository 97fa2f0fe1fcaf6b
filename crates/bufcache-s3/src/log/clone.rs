//! Clones of a snapshot: a writable log-layout disk whose reads of what it has not written
//! fall through to the segments a snapshot of another disk (its base, in the same bucket or
//! another bucket of the same store) names. No data is copied.
//!
//! - The clone's metadata object (format version 4, `FORMAT_VERSION_LOG_CLONE`) carries its
//!   base: `"base":{"prefix":P,"disk_id":"16 hex digits","snapshot":NAME}`, with
//!   `"bucket":B` when the base is in another bucket (reached with the clone URL's endpoint,
//!   region and credentials: a clone records where its base is, not how to reach the store),
//!   so creating a clone writes two objects (the clone record below, then the metadata, both
//!   create-only).
//!   Clones made before that carry it in `PREFIX/log/base` (format below) beside a version 2
//!   metadata object, and are still read so. An open reads the base's reference, the base's
//!   metadata and the snapshot, and starts from the snapshot's index; the clone's own log
//!   starts after the snapshot's `through`, so a sequence at or below it is the base's
//!   segment (read with the base's key and under the base's prefix, with the owners the
//!   snapshot records), one above it the clone's own.
//! - The clone never deletes or rewrites a base segment: they are not among its stored
//!   segments, which its collector and cleanup alone consider. The base keeps them because
//!   the snapshot pins them (module `snapshot`), and the snapshot stays because the base
//!   holds a clone record `PREFIX/log/clones/<NAME>/<hex of the clone's prefix>` (a clone in
//!   another bucket: `<hex of its bucket>-<hex of its prefix>`; its body the clone's
//!   `s3://BUCKET/PREFIX`), which `disk delete-snapshot` refuses over, naming it.
//!
//! Format of `log/base` (integers little-endian), tagged as every object of an encrypted
//! clone is:
//!
//! ```text
//!  0  magic "BCLOGBAS"   8 format version u32 (1)   12 reserved u32 (0)
//! 16  clone's disk id u64    24 base's disk id u64
//! 32  snapshot name length u16, name bytes; base prefix length u16, prefix bytes
//! end CRC-32 (IEEE) of every byte before it u32
//! ```

use std::sync::Arc;

#[cfg(test)]
use bytes::{BufMut, Bytes, BytesMut};
use object_store::ObjectStore;

use super::{check_layout, epoch, snapshot, Index, LogConfig};
use crate::error::{DecodeError, OpenError};
use crate::seal::Sealer;
use crate::store::{
    Buckets, ChunkStore, Create, DiskMetadata, FORMAT_VERSION_LOG_CLONE, METADATA_NAME,
};
use crate::url::{snapshot_name_problem, S3Url};

const MAGIC: &[u8; 8] = b"BCLOGBAS";
const FORMAT_VERSION: u32 = 1;

/// The name of a clone's base record under its prefix (clones made before the metadata
/// carried the base).
pub(crate) const BASE_NAME: &str = "log/base";

/// A clone's base: the segments at or below `through` are the base disk's.
pub(super) struct Base {
    /// The base disk (its bucket and prefix; the clone's endpoint and parameters).
    pub url: S3Url,
    /// The client for the base's bucket when it is not the clone's (None: the clone's own).
    pub store: Option<Arc<dyn ObjectStore>>,
    /// The owners of the base's segments, as the snapshot records them.
    pub epochs: epoch::Epochs,
    /// The last segment of the base's log the snapshot covers.
    pub through: u64,
    /// Unseals the base's extents (its disk id and key).
    pub sealer: Arc<Sealer>,
}

/// What a clone's base record says.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Record {
    pub clone_disk_id: u64,
    pub base_disk_id: u64,
    pub snapshot: String,
    pub base_prefix: String,
    /// The base's bucket when it is not the clone's.
    pub base_bucket: Option<String>,
}

/// Encodes a base record (written by clones made before the metadata carried the base;
/// kept to test that they are still read).
#[cfg(test)]
fn encode(record: &Record) -> Bytes {
    let mut object = BytesMut::new();
    object.put_slice(MAGIC);
    object.put_u32_le(FORMAT_VERSION);
    object.put_u32_le(0);
    object.put_u64_le(record.clone_disk_id);
    object.put_u64_le(record.base_disk_id);
    for text in [&record.snapshot, &record.base_prefix] {
        let length = u16::try_from(text.len()).expect("names and prefixes are short");
        object.put_u16_le(length);
        object.put_slice(text.as_bytes());
    }
    let checksum = crc32fast::hash(&object);
    object.put_u32_le(checksum);
    object.freeze()
}

fn decode(object: &[u8], clone_disk_id: u64) -> Result<Record, DecodeError> {
    if object.len() < 40 || &object[..8] != MAGIC {
        return Err(DecodeError::Inconsistent(
            "not a bufcache clone base record (magic `BCLOGBAS`)".to_string(),
        ));
    }
    let (body, stored) = object.split_at(object.len() - 4);
    if crc32fast::hash(body) != u32::from_le_bytes(stored.try_into().expect("4 bytes")) {
        return Err(DecodeError::BadCrc {
            part: "object",
            meaning: "corrupt or truncated",
        });
    }
    let version = u32::from_le_bytes(body[8..12].try_into().expect("4 bytes"));
    if version != FORMAT_VERSION {
        return Err(DecodeError::Inconsistent(format!(
            "clone base record format version {version} is not a supported one ({FORMAT_VERSION})"
        )));
    }
    let u64_at = |at: usize| u64::from_le_bytes(body[at..at + 8].try_into().expect("8 bytes"));
    let (stored_clone, base_disk_id) = (u64_at(16), u64_at(24));
    if stored_clone != clone_disk_id {
        return Err(DecodeError::Inconsistent(format!(
            "belongs to disk {stored_clone:016x}, not this disk {clone_disk_id:016x}"
        )));
    }
    let mut at = 32;
    let mut texts = Vec::new();
    for _ in 0..2 {
        let length = body
            .get(at..at + 2)
            .map(|bytes| u16::from_le_bytes(bytes.try_into().expect("2 bytes")) as usize)
            .ok_or(DecodeError::Inconsistent("truncated".to_string()))?;
        let text = body
            .get(at + 2..at + 2 + length)
            .ok_or(DecodeError::Inconsistent("truncated".to_string()))?;
        texts.push(
            String::from_utf8(text.to_vec())
                .map_err(|_| DecodeError::Inconsistent("a name that is not UTF-8".to_string()))?,
        );
        at += 2 + length;
    }
    if at != body.len() {
        return Err(DecodeError::Inconsistent(format!(
            "{} bytes after the prefix",
            body.len() - at
        )));
    }
    let base_prefix = texts.pop().expect("two texts");
    let snapshot = texts.pop().expect("two texts");
    Ok(Record {
        clone_disk_id,
        base_disk_id,
        snapshot,
        base_prefix,
        base_bucket: None,
    })
}

/// A new clone's metadata and its object's JSON: a log-layout disk of `size_bytes` with the
/// URL's compression and key, carrying its base (format version 4; `base_bucket` only when
/// it is not the clone's); and its record.
pub(crate) fn new_metadata(
    url: &S3Url,
    size_bytes: u64,
    base_disk_id: u64,
    snapshot: &str,
    base_prefix: &str,
    base_bucket: Option<&str>,
) -> Result<(DiskMetadata, serde_json::Value, Record), OpenError> {
    let (mut metadata, mut body) = crate::store::new_log_metadata(url, size_bytes)?;
    metadata.format_version = FORMAT_VERSION_LOG_CLONE;
    body["format_version"] = FORMAT_VERSION_LOG_CLONE.into();
    let record = Record {
        clone_disk_id: metadata.disk_id,
        base_disk_id,
        snapshot: snapshot.to_string(),
        base_prefix: base_prefix.to_string(),
        base_bucket: base_bucket
            .filter(|bucket| *bucket != url.bucket)
            .map(str::to_string),
    };
    body["base"] = serde_json::json!({
        "prefix": record.base_prefix,
        "disk_id": format!("{base_disk_id:016x}"),
        "snapshot": record.snapshot,
    });
    if let Some(bucket) = &record.base_bucket {
        body["base"]["bucket"] = bucket.as_str().into();
    }
    Ok((metadata, body, record))
}

/// The base a version 4 clone's metadata object carries.
pub(crate) fn record_from_metadata(
    value: &serde_json::Value,
    clone_disk_id: u64,
) -> Result<Record, DecodeError> {
    let base = &value["base"];
    let text = |name: &str| {
        base[name].as_str().map(str::to_string).ok_or_else(|| {
            DecodeError::Inconsistent(format!("field `base.{name}` is missing or not a string"))
        })
    };
    let base_prefix = text("prefix")?;
    let snapshot = text("snapshot")?;
    if let Some(problem) = snapshot_name_problem(&snapshot) {
        return Err(DecodeError::Inconsistent(format!(
            "field `base.snapshot`: {problem}"
        )));
    }
    let base_disk_id = text("disk_id")?;
    let base_disk_id = (base_disk_id.len() == 16)
        .then(|| u64::from_str_radix(&base_disk_id, 16).ok())
        .flatten()
        .ok_or(DecodeError::Inconsistent(
            "field `base.disk_id` is not 16 hex digits".to_string(),
        ))?;
    // Absent: the base is in the clone's bucket.
    let base_bucket = if base["bucket"].is_null() {
        None
    } else {
        let bucket = text("bucket")?;
        if bucket.is_empty() {
            return Err(DecodeError::Inconsistent(
                "field `base.bucket` is empty".to_string(),
            ));
        }
        Some(bucket)
    };
    Ok(Record {
        clone_disk_id,
        base_disk_id,
        snapshot,
        base_prefix,
        base_bucket,
    })
}

/// The base disk's URL: the clone's with the base's bucket and prefix (same endpoint, key
/// file).
pub(crate) fn base_url(url: &S3Url, record: &Record) -> S3Url {
    let mut base = url.clone();
    if let Some(bucket) = &record.base_bucket {
        base.bucket = bucket.clone();
    }
    base.prefix = record.base_prefix.clone();
    base.snapshot = None;
    base.create_size_bytes = None;
    base.compression = None;
    base
}

fn hex(text: &str) -> String {
    text.bytes().map(|byte| format!("{byte:02x}")).collect()
}

fn unhex(hex: &str) -> Option<String> {
    let bytes: Option<Vec<u8>> = (0..hex.len() / 2)
        .map(|at| u8::from_str_radix(hex.get(at * 2..at * 2 + 2)?, 16).ok())
        .collect();
    String::from_utf8(bytes.filter(|_| hex.len().is_multiple_of(2))?).ok()
}

/// The key of the clone record of the clone at `clone` under the base's snapshot: its last
/// part the hex of the clone's prefix, or for a clone in another bucket the hex of its
/// bucket, `-` and the hex of its prefix (hex holds no `-`, so the two never meet).
pub(crate) fn record_key(base: &S3Url, snapshot: &str, clone: &S3Url) -> String {
    let name = if clone.bucket == base.bucket {
        hex(&clone.prefix)
    } else {
        format!("{}-{}", hex(&clone.bucket), hex(&clone.prefix))
    };
    base.key(&format!("log/clones/{snapshot}/{name}"))
}

/// The clone a record's key names, as `s3://BUCKET/PREFIX` ([`record_key`]); None for a
/// name that is not a record's.
pub(crate) fn recorded_clone(base: &S3Url, record_name: &str) -> Option<String> {
    let (bucket, prefix) = match record_name.split_once('-') {
        Some((bucket, prefix)) => (unhex(bucket).filter(|bucket| !bucket.is_empty())?, prefix),
        None => (base.bucket.clone(), record_name),
    };
    Some(format!("s3://{bucket}/{}", unhex(prefix)?))
}

/// Reads a clone's base (None for a disk that is no clone): its record, the base's metadata
/// and the snapshot, whose index the clone starts from; a base in another bucket through a
/// client `buckets` makes.
pub(super) async fn read_base(
    store: &dyn ObjectStore,
    buckets: &Buckets,
    url: &S3Url,
    metadata: &DiskMetadata,
    sealer: &Sealer,
) -> Result<Option<(Base, Index)>, OpenError> {
    let Some((key, record)) = read_record(store, url, metadata, sealer).await? else {
        return Ok(None);
    };
    let base_store = match &record.base_bucket {
        Some(bucket) if *bucket != url.bucket => Some(buckets.store(bucket)?),
        _ => None,
    };
    read_base_of(store, base_store, url, key, record).await
}

/// What names a clone's base (None for a disk that is no clone), and the key it was read
/// from: the metadata of a version 4 clone, else `log/base` (one GET either way).
pub(crate) async fn read_record(
    store: &dyn ObjectStore,
    url: &S3Url,
    metadata: &DiskMetadata,
    sealer: &Sealer,
) -> Result<Option<(String, Record)>, OpenError> {
    let (key, record) = if metadata.format_version == FORMAT_VERSION_LOG_CLONE {
        let key = url.key(METADATA_NAME);
        let value = crate::store::read_metadata_json(store, url).await?;
        let record = record_from_metadata(&value, metadata.disk_id).map_err(|reason| {
            OpenError::BadMetadata {
                url: url.to_string(),
                key: key.clone(),
                reason,
            }
        })?;
        (key, record)
    } else {
        let key = url.key(BASE_NAME);
        let what = format!("the clone base record `{key}`");
        let Some(body) = crate::store::get_optional(store, url, &key, &what).await? else {
            return Ok(None);
        };
        let record = sealer
            .check_object(BASE_NAME, &body)
            .and_then(|body| decode(body, metadata.disk_id))
            .map_err(|reason| super::bad_object(url, &key, reason))?;
        (key, record)
    };
    Ok(Some((key, record)))
}

async fn read_base_of(
    store: &dyn ObjectStore,
    base_store: Option<Arc<dyn ObjectStore>>,
    url: &S3Url,
    key: String,
    record: Record,
) -> Result<Option<(Base, Index)>, OpenError> {
    let mut base = base_url(url, &record);
    let reading: &dyn ObjectStore = base_store.as_deref().unwrap_or(store);
    let base_metadata = ChunkStore::open_metadata(reading, &base, Create::Never).await?;
    if base_metadata.seal.key_check.is_none() {
        // An unencrypted base under an encrypted clone: the clone's key is not the base's.
        base.key_file = None;
    }
    if base_metadata.disk_id != record.base_disk_id {
        return Err(super::bad_object(
            url,
            &key,
            DecodeError::Inconsistent(format!(
                "names base disk {:016x} at `{}`, which holds disk {:016x} now",
                record.base_disk_id, record.base_prefix, base_metadata.disk_id
            )),
        ));
    }
    if base_metadata.format_version == FORMAT_VERSION_LOG_CLONE {
        return Err(super::bad_object(
            url,
            &key,
            DecodeError::Inconsistent(format!(
                "names `{}` as its base, which is a clone itself (a clone of a clone is not supported)",
                record.base_prefix
            )),
        ));
    }
    let base_sealer = check_layout(&base, &base_metadata, &LogConfig::default())?;
    let taken = snapshot::read(
        reading,
        &base,
        &base_metadata,
        &base_sealer,
        &record.snapshot,
    )
    .await?
    .ok_or_else(|| OpenError::LostObjects {
        url: url.to_string(),
        missing: vec![base.key(&snapshot::snapshot_name(&record.snapshot))],
        evidence: format!(
            "this disk is a clone of snapshot `{}` of {base} (record `{key}`)",
            record.snapshot
        ),
    })?;
    let epochs = taken.epochs.expect("snapshot::decode refuses version 1");
    Ok(Some((
        Base {
            url: base,
            store: base_store,
            epochs,
            through: taken.through_sequence,
            sealer: Arc::new(base_sealer),
        },
        taken.index,
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: the base a clone's metadata carries round-trips, and a bad field is an error
    // naming it. Method: build a clone's metadata, read the base back, break each field.
    #[test]
    fn the_base_in_a_clone_metadata_round_trips_and_bad_fields_are_named() {
        let url = S3Url::parse("s3://bucket/clone?endpoint=http://127.0.0.1:1").unwrap();
        let (metadata, body, record) =
            new_metadata(&url, 1 << 20, 0xab, "golden", "disks/base", None).unwrap();
        assert_eq!(metadata.format_version, FORMAT_VERSION_LOG_CLONE);
        assert_eq!(body["format_version"], FORMAT_VERSION_LOG_CLONE);
        assert_eq!(
            record_from_metadata(&body, metadata.disk_id).unwrap(),
            record
        );
        assert_eq!(
            (
                record.base_disk_id,
                record.snapshot.as_str(),
                record.base_prefix.as_str()
            ),
            (0xab, "golden", "disks/base")
        );
        let (other, other_body, other_record) =
            new_metadata(&url, 1 << 20, 0xab, "golden", "disks/base", Some("bases")).unwrap();
        assert_eq!(other_body["base"]["bucket"], "bases");
        assert_eq!(other_record.base_bucket.as_deref(), Some("bases"));
        assert_eq!(
            record_from_metadata(&other_body, other.disk_id).unwrap(),
            other_record
        );
        assert_eq!(base_url(&url, &other_record).bucket, "bases");
        assert_eq!(base_url(&url, &record).bucket, "bucket");
        // The clone's own bucket named as the base's is recorded as no bucket.
        let (_, same_body, same_record) =
            new_metadata(&url, 1 << 20, 0xab, "golden", "disks/base", Some("bucket")).unwrap();
        assert!(same_body["base"]["bucket"].is_null());
        assert_eq!(same_record.base_bucket, None);
        for (field, value, says) in [
            ("bucket", serde_json::json!(""), "base.bucket"),
            ("bucket", serde_json::json!(3), "base.bucket"),
            ("prefix", serde_json::json!(7), "base.prefix"),
            ("snapshot", serde_json::json!("a/b"), "base.snapshot"),
            ("disk_id", serde_json::json!("xyz"), "base.disk_id"),
            ("disk_id", serde_json::Value::Null, "base.disk_id"),
        ] {
            let mut broken = body.clone();
            broken["base"][field] = value;
            let error = record_from_metadata(&broken, metadata.disk_id).unwrap_err();
            assert!(error.to_string().contains(says), "{field}: {error}");
        }
    }

    // Goal: a clone record's key names the clone it was made for, in the base's bucket or
    // another, and nothing else reads as one. Method: make keys for clones in both, read
    // the clone back from each key's last part; try names that are no record's.
    #[test]
    fn clone_record_keys_name_their_clone_in_any_bucket() {
        let base = S3Url::parse("s3://bases/disks/vm?endpoint=http://127.0.0.1:1").unwrap();
        for clone in [
            "s3://bases/clones/a?endpoint=http://127.0.0.1:1",
            "s3://other/clones/a?endpoint=http://127.0.0.1:1",
            "s3://other-bucket.x/?endpoint=http://127.0.0.1:1",
        ] {
            let clone = S3Url::parse(clone).unwrap();
            let key = record_key(&base, "golden", &clone);
            assert!(key.starts_with("disks/vm/log/clones/golden/"), "{key}");
            let name = key.rsplit('/').next().unwrap();
            assert_eq!(
                recorded_clone(&base, name),
                Some(format!("s3://{}/{}", clone.bucket, clone.prefix)),
                "{key}"
            );
        }
        for name in ["zz", "abc", "-6162", "6162-zz"] {
            assert_eq!(recorded_clone(&base, name), None, "{name}");
        }
    }

    // Goal: a base record round-trips, and damage or another disk's record is an error.
    // Method: encode one, decode it, flip every byte.
    #[test]
    fn clone_base_records_round_trip_and_every_flipped_byte_is_detected() {
        let record = Record {
            clone_disk_id: 7,
            base_disk_id: 9,
            snapshot: "before-upgrade".to_string(),
            base_prefix: "disks/vm1".to_string(),
            base_bucket: None,
        };
        let object = encode(&record);
        assert_eq!(decode(&object, 7).unwrap(), record);
        assert!(decode(&object, 8).unwrap_err().to_string().contains("disk"));
        for byte in 0..object.len() {
            let mut damaged = object.to_vec();
            damaged[byte] ^= 1;
            assert!(decode(&damaged, 7).is_err(), "byte {byte}");
        }
    }
}
