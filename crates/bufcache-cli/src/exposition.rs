//! The `/metrics` document: samples gathered per metric family, then written in the
//! Prometheus text format (version 0.0.4) by `prometheus-client`'s encoder.
//!
//! The server's figures are snapshots read at scrape time (engine statistics, device and store
//! counters), not instruments the code updates, so they are gathered into an [`Exposition`]
//! and handed to the encoder as one [`Collector`]. Gathering per family is what keeps each
//! family's samples together under one `# HELP` and `# TYPE` whatever order the exports add
//! them in (a family that two exports feed is one family with two label sets).

use std::collections::HashMap;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

/// A sample's labels, in the order they are written.
pub type Labels = Vec<(String, String)>;

/// `labels` with `key="value"` appended.
pub fn with_label(labels: &Labels, key: &str, value: &str) -> Labels {
    let mut more = labels.clone();
    more.push((key.to_string(), value.to_string()));
    more
}

/// One label, as a label set of its own.
pub fn label(key: &str, value: &str) -> Labels {
    vec![(key.to_string(), value.to_string())]
}

/// A gauge's value: whole numbers are written without a fraction.
#[derive(Debug, Clone, Copy)]
pub enum Level {
    Whole(u64),
    Real(f64),
}

impl From<u64> for Level {
    fn from(value: u64) -> Self {
        Level::Whole(value)
    }
}

impl From<f64> for Level {
    fn from(value: f64) -> Self {
        Level::Real(value)
    }
}

/// The metric families of one scrape, in the order each was first added.
#[derive(Debug, Default)]
pub struct Exposition {
    families: Vec<Family>,
    /// Family name (as written, `_total` included) to its place in `families`.
    positions: HashMap<String, usize>,
}

#[derive(Debug)]
struct Family {
    /// The name as the encoder takes it: a counter's without its `_total`, which the
    /// encoder appends.
    stem: String,
    help: String,
    kind: MetricType,
    samples: Vec<(Labels, Value)>,
}

#[derive(Debug)]
enum Value {
    Counter(u64),
    Gauge(Level),
    /// Each bucket's upper bound and its own (not cumulative) count, the sum and the count.
    Histogram {
        buckets: Vec<(f64, u64)>,
        sum: f64,
        count: u64,
    },
}

impl Exposition {
    /// Adds a counter sample; `name` ends in `_total`.
    pub fn counter(&mut self, name: &str, labels: Labels, value: u64, help: &str) {
        let stem = name
            .strip_suffix("_total")
            .unwrap_or_else(|| panic!("counter {name} does not end in _total"));
        self.add(
            name,
            stem,
            help,
            MetricType::Counter,
            labels,
            Value::Counter(value),
        );
    }

    /// Adds a gauge sample.
    pub fn gauge(&mut self, name: &str, labels: Labels, value: impl Into<Level>, help: &str) {
        let value = Value::Gauge(value.into());
        self.add(name, name, help, MetricType::Gauge, labels, value);
    }

    /// Adds a histogram sample: `buckets` holds each bucket's upper bound (`f64::INFINITY`
    /// for the last) and its own count; `count` is the number of observations.
    pub fn histogram(
        &mut self,
        name: &str,
        labels: Labels,
        buckets: Vec<(f64, u64)>,
        sum: f64,
        count: u64,
        help: &str,
    ) {
        let value = Value::Histogram {
            buckets,
            sum,
            count,
        };
        self.add(name, name, help, MetricType::Histogram, labels, value);
    }

    fn add(
        &mut self,
        name: &str,
        stem: &str,
        help: &str,
        kind: MetricType,
        labels: Labels,
        value: Value,
    ) {
        let position = *self.positions.entry(name.to_string()).or_insert_with(|| {
            self.families.push(Family {
                stem: stem.to_string(),
                help: help.to_string(),
                kind,
                samples: Vec::new(),
            });
            self.families.len() - 1
        });
        let family = &mut self.families[position];
        // Either would make a scrape Prometheus rejects: a bug of the caller, caught in tests;
        // a release build drops the sample rather than fail the scrape.
        let kind_differs = family.kind.as_str() != kind.as_str();
        let repeated = family.samples.iter().any(|(known, _)| *known == labels);
        debug_assert!(
            !kind_differs,
            "metric {name} added as a {} and as a {}",
            family.kind.as_str(),
            kind.as_str()
        );
        debug_assert!(
            !repeated,
            "metric {name} added twice with labels {labels:?}"
        );
        if !kind_differs && !repeated {
            family.samples.push((labels, value));
        }
    }

