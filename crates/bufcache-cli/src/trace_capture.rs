//! `serve --trace FILE`: records every NBD request as one CSV line that both `bufcache replay`
//! and libCacheSim read:
//!
//! ```text
//! time_us,export,op,offset_bytes,length_bytes,obj_id
//! 1532,0,read,1048576,4096,1048576
//! ```
//!
//! `time_us` counts from the server's start, `export` is the export's index in the order the
//! server printed them, `obj_id` is the byte offset with the export index in bits 56 and up
//! (so exports never share a key). Replay it with
//! `bufcache replay FILE --format csv --trace-options "time-col=1,obj-id-col=6,obj-size-col=5,op-col=3,has-header=true,lbn-size=1"`;
//! libCacheSim: `cachesim FILE csv lru 1GiB -t "time-col=1,obj-id-col=6,obj-size-col=5,op-col=3,header=true"`.
//!
//! The file is bounded: when the next line would pass `--trace-size-max`, recording stops
//! and the log says so. Lines are buffered (64 KiB) and the buffer is written when full and
//! when the server exits.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

use anyhow::Context;

/// The operations a trace line can name (the `op` column).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TraceOperation {
    Read,
    Write,
    Flush,
    Trim,
    WriteZeroes,
    Cache,
}

impl TraceOperation {
    fn name(self) -> &'static str {
        match self {
            TraceOperation::Read => "read",
            TraceOperation::Write => "write",
            TraceOperation::Flush => "flush",
            TraceOperation::Trim => "trim",
            TraceOperation::WriteZeroes => "write_zeroes",
            TraceOperation::Cache => "cache",
        }
    }
}

/// The trace-options string that replays a captured file.
pub const REPLAY_OPTIONS: &str =
    "time-col=1,obj-id-col=6,obj-size-col=5,op-col=3,has-header=true,lbn-size=1";

/// The first line of every captured file.
const HEADER: &str = "time_us,export,op,offset_bytes,length_bytes,obj_id\n";

/// Whether `path` starts with a capture's header (so [`REPLAY_OPTIONS`] reads it).
pub fn is_capture(path: &Path) -> bool {
    let mut start = [0u8; HEADER.len()];
    File::open(path)
        .and_then(|mut file| std::io::Read::read_exact(&mut file, &mut start))
        .is_ok_and(|()| start == HEADER.as_bytes())
}

struct Output {
    writer: Option<BufWriter<File>>,
    bytes_written: u64,
}

/// Appends request lines to the trace file until it reaches its size limit.
pub struct TraceRecorder {
    path: PathBuf,
    started: Instant,
    bytes_max: u64,
    output: Mutex<Output>,
}

impl TraceRecorder {
    /// Creates (truncates) `path` and writes the header.
    pub fn create(path: &Path, bytes_max: u64) -> anyhow::Result<TraceRecorder> {
        let file = File::create(path)
            .with_context(|| format!("--trace {}: cannot create", path.display()))?;
        let mut writer = BufWriter::with_capacity(1 << 16, file);
        let header = HEADER;
        writer
            .write_all(header.as_bytes())
            .with_context(|| format!("--trace {}", path.display()))?;
        Ok(TraceRecorder {
            path: path.to_path_buf(),
            started: Instant::now(),
            bytes_max,
            output: Mutex::new(Output {
                writer: Some(writer),
                bytes_written: header.len() as u64,
            }),
        })
    }

    /// Records one request; after the limit or a write error, does nothing (logged once).
    pub fn record(&self, export: u64, operation: TraceOperation, offset: u64, length: u64) {
        let time_us = self.started.elapsed().as_micros();
        let object_id = (export << 56) | (offset & ((1 << 56) - 1));
        let line = format!(
            "{time_us},{export},{},{offset},{length},{object_id}\n",
            operation.name()
        );
        let mut guard = self.output.lock().unwrap_or_else(|e| e.into_inner());
        let output = &mut *guard;
        let Some(writer) = output.writer.as_mut() else {
            return;
        };
        if output.bytes_written + line.len() as u64 > self.bytes_max {
            let _ = writer.flush();
            output.writer = None;
            tracing::warn!(path = %self.path.display(), bytes_max = self.bytes_max, "trace reached --trace-size-max: recording stopped");
            crate::log::say!(
                "trace {} reached --trace-size-max ({} bytes): recording stopped",
                self.path.display(),
                self.bytes_max
            );
            return;
        }
        if let Err(error) = writer.write_all(line.as_bytes()) {
            output.writer = None;
            crate::log::say!(
                "trace {}: write failed, recording stopped: {error}",
                self.path.display()
            );
            return;
        }
        output.bytes_written += line.len() as u64;
    }
}

impl Drop for TraceRecorder {
    fn drop(&mut self) {
        let output = self.output.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some(writer) = output.writer.as_mut() {
            if let Err(error) = writer.flush() {
                crate::log::say!("trace {}: {error}", self.path.display());
            }
        }
    }
}
