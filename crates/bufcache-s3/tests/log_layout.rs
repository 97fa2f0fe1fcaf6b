//! The log layout (`layout=log`) against a real S3 server (moto on loopback; the `_on_seaweedfs`
//! tests on SeaweedFS): reads after writes, zeroes and reopening; what a write-back costs in
//! requests and bytes; the recovery rule (replay stops at a missing segment); damaged objects
//! refused by name.

#[path = "support/raw.rs"]
mod raw;
mod support;

use std::io::IoSlice;

use bufcache_device::Device;
use bufcache_s3::{LayoutKind, LogStore, OpenError, S3Device, S3Url, GET_BYTES_MAX_DEFAULT};
use rand::{Rng, SeedableRng};
use raw::Raw;
use support::{have_moto, have_seaweedfs, Moto, S3Server, SeaweedFs};

fn url(endpoint: &str, parameters: &str) -> S3Url {
    S3Url::parse(&format!("s3://bucket/disk?endpoint={endpoint}{parameters}")).unwrap()
}

fn open(endpoint: &str, parameters: &str) -> Result<LogStore, OpenError> {
    LogStore::open_locked(&url(endpoint, parameters))
}

fn random(length: usize, rng: &mut impl Rng) -> Vec<u8> {
    let mut data = vec![0u8; length];
    rng.fill(&mut data[..]);
    data
}

/// Bytes zstd shrinks: runs of one random byte, 1 to 512 bytes long.
fn compressible(length: usize, rng: &mut impl Rng) -> Vec<u8> {
    let mut data = Vec::with_capacity(length);
    while data.len() < length {
        let run = rng.gen_range(1..=512).min(length - data.len());
        let byte: u8 = rng.gen();
        data.extend(std::iter::repeat_n(byte, run));
    }
    data
}

fn read_all(store: &LogStore, size: usize) -> Vec<u8> {
    let mut back = vec![0u8; size];
    store.read(&mut back, 0).unwrap();
    back
}

/// The lock id of a store that is then abandoned as a crashed server would leave it.
fn crash(mut store: LogStore) -> String {
    // A crashed server's collector does not go on deleting either.
    store.stop_gc();
    let id = store.lock().unwrap().holder().id.clone();
    // No close: no final checkpoint, no lock release, as after kill -9.
    std::mem::forget(store);
    id
}

// Goal: whatever mix of writes and zeroes, at any offsets, reads return the newest bytes:
// from the open segment, from sealed segments still uploading, from the store, and after a
// reopen. Method: 64 KiB segments (so many seal); random writes of 1 B to 100 KiB and
// zeroings mirrored in a model; whole-disk and random reads compared with it, before and
// after a flush, and after closing and reopening the disk.
#[test]
fn log_disk_reads_back_writes_and_zeroes_before_and_after_reopen() {
    let name = "log_disk_reads_back_writes_and_zeroes_before_and_after_reopen";
    if have_moto(name) {
        log_disk_reads_back_writes_and_zeroes(&Moto::start());
    }
}

#[test]
fn log_disk_reads_back_writes_and_zeroes_before_and_after_reopen_on_seaweedfs() {
    // Goal and method: those of
    // `log_disk_reads_back_writes_and_zeroes_before_and_after_reopen`, on SeaweedFS.
    let name = "log_disk_reads_back_writes_and_zeroes_before_and_after_reopen_on_seaweedfs";
    if have_seaweedfs(name) {
        log_disk_reads_back_writes_and_zeroes(&SeaweedFs::start());
    }
}

