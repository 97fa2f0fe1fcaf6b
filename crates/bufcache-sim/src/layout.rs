//! File-system layout: where the blocks of each file lie on the disk (seed 002's newfs knobs).
//!
//! Files are allocated one after another, as FFS does in an empty cylinder group. A file's
//! blocks are laid out in runs of `maxcontig` blocks; with a non-zero `rotdelay`, a gap
//! (rounded up to whole blocks, as FFS rounds its rotational preference) of the bytes the
//! platter turns in `rotdelay` separates the runs, so that a host that issues the next
//! request `rotdelay` late still finds its first sector ahead of the head. A file's last
//! block takes whole fragments only. Each file's [`FileMap`] is the engine's `BlockMap`, so
//! clusters stop at the gaps.

use std::sync::Arc;

use bufcache::{BlockMap, MappedRun};
use serde::Serialize;

/// The newfs parameters.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LayoutParams {
    /// File-system block size (`newfs -b`), bytes.
    pub block_size: u32,
    /// Fragment size (`newfs -f`), bytes.
    pub fragment_size: u32,
    /// Blocks laid out contiguously before a rotational gap (`newfs -a`).
    pub maxcontig: u32,
    /// Rotational delay between runs (`newfs -d`), ms; 0 lays runs back to back.
    pub rotdelay_ms: f64,
}

impl Default for LayoutParams {
    fn default() -> Self {
        LayoutParams {
            block_size: 8192,
            fragment_size: 1024,
            maxcontig: 8,
            rotdelay_ms: 0.0,
        }
    }
}

/// Allocates files on a disk.
pub struct FsLayout {
    params: LayoutParams,
    gap_bytes: u64,
    next_offset: u64,
    capacity: u64,
}

impl FsLayout {
    /// A layout on a disk of `capacity` bytes moving `bytes_per_ms` under the head.
    /// Allocation starts at `start_offset` (past the superblock area).
    pub fn new(params: LayoutParams, bytes_per_ms: f64, capacity: u64, start_offset: u64) -> Self {
        let block = params.block_size as u64;
        let gap_bytes = if params.rotdelay_ms > 0.0 {
            ((params.rotdelay_ms * bytes_per_ms) as u64)
                .div_ceil(block)
                .max(1)
                * block
        } else {
            0
        };
        FsLayout {
            gap_bytes,
            next_offset: start_offset,
            capacity,
            params,
        }
    }

    /// The parameters.
    pub fn params(&self) -> &LayoutParams {
        &self.params
    }

    /// Gap between runs, bytes.
    pub fn gap_bytes(&self) -> u64 {
        self.gap_bytes
    }

    /// Allocates a file of `length` bytes; `None` when the disk is full.
    pub fn allocate(&mut self, length: u64) -> Option<Arc<FileMap>> {
        let fragment = self.params.fragment_size as u64;
        let block = if length < self.params.block_size as u64 {
            // A file smaller than a block lives in fragments and gets a buffer of that size.
            length.next_multiple_of(fragment).max(512)
        } else {
            self.params.block_size as u64
        };
        let blocks = length.div_ceil(block).max(1);
        let maxcontig = self.params.maxcontig.max(1) as u64;
        let mut runs: Vec<Run> = Vec::new();
        let mut offset = self.next_offset.next_multiple_of(fragment);
        let mut placed = 0;
        while placed < blocks {
            let count = maxcontig.min(blocks - placed);
            match runs.last_mut() {
                Some(last) if self.gap_bytes == 0 => last.blocks += count,
                _ => runs.push(Run {
                    first_block: placed,
                    device_offset: offset,
                    blocks: count,
                }),
            }
            placed += count;
            offset += count * block;
            if placed < blocks {
                offset += self.gap_bytes;
            }
        }
        // The last block takes only the fragments it needs.
        let tail = length % block;
        if tail != 0 && block == self.params.block_size as u64 {
            offset -= block - tail.next_multiple_of(fragment);
        }
        if offset > self.capacity {
            return None;
        }
        self.next_offset = offset;
        Some(Arc::new(FileMap {
            runs,
            block_size: block,
        }))
    }

    /// Bytes allocated so far (end of the last file).
    pub fn used_bytes(&self) -> u64 {
        self.next_offset
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
struct Run {
    first_block: u64,
    device_offset: u64,
    blocks: u64,
}

/// The block map of one file: runs of contiguous blocks.
#[derive(Debug, Serialize)]
pub struct FileMap {
    runs: Vec<Run>,
    block_size: u64,
}

impl FileMap {
    /// A map of runs `(first block, device offset, blocks)` in block order, each run's
    /// blocks contiguous on the disk.
    pub fn from_runs(runs: Vec<(u64, u64, u64)>, block_size: u64) -> FileMap {
        FileMap {
            runs: runs
                .into_iter()
                .map(|(first_block, device_offset, blocks)| Run {
                    first_block,
                    device_offset,
                    blocks,
                })
                .collect(),
            block_size,
        }
    }

    /// Block size of this file's buffers, bytes.
    pub fn block_size(&self) -> u64 {
        self.block_size
    }

    /// Number of contiguous runs.
    pub fn runs(&self) -> usize {
        self.runs.len()
    }

    /// Device byte ranges `(offset, length)` holding blocks `[first, end)`.
    pub fn device_ranges(&self, first: u64, end: u64) -> Vec<(u64, u64)> {
        let mut ranges = Vec::new();
        let mut block = first;
        while block < end {
            let mapped = self.map(block);
            let count = mapped.contiguous_blocks.min(end - block).max(1);
            ranges.push((mapped.device_offset, count * self.block_size));
            block += count;
        }
        ranges
    }
}

impl BlockMap for FileMap {
    fn map(&self, block: u64) -> MappedRun {
        let index = self
            .runs
            .partition_point(|run| run.first_block <= block)
            .saturating_sub(1);
        let run = self.runs[index];
        let within = block.saturating_sub(run.first_block).min(run.blocks - 1);
        MappedRun {
            device_offset: run.device_offset + within * self.block_size,
            contiguous_blocks: run.blocks - within,
        }
    }
}
