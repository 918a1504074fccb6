//! SVG plots of bench tables (`bench --plot`, `report --plot`), one panel per figure:
//!
//! - overcommit: each variant's time over its own median at 1x (0 hogs), per hog count, each
//!   run a dot and its spread a bar (guest seconds when the table has no 0-hog case);
//! - scaling: time per acquisition against vCPUs, when the tables hold several vCPU counts
//!   (`report` over several saved benches);
//! - kick-to-wake: the ping-pong workload's latency percentiles, per variant (kick path).
//!
//! Axes name their units; a value axis spanning a decade or more is logarithmic.

use std::ops::Range;
use std::path::{Path, PathBuf};

use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint, Ranged};
use plotters::coord::Shift;
use plotters::prelude::*;

use crate::bench::{median_of, BenchTable, CaseResult};
use pvspin_test_vm::report::LatencySummary;

/// Why a plot could not be made.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// The tables hold no runs.
    #[error("nothing to plot: no runs")]
    Empty,
    /// plotters failed.
    #[error("drawing the plot: {0}")]
    Draw(#[from] DrawingAreaErrorKind<std::io::Error>),
    /// The file could not be written.
    #[error("writing {}: {source}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// A table to plot, with the name it goes by when there are several (`A`, a file name).
#[derive(Clone, Copy, Debug)]
pub struct Labelled<'a> {
    /// Its name in titles and legends; `None` for a plot of one table.
    pub label: Option<&'a str>,
    /// The table.
    pub table: &'a BenchTable,
}

/// Width of the picture, in pixels.
const WIDTH: u32 = 1000;
/// Height of one panel.
const PANEL_HEIGHT: u32 = 600;
/// Width of the legend beside each chart.
const LEGEND_WIDTH: u32 = 290;
/// Colours of the series: Okabe and Ito's colour-blind-safe set (without its yellow, too pale
/// on white), then more.
const PALETTE: [RGBColor; 12] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(230, 159, 0),
    RGBColor(86, 180, 233),
    RGBColor(0, 0, 0),
    RGBColor(136, 136, 136),
    RGBColor(117, 112, 179),
    RGBColor(166, 118, 29),
    RGBColor(102, 166, 30),
    RGBColor(231, 41, 138),
];

/// One series: a variant (or variant and hog count) in one panel.
#[derive(Clone, Debug, Default)]
struct Series {
    name: String,
    /// The medians, joined by a line.
    line: Vec<(f64, f64)>,
    /// Each run, a hollow dot.
    runs: Vec<(f64, f64)>,
    /// Each run's own line (percentile ladders), thin.
    run_lines: Vec<Vec<(f64, f64)>>,
    /// Fastest to slowest run at x: a bar.
    spreads: Vec<(f64, f64, f64)>,
    /// Medians of cases with runs stopped by the bound (counted as the bound, so the time is
    /// at least this): marked apart.
    bounded: Vec<(f64, f64)>,
}

/// One figure.
#[derive(Clone, Debug)]
struct Panel {
    title: String,
    subtitle: String,
    x_desc: String,
    y_desc: String,
    /// Category positions and names on the x axis.
    x_ticks: Vec<(f64, String)>,
    x_range: Range<f64>,
    series: Vec<Series>,
    /// A dashed level line (1 for ratios).
    reference_y: Option<f64>,
    /// What the marks mean, at the top of the legend.
    key: Vec<&'static str>,
}

