//! `FaultDevice`: a wrapper that injects errors, latency spikes and torn writes.
//!
//! Faults are wrapper devices, never special cases in the engine: tests put a `FaultDevice`
//! (usually over a [`crate::MemoryDevice`] or [`crate::FileDevice`], under a
//! [`crate::CountingDevice`]) below the cache and steer it while the engine runs.
//!
//! A request of a given [`FaultKind`] fails when any of these says so, checked in this order:
//! - the runtime switch ([`FaultDevice::set_failing`]): every request of the kind fails until
//!   the switch is turned off again (a disk that goes bad and later heals);
//! - the script ([`FaultDevice::fail_requests`]): the listed request numbers of the kind fail
//!   (numbers count every request of that kind since the device was made, from 0);
//! - offset ranges ([`FaultDevice::fail_range`]): requests overlapping the range fail;
//! - the rate ([`FaultDevice::set_rate`]): each request fails with a probability, drawn from a
//!   seeded splitmix64 generator, so a run is reproducible from its seed (for one thread, or
//!   for several when their order is fixed).
//!
//! A failing write may be *torn* ([`FaultDevice::set_torn_writes`]): a random whole-sector
//! prefix of it reaches the inner device before the error is returned, like a power cut in the
//! middle of a large write. Latency ([`FaultDevice::set_latency`]) sleeps before a request:
//! always, or as spikes with a probability.
//!
//! Every injected error names itself — `injected write fault at offset 8192 (4096 bytes,
//! write request #3, switch)` — and has kind `Other`. [`FaultDevice::stats`] counts requests
//! seen and faults injected per kind. Requests that are not failed pass through unchanged.

use std::io::{self, IoSlice, IoSliceMut};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use crate::device::{total_length, Capabilities, Device, Extent};
use crate::request::{ReadRequest, WriteRequest};
use crate::rng::SeededRng;

/// Sector size used to tear writes: a torn write keeps a whole number of these.
pub const TORN_SECTOR_BYTES: u64 = 512;

/// The kinds of request a [`FaultDevice`] can fail or slow down.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FaultKind {
    /// `read_vectored_at`.
    Read,
    /// `write_vectored_at`.
    Write,
    /// `flush`.
    Flush,
    /// `discard` and `write_zeroes`.
    Discard,
}

impl FaultKind {
    /// Every kind, in the order of [`FaultStats`]' arrays.
    pub const ALL: [FaultKind; 4] = [
        FaultKind::Read,
        FaultKind::Write,
        FaultKind::Flush,
        FaultKind::Discard,
    ];

    /// Index into [`FaultStats`]' arrays.
    pub fn index(self) -> usize {
        match self {
            FaultKind::Read => 0,
            FaultKind::Write => 1,
            FaultKind::Flush => 2,
            FaultKind::Discard => 3,
        }
    }

    /// Lower-case name used in error messages.
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::Read => "read",
            FaultKind::Write => "write",
            FaultKind::Flush => "flush",
            FaultKind::Discard => "discard",
        }
    }
}

/// Counters of a [`FaultDevice`], indexed by [`FaultKind::index`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultStats {
    /// Requests seen (failed or not).
    pub requests: [u64; 4],
    /// Faults injected.
    pub injected: [u64; 4],
    /// Injected write faults that let a prefix of the write land.
    pub torn_writes: u64,
    /// Requests that were delayed.
    pub delayed: u64,
}

impl FaultStats {
    /// Requests of `kind` seen.
    pub fn requests(&self, kind: FaultKind) -> u64 {
        self.requests[kind.index()]
    }

    /// Faults of `kind` injected.
    pub fn injected(&self, kind: FaultKind) -> u64 {
        self.injected[kind.index()]
    }

