//! Delimited text traces described by libCacheSim's column options.
//!
//! Owns the mapping column text → [`TraceRequest`]: `object_id` is the id column
//! (hashed with FNV-1a and folded when `obj-id-is-num=false`), `offset_bytes =
//! object_id * lbn-size`, `length_bytes` the size column (0 without one), the time
//! column scaled by `time-unit` to microseconds, and the op column through
//! [`operation_from_text`]. Blank lines are skipped; a line missing a configured column,
//! or with a value that does not parse, is an error naming the option key of the column.

use std::io::BufRead;
use std::path::PathBuf;

use crate::error::TraceError;
use crate::fold_block_number;
use crate::operation_from_text;
use crate::options::TraceOptions;
use crate::text::{LineContext, LineSource};
use crate::{Operation, TraceRequest};

/// Streaming reader of one CSV trace.
#[derive(Debug)]
pub(crate) struct CsvReader<R> {
    lines: LineSource<R>,
    columns: Columns,
    has_header: bool,
    delimiter: char,
    object_id_is_numeric: bool,
    lbn_size_bytes: u64,
    time_unit_nanoseconds: u64,
}

/// 0-based column indexes of the fields a request needs.
#[derive(Clone, Copy, Debug)]
struct Columns {
    time: Option<usize>,
    object_id: usize,
    size: Option<usize>,
    operation: Option<usize>,
    /// How many columns a line needs.
    count: usize,
}

/// The raw text of the fields one line provides.
#[derive(Default)]
struct Fields<'a> {
    time: Option<&'a str>,
    object_id: Option<&'a str>,
    size: Option<&'a str>,
    operation: Option<&'a str>,
    count: usize,
}

impl<R: BufRead> CsvReader<R> {
    pub fn new(input: R, path: PathBuf, options: &TraceOptions) -> Result<Self, TraceError> {
        let object_id_column =
            options
                .object_id_column
                .ok_or_else(|| TraceError::MissingOption {
                    path: path.clone(),
                    format: "csv",
                    reason: "--trace-options must name the object id's column (1-based), for \
                         example --trace-options \"obj-id-col=2,obj-size-col=3,op-col=4,\
                         has-header=true\" (time-col, obj-size-col, op-col and has-header as the \
                         file has them)",
                })?;
        let zero_based = |column: usize| column - 1;
        let columns = Columns {
            time: options.time_column.map(zero_based),
            object_id: zero_based(object_id_column),
            size: options.object_size_column.map(zero_based),
            operation: options.operation_column.map(zero_based),
            count: [
                options.time_column,
                Some(object_id_column),
                options.object_size_column,
                options.operation_column,
            ]
            .into_iter()
            .flatten()
            .max()
            .unwrap_or(object_id_column),
        };
        Ok(CsvReader {
            lines: LineSource::new(input, path),
            columns,
            has_header: options.has_header,
            delimiter: options.delimiter,
            object_id_is_numeric: options.object_id_is_numeric,
            lbn_size_bytes: options.lbn_size_bytes,
            time_unit_nanoseconds: options.time_unit.nanoseconds(),
        })
    }

    fn next_request(&mut self) -> Result<Option<TraceRequest>, TraceError> {
        while self.lines.advance()? {
            let (line, context) = self.lines.line()?;
            let is_header = self.has_header && context.line_number == 1;
            if is_header || line.trim().is_empty() {
                continue;
            }
            return self.parse_line(line, context).map(Some);
        }
        Ok(None)
    }

    fn parse_line(&self, line: &str, context: LineContext<'_>) -> Result<TraceRequest, TraceError> {
        let fields = self.split(line);
        let column_text = |text, key, column| required(text, key, column, &fields, line, context);
        let id_text = column_text(fields.object_id, "obj-id-col", self.columns.object_id)?;
        let object_id = self.object_id(id_text, context)?;
        let offset_bytes = context.scale("obj-id-col", object_id, self.lbn_size_bytes)?;
        let time_us = match self.columns.time {
            Some(column) => {
                let text = column_text(fields.time, "time-col", column)?;
                context.parse_time_us("time-col", text, self.time_unit_nanoseconds)?
            }
            None => 0,
        };
        let length_bytes = match self.columns.size {
            Some(column) => context.parse_u64(
                "obj-size-col",
                column_text(fields.size, "obj-size-col", column)?,
            )?,
            None => 0,
        };
        let operation = match self.columns.operation {
            Some(column) => operation_from_text(column_text(fields.operation, "op-col", column)?),
            None => Operation::Other,
        };
        Ok(TraceRequest {
            time_us,
            operation,
            offset_bytes,
            length_bytes,
            object_id,
        })
    }

    /// Picks the configured columns out of `line`, counting how many columns it has.
    fn split<'a>(&self, line: &'a str) -> Fields<'a> {
        let mut fields = Fields::default();
        // A space delimiter means "aligned columns": runs of spaces separate one field.
        let collapse_runs = self.delimiter == ' ';
        let pieces = line
            .split(self.delimiter)
            .filter(|piece| !(collapse_runs && piece.is_empty()));
        for (index, piece) in pieces.enumerate().take(self.columns.count) {
            let piece = unquote(piece);
            let columns = &self.columns;
            if index == columns.object_id {
                fields.object_id = Some(piece);
            }
            if Some(index) == columns.time {
                fields.time = Some(piece);
            }
            if Some(index) == columns.size {
                fields.size = Some(piece);
            }
            if Some(index) == columns.operation {
                fields.operation = Some(piece);
            }
            fields.count = index + 1;
        }
        fields
    }

    fn object_id(&self, text: &str, context: LineContext<'_>) -> Result<u64, TraceError> {
        if self.object_id_is_numeric {
            return context.parse_u64("obj-id-col", text);
        }
        Ok(fold_block_number(
            fnv1a(text.trim().as_bytes()),
            self.lbn_size_bytes,
        ))
    }
}

impl<R: BufRead> Iterator for CsvReader<R> {
    type Item = Result<TraceRequest, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.next_request().transpose()
    }
}

/// The text of a configured column, or an error naming its option key when the line is short.
fn required<'a>(
    text: Option<&'a str>,
    key: &'static str,
    column: usize,
    fields: &Fields<'_>,
    line: &str,
    context: LineContext<'_>,
) -> Result<&'a str, TraceError> {
    text.ok_or_else(|| {
        context.error(
            key,
            line,
            &format!(
                "line has {} columns, column {} needed",
                fields.count,
                column + 1
            ),
        )
    })
}

/// Strips one pair of surrounding double quotes, as spreadsheet exports add them.
fn unquote(field: &str) -> &str {
    let trimmed = field.trim();
    trimmed
        .strip_prefix('"')
        .and_then(|inner| inner.strip_suffix('"'))
        .unwrap_or(trimmed)
}

/// 64-bit FNV-1a: stable across runs and platforms, unlike `std`'s randomised hasher.
fn fnv1a(bytes: &[u8]) -> u64 {
    const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    bytes.iter().fold(OFFSET_BASIS, |hash, &byte| {
        (hash ^ u64::from(byte)).wrapping_mul(PRIME)
    })
}
