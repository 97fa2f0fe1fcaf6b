//! Page-aligned, zero-initialised heap memory for buffer data.
//!
//! Every buffer's bytes live in one `AlignedBytes`, aligned to the cache's page size, so that
//! the same memory can be handed to an O_DIRECT device without a bounce copy. The allocation
//! is zeroed so no stale heap contents can ever reach a reader.

use std::alloc::{self, Layout};
use std::ptr::NonNull;

/// An owned, aligned, fixed-length byte array.
pub struct AlignedBytes {
    pointer: NonNull<u8>,
    layout: Layout,
}

// SAFETY: AlignedBytes owns its allocation exclusively, like a Box<[u8]>.
unsafe impl Send for AlignedBytes {}
// SAFETY: shared access only hands out &[u8].
unsafe impl Sync for AlignedBytes {}

impl AlignedBytes {
    /// Allocates `length` zero bytes aligned to `alignment` (a power of two).
    ///
    /// # Panics
    /// When `length` is zero or the layout is invalid: both are programming errors, since
    /// buffer sizes are validated by the configuration.
    pub fn zeroed(length: usize, alignment: usize) -> Self {
        assert!(length > 0, "zero-length buffer");
        let layout = Layout::from_size_align(length, alignment).expect("valid buffer layout");
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let pointer = NonNull::new(raw).unwrap_or_else(|| alloc::handle_alloc_error(layout));
        AlignedBytes { pointer, layout }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.layout.size()
    }

    /// Always false: zero-length buffers are never made.
    pub fn is_empty(&self) -> bool {
        false
    }
}

impl std::ops::Deref for AlignedBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the allocation is live, initialised and `len` bytes long.
        unsafe { std::slice::from_raw_parts(self.pointer.as_ptr(), self.layout.size()) }
    }
}

impl std::ops::DerefMut for AlignedBytes {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.pointer.as_ptr(), self.layout.size()) }
    }
}

impl Drop for AlignedBytes {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this same layout.
        unsafe { alloc::dealloc(self.pointer.as_ptr(), self.layout) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocation_is_aligned_and_zeroed() {
        let bytes = AlignedBytes::zeroed(8192, 4096);
        assert_eq!(bytes.as_ptr() as usize % 4096, 0);
        assert!(bytes.iter().all(|&byte| byte == 0));
        assert_eq!(bytes.len(), 8192);
    }
}

/// Page-aligned slots for buffer data, carved from large chunks and recycled by size.
///
/// One aligned heap allocation per buffer costs the C allocator about as much again in
/// padding and fragmentation (measured: resident memory 2–2.6 × the cache). The pool instead
/// takes memory in 2 MiB chunks and hands out slots of one size each, so resident memory
/// follows the cache's own charge. Freed slots are kept for reuse (zeroed when handed out
/// again, unless the taker overwrites them at once: [`BufferPool::allocate_unzeroed`]); [`BufferPool::trim`] gives their pages back to the system, which the cache does
/// when its limit shrinks or many slots sit unused.
///
/// Invariants: a slot is either handed out (owned by one `PooledBytes`) or on its class's free
/// list, never both; chunks live until the pool is dropped, which happens only after every
/// `PooledBytes` (each holds the pool) is gone.
pub struct BufferPool {
    alignment: usize,
    /// Ask the kernel for transparent huge pages for new chunks (`MADV_HUGEPAGE`).
    huge_pages: bool,
    classes: crate::sync::SleepingMutex<Vec<SizeClass>>,
}

/// Bytes taken from the system at a time for one slot size.
pub const POOL_CHUNK_BYTES: usize = 2 << 20;

/// Chunks start on this boundary (the x86-64 and arm64 transparent huge page size), so a
/// system whose policy gives anonymous memory huge pages can back a chunk with one. The pool
/// asks for them (`MADV_HUGEPAGE`) only when told to ([`BufferPool::with_huge_pages`]):
/// they make a cache's first fill cheaper (one fault per 2 MiB), but measured in a VM a huge
/// page often came from never-touched memory and cost up to 3 × the CPU of a cold copy to
/// clear, and compaction stalls are why database engines advise against them.
const HUGE_PAGE_BYTES: usize = 2 << 20;

/// Anonymous memory mapped for one chunk: zero-filled by the kernel, so fresh slots need no
/// clearing (and cost nothing until touched).
struct Mapping {
    base: NonNull<u8>,
    length: usize,
}

impl Mapping {
    /// Maps `length` bytes plus room to start the usable part on a `boundary` (a power of
    /// two); returns the mapping and the first byte at that boundary. The slack before and
    /// after is never touched, so it costs address space only.
    fn new(length: usize, boundary: usize, huge_pages: bool) -> (Mapping, NonNull<u8>) {
        let mapped_length = length + boundary;
        // SAFETY: a fresh private anonymous mapping; no existing memory is affected.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped_length,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            let layout = Layout::from_size_align(length, boundary).expect("valid chunk layout");
            alloc::handle_alloc_error(layout);
        }
        let base = NonNull::new(raw as *mut u8).expect("mmap never maps address zero");
        let skip = (boundary - base.as_ptr() as usize % boundary) % boundary;
        // SAFETY: `skip` < `boundary`, so `skip + length` lies within the mapping.
        let start = unsafe { NonNull::new_unchecked(base.as_ptr().add(skip)) };
        #[cfg(target_os = "linux")]
        if huge_pages {
            // SAFETY: the range lies within our mapping; the advice changes no contents.
            // Failure (huge pages unavailable) only means small pages, so it is ignored.
            unsafe {
                libc::madvise(
                    start.as_ptr() as *mut libc::c_void,
                    length,
                    libc::MADV_HUGEPAGE,
                );
            }
        }
        #[cfg(target_os = "linux")]
        // SAFETY: as above. Faulting the whole chunk in with one call, rather than one page
        // fault per 4 KiB as buffers are first written, took the per-fault trap and
        // accounting cost off a cold fill's data path (the chunk is carved into buffers that
        // are about to be used; the kernel still zeroes it). Kernels before 5.14 refuse the
        // advice, and then pages fault in on first touch as before.
        unsafe {
            libc::madvise(
                start.as_ptr() as *mut libc::c_void,
                length,
                libc::MADV_POPULATE_WRITE,
            );
        }
        #[cfg(not(target_os = "linux"))]
        let _ = huge_pages;
        (
            Mapping {
                base,
                length: mapped_length,
            },
            start,
        )
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: mapped in `new` with this length; no slot of it is handed out any more.
        unsafe { libc::munmap(self.base.as_ptr() as *mut libc::c_void, self.length) };
    }
}

