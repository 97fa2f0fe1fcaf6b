//! Live what-if for `serve`: the request stream of every export, cut into block keys, feeds
//! miniature simulations ([`bufcache_policy::whatif`]) of the configured policy and LRU at
//! ¼…8× the configured cache size. Results go to `/metrics`, `/stats` and `bufcache stat`.
//!
//! The feed sits at the NBD export adapter (the `observe` module wraps any export), so the
//! engine is untouched and sees no extra work. Hot path per request: for each block it covers,
//! one hash and a compare; only a sampled block (about 1 in 100 by default) takes the lock
//! around the miniatures. Keys are `export << 52 | block`, so exports never share a key.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::bail;
use bufcache::format_size;
use bufcache_policy::whatif::{sampling_hash, WhatIf, WhatIfEstimate};
use bufcache_policy::{PolicyKind, PolicyParameters};
use serde_json::{json, Value};

/// The miniature caches of one server and what they need to cut requests into keys.
pub struct WhatIfFeed {
    threshold: u64,
    block_size_bytes: u64,
    policy: PolicyKind,
    cache_size_bytes: u64,
    /// Block accesses offered, sampled or not (the miniatures' bias correction needs it).
    offered_accesses: AtomicU64,
    state: Mutex<WhatIf>,
}

/// Largest discard, in blocks, whose blocks are dropped from the miniatures.
const DISCARD_BLOCKS_MAX: u64 = 8192;

/// Bits of a key that hold the block number (4 KiB blocks of a 2^64-byte export need 52).
const BLOCK_BITS: u32 = 52;

impl WhatIfFeed {
    /// The feed for a cache of `cache_size_bytes` run by `policy` sampling about `rate` of the
    /// blocks, or `None` when the rate is 0 (off). A rate outside 0..=1 is refused naming the flag.
    pub fn start(
        rate: f64,
        policy: PolicyKind,
        cache_size_bytes: u64,
        block_size_bytes: u64,
        parameters: &PolicyParameters,
    ) -> anyhow::Result<Option<Arc<WhatIfFeed>>> {
        if !(0.0..=1.0).contains(&rate) {
            bail!("--whatif-sampling-rate {rate}: must be from 0 (off) to 1 (every block)");
        }
        if rate == 0.0 {
            return Ok(None);
        }
        let whatif = WhatIf::with_parameters(
            &[policy, PolicyKind::Lru],
            cache_size_bytes,
            block_size_bytes,
            rate,
            parameters,
        );
        tracing::info!(
            sampling_rate = whatif.sampling_rate(),
            "what-if miniature caches running"
        );
        Ok(Some(Arc::new(WhatIfFeed {
            threshold: whatif.threshold(),
            block_size_bytes: block_size_bytes.max(1),
            policy,
            cache_size_bytes,
            offered_accesses: AtomicU64::new(0),
            state: Mutex::new(whatif),
        })))
    }

    /// Feeds the blocks of one read or write; `discard` drops them instead.
    pub fn record(&self, export: u64, offset: u64, length: u64, discard: bool) {
        let first = offset / self.block_size_bytes;
        let last = offset.saturating_add(length.max(1) - 1) / self.block_size_bytes;
        // A discard may name a whole disk (mkfs trims everything): walking billions of block
        // numbers would stall the request, so large discards are not mirrored; the blocks
        // they name age out of the miniatures like any unused block.
        if discard && last - first >= DISCARD_BLOCKS_MAX {
            return;
        }
        if !discard {
            self.offered_accesses
                .fetch_add(last - first + 1, Ordering::Relaxed);
        }
        let mut state = None;
        for block in first..=last {
            let key = (export << BLOCK_BITS) | (block & ((1 << BLOCK_BITS) - 1));
            if self.threshold != u64::MAX && sampling_hash(key) >= self.threshold {
                continue;
            }
            let whatif =
                state.get_or_insert_with(|| self.state.lock().unwrap_or_else(|e| e.into_inner()));
            if discard {
                whatif.remove(key);
            } else {
                whatif.access_sampled(key);
            }
        }
    }

    fn snapshot(&self) -> (f64, Vec<WhatIfEstimate>) {
        let mut whatif = self.state.lock().unwrap_or_else(|e| e.into_inner());
        whatif.set_offered_accesses(self.offered_accesses.load(Ordering::Relaxed));
        (whatif.sampling_rate(), whatif.estimates())
    }

    /// The `/stats` section.
    pub fn json(&self) -> Value {
        let (rate, estimates) = self.snapshot();
        let rows: Vec<Value> = estimates
            .iter()
            .map(|estimate| {
                json!({
                    "policy": estimate.policy.name(),
                    "cache_size_bytes": estimate.cache_size_bytes,
                    "multiplier": estimate.multiplier,
                    "hit_ratio": estimate.hit_ratio,
                    "sampled_accesses": estimate.sampled_accesses,
                })
            })
            .collect();
        json!({
            "policy": self.policy.name(),
            "cache_size_bytes": self.cache_size_bytes,
            "sampling_rate": rate,
            "estimates": rows,
        })
    }

