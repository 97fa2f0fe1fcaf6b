// Goal: no reader panics on any input, and every failure is a TraceError.
// Method: proptest feeds arbitrary bytes, and bytes drawn from each format's own alphabet
// (to get past the first field), to every format under several option sets, draining the
// whole stream so that errors on early lines do not hide later ones.

use bufcache_trace::{TraceFormat, TraceOptions, TraceReader};
use proptest::prelude::*;

const OPTION_SETS: [&str; 4] = [
    "time-col=2,obj-id-col=5,obj-size-col=4,op-col=3,has-header=true,delimiter=,",
    "obj-id-col=1,delimiter=space,obj-id-is-num=false,lbn-size=1",
    "time-col=1,obj-id-col=2,time-unit=ns,blkparse-action=C,vscsi-version=2,lbn-size=4096",
    "obj-id-col=3,blkparse-action=D,vscsi-version=1",
];

/// Reads every request of `bytes` in every format, ignoring results: only panics fail.
fn drain_all_formats(bytes: &[u8]) {
    for options_text in OPTION_SETS {
        let options = TraceOptions::parse(options_text).expect("fixed options parse");
        for format in TraceFormat::ALL {
            if let Ok(reader) = TraceReader::new(bytes, "fuzz", format, &options) {
                // Bounded by input size: every item consumes at least one byte.
                for item in reader.take(bytes.len() + 1) {
                    let _ = item.map_err(|error| error.to_string());
                }
            }
        }
    }
}

/// One valid sample per format, as seeds for mutation.
fn valid_samples() -> Vec<Vec<u8>> {
    let mut vscsi = Vec::new();
    for lbn in 0..3u64 {
        vscsi.extend_from_slice(&[1, 0, 0, 0, 0, 2, 0, 0, 1, 0, 0, 0, 0x28, 0, 0, 1]);
        vscsi.extend_from_slice(&lbn.to_le_bytes());
        vscsi.extend_from_slice(&lbn.to_le_bytes());
    }
    vec![
        b"version,time,op,size,lbn\n1,5,2a,512,100\n1,6,28,4096,7\n".to_vec(),
        b"  8,0 3 1 0.000000000 4162 Q WS 2048 + 8 [kw]\n  8,0 3 2 0.1 4162 C R 8 + 8 [0]\nCPU0 (8,0):\n".to_vec(),
        b"128166372003061629,hm,0,Read,3584,4096,1234\n128166372003061630,hm,0,Write,0,512,1\n".to_vec(),
        b"fio version 2 iolog\nf add\nf write 0 4096\nf wait 10 0\nf read 0 1\n".to_vec(),
        b"fio version 3 iolog\n1 f add\n2 f write 0 4096\n3 f sync 0 0\n".to_vec(),
        vec![7; 24 * 3],
        vscsi,
    ]
}

fn text_bytes() -> impl Strategy<Value = Vec<u8>> {
    let alphabet: Vec<u8> = b"0123456789,,,. +-\n\n\tRWSDQCx[]abcdefio version23ReadWrite".to_vec();
    prop::collection::vec(prop::sample::select(alphabet), 0..600)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..1200)) {
        drain_all_formats(&bytes);
    }

    #[test]
    fn text_like_bytes_never_panic(bytes in text_bytes()) {
        drain_all_formats(&bytes);
        let mut with_header = b"fio version 3 iolog\n".to_vec();
        with_header.extend_from_slice(&bytes);
        drain_all_formats(&with_header);
    }

    #[test]
    fn mutated_valid_samples_never_panic(
        sample_index in 0usize..7,
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        keep in any::<prop::sample::Index>(),
    ) {
        let mut bytes = valid_samples().swap_remove(sample_index);
        for (position, byte) in edits {
            let at = position.index(bytes.len());
            bytes[at] = byte;
        }
        bytes.truncate(keep.index(bytes.len() + 1));
        drain_all_formats(&bytes);
    }

    #[test]
    fn arbitrary_option_strings_never_panic(text in "[a-z=,\\-0-9 \\\\t]{0,60}") {
        let _ = TraceOptions::parse(&text);
    }

    #[test]
    fn arbitrary_format_names_never_panic(text in ".{0,20}") {
        let _ = text.parse::<TraceFormat>();
    }
}
