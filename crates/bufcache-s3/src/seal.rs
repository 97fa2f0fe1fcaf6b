//! Sealing of extents: optional compression (zstd or LZ4) and authenticated encryption
//! (XChaCha20-Poly1305), per extent, for the log layout.
//!
//! Both are chosen when a disk is created (`compress=`, `key-file=`) and recorded in its
//! metadata object ([`SealParameters`]): the compression by name, the encryption as a key
//! check value (a random nonce and the tag of an empty message whose associated data is the
//! disk id), never the key. Opening an encrypted disk needs the key file, and a wrong key is
//! refused at open by that check, before anything is read or written.
//!
//! A sealed extent's stored bytes (its frame):
//!
//! ```text
//! flags u8 (bit 0: compressed, bit 1: encrypted)
//! [nonce, 24 random bytes]              encrypted only
//! body: the (compressed) bytes, encrypted when bit 1 is set
//! [tag, 16 bytes]                       encrypted only
//! CRC-32 (IEEE) of every byte before it u32
//! ```
//!
//! The associated data of an encrypted body binds the disk id, the segment sequence, the
//! extent's disk offset and its flags, so an extent moved to another place, segment or disk
//! (or replayed from an older segment under a newer one's name) fails authentication. The
//! CRC tells damage from a wrong binding in messages and protects compressed-only extents.
//! The random 24-byte nonce makes a nonce collision negligible for any number of extents.
//!
//! Every object of an encrypted disk (segment, checkpoint, epoch object) ends with a tag:
//! HMAC-SHA256, keyed with a key derived from the disk's key and id, over the object's name
//! under the disk's prefix and all its bytes before the tag ([`Sealer::tag_object`],
//! [`Sealer::check_object`]). Without the key nobody can make an object an open accepts:
//! not a segment whose extents are stored plain or zeroed, not an extent table, a header,
//! a checkpoint or an epoch object, nor one object renamed as another. Disks encrypted
//! before the tag existed record `encryption` "xchacha20-poly1305" and are refused
//! ([`Sealer::open`]); those with the tag record "xchacha20-poly1305+hmac-sha256", which the
//! versions before it refuse in turn.
//!
//! The metadata object (JSON) carries its tag in a field, [`METADATA_TAG_FIELD`], over its
//! canonical JSON without that field ([`Sealer::tag_metadata`], [`Sealer::check_metadata`]),
//! and records "xchacha20-poly1305+hmac-sha256+metadata-tag". Its key check is then made
//! under another context, so nobody without the key can strip the tag and pass the object
//! off as metadata written before metadata tags, which is accepted untagged (and tagged by
//! the next writable open).
//!
//! Extents are sealed in pieces of at most [`SEALED_EXTENT_BYTES_MAX`] logical bytes, since a
//! sealed extent can only be read whole: a 4 KiB read of one fetches at most that much.
//! Without encryption an extent compression does not shrink is stored as written (plain),
//! and read by ranges as before.

use std::path::Path;

use bytes::{Bytes, BytesMut};
use chacha20poly1305::aead::{Aead, Payload};
use chacha20poly1305::{Key, KeyInit, XChaCha20Poly1305, XNonce};
use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::{DecodeError, OpenError};
use crate::url::{Compression, S3Url, METADATA_NAME};

