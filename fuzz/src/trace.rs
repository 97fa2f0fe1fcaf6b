//! Every trace reader, over in-memory input, plus option and format-name parsing.
//!
//! The first input byte picks one of a few option sets (the readers that take options
//! behave differently under each); the rest is the trace. Readers are drained past errors,
//! because iteration continues after a bad line and later lines must not panic either.

use bufcache_trace::{TraceError, TraceFormat, TraceOptions, TraceReader, VALUE_LENGTH_MAX};

/// Name the readers put in their errors.
const SOURCE: &str = "fuzz-input";

/// Option sets the first byte chooses from.
const OPTION_SETS: [&str; 6] = [
    "",
    "time-col=2,obj-id-col=5,obj-size-col=4,op-col=3,has-header=true,delimiter=,",
    "obj-id-col=1,delimiter=space,obj-id-is-num=false,lbn-size=1",
    "time-col=1,obj-id-col=2,obj-size-col=3,op-col=4,time-unit=ns,blkparse-action=C,vscsi-version=2,lbn-size=4096",
    "obj-id-col=3,blkparse-action=D,vscsi-version=1,time-unit=ms,delimiter=tab",
    "time-col=1,obj-id-col=2,obj-size-col=3,op-col=4,time-unit=us,lbn-size=1",
];

pub fn trace_csv(data: &[u8]) {
    run_reader(TraceFormat::Csv, data);
}

pub fn trace_blkparse(data: &[u8]) {
    run_reader(TraceFormat::Blkparse, data);
}

pub fn trace_msr(data: &[u8]) {
    run_reader(TraceFormat::Msr, data);
}

pub fn trace_fio(data: &[u8]) {
    run_reader(TraceFormat::Fio, data);
}

pub fn trace_oracle_general(data: &[u8]) {
    run_reader(TraceFormat::OracleGeneral, data);
}

pub fn trace_vscsi(data: &[u8]) {
    run_reader(TraceFormat::Vscsi, data);
}

/// `TraceOptions::parse` and `TraceFormat::from_str` on the first line; options that parse
/// then drive the CSV reader over the rest.
pub fn trace_options(data: &[u8]) {
    let split = data.iter().position(|&byte| byte == b'\n');
    let (line, body) = match split {
        Some(index) => (&data[..index], &data[index + 1..]),
        None => (data, &[][..]),
    };
    let text = String::from_utf8_lossy(line);
    if let Err(error) = text.parse::<TraceFormat>() {
        check_error_message(&error);
    }
    match TraceOptions::parse(&text) {
        Ok(options) => {
            assert!(
                options.lbn_size_bytes > 0,
                "lbn-size 0 accepted from {text:?}"
            );
            assert!(
                options.delimiter.is_ascii(),
                "delimiter {:?}",
                options.delimiter
            );
            for column in [
                options.time_column,
                options.object_id_column,
                options.object_size_column,
                options.operation_column,
            ]
            .into_iter()
            .flatten()
            {
                assert!(column > 0, "column 0 accepted from {text:?}");
            }
            drain(TraceFormat::Csv, &options, body);
        }
        Err(error) => {
            check_error_message(&error);
        }
    }
}

fn run_reader(format: TraceFormat, data: &[u8]) {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    let options = TraceOptions::parse(OPTION_SETS[usize::from(selector) % OPTION_SETS.len()])
        .expect("the fixed option sets parse");
    drain(format, &options, body);
}

fn drain(format: TraceFormat, options: &TraceOptions, body: &[u8]) {
    let reader = match TraceReader::new(body, SOURCE, format, options) {
        Ok(reader) => reader,
        Err(error) => {
            check_error_message(&error);
            return;
        }
    };
    let mut items = 0usize;
    for item in reader {
        items += 1;
        // Every item consumes at least one byte, so more items than bytes is a loop.
        assert!(
            items <= body.len() + 1,
            "{format} reader yields more items than the {} input bytes",
            body.len()
        );
        if let Err(error) = item {
            let message = check_error_message(&error);
            assert!(
                message.contains(SOURCE),
                "{format} error does not name its source: {message}"
            );
        }
    }
}

/// Error messages are bounded whatever the input (values are cut to `VALUE_LENGTH_MAX`
/// characters).
fn check_error_message(error: &TraceError) -> String {
    let message = error.to_string();
    let bound = 1024 + 16 * VALUE_LENGTH_MAX;
    assert!(
        message.len() <= bound,
        "error message of {} bytes: {}",
        message.len(),
        message.chars().take(300).collect::<String>()
    );
    message
}
