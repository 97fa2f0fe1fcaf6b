//! Writes whose data comes from a source (an NBD client's socket read straight into the cache's
//! buffers): the data lands where it belongs, large writes are filled in few calls, and a
//! source that fails part-way tears the write the way an unacknowledged write may be torn —
//! never putting bytes the client did not send over data on the device.
//!
//! Method: a `MemoryDevice` under a cache with inline background work; sources that copy from
//! a slice, count their calls, or fail after a number of bytes; the device is checked after a
//! flush.

// Tests drive the engine from real threads on real time; only the engine itself may not.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::io::{self, IoSliceMut};
use std::sync::Arc;

use bufcache::{Cache, CacheConfig, CacheError, Device, MemoryDevice, ObjectConfig, ObjectHandle};

const BLOCK: u64 = 4096;

fn setup() -> (Cache, ObjectHandle, Arc<MemoryDevice>) {
    let device = Arc::new(MemoryDevice::new(4 << 20));
    let cache = bufcache_host::system_cache(CacheConfig {
        memory_bytes_max: 2 << 20,
        readahead_bytes_max: 0,
        ..CacheConfig::default()
    })
    .unwrap();
    let handle = cache
        .open_object(ObjectConfig::new("w", device.clone() as Arc<dyn Device>))
        .unwrap();
    (cache, handle, device)
}

fn pattern(seed: u8, length: usize) -> Vec<u8> {
    (0..length)
        .map(|index| seed.wrapping_add((index % 251) as u8) | 1)
        .collect()
}

/// A source that fills slices from `data` and fails once `fail_after` bytes were given.
fn failing_source(
    data: &[u8],
    fail_after: usize,
) -> impl FnMut(&mut [IoSliceMut<'_>]) -> io::Result<()> + '_ {
    let mut given = 0usize;
    move |slices: &mut [IoSliceMut<'_>]| {
        for slice in slices.iter_mut() {
            let take = slice.len().min(fail_after.saturating_sub(given));
            slice[..take].copy_from_slice(&data[given..given + take]);
            given += take;
            if take < slice.len() {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "client gone"));
            }
        }
        Ok(())
    }
}

#[test]
fn a_megabyte_written_from_a_source_lands_whole_in_few_source_calls() {
    // Goal: the data a source supplies reaches the device unchanged, and a 1 MiB write asks
    // the source for its data in a handful of vectored calls (one readv each on a socket),
    // not one call per block. Method: count the source's calls; flush; compare the device.
    let (_cache, handle, device) = setup();
    let data = pattern(7, 1 << 20);
    let mut calls = 0usize;
    let mut given = 0usize;
    let mut source = |slices: &mut [IoSliceMut<'_>]| {
        calls += 1;
        for slice in slices.iter_mut() {
            let length = slice.len();
            slice.copy_from_slice(&data[given..given + length]);
            given += length;
        }
        Ok(())
    };
    handle
        .write_from(BLOCK / 2, data.len() as u64, false, &mut source)
        .unwrap();
    assert!(calls <= 4, "{calls} source calls for 1 MiB");
    handle.flush().unwrap();
    let mut back = vec![0u8; data.len()];
    device.read_into(BLOCK / 2, &mut back).unwrap();
    assert!(back == data, "the device holds what the source gave");
}

#[test]
fn a_failed_source_never_puts_unsent_bytes_over_device_data() {
    // Goal: when the source fails part-way (the client disconnected mid-payload), blocks that
    // were not cached keep their device contents (no zeroes or stale bytes are written in the
    // part the client never sent), a cached block keeps its old bytes beyond what was sent,
    // the error says the data source failed, and nothing dirty is lost. Method: old data on
    // the device, block 0 cached, a write over blocks 0..4 whose source fails in block 2;
    // flush; check every byte on the device.
    let (_cache, handle, device) = setup();
    let old = pattern(50, 4 * BLOCK as usize);
    device
        .write_vectored_at(&[io::IoSlice::new(&old)], 0)
        .unwrap();
    let mut cached = vec![0u8; BLOCK as usize];
    handle.read_at(0, &mut cached).unwrap();
    let new = pattern(90, 4 * BLOCK as usize);
    let sent = 2 * BLOCK as usize + 100;
    let mut source = failing_source(&new, sent);
    let error = handle
        .write_from(0, new.len() as u64, false, &mut source)
        .unwrap_err();
    assert!(
        matches!(error, CacheError::DataSource { .. }),
        "unexpected error: {error}"
    );
    handle.flush().unwrap();
    let mut back = vec![0u8; old.len()];
    device.read_into(0, &mut back).unwrap();
    for (index, &byte) in back.iter().enumerate() {
        let allowed = byte == old[index] || (index < sent && byte == new[index]);
        assert!(
            allowed,
            "byte {index}: {byte:#04x} is neither the old {:#04x} nor a sent {:#04x}",
            old[index], new[index]
        );
    }
    assert_eq!(
        back[BLOCK as usize * 3..],
        old[BLOCK as usize * 3..],
        "a block the source never reached is untouched"
    );
    // The cache agrees with the device: what a reader sees now is what was kept.
    let mut through_cache = vec![0u8; old.len()];
    handle.read_at(0, &mut through_cache).unwrap();
    assert!(through_cache == back);
}

#[test]
fn a_source_that_panics_leaves_no_unfilled_block_cached_and_keeps_what_it_wrote_dirty() {
    // Goal: a panicking source tears a write as a failing one does. Blocks that were not
    // cached must not stay cached unfilled: their buffer memory still holds whatever an
    // earlier block left there (here: another object's data), and a reader must never see
    // it. A cached block the source wrote into before panicking keeps those bytes and is
    // dirty, so the cache and the device agree once flushed. Method: fill and discard 1 MiB
    // of another object so the buffer memory holds its bytes; cache block 0 of this one;
    // write 1 MiB from a source that fills block 0's slice and then panics (caught); every
    // byte read back, before and after a flush, and the device's, must be this object's old
    // data except block 0, which holds the sent bytes.
    let (cache, handle, device) = setup();
    let other_device = Arc::new(MemoryDevice::new(4 << 20));
    let other = cache
        .open_object(ObjectConfig::new("other", other_device as Arc<dyn Device>))
        .unwrap();
    let secret = pattern(7, 1 << 20);
    other.write_at(0, &secret, false).unwrap();
    other.flush().unwrap();
    other.discard(0, 1 << 20).unwrap();
    let old = pattern(33, 1 << 20);
    device
        .write_vectored_at(&[io::IoSlice::new(&old)], 0)
        .unwrap();
    let mut block_zero = vec![0u8; BLOCK as usize];
    handle.read_at(0, &mut block_zero).unwrap();
    let sent = pattern(91, BLOCK as usize);
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut source = |slices: &mut [IoSliceMut<'_>]| -> io::Result<()> {
            slices[0].copy_from_slice(&sent);
            panic!("the source gave up after the first block")
        };
        let _ = handle.write_from(0, 1 << 20, false, &mut source);
    }));
    assert!(panicked.is_err(), "the source's panic reached the caller");
    let mut expected = old.clone();
    expected[..BLOCK as usize].copy_from_slice(&sent);
    let mut back = vec![0u8; 1 << 20];
    handle.read_at(0, &mut back).unwrap();
    assert!(
        back == expected,
        "a read returned bytes that were never written here"
    );
    handle.flush().unwrap();
    let mut on_device = vec![0u8; 1 << 20];
    device.read_into(0, &mut on_device).unwrap();
    assert!(
        on_device == expected,
        "the sent block was kept dirty and nothing else written"
    );
}