/// The SVG of `tables`.
pub fn render_svg(tables: &[Labelled<'_>]) -> Result<String, PlotError> {
    render_panels(&panels(tables))
}

/// The SVG of A/B pairs of tables (`report --ab`): per pair, B's time over A's per row, then
/// A's and B's own figures.
pub fn render_ab_svg(pairs: &[(&BenchTable, &BenchTable)]) -> Result<String, PlotError> {
    let mut all = Vec::new();
    for (a, b) in pairs {
        all.extend(ab_panel(a, b));
        all.extend(panels(&[
            Labelled {
                label: Some("A"),
                table: a,
            },
            Labelled {
                label: Some("B"),
                table: b,
            },
        ]));
    }
    render_panels(&all)
}

fn render_panels(panels: &[Panel]) -> Result<String, PlotError> {
    if panels.is_empty() {
        return Err(PlotError::Empty);
    }
    let mut svg = String::new();
    {
        let height = PANEL_HEIGHT * u32::try_from(panels.len()).unwrap_or(1);
        let root = SVGBackend::with_string(&mut svg, (WIDTH, height)).into_drawing_area();
        root.fill(&WHITE)?;
        for (area, panel) in root.split_evenly((panels.len(), 1)).iter().zip(panels) {
            draw_panel(area, panel)?;
        }
        root.present()?;
    }
    Ok(svg)
}

/// The SVG of one ratio per category, each run a circle, e.g. a co-tenant's throughput
/// beside each kind of VM against a baseline (`categories`: name, the runs' ratios). The axis
/// shows each category's number, the legend its name.
pub fn render_ratios(
    title: &str,
    subtitle: &str,
    y_desc: &str,
    categories: &[(String, Vec<f64>)],
) -> Result<String, PlotError> {
    let series: Vec<Series> = categories
        .iter()
        .enumerate()
        .filter(|(_, (_, values))| !values.is_empty())
        .map(|(i, (name, values))| {
            let mut s = Series {
                name: format!("{}: {name}", i + 1),
                ..Series::default()
            };
            add_case(&mut s, i as f64, values.iter().copied());
            s
        })
        .collect();
    if series.is_empty() {
        return Err(PlotError::Empty);
    }
    render_panels(&[Panel {
        title: title.to_string(),
        subtitle: subtitle.to_string(),
        x_desc: "case (numbered as in the legend)".into(),
        y_desc: y_desc.to_string(),
        x_ticks: (0..categories.len())
            .map(|i| (i as f64, (i + 1).to_string()))
            .collect(),
        x_range: -0.5..categories.len() as f64 - 0.5,
        series,
        reference_y: Some(1.0),
        key: vec![
            "filled dot: median of the runs",
            "circle: one run",
            "bar: fastest to slowest run",
        ],
    }])
}

/// Writes `svg` (from [`render_svg`] or [`render_ab_svg`]) to the file `path`.
pub fn write(path: &Path, svg: &str) -> Result<(), PlotError> {
    std::fs::write(path, svg).map_err(|source| PlotError::Write {
        path: path.to_owned(),
        source,
    })
}

/// The figures `tables` make: per table its overcommit figure (when it has several hog counts,
/// or nothing else to show), the scaling figure across tables with several vCPU counts, per
/// table with ping-pong runs its kick-to-wake figure.
fn panels(tables: &[Labelled<'_>]) -> Vec<Panel> {
    let tables: Vec<Labelled<'_>> = tables
        .iter()
        .map(|t| Labelled {
            label: t.label,
            table: t.table,
        })
        .filter(|t| t.table.cases.iter().any(|c| !c.seconds.is_empty()))
        .collect();
    let scaling = scaling_panel(&tables);
    let mut out = Vec::new();
    let mut latency = Vec::new();
    for t in &tables {
        let ping = latency_panel(*t);
        let several_hogs = distinct(t.table.cases.iter().map(|c| c.hogs)).len() > 1;
        let in_scaling = scaling.is_some() && t.table.workload == "lock";
        if several_hogs || (ping.is_none() && !in_scaling) {
            out.push(overcommit_panel(*t));
        }
        latency.extend(ping);
    }
    out.extend(scaling);
    out.extend(latency);
    out
}

/// `items` without repeats, in first-seen order.
fn distinct<T: PartialEq>(items: impl IntoIterator<Item = T>) -> Vec<T> {
    let mut out = Vec::new();
    for item in items {
        if !out.contains(&item) {
            out.push(item);
        }
    }
    out
}

/// Offset of series `j` of `n` around a category, so their marks sit side by side.
fn dodge(j: usize, n: usize, width: f64) -> f64 {
    if n < 2 {
        0.0
    } else {
        width * (j as f64 / (n - 1) as f64 - 0.5)
    }
}

fn prefixed(label: Option<&str>, text: &str) -> String {
    label.map_or_else(|| text.to_string(), |l| format!("{l}: {text}"))
}

/// Time over own 1x per variant at each hog count (guest seconds without a 0-hog case).
fn overcommit_panel(t: Labelled<'_>) -> Panel {
    let table = t.table;
    let hogs = distinct(table.cases.iter().map(|c| c.hogs));
    let variants = distinct(table.cases.iter().map(|c| c.variant));
    let relative = hogs.len() > 1 && variants.iter().all(|v| table.own_1x_median(v).is_some());
    let mut series = Vec::new();
    for (j, variant) in variants.iter().enumerate() {
        let scale = if relative {
            table.own_1x_median(variant).unwrap_or(1.0)
        } else {
            1.0
        };
        let mut s = Series {
            name: variant.name(),
            ..Series::default()
        };
        for (i, h) in hogs.iter().enumerate() {
            let Some(case) = table
                .cases
                .iter()
                .find(|c| c.hogs == *h && c.variant == *variant && !c.seconds.is_empty())
            else {
                continue;
            };
            let x = i as f64 + dodge(j, variants.len(), 0.5);
            add_case(&mut s, x, case.seconds.iter().map(|v| v / scale));
            mark_bounded(&mut s, case);
        }
        series.push(s);
    }
    let stopped: u32 = table.cases.iter().map(|c| c.timed_out).sum();
    Panel {
        title: prefixed(
            t.label,
            if relative {
                "Overcommit: each variant's time over its own time at 1x (0 hogs)"
            } else {
                "Guest time per variant"
            },
        ),
        subtitle: format!(
            "{}{}",
            table.title,
            if stopped > 0 {
                format!("; {stopped} runs stopped by the bound count as the bound")
            } else {
                String::new()
            }
        ),
        x_desc: "case: host load = (vCPUs + hog threads) / host CPUs".into(),
        y_desc: if relative {
            "time / own median at 1x (T/T1x, ratio)".into()
        } else {
            "guest time (s)".into()
        },
        x_ticks: hogs
            .iter()
            .enumerate()
            .map(|(i, h)| (i as f64, table.case_label(*h)))
            .collect(),
        x_range: -0.5..hogs.len() as f64 - 0.5,
        series,
        reference_y: relative.then_some(1.0),
        key: vec![
            "line: median of the runs",
            "circle: one run",
            "bar: fastest to slowest run",
        ],
    }
}

/// Marks the median `add_case` just added when some of `case`'s runs were stopped by the bound.
fn mark_bounded(s: &mut Series, case: &CaseResult) {
    if case.timed_out > 0 {
        s.bounded.extend(s.line.last().copied());
    }
}

/// A case's runs at `x`: its median on the line, each run, the spread.
fn add_case(s: &mut Series, x: f64, values: impl Iterator<Item = f64>) {
    let values: Vec<f64> = values.collect();
    let (lo, hi) = values
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
            (lo.min(*v), hi.max(*v))
        });
    s.line.push((x, median_of(&values)));
    s.runs.extend(values.iter().map(|v| (x, *v)));
    if values.len() > 1 {
        s.spreads.push((x, lo, hi));
    }
}

