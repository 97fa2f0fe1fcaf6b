//! Goal: a server with no credentials for an object store says so in one line naming where
//! it looked, and never asks the instance-metadata address unless told to. Method: moto on
//! loopback as the store; `bufcache serve` run with no key in its environment, HOME and the
//! credentials file pointed at an empty directory, and the metadata endpoint
//! (`AWS_METADATA_ENDPOINT`) at a loopback listener that counts the connections it accepts.

mod common;
#[path = "../../bufcache-s3/tests/support/mod.rs"]
mod s3_support;

use std::net::TcpListener;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use s3_support::{have_moto, Moto};

/// A loopback listener standing in for the instance-metadata service: it counts and closes
/// every connection.
struct MetadataListener {
    port: u16,
    connections: Arc<AtomicUsize>,
}

impl MetadataListener {
    fn start() -> MetadataListener {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let connections: Arc<AtomicUsize> = Arc::default();
        let counted = connections.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                counted.fetch_add(1, Ordering::SeqCst);
                drop(stream);
            }
        });
        MetadataListener { port, connections }
    }

    fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
}

/// `bufcache serve --backend URL` with no credentials anywhere it looks, the metadata
/// endpoint at `metadata_port`; expects it to exit and returns its output.
fn serve_without_credentials(dir: &std::path::Path, url: &str, metadata_port: u16) -> String {
    let mut command = Command::new(bufcache_bin());
    command
        .args(["serve", "--backend", url, "--listen"])
        .arg(format!("unix:{}", dir.join("refused.sock").display()));
    for name in [
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_ROLE_ARN",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    ] {
        command.env_remove(name);
    }
    command
        .env("HOME", dir)
        .env("AWS_SHARED_CREDENTIALS_FILE", dir.join("no-credentials"))
        .env(
            "AWS_METADATA_ENDPOINT",
            format!("http://127.0.0.1:{metadata_port}"),
        );
    let output = run_timeout(&mut command, Duration::from_secs(60));
    let text = output_text(&output);
    assert_eq!(output.status.code(), Some(2), "{url}: {text}");
    text
}

// Goal: with no credentials and `endpoint=` naming a store, serving is refused with one line
// naming the environment variables, the credentials file and the profile, and nothing
// connects to the metadata address; with `credentials=instance` the metadata address is
// asked (which shows the listener would have seen the first case's request). Method: see
// the file's opening comment; the second run has a short retry timeout so it ends quickly.
#[test]
fn no_credentials_is_one_line_naming_where_and_never_asks_the_metadata_address() {
    let name = "no_credentials_is_one_line_naming_where_and_never_asks_the_metadata_address";
    if !have_moto(name) {
        return;
    }
    let _timer = Timer::new(name);
    let dir = temp_dir();
    let moto = Moto::start();
    moto.create_bucket("disks");
    let metadata = MetadataListener::start();
    let puts_before = moto.request_count("PUT");
    let url = format!(
        "s3://disks/vm1?endpoint={}&create-size=8M&layout=chunk",
        moto.endpoint()
    );
    let refusal = serve_without_credentials(dir.path(), &url, metadata.port);
    let lines: Vec<&str> = refusal
        .lines()
        .filter(|line| line.contains("no credentials found"))
        .collect();
    assert_eq!(lines.len(), 1, "one line says what is missing: {refusal}");
    for place in [
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "profile `default`",
        "no-credentials",
        "credentials=instance",
    ] {
        assert!(lines[0].contains(place), "`{place}` not named: {refusal}");
    }
    assert!(
        !refusal.contains("169.254.169.254") && !refusal.contains("api/token"),
        "{refusal}"
    );
    assert_eq!(
        metadata.connections(),
        0,
        "a request went to the metadata address"
    );
    assert_eq!(
        moto.request_count("PUT"),
        puts_before,
        "the refused server wrote"
    );

    let asked = serve_without_credentials(
        dir.path(),
        &format!("{url}&credentials=instance&retry-timeout-ms=200"),
        metadata.port,
    );
    assert!(
        metadata.connections() > 0,
        "credentials=instance did not ask the metadata address: {asked}"
    );
}

// Goal: a wrong endpoint, a missing bucket and refused credentials are each refused at start
// with exit status 2 and a line naming that cause and what to check, not one guess for all
// three. Method: moto on loopback: an endpoint where nothing listens, a bucket never created,
// and moto's IAM checks turned on (after which the tests' key is unknown to it).
#[test]
fn a_wrong_endpoint_a_missing_bucket_and_refused_credentials_each_name_their_cause() {
    let name = "a_wrong_endpoint_a_missing_bucket_and_refused_credentials_each_name_their_cause";
    if !have_moto(name) {
        return;
    }
    let _timer = Timer::new(name);
    let dir = temp_dir();
    let moto = Moto::start();
    moto.create_bucket("disks");
    let refused = |url: &str| {
        let output = run_timeout(
            Command::new(bufcache_bin())
                .args(["serve", "--backend", url, "--listen"])
                .arg(format!("unix:{}", dir.path().join("never.sock").display())),
            Duration::from_secs(60),
        );
        let text = output_text(&output);
        assert_eq!(output.status.code(), Some(2), "{url}: {text}");
        text
    };
    let nobody = format!("http://127.0.0.1:{}", free_tcp_port());
    for (url, cause) in [
        (
            format!("s3://disks/vm1?endpoint={nobody}&create-size=8M&retry-timeout-ms=200"),
            "the endpoint did not answer (check endpoint=",
        ),
        (
            format!(
                "s3://no-such-bucket/vm1?endpoint={}&create-size=8M",
                moto.endpoint()
            ),
            "the bucket does not exist",
        ),
    ] {
        let text = refused(&url);
        assert!(text.contains(cause), "{url}: expected `{cause}` in: {text}");
    }
    let _reader = moto.read_only_user();
    let url = format!("s3://disks/vm1?endpoint={}&create-size=8M", moto.endpoint());
    let text = refused(&url);
    assert!(
        text.contains("the store refused the credentials (check AWS_ACCESS_KEY_ID"),
        "{url}: {text}"
    );
    moto.stop_checking_iam();
}
