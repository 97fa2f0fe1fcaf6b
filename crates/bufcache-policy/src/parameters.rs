//! Tunable parameters of the policies that have them, with libCacheSim's defaults, so that a
//! replay can explore them and still compare with libCacheSim at the defaults.
//!
//! Each parameter has one name, used in errors and as the command-line flag (`--NAME`); the
//! doc of each field gives libCacheSim's name for it.

/// Parameters of S3-FIFO, 2Q and CLOCK. `Default` is libCacheSim's defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PolicyParameters {
    /// S3-FIFO: the small FIFO's share of the capacity (libCacheSim `fifo-size-ratio`),
    /// above 0 and below 1.
    pub s3fifo_small_queue_ratio: f64,
    /// S3-FIFO: ghost entries kept, as a fraction of the capacity (libCacheSim
    /// `ghost-size-ratio`), 0 (no ghost) to 10.
    pub s3fifo_ghost_size_ratio: f64,
    /// S3-FIFO: hits an entry needs while in the small FIFO to move to the main one instead of
    /// being evicted (libCacheSim `move-to-main-threshold`), 0 to 3 (the counter's maximum).
    pub s3fifo_move_to_main_threshold: u8,
    /// 2Q: `Kin`, the `A1in` FIFO's share of the capacity (libCacheSim `Ain-size-ratio`),
    /// above 0 and below 1.
    pub two_q_ain_size_ratio: f64,
    /// 2Q: `Kout`, the `A1out` ghost's size as a fraction of the capacity (libCacheSim
    /// `Aout-size-ratio`), 0 (no ghost) to 10.
    pub two_q_aout_size_ratio: f64,
    /// CLOCK: bits of the per-entry reference counter (libCacheSim `n-bit-counter`), 1 to 8;
    /// an entry survives up to `2^bits - 1` passes of the hand after its last hits.
    pub clock_bits: u8,
}

impl Default for PolicyParameters {
    fn default() -> Self {
        PolicyParameters {
            s3fifo_small_queue_ratio: 0.10,
            s3fifo_ghost_size_ratio: 0.90,
            s3fifo_move_to_main_threshold: crate::MOVE_TO_MAIN_HITS,
            two_q_ain_size_ratio: 0.25,
            two_q_aout_size_ratio: 0.50,
            clock_bits: 1,
        }
    }
}

/// A parameter outside its range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("--{name} {value}: must be {expected}")]
pub struct InvalidParameter {
    /// The parameter's name (its flag without `--`).
    pub name: &'static str,
    /// The value given.
    pub value: String,
    /// The accepted range, in words.
    pub expected: &'static str,
}

/// Largest ghost ratio accepted: ten times the cache is already far past any benefit, and a
/// bound keeps a typo (90 for 0.9) from allocating a ghost list of 90 caches.
const GHOST_RATIO_MAX: f64 = 10.0;

impl PolicyParameters {
    /// Checks every parameter's range; the error names the first bad one.
    pub fn validate(&self) -> Result<(), InvalidParameter> {
        fraction("s3fifo-small-queue-ratio", self.s3fifo_small_queue_ratio)?;
        ghost_ratio("s3fifo-ghost-size-ratio", self.s3fifo_ghost_size_ratio)?;
        if self.s3fifo_move_to_main_threshold > 3 {
            return Err(InvalidParameter {
                name: "s3fifo-move-to-main-threshold",
                value: self.s3fifo_move_to_main_threshold.to_string(),
                expected: "from 0 to 3 (the 2-bit counter's maximum)",
            });
        }
        fraction("2q-ain-size-ratio", self.two_q_ain_size_ratio)?;
        ghost_ratio("2q-aout-size-ratio", self.two_q_aout_size_ratio)?;
        if !(1..=8).contains(&self.clock_bits) {
            return Err(InvalidParameter {
                name: "clock-bits",
                value: self.clock_bits.to_string(),
                expected: "from 1 to 8",
            });
        }
        Ok(())
    }
}

fn fraction(name: &'static str, value: f64) -> Result<(), InvalidParameter> {
    if value > 0.0 && value < 1.0 {
        return Ok(());
    }
    Err(InvalidParameter {
        name,
        value: value.to_string(),
        expected: "above 0 and below 1",
    })
}

fn ghost_ratio(name: &'static str, value: f64) -> Result<(), InvalidParameter> {
    if (0.0..=GHOST_RATIO_MAX).contains(&value) {
        return Ok(());
    }
    Err(InvalidParameter {
        name,
        value: value.to_string(),
        expected: "from 0 to 10",
    })
}

/// `capacity × ratio` rounded down as libCacheSim computes it (`(int64_t)(size * ratio)`).
pub(crate) fn share(capacity: usize, ratio: f64) -> usize {
    (capacity as f64 * ratio) as usize
}

/// A ghost list's size: [`share`], but at least one entry unless the ratio turns it off.
pub(crate) fn ghost_share(capacity: usize, ratio: f64) -> usize {
    if ratio == 0.0 {
        0
    } else {
        share(capacity, ratio).max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_out_of_range_values_name_their_flag() {
        assert_eq!(PolicyParameters::default().validate(), Ok(()));
        let bad = PolicyParameters {
            two_q_ain_size_ratio: 1.0,
            ..PolicyParameters::default()
        };
        let error = bad.validate().unwrap_err();
        assert_eq!(error.name, "2q-ain-size-ratio");
        assert!(error.to_string().starts_with("--2q-ain-size-ratio 1: "));
        let bad = PolicyParameters {
            clock_bits: 0,
            ..PolicyParameters::default()
        };
        assert_eq!(bad.validate().unwrap_err().name, "clock-bits");
        let bad = PolicyParameters {
            s3fifo_small_queue_ratio: f64::NAN,
            ..PolicyParameters::default()
        };
        assert_eq!(bad.validate().unwrap_err().name, "s3fifo-small-queue-ratio");
    }

    #[test]
    fn shares_round_down_like_libcachesim() {
        assert_eq!(share(4897, 0.1), 489);
        assert_eq!(share(4897, 0.9), 4407);
        assert_eq!(share(1000, 0.25), 250);
        assert_eq!(ghost_share(1, 0.9), 1);
        assert_eq!(ghost_share(100, 0.0), 0);
    }
}
