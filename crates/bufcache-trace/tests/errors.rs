// Goal: every bad input gives a TraceError that names the line or record and the field.
// Method: feed one broken sample per case through TraceReader/parse_all from memory and
// match the error variant's line number / record index, field and value, plus the message.

use bufcache_trace::{parse_all, TraceError, TraceFormat, TraceOptions, TraceReader};

fn options(text: &str) -> TraceOptions {
    TraceOptions::parse(text).expect("options parse")
}

fn first_error(bytes: &[u8], format: TraceFormat, options_text: &str) -> TraceError {
    parse_all(bytes, format, &options(options_text)).expect_err("input must be rejected")
}

/// Asserts a text error at `line_number` about `field`, whose value contains `value`.
fn assert_line_error(error: TraceError, line_number: u64, field: &str, value: &str) {
    let message = error.to_string();
    match error {
        TraceError::Line {
            path,
            line_number: actual_line,
            field: actual_field,
            value: actual_value,
            ..
        } => {
            assert_eq!(path.to_str(), Some("<memory>"), "{message}");
            assert_eq!(actual_line, line_number, "{message}");
            assert_eq!(actual_field, field, "{message}");
            assert!(actual_value.contains(value), "{message}");
            assert!(message.starts_with(&format!("<memory>:{line_number}: field {field}")));
        }
        other => panic!("expected a line error, got {other:?}"),
    }
}

const CLOUDPHYSICS: &str =
    "time-col=2,obj-id-col=5,obj-size-col=4,op-col=3,has-header=true,delimiter=,";

#[test]
fn csv_bad_number_names_column_key() {
    let text = b"version,time,op,size,lbn\n1,5,2a,512,100\n1,5,2a,51x,100\n";
    assert_line_error(
        first_error(text, TraceFormat::Csv, CLOUDPHYSICS),
        3,
        "obj-size-col",
        "51x",
    );
}

#[test]
fn csv_missing_column() {
    let text = b"version,time,op,size,lbn\n1,5,2a\n";
    let error = first_error(text, TraceFormat::Csv, CLOUDPHYSICS);
    assert!(
        error
            .to_string()
            .contains("line has 3 columns, column 5 needed"),
        "{error}"
    );
    assert_line_error(error, 2, "obj-id-col", "1,5,2a");
}

#[test]
fn csv_bad_time_and_overflowing_offset() {
    let bad_time = b"x,1\n";
    assert_line_error(
        first_error(bad_time, TraceFormat::Csv, "time-col=1,obj-id-col=2"),
        1,
        "time-col",
        "x",
    );
    let huge = b"1,18446744073709551615\n";
    assert_line_error(
        first_error(huge, TraceFormat::Csv, "time-col=1,obj-id-col=2"),
        1,
        "obj-id-col",
        "18446744073709551615",
    );
}

#[test]
fn csv_needs_object_id_column() {
    let error = first_error(b"1\n", TraceFormat::Csv, "time-col=1");
    assert!(
        matches!(error, TraceError::MissingOption { format: "csv", .. }),
        "{error}"
    );
}

#[test]
fn csv_invalid_utf8_line() {
    assert_line_error(
        first_error(b"1,2\n\xff\xfe,3\n", TraceFormat::Csv, "obj-id-col=2"),
        2,
        "line",
        "",
    );
}

#[test]
fn errors_do_not_stop_a_text_stream() {
    let text = b"1,2\n1,x\n1,3\n";
    let reader = TraceReader::new(
        &text[..],
        "t.csv",
        TraceFormat::Csv,
        &options("obj-id-col=2"),
    )
    .unwrap();
    let results: Vec<_> = reader.collect();
    assert_eq!(results.len(), 3);
    assert!(results[0].is_ok() && results[1].is_err() && results[2].is_ok());
}

#[test]
fn over_long_line_ends_the_stream() {
    let mut text = vec![b'1'; bufcache_trace::LINE_LENGTH_MAX + 10];
    text.extend_from_slice(b"\n1\n");
    let reader = TraceReader::new(
        &text[..],
        "t.csv",
        TraceFormat::Csv,
        &options("obj-id-col=1"),
    )
    .unwrap();
    let results: Vec<_> = reader.collect();
    assert_eq!(results.len(), 1);
    assert!(results[0]
        .as_ref()
        .unwrap_err()
        .to_string()
        .contains("line longer than"));
}

#[test]
fn blkparse_malformed_event_lines() {
    let short = b"  8,0    3        1     0.000000000  4162\n";
    assert_line_error(
        first_error(short, TraceFormat::Blkparse, ""),
        1,
        "event",
        "8,0",
    );
    let bad_sector = b"  8,0 3 1 0.0 4162 Q WS 20x8 + 8 [kw]\n";
    assert_line_error(
        first_error(bad_sector, TraceFormat::Blkparse, ""),
        1,
        "sector",
        "20x8",
    );
    let bad_count = b"  8,0 3 1 0.0 4162 Q WS 2048 + many [kw]\n";
    assert_line_error(
        first_error(bad_count, TraceFormat::Blkparse, ""),
        1,
        "count",
        "many",
    );
    let bad_time = b"ok line\n  8,0 3 1 0.0.1 4162 Q WS 2048 + 8 [kw]\n";
    assert_line_error(
        first_error(bad_time, TraceFormat::Blkparse, ""),
        2,
        "time",
        "0.0.1",
    );
    let no_plus = b"  8,0 3 1 0.0 4162 Q WS 2048 8 [kw]\n";
    assert_line_error(
        first_error(no_plus, TraceFormat::Blkparse, ""),
        1,
        "sector",
        "2048",
    );
}

