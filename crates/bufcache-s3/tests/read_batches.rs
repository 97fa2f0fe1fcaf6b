//! A batch of reads (a read-ahead window's runs) reaches the object store as GETs in flight
//! together, in both layouts, and each read keeps its own outcome.

mod support;

use std::io::IoSliceMut;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bufcache_device::Device;
use bufcache_device::ReadRequest;
use bufcache_s3::{S3Device, S3Url};
use rand::{Rng, SeedableRng};
use support::{have_moto, DelayProxy, Moto};

const RUN_BYTES: usize = 64 << 10;
const RUNS: u64 = 16;

fn random(length: usize, seed: u64) -> Vec<u8> {
    let mut data = vec![0u8; length];
    rand::rngs::StdRng::seed_from_u64(seed).fill(&mut data[..]);
    data
}

/// What each read of a batch ended with: its offset, its bytes, and whether it succeeded.
type Outcomes = Arc<Mutex<Vec<(u64, Vec<u8>, bool)>>>;

/// Memory a read fills, handed back to the test with the outcome.
struct Filled(Vec<u8>);

impl bufcache_device::ReadMemory for Filled {
    fn slices_mut(&mut self) -> Vec<IoSliceMut<'_>> {
        vec![IoSliceMut::new(&mut self.0)]
    }
}

// Goal: the reads of one `submit_reads` batch are GETs in flight together, not one round
// trip after another (read-ahead over a 20 ms store was held to the background pool's four
// threads), and each read completes with its own bytes or its own error. Method: for each
// layout, 64 KiB chunks or a small segment size, 16 runs of 64 KiB written at every third
// run's place, each flushed on its own (in the log layout a segment each: runs back to back
// in one segment would share a GET); through a proxy that holds every request 50 ms and counts
// requests in flight, one batch of the 16 reads plus one past the end; at least 6 GETs must
// have been in flight at once (a batch has a quarter of the store's bound of 32 in reads at
// once, each one GET or more), the read past the end alone must fail, and every other must
// hold its run's bytes.
#[test]
fn a_read_batch_keeps_its_gets_in_flight_together_and_each_read_its_outcome() {
    if !have_moto("a_read_batch_keeps_its_gets_in_flight_together_and_each_read_its_outcome") {
        return;
    }
    let moto = Moto::start();
    for (bucket, parameters) in [
        ("chunk", "layout=chunk&chunk-size=64k"),
        ("log", "layout=log&segment-size=256k"),
    ] {
        moto.create_bucket(bucket);
        let proxy = DelayProxy::start(moto.port, Duration::from_millis(50));
        let url = S3Url::parse(&format!(
            "s3://{bucket}/disk?endpoint={}&create-size=4M&{parameters}",
            proxy.endpoint()
        ))
        .unwrap();
        let device = S3Device::open_locked(&url).unwrap();
        let runs: Vec<(u64, Vec<u8>)> = (0..RUNS)
            .map(|index| (index * 3 * RUN_BYTES as u64, random(RUN_BYTES, 200 + index)))
            .collect();
        for (offset, data) in &runs {
            device
                .write_vectored_at(&[std::io::IoSlice::new(data)], *offset)
                .unwrap();
            device.flush().unwrap();
        }
        let outcomes: Outcomes = Arc::default();
        let mut reads: Vec<ReadRequest> = runs
            .iter()
            .map(|(offset, _)| *offset)
            .chain([4 << 20])
            .map(|offset| {
                let outcomes = Arc::clone(&outcomes);
                ReadRequest::new(
                    offset,
                    Filled(vec![0u8; RUN_BYTES]),
                    move |filled: Filled, result: std::io::Result<()>| {
                        outcomes
                            .lock()
                            .unwrap()
                            .push((offset, filled.0, result.is_ok()))
                    },
                )
            })
            .collect();
        reads.swap(3, RUNS as usize);
        proxy.reset_peak();
        device.submit_reads(reads);
        assert!(
            proxy.peak() >= 6,
            "{bucket}: the batch's GETs went {} at a time",
            proxy.peak()
        );
        let outcomes = outcomes.lock().unwrap();
        assert_eq!(
            outcomes.len(),
            RUNS as usize + 1,
            "{bucket}: one outcome per read"
        );
        for (offset, bytes, ok) in outcomes.iter() {
            match runs.iter().find(|(run_offset, _)| run_offset == offset) {
                Some((_, data)) => {
                    assert!(*ok, "{bucket}: the read at {offset} failed");
                    assert!(
                        bytes == data,
                        "{bucket}: the read at {offset} got other bytes"
                    );
                }
                None => assert!(
                    !*ok,
                    "{bucket}: the read past the end at {offset} succeeded"
                ),
            }
        }
    }
}
