// Goal: the NBD URI parser (built on `url` and `percent-encoding`) reads every URI the NBD URI
// standard allows with the meaning it gives them, keeps the meaning the hand-written parser
// gave the cases where `url` normalises (dot segments, `#`, tabs, a user without a host), and
// refuses every bad URI with the error naming what is wrong. Method: a property test writes
// generated addresses, export names and TLS settings as URIs (`NbdUri::new`) and parses them
// back (the seed is printed on failure; `URI_SEED=N` replays it); tables pin each
// normalisation edge and each refusal.

use std::net::Ipv6Addr;
use std::path::PathBuf;

use bufcache_check::seeded_proptest::run_seeded;
use bufcache_nbd::{ClientTls, NbdAddress, NbdUri, UriError};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

fn parse(text: &str) -> Result<NbdUri, UriError> {
    text.parse()
}

fn tcp(host: &str, port: u16) -> NbdAddress {
    NbdAddress::Tcp {
        host: host.to_string(),
        port,
    }
}

fn host_strategy() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-zA-Z0-9]([a-zA-Z0-9-]{0,12}[a-zA-Z0-9])?(\\.[a-zA-Z0-9]{1,8}){0,3}",
        // Names no DNS has, which a URI still carries (escaped).
        "[a-z%@:#/?é ]{1,8}",
        any::<[u8; 4]>().prop_map(|[a, b, c, d]| format!("{a}.{b}.{c}.{d}")),
        // `url` writes IPv6 hosts compressed as Rust does, except IPv4-mapped ones.
        any::<[u16; 8]>()
            .prop_map(Ipv6Addr::from)
            .prop_filter("IPv4-mapped", |address| address.to_ipv4_mapped().is_none())
            .prop_map(|address| format!("[{address}]")),
        Just("[::1]".to_string()),
    ]
}

/// Free text, with the characters URIs treat specially well represented.
fn text_strategy() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        "[a-z/%#?&=+@:;. \\t\\[\\]é]{0,16}",
        Just(".".to_string()),
        Just("..".to_string()),
        Just("a/../b".to_string()),
        Just("/disk".to_string()),
    ]
}

fn path_strategy() -> impl Strategy<Value = PathBuf> {
    text_strategy()
        .prop_filter("empty", |text| !text.is_empty())
        .prop_map(PathBuf::from)
}

fn tls_strategy() -> impl Strategy<Value = Option<ClientTls>> {
    let credentials = prop_oneof![
        (path_strategy(), Just(None)).prop_map(|(psk, certificates)| (Some(psk), certificates)),
        (Just(None), path_strategy()).prop_map(|(psk, certificates)| (psk, Some(certificates))),
        (path_strategy(), path_strategy()).prop_map(|(psk, certs)| (Some(psk), Some(certs))),
    ];
    let tls = (
        proptest::option::of(text_strategy()),
        credentials,
        proptest::option::of(text_strategy()),
    )
        .prop_map(|(username, (psk_file, certificates), hostname)| ClientTls {
            username,
            psk_file,
            certificates,
            hostname,
        });
    proptest::option::of(tls)
}

fn address_strategy() -> impl Strategy<Value = NbdAddress> {
    prop_oneof![
        (host_strategy(), 1..=u16::MAX).prop_map(|(host, port)| NbdAddress::Tcp { host, port }),
        path_strategy().prop_map(NbdAddress::Unix),
    ]
}

#[test]
fn every_written_uri_parses_back_to_the_same_address_export_and_tls() {
    let strategy = (address_strategy(), text_strategy(), tls_strategy());
    run_seeded(
        "nbd uri round trip",
        "URI_SEED",
        strategy,
        |(address, export, tls)| {
            let written = NbdUri::new(address, export, tls);
            let parsed = parse(&written.to_string())
                .map_err(|error| TestCaseError::fail(format!("{written}: {error}")))?;
            prop_assert_eq!(parsed, written);
            Ok(())
        },
    );
}

