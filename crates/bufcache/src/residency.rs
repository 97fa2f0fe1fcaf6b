//! What an object's bytes are, where: the allocation map with dirty data overlaid
//! (`extents`, NBD's base:allocation) and the cache's own view (`residency`,
//! `x-bufcache:state`). Queries only: nothing here changes state.

use std::sync::Arc;

use bufcache_device::Extent;

use crate::cache::Inner;
use crate::error::CacheError;
use crate::object::ObjectState;

/// The range queries of one object, borrowed from a handle for one call.
pub(crate) struct RangeMaps<'h> {
    inner: &'h Arc<Inner>,
    object: &'h Arc<ObjectState>,
}

impl<'h> RangeMaps<'h> {
    pub(crate) fn new(inner: &'h Arc<Inner>, object: &'h Arc<ObjectState>) -> Self {
        RangeMaps { inner, object }
    }

    fn inner(&self) -> &'h Arc<Inner> {
        self.inner
    }

    /// The body of [`crate::ObjectHandle::extents`].
    pub(crate) fn extents(
        &self,
        offset: u64,
        length_bytes: u64,
    ) -> Result<Vec<Extent>, CacheError> {
        let object = &self.object;
        object.check_range(offset, length_bytes)?;
        let end = offset + length_bytes;
        let dirty = self.dirty_byte_runs(offset, end);
        let clean_start = match dirty.first() {
            Some(&(start, run_end)) if start <= offset => run_end,
            _ => offset,
        };
        let clean_end = match dirty.last() {
            Some(&(start, run_end)) if run_end >= end => start,
            _ => end,
        };
        let device_runs = if clean_start < clean_end {
            self.device_extents(clean_start, clean_end)?
        } else {
            Vec::new()
        };
        let extents = overlay_dirty(offset, end, &dirty, &device_runs);
        strict_assert!(
            extents.iter().map(|extent| extent.length).sum::<u64>() <= length_bytes,
            "extents reach past the range asked for"
        );
        strict_assert!(
            length_bytes == 0 || !extents.is_empty(),
            "a range of bytes has no extents"
        );
        Ok(extents)
    }

    /// The byte ranges of `[offset, end)` whose blocks are dirty, merged into runs, in order.
    fn dirty_byte_runs(&self, offset: u64, end: u64) -> Vec<(u64, u64)> {
        let block_size = u64::from(self.object.block_size_bytes);
        let (first, last) = (offset / block_size, end.div_ceil(block_size));
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for (block, _) in self.object.dirty.lock().range(first..last) {
            let start = (block * block_size).max(offset);
            let run_end = ((block + 1) * block_size).min(end);
            match runs.last_mut() {
                Some(last_run) if last_run.1 == start => last_run.1 = run_end,
                _ => runs.push((start, run_end)),
            }
        }
        runs
    }

    /// The device's allocation map of `[start, end)` as absolute `(start, end, hole)` runs:
    /// asked for the range widened to the device's alignment, answered for the range only.
    fn device_extents(&self, start: u64, end: u64) -> Result<Vec<(u64, u64, bool)>, CacheError> {
        let io = self.inner().io();
        let capabilities = io.capabilities(self.object);
        let alignment = (capabilities.alignment_bytes as u64).max(1);
        let query_start = start - start % alignment;
        let query_end = end
            .div_ceil(alignment)
            .saturating_mul(alignment)
            .min(capabilities.length_bytes)
            .max(end);
        let answer = io.extents(self.object, query_start, query_end - query_start)?;
        let mut runs = Vec::with_capacity(answer.len());
        let mut position = query_start;
        for extent in answer {
            let (run_start, run_end) = (position.max(start), (position + extent.length).min(end));
            position += extent.length;
            if run_start < run_end {
                runs.push((run_start, run_end, extent.hole));
            }
            if position >= end {
                break;
            }
        }
        Ok(runs)
    }

    /// The body of [`crate::ObjectHandle::residency`].
    pub(crate) fn residency(
        &self,
        offset: u64,
        length_bytes: u64,
    ) -> Result<Vec<ResidencyRun>, CacheError> {
        let object = &self.object;
        object.check_range(offset, length_bytes)?;
        let end = offset + length_bytes;
        let block_size = u64::from(object.block_size_bytes);
        let (first, last) = (offset / block_size, end.div_ceil(block_size));
        let table = self.inner().table();
        // A short range is probed block by block; a long one from the table's list of the
        // object's cached blocks, which costs the cache's size instead of the range's.
        let resident: Vec<u64> = if last - first <= RESIDENCY_PROBED_BLOCKS_MAX {
            (first..last)
                .filter(|&block| table.contains(object.key(block)))
                .collect()
        } else {
            table.cached_blocks(object.id, first, last)
        };
        let dirty: Vec<u64> = object
            .dirty
            .lock()
            .range(first..last)
            .map(|(block, _)| block)
            .collect();
        let mut runs: Vec<ResidencyRun> = Vec::new();
        let mut push = |start: u64, run_end: u64, state: Residency| {
            let length = run_end.min(end) - start.max(offset);
            match runs.last_mut() {
                Some(last_run) if last_run.state == state => last_run.length += length,
                _ => runs.push(ResidencyRun { length, state }),
            }
        };
        let (mut resident, mut dirty) = (
            resident.into_iter().peekable(),
            dirty.into_iter().peekable(),
        );
        let mut block = first;
        while block < last {
            // A dirty block is resident too, so it shows up in both lists.
            let next_resident = resident.peek().copied().unwrap_or(last);
            let next_dirty = dirty.peek().copied().unwrap_or(last);
            let next = next_resident.min(next_dirty);
            if next > block {
                push(block * block_size, next * block_size, Residency::Absent);
                block = next;
                continue;
            }
            let state = if next_dirty == block {
                Residency::Dirty
            } else {
                Residency::Resident
            };
            push(block * block_size, (block + 1) * block_size, state);
            resident.next_if_eq(&block);
            dirty.next_if_eq(&block);
            block += 1;
        }
        strict_assert!(
            runs.iter().map(|run| run.length).sum::<u64>() == length_bytes,
            "residency runs do not cover the range"
        );
        Ok(runs)
    }
}

