//! `bufcache sim`: the seed experiments and custom runs of the engine on modelled disks, on a
//! virtual clock (the `bufcache-sim` crate). Everything printed is deterministic for a seed.

use std::path::PathBuf;

use anyhow::Context;
use bufcache::QueueMode;
use bufcache_sim::experiments::run_custom_with;
use bufcache_sim::{
    host_for, run_experiment, sim_cache_config, DiskSpec, ExperimentOptions, SimConfig, SimIoQueue,
    WorkloadSpec, EXPERIMENTS, SERVE_BACKGROUND_WORKERS,
};
use clap::{Args, Subcommand};

use crate::engine_args::EngineArgs;

/// What `sim check` checks.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum CheckLayout {
    /// The engine's durability contract on simulated disks.
    Engine,
    /// The S3 log layout over a simulated object store.
    Log,
}

/// How many servers `sim check --layout log` puts on one disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ServerCount {
    /// `N` servers on every seed (1, 2 or 3).
    Exactly(u32),
    /// `2-3`: each seed picks two or three.
    TwoOrThree,
}

fn parse_server_count(text: &str) -> Result<ServerCount, String> {
    match text {
        "1" => Ok(ServerCount::Exactly(1)),
        "2" => Ok(ServerCount::Exactly(2)),
        "3" => Ok(ServerCount::Exactly(3)),
        "2-3" => Ok(ServerCount::TwoOrThree),
        _ => Err(format!(
            "`{text}`: give 1, 2, 3 or 2-3 (servers on one disk)"
        )),
    }
}

/// Arguments of `bufcache sim`.
#[derive(Args, Debug)]
pub struct SimArgs {
    #[command(subcommand)]
    command: SimCommand,
}

