//! `gateways-figure`: TTFT p99 of stored runs divided by a reference
//! variant's, paired by seed, against the number of gateways each variant
//! ran behind (bench-results/legacy-model/results.md, "Several gateways"). It runs nothing: it
//! reads the `runs.jsonl` of finished suites.

use std::path::{Path, PathBuf};

use clap::Args;

use crate::plot::{self, RatioPoint};
use crate::report;
use crate::runner::{ResultsFile, RunRecord};
use crate::stats::{median, paired_ratio};
use crate::variant::Variant;

#[derive(Debug, Clone, Args)]
pub struct GatewaysFigureArgs {
    /// `LABEL;DIR;VARIANT,VARIANT,...[;REFERENCE]`: one line of the
    /// figure, from DIR/runs.jsonl, divided by REFERENCE (default
    /// `--reference`; repeat for more lines).
    #[arg(long = "series", required = true)]
    series: Vec<String>,
    /// The variant ratios divide by, in each DIR, unless a series names its own.
    #[arg(long, default_value = "dprank")]
    reference: String,
    /// `GATEWAYS=RATIO`: a target to draw (repeat for more).
    #[arg(long = "target")]
    targets: Vec<String>,
    /// Top of the ratio axis: intervals above it are cut there and their top written beside them.
    #[arg(long, default_value_t = 2.6)]
    y_max: f64,
    #[arg(long, default_value = "bench-results/legacy-model/gateways-ttft-p99.png")]
    out: PathBuf,
}

/// One `--series`, parsed.
#[derive(Debug, Clone, PartialEq)]
struct SeriesSpec {
    label: String,
    dir: PathBuf,
    variants: Vec<String>,
    reference: Option<String>,
}

fn parse_series(spec: &str) -> Result<SeriesSpec, String> {
    let parts: Vec<&str> = spec.split(';').collect();
    let (label, dir, variants, reference) = match parts.as_slice() {
        [label, dir, variants] => (label, dir, variants, None),
        [label, dir, variants, reference] if !reference.trim().is_empty() => {
            (label, dir, variants, Some(reference.trim().to_string()))
        }
        _ => {
            return Err(format!(
                "--series `{spec}`: expected LABEL;DIR;VARIANT,VARIANT,...[;REFERENCE]"
            ))
        }
    };
    let variants: Vec<String> = variants
        .split(',')
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .map(String::from)
        .collect();
    if label.trim().is_empty() || dir.trim().is_empty() || variants.is_empty() {
        return Err(format!(
            "--series `{spec}`: label, directory and at least one variant are needed"
        ));
    }
    Ok(SeriesSpec {
        label: label.trim().to_string(),
        dir: PathBuf::from(dir.trim()),
        variants,
        reference,
    })
}

fn parse_target(spec: &str) -> Result<(f64, f64), String> {
    let bad = || format!("--target `{spec}`: expected GATEWAYS=RATIO, e.g. 4=1.15");
    let (x, y) = spec.split_once('=').ok_or_else(bad)?;
    let x: f64 = x.trim().parse().map_err(|_| bad())?;
    let y: f64 = y.trim().parse().map_err(|_| bad())?;
    (x >= 1.0 && y > 0.0).then_some((x, y)).ok_or_else(bad)
}

/// The points of one series: each variant's TTFT p99 ÷ the reference's,
/// at the variant's number of gateways, with the median polls per second
/// per worker it measured. The runs must form one of the reports' groups
/// (`report::group`: one workload, KV size, rate and time scale).
fn points(
    records: &[RunRecord],
    spec: &SeriesSpec,
    reference: &str,
) -> Result<Vec<(RatioPoint, f64)>, String> {
    let groups = report::group(records);
    let wanted = |v: &str| v == reference || spec.variants.iter().any(|s| s == v);
    let mut holding = groups
        .iter()
        .filter(|g| g.variants.iter().any(|(v, _)| wanted(v)));
    let no_reference = || format!("{}: no runs of the reference `{reference}`", spec.dir.display());
    let group = holding.next().ok_or_else(no_reference)?;
    if holding.next().is_some() {
        return Err(format!(
            "{}: the runs of these variants span several workloads, KV sizes, rates or time scales; keep one regime per directory",
            spec.dir.display()
        ));
    }
    let runs_of = |name: &str| {
        group
            .variants
            .iter()
            .find(|(v, _)| v == name)
            .map_or(&[][..], |(_, runs)| runs.as_slice())
    };
    let base = report::per_seed(runs_of(reference), |r| r.ttft_p99);
    if base.is_empty() {
        return Err(no_reference());
    }
    spec.variants
        .iter()
        .map(|name| {
            let gateways = Variant::parse(name)?.gateways as f64;
            let runs = runs_of(name);
            let ratio = paired_ratio(&report::per_seed(runs, |r| r.ttft_p99), &base).ok_or_else(|| {
                format!(
                    "{}: no seed of `{name}` pairs with `{reference}`",
                    spec.dir.display()
                )
            })?;
            let mut polls = report::values(runs, |r| r.load_polls_per_worker_s);
            polls.retain(|p| p.is_finite());
            let point = RatioPoint {
                x: gateways,
                median: ratio.median,
                lo: ratio.lo,
                hi: ratio.hi,
            };
            Ok((point, median(&polls)))
        })
        .collect()
}

