//! Reader options, spelled the way libCacheSim spells them.
//!
//! [`TraceOptions::parse`] takes libCacheSim's `key=value,key=value` string
//! (`time-col=2,obj-id-col=5,obj-size-col=4,op-col=3,has-header=true,delimiter=,`).
//! Invariants after a successful parse: column numbers are 1-based and non-zero,
//! the delimiter is one ASCII character, `lbn-size` is non-zero. Unknown keys and
//! bad values are errors naming the key; nothing is silently ignored.

use std::str::FromStr;

use crate::error::{excerpt, TraceError};

/// Every key [`TraceOptions::parse`] accepts, for error messages.
const KNOWN_KEYS: &str = "time-col, obj-id-col, obj-size-col, op-col, has-header, delimiter, \
     obj-id-is-num, lbn-size, time-unit, blkparse-action, vscsi-version";

/// Unit of the time column of a CSV trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimeUnit {
    /// Seconds.
    Seconds,
    /// Milliseconds.
    Milliseconds,
    /// Microseconds.
    Microseconds,
    /// Nanoseconds.
    Nanoseconds,
}

impl TimeUnit {
    /// Length of one unit in nanoseconds.
    pub fn nanoseconds(self) -> u64 {
        match self {
            TimeUnit::Seconds => 1_000_000_000,
            TimeUnit::Milliseconds => 1_000_000,
            TimeUnit::Microseconds => 1_000,
            TimeUnit::Nanoseconds => 1,
        }
    }
}

/// Which blkparse event stands for a request: queued (Q), dispatched to the driver (D)
/// or completed (C).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlkparseAction {
    /// The request was queued (Q).
    Queue,
    /// The request was dispatched to the driver (D).
    Dispatch,
    /// The request completed (C).
    Complete,
}

impl BlkparseAction {
    /// The action letter blkparse prints.
    pub fn letter(self) -> &'static str {
        match self {
            BlkparseAction::Queue => "Q",
            BlkparseAction::Dispatch => "D",
            BlkparseAction::Complete => "C",
        }
    }
}

/// Record layout of a CloudPhysics vscsi trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VscsiVersion {
    /// 32-byte records.
    V1,
    /// 40-byte records with a response time.
    V2,
}

/// Options for every reader; each reader uses the keys that concern it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceOptions {
    /// CSV: 1-based column of the timestamp (`time-col`); none means time 0.
    pub time_column: Option<usize>,
    /// CSV: 1-based column of the object id (`obj-id-col`); required for CSV.
    pub object_id_column: Option<usize>,
    /// CSV: 1-based column of the request size in bytes (`obj-size-col`); none means 0.
    pub object_size_column: Option<usize>,
    /// CSV: 1-based column of the operation (`op-col`); none means `Other`.
    pub operation_column: Option<usize>,
    /// CSV: skip the first line (`has-header`).
    pub has_header: bool,
    /// CSV: field separator (`delimiter`), one ASCII character.
    pub delimiter: char,
    /// CSV: ids are decimal numbers (`obj-id-is-num`); when false, ids are hashed strings.
    pub object_id_is_numeric: bool,
    /// CSV, vscsi, oracle-general: bytes per object id unit (`lbn-size`), so
    /// `offset_bytes = object_id * lbn_size_bytes`.
    pub lbn_size_bytes: u64,
    /// CSV: unit of the time column (`time-unit` = s, ms, us, ns).
    pub time_unit: TimeUnit,
    /// blkparse: which event is a request (`blkparse-action` = Q, D, C).
    pub blkparse_action: BlkparseAction,
    /// vscsi: force a record layout (`vscsi-version` = 1, 2) instead of detecting it.
    pub vscsi_version: Option<VscsiVersion>,
}

impl Default for TraceOptions {
    fn default() -> Self {
        TraceOptions {
            time_column: None,
            object_id_column: None,
            object_size_column: None,
            operation_column: None,
            has_header: false,
            delimiter: ',',
            object_id_is_numeric: true,
            // Block traces count in 512-byte sectors unless told otherwise.
            lbn_size_bytes: 512,
            // libCacheSim's CSV clock is in seconds.
            time_unit: TimeUnit::Seconds,
            blkparse_action: BlkparseAction::Queue,
            vscsi_version: None,
        }
    }
}

impl TraceOptions {
    /// Parses libCacheSim's `key=value,...` option string; an empty string gives the defaults.
    ///
    /// `delimiter` takes one character, so `delimiter=,` means comma (also at the end of
    /// the string); `\t`, `tab`, `space` and `comma` are accepted as names.
    pub fn parse(text: &str) -> Result<TraceOptions, TraceError> {
        let mut options = TraceOptions::default();
        // Trailing spaces are kept: `delimiter= ` means a space.
        let mut rest = text.trim_start().trim_end_matches(['\n', '\r']);
        while !rest.is_empty() {
            let (key, value, after) = split_pair(rest)?;
            options.set(key.trim(), value)?;
            rest = after;
        }
        Ok(options)
    }

