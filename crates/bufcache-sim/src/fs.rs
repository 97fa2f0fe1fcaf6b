//! A 4.4BSD FFS model: where `newfs` and the allocator put cylinder groups, inodes,
//! directories, free-block bitmaps, indirect blocks and file data, so that the metadata
//! traffic of creating and writing files goes through the same cache as the data.
//!
//! What follows 4.4BSD-Lite (`newfs`, `ffs_alloc.c`, `ffs_balloc.c`; McKusick, Bostic,
//! Karels and Quarterman, *The Design and Implementation of the 4.4BSD Operating System*,
//! 1996, §8.2 and §8.9):
//!
//! - The disk is cut into cylinder groups of `cylinders_per_group` cylinders (`newfs -c`,
//!   default 16). Each holds a superblock copy, its cylinder-group block (the free-block and
//!   free-inode bitmaps, one file-system block) and an inode table of one 128-byte inode per
//!   `bytes_per_inode` of the group (`newfs -i`, default 4096: 4 fragments per inode as
//!   4.4BSD's NFPI), then data. (The per-group stagger of the metadata is left out.)
//! - A new directory goes to the group with the fewest directories among those with at
//!   least the average number of free inodes (`ffs_dirpref`); a file goes to its directory's
//!   group (`ffs_valloc` with the parent's group as preference).
//! - Data blocks are allocated in file order from the group's free space: runs of
//!   `maxcontig` blocks (`-a`), separated with a non-zero `rotdelay` (`-d`) by the blocks
//!   the platter passes in that time at `rpm` (`-r`) — the gap `ffs_blkpref` leaves. A file
//!   whose size is not a multiple of the block ends in fragments (`-f`) right after its last
//!   block (in-place extension); a file smaller than a block takes fragments from a
//!   partially used block, as `ffs_alloccg` takes them from the fragment summary.
//! - Blocks 0–11 are direct; block 12 needs the single indirect block, block
//!   12 + NINDIR the double indirect block and one second-level block per NINDIR blocks
//!   after. A new indirect block is allocated just before the data block that needs it and
//!   written synchronously (zeroed) so it never points at garbage (`ffs_balloc`); the
//!   pointers it gains are delayed writes. At each indirect boundary past the first, the
//!   file moves to the group `(inode's group + lbn / maxbpg) mod groups` with free space
//!   (`ffs_blkpref`; maxbpg = NINDIR, `newfs -e`'s default), so large files spread over
//!   the groups.
//! - `rotational_positions` (`-n`) changes no placement, as in 4.4BSD on an empty file
//!   system: `ffs_alloccgblk` takes the requested block when it is free and searches the
//!   cylinder's rotational positions (`fs_nrpos`) only when it is taken, and the rotdelay gap
//!   comes from `ffs_blkpref` whatever `-n` is. Files are never freed here, so the requested
//!   block is always free (seed 002's "-n 1" effect; see docs/experiments.md).

use std::sync::Arc;

use bufcache::{BlockMap, MappedRun};
use serde::Serialize;

use crate::layout::FileMap;

/// Bytes of one on-disk inode (4.4BSD's `struct dinode`).
pub const INODE_BYTES: u64 = 128;
/// Direct block pointers in an inode (4.4BSD's NDADDR).
pub const DIRECT_BLOCKS: u64 = 12;
/// Bytes of a directory entry with a name of about ten characters (`struct direct`: 8 bytes
/// of header plus the name rounded up to 4). **Assumed** average name length.
pub const DIRECTORY_ENTRY_BYTES: u64 = 20;
/// 4.4BSD's directory block (DIRBLKSIZ): directories grow by this much.
pub const DIRECTORY_BLOCK_BYTES: u64 = 512;

/// Bytes of a directory sized for `entries` entries (at least `.` and `..`), in whole
/// directory blocks.
pub fn directory_bytes(entries: u64) -> u64 {
    (entries.max(2) * DIRECTORY_ENTRY_BYTES).next_multiple_of(DIRECTORY_BLOCK_BYTES)
}

