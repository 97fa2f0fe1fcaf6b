//! Line-by-line input for the text formats, and the field parsers they share.
//!
//! [`LineSource`] owns one reusable line buffer, so memory stays bounded by
//! [`LINE_LENGTH_MAX`] whatever the file size. Line numbers are 1-based and count
//! every line read, including skipped ones, so errors point at the line an editor shows.
//! After an I/O error, an over-long line or invalid UTF-8 at end of input, the source is
//! finished: those leave no trustworthy place to resume.

use std::io::{BufRead, Read};
use std::path::{Path, PathBuf};

use crate::error::{excerpt, TraceError};

/// Longest line accepted, in bytes; real trace lines are under 200 bytes, so anything
/// longer is binary data read as text.
pub const LINE_LENGTH_MAX: usize = 64 * 1024;

/// A buffered reader handing out one line at a time.
#[derive(Debug)]
pub(crate) struct LineSource<R> {
    input: R,
    path: PathBuf,
    buffer: Vec<u8>,
    line_number: u64,
    finished: bool,
}

/// Where a line came from: everything an error about it needs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LineContext<'a> {
    pub path: &'a Path,
    pub line_number: u64,
}

impl<R: BufRead> LineSource<R> {
    pub fn new(input: R, path: PathBuf) -> Self {
        LineSource {
            input,
            path,
            buffer: Vec::with_capacity(256),
            line_number: 0,
            finished: false,
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads the next line into the buffer; `Ok(false)` at end of input.
    pub fn advance(&mut self) -> Result<bool, TraceError> {
        if self.finished {
            return Ok(false);
        }
        self.buffer.clear();
        // One byte over the limit tells an over-long line from one exactly at the limit.
        let limit = LINE_LENGTH_MAX as u64 + 1;
        let read = (&mut self.input)
            .take(limit)
            .read_until(b'\n', &mut self.buffer);
        match read {
            Ok(0) => {
                self.finished = true;
                Ok(false)
            }
            Ok(_) => {
                self.line_number += 1;
                self.check_length()?;
                Ok(true)
            }
            Err(source) => {
                self.finished = true;
                Err(TraceError::Io {
                    path: self.path.clone(),
                    source,
                })
            }
        }
    }

    fn check_length(&mut self) -> Result<(), TraceError> {
        if self.buffer.len() <= LINE_LENGTH_MAX {
            return Ok(());
        }
        self.finished = true;
        Err(self.context().error(
            "line",
            &String::from_utf8_lossy(&self.buffer[..80]),
            &format!("line longer than {LINE_LENGTH_MAX} bytes"),
        ))
    }

    fn context(&self) -> LineContext<'_> {
        LineContext {
            path: &self.path,
            line_number: self.line_number,
        }
    }

    /// The current line without its line break, with its context.
    pub fn line(&self) -> Result<(&str, LineContext<'_>), TraceError> {
        let mut bytes = self.buffer.as_slice();
        if let Some(stripped) = bytes.strip_suffix(b"\n") {
            bytes = stripped;
        }
        if let Some(stripped) = bytes.strip_suffix(b"\r") {
            bytes = stripped;
        }
        match std::str::from_utf8(bytes) {
            Ok(text) => Ok((text, self.context())),
            Err(_) => Err(self.context().error(
                "line",
                &String::from_utf8_lossy(bytes),
                "not text (a binary file?): is --format right? oracle-general and vscsi are the \
                 binary formats",
            )),
        }
    }
}

impl LineContext<'_> {
    /// An error about `field` on this line.
    pub fn error(&self, field: &'static str, value: &str, reason: &str) -> TraceError {
        TraceError::Line {
            path: self.path.to_path_buf(),
            line_number: self.line_number,
            field,
            value: excerpt(value),
            reason: reason.to_owned(),
        }
    }

    /// A decimal unsigned integer.
    pub fn parse_u64(&self, field: &'static str, text: &str) -> Result<u64, TraceError> {
        text.trim()
            .parse::<u64>()
            .map_err(|_| self.error(field, text, "expected an unsigned integer"))
    }

    /// `object_id * unit_bytes`, or an error naming `field` when it does not fit in 64 bits.
    pub fn scale(
        &self,
        field: &'static str,
        value: u64,
        unit_bytes: u64,
    ) -> Result<u64, TraceError> {
        value.checked_mul(unit_bytes).ok_or_else(|| {
            self.error(
                field,
                &value.to_string(),
                &format!("times {unit_bytes} bytes overflows 64 bits"),
            )
        })
    }

    /// A time such as `12`, `0.000123456` in units of `unit_nanoseconds`, as microseconds.
    pub fn parse_time_us(
        &self,
        field: &'static str,
        text: &str,
        unit_nanoseconds: u64,
    ) -> Result<u64, TraceError> {
        decimal_to_microseconds(text.trim(), unit_nanoseconds).ok_or_else(|| {
            self.error(
                field,
                text,
                "expected a non-negative time that fits in 64 bits of microseconds",
            )
        })
    }
}

/// Converts a non-negative decimal number of units to whole microseconds (truncating).
///
/// Done in integers rather than `f64` so that nanosecond timestamps of long traces keep
/// every digit.
pub(crate) fn decimal_to_microseconds(text: &str, unit_nanoseconds: u64) -> Option<u64> {
    let (whole_text, fraction_text) = text.split_once('.').unwrap_or((text, ""));
    if whole_text.is_empty() && fraction_text.is_empty() {
        return None;
    }
    if !whole_text.bytes().all(|b| b.is_ascii_digit())
        || !fraction_text.bytes().all(|b| b.is_ascii_digit())
    {
        return None;
    }
    let whole: u128 = if whole_text.is_empty() {
        0
    } else {
        whole_text.parse().ok()?
    };
    // Digits past the ninth are below a nanosecond of a second; drop them.
    let digits = &fraction_text[..fraction_text.len().min(9)];
    let fraction: u128 = if digits.is_empty() {
        0
    } else {
        digits.parse().ok()?
    };
    let fraction_scale = 10u128.pow(digits.len() as u32);
    let unit = u128::from(unit_nanoseconds);
    let total_nanoseconds = whole
        .checked_mul(unit)?
        .checked_add(fraction * unit / fraction_scale)?;
    u64::try_from(total_nanoseconds / 1000).ok()
}
