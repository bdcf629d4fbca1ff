//! `dprank-bench demo` (`make demo`): one seeded trace through Envoy round
//! robin, then through Envoy + dprank, each on a fresh simulated fleet, and
//! what differs side by side: tokens per rank over time and TTFT, in the
//! terminal and as a PNG.
//!
//! The seed fixes the requests (lengths, text, arrival times), not where
//! they go: Envoy spreads connections over its worker threads, each with its
//! own round robin, and dprank routes on the loads it polled, which depend on
//! timing. Counts per rank vary a little from run to run (measured: by one
//! request per rank for round robin) and the demo says so.

use std::fmt::Write as _;
use std::path::PathBuf;

use clap::Args;

use crate::fleet::Tools;
use crate::loadgen::LoadSample;
use crate::plot::{self, RankPanel};
use crate::preset::Kv;
use crate::runner::{run_cell, Cell, CellRun, FleetShape, Skipped};
use crate::variant::{SimFeatures, Variant};
use crate::workload::{Workload, WorkloadKind};

#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Requests per simulated second: about 90% of what the small-KV fleet
    /// serves (`dprank-bench capacity`), where the spread of tokens over
    /// ranks decides the queueing.
    #[arg(long, default_value_t = 10.0)]
    pub rate: f64,
    /// Simulated seconds of arrivals.
    #[arg(long, default_value_t = 60.0)]
    pub duration: f64,
    #[arg(long, default_value_t = 5.0)]
    pub time_scale: f64,
    /// Where the PNG goes.
    #[arg(long, default_value = ".dprank/demo")]
    pub out: PathBuf,
}

