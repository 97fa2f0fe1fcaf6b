//! Experiment output: a table (text, CSV, JSON) and a line plot (SVG, written by hand so the
//! crate needs no plotting library or fonts).

use std::fmt::Write as _;

use serde::ser::{Serialize, Serializer};

/// One table cell: text, or a number shown with a fixed number of decimals.
#[derive(Clone, Debug, PartialEq)]
pub enum Cell {
    /// Text.
    Text(String),
    /// A number and the decimals to show.
    Number(f64, usize),
}

impl Cell {
    /// The cell as shown in text and CSV.
    pub fn show(&self) -> String {
        match self {
            Cell::Text(text) => text.clone(),
            Cell::Number(value, decimals) => format!("{value:.decimals$}"),
        }
    }

    /// The numeric value, if any.
    pub fn value(&self) -> Option<f64> {
        match self {
            Cell::Number(value, _) => Some(*value),
            Cell::Text(_) => None,
        }
    }
}

impl Serialize for Cell {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Cell::Text(text) => serializer.serialize_str(text),
            Cell::Number(value, _) => serializer.serialize_f64(*value),
        }
    }
}

/// Text cell.
pub fn text(value: impl Into<String>) -> Cell {
    Cell::Text(value.into())
}

/// Number cell.
pub fn num(value: f64, decimals: usize) -> Cell {
    Cell::Number(value, decimals)
}

/// A table.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Table {
    /// Column headings.
    pub columns: Vec<String>,
    /// Rows of cells.
    pub rows: Vec<Vec<Cell>>,
}