/// B's time over A's per row: each B run over A's median, the line through B's median over
/// A's median; rows both ran.
fn ab_panel(a: &BenchTable, b: &BenchTable) -> Option<Panel> {
    let hogs = distinct(a.cases.iter().map(|c| c.hogs));
    let variants = distinct(a.cases.iter().map(|c| c.variant.name()));
    let find = |t: &BenchTable, h: u32, v: &str| {
        t.cases
            .iter()
            .find(|c| c.hogs == h && c.variant.name() == v && !c.seconds.is_empty())
            .cloned()
    };
    let mut series = Vec::new();
    for (j, variant) in variants.iter().enumerate() {
        let mut s = Series {
            name: variant.clone(),
            ..Series::default()
        };
        for (i, h) in hogs.iter().enumerate() {
            let (Some(ca), Some(cb)) = (find(a, *h, variant), find(b, *h, variant)) else {
                continue;
            };
            let base = ca.median();
            if base <= 0.0 {
                continue;
            }
            let x = i as f64 + dodge(j, variants.len(), 0.5);
            add_case(&mut s, x, cb.seconds.iter().map(|v| v / base));
            mark_bounded(&mut s, &cb);
        }
        if !s.line.is_empty() {
            series.push(s);
        }
    }
    if series.is_empty() {
        return None;
    }
    Some(Panel {
        title: "A/B: B's time over A's, per row".into(),
        subtitle: format!("A: {} | B: {}", a.title, b.title),
        x_desc: "case: host load = (vCPUs + hog threads) / host CPUs (A's)".into(),
        y_desc: "B / A median (ratio, below 1: B is faster)".into(),
        x_ticks: hogs
            .iter()
            .enumerate()
            .map(|(i, h)| (i as f64, a.case_label(*h)))
            .collect(),
        x_range: -0.5..hogs.len() as f64 - 0.5,
        series,
        reference_y: Some(1.0),
        key: vec![
            "line: B's median / A's median",
            "circle: one B run / A's median",
            "bar: fastest to slowest B run",
        ],
    })
}

