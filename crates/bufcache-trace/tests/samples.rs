// Goal: every format reads a small hand-written sample to exactly the expected requests.
// Method: write each sample inline (text) or with to_le_bytes (binary), parse it from
// memory through TraceReader, and compare the whole request list.

use bufcache_trace::{Operation, TraceFormat, TraceOptions, TraceReader, TraceRequest};

fn read(bytes: &[u8], format: TraceFormat, options: &str) -> Vec<TraceRequest> {
    let options = TraceOptions::parse(options).expect("options parse");
    TraceReader::new(bytes, "sample", format, &options)
        .expect("reader opens")
        .collect::<Result<Vec<_>, _>>()
        .expect("sample parses")
}

fn request(
    time_us: u64,
    operation: Operation,
    offset_bytes: u64,
    length_bytes: u64,
    object_id: u64,
) -> TraceRequest {
    TraceRequest {
        time_us,
        operation,
        offset_bytes,
        length_bytes,
        object_id,
    }
}

#[test]
fn csv_cloudphysics_columns() {
    let text = b"version,time,op,size,lbn\n1,5,2a,512,100\n1,6,28,4096,7\n\n1,7,0x35,0,9\n";
    let options = "time-col=2,obj-id-col=5,obj-size-col=4,op-col=3,has-header=true,delimiter=,";
    assert_eq!(
        read(text, TraceFormat::Csv, options),
        vec![
            request(5_000_000, Operation::Write, 51_200, 512, 100),
            request(6_000_000, Operation::Read, 3_584, 4096, 7),
            request(7_000_000, Operation::Other, 4_608, 0, 9),
        ]
    );
}

#[test]
fn csv_tab_delimiter_words_decimal_time_and_lbn_size() {
    let text = b"0.5\tR\t3\t8192\n1.25\twrite\t4\t0\n2\tflush\t5\t0\n";
    let options = "time-col=1,op-col=2,obj-id-col=3,obj-size-col=4,delimiter=\\t,lbn-size=4096";
    assert_eq!(
        read(text, TraceFormat::Csv, options),
        vec![
            request(500_000, Operation::Read, 12_288, 8192, 3),
            request(1_250_000, Operation::Write, 16_384, 0, 4),
            request(2_000_000, Operation::Other, 20_480, 0, 5),
        ]
    );
}

#[test]
fn csv_space_delimiter_collapses_runs_and_id_only() {
    let text = b"  10   20\n11 21\n";
    let options = "obj-id-col=2,time-col=1,delimiter=space,time-unit=us";
    assert_eq!(
        read(text, TraceFormat::Csv, options),
        vec![
            request(10, Operation::Other, 20 * 512, 0, 20),
            request(11, Operation::Other, 21 * 512, 0, 21),
        ]
    );
}

#[test]
fn csv_string_ids_hash_stably() {
    let text = b"alpha\nbeta\nalpha\n";
    let requests = read(text, TraceFormat::Csv, "obj-id-col=1,obj-id-is-num=false");
    assert_eq!(requests[0], requests[2]);
    assert_ne!(requests[0].object_id, requests[1].object_id);
    assert_eq!(requests[0].offset_bytes, requests[0].object_id * 512);
}

#[test]
fn blkparse_queue_events_and_summary() {
    let text = b"  8,0    3        1     0.000000000  4162  Q  WS 2048 + 8 [kworker/3:1]
  8,0    3        2     0.000001234  4162  G  WS 2048 + 8 [kworker/3:1]
  8,0    3        3     0.000002000  4162  D  WS 2048 + 8 [kworker/3:1]
  8,0    0        4     0.500000000     0  C  WS 2048 + 8 [0]
  8,0    1        5     1.000000999  5000  Q   R 100 + 16 [cat]
  8,0    1        6     1.100000000  5000  Q FWS [jbd2/sda1-8]
  8,0    1        7     1.200000000  5000  Q   D 4096 + 2048 [fstrim]
  8,0    1        0     1.300000000     0  m   N cfq5000 insert_request

CPU0 (8,0):
 Reads Queued:           0,        0KiB\t Writes Queued:           1,        4KiB
Total (8,0):
Throughput (R/W): 0KiB/s / 8KiB/s
Events (8,0): 8 entries
Skips: 0 forward (0 -   0.0%)
";
    assert_eq!(
        read(text, TraceFormat::Blkparse, ""),
        vec![
            request(0, Operation::Write, 2048 * 512, 8 * 512, 2048),
            request(1_000_000, Operation::Read, 100 * 512, 16 * 512, 100),
            request(1_100_000, Operation::Other, 0, 0, 0),
            request(1_200_000, Operation::Other, 4096 * 512, 2048 * 512, 4096),
        ]
    );
    assert_eq!(
        read(text, TraceFormat::Blkparse, "blkparse-action=C"),
        vec![request(
            500_000,
            Operation::Write,
            2048 * 512,
            8 * 512,
            2048
        )]
    );
    assert_eq!(
        read(text, TraceFormat::Blkparse, "blkparse-action=D"),
        vec![request(2, Operation::Write, 2048 * 512, 8 * 512, 2048)]
    );
}

#[test]
fn msr_cambridge() {
    let text =
        b"128166372003061629,hm,0,Read,3584,4096,1234\n128166372016382155,hm,1,Write,0,512,77\n";
    assert_eq!(
        read(text, TraceFormat::Msr, ""),
        vec![
            request(12_816_637_200_306_162, Operation::Read, 3584, 4096, 3584),
            request(12_816_637_201_638_215, Operation::Write, 0, 512, 0),
        ]
    );
}

