//! Write and read errors follow the fsyncgate lessons: failed write-back keeps the data dirty
//! and readable, every handle hears of a write-back error once, a healed device gets the data
//! on the next flush, a failed read caches nothing, and a cache full of unwritable dirty data
//! makes writers fail loudly instead of dropping anything.
//!
//! Method: a `FaultDevice` over a `MemoryDevice` below the cache; faults are switched on and
//! off at run time and what landed is checked on the inner device.

// Tests drive the engine from real threads on real time; only the engine itself may not.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use bufcache::{
    Cache, CacheConfig, CacheError, Device, FaultDevice, FaultKind, MemoryDevice, ObjectConfig,
    ObjectHandle,
};

type Faulty = Arc<FaultDevice<MemoryDevice>>;

fn setup(memory: u64, space_wait: Duration) -> (Cache, ObjectHandle, Faulty) {
    let fault = Arc::new(FaultDevice::new(MemoryDevice::new(1 << 20), 1));
    let cache = bufcache_host::system_cache(CacheConfig {
        buffer_bytes_max: 4096,
        memory_bytes_max: memory,
        buffers_max: memory / 4096,
        space_wait_max: space_wait,
        readahead_bytes_max: 0,
        ..CacheConfig::default()
    })
    .unwrap();
    let handle = cache
        .open_object(ObjectConfig::new("e", fault.clone() as Arc<dyn Device>))
        .unwrap();
    (cache, handle, fault)
}