    /// The `/metrics` samples: gauge `bufcache_whatif_hit_ratio{policy,cache_size_bytes}`.
    pub fn prometheus(&self, text: &mut crate::exposition::Exposition) {
        let (_, estimates) = self.snapshot();
        for estimate in estimates {
            let labels = vec![
                ("policy".to_string(), estimate.policy.name().to_string()),
                (
                    "cache_size_bytes".to_string(),
                    estimate.cache_size_bytes.to_string(),
                ),
            ];
            text.gauge(
                "bufcache_whatif_hit_ratio",
                labels,
                estimate.hit_ratio,
                "Hit ratio a cache of this size and policy would have had, estimated by \
                 miniature simulation.",
            );
        }
    }
}

/// The readable what-if lines of `bufcache stat`, from the `/stats` section; empty when the
/// server runs without what-if or nothing was sampled yet.
pub fn stat_lines(stats: &Value) -> Vec<String> {
    let Some(section) = stats.get("whatif") else {
        return Vec::new();
    };
    let policy = section["policy"].as_str().unwrap_or("");
    let rows = section["estimates"].as_array().cloned().unwrap_or_default();
    let find = |name: &str, multiplier: f64| {
        rows.iter().find(|row| {
            row["policy"].as_str() == Some(name) && row["multiplier"].as_f64() == Some(multiplier)
        })
    };
    let mut lines = Vec::new();
    let Some(now) = find(policy, 1.0) else {
        return lines;
    };
    if now["sampled_accesses"].as_u64().unwrap_or(0) == 0 {
        return vec!["what-if: no block sampled yet".to_string()];
    }
    let now_ratio = now["hit_ratio"].as_f64().unwrap_or(0.0);
    lines.push(format!(
        "what-if ({policy}, miniature caches on {:.2}% of blocks, {} samples):",
        section["sampling_rate"].as_f64().unwrap_or(0.0) * 100.0,
        now["sampled_accesses"]
    ));
    for row in &rows {
        let multiplier = row["multiplier"].as_f64().unwrap_or(0.0);
        if row["policy"].as_str() != Some(policy) || multiplier == 1.0 {
            continue;
        }
        let size = format_size(row["cache_size_bytes"].as_u64().unwrap_or(0));
        let lru = find("lru", multiplier)
            .filter(|_| policy != "lru")
            .map(|lru| format!(" (lru {:.2})", lru["hit_ratio"].as_f64().unwrap_or(0.0)))
            .unwrap_or_default();
        lines.push(format!(
            "  at {}× memory ({size}): hit ratio {now_ratio:.2} → {:.2}{lru}",
            multiplier_text(multiplier),
            row["hit_ratio"].as_f64().unwrap_or(0.0)
        ));
    }
    lines
}

/// The live what-if curve from a `/stats` document: predicted hit ratio against cache size,
/// one curve per simulated policy. An error says why when there is nothing to draw.
pub fn whatif_plot(stats: &Value) -> anyhow::Result<crate::plot::CurvePlot> {
    let Some(section) = stats.get("whatif") else {
        bail!(
            "the server runs no what-if simulation (it was started with \
             --whatif-sampling-rate 0): nothing to plot"
        );
    };
    let rows = section["estimates"].as_array().cloned().unwrap_or_default();
    if rows
        .iter()
        .all(|row| row["sampled_accesses"].as_u64().unwrap_or(0) == 0)
    {
        bail!("the what-if caches have sampled no block yet: plot again after some I/O");
    }
    let configured_bytes = section["cache_size_bytes"].as_u64().unwrap_or(0);
    let bytes_max = rows
        .iter()
        .filter_map(|row| row["cache_size_bytes"].as_f64())
        .fold(0.0, f64::max);
    let (unit, unit_bytes) = crate::plot::size_unit(bytes_max);
    let mut names: Vec<&str> = Vec::new();
    for row in &rows {
        if let Some(name) = row["policy"].as_str() {
            if !names.contains(&name) {
                names.push(name);
            }
        }
    }
    let curves = names
        .iter()
        .map(|&name| {
            let mut points: Vec<(f64, f64)> = rows
                .iter()
                .filter(|row| row["policy"].as_str() == Some(name))
                .filter_map(|row| {
                    Some((
                        row["cache_size_bytes"].as_f64()? / unit_bytes,
                        row["hit_ratio"].as_f64()?,
                    ))
                })
                .collect();
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            crate::plot::Curve {
                name: name.to_string(),
                points,
            }
        })
        .collect();
    Ok(crate::plot::CurvePlot {
        title: format!(
            "Live what-if: {} cache now {}, {:.2}% of blocks sampled",
            section["policy"].as_str().unwrap_or("?"),
            format_size(configured_bytes),
            section["sampling_rate"].as_f64().unwrap_or(0.0) * 100.0
        ),
        x_label: format!("cache size ({unit})"),
        y_label: "hit ratio (predicted)".into(),
        curves,
        y_is_ratio: true,
    })
}

