//! Goal: the names users' dashboards and scripts read stay exactly as they are: every metric
//! family of `/metrics` with its type, every series name with its label names, and every key
//! of the `/stats` JSON. Whatever builds the exposition (by hand, or a metrics crate), the
//! contract is the same.
//! Method: serve the exports that bring every family out (memory, an nbdkit upstream, and
//! over moto an S3 log-layout disk with a local cache), make one write, read and flush on each,
//! scrape both endpoints and reduce them to names (values and label values dropped), then
//! compare with the snapshot files under tests/data/. A deliberate change rewrites them with
//! BUFCACHE_UPDATE_SNAPSHOTS=1 and shows in the diff. The exposition must also be well formed
//! with two exports: each family declared once, its samples right after its declaration
//! (the text format's rule; a family two exports feed is one family).

mod common;
#[path = "../../bufcache-s3/tests/support/mod.rs"]
mod s3_support;

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::time::Duration;

use bufcache_nbd::NbdClient;
use common::*;
use s3_support::{have_moto, Moto};

const TIMEOUT: Duration = Duration::from_secs(60);

/// The body of `GET path` at `address`.
fn get(address: &str, path: &str) -> String {
    let mut stream = std::net::TcpStream::connect(address).unwrap();
    write!(stream, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(
        head.starts_with("HTTP/1.") && head.contains(" 200 "),
        "{head}"
    );
    body.to_string()
}

/// The label names of a series' `{…}`, in order, skipping quoted values (which may hold any
/// character, escaped).
fn label_names(labels: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = labels;
    while let Some((name, after)) = rest.split_once("=\"") {
        names.push(name.trim_start_matches(',').trim().to_string());
        let mut escaped = false;
        let end = after
            .char_indices()
            .find(|&(_, character)| {
                let closes = character == '"' && !escaped;
                escaped = character == '\\' && !escaped;
                closes
            })
            .map(|(index, _)| index)
            .expect("a closed label value");
        rest = &after[end + 1..];
    }
    names
}

/// The exposition reduced to names: `TYPE family kind` for each family and `SERIES
/// name{label,…}` for each distinct series shape.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines().filter(|line| !line.trim().is_empty()) {
        if let Some(declaration) = line.strip_prefix("# TYPE ") {
            names.insert(format!("TYPE {declaration}"));
        } else if line.starts_with('#') {
            continue;
        } else {
            let series = line.rsplit_once(' ').expect("a sample has a value").0;
            let shape = match series.split_once('{') {
                Some((name, labels)) => {
                    let labels = labels.strip_suffix('}').expect("labels end with }");
                    // Sorted: the order of labels is no part of a series' identity.
                    let mut names = label_names(labels);
                    names.sort();
                    format!("{name}{{{}}}", names.join(","))
                }
                None => series.to_string(),
            };
            names.insert(format!("SERIES {shape}"));
        }
    }
    names
}

/// Every key path of a JSON value: objects by key, arrays as `[]` (their elements' keys
/// together).
fn key_paths(value: &serde_json::Value, path: &str, paths: &mut BTreeSet<String>) {
    match value {
        serde_json::Value::Object(map) => {
            for (key, inner) in map {
                let inner_path = format!("{path}.{key}");
                paths.insert(inner_path.clone());
                key_paths(inner, &inner_path, paths);
            }
        }
        serde_json::Value::Array(items) => {
            for item in items {
                key_paths(item, &format!("{path}[]"), paths);
            }
        }
        _ => {}
    }
}

/// Compares `names` with the snapshot `file` (or writes it, with BUFCACHE_UPDATE_SNAPSHOTS=1).
fn check_snapshot(file: &str, names: &BTreeSet<String>) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(file);
    let text: String = names.iter().map(|name| format!("{name}\n")).collect();
    if std::env::var_os("BUFCACHE_UPDATE_SNAPSHOTS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &text).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path)
        .unwrap_or_else(|error| panic!("{}: {error}", path.display()));
    let expected: BTreeSet<&str> = expected.lines().collect();
    let actual: BTreeSet<&str> = text.lines().collect();
    let missing: Vec<&&str> = expected.difference(&actual).collect();
    let added: Vec<&&str> = actual.difference(&expected).collect();
    assert!(
        missing.is_empty() && added.is_empty(),
        "{file}: names changed (a dashboard reading them breaks)\nmissing: {missing:#?}\nadded: \
         {added:#?}\n(BUFCACHE_UPDATE_SNAPSHOTS=1 rewrites the file when the change is meant)"
    );
}