#[derive(Subcommand, Debug)]
enum SimCommand {
    /// List the experiments.
    List,
    /// Run a seed experiment: prints its figures beside the seed's, its table, and writes
    /// NAME.txt, .csv, .comparison.csv, .json (with a `comparison` list), .svg and .png.
    #[command(after_help = "Examples:\n  \
        bufcache sim experiment maxbsize            # seed 000: MAXBSIZE 16K vs 64K on an RZ25\n  \
        bufcache sim experiment sweep --scale 0.25  # seed 003's read sweep, smaller and faster\n  \
        bufcache sim experiment scan --json")]
    Experiment {
        /// Experiment name (see `bufcache sim list`).
        name: String,
        /// Print JSON instead of the table.
        #[arg(long)]
        json: bool,
        /// Shrink (below 1) or grow files and memory together; above 0, at most 16.
        #[arg(long, default_value_t = 1.0)]
        scale: f64,
        /// Seed of the deterministic schedule.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Directory for the CSV, JSON and SVG files.
        #[arg(long, default_value = "sim-results")]
        output: PathBuf,
    },
    /// Deterministic simulation testing: seeded random workloads (several clients; reads,
    /// writes, FUA, zeroes, discards, flushes; tiny caches; device faults; crashes; shutdowns
    /// during a store outage saving rescue files, and restarts that must replay them, or refuse
    /// them once another server opened the disk) through the real engine, checked against a
    /// shadow model of the durability contract. Prints the seed of every violation and `N
    /// seeds, V violations`; exits 1 on a violation.
    #[command(after_help = "Examples:\n  \
        bufcache sim check --seeds 1000            # seeds 1 to 1000\n  \
        bufcache sim check --seeds 1 --seed 4711   # replay one seed\n  \
        bufcache sim check --seeds 1 --seed 4711 --trace   # every step of it\n  \
        bufcache sim check --local-tier --seeds 10000      # the local tier: log + remote\n  \
        bufcache sim check --layout log --seeds 2000       # the S3 log layout's crash consistency\n  \
        bufcache sim check --layout log --servers 2-3 --seeds 2000   # failover under the lease")]
    Check {
        /// How many seeds to run.
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..))]
        seeds: u64,
        /// The first seed; seeds SEED, SEED+1, ... are run.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Print every step of every seed to standard error (for replaying one seed).
        #[arg(long)]
        trace: bool,
        /// Check the persistent local tier instead of the engine: a simulated local device
        /// (the log) and a remote, remote faults, machine crashes and the loss of the local
        /// device; asserts no acknowledged write is lost and the remote is always an epoch
        /// prefix (docs/local-tier.md).
        #[arg(long)]
        local_tier: bool,
        /// What to check: `engine` (the cache engine's durability contract) or `log` (the
        /// S3 log layout's crash consistency over a simulated object store that fails,
        /// loses and hangs requests and lands a crashed server's requests late; docs/s3.md).
        #[arg(long, value_enum, default_value_t = CheckLayout::Engine)]
        layout: CheckLayout,
        /// With `--layout log`: servers on one disk, `1` (crash consistency of one server),
        /// `2`, `3` or `2-3` (each seed picks): standbys take the disk over under the lease
        /// through partitions, frozen processes, clock skew within the bound and crashes;
        /// asserts that no two servers' acknowledged intervals overlap and that every
        /// FLUSH-acknowledged write survives every takeover (docs/s3.md).
        #[arg(long, default_value = "1", value_parser = parse_server_count)]
        servers: ServerCount,
    },
    /// Run one workload on one disk with the engine's knobs.
    #[command(after_help = "Examples:\n  \
        bufcache sim run --disk rz25 --workload dd:write,bs=1M,count=86 --cluster-size-max 16k\n  \
        bufcache sim run --disk hdd7200 --workload sweep:file=256M,sizes=32M/64M,bs=1M,passes=4 --cache-size 64M\n  \
        bufcache sim run --disk wan:rtt_ms=80 --workload mixed:scan=512M,ws=32M --policy lru\n  \
        bufcache sim run --disk rz25 --workload treecopy:files=200,remote=on --newfs default --update-period 30 --io-queue fifo\n  \
        bufcache sim run --disk travelstar --workload build:jobs=30,sources=1000,headers=1500,cpu_ms=1388 --cache-size 48M --memory default\n\n\
        Disks: rz25, rz25-1995est, rz28, fireball-tm, travelstar, cheetah9lp, ata2002, hdd7200, nvme, lan, wan (PRESET:key=value,...).\n\
        Workloads: dd, sweep, mixed, treecopy, build (NAME:key=value,...).")]
    Run {
        /// Disk model, PRESET[:key=value,...].
        #[arg(long)]
        disk: DiskSpec,
        /// Workload, NAME:key=value,...
        #[arg(long)]
        workload: WorkloadSpec,
        /// Print JSON instead of the report.
        #[arg(long)]
        json: bool,
        /// Lay out a 4.4BSD FFS on the disk and write its metadata (inodes, directories,
        /// bitmaps, indirect blocks) through the cache: `default` or newfs keys, e.g.
        /// `a=16,d=0,n=1` (b, f, a, d, n, r, c, i, sync=on|off); `age=0.7,churn=2` ages
        /// the file system first (filled to that share by seeded create/remove churn through
        /// the allocator). Default: a flat layout without metadata I/O.
        #[arg(long, value_name = "NEWFS")]
        newfs: Option<bufcache_sim::NewfsParams>,
        /// Run 4.4BSD's update daemon: sync(2) every this many seconds (4.4BSD: 30). Default:
        /// none.
        #[arg(long, value_name = "SECONDS", value_parser = clap::value_parser!(u64).range(1..=3600))]
        update_period: Option<u64>,
        /// Share the host's memory between the workload's processes and the buffer area,
        /// paging what the processes lack to swap on the same disk, in disk time: `default`
        /// (seed 003's ThinkPad: ram=160M, reserved=16M, job=6M, wired=6M, dynamic=off,
        /// period_ms=100, swap=320M, cluster=64k, pagecache=off, dontneed=on) or those keys;
        /// `dynamic=on` reclaims clean buffer pages first (Tanimura's patch), `swap=off` only
        /// watches; `pagecache=on` keeps pages released by buffers in a VM page cache that
        /// competes with the processes' pages in FreeBSD's activity order (with `dynamic=on`
        /// released pages pass through vm_page_dontneed unless `dontneed=off`). The buffer
        /// area starts at --cache-size. Default: memory not modelled.
        #[arg(long, value_name = "MEMORY", value_parser = parse_memory)]
        memory: Option<Box<bufcache_sim::MemoryModel>>,
        #[command(flatten)]
        engine: Box<EngineArgs>,
    },
}

