//! `CrashDevice`: an in-memory device with a volatile and a durable image, for crash tests.
//!
//! Writes, discards and write_zeroes land in the *volatile* image (what reads see) and are
//! appended to a journal of unflushed requests. `flush` applies the journal to the *durable*
//! image in order and empties it: every write that completed before `flush` was called is
//! durable when it returns, exactly the [`Device`] contract and nothing more.
//!
//! [`CrashDevice::crash`] models a power cut: the journal is resolved by a [`CrashMode`] —
//! dropped, kept whole, kept as a random prefix, a random subset, or torn at sector
//! granularity — into the durable image, the volatile image is reset to the durable one, and
//! the device refuses every request (`crashed`) until [`CrashDevice::restart`], so background
//! work still running in the engine above cannot change what "survived". A crash can also be
//! armed to happen by itself in the middle of the engine's work, just before the n-th
//! following write or flush ([`CrashDevice::crash_after_requests`]).
//!
//! Both images are sparse (4 KiB pages in a map), so a large device costs only what is written.
//! Random choices come from a seeded splitmix64 generator: a crash is reproducible from the
//! seed and the request order.

use std::io::{self, IoSlice, IoSliceMut};

use parking_lot::Mutex;

use crate::device::{all_data, check_range, total_length, Capabilities, Device, Extent};
use crate::rng::SeededRng;
use crate::sparse::SparseStore;

const PAGE_BYTES: u64 = 4096;

/// Granularity at which [`CrashMode::TornSectors`] tears writes.
pub const CRASH_SECTOR_BYTES: u64 = 512;

/// What happens to unflushed requests at a crash.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CrashMode {
    /// Nothing unflushed survives.
    DropUnflushed,
    /// Everything unflushed survives (the disk's cache happened to drain).
    KeepAll,
    /// The first k unflushed requests survive, k random in `0..=n` (an in-order disk).
    KeepPrefix,
    /// Each unflushed request survives or not, independently (a reordering disk).
    KeepSubset,
    /// Each sector of each unflushed request survives or not, independently (torn writes).
    TornSectors,
}

impl CrashMode {
    /// Every mode.
    pub const ALL: [CrashMode; 5] = [
        CrashMode::DropUnflushed,
        CrashMode::KeepAll,
        CrashMode::KeepPrefix,
        CrashMode::KeepSubset,
        CrashMode::TornSectors,
    ];
}

/// Counters of a [`CrashDevice`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CrashStats {
    /// Writes accepted (write_vectored_at).
    pub writes: u64,
    /// Discards and write_zeroes accepted.
    pub zeroings: u64,
    /// Successful flushes.
    pub flushes: u64,
    /// Requests refused because the device had crashed.
    pub refused: u64,
    /// Crashes so far.
    pub crashes: u64,
    /// Unflushed requests now.
    pub pending: u64,
}

#[derive(Clone, Debug)]
enum Payload {
    Data(Vec<u8>),
    Zeroes(u64),
}

impl Payload {
    fn len(&self) -> u64 {
        match self {
            Payload::Data(data) => data.len() as u64,
            Payload::Zeroes(length) => *length,
        }
    }
}

#[derive(Clone, Debug)]
struct Pending {
    offset: u64,
    payload: Payload,
}

/// One image of the disk (what reads see, or what survives a crash), kept sparsely.
#[derive(Clone)]
struct Image {
    store: SparseStore,
}

impl Default for Image {
    fn default() -> Self {
        Image {
            store: SparseStore::new(PAGE_BYTES),
        }
    }
}

impl Image {
    fn write(&mut self, offset: u64, data: &[u8]) {
        self.store.write(offset, data);
    }

    fn zero(&mut self, offset: u64, length: u64) {
        self.store.zero(offset, length);
    }

    fn read(&self, offset: u64, target: &mut [u8]) {
        self.store.read(offset, target);
    }

    fn apply(&mut self, pending: &Pending) {
        match &pending.payload {
            Payload::Data(data) => self.write(pending.offset, data),
            Payload::Zeroes(length) => self.zero(pending.offset, *length),
        }
    }

    /// Applies only the sectors of `pending` for which `keep` says yes.
    fn apply_sectors(&mut self, pending: &Pending, keep: &mut impl FnMut() -> bool) {
        let length = pending.payload.len();
        let mut done = 0u64;
        while done < length {
            let position = pending.offset + done;
            let step = (CRASH_SECTOR_BYTES - position % CRASH_SECTOR_BYTES).min(length - done);
            if keep() {
                match &pending.payload {
                    Payload::Data(data) => {
                        self.write(position, &data[done as usize..(done + step) as usize])
                    }
                    Payload::Zeroes(_) => self.zero(position, step),
                }
            }
            done += step;
        }
    }
}

