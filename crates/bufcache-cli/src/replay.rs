//! `bufcache replay`: miss-ratio curves of replacement policies over a block I/O trace.
//!
//! The trace is read once (streamed, then held as compact accesses) and replayed through each
//! policy × cache size with the policy crate's single-threaded simulator, in parallel across
//! combinations. By default a request is split into the blocks it covers and the cache size is
//! in bytes (or blocks, for a bare number); with `--no-split` each request is one unit-size
//! object keyed by its starting block and the cache size counts objects — libCacheSim's way,
//! so results compare with it exactly. Reads and writes are both accesses; a miss inserts.

use std::path::PathBuf;
use std::sync::Mutex;

use anyhow::{bail, Context};

use crate::BadInput;
use bufcache::parse_size;
use bufcache_policy::offline::{belady, ShardsCurve};
use bufcache_policy::simulate::Simulator;
use bufcache_policy::{PolicyKind, PolicyParameters};
use bufcache_trace::{open_trace, Operation, TraceFormat, TraceOptions};
use clap::Args;

/// Arguments of `bufcache replay`.
#[derive(Args, Debug)]
#[command(after_help = "Examples:\n  \
    bufcache replay cloudPhysicsIO.vscsi --format vscsi --policy lru,s3fifo,arc --cache-size 16MiB,64MiB,256MiB\n  \
    bufcache replay trace.csv --format csv --trace-options \"time-col=2,obj-id-col=5,obj-size-col=4,op-col=3,has-header=true,delimiter=,\" \\\n      \
    --policy lru,sieve --cache-size 1000,5000 --no-split --json\n  \
    bufcache replay cloudPhysicsIO.vscsi --format vscsi --policy lru,s3fifo,opt --cache-size 16MiB,64MiB\n  \
    bufcache replay big.oracleGeneral --mrc shards --sampling-rate 0.001 --cache-size 1GiB,4GiB,16GiB\n\n\
    Formats: csv, blkparse, msr, fio, oracle-general, vscsi. Policies: lru, fifo, clock, 2q, arc, s3fifo, sieve, opt.")]
pub struct ReplayArgs {
    /// The trace file.
    trace: PathBuf,
    /// Trace format (csv, blkparse, msr, fio, oracle-general, vscsi); guessed when omitted.
    #[arg(long)]
    format: Option<TraceFormat>,
    /// Reader options in libCacheSim's syntax, for example "time-col=2,obj-id-col=5,...".
    #[arg(long, default_value = "")]
    trace_options: String,
    /// Policies, comma separated; `opt` is Belady's optimal policy (a lower bound on misses,
    /// computed in two passes). Default s3fifo (lru with --mrc shards).
    #[arg(long, value_delimiter = ',')]
    policy: Vec<ReplayPolicy>,
    /// How the curve is computed: `exact` simulates every policy × size; `shards` estimates
    /// LRU's curve for all sizes in one pass over a spatially hashed sample of the keys
    /// (SHARDS, Waldspurger et al. FAST '15), for large traces.
    #[arg(long, value_enum, default_value_t = MrcMethod::Exact)]
    mrc: MrcMethod,
    /// Fraction of keys sampled by --mrc shards (0 < RATE <= 1).
    #[arg(long, value_name = "RATE", default_value_t = 0.01)]
    sampling_rate: f64,
    /// Cache sizes, comma separated: bytes with a unit (4k, 64MiB), or a bare number of blocks
    /// (of objects with --no-split).
    #[arg(long, required = true, value_delimiter = ',')]
    cache_size: Vec<String>,
    /// Block size for splitting requests. Default 4k.
    #[arg(long, default_value = "4k")]
    block_size: String,
    /// One unit-size object per request, keyed by its starting block (libCacheSim's counting).
    #[arg(long)]
    no_split: bool,
    /// Print a JSON array instead of a table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    parameters: PolicyParameterArgs,
    /// Also draw the miss-ratio curves (miss ratio per cache size, a line per policy): an
    /// SVG file, or PNG when the name ends in .png; any other extension is refused.
    #[arg(long, value_name = "FILE.svg|FILE.png", value_parser = crate::plot::parse_plot_path)]
    plot: Option<PathBuf>,
}