fn load(dir: &Path) -> Result<Vec<RunRecord>, String> {
    let records = ResultsFile::new(&dir.join("runs.jsonl")).load()?;
    if records.is_empty() {
        return Err(format!("{}: no runs.jsonl, or no runs in it", dir.display()));
    }
    Ok(records)
}

pub fn gateways_figure(args: &GatewaysFigureArgs) -> Result<(), String> {
    let specs = args
        .series
        .iter()
        .map(|s| parse_series(s))
        .collect::<Result<Vec<_>, _>>()?;
    let targets = args
        .targets
        .iter()
        .map(|t| parse_target(t))
        .collect::<Result<Vec<_>, _>>()?;
    let mut series = Vec::new();
    println!("| series | variant | gateways | TTFT p99 ÷ the reference's | polls/s per worker |");
    println!("|---|---|---|---|---|");
    for spec in &specs {
        let records = load(&spec.dir)?;
        let reference = spec.reference.as_deref().unwrap_or(&args.reference);
        let found = points(&records, spec, reference)?;
        for (variant, (p, polls)) in spec.variants.iter().zip(&found) {
            println!(
                "| {} | `{variant}` | {} | {:.2} [{:.2}, {:.2}] (÷ `{reference}`) | {polls:.1} |",
                spec.label, p.x, p.median, p.lo, p.hi
            );
        }
        series.push((spec.label.clone(), found.into_iter().map(|(p, _)| p).collect()));
    }
    plot::ratios(
        &args.out,
        "TTFT p99 ÷ one gateway's, paired by seed: median over seeds, 95% interval",
        "gateways sharing the fleet",
        "TTFT p99 ratio",
        &series,
        &targets,
        args.y_max,
    )?;
    println!("wrote {}", args.out.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_and_targets_parse_or_say_why_not() {
        let s = parse_series("tenants;bench-results/x;dprank, dprank:gw=4:set.gateways=4").unwrap();
        assert_eq!(s.label, "tenants");
        assert_eq!(s.dir, PathBuf::from("bench-results/x"));
        assert_eq!(s.variants, ["dprank", "dprank:gw=4:set.gateways=4"]);
        assert_eq!(s.reference, None);
        let own = parse_series("a;b;smg:gw=4;smg").unwrap();
        assert_eq!(own.reference.as_deref(), Some("smg"));
        for bad in ["tenants;dir", ";dir;dprank", "a;b;,", "a;b;c;", "a;b;c;d;e"] {
            assert!(parse_series(bad).unwrap_err().contains("--series"), "{bad}");
        }
        assert_eq!(parse_target("4=1.15").unwrap(), (4.0, 1.15));
        for bad in ["4", "x=1", "0=1.1", "4=-1"] {
            assert!(parse_target(bad).unwrap_err().contains("GATEWAYS=RATIO"), "{bad}");
        }
    }

    fn record(variant: &str, seed: u64, p99: f64, workload: &str) -> RunRecord {
        RunRecord {
            workload: workload.into(),
            ..crate::report::tests::record(variant, seed, p99, 10.0)
        }
    }

    #[test]
    fn ratios_pair_by_seed_at_the_variants_gateways() {
        let mut records = Vec::new();
        for seed in 1..=5 {
            records.push(record("dprank", seed, 100.0, "tenants"));
            records.push(record("dprank:gw=4", seed, 100.0 + 10.0 * seed as f64, "tenants"));
        }
        let spec = parse_series("t;d;dprank,dprank:gw=4").unwrap();
        let found = points(&records, &spec, "dprank").unwrap();
        assert_eq!((found[0].0.x, found[0].0.median), (1.0, 1.0));
        assert_eq!(found[1].0.x, 4.0);
        assert!((found[1].0.median - 1.3).abs() < 1e-9, "{:?}", found[1]);
        assert!(found[1].0.lo <= 1.3 && found[1].0.hi >= 1.3);

        let missing = parse_series("t;d;dprank:gw=8").unwrap();
        assert!(points(&records, &missing, "dprank")
            .unwrap_err()
            .contains("pairs"));
        records.push(record("dprank:gw=4", 9, 1.0, "chat"));
        assert!(points(&records, &spec, "dprank")
            .unwrap_err()
            .contains("one regime"));
    }
}