/// Time per acquisition against vCPUs, across lock-workload tables of several vCPU counts.
fn scaling_panel(tables: &[Labelled<'_>]) -> Option<Panel> {
    let locks: Vec<&Labelled<'_>> = tables
        .iter()
        .filter(|t| t.table.workload == "lock" && t.table.iterations > 0)
        .collect();
    let mut vcpus = distinct(locks.iter().map(|t| t.table.vcpus));
    if vcpus.len() < 2 {
        return None;
    }
    vcpus.sort_unstable();
    let all_hogs = distinct(
        locks
            .iter()
            .flat_map(|t| t.table.cases.iter().map(|c| c.hogs)),
    );
    // One series per (table group, variant, hogs): the same variant in several files is one
    // line over vCPUs, unless the files are A and B.
    let key = |t: &Labelled<'_>, c: &CaseResult| {
        let group = match t.label {
            Some(l @ ("A" | "B")) => format!("{l}: "),
            _ => String::new(),
        };
        let hogs = if all_hogs.len() > 1 {
            format!(", {} hogs", c.hogs)
        } else {
            String::new()
        };
        format!("{group}{}{hogs}", c.variant.name())
    };
    let names = distinct(
        locks
            .iter()
            .flat_map(|t| t.table.cases.iter().map(move |c| key(t, c))),
    );
    let gap = vcpus
        .windows(2)
        .map(|w| f64::from(w[1] - w[0]))
        .fold(f64::INFINITY, f64::min);
    let mut series: Vec<Series> = names
        .iter()
        .map(|name| Series {
            name: name.clone(),
            ..Series::default()
        })
        .collect();
    // Microseconds, or nanoseconds when no run takes a microsecond per acquisition.
    let per_acquisition = |t: &Labelled<'_>, seconds: f64| {
        seconds / (f64::from(t.table.vcpus) * t.table.iterations as f64)
    };
    let slowest = locks
        .iter()
        .flat_map(|t| {
            t.table
                .cases
                .iter()
                .flat_map(|c| c.seconds.iter().map(|s| per_acquisition(t, *s)))
        })
        .fold(0.0, f64::max);
    let (unit, scale) = if slowest < 1e-6 {
        ("ns", 1e9)
    } else {
        ("µs", 1e6)
    };
    for t in &locks {
        for case in t.table.cases.iter().filter(|c| !c.seconds.is_empty()) {
            let j = names.iter().position(|n| *n == key(t, case)).unwrap_or(0);
            let x = f64::from(t.table.vcpus) + dodge(j, names.len(), gap * 0.4);
            add_case(
                &mut series[j],
                x,
                case.seconds.iter().map(|s| per_acquisition(t, *s) * scale),
            );
            mark_bounded(&mut series[j], case);
        }
    }
    for s in &mut series {
        s.line.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    let (first, last) = (f64::from(vcpus[0]), f64::from(vcpus[vcpus.len() - 1]));
    Some(Panel {
        title: "Scaling: time per lock acquisition against vCPUs".into(),
        subtitle: format!(
            "guest time / (vCPUs x acquisitions per vCPU); {} benches, the first: {}",
            locks.len(),
            locks.first().map_or("", |t| t.table.title.as_str())
        ),
        x_desc: "vCPUs".into(),
        y_desc: format!("time per acquisition ({unit})"),
        x_ticks: vcpus
            .iter()
            .map(|v| (f64::from(*v), v.to_string()))
            .collect(),
        x_range: first - gap * 0.5..last + gap * 0.5,
        series,
        reference_y: None,
        key: vec![
            "line: median of the runs",
            "circle: one run",
            "bar: fastest to slowest run",
        ],
    })
}

