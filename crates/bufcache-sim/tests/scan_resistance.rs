//! Goal: no-reuse placement keeps a working set cached through a large sequential scan,
//! where plain LRU loses it (seed 003's vm_page_dontneed argument).
//! Method: run the `scan` experiment at 1/8 scale and compare the working set's hit ratio
//! under LRU without and with no-reuse placement.

use bufcache_sim::{run_experiment, ExperimentOptions};

#[test]
fn noreuse_keeps_the_working_set_through_a_scan() {
    let result = run_experiment(
        "scan",
        &ExperimentOptions {
            scale: 0.125,
            seed: 3,
        },
    )
    .unwrap();
    let text = result.to_text();
    let plain = result.value(0, "ws_hit_ratio").unwrap();
    let noreuse = result.value(1, "ws_hit_ratio").unwrap();
    assert!(plain < 0.3, "{text}");
    assert!(noreuse > plain + 0.4, "{text}");
    let latency_plain = result.value(0, "ws_latency_ms").unwrap();
    let latency_noreuse = result.value(1, "ws_latency_ms").unwrap();
    assert!(latency_noreuse < latency_plain, "{text}");
}
