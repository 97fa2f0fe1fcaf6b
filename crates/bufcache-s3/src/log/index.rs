//! The index: which disk byte ranges live where. A map from disk offset to non-overlapping
//! mappings `(length, segment, object offset)`; a range with no mapping reads as zeroes (never
//! written, trimmed or zeroed). Later writes split or replace the mappings they overlap.
//!
//! The index also keeps the live bytes of every segment (bytes some mapping points at), the
//! measure garbage collection picks segments by. Invariant: `live` holds exactly the sums a
//! recount of the mappings gives ([`Index::recount_live_bytes`]), and no segment with zero
//! live bytes is kept in it.

use std::collections::{BTreeMap, HashMap};

use bufcache_device::strict_assert;

/// Where one mapped range's bytes are: `length` bytes at `object_offset` of segment `segment`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mapping {
    pub length: u64,
    pub segment: u64,
    pub object_offset: u64,
}

/// One piece of a lookup: `length` bytes at `disk_offset`, stored (Some) or zeroes (None).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    pub disk_offset: u64,
    pub length: u64,
    /// (segment, object offset) of the piece's first byte.
    pub stored: Option<(u64, u64)>,
}

#[derive(Clone, Default, Debug, PartialEq, Eq)]
pub struct Index {
    /// Keyed by disk offset; mappings never overlap.
    mappings: BTreeMap<u64, Mapping>,
    /// Live bytes per segment (see the module docs).
    live: HashMap<u64, u64>,
}

impl Index {
    pub fn new() -> Index {
        Index::default()
    }

