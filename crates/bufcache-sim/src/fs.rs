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
//!   pointers it gains are delayed writes. At each indirect boundary the file moves to the
//!   first group from `(inode's group + lbn / maxbpg) mod groups` with at least the average
//!   number of free blocks (`ffs_blkpref`; maxbpg = NINDIR, `newfs -e`'s default), so large
//!   files spread over the groups.
//! - Blocks come from per-group free-block maps as 4.4BSD-Lite2's `ffs_alloc.c` hands
//!   them out: `ffs_blkpref` requests the block after the previous one (or a rotdelay gap
//!   further), and at the start of a section the group's second block — in the inode's group
//!   for the direct blocks, else in the first group from `inode's group + lbn / maxbpg` with
//!   at least the average number of free blocks; `ffs_alloccgblk` takes the requested block
//!   if it is free, else with `-n` above 1 the first free block of the requested cylinder at
//!   the requested rotational position or the next one around (`cbtorpos` on the label's
//!   track), else (`-n 1`: "drives of unknown geometry (e.g. SCSI)") the next free block
//!   after the request (`ffs_mapsearch`); a group without free blocks passes the request
//!   on (`ffs_hashalloc`'s quadratic rehash, then every group).
//! - So `-n` decides only when a requested block is taken: on a fresh file system, where a
//!   file starts (its first request, the group's second block, is metadata) and at its
//!   indirect blocks; on an aged one ([`Ffs::age`]: seeded create/remove churn through the
//!   same maps), wherever other files' blocks are in the way (seed 002's "-n 1"; see
//!   docs/experiments.md).
//! - Simplified: the maps are kept per block with a count of fragments in use; small files
//!   and tails take fragments from one partially used block per group, and fragments freed
//!   inside a block still partly in use are not reused until the whole block is free. No
//!   `ffs_reallocblks` (cluster reallocation).

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
    /// requested block (see the module documentation).
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
    /// Age the file system before the run (`None`: a fresh file system, as `newfs` leaves
    /// it). Not a newfs flag: the history the file system had before the measurement.
    pub aging: Option<AgingParams>,
}

/// How a file system is aged before a run (see [`Ffs::age`]). The seeds do not describe
/// their file systems' history; every value here is **assumed**.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AgingParams {
    /// Share of the data blocks in use when aging ends, above 0 and at most 0.9 (4.4BSD
    /// keeps `minfree`, 10 %, for root).
    pub fill: f64,
    /// Bytes created again after the first fill (each creation after a random removal), as
    /// a multiple of the first fill's bytes; 0 to 20.
    pub churn: f64,
    /// Smallest file, bytes (sizes are log-uniform between the bounds).
    pub file_bytes_min: u64,
    /// Largest file, bytes.
    pub file_bytes_max: u64,
}

impl Default for AgingParams {
    /// Filled to 70 %, churned twice over, files of 1 KiB to 1 MiB (**assumed**).
    fn default() -> Self {
        AgingParams {
            fill: 0.7,
            churn: 2.0,
            file_bytes_min: 1 << 10,
            file_bytes_max: 1 << 20,
        }
    }
}

