// Goal: `s3://` URLs, now read with the `url` crate's help, keep the meaning the hand-written
// parser gave them: parts are literal (as the AWS CLI reads `s3://` URLs: `%`, `+`, `#` and
// dot segments are text), every parameter is read as before, and every bad URL is refused
// with a one-line error naming the bad part. Method: a property test writes generated disks
// and parameters as URLs (`S3Url::to_url`) and parses them back (the seed is printed on
// failure; `URL_SEED=N` replays it); tables pin each normalisation edge and each refusal.

use bufcache_check::seeded_proptest::run_seeded;
use bufcache_s3::{Compression, LayoutKind, S3Url, UrlError};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

/// A prefix: segments of text URLs treat specially (`%`, `#`, `+`, spaces, dots, non-ASCII),
/// without the `/` it is trimmed of or the `?` that ends it.
fn prefix_strategy() -> impl Strategy<Value = String> {
    let segment = prop_oneof![
        "[a-zA-Z0-9._ %#+=@:é-]{0,8}",
        Just(".".to_string()),
        Just("..".to_string()),
    ];
    prop::collection::vec(segment, 0..4)
        .prop_map(|segments| segments.join("/").trim_matches('/').to_string())
}

fn endpoint_strategy() -> impl Strategy<Value = String> {
    // A name whose last label is a number is an invalid IPv4 address to `url` (and to the
    // store's HTTP client).
    let host = prop_oneof![
        "[a-z0-9]([a-z0-9-]{0,10}[a-z0-9])?(\\.[a-z][a-z0-9]{0,4}){0,2}",
        Just("127.0.0.1".to_string()),
        Just("[::1]".to_string()),
    ];
    (any::<bool>(), host, 1..=u16::MAX).prop_map(|(secure, host, port)| {
        format!("http{}://{host}:{port}", if secure { "s" } else { "" })
    })
}

fn url_strategy() -> impl Strategy<Value = S3Url> {
    let location = (
        "[a-zA-Z0-9]([a-zA-Z0-9.-]{0,20}[a-zA-Z0-9])?",
        prefix_strategy(),
        proptest::option::of(endpoint_strategy()),
        proptest::option::of("[a-z0-9-]{1,12}"),
        proptest::option::of(any::<bool>()),
        any::<u64>(),
        proptest::option::of("[0-9a-f]{1,16}"),
        any::<(bool, bool, bool)>(),
    );
    let layout = (
        proptest::option::of(prop_oneof![Just(LayoutKind::Chunk), Just(LayoutKind::Log)]),
        proptest::option::of((12..=26u32).prop_map(|shift| 1u64 << shift)),
        proptest::option::of((64u64 << 10)..=(1 << 30)),
        proptest::option::of(any::<bool>()),
        proptest::option::of(1..1_000_000u32),
        proptest::option::of("/[a-zA-Z0-9 ._%#+=é/-]{1,20}"),
        proptest::option::of(prop_oneof![
            Just(Compression::Off),
            Just(Compression::Zstd),
            Just(Compression::Lz4)
        ]),
        proptest::option::of(1..(1u64 << 50)),
        proptest::option::of("[a-zA-Z0-9][a-zA-Z0-9_:+@.-]{0,20}"),
        proptest::option::of(1_000..=600_000u64),
        proptest::option::of(100..=3_600_000u64),
    );
    (location, layout).prop_map(|(location, layout)| {
        let (bucket, prefix, endpoint, region, path_style, retry_timeout_ms, break_lock, flags) =
            location;
        let (lock_check, recover_prefix, credentials_instance) = flags;
        let (
            layout,
            chunk,
            segment,
            gc,
            threshold,
            key_file,
            compression,
            create,
            snapshot,
            lease,
            follow,
        ) = layout;
        let mut url = S3Url::parse(&format!("s3://{bucket}")).expect("a plain bucket parses");
        url.prefix = prefix;
        url.endpoint = endpoint;
        url.region = region;
        url.path_style = path_style;
        url.retry_timeout_ms = retry_timeout_ms;
        url.break_lock = break_lock;
        url.lock_check = lock_check;
        url.recover_prefix = recover_prefix;
        url.credentials_instance = credentials_instance;
        url.layout = layout;
        url.chunk_size_bytes = chunk;
        url.segment_bytes_max = segment;
        url.gc = gc;
        url.gc_threshold_ppm = threshold;
        url.key_file = key_file.map(Into::into);
        url.compression = compression;
        url.create_size_bytes = create;
        url.snapshot = snapshot;
        // None is `lease=off`; the default is written as no parameter.
        url.lease_ms = lease.filter(|ms| ms % 7 != 0);
        url.follow_ms = follow;
        url
    })
}

#[test]
fn every_written_url_parses_back_to_the_same_disk_and_parameters() {
    run_seeded("s3 url round trip", "URL_SEED", url_strategy(), |written| {
        let text = written.to_url();
        let parsed =
            S3Url::parse(&text).map_err(|error| TestCaseError::fail(format!("{text}: {error}")))?;
        prop_assert!(parsed == written, "{text} parsed as {}", parsed.to_url());
        Ok(())
    });
}