/// The `newfs` parameters of the model.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct NewfsParams {
    /// Block size (`-b`), bytes: a power of two from 4 KiB to 64 KiB.
    pub block_size: u32,
    /// Fragment size (`-f`), bytes: the block divided by 1, 2, 4 or 8.
    pub fragment_size: u32,
    /// Blocks laid out contiguously before a rotational gap (`-a`), 1 to 512 (4.4BSD's
    /// newfs accepts any value; the seed tried 512).
    pub maxcontig: u32,
    /// Rotational delay between runs (`-d`), ms; 0 lays runs back to back.
    pub rotdelay_ms: f64,
    /// Rotational positions per cylinder (`-n`); consulted by 4.4BSD only for a taken
    /// requested block, which never happens here (see the module documentation).
    pub rotational_positions: u32,
    /// Revolutions per minute the file system assumes (`-r`), for the rotdelay gap.
    pub rpm: u32,
    /// Cylinders per cylinder group (`-c`).
    pub cylinders_per_group: u32,
    /// Bytes of data space per inode (`-i`).
    pub bytes_per_inode: u32,
    /// Write inodes and directory entries synchronously on create (4.4BSD FFS without soft
    /// updates, as in seed 004's "FFS partition w/o softdeps"). Off: delayed writes.
    pub sync_metadata: bool,
}

impl Default for NewfsParams {
    /// 4.4BSD's newfs defaults: 8K/1K, maxcontig 8 (seed 000's "maxcontig of 8"), rotdelay
    /// 4 ms, 8 rotational positions, 3600 RPM, 16 cylinders per group, 4096 bytes per
    /// inode; synchronous metadata.
    fn default() -> Self {
        NewfsParams {
            block_size: 8192,
            fragment_size: 1024,
            maxcontig: 8,
            rotdelay_ms: 4.0,
            rotational_positions: 8,
            rpm: 3600,
            cylinders_per_group: 16,
            bytes_per_inode: 4096,
            sync_metadata: true,
        }
    }
}

impl NewfsParams {
    /// Checks the parameters; the error names the bad one.
    pub fn validate(&self) -> Result<(), FsError> {
        let invalid = |flag: &'static str, value: String, expected: &str| {
            Err(FsError::Invalid {
                flag,
                value,
                expected: expected.to_string(),
            })
        };
        let block = self.block_size;
        if !(4096..=65536).contains(&block) || !block.is_power_of_two() {
            return invalid("-b", block.to_string(), "a power of two from 4096 to 65536");
        }
        let fragment = self.fragment_size;
        if fragment < 512
            || !block.is_multiple_of(fragment)
            || !(1..=8).contains(&(block / fragment))
        {
            return invalid(
                "-f",
                fragment.to_string(),
                &format!("the block ({block}) divided by 1, 2, 4 or 8, at least 512"),
            );
        }
        if !(1..=512).contains(&self.maxcontig) {
            return invalid("-a", self.maxcontig.to_string(), "from 1 to 512");
        }
        if !(self.rotdelay_ms >= 0.0 && self.rotdelay_ms <= 100.0) {
            return invalid("-d", self.rotdelay_ms.to_string(), "from 0 to 100 ms");
        }
        if !(1..=32).contains(&self.rotational_positions) {
            return invalid("-n", self.rotational_positions.to_string(), "from 1 to 32");
        }
        if !(1000..=20000).contains(&self.rpm) {
            return invalid("-r", self.rpm.to_string(), "from 1000 to 20000");
        }
        if !(1..=1024).contains(&self.cylinders_per_group) {
            return invalid("-c", self.cylinders_per_group.to_string(), "from 1 to 1024");
        }
        if !(1024..=1 << 20).contains(&self.bytes_per_inode) {
            return invalid(
                "-i",
                self.bytes_per_inode.to_string(),
                "from 1024 to 1048576",
            );
        }
        Ok(())
    }
}

/// A file system that cannot be laid out, or is full.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FsError {
    /// A `newfs` parameter out of range, or one the disk cannot hold.
    Invalid {
        /// The newfs flag (`-a`, `-f`, ...).
        flag: &'static str,
        /// The value given.
        value: String,
        /// What is allowed.
        expected: String,
    },
    /// No free inode or block is left.
    Full(&'static str),
}

impl std::fmt::Display for FsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FsError::Invalid {
                flag,
                value,
                expected,
            } => write!(f, "newfs {flag} {value} is invalid: expected {expected}"),
            FsError::Full(what) => write!(f, "the file system is full: {what}"),
        }
    }
}

impl std::error::Error for FsError {}

