//! The chunk store against a real S3 server (moto on loopback): layout, zero elision,
//! read-modify-write, metadata checks, and errors (never success) while the server is down.

mod support;

use bufcache_device::Device;
use bufcache_s3::{ChunkStore, OpenError, ReadOnly, S3Device, S3Url};
use bytes::Bytes;
use rand::{Rng, SeedableRng};
use support::{
    have_moto, have_seaweedfs, FaultProxy, Moto, Proxy, RefuseProxy, S3Server, SeaweedFs,
};

fn open(endpoint: &str, bucket: &str, parameters: &str) -> Result<ChunkStore, OpenError> {
    ChunkStore::open(
        &S3Url::parse(&format!(
            "s3://{bucket}/disk?endpoint={endpoint}{parameters}"
        ))
        .unwrap(),
    )
}

fn random(length: usize, seed: u64) -> Vec<u8> {
    let mut data = vec![0u8; length];
    rand::rngs::StdRng::seed_from_u64(seed).fill(&mut data[..]);
    data
}

// Goal: whole-chunk writes are one PUT each, partial writes merge into the stored chunk, and
// unaligned reads return exactly what was written. Method: 64 KiB chunks; write random data
// at unaligned offsets across chunk boundaries, compare with a model; count PUTs in moto's log.
#[test]
fn writes_at_any_offset_read_back_and_whole_chunks_are_one_put() {
    if !have_moto("writes_at_any_offset_read_back_and_whole_chunks_are_one_put") {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let store = open(&moto.endpoint(), "bucket", "&create-size=1M&chunk-size=64k").unwrap();
    let mut model = vec![0u8; 1 << 20];
    let puts_before = moto.request_count("PUT");
    let aligned = random(256 << 10, 1);
    store
        .write(Bytes::from(aligned.clone()), 128 << 10)
        .unwrap();
    model[128 << 10..384 << 10].copy_from_slice(&aligned);
    assert_eq!(
        moto.request_count("PUT") - puts_before,
        4,
        "4 whole chunks, 4 PUTs"
    );
    for (seed, offset, length) in [
        (2u64, 1000u64, 70_000usize),
        (3, 300_000, 5),
        (4, 1_000_000, 48_575),
    ] {
        let data = random(length, seed);
        store.write(Bytes::from(data.clone()), offset).unwrap();
        model[offset as usize..offset as usize + length].copy_from_slice(&data);
    }
    let mut back = vec![0u8; 1 << 20];
    store.read(&mut back, 0).unwrap();
    assert!(back == model, "whole disk differs from the model");
    let mut piece = vec![0u8; 99_999];
    store.read(&mut piece, 12_345).unwrap();
    assert!(piece[..] == model[12_345..12_345 + 99_999]);
}

// Goal: zero elision. A sparse 1 GiB disk with 10 MiB written stores about 10 MiB, zero
// chunks are not stored and a whole-chunk write-zeroes deletes its object. Method: count
// and sum the chunk objects by listing the bucket.
#[test]
fn sparse_disk_stores_only_written_chunks_and_zeroes_delete_objects() {
    if have_moto("sparse_disk_stores_only_written_chunks_and_zeroes_delete_objects") {
        sparse_disk_stores_only_written_chunks(&Moto::start());
    }
}

#[test]
fn sparse_disk_stores_only_written_chunks_and_zeroes_delete_objects_on_seaweedfs() {
    // Goal and method: those of
    // `sparse_disk_stores_only_written_chunks_and_zeroes_delete_objects`, on SeaweedFS.
    let name = "sparse_disk_stores_only_written_chunks_and_zeroes_delete_objects_on_seaweedfs";
    if have_seaweedfs(name) {
        sparse_disk_stores_only_written_chunks(&SeaweedFs::start());
    }
}

/// The body of the zero-elision tests, on `store`.
fn sparse_disk_stores_only_written_chunks(store: &dyn S3Server) {
    store.create_bucket("bucket");
    let device =
        S3Device::new(open(&store.endpoint(), "bucket", "&create-size=1G&chunk-size=1M").unwrap());
    assert_eq!(device.len(), 1 << 30);
    let data = random(10 << 20, 5);
    device
        .write_vectored_at(&[std::io::IoSlice::new(&data)], 512 << 20)
        .unwrap();
    // An all-zero write of a chunk that was never stored stores nothing.
    device
        .write_vectored_at(&[std::io::IoSlice::new(&vec![0u8; 2 << 20])], 0)
        .unwrap();
    // Chunks are stored in checked blocks: 4 KiB and its CRC-32 each (docs/s3.md).
    let chunk_object_bytes = (1 << 20) / 4096 * 4100;
    let (count, bytes) = device.store().unwrap().stored_chunks().unwrap();
    assert_eq!((count, bytes), (10, 10 * chunk_object_bytes));
    device.write_zeroes(512 << 20, 3 << 20).unwrap();
    device.discard((515 << 20) + 4096, 4096).unwrap();
    let (count, bytes) = device.store().unwrap().stored_chunks().unwrap();
    assert_eq!(
        (count, bytes),
        (7, 7 * chunk_object_bytes),
        "3 whole chunks zeroed, 1 partially"
    );
    let mut back = vec![0xffu8; 4 << 20];
    device
        .read_vectored_at(&mut [std::io::IoSliceMut::new(&mut back)], 512 << 20)
        .unwrap();
    assert!(back[..3 << 20].iter().all(|&byte| byte == 0));
    assert!(back[3 << 20..(3 << 20) + 4096] == data[3 << 20..(3 << 20) + 4096]);
    assert!(back[(3 << 20) + 4096..(3 << 20) + 8192]
        .iter()
        .all(|&byte| byte == 0));
}

// Goal: the metadata object is written once and checked at every open; a mismatch or a
// missing disk is a clear error naming the parameter, and writes nothing. Method: create,
// reopen with matching, mismatching and absent parameters, count PUTs.
#[test]
fn metadata_is_checked_at_open_and_a_mismatch_writes_nothing() {
    if !have_moto("metadata_is_checked_at_open_and_a_mismatch_writes_nothing") {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let endpoint = moto.endpoint();
    let error = open(&endpoint, "bucket", "").err().unwrap();
    assert!(matches!(error, OpenError::NoDisk { .. }), "{error}");
    assert!(error.to_string().contains("create-size"), "{error}");
    let created = open(&endpoint, "bucket", "&create-size=8M&chunk-size=1M").unwrap();
    assert_eq!(created.metadata().size_bytes, 8 << 20);
    drop(created);
    let puts = moto.request_count("PUT");
    let reopened = open(&endpoint, "bucket", "").unwrap();
    assert_eq!(reopened.metadata().chunk_size_bytes, 1 << 20);
    drop(reopened);
    open(&endpoint, "bucket", "&create-size=8M").unwrap();
    for (parameters, named) in [
        ("&create-size=16M", "create-size"),
        ("&chunk-size=2M", "chunk-size"),
    ] {
        let error = open(&endpoint, "bucket", parameters).err().unwrap();
        assert!(matches!(error, OpenError::Mismatch { .. }), "{error}");
        assert!(error.to_string().contains(&format!("`{named}=")), "{error}");
    }
    assert_eq!(
        moto.request_count("PUT"),
        puts,
        "opening an existing disk writes nothing"
    );
    let error = open(&endpoint, "absent-bucket", "&create-size=8M")
        .err()
        .unwrap();
    assert!(matches!(error, OpenError::Request { .. }), "{error}");
    assert!(error.to_string().contains("NoSuchBucket"), "{error}");
}

// Goal: while the server is unreachable a write or read returns an error (after bounded
// retries), never success; once it is back the same write succeeds and everything written
// before is intact. Method: a proxy in front of moto is taken down and brought back.
#[test]
fn requests_fail_while_the_server_is_down_and_succeed_after() {
    if !have_moto("requests_fail_while_the_server_is_down_and_succeed_after") {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let proxy = Proxy::start(moto.port);
    let store = open(
        &proxy.endpoint(),
        "bucket",
        "&create-size=4M&chunk-size=1M&retry-timeout-ms=1500",
    )
    .unwrap();
    let first = random(1 << 20, 6);
    store.write(Bytes::from(first.clone()), 0).unwrap();
    proxy.set_down(true);
    let second = random(1 << 20, 7);
    assert!(store.write(Bytes::from(second.clone()), 1 << 20).is_err());
    assert!(
        store.write(Bytes::from(second.clone()), 100).is_err(),
        "partial write"
    );
    let mut back = vec![0u8; 2 << 20];
    assert!(store.read(&mut back, 0).is_err());
    proxy.set_down(false);
    store.write(Bytes::from(second.clone()), 1 << 20).unwrap();
    store.read(&mut back, 0).unwrap();
    assert!(back[..1 << 20] == first[..]);
    assert!(back[1 << 20..] == second[..]);
}

// Goal: a store holding the disk lock asks the server nothing about chunks it knows were
// never stored: reading them, writing part of one, zeroing one cost no GET and no DELETE,
// while stored chunks are still read, merged and deleted as before; a second locked open
// is refused naming the holder. Method: count requests in moto's log around each step and
// compare the data with a model; chunks written before the reopen are found by its LIST.
#[test]
fn locked_store_asks_nothing_about_chunks_never_stored() {
    if !have_moto("locked_store_asks_nothing_about_chunks_never_stored") {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let url = |parameters: &str| {
        S3Url::parse(&format!(
            "s3://bucket/disk?endpoint={}{parameters}",
            moto.endpoint()
        ))
        .unwrap()
    };
    let store = ChunkStore::open_locked(&url("&create-size=1M&chunk-size=64k")).unwrap();
    let refused = ChunkStore::open_locked(&url(""))
        .err()
        .expect("a second lock");
    assert!(
        refused
            .to_string()
            .contains(&format!("pid {}", std::process::id())),
        "{refused}"
    );
    let counts = || {
        (
            moto.request_count("GET"),
            moto.request_count("PUT"),
            moto.request_count("DELETE"),
        )
    };
    let mut model = vec![0u8; 1 << 20];
    let before = counts();
    let data = random(10_000, 9);
    store.write(Bytes::from(data.clone()), 70_000).unwrap();
    model[70_000..80_000].copy_from_slice(&data);
    let mut back = vec![0u8; 64 << 10];
    store.read(&mut back, 512 << 10).unwrap();
    store.write_zeroes(256 << 10, 64 << 10).unwrap();
    assert_eq!(
        counts(),
        (before.0, before.1 + 1, before.2),
        "(GET, PUT, DELETE): only the partial write's PUT"
    );
    drop(store);
    let store = ChunkStore::open_locked(&url("")).unwrap();
    let before = counts();
    let data = random(100, 10);
    store.write(Bytes::from(data.clone()), 65_600).unwrap();
    model[65_600..65_700].copy_from_slice(&data);
    let mut back = vec![0u8; 1 << 20];
    store.read(&mut back, 0).unwrap();
    assert!(back == model, "disk differs from the model");
    store.write_zeroes(64 << 10, 64 << 10).unwrap();
    assert_eq!(
        counts(),
        (before.0 + 2, before.1 + 1, before.2 + 1),
        "a stored chunk: GET to merge, PUT, GET to read, DELETE to zero"
    );
}

// Goal: a write-back batch reaches the store as PUTs in flight together, not one round trip
// after another, and each write of the batch keeps its own outcome. Method: 64 KiB chunks
// through a proxy that holds every request 50 ms and counts requests in flight; one batch of
// 16 whole-chunk writes on separate chunks plus one write past the end; at least 8 PUTs must
// have been in flight at once, the bad write alone must fail, and every other chunk must read
// back.
#[test]
fn a_write_batch_keeps_its_puts_in_flight_together_and_each_write_its_outcome() {
    if !have_moto("a_write_batch_keeps_its_puts_in_flight_together_and_each_write_its_outcome") {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("batch");
    let proxy = support::DelayProxy::start(moto.port, std::time::Duration::from_millis(50));
    let store = open(&proxy.endpoint(), "batch", "&create-size=4M&chunk-size=64k").unwrap();
    let device = S3Device::new(store);
    let chunks: Vec<(u64, Vec<u8>)> = (0..16u64)
        .map(|index| (index * 3 * (64 << 10), random(64 << 10, 100 + index)))
        .collect();
    let mut writes = chunks.clone();
    writes.insert(5, (4 << 20, chunks[0].1.clone()));
    let count = writes.len();
    proxy.reset_peak();
    let results = bufcache_device::write_and_wait(&device, writes);
    assert_eq!(results.len(), count, "one outcome per write");
    for (index, (_, result)) in results.iter().enumerate() {
        assert_eq!(
            result.is_err(),
            index == 5,
            "write {index} of the batch: {result:?}"
        );
    }
    assert!(
        proxy.peak() >= 8,
        "the batch's PUTs went {} at a time",
        proxy.peak()
    );
    for (offset, data) in &chunks {
        let mut back = vec![0u8; data.len()];
        device
            .read_vectored_at(&mut [std::io::IoSliceMut::new(&mut back)], *offset)
            .unwrap();
        assert!(back == *data, "chunk at {offset} did not read back");
    }
}

// Goal: taking the disk lock is idempotent (issue #32): a lock PUT the store carried out but
// answered 500 is retried by the client, and the retry fails its If-None-Match condition;
// that must be recognised as our own lock (its body carries our id), not refused as "in use
// by ... pid <our own pid>" with the lock left behind. Method: a proxy in front of moto
// carries out the first PUT of the lock object and answers it 500; the locked open must
// succeed, the lock must name this process's lock id, and dropping the store must delete it.
#[test]
fn a_lock_put_carried_out_but_answered_500_still_takes_the_lock() {
    if !have_moto("a_lock_put_carried_out_but_answered_500_still_takes_the_lock") {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    drop(open(&moto.endpoint(), "bucket", "&create-size=1M&chunk-size=64k").unwrap());
    let proxy = FaultProxy::start(moto.port, bufcache_s3::LOCK_NAME, 1);
    let url = S3Url::parse(&format!("s3://bucket/disk?endpoint={}", proxy.endpoint())).unwrap();
    let store = ChunkStore::open_locked(&url).expect("the server takes its own lock");
    let faults = proxy.faults();
    assert_eq!(faults.len(), 1, "the fault was not injected: {faults:?}");
    assert!(
        faults[0].ends_with(" 200"),
        "the faulted PUT was not carried out: {faults:?}"
    );
    let holder = store.lock_holder().unwrap().expect("a lock object");
    assert_eq!(holder.id, store.lock().unwrap().holder().id);
    assert_eq!(holder.pid, u64::from(std::process::id()));
    drop(store);
    let inspector = open(&moto.endpoint(), "bucket", "").unwrap();
    assert_eq!(
        inspector.lock_holder().unwrap(),
        None,
        "the lock was left behind"
    );
}

// Goal: a store that refuses writes with 403 at open (credentials that may only read) gives a
// read-only store, not an error: no lock, every write refused with PermissionDenied before
// any request, reads served, and the device says read_only. Method: moto behind a proxy that
// answers every PUT and DELETE 403 AccessDenied without forwarding it; data written earlier
// straight to moto must read back through the read-only store, and moto must hold no lock.
// (The CLI test credentials_that_cannot_write_serve_a_read_only_export does the same with
// moto's own IAM checks.)
#[test]
fn a_lock_put_refused_403_opens_the_store_read_only_without_a_lock() {
    if !have_moto("a_lock_put_refused_403_opens_the_store_read_only_without_a_lock") {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let writer = open(&moto.endpoint(), "bucket", "&create-size=1M&chunk-size=64k").unwrap();
    let data = random(100_000, 21);
    writer.write(Bytes::from(data.clone()), 30_000).unwrap();
    drop(writer);
    let proxy = RefuseProxy::start(moto.port, "PUT,DELETE", 403, "AccessDenied");
    let url = S3Url::parse(&format!("s3://bucket/disk?endpoint={}", proxy.endpoint())).unwrap();
    let store = ChunkStore::open_locked(&url).expect("a read-only store, not an error");
    match store.read_only() {
        Some(ReadOnly::WritesRefused(answer)) => assert!(
            answer.contains("403") && answer.contains("AccessDenied"),
            "{answer}"
        ),
        other => panic!("the store must say the store refused writes, not {other:?}"),
    }
    assert!(store.lock().is_none(), "no lock is held");
    let mut back = vec![0u8; 100_000];
    store.read(&mut back, 30_000).unwrap();
    assert!(back == data, "the data written before reads back");
    let puts = moto.request_count("PUT");
    let refused = store.write(Bytes::from_static(b"x"), 0).unwrap_err();
    assert_eq!(
        std::io::Error::from(refused).kind(),
        std::io::ErrorKind::PermissionDenied
    );
    assert!(store.write_zeroes(0, 65_536).is_err());
    assert_eq!(
        moto.request_count("PUT"),
        puts,
        "a refused write sends nothing"
    );
    let device = S3Device::new(store);
    assert!(device.capabilities().read_only);
    drop(device);
    let inspector = open(&moto.endpoint(), "bucket", "").unwrap();
    assert_eq!(inspector.lock_holder().unwrap(), None, "no lock object");
}

// Goal: a store that fails the lock's PUT for any reason but a 403 (a 500 that outlasts the
// retries, a connection closed unanswered) is an error at open naming the lock, never a
// silently read-only store. Method: moto behind a proxy that answers every PUT 500
// InternalError, then behind one that closes the connection of every PUT; retry-timeout-ms=500
// keeps each open short.
#[test]
fn a_lock_put_failing_but_not_403_is_an_error_at_open_not_read_only() {
    if !have_moto("a_lock_put_failing_but_not_403_is_an_error_at_open_not_read_only") {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    drop(open(&moto.endpoint(), "bucket", "&create-size=1M&chunk-size=64k").unwrap());
    for (status, code) in [(500, "InternalError"), (0, "-")] {
        let proxy = RefuseProxy::start(moto.port, "PUT", status, code);
        let url = S3Url::parse(&format!(
            "s3://bucket/disk?endpoint={}&retry-timeout-ms=500",
            proxy.endpoint()
        ))
        .unwrap();
        let error = match ChunkStore::open_locked(&url) {
            Err(error) => error.to_string(),
            Ok(store) => panic!(
                "status {status}: opened (read-only: {:?}) instead of failing",
                store.read_only()
            ),
        };
        assert!(
            error.contains("creating the lock") && error.contains("bufcache-lock.json"),
            "status {status}: {error}"
        );
    }
}

// Goal: a store opened read-only on request writes nothing at all (not the lock, not a new
// disk), refuses a disk another server holds unless break-lock= names that holder (and then
// leaves the lock alone), and refuses to create a disk. Method: count PUTs and DELETEs in
// moto's log around read-only opens, reads and refused writes, with and without a locked
// writer on the same disk.
#[test]
fn a_read_only_open_writes_nothing_and_respects_another_servers_lock() {
    if !have_moto("a_read_only_open_writes_nothing_and_respects_another_servers_lock") {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let url = |parameters: &str| {
        S3Url::parse(&format!(
            "s3://bucket/disk?endpoint={}{parameters}",
            moto.endpoint()
        ))
        .unwrap()
    };
    let counts = || (moto.request_count("PUT"), moto.request_count("DELETE"));
    let before = counts();
    let missing = ChunkStore::open_read_only(&url("&create-size=1M&chunk-size=64k"))
        .err()
        .expect("no disk to open");
    assert!(
        matches!(missing, OpenError::NoDiskReadOnly { .. }),
        "{missing}"
    );
    assert_eq!(counts(), before, "a read-only open creates nothing");
    let writer = ChunkStore::open_locked(&url("&create-size=1M&chunk-size=64k")).unwrap();
    let data = random(5_000, 22);
    writer.write(Bytes::from(data.clone()), 1_000).unwrap();
    let holder = writer.lock().unwrap().holder().clone();
    let refused = ChunkStore::open_read_only(&url(""))
        .err()
        .expect("the disk is held");
    assert!(
        matches!(refused, OpenError::LockedReadOnly { holder: ref named, ref id, .. }
            if **named == holder.to_string() && *id == holder.id),
        "{refused}"
    );
    let before = counts();
    let reader = ChunkStore::open_read_only(&url(&format!("&break-lock={}", holder.id)))
        .expect("break-lock= naming the holder lets a read-only server in");
    assert_eq!(reader.read_only(), Some(&ReadOnly::Requested));
    let mut back = vec![0u8; 5_000];
    reader.read(&mut back, 1_000).unwrap();
    assert!(back == data, "the holder's data reads back");
    assert!(reader.write(Bytes::from_static(b"x"), 0).is_err());
    drop(reader);
    assert_eq!(counts(), before, "no PUT and no DELETE, lock included");
    assert_eq!(
        writer.lock_holder().unwrap(),
        Some(holder),
        "the holder's lock is left in place"
    );
}

// Goal: a store that ignores create-only PUTs (`If-None-Match: *`) is refused at open with
// an error naming the behaviour and `lock=off`, for both layouts, since its lock would keep
// nobody out; with `lock=off` it is served. Method: moto behind a proxy that drops the
// condition headers, as s3rver 3.7.1 behaves.
#[test]
fn a_store_that_ignores_create_only_puts_is_refused_unless_lock_off() {
    if !have_moto("a_store_that_ignores_create_only_puts_is_refused_unless_lock_off") {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("bucket");
    let proxy = FaultProxy::ignoring_conditions(moto.port);
    for (prefix, layout) in [("chunky", "chunk"), ("loggy", "log")] {
        let url = |extra: &str| {
            S3Url::parse(&format!(
                "s3://bucket/{prefix}?endpoint={}&create-size=1M&layout={layout}{extra}",
                proxy.endpoint()
            ))
            .unwrap()
        };
        let refused = S3Device::open_locked(&url(""))
            .err()
            .expect("a store that cannot lock is refused");
        let text = refused.to_string();
        assert!(
            matches!(refused, OpenError::StoreCannotLock { .. })
                && text.contains("If-None-Match")
                && text.contains("lock=off")
                && text.contains(&format!("{prefix}/{}", bufcache_s3::LOCK_NAME)),
            "{text}"
        );
        // The refused server left no lock behind, and `lock=off` serves the store.
        let device = S3Device::open_locked(&url("&lock=off")).unwrap();
        device
            .write_vectored_at(&[std::io::IoSlice::new(&[5u8; 4096])], 0)
            .unwrap();
        device.flush().unwrap();
        let mut back = [0u8; 4096];
        device
            .read_vectored_at(&mut [std::io::IoSliceMut::new(&mut back)], 0)
            .unwrap();
        assert_eq!(back, [5u8; 4096]);
    }
}

// Goal: issue #35 item 5: every run a batch writes into one chunk becomes one read-modify-write
// of that chunk (one GET at most, one PUT), none when the runs cover the chunk, and later runs
// of the batch win where runs overlap. Method: 64 KiB chunks; chunk 0 is stored first; a batch
// of 6 scattered 4 KiB runs in chunk 0 (two of them overlapping), 16 runs covering all of
// chunk 1, and one run in never-written chunk 2; count GETs and PUTs in moto's log and compare
// the disk with a model.
#[test]
fn the_runs_of_one_chunk_in_a_batch_cost_one_get_and_one_put() {
    if !have_moto("the_runs_of_one_chunk_in_a_batch_cost_one_get_and_one_put") {
        return;
    }
    let moto = Moto::start();
    moto.create_bucket("runs");
    // Locked, as `serve` opens it: the store then knows which chunks exist (chunk 2 does not).
    let url = format!(
        "s3://runs/disk?endpoint={}&create-size=1M&chunk-size=64k",
        moto.endpoint()
    );
    let store = ChunkStore::open_locked(&S3Url::parse(&url).unwrap()).unwrap();
    let device = S3Device::new(store);
    let mut model = vec![0u8; 1 << 20];
    let first = random(64 << 10, 7);
    device
        .write_vectored_at(&[std::io::IoSlice::new(&first)], 0)
        .unwrap();
    model[..64 << 10].copy_from_slice(&first);
    let mut runs: Vec<(u64, Vec<u8>)> = [0u64, 3, 9, 10, 15]
        .iter()
        .map(|&block| (block * 4096, random(4096, 200 + block)))
        .collect();
    runs.push((9 * 4096 + 100, random(4096, 300))); // overlaps blocks 9 and 10, written last
    runs.extend((16..32u64).map(|block| (block * 4096, random(4096, 400 + block))));
    runs.push((2 * (64 << 10) + 8192, random(4096, 500)));
    for (offset, data) in &runs {
        model[*offset as usize..*offset as usize + data.len()].copy_from_slice(data);
    }
    let (gets_before, puts_before) = (moto.request_count("GET"), moto.request_count("PUT"));
    let results = bufcache_device::write_and_wait(&device, runs.clone());
    assert!(
        results.iter().all(|(_, result)| result.is_ok()),
        "{:?}",
        results.iter().map(|(_, result)| result).collect::<Vec<_>>()
    );
    assert_eq!(
        moto.request_count("GET") - gets_before,
        1,
        "only chunk 0 is partly written over stored bytes"
    );
    assert_eq!(
        moto.request_count("PUT") - puts_before,
        3,
        "one PUT per chunk touched"
    );
    let mut back = vec![0u8; 1 << 20];
    device
        .read_vectored_at(&mut [std::io::IoSliceMut::new(&mut back)], 0)
        .unwrap();
    assert!(back == model, "the disk differs from the model");
}
