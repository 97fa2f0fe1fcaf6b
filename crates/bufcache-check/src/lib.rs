//! The harness bufcache's seeded property checkers share: `bufcache sim check` (the engine,
//! `bufcache-sim`'s `check`), its `--local-tier` checker (`check_tier`) and its
//! `--layout log` checkers (`bufcache-s3`'s `sim_check` and `sim_servers`).
//!
//! A checker draws everything of one run from a seed and drives its system step by step
//! against a shadow model of what it promised. What they share lives here:
//! - [`Notes`]: every step noted as it is taken (printed when tracing), the last few kept for
//!   a report;
//! - [`Violation`]: a broken promise, typed: which property, at which step, the seed, the
//!   scenario and the steps before it;
//! - [`check_seeds`] and [`Sweep`]: the loop over a range of seeds, a checker's totals, every
//!   violation, and the command line that replays one seed.
//!
//! - with the `proptest` feature, [`seeded_proptest`]: a property test run from a seed that
//!   a failure names, replayable from an environment variable (the URL and URI round trips).
//!
//! The crate depends on nothing (without the `proptest` feature, which only tests enable), so
//! the object store's checker (which must not depend on the engine) and the engine's share
//! it.

#![deny(missing_docs)]

#[cfg(feature = "proptest")]
pub mod seeded_proptest;

use std::collections::VecDeque;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

/// Steps a checker keeps for a violation's report, unless it says otherwise.
pub const RECENT_STEPS: usize = 12;

/// The steps of one seed's run: each printed to standard error as it is noted when the run
/// is traced, the last `recent_max` kept for a violation's report.
#[derive(Clone, Debug)]
pub struct Notes {
    recent: VecDeque<String>,
    recent_max: usize,
    trace: bool,
}

impl Notes {
    /// Notes keeping the last `recent_max` steps; `trace` prints every one.
    pub fn new(recent_max: usize, trace: bool) -> Notes {
        assert!(recent_max > 0, "a report keeps at least one step");
        Notes {
            recent: VecDeque::with_capacity(recent_max),
            recent_max,
            trace,
        }
    }

    /// Whether every step is printed.
    pub fn tracing(&self) -> bool {
        self.trace
    }

    /// Notes a step: `at` says where the run is (`step 12`, `seed 4 tick 9`), printed before
    /// the text when tracing; the text alone is kept.
    pub fn note(&mut self, at: impl fmt::Display, text: String) {
        if self.trace {
            eprintln!("{at}: {text}");
        }
        if self.recent.len() == self.recent_max {
            self.recent.pop_front();
        }
        self.recent.push_back(text);
        debug_assert!(self.recent.len() <= self.recent_max);
    }

    /// Prints a line when tracing, without keeping it (detail below a step: a store's log).
    pub fn trace(&self, at: impl fmt::Display, text: impl fmt::Display) {
        if self.trace {
            eprintln!("{at}: {text}");
        }
    }

    /// The kept steps, oldest first.
    pub fn recent(&self) -> Vec<String> {
        self.recent.iter().cloned().collect()
    }
}

/// Where in its run a checker found a violation: the step counter it keeps, and what it
/// calls a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    /// `step` for a workload step, `tick` for a tick of virtual time.
    pub unit: &'static str,
    /// The step's number, from 1 (0: before the first step, or not known).
    pub number: u64,
}

impl Step {
    /// Workload step `number`.
    pub fn workload(number: u64) -> Step {
        Step {
            unit: "step",
            number,
        }
    }

    /// Tick `number` of virtual time.
    pub fn tick(number: u64) -> Step {
        Step {
            unit: "tick",
            number,
        }
    }
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.unit, self.number)
    }
}

/// A broken promise found by a seed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// The property broken, in a few fixed words (`durability`, `remote prefix`, `no panic`);
    /// each checker documents its own.
    pub property: &'static str,
    /// What was found, where: `lost write after a crash: sector 12 holds version 3, …`.
    pub detail: String,
    /// The step that found it.
    pub step: Step,
    /// The seed: `--seeds 1 --seed SEED` replays it.
    pub seed: u64,
    /// The shape the seed drew (empty when the checker describes none).
    pub scenario: String,
    /// The steps before it, oldest first.
    pub recent: Vec<String>,
}

