//! The list of supported trace formats, their names, and guessing one from a file.
//!
//! Names are the lower-case strings users type (`csv`, `blkparse`, `msr`, `fio`,
//! `oracle-general`, `vscsi`); `FromStr` and `Display` round-trip through them.

use std::fmt;
use std::fs::File;
use std::io::Read;
use std::path::Path;
use std::str::FromStr;

use crate::error::{excerpt, TraceError};

/// A trace file format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TraceFormat {
    /// Delimited text with libCacheSim's column options.
    Csv,
    /// `blkparse` default text output.
    Blkparse,
    /// MSR Cambridge CSV (`Timestamp,Hostname,DiskNumber,Type,Offset,Size,ResponseTime`).
    Msr,
    /// fio iolog, version 2 or 3.
    Fio,
    /// libCacheSim oracleGeneral: 24-byte little-endian records.
    OracleGeneral,
    /// CloudPhysics vscsi, version 1 (32-byte) or 2 (40-byte) records.
    Vscsi,
}

const NAMES: &str = "csv, blkparse, msr, fio, oracle-general, vscsi";

/// Bytes of a file read to recognise its content.
const SNIFF_BYTES: usize = 512;

impl TraceFormat {
    /// Every format, in documentation order.
    pub const ALL: [TraceFormat; 6] = [
        TraceFormat::Csv,
        TraceFormat::Blkparse,
        TraceFormat::Msr,
        TraceFormat::Fio,
        TraceFormat::OracleGeneral,
        TraceFormat::Vscsi,
    ];

    /// The name `FromStr` accepts.
    pub fn name(self) -> &'static str {
        match self {
            TraceFormat::Csv => "csv",
            TraceFormat::Blkparse => "blkparse",
            TraceFormat::Msr => "msr",
            TraceFormat::Fio => "fio",
            TraceFormat::OracleGeneral => "oracle-general",
            TraceFormat::Vscsi => "vscsi",
        }
    }

    /// Guesses the format from the file name, then from the first bytes.
    ///
    /// A `.csv` file is MSR when its first line has MSR's seven fields with `Read` or
    /// `Write` fourth, otherwise generic CSV (which still needs column options).
    pub fn guess(path: impl AsRef<Path>) -> Result<TraceFormat, TraceError> {
        let path = path.as_ref();
        let name = path
            .file_name()
            .map(|name| name.to_string_lossy().to_ascii_lowercase())
            .unwrap_or_default();
        if name.ends_with(".vscsi") {
            return Ok(TraceFormat::Vscsi);
        }
        if name.contains("oraclegeneral") {
            return Ok(TraceFormat::OracleGeneral);
        }
        let head = read_head(path)?;
        let first_line = head.lines().next().unwrap_or("");
        if first_line.starts_with("fio version") {
            return Ok(TraceFormat::Fio);
        }
        if looks_like_msr(first_line) {
            return Ok(TraceFormat::Msr);
        }
        if looks_like_blkparse(first_line) {
            return Ok(TraceFormat::Blkparse);
        }
        if name.ends_with(".csv") {
            return Ok(TraceFormat::Csv);
        }
        Err(TraceError::FormatNotGuessed {
            path: path.to_path_buf(),
            reason: format!("no known extension, first line {:?}", excerpt(first_line)),
        })
    }
}

fn read_head(path: &Path) -> Result<String, TraceError> {
    let io_error = |source| TraceError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut head = Vec::with_capacity(SNIFF_BYTES);
    File::open(path)
        .map_err(io_error)?
        .take(SNIFF_BYTES as u64)
        .read_to_end(&mut head)
        .map_err(io_error)?;
    Ok(String::from_utf8_lossy(&head).into_owned())
}

fn looks_like_msr(line: &str) -> bool {
    let fields: Vec<&str> = line.split(',').collect();
    fields.len() == 7
        && fields[0].trim().parse::<u64>().is_ok()
        && matches!(fields[3].trim(), "Read" | "Write")
}

fn looks_like_blkparse(line: &str) -> bool {
    line.split_whitespace()
        .next()
        .is_some_and(crate::blkparse::is_device_number)
}

impl FromStr for TraceFormat {
    type Err = TraceError;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        let lowered = name.trim().to_ascii_lowercase();
        let format = match lowered.as_str() {
            "csv" => TraceFormat::Csv,
            "blkparse" => TraceFormat::Blkparse,
            "msr" => TraceFormat::Msr,
            "fio" => TraceFormat::Fio,
            // libCacheSim spells it oracleGeneral; accept its spelling too.
            "oracle-general" | "oraclegeneral" | "oracle_general" => TraceFormat::OracleGeneral,
            "vscsi" => TraceFormat::Vscsi,
            _ => {
                return Err(TraceError::UnknownFormat {
                    name: excerpt(name),
                    expected: NAMES,
                })
            }
        };
        Ok(format)
    }
}

impl fmt::Display for TraceFormat {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(self.name())
    }
}