/// Parameters of the policies that have them. Defaults are libCacheSim's, so results at the
/// defaults compare with it; each flag gives libCacheSim's name for the parameter.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Policy parameters (libCacheSim's defaults)")]
pub struct PolicyParameterArgs {
    /// S3-FIFO: the small FIFO's share of the cache (libCacheSim fifo-size-ratio); above 0
    /// and below 1.
    #[arg(long = "s3fifo-small-queue-ratio", value_name = "RATIO", allow_negative_numbers = true, default_value_t = PolicyParameters::default().s3fifo_small_queue_ratio)]
    s3fifo_small_queue_ratio: f64,
    /// S3-FIFO: ghost entries kept, as a fraction of the cache (ghost-size-ratio); 0 (none)
    /// to 10.
    #[arg(long = "s3fifo-ghost-size-ratio", value_name = "RATIO", allow_negative_numbers = true, default_value_t = PolicyParameters::default().s3fifo_ghost_size_ratio)]
    s3fifo_ghost_size_ratio: f64,
    /// S3-FIFO: hits in the small FIFO that move an entry to the main one instead of evicting
    /// it (move-to-main-threshold); 0 to 3.
    #[arg(long = "s3fifo-move-to-main-threshold", value_name = "HITS", default_value_t = PolicyParameters::default().s3fifo_move_to_main_threshold)]
    s3fifo_move_to_main_threshold: u8,
    /// 2Q: Kin, the A1in FIFO's share of the cache (Ain-size-ratio); above 0 and below 1.
    #[arg(long = "2q-ain-size-ratio", value_name = "RATIO", allow_negative_numbers = true, default_value_t = PolicyParameters::default().two_q_ain_size_ratio)]
    two_q_ain_size_ratio: f64,
    /// 2Q: Kout, the A1out ghost's size as a fraction of the cache (Aout-size-ratio); 0 (none)
    /// to 10.
    #[arg(long = "2q-aout-size-ratio", value_name = "RATIO", allow_negative_numbers = true, default_value_t = PolicyParameters::default().two_q_aout_size_ratio)]
    two_q_aout_size_ratio: f64,
    /// CLOCK: bits of each entry's reference counter (n-bit-counter); an entry survives up to
    /// 2^BITS - 1 passes of the hand after its hits. 1 to 8.
    #[arg(long = "clock-bits", value_name = "BITS", default_value_t = PolicyParameters::default().clock_bits)]
    clock_bits: u8,
}

impl Default for PolicyParameterArgs {
    fn default() -> Self {
        let defaults = PolicyParameters::default();
        PolicyParameterArgs {
            s3fifo_small_queue_ratio: defaults.s3fifo_small_queue_ratio,
            s3fifo_ghost_size_ratio: defaults.s3fifo_ghost_size_ratio,
            s3fifo_move_to_main_threshold: defaults.s3fifo_move_to_main_threshold,
            two_q_ain_size_ratio: defaults.two_q_ain_size_ratio,
            two_q_aout_size_ratio: defaults.two_q_aout_size_ratio,
            clock_bits: defaults.clock_bits,
        }
    }
}

impl PolicyParameterArgs {
    /// The flags whose value differs from the default, as `--flag value`, for the log.
    fn changed(&self) -> Vec<String> {
        let defaults = PolicyParameters::default();
        let flags = [
            (
                "s3fifo-small-queue-ratio",
                self.s3fifo_small_queue_ratio,
                defaults.s3fifo_small_queue_ratio,
            ),
            (
                "s3fifo-ghost-size-ratio",
                self.s3fifo_ghost_size_ratio,
                defaults.s3fifo_ghost_size_ratio,
            ),
            (
                "s3fifo-move-to-main-threshold",
                f64::from(self.s3fifo_move_to_main_threshold),
                f64::from(defaults.s3fifo_move_to_main_threshold),
            ),
            (
                "2q-ain-size-ratio",
                self.two_q_ain_size_ratio,
                defaults.two_q_ain_size_ratio,
            ),
            (
                "2q-aout-size-ratio",
                self.two_q_aout_size_ratio,
                defaults.two_q_aout_size_ratio,
            ),
            (
                "clock-bits",
                f64::from(self.clock_bits),
                f64::from(defaults.clock_bits),
            ),
        ];
        flags
            .iter()
            .filter(|(_, value, default)| value != default)
            .map(|(name, value, _)| format!("--{name} {value}"))
            .collect()
    }