impl Violation {
    /// A violation of `property` found at `step` of `seed`, with the steps `notes` kept.
    pub fn new(
        property: &'static str,
        detail: String,
        step: Step,
        seed: u64,
        notes: &Notes,
    ) -> Violation {
        Violation {
            property,
            detail,
            step,
            seed,
            scenario: String::new(),
            recent: notes.recent(),
        }
    }

    /// The same, with the seed's scenario described.
    pub fn in_scenario(mut self, scenario: String) -> Violation {
        self.scenario = scenario;
        self
    }

    /// The same, with `what` (the checked thing's name: `clone`) before the detail.
    pub fn of(mut self, what: &str) -> Violation {
        self.detail = format!("{what}: {}", self.detail);
        self
    }

    /// The command line that replays this seed, every step printed: `command` is the check's
    /// own (`bufcache sim check --local-tier`).
    pub fn replay(&self, command: &str) -> String {
        format!("{command} --seeds 1 --seed {} --trace", self.seed)
    }
}

/// `step 37: lost write after a crash: …`, then the property, the scenario and the last
/// steps on lines of their own.
impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.step, self.detail)?;
        write!(f, "\n  property: {}", self.property)?;
        if !self.scenario.is_empty() {
            write!(f, "\n  scenario: {}", self.scenario)?;
        }
        if !self.recent.is_empty() {
            write!(f, "\n  last steps: {}", self.recent.join("; "))?;
        }
        Ok(())
    }
}

/// The property a panic of the checked code (or of the checker) breaks.
pub const NO_PANIC: &str = "no panic";

/// Runs one seed's check, catching a panic of the checked code (a broken invariant
/// assertion): a panic is a violation of [`NO_PANIC`], its text kept, at `step` as the
/// checker last knew it. `what` names what was checked (`the engine`).
pub fn catching_panics(
    seed: u64,
    what: &str,
    run: impl FnOnce() -> Result<(), Violation>,
) -> Option<Violation> {
    match catch_unwind(AssertUnwindSafe(run)) {
        Ok(Ok(())) => None,
        Ok(Err(violation)) => Some(violation),
        Err(panic) => {
            let text = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "a panic without a message".to_string());
            Some(Violation {
                property: NO_PANIC,
                detail: format!("{what} panicked: {text}"),
                step: Step::workload(0),
                seed,
                scenario: String::new(),
                recent: Vec::new(),
            })
        }
    }
}

/// What one seed's check reports: its counts, and the first broken promise if any.
pub trait SeedOutcome {
    /// The first broken promise, if any.
    fn violation(&self) -> Option<&Violation>;
}

/// A checker's totals over a sweep of seeds.
pub trait Totals<O>: Default {
    /// Counts one seed's outcome in.
    fn add(&mut self, outcome: &O);
}

/// The result of a sweep of seeds.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Sweep<T> {
    /// Seeds run.
    pub seeds: u64,
    /// The checker's totals over them.
    pub totals: T,
    /// Every violation, in seed order.
    pub violations: Vec<Violation>,
    /// Wall-clock time of the sweep.
    pub elapsed: Duration,
}

