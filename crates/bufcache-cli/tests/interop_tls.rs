//! Goal: TLS on the server interoperates with the real NBD clients, over TCP and unix
//! sockets, with pre-shared keys and X.509 certificates, and refuses what it must: the wrong
//! key, an unknown identity, plain text against `--tls=require`, a client certificate from an
//! unknown CA, an expired one, none at all under `--tls-verify-peer`; bad credential files
//! stop the server at start-up naming the flag and file (exit 2).
//! Method: keys and certificates are made in the test with psktool and certtool (gnutls-bin);
//! `bufcache serve` listens on 127.0.0.1:0 and a unix socket; the clients are libnbd's
//! nbdinfo and nbdcopy (nbds:// and nbds+unix:// URIs) and qemu-img / qemu-io (tls-creds-psk
//! and tls-creds-x509 objects). Each case records works/refused in a matrix printed at the end.

mod reliability_support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use reliability_support::*;

fn run(command: &mut Command) -> Output {
    command.output().expect("running a tool")
}

fn run_ok(command: &mut Command) {
    let output = run(command);
    assert!(
        output.status.success(),
        "{command:?} failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The TCP port the server printed in its "listening on tcp:..." line.
fn tcp_port(server: &Server) -> u16 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let log = server.log_text();
        if let Some(port) = log
            .lines()
            .find_map(|line| line.strip_prefix("bufcache: listening on tcp:127.0.0.1:"))
            .and_then(|rest| rest.split_whitespace().next())
        {
            return port.parse().expect("a port number");
        }
        assert!(
            Instant::now() < deadline,
            "no TCP address in the log:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Makes a private key and a certificate from `template` with certtool, signed by the CA in
/// `ca` (a directory with ca-cert.pem and ca-key.pem), or self-signed when `ca` is None.
fn certificate(
    directory: &Path,
    name: &str,
    template: &str,
    ca: Option<&Path>,
) -> (PathBuf, PathBuf) {
    let key = directory.join(format!("{name}-key.pem"));
    let cert = directory.join(format!("{name}-cert.pem"));
    let info = directory.join(format!("{name}.info"));
    std::fs::write(&info, template).unwrap();
    run_ok(
        Command::new("certtool")
            .args([
                "--generate-privkey",
                "--key-type",
                "rsa",
                "--bits",
                "2048",
                "--outfile",
            ])
            .arg(&key),
    );
    let mut command = Command::new("certtool");
    match ca {
        None => {
            command.arg("--generate-self-signed");
        }
        Some(ca) => {
            command
                .arg("--generate-certificate")
                .arg("--load-ca-certificate")
                .arg(ca.join("ca-cert.pem"))
                .arg("--load-ca-privkey")
                .arg(ca.join("ca-key.pem"));
        }
    }
    run_ok(
        command
            .arg("--load-privkey")
            .arg(&key)
            .arg("--template")
            .arg(&info)
            .arg("--outfile")
            .arg(&cert),
    );
    (key, cert)
}

const CA_TEMPLATE: &str =
    "cn = bufcache test CA\nca\ncert_signing_key\ncrl_signing_key\nexpiration_days = 30\n";
const SERVER_TEMPLATE: &str = "organization = bufcache test\ncn = localhost\ndns_name = localhost\nip_address = 127.0.0.1\ntls_www_server\nencryption_key\nsigning_key\nexpiration_days = 30\n";
const CLIENT_TEMPLATE: &str = "organization = bufcache test\ncn = alice\ntls_www_client\nencryption_key\nsigning_key\nexpiration_days = 30\n";
const EXPIRED_CLIENT_TEMPLATE: &str = "organization = bufcache test\ncn = alice\ntls_www_client\nencryption_key\nsigning_key\nactivation_date = \"2020-01-01 00:00:00 UTC\"\nexpiration_date = \"2020-12-31 00:00:00 UTC\"\n";

/// A client credentials directory in the layout libnbd and qemu expect: ca-cert.pem,
/// client-cert.pem, client-key.pem.
fn client_directory(root: &Path, name: &str, ca: &Path, template: &str, signer: &Path) -> PathBuf {
    let directory = root.join(name);
    std::fs::create_dir_all(&directory).unwrap();
    std::fs::copy(ca.join("ca-cert.pem"), directory.join("ca-cert.pem")).unwrap();
    let (key, cert) = certificate(&directory, "made", template, Some(signer));
    std::fs::rename(key, directory.join("client-key.pem")).unwrap();
    std::fs::rename(cert, directory.join("client-cert.pem")).unwrap();
    directory
}

/// The server's directory (nbdkit's layout) and a trusted CA; plus a rogue CA.
struct Pki {
    server: PathBuf,
    ca: PathBuf,
    rogue_ca: PathBuf,
}

fn make_pki(root: &Path) -> Pki {
    let ca = root.join("ca");
    let rogue_ca = root.join("rogue-ca");
    let server = root.join("server");
    for directory in [&ca, &rogue_ca, &server] {
        std::fs::create_dir_all(directory).unwrap();
    }
    certificate(&ca, "ca", CA_TEMPLATE, None);
    certificate(&rogue_ca, "ca", CA_TEMPLATE, None);
    let (key, cert) = certificate(&server, "server", SERVER_TEMPLATE, Some(&ca));
    assert!(key.ends_with("server-key.pem") && cert.ends_with("server-cert.pem"));
    std::fs::copy(ca.join("ca-cert.pem"), server.join("ca-cert.pem")).unwrap();
    Pki {
        server,
        ca,
        rogue_ca,
    }
}

/// The interop matrix: one line per case.
#[derive(Default)]
struct Matrix(Vec<String>);

impl Matrix {
    /// Runs `command`, checks it succeeded (`expect_works`) or failed, and records the case.
    fn case(&mut self, name: &str, expect_works: bool, command: &mut Command) {
        let output = run(command);
        let works = output.status.success();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(
            works,
            expect_works,
            "{name}: expected {}, got {}:\n{stderr}",
            if expect_works { "works" } else { "refused" },
            if works { "works" } else { "refused" }
        );
        let outcome = if works { "works" } else { "refused" };
        let line = format!("{name:<62} {outcome}");
        eprintln!("{line}");
        self.0.push(line);
    }
}

fn nbdinfo(uri: &str) -> Command {
    let mut command = Command::new("nbdinfo");
    command.args(["--size", uri]);
    command
}

fn qemu_img_info(object: &str, image: &str) -> Command {
    let mut command = Command::new("qemu-img");
    command.args(["info", "--object", object, "--image-opts", image]);
    command
}

#[test]
fn tls_with_psk_interoperates_and_refuses_wrong_keys_and_plain_text() {
    let _timer = Timer::new("tls_with_psk_interoperates");
    if !have_tools(
        "interop_tls psk",
        &["psktool", "nbdinfo", "nbdcopy", "qemu-img", "qemu-io"],
    ) {
        return;
    }
    let dir = temp_dir();
    let root = dir.path();
    // qemu's tls-creds-psk reads DIR/keys.psk.
    run_ok(
        Command::new("psktool")
            .args(["-u", "alice", "-p"])
            .arg(root.join("keys.psk")),
    );
    let wrong = root.join("wrong");
    std::fs::create_dir_all(&wrong).unwrap();
    run_ok(
        Command::new("psktool")
            .args(["-u", "alice", "-p"])
            .arg(wrong.join("keys.psk")),
    );
    run_ok(
        Command::new("psktool")
            .args(["-u", "mallory", "-p"])
            .arg(root.join("mallory.psk")),
    );
    let keys = root.join("keys.psk");
    let keys_arg = keys.to_str().unwrap();
    let server = Server::start(
        root,
        "bufcache",
        &[
            "--backend",
            "memory:64M",
            "--listen",
            "tcp:127.0.0.1:0",
            "--tls",
            "require",
            "--tls-psk",
            keys_arg,
        ],
    );
    let port = tcp_port(&server);
    let socket = server.socket.display().to_string();
    let tcp = |file: &Path| {
        format!(
            "nbds://alice@127.0.0.1:{port}/?tls-psk-file={}",
            file.display()
        )
    };
    let unix = |file: &Path| {
        format!(
            "nbds+unix://alice@/?socket={socket}&tls-psk-file={}",
            file.display()
        )
    };
    let mut matrix = Matrix::default();
    matrix.case("nbdinfo      tcp   psk", true, &mut nbdinfo(&tcp(&keys)));
    matrix.case("nbdinfo      unix  psk", true, &mut nbdinfo(&unix(&keys)));
    // Data survives a round trip through TLS: 8 MiB in, 8 MiB out, compared.
    let input = root.join("in.bin");
    let output = root.join("out.bin");
    std::fs::write(&input, random_bytes(8 << 20, 3)).unwrap();
    matrix.case(
        "nbdcopy      tcp   psk (write 8 MiB)",
        true,
        Command::new("nbdcopy").arg(&input).arg(tcp(&keys)),
    );
    matrix.case(
        "nbdcopy      unix  psk (read back)",
        true,
        Command::new("nbdcopy").arg(unix(&keys)).arg(&output),
    );
    let back = std::fs::read(&output).unwrap();
    assert!(
        back[..8 << 20] == std::fs::read(&input).unwrap()[..],
        "data differs"
    );
    let psk_object = |directory: &Path, user: &str| {
        format!(
            "tls-creds-psk,id=tls0,dir={},username={user},endpoint=client",
            directory.display()
        )
    };
    let tcp_image = format!("driver=nbd,host=127.0.0.1,port={port},tls-creds=tls0");
    let unix_image = format!("driver=nbd,server.type=unix,server.path={socket},tls-creds=tls0");
    matrix.case(
        "qemu-img     tcp   psk",
        true,
        &mut qemu_img_info(&psk_object(root, "alice"), &tcp_image),
    );
    matrix.case(
        "qemu-io      unix  psk (write, read back)",
        true,
        Command::new("qemu-io")
            .args(["--object", &psk_object(root, "alice"), "--image-opts"])
            .arg(&unix_image)
            .args(["-c", "write -P 0x5a 1M 64k", "-c", "read -P 0x5a 1M 64k"]),
    );
    matrix.case(
        "nbdinfo      tcp   psk, wrong key",
        false,
        &mut nbdinfo(&tcp(&wrong.join("keys.psk"))),
    );
    matrix.case(
        "qemu-img     tcp   psk, wrong key",
        false,
        &mut qemu_img_info(&psk_object(&wrong, "alice"), &tcp_image),
    );
    matrix.case(
        "nbdinfo      tcp   psk, unknown identity",
        false,
        &mut nbdinfo(&format!(
            "nbds://mallory@127.0.0.1:{port}/?tls-psk-file={}",
            root.join("mallory.psk").display()
        )),
    );
    matrix.case(
        "nbdinfo      tcp   plain text vs --tls=require",
        false,
        &mut nbdinfo(&format!("nbd://127.0.0.1:{port}/")),
    );
    matrix.case(
        "qemu-img     unix  plain text vs --tls=require",
        false,
        &mut qemu_img_info(
            "secret,id=unused,data=x",
            &format!("driver=nbd,server.type=unix,server.path={socket}"),
        ),
    );
    // Refusals are logged with the peer's address and the reason.
    assert!(log_line_has(
        &server,
        &["127.0.0.1:", "TLS handshake failed"]
    ));
    assert!(log_line_has(&server, &["127.0.0.1:", "TLS is required"]));
}

/// True when one line of the server log contains every one of `texts` within 10 s: the
/// server writes its log from a thread of its own, so a line can land after the client that
/// caused it has its answer.
fn log_line_has(server: &Server, texts: &[&str]) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let log = server.log_text();
        if log
            .lines()
            .any(|line| texts.iter().all(|text| line.contains(text)))
        {
            return true;
        }
        if Instant::now() >= deadline {
            eprintln!("no log line with {texts:?} in:\n{log}");
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `--tls=on` serves both: clients that upgrade and clients that stay in plain text.
#[test]
fn tls_on_serves_both_plain_and_tls_clients() {
    if !have_tools("interop_tls on", &["psktool", "nbdinfo"]) {
        return;
    }
    let dir = temp_dir();
    let keys = dir.path().join("keys.psk");
    run_ok(
        Command::new("psktool")
            .args(["-u", "alice", "-p"])
            .arg(&keys),
    );
    let server = Server::start(
        dir.path(),
        "bufcache",
        &[
            "--backend",
            "memory:1M",
            "--listen",
            "tcp:127.0.0.1:0",
            "--tls",
            "on",
            "--tls-psk",
            keys.to_str().unwrap(),
        ],
    );
    let port = tcp_port(&server);
    let mut matrix = Matrix::default();
    matrix.case(
        "nbdinfo      tcp   plain text vs --tls=on",
        true,
        &mut nbdinfo(&format!("nbd://127.0.0.1:{port}/")),
    );
    matrix.case(
        "nbdinfo      tcp   psk vs --tls=on",
        true,
        &mut nbdinfo(&format!(
            "nbds://alice@127.0.0.1:{port}/?tls-psk-file={}",
            keys.display()
        )),
    );
}

#[test]
fn tls_with_certificates_interoperates_and_refuses_unknown_or_expired_clients() {
    let _timer = Timer::new("tls_with_certificates_interoperates");
    if !have_tools(
        "interop_tls x509",
        &["certtool", "nbdinfo", "nbdcopy", "qemu-img"],
    ) {
        return;
    }
    let dir = temp_dir();
    let root = dir.path();
    let pki = make_pki(root);
    let good = client_directory(root, "good", &pki.ca, CLIENT_TEMPLATE, &pki.ca);
    let rogue = client_directory(root, "rogue", &pki.ca, CLIENT_TEMPLATE, &pki.rogue_ca);
    let expired = client_directory(root, "expired", &pki.ca, EXPIRED_CLIENT_TEMPLATE, &pki.ca);
    // Trusts only the rogue CA, so it cannot verify the server.
    let distrustful =
        client_directory(root, "distrustful", &pki.rogue_ca, CLIENT_TEMPLATE, &pki.ca);
    let bob_template = CLIENT_TEMPLATE.replace("cn = alice", "cn = bob");
    let bob = client_directory(root, "bob", &pki.ca, &bob_template, &pki.ca);
    let server = Server::start(
        root,
        "bufcache",
        &[
            "--backend",
            "memory:64M",
            "--listen",
            "tcp:127.0.0.1:0",
            "--tls",
            "require",
            "--tls-certificates",
            pki.server.to_str().unwrap(),
            "--tls-verify-peer",
            // The default export: only the certificate whose common name is alice.
            "--export-identity",
            "=alice",
        ],
    );
    let port = tcp_port(&server);
    let socket = server.socket.display().to_string();
    let tcp = |directory: &Path| {
        format!(
            "nbds://127.0.0.1:{port}/?tls-certificates={}",
            directory.display()
        )
    };
    let unix = |directory: &Path| {
        format!(
            "nbds+unix:///?socket={socket}&tls-certificates={}&tls-hostname=localhost",
            directory.display()
        )
    };
    let mut matrix = Matrix::default();
    matrix.case("nbdinfo      tcp   x509", true, &mut nbdinfo(&tcp(&good)));
    matrix.case("nbdinfo      unix  x509", true, &mut nbdinfo(&unix(&good)));
    let input = root.join("in.bin");
    std::fs::write(&input, random_bytes(4 << 20, 5)).unwrap();
    matrix.case(
        "nbdcopy      tcp   x509 (write 4 MiB)",
        true,
        Command::new("nbdcopy").arg(&input).arg(tcp(&good)),
    );
    let x509_object = |directory: &Path| {
        format!(
            "tls-creds-x509,id=tls0,dir={},endpoint=client",
            directory.display()
        )
    };
    matrix.case(
        "qemu-img     tcp   x509",
        true,
        &mut qemu_img_info(
            &x509_object(&good),
            &format!("driver=nbd,host=127.0.0.1,port={port},tls-creds=tls0"),
        ),
    );
    matrix.case(
        "nbdinfo      tcp   x509, client cert from an unknown CA",
        false,
        &mut nbdinfo(&tcp(&rogue)),
    );
    matrix.case(
        "nbdinfo      tcp   x509, expired client cert",
        false,
        &mut nbdinfo(&tcp(&expired)),
    );
    matrix.case(
        "nbdinfo      tcp   x509, client does not trust the server's CA",
        false,
        &mut nbdinfo(&tcp(&distrustful)),
    );
    matrix.case(
        "nbdinfo      tcp   x509, valid cert for bob, export is alice's",
        false,
        &mut nbdinfo(&tcp(&bob)),
    );
    assert!(log_line_has(
        &server,
        &["127.0.0.1:", "export refused", "bob"]
    ));
    // A client with only the CA, no certificate of its own, under --tls-verify-peer.
    let anonymous = root.join("anonymous");
    std::fs::create_dir_all(&anonymous).unwrap();
    std::fs::copy(pki.ca.join("ca-cert.pem"), anonymous.join("ca-cert.pem")).unwrap();
    matrix.case(
        "nbdinfo      tcp   x509, no client certificate",
        false,
        &mut nbdinfo(&tcp(&anonymous)),
    );
    matrix.case(
        "nbdinfo      tcp   plain text vs --tls=require",
        false,
        &mut nbdinfo(&format!("nbd://127.0.0.1:{port}/")),
    );
    assert!(log_line_has(
        &server,
        &["127.0.0.1:", "TLS handshake failed"]
    ));
}

/// Bad credentials stop the server before it listens, naming the flag and the file.
#[test]
fn bad_tls_credentials_are_refused_at_start_up_naming_flag_and_file() {
    let dir = temp_dir();
    let root = dir.path();
    let psk = root.join("bad.psk");
    std::fs::write(&psk, "alice:00112233\nbob 4455\n").unwrap();
    let missing = root.join("no-such-dir");
    let empty = root.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let cases: Vec<(Vec<String>, Vec<String>)> = vec![
        (
            vec![
                "--tls=require".into(),
                "--tls-psk".into(),
                psk.display().to_string(),
            ],
            vec![
                "--tls-psk".into(),
                psk.display().to_string(),
                "line 2".into(),
            ],
        ),
        (
            vec![
                "--tls=on".into(),
                "--tls-certificates".into(),
                missing.display().to_string(),
            ],
            vec!["--tls-certificates".into(), "server-cert.pem".into()],
        ),
        (
            vec!["--tls=require".into()],
            vec!["--tls-certificates".into(), "--tls-psk".into()],
        ),
        (
            vec!["--tls-psk".into(), psk.display().to_string()],
            vec!["--tls".into()],
        ),
        (
            vec![
                "--tls=require".into(),
                "--tls-psk".into(),
                psk.display().to_string(),
                "--tls-verify-peer".into(),
            ],
            vec!["--tls-verify-peer".into()],
        ),
        (
            vec!["--tls=sometimes".into()],
            vec!["--tls".into(), "sometimes".into()],
        ),
    ];
    for (arguments, expected) in cases {
        let output = run(Command::new(bufcache_bin())
            .args(["serve", "--backend", "memory:1M", "--listen"])
            .arg(format!("unix:{}", root.join("s.sock").display()))
            .args(&arguments));
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{arguments:?}: {stderr}");
        for text in expected {
            assert!(
                stderr.contains(&text),
                "{arguments:?}: no {text:?} in {stderr}"
            );
        }
    }
}

/// Per-export authorisation by PSK identity and per-export read-only: export `a` is alice's
/// alone, `b` is open to every key holder but read-only. bob does not see `a` in the list and
/// cannot open it; nobody can write `b`.
#[test]
fn exports_are_authorised_per_identity_and_hidden_from_others() {
    if !have_tools("interop_tls exports", &["psktool", "nbdinfo", "nbdcopy"]) {
        return;
    }
    let dir = temp_dir();
    let root = dir.path();
    let keys = root.join("keys.psk");
    for user in ["alice", "bob"] {
        run_ok(Command::new("psktool").args(["-u", user, "-p"]).arg(&keys));
    }
    let server = Server::start(
        root,
        "bufcache",
        &[
            "--export",
            "a=memory:8M",
            "--export",
            "b=memory:8M",
            "--listen",
            "tcp:127.0.0.1:0",
            "--tls",
            "require",
            "--tls-psk",
            keys.to_str().unwrap(),
            "--export-identity",
            "a=alice",
            "--export-read-only",
            "b",
        ],
    );
    let port = tcp_port(&server);
    let uri = |user: &str, export: &str| {
        format!(
            "nbds://{user}@127.0.0.1:{port}/{export}?tls-psk-file={}",
            keys.display()
        )
    };
    let list = |user: &str| {
        let output = run(Command::new("nbdinfo").arg("--list").arg(uri(user, "")));
        assert!(output.status.success(), "{output:?}");
        String::from_utf8_lossy(&output.stdout).into_owned()
    };
    let alice_sees = list("alice");
    assert!(
        alice_sees.contains("export=\"a\"") && alice_sees.contains("export=\"b\""),
        "{alice_sees}"
    );
    let bob_sees = list("bob");
    assert!(
        !bob_sees.contains("export=\"a\"") && bob_sees.contains("export=\"b\""),
        "{bob_sees}"
    );
    let mut matrix = Matrix::default();
    matrix.case(
        "nbdinfo      tcp   psk alice opens a (hers)",
        true,
        &mut nbdinfo(&uri("alice", "a")),
    );
    matrix.case(
        "nbdinfo      tcp   psk bob opens a (alice's)",
        false,
        &mut nbdinfo(&uri("bob", "a")),
    );
    matrix.case(
        "nbdinfo      tcp   psk bob opens b (read-only)",
        true,
        &mut nbdinfo(&uri("bob", "b")),
    );
    let input = root.join("in.bin");
    std::fs::write(&input, random_bytes(1 << 20, 9)).unwrap();
    matrix.case(
        "nbdcopy      tcp   psk alice writes a",
        true,
        Command::new("nbdcopy").arg(&input).arg(uri("alice", "a")),
    );
    matrix.case(
        "nbdcopy      tcp   psk alice writes b (read-only)",
        false,
        Command::new("nbdcopy").arg(&input).arg(uri("alice", "b")),
    );
    assert!(log_line_has(
        &server,
        &["127.0.0.1:", "export refused", "bob"]
    ));
}

/// TLS on the upstream side: bufcache fronts nbdkit running `--tls=require`, over
/// `nbds+unix://` with a PSK and with certificates. Data written through bufcache is on the
/// TLS-only upstream after a clean stop (read back over TLS and compared); a wrong key makes
/// the backend fail at start-up with the TLS reason, never a plain-text fallback.
#[test]
fn bufcache_fronts_a_tls_only_upstream_with_psk_and_certificates() {
    let _timer = Timer::new("bufcache_fronts_a_tls_only_upstream");
    if !have_tools(
        "interop_tls upstream",
        &["nbdkit", "psktool", "certtool", "nbdcopy"],
    ) {
        return;
    }
    let dir = temp_dir();
    let root = dir.path();
    let keys = root.join("keys.psk");
    run_ok(
        Command::new("psktool")
            .args(["-u", "alice", "-p"])
            .arg(&keys),
    );
    let wrong = root.join("wrong.psk");
    run_ok(
        Command::new("psktool")
            .args(["-u", "alice", "-p"])
            .arg(&wrong),
    );
    let pki = make_pki(root);
    let client = client_directory(root, "client", &pki.ca, CLIENT_TEMPLATE, &pki.ca);
    let psk_upstream = Nbdkit::start(
        root,
        "psk-upstream",
        &[
            "--tls=require".into(),
            format!("--tls-psk={}", keys.display()),
            "memory".into(),
            "64M".into(),
        ],
    );
    let x509_upstream = Nbdkit::start(
        root,
        "x509-upstream",
        &[
            "--tls=require".into(),
            format!("--tls-certificates={}", pki.server.display()),
            "memory".into(),
            "64M".into(),
        ],
    );
    let psk_uri = |file: &Path| {
        format!(
            "nbds+unix://alice@/?socket={}&tls-psk-file={}",
            psk_upstream.socket.display(),
            file.display()
        )
    };
    let x509_uri = format!(
        "nbds+unix:///?socket={}&tls-certificates={}&tls-hostname=localhost",
        x509_upstream.socket.display(),
        client.display()
    );
    let input = root.join("in.bin");
    std::fs::write(&input, random_bytes(4 << 20, 11)).unwrap();
    for (name, backend) in [("psk", psk_uri(&keys)), ("x509", x509_uri.clone())] {
        let mut server = Server::start(root, &format!("front-{name}"), &["--backend", &backend]);
        run_ok(Command::new("nbdcopy").arg(&input).arg(server.uri()));
        server.stop_clean(Duration::from_secs(60));
        let output = root.join(format!("out-{name}.bin"));
        run_ok(Command::new("nbdcopy").arg(&backend).arg(&output));
        let back = std::fs::read(&output).unwrap();
        assert!(
            back[..4 << 20] == std::fs::read(&input).unwrap()[..],
            "{name}: data on the upstream differs"
        );
        eprintln!(
            "{:<62} works",
            format!("bufcache → nbdkit  unix  {name} (write 4 MiB, read back)")
        );
    }
    let output = run(Command::new(bufcache_bin())
        .current_dir(root)
        .args(["serve", "--backend", &psk_uri(&wrong), "--listen"])
        .arg(format!("unix:{}", root.join("never.sock").display())));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(stderr.contains("TLS"), "{stderr}");
    eprintln!("{:<62} refused", "bufcache → nbdkit  unix  psk, wrong key");
}