#[test]
fn the_standards_examples_and_the_edges_url_normalises_keep_their_meaning() {
    // (URI, address, export name): the NBD URI standard's table, then where `url` alone would
    // read the URI differently.
    let unix = |path: &str| NbdAddress::Unix(PathBuf::from(path));
    let cases = [
        ("nbd://example.com/disk", tcp("example.com", 10809), "disk"),
        ("nbd+unix:///disk?socket=sock", unix("sock"), "disk"),
        ("nbd://example.com/", tcp("example.com", 10809), ""),
        ("nbd://example.com", tcp("example.com", 10809), ""),
        (
            "nbd://example.com//disk",
            tcp("example.com", 10809),
            "/disk",
        ),
        (
            "nbd://example.com/hello%20world",
            tcp("example.com", 10809),
            "hello world",
        ),
        ("nbd+unix:///?socket=%00/abstract", unix("\0/abstract"), ""),
        // Dot segments are part of the export name (`url` would resolve them).
        ("nbd://h/a/../b", tcp("h", 10809), "a/../b"),
        ("nbd://h/%2e%2e", tcp("h", 10809), ".."),
        ("nbd://h/./", tcp("h", 10809), "./"),
        // `#` is text, not a fragment; `+` is a plus; tabs are kept.
        ("nbd://h/a#b", tcp("h", 10809), "a#b"),
        ("nbd+unix:///e?socket=/s#1", unix("/s#1"), "e"),
        ("nbd+unix:///a+b?socket=/a+b", unix("/a+b"), "a+b"),
        ("nbd://h/a\tb", tcp("h", 10809), "a\tb"),
        // Host names keep their case; IPv6 is compressed; a host is percent-decoded.
        (
            "nbd://Host.Example:10810/E",
            tcp("Host.Example", 10810),
            "E",
        ),
        ("nbd://[0:0::1]:10/e", tcp("[::1]", 10), "e"),
        ("nbd://[2001:DB8::1]/", tcp("[2001:db8::1]", 10809), ""),
        ("nbd://h%C3%A9/", tcp("hé", 10809), ""),
        ("nbd://hé/", tcp("hé", 10809), ""),
        ("nbd://127.1/", tcp("127.1", 10809), ""),
        ("nbd://h:010/", tcp("h", 10), ""),
        // Non-ASCII export names and sockets, typed or escaped.
        ("nbd://h/donn%C3%A9es", tcp("h", 10809), "données"),
        (
            "nbd+unix:///données?socket=/tmp/é",
            unix("/tmp/é"),
            "données",
        ),
    ];
    for (text, address, export) in cases {
        let uri = parse(text).unwrap_or_else(|error| panic!("{text}: {error}"));
        assert_eq!(uri.address, address, "{text}");
        assert_eq!(uri.export_name, export, "{text}");
        assert_eq!(uri.tls, None, "{text}");
        assert_eq!(uri.to_string(), text);
    }
    // The PSK identity: the user (percent-decoded), also before the empty host of a Unix
    // socket (`url` refuses a user without a host), and `tls-username=` wins over it.
    let uri = parse("nbds://al%20ice@h/?tls-psk-file=/k").unwrap();
    assert_eq!(uri.tls.unwrap().username.as_deref(), Some("al ice"));
    let uri = parse("nbds+unix://alice@/e?socket=/s&tls-psk-file=/k").unwrap();
    assert_eq!(uri.address, unix("/s"));
    assert_eq!(uri.tls.unwrap().username.as_deref(), Some("alice"));
    let uri = parse("nbds://alice@h/?tls-psk-file=/k&tls-username=bob").unwrap();
    assert_eq!(uri.tls.unwrap().username.as_deref(), Some("bob"));
}

