//! Integrity against a real S3 server (moto on loopback): a flipped byte or a truncation in
//! any stored object (log segments of every seal setting, chunk objects) is a read error
//! naming the object, never wrong data; the collector and the chunk layout's
//! read-modify-write refuse damage instead of copying it; objects of the older formats still
//! read; a segment recovery deleted is never read again when put back.

#[path = "support/fixtures.rs"]
mod fixtures;
#[path = "support/raw.rs"]
mod raw;
mod support;

use std::io::{IoSlice, IoSliceMut};

use bufcache_device::Device;
use bufcache_s3::{LogStore, OpenError, S3Device, S3Url};
use fixtures::{key_file, random};
use rand::{Rng, SeedableRng};
use raw::Raw;
use support::{have_moto, have_seaweedfs, Moto, S3Server, SeaweedFs};

fn url(endpoint: &str, disk: &str, parameters: &str) -> S3Url {
    S3Url::parse(&format!(
        "s3://bucket/{disk}?endpoint={endpoint}{parameters}"
    ))
    .unwrap()
}

fn open_log(endpoint: &str, disk: &str, parameters: &str) -> Result<LogStore, OpenError> {
    LogStore::open_locked(&url(endpoint, disk, parameters))
}

/// Bytes compression shrinks: runs of one random byte, 1 to 512 bytes long.
fn compressible(length: usize, rng: &mut impl Rng) -> Vec<u8> {
    let mut data = Vec::with_capacity(length);
    while data.len() < length {
        let run = rng.gen_range(1..=512).min(length - data.len());
        let byte: u8 = rng.gen();
        data.extend(std::iter::repeat_n(byte, run));
    }
    data
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap())
}