    /// The Prometheus text of every family.
    pub fn render(self) -> String {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(self));
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, &registry)
            .expect("writing to a String does not fail");
        text
    }
}

impl Collector for Exposition {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for family in &self.families {
            let mut metric =
                encoder.encode_descriptor(&family.stem, &family.help, None, family.kind)?;
            for (labels, value) in &family.samples {
                let sample = metric.encode_family(labels)?;
                Sample(value).encode(sample)?;
            }
        }
        Ok(())
    }
}

/// One sample's value, encoded under the labels its family encoder was given.
struct Sample<'a>(&'a Value);

impl EncodeMetric for Sample<'_> {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::MetricEncoder,
    ) -> Result<(), std::fmt::Error> {
        match self.0 {
            Value::Counter(value) => encoder.encode_counter::<NoLabelSet, _, u64>(value, None),
            Value::Gauge(Level::Whole(value)) => encoder.encode_gauge(value),
            Value::Gauge(Level::Real(value)) => encoder.encode_gauge(value),
            Value::Histogram {
                buckets,
                sum,
                count,
            } => encoder.encode_histogram::<NoLabelSet>(*sum, *count, buckets, None),
        }
    }

    fn metric_type(&self) -> MetricType {
        match self.0 {
            Value::Counter(_) => MetricType::Counter,
            Value::Gauge(_) => MetricType::Gauge,
            Value::Histogram { .. } => MetricType::Histogram,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_family_fed_by_two_exports_is_written_once_with_its_samples_together() {
        // Goal: the text format's rule that a family's samples follow its one `# HELP` and
        // `# TYPE`, whatever order the samples were added in. Method: two exports each add a
        // counter and a histogram, interleaved; the text is checked line by line.
        let mut exposition = Exposition::default();
        for export in ["a", "b"] {
            let labels = label("export", export);
            exposition.counter("demo_requests_total", labels.clone(), 3, "Requests.");
            exposition.histogram(
                "demo_duration_seconds",
                labels.clone(),
                vec![(0.5, 2), (f64::INFINITY, 1)],
                1.25,
                3,
                "Durations.",
            );
            exposition.gauge("demo_open", labels, 1u64, "Open.");
        }
        let text = exposition.render();
        let lines: Vec<&str> = text.lines().collect();
        let expected = [
            "# HELP demo_requests_total Requests.",
            "# TYPE demo_requests_total counter",
            "demo_requests_total{export=\"a\"} 3",
            "demo_requests_total{export=\"b\"} 3",
            "# HELP demo_duration_seconds Durations.",
            "# TYPE demo_duration_seconds histogram",
            "demo_duration_seconds_bucket{export=\"a\",le=\"0.5\"} 2",
            "demo_duration_seconds_bucket{export=\"a\",le=\"+Inf\"} 3",
            "demo_duration_seconds_sum{export=\"a\"} 1.25",
            "demo_duration_seconds_count{export=\"a\"} 3",
            "demo_duration_seconds_bucket{export=\"b\",le=\"0.5\"} 2",
            "demo_duration_seconds_bucket{export=\"b\",le=\"+Inf\"} 3",
            "demo_duration_seconds_sum{export=\"b\"} 1.25",
            "demo_duration_seconds_count{export=\"b\"} 3",
            "# HELP demo_open Open.",
            "# TYPE demo_open gauge",
            "demo_open{export=\"a\"} 1",
            "demo_open{export=\"b\"} 1",
        ];
        assert_eq!(lines, expected, "{text}");
    }

    #[test]
    fn label_values_are_escaped() {
        // Goal: an export name with a quote, a backslash or a newline cannot break the text.
        // Method: one gauge labelled with all three; the written label is the escaped form.
        let mut exposition = Exposition::default();
        exposition.gauge("demo", label("export", "a\"b\\c\nd"), 1.0, "Demo.");
        let text = exposition.render();
        assert!(
            text.contains("demo{export=\"a\\\"b\\\\c\\nd\"} 1.0"),
            "{text}"
        );
    }

    #[test]
    #[should_panic(expected = "added twice")]
    fn a_sample_added_twice_is_a_bug_caught_at_once() {
        // Goal: two samples with one name and one label set (a scrape Prometheus would reject)
        // never reach a client. Method: add the same gauge twice.
        let mut exposition = Exposition::default();
        exposition.gauge("demo", Labels::new(), 1.0, "Demo.");
        exposition.gauge("demo", Labels::new(), 2.0, "Demo.");
    }
}