/// Most logical bytes of one sealed extent: a read of any byte of it fetches and unseals it
/// whole, so this bounds the read amplification of small reads (16 × for 4 KiB) while keeping
/// the per-extent costs (a table entry, a frame, zstd's per-frame overhead) small.
pub const SEALED_EXTENT_BYTES_MAX: u64 = 64 << 10;
/// zstd level: 3, the library's default, compresses at hundreds of MB/s per core.
const ZSTD_LEVEL: i32 = 3;
const NONCE_BYTES: usize = 24;
const TAG_BYTES: usize = 16;
const CRC_BYTES: usize = 4;
const FLAG_COMPRESSED: u8 = 1;
const FLAG_ENCRYPTED: u8 = 2;
/// Most bytes a frame adds to an extent's body.
pub const FRAME_OVERHEAD_BYTES_MAX: u64 = (1 + NONCE_BYTES + TAG_BYTES + CRC_BYTES) as u64;
/// Bytes of a key check value: a nonce and a tag.
const KEY_CHECK_BYTES: usize = NONCE_BYTES + TAG_BYTES;
const KEY_BYTES: usize = 32;
const KEY_CHECK_CONTEXT: &[u8] = b"bufcache-s3 key check v1";
/// The key check's context on a disk whose metadata object carries a tag: another context, so
/// nobody without the key can pass such a disk's metadata off as one written before
/// metadata tags existed (whose untagged metadata is accepted, [`Sealer::check_metadata`]).
const KEY_CHECK_CONTEXT_METADATA_TAGGED: &[u8] = b"bufcache-s3 key check v2, metadata tagged";
const EXTENT_CONTEXT: &[u8] = b"bufcache-s3 extent v1";
const OBJECT_KEY_CONTEXT: &[u8] = b"bufcache-s3 object tag key v1";
/// Bytes of the tag ending every object of an encrypted disk.
pub const OBJECT_TAG_BYTES: usize = 32;
/// The `encryption` a metadata object records for a disk whose objects carry tags.
const ENCRYPTION_TAGGED: &str = "xchacha20-poly1305+hmac-sha256";
/// The `encryption` of disks encrypted before objects carried tags (refused).
const ENCRYPTION_UNTAGGED: &str = "xchacha20-poly1305";
/// The `encryption` a metadata object records when it carries a tag itself (field
/// [`METADATA_TAG_FIELD`]): versions before it refuse the disk rather than rewrite its
/// metadata untagged.
const ENCRYPTION_METADATA_TAGGED: &str = "xchacha20-poly1305+hmac-sha256+metadata-tag";
/// The metadata object's field holding its tag (an encrypted disk only): HMAC-SHA256 with the
/// objects' tag key over the metadata object's name and its canonical JSON without this field.
pub const METADATA_TAG_FIELD: &str = "metadata_tag";
/// The metadata object's fields its tag does not cover: the tag itself, and the mark a
/// `disk delete` sets while it runs (`store::DELETING_FIELD`), which refuses new clones and
/// nothing else (someone without the key can refuse clones anyway, by deleting the base):
/// setting and taking it off leaves the tag as it was.
const UNTAGGED_METADATA_FIELDS: [&str; 2] = [METADATA_TAG_FIELD, "deleting"];

/// What a disk's metadata object records about sealing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SealParameters {
    pub compression: Compression,
    /// For an encrypted disk: nonce and tag of an empty message sealed with the disk's key
    /// (associated data: a context string and the disk id). None: not encrypted.
    pub key_check: Option<[u8; KEY_CHECK_BYTES]>,
    /// Whether every object of the (encrypted) disk ends with a tag: false only for disks
    /// encrypted before tags existed.
    pub objects_tagged: bool,
    /// Whether the (encrypted) disk's metadata object carries a tag and its key check the
    /// context saying so: false only for disks whose metadata was last written before
    /// metadata tags existed.
    pub metadata_tagged: bool,
}

impl Default for SealParameters {
    fn default() -> Self {
        SealParameters {
            compression: Compression::Off,
            key_check: None,
            objects_tagged: false,
            metadata_tagged: false,
        }
    }
}

fn random_bytes<const N: usize>() -> [u8; N] {
    let mut bytes = [0u8; N];
    getrandom::getrandom(&mut bytes).expect("the operating system's random source failed");
    bytes
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) || !text.bytes().all(|byte| byte.is_ascii_hexdigit()) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|at| u8::from_str_radix(&text[at..at + 2], 16).ok())
        .collect()
}

fn key_check_data(disk_id: u64, metadata_tagged: bool) -> Vec<u8> {
    let mut data = if metadata_tagged {
        KEY_CHECK_CONTEXT_METADATA_TAGGED
    } else {
        KEY_CHECK_CONTEXT
    }
    .to_vec();
    data.extend_from_slice(&disk_id.to_le_bytes());
    data
}

/// A new key check value for `disk_id` under `cipher` (the context of a disk whose metadata
/// carries a tag).
fn new_key_check(cipher: &XChaCha20Poly1305, disk_id: u64) -> [u8; KEY_CHECK_BYTES] {
    let nonce: [u8; NONCE_BYTES] = random_bytes();
    let tag = cipher
        .encrypt(
            &XNonce::from(nonce),
            Payload {
                msg: &[],
                aad: &key_check_data(disk_id, true),
            },
        )
        .expect("sealing an empty message cannot fail");
    let mut check = [0u8; KEY_CHECK_BYTES];
    check[..NONCE_BYTES].copy_from_slice(&nonce);
    check[NONCE_BYTES..].copy_from_slice(&tag);
    check
}

/// Whether `check` passes under `cipher` for `disk_id` with the context `metadata_tagged`
/// names.
fn key_check_passes(
    cipher: &XChaCha20Poly1305,
    check: &[u8; KEY_CHECK_BYTES],
    disk_id: u64,
    metadata_tagged: bool,
) -> bool {
    let (nonce, tag) = check.split_at(NONCE_BYTES);
    let nonce = XNonce::try_from(nonce).expect("24 bytes");
    cipher
        .decrypt(
            &nonce,
            Payload {
                msg: tag,
                aad: &key_check_data(disk_id, metadata_tagged),
            },
        )
        .is_ok()
}