/// CRC-32 (IEEE), as the segment format uses, bit by bit (the test needs no crate for it).
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in bytes {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// Reads `length` bytes at `offset` through the device: the bytes, or the error's text.
fn device_read(device: &S3Device, offset: u64, length: usize) -> Result<Vec<u8>, String> {
    let mut back = vec![0u8; length];
    device
        .read_vectored_at(&mut [IoSliceMut::new(&mut back)], offset)
        .map(|()| back)
        .map_err(|error| error.to_string())
}

/// The seal settings of the log layout: name (also the disk's prefix) and URL parameters.
fn seal_settings(key: &str) -> Vec<(&'static str, String)> {
    vec![
        ("plain", String::new()),
        ("zstd", "&compress=zstd".to_string()),
        ("lz4", "&compress=lz4".to_string()),
        ("encrypted", format!("&key-file={key}")),
        ("lz4-encrypted", format!("&compress=lz4&key-file={key}")),
    ]
}

// Goal: a flipped byte anywhere in the data of a stored segment, or a truncated segment, is a
// read error naming the segment object, never wrong bytes, with every seal setting (plain
// extents in checked blocks, zstd, lz4, encrypted, lz4 and encrypted), through the S3 device;
// the restored object reads back exactly. Method: per setting, a disk with compressible
// writes (whole 4 KiB blocks and an unaligned 5,000-byte one), closed (so a checkpoint covers
// the segment and reopening replays nothing: only the read path can catch the damage); flip
// a byte at the start, the middle and the end of the segment's data area through the
// bucket, reopen, read every written byte through `S3Device`; then truncate it to half;
// then put the original back and compare with the model.
#[test]
fn a_flipped_byte_in_any_stored_segment_is_a_read_error_naming_it_never_wrong_data() {
    let name = "a_flipped_byte_in_any_stored_segment_is_a_read_error_naming_it_never_wrong_data";
    if have_moto(name) {
        a_flipped_byte_in_any_stored_segment_is_a_read_error(&Moto::start());
    }
}

#[test]
fn a_flipped_byte_in_any_stored_segment_is_a_read_error_naming_it_never_wrong_data_on_seaweedfs() {
    // Goal and method: those of `a_flipped_byte_in_any_stored_segment_is_a_read_error_naming_it_never_wrong_data`, on SeaweedFS.
    let name = "a_flipped_byte_in_any_stored_segment_is_a_read_error_naming_it_never_wrong_data_on_seaweedfs";
    if have_seaweedfs(name) {
        a_flipped_byte_in_any_stored_segment_is_a_read_error(&SeaweedFs::start());
    }
}

/// The body of the `a_flipped_byte_in_any_stored_segment_is_a_read_error_naming_it_never_wrong_data` tests, on `store`.
fn a_flipped_byte_in_any_stored_segment_is_a_read_error(store: &dyn S3Server) {
    store.create_bucket("bucket");
    let raw = Raw::new(store);
    let keys = tempfile::tempdir().unwrap();
    let key = key_file(keys.path());
    let endpoint = store.endpoint();
    let mut rng = rand::rngs::StdRng::seed_from_u64(35);
    const SIZE: usize = 2 << 20;
    for (disk, parameters) in seal_settings(&key) {
        let mut model = vec![0u8; SIZE];
        let store = open_log(
            &endpoint,
            disk,
            &format!("&create-size=2M&layout=log{parameters}"),
        )
        .unwrap();
        for (offset, length) in [(65_536usize, 192 << 10), ((1 << 20) + 100, 5000)] {
            let data = compressible(length, &mut rng);
            store.write(&data, offset as u64).unwrap();
            model[offset..offset + length].copy_from_slice(&data);
        }
        drop(store);
        let segments = raw.keys(&format!("{disk}/log/segments"));
        assert_eq!(segments.len(), 1, "{disk}: {segments:?}");
        let segment = &segments[0];
        let body = raw.get(segment);
        let data_bytes = u64_at(&body, 32) as usize;
        let reopen = format!(
            "&gc=off{}",
            parameters
                .split('&')
                .filter(|parameter| parameter.starts_with("key-file="))
                .map(|parameter| format!("&{parameter}"))
                .collect::<String>()
        );
        let damaged_read = |what: &str| {
            let device = S3Device::new_log(open_log(&endpoint, disk, &reopen).unwrap());
            let text = device_read(&device, 0, SIZE).expect_err(what);
            assert!(
                text.contains(segment.as_str()),
                "{disk}, {what}: the error names the segment: {text}"
            );
            text
        };
        for position in [64, 64 + data_bytes / 2, 64 + data_bytes - 1] {
            let mut damaged = body.clone();
            damaged[position] ^= 0x10;
            raw.put(segment, damaged);
            let text = damaged_read(&format!("byte {position} flipped"));
            assert!(
                text.contains("checksum") || text.contains("authentication"),
                "{disk}: {text}"
            );
        }
        raw.put(segment, body[..64 + data_bytes / 2].to_vec());
        damaged_read("truncated to half its data");
        raw.put(segment, body.clone());
        let device = S3Device::new_log(open_log(&endpoint, disk, &reopen).unwrap());
        assert!(
            device_read(&device, 0, SIZE).unwrap() == model,
            "{disk}: the restored segment reads back the writes"
        );
    }
}

// Goal: the garbage collector checks what it reads: a damaged live extent of a source segment
// is an error naming it, not copied into a new segment under fresh checksums (which would
// turn the damage into data). Method: plain disk, 8 blocks written and flushed (segment 1),
// 6 of them overwritten (segment 2), closed; flip a byte in one of segment 1's two live
// blocks; reopen with gc=off, run a round that picks segment 1: an error naming it; the
// damaged range still reads as an error and segment 1 is still there.
#[test]
fn the_collector_refuses_a_damaged_source_instead_of_copying_it() {
    let name = "the_collector_refuses_a_damaged_source_instead_of_copying_it";
    if !have_moto(name) {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let raw = Raw::new(&moto);
    let endpoint = moto.endpoint();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let store = open_log(&endpoint, "disk", "&create-size=1M&layout=log&gc=off").unwrap();
    store.write(&random(8 * 4096, &mut rng), 0).unwrap();
    store.flush().unwrap();
    store.write(&random(6 * 4096, &mut rng), 0).unwrap();
    store.flush().unwrap();
    drop(store);
    let segments = raw.keys("disk/log/segments");
    assert_eq!(segments.len(), 2, "{segments:?}");
    let source = &segments[0];
    let mut body = raw.get(source);
    // Logical block 6 of the only extent: stored block 6 (4,100 bytes each) after the header.
    body[64 + 6 * 4100 + 17] ^= 0x01;
    raw.put(source, body);
    let store = open_log(&endpoint, "disk", "&gc=off").unwrap();
    let error = store
        .collect_garbage(0.5)
        .expect_err("a damaged source is an error")
        .to_string();
    assert!(
        error.contains(source.as_str()) && error.contains("checksum"),
        "{error}"
    );
    let mut back = vec![0u8; 2 * 4096];
    let error = store.read(&mut back, 6 * 4096).unwrap_err().to_string();
    assert!(error.contains(source.as_str()), "{error}");
    assert!(
        raw.keys("disk/log/segments").contains(source),
        "the damaged source is not deleted"
    );
}

// Goal: chunk objects carry checksums: a flipped byte is a read error naming the chunk
// object and the disk offset of its block (other blocks of the chunk still read), a partial
// write into the damaged chunk fails at its GET instead of storing the damage under fresh
// checksums, and a truncated chunk is a read error naming it; a new chunk disk records the
// checksums in its metadata. Method: a chunk disk (64 KiB chunks) through `S3Device`; write
// chunk 2 whole, close; flip a byte of its block 0 through the bucket; reopen, read, write;
// truncate; put the original back and read it.
#[test]
fn a_flipped_byte_in_a_chunk_is_a_read_error_and_stops_its_read_modify_write() {
    let name = "a_flipped_byte_in_a_chunk_is_a_read_error_and_stops_its_read_modify_write";
    if have_moto(name) {
        a_flipped_byte_in_a_chunk_is_a_read_error(&Moto::start());
    }
}

#[test]
fn a_flipped_byte_in_a_chunk_is_a_read_error_and_stops_its_read_modify_write_on_seaweedfs() {
    // Goal and method: those of `a_flipped_byte_in_a_chunk_is_a_read_error_and_stops_its_read_modify_write`, on SeaweedFS.
    let name =
        "a_flipped_byte_in_a_chunk_is_a_read_error_and_stops_its_read_modify_write_on_seaweedfs";
    if have_seaweedfs(name) {
        a_flipped_byte_in_a_chunk_is_a_read_error(&SeaweedFs::start());
    }
}

/// The body of the `a_flipped_byte_in_a_chunk_is_a_read_error_and_stops_its_read_modify_write` tests, on `store`.
fn a_flipped_byte_in_a_chunk_is_a_read_error(store: &dyn S3Server) {
    store.create_bucket("bucket");
    let raw = Raw::new(store);
    let endpoint = store.endpoint();
    let disk = url(
        &endpoint,
        "disk",
        "&create-size=1M&layout=chunk&chunk-size=64k",
    );
    let reopen = url(&endpoint, "disk", "");
    let data = random(64 << 10, &mut rand::rngs::StdRng::seed_from_u64(11));
    let device = S3Device::open_locked(&disk).unwrap();
    device
        .write_vectored_at(&[IoSlice::new(&data)], 128 << 10)
        .unwrap();
    drop(device);
    let metadata = String::from_utf8(raw.get("disk/bufcache-disk.json")).unwrap();
    assert!(
        metadata.contains(r#""chunk_checksums":"crc32-4k""#)
            && metadata.contains(r#""format_version":3"#),
        "{metadata}"
    );
    let chunk = "disk/chunks/0000000000000002";
    let body = raw.get(chunk);
    assert_eq!(
        body.len(),
        16 * 4100,
        "16 blocks of 4 KiB, each with its CRC-32"
    );
    let mut damaged = body.clone();
    damaged[3000] ^= 0x80;
    raw.put(chunk, damaged.clone());
    let device = S3Device::open_locked(&reopen).unwrap();
    let error = device_read(&device, 128 << 10, 4096).unwrap_err();
    assert!(
        error.contains(chunk) && error.contains("disk offset 131072") && error.contains("checksum"),
        "{error}"
    );
    assert!(
        device_read(&device, (128 << 10) + 8192, 4096).unwrap() == data[8192..12_288],
        "the chunk's other blocks still read"
    );
    let error = device
        .write_vectored_at(&[IoSlice::new(&[7u8; 10])], (128 << 10) + 40_000)
        .expect_err("merging into a damaged chunk is an error")
        .to_string();
    assert!(error.contains(chunk), "{error}");
    assert!(
        raw.get(chunk) == damaged,
        "the damaged chunk is left as it was"
    );
    raw.put(chunk, body[..30_000].to_vec());
    let error = device_read(&device, (128 << 10) + 40_000, 100).unwrap_err();
    assert!(error.contains(chunk), "truncated: {error}");
    raw.put(chunk, body);
    assert!(device_read(&device, 128 << 10, 64 << 10).unwrap() == data);
}

// Goal: disks and objects written before the checksums keep working: a chunk disk of format
// version 1 (raw chunks) reads and takes partial writes, its chunks staying raw; a version 3
// log segment (plain extent without block checksums) is replayed and read, and new writes
// beside it (version 4) read back after a reopen. Method: plant the metadata objects and a
// raw chunk / a hand-built version 3 segment through the bucket, open, read, write, reopen.
#[test]
fn objects_of_the_formats_before_checksums_still_read() {
    let name = "objects_of_the_formats_before_checksums_still_read";
    if !have_moto(name) {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let raw = Raw::new(&moto);
    let endpoint = moto.endpoint();
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);

    // A chunk disk of format version 1.
    raw.put(
        "old-chunks/bufcache-disk.json",
        br#"{"format":"bufcache-s3","format_version":1,"size_bytes":1048576,"chunk_size_bytes":65536}"#.to_vec(),
    );
    let mut chunk = random(64 << 10, &mut rng);
    raw.put("old-chunks/chunks/0000000000000001", chunk.clone());
    let device = S3Device::open_locked(&url(&endpoint, "old-chunks", "")).unwrap();
    assert!(device_read(&device, 64 << 10, 64 << 10).unwrap() == chunk);
    device
        .write_vectored_at(&[IoSlice::new(&[5u8; 4096])], (64 << 10) + 4096)
        .unwrap();
    chunk[4096..8192].fill(5);
    assert!(device_read(&device, 64 << 10, 64 << 10).unwrap() == chunk);
    drop(device);
    assert!(
        raw.get("old-chunks/chunks/0000000000000001") == chunk,
        "a version 1 disk's chunks stay raw"
    );

    // A log disk whose only segment is of version 3: one plain extent of 8 KiB at 4096.
    raw.put(
        "old-log/bufcache-disk.json",
        br#"{"format":"bufcache-s3","format_version":2,"layout":"log","disk_id":"00000000000000ab","size_bytes":1048576}"#.to_vec(),
    );
    let extent = random(8192, &mut rng);
    let mut table = Vec::new();
    for field in [4096u64, 8192, 0] {
        table.extend_from_slice(&field.to_le_bytes());
    }
    table.extend_from_slice(&crc32(&extent).to_le_bytes());
    table.extend_from_slice(&1u32.to_le_bytes()); // kind: data
    table.extend_from_slice(&0u64.to_le_bytes()); // source segment
    table.extend_from_slice(&8192u64.to_le_bytes()); // stored length
    table.extend_from_slice(&[0u8; 8]); // seal flags 0, reserved
    let mut segment = b"BCLOGSEG".to_vec();
    segment.extend_from_slice(&3u32.to_le_bytes());
    segment.extend_from_slice(&64u32.to_le_bytes());
    for field in [0xabu64, 1, 8192, 1] {
        segment.extend_from_slice(&field.to_le_bytes());
    }
    segment.extend_from_slice(&crc32(&table).to_le_bytes());
    segment.extend_from_slice(&[0u8; 8]);
    let header_checksum = crc32(&segment);
    segment.extend_from_slice(&header_checksum.to_le_bytes());
    segment.extend_from_slice(&extent);
    segment.extend_from_slice(&table);
    raw.put("old-log/log/segments/0000000000000001", segment);
    let mut model = vec![0u8; 64 << 10];
    model[4096..12_288].copy_from_slice(&extent);
    let store = open_log(&endpoint, "old-log", "").unwrap();
    let mut back = vec![0u8; 64 << 10];
    store.read(&mut back, 0).unwrap();
    assert!(back == model, "the version 3 segment replays and reads");
    let newer = random(4096, &mut rng);
    store.write(&newer, 8192).unwrap();
    model[8192..12_288].copy_from_slice(&newer);
    drop(store);
    let store = open_log(&endpoint, "old-log", "").unwrap();
    store.read(&mut back, 0).unwrap();
    assert!(
        back == model,
        "version 3 and 4 segments read together after a reopen"
    );
    store.read(&mut back[..100], 4096 + 10).unwrap();
    assert!(
        back[..100] == model[4096 + 10..4096 + 110],
        "a ranged read inside it"
    );
}

// Goal: a segment that recovery deleted (written after a missing one, never covered by a
// FLUSH) is never read again, even when a saved copy is put back under its number on an
// encrypted disk, where its extents would authenticate: segment numbers are never used
// twice. Method: three flushed epochs in three segments, crash, save segment 3, delete
// segment 2, reopen with recover-prefix=on (segment 3 goes; a checkpoint covering 3 is
// stored); write epoch 4 and
// flush: its segment is numbered 4; crash, put segment 3 back, reopen: epoch 1 and epoch 4
// only, and segment 3 is deleted again.
#[test]
fn a_segment_recovery_deleted_is_never_read_when_put_back() {
    let name = "a_segment_recovery_deleted_is_never_read_when_put_back";
    if !have_moto(name) {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let raw = Raw::new(&moto);
    let keys = tempfile::tempdir().unwrap();
    let key = key_file(keys.path());
    let endpoint = moto.endpoint();
    let crash = |mut store: LogStore| {
        store.stop_gc();
        let id = store.lock().unwrap().holder().id.clone();
        std::mem::forget(store);
        id
    };
    let store = open_log(
        &endpoint,
        "disk",
        &format!("&create-size=1M&layout=log&key-file={key}"),
    )
    .unwrap();
    for epoch in 1..=3u8 {
        store.write(&[epoch; 4096], 0).unwrap();
        store
            .write(&[epoch; 4096], u64::from(epoch) * 4096)
            .unwrap();
        store.flush().unwrap();
    }
    let id = crash(store);
    let segments = raw.keys("disk/log/segments");
    assert_eq!(segments.len(), 3, "{segments:?}");
    let saved = raw.get(&segments[2]);
    raw.delete(&segments[1]);
    // Segment 3 proves segment 2 was stored: a loss, opened only with recover-prefix=on.
    let store = open_log(
        &endpoint,
        "disk",
        &format!("&key-file={key}&break-lock={id}&recover-prefix=on"),
    )
    .unwrap();
    assert_eq!(raw.keys("disk/log/segments"), segments[..1].to_vec());
    assert_eq!(
        raw.keys("disk/log/checkpoints"),
        // Named `<through>-<epoch>`: stored by the second open, epoch 2.
        vec!["disk/log/checkpoints/0000000000000003-0000000000000002".to_string()]
    );
    store.write(&[4; 4096], 3 * 4096).unwrap();
    store.write(&[4; 4096], 4 * 4096).unwrap();
    store.flush().unwrap();
    // Segment names are `<sequence>-<epoch>` (the epoch of the open that wrote them).
    let newest = raw.keys("disk/log/segments").last().unwrap().clone();
    assert!(
        newest.starts_with("disk/log/segments/0000000000000004"),
        "new segments are numbered after the deleted ones: {newest}"
    );
    let id = crash(store);
    raw.put(&segments[2], saved);
    let store = open_log(
        &endpoint,
        "disk",
        &format!("&key-file={key}&break-lock={id}"),
    )
    .unwrap();
    let mut image = vec![0u8; 5 * 4096];
    store.read(&mut image, 0).unwrap();
    let blocks: Vec<u8> = image.chunks(4096).map(|block| block[0]).collect();
    assert_eq!(blocks, [1, 1, 0, 4, 4], "epoch 3 never comes back");
    assert!(image
        .chunks(4096)
        .all(|block| block.iter().all(|&byte| byte == block[0])));
    // The checkpoint past the gap is the disk's only one (its predecessor the log's start,
    // which keeps every segment): the segment goes with the next checkpoint, at the close.
    drop(store);
    assert!(
        !raw.keys("disk/log/segments").contains(&segments[2]),
        "the put-back segment is deleted again"
    );
}