struct State {
    volatile: Image,
    durable: Image,
    journal: Vec<Pending>,
    crashed: bool,
    armed: Option<(u64, CrashMode)>,
    random: SeededRng,
    stats: CrashStats,
}

impl State {
    fn crash(&mut self, mode: CrashMode) {
        let journal = std::mem::take(&mut self.journal);
        let count = journal.len() as u64;
        match mode {
            CrashMode::DropUnflushed => {}
            CrashMode::KeepAll => journal.iter().for_each(|p| self.durable.apply(p)),
            CrashMode::KeepPrefix => {
                let kept = self.random.below(count + 1) as usize;
                journal[..kept].iter().for_each(|p| self.durable.apply(p));
            }
            CrashMode::KeepSubset => {
                for pending in &journal {
                    if self.random.chance(0.5) {
                        self.durable.apply(pending);
                    }
                }
            }
            CrashMode::TornSectors => {
                let random = &mut self.random;
                for pending in &journal {
                    self.durable
                        .apply_sectors(pending, &mut || random.chance(0.5));
                }
            }
        }
        self.volatile = self.durable.clone();
        self.crashed = true;
        self.armed = None;
        self.stats.crashes += 1;
    }

    /// Refuses the request when crashed, or crashes first when an armed crash is due.
    fn admit(&mut self, what: &str) -> io::Result<()> {
        if let Some((left, mode)) = self.armed {
            if left == 0 {
                self.crash(mode);
            } else {
                self.armed = Some((left - 1, mode));
            }
        }
        if self.crashed {
            self.stats.refused += 1;
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                format!("crash device: {what} refused, the device has crashed (power is off)"),
            ));
        }
        Ok(())
    }
}

/// An in-memory device that can lose power. See the module docs.
pub struct CrashDevice {
    length_bytes: u64,
    state: Mutex<State>,
}

impl CrashDevice {
    /// A zeroed device of `length_bytes`; `seed` drives the random choices of crashes.
    pub fn new(length_bytes: u64, seed: u64) -> Self {
        CrashDevice {
            length_bytes,
            state: Mutex::new(State {
                volatile: Image::default(),
                durable: Image::default(),
                journal: Vec::new(),
                crashed: false,
                armed: None,
                random: SeededRng::new(seed),
                stats: CrashStats::default(),
            }),
        }
    }

    /// Cuts the power now: resolves unflushed requests by `mode` into the durable image, resets
    /// the volatile image to it, and refuses every request until [`CrashDevice::restart`].
    pub fn crash(&self, mode: CrashMode) {
        self.state.lock().crash(mode);
    }

    /// Arms a crash that happens just before the `requests`-th following write, zeroing or
    /// flush is carried out (0: before the next one). The refused request fails.
    pub fn crash_after_requests(&self, requests: u64, mode: CrashMode) {
        self.state.lock().armed = Some((requests, mode));
    }

    /// True after a crash, until restart.
    pub fn is_crashed(&self) -> bool {
        self.state.lock().crashed
    }

    /// Powers the device back on: it serves the durable image.
    pub fn restart(&self) {
        let mut state = self.state.lock();
        state.crashed = false;
        state.armed = None;
    }

    /// Copies durable bytes at `offset` into `target` (works while crashed).
    pub fn read_durable(&self, offset: u64, target: &mut [u8]) -> io::Result<()> {
        check_range(self.length_bytes, offset, target.len() as u64)?;
        self.state.lock().durable.read(offset, target);
        Ok(())
    }

    /// Copies volatile bytes (what a read sees now) at `offset` into `target`.
    pub fn read_volatile(&self, offset: u64, target: &mut [u8]) -> io::Result<()> {
        check_range(self.length_bytes, offset, target.len() as u64)?;
        self.state.lock().volatile.read(offset, target);
        Ok(())
    }

    /// The whole durable image (for small devices).
    pub fn durable_image(&self) -> Vec<u8> {
        let mut image = vec![0u8; self.length_bytes as usize];
        self.state.lock().durable.read(0, &mut image);
        image
    }

    /// The whole volatile image (for small devices).
    pub fn volatile_image(&self) -> Vec<u8> {
        let mut image = vec![0u8; self.length_bytes as usize];
        self.state.lock().volatile.read(0, &mut image);
        image
    }