/// Syntax: `key=value,...` with the newfs flags as keys — `b` (block), `f` (fragment), `a`
/// (maxcontig), `d` (rotdelay, ms), `n` (rotational positions), `r` (rpm), `c` (cylinders
/// per group), `i` (bytes per inode) — and `sync` (`on` or `off`: synchronous metadata);
/// unnamed keys keep [`NewfsParams::default`]. `default` alone is the defaults.
impl std::str::FromStr for NewfsParams {
    type Err = crate::disk::SpecError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        use crate::disk::SpecError;
        let mut params = NewfsParams::default();
        let text = text.trim();
        if text.is_empty() || text == "default" {
            return Ok(params);
        }
        for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (key, value) = item.split_once('=').ok_or_else(|| {
                SpecError::new(item, "", "key=value (b, f, a, d, n, r, c, i, sync)")
            })?;
            let (key, value) = (key.trim(), value.trim());
            let whole = || {
                value
                    .parse::<u32>()
                    .map_err(|_| SpecError::new(key, value, "a whole number"))
            };
            match key {
                "b" => params.block_size = whole()?,
                "f" => params.fragment_size = whole()?,
                "a" => params.maxcontig = whole()?,
                "d" => {
                    params.rotdelay_ms = value
                        .parse::<f64>()
                        .map_err(|_| SpecError::new(key, value, "a number of ms"))?
                }
                "n" => params.rotational_positions = whole()?,
                "r" => params.rpm = whole()?,
                "c" => params.cylinders_per_group = whole()?,
                "i" => params.bytes_per_inode = whole()?,
                "sync" => {
                    params.sync_metadata = match value {
                        "on" | "1" | "true" => true,
                        "off" | "0" | "false" => false,
                        _ => return Err(SpecError::new(key, value, "on or off")),
                    }
                }
                _ => {
                    return Err(SpecError::new(
                        key,
                        value,
                        "a newfs key: b, f, a, d, n, r, c, i, sync",
                    ))
                }
            }
        }
        params.validate().map_err(|e| match e {
            FsError::Invalid {
                flag,
                value,
                expected,
            } => SpecError::new(flag.trim_start_matches('-'), &value, &expected),
            FsError::Full(what) => SpecError::new("newfs", what, "room"),
        })?;
        Ok(params)
    }
}

/// The disk geometry the file system is laid out on (`newfs` reads it from the label).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct FsGeometry {
    /// Disk capacity, bytes.
    pub capacity_bytes: u64,
    /// Bytes per cylinder (sectors per track × heads × 512).
    pub cylinder_bytes: u64,
    /// Bytes per track.
    pub track_bytes: u64,
}

/// Where a file's metadata lies.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FileMeta {
    /// Cylinder group of the inode.
    pub group: usize,
    /// Device offset of the inode (128 bytes).
    pub inode_offset: u64,
    /// Indirect blocks: (first data block they map, device offset), in allocation order.
    pub indirect_blocks: Vec<(u64, u64)>,
}

/// A file laid out: its block map and its metadata.
pub struct Placed {
    /// The data blocks.
    pub map: Arc<FileMap>,
    /// Inode and indirect blocks.
    pub meta: FileMeta,
}

struct Group {
    /// First byte of the group.
    start: u64,
    /// First data byte (past the superblock copy, cylinder-group block and inodes).
    data_start: u64,
    /// End of the group.
    end: u64,
    /// Next free block-aligned data byte (blocks are handed out in order).
    data_next: u64,
    /// A partially used block whose free fragments small files and tails take: (offset of
    /// its first free fragment, end of the block).
    fragments: Option<(u64, u64)>,
    inodes_used: u64,
    directories: u64,
}

/// The file system: cylinder groups and their allocation state.
pub struct Ffs {
    params: NewfsParams,
    groups: Vec<Group>,
    inodes_per_group: u64,
    gap_blocks: u64,
    pointers_per_block: u64,
}