/// `value`'s canonical JSON text without its tag field: object members sorted by name, no
/// whitespace, so the tag does not depend on how a JSON library orders or spaces them.
fn canonical_metadata(value: &serde_json::Value) -> String {
    fn write(value: &serde_json::Value, top: bool, text: &mut String) {
        match value {
            serde_json::Value::Object(members) => {
                let mut names: Vec<&String> = members
                    .keys()
                    .filter(|name| !(top && UNTAGGED_METADATA_FIELDS.contains(&name.as_str())))
                    .collect();
                names.sort();
                text.push('{');
                for (index, name) in names.into_iter().enumerate() {
                    if index > 0 {
                        text.push(',');
                    }
                    text.push_str(&serde_json::Value::from(name.as_str()).to_string());
                    text.push(':');
                    write(&members[name], false, text);
                }
                text.push('}');
            }
            serde_json::Value::Array(items) => {
                text.push('[');
                for (index, item) in items.iter().enumerate() {
                    if index > 0 {
                        text.push(',');
                    }
                    write(item, false, text);
                }
                text.push(']');
            }
            scalar => text.push_str(&scalar.to_string()),
        }
    }
    let mut text = String::new();
    write(value, true, &mut text);
    text
}

/// What [`Sealer::check_metadata`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetadataTag {
    /// The disk is not encrypted: its metadata carries no tag, and anyone who may write to
    /// the bucket may change it (as any of its objects).
    Unencrypted,
    /// The disk is encrypted but was opened without a key file: nothing could be checked
    /// (and every open that reads or writes data refuses, [`Sealer::open`]).
    Unchecked,
    /// The tag proves the metadata was written with the disk's key.
    Passes,
    /// An encrypted disk whose metadata was last written before metadata tags existed (its
    /// key check made in the old context, which nobody without the key can make for a disk
    /// written since): accepted as found; the next writable open tags it.
    UntaggedBeforeTags,
}

impl SealParameters {
    /// The parameters a new disk gets from `url`: its `compress=` (default off) and, with
    /// `key-file=`, a key check value for `disk_id`. The error names the key file.
    pub fn for_new_disk(url: &S3Url, disk_id: u64) -> Result<SealParameters, KeyFileError> {
        let key_check = match &url.key_file {
            None => None,
            Some(path) => Some(new_key_check(&cipher_of(&read_key_file(path)?), disk_id)),
        };
        Ok(SealParameters {
            compression: url.compression.unwrap_or(Compression::Off),
            objects_tagged: key_check.is_some(),
            metadata_tagged: key_check.is_some(),
            key_check,
        })
    }

    /// Adds the parameters to a metadata object's JSON (nothing for a plain disk, so its
    /// metadata reads as before).
    pub fn write_json(&self, object: &mut serde_json::Value) {
        if self.compression != Compression::Off {
            object["compress"] = self.compression.name().into();
        }
        if let Some(check) = &self.key_check {
            object["encryption"] = match (self.objects_tagged, self.metadata_tagged) {
                (_, true) => ENCRYPTION_METADATA_TAGGED,
                (true, false) => ENCRYPTION_TAGGED,
                (false, false) => ENCRYPTION_UNTAGGED,
            }
            .into();
            object["key_check"] = hex(check).into();
        }
    }

    /// The parameters a metadata object's JSON records; the error names the field.
    pub fn read_json(object: &serde_json::Value) -> Result<SealParameters, DecodeError> {
        let compression = match &object["compress"] {
            serde_json::Value::Null => Compression::Off,
            value => value
                .as_str()
                .and_then(Compression::parse)
                .ok_or(DecodeError::BadField {
                    field: "compress".to_string(),
                    problem: "is not \"zstd\", \"lz4\" or \"off\"".to_string(),
                })?,
        };
        let mut objects_tagged = false;
        let mut metadata_tagged = false;
        let key_check = match (&object["encryption"], &object["key_check"]) {
            (serde_json::Value::Null, serde_json::Value::Null) => None,
            (encryption, check) => {
                metadata_tagged = encryption == ENCRYPTION_METADATA_TAGGED;
                objects_tagged = metadata_tagged || encryption == ENCRYPTION_TAGGED;
                if !objects_tagged && encryption != ENCRYPTION_UNTAGGED {
                    return Err(DecodeError::BadField {
                        field: "encryption".to_string(),
                        problem: format!("is not \"{ENCRYPTION_METADATA_TAGGED}\" (the supported one) or \"{ENCRYPTION_TAGGED}\" (written before metadata tags)"),
                    });
                }
                let bytes = check
                    .as_str()
                    .and_then(unhex)
                    .filter(|bytes| bytes.len() == KEY_CHECK_BYTES)
                    .ok_or(DecodeError::BadField {
                        field: "key_check".to_string(),
                        problem: format!("is not {} hex digits", KEY_CHECK_BYTES * 2),
                    })?;
                Some(bytes.try_into().expect("length checked"))
            }
        };
        Ok(SealParameters {
            compression,
            key_check,
            objects_tagged,
            metadata_tagged,
        })
    }
}

