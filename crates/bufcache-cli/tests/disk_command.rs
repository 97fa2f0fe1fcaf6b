//! `bufcache disk` as an owner uses it (issue 50): create, info, verify and resize from the
//! command line, with their exit statuses and `--json`, beside a server that serves the disk.
//! Against moto on loopback; nbdinfo reads the size a client sees.

mod common;
#[path = "../../bufcache-s3/tests/support/mod.rs"]
mod s3_support;

use std::process::Command;
use std::time::Duration;

use bufcache_nbd::NbdClient;
use common::*;
use s3_support::{have_moto, Moto};

const TIMEOUT: Duration = Duration::from_secs(60);

fn disk(args: &[&str]) -> std::process::Output {
    run_timeout(Command::new(bufcache_bin()).arg("disk").args(args), TIMEOUT)
}

fn json(output: &std::process::Output) -> serde_json::Value {
    serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|error| panic!("not JSON ({error}): {}", output_text(output)))
}

/// Flips byte 100 of the first segment object of `disks/vm` through moto's S3 API (boto3,
/// which moto's server installs); returns its key.
fn flip_a_byte_of_a_segment(endpoint: &str) -> String {
    boto3(endpoint, "", "first")
}

fn flip_back(endpoint: &str, key: &str) {
    boto3(endpoint, key, "again");
}

fn boto3(endpoint: &str, key: &str, which: &str) -> String {
    let script = r#"
import sys, boto3
endpoint, key, which = sys.argv[1], sys.argv[2], sys.argv[3]
s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                  aws_access_key_id="testing", aws_secret_access_key="testing")
if which == "first":
    listed = s3.list_objects_v2(Bucket="disks", Prefix="vm/log/segments/")
    key = sorted(o["Key"] for o in listed["Contents"])[0]
body = bytearray(s3.get_object(Bucket="disks", Key=key)["Body"].read())
body[100] ^= 0x20
s3.put_object(Bucket="disks", Key=key, Body=bytes(body))
print(key)
"#;
    let output = run_ok(
        Command::new("python3").args(["-c", script, endpoint, key, which]),
        TIMEOUT,
    );
    String::from_utf8(output.stdout).unwrap().trim().to_string()
}

fn nbdinfo_size(uri: &str) -> u64 {
    let output = run_ok(Command::new("nbdinfo").args(["--size", uri]), TIMEOUT);
    String::from_utf8(output.stdout)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

// Goal: an owner can create a disk, look at it while it is served (the lock holder shown),
// verify it (exit 0, then exit 1 naming a damaged segment), and grow it once the server
// stopped, a client seeing the new size at its next connection; a resize while served and
// bad input exit 2 with one line naming what was wrong. Method: the commands run against a
// log-layout disk on moto with a server writing through NBD; a segment damaged through
// moto's S3 API with the raw object put back afterwards.
#[test]
fn an_owner_creates_inspects_verifies_and_grows_a_disk() {
    let name = "an_owner_creates_inspects_verifies_and_grows_a_disk";
    if !have_moto(name) || !have_tools(name, &["nbdinfo"]) {
        return;
    }
    let _timer = Timer::new(name);
    let moto = Moto::start();
    moto.create_bucket("disks");
    let dir = temp_dir();
    let url = format!(
        "s3://disks/vm?endpoint={}&layout=log&segment-size=256k",
        moto.endpoint()
    );

    let created = disk(&["create", &url, "--size", "64M", "--json"]);
    assert!(created.status.success(), "{}", output_text(&created));
    let created = json(&created);
    assert_eq!(created["size_bytes"], 64 << 20);
    assert_eq!(created["layout"], "log");
    let again = disk(&["create", &url, "--size", "64M"]);
    assert_eq!(again.status.code(), Some(2), "{}", output_text(&again));
    assert!(
        output_text(&again).contains("exists"),
        "{}",
        output_text(&again)
    );

    let mut server = Server::start(
        dir.path(),
        "vm",
        &["--backend", &url, "--cache-size", "16M"],
    );
    let client = NbdClient::connect(&server.uri()).unwrap();
    let data = random_bytes(3 << 20, 50);
    client.write(1 << 20, &data).unwrap();
    client.flush().unwrap();
    let info = disk(&["info", &url, "--json"]);
    assert!(info.status.success(), "{}", output_text(&info));
    let info = json(&info);
    assert!(
        info["lock"]["pid"].as_u64() == Some(u64::from(server.pid())),
        "{info}"
    );
    assert_eq!(info["objects"]["mapped_bytes"], 3 << 20, "{info}");
    let text = disk(&["info", &url]);
    assert!(
        output_text(&text).contains(&format!("pid {}", server.pid())),
        "{}",
        output_text(&text)
    );

    let held = disk(&["resize", &url, "128M"]);
    assert_eq!(held.status.code(), Some(2), "{}", output_text(&held));
    assert!(
        output_text(&held).contains("in use by"),
        "{}",
        output_text(&held)
    );
    client.disconnect();
    server.stop_clean();

    let verified = disk(&["verify", &url, "--json"]);
    assert!(verified.status.success(), "{}", output_text(&verified));
    assert_eq!(json(&verified)["damaged"], serde_json::json!([]));
    let segment = flip_a_byte_of_a_segment(&moto.endpoint());
    let damaged = disk(&["verify", &url]);
    assert_eq!(damaged.status.code(), Some(1), "{}", output_text(&damaged));
    assert!(
        output_text(&damaged).contains(&format!("damaged: {segment}")),
        "{}",
        output_text(&damaged)
    );
    flip_back(&moto.endpoint(), &segment);
    assert!(disk(&["verify", &url]).status.success(), "restored");

    let resized = disk(&["resize", &url, "128M"]);
    assert!(resized.status.success(), "{}", output_text(&resized));
    let mut server = Server::start(dir.path(), "vm-grown", &["--backend", &url]);
    assert_eq!(
        nbdinfo_size(&server.uri()),
        128 << 20,
        "a new connection sees the new size"
    );
    let client = NbdClient::connect(&server.uri()).unwrap();
    let mut back = vec![0u8; 3 << 20];
    client.read(1 << 20, &mut back).unwrap();
    assert_same_bytes(&data, &back, "data after the resize");
    client.disconnect();
    server.stop_clean();

    let bad = disk(&["resize", &url, "12k34"]);
    assert_eq!(bad.status.code(), Some(2), "{}", output_text(&bad));
    let file = disk(&["info", "/var/tmp/image.raw"]);
    assert_eq!(file.status.code(), Some(2), "{}", output_text(&file));
    assert!(
        output_text(&file).contains("qemu-img"),
        "{}",
        output_text(&file)
    );
}
