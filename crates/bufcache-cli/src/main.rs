//! The `bufcache` command: serve, dd, replay, sim, stat.

mod dd;
mod engine_args;
mod replay;

use clap::{Parser, Subcommand};

/// A buffer cache with I/O clustering: an NBD server, a dd, and a simulator.
#[derive(Parser)]
#[command(name = "bufcache", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Copy through the buffer cache with dd's syntax (seed 000's tool).
    Dd(dd::DdArgs),
    /// Miss-ratio curves of replacement policies over a block I/O trace.
    Replay(replay::ReplayArgs),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Dd(args) => dd::run(args),
        Command::Replay(args) => replay::run(args),
    };
    if let Err(error) = result {
        eprintln!("bufcache: {error:#}");
        std::process::exit(1);
    }
}
