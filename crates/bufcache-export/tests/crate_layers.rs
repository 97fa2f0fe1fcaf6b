//! The crates' layering: the backends (object store, local tier) and the NBD protocol crate
//! sit beside or below the engine, never above it, so they can be built, tested and reused
//! without the cache; only the crates where the engine meets something (this one, the
//! simulator, the command line) depend on it.

use std::path::Path;

/// The crates (path names under `crates/`) named in the `[dependencies]` table of `crate_name`'s
/// manifest: normal dependencies only, not dev- or build-dependencies.
fn normal_dependencies(crate_name: &str) -> Vec<String> {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(crate_name)
        .join("Cargo.toml");
    let text = std::fs::read_to_string(&manifest)
        .unwrap_or_else(|error| panic!("{}: {error}", manifest.display()));
    let mut in_dependencies = false;
    let mut names = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            in_dependencies = line == "[dependencies]";
            continue;
        }
        if in_dependencies && !line.starts_with('#') {
            if let Some((name, _)) = line.split_once('=') {
                names.push(name.trim().to_string());
            }
        }
    }
    names
}

#[test]
fn backends_and_the_protocol_crate_do_not_depend_on_the_engine() {
    // Goal: the layering `cargo tree -p CRATE -e normal` shows stays as the design says:
    // bufcache-s3, bufcache-tier and bufcache-nbd reach the Device trait through
    // bufcache-device and never import the engine (`bufcache`) except in their tests.
    // Method: read each manifest's [dependencies] table; also check the reading finds the
    // engine where it is a dependency (this crate), so the check can fail.
    for crate_name in ["bufcache-s3", "bufcache-tier", "bufcache-nbd"] {
        let names = normal_dependencies(crate_name);
        assert!(
            names.iter().any(|name| name == "bufcache-device"),
            "{crate_name} depends on {names:?}, not on bufcache-device"
        );
        assert!(
            !names.iter().any(|name| name == "bufcache"),
            "{crate_name} depends on the engine: {names:?}"
        );
    }
    let ours = normal_dependencies("bufcache-export");
    assert!(
        ours.iter().any(|name| name == "bufcache")
            && ours.iter().any(|name| name == "bufcache-nbd"),
        "the reading missed bufcache-export's own dependencies: {ours:?}"
    );
}

#[test]
fn the_seeded_check_harness_depends_on_no_crate_of_ours() {
    // Goal: the harness the seeded checkers share (bufcache-check) stays a leaf, so the
    // object store's checker (bufcache-s3, below the engine) and the engine's simulator
    // (bufcache-sim) both use it without drawing in each other or the engine. Method: read
    // its manifest's [dependencies] table; check that both checkers' crates list it.
    let names = normal_dependencies("bufcache-check");
    assert!(
        !names.iter().any(|name| name.starts_with("bufcache")),
        "bufcache-check depends on {names:?}"
    );
    for checker in ["bufcache-s3", "bufcache-sim"] {
        assert!(
            normal_dependencies(checker)
                .iter()
                .any(|name| name == "bufcache-check"),
            "{checker} does not use the shared harness"
        );
    }
}