    /// Faults injected of every kind.
    pub fn injected_total(&self) -> u64 {
        self.injected.iter().sum()
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct Latency {
    always: Duration,
    spike: Duration,
    spike_probability: f64,
}

#[derive(Default)]
struct Rules {
    rate: [f64; 4],
    script: [Vec<u64>; 4],
    ranges: [Vec<Range<u64>>; 4],
    latency: [Latency; 4],
}

/// A device wrapper that fails, delays or tears requests on command. See the module docs.
pub struct FaultDevice<D> {
    inner: D,
    rules: Mutex<Rules>,
    random: Mutex<SeededRng>,
    switches: [AtomicBool; 4],
    torn_writes: AtomicBool,
    requests: [AtomicU64; 4],
    injected: [AtomicU64; 4],
    torn: AtomicU64,
    delayed: AtomicU64,
}

impl<D: Device> FaultDevice<D> {
    /// Wraps `inner`; `seed` drives every random choice (rates, spikes, tear points).
    pub fn new(inner: D, seed: u64) -> Self {
        FaultDevice {
            inner,
            rules: Mutex::new(Rules::default()),
            random: Mutex::new(SeededRng::new(seed)),
            switches: Default::default(),
            torn_writes: AtomicBool::new(false),
            requests: Default::default(),
            injected: Default::default(),
            torn: AtomicU64::new(0),
            delayed: AtomicU64::new(0),
        }
    }

    /// The wrapped device (for checking what actually landed).
    pub fn inner(&self) -> &D {
        &self.inner
    }

    /// Makes every request of `kind` fail (`true`) or stops doing so (`false`).
    pub fn set_failing(&self, kind: FaultKind, failing: bool) {
        self.switches[kind.index()].store(failing, Ordering::Release);
    }

    /// True while the switch for `kind` is on.
    pub fn is_failing(&self, kind: FaultKind) -> bool {
        self.switches[kind.index()].load(Ordering::Acquire)
    }

    /// Fails each request of `kind` with `probability` (0 turns the rate off).
    pub fn set_rate(&self, kind: FaultKind, probability: f64) {
        self.rules.lock().rate[kind.index()] = probability.clamp(0.0, 1.0);
    }

    /// Fails the requests of `kind` with these numbers (0 = the first request of that kind
    /// this device ever saw). Adds to earlier scripts.
    pub fn fail_requests(&self, kind: FaultKind, numbers: impl IntoIterator<Item = u64>) {
        self.rules.lock().script[kind.index()].extend(numbers);
    }

    /// Fails requests of `kind` that overlap `length` bytes at `offset` (flushes have no
    /// range and are never failed by this rule). Adds to earlier ranges.
    pub fn fail_range(&self, kind: FaultKind, offset: u64, length: u64) {
        self.rules.lock().ranges[kind.index()].push(offset..offset.saturating_add(length));
    }

    /// Lets failing writes land a random whole-sector prefix before returning the error.
    pub fn set_torn_writes(&self, torn: bool) {
        self.torn_writes.store(torn, Ordering::Release);
    }

    /// Sleeps `always` before every request of `kind`, and additionally `spike` with
    /// `spike_probability`. Zero durations turn latency off.
    pub fn set_latency(
        &self,
        kind: FaultKind,
        always: Duration,
        spike: Duration,
        spike_probability: f64,
    ) {
        self.rules.lock().latency[kind.index()] = Latency {
            always,
            spike,
            spike_probability: spike_probability.clamp(0.0, 1.0),
        };
    }

    /// Removes every rule, switch, torn-write setting and latency: the device is healthy.
    /// Counters are kept.
    pub fn heal(&self) {
        *self.rules.lock() = Rules::default();
        for switch in &self.switches {
            switch.store(false, Ordering::Release);
        }
        self.torn_writes.store(false, Ordering::Release);
    }

    /// The counters now.
    pub fn stats(&self) -> FaultStats {
        FaultStats {
            requests: std::array::from_fn(|i| self.requests[i].load(Ordering::Acquire)),
            injected: std::array::from_fn(|i| self.injected[i].load(Ordering::Acquire)),
            torn_writes: self.torn.load(Ordering::Acquire),
            delayed: self.delayed.load(Ordering::Acquire),
        }
    }

    /// Counts the request, sleeps if asked, and decides whether it fails: `Some(cause)`.
    fn admit(&self, kind: FaultKind, range: Option<Range<u64>>) -> (u64, Option<&'static str>) {
        let index = kind.index();
        let number = self.requests[index].fetch_add(1, Ordering::AcqRel);
        let (latency, scripted, in_range, rate) = {
            let rules = self.rules.lock();
            let in_range = range.as_ref().is_some_and(|request| {
                rules.ranges[index].iter().any(|bad| {
                    request.start < bad.end && bad.start < request.end.max(request.start + 1)
                })
            });
            (
                rules.latency[index],
                rules.script[index].contains(&number),
                in_range,
                rules.rate[index],
            )
        };
        let mut sleep = latency.always;
        if latency.spike_probability > 0.0 && self.random.lock().chance(latency.spike_probability) {
            sleep += latency.spike;
        }
        if !sleep.is_zero() {
            self.delayed.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(sleep);
        }
        let cause = if self.switches[index].load(Ordering::Acquire) {
            Some("switch")
        } else if scripted {
            Some("script")
        } else if in_range {
            Some("range")
        } else if rate > 0.0 && self.random.lock().chance(rate) {
            Some("rate")
        } else {
            None
        };
        if cause.is_some() {
            self.injected[index].fetch_add(1, Ordering::AcqRel);
        }
        (number, cause)
    }

    /// The error for write request `number`, failed by `cause`. With torn writes on, a
    /// random whole-sector prefix shorter than the write reaches the inner device first.
    fn fail_write(
        &self,
        buffers: &[IoSlice<'_>],
        offset: u64,
        number: u64,
        cause: &str,
    ) -> io::Error {
        let length = total_length(buffers.iter().map(|b| b.len()));
        if !self.torn_writes.load(Ordering::Acquire) || length == 0 {
            return Self::fault(FaultKind::Write, offset, length, number, cause, "");
        }
        let sectors = length.div_ceil(TORN_SECTOR_BYTES);
        let kept = (self.random.lock().below(sectors) * TORN_SECTOR_BYTES).min(length);
        if kept > 0 {
            let mut prefix: Vec<IoSlice<'_>> = Vec::new();
            let mut left = kept as usize;
            for buffer in buffers {
                if left == 0 {
                    break;
                }
                let step = buffer.len().min(left);
                prefix.push(IoSlice::new(&buffer[..step]));
                left -= step;
            }
            if let Err(error) = self.inner.write_vectored_at(&prefix, offset) {
                return error;
            }
        }
        self.torn.fetch_add(1, Ordering::AcqRel);
        Self::fault(
            FaultKind::Write,
            offset,
            length,
            number,
            cause,
            &format!(", torn after {kept} bytes"),
        )
    }

    fn fault(
        kind: FaultKind,
        offset: u64,
        length: u64,
        number: u64,
        cause: &str,
        extra: &str,
    ) -> io::Error {
        io::Error::other(format!(
            "injected {} fault at offset {offset} ({length} bytes, {} request #{number}, \
                 {cause}{extra})",
            kind.name(),
            kind.name()
        ))
    }
}

impl<D: Device> Device for FaultDevice<D> {
    fn read_vectored_at(&self, buffers: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<()> {
        let length = total_length(buffers.iter().map(|b| b.len()));
        let (number, cause) = self.admit(FaultKind::Read, Some(offset..offset + length));
        match cause {
            Some(cause) => Err(Self::fault(
                FaultKind::Read,
                offset,
                length,
                number,
                cause,
                "",
            )),
            None => self.inner.read_vectored_at(buffers, offset),
        }
    }

    fn write_vectored_at(&self, buffers: &[IoSlice<'_>], offset: u64) -> io::Result<()> {
        let length = total_length(buffers.iter().map(|b| b.len()));
        let (number, cause) = self.admit(FaultKind::Write, Some(offset..offset + length));
        match cause {
            Some(cause) => Err(self.fail_write(buffers, offset, number, cause)),
            None => self.inner.write_vectored_at(buffers, offset),
        }
    }

    /// Each write is admitted (counted, delayed, judged) as if it came alone, in order; the
    /// healthy ones then reach the inner device as one batch, so faults cost a batch none of
    /// its in-flight writes.
    fn submit_writes(&self, writes: Vec<WriteRequest>) {
        let mut healthy = Vec::with_capacity(writes.len());
        for write in writes {
            let (offset, length) = (write.offset(), write.length_bytes());
            match self.admit(FaultKind::Write, Some(offset..offset + length)) {
                (number, Some(cause)) => {
                    let error = self.fail_write(&write.slices(), offset, number, cause);
                    write.complete(Err(error));
                }
                (_, None) => healthy.push(write),
            }
        }
        if !healthy.is_empty() {
            self.inner.submit_writes(healthy);
        }
    }

    /// Each read is judged (and delayed) as if it came alone; the healthy ones are passed on
    /// together.
    fn submit_reads(&self, reads: Vec<ReadRequest>) {
        let mut healthy = Vec::with_capacity(reads.len());
        for read in reads {
            let (offset, length) = (read.offset(), read.length_bytes());
            match self.admit(FaultKind::Read, Some(offset..offset + length)) {
                (number, Some(cause)) => read.complete(Err(Self::fault(
                    FaultKind::Read,
                    offset,
                    length,
                    number,
                    cause,
                    "",
                ))),
                (_, None) => healthy.push(read),
            }
        }
        if !healthy.is_empty() {
            self.inner.submit_reads(healthy);
        }
    }

    fn flush(&self) -> io::Result<()> {
        let (number, cause) = self.admit(FaultKind::Flush, None);
        match cause {
            Some(cause) => Err(Self::fault(FaultKind::Flush, 0, 0, number, cause, "")),
            None => self.inner.flush(),
        }
    }

    fn discard(&self, offset: u64, length: u64) -> io::Result<()> {
        let (number, cause) = self.admit(FaultKind::Discard, Some(offset..offset + length));
        match cause {
            Some(cause) => Err(Self::fault(
                FaultKind::Discard,
                offset,
                length,
                number,
                cause,
                "",
            )),
            None => self.inner.discard(offset, length),
        }
    }

    fn write_zeroes(&self, offset: u64, length: u64) -> io::Result<()> {
        let (number, cause) = self.admit(FaultKind::Discard, Some(offset..offset + length));
        match cause {
            Some(cause) => Err(Self::fault(
                FaultKind::Discard,
                offset,
                length,
                number,
                cause,
                " (write_zeroes)",
            )),
            None => self.inner.write_zeroes(offset, length),
        }
    }

    fn extents(&self, offset: u64, length: u64) -> io::Result<Vec<Extent>> {
        self.inner.extents(offset, length)
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    fn describe(&self) -> String {
        format!("fault:{}", self.inner.describe())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryDevice;

    fn write(device: &dyn Device, offset: u64, data: &[u8]) -> io::Result<()> {
        device.write_vectored_at(&[IoSlice::new(data)], offset)
    }

    fn read(device: &dyn Device, offset: u64, length: usize) -> io::Result<Vec<u8>> {
        let mut data = vec![0u8; length];
        device.read_vectored_at(&mut [IoSliceMut::new(&mut data)], offset)?;
        Ok(data)
    }

    #[test]
    fn healthy_device_passes_everything_through() {
        let device = FaultDevice::new(MemoryDevice::new(1 << 20), 1);
        write(&device, 4096, b"hello").unwrap();
        assert_eq!(read(&device, 4096, 5).unwrap(), b"hello");
        device.flush().unwrap();
        let stats = device.stats();
        assert_eq!(stats.requests(FaultKind::Write), 1);
        assert_eq!(stats.requests(FaultKind::Read), 1);
        assert_eq!(stats.requests(FaultKind::Flush), 1);
        assert_eq!(stats.injected_total(), 0);
        assert!(device.describe().contains("memory"));
    }

    #[test]
    fn switch_fails_writes_until_healed_and_errors_name_themselves() {
        let device = FaultDevice::new(MemoryDevice::new(1 << 20), 1);
        device.set_failing(FaultKind::Write, true);
        let error = write(&device, 8192, &[7u8; 4096]).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::Other);
        let message = error.to_string();
        assert!(
            message.contains("injected write fault at offset 8192"),
            "{message}"
        );
        assert_eq!(read(&device, 8192, 4).unwrap(), [0u8; 4], "nothing landed");
        assert!(read(&device, 8192, 4).is_ok(), "reads are unaffected");
        device.set_failing(FaultKind::Write, false);
        write(&device, 8192, &[7u8; 4096]).unwrap();
        assert_eq!(read(&device, 8192, 4).unwrap(), [7u8; 4]);
        assert_eq!(device.stats().injected(FaultKind::Write), 1);
        device.set_failing(FaultKind::Flush, true);
        assert!(device
            .flush()
            .unwrap_err()
            .to_string()
            .contains("injected flush fault"));
        device.heal();
        device.flush().unwrap();
    }

    #[test]
    fn script_fails_exactly_the_listed_request_numbers() {
        let device = FaultDevice::new(MemoryDevice::new(1 << 20), 1);
        device.fail_requests(FaultKind::Read, [1, 3]);
        let outcomes: Vec<bool> = (0..5).map(|_| read(&device, 0, 512).is_ok()).collect();
        assert_eq!(outcomes, [true, false, true, false, true]);
        device.fail_requests(FaultKind::Read, [5]);
        let error = read(&device, 512, 1).unwrap_err().to_string();
        assert!(error.contains("read request #5, script"), "{error}");
    }

    #[test]
    fn ranges_fail_only_overlapping_requests() {
        let device = FaultDevice::new(MemoryDevice::new(1 << 20), 1);
        device.fail_range(FaultKind::Write, 65536, 4096);
        assert!(
            write(&device, 61440, &[1u8; 4096]).is_ok(),
            "ends at the range"
        );
        assert!(
            write(&device, 69632, &[1u8; 4096]).is_ok(),
            "starts after it"
        );
        assert!(
            write(&device, 64000, &[1u8; 4096]).is_err(),
            "overlaps the start"
        );
        assert!(write(&device, 68000, &[1u8; 10]).is_err(), "inside");
        assert!(
            read(&device, 65536, 4096).is_ok(),
            "reads are a different kind"
        );
        let error = write(&device, 65536, &[1u8; 512]).unwrap_err().to_string();
        assert!(error.contains("range"), "{error}");
        assert_eq!(device.stats().injected(FaultKind::Write), 3);
    }

    #[test]
    fn rates_are_deterministic_per_seed() {
        let pattern = |seed| {
            let device = FaultDevice::new(MemoryDevice::new(1 << 20), seed);
            device.set_rate(FaultKind::Read, 0.3);
            (0..200)
                .map(|_| read(&device, 0, 512).is_ok())
                .collect::<Vec<bool>>()
        };
        let first = pattern(42);
        assert_eq!(first, pattern(42));
        assert_ne!(first, pattern(43));
        let failures = first.iter().filter(|ok| !**ok).count();
        assert!((30..=90).contains(&failures), "{failures} of 200 at 30 %");
    }

    #[test]
    fn torn_writes_land_a_sector_prefix_then_fail() {
        let device = FaultDevice::new(MemoryDevice::new(1 << 20), 7);
        device.set_torn_writes(true);
        device.set_failing(FaultKind::Write, true);
        let data = vec![0xABu8; 16 * 512];
        let mut torn_somewhere = false;
        for attempt in 0..20u64 {
            let offset = attempt * 16 * 512;
            let error = device
                .write_vectored_at(
                    &[IoSlice::new(&data[..1000]), IoSlice::new(&data[1000..])],
                    offset,
                )
                .unwrap_err();
            let message = error.to_string();
            assert!(message.contains("torn after"), "{message}");
            let mut back = vec![0u8; data.len()];
            device.inner().read_into(offset, &mut back).unwrap();
            let kept = back.iter().take_while(|&&b| b == 0xAB).count();
            assert_eq!(kept % 512, 0, "whole sectors");
            assert!(kept < data.len(), "never the whole write");
            assert!(back[kept..].iter().all(|&b| b == 0), "only a prefix");
            torn_somewhere |= kept > 0;
        }
        assert!(torn_somewhere);
        assert_eq!(device.stats().torn_writes, 20);
    }

    #[test]
    fn latency_delays_requests() {
        let device = FaultDevice::new(MemoryDevice::new(1 << 20), 1);
        device.set_latency(
            FaultKind::Read,
            Duration::from_millis(20),
            Duration::ZERO,
            0.0,
        );
        let start = std::time::Instant::now();
        read(&device, 0, 512).unwrap();
        assert!(start.elapsed() >= Duration::from_millis(20));
        write(&device, 0, &[1]).unwrap();
        assert_eq!(device.stats().delayed, 1, "writes are not delayed");
        device.set_latency(
            FaultKind::Write,
            Duration::ZERO,
            Duration::from_millis(1),
            1.0,
        );
        write(&device, 0, &[1]).unwrap();
        assert_eq!(device.stats().delayed, 2, "a certain spike");
    }

    #[test]
    fn discard_and_write_zeroes_share_the_discard_kind() {
        let device = FaultDevice::new(MemoryDevice::new(1 << 20), 1);
        device.set_failing(FaultKind::Discard, true);
        assert!(device.discard(0, 4096).is_err());
        let message = device.write_zeroes(0, 4096).unwrap_err().to_string();
        assert!(message.contains("write_zeroes"), "{message}");
        assert_eq!(device.stats().injected(FaultKind::Discard), 2);
    }

    #[test]
    fn a_batch_is_judged_write_by_write_and_its_healthy_writes_still_land() {
        // Goal: in a batch, each write is counted and judged as if it came alone (request
        // numbers, ranges), a failed one fails only itself, and the healthy ones reach the
        // inner device. Method: script write #1 and a range over the fourth write; a batch of
        // four; read back.
        let device = FaultDevice::new(MemoryDevice::new(1 << 20), 1);
        device.fail_requests(FaultKind::Write, [1]);
        device.fail_range(FaultKind::Write, 3 * 4096, 1);
        let writes: Vec<(u64, Vec<u8>)> = (0..4u8)
            .map(|index| (u64::from(index) * 4096, vec![index + 1; 4096]))
            .collect();
        let results = crate::device::write_and_wait(&device, writes);
        let failed: Vec<bool> = results.iter().map(|(_, result)| result.is_err()).collect();
        assert_eq!(failed, [false, true, false, true]);
        assert!(results[1]
            .1
            .as_ref()
            .unwrap_err()
            .to_string()
            .contains("write request #1, script"));
        assert_eq!(device.stats().requests(FaultKind::Write), 4);
        assert_eq!(device.stats().injected(FaultKind::Write), 2);
        for (index, failed) in failed.iter().enumerate() {
            let expected = if *failed { 0 } else { index as u8 + 1 };
            let back = read(&device, index as u64 * 4096, 4096).unwrap();
            assert!(back.iter().all(|&byte| byte == expected), "write {index}");
        }
    }
}
