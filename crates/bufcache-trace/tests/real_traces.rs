// Goal: the real CloudPhysics trace reads completely in both encodings, and they agree.
// Method: stream /work/shared/traces/cloudPhysicsIO.csv (CSV reader, libCacheSim options)
// and cloudPhysicsIO.vscsi (vscsi reader) side by side and compare (op, lbn, size) and the
// time (the CSV keeps whole seconds) for every one of the 113,872 requests.
// Skipped with a note when the trace directory is absent.

use std::path::Path;

use bufcache_trace::{open_trace, Operation, TraceFormat, TraceOptions};

const TRACE_DIRECTORY: &str = "/work/shared/traces";
const REQUEST_COUNT: usize = 113_872;
const CSV_OPTIONS: &str =
    "time-col=2,obj-id-col=5,obj-size-col=4,op-col=3,has-header=true,delimiter=,";

fn trace_path(name: &str) -> Option<std::path::PathBuf> {
    let path = Path::new(TRACE_DIRECTORY).join(name);
    if path.exists() {
        Some(path)
    } else {
        eprintln!("skipping: {} not found", path.display());
        None
    }
}

#[test]
fn csv_and_vscsi_agree_on_every_request() {
    let (Some(csv_path), Some(vscsi_path)) = (
        trace_path("cloudPhysicsIO.csv"),
        trace_path("cloudPhysicsIO.vscsi"),
    ) else {
        return;
    };
    let csv_options = TraceOptions::parse(CSV_OPTIONS).unwrap();
    let csv = open_trace(&csv_path, TraceFormat::Csv, &csv_options).unwrap();
    let vscsi = open_trace(&vscsi_path, TraceFormat::Vscsi, &TraceOptions::default()).unwrap();

    let mut count = 0;
    let mut reads = 0;
    for (index, pair) in csv.zip(vscsi).enumerate() {
        let (from_csv, from_vscsi) = (pair.0.unwrap(), pair.1.unwrap());
        let key = |r: &bufcache_trace::TraceRequest| {
            (r.operation, r.object_id, r.length_bytes, r.offset_bytes)
        };
        assert_eq!(key(&from_csv), key(&from_vscsi), "request {index}");
        assert_eq!(
            from_csv.time_us,
            from_vscsi.time_us / 1_000_000 * 1_000_000,
            "request {index}"
        );
        assert_ne!(from_csv.operation, Operation::Other, "request {index}");
        reads += usize::from(from_csv.operation == Operation::Read);
        count += 1;
    }
    assert_eq!(count, REQUEST_COUNT);
    // `awk -F, '{print $3}' | sort | uniq -c` on the CSV: 46,974 reads (28), 66,898 writes (2a).
    assert_eq!(reads, 46_974);

    // zip stops at the shorter stream: make sure neither has extra requests.
    let csv_total = open_trace(&csv_path, TraceFormat::Csv, &csv_options)
        .unwrap()
        .count();
    let vscsi_total = open_trace(&vscsi_path, TraceFormat::Vscsi, &TraceOptions::default())
        .unwrap()
        .count();
    assert_eq!((csv_total, vscsi_total), (REQUEST_COUNT, REQUEST_COUNT));
}

#[test]
fn formats_are_guessed_from_the_real_files() {
    let (Some(csv_path), Some(vscsi_path)) = (
        trace_path("cloudPhysicsIO.csv"),
        trace_path("cloudPhysicsIO.vscsi"),
    ) else {
        return;
    };
    assert_eq!(TraceFormat::guess(csv_path).unwrap(), TraceFormat::Csv);
    assert_eq!(TraceFormat::guess(vscsi_path).unwrap(), TraceFormat::Vscsi);
}
