//! `CountingDevice`: a wrapper that counts every request reaching the device below it.
//!
//! It counts requests and bytes by direction, flushes, discards and errors, and keeps a
//! request-size histogram per direction in power-of-two buckets. Counters are atomics updated
//! after the inner request returns, so a snapshot never shows a transfer that has not happened.
//! The average transfer size is bytes / requests of the same direction (seed 001: iostat got
//! this wrong by mixing directions).

use std::io::{self, IoSlice, IoSliceMut};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use crate::device::{total_length, Capabilities, Device, Extent};
use crate::request::{ReadRequest, WriteRequest};

/// Histogram buckets: bucket `i` counts requests of at most `512 << i` bytes; the last bucket
/// counts everything larger.
pub const HISTOGRAM_BUCKETS: usize = 18;

/// Upper bound in bytes of histogram bucket `index` (`u64::MAX` for the last).
pub fn histogram_bucket_limit_bytes(index: usize) -> u64 {
    if index + 1 >= HISTOGRAM_BUCKETS {
        u64::MAX
    } else {
        512u64 << index
    }
}

fn histogram_bucket(length_bytes: u64) -> usize {
    (0..HISTOGRAM_BUCKETS)
        .find(|&index| length_bytes <= histogram_bucket_limit_bytes(index))
        .unwrap_or(HISTOGRAM_BUCKETS - 1)
}

#[derive(Default)]
struct DirectionCounters {
    requests: AtomicU64,
    bytes: AtomicU64,
    errors: AtomicU64,
    histogram: [AtomicU64; HISTOGRAM_BUCKETS],
}

impl DirectionCounters {
    fn record(&self, length_bytes: u64, result: &io::Result<()>) {
        if result.is_err() {
            self.errors.fetch_add(1, Relaxed);
            return;
        }
        self.requests.fetch_add(1, Relaxed);
        self.bytes.fetch_add(length_bytes, Relaxed);
        self.histogram[histogram_bucket(length_bytes)].fetch_add(1, Relaxed);
    }

    fn snapshot(&self) -> DirectionStats {
        DirectionStats {
            requests: self.requests.load(Relaxed),
            bytes: self.bytes.load(Relaxed),
            errors: self.errors.load(Relaxed),
            histogram: std::array::from_fn(|index| self.histogram[index].load(Relaxed)),
        }
    }
}

/// Counts for one direction.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DirectionStats {
    /// Requests that completed successfully.
    pub requests: u64,
    /// Bytes moved by successful requests.
    pub bytes: u64,
    /// Requests that failed.
    pub errors: u64,
    /// Successful requests by size; see [`histogram_bucket_limit_bytes`].
    pub histogram: [u64; HISTOGRAM_BUCKETS],
}

impl DirectionStats {
    /// Mean size of a successful request in bytes (0 when there were none).
    pub fn average_transfer_bytes(&self) -> f64 {
        if self.requests == 0 {
            0.0
        } else {
            self.bytes as f64 / self.requests as f64
        }
    }

    /// The largest histogram bucket limit that holds a request, a bound on the largest request.
    pub fn largest_bucket_limit_bytes(&self) -> u64 {
        self.histogram
            .iter()
            .rposition(|&count| count > 0)
            .map(histogram_bucket_limit_bytes)
            .unwrap_or(0)
    }

    /// Difference between two snapshots (self later than `earlier`).
    pub fn since(&self, earlier: &DirectionStats) -> DirectionStats {
        DirectionStats {
            requests: self.requests - earlier.requests,
            bytes: self.bytes - earlier.bytes,
            errors: self.errors - earlier.errors,
            histogram: std::array::from_fn(|index| {
                self.histogram[index] - earlier.histogram[index]
            }),
        }
    }
}

/// A snapshot of a [`CountingDevice`]'s counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceStats {
    /// Reads.
    pub reads: DirectionStats,
    /// Writes (including write_zeroes that moved data).
    pub writes: DirectionStats,
    /// Successful flushes.
    pub flushes: u64,
    /// Successful discards and write_zeroes requests.
    pub discards: u64,
    /// Failed flushes and discards.
    pub other_errors: u64,
}

impl DeviceStats {
    /// Difference between two snapshots (self later than `earlier`).
    pub fn since(&self, earlier: &DeviceStats) -> DeviceStats {
        DeviceStats {
            reads: self.reads.since(&earlier.reads),
            writes: self.writes.since(&earlier.writes),
            flushes: self.flushes - earlier.flushes,
            discards: self.discards - earlier.discards,
            other_errors: self.other_errors - earlier.other_errors,
        }
    }
}

/// A device wrapper that counts what reaches the inner device.
pub struct CountingDevice<D> {
    inner: D,
    /// Shared with the completions of submitted requests, which may run on another thread.
    reads: Arc<DirectionCounters>,
    writes: Arc<DirectionCounters>,
    flushes: AtomicU64,
    discards: AtomicU64,
    other_errors: AtomicU64,
}