/// Why a key file could not be used; the message names the file.
#[derive(Debug, thiserror::Error)]
pub enum KeyFileError {
    #[error("cannot read key file `{path}`: {source}")]
    Unreadable {
        path: String,
        source: std::io::Error,
    },
    #[error("key file `{path}` holds {bytes} bytes, neither a {KEY_BYTES}-byte key nor {hex_digits} hex digits", hex_digits = KEY_BYTES * 2)]
    WrongLength { path: String, bytes: usize },
}

/// Reads a 32-byte key from `path`: 32 raw bytes, or 64 hex digits (surrounding whitespace
/// ignored). The error names the file and what is wrong with it.
pub fn read_key_file(path: &Path) -> Result<[u8; KEY_BYTES], KeyFileError> {
    let bytes = std::fs::read(path).map_err(|source| KeyFileError::Unreadable {
        path: path.display().to_string(),
        source,
    })?;
    if bytes.len() == KEY_BYTES {
        return Ok(bytes.try_into().expect("length checked"));
    }
    let text = String::from_utf8_lossy(&bytes);
    match unhex(text.trim()) {
        Some(key) if key.len() == KEY_BYTES => Ok(key.try_into().expect("length checked")),
        _ => Err(KeyFileError::WrongLength {
            path: path.display().to_string(),
            bytes: bytes.len(),
        }),
    }
}

fn cipher_of(key: &[u8; KEY_BYTES]) -> XChaCha20Poly1305 {
    XChaCha20Poly1305::new(&Key::from(*key))
}

/// The key of the objects' tags, derived from the disk's key and id.
fn object_key_of(key: &[u8; KEY_BYTES], disk_id: u64) -> [u8; 32] {
    let mut mac = <Hmac<Sha256> as hmac::KeyInit>::new_from_slice(key).expect("HMAC takes any key");
    mac.update(OBJECT_KEY_CONTEXT);
    mac.update(&disk_id.to_le_bytes());
    mac.finalize().into_bytes().into()
}

/// How one disk's extents are sealed and unsealed, and its objects tagged: its id,
/// compression, cipher and tag key.
pub struct Sealer {
    disk_id: u64,
    compression: Compression,
    cipher: Option<XChaCha20Poly1305>,
    /// The key of the tag ending every object (an encrypted disk only).
    object_key: Option<[u8; 32]>,
    /// Whether the metadata object the sealer was opened with carries a tag (an encrypted
    /// disk only; [`SealParameters::metadata_tagged`]).
    metadata_tagged: bool,
}

impl Sealer {
    /// A sealer that stores everything plain (the log layout before sealing existed).
    #[cfg(test)]
    pub fn plain(disk_id: u64) -> Sealer {
        Sealer {
            disk_id,
            compression: Compression::Off,
            cipher: None,
            object_key: None,
            metadata_tagged: false,
        }
    }

    /// A sealer for tests, with `key` when given.
    #[cfg(test)]
    pub fn with(disk_id: u64, compression: Compression, key: Option<[u8; KEY_BYTES]>) -> Sealer {
        Sealer {
            disk_id,
            compression,
            cipher: key.as_ref().map(cipher_of),
            object_key: key.as_ref().map(|key| object_key_of(key, disk_id)),
            metadata_tagged: key.is_some(),
        }
    }

    /// The sealer of disk `disk_id`, whose metadata object records `recorded`, opened with
    /// `url`'s key file: refuses a `compress=` other than the recorded one, an encrypted disk
    /// without `key-file=`, a key file for a disk created unencrypted, and a key that fails
    /// the recorded check; refuses a disk encrypted before objects carried tags.
    pub fn open(url: &S3Url, disk_id: u64, recorded: SealParameters) -> Result<Sealer, OpenError> {
        let sealer = Sealer::open_keyed(url, disk_id, recorded)?;
        if let Some(given) = url.compression {
            if given != recorded.compression {
                return Err(OpenError::Mismatch {
                    url: url.to_string(),
                    parameter: "compress",
                    given: given.name().to_string(),
                    stored: recorded.compression.name().to_string(),
                });
            }
        }
        Ok(sealer)
    }