#[test]
fn parts_are_literal_where_url_would_normalise_them() {
    // (URL, bucket, prefix): `%`, `+`, `#`, spaces, tabs, non-ASCII and dot segments are
    // text; bucket case is kept; `/` around the prefix is trimmed.
    let cases = [
        ("s3://b/a%20b", "b", "a%20b"),
        ("s3://b/a+b", "b", "a+b"),
        ("s3://b/a#b", "b", "a#b"),
        ("s3://b/a b/é", "b", "a b/é"),
        ("s3://b/p\t", "b", "p\t"),
        ("s3://b/a/../c", "b", "a/../c"),
        ("s3://b/./p/", "b", "./p"),
        ("s3://b/%2e%2e", "b", "%2e%2e"),
        ("s3://b//a//b//", "b", "a//b"),
        ("s3://MyBucket/P", "MyBucket", "P"),
        ("s3://my.bucket-1", "my.bucket-1", ""),
        ("s3://b?region=r", "b", ""),
    ];
    for (text, bucket, prefix) in cases {
        let url = S3Url::parse(text).unwrap_or_else(|error| panic!("{text}: {error}"));
        assert_eq!(url.bucket, bucket, "{text}");
        assert_eq!(url.prefix, prefix, "{text}");
    }
    // Values are literal too: no percent-decoding, `+` is a plus (form decoding would make it
    // a space), `#` and `=` are text, and an endpoint keeps its spelling.
    let url = S3Url::parse(
        "s3://b/p?key-file=/k%41 +#=x&snapshot=a+b@c&endpoint=http://Store.Example:9000/",
    )
    .unwrap();
    assert_eq!(
        url.key_file.as_deref(),
        Some(std::path::Path::new("/k%41 +#=x"))
    );
    assert_eq!(url.snapshot.as_deref(), Some("a+b@c"));
    assert_eq!(url.endpoint.as_deref(), Some("http://Store.Example:9000"));
    for endpoint in ["http://x", "https://[::1]:9000", "http://h:9000/path/"] {
        let url = S3Url::parse(&format!("s3://b/p?endpoint={endpoint}")).unwrap();
        assert_eq!(
            url.endpoint.as_deref(),
            Some(endpoint.trim_end_matches('/'))
        );
    }
}

#[test]
fn every_bad_url_is_refused_naming_the_bad_part() {
    type Check = fn(&UrlError) -> bool;
    let scheme: Check = |error| matches!(error, UrlError::Scheme(_));
    let bucket: Check = |error| matches!(error, UrlError::Bucket { .. });
    let value: Check = |error| matches!(error, UrlError::BadValue { .. });
    let cases: [(&str, Check, &str); 18] = [
        ("s4://b/p", scheme, "not an s3:// URL"),
        ("S3://b/p", scheme, "not an s3:// URL"),
        ("s3:/b/p", scheme, "not an s3:// URL"),
        (
            "s3:///p",
            |error| matches!(error, UrlError::MissingBucket(_)),
            "missing bucket",
        ),
        (
            "s3://?region=r",
            |error| matches!(error, UrlError::MissingBucket(_)),
            "missing bucket",
        ),
        ("s3://b:9000/p", bucket, "endpoint=http://HOST:PORT"),
        ("s3://b:/p", bucket, "no port"),
        ("s3://a<b/p", bucket, "bucket `a<b`"),
        ("s3://a b/p", bucket, "bucket `a b`"),
        ("s3://a\tb/p", bucket, "letters, digits"),
        ("s3://a#b/p", bucket, "letters, digits"),
        ("s3://alice@b/p", bucket, "credentials do not go in the URL"),
        (
            "s3://b/p?endpoint=http://h:99999",
            value,
            "`endpoint=http://h:99999`",
        ),
        (
            "s3://b/p?endpoint=ftp://h",
            value,
            "expected http://HOST:PORT",
        ),
        (
            "s3://b/p?endpoint=http://a.0:9000",
            value,
            "invalid IPv4 address",
        ),
        ("s3://b/p?endpoint=http://", value, "`endpoint"),
        ("s3://b/p?endpoint= http://h", value, "`endpoint"),
        (
            "s3://b/p?region=a&region=b",
            |error| matches!(error, UrlError::DuplicateParameter { .. }),
            "given twice",
        ),
    ];
    for (text, is_expected, says) in cases {
        let error = S3Url::parse(text).expect_err(text);
        let message = error.to_string();
        assert!(is_expected(&error), "{text}: {error:?}");
        assert!(message.contains(says), "{text}: {message}");
        assert!(!message.contains('\n'), "{text}: {message}");
    }
    // A secret key typed into the URL is not echoed.
    let message = S3Url::parse("s3://AKIAEXAMPLE:s3cr3t@b/p")
        .unwrap_err()
        .to_string();
    assert!(
        !message.contains("s3cr3t") && !message.contains("AKIAEXAMPLE"),
        "{message}"
    );
    assert!(message.contains("…@b"), "{message}");
}