    /// The parameters, checked: a value out of range is an error naming its flag.
    pub fn parameters(&self) -> Result<PolicyParameters, BadInput> {
        let parameters = PolicyParameters {
            s3fifo_small_queue_ratio: self.s3fifo_small_queue_ratio,
            s3fifo_ghost_size_ratio: self.s3fifo_ghost_size_ratio,
            s3fifo_move_to_main_threshold: self.s3fifo_move_to_main_threshold,
            two_q_ain_size_ratio: self.two_q_ain_size_ratio,
            two_q_aout_size_ratio: self.two_q_aout_size_ratio,
            clock_bits: self.clock_bits,
        };
        parameters
            .validate()
            .map_err(|error| BadInput(error.to_string()))?;
        Ok(parameters)
    }
}

/// How `bufcache replay` computes the miss-ratio curve.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum MrcMethod {
    /// A full simulation per policy and cache size.
    Exact,
    /// SHARDS: LRU only, one sampled pass for all sizes.
    Shards,
}

/// A policy `bufcache replay` can run: an online policy, or Belady's offline optimum.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ReplayPolicy {
    Online(PolicyKind),
    Opt,
}

impl ReplayPolicy {
    fn name(self) -> &'static str {
        match self {
            ReplayPolicy::Online(kind) => kind.name(),
            ReplayPolicy::Opt => "opt",
        }
    }
}

impl std::str::FromStr for ReplayPolicy {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if text.trim().eq_ignore_ascii_case("opt") {
            return Ok(ReplayPolicy::Opt);
        }
        text.parse::<PolicyKind>()
            .map(ReplayPolicy::Online)
            .map_err(|error| format!("{error}, opt"))
    }
}

/// One access of the replay: a key and the bytes of the request it stands for.
#[derive(Clone, Copy)]
struct Access {
    key: u64,
    bytes: u32,
}

/// One row of the miss-ratio curve.
#[derive(Clone, Debug)]
struct Row {
    policy: ReplayPolicy,
    cache_size: String,
    capacity_units: u64,
    requests: u64,
    accesses: u64,
    misses: u64,
    bytes: u64,
    missed_bytes: u64,
    /// SHARDS rows: the estimated miss ratio (their miss and byte counts are not measured).
    estimated_miss_ratio: Option<f64>,
}

