//! `SparseStore`: bytes of a large address space held in fixed-size chunks, only where data was
//! written. The one sparse in-memory store of the project: the memory device, the crash
//! device's volatile and durable images and the simulator's disk all keep their bytes here.
//!
//! Invariants: a chunk absent from the map reads as zeroes; a chunk that is all zeroes is not
//! kept (written zeroes, zeroing and discards cost no memory); a stored chunk is exactly
//! `chunk_bytes` long.
//! The store does no locking and no range checks: its owner does both.

use std::collections::BTreeMap;
use std::io::IoSliceMut;

use crate::device::Extent;

/// A sparse byte store in chunks of `chunk_bytes`.
#[derive(Clone, Debug)]
pub struct SparseStore {
    chunk_bytes: u64,
    chunks: BTreeMap<u64, Box<[u8]>>,
}

impl SparseStore {
    /// An empty store (all zeroes) with chunks of `chunk_bytes` (a power of two).
    pub fn new(chunk_bytes: u64) -> Self {
        assert!(
            chunk_bytes.is_power_of_two(),
            "chunk size {chunk_bytes} is not a power of two"
        );
        SparseStore {
            chunk_bytes,
            chunks: BTreeMap::new(),
        }
    }

    /// Bytes of memory held by stored chunks.
    pub fn allocated_bytes(&self) -> u64 {
        self.chunks.len() as u64 * self.chunk_bytes
    }

    /// Stores `data` at `offset`. Zeroes cost nothing: an all-zero piece allocates no chunk,
    /// and a chunk that becomes all zeroes is freed (simulated disks mostly write zeroes, and
    /// a memory device should not grow when a file system zeroes its free space).
    pub fn write(&mut self, offset: u64, data: &[u8]) {
        let chunk_bytes = self.chunk_bytes;
        for_each_piece(
            chunk_bytes,
            offset,
            data.len() as u64,
            |index, within, start, step| {
                let piece = &data[start..start + step];
                let zeroes = piece.iter().all(|&byte| byte == 0);
                match self.chunks.get_mut(&index) {
                    Some(chunk) => {
                        chunk[within..within + step].copy_from_slice(piece);
                        if zeroes
                            && (step as u64 == chunk_bytes || chunk.iter().all(|&byte| byte == 0))
                        {
                            self.chunks.remove(&index);
                        }
                    }
                    None if zeroes => {}
                    None => {
                        let mut chunk = vec![0u8; chunk_bytes as usize].into_boxed_slice();
                        chunk[within..within + step].copy_from_slice(piece);
                        self.chunks.insert(index, chunk);
                    }
                }
            },
        );
    }

    /// Makes `length` bytes at `offset` read as zeroes, freeing whole chunks.
    pub fn zero(&mut self, offset: u64, length: u64) {
        let chunk_bytes = self.chunk_bytes;
        for_each_piece(chunk_bytes, offset, length, |index, within, _, step| {
            if within == 0 && step as u64 == chunk_bytes {
                self.chunks.remove(&index);
            } else if let Some(chunk) = self.chunks.get_mut(&index) {
                chunk[within..within + step].fill(0);
            }
        });
    }

    /// Copies the bytes at `offset` into `target` (zeroes where nothing is stored). One
    /// ordered walk over the stored chunks the range touches, and one fill per stretch of
    /// absent chunks between them, rather than a map probe and a fill per chunk: a read-ahead
    /// cluster of a never-written region is one fill per target.
    pub fn read(&self, offset: u64, target: &mut [u8]) {
        self.read_before(offset, target, &[]);
    }