    /// [`Sealer::open`] without comparing the URL's `compress=` with the recorded one: what
    /// checks the metadata's tag before any recorded value is trusted.
    pub fn open_keyed(
        url: &S3Url,
        disk_id: u64,
        recorded: SealParameters,
    ) -> Result<Sealer, OpenError> {
        let config = |reason: String| OpenError::Config {
            url: url.to_string(),
            reason,
        };
        if recorded.key_check.is_some() && !recorded.objects_tagged {
            return Err(config(format!(
                "the disk was encrypted by an earlier bufcache, whose objects carry no tag (metadata `encryption` \"{ENCRYPTION_UNTAGGED}\"): someone who may write to the bucket could plant data in it unnoticed, so this version refuses it; read it with the version that wrote it and copy the data to a new disk"
            )));
        }
        let (cipher, object_key) = match (&url.key_file, &recorded.key_check) {
            (None, None) => (None, None),
            (None, Some(_)) => {
                return Err(config(
                    "the disk is encrypted (its metadata object records a key check): add key-file=PATH naming the file with its key".to_string(),
                ))
            }
            (Some(path), None) => {
                return Err(config(format!(
                    "key-file=`{}` given, but the disk was created unencrypted (its metadata object records no key check); drop key-file= to open it",
                    path.display()
                )))
            }
            (Some(path), Some(check)) => {
                let key = read_key_file(path).map_err(|error| config(error.to_string()))?;
                let cipher = cipher_of(&key);
                if !key_check_passes(&cipher, check, disk_id, recorded.metadata_tagged) {
                    if key_check_passes(&cipher, check, disk_id, !recorded.metadata_tagged) {
                        // The key is right, but the key check was made for the other kind of
                        // metadata: someone changed `encryption`, most likely to pass tagged
                        // metadata off as metadata written before tags existed.
                        return Err(OpenError::ForgedMetadata {
                            url: url.to_string(),
                            key: url.key(METADATA_NAME),
                            reason: DecodeError::Inconsistent(if recorded.metadata_tagged {
                                "fails its key check's kind: its `encryption` says it carries a tag, but its key check was made for metadata written before tags (changed by someone without the key)"
                            } else {
                                "fails its key check's kind: its `encryption` says it was written before metadata tags, but its key check was made for metadata that carries a tag (changed by someone without the key, who removed the tag)"
                            }
                            .to_string()),
                        });
                    }
                    return Err(config(format!(
                        "wrong key: the key in key file `{}` fails the key check the disk's metadata object records (not this disk's key)",
                        path.display()
                    )));
                }
                (Some(cipher), Some(object_key_of(&key, disk_id)))
            }
        };
        Ok(Sealer {
            disk_id,
            compression: recorded.compression,
            cipher,
            object_key,
            metadata_tagged: recorded.metadata_tagged,
        })
    }

    /// Whether the metadata object `value` (the one this sealer was opened with) was written
    /// with the disk's key: its tag must pass on a disk whose metadata carries tags; on one
    /// whose metadata predates them no tag is expected (an attacker cannot make a disk look
    /// like that: its key check's context says so). The error says what is wrong (the caller
    /// names the object).
    pub fn check_metadata(&self, value: &serde_json::Value) -> Result<MetadataTag, DecodeError> {
        let Some(key) = &self.object_key else {
            return Ok(MetadataTag::Unencrypted);
        };
        let stored = &value[METADATA_TAG_FIELD];
        if stored.is_null() && !self.metadata_tagged {
            return Ok(MetadataTag::UntaggedBeforeTags);
        }
        let Some(tag) = stored.as_str().and_then(unhex) else {
            return Err(DecodeError::BadField {
                field: METADATA_TAG_FIELD.to_string(),
                problem: "is missing or not hex digits: the metadata of this encrypted disk always carries its tag (changed by someone without the key)".to_string(),
            });
        };
        Self::object_mac(key, METADATA_NAME, canonical_metadata(value).as_bytes())
            .verify_slice(&tag)
            .map_err(|_| DecodeError::BadTag)?;
        Ok(MetadataTag::Passes)
    }

