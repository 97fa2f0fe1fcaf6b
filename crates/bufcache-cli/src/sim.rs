//! `bufcache sim`: the seed experiments and custom runs of the engine on modelled disks, on a
//! virtual clock (the `bufcache-sim` crate). Everything printed is deterministic for a seed.

use std::path::PathBuf;

use anyhow::Context;
use bufcache_sim::{
    run_custom, run_experiment, DiskSpec, ExperimentOptions, WorkloadSpec, EXPERIMENTS,
};
use clap::{Args, Subcommand};

use crate::engine_args::EngineArgs;

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
    /// Run a seed experiment: prints its table and writes NAME.txt, .csv, .json, .svg and .png.
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
    /// Run one workload on one disk with the engine's knobs.
    #[command(after_help = "Examples:\n  \
        bufcache sim run --disk rz25 --workload dd:write,bs=1M,count=86 --cluster-size-max 16k\n  \
        bufcache sim run --disk hdd7200 --workload sweep:file=256M,sizes=32M/64M,bs=1M,passes=4 --cache-size 64M\n  \
        bufcache sim run --disk wan:rtt_ms=80 --workload mixed:scan=512M,ws=32M --policy lru\n\n\
        Disks: rz25, cheetah9lp, ata2002, hdd7200, nvme, lan, wan (PRESET:key=value,...).\n\
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
                    "bufcache: wrote {}/{name}.{{txt,csv,json,svg,png}}",
                    output.display()
                );
            } else {
                eprintln!(
                    "bufcache: wrote {}/{name}.{{txt,csv,json,svg}}; no PNG (install librsvg2-bin for rsvg-convert)",
                    output.display()
                );
            }
            Ok(())
        }
        SimCommand::Run {
            disk,
            workload,
            json,
            engine,
        } => {
            refuse_io_queue_flags(&engine)?;
            let progress = spinner("simulating".to_string());
            let report = run_custom(&disk, &workload, engine.config()?);
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

/// The io queue flags cannot take effect in `sim run`: the simulated engine issues one
/// device request at a time (one entity runs at a time), so a queue below it never holds two
/// requests to sort or merge and would change nothing. Refuse them rather than ignore them.
fn refuse_io_queue_flags(engine: &EngineArgs) -> anyhow::Result<()> {
    let given: Vec<&str> = [
        ("--io-queue", engine.io_queue.is_some()),
        ("--io-queue-depth", engine.io_queue_depth.is_some()),
        ("--no-io-merge", engine.no_io_merge),
    ]
    .into_iter()
    .filter_map(|(flag, set)| set.then_some(flag))
    .collect();
    if given.is_empty() {
        return Ok(());
    }
    Err(crate::UsageError(format!(
        "sim run does not support {}: the simulator issues one device request at a time, so \
         an io queue would never hold two requests to sort or merge; drop the flag (the \
         simulated path has no io queue)",
        given.join(", ")
    ))
    .into())
}

/// A spinner on standard error while a simulation runs (hidden when not on a terminal).
fn spinner(message: String) -> indicatif::ProgressBar {
    let progress = indicatif::ProgressBar::new_spinner().with_message(message);
    progress.enable_steady_tick(std::time::Duration::from_millis(120));
    progress
}
