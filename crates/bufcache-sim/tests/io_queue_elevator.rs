//! The simulated io queue in virtual time: requests of several clients wait together, the
//! discipline picks the next one when the disk is free, and only then is it timed.

use bufcache::QueueMode;
use bufcache_sim::{
    check_seed, run_custom_queued, DiskSpec, Dispatch, FileId, Os, Process, SimConfig, SimError,
    SimIoQueue, Simulation, Step, WorkloadSpec,
};

/// A client reading random blocks of one file, `reads` times.
struct RandomReader {
    file: FileId,
    reads: u64,
}

impl Process for RandomReader {
    fn step(&mut self, os: &mut Os<'_>) -> Result<Step, SimError> {
        if self.reads == 0 {
            return Ok(Step::Done);
        }
        self.reads -= 1;
        let block = os.block_size(self.file);
        let blocks = os.file_len(self.file) / block;
        let chosen = os.rng().below(blocks);
        os.read(self.file, chosen * block, block)?;
        Ok(Step::Continue)
    }
}

/// Eight clients reading scattered blocks of a 256 MiB file on the RZ25 through a tiny cache,
/// with the io queue in `mode` (no merging, so every batch is one request): the dispatches
/// and the disk's busy time.
fn scattered_reads(mode: QueueMode, seed: u64) -> (Vec<Dispatch>, u64) {
    let disk = DiskSpec::rz25();
    let mut config = SimConfig::new(disk.clone(), bufcache_sim::host_for(&disk));
    config.seed = seed;
    config.cache.memory_bytes_max = 256 << 10;
    config.cache.readahead_bytes_max = 0;
    config.io_queue = Some(SimIoQueue::new(mode, false, 1 << 20));
    let mut sim = Simulation::new(&config).unwrap();
    let file = sim.create_file("data", 256 << 20).unwrap();
    for client in 0..8 {
        sim.spawn(
            &format!("client{client}"),
            Box::new(RandomReader { file, reads: 60 }),
            0,
            true,
        );
    }
    sim.core().record_dispatches();
    sim.run().unwrap();
    let report = sim.report();
    assert!(report.processes.iter().all(|p| p.finished));
    (sim.core().dispatches(), report.device.busy_ns)
}

/// Bytes the head travels between batches, served in the order given.
fn seek_distance(dispatches: &[Dispatch]) -> u64 {
    let mut head = 0u64;
    let mut total = 0;
    for dispatch in dispatches {
        total += dispatch.offset.abs_diff(head);
        head = dispatch.offset + dispatch.length;
    }
    total
}

#[test]
fn the_elevator_seeks_less_than_fifo_and_serves_a_valid_sweep() {
    // Goal: with requests waiting together, the elevator reorders them into one-way sweeps,
    // which saves positioning over first come, first served. Method: eight clients read
    // scattered blocks on a rotating disk, on several seeds, once with each discipline; the
    // elevator's head travel and busy time must not exceed fifo's, and every elevator
    // dispatch must take the lowest waiting offset at or after the head (C-LOOK), or the
    // lowest of all when none lies ahead — checked against the set of requests that were
    // waiting at that moment, recorded by the queue.
    for seed in 1..=4 {
        let (fifo, fifo_busy_ns) = scattered_reads(QueueMode::Fifo, seed);
        let (elevator, elevator_busy_ns) = scattered_reads(QueueMode::Elevator, seed);
        assert_eq!(fifo.len(), elevator.len(), "seed {seed}: same requests");
        let choices = elevator.iter().filter(|d| d.waiting.len() > 1).count();
        assert!(
            choices > elevator.len() / 2,
            "seed {seed}: requests must wait together ({choices} of {} dispatches had a choice)",
            elevator.len()
        );
        let (fifo_seek, elevator_seek) = (seek_distance(&fifo), seek_distance(&elevator));
        assert!(
            elevator_seek <= fifo_seek,
            "seed {seed}: elevator travels {elevator_seek} bytes, fifo {fifo_seek}"
        );
        assert!(
            elevator_busy_ns <= fifo_busy_ns,
            "seed {seed}: elevator busy {elevator_busy_ns} ns, fifo {fifo_busy_ns} ns"
        );
        for dispatch in &elevator {
            assert!(dispatch.waiting.contains(&dispatch.offset));
            let expected = dispatch
                .waiting
                .iter()
                .copied()
                .filter(|&offset| offset >= dispatch.head_before)
                .min()
                .or_else(|| dispatch.waiting.iter().copied().min())
                .unwrap();
            assert_eq!(
                dispatch.offset, expected,
                "seed {seed}: not a sweep step: {dispatch:?}"
            );
        }
        // FIFO serves the oldest waiting request: in arrival order, which the queue records.
        for dispatch in &fifo {
            assert_eq!(
                dispatch.offset, dispatch.waiting[0],
                "seed {seed}: {dispatch:?}"
            );
        }
    }
}

#[test]
fn seeds_with_the_elevator_keep_the_durability_contract_while_reordering() {
    // Goal: reordering and merging in virtual time never changes what the engine reads or
    // what survives a crash. Method: run `sim check` seeds until 40 have drawn the elevator
    // (among the others); none may violate the contract, and their queues must have had
    // choices to make, so the elevator did reorder.
    let mut elevator_seeds = 0;
    let mut choices = 0;
    let mut seed = 1;
    while elevator_seeds < 40 {
        let outcome = check_seed(seed);
        assert_eq!(outcome.violation, None, "seed {seed}");
        if outcome.queue_mode == Some(QueueMode::Elevator) {
            elevator_seeds += 1;
            choices += outcome.queue_choices;
        }
        seed += 1;
    }
    assert!(
        choices > 40,
        "the elevator seeds must reorder waiting requests: {choices} choices"
    );
}

#[test]
fn an_elevator_run_repeats_byte_for_byte() {
    // Goal: the io queue keeps the simulation deterministic. Method: a ten-job build with
    // the elevator (merging, depth 1) and the same with depth 4 on an SSD, each run twice;
    // the JSON reports must be identical.
    let workload: WorkloadSpec = "build:jobs=10,sources=60,headers=80".parse().unwrap();
    for (disk, depth) in [("rz25", 1), ("nvme", 4)] {
        let disk: DiskSpec = disk.parse().unwrap();
        let queue = SimIoQueue {
            depth_max: depth,
            ..SimIoQueue::new(QueueMode::Elevator, true, 1 << 20)
        };
        let config = bufcache::CacheConfig {
            memory_bytes_max: 2 << 20,
            ..Default::default()
        };
        let first = run_custom_queued(&disk, &workload, config.clone(), Some(queue)).unwrap();
        let second = run_custom_queued(&disk, &workload, config, Some(queue)).unwrap();
        assert_eq!(first.to_json(), second.to_json());
        assert!(first.report.device.queue_entered > 0);
        assert!(first.report.processes.iter().all(|p| p.finished));
    }
}