    /// Tags the metadata object `value` (nothing for an unencrypted disk), first making its
    /// key check and `encryption` those of a disk whose metadata carries tags when it
    /// predates them. Returns whether it did the latter.
    pub fn tag_metadata(&self, value: &mut serde_json::Value) -> bool {
        let (Some(key), Some(cipher)) = (&self.object_key, &self.cipher) else {
            return false;
        };
        let upgraded = value["encryption"] != ENCRYPTION_METADATA_TAGGED;
        if upgraded {
            value["encryption"] = ENCRYPTION_METADATA_TAGGED.into();
            value["key_check"] = hex(&new_key_check(cipher, self.disk_id)).into();
        }
        let tag = Self::object_mac(key, METADATA_NAME, canonical_metadata(value).as_bytes())
            .finalize()
            .into_bytes();
        value[METADATA_TAG_FIELD] = hex(&tag).into();
        upgraded
    }

    /// Bytes the tag adds to every object (0 when the disk is not encrypted).
    pub fn object_tag_bytes(&self) -> u64 {
        if self.object_key.is_some() {
            OBJECT_TAG_BYTES as u64
        } else {
            0
        }
    }

    fn object_mac(key: &[u8; 32], name: &str, body: &[u8]) -> Hmac<Sha256> {
        let mut mac =
            <Hmac<Sha256> as hmac::KeyInit>::new_from_slice(key).expect("HMAC takes any key");
        mac.update(&(name.len() as u64).to_le_bytes());
        mac.update(name.as_bytes());
        mac.update(body);
        mac
    }

    /// `object` with its tag appended (unchanged when the disk is not encrypted); `name` is
    /// the object's key under the disk's prefix.
    pub fn tag_object(&self, name: &str, object: Bytes) -> Bytes {
        let Some(key) = &self.object_key else {
            return object;
        };
        let tag = Self::object_mac(key, name, &object).finalize().into_bytes();
        let mut tagged = BytesMut::with_capacity(object.len() + OBJECT_TAG_BYTES);
        tagged.extend_from_slice(&object);
        tagged.extend_from_slice(&tag);
        tagged.freeze()
    }

