//! Measures how fast a trace reads: `cargo run --release --example trace_speed -- PATH FORMAT [OPTIONS]`.
//!
//! Reads the whole trace `REPEATS` times (the first pass warms the page cache) and
//! prints the best pass in requests per second.

use std::time::Instant;

use bufcache_trace::{open_trace, TraceFormat, TraceOptions};

const REPEATS: usize = 5;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let arguments: Vec<String> = std::env::args().skip(1).collect();
    let [path, format, rest @ ..] = arguments.as_slice() else {
        return Err("usage: trace_speed PATH FORMAT [OPTIONS]".into());
    };
    let format: TraceFormat = format.parse()?;
    let options = TraceOptions::parse(rest.first().map_or("", String::as_str))?;
    let mut best_seconds = f64::INFINITY;
    let mut count = 0usize;
    for _ in 0..REPEATS {
        let started = Instant::now();
        count = 0;
        for request in open_trace(path, format, &options)? {
            std::hint::black_box(request?);
            count += 1;
        }
        best_seconds = best_seconds.min(started.elapsed().as_secs_f64());
    }
    println!(
        "{path} ({format}): {count} requests in {:.2} ms = {:.1} M requests/s",
        best_seconds * 1e3,
        count as f64 / best_seconds / 1e6
    );
    Ok(())
}