pub fn run(args: ReplayArgs) -> anyhow::Result<()> {
    let format = match args.format {
        Some(format) => format,
        None => TraceFormat::guess(&args.trace).map_err(|error| match error {
            // Unreadable is unreadable: --format would not help.
            bufcache_trace::TraceError::Io { .. } => anyhow::Error::new(error),
            other => anyhow::Error::new(other).context("pass --format"),
        })?,
    };
    let options: TraceOptions = captured_trace_options(&args, format)
        .parse()
        .context("--trace-options")?;
    let parameters = args.parameters.parameters()?;
    let changed = args.parameters.changed();
    if !changed.is_empty() {
        eprintln!(
            "bufcache: policy parameters {} (libCacheSim's defaults otherwise)",
            changed.join(" ")
        );
    }
    let block_size = parse_size(&args.block_size).context("--block-size")?;
    if block_size == 0 || block_size > 1 << 30 {
        bail!(
            "--block-size {}: must be from 1 byte to 1GiB",
            args.block_size
        );
    }
    let capacities = args
        .cache_size
        .iter()
        .map(|text| {
            capacity_units(text, block_size, args.no_split).map(|units| (text.clone(), units))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut args = args;
    if args.policy.is_empty() {
        args.policy = vec![match args.mrc {
            MrcMethod::Exact => ReplayPolicy::Online(PolicyKind::S3Fifo),
            MrcMethod::Shards => ReplayPolicy::Online(PolicyKind::Lru),
        }];
    }
    if args.mrc == MrcMethod::Shards {
        if args.policy != [ReplayPolicy::Online(PolicyKind::Lru)] {
            return Err(BadInput(
                "--mrc shards estimates LRU's curve only: pass --policy lru (or omit --policy)"
                    .into(),
            )
            .into());
        }
        if !(args.sampling_rate > 0.0 && args.sampling_rate <= 1.0) {
            return Err(BadInput(format!(
                "--sampling-rate {}: must be above 0 and at most 1",
                args.sampling_rate
            ))
            .into());
        }
    }
    let (accesses, requests) = load(&args, format, &options, block_size)?;
    let rows = match args.mrc {
        MrcMethod::Exact => {
            let mut combinations = Vec::new();
            for &policy in &args.policy {
                for (text, units) in &capacities {
                    combinations.push((policy, text.clone(), *units));
                }
            }
            replay_all(&accesses, requests, &combinations, &parameters)
        }
        MrcMethod::Shards => shards_rows(&accesses, requests, &capacities, args.sampling_rate),
    };
    if let Some(path) = &args.plot {
        miss_ratio_plot(&rows, &args, block_size).write(path)?;
        eprintln!("bufcache: wrote {}", path.display());
    }
    if args.json {
        print_json(&rows);
    } else {
        print_table(&rows, args.no_split);
    }
    Ok(())
}

/// Miss ratio against cache size, one curve per policy. Sizes are in a binary unit fitted to
/// the largest (blocks times the block size), or in objects with --no-split.
/// The reader options: the user's, or, when none are given for a CSV file that `serve --trace`
/// wrote, the ones that read it (said on standard error).
fn captured_trace_options(args: &ReplayArgs, format: TraceFormat) -> String {
    if args.trace_options.is_empty()
        && format == TraceFormat::Csv
        && crate::trace_capture::is_capture(&args.trace)
    {
        eprintln!(
            "bufcache: {} is a `serve --trace` capture: reading it with --trace-options \"{}\"",
            args.trace.display(),
            crate::trace_capture::REPLAY_OPTIONS
        );
        return crate::trace_capture::REPLAY_OPTIONS.to_string();
    }
    args.trace_options.clone()
}

fn miss_ratio_plot(rows: &[Row], args: &ReplayArgs, block_size: u64) -> crate::plot::CurvePlot {
    let bytes_max = rows
        .iter()
        .map(|row| row.capacity_units as f64 * block_size as f64)
        .fold(0.0, f64::max);
    let (unit, unit_value) = if args.no_split {
        ("objects", 1.0)
    } else {
        let (unit, unit_bytes) = crate::plot::size_unit(bytes_max);
        (unit, unit_bytes / block_size as f64)
    };
    let curves = args
        .policy
        .iter()
        .map(|policy| {
            let mut points: Vec<(f64, f64)> = rows
                .iter()
                .filter(|row| row.policy == *policy)
                .map(|row| (row.capacity_units as f64 / unit_value, row.miss_ratio()))
                .collect();
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            crate::plot::Curve {
                name: policy.name().to_string(),
                points,
            }
        })
        .collect();
    let method = match args.mrc {
        MrcMethod::Exact => "",
        MrcMethod::Shards => " (SHARDS estimate)",
    };
    crate::plot::CurvePlot {
        title: format!(
            "Miss-ratio curve{method}: {}",
            args.trace
                .file_name()
                .map(|n| n.to_string_lossy().to_string())
                .unwrap_or_default()
        ),
        x_label: format!("cache size ({unit})"),
        y_label: if args.no_split {
            "miss ratio (per request)".into()
        } else {
            "miss ratio (per block)".into()
        },
        curves,
        y_is_ratio: true,
    }
}

fn capacity_units(text: &str, block_size: u64, no_split: bool) -> anyhow::Result<u64> {
    let bare = text.trim().chars().all(|c| c.is_ascii_digit());
    let units = if bare {
        text.trim()
            .parse::<u64>()
            .with_context(|| format!("--cache-size `{text}`"))?
    } else if no_split {
        bail!("--cache-size `{text}`: with --no-split the cache size counts objects; give a bare number");
    } else {
        parse_size(text).with_context(|| format!("--cache-size `{text}`"))? / block_size
    };
    if units == 0 {
        bail!("--cache-size `{text}`: holds no block of {block_size} bytes; give a larger size");
    }
    Ok(units)
}

/// Reads the whole trace into accesses; returns them and the number of requests.
///
/// A CSV trace without `op-col` (libCacheSim's common `time,obj_id,size` layout) says nothing
/// about operations, so every request counts as a read, and a note on standard error says so.
/// Requests that are neither reads nor writes (flush, trim, unknown opcodes) are skipped and
/// counted; a trace that leaves no request is an error saying which of these happened.
fn load(
    args: &ReplayArgs,
    format: TraceFormat,
    options: &TraceOptions,
    block_size: u64,
) -> anyhow::Result<(Vec<Access>, u64)> {
    let stream = open_trace(&args.trace, format, options).map_err(BadInput::from)?;
    let no_operation_column = format == TraceFormat::Csv && options.operation_column.is_none();
    if no_operation_column {
        eprintln!(
            "bufcache: {}: no op-col in --trace-options, so every request counts as a read",
            args.trace.display()
        );
    }
    let mut accesses = Vec::new();
    let mut requests = 0u64;
    let mut skipped = 0u64;
    let progress = indicatif::ProgressBar::new_spinner()
        .with_message(format!("reading {}", args.trace.display()));
    for request in stream {
        let request = request.map_err(BadInput::from)?;
        if requests.is_multiple_of(65_536) {
            progress.set_position(requests);
        }
        if request.operation == Operation::Other && !no_operation_column {
            skipped += 1;
            continue;
        }
        requests += 1;
        if args.no_split {
            accesses.push(Access {
                key: request.object_id,
                bytes: request.length_bytes.min(u32::MAX as u64) as u32,
            });
            continue;
        }
        let start = request.offset_bytes;
        let end = start + request.length_bytes.max(1);
        let mut block = start / block_size;
        while block * block_size < end {
            let block_start = block * block_size;
            let covered = end.min(block_start + block_size) - start.max(block_start);
            accesses.push(Access {
                key: block,
                bytes: covered as u32,
            });
            block += 1;
        }
    }
    progress.finish_and_clear();
    if requests == 0 {
        let why = if skipped == 0 {
            "the trace holds no request (empty, or only a header and blank lines)".to_string()
        } else {
            format!(
                "all {skipped} requests are neither reads nor writes (flush, trim or an unknown \
                 op); check op-col in --trace-options"
            )
        };
        return Err(BadInput(format!(
            "{}: nothing to replay: {why}",
            args.trace.display()
        ))
        .into());
    }
    if skipped > 0 {
        eprintln!(
            "bufcache: {}: skipped {skipped} requests that are neither reads nor writes",
            args.trace.display()
        );
    }
    Ok((accesses, requests))
}

/// LRU rows estimated by SHARDS from one pass over the sampled keys.
fn shards_rows(
    accesses: &[Access],
    requests: u64,
    capacities: &[(String, u64)],
    rate: f64,
) -> Vec<Row> {
    let keys: Vec<u64> = accesses.iter().map(|access| access.key).collect();
    let curve = ShardsCurve::build(&keys, rate);
    eprintln!(
        "bufcache: SHARDS sampled {} of {} accesses (rate {rate})",
        curve.sampled(),
        keys.len()
    );
    capacities
        .iter()
        .map(|(text, units)| {
            let miss_ratio = curve.miss_ratio(*units);
            Row {
                policy: ReplayPolicy::Online(PolicyKind::Lru),
                cache_size: text.clone(),
                capacity_units: *units,
                requests,
                accesses: keys.len() as u64,
                misses: (miss_ratio * keys.len() as f64).round() as u64,
                bytes: 0,
                missed_bytes: 0,
                estimated_miss_ratio: Some(miss_ratio),
            }
        })
        .collect()
}

fn replay_all(
    accesses: &[Access],
    requests: u64,
    combinations: &[(ReplayPolicy, String, u64)],
    parameters: &PolicyParameters,
) -> Vec<Row> {
    let next = Mutex::new(0usize);
    let rows = Mutex::new(Vec::new());
    let progress = indicatif::ProgressBar::new(combinations.len() as u64).with_message("replaying");
    let workers = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .min(combinations.len().max(1));
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| loop {
                let index = {
                    let mut next = next.lock().unwrap();
                    let index = *next;
                    *next += 1;
                    index
                };
                let Some((policy, text, units)) = combinations.get(index) else {
                    return;
                };
                let row = replay_one(accesses, requests, *policy, text, *units, parameters);
                rows.lock().unwrap().push((index, row));
                progress.inc(1);
            });
        }
    });
    progress.finish_and_clear();
    let mut rows = rows.into_inner().unwrap();
    rows.sort_by_key(|(index, _)| *index);
    rows.into_iter().map(|(_, row)| row).collect()
}

