//! Plots: curves drawn with `plotters` (SVG backend), written as SVG, or as PNG by rendering
//! that SVG with `rsvg-convert` (Debian's librsvg2-bin). plotters' own bitmap backend needs a
//! font stack (font-kit and the system's fontconfig/freetype, or a bundled font) to draw any
//! text; the SVG route keeps the binary free of both and gives identical pictures.
//!
//! Curve plots fit the y axis to the data (close policies stay apart), use a logarithmic x
//! axis when the sizes span a decade or more, and keep the legend in a column of its own
//! right of the plot, so it never covers a curve. The file format follows the extension;
//! any other extension is refused before any work is done.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};
use plotters::coord::ranged1d::{AsRangedCoord, Ranged, ValueFormatter};
use plotters::prelude::*;

/// One named line of a [`CurvePlot`]: points in increasing x.
#[derive(Clone, Debug, PartialEq)]
pub struct Curve {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// A line chart of curves sharing axes, e.g. miss ratio against cache size per policy.
#[derive(Clone, Debug, PartialEq)]
pub struct CurvePlot {
    pub title: String,
    /// The x axis's quantity and unit, e.g. "cache size (MiB)".
    pub x_label: String,
    pub y_label: String,
    pub curves: Vec<Curve>,
    /// The y values are ratios: the fitted axis never leaves 0..=1.
    pub y_is_ratio: bool,
}

const WIDTH_PIXELS: u32 = 860;
const HEIGHT_PIXELS: u32 = 500;
const LEGEND_WIDTH_PIXELS: u32 = 150;

/// Colours that stay distinct for the seven policies plus OPT (Tableau 10).
const COLOURS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

impl CurvePlot {
    /// The plot as an SVG document.
    pub fn to_svg(&self) -> anyhow::Result<String> {
        let mut svg = String::new();
        {
            let root = SVGBackend::with_string(&mut svg, (WIDTH_PIXELS, HEIGHT_PIXELS))
                .into_drawing_area();
            self.draw(&root)
                .map_err(|error| anyhow::anyhow!("drawing the plot: {error}"))?;
            root.present()
                .map_err(|error| anyhow::anyhow!("drawing the plot: {error}"))?;
        }
        Ok(svg)
    }

    /// Writes the plot to `path` in the format its extension names (see [`parse_plot_path`]).
    pub fn write(&self, path: &Path) -> anyhow::Result<()> {
        write_plot(&self.to_svg()?, path)
    }

    /// The x range covered by the data, padded so end points are not on the frame.
    fn x_extent(&self) -> (f64, f64) {
        let (low, high) = extent(
            self.curves
                .iter()
                .flat_map(|curve| curve.points.iter().map(|p| p.0)),
        );
        if high > low {
            (low, high)
        } else {
            let pad = if low == 0.0 { 1.0 } else { low.abs() * 0.1 };
            (low - pad, high + pad)
        }
    }

    /// The y range fitted to the data with 8% of margin (at least 0.01 each side).
    fn y_range(&self) -> Range<f64> {
        let (low, high) = extent(
            self.curves
                .iter()
                .flat_map(|curve| curve.points.iter().map(|p| p.1)),
        );
        let pad = ((high - low) * 0.08).max(0.01);
        let (mut low, mut high) = (low - pad, high + pad);
        if self.y_is_ratio {
            low = low.max(0.0);
            high = high.min(1.0);
        }
        low..high
    }

