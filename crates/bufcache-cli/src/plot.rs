//! Writing plots: SVG directly, PNG by rendering the SVG with `rsvg-convert` (Debian's
//! librsvg2-bin), so every plot a command draws is available in both formats.

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context};

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
pub fn parse_plot_path(text: &str) -> Result<std::path::PathBuf, String> {
    let path = std::path::PathBuf::from(text);
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
