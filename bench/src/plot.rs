//! SVG plots of a [`Report`] with `plotters` (SVG backend: text is emitted as `<text>`
//! elements, so no font files are needed).
//!
//! * `ttft_cdf.svg` — cumulative distribution of TTFT (log-scaled time axis), all requests
//!   and one line per instance.
//! * `inflight.svg` — in-flight requests per instance over time (client view; the report's
//!   buckets averaged in groups so that a line has at most 300 points).
//!
//! Across runs ([`PlotSpec`], drawn by the `tail-plot` binary for `bench/tail.sh`):
//!
//! * [`percentiles_svg`] — TTFT p50 / p90 / p99 per config, one column per run (seed).
//! * [`ccdfs_svg`] — the TTFT tail per config: fraction of requests at least x ms, log-log.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context};
use plotters::prelude::*;
use serde::Deserialize;

use super::report::Report;

fn err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("plotting: {e:?}")
}

/// Ten well-separated colours (matplotlib's "tab10"), then plotters' 99-colour palette.
/// The series legend, boxed, in one corner of the chart.
fn draw_legend<'a, DB: DrawingBackend + 'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
    pos: SeriesLabelPosition,
) -> anyhow::Result<()> {
    chart
        .configure_series_labels()
        .position(pos)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)
}

fn color(i: usize) -> RGBColor {
    const TAB10: [(u8, u8, u8); 10] = [
        (31, 119, 180),
        (255, 127, 14),
        (44, 160, 44),
        (214, 39, 40),
        (148, 103, 189),
        (140, 86, 75),
        (227, 119, 194),
        (127, 127, 127),
        (188, 189, 34),
        (23, 190, 207),
    ];
    if let Some(&(r, g, b)) = TAB10.get(i) {
        return RGBColor(r, g, b);
    }
    let c = Palette99::pick(i).to_rgba();
    RGBColor(c.0, c.1, c.2)
}

/// Labels of a log axis: only 1, 2 and 5 × 10^k, without trailing zeros.
fn log_label(x: &f64) -> String {
    if *x <= 0.0 {
        return String::new();
    }
    let exp = x.log10().floor();
    let mant = x / 10f64.powf(exp);
    if [1.0, 2.0, 5.0, 10.0]
        .iter()
        .any(|m| (mant - m).abs() < 1e-6)
    {
        let v = (mant.round() * 10f64.powf(exp) * 1e6).round() / 1e6;
        format!("{v}")
    } else {
        String::new()
    }
}

/// CDF points (x, fraction ≤ x) of sorted-in-place values.
fn cdf(v: &mut [f64]) -> Vec<(f64, f64)> {
    v.sort_by(f64::total_cmp);
    let n = v.len() as f64;
    v.iter()
        .enumerate()
        .map(|(i, &x)| (x, (i + 1) as f64 / n))
        .collect()
}

/// The TTFT CDF as an SVG document.
pub fn ttft_cdf_svg(report: &Report) -> anyhow::Result<String> {
    let ok = report.requests.iter().filter(|r| r.ok());
    let mut all: Vec<f64> = ok.clone().filter_map(|r| r.ttft_ms).collect();
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (900, 520)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let lo = all.iter().cloned().fold(f64::INFINITY, f64::min);
        let hi = all.iter().cloned().fold(0.0, f64::max);
        let (lo, hi) = if all.is_empty() {
            (0.1, 1.0)
        } else {
            ((lo * 0.9).max(1e-3), (hi * 1.1).max(lo * 1.2).max(1e-2))
        };
        let mut chart = ChartBuilder::on(&root)
            .caption(
                format!("TTFT CDF — {} requests", all.len()),
                ("sans-serif", 20),
            )
            .margin(12)
            .x_label_area_size(45)
            .y_label_area_size(55)
            .build_cartesian_2d((lo..hi).log_scale(), 0.0..1.0)
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc("TTFT (ms, log scale)")
            .x_labels(30)
            .x_label_formatter(&log_label)
            .light_line_style(BLACK.mix(0.03))
            .y_desc("fraction of requests")
            .y_label_formatter(&|y| format!("{y:.1}"))
            .draw()
            .map_err(err)?;
        let instances: Vec<&String> = report
            .instances
            .iter()
            .map(|i| &i.instance)
            .filter(|n| n.as_str() != "-")
            .collect();
        if instances.len() > 1 && instances.len() <= 16 {
            for (k, name) in instances.iter().enumerate() {
                let mut v: Vec<f64> = ok
                    .clone()
                    .filter(|r| r.instance_label() == name.as_str())
                    .filter_map(|r| r.ttft_ms)
                    .collect();
                let c = color(k);
                chart
                    .draw_series(LineSeries::new(cdf(&mut v), c.stroke_width(1)))
                    .map_err(err)?
                    .label(name.as_str())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c));
            }
        }
        chart
            .draw_series(LineSeries::new(cdf(&mut all), BLACK.stroke_width(3)))
            .map_err(err)?
            .label("all")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLACK.stroke_width(3)));
        draw_legend(&mut chart, SeriesLabelPosition::LowerRight)?;
        root.present().map_err(err)?;
    }
    Ok(out)
}

