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
/// A first fill pays for fresh memory: the kernel zeroes and charges every page as a chunk is
/// faulted in, which was a fifth to a half of a cold copy's server CPU. A server can take that
/// off the data path by faulting chunks in before it serves ([`BufferPool::prefault_chunk`]):
/// they wait as spares, and a size class takes a spare before mapping a chunk of its own.
///
/// Invariants: a slot is either handed out (owned by one `PooledBytes`) or on its class's free
/// list, never both; a spare chunk belongs to no class; chunks live until the pool is dropped
/// (spares until [`BufferPool::release_spares`]), which happens only after every `PooledBytes`
/// (each holds the pool) is gone.
pub struct BufferPool {
    alignment: usize,
    /// Ask the kernel for transparent huge pages for new chunks (`MADV_HUGEPAGE`).
    huge_pages: bool,
    classes: crate::sync::SleepingMutex<Vec<SizeClass>>,
    /// Chunks of `POOL_CHUNK_BYTES` faulted in ahead of need ([`BufferPool::prefault_chunk`])
    /// and not yet given to a size class. Lock order: `classes`, then `spare`.
    spare: crate::sync::SleepingMutex<Vec<Mapping>>,
    /// Usable bytes of every chunk mapped, in classes and spare: what
    /// [`BufferPool::prefault_chunk`] bounds.
    mapped_bytes: std::sync::atomic::AtomicUsize,
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

/// How a chunk's pages are faulted in when it is mapped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Populate {
    /// One `madvise(MADV_POPULATE_WRITE)` call for the chunk: the cheapest, but the kernel
    /// holds the process's address-space lock for the whole call, so a thread preempted inside
    /// it makes every `mmap` in the process wait. For the data path and for faulting in
    /// before serving, when nothing else runs.
    Advise,
    /// Touch each page from user space: a trap per page, but no lock held between pages. For
    /// a low-priority thread faulting memory in while the server runs, which may be preempted
    /// anywhere.
    Touch,
}

/// Anonymous memory mapped for one chunk: zero-filled by the kernel, so fresh slots need no
/// clearing.
struct Mapping {
    base: NonNull<u8>,
    length: usize,
    /// The first usable byte, on the boundary asked for.
    start: NonNull<u8>,
    /// Usable bytes from `start`.
    usable_bytes: usize,
}

// SAFETY: a Mapping owns its memory exclusively; only the pool, under its locks, uses it.
unsafe impl Send for Mapping {}