#[test]
fn fio_version_2_with_waits() {
    let text = b"fio version 2 iolog
/dev/sdb add
/dev/sdb open
/dev/sdb write 0 4096
/dev/sdb wait 250 0
/dev/sdb read 8192 512
/dev/sdb sync 0 0
/dev/sdb trim 4096 4096
/dev/sdb close
";
    assert_eq!(
        read(text, TraceFormat::Fio, ""),
        vec![
            request(0, Operation::Write, 0, 4096, 0),
            request(250, Operation::Read, 8192, 512, 8192),
            request(250, Operation::Other, 0, 0, 0),
            request(250, Operation::Other, 4096, 4096, 4096),
        ]
    );
}

#[test]
fn fio_version_3() {
    let text = b"fio version 3 iolog
2 Nvme1n1 add
872 Nvme1n1 open
878 Nvme1n1 write 0 16384
888 Nvme1n1 read 16384 4096
900 Nvme1n1 datasync
10001677 Nvme1n1 close
";
    assert_eq!(
        read(text, TraceFormat::Fio, ""),
        vec![
            request(878, Operation::Write, 0, 16384, 0),
            request(888, Operation::Read, 16384, 4096, 16384),
            request(900, Operation::Other, 0, 0, 0),
        ]
    );
}

fn oracle_record(time: u32, object_id: u64, size: u32, next_access_vtime: i64) -> Vec<u8> {
    let mut bytes = Vec::new();
    bytes.extend_from_slice(&time.to_le_bytes());
    bytes.extend_from_slice(&object_id.to_le_bytes());
    bytes.extend_from_slice(&size.to_le_bytes());
    bytes.extend_from_slice(&next_access_vtime.to_le_bytes());
    bytes
}

#[test]
fn oracle_general() {
    let mut bytes = oracle_record(1, 42, 4096, 2);
    bytes.extend(oracle_record(3, u64::MAX, 100, -1));
    let requests = read(&bytes, TraceFormat::OracleGeneral, "");
    assert_eq!(
        requests[0],
        request(1_000_000, Operation::Read, 42 * 512, 4096, 42)
    );
    // A hashed key too large to be a block number keeps its id and gets an aligned position.
    assert_eq!(requests[1].object_id, u64::MAX);
    assert_eq!(requests[1].offset_bytes % 512, 0);
    assert_eq!(requests.len(), 2);
}

pub fn vscsi_v1_record(length: u32, command: u16, lbn: u64, time_us: u64) -> Vec<u8> {
    let mut bytes = Vec::new();
    bytes.extend_from_slice(&7u32.to_le_bytes()); // sn
    bytes.extend_from_slice(&length.to_le_bytes());
    bytes.extend_from_slice(&1u32.to_le_bytes()); // nSG
    bytes.extend_from_slice(&command.to_le_bytes());
    bytes.extend_from_slice(&0x0100u16.to_le_bytes()); // ver: version 1 in the high byte
    bytes.extend_from_slice(&lbn.to_le_bytes());
    bytes.extend_from_slice(&time_us.to_le_bytes());
    bytes
}

fn vscsi_v2_record(length: u32, command: u16, lbn: u64, time_us: u64) -> Vec<u8> {
    let mut bytes = Vec::new();
    bytes.extend_from_slice(&command.to_le_bytes());
    bytes.extend_from_slice(&0x0200u16.to_le_bytes()); // ver: version 2 in the high byte
    bytes.extend_from_slice(&7u32.to_le_bytes()); // sn
    bytes.extend_from_slice(&length.to_le_bytes());
    bytes.extend_from_slice(&1u32.to_le_bytes()); // nSG
    bytes.extend_from_slice(&lbn.to_le_bytes());
    bytes.extend_from_slice(&time_us.to_le_bytes());
    bytes.extend_from_slice(&99u64.to_le_bytes()); // response time
    bytes
}

#[test]
fn vscsi_version_1() {
    let mut bytes = vscsi_v1_record(512, 0x2A, 100, 10);
    bytes.extend(vscsi_v1_record(4096, 0x28, 200, 20));
    bytes.extend(vscsi_v1_record(0, 0x35, 0, 30));
    assert_eq!(
        read(&bytes, TraceFormat::Vscsi, ""),
        vec![
            request(10, Operation::Write, 51_200, 512, 100),
            request(20, Operation::Read, 102_400, 4096, 200),
            request(30, Operation::Other, 0, 0, 0),
        ]
    );
}

#[test]
fn vscsi_version_2() {
    let mut bytes = vscsi_v2_record(512, 0x8A, 100, 10);
    bytes.extend(vscsi_v2_record(8192, 0x88, 200, 20));
    bytes.extend(vscsi_v2_record(1024, 0x08, 300, 30));
    assert_eq!(
        read(&bytes, TraceFormat::Vscsi, ""),
        vec![
            request(10, Operation::Write, 51_200, 512, 100),
            request(20, Operation::Read, 102_400, 8192, 200),
            request(30, Operation::Read, 153_600, 1024, 300),
        ]
    );
}

#[test]
fn vscsi_single_record_and_empty_file() {
    let bytes = vscsi_v1_record(512, 0x28, 1, 2);
    assert_eq!(read(&bytes, TraceFormat::Vscsi, "").len(), 1);
    assert!(read(b"", TraceFormat::Vscsi, "").is_empty());
}

#[test]
fn format_names_round_trip() {
    for format in TraceFormat::ALL {
        assert_eq!(format.name().parse::<TraceFormat>().unwrap(), format);
        assert_eq!(format.to_string(), format.name());
    }
    assert_eq!(
        "oracleGeneral".parse::<TraceFormat>().unwrap(),
        TraceFormat::OracleGeneral
    );
}
