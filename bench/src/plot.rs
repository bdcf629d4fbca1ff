//! PNG plots with plotters' bitmap backend. Text needs a TrueType font: the
//! first of a few usual system paths (Debian's fonts-dejavu-core) is loaded
//! at run time; without one the plots are drawn without any text.

use std::path::Path;
use std::sync::OnceLock;

use plotters::coord::combinators::IntoLogRange;
use plotters::prelude::*;

use crate::loadgen::LoadSample;

const FONT_PATHS: [&str; 4] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
];

/// Whether a font could be registered (once per process).
fn has_font() -> bool {
    static FONT: OnceLock<bool> = OnceLock::new();
    *FONT.get_or_init(|| {
        for path in FONT_PATHS {
            if let Ok(bytes) = std::fs::read(path) {
                // plotters keeps the font for the whole process.
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return true;
                }
            }
        }
        eprintln!("no TrueType font found (apt-get install fonts-dejavu-core): plots are drawn without text");
        false
    })
}

fn err<E: std::fmt::Display>(e: E) -> String {
    format!("plot: {e}")
}

/// The series' legend box, at `position`.
fn legend<'a, DB: DrawingBackend + 'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
    position: SeriesLabelPosition,
) -> Result<(), String> {
    chart
        .configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)
}

fn color(i: usize) -> RGBColor {
    const COLORS: [RGBColor; 10] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
        RGBColor(188, 189, 34),
        RGBColor(23, 190, 207),
    ];
    COLORS[i % COLORS.len()]
}

/// One panel of [`rank_tokens`]: load samples and a caption.
pub struct RankPanel<'a> {
    pub samples: &'a [LoadSample],
    pub caption: String,
}

