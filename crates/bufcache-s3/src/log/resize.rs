//! Growing a log-layout disk while its writer serves it (`bufcache disk resize URL SIZE
//! --control PATH`): the metadata object records the new size first, then this open's size
//! rises, so no extent past the old end is appended before the store says the disk reaches
//! there (an open checks every extent against the recorded size).
//!
//! Only growing: clients of a served disk learned its size when they connected, and NBD has
//! no message to tell them it shrank. A shrink is the offline `disk resize` (no server holds
//! the disk).

use std::sync::atomic::Ordering;
use std::sync::Mutex;

use super::{Core, LogStore};
use crate::error::OpenError;

/// Grows are serialized, so the metadata object and the size an open serves never disagree
/// in the order two grows would leave them in.
static GROWING: Mutex<()> = Mutex::new(());

impl Core {
    /// The disk's size now.
    pub(super) fn size_bytes(&self) -> u64 {
        self.shared.size_bytes.load(Ordering::Acquire)
    }
}

impl LogStore {
    /// Grows the disk to `size_bytes` (a multiple of 4 KiB, not less than its size now;
    /// equal is a no-op): rewrites the size in the metadata object (a GET and a PUT), then
    /// serves the new size. Refused, nothing changed, on a read-only open, a lapsed lease, a
    /// shrink or a size that is not a multiple of 4 KiB.
    pub fn grow(&self, size_bytes: u64) -> Result<(), OpenError> {
        let _serialized = GROWING
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let shared = &self.core.shared;
        let refused = |reason: String| OpenError::Config {
            url: shared.url.to_string(),
            reason: format!("{reason}: nothing was changed"),
        };
        let now = self.core.size_bytes();
        if size_bytes < now {
            return Err(refused(format!(
                "a served disk only grows ({size_bytes} bytes is less than its {now}: its clients were told {now} when they connected); stop the server and run `bufcache disk resize` to shrink it"
            )));
        }
        crate::store::check_new_size(&shared.url, &shared.metadata, size_bytes)?;
        if size_bytes == now {
            return Ok(());
        }
        self.core
            .check_writable()
            .and_then(|()| shared.check_lease())
            .map_err(|error| refused(format!("the disk cannot be grown here: {error}")))?;
        let store = shared.store.clone();
        let url = shared.url.clone();
        self.core
            .runtime
            .block_on(async move { crate::store::write_size(&*store, &url, size_bytes).await })?;
        let before = shared.size_bytes.swap(size_bytes, Ordering::AcqRel);
        assert_eq!(before, now, "grows are serialized");
        tracing::info!(disk = %shared.url, size_bytes_before = now, size_bytes, "grew the disk while serving it");
        Ok(())
    }
}
