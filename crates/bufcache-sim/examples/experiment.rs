//! Runs one experiment and prints its table: `cargo run --release --example experiment -- NAME [SCALE] [OUTDIR]`.
//! With OUTDIR, also writes NAME.txt, NAME.csv, NAME.json and NAME.svg there.

fn main() {
    let mut args = std::env::args().skip(1);
    let name = args.next().unwrap_or_else(|| "maxbsize".into());
    let scale: f64 = args
        .next()
        .map_or(1.0, |s| s.parse().expect("scale is a number"));
    let options = bufcache_sim::ExperimentOptions { scale, seed: 1 };
    let started = std::time::Instant::now();
    match bufcache_sim::run_experiment(&name, &options) {
        Ok(result) => {
            print!("{}", result.to_text());
            eprintln!("(ran in {:.2} s)", started.elapsed().as_secs_f64());
            if let Some(dir) = args.next() {
                let dir = std::path::Path::new(&dir);
                std::fs::create_dir_all(dir).expect("output directory");
                std::fs::write(dir.join(format!("{name}.txt")), result.to_text()).unwrap();
                std::fs::write(dir.join(format!("{name}.csv")), result.to_csv()).unwrap();
                std::fs::write(dir.join(format!("{name}.json")), result.to_json()).unwrap();
                std::fs::write(dir.join(format!("{name}.svg")), result.to_svg()).unwrap();
            }
        }
        Err(error) => {
            eprintln!("error: {error}");
            std::process::exit(1);
        }
    }
}
