//! The `bufcache` command: serve, dd, replay, sim, stat.

mod dd;
mod engine_args;
mod metrics;
mod replay;
mod serve;
mod sim;
mod stat;

use clap::{Parser, Subcommand};

/// A buffer cache with I/O clustering: an NBD server, a dd, and a simulator.
#[derive(Parser)]
#[command(name = "bufcache", version, about, long_about = None)]
struct Cli {
    /// More log output (-v info, -vv debug, -vvv trace); RUST_LOG overrides.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve backing stores over NBD through the cache (the main job).
    Serve(serve::ServeArgs),
    /// Copy through the buffer cache with dd's syntax (seed 000's tool).
    Dd(dd::DdArgs),
    /// The engine on modelled disks, on a virtual clock: the seed experiments and custom runs.
    Sim(sim::SimArgs),
    /// A live view of a running server's statistics (iostat style).
    Stat(stat::StatArgs),
    /// Miss-ratio curves of replacement policies over a block I/O trace.
    Replay(replay::ReplayArgs),
}

fn main() {
    let cli = Cli::parse();
    init_logging(cli.verbose);
    let result = match cli.command {
        Command::Serve(args) => serve::run(args),
        Command::Dd(args) => dd::run(args),
        Command::Replay(args) => replay::run(args),
        Command::Stat(args) => stat::run(args),
        Command::Sim(args) => sim::run(args),
    };
    if let Err(error) = result {
        eprintln!("bufcache: {error:#}");
        std::process::exit(1);
    }
}

/// Logs to standard error: warnings by default, more with -v, or as RUST_LOG says.
fn init_logging(verbose: u8) {
    let default = match verbose {
        0 => "warn",
        1 => "info",
        2 => "debug",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}