/// In-flight requests per instance over time as an SVG document.
pub fn inflight_svg(report: &Report) -> anyhow::Result<String> {
    let l = &report.load;
    let nb = l.inflight.first().map_or(0, |v| v.len());
    // At most MAX_POINTS points per line: average groups of k buckets.
    const MAX_POINTS: usize = 300;
    let k = nb.div_ceil(MAX_POINTS).max(1);
    let bucket_ms = l.bucket_ms * k as f64;
    let series: Vec<Vec<f64>> = l
        .inflight
        .iter()
        .map(|v| {
            v.chunks(k)
                .map(|c| c.iter().sum::<f64>() / c.len() as f64)
                .collect()
        })
        .collect();
    let t_end = (nb as f64 * l.bucket_ms / 1000.0).max(1e-3);
    let peak = series
        .iter()
        .flat_map(|v| v.iter().cloned())
        .fold(0.0, f64::max)
        .max(1.0);
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (900, 520)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                format!(
                    "In-flight requests per instance ({bucket_ms:.0} ms averages, imbalance {:.2})",
                    l.imbalance
                ),
                ("sans-serif", 20),
            )
            .margin(12)
            .x_label_area_size(45)
            .y_label_area_size(55)
            .build_cartesian_2d(0.0..t_end, 0.0..peak * 1.1)
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_label_formatter(&|x| format!("{x}"))
            .y_label_formatter(&|y| format!("{y}"))
            .x_desc("time since start (s)")
            .y_desc("in-flight requests")
            .draw()
            .map_err(err)?;
        for (i, (name, series)) in l.instances.iter().zip(&series).enumerate() {
            let c = color(i);
            let pts = series
                .iter()
                .enumerate()
                .map(|(b, &v)| ((b as f64 + 0.5) * bucket_ms / 1000.0, v));
            chart
                .draw_series(LineSeries::new(pts, c.stroke_width(1)))
                .map_err(err)?
                .label(name.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c));
        }
        draw_legend(&mut chart, SeriesLabelPosition::UpperRight)?;
        root.present().map_err(err)?;
    }
    Ok(out)
}

/// Writes `ttft_cdf.svg` and `inflight.svg` into `dir` (created if missing); returns the paths.
pub fn write_plots(report: &Report, dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut paths = Vec::new();
    for (name, svg) in [
        ("ttft_cdf.svg", ttft_cdf_svg(report)?),
        ("inflight.svg", inflight_svg(report)?),
    ] {
        let p = dir.join(name);
        std::fs::write(&p, svg).with_context(|| format!("writing {}", p.display()))?;
        paths.push(p);
    }
    Ok(paths)
}

/// The log-scale bounds of a time axis holding `values` (ms).
fn log_bounds(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values
        .filter(|x| x.is_finite() && *x > 0.0)
        .fold((f64::INFINITY, 0.0f64), |(lo, hi), x| {
            (lo.min(x), hi.max(x))
        });
    if hi == 0.0 {
        (0.1, 1.0)
    } else {
        ((lo * 0.8).max(1e-3), (hi * 1.25).max(lo * 1.5).max(1e-2))
    }
}

/// One config of [`percentiles_svg`]: TTFT (p50, p90, p99) in ms of each of its runs.
#[derive(Clone, Debug, Deserialize)]
pub struct PercentileRow {
    pub label: String,
    pub runs: Vec<[f64; 3]>,
}