impl Table {
    /// An empty table with these columns.
    pub fn new(columns: &[&str]) -> Self {
        Table {
            columns: columns.iter().map(|c| c.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    /// Adds a row.
    pub fn push(&mut self, row: Vec<Cell>) {
        self.rows.push(row);
    }

    /// Aligned text: numbers right-aligned, text left-aligned.
    pub fn to_text(&self) -> String {
        let shown: Vec<Vec<String>> = self
            .rows
            .iter()
            .map(|row| row.iter().map(Cell::show).collect())
            .collect();
        let widths: Vec<usize> = (0..self.columns.len())
            .map(|i| {
                shown
                    .iter()
                    .filter_map(|row| row.get(i))
                    .map(|s| s.chars().count())
                    .chain([self.columns[i].chars().count()])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let mut out = String::new();
        let line = |cells: Vec<(String, bool)>, out: &mut String| {
            let parts: Vec<String> = cells
                .iter()
                .zip(&widths)
                .map(|((cell, right), &width)| {
                    if *right {
                        format!("{cell:>width$}")
                    } else {
                        format!("{cell:<width$}")
                    }
                })
                .collect();
            out.push_str(parts.join("  ").trim_end());
            out.push('\n');
        };
        line(
            self.columns.iter().map(|c| (c.clone(), false)).collect(),
            &mut out,
        );
        line(
            widths.iter().map(|&w| ("-".repeat(w), false)).collect(),
            &mut out,
        );
        for (row, cells) in self.rows.iter().zip(&shown) {
            line(
                row.iter()
                    .zip(cells)
                    .map(|(cell, s)| (s.clone(), cell.value().is_some()))
                    .collect(),
                &mut out,
            );
        }
        out
    }

    /// CSV with a header line.
    pub fn to_csv(&self) -> String {
        let quote = |s: &str| {
            if s.contains([',', '"', '\n']) {
                format!("\"{}\"", s.replace('"', "\"\""))
            } else {
                s.to_string()
            }
        };
        let mut out = self
            .columns
            .iter()
            .map(|c| quote(c))
            .collect::<Vec<_>>()
            .join(",");
        out.push('\n');
        for row in &self.rows {
            let cells: Vec<String> = row
                .iter()
                .map(|cell| match cell {
                    Cell::Number(value, _) => format!("{value}"),
                    Cell::Text(text) => quote(text),
                })
                .collect();
            out.push_str(&cells.join(","));
            out.push('\n');
        }
        out
    }
}

/// One line of a plot.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Series {
    /// Legend name.
    pub name: String,
    /// Points (x, y).
    pub points: Vec<(f64, f64)>,
}

/// A line plot.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Plot {
    /// Title.
    pub title: String,
    /// X axis label.
    pub x_label: String,
    /// Y axis label.
    pub y_label: String,
    /// Lines.
    pub series: Vec<Series>,
    /// Category names for x = 0, 1, 2, ... (instead of numeric ticks).
    pub x_categories: Vec<String>,
}

fn nice_step(range: f64) -> f64 {
    let raw = (range / 5.0).max(1e-12);
    let magnitude = 10f64.powf(raw.log10().floor());
    let fraction = raw / magnitude;
    let nice = if fraction <= 1.0 {
        1.0
    } else if fraction <= 2.0 {
        2.0
    } else if fraction <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * magnitude
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

impl Plot {
    /// The plot as a standalone SVG document.
    pub fn to_svg(&self) -> String {
        const COLORS: [&str; 8] = [
            "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
        ];
        let (width, height) = (720.0, 440.0);
        let (left, right, top, bottom) = (70.0, 170.0, 40.0, 60.0);
        let points = self.series.iter().flat_map(|s| s.points.iter());
        let (mut x_min, mut x_max, mut y_max) = (f64::MAX, f64::MIN, 0.0f64);
        for &(x, y) in points {
            x_min = x_min.min(x);
            x_max = x_max.max(x);
            y_max = y_max.max(y);
        }
        if x_min > x_max {
            (x_min, x_max) = (0.0, 1.0);
        }
        if x_max == x_min {
            x_max = x_min + 1.0;
        }
        let y_step = nice_step(y_max.max(1e-9));
        let y_top = (y_max / y_step).ceil().max(1.0) * y_step;
        let plot_w = width - left - right;
        let plot_h = height - top - bottom;
        let sx = |x: f64| left + (x - x_min) / (x_max - x_min) * plot_w;
        let sy = |y: f64| top + plot_h - y / y_top * plot_h;
        let mut svg = String::new();
        let _ = writeln!(
            svg,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
        let _ = writeln!(
            svg,
            r#"<text x="{}" y="22" text-anchor="middle" font-size="15">{}</text>"#,
            left + plot_w / 2.0,
            escape(&self.title)
        );
        // Y grid and ticks.
        let mut y = 0.0;
        while y <= y_top + y_step * 0.01 {
            let py = sy(y);
            let _ = writeln!(
                svg,
                r##"<line x1="{left}" y1="{py:.1}" x2="{:.1}" y2="{py:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
                left + plot_w,
                left - 6.0,
                py + 4.0,
                format_tick(y)
            );
            y += y_step;
        }
        // X ticks.
        if self.x_categories.is_empty() {
            let x_step = nice_step(x_max - x_min);
            let mut x = (x_min / x_step).ceil() * x_step;
            while x <= x_max + x_step * 0.01 {
                let _ = writeln!(
                    svg,
                    r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                    sx(x),
                    top + plot_h + 18.0,
                    format_tick(x)
                );
                x += x_step;
            }
        } else {
            for (index, name) in self.x_categories.iter().enumerate() {
                let _ = writeln!(
                    svg,
                    r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                    sx(index as f64),
                    top + plot_h + 18.0,
                    escape(name)
                );
            }
        }
        let _ = writeln!(
            svg,
            r##"<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#333"/>"##
        );
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            left + plot_w / 2.0,
            height - 18.0,
            escape(&self.x_label)
        );
        let _ = writeln!(
            svg,
            r#"<text transform="translate(18,{:.1}) rotate(-90)" text-anchor="middle">{}</text>"#,
            top + plot_h / 2.0,
            escape(&self.y_label)
        );
        for (index, series) in self.series.iter().enumerate() {
            let color = COLORS[index % COLORS.len()];
            let path: Vec<String> = series
                .points
                .iter()
                .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
                .collect();
            let _ = writeln!(
                svg,
                r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"/>"#,
                path.join(" ")
            );
            for &(x, y) in &series.points {
                let _ = writeln!(
                    svg,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{color}"/>"#,
                    sx(x),
                    sy(y)
                );
            }
            let ly = top + 10.0 + index as f64 * 18.0;
            let lx = left + plot_w + 12.0;
            let _ = writeln!(
                svg,
                r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{color}" stroke-width="3"/><text x="{}" y="{}">{}</text>"#,
                lx + 18.0,
                lx + 24.0,
                ly + 4.0,
                escape(&series.name)
            );
        }
        svg.push_str("</svg>\n");
        svg
    }
}

fn format_tick(value: f64) -> String {
    if value.abs() >= 100.0 || value == value.round() {
        format!("{value:.0}")
    } else if value.abs() >= 1.0 {
        format!("{value:.1}")
    } else {
        format!("{value:.2}")
    }
}

/// The output of one experiment.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ExperimentResult {
    /// Experiment name (`maxbsize`, `sweep`, ...).
    pub name: String,
    /// One-line title.
    pub title: String,
    /// The seed it reproduces and how.
    pub description: String,
    /// The results.
    pub table: Table,
    /// Remarks: the seed's own numbers, the setup, caveats.
    pub notes: Vec<String>,
    /// A plot of the table.
    pub plot: Plot,
    /// The seed's figures beside ours, shape (direction and ratio) first.
    pub comparison: Vec<Comparison>,
}

/// What a [`Comparison`] entry compares.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ComparisonKind {
    /// A ratio between two of the seed's conditions (the direction and size of a change):
    /// what the experiment is meant to reproduce.
    Shape,
    /// A direction the seed states without a figure ("much worse", "greatly improved"):
    /// `theirs` is +1 (the ratio goes up) or -1 (down), `ours` the ratio.
    Direction,
    /// An absolute figure of one condition.
    Figure,
    /// A figure the model was calibrated on: an input, never a result.
    Calibration,
}

/// One of the seed's figures beside ours.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Comparison {
    /// The seed thread (`000` … `004`).
    pub seed: String,
    /// What is compared, with its unit or `ratio a/b`.
    pub metric: String,
    /// Shape, figure or calibration input.
    pub kind: ComparisonKind,
    /// The seed's value, copied from the thread.
    pub theirs: f64,
    /// Ours.
    pub ours: f64,
}

impl Comparison {
    /// An entry.
    pub fn new(
        seed: &str,
        kind: ComparisonKind,
        metric: impl Into<String>,
        theirs: f64,
        ours: f64,
    ) -> Self {
        Comparison {
            seed: seed.to_string(),
            metric: metric.into(),
            kind,
            theirs,
            ours,
        }
    }