const SHADES: [char; 9] = [' ', '▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];
const COLUMNS: usize = 30;

/// Mean tokens of rank `rank` per time column, `columns` columns over [0, end_s).
pub fn columns(samples: &[LoadSample], rank: usize, end_s: f64, columns: usize) -> Vec<f64> {
    let mut sums = vec![0.0; columns];
    let mut counts = vec![0usize; columns];
    for s in samples {
        let Some(tokens) = s.tokens.get(rank) else {
            continue;
        };
        let column = ((s.t_s / end_s) * columns as f64) as usize;
        if column < columns {
            sums[column] += *tokens as f64;
            counts[column] += 1;
        }
    }
    sums.iter()
        .zip(&counts)
        .map(|(s, c)| if *c > 0 { s / *c as f64 } else { 0.0 })
        .collect()
}

/// One character per value, shaded against `max`.
pub fn shade(values: &[f64], max: f64) -> String {
    values
        .iter()
        .map(|v| {
            let level = if max > 0.0 {
                (v / max * 8.0).round() as usize
            } else {
                0
            };
            SHADES[level.min(8)]
        })
        .collect()
}

pub async fn demo(tools: &Tools, args: &DemoArgs) -> Result<(), String> {
    let features = SimFeatures::detect(&tools.sim)?;
    let fleet = FleetShape::default();
    let legacy = crate::preset::preset("legacy")?;
    let (slo, _) = crate::slo::resolve(legacy)?;
    let provenance = crate::provenance::Provenance::current(&tools.root, "dprank-bench demo");
    let workload = Workload::new(WorkloadKind::NoPrefix);
    println!(
        "dprank demo: seed {} — {} simulated s of streamed /generate requests at {} req/s (Poisson arrivals, ShareGPT-like lengths) on {} simulated workers x {} ranks ({}), simulated time {}x faster than wall time.\n",
        args.seed,
        args.duration,
        args.rate,
        fleet.workers,
        fleet.dp_size,
        legacy.describe_kv(Kv::Small),
        args.time_scale
    );
    let mut runs: Vec<(&str, CellRun)> = Vec::new();
    for (title, spec) in [("Envoy round robin", "rr"), ("Envoy + dprank", "dprank")] {
        println!("== the trace through {title}");
        let cell = Cell {
            suite: "demo".into(),
            workload: workload.clone(),
            variant: Variant::parse(spec)?,
            seed: args.seed,
            kv: Kv::Small,
            preset: legacy,
            rate: args.rate,
            load: None,
            warmup_s: 0.0,
            duration_s: args.duration,
            nominal_duration_s: args.duration,
            time_scale: args.time_scale,
            fleet,
            slo,
            capacity: None,
            provenance: provenance.clone(),
            high_share: None,
        };
        match run_cell(tools, &features, &cell, true).await? {
            Ok(run) => runs.push((title, run)),
            Err(Skipped(reason)) => return Err(format!("{title} cannot run: {reason}")),
        }
    }
    let end_s = args.duration;
    let max = runs
        .iter()
        .flat_map(|(_, r)| {
            r.samples
                .iter()
                .filter(|s| s.t_s < end_s)
                .flat_map(|s| s.tokens.iter().copied())
        })
        .max()
        .unwrap_or(1) as f64;
    let mut out = String::new();
    let _ = writeln!(out, "\n{:<18}{:<w$}{}", "", runs[0].0, runs[1].0, w = COLUMNS + 6);
    let line = |label: &str, f: &dyn Fn(&CellRun) -> String| -> String {
        format!(
            "{label:<18}{:<w$}{}\n",
            f(&runs[0].1),
            f(&runs[1].1),
            w = COLUMNS + 6
        )
    };
    out.push_str(&line("TTFT p50 / p99", &|r| {
        format!("{:.0} / {:.0} ms", r.record.ttft_p50, r.record.ttft_p99)
    }));
    out.push_str(&line("goodput", &|r| {
        format!("{:.1} %", r.record.goodput * 100.0)
    }));
    out.push_str(&line("rank imbalance", &|r| {
        r.record
            .imbalance
            .map_or("–".into(), |v| format!("{v:.2} (max/mean tokens)"))
    }));
    out.push_str(&line("errors", &|r| r.record.errors.to_string()));
    let _ = writeln!(
        out,
        "\nrequests served per rank (worker 0 ranks 0-{}, then worker 1):",
        fleet.dp_size - 1
    );
    out.push_str(&line("", &|r| {
        r.record
            .served_per_rank
            .iter()
            .map(|n| format!("{n:>3}"))
            .collect::<Vec<_>>()
            .join(" ")
    }));
    let _ = writeln!(
        out,
        "\ntokens per rank over time (each column {:.0} simulated s; full block = {max:.0} tokens):",
        end_s / COLUMNS as f64
    );
    let ranks = runs[0].1.samples.first().map_or(0, |s| s.tokens.len());
    for rank in 0..ranks {
        let label = format!("worker {} rank {}", rank / fleet.dp_size, rank % fleet.dp_size);
        let _ = writeln!(
            out,
            "{label:<18}{:<w$}{}",
            shade(&columns(&runs[0].1.samples, rank, end_s, COLUMNS), max),
            shade(&columns(&runs[1].1.samples, rank, end_s, COLUMNS), max),
            w = COLUMNS + 6
        );
    }
    let (rr, dp) = (&runs[0].1.record, &runs[1].1.record);
    let _ = writeln!(
        out,
        "\nTTFT p99: dprank {:.0} ms vs round robin {:.0} ms = {:.2}x (latencies in simulated ms; one seed, one run: `make bench` gives intervals over seeds)",
        dp.ttft_p99,
        rr.ttft_p99,
        dp.ttft_p99 / rr.ttft_p99
    );
    let _ = writeln!(
        out,
        "Seeded: the same seed sends the same requests at the same times. Which rank serves each is not: Envoy spreads connections over its worker threads, each with its own round robin, and dprank routes on polled loads, which depend on timing; so counts per rank vary a little from run to run."
    );
    print!("{out}");
    std::fs::create_dir_all(&args.out).map_err(|e| format!("cannot create {}: {e}", args.out.display()))?;
    let png = args.out.join("demo.png");
    let panels: Vec<RankPanel> = runs
        .iter()
        .map(|(title, r)| RankPanel {
            samples: &r.samples,
            caption: format!(
                "{title}: TTFT p99 {:.0} ms, imbalance {:.2}",
                r.record.ttft_p99,
                r.record.imbalance.unwrap_or(f64::NAN)
            ),
        })
        .collect();
    plot::rank_tokens(&png, &panels, fleet.dp_size)?;
    println!("PNG (tokens per rank over time, side by side): {}", png.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(t_s: f64, tokens: Vec<u64>) -> LoadSample {
        LoadSample {
            t_s,
            waiting: vec![0; tokens.len()],
            cache_hit_rate: vec![f64::NAN; tokens.len()],
            tokens,
        }
    }

    #[test]
    fn columns_average_and_shades_scale() {
        let samples = vec![
            sample(0.5, vec![10, 0]),
            sample(1.5, vec![30, 0]),
            sample(2.5, vec![80, 8]),
        ];
        assert_eq!(columns(&samples, 0, 4.0, 2), vec![20.0, 80.0]);
        assert_eq!(columns(&samples, 1, 4.0, 4), vec![0.0, 0.0, 8.0, 0.0]);
        assert_eq!(shade(&[0.0, 40.0, 80.0], 80.0), " ▄█");
        assert_eq!(shade(&[5.0], 0.0), " ");
    }
}
