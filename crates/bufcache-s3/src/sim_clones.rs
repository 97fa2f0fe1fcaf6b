//! `bufcache sim check --layout log`, clones: how the check makes a clone of a snapshot its
//! disk took, in the same faulty simulated store ([`crate::sim_store`]). The clone is then
//! a second disk of the seed, driven by a harness of its own (module `sim_check`): seeded
//! writes, zeroes, reads, flushes, snapshots, collection rounds, clean closes and crashes,
//! interleaved with the base's steps, under the same request faults, hangs and late
//! landings, and reopened after a crash as the base is. What is checked:
//! - the clone, at its first open, reads its snapshot's content (fixed by the snapshot's
//!   first read back) block by block;
//! - after every crash and reopen of the clone, it equals a prefix of its own writes since
//!   its previous open that includes every write a FLUSH acknowledged, over the image it
//!   had then, so a block it never wrote reads its snapshot's content all its life;
//! - after every collection round and every reopen of the base (the moments the base may
//!   delete segments), the open clone is read whole and must read its latest acknowledged
//!   data, and every base segment it names must exist.
//!
//! The planted defect `planted-snapshot-defect` (the collector and an open's cleanup
//! deleting segments only a snapshot holds) is caught here too: the clone then names a base
//! segment that is gone.

use std::sync::Arc;

use object_store::ObjectStore;

use crate::S3Url;

/// Why making a clone failed (a request of the faulty store, or no runtime to run it on).
#[derive(Debug, thiserror::Error)]
pub(crate) enum CloneError {
    #[error("a runtime: {0}")]
    Runtime(#[from] std::io::Error),
    #[error(transparent)]
    Snapshot(#[from] crate::SnapshotError),
}

/// Makes the clone at `clone_url` of snapshot `name` of the disk at `base_url` through
/// `store` (one instance's connection, under its faults), as `bufcache disk clone` does:
/// the record's create-only PUT, GETs of the base's metadata and of the snapshot, the clone
/// metadata's create-only PUT.
pub(crate) fn create_clone(
    store: Arc<dyn ObjectStore>,
    base_url: &S3Url,
    clone_url: &S3Url,
    name: &str,
) -> Result<(), CloneError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        crate::admin::create_clone_objects(&*store, &*store, base_url, clone_url, name).await?;
        Ok(())
    })
}
