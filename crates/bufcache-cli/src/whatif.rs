//! Live what-if for `serve`: the request stream of every export, cut into block keys, feeds
//! miniature simulations ([`bufcache_policy::whatif`]) of the configured policy and LRU at
//! ¼…8× the configured cache size. Results go to `/metrics`, `/stats` and `bufcache stat`.
//!
//! The feed sits at the NBD export adapter ([`WhatIfExport`] wraps any [`Export`]), so the
//! engine is untouched and sees no extra work. Hot path per request: for each block it covers,
//! one hash and a compare; only a sampled block (about 1 in 100 by default) takes the lock
//! around the miniatures. Keys are `export << 52 | block`, so exports never share a key.

use std::sync::{Arc, Mutex};

use anyhow::bail;
use bufcache::format_size;
use bufcache_nbd::{BlockStatusExtent, Export};
use bufcache_policy::whatif::{sampling_hash, WhatIf, WhatIfEstimate};
use bufcache_policy::PolicyKind;
use clap::Args;
use serde_json::{json, Value};

/// Serve flags of the live what-if.
#[derive(Args, Debug, Clone)]
pub struct WhatIfArgs {
    /// Fraction of blocks (chosen by a hash of their address) fed to the what-if miniature
    /// caches (the configured policy and LRU at 1/4, 1/2, 1, 2, 4, 8 times --cache-size).
    /// Raised so the 1x miniature holds at least 1024 blocks, lowered so it holds at most
    /// 2048 (a few MiB in all). 0 turns the what-if off.
    #[arg(long, value_name = "RATE", default_value_t = 0.01)]
    pub whatif_sampling_rate: f64,
}

/// The miniature caches of one server and what they need to cut requests into keys.
pub struct WhatIfFeed {
    threshold: u64,
    block_size_bytes: u64,
    policy: PolicyKind,
    cache_size_bytes: u64,
    state: Mutex<WhatIf>,
}

/// Bits of a key that hold the block number (4 KiB blocks of a 2^64-byte export need 52).
const BLOCK_BITS: u32 = 52;

