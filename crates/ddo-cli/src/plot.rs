//! `ddo bench --plot PREFIX`: time against peak memory, one numbered point per candidate
//! (route or preset), drawn with `plotters` to `PREFIX.svg` and `PREFIX.png`. x is the peak
//! device memory in MiB, y the median time in ms; a legend under the chart names each
//! numbered point, and the caption names the component and the device. Text is laid out
//! with `ab_glyph` from the DejaVu Sans font embedded in the binary (`assets/`, with its
//! licence), so drawing needs no system font library.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;

use crate::bench::CandidateResult;
use crate::error::{CliError, CliResult};

/// DejaVu Sans (Bitstream Vera licence: `assets/DejaVuSans-LICENSE.txt`).
const FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");
/// The family name the font is registered under.
const FAMILY: &str = "sans-serif";

const WIDTH: u32 = 1024;
const CHART_HEIGHT: u32 = 640;
const LEGEND_LINE: u32 = 22;

/// Registers the embedded font with plotters once; false when it could not be parsed.
fn font_ready() -> bool {
    static READY: OnceLock<bool> = OnceLock::new();
    *READY.get_or_init(|| plotters::style::register_font(FAMILY, FontStyle::Normal, FONT).is_ok())
}

/// `prefix` with `.ext` appended (`out/p` → `out/p.svg`).
fn with_ext(prefix: &Path, ext: &str) -> PathBuf {
    let mut s = OsString::from(prefix.as_os_str());
    s.push(".");
    s.push(ext);
    PathBuf::from(s)
}

/// Draws the chart on `root`: the candidates that ran as numbered points, a legend line for
/// every candidate (refused ones say so and have no point).
fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    caption: &str,
    results: &[CandidateResult],
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    root.fill(&WHITE)?;
    let (chart_area, legend_area) = root.split_vertically(CHART_HEIGHT);
    let ran: Vec<(usize, f64, f64)> = results
        .iter()
        .enumerate()
        .filter(|(_, r)| r.error.is_none())
        .map(|(i, r)| {
            (
                i,
                r.peak_bytes as f64 / (1024.0 * 1024.0),
                r.median_seconds * 1e3,
            )
        })
        .collect();
    let top = |v: f64| if v > 0.0 { v * 1.15 } else { 1.0 };
    let x_max = top(ran.iter().map(|p| p.1).fold(0.0, f64::max));
    let y_max = top(ran.iter().map(|p| p.2).fold(0.0, f64::max));

    let mut chart = ChartBuilder::on(&chart_area)
        .caption(caption, (FAMILY, 20))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)?;
    chart
        .configure_mesh()
        .x_desc("peak device memory (MiB)")
        .y_desc("median time (ms)")
        .axis_desc_style((FAMILY, 16))
        .label_style((FAMILY, 13))
        .draw()?;
    for &(i, x, y) in &ran {
        let color = Palette99::pick(i).to_rgba();
        chart.draw_series(std::iter::once(
            EmptyElement::at((x, y))
                + Circle::new((0, 0), 5, color.filled())
                + Text::new(format!("{}", i + 1), (7, -16), (FAMILY, 14)),
        ))?;
    }

    let text = (FAMILY, 14).into_font();
    for (i, r) in results.iter().enumerate() {
        let y = 6 + (i as u32 * LEGEND_LINE) as i32;
        let line = match &r.error {
            None => format!("{}  {}", i + 1, r.label),
            Some(_) => format!("{}  {} (refused, not plotted)", i + 1, r.label),
        };
        if r.error.is_none() {
            legend_area.draw(&Circle::new(
                (24, y + 4),
                5,
                Palette99::pick(i).to_rgba().filled(),
            ))?;
        }
        legend_area.draw(&Text::new(line, (40, y), text.clone()))?;
    }
    root.present()
}

/// The files `--plot PREFIX` names: `PREFIX.svg` and `PREFIX.png`. A prefix that names a
/// folder (empty, ending in a separator, `.` or `..`) would give hidden files named `.svg`
/// and `.png` in it: refused.
pub fn paths(prefix: &Path) -> CliResult<(PathBuf, PathBuf)> {
    let text = prefix.as_os_str().as_encoded_bytes();
    let names_file = !text.is_empty()
        && !text.ends_with(b"/")
        && matches!(
            prefix.components().next_back(),
            Some(std::path::Component::Normal(_))
        );
    if !names_file {
        return Err(CliError::usage(
            format!(
                "--plot {:?}: names a folder, not the start of a file name",
                prefix.display().to_string()
            ),
            "give a prefix such as out/plot (writes out/plot.svg and out/plot.png)",
        ));
    }
    Ok((with_ext(prefix, "svg"), with_ext(prefix, "png")))
}

/// Draws the chart in memory: the SVG text and the PNG bytes, for the caller to write
/// (`ddo bench` writes them with its other outputs, all or none).
pub fn render_plot(caption: &str, results: &[CandidateResult]) -> CliResult<(String, Vec<u8>)> {
    if !font_ready() {
        return Err(CliError::runtime(
            "cannot load the embedded plot font",
            "this is a bug in the ddo build; run without --plot",
        ));
    }
    let (w, h) = (
        WIDTH,
        CHART_HEIGHT + 12 + LEGEND_LINE * results.len() as u32,
    );
    let failed = |what: &str, e: &dyn std::fmt::Display| {
        CliError::runtime(format!("cannot draw the {what} chart: {e}"), "")
    };
    let mut svg = String::new();
    draw(
        SVGBackend::with_string(&mut svg, (w, h)).into_drawing_area(),
        caption,
        results,
    )
    .map_err(|e| failed("SVG", &e))?;
    let mut rgb = vec![0u8; w as usize * h as usize * 3];
    draw(
        BitMapBackend::with_buffer(&mut rgb, (w, h)).into_drawing_area(),
        caption,
        results,
    )
    .map_err(|e| failed("PNG", &e))?;
    let mut png = Vec::new();
    {
        let mut encoder = png::Encoder::new(&mut png, w, h);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        let mut writer = encoder.write_header().map_err(|e| failed("PNG", &e))?;
        writer
            .write_image_data(&rgb)
            .map_err(|e| failed("PNG", &e))?;
    }
    Ok((svg, png))
}