    /// `object` without its tag once the tag proves it was made with the disk's key under
    /// `name` (unchanged when the disk is not encrypted). The error says what is wrong (the
    /// caller names the object).
    pub fn check_object<'a>(&self, name: &str, object: &'a [u8]) -> Result<&'a [u8], DecodeError> {
        let Some(key) = &self.object_key else {
            return Ok(object);
        };
        let Some(body_bytes) = object.len().checked_sub(OBJECT_TAG_BYTES) else {
            return Err(DecodeError::Truncated {
                found: object.len() as u64,
                needed: format!(
                    "too short for the {OBJECT_TAG_BYTES}-byte tag every object of an encrypted disk ends with"
                ),
            });
        };
        let (body, tag) = object.split_at(body_bytes);
        Self::object_mac(key, name, body)
            .verify_slice(tag)
            .map_err(|_| DecodeError::BadTag)?;
        Ok(body)
    }

    /// Whether extents are sealed at all (else every extent is stored as written).
    pub fn seals(&self) -> bool {
        self.cipher.is_some() || self.compression != Compression::Off
    }

    /// Most bytes sealing adds to one extent (0 when nothing is sealed).
    pub fn overhead_bytes_max(&self) -> u64 {
        if self.seals() {
            FRAME_OVERHEAD_BYTES_MAX
        } else {
            0
        }
    }

    /// Most logical bytes of one extent.
    pub fn extent_bytes_max(&self) -> u64 {
        if self.seals() {
            SEALED_EXTENT_BYTES_MAX
        } else {
            u64::MAX
        }
    }

    fn associated_data(&self, sequence: u64, disk_offset: u64, flags: u8) -> Vec<u8> {
        let mut data = EXTENT_CONTEXT.to_vec();
        data.extend_from_slice(&self.disk_id.to_le_bytes());
        data.extend_from_slice(&sequence.to_le_bytes());
        data.extend_from_slice(&disk_offset.to_le_bytes());
        data.push(flags);
        data
    }

    /// The frame of `data` written at `disk_offset` in segment `sequence` (with its flags),
    /// or None when it is stored as written (nothing to seal, or only compression and it
    /// does not shrink the bytes).
    pub fn seal(&self, sequence: u64, disk_offset: u64, data: &[u8]) -> Option<(Vec<u8>, u8)> {
        if !self.seals() {
            return None;
        }
        let compressed = match self.compression {
            Compression::Off => None,
            Compression::Zstd => zstd::bulk::compress(data, ZSTD_LEVEL).ok(),
            Compression::Lz4 => Some(lz4_flex::block::compress(data)),
        }
        .filter(|packed| packed.len() + CRC_BYTES + 1 < data.len());
        let mut flags = if compressed.is_some() {
            FLAG_COMPRESSED
        } else {
            0
        };
        let body = compressed.as_deref().unwrap_or(data);
        let mut frame = Vec::with_capacity(body.len() + FRAME_OVERHEAD_BYTES_MAX as usize);
        match &self.cipher {
            None if flags == 0 => return None,
            None => {
                frame.push(flags);
                frame.extend_from_slice(body);
            }
            Some(cipher) => {
                flags |= FLAG_ENCRYPTED;
                let nonce: [u8; NONCE_BYTES] = random_bytes();
                let sealed = cipher
                    .encrypt(
                        &XNonce::from(nonce),
                        Payload {
                            msg: body,
                            aad: &self.associated_data(sequence, disk_offset, flags),
                        },
                    )
                    .expect("an extent is far below the cipher's message limit");
                frame.push(flags);
                frame.extend_from_slice(&nonce);
                frame.extend_from_slice(&sealed);
            }
        }
        let checksum = crc32fast::hash(&frame);
        frame.extend_from_slice(&checksum.to_le_bytes());
        Some((frame, flags))
    }

    /// The logical bytes of a frame [`Sealer::seal`] made for `disk_offset` in segment
    /// `sequence`. The error says what is wrong (the caller names the object).
    pub fn unseal(
        &self,
        frame: &[u8],
        sequence: u64,
        disk_offset: u64,
    ) -> Result<Vec<u8>, DecodeError> {
        let what = || format!("sealed extent at disk offset {disk_offset}");
        if frame.len() < 1 + CRC_BYTES {
            return Err(DecodeError::Inconsistent(format!(
                "{}: {} bytes, too short",
                what(),
                frame.len()
            )));
        }
        let (content, checksum) = frame.split_at(frame.len() - CRC_BYTES);
        if crc32fast::hash(content) != u32::from_le_bytes(checksum.try_into().expect("4 bytes")) {
            return Err(DecodeError::Inconsistent(format!(
                "{} fails its checksum (corrupt data)",
                what()
            )));
        }
        let flags = content[0];
        let body = &content[1..];
        if flags & !(FLAG_COMPRESSED | FLAG_ENCRYPTED) != 0 {
            return Err(DecodeError::Inconsistent(format!(
                "{} has unknown flags {flags:#x}",
                what()
            )));
        }
        let decrypted;
        let plain = match (flags & FLAG_ENCRYPTED != 0, &self.cipher) {
            (false, None) => body,
            (true, Some(cipher)) => {
                if body.len() < NONCE_BYTES + TAG_BYTES {
                    return Err(DecodeError::Inconsistent(format!(
                        "{}: too short for a nonce and a tag",
                        what()
                    )));
                }
                let (nonce, sealed) = body.split_at(NONCE_BYTES);
                decrypted = cipher
                    .decrypt(
                        &XNonce::try_from(nonce).expect("24 bytes"),
                        Payload {
                            msg: sealed,
                            aad: &self.associated_data(sequence, disk_offset, flags),
                        },
                    )
                    .map_err(|_| {
                        DecodeError::Inconsistent(format!(
                            "{} fails authentication (tampered, or moved from another place, segment or disk)",
                            what()
                        ))
                    })?;
                &decrypted[..]
            }
            (true, None) => {
                return Err(DecodeError::Inconsistent(format!(
                    "{} is encrypted but the disk is not",
                    what()
                )))
            }
            (false, Some(_)) => {
                return Err(DecodeError::Inconsistent(format!(
                    "{} is not encrypted but the disk is (planted?)",
                    what()
                )))
            }
        };
        if flags & FLAG_COMPRESSED == 0 {
            return Ok(plain.to_vec());
        }
        // The disk's recorded compression says how (it is fixed at creation); the output is
        // bounded by the most a sealed extent holds whatever the frame claims.
        match self.compression {
            Compression::Zstd => zstd::bulk::decompress(plain, SEALED_EXTENT_BYTES_MAX as usize)
                .map_err(|error| {
                    DecodeError::Inconsistent(format!("{} does not decompress: {error}", what()))
                }),
            Compression::Lz4 => {
                let mut logical = vec![0u8; SEALED_EXTENT_BYTES_MAX as usize];
                let length =
                    lz4_flex::block::decompress_into(plain, &mut logical).map_err(|error| {
                        DecodeError::Inconsistent(format!(
                            "{} does not decompress: {error}",
                            what()
                        ))
                    })?;
                logical.truncate(length);
                Ok(logical)
            }
            Compression::Off => Err(DecodeError::Inconsistent(format!(
                "{} is compressed but the disk's metadata records no compression",
                what()
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: a tagged metadata object passes whatever order or spacing its JSON has, and any
    // changed field, a removed tag or another disk's key fails; metadata that predates tags
    // passes untagged only when the sealer was opened for such metadata. Method: tag a
    // metadata value, check it reordered, then changed field by field.
    #[test]
    fn metadata_tags_pass_reordered_and_fail_on_any_change() {
        let key = [3u8; KEY_BYTES];
        let sealer = Sealer::with(9, Compression::Off, Some(key));
        let mut value = serde_json::json!({
            "format": "bufcache-s3", "format_version": 4, "layout": "log",
            "disk_id": "0000000000000009", "size_bytes": 1048576, "generation": 2,
            "base": {"prefix": "disks/a", "disk_id": "00000000000000ab", "snapshot": "golden"},
        });
        assert!(
            sealer.tag_metadata(&mut value),
            "no `encryption` yet: upgraded"
        );
        assert!(!sealer.tag_metadata(&mut value), "tagged already");
        assert_eq!(sealer.check_metadata(&value), Ok(MetadataTag::Passes));
        let reordered: serde_json::Value = serde_json::from_str(&format!(
            " {} ",
            serde_json::to_string_pretty(&value).unwrap()
        ))
        .unwrap();
        assert_eq!(sealer.check_metadata(&reordered), Ok(MetadataTag::Passes));
        for (field, changed) in [
            ("size_bytes", serde_json::json!(2097152)),
            ("generation", serde_json::json!(3)),
            ("compress", serde_json::json!("zstd")),
            ("base", serde_json::json!({"prefix": "disks/b"})),
        ] {
            let mut forged = value.clone();
            forged[field] = changed;
            assert_eq!(
                sealer.check_metadata(&forged),
                Err(DecodeError::BadTag),
                "{field}"
            );
        }
        let mut stripped = value.clone();
        stripped.as_object_mut().unwrap().remove(METADATA_TAG_FIELD);
        assert!(sealer.check_metadata(&stripped).is_err());
        let other_key = Sealer::with(9, Compression::Off, Some([4u8; KEY_BYTES]));
        assert_eq!(other_key.check_metadata(&value), Err(DecodeError::BadTag));
        let mut before_tags = Sealer::with(9, Compression::Off, Some(key));
        before_tags.metadata_tagged = false;
        assert_eq!(
            before_tags.check_metadata(&stripped),
            Ok(MetadataTag::UntaggedBeforeTags)
        );
        assert_eq!(
            Sealer::plain(9).check_metadata(&stripped),
            Ok(MetadataTag::Unencrypted)
        );
    }

    // Goal: sealing round-trips in every combination, and a frame unsealed under another
    // binding or with a flipped byte is refused. Method: seal compressible and random bytes
    // with each sealer, unseal them, then unseal with other offsets/sequences and damaged
    // copies and expect errors.
    #[test]
    fn frames_round_trip_and_refuse_other_bindings_and_damage() {
        let key = [7u8; KEY_BYTES];
        let compressible = vec![b'a'; 8192];
        let random: Vec<u8> = (0..8192).map(|_| rand::random::<u8>()).collect();
        for sealer in [
            Sealer::with(1, Compression::Zstd, None),
            Sealer::with(1, Compression::Lz4, None),
            Sealer::with(1, Compression::Off, Some(key)),
            Sealer::with(1, Compression::Zstd, Some(key)),
            Sealer::with(1, Compression::Lz4, Some(key)),
        ] {
            for data in [&compressible, &random] {
                let Some((frame, _)) = sealer.seal(5, 4096, data) else {
                    assert!(sealer.cipher.is_none(), "encryption always seals");
                    continue;
                };
                assert_eq!(&sealer.unseal(&frame, 5, 4096).unwrap(), data);
                for index in 0..frame.len() {
                    let mut damaged = frame.clone();
                    damaged[index] ^= 0x10;
                    assert!(sealer.unseal(&damaged, 5, 4096).is_err(), "byte {index}");
                }
                if sealer.cipher.is_some() {
                    assert!(sealer
                        .unseal(&frame, 6, 4096)
                        .unwrap_err()
                        .to_string()
                        .contains("authentication"));
                    assert!(sealer.unseal(&frame, 5, 0).is_err());
                    let other_disk = Sealer::with(2, Compression::Zstd, Some(key));
                    assert!(other_disk.unseal(&frame, 5, 4096).is_err());
                }
            }
        }
        for compression in [Compression::Zstd, Compression::Lz4] {
            let compressing = Sealer::with(1, compression, None);
            let (frame, _) = compressing.seal(1, 0, &compressible).unwrap();
            assert!(frame.len() < 200, "{compression:?}: {} bytes", frame.len());
            assert!(
                compressing.seal(1, 0, &random).is_none(),
                "{compression:?}: incompressible stays plain"
            );
        }
    }
}