    /// The mappings in disk order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, Mapping)> + '_ {
        self.mappings
            .iter()
            .map(|(&offset, &mapping)| (offset, mapping))
    }

    pub fn len(&self) -> usize {
        self.mappings.len()
    }

    /// Bytes mapped (live data).
    pub fn mapped_bytes(&self) -> u64 {
        self.mappings.values().map(|mapping| mapping.length).sum()
    }

    /// Bytes of segment `segment` some mapping points at.
    pub fn live_bytes(&self, segment: u64) -> u64 {
        self.live.get(&segment).copied().unwrap_or(0)
    }

    /// Live bytes of every segment with any (kept up to date, see the module docs).
    pub fn live_bytes_by_segment(&self) -> &HashMap<u64, u64> {
        &self.live
    }

    /// Live bytes per segment counted afresh from the mappings (tests compare it with
    /// [`Index::live_bytes_by_segment`]).
    pub fn recount_live_bytes(&self) -> HashMap<u64, u64> {
        let mut live = HashMap::new();
        for mapping in self.mappings.values() {
            *live.entry(mapping.segment).or_insert(0) += mapping.length;
        }
        live
    }

    fn add_live(&mut self, segment: u64, bytes: u64) {
        strict_assert!(
            bytes > 0,
            "no empty mapping is counted live (segment {segment})"
        );
        if bytes > 0 {
            *self.live.entry(segment).or_insert(0) += bytes;
        }
    }

    fn subtract_live(&mut self, segment: u64, bytes: u64) {
        if bytes == 0 {
            return;
        }
        let live = self
            .live
            .get_mut(&segment)
            .expect("a mapped segment has live bytes");
        *live = live.checked_sub(bytes).unwrap_or_else(|| {
            panic!("live bytes of segment {segment} would go negative ({live} - {bytes})")
        });
        if *live == 0 {
            self.live.remove(&segment);
        }
    }

    /// Maps `[offset, offset + mapping.length)` to `mapping`, replacing whatever was there.
    pub fn insert(&mut self, offset: u64, mapping: Mapping) {
        self.remove(offset, mapping.length);
        if mapping.length > 0 {
            self.add_live(mapping.segment, mapping.length);
            let replaced = self.mappings.insert(offset, mapping);
            strict_assert!(
                replaced.is_none(),
                "a mapping at {offset} survived the removal of its range"
            );
            self.assert_no_overlap_around(offset, offset + mapping.length);
        }
    }

    /// Mappings never overlap: the one before `[start, end)` ends by `start`, the one after
    /// starts at `end` or later. Checked where a change was made (a whole recount is the
    /// simulator's, `recount_live_bytes`).
    fn assert_no_overlap_around(&self, start: u64, end: u64) {
        if let Some((&before, mapping)) = self.mappings.range(..start).next_back() {
            strict_assert!(
                before + mapping.length <= start,
                "mapping at {before} (+{}) overlaps {start}",
                mapping.length
            );
        }
        if let Some((&after, _)) = self.mappings.range(start..).find(|&(&at, _)| at != start) {
            strict_assert!(
                after >= end,
                "mapping at {after} starts inside [{start}, {end})"
            );
        }
    }

    /// Applies a garbage collector's copy: maps to `mapping` only the parts of
    /// `[offset, offset + mapping.length)` that the index still maps to segment `source`
    /// (a newer write or trim of the rest wins over the copy). Returns the bytes mapped.
    pub fn insert_copy(&mut self, offset: u64, mapping: Mapping, source: u64) -> u64 {
        let mut applied = 0;
        for piece in self.lookup(offset, mapping.length) {
            if matches!(piece.stored, Some((segment, _)) if segment == source) {
                let within = piece.disk_offset - offset;
                self.insert(
                    piece.disk_offset,
                    Mapping {
                        length: piece.length,
                        segment: mapping.segment,
                        object_offset: mapping.object_offset + within,
                    },
                );
                applied += piece.length;
            }
        }
        strict_assert!(
            applied <= mapping.length,
            "a copy of {} bytes applied {applied}",
            mapping.length
        );
        applied
    }

    /// Unmaps `[offset, offset + length)`: it reads as zeroes.
    pub fn remove(&mut self, offset: u64, length: u64) {
        if length == 0 {
            return;
        }
        let end = offset + length;
        // The mapping starting before `offset` may reach into the range: keep its head and,
        // when it reaches past `end`, its tail.
        if let Some((&start, &mapping)) = self.mappings.range(..offset).next_back() {
            let mapping_end = start + mapping.length;
            if mapping_end > offset {
                self.subtract_live(mapping.segment, mapping_end.min(end) - offset);
                self.mappings.insert(
                    start,
                    Mapping {
                        length: offset - start,
                        ..mapping
                    },
                );
                if mapping_end > end {
                    self.mappings.insert(
                        end,
                        Mapping {
                            length: mapping_end - end,
                            segment: mapping.segment,
                            object_offset: mapping.object_offset + (end - start),
                        },
                    );
                }
            }
        }
        let inside: Vec<u64> = self
            .mappings
            .range(offset..end)
            .map(|(&start, _)| start)
            .collect();
        for start in inside {
            let mapping = self.mappings.remove(&start).expect("listed just now");
            let mapping_end = start + mapping.length;
            self.subtract_live(mapping.segment, mapping_end.min(end) - start);
            if mapping_end > end {
                self.mappings.insert(
                    end,
                    Mapping {
                        length: mapping_end - end,
                        segment: mapping.segment,
                        object_offset: mapping.object_offset + (end - start),
                    },
                );
            }
        }
        strict_assert!(
            self.mappings.range(offset..end).next().is_none(),
            "a mapping starts inside the removed [{offset}, {end})"
        );
        self.assert_no_overlap_around(offset, end);
    }

    /// The pieces covering `[offset, offset + length)` in order, holes included.
    pub fn lookup(&self, offset: u64, length: u64) -> Vec<Piece> {
        let end = offset + length;
        let mut pieces = Vec::new();
        let mut position = offset;
        let first = self
            .mappings
            .range(..=offset)
            .next_back()
            .filter(|(&start, mapping)| start + mapping.length > offset)
            .map(|(&start, _)| start)
            .unwrap_or(offset);
        for (&start, mapping) in self.mappings.range(first..end) {
            let mapping_end = start + mapping.length;
            if start > position {
                pieces.push(Piece {
                    disk_offset: position,
                    length: start - position,
                    stored: None,
                });
                position = start;
            }
            let piece_end = mapping_end.min(end);
            pieces.push(Piece {
                disk_offset: position,
                length: piece_end - position,
                stored: Some((mapping.segment, mapping.object_offset + (position - start))),
            });
            position = piece_end;
        }
        if position < end {
            pieces.push(Piece {
                disk_offset: position,
                length: end - position,
                stored: None,
            });
        }
        pieces
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    // Goal: the index always says where the newest bytes of every disk byte are. Method: a
    // random sequence of inserts, garbage-collector copies and removes on a small disk,
    // mirrored in a per-byte model (segment, object offset or hole); every lookup of every
    // range agrees with the model, and the live bytes kept per segment equal a recount.
    #[test]
    fn index_lookups_agree_with_a_per_byte_model() {
        let seed: u64 = rand::random();
        println!("seed {seed}");
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        const SIZE: u64 = 256;
        let mut index = Index::new();
        let mut model: Vec<Option<(u64, u64)>> = vec![None; SIZE as usize];
        for step in 0..2000u64 {
            let offset = rng.gen_range(0..SIZE);
            let length = rng.gen_range(0..=(SIZE - offset).min(40));
            let source = model[offset as usize].map(|(segment, _)| segment);
            if let (Some(source), true) = (source, rng.gen_bool(0.2)) {
                // A copy applies only where the range still maps to its source.
                let object_offset = rng.gen_range(0..1000u64);
                let mapping = Mapping {
                    length,
                    segment: step,
                    object_offset,
                };
                let applied = index.insert_copy(offset, mapping, source);
                let mut expected_applied = 0;
                for byte in 0..length {
                    let at = (offset + byte) as usize;
                    if matches!(model[at], Some((segment, _)) if segment == source) {
                        model[at] = Some((step, object_offset + byte));
                        expected_applied += 1;
                    }
                }
                assert_eq!(applied, expected_applied, "seed {seed} step {step}");
            } else if rng.gen_bool(0.7) {
                let object_offset = rng.gen_range(0..1000u64);
                index.insert(
                    offset,
                    Mapping {
                        length,
                        segment: step,
                        object_offset,
                    },
                );
                for byte in 0..length {
                    model[(offset + byte) as usize] = Some((step, object_offset + byte));
                }
            } else {
                index.remove(offset, length);
                for byte in 0..length {
                    model[(offset + byte) as usize] = None;
                }
            }
            let from = rng.gen_range(0..SIZE);
            let span = rng.gen_range(0..=SIZE - from);
            let mut position = from;
            for piece in index.lookup(from, span) {
                assert_eq!(piece.disk_offset, position, "seed {seed}");
                for byte in 0..piece.length {
                    let expected = model[(piece.disk_offset + byte) as usize];
                    let got = piece
                        .stored
                        .map(|(segment, object)| (segment, object + byte));
                    assert_eq!(got, expected, "seed {seed} step {step}");
                }
                position += piece.length;
            }
            assert_eq!(position, from + span, "seed {seed}");
            let mapped = model.iter().filter(|byte| byte.is_some()).count() as u64;
            assert_eq!(index.mapped_bytes(), mapped, "seed {seed}");
            assert_eq!(
                index.live_bytes_by_segment(),
                &index.recount_live_bytes(),
                "live bytes per segment, seed {seed} step {step}"
            );
        }
    }
}