/// Ranges of at most this many blocks are probed block by block by
/// [`crate::ObjectHandle::residency`]; longer ones use the table's list of cached blocks.
const RESIDENCY_PROBED_BLOCKS_MAX: u64 = 4096;

/// Where a run of an object's bytes is, as [`crate::ObjectHandle::residency`] reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Residency {
    /// Not in the cache: the device holds the bytes.
    Absent,
    /// Cached and clean: the same bytes as the device.
    Resident,
    /// Cached and newer than the device (not yet written back).
    Dirty,
}

/// A run of bytes with one [`Residency`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResidencyRun {
    /// Length of the run in bytes (never zero).
    pub length: u64,
    /// Where the run's blocks are.
    pub state: Residency,
}

/// The extents of `[offset, end)`: the `dirty` byte runs as data, the rest from `device`
/// (absolute `(start, end, hole)` runs covering the non-dirty bytes from their start, or a
/// prefix of them), merged. Stops where neither says anything.
fn overlay_dirty(
    offset: u64,
    end: u64,
    dirty: &[(u64, u64)],
    device: &[(u64, u64, bool)],
) -> Vec<Extent> {
    let mut extents: Vec<Extent> = Vec::new();
    let mut push = |length: u64, hole: bool| match extents.last_mut() {
        Some(last) if last.hole == hole => last.length += length,
        _ => extents.push(Extent { length, hole }),
    };
    let (mut dirty, mut device) = (dirty.iter().peekable(), device.iter().peekable());
    let mut position = offset;
    while position < end {
        if let Some(&&(start, run_end)) = dirty.peek() {
            if start <= position {
                push(run_end - position, false);
                position = run_end;
                dirty.next();
                continue;
            }
        }
        let next_dirty = dirty.peek().map_or(end, |&&(start, _)| start);
        while device
            .next_if(|&&(_, run_end, _)| run_end <= position)
            .is_some()
        {}
        let Some(&&(start, run_end, hole)) = device.peek() else {
            break;
        };
        if start > position {
            // The device answered less than asked: report what is known.
            break;
        }
        let stop = run_end.min(next_dirty);
        push(stop - position, hole);
        position = stop;
    }
    extents
}