impl AgingParams {
    /// Checks the parameters; the error names the bad one.
    pub fn validate(&self) -> Result<(), FsError> {
        let invalid = |flag: &'static str, value: String, expected: &str| {
            Err(FsError::Invalid {
                flag,
                value,
                expected: expected.to_string(),
            })
        };
        if !(self.fill > 0.0 && self.fill <= 0.9) {
            return invalid("age", self.fill.to_string(), "above 0 and at most 0.9");
        }
        if !(0.0..=20.0).contains(&self.churn) {
            return invalid("churn", self.churn.to_string(), "from 0 to 20");
        }
        if self.file_bytes_min == 0 || self.file_bytes_min > self.file_bytes_max {
            return invalid(
                "age file sizes",
                format!("{}..{}", self.file_bytes_min, self.file_bytes_max),
                "a smallest size of at least 1 byte, no larger than the largest",
            );
        }
        Ok(())
    }
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
            aging: None,
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
        if let Some(aging) = &self.aging {
            aging.validate()?;
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
/// per group), `i` (bytes per inode) — `sync` (`on` or `off`: synchronous metadata), and
/// `age` (fill share) and `churn` to age the file system first ([`AgingParams`]);
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
                SpecError::new(
                    item,
                    "",
                    "key=value (b, f, a, d, n, r, c, i, sync, age, churn)",
                )
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
                "age" => {
                    params.aging.get_or_insert_with(AgingParams::default).fill =
                        value.parse::<f64>().map_err(|_| {
                            SpecError::new(key, value, "a share of the data blocks, e.g. 0.7")
                        })?
                }
                "churn" => {
                    params.aging.get_or_insert_with(AgingParams::default).churn =
                        value.parse::<f64>().map_err(|_| {
                            SpecError::new(key, value, "a multiple of the first fill, e.g. 2")
                        })?
                }
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
                        "a newfs key: b, f, a, d, n, r, c, i, sync, age, churn",
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

/// A block of a group's map that is never free: boot area, superblock copy, cylinder-group
/// block and inode table.
const METADATA_BLOCK: u8 = u8::MAX;

struct Group {
    /// First byte of the group.
    start: u64,
    /// First data byte (past the superblock copy, cylinder-group block and inodes).
    data_start: u64,
    /// End of the group.
    end: u64,
    /// The free-block map (`cg_blksfree`) at block granularity: per block of the group, the
    /// fragments in use — 0 is a free block, `METADATA_BLOCK` one that never frees.
    used: Vec<u8>,
    /// Whole free blocks (`cs_nbfree`).
    free_blocks: u64,
    /// `cg_rotor`: where the last search without a usable preference found a block.
    rotor: usize,
    /// A partially used block whose free fragments small files and tails take: (offset of
    /// its first free fragment, end of the block).
    fragments: Option<(u64, u64)>,
    inodes_used: u64,
    /// Next inode slot handed out (slots wrap; only their offsets matter here).
    inode_next: u64,
    directories: u64,
}

/// What a file took from the free-block maps: (block offset, fragments), so that removing
/// it gives them back.
type Taken = Vec<(u64, u8)>;

/// The file system: cylinder groups and their allocation state.
pub struct Ffs {
    params: NewfsParams,
    geometry: FsGeometry,
    groups: Vec<Group>,
    group_bytes: u64,
    inodes_per_group: u64,
    gap_blocks: u64,
    pointers_per_block: u64,
    fragments_per_block: u8,
}

/// A file-system aging run: what it left behind.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AgingReport {
    /// Files alive at the end (besides the aging's directories).
    pub files: u64,
    /// Files created and removed over the run.
    pub files_created: u64,
    /// Files removed.
    pub files_removed: u64,
    /// Share of the data blocks in use at the end.
    pub used_fraction: f64,
    /// Mean length of a run of free blocks, in blocks (a fresh group is one run).
    pub free_run_mean_blocks: f64,
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
            let blocks = ((end - start) / block) as usize;
            let metadata_blocks = ((data_start - start) / block) as usize;
            let mut used = vec![0u8; blocks];
            used[..metadata_blocks].fill(METADATA_BLOCK);
            groups.push(Group {
                start,
                data_start,
                end,
                free_blocks: (blocks - metadata_blocks) as u64,
                used,
                rotor: metadata_blocks,
                fragments: None,
                inodes_used: 0,
                inode_next: 0,
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
            fragments_per_block: (params.block_size / params.fragment_size) as u8,
            gap_blocks,
            inodes_per_group,
            groups,
            group_bytes,
            geometry,
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
            let g = &mut self.groups[group];
            if g.inodes_used < self.inodes_per_group {
                let number = g.inode_next % self.inodes_per_group;
                g.inode_next += 1;
                g.inodes_used += 1;
                return Ok((group, self.inode_table_offset(group) + number * INODE_BYTES));
            }
        }
        Err(FsError::Full("no free inode"))
    }

    fn group_of(&self, offset: u64) -> Option<usize> {
        let group = (offset / self.group_bytes) as usize;
        (group < self.groups.len() && offset < self.groups[group].end).then_some(group)
    }

    fn block_offset(&self, group: usize, index: usize) -> u64 {
        self.groups[group].start + index as u64 * self.params.block_size as u64
    }

    /// `cbtorpos`: the rotational position (of `-n`) at which the block at `offset` starts,
    /// on the label's track (no track skew or interleave, as for SCSI disks).
    fn rotational_position(&self, offset: u64) -> u64 {
        let sectors = (self.geometry.track_bytes / 512).max(1);
        (offset / 512 % sectors) * self.params.rotational_positions as u64 / sectors
    }

    fn take(&mut self, group: usize, index: usize) -> u64 {
        let g = &mut self.groups[group];
        debug_assert_eq!(g.used[index], 0, "block {index} of group {group} is taken");
        g.used[index] = self.fragments_per_block;
        g.free_blocks -= 1;
        self.block_offset(group, index)
    }

    /// `ffs_mapsearch` for a whole block: the first free block at or after `from`, around
    /// the group; becomes the group's rotor.
    fn map_search(&mut self, group: usize, from: usize) -> Option<u64> {
        let g = &self.groups[group];
        let blocks = g.used.len();
        let from = from.min(blocks);
        let index = (from..blocks)
            .chain(0..from)
            .find(|&index| g.used[index] == 0)?;
        self.groups[group].rotor = index;
        Some(self.take(group, index))
    }

    /// `ffs_alloccgblk` (4.4BSD-Lite2 `ffs_alloc.c`): the requested block if it is free;
    /// else, with `-n` above 1, the first free block of the requested cylinder at the
    /// requested rotational position or the next one around (the rotational search);
    /// else (`-n 1`, or nothing free in that cylinder) the next free block of the group
    /// after the requested one. Without a request in this group, the search starts at the
    /// group's rotor.
    fn alloc_in_group(&mut self, group: usize, preference: Option<u64>) -> Option<u64> {
        if self.groups[group].free_blocks == 0 {
            return None;
        }
        let block = self.params.block_size as u64;
        let Some(preferred) = preference.filter(|&p| self.group_of(p) == Some(group)) else {
            let rotor = self.groups[group].rotor;
            return self.map_search(group, rotor);
        };
        let start = self.groups[group].start;
        let index = ((preferred - start) / block) as usize;
        if self.groups[group].used[index] == 0 {
            return Some(self.take(group, index));
        }
        let positions = self.params.rotational_positions as u64;
        if positions <= 1 {
            return self.map_search(group, index);
        }
        // The requested cylinder's blocks (by where they start) within this group.
        let preferred = start + index as u64 * block;
        let cylinder_bytes = self.geometry.cylinder_bytes;
        let low = (preferred / cylinder_bytes * cylinder_bytes).max(start);
        let high =
            (low / cylinder_bytes * cylinder_bytes + cylinder_bytes).min(self.groups[group].end);
        let first = (low - start).div_ceil(block) as usize;
        let last = ((high - start).div_ceil(block) as usize).min(self.groups[group].used.len());
        // The first free block at each rotational position (postbl's chain order).
        let mut at_position: Vec<Option<usize>> = vec![None; positions as usize];
        for candidate in first..last {
            if self.groups[group].used[candidate] == 0 {
                let position = self.rotational_position(start + candidate as u64 * block);
                at_position[position as usize].get_or_insert(candidate);
            }
        }
        let wanted = self.rotational_position(preferred);
        let found = (wanted..positions)
            .chain(0..wanted)
            .find_map(|position| at_position[position as usize]);
        match found {
            Some(candidate) => Some(self.take(group, candidate)),
            None => self.map_search(group, index),
        }
    }

    /// `ffs_alloc` with `ffs_hashalloc`: the preferred group (that of the requested block,
    /// else the inode's), then a quadratic rehash over the groups, then all of them.
    fn alloc_block(
        &mut self,
        inode_group: usize,
        preference: Option<u64>,
    ) -> Result<(u64, usize), FsError> {
        let count = self.groups.len();
        let first = preference
            .and_then(|p| self.group_of(p))
            .unwrap_or(inode_group);
        if let Some(offset) = self.alloc_in_group(first, preference) {
            return Ok((offset, first));
        }
        let mut group = first;
        let mut step = 1;
        while step < count {
            group = (group + step) % count;
            if let Some(offset) = self.alloc_in_group(group, None) {
                return Ok((offset, group));
            }
            step *= 2;
        }
        let mut group = (first + 2) % count;
        for _ in 2..count {
            if let Some(offset) = self.alloc_in_group(group, None) {
                return Ok((offset, group));
            }
            group = (group + 1) % count;
        }
        Err(FsError::Full("no free block"))
    }

    /// `ffs_blkpref` at the start of a section of the file (block 0, and every block that
    /// starts a new indirect block's worth): for the direct blocks the inode's group, else
    /// the first group from `inode's group + lbn / maxbpg` with at least the average number
    /// of free blocks; the request is that group's second block.
    fn section_preference(&self, inode_group: usize, lbn: u64) -> Option<u64> {
        let block = self.params.block_size as u64;
        if lbn < DIRECT_BLOCKS {
            return Some(self.groups[inode_group].start + block);
        }
        let count = self.groups.len();
        let first = (inode_group + (lbn / self.pointers_per_block) as usize) % count;
        let average = self.groups.iter().map(|g| g.free_blocks).sum::<u64>() / count as u64;
        (first..count)
            .chain(0..=first)
            .find(|&group| self.groups[group].free_blocks >= average)
            .map(|group| self.groups[group].start + block)
    }

    /// `bytes` of fragments (a multiple of the fragment) in group `group`'s partially used
    /// block, or a new block's first fragments (`ffs_alloccg` for fragments: a whole block
    /// is split when no partial one has room).
    fn fragments_in(
        &mut self,
        group: usize,
        bytes: u64,
        taken: &mut Taken,
    ) -> Result<u64, FsError> {
        let block = self.params.block_size as u64;
        let fragment = self.params.fragment_size as u64;
        let count = (bytes / fragment) as u8;
        if let Some((next, end)) = self.groups[group].fragments {
            if next + bytes <= end {
                self.groups[group].fragments = Some((next + bytes, end));
                let index = ((end - block - self.groups[group].start) / block) as usize;
                self.groups[group].used[index] += count;
                taken.push((end - block, count));
                return Ok(next);
            }
        }
        let preference = self.section_preference(group, 0);
        let (offset, from) = self.alloc_block(group, preference)?;
        let index = ((offset - self.groups[from].start) / block) as usize;
        self.groups[from].used[index] = count;
        self.groups[from].fragments = Some((offset + bytes, offset + block));
        taken.push((offset, count));
        Ok(offset)
    }

    /// Makes a directory able to hold `entries` entries in group chosen by `ffs_dirpref`.
    pub fn make_directory(&mut self, entries: u64) -> Result<Placed, FsError> {
        let group = self.directory_group();
        Ok(self.place(group, directory_bytes(entries), true)?.0)
    }

    /// Creates a file of `length` bytes in the group of its directory (`directory_group`).
    pub fn create_file(&mut self, directory_group: usize, length: u64) -> Result<Placed, FsError> {
        Ok(self.place(directory_group, length, false)?.0)
    }

    fn place(
        &mut self,
        preferred: usize,
        length: u64,
        directory: bool,
    ) -> Result<(Placed, Taken), FsError> {
        let (group, inode_offset) = self.inode_in(preferred)?;
        if directory {
            self.groups[group].directories += 1;
        }
        let mut taken = Taken::new();
        let block = self.params.block_size as u64;
        let fragment = self.params.fragment_size as u64;
        let length = length.max(1);
        if length < block {
            // Fragments only: the buffer is the fragments' size, as 4.4BSD sizes it.
            let bytes = length.next_multiple_of(fragment);
            let offset = self.fragments_in(group, bytes, &mut taken)?;
            let placed = Placed {
                map: Arc::new(FileMap::from_runs(vec![(0, offset, 1)], bytes)),
                meta: FileMeta {
                    group,
                    inode_offset,
                    indirect_blocks: Vec::new(),
                },
            };
            return Ok((placed, taken));
        }
        let blocks = length.div_ceil(block);
        let maxcontig = self.params.maxcontig as usize;
        let nindir = self.pointers_per_block;
        let mut runs: Vec<(u64, u64, u64)> = Vec::new();
        let mut indirect_blocks = Vec::new();
        // The block pointers of the current section (`bap`: the inode's direct blocks, then
        // each indirect block's).
        let mut section: Vec<u64> = Vec::new();
        let mut last = (0u64, group);
        for lbn in 0..blocks {
            let starts_section =
                lbn == 0 || (lbn >= DIRECT_BLOCKS && (lbn - DIRECT_BLOCKS).is_multiple_of(nindir));
            if starts_section && lbn >= DIRECT_BLOCKS {
                // ffs_balloc: the indirect blocks this block needs (the single at 12; the
                // double and a second-level one at 12 + NINDIR; a second-level one after),
                // each requested where the section will go, then written.
                let needed = if lbn == DIRECT_BLOCKS + nindir { 2 } else { 1 };
                let preference = self.section_preference(group, lbn);
                for _ in 0..needed {
                    let (offset, _) = self.alloc_block(group, preference)?;
                    indirect_blocks.push((lbn, offset));
                    taken.push((offset, self.fragments_per_block));
                }
                section.clear();
            }
            let preference = if starts_section {
                self.section_preference(group, lbn)
            } else {
                // ffs_blkpref: the block after the previous one, or a rotdelay gap further
                // once the last maxcontig blocks are contiguous.
                let index = section.len();
                let next = section[index - 1] + block;
                if self.gap_blocks > 0
                    && index >= maxcontig
                    && section[index - maxcontig] + maxcontig as u64 * block == next
                {
                    Some(next + self.gap_blocks * block)
                } else {
                    Some(next)
                }
            };
            let (offset, from) = self.alloc_block(group, preference)?;
            section.push(offset);
            taken.push((offset, self.fragments_per_block));
            last = (offset, from);
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
            let (last_block, from) = last;
            if used < block {
                let count = (used / fragment) as u8;
                let index = ((last_block - self.groups[from].start) / block) as usize;
                self.groups[from].used[index] = count;
                self.groups[from].fragments = Some((last_block + used, last_block + block));
                if let Some(entry) = taken.iter_mut().rev().find(|(o, _)| *o == last_block) {
                    entry.1 = count;
                }
            }
        }
        let placed = Placed {
            map: Arc::new(FileMap::from_runs(runs, block)),
            meta: FileMeta {
                group,
                inode_offset,
                indirect_blocks,
            },
        };
        Ok((placed, taken))
    }

    /// Removes a file: its blocks and fragments go back to the free maps (a block whose
    /// fragments are all free is a free block again), its inode to its group.
    fn remove(&mut self, group: usize, taken: &Taken) {
        let block = self.params.block_size as u64;
        for &(offset, count) in taken {
            let Some(from) = self.group_of(offset) else {
                continue;
            };
            let index = ((offset - self.groups[from].start) / block) as usize;
            let g = &mut self.groups[from];
            debug_assert!(g.used[index] >= count && g.used[index] != METADATA_BLOCK);
            g.used[index] -= count;
            if g.used[index] == 0 {
                g.free_blocks += 1;
                // Its free fragments are a free block now, not a partial one.
                if matches!(g.fragments, Some((_, end)) if end == offset + block) {
                    g.fragments = None;
                }
            }
        }
        self.groups[group].inodes_used -= 1;
    }

    /// Ages the file system (Smith and Seltzer's point, "File System Aging", SIGMETRICS
    /// 1997: a benchmark on an empty file system never meets the allocator's fallbacks):
    /// creates files of log-uniform sizes in one directory per group until `fill` of the
    /// data blocks are used, then removes a random file and creates new ones, to the same
    /// fill, until `churn` × the filled bytes have been created again — all through this
    /// allocator, so the free space is fragmented the way 4.4BSD's policies fragment it.
    /// No I/O: the state is as if the churn had happened before the run. Deterministic in
    /// `seed`.
    pub fn age(&mut self, aging: &AgingParams, seed: u64) -> Result<AgingReport, FsError> {
        aging.validate()?;
        let mut rng = crate::clock::SimRng::new(seed ^ 0xA6E5_F5A6_0000_0037);
        let data_blocks: u64 = self
            .groups
            .iter()
            .map(|g| g.used.iter().filter(|&&u| u != METADATA_BLOCK).count() as u64)
            .sum();
        let target_used = (aging.fill * data_blocks as f64) as u64;
        let used = |ffs: &Ffs| data_blocks - ffs.groups.iter().map(|g| g.free_blocks).sum::<u64>();
        let directories: Vec<usize> = (0..self.groups.len())
            .map(|_| self.make_directory(64).map(|placed| placed.meta.group))
            .collect::<Result<_, _>>()?;
        let (low, high) = (
            (aging.file_bytes_min as f64).ln(),
            (aging.file_bytes_max as f64).ln(),
        );
        let mut live: Vec<(usize, Taken)> = Vec::new();
        let mut created = 0u64;
        let mut removed = 0u64;
        let mut created_bytes = 0u64;
        let mut fill_bytes = None;
        loop {
            while used(self) < target_used {
                let unit = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
                let length = (low + unit * (high - low)).exp() as u64;
                let directory = directories[rng.below(directories.len() as u64) as usize];
                let (placed, taken) = self.place(directory, length.max(1), false)?;
                live.push((placed.meta.group, taken));
                created += 1;
                created_bytes += length;
            }
            let filled = *fill_bytes.get_or_insert(created_bytes);
            if created_bytes >= filled + (aging.churn * filled as f64) as u64 || live.is_empty() {
                break;
            }
            let victim = live.swap_remove(rng.below(live.len() as u64) as usize);
            self.remove(victim.0, &victim.1);
            removed += 1;
        }
        let mut runs = 0u64;
        let mut free = 0u64;
        for g in &self.groups {
            let mut previous_free = false;
            for &u in &g.used {
                let is_free = u == 0;
                if is_free {
                    free += 1;
                    if !previous_free {
                        runs += 1;
                    }
                }
                previous_free = is_free;
            }
        }
        Ok(AgingReport {
            files: live.len() as u64,
            files_created: created,
            files_removed: removed,
            used_fraction: used(self) as f64 / data_blocks.max(1) as f64,
            free_run_mean_blocks: free as f64 / runs.max(1) as f64,
        })
    }

    /// Bytes of data space handed out so far (whole blocks, partly used ones included).
    pub fn data_used_bytes(&self) -> u64 {
        let block = self.params.block_size as u64;
        self.groups
            .iter()
            .map(|g| {
                let data = g.used.iter().filter(|&&u| u != METADATA_BLOCK).count() as u64;
                (data - g.free_blocks) * block
            })
            .sum()
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
