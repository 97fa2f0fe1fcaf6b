//! A global page replacement behind the buffer cache (seed 003): FreeBSD's VM page cache
//! and its one activity order over file pages and process pages.
//!
//! In FreeBSD a buffer's data lives in VM pages. When a buffer is released its pages are
//! unwired and put on the page queues, where they stay — a VM page cache behind the buffer
//! cache — until the page daemon reclaims them; the daemon reclaims by activity, whichever
//! object a page belongs to (a file or a process). The engine has one memory limit and
//! forgets an evicted buffer's data, so this module keeps what FreeBSD kept:
//!
//! - [`VmPages`]: the file pages resident in memory (in a buffer or cached behind it), each
//!   with its place in the activity order (a key: the earlier, the sooner reclaimed);
//! - [`VmDevice`]: the device the engine's objects use when the page cache is modelled: a
//!   read of pages resident in the page cache is served from the disk's contents
//!   ([`SimDevice::peek`]) without disk time, its pages' rewiring charged as CPU; the rest
//!   goes to the disk. Every page read or written becomes resident.
//!
//! The keys follow FreeBSD 5.0-current's (2002, the thread's kernel) `vm_pageout.c` and
//! `vm_page.c`:
//!
//! - a page's activity count starts at `ACT_INIT` (5), gains `ACT_ADVANCE` + 1 (4) in every
//!   scan that finds it referenced (up to `ACT_MAX`, 64) and loses `ACT_DECLINE` (1) in every
//!   scan that does not; at 0 it is deactivated, and the inactive queue is reclaimed in the
//!   order pages entered it. With every page declining at the same rate, a page's place in
//!   the reclaim order is the time its count reaches 0: its last reference plus its count
//!   times the scan interval (the key).
//! - the scan interval is the page daemon's half-second between passes under pressure
//!   (`tsleep(..., hz/2)` in `vm_pageout()`).
//! - a buffer's pages, released: 4.x's `vfs_vmio_release` unwires them onto the inactive
//!   queue's tail (`vm_page_unwire(m, 0)`: "keep page LRU ordering consistent"), so a
//!   released file page's key is the time of its release, approximated by its last
//!   reference (**assumed**: the engine does not say when it evicts a buffer). Tanimura's
//!   patch passes every unwired buffer page to `vm_page_dontneed`, which by a rolling
//!   counter leaves 1 page in 32 alone, puts 3 in 32 at the inactive queue's tail and 28 in
//!   32 at its head (reclaimed first).

use std::collections::{BTreeSet, HashMap};
use std::io::{self, IoSlice, IoSliceMut};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::core::{SimCore, SimDevice};

/// A page's initial activity count (`ACT_INIT`, vm_page.h).
pub const ACT_INIT: u64 = 5;
/// What a scan that finds a page referenced adds (`ACT_ADVANCE`, vm_page.h), plus the one
/// reference `pmap_ts_referenced` counts (`m->act_count += ACT_ADVANCE + actcount`).
pub const ACT_ADVANCE: u64 = 3;
/// What a scan that finds a page unreferenced takes (`ACT_DECLINE`, vm_page.h).
pub const ACT_DECLINE: u64 = 1;
/// The activity count's ceiling (`ACT_MAX`, vm_page.h).
pub const ACT_MAX: u64 = 64;
/// The page daemon's interval between passes under pressure: `hz/2` (vm_pageout.c).
pub const SCAN_NS: u64 = 500_000_000;
/// The VM page (i386).
pub const PAGE_BYTES: u64 = 4096;

/// Where a page stands in the reclaim order: lower is reclaimed sooner. `(0, _)`: at the
/// inactive queue's head (by `vm_page_dontneed`), the latest first; `(1, ns)`: reclaimed when
/// its activity count reaches 0, at `ns`.
pub type ReclaimKey = (u8, u64);

/// An activity count as of a scan, declining lazily.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Activity {
    /// The count after the last scan that found the page referenced.
    pub count: u64,
    /// That scan's index (`time / SCAN_NS`).
    pub scan: u64,
    /// The last reference, ns.
    pub last_ns: u64,
}

impl Activity {
    /// A page first referenced at `now_ns`.
    pub fn new(now_ns: u64) -> Activity {
        Activity {
            count: ACT_INIT,
            scan: now_ns / SCAN_NS,
            last_ns: now_ns,
        }
    }

