//! The NBD export adapter that watches requests for the live what-if and trace capture:
//! [`ObservedExport`] wraps any [`Export`], reports each request, then delegates. With both
//! features off, [`wrap`] returns the export unchanged, so nothing is added to the path.

use std::sync::Arc;

use bufcache_nbd::{Export, ExportLayer};

use crate::trace_capture::{TraceOperation, TraceRecorder};
use crate::whatif::WhatIfFeed;

/// Serve flags of the live what-if and of trace capture.
#[derive(clap::Args, Debug, Clone)]
pub struct ObserveArgs {
    /// Fraction of blocks (chosen by a hash of their address) fed to the what-if miniature
    /// caches (the configured policy and LRU at 1/4, 1/2, 1, 2, 4, 8 times --cache-size; see
    /// /metrics, /stats, `bufcache stat`). Raised so the 1x miniature holds at least 1024
    /// blocks, lowered so it holds at most 2048 (a few MiB in all). 0 turns the what-if off.
    #[arg(long, value_name = "RATE", default_value_t = 0.01)]
    pub whatif_sampling_rate: f64,
    /// Record every request (time, export, op, offset, length) in FILE, a CSV that
    /// `bufcache replay` and libCacheSim read (the log prints the replay command).
    #[arg(long, value_name = "FILE")]
    pub trace: Option<std::path::PathBuf>,
    /// Stop recording when the trace file would grow past this size. Default 1GiB.
    #[arg(long, value_name = "SIZE", default_value = "1GiB", value_parser = |text: &str| bufcache::parse_size(text).map_err(|e| e.to_string()))]
    pub trace_size_max: u64,
}

/// What watches the requests of every export.
#[derive(Clone, Default)]
pub struct Observers {
    pub whatif: Option<Arc<WhatIfFeed>>,
    pub trace: Option<Arc<TraceRecorder>>,
}

impl Observers {
    /// Starts what `args` asks for, for a cache of `cache_size_bytes` run by `policy`.
    pub fn start(
        args: &ObserveArgs,
        policy: bufcache_policy::PolicyKind,
        parameters: &bufcache_policy::PolicyParameters,
        cache_size_bytes: u64,
        block_size_bytes: u64,
    ) -> anyhow::Result<Observers> {
        let whatif = WhatIfFeed::start(
            args.whatif_sampling_rate,
            policy,
            cache_size_bytes,
            block_size_bytes,
            parameters,
        )?;
        let trace = match &args.trace {
            Some(path) => {
                let recorder = TraceRecorder::create(path, args.trace_size_max)?;
                crate::log::say!(
                    "recording requests in {} (at most {} bytes); replay with: \
                     bufcache replay {} --format csv --trace-options \"{}\" --cache-size SIZE",
                    path.display(),
                    args.trace_size_max,
                    path.display(),
                    crate::trace_capture::REPLAY_OPTIONS
                );
                Some(Arc::new(recorder))
            }
            None => None,
        };
        Ok(Observers { whatif, trace })
    }
}

/// An export whose requests also feed the what-if miniatures and the trace.
pub struct ObservedExport {
    inner: Arc<dyn Export>,
    observers: Observers,
    export: u64,
}

/// Wraps `inner`, the `export`-th export, so `observers` see its requests; returns it
/// unchanged when nothing observes.
pub fn wrap(observers: &Observers, export: usize, inner: Arc<dyn Export>) -> Arc<dyn Export> {
    if observers.whatif.is_none() && observers.trace.is_none() {
        return inner;
    }
    Arc::new(ObservedExport {
        inner,
        observers: observers.clone(),
        export: export as u64,
    })
}

impl ObservedExport {
    fn observe(&self, operation: TraceOperation, offset: u64, length: u64) {
        if let Some(trace) = &self.observers.trace {
            trace.record(self.export, operation, offset, length);
        }
        if let Some(whatif) = &self.observers.whatif {
            match operation {
                TraceOperation::Read | TraceOperation::Write => {
                    whatif.record(self.export, offset, length, false)
                }
                TraceOperation::Trim => whatif.record(self.export, offset, length, true),
                TraceOperation::Flush | TraceOperation::WriteZeroes | TraceOperation::Cache => {}
            }
        }
    }
}

// Only what observing adds: every other method forwards to the inner export.
impl ExportLayer for ObservedExport {
    fn inner(&self) -> &Arc<dyn Export> {
        &self.inner
    }

    fn over(&self, inner: Arc<dyn Export>) -> Arc<dyn Export> {
        Arc::new(ObservedExport {
            inner,
            observers: self.observers.clone(),
            export: self.export,
        })
    }

    fn read(&self, offset: u64, buffer: &mut [u8]) -> std::io::Result<()> {
        self.observe(TraceOperation::Read, offset, buffer.len() as u64);
        self.inner.read(offset, buffer)
    }

    fn read_with(
        &self,
        offset: u64,
        buffer: &mut [u8],
        send: &mut bufcache_nbd::ReadSink<'_>,
    ) -> std::io::Result<()> {
        self.observe(TraceOperation::Read, offset, buffer.len() as u64);
        self.inner.read_with(offset, buffer, send)
    }

    fn write(&self, offset: u64, data: &[u8], fua: bool) -> std::io::Result<()> {
        self.observe(TraceOperation::Write, offset, data.len() as u64);
        self.inner.write(offset, data, fua)
    }

    fn flush(&self) -> std::io::Result<()> {
        self.observe(TraceOperation::Flush, 0, 0);
        self.inner.flush()
    }

    fn trim(&self, offset: u64, length: u64, fua: bool) -> std::io::Result<()> {
        self.observe(TraceOperation::Trim, offset, length);
        self.inner.trim(offset, length, fua)
    }

    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        may_trim: bool,
        fast_only: bool,
        fua: bool,
    ) -> std::io::Result<()> {
        self.observe(TraceOperation::WriteZeroes, offset, length);
        self.inner
            .write_zeroes(offset, length, may_trim, fast_only, fua)
    }

    fn cache(&self, offset: u64, length: u64) -> std::io::Result<()> {
        self.observe(TraceOperation::Cache, offset, length);
        self.inner.cache(offset, length)
    }

    /// Observed only when it starts: a read not started is served (and observed) by
    /// `read_with`.
    fn start_read(
        &self,
        offset: u64,
        length: u32,
        done: bufcache_nbd::ReadDone,
    ) -> Result<(), bufcache_nbd::ReadDone> {
        self.inner.start_read(offset, length, done)?;
        self.observe(TraceOperation::Read, offset, u64::from(length));
        Ok(())
    }

    fn write_from(
        &self,
        offset: u64,
        length: u64,
        fua: bool,
        source: &mut bufcache_nbd::export::WriteSource<'_>,
    ) -> std::io::Result<()> {
        self.observe(TraceOperation::Write, offset, length);
        self.inner.write_from(offset, length, fua, source)
    }
}