    /// [`SparseStore::read`] into each of `targets` in turn, from `offset` on: a vectored
    /// read. While it checks one target for zeroes (see `fill_zeroes`) it asks the CPU to
    /// fetch the start of the next, which sits at an unrelated address (another cache
    /// buffer) that no hardware prefetcher predicts.
    pub fn read_vectored(&self, offset: u64, targets: &mut [IoSliceMut<'_>]) {
        let mut at = offset;
        for index in 0..targets.len() {
            let (target, rest) = targets[index..]
                .split_first_mut()
                .expect("index within the targets");
            let next: &[u8] = rest.first().map_or(&[], |next| &next[..]);
            self.read_before(at, target, next);
            at += target.len() as u64;
        }
    }

    /// [`SparseStore::read`], where `next` is the memory the caller fills next (to prefetch).
    fn read_before(&self, offset: u64, target: &mut [u8], next: &[u8]) {
        let length = target.len() as u64;
        if length == 0 {
            return;
        }
        let chunk_bytes = self.chunk_bytes;
        let first = offset / chunk_bytes;
        let last = (offset + length - 1) / chunk_bytes;
        // Bytes of `target` filled so far: everything before it is copied or zeroed.
        let mut done = 0usize;
        for (&index, chunk) in self.chunks.range(first..=last) {
            let chunk_start = index * chunk_bytes;
            let from = chunk_start.max(offset);
            let to = (chunk_start + chunk_bytes).min(offset + length);
            let start = (from - offset) as usize;
            let end = (to - offset) as usize;
            fill_zeroes(&mut target[done..start], &[]);
            let within = (from - chunk_start) as usize;
            target[start..end].copy_from_slice(&chunk[within..within + (end - start)]);
            done = end;
        }
        fill_zeroes(&mut target[done..], next);
    }

    /// The allocation map of `length` bytes at `offset`, at chunk granularity: a chunk never
    /// stored (or wholly zeroed) is a hole.
    pub fn extents(&self, offset: u64, length: u64) -> Vec<Extent> {
        let mut extents: Vec<Extent> = Vec::new();
        for_each_piece(self.chunk_bytes, offset, length, |index, _, _, step| {
            let hole = !self.chunks.contains_key(&index);
            match extents.last_mut() {
                Some(last) if last.hole == hole => last.length += step as u64,
                _ => extents.push(Extent {
                    length: step as u64,
                    hole,
                }),
            }
        });
        extents
    }
}

/// Makes `bytes` zero, writing only from the first stretch of them that is not zero already:
/// memory that reads as zero (a recycled cache buffer that held a never-written block, a
/// fresh mapping) is only read, never dirtied. Zeroing a cold buffer costs a trip to memory
/// for each line and a write-back later; checking it costs the trip alone, and leaves the
/// lines in the CPU cache for the copy to the reader that follows. A buffer that holds other
/// bytes costs one extra read of `ZERO_CHECK_BYTES`, which the fill fetches anyway. `next` is
/// the memory the caller fills next, prefetched while this is checked. Empty slices make no
/// call: glibc's AVX-512 memset ends even an empty fill with a masked store at the slice's
/// end, which may be the next page.
fn fill_zeroes(bytes: &mut [u8], next: &[u8]) {
    let zero = zero_prefix_bytes(bytes, next);
    if zero < bytes.len() {
        bytes[zero..].fill(0);
    }
}

/// Bytes [`zero_prefix_bytes`] checks at a time: one early exit per block keeps a buffer of
/// other bytes from being read twice, and the block is long enough for the loop to run in
/// whole vectors.
const ZERO_CHECK_BYTES: usize = 256;

/// How far ahead of the block being checked the AVX2 check prefetches, bytes: far enough
/// for the lines to arrive from memory before the check gets there.
const PREFETCH_AHEAD_BYTES: usize = 2048;

/// How many leading bytes of `bytes` are known to be zero: all of them, or the whole
/// `ZERO_CHECK_BYTES` blocks before the first block that holds another byte. Checks with
/// 32-byte vectors where the CPU has them: with 16-byte (SSE2) or 8-byte loads the check
/// issues so many loads per cache line that it takes longer than zeroing the line. There it
/// also prefetches ahead, into `next` (the memory checked after `bytes`) past the end.
fn zero_prefix_bytes(bytes: &[u8], next: &[u8]) -> usize {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the function only needs AVX2, which the CPU was just found to have.
        return unsafe { zero_prefix_bytes_avx2(bytes, next) };
    }
    let _ = next;
    zero_prefix_bytes_portable(bytes, |_| {})
}