/// TTFT p50 (circle), p90 (triangle) and p99 (square) per config, one column per run in
/// the given order (seeds), log time axis.
pub fn percentiles_svg(title: &str, rows: &[PercentileRow]) -> anyhow::Result<String> {
    let width = rows.iter().map(|r| r.runs.len()).max().unwrap_or(1).max(1);
    // Slots: each config's runs, then one empty slot between configs.
    let group = width as i32 + 1;
    let slots = (rows.len() as i32 * group - 1).max(1);
    let (lo, hi) = log_bounds(rows.iter().flat_map(|r| r.runs.iter().flatten().copied()));
    // Head room above the data for the legend.
    let hi = hi * 3.0;
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (960, 540)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d((0..slots).into_segmented(), (lo..hi).log_scale())
            .map_err(err)?;
        let label = |v: &SegmentValue<i32>| -> String {
            let s = match v {
                SegmentValue::CenterOf(s) | SegmentValue::Exact(s) => *s,
                SegmentValue::Last => return String::new(),
            };
            let (g, k) = (s / group, s % group);
            match rows.get(g as usize) {
                Some(r) if k == (r.runs.len() as i32 - 1).max(0) / 2 => r.label.clone(),
                _ => String::new(),
            }
        };
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(slots as usize + 1)
            .x_label_formatter(&label)
            .y_desc("TTFT (ms, log scale)")
            .y_labels(30)
            .y_label_formatter(&log_label)
            .light_line_style(WHITE)
            .draw()
            .map_err(err)?;
        let marks = [("p50", color(0)), ("p90", color(1)), ("p99", color(3))];
        for (g, row) in rows.iter().enumerate() {
            for (k, run) in row.runs.iter().enumerate() {
                let x = SegmentValue::CenterOf(g as i32 * group + k as i32);
                chart
                    .draw_series(std::iter::once(PathElement::new(
                        vec![(x.clone(), run[0].max(lo)), (x.clone(), run[2].max(lo))],
                        BLACK.mix(0.3),
                    )))
                    .map_err(err)?;
                for (p, &(_, c)) in marks.iter().enumerate() {
                    let at = (x.clone(), run[p].max(lo));
                    let style = c.filled();
                    match p {
                        0 => chart.draw_series(std::iter::once(Circle::new(at, 4, style))),
                        1 => chart.draw_series(std::iter::once(TriangleMarker::new(at, 6, style))),
                        _ => chart.draw_series(std::iter::once(
                            EmptyElement::at(at) + Rectangle::new([(-4, -4), (4, 4)], style),
                        )),
                    }
                    .map_err(err)?;
                }
            }
        }
        // Legend entries (empty series, only for their labels).
        for (p, (name, c)) in marks.into_iter().enumerate() {
            chart
                .draw_series(std::iter::empty::<Circle<(SegmentValue<i32>, f64), i32>>())
                .map_err(err)?
                .label(name)
                .legend(move |(x, y)| {
                    let at = EmptyElement::at((x + 8, y));
                    match p {
                        0 => at + Circle::new((0, 0), 4, c.filled()).into_dyn(),
                        1 => at + TriangleMarker::new((0, 0), 6, c.filled()).into_dyn(),
                        _ => at + Rectangle::new([(-4, -4), (4, 4)], c.filled()).into_dyn(),
                    }
                });
        }
        draw_legend(&mut chart, SeriesLabelPosition::UpperLeft)?;
        root.present().map_err(err)?;
    }
    Ok(out)
}

/// The tail of one TTFT distribution per series: the fraction of requests whose TTFT is at
/// least x, both axes log-scaled (so p90 is at 0.1 and p99 at 0.01).
pub fn ccdfs_svg(title: &str, series: &[(String, Vec<f64>)]) -> anyhow::Result<String> {
    let (lo, hi) = log_bounds(series.iter().flat_map(|(_, v)| v.iter().copied()));
    let n_max = series
        .iter()
        .map(|(_, v)| v.len())
        .max()
        .unwrap_or(1)
        .max(1);
    let y_lo = (0.5 / n_max as f64).min(0.005);
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (960, 540)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(45)
            .y_label_area_size(60)
            .build_cartesian_2d((lo..hi).log_scale(), (y_lo..1.0).log_scale())
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc("TTFT (ms, log scale)")
            .x_labels(30)
            .x_label_formatter(&log_label)
            .y_desc("fraction of requests with TTFT ≥ x (log scale)")
            .y_labels(30)
            .y_label_formatter(&log_label)
            .light_line_style(WHITE)
            .draw()
            .map_err(err)?;
        for (k, (name, values)) in series.iter().enumerate() {
            let mut v: Vec<f64> = values.iter().map(|x| x.max(lo)).collect();
            v.sort_by(f64::total_cmp);
            let n = v.len() as f64;
            let pts = v.iter().enumerate().map(|(i, &x)| (x, (n - i as f64) / n));
            let c = color(k);
            chart
                .draw_series(LineSeries::new(pts, c.stroke_width(2)))
                .map_err(err)?
                .label(name.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2))
                });
        }
        draw_legend(&mut chart, SeriesLabelPosition::LowerLeft)?;
        root.present().map_err(err)?;
    }
    Ok(out)
}