impl<D: Device> CountingDevice<D> {
    /// Wraps `inner`.
    pub fn new(inner: D) -> Self {
        CountingDevice {
            inner,
            reads: Arc::default(),
            writes: Arc::default(),
            flushes: AtomicU64::new(0),
            discards: AtomicU64::new(0),
            other_errors: AtomicU64::new(0),
        }
    }

    /// The wrapped device.
    pub fn inner(&self) -> &D {
        &self.inner
    }

    /// The counters now.
    pub fn stats(&self) -> DeviceStats {
        DeviceStats {
            reads: self.reads.snapshot(),
            writes: self.writes.snapshot(),
            flushes: self.flushes.load(Relaxed),
            discards: self.discards.load(Relaxed),
            other_errors: self.other_errors.load(Relaxed),
        }
    }

    fn record_other(&self, counter: &AtomicU64, result: &io::Result<()>) {
        match result {
            Ok(()) => counter.fetch_add(1, Relaxed),
            Err(_) => self.other_errors.fetch_add(1, Relaxed),
        };
    }
}

impl<D: Device> Device for CountingDevice<D> {
    fn read_vectored_at(&self, buffers: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<()> {
        let length = total_length(buffers.iter().map(|b| b.len()));
        let result = self.inner.read_vectored_at(buffers, offset);
        self.reads.record(length, &result);
        result
    }

    fn write_vectored_at(&self, buffers: &[IoSlice<'_>], offset: u64) -> io::Result<()> {
        let length = total_length(buffers.iter().map(|b| b.len()));
        let result = self.inner.write_vectored_at(buffers, offset);
        self.writes.record(length, &result);
        result
    }

    fn submit_reads(&self, reads: Vec<ReadRequest>) {
        let reads = reads
            .into_iter()
            .map(|read| {
                let (length, counts) = (read.length_bytes(), Arc::clone(&self.reads));
                read.on_complete(move |result| {
                    counts.record(length, &result);
                    result
                })
            })
            .collect();
        self.inner.submit_reads(reads);
    }

    fn submit_writes(&self, writes: Vec<WriteRequest>) {
        let writes = writes
            .into_iter()
            .map(|write| {
                let (length, counts) = (write.length_bytes(), Arc::clone(&self.writes));
                write.on_complete(move |result| {
                    counts.record(length, &result);
                    result
                })
            })
            .collect();
        self.inner.submit_writes(writes);
    }

    fn flush(&self) -> io::Result<()> {
        let result = self.inner.flush();
        self.record_other(&self.flushes, &result);
        result
    }

    fn discard(&self, offset: u64, length: u64) -> io::Result<()> {
        let result = self.inner.discard(offset, length);
        self.record_other(&self.discards, &result);
        result
    }

    fn write_zeroes(&self, offset: u64, length: u64) -> io::Result<()> {
        let result = self.inner.write_zeroes(offset, length);
        self.record_other(&self.discards, &result);
        result
    }

    fn extents(&self, offset: u64, length: u64) -> io::Result<Vec<Extent>> {
        self.inner.extents(offset, length)
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryDevice;

    #[test]
    fn counts_requests_bytes_and_sizes_by_direction() {
        let device = CountingDevice::new(MemoryDevice::new(1 << 20));
        let data = vec![1u8; 65536];
        device.write_vectored_at(&[IoSlice::new(&data)], 0).unwrap();
        device
            .write_vectored_at(&[IoSlice::new(&data[..4096])], 65536)
            .unwrap();
        let mut back = vec![0u8; 4096];
        device
            .read_vectored_at(&mut [IoSliceMut::new(&mut back)], 0)
            .unwrap();
        assert!(device
            .read_vectored_at(&mut [IoSliceMut::new(&mut back)], 1 << 20)
            .is_err());
        let stats = device.stats();
        assert_eq!(stats.writes.requests, 2);
        assert_eq!(stats.writes.bytes, 65536 + 4096);
        assert_eq!(
            stats.writes.average_transfer_bytes(),
            (65536.0 + 4096.0) / 2.0
        );
        assert_eq!(stats.writes.largest_bucket_limit_bytes(), 65536);
        assert_eq!(stats.reads.requests, 1);
        assert_eq!(stats.reads.errors, 1);
        assert_eq!(stats.reads.histogram[histogram_bucket(4096)], 1);
    }

    #[test]
    fn a_batch_counts_each_of_its_writes() {
        // Goal: what a batch carries is counted write by write, as separate writes would be.
        // Method: a batch of a 64 KiB and a 4 KiB write counts two requests and their bytes.
        let device = CountingDevice::new(MemoryDevice::new(1 << 20));
        let results = crate::device::write_and_wait(
            &device,
            vec![(0, vec![1u8; 65536]), (1 << 19, vec![2u8; 4096])],
        );
        assert!(results.iter().all(|(_, result)| result.is_ok()));
        let writes = device.stats().writes;
        assert_eq!(writes.requests, 2);
        assert_eq!(writes.bytes, 65536 + 4096);
    }
}
