//! Sequential detection and read-ahead windows, one state per stream, not per object.
//!
//! Each object keeps a small table of recent streams (`streams_per_object_max`). A read that
//! starts exactly where a stream's last read ended continues that stream; any other read
//! replaces the least recently used stream and causes no read-ahead, so random readers pay
//! nothing. Several interleaved sequential readers of one object (nbdcopy's four
//! connections) each keep their own entry.
//!
//! A stream's second sequential read opens a window of `readahead_size_initial_bytes` read in
//! the same device request as the miss (synchronous read-ahead). The first block of each
//! window is its trigger: when a reader reaches it, the next window — four times larger, up to
//! `readahead_bytes_max` — is issued asynchronously, so it is in flight before the reader
//! gets there (Linux's PG_readahead marker, FreeBSD's B_RAM).
//!
//! Over a device with a per-request latency (an upstream server, object storage) a window of
//! `readahead_bytes_max` can leave the reader waiting for read-ahead still in flight.
//! Each such wait doubles that stream's own window limit, up to
//! `readahead_latency_bytes_max`; windows are read as cluster-sized requests in
//! parallel, so a larger window means more requests in flight — enough, after a few waits, to
//! cover bandwidth × latency. A stream on a fast device never waits and keeps the base limit.
//!
//! That growth stops at the stream's share of the read-ahead the cache can spare
//! (`WindowLimits::spare_blocks`, split evenly among the object's active streams): windows
//! the cache cannot hold beside the readers' own requests are cut short when they are issued
//! (rule 3 of "Admission under pressure"), and the stream's reader then misses on the blocks
//! the window claimed but never read (rule 6 there).

/// What the reader of one request should read beyond the blocks it asked for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct ReadaheadPlan {
    /// Blocks `[request end, extend_to)` are read together with the request's misses.
    pub extend_to_block: u64,
    /// A window to read in the background: `[start, end)`.
    pub background: Option<(u64, u64)>,
    /// The stream is long: its blocks go to the eviction end of the policy.
    pub no_reuse: bool,
    /// End of the read-ahead already issued for this stream: a miss before it reads up to it.
    pub window_end_block: u64,
}

#[derive(Clone, Copy, Debug)]
struct Stream {
    next_block: u64,
    window_blocks: u64,
    trigger_block: u64,
    ahead_end_block: u64,
    /// This stream's window limit: the base limit, doubled per wait for read-ahead.
    blocks_max: u64,
    last_use: u64,
}

/// The recent streams of one object.
pub(crate) struct StreamTable {
    streams: Vec<Stream>,
    tick: u64,
}

/// Window sizes in blocks for one object.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WindowLimits {
    pub initial_blocks: u64,
    pub blocks_max: u64,
    /// The most a stream's limit grows to when its reader waits for read-ahead.
    pub latency_blocks_max: u64,
    pub streams_max: usize,
    pub object_blocks: u64,
    /// Blocks of read-ahead not yet used the cache can hold now (a share of its buffers);
    /// the latency growth of the active streams' windows together stays within it.
    pub spare_blocks: u64,
}

/// A stream used within this many reads of the object counts as active when the spare
/// read-ahead is shared out: nbdcopy's connections leave a stream behind each time they
/// move to a new region, and those must not keep a share.
const STREAM_ACTIVE_READS_MAX: u64 = 64;

impl StreamTable {
    pub fn new() -> Self {
        StreamTable {
            streams: Vec::new(),
            tick: 0,
        }
    }