/// Kick-to-wake percentiles per variant, for a table with ping-pong runs.
fn latency_panel(t: Labelled<'_>) -> Option<Panel> {
    let table = t.table;
    let cases: Vec<&CaseResult> = table
        .cases
        .iter()
        .filter(|c| !c.kick_to_wake.is_empty())
        .collect();
    if cases.is_empty() {
        return None;
    }
    let several_hogs = distinct(cases.iter().map(|c| c.hogs)).len() > 1;
    let series = cases
        .iter()
        .map(|case| {
            let ladder = |l: &LatencySummary| -> Vec<(f64, f64)> {
                l.percentiles()
                    .iter()
                    .enumerate()
                    .map(|(i, v)| (i as f64, *v))
                    .collect()
            };
            let medians = case.kick_to_wake_medians().unwrap_or_default();
            Series {
                name: if several_hogs {
                    format!("{}, {} hogs", case.variant.name(), case.hogs)
                } else {
                    case.variant.name()
                },
                line: medians
                    .iter()
                    .enumerate()
                    .map(|(i, v)| (i as f64, *v))
                    .collect(),
                runs: case.kick_to_wake.iter().flat_map(ladder).collect(),
                run_lines: case.kick_to_wake.iter().map(ladder).collect(),
                spreads: Vec::new(),
                bounded: Vec::new(),
            }
        })
        .collect();
    let samples: usize = cases
        .iter()
        .flat_map(|c| c.kick_to_wake.iter().map(|l| l.samples))
        .sum();
    Some(Panel {
        title: prefixed(t.label, "Kick-to-wake latency per kick path"),
        subtitle: format!("{}; {samples} samples in all", table.title),
        x_desc: "percentile of the run's samples".into(),
        y_desc: "kick-to-wake latency (µs)".into(),
        x_ticks: LatencySummary::PERCENTILE_NAMES
            .iter()
            .enumerate()
            .map(|(i, n)| (i as f64, (*n).to_string()))
            .collect(),
        x_range: -0.3..4.3,
        series,
        reference_y: None,
        key: vec!["thick line: median of the runs", "thin line: one run"],
    })
}

/// Every y value of the panel.
fn y_values(panel: &Panel) -> impl Iterator<Item = f64> + '_ {
    panel
        .series
        .iter()
        .flat_map(|s| {
            s.line
                .iter()
                .chain(&s.runs)
                .chain(s.run_lines.iter().flatten())
                .map(|p| p.1)
                .chain(s.spreads.iter().flat_map(|p| [p.1, p.2]))
        })
        .chain(panel.reference_y)
        .filter(|v| v.is_finite())
}