impl Ffs {
    /// Lays out an empty file system (what `newfs` writes) on `geometry`.
    pub fn new(params: NewfsParams, geometry: FsGeometry) -> Result<Ffs, FsError> {
        params.validate()?;
        let block = params.block_size as u64;
        let group_bytes =
            (geometry.cylinder_bytes * params.cylinders_per_group as u64) / block * block;
        if group_bytes < 8 * block {
            return Err(FsError::Invalid {
                flag: "-c",
                value: params.cylinders_per_group.to_string(),
                expected: format!(
                    "cylinder groups of at least 8 blocks (this gives {group_bytes} bytes)"
                ),
            });
        }
        let inodes_per_group = (group_bytes / params.bytes_per_inode as u64)
            .max(block / INODE_BYTES)
            .next_multiple_of(block / INODE_BYTES);
        let inode_bytes = inodes_per_group * INODE_BYTES;
        let count = (geometry.capacity_bytes / group_bytes).max(1);
        let mut groups = Vec::new();
        for index in 0..count {
            let start = index * group_bytes;
            // Group 0 starts past the boot blocks and the primary superblock (16 KiB).
            let metadata = start
                + if index == 0 {
                    (16u64 << 10).next_multiple_of(block)
                } else {
                    0
                };
            // The superblock copy and the cylinder-group block, one block each.
            let data_start = metadata + 2 * block + inode_bytes;
            let end = (start + group_bytes).min(geometry.capacity_bytes);
            if data_start + block > end {
                return Err(FsError::Invalid {
                    flag: "-i",
                    value: params.bytes_per_inode.to_string(),
                    expected: format!("inodes that leave data space in cylinder group {index}"),
                });
            }
            groups.push(Group {
                start,
                data_start,
                end,
                data_next: data_start,
                fragments: None,
                inodes_used: 0,
                directories: 0,
            });
        }
        // The rotdelay gap in whole blocks at the rpm the file system assumes, on the
        // label's track (ffs_blkpref's fs_rotdelay × fs_rps × fs_nsect, rounded up).
        let gap_blocks = if params.rotdelay_ms > 0.0 {
            let bytes = params.rotdelay_ms / 1000.0 * params.rpm as f64 / 60.0
                * geometry.track_bytes as f64;
            ((bytes as u64).div_ceil(block)).max(1)
        } else {
            0
        };
        Ok(Ffs {
            pointers_per_block: block / 4,
            gap_blocks,
            inodes_per_group,
            groups,
            params,
        })
    }

    /// The parameters.
    pub fn params(&self) -> &NewfsParams {
        &self.params
    }

    /// Cylinder groups.
    pub fn groups(&self) -> usize {
        self.groups.len()
    }

    /// Device offset of group `group`'s cylinder-group block (its bitmaps).
    pub fn group_block_offset(&self, group: usize) -> u64 {
        let g = &self.groups[group];
        let block = self.params.block_size as u64;
        g.data_start - self.inodes_per_group * INODE_BYTES - block
    }

    fn inode_table_offset(&self, group: usize) -> u64 {
        self.groups[group].data_start - self.inodes_per_group * INODE_BYTES
    }

    /// `ffs_dirpref`: the group with the fewest directories among those with at least the
    /// average number of free inodes.
    fn directory_group(&self) -> usize {
        let free: u64 = self
            .groups
            .iter()
            .map(|g| self.inodes_per_group - g.inodes_used)
            .sum();
        let average = free / self.groups.len() as u64;
        self.groups
            .iter()
            .enumerate()
            .filter(|(_, g)| self.inodes_per_group - g.inodes_used >= average)
            .min_by_key(|(index, g)| (g.directories, *index))
            .map(|(index, _)| index)
            .unwrap_or(0)
    }

    fn inode_in(&mut self, preferred: usize) -> Result<(usize, u64), FsError> {
        let count = self.groups.len();
        for step in 0..count {
            let group = (preferred + step) % count;
            if self.groups[group].inodes_used < self.inodes_per_group {
                let number = self.groups[group].inodes_used;
                self.groups[group].inodes_used += 1;
                return Ok((group, self.inode_table_offset(group) + number * INODE_BYTES));
            }
        }
        Err(FsError::Full("no free inode"))
    }

    /// One whole block from group `preferred` or the next with space; returns its offset
    /// and the group it came from.
    fn block_from(&mut self, preferred: usize) -> Result<(u64, usize), FsError> {
        let block = self.params.block_size as u64;
        let count = self.groups.len();
        for step in 0..count {
            let group = (preferred + step) % count;
            let g = &mut self.groups[group];
            if g.data_next + block <= g.end {
                let offset = g.data_next;
                g.data_next += block;
                return Ok((offset, group));
            }
        }
        Err(FsError::Full("no free block"))
    }

    /// `bytes` of fragments (a multiple of the fragment) in group `group`'s partially used
    /// block, or a new block's first fragments.
    fn fragments_in(&mut self, group: usize, bytes: u64) -> Result<u64, FsError> {
        if let Some((next, end)) = self.groups[group].fragments {
            if next + bytes <= end {
                self.groups[group].fragments = Some((next + bytes, end));
                return Ok(next);
            }
        }
        let block = self.params.block_size as u64;
        let (offset, from) = self.block_from(group)?;
        self.groups[from].fragments = Some((offset + bytes, offset + block));
        Ok(offset)
    }