    fn kind_name(&self) -> &'static str {
        match self.kind {
            ComparisonKind::Shape => "shape",
            ComparisonKind::Direction => "direction",
            ComparisonKind::Figure => "figure",
            ComparisonKind::Calibration => "calibration input",
        }
    }
}

/// Ratios within this of 1 count as no change: a flat result never shares the seed's
/// direction (`f64::signum` would call a ratio of exactly 1 an increase).
const FLAT_RATIO_TOLERANCE: f64 = 0.01;

/// The sign of the change a ratio shows: +1 up, -1 down, 0 flat.
fn change(ratio: f64) -> f64 {
    if (ratio - 1.0).abs() < FLAT_RATIO_TOLERANCE {
        0.0
    } else {
        (ratio - 1.0).signum()
    }
}

/// Whether ours moved as the seed did: `same`, `opposite`, `flat` (the seed's figure moved,
/// ours did not) or `differs` (the seed's did not move, ours moved by more than 10 %); `-`
/// for figures.
pub fn direction_label(entry: &Comparison) -> &'static str {
    let theirs = match entry.kind {
        // A ratio above 1 is an increase, below 1 a decrease.
        ComparisonKind::Shape => change(entry.theirs),
        // The seed states the sign alone.
        ComparisonKind::Direction => entry.theirs.signum(),
        _ => return "-",
    };
    let ours = change(entry.ours);
    if entry.kind == ComparisonKind::Shape && (entry.theirs - 1.0).abs() < 0.02 {
        // No change in the seed: ours within 10 % counts as the same.
        return if (entry.ours - 1.0).abs() <= 0.1 {
            "same"
        } else {
            "differs"
        };
    }
    if ours == 0.0 {
        "flat"
    } else if ours == theirs {
        "same"
    } else {
        "opposite"
    }
}

