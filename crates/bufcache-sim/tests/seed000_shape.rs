//! Goal: seed 000's result reproduces in shape: with clusters bounded by a 16K MAXBSIZE,
//! dd write on an RZ25 is markedly slower than with 64K, reads are about the same speed,
//! and 16K uses about four times as many requests and more system time.
//! Method: run the `maxbsize` experiment at a quarter of the seed's size and check the
//! direction and rough factors, not exact numbers.

use bufcache_sim::{run_experiment, ExperimentOptions};

#[test]
fn small_clusters_halve_write_speed_on_rz25() {
    let result = run_experiment(
        "maxbsize",
        &ExperimentOptions {
            scale: 0.25,
            seed: 1,
        },
    )
    .unwrap();
    let text = result.to_text();
    let (w16, w64) = (
        result.value(0, "MB/s").unwrap(),
        result.value(1, "MB/s").unwrap(),
    );
    let (r16, r64) = (
        result.value(2, "MB/s").unwrap(),
        result.value(3, "MB/s").unwrap(),
    );
    let ratio = w64 / w16;
    assert!(ratio > 1.5 && ratio < 3.0, "write ratio {ratio}\n{text}");
    assert!((r64 / r16 - 1.0).abs() < 0.2, "reads about equal\n{text}");
    let (q16, q64) = (
        result.value(0, "requests").unwrap(),
        result.value(1, "requests").unwrap(),
    );
    assert!(q16 > 3.0 * q64, "{text}");
    let (s16, s64) = (
        result.value(0, "sys_s").unwrap(),
        result.value(1, "sys_s").unwrap(),
    );
    assert!(s16 > s64, "{text}");
    // Absolute speed within half again of the seed's (0.86 and 1.73 MB/s): the RZ25's
    // reported geometry (2.86 MB/s media rate) makes ours faster; the shape is the target.
    assert!(w16 > 0.43 && w16 < 1.3 && w64 > 0.87 && w64 < 2.6, "{text}");
    assert!(result.to_svg().starts_with("<svg"));
    assert!(result.to_csv().lines().count() == 5);
}
