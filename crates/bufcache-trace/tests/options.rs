// Goal: TraceOptions::parse accepts libCacheSim's option strings and rejects bad ones by key.
// Method: parse representative strings (including the trailing `delimiter=,`) and compare
// fields; for bad input, check the error variant names the offending key.

use bufcache_trace::{
    BlkparseAction, TimeUnit, TraceError, TraceFormat, TraceOptions, VscsiVersion,
};

#[test]
fn libcachesim_string_with_trailing_comma_delimiter() {
    let options = TraceOptions::parse(
        "time-col=2,obj-id-col=5,obj-size-col=4,op-col=3,has-header=true,delimiter=,",
    )
    .unwrap();
    assert_eq!(options.time_column, Some(2));
    assert_eq!(options.object_id_column, Some(5));
    assert_eq!(options.object_size_column, Some(4));
    assert_eq!(options.operation_column, Some(3));
    assert!(options.has_header);
    assert_eq!(options.delimiter, ',');
}

#[test]
fn comma_delimiter_in_the_middle_and_other_delimiters() {
    let options = TraceOptions::parse("delimiter=,,obj-id-col=1").unwrap();
    assert_eq!(
        (options.delimiter, options.object_id_column),
        (',', Some(1))
    );
    assert_eq!(
        TraceOptions::parse("delimiter=\\t").unwrap().delimiter,
        '\t'
    );
    assert_eq!(
        TraceOptions::parse("delimiter=tab").unwrap().delimiter,
        '\t'
    );
    assert_eq!(TraceOptions::parse("delimiter= ").unwrap().delimiter, ' ');
    assert_eq!(
        TraceOptions::parse("delimiter=space").unwrap().delimiter,
        ' '
    );
    assert_eq!(TraceOptions::parse("delimiter=;").unwrap().delimiter, ';');
}

#[test]
fn our_own_keys() {
    let options = TraceOptions::parse(
        "lbn-size=4096,time-unit=ns,blkparse-action=D,vscsi-version=2,obj-id-is-num=false",
    )
    .unwrap();
    assert_eq!(options.lbn_size_bytes, 4096);
    assert_eq!(options.time_unit, TimeUnit::Nanoseconds);
    assert_eq!(options.blkparse_action, BlkparseAction::Dispatch);
    assert_eq!(options.vscsi_version, Some(VscsiVersion::V2));
    assert!(!options.object_id_is_numeric);
    assert_eq!(TraceOptions::parse("").unwrap(), TraceOptions::default());
}

fn rejected_key(text: &str) -> String {
    match TraceOptions::parse(text).expect_err(text) {
        TraceError::InvalidOption { key, .. } => key.to_owned(),
        TraceError::UnknownOption { key, .. } => key,
        other => panic!("{text}: unexpected {other:?}"),
    }
}

#[test]
fn bad_options_name_their_key() {
    assert_eq!(rejected_key("time-col=0"), "time-col");
    assert_eq!(rejected_key("obj-id-col=five"), "obj-id-col");
    assert_eq!(rejected_key("has-header=maybe"), "has-header");
    assert_eq!(rejected_key("delimiter=ab"), "delimiter");
    assert_eq!(rejected_key("lbn-size=0"), "lbn-size");
    assert_eq!(rejected_key("time-unit=fortnight"), "time-unit");
    assert_eq!(rejected_key("blkparse-action=X"), "blkparse-action");
    assert_eq!(rejected_key("vscsi-version=3"), "vscsi-version");
    assert_eq!(rejected_key("obj-id-col=1,colour=blue"), "colour");
    assert_eq!(rejected_key("obj-id-col"), "(option)");
    let message = TraceOptions::parse("op-col=-1").unwrap_err().to_string();
    assert!(
        message.contains("op-col") && message.contains("-1"),
        "{message}"
    );
}

#[test]
fn unknown_format_name() {
    let message = "pcap".parse::<TraceFormat>().unwrap_err().to_string();
    assert!(
        message.contains("pcap") && message.contains("oracle-general"),
        "{message}"
    );
}