#[test]
fn every_bad_uri_is_refused_naming_what_is_wrong() {
    type Check = fn(&UriError) -> bool;
    let cases: [(&str, Check, &str); 24] = [
        (
            "http://x/",
            |e| matches!(e, UriError::Scheme(_)),
            "unsupported URI scheme",
        ),
        (
            "NBD://h/e",
            |e| matches!(e, UriError::Scheme(_)),
            "unsupported URI scheme",
        ),
        (
            "nbd:/h/e",
            |e| matches!(e, UriError::Scheme(_)),
            "nbd://HOST",
        ),
        (
            "nbds://x/",
            |e| matches!(e, UriError::Tls(_)),
            "tls-psk-file=FILE",
        ),
        (
            "nbds://x/?tls-hostname=h",
            |e| matches!(e, UriError::Tls(_)),
            "credentials",
        ),
        (
            "nbd:///e",
            |e| matches!(e, UriError::MissingHost(_)),
            "missing host",
        ),
        (
            "nbds://alice@/e?tls-psk-file=/k",
            |e| matches!(e, UriError::MissingHost(_)),
            "missing host",
        ),
        (
            "nbd://h:0/e",
            |e| matches!(e, UriError::Port { .. }),
            "invalid port \"0\"",
        ),
        (
            "nbd://h:x/e",
            |e| matches!(e, UriError::Port { .. }),
            "invalid port \"x\"",
        ),
        (
            "nbd://h:/e",
            |e| matches!(e, UriError::Port { .. }),
            "invalid port \"\"",
        ),
        (
            "nbd://h:65536/e",
            |e| matches!(e, UriError::Port { .. }),
            "\"65536\"",
        ),
        (
            "nbd://[::1]:x/e",
            |e| matches!(e, UriError::Port { .. }),
            "\"x\"",
        ),
        (
            "nbd://[::g]/e",
            |e| matches!(e, UriError::Host { .. }),
            "invalid IPv6 address",
        ),
        (
            "nbd://[fe80::1%25eth0]/e",
            |e| matches!(e, UriError::Host { .. }),
            "IPv6",
        ),
        (
            "nbd://a<b/e",
            |e| matches!(e, UriError::Host { .. }),
            "invalid host",
        ),
        (
            "nbd://alice@h/e",
            |e| matches!(e, UriError::User(_)),
            "nbds://",
        ),
        (
            "nbds://alice:pw@h/e?tls-psk-file=/k",
            |e| matches!(e, UriError::Password(_)),
            "no password",
        ),
        (
            "nbd+unix://h/e?socket=/s",
            |e| matches!(e, UriError::UnixHost(_)),
            "take no host",
        ),
        (
            "nbd+unix://alice@/e?socket=/s",
            |e| matches!(e, UriError::UnixHost(_)),
            "take no host",
        ),
        (
            "nbd+unix:///e",
            |e| matches!(e, UriError::MissingSocket(_)),
            "socket=PATH",
        ),
        (
            "nbd+unix:///e?socket=",
            |e| matches!(e, UriError::MissingSocket(_)),
            "socket=PATH",
        ),
        (
            "nbd+unix:///e?sock=/s",
            |e| matches!(e, UriError::Query { .. }),
            "\"sock=/s\"",
        ),
        (
            "nbd://h/e?x-y=1",
            |e| matches!(e, UriError::Query { .. }),
            "\"x-y=1\"",
        ),
        (
            "nbd://h/%zz",
            |e| matches!(e, UriError::PercentEncoding(_)),
            "percent-encoding",
        ),
    ];
    for (text, is_expected, says) in cases {
        let error = parse(text).expect_err(text);
        let message = error.to_string();
        assert!(is_expected(&error), "{text}: {error:?}");
        assert!(message.contains(says), "{text}: {message}");
        assert!(message.contains(&format!("{text:?}")), "{text}: {message}");
        assert!(!message.contains('\n'), "{text}: {message}");
    }
    for malformed in [
        "nbd://h/a%2",
        "nbd://h/%",
        "nbd://h/%ff%fe",
        "nbd+unix:///?socket=%g0",
    ] {
        assert!(
            matches!(parse(malformed), Err(UriError::PercentEncoding(_))),
            "{malformed}"
        );
    }
}