    /// Records a read of blocks `[first, end)` and says what to read ahead.
    pub fn on_read(&mut self, first: u64, end: u64, limits: WindowLimits) -> ReadaheadPlan {
        self.tick += 1;
        let none = ReadaheadPlan {
            extend_to_block: end,
            ..Default::default()
        };
        if limits.blocks_max == 0 {
            return none;
        }
        let tick = self.tick;
        let Some(index) = self.streams.iter().position(|s| s.next_block == first) else {
            self.start_stream(end, limits.streams_max);
            return none;
        };
        self.streams[index].next_block = end;
        self.streams[index].last_use = tick;
        let latency_blocks_max = self.latency_blocks_max(limits);
        let stream = &mut self.streams[index];
        let blocks_max = stream
            .blocks_max
            .min(latency_blocks_max)
            .max(limits.blocks_max);
        let clamp = |block: u64| block.min(limits.object_blocks);
        if stream.window_blocks == 0 || first >= stream.ahead_end_block {
            // A new sequential stream, or a reader that outran its read-ahead: read a window
            // together with this request.
            stream.window_blocks = if stream.window_blocks == 0 {
                // Large requests start with a window at least twice their size, so the window
                // is never smaller than what the reader asks for at once.
                limits.initial_blocks.max(2 * (end - first)).min(blocks_max)
            } else {
                grow(stream.window_blocks, blocks_max)
            };
            stream.ahead_end_block = clamp(end + stream.window_blocks);
            stream.trigger_block = end;
            return ReadaheadPlan {
                extend_to_block: stream.ahead_end_block,
                background: None,
                no_reuse: stream.window_blocks >= limits.blocks_max,
                window_end_block: stream.ahead_end_block,
            };
        }
        let mut plan = ReadaheadPlan {
            extend_to_block: end,
            background: None,
            no_reuse: stream.window_blocks >= limits.blocks_max,
            window_end_block: stream.ahead_end_block,
        };
        if end > stream.trigger_block && stream.ahead_end_block < limits.object_blocks {
            stream.window_blocks = grow(stream.window_blocks, blocks_max);
            let start = stream.ahead_end_block;
            let window_end = clamp(start + stream.window_blocks);
            stream.trigger_block = start;
            stream.ahead_end_block = window_end;
            plan.background = Some((start, window_end));
            plan.no_reuse = stream.window_blocks >= limits.blocks_max;
            plan.window_end_block = window_end;
        }
        plan
    }

    /// The reader of the stream now at `next_block` waited for read-ahead in flight: double
    /// the stream's window limit, up to `latency_blocks_max`, once its windows are full size.
    pub fn reader_waited(&mut self, next_block: u64, limits: WindowLimits) {
        let latency_blocks_max = self.latency_blocks_max(limits);
        let Some(stream) = self.streams.iter_mut().find(|s| s.next_block == next_block) else {
            return;
        };
        let current_max = stream.blocks_max.max(limits.blocks_max);
        // While windows still ramp up (×4 each), catching up with them is expected; only a
        // reader that outruns a full-size window shows latency the window does not cover.
        if stream.window_blocks >= current_max {
            let doubled = (current_max * 2).max(1);
            stream.blocks_max = doubled.min(latency_blocks_max);
        }
    }

    /// The largest window latency may grow a stream's to now: `latency_blocks_max`, but no
    /// more than half the stream's even share of `spare_blocks` among the active streams,
    /// and never below the base limit. Half, because a stream has up to two windows unread
    /// at once: the next one is issued when its reader reaches the current one's first
    /// block. Windows that together claimed more than the spare were cut short when issued
    /// (rule 3 of "Admission under pressure"), and each request in the hole a cut left was
    /// a demand miss read on its own.
    fn latency_blocks_max(&self, limits: WindowLimits) -> u64 {
        let active = self
            .streams
            .iter()
            .filter(|s| s.window_blocks > 0 && self.tick - s.last_use < STREAM_ACTIVE_READS_MAX)
            .count()
            .max(1) as u64;
        limits
            .latency_blocks_max
            .min(limits.spare_blocks / (2 * active))
            .max(limits.blocks_max)
    }

    fn start_stream(&mut self, end: u64, streams_max: usize) {
        let fresh = Stream {
            next_block: end,
            window_blocks: 0,
            trigger_block: 0,
            ahead_end_block: 0,
            blocks_max: 0,
            last_use: self.tick,
        };
        if self.streams.len() < streams_max {
            self.streams.push(fresh);
        } else if let Some(oldest) = self.streams.iter_mut().min_by_key(|s| s.last_use) {
            *oldest = fresh;
        }
    }

    /// Number of streams being tracked (for tests).
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.streams.len()
    }
}