/// An axis with the ticks this module picks, linear or logarithmic (plotters' own f64 axes
/// with fixed ticks give up their label formatting).
#[derive(Clone, Debug)]
struct Axis {
    range: Range<f64>,
    /// Ticks with labels and grid lines.
    ticks: Vec<f64>,
    /// Fainter grid lines.
    minor: Vec<f64>,
    log: bool,
}

impl Ranged for Axis {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        let (start, end, v) = if self.log {
            let ln = |v: f64| v.max(f64::MIN_POSITIVE).ln();
            (ln(self.range.start), ln(self.range.end), ln(*value))
        } else {
            (self.range.start, self.range.end, *value)
        };
        let fraction = if end > start {
            (v - start) / (end - start)
        } else {
            0.5
        };
        limit.0 + (f64::from(limit.1 - limit.0) * fraction).round() as i32
    }

    fn key_points<Hint: KeyPointHint>(&self, hint: Hint) -> Vec<f64> {
        if hint.weight().allow_light_points() {
            self.minor.clone()
        } else {
            self.ticks.clone()
        }
    }

    fn range(&self) -> Range<f64> {
        self.range.clone()
    }
}

fn y_axis(panel: &Panel) -> Axis {
    let (lo, hi) = y_values(panel).fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if !lo.is_finite() {
        return Axis {
            range: 0.0..1.0,
            ticks: vec![0.0, 0.5, 1.0],
            minor: Vec::new(),
            log: false,
        };
    }
    if lo > 0.0 && hi / lo >= 10.0 {
        // A decade or more: logarithmic, ticks at 1, 2, 5 times powers of ten.
        let range = lo / 1.3..hi * 1.3;
        let decades = || {
            let first = range.start.log10().floor() as i32;
            let last = range.end.log10().ceil() as i32;
            (first..=last).map(|e| 10f64.powi(e))
        };
        let within = |v: &f64| range.contains(v);
        let mut ticks: Vec<f64> = decades()
            .flat_map(|d| [d, 2.0 * d, 5.0 * d])
            .filter(within)
            .collect();
        if ticks.len() > 12 {
            ticks = decades().filter(within).collect();
        }
        let minor = decades()
            .flat_map(|d| (1..10).map(move |m| f64::from(m) * d))
            .filter(within)
            .collect();
        return Axis {
            range,
            ticks,
            minor,
            log: true,
        };
    }
    let start = if lo >= 0.0 { 0.0 } else { lo * 1.1 };
    let end = if hi > 0.0 { hi * 1.1 } else { 1.0 };
    let raw = (end - start) / 6.0;
    let magnitude = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|s| *s >= raw)
        .unwrap_or(raw);
    let ticks = (0..)
        .map(|i| (start / step).ceil() * step + f64::from(i) * step)
        .take_while(|v| *v <= end + step * 1e-9)
        .take(50)
        .collect();
    Axis {
        range: start..end,
        ticks,
        minor: Vec::new(),
        log: false,
    }
}

/// A tick's label: at most 3 significant digits, no trailing zeros; thousands grouped from
/// 10,000 up (log axes of latencies reach millions of µs).
fn tick_label(v: f64) -> String {
    if v == 0.0 {
        return "0".into();
    }
    if v.abs() >= 10_000.0 {
        let digits = format!("{:.0}", v.abs());
        let mut grouped = String::new();
        for (i, c) in digits.chars().enumerate() {
            if i > 0 && (digits.len() - i) % 3 == 0 {
                grouped.push(',');
            }
            grouped.push(c);
        }
        return if v < 0.0 {
            format!("-{grouped}")
        } else {
            grouped
        };
    }
    let decimals = (2 - v.abs().log10().floor() as i32).max(0) as usize;
    let text = format!("{v:.decimals$}");
    if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        text
    }
}