    fn draw<DB: DrawingBackend>(
        &self,
        root: &DrawingArea<DB, plotters::coord::Shift>,
    ) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
        root.fill(&WHITE)?;
        let (plot_area, legend_area) = root.split_horizontally(WIDTH_PIXELS - LEGEND_WIDTH_PIXELS);
        let (x_low, x_high) = self.x_extent();
        // On a log axis, ticks at the sizes that were measured (a handful, usually powers of
        // two), which decade-based ticks would skip; too many to label are left to plotters.
        let mut ticks: Vec<f64> = self
            .curves
            .iter()
            .flat_map(|curve| curve.points.iter().map(|point| point.0))
            .collect();
        ticks.sort_by(f64::total_cmp);
        ticks.dedup();
        let own_ticks = ticks.len() <= 12;
        if x_low > 0.0 && x_high / x_low >= 10.0 {
            // Sizes spanning decades: equal ratios get equal room.
            let range = (x_low / 1.15..x_high * 1.15).log_scale();
            if own_ticks {
                self.draw_chart(&plot_area, range.with_key_points(ticks))?;
            } else {
                self.draw_chart(&plot_area, range)?;
            }
        } else {
            // Within a decade plotters' own round ticks read well.
            let pad = (x_high - x_low) * 0.05;
            self.draw_chart(&plot_area, (x_low - pad)..(x_high + pad))?;
        }
        self.draw_legend(&legend_area)
    }

    fn draw_chart<DB: DrawingBackend, X>(
        &self,
        area: &DrawingArea<DB, plotters::coord::Shift>,
        x_range: X,
    ) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>>
    where
        X: AsRangedCoord<Value = f64>,
        X::CoordDescType: ValueFormatter<f64>,
        <X::CoordDescType as Ranged>::ValueType: Into<f64>,
    {
        let mut chart = ChartBuilder::on(area)
            .caption(&self.title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(48)
            .y_label_area_size(64)
            .build_cartesian_2d(x_range, self.y_range())?;
        chart
            .configure_mesh()
            .x_desc(&self.x_label)
            .y_desc(&self.y_label)
            .x_label_formatter(&|value| short_number(*value))
            .y_label_formatter(&|value| format!("{value:.3}"))
            .label_style(("sans-serif", 13))
            .axis_desc_style(("sans-serif", 15))
            .draw()?;
        for (index, curve) in self.curves.iter().enumerate() {
            let colour = COLOURS[index % COLOURS.len()];
            chart.draw_series(LineSeries::new(
                curve.points.iter().copied(),
                colour.stroke_width(2),
            ))?;
            chart.draw_series(
                curve
                    .points
                    .iter()
                    .map(|&point| Circle::new(point, 3, colour.filled())),
            )?;
        }
        Ok(())
    }

    fn draw_legend<DB: DrawingBackend>(
        &self,
        area: &DrawingArea<DB, plotters::coord::Shift>,
    ) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
        for (index, curve) in self.curves.iter().enumerate() {
            let colour = COLOURS[index % COLOURS.len()];
            let y = 60 + 24 * index as i32;
            area.draw(&PathElement::new(
                vec![(8, y), (36, y)],
                colour.stroke_width(3),
            ))?;
            area.draw(&Text::new(
                curve.name.clone(),
                (44, y - 8),
                ("sans-serif", 15).into_font(),
            ))?;
        }
        Ok(())
    }
}

/// Smallest and largest of `values` (0, 0 when empty; NaN ignored).
fn extent(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (low, high) = values
        .filter(|value| value.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(low, high), value| {
            (low.min(value), high.max(value))
        });
    if low.is_finite() {
        (low, high)
    } else {
        (0.0, 0.0)
    }
}

/// An axis label: integers without decimals, others with as few as tell them apart.
fn short_number(value: f64) -> String {
    if value == value.round() && value.abs() < 1e15 {
        format!("{value:.0}")
    } else if value.abs() >= 10.0 {
        format!("{value:.1}")
    } else {
        format!("{value:.3}")
            .trim_end_matches('0')
            .trim_end_matches('.')
            .to_string()
    }
}

/// A binary unit for an axis of byte sizes up to `bytes_max`: its name and size in bytes, so
/// that axis numbers stay between about 1 and 1024.
pub fn size_unit(bytes_max: f64) -> (&'static str, f64) {
    const UNITS: [(&str, f64); 5] = [
        ("TiB", 1024.0 * 1024.0 * 1024.0 * 1024.0),
        ("GiB", 1024.0 * 1024.0 * 1024.0),
        ("MiB", 1024.0 * 1024.0),
        ("KiB", 1024.0),
        ("bytes", 1.0),
    ];
    UNITS
        .iter()
        .copied()
        .find(|&(_, size)| bytes_max >= size)
        .unwrap_or(("bytes", 1.0))
}