fn pattern(seed: u8, length: usize) -> Vec<u8> {
    (0..length)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn on_device(fault: &Faulty, offset: u64, length: usize) -> Vec<u8> {
    let mut data = vec![0u8; length];
    fault.inner().read_into(offset, &mut data).unwrap();
    data
}

#[test]
fn failed_writeback_keeps_data_readable_and_every_handle_hears_once() {
    let (cache, first, fault) = setup(1 << 20, Duration::from_secs(2));
    let second = first.reopen();
    let data = pattern(1, 8 * 4096);
    first.write_at(0, &data, false).unwrap();
    fault.set_failing(FaultKind::Write, true);

    let error = first
        .flush()
        .expect_err("flush must report the failed write-back");
    assert!(
        error.to_string().contains("injected write fault"),
        "the error names its cause: {error}"
    );
    let mut back = vec![0u8; data.len()];
    first.read_at(0, &mut back).unwrap();
    assert_eq!(back, data, "the data is still readable from the cache");
    assert!(
        cache.stats().dirty_bytes >= data.len() as u64,
        "still dirty"
    );
    assert_eq!(on_device(&fault, 0, data.len()), vec![0u8; data.len()]);
    assert!(
        first.flush().is_err(),
        "a second flush while the device still fails must not say success (fsyncgate)"
    );

    // A handle opened after the failure was not open when it happened.
    let late = first.reopen();
    fault.set_failing(FaultKind::Write, false);

    let error = second
        .flush()
        .expect_err("the other handle hears of the earlier failure once");
    assert!(
        matches!(error, CacheError::WritebackFailed { .. }),
        "reported as an earlier write-back failure: {error}"
    );
    assert_eq!(
        on_device(&fault, 0, data.len()),
        data,
        "that flush wrote the data"
    );
    assert_eq!(cache.stats().dirty_bytes, 0);
    second.flush().expect("once only");
    first.flush().expect("the first handle already heard");
    late.flush().expect("opened after the error");
    assert!(fault.stats().injected(FaultKind::Write) > 0);
}

#[test]
fn failed_device_flush_is_reported_and_retried() {
    let (_cache, first, fault) = setup(1 << 20, Duration::from_secs(2));
    let second = first.reopen();
    let data = pattern(2, 4096);
    first.write_at(4096, &data, false).unwrap();
    fault.set_failing(FaultKind::Flush, true);
    let error = first.flush().expect_err("flush fails");
    assert!(
        error.to_string().contains("injected flush fault"),
        "{error}"
    );
    assert!(
        first.write_at(0, &data, true).is_err(),
        "a FUA write needs a flush too"
    );
    fault.set_failing(FaultKind::Flush, false);
    assert!(second.flush().is_err(), "the other handle hears once");
    second.flush().unwrap();
    // The FUA write's own flush failure was returned by write_at: that counts as reported to
    // the first handle, so its next flush, after healing, succeeds.
    first.flush().unwrap();
    assert_eq!(on_device(&fault, 4096, 4096), data);
}

#[test]
fn errors_of_background_writeback_reach_the_next_flush() {
    let (cache, handle, fault) = setup(4 << 20, Duration::from_secs(2));
    fault.set_failing(FaultKind::Write, true);
    // Whole clusters completed by a sequential writer are written behind in the background.
    let data = pattern(3, 256 * 4096);
    handle.write_at(0, &data, false).unwrap();
    cache.writeback_tick();
    let started = Instant::now();
    while fault.stats().injected(FaultKind::Write) == 0
        && started.elapsed() < Duration::from_secs(2)
    {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        fault.stats().injected(FaultKind::Write) > 0,
        "background write-back tried and failed"
    );
    fault.set_failing(FaultKind::Write, false);
    assert!(
        handle.flush().is_err(),
        "the background failure is reported by the next flush"
    );
    handle.flush().unwrap();
    assert_eq!(on_device(&fault, 0, data.len()), data);
}

#[test]
fn torn_writes_are_rewritten_whole_after_healing() {
    let (_cache, handle, fault) = setup(1 << 20, Duration::from_secs(2));
    let data = pattern(4, 64 * 4096);
    handle.write_at(0, &data, false).unwrap();
    fault.set_torn_writes(true);
    fault.set_failing(FaultKind::Write, true);
    assert!(handle.flush().is_err());
    assert!(fault.stats().torn_writes > 0);
    let mut back = vec![0u8; data.len()];
    handle.read_at(0, &mut back).unwrap();
    assert_eq!(back, data, "the cache still has every byte");
    fault.heal();
    handle.flush().unwrap();
    assert_eq!(on_device(&fault, 0, data.len()), data);
}

#[test]
fn failed_read_caches_nothing_and_a_later_read_goes_to_the_device() {
    let (cache, handle, fault) = setup(1 << 20, Duration::from_secs(2));
    let data = pattern(5, 4096);
    fault
        .inner()
        .write_vectored_at(&[std::io::IoSlice::new(&data)], 8192)
        .unwrap();
    fault.set_failing(FaultKind::Read, true);
    let mut back = vec![0u8; 4096];
    let error = handle.read_at(8192, &mut back).expect_err("read fails");
    assert!(
        error
            .to_string()
            .contains("injected read fault at offset 8192"),
        "{error}"
    );
    assert!(handle.bread(2).is_err(), "bread fails too");
    assert!(
        handle.write_at(8192 + 100, b"partial", false).is_err(),
        "a partial write needs the block and fails"
    );
    let stats = cache.stats();
    assert_eq!(stats.buffers_in_use, 0, "nothing cached: {stats:?}");
    assert_eq!(stats.dirty_bytes, 0);
    let reads_before = fault.stats().requests(FaultKind::Read);
    fault.set_failing(FaultKind::Read, false);
    handle.read_at(8192, &mut back).unwrap();
    assert_eq!(back, data);
    assert_eq!(
        fault.stats().requests(FaultKind::Read),
        reads_before + 1,
        "the read after healing went to the device"
    );
    handle.read_at(8192, &mut back).unwrap();
    assert_eq!(
        fault.stats().requests(FaultKind::Read),
        reads_before + 1,
        "and is cached now"
    );
}

#[test]
fn memory_full_of_unwritable_dirty_data_fails_writers_never_drops_data() {
    let space_wait = Duration::from_millis(300);
    let (cache, handle, fault) = setup(32 << 10, space_wait);
    fault.set_failing(FaultKind::Write, true);
    let mut accepted = Vec::new();
    let mut failure = None;
    for block in 0..64u64 {
        let data = pattern(block as u8, 4096);
        let started = Instant::now();
        match handle.write_at(block * 4096, &data, false) {
            Ok(()) => accepted.push((block, data)),
            Err(error) => {
                failure = Some((error, started.elapsed()));
                break;
            }
        }
    }
    let (error, waited) = failure.expect("a writer must get an error once memory is full");
    assert!(
        matches!(
            error,
            CacheError::NoSpace { .. }
                | CacheError::Device { .. }
                | CacheError::WritebackFailed { .. }
        ),
        "NoSpace or the write error: {error}"
    );
    assert!(
        waited < space_wait + Duration::from_secs(2),
        "bounded by space_wait_max: {waited:?}"
    );
    assert!(
        !accepted.is_empty() && accepted.len() <= 8,
        "{}",
        accepted.len()
    );
    for (block, data) in &accepted {
        let mut back = vec![0u8; 4096];
        handle.read_at(block * 4096, &mut back).unwrap();
        assert_eq!(&back, data, "accepted block {block} is still readable");
    }
    let stats = cache.stats();
    assert_eq!(stats.dirty_bytes, accepted.len() as u64 * 4096, "{stats:?}");
    fault.set_failing(FaultKind::Write, false);
    let _ = handle.flush(); // may report the earlier failure once
    handle.flush().unwrap();
    for (block, data) in &accepted {
        assert_eq!(
            &on_device(&fault, block * 4096, 4096),
            data,
            "block {block}"
        );
    }
}

/// Goal: objects are isolated from each other's device failures (issue #32: two exports in
/// one cache, one's upstream refusing writes, and 9–12 of 24 uncached reads of the healthy
/// one returned EIO — the write-back error of evicting the other's blocks). An allocation
/// for object b that has to make room by writing back object a's dirty data, which fails,
/// must never get a's I/O error: it reads (room found elsewhere) or gets `NoSpace`; a's error
/// stays latched for a's own flushers. Method: a cache of 8 buffers; a's device fails every
/// write and a fills the cache with dirty blocks, as far as the dirty limit allows; 24
/// reads of 4 of b's uncached blocks follow, each needing more buffers than are clean.
#[test]
fn a_failing_object_never_fails_another_objects_allocation() {
    let fault = Arc::new(FaultDevice::new(MemoryDevice::new(1 << 20), 1));
    let cache = bufcache_host::system_cache(CacheConfig {
        buffer_bytes_max: 4096,
        memory_bytes_max: 32 << 10,
        buffers_max: 8,
        space_wait_max: Duration::from_millis(100),
        readahead_bytes_max: 0,
        // As much of the cache dirty as the engine allows, and kept dirty.
        dirty_background_percent: 89,
        dirty_limit_percent: 90,
        write_behind: false,
        ..CacheConfig::default()
    })
    .unwrap();
    let failing = cache
        .open_object(ObjectConfig::new("a", fault.clone() as Arc<dyn Device>))
        .unwrap();
    let healthy_device = Arc::new(MemoryDevice::new(1 << 20));
    let healthy_data = pattern(9, 24 * 4096);
    healthy_device
        .write_vectored_at(&[std::io::IoSlice::new(&healthy_data)], 0)
        .unwrap();
    let healthy = cache
        .open_object(ObjectConfig::new("b", healthy_device as Arc<dyn Device>))
        .unwrap();
    fault.set_failing(FaultKind::Write, true);
    // a's writes fill the cache until one needs room and fails with a's own error.
    let accepted = (0..8u64)
        .take_while(|&block| {
            failing
                .write_at(block * 4096, &pattern(block as u8, 4096), false)
                .is_ok()
        })
        .count() as u64;
    let dirty_bytes = cache.stats().dirty_bytes;
    eprintln!("a: {accepted} blocks accepted, {dirty_bytes} bytes dirty");
    assert_eq!(
        dirty_bytes,
        accepted * 4096,
        "nothing of a's was written or dropped"
    );
    // Reads of several blocks: each needs more buffers than the one a left clean.
    let mut read = 0;
    for index in 0..24u64 {
        let offset = (index % 6) * 4 * 4096;
        let mut back = vec![0u8; 4 * 4096];
        match healthy.read_at(offset, &mut back) {
            Ok(()) => {
                let expected = &healthy_data[offset as usize..][..back.len()];
                assert!(back == expected, "read {index} at {offset}");
                read += 1;
            }
            Err(CacheError::NoSpace { .. }) => {}
            Err(other) => panic!("a read of b got another object's error: {other}"),
        }
    }
    eprintln!("{read} of 24 reads of the healthy object served, the rest NoSpace");
    assert!(
        failing.flush().is_err(),
        "the failing object's own flusher hears of its write-back error"
    );
    fault.set_failing(FaultKind::Write, false);
    let _ = failing.flush();
    failing.flush().unwrap();
    for block in 0..accepted {
        assert_eq!(
            on_device(&fault, block * 4096, 4096),
            pattern(block as u8, 4096),
            "block {block}"
        );
    }
}
