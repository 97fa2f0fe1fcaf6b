//! MSR Cambridge block traces: `Timestamp,Hostname,DiskNumber,Type,Offset,Size,ResponseTime`.
//!
//! No header. Timestamp is a Windows FILETIME (100 ns units since 1601), converted to
//! microseconds on the same epoch; Type is `Read` or `Write` (any case, anything else is
//! an error); Offset and Size are bytes, and the byte offset is also the object id.
//! DiskNumber and ResponseTime are checked to be integers but not returned.

use std::io::BufRead;
use std::path::PathBuf;

use crate::error::TraceError;
use crate::text::{LineContext, LineSource};
use crate::{Operation, TraceRequest};

/// FILETIME ticks per microsecond (one tick is 100 ns).
const FILETIME_TICKS_PER_MICROSECOND: u64 = 10;

const FIELD_NAMES: [&str; 7] = [
    "Timestamp",
    "Hostname",
    "DiskNumber",
    "Type",
    "Offset",
    "Size",
    "ResponseTime",
];

/// Streaming reader of one MSR Cambridge CSV file.
#[derive(Debug)]
pub(crate) struct MsrReader<R> {
    lines: LineSource<R>,
}

impl<R: BufRead> MsrReader<R> {
    pub fn new(input: R, path: PathBuf) -> Self {
        MsrReader {
            lines: LineSource::new(input, path),
        }
    }

    fn next_request(&mut self) -> Result<Option<TraceRequest>, TraceError> {
        while self.lines.advance()? {
            let (line, context) = self.lines.line()?;
            if line.trim().is_empty() {
                continue;
            }
            return parse_line(line, context).map(Some);
        }
        Ok(None)
    }
}

impl<R: BufRead> Iterator for MsrReader<R> {
    type Item = Result<TraceRequest, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.next_request().transpose()
    }
}

fn parse_line(line: &str, context: LineContext<'_>) -> Result<TraceRequest, TraceError> {
    let mut fields = [""; 7];
    let mut count = 0;
    for piece in line.split(',') {
        if count == fields.len() {
            return Err(context.error("line", line, "more than 7 comma-separated fields"));
        }
        fields[count] = piece.trim();
        count += 1;
    }
    if count < fields.len() {
        return Err(context.error(
            FIELD_NAMES[count],
            line,
            &format!("line has {count} fields, expected 7"),
        ));
    }
    let [timestamp, _hostname, disk, kind, offset, size, response_time] = fields;
    let filetime = context.parse_u64("Timestamp", timestamp)?;
    context.parse_u64("DiskNumber", disk)?;
    context.parse_u64("ResponseTime", response_time)?;
    let operation = if kind.eq_ignore_ascii_case("read") {
        Operation::Read
    } else if kind.eq_ignore_ascii_case("write") {
        Operation::Write
    } else {
        return Err(context.error("Type", kind, "expected Read or Write"));
    };
    let offset_bytes = context.parse_u64("Offset", offset)?;
    Ok(TraceRequest {
        time_us: filetime / FILETIME_TICKS_PER_MICROSECOND,
        operation,
        offset_bytes,
        length_bytes: context.parse_u64("Size", size)?,
        object_id: offset_bytes,
    })
}
