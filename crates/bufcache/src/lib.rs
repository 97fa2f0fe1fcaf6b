//! bufcache: a concurrent block buffer cache with I/O clustering over pluggable devices.

pub mod device;

pub use device::{Device, Extent};