fn replay_one(
    accesses: &[Access],
    requests: u64,
    policy: ReplayPolicy,
    text: &str,
    units: u64,
    parameters: &PolicyParameters,
) -> Row {
    let bytes = accesses.iter().map(|access| access.bytes as u64).sum();
    let mut misses = 0u64;
    let mut missed_bytes = 0u64;
    match policy {
        ReplayPolicy::Online(kind) => {
            let mut simulator = Simulator::with_parameters(kind, units as usize, parameters);
            for access in accesses {
                if !simulator.access(access.key) {
                    missed_bytes += access.bytes as u64;
                }
            }
            misses = simulator.misses();
        }
        ReplayPolicy::Opt => {
            let keys: Vec<u64> = accesses.iter().map(|access| access.key).collect();
            belady(&keys, units as usize, |index, hit| {
                if !hit {
                    misses += 1;
                    missed_bytes += accesses[index].bytes as u64;
                }
            });
        }
    }
    Row {
        policy,
        cache_size: text.to_string(),
        capacity_units: units,
        requests,
        accesses: accesses.len() as u64,
        misses,
        bytes,
        missed_bytes,
        estimated_miss_ratio: None,
    }
}

impl Row {
    /// Misses per access (per block when splitting, per request with --no-split).
    fn miss_ratio(&self) -> f64 {
        self.estimated_miss_ratio
            .unwrap_or(self.misses as f64 / self.accesses.max(1) as f64)
    }

