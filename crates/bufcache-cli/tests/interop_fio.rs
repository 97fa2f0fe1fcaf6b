//! Goal: fio's nbd engine drives `bufcache serve` at queue depth 16 without a single corrupt
//! block. Method: a random-write job with `--verify=crc32c` (fio writes checksummed blocks, then
//! reads every one back and checks it), with a large cache and with a cache far smaller than the
//! data; then a clean restart and `--verify_only` re-checks the same blocks from the backing
//! file; a negative control (zeroed backing file) proves fio's verify would catch a loss.

mod common;

use std::time::Duration;

use common::*;

const TIMEOUT: Duration = Duration::from_secs(180);
const SIZE: &str = "48M";
const SIZE_BYTES: u64 = 48 << 20;

/// Runs one fio job against `uri`; returns (exit success, whole output, parsed JSON job).
fn fio(uri: &str, extra: &[&str]) -> (bool, String, Option<serde_json::Value>) {
    let uri_arg = format!("--uri={uri}");
    let size_arg = format!("--size={SIZE}");
    let mut args = vec![
        "--name=bufcache-verify",
        "--ioengine=nbd",
        uri_arg.as_str(),
        "--rw=randwrite",
        "--bsrange=4k-64k",
        "--iodepth=16",
        size_arg.as_str(),
        "--verify=crc32c",
        "--randseed=4242",
        "--output-format=json",
    ];
    args.extend_from_slice(extra);
    let output = run_timeout(cmd("fio", &args), TIMEOUT);
    let text = output_text(&output);
    // fio may print warnings before the JSON document; parse from the first '{'.
    let stdout = String::from_utf8_lossy(&output.stdout);
    let job = stdout
        .find('{')
        .and_then(|start| serde_json::from_str::<serde_json::Value>(&stdout[start..]).ok())
        .map(|json| json["jobs"][0].clone());
    (output.status.success(), text, job)
}

fn assert_no_verify_errors(success: bool, text: &str, job: &Option<serde_json::Value>) {
    let lower = text.to_lowercase();
    assert!(success, "fio failed:\n{text}");
    for needle in [
        "verify failed",
        "bad magic",
        "bad header",
        "crc32c: verify",
        "verify: ",
    ] {
        assert!(!lower.contains(needle), "fio reported `{needle}`:\n{text}");
    }
    let job = job
        .as_ref()
        .unwrap_or_else(|| panic!("no JSON job in fio output:\n{text}"));
    assert_eq!(job["error"], 0, "fio job error:\n{text}");
}

#[test]
fn fio_random_write_then_crc32c_verify_at_iodepth_16() {
    let _timer = Timer::new("fio_random_write_then_crc32c_verify_at_iodepth_16");
    if !have_tools("fio_random_write_verify", &["fio"]) {
        return;
    }
    let configurations: [&[&str]; 2] = [&[], &["--cache-size", "8M", "--dirty-age-max", "0.2"]];
    for extra in configurations {
        let dir = temp_dir();
        let mut args = vec!["--backend", "disk.img", "--create-size", "64M"];
        args.extend_from_slice(extra);
        let mut server = Server::start(dir.path(), "srv", &args);
        let (success, text, job) = fio(&server.uri(), &["--do_verify=1"]);
        assert_no_verify_errors(success, &text, &job);
        let job = job.unwrap();
        assert_eq!(
            job["write"]["io_bytes"], SIZE_BYTES,
            "config {extra:?}:\n{text}"
        );
        // The verify phase reads every written block back.
        assert_eq!(
            job["read"]["io_bytes"], SIZE_BYTES,
            "config {extra:?}:\n{text}"
        );
        eprintln!(
            "config {extra:?}: wrote {} and verified {} bytes; write {:.0} IOPS",
            job["write"]["io_bytes"],
            job["read"]["io_bytes"],
            job["write"]["iops"].as_f64().unwrap_or(0.0)
        );
        server.stop_clean();

        // The same blocks verify again after a clean restart on the same backing file.
        let mut server = Server::start(dir.path(), "srv2", &["--backend", "disk.img"]);
        let (success, text, job) = fio(&server.uri(), &["--verify_only"]);
        assert_no_verify_errors(success, &text, &job);
        assert_eq!(job.unwrap()["read"]["io_bytes"], SIZE_BYTES, "{text}");
        server.stop_clean();

        // Negative control: with the data gone, fio's verification must fail.
        let backing = dir.path().join("disk.img");
        write_file(&backing, &vec![0u8; 64 << 20]);
        let server = Server::start(dir.path(), "srv3", &["--backend", "disk.img"]);
        let (success, text, _) = fio(&server.uri(), &["--verify_only"]);
        assert!(
            !success && text.contains("verify: bad magic"),
            "fio --verify_only passed on a zeroed disk; the verify check is not effective:\n{text}"
        );
        drop(server);
    }
}
