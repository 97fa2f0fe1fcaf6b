//! The non-server commands behave as documented: dd copies exactly what dd would (checked
//! byte for byte against a reference computed here), replay matches libCacheSim's numbers on
//! the real trace, sim writes its files, the config default is valid TOML, docs/cli.md is
//! current, and bad input gets an error naming what was wrong.
//!
//! Method: run the release binary as a user would, on temporary files.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn bufcache(arguments: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_bufcache"))
        .args(arguments)
        .output()
        .expect("running bufcache")
}

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

fn pseudo_random_bytes(length: usize, seed: u64) -> Vec<u8> {
    let mut state = seed;
    (0..length)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn dd_copies_exactly_like_dd() {
    let directory = tempfile::tempdir().unwrap();
    let input = directory.path().join("in.img");
    let output = directory.path().join("out.img");
    let data = pseudo_random_bytes(3 * 1024 * 1024 + 1234, 7);
    std::fs::write(&input, &data).unwrap();
    let result = bufcache(&[
        "dd",
        &format!("if={}", input.display()),
        &format!("of={}", output.display()),
        "bs=64k",
    ]);
    assert!(result.status.success(), "{}", text(&result));
    assert_eq!(
        std::fs::read(&output).unwrap(),
        data,
        "a whole copy is identical (cmp)"
    );
    assert!(
        text(&result).contains("48+1 records in"),
        "{}",
        text(&result)
    );

    // skip, seek, count and conv=notrunc, against the same copy done by hand.
    let existing = pseudo_random_bytes(1024 * 1024, 9);
    std::fs::write(&output, &existing).unwrap();
    let result = bufcache(&[
        "dd",
        &format!("if={}", input.display()),
        &format!("of={}", output.display()),
        "bs=4k",
        "skip=3",
        "seek=5",
        "count=300",
        "conv=notrunc",
        "--cluster-size-max",
        "16k",
    ]);
    assert!(result.status.success(), "{}", text(&result));
    let mut expected = existing.clone();
    expected.resize(expected.len().max((5 + 300) * 4096), 0);
    expected[5 * 4096..(5 + 300) * 4096].copy_from_slice(&data[3 * 4096..(3 + 300) * 4096]);
    assert_eq!(std::fs::read(&output).unwrap(), expected);
    // 300 blocks in clusters of at most 16 KiB: 75 when runs start at the first dirty block,
    // 76 when write-behind already pushed the aligned clusters (a 3-block head, one tail block).
    let report = text(&result);
    let writes: u64 = report
        .split("device writes: ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|count| count.parse().ok())
        .unwrap_or_else(|| panic!("no device write count in: {report}"));
    assert!(
        (75..=76).contains(&writes),
        "clusters bounded by the knob: {report}"
    );
}

#[test]
fn dd_with_direct_io_round_trips() {
    let directory = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let input = directory.path().join("in.img");
    let output = directory.path().join("out.img");
    let data = pseudo_random_bytes(2 * 1024 * 1024, 11);
    std::fs::write(&input, &data).unwrap();
    let result = bufcache(&[
        "dd",
        &format!("if={}", input.display()),
        &format!("of={}", output.display()),
        "bs=1M",
        "iflag=direct",
        "oflag=direct",
    ]);
    let output_text = text(&result);
    if output_text.contains("refuses it") {
        eprintln!("skipped: this file system refuses O_DIRECT: {output_text}");
        return;
    }
    assert!(result.status.success(), "{output_text}");
    assert_eq!(std::fs::read(&output).unwrap(), data);
}

#[test]
fn dd_demonstration_runs_with_no_arguments() {
    let result = bufcache(&["dd"]);
    let output = text(&result);
    assert!(result.status.success(), "{output}");
    assert_eq!(output.matches("86+0 records in").count(), 2, "{output}");
    assert!(
        output.contains("device writes: 86 transfers"),
        "1 MiB clusters: {output}"
    );
}

#[test]
fn replay_matches_libcachesim_on_the_real_trace() {
    let trace = Path::new("/work/shared/traces/cloudPhysicsIO.csv");
    let trace = if trace.exists() {
        trace.to_path_buf()
    } else {
        workspace_root().join("../shared/traces/cloudPhysicsIO.csv")
    };
    if !trace.exists() {
        eprintln!("skipped: the cloudPhysicsIO trace is not on this machine");
        return;
    }
    let result = bufcache(&[
        "replay",
        trace.to_str().unwrap(),
        "--format",
        "csv",
        "--trace-options",
        "time-col=2,obj-id-col=5,obj-size-col=4,op-col=3,has-header=true,delimiter=,",
        "--policy",
        "lru,s3fifo",
        "--cache-size",
        "4897",
        "--no-split",
        "--json",
    ]);
    assert!(result.status.success(), "{}", text(&result));
    let rows: serde_json::Value = serde_json::from_slice(&result.stdout).unwrap();
    let ratio = |index: usize| rows[index]["miss_ratio"].as_f64().unwrap();
    assert_eq!(rows[0]["policy"], "lru");
    assert_eq!(rows[0]["requests"], 113_872);
    // libCacheSim 0.3.5 on the same trace: LRU 0.8049, S3-FIFO 0.7553 (docs/policies.md).
    assert!((ratio(0) - 0.8049).abs() < 0.0001, "lru {}", ratio(0));
    assert!((ratio(1) - 0.7553).abs() < 0.0001, "s3fifo {}", ratio(1));
}

#[test]
fn sim_experiment_prints_its_table_and_writes_its_files() {
    let directory = tempfile::tempdir().unwrap();
    let result = bufcache(&[
        "sim",
        "experiment",
        "maxbsize",
        "--scale",
        "0.25",
        "--output",
        directory.path().to_str().unwrap(),
    ]);
    assert!(result.status.success(), "{}", text(&result));
    assert!(text(&result).contains("MAXBSIZE"), "{}", text(&result));
    for extension in ["txt", "csv", "comparison.csv", "json", "svg", "png"] {
        let path = directory.path().join(format!("maxbsize.{extension}"));
        assert!(
            std::fs::metadata(&path)
                .map(|m| m.len() > 0)
                .unwrap_or(false),
            "{} written",
            path.display()
        );
    }
    let result = bufcache(&["sim", "experiment", "nonesuch"]);
    assert!(!result.status.success());
    assert!(
        text(&result).contains("maxbsize"),
        "the error lists the experiments: {}",
        text(&result)
    );
}

#[test]
fn replay_draws_its_miss_ratio_curve_as_svg_and_png() {
    // Goal: `--plot` writes the format its extension names, with axes in real units.
    // Method: replay a small loop trace with .svg and .png names; check the PNG signature
    // and the SVG's axis labels and legend.
    let directory = tempfile::tempdir().unwrap();
    let trace = directory.path().join("loop.csv");
    let lines: String = (0..3000)
        .map(|index| format!("{index},{},4096,r\n", index % 300))
        .collect();
    std::fs::write(&trace, lines).unwrap();
    for name in ["curve.svg", "curve.png"] {
        let plot = directory.path().join(name);
        let result = bufcache(&[
            "replay",
            trace.to_str().unwrap(),
            "--format",
            "csv",
            "--trace-options",
            "time-col=1,obj-id-col=2,obj-size-col=3,op-col=4",
            "--policy",
            "lru,s3fifo",
            "--cache-size",
            "100,200,400",
            "--no-split",
            "--plot",
            plot.to_str().unwrap(),
        ]);
        assert!(result.status.success(), "{}", text(&result));
        let bytes = std::fs::read(&plot).unwrap();
        if name.ends_with(".png") {
            assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "a real PNG");
        } else {
            let svg = String::from_utf8(bytes).unwrap();
            assert!(
                svg.starts_with("<svg") && svg.contains("lru") && svg.contains("miss ratio"),
                "{svg}"
            );
            assert!(svg.contains("cache size (objects)"), "{svg}");
        }
    }
    // Split into blocks, the x axis is in a binary unit fitted to the sizes, never "bytes or
    // blocks".
    let plot = directory.path().join("bytes.svg");
    let result = bufcache(&[
        "replay",
        trace.to_str().unwrap(),
        "--format",
        "csv",
        "--trace-options",
        "time-col=1,obj-id-col=2,obj-size-col=3,op-col=4",
        "--cache-size",
        "512KiB,1MiB,2MiB",
        "--plot",
        plot.to_str().unwrap(),
    ]);
    assert!(result.status.success(), "{}", text(&result));
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(svg.contains("cache size (MiB)"), "{svg}");
    assert!(!svg.contains("bytes or blocks"), "{svg}");
}

#[test]
fn default_configuration_is_valid_toml_with_every_serve_flag() {
    let result = bufcache(&["config", "--print-default"]);
    assert!(result.status.success(), "{}", text(&result));
    let uncommented: String = String::from_utf8_lossy(&result.stdout)
        .lines()
        .filter_map(|line| line.strip_prefix("# "))
        .filter(|line| {
            line.split_once(" = ")
                .is_some_and(|(key, _)| key.chars().all(|c| c.is_ascii_lowercase() || c == '-'))
        })
        .map(|line| format!("{line}\n"))
        .collect();
    let table: toml::Table = uncommented.parse().expect("the printed default is TOML");
    for key in [
        "cache-size",
        "cluster-size-max",
        "listen",
        "policy",
        "io-queue",
        "metrics",
    ] {
        assert!(
            table.contains_key(key),
            "{key} in the default configuration"
        );
    }
}

#[test]
fn docs_cli_md_is_current() {
    let result = bufcache(&["help-markdown"]);
    assert!(result.status.success());
    let generated = String::from_utf8(result.stdout).unwrap();
    let checked_in =
        std::fs::read_to_string(workspace_root().join("docs/cli.md")).unwrap_or_default();
    assert!(
        generated == checked_in,
        "docs/cli.md is out of date: run `cargo run --release -- help-markdown > docs/cli.md`"
    );
}

#[test]
fn bad_input_is_named() {
    let cases: [(&[&str], &str); 6] = [
        (&["dd", "bs=12q"], "bs="),
        (&["dd", "colour=blue"], "colour"),
        (&["serve", "--cache-size", "12q"], "--cache-size"),
        (&["serve", "--cluster-size-max", "2M"], "--cluster-size-max"),
        (
            &["serve", "--backend", "/nonexistent/dir/disk.img"],
            "/nonexistent/dir/disk.img",
        ),
        (
            &[
                "replay",
                "/nonexistent.csv",
                "--format",
                "csv",
                "--cache-size",
                "10",
            ],
            "/nonexistent.csv",
        ),
    ];
    for (arguments, expected) in cases {
        let result = bufcache(arguments);
        assert!(!result.status.success(), "{arguments:?} fails");
        assert!(
            text(&result).contains(expected),
            "{arguments:?}: the error names `{expected}`: {}",
            text(&result)
        );
    }
}

#[test]
fn replay_refuses_traces_it_cannot_use_and_says_why() {
    // Goal: a trace that yields nothing, or that cannot be parsed, never replays silently as
    // "miss ratio 0"; the error says why and names the line and field, and the exit status is
    // 2 (bad input). A CSV without op-col counts every request as a read and says so.
    // Method: run replay on small CSV files written here.
    let directory = tempfile::tempdir().unwrap();
    let write = |name: &str, content: &str| {
        let path = directory.path().join(name);
        std::fs::write(&path, content).unwrap();
        path.to_str().unwrap().to_string()
    };
    let replay = |trace: &str, options: &str, extra: &[&str]| {
        let mut arguments = vec![
            "replay",
            trace,
            "--format",
            "csv",
            "--trace-options",
            options,
            "--cache-size",
            "10",
            "--no-split",
            "--json",
        ];
        arguments.extend_from_slice(extra);
        bufcache(&arguments)
    };
    let without_op = write("no_op.csv", "1,5,4096\n2,6,4096\n3,5,4096\n");
    let result = replay(&without_op, "time-col=1,obj-id-col=2,obj-size-col=3", &[]);
    assert!(result.status.success(), "{}", text(&result));
    assert!(
        String::from_utf8_lossy(&result.stderr).contains("every request counts as a read"),
        "{}",
        text(&result)
    );
    let rows: serde_json::Value = serde_json::from_slice(&result.stdout).unwrap();
    assert_eq!(rows[0]["requests"], 3);
    assert_eq!(rows[0]["misses"], 2);

    let cases = [
        (
            write("flushes.csv", "1,5,0,flush\n2,6,0,trim\n"),
            "neither reads nor writes",
        ),
        (
            write("header_only.csv", "time,id,size,op\n\n"),
            "no request",
        ),
        (
            write("bad_size.csv", "time,id,size,op\n1,5,4096,r\n2,6,big,r\n"),
            ":3: field obj-size-col",
        ),
    ];
    for (trace, expected) in cases {
        let result = replay(
            &trace,
            "time-col=1,obj-id-col=2,obj-size-col=3,op-col=4,has-header=true",
            &[],
        );
        assert_eq!(result.status.code(), Some(2), "{trace}: {}", text(&result));
        assert!(
            text(&result).contains(expected),
            "{trace}: the error says `{expected}`: {}",
            text(&result)
        );
    }

    let plot = directory.path().join("curve.jpg");
    let result = replay(
        &without_op,
        "time-col=1,obj-id-col=2,obj-size-col=3",
        &["--plot", plot.to_str().unwrap()],
    );
    assert_eq!(result.status.code(), Some(2), "{}", text(&result));
    assert!(text(&result).contains("curve.jpg"), "{}", text(&result));
    assert!(!plot.exists(), "nothing written to a .jpg");
}

fn shipped_trace() -> Option<PathBuf> {
    let trace = Path::new("/work/shared/traces/cloudPhysicsIO.csv");
    let trace = if trace.exists() {
        trace.to_path_buf()
    } else {
        workspace_root().join("../shared/traces/cloudPhysicsIO.csv")
    };
    trace.exists().then_some(trace)
}

const SHIPPED_TRACE_OPTIONS: &str =
    "time-col=2,obj-id-col=5,obj-size-col=4,op-col=3,has-header=true,delimiter=,";

fn replay_json(trace: &Path, extra: &[&str]) -> serde_json::Value {
    let mut arguments = vec![
        "replay",
        trace.to_str().unwrap(),
        "--format",
        "csv",
        "--trace-options",
        SHIPPED_TRACE_OPTIONS,
        "--json",
    ];
    arguments.extend_from_slice(extra);
    let result = bufcache(&arguments);
    assert!(result.status.success(), "{}", text(&result));
    serde_json::from_slice(&result.stdout).unwrap()
}

#[test]
fn shards_curve_is_within_a_hundredth_of_exact_lru_on_the_shipped_trace() {
    // Goal: `--mrc shards` (one sampled pass) estimates LRU's miss ratio within 0.01 at every
    // size, on the real trace split into 4 KiB blocks (1.1 million block accesses).
    // Method: replay the same sizes exactly and with SHARDS at a 10% rate; compare.
    let Some(trace) = shipped_trace() else {
        eprintln!("skipped: the cloudPhysicsIO trace is not on this machine");
        return;
    };
    let sizes = "1MiB,4MiB,16MiB,64MiB,256MiB,1GiB";
    let exact = replay_json(&trace, &["--policy", "lru", "--cache-size", sizes]);
    let shards = replay_json(
        &trace,
        &[
            "--mrc",
            "shards",
            "--sampling-rate",
            "0.1",
            "--cache-size",
            sizes,
        ],
    );
    for (exact, estimate) in exact
        .as_array()
        .unwrap()
        .iter()
        .zip(shards.as_array().unwrap())
    {
        let exact_ratio = exact["miss_ratio"].as_f64().unwrap();
        let estimated = estimate["miss_ratio"].as_f64().unwrap();
        assert!(
            (exact_ratio - estimated).abs() <= 0.01,
            "{}: exact {exact_ratio} shards {estimated}",
            exact["cache_size"]
        );
        assert!(
            estimate["byte_miss_ratio"].is_null(),
            "not measured by SHARDS"
        );
    }
    let result = bufcache(&[
        "replay",
        trace.to_str().unwrap(),
        "--format",
        "csv",
        "--mrc",
        "shards",
        "--policy",
        "s3fifo",
        "--cache-size",
        "1MiB",
    ]);
    assert_eq!(result.status.code(), Some(2), "{}", text(&result));
    assert!(text(&result).contains("--policy lru"), "{}", text(&result));
}

#[test]
fn opt_misses_no_more_than_any_policy_on_the_shipped_trace() {
    // Goal: `--policy opt` (Belady) is the lower bound it claims to be on a real trace.
    // Method: replay every policy and opt at three sizes; opt's misses are the fewest.
    let Some(trace) = shipped_trace() else {
        eprintln!("skipped: the cloudPhysicsIO trace is not on this machine");
        return;
    };
    let rows = replay_json(
        &trace,
        &[
            "--policy",
            "lru,fifo,clock,2q,arc,s3fifo,sieve,opt",
            "--cache-size",
            "1000,4897,20000",
            "--no-split",
        ],
    );
    let rows = rows.as_array().unwrap();
    for size in ["1000", "4897", "20000"] {
        let at_size: Vec<_> = rows
            .iter()
            .filter(|row| row["cache_size"] == size)
            .collect();
        let opt = at_size.iter().find(|row| row["policy"] == "opt").unwrap()["misses"]
            .as_u64()
            .unwrap();
        for row in &at_size {
            assert!(
                opt <= row["misses"].as_u64().unwrap(),
                "size {size}: opt {opt} vs {row}"
            );
        }
    }
}

#[test]
fn sim_run_refuses_io_queue_flags_it_cannot_apply_and_bad_input_with_exit_2() {
    // Goal: `sim run` never silently ignores a flag it cannot apply, and bad input names the
    // offending key. Method: pass each io queue flag that cannot apply (merging or a depth
    // without a queue, a depth out of range), an unknown workload key, an impossible disk
    // parameter and a non-numeric seed; each must fail with status 2 and a message naming what
    // was wrong. The queues it models (fifo and elevator, merging or not, any depth) must run
    // and report themselves.
    let base = [
        "sim",
        "run",
        "--disk",
        "nvme",
        "--workload",
        "dd:read,bs=4k,count=8",
    ];
    for (extra, named) in [
        (
            &["--io-queue", "elevator", "--io-queue-depth", "0"][..],
            "--io-queue-depth",
        ),
        (&["--no-io-merge"][..], "--no-io-merge"),
        (
            &["--io-queue", "none", "--no-io-merge"][..],
            "--no-io-merge",
        ),
        (&["--io-queue-depth", "4"][..], "--io-queue-depth"),
    ] {
        let mut arguments = base.to_vec();
        arguments.extend_from_slice(extra);
        let result = bufcache(&arguments);
        assert_eq!(
            result.status.code(),
            Some(2),
            "{extra:?}: {}",
            text(&result)
        );
        assert!(
            text(&result).contains(named),
            "{extra:?}: {}",
            text(&result)
        );
    }
    for (arguments, named) in [
        (
            &[
                "sim",
                "run",
                "--disk",
                "nvme",
                "--workload",
                "dd:read,colour=red",
            ][..],
            "colour",
        ),
        (
            &[
                "sim",
                "run",
                "--disk",
                "nvme:channels=zero",
                "--workload",
                "dd:read",
            ][..],
            "channels",
        ),
        (
            &["sim", "experiment", "scan", "--seed", "abc"][..],
            "--seed",
        ),
        (
            &[
                "sim",
                "run",
                "--disk",
                "rz25",
                "--workload",
                "dd:read",
                "--newfs",
                "a=600",
            ][..],
            "a = `600`",
        ),
        (
            &[
                "sim",
                "run",
                "--disk",
                "rz25",
                "--workload",
                "dd:read",
                "--update-period",
                "0",
            ][..],
            "--update-period",
        ),
    ] {
        let result = bufcache(arguments);
        assert_eq!(
            result.status.code(),
            Some(2),
            "{arguments:?}: {}",
            text(&result)
        );
        assert!(
            text(&result).contains(named),
            "{arguments:?}: {}",
            text(&result)
        );
    }
    let result = bufcache(&base);
    assert!(result.status.success(), "{}", text(&result));
    // The FFS model and the update daemon run from the command line too: a tree copy then
    // writes more than its files' data (inodes and directory entries).
    let result = bufcache(&[
        "sim",
        "run",
        "--disk",
        "rz25",
        "--workload",
        "treecopy:files=20,remote=on",
        "--newfs",
        "a=16,d=0,n=1",
        "--update-period",
        "30",
    ]);
    assert!(result.status.success(), "{}", text(&result));
    assert!(
        String::from_utf8_lossy(&result.stdout).contains("device: "),
        "{}",
        text(&result)
    );
    for extra in [
        &["--io-queue", "fifo"][..],
        &["--io-queue", "fifo", "--no-io-merge"][..],
        &["--io-queue", "elevator"][..],
        &["--io-queue", "elevator", "--io-queue-depth", "4"][..],
    ] {
        let mut arguments = base.to_vec();
        arguments.extend_from_slice(extra);
        let result = bufcache(&arguments);
        assert!(result.status.success(), "{extra:?}: {}", text(&result));
        assert!(
            String::from_utf8_lossy(&result.stdout).contains("io queue: "),
            "{extra:?}: {}",
            text(&result)
        );
    }
}

#[test]
fn sim_check_prints_its_summary_and_names_bad_flags() {
    // Goal: `sim check` runs seeds through the engine and says so in its one-line summary,
    // and a bad seed count, seed or server count is refused naming what was wrong. Method:
    // run three seeds, then a non-numeric seed, a zero seed count, four servers and servers
    // without the log layout; each bad one must exit 2.
    let result = bufcache(&["sim", "check", "--seeds", "3", "--seed", "11"]);
    assert!(result.status.success(), "{}", text(&result));
    assert!(
        String::from_utf8_lossy(&result.stdout).contains("3 seeds, 0 violations"),
        "{}",
        text(&result)
    );
    for (arguments, named) in [
        (&["sim", "check", "--seed", "abc"][..], "--seed"),
        (&["sim", "check", "--seeds", "0"][..], "--seeds"),
        (
            &["sim", "check", "--layout", "log", "--servers", "4"][..],
            "give 1, 2, 3 or 2-3",
        ),
        (
            &["sim", "check", "--servers", "2"][..],
            "--servers applies to --layout log only",
        ),
    ] {
        let result = bufcache(arguments);
        assert_eq!(result.status.code(), Some(2), "{}", text(&result));
        assert!(text(&result).contains(named), "{}", text(&result));
    }
}

#[test]
fn replay_policy_parameters_reach_the_policies_and_bad_values_name_their_flag() {
    // Goal: `replay`'s policy-parameter flags mean libCacheSim's parameters, and a value out of
    // range is refused (exit 2) with its flag named, before the trace is read. Method: replay
    // the shipped trace with non-default 2Q, CLOCK and S3-FIFO parameters and compare the miss
    // counts with libCacheSim 0.3.5's for the same parameters (`TwoQ(4897, a_in_size_ratio=0.1,
    // a_out_size_ratio=1.0)`: 84,810; `Clock(4897, n_bit_counter=3)`: 91,518;
    // `S3FIFO(4897, small_size_ratio=0.2, ghost_size_ratio=0.5, move_to_main_threshold=1)`:
    // 88,485); then give out-of-range values on a trace that does not exist.
    if let Some(trace) = shipped_trace() {
        let rows = replay_json(
            &trace,
            &[
                "--policy",
                "2q,clock,s3fifo",
                "--cache-size",
                "4897",
                "--no-split",
                "--2q-ain-size-ratio",
                "0.1",
                "--2q-aout-size-ratio",
                "1.0",
                "--clock-bits",
                "3",
                "--s3fifo-small-queue-ratio",
                "0.2",
                "--s3fifo-ghost-size-ratio",
                "0.5",
                "--s3fifo-move-to-main-threshold",
                "1",
            ],
        );
        let misses: Vec<u64> = rows
            .as_array()
            .unwrap()
            .iter()
            .map(|row| row["misses"].as_u64().unwrap())
            .collect();
        assert_eq!(misses, [84_810, 91_518, 88_485]);
    } else {
        eprintln!("skipped the libCacheSim comparison: the cloudPhysicsIO trace is not here");
    }
    for (flag, value) in [
        ("--s3fifo-small-queue-ratio", "1"),
        ("--s3fifo-ghost-size-ratio", "-0.5"),
        ("--s3fifo-move-to-main-threshold", "4"),
        ("--2q-ain-size-ratio", "0"),
        ("--2q-aout-size-ratio", "11"),
        ("--clock-bits", "9"),
        ("--clock-bits", "many"),
    ] {
        let result = bufcache(&[
            "replay",
            "/nonexistent/trace.csv",
            "--format",
            "csv",
            "--cache-size",
            "100",
            flag,
            value,
        ]);
        assert_eq!(
            result.status.code(),
            Some(2),
            "{flag} {value}: {}",
            text(&result)
        );
        assert!(
            text(&result).contains(flag),
            "{flag} {value}: {}",
            text(&result)
        );
        assert!(
            !text(&result).contains("/nonexistent"),
            "{flag} {value}: checked before the trace is opened: {}",
            text(&result)
        );
    }
}
