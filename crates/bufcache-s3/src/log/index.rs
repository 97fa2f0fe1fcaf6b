//! The index: which disk byte ranges live where. A map from disk offset to non-overlapping
//! mappings `(length, segment, object offset)`; a range with no mapping reads as zeroes (never
//! written, trimmed or zeroed). Later writes split or replace the mappings they overlap.

use std::collections::BTreeMap;

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

    /// Maps `[offset, offset + mapping.length)` to `mapping`, replacing whatever was there.
    pub fn insert(&mut self, offset: u64, mapping: Mapping) {
        self.remove(offset, mapping.length);
        if mapping.length > 0 {
            self.mappings.insert(offset, mapping);
        }
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
    // random sequence of inserts and removes on a small disk, mirrored in a per-byte model
    // (segment, object offset or hole); every lookup of every range agrees with the model.
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
            if rng.gen_bool(0.7) {
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
        }
    }
}