fn multiplier_text(multiplier: f64) -> String {
    if multiplier >= 1.0 {
        format!("{multiplier}")
    } else {
        format!("1/{}", (1.0 / multiplier).round())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whatif_plot_has_a_curve_per_policy_in_binary_units() {
        // Goal: `bufcache stat --plot` draws every simulated policy against real sizes, and
        // says why when there is nothing to draw. Method: feed a loop to a feed, plot its
        // /stats section; then plot sections without samples and without what-if.
        let feed = WhatIfFeed::start(
            1.0,
            PolicyKind::S3Fifo,
            256 * 4096,
            4096,
            &PolicyParameters::default(),
        )
        .unwrap()
        .unwrap();
        for round in 0..4 {
            for block in 0..300u64 {
                feed.record(0, (block + round) * 4096, 4096, false);
            }
        }
        let plot = whatif_plot(&json!({ "whatif": feed.json() })).unwrap();
        let names: Vec<&str> = plot
            .curves
            .iter()
            .map(|curve| curve.name.as_str())
            .collect();
        assert_eq!(names, ["s3fifo", "lru"]);
        assert_eq!(plot.x_label, "cache size (MiB)");
        let sizes: Vec<f64> = plot.curves[0].points.iter().map(|point| point.0).collect();
        assert!(sizes.contains(&1.0) && sizes.contains(&8.0), "{sizes:?}");
        let idle = WhatIfFeed::start(
            1.0,
            PolicyKind::Lru,
            256 * 4096,
            4096,
            &PolicyParameters::default(),
        )
        .unwrap()
        .unwrap();
        let error = whatif_plot(&json!({ "whatif": idle.json() })).unwrap_err();
        assert!(error.to_string().contains("no block yet"), "{error}");
        let error = whatif_plot(&json!({})).unwrap_err();
        assert!(
            error.to_string().contains("--whatif-sampling-rate 0"),
            "{error}"
        );
    }

    #[test]
    fn stat_prints_a_readable_line_per_size() {
        // Goal: `bufcache stat` turns the /stats section into sentences a person reads.
        // Method: feed a loop of 300 blocks to a feed sized for 256 blocks, render.
        let feed = WhatIfFeed::start(
            0.01,
            PolicyKind::S3Fifo,
            256 * 4096,
            4096,
            &PolicyParameters::default(),
        )
        .unwrap()
        .unwrap();
        for _ in 0..20 {
            for block in 0..300u64 {
                feed.record(0, block * 4096, 4096, false);
            }
        }
        let stats = json!({ "whatif": feed.json() });
        let lines = stat_lines(&stats);
        assert!(lines[0].contains("s3fifo"), "{lines:?}");
        let two = lines
            .iter()
            .find(|line| line.contains("at 2× memory (2MiB)"))
            .unwrap_or_else(|| panic!("{lines:?}"));
        assert!(two.contains("→ 0.95"), "the loop fits at 2×: {two}");
        let mut exposition = crate::exposition::Exposition::default();
        feed.prometheus(&mut exposition);
        let text = exposition.render();
        assert!(
            text.contains("bufcache_whatif_hit_ratio{policy=\"lru\",cache_size_bytes=\"2097152\"}"),
            "{text}"
        );
    }

    #[test]
    fn small_discards_drop_blocks_and_whole_disk_discards_are_skipped() {
        // Goal: a discarded block is no longer a hit in the miniatures, and a discard of a
        // whole disk (mkfs) does not walk billions of block numbers on the request path.
        // Method: cache two blocks (rate 1), discard one with a small range and the other
        // with a 1 TiB range; read both again and count the hits.
        let feed = WhatIfFeed::start(
            1.0,
            PolicyKind::Lru,
            256 * 4096,
            4096,
            &PolicyParameters::default(),
        )
        .unwrap()
        .unwrap();
        feed.record(0, 0, 8192, false);
        feed.record(0, 0, 4096, true);
        feed.record(0, 0, 1 << 40, true);
        feed.record(0, 0, 8192, false);
        let estimates = feed.snapshot().1;
        let at_one = estimates
            .iter()
            .find(|estimate| estimate.multiplier == 1.0)
            .unwrap();
        // 4 accesses: 2 cold misses, block 0 missed again (discarded), block 1 hit.
        assert_eq!(at_one.sampled_accesses, 4);
        assert!((at_one.hit_ratio - 0.25).abs() < 1e-9, "{at_one:?}");
    }
}