struct FreeSlot {
    pointer: NonNull<u8>,
    /// The slot still holds an earlier buffer's bytes (not yet zeroed or trimmed).
    dirty: bool,
}

struct SizeClass {
    slot_bytes: usize,
    free: Vec<FreeSlot>,
    /// Uncarved remainder of the newest chunk: (next slot, slots left).
    fresh: Option<(NonNull<u8>, usize)>,
    chunks: Vec<Mapping>,
}

// SAFETY: the raw pointers are owned allocations guarded by the pool's mutex.
unsafe impl Send for SizeClass {}

impl BufferPool {
    /// A pool whose slots are aligned to `alignment` (a power of two, the page size).
    pub fn new(alignment: usize) -> std::sync::Arc<Self> {
        Self::with_huge_pages(alignment, false)
    }

    /// As [`BufferPool::new`], asking the kernel for transparent huge pages for its chunks
    /// when `huge_pages` is set (see `HUGE_PAGE_BYTES` for the trade-off).
    pub fn with_huge_pages(alignment: usize, huge_pages: bool) -> std::sync::Arc<Self> {
        std::sync::Arc::new(BufferPool {
            alignment,
            huge_pages,
            classes: crate::sync::SleepingMutex::new(Vec::new()),
        })
    }

    /// A zeroed slot of at least `length` bytes (a multiple of the alignment).
    pub fn allocate(self: &std::sync::Arc<Self>, length: usize) -> PooledBytes {
        self.allocate_with(length, true)
    }

    /// A slot of at least `length` bytes that may still hold an earlier buffer's bytes (every
    /// byte is initialised, just not necessarily zero): for a caller that overwrites all of
    /// it before anyone reads it — a buffer about to be filled by a device read or a whole
    /// write — so the pool does not zero what is overwritten at once.
    pub fn allocate_unzeroed(self: &std::sync::Arc<Self>, length: usize) -> PooledBytes {
        self.allocate_with(length, false)
    }