/// Writes `svg` to `path`: as SVG, or rendered to PNG when `path` ends in `.png`.
pub fn write_plot(svg: &str, path: &Path) -> anyhow::Result<()> {
    let is_png = path
        .extension()
        .is_some_and(|extension| extension.eq_ignore_ascii_case("png"));
    if !is_png {
        return std::fs::write(path, svg).with_context(|| format!("writing {}", path.display()));
    }
    let source = path.with_extension("svg.tmp");
    std::fs::write(&source, svg).with_context(|| format!("writing {}", source.display()))?;
    let rendered = Command::new("rsvg-convert")
        .arg("--background-color=white")
        .arg("-o")
        .arg(path)
        .arg(&source)
        .output();
    let _ = std::fs::remove_file(&source);
    match rendered {
        Ok(output) if output.status.success() => Ok(()),
        Ok(output) => bail!(
            "rsvg-convert could not render {}: {}",
            path.display(),
            String::from_utf8_lossy(&output.stderr).trim()
        ),
        Err(error) => bail!(
            "writing {} needs rsvg-convert (apt-get install librsvg2-bin): {error}",
            path.display()
        ),
    }
}

/// Parses a `--plot` path: its name must end in .svg or .png (any case), so a plot never
/// lands in a file whose name promises another format.
pub fn parse_plot_path(text: &str) -> Result<PathBuf, String> {
    let path = PathBuf::from(text);
    let known = path.extension().is_some_and(|extension| {
        extension.eq_ignore_ascii_case("svg") || extension.eq_ignore_ascii_case("png")
    });
    if known {
        Ok(path)
    } else {
        Err(format!(
            "`{text}`: a plot is written as SVG or PNG; name the file *.svg or *.png"
        ))
    }
}

/// True when PNG plots can be rendered here.
pub fn png_available() -> bool {
    Command::new("rsvg-convert")
        .arg("--version")
        .output()
        .is_ok_and(|output| output.status.success())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plot(points: &[(f64, f64)]) -> CurvePlot {
        CurvePlot {
            title: "t".into(),
            x_label: "cache size (MiB)".into(),
            y_label: "miss ratio".into(),
            curves: vec![Curve {
                name: "lru".into(),
                points: points.to_vec(),
            }],
            y_is_ratio: true,
        }
    }

    #[test]
    fn y_axis_is_fitted_to_the_data_and_stays_within_ratios() {
        let close = plot(&[(1.0, 0.80), (4.0, 0.78), (16.0, 0.75)]).y_range();
        assert!(close.start > 0.7 && close.end < 0.85, "{close:?}");
        let edge = plot(&[(1.0, 0.999), (2.0, 0.0)]).y_range();
        assert_eq!((edge.start, edge.end), (0.0, 1.0));
    }

    #[test]
    fn svg_names_the_axes_and_every_curve() {
        let mut plot = plot(&[(1.0, 0.8), (64.0, 0.6)]);
        plot.curves.push(Curve {
            name: "s3fifo".into(),
            points: vec![(1.0, 0.7), (64.0, 0.5)],
        });
        let svg = plot.to_svg().unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..40]);
        for text in ["cache size (MiB)", "miss ratio", "lru", "s3fifo"] {
            assert!(svg.contains(text), "{text} missing");
        }
    }

    #[test]
    fn size_units_keep_axis_numbers_readable() {
        assert_eq!(size_unit(512.0 * 1024.0 * 1024.0).0, "MiB");
        assert_eq!(size_unit(2.0 * 1024.0 * 1024.0 * 1024.0).0, "GiB");
        assert_eq!(size_unit(100.0).0, "bytes");
    }
}
