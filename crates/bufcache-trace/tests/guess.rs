// Goal: TraceFormat::guess recognises each format from its name or first line.
// Method: write small sample files into a temporary directory and guess each one.

use std::fs;

use bufcache_trace::{TraceError, TraceFormat};

#[test]
fn guesses_by_name_and_content() {
    let directory = tempfile::tempdir().unwrap();
    let cases: [(&str, &[u8], TraceFormat); 6] = [
        ("a.vscsi", &[0u8; 64], TraceFormat::Vscsi),
        (
            "w.oracleGeneral.bin",
            &[0u8; 24],
            TraceFormat::OracleGeneral,
        ),
        (
            "job.log",
            b"fio version 3 iolog\n1 f add\n",
            TraceFormat::Fio,
        ),
        (
            "hm_0.csv",
            b"128166372003061629,hm,0,Read,3584,4096,1234\n",
            TraceFormat::Msr,
        ),
        (
            "sda.txt",
            b"  8,0    3        1     0.000000000  4162  Q  WS 2048 + 8 [kw]\n",
            TraceFormat::Blkparse,
        ),
        ("trace.csv", b"version,time,op,size,lbn\n", TraceFormat::Csv),
    ];
    for (name, content, expected) in cases {
        let path = directory.path().join(name);
        fs::write(&path, content).unwrap();
        assert_eq!(TraceFormat::guess(&path).unwrap(), expected, "{name}");
    }
    let unknown = directory.path().join("mystery.bin");
    fs::write(&unknown, b"\x00\x01").unwrap();
    assert!(matches!(
        TraceFormat::guess(&unknown),
        Err(TraceError::FormatNotGuessed { .. })
    ));
}