/// The body of the read-back tests, on `server`.
fn log_disk_reads_back_writes_and_zeroes(server: &dyn S3Server) {
    let seed: u64 = rand::random();
    println!("seed {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    server.create_bucket("bucket");
    const SIZE: usize = 2 << 20;
    let store = open(
        &server.endpoint(),
        "&create-size=2M&layout=log&segment-size=64k",
    )
    .unwrap();
    assert_eq!(store.metadata().layout, LayoutKind::Log);
    let mut model = vec![0u8; SIZE];
    for step in 0..300 {
        let offset = rng.gen_range(0..SIZE);
        let length = rng.gen_range(1..=(SIZE - offset).min(100 << 10));
        if rng.gen_bool(0.85) {
            let data = random(length, &mut rng);
            store.write(&data, offset as u64).unwrap();
            model[offset..offset + length].copy_from_slice(&data);
        } else {
            store.write_zeroes(offset as u64, length as u64).unwrap();
            model[offset..offset + length].fill(0);
        }
        if step % 50 == 0 {
            store.flush().unwrap();
        }
        let from = rng.gen_range(0..SIZE);
        let span = rng.gen_range(0..=(SIZE - from).min(300 << 10));
        let mut piece = vec![0u8; span];
        store.read(&mut piece, from as u64).unwrap();
        assert!(piece == model[from..from + span], "seed {seed} step {step}");
    }
    assert!(read_all(&store, SIZE) == model, "seed {seed}: before flush");
    store.flush().unwrap();
    assert!(read_all(&store, SIZE) == model, "seed {seed}: after flush");
    drop(store);
    let reopened = open(&server.endpoint(), "").unwrap();
    assert!(
        read_all(&reopened, SIZE) == model,
        "seed {seed}: after reopen"
    );
    assert!(
        url(&server.endpoint(), "&layout=chunk").layout == Some(LayoutKind::Chunk),
        "layout parameter parsed"
    );
    drop(reopened);
    let other = bufcache_s3::ChunkStore::open(&url(&server.endpoint(), ""))
        .err()
        .expect("the chunk store refuses a log disk");
    assert!(other.to_string().contains("layout"), "{other}");
}

// Goal: the write-back targets, through the device as the engine drives it:
// 1,024 random 4 KiB writes + flush cost ≤ 4 PUTs and ≤ 1.5× the client's bytes; a
// sequential write costs ≤ 1.05× its bytes in ≤ size ÷ segment size + 2 PUTs; a cold
// sequential read of one segment's worth is one GET (adjacent extents coalesced). Method:
// count PUTs and GETs in moto's log and sum the stored segment objects.
#[test]
fn random_4k_writes_cost_their_bytes_once_in_few_puts() {
    let name = "random_4k_writes_cost_their_bytes_once_in_few_puts";
    if !have_moto(name) {
        return;
    }
    let seed: u64 = rand::random();
    println!("seed {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let raw = Raw::new(&moto);
    let device =
        S3Device::open_locked(&url(&moto.endpoint(), "&create-size=1G&layout=log")).unwrap();
    assert_eq!(device.capabilities().write_unit_bytes, 1);
    let blocks: Vec<u64> = (0..1024).map(|_| rng.gen_range(0..(1u64 << 18))).collect();
    let data = random(4096 * 1024, &mut rng);
    let writes: Vec<(u64, Vec<u8>)> = blocks
        .iter()
        .zip(data.chunks(4096))
        .map(|(&block, bytes)| (block * 4096, bytes.to_vec()))
        .collect();
    let puts_before = moto.request_count("PUT");
    for (_, result) in bufcache_device::write_and_wait(&device, writes) {
        result.unwrap();
    }
    device.flush().unwrap();
    let puts = moto.request_count("PUT") - puts_before;
    let stored: u64 = raw.objects("disk/log/").iter().map(|(_, size)| size).sum();
    println!(
        "random 4K: {puts} PUTs, {stored} bytes stored for {} client bytes",
        data.len()
    );
    assert!(puts <= 4, "{puts} PUTs");
    assert!(
        stored as f64 <= 1.5 * data.len() as f64,
        "{stored} bytes stored"
    );
    // Sequential: 32 MiB in 1 MiB writes.
    let sequential = random(32 << 20, &mut rng);
    let before_bytes: u64 = raw
        .objects("disk/log/segments")
        .iter()
        .map(|(_, size)| size)
        .sum();
    let puts_before = moto.request_count("PUT");
    for (number, piece) in sequential.chunks(1 << 20).enumerate() {
        device
            .write_vectored_at(
                &[IoSlice::new(piece)],
                (512 << 20) + ((number as u64) << 20),
            )
            .unwrap();
    }
    device.flush().unwrap();
    let puts = moto.request_count("PUT") - puts_before;
    let after_bytes: u64 = raw
        .objects("disk/log/segments")
        .iter()
        .map(|(_, size)| size)
        .sum();
    let amplification = (after_bytes - before_bytes) as f64 / sequential.len() as f64;
    println!("sequential 32 MiB: {puts} PUTs, write amplification {amplification:.5}");
    assert!(amplification <= 1.05, "WA {amplification}");
    assert!(puts <= 32 / 8 + 2, "{puts} PUTs");
    drop(device);
    // Cold read of the first 8 MiB of the sequential range: its extents are adjacent in the
    // first segment (less what its header and table take) and the second, so one GET per
    // GET_BYTES_MAX_DEFAULT bytes and one more where the range crosses into the second.
    let reopened = open(&moto.endpoint(), "").unwrap();
    let gets_before = moto.request_count("GET");
    let mut back = vec![0u8; 8 << 20];
    reopened.read(&mut back, 512 << 20).unwrap();
    let gets = moto.request_count("GET") - gets_before;
    assert!(back[..] == sequential[..8 << 20]);
    let gets_max = (8u64 << 20).div_ceil(GET_BYTES_MAX_DEFAULT) + 1;
    assert!(
        gets as u64 <= gets_max,
        "{gets} GETs for 8 MiB of adjacent extents (at most {gets_max})"
    );
}

// Goal: TRIM and WRITE_ZEROES only change the index: zeroing 1 MiB of written data uploads
// a table entry, not a MiB, and it reads as zeroes before and after a reopen. Method: sum
// the segment objects before and after the zeroing and its flush.
#[test]
fn trim_and_write_zeroes_only_change_the_index() {
    let name = "trim_and_write_zeroes_only_change_the_index";
    if !have_moto(name) {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let raw = Raw::new(&moto);
    let device =
        S3Device::open_locked(&url(&moto.endpoint(), "&create-size=16M&layout=log")).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let data = random(2 << 20, &mut rng);
    device.write_vectored_at(&[IoSlice::new(&data)], 0).unwrap();
    device.flush().unwrap();
    let before: u64 = raw
        .objects("disk/log/segments")
        .iter()
        .map(|(_, size)| size)
        .sum();
    device.write_zeroes(0, 1 << 20).unwrap();
    device.discard(1 << 20, 512 << 10).unwrap();
    device.flush().unwrap();
    let after: u64 = raw
        .objects("disk/log/segments")
        .iter()
        .map(|(_, size)| size)
        .sum();
    assert!(
        after - before <= 256,
        "zeroing uploaded {} bytes",
        after - before
    );
    let check = |store: &LogStore| {
        let mut back = vec![0u8; 2 << 20];
        store.read(&mut back, 0).unwrap();
        assert!(back[..(3 << 19)].iter().all(|&byte| byte == 0));
        assert!(back[3 << 19..] == data[3 << 19..]);
    };
    check(device.log_store().unwrap());
    drop(device);
    check(&open(&moto.endpoint(), "").unwrap());
}

// Goal: the recovery rule. A segment missing before a later one sealed once it was stored
// (its durable mark) is a loss, refused naming it, deleting nothing; with recover-prefix=on
// the disk reopens as the writes of the segments up to the first missing one, and the
// segments after the gap are deleted before new ones reuse their numbers. Method: three
// flushed epochs in three segments, abandon the store (no close: no checkpoint), delete
// segment 2, reopen: refused; again with recover-prefix=on: epoch 1 only, segment 3 gone;
// write again and reopen once more.
#[test]
fn replay_stops_at_a_missing_segment_and_deletes_the_segments_after_it() {
    let name = "replay_stops_at_a_missing_segment_and_deletes_the_segments_after_it";
    if !have_moto(name) {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let raw = Raw::new(&moto);
    let store = open(&moto.endpoint(), "&create-size=1M&layout=log").unwrap();
    for epoch in 1..=3u8 {
        store.write(&[epoch; 4096], 0).unwrap();
        store
            .write(&[epoch; 4096], u64::from(epoch) * 4096)
            .unwrap();
        store.flush().unwrap();
    }
    let id = crash(store);
    let segments = raw.objects("disk/log/segments");
    assert_eq!(segments.len(), 3, "{segments:?}");
    raw.delete(&segments[1].0);
    let refused = open(&moto.endpoint(), &format!("&break-lock={id}"))
        .err()
        .expect("a segment lost before a later one is refused");
    assert!(
        matches!(&refused, OpenError::LostObjects { missing, .. } if *missing == [segments[1].0.clone()]),
        "{refused}"
    );
    assert_eq!(raw.objects("disk/log/segments").len(), 2, "nothing deleted");
    let reopened = open(
        &moto.endpoint(),
        &format!("&break-lock={id}&recover-prefix=on"),
    )
    .unwrap();
    let image = read_all(&reopened, 4 * 4096);
    assert!(image[..4096].iter().all(|&byte| byte == 1));
    assert!(image[4096..8192].iter().all(|&byte| byte == 1));
    assert!(image[8192..].iter().all(|&byte| byte == 0));
    assert_eq!(
        raw.objects("disk/log/segments").len(),
        1,
        "segment 3 deleted"
    );
    reopened.write(&[9; 4096], 3 * 4096).unwrap();
    reopened.flush().unwrap();
    drop(reopened);
    let again = open(&moto.endpoint(), "").unwrap();
    let image = read_all(&again, 4 * 4096);
    assert!(image[..8192].iter().all(|&byte| byte == 1));
    assert!(image[8192..12288].iter().all(|&byte| byte == 0));
    assert!(image[12288..].iter().all(|&byte| byte == 9));
}

// Goal: damage is an error naming the object, never data: a flipped byte in a segment, a
// truncated checkpoint whose replay from the log's start cannot reach past it (with the
// segment, the open falls back and reads the data), a segment of another disk, a checkpoint naming a missing segment, and
// a deleted checkpoint that was the only record of a segment's epoch each stop the open with
// the object's name (and delete nothing). Method: damage objects through the bucket
// directly, one case per disk.
#[test]
fn damaged_segments_and_checkpoints_are_refused_naming_the_object() {
    let name = "damaged_segments_and_checkpoints_are_refused_naming_the_object";
    if !have_moto(name) {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let raw = Raw::new(&moto);
    // A flipped data byte in the only segment (no checkpoint: the store is abandoned).
    let store = open(&moto.endpoint(), "&create-size=1M&layout=log").unwrap();
    store.write(&[7; 8192], 4096).unwrap();
    store.flush().unwrap();
    let id = crash(store);
    let (key, _) = raw.objects("disk/log/segments")[0].clone();
    let mut body = raw.get(&key);
    body[100] ^= 1;
    raw.put(&key, body.clone());
    let error = open(&moto.endpoint(), &format!("&break-lock={id}"))
        .err()
        .expect("a damaged segment is refused");
    let text = error.to_string();
    assert!(text.contains(&key) && text.contains("checksum"), "{text}");
    // Restored, the disk opens; closed cleanly, it has a checkpoint; truncate that.
    body[100] ^= 1;
    raw.put(&key, body);
    let store = open(&moto.endpoint(), &format!("&break-lock={id}")).unwrap();
    drop(store);
    let (checkpoint, _) = raw.objects("disk/log/checkpoints")[0].clone();
    let whole = raw.get(&checkpoint);
    raw.put(&checkpoint, whole[..whole.len() - 3].to_vec());
    // The open falls back to the log's start, which reaches past the truncated checkpoint
    // (the disk's only one: nothing was deleted); without the segment it covers, it is
    // refused naming the checkpoint.
    let reader = LogStore::open_read_only(&url(&moto.endpoint(), "")).unwrap();
    assert!(
        read_all(&reader, 4096 * 3)[4096..] == [7; 8192],
        "the fallback reads the data"
    );
    drop(reader);
    let saved = raw.get(&key);
    raw.delete(&key);
    let text = open(&moto.endpoint(), "").err().unwrap().to_string();
    assert!(text.contains(&checkpoint), "{text}");
    raw.put(&key, saved);
    raw.put(&checkpoint, whole);
    // The checkpoint names a segment that is gone.
    let saved = raw.get(&key);
    raw.delete(&key);
    let text = open(&moto.endpoint(), "").err().unwrap().to_string();
    assert!(
        text.contains(&key) && text.contains("does not exist"),
        "{text}"
    );
    // A segment of another disk (a second log disk's segment copied in).
    let other = S3Url::parse(&format!(
        "s3://bucket/other?endpoint={}&create-size=1M&layout=log",
        moto.endpoint()
    ))
    .unwrap();
    let other_store = LogStore::open_locked(&other).unwrap();
    other_store.write(&[1; 4096], 0).unwrap();
    other_store.flush().unwrap();
    drop(other_store);
    raw.put(&key, saved);
    let foreign = raw.keys("other/log/segments")[0].clone();
    // Copied in as the segment after the checkpoint (sequence 2 of epoch 2, the open that
    // wrote the checkpoint), which the open replays.
    let next = "disk/log/segments/0000000000000002-0000000000000002";
    raw.put(next, raw.get(&foreign));
    let text = open(&moto.endpoint(), "").err().unwrap().to_string();
    assert!(
        text.contains(next) && text.contains("not this disk"),
        "{text}"
    );
    raw.delete(next);
    // The checkpoint deleted, and epoch 1's object (kept while the disk's only checkpoint
    // has the log's start as its predecessor; deleted once a later checkpoint lets it go):
    // with no record of epoch 1 left, segment 1 is refused, not taken for void and deleted.
    raw.delete(&checkpoint);
    raw.delete("disk/log/epochs/0000000000000001");
    let text = open(&moto.endpoint(), "").err().unwrap().to_string();
    assert!(
        text.contains(&key) && text.contains("no epoch object"),
        "{text}"
    );
    assert!(raw
        .objects("disk/log/segments")
        .iter()
        .any(|(listed, _)| *listed == key));
}

// Goal: a segment whose upload fails is never dropped: FLUSH reports the error, reads still
// return the data, and a later FLUSH (store back) uploads the kept segments. Method: a proxy
// in front of moto taken down with a short retry timeout; write, FLUSH (error), read back,
// bring the proxy up, FLUSH (ok, nothing written again), reopen through moto and read back.
#[test]
fn failed_segment_uploads_are_kept_and_a_later_flush_stores_them() {
    let name = "failed_segment_uploads_are_kept_and_a_later_flush_stores_them";
    if !have_moto(name) {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let proxy = support::Proxy::start(moto.port);
    let store = open(
        &proxy.endpoint(),
        "&create-size=4M&layout=log&segment-size=64k&retry-timeout-ms=300",
    )
    .unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let data = random(200 << 10, &mut rng);
    proxy.set_down(true);
    // 200 KiB seal 3 segments of 64 KiB: within segments_in_flight_max, so the write
    // itself needs no upload to finish.
    store.write(&data, 4096).unwrap();
    let error = store.flush().expect_err("the store is down");
    assert!(error.to_string().contains("log/segments/"), "{error}");
    let mut back = vec![0u8; data.len()];
    store.read(&mut back, 4096).unwrap();
    assert!(
        back == data,
        "data served from memory while its upload fails"
    );
    proxy.set_down(false);
    store.flush().unwrap();
    drop(store);
    let reopened = open(&moto.endpoint(), "").unwrap();
    let mut back = vec![0u8; data.len()];
    reopened.read(&mut back, 4096).unwrap();
    assert!(back == data);
}

// Goal: a write split at a segment's end (to keep segments full) is split between whole
// 4 KiB blocks, so when a crash keeps the first segment and loses the second, every block of
// the write reads back whole — new or old, never part of each (the kill -9 test through the
// server found such a torn block). Method: 64 KiB segments; an odd-sized filler leaves the
// open segment with room that is not a multiple of 4 KiB; a 40 KiB write of a new pattern
// over blocks holding an old one must then straddle two segments; flush, crash, delete the
// newest segment behind the store's back, reopen, and look at each 4 KiB block.
#[test]
fn a_write_split_at_a_segment_end_keeps_every_block_whole_when_the_rest_is_lost() {
    let name = "a_write_split_at_a_segment_end_keeps_every_block_whole_when_the_rest_is_lost";
    if !have_moto(name) {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let raw = Raw::new(&moto);
    let store = open(
        &moto.endpoint(),
        "&create-size=1M&layout=log&segment-size=64k",
    )
    .unwrap();
    store.write(&[1; 40960], 0).unwrap();
    store.flush().unwrap();
    store.write(&[3; 30001], 512 << 10).unwrap();
    store.write(&[2; 40960], 0).unwrap();
    store.flush().unwrap();
    let id = crash(store);
    let segments = raw.objects("disk/log/segments");
    let (newest, _) = segments.last().expect("segments").clone();
    raw.delete(&newest);
    let reopened = open(&moto.endpoint(), &format!("&break-lock={id}")).unwrap();
    let image = read_all(&reopened, 40960);
    let mut new_blocks = 0;
    for (index, block) in image.chunks(4096).enumerate() {
        let first = block[0];
        assert!(
            (first == 1 || first == 2) && block.iter().all(|&byte| byte == first),
            "block {index} is torn: starts with {first}, holds {:?}",
            block
                .iter()
                .copied()
                .collect::<std::collections::BTreeSet<u8>>()
        );
        new_blocks += usize::from(first == 2);
    }
    assert!(
        new_blocks > 0 && new_blocks < 10,
        "the write must straddle the lost segment ({new_blocks} of 10 blocks kept)"
    );
}

/// Every object under `disk/log/` with its body, to put back behind the store's back.
fn snapshot(raw: &Raw) -> Vec<(String, Vec<u8>)> {
    raw.objects("disk/log/")
        .into_iter()
        .map(|(key, _)| {
            let body = raw.get(&key);
            (key, body)
        })
        .collect()
}

fn listed_bytes(raw: &Raw, folder: &str) -> u64 {
    raw.objects(&format!("disk/{folder}"))
        .iter()
        .map(|(_, size)| size)
        .sum()
}

// Goal: garbage collection never changes what the disk reads, keeps the live bytes per
// segment equal to a recount, bounds what is stored, and leaves nothing behind that the
// store does not know of, through clean closes, crashes and the background collector
// racing the client. Method: four rounds of random writes, zeroings, flushes and forced
// collection rounds (random thresholds) on a 1 MiB disk with 64 KiB segments, mirrored in a
// model; random reads compared after every step, the live-byte recount checked after every
// step; at each round's end a flush and a round at 0.5 (stored segment bytes ≤ 2 × live
// + 4 segments), then a clean close (round 0) or an abandoned store (a crash) and reopen:
// the whole disk equals the model and the listed segments are exactly the ones the store
// counts. Rounds 2 and 3 also run the background collector (`gc=on`).
#[test]
fn garbage_collection_keeps_a_shadow_model_through_reopen_and_crash() {
    let name = "garbage_collection_keeps_a_shadow_model_through_reopen_and_crash";
    if !have_moto(name) {
        return;
    }
    garbage_collection_keeps_a_shadow_model(&Moto::start(), "");
}

#[test]
fn garbage_collection_keeps_a_shadow_model_through_reopen_and_crash_on_seaweedfs() {
    // Goal and method: those of
    // `garbage_collection_keeps_a_shadow_model_through_reopen_and_crash`, on SeaweedFS.
    let name = "garbage_collection_keeps_a_shadow_model_through_reopen_and_crash_on_seaweedfs";
    if have_seaweedfs(name) {
        garbage_collection_keeps_a_shadow_model(&SeaweedFs::start(), "");
    }
}

/// The body of [`garbage_collection_keeps_a_shadow_model_through_reopen_and_crash`], with
/// `extra` URL parameters on every open (sealing: `&key-file=…&compress=zstd`), on `server`.
fn garbage_collection_keeps_a_shadow_model(server: &dyn S3Server, extra: &str) {
    // GC_SEED=N replays a printed seed.
    let seed: u64 = std::env::var("GC_SEED")
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or_else(rand::random);
    println!("seed {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    server.create_bucket("bucket");
    let raw = Raw::new(server);
    const SIZE: usize = 1 << 20;
    const SEGMENT: u64 = 64 << 10;
    let endpoint = server.endpoint();
    let mut store = open(
        &endpoint,
        &format!("&create-size=1M&layout=log&segment-size=64k&gc=off{extra}"),
    )
    .unwrap();
    let mut model = vec![0u8; SIZE];
    let mut rewritten = 0;
    let mut deleted = 0;
    for round in 0..4 {
        for step in 0..250 {
            let offset = rng.gen_range(0..SIZE);
            let length = rng.gen_range(1..=(SIZE - offset).min(48 << 10));
            match rng.gen_range(0..100) {
                0..=69 => {
                    let data = if !extra.is_empty() && rng.gen_bool(0.5) {
                        compressible(length, &mut rng)
                    } else {
                        random(length, &mut rng)
                    };
                    store.write(&data, offset as u64).unwrap();
                    model[offset..offset + length].copy_from_slice(&data);
                }
                70..=79 => {
                    store.write_zeroes(offset as u64, length as u64).unwrap();
                    model[offset..offset + length].fill(0);
                }
                80..=87 => store.flush().unwrap(),
                _ => {
                    let report = store.collect_garbage(rng.gen_range(0.2..0.9)).unwrap();
                    rewritten += report.segments_rewritten;
                    deleted += report.segments_deleted;
                }
            }
            store
                .check_live_bytes()
                .unwrap_or_else(|error| panic!("seed {seed} round {round} step {step}: {error}"));
            let from = rng.gen_range(0..SIZE);
            let span = rng.gen_range(0..=(SIZE - from).min(200 << 10));
            let mut piece = vec![0u8; span];
            store.read(&mut piece, from as u64).unwrap();
            assert!(
                piece == model[from..from + span],
                "seed {seed} round {round} step {step}: read of {span} at {from}"
            );
        }
        store.flush().unwrap();
        let report = store.collect_garbage(0.5).unwrap();
        rewritten += report.segments_rewritten;
        deleted += report.segments_deleted;
        // Live bytes as stored: an extent that does not end on a 4 KiB boundary keeps its
        // last checked block whole, and this workload's unaligned writes leave many such
        // pieces (the engine's whole-block writes leave none).
        let stored = store.stored_segment_bytes();
        let live = store.mapped_bytes() + store.mapped_extents() as u64 * 4100;
        assert!(
            stored <= 2 * live + 4 * SEGMENT,
            "seed {seed} round {round}: {stored} bytes stored for {live} live (padding included)"
        );
        assert!(read_all(&store, SIZE) == model, "seed {seed} round {round}");
        let gc = if round >= 1 { "on" } else { "off" };
        store = if round == 0 {
            drop(store);
            open(&endpoint, &format!("&gc={gc}{extra}")).unwrap()
        } else {
            let id = crash(store);
            open(&endpoint, &format!("&gc={gc}&break-lock={id}{extra}")).unwrap()
        };
        assert!(
            read_all(&store, SIZE) == model,
            "seed {seed} round {round}: after reopening"
        );
        store
            .check_live_bytes()
            .unwrap_or_else(|error| panic!("seed {seed} round {round} reopened: {error}"));
        // Between rounds of the collector a reopened store with gc=on runs: a delete it
        // completes is counted only after the bucket has lost the segment.
        let (listed, counted) = store.between_collector_rounds(|| {
            (
                listed_bytes(&raw, "log/segments"),
                store.stored_segment_bytes(),
            )
        });
        assert_eq!(
            listed, counted,
            "seed {seed} round {round}: segments in the bucket and counted differ"
        );
        rewritten += store.gc_totals().segments_rewritten;
        deleted += store.gc_totals().segments_deleted;
    }
    assert!(
        rewritten > 0 && deleted > 0,
        "seed {seed}: {rewritten} rewritten, {deleted} deleted"
    );
}

// Goal: a client write that lands between the collector's read of a source segment and its
// append wins over the copy, live and after a crash at any step of the round: after the
// collector's segment is stored but before its checkpoint (replay applies the copy only
// where the range still maps to the source), after the checkpoint but before the source is
// deleted (opening deletes it), and after the delete. Method: segment 1 holds A over
// [0, 48K); B overwrites [16K, 48K) (segment 1 a third live); a round at 0.5 rewrites
// segment 1 and, between its read and its append, the client writes C over [0, 8K). The
// disk must read C, A, B live; then the store is abandoned and the bucket set back (objects
// saved before the round put back, newer checkpoints deleted) to each crash point in turn
// and reopened.
#[test]
fn a_write_between_the_collector_read_and_its_append_wins_live_and_after_a_crash() {
    let name = "a_write_between_the_collector_read_and_its_append_wins_live_and_after_a_crash";
    if !have_moto(name) {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let raw = Raw::new(&moto);
    let endpoint = moto.endpoint();
    let store = open(
        &endpoint,
        "&create-size=1M&layout=log&segment-size=64k&gc=off",
    )
    .unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(35);
    let a = random(48 << 10, &mut rng);
    let b = random(32 << 10, &mut rng);
    let c = random(8 << 10, &mut rng);
    store.write(&a, 0).unwrap();
    store.flush().unwrap();
    store.write(&b, 16 << 10).unwrap();
    store.flush().unwrap();
    let mut expected = a.clone();
    expected[16 << 10..].copy_from_slice(&b);
    expected[..8 << 10].copy_from_slice(&c);
    let before = snapshot(&raw);
    let source = "disk/log/segments/0000000000000001-0000000000000001";
    assert!(before.iter().any(|(key, _)| key == source), "{before:?}");
    let mut written = false;
    let report = store
        .collect_garbage_calling(0.5, &mut || {
            store.write(&c, 0).unwrap();
            written = true;
        })
        .unwrap();
    assert!(written);
    assert_eq!(report.segments_rewritten, 1, "{report:?}");
    assert_eq!(report.segments_deleted, 1, "{report:?}");
    assert!(read_all(&store, 48 << 10) == expected, "live");
    store.check_live_bytes().unwrap();
    store.flush().unwrap();
    let after = snapshot(&raw);
    assert!(
        !after.iter().any(|(key, _)| key == source),
        "source deleted"
    );
    let checkpoints_after: Vec<String> = raw
        .objects("disk/log/checkpoints")
        .into_iter()
        .map(|(key, _)| key)
        .collect();
    // The copy's checkpoint and the one after it, which retired the one naming the source.
    assert_eq!(checkpoints_after.len(), 2, "{checkpoints_after:?}");
    let mut id = crash(store);

    // Each crash point: (what to put back from before the round, keep the new checkpoint).
    for (point, put_back_checkpoints) in [
        ("after the collector's segment, before its checkpoint", true),
        ("after the checkpoint, before the source's delete", false),
        ("after the delete", false),
    ] {
        if point != "after the delete" {
            raw.put(
                source,
                before
                    .iter()
                    .find(|(key, _)| key == source)
                    .unwrap()
                    .1
                    .clone(),
            );
        }
        if put_back_checkpoints {
            for key in &checkpoints_after {
                raw.delete(key);
            }
            for (key, body) in before.iter().filter(|(key, _)| key.contains("checkpoints")) {
                raw.put(key, body.clone());
            }
        }
        let reopened = open(&endpoint, &format!("&gc=off&break-lock={id}")).unwrap();
        assert!(
            read_all(&reopened, 48 << 10) == expected,
            "crash {point}: the copy must not win over the newer write"
        );
        reopened.check_live_bytes().unwrap();
        if !put_back_checkpoints {
            assert!(
                !raw.objects("disk/log/segments")
                    .iter()
                    .any(|(key, _)| key == source),
                "crash {point}: opening deletes the source the checkpoint no longer needs"
            );
        }
        if put_back_checkpoints {
            // Leave the bucket as the round did: the newest checkpoint again.
            drop(reopened);
            let again = open(&endpoint, "&gc=off").unwrap();
            assert!(
                read_all(&again, 48 << 10) == expected,
                "crash {point}: closed"
            );
            id = crash(again);
        } else {
            id = crash(reopened);
        }
    }
}

// Goal: a log disk opened read-only reads what a writing server's recovery would give and
// writes nothing at all: no lock, no deletes (not even of the segment after a gap, which a
// writing open deletes), no checkpoint at close; writes are refused; a disk whose lock
// another server holds is refused unless `break-lock=` names it. Method: three flushed
// epochs in three segments, the store abandoned (its lock left), segment 2 deleted behind
// its back; read-only opens with and without break-lock (recover-prefix=on, since segment 3
// proves segment 2 lost); moto's PUT and DELETE counts before and after; then a writing open
// deletes segment 3.
#[test]
fn a_read_only_log_disk_reads_the_recovered_prefix_and_writes_nothing() {
    let name = "a_read_only_log_disk_reads_the_recovered_prefix_and_writes_nothing";
    if !have_moto(name) {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let raw = Raw::new(&moto);
    let endpoint = moto.endpoint();
    let store = open(&endpoint, "&create-size=1M&layout=log&gc=off").unwrap();
    for epoch in 1..=3u8 {
        store
            .write(&[epoch; 4096], u64::from(epoch) * 4096)
            .unwrap();
        store.flush().unwrap();
    }
    let id = crash(store);
    let segments = raw.objects("disk/log/segments");
    assert_eq!(segments.len(), 3, "{segments:?}");
    raw.delete(&segments[1].0);
    let writes_before = (moto.request_count("PUT"), moto.request_count("DELETE"));
    let refused = LogStore::open_read_only(&url(&endpoint, ""))
        .err()
        .expect("another server's lock refuses a read-only open");
    assert!(
        matches!(refused, OpenError::LockedReadOnly { .. }),
        "{refused}"
    );
    let reader = LogStore::open_read_only(&url(
        &endpoint,
        &format!("&break-lock={id}&recover-prefix=on"),
    ))
    .unwrap();
    assert!(reader.read_only().is_some());
    let image = read_all(&reader, 4 * 4096);
    assert!(image[..4096].iter().all(|&byte| byte == 0));
    assert!(image[4096..8192].iter().all(|&byte| byte == 1));
    assert!(image[8192..].iter().all(|&byte| byte == 0), "after the gap");
    let write = reader.write(&[7; 4096], 0).unwrap_err();
    assert!(
        matches!(write, bufcache_s3::StoreError::ReadOnly { .. }),
        "{write}"
    );
    assert!(reader.write_zeroes(0, 4096).is_err());
    reader.flush().unwrap();
    assert!(reader.collect_garbage(0.5).is_err());
    drop(reader);
    assert_eq!(
        (moto.request_count("PUT"), moto.request_count("DELETE")),
        writes_before,
        "(PUT, DELETE): none from a read-only store"
    );
    assert_eq!(
        raw.objects("disk/log/segments").len(),
        2,
        "segment 3 left in place"
    );
    let writer = open(&endpoint, &format!("&break-lock={id}&recover-prefix=on")).unwrap();
    assert_eq!(
        raw.objects("disk/log/segments").len(),
        1,
        "a writing open deletes it"
    );
    drop(writer);
}

// Goal: a source segment is deleted only once a checkpoint covering the collector's copy is
// stored: when that checkpoint's PUT fails, the round reports the error and the source stays;
// a crash at that point reopens to the same data. Method: a fault proxy in front of moto
// answers every PUT of checkpoint 3 with 500 (after carrying it out, as a lost answer), with
// retries cut to 1 s; segment 1 holds A, segment 2 overwrites two thirds of it; a round at
// 0.5 fails naming the checkpoint and segment 1 is still in the bucket; the store is
// abandoned and the disk reopened directly: A and B read back, and segment 1 (covered by the
// checkpoint that did land, and not named by it) is kept while the log's start is the kept
// checkpoint, and deleted by that store's clean close.
#[test]
fn a_source_segment_stays_until_the_checkpoint_covering_its_copy_is_stored() {
    let name = "a_source_segment_stays_until_the_checkpoint_covering_its_copy_is_stored";
    if !have_moto(name) {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let raw = Raw::new(&moto);
    let proxy = support::FaultProxy::start(
        moto.port,
        "log/checkpoints/0000000000000003-0000000000000001",
        1000,
    );
    let store = open(
        &proxy.endpoint(),
        "&create-size=1M&layout=log&segment-size=64k&gc=off&retry-timeout-ms=1000",
    )
    .unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(35);
    let a = random(48 << 10, &mut rng);
    let b = random(32 << 10, &mut rng);
    store.write(&a, 0).unwrap();
    store.flush().unwrap();
    store.write(&b, 16 << 10).unwrap();
    store.flush().unwrap();
    let mut expected = a.clone();
    expected[16 << 10..].copy_from_slice(&b);
    let source = "disk/log/segments/0000000000000001-0000000000000001";
    let error = store.collect_garbage(0.5).unwrap_err().to_string();
    assert!(error.contains("checkpoints/0000000000000003"), "{error}");
    assert!(
        raw.objects("disk/log/segments")
            .iter()
            .any(|(key, _)| key == source),
        "the source stays while no checkpoint covering its copy is known to be stored"
    );
    assert!(read_all(&store, 48 << 10) == expected, "live");
    let id = crash(store);
    let reopened = open(&moto.endpoint(), &format!("&gc=off&break-lock={id}")).unwrap();
    assert!(read_all(&reopened, 48 << 10) == expected, "after the crash");
    reopened.check_live_bytes().unwrap();
    assert!(
        raw.objects("disk/log/segments")
            .iter()
            .any(|(key, _)| key == source),
        "the checkpoint that landed is the disk's only one: the log's start is kept with it"
    );
    drop(reopened);
    assert!(
        !raw.objects("disk/log/segments")
            .iter()
            .any(|(key, _)| key == source),
        "a clean close writes one more checkpoint and deletes the source"
    );
}

/// A key file of 64 hex digits (and a newline) in `directory`, from `seed`.
fn key_file(directory: &std::path::Path, name: &str, seed: u8) -> String {
    let path = directory.join(name);
    let hex: String = (0..32u8)
        .map(|n| format!("{:02x}", n.wrapping_mul(31).wrapping_add(seed)))
        .collect();
    std::fs::write(&path, format!("{hex}\n")).unwrap();
    path.display().to_string()
}

fn open_disk(endpoint: &str, disk: &str, parameters: &str) -> Result<LogStore, OpenError> {
    LogStore::open_locked(
        &S3Url::parse(&format!(
            "s3://bucket/{disk}?endpoint={endpoint}{parameters}"
        ))
        .unwrap(),
    )
}

// Goal: every seal setting (none, zstd, encryption, both) reads back the newest bytes from
// the open segment, sealed segments, the store and after reopening (the reopen gives no
// `compress=`: the recorded one is followed), and the metadata records the setting.
// Method: one disk per setting with 64 KiB segments; random writes of 1 B to 100 KiB, half
// compressible, and zeroings mirrored in a model; random reads compared with it, flushes,
// then a close, a reopen and a whole-disk compare, then a crash (no checkpoint) after more
// writes and a flush, and a reopen that replays sealed segments.
#[test]
fn every_seal_setting_reads_back_like_a_model_before_and_after_reopen() {
    let name = "every_seal_setting_reads_back_like_a_model_before_and_after_reopen";
    if have_moto(name) {
        every_seal_setting_reads_back_like_a_model(&Moto::start());
    }
}

#[test]
fn every_seal_setting_reads_back_like_a_model_before_and_after_reopen_on_seaweedfs() {
    // Goal and method: those of
    // `every_seal_setting_reads_back_like_a_model_before_and_after_reopen`, on SeaweedFS.
    let name = "every_seal_setting_reads_back_like_a_model_before_and_after_reopen_on_seaweedfs";
    if have_seaweedfs(name) {
        every_seal_setting_reads_back_like_a_model(&SeaweedFs::start());
    }
}

/// The body of the seal-setting tests, on `server`.
fn every_seal_setting_reads_back_like_a_model(server: &dyn S3Server) {
    let seed: u64 = rand::random();
    println!("seed {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    server.create_bucket("bucket");
    let keys = tempfile::tempdir().unwrap();
    let key = key_file(keys.path(), "key", 1);
    const SIZE: usize = 2 << 20;
    let settings = [
        ("plain", String::new()),
        ("zstd", "&compress=zstd".to_string()),
        ("encrypted", format!("&key-file={key}")),
        ("both", format!("&compress=zstd&key-file={key}")),
    ];
    for (disk, parameters) in &settings {
        let key_only = if parameters.contains("key-file") {
            format!("&key-file={key}")
        } else {
            String::new()
        };
        let store = open_disk(
            &server.endpoint(),
            disk,
            &format!("&create-size=2M&layout=log&segment-size=64k{parameters}"),
        )
        .unwrap();
        let seal = store.metadata().seal;
        assert_eq!(
            (
                seal.compression == bufcache_s3::Compression::Zstd,
                seal.key_check.is_some()
            ),
            (parameters.contains("zstd"), parameters.contains("key-file")),
            "{disk}"
        );
        let mut model = vec![0u8; SIZE];
        let mut step_all = |store: &LogStore, model: &mut [u8], steps: usize| {
            for step in 0..steps {
                let offset = rng.gen_range(0..SIZE);
                let length = rng.gen_range(1..=(SIZE - offset).min(100 << 10));
                if rng.gen_bool(0.85) {
                    let data = if rng.gen_bool(0.5) {
                        compressible(length, &mut rng)
                    } else {
                        random(length, &mut rng)
                    };
                    store.write(&data, offset as u64).unwrap();
                    model[offset..offset + length].copy_from_slice(&data);
                } else {
                    store.write_zeroes(offset as u64, length as u64).unwrap();
                    model[offset..offset + length].fill(0);
                }
                if step % 40 == 0 {
                    store.flush().unwrap();
                }
                let from = rng.gen_range(0..SIZE);
                let span = rng.gen_range(0..=(SIZE - from).min(300 << 10));
                let mut piece = vec![0u8; span];
                store.read(&mut piece, from as u64).unwrap();
                assert!(
                    piece == model[from..from + span],
                    "seed {seed} {disk} step {step}: read of {span} at {from}"
                );
            }
        };
        step_all(&store, &mut model, 200);
        assert!(
            read_all(&store, SIZE) == model,
            "seed {seed} {disk}: before flush"
        );
        store.flush().unwrap();
        assert!(
            read_all(&store, SIZE) == model,
            "seed {seed} {disk}: after flush"
        );
        drop(store);
        let store = open_disk(&server.endpoint(), disk, &key_only).unwrap();
        assert!(
            read_all(&store, SIZE) == model,
            "seed {seed} {disk}: after reopen"
        );
        step_all(&store, &mut model, 60);
        store.flush().unwrap();
        let id = crash(store);
        let store = open_disk(
            &server.endpoint(),
            disk,
            &format!("&break-lock={id}{key_only}"),
        )
        .unwrap();
        assert!(
            read_all(&store, SIZE) == model,
            "seed {seed} {disk}: after a crash and replay"
        );
    }
}

// Goal: an encrypted disk opens only with its key, and the seal settings recorded at
// creation are enforced by name: a wrong key is refused at open naming the key file and the
// metadata's key check, no key names key-file=, a key for an unencrypted disk and a
// `compress=` other than the recorded one are refused; none of these writes anything.
// Method: create an encrypted disk, write and close it, snapshot the bucket, try each bad
// open, compare the bucket, then open with the right key and read the data back.
#[test]
fn a_wrong_or_missing_key_and_other_seal_settings_are_refused_at_open_by_name() {
    let name = "a_wrong_or_missing_key_and_other_seal_settings_are_refused_at_open_by_name";
    if !have_moto(name) {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let raw = Raw::new(&moto);
    let keys = tempfile::tempdir().unwrap();
    let right = key_file(keys.path(), "right", 1);
    let wrong = key_file(keys.path(), "wrong", 2);
    let endpoint = moto.endpoint();
    let store = open(
        &endpoint,
        &format!("&create-size=1M&layout=log&key-file={right}"),
    )
    .unwrap();
    store.write(&[5; 8192], 4096).unwrap();
    drop(store);
    let metadata = String::from_utf8(raw.get("disk/bufcache-disk.json")).unwrap();
    assert!(
        metadata.contains("key_check")
            && !metadata.contains(&std::fs::read_to_string(&right).unwrap()[..64]),
        "the metadata records a key check, never the key: {metadata}"
    );
    let before = snapshot(&raw);
    let text = open(&endpoint, &format!("&key-file={wrong}"))
        .err()
        .unwrap()
        .to_string();
    assert!(
        text.contains("wrong key") && text.contains(&wrong),
        "{text}"
    );
    let text = open(&endpoint, "").err().unwrap().to_string();
    assert!(
        text.contains("encrypted") && text.contains("key-file="),
        "{text}"
    );
    let text = open(&endpoint, &format!("&key-file={right}&compress=zstd"))
        .err()
        .unwrap()
        .to_string();
    assert!(
        text.contains("compress=zstd") && text.contains("off"),
        "{text}"
    );
    assert!(
        snapshot(&raw) == before,
        "a refused open changed the bucket"
    );
    let store = open(&endpoint, &format!("&key-file={right}")).unwrap();
    let mut back = vec![0u8; 8192];
    store.read(&mut back, 4096).unwrap();
    assert_eq!(back, vec![5; 8192]);
    drop(store);
    // A key for a disk created without one.
    let plain = open_disk(&endpoint, "plain", "&create-size=1M&layout=log").unwrap();
    drop(plain);
    let text = open_disk(&endpoint, "plain", &format!("&key-file={right}"))
        .err()
        .unwrap()
        .to_string();
    assert!(
        text.contains("unencrypted") && text.contains(&right),
        "{text}"
    );
    // The chunk layout has neither.
    let text = bufcache_s3::ChunkStore::open(
        &S3Url::parse(&format!(
            "s3://bucket/chunky?endpoint={endpoint}&create-size=1M&compress=zstd"
        ))
        .unwrap(),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(text.contains("log-layout disks only"), "{text}");
}

// Goal: a key file that is not a 32-byte key is refused naming the file and what is wrong,
// before any disk is created. Method: files of 31 raw bytes, 63 hex digits, 64 characters
// that are not hex, and a missing file; each create fails and the bucket stays empty.
#[test]
fn a_key_file_of_the_wrong_length_is_refused_naming_the_file() {
    let name = "a_key_file_of_the_wrong_length_is_refused_naming_the_file";
    if !have_moto(name) {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let raw = Raw::new(&moto);
    let keys = tempfile::tempdir().unwrap();
    let cases: [(&str, Vec<u8>, &str); 4] = [
        ("short", vec![7u8; 31], "31 bytes"),
        ("hex63", vec![b'a'; 63], "63 bytes"),
        ("nothex", vec![b'g'; 64], "64 bytes"),
        ("missing", Vec::new(), "cannot read"),
    ];
    for (file, content, expected) in cases {
        let path = keys.path().join(file);
        if file != "missing" {
            std::fs::write(&path, content).unwrap();
        }
        let text = open(
            &moto.endpoint(),
            &format!("&create-size=1M&layout=log&key-file={}", path.display()),
        )
        .err()
        .expect("a bad key file is refused")
        .to_string();
        assert!(
            text.contains(&path.display().to_string()) && text.contains(expected),
            "{file}: {text}"
        );
    }
    assert!(raw.objects("disk/").is_empty(), "nothing was created");
}

// Goal: a flipped byte in a stored sealed extent is a read error naming the segment, never
// wrong data: caught by the frame's checksum, and, when the checksum is forged to match, by
// the encryption's tag; compressed-only extents are caught by the checksum. Method: write
// one 4 KiB extent, close (a checkpoint, so opening replays nothing), flip a byte of the
// stored frame through the bucket, reopen and read.
#[test]
fn a_flipped_byte_in_a_sealed_extent_is_a_read_error_naming_the_segment() {
    let name = "a_flipped_byte_in_a_sealed_extent_is_a_read_error_naming_the_segment";
    if !have_moto(name) {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let raw = Raw::new(&moto);
    let keys = tempfile::tempdir().unwrap();
    let key = key_file(keys.path(), "key", 3);
    let endpoint = moto.endpoint();
    let mut rng = rand::rngs::StdRng::seed_from_u64(35);
    for (disk, parameters) in [
        ("encrypted", format!("&key-file={key}")),
        ("zstd", "&compress=zstd".to_string()),
    ] {
        let data = if disk == "zstd" {
            compressible(4096, &mut rng)
        } else {
            random(4096, &mut rng)
        };
        let create = format!("&create-size=1M&layout=log{parameters}");
        let store = open_disk(&endpoint, disk, &create).unwrap();
        store.write(&data, 8192).unwrap();
        drop(store);
        let key_name = raw.keys(&format!("{disk}/log/segments"))[0].clone();
        let body = raw.get(&key_name);
        // The frame starts after the 64-byte header; its stored length is in the table
        // entry (offset 40 of the 56-byte entry at the end, before the 32-byte tag of an
        // encrypted disk's object).
        let tag_bytes = if disk == "encrypted" { 32 } else { 0 };
        let table = body.len() - tag_bytes - 56;
        let stored = u64::from_le_bytes(body[table + 40..table + 48].try_into().unwrap()) as usize;
        let frame = 64..64 + stored;
        let mut damaged = body.clone();
        damaged[frame.start + stored / 2] ^= 0x20;
        raw.put(&key_name, damaged.clone());
        let reopen = key_only(&parameters);
        let store = open_disk(&endpoint, disk, &reopen).unwrap();
        let mut back = vec![0u8; 4096];
        let text = store
            .read(&mut back, 8192)
            .expect_err("damage is an error")
            .to_string();
        assert!(
            text.contains(&key_name) && text.contains("checksum"),
            "{disk}: {text}"
        );
        drop(store);
        if disk == "encrypted" {
            // Forge the checksum: only the tag can tell now.
            let crc_at = frame.end - 4;
            let forged = crc32fast_hash(&damaged[frame.start..crc_at]);
            damaged[crc_at..frame.end].copy_from_slice(&forged.to_le_bytes());
            raw.put(&key_name, damaged);
            let store = open_disk(&endpoint, disk, &reopen).unwrap();
            let text = store.read(&mut back, 8192).err().unwrap().to_string();
            assert!(
                text.contains(&key_name) && text.contains("authentication"),
                "{text}"
            );
            drop(store);
        }
        raw.put(&key_name, body);
        let store = open_disk(&endpoint, disk, &reopen).unwrap();
        store.read(&mut back, 8192).unwrap();
        assert_eq!(back, data, "{disk}: restored");
    }
}

fn key_only(parameters: &str) -> String {
    parameters
        .split('&')
        .filter(|parameter| parameter.starts_with("key-file="))
        .map(|parameter| format!("&{parameter}"))
        .collect()
}

/// CRC-32 (IEEE), as the segment format uses, bit by bit (the test needs no crate for it).
fn crc32fast_hash(bytes: &[u8]) -> u32 {
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

// Goal: with compression on, compressible data costs fewer stored bytes than the client
// wrote, and incompressible data costs at most a frame per 64 KiB more. Method: write 4 MiB
// of this repository's Rust sources (real text) and 4 MiB of random bytes to a disk with
// `compress=zstd` and one with encryption as well, flush, and compare the stored segment
// bytes with the client's; print the ratios.
#[test]
fn compression_stores_fewer_bytes_than_the_client_wrote() {
    let name = "compression_stores_fewer_bytes_than_the_client_wrote";
    if !have_moto(name) {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let keys = tempfile::tempdir().unwrap();
    let key = key_file(keys.path(), "key", 4);
    const BYTES: usize = 4 << 20;
    let mut sources = Vec::new();
    let mut folders = vec![std::path::PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/.."
    ))];
    while let Some(folder) = folders.pop() {
        let mut entries: Vec<_> = std::fs::read_dir(&folder)
            .unwrap()
            .map(|entry| entry.unwrap().path())
            .collect();
        entries.sort();
        for path in entries {
            if path.is_dir() {
                folders.push(path);
            } else if path.extension().is_some_and(|extension| extension == "rs") {
                sources.extend(std::fs::read(&path).unwrap());
            }
        }
    }
    assert!(
        sources.len() > 256 << 10,
        "{} bytes of sources",
        sources.len()
    );
    let text: Vec<u8> = sources.iter().copied().cycle().take(BYTES).collect();
    let mut rng = rand::rngs::StdRng::seed_from_u64(4);
    let noise = random(BYTES, &mut rng);
    for (disk, parameters) in [
        ("zstd", "&compress=zstd".to_string()),
        ("both", format!("&compress=zstd&key-file={key}")),
        ("encrypted", format!("&key-file={key}")),
    ] {
        for (kind, data) in [("sources", &text), ("random", &noise)] {
            let prefix = format!("{disk}-{kind}");
            let store = open_disk(
                &moto.endpoint(),
                &prefix,
                &format!("&create-size=8M&layout=log{parameters}"),
            )
            .unwrap();
            store.write(data, 0).unwrap();
            store.flush().unwrap();
            let stored = store.stored_segment_bytes();
            let ratio = stored as f64 / BYTES as f64;
            println!("{disk} {kind}: {BYTES} client bytes, {stored} stored, ratio {ratio:.3}");
            // Per 64 KiB extent: a frame (45 bytes encrypted) or, stored as written, its 16
            // block checksums (64 bytes); and a table entry (56).
            let overhead_max = (BYTES as u64 / (64 << 10)) * (64 + 56) + 64 * 4;
            if kind == "sources" && disk != "encrypted" {
                assert!(ratio < 0.5, "{disk} {kind}: ratio {ratio}");
            } else {
                assert!(
                    stored <= BYTES as u64 + overhead_max,
                    "{disk} {kind}: {stored} stored"
                );
            }
            let mut back = vec![0u8; BYTES];
            drop(store);
            let store = open_disk(&moto.endpoint(), &prefix, &key_only(&parameters)).unwrap();
            store.read(&mut back, 0).unwrap();
            assert!(&back == data, "{disk} {kind}: read back");
        }
    }
}

// Goal: garbage collection on an encrypted, compressed disk keeps the shadow model through
// reopen and crash, as on a plain one (copies are unsealed and sealed anew under the new
// segment's sequence). Method: the plain disk's GC property test with `key-file=` and
// `compress=zstd` on every open, half of the writes compressible.
#[test]
fn garbage_collection_keeps_a_shadow_model_on_an_encrypted_compressed_disk() {
    let name = "garbage_collection_keeps_a_shadow_model_on_an_encrypted_compressed_disk";
    if !have_moto(name) {
        return;
    }
    let keys = tempfile::tempdir().unwrap();
    let key = key_file(keys.path(), "key", 5);
    garbage_collection_keeps_a_shadow_model(
        &Moto::start(),
        &format!("&key-file={key}&compress=zstd"),
    );
}