/// The comparison entries as a table, shapes first: seed, kind, metric, theirs, ours, and
/// ours/theirs with the direction (see [`direction_label`]).
pub fn comparison_table(entries: &[Comparison]) -> Table {
    let mut table = Table::new(&[
        "seed",
        "kind",
        "metric",
        "theirs",
        "ours",
        "ours/theirs",
        "direction",
    ]);
    let mut sorted: Vec<&Comparison> = entries.iter().collect();
    sorted.sort_by_key(|c| match c.kind {
        ComparisonKind::Shape | ComparisonKind::Direction => 0,
        ComparisonKind::Figure => 1,
        ComparisonKind::Calibration => 2,
    });
    for entry in sorted {
        let direction = direction_label(entry);
        let relative = match entry.kind {
            ComparisonKind::Direction => text("-"),
            _ => num(
                if entry.theirs != 0.0 {
                    entry.ours / entry.theirs
                } else {
                    0.0
                },
                2,
            ),
        };
        table.push(vec![
            text(entry.seed.clone()),
            text(entry.kind_name()),
            text(entry.metric.clone()),
            num(entry.theirs, 3),
            num(entry.ours, 3),
            relative,
            text(direction),
        ]);
    }
    table
}

impl ExperimentResult {
    /// Title, description, the comparison with the seed, table and notes as text.
    pub fn to_text(&self) -> String {
        let mut out = format!("{}\n{}\n\n", self.title, self.description);
        if !self.comparison.is_empty() {
            out.push_str("beside the seed (shape first; a calibration input is not a result):\n");
            out.push_str(&comparison_table(&self.comparison).to_text());
            out.push('\n');
        }
        out.push_str(&self.table.to_text());
        out.push('\n');
        for note in &self.notes {
            out.push_str(&format!("* {note}\n"));
        }
        out
    }

    /// The table as CSV.
    pub fn to_csv(&self) -> String {
        self.table.to_csv()
    }

    /// The comparison with the seed as CSV (shapes first).
    pub fn comparison_csv(&self) -> String {
        comparison_table(&self.comparison).to_csv()
    }

    /// Everything as pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("experiment results serialize")
    }

    /// The plot as SVG.
    pub fn to_svg(&self) -> String {
        self.plot.to_svg()
    }

    /// The numeric value in `column` of row `row`.
    pub fn value(&self, row: usize, column: &str) -> Option<f64> {
        let index = self.table.columns.iter().position(|c| c == column)?;
        self.table.rows.get(row)?.get(index)?.value()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flat_ratio_never_shares_the_seeds_direction() {
        // Goal: a ratio of 1 (ours did not move) is reported as flat, not as the seed's
        // increase (f64::signum(0.0) is +1). Method: label shapes and directions whose ours
        // is exactly 1, slightly off 1, clearly up and clearly down.
        let shape = |theirs, ours| Comparison::new("002", ComparisonKind::Shape, "m", theirs, ours);
        let direction =
            |theirs, ours| Comparison::new("002", ComparisonKind::Direction, "m", theirs, ours);
        assert_eq!(direction_label(&shape(1.093, 1.0)), "flat");
        assert_eq!(direction_label(&shape(0.808, 1.004)), "flat");
        assert_eq!(direction_label(&shape(1.093, 1.2)), "same");
        assert_eq!(direction_label(&shape(1.093, 0.8)), "opposite");
        assert_eq!(direction_label(&direction(1.0, 1.0)), "flat");
        assert_eq!(direction_label(&direction(1.0, 1.36)), "same");
        assert_eq!(direction_label(&direction(1.0, 0.74)), "opposite");
        // The seed did not move: ours within 10 % is the same, beyond it differs.
        assert_eq!(direction_label(&shape(0.995, 1.05)), "same");
        assert_eq!(direction_label(&shape(0.995, 1.47)), "differs");
        let figure = Comparison::new("002", ComparisonKind::Figure, "m", 4.3, 2.7);
        assert_eq!(direction_label(&figure), "-");
    }
}
