//! Goal: the mechanical disk model keeps the properties its presets promise.
//! Method: drive `HddModel` directly with hand-made requests: the fitted seek curve hits the
//! preset's single-cylinder and full-stroke times and its random-pair mean is the average;
//! back-to-back sequential reads stream at the media rate (the drive's read-ahead segment
//! hides the host's turnaround); a write to the sector that has just passed under the head
//! waits about one revolution.

use bufcache_sim::{DiskKind, DiskModel, DiskSpec, HddModel, HddParams, Op};

fn params(spec: DiskSpec) -> HddParams {
    match spec.kind {
        DiskKind::Hdd(p) => p,
        _ => panic!("not a mechanical disk"),
    }
}

#[test]
fn seek_curve_matches_the_cheetah_preset() {
    let p = params(DiskSpec::cheetah9lp());
    let model = HddModel::new(p.clone());
    let curve = model.seek_curve();
    assert!((curve.time_ms(1) - 0.831).abs() < 1e-6);
    assert!((curve.time_ms(p.cylinders as u64 - 1) - 10.627).abs() < 1e-3);
    // Mean over random cylinder pairs (weight C - d) equals the average seek.
    let c = p.cylinders as f64;
    let (mut sum, mut weight) = (0.0, 0.0);
    for d in 1..p.cylinders as u64 {
        let w = c - d as f64;
        sum += w * curve.time_ms(d);
        weight += w;
    }
    assert!(
        (sum / weight - p.seek_avg_ms).abs() < 0.05,
        "mean {}",
        sum / weight
    );
    // Monotone.
    let mut last = 0.0;
    for d in (0..p.cylinders as u64).step_by(17) {
        let t = curve.time_ms(d);
        assert!(t >= last);
        last = t;
    }
}

#[test]
fn sequential_reads_stream_at_the_media_rate() {
    for spec in [DiskSpec::rz25(), DiskSpec::hdd7200()] {
        let p = params(spec);
        let media = p.media_bytes_per_s();
        let mut model = HddModel::new(p);
        let chunk = 64u64 << 10;
        let mut t = model.serve(Op::Read, 0, chunk, 0);
        let start = t;
        let count = 200u64;
        for i in 1..=count {
            // The host takes 50 µs to issue the next request.
            t = model.serve(Op::Read, i * chunk, chunk, t + 50_000);
        }
        let rate = (count * chunk) as f64 / ((t - start) as f64 / 1e9);
        assert!(
            (rate / media - 1.0).abs() < 0.05,
            "rate {rate:.0} B/s vs media {media:.0} B/s"
        );
    }
}

#[test]
fn just_missed_sector_costs_one_revolution() {
    let p = params(DiskSpec::rz25());
    let revolution = p.revolution_ns();
    let sector = revolution / p.sectors_per_track as f64;
    let mut model = HddModel::new(p.clone());
    let done = model.serve(Op::Write, 0, 8 * 512, 0);
    // The next sector: the command overhead lets it pass under the head.
    let next = model.serve(Op::Write, 8 * 512, 512, done);
    let service = (next - done) as f64;
    assert!(
        service > 0.95 * revolution && service < revolution + 2.0 * sector,
        "service {service} ns, revolution {revolution} ns"
    );
    // Asking for a sector half a turn ahead costs about half a turn.
    let half = p.sectors_per_track as u64 / 2;
    let done = model.serve(Op::Write, 0, 512, next + 100_000_000);
    let later = model.serve(Op::Write, (1 + half) * 512, 512, done);
    let service = (later - done) as f64;
    assert!(service < 0.6 * revolution, "service {service} ns");
}

#[test]
fn ssd_channels_overlap_latency() {
    let DiskKind::Ssd(p) = DiskSpec::nvme().kind else {
        panic!()
    };
    let mut model = bufcache_sim::QueueModel::new(p);
    let serial = model.serve(Op::Read, 0, 4096, 0);
    let mut last = 0;
    for i in 0..8 {
        last = last.max(model.serve(Op::Read, i * 4096, 4096, serial));
    }
    assert!(
        last - serial < 2 * serial,
        "8 requests overlap on 8 channels"
    );
}

#[test]
fn a_write_cache_streams_contiguous_writes_and_a_gap_costs_its_rotation() {
    // Goal: seed 002's drives had write-behind caches, where contiguous writes stream and a
    // rotdelay gap is lost time. Method: issue 16 contiguous 8 KiB writes, each after a host
    // turnaround, then drain the cache (a flush); with the cache the whole run takes about
    // its media time, without it nearly a revolution per write; with a gap after every
    // write, the cached run pays about the gaps' rotation.
    let run = |write_cache: bool, gap_sectors: u64| {
        let mut p = params(DiskSpec::hdd7200());
        p.write_cache = write_cache;
        let revolution = p.revolution_ns();
        let mut model = HddModel::new(p);
        let mut now = 0u64;
        let mut sector = 0u64;
        for _ in 0..16 {
            now = model.serve(Op::Write, sector * 512, 8192, now) + 50_000;
            sector += 16 + gap_sectors;
        }
        let end = model.drain_write_cache(now).unwrap_or(now);
        (end as f64, revolution)
    };
    let (cached, revolution) = run(true, 0);
    let (uncached, _) = run(false, 0);
    assert!(cached < 3.0 * revolution, "cached {cached} ns");
    assert!(uncached > 12.0 * revolution, "uncached {uncached} ns");
    let (gapped, _) = run(true, 2000);
    assert!(gapped > 3.0 * cached, "gapped {gapped} ns vs {cached} ns");
}
