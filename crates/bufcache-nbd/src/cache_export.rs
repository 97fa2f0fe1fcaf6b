//! The NBD side of the cache: [`CacheExport`] serves one cache object as an NBD export.
//!
//! It only translates: each NBD command becomes one call on the object handle, and every
//! decision (how to zero, whether a request will wait for I/O) is the engine's. Each
//! connection gets its own handle ([`Export::open_connection`]), so every connection's next
//! FLUSH hears of a write-back error once.

use std::io;
use std::sync::Arc;

use bufcache::{CacheError, ObjectHandle, Residency, StartedRead, StartedReadDone, ZeroOptions};

use crate::export::{BlockStatusExtent, CacheStateExtent, Export, ReadDone, ReadSink, WriteSource};

/// A cache object served as an NBD export.
pub struct CacheExport {
    object: ObjectHandle,
}

impl CacheExport {
    /// Serves `object`.
    pub fn new(object: ObjectHandle) -> Self {
        CacheExport { object }
    }
}

impl Export for CacheExport {
    fn size(&self) -> u64 {
        self.object.len()
    }

    fn read_only(&self) -> bool {
        self.object.is_read_only()
    }

    fn description(&self) -> String {
        format!("bufcache over {}", self.object.device().describe())
    }

    fn preferred_block_size(&self) -> u32 {
        self.object.block_size()
    }

    fn read(&self, offset: u64, buffer: &mut [u8]) -> io::Result<()> {
        Ok(self.object.read_at(offset, buffer)?)
    }

    fn read_with(&self, offset: u64, buffer: &mut [u8], send: &mut ReadSink<'_>) -> io::Result<()> {
        match self.object.read_with(offset, buffer, send) {
            Ok(()) => Ok(()),
            Err(CacheError::DataSink { source }) => Err(source),
            Err(error) => Err(error.into()),
        }
    }

    fn write(&self, offset: u64, data: &[u8], fua: bool) -> io::Result<()> {
        Ok(self.object.write_at(offset, data, fua)?)
    }

    fn write_from(
        &self,
        offset: u64,
        length: u64,
        fua: bool,
        source: &mut WriteSource<'_>,
    ) -> io::Result<()> {
        Ok(self.object.write_from(offset, length, fua, source)?)
    }

    fn flush(&self) -> io::Result<()> {
        Ok(self.object.flush()?)
    }

    fn trim(&self, offset: u64, length: u64, fua: bool) -> io::Result<()> {
        self.object.discard(offset, length)?;
        if fua {
            self.object.flush()?;
        }
        Ok(())
    }

    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        may_trim: bool,
        fast_only: bool,
        fua: bool,
    ) -> io::Result<()> {
        let options = ZeroOptions {
            may_deallocate: may_trim,
            fast_only,
            fua,
        };
        Ok(self.object.zero(offset, length, options)?)
    }

    fn can_fast_zero(&self) -> bool {
        self.object.can_zero_fast()
    }

    fn cache(&self, offset: u64, length: u64) -> io::Result<()> {
        Ok(self.object.prefetch(offset, length)?)
    }

    fn read_is_quick(&self, offset: u64, length: u64) -> bool {
        self.object.is_resident(offset, length)
    }

    fn start_read(&self, offset: u64, length: u32, done: ReadDone) -> Result<(), ReadDone> {
        let engine_done: StartedReadDone =
            Box::new(move |outcome| done(outcome.map_err(io::Error::from)));
        // The engine hands back its own callback when it declines; the export's is inside.
        self.object
            .start_read(offset, u64::from(length), engine_done)
            .map_err(|engine_done| -> ReadDone {
                Box::new(move |outcome: io::Result<StartedRead>| {
                    engine_done(outcome.map_err(|source| CacheError::DataSink { source }))
                })
            })
    }

    fn write_is_quick(&self, offset: u64, length: u64, fua: bool) -> bool {
        self.object.write_is_quick(offset, length, fua)
    }

    fn open_connection(&self) -> Option<Arc<dyn Export>> {
        Some(Arc::new(CacheExport {
            object: self.object.reopen(),
        }))
    }

    fn block_status(&self, offset: u64, length: u64) -> io::Result<Vec<BlockStatusExtent>> {
        let extents = self.object.extents(offset, length)?;
        Ok(extents
            .into_iter()
            .map(|extent| BlockStatusExtent {
                length: extent.length,
                hole: extent.hole,
                zero: extent.hole,
            })
            .collect())
    }

    fn has_cache_state(&self) -> bool {
        true
    }

    fn cache_state(&self, offset: u64, length: u64) -> io::Result<Vec<CacheStateExtent>> {
        let runs = self.object.residency(offset, length)?;
        Ok(runs
            .into_iter()
            .map(|run| CacheStateExtent {
                length: run.length,
                resident: run.state != Residency::Absent,
                dirty: run.state == Residency::Dirty,
            })
            .collect())
    }
}
