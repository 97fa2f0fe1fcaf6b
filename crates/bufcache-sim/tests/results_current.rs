//! Goal: the published experiment outputs (`results/NAME.csv` and `NAME.comparison.csv`, which
//! docs/experiments.md quotes) are what the current code produces, so no stale number stays
//! published.
//! Method: run every experiment at the published scale and seed and compare its CSV and
//! comparison CSV with the files, byte for byte; on a difference, regenerate them with
//! `scripts/sim-results` and update docs/experiments.md.

use std::path::Path;

use bufcache_sim::{run_experiment, ExperimentOptions, EXPERIMENTS};

#[test]
fn published_results_are_current() {
    let results = Path::new(env!("CARGO_MANIFEST_DIR")).join("results");
    let mut stale = Vec::new();
    for (name, _) in EXPERIMENTS {
        let result = run_experiment(name, &ExperimentOptions::default()).unwrap();
        for (file, fresh) in [
            (format!("{name}.csv"), result.to_csv()),
            (format!("{name}.comparison.csv"), result.comparison_csv()),
        ] {
            let published = std::fs::read_to_string(results.join(&file)).unwrap_or_default();
            if published != fresh {
                stale.push(file);
            }
        }
    }
    assert!(
        stale.is_empty(),
        "stale in crates/bufcache-sim/results: {stale:?}; run scripts/sim-results and update \
         docs/experiments.md"
    );
}