fn draw_panel(area: &DrawingArea<SVGBackend<'_>, Shift>, panel: &Panel) -> Result<(), PlotError> {
    let area = area.margin(12, 8, 16, 12);
    let subtitle = wrap(&panel.subtitle, SUBTITLE_CHARS, &[' ']);
    let shown = subtitle.len().min(3);
    let (head, body) = area.split_vertically(40 + 17 * shown as u32);
    head.draw(&Text::new(
        panel.title.clone(),
        (0, 2),
        ("sans-serif", 21).into_font().style(FontStyle::Bold),
    ))?;
    for (i, line) in subtitle.iter().take(shown).enumerate() {
        let mut line = line.clone();
        if i + 1 == shown && subtitle.len() > shown {
            line.push_str(" ...");
        }
        head.draw(&Text::new(
            line,
            (0, 32 + 17 * i as i32),
            ("sans-serif", 13).into_font().color(&BLACK.mix(0.75)),
        ))?;
    }
    let chart_width = body.dim_in_pixel().0.saturating_sub(LEGEND_WIDTH);
    let (chart_area, legend_area) = body.split_horizontally(chart_width);
    let x = Axis {
        range: panel.x_range.clone(),
        ticks: panel.x_ticks.iter().map(|t| t.0).collect(),
        minor: Vec::new(),
        log: false,
    };
    let y = y_axis(panel);
    let mut chart = ChartBuilder::on(&chart_area)
        .margin_right(16)
        .margin_top(8)
        .x_label_area_size(56)
        .y_label_area_size(78)
        .build_cartesian_2d(x, y)?;
    let x_label = |v: &f64| {
        panel
            .x_ticks
            .iter()
            .find(|t| (t.0 - v).abs() < 1e-9)
            .map_or(String::new(), |t| t.1.clone())
    };
    let y_label = |v: &f64| tick_label(*v);
    chart
        .configure_mesh()
        .x_desc(panel.x_desc.as_str())
        .y_desc(panel.y_desc.as_str())
        .x_label_formatter(&x_label)
        .y_label_formatter(&y_label)
        .axis_desc_style(("sans-serif", 15))
        .label_style(("sans-serif", 13))
        .bold_line_style(BLACK.mix(0.12))
        .light_line_style(BLACK.mix(0.05))
        .draw()?;
    if let Some(level) = panel.reference_y {
        let (x0, x1) = (panel.x_range.start, panel.x_range.end);
        chart.draw_series(DashedLineSeries::new(
            [(x0, level), (x1, level)],
            6,
            4,
            BLACK.mix(0.45).stroke_width(1),
        ))?;
    }
    for (i, s) in panel.series.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        for run in &s.run_lines {
            chart.draw_series(LineSeries::new(
                run.iter().copied(),
                color.mix(0.35).stroke_width(1),
            ))?;
        }
        chart.draw_series(s.spreads.iter().map(|(x, lo, hi)| {
            PathElement::new(vec![(*x, *lo), (*x, *hi)], color.mix(0.55).stroke_width(2))
        }))?;
        chart.draw_series(LineSeries::new(
            s.line.iter().copied(),
            color.stroke_width(if s.run_lines.is_empty() { 2 } else { 3 }),
        ))?;
        chart.draw_series(
            s.runs
                .iter()
                .map(|p| Circle::new(*p, 3, color.mix(0.8).stroke_width(1))),
        )?;
        chart.draw_series(s.line.iter().map(|p| Circle::new(*p, 5, color.filled())))?;
        chart.draw_series(
            s.bounded
                .iter()
                .map(|p| TriangleMarker::new(*p, 9, color.stroke_width(2))),
        )?;
    }
    draw_legend(&legend_area, panel)
}