/// [`zero_prefix_bytes_portable`] compiled for AVX2, prefetching `PREFETCH_AHEAD_BYTES`
/// ahead of each block in `bytes` followed by `next`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn zero_prefix_bytes_avx2(bytes: &[u8], next: &[u8]) -> usize {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    /// Bytes of a cache line.
    const LINE_BYTES: usize = 64;
    zero_prefix_bytes_portable(bytes, |block_start| {
        let ahead = block_start + PREFETCH_AHEAD_BYTES;
        let (memory, from) = if ahead < bytes.len() {
            (bytes, ahead)
        } else {
            (next, ahead - bytes.len())
        };
        let end = memory.len().min(from + ZERO_CHECK_BYTES);
        for line in (from..end).step_by(LINE_BYTES) {
            // A hint only: it reads nothing into the program and cannot fault.
            _mm_prefetch::<_MM_HINT_T0>(memory[line..].as_ptr().cast());
        }
    })
}

/// [`zero_prefix_bytes`] in plain Rust: the OR of each block's bytes, which the compiler
/// turns into vector ORs of the widest vectors it is allowed. `before_block` is called with
/// each block's start before the block is checked.
#[inline(always)]
fn zero_prefix_bytes_portable(bytes: &[u8], mut before_block: impl FnMut(usize)) -> usize {
    let mut blocks = bytes.chunks_exact(ZERO_CHECK_BYTES);
    let mut zero = 0;
    for block in &mut blocks {
        before_block(zero);
        if block.iter().fold(0u8, |any, &byte| any | byte) != 0 {
            return zero;
        }
        zero += ZERO_CHECK_BYTES;
    }
    if blocks.remainder().iter().all(|&byte| byte == 0) {
        bytes.len()
    } else {
        zero
    }
}