    fn allocate_with(self: &std::sync::Arc<Self>, length: usize, zeroed: bool) -> PooledBytes {
        assert!(length > 0, "zero-length buffer");
        let slot_bytes = length.next_multiple_of(self.alignment);
        let (pointer, dirty) = {
            let mut classes = self.classes.lock();
            let class = match classes
                .iter()
                .position(|class| class.slot_bytes == slot_bytes)
            {
                Some(index) => &mut classes[index],
                None => {
                    classes.push(SizeClass {
                        slot_bytes,
                        free: Vec::new(),
                        fresh: None,
                        chunks: Vec::new(),
                    });
                    classes.last_mut().expect("just pushed")
                }
            };
            class.take(self.alignment, self.huge_pages)
        };
        if dirty && zeroed {
            // SAFETY: the slot is ours now and `slot_bytes` long.
            unsafe { std::ptr::write_bytes(pointer.as_ptr(), 0, slot_bytes) };
        }
        PooledBytes {
            pointer,
            length,
            slot_bytes,
            pool: std::sync::Arc::clone(self),
        }
    }

    fn release(&self, pointer: NonNull<u8>, slot_bytes: usize) {
        let mut classes = self.classes.lock();
        let class = classes
            .iter_mut()
            .find(|class| class.slot_bytes == slot_bytes)
            .expect("a slot returns to the class it came from");
        class.free.push(FreeSlot {
            pointer,
            dirty: true,
        });
    }

    /// Bytes in slots that are free and still resident.
    pub fn idle_resident_bytes(&self) -> u64 {
        let classes = self.classes.lock();
        classes
            .iter()
            .map(|class| {
                class.free.iter().filter(|slot| slot.dirty).count() as u64 * class.slot_bytes as u64
            })
            .sum()
    }

    /// Gives the pages of every free slot back to the system (they read as zero afterwards,
    /// so reuse needs no clearing). Returns the bytes released.
    pub fn trim(&self) -> u64 {
        let mut classes = self.classes.lock();
        let mut released = 0u64;
        for class in classes.iter_mut() {
            for slot in class.free.iter_mut().filter(|slot| slot.dirty) {
                // SAFETY: the slot is free, page aligned and `slot_bytes` long; its contents
                // are not needed. MADV_DONTNEED on private anonymous memory zero-fills.
                let result = unsafe {
                    libc::madvise(
                        slot.pointer.as_ptr() as *mut libc::c_void,
                        class.slot_bytes,
                        libc::MADV_DONTNEED,
                    )
                };
                if result == 0 {
                    slot.dirty = false;
                    released += class.slot_bytes as u64;
                }
            }
        }
        released
    }
}

impl SizeClass {
    fn take(&mut self, alignment: usize, huge_pages: bool) -> (NonNull<u8>, bool) {
        if let Some(slot) = self.free.pop() {
            return (slot.pointer, slot.dirty);
        }
        if let Some((next, left)) = self.fresh.filter(|&(_, left)| left > 0) {
            // SAFETY: `next` lies inside the newest chunk with `left` slots after it.
            let following = unsafe { NonNull::new_unchecked(next.as_ptr().add(self.slot_bytes)) };
            self.fresh = Some((following, left - 1));
            return (next, false);
        }
        let chunk_bytes = POOL_CHUNK_BYTES
            .max(self.slot_bytes)
            .next_multiple_of(self.slot_bytes);
        let (mapping, base) = Mapping::new(chunk_bytes, alignment.max(HUGE_PAGE_BYTES), huge_pages);
        self.chunks.push(mapping);
        let slots = chunk_bytes / self.slot_bytes;
        // SAFETY: the chunk holds `slots` slots.
        let following = unsafe { NonNull::new_unchecked(base.as_ptr().add(self.slot_bytes)) };
        self.fresh = Some((following, slots - 1));
        (base, false)
    }
}

// Dropping the pool drops its chunks' mappings (`Mapping::drop`); no slot is handed out by
// then, since each `PooledBytes` holds the pool alive.

/// A slot handed out by a [`BufferPool`]; returns to the pool when dropped.
pub struct PooledBytes {
    pointer: NonNull<u8>,
    length: usize,
    slot_bytes: usize,
    pool: std::sync::Arc<BufferPool>,
}

// SAFETY: PooledBytes owns its slot exclusively, like a Box<[u8]>.
unsafe impl Send for PooledBytes {}
// SAFETY: shared access only hands out &[u8].
unsafe impl Sync for PooledBytes {}

impl PooledBytes {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.length
    }

    /// Always false: zero-length slots are never made.
    pub fn is_empty(&self) -> bool {
        false
    }
}

impl std::ops::Deref for PooledBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the slot is live, initialised and at least `length` bytes long.
        unsafe { std::slice::from_raw_parts(self.pointer.as_ptr(), self.length) }
    }
}

impl std::ops::DerefMut for PooledBytes {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.pointer.as_ptr(), self.length) }
    }
}

impl Drop for PooledBytes {
    fn drop(&mut self) {
        self.pool.release(self.pointer, self.slot_bytes);
    }
}

