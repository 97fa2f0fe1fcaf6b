//! fio iolog, versions 2 and 3 (what `write_iolog=` writes and `read_iolog=` replays).
//!
//! The first line must be `fio version 2 iolog` or `fio version 3 iolog`. Version 2
//! lines are `filename action [offset length]`; version 3 lines put a timestamp in
//! microseconds first. File actions (add, open, close) are skipped; read and write map
//! to their operations; trim, sync, datasync and sync_file_range are `Other` (sync-like
//! actions may omit offset and length). A version 2 `wait` line carries a delay in
//! microseconds in its offset field: it advances the clock of later requests, because
//! version 2 has no timestamps of its own. The byte offset is also the object id; the
//! file name is not part of the request.

use std::io::BufRead;
use std::path::PathBuf;

use crate::error::TraceError;
use crate::text::{LineContext, LineSource};
use crate::{Operation, TraceRequest};

/// Streaming reader of one fio iolog.
#[derive(Debug)]
pub(crate) struct FioReader<R> {
    lines: LineSource<R>,
    version: IologVersion,
    /// Version 2's clock: the sum of `wait` delays so far, in microseconds.
    waited_us: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum IologVersion {
    V2,
    V3,
}

/// What one iolog line means.
enum Entry {
    Request(TraceRequest),
    Wait { delay_us: u64 },
    Skip,
}

impl<R: BufRead> FioReader<R> {
    /// Reads and checks the header line.
    pub fn new(input: R, path: PathBuf) -> Result<Self, TraceError> {
        let mut lines = LineSource::new(input, path);
        let header_error = |lines: &LineSource<R>, reason: String| TraceError::Header {
            path: lines.path().to_path_buf(),
            reason,
        };
        if !lines.advance()? {
            return Err(header_error(
                &lines,
                "empty file, expected `fio version 2 iolog` or `fio version 3 iolog`".to_owned(),
            ));
        }
        let (header, _) = lines.line()?;
        let version = match header.trim() {
            "fio version 2 iolog" => IologVersion::V2,
            "fio version 3 iolog" => IologVersion::V3,
            other => {
                let reason = format!(
                    "line 1 is {:?}, expected `fio version 2 iolog` or `fio version 3 iolog`",
                    crate::error::excerpt(other)
                );
                return Err(header_error(&lines, reason));
            }
        };
        Ok(FioReader {
            lines,
            version,
            waited_us: 0,
        })
    }

    fn next_request(&mut self) -> Result<Option<TraceRequest>, TraceError> {
        while self.lines.advance()? {
            let (line, context) = self.lines.line()?;
            match parse_line(line, self.version, self.waited_us, context)? {
                Entry::Request(request) => return Ok(Some(request)),
                Entry::Wait { delay_us } => {
                    self.waited_us = self.waited_us.saturating_add(delay_us);
                }
                Entry::Skip => {}
            }
        }
        Ok(None)
    }
}

impl<R: BufRead> Iterator for FioReader<R> {
    type Item = Result<TraceRequest, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.next_request().transpose()
    }
}

/// The fields of one iolog line.
struct Fields<'a> {
    line: &'a str,
    /// Version 3's timestamp; none in version 2.
    time_us: Option<u64>,
    action: &'a str,
    offset: Option<&'a str>,
    length: Option<&'a str>,
}

fn parse_line(
    line: &str,
    version: IologVersion,
    waited_us: u64,
    context: LineContext<'_>,
) -> Result<Entry, TraceError> {
    let Some(fields) = split_fields(line, version, context)? else {
        return Ok(Entry::Skip);
    };
    match fields.action {
        "add" | "open" | "close" => Ok(Entry::Skip),
        "wait" if version == IologVersion::V2 => {
            let delay = fields
                .offset
                .ok_or_else(|| context.error("offset", line, "wait needs a delay"))?;
            let delay_us = context.parse_u64("offset", delay)?;
            Ok(Entry::Wait { delay_us })
        }
        _ => request(&fields, waited_us, context).map(Entry::Request),
    }
}

/// Splits a line into its fields; `None` for a blank line.
fn split_fields<'a>(
    line: &'a str,
    version: IologVersion,
    context: LineContext<'_>,
) -> Result<Option<Fields<'a>>, TraceError> {
    let mut pieces = line.split_whitespace();
    let time_us = match version {
        IologVersion::V2 => None,
        IologVersion::V3 => match pieces.next() {
            Some(timestamp) => Some(context.parse_u64("timestamp", timestamp)?),
            None => return Ok(None),
        },
    };
    let Some(_filename) = pieces.next() else {
        return match version {
            IologVersion::V2 => Ok(None),
            IologVersion::V3 => Err(context.error("filename", line, "missing")),
        };
    };
    let action = pieces
        .next()
        .ok_or_else(|| context.error("action", line, "missing"))?;
    Ok(Some(Fields {
        line,
        time_us,
        action,
        offset: pieces.next(),
        length: pieces.next(),
    }))
}

/// The request an I/O action line stands for.
fn request(
    fields: &Fields<'_>,
    waited_us: u64,
    context: LineContext<'_>,
) -> Result<TraceRequest, TraceError> {
    let action = fields.action;
    let operation = match action {
        "read" => Operation::Read,
        "write" => Operation::Write,
        "trim" | "sync" | "datasync" | "sync_file_range" => Operation::Other,
        _ => return Err(context.error(
            "action",
            action,
            "expected add, open, close, read, write, trim, sync, datasync, sync_file_range or wait",
        )),
    };
    // fio writes sync-like actions with a zero range, but hand-written logs may omit it.
    let data_required = matches!(action, "read" | "write" | "trim");
    let number = |field: &'static str, text: Option<&str>| match text {
        Some(text) => context.parse_u64(field, text),
        None if data_required => {
            Err(context.error(field, fields.line, &format!("{action} needs {field}")))
        }
        None => Ok(0),
    };
    let offset_bytes = number("offset", fields.offset)?;
    Ok(TraceRequest {
        time_us: fields.time_us.unwrap_or(waited_us),
        operation,
        offset_bytes,
        length_bytes: number("length", fields.length)?,
        object_id: offset_bytes,
    })
}