/// One write, read and flush on each export, so every per-command and per-export series
/// exists.
fn exercise(server: &Server, exports: &[&str]) {
    for export in exports {
        let client = NbdClient::connect(&server.uri_of(export)).unwrap();
        client.write(4096, &random_bytes(64 << 10, 7)).unwrap();
        let mut back = vec![0u8; 64 << 10];
        client.read(4096, &mut back).unwrap();
        client.flush().unwrap();
    }
}

/// Panics unless every family is declared once (`# HELP`, then `# TYPE`) and each sample
/// follows its own family's declaration with no other family in between.
fn assert_families_grouped(text: &str) {
    let mut declared = BTreeSet::new();
    let mut current: Option<(String, String)> = None;
    for line in text.lines().filter(|line| !line.trim().is_empty()) {
        if let Some(declaration) = line.strip_prefix("# TYPE ") {
            let (family, kind) = declaration.split_once(' ').expect("# TYPE name kind");
            assert!(
                declared.insert(family.to_string()),
                "{family} declared twice:\n{text}"
            );
            current = Some((family.to_string(), kind.to_string()));
        } else if !line.starts_with('#') {
            let (family, kind) = current.as_ref().expect("a sample before any # TYPE");
            let name = line.split(['{', ' ']).next().unwrap();
            let belongs = match kind.as_str() {
                "histogram" => ["_bucket", "_sum", "_count"]
                    .iter()
                    .any(|suffix| name.strip_suffix(suffix) == Some(family.as_str())),
                _ => name == family,
            };
            assert!(
                belongs,
                "sample `{line}` is not under its family (under {family}):\n{text}"
            );
        }
    }
}

fn check_server(server: &Server, snapshot: &str) {
    let address = metrics_address(&server.log_text());
    let text = get(&address, "/metrics");
    assert_families_grouped(&text);
    check_snapshot(&format!("{snapshot}.metrics.txt"), &metric_names(&text));
    let stats: serde_json::Value = serde_json::from_str(&get(&address, "/stats")).unwrap();
    let mut paths = BTreeSet::new();
    key_paths(&stats, "", &mut paths);
    check_snapshot(&format!("{snapshot}.stats.txt"), &paths);
}

#[test]
fn metric_names_labels_and_types_and_stats_keys_of_memory_and_upstream_exports_stay() {
    // Goal and method: see the file's opening comment; a memory export and an nbdkit upstream.
    let name = "metric_names_labels_and_types_and_stats_keys_of_memory_and_upstream_exports_stay";
    if !have_tools(name, &["nbdkit"]) {
        return;
    }
    let _timer = Timer::new(name);
    let dir = temp_dir();
    let upstream_socket = dir.path().join("upstream.sock");
    let _nbdkit = QuietChild::spawn(
        &mut cmd(
            "nbdkit",
            &[
                "-f",
                "-U",
                upstream_socket.to_str().unwrap(),
                "memory",
                "64M",
            ],
        ),
        "nbdkit",
        &dir.path().join("nbdkit.log"),
    );
    wait_until("nbdkit listens", TIMEOUT, || upstream_socket.exists());
    let memory = "mem=memory:64M".to_string();
    let upstream = format!("up=nbd+unix:///?socket={}", upstream_socket.display());
    let server = Server::start(
        dir.path(),
        "names",
        &[
            "--export",
            &memory,
            "--export",
            &upstream,
            "--metrics",
            "127.0.0.1:0",
        ],
    );
    exercise(&server, &["mem", "up"]);
    check_server(&server, "memory_and_upstream");
}

#[test]
fn metric_names_labels_and_types_and_stats_keys_of_an_s3_disk_with_a_local_cache_stay() {
    // Goal and method: see the file's opening comment; an S3 log-layout disk on moto with a
    // local cache in front.
    let name = "metric_names_labels_and_types_and_stats_keys_of_an_s3_disk_with_a_local_cache_stay";
    if !have_moto(name) {
        return;
    }
    let _timer = Timer::new(name);
    let dir = temp_dir();
    let moto = Moto::start();
    moto.create_bucket("disks");
    let url = format!(
        "s3://disks/vm1?endpoint={}&create-size=64M&layout=log&segment-size=1M&gc=off&lease=600",
        moto.endpoint()
    );
    let cache = dir.path().join("local.cache").display().to_string();
    let server = Server::start(
        dir.path(),
        "names-s3",
        &[
            "--backend",
            &url,
            "--local-cache",
            &cache,
            "--local-cache-size",
            "32M",
            "--metrics",
            "127.0.0.1:0",
        ],
    );
    exercise(&server, &[""]);
    check_server(&server, "s3_local_cache");
}
