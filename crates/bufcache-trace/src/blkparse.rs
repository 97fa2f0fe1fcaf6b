//! `blkparse` default text output (`%D %2c %8s %5T.%9t %5p %2a %3d ...`).
//!
//! An event line starts with a `major,minor` device number; only events of the chosen
//! action (Q by default) become requests. The RWBS field decides the operation (R →
//! Read, W → Write, else Other); `sector + count` gives `offset_bytes = sector * 512`,
//! `length_bytes = count * 512` and `object_id = sector`. Events without a sector (a
//! pure flush prints only `[process]`) are data-less `Other` requests. Lines that do not
//! start with a device number (the per-CPU and total summary blkparse prints at the end)
//! are skipped; an event line of the chosen action that does not parse is an error.

use std::io::BufRead;
use std::path::PathBuf;

use crate::error::TraceError;
use crate::options::TraceOptions;
use crate::text::{LineContext, LineSource};
use crate::{Operation, TraceRequest};

/// blkparse always counts in 512-byte sectors, whatever the device's block size.
const SECTOR_BYTES: u64 = 512;

/// Nanoseconds per second: blkparse prints time as `seconds.nanoseconds`.
const SECOND_NANOSECONDS: u64 = 1_000_000_000;

/// Streaming reader of one blkparse text output.
#[derive(Debug)]
pub(crate) struct BlkparseReader<R> {
    lines: LineSource<R>,
    action: &'static str,
}

impl<R: BufRead> BlkparseReader<R> {
    pub fn new(input: R, path: PathBuf, options: &TraceOptions) -> Self {
        BlkparseReader {
            lines: LineSource::new(input, path),
            action: options.blkparse_action.letter(),
        }
    }

    fn next_request(&mut self) -> Result<Option<TraceRequest>, TraceError> {
        while self.lines.advance()? {
            let (line, context) = self.lines.line()?;
            if let Some(request) = parse_line(line, self.action, context)? {
                return Ok(Some(request));
            }
        }
        Ok(None)
    }
}

impl<R: BufRead> Iterator for BlkparseReader<R> {
    type Item = Result<TraceRequest, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.next_request().transpose()
    }
}

/// True for blkparse's device field, `major,minor` in decimal.
pub(crate) fn is_device_number(field: &str) -> bool {
    let all_digits = |text: &str| !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit());
    field
        .split_once(',')
        .is_some_and(|(major, minor)| all_digits(major) && all_digits(minor))
}

/// Parses one line: `None` for summary lines and events of other actions.
fn parse_line(
    line: &str,
    action: &str,
    context: LineContext<'_>,
) -> Result<Option<TraceRequest>, TraceError> {
    let mut fields = line.split_whitespace();
    let Some([_cpu, _sequence, time, _pid, event_action, rwbs]) =
        event_header(&mut fields, line, context)?
    else {
        return Ok(None);
    };
    if event_action != action {
        return Ok(None);
    }
    let time_us = context.parse_time_us("time", time, SECOND_NANOSECONDS)?;
    let rest = [fields.next(), fields.next(), fields.next()];
    let request = match rest {
        [Some(sector), Some("+"), Some(count)] => {
            let sector = context.parse_u64("sector", sector)?;
            let count = context.parse_u64("count", count)?;
            TraceRequest {
                time_us,
                operation: operation_from_rwbs(rwbs),
                offset_bytes: context.scale("sector", sector, SECTOR_BYTES)?,
                length_bytes: context.scale("count", count, SECTOR_BYTES)?,
                object_id: sector,
            }
        }
        // No sector: a flush or a SCSI passthrough command with no data range.
        [None, ..] => data_less(time_us),
        [Some(first), ..] if first.starts_with('[') || rwbs.contains('N') => data_less(time_us),
        [Some(first), ..] => {
            return Err(context.error("sector", first, "expected `sector + count` or `[process]`"))
        }
    };
    Ok(Some(request))
}

/// The six fields after the device number (cpu, sequence, time, pid, action, rwbs), or
/// `None` when the line is not an event line.
fn event_header<'a>(
    fields: &mut impl Iterator<Item = &'a str>,
    line: &str,
    context: LineContext<'_>,
) -> Result<Option<[&'a str; 6]>, TraceError> {
    if !fields.next().is_some_and(is_device_number) {
        return Ok(None);
    }
    let mut header = [""; 6];
    for slot in header.iter_mut() {
        *slot = fields.next().ok_or_else(|| {
            context.error(
                "event",
                line,
                "expected device cpu sequence time pid action rwbs",
            )
        })?;
    }
    Ok(Some(header))
}

fn data_less(time_us: u64) -> TraceRequest {
    TraceRequest {
        time_us,
        operation: Operation::Other,
        offset_bytes: 0,
        length_bytes: 0,
        object_id: 0,
    }
}

/// RWBS: R read, W write; D (discard), F (flush) alone, N (none) are Other.
fn operation_from_rwbs(rwbs: &str) -> Operation {
    if rwbs.contains('R') {
        Operation::Read
    } else if rwbs.contains('W') {
        Operation::Write
    } else {
        Operation::Other
    }
}