    /// References from `start_ns` to `end_ns` (a process running): every scan in between
    /// finds the page referenced; the scans since the last reference found it idle.
    pub fn reference(&mut self, start_ns: u64, end_ns: u64) {
        let first = start_ns / SCAN_NS;
        let last = end_ns.max(start_ns) / SCAN_NS;
        let idle = first.saturating_sub(self.scan + 1);
        let mut count = self.count.saturating_sub(idle * ACT_DECLINE);
        let from = first.max(self.scan + 1);
        if last >= from {
            count += (last - from + 1) * (ACT_ADVANCE + 1);
        }
        self.count = count.min(ACT_MAX);
        self.scan = self.scan.max(last);
        self.last_ns = self.last_ns.max(end_ns);
    }

    /// When the count reaches 0 with no further reference: the page's reclaim key.
    pub fn key(&self) -> ReclaimKey {
        (1, self.scan * SCAN_NS + self.count * SCAN_NS / ACT_DECLINE)
    }
}

/// How released buffer pages enter the page queues.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Release {
    /// 4.x: onto the inactive queue's tail (`vfs_vmio_release`).
    InactiveTail,
    /// Tanimura's patch: through `vm_page_dontneed`.
    DontNeed,
}

struct VmState {
    release: Release,
    /// Resident file pages (page index on the device) and their keys.
    keys: HashMap<u64, ReclaimKey>,
    /// The same, in reclaim order.
    order: BTreeSet<(ReclaimKey, u64)>,
    /// `vm_page_dontneed`'s rolling counter (`dnweight`).
    dontneed_calls: u64,
    /// Pages served from the page cache, not yet reported to the scheduler's wiring account.
    served_pages: u64,
    report: PageCacheReport,
}

/// What the page cache saw over a run.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct PageCacheReport {
    /// Device reads served entirely or partly from resident pages.
    pub hits: u64,
    /// Bytes served from resident pages (no disk time).
    pub hit_bytes: u64,
    /// Bytes the engine read that had to come from the disk.
    pub miss_bytes: u64,
    /// File pages the page daemon reclaimed.
    pub reclaimed_pages: u64,
    /// Most file pages resident at once.
    pub resident_pages_max: u64,
}

/// The resident file pages and their reclaim order, shared by the scheduler (references,
/// the page daemon) and [`VmDevice`] (hits, fills).
pub struct VmPages {
    state: Mutex<VmState>,
}