impl WhatIfFeed {
    /// The feed for a cache of `cache_size_bytes` run by `policy`, or `None` when the flag
    /// turns it off. A rate outside 0..=1 is refused naming the flag.
    pub fn start(
        args: &WhatIfArgs,
        policy: PolicyKind,
        cache_size_bytes: u64,
        block_size_bytes: u64,
    ) -> anyhow::Result<Option<Arc<WhatIfFeed>>> {
        let rate = args.whatif_sampling_rate;
        if !(0.0..=1.0).contains(&rate) {
            bail!("--whatif-sampling-rate {rate}: must be from 0 (off) to 1 (every block)");
        }
        if rate == 0.0 {
            return Ok(None);
        }
        let whatif = WhatIf::new(
            &[policy, PolicyKind::Lru],
            cache_size_bytes,
            block_size_bytes,
            rate,
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
            state: Mutex::new(whatif),
        })))
    }

    /// Feeds the blocks of one read or write; `discard` drops them instead.
    pub fn record(&self, export: u64, offset: u64, length: u64, discard: bool) {
        let first = offset / self.block_size_bytes;
        let last = offset.saturating_add(length.max(1) - 1) / self.block_size_bytes;
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
        let whatif = self.state.lock().unwrap_or_else(|e| e.into_inner());
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

    /// The `/metrics` lines: gauge `bufcache_whatif_hit_ratio{policy,cache_size_bytes}`.
    pub fn prometheus(&self, text: &mut String) {
        let (_, estimates) = self.snapshot();
        text.push_str(
            "# HELP bufcache_whatif_hit_ratio Hit ratio a cache of this size and policy would \
             have had, estimated by miniature simulation.\n\
             # TYPE bufcache_whatif_hit_ratio gauge\n",
        );
        for estimate in estimates {
            text.push_str(&format!(
                "bufcache_whatif_hit_ratio{{policy=\"{}\",cache_size_bytes=\"{}\"}} {}\n",
                estimate.policy.name(),
                estimate.cache_size_bytes,
                estimate.hit_ratio
            ));
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

fn multiplier_text(multiplier: f64) -> String {
    if multiplier >= 1.0 {
        format!("{multiplier}")
    } else {
        format!("1/{}", (1.0 / multiplier).round())
    }
}

/// An export whose reads, writes and discards also feed the what-if miniatures.
pub struct WhatIfExport {
    inner: Arc<dyn Export>,
    feed: Arc<WhatIfFeed>,
    export: u64,
}

/// Wraps `inner` (the `export`-th export) so it feeds `feed`; returns it unchanged when
/// the what-if is off.
pub fn wrap(
    feed: &Option<Arc<WhatIfFeed>>,
    export: usize,
    inner: Arc<dyn Export>,
) -> Arc<dyn Export> {
    match feed {
        Some(feed) => Arc::new(WhatIfExport {
            inner,
            feed: Arc::clone(feed),
            export: export as u64,
        }),
        None => inner,
    }
}

impl Export for WhatIfExport {
    fn size(&self) -> u64 {
        self.inner.size()
    }

    fn read_only(&self) -> bool {
        self.inner.read_only()
    }

    fn description(&self) -> String {
        self.inner.description()
    }

    fn preferred_block_size(&self) -> u32 {
        self.inner.preferred_block_size()
    }

    fn read(&self, offset: u64, buffer: &mut [u8]) -> std::io::Result<()> {
        self.feed
            .record(self.export, offset, buffer.len() as u64, false);
        self.inner.read(offset, buffer)
    }

    fn write(&self, offset: u64, data: &[u8], fua: bool) -> std::io::Result<()> {
        self.feed
            .record(self.export, offset, data.len() as u64, false);
        self.inner.write(offset, data, fua)
    }

    fn flush(&self) -> std::io::Result<()> {
        self.inner.flush()
    }

    fn trim(&self, offset: u64, length: u64, fua: bool) -> std::io::Result<()> {
        self.feed.record(self.export, offset, length, true);
        self.inner.trim(offset, length, fua)
    }

    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        may_trim: bool,
        fast_only: bool,
        fua: bool,
    ) -> std::io::Result<()> {
        self.inner
            .write_zeroes(offset, length, may_trim, fast_only, fua)
    }

    fn can_fast_zero(&self) -> bool {
        self.inner.can_fast_zero()
    }

    fn cache(&self, offset: u64, length: u64) -> std::io::Result<()> {
        self.inner.cache(offset, length)
    }

    fn read_is_quick(&self, offset: u64, length: u64) -> bool {
        self.inner.read_is_quick(offset, length)
    }

    fn open_connection(&self) -> Option<Arc<dyn Export>> {
        self.inner.open_connection().map(|inner| {
            Arc::new(WhatIfExport {
                inner,
                feed: Arc::clone(&self.feed),
                export: self.export,
            }) as Arc<dyn Export>
        })
    }

    fn block_status(&self, offset: u64, length: u64) -> std::io::Result<Vec<BlockStatusExtent>> {
        self.inner.block_status(offset, length)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_prints_a_readable_line_per_size() {
        // Goal: `bufcache stat` turns the /stats section into sentences a person reads.
        // Method: feed a loop of 300 blocks to a feed sized for 256 blocks, render.
        let args = WhatIfArgs {
            whatif_sampling_rate: 0.01,
        };
        let feed = WhatIfFeed::start(&args, PolicyKind::S3Fifo, 256 * 4096, 4096)
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
        let mut text = String::new();
        feed.prometheus(&mut text);
        assert!(
            text.contains("bufcache_whatif_hit_ratio{policy=\"lru\",cache_size_bytes=\"2097152\"}"),
            "{text}"
        );
    }
}
