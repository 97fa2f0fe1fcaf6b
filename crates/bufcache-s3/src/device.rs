//! The thin adapter from [`ChunkStore`] to the engine's [`Device`] trait.

use std::io::{self, IoSlice, IoSliceMut};

use bufcache::device::all_data;
use bufcache::{Capabilities, Device, Extent};
use bytes::{Bytes, BytesMut};

use crate::store::ChunkStore;

/// A bufcache device stored in an object store.
pub struct S3Device {
    store: ChunkStore,
}

impl S3Device {
    pub fn new(store: ChunkStore) -> Self {
        S3Device { store }
    }

    pub fn store(&self) -> &ChunkStore {
        &self.store
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
    fn submit_writes(&self, mut writes: Vec<bufcache::device::WriteRequest>) {
        let gathered = writes
            .iter_mut()
            .map(|write| (gather(&write.slices()), write.offset()))
            .collect();
        let results = self.store.write_batch(gathered);
        for (write, result) in writes.into_iter().zip(results) {
            write.complete(result.map_err(io::Error::from));
        }
    }

    fn submit_reads(&self, reads: Vec<bufcache::device::ReadRequest>) {
        bufcache::device::read_each_now(self, reads)
    }

    /// Every write returned only after the store acknowledged its PUTs and DELETEs, so there
    /// is nothing left to wait for.
    fn flush(&self) -> io::Result<()> {
        Ok(())
    }

    fn discard(&self, offset: u64, length: u64) -> io::Result<()> {
        Ok(self.store.write_zeroes(offset, length)?)
    }

    fn write_zeroes(&self, offset: u64, length: u64) -> io::Result<()> {
        Ok(self.store.write_zeroes(offset, length)?)
    }

    /// Every chunk is data to the engine; a missing chunk reads as zeroes anyway.
    fn extents(&self, offset: u64, length: u64) -> io::Result<Vec<Extent>> {
        all_data(self.store.metadata().size_bytes, offset, length)
    }

    /// Discard and write-zeroes delete or rewrite chunks without moving the caller's data. A
    /// store opened read-only (asked for, or credentials that may not write) says so, and the
    /// object over it refuses writes.
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            read_only: self.store.read_only().is_some(),
            discard_zeroes: true,
            write_zeroes_fast: true,
            write_unit_bytes: self.store.metadata().chunk_size_bytes,
            inflight_requests_max: self.store.requests_in_flight_max(),
            ..Capabilities::plain(self.store.metadata().size_bytes)
        }
    }

    fn describe(&self) -> String {
        self.store.url().to_string()
    }
}