impl<T> Sweep<T> {
    /// Seeds checked per second of wall-clock time.
    pub fn seeds_per_second(&self) -> f64 {
        self.seeds as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// The one-line summary: `N seeds, V violations`.
    pub fn line(&self) -> String {
        format!("{} seeds, {} violations", self.seeds, self.violations.len())
    }

    /// None when every seed kept its promises; else what broke, with the command that
    /// replays the first violating seed (`command` is the check's own).
    pub fn failure(&self, what: &str, command: &str) -> Option<String> {
        let first = self.violations.first()?;
        Some(format!(
            "{} of {} seeds broke {what} (replay the first with `{}`)",
            self.violations.len(),
            self.seeds,
            first.replay(command)
        ))
    }
}

/// Runs `check` on seeds `first .. first + count` in order, calling `on_seed` after each,
/// and adds each outcome to the totals.
pub fn check_seeds<O: SeedOutcome, T: Totals<O>>(
    first: u64,
    count: u64,
    mut check: impl FnMut(u64) -> O,
    mut on_seed: impl FnMut(u64, &O),
) -> Sweep<T> {
    let started = Instant::now();
    let mut sweep = Sweep {
        seeds: 0,
        totals: T::default(),
        violations: Vec::new(),
        elapsed: Duration::ZERO,
    };
    for seed in first..first.saturating_add(count) {
        let outcome = check(seed);
        sweep.seeds += 1;
        sweep.totals.add(&outcome);
        if let Some(violation) = outcome.violation() {
            debug_assert_eq!(violation.seed, seed, "a violation names its own seed");
            sweep.violations.push(violation.clone());
        }
        on_seed(seed, &outcome);
    }
    sweep.elapsed = started.elapsed();
    sweep
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Outcome {
        steps: u64,
        violation: Option<Violation>,
    }

    impl SeedOutcome for Outcome {
        fn violation(&self) -> Option<&Violation> {
            self.violation.as_ref()
        }
    }

    impl Totals<Outcome> for u64 {
        fn add(&mut self, outcome: &Outcome) {
            *self += outcome.steps;
        }
    }

    #[test]
    fn notes_keep_the_last_steps_and_violations_carry_them() {
        // Goal: a violation's report shows the steps just before it, no more. Method: note
        // more steps than kept; the violation made then carries the last ones, oldest first,
        // and prints its step, property and steps.
        let mut notes = Notes::new(3, false);
        for step in 1..=5 {
            notes.note(Step::workload(step), format!("write {step}"));
        }
        let violation = Violation::new(
            "durability",
            "lost".to_string(),
            Step::workload(5),
            9,
            &notes,
        );
        assert_eq!(violation.recent, ["write 3", "write 4", "write 5"]);
        let text = violation.to_string();
        assert!(
            text.starts_with("step 5: lost\n  property: durability"),
            "{text}"
        );
        assert!(
            text.ends_with("last steps: write 3; write 4; write 5"),
            "{text}"
        );
        assert_eq!(
            violation.replay("bufcache sim check"),
            "bufcache sim check --seeds 1 --seed 9 --trace"
        );
    }

    #[test]
    fn a_sweep_counts_every_seed_and_names_the_violating_ones() {
        // Goal: the seeds loop runs each seed once, in order, totals their counts and keeps
        // the violations with their seeds; a panic is a violation too. Method: a checker
        // that fails on even seeds (one of them by panicking) over seeds 3..=7.
        let mut seen = Vec::new();
        let sweep: Sweep<u64> = check_seeds(
            3,
            5,
            |seed| Outcome {
                steps: seed,
                violation: catching_panics(seed, "the checked code", || {
                    if seed == 4 {
                        panic!("invariant broken");
                    }
                    if seed % 2 == 0 {
                        let notes = Notes::new(1, false);
                        return Err(Violation::new("p", "d".into(), Step::tick(1), seed, &notes));
                    }
                    Ok(())
                }),
            },
            |seed, _| seen.push(seed),
        );
        assert_eq!(seen, [3, 4, 5, 6, 7]);
        assert_eq!(sweep.seeds, 5);
        assert_eq!(sweep.totals, 3 + 4 + 5 + 6 + 7);
        let seeds: Vec<u64> = sweep.violations.iter().map(|v| v.seed).collect();
        assert_eq!(seeds, [4, 6]);
        assert_eq!(sweep.violations[0].property, NO_PANIC);
        assert!(sweep.violations[0].detail.contains("invariant broken"));
        assert_eq!(sweep.line(), "5 seeds, 2 violations");
        let failure = sweep.failure("the contract", "check").expect("violations");
        assert_eq!(
            failure,
            "2 of 5 seeds broke the contract (replay the first with `check --seeds 1 --seed 4 --trace`)"
        );
        let clean: Sweep<u64> = check_seeds(1, 1, |_| Outcome::default(), |_, _| {});
        assert_eq!(clean.failure("the contract", "check"), None);
    }
}