#[cfg(test)]
mod pool_tests {
    use super::*;

    #[test]
    fn slots_are_aligned_zeroed_and_recycled_zeroed() {
        let pool = BufferPool::new(4096);
        let mut first = pool.allocate(4096);
        assert_eq!(first.as_ptr() as usize % 4096, 0);
        assert!(first.iter().all(|&byte| byte == 0));
        first.fill(0xAB);
        let address = first.as_ptr() as usize;
        drop(first);
        let again = pool.allocate(4096);
        assert_eq!(again.as_ptr() as usize, address, "a freed slot is reused");
        assert!(
            again.iter().all(|&byte| byte == 0),
            "a reused slot is zeroed"
        );
    }

    #[test]
    fn chunks_start_on_huge_page_boundaries_with_or_without_huge_pages() {
        // Goal: both pool kinds hand out zeroed, page-aligned slots, and every chunk starts on
        // a 2 MiB boundary (so the kernel can back it with a huge page). Method: take 1,100
        // slots of 4 KiB (three chunks) from each kind; the first slot of each chunk is the
        // one at a 512-slot step.
        for huge_pages in [false, true] {
            let pool = BufferPool::with_huge_pages(4096, huge_pages);
            let slots: Vec<PooledBytes> = (0..1100).map(|_| pool.allocate(4096)).collect();
            for (index, slot) in slots.iter().enumerate() {
                assert_eq!(
                    slot.as_ptr() as usize % 4096,
                    0,
                    "slot {index} page-aligned"
                );
                assert!(slot.iter().all(|&byte| byte == 0), "slot {index} zeroed");
                if index % (POOL_CHUNK_BYTES / 4096) == 0 {
                    assert_eq!(
                        slot.as_ptr() as usize % HUGE_PAGE_BYTES,
                        0,
                        "chunk of slot {index} on a 2 MiB boundary (huge_pages {huge_pages})"
                    );
                }
            }
        }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_new_chunk_is_resident_before_its_slots_are_touched() {
        // Goal: a cold fill pays no page fault per 4 KiB buffer; the pool faults a new chunk
        // in whole. Method: take one slot, touch nothing, and ask mincore(2) whether every
        // page of the 2 MiB chunk is resident. Kernels before 5.14 cannot populate; there the
        // property does not hold and the test says so instead of failing.
        let pool = BufferPool::new(4096);
        let first = pool.allocate_unzeroed(4096);
        let pages = POOL_CHUNK_BYTES / 4096;
        let mut resident = vec![0u8; pages];
        // SAFETY: the chunk starts at the first slot (2 MiB aligned) and is mapped whole;
        // mincore only reports on it.
        let result = unsafe {
            libc::mincore(
                first.as_ptr() as *mut libc::c_void,
                POOL_CHUNK_BYTES,
                resident.as_mut_ptr(),
            )
        };
        assert_eq!(result, 0, "mincore: {}", std::io::Error::last_os_error());
        let resident_pages = resident.iter().filter(|&&page| page & 1 == 1).count();
        if !kernel_populates() {
            eprintln!("kernel older than 5.14: chunks fault in page by page");
            return;
        }
        assert_eq!(
            resident_pages, pages,
            "every page of a new chunk is resident"
        );
    }

    #[cfg(target_os = "linux")]
    fn kernel_populates() -> bool {
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let mut numbers = release
            .split(|c: char| !c.is_ascii_digit())
            .filter_map(|part| part.parse::<u32>().ok());
        let version = (numbers.next().unwrap_or(0), numbers.next().unwrap_or(0));
        version >= (5, 14)
    }

    #[test]
    fn trimmed_slots_read_as_zero_and_sizes_do_not_mix() {
        let pool = BufferPool::new(4096);
        let slots: Vec<PooledBytes> = (0..600)
            .map(|index| {
                let mut slot = pool.allocate(if index % 2 == 0 { 4096 } else { 8192 });
                slot.fill(index as u8);
                slot
            })
            .collect();
        let distinct: std::collections::HashSet<usize> =
            slots.iter().map(|s| s.as_ptr() as usize).collect();
        assert_eq!(distinct.len(), 600, "no slot is handed out twice");
        drop(slots);
        assert_eq!(pool.idle_resident_bytes(), 300 * 4096 + 300 * 8192);
        assert_eq!(pool.trim(), 300 * 4096 + 300 * 8192);
        assert_eq!(pool.idle_resident_bytes(), 0);
        let reused = pool.allocate(8192);
        assert!(reused.iter().all(|&byte| byte == 0));
    }
}
