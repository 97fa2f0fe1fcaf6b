//! The layouts an [`crate::S3Device`] can drive, behind one set of calls, so the device
//! adapter does not care which one the disk's metadata object names.

use bytes::Bytes;

use crate::error::{OpenError, StoreError};
use crate::log::{LogConfig, LogStore};
use std::sync::Arc;

use crate::meters::{LogStoreStats, StoreMeters};
use crate::replica::Replica;
use crate::store::{connect_counted, ChunkStore, Create, DiskState, ReadOnly};
use crate::url::{LayoutKind, S3Url};

/// A disk of either layout (one per device: the size difference does not matter).
#[allow(clippy::large_enum_variant)]
pub enum Layout {
    Chunk(ChunkStore),
    Log(LogStore),
    /// A read replica of a log-layout disk (`follow=`).
    Replica(Arc<Replica>),
}

/// Why a replica refuses writes.
static REPLICA: ReadOnly = ReadOnly::Replica;

impl Layout {
    /// Opens the disk `url` names with the layout its metadata object records (a new disk
    /// gets the URL's `layout=`, else [`crate::LAYOUT_DEFAULT`]) and takes its lock; every
    /// request is counted in `meters`.
    /// A standby's open (`url.standby`) tells `watching` of each renewal of the holder's lease
    /// it sees while it waits for it to lapse.
    pub fn open_locked_watching(
        url: &S3Url,
        meters: Arc<StoreMeters>,
        watching: Option<Arc<crate::lease::LeaseSeen>>,
    ) -> Result<Layout, OpenError> {
        if url.follow_ms.is_some() {
            return Err(OpenError::Config {
                url: url.to_string(),
                reason: "follow= makes a read replica, which never writes: serve it read-only (-r)"
                    .to_string(),
            });
        }
        if url.standby && url.lease_ms.is_none() {
            return Err(OpenError::Config {
                url: url.to_string(),
                reason: "a standby takes the disk when the writer's lease lapses, and lease=off has none".to_string(),
            });
        }
        let chunk_refused = || {
            OpenError::Config {
            url: url.to_string(),
            reason: "a standby needs the log layout: a chunk-layout disk has no epochs to fence a paused writer's late writes, so only break-lock= takes it over".to_string(),
        }
        };
        if url.standby && url.layout == Some(LayoutKind::Chunk) {
            return Err(chunk_refused());
        }
        let connection = connect_counted(url, Create::IfAsked, meters)?;
        match connection.metadata.layout {
            LayoutKind::Chunk if url.standby => Err(chunk_refused()),
            LayoutKind::Chunk => Ok(Layout::Chunk(
                ChunkStore::from_connection(url, connection)?.take_lock(url)?,
            )),
            LayoutKind::Log => Ok(Layout::Log(LogStore::from_connection(
                url,
                connection,
                LogConfig::from_url(url),
                watching,
            )?)),
        }
    }

    /// Opens an existing disk read-only, writing nothing (see [`ChunkStore::open_read_only`]
    /// and [`LogStore::open_read_only`]); every request is counted in `meters`.
    pub fn open_read_only(url: &S3Url, meters: Arc<StoreMeters>) -> Result<Layout, OpenError> {
        if url.follow_ms.is_some() {
            return Ok(Layout::Replica(Replica::open(url, meters)?));
        }
        let connection = connect_counted(url, Create::Never, meters)?;
        match connection.metadata.layout {
            LayoutKind::Chunk => Ok(Layout::Chunk(ChunkStore::read_only_from_connection(
                url, connection,
            )?)),
            LayoutKind::Log => Ok(Layout::Log(LogStore::read_only_from_connection(
                url,
                connection,
                LogConfig::from_url(url),
                ReadOnly::Requested,
            )?)),
        }
    }

    /// Why the disk refuses writes; None when it takes them.
    pub fn read_only(&self) -> Option<&ReadOnly> {
        match self {
            Layout::Chunk(store) => store.read_only(),
            Layout::Log(store) => store.read_only(),
            Layout::Replica(_) => Some(&REPLICA),
        }
    }

    pub fn read(&self, buffer: &mut [u8], offset: u64) -> Result<(), StoreError> {
        match self {
            Layout::Chunk(store) => store.read(buffer, offset),
            Layout::Log(store) => store.read(buffer, offset),
            Layout::Replica(replica) => replica.read(buffer, offset),
        }
    }