    /// Sets one option by its libCacheSim key.
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), TraceError> {
        match key {
            "time-col" => self.time_column = Some(parse_column("time-col", value)?),
            "obj-id-col" => self.object_id_column = Some(parse_column("obj-id-col", value)?),
            "obj-size-col" => self.object_size_column = Some(parse_column("obj-size-col", value)?),
            "op-col" => self.operation_column = Some(parse_column("op-col", value)?),
            "has-header" => self.has_header = parse_bool("has-header", value)?,
            "delimiter" => self.delimiter = parse_delimiter(value)?,
            "obj-id-is-num" => self.object_id_is_numeric = parse_bool("obj-id-is-num", value)?,
            "lbn-size" => self.lbn_size_bytes = parse_lbn_size(value)?,
            "time-unit" => self.time_unit = parse_time_unit(value)?,
            "blkparse-action" => self.blkparse_action = parse_blkparse_action(value)?,
            "vscsi-version" => self.vscsi_version = Some(parse_vscsi_version(value)?),
            _ => {
                return Err(TraceError::UnknownOption {
                    key: excerpt(key),
                    known: KNOWN_KEYS,
                })
            }
        }
        Ok(())
    }
}

impl FromStr for TraceOptions {
    type Err = TraceError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        TraceOptions::parse(text)
    }
}

/// Splits `key=value` off the front of `text`, returning the rest after the next comma.
///
/// A delimiter value starting with a comma is that comma: the one place where a comma
/// is a value rather than a separator.
fn split_pair(text: &str) -> Result<(&str, &str, &str), TraceError> {
    let Some((key, after_equals)) = text.split_once('=') else {
        let key = text.split(',').next().unwrap_or(text);
        return Err(TraceError::InvalidOption {
            key: "(option)",
            value: excerpt(key),
            reason: "expected key=value".to_owned(),
        });
    };
    if key.trim() == "delimiter" && after_equals.starts_with(',') {
        let after = &after_equals[1..];
        return Ok((key, ",", after.strip_prefix(',').unwrap_or(after)));
    }
    match after_equals.split_once(',') {
        Some((value, after)) => Ok((key, value, after)),
        None => Ok((key, after_equals, "")),
    }
}

fn invalid(key: &'static str, value: &str, reason: &str) -> TraceError {
    TraceError::InvalidOption {
        key,
        value: excerpt(value),
        reason: reason.to_owned(),
    }
}

fn parse_column(key: &'static str, value: &str) -> Result<usize, TraceError> {
    match value.trim().parse::<usize>() {
        Ok(0) => Err(invalid(key, value, "columns are numbered from 1")),
        Ok(column) => Ok(column),
        Err(_) => Err(invalid(key, value, "expected a column number (1, 2, ...)")),
    }
}

fn parse_bool(key: &'static str, value: &str) -> Result<bool, TraceError> {
    match value.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" => Ok(true),
        "false" | "0" | "no" => Ok(false),
        _ => Err(invalid(key, value, "expected true or false")),
    }
}

fn parse_delimiter(value: &str) -> Result<char, TraceError> {
    let delimiter = match value {
        "\\t" | "tab" => '\t',
        "space" => ' ',
        "comma" => ',',
        _ => {
            let mut characters = value.chars();
            match (characters.next(), characters.next()) {
                (Some(only), None) => only,
                _ => return Err(invalid("delimiter", value, "expected one character")),
            }
        }
    };
    // Splitting is done on bytes of UTF-8 text, which is only safe for ASCII separators.
    if !delimiter.is_ascii() || delimiter == '\n' || delimiter == '\r' {
        return Err(invalid(
            "delimiter",
            value,
            "expected an ASCII character other than a line break",
        ));
    }
    Ok(delimiter)
}

fn parse_lbn_size(value: &str) -> Result<u64, TraceError> {
    match value.trim().parse::<u64>() {
        Ok(0) | Err(_) => Err(invalid(
            "lbn-size",
            value,
            "expected a positive number of bytes",
        )),
        Ok(size) => Ok(size),
    }
}

fn parse_time_unit(value: &str) -> Result<TimeUnit, TraceError> {
    match value.trim() {
        "s" | "sec" => Ok(TimeUnit::Seconds),
        "ms" => Ok(TimeUnit::Milliseconds),
        "us" => Ok(TimeUnit::Microseconds),
        "ns" => Ok(TimeUnit::Nanoseconds),
        _ => Err(invalid("time-unit", value, "expected s, ms, us or ns")),
    }
}

fn parse_blkparse_action(value: &str) -> Result<BlkparseAction, TraceError> {
    match value.trim() {
        "Q" | "q" => Ok(BlkparseAction::Queue),
        "D" | "d" => Ok(BlkparseAction::Dispatch),
        "C" | "c" => Ok(BlkparseAction::Complete),
        _ => Err(invalid("blkparse-action", value, "expected Q, D or C")),
    }
}

fn parse_vscsi_version(value: &str) -> Result<VscsiVersion, TraceError> {
    match value.trim() {
        "1" => Ok(VscsiVersion::V1),
        "2" => Ok(VscsiVersion::V2),
        _ => Err(invalid("vscsi-version", value, "expected 1 or 2")),
    }
}