/// Calls `visit(chunk_index, offset_in_chunk, offset_in_transfer, length)` for each chunk
/// piece of a transfer of `length` bytes at `offset`.
fn for_each_piece(
    chunk_bytes: u64,
    offset: u64,
    length: u64,
    mut visit: impl FnMut(u64, usize, usize, usize),
) {
    let mut done = 0u64;
    while done < length {
        let position = offset + done;
        let within = position % chunk_bytes;
        let step = (chunk_bytes - within).min(length - done);
        visit(
            position / chunk_bytes,
            within as usize,
            done as usize,
            step as usize,
        );
        done += step;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SeededRng;

    /// Goal: the store reads back what was written across chunk boundaries, reads zeroes
    /// elsewhere, frees wholly zeroed chunks and reports holes. Method: write across three
    /// chunks, read, zero one whole chunk and part of another, check bytes, memory and map.
    #[test]
    fn stores_sparsely_and_frees_zeroed_chunks() {
        let mut store = SparseStore::new(4096);
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8 + 1).collect();
        store.write(3000, &data);
        let mut back = vec![0u8; 10_000];
        store.read(3000, &mut back);
        assert_eq!(back, data);
        assert_eq!(store.allocated_bytes(), 4 * 4096);
        store.zero(4096, 4096);
        store.zero(3000, 10);
        assert_eq!(store.allocated_bytes(), 3 * 4096);
        store.write(5 * 4096, &[0u8; 4096]);
        assert_eq!(
            store.allocated_bytes(),
            3 * 4096,
            "written zeroes allocate nothing"
        );
        let mut piece = vec![9u8; 20];
        store.read(2995, &mut piece);
        assert!(piece[..15].iter().all(|&b| b == 0));
        assert_eq!(piece[15..], data[10..15]);
        let extents = store.extents(0, 5 * 4096);
        assert_eq!(
            extents,
            vec![
                Extent {
                    length: 4096,
                    hole: false
                },
                Extent {
                    length: 4096,
                    hole: true
                },
                Extent {
                    length: 2 * 4096,
                    hole: false
                },
                Extent {
                    length: 4096,
                    hole: true
                },
            ]
        );
    }

    /// Goal: a read of never-written bytes leaves its target all zeroes whatever the target
    /// held, though the zero fill skips leading stretches that are zero already (and checks
    /// them with AVX2 where the CPU has it, prefetching into the next target). Method:
    /// targets of several lengths (whole check blocks and not) that are zero but for one
    /// byte, placed in turn at every offset, read from an empty store alone and as the first
    /// of two vectored targets; the portable check is compared with the dispatched one.
    #[test]
    fn absent_ranges_read_as_zeroes_whatever_the_target_held() {
        let store = SparseStore::new(4096);
        let next = vec![1u8; 3000];
        for length in [1, 31, 255, 256, 257, 1000, 8192] {
            for position in 0..length {
                let mut target = vec![0u8; length];
                target[position] = 0x80;
                let expected_prefix = position / ZERO_CHECK_BYTES * ZERO_CHECK_BYTES;
                assert_eq!(
                    zero_prefix_bytes_portable(&target, |_| {}),
                    expected_prefix,
                    "portable check, length {length}, nonzero byte at {position}"
                );
                assert_eq!(
                    zero_prefix_bytes(&target, &next),
                    expected_prefix,
                    "dispatched check, length {length}, nonzero byte at {position}"
                );
                let mut copy = target.clone();
                store.read(12_345, &mut target);
                assert!(
                    target.iter().all(|&byte| byte == 0),
                    "length {length}, nonzero byte at {position} survived the read"
                );
                let mut second = next.clone();
                store.read_vectored(
                    12_345,
                    &mut [IoSliceMut::new(&mut copy), IoSliceMut::new(&mut second)],
                );
                assert!(
                    copy.iter().chain(&second).all(|&byte| byte == 0),
                    "length {length}, nonzero byte at {position}: a vectored read left bytes"
                );
            }
            let mut zeroes = vec![0u8; length];
            assert_eq!(zero_prefix_bytes(&zeroes, &[]), length);
            store.read(0, &mut zeroes);
            assert!(zeroes.iter().all(|&byte| byte == 0));
        }
    }

    /// Goal: a read returns exactly what a flat array of the same writes and zeroings holds,
    /// whatever mix of stored and absent chunks (and chunk edges) the range crosses. Method:
    /// seeded random writes, zeroings and reads over a small store with 64-byte chunks,
    /// each read compared with the model; the seed is printed.
    #[test]
    fn reads_match_a_flat_model_across_stored_and_absent_chunks() {
        let seed = 0x5EED_0034_u64;
        println!("seed {seed:#x}");
        let mut rng = SeededRng::new(seed);
        let mut next = move |bound: u64| rng.below(bound);
        let size = 2048u64;
        let mut store = SparseStore::new(64);
        let mut model = vec![0u8; size as usize];
        for round in 0..4000 {
            let offset = next(size);
            let length = next(size - offset + 1);
            let range = offset as usize..(offset + length) as usize;
            match next(4) {
                0 => {
                    let data: Vec<u8> = (0..length).map(|_| next(3) as u8).collect();
                    store.write(offset, &data);
                    model[range].copy_from_slice(&data);
                }
                1 => {
                    store.zero(offset, length);
                    model[range].fill(0);
                }
                2 => {
                    let mut back = vec![0xA5u8; length as usize];
                    store.read(offset, &mut back);
                    assert_eq!(
                        back, model[range],
                        "seed {seed:#x}, round {round}: read of {length} bytes at {offset}"
                    );
                }
                _ => {
                    // A vectored read in three pieces of random lengths (some empty).
                    let mut back = vec![0xA5u8; length as usize];
                    let first = next(length + 1) as usize;
                    let second = first + next(length - first as u64 + 1) as usize;
                    let (head, tail) = back.split_at_mut(second);
                    let (one, two) = head.split_at_mut(first);
                    store.read_vectored(
                        offset,
                        &mut [
                            IoSliceMut::new(one),
                            IoSliceMut::new(two),
                            IoSliceMut::new(tail),
                        ],
                    );
                    assert_eq!(
                        back, model[range],
                        "seed {seed:#x}, round {round}: vectored read of {length} bytes at {offset}"
                    );
                }
            }
        }
    }
}
