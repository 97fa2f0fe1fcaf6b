//! The rescue file as the server sees it: the file, its format and the rule deciding whether
//! it may be replayed are `bufcache_host::rescue` (shared with the simulator's checker, which
//! checks that rule); what `--rescue` asks for is here.

pub use bufcache_host::rescue::*;

/// What `--rescue` says to do with a rescue file found at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RescueAction {
    /// Write its data to the backends and flush before accepting clients (the default);
    /// refused when the disk moved on since the file was saved.
    Replay,
    /// Replay it even when the disk moved on since it was saved (another server opened it,
    /// so its data may be older than what is there now), or when the file does not say.
    Force,
    /// Delete it without writing its data anywhere.
    Discard,
}