    /// Unflushed requests now.
    pub fn pending_requests(&self) -> usize {
        self.state.lock().journal.len()
    }

    /// The counters now.
    pub fn stats(&self) -> CrashStats {
        let state = self.state.lock();
        CrashStats {
            pending: state.journal.len() as u64,
            ..state.stats
        }
    }

    fn zeroing(&self, offset: u64, length: u64, what: &str) -> io::Result<()> {
        check_range(self.length_bytes, offset, length)?;
        let mut state = self.state.lock();
        state.admit(what)?;
        if length == 0 {
            return Ok(());
        }
        let pending = Pending {
            offset,
            payload: Payload::Zeroes(length),
        };
        state.volatile.apply(&pending);
        state.journal.push(pending);
        state.stats.zeroings += 1;
        Ok(())
    }
}

impl Device for CrashDevice {
    fn read_vectored_at(&self, buffers: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<()> {
        let length = total_length(buffers.iter().map(|b| b.len()));
        check_range(self.length_bytes, offset, length)?;
        let mut state = self.state.lock();
        if state.crashed {
            state.stats.refused += 1;
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "crash device: read refused, the device has crashed (power is off)",
            ));
        }
        let mut position = offset;
        for buffer in buffers.iter_mut() {
            state.volatile.read(position, buffer);
            position += buffer.len() as u64;
        }
        Ok(())
    }

    fn write_vectored_at(&self, buffers: &[IoSlice<'_>], offset: u64) -> io::Result<()> {
        let length = total_length(buffers.iter().map(|b| b.len()));
        check_range(self.length_bytes, offset, length)?;
        let mut state = self.state.lock();
        state.admit("write")?;
        let mut data = Vec::with_capacity(length as usize);
        for buffer in buffers {
            data.extend_from_slice(buffer);
        }
        state.volatile.write(offset, &data);
        state.journal.push(Pending {
            offset,
            payload: Payload::Data(data),
        });
        state.stats.writes += 1;
        Ok(())
    }

    fn submit_reads(&self, reads: Vec<crate::request::ReadRequest>) {
        crate::device::read_each_now(self, reads)
    }

    fn submit_writes(&self, writes: Vec<crate::request::WriteRequest>) {
        crate::device::write_each_now(self, writes)
    }

    fn flush(&self) -> io::Result<()> {
        let mut state = self.state.lock();
        state.admit("flush")?;
        let journal = std::mem::take(&mut state.journal);
        for pending in &journal {
            state.durable.apply(pending);
        }
        state.stats.flushes += 1;
        Ok(())
    }

    fn discard(&self, offset: u64, length: u64) -> io::Result<()> {
        self.zeroing(offset, length, "discard")
    }

    fn extents(&self, offset: u64, length: u64) -> io::Result<Vec<Extent>> {
        all_data(self.length_bytes, offset, length)
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            discard_zeroes: true,
            write_zeroes_fast: true,
            ..Capabilities::plain(self.length_bytes)
        }
    }

    fn write_zeroes(&self, offset: u64, length: u64) -> io::Result<()> {
        self.zeroing(offset, length, "write_zeroes")
    }

    fn describe(&self) -> String {
        format!("crash:{}", self.length_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(device: &CrashDevice, offset: u64, byte: u8, length: usize) -> io::Result<()> {
        device.write_vectored_at(&[IoSlice::new(&vec![byte; length])], offset)
    }

    fn read(device: &CrashDevice, offset: u64, length: usize) -> Vec<u8> {
        let mut data = vec![0u8; length];
        device
            .read_vectored_at(&mut [IoSliceMut::new(&mut data)], offset)
            .unwrap();
        data
    }

    #[test]
    fn reads_see_volatile_writes_and_flush_makes_them_durable() {
        let device = CrashDevice::new(1 << 20, 1);
        write(&device, 5000, 9, 10_000).unwrap();
        assert_eq!(read(&device, 5000, 10_000), vec![9u8; 10_000]);
        let mut durable = vec![1u8; 10_000];
        device.read_durable(5000, &mut durable).unwrap();
        assert_eq!(durable, vec![0u8; 10_000], "not durable before flush");
        assert_eq!(device.pending_requests(), 1);
        device.flush().unwrap();
        device.read_durable(5000, &mut durable).unwrap();
        assert_eq!(durable, vec![9u8; 10_000]);
        assert_eq!(device.pending_requests(), 0);
        assert!(device.read_durable(1 << 20, &mut [0u8; 1]).is_err());
    }

    #[test]
    fn crash_drops_unflushed_writes_and_refuses_requests_until_restart() {
        let device = CrashDevice::new(1 << 20, 1);
        write(&device, 0, 1, 4096).unwrap();
        device.flush().unwrap();
        write(&device, 0, 2, 4096).unwrap();
        write(&device, 8192, 3, 4096).unwrap();
        device.crash(CrashMode::DropUnflushed);
        assert!(device.is_crashed());
        let error = write(&device, 0, 4, 1).unwrap_err().to_string();
        assert!(error.contains("crashed"), "{error}");
        assert!(device.flush().is_err());
        device.restart();
        assert_eq!(read(&device, 0, 4096), vec![1u8; 4096]);
        assert_eq!(read(&device, 8192, 4096), vec![0u8; 4096]);
        assert_eq!(device.stats().crashes, 1);
        assert_eq!(device.stats().refused, 2);
    }

    #[test]
    fn keep_all_and_prefix_keep_requests_in_order() {
        let device = CrashDevice::new(1 << 20, 3);
        for value in 1..=10u8 {
            write(&device, 0, value, 512).unwrap();
        }
        device.crash(CrashMode::KeepAll);
        assert_eq!(device.durable_image()[..512], [10u8; 512]);
        for seed in 0..20 {
            let device = CrashDevice::new(1 << 16, seed);
            for value in 1..=10u8 {
                write(&device, value as u64 * 512, value, 512).unwrap();
            }
            device.crash(CrashMode::KeepPrefix);
            let image = device.durable_image();
            let kept: Vec<bool> = (1..=10u64)
                .map(|v| image[(v * 512) as usize] == v as u8)
                .collect();
            let boundary = kept.iter().take_while(|k| **k).count();
            assert!(kept[boundary..].iter().all(|k| !k), "a prefix: {kept:?}");
        }
    }

    #[test]
    fn subset_and_torn_crashes_are_seeded_and_never_invent_data() {
        let outcome = |seed, mode| {
            let device = CrashDevice::new(1 << 16, seed);
            write(&device, 0, 0xEE, 4096).unwrap();
            device.flush().unwrap();
            for value in 1..=8u8 {
                write(&device, value as u64 * 4096, value, 4096).unwrap();
            }
            write(&device, 0, 0x77, 4096).unwrap();
            device.discard(4096, 4096).unwrap();
            device.crash(mode);
            device.durable_image()
        };
        for mode in [CrashMode::KeepSubset, CrashMode::TornSectors] {
            let first = outcome(11, mode);
            assert_eq!(first, outcome(11, mode), "same seed, same crash");
            let differs = (12..30).any(|seed| outcome(seed, mode) != first);
            assert!(differs, "{mode:?} depends on the seed");
            for seed in 0..30 {
                let image = outcome(seed, mode);
                for sector in image.chunks(512).take(9 * 8) {
                    let value = sector[0];
                    assert!(
                        sector.iter().all(|&b| b == value),
                        "a sector is never mixed"
                    );
                }
                for (index, page) in image.chunks(4096).enumerate().take(9) {
                    for &byte in page.iter().step_by(512) {
                        let allowed: &[u8] = match index {
                            0 => &[0xEE, 0x77],
                            1 => &[0, 1],
                            other => &[0, other as u8],
                        };
                        assert!(allowed.contains(&byte), "page {index} byte {byte}");
                    }
                }
            }
        }
    }

    #[test]
    fn an_armed_crash_fires_before_the_nth_request() {
        let device = CrashDevice::new(1 << 16, 1);
        device.crash_after_requests(2, CrashMode::DropUnflushed);
        write(&device, 0, 1, 512).unwrap();
        device.flush().unwrap();
        assert!(
            write(&device, 512, 2, 512).is_err(),
            "third request refused"
        );
        assert!(device.is_crashed());
        assert_eq!(
            device.durable_image()[..1024],
            [[1u8; 512], [0u8; 512]].concat()[..]
        );
    }

    #[test]
    fn zeroing_is_journaled_like_writes() {
        let device = CrashDevice::new(1 << 16, 1);
        write(&device, 0, 5, 8192).unwrap();
        device.flush().unwrap();
        device.write_zeroes(0, 8192).unwrap();
        assert_eq!(read(&device, 0, 8192), vec![0u8; 8192]);
        device.crash(CrashMode::DropUnflushed);
        device.restart();
        assert_eq!(read(&device, 0, 8192), vec![5u8; 8192]);
    }
}
