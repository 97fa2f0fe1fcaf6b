//! What a test of an export layer ([`ExportLayer`]) needs to see that the layer drops no
//! capability of the export it wraps: [`Distinctive`], an export whose every answer differs
//! from [`Export`]'s defaults, and [`advertised`], everything an export answers without
//! changing its data. Compiled for this crate's tests and, with the `test-support` feature,
//! for other crates' tests (bufcache-cli's request meters and observers are layers too).

use std::io::{self, IoSlice};
use std::sync::Arc;

use crate::export::MEMORY_PAGE_BYTES;
use crate::{CacheStateExtent, Export, ExportLayer, HeldRead, MemoryExport, ReadDone};

/// A read-only memory export whose every capability answers other than `Export`'s
/// defaults, so that a layer which lost one would be seen answering the default. Its
/// description says whether it is a connection's view.
pub struct Distinctive {
    inner: Arc<dyn Export>,
    connection: bool,
}

/// The bytes of a read [`Distinctive`] starts (none: only that it started is compared).
struct Held;

impl HeldRead for Held {
    fn slices(&self) -> Vec<IoSlice<'_>> {
        Vec::new()
    }
}

impl Distinctive {
    /// The shared export (not a connection's view): four pages, read-only, with ten bytes
    /// of 7 at the start of the second page (so reads and block status see data and holes).
    pub fn shared() -> Arc<dyn Export> {
        let memory = MemoryExport::new(4 * MEMORY_PAGE_BYTES);
        memory
            .write(MEMORY_PAGE_BYTES, &[7; 10], false)
            .expect("a write inside a fresh memory export succeeds");
        Arc::new(Distinctive {
            inner: Arc::new(memory.with_read_only(true)),
            connection: false,
        })
    }
}

impl ExportLayer for Distinctive {
    fn inner(&self) -> &Arc<dyn Export> {
        &self.inner
    }
    fn over(&self, inner: Arc<dyn Export>) -> Arc<dyn Export> {
        Arc::new(Distinctive {
            inner,
            connection: self.connection,
        })
    }
    fn description(&self) -> String {
        format!("distinctive, connection {}", self.connection)
    }
    fn preferred_block_size(&self) -> u32 {
        512
    }
    fn cache_request_bytes_max(&self) -> u64 {
        12_345
    }
    fn read_is_quick(&self, _offset: u64, _length: u64) -> bool {
        false
    }
    fn write_is_quick(&self, _offset: u64, _length: u64, _fua: bool) -> bool {
        false
    }
    fn start_read(&self, _offset: u64, _length: u32, done: ReadDone) -> Result<(), ReadDone> {
        done(Ok(Box::new(Held)));
        Ok(())
    }
    fn open_connection(&self) -> Option<Arc<dyn Export>> {
        Some(Arc::new(Distinctive {
            inner: Arc::clone(&self.inner),
            connection: true,
        }))
    }
    fn has_cache_state(&self) -> bool {
        true
    }
    fn cache_state(&self, _offset: u64, length: u64) -> io::Result<Vec<CacheStateExtent>> {
        Ok(vec![CacheStateExtent {
            length,
            resident: true,
            dirty: true,
        }])
    }
    fn may_acknowledge_changes(&self) -> io::Result<()> {
        Err(io::Error::other("the lease lapsed"))
    }
}

/// What `export` advertises and answers, for comparing an export with a layer over it:
/// every method of `Export` that does not change the data. It reads three times (`read`,
/// `read_with`, and a `start_read` that [`Distinctive`] finishes) and opens one
/// connection's view.
pub fn advertised(export: &dyn Export) -> String {
    let length = 2 * MEMORY_PAGE_BYTES;
    let mut buffer = vec![0u8; length as usize];
    let mut sent = Vec::new();
    let read_with = export.read_with(0, &mut buffer, &mut |slices| {
        sent.extend(slices.iter().map(|slice| slice.len()));
        Ok(())
    });
    let started = export.start_read(0, 4096, Box::new(|_| {})).is_ok();
    let connection = export.open_connection().map(|view| view.description());
    format!(
        "size {} read_only {} description {:?} preferred_block_size {} read {:?} \
         read_with {:?} {sent:?} can_fast_zero {} cache {:?} cache_request_bytes_max {} \
         read_is_quick {} start_read {started} write_is_quick {} connection {connection:?} \
         block_status {:?} has_cache_state {} cache_state {:?} known_zeroes {:?} \
         may_acknowledge_changes {:?}",
        export.size(),
        export.read_only(),
        export.description(),
        export.preferred_block_size(),
        export
            .read(MEMORY_PAGE_BYTES, &mut [0u8; 4])
            .map_err(|error| error.to_string()),
        read_with.map_err(|error| error.to_string()),
        export.can_fast_zero(),
        export.cache(0, length).map_err(|error| error.to_string()),
        export.cache_request_bytes_max(),
        export.read_is_quick(0, length),
        export.write_is_quick(0, length, false),
        export
            .block_status(0, length)
            .map_err(|error| error.to_string()),
        export.has_cache_state(),
        export
            .cache_state(0, length)
            .map_err(|error| error.to_string()),
        export.known_zeroes(0, length),
        export
            .may_acknowledge_changes()
            .map_err(|error| error.to_string()),
    )
}
