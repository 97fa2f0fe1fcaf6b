//! `MemoryDevice`: a sparse in-memory device, for tests, simulation and `memory:SIZE` exports.
//!
//! Storage is a [`SparseStore`] of 64 KiB chunks; chunks that were never written (or were
//! wholly discarded) are absent and read as zeroes, so a `memory:1T` device costs only what is
//! written. Writes are immediately "durable": `flush` has nothing to do.

use std::io::{self, IoSlice, IoSliceMut};

use parking_lot::RwLock;

use crate::device::{check_range, total_length, Capabilities, Device, Extent};
use crate::sparse::SparseStore;

const CHUNK_SIZE: u64 = 64 * 1024;

/// A sparse device held in memory.
pub struct MemoryDevice {
    length_bytes: u64,
    store: RwLock<SparseStore>,
}

impl MemoryDevice {
    /// A device of `length_bytes` zero bytes.
    pub fn new(length_bytes: u64) -> Self {
        MemoryDevice {
            length_bytes,
            store: RwLock::new(SparseStore::new(CHUNK_SIZE)),
        }
    }

    /// Bytes of memory held by written chunks.
    pub fn allocated_bytes(&self) -> u64 {
        self.store.read().allocated_bytes()
    }

    /// Copies the device's contents at `offset` into `target`, for tests and checks.
    pub fn read_into(&self, offset: u64, target: &mut [u8]) -> io::Result<()> {
        self.read_vectored_at(&mut [IoSliceMut::new(target)], offset)
    }
}

impl Device for MemoryDevice {
    fn read_vectored_at(&self, buffers: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<()> {
        check_range(
            self.length_bytes,
            offset,
            total_length(buffers.iter().map(|b| b.len())),
        )?;
        self.store.read().read_vectored(offset, buffers);
        Ok(())
    }

    fn write_vectored_at(&self, buffers: &[IoSlice<'_>], offset: u64) -> io::Result<()> {
        check_range(
            self.length_bytes,
            offset,
            total_length(buffers.iter().map(|b| b.len())),
        )?;
        let mut store = self.store.write();
        let mut position = offset;
        for buffer in buffers {
            store.write(position, buffer);
            position += buffer.len() as u64;
        }
        Ok(())
    }

    fn submit_reads(&self, reads: Vec<crate::request::ReadRequest>) {
        crate::device::read_each_now(self, reads)
    }

    fn submit_writes(&self, writes: Vec<crate::request::WriteRequest>) {
        crate::device::write_each_now(self, writes)
    }

    fn flush(&self) -> io::Result<()> {
        Ok(())
    }

    fn discard(&self, offset: u64, length: u64) -> io::Result<()> {
        self.write_zeroes(offset, length)
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            discard_zeroes: true,
            write_zeroes_fast: true,
            extents: true,
            ..Capabilities::plain(self.length_bytes)
        }
    }

    fn write_zeroes(&self, offset: u64, length: u64) -> io::Result<()> {
        check_range(self.length_bytes, offset, length)?;
        self.store.write().zero(offset, length);
        Ok(())
    }

    fn extents(&self, offset: u64, length: u64) -> io::Result<Vec<Extent>> {
        check_range(self.length_bytes, offset, length)?;
        Ok(self.store.read().extents(offset, length))
    }

    fn describe(&self) -> String {
        format!("memory:{}", self.length_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_back_what_was_written_across_chunks() {
        let device = MemoryDevice::new(1 << 20);
        let data: Vec<u8> = (0..100_000u32).map(|i| i as u8).collect();
        device
            .write_vectored_at(
                &[IoSlice::new(&data[..10]), IoSlice::new(&data[10..])],
                60_000,
            )
            .unwrap();
        let mut back = vec![0u8; 100_000];
        device.read_into(60_000, &mut back).unwrap();
        assert_eq!(back, data);
        let extents = device.extents(0, 1 << 20).unwrap();
        assert_eq!(
            extents,
            vec![
                Extent {
                    length: 3 * CHUNK_SIZE,
                    hole: false
                },
                Extent {
                    length: (1 << 20) - 3 * CHUNK_SIZE,
                    hole: true
                },
            ]
        );
    }

    #[test]
    fn refuses_requests_past_the_end() {
        let device = MemoryDevice::new(4096);
        let mut buffer = [0u8; 8];
        let error = device.read_into(4090, &mut buffer).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn write_zeroes_frees_whole_chunks() {
        let device = MemoryDevice::new(1 << 20);
        device
            .write_vectored_at(&[IoSlice::new(&vec![7u8; 200_000])], 0)
            .unwrap();
        device.write_zeroes(0, 131_072).unwrap();
        assert_eq!(device.allocated_bytes(), 2 * CHUNK_SIZE);
        let mut back = vec![1u8; 4];
        device.read_into(131_070, &mut back).unwrap();
        assert_eq!(back, [0, 0, 7, 7]);
    }
}