impl Mapping {
    /// Maps `length` bytes plus room to start the usable part on a `boundary` (a power of
    /// two), and faults the usable part in. The slack before and after is never touched, so
    /// it costs address space only.
    fn new(length: usize, boundary: usize, huge_pages: bool, populate: Populate) -> Mapping {
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
        // Faulting the whole chunk in with one call, rather than one page fault per 4 KiB as
        // buffers are first written, took the per-fault trap and accounting cost off a cold
        // fill's data path (the chunk is carved into buffers that are about to be used; the
        // kernel still zeroes it). Kernels before 5.14 refuse the advice; then, and when
        // touching was asked for, each page is touched below.
        #[cfg(target_os = "linux")]
        let populated = match populate {
            // SAFETY: as above: the range lies within our mapping.
            Populate::Advise => unsafe {
                libc::madvise(
                    start.as_ptr() as *mut libc::c_void,
                    length,
                    libc::MADV_POPULATE_WRITE,
                )
            },
            Populate::Touch => -1,
        };
        #[cfg(not(target_os = "linux"))]
        let populated = {
            let _ = populate;
            -1
        };
        if populated != 0 {
            // Touch each page, so a prefaulted chunk is resident as promised (a chunk mapped
            // on the data path is about to be touched anyway).
            for page in (0..length).step_by(4096) {
                // SAFETY: within the usable part of our fresh, writable mapping.
                unsafe { start.as_ptr().add(page).write_volatile(0) };
            }
        }
        #[cfg(not(target_os = "linux"))]
        let _ = huge_pages;
        Mapping {
            base,
            length: mapped_length,
            start,
            usable_bytes: length,
        }
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
            spare: crate::sync::SleepingMutex::new(Vec::new()),
            mapped_bytes: std::sync::atomic::AtomicUsize::new(0),
        })
    }

    /// Faults one more chunk in ahead of need, unless the pool's chunks (in use or spare)
    /// would then exceed `bytes_max`. Returns whether it did; call it until it returns false,
    /// from as many threads as you like (the chunk is counted before it is mapped, so
    /// concurrent callers never pass the bound together). `populate` says how its pages are
    /// faulted in.
    pub fn prefault_chunk(&self, bytes_max: usize, populate: Populate) -> bool {
        use std::sync::atomic::Ordering;
        let counted =
            self.mapped_bytes
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |mapped| {
                    (mapped + POOL_CHUNK_BYTES <= bytes_max).then_some(mapped + POOL_CHUNK_BYTES)
                });
        if counted.is_err() {
            return false;
        }
        let mapping = self.mapping(POOL_CHUNK_BYTES, populate);
        let mut spare = self.spare.lock();
        // Size classes may have mapped chunks of their own while this one was faulted in
        // (slowly, from a low-priority thread): past the bound, this chunk would only be
        // memory no buffer will use, so it goes back instead.
        if self.mapped_bytes.load(Ordering::Acquire) > bytes_max {
            drop(spare);
            drop(mapping);
            self.mapped_bytes
                .fetch_sub(POOL_CHUNK_BYTES, Ordering::AcqRel);
            return false;
        }
        spare.push(mapping);
        true
    }

    /// Usable bytes of every chunk mapped, in size classes and spare.
    pub fn mapped_bytes(&self) -> u64 {
        self.mapped_bytes.load(std::sync::atomic::Ordering::Acquire) as u64
    }

    /// Bytes of spare chunks faulted in ahead of need that no size class has taken yet.
    pub fn spare_bytes(&self) -> u64 {
        (self.spare.lock().len() * POOL_CHUNK_BYTES) as u64
    }

    /// Unmaps every spare chunk (for a cache whose memory limit shrank). Returns the bytes
    /// released.
    pub fn release_spares(&self) -> u64 {
        let spares = std::mem::take(&mut *self.spare.lock());
        let released = spares.len() * POOL_CHUNK_BYTES;
        self.mapped_bytes
            .fetch_sub(released, std::sync::atomic::Ordering::AcqRel);
        released as u64
    }

    /// Maps and faults in a chunk of `chunk_bytes`, not yet counted.
    fn mapping(&self, chunk_bytes: usize, populate: Populate) -> Mapping {
        Mapping::new(
            chunk_bytes,
            self.alignment.max(HUGE_PAGE_BYTES),
            self.huge_pages,
            populate,
        )
    }

    /// Maps and faults in a chunk of `chunk_bytes`, counted in `mapped_bytes`.
    fn map_chunk(&self, chunk_bytes: usize) -> Mapping {
        let mapping = self.mapping(chunk_bytes, Populate::Advise);
        self.mapped_bytes
            .fetch_add(chunk_bytes, std::sync::atomic::Ordering::AcqRel);
        mapping
    }

    /// A chunk of `chunk_bytes` for a size class: a spare if there is one of that size, else a
    /// new one. A class whose chunks are of another size (a slot size that does not divide
    /// `POOL_CHUNK_BYTES`) retires a spare instead, so prefaulting never raises the pool
    /// above what it would have mapped anyway.
    fn chunk_for_class(&self, chunk_bytes: usize) -> Mapping {
        let spare = self.spare.lock().pop();
        match spare {
            Some(mapping) if chunk_bytes == POOL_CHUNK_BYTES => mapping,
            retired => {
                if retired.is_some() {
                    self.mapped_bytes
                        .fetch_sub(POOL_CHUNK_BYTES, std::sync::atomic::Ordering::AcqRel);
                }
                drop(retired);
                self.map_chunk(chunk_bytes)
            }
        }
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
            class.take(self)
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
    fn take(&mut self, pool: &BufferPool) -> (NonNull<u8>, bool) {
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
        let mapping = pool.chunk_for_class(chunk_bytes);
        let base = mapping.start;
        debug_assert_eq!(mapping.usable_bytes, chunk_bytes);
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
        // in whole (with MADV_POPULATE_WRITE, or by touching each page on kernels before
        // 5.14). Method: take one slot, touch nothing, and ask mincore(2) whether every page
        // of the 2 MiB chunk is resident.
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
        assert_eq!(
            resident_pages, pages,
            "every page of a new chunk is resident"
        );
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

    #[test]
    fn prefaulted_chunks_are_used_before_any_new_memory_is_mapped() {
        // Goal: faulting memory in ahead of need never raises the pool above its bound, and a
        // fill takes the spares before mapping more. Method: prefault up to 3 chunks (a 4th
        // is refused), take 3 chunks' worth of 4 KiB slots, and check that the pool mapped
        // nothing new; the next slot maps a 4th chunk.
        let pool = BufferPool::new(4096);
        let bound = 3 * POOL_CHUNK_BYTES;
        let mut prefaulted = 0;
        while pool.prefault_chunk(bound, Populate::Advise) {
            prefaulted += 1;
        }
        assert_eq!(prefaulted, 3);
        assert_eq!(pool.spare_bytes(), bound as u64);
        assert_eq!(pool.mapped_bytes(), bound as u64);
        let slots: Vec<PooledBytes> = (0..bound / 4096).map(|_| pool.allocate(4096)).collect();
        assert!(slots.iter().all(|slot| slot.iter().all(|&byte| byte == 0)));
        assert_eq!(pool.spare_bytes(), 0, "every spare was taken");
        assert_eq!(pool.mapped_bytes(), bound as u64, "nothing new was mapped");
        assert!(
            !pool.prefault_chunk(bound, Populate::Advise),
            "the bound still holds"
        );
        let next = pool.allocate(4096);
        assert_eq!(pool.mapped_bytes(), (bound + POOL_CHUNK_BYTES) as u64);
        drop(next);
    }

    #[test]
    fn a_class_of_another_chunk_size_retires_a_spare_and_spares_can_be_released() {
        // Goal: slots whose size does not divide a chunk (12 KiB) cannot use a spare; their
        // class retires one instead, so the pool's mapped memory stays what it would have
        // been; release_spares gives the rest back. Method: prefault 2 chunks, take one
        // 12 KiB slot, compare mapped bytes; then release.
        let pool = BufferPool::new(4096);
        assert!(pool.prefault_chunk(2 * POOL_CHUNK_BYTES, Populate::Touch));
        assert!(pool.prefault_chunk(2 * POOL_CHUNK_BYTES, Populate::Touch));
        let odd = pool.allocate(12 << 10);
        let odd_chunk_bytes = POOL_CHUNK_BYTES.next_multiple_of(12 << 10);
        assert_eq!(pool.spare_bytes(), POOL_CHUNK_BYTES as u64);
        assert_eq!(
            pool.mapped_bytes(),
            (POOL_CHUNK_BYTES + odd_chunk_bytes) as u64
        );
        assert_eq!(pool.release_spares(), POOL_CHUNK_BYTES as u64);
        assert_eq!(pool.spare_bytes(), 0);
        assert_eq!(pool.mapped_bytes(), odd_chunk_bytes as u64);
        assert!(odd.iter().all(|&byte| byte == 0));
    }
}
