//! Request payload and reply buffers, reused across requests.
//!
//! A fresh buffer per request costs twice: the allocator zero-fills it (or the kernel
//! faults in zeroed pages for a large one), and then the socket or the cache overwrites every
//! byte anyway. Buffers handed back after a reply are kept for the next request instead, so
//! in steady state a request neither zero-fills nor faults a page.
//!
//! Invariants:
//! - every byte of a kept buffer is initialised (it was zero-filled once, when first
//!   allocated), so handing one out needs no `unsafe`; a taker gets a buffer at least as long
//!   as it asked for and uses the prefix it needs;
//! - the bytes kept while unused never exceed `retained_bytes_max`, so resident memory stays
//!   within the cache, the in-flight budget and this bound; buffers above it are freed.

use parking_lot::Mutex;

/// The smallest buffer made, so 4 KiB requests with their reply header share one size class.
const BUFFER_BYTES_MIN: usize = 8 << 10;

/// Unused buffers kept at most, whatever their sizes: a scan over them stays short.
const RETAINED_BUFFERS_MAX: usize = 64;

/// Reusable byte buffers shared by every connection of a server.
pub(crate) struct BufferRecycler {
    retained_bytes_max: usize,
    kept: Mutex<Kept>,
}

#[derive(Default)]
struct Kept {
    buffers: Vec<Vec<u8>>,
    bytes: usize,
}

impl BufferRecycler {
    /// A recycler keeping at most `retained_bytes_max` bytes of unused buffers.
    pub(crate) fn new(retained_bytes_max: usize) -> Self {
        BufferRecycler {
            retained_bytes_max,
            kept: Mutex::new(Kept::default()),
        }
    }

    /// A buffer of at least `length_bytes` initialised bytes: the smallest kept one that is
    /// large enough, or a new one rounded up to a power of two so it suits later requests.
    pub(crate) fn take(&self, length_bytes: usize) -> Vec<u8> {
        {
            let mut kept = self.kept.lock();
            let best = kept
                .buffers
                .iter()
                .enumerate()
                .filter(|(_, buffer)| buffer.len() >= length_bytes)
                .min_by_key(|(_, buffer)| buffer.len())
                .map(|(index, _)| index);
            if let Some(index) = best {
                let buffer = kept.buffers.swap_remove(index);
                kept.bytes -= buffer.len();
                return buffer;
            }
        }
        vec![0u8; length_bytes.max(BUFFER_BYTES_MIN).next_power_of_two()]
    }

    /// Keeps `buffer` for a later request if the bounds allow, else frees it. When full, a
    /// smaller kept buffer makes way for a larger one, which serves more requests.
    pub(crate) fn give_back(&self, buffer: Vec<u8>) {
        if buffer.len() > self.retained_bytes_max {
            return;
        }
        let mut kept = self.kept.lock();
        while kept.bytes + buffer.len() > self.retained_bytes_max
            || kept.buffers.len() >= RETAINED_BUFFERS_MAX
        {
            let smallest = kept
                .buffers
                .iter()
                .enumerate()
                .min_by_key(|(_, kept)| kept.len())
                .map(|(index, kept)| (index, kept.len()));
            match smallest {
                Some((index, length)) if length < buffer.len() => {
                    kept.buffers.swap_remove(index);
                    kept.bytes -= length;
                }
                _ => return,
            }
        }
        kept.bytes += buffer.len();
        kept.buffers.push(buffer);
        debug_assert!(kept.bytes <= self.retained_bytes_max);
    }

    #[cfg(test)]
    fn retained_bytes(&self) -> usize {
        self.kept.lock().bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Goal: a buffer handed back is handed out again (no new allocation, no zero-fill), and
    /// the kept bytes never exceed the bound. Method: take, mark, give back, take again and
    /// find the mark; then give back more than the bound allows and check the total.
    #[test]
    fn buffers_are_reused_and_retained_bytes_stay_bounded() {
        let recycler = BufferRecycler::new(1 << 20);
        let mut first = recycler.take(4096 + 16);
        assert!(first.len() >= 4096 + 16);
        first[0] = 0xa5;
        let pointer = first.as_ptr();
        recycler.give_back(first);
        let again = recycler.take(100);
        assert_eq!(again.as_ptr(), pointer, "the kept buffer is reused");
        assert_eq!(again[0], 0xa5, "and not zero-filled again");
        recycler.give_back(again);
        for _ in 0..10 {
            recycler.give_back(vec![0u8; 256 << 10]);
        }
        assert!(recycler.retained_bytes() <= 1 << 20);
        recycler.give_back(vec![0u8; 2 << 20]);
        assert!(
            recycler.retained_bytes() <= 1 << 20,
            "oversized buffers are freed"
        );
        let large = recycler.take(200 << 10);
        assert!(large.len() >= 200 << 10);
    }
}