#[test]
fn msr_bad_fields() {
    let bad_type = b"128166372003061629,hm,0,Trim,3584,4096,1234\n";
    assert_line_error(
        first_error(bad_type, TraceFormat::Msr, ""),
        1,
        "Type",
        "Trim",
    );
    let short = b"128166372003061629,hm,0,Read,3584\n";
    assert_line_error(first_error(short, TraceFormat::Msr, ""), 1, "Size", "3584");
    let bad_offset = b"1,hm,0,Read,-5,4096,1\n";
    assert_line_error(
        first_error(bad_offset, TraceFormat::Msr, ""),
        1,
        "Offset",
        "-5",
    );
    let extra = b"1,hm,0,Read,5,4096,1,9\n";
    assert_line_error(first_error(extra, TraceFormat::Msr, ""), 1, "line", "1,hm");
}

#[test]
fn fio_bad_header_and_lines() {
    let error = first_error(b"fio version 9 iolog\n", TraceFormat::Fio, "");
    assert!(matches!(error, TraceError::Header { .. }), "{error}");
    assert!(error.to_string().contains("fio version 9 iolog"), "{error}");
    let error = first_error(b"", TraceFormat::Fio, "");
    assert!(matches!(error, TraceError::Header { .. }), "{error}");

    let v2 = b"fio version 2 iolog\nf add\nf write 0\n";
    assert_line_error(
        first_error(v2, TraceFormat::Fio, ""),
        3,
        "length",
        "f write 0",
    );
    let v2 = b"fio version 2 iolog\nf fly 0 1\n";
    assert_line_error(first_error(v2, TraceFormat::Fio, ""), 2, "action", "fly");
    let v3 = b"fio version 3 iolog\nabc f write 0 1\n";
    assert_line_error(first_error(v3, TraceFormat::Fio, ""), 2, "timestamp", "abc");
    let v3 = b"fio version 3 iolog\n1 f read zero 1\n";
    assert_line_error(first_error(v3, TraceFormat::Fio, ""), 2, "offset", "zero");
}

#[test]
fn truncated_binary_records_are_named() {
    let mut bytes = vec![0u8; 24 * 2 + 5];
    bytes[4] = 1;
    let error = first_error(&bytes, TraceFormat::OracleGeneral, "");
    match error {
        TraceError::TruncatedRecord {
            record_index,
            offset_bytes,
            present_bytes,
            record_bytes,
            ..
        } => assert_eq!(
            (record_index, offset_bytes, present_bytes, record_bytes),
            (2, 48, 5, 24)
        ),
        other => panic!("expected a truncated record, got {other:?}"),
    }

    let mut vscsi = Vec::new();
    for lbn in 0..3u64 {
        vscsi.extend_from_slice(&[0; 12]);
        vscsi.extend_from_slice(&0x28u16.to_le_bytes());
        vscsi.extend_from_slice(&0x0100u16.to_le_bytes());
        vscsi.extend_from_slice(&lbn.to_le_bytes());
        vscsi.extend_from_slice(&0u64.to_le_bytes());
    }
    vscsi.truncate(3 * 32 - 1);
    let error = first_error(&vscsi, TraceFormat::Vscsi, "");
    assert!(
        error
            .to_string()
            .contains("record 2 at byte 64 is truncated: 31 of 32 bytes present"),
        "{error}"
    );
}

#[test]
fn vscsi_unknown_version_and_overflow() {
    let error = first_error(&[0u8; 80], TraceFormat::Vscsi, "");
    assert!(matches!(error, TraceError::Header { .. }), "{error}");
    assert!(error.to_string().contains("ver 0x0000"), "{error}");

    let mut record = vec![0u8; 32];
    record[12] = 0x28;
    record[15] = 1;
    record[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    let error = first_error(&record, TraceFormat::Vscsi, "");
    match error {
        TraceError::Record {
            record_index,
            offset_bytes,
            field,
            ..
        } => assert_eq!((record_index, offset_bytes, field), (0, 0, "lbn")),
        other => panic!("expected a record error, got {other:?}"),
    }
}

#[test]
fn open_trace_names_missing_file() {
    let result = bufcache_trace::open_trace(
        "/nonexistent/trace.csv",
        TraceFormat::Csv,
        &options("obj-id-col=1"),
    );
    let error = result.err().expect("missing file is an error");
    assert!(
        error.to_string().starts_with("/nonexistent/trace.csv:"),
        "{error}"
    );
}