pub fn run(args: SimArgs) -> anyhow::Result<()> {
    match args.command {
        SimCommand::List => {
            for (name, description) in EXPERIMENTS {
                println!("{name:<12} {description}");
            }
            Ok(())
        }
        SimCommand::Experiment {
            name,
            json,
            scale,
            seed,
            output,
        } => {
            let progress = spinner(format!("simulating {name}"));
            let result = run_experiment(&name, &ExperimentOptions { scale, seed });
            progress.finish_and_clear();
            let result = result?;
            if json {
                println!("{}", result.to_json());
            } else {
                print!("{}", result.to_text());
            }
            std::fs::create_dir_all(&output)
                .with_context(|| format!("creating {}", output.display()))?;
            for (extension, contents) in [
                ("txt", result.to_text()),
                ("csv", result.to_csv()),
                ("comparison.csv", result.comparison_csv()),
                ("json", result.to_json()),
                ("svg", result.to_svg()),
            ] {
                let path = output.join(format!("{name}.{extension}"));
                std::fs::write(&path, contents)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            let png = output.join(format!("{name}.png"));
            if crate::plot::png_available() {
                crate::plot::write_plot(&result.to_svg(), &png)?;
                eprintln!(
                    "bufcache: wrote {}/{name}.{{txt,csv,comparison.csv,json,svg,png}}",
                    output.display()
                );
            } else {
                eprintln!(
                    "bufcache: wrote {}/{name}.{{txt,csv,comparison.csv,json,svg}}; no PNG (install librsvg2-bin for rsvg-convert)",
                    output.display()
                );
            }
            Ok(())
        }
        SimCommand::Check {
            seeds,
            seed,
            trace,
            local_tier,
            layout,
            servers,
        } => match layout {
            CheckLayout::Log if local_tier => Err(crate::UsageError(
                "sim check: --local-tier and --layout log are two different checks; give one"
                    .into(),
            )
            .into()),
            CheckLayout::Engine if servers != ServerCount::Exactly(1) => Err(crate::UsageError(
                "sim check: --servers applies to --layout log only".into(),
            )
            .into()),
            CheckLayout::Log => match servers {
                ServerCount::Exactly(1) => check_log(seeds, seed, trace),
                ServerCount::Exactly(count) => check_servers(seeds, seed, Some(count), trace),
                ServerCount::TwoOrThree => check_servers(seeds, seed, None, trace),
            },
            CheckLayout::Engine => check(seeds, seed, trace, local_tier),
        },
        SimCommand::Run {
            disk,
            workload,
            json,
            newfs,
            update_period,
            memory,
            engine,
        } => {
            let config = engine.config()?;
            let io_queue = sim_io_queue(&engine, &config, &disk)?;
            let mut sim_config = SimConfig::new(disk.clone(), host_for(&disk));
            sim_config.cache = sim_cache_config(config);
            if io_queue.is_some() {
                sim_config.io_daemons = SERVE_BACKGROUND_WORKERS;
            }
            sim_config.io_queue = io_queue;
            sim_config.fs = newfs;
            sim_config.update_period = update_period.map(std::time::Duration::from_secs);
            sim_config.memory = memory.map(|model| *model);
            let progress = spinner("simulating".to_string());
            let report = run_custom_with(&sim_config, &workload);
            progress.finish_and_clear();
            let report = report?;
            if json {
                println!("{}", report.to_json());
            } else {
                print!("{}", report.to_text());
            }
            Ok(())
        }
    }
}

/// `--memory`: boxed, so the subcommand enum stays small.
fn parse_memory(text: &str) -> Result<Box<bufcache_sim::MemoryModel>, bufcache_sim::SpecError> {
    text.parse().map(Box::new)
}

/// `sim check`: runs the seeds, prints each violation with its seed and the summary line.
fn check(seeds: u64, first_seed: u64, trace: bool, local_tier: bool) -> anyhow::Result<()> {
    let check_seed_traced = if local_tier {
        bufcache_sim::check_tier_seed_traced
    } else {
        bufcache_sim::check::check_seed_traced
    };
    let progress = spinner(format!("checking {seeds} seeds"));
    if trace {
        progress.finish_and_clear();
    }
    let summary: bufcache_sim::CheckSummary = bufcache_check::check_seeds(
        first_seed,
        seeds,
        |seed| check_seed_traced(seed, trace),
        |seed, outcome: &bufcache_sim::SeedOutcome| {
            if outcome.violation.is_some() && !trace {
                progress.suspend(|| eprintln!("bufcache: seed {seed} violates the contract"));
            }
        },
    );
    progress.finish_and_clear();
    print_violations(&summary.violations);
    println!("{}", summary.line());
    let totals = &summary.totals;
    let restarts = if local_tier {
        format!(
            "{} starts on another disk refused",
            totals.wrong_disk_refusals
        )
    } else {
        format!(
            "rescue files: {} saved, {} replayed, {} stale refused",
            totals.rescue.saved, totals.rescue.replayed, totals.rescue.refused
        )
    };
    eprintln!(
        "bufcache: {} engine calls, {} crashes, {} device faults, {restarts}; {:.0} seeds/s",
        totals.steps,
        totals.crashes,
        totals.device_faults,
        summary.seeds_per_second()
    );
    let command = if local_tier {
        "bufcache sim check --local-tier"
    } else {
        "bufcache sim check"
    };
    match summary.failure("the durability contract", command) {
        None => Ok(()),
        Some(failure) => Err(anyhow::anyhow!(failure)),
    }
}

/// Prints each violation, after its seed.
fn print_violations(violations: &[bufcache_check::Violation]) {
    for violation in violations {
        println!("seed {}: {violation}", violation.seed);
    }
}

/// `sim check --layout log`: runs the seeds, prints each violation with its seed and the
/// summary line.
fn check_log(seeds: u64, first_seed: u64, trace: bool) -> anyhow::Result<()> {
    let progress = spinner(format!("checking the log layout on {seeds} seeds"));
    if trace {
        progress.finish_and_clear();
    }
    let summary =
        bufcache_s3::sim_check::check_log_seeds(first_seed, seeds, trace, |seed, outcome| {
            if outcome.violation.is_some() {
                progress.suspend(|| {
                    eprintln!("bufcache: seed {seed} violates the log layout's crash consistency")
                });
            }
        });
    progress.finish_and_clear();
    print_violations(&summary.violations);
    println!("{}", summary.line());
    let totals = &summary.totals;
    eprintln!(
        "bufcache: {} steps, {} crashes, {} clean closes, {} store faults, {} late landings of crashed servers' requests, {} collection rounds, {} epoch objects pruned (at most {} in a bucket after an open), {} snapshots taken and {} read back whole against their shadow copies, {} clones made and driven {} steps, {} whole reads of a clone checked; {:.1} seeds/s",
        totals.steps,
        totals.crashes,
        totals.clean_closes,
        totals.faults,
        totals.late_landings,
        totals.gc_rounds,
        totals.epochs_pruned,
        totals.epoch_objects_max,
        totals.snapshots_taken,
        totals.snapshot_checks,
        totals.clones_made,
        totals.clone_steps,
        totals.clone_checks,
        summary.seeds_per_second()
    );
    match summary.failure(
        "the log layout's crash consistency",
        "bufcache sim check --layout log",
    ) {
        None => Ok(()),
        Some(failure) => Err(anyhow::anyhow!(failure)),
    }
}

/// `sim check --layout log --servers N`: runs the seeds, prints each violation with its seed
/// and the summary line.
fn check_servers(
    seeds: u64,
    first_seed: u64,
    servers: Option<u32>,
    trace: bool,
) -> anyhow::Result<()> {
    let progress = spinner(format!(
        "checking servers taking over one log-layout disk on {seeds} seeds"
    ));
    if trace {
        progress.finish_and_clear();
    }
    let summary = bufcache_s3::sim_servers::check_servers_seeds(
        first_seed,
        seeds,
        servers,
        trace,
        |seed, outcome| {
            if outcome.violation.is_some() {
                progress.suspend(|| {
                    eprintln!(
                        "bufcache: seed {seed} violates the contract of servers sharing a disk"
                    )
                });
            }
        },
    );
    progress.finish_and_clear();
    print_violations(&summary.violations);
    let totals = &summary.totals;
    println!(
        "{} seeds ({} with two servers, {} with three), {} violations",
        summary.seeds,
        totals.seeds_two,
        totals.seeds_three,
        summary.violations.len()
    );
    eprintln!(
        "bufcache: {} client steps, {} acknowledged writes and FLUSHes, {} refused by the lease, {} takeovers, {} opens checked against the flushed history, {} pauses ({} in the middle of a step), {} partitions, {} crashes, {} store faults, {} late landings, clock-rate errors up to {} ppm; {:.1} seeds/s",
        totals.steps,
        totals.acknowledged,
        totals.refused_by_lease,
        totals.takeovers,
        totals.opens_checked,
        totals.pauses,
        totals.pauses_in_step,
        totals.partitions,
        totals.crashes,
        totals.faults,
        totals.late_landings,
        totals.clock_rate_error_ppm_max,
        summary.seeds_per_second()
    );
    let command = format!(
        "bufcache sim check --layout log --servers {}",
        servers.map_or("2-3".to_string(), |count| count.to_string())
    );
    match summary.failure("the contract of servers sharing a disk", &command) {
        None => Ok(()),
        Some(failure) => Err(anyhow::anyhow!(failure)),
    }
}

/// The io queue of `sim run`, from the same flags as `serve`'s. Without `--io-queue` the
/// simulated path has no queue (so the experiments' figures do not move); `--io-queue fifo`
/// or `elevator` puts the simulated queue in (merging unless `--no-io-merge`), where requests
/// wait in virtual time and the discipline picks the next one when the disk is free;
/// `--io-queue none` keeps it out. `--io-queue-depth` sets the batches at the disk at once
/// (default: what the modelled drive accepts — 1 for a mechanical disk, which does no command
/// queueing, its channels for an SSD or network disk). A flag that cannot apply is refused,
/// never ignored: `--no-io-merge` or `--io-queue-depth` without a queue.
fn sim_io_queue(
    engine: &EngineArgs,
    config: &bufcache::CacheConfig,
    disk: &DiskSpec,
) -> anyhow::Result<Option<SimIoQueue>> {
    let mode = engine.io_queue.unwrap_or(QueueMode::None);
    if engine.io_queue_read_batches_ahead_max.is_some() {
        return Err(crate::UsageError(
            "sim run: --io-queue-read-batches-ahead-max applies to serve's io queue; the \
             simulated queue orders requests as 4.4BSD's disksort did, reads and writes alike"
                .to_string(),
        )
        .into());
    }
    if mode == QueueMode::None {
        if engine.no_io_merge {
            return Err(crate::UsageError(
                "sim run: --no-io-merge needs --io-queue fifo or elevator (without a queue \
                 nothing is merged)"
                    .to_string(),
            )
            .into());
        }
        if engine.io_queue_depth.is_some() {
            return Err(crate::UsageError(
                "sim run: --io-queue-depth needs --io-queue fifo or elevator (without a queue \
                 every request goes straight to the disk)"
                    .to_string(),
            )
            .into());
        }
        return Ok(None);
    }
    let depth_max = engine.io_queue_depth.unwrap_or_else(|| disk.commands_max());
    if let Err(error) = (bufcache::IoQueueConfig {
        depth_max,
        ..bufcache::IoQueueConfig::default()
    })
    .validate()
    {
        return Err(crate::UsageError(format!("--io-queue-depth {depth_max}: {error}")).into());
    }
    Ok(Some(SimIoQueue {
        depth_max,
        ..SimIoQueue::new(mode, !engine.no_io_merge, config.transfer_bytes_max)
    }))
}

/// A spinner on standard error while a simulation runs (hidden when not on a terminal).
fn spinner(message: String) -> indicatif::ProgressBar {
    let progress = indicatif::ProgressBar::new_spinner().with_message(message);
    progress.enable_steady_tick(std::time::Duration::from_millis(120));
    progress
}
