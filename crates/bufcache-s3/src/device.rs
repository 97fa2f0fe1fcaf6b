//! The thin adapter from a disk's layout ([`ChunkStore`] or [`LogStore`]) to the engine's
//! [`Device`] trait.

use std::io::{self, IoSlice, IoSliceMut};
use std::sync::Arc;

use bufcache_device::check_range;
use bufcache_device::{Capabilities, Device, Extent};
use bytes::{Bytes, BytesMut};

use crate::error::OpenError;
use crate::layout::Layout;
use crate::log::LogStore;
use crate::meters::{StoreMeters, StoreStats};
use crate::store::{advance_generation_counted, new_disk_id, ChunkStore, DiskState};
use crate::url::S3Url;

/// A batch's reads in flight at once are at most the store's request bound divided by this
/// (8 of the default 32): a chunk read is one or two GETs, a log-layout read a few.
pub const READ_SHARE_DIVISOR: usize = 4;

/// A bufcache device stored in an object store.
pub struct S3Device {
    store: Layout,
    /// The disk's identity and generation: as this open left them (raised by a writable
    /// open), or as read (a read-only one).
    state: DiskState,
    /// Every request of the disk's connection (counted only for a device opened here, not
    /// for one built over a store opened elsewhere).
    meters: Arc<StoreMeters>,
}

impl S3Device {
    /// A device over a chunk-layout disk.
    pub fn new(store: ChunkStore) -> Self {
        let store = Layout::Chunk(store);
        S3Device {
            state: store.state(),
            store,
            meters: StoreMeters::new(),
        }
    }

    /// A device over a log-layout disk.
    pub fn new_log(store: LogStore) -> Self {
        let store = Layout::Log(store);
        S3Device {
            state: store.state(),
            store,
            meters: StoreMeters::new(),
        }
    }

    /// Opens the disk `url` names in the layout its metadata records (creating it with the
    /// URL's `layout=` when asked to), takes its lock and raises its generation.
    pub fn open_locked(url: &S3Url) -> Result<Self, OpenError> {
        Self::open_locked_after_probe(url, None, new_disk_id(), StoreMeters::new())
    }

    /// [`S3Device::open_locked`] for a caller that checked what depends on the disk's state
    /// against `seen` (from [`crate::probe`]; None: no disk existed, or nothing to hold to)
    /// before anything was written: once the lock is held, the generation is raised only if
    /// it is still the one seen, and a disk without an id gets `proposed_id`.
    /// Its requests are counted in `meters`, those the probe was counted in.
    pub fn open_locked_after_probe(
        url: &S3Url,
        seen: Option<&DiskState>,
        proposed_id: u64,
        meters: Arc<StoreMeters>,
    ) -> Result<Self, OpenError> {
        Self::open_locked_watching(url, seen, proposed_id, meters, None)
    }

    /// [`S3Device::open_locked_after_probe`] for a standby (`url.standby`), telling
    /// `watching` of each renewal of the writer's lease it sees while it waits.
    pub fn open_locked_watching(
        url: &S3Url,
        seen: Option<&DiskState>,
        proposed_id: u64,
        meters: Arc<StoreMeters>,
        watching: Option<Arc<crate::lease::LeaseSeen>>,
    ) -> Result<Self, OpenError> {
        let store = Layout::open_locked_watching(url, Arc::clone(&meters), watching)?;
        let state = match store.read_only() {
            Some(_) => store.state(),
            None => advance_generation_counted(
                url,
                seen.map(|seen| seen.generation),
                proposed_id,
                Some(&meters),
            )?,
        };
        Ok(S3Device {
            store,
            state,
            meters,
        })
    }

    /// Opens an existing disk read-only, writing nothing at all (see
    /// [`ChunkStore::open_read_only`]).
    pub fn open_read_only(url: &S3Url) -> Result<Self, OpenError> {
        Self::open_read_only_counted(url, StoreMeters::new())
    }

    /// [`S3Device::open_read_only`] counting its requests in `meters` (with a probe's).
    pub fn open_read_only_counted(
        url: &S3Url,
        meters: Arc<StoreMeters>,
    ) -> Result<Self, OpenError> {
        let store = Layout::open_read_only(url, Arc::clone(&meters))?;
        Ok(S3Device {
            state: store.state(),
            store,
            meters,
        })
    }

    /// The disk's identity and generation (see [`DiskState`]).
    pub fn state(&self) -> DiskState {
        self.state
    }