/// A cross-run plot described in JSON (`{"kind": "percentiles", "title", "rows": [{label,
/// runs: [[p50, p90, p99], …]}]}` or `{"kind": "ccdf", "title", "series": [{label, values}]}`).
#[derive(Clone, Debug, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum PlotSpec {
    Percentiles {
        title: String,
        rows: Vec<PercentileRow>,
    },
    /// Drawn as the tail ([`ccdfs_svg`]).
    Ccdf {
        title: String,
        series: Vec<CdfSeries>,
    },
}

#[derive(Clone, Debug, Deserialize)]
pub struct CdfSeries {
    pub label: String,
    pub values: Vec<f64>,
}

impl PlotSpec {
    pub fn to_svg(&self) -> anyhow::Result<String> {
        match self {
            PlotSpec::Percentiles { title, rows } => percentiles_svg(title, rows),
            PlotSpec::Ccdf { title, series } => {
                let s: Vec<(String, Vec<f64>)> = series
                    .iter()
                    .map(|c| (c.label.clone(), c.values.clone()))
                    .collect();
                ccdfs_svg(title, &s)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::report::{Counts, Report, RequestRecord, RunMeta};
    use super::*;

    #[test]
    fn log_axis_labels() {
        assert_eq!(log_label(&100.0), "100");
        assert_eq!(log_label(&0.2), "0.2");
        assert_eq!(log_label(&5000.0), "5000");
        assert_eq!(log_label(&300.0), "");
    }

    #[test]
    fn plots_render_to_svg_with_text() {
        let recs: Vec<RequestRecord> = (0..40)
            .map(|i| RequestRecord {
                index: i,
                instance: Some(format!("e{}", i % 2)),
                sent_ms: i as f64 * 10.0,
                end_ms: i as f64 * 10.0 + 55.0,
                ttft_ms: Some(1.0 + i as f64),
                e2e_ms: Some(55.0),
                ..Default::default()
            })
            .collect();
        let r = Report::build(RunMeta::default(), Counts::default(), recs, vec![], 20.0);
        let a = ttft_cdf_svg(&r).unwrap();
        assert!(a.starts_with("<svg") && a.contains("TTFT CDF"), "{a:.300}");
        let texts: Vec<&str> = a
            .split("</text>")
            .filter_map(|t| t.rsplit('>').next())
            .map(str::trim)
            .collect();
        assert!(texts.contains(&"e1") && texts.contains(&"all"), "{texts:?}");
        let b = inflight_svg(&r).unwrap();
        assert!(b.contains("<svg") && b.contains("In-flight") && b.contains("<polyline"));
        // Cross-run plots.
        let spec: PlotSpec = serde_json::from_str(
            r#"{"kind": "percentiles", "title": "TTFT", "rows": [
                {"label": "tg-a", "runs": [[10, 50, 900], [12, 60, 1200], [11, 55, 1000]]},
                {"label": "smg-b", "runs": [[20, 40, 300]]}]}"#,
        )
        .unwrap();
        let p = spec.to_svg().unwrap();
        assert!(
            p.contains("tg-a") && p.contains("smg-b") && p.contains("p99"),
            "{p:.300}"
        );
        let spec: PlotSpec = serde_json::from_str(
            r#"{"kind": "ccdf", "title": "tail", "series": [
                {"label": "x", "values": [1, 2, 3]}, {"label": "y", "values": []}]}"#,
        )
        .unwrap();
        let c = spec.to_svg().unwrap();
        let texts: Vec<&str> = c
            .split("</text>")
            .filter_map(|t| t.rsplit('>').next())
            .map(str::trim)
            .collect();
        assert!(c.contains("<polyline") && texts.contains(&"x"), "{texts:?}");
        percentiles_svg("empty", &[]).unwrap();
        // An empty report still renders.
        let empty = Report::default();
        ttft_cdf_svg(&empty).unwrap();
        inflight_svg(&empty).unwrap();
    }
}