/// Tokens per rank over time, panels side by side, same axes.
pub fn rank_tokens(path: &Path, panels: &[RankPanel], dp_size: usize) -> Result<(), String> {
    let text = has_font();
    let root = BitMapBackend::new(path, (800 * panels.len() as u32, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let x_max = panels
        .iter()
        .flat_map(|p| p.samples.iter().map(|s| s.t_s))
        .fold(1.0, f64::max);
    let y_max = panels
        .iter()
        .flat_map(|p| p.samples.iter().flat_map(|s| s.tokens.iter().copied()))
        .max()
        .unwrap_or(1)
        .max(1) as f64
        * 1.05;
    let areas = root.split_evenly((1, panels.len()));
    for (panel, area) in panels.iter().zip(areas.iter()) {
        let mut builder = ChartBuilder::on(area);
        builder.margin(12).x_label_area_size(40).y_label_area_size(70);
        if text {
            builder.caption(&panel.caption, ("sans-serif", 20));
        }
        let mut chart = builder
            .build_cartesian_2d(0f64..x_max, 0f64..y_max)
            .map_err(err)?;
        let mut mesh = chart.configure_mesh();
        if text {
            mesh.x_desc("simulated seconds")
                .y_desc("tokens on the rank (polled /v1/loads)")
                .x_label_formatter(&|v| format!("{v:.0}"))
                .y_label_formatter(&|v| format!("{v:.0}"));
        } else {
            mesh.x_labels(0).y_labels(0);
        }
        mesh.draw().map_err(err)?;
        let ranks = panel.samples.first().map_or(0, |s| s.tokens.len());
        for rank in 0..ranks {
            let c = color(rank);
            let points = panel
                .samples
                .iter()
                .filter_map(|s| s.tokens.get(rank).map(|t| (s.t_s, *t as f64)));
            let series = chart
                .draw_series(LineSeries::new(points, c.stroke_width(2)))
                .map_err(err)?;
            if text {
                let label = format!("worker {} rank {}", rank / dp_size.max(1), rank % dp_size.max(1));
                series
                    .label(label)
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
            }
        }
        if text {
            legend(&mut chart, SeriesLabelPosition::UpperRight)?;
        }
    }
    root.present().map_err(err)
}

/// Empirical CDFs on a log x axis, one line per series.
pub fn cdf(path: &Path, title: &str, x_desc: &str, series: &[(String, Vec<f64>)]) -> Result<(), String> {
    let text = has_font();
    let root = BitMapBackend::new(path, (1200, 700)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let positive = || {
        series
            .iter()
            .flat_map(|(_, v)| v.iter().copied())
            .filter(|v| *v > 0.0)
    };
    let lo = positive().fold(f64::INFINITY, f64::min);
    let hi = positive().fold(0.0, f64::max);
    let (lo, hi) = if lo.is_finite() && hi > lo {
        (lo * 0.9, hi * 1.1)
    } else {
        (1.0, 10.0)
    };
    let mut builder = ChartBuilder::on(&root);
    builder.margin(15).x_label_area_size(45).y_label_area_size(60);
    if text {
        builder.caption(title, ("sans-serif", 22));
    }
    let mut chart = builder
        .build_cartesian_2d((lo..hi).log_scale(), 0f64..1.0)
        .map_err(err)?;
    let mut mesh = chart.configure_mesh();
    if text {
        mesh.x_desc(x_desc)
            .y_desc("fraction of requests")
            .x_label_formatter(&|v| format!("{v:.0}"));
    } else {
        mesh.x_labels(0).y_labels(0);
    }
    mesh.draw().map_err(err)?;
    for (i, (name, values)) in series.iter().enumerate() {
        let mut sorted: Vec<f64> = values.iter().copied().filter(|v| *v > 0.0).collect();
        sorted.sort_by(|a, b| a.total_cmp(b));
        let n = sorted.len().max(1) as f64;
        let c = color(i);
        let points = sorted.iter().enumerate().map(|(k, v)| (*v, (k + 1) as f64 / n));
        let drawn = chart
            .draw_series(LineSeries::new(points, c.stroke_width(2)))
            .map_err(err)?;
        if text {
            drawn
                .label(name.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        }
    }
    if text {
        legend(&mut chart, SeriesLabelPosition::LowerRight)?;
    }
    root.present().map_err(err)
}

/// Lines of (x, y) points, one per series; `log_y` for latencies. Used for
/// the sweep: a metric against the offered load.
pub fn lines(
    path: &Path,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[(String, Vec<(f64, f64)>)],
    log_y: bool,
) -> Result<(), String> {
    let text = has_font();
    let root = BitMapBackend::new(path, (1000, 650)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let points = || {
        series
            .iter()
            .flat_map(|(_, p)| p.iter().copied())
            .filter(|(x, y)| x.is_finite() && y.is_finite())
    };
    let (x_lo, x_hi) = points().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), (x, _)| {
        (lo.min(x), hi.max(x))
    });
    let (x_lo, x_hi) = if x_lo < x_hi {
        (x_lo - 0.03, x_hi + 0.03)
    } else {
        (0.0, 1.0)
    };
    let positive = points().map(|(_, y)| y).filter(|y| *y > 0.0);
    let y_hi = positive.clone().fold(0.0, f64::max);
    let y_lo = positive.fold(f64::INFINITY, f64::min);
    // A log axis over less than a decade gets no labels: linear then.
    let log_y = log_y && y_hi >= 10.0 * y_lo;
    let y_desc = if log_y {
        y_desc.to_string()
    } else {
        y_desc.replace(" (log)", "")
    };
    let mut builder = ChartBuilder::on(&root);
    builder.margin(15).x_label_area_size(45).y_label_area_size(70);
    if text {
        builder.caption(title, ("sans-serif", 22));
    }
    macro_rules! draw {
        ($chart:expr) => {{
            let mut chart = $chart;
            let x_label = |v: &f64| format!("{:.0}%", v * 100.0);
            let y_label = |v: &f64| {
                if log_y || *v >= 10.0 {
                    format!("{v:.0}")
                } else {
                    format!("{v:.2}")
                }
            };
            let mut mesh = chart.configure_mesh();
            if text {
                mesh.x_desc(x_desc)
                    .y_desc(y_desc)
                    .x_label_formatter(&x_label)
                    .y_label_formatter(&y_label);
            } else {
                mesh.x_labels(0).y_labels(0);
            }
            mesh.draw().map_err(err)?;
            for (i, (name, pts)) in series.iter().enumerate() {
                let c = color(i);
                let pts: Vec<(f64, f64)> = pts
                    .iter()
                    .copied()
                    .filter(|(x, y)| x.is_finite() && y.is_finite() && (!log_y || *y > 0.0))
                    .collect();
                chart
                    .draw_series(pts.iter().map(|p| Circle::new(*p, 4, c.filled())))
                    .map_err(err)?;
                let drawn = chart
                    .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
                    .map_err(err)?;
                if text {
                    drawn
                        .label(name.clone())
                        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
                }
            }
            if text {
                legend(&mut chart, SeriesLabelPosition::UpperLeft)?;
            }
        }};
    }
    if log_y {
        let (lo, hi) = if y_lo.is_finite() && y_hi > y_lo {
            (y_lo * 0.8, y_hi * 1.25)
        } else {
            (1.0, 10.0)
        };
        draw!(builder
            .build_cartesian_2d(x_lo..x_hi, (lo..hi).log_scale())
            .map_err(err)?);
    } else {
        let hi = if y_hi > 0.0 { y_hi * 1.05 } else { 1.0 };
        draw!(builder.build_cartesian_2d(x_lo..x_hi, 0f64..hi).map_err(err)?);
    }
    root.present().map_err(err)
}

/// One point of [`ratios`]: a median ratio and its interval at `x`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RatioPoint {
    pub x: f64,
    pub median: f64,
    pub lo: f64,
    pub hi: f64,
}

/// Ratios with their intervals against a small integer x (gateways), one
/// line per series, each series nudged sideways so the bars do not overlap;
/// `targets` are drawn as black bars (the most a ratio may reach there).
/// Intervals reaching above `y_max` are cut there and their top written
/// beside them, so one wide interval does not flatten the rest.
pub fn ratios(
    path: &Path,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[(String, Vec<RatioPoint>)],
    targets: &[(f64, f64)],
    y_max: f64,
) -> Result<(), String> {
    let text = has_font();
    let root = BitMapBackend::new(path, (1000, 650)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let finite =
        |p: &&RatioPoint| p.x.is_finite() && p.median.is_finite() && p.lo.is_finite() && p.hi.is_finite();
    let all = || series.iter().flat_map(|(_, p)| p.iter()).filter(finite);
    let x_hi = all()
        .map(|p| p.x)
        .chain(targets.iter().map(|t| t.0))
        .fold(1.0, f64::max);
    let y_hi = all()
        .map(|p| p.hi)
        .chain(targets.iter().map(|t| t.1))
        .fold(1.0, f64::max)
        .min(y_max);
    let y_lo = all().map(|p| p.lo).fold(1.0, f64::min);
    let mut builder = ChartBuilder::on(&root);
    builder.margin(15).x_label_area_size(45).y_label_area_size(70);
    if text {
        builder.caption(title, ("sans-serif", 22));
    }
    let mut chart = builder
        .build_cartesian_2d(0.5..x_hi + 0.5, (y_lo - 0.05).min(0.95)..y_hi + 0.05)
        .map_err(err)?;
    let mut mesh = chart.configure_mesh();
    if text {
        mesh.x_desc(x_desc)
            .y_desc(y_desc)
            .x_label_formatter(&|v: &f64| format!("{v:.0}"));
    } else {
        mesh.x_labels(0).y_labels(0);
    }
    mesh.draw().map_err(err)?;
    let width = 0.5 / series.len().max(1) as f64;
    for (i, (name, points)) in series.iter().enumerate() {
        let c = color(i);
        let nudge = (i as f64 - (series.len() as f64 - 1.0) / 2.0) * width;
        let points: Vec<RatioPoint> = points.iter().filter(finite).copied().collect();
        chart
            .draw_series(points.iter().map(|p| {
                ErrorBar::new_vertical(
                    p.x + nudge,
                    p.lo.min(y_hi),
                    p.median.min(y_hi),
                    p.hi.min(y_hi),
                    c.filled(),
                    10,
                )
            }))
            .map_err(err)?;
        if text {
            chart
                .draw_series(points.iter().filter(|p| p.hi > y_hi).map(|p| {
                    Text::new(
                        format!("to {:.1}", p.hi),
                        (p.x + nudge + 0.05, y_hi),
                        ("sans-serif", 14).into_font().color(&c),
                    )
                }))
                .map_err(err)?;
        }
        let drawn = chart
            .draw_series(LineSeries::new(
                points.iter().map(|p| (p.x + nudge, p.median)),
                c.stroke_width(2),
            ))
            .map_err(err)?;
        if text {
            drawn
                .label(name.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        }
    }
    let drawn = chart
        .draw_series(
            targets
                .iter()
                .map(|(x, y)| PathElement::new(vec![(x - 0.3, *y), (x + 0.3, *y)], BLACK.stroke_width(3))),
        )
        .map_err(err)?;
    if text {
        if !targets.is_empty() {
            drawn
                .label("target (at most)")
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK.stroke_width(3)));
        }
        legend(&mut chart, SeriesLabelPosition::UpperLeft)?;
    }
    root.present().map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plots_are_written() {
        let dir = std::env::temp_dir().join(format!("dprank-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let series = vec![
            ("a".to_string(), vec![(0.5, 10.0), (0.7, 30.0), (0.95, 900.0)]),
            ("b".to_string(), vec![(0.5, 12.0), (0.7, f64::NAN), (0.95, 400.0)]),
        ];
        lines(&dir.join("l.png"), "t", "load", "ms", &series, true).unwrap();
        lines(&dir.join("g.png"), "t", "load", "share", &series, false).unwrap();
        let samples = vec![LoadSample {
            t_s: 1.0,
            tokens: vec![1, 2, 3, 4],
            waiting: vec![0; 4],
            cache_hit_rate: vec![f64::NAN; 4],
        }];
        let panels = [
            RankPanel {
                samples: &samples,
                caption: "x".into(),
            },
            RankPanel {
                samples: &samples,
                caption: "y".into(),
            },
        ];
        rank_tokens(&dir.join("r.png"), &panels, 4).unwrap();
        let point = |x, median| RatioPoint {
            x,
            median,
            lo: median - 0.05,
            hi: median + 0.1,
        };
        let ratio_series = vec![
            ("a".to_string(), vec![point(1.0, 1.0), point(4.0, 1.2)]),
            ("b".to_string(), vec![point(4.0, f64::NAN), point(8.0, 1.4)]),
        ];
        ratios(
            &dir.join("q.png"),
            "t",
            "gateways",
            "ratio",
            &ratio_series,
            &[(4.0, 1.15)],
            1.3,
        )
        .unwrap();
        for f in ["l.png", "g.png", "r.png", "q.png"] {
            assert!(std::fs::metadata(dir.join(f)).unwrap().len() > 1000, "{f}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
