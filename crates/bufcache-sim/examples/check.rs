//! Runs `sim check` seeds and prints each violation and the summary: `cargo run --example
//! check -p bufcache-sim -- SEEDS [FIRST_SEED]`.

fn main() {
    let mut args = std::env::args().skip(1);
    let seeds: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(100);
    let first: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(1);
    if std::env::var_os("TRACE").is_some() {
        let outcome = bufcache_sim::check::check_seed_traced(first, true);
        println!("{outcome:?}");
        return;
    }
    let summary = bufcache_sim::check_seeds(first, seeds, |_, _| {});
    for violation in &summary.violations {
        println!("seed {}: {violation}", violation.seed);
    }
    println!(
        "{} ({} steps, {} crashes, {} device faults, {:.1} seeds/s)",
        summary.line(),
        summary.totals.steps,
        summary.totals.crashes,
        summary.totals.device_faults,
        summary.seeds_per_second()
    );
}