fn grow(window_blocks: u64, blocks_max: u64) -> u64 {
    (window_blocks * 4).min(blocks_max).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: WindowLimits = WindowLimits {
        initial_blocks: 4,
        blocks_max: 256,
        latency_blocks_max: 4096,
        streams_max: 8,
        object_blocks: 1 << 30,
        spare_blocks: u64::MAX,
    };

    #[test]
    fn random_reads_cause_no_read_ahead() {
        let mut table = StreamTable::new();
        for block in [10, 500, 3, 90_000, 7] {
            let plan = table.on_read(block, block + 1, LIMITS);
            assert_eq!(
                plan,
                ReadaheadPlan {
                    extend_to_block: block + 1,
                    ..Default::default()
                }
            );
        }
    }

    #[test]
    fn sequential_windows_grow_and_trigger_ahead_of_the_reader() {
        let mut table = StreamTable::new();
        assert_eq!(table.on_read(0, 1, LIMITS).extend_to_block, 1);
        let plan = table.on_read(1, 2, LIMITS);
        assert_eq!(
            plan.extend_to_block, 6,
            "second read opens the initial window"
        );
        let plan = table.on_read(2, 3, LIMITS);
        assert_eq!(
            plan.background,
            Some((6, 22)),
            "reaching the trigger issues the next window"
        );
        let mut windows = vec![];
        for block in 3..2000 {
            if let Some((start, end)) = table.on_read(block, block + 1, LIMITS).background {
                assert!(start > block, "read-ahead is ahead of the reader");
                windows.push(end - start);
            }
        }
        assert_eq!(windows[..3], [64, 256, 256]);
    }

    /// Goal: a stream whose reader waits for read-ahead in flight gets larger windows, up to
    /// the latency limit, and a stream that never waits keeps the base limit. Method: read
    /// two streams block by block, report a wait for one after every window, compare sizes.
    #[test]
    fn waiting_for_read_ahead_grows_the_window_to_the_latency_limit() {
        let mut table = StreamTable::new();
        let (slow, fast) = (0u64, 1u64 << 20);
        let mut largest = [0u64; 2];
        for step in 0..20_000u64 {
            for (index, start) in [slow, fast].into_iter().enumerate() {
                let block = start + step;
                if let Some((begin, end)) = table.on_read(block, block + 1, LIMITS).background {
                    largest[index] = largest[index].max(end - begin);
                    if index == 0 {
                        table.reader_waited(block + 1, LIMITS);
                    }
                }
            }
        }
        assert_eq!(largest[0], LIMITS.latency_blocks_max, "the waiting stream");
        assert_eq!(largest[1], LIMITS.blocks_max, "the stream that never waits");
    }

    /// Goal: latency growth never lets the active streams together claim more unread
    /// read-ahead than the cache can spare, a lone stream still grows up to half of it (its
    /// two windows take all of it), and a stream that stopped reading keeps no share.
    /// Method: four interleaved streams whose readers wait after every window, on a spare
    /// of 2048 blocks (latency limit 4096, base limit 256); after every read the blocks the
    /// streams issued and have not read yet are summed and must stay within the spare, and
    /// each stream's windows stop at 256, an eighth; then three stop reading, and the last
    /// one's windows grow to 1024 and no further, its unread blocks within the spare.
    #[test]
    fn latency_growth_keeps_the_streams_windows_within_the_spare_read_ahead() {
        let limits = WindowLimits {
            spare_blocks: 2048,
            ..LIMITS
        };
        let mut table = StreamTable::new();
        let starts = [0u64, 1 << 20, 2 << 20, 3 << 20];
        let mut largest = [0u64; 4];
        let unread = |table: &StreamTable| -> u64 {
            table
                .streams
                .iter()
                .map(|stream| stream.ahead_end_block.saturating_sub(stream.next_block))
                .sum()
        };
        for step in 0..20_000u64 {
            for (index, start) in starts.iter().enumerate() {
                let block = start + step;
                if let Some((begin, end)) = table.on_read(block, block + 1, limits).background {
                    largest[index] = largest[index].max(end - begin);
                    table.reader_waited(block + 1, limits);
                }
                assert!(
                    unread(&table) <= limits.spare_blocks,
                    "step {step}: {} blocks issued and unread, spare {}",
                    unread(&table),
                    limits.spare_blocks
                );
            }
        }
        assert_eq!(
            largest, [256; 4],
            "four active streams share the spare evenly, two windows each"
        );
        let mut alone = 0u64;
        for block in 20_000..60_000u64 {
            if let Some((begin, end)) = table.on_read(block, block + 1, limits).background {
                alone = alone.max(end - begin);
                table.reader_waited(block + 1, limits);
            }
            let lone = table
                .streams
                .iter()
                .find(|stream| stream.next_block == block + 1);
            let lone_unread = lone.map_or(0, |stream| stream.ahead_end_block - stream.next_block);
            assert!(
                lone_unread <= limits.spare_blocks,
                "block {block}: {lone_unread} unread"
            );
        }
        assert_eq!(
            alone,
            limits.spare_blocks / 2,
            "the one stream left takes the whole spare in its two windows"
        );
    }

    #[test]
    fn interleaved_streams_are_each_detected() {
        let mut table = StreamTable::new();
        let starts = [0u64, 1 << 20, 2 << 20, 3 << 20];
        let mut extended = [false; 4];
        for step in 0..10 {
            for (index, start) in starts.iter().enumerate() {
                let block = start + step;
                let plan = table.on_read(block, block + 1, LIMITS);
                extended[index] |= plan.extend_to_block > block + 1 || plan.background.is_some();
            }
        }
        assert_eq!(extended, [true; 4]);
        assert_eq!(table.len(), 4);
    }
}