    /// Makes a directory able to hold `entries` entries in group chosen by `ffs_dirpref`.
    pub fn make_directory(&mut self, entries: u64) -> Result<Placed, FsError> {
        let group = self.directory_group();
        self.place(group, directory_bytes(entries), true)
    }

    /// Creates a file of `length` bytes in the group of its directory (`directory_group`).
    pub fn create_file(&mut self, directory_group: usize, length: u64) -> Result<Placed, FsError> {
        self.place(directory_group, length, false)
    }

    fn place(&mut self, preferred: usize, length: u64, directory: bool) -> Result<Placed, FsError> {
        let (group, inode_offset) = self.inode_in(preferred)?;
        if directory {
            self.groups[group].directories += 1;
        }
        let block = self.params.block_size as u64;
        let fragment = self.params.fragment_size as u64;
        let length = length.max(1);
        if length < block {
            // Fragments only: the buffer is the fragments' size, as 4.4BSD sizes it.
            let bytes = length.next_multiple_of(fragment);
            let offset = self.fragments_in(group, bytes)?;
            return Ok(Placed {
                map: Arc::new(FileMap::from_runs(vec![(0, offset, 1)], bytes)),
                meta: FileMeta {
                    group,
                    inode_offset,
                    indirect_blocks: Vec::new(),
                },
            });
        }
        let blocks = length.div_ceil(block);
        let maxcontig = self.params.maxcontig as u64;
        let mut runs: Vec<(u64, u64, u64)> = Vec::new();
        let mut indirect_blocks = Vec::new();
        let mut current = group;
        let mut in_run = 0u64;
        let nindir = self.pointers_per_block;
        for lbn in 0..blocks {
            // Indirect blocks needed before this data block.
            let mut needed = 0;
            if lbn == DIRECT_BLOCKS {
                needed = 1;
            } else if lbn > DIRECT_BLOCKS && (lbn - DIRECT_BLOCKS).is_multiple_of(nindir) {
                // A new second-level block, plus the double indirect block at the first.
                needed = if lbn == DIRECT_BLOCKS + nindir { 2 } else { 1 };
                // ffs_blkpref: a new section of the file starts in another group.
                let section = lbn / nindir;
                current = (group + section as usize) % self.groups.len();
                in_run = 0;
            }
            for _ in 0..needed {
                let (offset, from) = self.block_from(current)?;
                current = from;
                indirect_blocks.push((lbn, offset));
                in_run = 0;
            }
            // The rotational gap after a run of maxcontig blocks.
            if in_run == maxcontig {
                for _ in 0..self.gap_blocks {
                    let g = &mut self.groups[current];
                    if g.data_next + block <= g.end {
                        g.data_next += block;
                    }
                }
                in_run = 0;
            }
            let (offset, from) = self.block_from(current)?;
            current = from;
            in_run += 1;
            match runs.last_mut() {
                Some((_, start, count)) if *start + *count * block == offset => {
                    *count += 1;
                }
                _ => runs.push((lbn, offset, 1)),
            }
        }
        // The tail: the last block holds only the fragments it needs; the rest of that block
        // becomes free fragments for small files.
        let tail = length % block;
        if tail != 0 {
            let used = tail.next_multiple_of(fragment);
            if let Some((_, start, count)) = runs.last() {
                let last_block = start + (count - 1) * block;
                if used < block {
                    self.groups[current].fragments = Some((last_block + used, last_block + block));
                }
            }
        }
        Ok(Placed {
            map: Arc::new(FileMap::from_runs(runs, block)),
            meta: FileMeta {
                group,
                inode_offset,
                indirect_blocks,
            },
        })
    }

    /// Bytes of data space handed out so far.
    pub fn data_used_bytes(&self) -> u64 {
        self.groups.iter().map(|g| g.data_next - g.data_start).sum()
    }

    /// First byte of group `group`.
    pub fn group_start(&self, group: usize) -> u64 {
        self.groups[group].start
    }
}

/// The whole disk seen block by block (the raw device): the metadata buffers (inode blocks,
/// cylinder-group blocks, indirect blocks) are cached as blocks of this object at their
/// device offsets, as 4.4BSD caches them by device block number.
pub struct RawMap {
    /// Block size, bytes.
    pub block_size: u64,
}

impl BlockMap for RawMap {
    fn map(&self, block: u64) -> MappedRun {
        MappedRun {
            device_offset: block * self.block_size,
            // Metadata blocks are written one at a time: never cluster them with neighbours.
            contiguous_blocks: 1,
        }
    }
}
