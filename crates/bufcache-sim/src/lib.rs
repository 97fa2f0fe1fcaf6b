//! Simulator (being written).
pub mod clock;
pub mod core;
pub mod disk;
pub mod host;