impl VmPages {
    /// An empty page cache whose released pages enter the queues as `release` says.
    pub fn new(release: Release) -> Arc<VmPages> {
        Arc::new(VmPages {
            state: Mutex::new(VmState {
                release,
                keys: HashMap::new(),
                order: BTreeSet::new(),
                dontneed_calls: 0,
                served_pages: 0,
                report: PageCacheReport::default(),
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, VmState> {
        self.state
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    /// Device pages covering bytes `[offset, offset + length)`.
    fn pages(offset: u64, length: u64) -> std::ops::Range<u64> {
        offset / PAGE_BYTES..(offset + length).div_ceil(PAGE_BYTES)
    }

    /// The pages of `[offset, offset + length)` were used at `now_ns` (read or written
    /// through a buffer) and released: each is resident, its key where its release puts it.
    pub fn reference(&self, offset: u64, length: u64, now_ns: u64) {
        let mut state = self.lock();
        for page in Self::pages(offset, length) {
            let key = match state.release {
                Release::InactiveTail => (1, now_ns),
                Release::DontNeed => {
                    state.dontneed_calls += 1;
                    let dnw = state.dontneed_calls;
                    if dnw & 0x01F0 == 0 {
                        // Left alone: active, with a fresh page's count.
                        Activity::new(now_ns).key()
                    } else if dnw & 0x0070 == 0 {
                        (1, now_ns)
                    } else {
                        (0, u64::MAX - now_ns)
                    }
                }
            };
            if let Some(old) = state.keys.insert(page, key) {
                state.order.remove(&(old, page));
            }
            state.order.insert((key, page));
        }
        let resident = state.keys.len() as u64;
        state.report.resident_pages_max = state.report.resident_pages_max.max(resident);
    }

    /// True when every page of `[offset, offset + length)` is resident.
    fn resident(state: &VmState, offset: u64, length: u64) -> bool {
        Self::pages(offset, length).all(|page| state.keys.contains_key(&page))
    }

    /// Resident file pages.
    pub fn resident_pages(&self) -> u64 {
        self.lock().keys.len() as u64
    }

    /// The reclaim key of the least active resident page, if any.
    pub fn first_key(&self) -> Option<ReclaimKey> {
        self.lock().order.first().map(|&(key, _)| key)
    }

    /// Reclaims up to `pages` file pages in reclaim order, stopping at the first whose key
    /// is not below `below` (when given). Returns the pages reclaimed.
    pub fn reclaim(&self, pages: u64, below: Option<ReclaimKey>) -> u64 {
        let mut state = self.lock();
        let mut reclaimed = 0;
        while reclaimed < pages {
            let Some(&(key, page)) = state.order.first() else {
                break;
            };
            if below.is_some_and(|limit| key >= limit) {
                break;
            }
            state.order.pop_first();
            state.keys.remove(&page);
            reclaimed += 1;
        }
        state.report.reclaimed_pages += reclaimed;
        reclaimed
    }

    /// Pages served from the page cache since the last call (their wiring is charged
    /// already).
    pub fn take_served_pages(&self) -> u64 {
        std::mem::take(&mut self.lock().served_pages)
    }

    /// The counters so far.
    pub fn report(&self) -> PageCacheReport {
        self.lock().report.clone()
    }
}

/// The device the engine's objects read through when the page cache is modelled: resident
/// pages come from memory, the rest from the disk ([`VmPages`]).
pub struct VmDevice {
    inner: Arc<SimDevice>,
    core: Arc<SimCore>,
    vm: Arc<VmPages>,
    wire_page_ns: u64,
}

impl VmDevice {
    /// `inner` behind the page cache `vm`; a page served from memory costs `wire_page_ns`
    /// of system time (rewiring it into a buffer).
    pub fn new(
        inner: Arc<SimDevice>,
        core: Arc<SimCore>,
        vm: Arc<VmPages>,
        wire_page_ns: u64,
    ) -> VmDevice {
        VmDevice {
            inner,
            core,
            vm,
            wire_page_ns,
        }
    }
}

impl bufcache::Device for VmDevice {
    /// Splits the read into runs of whole pages resident or not: a resident run is copied
    /// from the disk's contents with no disk time (only the pages' rewiring, system time),
    /// a missing run is one disk read. Every page read becomes resident.
    fn read_vectored_at(&self, buffers: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<()> {
        let length = bufcache::device::total_length(buffers.iter().map(|b| b.len()));
        bufcache::device::check_range(self.inner.len_bytes(), offset, length)?;
        if length == 0 {
            return Ok(());
        }
        // Runs: (start, end, resident), in bytes relative to `offset`.
        let mut runs: Vec<(u64, u64, bool)> = Vec::new();
        {
            let state = self.vm.lock();
            let mut at = 0;
            while at < length {
                let page_end = ((offset + at) / PAGE_BYTES + 1) * PAGE_BYTES - offset;
                let end = page_end.min(length);
                let resident = VmPages::resident(&state, offset + at, end - at);
                match runs.last_mut() {
                    Some(run) if run.2 == resident => run.1 = end,
                    _ => runs.push((at, end, resident)),
                }
                at = end;
            }
        }
        if runs.len() == 1 && !runs[0].2 {
            self.inner.read_vectored_at(buffers, offset)?;
        } else {
            let mut data = vec![0u8; length as usize];
            for &(start, end, resident) in &runs {
                let slice = &mut data[start as usize..end as usize];
                if resident {
                    self.inner.peek(slice, offset + start);
                } else {
                    self.inner
                        .read_vectored_at(&mut [IoSliceMut::new(slice)], offset + start)?;
                }
            }
            let mut at = 0usize;
            for buffer in buffers.iter_mut() {
                let n = buffer.len();
                buffer.copy_from_slice(&data[at..at + n]);
                at += n;
            }
        }
        let hit_bytes: u64 = runs.iter().filter(|r| r.2).map(|r| r.1 - r.0).sum();
        let hit_pages = runs
            .iter()
            .filter(|r| r.2)
            .map(|r| VmPages::pages(offset + r.0, r.1 - r.0).count() as u64)
            .sum::<u64>();
        if hit_pages > 0 {
            self.core.cpu(0, hit_pages * self.wire_page_ns);
        }
        {
            let mut state = self.vm.lock();
            state.served_pages += hit_pages;
            if hit_bytes > 0 {
                state.report.hits += 1;
            }
            state.report.hit_bytes += hit_bytes;
            state.report.miss_bytes += length - hit_bytes;
        }
        self.vm.reference(offset, length, self.core.cursor());
        Ok(())
    }

    fn write_vectored_at(&self, buffers: &[IoSlice<'_>], offset: u64) -> io::Result<()> {
        self.inner.write_vectored_at(buffers, offset)
    }

    fn submit_reads(&self, reads: Vec<bufcache::device::ReadRequest>) {
        bufcache::device::read_each_now(self, reads)
    }

    fn submit_writes(&self, writes: Vec<bufcache::device::WriteRequest>) {
        self.inner.submit_writes(writes)
    }

    fn flush(&self) -> io::Result<()> {
        self.inner.flush()
    }

    fn discard(&self, offset: u64, length: u64) -> io::Result<()> {
        self.inner.discard(offset, length)
    }

    fn write_zeroes(&self, offset: u64, length: u64) -> io::Result<()> {
        self.inner.write_zeroes(offset, length)
    }

    fn extents(&self, offset: u64, length: u64) -> io::Result<Vec<bufcache::Extent>> {
        self.inner.extents(offset, length)
    }

    fn capabilities(&self) -> bufcache::Capabilities {
        self.inner.capabilities()
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_idle_page_is_reclaimed_when_its_count_has_declined_to_zero() {
        // Goal: the key is the time the activity count reaches 0. Method: a page referenced
        // once at 0 keeps ACT_INIT; one referenced over three scans gains 4 per scan.
        let once = Activity::new(0);
        assert_eq!(once.key(), (1, ACT_INIT * SCAN_NS));
        let mut busy = Activity::new(0);
        busy.reference(SCAN_NS, 3 * SCAN_NS + 1);
        assert_eq!(busy.count, ACT_INIT + 3 * (ACT_ADVANCE + 1));
        assert_eq!(busy.key(), (1, 3 * SCAN_NS + busy.count * SCAN_NS));
        // Idle for 100 scans, then referenced once: the count had declined to 0.
        busy.reference(103 * SCAN_NS, 103 * SCAN_NS);
        assert_eq!(busy.count, ACT_ADVANCE + 1);
    }

    #[test]
    fn the_page_daemon_reclaims_file_pages_below_a_threshold_first_and_oldest_first() {
        // Goal: reclaim follows the activity order and stops at the least active process's
        // key. Method: release pages at 1, 2, 3 and 4 s on the inactive tail; reclaim with the
        // threshold at 2.5 s, then without one.
        let vm = VmPages::new(Release::InactiveTail);
        for second in 1..=4u64 {
            vm.reference(second * PAGE_BYTES, PAGE_BYTES, second * 1_000_000_000);
        }
        assert_eq!(vm.reclaim(10, Some((1, 2_500_000_000))), 2);
        assert_eq!(vm.first_key(), Some((1, 3_000_000_000)));
        assert_eq!(vm.reclaim(1, None), 1);
        assert_eq!(vm.resident_pages(), 1);
        assert_eq!(vm.report().reclaimed_pages, 3);
    }

    #[test]
    fn dontneed_puts_28_of_32_released_pages_at_the_inactive_head() {
        // Goal: Tanimura's patch passes released pages through vm_page_dontneed's rolling
        // counter. Method: release 512 pages one at a time and count where they went.
        let vm = VmPages::new(Release::DontNeed);
        for page in 0..512 {
            vm.reference(page * PAGE_BYTES, PAGE_BYTES, 1_000);
        }
        let state = vm.lock();
        let head = state.keys.values().filter(|k| k.0 == 0).count();
        let tail = state.keys.values().filter(|&&k| k == (1, 1_000)).count();
        let alone = 512 - head - tail;
        assert_eq!((head, tail, alone), (448, 48, 16));
    }
}