    /// Every range written to this device whose data is not durable in the store yet, with
    /// that data (log layout: extents in the open segment or in sealed segments not uploaded;
    /// the chunk layout acknowledges a write only once stored, so it has none): what a
    /// shutdown that cannot reach the store saves elsewhere; and the bytes that could not be
    /// read back.
    pub fn undurable_extents(&self) -> (Vec<(u64, Vec<u8>)>, u64) {
        match &self.store {
            Layout::Chunk(_) | Layout::Replica(_) => (Vec::new(), 0),
            Layout::Log(store) => store.undurable_extents(),
        }
    }

    /// What the disk asked of its store so far (requests, bytes, retries, durations) and,
    /// for the log layout, what its objects hold.
    pub fn store_stats(&self) -> StoreStats {
        StoreStats {
            log: self.store.log_stats(),
            ..self.meters.stats()
        }
    }

    /// Why the disk refuses writes (asked for, or credentials that may not write); None when
    /// it takes them.
    pub fn read_only(&self) -> Option<&crate::ReadOnly> {
        self.store.read_only()
    }

    /// The chunk store, when the disk has the chunk layout.
    pub fn store(&self) -> Option<&ChunkStore> {
        match &self.store {
            Layout::Chunk(store) => Some(store),
            Layout::Log(_) | Layout::Replica(_) => None,
        }
    }

    /// The lease under which this open may acknowledge writes: a writable log-layout open
    /// (whose epochs fence a predecessor that lost it); None otherwise.
    pub fn lease(&self) -> Option<Arc<crate::lease::Lease>> {
        self.log_store()?.lock()?.lease().cloned()
    }

    /// The log store, when the disk has the log layout.
    pub fn log_store(&self) -> Option<&LogStore> {
        match &self.store {
            Layout::Log(store) => Some(store),
            Layout::Chunk(_) | Layout::Replica(_) => None,
        }
    }

    /// The read replica, when this open follows a log another server writes (`follow=`).
    pub fn replica(&self) -> Option<&Arc<crate::replica::Replica>> {
        match &self.store {
            Layout::Replica(replica) => Some(replica),
            Layout::Chunk(_) | Layout::Log(_) => None,
        }
    }

    /// What this open is to its disk: `writer` (holds the lock), `replica` (follows the
    /// writer, `follow=`), or None (read-only, following nothing).
    pub fn role(&self) -> Option<&'static str> {
        match &self.store {
            Layout::Replica(_) => Some("replica"),
            _ if self.read_only().is_none() => Some("writer"),
            _ => None,
        }
    }
}