    pub fn write(&self, data: Bytes, offset: u64) -> Result<(), StoreError> {
        match self {
            Layout::Chunk(store) => store.write(data, offset),
            Layout::Log(store) => store.write(&data, offset),
            Layout::Replica(replica) => Err(replica_refuses(replica)),
        }
    }

    pub fn write_batch(&self, writes: Vec<(Bytes, u64)>) -> Vec<Result<(), StoreError>> {
        match self {
            Layout::Chunk(store) => store.write_batch(writes),
            Layout::Log(store) => store.write_batch(writes),
            Layout::Replica(replica) => writes
                .iter()
                .map(|_| Err(replica_refuses(replica)))
                .collect(),
        }
    }

    pub fn write_zeroes(&self, offset: u64, length: u64) -> Result<(), StoreError> {
        match self {
            Layout::Chunk(store) => store.write_zeroes(offset, length),
            Layout::Log(store) => store.write_zeroes(offset, length),
            Layout::Replica(replica) => Err(replica_refuses(replica)),
        }
    }

    /// The chunk layout acknowledges each write only once stored, so it has nothing to wait
    /// for; the log layout seals and uploads its open segment.
    pub fn flush(&self) -> Result<(), StoreError> {
        match self {
            Layout::Chunk(_) | Layout::Replica(_) => Ok(()),
            Layout::Log(store) => store.flush(),
        }
    }

    /// The disk's identity and generation as its metadata object recorded them at open.
    pub fn state(&self) -> DiskState {
        match self {
            Layout::Chunk(store) => DiskState::of(&store.metadata()),
            Layout::Log(store) => DiskState::of(&store.metadata()),
            Layout::Replica(replica) => DiskState::of(&replica.current().metadata()),
        }
    }

    /// The runs of `[offset, offset + length)` as (length, holds data); see
    /// [`ChunkStore::stored_runs`] and [`LogStore::mapped_runs`].
    pub fn data_runs(&self, offset: u64, length: u64) -> Vec<(u64, bool)> {
        match self {
            Layout::Chunk(store) => store.stored_runs(offset, length),
            Layout::Log(store) => store.mapped_runs(offset, length),
            Layout::Replica(replica) => replica.current().mapped_runs(offset, length),
        }
    }

    /// The log layout's store figures (None for the chunk layout).
    pub fn log_stats(&self) -> Option<LogStoreStats> {
        let view;
        let store = match self {
            Layout::Log(store) => store,
            Layout::Replica(replica) => {
                view = replica.current();
                &*view
            }
            Layout::Chunk(_) => return None,
        };
        let live_bytes = store.mapped_bytes();
        let gc = store.gc_totals();
        Some(LogStoreStats {
            live_bytes,
            garbage_bytes: store.stored_segment_bytes().saturating_sub(live_bytes),
            segments: store.stored_segments(),
            gc_passes: gc.rounds,
            gc_bytes_moved: gc.bytes_read,
        })
    }

    pub fn size_bytes(&self) -> u64 {
        match self {
            Layout::Chunk(store) => store.metadata().size_bytes,
            Layout::Log(store) => store.metadata().size_bytes,
            Layout::Replica(replica) => replica.current().metadata().size_bytes,
        }
    }

    /// The chunk size for the chunk layout (a partial chunk costs a read-modify-write); 1 for
    /// the log layout, where every write costs its own bytes.
    pub fn write_unit_bytes(&self) -> u64 {
        match self {
            Layout::Chunk(store) => store.metadata().chunk_size_bytes,
            Layout::Log(_) | Layout::Replica(_) => 1,
        }
    }

    pub fn requests_in_flight_max(&self) -> usize {
        match self {
            Layout::Chunk(store) => store.requests_in_flight_max(),
            Layout::Log(store) => store.config().requests_in_flight_max,
            Layout::Replica(replica) => replica.current().config().requests_in_flight_max,
        }
    }

    pub fn url(&self) -> &S3Url {
        match self {
            Layout::Chunk(store) => store.url(),
            Layout::Log(store) => store.url(),
            Layout::Replica(replica) => replica.url(),
        }
    }
}

fn replica_refuses(replica: &Replica) -> StoreError {
    StoreError::ReadOnly {
        url: replica.url().to_string(),
        reason: REPLICA.to_string(),
    }
}
