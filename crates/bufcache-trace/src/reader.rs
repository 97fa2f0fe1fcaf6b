//! [`TraceReader`]: one iterator type over every format, generic over any `BufRead`.
//!
//! Static dispatch over the per-format readers, so a reader over a `Send` input is
//! itself `Send`, and reading from memory (`&[u8]`) runs the same code as reading a file.

use std::io::BufRead;
use std::iter::FusedIterator;
use std::path::PathBuf;

use crate::blkparse::BlkparseReader;
use crate::csv::CsvReader;
use crate::error::TraceError;
use crate::fio::FioReader;
use crate::format::TraceFormat;
use crate::msr::MsrReader;
use crate::options::TraceOptions;
use crate::oracle::OracleGeneralReader;
use crate::vscsi::VscsiReader;
use crate::TraceRequest;

/// A streaming reader of any supported format.
#[derive(Debug)]
pub struct TraceReader<R> {
    format: FormatReader<R>,
}

#[derive(Debug)]
enum FormatReader<R> {
    Csv(CsvReader<R>),
    Blkparse(BlkparseReader<R>),
    Msr(MsrReader<R>),
    Fio(FioReader<R>),
    OracleGeneral(OracleGeneralReader<R>),
    Vscsi(VscsiReader<R>),
}

impl<R: BufRead> TraceReader<R> {
    /// Wraps `input`; `source` names it in errors (a path, or `<memory>`).
    ///
    /// Fails early on options the format cannot use and on a bad header (fio's first
    /// line, vscsi's version detection).
    pub fn new(
        input: R,
        source: impl Into<PathBuf>,
        format: TraceFormat,
        options: &TraceOptions,
    ) -> Result<Self, TraceError> {
        let path = source.into();
        let format = match format {
            TraceFormat::Csv => FormatReader::Csv(CsvReader::new(input, path, options)?),
            TraceFormat::Blkparse => {
                FormatReader::Blkparse(BlkparseReader::new(input, path, options))
            }
            TraceFormat::Msr => FormatReader::Msr(MsrReader::new(input, path)),
            TraceFormat::Fio => FormatReader::Fio(FioReader::new(input, path)?),
            TraceFormat::OracleGeneral => {
                FormatReader::OracleGeneral(OracleGeneralReader::new(input, path, options))
            }
            TraceFormat::Vscsi => FormatReader::Vscsi(VscsiReader::new(input, path, options)?),
        };
        Ok(TraceReader { format })
    }
}

impl<R: BufRead> Iterator for TraceReader<R> {
    type Item = Result<TraceRequest, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        match &mut self.format {
            FormatReader::Csv(reader) => reader.next(),
            FormatReader::Blkparse(reader) => reader.next(),
            FormatReader::Msr(reader) => reader.next(),
            FormatReader::Fio(reader) => reader.next(),
            FormatReader::OracleGeneral(reader) => reader.next(),
            FormatReader::Vscsi(reader) => reader.next(),
        }
    }
}

/// Every reader returns `None` forever once its input is exhausted or broken.
impl<R: BufRead> FusedIterator for TraceReader<R> {}