/// The legend, beside the chart: what the marks mean, then one line per series.
fn draw_legend(area: &DrawingArea<SVGBackend<'_>, Shift>, panel: &Panel) -> Result<(), PlotError> {
    let mut y = 14;
    let bounded = panel.series.iter().any(|s| !s.bounded.is_empty());
    let bound_key = "triangle: runs stopped by the bound, time is at least this";
    for key in panel.key.iter().chain(bounded.then_some(&bound_key)) {
        area.draw(&Text::new(
            (*key).to_string(),
            (4, y),
            ("sans-serif", 12).into_font().color(&BLACK.mix(0.7)),
        ))?;
        y += 17;
    }
    y += 12;
    for (i, s) in panel.series.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let mid = y + 7;
        area.draw(&PathElement::new(
            vec![(4, mid), (30, mid)],
            color.stroke_width(3),
        ))?;
        area.draw(&Circle::new((17, mid), 5, color.filled()))?;
        for line in wrap(&s.name, LEGEND_CHARS, &[',', '@', ':', '/', ' ']) {
            area.draw(&Text::new(line, (38, y), ("sans-serif", 13).into_font()))?;
            y += 16;
        }
        y += 6;
    }
    Ok(())
}

/// Characters of a subtitle line (13 px sans-serif, about 6.5 px each).
const SUBTITLE_CHARS: usize = 140;
/// Characters of a legend line.
const LEGEND_CHARS: usize = 34;

/// `text` in lines of at most `width` characters, broken after one of `breaks` where it can
/// be (a word longer than a line is cut).
fn wrap(text: &str, width: usize, breaks: &[char]) -> Vec<String> {
    let mut lines = Vec::new();
    let mut rest: Vec<char> = text.chars().collect();
    while rest.len() > width {
        let cut = (1..=width)
            .rev()
            .find(|&i| breaks.contains(&rest[i - 1]))
            .unwrap_or(width);
        let line: String = rest.drain(..cut).collect();
        lines.push(line.trim_end().to_string());
        while rest.first() == Some(&' ') {
            rest.remove(0);
        }
    }
    if !rest.is_empty() || lines.is_empty() {
        lines.push(rest.into_iter().collect());
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_names_wrap_at_their_separators() {
        assert_eq!(wrap("short", 10, &[' ']), ["short"]);
        assert_eq!(
            wrap(
                "queued:kick/slots:signal-msi@stock, 2 hogs",
                36,
                &[',', ':']
            ),
            ["queued:kick/slots:signal-msi@stock,", "2 hogs"]
        );
        assert_eq!(wrap("abcdefghij", 4, &[' ']), ["abcd", "efgh", "ij"]);
    }

    #[test]
    fn runs_stopped_by_the_bound_are_marked_apart() {
        let case = |hogs, seconds: &[f64], timed_out| CaseResult {
            seconds: seconds.to_vec(),
            timed_out,
            ..CaseResult::new(hogs, crate::bench::Variant::parse("ticket:off").unwrap())
        };
        let table = BenchTable::for_tests(
            1,
            10,
            vec![case(0, &[1.0, 1.2], 0), case(2, &[4.0, 20.0], 1)],
        );
        let labelled = [Labelled {
            label: None,
            table: &table,
        }];
        let svg = render_svg(&labelled).unwrap();
        assert!(svg.contains("triangle: runs stopped by the bound"), "{svg}");
        assert_eq!(panels(&labelled)[0].series[0].bounded.len(), 1);
        let unbounded = BenchTable {
            cases: vec![case(0, &[1.0], 0), case(2, &[4.0], 0)],
            ..table.clone()
        };
        let svg = render_svg(&[Labelled {
            label: None,
            table: &unbounded,
        }])
        .unwrap();
        assert!(!svg.contains("triangle:"), "{svg}");
    }

    #[test]
    fn ticks_read_well() {
        assert_eq!(tick_label(0.0), "0");
        assert_eq!(tick_label(0.05), "0.05");
        assert_eq!(tick_label(2.5), "2.5");
        assert_eq!(tick_label(1500.0), "1500");
        assert_eq!(tick_label(10_000.0), "10,000");
        assert_eq!(tick_label(1_000_000.0), "1,000,000");
        assert_eq!(tick_label(-250_000.0), "-250,000");
        assert_eq!(tick_label(1.0), "1");
    }
}