/// The buffers' bytes, in order, as one owned payload (the store's requests outlive the borrow).
fn gather(buffers: &[IoSlice<'_>]) -> Bytes {
    let total: usize = buffers.iter().map(|buffer| buffer.len()).sum();
    let mut data = BytesMut::with_capacity(total);
    for buffer in buffers {
        data.extend_from_slice(buffer);
    }
    data.freeze()
}

/// Reads every slice of every read of `reads` as one log-layout batch (each slice is a
/// contiguous disk range of its own: its read's offset plus the slices before it); a read's
/// outcome is its first slice's error, if any.
fn read_log_batch(
    store: &LogStore,
    reads: &mut [bufcache_device::ReadRequest],
) -> Vec<Result<(), crate::StoreError>> {
    let offsets: Vec<u64> = reads.iter().map(|read| read.offset()).collect();
    let mut outcomes: Vec<Result<(), crate::StoreError>> = vec![Ok(()); reads.len()];
    let mut slices: Vec<Vec<IoSliceMut<'_>>> =
        reads.iter_mut().map(|read| read.slices_mut()).collect();
    let mut owners = Vec::new();
    let mut items: Vec<(&mut [u8], u64)> = Vec::new();
    for (read, (read_slices, offset)) in slices.iter_mut().zip(offsets).enumerate() {
        let mut position = offset;
        for slice in read_slices.iter_mut() {
            let slice: &mut [u8] = slice;
            let length = slice.len() as u64;
            items.push((slice, position));
            owners.push(read);
            position += length;
        }
    }
    for (read, outcome) in owners.into_iter().zip(store.read_batch(&mut items)) {
        if let (Ok(()), Err(error)) = (&outcomes[read], outcome) {
            outcomes[read] = Err(error);
        }
    }
    outcomes
}

impl Device for S3Device {
    fn read_vectored_at(&self, buffers: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<()> {
        if let [single] = buffers {
            return Ok(self.store.read(single, offset)?);
        }
        let total: usize = buffers.iter().map(|buffer| buffer.len()).sum();
        let mut data = vec![0u8; total];
        self.store.read(&mut data, offset)?;
        let mut position = 0;
        for buffer in buffers.iter_mut() {
            let length = buffer.len();
            buffer.copy_from_slice(&data[position..position + length]);
            position += length;
        }
        Ok(())
    }

    fn write_vectored_at(&self, buffers: &[IoSlice<'_>], offset: u64) -> io::Result<()> {
        Ok(self.store.write(gather(buffers), offset)?)
    }

    /// Every chunk request of every write goes to the store at once (up to the store's
    /// in-flight bound): a batch of scattered runs costs about one round trip, not one each.
    fn submit_writes(&self, mut writes: Vec<bufcache_device::WriteRequest>) {
        let gathered = writes
            .iter_mut()
            .map(|write| (gather(&write.slices()), write.offset()))
            .collect();
        let results = self.store.write_batch(gathered);
        for (write, result) in writes.into_iter().zip(results) {
            write.complete(result.map_err(io::Error::from));
        }
    }

    /// The reads of a batch (a read-ahead window's runs) go to the store together, each
    /// completing as its own GETs end: a window costs about one round trip, not one per run.
    /// At most a [`READ_SHARE_DIVISOR`]th of the store's request bound of reads are in flight
    /// at once, since one read may itself have several GETs in flight (a log-layout range
    /// spread over extents). They are done before this returns (`completes_later` is false),
    /// on short-lived threads that each take the next read.
    ///
    /// Log layout: the whole batch is one [`LogStore::read_batch`], whose GETs are in flight
    /// together and join runs that lie back to back in a segment (a window over data written
    /// sequentially costs about a GET per `get_bytes_max`, not one per run).
    fn submit_reads(&self, mut reads: Vec<bufcache_device::ReadRequest>) {
        if let Layout::Log(store) = &self.store {
            let outcomes = read_log_batch(store, &mut reads);
            for (read, outcome) in reads.into_iter().zip(outcomes) {
                read.complete(outcome.map_err(io::Error::from));
            }
            return;
        }
        if reads.len() <= 1 {
            return bufcache_device::read_each_now(self, reads);
        }
        let reads_in_flight_max = (self.store.requests_in_flight_max() / READ_SHARE_DIVISOR).max(1);
        let workers = reads.len().min(reads_in_flight_max);
        let queue = std::sync::Mutex::new(reads.into_iter());
        let next = || {
            queue
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .next()
        };
        let work = || {
            while let Some(mut read) = next() {
                let offset = read.offset();
                let result = self.read_vectored_at(&mut read.slices_mut(), offset);
                read.complete(result);
            }
        };
        std::thread::scope(|scope| {
            for _ in 1..workers {
                // A thread that cannot be started leaves its share to the others and to
                // this one, which works the queue too.
                let _ = std::thread::Builder::new()
                    .name("bufcache-s3-read".into())
                    .spawn_scoped(scope, work);
            }
            work();
        });
    }

    /// Chunk layout: every write returned only after the store acknowledged its PUTs and
    /// DELETEs, so there is nothing left to wait for. Log layout: the open segment is sealed
    /// and every segment up to it uploaded.
    fn flush(&self) -> io::Result<()> {
        Ok(self.store.flush()?)
    }

    fn discard(&self, offset: u64, length: u64) -> io::Result<()> {
        Ok(self.store.write_zeroes(offset, length)?)
    }

    fn write_zeroes(&self, offset: u64, length: u64) -> io::Result<()> {
        Ok(self.store.write_zeroes(offset, length)?)
    }

    /// Holes are what reads as zeroes without a request: ranges the log layout's index does
    /// not map, chunks the chunk layout does not store (known while it holds the disk lock;
    /// without it, everything is data). Answered from memory, never from the store.
    fn extents(&self, offset: u64, length: u64) -> io::Result<Vec<Extent>> {
        check_range(self.store.size_bytes(), offset, length)?;
        Ok(self
            .store
            .data_runs(offset, length)
            .into_iter()
            .map(|(length, data)| Extent {
                length,
                hole: !data,
            })
            .collect())
    }

    /// Discard and write-zeroes delete or rewrite chunks (chunk layout) or change only the
    /// index (log layout) without moving the caller's data. A store opened read-only (asked
    /// for, or credentials that may not write) says so, and the object over it refuses writes.
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            read_only: self.store.read_only().is_some(),
            discard_zeroes: true,
            write_zeroes_fast: true,
            write_unit_bytes: self.store.write_unit_bytes(),
            inflight_requests_max: self.store.requests_in_flight_max(),
            ..Capabilities::plain(self.store.size_bytes())
        }
    }

    fn describe(&self) -> String {
        self.store.url().to_string()
    }
}
