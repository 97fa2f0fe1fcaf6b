//! The host cost model: CPU time of the operating system around the cache.
//!
//! Costs are charged to the simulated process (or daemon) that causes them, on a pool of
//! simulated CPUs: a process that needs CPU while every CPU is busy waits. `user` time is the
//! program's own work; `sys` time is system calls, buffer lookups, copies between the cache
//! and the process, per-I/O driver and interrupt work and page wiring, as `time` reports them.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use crate::disk::{split_spec, SpecError};

/// CPU costs of one host.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HostCosts {
    /// Preset name.
    pub name: String,
    /// CPUs.
    pub cpus: u32,
    /// User time per system call made by a workload (its own loop around the call), ns.
    pub user_per_call_ns: u64,
    /// Kernel entry and exit per system call, ns.
    pub syscall_ns: u64,
    /// One buffer lookup (hash, lock, policy update), ns.
    pub lookup_ns: u64,
    /// Copying between the cache and a process (or zero-filling), picoseconds per byte.
    pub copy_ps_per_byte: u64,
    /// One device request: driver, controller setup, interrupt, completion, ns.
    pub io_ns: u64,
    /// Wiring one page into a buffer, ns.
    pub wire_page_ns: u64,
    /// Unwiring one page when a buffer is released for reuse, ns.
    pub unwire_page_ns: u64,
}

/// The host preset names.
pub const HOST_PRESETS: &[&str] = &["alpha1995", "p150", "pii366", "pc2002", "modern"];

impl HostCosts {
    /// A 1995 DEC 3000 Alpha with a 53c810 SCSI controller (seed 000's machine). Calibrated
    /// on the seed's own numbers: 7.5 s sys for 86 MiB with 64 KiB clusters and 9.1 s with
    /// 16 KiB gives ≈ 0.4 ms per device request, and the rest (two copies of 86 MiB: the zero
    /// fill of /dev/zero and the copy into the cache) ≈ 38 ns per byte.
    pub fn alpha1995() -> HostCosts {
        HostCosts {
            name: "alpha1995".into(),
            cpus: 1,
            user_per_call_ns: 20_000,
            syscall_ns: 30_000,
            lookup_ns: 4_000,
            copy_ps_per_byte: 38_000,
            io_ns: 400_000,
            wire_page_ns: 6_000,
            unwire_page_ns: 4_000,
        }
    }

    /// A 2002 PC (seed 003's 160 MB FreeBSD box): cached 1 MiB reads at ≈ 65 MB/s gives
    /// ≈ 14 ns per byte copied with lookups and wiring included.
    pub fn pc2002() -> HostCosts {
        HostCosts {
            name: "pc2002".into(),
            cpus: 1,
            user_per_call_ns: 2_000,
            syscall_ns: 2_000,
            lookup_ns: 500,
            copy_ps_per_byte: 13_000,
            io_ns: 30_000,
            wire_page_ns: 1_000,
            unwire_page_ns: 700,
        }
    }

    /// The Pentium II 366 of seed 003's ThinkPad 600E (160 MB). The costs are
    /// [`HostCosts::pc2002`]'s, which were calibrated on that machine's own figure (cached
    /// 1 MiB reads at ≈ 65 MB/s in seed 003): this preset names the machine.
    pub fn pii366() -> HostCosts {
        HostCosts {
            name: "pii366".into(),
            ..Self::pc2002()
        }
    }

    /// The 1997 Pentium 150 of seed 001 (32 MB, IDE disk). **Assumed**: the PII 366's costs
    /// scaled by the clock ratio 366/150 ≈ 2.4 (no figure in the seed gives a per-call or
    /// per-byte cost), and an IDE request costs 60 µs of driver and interrupt time (the
    /// PII's 30 µs doubled for programmed I/O set-up on a slower bus; assumed).
    pub fn p150() -> HostCosts {
        let scale = |ns: u64| ns * 366 / 150;
        let base = Self::pc2002();
        HostCosts {
            name: "p150".into(),
            cpus: 1,
            user_per_call_ns: scale(base.user_per_call_ns),
            syscall_ns: scale(base.syscall_ns),
            lookup_ns: scale(base.lookup_ns),
            copy_ps_per_byte: scale(base.copy_ps_per_byte),
            io_ns: 60_000,
            wire_page_ns: scale(base.wire_page_ns),
            unwire_page_ns: scale(base.unwire_page_ns),
        }
    }

    /// A current 4-core machine: ≈ 10 GB/s copies, 5 µs per I/O (NVMe driver + interrupt).
    pub fn modern() -> HostCosts {
        HostCosts {
            name: "modern".into(),
            cpus: 4,
            user_per_call_ns: 200,
            syscall_ns: 300,
            lookup_ns: 50,
            copy_ps_per_byte: 100,
            io_ns: 5_000,
            wire_page_ns: 100,
            unwire_page_ns: 80,
        }
    }

    /// The preset called `name`.
    pub fn preset(name: &str) -> Option<HostCosts> {
        Some(match name {
            "alpha1995" | "alpha" => Self::alpha1995(),
            "pc2002" | "pc" => Self::pc2002(),
            "pii366" => Self::pii366(),
            "p150" => Self::p150(),
            "modern" => Self::modern(),
            _ => return None,
        })
    }

    /// CPU time to copy `bytes`, ns.
    pub fn copy_ns(&self, bytes: u64) -> u64 {
        (bytes as u128 * self.copy_ps_per_byte as u128 / 1000) as u64
    }
}

impl fmt::Display for HostCosts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({} CPU, syscall {} ns, lookup {} ns, copy {} ps/B, I/O {} ns, wire {} ns/page)",
            self.name,
            self.cpus,
            self.syscall_ns,
            self.lookup_ns,
            self.copy_ps_per_byte,
            self.io_ns,
            self.wire_page_ns
        )
    }
}

/// Syntax: `PRESET[:key=value,...]` with keys `cpus`, `user_per_call_ns`, `syscall_ns`,
/// `lookup_ns`, `copy_ps_per_byte`, `io_ns`, `wire_page_ns`, `unwire_page_ns`.
impl FromStr for HostCosts {
    type Err = SpecError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let (name, pairs) = split_spec(text)?;
        let mut host = HostCosts::preset(&name).ok_or_else(|| {
            SpecError::new(
                "host",
                &name,
                &format!("one of {}", HOST_PRESETS.join(", ")),
            )
        })?;
        for (key, value) in pairs {
            let number: u64 = value
                .parse()
                .map_err(|_| SpecError::new(&key, &value, "a whole number"))?;
            match key.as_str() {
                "cpus" if (1..=1024).contains(&number) => host.cpus = number as u32,
                "cpus" => return Err(SpecError::new(&key, &value, "from 1 to 1024")),
                "user_per_call_ns" => host.user_per_call_ns = number,
                "syscall_ns" => host.syscall_ns = number,
                "lookup_ns" => host.lookup_ns = number,
                "copy_ps_per_byte" => host.copy_ps_per_byte = number,
                "io_ns" => host.io_ns = number,
                "wire_page_ns" => host.wire_page_ns = number,
                "unwire_page_ns" => host.unwire_page_ns = number,
                _ => {
                    return Err(SpecError::new(
                        &key,
                        &value,
                        "a host key: cpus, user_per_call_ns, syscall_ns, lookup_ns, \
                         copy_ps_per_byte, io_ns, wire_page_ns, unwire_page_ns",
                    ))
                }
            }
        }
        Ok(host)
    }
}