    /// Missed bytes per requested byte (not known for SHARDS estimates).
    fn byte_miss_ratio(&self) -> Option<f64> {
        if self.estimated_miss_ratio.is_some() {
            return None;
        }
        Some(self.missed_bytes as f64 / self.bytes.max(1) as f64)
    }
}

fn print_table(rows: &[Row], no_split: bool) {
    let unit = if no_split { "objects" } else { "blocks" };
    println!(
        "{:<8} {:>12} {:>12} {:>10} {:>12} {:>10} {:>15}",
        "policy", "cache size", unit, "requests", "misses", "miss ratio", "byte miss ratio"
    );
    for row in rows {
        println!(
            "{:<8} {:>12} {:>12} {:>10} {:>12} {:>10.4} {:>15}",
            row.policy.name(),
            row.cache_size,
            row.capacity_units,
            row.requests,
            row.misses,
            row.miss_ratio(),
            row.byte_miss_ratio()
                .map(|ratio| format!("{ratio:.4}"))
                .unwrap_or_else(|| "-".into())
        );
    }
}

fn print_json(rows: &[Row]) {
    let values: Vec<serde_json::Value> = rows
        .iter()
        .map(|row| {
            serde_json::json!({
                "policy": row.policy.name(),
                "cache_size": row.cache_size,
                "requests": row.requests,
                "misses": row.misses,
                "miss_ratio": row.miss_ratio(),
                "byte_miss_ratio": row.byte_miss_ratio(),
            })
        })
        .collect();
    println!(
        "{}",
        serde_json::to_string_pretty(&values).expect("JSON of plain values")
    );
}
